//! The agreement over NCCL (`agree::nccl`), through cudarc's driver API, against the fake CUDA
//! driver and the fake `libnccl.so.2` (`tests/fake-cuda`, `tests/fake-nccl`): ranks as threads
//! of this process, and ranks as processes that exchange the Id through a file.
//!
//! No test can hang: every rank waits with a timeout, every thread and child process is
//! awaited with a deadline, and a test fails rather than waits.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use batch_size_runtime::agree::{safe_point, AgreementError, Collective, IdExchange, ReduceOp};
use batch_size_runtime::agree::{NcclError, NcclId, NcclRank};
use batch_size_runtime::BatchSizeSearch;
use batch_size_tests::cuda_scenario::{GrowingModel, MIB};
use batch_size_tests::fake_cuda::FakeCuda;
use batch_size_tests::fake_nccl::{FakeNccl, LIBRARY_PATH};
use cudarc::driver::{CudaContext, CudaSlice};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// 4 buffers of 1 MiB per sample: a step of `n` samples needs `4 n` MiB.
fn model() -> GrowingModel {
    GrowingModel::new(4, MIB as usize)
}

/// A rank joined: its communicator, its context, and the memory taken from under it.
type Joined = (NcclRank, Arc<CudaContext>, Option<CudaSlice<u8>>);

/// Joins rank `rank` of `world` on fake device `rank`, taking `ballast` MiB there first (mixed
/// GPUs: less room on some).
fn join(
    rank: usize,
    world: usize,
    id: NcclId,
    ballast: u64,
    timeout: Duration,
) -> Result<Joined, NcclError> {
    let ctx = CudaContext::new(rank).unwrap();
    let stream = ctx.new_stream().unwrap();
    let held = (ballast > 0).then(|| stream.alloc_zeros::<u8>((ballast * MIB) as usize).unwrap());
    let nccl = NcclRank::with_timeout(stream, &id, rank, world, timeout)?;
    Ok((nccl, ctx, held))
}

/// Awaits `count` results from `receiver`, failing after `deadline`.
fn gather<T>(receiver: &mpsc::Receiver<(usize, T)>, count: usize, deadline: Duration) -> Vec<T> {
    let until = Instant::now() + deadline;
    let mut results: Vec<Option<T>> = (0..count).map(|_| None).collect();
    for _ in 0..count {
        let left = until.saturating_duration_since(Instant::now());
        let (rank, value) = receiver
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("a rank did not finish within {deadline:?}"));
        results[rank] = Some(value);
    }
    results.into_iter().map(Option::unwrap).collect()
}

#[test]
fn four_ranks_on_mixed_gpus_agree_over_nccl() -> TestResult {
    let cuda = FakeCuda::session(4, 100 * MIB)?;
    let nccl = FakeNccl::load()?;
    let (destroyed, aborted) = (nccl.calls("ncclCommDestroy"), nccl.calls("ncclCommAbort"));
    let id = NcclId::new()?;
    let ballast = [0u64, 40, 10, 60]; // MiB taken on each device before the search
    let (sender, receiver) = mpsc::channel();
    for (rank, taken) in ballast.into_iter().enumerate() {
        let sender = sender.clone();
        thread::spawn(move || {
            let outcome = (|| -> Result<usize, String> {
                let (nccl, ctx, _held) =
                    join(rank, 4, id, taken, Duration::from_secs(10)).map_err(|e| e.to_string())?;
                let stream = ctx.default_stream();
                let model = model();
                BatchSizeSearch::new(64)
                    .with_agreement(&nccl)
                    .run(|batch_size| -> anyhow::Result<usize> {
                        Ok(model.step(&stream, batch_size)?)
                    })
                    .map_err(|error| error.to_string())
            })();
            let _ = sender.send((rank, outcome));
        });
    }
    let sizes: Vec<usize> = gather(&receiver, 4, Duration::from_secs(30))
        .into_iter()
        .map(|outcome| outcome.unwrap())
        .collect();
    assert!(sizes.iter().all(|&size| size == sizes[0]), "{sizes:?}");
    // The most loaded device (60 MiB taken) holds 40 MiB: 10 samples.
    let most = model().largest_fitting(40 * MIB, 64).unwrap();
    assert!(sizes[0] <= most && sizes[0] > 0, "{sizes:?}, fits {most}");
    assert!(
        nccl.calls("ncclAllReduce") >= 8,
        "the agreement ran over NCCL"
    );
    // Every communicator was closed on drop, gracefully.
    assert_eq!(nccl.live_comms(), 0);
    assert_eq!(nccl.calls("ncclCommDestroy") - destroyed, 4);
    assert_eq!(nccl.calls("ncclCommAbort") - aborted, 0);
    drop(cuda);
    Ok(())
}

/// One global batch in uneven shares over NCCL: each rank at the micro-batch its device holds,
/// the shares following simulated speeds, every rank computing the same shares from figures
/// all-gathered over the fake NCCL.
#[test]
fn uneven_shares_of_one_global_batch_over_nccl() -> TestResult {
    use batch_size_runtime::EffectiveBatch;
    use std::sync::atomic::{AtomicU64, Ordering};

    let cuda = FakeCuda::session(4, 100 * MIB)?;
    let nccl = FakeNccl::load()?;
    let reduces = nccl.calls("ncclAllReduce");
    let id = NcclId::new()?;
    let ballast = [0u64, 40, 10, 60]; // MiB taken on each device: mixed GPUs
    let per_sample = [1_000u64, 1_000, 2_000, 3_000]; // simulated ns a sample
    let (global, steps) = (96, 6);
    /// Per step (share, micro, simulated time), and the shares at the end.
    type Seen = (Vec<(usize, usize, u64)>, Vec<std::ops::Range<usize>>);
    let (sender, receiver) = mpsc::channel();
    for rank in 0..4 {
        let sender = sender.clone();
        thread::spawn(move || {
            let outcome = (|| -> Result<Seen, String> {
                let (nccl, ctx, _held) = join(rank, 4, id, ballast[rank], Duration::from_secs(10))
                    .map_err(|e| e.to_string())?;
                let stream = ctx.default_stream();
                let model = model();
                let clock = Arc::new(AtomicU64::new(0));
                let read = Arc::clone(&clock);
                let mut runner = EffectiveBatch::new(global)
                    .with_agreement(&nccl)
                    .with_uneven_shares()
                    .with_clock(move || Duration::from_nanos(read.load(Ordering::SeqCst)));
                let mut seen = Vec::new();
                for _ in 0..steps {
                    let (share, micro, time) = runner
                        .step(|plan| -> anyhow::Result<(usize, usize, u64)> {
                            let started = clock.load(Ordering::SeqCst);
                            for micro in plan.micro_batches() {
                                model.step(&stream, micro.range.len())?;
                                clock.fetch_add(
                                    5_000 + micro.range.len() as u64 * per_sample[rank],
                                    Ordering::SeqCst,
                                );
                            }
                            let time = clock.load(Ordering::SeqCst) - started;
                            Ok((plan.share().len(), plan.micro(), time))
                        })
                        .map_err(|error| format!("{error:#}"))?;
                    seen.push((share, micro, time));
                }
                Ok((seen, runner.shares()))
            })();
            let _ = sender.send((rank, outcome));
        });
    }
    let ranks: Vec<_> = gather(&receiver, 4, Duration::from_secs(60))
        .into_iter()
        .map(|outcome| outcome.unwrap())
        .collect();
    // Every rank computed the same shares, and they tile the global batch.
    assert!(
        ranks.iter().all(|(_, shares)| *shares == ranks[0].1),
        "{ranks:?}"
    );
    assert_eq!(ranks[0].1.first().map(|r| r.start), Some(0));
    assert_eq!(ranks[0].1.last().map(|r| r.end), Some(global));
    for step in 0..steps {
        let total: usize = ranks.iter().map(|(seen, _)| seen[step].0).sum();
        assert_eq!(total, global, "step {step}");
    }
    // Each rank at its own micro-batch: the most loaded device (60 MiB taken) holds fewer
    // samples than the empty one runs.
    let last = |rank: usize| ranks[rank].0[steps - 1];
    assert!(last(3).1 < last(0).1, "{:?} against {:?}", last(3), last(0));
    // The shares followed the speeds: the slowest rank's last step within 10 % of the fastest.
    let times: Vec<u64> = (0..4).map(|rank| last(rank).2).collect();
    let (slowest, fastest) = (times.iter().max().unwrap(), times.iter().min().unwrap());
    assert!(
        *slowest as f64 <= *fastest as f64 * 1.10,
        "{times:?}, {ranks:?}"
    );
    assert!(nccl.calls("ncclAllReduce") - reduces >= (steps * 4 * 4) as u64);
    assert_eq!(nccl.live_comms(), 0);
    drop(cuda);
    Ok(())
}

#[test]
fn the_values_come_back_reduced_on_every_rank() -> TestResult {
    let _cuda = FakeCuda::session(3, 100 * MIB)?;
    FakeNccl::load()?;
    let id = NcclId::new()?;
    let (sender, receiver) = mpsc::channel();
    for rank in 0..3usize {
        let sender = sender.clone();
        thread::spawn(move || {
            // Everything of this rank is dropped before it reports: the next test's driver
            // reset must not meet a context of this one.
            let reduced = {
                let (nccl, _ctx, _) = join(rank, 3, id, 0, Duration::from_secs(10)).unwrap();
                let mut max = [rank as u64 * 10, 7, u64::MAX - rank as u64];
                nccl.all_reduce(&mut max, ReduceOp::Max).unwrap();
                let mut min = [rank as u64 + 5, 100 - rank as u64];
                nccl.all_reduce(&mut min, ReduceOp::Min).unwrap();
                (max, min, nccl.rank(), nccl.world_size())
            };
            let _ = sender.send((rank, reduced));
        });
    }
    for (rank, (max, min, reported, world)) in gather(&receiver, 3, Duration::from_secs(20))
        .into_iter()
        .enumerate()
    {
        assert_eq!(max, [20, 7, u64::MAX], "rank {rank}");
        assert_eq!(min, [5, 98], "rank {rank}");
        assert_eq!((reported, world), (rank, 3));
    }
    Ok(())
}

/// Rank `rank` of 3 joins `id` and all-reduces its rank + 1 with MAX; everything of it is dropped
/// before it returns.
fn reduce_one(rank: usize, id: NcclId) -> [u64; 1] {
    let (nccl, _ctx, _) = join(rank, 3, id, 0, Duration::from_secs(10)).unwrap();
    let mut values = [rank as u64 + 1];
    nccl.all_reduce(&mut values, ReduceOp::Max).unwrap();
    values
}

/// The Id through a channel of the program's own (a launcher's store, say; a channel here):
/// rank 0 creates it and sends its bytes, the others rebuild it with `NcclId::from_bytes`.
#[test]
fn the_id_through_a_channel_of_the_programs_own() -> TestResult {
    let _cuda = FakeCuda::session(3, 100 * MIB)?;
    FakeNccl::load()?;
    let (sender, receiver) = mpsc::channel();
    let mut to_others = Vec::new();
    for rank in 1..3usize {
        let (to, from) = mpsc::channel::<[u8; 128]>();
        to_others.push(to);
        let sender = sender.clone();
        thread::spawn(move || {
            let bytes = from.recv_timeout(Duration::from_secs(10)).unwrap();
            let reduced = reduce_one(rank, NcclId::from_bytes(bytes));
            let _ = sender.send((rank, reduced));
        });
    }
    let id = NcclId::new()?;
    for to in to_others {
        to.send(*id.as_bytes())?;
    }
    thread::spawn(move || {
        let reduced = reduce_one(0, id);
        let _ = sender.send((0, reduced));
    });
    let reduced = gather(&receiver, 3, Duration::from_secs(20));
    assert_eq!(reduced, [[3], [3], [3]]);
    Ok(())
}

#[test]
fn a_rank_that_never_joins_makes_the_others_time_out() -> TestResult {
    let _cuda = FakeCuda::session(2, 100 * MIB)?;
    let nccl = FakeNccl::load()?;
    let aborted = nccl.calls("ncclCommAbort");
    let id = NcclId::new()?;
    let started = Instant::now();
    let error = join(0, 2, id, 0, Duration::from_millis(300)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            error,
            NcclError::Timeout {
                rank: 0,
                world_size: 2,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("did not start"), "{error}");
    assert_eq!(
        nccl.calls("ncclCommAbort") - aborted,
        1,
        "aborted, not leaked"
    );
    assert_eq!(nccl.live_comms(), 0);
    Ok(())
}

#[test]
fn a_rank_that_stops_answering_times_out_the_agreement_and_the_communicator_stays_failed(
) -> TestResult {
    let _cuda = FakeCuda::session(2, 100 * MIB)?;
    FakeNccl::load()?;
    let id = NcclId::new()?;
    let (joined_sender, joined) = mpsc::channel();
    let (release_sender, release) = mpsc::channel::<()>();
    let silent = thread::spawn(move || {
        let (nccl, _ctx, _) = join(1, 2, id, 0, Duration::from_secs(10)).unwrap();
        joined_sender.send(()).unwrap();
        // Alive but silent (stuck elsewhere) until the test ends.
        let _ = release.recv_timeout(Duration::from_secs(20));
        drop(nccl);
    });
    let (nccl, _ctx, _) = join(0, 2, id, 0, Duration::from_millis(400))?;
    joined.recv_timeout(Duration::from_secs(10))?;
    let started = Instant::now();
    let error = nccl.all_reduce(&mut [1], ReduceOp::Max).unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(error, AgreementError::Timeout { rank: 0, .. }),
        "{error}"
    );
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(5));
    // Aborted: later agreements fail at once instead of waiting again.
    let started = Instant::now();
    let again = nccl.all_reduce(&mut [1], ReduceOp::Max).unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(100));
    assert!(again.to_string().contains("failed earlier"), "{again}");
    release_sender.send(())?;
    silent.join().unwrap();
    Ok(())
}

#[test]
fn an_out_of_memory_on_one_rank_is_everyones_through_the_safe_point() -> TestResult {
    let _cuda = FakeCuda::session(2, 100 * MIB)?;
    FakeNccl::load()?;
    let id = NcclId::new()?;
    let (sender, receiver) = mpsc::channel();
    for (rank, taken) in [(0usize, 0u64), (1, 50)] {
        let sender = sender.clone();
        thread::spawn(move || {
            let outcome = {
                let (nccl, ctx, _held) = join(rank, 2, id, taken, Duration::from_secs(10)).unwrap();
                let stream = ctx.default_stream();
                let model = model();
                let (result, report) = BatchSizeSearch::new(16)
                    .with_agreement(&nccl)
                    .run_with_report(|batch_size| -> anyhow::Result<usize> {
                        let forward_backward = model.step(&stream, batch_size);
                        safe_point(&nccl, forward_backward.is_err())?;
                        Ok(forward_backward?)
                    });
                let tried: Vec<usize> = report.attempts().map(|a| a.batch_size).collect();
                (result.map_err(|e| e.to_string()), tried)
            };
            let _ = sender.send((rank, outcome));
        });
    }
    let results = gather(&receiver, 2, Duration::from_secs(20));
    assert_eq!(results[0], results[1], "the same sizes tried and returned");
    let (size, tried) = (results[0].0.clone().unwrap(), &results[0].1);
    // Rank 1 has 50 MiB: 16 samples (64 MiB) do not fit there.
    assert!(tried.len() >= 2 && tried[0] == 16, "{tried:?}");
    assert!(size <= 12, "{size}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Ranks as processes: this test binary, run again with a role in the environment.

const ROLE: &str = "NCCL_TEST_CHILD_ROLE";

/// Runs this binary's test `name` as a child with `env`; returns its stdout and success.
fn run_child(name: &str, env: &[(&str, String)], deadline: Duration) -> (String, bool) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("BATCH_SIZE_NCCL_LIBRARY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let until = Instant::now() + deadline;
    loop {
        if let Some(_status) = child.try_wait().unwrap() {
            break;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("child {name} {env:?} ran past {deadline:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        eprintln!("child {name} failed:\n{stdout}\n{stderr}");
    }
    (stdout, output.status.success())
}

/// What a child printed after `marker` (libtest may print it after the test's name).
fn reported<'a>(stdout: &'a str, marker: &str) -> Option<&'a str> {
    stdout
        .lines()
        .find_map(|line| line.split_once(marker).map(|(_, rest)| rest))
        .map(str::trim)
}

/// A rank as a process: a fake device with `NCCL_TEST_CAPACITY_MIB`, the Id exchanged through
/// the file `NCCL_TEST_EXCHANGE`, the agreed search; prints `AGREED <size>` or `FAILED <error>`.
/// With `NCCL_TEST_DIE=1` it exits abruptly soon after it has joined, like a killed process.
#[test]
#[ignore = "a child process of the rank tests: run by them with --ignored"]
fn child_rank() {
    let role = std::env::var(ROLE).expect("run only as a child, which sets its role");
    assert_eq!(role, "rank");
    let capacity: u64 = std::env::var("NCCL_TEST_CAPACITY_MIB")
        .unwrap()
        .parse()
        .unwrap();
    let _cuda = FakeCuda::session(1, capacity * MIB).unwrap();
    FakeNccl::load().unwrap();
    let file = std::env::var("NCCL_TEST_EXCHANGE").unwrap();
    let rank = std::env::var("RANK").unwrap().parse().unwrap();
    let exchange = IdExchange::file(file, rank, 2).with_timeout(Duration::from_secs(20));
    let ctx = CudaContext::new(0).unwrap();
    let nccl = NcclRank::from_exchange(&exchange, ctx.new_stream().unwrap()).unwrap();
    if std::env::var("NCCL_TEST_DIE").is_ok() {
        // Not at once: rank 0, which joined first (rank 1 polls for its file), may not yet have
        // seen the join (its polls pause up to 2 ms), and the fake NCCL then reports the lost
        // peer as the creation's failure. This test is of the agreement noticing a lost peer.
        thread::sleep(Duration::from_millis(500));
        std::process::exit(3);
    }
    let stream = ctx.default_stream();
    let model = model();
    match BatchSizeSearch::new(64)
        .with_agreement(&nccl)
        .run(|batch_size| -> anyhow::Result<usize> { Ok(model.step(&stream, batch_size)?) })
    {
        Ok(size) => println!("@AGREED {size}"),
        Err(error) => println!("@FAILED {error}"),
    }
}

/// Two processes (rank 0 with 100 MiB, rank 1 with 30 MiB), the Id exchanged through a file
/// of `name`'s own (one for each test: they run at once).
fn two_processes(name: &str, die: bool) -> Vec<(String, bool)> {
    let folder = std::env::temp_dir().join(format!("nccl-exchange-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let exchange = folder.join("nccl-id").display().to_string();
    let children: Vec<_> = [(0, 100u64), (1, 30)]
        .into_iter()
        .map(|(rank, capacity)| {
            let mut env = vec![
                (ROLE, "rank".to_owned()),
                ("NCCL_TEST_CAPACITY_MIB", capacity.to_string()),
                ("NCCL_TEST_EXCHANGE", exchange.clone()),
                ("RANK", rank.to_string()),
            ];
            if die && rank == 1 {
                env.push(("NCCL_TEST_DIE", "1".to_owned()));
            }
            thread::spawn(move || run_child("child_rank", &env, Duration::from_secs(60)))
        })
        .collect();
    let results = children
        .into_iter()
        .map(|child| child.join().unwrap())
        .collect();
    let _ = std::fs::remove_dir_all(&folder);
    results
}

/// Runs two rank processes exchanging the Id through a file; both must succeed and report the
/// same size, which is returned.
fn agreed_size() -> usize {
    let results = two_processes("agree", false);
    let sizes: Vec<&str> = results
        .iter()
        .map(|(stdout, ok)| {
            assert!(ok, "{stdout}");
            reported(stdout, "@AGREED").unwrap_or_else(|| panic!("{stdout}"))
        })
        .collect();
    assert_eq!(sizes[0], sizes[1]);
    sizes[0].parse().unwrap()
}

#[test]
fn two_processes_agree_with_the_id_exchanged_through_a_file() {
    let size = agreed_size();
    assert!(
        size <= model().largest_fitting(30 * MIB, 64).unwrap(),
        "{size}"
    );
}

#[test]
fn a_rank_process_that_dies_fails_the_other_instead_of_hanging() {
    let started = Instant::now();
    let results = two_processes("die", true);
    let (survivor, ok) = &results[0];
    assert!(ok, "{survivor}");
    let failure = reported(survivor, "@FAILED").unwrap_or_else(|| panic!("{survivor}"));
    assert!(failure.contains("could not agree"), "{failure}");
    assert!(failure.contains("ncclRemoteError"), "{failure}");
    assert!(!results[1].1, "the dead rank exited abruptly");
    // NCCL reported the lost peer: no waiting for the 120 s timeout.
    assert!(started.elapsed() < Duration::from_secs(30));
}

// ---------------------------------------------------------------------------------------------
// Finding the library as it is installed.

/// Prints where NCCL was found, or why not (`LIBRARY <path>` / `MISSING <error>`), without
/// loading the fake first: the search itself finds it, or not.
#[test]
#[ignore = "a child process of the library search tests: run by them with --ignored"]
fn child_find_library() {
    assert_eq!(
        std::env::var(ROLE).as_deref(),
        Ok("find"),
        "run only as a child, which sets its role"
    );
    match NcclId::new() {
        Ok(_) => {
            let (path, version) = batch_size_runtime::agree::loaded_library().unwrap();
            println!("@LIBRARY {path} {version}");
        }
        Err(error) => println!("@MISSING {error}"),
    }
}

#[test]
fn the_library_is_found_in_the_pip_wheels_folder_of_a_virtual_environment() {
    let venv = std::env::temp_dir().join(format!("nccl-venv-{}", std::process::id()));
    let wheel = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&wheel).unwrap();
    std::fs::copy(LIBRARY_PATH, wheel.join("libnccl.so.2")).unwrap();
    let (stdout, ok) = run_child(
        "child_find_library",
        &[
            (ROLE, "find".to_owned()),
            ("VIRTUAL_ENV", venv.display().to_string()),
            ("LD_LIBRARY_PATH", String::new()),
        ],
        Duration::from_secs(30),
    );
    let _ = std::fs::remove_dir_all(&venv);
    assert!(ok, "{stdout}");
    let found = reported(&stdout, "@LIBRARY").unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        found.starts_with(&wheel.join("libnccl.so.2").display().to_string()),
        "{found}"
    );
    assert!(found.ends_with("22105"), "the version is read: {found}");
}

#[test]
fn a_library_that_is_not_there_is_an_error_that_says_what_to_do_not_a_panic() {
    let (stdout, ok) = run_child(
        "child_find_library",
        &[
            (ROLE, "find".to_owned()),
            (
                "BATCH_SIZE_NCCL_LIBRARY",
                "/nowhere/libnccl.so.2".to_owned(),
            ),
        ],
        Duration::from_secs(30),
    );
    assert!(ok, "no panic: {stdout}");
    let missing = reported(&stdout, "@MISSING").unwrap_or_else(|| panic!("{stdout}"));
    assert!(missing.contains("/nowhere/libnccl.so.2"), "{missing}");
    assert!(
        missing.contains("pip install nvidia-nccl-cu12"),
        "{missing}"
    );
}
