//! The record of a search: every attempt, its outcome, duration and memory figures.
//!
//! ```
//! use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
//!
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(32).run_dyn(|batch_size| {
//!     if batch_size > 8 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
//! });
//! assert_eq!(fitted.unwrap(), 8);
//! let report = last_report().unwrap();
//! let sizes: Vec<usize> = report.attempts().map(|attempt| attempt.batch_size).collect();
//! assert_eq!(sizes, [32, 16, 8]);
//! assert_eq!(report.out_of_memory_count(), 2);
//! ```

use std::cell::RefCell;
use std::fmt;
use std::time::Duration;

use crate::memory::MemorySnapshot;

/// How an attempt ended.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory, Outcome};
///
/// let _ = BatchSizeSearch::new(2).run_dyn(|batch_size| -> anyhow::Result<()> {
///     match batch_size {
///         2 => Err(OutOfMemory::new().on_device("sim:0").into()),
///         _ => anyhow::bail!("data loader closed"),
///     }
/// });
/// let report = last_report().unwrap();
/// let outcomes: Vec<&Outcome> = report.attempts().map(|attempt| &attempt.outcome).collect();
/// assert_eq!(
///     outcomes,
///     [
///         &Outcome::OutOfMemory { error: "out of device memory on sim:0".to_owned() },
///         &Outcome::Failed { error: "data loader closed".to_owned() },
///     ]
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// It returned a value (or `Ok`).
    Succeeded,
    /// It ran out of memory; what the error or panic said.
    OutOfMemory {
        /// The error's description.
        error: String,
    },
    /// It returned an error that is not out-of-memory: the search ended and returned it.
    Failed {
        /// The error's description.
        error: String,
    },
    /// It panicked with something that is not out-of-memory: the panic was resumed.
    Panicked,
}

/// One call of the attempt.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, Outcome, SimulatedDevice};
///
/// let device = SimulatedDevice::new(100);
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(16)
///     .with_release(device.clone())
///     .run_dyn(|batch_size| {
///         let _batch = device.alloc(batch_size as u64 * 10)?;
///         Ok(batch_size)
///     });
/// assert_eq!(fitted.unwrap(), 9); // 10 fill the device; 5 % is kept free
///
/// let report = last_report().unwrap();
/// let first = report.attempts().next().unwrap();
/// assert_eq!((first.number, first.batch_size), (1, 16));
/// assert!(matches!(first.outcome, Outcome::OutOfMemory { .. }));
/// assert_eq!(first.memory_at_start.as_ref().unwrap().free(), 100);
/// assert!(first.memory_at_end.is_some() && first.memory_after_release.is_some());
/// assert!(first.to_string().starts_with("attempt 1 with batch size 16: out of memory ("));
///
/// let last = report.attempts().last().unwrap();
/// assert_eq!((last.number, last.outcome.clone()), (2, Outcome::Succeeded));
/// assert!(last.memory_at_end.is_none()); // only read when an attempt runs out of memory
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Attempt {
    /// The attempt's number, from 1.
    pub number: usize,
    /// The batch size it was called with.
    pub batch_size: usize,
    /// How it ended.
    pub outcome: Outcome,
    /// How long it ran.
    pub duration: Duration,
    /// Device memory before it started, when the backend reports any.
    pub memory_at_start: Option<MemorySnapshot>,
    /// Device memory once the attempt had failed (what it owned already dropped), before the
    /// release: what a pool or cache still holds, and the attempt's peak.
    pub memory_at_end: Option<MemorySnapshot>,
    /// Device memory after the release that followed.
    pub memory_after_release: Option<MemorySnapshot>,
    /// Bytes the failed allocation asked for, when the out-of-memory error said.
    pub requested: Option<u64>,
    /// How the policy chose this size, when it says (an estimate, a fitted limit).
    pub rationale: Option<String>,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "attempt {} with batch size {}: ",
            self.number, self.batch_size
        )?;
        match &self.outcome {
            Outcome::Succeeded => f.write_str("succeeded")?,
            Outcome::OutOfMemory { error } => write!(f, "out of memory ({error})")?,
            Outcome::Failed { error } => write!(f, "failed ({error})")?,
            Outcome::Panicked => f.write_str("panicked")?,
        }
        write!(f, " in {:.3?}", self.duration)
    }
}

/// Every attempt of one search, in order, on success as on failure.
///
/// The attribute leaves the report of the last search that finished on the current thread
/// in [`last_report()`]; [`NoExecutableBatchSize::report`](crate::NoExecutableBatchSize::report)
/// carries it too.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
///
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
///     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
/// });
/// assert_eq!(fitted.unwrap(), 16);
///
/// let report = last_report().unwrap();
/// assert_eq!(report.len(), 3);
/// assert!(!report.is_empty());
/// assert_eq!(report.batch_size(), Some(16));
/// assert_eq!(report.out_of_memory_count(), 2);
/// let sizes: Vec<usize> = report.attempts().map(|attempt| attempt.batch_size).collect();
/// assert_eq!(sizes, [64, 32, 16]);
/// assert_eq!(report.to_string().lines().count(), 3); // one line per attempt
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchReport {
    // The final attempt is kept apart so that a search whose first attempt succeeds records
    // itself without allocating.
    earlier: Vec<Attempt>,
    last: Option<Attempt>,
}

impl Outcome {
    /// Whether the attempt returned its value.
    ///
    /// ```
    /// use batch_size_runtime::Outcome;
    /// assert!(Outcome::Succeeded.is_success());
    /// assert!(!Outcome::Panicked.is_success());
    /// ```
    pub fn is_success(&self) -> bool {
        matches!(self, Outcome::Succeeded)
    }

    /// Whether the attempt ran out of memory.
    ///
    /// ```
    /// use batch_size_runtime::Outcome;
    /// assert!(Outcome::OutOfMemory { error: "CUDA out of memory".into() }.is_out_of_memory());
    /// assert!(!Outcome::Succeeded.is_out_of_memory());
    /// ```
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Outcome::OutOfMemory { .. })
    }
}

impl SearchReport {
    /// The latest attempt: for a [`SizePolicy`](crate::policy::SizePolicy), the one it is
    /// deciding after.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.last().unwrap().batch_size, 16);
    /// ```
    pub fn last(&self) -> Option<&Attempt> {
        self.last.as_ref()
    }

    /// The smallest size that ran out of memory in this search, if any did.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.smallest_out_of_memory(), Some(32));
    /// ```
    pub fn smallest_out_of_memory(&self) -> Option<usize> {
        self.attempts()
            .filter(|attempt| attempt.outcome.is_out_of_memory())
            .map(|attempt| attempt.batch_size)
            .min()
    }

    /// The largest size that succeeded in this search, if any did.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.largest_success(), Some(16));
    /// ```
    pub fn largest_success(&self) -> Option<usize> {
        self.attempts()
            .filter(|attempt| attempt.outcome.is_success())
            .map(|attempt| attempt.batch_size)
            .max()
    }

    pub(crate) fn push(&mut self, attempt: Attempt) {
        if let Some(previous) = self.last.replace(attempt) {
            self.earlier.push(previous);
        }
    }

    /// The attempts, in order.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// let sizes: Vec<usize> = report.attempts().map(|attempt| attempt.batch_size).collect();
    /// assert_eq!(sizes, [64, 32, 16]);
    /// ```
    pub fn attempts(&self) -> impl DoubleEndedIterator<Item = &Attempt> + '_ {
        self.earlier.iter().chain(self.last.as_ref())
    }

    /// The sizes tried, in order (what [`NoExecutableBatchSize::tried`](crate::NoExecutableBatchSize::tried)
    /// says when no size fits).
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// assert_eq!(last_report().unwrap().tried(), [64, 32, 16]);
    /// ```
    pub fn tried(&self) -> Vec<usize> {
        self.attempts().map(|attempt| attempt.batch_size).collect()
    }

    /// How many attempts were made.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.len(), 3);
    /// ```
    pub fn len(&self) -> usize {
        self.earlier.len() + usize::from(self.last.is_some())
    }

    /// Whether no attempt was made.
    ///
    /// ```
    /// use batch_size_runtime::SearchReport;
    /// assert!(SearchReport::default().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.last.is_none()
    }

    /// The batch size of the attempt that succeeded, if one did.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.batch_size(), Some(16));
    /// ```
    pub fn batch_size(&self) -> Option<usize> {
        self.last
            .as_ref()
            .filter(|attempt| attempt.outcome == Outcome::Succeeded)
            .map(|attempt| attempt.batch_size)
    }

    /// How many attempts ran out of memory.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.out_of_memory_count(), 2);
    /// ```
    pub fn out_of_memory_count(&self) -> usize {
        self.attempts()
            .filter(|attempt| matches!(attempt.outcome, Outcome::OutOfMemory { .. }))
            .count()
    }

    pub(crate) fn last_oom_description(&self) -> Option<&str> {
        self.attempts()
            .rev()
            .find_map(|attempt| match &attempt.outcome {
                Outcome::OutOfMemory { error } => Some(error.as_str()),
                _ => None,
            })
    }
}

impl fmt::Display for SearchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, attempt) in self.attempts().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{attempt}")?;
        }
        Ok(())
    }
}

thread_local! {
    static LAST_REPORT: RefCell<Option<SearchReport>> = const { RefCell::new(None) };
}

pub(crate) fn store_last_report(report: SearchReport) {
    LAST_REPORT.with(|last| *last.borrow_mut() = Some(report));
}

/// The report of the last search that finished on this thread (with a value, an error or no
/// size), if any. It stays until the next search on this thread finishes.
///
/// An `async` search finishes on whichever thread polled it last: read the report from the
/// value you return, or use the engine's [`BatchSizeSearch`](crate::BatchSizeSearch) there.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
///
/// let value: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run_dyn(|batch_size| {
///     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
/// });
/// assert_eq!(value.unwrap(), 16);
/// let report = last_report().unwrap();
/// assert_eq!(report.len(), 3);
/// assert_eq!(report.batch_size(), Some(16));
/// ```
pub fn last_report() -> Option<SearchReport> {
    LAST_REPORT.with(|last| last.borrow().clone())
}
