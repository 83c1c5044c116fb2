//! A fake NCCL: a shared library whose SONAME is `libnccl.so.2` (the only name the NCCL pip
//! wheel ships), exporting the entry points batch-size's `NcclRank` calls, plus `fake_nccl_*`
//! control functions for the tests.
//!
//! `tests/build.rs` compiles it with plain `rustc` (no dependencies). It runs on the fake CUDA
//! driver (`fake-cuda/`): device memory is read and written through the driver's
//! `fake_cuda_read`/`fake_cuda_write`, and a collective holds its stream
//! (`fake_cuda_stream_hold`) until every rank has contributed, as a real NCCL kernel spins on
//! the device until its peers arrive.
//!
//! # Model
//! - `ncclGetUniqueId` starts a root on `127.0.0.1` (a thread with a listening socket) and puts
//!   its port in the Id, as the real bootstrap does: ranks in threads of one process and in
//!   other processes meet there alike.
//! - `ncclCommInitRankConfig` honours `blocking = 0`: it returns `ncclInProgress` and
//!   `ncclCommGetAsyncError` says `ncclInProgress` until every rank has joined.
//! - `ncclAllReduce` (sum, product, max, min over 32- and 64-bit integers and floats) returns at
//!   once; the stream stays held until the root has every rank's values and sent the result.
//! - A rank whose connection closes (its communicator aborted or destroyed, its process dead)
//!   makes the others' `ncclCommGetAsyncError` say `ncclRemoteError`; their streams stay held
//!   (the kernel would wait forever) until they abort.
//! - `ncclCommAbort` and `ncclCommDestroy` close the connection, release the streams the
//!   communicator holds and free it.

#![allow(non_snake_case, non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::thread;

type ncclResult_t = c_uint;
type CUstream = *mut c_void;
type CUdeviceptr = u64;
type CUresult = c_uint;

const NCCL_SUCCESS: ncclResult_t = 0;
const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
const NCCL_INVALID_USAGE: ncclResult_t = 5;
const NCCL_REMOTE_ERROR: ncclResult_t = 6;
const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// NCCL_VERSION(2, 21, 5).
const VERSION: c_int = 22105;
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
const ID_MAGIC: &[u8; 8] = b"FAKENCCL";

/// Root → rank messages.
const READY: u8 = 1;
const RESULT: u8 = 2;
const PEER_LOST: u8 = 3;
/// The sequence number of a rank's goodbye (`ncclCommDestroy`): it leaves on purpose.
const GOODBYE: u64 = u64::MAX;

// ---------------------------------------------------------------------------------------------
// The fake CUDA driver's entry points, found in the process.

type ReadFn = unsafe extern "C" fn(CUdeviceptr, *mut c_void, usize) -> CUresult;
type WriteFn = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult;
type HoldFn = extern "C" fn(CUstream) -> CUresult;

struct Driver {
    read: ReadFn,
    write: WriteFn,
    hold: HoldFn,
    release: HoldFn,
}

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

const RTLD_NOW: c_int = 2;
const RTLD_NOLOAD: c_int = 4;

/// The fake driver, which the tests load before anything calls CUDA.
fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: plain dlopen/dlsym of a library already loaded; the symbols have the
            // signatures above (fake-cuda/fake_cuda.rs).
            unsafe {
                let handle = dlopen(c"libcuda.so".as_ptr(), RTLD_NOW | RTLD_NOLOAD);
                if handle.is_null() {
                    return None;
                }
                let find = |name: &CStr| {
                    let symbol = dlsym(handle, name.as_ptr());
                    (!symbol.is_null()).then_some(symbol)
                };
                Some(Driver {
                    read: std::mem::transmute::<*mut c_void, ReadFn>(find(c"fake_cuda_read")?),
                    write: std::mem::transmute::<*mut c_void, WriteFn>(find(c"fake_cuda_write")?),
                    hold: std::mem::transmute::<*mut c_void, HoldFn>(find(
                        c"fake_cuda_stream_hold",
                    )?),
                    release: std::mem::transmute::<*mut c_void, HoldFn>(find(
                        c"fake_cuda_stream_release",
                    )?),
                })
            }
        })
        .as_ref()
}

// ---------------------------------------------------------------------------------------------
// Counters and the last error.

static CALLS: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
static LIVE_COMMS: Mutex<u64> = Mutex::new(0);
static LAST_ERROR: Mutex<Option<CString>> = Mutex::new(None);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn count(name: &str) {
    *lock(&CALLS)
        .get_or_insert_with(HashMap::new)
        .entry(name.to_owned())
        .or_default() += 1;
}

fn fail(code: ncclResult_t, message: String) -> ncclResult_t {
    *lock(&LAST_ERROR) = CString::new(message).ok();
    code
}

/// How many times the entry point `name` was called since the last reset.
///
/// # Safety
/// `name` is a valid NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fake_nccl_calls(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    lock(&CALLS)
        .as_ref()
        .and_then(|calls| calls.get(name.as_ref()).copied())
        .unwrap_or(0)
}

/// Communicators created and not yet aborted or destroyed.
#[no_mangle]
pub extern "C" fn fake_nccl_live_comms() -> u64 {
    *lock(&LIVE_COMMS)
}

/// Forgets the call counts.
#[no_mangle]
pub extern "C" fn fake_nccl_reset() {
    *lock(&CALLS) = None;
}

// ---------------------------------------------------------------------------------------------
// Version and errors.

/// # Safety
/// `version` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    count("ncclGetVersion");
    if version.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: the caller's contract; non-null.
    unsafe { version.write(VERSION) };
    NCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    let text: &'static CStr = match result {
        NCCL_SUCCESS => c"no error",
        NCCL_UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        NCCL_SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        NCCL_INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        NCCL_INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        NCCL_REMOTE_ERROR => c"remote process exited or there was a network error",
        NCCL_IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    text.as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    static EMPTY: &CStr = c"";
    // The string lives until the next failure; callers copy it at once, as with the real one.
    match lock(&LAST_ERROR).as_ref() {
        Some(text) => text.as_ptr(),
        None => EMPTY.as_ptr(),
    }
}

// ---------------------------------------------------------------------------------------------
// The root: one per unique Id, where the ranks meet.

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    internal: [c_char; 128],
}

/// What a rank's reader thread tells the root.
enum ToRoot {
    Joined { rank: usize, world: usize, stream: TcpStream },
    Values { rank: usize, message: Contribution },
    Lost { rank: usize },
}

struct Contribution {
    sequence: u64,
    datatype: u32,
    op: u32,
    bytes: Vec<u8>,
}

/// # Safety
/// `id` is null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t {
    count("ncclGetUniqueId");
    if id.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let listener = match TcpListener::bind("127.0.0.1:0") {
        Ok(listener) => listener,
        Err(error) => return fail(NCCL_SYSTEM_ERROR, format!("bootstrap: bind: {error}")),
    };
    let port = match listener.local_addr() {
        Ok(address) => address.port(),
        Err(error) => return fail(NCCL_SYSTEM_ERROR, format!("bootstrap: {error}")),
    };
    thread::spawn(move || root(listener));
    let mut internal = [0 as c_char; 128];
    for (slot, byte) in internal.iter_mut().zip(ID_MAGIC.iter().chain(&port.to_le_bytes())) {
        *slot = *byte as c_char;
    }
    // SAFETY: the caller's contract; non-null.
    unsafe { id.write(ncclUniqueId { internal }) };
    NCCL_SUCCESS
}

fn port_of(id: &ncclUniqueId) -> Option<u16> {
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    (&bytes[..8] == ID_MAGIC).then(|| u16::from_le_bytes([bytes[8], bytes[9]]))
}

/// Accepts every rank, then reduces each sequence number's contributions once all are in.
fn root(listener: TcpListener) {
    let (sender, receiver) = mpsc::channel();
    {
        let sender = sender.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let sender = sender.clone();
                thread::spawn(move || {
                    let mut hello = [0u8; 8];
                    if stream.read_exact(&mut hello).is_err() {
                        return;
                    }
                    let rank = u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]) as usize;
                    let world = u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]) as usize;
                    let Ok(reply) = stream.try_clone() else { return };
                    if sender.send(ToRoot::Joined { rank, world, stream: reply }).is_err() {
                        return;
                    }
                    loop {
                        match read_contribution(&mut stream) {
                            Some(message) => {
                                if sender.send(ToRoot::Values { rank, message }).is_err() {
                                    return;
                                }
                            }
                            None => {
                                let _ = sender.send(ToRoot::Lost { rank });
                                return;
                            }
                        }
                    }
                });
            }
        });
    }
    drop(sender);
    let mut peers: HashMap<usize, TcpStream> = HashMap::new();
    let mut world = usize::MAX;
    let mut pending: HashMap<u64, Vec<(usize, Contribution)>> = HashMap::new();
    let mut ready = false;
    let mut left = Vec::new();
    while let Ok(event) = receiver.recv() {
        match event {
            ToRoot::Joined { rank, world: size, stream } => {
                world = size;
                peers.insert(rank, stream);
                if peers.len() == world {
                    ready = true;
                    for stream in peers.values_mut() {
                        let _ = stream.write_all(&[READY]);
                    }
                }
            }
            ToRoot::Values { rank, message } if message.sequence == GOODBYE => {
                left.push(rank);
                peers.remove(&rank);
                if peers.is_empty() {
                    return;
                }
            }
            ToRoot::Values { rank, message } => {
                let sequence = message.sequence;
                let entries = pending.entry(sequence).or_default();
                entries.push((rank, message));
                if entries.len() == world {
                    let entries = pending.remove(&sequence).unwrap_or_default();
                    let result = reduce(&entries);
                    let mut frame = vec![RESULT];
                    frame.extend_from_slice(&(result.len() as u64).to_le_bytes());
                    frame.extend_from_slice(&result);
                    for stream in peers.values_mut() {
                        let _ = stream.write_all(&frame);
                    }
                }
            }
            ToRoot::Lost { rank } if left.contains(&rank) => {}
            ToRoot::Lost { rank } => {
                peers.remove(&rank);
                if ready || !peers.is_empty() {
                    let mut frame = vec![PEER_LOST];
                    frame.extend_from_slice(&(rank as u32).to_le_bytes());
                    for stream in peers.values_mut() {
                        let _ = stream.write_all(&frame);
                    }
                }
                if peers.is_empty() {
                    return;
                }
            }
        }
    }
}

fn read_contribution(stream: &mut TcpStream) -> Option<Contribution> {
    let mut header = [0u8; 24];
    stream.read_exact(&mut header).ok()?;
    let sequence = u64::from_le_bytes(header[0..8].try_into().ok()?);
    let datatype = u32::from_le_bytes(header[8..12].try_into().ok()?);
    let op = u32::from_le_bytes(header[12..16].try_into().ok()?);
    let len = u64::from_le_bytes(header[16..24].try_into().ok()?) as usize;
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes).ok()?;
    Some(Contribution {
        sequence,
        datatype,
        op,
        bytes,
    })
}

/// Element sizes of the supported `ncclDataType_t`s.
fn element_size(datatype: u32) -> Option<usize> {
    match datatype {
        2 | 3 | 7 => Some(4), // int32, uint32, float32
        4 | 5 | 8 => Some(8), // int64, uint64, float64
        _ => None,
    }
}

/// Reduces every rank's bytes, element by element, in rank order.
fn reduce(entries: &[(usize, Contribution)]) -> Vec<u8> {
    let mut sorted: Vec<&(usize, Contribution)> = entries.iter().collect();
    sorted.sort_by_key(|(rank, _)| *rank);
    let Some((_, first)) = sorted.first() else {
        return Vec::new();
    };
    let (datatype, op) = (first.datatype, first.op);
    let size = element_size(datatype).unwrap_or(1);
    let mut out = first.bytes.clone();
    for (_, other) in &sorted[1..] {
        for (held, next) in out.chunks_mut(size).zip(other.bytes.chunks(size)) {
            combine(held, next, datatype, op);
        }
    }
    out
}

fn combine(held: &mut [u8], next: &[u8], datatype: u32, op: u32) {
    macro_rules! apply {
        ($t:ty, $n:expr) => {{
            let (Ok(a), Ok(b)) = (<[u8; $n]>::try_from(&*held), <[u8; $n]>::try_from(next)) else {
                return;
            };
            let (a, b) = (<$t>::from_le_bytes(a), <$t>::from_le_bytes(b));
            let value: $t = match op {
                0 => a + b,
                1 => a * b,
                2 => if a >= b { a } else { b },
                _ => if a <= b { a } else { b },
            };
            held.copy_from_slice(&value.to_le_bytes());
        }};
    }
    match datatype {
        2 => apply!(i32, 4),
        3 => apply!(u32, 4),
        7 => apply!(f32, 4),
        4 => apply!(i64, 8),
        5 => apply!(u64, 8),
        8 => apply!(f64, 8),
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Communicators.

/// An all-reduce waiting for the root's result.
struct Pending {
    recv: CUdeviceptr,
    len: usize,
    stream: CUstream,
}

// SAFETY: the stream handle is an opaque number for the fake driver.
unsafe impl Send for Pending {}

struct CommState {
    status: ncclResult_t,
    pending: VecDeque<Pending>,
    closed: bool,
}

struct Comm {
    rank: usize,
    world: usize,
    device: c_int,
    state: Arc<Mutex<CommState>>,
    writer: Mutex<Option<TcpStream>>,
    sequence: Mutex<u64>,
}

/// The communicator behind a handle the caller holds.
///
/// # Safety
/// `comm` is null or a handle from `ncclCommInitRank*` not yet aborted or destroyed.
unsafe fn comm_ref<'a>(comm: *mut c_void) -> Option<&'a Comm> {
    // SAFETY: the caller's contract.
    unsafe { comm.cast::<Comm>().as_ref() }
}

/// # Safety
/// `comm` is valid for writes; `config` is null or points to an `ncclConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *const c_void,
) -> ncclResult_t {
    count("ncclCommInitRankConfig");
    let blocking = if config.is_null() {
        true
    } else {
        // SAFETY: the caller's contract: size_t size, unsigned magic, unsigned version,
        // int blocking, ...
        let (magic, blocking) = unsafe {
            (
                config.cast::<u8>().add(8).cast::<c_uint>().read_unaligned(),
                config.cast::<u8>().add(16).cast::<c_int>().read_unaligned(),
            )
        };
        if magic != CONFIG_MAGIC {
            return fail(NCCL_INVALID_ARGUMENT, "config: bad magic".to_owned());
        }
        blocking != 0
    };
    // SAFETY: the caller's contract, passed on.
    unsafe { init(comm, nranks, id, rank, blocking) }
}

/// # Safety
/// `comm` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    count("ncclCommInitRank");
    // SAFETY: the caller's contract, passed on.
    unsafe { init(comm, nranks, id, rank, true) }
}

/// # Safety
/// `comm` is valid for writes.
unsafe fn init(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    blocking: bool,
) -> ncclResult_t {
    if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("rank {rank} of {nranks}: invalid"),
        );
    }
    let Some(port) = port_of(&id) else {
        return fail(NCCL_INVALID_ARGUMENT, "not a unique id of this NCCL".to_owned());
    };
    if driver().is_none() {
        return fail(
            NCCL_UNHANDLED_CUDA_ERROR,
            "the fake CUDA driver is not loaded".to_owned(),
        );
    }
    let state = Arc::new(Mutex::new(CommState {
        status: NCCL_IN_PROGRESS,
        pending: VecDeque::new(),
        closed: false,
    }));
    let handle = Box::new(Comm {
        rank: rank as usize,
        world: nranks as usize,
        device: 0,
        state: Arc::clone(&state),
        writer: Mutex::new(None),
        sequence: Mutex::new(0),
    });
    let raw = Box::into_raw(handle);
    *lock(&LIVE_COMMS) += 1;
    // SAFETY: the caller's contract; non-null.
    unsafe { comm.write(raw.cast()) };
    // SAFETY: just created; freed only by abort/destroy, which the caller cannot call before
    // this returns.
    let this = unsafe { &*raw };
    let stream = match TcpStream::connect(("127.0.0.1", port)) {
        Ok(stream) => stream,
        Err(error) => {
            lock(&state).status = NCCL_SYSTEM_ERROR;
            return fail(NCCL_SYSTEM_ERROR, format!("bootstrap: connect: {error}"));
        }
    };
    let mut hello = Vec::with_capacity(8);
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(nranks as u32).to_le_bytes());
    let (Ok(mut reader), Ok(mut writer)) = (stream.try_clone(), stream.try_clone()) else {
        lock(&state).status = NCCL_SYSTEM_ERROR;
        return fail(NCCL_SYSTEM_ERROR, "bootstrap: socket".to_owned());
    };
    if writer.write_all(&hello).is_err() {
        lock(&state).status = NCCL_SYSTEM_ERROR;
        return fail(NCCL_SYSTEM_ERROR, "bootstrap: send".to_owned());
    }
    *lock(&this.writer) = Some(writer);
    let (joined_sender, joined) = mpsc::channel();
    {
        let state = Arc::clone(&state);
        thread::spawn(move || listen(&mut reader, &state, joined_sender));
    }
    if !blocking {
        return NCCL_IN_PROGRESS;
    }
    // Blocking: wait until every rank joined (forever, as the real one does).
    let _ = joined.recv();
    let status = lock(&state).status;
    status
}

/// A rank's side of the root connection: readiness, results, lost peers.
fn listen(stream: &mut TcpStream, state: &Mutex<CommState>, joined: mpsc::Sender<()>) {
    let Some(driver) = driver() else { return };
    loop {
        let mut tag = [0u8; 1];
        if stream.read_exact(&mut tag).is_err() {
            let mut state = lock(state);
            if !state.closed && state.status != NCCL_REMOTE_ERROR {
                state.status = NCCL_REMOTE_ERROR;
            }
            let _ = joined.send(());
            return;
        }
        match tag[0] {
            READY => {
                lock(state).status = NCCL_SUCCESS;
                let _ = joined.send(());
            }
            RESULT => {
                let mut len = [0u8; 8];
                if stream.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
                if stream.read_exact(&mut bytes).is_err() {
                    continue;
                }
                let mut state = lock(state);
                if let Some(done) = state.pending.pop_front() {
                    let len = done.len.min(bytes.len());
                    // SAFETY: `bytes` holds `len` bytes; the fake driver checks the range.
                    unsafe { (driver.write)(done.recv, bytes.as_ptr().cast(), len) };
                    (driver.release)(done.stream);
                }
            }
            PEER_LOST => {
                let mut rank = [0u8; 4];
                let _ = stream.read_exact(&mut rank);
                let mut state = lock(state);
                if !state.closed {
                    state.status = NCCL_REMOTE_ERROR;
                }
                *lock(&LAST_ERROR) = CString::new(format!(
                    "rank {} exited or there was a network error",
                    u32::from_le_bytes(rank)
                ))
                .ok();
                let _ = joined.send(());
            }
            _ => {}
        }
    }
}

/// # Safety
/// `comm` is a live handle; `result` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: *mut c_void,
    result: *mut ncclResult_t,
) -> ncclResult_t {
    count("ncclCommGetAsyncError");
    // SAFETY: the caller's contract.
    let Some(comm) = (unsafe { comm_ref(comm) }) else {
        return NCCL_INVALID_ARGUMENT;
    };
    if result.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: the caller's contract; non-null.
    unsafe { result.write(lock(&comm.state).status) };
    NCCL_SUCCESS
}

/// # Safety
/// `comm` is a live handle; the buffers are device memory of the fake driver.
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count_: usize,
    datatype: c_uint,
    op: c_uint,
    comm: *mut c_void,
    stream: CUstream,
) -> ncclResult_t {
    count("ncclAllReduce");
    // SAFETY: the caller's contract.
    let Some(comm) = (unsafe { comm_ref(comm) }) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let Some(driver) = driver() else {
        return NCCL_UNHANDLED_CUDA_ERROR;
    };
    let Some(size) = element_size(datatype) else {
        return fail(NCCL_INVALID_ARGUMENT, format!("datatype {datatype}: not supported"));
    };
    if op > 3 {
        return fail(NCCL_INVALID_ARGUMENT, format!("op {op}: not supported"));
    }
    let status = lock(&comm.state).status;
    if status != NCCL_SUCCESS {
        return fail(
            NCCL_INVALID_USAGE,
            format!("communicator not ready (status {status})"),
        );
    }
    let len = count_ * size;
    let mut bytes = vec![0u8; len];
    // SAFETY: `bytes` has room for `len`; the fake driver checks the device range.
    if unsafe { (driver.read)(sendbuff as CUdeviceptr, bytes.as_mut_ptr().cast(), len) } != 0 {
        return fail(NCCL_UNHANDLED_CUDA_ERROR, "send buffer: invalid".to_owned());
    }
    if (driver.hold)(stream) != 0 {
        return fail(NCCL_UNHANDLED_CUDA_ERROR, "stream: invalid".to_owned());
    }
    let sequence = {
        let mut next = lock(&comm.sequence);
        *next += 1;
        *next
    };
    lock(&comm.state).pending.push_back(Pending {
        recv: recvbuff as CUdeviceptr,
        len,
        stream,
    });
    let mut frame = Vec::with_capacity(24 + len);
    frame.extend_from_slice(&sequence.to_le_bytes());
    frame.extend_from_slice(&datatype.to_le_bytes());
    frame.extend_from_slice(&op.to_le_bytes());
    frame.extend_from_slice(&(len as u64).to_le_bytes());
    frame.extend_from_slice(&bytes);
    if let Some(writer) = lock(&comm.writer).as_mut() {
        if writer.write_all(&frame).is_err() {
            lock(&comm.state).status = NCCL_REMOTE_ERROR;
        }
    }
    NCCL_SUCCESS
}

/// Closes the connection (saying goodbye first when `graceful`: the others are not told of a
/// lost peer), releases what the communicator holds and frees it.
///
/// # Safety
/// `comm` is a live handle, not used again.
unsafe fn close(comm: *mut c_void, graceful: bool) -> ncclResult_t {
    if comm.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: the caller's contract: a handle from `init`, given back once.
    let comm = unsafe { Box::from_raw(comm.cast::<Comm>()) };
    {
        let mut state = lock(&comm.state);
        state.closed = true;
        if let Some(driver) = driver() {
            for pending in state.pending.drain(..) {
                (driver.release)(pending.stream);
            }
        }
    }
    if let Some(mut writer) = lock(&comm.writer).take() {
        if graceful {
            let mut goodbye = Vec::with_capacity(24);
            goodbye.extend_from_slice(&GOODBYE.to_le_bytes());
            goodbye.extend_from_slice(&[0u8; 16]);
            let _ = writer.write_all(&goodbye);
        }
        let _ = writer.shutdown(Shutdown::Both);
    }
    let mut live = lock(&LIVE_COMMS);
    *live = live.saturating_sub(1);
    NCCL_SUCCESS
}

/// # Safety
/// `comm` is a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> ncclResult_t {
    count("ncclCommAbort");
    // SAFETY: the caller's contract, passed on.
    unsafe { close(comm, false) }
}

/// # Safety
/// `comm` is a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> ncclResult_t {
    count("ncclCommDestroy");
    // SAFETY: the caller's contract, passed on.
    unsafe { close(comm, true) }
}

/// # Safety
/// `comm` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: *mut c_void) -> ncclResult_t {
    count("ncclCommFinalize");
    // SAFETY: the caller's contract.
    match unsafe { comm_ref(comm) } {
        Some(_) => NCCL_SUCCESS,
        None => NCCL_INVALID_ARGUMENT,
    }
}

/// # Safety
/// `comm` is a live handle; `out` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *const c_void, out: *mut c_int) -> ncclResult_t {
    count("ncclCommCount");
    // SAFETY: the caller's contract.
    match (unsafe { comm_ref(comm.cast_mut()) }, out.is_null()) {
        (Some(comm), false) => {
            // SAFETY: the caller's contract; non-null.
            unsafe { out.write(comm.world as c_int) };
            NCCL_SUCCESS
        }
        _ => NCCL_INVALID_ARGUMENT,
    }
}

/// # Safety
/// `comm` is a live handle; `out` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *const c_void, out: *mut c_int) -> ncclResult_t {
    count("ncclCommUserRank");
    // SAFETY: the caller's contract.
    match (unsafe { comm_ref(comm.cast_mut()) }, out.is_null()) {
        (Some(comm), false) => {
            // SAFETY: the caller's contract; non-null.
            unsafe { out.write(comm.rank as c_int) };
            NCCL_SUCCESS
        }
        _ => NCCL_INVALID_ARGUMENT,
    }
}

/// # Safety
/// `comm` is a live handle; `out` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *const c_void, out: *mut c_int) -> ncclResult_t {
    count("ncclCommCuDevice");
    // SAFETY: the caller's contract.
    match (unsafe { comm_ref(comm.cast_mut()) }, out.is_null()) {
        (Some(comm), false) => {
            // SAFETY: the caller's contract; non-null.
            unsafe { out.write(comm.device) };
            NCCL_SUCCESS
        }
        _ => NCCL_INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    count("ncclGroupStart");
    NCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    count("ncclGroupEnd");
    NCCL_SUCCESS
}
