//! What the tests against the frameworks' real allocators share: the harness
//! ([`harness`], which tch's workspace includes too) and the setup of burn's device.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test support: failing loudly is the point

pub mod harness;
pub use harness::*;

/// Set by a burn test's parent: `exclusive` sets burn's wgpu runtime up with
/// `MemoryConfiguration::ExclusivePages` (one page per allocation) instead of the default
/// (`Adaptive`: pages sized to the largest allocation served, which a failed request grows).
pub const BURN_MEMORY: &str = "REAL_ALLOCATORS_BURN_MEMORY";

/// Whether this child's burn device is set up with `ExclusivePages` ([`BURN_MEMORY`]).
pub fn burn_exclusive_pages() -> bool {
    std::env::var(BURN_MEMORY).as_deref() == Ok("exclusive")
}

/// burn's wgpu device, with the memory configuration [`BURN_MEMORY`] names.
pub fn burn_device() -> burn::tensor::Device {
    use burn::tensor::wgpu::MemoryConfiguration;
    use burn::tensor::{Device, DeviceKind};
    if burn_exclusive_pages() {
        Device::wgpu_options()
            .memory_config(MemoryConfiguration::ExclusivePages)
            .init()
            .unwrap()
    } else {
        Device::wgpu(DeviceKind::DefaultDevice)
    }
}

/// Where Mesa's software Vulkan driver (llvmpipe) registers itself.
pub const LLVMPIPE: &str = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json";
