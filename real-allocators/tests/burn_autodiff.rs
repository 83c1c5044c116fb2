//! A training step with a backward pass: a two-layer MLP on burn 0.22.1's wgpu backend through
//! autodiff (`Device::autodiff()`), on Mesa's llvmpipe, under an address-space limit (200 MiB
//! of room once the device is warm). Each scenario runs in a child process; every size found
//! runs again in a fresh process, against the largest that fits there (found by bisection,
//! each size in a fresh process).
//!
//! - the tuner sized from cubecl's dry run (`Tuner::with_dry_run(BurnDryRun::new(&device))`):
//!   no trial runs out of memory, and the size lands near the largest;
//! - memory back after an out-of-memory: the step at 8192 fails, the release runs, and the
//!   sizes that fit a fresh process run again (with the default memory configuration and with
//!   `ExclusivePages`), and the attribute from 8192 finds a size near the largest.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::memory::BurnDryRun;
use batch_size_runtime::{find_executable_batch_size, last_report, Release, SearchReport, Tuner};
use burn::tensor::wgpu::MemoryConfiguration;
use burn::tensor::{Device, DeviceKind, Tensor};
use real_allocators::{child, child_status, leave_room, value};

/// Input features: 16 KiB a sample, so that a tensor at 8192 (128 MiB) stays within llvmpipe's
/// 128 MiB buffer limit, and 8192 fails for want of memory, not of a buffer. The input is
/// normalised (three such tensors live at once) before the layers: memory grows by about
/// 48 KiB a sample while the layers stay narrow (llvmpipe's matmul is slow on two cores).
const INPUT: usize = 4096;
const HIDDEN: usize = 64;
const OUTPUT: usize = 16;
/// Address space left once the device is up.
const ROOM: u64 = 200 << 20;
/// Where the attribute starts, and the tuner's cap.
const STARTING: usize = 8192;

/// Set by the parent: `exclusive` sets the device up with `MemoryConfiguration::ExclusivePages`.
const MEMORY: &str = "REAL_ALLOCATORS_BURN_MEMORY";
/// Set by the parent: `forward` runs the step without its backward pass.
const PASS: &str = "REAL_ALLOCATORS_PASS";

struct Mlp {
    w1: Tensor<2>,
    b1: Tensor<1>,
    w2: Tensor<2>,
    b2: Tensor<1>,
}

fn device() -> Device {
    let device = if std::env::var(MEMORY).as_deref() == Ok("exclusive") {
        Device::wgpu_options()
            .memory_config(MemoryConfiguration::ExclusivePages)
            .init()
            .unwrap()
    } else {
        Device::wgpu(DeviceKind::DefaultDevice)
    };
    // Forward only: an inference step, no autodiff. (On an autodiff device, forward steps with
    // no backward left their saved activations live: the pools held a page more after each.)
    if backward() {
        device.autodiff()
    } else {
        device
    }
}

fn backward() -> bool {
    std::env::var(PASS).as_deref() != Ok("forward")
}

/// One training step at `batch_size`: forward, the loss, and (unless forward only) the
/// backward pass, with the weights' gradients read back. Driven by shapes only.
fn step(device: &Device, mlp: &Mlp, batch_size: usize) -> Result<f32, burn::tensor::ExecutionError> {
    let raw = Tensor::<2>::ones([batch_size, INPUT], device);
    let x = raw.clone().mul_scalar(2.0) - raw;
    let target = Tensor::<2>::zeros([batch_size, OUTPUT], device);
    let hidden = burn::tensor::activation::relu(
        x.matmul(mlp.w1.clone()) + mlp.b1.clone().unsqueeze(),
    );
    let out = hidden.matmul(mlp.w2.clone()) + mlp.b2.clone().unsqueeze();
    let loss = (out - target).square().mean();
    let read = if backward() {
        let grads = loss.backward();
        let g1 = mlp.w1.grad(&grads).map(|g| g.sum());
        let g2 = mlp.w2.grad(&grads).map(|g| g.sum());
        match (g1, g2) {
            (Some(g1), Some(g2)) => g1 + g2,
            _ => loss.detach(),
        }
    } else {
        loss
    };
    let data = read.try_into_data()?;
    Ok(data
        .try_to_vec::<f32>()
        .map_or(f32::NAN, |values| values[0]))
}

/// The device warm (kernels compiled at a small size, pools started), the model loaded, the
/// address space limited: the same start in every child.
fn scenario(name: &str) -> (Device, Mlp) {
    real_allocators::expect_child(name);
    let device = device();
    let grad = |tensor: Tensor<2>| if backward() { tensor.require_grad() } else { tensor };
    let grad1 = |tensor: Tensor<1>| if backward() { tensor.require_grad() } else { tensor };
    let mlp = Mlp {
        w1: grad(Tensor::full([INPUT, HIDDEN], 0.01, &device)),
        b1: grad1(Tensor::full([HIDDEN], 0.01, &device)),
        w2: grad(Tensor::full([HIDDEN, OUTPUT], 0.01, &device)),
        b2: grad1(Tensor::full([OUTPUT], 0.01, &device)),
    };
    // Kernels compiled at the sizes whose variants the step picks (cubecl's matmul and
    // reductions choose by shape): llvmpipe compiling a pipeline under the address-space limit
    // crashed the process (SIGSEGV in `vkCreateComputePipelines`) instead of failing.
    for size in [4, 256, 2048] {
        step(&device, &mlp, size).unwrap();
    }
    device.memory_cleanup();
    leave_room(ROOM);
    (device, mlp)
}

fn print(label: &str, found: usize, report: &SearchReport, dry_runs: usize) {
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{label}: {} {:?} ({:?})",
                attempt.batch_size, attempt.outcome, attempt.rationale
            );
        }
    }
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
fn one_size() {
    let (device, mlp) = scenario("one_size");
    step(&device, &mlp, real_allocators::one_size_requested()).unwrap();
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn dry() {
    let (device, mlp) = scenario("dry");
    let dry_run = BurnDryRun::new(&device);
    if std::env::var_os("REAL_ALLOCATORS_PROBE").is_some() {
        // What each dry run measures, sizes increasing, and the pools after it.
        use batch_size_runtime::memory::DryRun;
        eprintln!("budget {:?}", dry_run.budget());
        for size in [16, 64, 256, 1024, 4096] {
            let mut ran = None;
            let peak = dry_run.measure(&mut || ran = Some(step(&device, &mlp, size).is_ok()));
            eprintln!("dry run {size}: peak {peak:?} ran {ran:?}; pools {:?}", device.memory_pool_report());
        }
        return;
    }
    let tuned = Tuner::new()
        .with_max(STARTING)
        .with_release(Release::burn(&device))
        .with_dry_run(dry_run.clone())
        .run(|batch_size| anyhow::Ok(step(&device, &mlp, batch_size)?))
        .unwrap();
    print("dry", tuned.batch_size(), tuned.report(), dry_run.dry_runs());
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn ordinary() {
    let (device, mlp) = scenario("ordinary");
    let tuned = Tuner::new()
        .with_max(STARTING)
        .with_release(Release::burn(&device))
        .run(|batch_size| anyhow::Ok(step(&device, &mlp, batch_size)?))
        .unwrap();
    print("ordinary", tuned.batch_size(), tuned.report(), 0);
}

#[find_executable_batch_size(starting = STARTING, release = Release::burn(device))]
fn train(batch_size: usize, device: &Device, mlp: &Mlp) -> anyhow::Result<usize> {
    step(device, mlp, batch_size)?;
    Ok(batch_size)
}

#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn attribute() {
    let (device, mlp) = scenario("attribute");
    let found = train(&device, &mlp).unwrap();
    print("attribute", found, &last_report().unwrap(), 0);
}

/// After an out-of-memory (the step at `STARTING`) and the release, the largest size that runs,
/// scanning down from the size the parent asks in steps of 1 %: what a search can still find.
#[test]
#[ignore = "a scenario: run in a child process by this file\'s framework test, with --ignored"]
fn after_a_failure() {
    let (device, mlp) = scenario("after_a_failure");
    assert!(step(&device, &mlp, STARTING).is_err(), "{STARTING} ran");
    let release = Release::burn(&device);
    release.memory_backend().release().unwrap();
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        eprintln!("pools after the release: {:?}", device.memory_pool_report());
    }
    // 1 % steps down to 0.85 of the asked size, 10 % steps below (each step takes seconds on
    // llvmpipe: what matters is whether 0.90 runs, and otherwise about where it is).
    let asked = real_allocators::one_size_requested();
    let mut size = asked;
    while size > 1 && step(&device, &mlp, size).is_err() {
        release.memory_backend().release().unwrap();
        size = if size * 100 > asked * 85 { size * 99 / 100 } else { size * 9 / 10 };
    }
    println!("\nafter_a_failure.runs={size}");
}

/// A child's environment: the memory configuration, the pass, and the size where one is asked.
fn with(memory: &str, pass: &str, size: Option<usize>) -> Vec<(&'static str, String)> {
    let mut all = vec![(MEMORY, memory.to_owned()), (PASS, pass.to_owned())];
    all.extend(size.map(|size| ("REAL_ALLOCATORS_SIZE", size.to_string())));
    all
}

fn fits(memory: &str, pass: &str, size: usize) -> bool {
    child_status("one_size", &with(memory, pass, Some(size))).1
}

/// The largest size that runs in a fresh process, to 1 %, between the warm-up's 2048 (which
/// runs) and `STARTING` (which does not): each child takes seconds on llvmpipe, so the
/// bisection stops at 1 % rather than at one sample.
fn largest(memory: &str, pass: &str) -> usize {
    let (mut ran, mut failed) = (2048, STARTING);
    while (failed - ran) * 100 > ran {
        let size = ran + (failed - ran) / 2;
        if fits(memory, pass, size) {
            ran = size;
        } else {
            failed = size;
        }
    }
    ran
}

fn llvmpipe(test: &str) -> bool {
    real_allocators::available(
        test,
        std::path::Path::new(real_allocators::LLVMPIPE).exists(),
        "no llvmpipe (apt-get install mesa-vulkan-drivers)",
    )
}

/// The tuner sized from dry runs, on the step with and without its backward pass: no trial out
/// of memory, the size runs in a fresh process, near the largest.
#[test]
fn mlp_dry_run_sizing() {
    if !llvmpipe("mlp_dry_run_sizing") {
        return;
    }
    let mut scenarios = vec!["dry"];
    if std::env::var_os("REAL_ALLOCATORS_BENCH").is_some() {
        scenarios.push("ordinary");
    }
    for pass in ["backward", "forward"] {
        let largest = largest("adaptive", pass);
        println!("burn mlp ({pass}): the largest size that fits in a fresh process: {largest}");
        for scenario in &scenarios {
            let lines = child(scenario, &with("adaptive", pass, None));
            let found: usize = value(&lines, &format!("{scenario}.found")).parse().unwrap();
            let oom: usize = value(&lines, &format!("{scenario}.oom")).parse().unwrap();
            let share = found as f64 / largest as f64;
            println!(
                "burn mlp ({pass}) {scenario}: found {found} of {largest} ({share:.3}); dry runs {}, real trials {}, out-of-memory {oom}; {}",
                value(&lines, &format!("{scenario}.dry")),
                value(&lines, &format!("{scenario}.real")),
                real_allocators::value_if_any(&lines, &format!("{scenario}.rationale")).unwrap_or_default(),
            );
            assert!(fits("adaptive", pass, found), "{found} does not run in a fresh process");
            assert!(found <= largest + largest / 50, "{found} above {largest}");
            if *scenario == "dry" {
                assert_eq!(oom, 0, "({pass}) the dry runs' size ran out of memory: {lines:?}");
                assert!(share >= 0.90, "({pass}) {found} of {largest} ({share:.3})");
            }
        }
    }
}

/// After an out-of-memory at 8192, the sizes that fit a fresh process fit again, with each
/// memory configuration; the attribute from 8192 lands near the largest.
#[test]
fn mlp_memory_back_after_a_failure() {
    if !llvmpipe("mlp_memory_back_after_a_failure") {
        return;
    }
    for memory in ["adaptive", "exclusive"] {
        let largest = largest(memory, "backward");
        let lines = child(
            "after_a_failure",
            &with(memory, "backward", Some(largest)),
        );
        let runs: usize = value(&lines, "after_a_failure.runs").parse().unwrap();
        let lines = child("attribute", &with(memory, "backward", None));
        let found: usize = value(&lines, "attribute.found").parse().unwrap();
        println!(
            "burn mlp {memory}: largest in a fresh process {largest}; after an out-of-memory {runs} ({:.3}); attribute from {STARTING}: {found} ({:.3}) in {} attempts",
            runs as f64 / largest as f64,
            found as f64 / largest as f64,
            value(&lines, "attribute.real"),
        );
        assert!(fits(memory, "backward", runs), "{memory}: {runs}");
        assert!(fits(memory, "backward", found), "{memory}: {found}");
        assert!(
            runs as f64 >= 0.90 * largest as f64,
            "{memory}: after an out-of-memory {runs} of {largest}"
        );
    }
}
