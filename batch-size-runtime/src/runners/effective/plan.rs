//! How one optimizer step's samples are divided: this rank's share of the batch, and the
//! micro-batches it runs that share in.

use std::ops::Range;
use std::sync::Arc;

use crate::runners::split::{even_micro, Packing};

/// How one optimizer step's `effective` samples are divided: this rank's share of them (all of
/// them, unless the ranks split one global batch with
/// [`with_uneven_shares`](crate::EffectiveBatch::with_uneven_shares)), run in
/// [`accumulation()`](Self::accumulation) micro-batches of at most [`micro()`](Self::micro)
/// samples.
///
/// The micro-batches are as even as they can be: the fewest passes of at most the size asked
/// for, then sizes that differ by at most one (10 samples at 4 run 4 + 3 + 3, not 4 + 4 + 2;
/// 256 at 212 run 128 + 128, not 212 + 44). The number of passes is the same, the peak is
/// lower, and no ragged last batch skews batch statistics.
///
/// Each [`MicroBatch`]'s `weight` is its length over `effective`, the whole batch: summing the
/// weighted mean losses of the micro-batches gives exactly the mean loss of the batch, so the
/// accumulated gradient does not depend on the micro size, nor (with shares) on how the batch
/// was divided between ranks: a SUM all-reduce of the ranks' weighted gradients is the whole
/// batch's gradient.
///
/// What it cannot make exact:
/// - batch normalization computes its statistics per micro-batch: use layer or group norm,
///   synchronize the statistics, or accept that they change with the micro size;
/// - a loss that is a sum, not a mean, needs weight 1 for every micro-batch (sum the losses as
///   they are); any other reduction, rescale it to the whole batch yourself.
///
/// ```
/// use batch_size_runtime::BatchPlan;
///
/// let plan = BatchPlan::new(10, 4);
/// assert_eq!((plan.effective(), plan.micro(), plan.accumulation()), (10, 4, 3));
/// let ranges: Vec<_> = plan.micro_batches().map(|micro| micro.range).collect();
/// assert_eq!(ranges, [0..4, 4..7, 7..10]);
/// let weights: f64 = plan.micro_batches().map(|micro| micro.weight).sum();
/// assert!((weights - 1.0).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPlan {
    effective: usize,
    share_start: usize,
    share_end: usize,
    /// The largest micro-batch.
    micro: usize,
    passes: usize,
    /// Items of different cost, grouped by cost and packed to a budget
    /// ([`EffectiveBatch::step_by_cost`](crate::EffectiveBatch::step_by_cost)).
    packed: Option<Arc<Packed>>,
}

/// The micro-batches of a plan by cost: each one's items, its padded cost and its weight.
#[derive(Debug, PartialEq)]
struct Packed {
    micro_batches: Vec<(Vec<usize>, u64, f64)>,
    /// The budget the micro-batches were packed to (the costliest one's cost).
    budget: usize,
}

/// One micro-batch of a [`BatchPlan`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MicroBatch {
    /// Its position in the step, from 0.
    pub index: usize,
    /// The samples of the batch it holds (indices into the whole batch, within this rank's
    /// share). Empty in a plan by cost, whose micro-batches are not contiguous: use `items`.
    pub range: Range<usize>,
    /// The samples it holds: `range`'s, or in a plan by cost the items grouped with it (the
    /// costliest first), indices into the step's items.
    pub items: Vec<usize>,
    /// What it costs: its samples, or in a plan by cost its padded cost
    /// ([`BatchCost::of`](crate::BatchCost::of)).
    pub cost: u64,
    /// The factor of its mean loss: its samples over the whole batch's (`effective`), or in a
    /// plan by cost its items' cost over the step's (a token-mean loss), unless the
    /// [`BatchCost`](crate::BatchCost) weighs by samples.
    pub weight: f64,
}

impl BatchPlan {
    /// The plan for `effective` samples in micro-batches of at most `micro`, split evenly.
    /// `micro` is held to `1..=effective` (a micro-batch larger than the batch is the batch);
    /// an `effective` of 0 has no micro-batches.
    ///
    /// ```
    /// use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(8, 64).micro(), 8);
    /// assert_eq!(BatchPlan::new(256, 212).micro(), 128); // two passes either way
    /// assert_eq!(BatchPlan::new(0, 4).accumulation(), 0);
    /// ```
    pub fn new(effective: usize, micro: usize) -> Self {
        BatchPlan::for_share(effective, 0..effective, micro)
    }

    /// The plan of one rank whose share of a batch of `effective` samples is `share`, run in
    /// micro-batches of at most `micro`, split evenly. `share` is held within `0..effective`.
    ///
    /// ```
    /// use batch_size_runtime::BatchPlan;
    /// let plan = BatchPlan::for_share(256, 100..160, 32);
    /// let micro: Vec<_> = plan.micro_batches().map(|micro| micro.range).collect();
    /// assert_eq!(micro, [100..130, 130..160]); // two passes of at most 32: 30 + 30
    /// let weights: f64 = plan.micro_batches().map(|micro| micro.weight).sum();
    /// assert!((weights - 60.0 / 256.0).abs() < 1e-12); // the share's part of the batch
    /// ```
    pub fn for_share(effective: usize, share: Range<usize>, micro: usize) -> Self {
        let share_start = share.start.min(effective);
        let share_end = share.end.clamp(share_start, effective);
        let length = share_end - share_start;
        let asked = micro.clamp(1, length.max(1));
        let passes = length.div_ceil(asked);
        BatchPlan {
            effective,
            share_start,
            share_end,
            micro: if passes == 0 {
                asked
            } else {
                even_micro(length, asked)
            },
            passes,
            packed: None,
        }
    }

    /// The plan of one step over items of different cost, packed at `budget` (after
    /// [`Split::realize`](crate::runners::split::Split::realize)), in exactly `passes`
    /// micro-batches where the ranks agreed on a count.
    pub(crate) fn by_cost(packing: &Packing, budget: usize, passes: Option<usize>) -> Self {
        let costs = packing.costs();
        let shape = packing.shape();
        let total: u64 = costs
            .iter()
            .fold(0u64, |sum, &cost| sum.saturating_add(cost));
        let items = costs.len();
        let micro_batches: Vec<(Vec<usize>, u64, f64)> = packing
            .micro_batches(budget as u64, passes)
            .into_iter()
            .map(|(group, cost)| {
                let weight = if group.is_empty() {
                    0.0
                } else if shape.by_samples() || total == 0 {
                    group.len() as f64 / items as f64
                } else {
                    group.iter().map(|&item| costs[item] as f64).sum::<f64>() / total as f64
                };
                (group, cost, weight)
            })
            .collect();
        BatchPlan {
            effective: items,
            share_start: 0,
            share_end: items,
            micro: micro_batches
                .iter()
                .map(|(group, _, _)| group.len())
                .max()
                .unwrap_or(0),
            passes: micro_batches.len(),
            packed: Some(Arc::new(Packed {
                budget: micro_batches
                    .iter()
                    .map(|&(_, cost, _)| cost)
                    .max()
                    .map_or(budget, |cost| usize::try_from(cost).unwrap_or(usize::MAX)),
                micro_batches,
            })),
        }
    }

    /// The size the step's search ran: [`micro()`](Self::micro), or in a plan by cost the
    /// costliest micro-batch's cost (the budget).
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 40).budget(), 32);
    /// ```
    pub fn budget(&self) -> usize {
        self.packed
            .as_ref()
            .map_or(self.micro, |packed| packed.budget)
    }

    /// Samples in the optimizer step: the whole batch, every rank's share together.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 32).effective(), 96);
    /// ```
    pub fn effective(&self) -> usize {
        self.effective
    }

    /// The samples of the batch this rank runs: `0..effective` unless the ranks share one
    /// global batch.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 32).share(), 0..96);
    /// assert_eq!(BatchPlan::for_share(96, 40..96, 32).share(), 40..96);
    /// ```
    pub fn share(&self) -> Range<usize> {
        self.share_start..self.share_end
    }

    /// Samples in the largest micro-batch; the others hold the same or one fewer.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(96, 32).micro(), 32);
    /// assert_eq!(BatchPlan::new(256, 121).micro(), 86); // 86 + 85 + 85
    /// ```
    pub fn micro(&self) -> usize {
        self.micro
    }

    /// How many micro-batches the step runs: the share over the size asked for, rounded up.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// assert_eq!(BatchPlan::new(100, 32).accumulation(), 4);
    /// ```
    pub fn accumulation(&self) -> usize {
        self.passes
    }

    /// The micro-batches, in order: their ranges cover the share exactly once, and their
    /// lengths differ by at most one.
    ///
    /// ```
    /// # use batch_size_runtime::BatchPlan;
    /// let last = BatchPlan::new(10, 4).micro_batches().last().unwrap();
    /// assert_eq!((last.index, last.range, last.weight), (2, 7..10, 0.3));
    /// ```
    pub fn micro_batches(&self) -> impl ExactSizeIterator<Item = MicroBatch> + '_ {
        let packed = self.packed.as_deref();
        let even = if packed.is_none() { self.passes } else { 0 };
        let by_cost = packed.into_iter().flat_map(|packed| {
            packed
                .micro_batches
                .iter()
                .enumerate()
                .map(|(index, (items, cost, weight))| MicroBatch {
                    index,
                    range: 0..0,
                    items: items.clone(),
                    cost: *cost,
                    weight: *weight,
                })
        });
        let length = self.share_end - self.share_start;
        let passes = self.passes.max(1);
        // The first `longer` micro-batches hold one sample more than the rest.
        let (shorter, longer) = (length / passes, length % passes);
        let start = self.share_start;
        let effective = self.effective as f64;
        let even = (0..even).map(move |index| {
            let from = start + index * shorter + index.min(longer);
            let to = from + shorter + usize::from(index < longer);
            MicroBatch {
                index,
                range: from..to,
                items: (from..to).collect(),
                cost: (to - from) as u64,
                weight: (to - from) as f64 / effective,
            }
        });
        ExactLength {
            inner: even.chain(by_cost),
            left: self.passes,
        }
    }
}

/// An iterator whose length is known: the plan's passes (a chain of two is not
/// `ExactSizeIterator`).
struct ExactLength<I> {
    inner: I,
    left: usize,
}

impl<I: Iterator> Iterator for ExactLength<I> {
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        let next = self.inner.next();
        self.left = self.left.saturating_sub(usize::from(next.is_some()));
        next
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<I: Iterator> ExactSizeIterator for ExactLength<I> {}

#[cfg(test)]
mod tests {
    use super::BatchPlan;

    #[test]
    fn micro_batches_cover_the_share_once_evenly() {
        for effective in [1usize, 7, 64, 100, 256, 1000] {
            for (start, end) in [(0, effective), (effective / 3, effective * 2 / 3)] {
                for micro in [1usize, 3, 16, 121, 212, 5000] {
                    let plan = BatchPlan::for_share(effective, start..end, micro);
                    let ranges: Vec<_> = plan.micro_batches().map(|m| m.range).collect();
                    let mut next = start;
                    for range in &ranges {
                        assert_eq!(range.start, next);
                        next = range.end;
                    }
                    assert_eq!(next, end);
                    let lengths: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
                    if let (Some(max), Some(min)) = (lengths.iter().max(), lengths.iter().min()) {
                        assert!(max - min <= 1 && *max == plan.micro() && *max <= micro);
                        assert_eq!(
                            plan.accumulation(),
                            (end - start).div_ceil(micro.min(end - start))
                        );
                    }
                }
            }
        }
    }
}
