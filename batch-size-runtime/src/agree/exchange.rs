//! Sharing a communicator's unique Id (128 bytes) between the ranks of a job, the two ways
//! jobs are launched: a file every rank can read (a shared folder, one machine or an NFS
//! mount), or the launcher's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`, as `torchrun`, Slurm scripts and MPI wrappers set them) with rank 0 handing
//! the Id over TCP.
//!
//! Rank 0 creates the Id (`ncclGetUniqueId`); the others receive the same bytes. Nothing here
//! depends on NCCL: it moves 128 bytes, and never waits longer than its timeout.
//!
//! ```
//! use std::thread;
//! use batch_size_runtime::agree::IdExchange;
//!
//! let path = std::env::temp_dir().join(format!("doc-nccl-id-{}", std::process::id()));
//! let ranks: Vec<_> = (0..3)
//!     .map(|rank| {
//!         let exchange = IdExchange::file(&path, rank, 3);
//!         thread::spawn(move || exchange.exchange(|| Ok::<_, std::io::Error>([7u8; 128])))
//!     })
//!     .collect();
//! for rank in ranks {
//!     assert_eq!(rank.join().unwrap()?, [7u8; 128]);
//! }
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), batch_size_runtime::agree::ExchangeError>(())
//! ```
//!
//! # Several machines
//! With the environment: every process gets `MASTER_ADDR` (the address of the machine of
//! rank 0, reachable from all), `MASTER_PORT`, its `RANK` and the `WORLD_SIZE`; rank 0 listens
//! on every interface. `torchrun`'s own agent already serves its store on `MASTER_PORT`, so
//! under `torchrun` (`TORCHELASTIC_USE_AGENT_STORE=True`) the exchange uses the next port;
//! `BATCH_SIZE_EXCHANGE_PORT` chooses another. With a file: a path on storage every machine
//! mounts, fresh for each job (put the job's id in it): rank 0 replaces the file atomically,
//! and a rank that started early could read an old one.

use std::error::Error;
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

/// The size of a communicator's unique Id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// The variable that chooses the port of the TCP exchange.
pub const EXCHANGE_PORT_VARIABLE: &str = "BATCH_SIZE_EXCHANGE_PORT";

/// What a client sends first, and rank 0 answers with: a peer that is not this exchange (the
/// launcher's own store, another service) is told apart at once.
const MAGIC: &[u8; 8] = b"BSIDXv1\n";

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
    /// Rank 0 could not create the Id.
    #[error("rank 0 could not create the communicator's Id: {0}")]
    Create(#[source] Box<dyn Error + Send + Sync + 'static>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Way {
    File(PathBuf),
    Tcp { host: String, port: u16 },
}

/// How the ranks of one job share the communicator's Id: [`file`](Self::file),
/// [`tcp`](Self::tcp) or [`from_env`](Self::from_env), then [`exchange`](Self::exchange) on
/// every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdExchange {
    way: Way,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    timeout: Duration,
}

impl IdExchange {
    /// How long a rank waits for the others by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// Rank 0 writes the Id to `path` atomically (a temporary file in the same folder, then a
    /// rename), as candle's multi-process NCCL example does; the others poll for the file until
    /// the timeout and read it. Use it when every rank sees one folder (one machine, or storage
    /// every machine mounts) and there is no launcher's environment.
    ///
    /// The path must be fresh for each job (put the job's id in it): rank 0 replaces an
    /// existing file, and a rank that starts before it would read the old job's Id.
    ///
    /// ```
    /// use batch_size_runtime::agree::IdExchange;
    /// let job = std::process::id(); // a scheduler's job id, in a real job
    /// let exchange = IdExchange::file(std::env::temp_dir().join(format!("nccl-id-{job}")), 1, 4);
    /// assert_eq!((exchange.rank(), exchange.world_size(), exchange.local_rank()), (1, 4, 1));
    /// ```
    pub fn file(path: impl Into<PathBuf>, rank: usize, world_size: usize) -> Self {
        IdExchange {
            way: Way::File(path.into()),
            rank,
            world_size,
            local_rank: rank,
            timeout: IdExchange::DEFAULT_TIMEOUT,
        }
    }

    /// Rank 0 listens on `port` on every interface (`0.0.0.0`) and hands the Id to the
    /// `world_size - 1` others, which connect to `host:port` (rank 0's address, reachable from
    /// every rank), retrying until the timeout since rank 0 may start after them.
    ///
    /// ```
    /// use std::thread;
    /// use batch_size_runtime::agree::IdExchange;
    ///
    /// let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    /// let other = thread::spawn(move || {
    ///     IdExchange::tcp("127.0.0.1", port, 1, 2).exchange(|| Ok::<_, std::io::Error>([0; 128]))
    /// });
    /// let id = IdExchange::tcp("127.0.0.1", port, 0, 2).exchange(|| Ok::<_, std::io::Error>([5; 128]))?;
    /// assert_eq!(other.join().unwrap()?, id);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tcp(host: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Self {
        IdExchange {
            way: Way::Tcp {
                host: host.into(),
                port,
            },
            rank,
            world_size,
            local_rank: rank,
            timeout: IdExchange::DEFAULT_TIMEOUT,
        }
    }

    /// The TCP exchange from the launcher's environment, as `torchrun` sets it: `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK` (the rank when absent), `MASTER_ADDR`, `MASTER_PORT`. The
    /// port: `BATCH_SIZE_EXCHANGE_PORT` if set; else `MASTER_PORT + 1` under `torchrun`
    /// (whose agent serves its store on `MASTER_PORT`, `TORCHELASTIC_USE_AGENT_STORE=True`);
    /// else `MASTER_PORT`.
    ///
    /// A missing or unparsable variable is an [`ExchangeError`] that names it, its value and
    /// what to set; a `RANK` not below `WORLD_SIZE` is [`ExchangeError::InvalidRank`].
    pub fn from_env() -> Result<Self, ExchangeError> {
        IdExchange::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) reading the variables through `lookup`: for tests, and for
    /// launchers that keep them elsewhere than in the process's environment.
    ///
    /// ```
    /// use batch_size_runtime::agree::IdExchange;
    /// let exchange = IdExchange::from_vars(|name| match name {
    ///     "RANK" => Some("3".into()),
    ///     "WORLD_SIZE" => Some("8".into()),
    ///     "LOCAL_RANK" => Some("1".into()),
    ///     "MASTER_ADDR" => Some("10.0.0.1".into()),
    ///     "MASTER_PORT" => Some("29500".into()),
    ///     _ => None,
    /// })?;
    /// assert_eq!((exchange.rank(), exchange.world_size(), exchange.local_rank()), (3, 8, 1));
    /// # Ok::<(), batch_size_runtime::agree::ExchangeError>(())
    /// ```
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ExchangeError> {
        const LAUNCHER: &str =
            "launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process";
        let required = |name: &'static str| {
            lookup(name)
                .filter(|value| !value.is_empty())
                .ok_or(ExchangeError::MissingVariable {
                    name,
                    hint: LAUNCHER,
                })
        };
        let number = |name: &'static str, value: String| {
            value
                .trim()
                .parse::<usize>()
                .map_err(|_| ExchangeError::InvalidVariable {
                    name,
                    value,
                    why: "a whole number is expected",
                })
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        let local_rank = match lookup("LOCAL_RANK").filter(|value| !value.is_empty()) {
            Some(value) => number("LOCAL_RANK", value)?,
            None => rank,
        };
        let host = required("MASTER_ADDR")?;
        let port = |name: &'static str, value: String| {
            value
                .trim()
                .parse::<u16>()
                .map_err(|_| ExchangeError::InvalidVariable {
                    name,
                    value,
                    why: "a port number (1 to 65535) is expected",
                })
        };
        let port = match lookup(EXCHANGE_PORT_VARIABLE).filter(|value| !value.is_empty()) {
            Some(value) => port(EXCHANGE_PORT_VARIABLE, value)?,
            None => {
                let master = port("MASTER_PORT", required("MASTER_PORT")?)?;
                let agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|value| value.eq_ignore_ascii_case("true"));
                if agent_store {
                    master.checked_add(1).ok_or(ExchangeError::InvalidVariable {
                        name: "MASTER_PORT",
                        value: master.to_string(),
                        why: "torchrun's agent holds it and there is no next port: set BATCH_SIZE_EXCHANGE_PORT",
                    })?
                } else {
                    master
                }
            }
        };
        let exchange = IdExchange {
            way: Way::Tcp { host, port },
            rank,
            world_size,
            local_rank,
            timeout: IdExchange::DEFAULT_TIMEOUT,
        };
        exchange.check()?;
        Ok(exchange)
    }

    /// How long to wait for the others (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)):
    /// a rank that died or never started ends the exchange with [`ExchangeError::Timeout`]
    /// instead of a hang.
    ///
    /// ```
    /// use std::time::Duration;
    /// use batch_size_runtime::agree::{ExchangeError, IdExchange};
    ///
    /// let nobody = std::env::temp_dir().join(format!("no-rank-0-{}", std::process::id()));
    /// let error = IdExchange::file(nobody, 1, 2)
    ///     .with_timeout(Duration::from_millis(50))
    ///     .exchange(|| Ok::<_, std::io::Error>([0; 128]))
    ///     .unwrap_err();
    /// assert!(matches!(error, ExchangeError::Timeout { rank: 1, .. }));
    /// ```
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This rank, from 0: rank 0 creates the Id.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks take part: rank 0 waits for `world_size - 1` others.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The GPU ordinal this process should use on its machine: `LOCAL_RANK` from the
    /// launcher's environment (several machines number their GPUs from 0 each); the rank for
    /// [`file`](Self::file) and [`tcp`](Self::tcp), which assume one machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn check(&self) -> Result<(), ExchangeError> {
        if self.rank >= self.world_size {
            return Err(ExchangeError::InvalidRank {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Rank 0 calls `create` (`ncclGetUniqueId`, say) and shares its bytes; every rank returns
    /// the same 128 bytes. `create` is called on rank 0 only, and its error comes back as
    /// [`ExchangeError::Create`]. With one rank nothing is written or opened.
    ///
    /// ```
    /// use batch_size_runtime::agree::IdExchange;
    /// // One rank: no socket is opened, so the port does not matter.
    /// let id = IdExchange::tcp("127.0.0.1", 1, 0, 1).exchange(|| Ok::<_, std::io::Error>([3; 128]))?;
    /// assert_eq!(id, [3; 128]);
    /// # Ok::<(), batch_size_runtime::agree::ExchangeError>(())
    /// ```
    pub fn exchange<E>(
        &self,
        create: impl FnOnce() -> Result<[u8; ID_BYTES], E>,
    ) -> Result<[u8; ID_BYTES], ExchangeError>
    where
        E: Into<Box<dyn Error + Send + Sync + 'static>>,
    {
        self.check()?;
        if self.rank == 0 {
            let id = create().map_err(|error| ExchangeError::Create(error.into()))?;
            if self.world_size > 1 {
                match &self.way {
                    Way::File(path) => write_file(path, &id)?,
                    Way::Tcp { port, .. } => self.serve(*port, &id)?,
                }
            }
            tracing::info!(ranks = self.world_size, way = %self, "communicator Id shared");
            return Ok(id);
        }
        let id = match &self.way {
            Way::File(path) => self.read_file(path)?,
            Way::Tcp { host, port } => self.fetch(host, *port)?,
        };
        tracing::info!(rank = self.rank, way = %self, "communicator Id received");
        Ok(id)
    }

    fn timeout_error(&self, waiting_for: String) -> ExchangeError {
        ExchangeError::Timeout {
            rank: self.rank,
            waited: self.timeout,
            waiting_for,
        }
    }

    /// Waits for rank 0's file.
    fn read_file(&self, path: &Path) -> Result<[u8; ID_BYTES], ExchangeError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match fs::read_to_string(path) {
                Ok(text) => return parse_hex(&text, path),
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(ExchangeError::Io {
                        what: format!("reading the Id from {}", path.display()),
                        source,
                    })
                }
            }
            if Instant::now() >= deadline {
                return Err(self.timeout_error(format!(
                    "rank 0 to write the Id to {}: is rank 0 running, with the same path?",
                    path.display()
                )));
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Rank 0: hands the Id to every other rank, then closes the port.
    fn serve(&self, port: u16, id: &[u8; ID_BYTES]) -> Result<(), ExchangeError> {
        let listener =
            TcpListener::bind(("0.0.0.0", port)).map_err(|source| ExchangeError::Io {
                what: format!(
                    "listening on port {port} to share the Id (a port in use: set \
                 {EXCHANGE_PORT_VARIABLE} to a free one, the same for every rank)"
                ),
                source,
            })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| ExchangeError::Io {
                what: "configuring the Id's socket".to_owned(),
                source,
            })?;
        tracing::debug!(
            port,
            ranks = self.world_size - 1,
            "waiting for the ranks to fetch the Id"
        );
        let deadline = Instant::now() + self.timeout;
        let mut served = vec![false; self.world_size];
        served[0] = true;
        while served.iter().any(|done| !done) {
            match listener.accept() {
                Ok((stream, peer)) => match hand_over(stream, id, self.world_size, deadline) {
                    Ok(rank) if !served[rank] => {
                        served[rank] = true;
                        tracing::debug!(rank, %peer, "communicator Id handed over");
                    }
                    Ok(rank) => tracing::warn!(rank, %peer, "rank asked for the Id twice"),
                    Err(why) => {
                        tracing::warn!(%peer, "not a rank of this job asking for the Id: {why}")
                    }
                },
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    thread::sleep(Duration::from_millis(5))
                }
                Err(error) => tracing::warn!("accepting a rank: {error}"),
            }
            if Instant::now() >= deadline && served.iter().any(|done| !done) {
                let missing: Vec<String> = served
                    .iter()
                    .enumerate()
                    .filter(|(_, done)| !**done)
                    .map(|(rank, _)| rank.to_string())
                    .collect();
                return Err(self.timeout_error(format!(
                    "ranks {} to fetch the Id on port {port}: are they running, with the same \
                     MASTER_ADDR and port?",
                    missing.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Another rank: connects to rank 0 (retrying while it is not up) and reads the Id.
    fn fetch(&self, host: &str, port: u16) -> Result<[u8; ID_BYTES], ExchangeError> {
        let deadline = Instant::now() + self.timeout;
        let peer = format!("{host}:{port}");
        let mut last_error = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = last_error.map(|error: io::Error| format!(" (last: {error})"));
                return Err(self.timeout_error(format!(
                    "rank 0 at {peer} to hand over the Id{}: is rank 0 running, and is \
                     MASTER_ADDR reachable from here?",
                    why.unwrap_or_default()
                )));
            }
            match connect(host, port, left.min(Duration::from_secs(2))) {
                Ok(stream) => return receive(stream, self.rank, left, &peer),
                Err(error) => last_error = Some(error),
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl fmt::Display for IdExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.way {
            Way::File(path) => write!(f, "file {}", path.display()),
            Way::Tcp { host, port } => write!(f, "tcp {host}:{port}"),
        }
    }
}

fn connect(host: &str, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing");
    for address in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&address, timeout.max(Duration::from_millis(1))) {
            Ok(stream) => return Ok(stream),
            Err(error) => last = error,
        }
    }
    Err(last)
}

/// Rank 0's side of one connection: checks the greeting, sends the Id; returns the rank.
fn hand_over(
    mut stream: TcpStream,
    id: &[u8; ID_BYTES],
    world_size: usize,
    deadline: Instant,
) -> io::Result<usize> {
    // A peer that connects and stays silent holds rank 0 (which serves one connection at a
    // time) for a few seconds at most, and never past its deadline.
    let patience = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), Duration::from_secs(5));
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(patience))?;
    stream.set_write_timeout(Some(patience))?;
    let mut greeting = [0u8; 12];
    stream.read_exact(&mut greeting)?;
    if &greeting[..8] != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "wrong greeting"));
    }
    let rank = u32::from_le_bytes([greeting[8], greeting[9], greeting[10], greeting[11]]) as usize;
    if rank == 0 || rank >= world_size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rank {rank} is not one of 1 to {}", world_size - 1),
        ));
    }
    let mut answer = Vec::with_capacity(MAGIC.len() + ID_BYTES);
    answer.extend_from_slice(MAGIC);
    answer.extend_from_slice(id);
    stream.write_all(&answer)?;
    let _ = stream.shutdown(Shutdown::Write);
    Ok(rank)
}

/// A rank's side: greets, reads the answer.
fn receive(
    mut stream: TcpStream,
    rank: usize,
    timeout: Duration,
    peer: &str,
) -> Result<[u8; ID_BYTES], ExchangeError> {
    let io_error = |source| ExchangeError::Io {
        what: format!("fetching the Id from rank 0 at {peer}"),
        source,
    };
    let timeout = Some(timeout.max(Duration::from_millis(1)));
    stream.set_read_timeout(timeout).map_err(io_error)?;
    stream.set_write_timeout(timeout).map_err(io_error)?;
    let rank = u32::try_from(rank).map_err(|_| ExchangeError::Malformed {
        from: peer.to_owned(),
        why: format!("rank {rank} is too large"),
    })?;
    let mut greeting = Vec::with_capacity(12);
    greeting.extend_from_slice(MAGIC);
    greeting.extend_from_slice(&rank.to_le_bytes());
    stream.write_all(&greeting).map_err(io_error)?;
    // The greeting is checked as soon as it is in: another service that answers something and
    // keeps the connection open is told apart at once, not at the timeout.
    let malformed = |why: &str| ExchangeError::Malformed {
        from: peer.to_owned(),
        why: why.to_owned(),
    };
    let read =
        |stream: &mut TcpStream, buffer: &mut [u8], short: &str| match stream.read_exact(buffer) {
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => Err(malformed(short)),
            other => other.map_err(io_error),
        };
    let mut magic = [0u8; MAGIC.len()];
    read(
        &mut stream,
        &mut magic,
        "it closed the connection without answering (is this rank in the job, below WORLD_SIZE?)",
    )?;
    if &magic != MAGIC {
        return Err(malformed(
            "it answered something else (is MASTER_PORT another service's, such as torchrun's \
             store? set BATCH_SIZE_EXCHANGE_PORT to a free port, the same for every rank)",
        ));
    }
    let mut id = [0u8; ID_BYTES];
    read(
        &mut stream,
        &mut id,
        "it closed the connection before the whole Id",
    )?;
    Ok(id)
}

/// Writes the Id as hex to a temporary file beside `path`, then renames it into place, so that
/// a reader sees the whole Id or nothing.
fn write_file(path: &Path, id: &[u8; ID_BYTES]) -> Result<(), ExchangeError> {
    let mut text = String::with_capacity(2 * ID_BYTES + 1);
    for byte in id {
        text.push_str(&format!("{byte:02x}"));
    }
    text.push('\n');
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "nccl-id".to_owned());
    let temporary = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let io_error = |source| ExchangeError::Io {
        what: format!(
            "writing the Id to {} (is the folder there and writable by rank 0?)",
            path.display()
        ),
        source,
    };
    fs::write(&temporary, text).map_err(io_error)?;
    fs::rename(&temporary, path).map_err(|source| {
        let _ = fs::remove_file(&temporary);
        io_error(source)
    })
}

fn parse_hex(text: &str, path: &Path) -> Result<[u8; ID_BYTES], ExchangeError> {
    let malformed = |why: String| ExchangeError::Malformed {
        from: path.display().to_string(),
        why,
    };
    let text = text.trim_end().as_bytes();
    if text.len() != 2 * ID_BYTES {
        return Err(malformed(format!(
            "{} characters where an Id has {} hex digits (remove the file if it is another \
             job's, and give each job its own path)",
            text.len(),
            2 * ID_BYTES
        )));
    }
    let mut id = [0u8; ID_BYTES];
    for (slot, pair) in id.iter_mut().zip(text.chunks_exact(2)) {
        // Digit by digit: `u8::from_str_radix` would also take a sign ("+f").
        let digit = |byte: u8| (byte as char).to_digit(16);
        match (digit(pair[0]), digit(pair[1])) {
            (Some(high), Some(low)) => *slot = (high * 16 + low) as u8,
            _ => {
                return Err(malformed(format!(
                    "{:?} is not a hex digit pair",
                    String::from_utf8_lossy(pair)
                )))
            }
        }
    }
    Ok(id)
}
