//! wgpu 30 on Mesa's software Vulkan driver (llvmpipe) under an address-space limit:
//! `vkAllocateMemory` fails, wgpu says `Error::OutOfMemory` (an error scope's `Result`) or
//! panics "wgpu error: Out of Memory" (the default handler), and the search recovers through
//! the attribute (both forms), `Chunked` and the `Tuner`, with wgpu's own figures
//! (`Release::wgpu`). Each scenario runs in a child process; the size found runs again in a
//! fresh one and is not above the largest that fits, found by bisection in fresh processes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report, Chunked, Tuner};
use real_allocators::{
    check_failures, check_tuner_failures, compare_with_the_largest, fits_in_a_fresh_process,
    largest_that_fits, leave_room, one_size_requested, print_search,
};

/// Bytes a sample holds on the device: one buffer each.
const SAMPLE: u64 = 1 << 20;
/// Address space left once the device is up: a few hundred samples.
const ROOM: u64 = 256 << 20;
const STARTING: usize = 1024;

/// llvmpipe's device, with a small block size (`MemoryHints::MemoryUsage`) so that memory
/// follows the batch closely; `None` where no Vulkan driver is installed.
fn device() -> Option<(wgpu::Device, wgpu::Queue)> {
    let mut descriptor = wgpu::InstanceDescriptor::new_without_display_handle();
    descriptor.backends = wgpu::Backends::VULKAN;
    let instance = wgpu::Instance::new(descriptor);
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        force_fallback_adapter: false,
        ..Default::default()
    }))
    .ok()?;
    let device = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        memory_hints: wgpu::MemoryHints::MemoryUsage,
        ..Default::default()
    }))
    .ok()?;
    Some(device)
}

/// A buffer per sample: with no error scope, wgpu's default handler panics on out-of-memory.
fn allocate(device: &wgpu::Device, batch_size: usize) -> Vec<wgpu::Buffer> {
    (0..batch_size)
        .map(|_| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("sample"),
                size: SAMPLE,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
        .collect()
}

/// Writes every buffer of a step (kept until the step ends).
fn write(queue: &wgpu::Queue, buffers: &[wgpu::Buffer]) -> usize {
    for buffer in buffers {
        queue.write_buffer(buffer, 0, &[1u8; 256]);
    }
    queue.submit([]);
    buffers.len()
}

/// One step at `batch_size`, panicking on out-of-memory.
fn step(device: &wgpu::Device, queue: &wgpu::Queue, batch_size: usize) -> usize {
    write(queue, &allocate(device, batch_size))
}

/// The step with an error scope: wgpu's `Error::OutOfMemory` returned (a buffer that failed
/// is invalid: nothing is written before the scope says all were made).
fn step_in_scope(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    batch_size: usize,
) -> Result<usize, wgpu::Error> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let buffers = allocate(device, batch_size);
    if let Some(error) = pollster::block_on(scope.pop()) {
        return Err(error);
    }
    Ok(write(queue, &buffers))
}

fn release(device: &wgpu::Device) -> Release {
    if std::env::var("REAL_ALLOCATORS_FIGURES").as_deref() == Ok("none") {
        Release::none()
    } else {
        Release::wgpu(device)
    }
}

/// wgpu's counters after each release: nothing allocated beyond what was before the attempt.
fn memory_back(failed: &batch_size_runtime::Attempt) {
    let start = &failed.memory_at_start.as_ref().unwrap().devices[0];
    let after = &failed.memory_after_release.as_ref().unwrap().devices[0];
    assert!(after.device.starts_with("wgpu"), "{after:?}");
    assert!(
        after.pool_used.unwrap() <= start.pool_used.unwrap(),
        "allocated before {start:?}, after the release {after:?}"
    );
    // And the driver's memory with it (llvmpipe's is the process's): burn's counters alone said
    // "nothing in use" while the pages were still mapped, until the release synced the device.
    assert!(
        after.free + (16 << 20) >= start.free,
        "free before {start:?}, after the release {after:?}"
    );
}

#[find_executable_batch_size(starting = STARTING, release = release(device), policy = real_allocators::policy())]
fn train_result(
    batch_size: usize,
    device: &wgpu::Device,
    queue: &wgpu::Queue,
) -> Result<usize, wgpu::Error> {
    step_in_scope(device, queue, batch_size)
}

#[find_executable_batch_size(starting = STARTING, release = release(device), policy = real_allocators::policy())]
fn train_panicking(batch_size: usize, device: &wgpu::Device, queue: &wgpu::Queue) -> usize {
    step(device, queue, batch_size) // the default handler panics on out-of-memory
}

/// Three steps, each with `step_done()?` after it, as `docs/GUIDE.md` teaches it.
#[find_executable_batch_size(starting = STARTING, release = release(device), policy = real_allocators::policy())]
fn train_with_the_call(
    batch_size: usize,
    device: &wgpu::Device,
    queue: &wgpu::Queue,
) -> anyhow::Result<usize> {
    for _step in 0..3 {
        step_in_scope(device, queue, batch_size)?;
        batch_size_runtime::step_done()?;
    }
    Ok(batch_size)
}

fn scenario(name: &str) -> (wgpu::Device, wgpu::Queue) {
    real_allocators::expect_child(name);
    let (device, queue) = device().expect("no Vulkan adapter");
    // Warm: the driver's first allocations and pipelines made before the limit.
    step(&device, &queue, 4);
    leave_room(ROOM);
    (device, queue)
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_result() {
    let (device, queue) = scenario("attribute_result");
    let found = train_result(&device, &queue).unwrap();
    let report = last_report().unwrap();
    if std::env::var("REAL_ALLOCATORS_FIGURES").is_err() {
        check_failures(&report, memory_back);
    }
    print_search("result", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_with_the_call() {
    let (device, queue) = scenario("attribute_with_the_call");
    let found = train_with_the_call(&device, &queue).unwrap();
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    print_search("call", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute_panicking() {
    let (device, queue) = scenario("attribute_panicking");
    let found = train_panicking(&device, &queue);
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    print_search("panicking", found, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn chunked() {
    let (device, queue) = scenario("chunked");
    let mut done = 0;
    Chunked::new(2048)
        .with_starting(STARTING)
        .with_release(release(&device))
        .for_each(|range| -> anyhow::Result<()> {
            done += step_in_scope(&device, &queue, range.len())?;
            Ok(())
        })
        .unwrap();
    assert_eq!(done, 2048);
    let report = last_report().unwrap();
    check_failures(&report, memory_back);
    // No byte counts on wgpu: the chunks may halve, but not fail over and over (5 measured).
    assert!(
        report.out_of_memory_count() <= 10,
        "{} chunks out of memory",
        report.out_of_memory_count()
    );
    let largest = report.largest_success().unwrap();
    print_search("chunked", largest, &report);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn tuner() {
    let (device, queue) = scenario("tuner");
    let tuned = Tuner::new()
        .with_max(STARTING)
        .with_release(release(&device))
        .run(|batch_size| anyhow::Ok(step_in_scope(&device, &queue, batch_size)?))
        .unwrap();
    check_tuner_failures(tuned.report(), memory_back);
    print_search("tuner", tuned.batch_size(), tuned.report());
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size() {
    let (device, queue) = scenario("one_size");
    let size = one_size_requested();
    step_in_scope(&device, &queue, size).unwrap();
}

/// Every scenario, its size against the largest that fits, beside halving's (no figures).
#[test]
fn wgpu_on_llvmpipe() {
    if !real_allocators::available(
        "wgpu_on_llvmpipe",
        device().is_some(),
        "no Vulkan adapter (apt-get install mesa-vulkan-drivers)",
    ) {
        return;
    }
    let fits = fits_in_a_fresh_process;
    let largest = largest_that_fits(STARTING, fits);
    println!("wgpu: the largest size that fits in a fresh process: {largest}");
    assert!(largest > 8 && largest < STARTING, "{largest}");
    let scenarios = [
        ("attribute_result", "result"),
        ("attribute_panicking", "panicking"),
        ("attribute_with_the_call", "call"),
        ("chunked", "chunked"),
        ("tuner", "tuner"),
    ];
    compare_with_the_largest("wgpu", &scenarios, largest, fits, false, &[]);
}
