//! The remedies' contract on a second cost model (a step whose memory checkpointing
//! quarters and bf16 halves): applied only after `min` fails, in the declared order, nothing
//! undeclared changed, knobs never below their floor, sizes known to fail under the same
//! settings never retried, the settings in the result, the report and the cache, with
//! `EffectiveBatch` too, and an error naming every remedy when none helps. A non-OOM error and
//! invalid remedies are covered in `remedies.rs`, with the proptest.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{
    last_report, memory::SimulatedDevice, policy, remedies::Remedied, remedies::Remedies,
    remedies::Remedy, BatchSizeSearch, EffectiveBatch, NoExecutableBatchSize, StopReason,
};

#[derive(Debug, Clone, PartialEq)]
struct Settings {
    checkpointing: bool,
    bf16: bool,
    context: usize,
    /// Never declared: must never change.
    seed: u64,
    dataset: String,
}

fn base() -> Settings {
    Settings {
        checkpointing: false,
        bf16: false,
        context: 4096,
        seed: 42,
        dataset: "shards/*.bin".to_owned(),
    }
}

fn ladder() -> Remedies<Settings> {
    Remedies::new(base())
        .then(Remedy::switch("checkpointing", |s: &mut Settings| {
            s.checkpointing = true
        }))
        .then(Remedy::switch("bf16", |s: &mut Settings| s.bf16 = true))
        .then(
            Remedy::knob(
                "context",
                |s: &Settings| s.context,
                |s: &mut Settings, v| s.context = v,
            )
            .with_floor(1024),
        )
}

/// Bytes one attempt needs: a fixed 1 GiB, then per token 256 KiB, a quarter with
/// checkpointing, half in bf16.
fn needed(attempt: &Remedied<Settings>) -> u64 {
    let s = attempt.settings();
    let mut per_token: u64 = 256 << 10;
    if s.checkpointing {
        per_token /= 4;
    }
    if s.bf16 {
        per_token /= 2;
    }
    (1 << 30) + per_token * (attempt.batch_size() * s.context) as u64
}

/// Runs the search on a device of `capacity` bytes, recording every attempt.
fn search(
    capacity: u64,
    remedies: &Remedies<Settings>,
    min: usize,
    seen: &mut Vec<Remedied<Settings>>,
) -> anyhow::Result<((), Remedied<Settings>)> {
    let device = SimulatedDevice::new(capacity);
    BatchSizeSearch::new(16)
        .with_min(min)
        .with_release(device.clone())
        .with_remedies(remedies)
        .run(|attempt| {
            seen.push(attempt.clone());
            let _memory = device.alloc(needed(&attempt))?;
            Ok::<_, anyhow::Error>(())
        })
}

#[test]
fn a_remedy_comes_only_after_min_failed_and_in_the_declared_order() {
    let remedies = ladder();
    let mut seen = Vec::new();
    // 4 samples of 4096 tokens need 1 + 4 GiB as configured, 1 + 1 GiB with checkpointing and
    // 1 + 0.5 GiB with bf16 too: 1.7 GiB holds 4 only with both.
    let ((), ran) = search(1_740 << 20, &remedies, 4, &mut seen).unwrap();
    assert_eq!(ran.applied(), ["checkpointing", "bf16"]);
    // Settings change only right after an attempt at `min` ran out of memory.
    for pair in seen.windows(2) {
        if pair[0].applied() != pair[1].applied() {
            assert_eq!(pair[0].batch_size(), 4, "{seen:?}");
            // ... and the search starts again from `starting`.
            assert_eq!(pair[1].batch_size(), 16);
        }
    }
    let orders: Vec<&[String]> = seen.iter().map(|a| a.applied()).collect();
    let mut distinct: Vec<&[String]> = orders.clone();
    distinct.dedup();
    assert_eq!(
        distinct,
        [
            &[][..],
            &["checkpointing".to_owned()][..],
            &["checkpointing".to_owned(), "bf16".to_owned()][..]
        ]
    );
    // Nothing undeclared changed; the context was never needed.
    for attempt in &seen {
        assert_eq!(attempt.settings().seed, 42);
        assert_eq!(attempt.settings().dataset, "shards/*.bin");
        assert_eq!(attempt.settings().context, 4096);
    }
    // The report has the same settings on every attempt.
    let report = last_report().unwrap();
    let recorded: Vec<Option<String>> = report.attempts().map(|a| a.remedies.clone()).collect();
    assert_eq!(recorded.first().unwrap(), &None);
    assert_eq!(
        recorded.last().unwrap().as_deref(),
        Some("checkpointing, bf16")
    );
    assert_eq!(remedies.settings(), ran.settings().clone());
}

#[test]
fn sizes_known_to_fail_under_the_same_settings_are_not_retried() {
    let remedies = ladder();
    let mut seen = Vec::new();
    let _ = search(1_600 << 20, &remedies, 1, &mut seen);
    let mut group_start = 0;
    for index in 1..=seen.len() {
        let group_ends =
            index == seen.len() || seen[index].applied() != seen[group_start].applied();
        if !group_ends {
            continue;
        }
        let group = &seen[group_start..index];
        let sizes: Vec<usize> = group.iter().map(|a| a.batch_size()).collect();
        // Strictly decreasing within one settings: no size at or above one that failed.
        assert!(sizes.windows(2).all(|w| w[1] < w[0]), "{sizes:?}");
        group_start = index;
    }
}

#[test]
fn a_knob_never_goes_below_its_floor_and_the_error_names_every_remedy() {
    let remedies = ladder();
    let mut seen = Vec::new();
    // 1 GiB fixed on a 1 GiB device: nothing ever fits.
    let error = search(1 << 30, &remedies, 1, &mut seen).unwrap_err();
    let contexts: Vec<usize> = seen.iter().map(|a| a.settings().context).collect();
    assert!(contexts.iter().all(|&c| c >= 1024), "{contexts:?}");
    assert!(contexts.contains(&2048) && contexts.contains(&1024));
    let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    let StopReason::NoRemedyLeft { applied, .. } = none_fit.reason() else {
        panic!("{:?}", none_fit.reason());
    };
    let names: Vec<&str> = applied
        .iter()
        .map(|line| line.split(" (").next().unwrap())
        .collect();
    assert_eq!(
        names,
        ["checkpointing", "bf16", "context 2048", "context 1024"]
    );
    let message = none_fit.to_string();
    for name in ["checkpointing", "bf16", "context 2048", "context 1024"] {
        assert!(message.contains(name), "{message}");
    }
    assert!(message.contains("ran out of memory"), "{message}");
}

#[test]
fn the_cache_restores_the_settings_with_the_size() {
    // The process's cache is shared with `remedies`' tests, in this binary.
    let _one = crate::remedies::cache_lock();
    policy::clear_process_cache();
    let device = SimulatedDevice::new(1_740 << 20);
    let run = |remedies: &Remedies<Settings>| {
        BatchSizeSearch::new(16)
            .with_min(4)
            .with_release(device.clone())
            .with_cache("remedies contract cache")
            .with_remedies(remedies)
            .run(|attempt| {
                let _memory = device.alloc(needed(&attempt))?;
                Ok::<_, anyhow::Error>(attempt.batch_size())
            })
    };
    let (first, _) = run(&ladder()).unwrap();
    let rerun = ladder();
    let (again, ran) = run(&rerun).unwrap();
    assert_eq!(again, first);
    assert_eq!(ran.applied(), ["checkpointing", "bf16"]);
    assert_eq!(rerun.applied(), ["checkpointing", "bf16"]);
    let report = last_report().unwrap();
    assert_eq!(report.len(), 1, "{report}");
}

#[test]
fn effective_batch_reaches_min_micro_first_then_the_remedies() {
    let remedies = ladder();
    let device = SimulatedDevice::new(1_300 << 20);
    let mut runner = EffectiveBatch::new(64)
        .with_micro(16)
        .with_min(2)
        .with_release(device.clone())
        .with_remedies(&remedies);
    let mut micro_sizes = Vec::new();
    for _ in 0..3 {
        runner
            .step(|plan| -> anyhow::Result<()> {
                let settings = remedies.settings();
                micro_sizes.push((plan.micro(), remedies.applied()));
                let attempt = remedies.attempt(plan.micro());
                let _memory = device.alloc(needed(&attempt))?;
                assert_eq!(
                    plan.micro_batches().map(|m| m.range.len()).sum::<usize>(),
                    64
                );
                assert_eq!(settings.seed, 42);
                Ok(())
            })
            .unwrap();
    }
    // Without remedies the micro-batch went down to 2 before the first remedy.
    let first_remedied = micro_sizes
        .iter()
        .position(|(_, applied)| !applied.is_empty())
        .unwrap();
    assert_eq!(micro_sizes[first_remedied - 1], (2, vec![]));
    // What was applied stays for the later steps, which run at the size found.
    assert!(!remedies.applied().is_empty());
    assert!(runner.micro() >= 2);
    assert_eq!(runner.steps(), 3);
}

#[test]
fn a_switch_whose_estimated_saving_cannot_close_the_gap_gets_no_trial_of_its_own() {
    let remedies = Remedies::new(base())
        .then(
            Remedy::switch("checkpointing", |s: &mut Settings| s.checkpointing = true)
                .with_saving(0.05),
        )
        .then(Remedy::switch("bf16", |s: &mut Settings| s.bf16 = true));
    let mut seen = Vec::new();
    let ((), ran) = search(1_740 << 20, &remedies, 4, &mut seen).unwrap();
    assert_eq!(ran.applied(), ["checkpointing", "bf16"]);
    // No attempt ran with checkpointing alone: 5 % of 5 GiB cannot close a gap of 3.3 GiB.
    assert!(
        seen.iter().all(|a| a.applied() != ["checkpointing"]),
        "{seen:?}"
    );
    let report = last_report().unwrap();
    let restart = report.attempts().find(|a| a.remedies.is_some()).unwrap();
    assert!(
        restart
            .rationale
            .as_deref()
            .unwrap_or_default()
            .contains("checkpointing and bf16"),
        "{restart:?}"
    );
    // The last remedy always gets a trial, whatever its estimate.
    let last_only = Remedies::new(base()).then(
        Remedy::switch("checkpointing", |s: &mut Settings| s.checkpointing = true)
            .with_saving(0.01),
    );
    let mut seen = Vec::new();
    let _ = search(1_740 << 20, &last_only, 4, &mut seen);
    assert!(seen.iter().any(|a| a.applied() == ["checkpointing"]));
}
