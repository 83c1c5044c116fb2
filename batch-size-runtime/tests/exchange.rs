//! Sharing the communicator's Id: through a file and over TCP, with ranks as threads (the
//! tests crate's NCCL tests do it across processes), timeouts, and what the launcher's
//! environment must hold. Every wait is bounded: a test fails rather than hangs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{ExchangeError, IdExchange};

fn id(seed: u8) -> [u8; 128] {
    std::array::from_fn(|index| seed.wrapping_add(index as u8))
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs four ranks, rank 0 last; every rank must get rank 0's bytes, created once.
fn four_ranks(make: impl Fn(usize) -> IdExchange) {
    let created = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for rank in [1, 2, 3, 0] {
        let exchange = make(rank).with_timeout(Duration::from_secs(10));
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
    assert_eq!(text.trim_end().len(), 256, "hex, one line");
}

#[test]
fn four_ranks_share_the_id_over_tcp() {
    let port = free_port();
    four_ranks(|rank| IdExchange::tcp("127.0.0.1", port, rank, 4));
}

#[test]
fn one_rank_creates_the_id_and_opens_nothing() {
    let path = temporary("single");
    let got = IdExchange::file(&path, 0, 1)
        .exchange(|| Ok::<_, std::io::Error>(id(1)))
        .unwrap();
    assert_eq!(got, id(1));
    assert!(!path.exists());
}

#[test]
fn a_rank_without_rank_0_times_out_through_a_file() {
    let path = temporary("alone");
    let started = Instant::now();
    let error = IdExchange::file(&path, 1, 2)
        .with_timeout(Duration::from_millis(200))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(error, ExchangeError::Timeout { rank: 1, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("is rank 0 running"), "{error}");
}

#[test]
fn a_rank_without_rank_0_times_out_over_tcp() {
    let port = free_port();
    let started = Instant::now();
    let error = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(Duration::from_millis(300))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(matches!(error, ExchangeError::Timeout { .. }), "{error}");
}

#[test]
fn rank_0_without_the_others_times_out_naming_them() {
    let port = free_port();
    let error = IdExchange::tcp("127.0.0.1", port, 0, 3)
        .with_timeout(Duration::from_millis(200))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    assert!(error.to_string().contains("ranks 1, 2"), "{error}");
}

#[test]
fn a_file_that_is_not_an_id_is_an_error_at_once() {
    let path = temporary("malformed");
    std::fs::write(&path, "not an id\n").unwrap();
    let error = IdExchange::file(&path, 1, 2)
        .with_timeout(Duration::from_secs(10))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    assert!(matches!(error, ExchangeError::Malformed { .. }), "{error}");
}

#[test]
fn a_peer_that_answers_something_else_is_an_error_not_a_hang() {
    // Another service on the port (the launcher's own store, say).
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let impostor = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut greeting = [0u8; 12];
        stream.read_exact(&mut greeting).unwrap();
        stream
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .unwrap();
    });
    let error = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(Duration::from_secs(5))
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    impostor.join().unwrap();
    assert!(matches!(error, ExchangeError::Malformed { .. }), "{error}");
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
            .with_timeout(Duration::from_secs(10))
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
    let got = IdExchange::tcp("127.0.0.1", port, 1, 2)
        .with_timeout(Duration::from_secs(10))
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
    assert!(missing.to_string().contains("torchrun"), "{missing}");

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
}
