//! The engine's rules hold for every `SizePolicy`, and a policy sees every attempt.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use batch_size_runtime::policy::{Decision, SizePolicy};
use batch_size_runtime::{
    BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, Outcome, SearchReport, StopReason,
};

/// Proposes the sizes it is given, one after each attempt, then accepts.
#[derive(Debug)]
struct Script {
    sizes: Vec<usize>,
    seen: Arc<AtomicUsize>,
    ended_by_failure: Arc<AtomicUsize>,
}

impl Script {
    fn new(sizes: &[usize]) -> Self {
        Script {
            sizes: sizes.iter().rev().copied().collect(),
            seen: Arc::default(),
            ended_by_failure: Arc::default(),
        }
    }
}

impl SizePolicy for Script {
    fn first(&mut self, _starting: usize) -> Decision {
        self.sizes.pop().map_or(Decision::Accept, Decision::Try)
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        self.seen.store(history.len(), Ordering::SeqCst);
        self.sizes.pop().map_or(Decision::Accept, Decision::Try)
    }
    fn ended_by_failure(&mut self, _history: &SearchReport) {
        self.ended_by_failure.fetch_add(1, Ordering::SeqCst);
    }
}

fn fits_up_to(limit: usize) -> impl FnMut(usize) -> anyhow::Result<usize> {
    move |size| {
        if size > limit {
            return Err(OutOfMemory::new().into());
        }
        Ok(size)
    }
}

fn reason(result: anyhow::Result<usize>) -> StopReason {
    let error = result.unwrap_err();
    error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap()
        .reason()
        .clone()
}

#[test]
fn a_size_at_or_above_one_that_failed_is_never_tried() {
    // 40 fails; the script then proposes 50 (above it): the engine stops, naming both.
    let result = BatchSizeSearch::new(1)
        .with_policy(Script::new(&[40, 50]))
        .run(fits_up_to(30));
    assert_eq!(
        reason(result),
        StopReason::NotSmaller {
            failed: 40,
            proposed: 50
        }
    );
    // Growing below the failure is fine, even after successes.
    let found = BatchSizeSearch::new(1)
        .with_policy(Script::new(&[8, 16, 40, 24]))
        .run(fits_up_to(30));
    assert_eq!(found.unwrap(), 24);
}

#[test]
fn accept_returns_the_latest_success_even_after_a_failure() {
    let found = BatchSizeSearch::new(1)
        .with_policy(Script::new(&[8, 16, 40]))
        .run(fits_up_to(30));
    assert_eq!(found.unwrap(), 16);
}

#[test]
fn accept_without_any_success_stops_with_nothing_to_accept() {
    let result = BatchSizeSearch::new(1)
        .with_policy(Script::new(&[40]))
        .run(fits_up_to(30));
    assert_eq!(reason(result), StopReason::NothingToAccept);
}

#[test]
fn min_and_max_attempts_apply_to_every_policy() {
    // Below `min`, `min` itself runs once (it fits here); when it fails too, the search stops.
    let below = BatchSizeSearch::new(1)
        .with_min(10)
        .with_policy(Script::new(&[40, 5]))
        .run(fits_up_to(30));
    assert_eq!(below.unwrap(), 10);
    let below = BatchSizeSearch::new(1)
        .with_min(10)
        .with_policy(Script::new(&[40, 5, 3]))
        .run(fits_up_to(8));
    assert_eq!(reason(below), StopReason::BelowMinimum { next: 3, min: 10 });

    let capped = BatchSizeSearch::new(1)
        .with_max_attempts(2)
        .with_policy(Script::new(&[1, 2, 3, 4]))
        .run(fits_up_to(30));
    assert_eq!(reason(capped), StopReason::MaxAttempts(2));

    let zero = BatchSizeSearch::new(1)
        .with_policy(Script::new(&[40, 0]))
        .run(fits_up_to(30));
    assert_eq!(reason(zero), StopReason::ReachedZero);
}

#[test]
fn invalid_minimum_and_cap_are_refused_not_changed() {
    for search in [
        BatchSizeSearch::new(8).with_min(0),
        BatchSizeSearch::new(8).with_max_attempts(0),
    ] {
        let mut calls = 0;
        let result = search.run(|size| {
            calls += 1;
            fits_up_to(30)(size)
        });
        assert!(matches!(
            reason(result),
            StopReason::InvalidConfiguration(_)
        ));
        assert_eq!(calls, 0);
    }
}

#[test]
fn the_policy_sees_every_attempt_and_is_told_of_a_failure() {
    let policy = Script::new(&[64, 32, 16]);
    let seen = Arc::clone(&policy.seen);
    let ended = Arc::clone(&policy.ended_by_failure);
    let result = BatchSizeSearch::new(1)
        .with_policy(policy)
        .run(|size| -> anyhow::Result<usize> {
            if size == 16 {
                anyhow::bail!("corrupt shard");
            }
            Err(OutOfMemory::new().into())
        });
    assert_eq!(result.unwrap_err().to_string(), "corrupt shard");
    assert_eq!(seen.load(Ordering::SeqCst), 2); // after 64 and 32
    assert_eq!(ended.load(Ordering::SeqCst), 1); // 16: not out of memory
}

#[test]
fn when_and_notify_are_per_search() {
    let mut outcomes = Vec::new();
    let found: anyhow::Result<usize> = BatchSizeSearch::new(64)
        .when(|error| error.to_string().contains("arena exhausted"))
        .notify(|attempt| outcomes.push(attempt.outcome.clone()))
        .run(|size| {
            if size > 16 {
                anyhow::bail!("npu: arena exhausted");
            }
            Ok(size)
        });
    assert_eq!(found.unwrap(), 16);
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes[0].is_out_of_memory() && outcomes[2] == Outcome::Succeeded);

    // Another search without the rule: the same error is not out-of-memory.
    let other: anyhow::Result<usize> =
        BatchSizeSearch::new(64).run(|_| anyhow::bail!("npu: arena exhausted"));
    assert_eq!(other.unwrap_err().to_string(), "npu: arena exhausted");
}

#[test]
fn on_report_sees_the_report_of_a_search_that_found_nothing() {
    let reported = Arc::new(AtomicUsize::new(0));
    let sink = Arc::clone(&reported);
    let result: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .on_report(move |report| sink.store(report.len(), Ordering::SeqCst))
        .run(|_| Err(OutOfMemory::new().into()));
    assert!(result.is_err());
    assert_eq!(reported.load(Ordering::SeqCst), 4); // 8, 4, 2, 1
}
