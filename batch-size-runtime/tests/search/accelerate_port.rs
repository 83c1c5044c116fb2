//! Every case of Accelerate's tests/test_memory_utils.py, at the engine level.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::error::Error;

use batch_size_runtime::policy::Halve;

use crate::block_on;
use batch_size_runtime::{
    last_report, memory::SimulatedDevice, BatchSizeSearch, NoExecutableBatchSize, OutOfMemory,
    Outcome, StopReason,
};
use block_on::block_on;

/// Accelerate's `raise_fake_out_of_memory`.
fn fake_out_of_memory() -> anyhow::Error {
    anyhow::anyhow!("CUDA out of memory.")
}

const ACCELERATE_SEQUENCE: [usize; 23] = [
    128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8,
];

fn none_fit(error: &anyhow::Error) -> &NoExecutableBatchSize {
    error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap_or_else(|| panic!("expected NoExecutableBatchSize, got {error:#}"))
}

#[test]
fn memory_implicit_with_factor_0_9_reproduces_accelerate() {
    let mut batch_sizes = Vec::new();
    let result: anyhow::Result<()> = BatchSizeSearch::new(128)
        .with_factor(0.9)
        .run(|batch_size| {
            batch_sizes.push(batch_size);
            if batch_size != 8 {
                return Err(fake_out_of_memory());
            }
            Ok(())
        });
    result.unwrap();
    assert_eq!(batch_sizes, ACCELERATE_SEQUENCE);
}

#[test]
fn memory_implicit_halving_by_default() {
    let mut batch_sizes = Vec::new();
    let result: anyhow::Result<()> = BatchSizeSearch::new(128).run(|batch_size| {
        batch_sizes.push(batch_size);
        if batch_size != 8 {
            return Err(fake_out_of_memory());
        }
        Ok(())
    });
    result.unwrap();
    assert_eq!(batch_sizes, [128, 64, 32, 16, 8]);
}

#[test]
fn memory_explicit_extra_arguments_pass_through() {
    let arg1 = String::from("hello");
    let mut batch_sizes = Vec::new();
    let result: anyhow::Result<(usize, String)> =
        BatchSizeSearch::new(128)
            .with_factor(0.9)
            .run(|batch_size| {
                batch_sizes.push(batch_size);
                if batch_size != 8 {
                    return Err(fake_out_of_memory());
                }
                Ok((batch_size, arg1.clone()))
            });
    let (batch_size, arg) = result.unwrap();
    assert_eq!(batch_sizes, ACCELERATE_SEQUENCE);
    assert_eq!((batch_size, arg.as_str()), (8, "hello"));
}

#[test]
fn start_zero_never_calls_the_attempt() {
    let mut calls = 0;
    let result: anyhow::Result<()> = BatchSizeSearch::new(0).run(|_| {
        calls += 1;
        Ok(())
    });
    let error = result.unwrap_err();
    assert_eq!(calls, 0);
    let none_fit = none_fit(&error);
    assert_eq!(none_fit.reason(), &StopReason::StartedAtZero);
    assert!(none_fit.tried().is_empty());
    assert!(error
        .to_string()
        .starts_with("No executable batch size found"));
}

#[test]
fn approach_zero_reports_reached_zero() {
    let result: anyhow::Result<()> = BatchSizeSearch::new(16).run(|_| Err(fake_out_of_memory()));
    let error = result.unwrap_err();
    let none_fit = none_fit(&error);
    assert_eq!(none_fit.reason(), &StopReason::ReachedZero);
    assert_eq!(none_fit.tried(), &[16, 8, 4, 2, 1]);
    let message = error.to_string();
    assert!(
        message.starts_with("No executable batch size found: reached zero"),
        "{message}"
    );
    assert!(message.contains("16, 8, 4, 2, 1"), "{message}");
    assert!(message.contains("CUDA out of memory."), "{message}");
}

#[test]
fn approach_zero_with_factor_ends_at_zero_too() {
    let result: anyhow::Result<()> = BatchSizeSearch::new(3)
        .with_factor(0.9)
        .run(|_| Err(fake_out_of_memory()));
    let error = result.unwrap_err();
    // floor(3 * 0.9) = 2, floor(2 * 0.9) = 1, floor(0.9) = 0
    assert_eq!(none_fit(&error).tried(), &[3, 2, 1]);
    assert_eq!(none_fit(&error).reason(), &StopReason::ReachedZero);
}

#[test]
fn custom_reduction_keeps_its_own_state_and_sees_the_failure() {
    // Accelerate's reduce_batch_size_fn (PR #3071), with the context of PR #3650.
    let mut seen = Vec::new();
    let mut step = 0;
    let mut batch_sizes = Vec::new();
    let result: anyhow::Result<usize> = BatchSizeSearch::new(128)
        .with_reduce(|failed| {
            seen.push((failed.batch_size, failed.attempt, failed.error.to_owned()));
            step += 1;
            failed.batch_size - 10 * step
        })
        .run(|batch_size| {
            batch_sizes.push(batch_size);
            if batch_size > 100 {
                return Err(fake_out_of_memory());
            }
            Ok(batch_size)
        });
    assert_eq!(result.unwrap(), 98);
    assert_eq!(batch_sizes, [128, 118, 98]);
    assert_eq!(
        seen,
        [
            (128, 1, "CUDA out of memory.".to_owned()),
            (118, 2, "CUDA out of memory.".to_owned())
        ]
    );
}

#[test]
fn a_reduction_that_does_not_shrink_stops_the_search() {
    let mut calls = 0;
    let result: anyhow::Result<()> = BatchSizeSearch::new(32)
        .with_reduce(|failed| failed.batch_size)
        .run(|_| {
            calls += 1;
            Err(fake_out_of_memory())
        });
    let error = result.unwrap_err();
    assert_eq!(calls, 1);
    assert_eq!(
        none_fit(&error).reason(),
        &StopReason::NotSmaller {
            failed: 32,
            proposed: 32
        }
    );
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("Oops, we had an error!")]
struct Oops;

#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error(transparent)]
    Oops(#[from] Oops),
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

#[test]
fn any_other_error_passes_through_untouched_after_one_call() {
    let mut calls = 0;
    let result: Result<(), TrainError> = BatchSizeSearch::new(128).run(|_| {
        calls += 1;
        Err(Oops.into())
    });
    assert_eq!(calls, 1);
    assert!(matches!(result, Err(TrainError::Oops(Oops))));

    let mut calls = 0;
    let result: anyhow::Result<()> = BatchSizeSearch::new(128).run(|_| {
        calls += 1;
        Err(Oops.into())
    });
    assert_eq!(calls, 1);
    assert_eq!(result.unwrap_err().downcast_ref::<Oops>(), Some(&Oops));
    let report = last_report().unwrap();
    assert!(
        matches!(&report.attempts().next().unwrap().outcome, Outcome::Failed { error } if error == "Oops, we had an error!")
    );
}

#[test]
fn a_panic_that_is_not_oom_resumes_with_its_payload() {
    let caught = std::panic::catch_unwind(|| {
        BatchSizeSearch::new(8).call(|_| -> () { std::panic::panic_any(42_u32) })
    });
    let payload = caught.unwrap_err();
    assert_eq!(payload.downcast_ref::<u32>(), Some(&42));
}

#[test]
fn an_oom_panic_is_retried() {
    let mut batch_sizes = Vec::new();
    let fitted = BatchSizeSearch::new(32).call(|batch_size| {
        batch_sizes.push(batch_size);
        if batch_size > 8 {
            panic!("CUDA out of memory. Tried to allocate {} MiB", batch_size);
        }
        batch_size
    });
    assert_eq!(fitted.unwrap(), 8);
    assert_eq!(batch_sizes, [32, 16, 8]);
}

#[test]
fn min_and_max_attempts_stop_the_search() {
    let result: anyhow::Result<()> = BatchSizeSearch::new(100)
        .with_min(20)
        .run(|_| Err(fake_out_of_memory()));
    let error = result.unwrap_err();
    // Halving steps from 25 to 12, below `min`: 20 itself is tried before the search gives up.
    assert_eq!(none_fit(&error).tried(), &[100, 50, 25, 20]);
    assert_eq!(
        none_fit(&error).reason(),
        &StopReason::BelowMinimum { next: 12, min: 20 }
    );

    let result: anyhow::Result<()> = BatchSizeSearch::new(100)
        .with_max_attempts(2)
        .run(|_| Err(fake_out_of_memory()));
    assert_eq!(none_fit(&result.unwrap_err()).tried(), &[100, 50]);

    let mut calls = 0;
    let result: anyhow::Result<()> = BatchSizeSearch::new(10).with_min(11).run(|_| {
        calls += 1;
        Ok(())
    });
    assert_eq!(calls, 0);
    assert_eq!(
        none_fit(&result.unwrap_err()).reason(),
        &StopReason::BelowMinimum { next: 10, min: 11 }
    );
}

#[test]
fn an_invalid_factor_stops_before_the_first_attempt() {
    for factor in [0.0, 1.0, 1.5, -0.5, f64::NAN] {
        let mut calls = 0;
        let result: anyhow::Result<()> = BatchSizeSearch::new(10).with_factor(factor).run(|_| {
            calls += 1;
            Ok(())
        });
        assert_eq!(calls, 0, "factor {factor}");
        let error = result.unwrap_err();
        assert!(matches!(
            none_fit(&error).reason(),
            StopReason::InvalidConfiguration(_)
        ));
        assert!(error.to_string().contains("factor"), "{error}");
    }
}

#[test]
fn no_executable_batch_size_keeps_the_last_oom_as_its_source() {
    let result: Result<(), Box<dyn Error + Send + Sync>> = BatchSizeSearch::new(4).run(|n| {
        Err(Box::new(OutOfMemory::new().with_requested(n as u64)) as Box<dyn Error + Send + Sync>)
    });
    let error = result.unwrap_err();
    let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    let source = none_fit.source().unwrap();
    assert_eq!(
        source.downcast_ref::<OutOfMemory>(),
        Some(&OutOfMemory::new().with_requested(1))
    );
    fn assert_send_sync_static<T: Send + Sync + 'static>(_: &T) {}
    assert_send_sync_static(none_fit);
}

#[test]
fn panics_keep_their_description_as_source() {
    let result = BatchSizeSearch::new(2).call(|_| -> () {
        panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
    });
    let error = result.unwrap_err();
    assert_eq!(error.tried(), &[2, 1]);
    assert_eq!(
        error.source().unwrap().to_string(),
        "CUDA out of memory. Tried to allocate 1.00 GiB"
    );
}

#[test]
fn every_attempt_is_recorded_with_memory_figures() {
    let device = SimulatedDevice::new(100 << 20).with_caching();
    let result: Result<usize, anyhow::Error> = BatchSizeSearch::new(64)
        .with_release(device.clone())
        .run(|batch_size| {
            let _activations = device.alloc(batch_size as u64 * (4 << 20))?;
            Ok(batch_size)
        });
    // 25 samples fill the device. From one failure the guided default cannot rule out that
    // more would have been allocated after the failing request, so it tries halving's 32
    // first; the two failures then say 25 fit, and it keeps 5 % free: 23 (halving: 16).
    assert_eq!(result.unwrap(), 23);
    let report = last_report().unwrap();
    let sizes: Vec<usize> = report
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(sizes, [64, 32, 23]);
    assert_eq!(report.out_of_memory_count(), 2);
    assert_eq!(report.batch_size(), Some(23));
    for attempt in report.attempts().take(2) {
        assert!(matches!(attempt.outcome, Outcome::OutOfMemory { .. }));
        let after = attempt.memory_after_release.as_ref().unwrap();
        assert_eq!(after.free(), 100 << 20, "release gave the cache back");
        assert!(attempt.memory_at_end.is_some());
    }
    // The cache kept the failed attempts' nothing (they never allocated), so release_count is
    // what matters: once per OOM.
    assert_eq!(device.release_count(), 2);
}

#[test]
fn release_gives_the_failed_attempts_memory_back() {
    let device = SimulatedDevice::new(10 << 20).with_caching();
    let attempt = |batch_size: usize| -> anyhow::Result<usize> {
        let _activations = device.alloc((batch_size as u64) << 20)?;
        let _weights = device.alloc(6 << 20)?;
        Ok(batch_size)
    };
    // With release, the cache of the failed attempt is given back: 4 fits next to 6 MiB.
    let fitted: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .with_policy(Halve)
        .with_release(device.clone())
        .run(attempt);
    assert_eq!(fitted.unwrap(), 4);

    // Without it, the failed attempt's activations stay cached, in a block of a size no later
    // attempt asks for, and nothing fits any more.
    let device = SimulatedDevice::new(10 << 20).with_caching();
    let attempt = |batch_size: usize| -> anyhow::Result<usize> {
        let _activations = device.alloc((batch_size as u64) << 20)?;
        let _weights = device.alloc(6 << 20)?;
        Ok(batch_size)
    };
    let result: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .with_policy(Halve)
        .with_release(batch_size_runtime::memory::NoRelease)
        .run(attempt);
    assert!(result.unwrap_err().is::<NoExecutableBatchSize>());
}

#[test]
fn async_attempts_are_retried_and_their_panics_classified() {
    let mut batch_sizes = Vec::new();
    let future = BatchSizeSearch::new(16).run_async(|batch_size| {
        batch_sizes.push(batch_size);
        async move {
            if batch_size > 4 {
                panic!("CUDA out of memory. Tried to allocate 8.00 GiB");
            }
            if batch_size > 2 {
                return Err(anyhow::Error::new(OutOfMemory::new()));
            }
            Ok(batch_size)
        }
    });
    assert_eq!(block_on(future).unwrap(), 2);
    assert_eq!(batch_sizes, [16, 8, 4, 2]);

    let future =
        BatchSizeSearch::new(16).run_async(|_| async { Err::<(), _>(TrainError::Oops(Oops)) });
    assert!(matches!(block_on(future), Err(TrainError::Oops(Oops))));
}

#[test]
fn the_source_of_an_anyhow_search_downcasts_to_the_error_the_attempt_returned() {
    let result: anyhow::Result<()> =
        BatchSizeSearch::new(2).run(|n| Err(OutOfMemory::new().with_requested(n as u64).into()));
    let error = result.unwrap_err();
    let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    let source = none_fit.source().unwrap();
    assert_eq!(
        source.downcast_ref::<OutOfMemory>(),
        Some(&OutOfMemory::new().with_requested(1))
    );
}

#[test]
fn the_state_machine_hands_its_report_to_last_report_at_the_end() {
    let mut search = BatchSizeSearch::new(4).start();
    search.begin().unwrap();
    let oom = OutOfMemory::new();
    search.out_of_memory(batch_size_runtime::oom::classify_error(&oom).unwrap(), None);
    assert_eq!(search.report().len(), 1);
    search.begin().unwrap();
    search.succeeded();
    assert!(search.report().is_empty());
    let report = last_report().unwrap();
    assert_eq!(report.len(), 2);
    assert_eq!(report.batch_size(), Some(2));
    // Beginning again says the search ended, and leaves last_report() alone.
    let again = search.begin().unwrap_err();
    assert!(
        matches!(again.reason(), StopReason::InvalidConfiguration(why) if why.contains("ended"))
    );
    assert_eq!(last_report().unwrap().batch_size(), Some(2));
}
