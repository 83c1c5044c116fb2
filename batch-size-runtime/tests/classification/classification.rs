//! OOM detection: one test per pattern of the table, through `anyhow` and `Box<dyn Error>`,
//! typed cudarc errors without a driver, panics, and user rules.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::error::Error;
use std::fmt;

use batch_size_runtime::oom::{self, OomKind, OOM_PATTERNS};
use batch_size_runtime::OutOfMemory;
use cudarc::cublas::{result::CublasError, sys::cublasStatus_t};
use cudarc::curand::{result::CurandError, sys::curandStatus_t};
use cudarc::driver::{sys::CUresult, DriverError};

/// A message for each pattern, as its framework prints it.
fn example_message(pattern: &str) -> String {
    match pattern {
        "CUDA out of memory" => "Internal torch error: CUDA out of memory. Tried to allocate 2.22 GiB. GPU 0 has a total capacity of 79.15 GiB of which 228.38 MiB is free.".into(),
        "CUDA error: out of memory" => "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported".into(),
        " out of memory." => "RuntimeError: CUDA out of memory.".into(),
        "CUDA_ERROR_OUT_OF_MEMORY" => "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        "out of device memory" => "out of device memory allocating 1073741824 bytes".into(),
        "OutOfMemory { size:" => "called `Result::unwrap()` on an `Err` value: OutOfMemory { size: 4096 }".into(),
        other => format!("error: {other} (while running the step)"),
    }
}

#[derive(Debug)]
struct Layer {
    message: &'static str,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message)
    }
}

impl Error for Layer {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

#[test]
fn every_pattern_is_recognised_as_text_through_anyhow_and_box() {
    assert!(OOM_PATTERNS.len() >= 15);
    for pattern in OOM_PATTERNS {
        let message = example_message(pattern.text);
        let found = oom::classify_text(&message)
            .unwrap_or_else(|| panic!("{:?} not recognised in {message:?}", pattern.text));
        assert!(
            matches!(found.kind, OomKind::Pattern(p) if message.contains(p.text)),
            "{found:?}"
        );

        // anyhow, with context on top.
        let error = anyhow::anyhow!(message.clone()).context("training step 3");
        assert!(oom::is_out_of_memory(error.as_ref()), "anyhow: {message}");

        // Box<dyn Error + Send + Sync> holding a chain whose inner layer carries the text.
        let boxed: Box<dyn Error + Send + Sync> = Box::new(Layer {
            message: "epoch 1 failed",
            source: Some(message.clone().into()),
        });
        assert!(oom::is_out_of_memory(&*boxed), "box chain: {message}");

        // Panics: &str and String payloads.
        let payload: Box<dyn std::any::Any + Send> = Box::new(message.clone());
        assert!(oom::classify_panic(&*payload).is_some(), "panic: {message}");
    }
}

#[test]
fn ordinary_errors_are_not_out_of_memory() {
    for message in [
        "index out of bounds: the len is 3 but the index is 5",
        "shape mismatch in matmul, lhs: [2, 3], rhs: [4, 5]",
        "memory access out of range",
        "CUDA error: an illegal memory access was encountered",
        "DriverError(CUDA_ERROR_INVALID_VALUE, \"invalid argument\")",
    ] {
        assert!(oom::classify_text(message).is_none(), "{message}");
        assert!(!oom::is_out_of_memory(anyhow::anyhow!(message).as_ref()));
    }
}

#[test]
fn cudarc_driver_error_is_recognised_by_code_without_a_driver() {
    // No libcuda on CI: formatting this error would panic. Classification must not format it.
    let error = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let found = oom::classify_error(&error).unwrap();
    assert_eq!(found.kind, OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY"));
    assert!(found.description.contains("CUDA_ERROR_OUT_OF_MEMORY"));

    let other = DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
    assert!(oom::classify_error(&other).is_none());

    // Inside anyhow with context, and inside a user's error.
    let wrapped = anyhow::Error::new(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        .context("allocating activations");
    let found = oom::classify_error(wrapped.as_ref()).unwrap();
    assert_eq!(found.kind, OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY"));

    #[derive(Debug, thiserror::Error)]
    enum ModelError {
        #[error("cuda: {0}")]
        Cuda(#[from] DriverError),
    }
    let mine = ModelError::from(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    // Its Display would call cudarc's Display; classification reads the code instead.
    let _ = std::error::Error::source(&mine);
    let boxed: Box<dyn Error + Send + Sync> = Box::new(Layer {
        message: "step",
        source: Some(Box::new(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))),
    });
    assert!(oom::is_out_of_memory(&*boxed));
}

#[test]
fn cublas_and_curand_allocation_failures_are_recognised() {
    let cublas = CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED);
    assert_eq!(
        oom::classify_error(&cublas).unwrap().kind,
        OomKind::Cudarc("CUBLAS_STATUS_ALLOC_FAILED")
    );
    assert!(
        oom::classify_error(&CublasError(cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE)).is_none()
    );

    let curand = CurandError(curandStatus_t::CURAND_STATUS_ALLOCATION_FAILED);
    assert_eq!(
        oom::classify_error(&curand).unwrap().kind,
        OomKind::Cudarc("CURAND_STATUS_ALLOCATION_FAILED")
    );
    assert!(
        oom::classify_error(&CurandError(curandStatus_t::CURAND_STATUS_NOT_INITIALIZED)).is_none()
    );
}

#[test]
fn the_crate_error_and_io_out_of_memory_are_typed() {
    let own = anyhow::Error::new(OutOfMemory::new().with_requested(1024)).context("step");
    let found = oom::classify_error(own.as_ref()).unwrap();
    assert_eq!(found.kind, OomKind::Crate);
    assert_eq!(found.figures.requested, Some(1024));

    let io = std::io::Error::from(std::io::ErrorKind::OutOfMemory);
    assert_eq!(oom::classify_error(&io).unwrap().kind, OomKind::Io);
    assert!(oom::classify_error(&std::io::Error::from(std::io::ErrorKind::NotFound)).is_none());
}

#[test]
fn candle_style_errors_are_recognised_through_their_wrappers() {
    // candle_core::Error::Cuda(Box<dyn Error>) inside WithBacktrace / Context prints the
    // cudarc Debug text of the driver error.
    let inner: Box<dyn Error + Send + Sync> =
        "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into();
    let with_backtrace = Layer {
        message: "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")\n   0: backtrace",
        source: None,
    };
    assert!(oom::is_out_of_memory(&*inner));
    assert!(oom::is_out_of_memory(&with_backtrace));
}

#[test]
fn panic_payloads_of_every_kind() {
    let text: Box<dyn std::any::Any + Send> =
        Box::new("CUDA out of memory. Tried to allocate 20.00 MiB");
    assert_eq!(
        oom::classify_panic(&*text).unwrap().figures.requested,
        Some(20 << 20)
    );
    let typed: Box<dyn std::any::Any + Send> = Box::new(OutOfMemory::new());
    assert!(oom::classify_panic(&*typed).is_some());
    let anyhow_payload: Box<dyn std::any::Any + Send> =
        Box::new(anyhow::Error::new(OutOfMemory::new()));
    assert!(oom::classify_panic(&*anyhow_payload).is_some());
    let unrelated: Box<dyn std::any::Any + Send> = Box::new(7_i32);
    assert!(oom::classify_panic(&*unrelated).is_none());
}

#[test]
fn user_rules_extend_detection_to_errors_and_panics() {
    const MARKER: &str = "my_accel: arena exhausted (rule test)";
    assert!(oom::classify_text(MARKER).is_none());
    oom::add_rule(|error| error.to_string().contains("arena exhausted"));
    let found = oom::classify_text(MARKER).unwrap();
    assert_eq!(found.kind, OomKind::Rule);
    let error = anyhow::anyhow!(MARKER).context("accelerator step");
    assert!(oom::is_out_of_memory(error.as_ref()));
}

#[test]
fn a_pattern_past_the_first_line_is_found_and_the_description_is_the_line_that_matched() {
    // The report and the WARN line say what ran out, not the error's first line.
    let error = anyhow::anyhow!(
        "step 12 failed\ncaused by: CUDA out of memory. Tried to allocate 1.00 GiB"
    );
    let found = oom::classify_error(error.as_ref()).unwrap();
    assert_eq!(
        found.description,
        "caused by: CUDA out of memory. Tried to allocate 1.00 GiB"
    );
    assert_eq!(found.figures.requested, Some(1 << 30));
}

#[test]
fn specific_patterns_name_the_source_before_the_generic_one() {
    for (message, expected) in [
        (
            "HIP out of memory. Tried to allocate 2.00 GiB",
            "HIP out of memory",
        ),
        (
            "XPU out of memory. Tried to allocate 2.00 GiB",
            "XPU out of memory",
        ),
        (
            "NPU out of memory. Tried to allocate 2.00 GiB",
            "NPU out of memory",
        ),
        ("RuntimeError: CUDA out of memory.", "CUDA out of memory"),
        ("something else ran out of memory.", " out of memory."),
    ] {
        let found = oom::classify_text(message).unwrap();
        assert_eq!(
            found.kind,
            OomKind::Pattern(*OOM_PATTERNS.iter().find(|p| p.text == expected).unwrap()),
            "{message}"
        );
    }
}

/// The host's memory is not a device's: the crate's own error on the CPU says "host", and its
/// text, hidden behind a wrapper, is still recognised with its figures.
#[test]
fn the_hosts_out_of_memory_says_host_and_is_recognised_by_its_text() {
    let error = batch_size_runtime::OutOfMemory::new()
        .on_device("cpu")
        .with_requested(64 << 20)
        .with_free(7 << 20)
        .with_total(384 << 20);
    let text = error.to_string();
    assert_eq!(
        text,
        "out of host memory on cpu: tried to allocate 64.00 MiB with 7.00 MiB free of 384.00 MiB"
    );
    let found = batch_size_runtime::oom::classify_text(&format!("step 3 failed: {text}"))
        .expect("recognised by its text");
    assert_eq!(found.figures.requested, Some(64 << 20), "{found:?}");
    let figures = batch_size_runtime::oom::figures(&text);
    assert_eq!(figures.requested, Some(64 << 20));
    assert_eq!(figures.total, Some(384 << 20));
}
