//! [`BatchSizeSearch`], the runner users call directly and the attribute expands into: one
//! search from `starting`, shrinking after each out-of-memory failure.
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, memory::SimulatedDevice};
//!
//! let device = SimulatedDevice::new(1 << 30); // 1 GiB
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(256)
//!     .with_factor(0.9)
//!     .with_release(device.clone())
//!     .run(|batch_size| {
//!         let _activations = device.alloc(batch_size as u64 * (5 << 20))?; // 5 MiB a sample
//!         Ok(batch_size)
//!     });
//! assert_eq!(fitted.unwrap(), 186); // 256, 230 and 207 did not fit
//! ```

use std::error::Error;

use crate::attempt::AttemptError;
use crate::engine::dispatch::{Kept, LastError, PanicOnly};
use crate::engine::{drive_async, drive_ended, drive_reporting, settings_setters, Ended};
use crate::engine::{driver, Invalid, Search, Settings};
#[allow(unused_imports)] // for the docs' links
use crate::error::{NoExecutableBatchSize, StopReason};
#[allow(unused_imports)] // for the docs' links
use crate::memory::Release;
use crate::policy::{Reduction, SizePolicy};
use crate::record::{Attempt, SearchReport};
use crate::remedies::{RemediedSearch, Remedies};

/// Finds a batch size that fits: calls an attempt with `starting`, and after each
/// out-of-memory failure (a returned error or a panic) releases device memory and calls it
/// again with a smaller size.
///
/// # Default
/// - sizes: [`Guided`](crate::policy::Guided), from each failure's figures, halving where there are none
///   (`with_factor(0.9)` is Accelerate 1.x, `with_policy(Halve)` toma)
/// - `min`: 1; no cap on attempts
/// - release: [`Release::cuda()`], which does nothing where CUDA is not in use
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
///
/// let trained: Result<usize, anyhow::Error> = BatchSizeSearch::new(128)
///     .with_min(8)
///     .run(|batch_size| {
///         if batch_size > 32 {
///             return Err(OutOfMemory::new().into()); // what your framework returns
///         }
///         Ok(batch_size)
///     });
/// assert_eq!(trained.unwrap(), 32);
/// ```
#[derive(Debug)]
#[must_use = "a search does nothing until it is run"]
pub struct BatchSizeSearch<'r> {
    /// The first size tried.
    pub(crate) starting: usize,
    /// Everything else: bounds, size rule, release, cache, agreement, remedies, hooks.
    pub(crate) settings: Settings<'r>,
}

settings_setters!(
    BatchSizeSearch<'r>,
    "BatchSizeSearch::new(64)",
    bounds,
    label,
    clock,
    release,
    shrink,
    agreement
);

impl<'r> BatchSizeSearch<'r> {
    /// A search that starts at `starting`. With 0 it stops at once, calling nothing.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, StopReason};
    /// let fitted = BatchSizeSearch::new(16).call(|batch_size| batch_size);
    /// assert_eq!(fitted.unwrap(), 16);
    /// let never = BatchSizeSearch::new(0).call(|batch_size| batch_size).unwrap_err();
    /// assert_eq!(never.reason(), &StopReason::StartedAtZero);
    /// assert!(never.tried().is_empty());
    /// ```
    #[inline]
    pub fn new(starting: usize) -> Self {
        BatchSizeSearch {
            starting,
            settings: Settings::default(),
        }
    }

    /// Sets the reduction policy.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, policy::Reduction};
    /// let minus_eight = Reduction::Custom(Box::new(|failed| failed.batch_size - 8));
    /// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(32)
    ///     .with_reduction(minus_eight)
    ///     .run(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// assert_eq!(none_fit.tried(), &[32, 24, 16, 8]);
    /// ```
    pub fn with_reduction(mut self, reduction: Reduction<'r>) -> Self {
        self.settings.set_shrink(reduction);
        self
    }

    /// Makes at most `max_attempts` attempts. 0 is refused: the search stops before its first
    /// attempt with [`StopReason::InvalidConfiguration`].
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory, StopReason};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(64).with_max_attempts(2).run(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let error = error.downcast_ref::<batch_size_runtime::NoExecutableBatchSize>().unwrap();
    /// assert_eq!(error.reason(), &StopReason::MaxAttempts(2));
    /// ```
    #[inline]
    pub fn with_max_attempts(mut self, max_attempts: usize) -> Self {
        self.settings.set_max_attempts(max_attempts);
        self
    }

    /// Makes the search stop before its first attempt ([`StopReason::InvalidConfiguration`]).
    pub(crate) fn invalidate(&mut self, why: Invalid) {
        self.settings.invalidate(why);
    }

    /// Chooses sizes with `policy` instead of the guided default: a policy of this crate
    /// ([`policy`](crate::policy)) or your own.
    ///
    /// ```
    /// use batch_size_runtime::policy::Factor;
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    ///
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(128)
    ///     .with_policy(Factor(0.75))
    ///     .run(|batch_size| {
    ///         if batch_size > 80 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(fitted.unwrap(), 72); // 128, 96, 72
    /// ```
    pub fn with_policy(mut self, policy: impl SizePolicy + 'r) -> Self {
        self.settings.policy = Some(Box::new(policy));
        self
    }

    /// Also counts as out-of-memory, for this search only, every error for which `predicate`
    /// is true (each error of a `source()` chain in turn; a panic's message as an error whose
    /// `Display` is that text). [`oom::add_rule`](crate::oom::add_rule) does the same for the
    /// whole process.
    ///
    /// ```
    /// use batch_size_runtime::BatchSizeSearch;
    ///
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
    ///     .when(|error| error.to_string().contains("arena exhausted"))
    ///     .run(|batch_size| {
    ///         if batch_size > 16 { anyhow::bail!("my_accel: arena exhausted") }
    ///         Ok(batch_size)
    ///     });
    /// assert_eq!(fitted.unwrap(), 16);
    /// ```
    pub fn when(
        mut self,
        predicate: impl Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'r,
    ) -> Self {
        self.settings.hooks_mut().when = Some(Box::new(predicate));
        self
    }

    /// Calls `callback` with every attempt as it ends (after the release that follows an
    /// out-of-memory attempt): for progress bars and logs of your own.
    ///
    /// ```
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    ///
    /// let mut seen = Vec::new();
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
    ///     .notify(|attempt| seen.push((attempt.batch_size, attempt.outcome.is_success())))
    ///     .run(|batch_size| {
    ///         if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(fitted.unwrap(), 16);
    /// assert_eq!(seen, [(64, false), (32, false), (16, true)]);
    /// ```
    pub fn notify(mut self, callback: impl FnMut(&Attempt) + Send + 'r) -> Self {
        self.settings.hooks_mut().notify = Some(Box::new(callback));
        self
    }

    /// Hands the search's report to `callback` when the search ends, however it ends: the
    /// report of this search and no other, also for an `async` search that moved between
    /// threads or many searches running at once (where [`last_report()`](crate::last_report),
    /// per thread, cannot tell them apart).
    ///
    /// ```
    /// use std::sync::mpsc;
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    ///
    /// let (reports, received) = mpsc::channel();
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
    ///     .on_report(move |report| reports.send(report.clone()).unwrap())
    ///     .run(|batch_size| {
    ///         if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(fitted.unwrap(), 16);
    /// assert_eq!(received.recv().unwrap().len(), 3);
    /// ```
    pub fn on_report(mut self, callback: impl FnOnce(&SearchReport) + Send + 'r) -> Self {
        self.settings.hooks_mut().on_report = Some(Box::new(callback));
        self
    }

    /// Runs the search: calls `attempt` with each size until one returns without running out
    /// of memory. Takes the error types every runner takes ([`AttemptError`]): your own error
    /// type (with `From<NoExecutableBatchSize>`, e.g. a `thiserror` enum with a `#[from]`
    /// variant), `anyhow::Error` and `Box<dyn Error + Send + Sync>`.
    ///
    /// Returns the first `Ok`. An error that is not out-of-memory is returned at once,
    /// unchanged; a panic that is not out-of-memory resumes unwinding. When no size is left,
    /// returns `E::from(NoExecutableBatchSize)`, keeping the last out-of-memory error as its
    /// `source()`. The report goes to [`last_report()`](crate::last_report), as for every
    /// search.
    ///
    /// ```
    /// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// enum TrainError {
    ///     #[error("forward pass failed")]
    ///     Device(#[from] OutOfMemory),
    ///     #[error("bad data: {0}")]
    ///     Data(String),
    ///     #[error(transparent)]
    ///     NoBatchSize(#[from] NoExecutableBatchSize),
    /// }
    ///
    /// let fitted = BatchSizeSearch::new(64).run(|batch_size| {
    ///     if batch_size > 16 {
    ///         return Err(TrainError::Device(OutOfMemory::new()));
    ///     }
    ///     Ok(batch_size)
    /// });
    /// assert_eq!(fitted.unwrap(), 16);
    ///
    /// // Not out of memory: returned after one attempt, unchanged.
    /// let bad = BatchSizeSearch::new(64).run(|_| Err::<(), _>(TrainError::Data("row 7".into())));
    /// assert!(matches!(bad, Err(TrainError::Data(_))));
    ///
    /// // Nothing fits: `E::from(NoExecutableBatchSize)`.
    /// let none = BatchSizeSearch::new(2).run(|_| Err::<(), _>(OutOfMemory::new().into()));
    /// assert!(matches!(none, Err(TrainError::NoBatchSize(_))));
    ///
    /// // anyhow, as text: the same method.
    /// let fitted: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|batch_size| {
    ///     if batch_size > 16 { anyhow::bail!("CUDA out of memory. Tried to allocate 2.00 GiB") }
    ///     Ok(batch_size)
    /// });
    /// assert_eq!(fitted?, 16);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    #[inline]
    pub fn run<T, E, M, F>(self, attempt: F) -> Result<T, E>
    where
        F: FnMut(usize) -> Result<T, E>,
        E: AttemptError<M>,
    {
        let (result, report) = self.run_reporting(attempt);
        crate::record::store_last_report(report);
        result
    }

    /// Runs an attempt that returns a plain value: out-of-memory can only come as a panic
    /// (tch's plain methods, burn's `into_data`, cudarc's `unwrap`s), which is retried.
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// let fitted = BatchSizeSearch::new(16).call(|batch_size| {
    ///     if batch_size > 4 {
    ///         panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
    ///     }
    ///     batch_size
    /// });
    /// assert_eq!(fitted.unwrap(), 4);
    /// ```
    pub fn call<T, F>(mut self, attempt: F) -> Result<T, NoExecutableBatchSize>
    where
        F: FnMut(usize) -> T,
    {
        self.settings.name_the_work(&attempt);
        match drive_ended(
            self.start(),
            &PanicOnly::new(),
            LastError::AsSource,
            attempt,
        )
        .published()
        {
            Ended::Returned(value) => Ok(value),
            Ended::NoSizeFits(none_fit, _) => Err(none_fit),
        }
    }

    /// The async form of [`run`](Self::run): `attempt` returns a future, whose panics are
    /// caught and classified like a synchronous attempt's. The search's future is `Send` when
    /// the attempt's futures are.
    ///
    /// ```
    /// use std::io::{Error, ErrorKind};
    /// use batch_size_runtime::BatchSizeSearch;
    /// # fn block_on<F: std::future::Future>(future: F) -> F::Output {
    /// #     let mut future = std::pin::pin!(future);
    /// #     let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    /// #     loop {
    /// #         if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
    /// #             break value;
    /// #         }
    /// #     }
    /// # }
    ///
    /// let search = BatchSizeSearch::new(32).run_async(|batch_size| async move {
    ///     if batch_size > 8 {
    ///         return Err(Error::from(ErrorKind::OutOfMemory));
    ///     }
    ///     Ok(batch_size)
    /// });
    /// let fitted = block_on(search); // any executor: tokio, pollster, futures
    /// assert_eq!(fitted?, 8);
    /// # Ok::<(), Error>(())
    /// ```
    pub async fn run_async<T, E, M, Fut>(
        mut self,
        attempt: impl FnMut(usize) -> Fut,
    ) -> Result<T, E>
    where
        Fut: std::future::Future<Output = Result<T, E>>,
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&attempt);
        let attempt = driver::Returning(attempt);
        drive_async(
            self.start(),
            Kept::<E, M>::new(),
            Kept::<E, M>::new(),
            attempt,
        )
        .await
    }

    /// [`run`](Self::run), returning the search's report beside the result (it is in
    /// [`last_report()`](crate::last_report) too, as for every search).
    ///
    /// ```
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    ///
    /// let (fitted, report) = BatchSizeSearch::new(64).run_with_report(|batch_size| {
    ///     if batch_size > 16 { return Err(OutOfMemory::new().into()) }
    ///     Ok::<_, anyhow::Error>(batch_size)
    /// });
    /// assert_eq!(fitted.unwrap(), 16);
    /// assert_eq!(report.out_of_memory_count(), 2);
    /// ```
    pub fn run_with_report<T, E, M, F>(self, attempt: F) -> (Result<T, E>, SearchReport)
    where
        F: FnMut(usize) -> Result<T, E>,
        E: AttemptError<M>,
    {
        let (result, report) = self.run_reporting(attempt);
        crate::record::store_last_report(report.clone());
        (result, report)
    }

    /// [`run`](Self::run) for this crate's runners: result and report as values, nothing published.
    #[inline]
    pub(crate) fn run_reporting<T, E, M, F>(mut self, attempt: F) -> (Result<T, E>, SearchReport)
    where
        F: FnMut(usize) -> Result<T, E>,
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&attempt);
        drive_reporting(
            self.start(),
            Kept::<E, M>::new(),
            Kept::<E, M>::new(),
            attempt,
        )
    }

    /// The state machine, for a loop of your own (this is what the attribute expands into).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, StopReason};
    /// let mut search = BatchSizeSearch::new(8).start();
    /// assert_eq!(search.begin()?, 8);
    /// search.succeeded();
    ///
    /// // A configuration that cannot produce a size ends the search at the first `begin`.
    /// let error = BatchSizeSearch::new(8).with_factor(2.0).start().begin().unwrap_err();
    /// assert!(matches!(error.reason(), StopReason::InvalidConfiguration(_)));
    /// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
    /// ```
    #[inline]
    pub fn start(self) -> Search<'r> {
        Search::start(self.starting, self.settings)
    }
}

impl<'r> BatchSizeSearch<'r> {
    /// Allows the search the remedies declared in `remedies` when even `min` runs out of
    /// memory: the next one is applied and the batch size searched again from `starting`.
    /// Not with [`with_agreement`](Self::with_agreement) (the ranks do not yet agree on
    /// remedies: the search stops before its first attempt with
    /// [`StopReason::InvalidConfiguration`]).
    ///
    /// ```
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory, remedies::Remedies, remedies::Remedy};
    ///
    /// let context = Remedy::knob("context length", |c: &usize| *c, |c: &mut usize, v| *c = v)
    ///     .with_floor(512);
    /// let remedies = Remedies::new(4096usize).then(context);
    /// let (_, ran) = BatchSizeSearch::new(8).with_remedies(&remedies).run(|attempt| {
    ///     // fits when batch × context ≤ 2048 tokens
    ///     if attempt.batch_size() * attempt.settings() > 2048 { Err(OutOfMemory::new())? }
    ///     Ok::<_, anyhow::Error>(())
    /// })?;
    /// assert_eq!((ran.batch_size(), *ran.settings()), (1, 2048));
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_remedies<S: Clone + Send + 'static>(
        self,
        remedies: &Remedies<S>,
    ) -> RemediedSearch<'r, S> {
        RemediedSearch::new(self.starting, self.settings, remedies)
    }
}
