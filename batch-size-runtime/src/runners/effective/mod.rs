//! The effective batch kept exactly: one optimizer step over micro-batches whose size shrinks on
//! out-of-memory while the number of micro-batches grows, recovered in place in the middle of
//! training.
//!
//! Gradient accumulation computes the gradients of several small batches and steps once; with
//! each micro-batch's mean loss weighted by its share of the batch, the sum is exactly the full
//! batch's mean loss, whatever the division. [`BatchPlan`] is that division, [`EffectiveBatch`]
//! runs one step at a time and, when a step runs out of memory, redoes only that step with a
//! smaller micro-batch.
//!
//! ```
//! use batch_size_runtime::{EffectiveBatch, OutOfMemory};
//!
//! let mut runner = EffectiveBatch::new(32).with_micro(32);
//! let mut parameters = 0.0;
//! for step in 0..3 {
//!     runner.step(|plan| -> anyhow::Result<()> {
//!         if plan.micro() > 8 { Err(OutOfMemory::new())? } // this device holds 8 samples
//!         let mut gradient = 0.0;
//!         for micro in plan.micro_batches() {
//!             let loss_gradient = micro.range.len() as f64; // your backward pass here
//!             gradient += micro.weight * loss_gradient / micro.range.len() as f64;
//!         }
//!         parameters -= 0.1 * gradient;
//!         Ok(())
//!     })?;
//! }
//! assert_eq!(runner.micro(), 8);                    // 32 and 16 ran out of memory once
//! assert_eq!(runner.recoveries().len(), 1);         // at step 0, in place
//! assert!((parameters + 0.3).abs() < 1e-12);        // every step's gradient the full batch's
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::ops::Range;

use crate::agree::Collective;
use crate::attempt::AttemptError;
use crate::engine::BatchSizeSearch;
use crate::memory::Release;
use crate::policy::{FailedAttempt, GrowBack, Guided, Reduction};
use crate::record::SearchReport;

/// How one optimizer step's `effective` samples are divided into micro-batches of at most
/// `micro`: [`accumulation()`](Self::accumulation) of them, in order, the last possibly
/// shorter.
///
/// Each [`MicroBatch`]'s `weight` is its length over `effective`: summing the weighted mean
/// losses of the micro-batches gives exactly the mean loss of the whole batch, so the
/// accumulated gradient does not depend on the micro size.
///
/// What it cannot make exact:
/// - batch normalization computes its statistics per micro-batch: use layer or group norm,
///   synchronize the statistics, or accept that they change with the micro size;
/// - a loss that is a sum, not a mean, needs weight 1 for every micro-batch (sum the losses as
///   they are); any other reduction, rescale it to the whole batch yourself.
///
/// ```
/// use batch_size_runtime::BatchPlan;
///
/// let plan = BatchPlan::new(10, 4);
/// assert_eq!((plan.effective(), plan.micro(), plan.accumulation()), (10, 4, 3));
/// let ranges: Vec<_> = plan.micro_batches().map(|micro| micro.range).collect();
/// assert_eq!(ranges, [0..4, 4..8, 8..10]);
/// let weights: f64 = plan.micro_batches().map(|micro| micro.weight).sum();
/// assert!((weights - 1.0).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    effective: usize,
    micro: usize,
}

/// One micro-batch of a [`BatchPlan`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MicroBatch {
    /// Its position in the step, from 0.
    pub index: usize,
    /// The samples of the batch it holds.
    pub range: Range<usize>,
    /// Its length over the effective batch: the factor of its mean loss.
    pub weight: f64,
}

impl BatchPlan {
    /// The plan for `effective` samples in micro-batches of `micro`. `micro` is held to
    /// `1..=effective` (a micro-batch larger than the batch is the batch); an `effective` of 0
    /// has no micro-batches.
    ///
    /// ```
    /// use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(8, 64).micro(), 8);
    /// assert_eq!(BatchPlan::new(0, 4).accumulation(), 0);
    /// ```
    pub fn new(effective: usize, micro: usize) -> Self {
        BatchPlan {
            effective,
            micro: micro.clamp(1, effective.max(1)),
        }
    }

    /// Samples in the optimizer step.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 32).effective(), 96);
    /// ```
    pub fn effective(&self) -> usize {
        self.effective
    }

    /// Samples in each micro-batch but possibly the last.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 32).micro(), 32);
    /// ```
    pub fn micro(&self) -> usize {
        self.micro
    }

    /// How many micro-batches the step runs: `effective / micro`, rounded up.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(100, 32).accumulation(), 4);
    /// ```
    pub fn accumulation(&self) -> usize {
        self.effective.div_ceil(self.micro)
    }

    /// The micro-batches, in order: their ranges cover `0..effective` exactly once.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// let last = BatchPlan::new(10, 4).micro_batches().last().unwrap();
    /// assert_eq!((last.index, last.range, last.weight), (2, 8..10, 0.2));
    /// ```
    pub fn micro_batches(&self) -> impl ExactSizeIterator<Item = MicroBatch> + '_ {
        let effective = self.effective;
        let micro = self.micro;
        (0..self.accumulation()).map(move |index| {
            let start = index * micro;
            let end = (start + micro).min(effective);
            MicroBatch {
                index,
                range: start..end,
                weight: (end - start) as f64 / effective as f64,
            }
        })
    }
}

/// A step that needed a smaller micro-batch, and the sizes it tried.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recovery {
    /// The step's number, from 0.
    pub step: usize,
    /// The micro sizes tried for it, in order; the last ran unless the step failed.
    pub tried: Vec<usize>,
}

/// Runs optimizer steps over micro-batches that keep the effective batch exactly; a step that
/// runs out of memory (an error or a panic) is redone in place with a smaller micro-batch, and
/// the size is kept for the steps after it. Steps already done are never redone.
///
/// # Default
/// - micro size: `effective` (one micro-batch) until a step runs out of memory;
/// - minimum micro size: 1;
/// - sizes: the guided policy ([`Guided`]), `with_factor` and
///   `with_reduce` as in the attribute;
/// - growing back: off (`with_grow_after(steps)`);
/// - release: [`Release::cuda()`].
///
/// Each step is one search of the engine: the same OOM rules, release, logs and report as the
/// attribute. A step that runs out of memory at the smallest micro size returns
/// `E::from(NoExecutableBatchSize)`; any other error or panic comes back unchanged.
pub struct EffectiveBatch<'r> {
    effective: usize,
    micro: usize,
    min_micro: usize,
    release: Option<Release>,
    shrink: Reduction<'r>,
    grow: GrowBack,
    /// The micro size the next step starts from.
    next_micro: usize,
    steps: usize,
    recoveries: Vec<Recovery>,
    last_report: SearchReport,
    agreement: Option<Box<dyn Collective + 'r>>,
}

impl std::fmt::Debug for EffectiveBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectiveBatch")
            .field("effective", &self.effective)
            .field("micro", &self.micro)
            .field("steps", &self.steps)
            .field("recoveries", &self.recoveries)
            .field("agreement", &self.agreement)
            .finish_non_exhaustive()
    }
}

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
            min_micro: 1,
            release: None,
            shrink: Reduction::default(),
            grow: GrowBack::new(0, effective),
            next_micro: effective,
            steps: 0,
            recoveries: Vec::new(),
            last_report: SearchReport::default(),
            agreement: None,
        }
    }

    /// The micro size the first step tries (capped at `effective`).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(256).with_micro(32).plan().accumulation(), 8);
    /// ```
    pub fn with_micro(mut self, starting: usize) -> Self {
        self.micro = starting;
        self.next_micro = starting;
        self
    }

    /// The smallest micro size tried; below it a step fails with `NoExecutableBatchSize`.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut runner = EffectiveBatch::new(64).with_min_micro(16);
    /// let result = runner.step(|_| -> anyhow::Result<()> { Err(OutOfMemory::new().into()) });
    /// assert!(result.unwrap_err().is::<batch_size_runtime::NoExecutableBatchSize>());
    /// ```
    pub fn with_min_micro(mut self, min_micro: usize) -> Self {
        self.min_micro = min_micro;
        self
    }

    /// What releases device memory between attempts (default: [`Release::cuda()`]).
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, SimulatedDevice};
    /// let device = SimulatedDevice::new(1 << 20);
    /// let runner = EffectiveBatch::new(64).with_release(device.clone());
    /// # let _ = runner;
    /// ```
    pub fn with_release(mut self, release: impl Into<Release>) -> Self {
        self.release = Some(release.into());
        self
    }

    /// Multiplies the micro size by `factor` after an out-of-memory step (Composer halves).
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut runner = EffectiveBatch::new(64).with_factor(0.5);
    /// runner.step(|plan| -> anyhow::Result<()> {
    ///     if plan.micro() > 20 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// assert_eq!(runner.micro(), 16);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_factor(mut self, factor: f64) -> Self {
        self.shrink = Reduction::Factor(factor);
        self
    }

    /// Chooses the next micro size with your function of the failed attempt.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut runner = EffectiveBatch::new(64).with_reduce(|failed| failed.batch_size - 8);
    /// runner.step(|plan| -> anyhow::Result<()> {
    ///     if plan.micro() > 50 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// assert_eq!(runner.micro(), 48);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_reduce(
        mut self,
        reduce: impl FnMut(&FailedAttempt<'_>) -> usize + Send + 'r,
    ) -> Self {
        self.shrink = Reduction::Custom(Box::new(reduce));
        self
    }

    /// The guided policy's margin (see [`BatchSizeSearch::with_margin`]).
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// let runner = EffectiveBatch::new(64).with_margin(0.1);
    /// # let _ = runner;
    /// ```
    pub fn with_margin(mut self, margin: f64) -> Self {
        self.shrink = Reduction::Guided(Guided::new().with_margin(margin));
        self
    }

    /// After `steps` clean steps, tries a larger micro size again: double, capped at
    /// `effective`, while twice the size stays below the smallest size that ran out of memory;
    /// that size itself is tried again once it has held growth back for 16 steps (32, 64, ...
    /// while it keeps failing): the rule [`Chunked`](crate::Chunked) grows back by too. Off by
    /// default.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    /// let mut busy = true; // another process holds memory at first
    /// let mut runner = EffectiveBatch::new(64).with_micro(32).with_grow_after(2);
    /// for _ in 0..24 {
    ///     runner.step(|plan| -> anyhow::Result<()> {
    ///         if busy && plan.micro() > 8 { Err(OutOfMemory::new())? }
    ///         Ok(())
    ///     })?;
    ///     busy = false;
    /// }
    /// // 32 and 16 failed in the first step. Twice 8 is not below 16, so the steps stay at 8
    /// // until 16 has held growth back for 16 steps; then 16 is tried once more, fits (the
    /// // memory is back), and growing goes on: 32, then 64, the whole batch at once.
    /// assert_eq!(runner.micro(), 64);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_grow_after(mut self, steps: usize) -> Self {
        self.grow = GrowBack::new(steps, self.effective);
        self
    }

    /// Agrees with the other ranks of a data-parallel job on every step: if any rank runs out
    /// of memory in a step, every rank redoes that step with the same smaller micro-batch, so
    /// the ranks keep the same plan and step their optimizers together. Use it with
    /// [`step_then`](Self::step_then), whose `apply` (the gradient all-reduce and the optimizer
    /// step) runs only once every rank's micro-batches are done: the safe point. See
    /// [`agree`](crate::agree).
    ///
    /// ```
    /// use std::thread;
    /// use batch_size_runtime::agree::{Collective, ReduceOp, ThreadRanks};
    /// use batch_size_runtime::{EffectiveBatch, OutOfMemory};
    ///
    /// let ranks = ThreadRanks::new(2);
    /// thread::scope(|scope| {
    ///     for (rank, holds) in ranks.iter().zip([64, 16]) {
    ///         scope.spawn(move || {
    ///             let mut runner = EffectiveBatch::new(64).with_agreement(rank);
    ///             for _ in 0..3 {
    ///                 runner.step_then(
    ///                     |plan| -> anyhow::Result<()> {
    ///                         if plan.micro() > holds { Err(OutOfMemory::new())? }
    ///                         Ok(()) // forward and backward of every micro-batch
    ///                     },
    ///                     |_plan, ()| {
    ///                         let mut gradient = [1];
    ///                         rank.all_reduce(&mut gradient, ReduceOp::Max)?; // both ranks here
    ///                         Ok(())
    ///                     },
    ///                 )?;
    ///             }
    ///             assert!(runner.micro() <= 16); // the same plan on both ranks
    ///             anyhow::Ok(())
    ///         });
    ///     }
    /// });
    /// ```
    pub fn with_agreement(mut self, collective: impl Collective + 'r) -> Self {
        self.agreement = Some(Box::new(collective));
        self
    }

    /// The plan the next step will try.
    ///
    /// ```
    /// # use batch_size_runtime::EffectiveBatch;
    /// assert_eq!(EffectiveBatch::new(100).with_micro(30).plan().accumulation(), 4);
    /// ```
    pub fn plan(&self) -> BatchPlan {
        BatchPlan::new(self.effective, self.micro)
    }

    /// The micro size in use (the size of the last step that ran).
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
    /// assert_eq!(runner.last_report().len(), 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn last_report(&self) -> &SearchReport {
        &self.last_report
    }

    fn search(&mut self) -> BatchSizeSearch<'_> {
        let mut search = BatchSizeSearch::new(self.next_micro.min(self.effective).max(1))
            .with_label("effective_batch")
            .with_min(self.min_micro);
        search.settings.first_fit_at_debug = true;
        if self.effective == 0 {
            search.invalidate("`effective` must be at least 1, got 0".to_owned());
        }
        if let Some(release) = &self.release {
            search = search.with_release(release.clone());
        }
        if let Some(collective) = &self.agreement {
            search = search.with_agreement(&**collective);
        }
        search.with_reduction(self.shrink.borrowed())
    }

    /// Records how a step's search went.
    fn account(&mut self, report: SearchReport) {
        let step = self.steps;
        // More than one attempt: this rank ran out of memory, or (with an agreement) another
        // rank did and every rank redid the step. Either way the sizes before the last did not
        // fit somewhere, and growing back stays below them.
        if report.len() > 1 {
            let tried: Vec<usize> = report
                .attempts()
                .map(|attempt| attempt.batch_size)
                .collect();
            for &failed in &tried[..tried.len() - 1] {
                self.grow.failed(failed);
            }
            if report.out_of_memory_count() > 0 {
                tracing::warn!(
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
                    "step {step} redone with a smaller micro-batch: another rank ran out of memory"
                );
            }
            self.recoveries.push(Recovery { step, tried });
        }
        if let Some(micro) = report.batch_size() {
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
    /// The step's report is [`last_report`](Self::last_report), and in
    /// [`crate::last_report()`] as for every runner.
    ///
    /// ```
    /// # use batch_size_runtime::{EffectiveBatch, SimulatedDevice};
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
    pub fn step<T, E, M, F>(&mut self, mut body: F) -> Result<T, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        E: AttemptError<M>,
    {
        let effective = self.effective;
        let result = self
            .search()
            .run(|micro| body(&BatchPlan::new(effective, micro)));
        self.account(crate::record::last_report().unwrap_or_default());
        result
    }

    /// The same as [`step`](Self::step), which takes your own error type now.
    #[deprecated(
        since = "0.1.0",
        note = "`step` takes your own error type now: call `step`"
    )]
    pub fn step_typed<T, E, M, F>(&mut self, body: F) -> Result<T, E>
    where
        F: FnMut(&BatchPlan) -> Result<T, E>,
        E: AttemptError<M>,
    {
        self.step(body)
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
        apply(&self.plan(), accumulated)
    }
}
