//! The rules the engine holds every policy to, whatever it proposes: a size the batch-size
//! parameter's type cannot hold runs as the largest it can that has not failed (and the
//! report records what ran); `min` itself is tried before the search gives up below it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::Halve;
use batch_size_runtime::{
    find_executable_batch_size, last_report, policy::Decision, policy::SizePolicy, BatchSizeSearch,
    OutOfMemory, SearchReport,
};

/// A policy that proposes a fixed list of sizes, whatever happened.
#[derive(Debug)]
struct Proposes(Vec<usize>);

impl SizePolicy for Proposes {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(self.0.remove(0))
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        match history.last() {
            Some(last) if last.outcome.is_success() => Decision::Accept,
            _ if self.0.is_empty() => Decision::Accept,
            _ => Decision::Try(self.0.remove(0)),
        }
    }
}

#[find_executable_batch_size(starting = 200u8, policy = Proposes(vec![1000, 500, 250, 120]))]
fn narrow(batch_size: u8, ran: &mut Vec<u8>) -> anyhow::Result<u8> {
    ran.push(batch_size);
    if batch_size > 130 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[test]
fn a_proposal_larger_than_the_type_runs_as_the_largest_size_that_has_not_failed() {
    let mut ran = Vec::new();
    assert_eq!(narrow(&mut ran).unwrap(), 120);
    // 1000 runs as 255; 500 as 254 (255 failed and never runs again); then 250 and 120.
    assert_eq!(ran, [255, 254, 250, 120]);
    let recorded: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(
        recorded,
        [255, 254, 250, 120],
        "the report records what ran"
    );
}

#[test]
fn min_is_tried_before_the_search_gives_up_below_it() {
    let fitted: anyhow::Result<usize> =
        BatchSizeSearch::new(8)
            .with_policy(Halve)
            .with_min(5)
            .run(|size| {
                if size > 6 {
                    return Err(OutOfMemory::new().into());
                }
                Ok(size)
            });
    // Halving steps from 8 to 4, below `min`: 5 runs instead, and fits.
    assert_eq!(fitted.unwrap(), 5);
    let tried: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(tried, [8, 5]);

    // When `min` itself fails, the search stops there.
    let none: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .with_policy(Halve)
        .with_min(5)
        .run(|_| Err(OutOfMemory::new().into()));
    let error = none.unwrap_err();
    let none_fit = error
        .downcast_ref::<batch_size_runtime::NoExecutableBatchSize>()
        .unwrap();
    assert_eq!(none_fit.tried(), &[8, 5]);
}

/// A policy that confirms a smaller size after a success and accepts the latest success when
/// the confirmation fails (as a tuner's margin trial does).
#[derive(Debug)]
struct ConfirmBelow;

impl SizePolicy for ConfirmBelow {
    fn after(&mut self, history: &SearchReport) -> Decision {
        match history.last() {
            Some(last) if last.outcome.is_success() && history.len() == 1 => {
                Decision::Try(last.batch_size / 2)
            }
            Some(last) if last.outcome.is_success() => Decision::Accept,
            _ => Decision::Accept,
        }
    }
}

#[test]
fn a_size_above_a_failure_is_never_kept_whatever_the_policy() {
    // 64 runs; then another process takes memory and 32 no longer fits, nor anything above 20.
    let mut sizes_run = 0;
    let (fitted, report) = BatchSizeSearch::new(64)
        .with_policy(ConfirmBelow)
        .run_with_report(|batch_size| -> anyhow::Result<usize> {
            sizes_run += 1;
            if sizes_run > 1 && batch_size > 20 {
                Err(OutOfMemory::new())?
            }
            Ok(batch_size)
        });
    // 64 is not kept: the search went on below 32, the failure, and kept what ran there.
    let fitted = fitted.unwrap();
    assert!(fitted <= 20, "{fitted}: {report}");
    let tried = report.tried();
    assert_eq!(&tried[..2], &[64, 32], "{report}");
    assert_eq!(report.last().map(|last| last.batch_size), Some(fitted));
    let why = report
        .attempts()
        .nth(2)
        .and_then(|a| a.rationale.clone())
        .unwrap_or_default();
    assert!(why.contains("32 ran out of memory after 64 ran"), "{why}");
}

/// Doubles after each success; accepts the latest success after a failure.
#[derive(Debug)]
struct Doubling;

impl SizePolicy for Doubling {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(16)
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        match history.last() {
            Some(last) if last.outcome.is_success() => Decision::Try(last.batch_size * 2),
            _ => Decision::Accept,
        }
    }
}

#[test]
fn a_policy_accepting_below_its_failures_is_unchanged() {
    // 16 and 32 run, 64 fails: 32, below the failure, is kept as the policy says.
    let (fitted, report) = BatchSizeSearch::new(16)
        .with_policy(Doubling)
        .run_with_report(|batch_size| -> anyhow::Result<usize> {
            if batch_size > 40 {
                Err(OutOfMemory::new())?
            }
            Ok(batch_size)
        });
    assert_eq!(fitted.unwrap(), 32);
    assert_eq!(report.tried(), [16, 32, 64]);
}

#[test]
fn a_max_below_min_is_refused_by_every_runner_before_its_first_attempt() {
    use batch_size_runtime::{NoExecutableBatchSize, StopReason, Tuner};
    let refused = |error: &NoExecutableBatchSize| {
        matches!(error.reason(), StopReason::InvalidConfiguration(why) if why.contains("`max` (8) must not be below `min` (16)"))
            && error.tried().is_empty()
    };
    let search = BatchSizeSearch::new(64)
        .with_min(16)
        .with_max(8)
        .call(|batch_size| batch_size);
    assert!(refused(&search.unwrap_err()));
    let tuned: anyhow::Result<_> = Tuner::new()
        .with_min(16)
        .with_max(8)
        .run(|_| Ok::<_, anyhow::Error>(()));
    let error = tuned.unwrap_err();
    assert!(refused(
        error.downcast_ref::<NoExecutableBatchSize>().unwrap()
    ));
}

/// A policy that keeps proposing a size that already ran, on the same work, ends with a reason
/// that says so, never a hang (no `with_max_attempts` set).
#[test]
fn a_policy_that_repeats_a_size_that_succeeded_stops() {
    #[derive(Debug)]
    struct AlwaysEight;
    impl batch_size_runtime::policy::SizePolicy for AlwaysEight {
        fn after(&mut self, _: &batch_size_runtime::SearchReport) -> Decision {
            Decision::Try(8)
        }
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut runs = 0;
        let result = BatchSizeSearch::new(8)
            .with_policy(AlwaysEight)
            .call(|size| {
                runs += 1;
                size
            });
        let _ = done_tx.send((result.map_err(|e| e.reason().clone()), runs));
    });
    let (result, runs) = done_rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the search ended");
    assert_eq!(
        result.unwrap_err(),
        batch_size_runtime::StopReason::SizeRepeated {
            batch_size: 8,
            runs: 16
        }
    );
    assert_eq!(runs, 16);
}
