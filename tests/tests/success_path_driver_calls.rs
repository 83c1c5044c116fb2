//! Nothing on the success path: through every door into the engine, a success
//! costs no synchronize and no pool trim, and only a bounded number of memory queries, with the
//! default release (`Release::cuda()`, the real cudarc path over the active primary context)
//! on the fake CUDA driver, which counts each call.
//!
//! Each door runs `N` successes, then `2N` more, from one warm start: the difference is `N`
//! successes' worth, so "per success" is exact, and whatever a door pays once (a run of chunks
//! starting) cancels out. The work itself allocates from the pool and frees, as a forward pass
//! does, but never synchronizes (checked by `the_work_alone_calls_nothing_that_is_measured`):
//! every synchronize counted is the library's.
//!
//! Run with `--nocapture` to see the memory queries per success of each door.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::Arc;

use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::MemoryBackend, remedies::Remedies,
    BatchSizeSearch, Chunked, EffectiveBatch, Outcome, Release, Tuner,
};
use batch_size_tests::cuda_scenario::TrainError;
use batch_size_tests::fake_cuda::{FakeCuda, FakeCudaCounters};
use cudarc::driver::{CudaContext, CudaStream};

/// A device large enough for every size used here but the out-of-memory test's first.
const CAPACITY: u64 = 1 << 30;
/// Successes per measurement: the door runs `N`, then `2 * N`.
const N: usize = 31;
/// The batch size of every success (the size each door starts at).
const SIZE: usize = 8;
/// Each buffer takes 64 KiB per sample; 4 buffers per step.
const LAYERS: usize = 4;
const BYTES_PER_SAMPLE: usize = 64 << 10;

/// Memory queries one success of a search may cost at most: its attempt begins by resetting
/// the pool's peak (1 `cuMemPoolSetAttribute`) and reading the figures (1 `cuMemGetInfo_v2` and
/// 3 `cuMemPoolGetAttribute`: reserved, used, used high-water). 1 + 1 + 3 = 5, all figures the
/// driver and the allocator already keep: no synchronize, no trim. Measured: exactly 5 for the
/// attribute (sync and async), `BatchSizeSearch::run` and `call`, and `RemediedSearch::run`.
const MAX_QUERIES_PER_SUCCESS: u64 = 5;

/// The same for a step of `EffectiveBatch` or a chunk of `Chunked`, whose convergence reads the
/// figures once more as each step or chunk ends (1 `cuMemGetInfo_v2` and 3
/// `cuMemPoolGetAttribute`) to learn what it used: 5 + 4 = 9. Measured: exactly 9.
const MAX_QUERIES_PER_LEARNING_STEP: u64 = 9;

/// One forward pass on `stream`: `LAYERS` stream-ordered buffers of `batch_size` samples, freed
/// (to the pool's cache) when it returns. Nothing here synchronizes.
fn work(stream: &Arc<CudaStream>, batch_size: usize) -> Result<usize, TrainError> {
    let mut activations = Vec::with_capacity(LAYERS);
    for _ in 0..LAYERS {
        activations.push(stream.alloc_zeros::<u8>(batch_size * BYTES_PER_SAMPLE)?);
    }
    Ok(batch_size)
}

/// What a door asked of the driver over some successes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cost {
    synchronizes: u64,
    trims: u64,
    mem_get_infos: u64,
    pool_attribute_reads: u64,
    pool_attribute_writes: u64,
}

impl Cost {
    fn between(before: &FakeCudaCounters, after: &FakeCudaCounters) -> Self {
        Cost {
            synchronizes: after.synchronizes - before.synchronizes,
            trims: after.trims - before.trims,
            mem_get_infos: after.mem_get_infos - before.mem_get_infos,
            pool_attribute_reads: after.pool_attribute_reads - before.pool_attribute_reads,
            pool_attribute_writes: after.pool_attribute_writes - before.pool_attribute_writes,
        }
    }

    fn memory_queries(&self) -> u64 {
        self.mem_get_infos + self.pool_attribute_reads + self.pool_attribute_writes
    }

    fn minus(&self, other: &Cost) -> Self {
        Cost {
            synchronizes: self.synchronizes - other.synchronizes,
            trims: self.trims - other.trims,
            mem_get_infos: self.mem_get_infos - other.mem_get_infos,
            pool_attribute_reads: self.pool_attribute_reads - other.pool_attribute_reads,
            pool_attribute_writes: self.pool_attribute_writes - other.pool_attribute_writes,
        }
    }
}

/// Runs `door(successes)` for 1 success (warming cudarc's stream and the pool up), then `N`,
/// then `2N`, and checks the door's promise: no synchronize and no trim at all, and at most
/// `max_queries` memory queries per success. Returns `(cost of N, cost of
/// 2N)` for the door's own assertions.
///
/// `door` runs `successes` successes on device 0 and returns how many ran (checked); the
/// largest ran `largest` samples per pass.
fn check_door(
    name: &str,
    largest: usize,
    max_queries: u64,
    mut door: impl FnMut(&Arc<CudaStream>, usize) -> usize,
) -> (Cost, Cost) {
    let cuda = FakeCuda::session(1, CAPACITY).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();

    assert_eq!(door(&stream, 1), 1, "{name}: the warm-up");
    let mut measure = |successes: usize| {
        let before = cuda.counters(0);
        assert_eq!(door(&stream, successes), successes, "{name}");
        let after = cuda.counters(0);
        assert_eq!(
            after.failed_allocations, 0,
            "{name}: nothing ran out of memory"
        );
        Cost::between(&before, &after)
    };
    let once = measure(N);
    let twice = measure(2 * N);
    let per_n = twice.minus(&once);

    let per_success = |count: u64| count as f64 / N as f64;
    eprintln!(
        "{name}: per success {} synchronizes, {} trims, {} memory queries \
         ({} cuMemGetInfo_v2, {} pool attribute reads, {} writes); \
         {} memory queries for {N} successes, {} for {}",
        per_success(per_n.synchronizes),
        per_success(per_n.trims),
        per_success(per_n.memory_queries()),
        per_success(per_n.mem_get_infos),
        per_success(per_n.pool_attribute_reads),
        per_success(per_n.pool_attribute_writes),
        once.memory_queries(),
        twice.memory_queries(),
        2 * N,
    );

    // Not one synchronize or trim, neither per success nor once per run.
    assert_eq!((once.synchronizes, once.trims), (0, 0), "{name}: {once:?}");
    assert_eq!(
        (twice.synchronizes, twice.trims),
        (0, 0),
        "{name}: {twice:?}"
    );
    // Memory queries: the same number for each success (N more successes, N times as many),
    // and few.
    assert_eq!(
        per_n.memory_queries() % N as u64,
        0,
        "{name}: {per_n:?} is not a whole number per success"
    );
    assert!(
        per_n.memory_queries() / N as u64 <= max_queries,
        "{name}: {per_n:?} over {N} successes"
    );
    // The pool kept what the successes freed (nothing synchronized or trimmed it): the next
    // success allocates from its cache, not from the driver.
    let counters = cuda.counters(0);
    assert_eq!(counters.live_allocations, 0, "{name}");
    assert_eq!(
        counters.pool_reserved,
        (LAYERS * largest * BYTES_PER_SAMPLE) as u64,
        "{name}: the pool holds the largest pass's buffers"
    );
    (once, twice)
}

#[test]
fn the_work_alone_calls_nothing_that_is_measured() {
    let (once, twice) = check_door("the work alone", SIZE, 0, |stream, successes| {
        (0..successes)
            .map(|_| work(stream, SIZE).unwrap())
            .filter(|&size| size == SIZE)
            .count()
    });
    assert_eq!(once.memory_queries(), 0);
    assert_eq!(twice.memory_queries(), 0);
}

#[find_executable_batch_size(starting = SIZE)]
fn train(batch_size: usize, stream: &Arc<CudaStream>) -> Result<usize, TrainError> {
    work(stream, batch_size)
}

#[test]
fn the_attribute_adds_no_synchronize_and_no_trim_per_success() {
    check_door(
        "#[find_executable_batch_size] fn",
        SIZE,
        MAX_QUERIES_PER_SUCCESS,
        |stream, successes| {
            (0..successes)
                .map(|_| train(stream).unwrap())
                .filter(|&size| size == SIZE)
                .count()
        },
    );
}

#[find_executable_batch_size(starting = SIZE)]
async fn train_async(batch_size: usize, stream: &Arc<CudaStream>) -> Result<usize, TrainError> {
    work(stream, batch_size)
}

#[test]
fn the_async_attribute_adds_no_synchronize_and_no_trim_per_success() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    check_door(
        "#[find_executable_batch_size] async fn",
        SIZE,
        MAX_QUERIES_PER_SUCCESS,
        |stream, successes| {
            (0..successes)
                .map(|_| runtime.block_on(train_async(stream)).unwrap())
                .filter(|&size| size == SIZE)
                .count()
        },
    );
}

#[test]
fn batch_size_search_run_adds_no_synchronize_and_no_trim_per_success() {
    check_door(
        "BatchSizeSearch::run",
        SIZE,
        MAX_QUERIES_PER_SUCCESS,
        |stream, successes| {
            (0..successes)
                .map(|_| {
                    BatchSizeSearch::new(SIZE)
                        .run(|batch_size| work(stream, batch_size))
                        .unwrap()
                })
                .filter(|&size| size == SIZE)
                .count()
        },
    );
}

#[test]
fn batch_size_search_call_adds_no_synchronize_and_no_trim_per_success() {
    check_door(
        "BatchSizeSearch::call",
        SIZE,
        MAX_QUERIES_PER_SUCCESS,
        |stream, successes| {
            (0..successes)
                .map(|_| {
                    BatchSizeSearch::new(SIZE)
                        .call(|batch_size| work(stream, batch_size).unwrap())
                        .unwrap()
                })
                .filter(|&size| size == SIZE)
                .count()
        },
    );
}

#[test]
fn a_remedied_search_adds_no_synchronize_and_no_trim_per_success() {
    let remedies = Remedies::new(1usize);
    check_door(
        "RemediedSearch::run",
        SIZE,
        MAX_QUERIES_PER_SUCCESS,
        |stream, successes| {
            (0..successes)
                .map(|_| {
                    let (size, ran) = BatchSizeSearch::new(SIZE)
                        .with_remedies(&remedies)
                        .run(|attempt| work(stream, attempt.batch_size() * attempt.settings()))
                        .unwrap();
                    assert!(ran.applied().is_empty());
                    size
                })
                .filter(|&size| size == SIZE)
                .count()
        },
    );
}

#[test]
fn effective_batch_steps_add_no_synchronize_and_no_trim() {
    // One runner for all its steps, as a training loop has. It starts with micro-batches of
    // `SIZE`, 4 per step; its convergence reads the figures after each step and, seeing that
    // the whole batch fits, runs it in one pass from the next step on (the largest pass).
    let effective = 4 * SIZE;
    let mut runner = EffectiveBatch::new(effective).with_micro(SIZE);
    check_door(
        "EffectiveBatch::step",
        effective,
        MAX_QUERIES_PER_LEARNING_STEP,
        |stream, successes| {
            (0..successes)
                .map(|_| {
                    runner.step(|plan| -> Result<usize, TrainError> {
                        let mut samples = 0;
                        for micro in plan.micro_batches() {
                            samples += work(stream, micro.range.len())?;
                        }
                        Ok(samples)
                    })
                })
                .filter(|samples| matches!(samples, Ok(samples) if *samples == effective))
                .count()
        },
    );
    eprintln!("EffectiveBatch: micro size {} at the end", runner.micro());
    assert!(runner.recoveries().is_empty());
}

#[test]
fn chunks_add_no_synchronize_and_no_trim() {
    // Every chunk fits; `with_max` keeps the run from growing past `SIZE`, so that every chunk
    // is a success at the same size.
    check_door(
        "Chunked::run",
        SIZE,
        MAX_QUERIES_PER_LEARNING_STEP,
        |stream, successes| {
            let mut chunked = Chunked::new(successes * SIZE)
                .with_starting(SIZE)
                .with_max(SIZE);
            let outputs = chunked
                .run(|items| work(stream, items.len()).map(|size| vec![size; size]))
                .unwrap();
            assert_eq!(outputs.len(), successes * SIZE);
            assert!(chunked
                .chunks()
                .iter()
                .all(|chunk| chunk.range.len() == SIZE));
            chunked.chunk_count()
        },
    );
}

#[test]
fn async_chunks_add_no_synchronize_and_no_trim() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    check_door(
        "Chunked::run_async",
        SIZE,
        MAX_QUERIES_PER_LEARNING_STEP,
        |stream, successes| {
            let mut chunked = Chunked::new(successes * SIZE)
                .with_starting(SIZE)
                .with_max(SIZE);
            let outputs = runtime
                .block_on(chunked.run_async(|items| async move {
                    work(stream, items.len()).map(|size| vec![size; size])
                }))
                .unwrap();
            assert_eq!(outputs.len(), successes * SIZE);
            chunked.chunk_count()
        },
    );
}

/// Not a door of the success path: a tuner's trials run the same work at other sizes, and each
/// starts from released memory on purpose (its readings are its own). Shown for contrast: one
/// release per trial after the first.
#[test]
fn a_tuner_releases_between_its_trials() {
    let cuda = FakeCuda::session(1, CAPACITY).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();

    let before = cuda.counters(0);
    let tuned = Tuner::new()
        .with_max(4 * SIZE)
        .run(|batch_size| work(&stream, batch_size))
        .unwrap();
    let cost = Cost::between(&before, &cuda.counters(0));
    let trials = tuned.report().len() as u64;
    eprintln!(
        "Tuner::run (not a success-path door): {trials} trials, {} synchronizes, {} trims, {} memory queries",
        cost.synchronizes,
        cost.trims,
        cost.memory_queries()
    );
    assert!(trials > 1, "{:?}", tuned.report());
    assert!(cost.trims >= trials - 1, "{cost:?} over {trials} trials");
    assert!(
        cost.synchronizes >= trials - 1,
        "{cost:?} over {trials} trials"
    );
}

/// The other side, so that the zeros above cannot pass vacuously: after an out-of-memory
/// attempt the default release does synchronize and trim, and the counters see it.
#[test]
fn an_out_of_memory_attempt_is_followed_by_a_release() {
    let cuda = FakeCuda::session(1, CAPACITY).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    // 4 buffers of 64 KiB per sample: 8192 samples need 2 GiB, 4096 fit in 1 GiB.
    let starting = 8192;

    let before = cuda.counters(0);
    let fitted = BatchSizeSearch::new(starting)
        .with_release(Release::cuda())
        .run(|batch_size| work(&stream, batch_size))
        .unwrap();
    let after = cuda.counters(0);
    let cost = Cost::between(&before, &after);

    assert!(fitted < starting);
    let report = last_report().unwrap();
    let failures = report.out_of_memory_count() as u64;
    assert!(matches!(
        report.attempts().next().unwrap().outcome,
        Outcome::OutOfMemory { .. }
    ));
    assert_eq!(report.last().unwrap().outcome, Outcome::Succeeded);
    assert!(after.failed_allocations > 0);
    eprintln!(
        "out of memory first: {} attempts, {failures} out of memory, {} synchronizes, {} trims, {} memory queries",
        report.len(),
        cost.synchronizes,
        cost.trims,
        cost.memory_queries()
    );
    // One release per failure: a context synchronize and a trim of the default pool each.
    assert_eq!(
        (cost.synchronizes, cost.trims),
        (failures, failures),
        "{cost:?}"
    );
    assert_eq!(cuda.calls("cuCtxSynchronize"), failures);
    assert_eq!(cuda.calls("cuMemPoolTrimTo"), failures);
    // And the memory queries are still counted: the released attempt's figures are read again.
    assert!(cost.memory_queries() > 0, "{cost:?}");
    // The release really released: the read after it saw an empty pool.
    let failed = report.attempts().next().unwrap();
    let after_release = failed.memory_after_release.as_ref().unwrap();
    assert_eq!(after_release.devices[0].pool_reserved, Some(0));
    // `Release::cuda()` as a backend directly: one more of each.
    let backend = batch_size_runtime::memory::CudaBackend::active();
    backend.release().unwrap();
    let released = cuda.counters(0);
    assert_eq!(
        (
            released.synchronizes - after.synchronizes,
            released.trims - after.trims
        ),
        (1, 1)
    );
}
