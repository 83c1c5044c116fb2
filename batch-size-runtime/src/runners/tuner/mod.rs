//! A tuner that finds the largest batch size in a few short trials before training: probe two
//! small sizes, fit memory against the size from their peaks, jump to the predicted limit, and
//! stop once the largest success and the smallest failure are within a quarter of the
//! headroom; then keep the headroom, and run that size too. It times every trial, so that it can also name
//! the fastest size (samples per second), and return it instead of the largest.

use crate::attempt::AttemptError;
use crate::engine::{settings_setters, Invalid, Settings};
#[allow(unused_imports)] // for the docs' links
use crate::error::StopReason;
#[allow(unused_imports)] // for the docs' links
use crate::memory::Release;
use crate::opaque::Opaque;
use crate::policy::SizePolicy;
use crate::record::{CacheHit, SearchReport};
use crate::runners::search::BatchSizeSearch;

// One concept a file: the search (a size policy), what the trials measure of speed, the cache
// entry the tuner reads and writes.
mod cache;
mod dry_run;
mod search;
mod throughput;

use crate::memory::{DryRun, DrySizing};
use cache::{Found, Range, TunerCache};
use dry_run::DryRunPolicy;

use search::{kept_size, largest_below_failures, without_leftover_failures, Goal, TunerPolicy};
use throughput::{fastest, throughput};

/// Finds the largest batch size whose trial runs, in few trials.
///
/// Each trial is a call of your closure with a size: run a few training steps **at that size,
/// on the longest inputs** (the memory of a batch grows with its sequences: lhotse and OpenNMT
/// probe the longest batch first), and return as an attempt would. Out-of-memory errors and
/// panics are recognised as everywhere in this crate; memory is released between trials.
///
/// # What a trial must do
/// Allocate what a real step at that size allocates: a trial that ignores its size, or runs no
/// step (Lightning #21903 and #13851: trials that ran zero batches all "succeeded"), fits at
/// every size, and the size found then runs out of memory in training. Where the release backend
/// reads the device's peak memory, the tuner checks it: the same peak at two sizes at least 16
/// times apart stops it with [`StopReason::MemoryDoesNotGrow`] ("the trial's memory does not
/// grow with the batch size: does it run a step at the size it is given?"). Without figures
/// ([`Release::none()`], errors that carry none) nothing can check it: make sure the trial
/// builds its batch from the size it is given and runs at least one forward and backward pass.
///
/// # How it searches
/// With memory figures it fits memory against the size from its trials' peaks and runs the
/// size the fit says leaves the headroom, confirmed by that trial; without, it grows four times
/// a trial, then bisects. It never returns a size whose own trial did not succeed, never one
/// above a size that failed, and never tries one above `with_max`; where memory shrinks between
/// trials it searches again below the failure. With [`Choice::Fastest`] it also times the
/// trials ([`with_clock`](Self::with_clock)) and returns the smallest size within the tolerance
/// of the best throughput. The whole algorithm is in `docs/HOW_IT_WORKS.md` ("The tuner").
///
/// # Default
/// `min` 1, no `max`, headroom 0.05 (as Lightning's margin), `max_trials` 25, release
/// [`Release::cuda()`], no cache, [`Choice::Largest`], tolerance 0.02, the wall clock, no fixed
/// memory declared.
///
/// ```
/// use batch_size_runtime::{memory::SimulatedDevice, Tuner};
///
/// let device = SimulatedDevice::new(16 << 30); // 16 GiB
/// let tuned = Tuner::new()
///     .with_release(device.clone())
///     .run(|batch_size| -> anyhow::Result<()> {
///         let _weights = device.alloc(4 << 30)?;                             // 4 GiB
///         let _activations = device.alloc(batch_size as u64 * (100 << 20))?; // 100 MiB a sample
///         Ok(())
///     })?;
/// assert!(tuned.batch_size() >= 115 && tuned.batch_size() < 122); // 122 fit; 5 % kept
/// assert_eq!(tuned.largest_fit(), tuned.batch_size());     // no trial ran above it
/// assert!(tuned.report().len() <= 4);                      // Lightning's binsearch: 13 trials
/// # Ok::<(), anyhow::Error>(())
/// ```
#[must_use = "a tuner does nothing until it is run"]
#[derive(Debug)]
pub struct Tuner {
    settings: Settings<'static>,
    headroom: f64,
    max_trials: usize,
    choice: Choice,
    tolerance: f64,
    fixed_memory: Option<u64>,
    /// Sizes from dry runs first, where a framework has them.
    dry_run: Option<Opaque<Box<dyn DryRun>>>,
}

/// How the trials ended: the search's result and report.
struct Trials<T, E> {
    result: Result<T, E>,
    report: SearchReport,
}

/// What the search's policy learned, for the tuner's answer: the headroom's size where it ran
/// (0 where none did), and whether the budget ended the search with a larger size left.
struct Learned {
    kept: usize,
    cut_by_budget: bool,
}

/// Which size a [`Tuner`] returns as [`Tuned::batch_size`].
///
/// ```
/// use batch_size_runtime::{Choice, Tuner};
/// let tuner = Tuner::new().choose(Choice::Fastest);
/// # let _ = tuner;
/// assert_eq!(Choice::default(), Choice::Largest);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Choice {
    /// The largest size that fit, less the headroom (Lightning's, Accelerate's answer).
    #[default]
    Largest,
    /// The smallest size within the tolerance of the best samples per second measured, at or
    /// below the largest less the headroom: past a point a larger batch is no faster.
    Fastest,
}

/// What a [`Tuner`] found.
#[derive(Debug, Clone)]
pub struct Tuned {
    batch_size: usize,
    largest: usize,
    largest_fit: usize,
    fastest: usize,
    throughput: Vec<(usize, f64)>,
    report: SearchReport,
}

impl Tuned {
    /// The size to train with: by default [`largest()`](Self::largest) (its trial ran too); with
    /// [`Choice::Fastest`], [`fastest()`](Self::fastest), whatever the budget left for its
    /// final trial. A rerun from the cache returns the same size, in one trial, where the run
    /// that wrote the entry ended its search; where that run's budget ended it with a larger
    /// size left, the rerun spends its trials growing from the cached size.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(64).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), 60); // 64 ran; 5 % kept
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The largest size to train with, whichever [`Choice`] was made: the size the tuner kept
    /// below [`largest_fit()`](Self::largest_fit) with its headroom (`with_headroom`), aimed
    /// at from the figures and confirmed by a trial of its own, or, without figures, the
    /// largest that fit less the headroom. A rerun from the cache reports what the run that
    /// wrote the entry reported.
    ///
    /// ```
    /// # use batch_size_runtime::{Choice, Tuner};
    /// let tuned = Tuner::new().with_max(64).choose(Choice::Fastest).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.largest(), 60);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn largest(&self) -> usize {
        self.largest
    }

    /// The largest size whose trial succeeded below every size that failed (a size that ran
    /// before a smaller one failed no longer counts), before the headroom; on a rerun from the
    /// cache, the largest that succeeded when the entry was written.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(64).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.largest_fit(), 64);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn largest_fit(&self) -> usize {
        self.largest_fit
    }

    /// Samples per second measured at each size, by size: the size over the trial's time (the
    /// quickest trial where a size ran twice). Sizes whose trial failed, or took no measurable
    /// time, are absent.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use batch_size_runtime::Tuner;
    /// let mut now = Duration::ZERO;
    /// let tuned = Tuner::new()
    ///     .with_max(8)
    ///     .with_headroom(0.0)
    ///     .with_clock(move || { now += Duration::from_millis(50); now }) // 50 ms a trial
    ///     .run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.throughput()[0], (1, 20.0)); // 1 sample in 50 ms
    /// assert_eq!(tuned.throughput().last(), Some(&(8, 160.0)));
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn throughput(&self) -> &[(usize, f64)] {
        &self.throughput
    }

    /// The smallest size, at or below [`largest()`](Self::largest), whose samples per second
    /// are within the tolerance (default 2 %) of the best measured there; `largest()` when
    /// nothing was measured. It is judged over the sizes that ran: with [`Choice::Largest`]
    /// these are only the search's own trials, with [`Choice::Fastest`] powers of two below
    /// the largest were run for it.
    ///
    /// ```
    /// # use std::sync::{Arc, atomic::{AtomicU64, Ordering}};
    /// # use std::time::Duration;
    /// use batch_size_runtime::{Choice, OutOfMemory, Tuner};
    ///
    /// // A step takes 1 ms up to 64 samples, then longer in proportion: 64 000 samples/s at most.
    /// let micros = Arc::new(AtomicU64::new(0));
    /// let clock = Arc::clone(&micros);
    /// let tuned = Tuner::new()
    ///     .choose(Choice::Fastest)
    ///     .with_release(batch_size_runtime::Release::none())
    ///     .with_clock(move || Duration::from_micros(clock.load(Ordering::Relaxed)))
    ///     .run(|size| -> anyhow::Result<()> {
    ///         if size > 200 { Err(OutOfMemory::new())? }
    ///         micros.fetch_add(1000 * size.max(64) as u64 / 64, Ordering::Relaxed);
    ///         Ok(())
    ///     })?;
    /// assert_eq!(tuned.fastest(), 64);
    /// assert_eq!(tuned.batch_size(), 64);
    /// assert_eq!(tuned.largest_fit(), 200);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn fastest(&self) -> usize {
        self.fastest
    }

    /// Every trial, in order.
    ///
    /// ```
    /// # use batch_size_runtime::{OutOfMemory, Tuner};
    /// let tuned = Tuner::new().run(|size| -> anyhow::Result<()> {
    ///     if size > 40 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// assert!(tuned.report().out_of_memory_count() >= 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn report(&self) -> &SearchReport {
        &self.report
    }
}

impl Default for Tuner {
    fn default() -> Self {
        Tuner::new()
    }
}
settings_setters!(Tuner, "Tuner::new()", bounds, label, release, clock);

impl Tuner {
    /// A tuner with the defaults.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuner = Tuner::new();
    /// # let _ = tuner;
    /// ```
    pub fn new() -> Self {
        Tuner {
            settings: Settings::default(),
            headroom: 0.05,
            max_trials: 25,
            choice: Choice::Largest,
            tolerance: 0.02,
            fixed_memory: None,
            dry_run: None,
        }
    }

    /// Sizes from dry runs first ([`DryRun`]; for burn, `memory::BurnDryRun`):
    /// the trial runs under the framework's dry run at two or three sizes, increasing, a line
    /// through their peaks gives the largest size that fits the device, the headroom is taken
    /// off, and one real trial confirms that size. Where it runs out of memory, the ordinary
    /// search runs below it; where the dry runs give no size (the trial failed under one,
    /// its memory does not grow), the ordinary search runs. Only for [`Choice::Largest`].
    ///
    /// A trial measured this way must be driven by shapes: values read back under a dry run
    /// are garbage, so a trial that branches on them measures another step than the one that
    /// runs.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    /// use std::sync::Arc;
    /// use batch_size_runtime::memory::DryRun;
    /// use batch_size_runtime::Tuner;
    ///
    /// // A framework whose dry run says 100 MiB fixed and 1 MiB a sample, on 1 GiB.
    /// #[derive(Debug)]
    /// struct Paper(Arc<AtomicUsize>); // the size the step last ran at
    /// impl DryRun for Paper {
    ///     fn measure(&self, step: &mut dyn FnMut()) -> Option<u64> {
    ///         step();
    ///         Some((100 << 20) + self.0.load(Relaxed) as u64 * (1 << 20))
    ///     }
    ///     fn budget(&self) -> Option<u64> { Some(1 << 30) }
    /// }
    /// let size = Arc::new(AtomicUsize::new(0));
    /// let tuned = Tuner::new()
    ///     .with_release(batch_size_runtime::Release::none())
    ///     .with_dry_run(Paper(Arc::clone(&size)))
    ///     .run(|batch_size| { size.store(batch_size, Relaxed); Ok::<_, anyhow::Error>(()) })?;
    /// assert_eq!(tuned.report().len(), 1);           // one real trial
    /// assert_eq!(tuned.batch_size(), 924 * 95 / 100); // 924 fit; 5 % kept
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_dry_run(mut self, dry_run: impl DryRun + 'static) -> Self {
        self.dry_run = Some(Opaque(Box::new(dry_run)));
        self
    }

    /// Bytes the trial allocates whatever its size: weights, gradients and an optimizer's state
    /// it creates itself (parameters × bytes × (1 + gradients + optimizer states)). Not what
    /// is already on the device before the trial: that is read. With figures, the first trial's
    /// peak less these bytes is then what the size costs, and the second trial goes near the
    /// answer. A declaration above what the first trial used is ignored; one below it costs a
    /// trial, never a size above the limit.
    ///
    /// ```
    /// use batch_size_runtime::{memory::SimulatedDevice, Tuner};
    ///
    /// let device = SimulatedDevice::new(16 << 30);
    /// let tuned = Tuner::new()
    ///     .with_release(device.clone())
    ///     .with_fixed_memory(9 << 30)
    ///     .run(|batch_size| -> anyhow::Result<()> {
    ///         let _weights_and_adam = device.alloc(9 << 30)?;
    ///         let _activations = device.alloc(batch_size as u64 * (60 << 20))?;
    ///         Ok(())
    ///     })?;
    /// assert_eq!(tuned.batch_size(), 113); // 119 fit; 5 % kept
    /// assert_eq!(tuned.report().len(), 2); // 1, then 113
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_fixed_memory(mut self, bytes: u64) -> Self {
        self.fixed_memory = Some(bytes);
        self
    }

    /// The headroom: the share taken off the largest size that ran (0 ≤ headroom < 1; default
    /// 0.05). Not the guided policy's margin (memory kept free): a share of the size.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(100).with_headroom(0.2).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), 80);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_headroom(mut self, headroom: f64) -> Self {
        self.headroom = headroom;
        self
    }

    /// At most this many trials (default 25, as Lightning), whatever the memory does: a retry
    /// of the engine's (below a failure, after a pool's leftovers) counts as one, and none runs
    /// past the budget. Every trial is spent: the last
    /// is kept back only to confirm the headroom's size below the largest that ran, where that
    /// size has not run; otherwise it searches too, aimed at a size kept with the headroom, so
    /// that its success is the answer (and its failure leaves the size that ran before it).
    /// The size returned always ran, below every size that failed.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// // From 4, two trials that fit: the second grows past the first.
    /// let tuned = Tuner::new().with_min(4).with_max_trials(2).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.report().len(), 2);
    /// assert!(tuned.batch_size() > 4);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_max_trials(mut self, max_trials: usize) -> Self {
        self.max_trials = max_trials;
        self
    }

    /// Which size [`Tuned::batch_size`] is: [`Choice::Largest`] (the default) or
    /// [`Choice::Fastest`], which runs a few more trials to measure sizes below the largest.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use batch_size_runtime::{Choice, Tuner};
    /// // Every trial takes a second whatever its size (a clock of its own, not the wall's, so
    /// // that no other load changes the answer): the largest is the fastest.
    /// let mut now = Duration::ZERO;
    /// let tuned = Tuner::new()
    ///     .with_max(100)
    ///     .choose(Choice::Fastest)
    ///     .with_clock(move || { now += Duration::from_millis(500); now })
    ///     .run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), tuned.largest());
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn choose(mut self, choice: Choice) -> Self {
        self.choice = choice;
        self
    }

    /// How far below the best samples per second a size may be and still count as fastest
    /// (0 ≤ tolerance < 1; default 0.02).
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuner = Tuner::new().with_tolerance(0.05);
    /// # let _ = tuner;
    /// ```
    pub fn with_tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Runs the trials. Takes the error types every runner takes ([`AttemptError`] and
    /// `From<NoExecutableBatchSize>`): a trial that fails with an error that is not
    /// out-of-memory ends the tuning and the error comes back unchanged; a panic that is not
    /// out-of-memory resumes; when not even `min` fits, or the trial's memory does not grow
    /// with its size, `E::from(NoExecutableBatchSize)`.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let error = Tuner::new().run(|_| -> anyhow::Result<()> { anyhow::bail!("no data") }).unwrap_err();
    /// assert_eq!(error.to_string(), "no data"); // your error, not a string in another one
    /// ```
    pub fn run<T, E, M>(mut self, mut trial: impl FnMut(usize) -> Result<T, E>) -> Result<Tuned, E>
    where
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&trial);
        self.check();
        // The cache first: a usable entry makes the dry runs unnecessary.
        let cache = self.open_cache();
        let start = cache.as_ref().and_then(TunerCache::start);
        let mut policy = self.policy(self.settings.max).with_cached_start(start);
        let mut dry_policy = match start {
            Some(_) => None,
            None => self.dry_sizing(&mut trial).map(|sizing| {
                let below = self.policy(Some(
                    sizing.batch_size.saturating_sub(1).max(self.settings.min),
                ));
                DryRunPolicy::new(sizing, below, self.settings.min)
            }),
        };
        let sizes: &mut dyn SizePolicy = match &mut dry_policy {
            Some(dry_policy) => dry_policy,
            None => &mut policy,
        };
        let min = self.settings.min;
        let release = self.settings.release.clone();
        let offer = cache.as_ref().and_then(TunerCache::offer);
        let trials = self.trials(sizes, trial, offer);
        let learned = match &dry_policy {
            Some(dry_policy) => Learned {
                kept: dry_policy.kept_size(),
                cut_by_budget: dry_policy.cut_by_budget(),
            },
            None => Learned {
                kept: policy.kept_size(),
                cut_by_budget: policy.cut_by_budget(),
            },
        };
        trials.result?;
        let (tuned, found) = self.conclude(trials.report, cache.as_ref(), learned, min);
        if let Some(cache) = cache {
            cache.remember(&found, &release);
        }
        Ok(tuned)
    }

    /// The entry of this tuning, where a key was given and the settings hold: judged by the
    /// tuner's range, so that a size outside it (a forged `u64::MAX`, a size above `with_max`)
    /// never steers it.
    fn open_cache(&self) -> Option<TunerCache> {
        if self.settings.invalid.is_some() {
            return None;
        }
        let range = Range {
            min: self.settings.min,
            max: self.settings.max,
        };
        let settings = self.settings.cache()?;
        Some(TunerCache::open(
            settings,
            self.choice,
            range,
            &self.settings.release,
        ))
    }

    /// Every setting checked before any of your code runs, the dry run's trials included.
    fn check(&mut self) {
        let settings = &mut self.settings;
        settings.check();
        if !(self.headroom.is_finite() && (0.0..1.0).contains(&self.headroom)) {
            settings.invalidate(Invalid::Headroom(self.headroom));
        }
        if !(self.tolerance.is_finite() && (0.0..1.0).contains(&self.tolerance)) {
            settings.invalidate(Invalid::Tolerance(self.tolerance));
        }
        if self.max_trials == 0 {
            settings.invalidate(Invalid::MaxTrialsIsZero);
        }
    }

    /// The tuner's search policy, never above `max`: lent to the search, and what it learned
    /// read from it afterwards.
    fn policy(&self, max: Option<usize>) -> TunerPolicy {
        TunerPolicy::new(Goal {
            min: self.settings.min,
            max,
            headroom: self.headroom,
            max_trials: self.max_trials,
            choice: self.choice,
            tolerance: self.tolerance,
        })
        .with_fixed_memory(self.fixed_memory)
    }

    /// Sizing from dry runs, where asked for (and the settings hold): their size first, the
    /// ordinary search capped below it if it runs out of memory.
    fn dry_sizing<T, E>(&self, trial: &mut impl FnMut(usize) -> Result<T, E>) -> Option<DrySizing> {
        match (&self.dry_run, self.choice) {
            (Some(Opaque(dry_run)), Choice::Largest) if self.settings.invalid.is_none() => {
                dry_run::dry_sizing(
                    dry_run.as_ref(),
                    trial,
                    self.settings.min,
                    self.settings.max,
                    self.headroom,
                )
            }
            _ => None,
        }
    }

    /// Runs the trials: the search with the tuner's settings (moved into it) and `sizes` lent
    /// to it, behind
    /// the tuner's own cache wrapper where a key was given (the fastest size is another answer
    /// than the largest: another entry), each trial timed with the tuner's clock.
    fn trials<T, E, M>(
        &mut self,
        sizes: &mut dyn SizePolicy,
        trial: impl FnMut(usize) -> Result<T, E>,
        offer: Option<(usize, CacheHit)>,
    ) -> Trials<T, E>
    where
        E: AttemptError<M>,
    {
        let mut settings = std::mem::take(&mut self.settings);
        // The tuner reads and writes its entry itself (`TunerCache`): the search only says
        // whether the cached size was served.
        settings.cache = None;
        settings.cache_offer = offer;
        // The budget binds the engine too: none of its own rules (a retry below a failure, a
        // size run again after a pool's leftovers) runs a trial past it.
        settings.max_attempts = Some(self.max_trials.max(1));
        let min = settings.min;
        let search = BatchSizeSearch {
            starting: min,
            settings,
        };
        // Each trial is timed by the search, with the tuner's clock where one was given (it
        // travels in the settings): the durations are in the report, for the policy and for
        // the throughput.
        let (result, report) = search.with_policy(sizes).run_with_report(trial);
        Trials { result, report }
    }

    /// What the trials found: the largest (`kept`, the policy's headroom size, where it ran),
    /// the fastest, and what the cache keeps for the next run.
    fn conclude(
        &self,
        report: SearchReport,
        cache: Option<&TunerCache>,
        learned: Learned,
        min: usize,
    ) -> (Tuned, Found) {
        // A failure the engine ran again at once (a pool's leftovers) bounds nothing.
        let measured = without_leftover_failures(&report);
        let ran_largest = largest_below_failures(&measured).unwrap_or(0);
        let smallest_failure = measured
            .attempts()
            .filter(|attempt| attempt.outcome.is_out_of_memory())
            .map(|attempt| attempt.batch_size)
            .min();
        let last_ran = report.batch_size();
        // A rerun served from the cache ran one size: what was measured is in the entry, and
        // what the first run reported with it.
        let served = cache
            .filter(|_| report.from_cache())
            .and_then(TunerCache::served);
        let (largest_fit, largest) = match served {
            Some(entry) => {
                let largest_fit = entry.largest_fit.unwrap_or(ran_largest).max(ran_largest);
                // Never below the size cached: where nothing ran above it, it was kept with the
                // headroom already.
                let largest = entry
                    .largest
                    .unwrap_or_else(|| kept_size(largest_fit, self.headroom, min));
                (largest_fit, largest.max(last_ran.unwrap_or(0)))
            }
            None => match learned.kept {
                0 => (ran_largest, last_ran.unwrap_or(ran_largest)),
                kept => (ran_largest, kept),
            },
        };
        let throughput = throughput(&report);
        // Only sizes below every failure are candidates (a size that ran before the memory
        // shrank and failed since is not).
        let below_failures: Vec<(usize, f64)> = throughput
            .iter()
            .copied()
            .filter(|&(size, _)| smallest_failure.is_none_or(|failed| size < failed))
            .collect();
        let fastest = match (served, last_ran) {
            // The cached size is the fastest the first run found.
            (Some(_), Some(size)) if self.choice == Choice::Fastest => size,
            _ => fastest(&below_failures, largest, self.tolerance).unwrap_or(largest),
        };
        let batch_size = match self.choice {
            // The fastest measured, whatever the budget left for its final trial.
            Choice::Fastest => fastest,
            // The size that ran last; where the budget's last trial failed above the largest
            // kept (the search then ended on a failure), the largest: it ran, below that
            // failure.
            Choice::Largest => match last_ran {
                Some(size) => size,
                None if largest > 0 => largest,
                None => ran_largest,
            },
        };
        let found = Found {
            batch_size,
            largest,
            largest_fit,
            failed_above: smallest_failure.filter(|&failed| failed > batch_size),
            unfinished: learned.cut_by_budget,
        };
        let tuned = Tuned {
            batch_size,
            largest,
            largest_fit,
            fastest,
            throughput,
            report,
        };
        (tuned, found)
    }
}
