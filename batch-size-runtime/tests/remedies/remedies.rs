//! Remedies, from the outside: when even `min` runs out of memory the search applies the next
//! declared remedy (a switch, or a knob lowered a step towards its floor) and searches the batch
//! size again from `starting`. Each test names one contract; the last one checks them together
//! over random devices and ladders.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::{Mutex, MutexGuard};

use batch_size_runtime::agree::ThreadRanks;
use batch_size_runtime::{
    last_report, memory::SimulatedDevice, policy, remedies::Remedied, remedies::Remedies,
    remedies::Remedy, Attempt, BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, SearchReport,
    StopReason,
};
use proptest::prelude::*;

use crate::warnings;
use warnings::Warnings;

/// A training run's settings: three the remedies may change, three they must never touch.
#[derive(Debug, Clone, PartialEq)]
struct Config {
    checkpointing: bool,
    bf16: bool,
    eight_bit_adam: bool,
    context: usize,
    seed: u64,
    run_name: String,
    layers: usize,
}

fn config() -> Config {
    Config {
        checkpointing: false,
        bf16: false,
        eight_bit_adam: false,
        context: 4096,
        seed: 1234,
        run_name: "gpt2-medium".to_owned(),
        layers: 24,
    }
}

fn checkpointing() -> Remedy<Config> {
    Remedy::switch("activation checkpointing", |c: &mut Config| {
        c.checkpointing = true
    })
}

fn bf16() -> Remedy<Config> {
    Remedy::switch("bf16", |c: &mut Config| c.bf16 = true)
}

fn eight_bit_adam() -> Remedy<Config> {
    Remedy::switch("8-bit adam", |c: &mut Config| c.eight_bit_adam = true)
}

fn context() -> Remedy<Config> {
    Remedy::knob(
        "context length",
        |c: &Config| c.context,
        |c: &mut Config, v| c.context = v,
    )
}

fn oom() -> anyhow::Error {
    OutOfMemory::new().into()
}

fn attempts(report: &SearchReport) -> Vec<Attempt> {
    report.attempts().cloned().collect()
}

/// The attempts cut where their settings change (consecutive attempts under the same settings).
fn groups(attempts: &[Attempt]) -> Vec<Vec<Attempt>> {
    let mut groups: Vec<Vec<Attempt>> = Vec::new();
    for attempt in attempts {
        match groups.last_mut() {
            Some(group) if group[0].remedies == attempt.remedies => group.push(attempt.clone()),
            _ => groups.push(vec![attempt.clone()]),
        }
    }
    groups
}

fn no_size(error: &anyhow::Error) -> &NoExecutableBatchSize {
    error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap_or_else(|| panic!("not NoExecutableBatchSize: {error:#}"))
}

/// The tests that use the process's cache: one at a time.
pub(crate) fn cache_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn a_remedy_is_applied_only_after_min_ran_out_of_memory() {
    let remedies = Remedies::new(config()).then(checkpointing());
    let mut seen = Vec::new();
    let (size, ran) = BatchSizeSearch::new(32)
        .with_min(4)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            seen.push((attempt.batch_size(), attempt.settings().checkpointing));
            if !attempt.settings().checkpointing || attempt.batch_size() > 8 {
                return Err(oom());
            }
            Ok(attempt.batch_size())
        })
        .unwrap();
    assert_eq!((size, ran.batch_size()), (8, 8));

    let attempts = attempts(&last_report().unwrap());
    let first_remedied = attempts
        .iter()
        .position(|attempt| attempt.remedies.is_some())
        .expect("a remedy was applied");
    let before = &attempts[..first_remedied];
    assert_eq!(
        before.iter().map(|a| a.batch_size).collect::<Vec<_>>(),
        [32, 16, 8, 4],
        "the batch size goes down to min before any remedy"
    );
    assert!(before.iter().all(|a| a.outcome.is_out_of_memory()));
    assert!(before.iter().all(|a| a.remedies.is_none()));
    assert!(attempts[first_remedied..]
        .iter()
        .all(|a| a.remedies.as_deref() == Some("activation checkpointing")));
    // What the function saw agrees with the record.
    assert_eq!(
        seen,
        [
            (32, false),
            (16, false),
            (8, false),
            (4, false),
            (32, true),
            (16, true),
            (8, true)
        ]
    );
}

#[test]
fn remedies_are_applied_in_the_declared_order() {
    // Declared neither in the order of the fields nor alphabetically.
    let remedies = Remedies::new(config())
        .then(bf16())
        .then(eight_bit_adam())
        .then(checkpointing());
    let mut changes: Vec<(bool, bool, bool)> = Vec::new();
    let (_, ran) = BatchSizeSearch::new(4)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            let c = attempt.settings();
            let now = (c.bf16, c.eight_bit_adam, c.checkpointing);
            if changes.last() != Some(&now) {
                changes.push(now);
            }
            if !(c.bf16 && c.eight_bit_adam && c.checkpointing) {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(
        changes,
        [
            (false, false, false),
            (true, false, false),
            (true, true, false),
            (true, true, true)
        ]
    );
    let settings: Vec<Option<String>> = groups(&attempts(&last_report().unwrap()))
        .iter()
        .map(|group| group[0].remedies.clone())
        .collect();
    assert_eq!(
        settings,
        [
            None,
            Some("bf16".to_owned()),
            Some("bf16, 8-bit adam".to_owned()),
            Some("bf16, 8-bit adam, activation checkpointing".to_owned())
        ]
    );
    assert_eq!(
        ran.applied(),
        ["bf16", "8-bit adam", "activation checkpointing"]
    );
}

#[test]
fn settings_that_were_not_declared_are_never_touched() {
    let remedies = Remedies::new(config())
        .then(checkpointing())
        .then(context().with_floor(1024));
    let mut seen = Vec::new();
    let (_, ran) = BatchSizeSearch::new(8)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            seen.push(attempt.settings().clone());
            // Fits only once the context is down to 1024, at batch size 1.
            if attempt.settings().context > 1024 || attempt.batch_size() > 1 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert!(seen.len() > 8, "{seen:?}");
    for settings in seen.iter().chain([ran.settings(), &remedies.settings()]) {
        assert_eq!(
            (
                settings.seed,
                settings.run_name.as_str(),
                settings.layers,
                settings.bf16,
                settings.eight_bit_adam
            ),
            (1234, "gpt2-medium", 24, false, false),
            "{settings:?}"
        );
    }
    assert_eq!(
        (ran.settings().checkpointing, ran.settings().context),
        (true, 1024)
    );
}

/// The contexts one search saw, in order, each once, when nothing ever fits.
fn contexts_when_nothing_fits(knob: Remedy<Config>) -> (Vec<usize>, StopReason) {
    let remedies = Remedies::new(config()).then(knob);
    let mut contexts: Vec<usize> = Vec::new();
    let error = BatchSizeSearch::new(4)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| -> anyhow::Result<()> {
            if contexts.last() != Some(&attempt.settings().context) {
                contexts.push(attempt.settings().context);
            }
            Err(oom())
        })
        .unwrap_err();
    (contexts, no_size(&error).reason().clone())
}

#[test]
fn a_knob_is_lowered_step_by_step_and_never_below_its_floor() {
    let (contexts, reason) = contexts_when_nothing_fits(context().with_floor(512));
    assert_eq!(contexts, [4096, 2048, 1024, 512]);
    assert!(
        matches!(&reason, StopReason::NoRemedyLeft { applied, .. } if applied.len() == 3),
        "{reason:?}"
    );

    let (contexts, _) = contexts_when_nothing_fits(context().with_floor(512).with_factor(0.75));
    assert_eq!(
        contexts,
        [4096, 3072, 2304, 1728, 1296, 972, 729, 546, 512],
        "each step the last times 0.75, the floor last"
    );
    assert!(contexts.iter().all(|&context| context >= 512));

    // A floor between two steps: the step that would cross it stops at it.
    let (contexts, _) = contexts_when_nothing_fits(context().with_floor(1500));
    assert_eq!(contexts, [4096, 2048, 1500]);
}

#[test]
fn a_knob_already_at_its_floor_is_passed_over() {
    let remedies = Remedies::new(config())
        .then(context().with_floor(4096))
        .then(bf16());
    let mut contexts = Vec::new();
    let (_, ran) = BatchSizeSearch::new(2)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            contexts.push(attempt.settings().context);
            if !attempt.settings().bf16 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert!(contexts.iter().all(|&context| context == 4096));
    assert_eq!(ran.applied(), ["bf16"]);
}

/// Runs a search over a device where the memory of one attempt depends on checkpointing and the
/// context, and checks the report: within each group of attempts under the same settings, no
/// size at or above one that failed under them; each group after the first from `starting`.
fn no_size_retried_under_the_same_settings(with_figures: bool) {
    let device = SimulatedDevice::new(1000);
    let remedies = Remedies::new(config())
        .then(checkpointing())
        .then(context().with_floor(1024));
    let bytes = |c: &Config, size: usize| -> u64 {
        let per_sample = if c.checkpointing { 100 } else { 400 } * c.context as u64 / 1024;
        100 + per_sample * size as u64
    };
    let search = BatchSizeSearch::new(64).with_min(4);
    let search = if with_figures {
        search.with_release(device.clone())
    } else {
        search
    };
    let (_, ran) = search
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            let needed = bytes(attempt.settings(), attempt.batch_size());
            if with_figures {
                let _weights = device.alloc(100)?;
                let _activations = device.alloc(needed - 100)?;
            } else if needed > 1000 {
                return Err(oom());
            }
            Ok::<_, anyhow::Error>(())
        })
        .unwrap();
    assert!(bytes(ran.settings(), ran.batch_size()) <= 1000);
    let attempts = attempts(&last_report().unwrap());
    let groups = groups(&attempts);
    assert_eq!(
        groups
            .iter()
            .map(|group| group[0].remedies.clone())
            .collect::<Vec<_>>(),
        [
            None,
            Some("activation checkpointing".to_owned()),
            Some("activation checkpointing, context length 2048".to_owned())
        ],
        "{attempts:#?}"
    );
    for (index, group) in groups.iter().enumerate() {
        if index > 0 {
            assert_eq!(group[0].batch_size, 64, "after a remedy: from starting");
        }
        let mut smallest_failed = usize::MAX;
        for attempt in group {
            assert!(
                attempt.batch_size < smallest_failed,
                "{} tried again under {:?} after {smallest_failed} failed",
                attempt.batch_size,
                attempt.remedies
            );
            assert!(attempt.batch_size >= 4);
            if attempt.outcome.is_out_of_memory() {
                smallest_failed = smallest_failed.min(attempt.batch_size);
            }
        }
    }
    // Each remedy came after `min` failed under the settings before it.
    for group in &groups[..groups.len() - 1] {
        let last = group.last().unwrap();
        assert!(last.batch_size == 4 && last.outcome.is_out_of_memory());
    }
}

#[test]
fn no_size_is_retried_under_the_same_settings_and_a_remedy_restarts_from_starting() {
    no_size_retried_under_the_same_settings(false);
}

#[test]
fn no_size_is_retried_under_the_same_settings_with_the_devices_figures() {
    no_size_retried_under_the_same_settings(true);
}

#[test]
fn the_result_the_report_and_the_remedies_carry_the_settings() {
    let remedies = Remedies::new(config())
        .then(checkpointing())
        .then(context().with_floor(512));
    assert!(remedies.applied().is_empty());
    let (value, ran) = BatchSizeSearch::new(16)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| {
            let c = attempt.settings();
            if !c.checkpointing || c.context > 2048 || attempt.batch_size() > 4 {
                return Err(oom());
            }
            Ok(format!(
                "trained at {} with {}",
                attempt.batch_size(),
                c.context
            ))
        })
        .unwrap();
    assert_eq!(value, "trained at 4 with 2048");
    assert_eq!(ran.batch_size(), 4);
    assert_eq!(
        ran.applied(),
        ["activation checkpointing", "context length 2048"]
    );
    assert!(ran.settings().checkpointing && ran.settings().context == 2048);

    let report = last_report().unwrap();
    assert_eq!(report.batch_size(), Some(4));
    let last = report.last().unwrap();
    assert!(last.outcome.is_success());
    assert_eq!(
        last.remedies.as_deref(),
        Some("activation checkpointing, context length 2048")
    );

    assert_eq!(remedies.settings(), ran.settings().clone());
    assert_eq!(remedies.applied(), ran.applied());
    // A clone is the same state; the next search starts with the remedies in force.
    let again = remedies.clone();
    let (_, rerun) = BatchSizeSearch::new(4)
        .with_remedies(&again)
        .run(|attempt: Remedied<Config>| Ok::<_, anyhow::Error>(attempt.settings().context))
        .unwrap();
    assert_eq!(rerun.settings().context, 2048);
    assert_eq!(
        last_report().unwrap().last().unwrap().remedies.as_deref(),
        Some("activation checkpointing, context length 2048")
    );
}

#[test]
fn the_cache_restores_the_settings_with_the_size() {
    let _one = cache_lock();
    policy::clear_process_cache();
    let key = format!("remedies-test-cache-restores-{}", std::process::id());
    let train = |remedies: &Remedies<Config>| {
        BatchSizeSearch::new(16)
            .with_cache(key.as_str())
            .with_remedies(remedies)
            .run(|attempt: Remedied<Config>| {
                let c = attempt.settings();
                if !c.checkpointing || c.context > 1024 || attempt.batch_size() > 8 {
                    return Err(oom());
                }
                Ok(attempt.batch_size())
            })
            .unwrap()
    };
    let fresh = || {
        Remedies::new(config())
            .then(checkpointing())
            .then(context().with_floor(256))
    };

    let (size, first) = train(&fresh());
    assert_eq!(size, 8);
    assert!(last_report().unwrap().len() > 1);

    let remedies = fresh();
    let (size, second) = train(&remedies);
    assert_eq!(size, 8);
    let report = last_report().unwrap();
    assert_eq!(report.len(), 1, "one attempt, from the cache");
    let only = report.last().unwrap();
    assert!(only.outcome.is_success());
    assert_eq!(only.batch_size, 8);
    assert_eq!(
        only.remedies.as_deref(),
        Some("activation checkpointing, context length 1024")
    );
    assert_eq!(second.settings(), first.settings());
    assert_eq!(second.applied(), first.applied());
    assert_eq!(remedies.applied(), first.applied());
}

#[test]
fn when_no_remedy_helps_the_error_names_every_remedy_applied() {
    let remedies = Remedies::new(config())
        .then(checkpointing())
        .then(bf16())
        .then(context().with_floor(1024));
    let mut calls = 0;
    let error = BatchSizeSearch::new(8)
        .with_remedies(&remedies)
        .run(|_: Remedied<Config>| -> anyhow::Result<()> {
            calls += 1;
            Err(oom())
        })
        .unwrap_err();
    let error = no_size(&error);
    let StopReason::NoRemedyLeft { last, applied } = error.reason() else {
        panic!("{:?}", error.reason());
    };
    assert!(
        !matches!(**last, StopReason::NoRemedyLeft { .. }),
        "{last:?}"
    );
    let expected = [
        "activation checkpointing",
        "bf16",
        "context length 2048",
        "context length 1024",
    ];
    assert_eq!(applied.len(), expected.len(), "{applied:?}");
    for (entry, what) in applied.iter().zip(expected) {
        assert!(entry.starts_with(what), "{entry} for {what}");
        assert!(entry.contains("ran out of memory"), "{entry}");
    }
    let said = error.reason().to_string();
    for name in ["activation checkpointing", "bf16", "context length"] {
        assert!(said.contains(name), "{said}");
    }
    // Five settings, each searched from 8 down to 1.
    assert_eq!(calls, 20);
    assert_eq!(error.tried().len(), 20);
    assert_eq!(
        remedies.applied(),
        ["activation checkpointing", "bf16", "context length 1024"]
    );
}

#[test]
fn an_error_that_is_not_out_of_memory_after_a_remedy_comes_back_unchanged() {
    #[derive(Debug, thiserror::Error)]
    enum TrainError {
        #[error(transparent)]
        Memory(#[from] OutOfMemory),
        #[error("corrupt shard {0}")]
        Data(u32),
        #[error(transparent)]
        NoBatchSize(#[from] NoExecutableBatchSize),
    }
    let remedies = Remedies::new(config()).then(checkpointing()).then(bf16());
    let mut calls = 0;
    let error = BatchSizeSearch::new(4)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| -> Result<(), TrainError> {
            calls += 1;
            if !attempt.settings().checkpointing {
                return Err(OutOfMemory::new().into());
            }
            Err(TrainError::Data(7))
        })
        .unwrap_err();
    assert!(matches!(error, TrainError::Data(7)), "{error:?}");
    assert_eq!(calls, 4, "4, 2, 1, then 4 with checkpointing, and no more");
    let report = last_report().unwrap();
    let last = report.last().unwrap();
    assert!(
        matches!(&last.outcome, batch_size_runtime::Outcome::Failed { error } if error == "corrupt shard 7")
    );
    assert_eq!(last.remedies.as_deref(), Some("activation checkpointing"));
    assert_eq!(remedies.applied(), ["activation checkpointing"]);
}

/// A search on a 1000-byte device where 200 bytes are held and one sample takes 1000, less
/// with the remedies: "fused kernels" (said to save `saving`, saving half), then activation
/// checkpointing (a tenth). The settings of each attempt, the result and the WARNs.
fn with_saving(saving: f64) -> (Vec<Option<String>>, Vec<String>, Vec<String>) {
    #[derive(Debug, Clone)]
    struct Cost {
        fused: bool,
        checkpointing: bool,
    }
    let device = SimulatedDevice::new(1000);
    let remedies = Remedies::new(Cost {
        fused: false,
        checkpointing: false,
    })
    .then(Remedy::switch("fused kernels", |c: &mut Cost| c.fused = true).with_saving(saving))
    .then(Remedy::switch(
        "activation checkpointing",
        |c: &mut Cost| c.checkpointing = true,
    ));
    let warnings = Warnings::default();
    let (_, ran) = tracing::subscriber::with_default(warnings.clone(), || {
        BatchSizeSearch::new(2)
            .with_release(device.clone())
            .with_remedies(&remedies)
            .run(|attempt: Remedied<Cost>| {
                let c = attempt.settings();
                let mut per_sample = 1000;
                if c.fused {
                    per_sample /= 2;
                }
                if c.checkpointing {
                    per_sample /= 10;
                }
                let _weights = device.alloc(200)?;
                let _activations = device.alloc(per_sample * attempt.batch_size() as u64)?;
                Ok::<_, anyhow::Error>(())
            })
            .unwrap()
    });
    let settings = attempts(&last_report().unwrap())
        .into_iter()
        .map(|attempt| attempt.remedies)
        .collect();
    (settings, ran.applied().to_vec(), warnings.all())
}

#[test]
fn a_switch_that_cannot_close_the_gap_is_applied_without_a_trial_of_its_own() {
    // 5 % of the 1200 bytes the attempt needed is 60, short of the 200 over the device.
    let (settings, applied, warnings) = with_saving(0.05);
    assert!(
        !settings
            .iter()
            .any(|settings| settings.as_deref() == Some("fused kernels")),
        "{settings:?}"
    );
    assert!(settings
        .iter()
        .any(|settings| settings.as_deref() == Some("fused kernels, activation checkpointing")));
    assert_eq!(applied, ["fused kernels", "activation checkpointing"]);
    assert!(
        warnings
            .iter()
            .any(|warning| warning.contains("fused kernels") && warning.contains("without a trial")),
        "{warnings:#?}"
    );
}

#[test]
fn a_switch_that_can_close_the_gap_gets_a_trial_of_its_own() {
    // Half of 1200 bytes is 600, more than the 200 over: tried alone, and enough.
    let (settings, applied, warnings) = with_saving(0.5);
    assert!(settings
        .iter()
        .any(|settings| settings.as_deref() == Some("fused kernels")));
    assert_eq!(applied, ["fused kernels"]);
    assert!(!warnings
        .iter()
        .any(|warning| warning.contains("without a trial")));
}

/// The reason a search with `remedies` stopped, and how often it called the function.
fn stopped_before_the_first_attempt(
    search: BatchSizeSearch<'_>,
    remedies: &Remedies<Config>,
) -> (StopReason, usize) {
    let mut calls = 0;
    let error = search
        .with_remedies(remedies)
        .run(|_: Remedied<Config>| -> anyhow::Result<()> {
            calls += 1;
            Ok(())
        })
        .unwrap_err();
    (no_size(&error).reason().clone(), calls)
}

#[test]
fn an_invalid_remedy_stops_the_search_before_its_first_attempt() {
    let cases = [
        ("a floor of 0", context().with_floor(0), "context length"),
        (
            "a factor of 1.5",
            context().with_factor(1.5),
            "context length",
        ),
        (
            "a factor of 0",
            context().with_factor(0.0),
            "context length",
        ),
        ("a saving of 2.0", bf16().with_saving(2.0), "bf16"),
        ("a saving of 0", bf16().with_saving(0.0), "bf16"),
        ("a saving of NaN", bf16().with_saving(f64::NAN), "bf16"),
    ];
    for (what, remedy, name) in cases {
        let remedies = Remedies::new(config()).then(checkpointing()).then(remedy);
        let (reason, calls) = stopped_before_the_first_attempt(BatchSizeSearch::new(8), &remedies);
        assert_eq!(calls, 0, "{what}");
        let StopReason::InvalidConfiguration(why) = &reason else {
            panic!("{what}: {reason:?}");
        };
        assert!(why.contains(name), "{what}: {why}");
        assert!(remedies.applied().is_empty(), "{what}");
    }
}

#[test]
fn remedies_with_an_agreement_between_ranks_are_refused_before_the_first_attempt() {
    let rank = ThreadRanks::new(1).into_iter().next().unwrap();
    let remedies = Remedies::new(config()).then(checkpointing());
    let (reason, calls) =
        stopped_before_the_first_attempt(BatchSizeSearch::new(8).with_agreement(rank), &remedies);
    assert_eq!(calls, 0);
    assert!(
        matches!(&reason, StopReason::InvalidConfiguration(why) if why.contains("remedies are not agreed between ranks")),
        "{reason:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Properties over random devices and ladders.

/// Settings for the property: the switches in force, the context, and a field never declared.
#[derive(Debug, Clone, PartialEq)]
struct Knobs {
    on: [bool; 3],
    context: usize,
    tag: u64,
}

#[derive(Debug, Clone)]
struct Case {
    capacity: u64,
    fixed: u64,
    per_sample: u64,
    /// Each switch: what it scales a sample's memory by, and the saving it is said to make.
    switches: Vec<(f64, Option<f64>)>,
    /// Where the knob stands among the switches (`switches.len()`: last).
    knob_at: usize,
    base_context: usize,
    floor: usize,
    factor: f64,
    starting: usize,
    min: usize,
    figures: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1_000u64..1_000_000,
        0.0f64..1.0,
        0.001f64..2.0,
        prop::collection::vec((0.05f64..0.95, prop::option::of(0.01f64..=1.0)), 1..=3),
        0usize..=3,
        16usize..=256,
        0.0f64..1.2,
        0.2f64..0.9,
        1usize..=64,
        0.0f64..=1.0,
        any::<bool>(),
    )
        .prop_map(
            |(
                capacity,
                fixed,
                per_sample,
                switches,
                knob_at,
                base_context,
                floor,
                factor,
                starting,
                min,
                figures,
            )| {
                Case {
                    capacity,
                    fixed: (capacity as f64 * fixed) as u64,
                    per_sample: ((capacity as f64 * per_sample) as u64).max(1),
                    knob_at: knob_at.min(switches.len()),
                    switches,
                    base_context,
                    floor: ((base_context as f64 * floor) as usize).max(1),
                    factor,
                    starting,
                    min: ((starting as f64 * min) as usize).clamp(1, starting),
                    figures,
                }
            },
        )
}

impl Case {
    /// The bytes one attempt needs beyond the fixed ones.
    fn activations(&self, knobs: &Knobs, size: usize) -> u64 {
        let mut per_sample =
            self.per_sample as f64 * knobs.context as f64 / self.base_context as f64;
        for (index, (scale, _)) in self.switches.iter().enumerate() {
            if knobs.on[index] {
                per_sample *= scale;
            }
        }
        (per_sample.ceil() as u64).saturating_mul(size as u64)
    }

    fn fits(&self, knobs: &Knobs, size: usize) -> bool {
        self.fixed.saturating_add(self.activations(knobs, size)) <= self.capacity
    }

    fn base(&self) -> Knobs {
        Knobs {
            on: [false; 3],
            context: self.base_context,
            tag: 0xfeed,
        }
    }

    fn remedies(&self) -> Remedies<Knobs> {
        let mut remedies = Remedies::new(self.base());
        for position in 0..=self.switches.len() {
            if position == self.knob_at {
                remedies = remedies.then(
                    Remedy::knob(
                        "context",
                        |k: &Knobs| k.context,
                        |k: &mut Knobs, v| k.context = v,
                    )
                    .with_floor(self.floor)
                    .with_factor(self.factor),
                );
            }
            if let Some(&(_, saving)) = self.switches.get(position) {
                let mut switch =
                    Remedy::switch(format!("switch {position}"), move |k: &mut Knobs| {
                        k.on[position] = true
                    });
                if let Some(saving) = saving {
                    switch = switch.with_saving(saving);
                }
                remedies = remedies.then(switch);
            }
        }
        remedies
    }

    /// Every setting the ladder can reach, in its order: the base, then each step.
    fn reachable(&self) -> Vec<Knobs> {
        let mut now = self.base();
        let mut reachable = vec![now.clone()];
        for position in 0..=self.switches.len() {
            if position == self.knob_at {
                let mut value = self.base_context;
                while value > self.floor {
                    let stepped = ((value as f64) * self.factor).floor() as usize;
                    value = stepped.min(value - 1).max(self.floor);
                    now.context = value;
                    reachable.push(now.clone());
                }
            }
            if position < self.switches.len() {
                now.on[position] = true;
                reachable.push(now.clone());
            }
        }
        reachable
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn whenever_a_reachable_setting_fits_the_search_finds_a_size_that_runs(case in case()) {
        let device = SimulatedDevice::new(case.capacity);
        let remedies = case.remedies();
        let reachable = case.reachable();
        let mut seen: Vec<(usize, Knobs)> = Vec::new();
        let search = BatchSizeSearch::new(case.starting).with_min(case.min);
        let search = if case.figures { search.with_release(device.clone()) } else { search };
        let result = search.with_remedies(&remedies).run(|attempt: Remedied<Knobs>| {
            seen.push((attempt.batch_size(), attempt.settings().clone()));
            if case.figures {
                let _fixed = device.alloc(case.fixed)?;
                let _activations =
                    device.alloc(case.activations(attempt.settings(), attempt.batch_size()))?;
            } else if !case.fits(attempt.settings(), attempt.batch_size()) {
                return Err(oom());
            }
            Ok::<_, anyhow::Error>(attempt.batch_size())
        });

        for (size, knobs) in &seen {
            prop_assert!(*size >= case.min && *size <= case.starting, "size {size}");
            prop_assert_eq!(knobs.tag, 0xfeed);
            prop_assert!(knobs.context >= case.floor.min(case.base_context), "{knobs:?}");
            prop_assert!(reachable.contains(knobs), "{knobs:?} not in {reachable:?}");
        }
        // Each remedy came after `min` ran out of memory under the settings before it.
        let report = last_report().unwrap();
        let groups = groups(&attempts(&report));
        for group in &groups[..groups.len() - 1] {
            let last = group.last().unwrap();
            prop_assert!(last.batch_size == case.min && last.outcome.is_out_of_memory(), "{groups:#?}");
        }
        let any_fits = reachable.iter().any(|knobs| case.fits(knobs, case.min));
        match result {
            Ok((size, ran)) => {
                prop_assert_eq!(size, ran.batch_size());
                prop_assert!(case.fits(ran.settings(), size));
                prop_assert!(size >= case.min);
                prop_assert!(reachable.contains(ran.settings()));
                prop_assert_eq!(&remedies.settings(), ran.settings());
                prop_assert_eq!(report.batch_size(), Some(size));
            }
            Err(error) => {
                prop_assert!(!any_fits, "a reachable setting fits at min, yet: {error:#}");
                let reason = no_size(&error).reason();
                prop_assert!(matches!(reason, StopReason::NoRemedyLeft { .. }), "{reason:?}");
                // Every remedy went to its end.
                prop_assert_eq!(&remedies.settings(), reachable.last().unwrap());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Found while writing these tests: behaviour that departs from the documented contract.

#[test]

fn a_remedy_waits_for_min_even_with_a_reduction_that_stops_short() {
    let remedies = Remedies::new(config()).then(checkpointing());
    let mut sizes = Vec::new();
    let _ = BatchSizeSearch::new(64)
        .with_reduce(|_| 16)
        .with_remedies(&remedies)
        .run(|attempt: Remedied<Config>| -> anyhow::Result<()> {
            sizes.push((attempt.batch_size(), attempt.settings().checkpointing));
            if !attempt.settings().checkpointing {
                return Err(oom());
            }
            Ok(())
        });
    // The module's contract: "only when `min` itself runs out of memory is the next remedy
    // applied". Here 64 and 16 failed, the reduction proposed 16 again, and checkpointing was
    // applied with `min` (1) never tried.
    let first_remedied = sizes.iter().position(|&(_, on)| on).unwrap();
    assert_eq!(sizes[first_remedied - 1].0, 1, "{sizes:?}");
}

#[test]

fn no_remedy_left_names_the_remedies_restored_from_the_cache() {
    let _one = cache_lock();
    policy::clear_process_cache();
    let key = format!(
        "remedies-test-restored-then-none-left-{}",
        std::process::id()
    );
    let fresh = || {
        Remedies::new(config())
            .then(checkpointing())
            .then(context().with_floor(2048))
    };
    // First: fits with checkpointing, at 4.
    BatchSizeSearch::new(4)
        .with_cache(key.as_str())
        .with_remedies(&fresh())
        .run(|attempt: Remedied<Config>| {
            if !attempt.settings().checkpointing {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    // Then nothing fits: the search starts with checkpointing in force (from the cache) and
    // lowers the context to its floor.
    let remedies = fresh();
    let error = BatchSizeSearch::new(4)
        .with_cache(key.as_str())
        .with_remedies(&remedies)
        .run(|_: Remedied<Config>| -> anyhow::Result<()> { Err(oom()) })
        .unwrap_err();
    assert_eq!(
        remedies.applied(),
        ["activation checkpointing", "context length 2048"]
    );
    let StopReason::NoRemedyLeft { applied, .. } = no_size(&error).reason() else {
        panic!("{:?}", no_size(&error).reason());
    };
    // Every remedy in force when the search gave up is named: checkpointing too.
    assert!(
        applied
            .iter()
            .any(|entry| entry.starts_with("activation checkpointing")),
        "{applied:?}"
    );
}
