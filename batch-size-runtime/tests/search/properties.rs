//! Every reduction policy strictly decreases, terminates, never goes below `min` and never
//! calls the attempt with 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Policy {
    Halve,
    Factor(f64),
    /// A custom reduction that subtracts this much (0 means "does not shrink").
    Minus(usize),
    /// A custom reduction that returns a fixed (possibly larger) size.
    Constant(usize),
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Halve),
        (0.01f64..0.999).prop_map(Policy::Factor),
        (0usize..50).prop_map(Policy::Minus),
        (0usize..8_192).prop_map(Policy::Constant),
    ]
}

fn search(starting: usize, min: usize, policy: &Policy) -> BatchSizeSearch<'static> {
    let search = BatchSizeSearch::new(starting).with_min(min);
    match policy.clone() {
        Policy::Halve => search,
        Policy::Factor(factor) => search.with_factor(factor),
        Policy::Minus(step) => {
            search.with_reduce(move |failed| failed.batch_size.saturating_sub(step))
        }
        Policy::Constant(size) => search.with_reduce(move |_| size),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn sizes_strictly_decrease_stay_at_or_above_min_and_terminate(
        starting in 0usize..4_096,
        min in 0usize..64,
        fits_at in 0usize..4_096,
        policy in policy(),
    ) {
        let mut calls = Vec::new();
        let result: anyhow::Result<usize> = search(starting, min, &policy).run(|batch_size| {
            calls.push(batch_size);
            assert!(calls.len() <= 100_000, "did not terminate");
            if batch_size > fits_at {
                return Err(batch_size_runtime::OutOfMemory::new().into());
            }
            Ok(batch_size)
        });
        prop_assert!(calls.iter().all(|&size| size > 0), "called with 0: {calls:?}");
        prop_assert!(calls.iter().all(|&size| size >= min.max(1)), "below min: {calls:?}");
        prop_assert!(calls.windows(2).all(|pair| pair[1] < pair[0]), "not decreasing: {calls:?}");
        if let Some(&first) = calls.first() {
            prop_assert_eq!(first, starting);
        }
        match result {
            Ok(size) => {
                prop_assert!(size <= fits_at);
                prop_assert_eq!(Some(&size), calls.last());
            }
            Err(error) => {
                let none_fit = error.downcast_ref::<NoExecutableBatchSize>();
                prop_assert!(none_fit.is_some());
                let none_fit = none_fit.unwrap();
                prop_assert_eq!(none_fit.tried(), &calls[..]);
                prop_assert!(calls.iter().all(|&size| size > fits_at));
            }
        }
    }

    #[test]
    fn factor_matches_floor_of_the_product(starting in 1usize..1_000_000, factor in 0.01f64..0.999) {
        let mut calls = Vec::new();
        let _: anyhow::Result<()> = BatchSizeSearch::new(starting)
            .with_factor(factor)
            .with_max_attempts(3)
            .run(|batch_size| {
                calls.push(batch_size);
                Err(batch_size_runtime::OutOfMemory::new().into())
            });
        for pair in calls.windows(2) {
            prop_assert_eq!(pair[1], (pair[0] as f64 * factor).floor() as usize);
        }
    }
}
