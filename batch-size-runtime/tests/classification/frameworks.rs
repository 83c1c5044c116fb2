//! Every framework's out-of-memory as it really is. The texts are the frameworks' own, each
//! with the source file it comes from; where a framework's error type is not a dependency here
//! (wgpu and cubecl take minutes to build), a type with the same `Display` and `source()` chain
//! stands in for it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::error::Error;
use std::fmt;

use batch_size_runtime::oom::{self, OomKind};
use batch_size_runtime::BatchSizeSearch;
use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

use crate::candle_cuda_error;
use candle_cuda_error::CandleCudaError;

/// An error with a fixed text and an optional source, as thiserror would generate.
#[derive(Debug)]
struct Layer {
    text: &'static str,
    source: Option<Box<Layer>>,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text)
    }
}

impl Error for Layer {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source
            .as_deref()
            .map(|layer| layer as &(dyn Error + 'static))
    }
}

fn layer(text: &'static str) -> Layer {
    Layer { text, source: None }
}

fn with_source(text: &'static str, source: Layer) -> Layer {
    Layer {
        text,
        source: Some(Box::new(source)),
    }
}

#[test]
fn wgpu_out_of_memory_returned_and_as_the_uncaptured_error_panic() {
    // wgpu 30, src/api/device.rs: `Error::OutOfMemory { source }` displays "Out of Memory"; its
    // source is wgpu-core's ContextError around `DeviceError::OutOfMemory`, "Not enough memory
    // left." (wgpu-core src/device/mod.rs).
    let returned = with_source(
        "Out of Memory",
        with_source(
            "In Device::create_buffer, label = 'activations'",
            layer("Not enough memory left."),
        ),
    );
    assert!(oom::is_out_of_memory(&returned));
    // Without its source (an error scope's `Error` handed on as text), by its whole text.
    assert!(oom::is_out_of_memory(&layer("Out of Memory")));
    // wgpu-hal's `DeviceError::OutOfMemory` (Vulkan, DirectX 12 and Metal allocation failures).
    assert!(oom::is_out_of_memory(&layer("Out of memory")));
    // src/backend/wgpu_core.rs: the default uncaptured-error handler panics with
    // "wgpu error: {err}\n".
    std::panic::set_hook(Box::new(|_| {}));
    let payload = std::panic::catch_unwind(|| panic!("wgpu error: Out of Memory\n")).unwrap_err();
    let _ = std::panic::take_hook();
    assert!(oom::classify_panic(&*payload).is_some());
    // Not out of memory: the same words inside another message.
    assert!(!oom::is_out_of_memory(&layer(
        "Out of Memory Killer settings were read"
    )));
    assert!(!oom::is_out_of_memory(&layer(
        "Validation Error: buffer usage is empty"
    )));
}

#[test]
fn cubecl_and_burn_forms() {
    // cubecl-runtime 0.11, src/server/base.rs.
    let io =
        oom::classify_text("out of device memory allocating 4096 bytes\n   0: backtrace").unwrap();
    assert_eq!(io.figures.requested, Some(4096));
    assert!(oom::classify_text(
        "An out-of-memory error happened during launch\nCaused by:\n  no room for 1 GiB\nBacktrace\n"
    )
    .is_some());
    let too_big = oom::classify_text("can't allocate buffer of size: 1073741824\n").unwrap();
    assert_eq!(too_big.figures.requested, Some(1 << 30));
    // `into_data()`'s panic prints the value's Debug.
    assert!(oom::classify_text(
        "called `Result::unwrap()` on an `Err` value: OutOfMemory { size: 4096 }"
    )
    .is_some());
}

#[test]
fn hip_status_two_and_nothing_else() {
    // cubecl-hip reports `IoError::Unknown("hipMalloc failed with status 2")`; 2 is
    // hipErrorOutOfMemory.
    assert!(oom::classify_text("Unknown error: hipMalloc failed with status 2").is_some());
    assert!(oom::classify_text("hipMalloc failed with status 2 (out of memory)").is_some());
    assert!(oom::classify_text("hipErrorOutOfMemory: out of memory").is_some());
    assert!(oom::classify_text("hipMalloc failed with status 20").is_none());
    assert!(oom::classify_text("hipMemcpy failed with status 21").is_none());
    assert!(oom::classify_text("read failed with status 2").is_none()); // not HIP
}

#[test]
fn onnx_runtime_arena() {
    let found =
        oom::classify_text("Failed to allocate memory for requested buffer of size 1048576")
            .unwrap();
    assert_eq!(found.figures.requested, Some(1 << 20));
    assert!(matches!(found.kind, OomKind::Pattern(_)));
}

#[test]
fn an_error_whose_display_panics_is_classified_without_panicking() {
    // No libcuda in this process: cudarc's Display panics.
    let error = CandleCudaError(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    assert!(oom::classify_error(&error).is_none());
    assert!(!oom::is_out_of_memory(&error));
    let wrapped = anyhow::Error::new(error).context("forward pass");
    assert!(oom::classify_error(wrapped.as_ref()).is_none());

    // Through a search: not recognised, so it comes back as it is after one attempt, and
    // nothing panicked on the way.
    let mut calls = 0;
    let result: anyhow::Result<()> = BatchSizeSearch::new(8).run(|_| {
        calls += 1;
        Err(anyhow::Error::new(CandleCudaError(DriverError(
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ))))
    });
    assert_eq!(calls, 1);
    assert!(result.unwrap_err().is::<CandleCudaError>());

    // With the `DriverError` reachable through `source()`, the typed check still sees it.
    #[derive(Debug)]
    struct Visible(DriverError);
    impl fmt::Display for Visible {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{}", self.0)
        }
    }
    impl Error for Visible {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }
    let visible = Visible(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    assert_eq!(
        oom::classify_error(&visible).unwrap().kind,
        OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY")
    );
}

#[test]
fn a_rule_that_panics_does_not_match() {
    oom::add_rule(|error| {
        if error.to_string().contains("trip the rule") {
            panic!("a rule with a bug");
        }
        false
    });
    assert!(oom::classify_text("please trip the rule").is_none());
    assert!(!oom::is_out_of_memory(&layer("please trip the rule")));
}
