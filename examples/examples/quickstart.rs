//! Quickstart: the batch size of a small transformer's training, found on the GPU when there is
//! one, on a simulated 24 GiB GPU otherwise.
//!
//! ```text
//! cargo run -p batch-size-examples --example quickstart
//! ```
//!
//! `train` asks for 64 sequences of 1,024 tokens per step. Memory is modelled the way a GPU
//! would see it: weights, gradients and Adam's two moments at 16 bytes per parameter, then
//! activations saved for the backward pass, then the logits. 64 does not fit, so
//! `#[find_executable_batch_size]` releases the memory, reads the failure's figures (what was
//! in use, what was asked for, the device's capacity), and runs `train` again with the size
//! they say fits; halving, for comparison, lands lower in more attempts. The arithmetic of
//! training is not simulated, only its memory.
//!
//! Where a CUDA GPU is present, the same memory is allocated on it for real (through cudarc),
//! the starting size is chosen from its capacity so that it does not fit, its out-of-memory
//! errors are cudarc's `DriverError(CUDA_ERROR_OUT_OF_MEMORY)`, and the default release (the CUDA
//! backend) trims CUDA's pool between attempts. Elsewhere a simulated device stands in, with
//! the same caching behaviour, and the output is the same on every machine.
//!
//! `RUST_LOG=debug` shows more; `RUST_LOG=warn` only the retries.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use batch_size_examples::CudaDevice;
use batch_size_runtime::memory::{Bytes, DeviceMemory, MemorySnapshot};
use batch_size_runtime::Release;
use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::SimAllocation, memory::SimulatedDevice,
    Attempt, Outcome,
};
use cudarc::driver::{CudaSlice, CudaStream};

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
            batch_size: 0, // chosen from the device's memory: see `starting_for`
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

    /// Bytes of weights, gradients and Adam's two moments.
    fn state_bytes(&self) -> u64 {
        self.parameters() * 16
    }

    /// Bytes of activations and logits per sequence of a batch.
    fn bytes_per_sequence(&self) -> u64 {
        self.layers * self.activation_bytes_per_layer(1) + self.logits_bytes(1)
    }

    /// A starting size that does not fit in `free` bytes: the power of two above twice the
    /// largest size that would, so that the search has work to do (64 on 24 GiB).
    fn starting_for(&self, free: u64) -> usize {
        let fits = free.saturating_sub(self.state_bytes()) / self.bytes_per_sequence();
        ((fits as usize + 1).next_power_of_two() * 2).max(8)
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
    weights: Buffer,
    gradients: Buffer,
    adam_moments: Buffer,
}

/// Where the model's memory lives: a real CUDA GPU when one is here, a simulated one otherwise.
#[derive(Debug)]
enum Gpu {
    Cuda {
        device: CudaDevice,
        stream: Arc<CudaStream>,
    },
    Simulated(SimulatedDevice),
}

/// Device memory, freed when dropped (on the GPU, back into CUDA's stream-ordered pool).
#[derive(Debug)]
#[allow(dead_code)] // held for its memory only
enum Buffer {
    Cuda(CudaSlice<u8>),
    Simulated(SimAllocation),
}

impl Gpu {
    /// CUDA device 0 when there is one; otherwise 24 GiB simulated with 2 MiB blocks and a
    /// cache that keeps freed memory until released, as a stream-ordered pool does.
    fn detect() -> Self {
        match batch_size_examples::cuda_device() {
            Ok(device) => {
                let stream = device.context.default_stream();
                Gpu::Cuda { device, stream }
            }
            Err(_) => Gpu::Simulated(
                SimulatedDevice::new(24 << 30)
                    .named("sim:0")
                    .with_block_size(2 << 20)
                    .with_caching(),
            ),
        }
    }

    fn name(&self) -> String {
        match self {
            Gpu::Cuda { device, .. } => device.to_string(),
            Gpu::Simulated(sim) => format!("{} (simulated)", sim.name()),
        }
    }

    fn capacity(&self) -> u64 {
        match self {
            Gpu::Cuda { device, .. } => device.total,
            Gpu::Simulated(sim) => sim.capacity(),
        }
    }

    /// What the release backend reads now.
    fn memory(&self) -> Option<DeviceMemory> {
        self.release()
            .memory_backend()
            .memory()
            .devices
            .into_iter()
            .next()
    }

    fn free(&self) -> u64 {
        self.memory().map_or(self.capacity(), |memory| memory.free)
    }

    /// The most bytes in use at once since the attempt began.
    fn peak(&self) -> u64 {
        match self {
            Gpu::Cuda { .. } => self.memory().and_then(|memory| memory.peak).unwrap_or(0),
            Gpu::Simulated(sim) => sim.peak(),
        }
    }

    /// What to do with memory between attempts: on a GPU the default, the CUDA backend; on the
    /// simulated device, its own release.
    fn release(&self) -> Release {
        match self {
            Gpu::Cuda { .. } => Release::cuda(),
            Gpu::Simulated(sim) => Release::backend(sim.clone()),
        }
    }

    fn release_count(&self) -> Option<u64> {
        match self {
            Gpu::Cuda { .. } => None,
            Gpu::Simulated(sim) => Some(sim.release_count()),
        }
    }

    /// `bytes` of device memory: the GPU's error is cudarc's `DriverError`, the simulated
    /// device's this crate's `OutOfMemory`; both are recognised as out-of-memory.
    fn alloc(&self, bytes: u64) -> anyhow::Result<Buffer> {
        Ok(match self {
            Gpu::Cuda { stream, .. } => {
                Buffer::Cuda(stream.alloc_zeros::<u8>(usize::try_from(bytes)?)?)
            }
            Gpu::Simulated(sim) => Buffer::Simulated(sim.alloc(bytes)?),
        })
    }
}

/// Everything that holds device memory is created here, inside the function: after an
/// out-of-memory error it is all dropped before the next attempt, so the retry starts clean.
/// The default policy reads each failure's figures to choose the next size.
#[find_executable_batch_size(starting = cfg.batch_size, min = 4, release = gpu.release())]
fn train(batch_size: usize, cfg: &Config, data: &Dataset, gpu: &Gpu) -> anyhow::Result<Metrics> {
    step(batch_size, cfg, data, gpu)
}

/// The same training with halving, as toma and Accelerate before 2025 do, for comparison.
#[find_executable_batch_size(
    starting = cfg.batch_size,
    min = 4,
    release = gpu.release(),
    policy = batch_size_runtime::policy::Halve
)]
fn train_halving(
    batch_size: usize,
    cfg: &Config,
    data: &Dataset,
    gpu: &Gpu,
) -> anyhow::Result<Metrics> {
    step(batch_size, cfg, data, gpu)
}

/// One training step's memory at `batch_size`.
fn step(batch_size: usize, cfg: &Config, data: &Dataset, gpu: &Gpu) -> anyhow::Result<Metrics> {
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

    // The activations saved for the backward pass and the logits, in one planned workspace (as
    // XLA's buffer assignment or ONNX Runtime's arena reserve a step's memory at once).
    let _workspace = gpu
        .alloc(
            cfg.layers * cfg.activation_bytes_per_layer(batch_size) + cfg.logits_bytes(batch_size),
        )
        .context("activations and logits")?;

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

    let gpu = Gpu::detect();
    say_where(&gpu);

    let mut cfg = Config::gpt2_small();
    cfg.batch_size = cfg.starting_for(gpu.free());
    let data = Dataset { sequences: 4096 };

    let parameters = cfg.parameters();
    println!(
        "Model: GPT-2 small, {:.0}M parameters, sequences of {} tokens; {} of weights, \
         gradients and Adam moments.",
        parameters as f64 / 1e6,
        cfg.seq_len,
        Bytes(parameters * 16)
    );
    println!(
        "Each sequence in a batch needs {} of activations and logits. Device: {}, {} free.",
        Bytes(cfg.bytes_per_sequence()),
        gpu.name(),
        Bytes(gpu.free())
    );
    println!(
        "Starting at batch size {}; on out-of-memory the next size is estimated from the \
         failure's figures (minimum 4).\n",
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
             returned its error, but the {} kept them (free before release); the release \
             between attempts gave them back to the device (free after release), so the next \
             size started from an empty device.",
            report.out_of_memory_count(),
            match gpu.release_count() {
                Some(_) => "cache",
                None => "CUDA pool",
            },
        );
    }

    // The same search with halving, quietly, for comparison.
    let guided_attempts = last_report().map_or(0, |report| report.len());
    let halving = {
        let _quiet = tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default());
        train_halving(&cfg, &data, &gpu)?
    };
    let halving_attempts = last_report().map_or(0, |report| report.len());
    println!(
        "\nHalving (toma, Accelerate before 2025) would have trained with batch size {} after {} \
         attempts; the guided search found {} in {}.",
        halving.batch_size, halving_attempts, metrics.batch_size, guided_attempts
    );
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

/// Says which device the memory lives on.
fn say_where(gpu: &Gpu) {
    match gpu {
        Gpu::Cuda { .. } => println!(
            "Found {}: the model's memory is allocated there, and the default `release` (the \
             CUDA backend) trims CUDA's pool between attempts.\n",
            gpu.name()
        ),
        Gpu::Simulated(_) => println!(
            "No CUDA GPU here: a simulated device stands in for one, with a cache that keeps \
             freed memory until released, as CUDA's pool does. (On a machine with a GPU this \
             example allocates on it instead.)\n"
        ),
    }
}
