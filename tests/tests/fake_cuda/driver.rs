//! End to end through the real cudarc against the fake CUDA driver (`tests/fake-cuda`): a model
//! whose memory grows with the batch size runs out of the device's memory, the search retries
//! it smaller, and `CudaBackend` gives the memory of each failed attempt back in between.
//!
//! One process, one fake driver: every test holds a `FakeCuda::session`, which serialises them
//! and resets the driver.
#![cfg(target_os = "linux")]

use std::sync::Arc;

use batch_size_runtime::memory::{CudaBackend, DeviceMemory, MemoryBackend};
use batch_size_runtime::Release;
use batch_size_runtime::{last_report, Attempt, BatchSizeSearch, NoExecutableBatchSize, Outcome};
use batch_size_tests::cuda_scenario::{capture_logs, FiguresOnly, GrowingModel, TrainError, MIB};
use batch_size_tests::fake_cuda::{FakeCuda, FakeCudaCounters};
use cudarc::driver::sys::{CUmemPool_attribute, CUresult};
use cudarc::driver::{result, CudaContext, DriverError};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const CAPACITY: u64 = 100 * MIB;
const STARTING: usize = 64;

/// 4 buffers of 1 MiB per sample: a step needs `4 * batch_size` MiB (64 -> 256 MiB).
fn model() -> GrowingModel {
    GrowingModel::new(4, MIB as usize)
}

/// The search under test: `model` on `ctx`'s default stream, from `STARTING`, with `release`.
/// Also returns the fake driver's counters for device 0 as each attempt began.
fn train(
    cuda: &FakeCuda,
    ctx: &Arc<CudaContext>,
    model: GrowingModel,
    release: impl Into<Release>,
) -> (Result<usize, TrainError>, Vec<FakeCudaCounters>) {
    let stream = ctx.default_stream();
    let mut at_start = Vec::new();
    let fitted = BatchSizeSearch::new(STARTING)
        .with_release(release)
        .run(|batch_size| {
            at_start.push(cuda.counters(0));
            model.step(&stream, batch_size).map_err(TrainError::from)
        });
    (fitted, at_start)
}

fn attempts() -> Vec<Attempt> {
    last_report()
        .map(|report| report.attempts().cloned().collect())
        .unwrap_or_default()
}

fn only_device(memory: Option<&batch_size_runtime::memory::MemorySnapshot>) -> DeviceMemory {
    let devices = memory
        .map(|snapshot| snapshot.devices.clone())
        .unwrap_or_default();
    assert_eq!(
        devices.len(),
        1,
        "expected one device's figures: {devices:?}"
    );
    devices[0].clone()
}

#[test]
fn cudarc_loads_the_fake_driver_as_libcuda() -> TestResult {
    let cuda = FakeCuda::session(2, CAPACITY)?;
    // SAFETY: only asks the loader whether a libcuda can be opened.
    assert!(unsafe { cudarc::driver::sys::is_culib_present() });
    assert!(CudaBackend::driver_loaded());
    assert_eq!(CudaContext::device_count()?, 2);

    let ctx = CudaContext::new(0)?;
    assert_eq!(
        cuda.calls("cuInit"),
        2,
        "device_count() and new() each call it"
    );
    assert_eq!(cuda.counters(0).primary_refcount, 1);
    assert_eq!(cuda.counters(0).contexts_created, 1);
    assert_eq!(ctx.name()?, "Fake CUDA Device 0");
    assert_eq!(ctx.mem_get_info()?, (CAPACITY as usize, CAPACITY as usize));

    let stream = ctx.default_stream();
    let data: Vec<u32> = (0..1024).collect();
    let on_device = stream.clone_htod(&data)?;
    assert_eq!(stream.clone_dtoh(&on_device)?, data);
    let zeros = stream.alloc_zeros::<u8>(3 * MIB as usize)?;
    assert_eq!(stream.clone_dtoh(&zeros.slice(..8))?, vec![0; 8]);
    assert_eq!(cuda.counters(0).live_allocations, 2);
    assert_eq!(cuda.counters(0).pool_used, 4096 + 3 * MIB);

    let error = stream.alloc_zeros::<u8>(CAPACITY as usize).err();
    assert_eq!(error, Some(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)));
    assert_eq!(cuda.counters(0).failed_allocations, 1);
    // What cudarc asked of the driver for that: a stream-ordered allocation per buffer, with
    // two events each (its read/write tracking), and a memset for the zeros.
    assert_eq!(cuda.calls("cuMemAllocAsync"), 3);
    assert_eq!(cuda.calls("cuEventCreate"), 4);
    assert_eq!(cuda.calls("cuMemsetD8Async"), 1);

    drop((on_device, zeros));
    assert_eq!(cuda.counters(0).live_allocations, 0);
    drop(stream);
    drop(ctx);
    assert_eq!(cuda.counters(0).primary_refcount, 0);
    Ok(())
}

#[test]
fn freed_pool_memory_stays_reserved_until_a_synchronize_or_a_trim() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();

    drop(stream.alloc_zeros::<u8>(10 * MIB as usize)?);
    let held = cuda.counters(0);
    assert_eq!((held.pool_used, held.pool_reserved), (0, 10 * MIB));
    assert_eq!(held.free, CAPACITY - 10 * MIB);
    // With the default release threshold (0), a synchronization gives it back.
    ctx.synchronize()?;
    assert_eq!(cuda.counters(0).pool_reserved, 0);

    // With a threshold (what frameworks set to keep their pool warm), only a trim does.
    // SAFETY: the device's default pool; RELEASE_THRESHOLD is a cuuint64_t.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
        let mut keep_everything = u64::MAX;
        result::mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_everything as *mut u64).cast(),
        )?;
    }
    drop(stream.alloc_zeros::<u8>(10 * MIB as usize)?);
    ctx.synchronize()?;
    assert_eq!(cuda.counters(0).pool_reserved, 10 * MIB);
    CudaBackend::active().release()?;
    let trimmed = cuda.counters(0);
    assert_eq!((trimmed.pool_reserved, trimmed.free), (0, CAPACITY));
    assert_eq!(trimmed.trims, 1);
    Ok(())
}

#[test]
fn the_search_finds_the_largest_batch_size_the_capacity_allows() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let model = model();
    let expected = model.largest_fitting(CAPACITY, STARTING);
    assert_eq!(expected, Some(16));

    let (fitted, _) = train(&cuda, &ctx, model, Release::cuda());

    assert_eq!(fitted.ok(), expected);
    let attempts = attempts();
    let sizes: Vec<usize> = attempts.iter().map(|attempt| attempt.batch_size).collect();
    assert_eq!(sizes, [64, 32, 16]);
    for attempt in &attempts[..2] {
        assert!(
            matches!(&attempt.outcome, Outcome::OutOfMemory { error } if error.contains("CUDA_ERROR_OUT_OF_MEMORY")),
            "{attempt}"
        );
    }
    assert_eq!(attempts[2].outcome, Outcome::Succeeded);
    // One release per failed attempt, each a synchronize and a trim of the default pool.
    assert_eq!(cuda.counters(0).trims, 2);
    assert_eq!(cuda.calls("cuMemPoolTrimTo"), 2);
    // The attempts really ran on the device: 16 fitted 4 buffers of 16 MiB.
    assert_eq!(cuda.counters(0).pool_used_high, 64 * MIB);
    Ok(())
}

#[test]
fn no_memory_is_left_allocated_or_reserved_after_a_failed_attempt() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;

    let (fitted, at_start) = train(&cuda, &ctx, model(), Release::cuda());

    assert_eq!(fitted.ok(), Some(16));
    // Read by the attempt itself, as it began: a clean device every time.
    assert_eq!(at_start.len(), 3);
    for counters in &at_start {
        assert_eq!(counters.live_allocations, 0, "{counters:?}");
        assert_eq!(counters.pool_reserved, 0, "{counters:?}");
        assert_eq!(counters.free, CAPACITY, "{counters:?}");
    }
    // And as the search recorded it, through CudaBackend's figures.
    let attempts = attempts();
    for attempt in attempts.iter().filter(|attempt| attempt.batch_size > 16) {
        let at_end = only_device(attempt.memory_at_end.as_ref());
        assert_eq!(at_end.device, "cuda:0");
        assert_eq!(
            at_end.pool_used,
            Some(0),
            "{attempt}: freed by Rust already"
        );
        assert!(
            at_end.pool_reserved > Some(0),
            "{attempt}: still held by the pool"
        );
        assert!(at_end.free < CAPACITY);

        let after = only_device(attempt.memory_after_release.as_ref());
        assert_eq!(after.pool_reserved, Some(0), "{attempt}");
        assert_eq!(after.pool_used, Some(0), "{attempt}");
        assert_eq!((after.free, after.total), (CAPACITY, CAPACITY), "{attempt}");
    }
    // 64: the first 64 MiB buffer fitted, the second did not; 32: three of 32 MiB fitted.
    let reserved_at_end: Vec<Option<u64>> = attempts[..2]
        .iter()
        .map(|attempt| only_device(attempt.memory_at_end.as_ref()).pool_reserved)
        .collect();
    assert_eq!(reserved_at_end, [Some(64 * MIB), Some(96 * MIB)]);
    Ok(())
}

#[test]
fn without_a_release_the_failed_attempts_memory_stays_reserved() -> TestResult {
    // Activations from the pool, then a plain workspace (as cuBLAS and cuDNN take theirs):
    // 5 MiB per sample, so 16 (80 MiB) is the largest size that fits a clean device.
    let model = model().with_workspace(MIB as usize);
    assert_eq!(model.largest_fitting(CAPACITY, STARTING), Some(16));

    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let (released, at_start) = train(&cuda, &ctx, model, Release::cuda());
    assert_eq!(released.ok(), Some(16));
    assert!(at_start.iter().all(|counters| counters.pool_reserved == 0));
    drop((ctx, cuda));

    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let (kept, at_start) = train(&cuda, &ctx, model, Release::none());

    // The second attempt began with the first one's 64 MiB still reserved by the pool...
    assert_eq!(at_start[0].pool_reserved, 0);
    assert_eq!(at_start[1].live_allocations, 0);
    assert_eq!(at_start[1].pool_reserved, 64 * MIB);
    assert_eq!(at_start[1].free, CAPACITY - 64 * MIB);
    // ...and from the third on, 96 MiB: the pool reuses it for the activations, but the
    // workspace, which is not the pool's, finds 4 MiB free and the search settles on 4.
    assert!(at_start[2..]
        .iter()
        .all(|counters| counters.pool_reserved == 96 * MIB));
    assert_eq!(kept.ok(), Some(4));
    assert_eq!(cuda.counters(0).trims, 0);
    drop((ctx, cuda));

    // The same with the figures read but nothing released: they show where the memory went.
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let (kept, _) = train(&cuda, &ctx, model, FiguresOnly(CudaBackend::active()));
    assert_eq!(kept.ok(), Some(4));
    let first = attempts().into_iter().next().ok_or("no attempt")?;
    let after = only_device(first.memory_after_release.as_ref());
    assert_eq!(after.pool_reserved, Some(64 * MIB));
    assert_eq!(after.pool_used, Some(0));
    assert_eq!(after.free, CAPACITY - 64 * MIB);
    Ok(())
}

#[test]
fn the_release_acts_only_on_active_contexts() -> TestResult {
    let cuda = FakeCuda::session(2, CAPACITY)?;
    let ctx = CudaContext::new(0)?; // device 1's primary context is never retained

    let (fitted, _) = train(&cuda, &ctx, model(), Release::cuda());

    assert_eq!(fitted.ok(), Some(16));
    let untouched = cuda.counters(1);
    assert_eq!(untouched.primary_retains, 0, "{untouched:?}");
    assert_eq!(untouched.contexts_created, 0, "{untouched:?}");
    assert_eq!(untouched.trims, 0, "{untouched:?}");
    assert_eq!(untouched.synchronizes, 0, "{untouched:?}");
    let used = cuda.counters(0);
    assert_eq!(used.trims, 2);
    assert_eq!(
        used.contexts_created, 1,
        "the backend never re-creates a context"
    );
    // Each use of the backend retained and released the active context: balanced.
    assert_eq!(used.primary_retains, used.primary_releases + 1);
    for attempt in attempts() {
        for snapshot in [&attempt.memory_at_start, &attempt.memory_at_end] {
            for device in snapshot.iter().flat_map(|snapshot| &snapshot.devices) {
                assert_eq!(device.device, "cuda:0");
            }
        }
    }
    // The thread's current context is left as it was.
    assert_eq!(result::ctx::get_current()?, Some(ctx.cu_ctx()));
    Ok(())
}

#[test]
fn nothing_is_touched_before_cuinit_or_after_the_last_context_is_released() -> TestResult {
    let cuda = FakeCuda::session(2, CAPACITY)?;
    let backend = CudaBackend::active();

    // Loaded, never initialised: no context can exist, and the backend starts none.
    backend.release()?;
    backend.reset_peak();
    assert!(backend.memory().is_empty());
    assert_eq!(cuda.calls("cuInit"), 0);
    assert_eq!(cuda.calls("cuDevicePrimaryCtxRetain"), 0);

    // Initialised, the context used, then released: inactive again, so left alone.
    let ctx = CudaContext::new(1)?;
    assert_eq!(backend.memory().devices.len(), 1);
    drop(ctx);
    let retains = cuda.calls("cuDevicePrimaryCtxRetain");
    backend.release()?;
    assert!(backend.memory().is_empty());
    assert_eq!(cuda.calls("cuDevicePrimaryCtxRetain"), retains);
    assert_eq!(cuda.counters(1).contexts_created, 1);
    assert_eq!(cuda.counters(0).contexts_created, 0);
    assert_eq!(cuda.calls("cuInit"), 1, "only cudarc's CudaContext::new");
    Ok(())
}

#[test]
fn with_contexts_acts_on_exactly_the_given_contexts() -> TestResult {
    let cuda = FakeCuda::session(2, CAPACITY)?;
    let ctx0 = CudaContext::new(0)?;
    let ctx1 = CudaContext::new(1)?;
    drop(ctx0.default_stream().alloc_zeros::<u8>(MIB as usize)?);
    drop(ctx1.default_stream().alloc_zeros::<u8>(MIB as usize)?);
    let current = result::ctx::get_current()?;

    let backend = CudaBackend::with_contexts(vec![Arc::clone(&ctx1)]);
    let memory = backend.memory();
    backend.release()?;

    assert_eq!(memory.devices.len(), 1);
    assert_eq!(memory.devices[0].device, "cuda:1");
    assert_eq!(memory.devices[0].pool_reserved, Some(MIB));
    assert_eq!(cuda.counters(1).pool_reserved, 0);
    assert_eq!(cuda.counters(1).trims, 1);
    assert_eq!(
        cuda.counters(0).pool_reserved,
        MIB,
        "device 0 was not given"
    );
    assert_eq!(cuda.counters(0).trims, 0);
    // No retain of its own: the backend holds the context.
    assert_eq!(cuda.counters(1).primary_retains, 1);
    assert_eq!(result::ctx::get_current()?, current);
    Ok(())
}

#[test]
fn memory_figures_appear_in_the_warn_log_and_in_no_executable_batch_size() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let too_big = GrowingModel::new(2, 64 * MIB as usize); // 1 sample: 128 MiB

    let (fitted, logs) = capture_logs(|| {
        BatchSizeSearch::new(4)
            .run(|batch_size| too_big.step(&stream, batch_size).map_err(TrainError::from))
    });

    let Err(TrainError::NoBatchSize(none_fit)) = fitted else {
        return Err("expected NoExecutableBatchSize".into());
    };
    assert_eq!(none_fit.tried(), &[4, 2, 1]);
    let message = none_fit.to_string();
    assert!(
        // With libcuda loaded, cudarc's Display is safe: the whole chain, the caller's words too.
        message.contains("Last out-of-memory error: a CUDA driver call failed: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"),
        "{message}"
    );
    assert!(message.contains("Memory at that failure: cuda:0 has a total capacity of 100.00 MiB of which 36.00 MiB is free; 0 bytes is allocated and 64.00 MiB is reserved by the pool but unallocated"), "{message}");
    let source = std::error::Error::source(&none_fit).ok_or("no source")?;
    assert_eq!(
        source.downcast_ref::<TrainError>().map(|error| matches!(
            error,
            TrainError::Cuda(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        )),
        Some(true)
    );

    let warnings: Vec<&str> = logs.lines().filter(|line| line.contains("WARN")).collect();
    assert_eq!(warnings.len(), 3, "{logs}");
    assert!(
        warnings[0].contains("out of memory; retrying")
            && warnings[0].contains("batch_size=4 next_batch_size=2"),
        "{logs}"
    );
    // `memory` is the device as the attempt failed (as PyTorch's message gives it), before the
    // release; `free_after_release` what the next attempt starts with.
    for warning in &warnings {
        assert!(
            warning.contains("memory=cuda:0: ") && warning.contains(" free of 100.00 MiB"),
            "{logs}"
        );
        assert!(warning.contains("free_after_release=100.00 MiB"), "{logs}");
    }
    assert!(
        warnings[2].contains("36.00 MiB free of 100.00 MiB, pool reserves 64.00 MiB"),
        "{logs}"
    );
    assert_eq!(cuda.counters(0).trims, 3);
    Ok(())
}

#[test]
fn the_peak_is_reset_before_each_attempt() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;

    let (fitted, _) = train(&cuda, &ctx, model(), Release::cuda());

    assert_eq!(fitted.ok(), Some(16));
    let attempts = attempts();
    for attempt in &attempts {
        let at_start = only_device(attempt.memory_at_start.as_ref());
        assert_eq!(at_start.peak, Some(0), "{attempt}");
    }
    let peaks: Vec<Option<u64>> = attempts[..2]
        .iter()
        .map(|attempt| only_device(attempt.memory_at_end.as_ref()).peak)
        .collect();
    assert_eq!(peaks, [Some(64 * MIB), Some(96 * MIB)]);
    assert_eq!(cuda.calls("cuMemPoolSetAttribute"), 3);
    Ok(())
}

#[test]
fn the_trim_gives_back_what_a_release_threshold_keeps() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    // SAFETY: the device's default pool; RELEASE_THRESHOLD is a cuuint64_t.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
        let mut keep_everything = u64::MAX;
        result::mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_everything as *mut u64).cast(),
        )?;
    }

    let (fitted, at_start) = train(&cuda, &ctx, model(), Release::cuda());

    assert_eq!(fitted.ok(), Some(16));
    assert!(at_start.iter().all(|counters| counters.pool_reserved == 0));
    // Synchronizing alone would have kept it all: the trim gave it back.
    assert_eq!(cuda.counters(0).trims, 2);
    Ok(())
}

#[test]
fn live_memory_survives_the_release() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let weights: Vec<u8> = (0..=255).cycle().take(20 * MIB as usize).collect();
    let on_device = stream.clone_htod(&weights)?;

    let (fitted, at_start) = train(&cuda, &ctx, model(), Release::cuda());

    // 80 MiB are left for the activations: 16 needs 64 MiB.
    let fitted = fitted.ok();
    assert_eq!(fitted, model().largest_fitting(80 * MIB, STARTING));
    assert_eq!(fitted, Some(16));
    for counters in &at_start {
        assert_eq!(counters.live_allocations, 1);
        assert_eq!(counters.pool_reserved, 20 * MIB);
    }
    for attempt in attempts().iter().filter(|attempt| attempt.batch_size > 16) {
        let after = only_device(attempt.memory_after_release.as_ref());
        assert_eq!(after.pool_used, Some(20 * MIB), "{attempt}");
        assert_eq!(after.pool_reserved, Some(20 * MIB), "{attempt}");
    }
    assert_eq!(stream.clone_dtoh(&on_device)?, weights);
    Ok(())
}

#[test]
fn devices_without_memory_pools_are_only_synchronized() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    cuda.set_memory_pools_supported(0, false);
    let ctx = CudaContext::new(0)?;
    assert!(!ctx.has_async_alloc());

    let (fitted, at_start) = train(&cuda, &ctx, model(), Release::cuda());

    assert_eq!(fitted.ok(), Some(16));
    assert!(at_start.iter().all(|counters| counters.free == CAPACITY));
    assert_eq!(cuda.calls("cuMemAllocAsync"), 0);
    assert_eq!(cuda.calls("cuDeviceGetDefaultMemPool"), 0);
    assert_eq!(cuda.counters(0).trims, 0);
    assert!(cuda.calls("cuCtxSynchronize") >= 2);
    let first = attempts().into_iter().next().ok_or("no attempt")?;
    let after = only_device(first.memory_after_release.as_ref());
    assert_eq!(
        (after.pool_reserved, after.pool_used, after.peak),
        (None, None, None)
    );
    assert_eq!(after.free, CAPACITY);
    Ok(())
}

#[test]
fn a_failing_release_is_logged_and_the_search_goes_on() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    cuda.fail("cuMemPoolTrimTo", CUresult::CUDA_ERROR_INVALID_VALUE);

    let ((fitted, _), logs) = capture_logs(|| train(&cuda, &ctx, model(), Release::cuda()));

    // The synchronize before the trim still gave the pool back (threshold 0).
    assert_eq!(fitted.ok(), Some(16));
    let failures: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("could not release device memory"))
        .collect();
    assert_eq!(failures.len(), 2, "{logs}");
    assert!(failures[0].contains("WARN"), "{logs}");
    assert!(
        failures[0].contains("cuMemPoolTrimTo returned CUDA_ERROR_INVALID_VALUE on cuda:0"),
        "{logs}"
    );
    let error = CudaBackend::active()
        .release()
        .err()
        .ok_or("release succeeded")?;
    assert_eq!(
        error.to_string(),
        "releasing device memory failed: cuMemPoolTrimTo returned CUDA_ERROR_INVALID_VALUE on cuda:0"
    );
    Ok(())
}

#[test]
fn a_failing_release_never_hides_the_attempts_error() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    cuda.fail("cuCtxSynchronize", CUresult::CUDA_ERROR_LAUNCH_FAILED);
    let stream = ctx.default_stream();
    let too_big = GrowingModel::new(1, 2 * CAPACITY as usize);

    let fitted: Result<usize, TrainError> = BatchSizeSearch::new(2)
        .run(|batch_size| too_big.step(&stream, batch_size).map_err(TrainError::from));

    let Err(TrainError::NoBatchSize(none_fit)) = fitted else {
        return Err("expected NoExecutableBatchSize".into());
    };
    assert_eq!(none_fit.tried(), &[2, 1]);
    let source = std::error::Error::source(&none_fit).ok_or("no source")?;
    assert!(matches!(
        source.downcast_ref::<TrainError>(),
        Some(TrainError::Cuda(DriverError(
            CUresult::CUDA_ERROR_OUT_OF_MEMORY
        )))
    ));
    assert_eq!(
        cuda.counters(0).trims,
        0,
        "the release stopped at its failed synchronize"
    );
    Ok(())
}

#[test]
fn run_with_anyhow_releases_the_same_way() -> TestResult {
    let cuda = FakeCuda::session(1, CAPACITY)?;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let model = model();

    let fitted: anyhow::Result<usize> = BatchSizeSearch::new(STARTING).run(|batch_size| {
        assert_eq!(cuda.counters(0).pool_reserved, 0);
        Ok(model.step(&stream, batch_size)?)
    });

    assert_eq!(fitted.ok(), Some(16));
    assert_eq!(cuda.counters(0).trims, 2);
    let none_fit: anyhow::Result<usize> = BatchSizeSearch::new(STARTING)
        .with_min(32)
        .run(|batch_size| Ok(model.step(&stream, batch_size)?));
    let error = none_fit.err().ok_or("a size fitted")?;
    let none_fit = error
        .downcast_ref::<NoExecutableBatchSize>()
        .ok_or("not NoExecutableBatchSize")?;
    assert_eq!(none_fit.tried(), &[64, 32]);
    assert!(none_fit.to_string().contains("cuda:0"));
    Ok(())
}
