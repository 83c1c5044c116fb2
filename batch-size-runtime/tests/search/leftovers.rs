//! A size is not given up because a pool held memory from earlier work: when
//! an attempt fails while its pool held, from its start, memory reserved but unallocated that
//! explains the failure, the same size runs once more after the release; the report says so.
//! Everywhere else the search is unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::thread;

use batch_size_runtime::agree::{Agree, ThreadRanks};
use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::policy::Halve;
use batch_size_runtime::{BatchSizeSearch, EffectiveBatch, Outcome, SearchReport};

const MIB: u64 = 1 << 20;

/// A search from `starting` whose attempt allocates 1 MiB a sample on `device`.
fn search(device: &SimulatedDevice, starting: usize) -> (usize, SearchReport) {
    let (fitted, report) = BatchSizeSearch::new(starting)
        .with_release(device.clone())
        .run_with_report(|batch_size| -> anyhow::Result<usize> {
            let _activations = device.alloc(batch_size as u64 * MIB)?;
            Ok(batch_size)
        });
    (fitted.unwrap(), report)
}

fn sizes(report: &SearchReport) -> Vec<usize> {
    report
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect()
}

#[test]
fn memory_a_pool_kept_from_earlier_work_does_not_fail_a_size_that_fits() {
    // A pool that keeps what was freed until released, and cannot reuse it (an arena's
    // regions): the first search leaves 40 MiB in it, as a success is not followed by a release.
    let device = SimulatedDevice::new(100 * MIB).with_caching();
    assert_eq!(search(&device, 40).0, 40);
    assert_eq!(device.cached(), 40 * MIB);

    // 80 fits the device, but not beside the 40 MiB kept: it fails, the release gives them
    // back, and 80 runs again, this time with the whole device.
    let (fitted, report) = search(&device, 80);
    assert_eq!(fitted, 80);
    assert_eq!(sizes(&report), [80, 80]);
    assert!(report.attempts().next().unwrap().outcome.is_out_of_memory());
    let retry = report.attempts().nth(1).unwrap();
    assert_eq!(retry.outcome, Outcome::Succeeded);
    let why = retry.rationale.as_deref().unwrap();
    assert!(
        why.contains("reserved but unallocated from earlier work"),
        "{why}"
    );
    assert!(why.contains("40.00 MiB"), "{why}");
}

#[test]
fn a_size_that_does_not_fit_even_with_the_memory_given_back_is_tried_once_more_only() {
    let device = SimulatedDevice::new(100 * MIB).with_caching();
    search(&device, 30);
    // A step of `size` MiB of activations and 20 MiB of workspace: 90 fails beside the 30 MiB
    // kept, runs again once they are back, and fails for itself (110 MiB): the search goes on
    // below it, and never tries it a third time.
    let (fitted, report) = BatchSizeSearch::new(90)
        .with_release(device.clone())
        .run_with_report(|batch_size| -> anyhow::Result<usize> {
            let _activations = device.alloc(batch_size as u64 * MIB)?;
            let _workspace = device.alloc(20 * MIB)?;
            Ok(batch_size)
        });
    let tried = sizes(&report);
    assert_eq!(tried[..2], [90, 90], "{tried:?}");
    assert!(tried[2..].iter().all(|&size| size < 90), "{tried:?}");
    assert!(fitted.unwrap() <= 80, "{tried:?}");

    // A failure the kept memory cannot explain (more than free and kept together) is not
    // retried: 130 MiB never fits 100.
    let device = SimulatedDevice::new(100 * MIB).with_caching();
    search(&device, 30);
    let (_, report) = search(&device, 130);
    let tried = sizes(&report);
    assert!(tried.windows(2).all(|pair| pair[1] < pair[0]), "{tried:?}");
}

#[test]
fn without_leftovers_nothing_changes() {
    // No cache: the pool holds nothing unallocated, and the search is the one it always was.
    let device = SimulatedDevice::new(100 * MIB);
    let (fitted, report) = search(&device, 128);
    let tried = sizes(&report);
    assert!(tried.windows(2).all(|pair| pair[1] < pair[0]), "{tried:?}");
    assert!(fitted <= 100);
    assert!(report.attempts().all(|attempt| !attempt
        .rationale
        .as_deref()
        .unwrap_or("")
        .contains("earlier work")));

    // A cached pool emptied by the release before the first attempt: the same.
    let cached = SimulatedDevice::new(100 * MIB).with_caching();
    let (_, report) = search(&cached, 128);
    let tried = sizes(&report);
    assert!(tried.windows(2).all(|pair| pair[1] < pair[0]), "{tried:?}");
}

#[test]
fn the_steps_of_a_training_loop_keep_their_size_on_a_pool_that_keeps_memory() {
    // Each step leaves its buffers in the pool (no release after a success): the next step at
    // the same micro size fails beside them, and is redone at that size once they are back.
    let device = SimulatedDevice::new(100 * MIB).with_caching();
    let mut runner = EffectiveBatch::new(64).with_release(device.clone());
    for _ in 0..4 {
        runner
            .step(|plan| -> anyhow::Result<()> {
                for micro in plan.micro_batches() {
                    let _activations = device.alloc(micro.range.len() as u64 * MIB)?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(runner.micro(), 64, "{:?}", runner.recoveries());
    }
}

#[test]
fn ranks_that_agree_never_retry_alone() {
    // With an agreement every size is the ranks' verdict: a rank does not rerun a size on its
    // own, whatever its pool held.
    let handles: Vec<_> = ThreadRanks::new(2)
        .into_iter()
        .map(|rank| {
            thread::spawn(move || {
                let device = SimulatedDevice::new(100 * MIB).with_caching();
                drop(device.alloc(40 * MIB).unwrap()); // kept by the pool
                let (fitted, report) = BatchSizeSearch::new(80)
                    .with_release(device.clone())
                    .with_policy(Agree::new(Halve, rank))
                    .run_with_report(|batch_size| -> anyhow::Result<usize> {
                        let _activations = device.alloc(batch_size as u64 * MIB)?;
                        Ok(batch_size)
                    });
                (fitted.unwrap(), sizes(&report))
            })
        })
        .collect();
    for handle in handles {
        let (fitted, tried) = handle.join().unwrap();
        assert_eq!(tried, [80, 40], "halving, as agreed");
        assert_eq!(fitted, 40);
    }
}
