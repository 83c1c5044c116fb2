//! The fake CUDA driver (`fake-cuda/fake_cuda.rs`, built by `build.rs`) from the tests' side:
//! load it, reset it, read its counters, make a call fail; plus a model whose memory grows with
//! the batch size and a log capture, for end-to-end scenarios through cudarc.
//!
//! A test binary that uses it must call [`FakeCuda::session`] before anything calls cudarc:
//! loading the fake driver by absolute path first makes it the `libcuda.so` that cudarc then
//! opens (glibc matches the SONAME of an already loaded library). The driver stays loaded for
//! the whole process; each session resets it and holds a lock, so tests that use it run one at
//! a time.
//!
//! ```no_run
//! use batch_size_tests::fake_cuda::{FakeCuda, GrowingModel, MIB};
//!
//! let cuda = FakeCuda::session(1, 100 * MIB)?; // one 100 MiB device
//! let ctx = cudarc::driver::CudaContext::new(0)?;
//! let model = GrowingModel::new(4, MIB as usize); // 4 layers of 1 MiB per sample
//! assert!(model.step(&ctx.default_stream(), 64).is_err()); // 256 MiB: out of memory
//! assert!(cuda.counters(0).pool_reserved > 0); // what it got is still reserved by the pool
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::{c_char, c_int, c_uint, CString};
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use batch_size_runtime::memory::{CudaBackend, MemoryBackend, MemorySnapshot, ReleaseError};
use batch_size_runtime::NoExecutableBatchSize;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaStream, DriverError};
use libloading::Library;

include!("../fake-cuda/counters.rs");

/// One mebibyte.
pub const MIB: u64 = 1 << 20;

/// The absolute path of the fake driver that `build.rs` built.
pub const DRIVER_PATH: &str = env!("FAKE_CUDA_DRIVER");

type ResetFn = unsafe extern "C" fn(c_int, u64);
type SetPoolsFn = unsafe extern "C" fn(c_int, c_int) -> c_uint;
type CountersFn = unsafe extern "C" fn(c_int, *mut FakeCudaCounters) -> c_uint;
type CallsFn = unsafe extern "C" fn(*const c_char) -> u64;
type FailFn = unsafe extern "C" fn(*const c_char, c_uint);

/// The loaded fake driver and its control functions.
pub struct FakeCuda {
    // Keeps the library, and so the function pointers below, alive for the process.
    _library: Library,
    reset: ResetFn,
    set_pools: SetPoolsFn,
    counters: CountersFn,
    calls: CallsFn,
    fail: FailFn,
}

impl fmt::Debug for FakeCuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeCuda")
            .field("path", &DRIVER_PATH)
            .finish_non_exhaustive()
    }
}

static DRIVER: OnceLock<Result<FakeCuda, String>> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

/// Exclusive use of the fake driver, reset: dereferences to [`FakeCuda`].
#[derive(Debug)]
pub struct Session {
    driver: &'static FakeCuda,
    _serial: MutexGuard<'static, ()>,
}

impl std::ops::Deref for Session {
    type Target = FakeCuda;
    fn deref(&self) -> &FakeCuda {
        self.driver
    }
}

impl FakeCuda {
    /// The fake driver, loaded by absolute path on first use.
    pub fn load() -> Result<&'static FakeCuda, String> {
        DRIVER
            .get_or_init(|| {
                // SAFETY: the fake driver is plain Rust with no initialiser beyond std's.
                let library = unsafe { Library::new(DRIVER_PATH) }
                    .map_err(|error| format!("cannot load {DRIVER_PATH}: {error}"))?;
                // SAFETY: each symbol has the signature written in fake_cuda.rs.
                unsafe {
                    Ok(FakeCuda {
                        reset: symbol(&library, b"fake_cuda_reset")?,
                        set_pools: symbol(&library, b"fake_cuda_set_memory_pools_supported")?,
                        counters: symbol(&library, b"fake_cuda_counters")?,
                        calls: symbol(&library, b"fake_cuda_calls")?,
                        fail: symbol(&library, b"fake_cuda_fail")?,
                        _library: library,
                    })
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Waits for the other tests of this process to finish with the driver, then resets it:
    /// `devices` devices of `capacity` bytes each, with memory pools, not initialised.
    pub fn session(devices: i32, capacity: u64) -> Result<Session, String> {
        let driver = FakeCuda::load()?;
        // A test that failed while holding the lock leaves nothing to repair: we reset.
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // SAFETY: plain values.
        unsafe { (driver.reset)(devices, capacity) };
        Ok(Session {
            driver,
            _serial: serial,
        })
    }

    /// A device's counters (all zero for a device that does not exist).
    pub fn counters(&self, device: i32) -> FakeCudaCounters {
        let mut counters = FakeCudaCounters::default();
        // SAFETY: `counters` is a valid FakeCudaCounters to write.
        unsafe { (self.counters)(device, &mut counters) };
        counters
    }

    /// How many times the driver entry point `name` was called since the session began.
    pub fn calls(&self, name: &str) -> u64 {
        match CString::new(name) {
            // SAFETY: a valid NUL-terminated string.
            Ok(name) => unsafe { (self.calls)(name.as_ptr()) },
            Err(_) => 0,
        }
    }

    /// Makes every call of the entry point `name` return `code` until [`succeed`](Self::succeed).
    pub fn fail(&self, name: &str, code: CUresult) {
        if let Ok(name) = CString::new(name) {
            // SAFETY: a valid NUL-terminated string.
            unsafe { (self.fail)(name.as_ptr(), code as c_uint) };
        }
    }

    /// Stops making `name` fail.
    pub fn succeed(&self, name: &str) {
        self.fail(name, CUresult::CUDA_SUCCESS);
    }

    /// Sets `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` of a device (read by cudarc when a
    /// context is created: without pools it allocates with `cuMemAlloc_v2`).
    pub fn set_memory_pools_supported(&self, device: i32, supported: bool) {
        // SAFETY: plain values.
        unsafe { (self.set_pools)(device, c_int::from(supported)) };
    }
}

/// # Safety
/// `T` is the exact type of the symbol `name`.
unsafe fn symbol<T: Copy>(library: &Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller's contract.
    unsafe { library.get::<T>(name) }
        .map(|symbol| *symbol)
        .map_err(|error| format!("{DRIVER_PATH}: {error}"))
}

/// A model whose memory grows with the batch size, as a forward pass's activations do: a step
/// allocates `layers` buffers of `batch_size * bytes_per_sample` bytes one after the other on
/// a stream (from the device's memory pool, where it has one), then optionally a workspace of
/// `batch_size * workspace_bytes_per_sample` bytes with plain `cuMemAlloc` (as cuBLAS and
/// cuDNN take theirs), then reads the last buffer back (its "loss"). Everything is freed when
/// the step returns, successful or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowingModel {
    /// Buffers allocated per step.
    pub layers: usize,
    /// Bytes of each buffer per sample of the batch.
    pub bytes_per_sample: usize,
    /// Bytes of the plain workspace per sample (0: no workspace).
    pub workspace_bytes_per_sample: usize,
}

impl GrowingModel {
    /// A model of `layers` buffers of `bytes_per_sample` bytes per sample each, no workspace.
    pub fn new(layers: usize, bytes_per_sample: usize) -> Self {
        GrowingModel {
            layers,
            bytes_per_sample,
            workspace_bytes_per_sample: 0,
        }
    }

    /// Adds a plain (`cuMemAlloc`) workspace of `bytes_per_sample` bytes per sample, taken
    /// after the buffers.
    pub fn with_workspace(mut self, bytes_per_sample: usize) -> Self {
        self.workspace_bytes_per_sample = bytes_per_sample;
        self
    }

    /// Bytes of one buffer at `batch_size`.
    pub fn layer_bytes(&self, batch_size: usize) -> u64 {
        (batch_size * self.bytes_per_sample) as u64
    }

    /// Bytes a step at `batch_size` needs at its peak.
    pub fn step_bytes(&self, batch_size: usize) -> u64 {
        self.layer_bytes(batch_size) * self.layers as u64
            + (batch_size * self.workspace_bytes_per_sample) as u64
    }

    /// The first size of the halving sequence from `starting` whose step fits in `available`
    /// bytes, if any.
    pub fn largest_fitting(&self, available: u64, starting: usize) -> Option<usize> {
        std::iter::successors(Some(starting), |size| Some(size / 2))
            .take_while(|&size| size > 0)
            .find(|&size| self.step_bytes(size) <= available)
    }

    /// One training step at `batch_size` on `stream`: returns `batch_size` when every buffer
    /// fits, cudarc's `DriverError(CUDA_ERROR_OUT_OF_MEMORY)` when one does not.
    pub fn step(&self, stream: &Arc<CudaStream>, batch_size: usize) -> Result<usize, DriverError> {
        let mut activations = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            activations.push(stream.alloc_zeros::<u8>(batch_size * self.bytes_per_sample)?);
        }
        let _workspace = match batch_size * self.workspace_bytes_per_sample {
            0 => None,
            bytes => Some(PlainAllocation::new(stream, bytes)?),
        };
        if let Some(last) = activations.last() {
            let loss = stream.clone_dtoh(&last.slice(..last.len().min(16)))?;
            if loss.iter().any(|&byte| byte != 0) {
                return Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
            }
        }
        Ok(batch_size)
    }
}

/// Device memory from `cuMemAlloc_v2`, freed with `cuMemFree_v2` when dropped.
#[derive(Debug)]
struct PlainAllocation(cudarc::driver::sys::CUdeviceptr);

impl PlainAllocation {
    fn new(stream: &CudaStream, bytes: usize) -> Result<Self, DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: the stream's context is current; the memory is never read uninitialised.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.map(PlainAllocation)
    }
}

impl Drop for PlainAllocation {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync above, freed once. The stream-ordered work that could
        // use it was never queued (it is only a stand-in for a library's workspace).
        let _ = unsafe { cudarc::driver::result::free_sync(self.0) };
    }
}

/// A training function's error: cudarc's errors, and no batch size fitting. `#[from]` keeps the
/// `DriverError` as the `source()`, where the search recognises it by its code.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A CUDA driver call failed.
    #[error("a CUDA driver call failed")]
    Cuda(#[from] DriverError),
    /// No batch size fitted.
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

/// The CUDA backend's figures without its release: what the figures look like when nothing is
/// given back between attempts.
#[derive(Debug, Clone, Default)]
pub struct FiguresOnly(pub CudaBackend);

impl MemoryBackend for FiguresOnly {
    fn release(&self) -> Result<(), ReleaseError> {
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        self.0.memory()
    }

    fn reset_peak(&self) {
        self.0.reset_peak();
    }
}

/// Runs `work` with a `tracing` subscriber that writes every event (DEBUG and up, no colours)
/// of this thread to a string, and returns both.
pub fn capture_logs<T>(work: impl FnOnce() -> T) -> (T, String) {
    let buffer = LogBuffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(buffer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let value = tracing::subscriber::with_default(subscriber, work);
    (value, buffer.contents())
}

#[derive(Debug, Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    fn contents(&self) -> String {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl io::Write for LogBuffer {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut buffer = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;

    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}
