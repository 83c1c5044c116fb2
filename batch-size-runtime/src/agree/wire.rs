//! What the Id exchange's two sides say to each other: the sizes, the greetings, the limits and
//! the errors, shared by the exchange, the handshake of one connection and the job token, which
//! import them from here and never from each other.

use std::error::Error;
use std::io;
use std::time::Duration;

/// The size of a communicator's unique Id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// The variable that chooses the port of the TCP exchange.
pub const EXCHANGE_PORT_VARIABLE: &str = "BATCH_SIZE_EXCHANGE_PORT";

/// What a client sends first, and rank 0 answers with: a peer that is not this exchange (the
/// launcher's own store, another service) is told apart at once.
pub(crate) const MAGIC: &[u8; 8] = b"BSIDXv1\n";

/// What a rank with a job token sends first, and rank 0 answers its challenge with.
pub(crate) const MAGIC_TOKEN: &[u8; 8] = b"BSIDXt1\n";

/// What rank 0 answers a rank it will not serve with, before a line saying why.
pub(crate) const REFUSED: &[u8; 8] = b"BSIDXno\n";

/// The longest reason for a refusal that is read.
pub(crate) const MAX_REASON_BYTES: u64 = 512;

/// The variable that holds the job token (see [the exchange's Security section](crate::agree#security)).
pub const TOKEN_VARIABLE: &str = "BATCH_SIZE_EXCHANGE_TOKEN";

/// How long one connection may last, by default, whatever the peer sends and however slowly:
/// rank 0 closes a connection this long after accepting it, and a rank gives up a try this long
/// after it began (connecting included), both by the exchange's own timeout at the latest.
/// Rank 0 serves peers concurrently, so a silent or trickling one costs the others nothing.
/// [`IdExchange::with_connection_patience`](crate::agree::IdExchange::with_connection_patience)
/// chooses another.
pub const CONNECTION_PATIENCE: Duration = Duration::from_secs(5);

/// How many connections rank 0 holds at once; one more closes the one held longest.
pub const MAX_HELD_CONNECTIONS: usize = 64;

/// Why the Id could not be shared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// A variable of the launcher's environment is not set.
    #[error("{name} is not set: {hint}")]
    MissingVariable {
        /// The variable.
        name: &'static str,
        /// What sets it.
        hint: &'static str,
    },
    /// A variable of the launcher's environment does not parse.
    #[error("{name}={value:?} is not valid: {why}")]
    InvalidVariable {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        why: &'static str,
    },
    /// The rank is not below the world size.
    #[error("rank {rank} is not one of the {world_size} ranks (RANK must be below WORLD_SIZE)")]
    InvalidRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The others did not come in time.
    #[error("rank {rank} waited {waited:?} for {waiting_for}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// What it waited for, and what to check.
        waiting_for: String,
    },
    /// A file or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, and what to check.
        what: String,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// What was read is not an Id of this exchange.
    #[error("{from} is not a batch-size Id exchange: {why}")]
    Malformed {
        /// The file or peer.
        from: String,
        /// What was wrong.
        why: String,
    },
    /// Rank 0 refused this rank and said why, after proving that it knows the job token: only
    /// then are a peer's words shown as rank 0's.
    #[error("rank 0 at {peer} refused this rank: {why}")]
    Refused {
        /// Rank 0's address.
        peer: String,
        /// Rank 0's reason, and what to check.
        why: String,
    },
    /// With no job token, the peer at rank 0's address refused this rank (a token on one side
    /// only, a rank outside the job): nothing proves that it is rank 0, so its words are shown
    /// as its own, quoted and marked unverified.
    #[error(
        "the peer at {peer} refused this rank, but nothing proves that it is rank 0 (only a job \
         token could), so its words are unverified: {said:?}. If rank 0 runs there, do what \
         they say; else check MASTER_ADDR and the port"
    )]
    UnprovenRefusal {
        /// The peer's address.
        peer: String,
        /// What it said (control characters removed, 512 bytes at most).
        said: String,
    },
    /// The peer did not prove that it knows the job token, or refused before it did (its words
    /// are not shown): the rank fails at once, without waiting for its timeout.
    #[error("{peer} {why}")]
    Unauthenticated {
        /// The peer's address.
        peer: String,
        /// What failed, and what to check.
        why: String,
    },
    /// Rank 0 could not create the Id.
    #[error("rank 0 could not create the communicator's Id: {0}")]
    Create(#[source] Box<dyn Error + Send + Sync + 'static>),
}
