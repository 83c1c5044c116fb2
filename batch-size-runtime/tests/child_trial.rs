//! `ChildTrial` as users run it: a test harness that captures the child's output, a child that
//! logs, prints an out-of-memory line and fails otherwise, arguments that never reach the
//! trial, a crash after a fit, a helper left running, a worker of the same program, trials at
//! once, a deadline, and an abort whose figures come back. Each child is this test binary,
//! running the ignored `child_entry` (or `child_worker`) test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::time::{Duration, Instant};

use batch_size_runtime::{
    last_report, BatchSizeSearch, ChildTrial, ChildTrialError, Outcome, Release,
};

#[cfg(target_os = "linux")]
#[path = "common/address_space.rs"]
mod address_space;

/// The arguments the docs give for a test binary: no `--nocapture`, so the harness captures
/// what the child prints.
const CAPTURED: [&str; 3] = ["--exact", "child_entry", "--ignored"];

fn trial(name: &str) -> ChildTrial {
    ChildTrial::new(name).with_args(CAPTURED)
}

/// Every trial of this file, in the child. Each `serve` returns at once unless the parent asked
/// for its trial.
#[test]
#[ignore = "the child of this file's tests: run by them with --ignored"]
fn child_entry() {
    // Out of memory above 16, returned as tch returns it.
    trial("returns_oom").serve(|batch_size| -> Result<(), String> {
        if batch_size > 16 {
            return Err("CUDA out of memory. Tried to allocate 2.00 GiB".to_owned());
        }
        Ok(())
    });
    // Logs, then fails on its data.
    trial("logs_then_fails").serve(|_| -> Result<(), String> {
        eprintln!("[INFO] loading shard 3 of 8");
        Err("corrupt record 17 in shard 3".to_owned())
    });
    // Recovered from an out-of-memory and said so, then failed on its data.
    trial("warns_then_fails").serve(|_| -> Result<(), String> {
        println!(
            "WARN batch_size=64 error=CUDA out of memory. Tried to allocate 2.00 GiB: retrying"
        );
        eprintln!("WARN CUDA out of memory, retrying at 32");
        Err("bad value in record 5".to_owned())
    });
    // Fits, then the process crashes in a library's teardown (an `atexit` handler).
    #[cfg(unix)]
    trial("crashes_at_exit").serve(|_| -> Result<(), String> {
        extern "C" fn crash() {
            std::process::abort();
        }
        unsafe extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        // SAFETY: `crash` is an `extern "C" fn()` that lives as long as the program.
        unsafe { atexit(crash) };
        Ok(())
    });
    // Fits, leaving a helper that holds its stdout and stderr for 40 s.
    trial("leaves_a_helper").serve(|_| -> Result<(), String> {
        std::process::Command::new("sleep")
            .arg("40")
            .spawn()
            .map_err(|error| error.to_string())?;
        Ok(())
    });
    // Starts a worker of this same program, whose entry calls `serve` first, as documented.
    trial("starts_a_worker").serve(|_| -> Result<(), String> {
        if std::env::var_os("CHILD_TRIAL_TEST_WORKER").is_some() {
            return Err("the worker ran the trial instead of its own work".to_owned());
        }
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_worker", "--ignored"])
            .env("CHILD_TRIAL_TEST_WORKER", "1")
            .status()
            .map_err(|error| error.to_string())?;
        match status.code() {
            Some(WORKER_DID_ITS_WORK) => Ok(()),
            _ => Err(format!("the worker did not do its own work: {status}")),
        }
    });
    // Fits at its size after a pause: for trials at once.
    trial("sleeps").serve(|batch_size| -> Result<(), String> {
        std::thread::sleep(Duration::from_millis(200));
        if batch_size > 40 {
            return Err("CUDA out of memory. Tried to allocate 2.00 GiB".to_owned());
        }
        Ok(())
    });
    // Panics: out of memory above 16 (as tch's methods do), on its data otherwise.
    trial("panics").serve(|batch_size| -> Result<(), String> {
        if batch_size > 16 {
            panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
        }
        panic!("corrupt record 17\nin shard 3");
    });
    // Runs past any deadline.
    trial("hangs").serve(|_| -> Result<(), String> {
        std::thread::sleep(Duration::from_secs(60));
        Ok(())
    });
    // Allocates 1 MiB a sample under an address-space limit 64 MiB above what it holds: past
    // it, Rust's failed allocation aborts the process.
    #[cfg(target_os = "linux")]
    trial("aborts").serve(|batch_size| -> Result<(), String> {
        address_space::leave_room(ROOM).map_err(|error| error.to_string())?;
        let samples = vec![1u8; batch_size << 20];
        if samples
            .iter()
            .step_by(4096)
            .map(|&byte| usize::from(byte))
            .sum::<usize>()
            == 0
        {
            return Err("the step read nothing".to_owned());
        }
        Ok(())
    });
    panic!("run only as a ChildTrial's child: the parent sets the trial and the size");
}

const WORKER_DID_ITS_WORK: i32 = 42;

#[cfg(target_os = "linux")]
const ROOM: u64 = 64 << 20;

/// A worker of the same program: `serve` first, then its own work.
#[test]
#[ignore = "the worker that the child of trial_started_workers_do_their_own_work starts"]
fn child_worker() {
    trial("starts_a_worker").serve(|_| -> Result<(), String> {
        Err("the worker ran the trial instead of its own work".to_owned())
    });
    std::process::exit(WORKER_DID_ITS_WORK);
}

/// 1: under the documented arguments, without `--nocapture`, a returned out-of-memory comes
/// back as out-of-memory and the search goes on.
#[test]
fn a_returned_out_of_memory_is_retried_under_a_capturing_harness() {
    let trial = trial("returns_oom");
    let fitted = BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size));
    assert_eq!(fitted.unwrap(), 16);
    let report = last_report().unwrap();
    let sizes: Vec<usize> = report
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(sizes, [64, 32, 16]);
    assert_eq!(report.out_of_memory_count(), 2);
}

/// 2: a child that logs before failing comes back with its error, not its log.
#[test]
fn a_childs_error_comes_back_whole_not_its_first_log_line() {
    // With `--nocapture` the log line reaches the child's stderr, where a scrape would read it.
    let trial = ChildTrial::new("logs_then_fails").with_args([
        "--exact",
        "child_entry",
        "--ignored",
        "--nocapture",
    ]);
    let error = trial.run(8).unwrap_err();
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("not the child's own failure: {error}");
    };
    assert_eq!(message, "corrupt record 17 in shard 3");
}

/// 3: out-of-memory words in what a child printed do not make its data error out-of-memory.
#[test]
fn out_of_memory_in_a_childs_output_is_not_its_outcome() {
    let trial = ChildTrial::new("warns_then_fails").with_args([
        "--exact",
        "child_entry",
        "--ignored",
        "--nocapture",
    ]);
    let error = BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size))
        .unwrap_err();
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("not the child's own failure: {error}");
    };
    assert_eq!(message, "bad value in record 5");
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}

/// 4: a child that never started the trial is an error that names its arguments, not a fit.
#[test]
fn a_child_that_never_started_the_trial_is_no_fit() {
    let trial = ChildTrial::new("returns_oom").with_args(["--exact", "child_entyr", "--ignored"]);
    let error = trial.run(64).unwrap_err();
    let ChildTrialError::NotStarted { batch_size, .. } = &error else {
        panic!("not a trial that never started: {error:?}");
    };
    assert_eq!(*batch_size, 64);
    let text = error.to_string();
    assert!(
        text.contains("child_entyr") && text.contains("returns_oom"),
        "{text}"
    );
    // A search returns it after one attempt: it is not out of memory.
    let error = BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size))
        .unwrap_err();
    assert!(
        matches!(error, ChildTrialError::NotStarted { .. }),
        "{error}"
    );
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}

/// 4: a fit that the child reported before it crashed at exit is a fit.
#[cfg(unix)]
#[test]
fn a_fit_before_a_crash_at_exit_is_a_fit() {
    let trial = trial("crashes_at_exit");
    let fitted = BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size));
    assert_eq!(fitted.unwrap(), 64);
}

/// 5: `run` waits for the child, not for a helper it left holding its pipes.
#[test]
fn a_helper_left_running_does_not_hold_the_search() {
    let trial = trial("leaves_a_helper");
    let started = Instant::now();
    assert_eq!(trial.run(8).unwrap(), 8);
    // The helper lives 40 s; a start of this binary takes well under 20 even on a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

/// 6: the processes the child starts are not the trial's child.
#[test]
fn trial_started_workers_do_their_own_work() {
    let trial = trial("starts_a_worker");
    assert_eq!(trial.run(8).unwrap(), 8);
}

/// Trials at once on threads of one process, each reading its own child's report.
#[test]
fn trials_at_once_read_their_own_reports() {
    let trial = trial("sleeps");
    let outcomes: Vec<bool> = std::thread::scope(|scope| {
        let running: Vec<_> = [64, 8, 48, 16]
            .into_iter()
            .map(|batch_size| {
                let trial = &trial;
                scope.spawn(move || trial.run(batch_size))
            })
            .collect();
        running
            .into_iter()
            .map(|thread| thread.join().unwrap().is_ok())
            .collect()
    });
    assert_eq!(outcomes, [false, true, false, true]);
}

/// A deadline ends a trial that runs past it, with a reason of its own.
#[test]
fn a_trial_past_its_deadline_is_killed() {
    let trial = trial("hangs").with_deadline(Duration::from_millis(500));
    let started = Instant::now();
    let error = trial.run(8).unwrap_err();
    assert!(
        matches!(error, ChildTrialError::DeadlinePassed { batch_size: 8, .. }),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// 7: an aborted child's figures (the bytes Rust's abort message says it asked for, what it held
/// in the room it had) come back, and the search reads them as an in-process failure's.
#[cfg(target_os = "linux")]
#[test]
fn an_aborted_childs_figures_guide_the_search() {
    let trial = trial("aborts");
    let error = trial.run(256).unwrap_err();
    let ChildTrialError::Died {
        out_of_memory, how, ..
    } = &error
    else {
        panic!("not an abort: {error}");
    };
    assert!(how.contains("SIGABRT"), "{how}");
    assert_eq!(out_of_memory.requested, Some(256 << 20));
    let room = out_of_memory.total.unwrap();
    assert!((ROOM - (2 << 20)..=ROOM).contains(&room), "{room}");
    assert!(out_of_memory.free.unwrap() < 256 << 20, "{out_of_memory:?}");

    let fitted = BatchSizeSearch::new(256)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size))
        .unwrap();
    let report = last_report().unwrap();
    let first = report.attempts().next().unwrap();
    let Outcome::OutOfMemory { error } = &first.outcome else {
        panic!("{report:?}");
    };
    assert!(error.contains("tried to allocate 256.00 MiB"), "{error}");
    // Halving ends at 32 (256, 128, 64 fail); 64 MiB of room hold about 60 samples.
    assert!(fitted > 32 && fitted < 64, "{fitted}: {report:?}");
}

/// The size the parent asked for is the size the child ran and reported.
#[test]
fn the_size_asked_for_is_the_size_reported() {
    let trial = trial("returns_oom");
    assert_eq!(trial.run(16).unwrap(), 16);
    let error = trial.run(17).unwrap_err();
    assert!(
        matches!(error, ChildTrialError::OutOfMemory { batch_size: 17, .. }),
        "{error}"
    );
}

/// A search whose release is the trial's memory reads each child's figures as an in-process
/// attempt's: the room, what the attempt held at its failure, a fresh child's room before the
/// next one.
#[cfg(target_os = "linux")]
#[test]
fn a_search_reads_the_childrens_memory() {
    let trial = trial("aborts");
    let fitted = BatchSizeSearch::new(256)
        .with_release(trial.memory())
        .run(|batch_size| trial.run(batch_size))
        .unwrap();
    let report = last_report().unwrap();
    let attempts: Vec<_> = report.attempts().collect();
    let first = attempts[0];
    // Nothing ran before the first child: no figures at its start.
    assert!(first.memory_at_start.is_none(), "{report:?}");
    let at_end = &first.memory_at_end.as_ref().unwrap().devices[0];
    assert!(
        (ROOM - (2 << 20)..=ROOM).contains(&at_end.total),
        "{at_end:?}"
    );
    assert_eq!(at_end.pool_reserved, Some(at_end.total - at_end.free));
    // After the release, a fresh child has all the room; the next attempt starts from it.
    let after = &first.memory_after_release.as_ref().unwrap().devices[0];
    assert_eq!(after.free, after.total);
    let second = attempts[1].memory_at_start.as_ref().unwrap();
    assert_eq!(second.devices[0].free, at_end.total);
    assert!(fitted > 32 && fitted < 64, "{fitted}: {report:?}");
}

/// A child's panic comes back whole; an out-of-memory one is retried.
#[test]
fn a_childs_panic_comes_back_whole() {
    let trial = trial("panics");
    let error = BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| trial.run(batch_size))
        .unwrap_err();
    let ChildTrialError::Failed {
        message,
        batch_size,
        ..
    } = &error
    else {
        panic!("not the child's own failure: {error}");
    };
    assert_eq!(message, "corrupt record 17\nin shard 3");
    assert_eq!(*batch_size, 16);
    let sizes: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(sizes, [64, 32, 16]);
}
