//! The retry engine: try a size, and on out-of-memory release memory, pick a smaller size and
//! try again, until an attempt succeeds or no size is left.
//!
//! [`BatchSizeSearch`] is the builder users call directly; [`Search`] is the state machine it
//! runs, which the attribute drives from the code it generates (so that the attempt's error
//! type is known where it is classified).
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, SimulatedDevice};
//!
//! let device = SimulatedDevice::new(1 << 30); // 1 GiB
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(256)
//!     .with_factor(0.9)
//!     .with_release(device.clone())
//!     .run_dyn(|batch_size| {
//!         let _activations = device.alloc(batch_size as u64 * (5 << 20))?; // 5 MiB a sample
//!         Ok(batch_size)
//!     });
//! assert_eq!(fitted.unwrap(), 186); // 256, 230 and 207 did not fit
//! ```

use std::error::Error;
use std::future::Future;
use std::time::Instant;

use crate::error::{KeptError, NoExecutableBatchSize, StopReason};
use crate::memory::{Bytes, MemorySnapshot, Release};
use crate::oom::{self, OomMatch};
use crate::record::{self, Attempt, Outcome, SearchReport};
use crate::reduce::{FailedAttempt, Reduction};
use crate::unwind::{self, CatchUnwind, PanicPayload};

/// Finds a batch size that fits: calls an attempt with `starting`, and after each
/// out-of-memory failure (a returned error or a panic) releases device memory and calls it
/// again with a smaller size.
///
/// # Default
/// - reduction: halving (`with_factor(0.9)` is Accelerate 1.x)
/// - `min`: 1; no cap on attempts
/// - release: [`Release::cuda()`], which does nothing where CUDA is not in use
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
///
/// let trained: Result<usize, anyhow::Error> = BatchSizeSearch::new(128)
///     .with_min(8)
///     .run_dyn(|batch_size| {
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
    starting: usize,
    min: usize,
    max_attempts: Option<usize>,
    reduction: Reduction<'r>,
    // `None` until chosen: the default is resolved when the search starts, so that a search
    // given its own release never builds the default one.
    release: Option<Release>,
    label: &'static str,
    invalid: Option<String>,
}

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
    pub fn new(starting: usize) -> Self {
        BatchSizeSearch {
            starting,
            min: 1,
            max_attempts: None,
            reduction: Reduction::Halve,
            release: None,
            label: "batch_size_search",
            invalid: None,
        }
    }

    /// Stops when the next size would be below `min` (default 1; 0 counts as 1: an attempt is
    /// never called with 0).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(64).with_min(16).run_dyn(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let error = error.downcast_ref::<batch_size_runtime::NoExecutableBatchSize>().unwrap();
    /// assert_eq!(error.tried(), &[64, 32, 16]);
    /// ```
    pub fn with_min(mut self, min: usize) -> Self {
        self.min = min.max(1);
        self
    }

    /// Multiplies the size by `factor` (0 < f < 1) after each failure, rounding down.
    /// `0.9` reproduces Accelerate 1.x. A factor outside (0, 1) stops the search before the
    /// first attempt with [`StopReason::InvalidConfiguration`].
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    /// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
    ///     .with_factor(0.9)
    ///     .with_max_attempts(5)
    ///     .run_dyn(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let error = error.downcast_ref::<batch_size_runtime::NoExecutableBatchSize>().unwrap();
    /// assert_eq!(error.tried(), &[128, 115, 103, 92, 82]);
    /// ```
    pub fn with_factor(mut self, factor: f64) -> Self {
        self.reduction = Reduction::Factor(factor);
        self
    }

    /// Picks the next size with your function of the failed attempt. It must return a smaller
    /// size; anything else stops the search with [`StopReason::NotSmaller`].
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
    /// let result: Result<usize, anyhow::Error> = BatchSizeSearch::new(100)
    ///     .with_reduce(|failed| failed.batch_size - 10)
    ///     .run_dyn(|batch_size| {
    ///         if batch_size > 75 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(result.unwrap(), 70);
    /// ```
    pub fn with_reduce(
        mut self,
        reduce: impl FnMut(&FailedAttempt<'_>) -> usize + Send + 'r,
    ) -> Self {
        self.reduction = Reduction::Custom(Box::new(reduce));
        self
    }

    /// Sets the reduction policy.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, Reduction};
    /// let minus_eight = Reduction::Custom(Box::new(|failed| failed.batch_size - 8));
    /// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(32)
    ///     .with_reduction(minus_eight)
    ///     .run_dyn(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// assert_eq!(none_fit.tried(), &[32, 24, 16, 8]);
    /// ```
    pub fn with_reduction(mut self, reduction: Reduction<'r>) -> Self {
        self.reduction = reduction;
        self
    }

    /// Makes at most `max_attempts` attempts (0 counts as 1).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory, StopReason};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(64).with_max_attempts(2).run_dyn(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let error = error.downcast_ref::<batch_size_runtime::NoExecutableBatchSize>().unwrap();
    /// assert_eq!(error.reason(), &StopReason::MaxAttempts(2));
    /// ```
    pub fn with_max_attempts(mut self, max_attempts: usize) -> Self {
        self.max_attempts = Some(max_attempts.max(1));
        self
    }

    /// Chooses what happens to device memory between attempts (default: [`Release::cuda()`]).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, SimulatedDevice};
    /// let device = SimulatedDevice::new(100);
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
    ///     .with_release(device.clone())
    ///     .run_dyn(|batch_size| {
    ///         let _batch = device.alloc(batch_size as u64 * 2)?;
    ///         Ok(batch_size)
    ///     });
    /// assert_eq!(fitted.unwrap(), 32);
    /// assert_eq!(device.release_count(), 1); // once, after 64 ran out of memory
    /// ```
    pub fn with_release(mut self, release: impl Into<Release>) -> Self {
        self.release = Some(release.into());
        self
    }

    /// Names the search in its logs (the attribute passes the function's name).
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// // Its logs say `function="train_epoch"`.
    /// let search = BatchSizeSearch::new(8).with_label("train_epoch");
    /// assert_eq!(search.call(|batch_size| batch_size).unwrap(), 8);
    /// ```
    pub fn with_label(mut self, label: &'static str) -> Self {
        self.label = label;
        self
    }

    /// Makes the search stop before its first attempt with
    /// [`StopReason::InvalidConfiguration`] (the attribute uses it for a negative `starting`).
    #[doc(hidden)]
    pub fn with_invalid_configuration(mut self, why: String) -> Self {
        self.invalid = Some(why);
        self
    }

    /// Runs an attempt whose error type implements [`std::error::Error`] and
    /// `From<NoExecutableBatchSize>` (your `thiserror` enum with a `#[from]` variant, holding
    /// cudarc's or a framework's errors). The attribute also accepts error types that only
    /// have `From<std::io::Error>`, such as candle's.
    ///
    /// Returns the first `Ok`. An error that is not out-of-memory is returned at once,
    /// unchanged; a panic that is not out-of-memory resumes unwinding. When no size is left,
    /// returns `E::from(NoExecutableBatchSize)`, keeping the last out-of-memory error as its
    /// `source()`.
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
    /// ```
    pub fn run<T, E, F>(self, mut attempt: F) -> Result<T, E>
    where
        F: FnMut(usize) -> Result<T, E>,
        E: Error + Send + Sync + 'static + From<NoExecutableBatchSize>,
    {
        let mut search = self.start();
        loop {
            let batch_size = search.begin().map_err(E::from)?;
            let outcome = unwind::catch_attempt(|| attempt(batch_size));
            if let Some(result) = search.settle(outcome, |error| error, keep_typed) {
                return result;
            }
        }
    }

    /// Runs an attempt whose error is an `anyhow::Error` or a `Box<dyn Error + Send + Sync>`:
    /// the same as [`run`](Self::run), classifying through the whole chain.
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// type BoxError = Box<dyn std::error::Error + Send + Sync>;
    ///
    /// let fitted: Result<usize, BoxError> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    ///     if batch_size > 16 {
    ///         return Err("CUDA out of memory. Tried to allocate 2.00 GiB".into()); // as text
    ///     }
    ///     Ok(batch_size)
    /// });
    /// assert_eq!(fitted.unwrap(), 16);
    /// ```
    pub fn run_dyn<T, E, F>(self, mut attempt: F) -> Result<T, E>
    where
        F: FnMut(usize) -> Result<T, E>,
        E: AsRef<dyn Error + Send + Sync + 'static>
            + Into<Box<dyn Error + Send + Sync + 'static>>
            + From<NoExecutableBatchSize>
            + 'static,
    {
        let mut search = self.start();
        loop {
            let batch_size = search.begin().map_err(E::from)?;
            let outcome = unwind::catch_attempt(|| attempt(batch_size));
            if let Some(result) = search.settle(outcome, view_dyn, KeptError::keep) {
                return result;
            }
        }
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
    pub fn call<T, F>(self, mut attempt: F) -> Result<T, NoExecutableBatchSize>
    where
        F: FnMut(usize) -> T,
    {
        let mut search = self.start();
        loop {
            let batch_size = search.begin()?;
            match unwind::catch_attempt(|| attempt(batch_size)) {
                Ok(value) => {
                    search.succeeded();
                    return Ok(value);
                }
                Err(payload) => search.panicked(payload),
            }
        }
    }

    /// The async form of [`run`](Self::run): `attempt` returns a future, whose panics are
    /// caught and classified like a synchronous attempt's.
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
    pub async fn run_async<T, E, F, Fut>(self, mut attempt: F) -> Result<T, E>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Error + Send + Sync + 'static + From<NoExecutableBatchSize>,
    {
        let mut search = self.start();
        loop {
            let batch_size = search.begin().map_err(E::from)?;
            let outcome = CatchUnwind::new(attempt(batch_size)).await;
            if let Some(result) = search.settle(outcome, |error| error, keep_typed) {
                return result;
            }
        }
    }

    /// The async form of [`run_dyn`](Self::run_dyn).
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// # fn block_on<F: std::future::Future>(future: F) -> F::Output {
    /// #     let mut future = std::pin::pin!(future);
    /// #     let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    /// #     loop {
    /// #         if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
    /// #             break value;
    /// #         }
    /// #     }
    /// # }
    /// let search = BatchSizeSearch::new(32).run_dyn_async(|batch_size| async move {
    ///     if batch_size > 8 {
    ///         anyhow::bail!("CUDA out of memory. Tried to allocate 1.00 GiB");
    ///     }
    ///     Ok(batch_size)
    /// });
    /// let fitted: anyhow::Result<usize> = block_on(search); // any executor
    /// assert_eq!(fitted?, 8);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub async fn run_dyn_async<T, E, F, Fut>(self, mut attempt: F) -> Result<T, E>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: AsRef<dyn Error + Send + Sync + 'static>
            + Into<Box<dyn Error + Send + Sync + 'static>>
            + From<NoExecutableBatchSize>
            + 'static,
    {
        let mut search = self.start();
        loop {
            let batch_size = search.begin().map_err(E::from)?;
            let outcome = CatchUnwind::new(attempt(batch_size)).await;
            if let Some(result) = search.settle(outcome, view_dyn, KeptError::keep) {
                return result;
            }
        }
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
    pub fn start(mut self) -> Search<'r> {
        let stop = if let Some(why) = self.invalid.take() {
            Some(StopReason::InvalidConfiguration(why))
        } else if self.starting == 0 {
            Some(StopReason::StartedAtZero)
        } else if let Some(why) = self.reduction.invalid() {
            Some(StopReason::InvalidConfiguration(why))
        } else if self.starting < self.min {
            Some(StopReason::BelowMinimum {
                next: self.starting,
                min: self.min,
            })
        } else {
            None
        };
        Search {
            next: match stop {
                Some(reason) => Next::Stop(reason),
                None => Next::Size(self.starting),
            },
            release: self.release.take().unwrap_or_default(),
            config: self,
            running: None,
            report: SearchReport::default(),
            last_error: None,
        }
    }
}

#[derive(Debug)]
enum Next {
    Size(usize),
    Stop(StopReason),
    Done,
}

#[derive(Debug)]
struct Running {
    batch_size: usize,
    started: Instant,
    memory_at_start: Option<MemorySnapshot>,
}

/// One search in progress: [`begin`](Self::begin) an attempt, then report how it ended with
/// [`succeeded`](Self::succeeded), [`out_of_memory`](Self::out_of_memory),
/// [`failed`](Self::failed) or [`panicked`](Self::panicked).
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
///     break batch_size;
/// };
/// assert_eq!(fitted, 2);
/// # Ok::<(), batch_size_runtime::NoExecutableBatchSize>(())
/// ```
#[derive(Debug)]
pub struct Search<'r> {
    config: BatchSizeSearch<'r>,
    release: Release,
    next: Next,
    running: Option<Running>,
    report: SearchReport,
    last_error: Option<KeptError>,
}

impl Search<'_> {
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
        match std::mem::replace(&mut self.next, Next::Done) {
            Next::Size(batch_size) => {
                self.release.reset_peak();
                let memory_at_start = non_empty(self.release.memory());
                self.running = Some(Running {
                    batch_size,
                    started: Instant::now(),
                    memory_at_start,
                });
                Ok(batch_size)
            }
            Next::Stop(reason) => Err(self.give_up(reason)),
            // Called again after the end: say so, leaving `last_report()` to the search that ended.
            Next::Done => Err(NoExecutableBatchSize::new(
                StopReason::InvalidConfiguration("the search already ended".to_owned()),
                self.report.clone(),
                None,
            )),
        }
    }

    fn give_up(&mut self, reason: StopReason) -> NoExecutableBatchSize {
        let report = std::mem::take(&mut self.report);
        record::store_last_report(report.clone());
        let error = NoExecutableBatchSize::new(reason, report, self.last_error.take());
        tracing::error!(
            function = self.config.label,
            tried = ?error.tried(),
            reason = %error.reason(),
            "no executable batch size found"
        );
        error
    }

    fn finish_attempt(&mut self, outcome: Outcome) -> Attempt {
        let running = self.running.take();
        let (batch_size, duration, memory_at_start) = match running {
            Some(running) => (
                running.batch_size,
                running.started.elapsed(),
                running.memory_at_start,
            ),
            None => (0, Default::default(), None),
        };
        Attempt {
            number: self.report.len() + 1,
            batch_size,
            outcome,
            duration,
            memory_at_start,
            memory_at_end: None,
            memory_after_release: None,
        }
    }

    /// Records how one attempt of `run`, `run_dyn` and their async forms ended: `Some` ends the
    /// search with that result, `None` means out of memory, so try the next size. `view` shows
    /// the error to classification, `keep` keeps it for `NoExecutableBatchSize::source()`.
    fn settle<T, E>(
        &mut self,
        outcome: Result<Result<T, E>, PanicPayload>,
        view: impl Fn(&E) -> &(dyn Error + 'static),
        keep: impl FnOnce(E) -> KeptError,
    ) -> Option<Result<T, E>> {
        match outcome {
            Ok(Ok(value)) => {
                self.succeeded();
                Some(Ok(value))
            }
            Ok(Err(error)) => match oom::classify_error(view(&error)) {
                Some(found) => {
                    self.out_of_memory_kept(found, Some(keep(error)));
                    None
                }
                None => {
                    self.failed(view(&error));
                    Some(Err(error))
                }
            },
            Err(payload) => {
                self.panicked(payload);
                None
            }
        }
    }

    /// The attempt returned its value: the search is over.
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
        let attempt = self.finish_attempt(Outcome::Succeeded);
        tracing::info!(
            function = self.config.label,
            batch_size = attempt.batch_size,
            attempts = attempt.number,
            "found executable batch size"
        );
        self.report.push(attempt);
        // Moved, not cloned: the success path copies as little as it can.
        record::store_last_report(std::mem::take(&mut self.report));
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
        self.failed_described(oom::describe(error));
    }

    /// The attempt returned an error that is not out-of-memory, already described.
    #[doc(hidden)]
    pub fn failed_described(&mut self, description: String) {
        let attempt = self.finish_attempt(Outcome::Failed { error: description });
        self.report.push(attempt);
        // Moved, not cloned: the success path copies as little as it can.
        record::store_last_report(std::mem::take(&mut self.report));
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
        match oom::classify_panic(&*payload) {
            Some(found) => self.out_of_memory(found, None),
            None => {
                let attempt = self.finish_attempt(Outcome::Panicked);
                self.report.push(attempt);
                record::store_last_report(std::mem::take(&mut self.report));
                std::panic::resume_unwind(payload)
            }
        }
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
        self.out_of_memory_kept(found, error.map(KeptError::from));
    }

    /// [`out_of_memory`](Self::out_of_memory), with the error already kept.
    #[doc(hidden)]
    pub fn out_of_memory_kept(&mut self, found: OomMatch, error: Option<KeptError>) {
        let mut attempt = self.finish_attempt(Outcome::OutOfMemory {
            error: found.description.clone(),
        });
        let failed_size = attempt.batch_size;
        attempt.memory_at_end = non_empty(self.release.memory());

        let proposed = self.config.reduction.next(&FailedAttempt {
            batch_size: failed_size,
            attempt: attempt.number,
            error: &found.description,
            requested: found.requested,
            memory: attempt.memory_at_end.as_ref(),
        });

        if let Err(release_error) = self.release.release() {
            tracing::warn!(
                function = self.config.label,
                error = %release_error,
                "could not release device memory before the next attempt"
            );
        }
        attempt.memory_after_release = non_empty(self.release.memory());

        self.next = if self.config.max_attempts == Some(attempt.number) {
            Next::Stop(StopReason::MaxAttempts(attempt.number))
        } else if proposed == 0 {
            Next::Stop(StopReason::ReachedZero)
        } else if proposed >= failed_size {
            Next::Stop(StopReason::NotSmaller {
                failed: failed_size,
                proposed,
            })
        } else if proposed < self.config.min {
            Next::Stop(StopReason::BelowMinimum {
                next: proposed,
                min: self.config.min,
            })
        } else {
            Next::Size(proposed)
        };

        // As PyTorch's message does: the memory when the attempt failed; then what the release
        // made free for the next attempt.
        let memory = attempt
            .memory_at_end
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let free_after_release = attempt
            .memory_after_release
            .as_ref()
            .map(|after| Bytes(after.free()).to_string())
            .unwrap_or_default();
        match &self.next {
            Next::Size(next) => tracing::warn!(
                function = self.config.label,
                batch_size = failed_size,
                next_batch_size = *next,
                attempt = attempt.number,
                error = %found.description,
                memory = %memory,
                free_after_release = %free_after_release,
                "out of memory with batch size {failed_size}; retrying with {next}"
            ),
            _ => tracing::warn!(
                function = self.config.label,
                batch_size = failed_size,
                attempt = attempt.number,
                error = %found.description,
                memory = %memory,
                free_after_release = %free_after_release,
                "out of memory with batch size {failed_size}; no smaller size is left"
            ),
        }
        self.report.push(attempt);
        self.last_error = Some(error.unwrap_or_else(|| {
            let text: Box<dyn Error + Send + Sync> = Box::new(LastOutOfMemory(found.description));
            KeptError::from(text)
        }));
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

fn non_empty(snapshot: MemorySnapshot) -> Option<MemorySnapshot> {
    (!snapshot.is_empty()).then_some(snapshot)
}

/// How `run` keeps a typed error: boxed as it is.
fn keep_typed<E: Error + Send + Sync + 'static>(error: E) -> KeptError {
    let boxed: Box<dyn Error + Send + Sync + 'static> = Box::new(error);
    KeptError::from(boxed)
}

/// How `run_dyn` shows an `anyhow::Error` or a boxed error to classification.
fn view_dyn<E: AsRef<dyn Error + Send + Sync + 'static>>(error: &E) -> &(dyn Error + 'static) {
    error.as_ref()
}
