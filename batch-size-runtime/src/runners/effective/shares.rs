//! One global batch in contiguous shares among ranks of mixed hardware, following each rank's
//! speed (docs/SEVERAL_GPUS.md). Every rank applies the same rule to the same all-gathered
//! figures: after the first step (warm-up) shares follow micro sizes, after later ones throughput,
//! when the slowest rank is more than [`REBALANCE_ABOVE`] over balanced; never inside a step.

use crate::engine::Clock;
use crate::opaque::Opaque;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::agree::{AgreementError, Collective};

/// How much slower than balanced the slowest rank may be before shares move (below it: noise).
pub(crate) const REBALANCE_ABOVE: f64 = 0.03;

/// Steps of one configuration a rank's throughput is averaged over.
const WINDOW: usize = 4;

/// The shares of one global batch and what this rank measured.
#[derive(Debug)]
pub(crate) struct Shares<'r> {
    global: usize,
    rank: usize,
    lengths: Vec<usize>,
    throughput: Throughput,
    /// The runner's clock (`with_clock`), else the wall clock from `origin`.
    clock: Option<Opaque<Clock<'r>>>,
    origin: Instant,
}

/// Why the shares changed, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Basis {
    /// In proportion to the micro-batch each rank holds.
    Memory,
    /// In proportion to each rank's measured samples per second.
    Throughput,
}

impl<'r> Shares<'r> {
    /// Even shares of `global` among `world` ranks (the first `global % world` one sample more).
    pub(crate) fn even(global: usize, rank: usize, world: usize) -> Self {
        Shares {
            global,
            rank,
            lengths: proportional(global, &vec![1; world.max(1)]),
            throughput: Throughput::default(),
            clock: None,
            origin: Instant::now(),
        }
    }

    pub(crate) fn with_clock(mut self, clock: Option<Clock<'r>>) -> Self {
        self.clock = clock.map(Opaque);
        self
    }

    /// This rank's samples of the global batch.
    pub(crate) fn range(&self) -> Range<usize> {
        let start: usize = self.lengths[..self.rank.min(self.lengths.len())]
            .iter()
            .sum();
        start..start + self.lengths.get(self.rank).copied().unwrap_or(0)
    }

    /// Every rank's samples, in rank order.
    pub(crate) fn ranges(&self) -> Vec<Range<usize>> {
        let mut start = 0;
        self.lengths
            .iter()
            .map(|&length| {
                start += length;
                start - length..start
            })
            .collect()
    }

    /// The time now, by the runner's clock.
    pub(crate) fn now(&mut self) -> Duration {
        match &mut self.clock {
            Some(clock) => clock(),
            None => self.origin.elapsed(),
        }
    }

    /// This rank's share ran at micro size `micro` in `elapsed`.
    pub(crate) fn record(&mut self, micro: usize, elapsed: Duration) {
        let length = self.range().len();
        self.throughput.record((length, micro), length, elapsed);
    }

    /// After step `steps_done` (from 1): exchanges micro sizes and throughputs, and moves the
    /// shares if the rule says so; returns the basis when they moved.
    pub(crate) fn rebalance(
        &mut self,
        collective: &dyn Collective,
        micro: usize,
        steps_done: usize,
    ) -> Result<Option<Basis>, AgreementError> {
        let micros = collective.all_gather(micro as u64)?;
        let rates = collective.all_gather(self.throughput.milli_per_second())?;
        let proposal = if steps_done <= 1 {
            Some((proportional(self.global, &micros), Basis::Memory))
        } else if imbalance(&self.lengths, &rates).is_some_and(|over| over > REBALANCE_ABOVE) {
            Some((proportional(self.global, &rates), Basis::Throughput))
        } else {
            None
        };
        Ok(match proposal {
            Some((lengths, basis)) if lengths != self.lengths => {
                tracing::info!(
                    rank = self.rank,
                    shares = ?lengths,
                    micro = ?micros,
                    samples_per_second = ?rates.iter().map(|&rate| rate as f64 / 1000.0).collect::<Vec<_>>(),
                    basis = ?basis,
                    "the shares of the global batch of {} move to {:?}: {}",
                    self.global,
                    lengths,
                    match basis {
                        Basis::Memory => "in proportion to the micro-batch each rank holds",
                        Basis::Throughput => "in proportion to each rank's samples per second",
                    }
                );
                self.lengths = lengths;
                Some(basis)
            }
            _ => None,
        })
    }
}

/// How much longer than balanced the slowest rank's step is predicted to take (`None`: no figure).
fn imbalance(lengths: &[usize], rates: &[u64]) -> Option<f64> {
    if rates.is_empty() || rates.contains(&0) || rates.len() != lengths.len() {
        return None;
    }
    let total_rate: f64 = rates.iter().map(|&rate| rate as f64).sum();
    let global: usize = lengths.iter().sum();
    let balanced = global as f64 / total_rate;
    let slowest = lengths
        .iter()
        .zip(rates)
        .map(|(&length, &rate)| length as f64 / rate as f64)
        .fold(0.0, f64::max);
    Some(slowest / balanced - 1.0)
}

/// `global` in proportion to `weights`, at least one sample each while enough, the rest by largest
/// remainder (ties to the lower rank): the same on every rank.
pub(crate) fn proportional(global: usize, weights: &[u64]) -> Vec<usize> {
    let world = weights.len();
    if world == 0 {
        return Vec::new();
    }
    let weights: Vec<u128> = if weights.iter().all(|&weight| weight == 0) {
        vec![1; world]
    } else {
        weights.iter().map(|&weight| u128::from(weight)).collect()
    };
    let floor = usize::from(global >= world);
    let rest = (global - floor * world) as u128;
    let total: u128 = weights.iter().sum();
    let mut lengths: Vec<usize> = weights
        .iter()
        .map(|&weight| floor + (rest * weight / total) as usize)
        .collect();
    let mut left = global - lengths.iter().sum::<usize>();
    let mut by_remainder: Vec<usize> = (0..world).collect();
    by_remainder.sort_by_key(|&rank| std::cmp::Reverse(rest * weights[rank] % total));
    for rank in by_remainder.into_iter().cycle() {
        if left == 0 {
            break;
        }
        lengths[rank] += 1;
        left -= 1;
    }
    lengths
}

/// This rank's samples per second over its last steps of one share length and micro size.
#[derive(Debug, Default)]
struct Throughput {
    configuration: (usize, usize),
    steps: VecDeque<(usize, Duration)>,
}

impl Throughput {
    fn record(&mut self, configuration: (usize, usize), samples: usize, elapsed: Duration) {
        if configuration != self.configuration {
            self.configuration = configuration;
            self.steps.clear();
        }
        if self.steps.len() == WINDOW {
            self.steps.pop_front();
        }
        self.steps.push_back((samples, elapsed));
    }

    /// Thousandths of a sample per second, 0 while unknown (no step, or no time measured).
    fn milli_per_second(&self) -> u64 {
        let samples: usize = self.steps.iter().map(|(samples, _)| samples).sum();
        let nanos: u128 = self.steps.iter().map(|(_, time)| time.as_nanos()).sum();
        if nanos == 0 {
            return 0;
        }
        let rate = samples as u128 * 1_000_000_000_000 / nanos;
        u64::try_from(rate).unwrap_or(u64::MAX).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_shares_add_up_and_follow_the_weights() {
        assert_eq!(proportional(10, &[1, 1, 1]), [4, 3, 3]);
        assert_eq!(proportional(100, &[3, 1]), [75, 25]);
        assert_eq!(proportional(7, &[0, 0]), [4, 3]);
        assert_eq!(proportional(5, &[1000, 1, 1, 1]), [2, 1, 1, 1]); // one sample each at least
        assert_eq!(proportional(2, &[1, 1, 1]), [1, 1, 0]);
        for global in [1usize, 17, 256, 10_007] {
            for weights in [vec![5u64, 9, 1, 1, 30], vec![u64::MAX, 1], vec![7; 8]] {
                let lengths = proportional(global, &weights);
                assert_eq!(lengths.iter().sum::<usize>(), global);
                if global >= weights.len() {
                    assert!(lengths.iter().all(|&length| length >= 1));
                }
            }
        }
    }

    #[test]
    fn imbalance_is_the_slowest_over_balanced() {
        // 3 samples/s and 1 sample/s: 50 + 50 takes 16.7 s and 50 s; balanced is 25 s.
        let over = imbalance(&[50, 50], &[3000, 1000]).unwrap_or(0.0);
        assert!((over - 1.0).abs() < 1e-9);
        assert_eq!(imbalance(&[75, 25], &[3000, 1000]), Some(0.0));
        assert_eq!(imbalance(&[50, 50], &[3000, 0]), None);
    }

    #[test]
    fn throughput_starts_afresh_when_the_configuration_changes() {
        let mut throughput = Throughput::default();
        assert_eq!(throughput.milli_per_second(), 0);
        throughput.record((100, 50), 100, Duration::from_secs(2));
        throughput.record((100, 50), 100, Duration::from_secs(2));
        assert_eq!(throughput.milli_per_second(), 50_000);
        throughput.record((100, 25), 100, Duration::from_secs(4));
        assert_eq!(throughput.milli_per_second(), 25_000);
    }
}
