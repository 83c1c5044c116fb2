//! Threads as ranks: every rank returns the same size or a clear error, and no test can hang
//! (each rank's result is awaited with a deadline).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{safe_point, Agree, ThreadRank, ThreadRanks};
use batch_size_runtime::policy::Guided;
use batch_size_runtime::{
    memory::SimulatedDevice, BatchSizeSearch, NoExecutableBatchSize, OutOfMemory, StopReason,
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
                    .run(|size| body(rank, size, &device, &inside))
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
                .run(Ok);
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
            Err(Some(StopReason::Agreement(why))) => {
                assert!(why.contains("could not agree"), "{why}")
            }
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

/// Four ranks train six steps of 64 samples with gradient accumulation; at step 3 rank 2's
/// device loses room (another tenant, fragmentation) and runs out of memory in the middle of
/// its micro-batches. Every rank redoes step 3 with the same smaller micro-batch, and every
/// optimizer step runs on all ranks together (the gradient all-reduce in `apply` would time
/// out otherwise).
#[test]
fn an_out_of_memory_in_the_middle_of_an_effective_batch_on_one_rank_redoes_the_step_everywhere() {
    use batch_size_runtime::agree::{Collective, ReduceOp};
    use batch_size_runtime::EffectiveBatch;

    let capacities = [64u64, 48, 40, 64];
    let world = ThreadRanks::with_timeout(capacities.len(), Duration::from_secs(5));
    let (sender, receiver) = mpsc::channel();
    for (rank, (collective, capacity)) in world.into_iter().zip(capacities).enumerate() {
        let sender = sender.clone();
        thread::spawn(move || {
            let device = SimulatedDevice::new(capacity << 20);
            let mut runner = EffectiveBatch::new(64)
                .with_release(device.clone())
                .with_agreement(&collective);
            let mut micro_per_step = Vec::new();
            let mut accumulated_per_step = Vec::new();
            let mut held = None;
            let result = (0..6).try_for_each(|step| {
                if step == 3 && rank == 2 {
                    held = Some(device.alloc(24 << 20)?); // 24 MiB taken from under rank 2
                }
                runner.step_then(
                    |plan| -> anyhow::Result<usize> {
                        let mut samples = 0;
                        for micro in plan.micro_batches() {
                            // 1 MiB a sample, held for the micro-batch's forward and backward.
                            let _activations = device.alloc((micro.range.len() as u64) << 20)?;
                            samples += micro.range.len();
                        }
                        Ok(samples)
                    },
                    |plan, samples| {
                        // The gradient all-reduce: every rank must be here at every step.
                        let mut gradient = [samples as u64];
                        collective.all_reduce(&mut gradient, ReduceOp::Min)?;
                        micro_per_step.push(plan.micro());
                        accumulated_per_step.push(gradient[0]);
                        Ok(())
                    },
                )
            });
            let recoveries: Vec<usize> = runner.recoveries().iter().map(|r| r.step).collect();
            let _ = sender.send((
                rank,
                result.map_err(|error| format!("{error:#}")),
                micro_per_step,
                accumulated_per_step,
                recoveries,
            ));
        });
    }
    drop(sender);
    let mut seen = Vec::new();
    for _ in 0..capacities.len() {
        seen.push(
            receiver
                .recv_timeout(Duration::from_secs(20))
                .expect("a rank hung"),
        );
    }
    seen.sort_by_key(|(rank, ..)| *rank);
    let reference = &seen[0].2;
    assert_eq!(reference.len(), 6, "six optimizer steps: {seen:?}");
    for (rank, result, micro_per_step, accumulated, recoveries) in &seen {
        assert!(result.is_ok(), "rank {rank}: {result:?}");
        assert_eq!(micro_per_step, reference, "rank {rank} kept another plan");
        // Every step accumulated exactly the effective batch, on every rank.
        assert_eq!(accumulated, &vec![64; 6], "rank {rank}");
        // The first step fitted the smallest device; step 3 was redone on every rank.
        assert!(recoveries.contains(&3), "rank {rank}: {recoveries:?}");
    }
    assert!(reference[0] <= 40, "{reference:?}");
    assert!(reference[3] < reference[2], "step 3 shrank: {reference:?}");
    assert!(reference[3] <= 16, "rank 2 has 16 MiB left: {reference:?}");
}

/// A policy that explores upward after a success on one rank only (a tuner that sees more room
/// there) must not lead that rank into attempts the others do not run: all end together on
/// the size that ran everywhere.
#[test]
fn ranks_whose_policies_disagree_after_a_success_end_together() {
    use batch_size_runtime::policy::{Decision, SizePolicy};
    use batch_size_runtime::SearchReport;

    #[derive(Debug)]
    struct GrowOnce {
        grows: bool,
    }
    impl SizePolicy for GrowOnce {
        fn after(&mut self, history: &SearchReport) -> Decision {
            let last = history.last().unwrap();
            match (last.outcome.is_success(), self.grows) {
                (true, true) => {
                    self.grows = false;
                    Decision::Try(last.batch_size * 2)
                }
                (true, false) => Decision::Accept,
                (false, _) => Decision::Try(last.batch_size / 2),
            }
        }
    }

    let world = ThreadRanks::with_timeout(3, Duration::from_secs(5));
    let handles: Vec<_> = world
        .into_iter()
        .enumerate()
        .map(|(rank, collective)| {
            thread::spawn(move || {
                BatchSizeSearch::new(16)
                    .with_policy(GrowOnce { grows: rank == 1 })
                    .with_agreement(collective)
                    .run_with_report(|size| -> anyhow::Result<usize> { Ok(size) })
            })
        })
        .collect();
    for handle in handles {
        let (result, report) = handle.join().unwrap();
        assert_eq!(result.unwrap(), 16);
        assert_eq!(report.len(), 1, "no rank ran an attempt alone");
    }
}

/// When every rank's policy asks for more after a success, they go on together at the
/// smallest proposal.
#[test]
fn ranks_that_all_explore_go_on_together_at_the_smallest_proposal() {
    use batch_size_runtime::policy::{Decision, SizePolicy};
    use batch_size_runtime::SearchReport;

    #[derive(Debug)]
    struct Doubling {
        limit: usize,
    }
    impl SizePolicy for Doubling {
        fn after(&mut self, history: &SearchReport) -> Decision {
            let last = history.last().unwrap();
            if last.outcome.is_success() && last.batch_size * 2 <= self.limit {
                Decision::Try(last.batch_size * 2)
            } else {
                Decision::Accept
            }
        }
    }

    let world = ThreadRanks::with_timeout(2, Duration::from_secs(5));
    let handles: Vec<_> = world
        .into_iter()
        .zip([64usize, 16])
        .map(|(collective, limit)| {
            thread::spawn(move || {
                BatchSizeSearch::new(4)
                    .with_policy(Doubling { limit })
                    .with_agreement(collective)
                    .run_with_report(|size| -> anyhow::Result<usize> { Ok(size) })
            })
        })
        .collect();
    for handle in handles {
        let (result, report) = handle.join().unwrap();
        assert_eq!(result.unwrap(), 16);
        let sizes: Vec<usize> = report.attempts().map(|a| a.batch_size).collect();
        assert_eq!(sizes, [4, 8, 16]);
    }
}

/// Tensor-parallel chunks: every chunk of every rank holds a collective (behind the safe
/// point). Three ranks of different sizes run 2,000 items; rank 1 loses room after item 900.
/// Every rank runs the same chunks, redoes the same ones, and returns every output once.
#[test]
fn chunks_that_communicate_run_in_step_and_a_chunk_that_fails_anywhere_is_redone_everywhere() {
    use batch_size_runtime::agree::{Collective, ReduceOp};
    use batch_size_runtime::{ChunkRecord, Chunked};

    let world = ThreadRanks::with_timeout(3, Duration::from_secs(5));
    let (sender, receiver) = mpsc::channel();
    for (rank, (collective, holds)) in world.into_iter().zip([600usize, 400, 250]).enumerate() {
        let sender = sender.clone();
        thread::spawn(move || {
            let mut chunked = Chunked::new(2000).with_agreement(&collective);
            let outcome = chunked.run(|items| -> anyhow::Result<Vec<u64>> {
                let room = if rank == 1 && items.start >= 900 {
                    90
                } else {
                    holds
                };
                let out_of_memory = items.len() > room;
                safe_point(&collective, out_of_memory)?;
                if out_of_memory {
                    Err(OutOfMemory::new())?
                }
                let mut shard = [items.len() as u64];
                collective.all_reduce(&mut shard, ReduceOp::Min)?; // the chunk's collective
                assert_eq!(
                    shard[0],
                    items.len() as u64,
                    "every rank runs the same chunk"
                );
                Ok(items.map(|item| item as u64 * 3).collect())
            });
            let records: Vec<ChunkRecord> = chunked.chunks().to_vec();
            let _ = sender.send((rank, outcome.map_err(|e| e.to_string()), records));
        });
    }
    drop(sender);
    let mut seen: Vec<_> = (0..3)
        .map(|_| {
            receiver
                .recv_timeout(Duration::from_secs(20))
                .expect("a rank hung")
        })
        .collect();
    seen.sort_by_key(|(rank, ..)| *rank);
    let expected: Vec<u64> = (0..2000u64).map(|item| item * 3).collect();
    for (rank, outcome, records) in &seen {
        assert_eq!(outcome.as_ref().unwrap(), &expected, "rank {rank}");
        assert_eq!(records, &seen[0].2, "rank {rank} ran other chunks");
    }
    let records = &seen[0].2;
    assert!(records
        .iter()
        .all(|record| record.range.len() <= 250 || !record.done));
    let late = records.iter().filter(|r| r.done && r.range.start >= 900);
    assert!(
        late.clone().all(|record| record.range.len() <= 90),
        "{records:?}"
    );
    assert!(records
        .iter()
        .any(|record| !record.done && record.range.start >= 900));
}

/// Data-parallel chunks of different lengths (no collective inside): a rank that is done
/// answers the others until they are done; nobody waits forever.
#[test]
fn ranks_with_different_amounts_of_work_all_finish() {
    use batch_size_runtime::Chunked;

    let world = ThreadRanks::with_timeout(3, Duration::from_secs(5));
    let handles: Vec<_> = world
        .into_iter()
        .zip([10usize, 1000, 300])
        .map(|(collective, total)| {
            thread::spawn(move || {
                Chunked::new(total)
                    .with_starting(64)
                    .with_agreement(collective)
                    .run(|items| -> anyhow::Result<Vec<usize>> { Ok(items.collect()) })
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for (handle, total) in handles.into_iter().zip([10usize, 1000, 300]) {
        let outputs = handle.join().unwrap().unwrap();
        assert_eq!(outputs, (0..total).collect::<Vec<_>>());
    }
}

/// One rank's chunk fails with an error that is not out-of-memory: it gets its error back;
/// the others stop with an error naming it.
#[test]
fn a_chunk_failing_otherwise_on_one_rank_stops_the_others() {
    use batch_size_runtime::{ChunkError, Chunked};

    let world = ThreadRanks::with_timeout(2, Duration::from_secs(5));
    let handles: Vec<_> = world
        .into_iter()
        .enumerate()
        .map(|(rank, collective)| {
            thread::spawn(move || {
                Chunked::new(100)
                    .with_starting(10)
                    .with_agreement(collective)
                    .for_each(|items| -> anyhow::Result<()> {
                        if rank == 1 && items.start >= 30 {
                            anyhow::bail!("corrupt record {}", items.start);
                        }
                        Ok(())
                    })
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .map(|handle| handle.join().unwrap())
        .collect();
    match &results[1] {
        Err(ChunkError::Failed { completed, error }) => {
            assert_eq!(*completed, 30);
            assert_eq!(error.to_string(), "corrupt record 30");
        }
        other => panic!("{other:?}"),
    }
    let other = results[0].as_ref().unwrap_err().to_string();
    assert!(other.contains("rank 1 failed"), "{other}");
}

/// Ranks that meet in collectives of different lengths are out of step: an error, not a
/// panic or a wrong result.
#[test]
fn collectives_of_different_lengths_are_an_error() {
    use batch_size_runtime::agree::{Collective, ReduceOp};

    let world = ThreadRanks::with_timeout(2, Duration::from_secs(5));
    let handles: Vec<_> = world
        .into_iter()
        .enumerate()
        .map(|(rank, collective)| {
            thread::spawn(move || {
                let mut values = vec![1u64; rank + 1];
                collective
                    .all_reduce(&mut values, ReduceOp::Max)
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for handle in handles {
        let error = handle.join().unwrap().unwrap_err();
        assert!(error.contains("out of step"), "{error}");
    }
}

/// A rank that finished its items waits for the others; when one of them meets an item too
/// large for any chunk, every busy rank stops, and the finished one returns its outputs at
/// once instead of waiting for a round nobody will join.
#[test]
fn a_finished_rank_returns_at_once_when_the_others_stop() {
    use batch_size_runtime::Chunked;

    let timeout = Duration::from_secs(3);
    let world = ThreadRanks::with_timeout(3, timeout);
    let started = std::time::Instant::now();
    let handles: Vec<_> = world
        .into_iter()
        .zip([10usize, 1000, 1000])
        .enumerate()
        .map(|(rank, (collective, total))| {
            thread::spawn(move || {
                Chunked::new(total)
                    .with_starting(64)
                    .with_agreement(collective)
                    .run(|items| -> anyhow::Result<Vec<usize>> {
                        if rank == 1 && items.contains(&500) {
                            Err(OutOfMemory::new())? // item 500 never fits on rank 1
                        }
                        Ok(items.collect())
                    })
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(results[0].as_ref().unwrap(), &(0..10).collect::<Vec<_>>());
    assert!(
        results[1].as_ref().unwrap_err().contains("item 500"),
        "{results:?}"
    );
    assert!(results[2].is_err(), "{results:?}");
    assert!(
        started.elapsed() < timeout,
        "the finished rank waited for the timeout"
    );
}
