//! The tuner returns a size whose own trial ran, never above the largest that succeeded or
//! above `with_max`, whatever the device.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{NoExecutableBatchSize, OutOfMemory, SimulatedDevice, Tuner};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    #[test]
    fn the_size_returned_ran_and_respects_max(
        fixed_mib in 0u64..8000,
        per_sample_kib in 1u64..200_000,
        max in proptest::option::of(1usize..3000),
        figures in any::<bool>(),
    ) {
        let device = SimulatedDevice::new(16 << 30);
        let mut tuner = Tuner::new().with_max_trials(30);
        if let Some(max) = max {
            tuner = tuner.with_max(max);
        }
        tuner = if figures {
            tuner.with_release(device.clone())
        } else {
            tuner.with_release(batch_size_runtime::Release::none())
        };
        let result = tuner.run(|size| -> anyhow::Result<()> {
            let needed = (fixed_mib << 20) + size as u64 * (per_sample_kib << 10);
            if !figures {
                if needed > 16 << 30 { Err(OutOfMemory::new())? }
                return Ok(());
            }
            let _weights = device.alloc(fixed_mib << 20)?;
            let _activations = device.alloc(size as u64 * (per_sample_kib << 10))?;
            Ok(())
        });
        let largest = (((16u64 << 30).saturating_sub(fixed_mib << 20)) / (per_sample_kib << 10)) as usize;
        match result {
            Ok(tuned) => {
                prop_assert!(tuned.batch_size() <= tuned.largest_fit());
                prop_assert!(tuned.largest_fit() <= largest);
                if let Some(max) = max {
                    prop_assert!(tuned.report().attempts().all(|trial| trial.batch_size <= max));
                }
                // The size returned ran, successfully.
                prop_assert!(tuned
                    .report()
                    .attempts()
                    .any(|trial| trial.batch_size == tuned.batch_size() && trial.outcome.is_success()));
                prop_assert!(tuned.report().len() <= 30);
            }
            Err(error) => {
                let none_fit = error.downcast_ref::<NoExecutableBatchSize>();
                prop_assert!(none_fit.is_some(), "{}", error);
                prop_assert!(largest == 0 || none_fit.is_some_and(|none_fit| none_fit.report().len() >= 30), "{}", error);
            }
        }
    }
}

#[test]
fn with_figures_it_takes_fewer_trials_than_doubling_and_bisecting() {
    let device = SimulatedDevice::new(16 << 30);
    let tuned = Tuner::new()
        .with_release(device.clone())
        .run(|size| -> anyhow::Result<()> {
            let _weights = device.alloc(9 << 30)?;
            let _activations = device.alloc(size as u64 * (60 << 20))?;
            Ok(())
        })
        .unwrap();
    // 119 fit; bisection stops within half the margin of it.
    assert!(
        (116..=119).contains(&tuned.largest_fit()),
        "{}",
        tuned.largest_fit()
    );
    assert!(tuned.batch_size() as f64 >= 0.94 * 119.0);
    assert!(tuned.report().len() <= 8, "{}", tuned.report());
}
