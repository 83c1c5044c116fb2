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
//! use batch_size_runtime::{last_report, BatchSizeSearch, memory::SimulatedDevice};
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
mod dry_run;
mod host;
#[cfg(feature = "ort")]
mod ort;
pub(crate) mod out_of_memory;
pub(crate) mod release;
mod simulated;
mod tch;
#[cfg(feature = "wgpu")]
mod wgpu;

use std::fmt;

pub use cuda::CudaBackend;
pub use dry_run::{DryRun, DrySizing};
/// A `Key:   1234 kB` line of a `/proc` status file, in bytes (one parser for every reader).
pub(crate) use host::kilobytes as status_kilobytes;
pub(crate) use host::malloc_free_bytes;
pub use host::{HostLimit, HostLimitKind, HostMemory};
pub(crate) use out_of_memory::OutOfMemory;
pub(crate) use release::Release;
pub use simulated::{SimAllocation, SimulatedDevice};

#[cfg(feature = "burn")]
#[cfg_attr(docsrs, doc(cfg(feature = "burn")))]
pub use self::burn::BurnMemory;
#[cfg(feature = "burn")]
#[cfg_attr(docsrs, doc(cfg(feature = "burn")))]
pub use self::burn_dry_run::BurnDryRun;
#[cfg(feature = "ort")]
#[cfg_attr(docsrs, doc(cfg(feature = "ort")))]
pub use self::ort::OrtArena;
#[cfg(feature = "wgpu")]
#[cfg_attr(docsrs, doc(cfg(feature = "wgpu")))]
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
            // On the host (`cpu`) there is no pool: what is held is the process's own memory.
            (None, Some(reserved)) if self.device == "cpu" => {
                write!(f, "; the process holds {}", Bytes(reserved))?
            }
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
/// use batch_size_runtime::memory::SimulatedDevice;
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
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let mut snapshot = SimulatedDevice::new(100).memory();
    /// snapshot.devices.extend(SimulatedDevice::new(50).named("sim:1").memory().devices);
    /// assert_eq!(snapshot.free(), 150);
    /// ```
    pub fn free(&self) -> u64 {
        self.devices.iter().map(|device| device.free).sum()
    }

    /// Bytes the pools hold from the devices but have not allocated (reserved less in use),
    /// summed over the devices whose pool counts both; `None` where none does.
    ///
    /// ```
    /// # use batch_size_runtime::memory::{MemoryBackend, SimulatedDevice};
    /// let device = SimulatedDevice::new(100).with_caching();
    /// drop(device.alloc(30)?);
    /// let _held = device.alloc(20)?;
    /// assert_eq!(device.memory().pool_unallocated(), Some(30)); // freed, kept by the cache
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn pool_unallocated(&self) -> Option<u64> {
        self.sum_over_devices(|device| {
            Some(device.pool_reserved?.saturating_sub(device.pool_used?))
        })
    }

    /// Bytes the pools have allocated, summed over the devices that count them.
    pub fn pool_used(&self) -> Option<u64> {
        self.sum_over_devices(|device| device.pool_used)
    }

    /// The attempt's peak in use, summed over the devices that keep one.
    pub fn peak(&self) -> Option<u64> {
        self.sum_over_devices(|device| device.peak)
    }

    fn sum_over_devices(&self, figure: impl Fn(&DeviceMemory) -> Option<u64>) -> Option<u64> {
        self.devices
            .iter()
            .filter_map(figure)
            .reduce(u64::saturating_add)
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
    /// # use batch_size_runtime::memory::SimulatedDevice;
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
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// assert_eq!(SimulatedDevice::new(100).memory().free(), 100);
    /// assert!(NoRelease.memory().is_empty());
    /// ```
    fn memory(&self) -> MemorySnapshot;

    /// Starts a new peak, so that each attempt reports its own. Does nothing by default.
    ///
    /// ```
    /// # use batch_size_runtime::memory::MemoryBackend;
    /// # use batch_size_runtime::memory::SimulatedDevice;
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
    /// # use batch_size_runtime::memory::SimulatedDevice;
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
