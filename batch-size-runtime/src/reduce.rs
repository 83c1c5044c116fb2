//! How the next batch size is chosen after an out-of-memory attempt.
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Reduction};
//!
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(100)
//!     .with_reduction(Reduction::Factor(0.5))
//!     .run_dyn(|batch_size| {
//!         if batch_size > 30 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
//!     });
//! assert_eq!(fitted.unwrap(), 25); // 100, 50, 25
//! ```

use std::fmt;

use crate::memory::MemorySnapshot;

/// What a custom reduction is told about the attempt that ran out of memory: the context
/// Accelerate users asked for (accelerate PR #3650).
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, SimulatedDevice};
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
///     .run_dyn(|batch_size| {
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
/// [`Reduction::Halve`], as the seed documents and toma do: 128, 64, 32, 16, 8, ...
///
/// ```
/// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, Reduction};
///
/// fn sizes_tried(reduction: Reduction<'_>) -> Vec<usize> {
///     let result: Result<(), anyhow::Error> = BatchSizeSearch::new(128)
///         .with_reduction(reduction)
///         .with_max_attempts(4)
///         .run_dyn(|_| Err(OutOfMemory::new().into()));
///     let error = result.unwrap_err();
///     error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried().to_vec()
/// }
///
/// assert_eq!(sizes_tried(Reduction::default()), [128, 64, 32, 16]);
/// assert_eq!(sizes_tried(Reduction::Factor(0.9)), [128, 115, 103, 92]);
/// let minus_one = Reduction::Custom(Box::new(|failed| failed.batch_size - 1));
/// assert_eq!(sizes_tried(minus_one), [128, 127, 126, 125]);
/// ```
#[derive(Default)]
#[non_exhaustive]
pub enum Reduction<'r> {
    /// `next = size / 2`.
    #[default]
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
            Reduction::Halve => f.write_str("Halve"),
            Reduction::Factor(factor) => f.debug_tuple("Factor").field(factor).finish(),
            Reduction::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}
