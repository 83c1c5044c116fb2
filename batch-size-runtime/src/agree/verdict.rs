//! One round of the agreement: what a rank says after an attempt, and the verdict every rank
//! reads from the all-reduce of what all said (MAX of the outcomes, MIN of the proposals).
//!
//! [`Agree`](super::Agree) and `Chunked` both speak it.

use super::collective::{AgreementError, Collective, ReduceOp};
use crate::error::StopReason;
use crate::policy::Decision;

/// How an attempt ended on a rank, ordered so that the MAX all-reduce of the codes picks the
/// most serious.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RankOutcome {
    Succeeded = 0,
    OutOfMemory = 1,
    /// An error or a panic that is not out-of-memory.
    Failed = 2,
}

impl RankOutcome {
    fn from_wire(code: u64) -> RankOutcome {
        match code {
            0 => RankOutcome::Succeeded,
            1 => RankOutcome::OutOfMemory,
            _ => RankOutcome::Failed,
        }
    }
}

/// The size a rank's policy would try next, ordered so that the MIN all-reduce of the codes
/// picks "none left" over any size, and any size over "none needed".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proposal {
    /// Out of memory with no smaller size left (0 on the wire).
    NoneLeft,
    Size(usize),
    /// The rank needs no further attempt (`u64::MAX` on the wire).
    NoneNeeded,
}

impl Proposal {
    fn to_wire(self) -> u64 {
        match self {
            Proposal::NoneLeft => 0,
            Proposal::Size(size) => (size as u64).clamp(1, u64::MAX - 1),
            Proposal::NoneNeeded => u64::MAX,
        }
    }

    fn from_wire(code: u64) -> Proposal {
        match code {
            0 => Proposal::NoneLeft,
            u64::MAX => Proposal::NoneNeeded,
            size => Proposal::Size(usize::try_from(size).unwrap_or(usize::MAX)),
        }
    }

    /// A size a rank proposed, as a decision; without one, `otherwise`.
    pub(crate) fn try_or(self, otherwise: Decision) -> Decision {
        match self {
            Proposal::Size(size) => Decision::Try(size),
            _ => otherwise,
        }
    }
}

/// One round of the agreement: exchanges what this rank says after an attempt; every rank gets
/// the same [`Verdict`].
pub(crate) fn round(collective: &dyn Collective, said: Said) -> Result<Verdict, AgreementError> {
    let failed_rank = if said.outcome == RankOutcome::Failed {
        collective.rank() as u64 + 1
    } else {
        0
    };
    let continues = u64::from(said.continues);
    let mut most = [said.outcome as u64, failed_rank, continues];
    collective.all_reduce(&mut most, ReduceOp::Max)?;
    let mut least = [said.proposal.to_wire(), continues];
    collective.all_reduce(&mut least, ReduceOp::Min)?;
    Ok(Verdict {
        outcome: RankOutcome::from_wire(most[0]),
        failed_rank: (most[1] > 0).then(|| (most[1] - 1) as usize),
        smallest_proposal: Proposal::from_wire(least[0]),
        all_continue: least[1] == 1,
        any_continue: most[2] == 1,
    })
}

/// What one rank says after an attempt.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Said {
    pub(crate) outcome: RankOutcome,
    /// The size its policy would try next.
    pub(crate) proposal: Proposal,
    /// Whether its policy asks for another attempt after a success (a tuner, chunks).
    pub(crate) continues: bool,
}

/// What every rank learns from an exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Verdict {
    /// The most serious outcome of any rank.
    pub(crate) outcome: RankOutcome,
    /// The highest rank that failed with an error that is not out-of-memory.
    pub(crate) failed_rank: Option<usize>,
    pub(crate) smallest_proposal: Proposal,
    /// Whether every rank asked for another attempt.
    pub(crate) all_continue: bool,
    /// Whether any rank asked for another attempt.
    pub(crate) any_continue: bool,
}

impl Said {
    /// After an attempt that succeeded or ran out of memory, its policy having decided `own`.
    pub(crate) fn after_attempt(succeeded: bool, own: &Decision) -> Said {
        Said {
            outcome: if succeeded {
                RankOutcome::Succeeded
            } else {
                RankOutcome::OutOfMemory
            },
            proposal: match own {
                Decision::Try(size) => Proposal::Size(*size),
                _ if succeeded => Proposal::NoneNeeded,
                _ => Proposal::NoneLeft,
            },
            continues: matches!(own, Decision::Try(_)),
        }
    }
}

/// The first size every rank tries: the smallest of the ranks' `proposal`s (0: none).
pub(crate) fn agreed_start(collective: &dyn Collective, proposal: Proposal) -> Decision {
    let said = Said {
        outcome: RankOutcome::Succeeded,
        proposal,
        continues: true,
    };
    match round(collective, said) {
        Ok(verdict) => verdict
            .smallest_proposal
            .try_or(Decision::Stop(StopReason::Agreement(
                "a rank had no size to start from".to_owned(),
            ))),
        Err(error) => disagreement(&error),
    }
}

/// Tells the other ranks, waiting for this attempt's verdict, that it failed otherwise; what
/// they answer no longer matters here.
pub(crate) fn tell_failure(collective: &dyn Collective) {
    let said = Said {
        outcome: RankOutcome::Failed,
        proposal: Proposal::NoneLeft,
        continues: false,
    };
    let _ = round(collective, said);
}

impl Verdict {
    /// Whether every rank stops here: a rank ran out of memory with no smaller size left.
    pub(crate) fn all_stop(&self) -> bool {
        self.outcome == RankOutcome::OutOfMemory && self.smallest_proposal == Proposal::NoneLeft
    }

    /// The stop when a rank ran out of memory with no smaller size left: every rank stops.
    pub(crate) fn no_size_left(&self) -> Decision {
        Decision::Stop(StopReason::Agreement(
            "a rank ran out of memory and has no smaller size left".to_owned(),
        ))
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
