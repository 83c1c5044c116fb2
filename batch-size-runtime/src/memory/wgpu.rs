//! wgpu 30's allocator (feature `wgpu`): gpu-allocator's report through
//! `Device::generate_allocator_report()`.

use super::{DeviceMemory, HostMemory, MemoryBackend, MemorySnapshot, Release, ReleaseError};

/// wgpu's figures for one device.
///
/// - in use: the report's `total_allocated_bytes`; reserved: `total_reserved_bytes`, the
///   memory blocks held, free regions included ([`DeviceMemory::pool_reserved`] less
///   [`DeviceMemory::pool_used`] is reserved but unallocated);
/// - no peak: gpu-allocator keeps none;
/// - the device's total and free bytes: wgpu does not say them. The host's are used (a CPU
///   adapter: Mesa's llvmpipe, WARP), or the bytes given with [`with_total`](Self::with_total).
///
/// The release waits for the device's queued work (`poll` with a wait), after which the
/// attempt's dropped buffers are freed: wgpu frees a buffer once the GPU is done with it.
#[derive(Debug)]
pub struct WgpuMemory {
    device: wgpu::Device,
    total: Option<u64>,
    host: HostMemory,
}

impl WgpuMemory {
    /// wgpu's figures for `device`, on the host's memory.
    pub fn new(device: &wgpu::Device) -> Self {
        WgpuMemory {
            device: device.clone(),
            total: None,
            host: HostMemory::new(),
        }
    }

    /// The device's bytes, for a GPU (wgpu reads no total): free is then what the allocator
    /// has not reserved.
    pub fn with_total(mut self, bytes: u64) -> Self {
        self.total = Some(bytes);
        self
    }
}

impl MemoryBackend for WgpuMemory {
    fn release(&self) -> Result<(), ReleaseError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|error| ReleaseError::new(format!("wgpu's Device::poll: {error}")))?;
        self.host.release()
    }

    fn memory(&self) -> MemorySnapshot {
        let Some(report) = self.device.generate_allocator_report() else {
            return MemorySnapshot::default();
        };
        let reserved = report.total_reserved_bytes;
        let Some((total, free)) = self.host.device_room(self.total, reserved) else {
            return MemorySnapshot::default();
        };
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "wgpu:0".to_owned(),
                total,
                free,
                pool_reserved: Some(reserved),
                pool_used: Some(report.total_allocated_bytes),
                peak: None,
            }],
        }
    }
}

impl Release {
    /// wgpu 30's allocator on `device` (feature `wgpu`): its figures ([`WgpuMemory`], on the
    /// host's memory: for a GPU, give its bytes with
    /// `Release::backend(WgpuMemory::new(&device).with_total(bytes))`); the release waits for
    /// the device so that the attempt's dropped buffers are freed.
    ///
    /// ```ignore
    /// #[find_executable_batch_size(starting = 512, release = Release::wgpu(device))]
    /// fn train(batch_size: usize, device: &wgpu::Device) -> Result<(), wgpu::Error> { ... }
    /// ```
    pub fn wgpu(device: &wgpu::Device) -> Self {
        Release::backend(WgpuMemory::new(device))
    }
}
