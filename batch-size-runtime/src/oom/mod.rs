//! Out-of-memory detection: is this error, or this panic, a device running out of memory?
//!
//! Errors are recognised by type first, walking the whole [`source()`](Error::source) chain
//! (cudarc's `DriverError`, `CublasError` and `CurandError` by their codes, this crate's
//! [`OutOfMemory`], `std::io::Error` of kind `OutOfMemory`), then by text against
//! [`OOM_PATTERNS`] for frameworks whose errors are strings or boxed (tch, candle, burn, PyTorch
//! messages), then by the rules you added with [`add_rule`].
//!
//! cudarc's errors are never formatted here: their `Display` and `Debug` call into libcuda and
//! panic where it is absent. They are recognised and described by their code's name.
//!
//! ```
//! use batch_size_runtime::oom;
//!
//! // candle's errors, boxed as text:
//! let candle: Box<dyn std::error::Error + Send + Sync> =
//!     "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into();
//! assert!(oom::is_out_of_memory(&*candle));
//! assert!(oom::classify_text("HIP out of memory. Tried to allocate 2.00 MiB").is_some());
//! assert!(!oom::is_out_of_memory(&std::io::Error::other("checkpoint not found")));
//! ```

use std::any::Any;
use std::error::Error;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use crate::error::OutOfMemory;
use crate::record::Figures;

static QUIET_OOM_PANICS: AtomicBool = AtomicBool::new(true);

/// Whether the message of an out-of-memory panic caught by the search is kept from the panic
/// hook (`true`, the default) or printed like any panic (`false`).
///
/// With the default, a recovered out-of-memory panic prints nothing: the retry is logged at
/// WARN through `tracing`, and the panic's message and location at DEBUG. Panics that are not
/// out-of-memory always reach your hook.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use batch_size_runtime::{oom::set_quiet_oom_panics, BatchSizeSearch};
///
/// static PRINTED: AtomicUsize = AtomicUsize::new(0); // panics that reached the hook
/// std::panic::set_hook(Box::new(|_| {
///     PRINTED.fetch_add(1, Ordering::Relaxed);
/// }));
/// let search = || {
///     BatchSizeSearch::new(2).call(|batch_size| {
///         if batch_size > 1 {
///             panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
///         }
///         batch_size
///     })
/// };
///
/// assert_eq!(search().unwrap(), 1);
/// assert_eq!(PRINTED.load(Ordering::Relaxed), 0); // quiet by default
///
/// set_quiet_oom_panics(false); // print them, as Rust does by default
/// assert_eq!(search().unwrap(), 1);
/// assert_eq!(PRINTED.load(Ordering::Relaxed), 1);
/// ```
pub fn set_quiet_oom_panics(quiet: bool) {
    QUIET_OOM_PANICS.store(quiet, Ordering::Relaxed);
}

/// Whether recovered out-of-memory panics are kept quiet ([`set_quiet_oom_panics`]).
pub(crate) fn quiet_oom_panics() -> bool {
    QUIET_OOM_PANICS.load(Ordering::Relaxed)
}

/// A framework that runs device work on threads of its own and catches their panics, so that an
/// out-of-memory there reaches the attempt only as the device work it lost.
///
/// cubecl (burn's wgpu backend) runs each device's work on a thread named `DSD-*`: wgpu's
/// out-of-memory panics there, the thread catches it, and the attempt then reads "couldn't find
/// resource for that handle". Only this pair ties another thread's out-of-memory to an attempt:
/// the panicking thread is a device thread of a framework listed here, and the attempt failed
/// the way that framework's lost work fails. A thread of no framework (a metrics exporter, a
/// data loader, another search's thread) never changes an attempt's outcome, and an attempt
/// that fails any other way keeps its own error or panic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceThreads {
    /// How the framework's device threads are named (a prefix).
    pub(crate) named: &'static str,
    /// Texts of an attempt's failure after its device work was lost.
    pub(crate) lost_work: &'static [&'static str],
    /// Where the names and texts come from.
    #[cfg_attr(not(test), allow(dead_code))] // documents the row; read by the table's test
    pub(crate) origin: &'static str,
}

pub(crate) const DEVICE_THREADS: &[DeviceThreads] = &[DeviceThreads {
    named: "DSD-",
    lost_work: &["couldn't find resource for that handle"],
    origin: "cubecl-runtime 0.11 as burn 0.22's wgpu backend runs it: each device's work runs \
             on a thread named `DSD-*`, which catches the panic of wgpu's uncaptured-error \
             handler; the attempt's `try_into_data()` then returns, and `into_data()` panics \
             with, \"couldn't find resource for that handle\" (seen on llvmpipe, \
             real-allocators/tests/burn_cpu.rs)",
}];

/// Whether a thread so named is a framework's device thread ([`DEVICE_THREADS`]).
pub(crate) fn is_device_thread(name: &str) -> bool {
    DEVICE_THREADS.iter().any(|row| name.starts_with(row.named))
}

/// Whether an attempt's failure text is what a framework's lost device work leaves behind
/// ([`DEVICE_THREADS`]).
pub(crate) fn is_lost_device_work(text: &str) -> bool {
    DEVICE_THREADS
        .iter()
        .any(|row| row.lost_work.iter().any(|lost| text.contains(lost)))
}

/// A text that marks an error message as an out-of-memory error, and where it comes from.
///
/// ```
/// use batch_size_runtime::oom::{self, OomKind, OOM_PATTERNS};
///
/// let pytorch = OOM_PATTERNS.iter().find(|pattern| pattern.text == "CUDA out of memory").unwrap();
/// assert!(pytorch.origin.contains("PyTorch"));
/// let found = oom::classify_text("CUDA out of memory. Tried to allocate 20.00 MiB").unwrap();
/// assert_eq!(found.kind, OomKind::Pattern(*pytorch));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomPattern {
    /// Matched as a case-sensitive substring of the error's message.
    pub text: &'static str,
    /// Who prints it.
    pub origin: &'static str,
    /// Where the figures of a message of this kind are written; empty where it has none.
    pub figures: &'static [FigureAt],
}

/// A figure an out-of-memory message states: bytes, in the units the message uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Figure {
    /// Bytes the failed allocation asked for.
    Requested,
    /// Bytes free on the device when it failed.
    Free,
    /// The device's total bytes.
    Total,
}

/// Where a figure is written: right after `marker` (`"Tried to allocate "` then `2.00 GiB`).
/// Sizes are read as `4096`, `4096 bytes`, `2.00 GiB`, `1.5 GB`; a number with a fraction
/// needs a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FigureAt {
    /// The text right before the figure.
    pub marker: &'static str,
    /// Which figure it is.
    pub figure: Figure,
}

const fn at(marker: &'static str, figure: Figure) -> FigureAt {
    FigureAt { marker, figure }
}

/// PyTorch's allocator (CUDA, ROCm, XPU, NPU): "Tried to allocate 2.00 GiB. GPU 0 has a total
/// capacity of 79.15 GiB of which 228.38 MiB is free."
const PYTORCH_FIGURES: &[FigureAt] = &[
    at("Tried to allocate ", Figure::Requested),
    at("total capacity of ", Figure::Total),
    at(" of which ", Figure::Free),
];

/// This crate's [`OutOfMemory`] ("tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB")
/// and burn's "out of device memory allocating 4096 bytes".
const OUT_OF_DEVICE_MEMORY_FIGURES: &[FigureAt] = &[
    at("tried to allocate ", Figure::Requested),
    at(" with ", Figure::Free),
    at(" free of ", Figure::Total),
    at("allocating ", Figure::Requested),
];

/// Every message pattern recognised as out-of-memory, each with where it comes from. The first
/// match names the source, so specific entries come before Accelerate's generic
/// `" out of memory."`.
///
/// Matching is by case-sensitive substring anywhere in the message of any error in the chain
/// (or in a panic's message).
///
/// Each entry also says where a message of its kind states its figures (bytes requested, free,
/// total): [`figures`] reads them, into [`OomMatch::figures`] and so into each attempt's
/// [`Figures`]. One table, so that every message whose figures are read is one recognised as
/// out-of-memory.
///
/// ```
/// use batch_size_runtime::oom::{self, OOM_PATTERNS};
///
/// assert!(OOM_PATTERNS.iter().any(|pattern| pattern.text == "CUDA out of memory"));
/// for pattern in OOM_PATTERNS {
///     assert!(oom::classify_text(&format!("error: {}", pattern.text)).is_some());
/// }
/// ```
pub const OOM_PATTERNS: &[OomPattern] = &[
    OomPattern {
        text: "CUDA out of memory",
        origin: "PyTorch / tch: `OutOfMemoryError: CUDA out of memory. Tried to allocate ...`",
        figures: PYTORCH_FIGURES,
    },
    OomPattern {
        text: "CUDA error: out of memory",
        origin: "PyTorch's C10_CUDA_CHECK and CUDA runtime messages",
        figures: &[],
    },
    OomPattern {
        text: "CUDA_ERROR_OUT_OF_MEMORY",
        origin:
            "cudarc `DriverError(CUDA_ERROR_OUT_OF_MEMORY, ...)` as candle and unwrap() print it",
        figures: &[],
    },
    OomPattern {
        text: "cudaErrorMemoryAllocation",
        origin: "CUDA runtime API error name",
        figures: &[],
    },
    OomPattern {
        text: "out of device memory",
        origin: "burn / cubecl: `IoError::OutOfMemory` \"out of device memory allocating N bytes\"; this crate's `OutOfMemory`",
        figures: OUT_OF_DEVICE_MEMORY_FIGURES,
    },
    OomPattern {
        text: "out of host memory",
        origin: "this crate's `OutOfMemory` on the host (device `cpu`: a child trial's figures, the host's)",
        figures: OUT_OF_DEVICE_MEMORY_FIGURES,
    },
    OomPattern {
        text: "OutOfMemory { size:",
        origin: "burn / cubecl: `IoError::OutOfMemory` as `into_data()`'s panic prints it",
        figures: &[at("OutOfMemory { size: ", Figure::Requested)],
    },
    OomPattern {
        text: "CUBLAS_STATUS_ALLOC_FAILED",
        origin: "cuBLAS allocation failure (cudarc CublasError, tch)",
        figures: &[],
    },
    OomPattern {
        text: "CURAND_STATUS_ALLOCATION_FAILED",
        origin: "cuRAND allocation failure (cudarc CurandError)",
        figures: &[],
    },
    OomPattern {
        text: "CUDNN_STATUS_ALLOC_FAILED",
        origin: "cuDNN 8 allocation failure",
        figures: &[],
    },
    OomPattern {
        text: "_DEVICE_ALLOCATION_FAILED",
        origin: "cuDNN 9 `CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`",
        figures: &[],
    },
    OomPattern {
        text: "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
        origin: "Accelerate's list: PyTorch raises it when cuDNN has no memory for a workspace",
        figures: &[],
    },
    OomPattern {
        text: "DefaultCPUAllocator: can't allocate memory",
        origin: "Accelerate's list: PyTorch's CPU allocator (c10/core/impl/alloc_cpu.cpp: \"DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)\")",
        figures: &[at("you tried to allocate ", Figure::Requested)],
    },
    OomPattern {
        text: "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
        origin: "Accelerate's list: Habana HPU",
        figures: &[],
    },
    OomPattern {
        text: "HIP out of memory",
        origin: "PyTorch on ROCm: \"HIP out of memory. Tried to allocate ...\"",
        figures: PYTORCH_FIGURES,
    },
    OomPattern {
        text: "hipErrorOutOfMemory",
        origin: "HIP runtime error name (cubecl-hip's and PyTorch's HIP messages)",
        figures: &[],
    },
    OomPattern {
        text: "wgpu error: Out of Memory",
        origin: "wgpu 30: the default uncaptured-error handler's panic (src/backend/wgpu_core.rs, `panic!(\"wgpu error: {err}\")`) for `wgpu::Error::OutOfMemory`, as burn-wgpu raises it",
        figures: &[],
    },
    OomPattern {
        text: "Not enough memory left.",
        origin: "wgpu-core 30 `DeviceError::OutOfMemory` (src/device/mod.rs), the source of `wgpu::Error::OutOfMemory`; wgpu-hal maps Vulkan, DirectX 12 and Metal allocation failures to it",
        figures: &[],
    },
    OomPattern {
        text: "An out-of-memory error happened during launch",
        origin: "cubecl-runtime 0.11 `LaunchError::OutOfMemory` (src/server/base.rs), a kernel launch's allocation failure in burn",
        figures: &[],
    },
    OomPattern {
        text: "every page size the memory tracks still holds live allocations",
        origin: "cubecl-runtime 0.11 `IoError::PageSizesExhausted` (src/server/base.rs): \"Can't allocate N bytes: every page size ...\"; a cleanup relocates what it can",
        figures: &[at("Can't allocate ", Figure::Requested)],
    },
    OomPattern {
        text: "can't allocate buffer of size: ",
        origin: "cubecl-runtime 0.11 `IoError::BufferTooBig` (src/server/base.rs): a buffer larger than the device (or cubecl's CPU storage) can give, smaller with a smaller batch",
        figures: &[at("buffer of size: ", Figure::Requested)],
    },
    OomPattern {
        text: "XPU out of memory",
        origin: "PyTorch on Intel XPU: \"XPU out of memory. Tried to allocate ...\"",
        figures: PYTORCH_FIGURES,
    },
    OomPattern {
        text: "MPS backend out of memory",
        origin: "PyTorch on Apple MPS",
        figures: &[at("Tried to allocate ", Figure::Requested)],
    },
    OomPattern {
        text: "NPU out of memory",
        origin: "PyTorch on Ascend NPU (torch_npu)",
        figures: PYTORCH_FIGURES,
    },
    OomPattern {
        text: "CUDA failure 2: out of memory",
        origin: "ONNX Runtime's CUDA execution provider (the ort crate)",
        figures: &[],
    },
    OomPattern {
        text: "is smaller than requested bytes of",
        origin: "ONNX Runtime's BFC arena with a cap (`BFCArena::AllocateRawInternal ... Available memory of A is smaller than requested bytes of R`, an arena made with `CreateArenaCfgV2`'s `max_mem`), 1.31 and 1.32 (the ort crate)",
        figures: &[
            at("requested bytes of ", Figure::Requested),
            at("Available memory of ", Figure::Free),
        ],
    },
    OomPattern {
        text: "Failed to allocate memory for requested buffer",
        origin: "ONNX Runtime's BFC arena (the ort crate)",
        figures: &[at("requested buffer of size ", Figure::Requested)],
    },
    OomPattern {
        text: "RESOURCE_EXHAUSTED: Out of memory",
        origin: "XLA / PJRT (the xla crate)",
        figures: &[at("trying to allocate ", Figure::Requested)],
    },
    OomPattern {
        text: "OOM when allocating tensor",
        origin: "TensorFlow (the tensorflow crate)",
        figures: &[],
    },
    OomPattern {
        text: "OUT_OF_DEVICE_MEMORY",
        origin: "Vulkan `VK_ERROR_OUT_OF_DEVICE_MEMORY` as ash's `vk::Result` prints it (`ERROR_OUT_OF_DEVICE_MEMORY`), for code on ash or vulkano; wgpu drops the code and reports `Not enough memory left.`",
        figures: &[],
    },
    // Last: the generic form, so that the specific entries above name the source.
    OomPattern {
        text: " out of memory.",
        origin: "Accelerate's list (utils/memory.py, should_reduce_batch_size)",
        figures: PYTORCH_FIGURES,
    },
];

/// How an out-of-memory error was recognised.
///
/// ```
/// use batch_size_runtime::oom::{self, OomKind};
/// use batch_size_runtime::OutOfMemory;
/// use cudarc::driver::{sys::CUresult, DriverError};
///
/// let kind = |error: &(dyn std::error::Error + 'static)| oom::classify_error(error).unwrap().kind;
/// assert_eq!(kind(&OutOfMemory::new()), OomKind::Crate);
/// assert_eq!(
///     kind(&DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)),
///     OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY")
/// );
/// assert_eq!(kind(&std::io::Error::from(std::io::ErrorKind::OutOfMemory)), OomKind::Io);
/// assert!(matches!(
///     kind(&std::io::Error::other("CUDA out of memory. Tried to allocate 2.00 GiB")),
///     OomKind::Pattern(pattern) if pattern.text == "CUDA out of memory"
/// ));
/// oom::add_rule(|error| error.to_string().contains("arena exhausted"));
/// assert_eq!(kind(&std::io::Error::other("my_accel: arena exhausted")), OomKind::Rule);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OomKind {
    /// This crate's [`OutOfMemory`].
    Crate,
    /// A cudarc error with an allocation-failure code; the code's name.
    Cudarc(&'static str),
    /// `std::io::Error` of kind `OutOfMemory`.
    Io,
    /// A message matched one of [`OOM_PATTERNS`].
    Pattern(OomPattern),
    /// One of the rules added with [`add_rule`].
    Rule,
}

/// An error or panic recognised as out-of-memory.
///
/// ```
/// use batch_size_runtime::oom;
///
/// let pytorch = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total)\n\
///                Traceback (most recent call last): ...";
/// let found = oom::classify_text(pytorch).unwrap();
/// assert_eq!(found.figures.requested, Some(20 << 20));
/// assert_eq!(
///     found.description, // the first line
///     "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomMatch {
    /// How it was recognised.
    pub kind: OomKind,
    /// What the error said, safe to print (cudarc errors are described by code name).
    pub description: String,
    /// What the error stated of the failure: the bytes asked for, free and total, read as
    /// values from the crate's own [`OutOfMemory`] (a child's too) and parsed from a foreign
    /// error's text, here and nowhere else. The search adds the memory backend's readings.
    pub figures: Figures,
}

/// A rule that says whether an error is out-of-memory, for frameworks this crate does not know.
///
/// ```
/// use std::sync::Arc;
/// use batch_size_runtime::oom::{self, OomRule};
///
/// let level_zero: OomRule =
///     Arc::new(|error| error.to_string().contains("ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"));
/// let error = std::io::Error::other("zeMemAllocDevice: ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY");
/// assert!(level_zero(&error));
/// oom::add_rule(move |error| level_zero(error));
/// assert!(oom::is_out_of_memory(&error));
/// ```
pub type OomRule = Arc<dyn Fn(&(dyn Error + 'static)) -> bool + Send + Sync>;

static RULES: RwLock<Vec<OomRule>> = RwLock::new(Vec::new());

/// Adds a rule, for the whole process, that recognises more errors as out-of-memory.
///
/// The rule sees every error of a chain in turn; panic messages and errors known only by their
/// text reach it as an error whose `Display` is that text. Rules are consulted after the
/// built-in types and patterns.
///
/// ```
/// use batch_size_runtime::oom;
///
/// oom::add_rule(|error| error.to_string().contains("arena exhausted"));
/// let error = std::io::Error::other("my_accel: arena exhausted");
/// assert!(oom::is_out_of_memory(&error));
/// ```
pub fn add_rule(rule: impl Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'static) {
    match RULES.write() {
        Ok(mut rules) => rules.push(Arc::new(rule)),
        // A rule that panicked poisoned the lock; the list itself is still whole.
        Err(poisoned) => poisoned.into_inner().push(Arc::new(rule)),
    }
}

fn rules() -> Vec<OomRule> {
    match RULES.read() {
        Ok(rules) => rules.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// Whether `error`, or any error in its `source()` chain, is out-of-memory.
///
/// ```
/// use batch_size_runtime::{oom, OutOfMemory};
///
/// let wrapped = anyhow::Error::new(OutOfMemory::new()).context("forward pass");
/// assert!(oom::is_out_of_memory(wrapped.as_ref()));
/// assert!(!oom::is_out_of_memory(&std::fmt::Error));
/// ```
pub fn is_out_of_memory(error: &(dyn Error + 'static)) -> bool {
    classify_error(error).is_some()
}

/// Recognises an out-of-memory error anywhere in `error`'s chain and describes it.
///
/// ```
/// use batch_size_runtime::oom::{self, OomKind};
/// use cudarc::driver::{sys::CUresult, DriverError};
///
/// // No libcuda is needed: the code is compared, never formatted through the driver.
/// let error = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
/// let found = oom::classify_error(&error).unwrap();
/// assert_eq!(found.kind, OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY"));
/// ```
pub fn classify_error(error: &(dyn Error + 'static)) -> Option<OomMatch> {
    let chain = || chain_of(error);
    if chain().any(is_cudarc_error) {
        // Formatting a layer could reach cudarc's Display, which needs libcuda.
        return chain()
            .find_map(|layer| classify_typed(layer).map(|(kind, _)| kind))
            .map(|kind| OomMatch {
                description: describe_cudarc_chain(error),
                kind,
                figures: Figures::default(),
            });
    }
    if let Some((kind, figures)) = chain().find_map(classify_typed) {
        return Some(OomMatch {
            kind,
            description: describe_chain(error),
            figures,
        });
    }
    // One quiet section for every layer's text and every rule: the panic filter goes in and
    // out once, not once a layer.
    crate::panic_filter::quietly(|| classify_by_text(error)).flatten()
}

/// The patterns, then the rules, on the chain's text.
fn classify_by_text(error: &(dyn Error + 'static)) -> Option<OomMatch> {
    let text = chain_text(error);
    if let Some(found) = match_patterns(&text) {
        return Some(found);
    }
    let rules = rules();
    if rules.is_empty() {
        return None;
    }
    chain_of(error)
        .any(|layer| rules.iter().any(|rule| rule_matches(rule, layer)))
        // A rule's message has no known form: its figures are not guessed.
        .then_some(OomMatch {
            kind: OomKind::Rule,
            figures: Figures::default(),
            description: truncate(&text),
        })
}

/// Recognises an out-of-memory message (a string error or a panic message).
///
/// ```
/// use batch_size_runtime::oom;
///
/// let tch = "Internal torch error: CUDA out of memory. Tried to allocate 2.00 GiB";
/// assert_eq!(oom::classify_text(tch).unwrap().figures.requested, Some(2 << 30));
/// assert!(oom::classify_text("index out of bounds").is_none());
/// ```
pub fn classify_text(text: &str) -> Option<OomMatch> {
    if let Some(found) = match_patterns(text) {
        return Some(found);
    }
    let rules = rules();
    if rules.is_empty() {
        return None;
    }
    let as_error = TextError(text.to_owned());
    rules
        .iter()
        .any(|rule| rule_matches(rule, &as_error))
        .then(|| OomMatch {
            kind: OomKind::Rule,
            description: truncate(text),
            figures: Figures::default(),
        })
}

/// Recognises a panic payload (as `catch_unwind` returns it) as out-of-memory.
///
/// Payloads of type `&str` and `String` (what `panic!`, `unwrap` and `expect` produce) are read
/// as text; a payload that is an [`OutOfMemory`] (from `std::panic::panic_any`), an
/// `anyhow::Error` or a boxed error is classified like a returned error.
///
/// ```
/// use std::panic::{catch_unwind, panic_any};
/// use batch_size_runtime::oom::{self, OomKind};
/// use batch_size_runtime::OutOfMemory;
/// # std::panic::set_hook(Box::new(|_| {})); // keep the doctest's output clean
///
/// let oom = || panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
/// let payload = catch_unwind(oom).unwrap_err();
/// assert_eq!(oom::classify_panic(&*payload).unwrap().figures.requested, Some(1 << 30));
///
/// let payload = catch_unwind(|| panic_any(OutOfMemory::new())).unwrap_err();
/// assert_eq!(oom::classify_panic(&*payload).unwrap().kind, OomKind::Crate);
///
/// let payload = catch_unwind(|| panic!("index out of bounds")).unwrap_err();
/// assert!(oom::classify_panic(&*payload).is_none());
/// ```
pub fn classify_panic(payload: &(dyn Any + Send)) -> Option<OomMatch> {
    if let Some(text) = payload.downcast_ref::<&'static str>() {
        return classify_text(text);
    }
    if let Some(text) = payload.downcast_ref::<String>() {
        return classify_text(text);
    }
    if let Some(error) = payload.downcast_ref::<OutOfMemory>() {
        return classify_error(error);
    }
    if let Some(error) = payload.downcast_ref::<Box<dyn Error + Send + Sync>>() {
        return classify_error(&**error);
    }
    #[cfg(feature = "anyhow")]
    if let Some(error) = payload.downcast_ref::<anyhow::Error>() {
        return classify_error(error.as_ref());
    }
    None
}

/// `error` and its sources, outermost first.
///
/// ```
/// use batch_size_runtime::{oom, OutOfMemory};
///
/// let error = anyhow::Error::new(OutOfMemory::new()).context("forward pass");
/// let messages: Vec<String> = oom::chain_of(error.as_ref()).map(|e| e.to_string()).collect();
/// assert_eq!(messages, ["forward pass", "out of device memory"]);
/// ```
pub fn chain_of<'a>(
    error: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> + Clone {
    std::iter::successors(Some(error), |&layer| layer.source())
}

/// A message known only as text, shown to rules as an error.
#[derive(Debug)]
struct TextError(String);

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for TextError {}

/// Messages recognised only when they are an error's whole text, too short to match inside
/// others: wgpu 30's `Error::OutOfMemory` (src/api/device.rs) and wgpu-hal's
/// `DeviceError::OutOfMemory`.
pub const EXACT_OOM_MESSAGES: &[&str] = &["Out of Memory", "Out of memory"];

/// A HIP status of 2, `hipErrorOutOfMemory`, as cubecl-hip reports a failed allocation:
/// `IoError::Unknown("hipMalloc failed with status 2")`. Status 20 or 21 is something else.
fn hip_out_of_memory_status(text: &str) -> bool {
    text.match_indices("failed with status 2")
        .any(|(at, found)| {
            let before = &text[..at];
            let after = &text[at + found.len()..];
            before.contains("hip") && !after.starts_with(|c: char| c.is_ascii_digit())
        })
}

/// The pattern `text` matches: the whole-message forms first, then the table in order.
fn matched_pattern(text: &str) -> Option<OomPattern> {
    if EXACT_OOM_MESSAGES
        .iter()
        .any(|exact| text.split(": ").any(|layer| layer.trim() == *exact))
        || hip_out_of_memory_status(text)
    {
        return Some(OomPattern {
            text: "Out of Memory",
            origin: "wgpu's `Error::OutOfMemory`, wgpu-hal's `DeviceError::OutOfMemory`, or HIP status 2 (`hipErrorOutOfMemory`)",
            figures: &[],
        });
    }
    OOM_PATTERNS
        .iter()
        .find(|pattern| text.contains(pattern.text))
        .copied()
}

fn match_patterns(text: &str) -> Option<OomMatch> {
    matched_pattern(text).map(|pattern| OomMatch {
        kind: OomKind::Pattern(pattern),
        description: truncate(what_ran_out(text)),
        figures: stated(&read_figures(pattern.figures, text)),
    })
}

/// The line of `text` that says what ran out, and only that: the first line that matches a
/// pattern by itself (burn's "An error happened during execution" puts the cause lines below),
/// else the first. Lines are also split where an error's `Debug` escaped its newlines (tch's
/// `unwrap()` panics with libtorch's whole C++ stack on one line), and the wrappers around the
/// message are taken off (``called `Result::unwrap()` on an `Err` value: Torch("...")``).
fn what_ran_out(text: &str) -> &str {
    let line = text
        .lines()
        .flat_map(|line| line.split("\\n"))
        .find(|line| matched_pattern(line).is_some())
        .unwrap_or(text);
    unwrapped(line.trim())
}

/// `line` without what panicking on an `Err` and the error's `Debug` put around its message.
fn unwrapped(line: &str) -> &str {
    const UNWRAPPED: [&str; 2] = ["on an `Err` value: ", "on a `None` value: "];
    let mut line = UNWRAPPED
        .iter()
        .find_map(|marker| line.split_once(marker).map(|(_, rest)| rest))
        .unwrap_or(line);
    // A tuple variant's `Debug` around a string: `Torch("...")`, `Msg("...")`.
    if let Some((variant, message)) = line.split_once("(\"") {
        if !variant.is_empty()
            && variant
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            line = message.strip_suffix("\")").unwrap_or(message);
        }
    }
    line.trim()
}

/// The figures an out-of-memory states, as the record keeps them; free above total contradicts
/// itself, and neither is kept.
fn stated(own: &OutOfMemory) -> Figures {
    let consistent = own
        .free
        .zip(own.total)
        .is_none_or(|(free, total)| free <= total);
    Figures {
        requested: own.requested,
        free_at_failure: own.free.filter(|_| consistent),
        total: own.total.filter(|_| consistent),
        ..Figures::default()
    }
}

fn classify_typed(error: &(dyn Error + 'static)) -> Option<(OomKind, Figures)> {
    use cudarc::cublas::result::CublasError;
    use cudarc::cublas::sys::cublasStatus_t;
    use cudarc::curand::result::CurandError;
    use cudarc::curand::sys::curandStatus_t;
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::DriverError;

    if let Some(own) = error.downcast_ref::<OutOfMemory>() {
        return Some((OomKind::Crate, stated(own)));
    }
    if let Some(DriverError(code)) = error.downcast_ref::<DriverError>() {
        return (*code == CUresult::CUDA_ERROR_OUT_OF_MEMORY).then_some((
            OomKind::Cudarc("CUDA_ERROR_OUT_OF_MEMORY"),
            Figures::default(),
        ));
    }
    if let Some(CublasError(status)) = error.downcast_ref::<CublasError>() {
        return (*status == cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED).then_some((
            OomKind::Cudarc("CUBLAS_STATUS_ALLOC_FAILED"),
            Figures::default(),
        ));
    }
    if let Some(CurandError(status)) = error.downcast_ref::<CurandError>() {
        return (*status == curandStatus_t::CURAND_STATUS_ALLOCATION_FAILED).then_some((
            OomKind::Cudarc("CURAND_STATUS_ALLOCATION_FAILED"),
            Figures::default(),
        ));
    }
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        // An io::Error that merely wraps another error is judged by that error, further down.
        return (io.kind() == std::io::ErrorKind::OutOfMemory && io.get_ref().is_none())
            .then_some((OomKind::Io, Figures::default()));
    }
    None
}

fn is_cudarc_error(error: &(dyn Error + 'static)) -> bool {
    error.is::<cudarc::driver::DriverError>()
        || error.is::<cudarc::cublas::result::CublasError>()
        || error.is::<cudarc::curand::result::CurandError>()
}

/// What `error` says, safe to print: cudarc errors anywhere in the chain are named by code.
pub(crate) fn describe(error: &(dyn Error + 'static)) -> String {
    let has_cudarc = chain_of(error).any(is_cudarc_error);
    if has_cudarc {
        describe_cudarc_chain(error)
    } else {
        describe_chain(error)
    }
}

/// Where libcuda is loaded, cudarc's `Display` can ask it for the error's text, so the chain
/// is described whole (with the context a caller added); elsewhere the cudarc codes are named
/// without calling their `Display` (derived `Debug` of the code enums is plain Rust).
fn describe_cudarc_chain(error: &(dyn Error + 'static)) -> String {
    if crate::memory::CudaBackend::driver_loaded() {
        return describe_chain(error);
    }
    let names: Vec<String> = chain_of(error)
        .filter_map(|layer| {
            if let Some(driver) = layer.downcast_ref::<cudarc::driver::DriverError>() {
                Some(format!("CUDA driver error {:?}", driver.0))
            } else if let Some(cublas) = layer.downcast_ref::<cudarc::cublas::result::CublasError>()
            {
                Some(format!("cuBLAS error {:?}", cublas.0))
            } else {
                layer
                    .downcast_ref::<cudarc::curand::result::CurandError>()
                    .map(|curand| format!("cuRAND error {:?}", curand.0))
            }
        })
        .collect();
    names.join(": ")
}

/// The chain's messages joined with ": ", skipping a layer whose text its parent already shows
/// (thiserror's `#[error("...: {0}")]` and `transparent` repeat their source). Whole: patterns
/// are matched on all of it; descriptions keep its first line.
pub(crate) fn chain_text(error: &(dyn Error + 'static)) -> String {
    let mut text = String::new();
    for layer in chain_of(error) {
        // A layer whose `Display` panics (candle's CUDA error formats cudarc's, which needs
        // libcuda) is left out of the text; the typed checks still see it.
        let Some(message) = text_of(layer) else {
            continue;
        };
        if message.is_empty() || text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}

/// `layer.to_string()`, or `None` if its `Display` panicked.
fn text_of(layer: &(dyn Error + 'static)) -> Option<String> {
    crate::panic_filter::quietly(|| layer.to_string())
}

/// `rule(layer)`; a rule that panics does not match.
fn rule_matches(rule: &OomRule, layer: &(dyn Error + 'static)) -> bool {
    crate::panic_filter::quietly(|| rule(layer)).unwrap_or(false)
}

fn describe_chain(error: &(dyn Error + 'static)) -> String {
    truncate(&chain_text(error))
}

/// Error texts can be pages long (PyTorch appends advice, candle a backtrace): logs want the
/// first line, and at most a few hundred characters of it.
fn truncate(text: &str) -> String {
    const LIMIT: usize = 600;
    let text = text.lines().next().unwrap_or_default().trim_end();
    if text.len() <= LIMIT {
        return text.to_owned();
    }
    let mut end = LIMIT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// The figures `text` states, as an [`OutOfMemory`] (the one type for one failure's figures:
/// the bytes asked for, free, total), read where the pattern it matches says
/// ([`OomPattern::figures`]). A message that the table does not recognise as out-of-memory
/// states none: classification and figures come from the same table.
///
/// ```
/// use batch_size_runtime::oom;
///
/// let pytorch = oom::figures(
///     "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
///      80.00 GiB of which 1.00 GiB is free.",
/// );
/// assert_eq!(pytorch.requested, Some(2 << 30));
/// assert_eq!((pytorch.free, pytorch.total), (Some(1 << 30), Some(80 << 30)));
/// let ours = oom::figures("out of device memory on sim:0: tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB");
/// assert_eq!(ours.requested, Some(4 << 30));
/// assert_eq!((ours.free, ours.total), (Some(1 << 30), Some(16 << 30)));
/// assert_eq!(oom::figures("out of device memory allocating 4096 bytes").requested, Some(4096));
/// // The same words in a message that is not out-of-memory are not read.
/// assert_eq!(oom::figures("checkpoint: tried to allocate 4.00 GiB"), batch_size_runtime::OutOfMemory::new());
/// ```
pub fn figures(text: &str) -> OutOfMemory {
    matched_pattern(text)
        .map(|pattern| read_figures(pattern.figures, text))
        .unwrap_or_default()
}

fn read_figures(markers: &[FigureAt], text: &str) -> OutOfMemory {
    let read = |figure: Figure| {
        markers
            .iter()
            .filter(|at| at.figure == figure)
            .find_map(|at| {
                text.split_once(at.marker)
                    .and_then(|(_, rest)| bytes_at_start(rest))
            })
    };
    OutOfMemory {
        requested: read(Figure::Requested),
        free: read(Figure::Free),
        total: read(Figure::Total),
        device: None,
    }
}

/// "2.00 GiB", "786.00 MiB", "4096 bytes", "4096": the bytes, or `None` for anything else (a
/// negative, NaN or infinite number, a fraction without a unit, a figure past `u64`).
fn bytes_at_start(text: &str) -> Option<u64> {
    const PUNCTUATION: [char; 5] = [',', '.', ';', ')', '}'];
    let mut words = text.split_whitespace();
    let written = words.next()?.trim_end_matches(PUNCTUATION);
    let number: f64 = written.parse().ok()?;
    if !number.is_finite() || number < 0.0 {
        return None;
    }
    let unit = words
        .next()
        .map(|unit| unit.trim_end_matches(PUNCTUATION))
        .unwrap_or("");
    let scale: f64 = match unit {
        "bytes" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        // A bare count is bytes (ONNX Runtime: "buffer of size 4096"); a bare fraction is not.
        _ if written.bytes().all(|byte| byte.is_ascii_digit()) => 1.0,
        _ => return None,
    };
    let bytes = number * scale;
    (bytes < u64::MAX as f64).then_some(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_requested_bytes_from_pytorch_and_burn() {
        let requested = |text| figures(text).requested;
        assert_eq!(
            requested("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0"),
            Some(20 << 20)
        );
        assert_eq!(
            requested("out of device memory allocating 4096 bytes"),
            Some(4096)
        );
        assert_eq!(requested("CUDA error: out of memory"), None);
    }

    #[test]
    fn onnx_runtime_capped_arena() {
        // ONNX Runtime 1.32's text, as the ort crate returns it (real-allocators/tests/ort_cpu.rs).
        let text = "Non-zero status code returned while running MatMul node. Name:'matmul' \
                    Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:359 \
                    void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) \
                    Available memory of 234881024 is smaller than requested bytes of 268435456";
        assert_eq!(
            classify_text(text).map(|found| found.figures.requested),
            Some(Some(268_435_456))
        );
        let read = figures(text);
        assert_eq!(
            (read.requested, read.free),
            (Some(268_435_456), Some(234_881_024))
        );
        let uncapped = "Failed to allocate memory for requested buffer of size 268435456";
        assert_eq!(
            classify_text(uncapped).map(|found| found.figures.requested),
            Some(Some(268_435_456))
        );
    }

    #[test]
    fn describes_the_line_that_says_what_ran_out() {
        // burn 0.22's ExecutionError wraps cubecl's IoError below its own first line.
        let burn = "An error happened during execution\nCaused by:\n  out of device memory allocating 4096 bytes\n   0: backtrace";
        let found = classify_text(burn).map(|found| (found.description, found.figures.requested));
        assert_eq!(
            found,
            Some((
                "out of device memory allocating 4096 bytes".to_owned(),
                Some(4096)
            ))
        );
        let pages = "Can't allocate 8192 bytes: every page size the memory tracks still holds live allocations\n";
        assert_eq!(
            classify_text(pages).map(|found| found.figures.requested),
            Some(Some(8192))
        );
        // The lost handle alone is not out-of-memory: only a device thread's panic says so.
        let lost = "An error happened during execution\nCaused by:\n  couldn't find resource for that handle: Memory location was never initialized";
        assert!(classify_text(lost).is_none());
    }

    #[test]
    #[allow(clippy::expect_used)] // a test: failing loudly is the point
    fn says_what_ran_out_without_stack_frames_or_unwrap_wrappers() {
        // tch's plain methods: `unwrap()` on `TchError::Torch`, libtorch's stack escaped.
        let tch = "called `Result::unwrap()` on an `Err` value: Torch(\"DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12 (Cannot allocate memory)\\nException raised from alloc_cpu at ../c10/core/impl/alloc_cpu.cpp:72 (most recent call first):\\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in /usr/lib/libc10.so)\\nframe #1: <unknown function> + 0x4c062 (0x7f in /usr/lib/libc10.so)\")";
        let found = classify_text(tch).expect("tch's allocator message");
        assert_eq!(
            found.description,
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12 (Cannot allocate memory)"
        );
        assert_eq!(found.figures.requested, Some(85_899_345_920));
        // Its `f_*` methods: the error's `Display`, with real newlines.
        let returned = "Internal torch error: DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes. Error code 12 (Cannot allocate memory)\nException raised from alloc_cpu at ../c10/core/impl/alloc_cpu.cpp:72\nframe #0: <unknown function> + 0x4c062";
        let found = classify_text(returned).expect("tch's allocator message");
        assert!(
            !found.description.contains("frame #"),
            "{}",
            found.description
        );
        assert!(
            !found.description.contains("Exception raised"),
            "{}",
            found.description
        );
        // A plain message stays as it is.
        let plain = "CUDA out of memory. Tried to allocate 2.00 GiB";
        assert_eq!(
            classify_text(plain)
                .map(|found| found.description)
                .as_deref(),
            Some(plain)
        );
    }

    #[test]
    fn device_threads_are_named_and_their_lost_work_recognised() {
        assert!(is_device_thread("DSD-4-0"));
        assert!(!is_device_thread("metrics-exporter"));
        assert!(!is_device_thread("tokio-runtime-worker"));
        let lost = "An error happened during execution\nCaused by:\n  couldn't find resource for that handle: Memory location was never initialized";
        assert!(is_lost_device_work(lost));
        assert!(!is_lost_device_work("corrupt record 17 in shard 3"));
        assert!(DEVICE_THREADS.iter().all(|row| !row.origin.is_empty()));
    }

    #[test]
    fn bad_figures_are_not_read() {
        assert_eq!(bytes_at_start("NaN GiB"), None);
        assert_eq!(bytes_at_start("inf GiB"), None);
        assert_eq!(bytes_at_start("-3 GiB"), None);
        assert_eq!(bytes_at_start("1e30 TiB"), None);
        assert_eq!(bytes_at_start("2.5 apples"), None);
        assert_eq!(bytes_at_start("4096 }"), Some(4096));
    }

    #[test]
    fn keeps_the_first_line_only() {
        let candle = "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")\n   0: candle_core::error::Error::bt\n   1: main";
        assert_eq!(
            truncate(candle),
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"
        );
    }

    #[test]
    fn truncates_on_a_char_boundary() {
        let long = "é".repeat(400);
        let cut = truncate(&long);
        assert!(cut.ends_with("..."));
        assert!(cut.len() <= 603);
    }
}
