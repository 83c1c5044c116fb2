//! The tuner never keeps a size above one that failed: when a trial runs out of memory below a
//! size that ran (fragmentation, memory an allocator kept, another process taking memory), it
//! searches again below the failure, and the report says so.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::{Arc, Mutex};

use batch_size_runtime::{
    memory::SimulatedDevice, Choice, NoExecutableBatchSize, Release, SearchReport, Tuned, Tuner,
};
use proptest::prelude::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A GPU of 16 GiB running 4 GiB of weights and 100 MiB a sample, where another process takes
/// `taken` bytes from trial number `at` on (counting from 1) and keeps them.
struct NoisyDevice {
    device: SimulatedDevice,
    taken: u64,
    at: usize,
    figures: bool,
    trials: usize,
    neighbour: Option<batch_size_runtime::memory::SimAllocation>,
}

impl NoisyDevice {
    fn new(taken: u64, at: usize, figures: bool) -> NoisyDevice {
        NoisyDevice {
            device: SimulatedDevice::new(16 * GIB),
            taken,
            at,
            figures,
            trials: 0,
            neighbour: None,
        }
    }

    fn release(&self) -> Release {
        if self.figures {
            self.device.clone().into()
        } else {
            Release::none()
        }
    }

    fn trial(&mut self, size: usize) -> anyhow::Result<()> {
        self.trials += 1;
        if self.trials == self.at {
            self.neighbour = Some(self.device.alloc(self.taken)?);
        }
        let _weights = self.device.alloc(4 * GIB)?;
        let _activations = self.device.alloc(size as u64 * 100 * MIB)?;
        Ok(())
    }

    /// The largest size that fits once the neighbour took its share.
    fn fits_after_the_drop(&self) -> usize {
        ((16 * GIB - 4 * GIB - self.taken) / (100 * MIB)) as usize
    }
}

/// Sizes that ran out of memory.
fn failures(report: &SearchReport) -> Vec<usize> {
    report
        .attempts()
        .filter(|attempt| attempt.outcome.is_out_of_memory())
        .map(|attempt| attempt.batch_size)
        .collect()
}

/// The tuner's default budget of trials.
const DEFAULT_BUDGET: usize = 25;

/// What a user relies on, whatever the noise: the size returned ran, and is below every size
/// that failed; it ran as the last trial, after every failure, unless the budget's trials ran
/// out (no trial runs past it, whatever the memory does).
fn assert_never_above_a_failure(tuned: &Tuned) {
    let report = tuned.report();
    assert!(report.len() <= DEFAULT_BUDGET, "{report:?}");
    let last = report.last().unwrap();
    if report.len() < DEFAULT_BUDGET {
        assert!(last.outcome.is_success(), "{report:?}");
        assert_eq!(last.batch_size, tuned.batch_size(), "{report:?}");
    } else {
        assert!(
            report
                .attempts()
                .any(|trial| trial.batch_size == tuned.batch_size() && trial.outcome.is_success()),
            "{report:?}"
        );
    }
    for failed in failures(report) {
        assert!(
            tuned.batch_size() < failed,
            "{} kept, {failed} failed",
            tuned.batch_size()
        );
        assert!(
            tuned.largest_fit() < failed,
            "{} fit, {failed} failed",
            tuned.largest_fit()
        );
        assert!(tuned.largest() < failed);
    }
    assert!(tuned.batch_size() <= tuned.largest_fit());
}

/// The index of the first failure below a size that ran before it, if any.
fn first_failure_below_a_success(report: &SearchReport) -> Option<usize> {
    let attempts: Vec<_> = report.attempts().collect();
    (0..attempts.len()).find(|&index| {
        attempts[index].outcome.is_out_of_memory()
            && attempts[..index].iter().any(|earlier| {
                earlier.outcome.is_success() && earlier.batch_size >= attempts[index].batch_size
            })
    })
}

/// The confirming trial at the margin's size fails: the neighbour arrives just before it.
/// Without figures it is the first trial below a size that ran (the reported case: 1140 ran,
/// 1083 failed, 1140 was kept); with figures nothing ran above it (the fit's size is confirmed
/// by its own trial), and the search goes on below the failure all the same.
fn confirming_trial_fails(figures: bool) {
    // A first run without noise counts the trials up to the margin's.
    let mut quiet = NoisyDevice::new(0, usize::MAX, figures);
    let release = quiet.release();
    let baseline = Tuner::new()
        .with_release(release)
        .run(|size| quiet.trial(size))
        .unwrap();
    let confirming = baseline.report().len();
    if figures {
        assert_eq!(baseline.batch_size(), baseline.largest_fit());
    } else {
        assert!(baseline.batch_size() < baseline.largest_fit());
    }

    // 1 GiB taken: the margin's size no longer fits.
    let noisy = Arc::new(Mutex::new(NoisyDevice::new(GIB, confirming, figures)));
    let fits = noisy.lock().unwrap().fits_after_the_drop();
    assert!(
        fits < baseline.batch_size(),
        "the drop must make the margin's size fail"
    );
    let release = noisy.lock().unwrap().release();
    let trials = Arc::clone(&noisy);
    let tuned = Tuner::new()
        .with_release(release)
        .run(move |size| trials.lock().unwrap().trial(size))
        .unwrap();

    let report = tuned.report();
    let attempts: Vec<_> = report.attempts().collect();
    let failed = attempts[confirming - 1];
    assert_eq!(failed.batch_size, baseline.batch_size());
    assert!(failed.outcome.is_out_of_memory());
    assert_never_above_a_failure(&tuned);
    assert!(tuned.batch_size() <= fits);
    assert!(tuned.batch_size() < baseline.batch_size());
    if figures {
        // Nothing had run above the failed size: no size ran before it that it contradicts.
        assert_eq!(first_failure_below_a_success(report), None, "{report}");
        return;
    }
    // The report says what happened: the next trial's reason names the failure and the size
    // that had run.
    let reason = attempts[confirming]
        .rationale
        .as_deref()
        .unwrap_or_default();
    assert!(
        reason.contains(&format!(
            "batch size {} ran out of memory after {} ran",
            baseline.batch_size(),
            baseline.largest_fit()
        )),
        "{reason:?}"
    );
}

#[test]
fn a_failing_confirmation_is_searched_below_with_figures() {
    confirming_trial_fails(true);
}

#[test]
fn a_failing_confirmation_is_searched_below_without_figures() {
    confirming_trial_fails(false);
}

#[test]
fn the_fastest_size_failing_at_the_end_is_searched_below() {
    // Each trial takes 1 ms up to 8 samples, then in proportion: the fastest size is 8, and
    // its final trial (the last) runs after the neighbour took all but room for 4.
    let clock = Arc::new(Mutex::new(std::time::Duration::ZERO));
    let run = |noisy: Arc<Mutex<NoisyDevice>>| {
        let time = Arc::clone(&clock);
        let trials = Arc::clone(&noisy);
        let release = noisy.lock().unwrap().release();
        Tuner::new()
            .choose(Choice::Fastest)
            .with_release(release)
            .with_clock({
                let time = Arc::clone(&clock);
                move || *time.lock().unwrap()
            })
            .run(move |size| {
                trials.lock().unwrap().trial(size)?;
                *time.lock().unwrap() +=
                    std::time::Duration::from_micros(1000 * size.max(8) as u64 / 8);
                Ok::<_, anyhow::Error>(())
            })
            .unwrap()
    };
    let quiet = run(Arc::new(Mutex::new(NoisyDevice::new(0, usize::MAX, true))));
    let last = quiet.report().len();
    assert!(quiet.fastest() < quiet.largest());

    let taken = 12 * GIB - (quiet.fastest() as u64 - 1) * 100 * MIB;
    let noisy = run(Arc::new(Mutex::new(NoisyDevice::new(taken, last, true))));
    let attempts: Vec<_> = noisy.report().attempts().collect();
    assert_eq!(attempts[last - 1].batch_size, quiet.fastest());
    assert!(attempts[last - 1].outcome.is_out_of_memory());
    assert_never_above_a_failure(&noisy);
    assert!(noisy.batch_size() < quiet.fastest());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any drop, at any trial, with or without figures, either choice: never a size at or above
    /// one that failed, and the size returned ran last.
    #[test]
    fn never_a_size_above_a_failure(
        taken_mib in 0u64..12_000,
        at in 1usize..20,
        figures in any::<bool>(),
        fastest in any::<bool>(),
    ) {
        let noisy = Arc::new(Mutex::new(NoisyDevice::new(taken_mib * MIB, at, figures)));
        let release = noisy.lock().unwrap().release();
        let trials = Arc::clone(&noisy);
        let choice = if fastest { Choice::Fastest } else { Choice::Largest };
        let result = Tuner::new()
            .choose(choice)
            .with_release(release)
            .run(move |size| trials.lock().unwrap().trial(size));
        match result {
            Ok(tuned) => {
                assert_never_above_a_failure(&tuned);
                if first_failure_below_a_success(tuned.report()).is_some() {
                    prop_assert!(tuned.batch_size() <= noisy.lock().unwrap().fits_after_the_drop());
                }
            }
            Err(error) => {
                let none_fit = error.downcast_ref::<NoExecutableBatchSize>();
                prop_assert!(none_fit.is_some(), "{}", error);
            }
        }
    }
}

#[test]
fn a_device_without_noise_keeps_the_margin_size() {
    // The fix changes nothing where no trial fails below a size that ran.
    let mut quiet = NoisyDevice::new(0, usize::MAX, true);
    let release = quiet.release();
    let tuned = Tuner::new()
        .with_release(release)
        .run(|size| quiet.trial(size))
        .unwrap();
    assert_eq!(first_failure_below_a_success(tuned.report()), None);
    assert_never_above_a_failure(&tuned);
    // The fit's margin, confirmed by the trial of the size returned: nothing ran above it.
    let fits = quiet.fits_after_the_drop();
    assert_eq!(tuned.largest_fit(), tuned.batch_size());
    assert!(
        tuned.batch_size() < fits && tuned.batch_size() as f64 >= 0.94 * fits as f64,
        "{}",
        tuned.report()
    );
    assert!(tuned
        .report()
        .attempts()
        .all(|attempt| attempt.rationale.is_none()));
}
