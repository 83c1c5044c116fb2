//! [`Agree`]: a size policy wrapper that turns this rank's decision into the one every rank
//! takes, one round of the agreement after each attempt.

use super::collective::Collective;
use super::verdict::{
    agreed_start, disagreement, round, tell_failure, Proposal, RankOutcome, Said, Verdict,
};
use crate::policy::{holds_inner, Decision, PolicyWrapper, SizePolicy};
use crate::record::SearchReport;

/// Which size each rank tries after an attempt that ran out of memory somewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sizes {
    /// The same on every rank: the smallest proposal (one plan shared by every rank).
    Smallest,
    /// Each rank its own: a rank that ran out of memory tries its policy's next size, the
    /// others the size they just ran (ranks that split one batch into shares of their own).
    Own,
}

/// Makes every rank's search agree with the others' (see the [module docs](super)).
#[derive(Debug)]
pub struct Agree<P, C> {
    inner: P,
    collective: C,
    sizes: Sizes,
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
            sizes: Sizes::Smallest,
            overruled: None,
        }
    }

    /// Agrees on the outcome only: if any rank ran out of memory, every rank redoes the
    /// attempt, the ranks that ran out of memory at their policy's next size and the others at
    /// the size they just ran. For ranks whose sizes differ by design (shares of one global
    /// batch on mixed GPUs).
    pub(crate) fn own_sizes(inner: P, collective: C) -> Self {
        Agree {
            sizes: Sizes::Own,
            ..Agree::new(inner, collective)
        }
    }
}

impl<P: SizePolicy, C: Collective> Agree<P, C> {
    /// The verdict when every rank keeps its own size; `ran` is the size this rank just ran
    /// when it succeeded.
    fn own_size(&mut self, verdict: &Verdict, own: Decision, ran: Option<usize>) -> Decision {
        self.overruled = None;
        match verdict.outcome {
            RankOutcome::Failed => verdict.failed(),
            _ if verdict.all_stop() => verdict.no_size_left(),
            RankOutcome::OutOfMemory => match ran {
                // Another rank ran out of memory: the attempt is one step of every rank, so
                // this rank redoes it too, at the size that fitted here.
                Some(size) => {
                    self.overruled = Some(format!(
                        "another rank ran out of memory: this rank redoes the step at {size}, \
                         which fitted"
                    ));
                    Decision::Try(size)
                }
                None => own,
            },
            _ if verdict.all_continue => own,
            _ => match own {
                Decision::Try(_) => Decision::Accept,
                other => other,
            },
        }
    }
}

impl<P: SizePolicy, C: Collective> PolicyWrapper for Agree<P, C> {
    holds_inner!(P);

    /// Every attempt ends with a round of the agreement, successes too: the engine must ask.
    /// Every size is the ranks' verdict.
    fn agrees_with_others(&self) -> bool {
        true
    }

    /// No growing after a step under an agreement: each rank measures its own step and would
    /// grow on its own, and a rank that grew would leave the others waiting in the agreement's
    /// round. Every rank keeps the agreed size.
    fn grow_after_a_step(&self, _history: &SearchReport) -> Option<crate::policy::GrowRule> {
        None
    }

    fn accepts_every_success(&self) -> bool {
        false
    }

    fn first(&mut self, starting: usize) -> Decision {
        if self.sizes == Sizes::Own {
            return self.inner.first(starting);
        }
        let proposal = match self.inner.first(starting) {
            Decision::Try(size) => Proposal::Size(size),
            _ => Proposal::NoneLeft,
        };
        agreed_start(&self.collective, proposal)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let last = history.last();
        let succeeded = last.is_some_and(|last| last.outcome.is_success());
        let own = self.inner.after(history);
        let said = Said::after_attempt(succeeded, &own);
        let proposal = said.proposal;
        let verdict = match round(&self.collective, said) {
            Ok(verdict) => verdict,
            Err(error) => return disagreement(&error),
        };
        if self.sizes == Sizes::Own {
            return self.own_size(
                &verdict,
                own,
                last.filter(|_| succeeded).map(|l| l.batch_size),
            );
        }
        self.overruled = (verdict.outcome != RankOutcome::Succeeded
            && verdict.smallest_proposal != proposal
            && verdict.smallest_proposal != Proposal::NoneLeft)
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
            RankOutcome::Failed => verdict.failed(),
            _ if verdict.all_stop() => verdict.no_size_left(),
            // Every rank retries at the same size, the ones that succeeded too: the attempt
            // is one step of the same training on every rank.
            RankOutcome::OutOfMemory => verdict.smallest_proposal.try_or(verdict.no_size_left()),
            // Everyone succeeded and every policy asks for more (a tuner, chunks): go on
            // together, at the smallest proposal.
            _ if verdict.all_continue => verdict.smallest_proposal.try_or(Decision::Accept),
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

    fn rationale(&self) -> Option<String> {
        self.overruled.clone().or_else(|| self.inner.rationale())
    }
}
