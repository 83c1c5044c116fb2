//! `step_done()`: after the first step of an attempt, the search reads the step's peak and runs
//! the function again at a larger size where the figures show one fits, below every failure;
//! in every form the attribute accepts (any error type, sync and async, methods), never outside
//! a search, never under an agreement, and with the user's own errors unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use crate::block_on;

use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::SimulatedDevice, step_done, BatchSizeSearch,
    Grow, OutOfMemory, Outcome, SearchReport,
};
use block_on::block_on;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// 2 GiB of weights, then 24 layers of 5 MiB a sample: each failure comes part-way through the
/// step, so failures alone say little more than "smaller". 119 fit on 16 GiB.
fn layered_step(device: &SimulatedDevice, batch_size: usize) -> Result<(), OutOfMemory> {
    let mut held = vec![device.alloc(2 * GIB)?];
    for _ in 0..24 {
        held.push(device.alloc(batch_size as u64 * 5 * MIB)?);
    }
    Ok(())
}

const LAYERED_FIT: usize = 119;

/// Memory freed within an attempt is reused at once, as PyTorch's allocator does, so that the
/// function may run several steps.
fn device() -> SimulatedDevice {
    SimulatedDevice::new(16 * GIB)
}

fn grew(report: &SearchReport) -> usize {
    report
        .attempts()
        .filter(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
        .count()
}

#[find_executable_batch_size(starting = 1000, release = device.clone())]
fn train(batch_size: usize, device: &SimulatedDevice, calls: bool) -> anyhow::Result<usize> {
    for _step in 0..3 {
        layered_step(device, batch_size)?;
        if calls {
            step_done()?;
        }
    }
    Ok(batch_size)
}

#[test]
fn the_call_grows_to_near_the_limit_where_failures_alone_do_not() {
    let alone = train(&device(), false).unwrap();
    let alone_report = last_report().unwrap();
    assert_eq!(grew(&alone_report), 0);

    let grown = train(&device(), true).unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert!(grown <= LAYERED_FIT, "{report}");
    assert!(
        grown as f64 >= 0.93 * LAYERED_FIT as f64,
        "{grown}: {report}"
    );
    assert!(grown > alone, "{grown} with the call, {alone} without");
    // Every grown size is below every size that failed.
    let failed = report.smallest_out_of_memory().unwrap();
    assert!(report.attempts().all(|attempt| match attempt.outcome {
        Outcome::Grew { to } => to < failed,
        _ => true,
    }));
    // The attempt that grew says so, and the figures it read are kept.
    let first_grown = report
        .attempts()
        .find(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
        .unwrap();
    assert!(first_grown.memory_at_end.is_some());
    assert!(
        first_grown.to_string().contains("grown to"),
        "{first_grown}"
    );
}

#[test]
fn nothing_happens_outside_a_search_or_after_the_first_step() {
    assert_eq!(step_done(), Ok(()));
    assert_eq!(step_done(), Ok(()));
    // A search whose attempts call it many times: one growth at most per attempt.
    let device = device();
    let mut calls = 0;
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            for _ in 0..5 {
                layered_step(&device, batch_size)?;
                calls += 1;
                step_done()?;
            }
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    // 64 fit: it grew, then ran whole at the size grown to.
    assert!(fitted > 64 && fitted <= LAYERED_FIT, "{report}");
    assert_eq!(
        calls,
        grew(&report) + 5,
        "each grown attempt ends at its first step: {report}"
    );
}

#[test]
fn never_above_max() {
    let device = device();
    let fitted = BatchSizeSearch::new(40)
        .with_max(50)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            layered_step(&device, batch_size)?;
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    assert_eq!(fitted, 50, "{}", last_report().unwrap());
}

#[test]
fn without_figures_it_does_nothing() {
    let device = device();
    let fitted = BatchSizeSearch::new(64)
        .run(|batch_size| -> anyhow::Result<usize> {
            layered_step(&device, batch_size)?;
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    assert_eq!(fitted, 64);
    assert_eq!(last_report().unwrap().len(), 1);
}

#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error(transparent)]
    Memory(#[from] OutOfMemory),
    #[error(transparent)]
    Grow(#[from] Grow),
    #[error("corrupt shard")]
    Corrupt,
}

#[find_executable_batch_size(starting = 64, release = device.clone())]
fn fails_later(batch_size: usize, device: &SimulatedDevice) -> Result<usize, TrainError> {
    layered_step(device, batch_size)?;
    step_done()?;
    if batch_size > 64 {
        return Err(TrainError::Corrupt);
    }
    Ok(batch_size)
}

#[test]
fn the_users_own_error_comes_back_unchanged_after_a_growth() {
    let result = fails_later(&device());
    assert!(matches!(result, Err(TrainError::Corrupt)), "{result:?}");
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
}

#[find_executable_batch_size(starting = 1000, release = device.clone())]
async fn train_async(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
    for _step in 0..2 {
        std::future::ready(()).await;
        layered_step(device, batch_size)?;
        step_done()?;
    }
    Ok(batch_size)
}

#[test]
fn async_functions_grow() {
    let fitted = block_on(train_async(&device())).unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert!(
        fitted <= LAYERED_FIT && fitted as f64 >= 0.93 * LAYERED_FIT as f64,
        "{report}"
    );
}

struct Trainer {
    device: SimulatedDevice,
    steps: usize,
}

impl Trainer {
    #[find_executable_batch_size(starting = 1000, release = self.device.clone())]
    fn train(&mut self, batch_size: usize) -> anyhow::Result<usize> {
        layered_step(&self.device, batch_size)?;
        self.steps += 1;
        step_done()?;
        Ok(batch_size)
    }
}

#[test]
fn methods_grow() {
    let mut trainer = Trainer {
        device: device(),
        steps: 0,
    };
    let fitted = trainer.train().unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert!(fitted <= LAYERED_FIT && fitted as f64 >= 0.93 * LAYERED_FIT as f64);
    assert_eq!(trainer.steps, grew(&report) + 1);
}

/// A step whose later steps need more than its first (Adam's moments appear at the first
/// optimizer step): the size grown to from the first step fails in the second, and the search
/// returns to the size it had reached before growing, with that one failure.
#[test]
fn a_grown_size_that_fails_returns_to_the_size_that_fit() {
    let device = SimulatedDevice::new(16 * GIB);
    let fitted = BatchSizeSearch::new(40)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let _weights = device.alloc(2 * GIB)?;
            let mut moments = None;
            for _ in 0..2 {
                let activations = device.alloc(batch_size as u64 * 190 * MIB)?;
                drop(activations);
                if moments.is_none() {
                    moments = Some(device.alloc(6 * GIB)?);
                }
                step_done()?;
            }
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert_eq!(report.out_of_memory_count(), 1, "{report}");
    assert!(grew(&report) >= 1, "{report}");
    assert_eq!(fitted, 40, "{report}");
}

/// Under an agreement between ranks, no rank grows: each would measure its own step and grow on
/// its own, and the ranks would run different sizes. Every rank keeps the agreed size.
#[test]
fn no_rank_grows_under_an_agreement() {
    use batch_size_runtime::agree::{Agree, ThreadRanks};
    use batch_size_runtime::policy::Guided;
    use std::sync::mpsc;
    use std::time::Duration;

    let (sender, receiver) = mpsc::channel();
    let world = ThreadRanks::with_timeout(2, Duration::from_secs(10));
    for (collective, capacity) in world.into_iter().zip([200u64 << 20, 120 << 20]) {
        let sender = sender.clone();
        std::thread::spawn(move || {
            let device = SimulatedDevice::new(capacity);
            let result = BatchSizeSearch::new(32)
                .with_release(device.clone())
                .with_policy(Agree::new(Guided::new(), collective))
                .run(|size| -> anyhow::Result<usize> {
                    let _activations = device.alloc(size as u64 * MIB)?;
                    step_done()?;
                    Ok(size)
                });
            let grown = last_report().map_or(0, |report| grew(&report));
            let _ = sender.send((result.map_err(|error| error.to_string()), grown));
        });
    }
    drop(sender);
    for _ in 0..2 {
        let (result, grown) = receiver.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!((result, grown), (Ok(32), 0));
    }
}

/// `EffectiveBatch` and `Chunked` grow from their steps' figures themselves: `step_done` in
/// them ends nothing.
#[test]
fn effective_batch_and_chunked_are_left_alone() {
    let device = device();
    let mut runner = batch_size_runtime::EffectiveBatch::new(64).with_release(device.clone());
    runner
        .step(|plan| -> anyhow::Result<()> {
            layered_step(&device, plan.micro())?;
            step_done()?;
            Ok(())
        })
        .unwrap();
    assert_eq!(grew(runner.last_step_report()), 0);
    assert_eq!(runner.plan().micro(), 64);

    let items: Vec<u32> = (0..256).collect();
    let mut sizes = Vec::new();
    batch_size_runtime::Chunked::new(items.len())
        .with_starting(32)
        .with_release(device.clone())
        .for_each(|chunk| -> anyhow::Result<()> {
            layered_step(&device, chunk.len())?;
            sizes.push(chunk.len());
            step_done()?;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        sizes.iter().sum::<usize>(),
        items.len(),
        "every item once: {sizes:?}"
    );
}

/// A panic of the user's own, after a growth, comes back with its own payload.
#[test]
fn the_users_own_panic_comes_back_unchanged_after_a_growth() {
    std::panic::set_hook(Box::new(|_| {})); // keep the test's output clean
    let device = device();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        BatchSizeSearch::new(64).with_release(device.clone()).run(
            |batch_size| -> anyhow::Result<usize> {
                layered_step(&device, batch_size)?;
                step_done()?;
                if batch_size > 64 {
                    std::panic::panic_any(41_u32);
                }
                Ok(batch_size)
            },
        )
    }));
    let _ = std::panic::take_hook();
    let payload = caught.unwrap_err();
    assert_eq!(payload.downcast_ref::<u32>(), Some(&41));
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert_eq!(report.last().unwrap().outcome, Outcome::Panicked);
}
