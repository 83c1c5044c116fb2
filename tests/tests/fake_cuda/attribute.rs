//! The CUDA scenario through the attribute, with real cudarc calls against the fake driver and
//! the default release (the CUDA backend over active contexts).
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::Arc;

use batch_size_runtime::{find_executable_batch_size, last_report, NoExecutableBatchSize, Outcome};
use batch_size_tests::cuda_scenario::{GrowingModel, TrainError, MIB};
use batch_size_tests::fake_cuda::{FakeCuda, FakeCudaCounters};
use cudarc::driver::CudaContext;

/// 4 buffers of 1 MiB per sample; the device has 100 MiB: 64 and 32 do not fit, 16 does.
#[find_executable_batch_size(starting = 64)]
fn train(
    batch_size: usize,
    ctx: &Arc<CudaContext>,
    cuda: &FakeCuda,
    seen: &mut Vec<(usize, FakeCudaCounters)>,
) -> Result<usize, TrainError> {
    seen.push((batch_size, cuda.counters(0)));
    let stream = ctx.default_stream();
    Ok(GrowingModel::new(4, MIB as usize).step(&stream, batch_size)?)
}

#[test]
fn the_attribute_finds_the_size_and_each_retry_starts_from_an_empty_pool() {
    let cuda = FakeCuda::session(1, 100 * MIB).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let mut seen = Vec::new();

    assert_eq!(train(&ctx, &cuda, &mut seen).unwrap(), 16);

    let sizes: Vec<usize> = seen.iter().map(|(size, _)| *size).collect();
    assert_eq!(sizes, [64, 32, 16]);
    for (size, counters) in &seen[1..] {
        assert_eq!(counters.live_allocations, 0, "at batch size {size}");
        assert_eq!(counters.pool_reserved, 0, "pool not trimmed before {size}");
    }
    assert!(cuda.counters(0).trims >= 2, "one trim per failed attempt");

    let report = last_report().unwrap();
    assert_eq!(report.out_of_memory_count(), 2);
    for attempt in report.attempts().take(2) {
        assert!(
            matches!(&attempt.outcome, Outcome::OutOfMemory { error } if error.contains("CUDA_ERROR_OUT_OF_MEMORY"))
        );
        let after = attempt.memory_after_release.as_ref().unwrap();
        assert_eq!(after.devices[0].device, "cuda:0");
        assert_eq!(after.devices[0].pool_reserved, Some(0));
        assert_eq!(after.devices[0].free, 100 * MIB);
    }
}

#[test]
fn when_nothing_fits_the_error_names_the_sizes_the_device_and_its_memory() {
    let cuda = FakeCuda::session(1, 2 * MIB).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let mut seen = Vec::new();

    let error = train(&ctx, &cuda, &mut seen).unwrap_err();
    let TrainError::NoBatchSize(none_fit) = &error else {
        panic!("expected NoBatchSize, got {error:?}");
    };
    assert_eq!(none_fit.tried(), &[64, 32, 16, 8, 4, 2, 1]);
    let message = none_fit.to_string();
    assert!(
        message.starts_with("No executable batch size found: reached zero"),
        "{message}"
    );
    assert!(message.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{message}");
    assert!(
        message.contains("cuda:0 has a total capacity of 2.00 MiB"),
        "{message}"
    );
    // The last OOM error is kept as the source, still the driver's typed error.
    let source = std::error::Error::source(none_fit).unwrap();
    assert!(source.downcast_ref::<TrainError>().is_some());
    let _: &NoExecutableBatchSize = none_fit;
}
