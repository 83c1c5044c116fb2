//! Embedding a corpus of 5,000 sentences of varying length on a simulated GPU, in chunks
//! budgeted by tokens: chunks of short sentences hold more of them. Part-way, another process
//! takes half of the device; the chunk that ran out of memory is redone smaller from its own
//! start, and the 3,000 sentences already embedded are kept.
//!
//! ```text
//! cargo run -p batch-size-examples --example embed_corpus
//! ```

use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{memory::SimulatedDevice, Chunked};

const BYTES_PER_TOKEN: u64 = 256 << 10; // activations of one token through the encoder
const DIMENSIONS: usize = 8;

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();
    // Sentence lengths from 4 to 130 tokens, deterministic.
    let lengths: Vec<u64> = (0..5000u64).map(|i| 4 + (i * 7919 + i / 3) % 127).collect();
    let tokens: u64 = lengths.iter().sum();
    let device = SimulatedDevice::new(4 << 30); // 4 GiB
    println!(
        "{} sentences, {tokens} tokens; {} of activations a token; {} device.\n",
        lengths.len(),
        Bytes(BYTES_PER_TOKEN),
        Bytes(device.capacity())
    );

    let mut other_process = None;
    let mut chunked = Chunked::new(lengths.len())
        .with_starting(32_768) // tokens in the first chunk
        .with_cost(|sentence| lengths[sentence])
        .with_release(device.clone())
        .on_chunk(|progress| {
            if progress.completed % 1000 < 200 || progress.completed == progress.total {
                println!(
                    "  {:>5} / {} sentences embedded ({} chunk(s) retried)",
                    progress.completed, progress.total, progress.retries
                );
            }
        });
    let embeddings = chunked.run(|sentences| -> anyhow::Result<Vec<[f32; DIMENSIONS]>> {
        if sentences.start >= 3000 && other_process.is_none() {
            println!("  (another process takes 2 GiB of the device)");
            other_process = Some(device.alloc(2 << 30)?);
        }
        let chunk_tokens: u64 = sentences.clone().map(|s| lengths[s]).sum();
        let _activations = device.alloc(chunk_tokens * BYTES_PER_TOKEN)?;
        // A stand-in encoder: one vector per sentence.
        Ok(sentences
            .map(|s| std::array::from_fn(|d| ((s * (d + 1)) % 97) as f32 / 97.0))
            .collect())
    })?;
    drop(other_process);

    let chunks = chunked.chunks();
    let retried: Vec<_> = chunks.iter().filter(|chunk| !chunk.done).collect();
    println!(
        "\n{} embeddings of {DIMENSIONS} dimensions, in {} chunks; {} ran out of memory and were \
         redone smaller:",
        embeddings.len(),
        chunks.iter().filter(|chunk| chunk.done).count(),
        retried.len()
    );
    for chunk in retried {
        println!(
            "  sentences {:?}: {} tokens did not fit",
            chunk.range, chunk.cost
        );
    }
    let sizes: Vec<usize> = chunks
        .iter()
        .filter(|chunk| chunk.done)
        .map(|chunk| chunk.range.len())
        .collect();
    println!(
        "Sentences per chunk: from {} to {}; each sentence embedded once, in order.",
        sizes.iter().min().unwrap_or(&0),
        sizes.iter().max().unwrap_or(&0)
    );
    Ok(())
}
