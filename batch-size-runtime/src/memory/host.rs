//! The host's memory as a device: for training on the CPU (tch, candle or burn on CPU), where
//! an out-of-memory is an allocation that fails under the process's address-space limit.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use super::{DeviceMemory, MemoryBackend, MemorySnapshot, ReleaseError};

/// The host's memory as a device named `cpu`: the tightest of `RLIMIT_AS`, the cgroup's memory
/// limit and physical memory, the process's use of it, the peak of each attempt, and a release
/// that gives freed heap back to the kernel (see [below](#release)).
///
/// Reads Linux's `/proc` and `/sys/fs/cgroup`; elsewhere it reports no figures.
///
/// ```
/// use batch_size_runtime::memory::HostMemory;
///
/// let host = HostMemory::new();
/// if let Some(limit) = host.limit() {
///     // What this process holds counts against the limit, beside what others hold.
///     assert!(limit.own <= limit.in_use);
/// }
/// ```
///
/// # Which limit
/// Three limits can bind a process's memory; [`HostMemory`] reads all three and reports the one
/// with the least room left:
///
/// - `RLIMIT_AS` (`ulimit -v`, `prlimit --as`): the kernel refuses an `mmap` or `brk` that
///   would take the process's *virtual* size (`VmSize`) past it, so libtorch's CPU allocator
///   fails with "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes", an
///   error a search can catch. Against it, "in use" is `VmSize`: that is the figure the kernel
///   compares, reserved-but-untouched mappings (thread stacks, glibc's 64 MiB arenas) included.
/// - A cgroup's memory limit (`memory.max` in cgroup v2, `memory.limit_in_bytes` in v1): it
///   counts *resident* pages of every process in the cgroup, and past it the kernel's OOM
///   killer ends the process: nothing to catch, but the figures still tell a search (and a
///   person reading the log) how close a size came. Against it, "in use" is the cgroup's own
///   count (`memory.current`), of which this process holds its `VmRSS`.
/// - Physical memory (`MemTotal`, with `MemAvailable` free): resident pages again, `VmRSS`.
///
/// The process plays the part of a GPU's memory pool in the figures: `pool_reserved` is what
/// it holds (`VmSize` or `VmRSS`), and the rest of what is in use belongs to others (other
/// processes in the cgroup or on the machine), as memory outside the pool does on a GPU.
///
/// # Release
/// Freed heap memory that glibc keeps in its arenas still counts against every limit. At each
/// release [`HostMemory`] calls glibc's `malloc_trim(0)`, found at run time in the process
/// (through `dlsym`), which gives it back to the kernel. Where it is absent (musl, jemalloc or
/// mimalloc as the global allocator, macOS) release does nothing: those allocators return
/// large blocks on their own, and glibc does too, at once, for every block at or above
/// `M_MMAP_THRESHOLD` (`MALLOC_MMAP_THRESHOLD_=131072` in the environment makes every tensor
/// such a block).
///
/// # Kept
/// Under `RLIMIT_AS`, an allocation that fails leaves address space behind that
/// `malloc_trim(0)` does not give back: glibc retries a failed allocation in another arena,
/// creating it (a heap of up to 64 MiB of address space), and those heaps stay mapped, their
/// pages trimmed, for the allocations that follow (a transformer block's step in libtorch
/// held 128 MiB more after one failure, and 0.90 of the largest size that fits a fresh
/// process still ran; after seven failures it did not: those arenas fragment). So
/// from the first attempt a search runs (its first peak reset), what the process grew since
/// then *and* glibc holds free (`mallinfo2()`'s `fordblks`, less what it held free then) counts
/// as room rather than as held, and the attempt's peak is counted above what it reuses: the
/// step's figures read as in a fresh process, the frame in which the tuner's trials, growing
/// from small sizes, read theirs. Only the growth since the first attempt counts: free heap
/// from before it (scattered between live blocks) does not, nor the part of an arena's 64 MiB
/// not yet mapped. Those arenas still fill unevenly, and near the limit a size may fail in
/// the process that failed where a fresh one runs it: with `MALLOC_MMAP_THRESHOLD_=131072` in
/// the environment, every block of 128 KiB or more is its own mapping, given back when freed,
/// and nothing is kept (the transformer block's search then ran 0.95 of its fresh largest).
///
/// # Not the default
/// [`Release::default()`](crate::memory::Release) stays CUDA's: a search cannot know whether the
/// allocation that failed was on the host or on a GPU, and host figures beside a CUDA
/// out-of-memory would mislead the guided policy's estimate (and cost every search with the
/// default a few reads of `/proc`). Name it where training runs on the CPU:
/// `release = Release::host()` in the attribute, or
/// [`with_release(Release::host())`](crate::BatchSizeSearch::with_release).
///
/// ```
/// use batch_size_runtime::memory::{MemoryBackend};
/// use batch_size_runtime::Release;
///
/// let release = Release::host();
/// let snapshot = release.memory_backend().memory();
/// if cfg!(target_os = "linux") {
///     let cpu = &snapshot.devices[0];
///     assert_eq!(cpu.device, "cpu");
///     assert!(cpu.free <= cpu.total);
/// }
/// release.memory_backend().release()?; // malloc_trim(0) where glibc has it
/// # Ok::<(), batch_size_runtime::memory::ReleaseError>(())
/// ```
#[derive(Debug)]
pub struct HostMemory {
    /// Where procfs is mounted (`/proc`).
    proc_root: PathBuf,
    /// Where the cgroup hierarchy is mounted (`/sys/fs/cgroup`).
    cgroup_root: PathBuf,
    /// The process's counters when the peak was last reset.
    at_reset: Mutex<Option<Counters>>,
    /// What the process held and glibc had free at the first reset (the search's first
    /// attempt): address space kept since then is counted against it (see [Kept](#kept)).
    base: Mutex<Option<Base>>,
}

/// The process before its first attempt: its virtual size and glibc's free heap bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Base {
    virtual_size: u64,
    free_heap: u64,
}

/// Which limit binds the host's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostLimitKind {
    /// The process's address-space limit (`RLIMIT_AS`), against its virtual size.
    AddressSpace,
    /// The memory limit of the process's cgroup (v2 `memory.max` or v1
    /// `memory.limit_in_bytes`, the tightest along its path), against the cgroup's use.
    Cgroup,
    /// The machine's memory (`MemTotal`), with `MemAvailable` free.
    Physical,
}

/// The limit that binds now and the bytes counted against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLimit {
    /// Which limit.
    pub kind: HostLimitKind,
    /// Its bytes.
    pub total: u64,
    /// Bytes in use against it (by this process and, for a cgroup or the machine, by others).
    pub in_use: u64,
    /// This process's share: `VmSize` against `RLIMIT_AS`, `VmRSS` otherwise.
    pub own: u64,
}

impl HostLimit {
    fn free(&self) -> u64 {
        self.total.saturating_sub(self.in_use)
    }
}

/// The process's own counters, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counters {
    /// `VmSize`: the virtual size, which `RLIMIT_AS` limits.
    virtual_size: u64,
    /// `VmRSS`: resident bytes, which a cgroup and the machine count.
    resident: u64,
    /// `VmHWM`: the most resident bytes since the process started or the peak was reset.
    resident_peak: u64,
    /// `VmPeak`: the largest virtual size since the process started (never reset), if reported.
    virtual_peak: Option<u64>,
    /// Address space glibc keeps free for reuse that the process grew since the base (see
    /// [Kept](HostMemory#kept)): 0 before the first reset, or without `mallinfo2`.
    kept: u64,
}

impl Default for HostMemory {
    fn default() -> Self {
        HostMemory::new()
    }
}

impl HostMemory {
    /// A framework backend's total and free bytes: from `total` where given, else the host's.
    #[cfg(any(feature = "burn", feature = "wgpu"))]
    pub(crate) fn device_room(&self, total: Option<u64>, reserved: u64) -> Option<(u64, u64)> {
        match total {
            Some(total) => Some((total, total.saturating_sub(reserved))),
            None => {
                let host = self.memory().devices.pop()?;
                Some((host.total, host.free))
            }
        }
    }

    /// The host's memory as this process sees it: `/proc` and `/sys/fs/cgroup`.
    ///
    /// ```
    /// use batch_size_runtime::memory::{HostMemory, MemoryBackend};
    /// let snapshot = HostMemory::new().memory();
    /// assert!(snapshot.devices.len() <= 1);
    /// ```
    pub fn new() -> Self {
        HostMemory::with_roots("/proc", "/sys/fs/cgroup")
    }

    /// Reads procfs under `proc_root` (`self/limits`, `self/status`, `self/cgroup`, `meminfo`)
    /// and the cgroup hierarchy under `cgroup_root`: for a container that mounts them
    /// elsewhere, and for tests that write those files.
    ///
    /// ```
    /// use batch_size_runtime::memory::{HostLimitKind, HostMemory};
    ///
    /// let root = std::env::temp_dir().join(format!("host-doc-{}", std::process::id()));
    /// let cgroup = root.join("cgroup/job");
    /// std::fs::create_dir_all(root.join("proc/self"))?;
    /// std::fs::create_dir_all(&cgroup)?;
    /// std::fs::write(root.join("proc/self/limits"), "Max address space unlimited unlimited bytes\n")?;
    /// std::fs::write(root.join("proc/self/status"), "VmSize:\t 4096 kB\nVmRSS:\t 1024 kB\nVmHWM:\t 2048 kB\n")?;
    /// std::fs::write(root.join("proc/self/cgroup"), "0::/job\n")?;
    /// std::fs::write(root.join("proc/meminfo"), "MemTotal: 1048576 kB\nMemAvailable: 524288 kB\n")?;
    /// std::fs::write(cgroup.join("memory.max"), "8388608\n")?; // 8 MiB
    /// std::fs::write(cgroup.join("memory.current"), "2097152\n")?;
    ///
    /// let limit = HostMemory::with_roots(root.join("proc"), root.join("cgroup")).limit().unwrap();
    /// assert_eq!(limit.kind, HostLimitKind::Cgroup);
    /// assert_eq!((limit.total, limit.in_use, limit.own), (8 << 20, 2 << 20, 1 << 20));
    /// # std::fs::remove_dir_all(root)?;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn with_roots(proc_root: impl Into<PathBuf>, cgroup_root: impl Into<PathBuf>) -> Self {
        HostMemory {
            proc_root: proc_root.into(),
            cgroup_root: cgroup_root.into(),
            at_reset: Mutex::new(None),
            base: Mutex::new(None),
        }
    }

    /// The limit with the least room left now, and what is in use against it; `None` where
    /// the process's counters cannot be read (not Linux).
    ///
    /// ```
    /// # use batch_size_runtime::memory::HostMemory;
    /// if cfg!(target_os = "linux") {
    ///     assert!(HostMemory::new().limit().is_some());
    /// }
    /// ```
    pub fn limit(&self) -> Option<HostLimit> {
        let counters = self.counters()?;
        self.limit_with(counters)
    }

    fn limit_with(&self, counters: Counters) -> Option<HostLimit> {
        let address_space =
            address_space_limit(&read(&self.proc_root.join("self/limits"))?).map(|total| {
                HostLimit {
                    kind: HostLimitKind::AddressSpace,
                    total,
                    in_use: counters.virtual_size,
                    own: counters.virtual_size,
                }
            });
        let cgroup = read(&self.proc_root.join("self/cgroup"))
            .and_then(|membership| cgroup_limit(&membership, &self.cgroup_root))
            .map(|(total, in_use)| HostLimit {
                kind: HostLimitKind::Cgroup,
                total,
                // A cgroup's count may lag a page or two behind the process's own.
                in_use: in_use.max(counters.resident),
                own: counters.resident,
            });
        let physical = read(&self.proc_root.join("meminfo"))
            .and_then(|meminfo| {
                Some((
                    kilobytes(&meminfo, "MemTotal:")?,
                    kilobytes(&meminfo, "MemAvailable:")?,
                ))
            })
            .map(|(total, available)| HostLimit {
                kind: HostLimitKind::Physical,
                total,
                in_use: total.saturating_sub(available).max(counters.resident),
                own: counters.resident,
            });
        [address_space, cgroup, physical]
            .into_iter()
            .flatten()
            .min_by_key(HostLimit::free)
    }

    fn counters(&self) -> Option<Counters> {
        let status = read(&self.proc_root.join("self/status"))?;
        let mut counters = Counters {
            virtual_size: kilobytes(&status, "VmSize:")?,
            resident: kilobytes(&status, "VmRSS:")?,
            resident_peak: kilobytes(&status, "VmHWM:")?,
            virtual_peak: kilobytes(&status, "VmPeak:"),
            kept: 0,
        };
        let base = *self.base.lock().unwrap_or_else(PoisonError::into_inner);
        if let (Some(base), Some(free_heap)) = (base, self.free_heap()) {
            counters.kept = counters
                .virtual_size
                .saturating_sub(base.virtual_size)
                .min(free_heap.saturating_sub(base.free_heap));
        }
        Some(counters)
    }

    /// glibc's free heap bytes (`mallinfo2().fordblks`, every arena's), read where this
    /// backend reads the process's own `/proc` (a test's procfs has no heap of its own).
    fn free_heap(&self) -> Option<u64> {
        (self.proc_root == Path::new("/proc"))
            .then(malloc_free_bytes)
            .flatten()
    }

    /// The attempt's peak, counted as the binding limit counts (only `VmHWM` can be reset).
    /// Address space glibc kept free at the attempt's start is reused before the process
    /// grows: a new `VmPeak` is the step's peak as a fresh process would reach it, and the
    /// resident growth (which counts the kept pages the step touched again) is counted above
    /// what the process held less what was kept.
    fn peak(&self, kind: HostLimitKind, now: Counters) -> Option<u64> {
        let at_reset = (*self.at_reset.lock().unwrap_or_else(PoisonError::into_inner))?;
        let grown = now.resident_peak.saturating_sub(at_reset.resident);
        Some(match kind {
            HostLimitKind::AddressSpace => match (at_reset.virtual_peak, now.virtual_peak) {
                (Some(before), Some(peak)) if peak > before => peak,
                // Resident growth alone overstates: pages touched inside glibc's reserved
                // arenas add no virtual bytes, so it is capped by the largest virtual size before.
                (before, _) => at_reset
                    .virtual_size
                    .saturating_sub(at_reset.kept)
                    .saturating_add(grown)
                    .min(before.unwrap_or(u64::MAX))
                    .max(now.virtual_size.saturating_sub(now.kept)),
            },
            HostLimitKind::Cgroup | HostLimitKind::Physical => now.resident_peak.max(now.resident),
        })
    }
}

impl MemoryBackend for HostMemory {
    /// Gives freed heap memory back to the kernel: glibc's `malloc_trim(0)` where the process
    /// has it, nothing otherwise (see [below](#release)).
    fn release(&self) -> Result<(), ReleaseError> {
        if let Some(malloc_trim) = malloc_trim() {
            // SAFETY: glibc's `int malloc_trim(size_t pad)`, resolved from the process's own
            // symbols; it takes no pointer and may be called at any time from any thread.
            let trimmed = unsafe { malloc_trim(0) };
            tracing::debug!(trimmed = trimmed != 0, "malloc_trim(0) after the attempt");
        }
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        let Some(counters) = self.counters() else {
            return MemorySnapshot::default();
        };
        let Some(limit) = self.limit_with(counters) else {
            return MemorySnapshot::default();
        };
        // Against the address-space limit, what glibc kept since the base is room (see Kept).
        let kept = match limit.kind {
            HostLimitKind::AddressSpace => counters.kept.min(limit.own),
            HostLimitKind::Cgroup | HostLimitKind::Physical => 0,
        };
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "cpu".to_owned(),
                total: limit.total,
                free: limit.free().saturating_add(kept).min(limit.total),
                pool_reserved: Some(limit.own - kept),
                pool_used: None,
                peak: self.peak(limit.kind, counters),
            }],
        }
    }

    /// Resets the kernel's resident peak (`echo 5 > /proc/self/clear_refs`) and keeps the
    /// counters of now; where the reset fails (an older kernel, a read-only procfs) no peak is
    /// reported rather than one from before the attempt.
    fn reset_peak(&self) {
        if self
            .base
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
        {
            let base = self
                .counters()
                .zip(self.free_heap())
                .map(|(counters, free_heap)| Base {
                    virtual_size: counters.virtual_size,
                    free_heap,
                });
            let mut first = self.base.lock().unwrap_or_else(PoisonError::into_inner);
            *first = first.or(base);
        }
        let reset = fs::write(self.proc_root.join("self/clear_refs"), "5")
            .ok()
            .and_then(|()| self.counters());
        *self.at_reset.lock().unwrap_or_else(PoisonError::into_inner) = reset;
    }
}

type MallocTrim = unsafe extern "C" fn(usize) -> std::ffi::c_int;

/// glibc's `struct mallinfo2` (glibc 2.33 and later): every field a `size_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    /// Free bytes in every arena (its bins, fast bins and top): what glibc keeps for reuse.
    fordblks: usize,
    keepcost: usize,
}

type MallInfo2Fn = unsafe extern "C" fn() -> MallInfo2;

/// A symbol of the C library the process has loaded, as the function type `F`.
///
/// # Safety
/// `F` must be the symbol's C signature. The pointer stays valid: libc is never unloaded from
/// a running process.
unsafe fn libc_symbol<F: Copy>(name: &[u8]) -> Option<F> {
    #[cfg(unix)]
    {
        let this = libloading::os::unix::Library::this();
        // SAFETY: the caller names the symbol's type.
        unsafe { this.get::<F>(name) }.ok().map(|symbol| *symbol)
    }
    #[cfg(not(unix))]
    {
        let _ = name;
        None
    }
}

/// glibc's `mallinfo2()`, where the process has it (glibc 2.33 and later).
fn mallinfo2() -> Option<MallInfo2> {
    static MALLINFO2: OnceLock<Option<MallInfo2Fn>> = OnceLock::new();
    // SAFETY: the symbol, where present, is glibc's `struct mallinfo2 mallinfo2(void)`.
    let mallinfo2 =
        (*MALLINFO2.get_or_init(|| unsafe { libc_symbol::<MallInfo2Fn>(b"mallinfo2\0") }))?;
    // SAFETY: glibc's `mallinfo2` takes no argument and may be called from any thread; it
    // locks each arena while it reads it.
    Some(unsafe { mallinfo2() })
}

/// The bytes glibc's malloc holds free in every arena (`mallinfo2().fordblks`: its bins, fast
/// bins and tops), where the process has `mallinfo2` (glibc 2.33 and later).
pub(crate) fn malloc_free_bytes() -> Option<u64> {
    mallinfo2().map(|info| u64::try_from(info.fordblks).unwrap_or(u64::MAX))
}

/// glibc's `malloc_trim`, looked up once in the symbols the process has loaded.
fn malloc_trim() -> Option<MallocTrim> {
    static MALLOC_TRIM: OnceLock<Option<MallocTrim>> = OnceLock::new();
    // SAFETY: the symbol, where present, is glibc's `int malloc_trim(size_t)`.
    *MALLOC_TRIM.get_or_init(|| unsafe { libc_symbol::<MallocTrim>(b"malloc_trim\0") })
}

fn read(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok()
}

/// `RLIMIT_AS`'s soft limit from `/proc/self/limits`; `None` when unlimited.
fn address_space_limit(limits: &str) -> Option<u64> {
    limits.lines().find_map(|line| {
        let rest = line.strip_prefix("Max address space")?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// A `Key:   1234 kB` line of `/proc/self/status` or `/proc/meminfo`, in bytes.
pub(crate) fn kilobytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.strip_prefix(key)?.split_whitespace();
        let kilobytes: u64 = words.next()?.parse().ok()?;
        kilobytes.checked_mul(1024)
    })
}

/// The tightest memory limit along the process's cgroup path (v2, else v1), with the bytes in use.
fn cgroup_limit(membership: &str, root: &Path) -> Option<(u64, u64)> {
    let path_of = |wanted: &dyn Fn(&str) -> bool| {
        membership.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            wanted(controllers).then(|| path.trim_start_matches('/').to_owned())
        })
    };
    let v2 = path_of(&|controllers| controllers.is_empty())
        .and_then(|path| tightest(root, &path, "memory.max", "memory.current"));
    v2.or_else(|| {
        let path = path_of(&|controllers| controllers.split(',').any(|c| c == "memory"))?;
        tightest(
            &root.join("memory"),
            &path,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    })
}

/// The least room over `root/path` and its ancestors up to `root`: (limit, in use). Absent
/// directories are skipped: a container sees its own cgroup at the root.
fn tightest(root: &Path, path: &str, limit_file: &str, usage_file: &str) -> Option<(u64, u64)> {
    let mut dir = root.join(path);
    let mut best: Option<(u64, u64)> = None;
    loop {
        let limit = read(&dir.join(limit_file)).and_then(|text| text.trim().parse::<u64>().ok());
        // v1 writes "no limit" as a page-rounded i64::MAX, v2 as "max" (which does not parse).
        if let Some(limit) = limit.filter(|&limit| limit < 1 << 62) {
            let in_use = read(&dir.join(usage_file))
                .and_then(|text| text.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let room = limit.saturating_sub(in_use);
            if best.is_none_or(|(l, u)| room < l.saturating_sub(u)) {
                best = Some((limit, in_use));
            }
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return best;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn counters(virtual_size: u64, resident: u64, resident_peak: u64, kept: u64) -> Counters {
        Counters {
            virtual_size: virtual_size * MIB,
            resident: resident * MIB,
            resident_peak: resident_peak * MIB,
            // Set by an earlier failure, near the limit: no step below it raises it.
            virtual_peak: Some(814 * MIB),
            kept: kept * MIB,
        }
    }

    #[test]
    fn a_step_inside_the_kept_address_space_counts_above_what_was_held_less_it() {
        let host = HostMemory::with_roots("/nonexistent/proc", "/nonexistent/cgroup");
        // After failures: 780 MiB of address space held, 134 MiB of it free in glibc's arenas
        // grown since the first attempt. The step touches 135 MiB again, inside them.
        *host.at_reset.lock().unwrap() = Some(counters(780, 180, 180, 134));
        let now = counters(780, 190, 315, 120);
        assert_eq!(
            host.peak(HostLimitKind::AddressSpace, now),
            Some((646 + 135) * MIB)
        );
        // Nothing kept: the held address space and the growth, capped by the failure's peak.
        *host.at_reset.lock().unwrap() = Some(counters(780, 180, 180, 0));
        assert_eq!(
            host.peak(HostLimitKind::AddressSpace, counters(780, 190, 315, 0)),
            Some(814 * MIB)
        );
    }
}
