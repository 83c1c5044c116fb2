//! The shrinking policies: halving, a constant factor, and the user's `reduce` function, and
//! the one value that chooses among them and the guided default ([`Reduction`]), which every
//! runner holds. Each accepts the first success and, after an out-of-memory attempt, proposes a
//! smaller size.

use std::fmt;

use super::{Decision, Guided, SizePolicy};
use crate::memory::MemorySnapshot;
use crate::record::{Attempt, Outcome, SearchReport};

/// `next = size / 2`: 128, 64, 32, ... (toma, and Accelerate before Jul 2025).
///
/// ```
/// use batch_size_runtime::policy::Halve;
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
///
/// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
///     .with_policy(Halve)
///     .with_max_attempts(4)
///     .run(|_| Err(OutOfMemory::new().into()));
/// let error = result.unwrap_err();
/// assert_eq!(error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried(), &[128, 64, 32, 16]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Halve;

impl SizePolicy for Halve {
    fn accepts_every_success(&self) -> bool {
        true
    }

    #[inline]
    fn after(&mut self, history: &SearchReport) -> Decision {
        shrink(history, |failed| failed.batch_size / 2)
    }
}

/// `next = floor(size * factor)`, 0 < factor < 1. `Factor(0.9)` is Accelerate 1.x step for
/// step: 128, 115, 103, 92, 82, 73, 65, 58, ...
///
/// ```
/// use batch_size_runtime::policy::Factor;
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
///
/// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
///     .with_policy(Factor(0.9))
///     .with_max_attempts(5)
///     .run(|_| Err(OutOfMemory::new().into()));
/// let error = result.unwrap_err();
/// assert_eq!(
///     error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried(),
///     &[128, 115, 103, 92, 82]
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Factor(pub f64);

impl SizePolicy for Factor {
    fn accepts_every_success(&self) -> bool {
        true
    }

    fn check(&self) -> Result<(), String> {
        let Factor(factor) = *self;
        if factor > 0.0 && factor < 1.0 {
            Ok(())
        } else {
            Err(format!(
                "`factor` must be strictly between 0 and 1, got {factor}"
            ))
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let Factor(factor) = *self;
        // `as` saturates and the product is below the size, so this cannot overflow.
        shrink(history, |failed| {
            (failed.batch_size as f64 * factor).floor() as usize
        })
    }
}

/// Your function of the failed attempt (`reduce = |failed| ...`). It may keep state, as
/// Accelerate's `reduce_batch_size_fn` does, and is followed exactly as written: a size that is
/// not smaller than one that failed stops the search with
/// [`StopReason::NotSmaller`](crate::StopReason::NotSmaller).
///
/// ```
/// use batch_size_runtime::policy::Reduce;
/// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
///
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(100)
///     .with_policy(Reduce::new(|failed| failed.batch_size - 30))
///     .run(|batch_size| {
///         if batch_size > 50 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
///     });
/// assert_eq!(fitted.unwrap(), 40); // 100, 70, 40
/// ```
pub struct Reduce<'r>(Box<dyn FnMut(&FailedAttempt<'_>) -> usize + Send + 'r>);

impl<'r> Reduce<'r> {
    /// The policy that calls `reduce` after each out-of-memory attempt.
    pub fn new(reduce: impl FnMut(&FailedAttempt<'_>) -> usize + Send + 'r) -> Self {
        Reduce(Box::new(reduce))
    }
}

impl fmt::Debug for Reduce<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reduce(..)")
    }
}

impl SizePolicy for Reduce<'_> {
    fn accepts_every_success(&self) -> bool {
        true
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        shrink(history, |failed| (self.0)(failed))
    }
}

/// Accepts a success; after an out-of-memory attempt, tries `next` of it.
fn shrink(history: &SearchReport, next: impl FnOnce(&FailedAttempt<'_>) -> usize) -> Decision {
    match history.last() {
        Some(
            last @ Attempt {
                outcome: Outcome::OutOfMemory { error },
                ..
            },
        ) => Decision::Try(next(&FailedAttempt {
            batch_size: last.batch_size,
            attempt: last.number,
            error,
            requested: last.figures.requested,
            memory: last.memory_at_end.as_ref(),
        })),
        _ => Decision::Accept,
    }
}

/// What a custom reduction is told about the attempt that ran out of memory: the context
/// Accelerate users asked for (accelerate PR #3650).
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, memory::SimulatedDevice};
///
/// let device = SimulatedDevice::new(1000);
/// let mut seen = Vec::new();
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
///     .with_release(device.clone())
///     .with_reduce(|failed| {
///         assert!(failed.error.starts_with("out of device memory on sim:0"));
///         let free = failed.memory.map(|memory| memory.free());
///         seen.push((failed.attempt, failed.batch_size, failed.requested, free));
///         failed.batch_size - 16
///     })
///     .run(|batch_size| {
///         let _batch = device.alloc(batch_size as u64 * 25)?;
///         Ok(batch_size)
///     });
/// assert_eq!(fitted.unwrap(), 32);
/// assert_eq!(seen, [(1, 64, Some(1600), Some(1000)), (2, 48, Some(1200), Some(1000))]);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct FailedAttempt<'a> {
    /// The size that ran out of memory.
    pub batch_size: usize,
    /// The attempt's number, from 1.
    pub attempt: usize,
    /// What the out-of-memory error said.
    pub error: &'a str,
    /// Bytes the failed allocation asked for, when the error says.
    pub requested: Option<u64>,
    /// The device memory when the attempt failed (before release), when known.
    pub memory: Option<&'a MemorySnapshot>,
}

pub(crate) type CustomReduction<'r> = Box<dyn FnMut(&FailedAttempt<'_>) -> usize + Send + 'r>;

/// The policy that picks the next size.
///
/// # Default
/// [`Reduction::Guided`], the default of every runner: sizes from each failure's figures,
/// never below halving's (toma's and the seed's `Halve`: 128, 64, 32, 16, 8, ...).
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, policy::Reduction};
///
/// fn sizes_tried(reduction: Reduction<'_>) -> Vec<usize> {
///     let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
///         .with_reduction(reduction)
///         .with_max_attempts(4)
///         .run(|_| Err(OutOfMemory::new().into()));
///     let error = result.unwrap_err();
///     error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried().to_vec()
/// }
///
/// assert_eq!(sizes_tried(Reduction::Halve), [128, 64, 32, 16]);
/// assert_eq!(sizes_tried(Reduction::default()), [128, 64, 32, 16]); // no figures: halving
/// assert_eq!(sizes_tried(Reduction::Factor(0.9)), [128, 115, 103, 92]);
/// let minus_one = Reduction::Custom(Box::new(|failed| failed.batch_size - 1));
/// assert_eq!(sizes_tried(minus_one), [128, 127, 126, 125]);
/// ```
#[non_exhaustive]
pub enum Reduction<'r> {
    /// From each failure's figures, never below halving's size ([`Guided`]).
    Guided(Guided),
    /// `next = size / 2`.
    Halve,
    /// `next = floor(size * f)`, 0 < f < 1. `0.9` is Accelerate 1.x
    /// (128, 115, 103, 92, 82, 73, 65, 58, ...).
    Factor(f64),
    /// Your function of the failed attempt. It may keep state (an `FnMut`), as Accelerate's
    /// `reduce_batch_size_fn` does. It must return a smaller size, or the search stops.
    Custom(CustomReduction<'r>),
}

impl fmt::Debug for Reduction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reduction::Guided(guided) => f.debug_tuple("Guided").field(guided).finish(),
            Reduction::Halve => f.write_str("Halve"),
            Reduction::Factor(factor) => f.debug_tuple("Factor").field(factor).finish(),
            Reduction::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl Default for Reduction<'_> {
    fn default() -> Self {
        Reduction::Guided(Guided::new())
    }
}

impl Reduction<'_> {
    /// The same choice for one search, borrowing a custom function: a runner that runs one
    /// search per step or per run keeps its `Reduction` and lends it out.
    pub(crate) fn borrowed(&mut self) -> Reduction<'_> {
        match self {
            Reduction::Guided(guided) => Reduction::Guided(guided.clone()),
            Reduction::Halve => Reduction::Halve,
            Reduction::Factor(factor) => Reduction::Factor(*factor),
            Reduction::Custom(reduce) => Reduction::Custom(Box::new(|failed| reduce(failed))),
        }
    }
}

/// The choice is itself the policy: statically dispatched, so that a search with a built-in
/// policy allocates nothing.
impl SizePolicy for Reduction<'_> {
    fn after(&mut self, history: &SearchReport) -> Decision {
        match self {
            Reduction::Guided(guided) => guided.after(history),
            Reduction::Halve => Halve.after(history),
            Reduction::Factor(factor) => Factor(*factor).after(history),
            Reduction::Custom(reduce) => shrink(history, |failed| reduce(failed)),
        }
    }

    fn check(&self) -> Result<(), String> {
        match self {
            Reduction::Guided(guided) => guided.check(),
            Reduction::Factor(factor) => Factor(*factor).check(),
            Reduction::Halve | Reduction::Custom(_) => Ok(()),
        }
    }

    fn rationale(&self) -> Option<String> {
        match self {
            Reduction::Guided(guided) => guided.rationale(),
            _ => None,
        }
    }

    fn accepts_every_success(&self) -> bool {
        true
    }

    fn grow_after_a_step(&self, history: &SearchReport) -> Option<super::GrowRule> {
        match self {
            Reduction::Guided(guided) => guided.grow_after_a_step(history),
            _ => None,
        }
    }
}
