//! Even micro-batches: the same number of passes, a lower peak, no ragged last batch (256 at 212
//! runs 128 + 128). [`EvenSplit`] makes the engine try and record the size that really runs.

use crate::policy::{holds_inner, Decision, PolicyWrapper, SizePolicy};
use crate::record::SearchReport;
pub(crate) use crate::runners::learn::even_micro;

/// A size policy proposing the even split of `inner`'s proposal, for a share of `length` samples.
#[derive(Debug)]
pub(crate) struct EvenSplit<P> {
    inner: P,
    length: usize,
    /// Below it, a proposal is kept as it is: the engine's `min` judges what was proposed.
    min: usize,
}

impl<P: SizePolicy> EvenSplit<P> {
    pub(crate) fn new(inner: P, length: usize, min: usize) -> Self {
        EvenSplit { inner, length, min }
    }

    fn even(&self, decision: Decision) -> Decision {
        match decision {
            Decision::Try(size) => {
                let even = even_micro(self.length, size);
                // An even split below the floor would turn a legal proposal into a refused
                // one: run the proposal (the plan still splits it evenly).
                Decision::Try(if even < self.min && size >= self.min {
                    size
                } else {
                    even
                })
            }
            other => other,
        }
    }
}

impl<P: SizePolicy> PolicyWrapper for EvenSplit<P> {
    holds_inner!(P);

    fn first(&mut self, starting: usize) -> Decision {
        let first = self.inner.first(starting);
        self.even(first)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let next = self.inner.after(history);
        self.even(next)
    }
}

#[cfg(test)]
mod tests {
    use super::even_micro;

    #[test]
    fn the_fewest_passes_split_evenly() {
        assert_eq!(even_micro(256, 212), 128);
        assert_eq!(even_micro(256, 121), 86);
        assert_eq!(even_micro(256, 256), 256);
        assert_eq!(even_micro(256, 1000), 256);
        assert_eq!(even_micro(100, 33), 25);
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
