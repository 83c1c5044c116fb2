//! The effective batch kept exactly (the docs users read are on [`EffectiveBatch`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::agree::{Agree, Collective, ReduceOp};
use crate::attempt::AttemptError;
use crate::engine::{settings_setters, Invalid, Settings};
use crate::error::{NoExecutableBatchSize, StopReason};
#[allow(unused_imports)] // for the docs' links
use crate::memory::Release;
use crate::policy::CacheSlot;
use crate::record::SearchReport;
use crate::remedies::Remedies;
use crate::runners::learn::GrowBack;
use crate::runners::learn::{Convergence, Probing, SquareTerm};
use crate::runners::search::BatchSizeSearch;
use crate::runners::split::{BatchCost, Packing, Split};

// One concept a file: the division of a step (the plan), the size that really runs, and the
// shares of one global batch between ranks; the runner here.
mod plan;
mod real_sizes;
mod shares;

pub use plan::{BatchPlan, MicroBatch};
use real_sizes::RealSizes;
use shares::Shares;

/// A step that needed a smaller micro-batch, and the sizes it tried.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recovery {
    /// The step's number, from 0.
    pub step: usize,
    /// The micro sizes tried for it, in order; the last ran unless the step failed.
    pub tried: Vec<usize>,
}

/// The effective batch kept exactly: one optimizer step over micro-batches whose size shrinks on
/// out-of-memory while the number of micro-batches grows, recovered in place in the middle of
/// training.
///
/// Gradient accumulation computes the gradients of several small batches and steps once; with
/// each micro-batch's mean loss weighted by its share of the batch, the sum is exactly the full
/// batch's mean loss, whatever the division. [`BatchPlan`] is that division, [`EffectiveBatch`]
/// runs one step at a time and, when a step runs out of memory, redoes only that step with a
/// smaller micro-batch.
///
/// ```
/// use batch_size_runtime::{EffectiveBatch, OutOfMemory};
///
/// let mut runner = EffectiveBatch::new(32).with_micro(32);
/// let mut parameters = 0.0;
/// for step in 0..3 {
///     runner.step(|plan| -> anyhow::Result<()> {
///         if plan.micro() > 8 { Err(OutOfMemory::new())? } // this device holds 8 samples
///         let mut gradient = 0.0;
///         for micro in plan.micro_batches() {
///             let loss_gradient = micro.range.len() as f64; // your backward pass here
///             gradient += micro.weight * loss_gradient / micro.range.len() as f64;
///         }
///         parameters -= 0.1 * gradient;
///         Ok(())
///     })?;
/// }
/// assert_eq!(runner.micro(), 8);                    // 32 and 16 ran out of memory once
/// assert_eq!(runner.recoveries().len(), 1);         // at step 0, in place
/// assert!((parameters + 0.3).abs() < 1e-12);        // every step's gradient the full batch's
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// Runs optimizer steps over micro-batches that keep the effective batch exactly; a step that
/// runs out of memory (an error or a panic) is redone in place with a smaller micro-batch, and
/// the size is kept for the steps after it. Steps already done are never redone.
///
/// # Default
/// - micro size: `effective` (one micro-batch) until a step runs out of memory;
/// - minimum micro size: 1;
/// - sizes: the guided policy ([`Guided`](crate::policy::Guided)), `with_factor` and
///   `with_reduce` as in the attribute;
/// - learning from every step: on where the release reads figures; each step starts at the
///   micro size with the fewest passes the figures say fit
///   ([`with_convergence`](Self::with_convergence));
/// - growing back without figures: off (`with_grow_after(steps)`);
/// - release: [`Release::cuda()`].
///
/// Each step is one search of the engine: the same OOM rules, release, logs and report as the
/// attribute. A step that runs out of memory at the smallest micro size returns
/// `E::from(NoExecutableBatchSize)`; any other error or panic comes back unchanged.
#[derive(Debug)]
pub struct EffectiveBatch<'r> {
    effective: usize,
    micro: usize,
    /// The shared settings: `min` is the smallest micro size.
    settings: Settings<'r>,
    /// With `with_cache`: the micro size the steps settled on, for a resumed run.
    cache: Option<CacheSlot>,
    /// The first step has set up what the settings ask for (learning, growing, the cache).
    started: bool,
    grow: GrowBack,
    /// What the steps measured, and the size that fills the device by their figures.
    convergence: Convergence,
    /// The growth attempt the step in progress starts with, if it does.
    probing: Option<usize>,
    /// The micro size the next step starts from (before the even split of its share).
    next_micro: usize,
    steps: usize,
    recoveries: Vec<Recovery>,
    last_report: SearchReport,
    /// With uneven shares: this rank's part of the global batch, and what it measured.
    uneven: bool,
    shares: Option<Shares<'r>>,
    /// The plan of the last step that ran (what `step_then`'s `apply` gets).
    last_plan: Option<BatchPlan>,
    /// The micro size the search starts again from after a remedy (the first step's).
    first_micro: usize,
    /// How a batch of items costs, for steps by cost.
    batch_cost: BatchCost,
    /// Whether the steps so far ran by cost (`None` before the first): the sizes kept are in
    /// that unit.
    by_cost: Option<bool>,
    /// `with_micro` set the first size (by cost: the first budget; without, all the items).
    micro_given: bool,
    /// By cost: the steps' peaks against their micro-batches' shapes, for the square term.
    square_term: SquareTerm,
    /// The steps took another square term than the one given.
    square_term_learned: bool,
}

settings_setters!(
    EffectiveBatch<'r>,
    "EffectiveBatch::new(256)",
    bounds,
    label,
    clock,
    release,
    shrink,
    learning,
    agreement
);

impl<'r> EffectiveBatch<'r> {
    /// A runner for steps of `effective` samples.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// let runner = EffectiveBatch::new(256);
    /// assert_eq!(runner.plan().micro(), 256);
    /// ```
    pub fn new(effective: usize) -> Self {
        EffectiveBatch {
            effective,
            micro: effective,
            settings: Settings::default(),
            cache: None,
            started: false,
            grow: GrowBack::new(0, effective),
            convergence: Convergence::new(true),
            probing: None,
            next_micro: effective,
            steps: 0,
            recoveries: Vec::new(),
            last_report: SearchReport::default(),
            uneven: false,
            shares: None,
            last_plan: None,
            first_micro: effective,
            batch_cost: BatchCost::padded(),
            by_cost: None,
            micro_given: false,
            square_term: SquareTerm::default(),
            square_term_learned: false,
        }
    }

    /// The micro size the first step tries (capped at `effective`).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(256).with_micro(32).plan().accumulation(), 8);
    /// ```
    pub fn with_micro(mut self, starting: usize) -> Self {
        self.micro_given = true;
        self.micro = starting;
        self.next_micro = starting;
        self.first_micro = starting;
        self
    }

    /// Allows the remedies declared in `remedies` once a step runs out of memory at the
    /// smallest micro size (`with_min`): the next remedy is applied and the step searched
    /// again from the first step's micro size, the effective batch and its weights unchanged.
    /// What was applied stays in force for the steps after. The step reads the settings in
    /// force from the same `Remedies` ([`Remedies::settings`]); the step's report has them on
    /// every attempt. Not with [`with_agreement`](Self::with_agreement): the step stops with
    /// `NoExecutableBatchSize` ([`StopReason::InvalidConfiguration`]).
    ///
    /// ```
    /// use batch_size_runtime::{EffectiveBatch, remedies::Remedies, remedies::Remedy, memory::SimulatedDevice};
    ///
    /// #[derive(Debug, Clone)]
    /// struct Config { checkpointing: bool }
    /// let remedies = Remedies::new(Config { checkpointing: false })
    ///     .then(Remedy::switch("activation checkpointing", |c: &mut Config| c.checkpointing = true));
    /// let device = SimulatedDevice::new(100 << 20);
    /// let mut runner = EffectiveBatch::new(64)
    ///     .with_micro(16)
    ///     .with_min(4)
    ///     .with_release(device.clone())
    ///     .with_remedies(&remedies);
    /// runner.step(|plan| -> anyhow::Result<()> {
    ///     let per_sample = if remedies.settings().checkpointing { 8 << 20 } else { 32 << 20 };
    ///     for micro in plan.micro_batches() {
    ///         let _activations = device.alloc(micro.range.len() as u64 * per_sample)?;
    ///     }
    ///     Ok(())
    /// })?;
    /// assert_eq!(remedies.applied(), ["activation checkpointing"]); // 4 did not fit without it
    /// assert!(runner.micro() >= 8 && runner.plan().micro_batches().map(|m| m.range.len()).sum::<usize>() == 64);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_remedies<S: Clone + Send + 'static>(mut self, remedies: &Remedies<S>) -> Self {
        self.settings.remedies = Some(remedies.control());
        self
    }

    /// Splits the batch of `effective` samples, the *global* batch, into one contiguous share
    /// per rank of the agreement, each rank at its own micro-batch: the ranks of mixed GPUs
    /// each run what they hold, and the shares follow each rank's speed so that they finish a
    /// step together, rather than every rank running the micro-batch the smallest GPU holds.
    ///
    /// - The first step runs even shares; then the shares follow the micro-batch each rank
    ///   holds, then each rank's measured samples per second (over its last steps; see
    ///   [`with_clock`](Self::with_clock)). Every rank computes the same shares from figures
    ///   the ranks all-gather after each step; a change is logged at INFO with every share.
    /// - Each rank searches its own micro-batch. An out-of-memory on any rank redoes the step
    ///   on every rank ([`step_then`](Self::step_then)'s safe point), and only the rank that
    ///   ran out of memory shrinks; shares never change inside a step.
    /// - The plan's [`share()`](BatchPlan::share) is this rank's samples of the global batch,
    ///   its micro-batches' ranges lie within it, and their weights are lengths over the global
    ///   batch: **reduce the weighted gradients with a SUM all-reduce, not a mean** (DDP
    ///   averages: divide its result back by nothing, or multiply by the world size). The sum
    ///   over every rank is the whole global batch's gradient, whatever the shares and micro
    ///   sizes.
    ///
    /// Without [`with_agreement`](Self::with_agreement) there is one rank and its share is the
    /// whole batch. A global batch smaller than the number of ranks stops the first step with
    /// [`StopReason::InvalidConfiguration`].
    ///
    /// ```
    /// use std::sync::Mutex;
    /// use std::thread;
    /// use batch_size_runtime::agree::ThreadRanks;
    /// use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    ///
    /// let gradient = Mutex::new(0.0); // stands in for the SUM all-reduce
    /// thread::scope(|scope| {
    ///     for (rank, holds) in ThreadRanks::new(2).into_iter().zip([64, 8]) {
    ///         let gradient = &gradient;
    ///         scope.spawn(move || {
    ///             let mut runner = EffectiveBatch::new(96).with_agreement(rank).with_uneven_shares();
    ///             runner.step_then(
    ///                 |plan| -> anyhow::Result<f64> {
    ///                     if plan.micro() > holds { Err(OutOfMemory::new())? }
    ///                     // Per-sample gradient 1: each micro-batch's mean, by its weight.
    ///                     Ok(plan.micro_batches().map(|micro| micro.weight).sum())
    ///                 },
    ///                 |_plan, mine| {
    ///                     *gradient.lock().unwrap() += mine; // SUM, not mean
    ///                     Ok(())
    ///                 },
    ///             )?;
    ///             anyhow::Ok(runner.micro())
    ///         });
    ///     }
    /// });
    /// // Each rank ran its 48 samples at its own micro-batch (48, and 8 on the small one);
    /// // the weighted gradients add up to the global batch's mean.
    /// assert!((gradient.into_inner().unwrap() - 1.0).abs() < 1e-12);
    /// ```
    pub fn with_uneven_shares(mut self) -> Self {
        self.uneven = true;
        self
    }

    /// This rank's samples of the global batch for the next step: `0..effective` without
    /// [`with_uneven_shares`](Self::with_uneven_shares) (or before the first step with it,
    /// when the number of ranks is not yet known: even shares then).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(64).share(), 0..64);
    /// ```
    pub fn share(&self) -> Range<usize> {
        self.shares
            .as_ref()
            .map_or(0..self.effective, Shares::range)
    }

    /// Every rank's samples of the global batch for the next step, in rank order (one range,
    /// the whole batch, without uneven shares).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(64).shares(), [0..64]);
    /// ```
    pub fn shares(&self) -> Vec<Range<usize>> {
        self.shares.as_ref().map_or_else(
            || std::iter::once(0..self.effective).collect(),
            Shares::ranges,
        )
    }

    /// The plan the next step will try.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(100).with_micro(30).plan().accumulation(), 4);
    /// ```
    pub fn plan(&self) -> BatchPlan {
        BatchPlan::for_share(self.effective, self.share(), self.micro)
    }

    /// The micro size in use (the largest micro-batch of the last step that ran).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(64).with_micro(8).micro(), 8);
    /// ```
    pub fn micro(&self) -> usize {
        self.micro
    }

    /// Steps completed.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// let mut runner = EffectiveBatch::new(4);
    /// runner.step(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(runner.steps(), 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Every step that needed a smaller micro-batch, with the sizes it tried.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut runner = EffectiveBatch::new(64).with_factor(0.5);
    /// runner.step(|plan| -> anyhow::Result<()> {
    ///     if plan.micro() > 16 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// assert_eq!(runner.recoveries()[0].tried, [64, 32, 16]);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn recoveries(&self) -> &[Recovery] {
        &self.recoveries
    }

    /// The report of the last step's search.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// let mut runner = EffectiveBatch::new(4);
    /// runner.step(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(runner.last_step_report().len(), 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn last_step_report(&self) -> &SearchReport {
        &self.last_report
    }

    /// Sets up before the first step: learning, growing back, the micro size a cached run chose.
    fn start(&mut self) {
        self.started = true;
        // By cost, the budget may grow past any count of samples.
        let by_cost = self.by_cost == Some(true);
        let cap = if by_cost { usize::MAX } else { self.effective };
        self.grow = GrowBack::new(self.settings.grow_after, cap);
        let convergence = Convergence::new(self.settings.learn);
        self.convergence = if by_cost {
            convergence.over_items_that_differ()
        } else {
            convergence
        };
        let unit = if by_cost {
            format!(" by cost, {}", self.batch_cost.unit())
        } else {
            String::new()
        };
        let what = format!("effective {}{unit}", self.effective);
        if let Some(cache) = self.settings.open_cache("effective_batch", &what) {
            if let Some(fits) = cache.fits() {
                // Never above the batch; below `min` only where the batch is: the step's
                // search then says `min` is out of reach, as it does without an entry.
                let fits = fits.max(self.settings.min).min(cap.max(1));
                self.micro = fits;
                self.next_micro = fits;
            }
            // The failure that held the first run's growth back holds this one's back too.
            if let Some(failed) = cache.failed_at() {
                self.grow.failed(failed);
            }
            self.cache = Some(cache);
        }
    }

    /// The search of one step over `split`: this rank's share of samples, or items by cost.
    fn search(&mut self, split: Split) -> BatchSizeSearch<'_> {
        if !self.started {
            self.start();
        }
        // The size that fitted is kept whatever the share (or the items): new work is divided
        // into the fewest passes of at most that size, never into a division of the last one.
        let whole = split.whole();
        let kept = self
            .next_micro
            .max(self.convergence.fitted().unwrap_or(0))
            .min(split.whole())
            .max(1);
        let kept = split.realize(kept);
        // With figures, a step that needs fewer passes starts there (a growth attempt, then the
        // size kept if it runs out); where the size kept no longer fits, below it.
        let (start, fallback) = self.convergence.start(&split, kept);
        let probe = fallback.map(|fitted| (start, fitted));
        self.probing = probe.map(|(start, _)| start);
        // A first micro size of 0 is refused as every runner refuses a first size of 0.
        let start = if self.first_micro == 0 { 0 } else { start };
        let mut search = BatchSizeSearch::new(start);
        self.settings.lend_to_search(&mut search.settings);
        if self.effective == 0 {
            search.invalidate(Invalid::EffectiveIsZero);
        }
        let world = self
            .settings
            .agreement
            .as_ref()
            .map_or(1, |c| c.world_size());
        if self.uneven && self.effective < world {
            search.invalidate(Invalid::FewerSamplesThanRanks {
                effective: self.effective,
                ranks: world,
            });
        }
        // The step's search applies the remedies (and refuses them beside an agreement, in its
        // settings or in its policy).
        if let Some(remedies) = &self.settings.remedies {
            search.settings.remedies = Some(Arc::clone(remedies));
            search.settings.restart_after_remedy = Some(self.first_micro.min(whole).max(1));
        }
        let min = self.settings.min;
        // The engine tries what runs: the even split, or the packing, of each proposal.
        let probing = Probing::new(
            self.settings.shrink.borrowed(),
            probe,
            self.convergence.is_enabled(),
        );
        let sizes = RealSizes::new(probing, split, min);
        match &self.settings.agreement {
            // Each rank its own micro size; an out-of-memory anywhere redoes the step everywhere.
            Some(collective) if self.uneven => {
                search.with_policy(Agree::own_sizes(sizes, Arc::clone(collective)))
            }
            Some(collective) => search
                .with_policy(sizes)
                .with_agreement(Arc::clone(collective)),
            None => search.with_policy(sizes),
        }
    }

    /// Learns from the step's attempts under the settings in force at its end: memory against
    /// what the costliest micro-batch of each cost (`split`).
    fn learn(&mut self, report: &SearchReport, split: &Split) {
        if report.remedies_changed() {
            self.convergence.forget();
            self.square_term.forget();
        }
        for attempt in report.under_final_remedies() {
            self.convergence
                .learn(attempt, split.peak(attempt.batch_size));
        }
        self.convergence.advance();
    }

    /// Records how a step's search went.
    fn account(&mut self, report: SearchReport, split: &Split) {
        let step = self.steps;
        // More than one attempt: the sizes before the last ran out here or on another rank,
        // and growing back stays below them.
        if report.len() > 1 {
            let tried: Vec<usize> = report
                .attempts()
                .map(|attempt| attempt.batch_size)
                .collect();
            if report.remedies_changed() {
                // A remedy was applied in this step: the failures before it ran under other
                // settings and bound nothing now.
                self.grow.forget_failures();
                for attempt in report
                    .under_final_remedies()
                    .filter(|attempt| attempt.outcome.is_out_of_memory())
                {
                    self.grow.failed(attempt.batch_size);
                }
            } else if self.uneven {
                // Each rank its own size: only this rank's failures bound its growth (a step
                // redone for another rank's sake ran here at a size that fitted).
                for attempt in report.attempts().filter(|a| a.outcome.is_out_of_memory()) {
                    self.grow.failed(attempt.batch_size);
                }
            } else {
                for &failed in &tried[..tried.len() - 1] {
                    self.grow.failed(failed);
                }
            }
            let probed = self.probing.take();
            if probed.is_some_and(|probe| tried.first() == Some(&probe)) && tried.len() == 2 {
                tracing::info!(
                    step,
                    tried = ?tried,
                    micro = report.batch_size(),
                    "a larger micro-batch did not fit in step {step}: redone in place at the size \
                     that fitted"
                );
            } else if report.out_of_memory_count() > 0 {
                // Each failed attempt had its WARN from the engine; this is the step's outcome.
                tracing::info!(
                    step,
                    tried = ?tried,
                    micro = report.batch_size(),
                    "out of memory in step {step}: recovered in place with a smaller micro-batch"
                );
            } else {
                tracing::info!(
                    step,
                    tried = ?tried,
                    micro = report.batch_size(),
                    "step {step} redone: another rank ran out of memory"
                );
            }
            self.recoveries.push(Recovery { step, tried });
        }
        self.learn(&report, split);
        if let Some(micro) = report.batch_size() {
            // Once the steps learned another square term, budgets are in another unit than
            // the one the entry's key names: the entry keeps the last it could say.
            if let (Some(cache), false) = (&mut self.cache, self.square_term_learned) {
                cache.remember(micro, self.grow.smallest_failed());
            }
            if self.by_cost == Some(true) && self.steps > 0 && micro != self.micro {
                // The plan changes size: said, so that a change is never silent.
                tracing::info!(
                    step = self.steps,
                    budget = micro,
                    was = self.micro,
                    "step {}: micro-batches now cost at most {micro} (was {}); the effective \
                     batch and its weights are unchanged",
                    self.steps,
                    self.micro
                );
            }
            self.micro = micro;
            self.next_micro = if report.len() > 1 {
                micro
            } else {
                self.grow.succeeded(micro)
            };
            self.steps += 1;
        }
        self.last_report = report;
    }

    /// Runs one optimizer step: `body` receives the plan, zeroes the gradients, runs every
    /// micro-batch and steps the optimizer. If it runs out of memory, memory is released and
    /// the same step runs again with a smaller micro-batch (so `body` must not have stepped the
    /// optimizer before failing: step it last). Takes the error types every runner takes
    /// ([`AttemptError`]): your own enum, `anyhow::Error`,
    /// `Box<dyn Error + Send + Sync>`; an error that is not out-of-memory comes back unchanged.
    /// The step's report is [`last_step_report`](Self::last_step_report), and in
    /// [`crate::last_report()`] as for every runner.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, memory::SimulatedDevice};
    /// let device = SimulatedDevice::new(100);
    /// let mut runner = EffectiveBatch::new(64).with_release(device.clone());
    /// runner.step(|plan| -> anyhow::Result<()> {
    ///     for micro in plan.micro_batches() {
    ///         let _activations = device.alloc(micro.range.len() as u64 * 3)?;
    ///     }
    ///     Ok(())
    /// })?;
    /// assert!(runner.micro() <= 33);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// Your own error type, the same way:
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, NoExecutableBatchSize, OutOfMemory};
    /// #[derive(Debug, thiserror::Error)]
    /// enum TrainError {
    ///     #[error(transparent)]
    ///     Device(#[from] OutOfMemory),
    ///     #[error(transparent)]
    ///     NoBatchSize(#[from] NoExecutableBatchSize),
    /// }
    /// let mut runner = EffectiveBatch::new(16);
    /// runner.step(|plan| {
    ///     if plan.micro() > 4 { return Err(TrainError::Device(OutOfMemory::new())) }
    ///     Ok(())
    /// })?;
    /// assert_eq!(runner.micro(), 4);
    /// # Ok::<(), TrainError>(())
    /// ```
    pub fn step<T, E, M, F>(&mut self, body: F) -> Result<T, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&body);
        self.run_step(None, body)
    }

    /// Runs one optimizer step over items of different cost (`costs[i]`: item `i`'s length in
    /// tokens, say), as [`step`](Self::step) runs one over samples: the step's items are grouped
    /// by cost (the costliest first, so that padding stays small) and packed into the fewest
    /// micro-batches whose padded cost ([`with_batch_cost`](Self::with_batch_cost); by default
    /// items × the longest) stays within a budget of cost. The budget is what the search finds
    /// and the runner keeps and learns from step to step, as it keeps the micro size by count:
    /// a step whose items are longer makes more micro-batches of the same cost, not an
    /// out-of-memory, and one that runs out all the same is redone in place at a smaller
    /// budget, the budget learned from it.
    ///
    /// With figures (a release that reads them), the square term is learned too: the shape
    /// you give ([`with_batch_cost`](Self::with_batch_cost)) is where the runner starts, and
    /// where the steps' peaks follow another square term clearly better, it takes that one and
    /// says so at INFO.
    ///
    /// Each [`MicroBatch`] holds its `items` (indices into `costs`), its padded `cost`, and its
    /// `weight`: its items' cost over the step's, so that a token-mean loss accumulated as
    /// `Σ weight × micro-batch's token-mean` is exactly the whole batch's token-mean, whatever
    /// the division ([`BatchCost::weighted_by_samples`] for a sample-mean loss).
    ///
    /// Under [`with_agreement`](Self::with_agreement) the ranks agree on the budget (an
    /// out-of-memory on any rank redoes the step on every rank, as by count), and every rank
    /// runs as many micro-batches as the rank that needs the most, each with its own items (a
    /// rank whose items need fewer splits its widest micro-batches; one with fewer items than
    /// the count gets empty ones, of weight 0: skip them, or run nothing in them), so that a
    /// gradient all-reduce after the last micro-batch meets every rank at the same pass. Not
    /// with uneven shares.
    ///
    /// `costs` may differ in length from step to step (the plan's `effective()` is its length);
    /// an item of cost 0, no items, or a runner that also ran [`step`](Self::step) stop with
    /// [`StopReason::InvalidConfiguration`]. An item that runs out of memory alone stops with
    /// [`StopReason::ItemDoesNotFit`], naming it; the steps before it are kept.
    ///
    /// ```
    /// use batch_size_runtime::{EffectiveBatch, memory::SimulatedDevice};
    ///
    /// let device = SimulatedDevice::new(4_096); // holds 4,096 padded tokens at once
    /// let mut runner = EffectiveBatch::new(8).with_release(device.clone());
    /// let lengths = [100u64, 900, 120, 80, 1_000, 95, 110, 105];
    /// let loss = runner.step_by_cost(&lengths, |plan| -> anyhow::Result<f64> {
    ///     let mut loss = 0.0;
    ///     for micro in plan.micro_batches() {
    ///         let longest = micro.items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
    ///         let _activations = device.alloc(micro.items.len() as u64 * longest)?;
    ///         loss += micro.weight * 2.0; // the micro-batch's token-mean loss, by its weight
    ///     }
    ///     Ok(loss)
    /// })?;
    /// assert!((loss - 2.0).abs() < 1e-12); // the whole batch's token-mean
    /// // The two long sequences together, the six short ones together: two passes.
    /// assert_eq!(runner.plan_of(&lengths).accumulation(), 2);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn step_by_cost<T, E, M, F>(&mut self, costs: &[u64], body: F) -> Result<T, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&body);
        self.run_step(Some(costs), body)
    }

    /// How a batch of items costs in [`step_by_cost`](Self::step_by_cost): by default
    /// [`BatchCost::padded()`] (items × the longest, weights by cost).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchCost, EffectiveBatch};
    /// let runner = EffectiveBatch::new(64).with_batch_cost(BatchCost::padded().with_square_term(1024));
    /// # let _ = runner;
    /// ```
    pub fn with_batch_cost(mut self, cost: BatchCost) -> Self {
        self.batch_cost = cost;
        self
    }

    /// The plan the next [`step_by_cost`](Self::step_by_cost) over `costs` will try first
    /// without figures: the items packed at the budget in use.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// let plan = EffectiveBatch::new(4).with_micro(200).plan_of(&[100, 100, 50, 50]);
    /// assert_eq!(plan.accumulation(), 2);
    /// ```
    pub fn plan_of(&self, costs: &[u64]) -> BatchPlan {
        let packing = Packing::new(costs.iter().copied().collect(), self.batch_cost);
        let budget = packing.realize(self.micro.max(1) as u64);
        BatchPlan::by_cost(
            &packing,
            usize::try_from(budget).unwrap_or(usize::MAX),
            None,
        )
    }

    /// One step, by count (`costs` is `None`) or by cost.
    fn run_step<T, E, M, F>(&mut self, costs: Option<&[u64]>, mut body: F) -> Result<T, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        E: AttemptError<M>,
    {
        let effective = self.effective;
        if self.uneven && self.shares.is_none() {
            let (rank, world) = self
                .settings
                .agreement
                .as_ref()
                .map_or((0, 1), |c| (c.rank(), c.world_size()));
            self.shares = Some(
                Shares::even(effective, rank, world).with_clock(
                    self.settings
                        .hooks
                        .as_mut()
                        .and_then(|hooks| hooks.clock.take()),
                ),
            );
        }
        let share = self.share();
        let by_cost = costs.map(|costs| {
            Arc::new(Packing::new(
                costs.iter().copied().collect(),
                self.batch_cost,
            ))
        });
        let split = match &by_cost {
            None => Split::Even(share.len()),
            Some(packing) => Split::ByCost(Arc::clone(packing)),
        };
        let unit_changed = self.by_cost.replace(by_cost.is_some()) == Some(by_cost.is_none());
        if by_cost.is_some() && self.steps == 0 && !self.micro_given && self.cache.is_none() {
            // The first step by cost tries all its items at once, as a step by count does.
            self.next_micro = usize::MAX;
            self.first_micro = usize::MAX;
        }
        let invalid = match costs {
            _ if unit_changed || (by_cost.is_some() && self.uneven) => Some(Invalid::MixedUnits),
            Some([]) => Some(Invalid::NoItems),
            Some(costs) => costs
                .iter()
                .position(|&cost| cost == 0)
                .map(Invalid::ItemCostIsZero),
            None => None,
        };
        let plan_at = |size: usize, passes: Option<usize>| match &by_cost {
            None => BatchPlan::for_share(effective, share.clone(), size),
            Some(packing) => BatchPlan::by_cost(packing, size, passes),
        };
        // By cost under an agreement, every rank runs as many micro-batches as the rank that
        // needs the most, each with its own items: a gradient all-reduce after the last
        // micro-batch (DDP's `no_sync` until then) meets every rank at the same pass.
        let counted = by_cost
            .as_ref()
            .and(self.settings.agreement.clone())
            .filter(|_| invalid.is_none());
        let mut agreed_passes = None;
        // Only a step whose shares follow speed is timed: the plain path reads no clock.
        let mut shares = self.shares.take();
        let mut elapsed = None;
        let mut search = self.search(split.clone());
        if let Some(invalid) = invalid {
            search.invalidate(invalid);
        }
        let (result, report) = search.run_reporting(|micro| {
            let mut plan = plan_at(micro, None);
            if let Some(collective) = &counted {
                let mut passes = [plan.accumulation() as u64];
                if let Err(error) = collective.all_reduce(&mut passes, ReduceOp::Max) {
                    return Err(E::no_size_fits(NoExecutableBatchSize::new(
                        StopReason::Agreement(error.to_string()),
                        SearchReport::default(),
                        None,
                    )));
                }
                let passes = usize::try_from(passes[0]).unwrap_or(usize::MAX);
                if passes > plan.accumulation() {
                    plan = plan_at(micro, Some(passes));
                }
                agreed_passes = Some(passes);
            }
            let Some(shares) = shares.as_mut() else {
                return body(&plan);
            };
            let started = shares.now();
            let outcome = body(&plan);
            if outcome.is_ok() {
                elapsed = Some(shares.now().saturating_sub(started));
            }
            outcome
        });
        self.shares = shares;
        // The public edge: the step's report goes to `last_report()` too, as every runner's.
        crate::record::store_last_report(report.clone());
        self.account(report, &split);
        let value = result?;
        self.last_plan = Some(plan_at(self.micro, agreed_passes));
        if let Some(packing) = &by_cost {
            self.learn_square_term(packing, agreed_passes);
        }
        if let Err(error) = self.rebalance(elapsed) {
            // The step ran; the next cannot: its own error, saying so (not "no size fits").
            let report = self.last_report.clone();
            tracing::error!(step = self.steps.saturating_sub(1), %error, "the ranks could not agree on their shares of the next step");
            return Err(E::no_size_fits(NoExecutableBatchSize::new(
                StopReason::SharesNotAgreed {
                    after_step: self.steps.saturating_sub(1),
                    error: error.to_string(),
                },
                report,
                None,
            )));
        }
        Ok(value)
    }

    /// After a step by cost that ran: its peak against its micro-batches' shapes; where the
    /// steps say memory grows with a square term other than the one in use, the cost takes it,
    /// and the budget is what its line says fits the room the step had.
    fn learn_square_term(&mut self, packing: &Packing, passes: Option<usize>) {
        let Some(last) = self.last_report.last() else {
            return;
        };
        let (Some(peak), Some(room)) = (last.figures.peak, last.figures.room) else {
            return;
        };
        if !self.convergence.is_enabled() || !last.outcome.is_success() {
            return;
        }
        let costs = packing.costs();
        let shapes = packing
            .micro_batches(last.batch_size as u64, passes)
            .into_iter()
            .filter_map(|(items, _)| Some((items.len(), costs[*items.first()?])))
            .collect();
        let in_use = self.batch_cost.square_from();
        let Some((from, budget)) = self.square_term.observe(peak, room, shapes, in_use) else {
            return;
        };
        self.batch_cost = self.batch_cost.with_square_from(from);
        self.square_term_learned = true;
        // Sizes measured in the old unit bound nothing in the new one.
        self.convergence.forget();
        self.grow.forget_failures();
        self.micro = budget;
        self.next_micro = budget;
    }

    /// After a step that ran: the shares follow what every rank measured (with uneven shares).
    fn rebalance(&mut self, elapsed: Option<Duration>) -> Result<(), crate::agree::AgreementError> {
        let (Some(shares), Some(collective)) =
            (self.shares.as_mut(), self.settings.agreement.as_ref())
        else {
            return Ok(());
        };
        if let Some(elapsed) = elapsed {
            shares.record(self.micro, elapsed);
        }
        let before = shares.range().len();
        if shares
            .rebalance(&**collective, self.micro, self.steps)?
            .is_some()
        {
            let after = shares.range().len();
            // A rank that never ran out of memory runs its whole new share at once; one that
            // did keeps the size that fitted (the search holds it within the share).
            if after > before && self.grow.smallest_failed().is_none() {
                self.next_micro = after;
            }
        }
        Ok(())
    }

    /// One optimizer step in two parts: `accumulate` (zero the gradients, then forward and
    /// backward every micro-batch of the plan) runs until it fits, redone in place with a
    /// smaller micro-batch on out-of-memory as in [`step`](Self::step); then `apply` (the
    /// gradient all-reduce between ranks, the optimizer step) runs once, with what
    /// `accumulate` returned.
    ///
    /// With [`with_agreement`](Self::with_agreement) every rank has finished `accumulate`
    /// without running out of memory before any rank enters `apply`: no rank waits in a
    /// gradient all-reduce for a rank that is retrying. `apply` itself is not retried (an
    /// out-of-memory error there comes back as it is): keep it to steps whose memory does not
    /// depend on the micro size.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut runner = EffectiveBatch::new(32);
    /// let mut steps = 0;
    /// let loss = runner.step_then(
    ///     |plan| -> anyhow::Result<f64> {
    ///         if plan.micro() > 8 { Err(OutOfMemory::new())? }
    ///         Ok(plan.micro_batches().map(|micro| micro.weight).sum()) // the weights sum to 1
    ///     },
    ///     |_plan, loss| { steps += 1; Ok(loss) },
    /// )?;
    /// assert_eq!((runner.micro() <= 8, steps, loss), (true, 1, 1.0));
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn step_then<T, U, E, M, F, G>(&mut self, accumulate: F, apply: G) -> Result<U, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        G: FnOnce(&BatchPlan, T) -> Result<U, E>,
        E: AttemptError<M>,
    {
        let accumulated = self.step(accumulate)?;
        let plan = self.last_plan.clone().unwrap_or_else(|| self.plan());
        apply(&plan, accumulated)
    }
}
