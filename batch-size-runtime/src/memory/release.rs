//! [`Release`]: the backend the engine reads and releases between attempts, and the hooks run
//! with each release; what `release = ...` of the attribute takes.

use std::fmt;
use std::sync::{Arc, OnceLock};

use super::*;

type Hook = Arc<dyn Fn() + Send + Sync>;

/// What the engine does with device memory between attempts: a backend, plus hooks run with
/// each release. This is what `release = ...` of the attribute takes (anything `Into<Release>`).
///
/// # Default
/// [`Release::cuda()`]: the CUDA backend over every device whose primary context is active,
/// which does nothing where libcuda is absent or unused.
///
/// ```
/// use batch_size_runtime::Release;
/// use batch_size_runtime::memory::SimulatedDevice;
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

/// A backend: the defaults are statics, so the default release's success path touches no atomic.
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
    /// # use batch_size_runtime::Release;
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
    /// # use batch_size_runtime::Release;
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
    /// # use batch_size_runtime::Release;
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
    /// # use batch_size_runtime::Release;
    /// # use batch_size_runtime::memory::SimulatedDevice;
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
    /// # use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Release, memory::SimulatedDevice};
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
    /// # use batch_size_runtime::Release;
    /// # use batch_size_runtime::memory::SimulatedDevice;
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
