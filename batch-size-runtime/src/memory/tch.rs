//! tch (libtorch) on the CPU: the host's memory. No dependency: one would pin the user's tch and
//! libtorch, and two `links = "tch"` crates cannot share a build.

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
