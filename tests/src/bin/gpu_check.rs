//! The CUDA end-to-end scenario of `tests/tests/fake_cuda/driver.rs`, against the real driver
//! (`scripts/gpu-check.sh` builds and runs it; `cargo run -p batch-size-tests --bin gpu_check
//! [ORDINAL]` does too).
//!
//! A model whose memory grows with the batch size (4 buffers from the stream-ordered pool, then
//! a plain `cuMemAlloc` workspace, as cuBLAS takes its own) is sized from the device's free
//! memory so that 64 and 32 overflow it on purpose and 16 fits (59% of it). The search runs
//! twice: with the default release (`CudaBackend::active()`), where every failed attempt must
//! leave the pool empty and the free memory as it was, and 16 must be found; then with the
//! figures read but nothing released, for comparison (not checked: it shows what the pool
//! keeps, and whether the workspace then still fits). Each attempt's size, outcome and free memory before,
//! at the failure and after the release are printed; the retries' WARN logs go to stderr.
//!
//! Then the agreement over the real NCCL (`agree::nccl`), when NCCL is found: world size 1 on
//! the device (an all-reduce and the agreed search, checked), and two ranks, on two GPUs or
//! both on the one (NCCL may refuse that: the refusal must come back within the timeout); on
//! two GPUs, one global batch in uneven shares, the second GPU with half its room taken.
//!
//! Without a CUDA driver or device it says so and exits 0. It exits 1 when a check fails.

use std::io::IsTerminal;
use std::process::ExitCode;

use batch_size_runtime::memory::{Bytes, CudaBackend, DeviceMemory, MemoryBackend};
use batch_size_runtime::Release;
use batch_size_runtime::{last_report, Attempt, BatchSizeSearch, Outcome, SearchReport};
use batch_size_tests::cuda_scenario::{FiguresOnly, GrowingModel, TrainError, MIB};
use cudarc::driver::{CudaContext, DriverError};

const STARTING: usize = 64;
/// The size that must fit.
const FITTING: usize = 16;
/// Bytes per sample (of each buffer and of the workspace) are the free bytes over this: at 64,
/// two buffers fit (128/136 of the free memory) and the third does not; at 16 the step takes
/// 80/136; and the workspace at 16 (16/136) is more than what the first failure leaves free
/// (8/136) unless the pool gives its cache back.
const FREE_PER_SAMPLE: u64 = 136;
const PAGE: u64 = 4096;

fn main() -> ExitCode {
    let ordinal = match std::env::args().nth(1).map(|arg| arg.parse::<usize>()) {
        None => 0,
        Some(Ok(ordinal)) => ordinal,
        Some(Err(_)) => {
            eprintln!("usage: gpu_check [DEVICE_ORDINAL]");
            return ExitCode::from(2);
        }
    };
    // SAFETY: asks the loader whether libcuda can be opened; nothing else.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!(
            "gpu-check: no CUDA driver is present (libcuda cannot be loaded): nothing to check"
        );
        return ExitCode::SUCCESS;
    }
    match CudaContext::device_count() {
        Ok(count) if usize::try_from(count).is_ok_and(|count| count > ordinal) => {}
        Ok(count) => {
            println!("gpu-check: the CUDA driver has {count} device(s), none with ordinal {ordinal}: nothing to check");
            return ExitCode::SUCCESS;
        }
        Err(DriverError(code)) => {
            println!("gpu-check: the CUDA driver is present but has no usable device ({code:?}): nothing to check");
            return ExitCode::SUCCESS;
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
    match check(ordinal) {
        Ok(true) => {
            println!("gpu-check: PASS");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("gpu-check: FAIL");
            ExitCode::FAILURE
        }
        Err(DriverError(code)) => {
            println!("gpu-check: FAIL: a CUDA driver call outside the search failed with {code:?}");
            ExitCode::FAILURE
        }
    }
}

fn check(ordinal: usize) -> Result<bool, DriverError> {
    let ctx = CudaContext::new(ordinal)?;
    let device = format!("cuda:{ordinal}");
    let (free, total) = ctx.mem_get_info()?;
    println!(
        "{device}: {}, {} free of {}, memory pools: {}",
        ctx.name()?,
        Bytes(free as u64),
        Bytes(total as u64),
        if ctx.has_async_alloc() { "yes" } else { "no" }
    );

    // 4 buffers from the pool and a plain workspace, each `bytes_per_sample` per sample.
    // Whole pages, so that sizes stay close to the ratios on small devices too.
    let bytes_per_sample = (free as u64 / FREE_PER_SAMPLE).max(PAGE) / PAGE * PAGE;
    let model =
        GrowingModel::new(4, bytes_per_sample as usize).with_workspace(bytes_per_sample as usize);
    println!(
        "model: 4 buffers and a workspace of {} per sample; a step needs {} at {STARTING}, {} at {}, {} at {FITTING}",
        Bytes(bytes_per_sample),
        Bytes(model.step_bytes(STARTING)),
        Bytes(model.step_bytes(STARTING / 2)),
        STARTING / 2,
        Bytes(model.step_bytes(FITTING)),
    );
    let expected = model.largest_fitting(free as u64, STARTING);

    println!("\n== with the release (the default, CudaBackend::active())");
    let stream = ctx.default_stream();
    let fitted = BatchSizeSearch::new(STARTING)
        .with_label("gpu_check")
        .with_release(Release::cuda())
        .run(|batch_size| model.step(&stream, batch_size).map_err(TrainError::from));
    let report = last_report().unwrap_or_default();
    print_report(&report, &device);
    let mut passed = true;
    let found = fitted.as_ref().ok().copied();
    passed &= verdict(
        found == expected && expected == Some(FITTING),
        &format!("found {found:?}, expected {expected:?}"),
    );
    let tolerance = (64 * MIB).max(total as u64 / 100);
    let free_at_first_start = report
        .attempts()
        .next()
        .and_then(|attempt| figures(attempt.memory_at_start.as_ref(), &device))
        .map(|memory| memory.free);
    for attempt in report
        .attempts()
        .filter(|attempt| matches!(attempt.outcome, Outcome::OutOfMemory { .. }))
    {
        let Some(after) = figures(attempt.memory_after_release.as_ref(), &device) else {
            passed &= verdict(
                false,
                &format!("attempt {}: no figures after the release", attempt.number),
            );
            continue;
        };
        if ctx.has_async_alloc() {
            passed &= verdict(
                after.pool_reserved == Some(0),
                &format!(
                    "attempt {}: the pool reserves {} after the release",
                    attempt.number,
                    show(after.pool_reserved)
                ),
            );
        }
        if let Some(before) = free_at_first_start {
            passed &= verdict(
                after.free + tolerance >= before,
                &format!(
                    "attempt {}: {} free after the release, {} before the search (tolerance {})",
                    attempt.number,
                    Bytes(after.free),
                    Bytes(before),
                    Bytes(tolerance)
                ),
            );
        }
    }
    release_all();

    println!("\n== without a release (figures read, nothing given back), for comparison");
    let fitted = BatchSizeSearch::new(STARTING)
        .with_label("gpu_check")
        .with_release(FiguresOnly(CudaBackend::active()))
        .run(|batch_size| model.step(&stream, batch_size).map_err(TrainError::from));
    print_report(&last_report().unwrap_or_default(), &device);
    println!(
        "found {:?} without a release, {found:?} with it",
        fitted.as_ref().ok()
    );
    release_all();

    passed &= nccl_check(ordinal, &model, expected);
    Ok(passed)
}

/// The agreement over the real NCCL: world size 1 on this GPU (checked), then two ranks, on
/// GPUs `ordinal` and the next if there is one, or both on this GPU (reported: NCCL refuses two
/// ranks of one communicator on one GPU unless it is told otherwise, and that refusal must come
/// back as an error, not a hang).
fn nccl_check(ordinal: usize, model: &GrowingModel, expected: Option<usize>) -> bool {
    use batch_size_runtime::agree::{loaded_library, NcclId, NcclRank};
    use batch_size_runtime::agree::{Collective, ReduceOp};
    use std::time::Duration;

    println!("\n== the agreement over NCCL");
    let (path, version) = match loaded_library() {
        Ok(found) => found,
        Err(error) => {
            println!("  NCCL part skipped: {error}");
            return true;
        }
    };
    println!("  NCCL {version} from {path}");
    let timeout = Duration::from_secs(30);
    let mut passed = true;

    // World size 1.
    let single = (|| -> Result<(Vec<u64>, Option<usize>), String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| e.to_string())?;
        let id = NcclId::new().map_err(|e| e.to_string())?;
        let rank = NcclRank::with_timeout(
            ctx.new_stream().map_err(|e| e.to_string())?,
            &id,
            0,
            1,
            timeout,
        )
        .map_err(|e| e.to_string())?;
        let mut values = [3u64, 7, u64::MAX];
        rank.all_reduce(&mut values, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let stream = ctx.default_stream();
        let fitted = BatchSizeSearch::new(STARTING)
            .with_label("gpu_check_nccl")
            .with_agreement(&rank)
            .run(|batch_size| model.step(&stream, batch_size).map_err(TrainError::from))
            .ok();
        release_all();
        Ok((values.to_vec(), fitted))
    })();
    match single {
        Ok((values, fitted)) => {
            passed &= verdict(
                values == [3, 7, u64::MAX],
                &format!("world size 1: all-reduce gave {values:?}"),
            );
            passed &= verdict(
                fitted == expected,
                &format!("world size 1: the agreed search found {fitted:?}, expected {expected:?}"),
            );
        }
        Err(error) => passed &= verdict(false, &format!("world size 1: {error}")),
    }

    // Two ranks: on two GPUs if there are, else both on this one.
    let count = CudaContext::device_count().unwrap_or(1).max(1) as usize;
    let ordinals = if count > 1 {
        [ordinal, (ordinal + 1) % count]
    } else {
        [ordinal, ordinal]
    };
    println!(
        "  two ranks on cuda:{} and cuda:{}",
        ordinals[0], ordinals[1]
    );
    let id = match NcclId::new() {
        Ok(id) => id,
        Err(error) => return verdict(false, &format!("two ranks: {error}")) && passed,
    };
    let started = std::time::Instant::now();
    let outcomes: Vec<Result<u64, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                scope.spawn(move || -> Result<u64, String> {
                    let ctx = CudaContext::new(device).map_err(|e| e.to_string())?;
                    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                    let nccl = NcclRank::with_timeout(stream, &id, rank, 2, timeout)
                        .map_err(|e| e.to_string())?;
                    let mut values = [rank as u64 + 1];
                    nccl.all_reduce(&mut values, ReduceOp::Max)
                        .map_err(|e| e.to_string())?;
                    Ok(values[0])
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap_or_else(|_| Err("panicked".to_owned())))
            .collect()
    });
    let waited = started.elapsed();
    println!("  two ranks: {outcomes:?} in {waited:.1?}");
    if count > 1 {
        passed &= verdict(
            outcomes.iter().all(|outcome| outcome == &Ok(2)),
            "two ranks on two GPUs: both got the maximum, 2",
        );
        passed &= uneven_shares_check(ordinals, model, timeout);
    } else {
        // Either NCCL allows it (both see 2) or it refuses: in both cases no rank hangs.
        passed &= verdict(
            outcomes.iter().all(|outcome| outcome == &Ok(2)) || waited < timeout * 2,
            "two ranks on one GPU: agreed, or refused within the timeout",
        );
    }
    passed
}

/// Two ranks on two GPUs split one global batch into uneven shares (`with_uneven_shares`) over
/// the real NCCL: the second GPU has half its room taken, so it runs a smaller micro-batch;
/// every rank must compute the same shares, and they must tile the batch.
fn uneven_shares_check(
    ordinals: [usize; 2],
    model: &GrowingModel,
    timeout: std::time::Duration,
) -> bool {
    use batch_size_runtime::agree::{NcclId, NcclRank};
    use batch_size_runtime::EffectiveBatch;

    let global = 2 * STARTING;
    let id = match NcclId::new() {
        Ok(id) => id,
        Err(error) => return verdict(false, &format!("uneven shares: {error}")),
    };
    type Seen = (Vec<(usize, usize)>, Vec<std::ops::Range<usize>>);
    let outcomes: Vec<Result<Seen, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                scope.spawn(move || -> Result<Seen, String> {
                    let ctx = CudaContext::new(device).map_err(|e| e.to_string())?;
                    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                    // Half of the second GPU's free memory taken: a smaller GPU.
                    let (free, _) =
                        cudarc::driver::result::mem_get_info().map_err(|e| e.to_string())?;
                    let _ballast = if rank == 1 {
                        Some(
                            stream
                                .alloc_zeros::<u8>(free / 2)
                                .map_err(|e| e.to_string())?,
                        )
                    } else {
                        None
                    };
                    let nccl = NcclRank::with_timeout(
                        ctx.new_stream().map_err(|e| e.to_string())?,
                        &id,
                        rank,
                        2,
                        timeout,
                    )
                    .map_err(|e| e.to_string())?;
                    let mut runner = EffectiveBatch::new(global)
                        .with_agreement(&nccl)
                        .with_uneven_shares();
                    let mut seen = Vec::new();
                    for _ in 0..4 {
                        let step = runner
                            .step(|plan| -> Result<(usize, usize), TrainError> {
                                for micro in plan.micro_batches() {
                                    model.step(&stream, micro.range.len())?;
                                }
                                Ok((plan.share().len(), plan.micro()))
                            })
                            .map_err(|e| e.to_string())?;
                        seen.push(step);
                    }
                    release_all();
                    Ok((seen, runner.shares()))
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap_or_else(|_| Err("panicked".to_owned())))
            .collect()
    });
    println!("  uneven shares of {global} (share, micro) per step: {outcomes:?}");
    let tiled = match (&outcomes[0], &outcomes[1]) {
        (Ok((first, shares)), Ok((second, other))) => {
            shares == other && first.iter().zip(second).all(|(a, b)| a.0 + b.0 == global)
        }
        _ => false,
    };
    verdict(
        tiled,
        "uneven shares on two GPUs: the same shares on both ranks, tiling the global batch",
    )
}

/// Gives back what the last search left in the pool, so that the next one starts clean.
fn release_all() {
    if let Err(error) = CudaBackend::active().release() {
        println!("  note: {error}");
    }
}

fn figures<'a>(
    snapshot: Option<&'a batch_size_runtime::memory::MemorySnapshot>,
    device: &str,
) -> Option<&'a DeviceMemory> {
    snapshot?
        .devices
        .iter()
        .find(|memory| memory.device == device)
}

fn show(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "-".to_owned(), |bytes| Bytes(bytes).to_string())
}

fn describe(memory: Option<&DeviceMemory>) -> String {
    match memory {
        Some(memory) => format!(
            "{} free (pool reserves {})",
            Bytes(memory.free),
            show(memory.pool_reserved)
        ),
        None => "-".to_owned(),
    }
}

fn print_report(report: &SearchReport, device: &str) {
    for attempt in report.attempts() {
        print_attempt(attempt, device);
    }
}

fn print_attempt(attempt: &Attempt, device: &str) {
    println!("{attempt}");
    println!(
        "    before: {}",
        describe(figures(attempt.memory_at_start.as_ref(), device))
    );
    if matches!(attempt.outcome, Outcome::OutOfMemory { .. }) {
        println!(
            "    at the failure: {}",
            describe(figures(attempt.memory_at_end.as_ref(), device))
        );
        println!(
            "    after the release: {}",
            describe(figures(attempt.memory_after_release.as_ref(), device))
        );
    }
}

fn verdict(ok: bool, what: &str) -> bool {
    println!("{} {what}", if ok { "  ok:" } else { "  FAILED:" });
    ok
}
