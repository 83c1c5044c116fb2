//! What `#[find_executable_batch_size]` costs when the first attempt fits: the same body called
//! directly, through the attribute with nothing to release, through the attribute with its
//! default release (CUDA, which does nothing where libcuda is absent or unused), and through
//! the engine's `run`.
//!
//! `cargo bench -p batch-size-tests --bench overhead -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use batch_size_runtime::{find_executable_batch_size, BatchSizeSearch, OutOfMemory, Release};
use criterion::{criterion_group, criterion_main, Criterion};

/// The body every variant runs: cheap, and opaque to the optimiser.
#[inline(always)]
fn body(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    let batch_size = black_box(batch_size);
    if batch_size > input.len() * 1024 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size + input.len())
}

#[inline(never)]
fn direct(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    body(batch_size, input)
}

#[find_executable_batch_size(starting = 64, release = batch_size_runtime::Release::none())]
fn attribute_release_none(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    body(batch_size, input)
}

#[find_executable_batch_size(starting = 64)]
fn attribute_default_release(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    body(batch_size, input)
}

#[find_executable_batch_size(starting = 64, release = batch_size_runtime::Release::none())]
fn attribute_plain_return(batch_size: usize, input: &[u32]) -> usize {
    batch_size + input.len()
}

#[inline(never)]
fn engine_release_none(input: &[u32]) -> anyhow::Result<usize> {
    BatchSizeSearch::new(64)
        .with_release(Release::none())
        .run(|batch_size| body(batch_size, input))
}

fn overhead(c: &mut Criterion) {
    let input = [1_u32, 2, 3];
    // Every variant must do the same work and fit at once.
    for result in [
        direct(64, &input).ok(),
        attribute_release_none(&input).ok(),
        attribute_default_release(&input).ok(),
        Some(attribute_plain_return(&input)),
        engine_release_none(&input).ok(),
    ] {
        assert_eq!(result, Some(67), "a variant did not fit at once");
    }

    let mut group = c.benchmark_group("first_attempt_fits");
    group.bench_function("direct", |b| {
        b.iter(|| direct(black_box(64), black_box(&input)))
    });
    group.bench_function("attribute_release_none", |b| {
        b.iter(|| attribute_release_none(black_box(&input)))
    });
    group.bench_function("attribute_default_release", |b| {
        b.iter(|| attribute_default_release(black_box(&input)))
    });
    group.bench_function("attribute_plain_return_release_none", |b| {
        b.iter(|| attribute_plain_return(black_box(&input)))
    });
    group.bench_function("engine_run_dyn_release_none", |b| {
        b.iter(|| engine_release_none(black_box(&input)))
    });
    group.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);
