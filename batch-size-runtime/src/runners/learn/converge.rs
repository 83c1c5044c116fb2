//! Runners that learn from every step: a training loop is a tuner that runs for free. Each
//! successful step (or chunk) measured its peak and the memory in use before it; a failure
//! said what it needed at least. [`Convergence`] keeps those figures across steps, fits memory
//! against the size ([`MemoryFit`]) and proposes the size that fills the device, so that the
//! runner moves to the fewest passes a step needs in a step or two, confirming with as few
//! growth attempts as the figures allow. [`Probing`] wraps a step's policy: a growth attempt
//! that runs out of memory is followed by the size that fitted before, not by a guess.
//!
//! The rules, sound for any shape of memory against size:
//! - a fit is never trusted over a trial: a size that failed caps every proposal below it, and
//!   bends the fit down to what it needed;
//! - the first guess, from one size, counts all the step allocated as growing with the size:
//!   where gradients or optimizer state appear at the first step, it guesses low, and the next
//!   size's figures straighten it;
//! - a size that fitted and then fails (state allocated late, fragmentation, another process)
//!   makes every earlier figure stale: they are dropped, and the runner starts learning again
//!   from the size that runs now;
//! - a size that failed is not tried again under the same figures, but a failure is not for
//!   good: after [`REPROBE_AFTER`] steps (twice as long after each new failure there) it is
//!   tried once more, as the memory missing then may be back.
//!
//! Without figures (no memory backend that reads them) nothing is learned here: each growth
//! attempt would be a blind guess paid for with an out-of-memory pass, so the runners keep the
//! size that fitted unless asked to grow back ([`GrowBack`](super::GrowBack)).

use super::fit::{
    held_at_start, needed_at_least, peak_bytes, used_at_end, used_at_start, MemoryFit, Point,
};
use crate::policy::{holds_inner, Decision, PolicyWrapper, SizePolicy};
use crate::record::{Attempt, SearchReport};
use crate::runners::split::Split;

/// Steps (or chunks) a failed size first waits before it is tried again; doubled each time it
/// fails again.
pub(crate) const REPROBE_AFTER: usize = 16;

/// Sizes whose figures are kept: enough for a fit over a wide span, bounded for a long run.
const KEPT_POINTS: usize = 8;

/// The smallest size that ran out of memory since the figures were last made stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Failure {
    size: usize,
    /// The bytes it needed at least, where the figures say.
    needed: Option<u64>,
    /// Steps it has held growth back.
    held: usize,
}

/// What a runner has learned of its steps' memory; see the [module docs](self).
#[derive(Debug, Clone)]
pub(crate) struct Convergence {
    enabled: bool,
    /// The latest figures of each size that ran (the most recent peak: the state in force).
    points: Vec<Point>,
    /// A step that allocated state it keeps: its peak with that state, until a step measures
    /// it.
    estimate: Option<Point>,
    /// Bytes in use before the next step, as the latest success with figures left them.
    used_at_start: Option<u64>,
    /// The largest size that ran since the figures were last made stale.
    fitted: Option<usize>,
    failure: Option<Failure>,
    /// Steps a failure holds growth back before it is tried again.
    patience: usize,
    /// The failed size being tried again, if one is.
    reprobing: Option<usize>,
    /// The size of the latest success: what runs under the memory in use now.
    last_ran: Option<usize>,
    /// Sizes are budgets of cost over items that differ from step to step: a budget that ran
    /// on some items says nothing of one that failed on others.
    items_differ: bool,
}

impl Convergence {
    /// Learns when `enabled` (and figures come); without, keeps only the size that fitted.
    pub(crate) fn new(enabled: bool) -> Self {
        Convergence {
            enabled,
            points: Vec::new(),
            estimate: None,
            used_at_start: None,
            fitted: None,
            failure: None,
            patience: REPROBE_AFTER,
            reprobing: None,
            last_ran: None,
            items_differ: false,
        }
    }

    /// For budgets of cost over items that differ from step to step: a failure holds the
    /// budget below it until it is tried again after its patience, whatever ran on other items.
    pub(crate) fn over_items_that_differ(mut self) -> Self {
        self.items_differ = true;
        self
    }

    pub(crate) fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The largest size that ran since the figures were last made stale.
    pub(crate) fn fitted(&self) -> Option<usize> {
        self.fitted
    }

    /// Forgets everything: the attempts ran under other settings (a remedy was applied).
    pub(crate) fn forget(&mut self) {
        let items_differ = self.items_differ;
        *self = Convergence::new(self.enabled);
        self.items_differ = items_differ;
    }

    /// Learns from one attempt that ran `size` (the micro-batch, or a chunk's cost).
    pub(crate) fn learn(&mut self, attempt: &Attempt, size: usize) {
        if attempt.outcome.is_success() {
            self.last_ran = Some(size);
            self.fitted = Some(self.fitted.map_or(size, |fitted| fitted.max(size)));
            match self.failure {
                Some(failure) if size >= failure.size && self.items_differ => {
                    // Other items at a budget that failed: the cost does not measure memory
                    // alike for every item, and the failure still bounds the budget.
                    tracing::debug!(
                        budget = size,
                        failed = failure.size,
                        "a budget of cost that ran out of memory ran on other items: memory does \
                         not grow with the cost as declared (check `BatchCost`'s square term); \
                         the budget stays below the failure"
                    );
                }
                Some(failure) if size >= failure.size => {
                    // A size that failed fits now: the memory missing then is back.
                    self.failure = None;
                    self.patience = REPROBE_AFTER;
                }
                _ => {}
            }
            if self.reprobing.is_some_and(|retried| size >= retried) {
                self.reprobing = None;
                self.patience = REPROBE_AFTER;
            }
            if let Some((peak, total)) = peak_bytes(attempt) {
                let (before, after) = (used_at_start(attempt), used_at_end(attempt));
                let kept = after
                    .zip(before)
                    .map_or(0, |(after, before)| after.saturating_sub(before));
                if kept > 0 {
                    // The step allocated state it keeps (gradients at the first backward, an
                    // optimizer's moments at the first step): every step after it holds that
                    // too. The figures and sizes from before are stale. Until a step measures
                    // it, the peak is guessed with the state added, in case it came after the
                    // peak (an overcount where it came before: a guess on the low side).
                    self.points.clear();
                    self.fitted = Some(size);
                    self.estimate = Some(Point {
                        size,
                        peak: peak.saturating_add(kept),
                        total,
                    });
                } else {
                    self.estimate = None;
                    self.points.retain(|point| point.size != size);
                    self.points.push(Point { size, peak, total });
                }
                if self.points.len() > KEPT_POINTS {
                    // The oldest goes, but never the largest: it anchors the fit.
                    let largest = self.points.iter().map(|point| point.size).max();
                    if let Some(index) = self
                        .points
                        .iter()
                        .position(|point| Some(point.size) != largest)
                    {
                        self.points.remove(index);
                    }
                }
                // The next step starts with what this one left in use; where the figures
                // count only what the process holds (the host's), what it held when this one
                // started: a line from there counts every byte the step allocated as growing
                // with its size, which is the truth for a chunk that keeps nothing.
                self.used_at_start = after.or(before).or_else(|| held_at_start(attempt));
            }
        } else if attempt.outcome.is_out_of_memory() {
            if self.fitted.is_some_and(|fitted| size <= fitted) && self.items_differ {
                // Other items fail where earlier ones fitted: the size that fitted is no
                // verdict on these; the figures still are.
                self.fitted = None;
            } else if self.fitted.is_some_and(|fitted| size <= fitted) {
                // A size at or below one that fitted fails now: the memory is not what it was,
                // and the figures measured before say nothing of it.
                self.points.clear();
                self.estimate = None;
                self.used_at_start = None;
                self.fitted = None;
            }
            if self.reprobing.take().is_some_and(|retried| size >= retried) {
                // The limit is still there: wait twice as long before the next try.
                self.patience = self.patience.saturating_mul(2);
            }
            let needed = needed_at_least(attempt);
            self.failure = match self.failure {
                Some(known) if known.size <= size => Some(known),
                _ => Some(Failure {
                    size,
                    needed,
                    held: 0,
                }),
            };
        }
    }

    /// A step (or chunk) is done: a remembered failure has held growth back once more.
    pub(crate) fn advance(&mut self) {
        if let Some(failure) = self.failure.as_mut() {
            failure.held += 1;
            if failure.held >= self.patience {
                // Long enough below it: that failure may have been the moment's.
                self.reprobing = Some(failure.size);
                self.failure = None;
            }
        }
    }

    /// The largest size the figures say fits, below every size that failed; `None` without
    /// figures to say it.
    pub(crate) fn limit(&self) -> Option<usize> {
        if !self.enabled {
            return None;
        }
        let failure = self
            .failure
            .and_then(|failure| Some((failure.size, failure.needed?)));
        let fit = MemoryFit::from_points(&self.points, failure).or_else(|| {
            // One size: the line through the memory in use before it.
            let only = match self.points.as_slice() {
                [only] => *only,
                [] => self.estimate?,
                _ => return None,
            };
            MemoryFit::through_start(only, self.used_at_start?, failure)
        })?;
        let limit = fit.limit()?;
        Some(match self.failure {
            Some(failure) => limit.min(failure.size.saturating_sub(1)),
            None => limit,
        })
    }

    /// The micro size a step starts at, from `kept`, the size the runner would keep: the
    /// fewest passes the figures say fit where they say fewer than `kept`'s, or more where they
    /// say `kept` no longer fits (state a step allocated and kept since). With the size to fall
    /// back to when the start is above the size that last ran (a growth attempt): the size
    /// that really runs of it, which ran under the figures in force. Sizes are in the step's
    /// unit (samples, or a budget of cost: `split`).
    pub(crate) fn start(&self, split: &Split, kept: usize) -> (usize, Option<usize>) {
        // One fit a step: the figures change only when a step ends.
        let limit = self.limit();
        let size = match (
            limit.and_then(|limit| fewer_passes(limit, split, kept)),
            limit,
        ) {
            (Some(size), _) => size,
            (None, Some(limit)) if limit > 0 && limit < kept => split.realize(limit),
            _ => kept,
        };
        let ran = self
            .last_ran
            .map(|ran| split.realize(ran.min(split.whole())));
        match ran {
            Some(ran) if size > ran => (size, Some(ran)),
            _ => (size, None),
        }
    }
}

/// The size for a step when `limit`, the largest size the figures say fits, takes fewer passes
/// than `running`, the size it would run otherwise.
fn fewer_passes(limit: usize, split: &Split, running: usize) -> Option<usize> {
    let whole = split.whole();
    if whole == 0 || running == 0 {
        return None;
    }
    let limit = limit.min(whole);
    (limit > 0 && split.passes(limit) < split.passes(running.min(whole)))
        .then(|| split.realize(limit))
}

/// The next chunk's budget when `limit`, the largest the figures say fits, is at least 1/32
/// larger than `running`: an allocator's rounding never makes the size wander.
pub(crate) fn larger_budget(limit: usize, running: usize) -> Option<usize> {
    (limit > running.saturating_add(running / 32)).then_some(limit)
}

/// A step's policy whose first attempt is a growth attempt: when it runs out of memory, the
/// size that fitted before runs next (the step is redone in place), not a guess from the
/// failure; everything else is the inner policy's.
#[derive(Debug)]
pub(crate) struct Probing<P> {
    inner: P,
    /// The size tried first and the size that fitted before it.
    probe: Option<(usize, usize)>,
    /// The runner learns from the figures of each success.
    learning: bool,
}

impl<P> Probing<P> {
    pub(crate) fn new(inner: P, probe: Option<(usize, usize)>, learning: bool) -> Self {
        Probing {
            inner,
            probe,
            learning,
        }
    }
}

/// The largest of halving's sizes from `first` (`first`, `first / 2`, ...) at most `size`, or
/// `size` itself below them all.
fn halving_size_at_most(first: usize, size: usize) -> usize {
    std::iter::successors(Some(first), |&rung| Some(rung / 2))
        .take_while(|&rung| rung > 0)
        .find(|&rung| rung <= size)
        .unwrap_or(size)
}

impl<P: SizePolicy> PolicyWrapper for Probing<P> {
    holds_inner!(P);

    fn after(&mut self, history: &SearchReport) -> Decision {
        if let (Some((probe, fitted)), Some(last)) = (self.probe.take(), history.last()) {
            if history.len() == 1
                && last.batch_size == probe
                && last.outcome.is_out_of_memory()
                && fitted < probe
            {
                return Decision::Try(fitted);
            }
        }
        let decision = self.inner.after(history);
        if !self.learning {
            return decision;
        }
        // A runner that learns from its steps grows from the next step's figures: within a
        // step, an estimate between halving's sizes that fails is an out-of-memory pass the
        // learning would have saved. The step keeps to halving's sizes from its first (and the
        // inner policy's proofs that some of them fail), so that it never makes more passes
        // that run out of memory than halving would.
        match (decision, history.attempts().next(), history.last()) {
            (Decision::Try(size), Some(first), Some(last)) if last.outcome.is_out_of_memory() => {
                Decision::Try(halving_size_at_most(first.batch_size, size))
            }
            (decision, _, _) => decision,
        }
    }

    /// A runner that learns grows from its steps' figures itself, between steps: `step_done`
    /// ends no attempt of it.
    fn grow_after_a_step(&self, _history: &SearchReport) -> Option<crate::policy::GrowRule> {
        None
    }

    /// The figures of each step's success are what the runner learns from: one reading of
    /// the allocator's counters (no synchronize), only where it learns.
    fn reads_memory_after_success(&self) -> bool {
        self.learning || self.inner.reads_memory_after_success()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::memory::{DeviceMemory, MemorySnapshot};
    use crate::record::Outcome;

    /// An attempt on a device of 10 000 bytes with `start` bytes live before it and a peak of
    /// `peak` (a success) or a failure asking for `requested` at that peak.
    fn attempt(size: usize, start: u64, peak: u64, outcome: Outcome) -> Attempt {
        let reading = |peak: u64| MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "sim".to_owned(),
                total: 10_000,
                free: 10_000 - start,
                pool_reserved: Some(start),
                pool_used: Some(start),
                peak: Some(peak),
            }],
        };
        Attempt {
            number: 1,
            batch_size: size,
            outcome,
            duration: Default::default(),
            memory_at_start: Some(reading(start)),
            memory_at_end: Some(reading(peak)),
            memory_after_release: None,
            figures: Default::default(),
            rationale: None,
            remedies: None,
            first_step_done: false,
        }
    }

    fn ran(size: usize, start: u64, peak: u64) -> Attempt {
        attempt(size, start, peak, Outcome::Succeeded)
    }

    fn failed(size: usize, start: u64, peak: u64) -> Attempt {
        attempt(
            size,
            start,
            peak,
            Outcome::OutOfMemory {
                error: "out of memory".to_owned(),
            },
        )
    }

    #[test]
    fn two_sizes_find_the_fewest_passes() {
        // 1000 bytes fixed, 30 a sample: 300 fit. A step of 1024 at 128 takes 8 passes.
        let mut learned = Convergence::new(true);
        learned.learn(&ran(128, 1000, 1000 + 128 * 30), 128);
        learned.learn(&ran(64, 1000, 1000 + 64 * 30), 64);
        assert_eq!(learned.limit(), Some(300));
        // 4 passes of 256 (300 would still take 4).
        assert_eq!(learned.start(&Split::Even(1024), 128).0, 256);
        assert_eq!(learned.start(&Split::Even(1024), 256).0, 256);
    }

    #[test]
    fn one_size_guesses_low_where_state_appears_at_the_first_step() {
        // Weights 1000 in use before; the first step allocates 2000 of state and 30 a sample.
        let mut learned = Convergence::new(true);
        learned.learn(&ran(100, 1000, 3000 + 100 * 30), 100);
        let guess = learned.limit().unwrap();
        assert!(guess < (10_000 - 3000) / 30 && guess > 100, "{guess}");
    }

    #[test]
    fn a_failure_caps_and_is_tried_again_later() {
        let mut learned = Convergence::new(true);
        learned.learn(&ran(64, 1000, 1000 + 64 * 30), 64);
        learned.learn(&ran(128, 1000, 1000 + 128 * 30), 128);
        learned.learn(&failed(250, 1000, 9000), 250);
        assert!(learned.limit().unwrap() < 250);
        for _ in 0..REPROBE_AFTER - 1 {
            learned.advance();
            assert!(learned.limit().unwrap() < 250);
        }
        learned.advance();
        assert_eq!(learned.limit(), Some(300), "forgotten: tried once more");
        // It fails again: twice as long before the next try.
        learned.learn(&failed(250, 1000, 9000), 250);
        for _ in 0..2 * REPROBE_AFTER - 1 {
            learned.advance();
            assert!(learned.limit().unwrap() < 250);
        }
    }

    #[test]
    fn a_size_that_fitted_and_fails_makes_the_figures_stale() {
        let mut learned = Convergence::new(true);
        learned.learn(&ran(64, 1000, 1000 + 64 * 30), 64);
        learned.learn(&ran(128, 1000, 1000 + 128 * 30), 128);
        assert_eq!(learned.fitted(), Some(128));
        // Another process took 4000 bytes: 128 no longer fits.
        learned.learn(&failed(128, 5000, 9900), 128);
        assert_eq!(learned.fitted(), None);
        assert_eq!(learned.limit(), None);
        learned.learn(&ran(96, 5000, 5000 + 96 * 30), 96);
        assert_eq!(learned.fitted(), Some(96));
        assert!(learned.limit().unwrap() < 128);
    }

    #[test]
    fn nothing_is_proposed_when_off_or_without_figures() {
        let mut off = Convergence::new(false);
        off.learn(&ran(64, 1000, 1000 + 64 * 30), 64);
        off.learn(&ran(128, 1000, 1000 + 128 * 30), 128);
        assert_eq!(off.limit(), None);
        assert_eq!(off.fitted(), Some(128));
        let mut blind = Convergence::new(true);
        let mut no_figures = ran(64, 0, 0);
        no_figures.memory_at_start = None;
        no_figures.memory_at_end = None;
        blind.learn(&no_figures, 64);
        assert_eq!(blind.limit(), None);
        assert_eq!(blind.fitted(), Some(64));
    }
}
