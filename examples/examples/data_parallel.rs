//! Data-parallel training on four GPUs of different sizes, each rank a thread with its own
//! simulated device: the ranks agree on one batch size (the largest the smallest GPU holds),
//! then train with gradient accumulation; when one GPU loses room in the middle of training,
//! every rank redoes that step with the same smaller micro-batch, and every gradient
//! all-reduce still finds all four ranks. Over NCCL the same code takes an `NcclRank` instead
//! of a `ThreadRank` (feature `nccl`; see the README).
//!
//! ```text
//! cargo run -p batch-size-examples --example data_parallel
//! ```

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use batch_size_runtime::agree::{safe_point, Collective, ReduceOp, ThreadRank, ThreadRanks};
use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{find_executable_batch_size, EffectiveBatch, SimulatedDevice};

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
    Ok(())
}
