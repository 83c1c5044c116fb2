//! ONNX Runtime's CPU arena through `ort` 2.0.0-rc.15 (feature `ort`), read with
//! `AllocatorGetStats`. Why a run to shrink it: `OrtAllocator`'s `Shrink` is null in ONNX Runtime
//! 1.31 and 1.32; the run option `memory.enable_memory_arena_shrinkage` is the one door.

use std::ffi::{c_char, CStr};
use std::ptr;
use std::sync::{Arc, Mutex, PoisonError, TryLockError};

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::{RunOptions, Session};
use ort::value::{DynTensor, ValueType};
use ort::AsPointer;

use super::{DeviceMemory, HostMemory, MemoryBackend, MemorySnapshot, Release, ReleaseError};

/// The run option that shrinks the CPU arena at the end of a run.
const SHRINK: (&str, &str) = ("memory.enable_memory_arena_shrinkage", "cpu:0");

/// One session's CPU arena: its figures, and a shrink as the release.
///
/// - the device's total: the arena's `Limit` where it is capped (`CreateArenaCfgV2`'s
///   `max_mem`), else the host's; free: what the cap leaves beside `TotalAllocated` (never more
///   than the host's free bytes);
/// - in use: `InUse`; reserved: `TotalAllocated`, the regions the arena holds
///   ([`DeviceMemory::pool_reserved`] less [`DeviceMemory::pool_used`] is reserved but
///   unallocated);
/// - the attempt's peak: `MaxInUse` where the attempt raised it (ONNX Runtime keeps it for the
///   session and has no reset).
///
/// The release runs the session on zero samples (every dimension the model leaves free set to
/// 0) with the run option `memory.enable_memory_arena_shrinkage=cpu:0`. It needs the session:
/// an `Arc<Mutex<Session>>` that the attempt locks while it runs, and that is free between
/// attempts (a release that finds it locked says so and gives nothing back).
#[derive(Debug)]
pub struct OrtArena {
    /// The session's CPU allocator (the arena): `ort`'s `Allocator` is `Send`, not `Sync`.
    /// Declared before the session: fields drop in order, and the allocator must go first.
    allocator: Mutex<Option<Allocator>>,
    session: Arc<Mutex<Session>>,
    host: HostMemory,
    max_in_use_at_start: Mutex<Option<u64>>,
}

/// The arena's counters (`AllocatorGetStats`), in bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    limit: Option<u64>,
    in_use: Option<u64>,
    total_allocated: Option<u64>,
    max_in_use: Option<u64>,
}

impl OrtArena {
    /// The CPU arena of `session`.
    pub fn new(session: &Arc<Mutex<Session>>) -> Self {
        // Never waits: a caller that holds the lock while the release is built gets no figures,
        // not a deadlock.
        let locked = match session.try_lock() {
            Ok(session) => Some(session),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let allocator = locked.and_then(|session| {
            MemoryInfo::new(
                AllocationDevice::CPU,
                0,
                AllocatorType::Arena,
                MemoryType::Default,
            )
            .and_then(|info| Allocator::new(&session, info))
            .map_err(
                |error| tracing::debug!(%error, "no CPU allocator for the session: no figures"),
            )
            .ok()
        });
        OrtArena {
            allocator: Mutex::new(allocator),
            session: Arc::clone(session),
            host: HostMemory::new(),
            max_in_use_at_start: Mutex::new(None),
        }
    }

    fn stats(&self) -> Option<Stats> {
        let allocator = self
            .allocator
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let allocator = allocator.as_ref()?;
        let api = ort::api();
        let mut pairs = ptr::null_mut();
        // SAFETY: `allocator` is a live `OrtAllocator` of the session this arena keeps alive;
        // `pairs` receives a key-value list that is released below.
        let status = unsafe { (api.AllocatorGetStats)(allocator.ptr(), &mut pairs) };
        if !status.0.is_null() {
            // SAFETY: a non-null status from the call above, released once.
            unsafe { (api.ReleaseStatus)(status.0) };
            return None;
        }
        if pairs.is_null() {
            return None;
        }
        let read = |key: &CStr| -> Option<u64> {
            // SAFETY: `pairs` is the live list returned above; the value, where present, is a
            // NUL-terminated string the list owns, read before the list is released.
            let value: *const c_char = unsafe { (api.GetKeyValue)(pairs, key.as_ptr()) };
            if value.is_null() {
                return None;
            }
            // SAFETY: as above.
            unsafe { CStr::from_ptr(value) }.to_str().ok()?.parse().ok()
        };
        let stats = Stats {
            limit: read(c"Limit"),
            in_use: read(c"InUse"),
            total_allocated: read(c"TotalAllocated"),
            max_in_use: read(c"MaxInUse"),
        };
        // SAFETY: the list returned above, released once.
        unsafe { (api.ReleaseKeyValuePairs)(pairs) };
        Some(stats)
    }

    /// Zero samples for every input: free dimensions set to 0, a fixed shape as zeros of it
    /// (allocated outside the arena).
    fn zero_samples(session: &Session) -> Result<Vec<(String, DynTensor)>, ReleaseError> {
        let allocator = Allocator::default();
        session
            .inputs()
            .iter()
            .map(|input| {
                let ValueType::Tensor { ty, shape, .. } = input.dtype() else {
                    return Err(ReleaseError::new(format!(
                        "ONNX Runtime's arena: input '{}' is not a tensor, no zero-sample run to shrink it",
                        input.name()
                    )));
                };
                let dims: Vec<i64> = shape.iter().map(|dim| (*dim).max(0)).collect();
                // `DynTensor::new` fills the tensor with zeros.
                let tensor = DynTensor::new(&allocator, *ty, dims)
                    .map_err(|error| ReleaseError::new(format!("ONNX Runtime: {error}")))?;
                Ok((input.name().to_owned(), tensor))
            })
            .collect()
    }
}

impl MemoryBackend for OrtArena {
    fn release(&self) -> Result<(), ReleaseError> {
        let mut session = match self.session.try_lock() {
            Ok(session) => session,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Err(ReleaseError::new(
                "ONNX Runtime's arena: the session is locked outside the attempt; lock it inside",
            )),
        };
        let inputs = Self::zero_samples(&session)?;
        let mut options = RunOptions::new()
            .map_err(|error| ReleaseError::new(format!("ONNX Runtime: {error}")))?;
        options
            .set(SHRINK.0, SHRINK.1)
            .map_err(|error| ReleaseError::new(format!("ONNX Runtime: {error}")))?;
        session
            .run_with_options(inputs, &options)
            .map(drop)
            .map_err(|error| {
                ReleaseError::new(format!("ONNX Runtime's zero-sample run: {error}"))
            })?;
        drop(session);
        self.host.release()
    }

    fn memory(&self) -> MemorySnapshot {
        let Some(stats) = self.stats() else {
            return MemorySnapshot::default();
        };
        let Some(host) = self.host.memory().devices.pop() else {
            return MemorySnapshot::default();
        };
        let reserved = stats.total_allocated.unwrap_or(0);
        // An arena with no cap says the largest `size_t`.
        let (total, free) = match stats.limit.filter(|limit| *limit < host.total) {
            Some(limit) => (limit, limit.saturating_sub(reserved).min(host.free)),
            None => (host.total, host.free),
        };
        let at_start = *self
            .max_in_use_at_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let peak = stats
            .max_in_use
            .filter(|peak| at_start.is_some_and(|start| *peak > start));
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "onnxruntime:cpu".to_owned(),
                total,
                free,
                pool_reserved: stats.total_allocated,
                pool_used: stats.in_use,
                peak,
            }],
        }
    }

    fn reset_peak(&self) {
        let max = self.stats().and_then(|stats| stats.max_in_use);
        *self
            .max_in_use_at_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = max;
    }
}

impl Release {
    /// ONNX Runtime's CPU arena of `session` (feature `ort`): its figures, and a zero-sample run
    /// that shrinks it at each release ([`OrtArena`]). Lock the session inside the attempt.
    ///
    /// ```ignore
    /// #[find_executable_batch_size(starting = 512, release = Release::ort(session))]
    /// fn infer(batch_size: usize, session: &Arc<Mutex<Session>>) -> ort::Result<Vec<f32>> {
    ///     let mut session = session.lock().unwrap();
    ///     ...
    /// }
    /// ```
    pub fn ort(session: &Arc<Mutex<Session>>) -> Self {
        Release::backend(OrtArena::new(session))
    }
}
