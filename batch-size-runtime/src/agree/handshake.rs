//! One connection of the TCP Id exchange, both sides: rank 0's [`hand_over`] and a rank's
//! [`receive`].
//!
//! Without a token: the rank sends `BSIDXv1\n` and its rank (4 bytes, little-endian); rank 0
//! answers `BSIDXv1\n` and the Id. With a token, a challenge and response in both directions:
//!
//! ```text
//! rank   -> rank 0: BSIDXt1\n, rank, rank's nonce
//! rank 0 -> rank  : BSIDXt1\n, rank 0's nonce, rank 0's proof      (the rank checks it)
//! rank   -> rank 0: the rank's proof                               (rank 0 checks it)
//! rank 0 -> rank  : BSIDXv1\n, the Id masked, its tag               (the rank checks the tag)
//! ```
//!
//! Rank 0 answers a rank it will not serve with `BSIDXno\n` and a line saying why; a rank
//! whose check of rank 0's proof fails sends `BSIDXno\n` alone instead of its own proof, so that
//! a rank 0 with another token learns why at once and a process posing as rank 0 learns nothing
//! it did not know. A rank shows a refusal's words as rank 0's only once rank 0 has proved the
//! token (see `Proven`).
//!
//! Both sides read and write through a [`Bounded`] stream: one deadline for the whole
//! connection, not a limit per read that a peer trickling bytes could renew forever.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use super::deadline::{self, Bounded, Deadline};
use super::token::{self, Keyed, Session, NONCE_BYTES, PROOF_BYTES, SEALED_BYTES};
use super::wire::{
    ExchangeError, ID_BYTES, MAGIC, MAGIC_TOKEN, MAX_REASON_BYTES, REFUSED, TOKEN_VARIABLE,
};

/// Why a try of a rank failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The connection failed, closed with no answer, or ran past the try's deadline: try again.
    Io(io::Error),
    /// The peer answered wrong, refused, or did not prove the job token: an error at once (see
    /// `fetch` for why a rank does not try again).
    Peer(ExchangeError),
    /// This rank cannot go on (no random numbers): an error at once.
    Local(ExchangeError),
}

/// Rank 0's side of one connection: checks the greeting (and with a token, proves itself and
/// checks the peer's proof), sends the Id; returns the rank, or why the peer was dropped. Every
/// read and write ends by `deadline` (`patience` after the connection was accepted, at most),
/// however slowly the peer sends.
pub(crate) fn hand_over(
    stream: TcpStream,
    id: &[u8; ID_BYTES],
    world_size: usize,
    key: Option<&Keyed>,
    deadline: Deadline,
    patience: Duration,
) -> Result<usize, String> {
    let io = |error: io::Error| io_failure(error, patience);
    stream.set_nonblocking(false).map_err(io)?;
    let mut stream = Bounded::new(&stream, deadline);
    let (with_token, rank_number) = greeting(&mut stream, world_size, patience)?;
    let rank = rank_number as usize;
    let key = match (with_token, key) {
        (false, None) => {
            let mut answer = Vec::with_capacity(MAGIC.len() + ID_BYTES);
            answer.extend_from_slice(MAGIC);
            answer.extend_from_slice(id);
            stream.write_all(&answer).map_err(io)?;
            close_write(&stream);
            return Ok(rank);
        }
        (false, Some(_)) => {
            refuse(
                &mut stream,
                &format!(
                    "rank 0 requires the job token, and this rank has none: set \
                     {TOKEN_VARIABLE} to the same secret on every rank"
                ),
            );
            return Err(format!("rank {rank} came without the job token"));
        }
        (true, None) => {
            refuse(
                &mut stream,
                &format!(
                    "rank 0 has no job token, and this rank has one: set {TOKEN_VARIABLE} to \
                     the same secret on every rank, rank 0 included"
                ),
            );
            return Err(format!(
                "rank {rank} came with a job token, and rank 0 has none: set {TOKEN_VARIABLE} \
                 here too"
            ));
        }
        (true, Some(key)) => key,
    };
    prove_and_seal(&mut stream, key, rank_number, id, patience)?;
    Ok(rank)
}

/// Why a connection's read or write failed, as rank 0 logs it.
fn io_failure(error: io::Error, patience: Duration) -> String {
    if deadline::is_timeout(&error) {
        format!("it did not finish the exchange within {patience:?}")
    } else if error.kind() == io::ErrorKind::UnexpectedEof {
        "it closed the connection half-way".to_owned()
    } else {
        error.to_string()
    }
}

/// The peer's greeting: whether it comes with a job token, and the rank it claims (one of 1 to
/// `world_size - 1`, else refused).
fn greeting(
    stream: &mut Bounded<'_>,
    world_size: usize,
    patience: Duration,
) -> Result<(bool, u32), String> {
    let io = |error: io::Error| io_failure(error, patience);
    let mut magic = [0u8; MAGIC.len()];
    stream.read_exact(&mut magic).map_err(io)?;
    let with_token = match &magic {
        MAGIC => false,
        MAGIC_TOKEN => true,
        _ => return Err("not a rank of this job: wrong greeting".to_owned()),
    };
    let mut rank = [0u8; 4];
    stream.read_exact(&mut rank).map_err(io)?;
    let rank_number = u32::from_le_bytes(rank);
    let rank = rank_number as usize;
    if rank == 0 || rank >= world_size {
        let why = format!(
            "rank {rank} is not one of 1 to {}: is RANK below WORLD_SIZE, and WORLD_SIZE the \
             same on every rank?",
            world_size - 1
        );
        refuse(stream, &why);
        return Err(why);
    }
    Ok((with_token, rank_number))
}

/// With a job token: rank 0 proves it knows the token, checks the rank's proof, and sends the
/// Id sealed for this session; a rank with another token is refused, saying so.
fn prove_and_seal(
    stream: &mut Bounded<'_>,
    key: &Keyed,
    rank_number: u32,
    id: &[u8; ID_BYTES],
    patience: Duration,
) -> Result<(), String> {
    let io = |error: io::Error| io_failure(error, patience);
    let rank = rank_number;
    let mut rank_nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut rank_nonce).map_err(io)?;
    let session = Session {
        rank: rank_number,
        rank_nonce,
        rank_0_nonce: token::nonce().map_err(|error| error.to_string())?,
    };
    let mut challenge = Vec::with_capacity(MAGIC_TOKEN.len() + NONCE_BYTES + PROOF_BYTES);
    challenge.extend_from_slice(MAGIC_TOKEN);
    challenge.extend_from_slice(&session.rank_0_nonce);
    challenge.extend_from_slice(&key.rank_0_proof(&session));
    stream.write_all(&challenge).map_err(io)?;
    let mut proof = [0u8; PROOF_BYTES];
    let got = read_up_to(stream, &mut proof).map_err(io)?;
    if got < PROOF_BYTES {
        // A rank that found rank 0's proof wrong says so (the refusal's magic, then the end)
        // instead of proving itself: its token is another one.
        if proof[..got] == REFUSED[..] {
            return Err(format!(
                "rank {rank} rejected rank 0's proof of the job token: it holds another token \
                 (is {TOKEN_VARIABLE} the same on every rank?)"
            ));
        }
        return Err(format!(
            "rank {rank} closed the connection instead of proving that it knows the job \
             token (it may hold another one: is {TOKEN_VARIABLE} the same on every rank?)"
        ));
    }
    if !key.is_rank_proof(&session, &proof) {
        // Told at once, and nothing a peer without the token did not know: its proof failed.
        refuse(
            stream,
            &format!(
                "this rank's proof does not match rank 0's job token: is {TOKEN_VARIABLE} the \
                 same on every rank?"
            ),
        );
        return Err(format!(
            "the peer claiming rank {rank} did not prove that it knows the job token (another \
             token, or an answer replayed from another connection)"
        ));
    }
    let mut answer = Vec::with_capacity(MAGIC.len() + SEALED_BYTES);
    answer.extend_from_slice(MAGIC);
    answer.extend_from_slice(&key.seal(&session, id));
    stream.write_all(&answer).map_err(io)?;
    close_write(stream);
    Ok(())
}

/// Fills `buffer` until it is full or the peer ends the stream; returns how much came.
fn read_up_to(stream: &mut impl Read, buffer: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match stream.read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(read) => filled += read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(filled)
}

/// Says "no more from this side", so the peer reads the end at once.
fn close_write(stream: &Bounded<'_>) {
    let _ = stream.stream().shutdown(Shutdown::Write);
}

/// Tells the peer why it gets nothing, as far as it listens (until the connection's deadline).
fn refuse(stream: &mut Bounded<'_>, why: &str) {
    let mut answer = Vec::with_capacity(REFUSED.len() + why.len() + 1);
    answer.extend_from_slice(REFUSED);
    answer.extend_from_slice(why.as_bytes());
    answer.push(b'\n');
    let _ = stream.write_all(&answer);
    close_write(stream);
}

/// Whether the peer has proved that it is rank 0 when its answer comes: what its words are
/// worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proven {
    /// No job token: nothing can be proved; its words are shown, marked unverified.
    NoToken,
    /// A token, and the peer has not proved it yet: its words are not shown.
    NotYet,
    /// The peer proved that it knows the token: it is rank 0, its words are rank 0's.
    Yes,
}

/// A rank's side of one connection: greets (and with a token, checks rank 0's proof and proves
/// itself), reads the Id. Every read and write ends by `deadline`, the try's.
pub(crate) fn receive(
    stream: TcpStream,
    rank: usize,
    key: Option<&Keyed>,
    deadline: Deadline,
    peer: &str,
) -> Result<[u8; ID_BYTES], Failure> {
    let rank = u32::try_from(rank).map_err(|_| {
        Failure::Local(ExchangeError::Malformed {
            from: peer.to_owned(),
            why: format!("rank {rank} is too large"),
        })
    })?;
    let mut stream = Bounded::new(&stream, deadline);
    let Some(key) = key else {
        let mut greeting = Vec::with_capacity(MAGIC.len() + 4);
        greeting.extend_from_slice(MAGIC);
        greeting.extend_from_slice(&rank.to_le_bytes());
        stream.write_all(&greeting).map_err(Failure::Io)?;
        // The greeting is checked as soon as it is in: another service that answers something
        // and keeps the connection open is told apart at once, not at the timeout.
        expect(&mut stream, MAGIC, peer, Proven::NoToken)?;
        let mut id = [0u8; ID_BYTES];
        read(&mut stream, &mut id, || {
            malformed(peer, "it closed the connection before the whole Id")
        })?;
        return Ok(id);
    };
    receive_sealed(&mut stream, key, rank, peer)
}

/// With a job token: greets rank 0 with a nonce, checks rank 0's proof, proves itself, and
/// opens the sealed Id; a rank 0 that cannot prove the token is refused, and told only that.
fn receive_sealed(
    stream: &mut Bounded<'_>,
    key: &Keyed,
    rank: u32,
    peer: &str,
) -> Result<[u8; ID_BYTES], Failure> {
    let session_nonce = token::nonce().map_err(|source| {
        Failure::Local(ExchangeError::Io {
            what: "drawing a nonce for the job token's challenge".to_owned(),
            source,
        })
    })?;
    let mut greeting = Vec::with_capacity(MAGIC_TOKEN.len() + 4 + NONCE_BYTES);
    greeting.extend_from_slice(MAGIC_TOKEN);
    greeting.extend_from_slice(&rank.to_le_bytes());
    greeting.extend_from_slice(&session_nonce);
    stream.write_all(&greeting).map_err(Failure::Io)?;
    expect(stream, MAGIC_TOKEN, peer, Proven::NotYet)?;
    let mut challenge = [0u8; NONCE_BYTES + PROOF_BYTES];
    read(stream, &mut challenge, || {
        malformed(peer, "it closed the connection before the whole challenge")
    })?;
    let mut session = Session {
        rank,
        rank_nonce: session_nonce,
        rank_0_nonce: [0; NONCE_BYTES],
    };
    session
        .rank_0_nonce
        .copy_from_slice(&challenge[..NONCE_BYTES]);
    if !key.is_rank_0_proof(&session, &challenge[NONCE_BYTES..]) {
        // Rank 0 is told that its proof failed, and no more: the refusal's magic, not this
        // rank's proof. A real rank 0 with another token learns at once why this rank leaves;
        // a process posing as rank 0 learns what it knew (it does not know the token).
        let _ = stream.write_all(REFUSED);
        close_write(stream);
        return Err(unauthenticated(
            peer,
            format!(
            "did not prove that it knows the job token: either {TOKEN_VARIABLE} differs between \
             this rank and rank 0 (it must be the same secret on every rank), or a process \
             other than rank 0 answers on this port. This rank sent it nothing it could use, \
             took nothing from it, and stops rather than wait for its timeout"
        ),
        ));
    }
    stream
        .write_all(&key.rank_proof(&session))
        .map_err(Failure::Io)?;
    expect(stream, MAGIC, peer, Proven::Yes)?;
    let mut sealed = [0u8; SEALED_BYTES];
    read(stream, &mut sealed, || {
        malformed(peer, "it closed the connection before the whole Id")
    })?;
    key.open(&session, &sealed).ok_or_else(|| {
        unauthenticated(
            peer,
            "sent an Id whose tag does not match the job token (changed on the way?)".to_owned(),
        )
    })
}

fn malformed(peer: &str, why: &str) -> Failure {
    Failure::Peer(ExchangeError::Malformed {
        from: peer.to_owned(),
        why: why.to_owned(),
    })
}

fn unauthenticated(peer: &str, why: String) -> Failure {
    Failure::Peer(ExchangeError::Unauthenticated {
        peer: peer.to_owned(),
        why,
    })
}

/// Reads `buffer` whole; an end of stream is `short()`.
fn read(
    stream: &mut Bounded<'_>,
    buffer: &mut [u8],
    short: impl FnOnce() -> Failure,
) -> Result<(), Failure> {
    match stream.read_exact(buffer) {
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => Err(short()),
        other => other.map_err(Failure::Io),
    }
}

/// Reads the next 8 bytes, which must be `magic`. A refusal comes back with the peer's reason
/// as rank 0's words only once the peer has proved that it is rank 0 (`proven`).
fn expect(
    stream: &mut Bounded<'_>,
    magic: &[u8; 8],
    peer: &str,
    proven: Proven,
) -> Result<(), Failure> {
    let mut got = [0u8; 8];
    match stream.read_exact(&mut got) {
        Ok(()) => {}
        // Rank 0 closes connections it cannot hold (too many at once): another try may do.
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(Failure::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "it closed the connection without answering",
            )))
        }
        Err(error) => return Err(Failure::Io(error)),
    }
    if &got == magic {
        return Ok(());
    }
    if &got == REFUSED {
        if proven == Proven::NotYet {
            // Words from a peer that has not proved the token are not shown at all: they
            // could be anyone's, and advice in them could be an attacker's.
            return Err(Failure::Peer(ExchangeError::Unauthenticated {
                peer: peer.to_owned(),
                why: format!(
                    "refused this rank before proving that it knows the job token, so its \
                     reason is not trusted and not shown: either rank 0 runs with no \
                     {TOKEN_VARIABLE}, or with another RANK or WORLD_SIZE than this rank, or a \
                     process other than rank 0 answers on this port. Set {TOKEN_VARIABLE} to \
                     the same secret on every rank, rank 0 included"
                ),
            }));
        }
        // Bounded by the try's deadline too: a reason trickled byte by byte ends with it.
        let mut reason = Vec::new();
        let _ = stream.take(MAX_REASON_BYTES).read_to_end(&mut reason);
        // The peer's words go into logs and errors: no control characters.
        let why: String = String::from_utf8_lossy(&reason)
            .chars()
            .filter(|character| !character.is_control())
            .collect();
        return Err(Failure::Peer(match proven {
            Proven::Yes => ExchangeError::Refused {
                peer: peer.to_owned(),
                why,
            },
            Proven::NoToken | Proven::NotYet => ExchangeError::UnprovenRefusal {
                peer: peer.to_owned(),
                said: why,
            },
        }));
    }
    Err(Failure::Peer(ExchangeError::Malformed {
        from: peer.to_owned(),
        why: "it answered something else (is MASTER_PORT another service's, such as torchrun's \
              store? set BATCH_SIZE_EXCHANGE_PORT to a free port, the same for every rank)"
            .to_owned(),
    }))
}
