//! `ChildTrial` at its edges: a child never starts children of its own for a trial;
//! what the parent reports holds whatever the child did at exit, on a side thread or when it
//! was killed; the child's files and processes never outlive the trial. Each child is this test
//! binary, running the ignored `child_entry` (or `chain_entry`) test.

#![cfg(unix)] // signals, process groups, `kill(1)` and `sh`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::{Path, PathBuf};
use std::time::Duration;

use batch_size_runtime::{
    last_report, step_done, BatchSizeSearch, ChildTrial, ChildTrialError, Outcome,
};

/// The arguments of this file's children.
const CHILD: [&str; 3] = ["--exact", "child_entry", "--ignored"];

/// How many processes deep a chain of children may go before a test stops it itself: on a
/// source that lets a child start children, the chain would otherwise never end.
const DEPTH: &str = "CHILD_TRIAL_TRUST_DEPTH";
const MAX_DEPTH: u32 = 3;

fn trial(name: &str) -> ChildTrial {
    ChildTrial::new(name).with_args(CHILD)
}

/// Sends `signal` to this process with `kill(1)` and waits for it to land.
fn kill_this_process(signal: &str) -> ! {
    let _ = std::process::Command::new("kill")
        .args([format!("-{signal}"), std::process::id().to_string()])
        .status();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A thread that panics on its data, joined: the step goes on.
fn side_thread_panics() {
    let joined = std::thread::spawn(|| panic!("corrupt record 3 on a side thread")).join();
    assert!(joined.is_err());
}

/// How `spawns_a_thread`'s steps report a thread that could not start.
#[derive(Clone, Copy)]
enum Spawn {
    /// `std::thread::Builder::spawn`'s `io::Error`, through `?`.
    Returned,
    /// A message that says so, as a step that formats its errors returns it.
    Message,
    /// `std::thread::spawn`'s panic.
    Panics,
}

/// The files a child and its test exchange: "in the step" and "go on".
fn signal_files(parent: u32, batch_size: usize) -> (PathBuf, PathBuf) {
    let base = std::env::temp_dir().join(format!("child-trial-trust-{parent}-{batch_size}"));
    (base.with_extension("ready"), base.with_extension("go"))
}

/// Waits (at most a minute) for `path` to exist.
fn wait_for(path: &Path) {
    for _ in 0..600 {
        if path.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{} never appeared", path.display());
}

/// The names at which trials of this process kept their files in the shared temporary folder
/// before they had a private folder of their own, as another process of the same id (in another
/// PID namespace sharing `/tmp`) would reach them.
fn shared_names() -> Vec<PathBuf> {
    let pid = std::process::id();
    (0..200)
        .map(|trial| std::env::temp_dir().join(format!("batch-size-child-{pid}-{trial}.report")))
        .collect()
}

/// One level deeper in a chain of children; `false` where the chain is already too deep.
fn deeper() -> bool {
    let depth: u32 = std::env::var(DEPTH)
        .ok()
        .and_then(|depth| depth.parse().ok())
        .unwrap_or(0);
    // SAFETY: only this test's process runs here (one test, `--exact`): no other thread reads
    // the environment.
    unsafe { std::env::set_var(DEPTH, (depth + 1).to_string()) };
    depth < MAX_DEPTH
}

/// Every trial of this file, in the child.
#[test]
#[ignore = "the child of this file's tests: run by them with --ignored"]
fn child_entry() {
    // Its step runs its own trial again: a child of a child of the same trial.
    trial("runs_itself").serve(|batch_size| -> Result<(), String> {
        if !deeper() {
            return Err("a grandchild ran: the chain of children did not stop".to_owned());
        }
        match trial("runs_itself").run(batch_size) {
            Err(error @ ChildTrialError::StartedInAChild { .. }) => Err(error.to_string()),
            other => Err(format!("the step's own run started a child: {other:?}")),
        }
    });
    // Fits up to 16; above, the process is killed (SIGKILL, as the kernel's out-of-memory
    // killer does) before the step can say anything.
    trial("killed_above_16").serve(|batch_size| -> Result<(), String> {
        if batch_size > 16 {
            kill_this_process("KILL");
        }
        Ok(())
    });
    // Fits, then a library's teardown panics at exit (an `atexit` handler: the panic cannot
    // unwind out of it, and the process aborts after the panic hook ran).
    trial("panics_at_exit").serve(|_| -> Result<(), String> {
        extern "C" fn teardown() {
            panic!("a library's teardown failed");
        }
        unsafe extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        // SAFETY: `teardown` is an `extern "C" fn()` that lives as long as the program.
        unsafe { atexit(teardown) };
        Ok(())
    });
    // A side thread panics on its data and the step carries on (the thread's death is caught
    // by `join`); then the process is killed, or aborts, as a failed allocation ends it.
    trial("side_panic_then_killed").serve(|_| -> Result<(), String> {
        side_thread_panics();
        kill_this_process("KILL");
    });
    trial("side_panic_then_aborts").serve(|_| -> Result<(), String> {
        side_thread_panics();
        std::process::abort();
    });
    // A panic that cannot unwind (out of an `extern "C"` function) aborts the process: the
    // panic, not a failed allocation, ended it.
    trial("panic_aborts").serve(|_| -> Result<(), String> {
        extern "C" fn parse() {
            panic!("corrupt record 9");
        }
        parse();
        Ok(())
    });
    // Says it is in the step, waits for the parent's word, then is killed (SIGKILL).
    trial("killed_when_told").serve(|batch_size| -> Result<(), String> {
        let (ready, go) = signal_files(std::os::unix::process::parent_id(), batch_size);
        std::fs::write(ready, "in the step").map_err(|error| error.to_string())?;
        for _ in 0..600 {
            if go.exists() {
                kill_this_process("KILL");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("the parent never said go".to_owned())
    });
    // Starts a helper that says when it got SIGTERM, then runs past any deadline.
    trial("hangs_with_a_helper").serve(|batch_size| -> Result<(), String> {
        let (ready, terminated) = signal_files(std::os::unix::process::parent_id(), batch_size);
        std::process::Command::new("sh")
            .args([
                "-c",
                r#"trap 'echo term > "$1"; exit 0' TERM; sleep 120 & touch "$0"; wait"#,
            ])
            .arg(&ready)
            .arg(&terminated)
            .spawn()
            .map_err(|error| error.to_string())?;
        wait_for(&ready);
        std::thread::sleep(Duration::from_secs(120));
        Ok(())
    });
    // Allocates 1 MiB a sample, touched, under the room `with_memory_limit` gives it; one
    // trial with `RUST_BACKTRACE=1`, as a program run with it has, the other with `0`.
    // SAFETY (both): only this test's process runs here, in a child: no other thread reads
    // the environment.
    if ChildTrial::new("allocates_with_backtraces").is_child() {
        unsafe { std::env::set_var("RUST_BACKTRACE", "1") };
    }
    if ChildTrial::new("allocates").is_child() {
        unsafe { std::env::set_var("RUST_BACKTRACE", "0") };
    }
    for name in ["allocates", "allocates_with_backtraces"] {
        trial(name).serve(|batch_size| -> Result<(), String> {
            let samples = vec![1u8; batch_size << 20];
            let read: usize = samples
                .iter()
                .step_by(4096)
                .map(|&byte| usize::from(byte))
                .sum();
            if read == 0 {
                return Err("the step read nothing".to_owned());
            }
            Ok(())
        });
    }
    // Says its process id, then runs past any deadline.
    trial("says_its_pid_and_hangs").serve(|batch_size| -> Result<(), String> {
        let (ready, _) = signal_files(std::os::unix::process::parent_id(), batch_size);
        std::fs::write(ready, std::process::id().to_string()).map_err(|error| error.to_string())?;
        std::thread::sleep(Duration::from_secs(120));
        Ok(())
    });
    // Writes 32 MiB, touched: past a room smaller than that, it cannot fit.
    trial("writes_32_mib").serve(|_| -> Result<(), String> {
        let written = vec![1u8; 32 << 20];
        let read: usize = written.iter().step_by(4096).map(|&b| usize::from(b)).sum();
        if read == 0 {
            return Err("the step read nothing".to_owned());
        }
        Ok(())
    });
    // 1 MiB a sample, touched, then a thread for the rest of the step (its 8 MiB stack is
    // address space too): at a size that leaves room for the data but not for the stack,
    // the thread cannot start. Returned as `std::thread::Builder::spawn` returns it (an
    // `io::Error`), as a message (a `String` that says so), or as `std::thread::spawn`'s panic.
    for (name, how) in [
        ("spawns_a_thread", Spawn::Returned),
        ("spawns_a_thread_says_so", Spawn::Message),
        ("spawns_a_thread_panics", Spawn::Panics),
    ] {
        trial(name).serve(
            |batch_size| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                let samples = vec![1u8; batch_size << 20];
                let work = move || {
                    samples
                        .iter()
                        .step_by(4096)
                        .map(|&b| usize::from(b))
                        .sum::<usize>()
                };
                let builder = std::thread::Builder::new().stack_size(8 << 20);
                let read = match how {
                    Spawn::Returned => builder.spawn(work)?.join(),
                    Spawn::Message => builder
                        .spawn(work)
                        .map_err(|error| format!("failed to spawn thread: {error}"))?
                        .join(),
                    Spawn::Panics => std::thread::spawn(work).join(),
                };
                match read {
                    Ok(0) | Err(_) => Err("the step read nothing".into()),
                    Ok(_) => Ok(()),
                }
            },
        );
    }
    // A step's own `io::Error`s, which are not the limit's: one that says what went wrong, and
    // a non-blocking read's `WouldBlock` (EAGAIN) where no limit was asked for.
    trial("own_io_error").serve(|_| -> Result<(), std::io::Error> {
        Err(std::io::Error::other("corrupt record 17 in shard 3"))
    });
    trial("own_eagain")
        .serve(|_| -> Result<(), std::io::Error> { Err(std::io::Error::from_raw_os_error(11)) });
    // Fits.
    trial("fits").serve(|_| -> Result<(), String> { Ok(()) });
    panic!("run only as a ChildTrial's child: the parent sets the trial and the size");
}

/// A parent that runs a trial whose child hangs: the test kills it outright.
#[test]
#[ignore = "the parent that a_child_ends_with_its_parent kills: run by it with --ignored"]
fn parent_entry() {
    let outcome = trial("says_its_pid_and_hangs").run(4203);
    panic!("the child of a killed parent returned: {outcome:?}");
}

/// A test the child of `chain` runs instead of serving: it runs the trial itself, as a test
/// that sizes a step does, and its child would do the same.
#[test]
#[ignore = "the child of a_child_that_never_served_starts_no_child: run by it with --ignored"]
fn chain_entry() {
    if !deeper() {
        std::process::exit(77);
    }
    let outcome = ChildTrial::new("chain")
        .with_args(["--exact", "chain_entry", "--ignored"])
        .run(8);
    panic!("the child ran a trial of its own: {outcome:?}");
}

/// 1: a child whose arguments never reach `serve` (a test that runs the trial itself) stops at
/// its first `run`, and the parent's error says so, with the arguments; no grandchild starts.
#[test]
fn a_child_that_never_served_starts_no_child() {
    let trial = ChildTrial::new("chain").with_args(["--exact", "chain_entry", "--ignored"]);
    let error = trial.run(8).unwrap_err();
    let ChildTrialError::NotStarted {
        ran_before_serving, ..
    } = &error
    else {
        panic!("not a trial that never started: {error:?}");
    };
    assert_eq!(ran_before_serving.as_deref(), Some("chain"), "{error}");
    let text = error.to_string();
    assert!(
        text.contains("chain_entry") && text.contains("reached ChildTrial::run"),
        "{text}"
    );
}

/// 1: a child serving a trial whose step runs the same trial gets an error, not a grandchild.
#[test]
fn a_childs_step_that_runs_its_own_trial_starts_no_child() {
    let error = trial("runs_itself").run(8).unwrap_err();
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("not the child's own failure: {error:?}");
    };
    assert!(
        message.contains("would start a child of its own"),
        "{message}"
    );
}

/// 2: any deadline works, the longest one an `Instant` cannot hold included.
#[test]
fn the_longest_deadline_is_no_deadline() {
    for deadline in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        let trial = trial("fits").with_deadline(deadline);
        assert_eq!(trial.run(8).unwrap(), 8);
    }
}

/// 3: a child killed before it left figures has none: `memory()` does not give the last
/// child's as its own.
#[cfg(target_os = "linux")]
#[test]
fn a_killed_child_that_left_no_figures_has_none() {
    let trial = trial("killed_above_16");
    let memory = trial.memory();
    assert_eq!(trial.run(8).unwrap(), 8);
    // The fit left figures (otherwise this test would prove nothing).
    let after_fit = memory.memory_backend().memory();
    assert_eq!(after_fit.devices.len(), 1, "{after_fit:?}");

    let error = trial.run(64).unwrap_err();
    assert!(
        matches!(error, ChildTrialError::Died { .. }),
        "not a kill: {error:?}"
    );
    let after_kill = memory.memory_backend().memory();
    assert!(
        after_kill.devices.is_empty(),
        "the fit's figures read as the killed child's: {after_kill:?}"
    );
}

/// 4: a trial that returned `Ok` is a fit, whatever the process does at exit (a panic in a
/// library's teardown, after the panic hook saw it).
#[cfg(unix)]
#[test]
fn a_fit_stays_a_fit_whatever_happens_at_exit() {
    assert_eq!(trial("panics_at_exit").run(8).unwrap(), 8);
}

/// 5: a kill or an abort after the step started is out of memory, whatever a side thread's
/// caught panic said before.
#[test]
fn a_signal_after_a_side_threads_caught_panic_is_out_of_memory() {
    for name in ["side_panic_then_killed", "side_panic_then_aborts"] {
        let error = trial(name).run(8).unwrap_err();
        assert!(
            matches!(error, ChildTrialError::Died { batch_size: 8, .. }),
            "{name}: not out of memory: {error:?}"
        );
    }
}

/// 5: a panic that aborted the process is that panic's failure, not out of memory.
#[test]
fn a_panic_that_aborts_is_a_failure() {
    let error = trial("panic_aborts").run(8).unwrap_err();
    assert!(
        matches!(error, ChildTrialError::Failed { batch_size: 8, .. }),
        "{error:?}"
    );
}

/// 6: a child that started its step is never "not started", whatever another process does to
/// the shared temporary folder meanwhile (here: removes the files at the names this process's
/// trials once used, as a second run of the program with the same process id in another PID
/// namespace did at its start); it was killed in the step, so it ran out of memory.
#[cfg(target_os = "linux")]
#[test]
fn a_killed_childs_start_is_read_whatever_others_do_to_the_temporary_folder() {
    let batch_size = 4201;
    let (ready, go) = signal_files(std::process::id(), batch_size);
    let outcome = std::thread::scope(|scope| {
        let running = scope.spawn(|| trial("killed_when_told").run(batch_size));
        wait_for(&ready);
        for path in shared_names() {
            let _ = std::fs::remove_file(&path);
        }
        std::fs::write(&go, "go").unwrap();
        running.join().unwrap()
    });
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&go);
    let error = outcome.unwrap_err();
    assert!(
        matches!(error, ChildTrialError::Died { .. }),
        "a child killed in its step is not out of memory: {error:?}"
    );
}

/// 7: a symlink another user planted where a trial's files could go is never followed: the
/// file it points to stays as it was.
#[cfg(unix)]
#[test]
fn a_planted_symlink_is_never_followed() {
    let victim =
        std::env::temp_dir().join(format!("child-trial-trust-{}-victim", std::process::id()));
    std::fs::write(&victim, "precious").unwrap();
    let planted: Vec<PathBuf> = shared_names()
        .into_iter()
        .flat_map(|report| {
            let mut partial = report.into_os_string();
            partial.push(".0.partial");
            let partial = PathBuf::from(partial);
            let mut abort = partial.clone().into_os_string();
            abort.push(".abort");
            [partial, PathBuf::from(abort)]
        })
        .filter(|path| std::os::unix::fs::symlink(&victim, path).is_ok())
        .collect();
    let outcome = trial("fits").run(8);
    for path in &planted {
        let _ = std::fs::remove_file(path);
    }
    let left = std::fs::read_to_string(&victim).unwrap();
    let _ = std::fs::remove_file(&victim);
    assert_eq!(left, "precious");
    assert_eq!(outcome.unwrap(), 8);
}

/// 7: a deadline ends the child's whole process group, SIGTERM first: the helper the step
/// started hears it (and would otherwise outlive the trial).
#[cfg(unix)]
#[test]
fn a_deadline_ends_the_childs_group_with_sigterm_first() {
    let batch_size = 4202;
    let (ready, terminated) = signal_files(std::process::id(), batch_size);
    // Long enough for the child to start its helper on a loaded machine: the helper must have
    // set its trap before the deadline.
    let trial = trial("hangs_with_a_helper").with_deadline(Duration::from_secs(5));
    let error = trial.run(batch_size).unwrap_err();
    assert!(
        matches!(error, ChildTrialError::DeadlinePassed { .. }),
        "{error:?}"
    );
    wait_for(&terminated);
    let said = std::fs::read_to_string(&terminated).unwrap();
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&terminated);
    assert_eq!(said.trim(), "term");
}

/// 8: `with_memory_limit` gives the step its room in the child, with no `unsafe` or shell: a
/// size past it aborts there and comes back as out of memory, with the figures against that
/// room; the same room whether `RUST_BACKTRACE` is set or not.
#[cfg(target_os = "linux")]
#[test]
fn a_memory_limit_gives_the_step_its_room_whatever_rust_backtrace_says() {
    const ROOM: u64 = 64 << 20;
    for name in ["allocates", "allocates_with_backtraces"] {
        let trial = trial(name).with_memory_limit(ROOM);
        assert_eq!(trial.run(40).unwrap(), 40, "{name}");
        let error = trial.run(96).unwrap_err();
        let ChildTrialError::Died { out_of_memory, .. } = &error else {
            panic!("{name}: not an abort: {error:?}");
        };
        assert_eq!(out_of_memory.total, Some(ROOM), "{name}: {out_of_memory:?}");
        assert_eq!(out_of_memory.requested, Some(96 << 20), "{name}");
        let fitted = BatchSizeSearch::new(256)
            .with_release(trial.memory())
            .run(|batch_size| trial.run(batch_size))
            .unwrap();
        // Halving's ladder stops at 32 (256, 128, 64 fail); the figures land nearer 64.
        assert!(fitted > 32 && fitted < 64, "{name}: {fitted}");
        println!("{name}: room {ROOM} bytes, the search found {fitted}");
    }
}

/// 7: a parent killed outright (no `Drop` runs) does not leave its child running: on Linux the
/// kernel ends it.
#[cfg(target_os = "linux")]
#[test]
fn a_child_ends_with_its_parent() {
    let mut parent = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "parent_entry", "--ignored"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (ready, _) = signal_files(parent.id(), 4203);
    wait_for(&ready);
    let child = std::fs::read_to_string(&ready).unwrap();
    let _ = std::fs::remove_file(&ready);
    parent.kill().unwrap();
    parent.wait().unwrap();
    // A parent killed outright leaves its trial's folder: this test removes it.
    let prefix = format!("batch-size-child-{}-", parent.id());
    for entry in std::fs::read_dir(std::env::temp_dir()).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    for _ in 0..300 {
        let gone = std::fs::read_to_string(format!("/proc/{child}/stat")).map_or(true, |stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        });
        if gone {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the child {child} outlived its killed parent");
}

/// 1: the child itself says why it stops, on its stderr, naming its arguments, even under a
/// test harness that captures what tests print (it exits before the harness would show it).
/// Started here by hand, as a trial's `run` starts it (the variables are the crate's own).
#[test]
fn a_child_that_never_served_says_why_on_its_stderr() {
    let folder =
        std::env::temp_dir().join(format!("child-trial-trust-{}-by-hand", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "chain_entry", "--ignored"])
        .env("BATCH_SIZE_CHILD_TRIAL", "chain=8")
        .env("BATCH_SIZE_CHILD_FOLDER", &folder)
        // One level from the bottom: a source that chains starts one grandchild, no more.
        .env(DEPTH, (MAX_DEPTH - 1).to_string())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&folder);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("child of ChildTrial `chain`, started with --exact chain_entry --ignored"),
        "{stderr}"
    );
}

/// A limit the crate sets on the child: a thread (or a mapping) the step cannot get under it is
/// out of memory, retried smaller, however the step reports it; without the limit, or for the
/// step's own error, the error comes back unchanged.
#[cfg(target_os = "linux")]
#[test]
fn a_thread_that_cannot_start_under_the_limit_is_out_of_memory() {
    const ROOM: u64 = 256 << 20;
    for name in [
        "spawns_a_thread",
        "spawns_a_thread_says_so",
        "spawns_a_thread_panics",
    ] {
        let trial = trial(name).with_memory_limit(ROOM);
        assert_eq!(trial.run(100).unwrap(), 100, "{name}");
        // 255 MiB of data leave 1 MiB: room for the data, none for a stack (8 MiB, or
        // `std::thread::spawn`'s 2 MiB).
        let error = trial.run(255).unwrap_err();
        assert!(
            matches!(
                error,
                ChildTrialError::OutOfMemory {
                    batch_size: 255,
                    ..
                }
            ),
            "{name}: not out of memory: {error:?}"
        );
        let fitted = BatchSizeSearch::new(255)
            .with_release(trial.memory())
            .run(|batch_size| trial.run(batch_size))
            .unwrap();
        assert!((100..255).contains(&fitted), "{name}: {fitted}");
    }
}

/// Only the limit's refusals are out of memory: the step's own error, under the limit or not,
/// and an EAGAIN where no limit was asked for, come back as the step's failure, unchanged.
#[cfg(target_os = "linux")]
#[test]
fn the_steps_own_errors_stay_its_own_under_the_limit() {
    let error = trial("own_io_error")
        .with_memory_limit(256 << 20)
        .run(8)
        .unwrap_err();
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("the step's own error became {error:?}");
    };
    assert_eq!(message, "corrupt record 17 in shard 3");
    let error = trial("own_eagain").run(8).unwrap_err();
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("an EAGAIN without a limit became {error:?}");
    };
    assert_eq!(message, &std::io::Error::from_raw_os_error(11).to_string());
}

/// A room too small for any step is never a fit: 32 MiB written in a room of 0, 1 or 4096
/// bytes is an error that names the room asked for and what the child had mapped, not a size.
#[cfg(target_os = "linux")]
#[test]
fn a_room_too_small_for_any_step_is_an_error_not_a_fit() {
    for room in [0, 1, 4096] {
        let outcome = trial("writes_32_mib").with_memory_limit(room).run(32);
        let error = match outcome {
            Ok(fitted) => panic!("a room of {room} bytes fit {fitted}"),
            Err(error) => error,
        };
        let text = error.to_string();
        assert!(
            matches!(error, ChildTrialError::Failed { .. })
                && text.contains(&format!("{room} bytes")),
            "{room}: {text}"
        );
    }
}

/// A function that returns `ChildTrialError` takes the search's `Grow` through `?` after the
/// child's step, and the search finds it there: the attempt grows from the child's figures,
/// and the caller gets a size, never the `Grow`.
#[cfg(target_os = "linux")]
#[test]
fn a_grow_goes_through_child_trial_error_to_the_search() {
    let trial = trial("allocates").with_memory_limit(64 << 20);
    let fitted = BatchSizeSearch::new(8).with_release(trial.memory()).run(
        |batch_size| -> Result<usize, ChildTrialError> {
            let ran = trial.run(batch_size)?;
            step_done()?;
            Ok(ran)
        },
    );
    let report = last_report().unwrap();
    let fitted = fitted.unwrap_or_else(|error| panic!("{error}: {report}"));
    assert!(
        report
            .attempts()
            .any(|attempt| matches!(attempt.outcome, Outcome::Grew { .. })),
        "{report}"
    );
    assert!(fitted > 8 && fitted < 64, "{fitted}: {report}");
}

/// The resident budget of `with_resident_limit`'s tests: far below what the machine has, far
/// above what a child of this binary holds at its start.
#[cfg(target_os = "linux")]
const RESIDENT_BUDGET: u64 = 256 << 20;

/// `with_resident_limit` sizes by what a step writes: 1 MiB a sample, touched, fits at 64 with
/// its peak against the budget; at 512 it is stopped as out of memory, the budget as the total;
/// a search lands under the budget and each failure on the way is out of memory; with
/// `step_done()` after the child's step, the peak at the size that ran grows it toward the
/// budget.
#[cfg(target_os = "linux")]
#[test]
fn a_resident_budget_sizes_the_step_by_what_it_writes() {
    let trial = trial("allocates").with_resident_limit(RESIDENT_BUDGET);
    assert_eq!(trial.run(64).unwrap(), 64);
    let figures = trial.memory();
    let snapshot = figures.memory_backend().memory();
    let cpu = &snapshot.devices[0];
    // The room: the budget less what the child held as its step started (the program's own).
    let room = cpu.total;
    assert!(
        room < RESIDENT_BUDGET && room > RESIDENT_BUDGET / 2,
        "{cpu:?}"
    );
    // 64 MiB written, give or take the program's own pages between its start and the step.
    let peak = cpu.peak.unwrap();
    assert!(
        (60 << 20..=room).contains(&peak),
        "the peak of 64 MiB written: {cpu:?}"
    );

    let error = trial.run(512).unwrap_err();
    let ChildTrialError::OutOfMemory {
        batch_size: 512,
        figures,
        message,
    } = &error
    else {
        panic!("512 MiB written in a budget of 256 MiB: {error:?}");
    };
    // Another child's room: its start differs by a few pages, its room by a MiB at most.
    let total = figures.total.unwrap();
    assert!(
        total.abs_diff(room) <= 1 << 20,
        "{figures:?} against {room}"
    );
    assert_eq!(figures.free, Some(0), "{figures:?}");
    assert_eq!(figures.requested, None, "{figures:?}");
    assert!(message.contains("with_resident_limit"), "{message}");

    let fitted = BatchSizeSearch::new(1024)
        .with_release(trial.memory())
        .run(|batch_size| trial.run(batch_size));
    let report = last_report().unwrap();
    let fitted = fitted.unwrap_or_else(|error| panic!("{error}: {report}"));
    // Halving's ladder (1024, 512, 256 fail) reaches 128; 256 MiB written cannot fit with the
    // program's own pages beside it.
    assert!((128..256).contains(&fitted), "{fitted}: {report}");
    for attempt in report.attempts() {
        assert!(
            matches!(
                attempt.outcome,
                Outcome::Succeeded | Outcome::OutOfMemory { .. }
            ),
            "{report}"
        );
    }
    println!(
        "resident budget {RESIDENT_BUDGET} bytes, 1 MiB a sample: the search found {fitted} in \
         {} attempts, {} out of memory",
        report.attempts().count(),
        report.out_of_memory_count()
    );

    let grown = BatchSizeSearch::new(1024).with_release(trial.memory()).run(
        |batch_size| -> Result<usize, ChildTrialError> {
            let ran = trial.run(batch_size)?;
            step_done()?;
            Ok(ran)
        },
    );
    let report = last_report().unwrap();
    let grown = grown.unwrap_or_else(|error| panic!("{error}: {report}"));
    assert!((128..256).contains(&grown), "{grown}: {report}");
    for attempt in report.attempts() {
        assert!(
            !matches!(attempt.outcome, Outcome::Failed { .. } | Outcome::Panicked),
            "{report}"
        );
    }
    println!(
        "with step_done(): {grown} in {} attempts, {} out of memory\n{report}",
        report.attempts().count(),
        report.out_of_memory_count()
    );
}

/// Under a resident budget the step's own errors stay its own: its `io::Error`, and an EAGAIN
/// (only the address-space limit reads refusals as out of memory).
#[cfg(target_os = "linux")]
#[test]
fn the_steps_own_errors_stay_its_own_under_a_resident_budget() {
    for (name, expected) in [
        ("own_io_error", "corrupt record 17 in shard 3".to_owned()),
        (
            "own_eagain",
            std::io::Error::from_raw_os_error(11).to_string(),
        ),
    ] {
        let error = trial(name)
            .with_resident_limit(RESIDENT_BUDGET)
            .run(8)
            .unwrap_err();
        let ChildTrialError::Failed { message, .. } = &error else {
            panic!("{name}: the step's own error became {error:?}");
        };
        assert_eq!(message, &expected, "{name}");
    }
}

/// A resident budget no larger than what the child holds as the step starts is never a fit:
/// 0, 4096 bytes or 1 MiB is an error that names the budget asked for, not a size, and the step
/// does not run.
#[cfg(target_os = "linux")]
#[test]
fn a_resident_budget_below_the_childs_start_is_an_error_not_a_fit() {
    for budget in [0, 4096, 1 << 20] {
        let outcome = trial("fits").with_resident_limit(budget).run(32);
        let error = match outcome {
            Ok(fitted) => panic!("a resident budget of {budget} bytes fit {fitted}"),
            Err(error) => error,
        };
        let text = error.to_string();
        assert!(
            matches!(error, ChildTrialError::Failed { .. })
                && text.contains(&format!("resident budget of {budget} bytes")),
            "{budget}: {text}"
        );
    }
}

/// Under a resident budget a child killed before it reported (as the kernel's out-of-memory
/// killer ends one whose allocation outran the watcher) is out of memory, as without one, with
/// no figures; an abort leaves its figures in the budget's frame (the room: the budget less
/// what the program held before its step).
#[cfg(target_os = "linux")]
#[test]
fn a_signal_under_a_resident_budget_is_out_of_memory_in_its_frame() {
    let error = trial("killed_above_16")
        .with_resident_limit(RESIDENT_BUDGET)
        .run(32)
        .unwrap_err();
    let ChildTrialError::Died { out_of_memory, .. } = &error else {
        panic!("a kill under a resident budget became {error:?}");
    };
    assert_eq!(out_of_memory.total, None, "{out_of_memory:?}");
    let error = trial("side_panic_then_aborts")
        .with_resident_limit(RESIDENT_BUDGET)
        .run(8)
        .unwrap_err();
    let ChildTrialError::Died { out_of_memory, .. } = &error else {
        panic!("an abort under a resident budget became {error:?}");
    };
    // Below the budget (the start taken off it; with RUST_BACKTRACE set, the start holds the
    // debug information `serve` reads first), not the machine's memory.
    let room = out_of_memory.total.unwrap();
    assert!(room > 0 && room < RESIDENT_BUDGET, "{out_of_memory:?}");
    assert!(out_of_memory.free.unwrap() > room / 2, "{out_of_memory:?}");
}
