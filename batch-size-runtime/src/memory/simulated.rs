//! A simulated device: capacity, allocations that free themselves, out-of-memory past the
//! capacity, and the figures a real backend reports. It lets a training function be written,
//! driven through the attribute and tested on any machine, with no GPU.
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, memory::SimulatedDevice};
//!
//! let device = SimulatedDevice::new(1 << 30); // 1 GiB
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
//!     .with_release(device.clone())
//!     .run(|batch_size| {
//!         let _activations = device.alloc(batch_size as u64 * (24 << 20))?; // 24 MiB a sample
//!         Ok(batch_size)
//!     });
//! assert_eq!(fitted.unwrap(), 40); // 64 needs 1.5 GiB; 42 fill it, 5 % is kept free
//! assert_eq!(device.failed_allocation_count(), 1);
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::memory::{DeviceMemory, MemoryBackend, MemorySnapshot, OutOfMemory, ReleaseError};

#[derive(Debug, Default)]
struct Usage {
    live: u64,
    peak: u64,
    cached: u64,
    /// The cache's blocks by size, with how many of each (a cached size is served from it).
    cached_blocks: std::collections::BTreeMap<u64, usize>,
    allocations: u64,
    failed_allocations: u64,
    releases: u64,
}

#[derive(Debug)]
struct Device {
    name: String,
    capacity: u64,
    block_size: u64,
    caching: bool,
    usage: Mutex<Usage>,
}

impl Device {
    fn usage(&self) -> MutexGuard<'_, Usage> {
        // The counters stay consistent even if a thread panicked while holding the lock.
        self.usage
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A device with a fixed capacity that fails allocations past it with [`OutOfMemory`].
///
/// Cloning gives another handle to the same device. It is a [`MemoryBackend`], so
/// `release = device.clone()` in the attribute (or [`with_release`]) reports its figures in logs
/// and errors, and releases its cache between attempts.
///
/// ```
/// use batch_size_runtime::memory::SimulatedDevice;
///
/// let device = SimulatedDevice::new(1 << 30); // 1 GiB
/// let weights = device.alloc(600 << 20)?;
/// assert!(device.alloc(600 << 20).is_err()); // out of memory
/// assert_eq!(device.free(), 424 << 20);
/// drop(weights);
/// assert_eq!(device.live(), 0);
/// assert_eq!(device.peak(), 600 << 20);
/// assert_eq!(device.cached(), 0); // no cache without `with_caching`
/// assert_eq!(device.allocation_count(), 1);
/// assert_eq!(device.failed_allocation_count(), 1);
/// assert_eq!(device.release_count(), 0);
/// # Ok::<(), batch_size_runtime::OutOfMemory>(())
/// ```
///
/// [`with_release`]: crate::BatchSizeSearch::with_release
#[derive(Debug, Clone)]
pub struct SimulatedDevice {
    device: Arc<Device>,
}

impl SimulatedDevice {
    /// A device named `sim:0` with `capacity_bytes` of memory, exact allocations and no cache.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(8 << 30);
    /// assert_eq!((device.name(), device.capacity(), device.free()), ("sim:0", 8 << 30, 8 << 30));
    /// ```
    pub fn new(capacity_bytes: u64) -> Self {
        SimulatedDevice {
            device: Arc::new(Device {
                name: "sim:0".to_owned(),
                capacity: capacity_bytes,
                block_size: 1,
                caching: false,
                usage: Mutex::new(Usage::default()),
            }),
        }
    }

    fn rebuild(self, change: impl FnOnce(&mut Device)) -> Self {
        let mut device = Device {
            name: self.device.name.clone(),
            capacity: self.device.capacity,
            block_size: self.device.block_size,
            caching: self.device.caching,
            usage: Mutex::new(Usage::default()),
        };
        change(&mut device);
        SimulatedDevice {
            device: Arc::new(device),
        }
    }

    /// Names the device in logs and errors. Call before allocating: it makes a new device.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100).named("sim:1");
    /// assert_eq!(device.name(), "sim:1");
    /// let error = device.alloc(200).unwrap_err();
    /// assert_eq!(error.device.as_deref(), Some("sim:1"));
    /// ```
    pub fn named(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.rebuild(|device| device.name = name)
    }

    /// Rounds every allocation up to a multiple of `bytes`, as CUDA's allocators round to
    /// 2 MiB pages, so that figures are not unrealistically exact. Call before allocating.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(64 << 20).with_block_size(2 << 20);
    /// let small = device.alloc(1)?;
    /// assert_eq!(small.bytes(), 2 << 20);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn with_block_size(self, bytes: u64) -> Self {
        self.rebuild(|device| device.block_size = bytes.max(1))
    }

    /// Keeps freed memory reserved, as a caching allocator or a stream-ordered pool does, until
    /// [`release`](MemoryBackend::release) gives it back: without a release between attempts,
    /// a retry finds the memory of the failed attempt still taken. A freed block serves a later
    /// allocation of its own size (the next step of a training loop); blocks are never split or
    /// merged, so memory cached at other sizes stays taken. Call before allocating.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// use batch_size_runtime::memory::MemoryBackend;
    ///
    /// let device = SimulatedDevice::new(100).with_caching();
    /// drop(device.alloc(80)?);
    /// assert_eq!(device.free(), 20); // still held by the cache
    /// device.release().unwrap();
    /// assert_eq!(device.free(), 100);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn with_caching(self) -> Self {
        self.rebuild(|device| device.caching = true)
    }

    /// Allocates `bytes` (rounded up to the block size), or fails with [`OutOfMemory`] carrying
    /// the bytes requested and free. The allocation frees itself when dropped.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// let held = device.alloc(60)?;
    /// let error = device.alloc(50).unwrap_err();
    /// assert_eq!((error.requested, error.free, error.total), (Some(50), Some(40), Some(100)));
    /// drop(held);
    /// assert!(device.alloc(50).is_ok());
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn alloc(&self, bytes: u64) -> Result<SimAllocation, OutOfMemory> {
        let rounded = bytes
            .div_ceil(self.device.block_size)
            .saturating_mul(self.device.block_size);
        let mut usage = self.device.usage();
        if let Some(count) = usage.cached_blocks.get_mut(&rounded) {
            *count -= 1;
            if *count == 0 {
                usage.cached_blocks.remove(&rounded);
            }
            usage.cached = usage.cached.saturating_sub(rounded);
            return Ok(self.allocated(usage, rounded));
        }
        let free = self.free_in(&usage);
        if rounded > free {
            usage.failed_allocations += 1;
            return Err(OutOfMemory::new()
                .with_requested(bytes)
                .with_free(free)
                .with_total(self.device.capacity)
                .on_device(self.device.name.clone()));
        }
        Ok(self.allocated(usage, rounded))
    }

    fn allocated(&self, mut usage: MutexGuard<'_, Usage>, rounded: u64) -> SimAllocation {
        usage.live += rounded;
        usage.peak = usage.peak.max(usage.live);
        usage.allocations += 1;
        SimAllocation {
            device: Arc::clone(&self.device),
            bytes: rounded,
        }
    }

    fn free_in(&self, usage: &Usage) -> u64 {
        self.device
            .capacity
            .saturating_sub(usage.live)
            .saturating_sub(usage.cached)
    }

    /// The device's name.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// assert_eq!(SimulatedDevice::new(100).name(), "sim:0");
    /// ```
    pub fn name(&self) -> &str {
        &self.device.name
    }

    /// Total bytes.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// assert_eq!(SimulatedDevice::new(100).capacity(), 100);
    /// ```
    pub fn capacity(&self) -> u64 {
        self.device.capacity
    }

    /// Bytes held by live allocations.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// let _held = device.alloc(30)?;
    /// assert_eq!(device.live(), 30);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn live(&self) -> u64 {
        self.device.usage().live
    }

    /// The most bytes live at once since the peak was last reset.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// drop(device.alloc(70)?);
    /// let _held = device.alloc(20)?;
    /// assert_eq!(device.peak(), 70);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn peak(&self) -> u64 {
        self.device.usage().peak
    }

    /// Bytes freed but still held by the cache (always 0 without [`with_caching`](Self::with_caching)).
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100).with_caching();
    /// drop(device.alloc(30)?);
    /// assert_eq!(device.cached(), 30);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn cached(&self) -> u64 {
        self.device.usage().cached
    }

    /// Bytes an allocation can still get.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// let _held = device.alloc(30)?;
    /// assert_eq!(device.free(), 70);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn free(&self) -> u64 {
        let usage = self.device.usage();
        self.free_in(&usage)
    }

    /// Successful allocations so far.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// let _held = (device.alloc(10)?, device.alloc(10)?);
    /// assert_eq!(device.allocation_count(), 2);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn allocation_count(&self) -> u64 {
        self.device.usage().allocations
    }

    /// Allocations that failed with out-of-memory so far.
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100);
    /// assert!(device.alloc(101).is_err());
    /// assert_eq!(device.failed_allocation_count(), 1);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn failed_allocation_count(&self) -> u64 {
        self.device.usage().failed_allocations
    }

    /// Releases so far (each gives the cache back).
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// use batch_size_runtime::memory::MemoryBackend;
    /// let device = SimulatedDevice::new(100);
    /// device.release()?;
    /// assert_eq!(device.release_count(), 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn release_count(&self) -> u64 {
        self.device.usage().releases
    }
}

impl MemoryBackend for SimulatedDevice {
    fn release(&self) -> Result<(), ReleaseError> {
        let mut usage = self.device.usage();
        usage.cached = 0;
        usage.cached_blocks.clear();
        usage.releases += 1;
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        let usage = self.device.usage();
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: self.device.name.clone(),
                total: self.device.capacity,
                free: self.free_in(&usage),
                pool_reserved: Some(usage.live + usage.cached),
                pool_used: Some(usage.live),
                peak: Some(usage.peak),
            }],
        }
    }

    fn reset_peak(&self) {
        let mut usage = self.device.usage();
        usage.peak = usage.live;
    }
}

/// Memory taken from a [`SimulatedDevice`]; given back when dropped.
///
/// ```
/// use batch_size_runtime::memory::SimulatedDevice;
///
/// let device = SimulatedDevice::new(1 << 20);
/// let buffer = device.alloc(4096)?;
/// assert_eq!(buffer.bytes(), 4096);
/// assert_eq!(device.live(), 4096);
/// drop(buffer);
/// assert_eq!(device.live(), 0);
/// # Ok::<(), batch_size_runtime::OutOfMemory>(())
/// ```
pub struct SimAllocation {
    device: Arc<Device>,
    bytes: u64,
}

impl SimAllocation {
    /// Bytes held (after rounding to the block size).
    ///
    /// ```
    /// # use batch_size_runtime::memory::SimulatedDevice;
    /// let device = SimulatedDevice::new(100).with_block_size(8);
    /// assert_eq!(device.alloc(10)?.bytes(), 16);
    /// # Ok::<(), batch_size_runtime::OutOfMemory>(())
    /// ```
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for SimAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimAllocation")
            .field("device", &self.device.name)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for SimAllocation {
    fn drop(&mut self) {
        let mut usage = self.device.usage();
        usage.live = usage.live.saturating_sub(self.bytes);
        if self.device.caching {
            usage.cached += self.bytes;
            *usage.cached_blocks.entry(self.bytes).or_default() += 1;
        }
    }
}
