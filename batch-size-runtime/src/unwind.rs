//! Catching an attempt's panic, sync or async, and keeping a recovered out-of-memory panic from
//! looking like a crash.
//!
//! Rust prints a panic's message from the panic hook, before `catch_unwind` sees it. The
//! [panic filter](crate::panic_filter), put in front of the hook by the first attempt, skips the
//! message of an out-of-memory panic inside an attempt (it is logged at DEBUG instead, and the
//! retry at WARN); every other panic reaches the hook as before, and a hook set later replaces
//! the filter (see the filter's docs for the rule).

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use crate::oom;
use crate::panic_filter;

/// A caught panic's payload.
pub type PanicPayload = Box<dyn Any + Send + 'static>;

static QUIET_OOM_PANICS: AtomicBool = AtomicBool::new(true);

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

/// Whether recovered out-of-memory panics are kept quiet ([`set_quiet_oom_panics`]).
pub(crate) fn quiet_oom_panics() -> bool {
    QUIET_OOM_PANICS.load(Ordering::Relaxed)
}

/// The panic filter's judge during an attempt: an out-of-memory panic is kept quiet unless
/// [`set_quiet_oom_panics`] said otherwise. Read at each panic, so the setting applies at once.
fn quiet_out_of_memory(payload: &(dyn Any + Send)) -> Option<String> {
    if !quiet_oom_panics() {
        return None;
    }
    // A formatted panic message reaches the hook as a `String`, a literal as `&str`.
    oom::classify_panic(payload).map(|found| found.description)
}

/// Runs `attempt`, catching a panic.
///
/// The attempt is run again after an out-of-memory panic, so whatever it borrowed may be seen
/// half-updated by the next attempt: that is why everything holding device memory belongs
/// inside it (hence `AssertUnwindSafe`).
pub fn catch_attempt<R>(attempt: impl FnOnce() -> R) -> Result<R, PanicPayload> {
    panic_filter::catch_judged(quiet_out_of_memory, attempt)
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
        match panic_filter::catch_judged(quiet_out_of_memory, || future.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}
