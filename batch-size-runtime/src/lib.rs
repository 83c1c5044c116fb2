//! Run a training function with the largest batch size that fits in device memory: on an
//! out-of-memory error, release the memory, pick a smaller size and run it again.
//!
//! This is the runtime of `#[find_executable_batch_size]`, the Rust home of Hugging Face
//! Accelerate's decorator of the same name. The engine is usable on its own:
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, SimulatedDevice};
//!
//! let device = SimulatedDevice::new(1 << 30); // 1 GiB, no GPU needed
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(128)
//!     .with_release(device.clone())
//!     .run_dyn(|batch_size| {
//!         let _activations = device.alloc(batch_size as u64 * (20 << 20))?; // 20 MiB a sample
//!         Ok(batch_size)
//!     });
//! assert_eq!(fitted.unwrap(), 32);
//! ```
//!
//! # What is recognised as out-of-memory
//! See [`oom`]: cudarc's error codes by type (without ever formatting them, so no libcuda is
//! needed), this crate's [`OutOfMemory`], and the messages of tch, candle, burn, PyTorch and
//! Accelerate's list, in returned errors (through `anyhow`, boxes and `source()` chains) and in
//! panics. [`oom::add_rule`] adds your own.
//!
//! # Panics
//! An out-of-memory panic inside an attempt is caught and retried, and its message is kept from
//! the panic hook so that a recovered OOM does not look like a crash: the retry is logged at
//! WARN instead. [`set_quiet_oom_panics(false)`](set_quiet_oom_panics) prints them again. Any
//! other panic resumes with its original payload. With `panic = "abort"` nothing can be caught:
//! return errors instead.
//!
//! # Logs
//! Through `tracing`: each retry at WARN (`batch_size`, `next_batch_size`, `error`, `memory`),
//! the size found at INFO, giving up at ERROR. The library never prints.

#[doc(inline)]
pub use batch_size_macro::find_executable_batch_size;

pub mod engine;
pub mod error;
pub mod memory;
pub mod oom;
pub mod record;
pub mod reduce;
pub mod simulated;
mod unwind;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use engine::{BatchSizeSearch, Search};
pub use error::{NoExecutableBatchSize, OutOfMemory, StopReason};
pub use memory::{MemoryBackend, Release};
pub use record::{last_report, Attempt, Outcome, SearchReport};
pub use reduce::{FailedAttempt, Reduction};
pub use simulated::{SimAllocation, SimulatedDevice};
pub use unwind::{set_quiet_oom_panics, CatchUnwind};
