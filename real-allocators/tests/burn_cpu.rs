//! burn 0.22.1's wgpu backend on Mesa's software Vulkan driver (llvmpipe) under an address-space
//! limit. The real out-of-memory panics on cubecl's device thread ("wgpu error: Out of Memory"),
//! which swallows it; the caller gets "couldn't find resource for that handle" (`try_into_data`)
//! or a panic with it (`into_data`). The attempt counts it as out-of-memory with no rule, through
//! the attribute (both forms), `Chunked` and the `Tuner`, with burn's own figures
//! (`Release::burn`). Each scenario runs in a child process; the size found runs again in a
//! fresh one and is not above the largest that fits, found by bisection in fresh processes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report, Attempt, Chunked, Tuner};
use burn::tensor::{Device, Tensor};
use real_allocators::{
    check_failures, check_tuner_failures, compare_with_the_largest, fits_in_a_fresh_process,
    largest_that_fits, leave_room, one_size_requested, print_search, reserved_unallocated,
};

/// f32 values a sample: 256 KiB a tensor, four tensors live in a step.
const WIDTH: usize = 65536;
/// Address space left once the device is up.
const ROOM: u64 = 128 << 20;
/// Below llvmpipe's 128 MiB buffer limit for one tensor (448 × 256 KiB). From 500, halving's
/// 250 ran in the search's process and not in a fresh one (whose limit was 248): a size within
/// a sample or two of the limit is decided by the process's history, not by the search.
const STARTING: usize = 448;

fn device() -> Device {
    real_allocators::burn_device()
}

/// One step at `batch_size`, its result read back (`try_into_data`: errors returned).
fn step(device: &Device, batch_size: usize) -> Result<f32, burn::tensor::ExecutionError> {
    let x = Tensor::<2>::ones([batch_size, WIDTH], device);
    let doubled = x.clone().mul_scalar(2.0);
    let summed = doubled.clone().add(x);
    let product = summed.mul(doubled);
    let data = product.sum().try_into_data()?;
    Ok(data
        .try_to_vec::<f32>()
        .map_or(f32::NAN, |values| values[0]))
}

/// The same step read with `into_data`, which panics on failure.
fn step_panicking(device: &Device, batch_size: usize) -> f32 {
    let x = Tensor::<2>::ones([batch_size, WIDTH], device);
    let doubled = x.clone().mul_scalar(2.0);
    let summed = doubled.clone().add(x);
    let product = summed.mul(doubled);
    product.sum().into_data().try_to_vec::<f32>().unwrap()[0]
}

fn release(device: &Device) -> Release {
    if std::env::var("REAL_ALLOCATORS_FIGURES").as_deref() == Ok("none") {
        Release::none()
    } else {
        Release::burn(device)
    }
}

/// burn's counters after each release: in use back to what it was before the attempt.
fn memory_back(failed: &Attempt) {
    let start = &failed.memory_at_start.as_ref().unwrap().devices[0];
    let end = failed.memory_at_end.as_ref().unwrap();
    let after = &failed.memory_after_release.as_ref().unwrap().devices[0];
    assert!(after.device.starts_with("burn"), "{after:?}");
    assert!(
        after.pool_used.unwrap() <= start.pool_used.unwrap(),
        "in use before {start:?}, after the release {after:?}"
    );
    // And the driver's memory with it (llvmpipe's is the process's): burn's counters alone said
    // "nothing in use" while the pages were still mapped, until the release synced the device.
    assert!(
        after.free + (16 << 20) >= start.free,
        "free before {start:?}, after the release {after:?}"
    );
    println!(
        "\nburn.reserved_unallocated={:?}->{:?}",
        reserved_unallocated(end),
        reserved_unallocated(failed.memory_after_release.as_ref().unwrap())
    );
}

#[find_executable_batch_size(starting = STARTING, release = release(device), policy = real_allocators::policy())]
fn train_result(
    batch_size: usize,
    device: &Device,
) -> Result<(usize, f32), burn::tensor::ExecutionError> {
    Ok((batch_size, step(device, batch_size)?))
}

#[find_executable_batch_size(starting = STARTING, release = release(device), policy = real_allocators::policy())]
fn train_panicking(batch_size: usize, device: &Device) -> (usize, f32) {
    (batch_size, step_panicking(device, batch_size))
}

fn scenario(name: &str) -> Device {
    real_allocators::expect_child(name);
    let device = device();
    step(&device, 4).unwrap(); // kernels compiled, pools started
    device.memory_cleanup();
    leave_room(ROOM);
    device
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_result() {
    let device = scenario("attribute_result");
    let (found, _) = train_result(&device).unwrap();
    let report = last_report().unwrap();
    if std::env::var("REAL_ALLOCATORS_FIGURES").is_err() {
        check_failures(&report, memory_back);
    }
    print_search("result", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_panicking() {
    let device = scenario("attribute_panicking");
    let (found, _) = train_panicking(&device);
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    print_search("panicking", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn chunked() {
    let device = scenario("chunked");
    let mut done = 0;
    let ran = Chunked::new(1024)
        .with_starting(STARTING)
        .with_release(release(&device))
        .for_each(|range| -> anyhow::Result<()> {
            step(&device, range.len())?;
            done += range.len();
            Ok(())
        });
    if let Err(error) = ran {
        for attempt in last_report().unwrap().attempts() {
            eprintln!(
                "{} {:?} {:?}",
                attempt.batch_size, attempt.outcome, attempt.memory_after_release
            );
        }
        panic!("{error}");
    }
    assert_eq!(done, 1024);
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    let largest = report.largest_success().unwrap();
    print_search("chunked", largest, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn tuner() {
    let device = scenario("tuner");
    let tuned = Tuner::new()
        .with_max(STARTING)
        .with_release(release(&device))
        .run(|batch_size| anyhow::Ok(step(&device, batch_size)?))
        .unwrap();
    check_tuner_failures(tuned.report(), memory_back);
    print_search("tuner", tuned.batch_size(), tuned.report());
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size() {
    let device = scenario("one_size");
    let size = one_size_requested();
    step(&device, size).unwrap();
}

/// After an out-of-memory (the step at `STARTING`) and the release, the largest size that runs,
/// scanning down from the size the parent asks in steps of 1 %: what a search can still find.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn after_a_failure() {
    let device = scenario("after_a_failure");
    let vm_size = || {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find(|line| line.starts_with("VmSize"))
            .map(str::to_owned)
    };
    let before = vm_size();
    assert!(step(&device, STARTING).is_err(), "{STARTING} ran");
    let release = Release::burn(&device);
    release.memory_backend().release().unwrap();
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        eprintln!("pools after the release: {:?}", device.memory_pool_report());
        eprintln!("address space: before {before:?}, after {:?}", vm_size());
    }
    let mut size = one_size_requested();
    while size > 1 && step(&device, size).is_err() {
        release.memory_backend().release().unwrap();
        size = size * 99 / 100;
    }
    println!("\nafter_a_failure.runs={size}");
}

/// Sizes that fit a fresh process fit again after an out-of-memory: with the default memory
/// configuration and with `ExclusivePages`, each against its own largest in a fresh process.
#[test]
fn burn_memory_back_after_a_failure() {
    if !real_allocators::available(
        "burn_memory_back_after_a_failure",
        std::path::Path::new(real_allocators::LLVMPIPE).exists(),
        "no llvmpipe (apt-get install mesa-vulkan-drivers)",
    ) {
        return;
    }
    for memory in ["adaptive", "exclusive"] {
        let with = |size: usize| {
            vec![
                (real_allocators::BURN_MEMORY, memory.to_owned()),
                ("REAL_ALLOCATORS_SIZE", size.to_string()),
            ]
        };
        let fits = |size: usize| real_allocators::child_status("one_size", &with(size)).1;
        let largest = largest_that_fits(STARTING, fits);
        let lines = real_allocators::child("after_a_failure", &with(largest));
        let runs: usize = real_allocators::value(&lines, "after_a_failure.runs")
            .parse()
            .unwrap();
        let share = runs as f64 / largest as f64;
        println!(
            "burn {memory}: largest in a fresh process {largest}; after an out-of-memory {runs} ({share:.3})"
        );
        assert!(
            fits(runs),
            "{memory}: {runs} does not run in a fresh process"
        );
        // Measured 0.903 (default) and 0.902 to 0.906 (exclusive pages), in 1 % steps: the bound
        // leaves a step's room for the variation of a fresh process's limit.
        assert!(
            share >= 0.88,
            "{memory}: after an out-of-memory {runs} of {largest} ({share:.3})"
        );
    }
}

/// Every scenario, its size against the largest that fits, beside halving's (no figures).
#[test]
fn burn_on_llvmpipe() {
    if !real_allocators::available(
        "burn_on_llvmpipe",
        std::path::Path::new(real_allocators::LLVMPIPE).exists(),
        "no llvmpipe (apt-get install mesa-vulkan-drivers)",
    ) {
        return;
    }
    let fits = fits_in_a_fresh_process;
    let largest = largest_that_fits(STARTING, fits);
    println!("burn: the largest size that fits in a fresh process: {largest}");
    assert!(largest > 8 && largest < STARTING, "{largest}");
    let scenarios = [
        ("attribute_result", "result"),
        ("attribute_panicking", "panicking"),
        ("chunked", "chunked"),
        ("tuner", "tuner"),
    ];
    compare_with_the_largest("burn", &scenarios, largest, fits, true, &[]);
}
