//! The one search loop's state: which size comes next, the record of every attempt, and the
//! rules every policy is held to. The engine's `drive` runs it for every runner and for the
//! attribute's generated code; it is public for loops of your own.

use std::error::Error;
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::step::{self, Grown, StepWatch, MAX_GROWTHS};
use super::{ActivePolicy, Hooks, Invalid, Settings};
use crate::agree::Agree;
use crate::engine::dispatch::OomRules;
use crate::error::KeptError;
use crate::error::{NoExecutableBatchSize, StopReason};
use crate::memory::{Bytes, MemorySnapshot, Release};
use crate::oom::{self, OomMatch};
use crate::policy::{figures_of, Decision, SizePolicy};
use crate::policy::{Cached, Remediate};
use crate::record::{self, Attempt, CacheHit, Figures, Outcome, SearchReport};
use crate::unwind::PanicPayload;

#[derive(Debug)]
enum Next {
    Size(usize),
    Stop(StopReason),
    /// The policy accepted: the search ended with a success.
    Accepted,
    /// The search ended otherwise (an error, a panic, no size).
    Ended,
}

#[derive(Debug)]
struct Running {
    batch_size: usize,
    started: Instant,
    /// When it started by the caller's clock, where one was given.
    started_by_clock: Option<Duration>,
    memory_at_start: Option<MemorySnapshot>,
    /// The remedies in force, where a policy applies any.
    remedies: Option<String>,
    /// Out-of-memory panics on the framework's own threads since the attempt began.
    side_threads: crate::panic_filter::SideWatch,
}

/// One search in progress: [`begin`](Self::begin) an attempt, then report how it ended with
/// [`succeeded`](Self::succeeded), [`out_of_memory`](Self::out_of_memory),
/// [`failed`](Self::failed) or [`panicked`](Self::panicked). After `succeeded`,
/// [`is_accepted`](Self::is_accepted) says whether the policy ended the search there (a policy
/// that grows, or runs many chunks, asks for more attempts).
///
/// ```
/// use batch_size_runtime::{oom, BatchSizeSearch, OutOfMemory};
///
/// let mut search = BatchSizeSearch::new(8).start();
/// let fitted = loop {
///     let batch_size = search.begin()?;
///     if batch_size > 2 {
///         let error = OutOfMemory::new();
///         search.out_of_memory(oom::classify_error(&error).unwrap(), None);
///         continue;
///     }
///     search.succeeded();
///     if search.is_accepted() {
///         break batch_size;
///     }
/// };
/// assert_eq!(fitted, 2);
/// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
/// ```
#[derive(Debug)]
pub struct Search<'r> {
    policy: ActivePolicy<'r>,
    hooks: Option<Box<Hooks<'r>>>,
    min: usize,
    max_attempts: Option<usize>,
    /// No size above it runs: `with_max`, or the batch-size parameter's type's largest.
    max_size: usize,
    label: &'static str,
    release: Release,
    next: Next,
    running: Option<Running>,
    report: SearchReport,
    /// The search ended and `report` is whole: the driver takes it as a value; a loop of the
    /// user's own publishes it to `last_report()` (the public methods below).
    finished: bool,
    last_error: Option<KeptError>,
    smallest_failed: Option<usize>,
    succeeded_once: bool,
    /// The engine, not the policy, chose the attempt running: below a failure that came after
    /// a larger size ran. Its success ends the search.
    retrying_below: bool,
    rationale: Option<String>,
    first_fit_at_debug: bool,
    /// The cached size the search starts from and what its entry says, where it does.
    cache_offer: Option<(usize, CacheHit)>,
    /// Each size the policy proposed after a failure on the same work, with how many times:
    /// a proposal the engine turns into another size (one above `with_max` runs below the
    /// failure) never repeats a size that ran, yet may repeat for ever.
    proposed_after_failure: Vec<(usize, usize)>,
    /// What the running attempt's first step is measured against, until the driver takes it.
    watch: Option<Arc<StepWatch>>,
    /// How many attempts ended to grow after their first step, long reaches from far below
    /// aside ([`MAX_GROWTHS`] of them at most).
    growths: usize,
    /// Every growth, long reaches included (twice [`MAX_GROWTHS`] at most).
    all_growths: usize,
}

/// A growth to more than this many times its size is a long reach from far below (steps
/// measured where the figures are coarse next to them): it does not count against
/// [`MAX_GROWTHS`].
const LONG_REACH: usize = 2;

impl<'r> Search<'r> {
    /// The search from `starting` with `settings`: its policy wrapped as the settings ask, in
    /// one order (remedies around the size rule, the cache around them, since it remembers the
    /// remedies' levels with the size; the agreement outermost, so that every rank sees the
    /// same verdict, cached or not), and every setting checked before the first attempt.
    #[inline]
    pub(crate) fn start(starting: usize, mut settings: Settings<'r>) -> Self {
        // What only the whole can say, for every runner (the tuner's included).
        settings.check();
        let mut policy = match settings.policy.take() {
            Some(policy) => ActivePolicy::Custom(policy),
            None => ActivePolicy::Shrink(std::mem::take(&mut settings.shrink)),
        };
        let ladder = settings.remedies.take();
        // Remedies are not agreed between ranks: refused wherever the agreement sits, in the
        // settings or inside the runner's policy (uneven shares agree in theirs).
        if ladder.is_some() && (settings.agreement.is_some() || policy.agrees_with_others()) {
            settings.invalidate(Invalid::RemediesWithAgreement);
        }
        if let Some(control) = &ladder {
            policy = ActivePolicy::Custom(Box::new(Remediate::new(
                policy,
                Arc::clone(control),
                settings.restart_after_remedy.unwrap_or(starting),
                settings.min,
                settings.label,
            )));
        }
        if let Some(cache) = settings.cache().cloned() {
            let cached = Cached::new(
                policy,
                cache,
                settings.label,
                starting,
                (settings.min, settings.max),
                &settings.release,
                ladder,
            );
            // Read from the wrapper before it is lent to the loop: no hook asks it later.
            settings.cache_offer = cached.offer();
            policy = ActivePolicy::Custom(Box::new(cached));
        }
        if let Some(collective) = settings.agreement.take() {
            policy = ActivePolicy::Custom(Box::new(Agree::new(policy, collective)));
        }
        Search::new(starting, policy, settings)
    }

    #[inline]
    pub(crate) fn new(
        starting: usize,
        mut policy: ActivePolicy<'r>,
        settings: Settings<'r>,
    ) -> Self {
        let Settings {
            min,
            max,
            type_max,
            max_attempts,
            release,
            label,
            invalid,
            hooks,
            first_fit_at_debug,
            cache_offer,
            ..
        } = settings;
        // No size above `with_max` or above what the batch-size parameter's type holds.
        let max_size = max.unwrap_or(usize::MAX).min(type_max);
        let next = if let Some(why) = invalid {
            Next::Stop(StopReason::InvalidConfiguration(why.to_string()))
        } else if starting == 0 {
            Next::Stop(StopReason::StartedAtZero)
        } else if let Err(why) = policy.check() {
            Next::Stop(StopReason::InvalidConfiguration(why))
        } else {
            match policy.first(starting) {
                Decision::Try(0) => Next::Stop(StopReason::StartedAtZero),
                Decision::Try(size) if size.min(max_size) < min => {
                    Next::Stop(StopReason::BelowMinimum {
                        next: size.min(max_size),
                        min,
                    })
                }
                Decision::Try(size) => Next::Size(size.min(max_size)),
                Decision::Stop(reason) => Next::Stop(reason),
                Decision::Accept => Next::Stop(StopReason::NothingToAccept),
            }
        };
        // Built in one expression, in place: the success path moves as little as it can.
        Search {
            rationale: policy.rationale(),
            policy,
            hooks,
            min,
            max_attempts,
            max_size,
            label,
            release,
            next,
            running: None,
            report: SearchReport::default(),
            finished: false,
            last_error: None,
            smallest_failed: None,
            succeeded_once: false,
            retrying_below: false,
            first_fit_at_debug,
            cache_offer,
            proposed_after_failure: Vec::new(),
            watch: None,
            growths: 0,
            all_growths: 0,
        }
    }
}

/// How many times one search runs the same work at the same size, where its successes are not
/// new work (a tuner's trials, a policy of your own): a policy that keeps proposing a size that
/// already ran learns nothing more from it, and would otherwise run for ever.
pub(crate) const MAX_RUNS_OF_ONE_SIZE: usize = 16;

impl Search<'_> {
    /// After a success: a size that already succeeded [`MAX_RUNS_OF_ONE_SIZE`] times on the same
    /// work is not run again; the search stops, saying so.
    fn no_endless_repeats(&self, next: Next) -> Next {
        let Next::Size(size) = next else {
            return next;
        };
        if self.policy.each_success_is_new_work() {
            return next;
        }
        let runs = self
            .report
            .attempts()
            .filter(|attempt| attempt.batch_size == size && attempt.outcome.is_success())
            .count();
        if runs >= MAX_RUNS_OF_ONE_SIZE {
            Next::Stop(StopReason::SizeRepeated {
                batch_size: size,
                runs,
            })
        } else {
            next
        }
    }

    /// After a failure: a size the policy proposed [`MAX_RUNS_OF_ONE_SIZE`] times after failures
    /// on the same work is not proposed again; the search stops, saying so. Counted on what the
    /// policy proposed, before the engine's rules change it: a size above `with_max` runs as
    /// the largest below the failure, a new size each time, and a policy that keeps proposing
    /// it would step down one by one from `with_max`.
    fn no_endless_proposals(&mut self, decision: Decision) -> Decision {
        let Decision::Try(size) = decision else {
            return decision;
        };
        let runs = match self
            .proposed_after_failure
            .iter_mut()
            .find(|(proposed, _)| *proposed == size)
        {
            Some((_, runs)) => {
                *runs += 1;
                *runs
            }
            None => {
                self.proposed_after_failure.push((size, 1));
                1
            }
        };
        if runs > MAX_RUNS_OF_ONE_SIZE {
            Decision::Stop(StopReason::SizeRepeated {
                batch_size: size,
                runs: runs - 1,
            })
        } else {
            decision
        }
    }

    /// The engine's rules over what the policy decided.
    #[inline]
    fn within_the_rules(&self, decision: Decision) -> Next {
        match decision {
            Decision::Accept if self.succeeded_once => Next::Accepted,
            Decision::Accept => Next::Stop(StopReason::NothingToAccept),
            Decision::Stop(reason) => Next::Stop(reason),
            Decision::Try(size) => {
                // A size the batch-size parameter's type cannot hold runs as the largest it
                // can that has not failed, so that what runs is what the report records.
                let size = if size > self.max_size {
                    match self.smallest_failed {
                        Some(failed) if failed <= self.max_size => failed.saturating_sub(1),
                        _ => self.max_size,
                    }
                } else {
                    size
                };
                let made = self.report.len();
                if self.max_attempts.is_some_and(|max| made >= max) {
                    Next::Stop(StopReason::MaxAttempts(made))
                } else if size == 0 {
                    Next::Stop(if made == 0 {
                        StopReason::StartedAtZero
                    } else {
                        StopReason::ReachedZero
                    })
                } else if let Some(failed) = self.smallest_failed.filter(|&failed| size >= failed) {
                    Next::Stop(StopReason::NotSmaller {
                        failed,
                        proposed: size,
                    })
                } else if size < self.min {
                    // `min` itself is tried once before the search gives up below it: a
                    // policy's step over it (halving 8 to 4 with `min = 5`) is no proof that
                    // `min` does not fit.
                    match self.smallest_failed {
                        Some(failed) if failed <= self.min => {
                            Next::Stop(StopReason::BelowMinimum {
                                next: size,
                                min: self.min,
                            })
                        }
                        _ => Next::Size(self.min),
                    }
                } else {
                    Next::Size(size)
                }
            }
        }
    }

    /// Starts the next attempt and returns its batch size, or the error that ends the search.
    ///
    /// ```
    /// # use batch_size_runtime::{oom, BatchSizeSearch, StopReason};
    /// let mut search = BatchSizeSearch::new(4).with_max_attempts(1).start();
    /// assert_eq!(search.begin()?, 4);
    /// search.out_of_memory(oom::classify_text("CUDA out of memory").unwrap(), None);
    /// let error = search.begin().unwrap_err();
    /// assert_eq!(error.reason(), &StopReason::MaxAttempts(1));
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn begin(&mut self) -> Result<usize, NoExecutableBatchSize> {
        let begun = self.begin_attempt();
        self.publish_report();
        begun
    }

    /// [`begin`](Self::begin) for the engine's driver, which takes the report as a value.
    #[inline]
    pub(crate) fn begin_attempt(&mut self) -> Result<usize, NoExecutableBatchSize> {
        match std::mem::replace(&mut self.next, Next::Ended) {
            Next::Size(batch_size) => {
                step::keep_the_outer_peak();
                let memory_at_start = non_empty(self.release.start_attempt());
                self.watch = Some(self.watch_for(batch_size, memory_at_start.as_ref()));
                self.running = Some(Running {
                    batch_size,
                    started: Instant::now(),
                    started_by_clock: self.clock_now(),
                    memory_at_start,
                    remedies: self.policy.remedies_in_force(),
                    side_threads: crate::panic_filter::SideWatch::start(),
                });
                Ok(batch_size)
            }
            Next::Stop(reason) => Err(self.give_up(reason)),
            // Called again after the end: say so, leaving `last_report()` to the search that ended.
            ended @ (Next::Accepted | Next::Ended) => {
                self.next = ended;
                Err(NoExecutableBatchSize::new(
                    StopReason::InvalidConfiguration("the search already ended".to_owned()),
                    self.report.clone(),
                    None,
                ))
            }
        }
    }

    /// A watch over the attempt about to run at `batch_size`, for [`step_done`](crate::step_done):
    /// one that may grow where the policy grows after a step and a larger size is allowed
    /// (below every failure, within `max`, with attempts left for the grown size and a return to
    /// this one, and a growth left); else one that says why not to a call that asks.
    fn watch_for(&self, batch_size: usize, at_start: Option<&MemorySnapshot>) -> Arc<StepWatch> {
        let ceiling = self
            .smallest_failed
            .map_or(self.max_size, |failed| failed.saturating_sub(1))
            .min(self.max_size);
        let room_for_attempts = self
            .max_attempts
            .is_none_or(|max| self.report.len() + 3 <= max);
        let why_not = if self.growths >= MAX_GROWTHS || self.all_growths >= 2 * MAX_GROWTHS {
            "the search grew as often as it may"
        } else if !room_for_attempts {
            "`max_attempts` leaves no attempt for a larger size"
        } else if self.policy.agrees_with_others() {
            "ranks agree on every size, and one rank does not grow alone"
        } else {
            match self.policy.grow_after_a_step(&self.report) {
                Some(rule) => {
                    return StepWatch::new(
                        batch_size,
                        at_start.cloned(),
                        self.release.clone(),
                        ceiling,
                        rule,
                    )
                }
                None => "the policy does not grow after a step",
            }
        };
        StepWatch::idle(batch_size, why_not)
    }

    /// The running attempt's watch, for the driver to put in place while it runs; the search
    /// keeps it to record whether the first step ran.
    #[inline]
    pub(crate) fn step_watch(&self) -> Option<Arc<StepWatch>> {
        self.watch.clone()
    }

    /// The growth the running attempt's first step asked for ([`step_done`](crate::step_done)
    /// answered [`Grow`](crate::Grow)), for the driver once the attempt returned.
    #[inline]
    pub(crate) fn asked_to_grow(&self) -> Option<Grown> {
        self.watch.as_ref()?.grown().cloned()
    }

    /// The attempt's first step fit and its figures showed room for `grown.to`: the attempt is
    /// recorded as grown, memory is released as after an out-of-memory, and the policy (which
    /// lent the rule) answers the next size, held to the engine's rules. A policy that answers
    /// no larger size runs the size that fit again.
    pub(crate) fn record_growth(&mut self, grown: Grown) {
        let mut attempt = self.finish_attempt(Outcome::Grew { to: grown.to });
        attempt.memory_at_end = non_empty(grown.memory);
        // Figures that came with the attempt (a child's): the start they were measured from.
        if attempt.memory_at_start.is_none() {
            attempt.memory_at_start = non_empty(grown.at_start);
        }
        read_figures(&mut attempt, Default::default());
        let number = attempt.number;
        self.report.push(attempt);
        // A long reach from far below measured the step far from the fit, where the figures'
        // resolution is coarse: it is a first measurement, not a correction, and leaves the
        // corrections their count (within a hard cap).
        if grown.to <= grown.from.saturating_mul(LONG_REACH) {
            self.growths += 1;
        }
        self.all_growths += 1;
        self.release_before_next_attempt();
        let decision = match self.policy.after(&self.report) {
            Decision::Try(size) if size > grown.from => Decision::Try(size),
            _ => Decision::Try(grown.from),
        };
        self.rationale = self.policy.rationale();
        self.next = self.within_the_rules(decision);
        if let Next::Size(next) = &self.next {
            if grown.step.room == 0 {
                // No figures: the size is a guess, and the log says so.
                tracing::info!(
                    function = self.label,
                    batch_size = grown.from,
                    next_batch_size = *next,
                    attempt = number,
                    "the first step with batch size {} ran; with no memory figures to size from, \
                     running again with {next}, a guess halfway to the smallest size that failed",
                    grown.from,
                );
            } else {
                tracing::info!(
                    function = self.label,
                    batch_size = grown.from,
                    next_batch_size = *next,
                    attempt = number,
                    peak = %Bytes(grown.step.peak),
                    room = %Bytes(grown.step.room),
                    "the first step with batch size {} used {} of {}: running again with {next}",
                    grown.from,
                    Bytes(grown.step.peak),
                    Bytes(grown.step.room),
                );
            }
        }
        self.notify_last();
    }

    /// Whether the policy accepted the latest success: the search is over, with that size.
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// let mut search = BatchSizeSearch::new(4).start();
    /// search.begin()?;
    /// assert!(!search.is_accepted());
    /// search.succeeded();
    /// assert!(search.is_accepted());
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    #[inline]
    pub fn is_accepted(&self) -> bool {
        matches!(self.next, Next::Accepted)
    }

    fn give_up(&mut self, reason: StopReason) -> NoExecutableBatchSize {
        let report = self.finish_report();
        let error = NoExecutableBatchSize::new(reason, report, self.last_error.take());
        tracing::error!(
            function = self.label,
            tried = ?error.tried(),
            reason = %error.reason(),
            "no executable batch size found"
        );
        error
    }

    /// The search is over: the report goes to `on_report` and is kept for the caller; a copy
    /// is returned for [`NoExecutableBatchSize`].
    fn finish_report(&mut self) -> SearchReport {
        self.finish();
        self.report.clone()
    }

    /// The search is over: the report goes to `on_report` and waits for the caller, moved, not
    /// cloned (the success path copies as little as it can).
    fn finish(&mut self) {
        // Served from the cache: its size ran first, alone, and was accepted.
        if let Some((fits, hit)) = self.cache_offer.take() {
            let ran_alone = self.report.len() == 1
                && self
                    .report
                    .last()
                    .is_some_and(|only| only.batch_size == fits && only.outcome.is_success());
            if ran_alone && matches!(self.next, Next::Accepted) {
                self.report.cache_hit = Some(hit);
            }
        }
        if let Some(on_report) = self.hooks.as_mut().and_then(|hooks| hooks.on_report.take()) {
            on_report(&self.report);
        }
        self.finished = true;
    }

    /// The report of the search that ended, as a value (empty while it runs). The runners and
    /// the public edges that own the search take it here; nothing is stored on the way.
    #[inline]
    pub(crate) fn take_report(&mut self) -> SearchReport {
        if std::mem::take(&mut self.finished) {
            std::mem::take(&mut self.report)
        } else {
            SearchReport::default()
        }
    }

    /// For a loop of the user's own: once the search ended, its report goes to
    /// [`last_report()`](crate::last_report), as every public edge does.
    #[inline]
    pub(crate) fn publish_report(&mut self) {
        if std::mem::take(&mut self.finished) {
            record::store_last_report(std::mem::take(&mut self.report));
        }
    }

    /// The caller's clock, where one was given.
    #[inline]
    fn clock_now(&mut self) -> Option<Duration> {
        let clock = self.hooks.as_mut()?.clock.as_mut()?;
        Some(clock())
    }

    #[inline]
    fn finish_attempt(&mut self, outcome: Outcome) -> Attempt {
        let running = self.running.take();
        let ended_by_clock = self.clock_now();
        let (batch_size, duration, memory_at_start, remedies) = match running {
            Some(running) => (
                running.batch_size,
                match (running.started_by_clock, ended_by_clock) {
                    (Some(started), Some(ended)) => ended.saturating_sub(started),
                    _ => running.started.elapsed(),
                },
                running.memory_at_start,
                running.remedies,
            ),
            None => (0, Default::default(), None, None),
        };
        Attempt {
            number: self.report.len() + 1,
            batch_size,
            outcome,
            duration,
            memory_at_start,
            memory_at_end: None,
            memory_after_release: None,
            figures: Default::default(),
            rationale: self.rationale.take(),
            remedies,
            first_step_done: self.watch.take().is_some_and(|watch| watch.measured()),
        }
    }

    fn notify_last(&mut self) {
        let notify = self.hooks.as_mut().and_then(|hooks| hooks.notify.as_mut());
        if let (Some(notify), Some(attempt)) = (notify, self.report.last()) {
            notify(attempt);
        }
    }

    /// The attempt returned its value. The policy decides whether the search ends here
    /// ([`is_accepted`](Self::is_accepted)) or goes on with another size.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch};
    /// let mut search = BatchSizeSearch::new(4).start();
    /// let batch_size = search.begin()?;
    /// search.succeeded();
    /// assert_eq!(last_report().unwrap().batch_size(), Some(batch_size));
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn succeeded(&mut self) {
        self.record_success();
        self.publish_report();
    }

    /// [`succeeded`](Self::succeeded) for the engine's driver.
    #[inline]
    pub(crate) fn record_success(&mut self) {
        let stayed = self.watch.as_ref().and_then(|watch| watch.stayed());
        let mut attempt = self.finish_attempt(Outcome::Succeeded);
        if self.policy.reads_memory_after_success() {
            attempt.memory_at_end = non_empty(self.release.memory());
            read_figures(&mut attempt, Default::default());
        }
        self.succeeded_once = true;
        self.report.push(attempt);
        self.notify_last();
        self.next = if self.policy.is_shrinking() || std::mem::take(&mut self.retrying_below) {
            Next::Accepted
        } else {
            if self.policy.each_success_is_new_work() {
                self.smallest_failed = None;
                self.proposed_after_failure.clear();
            }
            let decision = self.policy.after(&self.report);
            self.rationale = self.policy.rationale();
            self.no_endless_repeats(self.within_the_rules(decision))
        };
        match &self.next {
            Next::Accepted => {
                if let Some(attempt) = self.report.last() {
                    if self.first_fit_at_debug && attempt.number == 1 {
                        tracing::debug!(
                            function = self.label,
                            batch_size = attempt.batch_size,
                            "the size in use fits"
                        );
                    } else {
                        match stayed {
                            // The call measured the step: why the size is where it stops.
                            Some(why) => tracing::info!(
                                function = self.label,
                                batch_size = attempt.batch_size,
                                attempts = attempt.number,
                                "found executable batch size; it stays there: {why}"
                            ),
                            None => tracing::info!(
                                function = self.label,
                                batch_size = attempt.batch_size,
                                attempts = attempt.number,
                                "found executable batch size"
                            ),
                        }
                    }
                }
                self.finish();
            }
            Next::Size(next) => {
                // A tuner's next trial runs the same work at another size: it starts, as after
                // a failure, from released memory, so that a pool's cache is not counted twice
                // and its readings are its own. The next chunk or step is new work and keeps
                // the pool: a synchronize drains the queue and a trim makes the next chunk
                // allocate from the driver again, for nothing.
                if self.policy.each_success_is_new_work() {
                    tracing::debug!(
                        function = self.label,
                        next_batch_size = *next,
                        "attempt succeeded; the policy continues"
                    )
                } else {
                    self.release_before_next_attempt();
                    // A trial (the tuner's): each is told as it runs, so that a long tuning
                    // shows its progress.
                    if let Some(attempt) = self.report.last() {
                        tracing::info!(
                            function = self.label,
                            batch_size = attempt.batch_size,
                            next_batch_size = *next,
                            attempt = attempt.number,
                            "trial at batch size {} ran; next trial at {next}",
                            attempt.batch_size
                        );
                    }
                }
            }
            Next::Stop(_) | Next::Ended => {}
        }
    }

    /// The attempt returned an error that is not out-of-memory: the search is over and the
    /// error goes back to the caller.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, Outcome};
    /// let mut search = BatchSizeSearch::new(4).start();
    /// search.begin()?;
    /// search.failed(&std::io::Error::other("corrupt shard"));
    /// let report = last_report().unwrap();
    /// let attempt = report.attempts().next().unwrap();
    /// assert_eq!(attempt.outcome, Outcome::Failed { error: "corrupt shard".to_owned() });
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn failed(&mut self, error: &(dyn Error + 'static)) {
        self.failed_with(oom::describe(error));
        self.publish_report();
    }

    pub(crate) fn failed_with(&mut self, description: String) {
        let attempt = self.finish_attempt(Outcome::Failed { error: description });
        self.report.push(attempt);
        self.policy.ended_by_failure(&self.report);
        self.notify_last();
        self.next = Next::Ended;
        self.finish();
    }

    /// The attempt panicked. An out-of-memory panic is recorded like an out-of-memory error;
    /// any other panic is recorded and resumed with its original payload.
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// # std::panic::set_hook(Box::new(|_| {})); // keep the doctest's output clean
    /// let mut search = BatchSizeSearch::new(4).start();
    /// search.begin()?;
    /// let oom = || panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
    /// let payload = std::panic::catch_unwind(oom).unwrap_err();
    /// search.panicked(payload); // out of memory: recorded, no unwinding
    /// assert_eq!(search.begin()?, 2);
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn panicked(&mut self, payload: PanicPayload) {
        self.record_panic(payload);
        self.publish_report();
    }

    /// [`panicked`](Self::panicked) for the engine's driver. A panic that is not out-of-memory
    /// leaves every caller by unwinding: its report is published on the way out.
    pub(crate) fn record_panic(&mut self, payload: PanicPayload) {
        match self.rules().classify_panic(&*payload) {
            Some(found) => self.record_out_of_memory(found, None),
            None => {
                let attempt = self.finish_attempt(Outcome::Panicked);
                self.report.push(attempt);
                self.policy.ended_by_failure(&self.report);
                self.notify_last();
                self.next = Next::Ended;
                self.finish();
                self.publish_report();
                std::panic::resume_unwind(payload)
            }
        }
    }

    /// What counts as out-of-memory for this search: the process-wide rules, then its own
    /// [`when`](crate::BatchSizeSearch::when).
    pub(crate) fn rules(&self) -> OomRules<'_> {
        OomRules::new(self.hooks.as_ref().and_then(|hooks| hooks.when.as_ref()))
            .with_side_threads(self.running.as_ref().map(|running| &running.side_threads))
    }

    /// The attempt ran out of memory: record it, release memory, pick the next size.
    /// `error` is kept as the `source()` of [`NoExecutableBatchSize`] if the search ends.
    ///
    /// ```
    /// # use batch_size_runtime::{oom, BatchSizeSearch, OutOfMemory};
    /// let mut search = BatchSizeSearch::new(4).start();
    /// search.begin()?;
    /// let error = OutOfMemory::new().with_requested(1 << 30);
    /// search.out_of_memory(oom::classify_error(&error).unwrap(), Some(Box::new(error)));
    /// assert_eq!(search.begin()?, 2);
    /// assert_eq!(search.report().out_of_memory_count(), 1);
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn out_of_memory(
        &mut self,
        found: OomMatch,
        error: Option<Box<dyn Error + Send + Sync + 'static>>,
    ) {
        self.record_out_of_memory(found, error.map(KeptError::from));
        self.publish_report();
    }

    pub(crate) fn record_out_of_memory(&mut self, found: OomMatch, error: Option<KeptError>) {
        let mut attempt = self.finish_attempt(Outcome::OutOfMemory {
            error: found.description.clone(),
        });
        let failed_size = attempt.batch_size;
        attempt.memory_at_end = non_empty(self.release.memory());

        self.release_before_next_attempt();
        attempt.memory_after_release = non_empty(self.release.memory());
        read_figures(&mut attempt, found.figures);
        let held = self.held_from_earlier_work(&attempt);
        self.report.push(attempt);

        if let Some(held) = held {
            // Memory a pool kept from earlier work failed this size, not the size itself:
            // it runs once more, with that memory given back, before the search goes lower.
            // The failure proves nothing about the size, so it bounds nothing, and the policy
            // sees it in the history with the retry's outcome.
            self.rationale = Some(format!(
                "the pool held {} reserved but unallocated from earlier work when batch size \
                 {failed_size} started; the release gave it back: {failed_size} again",
                Bytes(held)
            ));
            self.next = self.within_the_rules(Decision::Try(failed_size));
        } else {
            self.smallest_failed = Some(
                self.smallest_failed
                    .map_or(failed_size, |smallest| smallest.min(failed_size)),
            );
            // The policy sees the failure with the memory the release made free.
            let decision = self.policy.after(&self.report);
            self.rationale = self.policy.rationale();
            let decision = self.nothing_kept_above_a_failure(decision);
            let decision = self.no_endless_proposals(decision);
            self.next = self.within_the_rules(decision);
            self.remedy_if_no_size_is_left();
        }
        self.log_retry(failed_size, &found.description);
        self.notify_last();
        self.last_error = Some(error.unwrap_or_else(|| {
            let text: Box<dyn Error + Send + Sync> = Box::new(LastOutOfMemory(found.description));
            KeptError::from(text)
        }));
        if matches!(self.next, Next::Accepted) {
            self.finish();
        }
    }

    /// Bytes a pool held reserved but unallocated when `failed` started (what earlier work
    /// left: a caching pool, an arena's regions) that the attempt could not use: the failing
    /// allocation, on top of the attempt's peak, would have fit in the memory in use, free and
    /// held at its start together, so a pool that reuses what it holds (CUDA's) would not have
    /// failed there. Only where the release has given that memory back. `None` otherwise: where
    /// a figure is missing (the request's bytes, the peak), for a size already tried in this
    /// search (the retry's own failure is an answer), and for sizes agreed with other ranks
    /// (they would not retry with it). Read from the figures taken anyway at the attempt's
    /// start and end and after the release: nothing is added to the success path.
    fn held_from_earlier_work(&self, failed: &Attempt) -> Option<u64> {
        if self.policy.agrees_with_others()
            || self
                .report
                .attempts()
                .any(|earlier| earlier.batch_size == failed.batch_size)
        {
            return None;
        }
        let at_start = failed.memory_at_start.as_ref()?;
        let held = at_start.pool_unallocated().filter(|&held| held > 0)?;
        let requested = failed.figures.requested?;
        let peak = failed.memory_at_end.as_ref()?.peak()?;
        let in_use_at_start = at_start.pool_used().unwrap_or(0);
        let room = in_use_at_start
            .saturating_add(at_start.free())
            .saturating_add(held);
        let could_not_use = peak.saturating_add(requested) <= room;
        // Given back: what the pool holds unallocated now is at most half of it.
        let given_back = failed
            .memory_after_release
            .as_ref()
            .and_then(MemorySnapshot::pool_unallocated)
            .is_some_and(|left| left <= held / 2);
        (could_not_use && given_back).then_some(held)
    }

    /// Gives memory back before the next attempt; a release that fails is said, not fatal.
    fn release_before_next_attempt(&self) {
        if let Err(release_error) = self.release.release() {
            tracing::warn!(
                function = self.label,
                error = %release_error,
                "could not release device memory before the next attempt"
            );
        }
    }

    /// A policy may accept the latest success after a failure (a tuner that bracketed the
    /// limit). Where that success is at or above a size that failed since (the memory shrank:
    /// fragmentation, memory another process took), it is not kept, whatever the policy: it is
    /// the size most likely to fail again. The engine tries below the failure, and the first
    /// size there that runs ends the search; the next attempt's rationale says why.
    fn nothing_kept_above_a_failure(&mut self, decision: Decision) -> Decision {
        self.retrying_below = false;
        if decision != Decision::Accept {
            return decision;
        }
        let Some(failed) = self.smallest_failed else {
            return decision;
        };
        let ran = self
            .report
            .attempts()
            .rev()
            .find(|attempt| attempt.outcome.is_success())
            .map(|attempt| attempt.batch_size);
        match ran {
            Some(ran) if ran >= failed => {
                self.retrying_below = true;
                self.rationale = Some(format!(
                    "batch size {failed} ran out of memory after {ran} ran: {ran} is not kept, \
                     the search goes on below the failure"
                ));
                Decision::Try(failed - 1)
            }
            _ => decision,
        }
    }

    /// Where the rules leave no size, a policy that applies remedies may change the settings
    /// and start again: the sizes that failed under the old settings no longer bound the
    /// search. Asked once per failed attempt: the size it answers runs, or the search stops.
    /// (A policy may also answer a size under the same settings: `min`, not yet tried.)
    fn remedy_if_no_size_is_left(&mut self) {
        let remediable = matches!(
            &self.next,
            Next::Stop(
                StopReason::ReachedZero
                    | StopReason::BelowMinimum { .. }
                    | StopReason::NotSmaller { .. }
                    | StopReason::FixedMemoryDoesNotFit { .. }
                    | StopReason::ItemDoesNotFit { .. }
            )
        );
        if !remediable {
            return;
        }
        let Next::Stop(reason) = std::mem::replace(&mut self.next, Next::Ended) else {
            return;
        };
        let remedies_before = self.policy.remedies_in_force();
        self.next = match self.policy.no_size_left(reason, &self.report) {
            Decision::Try(size) => {
                // Other remedies: the sizes that failed under the old ones bound nothing now.
                if self.policy.remedies_in_force() != remedies_before {
                    self.smallest_failed = None;
                    self.proposed_after_failure.clear();
                }
                self.rationale = self.policy.rationale();
                self.within_the_rules(Decision::Try(size))
            }
            decision => self.within_the_rules(decision),
        };
    }

    fn log_retry(&self, failed_size: usize, description: &str) {
        // One short line a person reads: the error once (in `error`), the memory as the attempt
        // failed only where the error did not state it (as PyTorch's message gives it), then
        // what the release made free for the next attempt. The report keeps every figure.
        // Fields with nothing to say are left out (an `Option` records only when `Some`).
        let last = self.report.last();
        let stated = last.is_some_and(|attempt| attempt.figures.free_at_failure.is_some());
        let memory = last
            .and_then(|attempt| attempt.memory_at_end.as_ref())
            .filter(|memory| !memory.is_empty() && !stated)
            .map(|memory| tracing::field::display(Brief(memory)));
        // What the next attempt starts with, where it is news: not the free bytes the error
        // already stated.
        let stated_free = last.and_then(|attempt| attempt.figures.free_at_failure);
        let free_after_release = last
            .and_then(|attempt| attempt.memory_after_release.as_ref())
            .filter(|after| !after.is_empty() && stated_free != Some(after.free()))
            .map(|after| tracing::field::display(Bytes(after.free())));
        let why_free = last.and_then(why_free_was_not_enough).unwrap_or_default();
        // A rank that retries because another ran out says so first: its own step fitted.
        // The sizes are in the fields (`batch_size`, `next_batch_size`), the error in `error`.
        let what = if description.contains("another rank") {
            "another rank ran out of memory (this rank's step fitted)".to_owned()
        } else {
            format!("out of memory{why_free}")
        };
        match &self.next {
            Next::Size(next) => tracing::warn!(
                function = self.label,
                batch_size = failed_size,
                next_batch_size = *next,
                error = %description,
                memory,
                free_after_release,
                "{what}; retrying"
            ),
            Next::Accepted => tracing::warn!(
                function = self.label,
                batch_size = failed_size,
                error = %description,
                "{what}; keeping the last size that ran"
            ),
            Next::Stop(_) | Next::Ended => tracing::warn!(
                function = self.label,
                batch_size = failed_size,
                error = %description,
                memory,
                free_after_release,
                "{what}; no smaller size is left"
            ),
        }
        // Why the next size, on a line of its own: the retry's line stays short.
        if let (Next::Size(next), Some(rationale)) = (&self.next, self.rationale.as_deref()) {
            tracing::info!(
                function = self.label,
                batch_size = failed_size,
                next_batch_size = *next,
                "why {next}: {rationale}"
            );
        }
    }

    /// The attempts so far, while the search runs. When it ends, the report moves to
    /// [`last_report()`](crate::last_report) (and to [`NoExecutableBatchSize::report`] when no
    /// size fit), and this one is empty.
    ///
    /// ```
    /// # use batch_size_runtime::{oom, BatchSizeSearch};
    /// let mut search = BatchSizeSearch::new(4).start();
    /// assert!(search.report().is_empty());
    /// search.begin()?;
    /// search.out_of_memory(oom::classify_text("CUDA out of memory").unwrap(), None);
    /// assert_eq!(search.report().len(), 1);
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    pub fn report(&self) -> &SearchReport {
        &self.report
    }
}

/// What the last out-of-memory panic said, kept as `source()` where no error value exists.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct LastOutOfMemory(String);

/// Fills an attempt's figures once, from what its error `stated` and the readings kept on it.
fn read_figures(attempt: &mut Attempt, stated: Figures) {
    attempt.figures = figures_of(
        stated,
        attempt.memory_at_start.as_ref(),
        attempt.memory_at_end.as_ref(),
        attempt.memory_after_release.as_ref(),
    );
}

fn non_empty(snapshot: MemorySnapshot) -> Option<MemorySnapshot> {
    (!snapshot.is_empty()).then_some(snapshot)
}

/// The memory as a retry's line gives it: each device's free bytes of its total, and what its
/// pool (or, on the host, the process) holds; the report keeps the rest.
struct Brief<'a>(&'a MemorySnapshot);

impl std::fmt::Display for Brief<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, device) in self.0.devices.iter().enumerate() {
            if index > 0 {
                f.write_str("; ")?;
            }
            let (free, total) = (Bytes(device.free), Bytes(device.total));
            write!(f, "{}: {free} free of {total}", device.device)?;
            match device.pool_reserved {
                Some(held) if device.device == "cpu" => {
                    write!(f, ", process holds {}", Bytes(held))?
                }
                Some(held) => write!(f, ", pool reserves {}", Bytes(held))?,
                None => {}
            }
        }
        Ok(())
    }
}

/// Where a failed request was smaller than what the error said was free, the few words that
/// say why, so that the figures do not read as a contradiction: on the host, the limit counts
/// the process's own memory (its allocator's arenas, what it maps); on a device, the pool
/// holds a reserve, and what is free is not in one piece.
fn why_free_was_not_enough(attempt: &Attempt) -> Option<&'static str> {
    let figures = &attempt.figures;
    if figures.requested? > figures.free_at_failure? {
        return None;
    }
    let on_the_host = attempt.memory_at_end.as_ref().is_some_and(|memory| {
        !memory.devices.is_empty() && memory.devices.iter().all(|device| device.device == "cpu")
    });
    Some(if on_the_host {
        " (the process's own memory)"
    } else {
        " (the pool's reserve)"
    })
}
