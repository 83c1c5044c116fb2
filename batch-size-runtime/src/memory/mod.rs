//! Device memory between attempts: the [`MemoryBackend`] trait the engine calls, the figures it
//! reads, and [`Release`], the choice of backend that `release = ...` names.
//!
//! After an out-of-memory attempt returns or unwinds, Rust has dropped everything it held, but
//! stream-ordered pools (CUDA's default pool, frameworks' caching allocators) keep the freed
//! memory reserved. The engine therefore asks the backend to give it back before the next
//! attempt, and reads the figures around every attempt so that logs and errors can say where
//! the memory went.
//!
//! ```
//! use batch_size_runtime::{last_report, BatchSizeSearch, SimulatedDevice};
//!
//! // A caching device keeps freed memory reserved, as CUDA's pools do.
//! let device = SimulatedDevice::new(1000).with_caching();
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(8)
//!     .with_release(device.clone())
//!     .run(|batch_size| {
//!         let _weights = device.alloc(300)?;
//!         let _batch = device.alloc(batch_size as u64 * 100)?;
//!         Ok(batch_size)
//!     });
//! assert_eq!(fitted.unwrap(), 6); // 7 fill the device; 5 % is kept free
//!
//! let report = last_report().unwrap();
//! let failed = report.attempts().next().unwrap();
//! assert_eq!(failed.memory_at_end.as_ref().unwrap().free(), 700); // the weights, cached
//! assert_eq!(failed.memory_after_release.as_ref().unwrap().free(), 1000);
//! ```

#[cfg(feature = "burn")]
mod burn;
#[cfg(feature = "burn")]
mod burn_dry_run;
mod cuda;
mod host;
#[cfg(feature = "ort")]
mod ort;
mod tch;
#[cfg(feature = "wgpu")]
mod wgpu;

use std::fmt;
use std::sync::{Arc, OnceLock};

pub use cuda::CudaBackend;
pub use host::{HostLimit, HostLimitKind, HostMemory};

#[cfg(feature = "burn")]
pub use self::burn::BurnMemory;
#[cfg(feature = "burn")]
pub use self::burn_dry_run::BurnDryRun;
#[cfg(feature = "ort")]
pub use self::ort::OrtArena;
#[cfg(feature = "wgpu")]
pub use self::wgpu::WgpuMemory;

/// A byte count that displays itself the way PyTorch's OOM message does (`2.22 GiB`).
///
/// ```
/// use batch_size_runtime::memory::Bytes;
///
/// assert_eq!(Bytes(228 * 1024 * 1024).to_string(), "228.00 MiB");
/// assert_eq!(Bytes(512).to_string(), "512 bytes");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
        if self.0 < 1024 {
            return write!(f, "{} bytes", self.0);
        }
        let mut value = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.2} {}", UNITS[unit])
    }
}

/// The memory of one device at one moment.
///
/// ```
/// use batch_size_runtime::memory::DeviceMemory;
///
/// let memory = DeviceMemory {
///     device: "cuda:0".to_owned(),
///     total: 80 << 30,
///     free: 1 << 30,
///     pool_reserved: Some(70 << 30),
///     pool_used: Some(60 << 30),
///     peak: Some(75 << 30),
/// };
/// assert_eq!(
///     memory.to_string(),
///     "cuda:0 has a total capacity of 80.00 GiB of which 1.00 GiB is free; 60.00 GiB is \
///      allocated and 10.00 GiB is reserved by the pool but unallocated; the attempt's peak \
///      was 75.00 GiB"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device's name in logs: `cuda:0`, `sim:0`.
    pub device: String,
    /// Total bytes of the device.
    pub total: u64,
    /// Bytes free on the device (what `cuMemGetInfo` reports: memory held in a pool is not free).
    pub free: u64,
    /// Bytes the memory pool holds from the device, in use or not, when known.
    pub pool_reserved: Option<u64>,
    /// Bytes of the pool in use by live allocations, when known.
    pub pool_used: Option<u64>,
    /// The most bytes in use at once since the peak was last reset (before each attempt).
    pub peak: Option<u64>,
}

impl fmt::Display for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} has a total capacity of {} of which {} is free",
            self.device,
            Bytes(self.total),
            Bytes(self.free)
        )?;
        match (self.pool_used, self.pool_reserved) {
            (Some(used), Some(reserved)) => write!(
                f,
                "; {} is allocated and {} is reserved by the pool but unallocated",
                Bytes(used),
                Bytes(reserved.saturating_sub(used))
            )?,
            (None, Some(reserved)) => write!(f, "; the pool reserves {}", Bytes(reserved))?,
            (Some(used), None) => write!(f, "; {} is allocated", Bytes(used))?,
            (None, None) => {}
        }
        if let Some(peak) = self.peak {
            write!(f, "; the attempt's peak was {}", Bytes(peak))?;
        }
        Ok(())
    }
}

/// The memory of every device a backend watches, at one moment (empty when unknown).
///
/// ```
/// use batch_size_runtime::memory::MemoryBackend;
/// use batch_size_runtime::SimulatedDevice;
///
/// let device = SimulatedDevice::new(1000);
/// let _held = device.alloc(400)?;
/// let snapshot = device.memory();
/// assert!(!snapshot.is_empty());
/// assert_eq!(snapshot.free(), 600);
/// assert_eq!(snapshot.devices[0].device, "sim:0");
/// assert_eq!(snapshot.devices[0].pool_used, Some(400));
/// # Ok::<(), batch_size_runtime::OutOfMemory>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// One entry per device.
    pub devices: Vec<DeviceMemory>,
}

impl MemorySnapshot {
    /// Whether no device was read.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemorySnapshot;
    /// assert!(MemorySnapshot::default().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Free bytes summed over the devices.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemoryBackend;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let mut snapshot = SimulatedDevice::new(100).memory();
    /// snapshot.devices.extend(SimulatedDevice::new(50).named("sim:1").memory().devices);
    /// assert_eq!(snapshot.free(), 150);
    /// ```
    pub fn free(&self) -> u64 {
        self.devices.iter().map(|device| device.free).sum()
    }
}

impl fmt::Display for MemorySnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, device) in self.devices.iter().enumerate() {
            if index > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{device}")?;
        }
        Ok(())
    }
}

/// Releasing memory failed. The engine logs it at WARN and goes on: it never hides the error
/// that made the attempt fail.
///
/// ```
/// use batch_size_runtime::memory::{MemoryBackend, MemorySnapshot, ReleaseError};
/// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
///
/// #[derive(Debug)]
/// struct BusyPool;
///
/// impl MemoryBackend for BusyPool {
///     fn release(&self) -> Result<(), ReleaseError> {
///         Err(ReleaseError::new("the pool is busy"))
///     }
///     fn memory(&self) -> MemorySnapshot {
///         MemorySnapshot::default()
///     }
/// }
///
/// // The failed release is logged; the search goes on.
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(8)
///     .with_release(BusyPool)
///     .run(|batch_size| {
///         if batch_size > 2 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
///     });
/// assert_eq!(fitted.unwrap(), 2);
/// ```
#[derive(Debug, thiserror::Error)]
#[error("releasing device memory failed: {message}")]
pub struct ReleaseError {
    message: String,
}

impl ReleaseError {
    /// A release failure with its reason.
    ///
    /// ```
    /// # use batch_size_runtime::memory::ReleaseError;
    /// let error = ReleaseError::new("cuMemPoolTrimTo returned CUDA_ERROR_INVALID_VALUE");
    /// assert_eq!(
    ///     error.to_string(),
    ///     "releasing device memory failed: cuMemPoolTrimTo returned CUDA_ERROR_INVALID_VALUE"
    /// );
    /// ```
    pub fn new(message: impl Into<String>) -> Self {
        ReleaseError {
            message: message.into(),
        }
    }
}

/// Gives device memory back between attempts and reads the figures that logs and errors show.
///
/// The engine calls [`reset_peak`](Self::reset_peak) and reads [`memory`](Self::memory)
/// before each attempt, reads `memory` again when an attempt runs out of memory, then calls
/// [`release`](Self::release) and reads `memory` once more. Implement it for an allocator this
/// crate cannot see; for a cache that only needs a call, [`Release::hook`] is shorter.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use batch_size_runtime::memory::{MemoryBackend, MemorySnapshot, ReleaseError};
/// use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
///
/// #[derive(Debug, Clone, Default)]
/// struct MyPool {
///     releases: Arc<AtomicUsize>,
/// }
///
/// impl MemoryBackend for MyPool {
///     fn release(&self) -> Result<(), ReleaseError> {
///         // give cached blocks back to the device here
///         self.releases.fetch_add(1, Ordering::Relaxed);
///         Ok(())
///     }
///     fn memory(&self) -> MemorySnapshot {
///         MemorySnapshot::default() // figures unknown
///     }
/// }
///
/// let pool = MyPool::default();
/// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(8)
///     .with_release(pool.clone())
///     .run(|batch_size| {
///         if batch_size > 2 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
///     });
/// assert_eq!(fitted.unwrap(), 2);
/// assert_eq!(pool.releases.load(Ordering::Relaxed), 2); // after 8 and after 4
/// ```
pub trait MemoryBackend: Send + Sync + fmt::Debug {
    /// Gives cached memory back to the device. Called after every out-of-memory attempt.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemoryBackend;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let device = SimulatedDevice::new(100).with_caching();
    /// drop(device.alloc(60)?);
    /// assert_eq!(device.free(), 40);
    /// device.release()?;
    /// assert_eq!(device.free(), 100);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    fn release(&self) -> Result<(), ReleaseError>;

    /// Reads the memory figures now. An empty snapshot means "unknown".
    ///
    /// ```
    /// # use batch_size_runtime::memory::{MemoryBackend, NoRelease};
    /// # use batch_size_runtime::SimulatedDevice;
    /// assert_eq!(SimulatedDevice::new(100).memory().free(), 100);
    /// assert!(NoRelease.memory().is_empty());
    /// ```
    fn memory(&self) -> MemorySnapshot;

    /// Starts a new peak, so that each attempt reports its own. Does nothing by default.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemoryBackend;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// drop(device.alloc(70)?);
    /// let _held = device.alloc(20)?;
    /// device.reset_peak();
    /// assert_eq!(device.peak(), 20); // what is live now
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    fn reset_peak(&self) {}

    /// Before an attempt: starts a new peak and reads the figures, in one go (the engine calls
    /// this at the start of every attempt, on the success path: a backend can share the work
    /// of both, as the CUDA backend finds its devices once). Default: `reset_peak`, then
    /// `memory`.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemoryBackend;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// drop(device.alloc(70)?);
    /// let at_start = device.start_attempt();
    /// assert_eq!((device.peak(), at_start.free()), (0, 100));
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    fn start_attempt(&self) -> MemorySnapshot {
        self.reset_peak();
        self.memory()
    }
}

/// A backend that releases nothing and reads nothing.
///
/// ```
/// use batch_size_runtime::memory::{MemoryBackend, NoRelease};
///
/// assert!(NoRelease.release().is_ok());
/// assert!(NoRelease.memory().is_empty());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRelease;

impl MemoryBackend for NoRelease {
    fn release(&self) -> Result<(), ReleaseError> {
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        MemorySnapshot::default()
    }
}

type Hook = Arc<dyn Fn() + Send + Sync>;

/// What the engine does with device memory between attempts: a backend, plus hooks run with
/// each release. This is what `release = ...` of the attribute takes (anything `Into<Release>`).
///
/// # Default
/// [`Release::cuda()`]: the CUDA backend over every device whose primary context is active,
/// which does nothing where libcuda is absent or unused.
///
/// ```
/// use batch_size_runtime::memory::Release;
/// use batch_size_runtime::SimulatedDevice;
///
/// let default = Release::default();               // CUDA, where it is in use
/// let nothing = Release::none();                  // nothing to release
/// let burn = Release::hook(|| { /* B::memory_cleanup(&device) */ }); // CUDA + a framework cache
/// let simulated: Release = SimulatedDevice::new(1 << 30).into();
///
/// assert!(default.memory_backend().memory().is_empty()); // no CUDA in use in this process
/// assert!(nothing.memory_backend().memory().is_empty());
/// assert!(burn.memory_backend().memory().is_empty()); // CUDA's figures: none here
/// assert_eq!(simulated.memory_backend().memory().free(), 1 << 30);
/// ```
#[derive(Clone)]
pub struct Release {
    backend: Backend,
    hooks: Vec<Hook>,
}

/// The defaults are process-wide statics, shared without reference counting: the success path
/// of a search with the default release touches no atomic.
#[derive(Clone)]
enum Backend {
    Static(&'static dyn MemoryBackend),
    Shared(Arc<dyn MemoryBackend>),
}

impl Backend {
    fn get(&self) -> &dyn MemoryBackend {
        match self {
            Backend::Static(backend) => *backend,
            Backend::Shared(backend) => &**backend,
        }
    }
}

impl Release {
    /// The CUDA backend over every device whose primary context is active.
    ///
    /// ```
    /// # use batch_size_runtime::memory::Release;
    /// let release = Release::cuda();
    /// assert!(release.memory_backend().memory().is_empty()); // no CUDA in use in this process
    /// ```
    pub fn cuda() -> Self {
        // One backend for the process: the default release costs no allocation per call.
        static CUDA: OnceLock<CudaBackend> = OnceLock::new();
        Release {
            backend: Backend::Static(CUDA.get_or_init(CudaBackend::active)),
            hooks: Vec::new(),
        }
    }

    /// The host's memory, for training on the CPU: [`HostMemory`] (the tightest of
    /// `RLIMIT_AS`, the cgroup's limit and physical memory; `malloc_trim(0)` at each release).
    /// Not the default: see [`host`](HostMemory#not-the-default).
    ///
    /// ```
    /// # use batch_size_runtime::memory::Release;
    /// let release = Release::host();
    /// assert_eq!(release.memory_backend().memory().devices.len(), usize::from(cfg!(target_os = "linux")));
    /// ```
    pub fn host() -> Self {
        static HOST: OnceLock<HostMemory> = OnceLock::new();
        Release {
            backend: Backend::Static(HOST.get_or_init(HostMemory::new)),
            hooks: Vec::new(),
        }
    }

    /// Releases nothing and reads no figures.
    ///
    /// ```
    /// # use batch_size_runtime::memory::Release;
    /// let release = Release::none();
    /// assert!(release.memory_backend().release().is_ok());
    /// assert!(release.memory_backend().memory().is_empty());
    /// ```
    pub fn none() -> Self {
        static NONE: NoRelease = NoRelease;
        Release {
            backend: Backend::Static(&NONE),
            hooks: Vec::new(),
        }
    }

    /// The given backend.
    ///
    /// ```
    /// # use batch_size_runtime::memory::Release;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let release = Release::backend(SimulatedDevice::new(100).named("sim:3"));
    /// assert_eq!(release.memory_backend().memory().devices[0].device, "sim:3");
    /// ```
    pub fn backend(backend: impl MemoryBackend + 'static) -> Self {
        Release {
            backend: Backend::Shared(Arc::new(backend)),
            hooks: Vec::new(),
        }
    }

    /// The CUDA backend plus `hook`, run after it at each release: for caches this crate
    /// cannot reach (burn's `memory_cleanup`, libtorch's `emptyCache`, your own pool).
    ///
    /// ```
    /// # use std::sync::atomic::{AtomicUsize, Ordering};
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Release};
    /// static CLEANUPS: AtomicUsize = AtomicUsize::new(0);
    ///
    /// let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(8)
    ///     .with_release(Release::hook(|| {
    ///         CLEANUPS.fetch_add(1, Ordering::Relaxed); // e.g. B::memory_cleanup(&device)
    ///     }))
    ///     .run(|batch_size| {
    ///         if batch_size > 2 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(fitted.unwrap(), 2);
    /// assert_eq!(CLEANUPS.load(Ordering::Relaxed), 2); // after 8 and after 4
    /// ```
    ///
    /// burn and cubecl keep freed memory in their own pools, as CUDA's does: the one line for
    /// them hands `Backend::memory_cleanup` the device the attempt used (a stand-in for burn's
    /// trait here):
    ///
    /// ```
    /// # use std::sync::atomic::{AtomicUsize, Ordering};
    /// # use batch_size_runtime::{find_executable_batch_size, OutOfMemory, Release};
    /// # static CLEANED: AtomicUsize = AtomicUsize::new(0);
    /// # #[derive(Clone, Debug)] struct CudaDevice;
    /// # trait Backend { type Device; fn memory_cleanup(device: &Self::Device); }
    /// # struct Cuda;
    /// # impl Backend for Cuda {
    /// #     type Device = CudaDevice;
    /// #     fn memory_cleanup(_: &CudaDevice) { CLEANED.fetch_add(1, Ordering::Relaxed); }
    /// # }
    /// #[find_executable_batch_size(starting = 64, release = {
    ///     let device = device.clone();
    ///     Release::hook(move || Cuda::memory_cleanup(&device))
    /// })]
    /// fn train(batch_size: usize, device: &CudaDevice) -> anyhow::Result<usize> {
    ///     if batch_size > 16 { Err(OutOfMemory::new())? } // burn's IoError::OutOfMemory, say
    ///     Ok(batch_size)
    /// }
    /// assert_eq!(train(&CudaDevice)?, 16);
    /// assert_eq!(CLEANED.load(Ordering::Relaxed), 2); // after 64 and after 32
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// candle on CUDA needs nothing more than the default: it allocates from the device's
    /// default pool, which the CUDA backend synchronizes and trims. wgpu's memory is the
    /// Vulkan, Metal or DirectX 12 driver's, out of reach of CUDA: drop the attempt's buffers
    /// (returning does) and poll the device in a hook.
    pub fn hook(hook: impl Fn() + Send + Sync + 'static) -> Self {
        Release::cuda().with_hook(hook)
    }

    /// Adds a hook, run after the backend's release and after the hooks added before it.
    ///
    /// ```
    /// # use std::sync::Mutex;
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Release, SimulatedDevice};
    /// static RAN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    ///
    /// let device = SimulatedDevice::new(100);
    /// let seen = device.clone();
    /// let release = Release::backend(device.clone())
    ///     .with_hook(move || {
    ///         RAN.lock().unwrap().push(format!("first, after {} release", seen.release_count()))
    ///     })
    ///     .with_hook(|| RAN.lock().unwrap().push("second".to_owned()));
    ///
    /// let fitted: Result<usize, anyhow::Error> =
    ///     BatchSizeSearch::new(2).with_release(release).run(|batch_size| {
    ///         if batch_size > 1 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
    ///     });
    /// assert_eq!(fitted.unwrap(), 1);
    /// assert_eq!(*RAN.lock().unwrap(), ["first, after 1 release", "second"]);
    /// ```
    pub fn with_hook(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// The backend in use.
    ///
    /// ```
    /// # use batch_size_runtime::memory::Release;
    /// # use batch_size_runtime::SimulatedDevice;
    /// let release: Release = SimulatedDevice::new(100).into();
    /// assert_eq!(release.memory_backend().memory().free(), 100);
    /// ```
    pub fn memory_backend(&self) -> &dyn MemoryBackend {
        self.backend.get()
    }

    pub(crate) fn release(&self) -> Result<(), ReleaseError> {
        let released = self.backend.get().release();
        for hook in &self.hooks {
            hook();
        }
        released
    }

    pub(crate) fn memory(&self) -> MemorySnapshot {
        self.backend.get().memory()
    }

    pub(crate) fn start_attempt(&self) -> MemorySnapshot {
        self.backend.get().start_attempt()
    }
}

impl Default for Release {
    fn default() -> Self {
        Release::cuda()
    }
}

impl fmt::Debug for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Release")
            .field("backend", &self.backend.get())
            .field("hooks", &self.hooks.len())
            .finish()
    }
}

impl<B: MemoryBackend + 'static> From<B> for Release {
    fn from(backend: B) -> Self {
        Release::backend(backend)
    }
}
