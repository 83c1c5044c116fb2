//! The harness every real-allocator test shares, its framework's included (tch's workspace
//! includes this file too): each scenario runs in a child process (the test binary run again,
//! with `--ignored`, and `REAL_ALLOCATORS_CHILD` set to the scenario's name) under an
//! address-space limit, prints `key=value` lines, and the parent checks them; the largest size
//! that fits is found by bisection, each size in a fresh child. A framework's test file is its
//! step, its release and its scenarios.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test support: failing loudly is the point

use std::process::Command;

use batch_size_runtime::oom::OomKind;
use batch_size_runtime::{Attempt, Outcome, SearchReport};

/// Set in a child: which scenario it runs.
pub const CHILD: &str = "REAL_ALLOCATORS_CHILD";

/// A scenario runs only as the child its framework's test starts (it limits the process's
/// address space): run by hand without its parent, it fails, saying so, rather than pass
/// having done nothing.
pub fn expect_child(scenario: &str) {
    assert_eq!(
        std::env::var(CHILD).as_deref(),
        Ok(scenario),
        "{scenario} is a scenario: its framework's test runs it in a child process"
    );
}

/// Set (by `.ci/run`) where every framework must be tested: a missing library or driver then
/// fails the test instead of skipping it.
pub const REQUIRED: &str = "REAL_ALLOCATORS_REQUIRED";

/// Whether the framework `test` needs is here. Where it is not: a failure under
/// [`REQUIRED`] (CI), otherwise a message that the test was skipped, and `false`.
pub fn available(test: &str, present: bool, missing: &str) -> bool {
    if present {
        return true;
    }
    assert!(
        std::env::var_os(REQUIRED).is_none(),
        "{test}: {missing}, and {REQUIRED} is set: every framework must be tested"
    );
    eprintln!("{test}: skipped, {missing}");
    false
}

#[path = "../../batch-size-runtime/tests/common/address_space.rs"]
mod address_space;

/// Limits the address space to what it is now plus `room`: every child starts from the same
/// room once its framework is warm.
pub fn leave_room(room: u64) {
    address_space::leave_room(room).expect("setrlimit(RLIMIT_AS) failed");
}

/// Runs `scenario` (a test of the current binary) in a child with `extra` in its environment;
/// its stdout's `key=value` lines.
pub fn child(scenario: &str, extra: &[(&str, String)]) -> Vec<(String, String)> {
    let (lines, ok, stderr) = child_status(scenario, extra);
    assert!(ok, "{scenario} failed:\n{lines:?}\n{stderr}");
    lines
}

/// [`child`], also when it fails: its lines, whether it succeeded, and its stderr.
pub fn child_status(
    scenario: &str,
    extra: &[(&str, String)],
) -> (Vec<(String, String)>, bool, String) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            scenario,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, scenario);
    for (key, value) in extra {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let lines = stdout
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .collect();
    (
        lines,
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The value of `key` in a child's lines.
pub fn value(lines: &[(String, String)], key: &str) -> String {
    lines
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in {lines:?}"))
}

/// The policy of a scenario's attribute: the default, or halving where the parent asks
/// (`REAL_ALLOCATORS_POLICY=halving`) to print halving's size beside the default's.
pub fn policy() -> batch_size_runtime::policy::Reduction<'static> {
    if std::env::var("REAL_ALLOCATORS_POLICY").as_deref() == Ok("halving") {
        batch_size_runtime::policy::Reduction::Halve
    } else {
        batch_size_runtime::policy::Reduction::default()
    }
}

/// Runs each `(scenario, label)` in a fresh child, asserts it ran (and, with `quiet`, that it
/// printed no panic: a recovered out-of-memory panic is kept quiet, on any thread) and that
/// the size it found is not above the largest that fits and runs again in a fresh process;
/// prints it against the largest, beside the same search without figures
/// (`REAL_ALLOCATORS_FIGURES=none`: `Release::none()`) for the attribute's `Result` form and
/// the tuner, and beside halving's run (`REAL_ALLOCATORS_POLICY=halving`) for the attribute's
/// forms. A scenario named in `at_least` must find at least that share of the largest.
pub fn compare_with_the_largest(
    framework: &str,
    scenarios: &[(&str, &str)],
    largest: usize,
    fits: impl Fn(usize) -> bool,
    quiet: bool,
    at_least: &[(&str, f64)],
) {
    for &(scenario, label) in scenarios {
        let (lines, ran, stderr) = child_status(scenario, &[]);
        assert!(ran, "{scenario} failed:\n{lines:?}\n{stderr}");
        assert!(
            !quiet || !stderr.contains("panicked"),
            "{scenario} printed a panic:\n{stderr}"
        );
        let found: usize = value(&lines, &format!("{label}.found")).parse().unwrap();
        let attempts = value(&lines, &format!("{label}.attempts"));
        let out_of_memory = value_if_any(&lines, &format!("{label}.out_of_memory"))
            .map_or_else(String::new, |count| format!(", {count} out of memory"));
        assert_fits(scenario, found, largest, &fits);
        let share = |size: usize| size as f64 / largest as f64;
        let mut beside = String::new();
        if scenario == "attribute_result" || scenario == "tuner" {
            let lines = child(scenario, &[("REAL_ALLOCATORS_FIGURES", "none".to_owned())]);
            let found: usize = value(&lines, &format!("{label}.found")).parse().unwrap();
            beside.push_str(&format!(
                "; without figures {found} ({:.3}) in {} attempts",
                share(found),
                value(&lines, &format!("{label}.attempts"))
            ));
        }
        if scenario.starts_with("attribute") {
            let lines = child(
                scenario,
                &[("REAL_ALLOCATORS_POLICY", "halving".to_owned())],
            );
            let found: usize = value(&lines, &format!("{label}.found")).parse().unwrap();
            beside.push_str(&format!(
                "; halving {found} ({:.3}) in {} attempts",
                share(found),
                value(&lines, &format!("{label}.attempts"))
            ));
        }
        println!(
            "{framework} {scenario}: found {found} of {largest} ({:.3}) in {attempts} attempts{out_of_memory}{beside}; error: {}",
            share(found),
            value_if_any(&lines, &format!("{label}.error"))
                .unwrap_or_else(|| "none: no trial ran out of memory".to_owned())
        );
        if let Some(&(_, least)) = at_least.iter().find(|(name, _)| *name == scenario) {
            assert!(
                share(found) >= least,
                "{framework} {scenario}: {found} of {largest} ({:.3}), below {least}",
                share(found)
            );
        }
    }
}

/// The tuner's out-of-memory trials, where it had any: each recognised, its memory back. A
/// tuner that found the size from the figures without failing has none to check (the
/// attribute's and the chunks' scenarios check recognition).
pub fn check_tuner_failures(report: &SearchReport, memory_back: impl Fn(&Attempt)) {
    if std::env::var("REAL_ALLOCATORS_FIGURES").is_err() && report.out_of_memory_count() > 0 {
        check_failures(report, memory_back);
    }
}

/// Whether `size` runs in a fresh child (the test binary's `one_size` scenario).
pub fn fits_in_a_fresh_process(size: usize) -> bool {
    child_status("one_size", &[("REAL_ALLOCATORS_SIZE", size.to_string())]).1
}

/// The size the `one_size` scenario runs, as the parent asked (`REAL_ALLOCATORS_SIZE`).
pub fn one_size_requested() -> usize {
    std::env::var("REAL_ALLOCATORS_SIZE")
        .unwrap()
        .parse()
        .unwrap()
}

/// The value of `key` in a child's lines, where it printed one.
pub fn value_if_any(lines: &[(String, String)], key: &str) -> Option<String> {
    lines.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// The largest size in `1..=high` that runs in a fresh child (`one_size` scenario with
/// `REAL_ALLOCATORS_SIZE`), by bisection; `fits(size)` says whether one child ran.
pub fn largest_that_fits(high: usize, fits: impl Fn(usize) -> bool) -> usize {
    let (mut ran, mut failed) = (0, high + 1);
    while failed - ran > 1 {
        let size = ran + (failed - ran) / 2;
        if fits(size) {
            ran = size;
        } else {
            failed = size;
        }
    }
    ran
}

/// The size a search found runs in a fresh process, and is not above the largest that fits
/// there, within 2 %: a fresh process's limit varies by a MiB or so between runs (the threads
/// and mappings a framework starts after the limit is set), which near the edge is a sample or
/// two.
pub fn assert_fits(scenario: &str, found: usize, largest: usize, fits: impl Fn(usize) -> bool) {
    assert!(
        found <= largest + largest / 50,
        "{scenario}: {found} above the largest that fits, {largest}"
    );
    assert!(
        fits(found),
        "{scenario}: {found} does not run in a fresh process"
    );
}

/// Every out-of-memory attempt of `report`: recognised by the crate's own table (no rule), and
/// what `memory_back` says of its figures after the release.
pub fn check_failures(report: &SearchReport, memory_back: impl Fn(&Attempt)) -> usize {
    let failures: Vec<&Attempt> = report
        .attempts()
        .filter(|a| a.outcome.is_out_of_memory())
        .collect();
    assert!(
        !failures.is_empty(),
        "nothing ran out of memory: {report:?}"
    );
    for failed in &failures {
        let Outcome::OutOfMemory { error } = &failed.outcome else {
            unreachable!()
        };
        assert!(!error.is_empty(), "{failed:?}");
        memory_back(failed);
    }
    // No rule was added in these processes: every match is the crate's own.
    assert!(!matches!(
        batch_size_runtime::oom::classify_text("x"),
        Some(found) if found.kind == OomKind::Rule
    ));
    failures.len()
}

/// The line a scenario prints about its search: size found, attempts, and each failure's text.
pub fn print_search(label: &str, found: usize, report: &SearchReport) {
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{label}: {} {:?} ({:?}) start {:?} end {:?} after {:?}",
                attempt.batch_size,
                attempt.outcome,
                attempt.rationale,
                attempt.memory_at_start,
                attempt.memory_at_end,
                attempt.memory_after_release
            );
        }
    }
    println!("\n{label}.found={found}");
    println!("{label}.attempts={}", report.attempts().count());
    println!("{label}.out_of_memory={}", report.out_of_memory_count());
    if let Some(Outcome::OutOfMemory { error }) = report
        .attempts()
        .map(|a| &a.outcome)
        .find(|o| o.is_out_of_memory())
    {
        println!("{label}.error={error}");
    }
}

/// Bytes reserved but unallocated in the first device of a snapshot, where the backend says.
pub fn reserved_unallocated(snapshot: &batch_size_runtime::memory::MemorySnapshot) -> Option<u64> {
    let device = snapshot.devices.first()?;
    Some(device.pool_reserved?.saturating_sub(device.pool_used?))
}
