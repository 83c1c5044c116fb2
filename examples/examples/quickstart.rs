//! Quickstart: the batch size of a small transformer's training, found on a simulated 24 GiB GPU.
//!
//! ```text
//! cargo run -p batch-size-examples --example quickstart
//! ```
//!
//! `train` asks for 64 sequences of 1,024 tokens per step. Memory is modelled the way a GPU
//! would see it: weights, gradients and Adam's two moments at 16 bytes per parameter, then
//! activations saved for the backward pass, layer by layer, then the logits. 64 does not fit,
//! so `#[find_executable_batch_size]` releases the memory, halves the size and runs `train`
//! again, until a size fits. The arithmetic of training is not simulated, only its memory: the
//! output is the same on every machine, with or without a GPU.
//!
//! `RUST_LOG=debug` shows more; `RUST_LOG=warn` only the retries.

use std::time::Duration;

use anyhow::Context as _;
use batch_size_runtime::memory::{Bytes, DeviceMemory, MemorySnapshot};
use batch_size_runtime::{
    find_executable_batch_size, last_report, Attempt, Outcome, SimAllocation, SimulatedDevice,
};

/// GPT-2 small (124M parameters) with a context of 1,024 tokens.
#[derive(Debug, Clone)]
struct Config {
    /// The batch size to try first.
    batch_size: usize,
    seq_len: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    vocab: u64,
}

impl Config {
    fn gpt2_small() -> Self {
        Config {
            batch_size: 64,
            seq_len: 1024,
            hidden: 768,
            layers: 12,
            heads: 12,
            vocab: 50_257,
        }
    }

    /// Embeddings (tokens and positions) plus 12·h² per layer (attention and MLP weights).
    fn parameters(&self) -> u64 {
        let h = self.hidden;
        self.vocab * h + self.seq_len * h + self.layers * 12 * h * h
    }

    /// Activations one layer saves for the backward pass with mixed precision and no
    /// recomputation: `s·b·h·(34 + 5·a·s/h)` bytes (Korthikanti et al. 2022, "Reducing
    /// Activation Recomputation in Large Transformer Models", section 4.1). The `5·a·s/h` term
    /// is the attention scores, quadratic in the sequence length.
    fn activation_bytes_per_layer(&self, batch_size: usize) -> u64 {
        let (s, h, a) = (self.seq_len, self.hidden, self.heads);
        s * batch_size as u64 * (34 * h + 5 * a * s)
    }

    /// The output logits in fp32, kept for the loss's backward pass.
    fn logits_bytes(&self, batch_size: usize) -> u64 {
        batch_size as u64 * self.seq_len * self.vocab * 4
    }
}

/// Token ids of the training set (synthetic here).
#[derive(Debug)]
struct Dataset {
    sequences: usize,
}

impl Dataset {
    fn steps_per_epoch(&self, batch_size: usize) -> usize {
        self.sequences.div_ceil(batch_size)
    }
}

/// What one successful run of `train` returns.
#[derive(Debug)]
struct Metrics {
    batch_size: usize,
    steps: usize,
    peak: u64,
}

/// Weights, gradients and Adam's two moments: fp32, 16 bytes per parameter in all.
#[derive(Debug)]
#[allow(dead_code)] // held for their memory only
struct ModelState {
    weights: SimAllocation,
    gradients: SimAllocation,
    adam_moments: SimAllocation,
}

/// Everything that holds device memory is created here, inside the function: after an
/// out-of-memory error it is all dropped before the next attempt, so the retry starts clean.
#[find_executable_batch_size(starting = cfg.batch_size, min = 4, release = gpu.clone())]
fn train(
    batch_size: usize,
    cfg: &Config,
    data: &Dataset,
    gpu: &SimulatedDevice,
) -> anyhow::Result<Metrics> {
    tracing::info!(
        "trying batch size {batch_size}: {} tokens a step",
        batch_size as u64 * cfg.seq_len
    );
    let parameters = cfg.parameters();
    let _state = ModelState {
        weights: gpu.alloc(parameters * 4).context("weights")?,
        gradients: gpu.alloc(parameters * 4).context("gradients")?,
        adam_moments: gpu.alloc(parameters * 8).context("Adam moments")?,
    };

    // The forward pass saves each layer's activations, then the logits. A caching allocator
    // reaches its peak in the first step and serves later steps from the blocks it keeps; the
    // simulated device does not reuse blocks, so the first step's buffers are kept instead.
    let mut saved = Vec::new();
    for layer in 0..cfg.layers {
        let activations = gpu
            .alloc(cfg.activation_bytes_per_layer(batch_size))
            .with_context(|| format!("activations of layer {layer}"))?;
        saved.push(activations);
    }
    let _logits = gpu.alloc(cfg.logits_bytes(batch_size)).context("logits")?;

    let steps = data.steps_per_epoch(batch_size);
    tracing::info!(
        "batch size {batch_size} fits: {steps} steps, peak {}",
        Bytes(gpu.peak())
    );
    Ok(Metrics {
        batch_size,
        steps,
        peak: gpu.peak(),
    })
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();

    say_whether_a_gpu_is_here();

    let cfg = Config::gpt2_small();
    let data = Dataset { sequences: 4096 };
    // 2 MiB blocks, as CUDA's allocators round; freed memory stays cached until released, as
    // in a stream-ordered pool, so the release between attempts is what makes a retry possible.
    let gpu = SimulatedDevice::new(24 << 30)
        .named("sim:0")
        .with_block_size(2 << 20)
        .with_caching();

    let parameters = cfg.parameters();
    println!(
        "Model: GPT-2 small, {:.0}M parameters, sequences of {} tokens; {} of weights, \
         gradients and Adam moments.",
        parameters as f64 / 1e6,
        cfg.seq_len,
        Bytes(parameters * 16)
    );
    println!(
        "Each sequence in a batch needs {} of activations and logits. Device: {} with {}.",
        Bytes(cfg.layers * cfg.activation_bytes_per_layer(1) + cfg.logits_bytes(1)),
        gpu.name(),
        Bytes(gpu.capacity())
    );
    println!(
        "Starting at batch size {}; on out-of-memory the size is halved (minimum 4).\n",
        cfg.batch_size
    );

    let metrics = train(&cfg, &data, &gpu)?;

    println!(
        "\nTrained with batch size {}: {} steps per epoch, peak memory {} of {}.",
        metrics.batch_size,
        metrics.steps,
        Bytes(metrics.peak),
        Bytes(gpu.capacity())
    );
    if let Some(report) = last_report() {
        println!("\nAttempts (from batch_size_runtime::last_report()):");
        println!(
            "  {:>2}  {:>10}  {:<13}  {:>9}  {:>10}  {:>19}  {:>18}",
            "#",
            "batch size",
            "outcome",
            "time",
            "peak",
            "free before release",
            "free after release"
        );
        for attempt in report.attempts() {
            println!("  {}", row(attempt, &metrics));
        }
        println!(
            "\n{} attempt(s) ran out of memory. Each failed attempt's buffers were dropped as it \
             returned its error, but the cache kept them (free before release); the release \
             between attempts gave them back to the device (free after release), so the next \
             size started from an empty device. The device was released {} time(s).",
            report.out_of_memory_count(),
            gpu.release_count()
        );
    }
    Ok(())
}

/// One line of the summary table.
fn row(attempt: &Attempt, metrics: &Metrics) -> String {
    let first = |memory: &Option<MemorySnapshot>| {
        memory
            .as_ref()
            .and_then(|snapshot| snapshot.devices.first().cloned())
    };
    let at_end: Option<DeviceMemory> = first(&attempt.memory_at_end);
    let released: Option<DeviceMemory> = first(&attempt.memory_after_release);
    let (outcome, peak) = match &attempt.outcome {
        Outcome::Succeeded => ("succeeded", Some(metrics.peak)),
        Outcome::OutOfMemory { .. } => ("out of memory", at_end.as_ref().and_then(|m| m.peak)),
        Outcome::Failed { .. } => ("failed", None),
        _ => ("panicked", None),
    };
    let bytes = |value: Option<u64>| value.map_or_else(|| "-".to_owned(), |b| Bytes(b).to_string());
    format!(
        "{:>2}  {:>10}  {:<13}  {:>9}  {:>10}  {:>19}  {:>18}",
        attempt.number,
        attempt.batch_size,
        outcome,
        format!("{:.1?}", attempt.duration.max(Duration::from_micros(1))),
        bytes(peak),
        bytes(at_end.map(|m| m.free)),
        bytes(released.map(|m| m.free)),
    )
}

/// On a machine with an NVIDIA driver, says which GPU a real run would use.
fn say_whether_a_gpu_is_here() {
    match batch_size_examples::cuda_device() {
        Ok(device) => println!(
            "Found {device}. A real training function would allocate there, and the default \
             `release` (the CUDA backend, `Release::cuda()`) would free CUDA's pool between \
             attempts and report its figures. This demo stays on a simulated device so that \
             its output is the same everywhere.\n"
        ),
        Err(_) => println!(
            "No CUDA GPU here: a simulated device stands in for one. (On a machine with a GPU, \
             the default `release`, the CUDA backend, would free CUDA's pool between attempts \
             and report its figures.)\n"
        ),
    }
}
