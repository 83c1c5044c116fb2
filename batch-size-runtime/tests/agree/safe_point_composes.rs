//! `safe_point(rank, ...)?` composes with the crate's own error types, not only with
//! `anyhow`: inside a function returning `ChildTrialError` (one that runs child trials) or
//! `OutOfMemory` (the simulated device's allocations), the other rank's out-of-memory becomes
//! this rank's, and the search retries it with the others.
//!
//! Before `From<OutOfMemoryOnAnotherRank>` existed for these types, this file did not compile.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{safe_point, ThreadRank, ThreadRanks};
use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::{BatchSizeSearch, ChildTrialError, OutOfMemory, SearchReport};

/// Two ranks whose devices hold 100 and 40 samples run `attempt` from 128, halving: the rank
/// that fits must retry with the one that does not, and both end at 32.
fn two_ranks<E>(
    attempt: fn(&ThreadRank, usize, usize) -> Result<usize, E>,
) -> Vec<(Result<usize, String>, SearchReport)>
where
    E: std::error::Error + Send + Sync + From<batch_size_runtime::NoExecutableBatchSize> + 'static,
{
    let handles: Vec<_> = ThreadRanks::with_timeout(2, Duration::from_secs(10))
        .into_iter()
        .zip([100usize, 40])
        .map(|(rank, holds)| {
            thread::spawn(move || {
                let (result, report) = BatchSizeSearch::new(128)
                    .with_policy(batch_size_runtime::policy::Halve)
                    .with_agreement(&rank)
                    .run_with_report(|size| attempt(&rank, size, holds));
                (result.map_err(|error| error.to_string()), report)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|handle| handle.join().expect("a rank panicked"))
        .collect()
}

fn assert_both_retried(outcomes: &[(Result<usize, String>, SearchReport)]) {
    for (rank, (result, report)) in outcomes.iter().enumerate() {
        assert_eq!(result, &Ok(32), "rank {rank}: {report:?}");
        let tried: Vec<usize> = report
            .attempts()
            .map(|attempt| attempt.batch_size)
            .collect();
        assert_eq!(tried, [128, 64, 32], "rank {rank}");
    }
    // Rank 0's 128 and 64 fitted its device; it retried because rank 1's did not.
    let first = outcomes[0].1.attempts().next().expect("an attempt");
    assert!(!first.outcome.is_success(), "{first:?}");
}

#[test]
fn safe_point_composes_with_child_trial_error() {
    fn attempt(rank: &ThreadRank, size: usize, holds: usize) -> Result<usize, ChildTrialError> {
        let out_of_memory = size > holds;
        safe_point(rank, out_of_memory)?;
        if out_of_memory {
            return Err(ChildTrialError::OutOfMemory {
                batch_size: size,
                message: "CUDA out of memory".to_owned(),
                figures: OutOfMemory::new(),
            });
        }
        Ok(size)
    }
    assert_both_retried(&two_ranks(attempt));
}

#[test]
fn safe_point_composes_with_out_of_memory() {
    /// A step written against the simulated device's own error type.
    fn step(rank: &ThreadRank, size: usize, holds: usize) -> Result<usize, OutOfMemory> {
        let device = SimulatedDevice::new(holds as u64 * 1024);
        let forward_backward = device.alloc(size as u64 * 1024);
        safe_point(rank, forward_backward.is_err())?;
        let _activations = forward_backward?;
        Ok(size)
    }
    // A search returns "no size fits" through its function's error type, which
    // `OutOfMemory` cannot hold: the attempt wraps the step.
    fn attempt(rank: &ThreadRank, size: usize, holds: usize) -> Result<usize, StepError> {
        Ok(step(rank, size, holds)?)
    }
    #[derive(Debug, thiserror::Error)]
    enum StepError {
        #[error(transparent)]
        OutOfMemory(#[from] OutOfMemory),
        #[error(transparent)]
        NoSizeFits(#[from] batch_size_runtime::NoExecutableBatchSize),
    }
    assert_both_retried(&two_ranks(attempt));
}

#[test]
fn the_other_ranks_out_of_memory_reads_as_one() {
    let error = ChildTrialError::from(batch_size_runtime::agree::OutOfMemoryOnAnotherRank);
    assert_eq!(error.to_string(), "out of device memory on another rank");
    let error = OutOfMemory::from(batch_size_runtime::agree::OutOfMemoryOnAnotherRank);
    assert_eq!(error.to_string(), "out of device memory on another rank");
}
