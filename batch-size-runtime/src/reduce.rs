//! How the next batch size is chosen after an out-of-memory attempt: [`Reduction`], whose
//! default is the guided policy ([`Guided`](crate::policy::Guided)), and what a custom
//! reduction is told ([`FailedAttempt`]). Both live in [`policy`](crate::policy); this module
//! keeps the path.
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

pub use crate::policy::{FailedAttempt, Reduction};
