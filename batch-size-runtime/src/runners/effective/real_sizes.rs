//! The size that really runs: 256 samples at 212 run 128 + 128 (the same passes, a lower peak,
//! no ragged last batch), and items packed by cost at a budget run their costliest micro-batch.
//! [`RealSizes`] makes the engine try and record that size, so that what the model learns is
//! the memory of what ran.

use crate::error::StopReason;
use crate::policy::{holds_inner, Decision, PolicyWrapper, SizePolicy};
use crate::record::SearchReport;
use crate::runners::split::Split;

/// A size policy proposing the size that runs of `inner`'s proposal, for one step's `split`.
#[derive(Debug)]
pub(crate) struct RealSizes<P> {
    inner: P,
    split: Split,
    /// Below it, a proposal is kept as it is: the engine's `min` judges what was proposed.
    min: usize,
}

impl<P: SizePolicy> RealSizes<P> {
    pub(crate) fn new(inner: P, split: Split, min: usize) -> Self {
        RealSizes { inner, split, min }
    }

    fn real(&self, decision: Decision) -> Decision {
        match decision {
            // Below the floor (a cost budget below the costliest item alone): the engine
            // refuses it with its own reason, as it refuses any size below `min`.
            Decision::Try(size) if size < self.min => Decision::Try(size),
            Decision::Try(size) => {
                let real = self.split.realize(size);
                // A real size below the floor would turn a legal proposal into a refused one:
                // run the proposal (the plan still divides it as it runs).
                Decision::Try(if real < self.min { size } else { real })
            }
            other => other,
        }
    }
}

impl<P: SizePolicy> PolicyWrapper for RealSizes<P> {
    holds_inner!(P);

    fn first(&mut self, starting: usize) -> Decision {
        let first = self.inner.first(starting);
        self.real(first)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        // Items by cost, each in a micro-batch of its own, ran out of memory: one of them does
        // not fit alone, and the costliest is one that does not (memory grows with the cost).
        if let (Split::ByCost(packing), Some(last)) = (&self.split, history.last()) {
            if let Some((item, cost)) = packing.costliest() {
                if last.outcome.is_out_of_memory()
                    && packing.passes(last.batch_size as u64) == packing.len()
                {
                    return Decision::Stop(StopReason::ItemDoesNotFit { item, cost });
                }
            }
        }
        let next = self.inner.after(history);
        self.real(next)
    }
}

#[cfg(test)]
mod tests {
    use crate::runners::split::even_micro;

    #[test]
    fn the_fewest_passes_split_evenly() {
        assert_eq!(even_micro(256, 212), 128);
        assert_eq!(even_micro(256, 121), 86);
        assert_eq!(even_micro(256, 256), 256);
        assert_eq!(even_micro(256, 1000), 256);
        assert_eq!(even_micro(100, 33), 25);
        assert_eq!(even_micro(1024, 237), 205);
        assert_eq!(even_micro(7, 1), 1);
        assert_eq!(even_micro(0, 4), 4);
        assert_eq!(even_micro(9, 0), 0);
    }

    #[test]
    fn the_even_split_never_exceeds_the_size_nor_adds_a_pass() {
        for length in 1..200 {
            for size in 1..=length + 3 {
                let even = even_micro(length, size);
                assert!(even <= size && even >= 1, "{length} at {size}: {even}");
                assert_eq!(
                    length.div_ceil(even),
                    length.div_ceil(size.min(length)),
                    "{length} at {size}"
                );
            }
        }
    }
}
