//! Sharing a communicator's Id between the ranks of a job through a file (the docs users read
//! are on [`IdExchange`]).

use std::collections::hash_map::RandomState;
use std::error::Error;
use std::fmt;
use std::fs;
use std::hash::BuildHasher;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

/// The size of a communicator's unique Id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// Why the Id could not be shared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// The rank is not below the world size.
    #[error(
        "rank {rank} is not one of the {world_size} ranks (the rank must be below the world size)"
    )]
    InvalidRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// Rank 0 did not write the Id in time.
    #[error("rank {rank} waited {waited:?} for {waiting_for}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// What it waited for, and what to check.
        waiting_for: String,
    },
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, and what to check.
        what: String,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// What was read is not an Id written by this exchange.
    #[error("{from} is not a batch-size Id exchange: {why}")]
    Malformed {
        /// The file.
        from: String,
        /// What was wrong.
        why: String,
    },
    /// Rank 0 could not create the Id.
    #[error("rank 0 could not create the communicator's Id: {0}")]
    Create(#[source] Box<dyn Error + Send + Sync + 'static>),
}

/// Sharing a communicator's unique Id (128 bytes) between the ranks of a job through a file
/// every rank can read: one machine, or storage every machine mounts, as candle's multi-process
/// NCCL example shares it. Rank 0 creates the Id (`ncclGetUniqueId`) and writes it; the others
/// poll for the file and read the same bytes.
///
/// The other ways to share it need nothing of this type: under `mpirun` or `srun`, `MpiJob`
/// (feature `mpi`) broadcasts it over the job's MPI; with a launcher that gives the program a
/// channel of its own (torchrun's store, say), send [`NcclId::as_bytes`](super::NcclId::as_bytes)
/// through it and rebuild the Id with [`NcclId::from_bytes`](super::NcclId::from_bytes).
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
/// A path on storage every machine mounts, fresh for each job (put the job's id in it): rank 0
/// replaces the file atomically, and a rank that started early could read an old one.
///
/// # Security
/// Whoever has the Id can join the communicator, so only the job's own ranks should read it.
/// Rank 0 creates the file readable and writable by its owner only (0600 on unix), but the
/// folder must not be writable by others: whoever can write there can replace the Id.
///
/// # Time limits
/// A rank waits for rank 0's file at most the exchange's timeout
/// ([`with_timeout`](IdExchange::with_timeout), [`DEFAULT_TIMEOUT`](IdExchange::DEFAULT_TIMEOUT)
/// unless set), then returns [`ExchangeError::Timeout`]. Rank 0's `create` is not bounded here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdExchange {
    path: PathBuf,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl IdExchange {
    /// How long a rank waits for the others by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// Rank 0 writes the Id to `path` atomically (a temporary file in the same folder, then a
    /// rename), as candle's multi-process NCCL example does; the others poll for the file until
    /// the timeout and read it. Every rank must see the same folder (one machine, or storage
    /// every machine mounts).
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
            path: path.into(),
            rank,
            world_size,
            timeout: IdExchange::DEFAULT_TIMEOUT,
        }
    }

    /// How long to wait for rank 0 (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)): a
    /// rank 0 that died or never started ends the exchange with [`ExchangeError::Timeout`]
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

    /// How many ranks take part.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The GPU ordinal this process should use on its machine, taken to be the rank: the file
    /// exchange knows nothing of how ranks are laid out across machines. On several machines,
    /// use the launcher's local rank instead (`LOCAL_RANK`, `SLURM_LOCALID`).
    pub fn local_rank(&self) -> usize {
        self.rank
    }

    /// An error unless the rank is one of the ranks.
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
    /// [`ExchangeError::Create`]. With one rank nothing is written.
    ///
    /// ```
    /// use batch_size_runtime::agree::IdExchange;
    /// // One rank: no file is written, so the path does not matter.
    /// let id = IdExchange::file("/nonexistent/nccl-id", 0, 1)
    ///     .exchange(|| Ok::<_, std::io::Error>([3; 128]))?;
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
                write_file(&self.path, &id)?;
            }
            tracing::info!(ranks = self.world_size, way = %self, "communicator Id shared");
            return Ok(id);
        }
        let id = self.read_file()?;
        tracing::info!(rank = self.rank, way = %self, "communicator Id received");
        Ok(id)
    }

    /// Waits for rank 0's file, until the timeout.
    fn read_file(&self) -> Result<[u8; ID_BYTES], ExchangeError> {
        let path = &self.path;
        let started = Instant::now();
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
            let waited = started.elapsed();
            if waited >= self.timeout {
                return Err(ExchangeError::Timeout {
                    rank: self.rank,
                    waited: self.timeout,
                    waiting_for: format!(
                        "rank 0 to write the Id to {}: is rank 0 running, with the same path?",
                        path.display()
                    ),
                });
            }
            thread::sleep(Duration::from_millis(10).min(self.timeout.saturating_sub(waited)));
        }
    }
}

impl fmt::Display for IdExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file {}", self.path.display())
    }
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
    let temporary = path.with_file_name(format!(
        ".{name}.{}.{:016x}.tmp",
        std::process::id(),
        unguessable()
    ));
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

/// A number another process cannot foresee: the clock hashed under the standard library's
/// randomly keyed SipHash (its keys come from the operating system's random numbers).
fn unguessable() -> u64 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    RandomState::new().hash_one(now)
}

/// The Id in rank 0's file: 256 hex digits, then a newline.
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
