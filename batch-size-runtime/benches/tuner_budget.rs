//! The tuner under a budget of trials: for budgets 1 to 4 (and the default 25), with and
//! without figures, on the search benchmark's workloads, the mean utilisation of the size
//! returned (of the largest that fits), the worst, and the mean trials. A budget's spare
//! trial should be spent on the search: the utilisation grows with the budget.
//!
//! `cargo bench -p batch-size-runtime --bench tuner_budget`

use std::sync::atomic::{AtomicU64, Ordering};

use batch_size_runtime::{memory::SimulatedDevice, OutOfMemory, Release, Tuner};

// Shared with the search benchmark and the tests, which use what this file does not.
#[allow(dead_code)]
#[path = "../tests/common/workloads.rs"]
mod workloads;
use workloads::{noise, Workload, DEVICE, MIB};

/// The size the tuner returns on `workload` within `budget` trials (0 where none), and the
/// trials it ran.
fn tune(workload: Workload, figures: bool, budget: usize) -> (usize, usize) {
    let attempt_number = AtomicU64::new(0);
    let device = if figures {
        workload.device()
    } else if workload == Workload::Rounded {
        SimulatedDevice::new(DEVICE).with_block_size(2 * MIB)
    } else {
        SimulatedDevice::new(DEVICE)
    };
    let release = if figures {
        Release::from(device.clone())
    } else {
        Release::none()
    };
    let tuned = Tuner::new()
        .with_max_trials(budget)
        .with_release(release)
        .run(|size| -> anyhow::Result<()> {
            let n = attempt_number.fetch_add(1, Ordering::Relaxed);
            match workload.step(&device, size as u64, noise(n)) {
                Ok(()) => Ok(()),
                Err(_) if !figures => Err(OutOfMemory::new().into()),
                Err(error) => Err(error.into()),
            }
        });
    match tuned {
        Ok(tuned) => (tuned.batch_size(), tuned.report().len()),
        Err(_) => (0, batch_size_runtime::last_report().map_or(0, |r| r.len())),
    }
}

fn main() {
    println!("| budget | figures | mean utilisation | worst | mean trials |");
    println!("|---|---|---|---|---|");
    for budget in [1, 2, 3, 4, 25] {
        for figures in [true, false] {
            let (mut sum, mut worst, mut trials) = (0.0, f64::MAX, 0);
            for workload in Workload::ALL {
                let (size, ran) = tune(workload, figures, budget);
                let utilisation = size as f64 / workload.largest_fit(1.0) as f64;
                sum += utilisation;
                worst = f64::min(worst, utilisation);
                trials += ran;
            }
            let count = Workload::ALL.len() as f64;
            println!(
                "| {budget} | {} | {:.3} | {:.3} | {:.2} |",
                if figures { "with" } else { "without" },
                sum / count,
                worst,
                trials as f64 / count
            );
        }
    }
}
