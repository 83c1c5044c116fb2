//! Sharing the communicator's Id through a file, with ranks as threads and as processes (this
//! test binary run again as a child): timeouts, files that are not an Id, ranks outside the job,
//! and a file its owner alone may read. Every wait is bounded: a test fails rather than hangs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{ExchangeError, IdExchange};

use crate::exact_name;
use exact_name::exact_name;

fn id(seed: u8) -> [u8; 128] {
    std::array::from_fn(|index| seed.wrapping_add(index as u8))
}

/// The file format: lowercase hex, two digits a byte.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn temporary(name: &str) -> PathBuf {
    let folder = std::env::temp_dir().join(format!(
        "exchange-{name}-{}-{:?}",
        std::process::id(),
        thread::current().id()
    ));
    std::fs::create_dir_all(&folder).unwrap();
    folder.join("nccl-id")
}

/// Runs four ranks, rank 0 last; every rank must get rank 0's bytes, created once.
fn four_ranks(make: impl Fn(usize) -> IdExchange) {
    let created = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for rank in [1, 2, 3, 0] {
        let exchange = make(rank).with_timeout(Duration::from_secs(5));
        let created = Arc::clone(&created);
        if rank == 0 {
            thread::sleep(Duration::from_millis(100)); // the others are already waiting
        }
        handles.push(thread::spawn(move || {
            exchange.exchange(|| {
                created.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(id(42))
            })
        }));
    }
    for handle in handles {
        assert_eq!(handle.join().unwrap().unwrap(), id(42));
    }
    assert_eq!(created.load(Ordering::SeqCst), 1);
}

#[test]
fn four_ranks_share_the_id_through_a_file() {
    let path = temporary("file");
    four_ranks(|rank| IdExchange::file(&path, rank, 4));
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        format!("{}\n", hex(&id(42))),
        "lowercase hex, one line"
    );
    let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
    assert_eq!(leftovers, 1, "the temporary file was renamed into place");
}

#[test]
fn one_rank_creates_the_id_and_writes_nothing() {
    let path = temporary("single");
    let created = AtomicUsize::new(0);
    let got = IdExchange::file(&path, 0, 1)
        .exchange(|| {
            created.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(id(1))
        })
        .unwrap();
    assert_eq!(got, id(1));
    assert_eq!(created.load(Ordering::SeqCst), 1);
    assert!(!path.exists());
    assert_eq!(
        std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
        0
    );
}

#[test]
fn a_rank_without_rank_0_times_out_through_a_file() {
    let path = temporary("alone");
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let error = IdExchange::file(&path, 1, 2)
        .with_timeout(timeout)
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(1),
        "{waited:?}"
    );
    assert!(
        matches!(error, ExchangeError::Timeout { rank: 1, waited, .. } if waited == timeout),
        "{error}"
    );
    let message = error.to_string();
    assert!(message.contains("is rank 0 running"), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");
}

#[test]
fn a_file_that_is_not_an_id_is_an_error_at_once() {
    let path = temporary("malformed");
    // Too short; then the right length with a sign where a digit should be.
    for text in ["not an id\n".to_owned(), format!("{}\n", "+f".repeat(128))] {
        std::fs::write(&path, &text).unwrap();
        let started = Instant::now();
        let error = IdExchange::file(&path, 1, 2)
            .with_timeout(Duration::from_secs(5))
            .exchange(|| Ok::<_, std::io::Error>(id(0)))
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1), "{text:?}");
        assert!(
            matches!(&error, ExchangeError::Malformed { from, .. } if *from == path.display().to_string()),
            "{text:?}: {error}"
        );
    }
}

#[test]
fn rank_0_failing_to_create_the_id_keeps_its_error() {
    let error = IdExchange::file(temporary("create"), 0, 2)
        .exchange(|| Err(std::io::Error::other("ncclGetUniqueId failed")))
        .unwrap_err();
    assert!(matches!(error, ExchangeError::Create(_)), "{error}");
    let source = std::error::Error::source(&error).unwrap();
    assert_eq!(source.to_string(), "ncclGetUniqueId failed");
}

#[test]
fn a_rank_outside_the_job_is_an_error_before_create() {
    let error = IdExchange::file(temporary("outside"), 2, 2)
        .exchange(|| -> Result<[u8; 128], std::io::Error> { panic!("create on a bad rank") })
        .unwrap_err();
    assert!(
        matches!(
            error,
            ExchangeError::InvalidRank {
                rank: 2,
                world_size: 2
            }
        ),
        "{error}"
    );
}

// ---------------------------------------------------------------------------------------------
// Ranks as processes: this test binary, run again with a rank in the environment.

/// Set in a child only: the rank it plays. Without it the child test does nothing.
const CHILD_RANK: &str = "EXCHANGE_CHILD_RANK";
/// The file to exchange through.
const CHILD_FILE: &str = "EXCHANGE_CHILD_FILE";
/// Rank 0's Id is `id(seed)`.
const CHILD_SEED: &str = "EXCHANGE_CHILD_SEED";
/// What a child prints before the hex of the Id it got.
const EXCHANGED: &str = "EXCHANGED ";
/// What a child prints when its `create` ran.
const CREATED: &str = "CREATED";

/// A rank as a process: exchanges through `EXCHANGE_CHILD_FILE`; prints the Id.
#[test]
#[ignore = "a child process of the exchange's tests: run by them with --ignored"]
fn child_exchange_rank() {
    let rank = std::env::var(CHILD_RANK).expect("run only as a child, which sets its rank");
    let rank: usize = rank.parse().unwrap();
    let exchange = IdExchange::file(std::env::var(CHILD_FILE).unwrap(), rank, 2);
    assert_eq!((exchange.rank(), exchange.world_size()), (rank, 2));
    let seed: u8 = std::env::var(CHILD_SEED).unwrap().parse().unwrap();
    let got = exchange
        .with_timeout(Duration::from_secs(5))
        .exchange(|| {
            println!("{CREATED}");
            Ok::<_, std::io::Error>(id(seed))
        })
        .unwrap();
    println!("{EXCHANGED}{}", hex(&got));
}

/// Runs this binary's `child_exchange_rank` with `env`; returns its stdout once it succeeded.
fn run_child(env: &[(&str, String)]) -> String {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            &exact_name(module_path!(), "child_exchange_rank"),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            panic!("child {env:?} ran past 30 s");
        }
        thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "child {env:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn two_processes_share_the_id_through_a_file() {
    let path = temporary("processes").display().to_string();
    let seed = (std::process::id() % 251) as u8;
    let children: Vec<_> = [1, 0]
        .into_iter()
        .map(|rank| {
            let env = vec![
                (CHILD_FILE, path.clone()),
                (CHILD_RANK, rank.to_string()),
                (CHILD_SEED, seed.to_string()),
            ];
            if rank == 0 {
                thread::sleep(Duration::from_millis(200)); // rank 1 is already waiting
            }
            (rank, thread::spawn(move || run_child(&env)))
        })
        .collect();
    for (rank, child) in children {
        let stdout = child.join().unwrap();
        let got = stdout
            .lines()
            .find_map(|line| line.split_once(EXCHANGED).map(|(_, hex)| hex.trim()))
            .unwrap_or_else(|| panic!("rank {rank} printed no Id:\n{stdout}"));
        assert_eq!(got, hex(&id(seed)), "rank {rank}");
        assert_eq!(
            stdout.contains(CREATED),
            rank == 0,
            "rank {rank}:\n{stdout}"
        );
    }
}

#[cfg(unix)]
#[test]
fn the_id_file_is_readable_by_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;

    let folder = std::env::temp_dir().join(format!("exchange-mode-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let path = folder.join("nccl-id");
    // An earlier job's file, readable by all, is replaced, not written through.
    std::fs::write(&path, "old").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let reader = IdExchange::file(&path, 1, 2).with_timeout(Duration::from_secs(5));
    let rank_1 = thread::spawn(move || {
        // The old file is malformed: wait for the new one.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match reader.exchange(|| Ok::<_, std::io::Error>(id(0))) {
                Ok(id) => return id,
                Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                Err(error) => panic!("{error}"),
            }
        }
    });
    let got = IdExchange::file(&path, 0, 2)
        .exchange(|| Ok::<_, std::io::Error>(id(5)))
        .unwrap();
    assert_eq!(rank_1.join().unwrap(), got);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    let entries: Vec<_> = std::fs::read_dir(&folder).unwrap().collect();
    assert_eq!(entries.len(), 1, "no temporary file is left");
    std::fs::remove_dir_all(&folder).unwrap();
}
