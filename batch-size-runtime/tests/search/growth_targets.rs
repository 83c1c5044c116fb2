//! The attribute's doors on the search benchmark's workloads and on shapes written after the
//! policy (`common/workloads.rs`), from 1.25 to 16¼ times the fit: with `step_done()` after the
//! step, at least 0.95 of the fit on the mean in at most halving's runs + 3; the second run with
//! the cache at least 0.95 in at most 1.3 runs; alone, never below halving's size. Every figure
//! is deterministic (the noisy workload's noise is a function of the attempt's number). From a
//! quarter and a half of the fit, the call grows to it: at least 0.95 on the mean, 0.85 at
//! worst, in at most 4 runs on the mean and with at most 0.1 out-of-memory failures a case.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::cell::Cell;

use batch_size_runtime::policy::Halve;
use batch_size_runtime::{step_done, BatchSizeSearch};

use crate::workloads;

use workloads::{noise, Workload};

const STARTS: [f64; 6] = [1.25, 1.7, 2.5, 4.25, 8.5, 16.25];

/// One search on a fresh device: the size found (0 for none) and the runs of the function.
fn search(
    workload: Workload,
    start: usize,
    halving: bool,
    calls: bool,
    cache: Option<&str>,
    first_attempt: u64,
) -> (usize, usize, usize) {
    let device = workload.device();
    let attempt = Cell::new(first_attempt);
    let mut search = BatchSizeSearch::new(start).with_release(device.clone());
    if halving {
        search = search.with_policy(Halve);
    }
    if let Some(key) = cache {
        search = search.with_cache(key.to_owned());
    }
    let (found, report) = search.run_with_report(|size| -> anyhow::Result<usize> {
        attempt.set(attempt.get() + 1);
        // Six steps a run, the call after each: a short training run.
        for _ in 0..6 {
            workload.step(&device, size as u64, noise(attempt.get() - 1))?;
            if calls {
                step_done()?;
            }
        }
        Ok(size)
    });
    (
        found.unwrap_or(0),
        report.len(),
        report.out_of_memory_count(),
    )
}

#[test]
fn the_doors_reach_their_targets() {
    let mut cases = 0.0;
    let (mut halving_runs, mut grown, mut grown_runs) = (0.0, 0.0, 0.0);
    let (mut rerun, mut rerun_runs) = (0.0, 0.0);
    for workload in Workload::ALL.into_iter().chain(Workload::NEW) {
        let name = workload.name();
        let fit = workload.largest_fit(1.0);
        for (case, factor) in STARTS.into_iter().enumerate() {
            let start = ((fit as f64 * factor).round() as usize).max(fit + 1);
            let halving = search(workload, start, true, false, None, 0);
            let alone = search(workload, start, false, false, None, 0);
            let with_call = search(workload, start, false, true, None, 0);
            let key = format!("growth targets {name} {case}");
            search(workload, start, false, true, Some(&key), 0);
            let second = search(workload, start, false, true, Some(&key), 1000);
            for (door, found) in [("alone", alone.0), ("with the call", with_call.0)] {
                assert!(
                    found >= halving.0,
                    "{name} from {start}, {door}: {found} below halving's {}",
                    halving.0
                );
            }
            cases += 1.0;
            halving_runs += halving.1 as f64;
            grown += with_call.0 as f64 / fit as f64;
            grown_runs += with_call.1 as f64;
            rerun += second.0 as f64 / fit as f64;
            rerun_runs += second.1 as f64;
        }
    }
    let (grown, rerun) = (grown / cases, rerun / cases);
    assert!(
        grown >= 0.95,
        "with the call: {grown:.3} of the fit on the mean"
    );
    assert!(
        grown_runs <= halving_runs + 3.0 * cases,
        "with the call: {:.2} runs, halving {:.2}",
        grown_runs / cases,
        halving_runs / cases
    );
    assert!(rerun >= 0.95, "the cache's second run: {rerun:.3}");
    assert!(
        rerun_runs <= 1.3 * cases,
        "the cache's second run: {:.2} runs",
        rerun_runs / cases
    );
}

/// A user who starts low to be safe: from a quarter and a half of the fit, the measured steps
/// carry the size to the limit (the first step measured proves little where a large fixed part
/// fills the room; a probe a quarter larger separates it), with almost no failure on the way.
#[test]
fn from_below_the_fit_the_call_grows_to_it() {
    let (mut cases, mut utilisation, mut worst, mut runs, mut failures) = (0.0, 0.0, 1.0f64, 0, 0);
    for workload in Workload::ALL.into_iter().chain(Workload::NEW) {
        let fit = workload.largest_fit(1.0);
        for factor in [0.25, 0.5] {
            let start = ((fit as f64 * factor).round() as usize).max(1);
            let (found, ran, failed) = search(workload, start, false, true, None, 0);
            assert!(
                found <= fit && found >= start,
                "{} from {start}: {found}",
                workload.name()
            );
            cases += 1.0;
            utilisation += found as f64 / fit as f64;
            worst = worst.min(found as f64 / fit as f64);
            runs += ran;
            failures += failed;
        }
    }
    let mean = utilisation / cases;
    assert!(mean >= 0.95, "{mean:.3} of the fit on the mean");
    assert!(worst >= 0.85, "{worst:.3} at worst");
    assert!(
        runs as f64 / cases <= 4.0,
        "{:.2} runs",
        runs as f64 / cases
    );
    assert!(
        failures as f64 / cases <= 0.1,
        "{:.2} failures a case",
        failures as f64 / cases
    );
}

/// A user who starts far below to be safe (1/100, 1/20 and 1/10 of the fit): the first steps
/// are measured where the figures are coarse next to the step (whole blocks, noise), so their
/// growths reach a few times further each; such growths do not count against the three that
/// correct a step near its fit, and the call still gets there without a failure.
#[test]
fn from_far_below_the_call_still_reaches_the_fit() {
    let (mut cases, mut utilisation, mut worst, mut failures) = (0.0, 0.0, 1.0f64, 0);
    for workload in Workload::ALL.into_iter().chain(Workload::NEW) {
        let fit = workload.largest_fit(1.0);
        for factor in [0.01, 0.05, 0.1] {
            let start = ((fit as f64 * factor).round() as usize).max(1);
            let (found, _, failed) = search(workload, start, false, true, None, 0);
            let share = found as f64 / fit as f64;
            assert!(
                found <= fit && share >= 0.9,
                "{} from {start}: {found} of {fit}",
                workload.name()
            );
            cases += 1.0;
            utilisation += share;
            worst = worst.min(share);
            failures += failed;
        }
    }
    let mean = utilisation / cases;
    assert!(
        mean >= 0.95,
        "{mean:.3} of the fit on the mean (worst {worst:.3})"
    );
    assert_eq!(failures, 0);
}
