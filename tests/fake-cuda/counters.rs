// The fake CUDA driver's counters: one definition, compiled into the driver (fake_cuda.rs) and
// into the tests' helper (src/fake_cuda.rs) with `include!`, so that both sides agree on the
// layout that `fake_cuda_counters` writes.

/// What the fake CUDA driver knows about one device, as `fake_cuda_counters` reports it.
///
/// Pool figures follow CUDA's definitions: `pool_reserved` is what the default pool holds from
/// the device (in use or cached), `pool_used` what live stream-ordered allocations use. `free`
/// is what `cuMemGetInfo_v2` reports: the capacity less plain allocations and the pool's
/// reserved bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeCudaCounters {
    /// Total bytes of the device.
    pub capacity: u64,
    /// Bytes `cuMemGetInfo_v2` reports free.
    pub free: u64,
    /// Live allocations, plain (`cuMemAlloc_v2`) and stream-ordered (`cuMemAllocAsync`).
    pub live_allocations: u64,
    /// Bytes of those live allocations.
    pub live_bytes: u64,
    /// Bytes of the default pool in use (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub pool_used: u64,
    /// Bytes the default pool holds from the device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub pool_reserved: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    pub pool_used_high: u64,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`.
    pub pool_reserved_high: u64,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
    pub release_threshold: u64,
    /// Successful allocations so far.
    pub allocations: u64,
    /// Allocations that failed with `CUDA_ERROR_OUT_OF_MEMORY` so far.
    pub failed_allocations: u64,
    /// `cuMemPoolTrimTo` calls on the device's pool.
    pub trims: u64,
    /// Context, stream and event synchronizations on the device.
    pub synchronizes: u64,
    /// `cuDevicePrimaryCtxRetain` calls.
    pub primary_retains: u64,
    /// `cuDevicePrimaryCtxRelease_v2` calls.
    pub primary_releases: u64,
    /// References to the primary context now (it is active while above 0).
    pub primary_refcount: u64,
    /// Times the primary context was created (a retain while it was inactive).
    pub contexts_created: u64,
    /// Whether `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` is 1.
    pub memory_pools_supported: u64,
    /// `cuMemGetInfo_v2` calls answered for this device (its context current).
    pub mem_get_infos: u64,
    /// `cuMemPoolGetAttribute` calls on the device's pool, whatever the attribute.
    pub pool_attribute_reads: u64,
    /// `cuMemPoolSetAttribute` calls on the device's pool, whatever the attribute.
    pub pool_attribute_writes: u64,
}

impl FakeCudaCounters {
    /// The memory queries so far: `cuMemGetInfo_v2` calls and pool attribute reads and writes.
    #[allow(dead_code)]
    pub fn memory_queries(&self) -> u64 {
        self.mem_get_infos + self.pool_attribute_reads + self.pool_attribute_writes
    }
}
