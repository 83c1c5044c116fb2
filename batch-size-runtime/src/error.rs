//! The errors a caller can act on: no batch size fit, and a device ran out of memory.
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, StopReason};
//!
//! let result: Result<(), anyhow::Error> = BatchSizeSearch::new(4)
//!     .run(|_batch_size| Err(OutOfMemory::new().with_requested(1 << 30).into()));
//! let error = result.unwrap_err();
//! let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
//! assert_eq!(none_fit.reason(), &StopReason::ReachedZero);
//! let last_oom = std::error::Error::source(none_fit).unwrap();
//! assert_eq!(last_oom.to_string(), "out of device memory: tried to allocate 1.00 GiB");
//! ```

use std::error::Error;
use std::fmt;

use crate::memory::{Bytes, MemorySnapshot};
use crate::record::SearchReport;
// Defined with the device memory it describes; named here too, as every error is.
pub(crate) use crate::memory::OutOfMemory;

pub(crate) use kept::KeptError;

/// Why the search stopped without finding a batch size that fits.
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, StopReason};
///
/// fn reason(search: BatchSizeSearch<'_>) -> StopReason {
///     let result: Result<(), anyhow::Error> = search.run(|_| Err(OutOfMemory::new().into()));
///     let error = result.unwrap_err();
///     error.downcast_ref::<NoExecutableBatchSize>().unwrap().reason().clone()
/// }
///
/// assert_eq!(reason(BatchSizeSearch::new(0)), StopReason::StartedAtZero);
/// assert_eq!(reason(BatchSizeSearch::new(2)), StopReason::ReachedZero);
/// assert_eq!(
///     reason(BatchSizeSearch::new(16).with_min(6)),
///     StopReason::BelowMinimum { next: 4, min: 6 }
/// );
/// assert_eq!(
///     reason(BatchSizeSearch::new(16).with_reduce(|failed| failed.batch_size)),
///     StopReason::NotSmaller { failed: 16, proposed: 16 }
/// );
/// assert_eq!(reason(BatchSizeSearch::new(16).with_max_attempts(3)), StopReason::MaxAttempts(3));
/// assert!(matches!(
///     reason(BatchSizeSearch::new(16).with_factor(1.5)),
///     StopReason::InvalidConfiguration(_)
/// ));
/// assert_eq!(StopReason::ReachedZero.to_string(), "reached zero");
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StopReason {
    /// `starting` was 0: the attempt was never called (Accelerate raises at once too).
    StartedAtZero,
    /// The reduction reached 0 (Accelerate's "reached zero").
    ReachedZero,
    /// The next size would have been below `min`, or `starting` itself was.
    BelowMinimum {
        /// The size the reduction proposed (or `starting`).
        next: usize,
        /// The configured minimum.
        min: usize,
    },
    /// A custom reduction proposed a size that is not smaller than the one that failed.
    NotSmaller {
        /// The size that ran out of memory.
        failed: usize,
        /// What the reduction returned.
        proposed: usize,
    },
    /// The cap set with `max_attempts` was reached.
    MaxAttempts(usize),
    /// The configuration cannot produce a size (a `factor` outside (0, 1), a negative
    /// `starting`, a `min` or `max_attempts` of 0 or below).
    InvalidConfiguration(String),
    /// The policy accepted before any attempt had succeeded: there is no value to return.
    NothingToAccept,
    /// The policy proposed, after a success, a size that had already run successfully `runs`
    /// times on the same work, or proposed, after a failure, a size it had proposed `runs`
    /// times after failures on the same work (16 at most in one search, either way): running
    /// it again tells nothing new, and a policy that keeps proposing it would never end. Where
    /// every success is new work (the chunks of [`Chunked`](crate::Chunked)), sizes repeat
    /// freely across successes.
    SizeRepeated {
        /// The size proposed again.
        batch_size: usize,
        /// Its successful runs so far (after a success), or the times it was proposed after
        /// a failure (after a failure).
        runs: usize,
    },
    /// Your own policy stopped the search, saying why. (This crate's policies stop with the
    /// variants that say what happened, so that code can tell them apart.)
    Policy(String),
    /// The ranks of a data-parallel job stopped together without a size: another rank failed
    /// with an error that is not out-of-memory, or the ranks could not reach each other
    /// ([`agree`](crate::agree)).
    Agreement(String),
    /// A tuner's trials showed the same peak memory at sizes far apart (the larger at least 16
    /// times the smaller): the trial ignores its size or runs no step, and every size would
    /// "fit" (Lightning #21903 and #13851).
    MemoryDoesNotGrow {
        /// The smaller size.
        smaller: usize,
        /// The larger size, whose peak was no higher.
        larger: usize,
        /// The peak bytes at the larger size.
        peak: u64,
    },
    /// The guided policy's proof from two failures: the part of memory that does not depend on
    /// the batch size does not fit (both sizes failed on their first allocation, asking for
    /// the same bytes), so no smaller size can. A remedy may still help.
    FixedMemoryDoesNotFit {
        /// The two sizes that failed alike, the smaller last.
        sizes: (usize, usize),
        /// What their first allocation asked for.
        requested: u64,
        /// The bytes free on the device for it.
        free: u64,
        /// The device's bytes.
        total: u64,
    },
    /// The ranks of an uneven split ran a step, but could not agree on their shares of the
    /// next: the step's result came back to the caller, this error at the step after it.
    SharesNotAgreed {
        /// The step that ran, from 0.
        after_step: usize,
        /// What failed between the ranks.
        error: String,
    },
    /// Items of different cost ([`BatchCost`](crate::BatchCost)): the costliest item ran out of
    /// memory alone, in a micro-batch of its own, so no budget runs the step. Shorten or split
    /// that item, or need less memory per unit of cost (a remedy).
    ItemDoesNotFit {
        /// The item, its index in the work the runner was given.
        item: usize,
        /// Its cost alone, in the runner's unit.
        cost: u64,
    },
    /// No size fit, even with every remedy the search was allowed ([`Remedies`](crate::remedies::Remedies))
    /// applied in turn.
    NoRemedyLeft {
        /// Why the last batch-size search under the last settings ended.
        last: Box<StopReason>,
        /// Each remedy applied, in order, with the failure that led to it and its figures.
        applied: Vec<String>,
    },
}

impl StopReason {
    /// Whether the search stopped because sizes ran out of memory, so that the last
    /// out-of-memory error, the memory at that failure and the ways to need less memory are worth
    /// saying: not when the tuner's trials do not use the size they are given.
    fn is_out_of_memory(&self) -> bool {
        match self {
            StopReason::MemoryDoesNotGrow { .. }
            | StopReason::SharesNotAgreed { .. }
            | StopReason::SizeRepeated { .. } => false,
            StopReason::NoRemedyLeft { last, .. } => last.is_out_of_memory(),
            _ => true,
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::StartedAtZero => f.write_str("the starting batch size is 0"),
            StopReason::ReachedZero => f.write_str("reached zero"),
            StopReason::BelowMinimum { next, min } => {
                write!(f, "the next size, {next}, is below the minimum of {min}")
            }
            StopReason::NotSmaller { failed, proposed } => write!(
                f,
                "the reduction proposed {proposed} after {failed} failed; it must return a smaller size"
            ),
            StopReason::MaxAttempts(cap) => write!(f, "reached the cap of {cap} attempts"),
            StopReason::InvalidConfiguration(why) => write!(f, "invalid configuration: {why}"),
            StopReason::NothingToAccept => {
                f.write_str("the policy accepted before any attempt succeeded")
            }
            StopReason::SizeRepeated { batch_size, runs } => write!(
                f,
                "the policy proposed batch size {batch_size} again after it had run successfully, or been proposed after a failure, {runs} times on the same work; accept a success or propose another size"
            ),
            StopReason::Policy(why) | StopReason::Agreement(why) => f.write_str(why),
            StopReason::FixedMemoryDoesNotFit {
                sizes: (earlier, latest),
                requested,
                free,
                total,
            } => write!(
                f,
                "the part of memory that does not depend on the batch size does not fit: sizes {earlier} and {latest} both failed on their first allocation, asking for {} with {} of the device's {} free",
                Bytes(*requested),
                Bytes(*free),
                Bytes(*total),
            ),
            StopReason::SharesNotAgreed { after_step, error } => write!(
                f,
                "step {after_step} ran, but the ranks could not agree on their shares of the next step: {error}"
            ),
            StopReason::MemoryDoesNotGrow {
                smaller,
                larger,
                peak,
            } => write!(
                f,
                "the trial's memory does not grow with the batch size: does it run a step at the size it is given? (a peak of {} at {larger}, no more than at {smaller}.) Check that the trial builds its batch from the size it is given and runs at least one forward and backward pass, and that the release backend reads the device the trial runs on",
                Bytes(*peak)
            ),
            StopReason::ItemDoesNotFit { item, cost } => write!(
                f,
                "item {item} ran out of memory alone (its cost: {cost}): no micro-batch is smaller; shorten or split it, or need less memory per unit of cost"
            ),
            StopReason::NoRemedyLeft { last, applied } if applied.is_empty() => write!(
                f,
                "{last}; no remedy could be applied (each was at its floor or already on)"
            ),
            StopReason::NoRemedyLeft { last, applied } => write!(
                f,
                "{last}, with every remedy allowed applied: {}",
                applied.join("; then ")
            ),
        }
    }
}

/// No batch size fit: every size the search tried ran out of memory, or none was left to try.
///
/// The name and the opening words of its message are Accelerate's ("No executable batch size
/// found"). It says which sizes were tried, what the last out-of-memory error said and what the
/// device memory looked like then. [`source()`](Error::source) returns the last out-of-memory
/// error where it could be kept (an error that is `Send + Sync + 'static`), or its description.
///
/// It is `Send + Sync + 'static`, so `?` turns it into `anyhow::Error` or
/// `Box<dyn Error + Send + Sync>`; for your own error enum, add one `#[from]` variant.
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
///
/// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(8)
///     .run(|_batch_size| Err(OutOfMemory::new().into()));
/// let error = result.unwrap_err();
/// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
/// assert_eq!(none_fit.tried(), &[8, 4, 2, 1]);
/// assert!(none_fit.to_string().starts_with("No executable batch size found"));
/// ```
#[derive(Debug)]
pub struct NoExecutableBatchSize {
    // Boxed: a `Result<T, NoExecutableBatchSize>` stays one pointer wide on its error side.
    inner: Box<NoExecutableBatchSizeInner>,
}

#[derive(Debug)]
struct NoExecutableBatchSizeInner {
    reason: StopReason,
    report: SearchReport,
    tried: Vec<usize>,
    last_error: Option<KeptError>,
}

impl NoExecutableBatchSize {
    pub(crate) fn new(
        reason: StopReason,
        report: SearchReport,
        last_error: Option<KeptError>,
    ) -> Self {
        let tried = report
            .attempts()
            .map(|attempt| attempt.batch_size)
            .collect();
        NoExecutableBatchSize {
            inner: Box::new(NoExecutableBatchSizeInner {
                reason,
                report,
                tried,
                last_error,
            }),
        }
    }

    /// The batch sizes that were tried, in order (empty when `starting` was 0).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(4).run(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// assert_eq!(none_fit.tried(), &[4, 2, 1]);
    /// ```
    pub fn tried(&self) -> &[usize] {
        &self.inner.tried
    }

    /// Why the search stopped.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(4).run(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// assert_eq!(none_fit.reason(), &batch_size_runtime::StopReason::ReachedZero);
    /// ```
    pub fn reason(&self) -> &StopReason {
        &self.inner.reason
    }

    /// Every attempt, with its outcome, duration and memory figures.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
    /// let result: Result<(), anyhow::Error> =
    ///     BatchSizeSearch::new(4).run(|_| Err(OutOfMemory::new().into()));
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// assert_eq!(none_fit.report().len(), 3);
    /// assert_eq!(none_fit.report().out_of_memory_count(), 3);
    /// ```
    pub fn report(&self) -> &SearchReport {
        &self.inner.report
    }

    /// The memory figures read once the last attempt had failed (its values dropped), before the
    /// release: what a pool or cache still held, and the attempt's peak.
    ///
    /// ```
    /// # use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, memory::SimulatedDevice};
    /// // A caching device keeps what the failed attempt freed until the release.
    /// let device = SimulatedDevice::new(1000).with_caching();
    /// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(8)
    ///     .with_release(device.clone())
    ///     .run(|batch_size| {
    ///         let _weights = device.alloc(900)?;
    ///         let _batch = device.alloc(batch_size as u64 * 200)?;
    ///         Ok(())
    ///     });
    /// let error = result.unwrap_err();
    /// let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    /// let memory = none_fit.memory_at_last_failure().unwrap();
    /// assert_eq!(memory.free(), 100); // the weights' 900 bytes were still cached
    /// assert_eq!(device.free(), 1000); // and released afterwards
    /// ```
    pub fn memory_at_last_failure(&self) -> Option<&MemorySnapshot> {
        self.inner
            .report
            .attempts()
            .last()
            .and_then(|attempt| attempt.memory_at_end.as_ref())
    }
}

impl fmt::Display for NoExecutableBatchSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let StopReason::SharesNotAgreed { .. } = &self.inner.reason {
            // Not a search that found no size: the step ran.
            return write!(
                f,
                "{}. The ranks cannot go on in step: see the other ranks' logs",
                self.inner.reason
            );
        }
        write!(f, "No executable batch size found: {}", self.inner.reason)?;
        if self.inner.tried.is_empty() {
            f.write_str("; no size was tried")?;
        } else {
            let sizes: Vec<String> = self.inner.tried.iter().map(usize::to_string).collect();
            write!(
                f,
                "; tried {} ({} attempt{})",
                sizes.join(", "),
                sizes.len(),
                if sizes.len() == 1 { "" } else { "s" }
            )?;
        }
        if !self.inner.reason.is_out_of_memory() {
            // The reason says what to check; an earlier trial's failure would mislead.
            return Ok(());
        }
        if let Some(description) = self.inner.report.last_oom_description() {
            write!(f, ". Last out-of-memory error: {description}")?;
        }
        if let Some(memory) = self.memory_at_last_failure() {
            if !memory.is_empty() {
                write!(f, ". Memory at that failure: {memory}")?;
            }
        }
        match &self.inner.reason {
            StopReason::StartedAtZero
            | StopReason::InvalidConfiguration(_)
            | StopReason::NothingToAccept => Ok(()),
            StopReason::Agreement(_) => f.write_str(
                ". See the other ranks' logs; the error of a rank that failed comes back there",
            ),
            // `min` is already 1: what one sample needs is above the limit.
            _ if self.size_one_ran_out() => f.write_str(
                ". Even batch size 1 does not fit: raise the memory limit (or free the device), or shrink the model or sequence length",
            ),
            _ => f.write_str(
                ". Lower `min`, shrink the model or sequence length, or use gradient accumulation",
            ),
        }
    }
}

impl NoExecutableBatchSize {
    /// Whether batch size 1 ran out of memory: no smaller `min` is left to try.
    fn size_one_ran_out(&self) -> bool {
        self.inner
            .report
            .attempts()
            .any(|attempt| attempt.batch_size == 1 && attempt.outcome.is_out_of_memory())
    }
}

impl Error for NoExecutableBatchSize {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.inner.last_error.as_ref().map(KeptError::as_error)
    }
}

/// `io::Result` functions can use the attribute too: the error becomes
/// [`ErrorKind::OutOfMemory`](std::io::ErrorKind::OutOfMemory) with this error as its inner error.
///
/// ```
/// use std::io::{Error, ErrorKind};
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize};
///
/// let result: std::io::Result<()> =
///     BatchSizeSearch::new(2).run(|_| Err(Error::from(ErrorKind::OutOfMemory)));
/// let error = result.unwrap_err();
/// assert_eq!(error.kind(), ErrorKind::OutOfMemory);
/// assert!(error.get_ref().unwrap().is::<NoExecutableBatchSize>());
/// ```
impl From<NoExecutableBatchSize> for std::io::Error {
    fn from(error: NoExecutableBatchSize) -> Self {
        std::io::Error::new(std::io::ErrorKind::OutOfMemory, error)
    }
}

/// The last out-of-memory error of a search, kept for `NoExecutableBatchSize`'s `source()`.
/// Public in a private module: runners' bounds name it, users cannot.
mod kept {
    use std::error::Error;

    /// The last out-of-memory error of a search, kept for `NoExecutableBatchSize`'s `source()`.
    ///
    /// An `anyhow::Error` is kept as it is: turned into a `Box<dyn Error>` it would become anyhow's
    /// own wrapper type, and `source().downcast_ref::<YourError>()` would no longer find the error
    /// the attempt returned.
    #[derive(Debug)]
    pub struct KeptError(Kept);

    #[derive(Debug)]
    enum Kept {
        Boxed(Box<dyn Error + Send + Sync + 'static>),
        #[cfg(feature = "anyhow")]
        Anyhow(anyhow::Error),
    }

    impl KeptError {
        /// Keeps an error that converts into a box, unwrapping `anyhow::Error` as said above.
        pub(crate) fn keep<E>(error: E) -> Self
        where
            E: Into<Box<dyn Error + Send + Sync + 'static>> + 'static,
        {
            #[cfg(feature = "anyhow")]
            {
                let mut slot = Some(error);
                let any: &mut dyn std::any::Any = &mut slot;
                if let Some(anyhow_error) = any
                    .downcast_mut::<Option<anyhow::Error>>()
                    .and_then(Option::take)
                {
                    return KeptError(Kept::Anyhow(anyhow_error));
                }
                match slot {
                    Some(error) => KeptError(Kept::Boxed(error.into())),
                    // Only taken above, where it was an anyhow::Error and returned.
                    None => KeptError(Kept::Boxed("the out-of-memory error".into())),
                }
            }
            #[cfg(not(feature = "anyhow"))]
            {
                KeptError(Kept::Boxed(error.into()))
            }
        }

        pub(crate) fn as_error(&self) -> &(dyn Error + 'static) {
            match &self.0 {
                Kept::Boxed(error) => &**error,
                // anyhow's `Deref` gives the error it was built from, downcastable to its type.
                #[cfg(feature = "anyhow")]
                Kept::Anyhow(error) => {
                    let error: &(dyn Error + Send + Sync + 'static) = error.as_ref();
                    error
                }
            }
        }
    }

    impl From<Box<dyn Error + Send + Sync + 'static>> for KeptError {
        fn from(error: Box<dyn Error + Send + Sync + 'static>) -> Self {
            KeptError(Kept::Boxed(error))
        }
    }
}
