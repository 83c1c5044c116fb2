//! Data-parallel training on four GPUs of different sizes, each rank a thread with its own
//! simulated device: the ranks agree on one batch size (the largest the smallest GPU holds),
//! then train with gradient accumulation; when one GPU loses room in the middle of training,
//! every rank redoes that step with the same smaller micro-batch, and every gradient
//! all-reduce still finds all four ranks. Then the same global batch split into uneven shares
//! (`with_uneven_shares`): each GPU at its own micro-batch, the shares following each GPU's
//! speed, beside the agreed smallest size, on simulated clocks. Over NCCL the same code takes
//! an `NcclRank` instead of a `ThreadRank` (feature `nccl`; see the README).
//!
//! ```text
//! cargo run -p batch-size-examples --example data_parallel
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{safe_point, Collective, ReduceOp, ThreadRank, ThreadRanks};
use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{find_executable_batch_size, memory::SimulatedDevice, EffectiveBatch};

/// Activations of one sample during its forward and backward pass.
const PER_SAMPLE: u64 = 96 << 20;
/// The GPUs: an 80 GiB, a 24 GiB, a 48 GiB and a 16 GiB card.
const GPUS: [(&str, u64); 4] = [
    ("A100 80GB", 80),
    ("RTX 4090 24GB", 24),
    ("L40S 48GB", 48),
    ("T4 16GB", 16),
];
const STEPS: usize = 8;
/// Simulated time of one sample's forward and backward pass on each GPU, in microseconds
/// (roughly their dense half-precision speeds), and of launching one micro-batch.
const MICROS_PER_SAMPLE: [u64; 4] = [1_000, 1_900, 1_700, 4_800];
const MICROS_PER_PASS: u64 = 3_000;

/// One rank's part of the search: forward and backward at `batch_size`, then the safe point
/// before the gradient all-reduce, where every rank learns whether one ran out of memory.
#[find_executable_batch_size(starting = 512, agree = rank, release = device.clone())]
fn find_batch_size(
    batch_size: usize,
    rank: &ThreadRank,
    device: &SimulatedDevice,
    tried: &Mutex<Vec<usize>>,
) -> anyhow::Result<usize> {
    tried
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .push(batch_size);
    let forward_backward = device.alloc(batch_size as u64 * PER_SAMPLE);
    safe_point(rank, forward_backward.is_err())?;
    let _activations = forward_backward?;
    let mut gradients = [1];
    rank.all_reduce(&mut gradients, ReduceOp::Max)?; // the gradient all-reduce
    Ok(batch_size)
}

/// What a rank saw.
struct Story {
    tried: Vec<usize>,
    agreed: usize,
    micro_per_step: Vec<usize>,
    redone: Vec<usize>,
}

fn rank_main(rank: ThreadRank, device: SimulatedDevice) -> anyhow::Result<Story> {
    // 1. The largest batch every GPU holds.
    let tried = Mutex::new(Vec::new());
    let agreed = find_batch_size(&rank, &device, &tried)?;

    // 2. Training at that effective batch with accumulation; on step 4 another process takes
    //    10 GiB of the T4 (rank 3).
    let mut runner = EffectiveBatch::new(agreed)
        .with_release(device.clone())
        .with_agreement(&rank);
    let mut micro_per_step = Vec::new();
    let mut taken = None;
    for step in 0..STEPS {
        if step == 4 && rank.rank() == 3 {
            taken = Some(device.alloc(10 << 30)?);
        }
        runner.step_then(
            |plan| -> anyhow::Result<usize> {
                let mut samples = 0;
                for micro in plan.micro_batches() {
                    let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                    samples += micro.range.len(); // forward and backward of the micro-batch
                }
                Ok(samples)
            },
            |plan, samples| {
                // Every rank is here, or none is: the gradient all-reduce, then the optimizer.
                let mut gradients = [samples as u64];
                rank.all_reduce(&mut gradients, ReduceOp::Min)?;
                micro_per_step.push(plan.micro());
                Ok(())
            },
        )?;
    }
    drop(taken);
    let redone = runner.recoveries().iter().map(|r| r.step).collect();
    Ok(Story {
        tried: tried
            .into_inner()
            .map_err(|_| anyhow::anyhow!("poisoned"))?,
        agreed,
        micro_per_step,
        redone,
    })
}

/// One step of one rank, as the speed comparison saw it.
#[derive(Debug, Clone, Copy)]
struct Timed {
    share: usize,
    micro: usize,
    /// Simulated microseconds of the step's forward and backward passes.
    time: u64,
}

/// Trains `STEPS` steps on one rank with a simulated clock and returns each step's timing:
/// with `shares`, the global batch of `global` split into uneven shares; without, every rank
/// runs `global / world` samples at the micro-batch all agree on.
fn timed_rank(
    rank: ThreadRank,
    device: SimulatedDevice,
    per_sample: u64,
    global: usize,
    shares: bool,
) -> anyhow::Result<Vec<Timed>> {
    let clock = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&clock);
    let world = rank.world_size();
    let mut runner = if shares {
        EffectiveBatch::new(global)
            .with_uneven_shares()
            .with_clock(move || Duration::from_micros(read.load(Ordering::Relaxed)))
    } else {
        EffectiveBatch::new(global / world)
    }
    .with_release(device.clone())
    .with_agreement(&rank);
    let mut timed = Vec::new();
    let mut taken = None;
    for step in 0..STEPS {
        if step == 4 && rank.rank() == 3 {
            taken = Some(device.alloc(10 << 30)?);
        }
        runner.step_then(
            |plan| -> anyhow::Result<u64> {
                let started = clock.load(Ordering::Relaxed);
                for micro in plan.micro_batches() {
                    let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                    let time = MICROS_PER_PASS + micro.range.len() as u64 * per_sample;
                    clock.fetch_add(time, Ordering::Relaxed); // forward and backward
                }
                Ok(clock.load(Ordering::Relaxed) - started)
            },
            |plan, time| {
                let mut gradients = [1];
                rank.all_reduce(&mut gradients, ReduceOp::Max)?; // SUM of weighted gradients
                timed.push(Timed {
                    share: plan.share().len(),
                    micro: plan.micro(),
                    time,
                });
                Ok(())
            },
        )?;
    }
    drop(taken);
    Ok(timed)
}

/// Both ways of training the same global batch on the four GPUs, rank by rank.
fn compare(global: usize) -> anyhow::Result<[Vec<Vec<Timed>>; 2]> {
    let run = |shares: bool| -> anyhow::Result<Vec<Vec<Timed>>> {
        let ranks = ThreadRanks::with_timeout(GPUS.len(), Duration::from_secs(30));
        thread::scope(|scope| {
            let workers: Vec<_> = ranks
                .into_iter()
                .zip(GPUS)
                .zip(MICROS_PER_SAMPLE)
                .map(|((rank, (name, gib)), per_sample)| {
                    let device = SimulatedDevice::new(gib << 30).named(name);
                    scope.spawn(move || timed_rank(rank, device, per_sample, global, shares))
                })
                .collect();
            workers
                .into_iter()
                .map(|worker| {
                    worker
                        .join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))
                })
                .collect()
        })
    };
    Ok([run(false)?, run(true)?])
}

/// The job's step time: the slowest rank's, since every rank waits for it at the all-reduce.
fn step_time(ranks: &[Vec<Timed>], step: usize) -> u64 {
    ranks
        .iter()
        .filter_map(|timed| timed.get(step).map(|t| t.time))
        .max()
        .unwrap_or(0)
}

fn print_speed(global: usize) -> anyhow::Result<()> {
    let [agreed, shared] = compare(global)?;
    println!(
        "\nMixed GPUs at full speed: the global batch of {global}, the same {STEPS} steps, on \
         simulated clocks: {MICROS_PER_PASS} us to launch a micro-batch, then per sample"
    );
    for (rank, ((name, _), per_sample)) in GPUS.iter().zip(MICROS_PER_SAMPLE).enumerate() {
        println!("  rank {rank}: {name:<14} {per_sample} us a sample");
    }
    println!("Rank 3 loses 10 GiB at step 4 in both runs.\n");
    println!(
        "  {:>4}  {:<14}  {:>29}  {:>29}",
        "step", "", "agreed smallest micro-batch", "uneven shares"
    );
    println!(
        "  {:>4}  {:<14}  {:>6} {:>6} {:>15}  {:>6} {:>6} {:>15}",
        "", "rank", "share", "micro", "time", "share", "micro", "time"
    );
    for step in [0, 2, STEPS - 1] {
        for (rank, (name, _)) in GPUS.iter().enumerate() {
            let (a, s) = (agreed[rank][step], shared[rank][step]);
            println!(
                "  {:>4}  {:<14}  {:>6} {:>6} {:>12} ms  {:>6} {:>6} {:>12} ms",
                if rank == 0 {
                    step.to_string()
                } else {
                    String::new()
                },
                format!("{rank} {name}"),
                a.share,
                a.micro,
                format!("{:.1}", a.time as f64 / 1000.0),
                s.share,
                s.micro,
                format!("{:.1}", s.time as f64 / 1000.0),
            );
        }
        println!(
            "  {:>4}  {:<14}  {:>26} ms  {:>26} ms",
            "",
            "step (slowest)",
            format!("{:.1}", step_time(&agreed, step) as f64 / 1000.0),
            format!("{:.1}", step_time(&shared, step) as f64 / 1000.0),
        );
    }
    let total = |ranks: &[Vec<Timed>]| (0..STEPS).map(|step| step_time(ranks, step)).sum::<u64>();
    let (before, after) = (total(&agreed), total(&shared));
    let last = |ranks: &[Vec<Timed>]| step_time(ranks, STEPS - 1);
    println!(
        "\n{STEPS} steps of {global} samples: {:.2} s at the agreed smallest micro-batch, {:.2} s \
         with uneven shares: {:.2}x faster ({:.2}x at the last step).",
        before as f64 / 1e6,
        after as f64 / 1e6,
        before as f64 / after.max(1) as f64,
        last(&agreed) as f64 / last(&shared).max(1) as f64,
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();
    println!(
        "Four ranks, one GPU each, {} of activations a sample:",
        Bytes(PER_SAMPLE)
    );
    for (rank, (name, gib)) in GPUS.iter().enumerate() {
        let fits = (gib << 30) / PER_SAMPLE;
        println!("  rank {rank}: {name:<14} holds {fits} samples");
    }
    println!();

    let ranks = ThreadRanks::with_timeout(GPUS.len(), Duration::from_secs(30));
    let stories: Vec<anyhow::Result<Story>> = thread::scope(|scope| {
        let workers: Vec<_> = ranks
            .into_iter()
            .zip(GPUS)
            .map(|(rank, (name, gib))| {
                let device = SimulatedDevice::new(gib << 30).named(name);
                scope.spawn(move || rank_main(rank, device))
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))
            })
            .collect()
    });

    println!("Search, agreed after every attempt (Composer's MAX/MIN rounds):");
    let mut stories_ok = Vec::new();
    for (rank, story) in stories.into_iter().enumerate() {
        let story = story.map_err(|error| anyhow::anyhow!("rank {rank}: {error:#}"))?;
        let tried: Vec<String> = story.tried.iter().map(usize::to_string).collect();
        println!(
            "  rank {rank}: tried {} -> {}",
            tried.join(", "),
            story.agreed
        );
        stories_ok.push(story);
    }
    println!(
        "\nTraining, effective batch kept, micro-batch per step (rank 3 loses 10 GiB at step 4):"
    );
    print!("  step:  ");
    for step in 0..STEPS {
        print!("{step:>5}");
    }
    println!();
    for (rank, story) in stories_ok.iter().enumerate() {
        print!("  rank {rank}:");
        for micro in &story.micro_per_step {
            print!("{micro:>5}");
        }
        println!("   redone: {:?}", story.redone);
    }
    let same = stories_ok.windows(2).all(|pair| {
        pair[0].agreed == pair[1].agreed && pair[0].micro_per_step == pair[1].micro_per_step
    });
    println!(
        "\n{}",
        if same {
            "Every rank ran the same sizes: no rank waited alone in a collective."
        } else {
            "The ranks disagreed (this is a bug: please report it)."
        }
    );
    print_speed(stories_ok[0].agreed * GPUS.len())
}
