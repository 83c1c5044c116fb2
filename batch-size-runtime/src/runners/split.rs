//! How one step's work divides at a size: `n` samples in even micro-batches, or items of
//! different cost (tokens) grouped by cost and packed to a budget. The size the engine searches
//! and the model learns is the largest micro-batch in the unit the work costs by: samples, or
//! what a batch of items costs ([`BatchCost`]).

use std::ops::Range;
use std::sync::Arc;

/// What a batch of items of different cost (sequences of different lengths, say) costs in
/// memory, as the framework allocates it: every item padded to the longest, so `items ×
/// longest`, plus a square term where the step has one (attention).
///
/// Each item's cost is the user's unit, usually its length in tokens. The batch's cost is the
/// unit the runners size by: a budget of cost is what the search finds, the model learns the
/// memory per unit of it from the steps that ran, and the items are grouped by cost (the
/// longest together) and packed to the budget, so that padding stays small.
///
/// ```
/// use batch_size_runtime::BatchCost;
///
/// let padded = BatchCost::padded();
/// assert_eq!(padded.of(16, 200), 3_200); // 16 sequences padded to 200 tokens
/// // Attention's square term: a sequence of 512 costs as much again as its tokens.
/// let attention = BatchCost::padded().with_square_term(512);
/// assert_eq!(attention.of(4, 512), 4 * 512 + 4 * 512 * 512 / 512);
/// assert_eq!(attention.of(4, 4_096), 4 * 4_096 + 4 * 4_096 * 4_096 / 512);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCost {
    /// The item cost at which the square term equals the linear one (`None`: no square term).
    square_from: Option<u64>,
    /// Micro-batches weighted by their share of samples, not of cost.
    by_samples: bool,
}

impl Default for BatchCost {
    fn default() -> Self {
        BatchCost::padded()
    }
}

impl BatchCost {
    /// Items padded to the longest: a batch of `n` items whose costliest costs `c` costs `n × c`
    /// (fairseq's and lhotse's token budget, padding counted). Micro-batches are weighted by
    /// their share of the cost (tokens), as a token-mean loss needs.
    pub fn padded() -> Self {
        BatchCost {
            square_from: None,
            by_samples: false,
        }
    }

    /// Adds a term in the square of the longest item, as attention's scores allocate: a batch
    /// of `n` items whose costliest costs `c` costs `n × c + n × c² / from`. `from` is the cost
    /// where the two terms are equal (lhotse's `quadratic_duration`): for a transformer whose
    /// attention scores are materialized, about the hidden size over the number of heads
    /// times the bytes of a score over those of an activation; where unsure, the smaller
    /// `from` is the safer one. A `from` of 0 is taken as 1. [`EffectiveBatch::step_by_cost`]
    /// and [`Chunked`](crate::Chunked) start from it and learn the one their peaks follow
    /// (with a release that reads figures).
    ///
    /// [`EffectiveBatch::step_by_cost`]: crate::EffectiveBatch::step_by_cost
    pub fn with_square_term(mut self, from: u64) -> Self {
        self.square_from = Some(from.max(1));
        self
    }

    /// Weights each micro-batch by its share of the samples (a sample-mean loss), not of the
    /// cost (a token-mean loss, the default).
    pub fn weighted_by_samples(mut self) -> Self {
        self.by_samples = true;
        self
    }

    /// The cost where the square term equals the linear one (`None`: no square term).
    pub(crate) fn square_from(&self) -> Option<u64> {
        self.square_from
    }

    /// The same, with the square term from `from` (`None`: none).
    pub(crate) fn with_square_from(mut self, from: Option<u64>) -> Self {
        self.square_from = from.map(|from| from.max(1));
        self
    }

    /// The unit a budget of this cost is in, for a cache's key: a budget kept under another
    /// square term is in another unit.
    pub(crate) fn unit(&self) -> String {
        match self.square_from {
            None => "padded".to_owned(),
            Some(from) => format!("padded with a square term from {from}"),
        }
    }

    /// Whether micro-batches are weighted by their share of samples.
    pub(crate) fn by_samples(&self) -> bool {
        self.by_samples
    }

    /// The cost of a batch of `items` whose costliest item costs `longest` (saturating).
    pub fn of(&self, items: usize, longest: u64) -> u64 {
        let items = items as u64;
        let linear = items.saturating_mul(longest);
        match self.square_from {
            None => linear,
            Some(from) => {
                let square = (u128::from(longest) * u128::from(longest))
                    .saturating_mul(u128::from(items))
                    / u128::from(from);
                linear.saturating_add(u64::try_from(square).unwrap_or(u64::MAX))
            }
        }
    }
}

/// Items grouped by cost and packed to a budget: the costliest first (an out-of-memory comes
/// with the first micro-batch, not the last), each micro-batch the costliest items left while
/// their padded cost fits. Packing items sorted by cost this way makes the fewest micro-batches
/// any grouping can: a group's cost only falls when items leave it.
#[derive(Debug, Clone)]
pub(crate) struct Packing {
    costs: Arc<[u64]>,
    /// Item indices, the costliest first (ties in the caller's order).
    order: Vec<usize>,
    shape: BatchCost,
}

impl Packing {
    pub(crate) fn new(costs: Arc<[u64]>, shape: BatchCost) -> Self {
        let mut order: Vec<usize> = (0..costs.len()).collect();
        order.sort_by(|&a, &b| costs[b].cmp(&costs[a]));
        Packing {
            costs,
            order,
            shape,
        }
    }

    pub(crate) fn costs(&self) -> &[u64] {
        &self.costs
    }

    pub(crate) fn shape(&self) -> BatchCost {
        self.shape
    }

    /// Items in the work.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// The costliest item and its cost alone: no budget below it runs the work.
    pub(crate) fn costliest(&self) -> Option<(usize, u64)> {
        let item = *self.order.first()?;
        Some((item, self.shape.of(1, self.costs[item])))
    }

    /// The cost of every item in one batch.
    pub(crate) fn whole(&self) -> u64 {
        self.order
            .first()
            .map_or(0, |&item| self.shape.of(self.len(), self.costs[item]))
    }

    /// The groups `budget` makes, as ranges of the order (costliest first): at least one item each.
    fn groups(&self, budget: u64) -> Vec<Range<usize>> {
        let mut groups = Vec::new();
        let mut start = 0;
        while start < self.order.len() {
            let longest = self.costs[self.order[start]];
            let mut end = start + 1;
            while end < self.order.len() && self.shape.of(end + 1 - start, longest) <= budget {
                end += 1;
            }
            groups.push(start..end);
            start = end;
        }
        groups
    }

    /// Micro-batches at `budget`.
    pub(crate) fn passes(&self, budget: u64) -> usize {
        self.groups(budget).len()
    }

    /// The cost of the costliest of `groups`.
    fn peak_of(&self, groups: &[Range<usize>]) -> u64 {
        groups
            .iter()
            .map(|group| {
                self.shape
                    .of(group.len(), self.costs[self.order[group.start]])
            })
            .max()
            .unwrap_or(0)
    }

    /// The cost of the costliest micro-batch at `budget`: the budget's own, or an item's
    /// alone where it costs more.
    pub(crate) fn peak(&self, budget: u64) -> u64 {
        self.peak_of(&self.groups(budget))
    }

    /// The smallest budget that makes as few micro-batches as `budget`: the same passes, with
    /// the lowest peak.
    pub(crate) fn realize(&self, budget: u64) -> u64 {
        let passes = self.passes(budget);
        let (mut low, mut high) = (1, budget.max(1));
        // Passes only fall as the budget grows: the smallest budget with `passes` passes.
        while low < high {
            let middle = low + (high - low) / 2;
            if self.passes(middle) <= passes {
                high = middle;
            } else {
                low = middle + 1;
            }
        }
        high
    }

    /// Exactly `passes` groups (the count every rank of an agreement runs), none costlier than
    /// `budget`'s: the smallest budget that needs no more, then the groups with the most items
    /// halved until there are `passes` (a half costs no more than its whole). A rank with fewer
    /// items than `passes` ends with empty groups.
    fn groups_in(&self, budget: u64, passes: usize) -> Vec<Range<usize>> {
        let mut groups = self.groups(self.realize(budget));
        if groups.len() > passes {
            return groups;
        }
        while groups.len() < passes {
            let widest = (0..groups.len()).max_by_key(|&index| groups[index].len());
            match widest {
                Some(index) if groups[index].len() > 1 => {
                    let group = groups[index].clone();
                    let middle = group.start + group.len() / 2;
                    groups[index] = group.start..middle;
                    groups.insert(index + 1, middle..group.end);
                }
                _ => groups.push(self.order.len()..self.order.len()),
            }
        }
        groups
    }

    /// The micro-batches at `budget` (after [`realize`](Self::realize)), or exactly `passes` of
    /// them no costlier: each one's items (the costliest first) and its padded cost.
    pub(crate) fn micro_batches(
        &self,
        budget: u64,
        passes: Option<usize>,
    ) -> Vec<(Vec<usize>, u64)> {
        let groups = match passes {
            None => self.groups(budget),
            Some(passes) => self.groups_in(budget, passes),
        };
        groups
            .into_iter()
            .filter(|group| !group.is_empty() || passes.is_some())
            .map(|group| {
                if group.is_empty() {
                    return (Vec::new(), 0);
                }
                let cost = self
                    .shape
                    .of(group.len(), self.costs[self.order[group.start]]);
                (self.order[group].to_vec(), cost)
            })
            .collect()
    }
}

/// How a step's work divides at a size.
#[derive(Debug, Clone)]
pub(crate) enum Split {
    /// `length` samples in even micro-batches of at most the size.
    Even(usize),
    /// Items packed by cost to a budget.
    ByCost(Arc<Packing>),
}

impl Split {
    /// The size that runs everything at once.
    pub(crate) fn whole(&self) -> usize {
        match self {
            Split::Even(length) => *length,
            Split::ByCost(packing) => saturating_usize(packing.whole()),
        }
    }

    /// The micro-batches `size` runs.
    pub(crate) fn passes(&self, size: usize) -> usize {
        match self {
            Split::Even(length) => length.div_ceil(size.clamp(1, (*length).max(1))),
            Split::ByCost(packing) => packing.passes(size as u64),
        }
    }

    /// The size that really runs for `size`: the same passes, the smallest largest
    /// micro-batch. A size of 0, or an empty step, is returned as it is.
    pub(crate) fn realize(&self, size: usize) -> usize {
        match self {
            Split::Even(length) => even_micro(*length, size),
            Split::ByCost(packing) if size == 0 || packing.len() == 0 => size,
            Split::ByCost(packing) => saturating_usize(packing.realize(size as u64)),
        }
    }

    /// What the costliest micro-batch at `size` costs: the size itself by count, and by cost
    /// the budget's own or an item's alone where it costs more. The memory a step needs grows
    /// with it: what the model learns against.
    pub(crate) fn peak(&self, size: usize) -> usize {
        match self {
            Split::Even(_) => size,
            Split::ByCost(packing) => saturating_usize(packing.peak(size as u64)),
        }
    }
}

fn saturating_usize(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// The largest micro-batch when `length` samples run in the fewest passes of at most `size`,
/// split evenly: at most `size`, and `length` itself when `size` covers it. A `size` or a
/// `length` of 0 is returned as it is (the engine refuses a size of 0 with its own reason).
pub(crate) fn even_micro(length: usize, size: usize) -> usize {
    if length == 0 || size == 0 {
        return size;
    }
    let passes = length.div_ceil(size.min(length));
    length.div_ceil(passes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packing(costs: &[u64], shape: BatchCost) -> Packing {
        Packing::new(costs.iter().copied().collect(), shape)
    }

    #[test]
    fn items_are_grouped_by_cost_and_every_item_runs_once() {
        let costs = [300, 8_000, 250, 300, 4_000, 120, 7_900];
        let packing = packing(&costs, BatchCost::padded());
        let groups = packing.micro_batches(16_000, None);
        let mut seen: Vec<usize> = groups.iter().flat_map(|(items, _)| items.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..costs.len()).collect::<Vec<_>>());
        // The two long ones together, the medium one with nothing longer, the short ones last.
        assert_eq!(groups[0].0, [1, 6]);
        assert!(groups.iter().all(|(_, cost)| *cost <= 16_000));
        assert_eq!(groups.len(), 3);
    }

    #[test]
    fn the_realized_budget_keeps_the_passes_and_lowers_the_peak() {
        let costs: Vec<u64> = (0..64).map(|i| 100 + (i * 37) % 900).collect();
        for shape in [
            BatchCost::padded(),
            BatchCost::padded().with_square_term(256),
        ] {
            let packing = packing(&costs, shape);
            for budget in [2_000u64, 5_000, 12_345, 60_000, 1_000_000] {
                let real = packing.realize(budget);
                assert!(real <= budget);
                assert_eq!(packing.passes(real), packing.passes(budget));
                assert_eq!(packing.realize(real), real, "realizing is idempotent");
            }
        }
    }

    #[test]
    fn a_budget_below_the_costliest_item_runs_it_alone_and_packs_the_rest() {
        let packing = packing(&[50, 10, 10], BatchCost::padded());
        assert_eq!(packing.costliest(), Some((0, 50)));
        assert_eq!(packing.passes(1), 3);
        assert_eq!(packing.passes(20), 2);
        assert_eq!(packing.realize(40), 20);
        assert_eq!(packing.peak(20), 50);
        assert_eq!(Split::ByCost(Arc::new(packing)).peak(20), 50);
    }

    #[test]
    fn a_count_of_passes_is_met_exactly_and_never_costs_more() {
        let costs = [300, 8_000, 250, 300, 4_000, 120, 7_900];
        let packing = packing(&costs, BatchCost::padded());
        for passes in 3..=9 {
            let groups = packing.micro_batches(16_000, Some(passes));
            assert_eq!(groups.len(), passes);
            assert!(groups.iter().all(|(_, cost)| *cost <= 16_000));
            let mut seen: Vec<usize> = groups.iter().flat_map(|(items, _)| items.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..costs.len()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn the_square_term_counts_the_longest_item() {
        let shape = BatchCost::padded().with_square_term(100);
        assert_eq!(shape.of(3, 200), 600 + 1_200);
        assert_eq!(shape.of(0, 200), 0);
        assert_eq!(BatchCost::padded().with_square_term(0).of(1, 2), 2 + 4);
        assert_eq!(shape.of(usize::MAX, u64::MAX), u64::MAX);
    }
}
