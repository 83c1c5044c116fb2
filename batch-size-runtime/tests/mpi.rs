//! Real MPI jobs: `mpiexec -n 4` (or 2, 3) runs this very binary as the ranks
//! (`BATCH_SIZE_MPI_SCENARIO` names what they do), each with a simulated GPU of its own size,
//! and checks what they print, how they end and when.
//!
//! - `attribute`: four ranks agree on one size through `#[find_executable_batch_size]`.
//! - `uneven`: `EffectiveBatch` with uneven shares; rank 3 runs out of memory in step 3 and
//!   every rank redoes that step in place.
//! - `chunked`: `Chunked` with the agreement: every rank runs the same chunks, sized for the
//!   smallest GPU. The `attribute` job also checks that an agreement used after its job was
//!   dropped fails with a clear error.
//! - `extremes`: all-reduces of values at both ends of `u64` and across its sign bit give the
//!   unsigned MIN and MAX (MPICH 4.0.2 and Open MPI 4.1.4 compare `MPI_UINT64_T` as signed).
//! - `mix_effective`, `mix_chunked`, `mix_search`, each on 2, 3 and 4 ranks: a rank that fits
//!   and a rank that runs out of memory in one round (`EffectiveBatch` with a late
//!   out-of-memory, `Chunked` with more items on some ranks, `BatchSizeSearch` with no safe
//!   point); every rank's result line must be the one the same job gives on `ThreadRanks`,
//!   run in this process first.
//! - `two_searches`: two searches at once on every rank (two threads), each through an
//!   agreement of its own, started in opposite orders on even and odd ranks: each gives what it
//!   gives alone on `ThreadRanks`.
//! - `adopt`: the program initializes MPI itself; the job adopts it, refuses a second job,
//!   leaves MPI running when dropped, and after the program's `MPI_Finalize` a new job is
//!   refused as such.
//! - `zero_timeout`: `MpiJob::init_with_timeout(Duration::ZERO)` is refused on every rank.
//! - `late_init`, `stuck_init`: the last rank comes to `MpiJob::init` four timeouts late, or
//!   never; the others' watchdogs end the job within the timeout plus 2 s of their `init`.
//! - `nccl_id`, `nccl_id_missing`: rank 0 creates the NCCL Id (with the fake NCCL of
//!   `tests/fake-nccl`, compiled here with `rustc`) and MPI carries it to every rank; without
//!   NCCL, rank 0 says so and every other rank that rank 0 made no Id, at once.
//! - `panics`, `exits`, `stuck`, `returns`: one rank panics, exits, hangs or returns early
//!   while the others agree (`panics_in_attempt`: panics inside an attempt of the search); the
//!   job must end within the agreement's timeout plus 2 s of that moment, with an error that
//!   says what happened, never hang.
//!
//! Nothing here depends on timing but the limit under test: the shares follow a simulated
//! clock, and each failure is timed from the moment the failing rank printed.
//!
//! Needs `mpiexec` (MPICH: `apt-get install mpich libmpich-dev libclang-dev`) and the `mpi`
//! feature: `cargo test -p batch-size-runtime --features mpi --test mpi`. Without `mpiexec`
//! it prints why and passes, unless `MPI_REQUIRED=1` (CI: `.ci/mpi`), where it fails.
//! `MPI_JOBS=stuck,returns` runs only the jobs named.

use std::io::Read;
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use batch_size_runtime::agree::{safe_point, Collective, MpiJob, MpiRank};
use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::{find_executable_batch_size, EffectiveBatch};

const SCENARIO: &str = "BATCH_SIZE_MPI_SCENARIO";
/// How many ranks the launcher started (read before MPI is initialized).
const RANKS_VARIABLE: &str = "BATCH_SIZE_MPI_RANKS";
/// Names the job a process belongs to, to kill a hung job whole.
const JOB_MARKER: &str = "BATCH_SIZE_MPI_JOB";
const RANKS: usize = 4;
/// The agreement's timeout in the failure jobs.
const TIMEOUT: Duration = Duration::from_secs(3);
/// How long past the timeout every rank may take to end: the job must never hang, and a
/// surviving rank sees the failure within one timeout plus this.
const GRACE: Duration = Duration::from_secs(2);
/// A job still running after this has hung: it is killed and the test fails.
const HUNG: Duration = Duration::from_secs(60);
/// Activations of one sample.
const PER_SAMPLE: u64 = 64 << 20;
/// Each rank's simulated GPU, in MiB: room for 300, 70, 140 and 200 samples.
const DEVICE_MIB: [u64; RANKS] = [300 * 64, 70 * 64, 140 * 64, 200 * 64];

fn main() -> ExitCode {
    match std::env::var(SCENARIO) {
        Ok(scenario) => rank_main(&scenario),
        Err(_) => launch_all(),
    }
}

// ---- the ranks ----------------------------------------------------------------------------

fn rank_main(scenario: &str) -> ExitCode {
    let timeout = if !matches!(
        scenario,
        "panics" | "exits" | "stuck" | "returns" | "panics_in_attempt" | "late_init" | "stuck_init"
    ) {
        // Healthy jobs: long enough never to abort a slow but healthy machine.
        Duration::from_secs(30)
    } else {
        TIMEOUT
    };
    if scenario == "zero_timeout" {
        return zero_timeout();
    }
    if scenario == "adopt" {
        return adopt();
    }
    if matches!(scenario, "late_init" | "stuck_init") {
        before_init(scenario);
    }
    let job = match MpiJob::init_with_timeout(timeout) {
        Ok(job) => job,
        Err(error) => {
            eprintln!("MpiJob::init: {error}");
            return ExitCode::FAILURE;
        }
    };
    let rank = job.agreement();
    let me = job.rank();
    let device = SimulatedDevice::new(DEVICE_MIB[me % RANKS] << 20).named(format!("gpu{me}"));
    if scenario == "two_searches" {
        return match two_searches(&job) {
            Ok(lines) => {
                for line in lines {
                    println!("result {line}");
                }
                ExitCode::SUCCESS
            }
            Err(error) => job.abort(&format!("{error:#}")),
        };
    }
    if let Some(job_name) = scenario.strip_prefix("mix_") {
        let device = mixed_device(me);
        return match mixed(job_name, &rank, &device) {
            Ok(line) => {
                println!("result {line}");
                ExitCode::SUCCESS
            }
            Err(error) => job.abort(&format!("{error:#}")),
        };
    }
    let outcome = match scenario {
        "attribute" => attribute(&rank, &device),
        "extremes" => extremes(&rank),
        "late_init" | "stuck_init" => Ok(()),
        "uneven" => uneven(&rank, &device),
        "chunked" => chunked(&rank, &device),
        "nccl_id" | "nccl_id_missing" => nccl_id(&job),
        "panics" | "exits" | "stuck" | "returns" | "panics_in_attempt" => {
            failing(scenario, &job, &rank, &device)
        }
        other => Err(anyhow::anyhow!("no scenario {other}")),
    };
    match outcome {
        Ok(()) if scenario == "attribute" => after_the_job(job),
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // A failing rank must not finalize while others agree: end the job, saying why.
            job.abort(&format!("{error:#}"))
        }
    }
}

#[find_executable_batch_size(starting = 512, agree = rank, release = device.clone())]
fn search(batch_size: usize, rank: &MpiRank, device: &SimulatedDevice) -> anyhow::Result<usize> {
    let forward_backward = device.alloc(batch_size as u64 * PER_SAMPLE);
    safe_point(rank, forward_backward.is_err())?;
    let _activations = forward_backward?;
    Ok(batch_size)
}

/// `search` whose attempt panics (not out of memory) where `panics`.
#[find_executable_batch_size(starting = 512, agree = rank, release = device.clone())]
fn search_panicking(
    batch_size: usize,
    rank: &MpiRank,
    device: &SimulatedDevice,
    panics: bool,
) -> anyhow::Result<usize> {
    if panics {
        #[allow(clippy::panic)]
        {
            panic!("rank 2 panics on purpose inside an attempt");
        }
    }
    let forward_backward = device.alloc(batch_size as u64 * PER_SAMPLE);
    safe_point(rank, forward_backward.is_err())?;
    let _activations = forward_backward?;
    Ok(batch_size)
}

fn attribute(rank: &MpiRank, device: &SimulatedDevice) -> anyhow::Result<()> {
    let size = search(rank, device)?;
    println!(
        "rank {} of {}: agreed {size} (this GPU holds {})",
        rank.rank(),
        rank.world_size(),
        device.capacity() / PER_SAMPLE
    );
    Ok(())
}

/// An agreement kept past its job gets a clear error, not MPI's abort for a call after
/// `MPI_Finalize`.
fn after_the_job(job: MpiJob) -> ExitCode {
    use batch_size_runtime::agree::ReduceOp;
    let late = job.agreement();
    drop(job); // MPI_Finalize, on every rank
    match late.all_reduce(&mut [1], ReduceOp::Max) {
        Err(error) => {
            println!("rank {} after the job: {error}", late.rank());
            ExitCode::SUCCESS
        }
        Ok(()) => {
            println!("rank {} after the job: agreed", late.rank());
            ExitCode::FAILURE
        }
    }
}

/// 1,000 items in chunks that every rank runs alike: a chunk that did not fit one rank's GPU
/// is redone smaller on all.
fn chunked(rank: &MpiRank, device: &SimulatedDevice) -> anyhow::Result<()> {
    use batch_size_runtime::Chunked;
    let mut runner = Chunked::new(1000)
        .with_starting(256)
        .with_release(device.clone())
        .with_agreement(rank);
    let mut items = 0;
    runner.for_each(|range| {
        let _activations = device.alloc(range.len() as u64 * PER_SAMPLE)?;
        items += range.len();
        anyhow::Ok(())
    })?;
    let done: Vec<_> = runner
        .chunks()
        .iter()
        .filter(|chunk| chunk.done)
        .map(|chunk| chunk.range.clone())
        .collect();
    let covered: usize = done.iter().map(|range| range.len()).sum();
    // A chunk that fitted here but not on another rank ran again, smaller: `items` counts both.
    println!(
        "rank {} chunks {done:?} covering {covered}; ran {items} items",
        rank.rank()
    );
    Ok(())
}

/// Rank 0 creates the NCCL Id (the fake NCCL of `tests/fake-nccl`, or none), MPI carries it.
fn nccl_id(job: &MpiJob) -> anyhow::Result<()> {
    match job.nccl_id() {
        Ok(id) => {
            let hex: String = id
                .as_bytes()
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect();
            println!("rank {} id {hex}", job.rank());
        }
        Err(error) => println!("rank {} no id: {error}", job.rank()),
    }
    Ok(())
}

const STEPS: usize = 6;
const GLOBAL: usize = 512;
/// Simulated time of one sample's forward and backward pass on each rank, and of one pass, in
/// microseconds: a simulated clock keeps the shares the same from run to run (the wall clock
/// would time allocations of a few microseconds, and the shares would follow noise).
const MICROS_PER_SAMPLE: [u64; RANKS] = [1_000, 1_900, 1_700, 1_000];
const MICROS_PER_PASS: u64 = 3_000;

fn uneven(rank: &MpiRank, device: &SimulatedDevice) -> anyhow::Result<()> {
    use batch_size_runtime::agree::ReduceOp;
    let me = rank.rank();
    let clock = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&clock);
    let mut runner = EffectiveBatch::new(GLOBAL)
        .with_uneven_shares()
        .with_clock(move || Duration::from_micros(read.load(Ordering::Relaxed)))
        .with_release(device.clone())
        .with_agreement(rank);
    let mut taken = None;
    for step in 0..STEPS {
        if step == 3 && me == 3 {
            // Another process takes most of rank 3's GPU: room for 50 samples is left, and its
            // share (about 160, as fast as rank 0) no longer fits in one pass.
            taken = Some(device.alloc(150 * PER_SAMPLE)?);
        }
        runner.step_then(
            |plan| -> anyhow::Result<u64> {
                let mut samples = 0;
                for micro in plan.micro_batches() {
                    let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                    samples += micro.range.len() as u64;
                    let time = MICROS_PER_PASS + micro.range.len() as u64 * MICROS_PER_SAMPLE[me];
                    clock.fetch_add(time, Ordering::Relaxed);
                }
                Ok(samples)
            },
            |plan, samples| {
                // The gradient all-reduce: the samples of every share add up to the batch.
                let mut total = [samples];
                let mut sum = rank.all_gather(samples)?;
                rank.all_reduce(&mut total, ReduceOp::Max)?;
                let all: u64 = sum.drain(..).sum();
                println!(
                    "rank {me} step {step}: share {:?} micro {} samples of all ranks {all}",
                    plan.share(),
                    plan.micro()
                );
                Ok(())
            },
        )?;
        println!("rank {me} after step {step}: shares {:?}", runner.shares());
    }
    drop(taken);
    let redone: Vec<(usize, Vec<usize>)> = runner
        .recoveries()
        .iter()
        .map(|recovery| (recovery.step, recovery.tried.clone()))
        .collect();
    println!("rank {me}: redone {redone:?}");
    Ok(())
}

/// Rank 2 fails in the way `scenario` names, after the first agreement; the others go on to a
/// second one, which it never joins.
fn failing(
    scenario: &str,
    job: &MpiJob,
    rank: &MpiRank,
    device: &SimulatedDevice,
) -> anyhow::Result<()> {
    let size = search(rank, device)?;
    if scenario == "panics_in_attempt" {
        if job.rank() == 2 {
            eprintln!("rank 2 {scenario} at {}", unix_millis());
        }
        let again = search_panicking(rank, device, job.rank() == 2)?;
        println!("rank {} agreed {size} then {again}", job.rank());
        return Ok(());
    }
    if job.rank() == 2 {
        eprintln!("rank 2 {scenario} at {}", unix_millis());
        match scenario {
            // The panic under test: it unwinds out of `main`, through the job's drop.
            #[allow(clippy::panic)]
            "panics" => panic!("rank 2 panics on purpose"),
            "exits" => std::process::exit(3),
            "stuck" => std::thread::sleep(Duration::from_secs(3600)),
            _ => return Ok(()), // returns: drops the job, MPI_Finalize
        }
    }
    let again = search(rank, device)?;
    println!("rank {} agreed {size} then {again}", job.rank());
    Ok(())
}

// ---- a fit and an out-of-memory in one round --------------------------------------------

/// Each rank's simulated GPU in the mixed jobs, in samples of [`PER_SAMPLE`]: rank 0 holds
/// more than any share, rank 1 less than every share, so every first round mixes a rank that
/// fits with one that runs out of memory, on 2, 3 and 4 ranks.
const MIXED_SAMPLES: [u64; 4] = [300, 70, 140, 200];

fn mixed_device(rank: usize) -> SimulatedDevice {
    let samples = MIXED_SAMPLES.get(rank).copied().unwrap_or(100);
    SimulatedDevice::new(samples * PER_SAMPLE).named(format!("gpu{rank}"))
}

/// The mixed job `name` on this rank, through any collective: what it returns (one line) must
/// be the same under MPI as under `ThreadRanks`.
fn mixed<C: Collective>(name: &str, rank: &C, device: &SimulatedDevice) -> anyhow::Result<String> {
    match name {
        "effective" => mixed_effective(rank, device),
        "chunked" => mixed_chunked(rank, device),
        "search" => mixed_search(rank, device),
        "by_cost" => mixed_by_cost(rank, device),
        other => Err(anyhow::anyhow!("no mixed job {other}")),
    }
}

/// `EffectiveBatch` of 384 samples, even shares, four steps; at step 2 another process takes
/// four fifths of the last rank's GPU, so that step runs out of memory there late.
fn mixed_effective<C: Collective>(rank: &C, device: &SimulatedDevice) -> anyhow::Result<String> {
    let me = rank.rank();
    let last = rank.world_size() - 1;
    let mut runner = EffectiveBatch::new(384)
        .with_release(device.clone())
        .with_agreement(rank);
    let mut micro = Vec::new();
    let mut samples_of_all = Vec::new();
    let mut taken = None;
    for step in 0..4 {
        if step == 2 && me == last {
            taken = Some(device.alloc(device.capacity() / 5 * 4)?);
        }
        runner.step_then(
            |plan| -> anyhow::Result<u64> {
                let mut samples = 0;
                for batch in plan.micro_batches() {
                    let _activations = device.alloc(batch.range.len() as u64 * PER_SAMPLE)?;
                    samples += batch.range.len() as u64;
                }
                Ok(samples)
            },
            |plan, samples| {
                // The gradient all-reduce: every rank is here at every step.
                let all: u64 = rank.all_gather(samples)?.iter().sum();
                micro.push(plan.micro());
                samples_of_all.push(all);
                Ok(())
            },
        )?;
    }
    drop(taken);
    let redone: Vec<(usize, Vec<usize>)> = runner
        .recoveries()
        .iter()
        .map(|recovery| (recovery.step, recovery.tried.clone()))
        .collect();
    Ok(format!(
        "rank {me}: micro {micro:?} samples of all {samples_of_all:?} redone {redone:?}"
    ))
}

/// `EffectiveBatch::step_by_cost`, each rank its own lengths (a heavy tail on some ranks):
/// every rank runs as many micro-batches as the rank that needs the most, each step (the
/// all-gather after each step checks it where the gradient all-reduce would be).
fn mixed_by_cost<C: Collective>(rank: &C, device: &SimulatedDevice) -> anyhow::Result<String> {
    let me = rank.rank();
    let mut runner = EffectiveBatch::new(16)
        .with_release(device.clone())
        .with_agreement(rank);
    let mut counts = Vec::new();
    for step in 0..5u64 {
        // Lengths in samples' worth of memory: rank `me` has one long item every other step.
        let lengths: Vec<u64> = (0..16u64)
            .map(|i| {
                1 + (i * 7 + step * 3 + me as u64) % 5
                    + u64::from(i == 0 && (step + me as u64) % 2 == 0) * 30
            })
            .collect();
        runner.step_then(
            |plan| -> anyhow::Result<usize> {
                let mut passes = 0;
                for micro in plan.micro_batches() {
                    let longest = micro.items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
                    let _activations =
                        device.alloc(micro.items.len() as u64 * longest * PER_SAMPLE / 2)?;
                    passes += 1;
                }
                Ok(passes)
            },
            |_plan, passes| {
                let all = rank.all_gather(passes as u64)?;
                if all.iter().any(|&count| count != all[0]) {
                    anyhow::bail!("step {step}: the ranks ran {all:?} micro-batches");
                }
                counts.push(passes);
                Ok(())
            },
        )?;
    }
    Ok(format!("rank {me}: micro-batches {counts:?}"))
}

/// `Chunked` with more items on some ranks than others (1500, 500, 1000, 200), 256 a chunk at
/// first: every rank runs every item of its own, once.
fn mixed_chunked<C: Collective>(rank: &C, device: &SimulatedDevice) -> anyhow::Result<String> {
    use batch_size_runtime::Chunked;
    let me = rank.rank();
    let total = [1500, 500, 1000, 200].get(me).copied().unwrap_or(300);
    let mut runner = Chunked::new(total)
        .with_starting(256)
        .with_release(device.clone())
        .with_agreement(rank);
    let mut ran = 0;
    runner.for_each(|range| {
        let _activations = device.alloc(range.len() as u64 * PER_SAMPLE)?;
        ran += range.len();
        anyhow::Ok(())
    })?;
    let done: Vec<_> = runner
        .chunks()
        .iter()
        .filter(|chunk| chunk.done)
        .map(|chunk| chunk.range.clone())
        .collect();
    let covered: usize = done.iter().map(|range| range.len()).sum();
    Ok(format!(
        "rank {me}: {covered} of {total} items in {} chunks {done:?}; ran {ran}",
        done.len()
    ))
}

/// `BatchSizeSearch` from 1000 with no safe point: a rank's attempt that fits and another's
/// that runs out of memory meet in the agreement after it.
fn mixed_search<C: Collective>(rank: &C, device: &SimulatedDevice) -> anyhow::Result<String> {
    use batch_size_runtime::BatchSizeSearch;
    let (result, report) = BatchSizeSearch::new(1000)
        .with_release(device.clone())
        .with_agreement(rank)
        .run_with_report(|size| -> anyhow::Result<usize> {
            let _activations = device.alloc(size as u64 * PER_SAMPLE)?;
            Ok(size)
        });
    let tried: Vec<usize> = report
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    Ok(format!("rank {}: {} tried {tried:?}", rank.rank(), result?))
}

/// The same mixed job on `ThreadRanks`, one thread a rank: the line each rank returns, or its
/// error, in rank order.
fn on_threads(name: &str, ranks: usize) -> Vec<String> {
    on_threads_with(ranks, mixed_device, |rank, device| {
        mixed(name, rank, device)
    })
}

/// `job` on `ThreadRanks`, each rank with the device `device` makes for it.
fn on_threads_with(
    ranks: usize,
    device: fn(usize) -> SimulatedDevice,
    job: impl Fn(&batch_size_runtime::agree::ThreadRank, &SimulatedDevice) -> anyhow::Result<String>
        + Sync,
) -> Vec<String> {
    use batch_size_runtime::agree::ThreadRanks;
    let job = &job;
    std::thread::scope(|scope| {
        let threads: Vec<_> = ThreadRanks::with_timeout(ranks, Duration::from_secs(30))
            .into_iter()
            .map(|rank| {
                scope.spawn(move || {
                    let device = device(rank.rank());
                    job(&rank, &device).unwrap_or_else(|error| format!("error {error:#}"))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| {
                thread
                    .join()
                    .unwrap_or_else(|_| "error: the thread panicked".to_owned())
            })
            .collect()
    })
}

/// The second search's GPUs, in samples: other sizes than the first's, so that crossed rounds
/// would show.
const SECOND_SAMPLES: [u64; 4] = [90, 250, 40, 120];

fn second_device(rank: usize) -> SimulatedDevice {
    let samples = SECOND_SAMPLES.get(rank).copied().unwrap_or(100);
    SimulatedDevice::new(samples * PER_SAMPLE).named(format!("second{rank}"))
}

/// Two searches at once on every rank, on two threads, each through an agreement of its own
/// taken in the same order on every rank. Even ranks start the first search first, odd ranks
/// the second: through one communicator their rounds would cross.
fn two_searches(job: &MpiJob) -> anyhow::Result<Vec<String>> {
    let me = job.rank();
    let (first, second) = (job.agreement(), job.agreement());
    let stagger = |mine_first: bool| {
        if mine_first != (me % 2 == 0) {
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    std::thread::scope(|scope| {
        let one = scope.spawn(|| {
            stagger(true);
            mixed_search(&first, &mixed_device(me)).map(|line| format!("first {line}"))
        });
        let two = scope.spawn(|| {
            stagger(false);
            mixed_search(&second, &second_device(me)).map(|line| format!("second {line}"))
        });
        let one = one
            .join()
            .map_err(|_| anyhow::anyhow!("the first search panicked"))??;
        let two = two
            .join()
            .map_err(|_| anyhow::anyhow!("the second search panicked"))??;
        Ok(vec![one, two])
    })
}

/// Values at both ends of `u64` and across its sign bit, all-reduced: MIN and MAX must be the
/// unsigned ones (MPICH 4.0.2 and Open MPI 4.1.4 compare `MPI_UINT64_T` as signed).
const EXTREMES: [[u64; 5]; 2] = [
    [96, 1 << 63, u64::MAX, 0, (1 << 63) - 1],
    [u64::MAX, (1 << 63) - 1, 5, 1, 1 << 63],
];

fn extremes(rank: &MpiRank) -> anyhow::Result<()> {
    use batch_size_runtime::agree::ReduceOp;
    let mine = EXTREMES[rank.rank() % 2];
    let (mut least, mut most) = (mine, mine);
    rank.all_reduce(&mut least, ReduceOp::Min)?;
    rank.all_reduce(&mut most, ReduceOp::Max)?;
    println!("rank {} min {least:?} max {most:?}", rank.rank());
    Ok(())
}

// ---- init ---------------------------------------------------------------------------------

/// A zero timeout is refused before MPI is touched, with an error that says so.
fn zero_timeout() -> ExitCode {
    match MpiJob::init_with_timeout(Duration::ZERO) {
        Ok(job) => {
            println!("rank {}: a zero timeout was accepted", job.rank());
            ExitCode::FAILURE
        }
        Err(error) => {
            println!("refused: {error}");
            ExitCode::SUCCESS
        }
    }
}

/// The program initializes MPI itself (the `mpi` crate, as a user's MPI program would): the
/// job adopts it, refuses a second job, leaves MPI to the program when dropped, and after the
/// program finalized MPI a new job is refused as such.
fn adopt() -> ExitCode {
    use ::mpi::traits::{Communicator as _, CommunicatorCollectives as _};
    let Some((universe, _)) = ::mpi::initialize_with_threading(::mpi::Threading::Multiple) else {
        eprintln!("the program could not initialize MPI");
        return ExitCode::FAILURE;
    };
    let job = match MpiJob::init_with_timeout(Duration::from_secs(30)) {
        Ok(job) => job,
        Err(error) => {
            println!("rank ? not adopted: {error}");
            universe.world().abort(MpiJob::ABORT_CODE)
        }
    };
    let me = job.rank();
    match MpiJob::init() {
        Ok(_) => println!("rank {me} second job: accepted"),
        Err(error) => println!("rank {me} second job: {error}"),
    }
    let rank = job.agreement();
    let device = mixed_device(me);
    let size = match search(&rank, &device) {
        Ok(size) => size,
        Err(error) => job.abort(&format!("{error:#}")),
    };
    drop(job);
    // MPI is still the program's: its own collective runs after the job.
    universe.world().barrier();
    println!("rank {me} adopted: agreed {size}; the program's MPI still runs after the job");
    drop(universe); // MPI_Finalize, by the program
    match MpiJob::init() {
        Ok(_) => println!("rank {me} after finalize: accepted"),
        Err(error) => println!("rank {me} after finalize: {error}"),
    }
    ExitCode::SUCCESS
}

/// This rank's number from the launcher's environment, before MPI is initialized.
fn launcher_rank() -> Option<usize> {
    ["PMI_RANK", "OMPI_COMM_WORLD_RANK"]
        .into_iter()
        .find_map(|name| std::env::var(name).ok()?.parse().ok())
}

/// In `late_init` the last rank comes to `MpiJob::init` 12 s late (four timeouts); in
/// `stuck_init` it never comes. The others say when they entered it.
fn before_init(scenario: &str) {
    let ranks: usize = std::env::var(RANKS_VARIABLE)
        .ok()
        .and_then(|ranks| ranks.parse().ok())
        .unwrap_or(RANKS);
    let me = launcher_rank().unwrap_or(0);
    if me + 1 == ranks {
        let late = match scenario {
            "late_init" => TIMEOUT * 4,
            _ => Duration::from_secs(3600),
        };
        std::thread::sleep(late);
    } else {
        eprintln!("rank {me} enters init at {}", unix_millis());
    }
}

// ---- the launcher -------------------------------------------------------------------------

fn launch_all() -> ExitCode {
    let required = std::env::var("MPI_REQUIRED").is_ok_and(|value| value == "1");
    let Some(mpiexec) = find_mpiexec() else {
        if required {
            eprintln!("FAILED: MPI_REQUIRED=1 but no mpiexec (install mpich, or set MPIEXEC)");
            return ExitCode::FAILURE;
        }
        println!(
            "skipped: no mpiexec on PATH (apt-get install mpich libmpich-dev; or set MPIEXEC); \
             MPI_REQUIRED=1 makes this a failure"
        );
        return ExitCode::SUCCESS;
    };
    // `MPI_JOBS=stuck,returns` runs only those jobs.
    let only = std::env::var("MPI_JOBS").unwrap_or_default();
    let fake_nccl = match build_fake_nccl() {
        Ok(path) => path,
        Err(error) => {
            eprintln!("FAILED: building the fake NCCL: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut jobs: Vec<(String, usize, Check)> = vec![
        ("attribute".into(), RANKS, Box::new(check_attribute)),
        ("uneven".into(), RANKS, Box::new(check_uneven)),
        ("chunked".into(), RANKS, Box::new(check_chunked)),
        ("extremes".into(), 2, Box::new(check_extremes)),
    ];
    // A rank that fits and a rank that runs out of memory in one round, on 2, 3 and 4 ranks:
    // each job gives what the same job gives on `ThreadRanks`.
    for name in ["effective", "chunked", "search", "by_cost"] {
        for ranks in 2..=4 {
            let scenario = format!("mix_{name}");
            let selected = only.is_empty() || only.split(',').any(|job| job == scenario);
            if selected {
                let expected = on_threads(name, ranks);
                jobs.push((
                    scenario,
                    ranks,
                    Box::new(move |job| check_mixed(job, &expected)),
                ));
            }
        }
    }
    if only.is_empty() || only.split(',').any(|job| job == "two_searches") {
        // Each search alone on ThreadRanks: what each must give, though they run at once.
        let mut expected: Vec<String> = on_threads("search", RANKS)
            .into_iter()
            .map(|line| format!("first {line}"))
            .collect();
        expected.extend(
            on_threads_with(RANKS, second_device, |rank, device| {
                mixed_search(rank, device)
            })
            .into_iter()
            .map(|line| format!("second {line}")),
        );
        jobs.push((
            "two_searches".into(),
            RANKS,
            Box::new(move |job| check_mixed(job, &expected)),
        ));
    }
    jobs.extend([
        ("nccl_id".into(), RANKS, Box::new(check_nccl_id) as Check),
        (
            "nccl_id_missing".into(),
            RANKS,
            Box::new(check_nccl_id_missing),
        ),
        ("zero_timeout".into(), 2, Box::new(check_zero_timeout)),
        ("adopt".into(), 3, Box::new(check_adopt)),
        ("late_init".into(), 2, Box::new(check_late_init)),
        ("stuck_init".into(), 3, Box::new(check_stuck_init)),
        ("panics".into(), RANKS, Box::new(check_panics)),
        (
            "panics_in_attempt".into(),
            RANKS,
            Box::new(check_panics_in_attempt),
        ),
        ("exits".into(), RANKS, Box::new(check_exits)),
        ("stuck".into(), RANKS, Box::new(check_stuck)),
        ("returns".into(), RANKS, Box::new(check_returns)),
    ]);
    let mut failed = 0;
    for (scenario, ranks, check) in jobs {
        if !only.is_empty() && !only.split(',').any(|name| name == scenario) {
            continue;
        }
        let library = match scenario.as_str() {
            "nccl_id" => fake_nccl.display().to_string(),
            _ => "/nonexistent/libnccl.so.2".to_owned(),
        };
        let job = match run_job(&mpiexec, &scenario, ranks, &library) {
            Ok(job) => job,
            Err(error) => {
                eprintln!("FAILED {scenario} on {ranks} ranks: {error}");
                failed += 1;
                continue;
            }
        };
        match check(&job) {
            Ok(()) => println!("ok {scenario} on {ranks} ranks: {}", job.summary()),
            Err(error) => {
                eprintln!(
                    "FAILED {scenario} on {ranks} ranks: {error}\n{}\n--- stdout\n{}--- stderr\n{}",
                    job.summary(),
                    job.stdout,
                    job.stderr
                );
                failed += 1;
            }
        }
    }
    if let Some(folder) = fake_nccl.parent() {
        let _ = std::fs::remove_dir_all(folder);
    }
    if failed > 0 {
        eprintln!("{failed} MPI job(s) failed");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn find_mpiexec() -> Option<String> {
    if let Ok(path) = std::env::var("MPIEXEC") {
        return Some(path);
    }
    // Debian's `mpiexec` is whichever MPI the alternatives chose; prefer MPICH's by name.
    ["mpiexec.mpich", "mpiexec"].into_iter().find_map(|name| {
        let found = Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        found.then(|| name.to_owned())
    })
}

/// What a job must show.
type Check = Box<dyn Fn(&Job) -> Result<(), String>>;

/// A finished job.
struct Job {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    wall: Duration,
    ended_at: u128,
}

impl Job {
    fn summary(&self) -> String {
        format!("{} in {:.2} s", self.status, self.wall.as_secs_f64())
    }

    /// When rank 2 said it failed (unix ms), from its stderr.
    fn failed_at(&self) -> Result<u128, String> {
        self.stderr
            .lines()
            .find_map(|line| {
                let rest = line.strip_prefix("rank 2 ")?;
                rest.split(" at ").nth(1)?.trim().parse().ok()
            })
            .ok_or_else(|| "rank 2 never said when it failed".to_owned())
    }

    /// The job ended within the timeout plus 2 s of rank 2's failure, unsuccessfully.
    fn ended_in_time(&self) -> Result<Duration, String> {
        if self.status.success() {
            return Err("the job succeeded though a rank failed".to_owned());
        }
        let after = Duration::from_millis(
            u64::try_from(self.ended_at.saturating_sub(self.failed_at()?)).unwrap_or(u64::MAX),
        );
        if after > TIMEOUT + GRACE {
            return Err(format!(
                "the job ended {after:?} after the failure, over {:?}",
                TIMEOUT + GRACE
            ));
        }
        println!(
            "  ended {:.2} s after rank 2 failed (limit {:.0} s)",
            after.as_secs_f64(),
            (TIMEOUT + GRACE).as_secs_f64()
        );
        Ok(after)
    }

    fn stderr_says(&self, words: &str) -> Result<(), String> {
        if self.stderr.contains(words) {
            Ok(())
        } else {
            Err(format!("stderr does not say {words:?}"))
        }
    }
}

fn unix_millis() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis())
}

/// Compiles `tests/fake-nccl/fake_nccl.rs` (dependency-free) into a `libnccl.so.2` of its own,
/// as the tests crate's build script does.
fn build_fake_nccl() -> Result<std::path::PathBuf, String> {
    let source =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nccl/fake_nccl.rs");
    let folder = std::env::temp_dir().join(format!("batch-size-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&folder).map_err(|error| format!("{}: {error}", folder.display()))?;
    let library = folder.join("libnccl.so.2");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(&rustc)
        .args(["--edition", "2021", "--crate-type", "cdylib"])
        .args(["--crate-name", "fake_nccl", "-C", "opt-level=1"])
        .args(["-C", "link-arg=-Wl,-soname,libnccl.so.2", "-o"])
        .arg(&library)
        .arg(&source)
        .output()
        .map_err(|error| format!("{rustc}: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "{rustc} {}: {}",
            source.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(library)
}

fn run_job(mpiexec: &str, scenario: &str, ranks: usize, nccl_library: &str) -> Result<Job, String> {
    let started = Instant::now();
    let exe = std::env::current_exe().map_err(|error| format!("current_exe: {error}"))?;
    // Every process of the job inherits this marker, by which a hung job is found and killed
    // (MPICH's proxy puts each rank in a process group of its own).
    let marker = format!("{}-{scenario}", std::process::id());
    let mut child = Command::new(mpiexec)
        .args(["-n", &ranks.to_string()])
        .arg(exe)
        .env(SCENARIO, scenario)
        .env(RANKS_VARIABLE, ranks.to_string())
        .env(JOB_MARKER, &marker)
        .env("BATCH_SIZE_NCCL_LIBRARY", nccl_library)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| format!("{mpiexec}: {error}"))?;
    let stdout = reader(child.stdout.take());
    let stderr = reader(child.stderr.take());
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < HUNG => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                let killed = kill_marked(&marker);
                return Err(format!(
                    "the job hung: mpiexec and {killed} of its processes killed after {HUNG:?}"
                ));
            }
            Err(error) => return Err(format!("waiting for {mpiexec}: {error}")),
        }
    };
    let ended_at = unix_millis();
    let wall = started.elapsed();
    Ok(Job {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
        wall,
        ended_at,
    })
}

/// Kills the processes whose environment holds `JOB_MARKER=marker`: the ranks and MPICH's
/// proxy of a job this test started. Returns how many.
fn kill_marked(marker: &str) -> usize {
    let wanted = format!("{JOB_MARKER}={marker}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut killed = 0;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ
            .split(|byte| *byte == 0)
            .any(|pair| pair == wanted.as_bytes())
            && pid != std::process::id()
        {
            let killing = Command::new("kill")
                .args(["-s", "KILL", "--", &pid.to_string()])
                .status();
            if killing.is_ok_and(|status| status.success()) {
                killed += 1;
            }
        }
    }
    killed
}

fn reader(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

// ---- what each job must show ------------------------------------------------------------

fn check_attribute(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    let mut agreed = Vec::new();
    for line in job.stdout.lines().filter(|line| line.contains("agreed")) {
        println!("  {line}");
        let size = line
            .split("agreed ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|size| size.parse::<usize>().ok())
            .ok_or_else(|| format!("no size in {line:?}"))?;
        agreed.push(size);
    }
    // 512 halves to 64, the first size rank 1's GPU (70 samples) holds, on every rank.
    if agreed != [64; RANKS] {
        return Err(format!(
            "agreed {agreed:?}, not 64 on each of {RANKS} ranks"
        ));
    }
    let late = job
        .stdout
        .lines()
        .filter(|line| line.contains("after the job: the collective failed: MPI is finalized"))
        .count();
    if late != RANKS {
        return Err(format!(
            "{late} of {RANKS} ranks said that an agreement after the job fails"
        ));
    }
    Ok(())
}

fn check_nccl_id(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    let ids: Vec<&str> = job
        .stdout
        .lines()
        .filter_map(|line| line.split_once(" id ").map(|(_, id)| id))
        .collect();
    if ids.len() != RANKS || ids.iter().any(|id| *id != ids[0] || id.len() != 256) {
        return Err(format!("the ranks hold different Ids: {ids:?}"));
    }
    let id = ids.first().copied().unwrap_or_default();
    if id.chars().all(|digit| digit == '0') {
        return Err("the Id is all zeros".to_owned());
    }
    println!("  every rank: the Id {}...", &id[..32]);
    Ok(())
}

fn check_nccl_id_missing(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed instead of every rank returning an error".to_owned());
    }
    let said = |rank: usize, words: &str| {
        job.stdout
            .lines()
            .any(|line| line.starts_with(&format!("rank {rank} no id: ")) && line.contains(words))
    };
    if !said(0, "NCCL was not found") {
        return Err("rank 0 did not say that NCCL was not found".to_owned());
    }
    for rank in 1..RANKS {
        if !said(rank, "rank 0 could not create the NCCL Id") {
            return Err(format!("rank {rank} did not say that rank 0 made no Id"));
        }
    }
    for line in job.stdout.lines().filter(|line| line.contains("no id")) {
        println!("  {line}");
    }
    Ok(())
}

fn check_chunked(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    let chunks: Vec<&str> = job
        .stdout
        .lines()
        .filter_map(|line| line.split_once(" chunks ")?.1.split(';').next())
        .collect();
    if chunks.len() != RANKS || chunks.iter().any(|other| *other != chunks[0]) {
        return Err(format!("the ranks ran different chunks: {chunks:?}"));
    }
    let first = chunks.first().copied().unwrap_or_default();
    println!("  every rank: {first}");
    // Every item once, in chunks no larger than rank 1's GPU holds (70), the first redone.
    let largest = first
        .trim_start_matches('[')
        .split(", ")
        .filter_map(|range| {
            let (start, end) = range.trim_end_matches([']', ' ']).split_once("..")?;
            let end = end.split(']').next()?;
            Some(end.parse::<usize>().ok()? - start.parse::<usize>().ok()?)
        })
        .max()
        .unwrap_or(0);
    if !first.ends_with("covering 1000") || !first.starts_with("[0..") || largest > 70 {
        return Err(format!("not every item, once: {first}"));
    }
    Ok(())
}

fn check_uneven(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    for step in 0..STEPS {
        // Every rank computed the same shares, which cut the global batch without a gap.
        let prefix = format!("after step {step}: shares ");
        let shares: Vec<&str> = job
            .stdout
            .lines()
            .filter_map(|line| line.split_once(&prefix).map(|(_, shares)| shares))
            .collect();
        if shares.len() != RANKS || shares.iter().any(|other| *other != shares[0]) {
            return Err(format!("step {step}: ranks disagree on shares: {shares:?}"));
        }
        let samples = format!("step {step}: share");
        let all = job
            .stdout
            .lines()
            .filter(|line| line.contains(&samples))
            .filter(|line| line.ends_with(&format!("samples of all ranks {GLOBAL}")))
            .count();
        if all != RANKS {
            return Err(format!(
                "step {step}: {all} of {RANKS} ranks saw {GLOBAL} samples in all"
            ));
        }
        if step >= 2 {
            println!(
                "  step {step}: shares {}",
                shares.first().copied().unwrap_or_default()
            );
        }
    }
    // Step 3 ran out of memory on rank 3 and was redone, on every rank, with rank 3 smaller
    // (step 0, at even shares, is redone too: 128 samples do not fit rank 1's GPU).
    let redone: Vec<&str> = job
        .stdout
        .lines()
        .filter(|line| line.contains(": redone "))
        .collect();
    for line in &redone {
        println!("  {line}");
    }
    if redone.len() != RANKS {
        return Err(format!(
            "{} of {RANKS} ranks said what they redid",
            redone.len()
        ));
    }
    for line in redone {
        let tried = tried_in_step_3(line).ok_or_else(|| format!("step 3 not redone: {line}"))?;
        // Only the rank that ran out shrinks; the others redo the step at their own size.
        let shrank = tried.windows(2).any(|pair| pair[1] < pair[0]);
        if shrank != line.starts_with("rank 3:") {
            return Err(format!("step 3 redone at sizes {tried:?}: {line}"));
        }
    }
    Ok(())
}

/// The micro sizes a rank tried in step 3, from its `redone [(step, [sizes]), ...]` line.
fn tried_in_step_3(line: &str) -> Option<Vec<usize>> {
    let sizes = line.split("(3, [").nth(1)?.split(']').next()?;
    sizes.split(", ").map(|size| size.parse().ok()).collect()
}

fn check_panics(job: &Job) -> Result<(), String> {
    job.ended_in_time()?;
    job.stderr_says("rank 2 panics on purpose")?;
    job.stderr_says("batch-size: rank 2 of 4: panicked")
}

fn check_panics_in_attempt(job: &Job) -> Result<(), String> {
    job.ended_in_time()?;
    job.stderr_says("rank 2 panics on purpose inside an attempt")?;
    job.stderr_says("batch-size: rank 2 of 4: panicked")
}

fn check_exits(job: &Job) -> Result<(), String> {
    job.ended_in_time()?;
    // MPICH's launcher ends the job when a rank exits without MPI_Finalize: with the rank's
    // exit code, or (when another rank's end is seen first) its "BAD TERMINATION" banner on
    // stdout; else the others time out and say so.
    let launcher_saw_it = job.status.code() == Some(3) || job.stdout.contains("BAD TERMINATION");
    if launcher_saw_it || job.stderr.contains("for the other ranks to agree") {
        Ok(())
    } else {
        Err("neither the launcher nor the other ranks said that rank 2 ended".to_owned())
    }
}

fn check_stuck(job: &Job) -> Result<(), String> {
    job.ended_in_time()?;
    job.stderr_says("waited 3s for the other ranks to agree (MPI_Iallreduce)")
}

fn check_returns(job: &Job) -> Result<(), String> {
    job.ended_in_time()?;
    job.stderr_says("waited 3s for the other ranks to agree (MPI_Iallreduce)")
}

/// Every rank gave the line its thread gave on `ThreadRanks`, and none an error.
fn check_mixed(job: &Job, expected: &[String]) -> Result<(), String> {
    if let Some(error) = expected.iter().find(|line| line.starts_with("error")) {
        return Err(format!("on ThreadRanks itself: {error}"));
    }
    if !job.status.success() {
        return Err(format!("the job failed; on ThreadRanks: {expected:?}"));
    }
    let mut got: Vec<&str> = job
        .stdout
        .lines()
        .filter_map(|line| line.strip_prefix("result "))
        .collect();
    // In the order of `expected`: by search (where there are several), then by rank.
    got.sort_by_key(|line| {
        let (search, rest) = match line.split_once("rank ") {
            Some((search, rest)) => (search.to_owned(), rest),
            None => (String::new(), *line),
        };
        let rank = rest
            .split(':')
            .next()
            .and_then(|rank| rank.parse::<usize>().ok());
        (search != "first " && !search.is_empty(), rank)
    });
    if got != expected {
        return Err(format!(
            "MPI gave {got:#?}\nwhere ThreadRanks gives {expected:#?}"
        ));
    }
    for line in got {
        println!("  {line}");
    }
    Ok(())
}

fn check_extremes(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    let [a, b] = EXTREMES;
    let least: Vec<u64> = a.iter().zip(b).map(|(a, b)| (*a).min(b)).collect();
    let most: Vec<u64> = a.iter().zip(b).map(|(a, b)| (*a).max(b)).collect();
    for rank in 0..2 {
        let expected = format!("rank {rank} min {least:?} max {most:?}");
        if !job.stdout.lines().any(|line| line == expected) {
            return Err(format!("no line {expected:?}"));
        }
    }
    println!("  every rank: min {least:?} max {most:?}");
    Ok(())
}

fn check_zero_timeout(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed: a zero timeout was not refused".to_owned());
    }
    let refused = job
        .stdout
        .lines()
        .filter(|line| line.starts_with("refused: ") && line.contains("zero"))
        .collect::<Vec<_>>();
    if refused.len() != 2 {
        return Err(format!(
            "{} of 2 ranks refused a zero timeout",
            refused.len()
        ));
    }
    println!("  {}", refused[0]);
    Ok(())
}

/// The job ended, unsuccessfully, within the timeout plus 2 s of the on-time ranks' entering
/// `MpiJob::init`, saying that a rank did not come.
fn ended_after_init(job: &Job) -> Result<(), String> {
    if job.status.success() {
        return Err("the job succeeded though a rank never came".to_owned());
    }
    let entered = job
        .stderr
        .lines()
        .filter_map(|line| {
            line.split(" enters init at ")
                .nth(1)?
                .trim()
                .parse::<u128>()
                .ok()
        })
        .max()
        .ok_or("no rank said when it entered init")?;
    let after = Duration::from_millis(
        u64::try_from(job.ended_at.saturating_sub(entered)).unwrap_or(u64::MAX),
    );
    if after > TIMEOUT + GRACE {
        return Err(format!(
            "the job ended {after:?} after the ranks entered init, over {:?}",
            TIMEOUT + GRACE
        ));
    }
    println!(
        "  ended {:.2} s after the on-time ranks entered init (limit {:.0} s)",
        after.as_secs_f64(),
        (TIMEOUT + GRACE).as_secs_f64()
    );
    job.stderr_says("waited 3s for the other ranks to start (MPI_Init_thread)")
}

fn check_late_init(job: &Job) -> Result<(), String> {
    ended_after_init(job)
}

fn check_stuck_init(job: &Job) -> Result<(), String> {
    ended_after_init(job)
}

fn check_adopt(job: &Job) -> Result<(), String> {
    if !job.status.success() {
        return Err("the job failed".to_owned());
    }
    for rank in 0..3 {
        for (what, words) in [
            ("second job", "another MpiJob of this process is alive"),
            // 512 halves to 64, the first size rank 1's GPU (70 samples) holds.
            (
                "adopted",
                "agreed 64; the program's MPI still runs after the job",
            ),
            ("after finalize", "MPI is finalized already"),
        ] {
            let prefix = format!("rank {rank} {what}: ");
            let line = job
                .stdout
                .lines()
                .find(|line| line.starts_with(&prefix))
                .ok_or_else(|| format!("rank {rank} said nothing on {what}"))?;
            if !line.contains(words) {
                return Err(format!("rank {rank}: {line:?} does not say {words:?}"));
            }
            if rank == 0 {
                println!("  {line}");
            }
        }
    }
    Ok(())
}
