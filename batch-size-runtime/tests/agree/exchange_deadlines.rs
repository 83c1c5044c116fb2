//! The Id exchange's time limits hold against peers that trickle bytes: a limit per
//! read would let a peer that sends one byte every 400 ms hold a connection for ever, so the
//! exchange keeps one deadline per exchange, per try of a rank and per connection of rank 0,
//! over all their reads and writes. Over loopback, each direction: a process posing as rank 0
//! that trickles its answer to a rank, and a peer that trickles its greeting or its proof to
//! rank 0. Every limit is asserted as "within the limit + 10 % + 100 ms".
//!
//! The figures each test measured are printed (`cargo test -p batch-size-runtime --test agree
//! exchange_deadlines -- --nocapture`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{ExchangeError, IdExchange};

use crate::free_port;
use free_port::free_port;

const TOKEN: &str = "job 31 secret";

/// How often a trickling peer sends a byte: well under any limit of these tests, so that a
/// limit per read would never fire.
const TRICKLE: Duration = Duration::from_millis(400);

/// The most a limit may be overrun: 10 %, plus 100 ms for a loaded machine.
fn bound(limit: Duration) -> Duration {
    limit + limit / 10 + Duration::from_millis(100)
}

fn id(seed: u8) -> [u8; 128] {
    std::array::from_fn(|index| seed.wrapping_add(index as u8))
}

fn with_token(exchange: IdExchange, token: bool) -> IdExchange {
    if token {
        exchange.with_token(TOKEN)
    } else {
        exchange
    }
}

/// A process posing as rank 0 on a port of its own: for every connection it answers with
/// `answer` then zeros, one byte every [`TRICKLE`], and records how long the rank kept the
/// connection (from the accept to the rank's end of stream).
struct TricklingRank0 {
    port: u16,
    held: Arc<Mutex<Vec<Duration>>>,
    stop: Arc<AtomicBool>,
    acceptor: thread::JoinHandle<Vec<thread::JoinHandle<()>>>,
}

impl TricklingRank0 {
    fn start(answer: &'static [u8]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (record, halt) = (Arc::clone(&held), Arc::clone(&stop));
        let acceptor = thread::spawn(move || {
            let mut connections = Vec::new();
            while !halt.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (record, halt) = (Arc::clone(&record), Arc::clone(&halt));
                        connections.push(thread::spawn(move || {
                            trickle_answer(stream, answer, &record, &halt)
                        }));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(2)),
                }
            }
            connections
        });
        TricklingRank0 {
            port,
            held,
            stop,
            acceptor,
        }
    }

    /// How long each connection was held, once all are over.
    fn finish(self) -> Vec<Duration> {
        self.stop.store(true, Ordering::SeqCst);
        for connection in self.acceptor.join().unwrap() {
            connection.join().unwrap();
        }
        let held = self.held.lock().unwrap();
        held.clone()
    }
}

fn trickle_answer(
    stream: TcpStream,
    answer: &[u8],
    record: &Mutex<Vec<Duration>>,
    halt: &AtomicBool,
) {
    stream.set_nonblocking(false).unwrap();
    let accepted = Instant::now();
    let closed = Arc::new(AtomicBool::new(false));
    let mut reader = stream.try_clone().unwrap();
    let seen = Arc::clone(&closed);
    let watcher = thread::spawn(move || {
        // Whatever the rank sends (its greeting), until its end of stream.
        let mut buffer = [0u8; 256];
        while matches!(reader.read(&mut buffer), Ok(read) if read > 0) {}
        seen.store(true, Ordering::SeqCst);
        accepted.elapsed()
    });
    let mut writer = &stream;
    for byte in answer.iter().copied().chain(std::iter::repeat(0)) {
        if closed.load(Ordering::SeqCst)
            || halt.load(Ordering::SeqCst)
            || writer.write_all(&[byte]).is_err()
        {
            break;
        }
        thread::sleep(TRICKLE);
    }
    let _ = stream.shutdown(Shutdown::Both);
    let lasted = watcher.join().unwrap();
    record.lock().unwrap().push(lasted);
}

/// A rank against a trickling rank 0; returns how long the exchange took, its error, and how
/// long each connection was held.
fn rank_against_trickling_rank_0(
    token: bool,
    timeout: Duration,
    patience: Option<Duration>,
) -> (Duration, ExchangeError, Vec<Duration>) {
    let fake = TricklingRank0::start(if token { b"BSIDXt1\n" } else { b"BSIDXv1\n" });
    let mut exchange =
        with_token(IdExchange::tcp("127.0.0.1", fake.port, 1, 2), token).with_timeout(timeout);
    if let Some(patience) = patience {
        exchange = exchange.with_connection_patience(patience);
    }
    let started = Instant::now();
    let error = exchange
        .exchange(|| Ok::<_, std::io::Error>(id(0)))
        .unwrap_err();
    let took = started.elapsed();
    (took, error, fake.finish())
}

#[test]
fn a_rank_returns_by_its_timeout_against_a_rank_0_that_trickles_bytes() {
    // The default patience (5 s) is longer than the timeout: the exchange's deadline ends the
    // try. With a limit per read, the rank was held for a minute (8 + 128 bytes, 400 ms each).
    let timeout = Duration::from_millis(1500);
    let runs: Vec<_> = [false, true]
        .into_iter()
        .map(|token| {
            thread::spawn(move || (token, rank_against_trickling_rank_0(token, timeout, None)))
        })
        .collect();
    for run in runs {
        let (token, (took, error, held)) = run.join().unwrap();
        eprintln!("token {token}: the rank returned after {took:?} (timeout {timeout:?})");
        assert!(
            took >= timeout && took <= bound(timeout),
            "token {token}: {took:?}"
        );
        assert!(
            matches!(error, ExchangeError::Timeout { rank: 1, .. }),
            "token {token}: {error}"
        );
        assert!(
            error
                .to_string()
                .contains("did not finish a try within 1.5s"),
            "token {token}: {error}"
        );
        assert!(!held.is_empty(), "token {token}: it did connect");
        for lasted in held {
            assert!(lasted <= bound(timeout), "token {token}: {lasted:?}");
        }
    }
}

#[test]
fn each_try_of_a_rank_ends_by_its_patience_against_a_trickling_rank_0() {
    // A try lasts the connection's patience at most, then the rank tries again while its
    // timeout lasts.
    let timeout = Duration::from_millis(1500);
    let patience = Duration::from_millis(600);
    let runs: Vec<_> = [false, true]
        .into_iter()
        .map(|token| {
            thread::spawn(move || {
                (
                    token,
                    rank_against_trickling_rank_0(token, timeout, Some(patience)),
                )
            })
        })
        .collect();
    for run in runs {
        let (token, (took, error, held)) = run.join().unwrap();
        eprintln!(
            "token {token}: tries held {held:?} (patience {patience:?}); the rank returned \
             after {took:?} (timeout {timeout:?})"
        );
        assert!(took <= bound(timeout), "token {token}: {took:?}");
        assert!(
            matches!(error, ExchangeError::Timeout { rank: 1, .. }),
            "token {token}: {error}"
        );
        assert!(held.len() >= 2, "token {token}: tried again: {held:?}");
        for lasted in &held {
            assert!(*lasted <= bound(patience), "token {token}: {held:?}");
        }
    }
}

/// How a peer trickles bytes to rank 0: what it sends at once, then what it sends one byte
/// every [`TRICKLE`].
#[derive(Debug, Clone, Copy)]
enum Trickle {
    /// Without a token: the greeting (magic and rank).
    Greeting,
    /// With a token: the greeting (magic, rank, nonce).
    TokenGreeting,
    /// With a token: the greeting at once, then the proof.
    Proof,
}

impl Trickle {
    fn token(self) -> bool {
        !matches!(self, Trickle::Greeting)
    }

    fn bytes(self) -> (Vec<u8>, Vec<u8>) {
        let mut greeting = if self.token() {
            b"BSIDXt1\n".to_vec()
        } else {
            b"BSIDXv1\n".to_vec()
        };
        greeting.extend_from_slice(&1u32.to_le_bytes());
        if self.token() {
            greeting.extend_from_slice(&[9u8; 32]);
        }
        match self {
            Trickle::Greeting | Trickle::TokenGreeting => (Vec::new(), greeting),
            Trickle::Proof => (greeting, vec![0u8; 32]),
        }
    }
}

/// Connects to rank 0 (retrying while it starts) and trickles; returns how long rank 0 kept
/// the connection open, from the connect to rank 0's end of stream.
fn trickle_to_rank_0(port: u16, trickle: Trickle) -> Duration {
    let (fast, slow) = trickle.bytes();
    let give_up = Instant::now() + Duration::from_secs(5);
    let stream = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < give_up => thread::sleep(Duration::from_millis(2)),
            Err(error) => panic!("{error}"),
        }
    };
    let connected = Instant::now();
    let closed = Arc::new(AtomicBool::new(false));
    let mut reader = stream.try_clone().unwrap();
    let seen = Arc::clone(&closed);
    let watcher = thread::spawn(move || {
        // Rank 0's challenge, if any, then its end of stream.
        let mut buffer = [0u8; 256];
        while matches!(reader.read(&mut buffer), Ok(read) if read > 0) {}
        seen.store(true, Ordering::SeqCst);
        connected.elapsed()
    });
    let mut writer = &stream;
    writer.write_all(&fast).unwrap();
    for byte in slow {
        thread::sleep(TRICKLE);
        if closed.load(Ordering::SeqCst) || writer.write_all(&[byte]).is_err() {
            break;
        }
    }
    let lasted = watcher.join().unwrap();
    assert!(
        closed.load(Ordering::SeqCst),
        "{trickle:?}: rank 0 closed it"
    );
    lasted
}

#[test]
fn rank_0_closes_a_trickling_peer_by_its_patience_and_serves_the_ranks() {
    let patience = Duration::from_millis(800);
    let runs: Vec<_> = [Trickle::Greeting, Trickle::TokenGreeting, Trickle::Proof]
        .into_iter()
        .map(|trickle| {
            thread::spawn(move || {
                let port = free_port();
                let rank = |rank| {
                    with_token(IdExchange::tcp("127.0.0.1", port, rank, 3), trickle.token())
                        .with_timeout(Duration::from_secs(10))
                        .with_connection_patience(patience)
                };
                let rank_0 = rank(0);
                let rank_0 =
                    thread::spawn(move || rank_0.exchange(|| Ok::<_, std::io::Error>(id(42))));
                let trickler = thread::spawn(move || trickle_to_rank_0(port, trickle));
                thread::sleep(Duration::from_millis(50)); // the trickler first
                let started = Instant::now();
                let got = rank(1).exchange(|| Ok::<_, std::io::Error>(id(0))).unwrap();
                let rank_took = started.elapsed();
                assert_eq!(got, id(42));
                // Rank 0 stays up (rank 2 is not there yet) until the trickler's patience is
                // over: what ends its connection is that, not the exchange's end.
                let lasted = trickler.join().unwrap();
                assert_eq!(
                    rank(2).exchange(|| Ok::<_, std::io::Error>(id(0))).unwrap(),
                    id(42)
                );
                assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
                (trickle, lasted, rank_took)
            })
        })
        .collect();
    for run in runs {
        let (trickle, lasted, rank_took) = run.join().unwrap();
        eprintln!(
            "{trickle:?}: rank 0 held the trickling peer {lasted:?} (patience {patience:?}); \
             the rank beside it was served in {rank_took:?}"
        );
        assert!(
            lasted >= patience - Duration::from_millis(100) && lasted <= bound(patience),
            "{trickle:?}: {lasted:?}"
        );
        assert!(rank_took < Duration::from_millis(600), "{rank_took:?}");
    }
}

#[test]
fn rank_0_returns_by_its_timeout_whatever_trickling_peers_do() {
    // The default patience (5 s) is longer than the timeout: the exchange's deadline ends rank
    // 0, and every connection it holds, whatever the peers still send.
    let timeout = Duration::from_millis(1500);
    let port = free_port();
    let rank_0 = thread::spawn(move || {
        let started = Instant::now();
        let outcome = IdExchange::tcp("127.0.0.1", port, 0, 3)
            .with_token(TOKEN)
            .with_timeout(timeout)
            .exchange(|| Ok::<_, std::io::Error>(id(42)));
        (started.elapsed(), outcome)
    });
    let tricklers: Vec<_> = [Trickle::TokenGreeting, Trickle::Proof, Trickle::Greeting]
        .into_iter()
        .map(|trickle| thread::spawn(move || trickle_to_rank_0(port, trickle)))
        .collect();
    let (took, outcome) = rank_0.join().unwrap();
    let held: Vec<Duration> = tricklers
        .into_iter()
        .map(|trickler| trickler.join().unwrap())
        .collect();
    eprintln!("rank 0 returned after {took:?} (timeout {timeout:?}); it held the peers {held:?}");
    assert!(took >= timeout && took <= bound(timeout), "{took:?}");
    let error = outcome.unwrap_err();
    assert!(
        matches!(error, ExchangeError::Timeout { rank: 0, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("ranks 1, 2"), "{error}");
    for lasted in held {
        assert!(lasted <= bound(timeout), "{lasted:?}");
    }
}
