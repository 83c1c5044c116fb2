//! The panic filter: a panic hook in front of the process's own that keeps quiet the panics
//! the crate expects (an out-of-memory panic inside an attempt it will retry, an error's
//! `Display` that panics while it is read for classification) and passes every other panic to
//! the hook that was there, as it was.
//!
//! Rust calls the panic hook before `catch_unwind` sees the panic, so keeping a caught panic
//! quiet needs a hook. The hook is one per process and attempts may run on several threads at
//! once, hence this rule:
//!
//! - **In front once, not at every attempt.** The first attempt puts the filter in front of the
//!   hook set at that moment, and it stays there: outside attempts it passes every panic on,
//!   untouched. Putting a hook in and out costs `take_hook` then `set_hook`, and a panic on
//!   another thread between the two reaches Rust's default hook instead of yours: done at every
//!   attempt (a data loader's thread panicking while the training thread retries), your hook
//!   would miss panics, and every attempt would pay the swap (about 70 ns, measured).
//! - **A hook you set later wins.** `std::panic::set_hook` replaces the filter: your hook sees
//!   every panic. The filter notices it was dropped, and the next attempt puts it in front of
//!   your hook (a hook that wraps the one it took keeps the filter inside it, which passes
//!   everything on outside attempts).
//! - **Per thread.** The filter keeps a panic quiet only on a thread inside an attempt or a
//!   quiet read, and only as that section says: everything during a quiet read; during an
//!   attempt, what the attempt's judge recognises (out-of-memory). Other threads' panics pass.
//! - **Reading is no side effect.** Outside any search (`oom::is_out_of_memory` called by you),
//!   a quiet read puts a filter in front for the read alone and puts your very hook back after.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe, PanicHookInfo};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

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
}

thread_local! {
    static QUIET: Cell<Quiet> = const {
        Cell::new(Quiet {
            reading: 0,
            attempt: None,
        })
    };
}

/// The filter as installed, for putting the previous hook back.
struct Installed {
    /// The hook the filter stands in front of; the filter holds the other reference, so a
    /// count of 2 says the filter is alive.
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

/// Whether the resident filter (the one attempts put in front) is in the process's hook: cleared
/// when it is dropped, which `set_hook` does when it replaces it.
static RESIDENT: AtomicBool = AtomicBool::new(false);

/// Clears [`RESIDENT`] when the resident filter is dropped.
struct Resident;

impl Drop for Resident {
    fn drop(&mut self) {
        RESIDENT.store(false, Ordering::Release);
    }
}

/// Puts the resident filter in front of the process's hook, unless it is there already (one
/// atomic load on every attempt after the first).
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

/// A quiet read's filter counted in, from the first read's start to the last one's end, where
/// the resident filter is not there; dropping it counts out.
///
/// A section begun on a panicking thread (a quiet read inside a hook) is not counted: the hook
/// cannot be changed there, and the section it runs in is already counted.
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

/// Whether the panic `info` describes is expected by a section of this thread (then it is
/// logged at DEBUG instead of printed).
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
        return false;
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
        None => false,
    }
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

/// Runs `read` (an error's `Display`, a user's rule), turning a panic into `None` without
/// printing it: cudarc's errors call into libcuda when formatted and panic where it is absent,
/// and classification must never panic because of what an error's text does.
pub(crate) fn quietly<R>(read: impl FnOnce() -> R) -> Option<R> {
    // Inside a search the resident filter is there; otherwise one goes in for this read.
    let _in_use = (!RESIDENT.load(Ordering::Acquire)).then(InUse::begin);
    let _marked = Marked::mark(|quiet| quiet.reading += 1);
    panic::catch_unwind(AssertUnwindSafe(read)).ok()
}

/// Runs `attempt` on this thread, catching its panic, and keeping quiet a panic `judge`
/// recognises.
pub(crate) fn catch_judged<R>(
    judge: Judge,
    attempt: impl FnOnce() -> R,
) -> Result<R, Box<dyn Any + Send + 'static>> {
    stay_in_front();
    let _marked = Marked::mark(|quiet| quiet.attempt = Some(judge));
    panic::catch_unwind(AssertUnwindSafe(attempt))
}
