//! The agreement over MPI (feature `mpi`), for jobs launched with `mpirun`, `mpiexec` or
//! `srun`: the ranks agree on the CPU through the job's own MPI, with no GPU and no NCCL, and
//! with `nccl` too, rank 0's NCCL Id reaches the other ranks by an MPI broadcast.
//! The documentation is [`MpiJob`]'s.

use std::fmt;
use std::io::Write;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use ::mpi::collective::SystemOperation;
use ::mpi::environment::{Threading, Universe};
use ::mpi::ffi;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{AsRaw, Communicator, CommunicatorCollectives, FromRaw, Root};

use super::collective::{AgreementError, Collective, ReduceOp};
#[cfg(feature = "nccl")]
use super::nccl::{NcclError, NcclId, NcclRank};

/// Why MPI could not be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MpiError {
    /// Another [`MpiJob`] of this process is alive: one job a process.
    #[error(
        "another MpiJob of this process is alive: create one, at the start of `main`, and take \
         as many agreements from it as you need"
    )]
    AlreadyInitialized,
    /// MPI was finalized already (by an `MpiJob` that was dropped, or by code of yours): MPI
    /// cannot start twice in one process.
    #[error(
        "MPI is finalized already (an MpiJob was dropped, or your code finalized MPI), and MPI \
         cannot start twice in one process: create one MpiJob at the start of `main` and keep \
         it until the end"
    )]
    Finalized,
    /// [`MpiJob::init_with_timeout`] was given no time: every collective would give up at
    /// once and end the job.
    #[error(
        "the agreement's timeout is zero: every rank would give up on the others at once and \
         abort the job; give the longest a rank may wait for the others (MpiJob::init uses \
         MpiJob::DEFAULT_TIMEOUT, 120 s)"
    )]
    ZeroTimeout,
    /// The MPI library cannot serve calls from several threads, or your code initialized it
    /// for one thread only.
    #[error(
        "the MPI library provides thread level {provided}; the agreement needs \
         MPI_THREAD_SERIALIZED at least (MPICH and Open MPI both provide MPI_THREAD_MULTIPLE; \
         where your code initializes MPI, ask for it: MPI_Init_thread, or the `mpi` crate's \
         initialize_with_threading(Threading::Multiple))"
    )]
    ThreadLevel {
        /// What the library provides.
        provided: &'static str,
    },
    /// The broadcast of the Id could not run (MPI is finalized).
    #[error(transparent)]
    Agreement(#[from] AgreementError),
    /// Rank 0 could not create the NCCL Id (its own error says why).
    #[error("rank 0 could not create the NCCL Id; its stderr or its error says why")]
    NoIdFromRankZero,
    /// NCCL failed: creating the Id on rank 0, or joining the communicator.
    #[cfg(feature = "nccl")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
    #[error(transparent)]
    Nccl(#[from] NcclError),
}

/// The MPI job this process is one rank of: `MPI_Init` when created, `MPI_Finalize` when
/// dropped, or `MPI_Abort` when dropped by a panicking thread. Create one, in `main`;
/// [`agreement`](Self::agreement) gives the [`Collective`] a search agrees through. Where your
/// program initialized MPI itself, the job adopts it and leaves finalizing to you (see
/// [`init`](Self::init)).
///
/// ```no_run
/// use batch_size_runtime::agree::{safe_point, MpiJob, MpiRank};
/// use batch_size_runtime::find_executable_batch_size;
///
/// #[find_executable_batch_size(starting = 512, agree = rank)]
/// fn train(batch_size: usize, rank: &MpiRank) -> anyhow::Result<usize> {
///     let forward_backward: anyhow::Result<()> = Ok(()); // may run out of memory
///     safe_point(rank, forward_backward.is_err())?; // before any collective of the step
///     forward_backward?;
///     Ok(batch_size)
/// }
///
/// fn main() -> anyhow::Result<()> {
///     // mpiexec -n 4 ./train: MPI_Init here; MPI_Finalize when `job` is dropped, unless this
///     // rank is panicking: then MPI_Abort, so that no rank waits for it.
///     let job = MpiJob::init()?;
///     let rank = job.agreement();
///     let batch_size = train(&rank)?;
///     println!("rank {} of {}: {batch_size}", job.rank(), job.world_size());
///     Ok(())
/// }
/// ```
///
/// # Nobody hangs
/// MPI's own collectives wait for ever for a rank that never comes, and a rank that unwinds
/// past `MPI_Finalize` waits for the ranks still inside a collective (rsmpi's issue 197). So:
/// - every collective here is non-blocking (`MPI_Iallreduce`, `MPI_Ibcast`, `MPI_Comm_idup`)
///   and polled against the job's timeout ([`MpiJob::DEFAULT_TIMEOUT`] unless
///   [`MpiJob::init_with_timeout`]);
/// - past it, the rank prints why on its stderr (one line naming the rank, the collective and
///   the wait) and ends the whole job with `MPI_Abort`: an MPI collective once started cannot be
///   withdrawn from, so the job could not go on anyway. [`AgreementError::Timeout`] is
///   therefore never returned by an [`MpiRank`]: its message is that line on stderr, and the job
///   ends with the launcher reporting the abort;
/// - an [`MpiJob`] dropped while its thread panics (a panic unwinding out of `main`) prints so
///   and calls `MPI_Abort`, never `MPI_Finalize`. Keep the job in `main`, alive until the end.
///   An out-of-memory panic inside an attempt is caught by the search and retried like any
///   out-of-memory, on every rank; any other panic there is first told to the other ranks (as
///   with every collective) and then unwinds on, out of `main` and through the job, which
///   aborts.
///
/// A rank that exits, or returns from `main` while the others still agree, ends the job too:
/// the others give up at their timeout and abort, so every rank has ended within the timeout
/// plus the launcher's time to stop the processes (MPICH's `mpiexec`: well under 2 s).
///
/// # Trust
/// MPI trusts whoever launched the job: every process `mpiexec` or `srun` started is a rank,
/// and nothing here checks who it is (the launcher already decided who takes part).
///
/// # Threads
/// MPI is initialized with `MPI_THREAD_MULTIPLE` (`MPI_THREAD_SERIALIZED` at least is needed),
/// so an [`MpiRank`] may be used from any thread. Each [`agreement`](Self::agreement) is a
/// communicator of its own (a duplicate of the job's duplicate of `MPI_COMM_WORLD`), so it
/// never meets the collectives of your training nor another agreement's: two searches running
/// at once on two threads each take one, in the same order on every rank, and each gets its
/// own rounds. One agreement serves one search at a time. An `MpiRank` owns what it needs (it
/// is `'static`, like a `ThreadRank`); used after its job was dropped, it returns
/// [`AgreementError::Failed`] saying so.
pub struct MpiJob {
    /// `None` once finalized, and where MPI was initialized by the program (adopted): the
    /// program finalizes it then.
    universe: Option<Universe>,
    shared: Arc<Shared>,
    /// The job's own duplicate of the world: the NCCL Id's broadcast, and each agreement's
    /// duplicate of it.
    own: Arc<Channel>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// `MPI_Finalize` must be called by the thread that initialized MPI: the job stays on it.
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for MpiJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiJob")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What the job and its agreements share: whether the job is alive, one MPI call at a time,
/// and how MPI was initialized.
struct Shared {
    /// `false` once the job is dropped. Every collective holds it for reading while it runs;
    /// the job's drop takes it for writing, so no collective starts after it and MPI is not
    /// finalized under one.
    alive: RwLock<bool>,
    /// Taken for each MPI call (`MPI_THREAD_SERIALIZED` asks no more), never across a whole
    /// collective: agreements on several threads each make progress while they wait.
    calls: Mutex<()>,
    /// `MPI_THREAD_MULTIPLE`: a rank may abort the job while another thread is in a call.
    multiple: bool,
    /// MPI was initialized by the program, not by the job: the program finalizes it.
    adopted: bool,
}

impl Shared {
    fn call(&self) -> MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One communicator of the job, with its collectives one at a time: the job's own (the NCCL
/// Id's broadcast, duplicating new agreements) or one agreement's.
struct Channel {
    job: Arc<Shared>,
    /// `None` where MPI was finalized (by the program) before the agreement was taken.
    comm: Option<Comm>,
    /// Held through each collective on `comm`: MPI matches a communicator's collectives in
    /// the order each rank starts them, so one agreement's never overlap.
    turn: Mutex<()>,
}

/// A communicator handle that may move between threads, never freed: `MPI_Comm_free` is not
/// allowed after `MPI_Finalize`, which frees it, and an agreement may outlive its job.
struct Comm(ManuallyDrop<SimpleCommunicator>);

// SAFETY: MPI was initialized with at least MPI_THREAD_SERIALIZED (`MpiJob::init` refuses
// less), so MPI may be called from any thread as long as no two calls overlap; every call on
// the handle is made under `Shared::calls`, which sees to that. (With Open MPI, `MPI_Comm` is
// a pointer, hence no automatic `Send` or `Sync`.)
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: shared references only reach MPI under `Shared::calls`.
unsafe impl Sync for Comm {}

/// A collective's hold on its channel: its turn, and the job alive throughout.
struct Entered<'a> {
    _turn: MutexGuard<'a, ()>,
    _alive: RwLockReadGuard<'a, bool>,
    comm: &'a SimpleCommunicator,
}

impl Channel {
    fn new(job: &Arc<Shared>, comm: Option<SimpleCommunicator>) -> Channel {
        Channel {
            job: Arc::clone(job),
            comm: comm.map(|comm| Comm(ManuallyDrop::new(comm))),
            turn: Mutex::new(()),
        }
    }

    /// This channel's turn, while its job is alive and MPI not finalized (an adopted MPI may
    /// be finalized by the program while an agreement is kept).
    fn enter(&self) -> Result<Entered<'_>, AgreementError> {
        let turn = self.turn.lock().unwrap_or_else(PoisonError::into_inner);
        let alive = self
            .job
            .alive
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        match &self.comm {
            Some(comm) if *alive && !::mpi::environment::is_finalized() => Ok(Entered {
                _turn: turn,
                _alive: alive,
                comm: &comm.0,
            }),
            _ => Err(AgreementError::Failed(if self.job.adopted {
                "the MpiJob was dropped, or your code finalized MPI, before this agreement (keep \
                 the job alive in `main` until every rank is done, and finalize MPI after it)"
                    .to_owned()
            } else {
                "MPI is finalized: the MpiJob was dropped before this agreement (keep it alive in \
                 `main` until every rank is done)"
                    .to_owned()
            })),
        }
    }
}

impl MpiJob {
    /// How long a rank waits for the others at every collective, by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// The exit code a rank gives `MPI_Abort` when it ends the job (`EX_SOFTWARE`).
    pub const ABORT_CODE: i32 = 70;

    /// Initializes MPI (`MPI_THREAD_MULTIPLE`) and the agreement's communicator, waiting at
    /// most [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT) for the other ranks.
    ///
    /// Where your program initialized MPI itself (`MPI_Init_thread`, the `mpi` crate's
    /// `initialize_with_threading`), the job adopts it: its agreement runs on a duplicate of
    /// your `MPI_COMM_WORLD`, and dropping the job leaves MPI to you (finalize it after the
    /// job is dropped). It is refused only where it cannot work: MPI initialized for one thread
    /// ([`MpiError::ThreadLevel`]: ask for `MPI_THREAD_MULTIPLE`), MPI already finalized
    /// ([`MpiError::Finalized`]), or another `MpiJob` alive ([`MpiError::AlreadyInitialized`]).
    pub fn init() -> Result<MpiJob, MpiError> {
        MpiJob::init_with_timeout(MpiJob::DEFAULT_TIMEOUT)
    }

    /// [`init`](Self::init) with every collective waiting at most `timeout` for the other
    /// ranks, before this rank aborts the job. A zero `timeout` is refused
    /// ([`MpiError::ZeroTimeout`]) before MPI is touched.
    ///
    /// `MPI_Init_thread` itself waits for every rank of the job, and for ever for one that
    /// never comes: a watchdog thread started before it ends this process (exit code
    /// [`ABORT_CODE`](Self::ABORT_CODE), saying why on stderr) if MPI is not initialized within
    /// `timeout`, and the launcher then ends the job. MPI cannot be aborted before it is
    /// initialized, so this is the one way not to wait for ever there. The same `timeout`
    /// bounds the whole of `init`, the agreement's communicator included.
    pub fn init_with_timeout(timeout: Duration) -> Result<MpiJob, MpiError> {
        if timeout.is_zero() {
            return Err(MpiError::ZeroTimeout);
        }
        let started = Instant::now();
        if JOB_ALIVE.swap(true, Ordering::SeqCst) {
            return Err(MpiError::AlreadyInitialized);
        }
        // From here on, an error gives the place back for another job.
        let alive = AliveGuard;
        let (universe, threading) = if ::mpi::environment::is_initialized() {
            if ::mpi::environment::is_finalized() {
                return Err(MpiError::Finalized);
            }
            // Initialized by the program: adopt it (see `init`).
            (None, ::mpi::environment::threading_support())
        } else {
            let watchdog = InitWatchdog::start(timeout);
            let initialized = ::mpi::initialize_with_threading(Threading::Multiple);
            watchdog.disarm();
            match initialized {
                Some((universe, threading)) => (Some(universe), threading),
                // Another thread initialized it in between: adopt it as well.
                None => (None, ::mpi::environment::threading_support()),
            }
        };
        let provided = match threading {
            Threading::Multiple | Threading::Serialized => None,
            Threading::Funneled => Some("MPI_THREAD_FUNNELED"),
            Threading::Single => Some("MPI_THREAD_SINGLE"),
        };
        if let Some(provided) = provided {
            // Finalizing (where this job initialized MPI) is safe here: no rank has started a
            // collective yet.
            drop(universe);
            return Err(MpiError::ThreadLevel { provided });
        }
        let adopted = universe.is_none();
        let world = SimpleCommunicator::world();
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        let world_size = usize::try_from(world.size()).unwrap_or(1).max(1);
        std::mem::forget(alive);
        let shared = Arc::new(Shared {
            alive: RwLock::new(true),
            calls: Mutex::new(()),
            multiple: threading == Threading::Multiple,
            adopted,
        });
        let waiting = "to create the job's communicator (MPI_Comm_idup)";
        let own = duplicate(&shared, &world, started, timeout, waiting);
        let job = MpiJob {
            universe,
            own: Arc::new(Channel::new(&shared, Some(own))),
            shared,
            rank,
            world_size,
            timeout,
            _not_send: PhantomData,
        };
        tracing::info!(
            rank,
            world_size,
            ?timeout,
            adopted,
            "MPI job of the batch-size agreement"
        );
        Ok(job)
    }

    /// This rank, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long a rank waits for the others at every collective before it aborts the job.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The [`Collective`] a search agrees through: `agree = rank` in the attribute,
    /// `with_agreement(&rank)` on the runners.
    ///
    /// Each agreement is a communicator of its own (an `MPI_Comm_idup` of the job's, polled
    /// against the timeout), so its rounds never meet another agreement's nor your training's
    /// collectives: take one for each search that runs at the same time as another (on other
    /// threads), and searches on several threads at once each get their own rounds. Like any
    /// collective, every rank takes its agreements in the same order (the job stays on the
    /// thread that created it, so they are taken there). One agreement serves one search at a
    /// time: two searches at once through the same agreement (or its clones) would cross their
    /// rounds, as two threads using one MPI communicator at once do.
    pub fn agreement(&self) -> MpiRank {
        let comm = match self.own.enter() {
            Ok(entered) => Some(duplicate(
                &self.shared,
                entered.comm,
                Instant::now(),
                self.timeout,
                "to create an agreement's communicator (MPI_Comm_idup)",
            )),
            // MPI was finalized by the program: the agreement says so when used.
            Err(_) => None,
        };
        self.rank_over(Arc::new(Channel::new(&self.shared, comm)))
    }

    fn rank_over(&self, channel: Arc<Channel>) -> MpiRank {
        MpiRank {
            channel,
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.timeout,
        }
    }

    /// Ends the whole job now: prints `why` on stderr, naming this rank, then `MPI_Abort`.
    /// For a rank that cannot go on: returning instead would leave the others waiting until
    /// their timeout.
    pub fn abort(&self, why: &str) -> ! {
        abort_job(&self.shared, self.rank, self.world_size, why)
    }

    /// The NCCL Id of the job's communicator: rank 0 creates it, an MPI broadcast (polled
    /// against the timeout) carries it to every rank. Every rank must call it.
    ///
    /// Rank 0 sends a flag byte before the 128 bytes of the Id, so that where it could not
    /// create one, every rank returns [`MpiError::NoIdFromRankZero`] instead of waiting.
    #[cfg(feature = "nccl")]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "mpi", feature = "nccl"))))]
    pub fn nccl_id(&self) -> Result<NcclId, MpiError> {
        let mut message = [0u8; 1 + 128];
        let mut failure = None;
        if self.rank == 0 {
            match NcclId::new() {
                Ok(id) => {
                    message[0] = 1;
                    message[1..].copy_from_slice(id.as_bytes());
                }
                Err(error) => failure = Some(error),
            }
        }
        self.rank_over(Arc::clone(&self.own))
            .broadcast_from_rank_zero(&mut message)?;
        if let Some(error) = failure {
            return Err(MpiError::Nccl(error));
        }
        let mut id = [0u8; 128];
        id.copy_from_slice(&message[1..]);
        match message[0] {
            1 => Ok(NcclId::from_bytes(id)),
            _ => Err(MpiError::NoIdFromRankZero),
        }
    }
}

/// `MPI_Comm_idup` of `parent`, polled until `timeout` counted from `started`, or past it the
/// job aborted, saying it waited `waiting`.
fn duplicate(
    shared: &Shared,
    parent: &SimpleCommunicator,
    started: Instant,
    timeout: Duration,
    waiting: &str,
) -> SimpleCommunicator {
    // SAFETY: reading constants that mpi-sys's C shim defines.
    let (mut own, mut request) = unsafe { (ffi::RSMPI_COMM_NULL, ffi::RSMPI_REQUEST_NULL) };
    {
        let _call = shared.call();
        // SAFETY: `parent` is live (MPI is initialized and not finalized); `own` and `request`
        // are valid out-pointers that outlive the request, which is completed below (or the
        // job aborted) before they go out of scope.
        unsafe { ffi::MPI_Comm_idup(parent.as_raw(), &mut own, &mut request) };
    }
    let mut pause = Pause::new();
    loop {
        let mut done = 0;
        {
            let _call = shared.call();
            // SAFETY: `request` is the live request of the idup above; STATUS_IGNORE is
            // allowed.
            unsafe { ffi::MPI_Test(&mut request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        }
        if done != 0 {
            break;
        }
        if started.elapsed() >= timeout {
            let world_size = usize::try_from(parent.size()).unwrap_or(0);
            let rank = usize::try_from(parent.rank()).unwrap_or(0);
            abort_job(
                shared,
                rank,
                world_size,
                &waited_message(waiting, world_size, timeout),
            );
        }
        pause.sleep();
    }
    // SAFETY: `own` is the live intra-communicator the completed idup created, used only
    // through the value returned.
    unsafe { SimpleCommunicator::from_raw(own) }
}

impl Drop for MpiJob {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // MPI_Finalize would wait for the ranks still inside a collective, which wait for
            // this one: end the job instead. The panic's own message is printed above.
            abort_job(
                &self.shared,
                self.rank,
                self.world_size,
                "panicked (the panic's message is above)",
            );
        }
        // From now on an `MpiRank` of this job says that its job is gone. Taking this waits
        // for the collectives under way.
        *self
            .shared
            .alive
            .write()
            .unwrap_or_else(PoisonError::into_inner) = false;
        // Dropping the universe calls MPI_Finalize; an adopted MPI is the program's to end.
        if let Some(universe) = self.universe.take() {
            tracing::debug!(rank = self.rank, "MPI_Finalize");
            drop(universe);
        }
        JOB_ALIVE.store(false, Ordering::SeqCst);
    }
}

/// Whether an [`MpiJob`] of this process is alive: one at a time.
static JOB_ALIVE: AtomicBool = AtomicBool::new(false);

/// Gives the place of the one job back where `init` fails after taking it.
struct AliveGuard;

impl Drop for AliveGuard {
    fn drop(&mut self) {
        JOB_ALIVE.store(false, Ordering::SeqCst);
    }
}

/// Ends this process if `MPI_Init_thread` has not returned within the timeout: it waits for
/// every rank, and for ever for one late or stuck before it, and MPI cannot be aborted before
/// it returns. The launcher (MPICH's `mpiexec`, Open MPI's `mpirun`, `srun`) ends the rest of
/// the job when a rank exits without `MPI_Finalize`.
struct InitWatchdog {
    state: Arc<(Mutex<bool>, Condvar)>,
}

impl InitWatchdog {
    fn start(timeout: Duration) -> InitWatchdog {
        let state = Arc::new((Mutex::new(false), Condvar::new()));
        let watched = Arc::clone(&state);
        let spawned = std::thread::Builder::new()
            .name("batch-size-mpi-init-watchdog".to_owned())
            .spawn(move || {
                let (initialized, changed) = &*watched;
                let held = initialized.lock().unwrap_or_else(PoisonError::into_inner);
                let (held, _) = changed
                    .wait_timeout_while(held, timeout, |initialized| !*initialized)
                    .unwrap_or_else(PoisonError::into_inner);
                if !*held {
                    // The lock stays held: `disarm` cannot return while this ends the process.
                    exit_before_init(timeout);
                }
            });
        if let Err(error) = spawned {
            // Without the watchdog, init waits as MPI does; say so rather than fail a job that
            // would most likely start.
            tracing::warn!(%error, "no watchdog for MPI_Init_thread: a rank that never comes holds this one");
        }
        InitWatchdog { state }
    }

    /// `MPI_Init_thread` returned: the watchdog ends without a word.
    fn disarm(self) {
        let (initialized, changed) = &*self.state;
        *initialized.lock().unwrap_or_else(PoisonError::into_inner) = true;
        changed.notify_all();
    }
}

/// The watchdog's end of a rank whose `MPI_Init_thread` waited past the timeout.
fn exit_before_init(timeout: Duration) -> ! {
    // MPI is not initialized: its rank is the launcher's (MPICH, Open MPI, Slurm).
    let rank = ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"]
        .into_iter()
        .find_map(|name| std::env::var(name).ok())
        .unwrap_or_else(|| "?".to_owned());
    let world_size = ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"]
        .into_iter()
        .find_map(|name| std::env::var(name).ok())
        .unwrap_or_else(|| "?".to_owned());
    tracing::error!(
        rank,
        world_size,
        ?timeout,
        "MPI_Init_thread waited past the timeout"
    );
    let line = format!(
        "batch-size: rank {rank} of {world_size}: waited {timeout:?} for the other ranks to start \
         (MPI_Init_thread), the agreement's timeout (a rank is late to MpiJob::init, stuck \
         before it, or never started); ending this rank (exit code {}) so that the launcher ends \
         the job, since MPI cannot be aborted before it is initialized\n",
        MpiJob::ABORT_CODE
    );
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(line.as_bytes());
    let _ = stderr.flush();
    drop(stderr);
    std::thread::sleep(LINE_OUT);
    unsafe extern "C" {
        fn _exit(status: std::os::raw::c_int) -> !;
    }
    // SAFETY: `_exit` (POSIX) ends the process at once and takes any status. It is called
    // rather than `exit` because the main thread is inside MPI_Init_thread: `exit`'s handlers
    // (MPI's, stdio's) could wait for locks that thread holds.
    unsafe { _exit(MpiJob::ABORT_CODE) }
}

/// One rank's agreement through its [`MpiJob`]: implements [`Collective`] with non-blocking
/// all-reduces polled against the job's timeout. Past it, the rank prints why and aborts the
/// job (see [`MpiJob`]'s "Nobody hangs"). Cheap to clone; every clone shares the job's
/// communicator.
#[derive(Clone)]
pub struct MpiRank {
    channel: Arc<Channel>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl fmt::Debug for MpiRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiRank")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Collective for MpiRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// `MPI_Iallreduce` of `MPI_INT64_T` (each value moved into the signed range with its
    /// order kept, since MPICH 4.0.2 and Open MPI 4.1.4 compare `MPI_UINT64_T` as signed),
    /// polled; never returns [`AgreementError::Timeout`]: past the timeout the job is aborted.
    /// Ranks calling it with different lengths are out of step; MPI's default error handler
    /// then ends the job with its own message.
    fn all_reduce(&self, values: &mut [u64], op: ReduceOp) -> Result<(), AgreementError> {
        let send: Vec<i64> = values.iter().copied().map(to_signed).collect();
        let mut reduced = vec![0i64; send.len()];
        let operation = match op {
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        };
        let entered = self.channel.enter()?;
        ::mpi::request::scope(|scope| {
            let request = {
                let _call = self.channel.job.call();
                entered.comm.immediate_all_reduce_into(
                    scope,
                    &send[..],
                    &mut reduced[..],
                    operation,
                )
            };
            self.complete(request, "to agree (MPI_Iallreduce)");
        });
        drop(entered);
        for (value, reduced) in values.iter_mut().zip(reduced) {
            *value = from_signed(reduced);
        }
        Ok(())
    }
}

impl MpiRank {
    /// `MPI_Ibcast` of `bytes` from rank 0, polled against the timeout.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    fn broadcast_from_rank_zero(&self, bytes: &mut [u8]) -> Result<(), AgreementError> {
        let entered = self.channel.enter()?;
        ::mpi::request::scope(|scope| {
            let request = {
                let _call = self.channel.job.call();
                let root = entered.comm.process_at_rank(0);
                root.immediate_broadcast_into(scope, bytes)
            };
            self.complete(request, "for rank 0's broadcast (MPI_Ibcast)");
        });
        Ok(())
    }

    /// Polls `request` until it completes, or past the timeout ends the job, saying it waited
    /// `waiting`. Never returns with the request pending: leaving its scope so, rsmpi would
    /// abort the process without a word.
    fn complete<'a, D: ?Sized, S: ::mpi::request::Scope<'a>>(
        &self,
        mut request: ::mpi::request::Request<'a, D, S>,
        waiting: &str,
    ) {
        let started = Instant::now();
        let mut pause = Pause::new();
        loop {
            let tested = {
                let _call = self.channel.job.call();
                request.test()
            };
            match tested {
                Ok(_) => return,
                Err(pending) => request = pending,
            }
            if started.elapsed() >= self.timeout {
                self.give_up(waiting);
            }
            pause.sleep();
        }
    }

    /// Past the timeout, inside a collective (between two calls): ends the job.
    fn give_up(&self, waiting: &str) -> ! {
        let why = waited_message(waiting, self.world_size, self.timeout);
        abort_job(&self.channel.job, self.rank, self.world_size, &why)
    }
}

/// `value` as the signed integer of the same rank among all `u64`s (`0` is `i64::MIN`,
/// `u64::MAX` is `i64::MAX`): MIN and MAX of the signed values are those of the unsigned ones.
/// The all-reduce sends these as `MPI_INT64_T` because MPICH 4.0.2 and Open MPI 4.1.4 compare
/// `MPI_UINT64_T` as signed in MIN and MAX, so that `u64::MAX` (a rank that needs no further
/// attempt) would win a MIN against any size. Signed 64-bit MIN and MAX every MPI gets right.
fn to_signed(value: u64) -> i64 {
    (value ^ (1 << 63)) as i64
}

/// The inverse of [`to_signed`].
fn from_signed(value: i64) -> u64 {
    (value as u64) ^ (1 << 63)
}

#[cfg(feature = "nccl")]
impl NcclRank {
    /// Creates the NCCL Id on rank 0, broadcasts it over MPI ([`MpiJob::nccl_id`]) and joins
    /// the communicator on `stream`'s GPU with the job's rank, world size and timeout. Every
    /// rank must call it.
    ///
    /// ```no_run
    /// use batch_size_runtime::agree::{MpiJob, NcclRank};
    /// // mpiexec -n 8 ./train (one GPU a rank: the rank on its node picks it)
    /// let job = MpiJob::init()?;
    /// let context = cudarc::driver::CudaContext::new(job.rank() % 8)?;
    /// let rank = NcclRank::from_mpi(&job, context.new_stream()?)?;
    /// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    /// ```
    #[cfg_attr(docsrs, doc(cfg(all(feature = "mpi", feature = "nccl"))))]
    pub fn from_mpi(
        job: &MpiJob,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<NcclRank, MpiError> {
        let id = job.nccl_id()?;
        Ok(NcclRank::with_timeout(
            stream,
            &id,
            job.rank(),
            job.world_size(),
            job.timeout(),
        )?)
    }
}

fn waited_message(waiting: &str, world_size: usize, waited: Duration) -> String {
    format!(
        "waited {waited:?} for the other ranks {waiting}, the agreement's timeout (a rank died, \
         returned, or is stuck; MPI cannot say which of the {world_size} joined): \
         AgreementError::Timeout under MPI"
    )
}

/// Ends the job from outside a collective (a panic, `MpiJob::abort`).
fn abort_job(shared: &Shared, rank: usize, world_size: usize, why: &str) -> ! {
    if shared.multiple {
        // MPI_Abort may be called while another thread is inside a collective: do not wait for
        // it to give up.
        abort_with(rank, world_size, why)
    }
    let _call = shared.call();
    abort_with(rank, world_size, why)
}

/// How long a rank that aborts waits after printing why, for the launcher to forward it.
const LINE_OUT: Duration = Duration::from_millis(200);

/// Prints why on stderr (one write, so that ranks' lines do not interleave), then ends every
/// rank of the job.
fn abort_with(rank: usize, world_size: usize, why: &str) -> ! {
    tracing::error!(rank, world_size, why, "aborting the MPI job");
    let line = format!(
        "batch-size: rank {rank} of {world_size}: {why}; aborting the MPI job (MPI_Abort) so \
         that no rank waits for ever\n"
    );
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(line.as_bytes());
    let _ = stderr.flush();
    drop(stderr);
    // MPICH's proxy forwards a rank's output and its abort on separate channels, and drops what
    // it has not forwarded when it kills the job: give the line time to get out first.
    std::thread::sleep(LINE_OUT);
    // The world's group is the agreement's: MPI_Abort ends every rank of the job.
    SimpleCommunicator::world().abort(MpiJob::ABORT_CODE)
}

/// Waits between polls: yields first (an agreement of a healthy job takes microseconds), then
/// sleeps up to 1 ms, so that a long wait costs no CPU a training step would use.
struct Pause {
    polls: u32,
}

impl Pause {
    fn new() -> Pause {
        Pause { polls: 0 }
    }

    fn sleep(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < 100 {
            std::thread::yield_now();
        } else {
            let micros = u64::from(self.polls.min(1_000));
            std::thread::sleep(Duration::from_micros(micros));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{from_signed, to_signed};

    /// The signed values sort as the unsigned ones, across the sign bit and at both ends, and
    /// come back unchanged: a MIN or MAX of the signed values is that of the unsigned ones.
    #[test]
    fn signed_values_keep_the_order_of_the_unsigned_ones() {
        let values = [
            0,
            1,
            2,
            96,
            (1 << 63) - 1,
            1 << 63,
            (1 << 63) + 1,
            u64::MAX - 1,
            u64::MAX,
        ];
        for &a in &values {
            assert_eq!(from_signed(to_signed(a)), a);
            for &b in &values {
                assert_eq!(
                    to_signed(a).cmp(&to_signed(b)),
                    a.cmp(&b),
                    "{a} against {b}"
                );
            }
        }
        assert_eq!(to_signed(0), i64::MIN);
        assert_eq!(to_signed(u64::MAX), i64::MAX);
    }
}
