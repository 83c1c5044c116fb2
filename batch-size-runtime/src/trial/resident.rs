//! The resident budget a child's step may use (`ChildTrial::with_resident_limit`): what a
//! machine's RAM, a container's `memory.max` or a job scheduler's limit counts, the process's
//! resident bytes (`VmRSS`), not its address space. No kernel limit refuses an allocation at a
//! resident figure (`RLIMIT_RSS` is ignored by Linux), so the child watches itself: a thread
//! reads `/proc/self/statm` every [`POLL`] and, once the process holds more than the budget,
//! reports the step out of memory (with the figures of [`Resident`], which the parent frames)
//! and ends the process at once. As the step returns, its peak (`VmHWM`, reset as the step starts, or the
//! most the watcher saw) decides too, so a step that passed the budget between two readings is
//! out of memory all the same: the outcome does not hang on the watcher's timing. An allocation
//! that outruns the watcher past what the machine has can still bring the kernel's
//! out-of-memory killer (SIGKILL, no report): the parent reads that as any signal after the
//! step started, out of memory.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::memory::Bytes;

/// How often the watcher reads the process's resident size: at a few GB/s of writes, a step
/// passes the budget by some MiB before it is seen, far from what the machine has.
const POLL: Duration = Duration::from_millis(2);

/// The watcher's stack: it reads into buffers of its own frame, and allocates only as it starts
/// and at a crossing.
const WATCHER_STACK: usize = 256 << 10;

/// What the process held against the budget, in resident bytes, its start included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resident {
    /// What the program holds before its step, which the step cannot use: the start the
    /// figures count from.
    pub(crate) start: u64,
    /// What it held when read.
    pub(crate) held: u64,
    /// The most it held since the watch started.
    pub(crate) peak: u64,
}

/// The watcher of one step: stopped by [`Watch::stop`] as the step returns.
#[derive(Debug)]
pub(crate) struct Watch {
    budget: u64,
    /// The start the figures count from.
    start: u64,
    /// Whether the outcome is decided: by the watcher at a crossing (then it ends the process),
    /// or by the step's thread as it stops the watch. Whoever takes it first decides.
    decided: Arc<Mutex<bool>>,
    /// The most the watcher read.
    seen: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Whether the kernel's resident peak (`VmHWM`) was reset as the watch started: where it
    /// was not, it counts the program's start too, and only the watcher's readings are the step's.
    peak_reset: bool,
}

/// Starts watching this process's resident memory against `budget` bytes, the figures counted
/// from `start` (what the program holds before its step; see `ChildTrial::run`), and returns
/// once the watcher runs. At a crossing, the watcher calls `on_crossing` with what the process
/// holds (it writes the report) and ends the process with the exit code it returns, without
/// running exit handlers: the step's thread is still running.
///
/// A budget no larger than what the process holds now is refused, naming both: every size would
/// be out of memory before the step allocated a byte.
pub(crate) fn watch(
    budget: u64,
    start: u64,
    on_crossing: impl FnOnce(Resident) -> i32 + Send + 'static,
) -> io::Result<Watch> {
    let now = statm::resident()?;
    if budget <= now {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a resident budget of {budget} bytes ({}) is no more than the {now} bytes ({}) the \
                 child holds resident as the step starts (the program, its libraries, what it \
                 built before serve): no step can fit; ask for more than {now} bytes, or for the \
                 memory a box or container has in all",
                Bytes(budget),
                Bytes(now)
            ),
        ));
    }
    // Writing 5 to clear_refs resets `VmHWM` to the resident size now (Linux 4.0 and later).
    let peak_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let decided = Arc::new(Mutex::new(false));
    let seen = Arc::new(AtomicU64::new(now));
    let stop = Arc::new(AtomicBool::new(false));
    let (ready, started) = std::sync::mpsc::channel();
    let thread = {
        let (decided, seen, stop) = (Arc::clone(&decided), Arc::clone(&seen), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("batch-size-resident-watch".to_owned())
            .stack_size(WATCHER_STACK)
            .spawn(move || {
                // A first allocation here, before the step and any address-space limit: the
                // arena glibc may give this thread is reserved now, not out of the step's room
                // when the report is written.
                drop(std::hint::black_box(Vec::<u8>::with_capacity(64)));
                let _ = ready.send(());
                while !stop.load(Ordering::SeqCst) {
                    let held = match statm::resident() {
                        Ok(held) => held,
                        Err(error) => {
                            tracing::warn!(
                                %error,
                                "could not read the child's resident memory: the budget is \
                                 checked against its peak when the step returns"
                            );
                            return;
                        }
                    };
                    let peak = seen.fetch_max(held, Ordering::SeqCst).max(held);
                    if held > budget {
                        let mut decided = decided.lock().unwrap_or_else(PoisonError::into_inner);
                        if *decided {
                            return;
                        }
                        *decided = true;
                        let code = on_crossing(Resident { start, held, peak });
                        // Holding `decided`: the step's thread cannot write an outcome of its own.
                        statm::end_now(code);
                    }
                    std::thread::sleep(POLL);
                }
            })?
    };
    // The watch is on before the step starts (a thread that never ran could not end it).
    let _ = started.recv();
    Ok(Watch {
        budget,
        start,
        decided,
        seen,
        stop,
        thread: Some(thread),
        peak_reset,
    })
}

impl Watch {
    /// The budget watched.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Stops the watcher, as the step has returned (where the watcher is ending the process,
    /// this waits for that), and reads what the step held: resident now, and its peak (the
    /// larger of `VmHWM` and the watcher's readings).
    pub(crate) fn stop(mut self) -> Resident {
        *self.decided.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let seen = self.seen.load(Ordering::SeqCst);
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kilobytes = |key| crate::memory::status_kilobytes(&status, key);
        let held = kilobytes("VmRSS:")
            .or_else(|| statm::resident().ok())
            .unwrap_or(seen);
        let hwm = if self.peak_reset {
            kilobytes("VmHWM:").unwrap_or(0)
        } else {
            0
        };
        Resident {
            start: self.start,
            held,
            peak: seen.max(hwm).max(held),
        }
    }
}

#[cfg(target_os = "linux")]
mod statm {
    use std::ffi::{c_int, c_long};
    use std::io::{self, Read};

    unsafe extern "C" {
        fn sysconf(name: c_int) -> c_long;
        fn _exit(status: c_int) -> !;
    }

    /// `_SC_PAGESIZE` on Linux (glibc and musl).
    const SC_PAGESIZE: c_int = 30;

    /// This process's resident bytes: `/proc/self/statm`'s second field, in pages. Reads into a
    /// buffer of this frame: no allocation, so the watcher never takes an arena of its own.
    pub(super) fn resident() -> io::Result<u64> {
        let mut buffer = [0u8; 256];
        let mut file = std::fs::File::open("/proc/self/statm")?;
        let mut length = 0;
        while length < buffer.len() {
            match file.read(&mut buffer[length..])? {
                0 => break,
                read => length += read,
            }
        }
        let pages = parse(&buffer[..length]).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "/proc/self/statm has no resident field",
            )
        })?;
        // SAFETY: `sysconf` takes a constant and touches no memory of ours.
        let page = unsafe { sysconf(SC_PAGESIZE) };
        let page = u64::try_from(page)
            .ok()
            .filter(|&page| page > 0)
            .ok_or_else(io::Error::last_os_error)?;
        Ok(pages.saturating_mul(page))
    }

    /// The resident pages in the text of a `statm` (size, resident, shared, ...).
    pub(super) fn parse(statm: &[u8]) -> Option<u64> {
        let text = std::str::from_utf8(statm).ok()?;
        text.split_ascii_whitespace().nth(1)?.parse().ok()
    }

    /// Ends the process with `code` at once: no exit handler runs, since the step's thread is
    /// still at work (a library's handler could wait on it, or crash under it).
    pub(super) fn end_now(code: i32) -> ! {
        // SAFETY: `_exit` takes an exit code and never returns.
        unsafe { _exit(code) }
    }
}

#[cfg(not(target_os = "linux"))]
mod statm {
    use std::io;

    pub(super) fn resident() -> io::Result<u64> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "ChildTrial::with_resident_limit reads the child's resident memory from \
             /proc/self/statm, which only Linux has: use with_memory_limit (address space), or \
             limit the program from outside (a container's memory limit)",
        ))
    }

    pub(super) fn end_now(code: i32) -> ! {
        std::process::exit(code)
    }
}

#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn statm_reads_the_resident_pages() {
        assert_eq!(statm::parse(b"5120 812 640 11 0 300 0\n"), Some(812));
        assert_eq!(statm::parse(b"5120\n"), None);
        let resident = statm::resident().unwrap();
        assert!(resident > 0);
    }

    #[test]
    fn a_budget_below_what_the_process_holds_is_refused() {
        for budget in [0, 4096] {
            let error = watch(budget, 0, |_| 3).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
            assert!(error.to_string().contains(&format!("{budget} bytes")));
        }
    }
}
