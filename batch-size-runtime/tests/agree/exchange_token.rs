//! The Id exchange lets in only the job's own ranks, with ranks as threads over
//! loopback: the right token joins; another token, no token against a token, a replayed answer
//! and a process posing as rank 0 are refused with clear errors, at once, and the job forms
//! with the right ranks (a rank does not wait for its timeout); words from a peer
//! that has not proved the token are never shown as rank 0's; silent connections cost the
//! ranks nothing; rank 0 warns when it listens beyond loopback with no token; the Id file is
//! its owner's only. (Two processes: `tests/agree/exchange.rs`; trickling peers:
//! `tests/agree/exchange_deadlines.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{ExchangeError, IdExchange};

use crate::warnings;
use warnings::Warnings;

use crate::free_port;
use free_port::free_port;

const TOKEN: &str = "job 25 secret";

fn id(seed: u8) -> [u8; 128] {
    std::array::from_fn(|index| seed.wrapping_add(index as u8))
}

fn rank(port: u16, rank: usize, world_size: usize) -> IdExchange {
    IdExchange::tcp("127.0.0.1", port, rank, world_size).with_timeout(Duration::from_secs(10))
}

/// Runs `exchange` on a thread of its own, its WARNs recorded.
fn spawn_recorded(
    exchange: IdExchange,
    seed: u8,
) -> (
    thread::JoinHandle<Result<[u8; 128], ExchangeError>>,
    Warnings,
) {
    let warnings = Warnings::default();
    let recorder = warnings.clone();
    let handle = thread::spawn(move || {
        tracing::subscriber::with_default(recorder, || {
            exchange.exchange(|| Ok::<_, std::io::Error>(id(seed)))
        })
    });
    (handle, warnings)
}

fn connect(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => {
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                return stream;
            }
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
            Err(error) => panic!("{error}"),
        }
    }
}

fn fetch(exchange: IdExchange) -> Result<[u8; 128], ExchangeError> {
    exchange.exchange(|| Ok::<_, std::io::Error>(id(0)))
}

#[test]
fn the_right_token_joins() {
    let port = free_port();
    let ranks: Vec<_> = [1, 2, 3, 0]
        .into_iter()
        .map(|index| {
            let exchange = rank(port, index, 4).with_token(TOKEN);
            assert!(exchange.has_token());
            thread::spawn(move || exchange.exchange(|| Ok::<_, std::io::Error>(id(42))))
        })
        .collect();
    for handle in ranks {
        assert_eq!(handle.join().unwrap().unwrap(), id(42));
    }
}

#[test]
fn another_token_is_refused_and_the_job_still_forms() {
    let port = free_port();
    let (rank_0, warnings) = spawn_recorded(rank(port, 0, 2).with_token(TOKEN), 42);
    // Fails at once, not at its timeout of 10 s: another token is a setting, not a passing
    // fault.
    let started = Instant::now();
    let error = fetch(rank(port, 1, 2).with_token("another job")).unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(
        matches!(&error, ExchangeError::Unauthenticated { peer, .. } if *peer == format!("127.0.0.1:{port}")),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("did not prove that it knows the job token"),
        "{message}"
    );
    assert!(message.contains("BATCH_SIZE_EXCHANGE_TOKEN"), "{message}");

    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
    let warnings = warnings.all();
    assert!(
        warnings
            .iter()
            .any(|warning| warning.contains("peer=127.0.0.1:")
                && warning.contains("rejected rank 0's proof of the job token")
                && warning.contains("BATCH_SIZE_EXCHANGE_TOKEN")),
        "rank 0 learns at once why the rank left: {warnings:#?}"
    );
}

#[test]
fn no_token_against_a_token_is_refused_saying_what_to_set() {
    // A rank without a token, rank 0 with one: refused at once, with the peer's reason shown
    // as its own, unverified (without a token nothing proves that it is rank 0).
    let port = free_port();
    let (rank_0, warnings) = spawn_recorded(rank(port, 0, 2).with_token(TOKEN), 42);
    let started = Instant::now();
    let error = fetch(rank(port, 1, 2)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(
        matches!(&error, ExchangeError::UnprovenRefusal { peer, .. } if *peer == format!("127.0.0.1:{port}")),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("requires the job token") && message.contains("BATCH_SIZE_EXCHANGE_TOKEN"),
        "{message}"
    );
    assert!(
        message.contains("nothing proves that it is rank 0") && !message.contains("rank 0 at"),
        "{message}"
    );
    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
    let warnings = warnings.all();
    assert!(
        warnings
            .iter()
            .any(|warning| warning.contains("peer=127.0.0.1:")
                && warning.contains("without the job token")),
        "{warnings:#?}"
    );

    // A rank with a token, rank 0 without: rank 0 refuses before proving anything, so the
    // rank shows none of its words, names the likely causes itself, and stops at once.
    let port = free_port();
    let rank_0 =
        thread::spawn(move || rank(port, 0, 2).exchange(|| Ok::<_, std::io::Error>(id(7))));
    let started = Instant::now();
    let error = fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(&error, ExchangeError::Unauthenticated { .. }),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("refused this rank before proving that it knows the job token")
            && message.contains("with no BATCH_SIZE_EXCHANGE_TOKEN"),
        "{message}"
    );
    assert!(!message.contains("rank 0 has no job token"), "{message}");
    assert_eq!(fetch(rank(port, 1, 2)).unwrap(), id(7));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(7));
}

/// Reads exactly `bytes` bytes.
fn read_n(stream: &mut TcpStream, bytes: usize) -> Vec<u8> {
    let mut buffer = vec![0u8; bytes];
    stream.read_exact(&mut buffer).unwrap();
    buffer
}

// The wire (see `agree/handshake.rs`): hello = magic, rank, nonce; challenge = magic, nonce,
// proof; the rank's proof; then magic, sealed Id and tag.
const HELLO: usize = 8 + 4 + 32;
const CHALLENGE: usize = 8 + 32 + 32;
const PROOF: usize = 32;
const SEALED: usize = 8 + 128 + 32;

/// One real exchange through a proxy that keeps what each side said: (the rank's hello and
/// proof, rank 0's challenge and sealed Id).
fn record_one_exchange() -> (Vec<u8>, Vec<u8>) {
    let port = free_port();
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let rank_0 = thread::spawn(move || {
        rank(port, 0, 2)
            .with_token(TOKEN)
            .exchange(|| Ok::<_, std::io::Error>(id(1)))
    });
    let recorder = thread::spawn(move || {
        let (mut from_rank, _) = proxy.accept().unwrap();
        let mut to_rank_0 = connect(port);
        let mut rank_said = read_n(&mut from_rank, HELLO);
        to_rank_0.write_all(&rank_said).unwrap();
        let mut rank_0_said = read_n(&mut to_rank_0, CHALLENGE);
        from_rank.write_all(&rank_0_said).unwrap();
        let proof = read_n(&mut from_rank, PROOF);
        to_rank_0.write_all(&proof).unwrap();
        rank_said.extend(proof);
        let sealed = read_n(&mut to_rank_0, SEALED);
        from_rank.write_all(&sealed).unwrap();
        rank_0_said.extend(sealed);
        (rank_said, rank_0_said)
    });
    assert_eq!(
        fetch(rank(proxy_port, 1, 2).with_token(TOKEN)).unwrap(),
        id(1)
    );
    assert_eq!(rank_0.join().unwrap().unwrap(), id(1));
    recorder.join().unwrap()
}

#[test]
fn a_replayed_answer_is_refused_both_ways_and_the_job_still_forms() {
    let (rank_said, rank_0_said) = record_one_exchange();

    // To rank 0 of the next job with the same token: the rank's recorded proof answers another
    // challenge, and is refused.
    let port = free_port();
    let (rank_0, warnings) = spawn_recorded(rank(port, 0, 2).with_token(TOKEN), 42);
    let mut replay = connect(port);
    replay.write_all(&rank_said[..HELLO]).unwrap();
    let challenge = read_n(&mut replay, CHALLENGE);
    assert_ne!(
        challenge,
        rank_0_said[..CHALLENGE],
        "rank 0's nonce is fresh"
    );
    replay.write_all(&rank_said[HELLO..]).unwrap();
    let mut answer = Vec::new();
    replay.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("BSIDXno\n"), "{answer:?}");
    assert!(
        answer.contains("does not match rank 0's job token"),
        "{answer:?}"
    );
    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
    let warnings = warnings.all();
    assert!(
        warnings
            .iter()
            .any(|warning| warning.contains("peer=127.0.0.1:") && warning.contains("replayed")),
        "{warnings:#?}"
    );

    // To a rank, from a process posing as rank 0 with the recorded challenge and Id: the rank
    // (its own nonce is fresh) sends it no proof, only the refusal's magic, takes nothing from
    // it and stops at once; the job forms with the real rank 0.
    let port = free_port();
    let impostor = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let fake = thread::spawn(move || {
        let (mut stream, _) = impostor.accept().unwrap();
        let _hello = read_n(&mut stream, HELLO);
        stream.write_all(&rank_0_said).unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        rest // what the rank sent after the challenge
    });
    let started = Instant::now();
    let error = fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        fake.join().unwrap(),
        b"BSIDXno\n",
        "the rank sent no proof, only that the challenge failed"
    );
    assert!(
        matches!(&error, ExchangeError::Unauthenticated { peer, .. } if *peer == format!("127.0.0.1:{port}")),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("did not prove that it knows the job token"),
        "{error}"
    );
    let rank_0 = thread::spawn(move || {
        rank(port, 0, 2)
            .with_token(TOKEN)
            .exchange(|| Ok::<_, std::io::Error>(id(42)))
    });
    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
}

#[test]
fn a_process_posing_as_rank_0_gets_nothing_and_the_rank_stops_at_once() {
    // The impostor holds the port first, with a token of its own and another Id: the rank
    // takes nothing from it and stops at once, with an error naming the variable, and the
    // impostor learns only that its proof failed. The job forms once the real rank 0 listens.
    let port = free_port();
    let (impostor, impostor_warnings) = spawn_recorded(
        rank(port, 0, 2)
            .with_token("not the job's")
            .with_timeout(Duration::from_millis(600)),
        66,
    );
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let error = fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(
        matches!(&error, ExchangeError::Unauthenticated { peer, .. } if *peer == format!("127.0.0.1:{port}")),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("did not prove that it knows the job token")
            && message.contains("BATCH_SIZE_EXCHANGE_TOKEN")
            && message.contains("took nothing from it"),
        "{message}"
    );
    let impostor_error = impostor.join().unwrap().unwrap_err();
    assert!(
        matches!(impostor_error, ExchangeError::Timeout { rank: 0, .. }),
        "{impostor_error}"
    );
    assert!(
        impostor_warnings
            .all()
            .iter()
            .any(|warning| warning.contains("rejected rank 0's proof of the job token")),
        "{:#?}",
        impostor_warnings.all()
    );
    let rank_0 = thread::spawn(move || {
        rank(port, 0, 2)
            .with_token(TOKEN)
            .exchange(|| Ok::<_, std::io::Error>(id(42)))
    });
    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
}

#[test]
fn a_refusal_from_an_unproven_peer_is_never_shown_as_rank_0s() {
    // A process on rank 0's port refuses with advice of its own: with a token the rank shows
    // none of it; without one (nothing can be proved) it shows it quoted, as the peer's, not
    // rank 0's.
    const ADVICE: &str = "rank 0 says: set BATCH_SIZE_EXCHANGE_TOKEN=evil";
    let refusing = |hello: usize| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _hello = read_n(&mut stream, hello);
            stream
                .write_all(format!("BSIDXno\n{ADVICE}\n").as_bytes())
                .unwrap();
        });
        (port, fake)
    };

    let (port, fake) = refusing(HELLO);
    let error = fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap_err();
    fake.join().unwrap();
    assert!(
        matches!(&error, ExchangeError::Unauthenticated { peer, .. } if *peer == format!("127.0.0.1:{port}")),
        "{error}"
    );
    let message = error.to_string();
    assert!(!message.contains("evil"), "{message}");
    assert!(!message.contains("rank 0 at"), "{message}");
    assert!(
        message.starts_with(&format!(
            "127.0.0.1:{port} refused this rank before proving"
        )),
        "{message}"
    );

    let (port, fake) = refusing(8 + 4);
    let error = fetch(rank(port, 1, 2)).unwrap_err();
    fake.join().unwrap();
    assert!(
        matches!(&error, ExchangeError::UnprovenRefusal { said, .. } if said == ADVICE),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.starts_with(&format!(
            "the peer at 127.0.0.1:{port} refused this rank, but nothing proves that it is rank 0"
        )),
        "{message}"
    );
    assert!(
        message.contains(&format!("{ADVICE:?}")),
        "quoted: {message}"
    );
    assert!(!message.contains("rank 0 at"), "{message}");
}

#[test]
fn a_rank_whose_proof_rank_0_rejects_is_told_at_once() {
    // A proxy changes one bit of the rank's proof: rank 0 (which proved itself) refuses it at
    // once and says why, in words the rank shows as rank 0's; the rank stops, long before its
    // timeout of 10 s. The real rank then joins directly.
    let port = free_port();
    let (rank_0, warnings) = spawn_recorded(rank(port, 0, 2).with_token(TOKEN), 42);
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let tamperer = thread::spawn(move || {
        let (mut from_rank, _) = proxy.accept().unwrap();
        let mut to_rank_0 = connect(port);
        to_rank_0.write_all(&read_n(&mut from_rank, HELLO)).unwrap();
        from_rank
            .write_all(&read_n(&mut to_rank_0, CHALLENGE))
            .unwrap();
        let mut proof = read_n(&mut from_rank, PROOF);
        proof[0] ^= 1;
        to_rank_0.write_all(&proof).unwrap();
        let mut answer = Vec::new();
        to_rank_0.read_to_end(&mut answer).unwrap();
        from_rank.write_all(&answer).unwrap();
    });
    let started = Instant::now();
    let error = fetch(rank(proxy_port, 1, 2).with_token(TOKEN)).unwrap_err();
    let took = started.elapsed();
    tamperer.join().unwrap();
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(
        matches!(&error, ExchangeError::Refused { peer, .. } if *peer == format!("127.0.0.1:{proxy_port}")),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.starts_with(&format!(
            "rank 0 at 127.0.0.1:{proxy_port} refused this rank: this rank's proof does not \
             match rank 0's job token"
        )) && message.contains("BATCH_SIZE_EXCHANGE_TOKEN"),
        "{message}"
    );
    assert_eq!(fetch(rank(port, 1, 2).with_token(TOKEN)).unwrap(), id(42));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
    assert!(
        warnings
            .all()
            .iter()
            .any(|warning| warning.contains("did not prove that it knows the job token")),
        "{:#?}",
        warnings.all()
    );
}

/// Rank 0 and two ranks, after `silent` connections that never say a word; returns how long
/// the ranks took from their start, and the silent connections.
fn ranks_after_silent_connections(
    silent: usize,
    token: Option<&str>,
) -> (Duration, Vec<TcpStream>) {
    let port = free_port();
    let with = |exchange: IdExchange| match token {
        Some(token) => exchange.with_token(token),
        None => exchange,
    };
    let rank_0 = with(rank(port, 0, 3));
    let rank_0 = thread::spawn(move || rank_0.exchange(|| Ok::<_, std::io::Error>(id(42))));
    let silent: Vec<TcpStream> = (0..silent).map(|_| connect(port)).collect();
    thread::sleep(Duration::from_millis(50)); // all accepted
    let started = Instant::now();
    let ranks: Vec<_> = [1, 2]
        .into_iter()
        .map(|index| {
            let exchange = with(rank(port, index, 3));
            thread::spawn(move || fetch(exchange))
        })
        .collect();
    for handle in ranks {
        assert_eq!(handle.join().unwrap().unwrap(), id(42));
    }
    let took = started.elapsed();
    assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
    (took, silent)
}

#[test]
fn ten_silent_connections_opened_first_do_not_delay_the_ranks() {
    for token in [None, Some(TOKEN)] {
        let (took, _silent) = ranks_after_silent_connections(10, token);
        assert!(took < Duration::from_secs(1), "{token:?}: {took:?}");
    }
}

#[test]
fn rank_0_holds_a_bounded_number_of_connections() {
    let held = batch_size_runtime::agree::MAX_HELD_CONNECTIONS;
    let (took, mut silent) = ranks_after_silent_connections(held + 20, Some(TOKEN));
    assert!(took < Duration::from_secs(1), "{took:?}");
    // The oldest were closed to make room; the exchange over, the rest are closed too.
    let closed = silent
        .iter_mut()
        .map(|stream| {
            stream
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            matches!(stream.read(&mut [0u8; 1]), Ok(0) | Err(_))
        })
        .filter(|closed| *closed)
        .count();
    assert_eq!(closed, held + 20);
}

#[test]
fn rank_0_beyond_loopback_with_no_token_warns_once() {
    let warns_beyond_loopback = |host: &str, token: Option<&str>| {
        let port = free_port();
        let mut exchange = IdExchange::tcp(host, port, 0, 2).with_timeout(Duration::from_secs(10));
        if let Some(token) = token {
            exchange = exchange.with_token(token);
        }
        let (rank_0, warnings) = spawn_recorded(exchange, 42);
        let mut rank_1 = rank(port, 1, 2);
        if let Some(token) = token {
            rank_1 = rank_1.with_token(token);
        }
        assert_eq!(fetch(rank_1).unwrap(), id(42));
        assert_eq!(rank_0.join().unwrap().unwrap(), id(42));
        warnings
            .all()
            .into_iter()
            .filter(|warning| warning.contains("any process that reaches it can take part"))
            .collect::<Vec<_>>()
    };
    // 0.0.0.0 stands for an address other machines reach (this machine's own, in a real job).
    let warned = warns_beyond_loopback("0.0.0.0", None);
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(
        warned[0].contains("BATCH_SIZE_EXCHANGE_TOKEN"),
        "{warned:#?}"
    );
    assert!(warns_beyond_loopback("0.0.0.0", Some(TOKEN)).is_empty());
    assert!(warns_beyond_loopback("127.0.0.1", None).is_empty());
}

#[test]
fn on_loopback_rank_0_listens_on_loopback_only() {
    // Rank 0 binds 127.0.0.1 for MASTER_ADDR=127.0.0.1: the same port stays free on another
    // address of the machine (0.0.0.0 would hold it on all of them).
    let port = free_port();
    let rank_0 = thread::spawn(move || fetch_as_rank_0(rank(port, 0, 2)));
    let _rank_1_waits = connect(port); // rank 0 listens
    let other_address = TcpListener::bind(("127.0.0.2", port));
    drop(_rank_1_waits);
    assert_eq!(fetch(rank(port, 1, 2)).unwrap(), id(3));
    assert_eq!(rank_0.join().unwrap().unwrap(), id(3));
    assert!(other_address.is_ok(), "{other_address:?}");
}

fn fetch_as_rank_0(exchange: IdExchange) -> Result<[u8; 128], ExchangeError> {
    exchange.exchange(|| Ok::<_, std::io::Error>(id(3)))
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
            match fetch(reader.clone()) {
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
