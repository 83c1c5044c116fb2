//! What a chunked run has done, shared by its chunks and its policy: the chunks that ran, the
//! progress, and what `notify` is told.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

use crate::runners::split::BatchCost;

/// One chunk that ran, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkRecord {
    /// Its items.
    pub range: Range<usize>,
    /// The budget it was packed to (items, or cost with `with_cost`).
    pub budget: usize,
    /// The cost of its items.
    pub cost: u64,
    /// Whether it completed or ran out of memory.
    pub done: bool,
}

/// Progress shown to `notify`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkProgress {
    /// Items done.
    pub completed: usize,
    /// Items in all.
    pub total: usize,
    /// Chunks that ran out of memory so far.
    pub retries: usize,
}

/// What the chunks share with the policy: where the work is.
#[derive(Debug, Default)]
pub(super) struct Progress {
    pub(super) completed: usize,
    pub(super) total: usize,
    /// The chunk being run, its cost and its costliest item's.
    pub(super) current: Range<usize>,
    pub(super) current_cost: u64,
    pub(super) current_longest: u64,
    /// How a chunk costs (with `with_cost`): the policy may learn another square term.
    pub(super) shape: BatchCost,
}

/// What one run's chunks and its policy share.
#[derive(Debug)]
pub(super) struct Run {
    pub(super) progress: Progress,
    /// Bounded for a long run: see [`Chunked::chunks`](super::Chunked::chunks).
    pub(super) records: Vec<ChunkRecord>,
    /// Chunks run, kept or not.
    pub(super) chunks_run: usize,
    /// When the records' done chunks are next thinned out.
    pub(super) thin_at: usize,
    pub(super) retries: usize,
}

/// The run, whatever a panic elsewhere left in the lock.
pub(super) fn lock(run: &Mutex<Run>) -> MutexGuard<'_, Run> {
    lock_any(run)
}

/// A lock, whatever a panic elsewhere left in it.
pub(super) fn lock_any<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
