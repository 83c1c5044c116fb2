//! The policy of one chunked run: the next chunk after each success, a smaller one after an
//! out-of-memory chunk, growing back after clean chunks, and (with other ranks) chunks in step.

use std::sync::{Arc, Mutex};

use super::progress::{lock, Run};
use crate::agree::{self, Collective, Proposal, RankOutcome, Said};
use crate::error::StopReason;
use crate::policy::{holds_inner, Decision, PolicyWrapper, SizePolicy};
use crate::record::{Outcome, SearchReport};
use crate::runners::learn::{larger_budget, Convergence, GrowBack, SquareTerm};

/// The policy of one chunked run: the next chunk after a success, a smaller one after an OOM.
#[derive(Debug)]
pub(super) struct ChunkPolicy<'r, P> {
    pub(super) inner: P,
    /// The run's progress, lent by the runner; the chunks update it between decisions.
    pub(super) run: &'r Mutex<Run>,
    pub(super) grow: GrowBack,
    /// What the chunks measured, and the chunk the figures say fills the device.
    pub(super) convergence: Convergence,
    /// With a cost per item: the chunks' peaks against their shapes, for the square term.
    pub(super) square_term: Option<SquareTerm>,
    /// The larger chunk being tried, and the size that fitted before it.
    pub(super) probing: Option<(usize, usize)>,
    /// No chunk above this (`with_max`).
    pub(super) max: usize,
    /// The other ranks whose chunks run in step with these.
    pub(super) agreement: Option<Arc<dyn Collective + 'r>>,
}

impl<P: SizePolicy> PolicyWrapper for ChunkPolicy<'_, P> {
    holds_inner!(P);

    /// `Chunked` grows its chunks from their figures itself: `step_done` ends no chunk.
    fn grow_after_a_step(&self, _history: &SearchReport) -> Option<crate::policy::GrowRule> {
        None
    }

    /// After a chunk comes the next one: the engine must ask.
    fn accepts_every_success(&self) -> bool {
        false
    }

    fn first(&mut self, starting: usize) -> Decision {
        let Some(collective) = self.agreement.clone() else {
            return Decision::Try(starting);
        };
        // Every rank starts its first chunk at the smallest starting size of all.
        agree::agreed_start(&*collective, Proposal::Size(starting))
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let own = self.decide(history);
        match self.agreement.clone() {
            None => own,
            Some(collective) => self.agree(&*collective, history, own),
        }
    }

    fn ended_by_failure(&mut self, history: &SearchReport) {
        self.inner.ended_by_failure(history);
        if let Some(collective) = self.agreement.clone() {
            agree::tell_failure(&*collective);
        }
    }

    /// A chunk's size converges by its figures: one reading after it, no synchronize.
    fn reads_memory_after_success(&self) -> bool {
        self.convergence.is_enabled() || self.inner.reads_memory_after_success()
    }

    /// Each chunk holds other items: an earlier out-of-memory is no verdict on the next.
    fn agrees_with_others(&self) -> bool {
        self.agreement.is_some() || self.inner.agrees_with_others()
    }

    fn each_success_is_new_work(&self) -> bool {
        true
    }
}

impl<P: SizePolicy> ChunkPolicy<'_, P> {
    /// After a chunk that ran, with a cost per item: its peak against its shape; where the
    /// chunks say memory grows with a square term other than the one in use, the run's chunks
    /// cost by it from now on, and the next budget is what its line says fits.
    fn learn_square_term(&mut self, last: &crate::record::Attempt, items: usize) -> Option<usize> {
        let square_term = self.square_term.as_mut()?;
        let (peak, room) = (last.figures.peak?, last.figures.room?);
        let mut run = lock(self.run);
        let shapes = vec![(items, run.progress.current_longest)];
        let (from, budget) =
            square_term.observe(peak, room, shapes, run.progress.shape.square_from())?;
        run.progress.shape = run.progress.shape.with_square_from(from);
        // Sizes measured in the old unit bound nothing in the new one.
        self.convergence.forget();
        self.grow.forget_failures();
        Some(budget)
    }

    /// With other ranks: a chunk that ran out on any rank is redone smaller on every rank, so
    /// ranks stay in step; a rank that is done answers the others until they are done too.
    fn agree(
        &mut self,
        collective: &dyn Collective,
        history: &SearchReport,
        own: Decision,
    ) -> Decision {
        let succeeded = history
            .last()
            .is_some_and(|last| last.outcome == Outcome::Succeeded);
        let done = succeeded && own == Decision::Accept;
        let verdict = match agree::round(collective, Said::after_attempt(succeeded, &own)) {
            Ok(verdict) => verdict,
            Err(error) => return agree::disagreement(&error),
        };
        match verdict.outcome {
            RankOutcome::Failed => verdict.failed(),
            RankOutcome::OutOfMemory => {
                if succeeded {
                    self.take_back_last_chunk(history.last().map_or(0, |last| last.batch_size));
                }
                verdict
                    .smallest_proposal
                    .try_or(Decision::Stop(StopReason::Agreement(
                        "a rank ran out of memory on a chunk of one item".to_owned(),
                    )))
            }
            _ if !done => verdict.smallest_proposal.try_or(Decision::Accept),
            _ => {
                // Done here: answer the others' verdicts until every rank is done, or until
                // they all stop (one ran out of memory with no smaller chunk left).
                let mut verdict = verdict;
                while verdict.any_continue && !verdict.all_stop() {
                    let idle = Said {
                        outcome: RankOutcome::Succeeded,
                        proposal: Proposal::NoneNeeded,
                        continues: false,
                    };
                    verdict = match agree::round(collective, idle) {
                        Ok(verdict) if verdict.outcome == RankOutcome::Failed => {
                            return Decision::Accept
                        }
                        Ok(verdict) => verdict,
                        Err(error) => return agree::disagreement(&error),
                    };
                }
                Decision::Accept
            }
        }
    }

    /// This rank's last chunk succeeded but another rank's did not: it is redone.
    fn take_back_last_chunk(&mut self, size: usize) {
        self.grow.failed(size);
        let mut run = lock(self.run);
        let range = run.progress.current.clone();
        if run.progress.completed == range.end {
            run.progress.completed = range.start;
        }
        if let Some(record) = run.records.last_mut() {
            record.done = false;
        }
        run.retries += 1;
        tracing::info!(
            items = ?range,
            "chunk of items {range:?} is redone with the other ranks: one ran out of memory"
        );
    }

    /// This rank's own decision after a chunk.
    fn decide(&mut self, history: &SearchReport) -> Decision {
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        let (items, cost) = {
            let run = lock(self.run);
            (run.progress.current.len(), run.progress.current_cost)
        };
        // Memory goes with what the chunk held: its cost, not the budget it was packed to
        // (the last chunk of a run holds less).
        self.convergence
            .learn(last, usize::try_from(cost).unwrap_or(usize::MAX));
        let probed = self.probing.take();
        if last.outcome != Outcome::Succeeded {
            self.grow.failed(last.batch_size);
            if let Some((_, fitted)) = probed.filter(|&(probe, _)| probe == last.batch_size) {
                // A larger chunk than the figures had seen run did not fit: the size that
                // fitted, at once.
                return Decision::Try(fitted);
            }
            if items <= 1 {
                // Every budget packs this one item: no smaller chunk exists.
                // (The run says which item: `ChunkError::ItemTooLarge`.)
                return Decision::Stop(StopReason::ReachedZero);
            }
            // A budget that packs the same items again would fail again: below their cost.
            let below = usize::try_from(cost.saturating_sub(1)).unwrap_or(usize::MAX);
            return match self.inner.after(history) {
                // A rule that does not shrink stops, as in every search: clamping it below
                // the items' cost would walk down one item at a time.
                Decision::Try(budget) if budget >= last.batch_size => {
                    Decision::Stop(StopReason::NotSmaller {
                        failed: last.batch_size,
                        proposed: budget,
                    })
                }
                Decision::Try(budget) => Decision::Try(budget.min(below).max(1)),
                // Two budgets that packed the same items look like memory that does not depend
                // on the size; for chunks it is the items' own: halve instead.
                Decision::Stop(StopReason::FixedMemoryDoesNotFit { .. }) => {
                    Decision::Try((last.batch_size / 2).min(below).max(1))
                }
                other => other,
            };
        }
        let done = {
            let run = lock(self.run);
            run.progress.completed >= run.progress.total
        };
        if done {
            return Decision::Accept;
        }
        if let Some(budget) = self.learn_square_term(last, items) {
            return Decision::Try(budget.min(self.max));
        }
        self.convergence.advance();
        let grown = self.grow.succeeded(last.batch_size);
        // With figures the fit decides; doubling is for runs without. Figures that make no fit
        // yet (chunks too alike in cost to draw a line) are no licence to double blind.
        let Some(limit) = self.convergence.limit() else {
            let measured = self.convergence.is_enabled() && last.figures.peak.is_some();
            return Decision::Try(if measured { last.batch_size } else { grown });
        };
        // The fit's edge is where rounding decides (a cost's integer square term, an
        // allocator's blocks): 1 % kept back.
        let limit = limit - limit / 100;
        match larger_budget(limit, last.batch_size).map(|limit| limit.min(self.max)) {
            Some(probe) if probe > last.batch_size => {
                self.probing = Some((probe, last.batch_size));
                Decision::Try(probe)
            }
            _ => Decision::Try(last.batch_size),
        }
    }
}
