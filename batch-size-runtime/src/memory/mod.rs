//! Device memory between attempts: the [`MemoryBackend`] trait the engine calls, the figures it
//! reads, and [`Release`], the choice of backend that `release = ...` names.
//!
//! After an out-of-memory attempt returns or unwinds, Rust has dropped everything it held, but
//! stream-ordered pools (CUDA's default pool, frameworks' caching allocators) keep the freed
//! memory reserved. The engine therefore asks the backend to give it back before the next
//! attempt, and reads the figures around every attempt so that logs and errors can say where
//! the memory went.

mod cuda;

use std::fmt;
use std::sync::{Arc, OnceLock};

pub use cuda::CudaBackend;

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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// One entry per device.
    pub devices: Vec<DeviceMemory>,
}

impl MemorySnapshot {
    /// Whether no device was read.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Free bytes summed over the devices.
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
#[derive(Debug, thiserror::Error)]
#[error("releasing device memory failed: {message}")]
pub struct ReleaseError {
    message: String,
}

impl ReleaseError {
    /// A release failure with its reason.
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
/// use batch_size_runtime::memory::{MemoryBackend, MemorySnapshot, ReleaseError};
///
/// #[derive(Debug)]
/// struct MyPool;
///
/// impl MemoryBackend for MyPool {
///     fn release(&self) -> Result<(), ReleaseError> {
///         // give cached blocks back to the device here
///         Ok(())
///     }
///     fn memory(&self) -> MemorySnapshot {
///         MemorySnapshot::default()
///     }
/// }
/// ```
pub trait MemoryBackend: Send + Sync + fmt::Debug {
    /// Gives cached memory back to the device. Called after every out-of-memory attempt.
    fn release(&self) -> Result<(), ReleaseError>;

    /// Reads the memory figures now. An empty snapshot means "unknown".
    fn memory(&self) -> MemorySnapshot;

    /// Starts a new peak, so that each attempt reports its own. Does nothing by default.
    fn reset_peak(&self) {}
}

/// A backend that releases nothing and reads nothing.
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
/// # let _ = (default, nothing, burn, simulated);
/// ```
#[derive(Clone)]
pub struct Release {
    backend: Arc<dyn MemoryBackend>,
    hooks: Vec<Hook>,
}

impl Release {
    /// The CUDA backend over every device whose primary context is active.
    pub fn cuda() -> Self {
        // One backend for the process: the default release costs no allocation per call.
        static CUDA: OnceLock<Arc<dyn MemoryBackend>> = OnceLock::new();
        Release {
            backend: Arc::clone(CUDA.get_or_init(|| Arc::new(CudaBackend::active()))),
            hooks: Vec::new(),
        }
    }

    /// Releases nothing and reads no figures.
    pub fn none() -> Self {
        static NONE: OnceLock<Arc<dyn MemoryBackend>> = OnceLock::new();
        Release {
            backend: Arc::clone(NONE.get_or_init(|| Arc::new(NoRelease))),
            hooks: Vec::new(),
        }
    }

    /// The given backend.
    pub fn backend(backend: impl MemoryBackend + 'static) -> Self {
        Release {
            backend: Arc::new(backend),
            hooks: Vec::new(),
        }
    }

    /// The CUDA backend plus `hook`, run after it at each release: for caches this crate
    /// cannot reach (burn's `memory_cleanup`, libtorch's `emptyCache`, your own pool).
    pub fn hook(hook: impl Fn() + Send + Sync + 'static) -> Self {
        Release::cuda().with_hook(hook)
    }

    /// Adds a hook, run after the backend's release and after the hooks added before it.
    pub fn with_hook(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// The backend in use.
    pub fn memory_backend(&self) -> &dyn MemoryBackend {
        &*self.backend
    }

    pub(crate) fn release(&self) -> Result<(), ReleaseError> {
        let released = self.backend.release();
        for hook in &self.hooks {
            hook();
        }
        released
    }

    pub(crate) fn memory(&self) -> MemorySnapshot {
        self.backend.memory()
    }

    pub(crate) fn reset_peak(&self) {
        self.backend.reset_peak();
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
            .field("backend", &self.backend)
            .field("hooks", &self.hooks.len())
            .finish()
    }
}

impl<B: MemoryBackend + 'static> From<B> for Release {
    fn from(backend: B) -> Self {
        Release::backend(backend)
    }
}
