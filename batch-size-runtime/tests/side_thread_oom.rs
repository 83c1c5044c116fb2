//! An out-of-memory raised on a thread the framework owns, while an attempt runs, is that
//! attempt's out-of-memory when the attempt fails as the lost work does: burn 0.22's wgpu backend
//! panics "wgpu error: Out of Memory" on cubecl's device thread, which swallows the panic, and
//! the caller gets "couldn't find resource for that handle". Any other thread's out-of-memory
//! (another search's, a thread of no search) never changes an attempt's outcome, and a thread
//! that dies of it is printed. Its own test binary: the panic hook is process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use std::sync::mpsc;

use batch_size_runtime::{
    find_executable_batch_size, last_report, BatchSizeSearch, Chunked, EffectiveBatch, Outcome,
};

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

/// A thread of no search (a metrics exporter) dies of an out-of-memory panic, uncaught.
fn unrelated_thread_dies_of_out_of_memory() {
    let died = std::thread::Builder::new()
        .name("metrics-exporter".to_owned())
        .spawn(|| panic!("CUDA out of memory. Tried to allocate 2.00 GiB"))
        .unwrap()
        .join();
    assert!(died.is_err());
}

const DATA_ERROR: &str = "corrupt record 17 in shard 3";

#[test]
fn a_thread_of_no_search_never_turns_a_data_error_into_a_retry() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let printed = PRINTED.load(Ordering::SeqCst);

    let failed: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|_| {
        unrelated_thread_dies_of_out_of_memory();
        Err(anyhow::anyhow!(DATA_ERROR))
    });
    assert_eq!(failed.unwrap_err().to_string(), DATA_ERROR);
    assert_eq!(last_report().unwrap().attempts().count(), 1);

    let mut runner = EffectiveBatch::new(64);
    let failed = runner.step(|_| -> anyhow::Result<()> {
        unrelated_thread_dies_of_out_of_memory();
        Err(anyhow::anyhow!(DATA_ERROR))
    });
    assert_eq!(failed.unwrap_err().to_string(), DATA_ERROR);
    assert_eq!(runner.last_step_report().attempts().count(), 1);

    let mut chunked = Chunked::new(100).with_starting(50);
    let failed = chunked.for_each(|_| -> anyhow::Result<()> {
        unrelated_thread_dies_of_out_of_memory();
        Err(anyhow::anyhow!(DATA_ERROR))
    });
    assert!(
        failed.unwrap_err().to_string().starts_with(DATA_ERROR),
        "the data error came back"
    );
    assert_eq!(chunked.chunk_count(), 1);

    // Each dying thread was printed, as Rust prints it: three threads, three panics.
    assert_eq!(PRINTED.load(Ordering::SeqCst), printed + 3);
}

#[test]
fn a_device_threads_out_of_memory_does_not_take_a_data_error() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    // The device thread lost work, but the attempt failed for a reason of its own.
    let failed: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|_| {
        device_thread_runs_out();
        Err(anyhow::anyhow!(DATA_ERROR))
    });
    assert_eq!(failed.unwrap_err().to_string(), DATA_ERROR);
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}

#[test]
fn another_searchs_out_of_memory_never_changes_this_ones_outcome() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let (a_ran_out, b_may_fail) = mpsc::channel::<()>();
    let (b_running, a_may_run) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        // Search A runs out of memory, by panic, on its own thread while B's attempt runs.
        let a = scope.spawn(move || {
            let mut first = true;
            BatchSizeSearch::new(32).call(|batch_size| {
                if first {
                    first = false;
                    a_may_run.recv().unwrap();
                    let _ = a_ran_out.send(());
                    panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
                }
                batch_size
            })
        });
        let b = scope.spawn(move || {
            let failed: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|_| {
                b_running.send(()).unwrap();
                b_may_fail.recv().unwrap();
                Err(anyhow::anyhow!(DATA_ERROR))
            });
            (failed, last_report().unwrap().attempts().count())
        });
        assert_eq!(a.join().unwrap().unwrap(), 16);
        let (failed, attempts) = b.join().unwrap();
        assert_eq!(failed.unwrap_err().to_string(), DATA_ERROR);
        assert_eq!(attempts, 1, "B retried after A's out-of-memory");
    });
}

#[test]
fn an_attempts_own_panic_after_another_threads_out_of_memory_comes_back_printed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    count_printed_panics();
    let printed = PRINTED.load(Ordering::SeqCst);
    let mut attempts = 0;
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        BatchSizeSearch::new(64).call(|_| {
            attempts += 1;
            unrelated_thread_dies_of_out_of_memory();
            device_thread_runs_out();
            let rows: Vec<u8> = Vec::new();
            let index = rows.len() + 3;
            rows[index]
        })
    }));
    let payload = unwound.expect_err("the attempt's own panic resumes unwinding");
    let message = payload.downcast_ref::<String>().unwrap();
    assert!(message.contains("index out of bounds"), "{message}");
    assert_eq!(attempts, 1);
    // The dying thread and the attempt's own panic reached the hook; the device thread's
    // caught panic did not.
    assert_eq!(PRINTED.load(Ordering::SeqCst), printed + 2);
}
