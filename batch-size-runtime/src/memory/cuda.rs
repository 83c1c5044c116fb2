//! The CUDA backend: trims the default pool that `cuMemFreeAsync` leaves reserved, and reads the
//! figures. Failures are named by `CUresult` code: a cudarc error's `Display` calls libcuda.

use std::ffi::c_void;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

use cudarc::driver::sys::{self, CUdevice_attribute, CUmemPool_attribute, CUresult};
use cudarc::driver::{result, CudaContext, DriverError};

use super::{DeviceMemory, MemoryBackend, MemorySnapshot, ReleaseError};

/// Releases CUDA memory between attempts and reads each device's figures.
///
/// - [`CudaBackend::active()`] (the default, [`Release::cuda()`](super::Release::cuda)) acts
///   on every device whose primary context is already active: the contexts that cudarc's
///   `CudaContext::new`, candle, burn or libtorch use.
/// - [`CudaBackend::with_contexts()`] acts on exactly the contexts given.
///
/// At each release, for each device: synchronize its context, then trim its default memory pool
/// to zero (devices without memory pools are only synchronized). The figures are
/// `cuMemGetInfo`'s free and total bytes, and the pool's reserved, used and peak-used bytes.
///
/// Where CUDA is not in use (no libcuda loaded in the process, or `cuInit` never called) it
/// does nothing and reports nothing, so it is a safe default on machines without a GPU:
///
/// ```
/// use batch_size_runtime::memory::{CudaBackend, MemoryBackend};
///
/// let cuda = CudaBackend::active();
/// assert!(cuda.memory().is_empty()); // no CUDA in use in this process
/// cuda.release().unwrap(); // nothing to release
/// ```
#[derive(Clone, Default)]
pub struct CudaBackend {
    /// `None`: every active primary context; `Some`: exactly these.
    contexts: Option<Vec<Arc<CudaContext>>>,
}

impl CudaBackend {
    /// Acts on every device whose primary context is already active, and only on those.
    ///
    /// It never calls `cuInit` and never creates or activates a context: a device whose primary
    /// context nobody retained is not touched. Before any driver call it checks that libcuda is
    /// already loaded in the process (it never loads it).
    ///
    /// ```
    /// use batch_size_runtime::memory::{CudaBackend, MemoryBackend};
    /// use batch_size_runtime::BatchSizeSearch;
    ///
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(8)
    ///     .with_release(CudaBackend::active()) // the default, spelled out
    ///     .run(|batch_size| Ok(batch_size));
    /// assert_eq!(fitted.unwrap(), 8);
    /// ```
    pub fn active() -> Self {
        CudaBackend { contexts: None }
    }

    /// Acts on exactly `contexts` (cudarc contexts, primary or not), whatever else is active.
    ///
    /// The backend holds the contexts, so they stay alive as long as it does. Each is made
    /// current only for the duration of a release or a reading: the thread's current context is
    /// restored afterwards, and errors that cudarc recorded in a context are left for its owner.
    ///
    /// ```
    /// use batch_size_runtime::memory::{CudaBackend, MemoryBackend};
    ///
    /// // No context given, nothing to do (a real caller passes `CudaContext::new(0)?`).
    /// let none = CudaBackend::with_contexts(Vec::new());
    /// assert!(none.memory().is_empty());
    /// none.release().unwrap();
    /// ```
    pub fn with_contexts(contexts: Vec<Arc<CudaContext>>) -> Self {
        CudaBackend {
            contexts: Some(contexts),
        }
    }

    /// Whether the CUDA driver library (libcuda, nvcuda.dll) is loaded in this process. This
    /// never loads it: where it is not loaded, CUDA is not in use and the backend does nothing.
    ///
    /// ```
    /// use batch_size_runtime::memory::CudaBackend;
    ///
    /// // Nothing in a doctest loads libcuda, GPU or not.
    /// assert!(!CudaBackend::driver_loaded());
    /// ```
    pub fn driver_loaded() -> bool {
        driver_library_loaded()
    }

    /// Each readable device's figures, its pool's peak reset first where `reset_peak`.
    fn read(&self, reset_peak: bool) -> MemorySnapshot {
        let read = guarded(|| {
            let mut devices = Vec::new();
            for target in &self.targets()? {
                let reading = target.with_current(|| {
                    if reset_peak {
                        if let Err(failure) = reset_device_peak(target) {
                            tracing::debug!(error = %failure, "cannot reset the CUDA pool's peak");
                        }
                    }
                    read_device(target)
                });
                match reading {
                    Ok(memory) => devices.push(memory),
                    Err(failure) => tracing::debug!(error = %failure, "cannot read CUDA memory"),
                }
            }
            Ok(MemorySnapshot { devices })
        });
        read.unwrap_or_else(|failure| {
            tracing::debug!(error = %failure, "cannot read CUDA memory");
            MemorySnapshot::default()
        })
    }

    /// The devices to act on now, with the context to make current for each.
    fn targets(&self) -> Result<Vec<Target>, Failure> {
        match &self.contexts {
            Some(contexts) => Ok(contexts
                .iter()
                .map(|context| Target {
                    ordinal: context.ordinal(),
                    device: context.cu_device(),
                    context: TargetContext::Given(context.cu_ctx()),
                })
                .collect()),
            None => active_primary_contexts(),
        }
    }
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.contexts {
            None => f.write_str("CudaBackend(active primary contexts)"),
            Some(contexts) => {
                let devices: Vec<String> = contexts
                    .iter()
                    .map(|context| device_name(context.ordinal()))
                    .collect();
                f.debug_tuple("CudaBackend").field(&devices).finish()
            }
        }
    }
}

impl MemoryBackend for CudaBackend {
    /// Synchronizes each device's context and trims its default memory pool to zero; every
    /// device is attempted, and the first failure returned.
    fn release(&self) -> Result<(), ReleaseError> {
        guarded(|| {
            let mut first_failure = None;
            for target in &self.targets()? {
                if let Err(failure) = target.with_current(|| release_device(target)) {
                    tracing::debug!(error = %failure, "CUDA release failed");
                    first_failure.get_or_insert(failure);
                }
            }
            first_failure.map_or(Ok(()), Err)
        })
        .map_err(Failure::into_release_error)
    }

    /// Reads each device's figures; a device that cannot be read is left out.
    fn memory(&self) -> MemorySnapshot {
        self.read(false)
    }

    /// Resets each pool's peak and reads each device's figures, finding the devices once.
    fn start_attempt(&self) -> MemorySnapshot {
        self.read(true)
    }

    /// Resets each pool's peak (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`) to its current use.
    fn reset_peak(&self) {
        let reset = guarded(|| {
            for target in &self.targets()? {
                if let Err(failure) = target.with_current(|| reset_device_peak(target)) {
                    tracing::debug!(error = %failure, "cannot reset the CUDA pool's peak");
                }
            }
            Ok(())
        });
        if let Err(failure) = reset {
            tracing::debug!(error = %failure, "cannot reset the CUDA pool's peak");
        }
    }
}

/// Runs `work`, turning a panic inside cudarc (libcuda absent or lacking a symbol) into a failure.
fn guarded<T>(work: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    std::panic::catch_unwind(AssertUnwindSafe(work)).unwrap_or(Err(Failure {
        call: "a CUDA driver call",
        ordinal: None,
        code: None,
    }))
}

/// A driver call that failed, named without calling the driver.
#[derive(Debug, Clone, Copy)]
struct Failure {
    call: &'static str,
    ordinal: Option<usize>,
    /// `None`: cudarc panicked (libcuda could not be opened, or lacks the function).
    code: Option<CUresult>,
}

impl Failure {
    fn new(call: &'static str, error: DriverError) -> Self {
        Failure {
            call,
            ordinal: None,
            code: Some(error.0),
        }
    }

    fn on(mut self, ordinal: usize) -> Self {
        self.ordinal.get_or_insert(ordinal);
        self
    }

    fn into_release_error(self) -> ReleaseError {
        ReleaseError::new(self.to_string())
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.code {
            // The derived Debug of the code enum is plain Rust: it never calls libcuda.
            Some(code) => write!(f, "{} returned {code:?}", self.call)?,
            None => write!(
                f,
                "{} panicked in cudarc (libcuda could not be opened, or lacks the function)",
                self.call
            )?,
        }
        if let Some(ordinal) = self.ordinal {
            write!(f, " on {}", device_name(ordinal))?;
        }
        Ok(())
    }
}

/// Turns a raw `CUresult` into a result naming the call.
fn check(call: &'static str, code: CUresult) -> Result<(), Failure> {
    code.result().map_err(|error| Failure::new(call, error))
}

fn device_name(ordinal: usize) -> String {
    format!("cuda:{ordinal}")
}

/// One device to act on.
#[derive(Debug, Clone, Copy)]
struct Target {
    ordinal: usize,
    device: sys::CUdevice,
    context: TargetContext,
}

#[derive(Debug, Clone, Copy)]
enum TargetContext {
    /// The device's primary context, active when it was listed: retained for each use.
    Primary,
    /// A context the backend holds an `Arc` of: alive as long as the backend.
    Given(sys::CUcontext),
}

impl Target {
    /// Runs `work` with this target's context current, then restores the thread's previous one.
    fn with_current<T>(&self, work: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
        match self.context {
            TargetContext::Given(context) => {
                push_run_pop(context, work).map_err(|failure| failure.on(self.ordinal))
            }
            TargetContext::Primary => {
                let mut context: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: `device` came from cuDeviceGet; `context` is a valid out-pointer. The
                // primary context was active when listed, so retaining it does not create one
                // (but for a race with its last release, where the driver re-creates it).
                check("cuDevicePrimaryCtxRetain", unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut context, self.device)
                })
                .map_err(|failure| failure.on(self.ordinal))?;
                let outcome = push_run_pop(context, work);
                // SAFETY: balances the successful retain above, on the same device.
                let released = check("cuDevicePrimaryCtxRelease_v2", unsafe {
                    sys::cuDevicePrimaryCtxRelease_v2(self.device)
                });
                outcome
                    .and_then(|value| released.map(|()| value))
                    .map_err(|failure| failure.on(self.ordinal))
            }
        }
    }
}

/// Pushes `context`, runs `work`, pops it again (whatever `work` returned).
fn push_run_pop<T>(
    context: sys::CUcontext,
    work: impl FnOnce() -> Result<T, Failure>,
) -> Result<T, Failure> {
    // SAFETY: `context` is alive: retained by the caller, or held by an Arc<CudaContext>.
    check("cuCtxPushCurrent_v2", unsafe {
        sys::cuCtxPushCurrent_v2(context)
    })?;
    let outcome = work();
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above; `popped` is a valid out-pointer.
    let popped_ok = check("cuCtxPopCurrent_v2", unsafe {
        sys::cuCtxPopCurrent_v2(&mut popped)
    });
    outcome.and_then(|value| popped_ok.map(|()| value))
}

/// Every device whose primary context is active, without initialising or loading anything.
fn active_primary_contexts() -> Result<Vec<Target>, Failure> {
    // Once seen loaded, libcuda stays loaded (cudarc never closes it); until then, ask the
    // loader each time: CUDA may be started after the first search.
    static SEEN_LOADED: AtomicBool = AtomicBool::new(false);
    if !SEEN_LOADED.load(Ordering::Relaxed) && driver_library_loaded() {
        SEEN_LOADED.store(true, Ordering::Relaxed);
    }
    if !SEEN_LOADED.load(Ordering::Relaxed) {
        static NOT_LOADED: Once = Once::new();
        NOT_LOADED.call_once(|| {
            tracing::debug!("libcuda is not loaded in this process: no CUDA memory to release")
        });
        return Ok(Vec::new());
    }
    let count = match result::device::get_count() {
        Ok(count) => count,
        // The driver is loaded but nobody called cuInit (or it failed, or the process is
        // exiting): no context can exist.
        Err(DriverError(
            CUresult::CUDA_ERROR_NOT_INITIALIZED
            | CUresult::CUDA_ERROR_DEINITIALIZED
            | CUresult::CUDA_ERROR_NO_DEVICE,
        )) => return Ok(Vec::new()),
        Err(error) => return Err(Failure::new("cuDeviceGetCount", error)),
    };
    let mut targets = Vec::new();
    for ordinal in 0..count {
        let index = usize::try_from(ordinal).unwrap_or_default();
        let device = result::device::get(ordinal)
            .map_err(|error| Failure::new("cuDeviceGet", error).on(index))?;
        let mut flags: std::ffi::c_uint = 0;
        let mut active: std::ffi::c_int = 0;
        // SAFETY: `device` came from cuDeviceGet; both out-pointers are valid locals.
        check("cuDevicePrimaryCtxGetState", unsafe {
            sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active)
        })
        .map_err(|failure| failure.on(index))?;
        if active != 0 {
            targets.push(Target {
                ordinal: index,
                device,
                context: TargetContext::Primary,
            });
        }
    }
    Ok(targets)
}

/// The device's default memory pool, or `None` where the device has no pools.
fn default_pool(device: sys::CUdevice) -> Result<Option<sys::CUmemoryPool>, Failure> {
    // SAFETY: `device` came from cuDeviceGet or from a live CudaContext.
    let supported = unsafe {
        result::device::get_attribute(
            device,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
        )
    };
    if !matches!(supported, Ok(value) if value > 0) {
        return Ok(None);
    }
    // SAFETY: as above; pools are supported on this device.
    let pool = unsafe { result::device::get_default_mem_pool(device) }
        .map_err(|error| Failure::new("cuDeviceGetDefaultMemPool", error))?;
    Ok(Some(pool))
}

/// Synchronize the current context, then give the pool's unused memory back to the device.
fn release_device(target: &Target) -> Result<(), Failure> {
    result::ctx::synchronize().map_err(|error| Failure::new("cuCtxSynchronize", error))?;
    if let Some(pool) = default_pool(target.device)? {
        // SAFETY: `pool` is the device's default pool, which lives as long as the device.
        unsafe { result::mem_pool::trim_to(pool, 0) }
            .map_err(|error| Failure::new("cuMemPoolTrimTo", error))?;
    }
    Ok(())
}

fn pool_attribute(pool: sys::CUmemoryPool, attribute: CUmemPool_attribute) -> Option<u64> {
    let mut value: u64 = 0;
    // SAFETY: the reserved/used attributes are cuuint64_t, which `value` is.
    unsafe {
        result::mem_pool::get_attribute(pool, attribute, (&mut value as *mut u64).cast::<c_void>())
    }
    .ok()
    .map(|()| value)
}

/// The figures of the device whose context is current.
fn read_device(target: &Target) -> Result<DeviceMemory, Failure> {
    let (free, total) =
        result::mem_get_info().map_err(|error| Failure::new("cuMemGetInfo_v2", error))?;
    let mut memory = DeviceMemory {
        device: device_name(target.ordinal),
        total: total as u64,
        free: free as u64,
        pool_reserved: None,
        pool_used: None,
        peak: None,
    };
    if let Ok(Some(pool)) = default_pool(target.device) {
        memory.pool_reserved = pool_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        );
        memory.pool_used =
            pool_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        memory.peak = pool_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
    }
    Ok(memory)
}

fn reset_device_peak(target: &Target) -> Result<(), Failure> {
    if let Some(pool) = default_pool(target.device)? {
        let mut zero: u64 = 0;
        // SAFETY: USED_MEM_HIGH is a cuuint64_t and may only be set to zero, which `zero` is.
        unsafe {
            result::mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast::<c_void>(),
            )
        }
        .map_err(|error| Failure::new("cuMemPoolSetAttribute", error))?;
    }
    Ok(())
}

/// Whether an object the dynamic loader holds is named `libcuda.so*`, by `dl_iterate_phdr`
/// (which touches no file, unlike `dlopen(RTLD_NOLOAD)`), stopping early while nothing was loaded.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn driver_library_loaded() -> bool {
    loader::libcuda_in_the_list()
}

/// The loader's list of objects, walked for libcuda (see [`driver_library_loaded`]).
#[cfg(any(target_os = "linux", target_os = "android"))]
mod loader {
    use std::ffi::{c_char, c_int, c_ulonglong, c_ushort, c_void, CStr};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// `struct dl_phdr_info` up to `dlpi_subs`; the loader's `size` says whether they are there.
    #[repr(C)]
    struct DlPhdrInfo {
        addr: usize,
        name: *const c_char,
        phdr: *const c_void,
        phnum: c_ushort,
        adds: c_ulonglong,
        subs: c_ulonglong,
    }

    type Callback = unsafe extern "C" fn(*mut DlPhdrInfo, usize, *mut c_void) -> c_int;

    unsafe extern "C" {
        // glibc, musl and bionic (API 21+) all provide it.
        fn dl_iterate_phdr(callback: Option<Callback>, data: *mut c_void) -> c_int;
    }

    /// The loader's counters (one word) at the last walk that found no libcuda; 0 before any.
    static ABSENT_AT: AtomicU64 = AtomicU64::new(0);
    fn stamp(adds: u64, subs: u64) -> u64 {
        (adds << 32) | (subs & 0xFFFF_FFFF)
    }

    const FOUND: c_int = 1;
    const UNCHANGED: c_int = 2;

    struct Walk {
        first: bool,
        counters: Option<(u64, u64)>,
    }

    /// Stops the walk with FOUND for libcuda, or UNCHANGED where the counters say nothing changed.
    unsafe extern "C" fn visit(info: *mut DlPhdrInfo, size: usize, data: *mut c_void) -> c_int {
        if info.is_null() || data.is_null() {
            return 0;
        }
        // SAFETY: `data` is the `Walk` passed below, alive and not otherwise borrowed during
        // the walk.
        let walk = unsafe { &mut *data.cast::<Walk>() };
        if walk.first {
            walk.first = false;
            if size >= std::mem::size_of::<DlPhdrInfo>() {
                // SAFETY: the loader says the struct is this large, so the counters are there.
                let (adds, subs) = unsafe { ((*info).adds, (*info).subs) };
                walk.counters = Some((adds, subs));
                if stamp(adds, subs) == ABSENT_AT.load(Ordering::Relaxed) {
                    return UNCHANGED;
                }
            }
        }
        // SAFETY: the loader passes a valid dl_phdr_info, which starts with these fields.
        let name = unsafe { (*info).name };
        if name.is_null() {
            return 0;
        }
        // SAFETY: dlpi_name is a NUL-terminated string that lives during the callback.
        let path = unsafe { CStr::from_ptr(name) }.to_bytes();
        let file = path.rsplit(|&byte| byte == b'/').next().unwrap_or(path);
        if file.starts_with(b"libcuda.so") {
            FOUND
        } else {
            0
        }
    }

    /// Walks the loader's list: whether libcuda is there.
    pub(super) fn libcuda_in_the_list() -> bool {
        let mut walk = Walk {
            first: true,
            counters: None,
        };
        // SAFETY: the callback only reads the entry it is given and the `Walk`, and cannot unwind.
        let outcome =
            unsafe { dl_iterate_phdr(Some(visit), std::ptr::addr_of_mut!(walk).cast::<c_void>()) };
        match outcome {
            FOUND => true,
            UNCHANGED => false,
            _ => {
                if let Some((adds, subs)) = walk.counters {
                    ABSENT_AT.store(stamp(adds, subs), Ordering::Relaxed);
                }
                false
            }
        }
    }
}

/// Whether nvcuda.dll is already loaded (`GetModuleHandleExW`, which never loads it).
#[cfg(windows)]
fn driver_library_loaded() -> bool {
    libloading::os::windows::Library::open_already_loaded("nvcuda.dll").is_ok()
}

/// No CUDA driver exists for this platform: CUDA cannot be in use.
#[cfg(not(any(target_os = "linux", target_os = "android", windows)))]
fn driver_library_loaded() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn does_nothing_where_libcuda_is_not_loaded() {
        // This unit-test binary never loads libcuda.
        assert!(!CudaBackend::driver_loaded());
        let backend = CudaBackend::active();
        assert!(backend.release().is_ok());
        assert!(backend.memory().is_empty());
        backend.reset_peak();
    }

    #[test]
    fn failures_name_the_call_device_and_code_without_the_driver() {
        let failure = Failure::new(
            "cuMemPoolTrimTo",
            DriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
        )
        .on(1)
        .on(2);
        assert_eq!(
            failure.into_release_error().to_string(),
            "releasing device memory failed: cuMemPoolTrimTo returned CUDA_ERROR_INVALID_VALUE on cuda:1"
        );
    }

    #[test]
    fn a_panic_in_cudarc_becomes_a_failure() {
        let outcome: Result<(), Failure> =
            guarded(|| std::panic::resume_unwind(Box::new("Missing symbol cuMemPoolTrimTo")));
        let failure = outcome.err().map(|failure| failure.on(0).to_string());
        assert_eq!(
            failure.as_deref(),
            Some("a CUDA driver call panicked in cudarc (libcuda could not be opened, or lacks the function) on cuda:0")
        );
        assert!(guarded(|| Ok(7)).is_ok_and(|value| value == 7));
    }

    #[test]
    fn debug_names_the_devices() {
        assert_eq!(
            format!("{:?}", CudaBackend::active()),
            "CudaBackend(active primary contexts)"
        );
        assert_eq!(
            format!("{:?}", CudaBackend::with_contexts(Vec::new())),
            "CudaBackend([])"
        );
        assert_eq!(
            format!("{:?}", CudaBackend::default()),
            "CudaBackend(active primary contexts)"
        );
    }
}
