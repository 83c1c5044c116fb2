//! The tuner's search, as a size policy: bracket the largest size that fits (grow, jump to
//! the fitted limit, bisect), confirm the headroom's size, and for the fastest size descend by
//! powers of two; never keep a size above one that failed.

use std::borrow::Cow;

use super::throughput::{fastest, throughput};
use super::Choice;
use crate::error::StopReason;
use crate::policy::{Decision, SizePolicy};
use crate::record::{Attempt, Outcome, SearchReport};
use crate::runners::learn::fit::{
    failure_above, growth_in_attempt, peak_bytes, peak_resolution, points_up_to, used_at_start,
    MemoryFit, Point, GENTLER,
};

mod aim;

/// The size kept with the headroom below `largest`.
pub(super) fn kept_size(largest: usize, headroom: f64, min: usize) -> usize {
    let target = ((largest as f64) * (1.0 - headroom)).floor() as usize;
    target.max(min).min(largest)
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
enum Phase {
    /// Bracketing the largest size that fits: growing, jumping to the fitted limit, bisecting.
    #[default]
    Searching,
    /// The headroom's size is being confirmed.
    Confirming,
    /// For the fastest size: powers of two below the headroom's size, downwards.
    Descending,
    /// The fastest size runs last, so that it is the search's answer (and the cache's).
    Final,
}

/// What the search knows of the bracket it is in: started afresh (its default) where a trial
/// failed below a size that ran, since what ran before had other memory free.
#[derive(Debug, Default, Clone)]
struct Bracket {
    phase: Phase,
    /// The headroom's size, once it ran.
    kept: usize,
    /// The last size the memory fit chose, and whether it expected that trial to fit.
    guess: Option<(usize, bool)>,
    /// Once bracketed: the bracket's width in ratio (ln(high / low)) when the fit chose the
    /// last trial. A fit's trial that did not halve it is followed by a bisection, as in
    /// Brent's method: two trials at least halve the bracket, whatever the fit says.
    guessed_in: Option<f64>,
    /// The size of the last aim, until its outcome is scored, and whether a fit through two
    /// sizes chose it (only such a trial confirms the fit's headroom).
    aimed: Option<(usize, bool)>,
    /// The bytes the fit that chose the last aim predicted at its size, where a failure above
    /// bent that fit.
    predicted: Option<f64>,
    /// The gentler slope's size (see [`gentler`](TunerPolicy::gentler)), until it has run,
    /// and the smaller size of the line across the jump that chose it.
    gentler_aim: Option<(usize, f64)>,
    /// Where the gentler slope's size ran: the size below which a part appeared (the smaller
    /// size of the line across the jump). From then on the fit's line is drawn through the
    /// sizes above it only (see [`fit`](TunerPolicy::fit)).
    jump_above: Option<f64>,
    /// The size the fit kept from a line drawn far below it, while the size a headroom above
    /// it runs to measure the slope there (see [`near_check`](TunerPolicy::near_check)).
    far_check: Option<usize>,
}

/// What the tuner is asked for: never below `min` nor above `max`, the `headroom` kept below
/// the largest size that ran, in at most `max_trials` trials; for `choice`, within `tolerance`
/// of the best speed, which the search's report gives (each trial's duration).
#[derive(Debug, Clone, Copy)]
pub(super) struct Goal {
    /// No size below it is tried; the first trial runs it.
    pub(super) min: usize,
    /// No size above it is tried (`with_max`, or the dry runs' size less one).
    pub(super) max: Option<usize>,
    /// The share kept below the largest size that ran (`with_headroom`).
    pub(super) headroom: f64,
    /// At most this many trials (`with_max_trials`).
    pub(super) max_trials: usize,
    /// The largest size, or the fastest.
    pub(super) choice: Choice,
    /// For the fastest: how far below the best samples a second a size may be.
    pub(super) tolerance: f64,
}

/// Where a rerun starts from the cache: the size the entry kept, whether the search grows from
/// it (the run that wrote it ran out of trials before its search ended, or the device has more
/// room now) or accepts it in one trial, and the smallest size the entry saw fail above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CachedStart {
    pub(super) size: usize,
    pub(super) grow: bool,
    pub(super) failed_at: Option<usize>,
}

#[derive(Debug, Clone)]
pub(super) struct TunerPolicy {
    goal: Goal,
    /// The cache's size, where a rerun starts from it; gone once it failed (then the search
    /// starts at `min`, as a first run does).
    cached: Option<CachedStart>,
    /// Trials run so far, every one counted (a retry after a pool's leftovers included): what
    /// the budget is held to, whatever the history the search reads leaves out.
    spent: usize,
    /// The budget ended the search while it still had a larger size to try: a rerun from the
    /// cache grows from the size found.
    cut_by_budget: bool,
    /// The bracket's state: the phase, the size kept, the fit's last guess and aim.
    bracket: Bracket,
    /// While descending: the last size measured.
    below: usize,
    /// Before any failure: trials the fit got wrong the costly way (expected to fail, they
    /// fit, or they fit with more than the headroom to spare). Each doubles the least step
    /// above the largest success, so that a fit that does not describe the trial costs a few
    /// trials, not a crawl.
    misses: u32,
    /// Trials the fit expected to fit that failed. At two the fit is dropped for bisection:
    /// what fails is not explained by the memory the trials use (a limit that is not the
    /// device's memory, an allocator that cannot use all of it).
    overshoots: u32,
    /// Why the last decision went below a size that had run, when it did.
    rationale: Option<String>,
    /// Bytes the user declared the trial allocates whatever its size (weights, gradients, an
    /// optimizer's state allocated inside it): with one size run, the line's part at size 0.
    fixed_memory: Option<u64>,
    /// Trials the memory fit chose directly (probes and aims at its headroom's size).
    aims: u32,
    /// Aims that ran with more room than the resolution: each doubles the least step above
    /// them, so that a fit that misses (a part that appears above some size) costs a few
    /// trials, not a crawl.
    aim_misses: u32,
    /// An aim judged by a line from far below it was followed by that line's size (or the
    /// size a headroom above it ran): from then on an aim within the resolution of the fit's
    /// size is the answer.
    ran_past_far_line: bool,
    /// The fit no longer chooses sizes: it failed twice, had a failed size fitting, or took
    /// [`MOST_AIMS`] trials. Bisection (or the headroom below the largest that ran) follows.
    aiming_over: bool,
}

/// At most this many trials chosen by the fit's aim (the second probe, the aim, corrections);
/// then the search bisects, or keeps the headroom below the largest size that ran.
const MOST_AIMS: u32 = 5;

/// Sizes this far apart with the same peak: the trial does not run at its size. Far enough
/// apart that a small model's growth is not lost in an allocator's rounding (2 MiB blocks hide
/// under 140 KiB a sample at 16×). Also how much larger each trial is while the figures have
/// not resolved any growth (see [`growth_unresolved`]).
const FLAT_MEMORY_SPAN: usize = 16;

/// The least a sample of a training step allocates: its input, its activations and their
/// gradients (a 28×28 image's input alone is 3 KiB). Where the figures cannot resolve a growth
/// under some bytes (see [`peak_resolution`]), memory is flat only over a span of sizes at
/// least that many bytes wide: a small model in a large process (libtorch's 620 MiB, a few
/// MiB of resolution) is grown until its growth shows, while a child that ignores its size
/// (10 MiB of resolution in 700 MiB) is caught by 4,096 samples, not at a size 65 times the
/// fit (a byte a sample asked for ten million).
const LEAST_BYTES_A_SAMPLE: u64 = 4 << 10;

/// Figures counted in whole MiB (a child's) differ by up to one from rounding alone: two
/// peaks in whole MiB are flat within one.
const MIB: u64 = 1 << 20;

/// How far apart two peaks may be and still be the same memory: what the figures resolve, and
/// at least a MiB where both are counted in whole MiB.
fn flat_tolerance(resolution: u64, peaks: [u64; 2]) -> u64 {
    let rounded = peaks.iter().all(|peak| peak % MIB == 0);
    if rounded {
        resolution.max(MIB)
    } else {
        resolution
    }
}

/// The last trial's peak is no higher than that of a size at most 1/16 of it (or the other way
/// round), by more than the figures resolve (a MiB where they are rounded to whole MiB), over a
/// span of sizes wide enough that a trial that runs at its size would have shown its growth
/// (at [`LEAST_BYTES_A_SAMPLE`], more than the figures resolve and more than they grew): the
/// trial's memory does not depend on its size. Only trials since the memory last changed count: a small size run after another
/// process took memory shows its memory too.
fn memory_does_not_grow(history: &SearchReport) -> Option<StopReason> {
    // Each trial's own peak (above what was held at its start): memory other work frees
    // between trials lowers a whole-device peak, not a trial's own.
    let last = history.last().filter(|last| last.outcome.is_success())?;
    let peak = last.figures.peak?;
    let resolution = peak_resolution(last);
    history
        .attempts()
        .skip(since_memory_changed(history))
        .filter(|attempt| attempt.outcome.is_success())
        .filter_map(|attempt| Some((attempt.batch_size, attempt.figures.peak?)))
        .find_map(|(size, other_peak)| {
            let (smaller, larger, small_peak, large_peak) = if size < last.batch_size {
                (size, last.batch_size, other_peak, peak)
            } else {
                (last.batch_size, size, peak, other_peak)
            };
            let span = (larger - smaller) as u64;
            // Flat within what the figures resolve, and the growth they show (noise, rounding)
            // less than the span's samples would add at the least a sample allocates.
            let growth = large_peak.saturating_sub(small_peak);
            (larger >= smaller.saturating_mul(FLAT_MEMORY_SPAN)
                && growth <= flat_tolerance(resolution, [small_peak, large_peak])
                && span.saturating_mul(LEAST_BYTES_A_SAMPLE) >= resolution.max(growth))
            .then_some(StopReason::MemoryDoesNotGrow {
                smaller,
                larger,
                peak: large_peak,
            })
        })
}

/// Whether the trials since the memory last changed all ran, and neither any trial's own
/// growth (its peak above what was in use when it started) nor the spread of their peaks is
/// above what the figures resolve (see [`peak_resolution`]): a line through them would be
/// noise.
fn growth_unresolved(history: &SearchReport) -> bool {
    let attempts = || history.attempts().skip(since_memory_changed(history));
    if attempts().any(|attempt| !attempt.outcome.is_success()) {
        return false;
    }
    let Some(resolution) = history.last().map(peak_resolution).filter(|&r| r > 0) else {
        return false;
    };
    let mut peaks = Vec::new();
    for attempt in attempts() {
        match (peak_bytes(attempt), growth_in_attempt(attempt)) {
            (Some((peak, _)), Some(growth)) if growth <= resolution => peaks.push(peak),
            _ => return false,
        }
    }
    match (peaks.iter().min(), peaks.iter().max()) {
        (Some(least), Some(most)) => most - least <= resolution,
        _ => false,
    }
}

/// The largest power of two below `size` (0 for 1 and 0).
fn power_of_two_below(size: usize) -> usize {
    match size {
        0 | 1 => 0,
        _ => 1 << (usize::BITS - 1 - (size - 1).leading_zeros()),
    }
}

impl TunerPolicy {
    /// The search for `goal`.
    pub(super) fn new(goal: Goal) -> Self {
        TunerPolicy {
            goal,
            cached: None,
            spent: 0,
            cut_by_budget: false,
            bracket: Bracket::default(),
            below: 0,
            misses: 0,
            overshoots: 0,
            rationale: None,
            fixed_memory: None,
            aims: 0,
            aim_misses: 0,
            ran_past_far_line: false,
            aiming_over: false,
        }
    }

    /// The headroom's size, once its trial ran (0 before, and after a failure below it): read by
    /// the tuner when the search, to which it lent this policy, has returned.
    pub(super) fn kept_size(&self) -> usize {
        self.bracket.kept
    }

    /// A rerun that starts from the cache's size (validated by the tuner: in its range).
    pub(super) fn with_cached_start(mut self, cached: Option<CachedStart>) -> Self {
        self.cached = cached;
        self
    }

    /// Whether the budget ended the search while it had a larger size to try.
    pub(super) fn cut_by_budget(&self) -> bool {
        self.cut_by_budget
    }

    /// Bytes the trial allocates whatever its size, as the user declared them.
    pub(super) fn with_fixed_memory(mut self, bytes: Option<u64>) -> Self {
        self.fixed_memory = bytes;
        self
    }

    fn cap(&self, size: usize) -> usize {
        self.goal.max.map_or(size, |max| size.min(max))
    }

    /// Whether the fit's last guess held: a failure where it expected a fit is an overshoot; a
    /// fit where it expected a failure, or a fit with more than the headroom to spare by the
    /// fit's own new reckoning, is a miss.
    fn score_guess(&mut self, last: &Attempt, limit: Option<usize>) {
        let Some((size, expected_to_fit)) = self.bracket.guess.take() else {
            return;
        };
        if last.batch_size != size {
            return;
        }
        if !last.outcome.is_success() {
            self.overshoots += u32::from(expected_to_fit);
            return;
        }
        let spare =
            limit.is_some_and(|limit| limit as f64 > size as f64 * (1.0 + self.goal.headroom));
        if !expected_to_fit || spare {
            self.misses += 1;
        }
    }

    /// How close the largest success and the smallest failure must be for the search to stop:
    /// a quarter of the headroom (at least 1), so that the headroom's size stays within about 1 %
    /// of the largest that fits less the headroom. Bisecting further would refine a size the
    /// headroom then takes 5 % off.
    fn resolution(&self, low: usize) -> usize {
        ((low as f64 * self.goal.headroom / 4.0).floor() as usize).max(1)
    }

    /// The end of the search for the largest: the headroom's size if it has not run yet. With
    /// no trial left to run it, the largest size that ran where it ran last (the headroom is
    /// lost, not the size's trial), else the largest that ran at or below the headroom's size
    /// (or, where none did, the largest that ran): the answer always ran.
    fn finish(&mut self, history: &SearchReport) -> Decision {
        let largest = largest_below_failures(history).unwrap_or(0);
        let target = kept_size(largest, self.goal.headroom, self.goal.min);
        if target == 0 {
            return Decision::Accept;
        }
        if ran_last(history, target) {
            return self.kept(history, target);
        }
        if self.spent >= self.goal.max_trials {
            return self.out_of_trials(history, largest, target);
        }
        self.bracket.phase = Phase::Confirming;
        Decision::Try(target)
    }

    /// No trial left to confirm the headroom's size `target` below `largest`: the answer is a
    /// size that ran since the memory last changed, below every failure: `largest` where it
    /// ran last (the headroom is lost, not the size's trial), else the largest at or below
    /// `target`, else the largest. Where none ran since, nothing is kept: the engine runs
    /// below the failure, and its size is the answer.
    fn out_of_trials(&mut self, history: &SearchReport, largest: usize, target: usize) -> Decision {
        if ran_last(history, largest) {
            return self.kept(history, largest);
        }
        let since = since_memory_changed(history);
        let smallest_failure = smallest_failure(history);
        let ran: Vec<usize> = history
            .attempts()
            .skip(since)
            .filter(|attempt| attempt.outcome.is_success())
            .map(|attempt| attempt.batch_size)
            .filter(|&size| size < smallest_failure)
            .collect();
        let below_target = ran.iter().copied().filter(|&size| size <= target).max();
        match below_target.or_else(|| ran.iter().copied().max()) {
            Some(size) => self.kept(history, size),
            // Nothing ran since the memory shrank: accepting would keep a size above the
            // failure, and the engine would step below it trial after trial, past the budget.
            // No size has run in the memory there is now: the search stops, out of trials.
            None => {
                self.bracket.kept = 0;
                self.cut_by_budget = true;
                Decision::Stop(StopReason::MaxAttempts(self.spent))
            }
        }
    }

    /// The budget's last trial, where the headroom's size below the largest that ran has run
    /// already: the search's next size, less the headroom where the fit did not aim it with the
    /// headroom taken, so that its success is the answer; its failure leaves the headroom's size
    /// that ran. Nothing larger to try: the search ends.
    fn last_trial(&mut self, history: &SearchReport, decision: Decision, low: usize) -> Decision {
        let Decision::Try(next) = decision else {
            return decision;
        };
        if self.bracket.phase != Phase::Searching {
            return decision;
        }
        let aimed_with_headroom = self
            .bracket
            .aimed
            .is_some_and(|(size, judged)| size == next && judged);
        let answer = if aimed_with_headroom {
            next
        } else {
            kept_size(next, self.goal.headroom, self.goal.min)
        };
        if answer <= kept_size(low, self.goal.headroom, self.goal.min) {
            return self.finish(history);
        }
        // A step of the search the budget made its last (unless the fit aimed it with the
        // headroom taken, where its success ends the search anyway).
        self.cut_by_budget = !aimed_with_headroom;
        self.bracket.aimed = None;
        self.bracket.guess = None;
        self.bracket.phase = Phase::Confirming;
        Decision::Try(answer)
    }

    /// The headroom's size ran: the answer, or the start of the search for the fastest.
    fn kept(&mut self, history: &SearchReport, size: usize) -> Decision {
        self.bracket.kept = size;
        if self.goal.choice == Choice::Largest {
            return Decision::Accept;
        }
        self.bracket.phase = Phase::Descending;
        self.below = size;
        self.descend(history)
    }

    /// Powers of two below the headroom's size, downwards, until one is slower than the best by
    /// more than the tolerance; sizes measured already are not run again.
    fn descend(&mut self, history: &SearchReport) -> Decision {
        if history
            .last()
            .is_some_and(|last| !last.outcome.is_success())
        {
            return self.conclude(history);
        }
        let throughput = throughput(history);
        let rate = |size: usize| {
            throughput
                .iter()
                .find(|(measured, _)| *measured == size)
                .map(|(_, rate)| *rate)
        };
        let best = throughput
            .iter()
            .filter(|(size, _)| *size <= self.bracket.kept)
            .map(|(_, rate)| *rate)
            .fold(0.0, f64::max);
        loop {
            if self.below < self.bracket.kept
                && rate(self.below).is_some_and(|rate| rate < best * (1.0 - self.goal.tolerance))
            {
                return self.conclude(history);
            }
            let next = power_of_two_below(self.below);
            if next < self.goal.min || next == 0 {
                return self.conclude(history);
            }
            self.below = next;
            if rate(next).is_none() {
                // One trial is kept for the fastest size.
                if self.spent + 2 > self.goal.max_trials {
                    return self.conclude(history);
                }
                return Decision::Try(next);
            }
        }
    }

    /// The fastest size runs last, unless it just ran or no trial is left.
    fn conclude(&mut self, history: &SearchReport) -> Decision {
        let chosen = fastest(&throughput(history), self.bracket.kept, self.goal.tolerance)
            .unwrap_or(self.bracket.kept);
        if ran_last(history, chosen) || self.spent >= self.goal.max_trials {
            return Decision::Accept;
        }
        self.bracket.phase = Phase::Final;
        Decision::Try(chosen)
    }
}

impl SizePolicy for TunerPolicy {
    fn first(&mut self, starting: usize) -> Decision {
        match self.cached {
            Some(cached) => Decision::Try(self.cap(cached.size.max(self.goal.min))),
            None => Decision::Try(self.cap(starting.max(self.goal.min))),
        }
    }

    fn reads_memory_after_success(&self) -> bool {
        true
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone()
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        self.spent = history.len();
        let history = without_leftover_failures(history);
        let history = history.as_ref();
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        self.rationale = None;
        if let Some(decision) = self.after_the_cached_size(history, last) {
            return decision;
        }
        if let Some(reason) = memory_does_not_grow(history) {
            return Decision::Stop(reason);
        }
        if let Some(ran) = ran_above_failure(history, last) {
            // Less memory than when a larger size ran (fragmentation, memory an allocator
            // kept, another process): never keep that size; search again below the failure.
            // The engine's WARN line for the failure gives this rationale.
            self.rationale = Some(format!(
                "batch size {} ran out of memory after {ran} ran: less memory is free than \
                 then (fragmentation, memory kept by an allocator, another process); \
                 searching below {}",
                last.batch_size, last.batch_size
            ));
            self.bracket = Bracket::default();
        }
        match self.bracket.phase {
            Phase::Confirming if last.outcome.is_success() => {
                return self.kept(history, last.batch_size)
            }
            Phase::Final if last.outcome.is_success() => return Decision::Accept,
            Phase::Descending if last.outcome.is_success() => return self.descend(history),
            // A failure after the search is below a size that ran: searched again above.
            _ => self.bracket.phase = Phase::Searching,
        }
        // The smallest failure: the largest success is taken below it. A cached entry's failure
        // bounds the growth from its size as this search's own would.
        let high = history
            .attempts()
            .filter(|attempt| attempt.outcome.is_out_of_memory())
            .map(|attempt| attempt.batch_size)
            .chain(self.cached.and_then(|cached| cached.failed_at))
            .min();
        let Some(low) = largest_below_failures(history) else {
            // Nothing ran below the smallest failure (even the first probe failed): smaller,
            // as a shrinking search would.
            let failed = high.unwrap_or(last.batch_size);
            return match last.outcome {
                _ if self.spent >= self.goal.max_trials => {
                    Decision::Stop(StopReason::MaxAttempts(self.spent))
                }
                Outcome::OutOfMemory { .. } if failed / 2 >= self.goal.min => {
                    Decision::Try(failed / 2)
                }
                _ => Decision::Stop(StopReason::BelowMinimum {
                    next: failed / 2,
                    min: self.goal.min,
                }),
            };
        };
        // One trial is kept back for the headroom's size, unless that size has run already:
        // then the last trial is the search's too, aimed where its success is the answer.
        let left = self.goal.max_trials.saturating_sub(self.spent);
        // A rerun growing from the cache's size: that size was kept with the headroom already.
        let growing_from_cache = self.cached.is_some_and(|cached| cached.size == low);
        let headroom_ran = growing_from_cache
            || ran_below_failures(history, kept_size(low, self.goal.headroom, self.goal.min));
        if left == 0 || (left == 1 && !headroom_ran) {
            // Whether the search had a larger size to try (asked of a copy: nothing it
            // decides now runs).
            let next = self.clone().search(history, last, low, high);
            self.cut_by_budget = matches!(next, Decision::Try(next) if next > low);
            return self.finish(history);
        }
        let decision = self.search(history, last, low, high);
        if left == 1 {
            return self.last_trial(history, decision, low);
        }
        decision
    }
}

impl TunerPolicy {
    /// A rerun's first trial ran the cache's size: where its entry's search had ended, that
    /// size is the answer, in one trial; where it failed, the cache is not trusted and the
    /// search starts at `min`, as a first run does (that failure bounds it). `None` otherwise:
    /// the search goes on, growing from the cached size.
    fn after_the_cached_size(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
    ) -> Option<Decision> {
        let cached = self.cached?;
        if history.len() != 1 || last.batch_size != self.cap(cached.size.max(self.goal.min)) {
            return None;
        }
        if last.outcome.is_success() {
            if cached.grow {
                return None;
            }
            self.bracket.kept = last.batch_size;
            return Some(Decision::Accept);
        }
        self.cached = None;
        if !last.outcome.is_out_of_memory() || last.batch_size <= self.goal.min {
            return None;
        }
        if self.spent >= self.goal.max_trials {
            return Some(Decision::Stop(StopReason::MaxAttempts(self.spent)));
        }
        self.rationale = Some(format!(
            "batch size {}, from the cache, ran out of memory: tuning from {}, as a first run does",
            last.batch_size, self.goal.min
        ));
        Some(Decision::Try(self.goal.min))
    }

    /// A rerun growing from the cache's size, whose trial is the only one measured: the size
    /// that fills the device on the line through zero and that trial's own bytes (its fixed
    /// part counted as growing with the size, so the line never promises more room than there
    /// is), below any failure the entry kept. Each rerun lands nearer the limit. `None` without
    /// figures, or once the search has more to go on: its own rules follow.
    fn grown_from_the_cached_size(
        &self,
        history: &SearchReport,
        low: usize,
        high: Option<usize>,
    ) -> Option<usize> {
        self.cached
            .filter(|cached| cached.grow && cached.size == low)?;
        let [only] = history.attempts().collect::<Vec<_>>()[..] else {
            return None;
        };
        // A child trial's figures come with it: no reading from before the first trial, and
        // its peak is the step's own.
        let (peak, total) = peak_bytes(only).or_else(|| {
            let [device] = only.memory_at_end.as_ref()?.devices.as_slice() else {
                return None;
            };
            Some((device.peak?, device.total))
        })?;
        let before = used_at_start(only).unwrap_or(0);
        let own = peak.checked_sub(before).filter(|&own| own > 0)?;
        let room = total.saturating_sub(before);
        let filling = (low as f64 * room as f64 / own as f64).floor();
        let next = if filling >= usize::MAX as f64 {
            usize::MAX
        } else {
            filling as usize
        };
        let next = self
            .cap(next.min(low.saturating_mul(FARTHEST_JUMP)))
            .min(high.map_or(usize::MAX, |high| high - 1));
        (next > low).then_some(next)
    }

    /// The next trial while bracketing the largest size that fits, between `low` (the largest
    /// that ran below every failure) and `high` (the smallest failure).
    fn search(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
        low: usize,
        high: Option<usize>,
    ) -> Decision {
        if let Some(next) = self.grown_from_the_cached_size(history, low, high) {
            return Decision::Try(next);
        }
        if high.is_none() && growth_unresolved(history) {
            // A small step in a large process: grown until its growth shows, never fitted
            // from the noise (a line through it would jump by its whims, or not at all).
            let next = self.cap(low.saturating_mul(FLAT_MEMORY_SPAN));
            if next > low {
                return Decision::Try(next);
            }
            return self.finish(history);
        }
        if let Some(decision) = self.aim(history, last, low, high) {
            return decision;
        }
        if self.goal.max.is_some_and(|max| low >= max) {
            return self.finish(history);
        }
        let resolution = self.resolution(low);
        if high.is_some_and(|high| high.saturating_sub(low) <= resolution) {
            return self.finish(history);
        }
        let limit = MemoryFit::new(history, low).and_then(|fit| fit.limit());
        self.score_guess(last, limit);
        // A fit that has a failed size fitting, or whose guesses failed twice, does not
        // describe the trial: bisect.
        let limit = limit
            .filter(|&limit| high.is_none_or(|high| limit < high))
            .filter(|_| self.overshoots < 2);
        let mut guess = None;
        let next = match (limit, high) {
            // Growing: the fit's limit, or a step above the largest success where the fit puts
            // the limit closer than that (a failure there ends the search).
            (Some(limit), None) => {
                let step = resolution
                    .saturating_mul(1usize.checked_shl(self.misses).unwrap_or(usize::MAX));
                guess = Some(limit);
                limit
                    .max(low.saturating_add(step))
                    .min(low.saturating_mul(FARTHEST_JUMP))
            }
            // Bracketed: the fit's limit, unless its last trial left the bracket more than half
            // as wide (in ratio) as it found it.
            (Some(limit), Some(high)) => {
                let width = (high as f64 / low as f64).ln();
                if self
                    .bracket
                    .guessed_in
                    .take()
                    .is_some_and(|before| width > before / 2.0)
                {
                    geometric_middle(low, high)
                } else {
                    self.bracket.guessed_in = Some(width);
                    guess = Some(limit);
                    limit.max(low.saturating_add(resolution))
                }
            }
            // Without figures: grow, then bisect. A failure far above the limit costs no more
            // than one just above it (it fails at its first large allocation).
            (None, None) => low.saturating_mul(GROWTH),
            (None, Some(high)) => {
                self.bracket.guessed_in = None;
                geometric_middle(low, high)
            }
        };
        let next = self.cap(next).min(high.map_or(usize::MAX, |high| high - 1));
        if next <= low {
            return self.finish(history);
        }
        self.bracket.guess = guess.map(|limit| (next, next <= limit));
        Decision::Try(next)
    }
}

/// Without figures, how much larger each trial is until one fails.
const GROWTH: usize = 4;

/// The farthest the fit may send the next trial, as a multiple of the largest success: a
/// slope fitted to small sizes and lost in an allocator's rounding could otherwise ask for
/// millions of samples (and the host memory to build them).
const FARTHEST_JUMP: usize = 128;

/// The geometric middle of a bracket, strictly inside it where there is room: a bracket of
/// 16 to 64 is halved in ratio (32), not in width (40).
fn geometric_middle(low: usize, high: usize) -> usize {
    let middle = ((low as f64) * (high as f64)).sqrt().floor() as usize;
    middle.clamp(
        low.saturating_add(1),
        high.saturating_sub(1).max(low.saturating_add(1)),
    )
}

/// The history without the failures the engine ran again at once at the same size (a pool held
/// memory from earlier work when they started; the engine gave it back and retried): such a
/// failure proves nothing about its size and bounds nothing. The tuner itself never proposes a
/// size at or above one that failed, so a failure followed by the same size is the engine's
/// retry.
pub(super) fn without_leftover_failures(history: &SearchReport) -> Cow<'_, SearchReport> {
    let attempts: Vec<&Attempt> = history.attempts().collect();
    let retried = |index: usize| {
        attempts[index].outcome.is_out_of_memory()
            && attempts
                .get(index + 1)
                .is_some_and(|next| next.batch_size == attempts[index].batch_size)
    };
    if !(0..attempts.len()).any(retried) {
        return Cow::Borrowed(history);
    }
    let mut kept = SearchReport::default();
    for (index, attempt) in attempts.iter().enumerate() {
        if !retried(index) {
            kept.push((*attempt).clone());
        }
    }
    Cow::Owned(kept)
}

/// Whether the last trial ran `size` and succeeded.
fn ran_last(history: &SearchReport, size: usize) -> bool {
    history
        .last()
        .is_some_and(|last| last.outcome.is_success() && last.batch_size == size)
}

/// Whether `size` ran below every size that failed, since the memory last changed.
fn ran_below_failures(history: &SearchReport, size: usize) -> bool {
    let smallest_failure = smallest_failure(history);
    size < smallest_failure
        && history
            .attempts()
            .skip(since_memory_changed(history))
            .any(|attempt| attempt.outcome.is_success() && attempt.batch_size == size)
}

/// The smallest size that ran out of memory (`usize::MAX` where none did).
fn smallest_failure(history: &SearchReport) -> usize {
    history
        .attempts()
        .filter(|attempt| attempt.outcome.is_out_of_memory())
        .map(|attempt| attempt.batch_size)
        .min()
        .unwrap_or(usize::MAX)
}

/// The largest size that ran below every size that failed: what the tuner counts as fitting.
/// A size that ran before a smaller one failed does not count (the memory it had is gone).
pub(super) fn largest_below_failures(history: &SearchReport) -> Option<usize> {
    let smallest_failure = smallest_failure(history);
    history
        .attempts()
        .filter(|attempt| attempt.outcome.is_success() && attempt.batch_size < smallest_failure)
        .map(|attempt| attempt.batch_size)
        .max()
}

/// The largest size that ran at or above `last`'s, where `last` ran out of memory: a trial
/// failed below a size that ran.
fn ran_above_failure(history: &SearchReport, last: &Attempt) -> Option<usize> {
    if !last.outcome.is_out_of_memory() {
        return None;
    }
    history
        .attempts()
        .filter(|attempt| attempt.outcome.is_success() && attempt.batch_size >= last.batch_size)
        .map(|attempt| attempt.batch_size)
        .max()
}

/// The number of trials up to and including the last failure below a size that ran before it:
/// what ran before had other memory free.
fn since_memory_changed(history: &SearchReport) -> usize {
    let attempts: Vec<&Attempt> = history.attempts().collect();
    (0..attempts.len())
        .rev()
        .find(|&index| {
            let failed = attempts[index];
            failed.outcome.is_out_of_memory()
                && attempts[..index].iter().any(|earlier| {
                    earlier.outcome.is_success() && earlier.batch_size >= failed.batch_size
                })
        })
        .map_or(0, |index| index + 1)
}

/// The slope of memory against size through the sizes at or below the fit's smaller size (up
/// to `low`), where it is [`GENTLER`] times gentler than the fit's: a part appeared between
/// the fit's two sizes. `None` where it is not, or too few sizes ran below.
fn gentler_slope_below(history: &SearchReport, low: usize, fit: &MemoryFit) -> Option<f64> {
    let since = since_memory_changed(history);
    let below: Vec<Point> = points_up_to(history.attempts().skip(since), low)
        .into_iter()
        .filter(|point| (point.size as f64) <= fit.smaller())
        .collect();
    let slope = MemoryFit::from_points(&below, None)?.per_sample();
    (slope * GENTLER < fit.per_sample()).then_some(slope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_headroom_is_taken_off_and_never_below_min() {
        assert_eq!(kept_size(100, 0.05, 1), 95);
        assert_eq!(kept_size(10, 0.5, 8), 8);
        assert_eq!(kept_size(3, 0.05, 8), 3, "never above the size that ran");
    }

    #[test]
    fn powers_of_two_and_middles_in_ratio() {
        assert_eq!(power_of_two_below(1), 0);
        assert_eq!(power_of_two_below(65), 64);
        assert_eq!(power_of_two_below(64), 32);
        let middle = geometric_middle(16, 64);
        assert!(
            middle > 16 && middle < 64 && middle.abs_diff(32) <= 1,
            "{middle}"
        );
    }
}
