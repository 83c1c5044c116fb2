//! What the tuner measures of speed: the quickest successful trial at each size, samples per
//! second, and the fastest size within a tolerance of the best.

use std::sync::atomic::AtomicUsize;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

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

/// What the timed trials and the policy share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// The quickest successful trial at each size.
    timings: Mutex<Vec<(usize, Duration)>>,
    /// The margin's size, once its trial ran (0 before).
    pub(super) kept: AtomicUsize,
}

impl Shared {
    pub(super) fn record(&self, size: usize, elapsed: Duration) {
        if elapsed.is_zero() {
            return;
        }
        let mut timings = self.timings.lock().unwrap_or_else(PoisonError::into_inner);
        match timings.iter_mut().find(|(ran, _)| *ran == size) {
            Some((_, quickest)) => *quickest = (*quickest).min(elapsed),
            None => timings.push((size, elapsed)),
        }
    }

    /// Samples per second at each size, by size.
    pub(super) fn throughput(&self) -> Vec<(usize, f64)> {
        let timings = self.timings.lock().unwrap_or_else(PoisonError::into_inner);
        let mut rates: Vec<(usize, f64)> = timings
            .iter()
            .map(|&(size, elapsed)| (size, size as f64 / elapsed.as_secs_f64()))
            .collect();
        rates.sort_by_key(|&(size, _)| size);
        rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quickest_trial_of_a_size_counts_and_rates_come_by_size() {
        let shared = Shared::default();
        shared.record(64, Duration::from_millis(2));
        shared.record(32, Duration::from_millis(1));
        shared.record(64, Duration::from_millis(1)); // quicker: kept
        shared.record(16, Duration::ZERO); // not timed: left out
        assert_eq!(shared.throughput(), [(32, 32_000.0), (64, 64_000.0)]);
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
