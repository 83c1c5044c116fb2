//! The tuner's throughput (samples per second, timed by an injected clock, never the wall
//! clock), its check that a trial's memory grows with its size, and what a rerun from the cache
//! reports.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use batch_size_runtime::{
    memory::SimulatedDevice, Choice, NoExecutableBatchSize, OutOfMemory, Release, StopReason,
    Tuned, Tuner,
};

/// A simulated clock in microseconds: the trial advances it, the tuner reads it.
fn simulated_clock() -> (Arc<AtomicU64>, impl FnMut() -> Duration + Send + 'static) {
    let micros = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&micros);
    (micros, move || {
        Duration::from_micros(read.load(Ordering::Relaxed))
    })
}

/// A step's time: 1 ms up to `saturation` samples, then in proportion to the size (the device
/// is full: samples per second no longer grow).
fn saturating(size: usize, saturation: usize) -> u64 {
    1000 * size.max(saturation) as u64 / saturation as u64
}

/// Tunes a workload where 200 fit and a step takes `micros(size)`, with or without the
/// device's figures.
fn tune(choice: Choice, figures: bool, micros_of: fn(usize) -> u64) -> Tuned {
    let device = SimulatedDevice::new(16 << 30);
    let (micros, clock) = simulated_clock();
    let release = if figures {
        Release::from(device.clone())
    } else {
        Release::none()
    };
    Tuner::new()
        .choose(choice)
        .with_release(release)
        .with_clock(clock)
        .run(|size| -> anyhow::Result<()> {
            // 4 GiB fixed, then 60 MiB a sample: 204 fit; above 200 it fails anyway.
            if size > 200 {
                Err(OutOfMemory::new())?;
            }
            let _weights = device.alloc(4 << 30)?;
            let _activations = device.alloc(size as u64 * (60 << 20))?;
            micros.fetch_add(micros_of(size), Ordering::Relaxed);
            Ok(())
        })
        .unwrap()
}

/// The margin's size: with figures the fit's (its own trial confirms it, nothing ran above
/// it), near 95 % of the 204 the memory allows (the 200 above which the trial fails is not in
/// the figures, and is above it); without, 95 % of the largest size that ran, which bisection
/// found within a quarter of the margin of 200.
fn assert_margin_size(tuned: &Tuned, figures: bool) -> usize {
    if figures {
        assert_eq!(tuned.largest(), tuned.largest_fit(), "{}", tuned.report());
        assert!((192..=194).contains(&tuned.largest()), "{}", tuned.report());
    } else {
        assert!(
            (196..=200).contains(&tuned.largest_fit()),
            "{}",
            tuned.report()
        );
        assert_eq!(tuned.largest(), tuned.largest_fit() * 95 / 100);
    }
    tuned.largest()
}

#[test]
fn throughput_that_saturates_at_64_gives_64_as_fastest_while_200_fit() {
    for figures in [true, false] {
        let tuned = tune(Choice::Fastest, figures, |size| saturating(size, 64));
        assert_margin_size(&tuned, figures);
        assert_eq!(tuned.fastest(), 64, "{:?}", tuned.throughput());
        assert_eq!(tuned.batch_size(), 64);
        // The size returned ran last, successfully: the search's answer, and the cache's.
        assert_eq!(tuned.report().batch_size(), Some(64));
        // Measured where it saturates and just below, where it is slower.
        let rate = |size| {
            tuned
                .throughput()
                .iter()
                .find(|(measured, _)| *measured == size)
                .map(|(_, rate)| *rate)
        };
        assert_eq!(rate(64), Some(64_000.0));
        assert_eq!(rate(32), Some(32_000.0));
        assert!(tuned.report().len() <= 25);
    }
}

#[test]
fn with_the_default_choice_the_largest_is_returned_and_fastest_is_judged_over_the_trials_run() {
    let tuned = tune(Choice::Largest, true, |size| saturating(size, 64));
    assert_eq!(tuned.batch_size(), assert_margin_size(&tuned, true));
    // No trial was added for the fastest: among the sizes the search ran (1, 2, then near the
    // limit) the smallest at full speed.
    let ran: Vec<usize> = tuned
        .report()
        .attempts()
        .map(|trial| trial.batch_size)
        .collect();
    assert!(ran.contains(&tuned.fastest()), "{ran:?}");
    assert!(tuned.fastest() >= 64 && tuned.fastest() <= tuned.largest());
}

#[test]
fn throughput_that_keeps_growing_gives_the_largest() {
    for figures in [true, false] {
        // Every step takes 1 ms, whatever its size.
        let tuned = tune(Choice::Fastest, figures, |_| 1000);
        let largest = assert_margin_size(&tuned, figures);
        assert_eq!(tuned.fastest(), largest, "{:?}", tuned.throughput());
        assert_eq!(tuned.batch_size(), largest);
        // The power of two below the margin's size showed the drop; no trial after it.
        assert_eq!(tuned.report().batch_size(), Some(largest));
    }
}

#[test]
fn throughput_is_samples_over_the_trials_time_by_size() {
    let tuned = tune(Choice::Largest, false, |size| 10 * size as u64 + 1000);
    let sizes: Vec<usize> = tuned.throughput().iter().map(|(size, _)| *size).collect();
    let mut sorted = sizes.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sizes, sorted);
    let (size, rate) = tuned.throughput()[0];
    assert_eq!(size, 1);
    assert!((rate - 1.0 / 1010e-6).abs() < 1e-6, "{rate}");
    // Failed trials are not measured.
    assert!(sizes.iter().all(|&size| size <= 200));
}

#[test]
fn tolerance_widens_what_counts_as_fastest() {
    let device = SimulatedDevice::new(16 << 30);
    // Slowly growing: 64 and 128 are within 10 % of the largest's rate, not within 2 %.
    let tune = |tolerance| {
        let (micros, clock) = simulated_clock();
        Tuner::new()
            .choose(Choice::Fastest)
            .with_tolerance(tolerance)
            .with_release(device.clone())
            .with_clock(clock)
            .run(|size| -> anyhow::Result<()> {
                if size > 200 {
                    Err(OutOfMemory::new())?;
                }
                let _activations = device.alloc(size as u64 * (60 << 20))?;
                micros.fetch_add(100 + 10 * size as u64, Ordering::Relaxed);
                Ok(())
            })
            .unwrap()
    };
    let wide = tune(0.10);
    assert_eq!(wide.fastest(), 64, "{:?}", wide.throughput());
    assert_eq!(wide.batch_size(), 64);
    // Within 2 %: only sizes above 128 (which ones depends on the sizes the search ran).
    let narrow = tune(0.02);
    let best = narrow
        .throughput()
        .iter()
        .filter(|(size, _)| *size <= narrow.largest())
        .map(|(_, rate)| *rate)
        .fold(0.0, f64::max);
    let (_, rate) = narrow
        .throughput()
        .iter()
        .find(|(size, _)| *size == narrow.fastest())
        .unwrap();
    assert!(narrow.fastest() > 128, "{:?}", narrow.throughput());
    assert!(*rate >= best * 0.98, "{:?}", narrow.throughput());
    assert!(narrow.fastest() <= narrow.largest());
}

#[test]
fn a_trial_that_ignores_its_size_stops_with_a_clear_error() {
    let device = SimulatedDevice::new(16 << 30);
    let error = Tuner::new()
        .with_release(device.clone())
        .run(|_size| -> anyhow::Result<()> {
            let _always_the_same = device.alloc(4 << 30)?;
            Ok(())
        })
        .unwrap_err();
    let none = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    assert!(
        matches!(
            none.reason(),
            StopReason::MemoryDoesNotGrow { smaller: 1, larger: 16, peak } if *peak == 4 << 30
        ),
        "{:?}",
        none.reason()
    );
    assert!(
        error.to_string().contains(
            "the trial's memory does not grow with the batch size: does it run a step at the size it is given?"
        ),
        "{error}"
    );
    // Stopped early: 1, 2, then doubling to 16.
    assert!(none.report().len() <= 6, "{}", none.report());
}

#[test]
fn a_trial_that_runs_nothing_stops_too() {
    let device = SimulatedDevice::new(16 << 30);
    let error = Tuner::new()
        .with_release(device.clone())
        .run(|_size| Ok::<_, anyhow::Error>(()))
        .unwrap_err();
    let none = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    assert!(matches!(
        none.reason(),
        StopReason::MemoryDoesNotGrow { .. }
    ));
}

#[test]
fn a_flat_trial_is_not_reported_as_out_of_memory() {
    let device = SimulatedDevice::new(16 << 30);
    let error = Tuner::new()
        .with_release(device.clone())
        .run(|_size| -> anyhow::Result<()> {
            let _always_the_same = device.alloc(4 << 30)?;
            Ok(())
        })
        .unwrap_err();
    let message = error.to_string();
    // What to check, with the figures that show it; nothing ran out of memory.
    assert!(
        message.contains("a peak of 4.00 GiB at 16, no more than at 1"),
        "{message}"
    );
    assert!(
        message.contains("Check that the trial builds its batch"),
        "{message}"
    );
    assert!(!message.contains("Memory at that failure"), "{message}");
    assert!(!message.contains("out-of-memory error"), "{message}");
    assert!(!message.contains("Lower `min`"), "{message}");
}

#[test]
fn small_growth_under_an_allocators_rounding_is_not_taken_for_a_flat_trial() {
    // 200 KiB a sample, every allocation rounded up to 2 MiB: 1 and 2 look the same.
    let device = SimulatedDevice::new(1 << 30).with_block_size(2 << 20);
    let tuned = Tuner::new()
        .with_release(device.clone())
        .run(|size| -> anyhow::Result<()> {
            let _weights = device.alloc(100 << 20)?;
            let _activations = device.alloc(size as u64 * (200 << 10))?;
            Ok(())
        })
        .unwrap();
    assert!(tuned.largest_fit() > 4000, "{}", tuned.report());
}

#[test]
fn a_rerun_from_the_cache_reports_the_largest_that_fit_when_it_was_written() {
    batch_size_runtime::policy::clear_process_cache();
    let dir = std::env::temp_dir().join(format!("tuner-largest-fit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Without figures, so that a size above the one kept ran (with figures the fit's size is
    // confirmed by its own trial and is the largest that ran).
    let tune = |choice| {
        let device = SimulatedDevice::new(16 << 30);
        Tuner::new()
            .choose(choice)
            .with_release(Release::none())
            .with_cache("tuner largest_fit test")
            .with_cache_dir(&dir)
            .run(|size| -> anyhow::Result<()> {
                let fits = || -> Result<(), OutOfMemory> {
                    let _weights = device.alloc(2 << 30)?;
                    let _activations = device.alloc(size as u64 * (60 << 20))?;
                    Ok(())
                };
                fits().map_err(|_| OutOfMemory::new())?;
                Ok(())
            })
            .unwrap()
    };
    let first = tune(Choice::Largest);
    assert!(first.largest_fit() > first.batch_size());
    batch_size_runtime::policy::clear_process_cache(); // as a new process: read from the file
    let again = tune(Choice::Largest);
    assert_eq!(again.report().len(), 1);
    assert_eq!(again.batch_size(), first.batch_size());
    assert_eq!(again.largest(), first.batch_size());
    assert_eq!(again.largest_fit(), first.largest_fit()); // not the size that ran now
                                                          // And a third time: the rerun kept it in the entry.
    batch_size_runtime::policy::clear_process_cache();
    let third = tune(Choice::Largest);
    assert_eq!(third.largest_fit(), first.largest_fit());
    // The fastest size is another entry: it tunes again.
    let fastest = tune(Choice::Fastest);
    assert!(fastest.report().len() > 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_entry_written_before_largest_fit_was_kept_still_loads() {
    batch_size_runtime::policy::clear_process_cache();
    let dir = std::env::temp_dir().join(format!("tuner-old-entry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let device = SimulatedDevice::new(16 << 30);
    // Without figures, so that the entry's `largest_fit` (a size that ran above the one kept)
    // differs from the size kept.
    let tune = || {
        Tuner::new()
            .with_release(Release::none())
            .with_cache("tuner old entry test")
            .with_cache_dir(&dir)
            .run(|size| -> anyhow::Result<()> {
                let _activations = device
                    .alloc(size as u64 * (60 << 20))
                    .map_err(|_| OutOfMemory::new())?;
                Ok(())
            })
            .unwrap()
    };
    let first = tune();
    // Rewrite the entry as an older version wrote it: no `largest_fit`.
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "json"))
        .unwrap();
    let mut entry: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(entry["largest_fit"], first.largest_fit());
    entry.as_object_mut().unwrap().remove("largest_fit");
    std::fs::write(&file, entry.to_string()).unwrap();
    batch_size_runtime::policy::clear_process_cache();
    let again = tune();
    assert_eq!(again.report().len(), 1);
    assert_eq!(again.batch_size(), first.batch_size());
    // Nothing better is known than the size that ran.
    assert_eq!(again.largest_fit(), first.batch_size());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Other work on the device frees memory between trials: each trial's own peak still grows
/// with its size, so the tuner never stops with "memory does not grow". Before, it compared
/// whole-device peaks, which the freed memory lowered.
#[test]
fn memory_freed_by_other_work_between_trials_is_not_flat_memory() {
    let device = SimulatedDevice::new(16 << 30);
    let other = std::sync::Mutex::new(Some(device.alloc(8 << 30).unwrap()));
    let tuned = Tuner::new()
        .with_release(device.clone())
        .run(|size| -> anyhow::Result<()> {
            let _activations = device.alloc(size as u64 * (64 << 20))?;
            other.lock().unwrap().take(); // the other work ends with the first trial
            Ok(())
        })
        .unwrap_or_else(|error| panic!("{error:#}"));
    assert!(tuned.batch_size() > 16, "{}", tuned.report());
}

/// Children in 768 MiB of room, with figures as a child reports them: a peak and what it held,
/// counted in whole MiB, one MiB more or less from child to child. With no bytes a sample they
/// ignore the size they are given (the attribute put on the step inside the child: each one
/// settles on the same size whatever it is asked).
#[derive(Debug, Clone, Default)]
struct Children {
    per_sample: u64,
    last: Arc<std::sync::Mutex<(Option<u64>, bool)>>,
}

const MIB: u64 = 1 << 20;
const ROOM: u64 = 768 * MIB;
/// What the children's own attribute settles on: the largest size that fits.
const FIT: usize = 952;

impl Children {
    fn run(&self, size: usize) -> anyhow::Result<()> {
        let bytes = 400 * MIB + size as u64 * self.per_sample;
        let mut last = self.last.lock().unwrap();
        if bytes > ROOM {
            *last = (Some(ROOM), true);
            Err(OutOfMemory::new().with_free(0).with_total(ROOM))?;
        }
        let fixed = if self.per_sample == 0 { 300 } else { 0 };
        let jitter = (size as u64 * 7919) % 3;
        *last = (Some((bytes / MIB + fixed + jitter) * MIB), true);
        Ok(())
    }
}

impl batch_size_runtime::memory::MemoryBackend for Children {
    fn release(&self) -> Result<(), batch_size_runtime::memory::ReleaseError> {
        self.last.lock().unwrap().1 = false;
        Ok(())
    }

    fn memory(&self) -> batch_size_runtime::memory::MemorySnapshot {
        let (last, ended) = *self.last.lock().unwrap();
        let held = last.filter(|_| ended);
        batch_size_runtime::memory::MemorySnapshot {
            devices: vec![batch_size_runtime::memory::DeviceMemory {
                device: "cpu".to_owned(),
                total: ROOM,
                free: ROOM - held.unwrap_or(0),
                pool_reserved: Some(held.unwrap_or(0)),
                pool_used: None,
                peak: held,
            }],
        }
    }

    fn start_attempt(&self) -> batch_size_runtime::memory::MemorySnapshot {
        self.last.lock().unwrap().1 = false;
        self.memory()
    }
}

/// Before, the guard could not fire on a child's figures (their resolution, 1/64 of what the
/// child held, asked for millions of samples between two sizes): the tuner grew to its `max`
/// and returned 62,259, 65 times what fits.
#[test]
fn children_that_ignore_their_size_stop_whatever_the_figures_resolution() {
    let children = Children::default();
    let error = Tuner::new()
        .with_max(65536)
        .with_release(children.clone())
        .run(|size| children.run(size))
        .unwrap_err();
    let none = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    let StopReason::MemoryDoesNotGrow {
        smaller,
        larger,
        peak,
    } = *none.reason()
    else {
        panic!("{:?}: {}", none.reason(), none.report());
    };
    assert!(larger >= 16 * smaller, "{smaller}, {larger}");
    assert!((700 * MIB..=702 * MIB).contains(&peak), "{peak}");
    let largest = none.report().attempts().map(|trial| trial.batch_size).max();
    assert!(
        largest.is_some_and(|largest| largest < 8 * FIT),
        "ran {largest:?}: {}",
        none.report()
    );
    let message = error.to_string();
    assert!(
        message.contains(&format!("at {larger}, no more than at {smaller}")),
        "{message}"
    );
}

/// The guard's other edge: a small step in a large child (16 KiB a sample beside 400 MiB, its
/// growth below the figures' resolution up to a few hundred samples) is grown, not stopped.
#[test]
fn a_small_step_in_a_large_child_is_grown_not_stopped() {
    let children = Children {
        per_sample: 16 << 10,
        ..Children::default()
    };
    let fit = (368 * MIB / (16 << 10)) as usize;
    let tuned = Tuner::new()
        .with_release(children.clone())
        .run(|size| children.run(size))
        .unwrap();
    assert!(
        tuned.batch_size() >= fit / 2 && tuned.batch_size() <= fit,
        "{} of {fit}: {}",
        tuned.batch_size(),
        tuned.report()
    );
}
