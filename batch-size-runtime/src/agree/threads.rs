//! Ranks as threads of one process: a [`Collective`] over a shared barrier, for tests and for
//! one process driving several GPUs.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use super::collective::{AgreementError, Collective, ReduceOp};

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
