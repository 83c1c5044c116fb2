//! The tuner spends the trials it is given: with a budget of `n`, a trial is kept back only to
//! confirm a size that has not run; otherwise every trial searches, and the size returned ran,
//! is never above a failure, and grows where the budget allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{memory::SimulatedDevice, OutOfMemory, Release, Tuned, Tuner};

/// A step that fits up to `limit` samples: on the simulated device (figures) or by a plain
/// out-of-memory error above the limit (no figures).
fn try_tune(
    start: usize,
    budget: usize,
    headroom: f64,
    limit: usize,
    figures: bool,
) -> anyhow::Result<Tuned> {
    let device = SimulatedDevice::new(1 << 30);
    let per_sample = (1u64 << 30) / limit as u64;
    let tuner = Tuner::new()
        .with_min(start)
        .with_max(4096)
        .with_max_trials(budget)
        .with_headroom(headroom);
    let tuner = if figures {
        tuner.with_release(device.clone())
    } else {
        tuner.with_release(Release::none())
    };
    tuner.run(|size| -> anyhow::Result<()> {
        if figures {
            let _activations = device.alloc(size as u64 * per_sample)?;
        } else if size > limit {
            Err(OutOfMemory::new())?;
        }
        Ok(())
    })
}

fn tune(start: usize, budget: usize, headroom: f64, limit: usize, figures: bool) -> Tuned {
    try_tune(start, budget, headroom, limit, figures)
        .unwrap_or_else(|error| panic!("start {start}, budget {budget}: {error:#}"))
}

fn check(tuned: &Tuned, start: usize, budget: usize, limit: usize, figures: bool) {
    let what = format!(
        "start {start}, budget {budget}, figures {figures}: {:?} -> {}",
        tuned
            .report()
            .attempts()
            .map(|trial| (trial.batch_size, trial.outcome.is_success()))
            .collect::<Vec<_>>(),
        tuned.batch_size()
    );
    let trials = tuned.report().len();
    assert!(trials <= budget, "over the budget: {what}");
    assert!(
        tuned
            .report()
            .attempts()
            .any(|trial| trial.batch_size == tuned.batch_size() && trial.outcome.is_success()),
        "the size returned did not run: {what}"
    );
    assert!(tuned.batch_size() <= limit, "above the limit: {what}");
    let smallest_failure = tuned
        .report()
        .attempts()
        .filter(|trial| trial.outcome.is_out_of_memory())
        .map(|trial| trial.batch_size)
        .min();
    if let Some(failed) = smallest_failure {
        assert!(tuned.batch_size() < failed, "above a failure: {what}");
    }
    if budget >= 2 && start < limit && tuned.report().attempts().all(|t| t.outcome.is_success()) {
        assert!(
            tuned.batch_size() > start,
            "a spare trial was not spent: {what}"
        );
    }
    if budget >= 2 && start < limit {
        assert!(trials >= 2, "a spare trial was not spent: {what}");
    }
}

#[test]
fn every_budget_from_one_to_four_from_below_and_above_the_limit() {
    let limit = 300;
    for figures in [false, true] {
        for budget in 1..=4 {
            for start in [4, 8, 17, 64, 299, 300] {
                let tuned = tune(start, budget, 0.05, limit, figures);
                check(&tuned, start, budget, limit, figures);
            }
            // The tuner starts at its minimum: above the limit, no size it may try fits, and
            // it says so within the budget.
            for start in [301, 1000] {
                let error = try_tune(start, budget, 0.05, limit, figures).unwrap_err();
                let none_fit = error
                    .downcast_ref::<batch_size_runtime::NoExecutableBatchSize>()
                    .unwrap_or_else(|| panic!("start {start}, budget {budget}: {error:#}"));
                assert!(none_fit.report().len() <= budget, "{error:#}");
            }
        }
    }
}

/// Lightning's contract: from 4, two trials that both fit return a larger size than 4.
#[test]
fn a_budget_of_two_grows_past_the_first_size() {
    for figures in [false, true] {
        let tuned = tune(4, 2, 0.05, 300, figures);
        assert_eq!(tuned.report().len(), 2, "{:?}", tuned.report());
        assert!(tuned.batch_size() > 4, "{figures}: {}", tuned.batch_size());
        assert!(tuned.report().attempts().all(|t| t.outcome.is_success()));
    }
}

/// At a budget of two the headroom changes the answer: the last trial is aimed with it taken.
#[test]
fn the_headroom_changes_the_answer_at_a_budget_of_two() {
    let sizes: Vec<usize> = [0.0, 0.1, 0.2]
        .iter()
        .map(|&headroom| tune(4, 2, headroom, 300, false).batch_size())
        .collect();
    assert!(
        sizes[0] > sizes[1] && sizes[1] > sizes[2],
        "headrooms 0, 0.1, 0.2 gave {sizes:?}"
    );
}
