//! ONNX Runtime (the PyPI wheel's `libonnxruntime.so`, through the `ort` crate's `load-dynamic`
//! and `ORT_DYLIB_PATH`) with its CPU arena capped (`CreateArenaCfgV2`'s `max_mem`, registered
//! on the environment): "BFCArena::AllocateRawInternal ... Available memory of A is smaller than
//! requested bytes of R" recognised with no rule, its figures read, the arena shrunk after each
//! failure (`Release::ort`), through the attribute, `Chunked` and the `Tuner`. ONNX Runtime has
//! no panicking API. Each scenario runs in a child process; the size found runs again in a fresh
//! one and is not above the largest that fits, found by bisection in fresh processes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::ptr;
use std::sync::{Arc, Mutex};

use batch_size_runtime::oom::{self, OomKind};
use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report, Attempt, Chunked, Tuner};
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;
use ort::value::Tensor;
use ort::AsPointer;
use real_allocators::{
    check_failures, check_tuner_failures, child, compare_with_the_largest, fits_in_a_fresh_process,
    largest_that_fits, one_size_requested, print_search, reserved_unallocated,
};

/// The arena's cap: some hundreds of samples (128 KiB each in the model's two intermediates).
const CAP: usize = 64 << 20;
const STARTING: usize = 4096;
const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/mlp.onnx");
/// The same model with its weights an input of fixed shape, fed by the caller.
const FIXED_WEIGHTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/mlp_fixed_weights.onnx");
/// Set by the parent for the shared-arena scenario: the size of the work that runs before the
/// search, leaving the environment's arena holding its regions.
const EARLIER: &str = "REAL_ALLOCATORS_EARLIER";

/// A session of `models/mlp.onnx` on an environment whose CPU arena is capped at `CAP`.
fn session() -> Arc<Mutex<Session>> {
    session_of(MODEL)
}

/// A session of `model` that uses the environment's shared arena (`CreateAndRegisterAllocator`,
/// `session.use_env_allocators`), capped at `CAP`.
fn session_of(model: &str) -> Arc<Mutex<Session>> {
    // Regions of the size asked for (`kSameAsRequested`), not the next power of two: with the
    // default, a warm arena runs sizes that a fresh one cannot (its regions' history decides).
    shared_arena_session(model, CAP, Some(1))
}

/// A session of `model` on the environment's shared CPU arena, capped at `cap` bytes, with
/// `arena_extend_strategy` set where given (ONNX Runtime's default otherwise: the next power
/// of two).
fn shared_arena_session(model: &str, cap: usize, extend: Option<usize>) -> Arc<Mutex<Session>> {
    let environment = ort::init().with_name("real-allocators").build().unwrap();
    let api = ort::api();
    let mut keys = vec![c"max_mem".as_ptr()];
    let mut values = vec![cap];
    if let Some(extend) = extend {
        keys.push(c"arena_extend_strategy".as_ptr());
        values.push(extend);
    }
    let mut config = ptr::null_mut();
    // SAFETY: as many keys as values, valid for the call; `config` receives an arena config.
    let status = unsafe {
        (api.CreateArenaCfgV2)(keys.as_ptr(), values.as_ptr(), keys.len(), &mut config)
    };
    assert!(status.0.is_null());
    let info = MemoryInfo::new(
        AllocationDevice::CPU,
        0,
        AllocatorType::Arena,
        MemoryType::Default,
    )
    .unwrap();
    // SAFETY: the environment, memory info and config are live; ONNX Runtime copies the config.
    let status = unsafe {
        (api.CreateAndRegisterAllocator)(environment.ptr().cast_mut(), info.ptr(), config)
    };
    assert!(status.0.is_null());
    // SAFETY: the config made above, no longer used.
    unsafe { (api.ReleaseArenaCfg)(config) };
    let session = Session::builder(&environment)
        .unwrap()
        .with_intra_threads(1)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_config_entry("session.use_env_allocators", "1")
        .unwrap_or_else(|e| panic!("{e}"))
        .commit_from_file(model)
        .unwrap();
    std::mem::forget(environment); // one per process, for its whole life
    Arc::new(Mutex::new(session))
}

/// The model on `batch_size` samples of ones: the sum of its outputs.
fn infer(session: &Mutex<Session>, batch_size: usize) -> ort::Result<f32> {
    let x = Tensor::from_array(([batch_size, 64], vec![1.0f32; batch_size * 64]))?;
    let mut session = session.lock().unwrap();
    let outputs = session.run(ort::inputs!["x" => x])?;
    let (_, y) = outputs["y"].try_extract_tensor::<f32>()?;
    Ok(y.iter().sum())
}

/// The fixed-weights model on `batch_size` samples of ones, its weights fed as an input.
fn infer_fixed_weights(session: &Mutex<Session>, batch_size: usize) -> ort::Result<f32> {
    let x = Tensor::from_array(([batch_size, 64], vec![1.0f32; batch_size * 64]))?;
    let w = Tensor::from_array(([64usize, 16384], vec![0.001f32; 64 * 16384]))?;
    let mut session = session.lock().unwrap();
    let outputs = session.run(ort::inputs!["x" => x, "W" => w])?;
    let (_, y) = outputs["y"].try_extract_tensor::<f32>()?;
    Ok(y.iter().sum())
}

fn release(session: &Arc<Mutex<Session>>) -> Release {
    if std::env::var("REAL_ALLOCATORS_FIGURES").as_deref() == Ok("none") {
        Release::none()
    } else {
        Release::ort(session)
    }
}

/// The arena's counters after each release: what it holds back to at most what it held before
/// the attempt, and the failure read with its figures.
fn memory_back(failed: &Attempt) {
    let start = &failed.memory_at_start.as_ref().unwrap().devices[0];
    let end = failed.memory_at_end.as_ref().unwrap();
    let after = &failed.memory_after_release.as_ref().unwrap().devices[0];
    assert_eq!(after.device, "onnxruntime:cpu");
    assert_eq!(after.total, CAP as u64, "the arena's Limit");
    assert!(
        after.pool_reserved.unwrap() <= start.pool_reserved.unwrap().max(8 << 20),
        "reserved before {start:?}, after the release {after:?}"
    );
    assert!(
        failed.figures.requested.is_some_and(|bytes| bytes > 0),
        "{failed:?}"
    );
    println!(
        "\nort.reserved_unallocated={:?}->{:?}",
        reserved_unallocated(end),
        reserved_unallocated(failed.memory_after_release.as_ref().unwrap())
    );
}

#[find_executable_batch_size(starting = STARTING, release = release(session), policy = real_allocators::policy())]
fn train_result(batch_size: usize, session: &Arc<Mutex<Session>>) -> ort::Result<(usize, f32)> {
    Ok((batch_size, infer(session, batch_size)?))
}

#[find_executable_batch_size(starting = STARTING, release = release(session), policy = real_allocators::policy())]
fn train_fixed_weights(batch_size: usize, session: &Arc<Mutex<Session>>) -> ort::Result<usize> {
    infer_fixed_weights(session, batch_size).map(|_| batch_size)
}

fn scenario(name: &str) -> Arc<Mutex<Session>> {
    real_allocators::expect_child(name);
    session()
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_result() {
    let session = scenario("attribute_result");
    let (found, _) = train_result(&session).unwrap();
    let report = last_report().unwrap();
    if std::env::var("REAL_ALLOCATORS_FIGURES").is_err() {
        check_failures(&report, memory_back);
    }
    print_search("result", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn chunked() {
    let session = scenario("chunked");
    let outputs = Chunked::new(8192)
        .with_starting(STARTING)
        .with_release(release(&session))
        .run(|range| -> anyhow::Result<Vec<f32>> {
            let sum = infer(&session, range.len())?;
            Ok(vec![sum / range.len() as f32; range.len()])
        })
        .unwrap();
    assert_eq!(outputs.len(), 8192);
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    let largest = report.largest_success().unwrap();
    print_search("chunked", largest, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn tuner() {
    let session = scenario("tuner");
    let tuned = Tuner::new()
        .with_max(STARTING)
        .with_release(release(&session))
        .run(|batch_size| anyhow::Ok(infer(&session, batch_size)?))
        .unwrap();
    check_tuner_failures(tuned.report(), memory_back);
    print_search("tuner", tuned.batch_size(), tuned.report());
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size() {
    let session = scenario("one_size");
    let size = one_size_requested();
    infer(&session, size).unwrap();
}

/// One size of the fixed-weights model, in a fresh process.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size_fixed_weights() {
    real_allocators::expect_child("one_size_fixed_weights");
    let session = session_of(FIXED_WEIGHTS);
    infer_fixed_weights(&session, one_size_requested()).unwrap();
}

/// Earlier work leaves the environment's shared arena holding its regions (sized for that
/// work), then the attribute searches from `STARTING` on a model with an input of fixed shape.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_after_earlier_work() {
    real_allocators::expect_child("attribute_after_earlier_work");
    let session = session_of(FIXED_WEIGHTS);
    let earlier: usize = std::env::var(EARLIER).unwrap().parse().unwrap();
    infer_fixed_weights(&session, earlier).unwrap();
    let found = train_fixed_weights(&session).unwrap();
    let report = last_report().unwrap();
    if std::env::var("REAL_ALLOCATORS_FIGURES").is_err() {
        check_failures(&report, memory_back);
    }
    print_search("after_earlier_work", found, &report);
}

/// The capped arena's message, as ONNX Runtime writes it, recognised by the table.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn capped_arena_message() {
    let session = scenario("capped_arena_message");
    let error = infer(&session, STARTING).unwrap_err();
    let found = oom::classify_error(&error).unwrap();
    assert!(
        matches!(found.kind, OomKind::Pattern(pattern) if pattern.text == "is smaller than requested bytes of"),
        "{found:?}"
    );
    let figures = oom::figures(&error.to_string());
    assert!(
        figures.requested.is_some() && figures.free.is_some(),
        "{figures:?}"
    );
    println!("\nmessage={found:?}");
}

/// Every scenario, its size against the largest that fits, beside halving's (no figures).
#[test]
fn onnx_runtime_capped_arena() {
    if !real_allocators::available(
        "onnx_runtime_capped_arena",
        std::env::var_os("ORT_DYLIB_PATH").is_some(),
        "ORT_DYLIB_PATH is not set (pip install onnxruntime)",
    ) {
        return;
    }
    child("capped_arena_message", &[]);
    let fits = fits_in_a_fresh_process;
    let largest = largest_that_fits(STARTING, fits);
    println!("ort: the largest size that fits in a fresh process: {largest}");
    assert!(largest > 8 && largest < STARTING, "{largest}");
    let scenarios = [
        ("attribute_result", "result"),
        ("chunked", "chunked"),
        ("tuner", "tuner"),
    ];
    compare_with_the_largest(
        "ort",
        &scenarios,
        largest,
        fits,
        false,
        &[
            ("attribute_result", 0.90),
            ("chunked", 0.90),
            ("tuner", 0.90),
        ],
    );
}

/// The environment's shared arena after earlier work, on a model with an input of fixed shape:
/// the release shrinks it (zeros of the fixed input's shape), and the search lands near the
/// largest size that fits a fresh process, beside halving's.
#[test]
fn onnx_runtime_shared_arena_after_earlier_work() {
    if !real_allocators::available(
        "onnx_runtime_shared_arena_after_earlier_work",
        std::env::var_os("ORT_DYLIB_PATH").is_some(),
        "ORT_DYLIB_PATH is not set (pip install onnxruntime)",
    ) {
        return;
    }
    let fits = |size: usize| {
        real_allocators::child_status(
            "one_size_fixed_weights",
            &[("REAL_ALLOCATORS_SIZE", size.to_string())],
        )
        .1
    };
    let largest = largest_that_fits(STARTING, fits);
    println!("ort fixed weights: the largest size that fits in a fresh process: {largest}");
    assert!(largest > 8 && largest < STARTING, "{largest}");
    // Six sevenths of the limit: the arena's regions are then too small for the limit and too
    // large to leave room beside them.
    let earlier = largest * 6 / 7;
    println!("ort fixed weights: earlier work at {earlier}");
    // The children inherit it: the scenario runs that size before its search.
    std::env::set_var(EARLIER, earlier.to_string());
    compare_with_the_largest(
        "ort",
        &[("attribute_after_earlier_work", "after_earlier_work")],
        largest,
        fits,
        false,
        &[("attribute_after_earlier_work", 0.90)],
    );
}

/// The shared arena as a user sets it up: 256 MiB, the model's weights its initializers.
const USER_ARENA_CAP: usize = 256 << 20;

/// Set by the parent for the 256 MiB arena's children: `same` extends the arena by the size
/// asked for (`kSameAsRequested`), anything else keeps ONNX Runtime's default (the next power
/// of two).
const EXTEND: &str = "REAL_ALLOCATORS_EXTEND";

/// A session of `models/mlp.onnx` on the 256 MiB shared arena, extended as [`EXTEND`] says.
fn user_arena_session() -> Arc<Mutex<Session>> {
    let extend = (std::env::var(EXTEND).as_deref() == Ok("same")).then_some(1);
    shared_arena_session(MODEL, USER_ARENA_CAP, extend)
}

#[find_executable_batch_size(starting = 4 * STARTING, release = release(session), policy = real_allocators::policy())]
fn infer_user_arena(batch_size: usize, session: &Arc<Mutex<Session>>) -> ort::Result<usize> {
    infer(session, batch_size).map(|_| batch_size)
}

/// One size on the 256 MiB shared arena, in a fresh process.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size_user_arena() {
    real_allocators::expect_child("one_size_user_arena");
    infer(&user_arena_session(), one_size_requested()).unwrap();
}

/// Earlier work (`REAL_ALLOCATORS_EARLIER` samples) on the 256 MiB shared arena, then the
/// attribute from four times `STARTING` with `Release::ort`.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn user_arena_after_earlier_work() {
    real_allocators::expect_child("user_arena_after_earlier_work");
    let session = user_arena_session();
    let earlier: usize = std::env::var(EARLIER).unwrap().parse().unwrap();
    infer(&session, earlier).unwrap();
    let found = infer_user_arena(&session).unwrap();
    let report = last_report().unwrap();
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{attempt} | {:?} | {:?} -> {:?} -> {:?}",
                attempt.figures,
                attempt.memory_at_start,
                attempt.memory_at_end,
                attempt.memory_after_release
            );
        }
    }
    print_search("user_arena", found, &report);
}

/// ONNX Runtime's shared arena as a user sets it up (256 MiB, the weights initializers), with
/// the default extension and with regions of the size asked for, after earlier work at six
/// sevenths of the largest size that fits a fresh process: the attribute with `Release::ort`
/// lands at least 0.90 of it, beside halving's and the same search without figures
/// (`Release::none()`), in the same test.
#[test]
fn onnx_runtime_user_shared_arena_after_earlier_work() {
    if !real_allocators::available(
        "onnx_runtime_user_shared_arena_after_earlier_work",
        std::env::var_os("ORT_DYLIB_PATH").is_some(),
        "ORT_DYLIB_PATH is not set (pip install onnxruntime)",
    ) {
        return;
    }
    for extend in ["default", "same"] {
        let fits = |size: usize| {
            real_allocators::child_status(
                "one_size_user_arena",
                &[
                    ("REAL_ALLOCATORS_SIZE", size.to_string()),
                    (EXTEND, extend.to_owned()),
                ],
            )
            .1
        };
        let largest = largest_that_fits(4 * STARTING, fits);
        assert!(largest > 8 && largest < 4 * STARTING, "{largest}");
        let earlier = largest * 6 / 7;
        let run = |extra: &[(&str, String)]| {
            let mut env = vec![
                (EARLIER, earlier.to_string()),
                (EXTEND, extend.to_owned()),
            ];
            env.extend_from_slice(extra);
            let lines = child("user_arena_after_earlier_work", &env);
            let found: usize = real_allocators::value(&lines, "user_arena.found")
                .parse()
                .unwrap();
            let attempts = real_allocators::value(&lines, "user_arena.attempts");
            (found, attempts)
        };
        let (found, attempts) = run(&[]);
        let (halving, halving_attempts) =
            run(&[("REAL_ALLOCATORS_POLICY", "halving".to_owned())]);
        let (without, without_attempts) =
            run(&[("REAL_ALLOCATORS_FIGURES", "none".to_owned())]);
        let share = |size: usize| size as f64 / largest as f64;
        println!(
            "ort shared arena (256 MiB, {extend} extension), earlier work at {earlier}: Release::ort {found} of {largest} ({:.3}) in {attempts} attempts; halving {halving} ({:.3}) in {halving_attempts}; without figures {without} ({:.3}) in {without_attempts}",
            share(found),
            share(halving),
            share(without)
        );
        real_allocators::assert_fits("user_arena_after_earlier_work", found, largest, fits);
        assert!(
            share(found) >= 0.90,
            "{extend}: {found} of {largest} ({:.3})",
            share(found)
        );
    }
}
