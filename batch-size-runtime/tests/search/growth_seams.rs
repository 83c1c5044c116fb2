//! Growth after a step where it meets the other features: figures that come with the first
//! child, `effective = N`, remedies, a search nested in the step, the cache's rerun, and a grown
//! size that failed within its first step. Each case ran wrong before the one model of the
//! step's memory: it stayed put, grew past its bound, or grew into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::{Arc, Mutex};

use batch_size_runtime::memory::{
    DeviceMemory, MemoryBackend, MemorySnapshot, ReleaseError, SimulatedDevice,
};
use batch_size_runtime::remedies::{Remedied, Remedies, Remedy};
use batch_size_runtime::{
    find_executable_batch_size, last_report, step_done, BatchPlan, BatchSizeSearch, OutOfMemory,
    Outcome, SearchReport,
};

const MIB: u64 = 1 << 20;

fn grew(report: &SearchReport) -> usize {
    report
        .attempts()
        .filter(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
        .count()
}

/// What a `ChildTrial`'s `memory()` reads: nothing before the first child, then the last child's
/// peak against its room (a fresh child has all the room).
#[derive(Debug, Clone, Default)]
struct Children(Arc<Mutex<(Option<u64>, bool)>>);

const ROOM: u64 = 1024 * MIB;

impl Children {
    /// A child's step at `size`: 100 MiB fixed and 1 MiB a sample, in 1 GiB (924 fit).
    fn run(&self, size: usize) -> Result<usize, OutOfMemory> {
        let peak = 100 * MIB + size as u64 * MIB;
        let mut last = self.0.lock().unwrap();
        if peak > ROOM {
            *last = (Some(ROOM), true);
            return Err(OutOfMemory::new().with_free(0).with_total(ROOM));
        }
        *last = (Some(peak), true);
        Ok(size)
    }

    fn snapshot(&self, at_end: bool) -> MemorySnapshot {
        let (last, ended) = *self.0.lock().unwrap();
        let Some(peak) = last else {
            return MemorySnapshot::default();
        };
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "cpu".to_owned(),
                total: ROOM,
                free: ROOM,
                pool_reserved: Some(0),
                pool_used: None,
                peak: (at_end && ended).then_some(peak),
            }],
        }
    }
}

impl MemoryBackend for Children {
    fn release(&self) -> Result<(), ReleaseError> {
        self.0.lock().unwrap().1 = false;
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        self.snapshot(true)
    }

    fn start_attempt(&self) -> MemorySnapshot {
        self.0.lock().unwrap().1 = false;
        self.snapshot(false)
    }
}

#[find_executable_batch_size(starting = 200, release = children.clone())]
fn sized_in_children(batch_size: usize, children: &Children) -> anyhow::Result<usize> {
    let ran = children.run(batch_size)?;
    step_done()?;
    Ok(ran)
}

/// Before, the first attempt had no figures from before its child and never grew: 200 of 924.
#[test]
fn the_first_child_gives_figures_to_grow_from() {
    let fitted = sized_in_children(&Children::default()).unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert!((850..=924).contains(&fitted), "{fitted}: {report}");
}

#[find_executable_batch_size(starting = 16, effective = 64, release = device.clone())]
fn planned(plan: BatchPlan, device: &SimulatedDevice) -> anyhow::Result<usize> {
    for micro in plan.micro_batches() {
        let _activations = device.alloc(micro.range.len() as u64 * MIB)?;
    }
    step_done()?;
    Ok(plan.micro())
}

/// Before, the micro size grew past the effective batch (the report said 245 where the plan
/// ran 64 twice).
#[test]
fn effective_caps_the_growth() {
    let micro = planned(&SimulatedDevice::new(1 << 30)).unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert_eq!(micro, 64, "{report}");
    assert!(
        report.attempts().all(|attempt| attempt.batch_size <= 64),
        "{report}"
    );
}

/// A step that needs 60 MiB a sample without checkpointing and 10 with it, on 1 GiB: no size
/// fits from 64 down to `min` = 8 without, and 100 fit with. Before, the failures under the old
/// settings capped the growth after the remedy: 32 stayed 32.
#[test]
fn growth_after_a_remedy_works_as_without_one() {
    #[derive(Debug, Clone, PartialEq)]
    struct Config {
        checkpointing: bool,
    }
    let remedies = Remedies::new(Config {
        checkpointing: false,
    })
    .then(Remedy::switch(
        "activation checkpointing",
        |c: &mut Config| c.checkpointing = true,
    ));
    let device = SimulatedDevice::new(1 << 30).with_caching();
    let (size, _) = BatchSizeSearch::new(32)
        .with_min(8)
        .with_release(device.clone())
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| -> anyhow::Result<usize> {
            let per_sample = if attempt.settings().checkpointing {
                10
            } else {
                200
            };
            let _weights = device.alloc(20 * MIB)?;
            let _activations = device.alloc(attempt.batch_size() as u64 * per_sample * MIB)?;
            step_done()?;
            Ok(attempt.batch_size())
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1, "{report}");
    assert!((90..=100).contains(&size), "{size}: {report}");
}

#[find_executable_batch_size(starting = 8, release = device.clone())]
fn inner(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
    let _scratch = device.alloc(batch_size as u64 * MIB)?;
    Ok(batch_size)
}

/// An annotated function called on the same device inside the step restarts the device's peak
/// for its own attempts. Before, the outer step's peak was read from after it: 40 grew to 217,
/// ran out of memory, and came back to 40.
#[test]
fn a_nested_search_never_hides_the_outer_steps_peak() {
    let device = SimulatedDevice::new(1 << 30); // 1 GiB: 100 MiB + 8 MiB a sample, 115 fit
    let fitted = BatchSizeSearch::new(40)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let _weights = device.alloc(100 * MIB)?;
            drop(device.alloc(batch_size as u64 * 8 * MIB)?); // the step's activations
            inner(&device)?; // a small search of its own on the same device
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert_eq!(report.out_of_memory_count(), 0, "{report}");
    assert!(fitted <= 115, "{report}");
}

#[find_executable_batch_size(starting = 100, cache = format!("growth seams rerun {key}"), release = device.clone())]
fn cached_growth(batch_size: usize, device: &SimulatedDevice, key: &str) -> anyhow::Result<usize> {
    let _weights = device.alloc(100 * MIB)?;
    let _activations = device.alloc(batch_size as u64 * MIB)?;
    step_done()?;
    Ok(batch_size)
}

/// From below the fit the first run grows above `starting`; before, the rerun refused that size
/// ("the search could not have reached it") and grew again every time (3 runs, not 1).
#[test]
fn a_grown_size_is_served_from_the_cache_in_one_run() {
    let key = format!("{}", std::process::id());
    let first = cached_growth(&SimulatedDevice::new(1 << 30), &key).unwrap();
    let first_runs = last_report().unwrap().len();
    assert!(first > 100 && first_runs > 1, "{first} in {first_runs}");
    for _ in 0..2 {
        let again = cached_growth(&SimulatedDevice::new(1 << 30), &key).unwrap();
        let report = last_report().unwrap();
        assert_eq!((again, report.len()), (first, 1), "{report}");
        assert!(report.from_cache(), "{report}");
    }
}

/// A step that grows faster than the model allows for (as the batch cubed) overshoots once,
/// within its first step. Before, the search went back to the size that ran and stopped (0.42
/// of the fit for a newcomer's candle MLP); the failure is one more bound, and growth goes on
/// below it.
#[test]
fn a_grown_size_that_failed_within_its_first_step_bounds_growth_that_goes_on() {
    let device = SimulatedDevice::new(1 << 30);
    let bytes = |size: usize| 64 * MIB + (size as u64).pow(3) * 4096;
    let fit = (1..)
        .take_while(|&size| bytes(size) <= 1 << 30)
        .last()
        .unwrap(); // 62
    let fitted = BatchSizeSearch::new(20)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let _step = device.alloc(bytes(batch_size))?;
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(report.out_of_memory_count() >= 1, "{report}");
    let before_failure = report
        .attempts()
        .take_while(|attempt| !attempt.outcome.is_out_of_memory())
        .map(|attempt| attempt.batch_size)
        .max()
        .unwrap();
    assert!(
        fitted > before_failure,
        "{fitted} after {before_failure}: {report}"
    );
    assert!(fitted <= fit, "{report}");
}

/// A framework that counts what it holds but not the device's total (burn and wgpu on a
/// software driver) leaves the step no room to read: with a failure above, the call bisects
/// toward it, where halving stopped at half the failed size.
#[test]
fn without_figures_the_call_bisects_below_the_smallest_failure() {
    let fitted = BatchSizeSearch::new(256)
        .with_release(batch_size_runtime::Release::none())
        .run(|batch_size| -> anyhow::Result<usize> {
            if batch_size > 100 {
                Err(OutOfMemory::new())?; // no figures
            }
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    // 256 and 128 fail, 64 runs; then 96 (halfway to 128), 112 fails, 104 fails: 96.
    assert!(grew(&report) >= 1, "{report}");
    assert!((90..=100).contains(&fitted), "{fitted}: {report}");
}

/// A rerun whose cached size fails (memory another process took since) goes on as a first run,
/// growing included, and the entry it writes is served by the next rerun. Before, growth stayed
/// off for the whole rerun (113, 103 failed, then 56 where 74 fit), and the next rerun refused
/// the entry it wrote (56 above `starting`, not marked grown) and started over.
#[test]
fn a_cached_size_that_fails_grows_again_and_its_entry_is_served() {
    let key = format!("taken {}", std::process::id());
    let device = SimulatedDevice::new(1 << 30);
    // 100 MiB of weights and 1 MiB a sample in 1 GiB: 924 fit.
    let first = cached_growth(&device, &key).unwrap();
    assert!(first > 800, "{first}: {}", last_report().unwrap());
    // Another process takes 400 MiB: 524 fit now.
    let _taken = device.alloc(400 * MIB).unwrap();
    let fits_now = 524;
    let rerun = cached_growth(&device, &key).unwrap();
    let report = last_report().unwrap();
    assert!(report.out_of_memory_count() >= 1, "{report}");
    assert!(!report.from_cache(), "{report}");
    assert!(
        rerun as f64 >= 0.9 * fits_now as f64 && rerun <= fits_now,
        "{rerun} of {fits_now}: {report}"
    );
    // The next rerun, in the same room, is served the size that rerun found, in one run.
    let again = cached_growth(&device, &key).unwrap();
    let report = last_report().unwrap();
    assert_eq!((again, report.len()), (rerun, 1), "{report}");
}

/// A fixed part and a linear one where 159 fit, from 128: the call may overshoot to a size
/// that fails within its first step; that failure bounds the step from above, and growth goes
/// on below it rather than stopping at 128 (0.805).
#[test]
fn an_overshoot_by_a_few_grows_again_below_the_failure() {
    let device = SimulatedDevice::new(1 << 30);
    let bytes = |size: usize| 600 * MIB + size as u64 * 2_800_000;
    let fit = (1..)
        .take_while(|&size| bytes(size) <= 1 << 30)
        .last()
        .unwrap();
    let fitted = BatchSizeSearch::new(128)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            for _ in 0..6 {
                let _weights = device.alloc(600 * MIB)?;
                let _activations = device.alloc(batch_size as u64 * 2_800_000)?;
                step_done()?;
            }
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(
        fitted as f64 >= 0.9 * fit as f64 && fitted <= fit,
        "{fitted} of {fit}: {report}"
    );
}
