//! The tuner sized from cubecl's dry run (`Tuner::with_dry_run(BurnDryRun::new(&device))`) on
//! burn 0.22.1's wgpu backend on Mesa's llvmpipe, under an address-space limit: no trial runs
//! out of memory, and the size found runs again in a fresh process, not above the largest that
//! fits there (found by bisection, each size in a fresh process) and within 10 % below it
//! (measured 0.952 with the default margin, docs/BENCHMARKS.md). The step
//! allocates in several pools: its weights, the arena's pages (which grow with the batch) and
//! the small-allocation pool (a bias, per-sample sums).
//!
//! With `REAL_ALLOCATORS_BENCH=1` the ordinary tuner and halving run beside it (the figures in
//! docs/BENCHMARKS.md); CI runs the dry run only.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::memory::BurnDryRun;
use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report, SearchReport, Tuner};
use burn::tensor::{Device, DeviceKind, Tensor};
use real_allocators::{
    child, fits_in_a_fresh_process, largest_that_fits, leave_room, one_size_requested, value,
};

/// f32 values a sample: 256 KiB of input a sample.
const WIDTH: usize = 65536;
/// Address space left once the device is up.
const ROOM: u64 = 128 << 20;
/// Below llvmpipe's 128 MiB buffer limit for one tensor (448 × 256 KiB).
const MAX: usize = 448;

struct Model {
    weight: Tensor<2>,
    bias: Tensor<1>,
}

fn device() -> Device {
    Device::wgpu(DeviceKind::DefaultDevice)
}

/// One step at `batch_size`, its result read back: driven by shapes only (what a dry run can
/// measure).
fn step(
    device: &Device,
    model: &Model,
    batch_size: usize,
) -> Result<f32, burn::tensor::ExecutionError> {
    let x = Tensor::<2>::ones([batch_size, WIDTH], device);
    let doubled = x.clone().mul_scalar(2.0);
    let summed = doubled.clone().add(x);
    let hidden = summed.clone().matmul(model.weight.clone()) + model.bias.clone().unsqueeze();
    let per_sample = burn::tensor::activation::relu(hidden).sum_dim(1);
    let product = summed.mul(doubled);
    let data = (product.sum() + per_sample.sum()).try_into_data()?;
    Ok(data
        .try_to_vec::<f32>()
        .map_or(f32::NAN, |values| values[0]))
}

/// The device warm (kernels compiled at a small size, pools started), the model loaded, the
/// address space limited: the same start in every child.
fn scenario(name: &str) -> (Device, Model) {
    real_allocators::expect_child(name);
    let device = device();
    let model = Model {
        weight: Tensor::ones([WIDTH, 16], &device),
        bias: Tensor::ones([16], &device),
    };
    step(&device, &model, 4).unwrap();
    device.memory_cleanup();
    leave_room(ROOM);
    (device, model)
}

fn print(label: &str, found: usize, report: &SearchReport, dry_runs: usize) {
    println!("\n{label}.found={found}");
    println!("{label}.real={}", report.len());
    println!("{label}.oom={}", report.out_of_memory_count());
    println!("{label}.dry={dry_runs}");
    if let Some(reason) = report.attempts().next().and_then(|a| a.rationale.clone()) {
        println!("{label}.rationale={reason}");
    }
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn dry() {
    let (device, model) = scenario("dry");
    let dry_run = BurnDryRun::new(&device);
    // The default margin (5 %): without it the dry runs' size ran out of memory
    // (docs/BENCHMARKS.md).
    let margin = std::env::var("REAL_ALLOCATORS_MARGIN").map_or(0.05, |m| m.parse().unwrap());
    let tuned = Tuner::new()
        .with_max(MAX)
        .with_headroom(margin)
        .with_release(Release::burn(&device))
        .with_dry_run(dry_run.clone())
        .run(|batch_size| anyhow::Ok(step(&device, &model, batch_size)?))
        .unwrap();
    print(
        "dry",
        tuned.batch_size(),
        tuned.report(),
        dry_run.dry_runs(),
    );
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn ordinary() {
    let (device, model) = scenario("ordinary");
    let tuned = Tuner::new()
        .with_max(MAX)
        .with_release(Release::burn(&device))
        .run(|batch_size| anyhow::Ok(step(&device, &model, batch_size)?))
        .unwrap();
    print("ordinary", tuned.batch_size(), tuned.report(), 0);
}

#[find_executable_batch_size(starting = MAX, release = Release::none())]
fn halved(batch_size: usize, device: &Device, model: &Model) -> anyhow::Result<usize> {
    step(device, model, batch_size)?;
    Ok(batch_size)
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn halving() {
    let (device, model) = scenario("halving");
    let found = halved(&device, &model).unwrap();
    print("halving", found, &last_report().unwrap(), 0);
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn one_size() {
    let (device, model) = scenario("one_size");
    let size = one_size_requested();
    step(&device, &model, size).unwrap();
}

#[test]
fn dry_run_sizing_on_llvmpipe() {
    if !real_allocators::available(
        "dry_run_sizing_on_llvmpipe",
        std::path::Path::new(real_allocators::LLVMPIPE).exists(),
        "no llvmpipe (apt-get install mesa-vulkan-drivers)",
    ) {
        return;
    }
    let fits = fits_in_a_fresh_process;
    let largest = largest_that_fits(MAX, fits);
    println!("burn dry run: the largest size that fits in a fresh process: {largest}");
    assert!(largest > 16 && largest < MAX, "{largest}");
    let mut scenarios = vec![("dry", None)];
    if std::env::var_os("REAL_ALLOCATORS_BENCH").is_some() {
        scenarios.extend([("dry", Some("0")), ("ordinary", None), ("halving", None)]);
    }
    for (scenario, margin) in scenarios {
        let extra: Vec<(&str, String)> = margin
            .map(|m| ("REAL_ALLOCATORS_MARGIN", m.to_owned()))
            .into_iter()
            .collect();
        let lines = child(scenario, &extra);
        let found: usize = value(&lines, &format!("{scenario}.found")).parse().unwrap();
        let oom: usize = value(&lines, &format!("{scenario}.oom")).parse().unwrap();
        let fresh = fits(found);
        println!(
            "burn {scenario} (margin {margin:?}): found {found} of {largest} ({:.3}); dry runs {}, real trials {}, out-of-memory {oom}; runs in a fresh process: {fresh}; {}",
            found as f64 / largest as f64,
            value(&lines, &format!("{scenario}.dry")),
            value(&lines, &format!("{scenario}.real")),
            lines.iter().find(|(k, _)| k == &format!("{scenario}.rationale")).map_or("", |(_, v)| v.as_str()),
        );
        if scenario == "dry" && margin.is_none() {
            assert_eq!(oom, 0, "the dry run's size ran out of memory: {lines:?}");
            assert!(
                value(&lines, "dry.dry").parse::<usize>().unwrap() >= 2,
                "{lines:?}"
            );
            assert!(fresh, "{found} does not run in a fresh process");
            assert!(
                found <= largest + largest / 50,
                "{found} above the largest that fits, {largest}"
            );
            // Measured 236 of 248 (0.952): the dry runs' 249 less the 5 % margin. (Before the
            // weights were counted in the page they held before the sizing, rather than the
            // larger one a dry run's cleanup moved them to: 214, 0.863.)
            assert!(
                found * 10 >= largest * 9,
                "{found} more than 10 % below {largest}"
            );
        }
    }
}
