//! Every size policy on the same memory workloads, on a simulated 16 GiB device, side by side:
//! `cargo bench -p batch-size-runtime --bench search` prints one row per case (workload and
//! start) with halving, x0.9 and the default (guided, with the device's figures and with only the
//! error's text), then the means and, for each policy, the cases that ended below halving's size
//! or took more than halving's attempts + 2. Each policy runs through the real engine
//! (`BatchSizeSearch`), so the release, the figures and the engine's rules are the ones users get.
//!
//! The workloads, on a simulated 16 GiB device, are defined in `tests/common/workloads.rs`, shared
//! with `tests/search/guided_never_worse.rs`; each runs from the starts 128, 256 and 512 that are above
//! its fit, and from 4¼ and 16¼ times its fit (a start a little above a power of two times the
//! fit: halving's worst case, where it ends near half the fit).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_size_runtime::policy::{Decision, Factor, Guided, Halve, SizePolicy};
use batch_size_runtime::{
    memory::SimulatedDevice, step_done, BatchSizeSearch, Choice, OutOfMemory, Outcome,
    SearchReport, Tuner,
};

#[path = "../tests/common/workloads.rs"]
mod workloads;

use workloads::{noise, TextOnly, Workload, DEVICE, MIB};

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
    let search = if policy == "guided, text only" {
        BatchSizeSearch::new(start).with_release(TextOnly(device.clone()))
    } else {
        BatchSizeSearch::new(start).with_release(device.clone())
    };
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

fn shown(tried: &[usize]) -> String {
    let tried: Vec<String> = tried.iter().map(usize::to_string).collect();
    if tried.len() > 12 {
        format!(
            "{} … {}",
            tried[..6].join(" "),
            tried[tried.len() - 3..].join(" ")
        )
    } else {
        tried.join(" ")
    }
}

#[derive(Clone, Copy)]
struct Totals {
    utilisation: f64,
    worst: f64,
    attempts: usize,
    failures: usize,
    cases: usize,
    below_halving: usize,
    over_halving_attempts: usize,
}

/// A step's time in the throughput model: 1 ms up to 64 samples, then in proportion to the
/// size (the device is busy from 64 on: samples per second stop growing there).
fn step_micros(size: usize) -> u64 {
    1000 * size.max(64) as u64 / 64
}

/// The tuner on `workload`: with the device's figures, or without (no release backend, errors
/// that carry no figures, a device that frees at once), choosing the largest or the fastest
/// size (a simulated clock: [`step_micros`]). Returns the size, trials and failures, and the
/// sizes tried.
fn tune(workload: Workload, figures: bool, choice: Choice) -> (usize, usize, usize, Vec<usize>) {
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
    let micros = Arc::new(AtomicU64::new(0));
    let clock = Arc::clone(&micros);
    let mut tuner = Tuner::new()
        .choose(choice)
        .with_clock(move || Duration::from_micros(clock.load(Ordering::Relaxed)));
    tuner = if figures {
        tuner.with_release(device.clone())
    } else {
        tuner.with_release(batch_size_runtime::Release::none())
    };
    let tuned = tuner.run(|size| -> anyhow::Result<()> {
        let n = attempt_number.fetch_add(1, Ordering::Relaxed);
        micros.fetch_add(step_micros(size), Ordering::Relaxed);
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
            tuned.report().tried(),
        ),
        // The tuner returns the trial's own error; its record is the last report.
        Err(_) => batch_size_runtime::last_report().map_or((0, 0, 0, Vec::new()), |report| {
            (
                0,
                report.len(),
                report.out_of_memory_count(),
                report.tried(),
            )
        }),
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
                Err(_) => batch_size_runtime::last_report().map_or(0, |report| report.len()),
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

/// The steps of one run of the function in the growth tables.
const STEPS: usize = 6;

/// The doors of the growth table, in its column order.
const DOORS: [&str; 6] = [
    "halving",
    "x0.9",
    "default",
    "default + step_done",
    "cache, 2nd run (+ step_done)",
    "cache, 2nd run (alone)",
];

/// One search of the growth table: `door` on `workload` from `start`, the function calling
/// `step_done()` after its step where `calls`, the cache on under `key` where given. `first`
/// numbers the attempts for the noisy workload's noise.
fn search_once(
    workload: Workload,
    start: usize,
    policy: &str,
    calls: bool,
    key: Option<&str>,
    first: u64,
) -> Row {
    let device = workload.device();
    let attempt_number = AtomicU64::new(first);
    let mut search = BatchSizeSearch::new(start).with_release(device.clone());
    search = match policy {
        "halving" => search.with_policy(Halve),
        "x0.9" => search.with_policy(Factor(0.9)),
        _ => search,
    };
    if let Some(key) = key {
        search = search.with_cache(key.to_owned());
    }
    let (found, report) = search.run_with_report(|size| -> anyhow::Result<usize> {
        let n = attempt_number.fetch_add(1, Ordering::Relaxed);
        // Six steps a run, as a short training run: the call after each.
        for _ in 0..STEPS {
            workload.step(&device, size as u64, noise(n))?;
            if calls {
                step_done()?;
            }
        }
        Ok(size)
    });
    Row {
        tried: report
            .attempts()
            .map(|attempt| attempt.batch_size)
            .collect(),
        found: found.unwrap_or(0),
        attempts: report.len(),
        failures: report.out_of_memory_count(),
    }
}

fn door(workload: Workload, start: usize, door: &str, case: usize) -> Row {
    match door {
        "halving" | "x0.9" => search_once(workload, start, door, false, None, 0),
        "default" => search_once(workload, start, door, false, None, 0),
        "default + step_done" => search_once(workload, start, door, true, None, 0),
        _ => {
            let calls = door.contains("step_done");
            let key = format!("growth table {case} {calls}");
            search_once(workload, start, door, calls, Some(&key), 0);
            search_once(workload, start, door, calls, Some(&key), 1000)
        }
    }
}

/// The growth table: every door on the benchmark's shapes and on shapes written for it
/// ([`Workload::NEW`]), from starts 1.25 to 16¼ times the fit; then the means, for the
/// benchmark's shapes, the new ones, and all.
fn growth_table() {
    const STARTS: [f64; 6] = [1.25, 1.7, 2.5, 4.25, 8.5, 16.25];
    println!("| workload | start | fits | {} |", DOORS.join(" | "));
    println!("|---|---|---|{}", "---|".repeat(DOORS.len()));
    // Per door: (utilisation, worst, runs, failures, cases, below halving, over halving + 3)
    // for the benchmark's shapes [0] and the new ones [1].
    let mut totals = vec![
        [(
            0.0f64,
            f64::INFINITY,
            0usize,
            0usize,
            0usize,
            0usize,
            0usize
        ); 2];
        DOORS.len()
    ];
    let mut case = 0;
    for (set, workloads) in [&Workload::ALL[..], &Workload::NEW[..]]
        .into_iter()
        .enumerate()
    {
        for &workload in workloads {
            let fit = workload.largest_fit(1.0);
            for factor in STARTS {
                let start = ((fit as f64 * factor).round() as usize).max(fit + 1);
                case += 1;
                let rows: Vec<Row> = DOORS
                    .iter()
                    .map(|name| door(workload, start, name, case))
                    .collect();
                let halving = (rows[0].found, rows[0].attempts);
                let cells: Vec<String> = rows
                    .iter()
                    .enumerate()
                    .map(|(column, row)| {
                        let mut cell = format!(
                            "{} in {} ({:.2})",
                            row.found,
                            row.attempts,
                            row.found as f64 / fit as f64
                        );
                        // The door this table is about: the sizes it ran.
                        if column == 3 {
                            cell.push_str(&format!(": {}", shown(&row.tried)));
                        }
                        if row.found < halving.0 {
                            cell.push_str(" **below halving**");
                        }
                        cell
                    })
                    .collect();
                println!(
                    "| {} | {start} | {fit} | {} |",
                    workload.name(),
                    cells.join(" | ")
                );
                for (total, row) in totals.iter_mut().zip(&rows) {
                    let total = &mut total[set];
                    let utilisation = row.found as f64 / fit as f64;
                    total.0 += utilisation;
                    total.1 = total.1.min(utilisation);
                    total.2 += row.attempts;
                    total.3 += row.failures;
                    total.4 += 1;
                    total.5 += usize::from(row.found < halving.0);
                    total.6 += usize::from(row.attempts > halving.1 + 3);
                }
            }
        }
    }
    println!();
    println!("| door | shapes | mean utilisation | worst | mean runs | mean OOM failures | below halving's size | over halving's runs + 3 |");
    println!("|---|---|---|---|---|---|---|---|");
    for (name, total) in DOORS.iter().zip(&totals) {
        let all = (
            total[0].0 + total[1].0,
            total[0].1.min(total[1].1),
            total[0].2 + total[1].2,
            total[0].3 + total[1].3,
            total[0].4 + total[1].4,
            total[0].5 + total[1].5,
            total[0].6 + total[1].6,
        );
        for (shapes, t) in [("benchmark's", total[0]), ("new", total[1]), ("all", all)] {
            let cases = t.4.max(1) as f64;
            println!(
                "| {name} | {shapes} | {:.3} | {:.3} | {:.2} | {:.2} | {} of {} | {} of {} |",
                t.0 / cases,
                t.1,
                t.2 as f64 / cases,
                t.3 as f64 / cases,
                t.5,
                t.4,
                t.6,
                t.4
            );
        }
    }
    println!();
}

/// The attribute with the call from below the fit (a quarter and a half of it, as a user who
/// starts low to be safe does): it grows to the limit, and should not run out of memory on the
/// way. Halving and the default alone stay where they start.
fn below_the_fit_table() {
    const STARTS: [f64; 2] = [0.25, 0.5];
    let mut cases = Vec::new();
    println!("| workload | start | fits | default + step_done |");
    println!("|---|---|---|---|");
    for &workload in Workload::ALL.iter().chain(&Workload::NEW) {
        let fit = workload.largest_fit(1.0);
        for factor in STARTS {
            let start = ((fit as f64 * factor).round() as usize).max(1);
            let row = search_once(workload, start, "default", true, None, 0);
            let utilisation = row.found as f64 / fit as f64;
            println!(
                "| {} | {start} | {fit} | {} in {} ({utilisation:.2}), {} failed: {} |",
                workload.name(),
                row.found,
                row.attempts,
                row.failures,
                shown(&row.tried)
            );
            cases.push((utilisation, row.attempts, row.failures));
        }
    }
    let n = cases.len() as f64;
    println!();
    println!(
        "| door | starts | mean utilisation | worst | mean runs | mean OOM failures | cases |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| default + step_done | 0.25 and 0.5 of the fit | {:.3} | {:.3} | {:.2} | {:.2} | {} |",
        cases.iter().map(|case| case.0).sum::<f64>() / n,
        cases
            .iter()
            .map(|case| case.0)
            .fold(f64::INFINITY, f64::min),
        cases.iter().map(|case| case.1).sum::<usize>() as f64 / n,
        cases.iter().map(|case| case.2).sum::<usize>() as f64 / n,
        cases.len()
    );
    println!();
}

fn main() {
    below_the_fit_table();
    if std::env::args().any(|arg| arg == "--below-only") {
        return;
    }
    growth_table();
    if std::env::args().any(|arg| arg == "--growth-only") {
        return;
    }
    let policies = [
        "halving",
        "x0.9",
        "binsearch",
        "power",
        "guided",
        "guided, text only",
    ];
    let mut totals = vec![
        Totals {
            utilisation: 0.0,
            worst: f64::INFINITY,
            attempts: 0,
            failures: 0,
            cases: 0,
            below_halving: 0,
            over_halving_attempts: 0,
        };
        policies.len()
    ];
    println!(
        "| workload | start | fits | halving | x0.9 | guided (device figures): sizes tried | found | guided (text only): sizes tried | found |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for workload in Workload::ALL {
        let fit = workload.largest_fit(1.0);
        let mut starts: Vec<usize> = [128usize, 256, 512]
            .into_iter()
            .filter(|&start| start > fit)
            .collect();
        starts.extend([fit * 4 + fit / 4, fit * 16 + fit / 4]);
        for start in starts {
            let rows: Vec<Row> = policies
                .iter()
                .map(|policy| run(workload, start, policy))
                .collect();
            let halving = (rows[0].found, rows[0].attempts);
            for (total, row) in totals.iter_mut().zip(&rows) {
                let utilisation = row.found as f64 / fit as f64;
                total.utilisation += utilisation;
                total.worst = total.worst.min(utilisation);
                total.attempts += row.attempts;
                total.failures += row.failures;
                total.cases += 1;
                total.below_halving += usize::from(row.found < halving.0);
                total.over_halving_attempts += usize::from(row.attempts > halving.1 + 2);
            }
            let cell = |row: &Row| {
                let mut cell = format!(
                    "{} in {} ({:.3})",
                    row.found,
                    row.attempts,
                    row.found as f64 / fit as f64
                );
                if row.found < halving.0 {
                    cell.push_str(" **below halving**");
                }
                if row.attempts > halving.1 + 2 {
                    cell.push_str(" **over halving + 2**");
                }
                cell
            };
            println!(
                "| {} | {start} | {fit} | {} in {} | {} in {} | {} | {} | {} | {} |",
                workload.name(),
                rows[0].found,
                rows[0].attempts,
                rows[1].found,
                rows[1].attempts,
                shown(&rows[4].tried),
                cell(&rows[4]),
                shown(&rows[5].tried),
                cell(&rows[5]),
            );
        }
    }
    // The tuner against Lightning's binsearch, once a workload (they start small).
    println!();
    println!(
        "| workload | fits | tuner with figures | tuner without figures | Lightning binsearch | Lightning power | fastest (with figures / without) | rerun with the cache (guided / tuner) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut tuner_totals = [(0.0f64, f64::INFINITY, 0usize); 4];
    let mut fastest_trials = [0usize; 2];
    let mut workloads = 0usize;
    for workload in Workload::ALL {
        let fit = workload.largest_fit(1.0);
        let with = tune(workload, true, Choice::Largest);
        let without = tune(workload, false, Choice::Largest);
        let lightning = run(workload, 2, "binsearch");
        let power = run(workload, 2, "power");
        let fastest = [
            tune(workload, true, Choice::Fastest),
            tune(workload, false, Choice::Fastest),
        ];
        for (total, (_, trials, _, _)) in fastest_trials.iter_mut().zip(&fastest) {
            *total += trials;
        }
        let cells = [
            (with.0, with.1, with.2),
            (without.0, without.1, without.2),
            (lightning.found, lightning.attempts, lightning.failures),
            (power.found, power.attempts, power.failures),
        ];
        let mut shown: Vec<String> = cells
            .iter()
            .map(|(found, trials, failures)| {
                format!(
                    "{found} ({:.3}) in {trials} trials, {failures} OOM",
                    *found as f64 / fit as f64
                )
            })
            .collect();
        shown[0].push_str(&format!(": {}", self::shown(&with.3)));
        let reruns = (cached_rerun(workload, false), cached_rerun(workload, true));
        println!(
            "| {} | {fit} | {} | {} | {} | {} | {} in {} / {} in {} trials | {} / {} attempt(s) |",
            workload.name(),
            shown[0],
            shown[1],
            shown[2],
            shown[3],
            fastest[0].0,
            fastest[0].1,
            fastest[1].0,
            fastest[1].1,
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
    for (name, (sum, worst, trials)) in [
        "with figures",
        "without figures",
        "Lightning binsearch",
        "Lightning power",
    ]
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
    println!(
        "Choice::Fastest (a step of 1 ms up to 64 samples, then in proportion): mean trials {:.2} with figures, {:.2} without",
        fastest_trials[0] as f64 / workloads as f64,
        fastest_trials[1] as f64 / workloads as f64
    );

    println!();
    println!(
        "| policy | mean utilisation | worst | mean attempts | mean OOM failures | cases below halving's size | cases over halving's attempts + 2 |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (policy, total) in policies.iter().zip(totals) {
        let cases = total.cases.max(1) as f64;
        let shown_policy = match *policy {
            "binsearch" | "power" => format!("{policy} (Lightning, from 2)"),
            _ => (*policy).to_owned(),
        };
        println!(
            "| {shown_policy} | {:.3} | {:.3} | {:.2} | {:.2} | {} of {} | {} of {} |",
            total.utilisation / cases,
            total.worst,
            total.attempts as f64 / cases,
            total.failures as f64 / cases,
            total.below_halving,
            total.cases,
            total.over_halving_attempts,
            total.cases
        );
    }
}
