//! Threads as ranks: every rank returns the same size or a clear error, and no test can hang
//! (each rank's result is awaited with a deadline).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{safe_point, Agree, ThreadRank, ThreadRanks};
use batch_size_runtime::policy::Guided;
use batch_size_runtime::{
    BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, SimulatedDevice, StopReason,
};

type Outcome = Result<usize, String>;

/// Runs one search per rank, on devices of `capacities` (MiB), with `body` deciding what each
/// rank does; waits at most 20 s for all of them.
fn ranks(
    capacities: &[u64],
    timeout: Duration,
    body: fn(usize, usize, &SimulatedDevice, &ThreadRank) -> anyhow::Result<usize>,
) -> Vec<Option<Outcome>> {
    let (sender, receiver) = mpsc::channel();
    let world = ThreadRanks::with_timeout(capacities.len(), timeout);
    for (rank, (collective, capacity)) in world.into_iter().zip(capacities).enumerate() {
        let sender = sender.clone();
        let device = SimulatedDevice::new(capacity << 20);
        thread::spawn(move || {
            let inside = collective.clone();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                BatchSizeSearch::new(256)
                    .with_release(device.clone())
                    .with_policy(Agree::new(Guided::new(), collective))
                    .run_dyn(|size| body(rank, size, &device, &inside))
            }));
            let outcome = match result {
                Ok(Ok(size)) => Ok(size),
                Ok(Err(error)) => Err(format!("{error:#}")),
                Err(_) => Err("panicked".to_owned()),
            };
            let _ = sender.send((rank, outcome));
        });
    }
    drop(sender);
    let mut outcomes = vec![None; capacities.len()];
    for _ in 0..capacities.len() {
        match receiver.recv_timeout(Duration::from_secs(20)) {
            Ok((rank, outcome)) => outcomes[rank] = Some(outcome),
            Err(_) => break, // a rank hung: reported as None
        }
    }
    outcomes
}

fn step(
    _rank: usize,
    size: usize,
    device: &SimulatedDevice,
    _: &ThreadRank,
) -> anyhow::Result<usize> {
    let _activations = device.alloc(size as u64 * (1 << 20))?; // 1 MiB a sample
    Ok(size)
}

#[test]
fn mixed_gpus_agree_on_the_smallest_fit() {
    for capacities in [
        &[200u64, 120][..],
        &[200, 120, 90, 300],
        &[64, 200, 128, 300, 90, 250, 180, 100],
    ] {
        let outcomes = ranks(capacities, Duration::from_secs(10), step);
        let sizes: Vec<usize> = outcomes
            .iter()
            .map(|outcome| outcome.clone().unwrap().unwrap())
            .collect();
        let smallest = *capacities.iter().min().unwrap() as usize;
        assert!(sizes.iter().all(|&size| size == sizes[0]), "{sizes:?}");
        assert!(
            sizes[0] <= smallest && sizes[0] * 2 > smallest / 2,
            "{sizes:?} for {capacities:?}"
        );
    }
}

#[test]
fn an_out_of_memory_on_one_rank_only_makes_all_retry() {
    // Only rank 2 runs short; the others could run 256.
    let outcomes = ranks(&[1000, 1000, 100, 1000], Duration::from_secs(10), step);
    let sizes: Vec<usize> = outcomes
        .iter()
        .map(|outcome| outcome.clone().unwrap().unwrap())
        .collect();
    assert!(
        sizes.iter().all(|&size| size == sizes[0] && size <= 100),
        "{sizes:?}"
    );
}

#[test]
fn a_rank_failing_otherwise_stops_the_others_naming_it() {
    fn body(
        rank: usize,
        size: usize,
        device: &SimulatedDevice,
        _: &ThreadRank,
    ) -> anyhow::Result<usize> {
        if rank == 1 {
            anyhow::bail!("rank 1 lost its data loader");
        }
        step(rank, size, device, &ThreadRanks::new(1).remove(0))
    }
    let outcomes = ranks(&[500, 500, 500], Duration::from_secs(10), body);
    assert_eq!(
        outcomes[1].clone().unwrap().unwrap_err(),
        "rank 1 lost its data loader"
    );
    for rank in [0, 2] {
        let error = outcomes[rank].clone().unwrap().unwrap_err();
        assert!(error.contains("rank 1 failed"), "{error}");
    }
}

#[test]
fn a_rank_panicking_stops_the_others() {
    fn body(
        rank: usize,
        size: usize,
        device: &SimulatedDevice,
        _: &ThreadRank,
    ) -> anyhow::Result<usize> {
        if rank == 0 {
            panic!("index out of bounds");
        }
        step(rank, size, device, &ThreadRanks::new(1).remove(0))
    }
    std::panic::set_hook(Box::new(|_| {}));
    let outcomes = ranks(&[500, 500], Duration::from_secs(10), body);
    let _ = std::panic::take_hook();
    assert_eq!(outcomes[0].clone().unwrap().unwrap_err(), "panicked");
    assert!(outcomes[1]
        .clone()
        .unwrap()
        .unwrap_err()
        .contains("rank 0 failed"));
}

#[test]
fn a_rank_that_never_joins_times_out_instead_of_hanging() {
    let world = ThreadRanks::with_timeout(3, Duration::from_millis(200));
    let (sender, receiver) = mpsc::channel();
    // Ranks 0 and 1 search; rank 2 never starts.
    for collective in world.into_iter().take(2) {
        let sender = sender.clone();
        thread::spawn(move || {
            let result: anyhow::Result<usize> = BatchSizeSearch::new(8)
                .with_policy(Agree::new(Guided::new(), collective))
                .run_dyn(Ok);
            let _ = sender.send(result.map_err(|error| {
                error
                    .downcast_ref::<NoExecutableBatchSize>()
                    .map(|none| none.reason().clone())
            }));
        });
    }
    for _ in 0..2 {
        let result = receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("a rank hung");
        match result {
            Err(Some(StopReason::Policy(why))) => assert!(why.contains("could not agree"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn the_safe_point_turns_one_ranks_out_of_memory_into_everyones() {
    fn body(
        rank: usize,
        size: usize,
        _: &SimulatedDevice,
        collective: &ThreadRank,
    ) -> anyhow::Result<usize> {
        // Rank 1's backward pass runs out of memory above 64; nobody enters the gradient
        // all-reduce alone.
        let local_oom = rank == 1 && size > 64;
        safe_point(collective, local_oom)?;
        if local_oom {
            Err(OutOfMemory::new())?;
        }
        Ok(size)
    }
    let outcomes = ranks(&[10_000, 10_000, 10_000], Duration::from_secs(10), body);
    let sizes: Vec<usize> = outcomes
        .iter()
        .map(|outcome| outcome.clone().unwrap().unwrap())
        .collect();
    assert!(
        sizes.iter().all(|&size| size == sizes[0] && size <= 64),
        "{sizes:?}"
    );
}
