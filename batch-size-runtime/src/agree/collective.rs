//! The collective the agreement needs: an all-reduce of a few integers across ranks (and an
//! all-gather of one, built on it), and why it can fail.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The reduction of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The largest value of every rank.
    Max,
    /// The smallest value of every rank.
    Min,
}

/// Why the ranks could not agree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AgreementError {
    /// Not every rank joined in time (one died, or never started).
    #[error(
        "rank {rank} waited {waited:?} for the other ranks to agree; {joined} of {world} joined"
    )]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// Ranks that joined.
        joined: usize,
        /// Ranks in all.
        world: usize,
    },
    /// The collective failed or was aborted.
    #[error("the collective failed: {0}")]
    Failed(String),
}

/// The collective the agreement needs: an all-reduce of a few integers across ranks.
///
/// Implemented by `ThreadRank` (threads of one process), with the `nccl` feature by `NcclRank`
/// (one communicator over NCCL), with the `mpi` feature by `MpiRank` (the MPI of a job launched
/// with `mpirun` or `srun`); by references, boxes and `Arc`s of any, so a search can borrow the
/// rank it agrees through.
pub trait Collective: Send + Sync + fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks take part.
    fn world_size(&self) -> usize;
    /// Replaces `values`, on every rank, with their reduction over all ranks. Every rank must
    /// call it the same number of times with the same length.
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError>;

    /// Every rank's `value`, in rank order, on every rank. Every rank must call it the same
    /// number of times. The default is one MAX all-reduce of `world_size()` integers, each rank
    /// filling its own slot (the others 0): no other primitive is needed, so every collective
    /// has it, NCCL's included; a collective with a native all-gather may override it.
    ///
    /// ```
    /// use std::thread;
    /// use batch_size_runtime::agree::{Collective, ThreadRanks};
    ///
    /// let gathered: Vec<Vec<u64>> = thread::scope(|scope| {
    ///     let ranks: Vec<_> = ThreadRanks::new(3)
    ///         .into_iter()
    ///         .map(|rank| scope.spawn(move || rank.all_gather(10 * rank.rank() as u64 + 1)))
    ///         .collect();
    ///     ranks.into_iter().map(|rank| rank.join().unwrap().unwrap()).collect()
    /// });
    /// assert_eq!(gathered, vec![vec![1, 11, 21]; 3]);
    /// ```
    fn all_gather(&self, value: u64) -> Result<Vec<u64>, AgreementError> {
        let mut values = vec![0; self.world_size()];
        if let Some(slot) = values.get_mut(self.rank()) {
            *slot = value;
        }
        self.all_reduce(&mut values, ReduceOp::Max)?;
        Ok(values)
    }
}

/// A reference, a box or an `Arc` of a collective is that collective: a search can borrow the
/// rank it agrees through, or share it.
macro_rules! collective_through_pointer {
    ($($pointer:ty),*) => {$(
        impl<C: Collective + ?Sized> Collective for $pointer {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
                (**self).all_reduce(values, op)
            }
            fn all_gather(&self, value: u64) -> Result<Vec<u64>, AgreementError> {
                (**self).all_gather(value)
            }
        }
    )*};
}

collective_through_pointer!(&C, Box<C>, Arc<C>);
