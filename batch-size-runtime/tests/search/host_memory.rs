//! The host's memory as a device: limits read from a cgroup's and procfs's files, an
//! address-space limit set in a child process, and libtorch's CPU out-of-memory message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use batch_size_runtime::memory::{HostLimitKind, HostMemory, MemoryBackend};
use batch_size_runtime::oom;
use batch_size_runtime::Release;

use crate::exact_name;
use exact_name::exact_name;

/// A procfs and a cgroup hierarchy in a temporary directory, removed on drop.
struct FakeHost {
    root: PathBuf,
}

impl FakeHost {
    /// A process with `vm` bytes of virtual size and `rss` resident, on a machine of `total`
    /// bytes of which `available` are available, member of the v2 cgroup `/job/step`.
    fn new(name: &str, vm: u64, rss: u64, total: u64, available: u64) -> FakeHost {
        let root = std::env::temp_dir().join(format!("host-memory-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let host = FakeHost { root };
        host.write(
            "proc/self/status",
            &format!(
                "Name:\ttrain\nVmPeak:\t{} kB\nVmSize:\t{} kB\nVmHWM:\t{} kB\nVmRSS:\t{} kB\n",
                vm / 1024,
                vm / 1024,
                rss / 1024,
                rss / 1024
            ),
        );
        host.set_address_space(None);
        host.write("proc/self/cgroup", "0::/job/step\n");
        host.write(
            "proc/meminfo",
            &format!(
                "MemTotal: {} kB\nMemFree: 1 kB\nMemAvailable: {} kB\n",
                total / 1024,
                available / 1024
            ),
        );
        host
    }

    fn write(&self, path: &str, text: &str) {
        let path = self.root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    /// The soft `RLIMIT_AS` in `/proc/self/limits`, as the kernel writes it.
    fn set_address_space(&self, bytes: Option<u64>) {
        let soft = bytes.map_or("unlimited".to_owned(), |bytes| bytes.to_string());
        self.write(
            "proc/self/limits",
            &format!(
                "Limit                     Soft Limit           Hard Limit           Units     \n\
                 Max stack size            8388608              unlimited            bytes     \n\
                 Max address space         {soft:<20} unlimited            bytes     \n"
            ),
        );
    }

    fn memory(&self) -> HostMemory {
        HostMemory::with_roots(self.root.join("proc"), self.root.join("cgroup"))
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[test]
fn the_cgroup_limit_binds_where_it_leaves_the_least_room() {
    let host = FakeHost::new("cgroup", 3 * GIB, 600 * MIB, 64 * GIB, 60 * GIB);
    host.write("cgroup/job/step/memory.max", "max\n");
    host.write("cgroup/job/step/memory.current", &(700 * MIB).to_string());
    // The parent's limit binds its children: the tightest along the path counts.
    host.write("cgroup/job/memory.max", &(2 * GIB).to_string());
    host.write("cgroup/job/memory.current", &GIB.to_string());

    let limit = host.memory().limit().unwrap();
    assert_eq!(limit.kind, HostLimitKind::Cgroup);
    assert_eq!(
        (limit.total, limit.in_use, limit.own),
        (2 * GIB, GIB, 600 * MIB)
    );

    // The snapshot the engine logs: free against the cgroup, the process as the pool.
    let snapshot = host.memory().memory();
    let cpu = &snapshot.devices[0];
    assert_eq!(cpu.device, "cpu");
    assert_eq!((cpu.total, cpu.free), (2 * GIB, GIB));
    assert_eq!(cpu.pool_reserved, Some(600 * MIB));
    assert_eq!(cpu.peak, None, "no peak before a reset");
}

#[test]
fn a_cgroup_v1_limit_is_read_where_there_is_no_v2_one() {
    let host = FakeHost::new("cgroup-v1", GIB, 300 * MIB, 64 * GIB, 60 * GIB);
    host.write(
        "proc/self/cgroup",
        "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n",
    );
    host.write("cgroup/memory/job/memory.limit_in_bytes", &GIB.to_string());
    host.write(
        "cgroup/memory/job/memory.usage_in_bytes",
        &(400 * MIB).to_string(),
    );
    // "No limit" in v1 is a page-rounded i64::MAX.
    host.write(
        "cgroup/memory/memory.limit_in_bytes",
        "9223372036854771712\n",
    );

    let limit = host.memory().limit().unwrap();
    assert_eq!(limit.kind, HostLimitKind::Cgroup);
    assert_eq!((limit.total, limit.in_use), (GIB, 400 * MIB));
}

#[test]
fn the_address_space_limit_counts_the_virtual_size() {
    let host = FakeHost::new("rlimit", 3 * GIB, 600 * MIB, 64 * GIB, 60 * GIB);
    host.write("cgroup/job/step/memory.max", &(8 * GIB).to_string());
    host.write("cgroup/job/step/memory.current", &GIB.to_string());
    host.set_address_space(Some(4 * GIB));

    let limit = host.memory().limit().unwrap();
    assert_eq!(limit.kind, HostLimitKind::AddressSpace);
    // VmSize, not RSS: the kernel compares the virtual size with RLIMIT_AS.
    assert_eq!(
        (limit.total, limit.in_use, limit.own),
        (4 * GIB, 3 * GIB, 3 * GIB)
    );

    // Unlimited: the cgroup's 7 GiB of room binds before the machine's 60.
    host.set_address_space(None);
    assert_eq!(host.memory().limit().unwrap().kind, HostLimitKind::Cgroup);
    host.write("cgroup/job/step/memory.max", "max\n");
    let physical = host.memory().limit().unwrap();
    assert_eq!(physical.kind, HostLimitKind::Physical);
    assert_eq!((physical.total, physical.in_use), (64 * GIB, 4 * GIB));
}

#[test]
fn no_figures_without_the_process_counters() {
    let missing = HostMemory::with_roots("/nonexistent/proc", "/nonexistent/cgroup");
    assert!(missing.limit().is_none());
    assert!(missing.memory().is_empty());
    missing.reset_peak();
    assert!(missing.release().is_ok());
}

#[test]
fn libtorch_cpu_messages_give_the_bytes_asked_for() {
    // c10's alloc_cpu.cpp, as tch 0.10 (libtorch 1.13) returns it in TchError::Torch.
    let message = "DefaultCPUAllocator: can't allocate memory: you tried to allocate \
                   85899345920 bytes. Error code 12 (Cannot allocate memory)\n\
                   Exception raised from alloc_cpu at ../c10/core/impl/alloc_cpu.cpp:72";
    let found = oom::classify_text(message).unwrap();
    assert_eq!(found.figures.requested, Some(85_899_345_920));
    assert_eq!(oom::figures(message).requested, Some(85_899_345_920));
}

/// The environment variable that makes a re-executed test binary run the child's part.
const CHILD: &str = "BATCH_SIZE_HOST_MEMORY_CHILD";

/// Bytes a sample allocates in the child's training step.
const PER_SAMPLE: u64 = 4 * MIB;

/// Runs `test` in a child process of this test binary, alone, with `CHILD` set.
fn in_child(test: &str) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &exact_name(module_path!(), test),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // It ran its one test, not nothing.
    assert!(stdout.contains("1 passed"), "{stdout}");
}

#[cfg(target_os = "linux")]
use crate::address_space;

/// A training step on the host that fails as libtorch's CPU allocator does: weights in small
/// blocks (glibc keeps them in its heap), then the batch.
fn cpu_step(batch_size: usize) -> anyhow::Result<usize> {
    let weights: Vec<Vec<u8>> = (0..256).map(|_| vec![1u8; 64 << 10]).collect();
    let bytes = batch_size as u64 * PER_SAMPLE;
    let mut batch: Vec<u8> = Vec::new();
    if batch.try_reserve_exact(bytes as usize).is_err() {
        anyhow::bail!(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate {bytes} bytes. \
             Error code 12 (Cannot allocate memory)"
        );
    }
    // Written, so that it is resident and the peak sees it.
    batch.resize(bytes as usize, 1);
    std::hint::black_box((&weights, &batch));
    Ok(batch_size)
}

/// Runs [`child_guided_policy_from_host_figures`] in a child process: the address-space limit
/// would bind every other test of this binary.
#[cfg(target_os = "linux")]
#[test]
fn under_an_address_space_limit_the_guided_policy_works_from_host_figures() {
    in_child("child_guided_policy_from_host_figures");
}

#[cfg(target_os = "linux")]
#[test]
#[ignore = "a child process of under_an_address_space_limit_the_guided_policy_works_from_host_figures: run by it with --ignored"]
fn child_guided_policy_from_host_figures() {
    assert!(
        std::env::var_os(CHILD).is_some(),
        "run in a child process only: it limits this process's address space"
    );
    child_under_an_address_space_limit();
}

#[cfg(target_os = "linux")]
fn child_under_an_address_space_limit() {
    use batch_size_runtime::policy::Halve;
    use batch_size_runtime::{last_report, BatchSizeSearch};

    let host = HostMemory::new();
    // Room for 96 samples above what the process maps now: halving finds 64 there, from 1024.
    let limit = address_space::virtual_size().unwrap() + 96 * PER_SAMPLE;
    address_space::limit_address_space(limit).expect("setrlimit(RLIMIT_AS) failed");
    let under = host.limit().unwrap();
    assert_eq!(under.kind, HostLimitKind::AddressSpace);
    assert_eq!(under.total, limit);
    let room = under.total - under.in_use;
    println!("address space: {limit} bytes, {room} free");

    let halved: usize = BatchSizeSearch::new(1024)
        .with_policy(Halve)
        .with_release(Release::host())
        .run(cpu_step)
        .unwrap();
    let halving = last_report().unwrap();

    let guided: usize = BatchSizeSearch::new(1024)
        .with_release(Release::host())
        .run(cpu_step)
        .unwrap();
    let report = last_report().unwrap();
    println!(
        "halving: {halved} in {} attempts; guided: {guided} in {}",
        halving.len(),
        report.len()
    );

    // The size ran, so it fits; the figures got the guided policy above the halving ladder's
    // rung (without them it halves exactly, to the same size) in no more attempts but one.
    assert!(guided as u64 * PER_SAMPLE <= room);
    assert!(guided > halved, "guided {guided}, halving {halved}");
    assert!(report.len() <= halving.len() + 1);

    for attempt in report.attempts().filter(|a| a.outcome.is_out_of_memory()) {
        // The figures the WARN line prints: the host's, against the address-space limit.
        let at_end = attempt.memory_at_end.as_ref().unwrap();
        assert_eq!(at_end.devices[0].device, "cpu");
        assert_eq!(at_end.devices[0].total, limit);
        assert_eq!(
            attempt.figures.requested,
            Some(attempt.batch_size as u64 * PER_SAMPLE)
        );
        // The memory is back after each failure: the weights' heap blocks were trimmed.
        let start = attempt.memory_at_start.as_ref().unwrap().free();
        let after = attempt.memory_after_release.as_ref().unwrap().free();
        assert!(
            after + MIB >= start,
            "{} bytes free before the attempt at {}, {} after the release",
            start,
            attempt.batch_size,
            after
        );
    }
}
