//! The room a child may use (`ChildTrial::with_memory_limit`):
//! an address-space limit (`RLIMIT_AS`, what `ulimit -v` sets) that the child sets on itself
//! just before the step, the bytes asked for above what it maps then. Past it the kernel
//! refuses the mapping, the allocation fails and a Rust process aborts: the parent reads that
//! as out of memory, with the figures the child left, instead of the machine swapping or the
//! kernel's out-of-memory killer ending a process of its choice.

use std::io;

use crate::memory::Bytes;

/// The bytes this process's malloc holds free as the step starts (glibc's
/// `mallinfo2().fordblks`, every arena's): already mapped, so an allocation served from them
/// takes none of the room. Where a program freed much before the step (the first backtrace's
/// debug information, 30 MiB), a room of 0 once fitted a step of 32 MiB.
pub(crate) fn held_free() -> u64 {
    crate::memory::malloc_free_bytes().unwrap_or(0)
}

/// The address-space limit as it was before [`leave_room`], to give back once the step has
/// returned: the child's report must not fail for want of the room the step used.
#[derive(Debug)]
#[must_use = "the limit stays until restored"]
pub(crate) struct Before {
    soft: Option<u64>,
    hard: Option<u64>,
}

impl Before {
    /// Puts the soft limit back (raising it up to the hard one is always allowed).
    pub(crate) fn restore(self) {
        if let Err(error) = rlimit::set_address_space(self.soft, self.hard) {
            tracing::debug!(%error, "could not lift the step's address-space limit");
        }
    }
}

/// Limits this process's address space to `virtual_size + room` bytes (its soft limit; the
/// hard one stays, so the step may still lower it). An existing soft limit that is tighter
/// stays: the step never gets more than the program was given. `None` where nothing changed.
///
/// A room no larger than what malloc already holds free ([`held_free`]) is refused, naming
/// both figures and what the process maps: the step would take that much without the address
/// space growing, so the limit could not hold it to a room that small.
pub(crate) fn leave_room(virtual_size: u64, room: u64) -> io::Result<Option<Before>> {
    let free = held_free();
    if room <= free {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a room of {room} bytes is no more than the {free} bytes ({}) the child's malloc \
                 already holds free as the step starts, within the {virtual_size} bytes ({}) it \
                 maps then: the step would take those without the limit seeing it, so no room \
                 that small can be held to; ask for more than {free} bytes",
                Bytes(free),
                Bytes(virtual_size)
            ),
        ));
    }
    let wanted = virtual_size.saturating_add(room);
    let (soft, hard) = rlimit::address_space()?;
    if let Some(soft) = soft.filter(|&soft| soft <= wanted) {
        tracing::warn!(
            soft_limit = soft,
            wanted,
            "the address-space limit in force is tighter than the room asked for: it stays"
        );
        return Ok(None);
    }
    if hard.is_some_and(|hard| hard < wanted) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the hard address-space limit ({} bytes) is below the room asked for above what \
                 the child maps ({wanted} bytes): raise it (ulimit -H -v) or ask for less",
                hard.unwrap_or_default()
            ),
        ));
    }
    rlimit::set_address_space(Some(wanted), hard)?;
    Ok(Some(Before { soft, hard }))
}

#[cfg(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    ))
))]
mod rlimit {
    use std::ffi::{c_int, c_ulong};
    use std::io;

    /// `struct rlimit`: two `rlim_t`, an `unsigned long` on Linux.
    #[repr(C)]
    struct Rlimit {
        current: c_ulong,
        max: c_ulong,
    }

    unsafe extern "C" {
        fn getrlimit(resource: c_int, limit: *mut Rlimit) -> c_int;
        fn setrlimit(resource: c_int, limit: *const Rlimit) -> c_int;
    }

    /// `RLIMIT_AS` on the architectures this module is built for.
    const RLIMIT_AS: c_int = 9;
    /// `RLIM_INFINITY` on those architectures.
    const INFINITY: c_ulong = c_ulong::MAX;

    // `c_ulong` is `u64` here, `u32` on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    fn finite(value: c_ulong) -> Option<u64> {
        (value != INFINITY).then_some(u64::from(value))
    }

    /// The soft and hard address-space limits; `None` for unlimited.
    pub(super) fn address_space() -> io::Result<(Option<u64>, Option<u64>)> {
        let mut limit = Rlimit { current: 0, max: 0 };
        // SAFETY: `limit` is a valid, writable `struct rlimit` for the call.
        if unsafe { getrlimit(RLIMIT_AS, &mut limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((finite(limit.current), finite(limit.max)))
    }

    /// Sets the soft and the hard limits (unlimited for `None`).
    pub(super) fn set_address_space(soft: Option<u64>, hard: Option<u64>) -> io::Result<()> {
        let to_limit = |bytes: Option<u64>| {
            bytes.map_or(INFINITY, |bytes| {
                c_ulong::try_from(bytes).unwrap_or(INFINITY)
            })
        };
        let limit = Rlimit {
            current: to_limit(soft),
            max: to_limit(hard),
        };
        // SAFETY: `limit` is a valid `struct rlimit` for the call.
        if unsafe { setrlimit(RLIMIT_AS, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(not(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    ))
)))]
mod rlimit {
    use std::io;

    fn unsupported() -> io::Error {
        io::Error::new(
            io::ErrorKind::Unsupported,
            "ChildTrial::with_memory_limit sets RLIMIT_AS, which this crate does only on Linux \
             (x86, ARM, RISC-V, PowerPC, s390x): limit the program from outside instead (a \
             container's memory limit)",
        )
    }

    pub(super) fn address_space() -> io::Result<(Option<u64>, Option<u64>)> {
        Err(unsupported())
    }

    pub(super) fn set_address_space(_soft: Option<u64>, _hard: Option<u64>) -> io::Result<()> {
        Err(unsupported())
    }
}
