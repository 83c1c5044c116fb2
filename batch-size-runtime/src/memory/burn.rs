//! burn 0.22's own allocator (feature `burn`): cubecl's pools on the wgpu, CUDA, ROCm and CPU
//! backends, read through `Device::memory_pool_usage()` and `memory_pool_report()`, given back
//! with `Device::memory_cleanup()`.

use std::sync::{Mutex, PoisonError};

use burn_tensor::Device;

use super::{DeviceMemory, HostMemory, MemoryBackend, MemorySnapshot, Release, ReleaseError};

/// burn's figures for one device, and its cleanup as the release.
///
/// - in use: `MemoryPoolUsage::bytes_in_use` plus its padding, the pool's bytes live
///   allocations hold; reserved: `bytes_reserved` (what [`DeviceMemory::pool_reserved`] less
///   [`DeviceMemory::pool_used`] says is reserved but unallocated);
/// - the attempt's peak: the pages its pools held at most (`pages_peak` times `page_size`,
///   summed over `memory_pool_report()`), where the attempt raised it: cubecl keeps that mark
///   for the process and has no reset, so an attempt that stayed below an earlier one reports
///   no peak rather than the earlier one's;
/// - the device's total and free bytes: burn does not say them. The host's are used (where the
///   device's memory is the host's: Mesa's llvmpipe, burn's CPU backends), or the bytes given
///   with [`with_total`](Self::with_total) (a GPU).
///
/// The release is `memory_cleanup()`, which gives back the pages no live allocation holds.
///
/// # After an out-of-memory
/// cubecl's default memory configuration (`Adaptive`) carves pages sized to the largest
/// allocation served, and nothing shrinks them: an attempt that failed at a large size leaves
/// pages of its size (on wgpu even where the device refused them: wgpu reports the failure
/// later), and the cleanup moves the weights into one. Smaller sizes that fit a fresh process
/// may then not fit: a two-layer MLP's training step on llvmpipe ran 0.61 of its fresh
/// largest after a failure at 8192. With `MemoryConfiguration::ExclusivePages` set at device
/// setup (one page per allocation, none kept after the cleanup) 0.90 ran again
/// (`real-allocators/tests/burn_autodiff.rs`). A dry run (`BurnDryRun`) sizes without failing.
#[derive(Debug)]
pub struct BurnMemory {
    device: Device,
    name: String,
    total: Option<u64>,
    host: HostMemory,
    /// The pools' page peak in bytes when the attempt began.
    peak_at_start: Mutex<Option<u64>>,
}

impl BurnMemory {
    /// burn's figures for `device`, on the host's memory.
    pub fn new(device: &Device) -> Self {
        BurnMemory {
            device: device.clone(),
            name: format!("burn:{device:?}"),
            total: None,
            host: HostMemory::new(),
            peak_at_start: Mutex::new(None),
        }
    }

    /// The device's bytes, for a GPU (burn reads no total): free is then what the pools have
    /// not reserved.
    pub fn with_total(mut self, bytes: u64) -> Self {
        self.total = Some(bytes);
        self
    }

    /// The pools' page peak, in bytes.
    fn page_peak(&self) -> Option<u64> {
        let pools = self.device.memory_pool_report()?;
        Some(
            pools
                .iter()
                .map(|pool| pool.pages_peak.saturating_mul(pool.page_size))
                .sum(),
        )
    }
}

impl MemoryBackend for BurnMemory {
    fn release(&self) -> Result<(), ReleaseError> {
        // wgpu frees a buffer only once the device is polled past it: without the syncs every
        // size down to 1 ran out. A sync reporting the failed attempt's error is no reason to stop.
        let synced = self.device.sync();
        self.device.memory_cleanup();
        let synced_after = self.device.sync();
        if let Err(error) = synced.and(synced_after) {
            tracing::debug!(%error, "burn's Device::sync around memory_cleanup()");
        }
        // Host memory the cleanup gave back to the driver (llvmpipe's buffers are heap memory).
        self.host.release()
    }

    fn memory(&self) -> MemorySnapshot {
        let Some(usage) = self.device.memory_pool_usage() else {
            return MemorySnapshot::default();
        };
        let reserved = usage.bytes_reserved;
        let Some((total, free)) = self.host.device_room(self.total, reserved) else {
            return MemorySnapshot::default();
        };
        let at_start = *self
            .peak_at_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let peak = self
            .page_peak()
            .filter(|peak| at_start.is_some_and(|start| *peak > start));
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: self.name.clone(),
                total,
                free,
                pool_reserved: Some(reserved),
                pool_used: Some(usage.bytes_in_use.saturating_add(usage.bytes_padding)),
                peak,
            }],
        }
    }

    fn reset_peak(&self) {
        let peak = self.page_peak();
        *self
            .peak_at_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = peak;
    }
}

impl Release {
    /// burn 0.22's pools on `device` (feature `burn`): its figures and `memory_cleanup()` at
    /// each release ([`BurnMemory`], on the host's memory: for a GPU, give its bytes with
    /// `Release::backend(BurnMemory::new(&device).with_total(bytes))`).
    ///
    /// ```ignore
    /// #[find_executable_batch_size(starting = 512, release = Release::burn(device))]
    /// fn train(batch_size: usize, device: &burn::tensor::Device) -> anyhow::Result<f32> { ... }
    /// ```
    pub fn burn(device: &Device) -> Self {
        Release::backend(BurnMemory::new(device))
    }
}
