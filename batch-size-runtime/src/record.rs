//! The record of a search: every attempt, its outcome, duration and memory figures.
//!
//! ```
//! use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
//!
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(32).run(|batch_size| {
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
/// let _ = BatchSizeSearch::new(2).run(|batch_size| -> anyhow::Result<()> {
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
    /// Its first step ran and reported itself ([`step_done`](crate::step_done)), and the step's
    /// figures showed that a larger size fits: the attempt was ended there, and the function ran
    /// again at `to`. The size fits (one step of it ran); `memory_at_end` holds the figures read.
    Grew {
        /// The size the function ran at next.
        to: usize,
    },
}

/// One call of the attempt.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, Outcome, memory::SimulatedDevice};
///
/// let device = SimulatedDevice::new(100);
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(16)
///     .with_release(device.clone())
///     .run(|batch_size| {
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
    /// What the attempt's memory came to, read once where it ended ([`Figures`]).
    pub figures: Figures,
    /// How the policy chose this size, when it says (an estimate, a fitted limit).
    pub rationale: Option<String>,
    /// The remedies in force during this attempt ("activation checkpointing, context length
    /// 1024"), where a search applies any ([`Remedies`](crate::remedies::Remedies)); `None` otherwise.
    pub remedies: Option<String>,
    /// Whether the function reported a step with [`step_done`](crate::step_done) in an attempt
    /// watched for growing before the attempt ended: where it then ran out of memory, a later
    /// step needed more than the first.
    pub first_step_done: bool,
}

/// The figures of one attempt, in one frame: what it had to itself and what it used of it.
///
/// The frame: what was *held at the start* is what the attempt did not allocate and could not
/// use (other processes, the context, what a pool had allocated); its *room* is the rest (free,
/// plus what a pool held unallocated, which it reuses); its *peak* is the most it held above
/// what was held at its start. An out-of-memory's own figures (the bytes asked for, free and
/// total at the failure) come from the error as values: the crate's [`OutOfMemory`](crate::OutOfMemory)
/// and those of a child are read as they are, only a foreign error's text is parsed. Each
/// figure is `None` where nothing said it.
///
/// ```
/// use batch_size_runtime::{last_report, BatchSizeSearch, memory::SimulatedDevice};
///
/// let device = SimulatedDevice::new(1000);
/// let _: anyhow::Result<usize> = BatchSizeSearch::new(64)
///     .with_release(device.clone())
///     .run(|batch_size| {
///         let _weights = device.alloc(200)?;
///         let _batch = device.alloc(batch_size as u64 * 20)?;
///         Ok(batch_size)
///     });
/// let report = last_report().unwrap();
/// let first = report.attempts().next().unwrap().figures;
/// assert_eq!(first.requested, Some(64 * 20));
/// assert_eq!((first.free_at_failure, first.total), (Some(800), Some(1000)));
/// assert_eq!((first.held_at_start, first.room), (Some(0), Some(1000)));
/// assert_eq!(first.peak, Some(200));
/// assert_eq!(first.needed_at_least(), Some(200 + 64 * 20));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Figures {
    /// Bytes the failing allocation asked for.
    pub requested: Option<u64>,
    /// Bytes free on the device when the allocation failed, as the error said.
    pub free_at_failure: Option<u64>,
    /// The device's total bytes: the error's, else the memory backend's.
    pub total: Option<u64>,
    /// Bytes held when the attempt started that it could not use.
    pub held_at_start: Option<u64>,
    /// The most bytes the attempt held above what was held at its start.
    pub peak: Option<u64>,
    /// The bytes the attempt could use: free at its start plus a pool's unallocated reserve.
    pub room: Option<u64>,
    /// Bytes held once the release after a failure ran (less than at the start where it gave
    /// back what a pool kept from earlier work).
    pub held_after_release: Option<u64>,
}

impl Figures {
    /// Bytes in use on the device when the allocation failed: the error's free bytes against
    /// the total, else what was held at the start plus the attempt's peak.
    ///
    /// ```
    /// use batch_size_runtime::Figures;
    /// let mut figures = Figures::default();
    /// (figures.free_at_failure, figures.total) = (Some(1 << 30), Some(4 << 30));
    /// assert_eq!(figures.used_at_failure(), Some(3 << 30));
    /// ```
    pub fn used_at_failure(&self) -> Option<u64> {
        match (self.total, self.free_at_failure) {
            (Some(total), Some(free)) if free <= total => Some(total - free),
            (Some(_), Some(_)) => None,
            _ => Some(self.held_at_start?.saturating_add(self.peak?)),
        }
    }

    /// Bytes the attempt needed at least: what was in use when the allocation failed plus
    /// what it asked for (a failure part-way through the step knows only part of it).
    pub fn needed_at_least(&self) -> Option<u64> {
        Some(self.used_at_failure()?.saturating_add(self.requested?))
    }
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "attempt {} with batch size {}",
            self.number, self.batch_size
        )?;
        if let Some(remedies) = &self.remedies {
            write!(f, " ({remedies})")?;
        }
        f.write_str(": ")?;
        match &self.outcome {
            Outcome::Succeeded => f.write_str("succeeded")?,
            Outcome::OutOfMemory { error } => write!(f, "out of memory ({error})")?,
            Outcome::Failed { error } => write!(f, "failed ({error})")?,
            Outcome::Panicked => f.write_str("panicked")?,
            Outcome::Grew { to } => write!(f, "its first step fit; grown to {to}")?,
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
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
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
///
/// # A long search
/// A search that goes on after its successes (the chunks of a [`Chunked`](crate::Chunked) run,
/// hundreds of thousands of them) keeps a bounded record: the first
/// [`KEPT_FIRST`](Self::KEPT_FIRST) attempts, every attempt that did not succeed, and the last
/// [`KEPT_LAST_SUCCESSES`](Self::KEPT_LAST_SUCCESSES) successes; the successes in between are
/// counted ([`elided`](Self::elided)), not kept. [`len`](Self::len), the counts and the
/// smallest failure and largest success cover every attempt; [`attempts`](Self::attempts)
/// yields the kept ones, each with its own `number`.
///
/// ```
/// use batch_size_runtime::{last_report, Chunked, SearchReport};
///
/// let mut chunks = Chunked::new(100_000).with_starting(10).with_grow_after(0);
/// chunks.for_each(|_| Ok::<_, anyhow::Error>(()))?;
/// let report = last_report().unwrap();
/// assert_eq!(report.len(), 10_000);
/// let kept = SearchReport::KEPT_FIRST + SearchReport::KEPT_LAST_SUCCESSES;
/// assert!(report.attempts().count() <= kept + 2 * SearchReport::KEPT_LAST_SUCCESSES);
/// assert_eq!(report.attempts().count() + report.elided(), 10_000);
/// assert_eq!(report.attempts().last().unwrap().number, 10_000);
/// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchReport {
    // The final attempt is kept apart so that a search whose first attempt succeeds records
    // itself without allocating.
    earlier: Vec<Attempt>,
    last: Option<Attempt>,
    /// What is known of every attempt, kept or not: exact whatever the record leaves out.
    totals: Totals,
    /// Set when the search ran a size from the cache and returned it.
    pub(crate) cache_hit: Option<CacheHit>,
}

/// A search that ran the size its cache entry kept and returned it: what the entry said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheHit {
    /// The largest size that ran when the entry was written, where it was above the size kept
    /// (a tuner's, before its margin).
    pub(crate) largest_fit: Option<usize>,
}

/// Counts over every attempt of a search, kept up to date as attempts are recorded, so that no
/// question about the whole search scans it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Totals {
    attempts: usize,
    out_of_memory: usize,
    smallest_out_of_memory: Option<usize>,
    largest_success: Option<usize>,
    /// Successes left out of the record.
    elided: usize,
    /// The record's length at which the successes in its tail are next thinned out.
    thin_at: usize,
}

impl Outcome {
    /// Whether the attempt returned its value. Not for [`Grew`](Self::Grew), whose size ran
    /// too (its first step fit) but whose value was not kept: to ask whether a size fits, use
    /// [`ran`](Self::ran).
    ///
    /// ```
    /// use batch_size_runtime::Outcome;
    /// assert!(Outcome::Succeeded.is_success());
    /// assert!(!Outcome::Panicked.is_success());
    /// assert!(!Outcome::Grew { to: 128 }.is_success());
    /// ```
    pub fn is_success(&self) -> bool {
        matches!(self, Outcome::Succeeded)
    }

    /// Whether the attempt's size ran: it returned its value ([`Succeeded`](Self::Succeeded)),
    /// or its first step ran and the search grew from it ([`Grew`](Self::Grew)). Either way
    /// the size fits.
    ///
    /// ```
    /// use batch_size_runtime::Outcome;
    /// assert!(Outcome::Succeeded.ran());
    /// assert!(Outcome::Grew { to: 128 }.ran());
    /// assert!(!Outcome::OutOfMemory { error: "CUDA out of memory".into() }.ran());
    /// assert!(!Outcome::Failed { error: "corrupt record".into() }.ran());
    /// ```
    pub fn ran(&self) -> bool {
        matches!(self, Outcome::Succeeded | Outcome::Grew { .. })
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
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
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
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.smallest_out_of_memory(), Some(32));
    /// ```
    pub fn smallest_out_of_memory(&self) -> Option<usize> {
        self.totals.smallest_out_of_memory
    }

    /// The largest size that succeeded in this search, if any did.
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.largest_success(), Some(16));
    /// ```
    pub fn largest_success(&self) -> Option<usize> {
        self.totals.largest_success
    }

    /// Whether the search ran the size its cache entry kept and returned it
    /// ([`BatchSizeSearch::with_cache`](crate::BatchSizeSearch::with_cache)).
    ///
    /// ```
    /// # use batch_size_runtime::BatchSizeSearch;
    /// for rerun in [false, true] {
    ///     let (fitted, report) = BatchSizeSearch::new(8)
    ///         .with_cache("from_cache doc")
    ///         .run_with_report(|batch_size| Ok::<_, anyhow::Error>(batch_size));
    ///     assert_eq!((fitted?, report.from_cache()), (8, rerun));
    /// }
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn from_cache(&self) -> bool {
        self.cache_hit.is_some()
    }

    /// Attempts a long search keeps from its start.
    pub const KEPT_FIRST: usize = 256;
    /// Successes a long search keeps from its end (besides every attempt that did not succeed).
    pub const KEPT_LAST_SUCCESSES: usize = 64;

    /// Successful attempts a long search left out of its record (see [the type](Self)); 0 for
    /// any search of up to [`KEPT_FIRST`](Self::KEPT_FIRST) attempts.
    pub fn elided(&self) -> usize {
        self.totals.elided
    }

    /// The attempts made under the remedies in force at the end (those in force when the last
    /// attempt ran): what failed under other remedies bounds nothing now.
    pub(crate) fn under_final_remedies(&self) -> impl Iterator<Item = &Attempt> + '_ {
        let remedies = self.last().and_then(|last| last.remedies.as_ref());
        self.attempts()
            .filter(move |attempt| attempt.remedies.as_ref() == remedies)
    }

    /// Whether the remedies in force changed during the search (a remedy was applied).
    pub(crate) fn remedies_changed(&self) -> bool {
        self.under_final_remedies().count() != self.attempts().count()
    }

    /// The attempts numbered after `number`, as a report of their own (what a policy sees of
    /// the attempts made under the settings in force, after a remedy).
    pub(crate) fn since(&self, number: usize) -> SearchReport {
        let mut report = SearchReport::default();
        for attempt in self.attempts().filter(|attempt| attempt.number > number) {
            report.push(attempt.clone());
        }
        report
    }

    #[inline(always)]
    pub(crate) fn push(&mut self, attempt: Attempt) {
        let totals = &mut self.totals;
        totals.attempts += 1;
        match attempt.outcome {
            Outcome::Succeeded => {
                totals.largest_success = Some(
                    totals
                        .largest_success
                        .map_or(attempt.batch_size, |largest| {
                            largest.max(attempt.batch_size)
                        }),
                );
            }
            Outcome::OutOfMemory { .. } => {
                totals.out_of_memory += 1;
                totals.smallest_out_of_memory = Some(
                    totals
                        .smallest_out_of_memory
                        .map_or(attempt.batch_size, |smallest| {
                            smallest.min(attempt.batch_size)
                        }),
                );
            }
            Outcome::Failed { .. } | Outcome::Panicked | Outcome::Grew { .. } => {}
        }
        match &mut self.last {
            // The first attempt goes in place: the common search of one attempt copies nothing.
            None => self.last = Some(attempt),
            Some(last) => {
                let previous = std::mem::replace(last, attempt);
                self.keep_earlier(previous);
            }
        }
    }

    /// Keeps an attempt that is no longer the last (out of line: the first attempt's path does
    /// not need it).
    #[inline(never)]
    fn keep_earlier(&mut self, previous: Attempt) {
        self.earlier.push(previous);
        self.thin_out();
    }

    /// Leaves old successes out of a long record (see [the type](Self)).
    fn thin_out(&mut self) {
        self.totals.elided += thin_out(&mut self.earlier, &mut self.totals.thin_at, |attempt| {
            attempt.outcome.is_success()
        });
    }

    /// The attempts, in order (for a long search, the ones it keeps: see [the type](Self)).
    ///
    /// ```
    /// # use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
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
    /// says when no size fits); for a long search, those of the attempts it keeps.
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
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.len(), 3);
    /// ```
    pub fn len(&self) -> usize {
        self.totals.attempts
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
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
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
    /// # let _: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
    /// #     if batch_size > 16 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    /// # });
    /// let report = last_report().unwrap(); // 64 and 32 ran out of memory, 16 fit
    /// assert_eq!(report.out_of_memory_count(), 2);
    /// ```
    pub fn out_of_memory_count(&self) -> usize {
        self.totals.out_of_memory
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

/// Bounds a long record (a search's attempts, a chunked run's chunks): once its tail, after the
/// first [`SearchReport::KEPT_FIRST`] entries, holds twice
/// [`SearchReport::KEPT_LAST_SUCCESSES`] routine entries (successes), all but the last of those
/// are left out; every other entry (a failure) stays. Amortised, a constant cost an entry, and
/// memory that does not grow with the routine ones. Returns how many it left out.
pub(crate) fn thin_out<T>(
    record: &mut Vec<T>,
    thin_at: &mut usize,
    routine: impl Fn(&T) -> bool,
) -> usize {
    let (first, last) = (SearchReport::KEPT_FIRST, SearchReport::KEPT_LAST_SUCCESSES);
    if record.len() < (first + 2 * last).max(*thin_at) {
        return 0;
    }
    let in_tail = record
        .iter()
        .skip(first)
        .filter(|entry| routine(entry))
        .count();
    let mut to_leave_out = in_tail.saturating_sub(last);
    let before = record.len();
    let mut index = 0;
    record.retain(|entry| {
        index += 1;
        let leave_out = index > first && to_leave_out > 0 && routine(entry);
        if leave_out {
            to_leave_out -= 1;
        }
        !leave_out
    });
    // The next thinning waits for as many routine entries again.
    *thin_at = record.len() + 2 * last;
    before - record.len()
}

impl fmt::Display for SearchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, attempt) in self.attempts().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{attempt}")?;
        }
        if self.totals.elided > 0 {
            write!(
                f,
                "\n({} successful attempts in between not kept)",
                self.totals.elided
            )?;
        }
        Ok(())
    }
}

thread_local! {
    static LAST_REPORT: RefCell<Option<SearchReport>> = const { RefCell::new(None) };
}

/// Puts `report` where [`last_report`] reads it.
#[inline]
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
/// let value: Result<usize, anyhow::Error> = BatchSizeSearch::new(64).run(|batch_size| {
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
