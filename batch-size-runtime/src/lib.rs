//! Run a training function with the largest batch size that fits in device memory: on an
//! out-of-memory error, release the memory, pick a smaller size and run it again. Where a failed
//! allocation aborts the process instead (candle on the CPU, any `Vec`), each size runs in a
//! child process ([`ChildTrial`]).
//!
//! The Rust home of Hugging Face Accelerate's `find_executable_batch_size`. Annotate the
//! function whose first parameter is the batch size; call it without that parameter:
//!
//! ```
//! use batch_size_runtime::{find_executable_batch_size, memory::SimulatedDevice};
//!
//! struct Config { batch_size: usize }
//!
//! #[find_executable_batch_size(starting = cfg.batch_size, min = 4, release = device.clone())]
//! fn train(batch_size: usize, cfg: &Config, device: &SimulatedDevice) -> anyhow::Result<usize> {
//!     // Everything that holds device memory lives in here, so it is dropped before a retry.
//!     let _weights = device.alloc(2 << 30)?;                         // 2 GiB
//!     let _activations = device.alloc(batch_size as u64 * (64 << 20))?; // 64 MiB a sample
//!     Ok(batch_size)
//! }
//!
//! let device = SimulatedDevice::new(5 << 30); // 5 GiB; a GPU works the same way
//! // 128 runs out of memory. One failure cannot tell the 2 GiB of weights from activations,
//! // so halving's 64 comes next; 64's failure with 128's says 48 fit: 45 (a 5 % margin).
//! let fitted = train(&Config { batch_size: 128 }, &device)?;
//! assert_eq!(fitted, 45); // halving would have stopped at 32, in as many attempts
//! assert_eq!(batch_size_runtime::last_report().unwrap().len(), 3);
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! | Accelerate | this crate |
//! |---|---|
//! | `@find_executable_batch_size(...)` decorator | [`#[find_executable_batch_size(...)]`](find_executable_batch_size) attribute |
//! | `starting_batch_size=128` | `starting = 128` (any integer expression, may use the other parameters) |
//! | halving (before Jul 2025), `x 0.9` since | guided by each failure's figures by default (exact halving without figures), `factor = 0.9` for Accelerate 1.x |
//! | `reduce_batch_size_fn` (no argument) | `reduce = \|failed\| ...` with the [`FailedAttempt`](policy::FailedAttempt) (size, number, error, memory) |
//! | none | `min = 4`, `max_attempts = 6` |
//! | `gc.collect()` + `torch.cuda.empty_cache()`, `release_memory(*objs)` | values are dropped when the attempt returns or unwinds; then [`Release`]: CUDA's pools synchronized and trimmed, plus your hooks (`release = ...`) |
//! | `RuntimeError("No executable batch size found, reached zero.")` | [`NoExecutableBatchSize`]: sizes tried, last OOM, memory figures, `source()` |
//! | string match on `RuntimeError` | typed cudarc codes, this crate's [`OutOfMemory`], messages of tch, candle, burn, PyTorch ([`oom`]) |
//! | no logs | `tracing`: WARN per retry, INFO for the size found, [`last_report()`] |
//!
//! The engine is usable without the attribute, as [`BatchSizeSearch`].
//!
//! # Which door
//!
//! | your case | the door |
//! |---|---|
//! | training on a GPU: one function that trains (or evaluates) | the attribute, as above; [`BatchSizeSearch`] for a search in your own code |
//! | a training loop with gradient accumulation | [`EffectiveBatch`]: each optimizer step keeps the effective batch, a step that runs out of memory is redone with smaller micro-batches |
//! | inference over a dataset | [`Chunked`]: chunks that grow and shrink, never redoing finished work |
//! | one global batch across ranks | [`EffectiveBatch::with_agreement`] and [`EffectiveBatch::with_uneven_shares`]: each rank its share at its own micro-batch, every rank retrying together ([`agree`]: threads, NCCL, MPI) |
//! | the CPU, with a framework whose failed allocation aborts the process (candle, ndarray, `Vec`) | child trials: [`Tuner`] with a [`ChildTrial`] per size and [`ChildTrial::memory`] as its release, before training; then train at the size found, in the parent |
//! | choosing once, before training | [`Tuner`]: the largest size that fits (or the fastest) in a few short trials |
//!
//! Each door's page has its example; the README runs one for each case as a whole program. On
//! the CPU, a `Vec` that cannot be allocated aborts the process: nothing in it can be retried,
//! so each size runs in a child process, which reports to its parent how it ended and what it
//! used. The tuner, growing and bisecting from the children's figures, ended at 0.94 to 0.95 of
//! the largest size that fits for candle's MLP; the attribute alone, which stops at its first
//! success, nearer halving's rung (0.75 in those runs). The tuner:
//!
//! ```no_run
//! use batch_size_runtime::{ChildTrial, Tuner};
//!
//! fn step(batch_size: usize) -> Result<(), String> {
//!     let _inputs = vec![1.0f32; batch_size * 1024]; // candle's CPU backend allocates so
//!     Ok(())
//! }
//!
//! fn main() -> anyhow::Result<()> {
//!     let trial = ChildTrial::new("step");
//!     trial.serve(step); // first thing: in a child, runs the step at its size and exits
//!     let tuned = Tuner::new()
//!         .with_release(trial.memory()) // the children's figures
//!         .run(|batch_size| trial.run(batch_size))?;
//!     println!("train at batch size {}, in this process", tuned.batch_size());
//!     Ok(())
//! }
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
//! WARN instead. [`set_quiet_oom_panics(false)`](oom::set_quiet_oom_panics) prints them again. Any
//! other panic resumes with its original payload. With `panic = "abort"` nothing can be caught:
//! return errors instead.
//!
//! # Logs
//! Through `tracing`: each retry at WARN (`batch_size`, `next_batch_size`, `error`, `memory`),
//! the size found at INFO, giving up at ERROR. The library never prints.
//!
//! # Features
//! - `anyhow` (default): conveniences for `anyhow::Error`.
//! - `burn`, `wgpu`, `ort`: those frameworks' figures and release (`Release::burn`,
//!   `Release::wgpu`, `Release::ort`), and with `burn`, `memory::BurnDryRun`.
//! - `nccl`: the agreement between ranks over NCCL (`agree::NcclRank`), its Id shared by MPI,
//!   a file (`agree::IdExchange`) or a channel of the program's own (`agree::NcclId::from_bytes`).
//! - `mpi`: the agreement between ranks over MPI (`agree::MpiJob`, `agree::MpiRank`) for jobs
//!   launched with `mpirun`, `mpiexec` or `srun`, and with `nccl` the NCCL Id broadcast by MPI
//!   (`NcclRank::from_mpi`). Needs an MPI library and libclang to build.
//!
//! Each feature's items are marked with the feature they need in the documentation docs.rs
//! builds (every feature on but `mpi`: docs.rs has no MPI library to build it against).

#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`): each feature-gated item says which feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Retries the function with smaller batch sizes whenever it runs out of device memory.
///
/// The function's first parameter (after `&self` or `&mut self`) is the batch size, of any
/// primitive integer type and any pattern. The rewritten function has the same name,
/// visibility, generics and return type, without that parameter.
///
/// # Arguments
/// - `starting = EXPR` (required): the first size tried, any integer expression, evaluated at
///   each call; it may use the function's other parameters.
/// - `min = EXPR` (default 1): no smaller size is tried; a policy's step below it runs `min`
///   itself once before the search gives up.
/// - `factor = FLOAT` (0 < f < 1) or `reduce = EXPR` (a `FnMut(&FailedAttempt) -> usize`), not
///   both. Default: the guided policy ([`policy::Guided`]), which halves where the error gives no figures.
/// - `margin = FLOAT`: the guided policy's margin, 0 ≤ margin < 1 (default 0.05).
/// - `policy = EXPR`: any [`SizePolicy`](policy::SizePolicy) instead (excludes `factor` and `reduce`).
/// - `max_attempts = EXPR`: at most this many attempts.
/// - `release = EXPR`: anything `Into<`[`Release`]`>` (default: [`Release::cuda()`]).
/// - `when = EXPR`: a `Fn(&dyn Error) -> bool` that counts more errors as out-of-memory, for
///   this function only ([`BatchSizeSearch::when`]).
/// - `notify = EXPR`: a `FnMut(&Attempt)` called as each attempt ends ([`BatchSizeSearch::notify`]).
/// - `on_report = EXPR`: a `FnOnce(&SearchReport)` called when the search ends, with this call's
///   report, whatever thread an `async fn` ends on ([`BatchSizeSearch::on_report`]).
/// - `effective = EXPR`: with a [`BatchPlan`] first parameter, the effective batch that each
///   attempt's micro-batches add up to (gradient accumulation); `starting` is then the first
///   micro size ([`EffectiveBatch`] for a training loop of many steps).
/// - `cache = EXPR`: a key (`Into<String>`): the size that fit is remembered and the next call
///   starts there ([`BatchSizeSearch::with_cache`], [`policy::CacheEntry`]).
/// - `cache_dir = EXPR`: the folder for the cache's files (with `cache`; without it, a compile
///   error) ([`BatchSizeSearch::with_cache_dir`]).
/// - `agree = EXPR`: a rank ([`agree::ThreadRank`], `agree::NcclRank` with the `nccl` feature, any
///   [`agree::Collective`]): every rank of the job settles on the same size
///   ([`BatchSizeSearch::with_agreement`]).
/// - `remedies = EXPR`: a [`Remedies`](remedies::Remedies) (or `&Remedies`), with a [`Remedied`](remedies::Remedied) first parameter
///   carrying the batch size and the settings: when even `min` runs out of memory, the next
///   remedy is applied and the batch size searched again from `starting`
///   ([`BatchSizeSearch::with_remedies`], [`remedies`]).
/// - `crate = PATH`: where the runtime is, when renamed or re-exported.
///
/// # Parameters and return type
/// - `&T` and `&mut T` parameters are re-borrowed for every attempt; owned parameters are
///   cloned for every attempt (they must be `Clone`). `self` by value is refused: the body may
///   run several times.
/// - `Result<T, E>`: when no size fits, the function returns `Err(E::from(NoExecutableBatchSize))`
///   (`anyhow::Error`, `Box<dyn Error + Send + Sync>`, `std::io::Error`, your enum with
///   `#[error(transparent)] NoBatchSize(#[from] NoExecutableBatchSize)`); failing that
///   `E::from(io::Error)`, `E::from(String)` or `E::from(Box<dyn Error + Send + Sync>)`; and
///   for any other error type, the last out-of-memory error itself.
/// - `E` must be inspectable (`Error`, `anyhow::Error`, a boxed error) or at least `Display`:
///   otherwise an out-of-memory error could pass unseen, and it is a compile error at the
///   return type naming the bound to add.
/// - Any other return type: out-of-memory can only come as a panic, which is retried; when no
///   size fits the function panics with the `NoExecutableBatchSize` message.
/// - Errors and panics that are not out-of-memory come back unchanged after one attempt.
///   `return` and `?` in the body keep their meaning. `async fn` works.
///
/// # Examples
/// `starting` and `min`, reading another parameter:
/// ```
/// # use batch_size_runtime::{find_executable_batch_size, OutOfMemory};
/// #[find_executable_batch_size(starting = requested, min = 16)]
/// fn fit(batch_size: u32, requested: u32) -> anyhow::Result<u32> {
///     if batch_size > 20 { Err(OutOfMemory::new())? }
///     Ok(batch_size)
/// }
/// assert_eq!(fit(64)?, 16);
/// assert!(fit(15).is_err()); // below `min` from the start: never called
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// `factor`, as Accelerate 1.x:
/// ```
/// # use batch_size_runtime::{find_executable_batch_size, OutOfMemory};
/// #[find_executable_batch_size(starting = 128, factor = 0.9)]
/// fn fit(batch_size: usize) -> anyhow::Result<usize> {
///     if batch_size > 100 { Err(OutOfMemory::new())? }
///     Ok(batch_size)
/// }
/// assert_eq!(fit()?, 92); // 128, 115, 103, 92
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// `reduce`, with the failed attempt's context:
/// ```
/// # use batch_size_runtime::{find_executable_batch_size, OutOfMemory};
/// #[find_executable_batch_size(starting = 96, reduce = |failed| failed.batch_size - 32)]
/// fn fit(batch_size: usize) -> anyhow::Result<usize> {
///     if batch_size > 40 { Err(OutOfMemory::new())? }
///     Ok(batch_size)
/// }
/// assert_eq!(fit()?, 32);
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// `max_attempts`, and the error when nothing fits:
/// ```
/// # use batch_size_runtime::{find_executable_batch_size, NoExecutableBatchSize, OutOfMemory};
/// #[find_executable_batch_size(starting = 64, max_attempts = 2)]
/// fn fit(_batch_size: usize) -> anyhow::Result<()> {
///     Err(OutOfMemory::new().into())
/// }
/// let error = fit().unwrap_err();
/// assert_eq!(error.downcast_ref::<NoExecutableBatchSize>().unwrap().tried(), &[64, 32]);
/// ```
///
/// `release`, for a framework's cache or a simulated device:
/// ```
/// # use batch_size_runtime::{find_executable_batch_size, Release, memory::SimulatedDevice};
/// let device = SimulatedDevice::new(1 << 30).with_caching();
///
/// #[find_executable_batch_size(starting = 64, release = Release::backend(device.clone()).with_hook(|| {
///     // e.g. burn: B::memory_cleanup(&device)
/// }))]
/// fn fit(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
///     let _activations = device.alloc(batch_size as u64 * (32 << 20))?;
///     Ok(batch_size)
/// }
/// assert_eq!(fit(&device)?, 32); // 32 fill the device: halving's step, which the guided search tries first
/// assert_eq!(device.release_count(), 1);
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// `crate`, for a runtime re-exported under another name:
/// ```
/// mod ml {
///     pub mod batching {
///         pub use batch_size_runtime::*;
///     }
/// }
///
/// #[ml::batching::find_executable_batch_size(starting = 8, crate = ml::batching)]
/// fn fit(batch_size: usize) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
///     Ok(batch_size)
/// }
/// assert_eq!(fit().unwrap(), 8);
/// ```
///
/// Methods, `async fn` and panics:
/// ```
/// # use batch_size_runtime::find_executable_batch_size;
/// struct Trainer { fits: usize }
///
/// impl Trainer {
///     #[find_executable_batch_size(starting = 32)]
///     async fn fit(&self, batch_size: usize) -> usize {
///         if batch_size > self.fits {
///             panic!("CUDA out of memory. Tried to allocate 1.00 GiB"); // as tch's methods do
///         }
///         batch_size
///     }
/// }
/// # use std::future::Future;
/// # let waker = std::task::Waker::noop();
/// # let mut context = std::task::Context::from_waker(&waker);
/// let mut future = std::pin::pin!(Trainer { fits: 10 }.fit());
/// # let fitted = loop { if let std::task::Poll::Ready(v) = future.as_mut().poll(&mut context) { break v; } };
/// assert_eq!(fitted, 8);
/// ```
#[doc(inline)]
pub use batch_size_macro::find_executable_batch_size;

pub mod agree;
mod attempt;
mod attribute;
mod engine;
mod error;
pub mod memory;
pub mod oom;
mod opaque;
mod panic_filter;
pub mod policy;
mod record;
pub mod remedies;
mod runners;
mod trial;
mod unwind;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use attempt::AttemptError;
pub use engine::{step_done, step_handle, Grow, Search, StepHandle};
pub use error::{NoExecutableBatchSize, StopReason};
pub use memory::out_of_memory::OutOfMemory;
pub use memory::release::Release;
pub use record::{last_report, Attempt, Figures, Outcome, SearchReport};
pub use runners::chunked::{ChunkError, ChunkProgress, ChunkRecord, Chunked};
pub use runners::effective::{BatchPlan, EffectiveBatch, MicroBatch, Recovery};
pub use runners::search::BatchSizeSearch;
pub use runners::split::BatchCost;
pub use runners::tuner::{Choice, Tuned, Tuner};
pub use trial::{ChildTrial, ChildTrialError};
