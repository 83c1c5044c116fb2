//! The shrinking policies: halving, a constant factor, and the user's `reduce` function. Each
//! accepts the first success and, after an out-of-memory attempt, proposes a smaller size.

use std::fmt;

use super::{Decision, SizePolicy};
use crate::record::{Attempt, Outcome, SearchReport};
use crate::reduce::FailedAttempt;

/// `next = size / 2`: 128, 64, 32, ... (toma, and Accelerate before Jul 2025).
///
/// ```
/// use batch_size_runtime::policy::Halve;
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory};
///
/// let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
///     .with_policy(Halve)
///     .with_max_attempts(4)
///     .run_dyn(|_| Err(OutOfMemory::new().into()));
/// let error = result.unwrap_err();
/// assert_eq!(error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried(), &[128, 64, 32, 16]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Halve;

impl SizePolicy for Halve {
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
///     .run_dyn(|_| Err(OutOfMemory::new().into()));
/// let error = result.unwrap_err();
/// assert_eq!(
///     error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried(),
///     &[128, 115, 103, 92, 82]
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Factor(pub f64);

impl SizePolicy for Factor {
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
///     .run_dyn(|batch_size| {
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

    pub(crate) fn from_box(
        reduce: Box<dyn FnMut(&FailedAttempt<'_>) -> usize + Send + 'r>,
    ) -> Self {
        Reduce(reduce)
    }
}

impl fmt::Debug for Reduce<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reduce(..)")
    }
}

impl SizePolicy for Reduce<'_> {
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
            requested: last.requested,
            memory: last.memory_at_end.as_ref(),
        })),
        _ => Decision::Accept,
    }
}
