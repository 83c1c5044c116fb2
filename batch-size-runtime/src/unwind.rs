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
use std::task::{Context, Poll};

use crate::oom;
use crate::panic_filter;

/// A caught panic's payload.
pub type PanicPayload = Box<dyn Any + Send + 'static>;

/// The panic filter's judge during an attempt: an out-of-memory panic is kept quiet unless
/// [`set_quiet_oom_panics`](oom::set_quiet_oom_panics) said otherwise. Read at each panic, so the setting applies at once.
fn quiet_out_of_memory(payload: &(dyn Any + Send)) -> Option<String> {
    if !oom::quiet_oom_panics() {
        return None;
    }
    // A formatted panic message reaches the hook as a `String`, a literal as `&str`.
    oom::classify_panic(payload).map(|found| found.description)
}

/// How the panic filter reads the panics of threads that run no attempt (cubecl's device
/// threads): which threads are a framework's device threads, the line that says what ran out,
/// whether such panics are kept quiet, and what an attempt whose device work was lost fails with.
const SIDE_RULES: panic_filter::SideRules = panic_filter::SideRules {
    out_of_memory: |payload| oom::classify_panic(payload).map(|found| found.description),
    quiet: oom::quiet_oom_panics,
    device_thread: oom::is_device_thread,
    lost_device_work: oom::is_lost_device_work,
};

/// Runs `attempt`, catching a panic.
///
/// The attempt is run again after an out-of-memory panic, so whatever it borrowed may be seen
/// half-updated by the next attempt: that is why everything holding device memory belongs
/// inside it (hence `AssertUnwindSafe`).
pub fn catch_attempt<R>(attempt: impl FnOnce() -> R) -> Result<R, PanicPayload> {
    panic_filter::catch_judged(quiet_out_of_memory, SIDE_RULES, attempt)
}

/// A future that catches a panic raised while it is polled: the async attempts' catch
/// (tests/panic_hook.rs runs it through `BatchSizeSearch::run_async`).
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub(crate) struct CatchUnwind<F> {
    // Boxed so that polling needs no pin projection (and no `unsafe`); one allocation per
    // attempt is nothing next to an attempt's work.
    future: Pin<Box<F>>,
}

impl<F: Future> CatchUnwind<F> {
    /// Wraps `future`.
    pub(crate) fn new(future: F) -> Self {
        CatchUnwind {
            future: Box::pin(future),
        }
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, PanicPayload>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.future.as_mut();
        match panic_filter::catch_judged(quiet_out_of_memory, SIDE_RULES, || future.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}
