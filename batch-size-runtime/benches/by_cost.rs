//! Work whose items differ in cost, on the simulated device: the peers' way, the safe manual way
//! and this crate side by side, on the same seeds (`tests/common/lengths.rs` draws the lengths
//! and holds the memory function and the oracle).
//!
//! `cargo bench -p batch-size-runtime --bench by_cost`
//!
//! - training: 2,000 steps of 64 sequences, lengths heavy-tailed (a median of 300 tokens, a tail
//!   to 8,192), attention's square term, on a 24 GiB device with 8 GiB held;
//! - an embedding pass over 100,000 documents of the same lengths on an 8 GiB device;
//! - the same corpus with its longest documents last.
//!
//! The peers' way: a size found on the first batches (from 64 sequences or 512 documents),
//! cut by ×0.9 after each failure and the batch run again, items in the caller's order. The
//! safe manual way: the size that fits the longest item. The oracle knows the memory function
//! and groups items by length: the fewest passes (or chunks). A benchmark measures; it asserts
//! nothing.

#![allow(clippy::expect_used)] // the shared workload's held state is sized to fit

use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::{BatchCost, Chunked, EffectiveBatch};

#[path = "../tests/common/lengths.rs"]
mod lengths;
use lengths::{Lengths, Model, ENCODER, TRANSFORMER};

const STEPS: usize = 2_000;
const SEQUENCES: usize = 64;
const DOCUMENTS: usize = 100_000;
const SEEDS: [u64; 3] = [7, 8, 9];

/// What one way did over a run.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    failures: usize,
    /// Failures after the first 20 steps (or chunks).
    late: usize,
    passes: usize,
    oracle: usize,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.failures += other.failures;
        self.late += other.late;
        self.passes += other.passes;
        self.oracle += other.oracle;
    }
}

/// The peers' way over one step's items in order: micro-batches of `micro` items; after an
/// out-of-memory the micro size is cut by ×0.9 and the step runs again.
fn peers_step(
    model: Model,
    device: &SimulatedDevice,
    batch: &[u64],
    micro: &mut usize,
) -> (usize, usize) {
    let mut failures = 0;
    loop {
        let items: Vec<usize> = (0..batch.len()).collect();
        let ran = items
            .chunks(*micro)
            .try_for_each(|chunk| model.run(device, batch, chunk));
        if ran.is_ok() {
            return (failures, batch.len().div_ceil(*micro));
        }
        failures += 1;
        *micro = ((*micro as f64 * 0.9) as usize).max(1);
    }
}

fn train_peers(seed: u64) -> Tally {
    let (device, _held) = TRANSFORMER.device();
    let mut lengths = Lengths::heavy_tailed(seed);
    let (mut tally, mut micro) = (Tally::default(), SEQUENCES);
    for step in 0..STEPS {
        let batch = lengths.batch(SEQUENCES);
        let (failures, passes) = peers_step(TRANSFORMER, &device, &batch, &mut micro);
        tally.failures += failures;
        tally.late += if step >= 20 { failures } else { 0 };
        tally.passes += passes;
        tally.oracle += TRANSFORMER.fewest_passes(&batch);
    }
    tally
}

/// The size that fits the longest item.
fn safe_size(model: Model, longest: u64) -> usize {
    (1..)
        .take_while(|&n| model.fits(n, longest))
        .last()
        .unwrap_or(1)
}

fn train_safe(seed: u64) -> Tally {
    let mut lengths = Lengths::heavy_tailed(seed);
    let micro = safe_size(TRANSFORMER, lengths.longest);
    let mut tally = Tally::default();
    for _ in 0..STEPS {
        let batch = lengths.batch(SEQUENCES);
        tally.passes += batch.len().div_ceil(micro);
        tally.oracle += TRANSFORMER.fewest_passes(&batch);
    }
    tally
}

fn train_crate(seed: u64, shape: BatchCost, cache: Option<&std::path::Path>) -> Tally {
    let (device, _held) = TRANSFORMER.device();
    let mut runner = EffectiveBatch::new(SEQUENCES)
        .with_release(device.clone())
        .with_batch_cost(shape);
    if let Some(folder) = cache {
        runner = runner
            .with_cache(format!("bench {seed}"))
            .with_cache_dir(folder);
    }
    let mut lengths = Lengths::heavy_tailed(seed);
    let mut tally = Tally::default();
    for step in 0..STEPS {
        let batch = lengths.batch(SEQUENCES);
        let mut passes = 0;
        let ran = runner.step_by_cost(&batch, |plan| -> anyhow::Result<()> {
            for micro in plan.micro_batches() {
                TRANSFORMER.run(&device, &batch, &micro.items)?;
            }
            passes = plan.accumulation();
            Ok(())
        });
        if let Err(error) = ran {
            println!("  (step {step} stopped: {error})");
            break;
        }
        let failures = runner.last_step_report().out_of_memory_count();
        tally.failures += failures;
        tally.late += if step >= 20 { failures } else { 0 };
        tally.passes += passes;
        tally.oracle += TRANSFORMER.fewest_passes(&batch);
    }
    tally
}

fn corpus(seed: u64, longest_last: bool) -> Vec<u64> {
    let mut lengths = Lengths::heavy_tailed(seed).batch(DOCUMENTS);
    if longest_last {
        lengths.sort_unstable();
    }
    lengths
}

/// The peers' way over a corpus in its order: chunks of `n` documents from 512, ×0.9 after
/// each failure.
fn embed_peers(lengths: &[u64]) -> Tally {
    let (device, _held) = ENCODER.device();
    let (mut tally, mut size, mut done, mut chunk) = (Tally::default(), 512usize, 0, 0);
    while done < lengths.len() {
        let items: Vec<usize> = (done..(done + size).min(lengths.len())).collect();
        if ENCODER.run(&device, lengths, &items).is_ok() {
            done += items.len();
            tally.passes += 1;
        } else {
            tally.failures += 1;
            tally.late += usize::from(chunk >= 20);
            size = ((size as f64 * 0.9) as usize).max(1);
        }
        chunk += 1;
    }
    tally.oracle = ENCODER.fewest_passes(lengths);
    tally
}

fn embed_safe(lengths: &[u64]) -> Tally {
    let longest = lengths.iter().copied().max().unwrap_or(1);
    Tally {
        passes: lengths.len().div_ceil(safe_size(ENCODER, longest)),
        oracle: ENCODER.fewest_passes(lengths),
        ..Tally::default()
    }
}

fn embed_crate(lengths: &[u64], grouped: bool) -> Tally {
    let (device, _held) = ENCODER.device();
    let mut chunked = Chunked::new(lengths.len())
        .with_release(device.clone())
        .with_cost(|i| lengths[i]);
    let ran = if grouped {
        chunked
            .run_by_cost(|items| -> anyhow::Result<Vec<()>> {
                ENCODER.run(&device, lengths, items)?;
                Ok(vec![(); items.len()])
            })
            .map(drop)
    } else {
        chunked.for_each(|range| -> anyhow::Result<()> {
            let items: Vec<usize> = range.collect();
            Ok(ENCODER.run(&device, lengths, &items)?)
        })
    };
    if let Err(error) = ran {
        println!("  (stopped: {error})");
    }
    let records = chunked.chunks();
    let failed: Vec<usize> = (0..records.len()).filter(|&i| !records[i].done).collect();
    Tally {
        failures: failed.len(),
        late: failed.iter().filter(|&&i| i >= 20).count(),
        passes: chunked.chunk_count() - failed.len(),
        oracle: ENCODER.fewest_passes(lengths),
    }
}

fn row(way: &str, tally: Tally, unit: f64, gradients: &str) {
    println!(
        "| {way} | {} ({} after the first 20) | {:.2} ({:.3} of the oracle's {:.2}) | {gradients} |",
        tally.failures,
        tally.late,
        tally.passes as f64 / unit,
        tally.passes as f64 / tally.oracle.max(1) as f64,
        tally.oracle as f64 / unit,
    );
}

fn main() {
    let runs = SEEDS.len() as f64;
    println!("Training: {STEPS} steps of {SEQUENCES} sequences, seeds {SEEDS:?} (sums over the seeds; passes per step)\n");
    println!("| way | out-of-memory failures | passes per step | gradients |");
    println!("|---|---|---|---|");
    let sum = |f: &dyn Fn(u64) -> Tally| {
        let mut total = Tally::default();
        for seed in SEEDS {
            total.add(f(seed));
        }
        total
    };
    let steps = runs * STEPS as f64;
    row(
        "peers: first batches, ×0.9 a failure",
        sum(&train_peers),
        steps,
        "by samples",
    );
    row(
        "safe: the longest item's size",
        sum(&train_safe),
        steps,
        "by samples",
    );
    let square = BatchCost::padded().with_square_term(2_048);
    for (name, shape) in [
        ("as the model has it", square),
        ("2× too large", BatchCost::padded().with_square_term(1_024)),
        ("none", BatchCost::padded()),
    ] {
        let each: Vec<usize> = SEEDS
            .iter()
            .map(|&seed| train_crate(seed, shape, None).failures)
            .collect();
        println!("(this crate's failures by seed, square term declared {name}: {each:?})");
    }
    println!();
    row(
        "this crate, `step_by_cost`, square term as the model has it",
        sum(&|seed| train_crate(seed, square, None)),
        steps,
        "exact in tokens",
    );
    row(
        "this crate, square term declared 2× too large",
        sum(&|seed| train_crate(seed, BatchCost::padded().with_square_term(1_024), None)),
        steps,
        "exact in tokens",
    );
    row(
        "this crate, no square term declared",
        sum(&|seed| train_crate(seed, BatchCost::padded(), None)),
        steps,
        "exact in tokens",
    );
    let folder = std::env::temp_dir().join(format!("by-cost-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&folder);
    let _first = sum(&|seed| train_crate(seed, square, Some(&folder)));
    row(
        "this crate, a second run with the cache",
        sum(&|seed| train_crate(seed, square, Some(&folder))),
        steps,
        "exact in tokens",
    );
    let _ = std::fs::remove_dir_all(&folder);

    for (name, longest_last) in [
        ("in a random order", false),
        ("its longest documents last", true),
    ] {
        println!("\nEmbedding {DOCUMENTS} documents, {name}, seeds {SEEDS:?} (sums; chunks per corpus)\n");
        println!("| way | out-of-memory failures | chunks | |");
        println!("|---|---|---|---|");
        let corpora: Vec<Vec<u64>> = SEEDS
            .iter()
            .map(|&seed| corpus(seed + 20, longest_last))
            .collect();
        let sum = |f: &dyn Fn(&[u64]) -> Tally| {
            let mut total = Tally::default();
            for lengths in &corpora {
                total.add(f(lengths));
            }
            total
        };
        row(
            "peers: first chunks, ×0.9 a failure",
            sum(&embed_peers),
            runs,
            "caller's order",
        );
        row(
            "safe: the longest item's size",
            sum(&embed_safe),
            runs,
            "caller's order",
        );
        row(
            "this crate, `run` with `with_cost` (caller's order)",
            sum(&|lengths| embed_crate(lengths, false)),
            runs,
            "caller's order",
        );
        row(
            "this crate, `run_by_cost` (grouped by cost)",
            sum(&|lengths| embed_crate(lengths, true)),
            runs,
            "outputs in the caller's order",
        );
    }
}
