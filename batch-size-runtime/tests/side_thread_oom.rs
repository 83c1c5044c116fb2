//! An out-of-memory raised on a thread the framework owns, while an attempt runs, is that
//! attempt's out-of-memory: burn 0.22's wgpu backend panics "wgpu error: Out of Memory" on
//! cubecl's device thread, which swallows the panic, and the caller gets "couldn't find resource
//! for that handle" (issue 36). Its own test binary: the evidence is process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use batch_size_runtime::{find_executable_batch_size, last_report, BatchSizeSearch, Outcome};

/// Panics that reached the process's hook (printed, in a real program).
static PRINTED: AtomicUsize = AtomicUsize::new(0);
/// The tests here share the hook and the process-wide evidence: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn count_printed_panics() {
    std::panic::set_hook(Box::new(|_| {
        PRINTED.fetch_add(1, Ordering::SeqCst);
    }));
}

/// What cubecl's device thread does: wgpu's uncaptured-error handler panics there, the thread
/// catches it, and the caller's read fails with a text that says nothing of memory.
fn device_thread_runs_out() -> String {
    let handle = std::thread::Builder::new()
        .name("DSD-3-0".to_owned())
        .spawn(|| {
            let caught = std::panic::catch_unwind(|| panic!("wgpu error: Out of Memory"));
            assert!(caught.is_err());
        })
        .unwrap();
    handle.join().unwrap();
    "An error happened during execution\nCaused by:\n  couldn't find resource for that handle: \
     Memory location was never initialized"
        .to_owned()
}

#[find_executable_batch_size(starting = 32)]
fn train(batch_size: usize) -> Result<usize, String> {
    if batch_size > 8 {
        return Err(device_thread_runs_out());
    }
    Ok(batch_size)
}

#[test]
fn a_device_threads_out_of_memory_counts_for_the_returned_error_and_is_quiet() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let printed = PRINTED.load(Ordering::SeqCst);
    assert_eq!(train().unwrap(), 8);
    assert_eq!(
        PRINTED.load(Ordering::SeqCst),
        printed,
        "the device thread's panic was printed"
    );
    let report = last_report().unwrap();
    let failed: Vec<_> = report
        .attempts()
        .filter(|a| a.outcome.is_out_of_memory())
        .collect();
    assert_eq!(failed.len(), 2); // 32 and 16
    let Outcome::OutOfMemory { error } = &failed[0].outcome else {
        unreachable!()
    };
    // The line that says what ran out comes first, then where and what the caller saw.
    assert!(
        error.starts_with("wgpu error: Out of Memory (raised on thread 'DSD-3-0'"),
        "{error}"
    );
    assert!(
        error.ends_with("the attempt then failed with: An error happened during execution)"),
        "{error}"
    );
}

#[test]
fn a_device_threads_out_of_memory_counts_for_a_panic() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let printed = PRINTED.load(Ordering::SeqCst);
    let found = BatchSizeSearch::new(32).call(|batch_size| {
        if batch_size > 4 {
            // burn's `into_data()` panics with the caller's error.
            panic!("{}", device_thread_runs_out());
        }
        batch_size
    });
    assert_eq!(found.unwrap(), 4);
    assert_eq!(last_report().unwrap().out_of_memory_count(), 3);
    // Neither the device thread's panic nor the attempt's own, its consequence, was printed.
    assert_eq!(PRINTED.load(Ordering::SeqCst), printed);
}

#[test]
fn an_out_of_memory_before_the_attempt_does_not_count() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let printed = PRINTED.load(Ordering::SeqCst);
    device_thread_runs_out(); // no attempt runs: printed, and no attempt's evidence
    assert_eq!(PRINTED.load(Ordering::SeqCst), printed + 1);
    let failed: anyhow::Result<usize> =
        BatchSizeSearch::new(8).run(|_| Err(anyhow::anyhow!("corrupt shard")));
    // Not out-of-memory: the error comes back unchanged after one attempt.
    assert_eq!(failed.unwrap_err().to_string(), "corrupt shard");
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}
