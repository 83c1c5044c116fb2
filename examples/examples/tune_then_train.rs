//! Tune, then train: a few short trials find the largest batch size before training starts and
//! time themselves (samples per second by size: past a point a larger batch is no faster), the
//! training starts from the size chosen, and a second run of the program starts from the cache
//! instead of tuning again.
//!
//! ```text
//! cargo run -p batch-size-examples --example tune_then_train
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::SimulatedDevice, Choice, Tuner,
};

const SEQUENCE: u64 = 512; // tokens in the longest sequence of the dataset
const BYTES_PER_TOKEN: u64 = 96 << 10;

/// One training step at `batch_size`, on the longest sequences: the worst case. The simulated
/// device is busy from 64 samples on: a step takes 40 ms up to 64, then longer in proportion.
fn step(device: &SimulatedDevice, batch_size: usize, micros: &AtomicU64) -> anyhow::Result<()> {
    let _weights = device.alloc(3 << 30)?; // weights, gradients, optimizer state
    let _activations = device.alloc(batch_size as u64 * SEQUENCE * BYTES_PER_TOKEN)?;
    micros.fetch_add(40_000 * batch_size.max(64) as u64 / 64, Ordering::Relaxed);
    Ok(())
}

#[find_executable_batch_size(starting = starting, release = device.clone())]
fn train(
    batch_size: usize,
    starting: usize,
    device: &SimulatedDevice,
    micros: &AtomicU64,
) -> anyhow::Result<usize> {
    step(device, batch_size, micros)?; // the whole training loop, here one step
    Ok(batch_size)
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();
    let device = SimulatedDevice::new(24 << 30);
    let cache_dir = std::env::temp_dir().join("batch-size-example-cache");
    let _ = std::fs::remove_dir_all(&cache_dir); // a first run, for the example

    // The simulated device's time; on a real one, leave the default (the wall clock), or give a
    // clock that synchronizes the device first.
    let micros = Arc::new(AtomicU64::new(0));
    let clock = Arc::clone(&micros);

    for run in 1..=2 {
        batch_size_runtime::policy::clear_process_cache(); // as a new process would start
        let clock = Arc::clone(&clock);
        let tuned = Tuner::new()
            .with_release(device.clone())
            .with_cache("gpt-small, 512 tokens")
            .with_cache_dir(&cache_dir)
            .choose(Choice::Fastest)
            .with_clock(move || Duration::from_micros(clock.load(Ordering::Relaxed)))
            .run(|batch_size| step(&device, batch_size, &micros))?;
        let trials: Vec<String> = tuned
            .report()
            .attempts()
            .map(|trial| {
                format!(
                    "{}{}",
                    trial.batch_size,
                    if trial.outcome.is_success() {
                        ""
                    } else {
                        "✗"
                    }
                )
            })
            .collect();
        println!(
            "run {run}: tuned to {} in {} trial(s): {}",
            tuned.batch_size(),
            tuned.report().len(),
            trials.join(" ")
        );
        println!(
            "       fastest {}, largest {} (5 % below {}, the largest that ran)",
            tuned.fastest(),
            tuned.largest(),
            tuned.largest_fit()
        );
        println!("       size  samples/s");
        for (size, rate) in tuned.throughput() {
            println!("       {size:>4}  {rate:>9.0}");
        }
        let trained = train(tuned.batch_size(), &device, &micros)?;
        println!(
            "       trained with {trained}, in {} attempt(s)",
            last_report().map_or(0, |report| report.len())
        );
    }
    println!("\nThe cache: {}", cache_dir.display());
    Ok(())
}
