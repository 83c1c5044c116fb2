//! The guided default: exact halving without figures, within 10 % in at most one attempt more than
//! halving where the evidence is clear, an early stop only when the figures prove that the fixed part
//! does not fit (never on a text that repeats itself), and no panic or bad proposal on any figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::Guided;
use batch_size_runtime::{
    memory::SimulatedDevice, BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, StopReason,
};
use proptest::prelude::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn none_fit(result: anyhow::Result<usize>) -> NoExecutableBatchSize {
    let error = result.unwrap_err();
    match error.downcast::<NoExecutableBatchSize>() {
        Ok(none_fit) => none_fit,
        Err(other) => panic!("not NoExecutableBatchSize: {other}"),
    }
}

#[test]
fn without_figures_it_halves_exactly() {
    let result: anyhow::Result<usize> =
        BatchSizeSearch::new(128).run(|_| Err(OutOfMemory::new().into()));
    assert_eq!(none_fit(result).tried(), &[128, 64, 32, 16, 8, 4, 2, 1]);
    // A message without figures: the same.
    let result: anyhow::Result<usize> =
        BatchSizeSearch::new(128).run(|_| anyhow::bail!("CUDA out of memory."));
    assert_eq!(none_fit(result).tried(), &[128, 64, 32, 16, 8, 4, 2, 1]);
}

#[test]
fn clear_evidence_lands_within_ten_percent_in_at_most_one_attempt_more_than_halving() {
    for (fixed, per_sample, start, halving_attempts) in [
        (0, 120 * MIB, 512, 3),      // 512 256 128
        (9 * GIB, 60 * MIB, 256, 3), // 256 128 64
        (4 * GIB, 7 * MIB, 4096, 3), // 4096 2048 1024
        (9 * GIB, 60 * MIB, 128, 2), // 128 64
    ] {
        let device = SimulatedDevice::new(16 * GIB);
        let largest = ((16 * GIB - fixed) / per_sample) as usize;
        let found = BatchSizeSearch::new(start)
            .with_release(device.clone())
            .run(|size| -> anyhow::Result<usize> {
                let _weights = device.alloc(fixed)?;
                let _activations = device.alloc(size as u64 * per_sample)?;
                Ok(size)
            })
            .unwrap();
        let report = batch_size_runtime::last_report().unwrap();
        assert!(report.len() <= halving_attempts + 1, "{report}");
        assert!(
            found <= largest && found as f64 >= 0.9 * largest as f64,
            "{found} of {largest}"
        );
        // The last attempt's record says how it was chosen.
        assert!(report
            .last()
            .unwrap()
            .rationale
            .as_deref()
            .unwrap()
            .contains("fit"));
    }
}

#[test]
fn a_text_that_repeats_at_every_size_never_stops_the_search_early() {
    // A framework that reports the same failing allocation whatever the size: the figures do not
    // move with the batch, prove nothing, and the search walks halving's ladder to the size that
    // fits.
    let text = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.79 GiB of which 3.12 MiB is free.";
    for start in [64usize, 100, 256] {
        let found: anyhow::Result<usize> = BatchSizeSearch::new(start).run(|size| {
            if size > 8 {
                anyhow::bail!("{text}");
            }
            Ok(size)
        });
        let report = batch_size_runtime::last_report().unwrap();
        let halving: Vec<usize> = std::iter::successors(Some(start), |size| Some(size / 2))
            .take_while(|&size| size > 8)
            .collect();
        let halving_found = start >> halving.len();
        let found = found.unwrap_or_else(|error| panic!("from {start}: {error}\n{report}"));
        assert!(
            found >= halving_found && found <= 8,
            "from {start}: {report}"
        );
        assert!(report.len() <= halving.len() + 2, "from {start}: {report}");
    }
    // The same with a memory backend whose readings say nothing of the attempt (a device of its
    // own): no proof either.
    let device = SimulatedDevice::new(8 * GIB);
    let found: anyhow::Result<usize> =
        BatchSizeSearch::new(64)
            .with_release(device.clone())
            .run(|size| {
                if size > 8 {
                    anyhow::bail!("{text}");
                }
                Ok(size)
            });
    assert_eq!(found.unwrap(), 8);
}

#[test]
fn without_the_backend_readings_a_fixed_part_too_large_is_not_proved_and_the_ladder_is_walked() {
    // The error's text alone cannot say that nothing of the attempt's own was in use: no early
    // stop, the ladder to its end as halving's, at most one attempt more.
    let result: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|_| {
        anyhow::bail!(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 16.00 GiB of which 16.00 GiB is free."
        )
    });
    let none_fit = none_fit(result);
    assert!(none_fit.tried().len() <= 8, "{none_fit}"); // halving: 7
    assert_eq!(none_fit.tried().last(), Some(&1), "{none_fit}");
    assert!(
        !matches!(none_fit.reason(), StopReason::FixedMemoryDoesNotFit { .. }),
        "{none_fit}"
    );
}

#[test]
fn the_figures_come_from_pytorch_text_too() {
    // 20 GiB total, 4 GiB in use by the model, 100 MiB a sample: 163 fit.
    let found: anyhow::Result<usize> = BatchSizeSearch::new(256).run(|size| {
        let needed = size as u64 * 100 * MIB;
        if 4 * GIB + needed > 20 * GIB {
            anyhow::bail!(
                "CUDA out of memory. Tried to allocate {:.2} GiB. GPU 0 has a total capacity of 20.00 GiB of which 16.00 GiB is free.",
                needed as f64 / GIB as f64
            );
        }
        Ok(size)
    });
    let found = found.unwrap();
    assert!((147..=163).contains(&found), "{found}");
}

#[test]
fn a_fixed_part_larger_than_the_device_stops_early_with_the_figures() {
    let device = SimulatedDevice::new(16 * GIB);
    let result = BatchSizeSearch::new(512).with_release(device.clone()).run(
        |size| -> anyhow::Result<usize> {
            let _weights = device.alloc(20 * GIB)?; // the model alone does not fit
            let _activations = device.alloc(size as u64 * MIB)?;
            Ok(size)
        },
    );
    let none_fit = none_fit(result);
    assert_eq!(none_fit.tried().len(), 2, "{none_fit}");
    match none_fit.reason() {
        reason @ StopReason::FixedMemoryDoesNotFit { total, .. } => {
            assert_eq!(*total, 16 * GIB);
            let why = reason.to_string();
            assert!(why.contains("does not depend on the batch size"), "{why}");
            assert!(
                why.contains("20.00 GiB") && why.contains("16.00 GiB"),
                "{why}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_margin_outside_zero_one_is_refused() {
    for margin in [1.0, 1.5, -0.1, f64::NAN, f64::INFINITY] {
        let mut calls = 0;
        let result: anyhow::Result<usize> =
            BatchSizeSearch::new(8).with_margin(margin).run(|size| {
                calls += 1;
                Ok(size)
            });
        assert!(
            matches!(
                none_fit(result).reason(),
                StopReason::InvalidConfiguration(_)
            ),
            "{margin}"
        );
        assert_eq!(calls, 0);
        let policy = Guided::new().with_margin(margin);
        assert!(batch_size_runtime::policy::SizePolicy::check(&policy).is_err());
    }
    let zero: anyhow::Result<usize> = BatchSizeSearch::new(8).with_margin(0.0).run(Ok);
    assert_eq!(zero.unwrap(), 8);
}

#[test]
fn bad_figures_fall_back_to_halving() {
    for text in [
        "CUDA out of memory. Tried to allocate NaN GiB. GPU 0 has a total capacity of inf GiB of which NaN GiB is free.",
        // Free above total: contradictory.
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 4.00 GiB of which 9.00 GiB is free.",
        // Nothing free, nothing requested.
        "CUDA out of memory. Tried to allocate 0 bytes. GPU 0 has a total capacity of 0 bytes of which 0 bytes is free.",
    ] {
        let result: anyhow::Result<usize> =
            BatchSizeSearch::new(64).run(|_| anyhow::bail!("{text}"));
        assert_eq!(none_fit(result).tried(), &[64, 32, 16, 8, 4, 2, 1], "{text}");
    }
    // A request larger than the whole device, at every size: no panic, never a size that failed.
    let result: anyhow::Result<usize> = BatchSizeSearch::new(64).run(|size| {
        anyhow::bail!(
            "CUDA out of memory. Tried to allocate {} GiB. GPU 0 has a total capacity of 1.00 GiB of which 1.00 GiB is free.",
            size * 1000
        )
    });
    let tried = none_fit(result).tried().to_vec();
    assert!(tried.windows(2).all(|pair| pair[1] < pair[0]), "{tried:?}");
}

fn figure() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..1 << 40).prop_map(|bytes| format!("{bytes} bytes")),
        (0.0f64..5000.0).prop_map(|value| format!("{value:.2} MiB")),
        (0.0f64..200.0).prop_map(|value| format!("{value:.2} GiB")),
        Just("NaN GiB".to_owned()),
        Just("inf GiB".to_owned()),
        Just("-3.00 GiB".to_owned()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever the figures say: strictly smaller sizes, never below `min`, a bounded number of
    /// attempts, no panic, and never a proposal the engine has to refuse.
    #[test]
    fn any_figures_give_a_sound_search(
        start in 1usize..5000,
        min in 1usize..16,
        fits in 0usize..5000,
        margin in 0.0f64..0.9,
        figures in proptest::collection::vec((figure(), figure(), figure()), 1..8),
    ) {
        let mut attempt = 0usize;
        let result: anyhow::Result<usize> = BatchSizeSearch::new(start)
            .with_min(min)
            .with_margin(margin)
            .run(|size| {
                let (requested, total, free) = &figures[attempt % figures.len()];
                attempt += 1;
                if size > fits {
                    anyhow::bail!(
                        "CUDA out of memory. Tried to allocate {requested}. GPU 0 has a total capacity of {total} of which {free} is free."
                    );
                }
                Ok(size)
            });
        let report = batch_size_runtime::last_report().unwrap();
        let tried: Vec<usize> = report.attempts().map(|attempt| attempt.batch_size).collect();
        prop_assert!(tried.windows(2).all(|pair| pair[1] < pair[0]), "{:?}", tried);
        prop_assert!(tried.iter().all(|&size| size >= min), "{:?}", tried);
        prop_assert!(tried.len() <= 64);
        match result {
            Ok(found) => prop_assert!(found <= fits && found >= min),
            Err(error) => {
                let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
                prop_assert!(
                    !matches!(none_fit.reason(), StopReason::NotSmaller { .. }),
                    "{}", none_fit
                );
            }
        }
    }
}
