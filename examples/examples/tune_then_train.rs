//! Tune, then train: a few short trials find the largest batch size before training starts, the
//! training starts from it, and a second run of the program starts from the cache instead of
//! tuning again.
//!
//! ```text
//! cargo run -p batch-size-examples --example tune_then_train
//! ```

use batch_size_runtime::{find_executable_batch_size, last_report, SimulatedDevice, Tuner};

const SEQUENCE: u64 = 512; // tokens in the longest sequence of the dataset
const BYTES_PER_TOKEN: u64 = 96 << 10;

/// One training step at `batch_size`, on the longest sequences: the worst case.
fn step(device: &SimulatedDevice, batch_size: usize) -> anyhow::Result<()> {
    let _weights = device.alloc(3 << 30)?; // weights, gradients, optimizer state
    let _activations = device.alloc(batch_size as u64 * SEQUENCE * BYTES_PER_TOKEN)?;
    Ok(())
}

#[find_executable_batch_size(starting = starting, release = device.clone())]
fn train(batch_size: usize, starting: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
    step(device, batch_size)?; // the whole training loop, here one step
    Ok(batch_size)
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();
    let device = SimulatedDevice::new(24 << 30);
    let cache_dir = std::env::temp_dir().join("batch-size-example-cache");
    let _ = std::fs::remove_dir_all(&cache_dir); // a first run, for the example

    for run in 1..=2 {
        batch_size_runtime::cache::clear_process_cache(); // as a new process would start
        let tuned = Tuner::new()
            .with_release(device.clone())
            .with_cache("gpt-small, 512 tokens")
            .with_cache_dir(&cache_dir)
            .run(|batch_size| step(&device, batch_size))?;
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
            "run {run}: tuned to {} (largest that ran: {}) in {} trial(s): {}",
            tuned.batch_size(),
            tuned.largest_fit(),
            tuned.report().len(),
            trials.join(" ")
        );
        let trained = train(tuned.batch_size(), &device)?;
        println!(
            "       trained with {trained}, in {} attempt(s)",
            last_report().map_or(0, |report| report.len())
        );
    }
    println!("\nThe cache: {}", cache_dir.display());
    Ok(())
}
