//! Every size policy on the same memory workloads, on a simulated 16 GiB device, side by side:
//! `cargo bench -p batch-size-runtime --bench search` prints one row per case and policy, then
//! the means. Each policy runs through the real engine (`BatchSizeSearch`), so the release, the
//! figures and the engine's rules are the ones users get.
//!
//! Workloads (16 GiB device; starts above the fit):
//! - linear: one activation tensor of 120 MiB a sample;
//! - fixed + linear: 9 GiB of weights and optimizer state, then 60 MiB a sample;
//! - layered: 2 GiB of weights, then 24 layers that each keep 5 MiB a sample, so the failure
//!   comes part-way through the step;
//! - quadratic: 1 GiB, 30 MiB a sample and an attention matrix of 0.25 MiB × size²;
//! - rounded: 3 GiB, then four tensors of 7.3 MiB a sample, every allocation rounded up to
//!   2 MiB blocks;
//! - cramped: 15 GiB fixed, then 20 MiB a sample;
//! - noisy: 4 GiB, then 100 MiB a sample varying by up to ±3 % from one attempt to the next.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use batch_size_runtime::policy::{Decision, Factor, Guided, Halve, SizePolicy, Tuner};
use batch_size_runtime::{
    BatchSizeSearch, OutOfMemory, Outcome, SearchReport, SimAllocation, SimulatedDevice,
};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const DEVICE: u64 = 16 * GIB;

#[derive(Clone, Copy, PartialEq)]
enum Workload {
    Linear,
    FixedLinear,
    Layered,
    Quadratic,
    Rounded,
    Cramped,
    Noisy,
}

impl Workload {
    const ALL: [Workload; 7] = [
        Workload::Linear,
        Workload::FixedLinear,
        Workload::Layered,
        Workload::Quadratic,
        Workload::Rounded,
        Workload::Cramped,
        Workload::Noisy,
    ];

    fn name(self) -> &'static str {
        match self {
            Workload::Linear => "linear",
            Workload::FixedLinear => "fixed + linear",
            Workload::Layered => "layered (24)",
            Workload::Quadratic => "quadratic",
            Workload::Rounded => "2 MiB-rounded",
            Workload::Cramped => "cramped",
            Workload::Noisy => "noisy (±3 %)",
        }
    }

    fn device(self) -> SimulatedDevice {
        let device = SimulatedDevice::new(DEVICE).with_caching();
        match self {
            Workload::Rounded => device.with_block_size(2 * MIB),
            _ => device,
        }
    }

    /// One training step at `size`: every allocation it makes, kept until it returns.
    fn step(self, device: &SimulatedDevice, size: u64, noise: f64) -> Result<(), OutOfMemory> {
        let mut held: Vec<SimAllocation> = Vec::new();
        let mut alloc = |bytes: u64| -> Result<(), OutOfMemory> {
            held.push(device.alloc(bytes)?);
            Ok(())
        };
        match self {
            Workload::Linear => alloc(size * 120 * MIB),
            Workload::FixedLinear => {
                alloc(9 * GIB)?;
                alloc(size * 60 * MIB)
            }
            Workload::Layered => {
                alloc(2 * GIB)?;
                for _ in 0..24 {
                    alloc(size * 5 * MIB)?;
                }
                Ok(())
            }
            Workload::Quadratic => {
                alloc(GIB)?;
                alloc(size * 30 * MIB)?;
                alloc(size * size * MIB / 4)
            }
            Workload::Rounded => {
                alloc(3 * GIB)?;
                for _ in 0..4 {
                    alloc((size as f64 * 7.3 * MIB as f64) as u64)?;
                }
                Ok(())
            }
            Workload::Cramped => {
                alloc(15 * GIB)?;
                alloc(size * 20 * MIB)
            }
            Workload::Noisy => {
                alloc(4 * GIB)?;
                alloc((size as f64 * 100.0 * MIB as f64 * noise) as u64)
            }
        }
    }

    /// The largest size whose step fits (noise at its nominal 1.0).
    fn largest_fit(self) -> usize {
        let fits = |size: usize| self.step(&self.device(), size as u64, 1.0).is_ok();
        let (mut low, mut high) = (0usize, 1usize);
        while fits(high) {
            low = high;
            high *= 2;
        }
        while high - low > 1 {
            let middle = (low + high) / 2;
            if fits(middle) {
                low = middle;
            } else {
                high = middle;
            }
        }
        low
    }
}

/// Deterministic noise in [0.97, 1.03] for the n-th attempt.
fn noise(attempt: u64) -> f64 {
    let mut x = attempt
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0x2545_F491);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    0.97 + 0.06 * ((x % 10_000) as f64 / 10_000.0)
}

/// Lightning's `BatchSizeFinder` (lightning 2.6, src/lightning/pytorch/tuner/
/// batch_size_scaling.py, `_run_binary_scaling`): from `init_val` double while trials succeed;
/// after the first OOM bisect between the last success (`low`) and the failure (`high`) until
/// `high - low <= 1`; at most `max_trials` successful trials; then `int(size * (1 - margin))`,
/// a size that was not itself run.
#[derive(Debug)]
struct LightningBinsearch {
    low: usize,
    high: Option<usize>,
    count: usize,
    max_trials: usize,
    margin: f64,
    result: Arc<Mutex<Option<usize>>>,
}

impl LightningBinsearch {
    fn finish(&mut self, size: usize) -> Decision {
        let with_margin = (size as f64 * (1.0 - self.margin)) as usize;
        if let Ok(mut result) = self.result.lock() {
            *result = Some(with_margin);
        }
        Decision::Accept
    }
}

impl SizePolicy for LightningBinsearch {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(2) // init_val
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        let size = last.batch_size;
        if last.outcome == Outcome::Succeeded {
            self.count += 1;
            if self.count > self.max_trials {
                return self.finish(size);
            }
            self.low = size;
            match self.high {
                Some(high) if high - self.low <= 1 => self.finish(size),
                Some(high) => Decision::Try((high + self.low) / 2),
                None => Decision::Try(size * 2),
            }
        } else {
            self.high = Some(size);
            let middle = (size + self.low) / 2;
            if size - self.low <= 1 {
                // Lightning returns `midval` (= low, which ran) here.
                return self.finish(middle);
            }
            Decision::Try(middle)
        }
    }
}

/// Lightning's power mode (`_run_power_scaling`): double from `init_val` while trials succeed;
/// at the first OOM after a success, halve and return (the size that last ran).
#[derive(Debug)]
struct LightningPower {
    any_success: bool,
    trials: usize,
    result: Arc<Mutex<Option<usize>>>,
}

impl SizePolicy for LightningPower {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(2)
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        self.trials += 1;
        let size = last.batch_size;
        let next = if last.outcome == Outcome::Succeeded {
            self.any_success = true;
            size * 2
        } else {
            let halved = size / 2;
            if self.any_success || self.trials >= 25 {
                if let Ok(mut result) = self.result.lock() {
                    *result = Some(halved);
                }
                return Decision::Accept;
            }
            halved
        };
        if self.trials >= 25 {
            return Decision::Accept;
        }
        Decision::Try(next)
    }
}

struct Row {
    tried: Vec<usize>,
    found: usize,
    attempts: usize,
    failures: usize,
}

fn run(workload: Workload, start: usize, policy: &str) -> Row {
    let device = workload.device();
    let attempt_number = AtomicU64::new(0);
    let result = Arc::new(Mutex::new(None));
    let search = BatchSizeSearch::new(start).with_release(device.clone());
    let search = match policy {
        "halving" => search.with_policy(Halve),
        "x0.9" => search.with_policy(Factor(0.9)),
        "binsearch" => search.with_policy(LightningBinsearch {
            low: 1,
            high: None,
            count: 0,
            max_trials: 25,
            margin: 0.05,
            result: Arc::clone(&result),
        }),
        "power" => search.with_policy(LightningPower {
            any_success: false,
            trials: 0,
            result: Arc::clone(&result),
        }),
        _ => search.with_policy(Guided::new()),
    };
    let (found, report) = search.run_with_report(|size| -> anyhow::Result<usize> {
        let n = attempt_number.fetch_add(1, Ordering::Relaxed);
        workload.step(&device, size as u64, noise(n))?;
        Ok(size)
    });
    let found = result
        .lock()
        .ok()
        .and_then(|result| *result)
        .or_else(|| found.ok())
        .unwrap_or(0);
    Row {
        tried: report
            .attempts()
            .map(|attempt| attempt.batch_size)
            .collect(),
        found,
        attempts: report.len(),
        failures: report.out_of_memory_count(),
    }
}

/// The tuner on `workload`: with the device's figures, or without (no release backend, errors
/// that carry no figures, a device that frees at once). Returns the size, trials and failures.
fn tune(workload: Workload, figures: bool) -> (usize, usize, usize) {
    let attempt_number = AtomicU64::new(0);
    let device = if figures {
        workload.device()
    } else {
        let plain = SimulatedDevice::new(DEVICE);
        if workload == Workload::Rounded {
            plain.with_block_size(2 * MIB)
        } else {
            plain
        }
    };
    let mut tuner = Tuner::new();
    tuner = if figures {
        tuner.with_release(device.clone())
    } else {
        tuner.with_release(batch_size_runtime::Release::none())
    };
    let tuned = tuner.run(|size| -> anyhow::Result<()> {
        let n = attempt_number.fetch_add(1, Ordering::Relaxed);
        match workload.step(&device, size as u64, noise(n)) {
            Ok(()) => Ok(()),
            Err(_) if !figures => Err(OutOfMemory::new().into()),
            Err(error) => Err(error.into()),
        }
    });
    match tuned {
        Ok(tuned) => (
            tuned.batch_size(),
            tuned.report().len(),
            tuned.report().out_of_memory_count(),
        ),
        Err(none_fit) => (
            0,
            none_fit.report().len(),
            none_fit.report().out_of_memory_count(),
        ),
    }
}

/// The attempts of a second search (or tuning) with the cache on, after a first one.
fn cached_rerun(workload: Workload, tuner: bool) -> usize {
    let key = format!("bench {}", workload.name());
    let mut attempts = 0;
    for _ in 0..2 {
        let device = workload.device();
        let attempt_number = AtomicU64::new(0);
        let step = |size: usize| -> anyhow::Result<usize> {
            let n = attempt_number.fetch_add(1, Ordering::Relaxed);
            workload.step(&device, size as u64, noise(n))?;
            Ok(size)
        };
        attempts = if tuner {
            match Tuner::new()
                .with_release(device.clone())
                .with_cache(key.clone())
                .run(step)
            {
                Ok(tuned) => tuned.report().len(),
                Err(none_fit) => none_fit.report().len(),
            }
        } else {
            let (_, report) = BatchSizeSearch::new(512)
                .with_release(device.clone())
                .with_cache(key.clone())
                .run_with_report(step);
            report.len()
        };
    }
    attempts
}

fn main() {
    let policies = ["halving", "x0.9", "binsearch", "power", "guided"];
    let mut totals: Vec<(f64, f64, usize, usize, usize)> =
        vec![(0.0, f64::INFINITY, 0, 0, 0); policies.len()];
    println!(
        "| workload | start | fits | policy | sizes tried | found | attempts | OOM | utilisation |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for workload in Workload::ALL {
        let fit = workload.largest_fit();
        for start in [128usize, 256, 512] {
            if start <= fit {
                continue;
            }
            for (index, policy) in policies.iter().enumerate() {
                let row = run(workload, start, policy);
                let utilisation = row.found as f64 / fit as f64;
                let tried: Vec<String> = row.tried.iter().map(usize::to_string).collect();
                let tried = if tried.len() > 12 {
                    format!(
                        "{} … {}",
                        tried[..6].join(" "),
                        tried[tried.len() - 3..].join(" ")
                    )
                } else {
                    tried.join(" ")
                };
                let start_shown = if matches!(*policy, "binsearch" | "power") {
                    "2".to_owned()
                } else {
                    start.to_string()
                };
                println!(
                    "| {} | {start_shown} | {fit} | {policy} | {tried} | {} | {} | {} | {utilisation:.3} |",
                    workload.name(),
                    row.found,
                    row.attempts,
                    row.failures
                );
                let total = &mut totals[index];
                total.0 += utilisation;
                total.1 = total.1.min(utilisation);
                total.2 += row.attempts;
                total.3 += row.failures;
                total.4 += 1;
            }
        }
    }
    // The tuner against Lightning's binsearch, once a workload (they start small).
    println!();
    println!(
        "| workload | fits | tuner with figures | tuner without figures | Lightning binsearch | rerun with the cache (guided / tuner) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut tuner_totals = [(0.0f64, f64::INFINITY, 0usize); 3];
    let mut workloads = 0usize;
    for workload in Workload::ALL {
        let fit = workload.largest_fit();
        let with = tune(workload, true);
        let without = tune(workload, false);
        let lightning = run(workload, 2, "binsearch");
        let cells = [
            (with.0, with.1, with.2),
            (without.0, without.1, without.2),
            (lightning.found, lightning.attempts, lightning.failures),
        ];
        let shown: Vec<String> = cells
            .iter()
            .map(|(found, trials, failures)| {
                format!(
                    "{found} ({:.3}) in {trials} trials, {failures} OOM",
                    *found as f64 / fit as f64
                )
            })
            .collect();
        let reruns = (cached_rerun(workload, false), cached_rerun(workload, true));
        println!(
            "| {} | {fit} | {} | {} | {} | {} / {} attempt(s) |",
            workload.name(),
            shown[0],
            shown[1],
            shown[2],
            reruns.0,
            reruns.1
        );
        for (total, (found, trials, _)) in tuner_totals.iter_mut().zip(cells) {
            let utilisation = found as f64 / fit as f64;
            total.0 += utilisation;
            total.1 = total.1.min(utilisation);
            total.2 += trials;
        }
        workloads += 1;
    }
    println!();
    println!("| tuner | mean utilisation | worst | mean trials |");
    println!("|---|---|---|---|");
    for (name, (sum, worst, trials)) in ["with figures", "without figures", "Lightning binsearch"]
        .iter()
        .zip(tuner_totals)
    {
        println!(
            "| {name} | {:.3} | {worst:.3} | {:.2} |",
            sum / workloads as f64,
            trials as f64 / workloads as f64
        );
    }

    println!();
    println!("| policy | mean utilisation | worst | mean attempts | mean OOM failures |");
    println!("|---|---|---|---|---|");
    for (policy, (sum, worst, attempts, failures, cases)) in policies.iter().zip(totals) {
        let cases_f = cases.max(1) as f64;
        println!(
            "| {policy} | {:.3} | {worst:.3} | {:.2} | {:.2} |",
            sum / cases_f,
            attempts as f64 / cases_f,
            failures as f64 / cases_f
        );
    }
}
