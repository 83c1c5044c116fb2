//! The record of a search: every attempt, its outcome, duration and memory figures.

use std::cell::RefCell;
use std::fmt;
use std::time::Duration;

use crate::memory::MemorySnapshot;

/// How an attempt ended.
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
    /// Device memory when it ran out of memory, before release.
    pub memory_at_end: Option<MemorySnapshot>,
    /// Device memory after the release that followed.
    pub memory_after_release: Option<MemorySnapshot>,
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
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchReport {
    // The final attempt is kept apart so that a search whose first attempt succeeds records
    // itself without allocating.
    earlier: Vec<Attempt>,
    last: Option<Attempt>,
}

impl SearchReport {
    pub(crate) fn push(&mut self, attempt: Attempt) {
        if let Some(previous) = self.last.replace(attempt) {
            self.earlier.push(previous);
        }
    }

    /// The attempts, in order.
    pub fn attempts(&self) -> impl DoubleEndedIterator<Item = &Attempt> + '_ {
        self.earlier.iter().chain(self.last.as_ref())
    }

    /// How many attempts were made.
    pub fn len(&self) -> usize {
        self.earlier.len() + usize::from(self.last.is_some())
    }

    /// Whether no attempt was made.
    pub fn is_empty(&self) -> bool {
        self.last.is_none()
    }

    /// The batch size of the attempt that succeeded, if one did.
    pub fn batch_size(&self) -> Option<usize> {
        self.last
            .as_ref()
            .filter(|attempt| attempt.outcome == Outcome::Succeeded)
            .map(|attempt| attempt.batch_size)
    }

    /// How many attempts ran out of memory.
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
