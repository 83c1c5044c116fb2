//! `step_done()` answers `Grow` as a value the function returns: nothing unwinds, so the code
//! around the call behaves as on any early return (mutexes, `catch_unwind`, guards, code after
//! the call), a step on another thread grows through its handle, and a function with no
//! `Result` grows by returning early.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::SimulatedDevice, step_done, step_handle,
    BatchSizeSearch, Grow, OutOfMemory, Outcome, SearchReport,
};

const MIB: u64 = 1 << 20;

/// 100 MiB fixed, 1 MiB a sample, on 1 GiB: 924 fit.
fn step(device: &SimulatedDevice, batch_size: usize) -> Result<(), OutOfMemory> {
    let _weights = device.alloc(100 * MIB)?;
    let _batch = device.alloc(batch_size as u64 * MIB)?;
    Ok(())
}

fn device() -> SimulatedDevice {
    SimulatedDevice::new(1 << 30)
}

fn grew(report: &SearchReport) -> usize {
    report
        .attempts()
        .filter(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
        .count()
}

#[test]
fn a_mutex_held_across_the_call_is_not_poisoned() {
    let device = device();
    let state = Mutex::new(0_usize);
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let mut steps = state.lock().unwrap(); // the next attempt's lock would fail if poisoned
            step(&device, batch_size)?;
            *steps += 1;
            step_done()?;
            Ok(batch_size)
        })
        .unwrap();
    assert!(fitted > 64, "{}", last_report().unwrap());
    assert!(!state.is_poisoned());
    assert_eq!(*state.lock().unwrap(), grew(&last_report().unwrap()) + 1);
}

#[test]
fn a_catch_unwind_of_the_users_does_not_swallow_the_growth() {
    let device = device();
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            // The usual guard that skips a bad batch: a growth is not a panic, so it passes.
            let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                step(&device, batch_size)?;
                step_done()?;
                anyhow::Ok(())
            }));
            stepped.unwrap_or(Ok(()))?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1 && fitted > 64, "{report}");
}

#[test]
fn code_after_the_call_runs_and_guards_drop() {
    let device = device();
    let finished = AtomicUsize::new(0);
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Guard(Arc<AtomicUsize>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let _guard = Guard(Arc::clone(&dropped));
            step(&device, batch_size)?;
            let told = step_done();
            finished.fetch_add(1, Ordering::Relaxed); // a writer's `finish()`
            told?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(fitted > 64, "{report}");
    assert_eq!(finished.load(Ordering::Relaxed), report.len());
    assert_eq!(dropped.load(Ordering::Relaxed), report.len());
}

/// A step guard that reports the step from its `Drop`: during an out-of-memory panic's unwind
/// the call does nothing (before, it unwound from inside a `Drop` and aborted the process).
#[test]
fn a_call_from_a_drop_during_an_unwind_does_nothing() {
    struct StepGuard;
    impl Drop for StepGuard {
        fn drop(&mut self) {
            let _ = step_done();
        }
    }
    let device = device();
    let fitted = BatchSizeSearch::new(2000).with_release(device.clone()).run(
        |batch_size| -> anyhow::Result<usize> {
            let _guard = StepGuard;
            if step(&device, batch_size).is_err() {
                panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
            }
            Ok(batch_size)
        },
    );
    let report = last_report().unwrap();
    assert!(fitted.is_ok(), "{report}");
    assert!(report.out_of_memory_count() >= 1, "{report}");
}

#[test]
fn a_step_on_another_thread_grows_through_its_handle() {
    let device = device();
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            let handle = step_handle();
            let device = device.clone();
            std::thread::scope(|scope| {
                scope
                    .spawn(move || -> anyhow::Result<()> {
                        step(&device, batch_size)?;
                        handle.step_done()?;
                        Ok(())
                    })
                    .join()
                    .unwrap()
            })?;
            Ok(batch_size)
        })
        .unwrap();
    let report = last_report().unwrap();
    assert!(grew(&report) >= 1 && fitted > 64, "{report}");
    // Without the handle, the step's thread has no attempt: nothing grows, nothing breaks.
    let device = SimulatedDevice::new(1 << 30);
    let fitted = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<usize> {
            std::thread::scope(|scope| {
                scope
                    .spawn(|| -> anyhow::Result<()> {
                        step(&device, batch_size)?;
                        step_done()?;
                        Ok(())
                    })
                    .join()
                    .unwrap()
            })?;
            Ok(batch_size)
        })
        .unwrap();
    assert_eq!(fitted, 64);
}

/// A function that returns no `Result` grows by returning early once told.
#[find_executable_batch_size(starting = 64, release = device.clone())]
fn no_result(batch_size: usize, device: &SimulatedDevice) -> usize {
    for _ in 0..3 {
        if step(device, batch_size).is_err() {
            panic!("CUDA out of memory");
        }
        if step_done().is_err() {
            return 0; // not the caller's: the function runs again at the grown size
        }
    }
    batch_size
}

#[test]
fn a_function_with_no_result_grows_by_returning_early() {
    let fitted = no_result(&device());
    let report = last_report().unwrap();
    assert!(fitted > 64 && grew(&report) >= 1, "{fitted}: {report}");
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Memory(#[from] OutOfMemory),
    #[error(transparent)]
    Grow(#[from] Grow),
}

#[find_executable_batch_size(starting = 64, release = device.clone())]
fn with_an_enum(batch_size: usize, device: &SimulatedDevice) -> Result<usize, StepError> {
    step(device, batch_size)?;
    step_done()?;
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 64, release = device.clone())]
fn boxed(
    batch_size: usize,
    device: &SimulatedDevice,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    step(device, batch_size)?;
    step_done()?;
    Ok(batch_size)
}

/// An error that holds no chain (candle's `Error::wrap` keeps only a `Display`).
#[derive(Debug)]
struct Wrapped(String);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Wrapped {}

#[find_executable_batch_size(starting = 64, release = device.clone())]
fn wrapped(batch_size: usize, device: &SimulatedDevice) -> Result<usize, Wrapped> {
    step(device, batch_size).map_err(|error| Wrapped(error.to_string()))?;
    step_done().map_err(|grow| Wrapped(format!("{grow}\nstack backtrace: ...")))?;
    Ok(batch_size)
}

#[test]
fn every_error_type_carries_the_growth() {
    for fitted in [
        with_an_enum(&device()).unwrap(),
        boxed(&device()).unwrap(),
        wrapped(&device()).unwrap(),
    ] {
        let report = last_report().unwrap();
        assert!(fitted > 64 && grew(&report) >= 1, "{report}");
        assert!(fitted <= 924, "{report}");
    }
}

/// A `Grow` returned where no search asked for it (a stale one, kept from another search) is
/// the function's error like any other: it comes back unchanged.
#[test]
fn a_grow_no_search_asked_for_is_an_error() {
    let device = device();
    let mut kept = None;
    BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| -> anyhow::Result<()> {
            step(&device, batch_size)?;
            if let Err(grow) = step_done() {
                kept.get_or_insert(grow);
            }
            Ok(())
        })
        .unwrap();
    let grow = kept.expect("64 of 924 grows");
    let returned: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .with_release(device.clone())
        .run(|_| -> anyhow::Result<usize> { Err(grow.into()) });
    let error = returned.unwrap_err();
    assert_eq!(error.downcast_ref::<Grow>(), Some(&grow), "{error}");
    let report = last_report().unwrap();
    assert!(
        matches!(report.last().unwrap().outcome, Outcome::Failed { .. }),
        "{report}"
    );
}

/// A handle kept past its attempt answers for that attempt only: called in the next attempt,
/// it says nothing (the growth it once answered has happened), so the search goes on and no
/// stale `Grow` reaches the caller as the search's error.
#[test]
fn a_handle_kept_past_its_attempt_does_not_answer_for_the_next() {
    let device = device();
    let mut kept: Option<batch_size_runtime::StepHandle> = None;
    let fitted = BatchSizeSearch::new(64).with_release(device.clone()).run(
        |batch_size| -> anyhow::Result<usize> {
            let stale = kept.replace(step_handle());
            step(&device, batch_size)?;
            if let Some(stale) = stale {
                stale.step_done()?;
            }
            step_done()?;
            Ok(batch_size)
        },
    );
    let report = last_report().unwrap();
    let fitted = fitted.unwrap_or_else(|error| panic!("{error}: {report}"));
    assert!(fitted > 64 && grew(&report) >= 1, "{fitted}: {report}");
}
