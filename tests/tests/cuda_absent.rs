//! A process where libcuda is not loaded (whether or not the machine has one: nothing here
//! loads it): the CUDA backend does nothing, the search works, and cudarc's out-of-memory error
//! is recognised and reported without a driver to format it.

use batch_size_runtime::memory::{CudaBackend, MemoryBackend};
use batch_size_runtime::Release;
use batch_size_runtime::{last_report, BatchSizeSearch, NoExecutableBatchSize, Outcome};
use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error("a CUDA driver call failed")]
    Cuda(#[from] DriverError),
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

const OUT_OF_MEMORY: DriverError = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);

#[test]
fn the_cuda_backend_does_nothing_without_libcuda() {
    assert!(!CudaBackend::driver_loaded());
    for backend in [CudaBackend::active(), CudaBackend::default()] {
        assert!(backend.release().is_ok());
        backend.reset_peak();
        assert!(backend.memory().is_empty());
    }
    assert!(Release::cuda().memory_backend().memory().is_empty());
    assert!(!CudaBackend::driver_loaded(), "the backend loaded libcuda");
}

#[test]
fn the_search_works_and_records_no_figures_without_libcuda() {
    let fitted: Result<usize, TrainError> = BatchSizeSearch::new(64).run(|batch_size| {
        if batch_size > 8 {
            return Err(OUT_OF_MEMORY.into());
        }
        Ok(batch_size)
    });

    assert_eq!(fitted.ok(), Some(8));
    let report = last_report().unwrap_or_default();
    assert_eq!(report.len(), 4);
    for attempt in report.attempts() {
        assert_eq!(attempt.memory_at_start, None);
        assert_eq!(attempt.memory_at_end, None);
        assert_eq!(attempt.memory_after_release, None);
    }
    assert!(!CudaBackend::driver_loaded());
}

#[test]
fn cudarcs_out_of_memory_error_is_classified_and_reported_without_libcuda() {
    let fitted: Result<usize, TrainError> =
        BatchSizeSearch::new(4).run(|_| Err(OUT_OF_MEMORY.into()));

    let none_fit = match fitted {
        Err(TrainError::NoBatchSize(none_fit)) => none_fit,
        other => unreachable!("expected NoExecutableBatchSize, got {:?}", other.ok()),
    };
    assert_eq!(none_fit.tried(), &[4, 2, 1]);
    // Formatting never reaches cudarc's Display, which would call libcuda and panic.
    let message = none_fit.to_string();
    assert!(
        message.contains("Last out-of-memory error: CUDA driver error CUDA_ERROR_OUT_OF_MEMORY"),
        "{message}"
    );
    assert!(!message.contains("Memory at that failure"), "{message}");
    let report = none_fit.report();
    assert!(report.attempts().all(|attempt| matches!(
        &attempt.outcome,
        Outcome::OutOfMemory { error } if error == "CUDA driver error CUDA_ERROR_OUT_OF_MEMORY"
    )));
    assert!(!CudaBackend::driver_loaded());
}
