//! candle on the CPU, an encoder's forward pass (embeddings, attention scores, a feed-forward
//! layer, mean pooling) over documents of very unequal lengths, with `Chunked::run_by_cost`:
//! the documents grouped by length, each chunk filled to a budget of padded tokens that the run
//! learns from each chunk's figures, every chunk run in a child process under a resident budget
//! (a failed allocation aborts a candle CPU process: the child's abort is an out-of-memory the
//! run redoes smaller). The test asserts that every document is embedded once, in the caller's
//! order, that at most 3 chunks run out of memory, none after the 20th, and prints the chunks.
//!
//! Ignored: a debug build's matrix products make each child slow. Run it in release:
//! `cargo test --release -p batch-size-examples --test candle_cpu_child_embed -- --ignored --exact linux::corpus_embedded_by_cost --nocapture`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

#[cfg(target_os = "linux")]
mod linux {
    use batch_size_runtime::{BatchCost, ChildTrial, Chunked};
    use candle_core::{Device, Tensor, D};

    /// The resident memory each child may hold in all, its start included.
    const RESIDENT_BUDGET: u64 = 128 << 20;
    const DIMENSIONS: usize = 128;
    const VOCABULARY: usize = 1000;
    /// A chunk's shape travels as one number: items × SHAPE + the longest item's tokens.
    const SHAPE: usize = 1 << 16;

    fn trial() -> ChildTrial {
        ChildTrial::new("encode")
            .with_args(["--exact", "linux::child_encode", "--ignored"])
            .with_resident_limit(RESIDENT_BUDGET)
    }

    /// The encoder's forward pass over `items` documents padded to `longest` tokens: what each
    /// chunk's child runs. Activations: the embeddings, the feed-forward's hidden states (4 ×
    /// wider) and one head's attention scores (`longest²` a document).
    fn encode(items: usize, longest: usize) -> candle_core::Result<f32> {
        let device = Device::Cpu;
        let table = Tensor::randn(0f32, 1.0, (VOCABULARY, DIMENSIONS), &device)?;
        let up = Tensor::randn(0f32, 0.05, (DIMENSIONS, 4 * DIMENSIONS), &device)?;
        let down = Tensor::randn(0f32, 0.05, (4 * DIMENSIONS, DIMENSIONS), &device)?;
        let ids: Vec<u32> = (0..items * longest)
            .map(|token| (token % VOCABULARY) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, items * longest, &device)?;
        let hidden = table
            .embedding(&ids)?
            .reshape((items, longest, DIMENSIONS))?;
        let scores = hidden
            .matmul(&hidden.transpose(1, 2)?)?
            .affine(1.0 / (DIMENSIONS as f64).sqrt(), 0.0)?;
        let shifted = scores
            .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
            .exp()?;
        let attention = shifted.broadcast_div(&shifted.sum_keepdim(D::Minus1)?)?;
        let mixed = attention.matmul(&hidden)?;
        let flat = mixed.reshape((items * longest, DIMENSIONS))?;
        let wide = flat.matmul(&up)?.relu()?;
        let out = wide.matmul(&down)?.reshape((items, longest, DIMENSIONS))?;
        let pooled = out.mean(D::Minus2)?;
        pooled.sum_all()?.to_scalar::<f32>()
    }

    #[test]
    #[ignore = "a child process of corpus_embedded_by_cost: run by it with --ignored"]
    fn child_encode() {
        if trial().is_child() {
            std::env::set_var("RUST_BACKTRACE", "0");
        }
        trial().serve(|shape| -> anyhow::Result<()> {
            let total = encode(shape / SHAPE, shape % SHAPE)?;
            anyhow::ensure!(total.is_finite(), "the embeddings are not finite");
            Ok(())
        });
        panic!("run only as a ChildTrial's child: it sets the chunk's shape");
    }

    /// Lengths from 8 to 1,536 tokens, most short, a few long (deterministic).
    fn lengths(documents: usize) -> Vec<u64> {
        (0..documents as u64)
            .map(|i| {
                let draw = (i * 2_654_435_761) % 1000;
                match draw {
                    0..=899 => 8 + (i * 7919) % 120,
                    900..=979 => 128 + (i * 104_729) % 384,
                    _ => 512 + (i * 15_485_863) % 1024,
                }
            })
            .collect()
    }

    #[test]
    #[ignore = "candle's matrix products in a child per chunk: run in release, by hand"]
    fn corpus_embedded_by_cost() {
        let trial = trial();
        let lengths = lengths(3_000);
        let mut chunked = Chunked::new(lengths.len())
            .with_release(trial.memory())
            .with_cost(|i| lengths[i])
            // One head's scores (longest² a document) against 4 × 128 + 128 floats a token.
            .with_batch_cost(BatchCost::padded().with_square_term(640));
        let embedded = chunked
            .run_by_cost(
                |items| -> Result<Vec<usize>, batch_size_runtime::ChildTrialError> {
                    let longest = items.iter().map(|&i| lengths[i]).max().unwrap_or(1) as usize;
                    trial.run(items.len() * SHAPE + longest)?;
                    Ok(items.to_vec())
                },
            )
            .unwrap();
        assert_eq!(embedded, (0..lengths.len()).collect::<Vec<_>>());
        let records = chunked.chunks();
        let failed: Vec<usize> = (0..records.len()).filter(|&i| !records[i].done).collect();
        println!(
            "{} documents, {} tokens, in {} chunks; out of memory at chunks {failed:?}",
            lengths.len(),
            lengths.iter().sum::<u64>(),
            records.len() - failed.len()
        );
        for record in records {
            println!(
                "  {} documents, padded cost {}, budget {}, {}",
                record.range.len(),
                record.cost,
                record.budget,
                if record.done { "done" } else { "out of memory" }
            );
        }
        // The target for a corpus: at most 3 out-of-memory chunks, none after the 20th.
        assert!(
            failed.len() <= 3 && failed.iter().all(|&chunk| chunk < 20),
            "out of memory at chunks {failed:?}"
        );
    }
}
