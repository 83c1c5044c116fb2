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

pub mod exchange;
#[cfg(feature = "nccl")]
pub mod nccl;

pub use exchange::{ExchangeError, IdExchange};

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
///
/// Implemented by [`ThreadRank`] (threads of one process) and, with the `nccl` feature, by
/// `NcclRank` (one communicator over NCCL); by references, boxes and `Arc`s of either, so a
/// search can borrow the rank it agrees through.
pub trait Collective: Send + Sync + fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks take part.
    fn world_size(&self) -> usize;
    /// Replaces `values`, on every rank, with their reduction over all ranks. Every rank must
    /// call it the same number of times with the same length.
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError>;
}

impl<C: Collective + ?Sized> Collective for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        (**self).all_reduce(values, op)
    }
}

impl<C: Collective + ?Sized> Collective for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        (**self).all_reduce(values, op)
    }
}

impl<C: Collective + ?Sized> Collective for Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        (**self).all_reduce(values, op)
    }
}

/// Outcome codes, ordered so that MAX picks the most serious.
pub(crate) const SUCCEEDED: u64 = 0;
pub(crate) const OUT_OF_MEMORY: u64 = 1;
pub(crate) const FAILED: u64 = 2;

/// Makes every rank's search agree with the others' (see the [module docs](self)).
#[derive(Debug)]
pub struct Agree<P, C> {
    inner: P,
    collective: C,
    /// Why the last agreed size differs from this rank's own proposal, for the retry's log.
    overruled: Option<String>,
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
        Agree {
            inner,
            collective,
            overruled: None,
        }
    }

    fn exchange(&self, said: Said) -> Result<Verdict, AgreementError> {
        exchange(&self.collective, said)
    }
}

/// Exchanges what this rank says after an attempt; every rank gets the same [`Verdict`].
pub(crate) fn exchange(collective: &dyn Collective, said: Said) -> Result<Verdict, AgreementError> {
    let failed_rank = if said.outcome == FAILED {
        collective.rank() as u64 + 1
    } else {
        0
    };
    let continues = u64::from(said.continues);
    let mut most = [said.outcome, failed_rank, continues];
    collective.all_reduce(&mut most, ReduceOp::Max)?;
    let mut least = [said.proposal, continues];
    collective.all_reduce(&mut least, ReduceOp::Min)?;
    Ok(Verdict {
        outcome: most[0],
        failed_rank: (most[1] > 0).then(|| (most[1] - 1) as usize),
        smallest_proposal: least[0],
        all_continue: least[1] == 1,
        any_continue: most[2] == 1,
    })
}

/// What one rank says after an attempt.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Said {
    /// [`SUCCEEDED`], [`OUT_OF_MEMORY`] or [`FAILED`].
    pub(crate) outcome: u64,
    /// The size its policy would try next (`u64::MAX` for none, 0 for none left).
    pub(crate) proposal: u64,
    /// Whether its policy asks for another attempt after a success (a tuner, chunks).
    pub(crate) continues: bool,
}

/// What every rank learns from an exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Verdict {
    /// The most serious outcome of any rank.
    pub(crate) outcome: u64,
    /// The highest rank that failed with an error that is not out-of-memory.
    pub(crate) failed_rank: Option<usize>,
    pub(crate) smallest_proposal: u64,
    /// Whether every rank asked for another attempt.
    pub(crate) all_continue: bool,
    /// Whether any rank asked for another attempt.
    pub(crate) any_continue: bool,
}

impl Said {
    /// After an attempt that succeeded or ran out of memory, its policy having decided `own`.
    pub(crate) fn after_attempt(succeeded: bool, own: &Decision) -> Said {
        Said {
            outcome: if succeeded { SUCCEEDED } else { OUT_OF_MEMORY },
            proposal: match own {
                Decision::Try(size) => *size as u64,
                _ if succeeded => u64::MAX,
                _ => 0,
            },
            continues: matches!(own, Decision::Try(_)),
        }
    }
}

/// The first size every rank tries: the smallest of the ranks' `proposal`s (0: none).
pub(crate) fn agreed_start(collective: &dyn Collective, proposal: u64) -> Decision {
    let said = Said {
        outcome: SUCCEEDED,
        proposal,
        continues: true,
    };
    match exchange(collective, said) {
        Ok(verdict) if verdict.smallest_proposal == 0 => Decision::Stop(StopReason::Policy(
            "a rank had no size to start from".to_owned(),
        )),
        Ok(verdict) => Decision::Try(verdict.smallest_proposal as usize),
        Err(error) => disagreement(&error),
    }
}

/// Tells the other ranks, waiting for this attempt's verdict, that it failed otherwise; what
/// they answer no longer matters here.
pub(crate) fn tell_failure(collective: &dyn Collective) {
    let said = Said {
        outcome: FAILED,
        proposal: 0,
        continues: false,
    };
    let _ = exchange(collective, said);
}

impl Verdict {
    /// Whether every rank stops here: a rank ran out of memory with no smaller size left.
    pub(crate) fn all_stop(&self) -> bool {
        self.outcome == OUT_OF_MEMORY && self.smallest_proposal == 0
    }

    /// The stop for a rank that failed otherwise.
    pub(crate) fn failed(&self) -> Decision {
        Decision::Stop(StopReason::Agreement(format!(
            "rank {} failed with an error that is not out-of-memory",
            self.failed_rank
                .map_or_else(|| "?".to_owned(), |rank| rank.to_string())
        )))
    }
}

pub(crate) fn disagreement(error: &AgreementError) -> Decision {
    Decision::Stop(StopReason::Agreement(format!(
        "the ranks could not agree: {error}"
    )))
}

impl<P: SizePolicy, C: Collective> SizePolicy for Agree<P, C> {
    fn first(&mut self, starting: usize) -> Decision {
        let proposal = match self.inner.first(starting) {
            Decision::Try(size) => size as u64,
            _ => 0,
        };
        agreed_start(&self.collective, proposal)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let succeeded = history.last().is_some_and(|last| last.outcome.is_success());
        let own = self.inner.after(history);
        let said = Said::after_attempt(succeeded, &own);
        let proposal = said.proposal;
        let verdict = match self.exchange(said) {
            Ok(verdict) => verdict,
            Err(error) => return disagreement(&error),
        };
        self.overruled = (verdict.outcome != SUCCEEDED
            && verdict.smallest_proposal != proposal
            && verdict.smallest_proposal != 0)
            .then(|| {
                let own = match own {
                    Decision::Try(size) => format!("this rank proposed {size}"),
                    _ if succeeded => "this rank succeeded".to_owned(),
                    _ => "this rank had no size left".to_owned(),
                };
                format!(
                    "the smallest size the {} ranks proposed; {own}",
                    self.collective.world_size()
                )
            });
        match verdict.outcome {
            FAILED => verdict.failed(),
            _ if verdict.all_stop() => Decision::Stop(StopReason::Policy(
                "a rank ran out of memory and has no smaller size left".to_owned(),
            )),
            // Every rank retries at the same size, the ones that succeeded too: the attempt
            // is one step of the same training on every rank.
            OUT_OF_MEMORY => Decision::Try(verdict.smallest_proposal as usize),
            // Everyone succeeded and every policy asks for more (a tuner, chunks): go on
            // together, at the smallest proposal.
            _ if verdict.all_continue => Decision::Try(verdict.smallest_proposal as usize),
            // Everyone succeeded and some policy is done: all end here, at the size that just
            // ran on every rank (a rank that wanted more accepts it too).
            _ => match own {
                Decision::Try(_) => Decision::Accept,
                other => other,
            },
        }
    }

    fn ended_by_failure(&mut self, history: &SearchReport) {
        self.inner.ended_by_failure(history);
        tell_failure(&self.collective);
    }

    fn check(&self) -> Result<(), String> {
        self.inner.check()
    }

    fn reads_memory_after_success(&self) -> bool {
        self.inner.reads_memory_after_success()
    }

    fn rationale(&self) -> Option<String> {
        self.overruled.clone().or_else(|| self.inner.rationale())
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
    /// Ranks of this round called with different lengths (they are out of step).
    mismatched: bool,
    result_mismatched: bool,
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
            round.mismatched = false;
        } else {
            round.mismatched |= round.values.len() != values.len();
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
            round.result_mismatched = round.mismatched;
            round.joined = 0;
            round.generation += 1;
            shared.changed.notify_all();
            return self.take_result(&round, values);
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
        self.take_result(&round, values)
    }
}

impl ThreadRank {
    /// Copies a completed round's result, unless the ranks were out of step.
    fn take_result(&self, round: &Round, values: &mut [u64]) -> Result<(), AgreementError> {
        if round.result_mismatched || round.result.len() != values.len() {
            return Err(AgreementError::Failed(format!(
                "rank {} met the other ranks in collectives of different lengths: the ranks are \
                 out of step (is a collective of yours reached by some ranks only? put \
                 `safe_point` before it)",
                self.rank
            )));
        }
        values.copy_from_slice(&round.result);
        Ok(())
    }
}
