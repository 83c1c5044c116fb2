//! The tuner can be trusted at its edges: it never runs a trial over its budget whatever the
//! memory does, a size that failed on a pool's leftovers is retried and the tuning goes on,
//! `Choice::Fastest` returns the fastest size whatever the budget, a rerun from the cache spends
//! its trials growing from the cached size under a key that names the memory the trials ran
//! in, and nothing read from the cache outside the tuner's range steers it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_size_runtime::memory::{MemoryBackend, MemorySnapshot, ReleaseError, SimulatedDevice};
use batch_size_runtime::{
    Choice, NoExecutableBatchSize, OutOfMemory, Release, SearchReport, Tuned, Tuner,
};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Sizes tried, with whether each ran.
fn trials(report: &SearchReport) -> Vec<(usize, bool)> {
    report
        .attempts()
        .map(|trial| (trial.batch_size, trial.outcome.is_success()))
        .collect()
}

/// The size returned ran, and is below every size that failed.
fn assert_sound(tuned: &Tuned, what: &str) {
    let report = tuned.report();
    assert!(
        report
            .attempts()
            .any(|trial| trial.batch_size == tuned.batch_size() && trial.outcome.is_success()),
        "the size returned did not run: {what}: {:?} -> {}",
        trials(report),
        tuned.batch_size()
    );
    for failed in report
        .attempts()
        .filter(|trial| trial.outcome.is_out_of_memory())
    {
        assert!(
            tuned.batch_size() < failed.batch_size,
            "above a failure: {what}: {:?} -> {}",
            trials(report),
            tuned.batch_size()
        );
    }
}

/// A 16 GiB device, 4 GiB of weights and 100 MiB a sample (122 fit), where another process takes
/// `taken` bytes just before trial number `at` and keeps them.
struct Shrinking {
    device: SimulatedDevice,
    taken: u64,
    at: usize,
    trials: usize,
    neighbour: Option<batch_size_runtime::memory::SimAllocation>,
}

impl Shrinking {
    fn trial(&mut self, size: usize, figures: bool) -> anyhow::Result<()> {
        self.trials += 1;
        if self.trials == self.at {
            self.neighbour = Some(self.device.alloc(self.taken)?);
        }
        let allocated = (|| {
            let _weights = self.device.alloc(4 * GIB)?;
            let _activations = self.device.alloc((size as u64).saturating_mul(100 * MIB))?;
            Ok::<_, OutOfMemory>(())
        })();
        match allocated {
            Ok(()) => Ok(()),
            // Without figures: a plain out-of-memory, as an error that carries none.
            Err(_) if !figures => Err(OutOfMemory::new().into()),
            Err(error) => Err(error.into()),
        }
    }
}

/// A clock that a trial moves on by 1 ms up to 16 samples, then in proportion: the fastest
/// size is 16, below the largest.
fn timed(tuner: Tuner, now: &Arc<Mutex<Duration>>) -> Tuner {
    let clock = Arc::clone(now);
    tuner.with_clock(move || *clock.lock().unwrap())
}

fn tick(now: &Arc<Mutex<Duration>>, size: usize) {
    *now.lock().unwrap() += Duration::from_micros(1000 * size.max(16) as u64 / 16);
}

/// Memory that shrinks at any trial, by a little or by half the room: every budget from 2 to 6,
/// both choices, with and without figures. Before, memory that shrank before the last trial
/// made the tuner step down one size a trial (budget 4: `4, 55, 889, 844, 843, 842, …`).
#[test]
fn no_trial_runs_over_the_budget_whatever_the_memory_does() {
    for budget in 2..=6 {
        for choice in [Choice::Largest, Choice::Fastest] {
            for figures in [false, true] {
                for at in 1..=budget {
                    for taken in [GIB, 6 * GIB, 11 * GIB] {
                        let what = format!(
                            "budget {budget}, {choice:?}, figures {figures}, {} MiB taken at \
                             trial {at}",
                            taken >> 20
                        );
                        let device = SimulatedDevice::new(16 * GIB);
                        let shrinking = Mutex::new(Shrinking {
                            device: device.clone(),
                            taken,
                            at,
                            trials: 0,
                            neighbour: None,
                        });
                        let now = Arc::new(Mutex::new(Duration::ZERO));
                        let release = if figures {
                            Release::from(device.clone())
                        } else {
                            Release::none()
                        };
                        let tuner = Tuner::new()
                            .with_min(4)
                            .with_max_trials(budget)
                            .choose(choice)
                            .with_release(release);
                        let tuned = timed(tuner, &now).run(|size| {
                            shrinking.lock().unwrap().trial(size, figures)?;
                            tick(&now, size);
                            Ok::<_, anyhow::Error>(())
                        });
                        let ran = shrinking.lock().unwrap().trials;
                        assert!(ran <= budget, "{ran} trials: {what}");
                        match tuned {
                            Ok(tuned) => {
                                assert!(tuned.report().len() <= budget, "{what}");
                                assert_sound(&tuned, &what);
                            }
                            Err(error) => {
                                let none_fit = error
                                    .downcast_ref::<NoExecutableBatchSize>()
                                    .unwrap_or_else(|| panic!("{what}: {error:#}"));
                                assert!(none_fit.report().len() <= budget, "{what}: {error:#}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A pool that keeps what earlier work freed (an arena's regions): its first trial fails beside
/// that memory, the engine gives it back and runs the size again, and it fits. Before, the
/// tuner then ended with `NoExecutableBatchSize` ("the next size, 20, is below the minimum of
/// 40", or out of attempts) although that size had just run.
#[test]
fn a_size_that_failed_on_a_pools_leftovers_is_retried_and_the_tuning_goes_on() {
    for choice in [Choice::Largest, Choice::Fastest] {
        for budget in [2, 3, 4, 25] {
            let what = format!("{choice:?}, budget {budget}");
            let device = SimulatedDevice::new(100 * MIB).with_caching();
            drop(device.alloc(40 * MIB).unwrap()); // earlier work: kept by the pool
            assert_eq!(device.cached(), 40 * MIB);
            let now = Arc::new(Mutex::new(Duration::ZERO));
            let tuner = Tuner::new()
                .with_min(80)
                .with_max(95)
                .with_max_trials(budget)
                .choose(choice)
                .with_release(device.clone());
            let tuned = timed(tuner, &now)
                .run(|size| -> anyhow::Result<()> {
                    let _activations = device.alloc(size as u64 * MIB)?;
                    tick(&now, size);
                    Ok(())
                })
                .unwrap_or_else(|error| panic!("{what}: {error:#}"));
            let tried = trials(tuned.report());
            assert_eq!(tried[..2], [(80, false), (80, true)], "{what}");
            assert!(tried.len() <= budget, "{what}: {tried:?}");
            assert!(tuned.batch_size() >= 80, "{what}: {tried:?}");
            if budget == 2 {
                // The retry was the budget's last trial: its size is the answer.
                assert_eq!(tuned.batch_size(), 80, "{what}: {tried:?}");
                continue;
            }
            assert!(
                tried.len() > 2,
                "the tuning went on after the retry: {what}: {tried:?}"
            );
            assert!(tuned.largest_fit() > 80, "{what}: {tried:?}");
            // The retried failure bounds nothing: only sizes that failed after it do.
            for (size, ran) in &tried[2..] {
                assert!(*ran || *size > tuned.batch_size(), "{what}: {tried:?}");
            }
        }
    }
}

/// With `Choice::Fastest`, the size to train with is the fastest measured, whatever the budget:
/// before, a budget too tight for the fastest's final trial returned the largest.
#[test]
fn the_fastest_is_the_answer_whatever_the_budget() {
    for budget in 1..=10 {
        for figures in [false, true] {
            let what = format!("budget {budget}, figures {figures}");
            let device = SimulatedDevice::new(GIB);
            let release = if figures {
                Release::from(device.clone())
            } else {
                Release::none()
            };
            let now = Arc::new(Mutex::new(Duration::ZERO));
            let tuner = Tuner::new()
                .with_min(4)
                .with_max_trials(budget)
                .choose(Choice::Fastest)
                .with_release(release);
            let tuned = timed(tuner, &now)
                .run(|size| -> anyhow::Result<()> {
                    if !figures && size > 300 {
                        Err(OutOfMemory::new())?;
                    }
                    let _activations = device.alloc(size as u64 * (GIB / 300))?;
                    tick(&now, size);
                    Ok(())
                })
                .unwrap_or_else(|error| panic!("{what}: {error:#}"));
            assert_eq!(
                tuned.batch_size(),
                tuned.fastest(),
                "{what}: {:?}",
                trials(tuned.report())
            );
            assert!(tuned.fastest() <= tuned.largest(), "{what}");
            assert_sound(&tuned, &what);
        }
    }
}

/// A folder of the cache's files of this test's own.
struct CacheDir(PathBuf);

impl CacheDir {
    fn new(name: &str) -> CacheDir {
        let dir = std::env::temp_dir().join(format!("tuner-trust-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        CacheDir(dir)
    }

    /// Every entry in the folder, as JSON.
    fn entries(&self) -> Vec<serde_json::Value> {
        std::fs::read_dir(&self.0)
            .map(|files| {
                files
                    .filter_map(Result::ok)
                    .map(|file| file.path())
                    .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
                    .map(|path| read_json(&path))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Sets `fits` to `value` in every entry, as a hand (or a forger) might.
    fn forge(&self, value: u64) {
        for file in std::fs::read_dir(&self.0).unwrap().filter_map(Result::ok) {
            let path = file.path();
            if path.extension().is_some_and(|ext| ext == "json") {
                let mut entry = read_json(&path);
                entry["fits"] = serde_json::Value::from(value);
                std::fs::write(&path, entry.to_string()).unwrap();
            }
        }
        batch_size_runtime::policy::clear_process_cache();
    }
}

impl Drop for CacheDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Figures that exist only once a trial ran, as a child trial's (`ChildTrial::memory()`): the
/// device is unknown before the first trial.
#[derive(Debug, Clone)]
struct LateFigures {
    device: SimulatedDevice,
    ran: Arc<AtomicBool>,
}

impl MemoryBackend for LateFigures {
    fn release(&self) -> Result<(), ReleaseError> {
        self.device.release()
    }

    fn memory(&self) -> MemorySnapshot {
        if self.ran.load(Ordering::Relaxed) {
            self.device.memory()
        } else {
            MemorySnapshot::default()
        }
    }

    fn reset_peak(&self) {
        self.device.reset_peak();
    }
}

/// A 16 GiB device, 1 GiB of weights and 512 KiB a sample: 30720 fit.
const FITS: usize = 30720;

/// A run of the tuner with a budget of 2 and a cache on disk in `dir`, in a fresh process (the
/// entries kept in this one are forgotten first), with figures known before the first trial or
/// only once it ran.
fn cached_run(dir: &CacheDir, late: bool) -> Tuned {
    batch_size_runtime::policy::clear_process_cache();
    let device = SimulatedDevice::new(16 * GIB);
    let figures = LateFigures {
        device: device.clone(),
        ran: Arc::new(AtomicBool::new(false)),
    };
    let release = if late {
        Release::backend(figures.clone())
    } else {
        Release::from(device.clone())
    };
    Tuner::new()
        .with_max_trials(2)
        .with_release(release)
        .with_cache("newcomer")
        .with_cache_dir(&dir.0)
        .run(|size| -> anyhow::Result<()> {
            figures.ran.store(true, Ordering::Relaxed);
            let _weights = device.alloc(GIB)?;
            let _activations = device.alloc(size as u64 * 512 * 1024)?;
            Ok(())
        })
        .unwrap()
}

/// With `max_trials(2)` and a cache, each rerun starts from the cached size and spends its
/// second trial growing from it, until it is near the fit; the entry's key names the device the
/// trials ran in and its `largest_fit` is what the run reported. Before, a rerun ran the cached
/// size alone and stopped (a newcomer's 972 where 28437 fit, run after run), under a key ending
/// in "none with 0 bytes" where the figures came only with the trials, with `"largest_fit":
/// null`.
#[test]
fn a_rerun_from_the_cache_grows_from_the_cached_size() {
    for late in [false, true] {
        let dir = CacheDir::new(if late { "late" } else { "known" });
        let mut previous = cached_run(&dir, late);
        let mut sizes = vec![previous.batch_size()];
        for _ in 0..6 {
            let rerun = cached_run(&dir, late);
            let tried = trials(rerun.report());
            assert!(tried.len() <= 2, "late {late}: {tried:?}");
            assert_eq!(
                tried[0],
                (previous.batch_size(), true),
                "late {late}: the rerun starts from the cached size"
            );
            // It grows, or its growth failed and bounds the next rerun's; it never shrinks.
            let growth_failed = tried.get(1).is_some_and(|&(_, ran)| !ran);
            if (previous.batch_size() as f64) < 0.8 * FITS as f64 {
                assert!(
                    rerun.batch_size() > previous.batch_size() || growth_failed,
                    "late {late}: the rerun grew: {tried:?}, sizes so far {sizes:?}"
                );
            }
            assert!(
                rerun.batch_size() >= previous.batch_size(),
                "late {late}: {tried:?}, sizes so far {sizes:?}"
            );
            assert!(rerun.batch_size() <= FITS, "late {late}: {tried:?}");
            assert_sound(&rerun, "a rerun");
            sizes.push(rerun.batch_size());
            previous = rerun;
        }
        assert!(
            *sizes.last().unwrap() as f64 >= 0.85 * FITS as f64,
            "late {late}: {sizes:?}"
        );
        // The entry under the memory the trials ran in. Where the figures come only with the
        // trials, the same entry is also kept under the key a rerun can read before its first
        // trial.
        let entries = dir.entries();
        let named = format!("sim:0 with {} bytes", 16 * GIB);
        let entry = entries
            .iter()
            .find(|entry| entry["key"].as_str().unwrap().ends_with(&named))
            .unwrap_or_else(|| panic!("late {late}: {entries:?}"));
        assert_eq!(entries.len(), if late { 2 } else { 1 }, "{entries:?}");
        assert_eq!(
            entry["fits"].as_u64(),
            Some(previous.batch_size() as u64),
            "late {late}: {entry}"
        );
        assert_eq!(
            entry["largest_fit"].as_u64(),
            Some(previous.largest_fit() as u64),
            "late {late}: {entry}"
        );
    }
}

/// A forged entry (`u64::MAX`, or any size outside `min..=max`, or above what the device could
/// hold at a byte a sample) never steers the tuner: its first trial is its own, no trial runs
/// outside its range, and it finds what a first run finds. Before, `u64::MAX` made the tuner
/// start there and halve until its attempts ran out.
#[test]
fn a_forged_cache_entry_never_steers_the_tuner() {
    let limit = 300;
    let tune = |dir: &CacheDir, max: Option<usize>, figures: bool| {
        let device = SimulatedDevice::new(GIB);
        let release = if figures {
            Release::from(device.clone())
        } else {
            Release::none()
        };
        let tuner = Tuner::new()
            .with_min(4)
            .with_release(release)
            .with_cache("forged")
            .with_cache_dir(&dir.0);
        let tuner = match max {
            Some(max) => tuner.with_max(max),
            None => tuner,
        };
        tuner.run(|size| -> anyhow::Result<()> {
            if size > limit {
                Err(OutOfMemory::new())?;
            }
            let _activations = device.alloc(size as u64 * (GIB / 400))?;
            Ok(())
        })
    };
    for (max, figures) in [
        (Some(4096), false),
        (Some(4096), true),
        (None, true),
        (None, false),
    ] {
        let forgeries: Vec<u64> = match max {
            Some(max) => vec![u64::MAX, max as u64 + 1, 3, 0],
            None => vec![u64::MAX, 3, 0],
        };
        for forged in forgeries {
            let what = format!("max {max:?}, figures {figures}, forged {forged}");
            let dir = CacheDir::new("forged");
            batch_size_runtime::policy::clear_process_cache();
            let first = tune(&dir, max, figures).unwrap();
            assert!(!dir.entries().is_empty(), "{what}: an entry was written");
            dir.forge(forged);
            let rerun =
                tune(&dir, max, figures).unwrap_or_else(|error| panic!("{what}: {error:#}"));
            let tried = trials(rerun.report());
            assert!(!rerun.report().from_cache(), "{what}: {tried:?}");
            assert_eq!(tried[0].0, 4, "{what}: its own first trial: {tried:?}");
            assert!(
                tried
                    .iter()
                    .all(|&(size, _)| size >= 4 && max.is_none_or(|max| size <= max)),
                "{what}: {tried:?}"
            );
            assert_eq!(rerun.batch_size(), first.batch_size(), "{what}: {tried:?}");
            assert_sound(&rerun, &what);
        }
    }
}

/// An entry marked unfinished whose failed size is at or below its size (a damaged file) is
/// refused whole: the tuner never does arithmetic on the pair, starts from its own first trial
/// and finds what a first run finds. Before, (300, 10), (8, 4) and (400, 399) ended `Tuner::run`
/// with "attempt to subtract with overflow".
#[test]
fn an_unfinished_entry_whose_failure_is_not_above_its_size_is_refused() {
    let tune = |dir: &CacheDir| {
        let device = SimulatedDevice::new(GIB);
        Tuner::new()
            .with_min(4)
            .with_max_trials(3)
            .with_release(device.clone())
            .with_cache("inconsistent")
            .with_cache_dir(&dir.0)
            .run(|size| -> anyhow::Result<()> {
                let _activations = device.alloc(size as u64 * (GIB / 400))?;
                Ok(())
            })
    };
    for (fits, failed_at) in [(300u64, 10u64), (8, 4), (400, 399), (64, 64)] {
        let what = format!("fits {fits}, failed_at {failed_at}");
        let dir = CacheDir::new("inconsistent");
        batch_size_runtime::policy::clear_process_cache();
        let first = tune(&dir).unwrap();
        for file in std::fs::read_dir(&dir.0).unwrap().filter_map(Result::ok) {
            let mut entry = read_json(&file.path());
            entry["fits"] = fits.into();
            entry["failed_at"] = failed_at.into();
            entry["unfinished"] = true.into();
            std::fs::write(file.path(), entry.to_string()).unwrap();
        }
        batch_size_runtime::policy::clear_process_cache();
        let rerun = tune(&dir).unwrap_or_else(|error| panic!("{what}: {error:#}"));
        let tried = trials(rerun.report());
        assert!(!rerun.report().from_cache(), "{what}: {tried:?}");
        assert_eq!(tried[0].0, 4, "{what}: its own first trial: {tried:?}");
        assert_eq!(rerun.batch_size(), first.batch_size(), "{what}: {tried:?}");
        assert_sound(&rerun, &what);
    }
}
