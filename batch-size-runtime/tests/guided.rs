//! The guided default: exact halving without figures, one retry where the evidence is clear, an
//! early stop when the fixed part does not fit, and no panic or bad proposal on any figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::Guided;
use batch_size_runtime::{
    BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, SimulatedDevice, StopReason,
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
        BatchSizeSearch::new(128).run_dyn(|_| Err(OutOfMemory::new().into()));
    assert_eq!(none_fit(result).tried(), &[128, 64, 32, 16, 8, 4, 2, 1]);
    // A message without figures: the same.
    let result: anyhow::Result<usize> =
        BatchSizeSearch::new(128).run_dyn(|_| anyhow::bail!("CUDA out of memory."));
    assert_eq!(none_fit(result).tried(), &[128, 64, 32, 16, 8, 4, 2, 1]);
}

#[test]
fn clear_evidence_lands_within_ten_percent_in_one_retry() {
    for (fixed, per_sample, start) in [
        (0, 120 * MIB, 512),
        (9 * GIB, 60 * MIB, 256),
        (4 * GIB, 7 * MIB, 4096),
    ] {
        let device = SimulatedDevice::new(16 * GIB);
        let largest = ((16 * GIB - fixed) / per_sample) as usize;
        let found = BatchSizeSearch::new(start)
            .with_release(device.clone())
            .run_dyn(|size| -> anyhow::Result<usize> {
                let _weights = device.alloc(fixed)?;
                let _activations = device.alloc(size as u64 * per_sample)?;
                Ok(size)
            })
            .unwrap();
        let report = batch_size_runtime::last_report().unwrap();
        assert_eq!(report.len(), 2, "one failure, one retry: {report}");
        assert!(
            found <= largest && found as f64 >= 0.9 * largest as f64,
            "{found} of {largest}"
        );
        // The retry's record says how it was chosen.
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
fn the_figures_come_from_pytorch_text_too() {
    // 20 GiB total, 4 GiB in use by the model, 100 MiB a sample: 163 fit.
    let found: anyhow::Result<usize> = BatchSizeSearch::new(256).run_dyn(|size| {
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
    let result = BatchSizeSearch::new(512)
        .with_release(device.clone())
        .run_dyn(|size| -> anyhow::Result<usize> {
            let _weights = device.alloc(20 * GIB)?; // the model alone does not fit
            let _activations = device.alloc(size as u64 * MIB)?;
            Ok(size)
        });
    let none_fit = none_fit(result);
    assert_eq!(none_fit.tried().len(), 2, "{none_fit}");
    match none_fit.reason() {
        StopReason::Policy(why) => {
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
            BatchSizeSearch::new(8).with_margin(margin).run_dyn(|size| {
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
        assert!(batch_size_runtime::SizePolicy::check(&policy).is_err());
    }
    let zero: anyhow::Result<usize> = BatchSizeSearch::new(8).with_margin(0.0).run_dyn(Ok);
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
            BatchSizeSearch::new(64).run_dyn(|_| anyhow::bail!("{text}"));
        assert_eq!(none_fit(result).tried(), &[64, 32, 16, 8, 4, 2, 1], "{text}");
    }
    // A request larger than the whole device, at every size: no panic, never a size that failed.
    let result: anyhow::Result<usize> = BatchSizeSearch::new(64).run_dyn(|size| {
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
            .run_dyn(|size| {
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
