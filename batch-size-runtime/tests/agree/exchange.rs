//! Sharing the communicator's Id: through a file and over TCP, with ranks as threads and as
//! processes (this test binary run again as a child), timeouts, peers that are not ranks, and
//! what the launcher's environment must hold. Every wait is bounded: a test fails rather than
//! hangs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{ExchangeError, IdExchange};

use crate::exact_name;
use crate::free_port;
use exact_name::exact_name;
use free_port::free_port;

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
fn four_ranks_share_the_id_over_tcp() {
    let port = free_port();
    four_ranks(|rank| IdExchange::tcp("127.0.0.1", port, rank, 4));
}

#[test]
fn one_rank_creates_the_id_and_opens_nothing() {
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

    // Over TCP, a port another process holds does not matter: nothing listens.
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let got = IdExchange::tcp("127.0.0.1", port, 0, 1)
        .with_timeout(Duration::from_secs(2))
        .exchange(|| Ok::<_, std::io::Error>(id(2)))
        .unwrap();
    assert_eq!(got, id(2));
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
fn a_rank_without_rank_0_times_out_over_tcp() {
    let port = free_port();
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let error = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(timeout)
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(1),
        "{waited:?}"
    );
    assert!(
        matches!(error, ExchangeError::Timeout { rank: 1, .. }),
        "{error}"
    );
    let message = error.to_string();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(message.contains("MASTER_ADDR"), "{message}");
}

#[test]
fn rank_0_without_the_others_times_out_naming_them() {
    let port = free_port();
    let started = Instant::now();
    let error = IdExchange::tcp("127.0.0.1", port, 0, 3)
        .with_timeout(Duration::from_millis(300))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(1300));
    assert!(
        matches!(error, ExchangeError::Timeout { rank: 0, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("ranks 1, 2"), "{error}");
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
fn a_peer_that_answers_something_else_is_an_error_not_a_hang() {
    // Another service on the port (the launcher's own store, say).
    // It answers and keeps the connection open, as a server waiting for more would.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (done, client_done) = std::sync::mpsc::channel::<()>();
    let impostor = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut greeting = [0u8; 12];
        stream.read_exact(&mut greeting).unwrap();
        stream
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .unwrap();
        let _ = client_done.recv_timeout(Duration::from_secs(10));
        greeting
    });
    let started = Instant::now();
    let error = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(Duration::from_secs(5))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    let waited = started.elapsed();
    done.send(()).unwrap();
    let greeting = impostor.join().unwrap();
    assert_eq!(&greeting[..8], b"BSIDXv1\n");
    assert_eq!(greeting[8..], 1u32.to_le_bytes());
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    assert!(
        matches!(&error, ExchangeError::Malformed { from, .. } if *from == format!("127.0.0.1:{port}")),
        "{error}"
    );
    assert!(
        error.to_string().contains("BATCH_SIZE_EXCHANGE_PORT"),
        "{error}"
    );
}

#[test]
fn rank_0_ignores_a_stranger_and_still_serves_the_ranks() {
    let port = free_port();
    let server = thread::spawn(move || {
        IdExchange::tcp("127.0.0.1", port, 0, 2)
            .with_timeout(Duration::from_secs(5))
            .exchange(|| Ok::<_, std::io::Error>(id(9)))
    });
    // A stranger connects first and says something else.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut stranger = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
            Err(error) => panic!("{error}"),
        }
    };
    stranger.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    drop(stranger);
    // One with our greeting but a rank outside the job gets nothing and is not counted.
    let mut outsider = TcpStream::connect(("127.0.0.1", port)).unwrap();
    outsider
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut greeting = b"BSIDXv1\n".to_vec();
    greeting.extend_from_slice(&7u32.to_le_bytes());
    outsider.write_all(&greeting).unwrap();
    let mut answer = Vec::new();
    outsider.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("BSIDXno\n"), "{answer:?}");
    assert!(answer.contains("rank 7 is not one of 1 to 1"), "{answer:?}");
    let got = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(Duration::from_secs(5))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap();
    assert_eq!(got, id(9));
    assert_eq!(server.join().unwrap().unwrap(), id(9));
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

fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |name| {
        pairs
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| (*value).to_owned())
    }
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("MASTER_ADDR", "10.1.2.3"),
    ("MASTER_PORT", "29500"),
    ("TORCHELASTIC_USE_AGENT_STORE", "True"),
];

#[test]
fn the_launchers_environment_gives_rank_world_and_gpu() {
    let exchange = IdExchange::from_vars(vars(TORCHRUN)).unwrap();
    assert_eq!(
        (
            exchange.rank(),
            exchange.world_size(),
            exchange.local_rank()
        ),
        (5, 8, 1)
    );
    // torchrun's agent serves its own store on MASTER_PORT: the next port is used.
    assert_eq!(exchange.to_string(), "tcp 10.1.2.3:29501");
}

#[test]
fn without_torchrun_the_master_port_is_used_and_local_rank_defaults_to_rank() {
    let exchange = IdExchange::from_vars(vars(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap();
    assert_eq!(exchange.local_rank(), 2);
    assert_eq!(exchange.to_string(), "tcp node0:29500");
}

#[test]
fn the_exchange_port_variable_wins() {
    let exchange = IdExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("BATCH_SIZE_EXCHANGE_PORT", "31000"),
    ]))
    .unwrap();
    assert_eq!(exchange.to_string(), "tcp node0:31000");
}

#[test]
fn a_missing_or_bad_variable_is_named() {
    let missing = IdExchange::from_vars(vars(&[("WORLD_SIZE", "2")])).unwrap_err();
    assert!(matches!(
        missing,
        ExchangeError::MissingVariable { name: "RANK", .. }
    ));
    let message = missing.to_string();
    assert!(message.starts_with("RANK is not set"), "{message}");
    assert!(message.contains("torchrun"), "{message}");

    let bad_port = IdExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "http"),
    ]))
    .unwrap_err();
    assert!(
        matches!(&bad_port, ExchangeError::InvalidVariable { name: "MASTER_PORT", value, .. } if value == "http"),
        "{bad_port}"
    );
    assert!(
        bad_port.to_string().contains("MASTER_PORT=\"http\""),
        "{bad_port}"
    );

    let bad_override = IdExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("BATCH_SIZE_EXCHANGE_PORT", "70000"),
    ]))
    .unwrap_err();
    assert!(
        matches!(&bad_override, ExchangeError::InvalidVariable { name: "BATCH_SIZE_EXCHANGE_PORT", value, .. } if value == "70000"),
        "{bad_override}"
    );

    let outside = IdExchange::from_vars(vars(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap_err();
    assert!(matches!(
        outside,
        ExchangeError::InvalidRank {
            rank: 4,
            world_size: 4
        }
    ));
    assert!(
        outside
            .to_string()
            .contains("RANK must be below WORLD_SIZE"),
        "{outside}"
    );

    let nobody = IdExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "0"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap_err();
    assert!(
        matches!(
            nobody,
            ExchangeError::InvalidRank {
                rank: 0,
                world_size: 0
            }
        ),
        "{nobody}"
    );
    // The constructors check it when the exchange runs, before `create`.
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
/// The file to exchange through; without it the child reads the launcher's environment.
const CHILD_FILE: &str = "EXCHANGE_CHILD_FILE";
/// Rank 0's Id is `id(seed)`.
const CHILD_SEED: &str = "EXCHANGE_CHILD_SEED";
/// What a child prints before the hex of the Id it got.
const EXCHANGED: &str = "EXCHANGED ";
/// What a child prints when its `create` ran.
const CREATED: &str = "CREATED";
/// The child's timeout in milliseconds (5 s when absent).
const CHILD_TIMEOUT_MS: &str = "EXCHANGE_CHILD_TIMEOUT_MS";

/// A rank as a process: exchanges through `EXCHANGE_CHILD_FILE`, or over TCP as its
/// environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) says; prints the Id.
#[test]
#[ignore = "a child process of the exchange's tests: run by them with --ignored"]
fn child_exchange_rank() {
    let rank = std::env::var(CHILD_RANK).expect("run only as a child, which sets its rank");
    let rank: usize = rank.parse().unwrap();
    let exchange = match std::env::var(CHILD_FILE) {
        Ok(file) => IdExchange::file(file, rank, 2),
        Err(_) => IdExchange::from_env().unwrap(),
    };
    assert_eq!((exchange.rank(), exchange.world_size()), (rank, 2));
    let seed: u8 = std::env::var(CHILD_SEED).unwrap().parse().unwrap();
    let timeout = std::env::var(CHILD_TIMEOUT_MS).map_or(5000, |ms| ms.parse().unwrap());
    let got = exchange
        .with_timeout(Duration::from_millis(timeout))
        .exchange(|| {
            println!("{CREATED}");
            Ok::<_, std::io::Error>(id(seed))
        })
        .unwrap();
    println!("{EXCHANGED}{}", hex(&got));
}

/// Runs this binary's `child_exchange_rank` with `env`; returns its stdout once it succeeded.
fn run_child(env: &[(&str, String)]) -> String {
    let (succeeded, stdout, stderr) = run_child_to_the_end(env);
    assert!(succeeded, "child {env:?} failed:\n{stdout}\n{stderr}");
    stdout
}

/// Runs this binary's `child_exchange_rank` with `env`: whether it succeeded, its stdout and
/// its stderr.
fn run_child_to_the_end(env: &[(&str, String)]) -> (bool, String, String) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            &exact_name(module_path!(), "child_exchange_rank"),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        // The parent's own launcher must not choose the child's port.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .env_remove("BATCH_SIZE_EXCHANGE_PORT")
        .env_remove("LOCAL_RANK")
        .env_remove("BATCH_SIZE_EXCHANGE_TOKEN")
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
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Two processes, rank 0 started last; both must print rank 0's Id, and only rank 0 creates.
fn two_processes(env: impl Fn(usize) -> Vec<(&'static str, String)>) {
    let seed = (std::process::id() % 251) as u8;
    let children: Vec<_> = [1, 0]
        .into_iter()
        .map(|rank| {
            let mut env = env(rank);
            env.push((CHILD_RANK, rank.to_string()));
            env.push((CHILD_SEED, seed.to_string()));
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

#[test]
fn two_processes_share_the_id_through_a_file() {
    let path = temporary("processes").display().to_string();
    two_processes(|_| vec![(CHILD_FILE, path.clone())]);
}

#[test]
fn two_processes_share_the_id_over_tcp_from_the_launchers_environment() {
    let port = free_port();
    two_processes(|rank| {
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".to_owned()),
            ("MASTER_ADDR", "127.0.0.1".to_owned()),
            ("MASTER_PORT", port.to_string()),
        ]
    });
}

fn launcher(rank: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".to_owned()),
        ("MASTER_ADDR", "127.0.0.1".to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]
}

#[test]
fn two_processes_with_the_same_token_share_the_id_over_tcp() {
    let port = free_port();
    two_processes(|rank| {
        let mut env = launcher(rank, port);
        env.push(("BATCH_SIZE_EXCHANGE_TOKEN", "run 4711".to_owned()));
        env
    });
}

/// A rank as a process with `token` (none: no variable) and a timeout in milliseconds.
fn rank_process(
    rank: usize,
    port: u16,
    seed: u8,
    token: Option<&str>,
    timeout_ms: u64,
) -> thread::JoinHandle<(bool, String, String)> {
    let mut env = launcher(rank, port);
    env.push((CHILD_RANK, rank.to_string()));
    env.push((CHILD_SEED, seed.to_string()));
    env.push((CHILD_TIMEOUT_MS, timeout_ms.to_string()));
    if let Some(token) = token {
        env.push(("BATCH_SIZE_EXCHANGE_TOKEN", token.to_owned()));
    }
    thread::spawn(move || run_child_to_the_end(&env))
}

#[test]
fn processes_with_another_token_or_none_are_refused_and_the_job_still_forms() {
    let port = free_port();
    let seed = (std::process::id() % 251) as u8;
    let rank_0 = rank_process(0, port, seed, Some("run 4711"), 20_000);

    let (succeeded, stdout, stderr) = rank_process(1, port, seed, Some("run 4712"), 1_000)
        .join()
        .unwrap();
    assert!(!succeeded, "{stdout}");
    assert!(!stdout.contains(EXCHANGED), "{stdout}");
    assert!(
        stderr.contains("did not prove that it knows the job token")
            && stderr.contains("BATCH_SIZE_EXCHANGE_TOKEN"),
        "{stderr}"
    );

    let started = Instant::now();
    let (succeeded, stdout, stderr) = rank_process(1, port, seed, None, 5_000).join().unwrap();
    assert!(!succeeded, "{stdout}");
    assert!(
        stderr.contains("requires the job token") && stderr.contains("BATCH_SIZE_EXCHANGE_TOKEN"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "refused at once, not at the timeout"
    );

    let (succeeded, stdout, stderr) = rank_process(1, port, seed, Some("run 4711"), 5_000)
        .join()
        .unwrap();
    assert!(succeeded, "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("{EXCHANGED}{}", hex(&id(seed)))),
        "{stdout}"
    );
    let (succeeded, stdout, stderr) = rank_0.join().unwrap();
    assert!(succeeded, "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("{EXCHANGED}{}", hex(&id(seed)))),
        "{stdout}"
    );
}

#[test]
fn the_job_token_comes_from_the_environment_and_is_never_shown() {
    let with = |token: &'static str| {
        IdExchange::from_vars(move |name| match name {
            "BATCH_SIZE_EXCHANGE_TOKEN" => Some(token.to_owned()),
            _ => vars(TORCHRUN)(name),
        })
        .unwrap()
    };
    let exchange = with("s3cr3t-run-id");
    assert!(exchange.has_token());
    assert!(!format!("{exchange:?}").contains("s3cr3t"), "{exchange:?}");
    assert_eq!(exchange.to_string(), "tcp 10.1.2.3:29501");
    assert!(!with("").has_token(), "an empty variable is no token");
    assert!(!IdExchange::from_vars(vars(TORCHRUN)).unwrap().has_token());
    assert_ne!(with("a"), with("b"));
}
