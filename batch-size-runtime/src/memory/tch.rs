//! tch (libtorch): no feature and no dependency. On the CPU libtorch allocates from the
//! process's heap (`DefaultCPUAllocator`, malloc), so the host's figures and trim are its own;
//! tch has no `empty_cache` for CUDA's caching allocator to call.
//!
//! A dependency on tch would pin the user's tch, and with it the libtorch they must install
//! (tch 0.10 is libtorch 1.13, tch 0.22 is 2.7), and two `links = "tch"` crates cannot share a
//! build (burn's optional `burn-tch` has one): so none.

use super::Release;

impl Release {
    /// libtorch on the CPU through tch: the host's memory ([`Release::host`]): `RLIMIT_AS`, the
    /// cgroup's limit or the machine's, and `malloc_trim(0)` at each release, which gives back
    /// the heap that libtorch's freed tensors left. On CUDA, keep the default
    /// ([`Release::cuda`]): it reads the device, though libtorch's cache is out of its reach.
    ///
    /// ```
    /// # use batch_size_runtime::Release;
    /// let release = Release::tch();
    /// assert_eq!(release.memory_backend().memory().devices.len(), usize::from(cfg!(target_os = "linux")));
    /// ```
    pub fn tch() -> Self {
        Release::host()
    }
}
