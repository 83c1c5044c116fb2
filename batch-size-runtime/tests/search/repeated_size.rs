//! A policy that returns to one size after every failure ends with `SizeRepeated`, as one that
//! returns to it after every success does: never thousands of attempts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::{Decision, SizePolicy};
use batch_size_runtime::{
    BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, SearchReport, StopReason,
};

/// After each failure, proposes a size above `with_max`: the engine runs it as the largest size
/// below the failure, a new size each time, one below the last.
#[derive(Debug)]
struct AboveTheMax;

impl SizePolicy for AboveTheMax {
    fn after(&mut self, _: &SearchReport) -> Decision {
        Decision::Try(usize::MAX)
    }
}

#[test]
fn a_policy_that_returns_to_a_size_after_each_failure_stops() {
    let mut runs = 0;
    let result: Result<usize, anyhow::Error> = BatchSizeSearch::new(1 << 31)
        .with_max(1 << 31)
        .with_policy(AboveTheMax)
        // Without the rule the search would step down from 2^31 one by one: the cap keeps a
        // failing run of this test short.
        .with_max_attempts(1000)
        .with_release(batch_size_runtime::Release::none())
        .run(|batch_size| {
            runs += 1;
            if batch_size > 10 {
                return Err(OutOfMemory::new().into());
            }
            Ok(batch_size)
        });
    let error = result.unwrap_err();
    let reason = error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap()
        .reason();
    assert_eq!(
        reason,
        &StopReason::SizeRepeated {
            batch_size: usize::MAX,
            runs: 16
        }
    );
    // The first size, then the 16 runs of the proposal.
    assert_eq!(runs, 17);
}

/// After each failure, proposes the size that fitted before: with every success new work (a
/// run of chunks), the failures on one chunk are bounded, the successes are not.
#[derive(Debug)]
struct BackToEight {
    new_work: bool,
}

impl SizePolicy for BackToEight {
    fn after(&mut self, history: &SearchReport) -> Decision {
        match history.last().map(|attempt| attempt.outcome.is_success()) {
            Some(true) => Decision::Try(16),
            _ => Decision::Try(8),
        }
    }

    fn each_success_is_new_work(&self) -> bool {
        self.new_work
    }
}

#[test]
fn oscillating_over_new_work_is_bounded_by_the_attempts_only() {
    let result: Result<usize, anyhow::Error> = BatchSizeSearch::new(16)
        .with_policy(BackToEight { new_work: true })
        .with_max_attempts(100)
        .with_release(batch_size_runtime::Release::none())
        .run(|batch_size| {
            if batch_size > 10 {
                return Err(OutOfMemory::new().into());
            }
            Ok(batch_size)
        });
    let error = result.unwrap_err();
    let reason = error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap()
        .reason();
    assert_eq!(reason, &StopReason::MaxAttempts(100));
}
