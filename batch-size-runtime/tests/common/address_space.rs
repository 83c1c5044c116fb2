//! An address-space limit for a test process (Linux): RLIMIT_AS, what `ulimit -v` sets, above
//! the process's virtual size, so that allocations past it fail and the process lives. Shared by
//! the runtime's host-memory test and the real allocators' tests (`#[path]`), which each used
//! to declare `setrlimit` themselves.

#![allow(dead_code)] // each includer uses what it needs

/// Sets RLIMIT_AS for this process; the OS error where it refuses.
pub fn limit_address_space(bytes: u64) -> std::io::Result<()> {
    #[repr(C)]
    struct Rlimit {
        current: u64,
        max: u64,
    }
    unsafe extern "C" {
        fn setrlimit(resource: std::ffi::c_int, limit: *const Rlimit) -> std::ffi::c_int;
    }
    // Linux's RLIMIT_AS, on every architecture Rust supports.
    const RLIMIT_AS: std::ffi::c_int = 9;
    let limit = Rlimit {
        current: bytes,
        max: u64::MAX,
    };
    // SAFETY: `limit` is a valid `struct rlimit` (two 64-bit `rlim_t` on Linux) for the call.
    if unsafe { setrlimit(RLIMIT_AS, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The process's virtual size now (`VmSize` in `/proc/self/status`), in bytes: what the kernel
/// compares with RLIMIT_AS.
pub fn virtual_size() -> std::io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmSize:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| std::io::Error::other("no VmSize in /proc/self/status"))
}

/// Limits the address space to the virtual size now plus `room`.
pub fn leave_room(room: u64) -> std::io::Result<()> {
    limit_address_space(virtual_size()? + room)
}
