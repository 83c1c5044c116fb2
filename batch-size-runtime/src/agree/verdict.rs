//! One round of the agreement: what a rank says after an attempt, and the verdict every rank
//! reads from the all-reduce of what all said (MAX of the outcomes, MIN of the proposals).
//!
//! [`Agree`](super::Agree) and `Chunked` both speak it.

use super::collective::{AgreementError, Collective, ReduceOp};
use crate::error::StopReason;
use crate::policy::Decision;

/// Outcome codes, ordered so that MAX picks the most serious.
pub(crate) const SUCCEEDED: u64 = 0;
pub(crate) const OUT_OF_MEMORY: u64 = 1;
pub(crate) const FAILED: u64 = 2;

/// One round of the agreement: exchanges what this rank says after an attempt; every rank gets
/// the same [`Verdict`].
pub(crate) fn round(collective: &dyn Collective, said: Said) -> Result<Verdict, AgreementError> {
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
    match round(collective, said) {
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
    let _ = round(collective, said);
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
