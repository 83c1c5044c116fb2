//! A fake CUDA driver: a shared library whose SONAME is `libcuda.so`, exporting the driver entry
//! points that cudarc 0.19 calls for contexts, streams, events, plain and stream-ordered
//! allocations, copies, memory figures and the default memory pool, plus `fake_cuda_*` control
//! functions for the tests.
//!
//! `tests/build.rs` compiles it with plain `rustc` (no dependencies). A test loads it by absolute
//! path before cudarc's first call; cudarc's own `dlopen("libcuda.so")` then finds it loaded
//! under that SONAME and uses it.
//!
//! # Model
//! - Devices have a capacity. `cuMemGetInfo_v2` reports `free = capacity - plain - reserved`,
//!   where `plain` is what `cuMemAlloc_v2` holds and `reserved` what the default pool holds.
//! - `cuMemAlloc_v2` takes from the free bytes; `cuMemFree_v2` gives them back at once.
//! - `cuMemFreeAsync` returns the bytes to the pool's cache: still reserved, so not free for
//!   `cuMemAlloc_v2` (nor, on a real device, for other pools, cuBLAS/cuDNN workspaces or other
//!   processes). The cache goes back to the device at a context, stream or event
//!   synchronization while the pool holds more than its release threshold (0 by default:
//!   everything), or at `cuMemPoolTrimTo`.
//! - `cuMemAllocAsync` takes what it can from the cache (the pool's own memory is fungible here,
//!   which flatters the pool: a real one can be fragmented) and the rest from the free bytes.
//! - Either allocation fails with `CUDA_ERROR_OUT_OF_MEMORY` (2) past what it may use.
//! - A primary context is active while retained. Releasing the last reference destroys it and
//!   frees everything allocated on its device, as the real driver does.
//! - Everything but `cuInit`, `cuDriverGetVersion` and the error strings returns
//!   `CUDA_ERROR_NOT_INITIALIZED` (3) before `cuInit`.
//! - Memory contents are kept (lazily) so that copies read back what was written or set.
//! - Work of another library on a stream (the fake NCCL's collectives) holds it: while held,
//!   `cuStreamQuery` answers `CUDA_ERROR_NOT_READY` and `cuStreamSynchronize` waits, as a
//!   kernel that waits for its peers does on a real device (`fake_cuda_stream_hold`,
//!   `fake_cuda_stream_release`; `fake_cuda_read`/`fake_cuda_write` move its data).

#![allow(non_snake_case)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Condvar, Mutex, MutexGuard};

include!("counters.rs");

type CUresult = c_uint;
type CUdevice = c_int;
type CUcontext = *mut c_void;
type CUstream = *mut c_void;
type CUevent = *mut c_void;
type CUmemoryPool = *mut c_void;
type CUdeviceptr = u64;

const CUDA_SUCCESS: CUresult = 0;
const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
const CUDA_ERROR_NOT_READY: CUresult = 600;
const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_uint = 75;
const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_uint = 76;
const ATTRIBUTE_MEMORY_POOLS_SUPPORTED: c_uint = 115;

const POOL_RELEASE_THRESHOLD: c_uint = 4;
const POOL_RESERVED_MEM_CURRENT: c_uint = 5;
const POOL_RESERVED_MEM_HIGH: c_uint = 6;
const POOL_USED_MEM_CURRENT: c_uint = 7;
const POOL_USED_MEM_HIGH: c_uint = 8;

/// Context handles are `CONTEXT_BASE * (device + 1)`, pools `POOL_BASE + device`.
const CONTEXT_BASE: usize = 0x1000;
const POOL_BASE: usize = 0x20_0000;
/// Stream and event handles count up from here.
const HANDLE_BASE: usize = 0x100_0000;
/// Device `d`'s addresses start at `ADDRESS_BASE + d * ADDRESS_SPAN`.
const ADDRESS_BASE: u64 = 0x7000_0000_0000;
const ADDRESS_SPAN: u64 = 1 << 40;
const ALIGNMENT: u64 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Pool,
}

#[derive(Debug)]
struct Allocation {
    device: usize,
    kind: Kind,
    /// Bytes asked for: the addressable range.
    requested: u64,
    /// Contents, created on first write.
    data: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct Device {
    counters: FakeCudaCounters,
    plain_live: u64,
    /// Bytes the pool caches: freed by `cuMemFreeAsync`, still reserved.
    cached: u64,
    next_address: u64,
}

impl Device {
    fn new(index: usize, capacity: u64) -> Self {
        let mut device = Device {
            next_address: ADDRESS_BASE + index as u64 * ADDRESS_SPAN,
            ..Device::default()
        };
        device.counters.capacity = capacity;
        device.counters.memory_pools_supported = 1;
        device.refresh();
        device
    }

    fn refresh(&mut self) {
        let c = &mut self.counters;
        c.pool_reserved = c.pool_used + self.cached;
        c.pool_reserved_high = c.pool_reserved_high.max(c.pool_reserved);
        c.pool_used_high = c.pool_used_high.max(c.pool_used);
        c.free = c
            .capacity
            .saturating_sub(self.plain_live)
            .saturating_sub(c.pool_reserved);
    }

    /// Gives cached bytes back to the device until the pool holds at most `keep` bytes (or
    /// nothing but what is in use).
    fn trim_cache(&mut self, keep: u64) {
        let excess = self.counters.pool_reserved.saturating_sub(keep);
        self.cached -= excess.min(self.cached);
        self.refresh();
    }

    fn synchronized(&mut self) {
        self.counters.synchronizes += 1;
        let threshold = self.counters.release_threshold;
        if self.counters.pool_reserved > threshold {
            self.trim_cache(threshold);
        }
    }

    fn take_address(&mut self, bytes: u64) -> u64 {
        let address = self.next_address;
        self.next_address += bytes.max(1).div_ceil(ALIGNMENT) * ALIGNMENT;
        address
    }
}

#[derive(Debug, Default)]
struct State {
    initialized: bool,
    devices: Vec<Device>,
    allocations: BTreeMap<u64, Allocation>,
    /// Stream and event handles, with their device.
    streams: HashMap<usize, usize>,
    events: HashMap<usize, usize>,
    next_handle: usize,
    calls: HashMap<String, u64>,
    failures: HashMap<String, CUresult>,
    /// Streams held by work in progress elsewhere (stream handle → holds).
    held: HashMap<usize, u32>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
/// Signalled whenever a hold on a stream is released.
static RELEASED: Condvar = Condvar::new();

thread_local! {
    /// This thread's context stack, top last (context handles).
    static CONTEXT_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

struct Guard(MutexGuard<'static, Option<State>>);

impl std::ops::Deref for Guard {
    type Target = State;
    fn deref(&self) -> &State {
        // `enter` and `control` always leave Some behind.
        self.0.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl std::ops::DerefMut for Guard {
    fn deref_mut(&mut self) -> &mut State {
        self.0.as_mut().unwrap_or_else(|| unreachable!())
    }
}

fn control() -> Guard {
    let mut guard = STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if guard.is_none() {
        // Programs run by hand against the driver (LD_LIBRARY_PATH) can size the device with
        // FAKE_CUDA_CAPACITY (bytes); tests call fake_cuda_reset instead.
        let capacity = std::env::var("FAKE_CUDA_CAPACITY")
            .ok()
            .and_then(|bytes| bytes.parse().ok())
            .unwrap_or(1 << 30);
        *guard = Some(State {
            devices: vec![Device::new(0, capacity)],
            next_handle: HANDLE_BASE,
            ..State::default()
        });
    }
    Guard(guard)
}

/// The start of every driver entry point: counts the call, applies an injected failure, and
/// requires `cuInit` unless `before_init`.
fn enter_with(name: &str, before_init: bool) -> Result<Guard, CUresult> {
    let mut state = control();
    *state.calls.entry(name.to_owned()).or_default() += 1;
    if let Some(&code) = state.failures.get(name) {
        return Err(code);
    }
    if !before_init && !state.initialized {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    Ok(state)
}

fn enter(name: &str) -> Result<Guard, CUresult> {
    enter_with(name, false)
}

fn code(outcome: Result<(), CUresult>) -> CUresult {
    match outcome {
        Ok(()) => CUDA_SUCCESS,
        Err(code) => code,
    }
}

/// Writes through an out-pointer, or fails with CUDA_ERROR_INVALID_VALUE on null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for writes by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

impl State {
    fn device_index(&self, device: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(device)
            .ok()
            .filter(|&index| index < self.devices.len())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    fn context_device(&self, context: usize) -> Result<usize, CUresult> {
        if context == 0 || context % CONTEXT_BASE != 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        let index = context / CONTEXT_BASE - 1;
        match self.devices.get(index) {
            Some(device) if device.counters.primary_refcount > 0 => Ok(index),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// The device of the calling thread's current context.
    fn current_device(&self) -> Result<usize, CUresult> {
        let top = CONTEXT_STACK.with(|stack| stack.borrow().last().copied());
        match top {
            Some(context) => self.context_device(context),
            None => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// The device of a stream (0, 1 and 2 are the current context's default streams).
    fn stream_device(&self, stream: CUstream) -> Result<usize, CUresult> {
        let handle = stream as usize;
        if handle <= 2 {
            return self.current_device();
        }
        let device = *self.streams.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.live_device(device)
    }

    fn live_device(&self, device: usize) -> Result<usize, CUresult> {
        match self.devices.get(device) {
            Some(found) if found.counters.primary_refcount > 0 => Ok(device),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    fn pool_device(&self, pool: CUmemoryPool) -> Result<usize, CUresult> {
        (pool as usize)
            .checked_sub(POOL_BASE)
            .filter(|&index| index < self.devices.len())
            .filter(|&index| self.devices[index].counters.memory_pools_supported != 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn new_handle(&mut self) -> usize {
        self.next_handle += 16;
        self.next_handle
    }

    fn alloc(&mut self, device: usize, bytes: u64, kind: Kind) -> Result<u64, CUresult> {
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = &mut self.devices[device];
        let from_cache = match kind {
            Kind::Plain => 0,
            Kind::Pool => dev.cached.min(bytes),
        };
        if bytes - from_cache > dev.counters.free {
            dev.counters.failed_allocations += 1;
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        match kind {
            Kind::Plain => dev.plain_live += bytes,
            Kind::Pool => {
                dev.cached -= from_cache;
                dev.counters.pool_used += bytes;
            }
        }
        dev.counters.allocations += 1;
        dev.counters.live_allocations += 1;
        dev.counters.live_bytes += bytes;
        let address = dev.take_address(bytes);
        dev.refresh();
        self.allocations.insert(
            address,
            Allocation {
                device,
                kind,
                requested: bytes,
                data: None,
            },
        );
        Ok(address)
    }

    fn free(&mut self, address: u64, kind: Kind) -> Result<(), CUresult> {
        match self.allocations.get(&address) {
            Some(allocation) if allocation.kind == kind => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let allocation = self
            .allocations
            .remove(&address)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let dev = &mut self.devices[allocation.device];
        dev.counters.live_allocations -= 1;
        dev.counters.live_bytes -= allocation.requested;
        match kind {
            Kind::Plain => dev.plain_live -= allocation.requested,
            Kind::Pool => {
                dev.counters.pool_used -= allocation.requested;
                dev.cached += allocation.requested;
            }
        }
        dev.refresh();
        Ok(())
    }

    /// Destroys a device's primary context: everything allocated there is freed.
    fn destroy_context(&mut self, device: usize) {
        self.allocations
            .retain(|_, allocation| allocation.device != device);
        let dev = &mut self.devices[device];
        dev.counters.primary_refcount = 0;
        dev.counters.live_allocations = 0;
        dev.counters.live_bytes = 0;
        dev.counters.pool_used = 0;
        dev.plain_live = 0;
        dev.cached = 0;
        dev.refresh();
        self.streams.retain(|_, owner| *owner != device);
        self.events.retain(|_, owner| *owner != device);
    }

    /// The allocation holding `[address, address + len)`, and the offset of `address` in it.
    fn range_mut(&mut self, address: u64, len: u64) -> Result<(&mut Allocation, usize), CUresult> {
        let (base, allocation) = self
            .allocations
            .range_mut(..=address)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let offset = address - *base;
        if offset
            .checked_add(len)
            .map_or(true, |end| end > allocation.requested)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let offset = usize::try_from(offset).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        Ok((allocation, offset))
    }

    fn write(&mut self, address: u64, bytes: &[u8]) -> Result<(), CUresult> {
        let (allocation, offset) = self.range_mut(address, bytes.len() as u64)?;
        let size = usize::try_from(allocation.requested).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let data = allocation.data.get_or_insert_with(|| vec![0; size]);
        data[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn set(&mut self, address: u64, value: u8, len: u64) -> Result<(), CUresult> {
        let (allocation, offset) = self.range_mut(address, len)?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if value == 0 && allocation.data.is_none() {
            return Ok(()); // new memory reads as zeros already
        }
        let size = usize::try_from(allocation.requested).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let data = allocation.data.get_or_insert_with(|| vec![0; size]);
        data[offset..offset + len].fill(value);
        Ok(())
    }

    fn read(&mut self, address: u64, out: &mut [u8]) -> Result<(), CUresult> {
        let (allocation, offset) = self.range_mut(address, out.len() as u64)?;
        match &allocation.data {
            Some(data) => out.copy_from_slice(&data[offset..offset + out.len()]),
            None => out.fill(0),
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Control functions for the tests.

/// Forgets everything: `devices` devices of `capacity` bytes each, pools supported, the driver
/// not initialised, no failure injected, no call counted. Contexts current on threads stay
/// current but are inactive until retained again.
#[no_mangle]
pub extern "C" fn fake_cuda_reset(devices: c_int, capacity: u64) {
    let mut state = control();
    let count = usize::try_from(devices).unwrap_or(0);
    *state = State {
        devices: (0..count)
            .map(|index| Device::new(index, capacity))
            .collect(),
        next_handle: HANDLE_BASE,
        ..State::default()
    };
}

/// Makes `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` 0 or 1 for a device.
#[no_mangle]
pub extern "C" fn fake_cuda_set_memory_pools_supported(
    device: c_int,
    supported: c_int,
) -> CUresult {
    let mut state = control();
    match state.device_index(device) {
        Ok(index) => {
            state.devices[index].counters.memory_pools_supported = u64::from(supported != 0);
            CUDA_SUCCESS
        }
        Err(code) => code,
    }
}

/// Copies a device's counters to `out`.
///
/// # Safety
/// `out` is null or valid for a write of `FakeCudaCounters`.
#[no_mangle]
pub unsafe extern "C" fn fake_cuda_counters(device: c_int, out: *mut FakeCudaCounters) -> CUresult {
    let state = control();
    let outcome = state.device_index(device).and_then(|index| {
        // SAFETY: the caller's contract.
        unsafe { put(out, state.devices[index].counters) }
    });
    code(outcome)
}

/// How many times the entry point `name` was called since the last reset.
///
/// # Safety
/// `name` is a valid NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fake_cuda_calls(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    control().calls.get(name.as_ref()).copied().unwrap_or(0)
}

/// Makes every call of the entry point `name` fail with `code` (0: stop failing).
///
/// # Safety
/// `name` is a valid NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fake_cuda_fail(name: *const c_char, code: CUresult) {
    if name.is_null() {
        return;
    }
    // SAFETY: the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let mut state = control();
    if code == CUDA_SUCCESS {
        state.failures.remove(&name);
    } else {
        state.failures.insert(name, code);
    }
}

/// Holds `stream` for work of another library (the fake NCCL): it reads as not ready, and
/// synchronizing it waits, until as many `fake_cuda_stream_release`.
#[no_mangle]
pub extern "C" fn fake_cuda_stream_hold(stream: CUstream) -> CUresult {
    let mut state = control();
    let handle = stream as usize;
    if handle > 2 && !state.streams.contains_key(&handle) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *state.held.entry(handle).or_default() += 1;
    CUDA_SUCCESS
}

/// Ends one hold of `stream`.
#[no_mangle]
pub extern "C" fn fake_cuda_stream_release(stream: CUstream) -> CUresult {
    let mut state = control();
    let handle = stream as usize;
    let outcome = match state.held.get_mut(&handle) {
        Some(holds) if *holds > 0 => {
            *holds -= 1;
            CUDA_SUCCESS
        }
        _ => CUDA_ERROR_INVALID_VALUE,
    };
    drop(state);
    RELEASED.notify_all();
    outcome
}

/// Copies `bytes` bytes of device memory at `address` to `host`, from any thread and context
/// (what a collective's kernel reads).
///
/// # Safety
/// `host` is valid for `bytes` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn fake_cuda_read(address: CUdeviceptr, host: *mut c_void, bytes: usize) -> CUresult {
    if host.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), bytes) };
    code(control().read(address, out))
}

/// Copies `bytes` bytes from `host` to device memory at `address`, from any thread and context
/// (what a collective's kernel writes).
///
/// # Safety
/// `host` is valid for `bytes` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn fake_cuda_write(
    address: CUdeviceptr,
    host: *const c_void,
    bytes: usize,
) -> CUresult {
    if host.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    let data = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), bytes) };
    code(control().write(address, data))
}

// ---------------------------------------------------------------------------------------------
// Initialisation, version, errors.

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    code(enter_with("cuInit", true).and_then(|mut state| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        state.initialized = true;
        Ok(())
    }))
}

/// # Safety
/// `version` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: the caller's contract.
    code(enter_with("cuDriverGetVersion", true).and_then(|_| unsafe { put(version, 13000) }))
}

fn error_text(error: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    Some(match error {
        CUDA_SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        CUDA_ERROR_INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        CUDA_ERROR_OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        CUDA_ERROR_NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        CUDA_ERROR_INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        CUDA_ERROR_INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        CUDA_ERROR_INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        CUDA_ERROR_NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        CUDA_ERROR_NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        _ => return None,
    })
}

/// # Safety
/// `out` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, out: *mut *const c_char) -> CUresult {
    code(enter_with("cuGetErrorName", true).and_then(|_| {
        let (name, _) = error_text(error).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's contract; the string is static.
        unsafe { put(out, name.as_ptr()) }
    }))
}

/// # Safety
/// `out` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, out: *mut *const c_char) -> CUresult {
    code(enter_with("cuGetErrorString", true).and_then(|_| {
        let (_, text) = error_text(error).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's contract; the string is static.
        unsafe { put(out, text.as_ptr()) }
    }))
}

// ---------------------------------------------------------------------------------------------
// Devices.

/// # Safety
/// `count` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    code(enter("cuDeviceGetCount").and_then(|state| {
        let devices = c_int::try_from(state.devices.len()).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's contract.
        unsafe { put(count, devices) }
    }))
}

/// # Safety
/// `device` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    code(enter("cuDeviceGet").and_then(|state| {
        state.device_index(ordinal)?;
        // SAFETY: the caller's contract.
        unsafe { put(device, ordinal) }
    }))
}

/// # Safety
/// `name` is null or valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    len: c_int,
    device: CUdevice,
) -> CUresult {
    code(enter("cuDeviceGetName").and_then(|state| {
        let index = state.device_index(device)?;
        let text = format!("Fake CUDA Device {index}\0");
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len < text.len() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `name` holds at least `len >= text.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, text.len()) };
        Ok(())
    }))
}

/// # Safety
/// `bytes` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    code(enter("cuDeviceTotalMem_v2").and_then(|state| {
        let index = state.device_index(device)?;
        let total = usize::try_from(state.devices[index].counters.capacity)
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's contract.
        unsafe { put(bytes, total) }
    }))
}

/// # Safety
/// `value` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_uint,
    device: CUdevice,
) -> CUresult {
    code(enter("cuDeviceGetAttribute").and_then(|state| {
        let index = state.device_index(device)?;
        let answer = match attribute {
            ATTRIBUTE_MEMORY_POOLS_SUPPORTED => {
                c_int::from(state.devices[index].counters.memory_pools_supported != 0)
            }
            ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 8,
            ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
            _ => 0,
        };
        // SAFETY: the caller's contract.
        unsafe { put(value, answer) }
    }))
}

/// # Safety
/// `uuid` is null or valid for 16 bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    code(enter("cuDeviceGetUuid").and_then(|state| {
        let index = state.device_index(device)?;
        let mut bytes = [0xfa_u8; 16];
        bytes[15] = index as u8;
        // SAFETY: the caller's contract.
        unsafe { put(uuid, bytes) }
    }))
}

/// # Safety
/// `uuid` is null or valid for 16 bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    unsafe { cuDeviceGetUuid(uuid, device) }
}

// ---------------------------------------------------------------------------------------------
// Primary contexts and the context stack.

/// # Safety
/// `context` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    code(enter("cuDevicePrimaryCtxRetain").and_then(|mut state| {
        let index = state.device_index(device)?;
        if context.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let counters = &mut state.devices[index].counters;
        counters.primary_retains += 1;
        if counters.primary_refcount == 0 {
            counters.contexts_created += 1;
        }
        counters.primary_refcount += 1;
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { put(context, (CONTEXT_BASE * (index + 1)) as CUcontext) }
    }))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult {
    code(enter("cuDevicePrimaryCtxRelease_v2").and_then(|mut state| {
        let index = state.device_index(device)?;
        let counters = &mut state.devices[index].counters;
        if counters.primary_refcount == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        counters.primary_releases += 1;
        counters.primary_refcount -= 1;
        if counters.primary_refcount == 0 {
            state.destroy_context(index);
        }
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(device: CUdevice) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(device)
}

/// # Safety
/// `flags` and `active` are null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    device: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    code(enter("cuDevicePrimaryCtxGetState").and_then(|state| {
        let index = state.device_index(device)?;
        let is_active = c_int::from(state.devices[index].counters.primary_refcount > 0);
        // SAFETY: the caller's contract.
        unsafe {
            put(flags, 0)?;
            put(active, is_active)
        }
    }))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(device: CUdevice) -> CUresult {
    code(enter("cuDevicePrimaryCtxReset_v2").and_then(|mut state| {
        let index = state.device_index(device)?;
        state.destroy_context(index);
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(context: CUcontext) -> CUresult {
    code(enter("cuCtxPushCurrent_v2").and_then(|state| {
        state.context_device(context as usize)?;
        CONTEXT_STACK.with(|stack| stack.borrow_mut().push(context as usize));
        Ok(())
    }))
}

/// # Safety
/// `context` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(context: *mut CUcontext) -> CUresult {
    code(enter("cuCtxPopCurrent_v2").and_then(|_| {
        let popped = CONTEXT_STACK
            .with(|stack| stack.borrow_mut().pop())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !context.is_null() {
            // SAFETY: the caller's contract; non-null.
            unsafe { put(context, popped as CUcontext) }?;
        }
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(context: CUcontext) -> CUresult {
    code(enter("cuCtxSetCurrent").and_then(|state| {
        if context.is_null() {
            CONTEXT_STACK.with(|stack| stack.borrow_mut().pop());
            return Ok(());
        }
        state.context_device(context as usize)?;
        CONTEXT_STACK.with(|stack| {
            let mut stack = stack.borrow_mut();
            stack.pop();
            stack.push(context as usize);
        });
        Ok(())
    }))
}

/// # Safety
/// `context` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut CUcontext) -> CUresult {
    code(enter("cuCtxGetCurrent").and_then(|_| {
        let top = CONTEXT_STACK
            .with(|stack| stack.borrow().last().copied())
            .unwrap_or(0);
        // SAFETY: the caller's contract.
        unsafe { put(context, top as CUcontext) }
    }))
}

/// # Safety
/// `device` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    code(enter("cuCtxGetDevice").and_then(|state| {
        let index = state.current_device()?;
        // SAFETY: the caller's contract.
        unsafe { put(device, index as CUdevice) }
    }))
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    code(enter("cuCtxSynchronize").and_then(|mut state| {
        let index = state.current_device()?;
        state.devices[index].synchronized();
        Ok(())
    }))
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

/// # Safety
/// `stream` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CUstream, _flags: c_uint) -> CUresult {
    code(enter("cuStreamCreate").and_then(|mut state| {
        let index = state.current_device()?;
        let handle = state.new_handle();
        // SAFETY: the caller's contract.
        unsafe { put(stream, handle as CUstream) }?;
        state.streams.insert(handle, index);
        Ok(())
    }))
}

/// # Safety
/// `stream` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut CUstream,
    flags: c_uint,
    _priority: c_int,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    unsafe { cuStreamCreate(stream, flags) }
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    code(enter("cuStreamDestroy_v2").and_then(|mut state| {
        state
            .streams
            .remove(&(stream as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }))
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    code(enter("cuStreamSynchronize").and_then(|state| {
        state.stream_device(stream)?;
        let mut state = wait_while_held(state, stream as usize);
        let index = state.stream_device(stream)?;
        state.devices[index].synchronized();
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: CUstream) -> CUresult {
    code(enter("cuStreamQuery").and_then(|state| {
        state.stream_device(stream)?;
        match state.held.get(&(stream as usize)) {
            Some(&holds) if holds > 0 => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }))
}

/// Waits, the lock released, until nothing holds `stream`.
fn wait_while_held(state: Guard, stream: usize) -> Guard {
    let guard = RELEASED
        .wait_while(state.0, |state| {
            state
                .as_ref()
                .and_then(|state| state.held.get(&stream))
                .is_some_and(|&holds| holds > 0)
        })
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    Guard(guard)
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: CUstream, event: CUevent, _flags: c_uint) -> CUresult {
    code(enter("cuStreamWaitEvent").and_then(|state| {
        state.stream_device(stream)?;
        state
            .events
            .contains_key(&(event as usize))
            .then_some(())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }))
}

/// # Safety
/// `event` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut CUevent, _flags: c_uint) -> CUresult {
    code(enter("cuEventCreate").and_then(|mut state| {
        let index = state.current_device()?;
        let handle = state.new_handle();
        // SAFETY: the caller's contract.
        unsafe { put(event, handle as CUevent) }?;
        state.events.insert(handle, index);
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult {
    code(enter("cuEventRecord").and_then(|state| {
        let stream_device = state.stream_device(stream)?;
        match state.events.get(&(event as usize)) {
            Some(&device) if device == stream_device => Ok(()),
            Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
            None => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }))
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    code(enter("cuEventSynchronize").and_then(|mut state| {
        let index = *state
            .events
            .get(&(event as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        state.devices[index].synchronized();
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    code(enter("cuEventQuery").and_then(|state| {
        state
            .events
            .contains_key(&(event as usize))
            .then_some(())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }))
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    code(enter("cuEventDestroy_v2").and_then(|mut state| {
        state
            .events
            .remove(&(event as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }))
}

/// # Safety
/// `milliseconds` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    milliseconds: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    code(enter("cuEventElapsedTime").and_then(|state| {
        for event in [start, end] {
            if !state.events.contains_key(&(event as usize)) {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
        }
        // SAFETY: the caller's contract.
        unsafe { put(milliseconds, 0.0) }
    }))
}

/// # Safety
/// `milliseconds` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    milliseconds: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    unsafe { cuEventElapsedTime(milliseconds, start, end) }
}

// ---------------------------------------------------------------------------------------------
// Memory.

/// # Safety
/// `address` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(address: *mut CUdeviceptr, bytes: usize) -> CUresult {
    code(enter("cuMemAlloc_v2").and_then(|mut state| {
        if address.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let index = state.current_device()?;
        let allocated = state.alloc(index, bytes as u64, Kind::Plain)?;
        // SAFETY: the caller's contract; non-null.
        unsafe { put(address, allocated) }
    }))
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(address: CUdeviceptr) -> CUresult {
    code(enter("cuMemFree_v2").and_then(|mut state| state.free(address, Kind::Plain)))
}

/// # Safety
/// `address` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    address: *mut CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    code(enter("cuMemAllocAsync").and_then(|mut state| {
        if address.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let index = state.stream_device(stream)?;
        if state.devices[index].counters.memory_pools_supported == 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let allocated = state.alloc(index, bytes as u64, Kind::Pool)?;
        // SAFETY: the caller's contract; non-null.
        unsafe { put(address, allocated) }
    }))
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(address: CUdeviceptr, stream: CUstream) -> CUresult {
    code(enter("cuMemFreeAsync").and_then(|mut state| {
        state.stream_device(stream)?;
        state.free(address, Kind::Pool)
    }))
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(address: CUdeviceptr, value: u8, count: usize) -> CUresult {
    code(enter("cuMemsetD8_v2").and_then(|mut state| {
        state.current_device()?;
        state.set(address, value, count as u64)
    }))
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(
    address: CUdeviceptr,
    value: u8,
    count: usize,
    stream: CUstream,
) -> CUresult {
    code(enter("cuMemsetD8Async").and_then(|mut state| {
        state.stream_device(stream)?;
        state.set(address, value, count as u64)
    }))
}

/// # Safety
/// `source` is null or valid for `bytes` bytes of reads.
unsafe fn copy_in(
    state: &mut State,
    address: CUdeviceptr,
    source: *const c_void,
    bytes: usize,
) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    if source.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's contract.
    let host = unsafe { std::slice::from_raw_parts(source.cast::<u8>(), bytes) };
    state.write(address, host)
}

/// # Safety
/// `target` is null or valid for `bytes` bytes of writes.
unsafe fn copy_out(
    state: &mut State,
    target: *mut c_void,
    address: CUdeviceptr,
    bytes: usize,
) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    if target.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's contract.
    let host = unsafe { std::slice::from_raw_parts_mut(target.cast::<u8>(), bytes) };
    state.read(address, host)
}

/// # Safety
/// `source` is valid for `bytes` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    target: CUdeviceptr,
    source: *const c_void,
    bytes: usize,
) -> CUresult {
    code(enter("cuMemcpyHtoD_v2").and_then(|mut state| {
        state.current_device()?;
        // SAFETY: the caller's contract, passed on.
        unsafe { copy_in(&mut state, target, source, bytes) }
    }))
}

/// # Safety
/// `source` is valid for `bytes` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    target: CUdeviceptr,
    source: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    code(enter("cuMemcpyHtoDAsync_v2").and_then(|mut state| {
        state.stream_device(stream)?;
        // SAFETY: the caller's contract, passed on.
        unsafe { copy_in(&mut state, target, source, bytes) }
    }))
}

/// # Safety
/// `target` is valid for `bytes` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    target: *mut c_void,
    source: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    code(enter("cuMemcpyDtoH_v2").and_then(|mut state| {
        state.current_device()?;
        // SAFETY: the caller's contract, passed on.
        unsafe { copy_out(&mut state, target, source, bytes) }
    }))
}

/// # Safety
/// `target` is valid for `bytes` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    target: *mut c_void,
    source: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    code(enter("cuMemcpyDtoHAsync_v2").and_then(|mut state| {
        state.stream_device(stream)?;
        // SAFETY: the caller's contract, passed on.
        unsafe { copy_out(&mut state, target, source, bytes) }
    }))
}

fn copy_device(
    state: &mut State,
    target: CUdeviceptr,
    source: CUdeviceptr,
    bytes: usize,
) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    let mut buffer = vec![0; bytes];
    state.read(source, &mut buffer)?;
    state.write(target, &buffer)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(
    target: CUdeviceptr,
    source: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    code(enter("cuMemcpyDtoD_v2").and_then(|mut state| {
        state.current_device()?;
        copy_device(&mut state, target, source, bytes)
    }))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    target: CUdeviceptr,
    source: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    code(enter("cuMemcpyDtoDAsync_v2").and_then(|mut state| {
        state.stream_device(stream)?;
        copy_device(&mut state, target, source, bytes)
    }))
}

/// # Safety
/// `free` and `total` are null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    code(enter("cuMemGetInfo_v2").and_then(|mut state| {
        let index = state.current_device()?;
        state.devices[index].counters.mem_get_infos += 1;
        let counters = &state.devices[index].counters;
        let free_bytes = usize::try_from(counters.free).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let total_bytes =
            usize::try_from(counters.capacity).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's contract.
        unsafe {
            put(free, free_bytes)?;
            put(total, total_bytes)
        }
    }))
}

// ---------------------------------------------------------------------------------------------
// The default memory pool.

/// # Safety
/// `pool` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    pool: *mut CUmemoryPool,
    device: CUdevice,
) -> CUresult {
    code(enter("cuDeviceGetDefaultMemPool").and_then(|state| {
        let index = state.device_index(device)?;
        if state.devices[index].counters.memory_pools_supported == 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        // SAFETY: the caller's contract.
        unsafe { put(pool, (POOL_BASE + index) as CUmemoryPool) }
    }))
}

/// # Safety
/// `pool` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, device: CUdevice) -> CUresult {
    // The current pool is always the default one here.
    // SAFETY: the caller's contract, passed on.
    unsafe { cuDeviceGetDefaultMemPool(pool, device) }
}

/// # Safety
/// `value` is null or valid for a write of the attribute's type (`cuuint64_t` for 4 to 8).
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attribute: c_uint,
    value: *mut c_void,
) -> CUresult {
    code(enter("cuMemPoolGetAttribute").and_then(|mut state| {
        let index = state.pool_device(pool)?;
        state.devices[index].counters.pool_attribute_reads += 1;
        let counters = &state.devices[index].counters;
        let answer = match attribute {
            POOL_RELEASE_THRESHOLD => counters.release_threshold,
            POOL_RESERVED_MEM_CURRENT => counters.pool_reserved,
            POOL_RESERVED_MEM_HIGH => counters.pool_reserved_high,
            POOL_USED_MEM_CURRENT => counters.pool_used,
            POOL_USED_MEM_HIGH => counters.pool_used_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: the caller's contract: these attributes are cuuint64_t.
        unsafe { put(value.cast::<u64>(), answer) }
    }))
}

/// # Safety
/// `value` is null or valid for a read of the attribute's type (`cuuint64_t` for 4, 6 and 8).
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attribute: c_uint,
    value: *mut c_void,
) -> CUresult {
    code(enter("cuMemPoolSetAttribute").and_then(|mut state| {
        let index = state.pool_device(pool)?;
        state.devices[index].counters.pool_attribute_writes += 1;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's contract: these attributes are cuuint64_t.
        let new = unsafe { value.cast::<u64>().read() };
        let counters = &mut state.devices[index].counters;
        match attribute {
            POOL_RELEASE_THRESHOLD => counters.release_threshold = new,
            // The high-water marks can only be reset (to the current figure), with 0.
            POOL_RESERVED_MEM_HIGH if new == 0 => {
                counters.pool_reserved_high = counters.pool_reserved
            }
            POOL_USED_MEM_HIGH if new == 0 => counters.pool_used_high = counters.pool_used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult {
    code(enter("cuMemPoolTrimTo").and_then(|mut state| {
        let index = state.pool_device(pool)?;
        let device = &mut state.devices[index];
        device.counters.trims += 1;
        device.trim_cache(keep as u64);
        Ok(())
    }))
}
