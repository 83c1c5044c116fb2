//! What a chunk (and an `EffectiveBatch` step) costs the crate as the work grows: per-chunk
//! overhead and peak memory for `Chunked` at 10^4, 10^6 and 10^7 items (`for_each` and
//! `run_async`), `EffectiveBatch` at 10^6 steps, and chunks in step with another rank over
//! threads at 10^5 chunks. Each case runs in a process of its own, so that its peak memory is
//! its own.
//!
//! `cargo bench -p batch-size-runtime --bench chunked_scale`
//!
//! The body is trivial (a 1 KiB allocation per item on a simulated device, no out-of-memory),
//! so the time measured is the crate's. `run_async` keeps one output byte per item, which its
//! peak memory includes. A benchmark measures; it asserts nothing.

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use batch_size_runtime::agree::ThreadRanks;
use batch_size_runtime::{memory::SimulatedDevice, Chunked, EffectiveBatch};

#[path = "../tests/common/block_on.rs"]
mod block_on;
use block_on::block_on;

const CASE: &str = "CHUNKED_SCALE_CASE";

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        run_case(&case);
        return;
    }
    let cases = [
        "for_each 10000",
        "for_each 1000000",
        "for_each 10000000",
        "run_async 10000",
        "run_async 1000000",
        "run_async 10000000",
        "effective 1000000",
        "agreement 10000",
        "agreement 100000",
    ];
    println!("| case | units | chunks or steps | crate time per chunk or step | peak RSS |");
    println!("|---|---|---|---|---|");
    for case in cases {
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let output = Command::new(exe).env(CASE, case).output();
        match output {
            Ok(output) => print!("{}", String::from_utf8_lossy(&output.stdout)),
            Err(error) => println!("| {case} | could not run: {error} |"),
        }
    }
}

/// Peak resident memory of this process, from /proc (Linux).
fn peak_rss_mib() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or_else(|| "?".to_owned(), |kib| format!("{} MiB", kib / 1024))
}

fn chunked(items: usize, device: &SimulatedDevice) -> Chunked<'static> {
    Chunked::new(items)
        .with_starting(8)
        .with_max(64)
        .with_release(device.clone())
}

/// Chunks run (the records a run keeps are fewer: see `Chunked::chunks`).
fn chunk_count(work: &Chunked<'_>) -> usize {
    work.chunk_count()
}

fn report(case: &str, units: usize, count: usize, seconds: f64) {
    let per = seconds / count.max(1) as f64 * 1e6;
    println!(
        "| {case} | {units} | {count} | {per:.2} µs | {} |",
        peak_rss_mib()
    );
}

fn run_case(case: &str) {
    let mut words = case.split_whitespace();
    let kind = words.next().unwrap_or_default();
    let units: usize = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    let device = SimulatedDevice::new(1 << 40);
    match kind {
        "for_each" => {
            let mut work = chunked(units, &device);
            let started = Instant::now();
            let result = work.for_each(|items| -> anyhow::Result<()> {
                let _buffer = device.alloc(items.len() as u64 * 1024)?;
                black_box(items);
                Ok(())
            });
            let seconds = started.elapsed().as_secs_f64();
            let count = chunk_count(&work);
            if result.is_ok() {
                report(case, units, count, seconds);
            }
        }
        "run_async" => {
            let mut work = chunked(units, &device);
            let started = Instant::now();
            let result = block_on(work.run_async(|items| {
                let buffer = device.alloc(items.len() as u64 * 1024);
                async move {
                    let _buffer = buffer?;
                    Ok::<_, anyhow::Error>(items.map(|_| 0u8).collect::<Vec<_>>())
                }
            }));
            let seconds = started.elapsed().as_secs_f64();
            let count = chunk_count(&work);
            if result.is_ok() {
                report(case, units, count, seconds);
            }
        }
        "effective" => {
            let mut runner = EffectiveBatch::new(64)
                .with_micro(16)
                .with_release(device.clone());
            let started = Instant::now();
            for _ in 0..units {
                let stepped = runner.step(|plan| -> anyhow::Result<()> {
                    let _buffer = device.alloc(plan.micro() as u64 * 1024)?;
                    Ok(())
                });
                if stepped.is_err() {
                    return;
                }
            }
            report(case, units, units, started.elapsed().as_secs_f64());
        }
        "agreement" => {
            // Two ranks as threads, chunks in step: items such that each rank runs `units`
            // chunks of 8.
            let ranks = ThreadRanks::new(2);
            let started = Instant::now();
            let counts: Vec<usize> = std::thread::scope(|scope| {
                let workers: Vec<_> = ranks
                    .iter()
                    .map(|rank| {
                        let device = device.clone();
                        scope.spawn(move || {
                            let mut work = Chunked::new(units * 8)
                                .with_starting(8)
                                .with_max(8)
                                .with_release(device.clone())
                                .with_agreement(rank);
                            let done = work.for_each(|items| -> anyhow::Result<()> {
                                let _buffer = device.alloc(items.len() as u64 * 1024)?;
                                Ok(())
                            });
                            done.map_or(0, |()| chunk_count(&work))
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|worker| worker.join().unwrap_or(0))
                    .collect()
            });
            let count = counts.first().copied().unwrap_or(0);
            report(case, units * 8, count, started.elapsed().as_secs_f64());
        }
        _ => {}
    }
}
