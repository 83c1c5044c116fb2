//! Catching an attempt's panic, sync or async, and keeping a recovered out-of-memory panic from
//! looking like a crash.
//!
//! Rust prints a panic's message from the panic hook, before `catch_unwind` sees it. While an
//! attempt runs, a filter installed in front of the hook skips the message of a panic that is
//! out-of-memory (it is logged at DEBUG instead, and the retry at WARN); every other panic
//! still reaches the hook that was there before.

use std::any::Any;
use std::cell::Cell;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::task::{Context, Poll};

use crate::oom;

/// A caught panic's payload.
pub type PanicPayload = Box<dyn Any + Send + 'static>;

thread_local! {
    static ATTEMPTS_RUNNING: Cell<usize> = const { Cell::new(0) };
    /// Set while an error's text is read for classification: a panic there is expected.
    static READING_TEXT: Cell<bool> = const { Cell::new(false) };
}

static QUIET_OOM_PANICS: AtomicBool = AtomicBool::new(true);
static INSTALL_FILTER: Once = Once::new();

/// Whether the message of an out-of-memory panic caught by the search is kept from the panic
/// hook (`true`, the default) or printed like any panic (`false`).
///
/// With the default, a recovered out-of-memory panic prints nothing: the retry is logged at
/// WARN through `tracing`, and the panic's message and location at DEBUG. Panics that are not
/// out-of-memory always reach your hook.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use batch_size_runtime::{set_quiet_oom_panics, BatchSizeSearch};
///
/// static PRINTED: AtomicUsize = AtomicUsize::new(0); // panics that reached the hook
/// std::panic::set_hook(Box::new(|_| {
///     PRINTED.fetch_add(1, Ordering::Relaxed);
/// }));
/// let search = || {
///     BatchSizeSearch::new(2).call(|batch_size| {
///         if batch_size > 1 {
///             panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
///         }
///         batch_size
///     })
/// };
///
/// assert_eq!(search().unwrap(), 1);
/// assert_eq!(PRINTED.load(Ordering::Relaxed), 0); // quiet by default
///
/// set_quiet_oom_panics(false); // print them, as Rust does by default
/// assert_eq!(search().unwrap(), 1);
/// assert_eq!(PRINTED.load(Ordering::Relaxed), 1);
/// ```
pub fn set_quiet_oom_panics(quiet: bool) {
    QUIET_OOM_PANICS.store(quiet, Ordering::Relaxed);
}

fn install_filter() {
    INSTALL_FILTER.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if READING_TEXT.with(Cell::get) {
                tracing::debug!(
                    location = %info.location().map(ToString::to_string).unwrap_or_default(),
                    "an error's Display panicked while it was classified; its text is not used"
                );
                return;
            }
            let inside_attempt = ATTEMPTS_RUNNING.with(Cell::get) > 0;
            if inside_attempt && QUIET_OOM_PANICS.load(Ordering::Relaxed) {
                // A formatted panic message reaches the hook as a `String`, a literal as `&str`.
                if let Some(found) = oom::classify_panic(info.payload()) {
                    tracing::debug!(
                        location = %info.location().map(ToString::to_string).unwrap_or_default(),
                        error = %found.description,
                        "out-of-memory panic caught; the attempt will be retried"
                    );
                    return;
                }
            }
            previous(info);
        }));
    });
}

/// Runs `read` (an error's `Display`, a user's rule), turning a panic into `None` without
/// printing it: cudarc's errors call into libcuda when formatted and panic where it is absent,
/// and classification must never panic because of what an error's text does.
pub(crate) fn quietly<R>(read: impl FnOnce() -> R) -> Option<R> {
    install_filter();
    let was = READING_TEXT.with(|reading| reading.replace(true));
    let result = panic::catch_unwind(AssertUnwindSafe(read)).ok();
    READING_TEXT.with(|reading| reading.set(was));
    result
}

/// Marks this thread as running an attempt for as long as it lives.
struct AttemptGuard;

impl AttemptGuard {
    fn enter() -> Self {
        install_filter();
        ATTEMPTS_RUNNING.with(|running| running.set(running.get() + 1));
        AttemptGuard
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        ATTEMPTS_RUNNING.with(|running| running.set(running.get().saturating_sub(1)));
    }
}

/// Runs `attempt`, catching a panic.
///
/// The attempt is run again after an out-of-memory panic, so whatever it borrowed may be seen
/// half-updated by the next attempt: that is why everything holding device memory belongs
/// inside it (hence `AssertUnwindSafe`).
pub fn catch_attempt<R>(attempt: impl FnOnce() -> R) -> Result<R, PanicPayload> {
    let _running = AttemptGuard::enter();
    panic::catch_unwind(AssertUnwindSafe(attempt))
}

/// A future that catches a panic raised while it is polled.
///
/// ```
/// use std::future::Future;
/// use std::pin::Pin;
/// use std::task::{Context, Poll, Waker};
/// use batch_size_runtime::{oom, CatchUnwind};
///
/// async fn step(batch_size: usize) -> usize {
///     if batch_size > 4 {
///         panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
///     }
///     batch_size
/// }
///
/// let mut context = Context::from_waker(Waker::noop());
/// let mut fits = CatchUnwind::new(step(4));
/// assert!(matches!(Pin::new(&mut fits).poll(&mut context), Poll::Ready(Ok(4))));
///
/// let mut too_big = CatchUnwind::new(step(8));
/// let Poll::Ready(Err(payload)) = Pin::new(&mut too_big).poll(&mut context) else {
///     panic!("the panic should have been caught");
/// };
/// assert_eq!(oom::classify_panic(&*payload).unwrap().requested, Some(1 << 30));
/// ```
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct CatchUnwind<F> {
    // Boxed so that polling needs no pin projection (and no `unsafe`); one allocation per
    // attempt is nothing next to an attempt's work.
    future: Pin<Box<F>>,
}

impl<F: Future> CatchUnwind<F> {
    /// Wraps `future`.
    ///
    /// ```
    /// # use std::future::Future;
    /// # use std::task::{Context, Poll, Waker};
    /// # use batch_size_runtime::CatchUnwind;
    /// let mut future = CatchUnwind::new(async { 7 });
    /// let polled = std::pin::Pin::new(&mut future).poll(&mut Context::from_waker(Waker::noop()));
    /// assert!(matches!(polled, Poll::Ready(Ok(7))));
    /// ```
    pub fn new(future: F) -> Self {
        CatchUnwind {
            future: Box::pin(future),
        }
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, PanicPayload>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.future.as_mut();
        match catch_attempt(|| future.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}
