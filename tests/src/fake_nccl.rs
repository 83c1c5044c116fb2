//! The fake NCCL (`fake-nccl/fake_nccl.rs`, built by `build.rs` as `libnccl.so.2`) from the
//! tests' side: load it, read its counters.
//!
//! Loading it by absolute path makes it the NCCL "already loaded in the process" that
//! `batch_size_runtime::agree` finds first, as it finds the one PyTorch loaded. Load the
//! fake CUDA driver ([`FakeCuda::session`](crate::fake_cuda::FakeCuda::session)) before: the
//! fake NCCL moves its data through it.

use std::ffi::{c_char, CString};
use std::fmt;
use std::sync::OnceLock;

use libloading::Library;

/// The absolute path of the fake NCCL that `build.rs` built.
pub const LIBRARY_PATH: &str = env!("FAKE_NCCL_LIBRARY");

type CallsFn = unsafe extern "C" fn(*const c_char) -> u64;
type LiveFn = extern "C" fn() -> u64;

/// The loaded fake NCCL and its counters.
pub struct FakeNccl {
    // Keeps the library, and so the function pointers below, alive for the process.
    _library: Library,
    calls: CallsFn,
    live_comms: LiveFn,
}

impl fmt::Debug for FakeNccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeNccl")
            .field("path", &LIBRARY_PATH)
            .finish_non_exhaustive()
    }
}

static NCCL: OnceLock<Result<FakeNccl, String>> = OnceLock::new();

impl FakeNccl {
    /// The fake NCCL, loaded by absolute path on first use.
    pub fn load() -> Result<&'static FakeNccl, String> {
        NCCL.get_or_init(|| {
            // SAFETY: the fake NCCL's initialisers have no preconditions.
            let library = unsafe { Library::new(LIBRARY_PATH) }
                .map_err(|error| format!("loading {LIBRARY_PATH}: {error}"))?;
            // SAFETY: the signatures of fake-nccl/fake_nccl.rs.
            let (calls, live_comms) = unsafe {
                (
                    *library
                        .get::<CallsFn>(b"fake_nccl_calls")
                        .map_err(|error| error.to_string())?,
                    *library
                        .get::<LiveFn>(b"fake_nccl_live_comms")
                        .map_err(|error| error.to_string())?,
                )
            };
            Ok(FakeNccl {
                _library: library,
                calls,
                live_comms,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// How many times the entry point `name` was called in this process.
    pub fn calls(&self, name: &str) -> u64 {
        let Ok(name) = CString::new(name) else {
            return 0;
        };
        // SAFETY: a valid NUL-terminated string.
        unsafe { (self.calls)(name.as_ptr()) }
    }

    /// Communicators created and not yet destroyed or aborted, in this process.
    pub fn live_comms(&self) -> u64 {
        (self.live_comms)()
    }
}
