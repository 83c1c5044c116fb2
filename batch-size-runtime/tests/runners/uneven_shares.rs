//! One global batch split into per-rank shares on mixed GPUs (`with_uneven_shares`): ranks as
//! threads, each on a simulated device of its own capacity and speed, time measured by a
//! simulated clock (no wall clock anywhere). Every step's gradient, the SUM of the ranks'
//! weighted gradients, is the whole global batch's; the shares tile the global batch; after
//! rebalancing the slowest rank's step is within 10 % of the others'; an out-of-memory on one
//! rank in the middle of training is recovered in place, with the same parameters as a run
//! without it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{Collective, ThreadRank, ThreadRanks};

use crate::training;

use batch_size_runtime::{
    memory::SimulatedDevice, BatchPlan, EffectiveBatch, NoExecutableBatchSize, OutOfMemory,
    StopReason,
};
use training::mean_gradient;

/// Activations of one sample.
const PER_SAMPLE: u64 = 1 << 20;
/// Kernel launches and the optimizer's bookkeeping of one micro-batch, in simulated ns.
const PASS_OVERHEAD: u64 = 20_000;

/// One GPU: how many samples it holds, and how long one sample takes (simulated ns).
#[derive(Debug, Clone, Copy)]
struct Gpu {
    holds: u64,
    per_sample: u64,
}

const fn gpu(holds: u64, per_sample: u64) -> Gpu {
    Gpu { holds, per_sample }
}

/// A SUM all-reduce of two floats between threads (the gradient all-reduce of the test).
struct SumReduce {
    barrier: Barrier,
    parts: Mutex<Vec<[f64; 2]>>,
}

impl SumReduce {
    fn new(world: usize) -> Self {
        SumReduce {
            barrier: Barrier::new(world),
            parts: Mutex::new(vec![[0.0; 2]; world]),
        }
    }

    fn sum(&self, rank: usize, part: [f64; 2]) -> [f64; 2] {
        self.parts.lock().unwrap()[rank] = part;
        self.barrier.wait();
        let total = self
            .parts
            .lock()
            .unwrap()
            .iter()
            .fold([0.0; 2], |sum, p| [sum[0] + p[0], sum[1] + p[1]]);
        self.barrier.wait(); // nobody writes the next step's part before all have read
        total
    }
}

/// What one rank saw at each step.
#[derive(Debug, Clone)]
struct StepSeen {
    share: Range<usize>,
    micro: usize,
    /// Simulated time of the step's successful accumulation.
    time: u64,
    /// The SUM of the weighted gradients, and the whole batch's gradient computed directly.
    summed: [f64; 2],
    whole: [f64; 2],
}

struct Run {
    steps: Vec<Vec<StepSeen>>, // per rank
    parameters: Vec<[f64; 2]>, // per rank, at the end
    recovered_at: Vec<Vec<usize>>,
}

/// Trains `steps` steps of a global batch of `global` on `gpus`, one thread a rank; with
/// `fail`, rank `fail.0` runs out of memory once at step `fail.1`.
fn train(gpus: &[Gpu], global: usize, steps: usize, fail: Option<(usize, usize)>) -> Run {
    let world = gpus.len();
    let reduce = SumReduce::new(world);
    let results: Vec<(Vec<StepSeen>, [f64; 2], Vec<usize>)> = thread::scope(|scope| {
        let handles: Vec<_> = ThreadRanks::with_timeout(world, Duration::from_secs(20))
            .into_iter()
            .zip(gpus.iter().copied())
            .map(|(rank, gpu)| {
                let reduce = &reduce;
                scope.spawn(move || rank_main(rank, gpu, global, steps, fail, reduce))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    Run {
        steps: results.iter().map(|r| r.0.clone()).collect(),
        parameters: results.iter().map(|r| r.1).collect(),
        recovered_at: results.iter().map(|r| r.2.clone()).collect(),
    }
}

fn rank_main(
    rank: ThreadRank,
    gpu: Gpu,
    global: usize,
    steps: usize,
    fail: Option<(usize, usize)>,
    reduce: &SumReduce,
) -> (Vec<StepSeen>, [f64; 2], Vec<usize>) {
    let me = rank.rank();
    let device = SimulatedDevice::new(gpu.holds * PER_SAMPLE);
    let clock = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&clock);
    let mut runner = EffectiveBatch::new(global)
        .with_release(device.clone())
        .with_agreement(&rank)
        .with_uneven_shares()
        .with_clock(move || Duration::from_nanos(read.load(Ordering::SeqCst)));
    let mut w = [0.0f64; 2];
    let mut seen = Vec::new();
    for step in 0..steps {
        let mut fail_now = fail == Some((me, step));
        let summed = runner
            .step_then(
                |plan: &BatchPlan| -> anyhow::Result<([f64; 2], u64)> {
                    if std::mem::take(&mut fail_now) {
                        Err(OutOfMemory::new())?; // another process took memory, once
                    }
                    let started = clock.load(Ordering::SeqCst);
                    let mut gradient = [0.0; 2];
                    for micro in plan.micro_batches() {
                        let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                        clock.fetch_add(
                            PASS_OVERHEAD + micro.range.len() as u64 * gpu.per_sample,
                            Ordering::SeqCst,
                        );
                        let part = mean_gradient(&w, step, micro.range.clone());
                        gradient[0] += micro.weight * part[0];
                        gradient[1] += micro.weight * part[1];
                    }
                    Ok((gradient, clock.load(Ordering::SeqCst) - started))
                },
                |plan, (gradient, time)| {
                    let summed = reduce.sum(me, gradient); // SUM, not mean
                    seen.push(StepSeen {
                        share: plan.share(),
                        micro: plan.micro(),
                        time,
                        summed,
                        whole: mean_gradient(&w, step, 0..global),
                    });
                    Ok(summed)
                },
            )
            .unwrap_or_else(|error| panic!("rank {me}, step {step}: {error:#}"));
        w[0] -= 0.1 * summed[0];
        w[1] -= 0.1 * summed[1];
    }
    assert_eq!(runner.steps(), steps);
    let recovered = runner.recoveries().iter().map(|r| r.step).collect();
    (seen, w, recovered)
}

/// The checks every run must pass: exact gradients, shares that tile the global batch, and
/// (from step `balanced_from` on) the slowest rank within 10 % of the fastest.
fn check(run: &Run, global: usize, balanced_from: usize) {
    let world = run.steps.len();
    let steps = run.steps[0].len();
    for step in 0..steps {
        let mut shares: Vec<Range<usize>> = (0..world)
            .map(|r| run.steps[r][step].share.clone())
            .collect();
        shares.sort_by_key(|share| share.start);
        let mut next = 0;
        for share in &shares {
            assert_eq!(share.start, next, "step {step}: shares {shares:?}");
            assert!(
                !share.is_empty(),
                "step {step}: an empty share in {shares:?}"
            );
            next = share.end;
        }
        assert_eq!(
            next, global,
            "step {step}: the shares add up to the global batch"
        );
        for rank in 0..world {
            let seen = &run.steps[rank][step];
            for (summed, whole) in seen.summed.iter().zip(seen.whole) {
                assert!(
                    (summed - whole).abs() < 1e-9,
                    "step {step}, rank {rank}: summed {:?}, whole batch {:?}",
                    seen.summed,
                    seen.whole
                );
            }
        }
        if step >= balanced_from {
            let times: Vec<u64> = (0..world).map(|r| run.steps[r][step].time).collect();
            let (slowest, fastest) = (*times.iter().max().unwrap(), *times.iter().min().unwrap());
            assert!(
                slowest as f64 <= fastest as f64 * 1.10,
                "step {step}: step times {times:?} (shares {:?}, micro {:?})",
                (0..world)
                    .map(|r| run.steps[r][step].share.len())
                    .collect::<Vec<_>>(),
                (0..world)
                    .map(|r| run.steps[r][step].micro)
                    .collect::<Vec<_>>(),
            );
        }
    }
}

#[test]
fn two_ranks_a_large_fast_gpu_and_a_small_slow_one() {
    let gpus = [gpu(256, 1_000), gpu(24, 3_000)];
    let run = train(&gpus, 256, 8, None);
    check(&run, 256, 4);
    let last = |rank: usize| run.steps[rank].last().unwrap().clone();
    // The fast GPU takes about three quarters of the batch, in one pass; the small one runs
    // its share at the micro-batch it holds.
    assert!(last(0).share.len() > 180, "{:?}", last(0));
    assert!(last(1).micro <= 24, "{:?}", last(1));
    assert!(run.recovered_at[0].is_empty() || run.recovered_at[0] == [0]);
}

#[test]
fn four_ranks_of_mixed_capacity_and_speed() {
    let gpus = [
        gpu(800, 1_000),
        gpu(250, 1_900),
        gpu(500, 1_700),
        gpu(160, 4_800),
    ];
    let run = train(&gpus, 512, 10, None);
    check(&run, 512, 5);
}

#[test]
fn eight_ranks_of_mixed_capacity_and_speed() {
    let gpus = [
        gpu(400, 1_000),
        gpu(100, 1_000),
        gpu(60, 2_500),
        gpu(300, 1_500),
        gpu(40, 4_000),
        gpu(200, 2_000),
        gpu(120, 1_200),
        gpu(80, 3_000),
    ];
    let run = train(&gpus, 1024, 10, None);
    check(&run, 1024, 5);
}

#[test]
fn an_out_of_memory_on_one_rank_mid_training_is_recovered_in_place() {
    let gpus = [gpu(256, 1_000), gpu(64, 2_000), gpu(128, 1_500)];
    let clean = train(&gpus, 384, 8, None);
    let failed = train(&gpus, 384, 8, Some((1, 5)));
    check(&failed, 384, 8);
    // Step 5 was redone on every rank (and no step before it).
    for rank in 0..3 {
        assert!(
            failed.recovered_at[rank].contains(&5),
            "rank {rank}: recovered at {:?}",
            failed.recovered_at[rank]
        );
        assert!(!clean.recovered_at[rank].contains(&5));
    }
    // Only the rank that ran out of memory shrank its micro-batch.
    let micro = |run: &Run, rank: usize, step: usize| run.steps[rank][step].micro;
    assert!(micro(&failed, 1, 5) < micro(&failed, 1, 4));
    for rank in [0, 2] {
        let (before, after) = (
            failed.steps[rank][4].share.len(),
            failed.steps[rank][5].share.len(),
        );
        // The shares do not change inside a step: the redone step ran the same shares.
        assert_eq!(
            failed.steps[rank][5].share, clean.steps[rank][5].share,
            "rank {rank}"
        );
        let _ = (before, after);
        assert_eq!(
            micro(&failed, rank, 5),
            micro(&clean, rank, 5),
            "rank {rank}"
        );
    }
    // Every step's gradient was the whole batch's: the parameters are those of the clean run.
    for rank in 0..3 {
        for (a, b) in failed.parameters[rank].iter().zip(clean.parameters[rank]) {
            assert!((a - b).abs() < 1e-9, "rank {rank}: {a} against {b}");
        }
    }
}

#[test]
fn without_an_agreement_one_rank_holds_the_whole_batch() {
    let mut runner = EffectiveBatch::new(100).with_uneven_shares().with_micro(40);
    let plan = runner
        .step(|plan| -> anyhow::Result<BatchPlan> { Ok(plan.clone()) })
        .unwrap();
    assert_eq!(plan.share(), 0..100);
    assert_eq!((plan.micro(), plan.accumulation()), (34, 3)); // 34 + 33 + 33
    assert_eq!(runner.shares(), std::iter::once(0..100).collect::<Vec<_>>());
}

#[test]
fn a_global_batch_smaller_than_the_world_is_a_clear_error() {
    let results: Vec<String> = thread::scope(|scope| {
        let handles: Vec<_> = ThreadRanks::with_timeout(3, Duration::from_secs(10))
            .into_iter()
            .map(|rank| {
                scope.spawn(move || {
                    let mut runner = EffectiveBatch::new(2)
                        .with_agreement(rank)
                        .with_uneven_shares();
                    let error = runner.step(|_| anyhow::Ok(())).unwrap_err();
                    error.to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for message in results {
        assert!(message.contains("at least one sample a rank"), "{message}");
    }
}

#[test]
fn every_rank_computes_the_same_shares() {
    let gpus = [gpu(100, 1_000), gpu(30, 2_000), gpu(70, 1_000)];
    let run = train(&gpus, 300, 6, None);
    check(&run, 300, 6);
    for step in 0..6 {
        let starts: Vec<usize> = (0..3).map(|r| run.steps[r][step].share.start).collect();
        assert!(
            starts.windows(2).all(|pair| pair[0] < pair[1]),
            "step {step}: {starts:?}"
        );
    }
    // The all-gather the shares are agreed over gives every rank every rank's figure.
    let gathered: Vec<Vec<u64>> = thread::scope(|scope| {
        let handles: Vec<_> = ThreadRanks::new(3)
            .into_iter()
            .map(|rank| scope.spawn(move || rank.all_gather(rank.rank() as u64 * 5).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(gathered, vec![vec![0, 5, 10]; 3]);
}

/// One rank whose all-gather fails: the step's agreement works, the shares' does not.
#[derive(Debug)]
struct GatherFails(ThreadRank);

impl Collective for GatherFails {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(
        &self,
        values: &mut [u64],
        op: batch_size_runtime::agree::ReduceOp,
    ) -> Result<(), batch_size_runtime::agree::AgreementError> {
        self.0.all_reduce(values, op)
    }
    fn all_gather(&self, _: u64) -> Result<Vec<u64>, batch_size_runtime::agree::AgreementError> {
        Err(batch_size_runtime::agree::AgreementError::Failed(
            "the network went down".to_owned(),
        ))
    }
}

#[test]
fn shares_that_cannot_be_agreed_after_a_step_are_their_own_error() {
    let rank = ThreadRanks::new(1).remove(0);
    let mut runner = EffectiveBatch::new(64)
        .with_agreement(GatherFails(rank))
        .with_uneven_shares();
    let mut ran = 0;
    let error = runner
        .step(|_| -> anyhow::Result<()> {
            ran += 1;
            Ok(())
        })
        .unwrap_err();
    assert_eq!(ran, 1, "the step ran");
    let error = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    assert!(
        matches!(
            error.reason(),
            StopReason::SharesNotAgreed { after_step: 0, error } if error.contains("network went down")
        ),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.starts_with("step 0 ran, but the ranks could not agree"),
        "{message}"
    );
    assert!(!message.contains("No executable batch size"), "{message}");
}
