//! Sharing a communicator's Id between the ranks of a job (the docs users read are on
//! [`IdExchange`]).

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use super::deadline::{self, Deadline};
use super::handshake::{self, Failure};
use super::token::{self, JobToken, Keyed};

pub use super::wire::{
    ExchangeError, CONNECTION_PATIENCE, EXCHANGE_PORT_VARIABLE, ID_BYTES, MAX_HELD_CONNECTIONS,
    TOKEN_VARIABLE,
};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Way {
    File(PathBuf),
    Tcp { host: String, port: u16 },
}

/// Sharing a communicator's unique Id (128 bytes) between the ranks of a job, the two ways
/// jobs are launched: a file every rank can read (a shared folder, one machine or an NFS
/// mount), or the launcher's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT`, as `torchrun`, Slurm scripts and MPI wrappers set them) with rank 0 handing
/// the Id over TCP.
///
/// Rank 0 creates the Id (`ncclGetUniqueId`); the others receive the same bytes. Nothing here
/// depends on NCCL: it moves 128 bytes, and returns by its timeout whatever a peer sends or how
/// slowly (see [Time limits](IdExchange#time-limits)).
///
/// ```
/// use std::thread;
/// use batch_size_runtime::agree::IdExchange;
///
/// let path = std::env::temp_dir().join(format!("doc-nccl-id-{}", std::process::id()));
/// let ranks: Vec<_> = (0..3)
///     .map(|rank| {
///         let exchange = IdExchange::file(&path, rank, 3);
///         thread::spawn(move || exchange.exchange(|| Ok::<_, std::io::Error>([7u8; 128])))
///     })
///     .collect();
/// for rank in ranks {
///     assert_eq!(rank.join().unwrap()?, [7u8; 128]);
/// }
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), batch_size_runtime::agree::ExchangeError>(())
/// ```
///
/// # Several machines
/// With the environment: every process gets `MASTER_ADDR` (the address of the machine of
/// rank 0, reachable from all), `MASTER_PORT`, its `RANK` and the `WORLD_SIZE`; rank 0 listens
/// on every interface. `torchrun`'s own agent already serves its store on `MASTER_PORT`, so
/// under `torchrun` (`TORCHELASTIC_USE_AGENT_STORE=True`) the exchange uses the next port;
/// `BATCH_SIZE_EXCHANGE_PORT` chooses another. With a file: a path on storage every machine
/// mounts, fresh for each job (put the job's id in it): rank 0 replaces the file atomically,
/// and a rank that started early could read an old one.
///
/// # Security
/// Whoever has the Id can join the communicator, so only the job's own ranks should get it.
/// Over TCP, set a job token: [`BATCH_SIZE_EXCHANGE_TOKEN`](TOKEN_VARIABLE) (read by
/// [`from_env`](IdExchange::from_env)) or [`with_token`](IdExchange::with_token), the same secret
/// on every rank. Rank 0 and each rank then prove to each other that they know it, without
/// sending it: each side sends a fresh random nonce, and answers with an HMAC-SHA-256 of both
/// nonces and the rank under the token; a rank checks rank 0's answer before it trusts anything,
/// and the Id travels masked and tagged under the same key.
///
/// Rank 0 drops a peer that fails (another token, no token, an answer recorded from an earlier
/// connection) with a WARN naming its address, tells it so at once (it learns nothing it did
/// not know: that its proof failed), and goes on serving the others. A rank that meets a peer
/// which does not prove the token (rank 0 with another token or none, a process posing as rank
/// 0) takes nothing from it, sends it no proof of its own, only that its proof failed (so a
/// rank 0 with another token logs why at once), and stops with
/// [`ExchangeError::Unauthenticated`] naming [`BATCH_SIZE_EXCHANGE_TOKEN`](TOKEN_VARIABLE): it
/// does not try again until its timeout, since another token is a setting that no retry
/// mends. The price: a process that answers on rank 0's port before rank 0 can end a rank's
/// exchange early, which it could do anyway by keeping the port; it never gets the Id nor
/// gives a wrong one.
///
/// A refusal is shown in rank 0's words ([`ExchangeError::Refused`]) only once rank 0 has
/// proved the token. Before that, with a token, its words are not shown at all
/// ([`ExchangeError::Unauthenticated`] lists the likely causes in this crate's own words);
/// without a token, where nothing can be proved, they are quoted as the peer's, marked
/// unverified ([`ExchangeError::UnprovenRefusal`]).
///
/// Without a token, the exchange works as before: on one machine (`MASTER_ADDR` a loopback
/// address) rank 0 listens on loopback only; on any other address it logs one WARN, since any
/// process that reaches the port can then take the Id or a rank's place.
///
/// The token can come from the launcher's run id, which every rank of a job shares: torchrun
/// sets `TORCHELASTIC_RUN_ID` to `--rdzv-id` (its default, `none`, is no secret; give each job a
/// random one, say `--rdzv-id=$(openssl rand -hex 16)`, and keep in mind that a command line is
/// visible to the machine's other users):
///
/// ```no_run
/// use batch_size_runtime::agree::IdExchange;
/// let run_id = std::env::var("TORCHELASTIC_RUN_ID")?;
/// let exchange = IdExchange::from_env()?.with_token(format!("batch-size {run_id}"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// No peer can stall the others: rank 0 serves each connection on its own thread, gives each
/// [`CONNECTION_PATIENCE`] at most, and holds [`MAX_HELD_CONNECTIONS`] at once (a new one
/// closes the one held longest).
///
/// # Time limits
/// Each limit is a deadline over every read and write it covers, not a limit per read: the
/// socket's timeout is set from the time left before each one, so a peer that sends one byte
/// at a time, just often enough, gains nothing.
///
/// - **The exchange** ([`with_timeout`](IdExchange::with_timeout), 120 s by default): a rank
///   returns by it, and so does rank 0, closing every connection it still holds. Over by a few
///   milliseconds at most (the accept loop's pause of 2 ms, a socket's timer); the tests measure
///   1.50 to 1.53 s for 1.5 s against peers trickling a byte every 400 ms.
/// - **One connection** ([`CONNECTION_PATIENCE`], 5 s, or
///   [`with_connection_patience`](IdExchange::with_connection_patience)): rank 0 closes a
///   connection that long after accepting it; a rank gives up a try that long after it began,
///   connecting included, and tries again while its timeout lasts. Both end with the exchange
///   at the latest.
/// - **Not bounded here:** resolving `MASTER_ADDR` (the system's resolver decides how long),
///   and rank 0's `create`.
///
/// When `accept` fails (out of file descriptors, say), rank 0 pauses before the next try, from
/// 10 ms doubling to 1 s (never past its deadline), and logs each kind of error once.
///
/// With a file, rank 0 creates it readable and writable by its owner only (0600 on unix), but
/// the folder must not be writable by others: whoever can write there can replace the Id.
///
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
    patience: Duration,
    token: Option<JobToken>,
}

impl IdExchange {
    /// How long a rank waits for the others by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// An exchange by `way`, with the defaults.
    fn new(way: Way, rank: usize, world_size: usize) -> Self {
        IdExchange {
            way,
            rank,
            world_size,
            local_rank: rank,
            timeout: IdExchange::DEFAULT_TIMEOUT,
            patience: CONNECTION_PATIENCE,
            token: None,
        }
    }

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
        IdExchange::new(Way::File(path.into()), rank, world_size)
    }

    /// Rank 0 listens on `port` and hands the Id to the `world_size - 1` others, which connect
    /// to `host:port` (rank 0's address, reachable from every rank), retrying until the timeout
    /// since rank 0 may start after them. Rank 0 listens on loopback when `host` is a loopback
    /// address (one machine), else on every interface (`0.0.0.0`): then set a job token with
    /// [`with_token`](Self::with_token) (see [Security](IdExchange#security)).
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
        let way = Way::Tcp {
            host: host.into(),
            port,
        };
        IdExchange::new(way, rank, world_size)
    }

    /// The TCP exchange from the launcher's environment, as `torchrun` sets it: `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK` (the rank when absent), `MASTER_ADDR`, `MASTER_PORT`. The
    /// port: `BATCH_SIZE_EXCHANGE_PORT` if set; else `MASTER_PORT + 1` under `torchrun`
    /// (whose agent serves its store on `MASTER_PORT`, `TORCHELASTIC_USE_AGENT_STORE=True`);
    /// else `MASTER_PORT`.
    ///
    /// The job token: [`BATCH_SIZE_EXCHANGE_TOKEN`](TOKEN_VARIABLE) when it is set and not
    /// empty (see [Security](IdExchange#security)).
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
        // A variable's value read as `T`, or why not.
        fn parsed<T: std::str::FromStr>(
            name: &'static str,
            value: String,
            why: &'static str,
        ) -> Result<T, ExchangeError> {
            value
                .trim()
                .parse::<T>()
                .map_err(|_| ExchangeError::InvalidVariable { name, value, why })
        }
        let number = |name: &'static str, value: String| {
            parsed::<usize>(name, value, "a whole number is expected")
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        let local_rank = match lookup("LOCAL_RANK").filter(|value| !value.is_empty()) {
            Some(value) => number("LOCAL_RANK", value)?,
            None => rank,
        };
        let host = required("MASTER_ADDR")?;
        let port = |name: &'static str, value: String| {
            parsed::<u16>(name, value, "a port number (1 to 65535) is expected")
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
            patience: CONNECTION_PATIENCE,
            token: lookup(TOKEN_VARIABLE)
                .filter(|value| !value.is_empty())
                .map(JobToken::new),
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

    /// How long one connection may last over TCP (default [`CONNECTION_PATIENCE`], 5 s),
    /// whatever the peer sends and however slowly: rank 0 closes a connection this long after
    /// accepting it, and a rank gives up a try this long after it began, then tries again
    /// while its timeout lasts. Longer for links slow to answer; never longer than the
    /// exchange's timeout, which ends every connection too. A zero is taken as 1 ms.
    ///
    /// ```
    /// use std::time::Duration;
    /// use batch_size_runtime::agree::IdExchange;
    /// let exchange = IdExchange::tcp("10.0.0.1", 29500, 1, 4)
    ///     .with_connection_patience(Duration::from_secs(10));
    /// # let _ = exchange;
    /// ```
    pub fn with_connection_patience(mut self, patience: Duration) -> Self {
        self.patience = patience.max(Duration::from_millis(1));
        self
    }

    /// A secret every rank of the job shares (the same bytes on every rank): over TCP, rank 0
    /// and each rank prove to each other that they know it before the Id is handed over, and a
    /// peer that does not is dropped (see [Security](IdExchange#security)). It replaces the one
    /// [`from_env`](Self::from_env) read from [`BATCH_SIZE_EXCHANGE_TOKEN`](TOKEN_VARIABLE).
    /// The file exchange does not use it. `Debug` does not show it.
    ///
    /// # Default
    /// No token: any process that reaches rank 0's port can take part.
    ///
    /// ```
    /// use std::thread;
    /// use batch_size_runtime::agree::IdExchange;
    ///
    /// let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    /// let rank = |rank| IdExchange::tcp("127.0.0.1", port, rank, 2).with_token("job 4711 secret");
    /// let other = rank(1);
    /// let other = thread::spawn(move || other.exchange(|| Ok::<_, std::io::Error>([0; 128])));
    /// let id = rank(0).exchange(|| Ok::<_, std::io::Error>([5; 128]))?;
    /// assert_eq!(other.join().unwrap()?, id);
    /// assert!(rank(0).has_token() && !format!("{:?}", rank(0)).contains("4711"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_token(mut self, token: impl AsRef<[u8]>) -> Self {
        self.token = Some(JobToken::new(token));
        self
    }

    /// Whether a job token is set ([`with_token`](Self::with_token), or
    /// [`BATCH_SIZE_EXCHANGE_TOKEN`](TOKEN_VARIABLE) for [`from_env`](Self::from_env)).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
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
                    Way::Tcp { host, port } => self.serve(host, *port, &id)?,
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
        let deadline = Deadline::after(self.timeout);
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
            if deadline.passed() {
                return Err(self.timeout_error(format!(
                    "rank 0 to write the Id to {}: is rank 0 running, with the same path?",
                    path.display()
                )));
            }
            thread::sleep(Duration::from_millis(10).min(deadline.left()));
        }
    }

    /// Rank 0: hands the Id to every other rank, then closes the port. Each connection is
    /// served on its own thread with its own deadline (the patience after it was accepted, the
    /// exchange's at the latest), so that a silent, slow or trickling peer costs the ranks
    /// nothing; at most [`MAX_HELD_CONNECTIONS`] are held at once. Returns by the exchange's
    /// deadline (give or take a pause of the accept loop, 2 ms, or of a failing accept, 1 s at
    /// most but never past the deadline).
    fn serve(&self, host: &str, port: u16, id: &[u8; ID_BYTES]) -> Result<(), ExchangeError> {
        let (listener, key) = self.listen(host, port)?;
        let serving = Arc::new(Serving {
            id: *id,
            world_size: self.world_size,
            key,
        });
        tracing::debug!(
            port,
            ranks = self.world_size - 1,
            token = self.token.is_some(),
            "waiting for the ranks to fetch the Id"
        );
        let deadline = Deadline::after(self.timeout);
        let mut trouble = AcceptTrouble::default();
        let (report, reports) = mpsc::channel();
        let mut held = Held::default();
        let mut served = vec![false; self.world_size];
        served[0] = true;
        let outcome = loop {
            held.take_reports(&reports, &mut served);
            if served.iter().all(|done| *done) {
                break Ok(());
            }
            // Checked before accepting: a flood of connections cannot keep rank 0 past it.
            if deadline.passed() {
                break Err(self.ranks_missing(&served, port));
            }
            match listener.accept() {
                Ok((stream, peer)) => {
                    trouble.recovered();
                    // From the accept: a peer's time does not start when its thread does.
                    let until = Deadline::after(self.patience).min(deadline);
                    held.admit(stream, peer, until, self.patience, &serving, &report);
                    // No pause: others may be waiting in the backlog.
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    thread::sleep(Duration::from_millis(2).min(deadline.left()))
                }
                Err(error) => thread::sleep(trouble.failed(&error).min(deadline.left())),
            }
        };
        trouble.summarize(port);
        // Whoever is still connected (a stranger, a rank asking twice) is done with.
        held.close_all();
        outcome
    }

    /// Rank 0's listening socket for the Id, non-blocking, and the token's key where there is
    /// one (a WARN where none guards a port other machines may reach).
    fn listen(&self, host: &str, port: u16) -> Result<(TcpListener, Option<Keyed>), ExchangeError> {
        let address = listen_address(host);
        let listener = TcpListener::bind((address, port)).map_err(|source| ExchangeError::Io {
            what: format!(
                "listening on {address}:{port} to share the Id (a port in use: set \
                 {EXCHANGE_PORT_VARIABLE} to a free one, the same for every rank)"
            ),
            source,
        })?;
        if self.token.is_none() && !address.is_loopback() {
            tracing::warn!(
                %address,
                port,
                "rank 0 shares the communicator's Id with no job token on a port other machines \
                 may reach: any process that reaches it can take part (take the Id, or a rank's \
                 place). Set {TOKEN_VARIABLE} to the same secret on every rank, e.g. derived from \
                 the launcher's run id, or call IdExchange::with_token"
            );
        }
        let configure = |source| ExchangeError::Io {
            what: "configuring the Id's socket".to_owned(),
            source,
        };
        listener.set_nonblocking(true).map_err(configure)?;
        let key = match &self.token {
            Some(token) => Some(token.keyed().map_err(configure)?),
            None => None,
        };
        Ok((listener, key))
    }

    /// The exchange's timeout, naming the ranks that never fetched the Id.
    fn ranks_missing(&self, served: &[bool], port: u16) -> ExchangeError {
        let missing: Vec<String> = served
            .iter()
            .enumerate()
            .filter(|(_, done)| !**done)
            .map(|(rank, _)| rank.to_string())
            .collect();
        self.timeout_error(format!(
            "ranks {} to fetch the Id on port {port}: are they running, with the same \
             MASTER_ADDR and port{}?",
            missing.join(", "),
            if self.token.is_some() {
                " and the same job token"
            } else {
                ""
            }
        ))
    }

    /// Another rank: connects to rank 0 (retrying while it is not up) and reads the Id. Each
    /// try has its own deadline (the patience, the exchange's deadline at the latest) over all
    /// its reads and writes, connecting included: the exchange ends by its timeout whatever a
    /// peer sends, or how slowly.
    ///
    /// A try that fails on the way (nobody listens yet, the connection closed or ran out of
    /// time) is tried again. A peer that answers wrong is an error at once, with a token too:
    /// one that does not prove the token fails the same way on every try (another token on
    /// rank 0 is a setting, not a passing fault), so waiting for the timeout would only delay
    /// the error, with a WARN a second. A process posing as rank 0 can end a rank's exchange
    /// so, as it could by keeping rank 0's port; it never gets the Id or gives a wrong one.
    fn fetch(&self, host: &str, port: u16) -> Result<[u8; ID_BYTES], ExchangeError> {
        let deadline = Deadline::after(self.timeout);
        let peer = format!("{host}:{port}");
        let key = match &self.token {
            Some(token) => Some(token.keyed().map_err(|source| ExchangeError::Io {
                what: "preparing the job token".to_owned(),
                source,
            })?),
            None => None,
        };
        let mut last_error = None;
        let pause = Duration::from_millis(20);
        loop {
            if deadline.passed() {
                let why = last_error.map(|error: io::Error| format!(" (last: {error})"));
                return Err(self.timeout_error(format!(
                    "rank 0 at {peer} to hand over the Id{}: is rank 0 running, and is \
                     MASTER_ADDR reachable from here?",
                    why.unwrap_or_default()
                )));
            }
            let attempt = Deadline::after(self.patience).min(deadline);
            match connect(host, port, attempt.left()) {
                Ok(stream) => {
                    match handshake::receive(stream, self.rank, key.as_ref(), attempt, &peer) {
                        Ok(id) => return Ok(id),
                        // "Resource temporarily unavailable" would say nothing of a peer
                        // too slow for the try's deadline.
                        Err(Failure::Io(error)) if deadline::is_timeout(&error) => {
                            last_error = Some(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!(
                                    "it did not finish a try within {:?}",
                                    self.patience.min(self.timeout)
                                ),
                            ))
                        }
                        Err(Failure::Io(error)) => last_error = Some(error),
                        Err(Failure::Peer(error) | Failure::Local(error)) => return Err(error),
                    }
                }
                Err(error) => last_error = Some(error),
            }
            thread::sleep(pause.min(deadline.left()));
        }
    }
}

/// What rank 0 does about `accept` failing (out of file descriptors, say): each kind of error
/// is logged once, not once per try, and the pause between tries grows from 10 ms to 1 s, so a
/// lasting failure neither spins the loop nor floods the log.
#[derive(Debug, Default)]
struct AcceptTrouble {
    pause: Duration,
    seen: Vec<io::ErrorKind>,
    failures: u64,
}

impl AcceptTrouble {
    const FIRST_PAUSE: Duration = Duration::from_millis(10);
    const LONGEST_PAUSE: Duration = Duration::from_secs(1);

    /// Logs `error` if its kind is new, and returns how long to pause before the next try.
    fn failed(&mut self, error: &io::Error) -> Duration {
        self.failures += 1;
        if !self.seen.contains(&error.kind()) {
            self.seen.push(error.kind());
            tracing::warn!(
                kind = ?error.kind(),
                %error,
                "rank 0 could not accept a connection; trying again with pauses growing to \
                 {:?} (logged once for this kind of error; if it lasts, raise the limit on \
                 open files, ulimit -n)",
                Self::LONGEST_PAUSE
            );
        }
        self.pause = (self.pause * 2).clamp(Self::FIRST_PAUSE, Self::LONGEST_PAUSE);
        self.pause
    }

    /// A connection came: the next failure pauses briefly again (its kind is still not logged
    /// twice).
    fn recovered(&mut self) {
        self.pause = Duration::ZERO;
    }

    /// One line at the end for the failures not logged one by one.
    fn summarize(&self, port: u16) {
        if self.failures > 0 {
            tracing::debug!(
                port,
                failures = self.failures,
                kinds = ?self.seen,
                "accepting connections failed during the exchange"
            );
        }
    }
}

/// Where rank 0 listens: loopback when `host` is only loopback addresses (one machine), so
/// nothing outside the machine can reach it; else every interface.
fn listen_address(host: &str) -> IpAddr {
    let every = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    let Ok(addresses) = (host, 0).to_socket_addrs() else {
        return every;
    };
    let addresses: Vec<SocketAddr> = addresses.collect();
    if addresses.is_empty() || !addresses.iter().all(|address| address.ip().is_loopback()) {
        return every;
    }
    addresses
        .iter()
        .map(SocketAddr::ip)
        .find(IpAddr::is_ipv4)
        .unwrap_or(addresses[0].ip())
}

/// What every connection's thread needs.
struct Serving {
    id: [u8; ID_BYTES],
    world_size: usize,
    key: Option<Keyed>,
}

/// The connections rank 0 is serving, oldest first: closed when too many are held at once or
/// when the exchange is over.
#[derive(Default)]
struct Held {
    streams: BTreeMap<u64, TcpStream>,
    accepted: u64,
}

impl Held {
    /// Serves an accepted connection on a thread of its own, until `until`; the oldest held is
    /// closed first where [`MAX_HELD_CONNECTIONS`] are.
    fn admit(
        &mut self,
        stream: TcpStream,
        peer: SocketAddr,
        until: Deadline,
        patience: Duration,
        serving: &Arc<Serving>,
        report: &mpsc::Sender<Served>,
    ) {
        if self.streams.len() >= MAX_HELD_CONNECTIONS {
            if let Some((_, oldest)) = self.streams.pop_first() {
                let _ = oldest.shutdown(Shutdown::Both);
                tracing::warn!(
                    held = MAX_HELD_CONNECTIONS,
                    "too many connections to the Id exchange at once: closed the one held longest"
                );
            }
        }
        let connection = self.accepted;
        self.accepted += 1;
        let hand_over = HandOver {
            connection,
            peer,
            deadline: until,
            patience,
        };
        match spawn_hand_over(stream, hand_over, serving, report) {
            Ok(stream) => {
                self.streams.insert(connection, stream);
            }
            Err(error) => tracing::warn!(%peer, "serving a peer: {error}"),
        }
    }

    /// What the connections' threads reported: the ranks served (each once), the peers dropped.
    fn take_reports(&mut self, reports: &mpsc::Receiver<Served>, served: &mut [bool]) {
        while let Ok(Served {
            connection,
            peer,
            outcome,
        }) = reports.try_recv()
        {
            self.streams.remove(&connection);
            match outcome {
                Ok(rank) if !served[rank] => {
                    served[rank] = true;
                    tracing::debug!(rank, %peer, "communicator Id handed over");
                }
                Ok(rank) => tracing::warn!(rank, %peer, "rank asked for the Id twice"),
                Err(why) => tracing::warn!(%peer, "dropped a peer asking for the Id: {why}"),
            }
        }
    }

    fn close_all(&self) {
        for stream in self.streams.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// A connection's thread's report to rank 0: the rank it served, or why it dropped the peer.
struct Served {
    connection: u64,
    peer: SocketAddr,
    outcome: Result<usize, String>,
}

/// One accepted connection: its number, its peer, and when it must be over.
struct HandOver {
    connection: u64,
    peer: SocketAddr,
    deadline: Deadline,
    patience: Duration,
}

/// Serves one connection on a thread of its own; returns a handle to close it early with.
fn spawn_hand_over(
    stream: TcpStream,
    hand_over: HandOver,
    serving: &Arc<Serving>,
    report: &mpsc::Sender<Served>,
) -> io::Result<TcpStream> {
    let handle = stream.try_clone()?;
    let serving = Arc::clone(serving);
    let report = report.clone();
    thread::Builder::new()
        .name("batch-size-id-exchange".to_owned())
        .stack_size(256 << 10)
        .spawn(move || {
            let outcome = handshake::hand_over(
                stream,
                &serving.id,
                serving.world_size,
                serving.key.as_ref(),
                hand_over.deadline,
                hand_over.patience,
            );
            // Rank 0 may be gone (timed out): nobody to tell.
            let _ = report.send(Served {
                connection: hand_over.connection,
                peer: hand_over.peer,
                outcome,
            });
        })?;
    Ok(handle)
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

/// Writes the Id as hex to a temporary file beside `path`, created new and readable by its
/// owner only (0600 on unix), then renames it into place, so that a reader sees the whole Id or
/// nothing, and no other user sees it at all.
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
    let io_error = |source| ExchangeError::Io {
        what: format!(
            "writing the Id to {} (is the folder there and writable by rank 0?)",
            path.display()
        ),
        source,
    };
    // A name no one can guess, created new: nothing that waits at that name (a file another
    // user left, a link) is written through.
    let unique = token::nonce().map_err(io_error)?;
    let unique: String = unique[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let temporary = path.with_file_name(format!(".{name}.{}.{unique}.tmp", std::process::id()));
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = options
        .open(&temporary)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .and_then(|()| fs::rename(&temporary, path));
    written.map_err(|source| {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_accepts_pause_longer_and_longer_and_log_each_kind_once() {
        let mut trouble = AcceptTrouble::default();
        let out_of_files = io::Error::from_raw_os_error(24); // EMFILE
        let pauses: Vec<Duration> = (0..10).map(|_| trouble.failed(&out_of_files)).collect();
        let millis: Vec<u128> = pauses.iter().map(Duration::as_millis).collect();
        assert_eq!(
            millis,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000],
            "growing, bounded"
        );
        assert_eq!(trouble.seen.len(), 1, "one kind, logged once");
        trouble.failed(&io::Error::from(io::ErrorKind::ConnectionAborted));
        assert_eq!(trouble.seen.len(), 2, "a new kind is logged");
        trouble.recovered();
        assert_eq!(trouble.failed(&out_of_files), Duration::from_millis(10));
        assert_eq!(
            trouble.seen.len(),
            2,
            "a kind seen before is not logged again"
        );
        assert_eq!(trouble.failures, 12);
    }
}
