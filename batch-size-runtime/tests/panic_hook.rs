//! The process's panic hook and the panic filter: classifying an error outside a search leaves
//! the hook as it was; the filter that attempts put in front of the hook keeps recovered
//! out-of-memory panics quiet and passes every other panic on (on one thread or several, none
//! lost); a hook set before, during or after a search sees every panic that is not a recovered
//! out-of-memory panic.
//!
//! The hook is one per process, so these tests take turns (`TURN`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::future::Future;
use std::panic::{catch_unwind, panic_any};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread;

use batch_size_runtime::{oom, BatchSizeSearch};
use cudarc::driver::{sys::CUresult, DriverError};

#[path = "common/candle_cuda_error.rs"]
mod candle_cuda_error;
use candle_cuda_error::CandleCudaError;

static TURN: Mutex<()> = Mutex::new(());

fn my_turn() -> MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sets a hook that counts the panics reaching it; the count is returned.
fn counting_hook() -> Arc<AtomicUsize> {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&seen);
    std::panic::set_hook(Box::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    seen
}

/// Where the installed hook's closure lives: the same address, the same hook (the closures
/// here hold an `Arc`, so they are not zero-sized).
fn hook_address() -> usize {
    let hook = std::panic::take_hook();
    let address = std::ptr::from_ref(&*hook).cast::<()>().addr();
    std::panic::set_hook(hook);
    address
}

fn panic_outside_any_attempt(message: &'static str) {
    let caught = catch_unwind(|| panic_any(message));
    assert!(caught.is_err());
}

/// A search whose sizes above 1 run out of memory by panicking.
fn search_with_oom_panics() -> usize {
    BatchSizeSearch::new(8)
        .call(|batch_size| {
            if batch_size > 1 {
                panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
            }
            batch_size
        })
        .unwrap()
}

#[test]
fn classifying_an_error_leaves_the_hook_as_it_was() {
    let _turn = my_turn();
    let seen = counting_hook();
    let mine = hook_address();

    // Its Display panics while it is read: quiet, and not recognised by its text.
    let error = CandleCudaError(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    assert!(!oom::is_out_of_memory(&error));
    assert!(oom::classify_error(&error).is_none());
    assert!(oom::is_out_of_memory(&std::io::Error::other(
        "CUDA out of memory. Tried to allocate 2.00 GiB"
    )));
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "a quiet read reached the hook"
    );
    assert_eq!(hook_address(), mine, "classifying changed the hook");

    // The hook is still the one set above: it sees the next panic, even an out-of-memory one.
    panic_outside_any_attempt("index out of bounds");
    panic_outside_any_attempt("CUDA out of memory. Tried to allocate 2.00 GiB");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    let _ = std::panic::take_hook();
}

#[test]
fn out_of_memory_panics_inside_attempts_stay_quiet_and_others_reach_the_hook() {
    let _turn = my_turn();
    let seen = counting_hook();
    assert_eq!(search_with_oom_panics(), 1);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "a recovered OOM panic was printed"
    );
    // The filter stays in front of the hook (see `panic_filter`), passing everything else on.

    // A panic that is not out-of-memory, inside an attempt: the hook sees it, and the search
    // lets it go on unwinding.
    let crashed = catch_unwind(|| {
        BatchSizeSearch::new(8).call(|_batch_size| -> usize { panic!("index out of bounds") })
    });
    assert!(crashed.is_err());
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    // Outside attempts the hook set before the search sees every panic, out-of-memory or not.
    panic_outside_any_attempt("CUDA out of memory. Tried to allocate 2.00 GiB");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    let _ = std::panic::take_hook();
}

#[test]
fn a_hook_set_after_a_search_sees_every_panic() {
    let _turn = my_turn();
    let _ = std::panic::take_hook();
    assert_eq!(search_with_oom_panics(), 1);

    let seen = counting_hook();
    panic_outside_any_attempt("index out of bounds");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // Outside an attempt nothing is filtered, out-of-memory or not.
    panic_outside_any_attempt("CUDA out of memory. Tried to allocate 2.00 GiB");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    let _ = std::panic::take_hook();
}

#[test]
fn a_hook_set_while_attempts_run_is_kept() {
    let _turn = my_turn();
    let before = counting_hook();
    let during = Arc::new(AtomicUsize::new(0));
    let fitted = BatchSizeSearch::new(8)
        .call(|batch_size| {
            if batch_size == 8 {
                let counter = Arc::clone(&during);
                std::panic::set_hook(Box::new(move |_| {
                    counter.fetch_add(1, Ordering::SeqCst);
                }));
            }
            if batch_size > 2 {
                panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
            }
            batch_size
        })
        .unwrap();
    assert_eq!(fitted, 2);
    // It replaced the filter, so the first attempt's panic reached it; the next attempt put
    // the filter in front of it, and that panic did not.
    let printed_during_search = during.load(Ordering::SeqCst);
    assert_eq!(printed_during_search, 1);

    panic_outside_any_attempt("index out of bounds");
    assert_eq!(during.load(Ordering::SeqCst), printed_during_search + 1);
    assert_eq!(before.load(Ordering::SeqCst), 0);
    let _ = std::panic::take_hook();
}

#[test]
fn attempts_on_several_threads_share_the_filter_and_no_other_panic_is_lost() {
    let _turn = my_turn();
    let seen = counting_hook();
    // One search holds its attempt open for the whole test, so that the filter, installed
    // once, stays while the others come and go. (Where every search has ended the filter is
    // taken out, and std has no way to put a hook in place without the default hook standing
    // for an instant between `take_hook` and `set_hook`: a panic of another thread in that
    // instant would be printed by the default hook. That instant is not what this tests.)
    let (inside, release) = (
        Arc::new(std::sync::Barrier::new(2)),
        Arc::new(std::sync::Barrier::new(2)),
    );
    let holder = {
        let (inside, release) = (Arc::clone(&inside), Arc::clone(&release));
        thread::spawn(move || {
            BatchSizeSearch::new(1)
                .call(|batch_size| {
                    inside.wait();
                    release.wait();
                    batch_size
                })
                .unwrap()
        })
    };
    inside.wait();
    let searches: Vec<_> = (0..4)
        .map(|_| thread::spawn(|| (0..20).map(|_| search_with_oom_panics()).sum::<usize>()))
        .collect();
    // Meanwhile, panics of this thread outside attempts reach the hook.
    for _ in 0..20 {
        panic_outside_any_attempt("index out of bounds");
    }
    for search in searches {
        assert_eq!(search.join().unwrap(), 20);
    }
    release.wait();
    assert_eq!(holder.join().unwrap(), 1);
    // Every one of them: the filter is not swapped in and out around each attempt, so no panic
    // of this thread can fall between a `take_hook` and a `set_hook` into the default hook.
    assert_eq!(seen.load(Ordering::SeqCst), 20);
    panic_outside_any_attempt("CUDA out of memory. Tried to allocate 2.00 GiB");
    assert_eq!(seen.load(Ordering::SeqCst), 21);
    let _ = std::panic::take_hook();
}

/// Pending once, then runs out of memory by panicking.
struct PendingThenOom {
    polled: bool,
}

impl Future for PendingThenOom {
    type Output = usize;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
        if !self.polled {
            self.polled = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        panic!("CUDA out of memory. Tried to allocate 1.00 GiB")
    }
}

#[test]
fn an_async_attempt_is_quiet_across_its_polls_and_passes_other_panics_on() {
    let _turn = my_turn();
    let seen = counting_hook();
    let mut context = Context::from_waker(Waker::noop());
    // Every size above 2 is pending once, then panics out of memory; 2 runs.
    let search = BatchSizeSearch::new(8).run_async(|batch_size| async move {
        if batch_size > 2 {
            PendingThenOom { polled: false }.await;
        }
        Ok::<_, anyhow::Error>(batch_size)
    });
    let mut search = std::pin::pin!(search);
    let fitted = loop {
        if let Poll::Ready(fitted) = search.as_mut().poll(&mut context) {
            break fitted;
        }
    };
    assert_eq!(fitted.unwrap(), 2);
    assert_eq!(seen.load(Ordering::SeqCst), 0);

    // A search dropped while its attempt is pending leaves nothing quiet behind on this thread.
    let abandoned = BatchSizeSearch::new(8).run_async(|batch_size| async move {
        PendingThenOom { polled: false }.await;
        Ok::<_, anyhow::Error>(batch_size)
    });
    let mut abandoned = Box::pin(abandoned);
    assert!(abandoned.as_mut().poll(&mut context).is_pending());
    drop(abandoned);

    panic_outside_any_attempt("CUDA out of memory. Tried to allocate 2.00 GiB");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let _ = std::panic::take_hook();
}
