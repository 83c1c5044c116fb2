//! The panic filter: a hook in front of the process's own that keeps quiet the panics the crate
//! expects (an out-of-memory panic in an attempt, a panicking `Display` read for classification)
//! and passes every other on. The rules are in docs/HOW_IT_WORKS.md ("What counts as
//! out-of-memory"): in front once, not swapped at every attempt; a hook set later wins; per
//! thread; a quiet read outside a search puts your very hook back after. A framework's device
//! thread's out-of-memory counts only for an attempt that failed as its lost work fails.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe, PanicHookInfo};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// A panic hook, as `std::panic::set_hook` takes it.
type Hook = Box<dyn Fn(&PanicHookInfo<'_>) + Sync + Send + 'static>;

/// Recognises a panic to keep quiet during an attempt, saying what it was for the DEBUG log.
pub(crate) type Judge = fn(&(dyn Any + Send)) -> Option<String>;

/// What this thread's sections keep quiet.
#[derive(Clone, Copy, Default)]
struct Quiet {
    /// Quiet reads running: every panic is expected.
    reading: usize,
    /// The innermost running attempt's judge.
    attempt: Option<Judge>,
    /// [`SIDE_OOMS`] when that attempt began, to recognise its lost-device-work panic.
    side_seen: u64,
}

thread_local! {
    static QUIET: Cell<Quiet> = const {
        Cell::new(Quiet {
            reading: 0,
            attempt: None,
            side_seen: 0,
        })
    };
}

/// Attempts running now, on every thread (a device thread's OOM is kept quiet only then).
static ATTEMPTS_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// How other threads' panics are read, given by the first attempt (this module cannot import `oom`).
#[derive(Clone, Copy)]
pub(crate) struct SideRules {
    /// The line of a panic that says what ran out, if it is an out-of-memory panic.
    pub(crate) out_of_memory: fn(&(dyn Any + Send)) -> Option<String>,
    /// Whether recovered out-of-memory panics are kept quiet.
    pub(crate) quiet: fn() -> bool,
    /// Whether a thread so named is a framework's device thread, which catches its own panics.
    pub(crate) device_thread: fn(&str) -> bool,
    /// Whether an attempt's failure text is what a framework's lost device work leaves.
    pub(crate) lost_device_work: fn(&str) -> bool,
}

static SIDE_RULES: OnceLock<SideRules> = OnceLock::new();

/// Out-of-memory panics on frameworks' device threads since the process started, and the latest.
static SIDE_OOMS: AtomicU64 = AtomicU64::new(0);
static LATEST_SIDE_OOM: Mutex<Option<SideOom>> = Mutex::new(None);

/// An out-of-memory panic on a framework's device thread.
#[derive(Debug, Clone)]
struct SideOom {
    /// The line that says what ran out.
    line: String,
    thread: String,
}

/// Taken when an attempt begins (one atomic load): whether a device thread ran out since then.
#[derive(Debug)]
pub(crate) struct SideWatch {
    seen: u64,
}

impl SideWatch {
    pub(crate) fn start() -> SideWatch {
        SideWatch {
            seen: SIDE_OOMS.load(Ordering::Acquire),
        }
    }

    /// The latest device thread's out-of-memory since this watch began, as the attempt's, where
    /// `attempt_failed_with` is what the lost device work leaves.
    pub(crate) fn out_of_memory(&self, attempt_failed_with: &str) -> Option<SideOutOfMemory> {
        if SIDE_OOMS.load(Ordering::Acquire) == self.seen {
            return None;
        }
        let rules = SIDE_RULES.get()?;
        if !(rules.lost_device_work)(attempt_failed_with) {
            return None;
        }
        let latest = LATEST_SIDE_OOM
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()?;
        let failed_with = attempt_failed_with
            .lines()
            .next()
            .unwrap_or_default()
            .trim();
        let description = format!(
            "{} (raised on thread '{}' while the attempt ran; the attempt then failed with: {failed_with})",
            latest.line, latest.thread
        );
        Some(SideOutOfMemory {
            line: latest.line,
            description,
        })
    }
}

/// Another thread's out-of-memory panic, as a failed attempt's: its line and the description.
#[derive(Debug)]
pub(crate) struct SideOutOfMemory {
    pub(crate) line: String,
    pub(crate) description: String,
}

/// Counts an attempt as running until dropped.
struct Running;

impl Running {
    fn begin(side: SideRules) -> Running {
        let _ = SIDE_RULES.get_or_init(|| side);
        ATTEMPTS_RUNNING.fetch_add(1, Ordering::AcqRel);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        ATTEMPTS_RUNNING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A panic on a thread with no section: a device thread's out-of-memory is counted (always: an
/// async attempt between polls is not running) and kept quiet while an attempt runs.
fn side_thread_panic(info: &PanicHookInfo<'_>) -> bool {
    let Some(rules) = SIDE_RULES.get() else {
        // No attempt has run in this process: no attempt to count it for.
        return false;
    };
    let current = std::thread::current();
    let Some(thread) = current.name().filter(|name| (rules.device_thread)(name)) else {
        return false;
    };
    let thread = thread.to_owned();
    let Some(line) = (rules.out_of_memory)(info.payload()) else {
        return false;
    };
    *LATEST_SIDE_OOM
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(SideOom {
        line: line.clone(),
        thread: thread.clone(),
    });
    SIDE_OOMS.fetch_add(1, Ordering::AcqRel);
    if ATTEMPTS_RUNNING.load(Ordering::Acquire) == 0 {
        return false;
    }
    let quiet = (rules.quiet)();
    if quiet {
        tracing::debug!(
            thread = %thread,
            location = %info.location().map(ToString::to_string).unwrap_or_default(),
            error = %line,
            "out-of-memory panic on a framework's device thread while an attempt runs; an attempt that then fails as its lost work does counts as out-of-memory"
        );
    }
    quiet
}

/// The filter as installed, for putting the previous hook back.
struct Installed {
    /// The hook the filter stands in front of (a count of 2: the filter is alive).
    previous: Arc<Hook>,
    /// Where the filter's closure lives: with the filter alive, nothing else can be there.
    address: usize,
}

struct Filter {
    /// Sections running, on every thread.
    users: usize,
    installed: Option<Installed>,
}

static FILTER: Mutex<Filter> = Mutex::new(Filter {
    users: 0,
    installed: None,
});

/// Whether the resident filter (attempts') is in the process's hook; cleared when it is dropped.
static RESIDENT: AtomicBool = AtomicBool::new(false);

/// Clears [`RESIDENT`] when the resident filter is dropped.
struct Resident;

impl Drop for Resident {
    fn drop(&mut self) {
        RESIDENT.store(false, Ordering::Release);
    }
}

/// Puts the resident filter in front of the process's hook, unless it is there already.
pub(crate) fn stay_in_front() {
    if RESIDENT.load(Ordering::Acquire) || std::thread::panicking() {
        return;
    }
    // Serialised with the quiet reads' own filter going in and out.
    let _filter = FILTER.lock().unwrap_or_else(PoisonError::into_inner);
    if RESIDENT.load(Ordering::Acquire) {
        return;
    }
    let previous = panic::take_hook();
    let resident = Resident;
    RESIDENT.store(true, Ordering::Release);
    panic::set_hook(Box::new(move |info| {
        let _alive = &resident;
        if !keeps_quiet(info) {
            previous(info);
        }
    }));
}

/// A quiet read's filter counted in until dropped (not on a panicking thread: no hook change there).
#[derive(Debug)]
pub(crate) struct InUse {
    counted: bool,
}

impl InUse {
    pub(crate) fn begin() -> InUse {
        if std::thread::panicking() {
            return InUse { counted: false };
        }
        let mut filter = FILTER.lock().unwrap_or_else(PoisonError::into_inner);
        filter.users += 1;
        if filter.users == 1 {
            // A filter left in place by a section that ended while panicking goes first.
            uninstall(&mut filter);
            install(&mut filter);
        }
        InUse { counted: true }
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut filter = FILTER.lock().unwrap_or_else(PoisonError::into_inner);
        filter.users = filter.users.saturating_sub(1);
        // On a panicking thread the hook cannot be changed: the filter stays, passing every
        // panic on, until the next section replaces it.
        if filter.users == 0 && !std::thread::panicking() {
            uninstall(&mut filter);
        }
    }
}

fn address_of(hook: &Hook) -> usize {
    std::ptr::from_ref(&**hook).cast::<()>().addr()
}

fn install(filter: &mut Filter) {
    let previous = Arc::new(panic::take_hook());
    let passed_on = Arc::clone(&previous);
    let hook: Hook = Box::new(move |info| {
        if !keeps_quiet(info) {
            passed_on(info);
        }
    });
    let address = address_of(&hook);
    panic::set_hook(hook);
    filter.installed = Some(Installed { previous, address });
}

fn uninstall(filter: &mut Filter) {
    let Some(installed) = filter.installed.take() else {
        return;
    };
    let current = panic::take_hook();
    let ours =
        Arc::strong_count(&installed.previous) > 1 && address_of(&current) == installed.address;
    if !ours {
        // Someone set a hook while sections ran: it stays.
        panic::set_hook(current);
        return;
    }
    // Dropping the filter leaves `previous` unshared, so the very hook taken goes back.
    drop(current);
    match Arc::try_unwrap(installed.previous) {
        Ok(previous) => panic::set_hook(previous),
        Err(shared) => panic::set_hook(Box::new(move |info| shared(info))),
    }
}

/// Whether a section of this thread expects the panic (then it is logged at DEBUG, not printed).
fn keeps_quiet(info: &PanicHookInfo<'_>) -> bool {
    // A thread that is ending has no sections left.
    let Ok(quiet) = QUIET.try_with(Cell::get) else {
        return false;
    };
    let location = || info.location().map(ToString::to_string).unwrap_or_default();
    if quiet.reading > 0 {
        tracing::debug!(
            location = %location(),
            "an error's Display or a rule panicked while it was classified; it is not used"
        );
        return true;
    }
    let Some(judge) = quiet.attempt else {
        return side_thread_panic(info);
    };
    match judge(info.payload()) {
        Some(description) => {
            tracing::debug!(
                location = %location(),
                error = %description,
                "out-of-memory panic caught; the attempt will be retried"
            );
            true
        }
        // burn's `into_data()` panics with the lost handle after its device thread ran out.
        None if SIDE_OOMS.load(Ordering::Acquire) != quiet.side_seen
            && SIDE_RULES.get().is_some_and(|rules| {
                (rules.quiet)() && panic_text(info.payload()).is_some_and(rules.lost_device_work)
            }) =>
        {
            tracing::debug!(
                location = %location(),
                "the attempt panicked after another thread ran out of memory; it will be retried"
            );
            true
        }
        None => false,
    }
}

/// A panic's message, where it is text.
pub(crate) fn panic_text(payload: &(dyn Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&'static str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

/// Marks this thread's panics as `change` says until dropped.
struct Marked {
    was: Quiet,
}

impl Marked {
    fn mark(change: impl FnOnce(&mut Quiet)) -> Marked {
        QUIET.with(|quiet| {
            let was = quiet.get();
            let mut now = was;
            change(&mut now);
            quiet.set(now);
            Marked { was }
        })
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        let was = self.was;
        // A thread that is ending has nothing left to mark.
        let _ = QUIET.try_with(|quiet| quiet.set(was));
    }
}

/// Runs `read` (an error's `Display`, a user's rule), turning a panic into `None` unprinted
/// (cudarc's errors panic when formatted without libcuda).
pub(crate) fn quietly<R>(read: impl FnOnce() -> R) -> Option<R> {
    // Inside a search the resident filter is there; otherwise one goes in for this read.
    let _in_use = (!RESIDENT.load(Ordering::Acquire)).then(InUse::begin);
    let _marked = Marked::mark(|quiet| quiet.reading += 1);
    panic::catch_unwind(AssertUnwindSafe(read)).ok()
}

/// Runs `attempt`, catching its panic, and keeping quiet a panic `judge` recognises.
pub(crate) fn catch_judged<R>(
    judge: Judge,
    side: SideRules,
    attempt: impl FnOnce() -> R,
) -> Result<R, Box<dyn Any + Send + 'static>> {
    stay_in_front();
    let _running = Running::begin(side);
    let _marked = Marked::mark(|quiet| {
        quiet.attempt = Some(judge);
        quiet.side_seen = SIDE_OOMS.load(Ordering::Acquire);
    });
    panic::catch_unwind(AssertUnwindSafe(attempt))
}
