//! The agreement over NCCL (feature `nccl`): one communicator per rank, on the rank's GPU, as
//! data-parallel jobs already run.
//!
//! ```no_run
//! use batch_size_runtime::agree::{IdExchange, NcclRank};
//! use batch_size_runtime::BatchSizeSearch;
//!
//! // 8 processes on one machine, each started with its RANK and the job's JOB_ID.
//! let rank: usize = std::env::var("RANK")?.parse()?;
//! let job = std::env::var("JOB_ID")?; // a fresh path for each job
//! let exchange = IdExchange::file(std::env::temp_dir().join(format!("nccl-id-{job}")), rank, 8);
//! let context = cudarc::driver::CudaContext::new(exchange.local_rank())?;
//! let rank = NcclRank::from_exchange(&exchange, context.new_stream()?)?;
//! let batch_size = BatchSizeSearch::new(512)
//!     .with_agreement(&rank)
//!     .run(|batch_size| -> anyhow::Result<usize> {
//!         // forward and backward at `batch_size`; then `safe_point(&rank, ...)`; then the
//!         // gradient all-reduce and the optimizer step
//!         Ok(batch_size)
//!     })?;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
//!
//! # Sharing the Id
//! Rank 0's Id reaches the others through a file ([`IdExchange::file`], above: one machine or a
//! shared filesystem), through MPI (`NcclRank::from_mpi`, with the `mpi` feature, under `mpirun`
//! or `srun`), or through any channel of the program's own (a torchrun-style launcher's store,
//! say): [`NcclId::new`] on rank 0, its [`as_bytes`](NcclId::as_bytes) sent, and
//! [`NcclId::from_bytes`] then [`NcclRank::new`] on every rank.
//!
//! # Why not cudarc's `Comm`
//! The device side is cudarc's: the rank's context is bound to the calling thread, the values
//! go to the device and come back with cudarc's copies on the rank's stream. NCCL itself is
//! loaded by this crate ([`loaded_library`] says from where), because cudarc's `nccl` module
//! cannot do three things this needs: find `libnccl.so.2` (the only name the pip wheel ships;
//! cudarc panics instead), create a non-blocking communicator (a blocking
//! `ncclCommInitRank` waits forever for a rank that never joins), and reach the raw
//! communicator to poll `ncclCommGetAsyncError` and call `ncclCommAbort` (its `Comm` keeps it
//! private and aborts with `expect` on drop). [`NcclId`] converts from and to cudarc's `Id`.
//!
//! # Nobody hangs
//! Every wait is bounded by the rank's timeout (default [`NcclRank::DEFAULT_TIMEOUT`]): while
//! a collective has not completed, the rank polls its stream and `ncclCommGetAsyncError`; a
//! peer that died (NCCL reports `ncclRemoteError`) or a timeout aborts the communicator, and
//! the agreement returns an error instead of waiting. A communicator that failed stays
//! failed: every later agreement through it returns an error at once.

mod library;

use std::ffi::{c_int, c_uint, c_void};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::collective::{AgreementError, Collective, ReduceOp};
use super::exchange::{ExchangeError, IdExchange};
use library::{library, NcclLibrary, RawComm, RawId, OLDEST_SUPPORTED};

pub use library::{loaded_library, NCCL_LIBRARY_VARIABLE};

const NCCL_SUCCESS: c_uint = 0;
const NCCL_IN_PROGRESS: c_uint = 7;
/// `ncclUint64`, `ncclMax`, `ncclMin`.
const NCCL_UINT64: c_uint = 5;
const NCCL_MAX: c_uint = 2;
const NCCL_MIN: c_uint = 3;

/// Why NCCL could not be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// NCCL is not installed where this crate looks.
    #[error(
        "NCCL was not found (looked for {}). Install it (`pip install nvidia-nccl-cu12`, or \
         your distribution's `libnccl2`), or set {NCCL_LIBRARY_VARIABLE}=/path/to/libnccl.so.2",
        if searched.is_empty() { "nothing".to_owned() } else { searched.join(", ") }
    )]
    LibraryNotFound {
        /// What was tried, in order.
        searched: Vec<String>,
    },
    /// The library lacks an entry point this crate calls.
    #[error("{path} has no `{symbol}`: is it NCCL 2.14 or newer?")]
    MissingSymbol {
        /// The entry point.
        symbol: &'static str,
        /// The library.
        path: String,
    },
    /// The library is older than 2.14, the first with non-blocking communicators.
    #[error(
        "{path} is NCCL {version}; 2.14 or newer is needed (`pip install -U nvidia-nccl-cu12`)"
    )]
    TooOld {
        /// `NCCL_VERSION` code (0 when it could not say).
        version: i32,
        /// The library.
        path: String,
    },
    /// A rank number outside `0..world_size`.
    #[error("rank {rank} is not one of the {world_size} ranks (0 to {})", world_size.saturating_sub(1))]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// The CUDA side failed (binding the context, the device buffer, a copy).
    #[error("CUDA failed while {doing}: {error}")]
    Cuda {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        error: String,
    },
    /// An NCCL call failed.
    #[error("{call} failed: {result}{}", detail.as_ref().map(|detail| format!(" ({detail})")).unwrap_or_default())]
    Call {
        /// The entry point.
        call: &'static str,
        /// The result code, named and described.
        result: String,
        /// NCCL's last error message, if any.
        detail: Option<String>,
    },
    /// Not every rank joined the communicator in time.
    #[error(
        "rank {rank} of {world_size} waited {waited:?} for the others to create the NCCL \
         communicator: a rank did not start, or was given another Id"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The world size.
        world_size: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// Exchanging the Id failed.
    #[error(transparent)]
    Exchange(Arc<ExchangeError>),
}

impl From<ExchangeError> for NcclError {
    fn from(error: ExchangeError) -> Self {
        NcclError::Exchange(Arc::new(error))
    }
}

/// The unique Id of a communicator: rank 0 creates it ([`NcclId::new`]), every rank passes
/// the same one to [`NcclRank::new`]. [`IdExchange`], MPI or a channel of the program's own
/// moves its bytes between processes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl NcclId {
    /// A new Id (`ncclGetUniqueId`), on rank 0 only. Loads NCCL if nothing has yet.
    pub fn new() -> Result<Self, NcclError> {
        let library = library()?;
        let mut raw = RawId { internal: [0; 128] };
        // SAFETY: a valid out-pointer to 128 bytes.
        let code = unsafe { (library.functions.get_unique_id)(&mut raw) };
        if code != NCCL_SUCCESS {
            return Err(call_error(
                library,
                "ncclGetUniqueId",
                code,
                std::ptr::null_mut(),
            ));
        }
        Ok(NcclId(raw.internal.map(|byte| byte as u8)))
    }

    /// An Id received from rank 0.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        NcclId(bytes)
    }

    /// The bytes to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    fn raw(&self) -> RawId {
        RawId {
            internal: self.0.map(|byte| byte as std::ffi::c_char),
        }
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The Id holds rank 0's address: not for logs.
        f.write_str("NcclId(..)")
    }
}

impl From<cudarc::nccl::Id> for NcclId {
    fn from(id: cudarc::nccl::Id) -> Self {
        NcclId(id.internal().map(|byte| byte as u8))
    }
}

impl From<NcclId> for cudarc::nccl::Id {
    fn from(id: NcclId) -> Self {
        cudarc::nccl::Id::uninit(id.raw().internal)
    }
}

/// A raw communicator; NCCL allows using one from any thread, one call at a time (the mutex
/// in [`NcclRank`] sees to that).
struct Comm(RawComm);

// SAFETY: see above; the pointer is only used under `NcclRank::state`'s lock.
unsafe impl Send for Comm {}

/// What the lock guards: the communicator, its device buffer, and whether it failed.
struct State {
    comm: Option<Comm>,
    buffer: CudaSlice<u64>,
    failed: Option<String>,
}

/// One rank of an agreement over NCCL: a communicator on the rank's GPU (its context and a
/// stream), used for nothing but the agreement's few integers. Implements [`Collective`].
pub struct NcclRank {
    library: &'static NcclLibrary,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
}

impl fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclRank")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("library", &self.library.path)
            .finish_non_exhaustive()
    }
}

impl NcclRank {
    /// How long a rank waits for the others by default, at creation and at every agreement.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// Joins the communicator `id` as `rank` of `world_size`, on `stream`'s GPU; returns once
    /// every rank has joined, or [`NcclError::Timeout`] after [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT).
    pub fn new(
        stream: Arc<CudaStream>,
        id: &NcclId,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, NcclError> {
        NcclRank::with_timeout(stream, id, rank, world_size, NcclRank::DEFAULT_TIMEOUT)
    }

    /// [`new`](Self::new) waiting at most `timeout` for the others, at creation and at every
    /// agreement.
    pub fn with_timeout(
        stream: Arc<CudaStream>,
        id: &NcclId,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        if rank >= world_size {
            return Err(NcclError::InvalidRank { rank, world_size });
        }
        let (Ok(nranks), Ok(rank_c)) = (c_int::try_from(world_size), c_int::try_from(rank)) else {
            return Err(NcclError::InvalidRank { rank, world_size });
        };
        let library = library()?;
        // NCCL creates the communicator on the current device: bind the rank's context.
        stream
            .context()
            .bind_to_thread()
            .map_err(|error| cuda_error("binding the context", error))?;
        let buffer = stream
            .alloc_zeros::<u64>(4)
            .map_err(|error| cuda_error("allocating the agreement's buffer", error))?;
        let mut config = CommConfig::non_blocking();
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the Id is passed by value.
        let code = unsafe {
            (library.functions.comm_init_rank_config)(
                &mut raw,
                nranks,
                id.raw(),
                rank_c,
                (&mut config as *mut CommConfig).cast(),
            )
        };
        let mut state = State {
            comm: (!raw.is_null()).then_some(Comm(raw)),
            buffer,
            failed: None,
        };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            let error = call_error(library, "ncclCommInitRankConfig", code, raw);
            abort(library, &mut state);
            return Err(error);
        }
        // Non-blocking: wait for every rank to join, within the timeout.
        if let Err(error) = joined(library, raw, timeout) {
            abort(library, &mut state);
            return Err(match error {
                None => NcclError::Timeout {
                    rank,
                    world_size,
                    waited: timeout,
                },
                Some(error) => error,
            });
        }
        tracing::info!(
            rank,
            world_size,
            version = library.version,
            "NCCL communicator of the batch-size agreement created"
        );
        Ok(NcclRank {
            library,
            stream,
            rank,
            world_size,
            timeout,
            state: Mutex::new(state),
        })
    }

    /// Exchanges the Id as `exchange` says (rank 0 creates it) and joins the communicator, on
    /// `stream`'s GPU, with the exchange's rank and world size.
    pub fn from_exchange(
        exchange: &IdExchange,
        stream: Arc<CudaStream>,
    ) -> Result<Self, NcclError> {
        let bytes = exchange.exchange(|| NcclId::new().map(|id| *id.as_bytes()))?;
        NcclRank::new(
            stream,
            &NcclId::from_bytes(bytes),
            exchange.rank(),
            exchange.world_size(),
        )
    }

    /// The stream the agreement's collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One all-reduce, waited for within the timeout.
    fn reduce(
        &self,
        state: &mut State,
        values: &mut [u64],
        op: c_uint,
    ) -> Result<(), AgreementError> {
        let failed = AgreementError::Failed;
        let Some(comm) = state.comm.as_ref().map(|comm| comm.0) else {
            return Err(failed("the communicator is closed".to_owned()));
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|error| failed(format!("binding the context: {error}")))?;
        if state.buffer.len() < values.len() {
            state.buffer = self
                .stream
                .alloc_zeros::<u64>(values.len())
                .map_err(|error| failed(format!("allocating: {error}")))?;
        }
        let count = values.len();
        let mut window = state.buffer.slice_mut(..count);
        self.stream
            .memcpy_htod(&*values, &mut window)
            .map_err(|error| failed(format!("copying to the device: {error}")))?;
        let code = {
            let (pointer, _recorded) = window.device_ptr(&self.stream);
            // SAFETY: in place on a live device buffer of `count` u64 on this stream.
            unsafe {
                (self.library.functions.all_reduce)(
                    pointer as *const c_void,
                    pointer as *mut c_void,
                    count,
                    NCCL_UINT64,
                    op,
                    comm,
                    self.stream.cu_stream().cast(),
                )
            }
        };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            return Err(self.library_error("ncclAllReduce", code, comm));
        }
        self.wait(comm)?;
        self.stream
            .memcpy_dtoh(&window, values)
            .map_err(|error| failed(format!("copying from the device: {error}")))?;
        Ok(())
    }

    /// Until the stream's work is done: polls it and the communicator's asynchronous error.
    fn wait(&self, comm: RawComm) -> Result<(), AgreementError> {
        let started = Instant::now();
        let mut pause = Pause::new();
        loop {
            // SAFETY: a live stream of a context bound to this thread.
            let query = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match query {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    return Err(AgreementError::Failed(format!(
                        "the stream failed: {other:?}"
                    )))
                }
            }
            match async_error(self.library, comm) {
                NCCL_SUCCESS | NCCL_IN_PROGRESS => {}
                code => return Err(self.library_error("the all-reduce", code, comm)),
            }
            if started.elapsed() >= self.timeout {
                return Err(AgreementError::Timeout {
                    rank: self.rank,
                    waited: self.timeout,
                    joined: 0,
                    world: self.world_size,
                });
            }
            pause.sleep();
        }
    }

    fn library_error(&self, call: &'static str, code: c_uint, comm: RawComm) -> AgreementError {
        AgreementError::Failed(call_error(self.library, call, code, comm).to_string())
    }
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        if values.is_empty() {
            return Ok(());
        }
        let op = match op {
            ReduceOp::Max => NCCL_MAX,
            ReduceOp::Min => NCCL_MIN,
        };
        let mut state = self.lock();
        if let Some(failed) = &state.failed {
            return Err(AgreementError::Failed(format!(
                "the NCCL communicator failed earlier: {failed}"
            )));
        }
        let reduced = self.reduce(&mut state, values, op);
        if let Err(error) = &reduced {
            // The communicator cannot be trusted after a failure or a timeout: abort it
            // (which ends the collective on this rank) and fail every later agreement.
            abort(self.library, &mut state);
            state.failed = Some(error.to_string());
            tracing::error!(rank = self.rank, "NCCL agreement failed: {error}");
        }
        reduced
    }
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        let library = self.library;
        let timeout = self.timeout;
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let Some(Comm(comm)) = state.comm.take() else {
            return;
        };
        if state.failed.is_some() {
            // SAFETY: a live communicator, not used again.
            unsafe { (library.functions.comm_abort)(comm) };
            return;
        }
        // A healthy communicator: finalize (flushes, tells the others this rank leaves on
        // purpose), then destroy; abort if either fails or does not finish in time.
        // SAFETY: a live communicator.
        let mut code = unsafe { (library.functions.comm_finalize)(comm) };
        let started = Instant::now();
        let mut pause = Pause::new();
        while code == NCCL_IN_PROGRESS && started.elapsed() < timeout {
            pause.sleep();
            code = async_error(library, comm);
        }
        if code == NCCL_SUCCESS {
            // SAFETY: a live, finalized communicator, not used again.
            code = unsafe { (library.functions.comm_destroy)(comm) };
            if code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS {
                return;
            }
        }
        tracing::warn!(
            rank = self.rank,
            "closing the NCCL communicator failed ({}): aborting it",
            library.describe(code)
        );
        // SAFETY: a live communicator, not used again.
        unsafe { (library.functions.comm_abort)(comm) };
    }
}

/// `ncclConfig_t` as NCCL 2.14 laid it out, all fields but `blocking` left undefined (NCCL
/// copies `size` bytes and defaults the rest, so newer versions accept it).
#[repr(C)]
struct CommConfig {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const std::ffi::c_char,
}

impl CommConfig {
    fn non_blocking() -> Self {
        const UNDEFINED: c_int = c_int::MIN;
        CommConfig {
            size: std::mem::size_of::<CommConfig>(),
            magic: 0xcafe_beef,
            version: OLDEST_SUPPORTED as c_uint,
            blocking: 0,
            cga_cluster_size: UNDEFINED,
            min_ctas: UNDEFINED,
            max_ctas: UNDEFINED,
            net_name: std::ptr::null(),
        }
    }
}

/// A communicator's asynchronous error (`ncclInProgress` while it is still joining).
fn async_error(library: &NcclLibrary, comm: RawComm) -> c_uint {
    let mut result: c_uint = NCCL_SUCCESS;
    // SAFETY: a live communicator and a valid out-pointer.
    let code = unsafe { (library.functions.comm_get_async_error)(comm, &mut result) };
    if code != NCCL_SUCCESS {
        code
    } else {
        result
    }
}

/// Aborts the state's communicator, if it has one.
fn abort(library: &NcclLibrary, state: &mut State) {
    if let Some(Comm(comm)) = state.comm.take() {
        // SAFETY: a live communicator, not used again.
        unsafe { (library.functions.comm_abort)(comm) };
    }
}

fn call_error(library: &NcclLibrary, call: &'static str, code: c_uint, comm: RawComm) -> NcclError {
    NcclError::Call {
        call,
        result: library.describe(code),
        detail: library.last_error(comm),
    }
}

fn cuda_error(doing: &'static str, error: cudarc::driver::DriverError) -> NcclError {
    NcclError::Cuda {
        doing,
        error: error.to_string(),
    }
}

/// Polling back-off: from 20 µs to 2 ms, so that a fast collective is seen at once and a slow
/// one costs little CPU.
struct Pause(Duration);

impl Pause {
    fn new() -> Self {
        Pause(Duration::from_micros(20))
    }

    fn sleep(&mut self) {
        std::thread::sleep(self.0);
        self.0 = (self.0 * 2).min(Duration::from_millis(2));
    }
}

/// Waits for every rank to join the communicator `raw` being created (non-blocking), within
/// `timeout`: `Err(None)` past it, `Err(Some(error))` where NCCL failed.
fn joined(library: &NcclLibrary, raw: RawComm, timeout: Duration) -> Result<(), Option<NcclError>> {
    let started = Instant::now();
    let mut pause = Pause::new();
    loop {
        match async_error(library, raw) {
            NCCL_SUCCESS => return Ok(()),
            NCCL_IN_PROGRESS if started.elapsed() < timeout => pause.sleep(),
            NCCL_IN_PROGRESS => return Err(None),
            code => {
                return Err(Some(call_error(
                    library,
                    "ncclCommInitRankConfig",
                    code,
                    raw,
                )))
            }
        }
    }
}
