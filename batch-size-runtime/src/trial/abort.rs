//! What an aborting child leaves: its counters at the moment it aborted, for the figures of a
//! failure no code of the trial lived to report. A failed Rust allocation prints "memory
//! allocation of N bytes failed" and calls `abort()`, which raises SIGABRT; a handler of that
//! signal still runs, so the child copies `/proc/self/status` (its virtual and resident size
//! then) and `/proc/self/limits` (the address-space limit it ran under, which a trial may set
//! itself) into a file of the trial's folder that the parent reads. Only system calls: the heap is what just failed.

use std::path::Path;

use super::report::Own;

/// The counters an aborted child left: its own bytes then, as the limit counts them, and the
/// address-space limit in force, where it had one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AtAbort {
    pub(crate) own: Own,
    pub(crate) address_space_limit: Option<u64>,
    /// Whether the thread that aborted was panicking (`panic = "abort"`, a panic while
    /// panicking, one that cannot unwind): the panic ended the process, not a failed
    /// allocation. A panic another thread caught earlier is not this.
    pub(crate) panicking: bool,
}

/// The line the handler adds where the aborting thread was panicking.
const PANICKING_LINE: &str = "batch-size-runtime: the aborting thread was panicking";

/// Reads what the handler wrote in the trial's folder; `None` where it did not run (no abort,
/// not Linux).
pub(crate) fn read(folder: &Path) -> Option<AtAbort> {
    let text = super::files::read(folder, super::files::ABORT)?;
    Some(AtAbort {
        own: Own::parse(&text)?,
        address_space_limit: text.lines().find_map(|line| {
            line.strip_prefix("Max address space")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        }),
        panicking: text.lines().any(|line| line == PANICKING_LINE),
    })
}

#[cfg(target_os = "linux")]
mod handler {
    use std::ffi::{c_char, c_int, c_void};
    use std::os::fd::IntoRawFd;
    use std::path::Path;
    use std::sync::atomic::{AtomicI32, Ordering};

    unsafe extern "C" {
        fn signal(signum: c_int, handler: usize) -> usize;
        fn open(path: *const c_char, flags: c_int, ...) -> c_int;
        fn read(fd: c_int, buffer: *mut c_void, count: usize) -> isize;
        fn write(fd: c_int, buffer: *const c_void, count: usize) -> isize;
        fn close(fd: c_int) -> c_int;
    }

    const SIGABRT: c_int = 6;
    const SIG_ERR: usize = usize::MAX;
    const O_RDONLY: c_int = 0;

    /// The abort file, opened before the trial: the handler may not allocate or build a path.
    static ABORT_FILE: AtomicI32 = AtomicI32::new(-1);

    /// Opens the abort file and installs the handler; `false` where either failed (the parent
    /// then has the report's figures only).
    pub(crate) fn install(folder: &Path) -> bool {
        let Ok(file) = crate::trial::files::create_new(folder, crate::trial::files::ABORT) else {
            return false;
        };
        ABORT_FILE.store(file.into_raw_fd(), Ordering::SeqCst);
        // SAFETY: `on_abort` is an `extern "C" fn(c_int)`, the handler type `signal` takes;
        // it makes only async-signal-safe calls (open, read, write, close).
        unsafe { signal(SIGABRT, on_abort as extern "C" fn(c_int) as usize) != SIG_ERR }
    }

    extern "C" fn on_abort(_signal: c_int) {
        let file = ABORT_FILE.swap(-1, Ordering::SeqCst);
        if file < 0 {
            return;
        }
        for source in [c"/proc/self/status", c"/proc/self/limits"] {
            // SAFETY: a NUL-terminated path; the buffer is this frame's own, and every count
            // passed is within it. Nothing here allocates.
            unsafe {
                let fd = open(source.as_ptr(), O_RDONLY);
                if fd < 0 {
                    continue;
                }
                let mut buffer = [0u8; 2048];
                loop {
                    let read = read(fd, buffer.as_mut_ptr().cast(), buffer.len());
                    if read <= 0 {
                        break;
                    }
                    write(file, buffer.as_ptr().cast(), read as usize);
                }
                close(fd);
            }
        }
        // Whether this thread is panicking: std reads an atomic count and, only where a panic
        // is under way somewhere, a const-initialised thread-local without a destructor;
        // neither allocates nor locks.
        if std::thread::panicking() {
            let line = b"\nbatch-size-runtime: the aborting thread was panicking\n";
            // SAFETY: a static buffer and its length.
            unsafe { write(file, line.as_ptr().cast(), line.len()) };
        }
        // SAFETY: the file opened in `install`, closed once (the swap above took it).
        unsafe { close(file) };
        // Returning lets `abort()` go on: it restores the default action and raises again.
    }
}

/// Installs the abort handler where the platform has one, its file in the trial's folder;
/// `false` elsewhere.
pub(crate) fn install(folder: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        handler::install(folder)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = folder;
        false
    }
}
