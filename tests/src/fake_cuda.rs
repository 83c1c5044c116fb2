//! The fake CUDA driver (`fake-cuda/fake_cuda.rs`, built by `build.rs`) from the tests' side:
//! load it, reset it, read its counters, make a call fail. The scenarios that run on it are in
//! [`crate::cuda_scenario`].
//!
//! A test binary that uses it must call [`FakeCuda::session`](crate::fake_cuda::FakeCuda::session) before anything calls cudarc:
//! loading the fake driver by absolute path first makes it the `libcuda.so` that cudarc then
//! opens (glibc matches the SONAME of an already loaded library). The driver stays loaded for
//! the whole process; each session resets it and holds a lock, so tests that use it run one at
//! a time.
//!
//! ```
//! use batch_size_tests::cuda_scenario::{GrowingModel, MIB};
//! use batch_size_tests::fake_cuda::FakeCuda;
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
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys::CUresult;
use libloading::Library;

include!("../fake-cuda/counters.rs");

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
