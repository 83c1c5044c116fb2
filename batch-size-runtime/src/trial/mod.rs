//! Trials in a child process, for frameworks whose failed allocation ends the process: candle's
//! CPU backend, ndarray, anything that allocates with `Vec` (a failed Rust allocation aborts,
//! exit 134 by SIGABRT, and no `catch_unwind` sees it). The trial runs in a copy of this
//! program, which reports to its parent on a channel of its own (files in a private folder the
//! parent makes for the trial, `files`): that the trial started, at which size, how it ended
//! and the figures it read. The exit status speaks only where the report is missing: an abort,
//! a segfault or a kill after the trial started counts as out-of-memory; a child that never
//! entered `serve` is an error that says so. Nothing the child prints is read: it is passed
//! through. A child never starts children of its own for a trial, and never outlives `run`
//! (`process`); `limit` gives its step the address space asked for, `resident` holds it to a
//! resident budget.

mod abort;
mod files;
mod limit;
mod process;
mod refused;
mod report;
mod resident;

use std::ffi::OsString;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::error::NoExecutableBatchSize;
use crate::memory::{Bytes, DeviceMemory, MemorySnapshot, ReleaseError};
use crate::memory::{HostLimit, HostLimitKind, HostMemory, MemoryBackend};
use crate::memory::{OutOfMemory, Release};
use crate::oom;
use files::TrialFolder;
use process::Running;
use report::{Ended, Own, Report, Used};

/// The environment variable that tells a copy of the program it is a trial's child: the
/// trial's name, `=`, the batch size.
const CHILD_VARIABLE: &str = "BATCH_SIZE_CHILD_TRIAL";

/// The environment variable that names the trial's private folder, where the child reports.
const FOLDER_VARIABLE: &str = "BATCH_SIZE_CHILD_FOLDER";

/// The environment variable that gives the child the room its step may map
/// ([`ChildTrial::with_memory_limit`] of the parent's trial), in bytes.
const MEMORY_LIMIT_VARIABLE: &str = "BATCH_SIZE_CHILD_MEMORY_LIMIT";

/// The environment variable that gives the child the resident memory it may hold
/// ([`ChildTrial::with_resident_limit`] of the parent's trial), in bytes.
const RESIDENT_LIMIT_VARIABLE: &str = "BATCH_SIZE_CHILD_RESIDENT_LIMIT";

/// The environment variable that gives the child the resident bytes its figures count from:
/// what the trial's first child held before its step, in bytes.
const RESIDENT_START_VARIABLE: &str = "BATCH_SIZE_CHILD_RESIDENT_START";

/// The exit code of a child whose trial did not fit (the report says how).
const TRIAL_FAILED: i32 = 3;

/// The exit code of a child that could not write its report.
const REPORT_UNWRITABLE: i32 = 4;

/// The exit code of a child that reached a trial's `run` before `serve` (and was stopped
/// there rather than start a child of its own): for a person reading the status; the parent
/// reads the file the child leaves.
const RAN_BEFORE_SERVING: i32 = 5;

/// The trial this process serves, once `serve` found it is that trial's child.
static SERVING: OnceLock<String> = OnceLock::new();

/// How long the parent waits, once an aborted child has ended, for the rest of its stderr
/// (Rust's "memory allocation of N bytes failed", already in the pipe) where a process the
/// child started still holds the pipe open.
const ABORT_MESSAGE_GRACE: Duration = Duration::from_secs(1);

/// Runs a trial in a child process: this program again, which calls [`serve`](Self::serve)
/// first thing and runs the trial at the size the parent asked for. In the parent,
/// [`run`](Self::run) starts the child, waits for it (not for processes it started) and reads
/// its report: `Ok(batch_size)` when the trial returned `Ok`; an out-of-memory
/// [`ChildTrialError`] when it returned or panicked with an out-of-memory, or when the child
/// was ended by a signal (an abort, a segfault, a kill) after the trial started; the trial's
/// own error, whole, which a search returns unchanged, otherwise.
///
/// The child is a new process: the program starts again from `main` (or the test runs again),
/// and what the trial needs it builds itself (the model, the data); nothing it learns, caches
/// or opens survives it, and nothing the parent did after starting is seen there. Use it where
/// a failed allocation cannot be caught in the process (candle on the CPU), to size the step;
/// then train in the process at that size. Each attempt costs a start of the program.
///
/// The child reads the host's memory ([`HostMemory`]) before the trial and at its end, and
/// where it aborted, the parent reads what it left: so the search reads an aborted child's
/// figures (the bytes it asked for, what it held, the room it had) as it reads an in-process
/// failure's, and lands near the limit instead of halving.
///
/// In a plain program:
///
/// ```no_run
/// use batch_size_runtime::{BatchSizeSearch, ChildTrial, ChildTrialError, Release};
///
/// /// A step on the CPU that allocates with `Vec`, as candle's CPU backend does: past the
/// /// machine's memory it aborts the process.
/// fn step(batch_size: usize) -> Result<(), String> {
///     let inputs = vec![1.0f32; batch_size << 20]; // 4 MiB a sample
///     if inputs.iter().sum::<f32>() == 0.0 {
///         return Err("no data".into());
///     }
///     Ok(())
/// }
///
/// fn main() -> Result<(), ChildTrialError> {
///     let trial = ChildTrial::new("step");
///     trial.serve(step); // in the child: runs the step and exits; here: returns at once
///     let fitted = BatchSizeSearch::new(4096)
///         .with_release(Release::none()) // the child's memory went with it
///         .run(|batch_size| trial.run(batch_size))?;
///     println!("batch size {fitted} fits");
///     Ok(())
/// }
/// ```
///
/// In tests, a test of its own serves (ignored, so that only the child runs it), named
/// exactly in the child's arguments:
///
/// ```no_run
/// use batch_size_runtime::{find_executable_batch_size, ChildTrial, ChildTrialError, Release};
///
/// fn trial() -> ChildTrial {
///     ChildTrial::new("step").with_args(["--exact", "child_step", "--ignored"])
/// }
///
/// #[test]
/// #[ignore = "the child of sized_in_a_child"]
/// fn child_step() {
///     trial().serve(|batch_size| -> Result<(), String> {
///         let _inputs = vec![1.0f32; batch_size << 20];
///         Ok(())
///     });
/// }
///
/// #[find_executable_batch_size(starting = 4096, release = Release::none())]
/// fn sized(batch_size: usize) -> Result<usize, ChildTrialError> {
///     trial().run(batch_size)
/// }
///
/// #[test]
/// fn sized_in_a_child() {
///     assert!(sized().unwrap() >= 1);
/// }
/// ```
#[derive(Debug, Clone)]
pub struct ChildTrial {
    name: String,
    args: Option<Vec<OsString>>,
    deadline: Option<Duration>,
    /// Whether the child's stdout and stderr reach this process's.
    pass_output_through: bool,
    /// The bytes the child may map above what it maps as the step starts.
    memory_limit: Option<u64>,
    /// The resident bytes the child may hold in all.
    resident_limit: Option<u64>,
    /// What the last child used, for [`memory`](Self::memory); shared by clones.
    figures: ChildMemory,
}

/// What the parent asked of this process, read once.
struct Asked {
    batch_size: usize,
    /// The trial's private folder, where the child writes its report.
    folder: PathBuf,
    /// The room the parent's trial gives the step, where it gives one.
    memory_limit: Option<u64>,
    /// The resident budget the parent's trial gives the child, where it gives one.
    resident_limit: Option<u64>,
    /// The resident bytes the figures count from, where an earlier child set them.
    resident_start: Option<u64>,
}

impl ChildTrial {
    /// A trial called `name` (one program may serve several).
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// assert!(!ChildTrial::new("step").is_child()); // this process was not started by a trial
    /// ```
    pub fn new(name: impl Into<String>) -> Self {
        ChildTrial {
            name: name.into(),
            args: None,
            deadline: None,
            pass_output_through: true,
            memory_limit: None,
            resident_limit: None,
            figures: ChildMemory::default(),
        }
    }

    /// The arguments the child is started with (default: this process's own, so that `main`
    /// reaches [`serve`](Self::serve) as it did here). A test binary passes the test that
    /// serves: `["--exact", "my_test", "--ignored"]`; without `--nocapture` too, since the
    /// report does not travel through the output the harness captures.
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// let trial = ChildTrial::new("step").with_args(["--exact", "child_step", "--ignored"]);
    /// ```
    pub fn with_args<I, A>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: Into<OsString>,
    {
        self.args = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// The longest a trial may run: a child still running then is ended with the processes it
    /// started (its process group gets SIGTERM, then SIGKILL 2 s later), and
    /// [`run`](Self::run) returns [`ChildTrialError::DeadlinePassed`], which a search returns
    /// (it is not out of memory: a swapping machine is slow at every size).
    ///
    /// # Default
    /// No deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use batch_size_runtime::ChildTrial;
    /// let trial = ChildTrial::new("step").with_deadline(Duration::from_secs(600));
    /// ```
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The address space the child's step may map (set on the trial whose [`run`](Self::run)
    /// starts the child, which passes it on). For "my box (my container, my job) has N GiB",
    /// [`with_resident_limit`](Self::with_resident_limit) is the one: this limit counts what the
    /// process reserves, not what it holds, and glibc's arenas reserve much more than they
    /// touch. In the child, just before the step, `serve` sets
    /// the process's address-space limit (`RLIMIT_AS`, what `ulimit -v` sets) to `bytes` above
    /// what the process maps then, so that a size too large fails there (Rust's failed
    /// allocation aborts the child, libtorch's returns an error) instead of swapping, or of the
    /// kernel's out-of-memory killer ending a process of its choice. No `unsafe`, `libc` or
    /// shell needed.
    ///
    /// The room is counted from the step's start, so it does not move with what the program
    /// mapped before (its libraries, the debug information a backtrace reads where
    /// `RUST_BACKTRACE` is set, which `serve` reads before the limit): the figures the child
    /// reports (its room, what it held, what it asked for) are against these bytes, in whole
    /// MiB. The address space counts every mapping, reserved or touched: each thread's stack
    /// (2 MiB for a Rust thread, 8 MiB for a C library's) and glibc's arenas (64 MiB each,
    /// reserved by threads that allocate) count too, so leave room for them: with a thread pool
    /// (candle's, rayon's), the arenas alone can take a few hundred MiB of the room, and the
    /// size that fits moves with how many threads allocated (`MALLOC_ARENA_MAX=2` in the
    /// environment bounds them; the crate sets no such variable). A tighter limit the program
    /// already has stays. Linux only: elsewhere the child reports the trial failed, saying so.
    ///
    /// What the child has mapped already is not the step's room, but what its malloc holds free
    /// there is: an allocation served from it takes none of the room. So a room no larger than
    /// what malloc holds free as the step starts (`with_memory_limit(0)`, or 4096 bytes after
    /// the program freed 30 MiB) cannot be held to, and is an error, not a fit:
    /// [`ChildTrialError::Failed`] naming the room asked for, what malloc held free and what the
    /// child mapped. Above it, small allocations may still come from that free heap and from
    /// the reserved tails of glibc's arenas on top of the room; large ones (a batch's tensors)
    /// are mapped afresh and count.
    ///
    /// Under the limit, a thread or a mapping the step cannot get is out of memory too (see
    /// [`serve`](Self::serve)).
    ///
    /// # Default
    /// No limit: the machine's memory, a container's or `ulimit -v`'s.
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// let trial = ChildTrial::new("step").with_memory_limit(2 << 30); // 2 GiB for the step
    /// ```
    pub fn with_memory_limit(mut self, bytes: u64) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// The resident memory the child may hold, in all (set on the trial whose
    /// [`run`](Self::run) starts the child, which passes it on): the budget a box's RAM, a
    /// container's `memory.max` or a job scheduler's memory limit counts. Pick it for "my box
    /// has N GiB"; pick [`with_memory_limit`](Self::with_memory_limit) only to bound address
    /// space itself (`ulimit -v`).
    ///
    /// In the child, a thread of `serve`'s reads the process's resident size
    /// (`/proc/self/statm`) every 2 ms while the step runs. Once the process holds more than
    /// `bytes`, the step ends as out of memory: the child reports it to the parent
    /// ([`ChildTrialError::OutOfMemory`], with its figures in the frame below and the bytes
    /// asked for unknown) and exits at once, so the search retries smaller as after any
    /// other failure. A step that returns after passing the budget between two readings is out
    /// of memory too: its peak (`VmHWM`, reset as the step starts) decides, so the outcome does
    /// not hang on the thread's timing. Only pages the process touches count: a tensor
    /// allocated and never written takes address space, not resident memory.
    ///
    /// The budget counts the whole process, its start included (the program, its libraries,
    /// what it built before `serve`), as a container does; not the processes the step starts.
    /// What the child holds as the step starts is the program's, not the step's: the figures
    /// the search reads from each child (through [`memory`](Self::memory), and an
    /// out-of-memory's) count the step's room as the budget less that start, in whole MiB, and
    /// what the step held and its peak as resident bytes above it, as the address-space limit
    /// counts from the step's start. The start is the trial's first child's, for every child of
    /// the trial and its clones, so that all rooms are one total (children start alike, not to
    /// the page); the message a person reads gives the process's whole figures. With
    /// `RUST_BACKTRACE` set, `serve` reads the program's debug information before the step (so
    /// that the backtrace a panic prints is not read into the step's memory), and the budget
    /// counts it in that start: 125 MiB for a debug test binary linking candle, where it holds
    /// 5.5 MiB without.
    ///
    /// A budget no larger than what the child holds as the step starts
    /// (`with_resident_limit(0)`) cannot fit any step, and is an error, not a fit:
    /// [`ChildTrialError::Failed`] naming both figures.
    ///
    /// What the watch cannot do: stop an allocation faster than its readings from taking more
    /// than the machine has. The kernel's out-of-memory killer may then end the child (SIGKILL)
    /// before it reports, which the parent reads as out of memory, as any signal after the step
    /// started, with no figures. Set the budget below what the machine (or container) has.
    ///
    /// glibc's arenas: each thread that allocates may reserve a 64 MiB arena of address space,
    /// which is resident only as far as it is written; under this budget they cost what they
    /// hold, not what they reserve, so nothing needs setting (the crate sets no
    /// `MALLOC_ARENA_MAX` or other variable). Both limits can be set; an abort under the address
    /// space's then carries that limit's figures. Linux only: elsewhere the child reports the
    /// trial failed, saying so.
    ///
    /// # Default
    /// No budget: the machine's memory, a container's.
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// // The box has 768 MiB for the program: the child, its start included, holds at most that.
    /// let trial = ChildTrial::new("step").with_resident_limit(768 << 20);
    /// ```
    pub fn with_resident_limit(mut self, bytes: u64) -> Self {
        self.resident_limit = Some(bytes);
        self
    }

    /// Whether what the child prints reaches this process's stdout and stderr (through `print!`
    /// and `eprint!`, so a test harness captures it here too), or is dropped: each attempt
    /// starts the program again, and its start-up logs repeat. Either way it is never read for
    /// the outcome.
    ///
    /// # Default
    /// Passed through.
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// let quiet = ChildTrial::new("step").with_output_passed_through(false);
    /// ```
    pub fn with_output_passed_through(mut self, passed: bool) -> Self {
        self.pass_output_through = passed;
        self
    }

    /// The children's memory as a search's release: a backend that reads what the last child
    /// of this trial (or of a clone of it) used, in the room it had, so that a search in the
    /// parent reads each attempt's figures (its peak where it fit, what it held where it
    /// failed) as it reads an in-process attempt's. It releases nothing (the child's memory
    /// went with it). For a search that runs one trial at a time; the first attempt has no
    /// figures from before it.
    ///
    /// ```
    /// use batch_size_runtime::{find_executable_batch_size, ChildTrial, ChildTrialError};
    ///
    /// #[find_executable_batch_size(starting = 4096, release = trial.memory())]
    /// fn sized(batch_size: usize, trial: &ChildTrial) -> Result<usize, ChildTrialError> {
    ///     trial.run(batch_size)
    /// }
    /// # let _ = sized;
    /// ```
    pub fn memory(&self) -> Release {
        Release::backend(self.figures.clone())
    }

    /// In the child this trial's parent started: runs `trial` at the size asked for, reports
    /// how it ended to the parent and exits. In any other process, returns at once. Call it
    /// first in `main` (or in the test the child runs), before any thread starts: it removes
    /// the trial's variables from the environment, so that the processes the trial starts
    /// (workers of the same program) do not take themselves for the trial's child.
    ///
    /// An error is judged by its text (`{:#}`, the whole chain of an `anyhow::Error`) with
    /// [`oom::classify_text`], a panic by its payload; either comes back to the parent whole.
    /// Whatever the trial prints is passed through and never judged.
    ///
    /// Under [`with_memory_limit`](Self::with_memory_limit), what the step could not get under
    /// that limit is out of memory too, retried smaller: a thread whose stack did not fit
    /// (`std::thread::Builder::spawn`'s EAGAIN, `std::thread::spawn`'s "failed to spawn
    /// thread" panic) or a mapping refused (ENOMEM, [`std::io::ErrorKind::OutOfMemory`]).
    /// They are read by type in an `io::Error`, a boxed error or an `anyhow::Error` and its
    /// chain, and by std's "failed to spawn thread" in any error's text. Without the limit
    /// they are the step's own errors, as any other error is.
    pub fn serve<E: fmt::Display + 'static>(&self, trial: impl FnOnce(usize) -> Result<(), E>) {
        let Some(asked) = self.asked() else {
            return;
        };
        // Remembered past the variables' removal: a `run` of this trial in its own child would
        // start another child, which would do the same.
        let _ = SERVING.set(self.name.clone());
        // A process the trial starts must not find these: it would run the trial itself.
        // Removing them is sound while no other thread reads the environment, which is why
        // `serve` comes first, before the program starts threads.
        // SAFETY: `serve` is documented to come first, before the program starts threads, so
        // no other thread reads or writes the environment while these are removed.
        unsafe {
            std::env::remove_var(CHILD_VARIABLE);
            std::env::remove_var(FOLDER_VARIABLE);
            std::env::remove_var(MEMORY_LIMIT_VARIABLE);
            std::env::remove_var(RESIDENT_LIMIT_VARIABLE);
            std::env::remove_var(RESIDENT_START_VARIABLE);
        }
        // First, before anything that may fail: the proof that this child entered `serve` for
        // the trial, so that the parent never takes a child that did for one that did not.
        let Ok(mut started_file) = files::create_new(&asked.folder, files::STARTED) else {
            std::process::exit(REPORT_UNWRITABLE);
        };

        // Where backtraces are on, Rust's failed-allocation hook prints one before it aborts,
        // and the first backtrace of a process reads the program's debug information into the
        // heap (30 MiB for a test binary): the abort's figures would count it as the trial's.
        // Read once here, before the figures start, it is cached for that backtrace.
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|value| value != "0") {
            let _ = std::backtrace::Backtrace::force_capture().to_string();
        }
        abort::install(&asked.folder);
        let host = HostMemory::new();
        host.reset_peak();
        let mut report = Report {
            batch_size: asked.batch_size,
            start: host.limit(),
            start_own: Own::now(),
            used: None,
            ended: None,
        };
        if started_file.write_all(report.to_text().as_bytes()).is_err() {
            std::process::exit(REPORT_UNWRITABLE);
        }
        drop(started_file);
        // A panic's text is reported as it happens: with `panic = "abort"`, or a panic while
        // panicking, nothing after the hook runs. It goes to a file of its own, never over the
        // outcome: a panic after the trial's outcome (in a library's teardown at exit) must not
        // take its place.
        let previous = panic::take_hook();
        let (folder, started) = (asked.folder.clone(), report.clone());
        panic::set_hook(Box::new(move |info| {
            let message = panic_text(info.payload());
            let panicking = Report {
                ended: Some(Ended::Panicking {
                    out_of_memory: oom::classify_panic(info.payload()).is_some(),
                    message,
                }),
                ..started.clone()
            };
            let _ = files::write_whole(&folder, files::PANICKING, &panicking.to_text());
            previous(info);
        }));

        // The resident budget's watcher, before the address-space limit: its thread's stack is
        // not the step's room.
        let watch = match asked.resident_limit.or(self.resident_limit) {
            None => None,
            Some(budget) => {
                let (folder, started) = (asked.folder.clone(), report.clone());
                // One start for every child of the trial (the first's), so that their rooms are
                // one total: a search reads a step's peak only against the room it started with.
                let start = asked
                    .resident_start
                    .or(report.start_own.map(|own| own.resident))
                    .unwrap_or(0);
                let watching = resident::watch(budget, start, move |resident| {
                    let used = resident_used(budget, resident);
                    let crossed = Report {
                        used: Some(used),
                        ended: Some(past_the_budget(budget, resident, None)),
                        ..started
                    };
                    match files::write_whole(&folder, files::ENDED, &crossed.to_text()) {
                        Ok(()) => TRIAL_FAILED,
                        Err(_) => REPORT_UNWRITABLE,
                    }
                });
                match watching {
                    Ok(watch) => Some(watch),
                    Err(error) => {
                        report.ended = Some(Ended::Failed {
                            message: format!(
                                "could not hold the child's resident memory to {budget} bytes \
                                 (ChildTrial::with_resident_limit): {error}"
                            ),
                        });
                        let _ = files::write_whole(&asked.folder, files::ENDED, &report.to_text());
                        std::process::exit(TRIAL_FAILED);
                    }
                }
            }
        };
        // Last before the step, and counted from what the process maps now, so that the step
        // has the room asked for whatever ran before (the backtrace read above included).
        let mut limited = None;
        if let Some(room) = asked.memory_limit.or(self.memory_limit) {
            let limiting = Own::now()
                .ok_or_else(|| std::io::Error::other("no VmSize in /proc/self/status"))
                .and_then(|own| limit::leave_room(own.virtual_size, room));
            match limiting {
                Ok(before) => limited = before,
                Err(error) => {
                    // Decided here: the watcher must not write an outcome over this one.
                    if let Some(watch) = watch {
                        let _ = watch.stop();
                    }
                    report.ended = Some(Ended::Failed {
                        message: format!(
                            "could not limit the child's memory to {room} bytes \
                             (ChildTrial::with_memory_limit): {error}"
                        ),
                    });
                    let _ = files::write_whole(&asked.folder, files::ENDED, &report.to_text());
                    std::process::exit(TRIAL_FAILED);
                }
            }
        }
        // Only where the crate's own limit binds is a refused thread or mapping the room's.
        let under_the_limit = limited.is_some();
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| trial(asked.batch_size)));
        // Stopped first, before anything the step's end allocates: from here the outcome is this
        // thread's to write.
        let resident = watch.map(|watch| (watch.budget(), watch.stop()));
        report.used = match resident {
            Some((budget, resident)) => Some(resident_used(budget, resident)),
            None => report
                .start_own
                .and_then(|start| used_in_the_room(start, &host)),
        };
        // The figures are read against the step's limit; the report must not fail for want of
        // the room the step used.
        if let Some(before) = limited {
            before.restore();
        }
        let ended = match outcome {
            Ok(Ok(())) => Ended::Fit,
            Ok(Err(error)) => {
                let message = format!("{error:#}");
                let refused = || under_the_limit && refused::error_refused(&error, &message);
                match oom::classify_text(&message) {
                    Some(_) => out_of_memory(message, report.used),
                    None if refused() => out_of_memory(message, report.used),
                    None => Ended::Failed { message },
                }
            }
            Err(payload) => {
                let message = panic_text(&*payload);
                let refused = || under_the_limit && refused::panic_refused(&*payload, &message);
                match oom::classify_panic(&*payload) {
                    Some(_) => out_of_memory(message, report.used),
                    None if refused() => out_of_memory(message, report.used),
                    None => Ended::Failed { message },
                }
            }
        };
        let ended = match resident {
            Some((budget, resident)) => judged_by_the_budget(ended, budget, resident),
            None => ended,
        };
        let code = if ended == Ended::Fit { 0 } else { TRIAL_FAILED };
        report.ended = Some(ended);
        if files::write_whole(&asked.folder, files::ENDED, &report.to_text()).is_err() {
            std::process::exit(REPORT_UNWRITABLE);
        }
        std::process::exit(code)
    }

    /// Whether this process is this trial's child.
    ///
    /// ```
    /// use batch_size_runtime::ChildTrial;
    /// assert!(!ChildTrial::new("step").is_child());
    /// ```
    pub fn is_child(&self) -> bool {
        self.asked().is_some()
    }

    fn asked(&self) -> Option<Asked> {
        let value = std::env::var(CHILD_VARIABLE).ok()?;
        let (name, size) = value.rsplit_once('=')?;
        if name != self.name {
            return None;
        }
        Some(Asked {
            batch_size: size.parse().ok()?,
            folder: std::env::var_os(FOLDER_VARIABLE)?.into(),
            memory_limit: std::env::var(MEMORY_LIMIT_VARIABLE)
                .ok()
                .and_then(|bytes| bytes.parse().ok()),
            resident_limit: std::env::var(RESIDENT_LIMIT_VARIABLE)
                .ok()
                .and_then(|bytes| bytes.parse().ok()),
            resident_start: std::env::var(RESIDENT_START_VARIABLE)
                .ok()
                .and_then(|bytes| bytes.parse().ok()),
        })
    }

    /// Runs the trial at `batch_size` in a child process and waits for it; the size that ran,
    /// for the search to return. The child's stdout and stderr are passed through to this
    /// process's (through `print!` and `eprint!`, so a test harness captures them here too)
    /// unless [`with_output_passed_through(false)`](Self::with_output_passed_through).
    ///
    /// A trial's child never starts children of its own for a trial: where this process was
    /// started as a trial's child and has not reached [`serve`](Self::serve) for it (its
    /// arguments led elsewhere: a test that calls `run` itself, a `main` that calls `serve`
    /// late), `run` ends the process at once with an error on stderr that names its arguments,
    /// and the parent's `run` returns [`ChildTrialError::NotStarted`] saying so; in a child
    /// serving this trial, it returns [`ChildTrialError::StartedInAChild`]. Either would
    /// otherwise start the program again, which would do the same, without end.
    pub fn run(&self, batch_size: usize) -> Result<usize, ChildTrialError> {
        if let Some(asked_for) = std::env::var_os(CHILD_VARIABLE) {
            refuse_before_serve(&self.name, &asked_for);
        }
        if SERVING.get().is_some_and(|serving| *serving == self.name) {
            return Err(ChildTrialError::StartedInAChild {
                name: self.name.clone(),
                args: std::env::args_os().skip(1).collect(),
            });
        }
        let args = match &self.args {
            Some(args) => args.clone(),
            None => std::env::args_os().skip(1).collect(),
        };
        // The start the child's resident figures count from, where an earlier child set it.
        let resident_start = self
            .figures
            .resident_start()
            .filter(|_| self.resident_limit.is_some());
        // Declared before the child, so that it is removed after the child has ended.
        let folder = TrialFolder::create().map_err(ChildTrialError::Start)?;
        // Ended (with the processes it starts) wherever this function returns before it has.
        let mut child = Running::spawn(
            Command::new(std::env::current_exe().map_err(ChildTrialError::Start)?)
                .args(&args)
                .env(CHILD_VARIABLE, format!("{}={batch_size}", self.name))
                .env(FOLDER_VARIABLE, folder.path())
                .envs(
                    self.memory_limit
                        .map(|bytes| (MEMORY_LIMIT_VARIABLE, bytes.to_string())),
                )
                .envs(
                    self.resident_limit
                        .map(|bytes| (RESIDENT_LIMIT_VARIABLE, bytes.to_string())),
                )
                .envs(resident_start.map(|bytes| (RESIDENT_START_VARIABLE, bytes.to_string())))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .map_err(ChildTrialError::Start)?;
        let abort_message = Arc::new(AbortMessage::default());
        if let Err(error) = self.pass_output_through(child.child_mut(), &abort_message) {
            // Without a thread to read its output the child would block on a full pipe.
            child.end();
            return Err(ChildTrialError::Start(error));
        }
        let Some(status) = self.wait(&mut child)? else {
            return Err(ChildTrialError::DeadlinePassed {
                batch_size,
                deadline: self.deadline.unwrap_or_default(),
            });
        };
        // The child has ended: what it wrote is all there will be.
        let Some(started) = folder.read(files::STARTED) else {
            // The file, not the exit code, says the child stopped at a `run`: a program may
            // exit with any code of its own.
            if let Some(trial) = folder.read(files::RAN_BEFORE_SERVING) {
                return Err(ChildTrialError::NotStarted {
                    batch_size,
                    name: self.name.clone(),
                    args,
                    status: describe_status(status),
                    ran_before_serving: Some(trial),
                });
            }
            if status.code() == Some(REPORT_UNWRITABLE) {
                return Err(ChildTrialError::NoReport {
                    batch_size,
                    path: folder.path().join(files::STARTED),
                });
            }
            return Err(ChildTrialError::NotStarted {
                batch_size,
                name: self.name.clone(),
                args,
                status: describe_status(status),
                ran_before_serving: None,
            });
        };
        let Some(start) = Report::parse(&started).filter(|start| start.batch_size == batch_size)
        else {
            // It entered `serve` (the file is there) and ended while it wrote its start.
            return Err(ChildTrialError::Failed {
                batch_size,
                status: status.code(),
                message: format!(
                    "the child process entered ChildTrial::serve and ended ({}) before the trial \
                     started, as it read its memory",
                    describe_status(status)
                ),
            });
        };
        if let Some(own) = start.start_own.filter(|_| self.resident_limit.is_some()) {
            self.figures.program_started(own.resident);
        }
        let read_report = |name| {
            folder
                .read(name)
                .and_then(|text| Report::parse(&text))
                .filter(|report| report.batch_size == batch_size)
        };
        let report = read_report(files::ENDED);
        // The trial's own outcome where it reported one; a panic under way only where it did not.
        let ended = match &report {
            Some(report) => report.ended.clone(),
            None => read_report(files::PANICKING).and_then(|panicking| panicking.ended),
        };
        let at_abort = abort::read(folder.path());
        let used_at_abort =
            at_abort
                .zip(start.start.zip(start.start_own))
                .map(|(at_abort, (limit, own))| {
                    let resident = self
                        .resident_limit
                        .map(|budget| (budget, resident_start.unwrap_or(own.resident)));
                    used_at_abort(at_abort, limit, own, resident)
                });
        self.figures
            .ended(report.and_then(|report| report.used).or(used_at_abort));
        let ending = Ending {
            batch_size,
            status,
            abort_message: &abort_message,
            used_at_abort,
            panicking_at_abort: at_abort.map(|at_abort| at_abort.panicking),
        };
        ending.outcome(ended)
    }

    /// Reads the child's stdout and stderr on threads of their own, passing them through where
    /// asked; stderr's abort message is read for the bytes it asked for.
    fn pass_output_through(
        &self,
        child: &mut Child,
        abort_message: &Arc<AbortMessage>,
    ) -> std::io::Result<()> {
        let passing = self.pass_output_through;
        if let Some(stdout) = child.stdout.take() {
            pass_through(
                stdout,
                move |line| {
                    if passing {
                        print!("{line}")
                    }
                },
                None,
            )?;
        }
        if let Some(stderr) = child.stderr.take() {
            pass_through(
                stderr,
                move |line| {
                    if passing {
                        eprint!("{line}")
                    }
                },
                Some(Arc::clone(abort_message)),
            )?;
        }
        Ok(())
    }

    /// Waits for the child itself (not for processes it started, which may hold its pipes),
    /// until the deadline where there is one; `None` where the deadline passed (the child and
    /// its group are ended: SIGTERM, a grace, SIGKILL).
    fn wait(&self, child: &mut Running) -> Result<Option<ExitStatus>, ChildTrialError> {
        // A deadline past what an `Instant` can hold (`Duration::MAX`) is no deadline.
        let Some(until) = self
            .deadline
            .and_then(|deadline| Instant::now().checked_add(deadline))
        else {
            return child.wait().map(Some).map_err(ChildTrialError::Wait);
        };
        loop {
            if let Some(status) = child.try_wait().map_err(ChildTrialError::Wait)? {
                return Ok(Some(status));
            }
            let now = Instant::now();
            if now >= until {
                child.end();
                return Ok(None);
            }
            std::thread::sleep((until - now).min(Duration::from_millis(10)));
        }
    }
}

/// In a process started as a trial's child that reached a trial's `run` before `serve` for its
/// own: says so where a person reads it, tells the parent, and exits. Returning an error
/// instead would let a test harness go on to the next test, which may start a child too.
fn refuse_before_serve(name: &str, asked_for: &std::ffi::OsStr) -> ! {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let asked_for = asked_for.to_string_lossy();
    let trial = asked_for
        .rsplit_once('=')
        .map_or(&*asked_for, |(trial, _)| trial);
    tracing::error!(
        trial,
        reached = name,
        args = %Args(&args),
        "a trial's child reached ChildTrial::run before ChildTrial::serve: it ends here rather \
         than start a child of its own"
    );
    // The process ends now, so stderr is the one place a person reads why (a subscriber may
    // not be installed); the parent passes it through. Written to the stream itself, not with
    // `eprintln!`, which a test harness captures and would drop at the exit.
    let _ = writeln!(
        std::io::stderr(),
        "error: this process is the child of ChildTrial `{trial}`, started with {}, and it \
         reached ChildTrial::run for trial `{name}` before ChildTrial::serve for `{trial}`: it \
         exits here rather than start a child of its own (each would do the same, without end). \
         Make its arguments lead to serve first (with_args naming the test that serves, \
         --exact and --ignored), or call serve first in main.",
        Args(&args)
    );
    if let Some(folder) = std::env::var_os(FOLDER_VARIABLE) {
        if let Ok(mut file) = files::create_new(Path::new(&folder), files::RAN_BEFORE_SERVING) {
            let _ = file.write_all(name.as_bytes());
        }
    }
    std::process::exit(RAN_BEFORE_SERVING)
}

/// How a child that started its trial ended: its exit status, Rust's abort message, the
/// figures it left where it aborted.
struct Ending<'a> {
    batch_size: usize,
    status: ExitStatus,
    abort_message: &'a AbortMessage,
    used_at_abort: Option<Used>,
    /// Whether the thread that aborted was panicking, where the abort handler said.
    panicking_at_abort: Option<bool>,
}

impl Ending<'_> {
    /// The trial's outcome: from the child's report first, from the exit status only where the
    /// report says the trial never ended.
    fn outcome(&self, ended: Option<Ended>) -> Result<usize, ChildTrialError> {
        let batch_size = self.batch_size;
        let failed = |message: String| ChildTrialError::Failed {
            batch_size,
            status: self.status.code(),
            message,
        };
        match ended {
            Some(Ended::Fit) => Ok(batch_size),
            Some(Ended::OutOfMemory { message, figures }) => Err(ChildTrialError::OutOfMemory {
                batch_size,
                message,
                figures,
            }),
            Some(Ended::Failed { message }) => Err(failed(message)),
            Some(Ended::Panicking {
                message,
                out_of_memory: true,
            }) => Err(ChildTrialError::OutOfMemory {
                batch_size,
                message,
                figures: OutOfMemory::new(),
            }),
            // A panic under way when the process ended: the panic only where it ended the
            // process. A kill, a segfault or an abort on a thread that was not panicking came
            // after a panic some thread caught (a side thread's), and is out of memory as any
            // signal after the trial started is.
            Some(Ended::Panicking {
                message,
                out_of_memory: false,
            }) => match ended_by_signal(self.status) {
                Some(how) if !self.the_panic_aborted() => Err(self.died(how)),
                _ => Err(failed(message)),
            },
            None => match ended_by_signal(self.status) {
                Some(how) => Err(self.died(how)),
                None => Err(failed(format!(
                    "the child process ended ({}) after the trial started, before the trial \
                     returned (the trial or a library it calls ended the process)",
                    describe_status(self.status)
                ))),
            },
        }
    }

    /// Whether the panic the child reported is what ended it: an abort (SIGABRT) on the thread
    /// that was panicking, by the abort handler's word; where the handler left none, an abort
    /// without Rust's failed-allocation message.
    fn the_panic_aborted(&self) -> bool {
        if signal_number(self.status) != Some(SIGABRT) {
            return false;
        }
        match self.panicking_at_abort {
            Some(panicking) => panicking,
            None => self.abort_message.requested(ABORT_MESSAGE_GRACE).is_none(),
        }
    }

    /// A child ended by a signal (an abort, a kill): out of memory, with the figures it left.
    fn died(&self, how: String) -> ChildTrialError {
        let requested = self.abort_message.requested(ABORT_MESSAGE_GRACE);
        let figures = match self.used_at_abort {
            Some(used) => in_the_room(used, requested),
            None => OutOfMemory {
                requested,
                ..OutOfMemory::new()
            },
        };
        ChildTrialError::Died {
            batch_size: self.batch_size,
            how,
            out_of_memory: figures,
        }
    }
}

/// What the trial used, in the room it had, as the limit that binds now counts (the trial may
/// have set one after the start): `None` where the host reads nothing.
fn used_in_the_room(start: Own, host: &HostMemory) -> Option<Used> {
    let limit = host.limit()?;
    let peak = host.memory().peak()?;
    let at_start = start.counted_by(limit.kind);
    let others = limit.in_use.saturating_sub(limit.own);
    Some(Used {
        room: round_down_to_mib(limit.total.saturating_sub(others).saturating_sub(at_start)),
        held: limit.own.saturating_sub(at_start),
        peak: peak.saturating_sub(at_start),
    })
}

/// An out-of-memory the trial returned or panicked with: the figures its text states, or
/// failing that what it used in the room it had (its peak as what it held at the failure),
/// so that two children's figures read alike.
fn out_of_memory(message: String, used: Option<Used>) -> Ended {
    let stated = oom::figures(&message);
    let figures = match used {
        Some(used) if stated.total.is_none() && stated.free.is_none() => in_the_room(
            Used {
                held: used.peak,
                ..used
            },
            stated.requested,
        ),
        _ => stated,
    };
    Ended::OutOfMemory { message, figures }
}

/// What an aborted child used: what it held at the abort beyond what it held at the start (its
/// anonymous memory, against an address-space limit or the resident kinds), in the room it had;
/// under a resident budget (and the start its figures count from) and no address-space limit,
/// its resident bytes above that start against the rest of the budget.
fn used_at_abort(
    at_abort: abort::AtAbort,
    limit: HostLimit,
    start: Own,
    resident: Option<(u64, u64)>,
) -> Used {
    if let (None, Some((budget, resident_start))) = (at_abort.address_space_limit, resident) {
        return resident_used(
            budget,
            resident::Resident {
                start: resident_start,
                held: at_abort.own.resident,
                peak: at_abort.own.resident,
            },
        );
    }
    let (kind, room) = match at_abort.address_space_limit {
        // A limit in force at the abort binds, whichever bound at the start (the trial may
        // have set it).
        Some(total) => (
            HostLimitKind::AddressSpace,
            total.saturating_sub(start.virtual_size),
        ),
        None => (
            limit.kind,
            limit
                .total
                .saturating_sub(limit.in_use.saturating_sub(limit.own))
                .saturating_sub(start.counted_by(limit.kind)),
        ),
    };
    let held = at_abort.own.allocated_since(&start, kind);
    Used {
        room: round_down_to_mib(room),
        held,
        peak: held,
    }
}

/// What a step held against a resident budget, in the frame of every child's figures: what
/// the process held as the step started is the program's, not the step's room; the room is the
/// rest of the budget, what the step held and its peak are the resident bytes above that start.
fn resident_used(budget: u64, resident: resident::Resident) -> Used {
    Used {
        room: round_down_to_mib(budget.saturating_sub(resident.start)),
        held: resident.held.saturating_sub(resident.start),
        peak: resident.peak.saturating_sub(resident.start),
    }
}

/// How a step under a resident budget ended: what it returned, unless its peak passed the
/// budget; then it did not fit, whatever it returned (the watcher may have read the process
/// between the peak's rise and fall), and what it returned is kept in the message.
fn judged_by_the_budget(ended: Ended, budget: u64, resident: resident::Resident) -> Ended {
    if resident.peak <= budget {
        return ended;
    }
    let returned = match ended {
        Ended::Fit => None,
        Ended::OutOfMemory { message, .. }
        | Ended::Failed { message }
        | Ended::Panicking { message, .. } => Some(message),
    };
    past_the_budget(budget, resident, returned)
}

/// A step past its resident budget: out of memory, its room (the budget less the program's
/// start) as the total and its resident peak as what it held (the bytes it asked for last are
/// not known); `returned`, what the step returned, where it returned before the crossing was
/// read.
fn past_the_budget(budget: u64, resident: resident::Resident, returned: Option<String>) -> Ended {
    let mut message = format!(
        "the child's resident memory reached {} ({} bytes), past its budget of {} ({budget} \
         bytes, ChildTrial::with_resident_limit), of which the program held {} before the step",
        Bytes(resident.peak),
        resident.peak,
        Bytes(budget),
        Bytes(resident.start)
    );
    if let Some(returned) = returned {
        message.push_str("; the step then returned: ");
        message.push_str(&returned);
    }
    let used = resident_used(budget, resident);
    let at_peak = Used {
        held: used.peak,
        ..used
    };
    Ended::OutOfMemory {
        message,
        figures: in_the_room(at_peak, None),
    }
}

/// Children start alike but not to the byte, and a search reads two failures as one line only
/// on the same total: the room is counted in whole MiB.
fn round_down_to_mib(bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    bytes / MIB * MIB
}

/// An out-of-memory's figures against the room a trial had: `free` is the room less what the
/// trial held at the failure.
fn in_the_room(used: Used, requested: Option<u64>) -> OutOfMemory {
    OutOfMemory {
        requested,
        free: Some(used.room.saturating_sub(used.held)),
        total: Some(used.room),
        device: Some("cpu".to_owned()),
    }
}

/// What the last child used, shared between a [`ChildTrial`] and the backend a search reads
/// ([`ChildTrial::memory`]).
#[derive(Debug, Clone, Default)]
struct ChildMemory(Arc<Mutex<ChildFigures>>);

#[derive(Debug, Default)]
struct ChildFigures {
    last: Option<Used>,
    /// A child ended since the attempt started and no release came after it: its figures are
    /// the attempt's end; otherwise what a fresh child has, all the room.
    ended: bool,
    /// What the first child under a resident budget held before its step: the start every
    /// later child's resident figures count from.
    resident_start: Option<u64>,
}

impl ChildMemory {
    fn resident_start(&self) -> Option<u64> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .resident_start
    }

    /// A child held `resident` bytes before its step: the start of the trial's resident figures
    /// where no child set one before.
    fn program_started(&self, resident: u64) {
        let mut figures = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        figures.resident_start.get_or_insert(resident);
    }

    fn ended(&self, used: Option<Used>) {
        let mut figures = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // A child that left no figures (killed before it could write them) has none: an
        // earlier child's would read as this one's.
        figures.last = used;
        figures.ended = true;
    }

    fn snapshot(&self, at_end: bool) -> MemorySnapshot {
        let figures = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(used) = figures.last else {
            return MemorySnapshot::default();
        };
        let (held, peak) = if at_end && figures.ended {
            (used.held, Some(used.peak))
        } else {
            (0, None)
        };
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "cpu".to_owned(),
                total: used.room,
                free: used.room.saturating_sub(held),
                pool_reserved: Some(held),
                pool_used: None,
                peak,
            }],
        }
    }
}

impl MemoryBackend for ChildMemory {
    fn release(&self) -> Result<(), ReleaseError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).ended = false;
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        self.snapshot(true)
    }

    fn start_attempt(&self) -> MemorySnapshot {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).ended = false;
        self.snapshot(false)
    }
}

/// A panic's message: the `&str` or `String` it carries.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a payload that is not text".to_owned())
}

/// What the child's stderr said of a failed allocation, and whether the pipe has closed.
#[derive(Default)]
struct AbortMessage {
    /// The bytes of the last "memory allocation of N bytes failed"; whether the pipe closed.
    state: Mutex<(Option<u64>, bool)>,
    changed: Condvar,
}

impl AbortMessage {
    /// Reads `line` for Rust's abort message ("memory allocation of N bytes failed"): the one
    /// line of the child's output ever read, for a figure only, never for the outcome.
    fn read(&self, line: &str) {
        let requested = line
            .trim()
            .strip_prefix("memory allocation of ")
            .and_then(|rest| rest.strip_suffix(" bytes failed"))
            .and_then(|bytes| bytes.parse().ok());
        if requested.is_some() {
            self.state.lock().unwrap_or_else(PoisonError::into_inner).0 = requested;
            self.changed.notify_all();
        }
    }

    fn close(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        self.changed.notify_all();
    }

    /// The bytes the abort message said, once the child has ended: waits until the pipe closes
    /// or the message is there, at most `grace` (a process the child started may hold the pipe
    /// open).
    fn requested(&self, grace: Duration) -> Option<u64> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (state, _) = self
            .changed
            .wait_timeout_while(state, grace, |(requested, closed)| {
                requested.is_none() && !*closed
            })
            .unwrap_or_else(PoisonError::into_inner);
        state.0
    }
}

/// Passes a pipe of the child's through, line by line, on a thread of its own that ends when
/// the pipe closes (which a process the child started may put off: nothing waits for it).
fn pass_through(
    pipe: impl Read + Send + 'static,
    write: impl Fn(&str) + Send + 'static,
    abort_message: Option<Arc<AbortMessage>>,
) -> std::io::Result<()> {
    let forward = move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        let mut passing = true;
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    // `print!` panics where this process's own output is closed (a pipe whose
                    // reader left): the child's output is then read and dropped, so that the
                    // child never blocks on a full pipe.
                    if passing {
                        passing = panic::catch_unwind(AssertUnwindSafe(|| write(&text))).is_ok();
                    }
                    if let Some(abort_message) = &abort_message {
                        abort_message.read(&text);
                    }
                }
            }
        }
        if let Some(abort_message) = &abort_message {
            abort_message.close();
        }
    };
    std::thread::Builder::new()
        .name("batch-size-child-output".to_owned())
        .spawn(forward)
        .map(drop)
}

fn describe_status(status: ExitStatus) -> String {
    match (status.code(), ended_by_signal(status)) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(how)) => how,
        (None, None) => status.to_string(),
    }
}

/// SIGABRT's number on every platform Rust supports.
const SIGABRT: i32 = 6;

#[cfg(unix)]
fn signal_number(status: ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

#[cfg(not(unix))]
fn signal_number(status: ExitStatus) -> Option<i32> {
    (status.code() == Some(3)).then_some(SIGABRT)
}

#[cfg(unix)]
fn ended_by_signal(status: ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let signal = status.signal()?;
    Some(match signal {
        6 => "SIGABRT (a failed allocation aborts a Rust process)".to_owned(),
        9 => "SIGKILL (the kernel's out-of-memory killer, or a kill)".to_owned(),
        11 => "SIGSEGV".to_owned(),
        other => format!("signal {other}"),
    })
}

#[cfg(not(unix))]
fn ended_by_signal(status: ExitStatus) -> Option<String> {
    // Windows: an abort exits with code 3, a failed allocation with 0xC0000017 (no memory).
    match status.code() {
        Some(3) => Some("an abort".to_owned()),
        Some(code) if code as u32 == 0xC000_0017 => Some("STATUS_NO_MEMORY".to_owned()),
        _ => None,
    }
}

/// The arguments, as a person would type them.
struct Args<'a>(&'a [OsString]);

impl fmt::Display for Args<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no arguments");
        }
        for (index, arg) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{}", arg.to_string_lossy())?;
        }
        Ok(())
    }
}

/// How a [`ChildTrial`] failed. [`Died`](Self::Died) and [`OutOfMemory`](Self::OutOfMemory)
/// are out-of-memory (a search retries smaller); the others come back from a search unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChildTrialError {
    /// The child was ended by a signal after the trial started, before it reported how the
    /// trial ended: counted as out-of-memory. Its figures, where the child left them: the bytes
    /// Rust's abort message says it asked for, and what the child held at the abort, in the
    /// room it had (the limit less what the process held before the trial).
    #[error("the trial's child process at batch size {batch_size} was ended by {how}")]
    Died {
        /// The size the child ran.
        batch_size: usize,
        /// The signal.
        how: String,
        /// What makes it out-of-memory to the classification, with the figures.
        #[source]
        out_of_memory: OutOfMemory,
    },
    /// The child's trial returned or panicked with an out-of-memory.
    #[error("the trial's child process at batch size {batch_size} ran out of memory: {message}")]
    OutOfMemory {
        /// The size the child ran.
        batch_size: usize,
        /// The error's or the panic's text, whole.
        message: String,
        /// The figures: those its text states, else the host's in the room the trial had.
        #[source]
        figures: OutOfMemory,
    },
    /// The child's trial returned an error, or panicked, otherwise: its text, whole.
    #[error("the trial's child process at batch size {batch_size} failed: {message}")]
    Failed {
        /// The size the child ran.
        batch_size: usize,
        /// Its exit code.
        status: Option<i32>,
        /// The error's or the panic's text, whole.
        message: String,
    },
    /// The child ended without starting the trial: its arguments did not lead it to
    /// [`ChildTrial::serve`] for this trial (a test's name misspelt, `--ignored` missing, a
    /// `main` that does not call `serve` first). Never a fit.
    #[error(
        "the trial's child process at batch size {batch_size} ended ({status}) without starting \
         trial `{name}`: started with {}, it never reached ChildTrial::serve for it{} (check the \
         test's exact name and --ignored, or that main calls serve first)",
        Args(args),
        RanBeforeServing(ran_before_serving.as_deref())
    )]
    NotStarted {
        /// The size asked for.
        batch_size: usize,
        /// The trial's name.
        name: String,
        /// The arguments the child was started with.
        args: Vec<OsString>,
        /// How it ended.
        status: String,
        /// Where the child reached a trial's [`ChildTrial::run`] before `serve` and was stopped
        /// there, rather than start a child of its own: that trial's name (empty where the
        /// child could not say).
        ran_before_serving: Option<String>,
    },
    /// [`ChildTrial::run`] was called in a child serving the same trial (in its step): it
    /// would start a child of its own, which would do the same, without end.
    #[error(
        "this process is trial `{name}`'s child (started with {}): ChildTrial::run for `{name}` \
         in its step would start a child of its own, which would do the same; call the step's \
         code directly in the child, and run the trial in the parent",
        Args(args)
    )]
    StartedInAChild {
        /// The trial's name.
        name: String,
        /// This process's arguments.
        args: Vec<OsString>,
    },
    /// The trial ran past [`ChildTrial::with_deadline`]; the child was killed.
    #[error("the trial's child process at batch size {batch_size} ran past its deadline of {deadline:?} and was killed")]
    DeadlinePassed {
        /// The size the child ran.
        batch_size: usize,
        /// The deadline.
        deadline: Duration,
    },
    /// The child could not write its report.
    #[error("the trial's child process at batch size {batch_size} could not write its report to {}", path.display())]
    NoReport {
        /// The size the child ran.
        batch_size: usize,
        /// Where it was to write it.
        path: PathBuf,
    },
    /// The child could not be started.
    #[error("could not start the trial's child process: {0}")]
    Start(#[source] std::io::Error),
    /// Waiting for the child failed.
    #[error("could not wait for the trial's child process: {0}")]
    Wait(#[source] std::io::Error),
    /// No size fit (what a search returns through this type).
    #[error(transparent)]
    NoSizeFits(#[from] NoExecutableBatchSize),
    /// The search's answer to a step that left room ([`step_done`](crate::step_done)`?` in a
    /// function returning this type, after the child's step): not a failure. The search finds
    /// the [`Grow`](crate::Grow) in the error's chain (its source), records the attempt as
    /// [`Outcome::Grew`](crate::Outcome::Grew) and runs the function again at the larger size;
    /// the caller never sees it.
    ///
    /// ```no_run
    /// use batch_size_runtime::{find_executable_batch_size, step_done, ChildTrial, ChildTrialError};
    ///
    /// #[find_executable_batch_size(starting = 8192, release = trial.memory())]
    /// fn sized(batch_size: usize, trial: &ChildTrial) -> Result<usize, ChildTrialError> {
    ///     let ran = trial.run(batch_size)?;
    ///     step_done()?; // the child's step ran: its peak may grow the size
    ///     Ok(ran)
    /// }
    /// # let _ = sized;
    /// ```
    #[error("{0}")]
    Grew(#[from] crate::Grow),
    /// Another rank ran out of memory in this step (`safe_point(rank, ...)?` in a function
    /// returning this type): out-of-memory, so a search retries this rank's attempt with the
    /// others.
    #[error("out of device memory on another rank")]
    OutOfMemoryOnAnotherRank,
}

/// ", and it reached ChildTrial::run for trial `x` first, where it was stopped", where it did.
struct RanBeforeServing<'a>(Option<&'a str>);

impl fmt::Display for RanBeforeServing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some("") => f.write_str(
                "; it reached ChildTrial::run first and was stopped there rather than start a \
                 child of its own",
            ),
            Some(trial) => write!(
                f,
                "; it reached ChildTrial::run for trial `{trial}` first and was stopped there \
                 rather than start a child of its own"
            ),
        }
    }
}

#[cfg(test)]
#[allow(clippy::panic)] // a test fails by panicking
mod tests {
    use super::*;

    #[test]
    fn a_peak_past_the_resident_budget_is_out_of_memory_whatever_the_step_returned() {
        const MIB: u64 = 1 << 20;
        let budget = 256 * MIB;
        let within = resident::Resident {
            start: 100 * MIB,
            held: 120 * MIB,
            peak: budget,
        };
        let past = resident::Resident {
            peak: budget + 1,
            ..within
        };
        let failed = || Ended::Failed {
            message: "corrupt record 17".to_owned(),
        };
        assert_eq!(judged_by_the_budget(Ended::Fit, budget, within), Ended::Fit);
        assert_eq!(judged_by_the_budget(failed(), budget, within), failed());
        for (ended, returned) in [(Ended::Fit, None), (failed(), Some("corrupt record 17"))] {
            let Ended::OutOfMemory { message, figures } = judged_by_the_budget(ended, budget, past)
            else {
                panic!("a peak past the budget is out of memory");
            };
            assert!(message.contains("with_resident_limit"), "{message}");
            assert_eq!(
                returned.is_some_and(|returned| message.ends_with(returned)),
                returned.is_some(),
                "{message}"
            );
            // The room: the budget less the start, in whole MiB; nothing of it free.
            assert_eq!(figures.total, Some(156 * MIB));
            assert_eq!(figures.free, Some(0));
            assert_eq!(figures.requested, None);
        }
    }
}
