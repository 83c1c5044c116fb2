//! The safe point inside an attempt: every rank learns whether any rank ran out of memory
//! before the training step's own collectives, so that none waits in one alone.

use super::collective::{Collective, ReduceOp};
use crate::trial::ChildTrialError;
use crate::OutOfMemory;

/// Inside an attempt, after the forward and backward passes and before the gradient
/// all-reduce: every rank learns whether any rank ran out of memory. A rank that did passes
/// `true` and then returns its error; the others get `Err(OutOfMemoryOnAnotherRank)`, which is
/// an out-of-memory error, so every rank's attempt fails and all retry at the same size.
///
/// ```
/// use batch_size_runtime::agree::{safe_point, ThreadRanks};
/// let rank = ThreadRanks::new(1).remove(0);
/// assert!(safe_point(&rank, false).is_ok());
/// ```
pub fn safe_point(
    collective: &impl Collective,
    out_of_memory_here: bool,
) -> Result<(), OutOfMemoryOnAnotherRank> {
    let mut any = [u64::from(out_of_memory_here)];
    match collective.all_reduce(&mut any, ReduceOp::Max) {
        Ok(()) if any[0] == 0 || out_of_memory_here => Ok(()),
        Ok(()) => Err(OutOfMemoryOnAnotherRank),
        // The others cannot be reached: stop this attempt as out of memory too, and let the
        // agreement after it report the failure.
        Err(_) => Err(OutOfMemoryOnAnotherRank),
    }
}

/// Another rank ran out of memory in this step (from [`safe_point`]): recognised as
/// out-of-memory, so this rank retries with the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("out of device memory on another rank")]
pub struct OutOfMemoryOnAnotherRank;

/// `safe_point(rank, ...)?` in a function returning this crate's [`OutOfMemory`] (as the
/// simulated device's allocations do): an out-of-memory with no figures, on "another rank".
impl From<OutOfMemoryOnAnotherRank> for OutOfMemory {
    fn from(_: OutOfMemoryOnAnotherRank) -> OutOfMemory {
        OutOfMemory::new().on_device("another rank")
    }
}

/// `safe_point(rank, ...)?` in a function returning [`ChildTrialError`] (one that runs
/// [`ChildTrial`](crate::ChildTrial)s): [`ChildTrialError::OutOfMemoryOnAnotherRank`].
impl From<OutOfMemoryOnAnotherRank> for ChildTrialError {
    fn from(_: OutOfMemoryOnAnotherRank) -> ChildTrialError {
        ChildTrialError::OutOfMemoryOnAnotherRank
    }
}
