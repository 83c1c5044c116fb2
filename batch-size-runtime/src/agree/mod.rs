//! Several ranks (processes or threads, one GPU each) agreeing on one batch size, so that no
//! rank retries alone while the others wait in a collective that never completes.
//!
//! [`Agree`] wraps any [`SizePolicy`]: at the end of every attempt each rank contributes
//! whether it succeeded, ran out of memory or failed otherwise, and what its own policy
//! proposes; an all-reduce (MAX of the outcomes, MIN of the proposals, as Composer does) gives
//! every rank the same verdict. If any rank ran out of memory, every rank retries at the same
//! size, the smallest proposal; if one failed with an error that is not out-of-memory, the
//! others stop with an error naming it; if all succeeded, all accept.
//!
//! The collective is a small trait, [`Collective`]; [`ThreadRanks`] implements it for threads
//! of one process (tests, one process driving several GPUs).
//!
//! ```
//! use std::thread;
//! use batch_size_runtime::agree::{Agree, ThreadRanks};
//! use batch_size_runtime::policy::Halve;
//! use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
//!
//! // Two GPUs: the first holds 100 samples, the second 40.
//! let handles: Vec<_> = ThreadRanks::new(2)
//!     .into_iter()
//!     .zip([100usize, 40])
//!     .map(|(rank, fits)| {
//!         thread::spawn(move || {
//!             BatchSizeSearch::new(128)
//!                 .with_policy(Agree::new(Halve, rank))
//!                 .run_dyn(|size| -> anyhow::Result<usize> {
//!                     if size > fits { Err(OutOfMemory::new())? }
//!                     Ok(size)
//!                 })
//!                 .unwrap()
//!         })
//!     })
//!     .collect();
//! let sizes: Vec<usize> = handles.into_iter().map(|handle| handle.join().unwrap()).collect();
//! assert_eq!(sizes, [32, 32]); // both at the size the smaller GPU holds
//! ```
//!
//! # Where a rank may run out of memory
//! The agreement happens between attempts. Inside an attempt, a rank that runs out of memory
//! must not be left alone while the others enter a collective of the training step (the
//! gradient all-reduce): they would wait forever. Call [`safe_point`] after the forward and
//! backward passes and before the gradient all-reduce:
//!
//! ```text
//! rank 0: forward ─ backward ─ safe_point ─┬─ all-reduce gradients ─ optimizer step
//! rank 1: forward ─ OOM ──────── safe_point ┘  (every rank leaves with "OOM on another rank")
//! ```

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::error::StopReason;
use crate::policy::{Decision, SizePolicy};
use crate::record::SearchReport;

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
pub trait Collective: Send + fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks take part.
    fn world_size(&self) -> usize;
    /// Replaces `values`, on every rank, with their reduction over all ranks. Every rank must
    /// call it the same number of times with the same length.
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError>;
}

/// Outcome codes, ordered so that MAX picks the most serious.
const SUCCEEDED: u64 = 0;
const OUT_OF_MEMORY: u64 = 1;
const FAILED: u64 = 2;

/// Makes every rank's search agree with the others' (see the [module docs](self)).
#[derive(Debug)]
pub struct Agree<P, C> {
    inner: P,
    collective: C,
}

impl<P: SizePolicy, C: Collective> Agree<P, C> {
    /// `inner` chooses this rank's sizes; `collective` connects it with the other ranks.
    ///
    /// ```
    /// use batch_size_runtime::agree::{Agree, ThreadRanks};
    /// use batch_size_runtime::policy::Guided;
    /// let mut ranks = ThreadRanks::new(1);
    /// let policy = Agree::new(Guided::new(), ranks.remove(0));
    /// # let _ = policy;
    /// ```
    pub fn new(inner: P, collective: C) -> Self {
        Agree { inner, collective }
    }

    /// Exchanges this rank's outcome and proposal; returns the worst outcome, the rank that
    /// failed (if one did) and the smallest proposal.
    fn exchange(
        &self,
        outcome: u64,
        proposal: u64,
    ) -> Result<(u64, Option<usize>, u64), AgreementError> {
        let failed_rank = if outcome == FAILED {
            self.collective.rank() as u64 + 1
        } else {
            0
        };
        let mut worst = [outcome, failed_rank];
        self.collective.all_reduce(&mut worst, ReduceOp::Max)?;
        let mut smallest = [proposal];
        self.collective.all_reduce(&mut smallest, ReduceOp::Min)?;
        let failed = (worst[1] > 0).then(|| (worst[1] - 1) as usize);
        Ok((worst[0], failed, smallest[0]))
    }
}

fn disagreement(error: &AgreementError) -> Decision {
    Decision::Stop(StopReason::Policy(format!(
        "the ranks could not agree: {error}"
    )))
}

impl<P: SizePolicy, C: Collective> SizePolicy for Agree<P, C> {
    fn first(&mut self, starting: usize) -> Decision {
        let proposal = match self.inner.first(starting) {
            Decision::Try(size) => size as u64,
            _ => 0,
        };
        match self.exchange(SUCCEEDED, proposal) {
            Ok((_, _, 0)) => Decision::Stop(StopReason::Policy(
                "a rank had no size to start from".to_owned(),
            )),
            Ok((_, _, size)) => Decision::Try(size as usize),
            Err(error) => disagreement(&error),
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let succeeded = history.last().is_some_and(|last| last.outcome.is_success());
        let own = self.inner.after(history);
        let (outcome, proposal) = match (&own, succeeded) {
            (_, true) => (SUCCEEDED, u64::MAX),
            (Decision::Try(size), false) => (OUT_OF_MEMORY, *size as u64),
            (_, false) => (OUT_OF_MEMORY, 0),
        };
        match self.exchange(outcome, proposal) {
            Err(error) => disagreement(&error),
            Ok((FAILED, rank, _)) => Decision::Stop(StopReason::Policy(format!(
                "rank {} failed with an error that is not out-of-memory",
                rank.map_or_else(|| "?".to_owned(), |rank| rank.to_string())
            ))),
            Ok((OUT_OF_MEMORY, _, 0)) => Decision::Stop(StopReason::Policy(
                "a rank ran out of memory and has no smaller size left".to_owned(),
            )),
            Ok((OUT_OF_MEMORY, _, size)) => Decision::Try(size as usize),
            Ok(_) => own,
        }
    }

    fn ended_by_failure(&mut self, history: &SearchReport) {
        self.inner.ended_by_failure(history);
        // Tell the others, who are waiting in `after`; what they answer no longer matters here.
        let _ = self.exchange(FAILED, 0);
    }

    fn check(&self) -> Result<(), String> {
        self.inner.check()
    }

    fn reads_memory_after_success(&self) -> bool {
        self.inner.reads_memory_after_success()
    }

    fn rationale(&self) -> Option<String> {
        self.inner.rationale()
    }
}

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

/// Ranks as threads of one process, over a shared barrier.
#[derive(Debug, Clone)]
pub struct ThreadRank {
    rank: usize,
    shared: Arc<Shared>,
}

/// Creates the ranks of one group of threads.
#[derive(Debug)]
pub struct ThreadRanks;

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<Round>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    generation: u64,
    joined: usize,
    values: Vec<u64>,
    result: Vec<u64>,
}

impl ThreadRanks {
    /// `world` ranks, each waiting at most 30 s for the others at every agreement.
    ///
    /// ```
    /// use batch_size_runtime::agree::{Collective, ThreadRanks};
    /// let ranks = ThreadRanks::new(4);
    /// assert_eq!(ranks.len(), 4);
    /// assert_eq!((ranks[3].rank(), ranks[3].world_size()), (3, 4));
    /// ```
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<ThreadRank> {
        ThreadRanks::with_timeout(world, Duration::from_secs(30))
    }

    /// `world` ranks that give up with [`AgreementError::Timeout`] after `timeout`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use batch_size_runtime::agree::{AgreementError, Collective, ReduceOp, ThreadRanks};
    /// let ranks = ThreadRanks::with_timeout(2, Duration::from_millis(10));
    /// let error = ranks[0].all_reduce(&mut [1], ReduceOp::Max).unwrap_err(); // rank 1 never came
    /// assert!(matches!(error, AgreementError::Timeout { joined: 1, .. }));
    /// ```
    pub fn with_timeout(world: usize, timeout: Duration) -> Vec<ThreadRank> {
        let shared = Arc::new(Shared {
            world: world.max(1),
            timeout,
            state: Mutex::new(Round::default()),
            changed: Condvar::new(),
        });
        (0..world.max(1))
            .map(|rank| ThreadRank {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        let shared = &*self.shared;
        let mut round = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = round.generation;
        if round.joined == 0 {
            round.values = values.to_vec();
        } else {
            for (held, value) in round.values.iter_mut().zip(values.iter()) {
                *held = match op {
                    ReduceOp::Max => (*held).max(*value),
                    ReduceOp::Min => (*held).min(*value),
                };
            }
        }
        round.joined += 1;
        if round.joined == shared.world {
            round.result = std::mem::take(&mut round.values);
            round.joined = 0;
            round.generation += 1;
            values.copy_from_slice(&round.result[..values.len().min(round.result.len())]);
            shared.changed.notify_all();
            return Ok(());
        }
        let (mut round, timeout) = shared
            .changed
            .wait_timeout_while(round, shared.timeout, |round| {
                round.generation == generation
            })
            .unwrap_or_else(PoisonError::into_inner);
        if timeout.timed_out() && round.generation == generation {
            let joined = round.joined;
            // Leave the round so that a later agreement starts clean.
            round.joined = round.joined.saturating_sub(1);
            return Err(AgreementError::Timeout {
                rank: self.rank,
                waited: shared.timeout,
                joined,
                world: shared.world,
            });
        }
        values.copy_from_slice(&round.result[..values.len().min(round.result.len())]);
        Ok(())
    }
}
