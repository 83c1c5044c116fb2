//! What the tuner measures of speed: the quickest successful trial at each size, samples per
//! second, and the fastest size within a tolerance of the best.

use std::time::Duration;

use crate::record::SearchReport;

/// The smallest size at or below `kept` within `tolerance` of the best throughput there.
pub(super) fn fastest(throughput: &[(usize, f64)], kept: usize, tolerance: f64) -> Option<usize> {
    let candidates = throughput.iter().filter(|(size, _)| *size <= kept);
    let best = candidates
        .clone()
        .map(|(_, rate)| *rate)
        .fold(0.0, f64::max);
    candidates
        .filter(|(_, rate)| *rate >= best * (1.0 - tolerance))
        .map(|(size, _)| *size)
        .min()
}

/// Samples per second at each size, by size: the size over its quickest successful trial, as
/// the search timed it (with the tuner's clock). Trials that took no measurable time are left
/// out. Read from the report: the policy and the runner each read it there, nothing is shared.
pub(super) fn throughput(history: &SearchReport) -> Vec<(usize, f64)> {
    let mut quickest: Vec<(usize, Duration)> = Vec::new();
    for attempt in history
        .attempts()
        .filter(|attempt| attempt.outcome.is_success())
    {
        if attempt.duration.is_zero() {
            continue;
        }
        match quickest
            .iter_mut()
            .find(|(ran, _)| *ran == attempt.batch_size)
        {
            Some((_, time)) => *time = (*time).min(attempt.duration),
            None => quickest.push((attempt.batch_size, attempt.duration)),
        }
    }
    let mut rates: Vec<(usize, f64)> = quickest
        .into_iter()
        .map(|(size, time)| (size, size as f64 / time.as_secs_f64()))
        .collect();
    rates.sort_by_key(|&(size, _)| size);
    rates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quickest_trial_of_a_size_counts_and_rates_come_by_size() {
        use crate::record::{Attempt, Outcome};
        let trial = |size: usize, millis: u64, outcome: Outcome| Attempt {
            number: 1,
            batch_size: size,
            outcome,
            duration: Duration::from_millis(millis),
            memory_at_start: None,
            memory_at_end: None,
            memory_after_release: None,
            figures: Default::default(),
            rationale: None,
            remedies: None,
            first_step_done: false,
        };
        let mut history = SearchReport::default();
        history.push(trial(64, 2, Outcome::Succeeded));
        history.push(trial(32, 1, Outcome::Succeeded));
        history.push(trial(64, 1, Outcome::Succeeded)); // quicker: kept
        history.push(trial(16, 0, Outcome::Succeeded)); // not timed: left out
        let failed = Outcome::OutOfMemory {
            error: "out of memory".to_owned(),
        };
        history.push(trial(128, 1, failed)); // did not run: left out
        assert_eq!(throughput(&history), [(32, 32_000.0), (64, 64_000.0)]);
    }

    #[test]
    fn the_fastest_is_the_smallest_size_within_the_tolerance_below_the_kept_one() {
        let rates = [(16, 900.0), (32, 990.0), (64, 1000.0), (128, 2000.0)];
        // 128 is above the size kept: not a candidate.
        assert_eq!(fastest(&rates, 100, 0.02), Some(32));
        assert_eq!(fastest(&rates, 100, 0.0), Some(64));
        assert_eq!(fastest(&rates, 8, 0.02), None);
    }
}
