//! When no batch size fits: GPT-2 medium with a context of 2,048 tokens on a simulated 8 GiB
//! GPU. Batch size 1 does not fit; the search applies the remedies the training allows, in its
//! order (activation checkpointing, then bf16, then a shorter context, never below 512), and
//! trains with the first settings under which a batch size fits.
//!
//! ```text
//! cargo run -p batch-size-examples --example remedies
//! ```
//!
//! Memory is modelled as the quickstart's: the training state (weights, gradients, Adam's two
//! moments) at 16 bytes a parameter in fp32 and 8 in bf16; the activations each layer saves for
//! the backward pass (Korthikanti et al. 2022, section 4.1, doubled in fp32); with activation
//! checkpointing, each layer's input only, and one layer's activations while it is recomputed;
//! the logits, their softmax and its gradient; and what CUDA and cuBLAS hold. The arithmetic of
//! training is not simulated, only its memory. A second run with the same cache key starts from
//! the settings and size that fit, in one attempt.
//!
//! `RUST_LOG=warn` shows each remedy's WARN, with the failure's figures.

use std::sync::{Mutex, PoisonError};

use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{
    find_executable_batch_size, last_report, memory::SimulatedDevice, remedies::Remedied,
    remedies::Remedies, remedies::Remedy, Outcome,
};

/// What the training allows the search to change, and what it does not (the seed, the data).
#[derive(Debug, Clone, PartialEq)]
struct TrainConfig {
    activation_checkpointing: bool,
    bf16: bool,
    context: u64,
    seed: u64,
}

/// GPT-2 medium: 24 layers, a hidden size of 1,024, 16 heads.
const LAYERS: u64 = 24;
const HIDDEN: u64 = 1024;
const HEADS: u64 = 16;
const VOCAB: u64 = 50_257;
/// The CUDA context, cuBLAS's workspace and the framework's own.
const RUNTIME_BYTES: u64 = 3 << 28; // 768 MiB

fn parameters(context: u64) -> u64 {
    VOCAB * HIDDEN + context * HIDDEN + LAYERS * 12 * HIDDEN * HIDDEN
}

/// Bytes one layer saves for the backward pass, per sequence: `s·h·(34 + 5·a·s/h)` in 16 bits.
fn layer_activations(config: &TrainConfig) -> u64 {
    let s = config.context;
    let bytes = s * (34 * HIDDEN + 5 * HEADS * s);
    if config.bf16 {
        bytes
    } else {
        bytes * 2
    }
}

fn element_bytes(config: &TrainConfig) -> u64 {
    if config.bf16 {
        2
    } else {
        4
    }
}

/// One training step's memory, allocated in the order a step needs it.
#[find_executable_batch_size(
    starting = 8,
    remedies = remedies,
    release = device.clone(),
    cache = "gpt2-medium remedies",
    notify = |_| record_peak(device.peak()),
)]
fn train(
    attempt: Remedied<TrainConfig>,
    remedies: &Remedies<TrainConfig>,
    device: &SimulatedDevice,
) -> anyhow::Result<(usize, TrainConfig)> {
    let config = attempt.settings();
    let batch = attempt.batch_size() as u64;
    let _runtime = device.alloc(RUNTIME_BYTES)?;
    let state_bytes_per_parameter = if config.bf16 { 8 } else { 16 };
    let _state = device.alloc(parameters(config.context) * state_bytes_per_parameter)?;
    let saved = if config.activation_checkpointing {
        // Each layer's input; one layer's activations while it is recomputed.
        LAYERS * config.context * HIDDEN * element_bytes(config) + layer_activations(config)
    } else {
        LAYERS * layer_activations(config)
    };
    let _activations = device.alloc(batch * saved)?;
    // The logits, their softmax and its gradient.
    let _logits = device.alloc(3 * batch * config.context * VOCAB * element_bytes(config))?;
    Ok((attempt.batch_size(), config.clone()))
}

/// Each attempt's peak, as it ends (the engine resets the device's peak as an attempt begins).
static PEAKS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

fn record_peak(peak: u64) {
    PEAKS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(peak);
}

fn remedies() -> Remedies<TrainConfig> {
    Remedies::new(TrainConfig {
        activation_checkpointing: false,
        bf16: false,
        context: 2048,
        seed: 17,
    })
    .then(Remedy::switch(
        "activation checkpointing",
        |config: &mut TrainConfig| config.activation_checkpointing = true,
    ))
    .then(Remedy::switch("bf16", |config: &mut TrainConfig| {
        config.bf16 = true
    }))
    .then(
        Remedy::knob(
            "context length",
            |config: &TrainConfig| config.context as usize,
            |config: &mut TrainConfig, value| config.context = value as u64,
        )
        .with_floor(512),
    )
}

fn print_attempts() {
    let Some(report) = last_report() else {
        return;
    };
    let peaks = std::mem::take(&mut *PEAKS.lock().unwrap_or_else(PoisonError::into_inner));
    println!(
        "  {:>3}  {:<32} {:>5}  {:<13} {:>10}  {:>11}",
        "#", "settings", "batch", "outcome", "peak", "asked for"
    );
    for (attempt, peak) in report.attempts().zip(peaks) {
        let outcome = match &attempt.outcome {
            Outcome::Succeeded => "trained",
            Outcome::OutOfMemory { .. } => "out of memory",
            _ => "failed",
        };
        // The allocation that did not fit.
        let asked = attempt
            .figures
            .requested
            .map_or_else(String::new, |bytes| Bytes(bytes).to_string());
        println!(
            "  {:>3}  {:<32} {:>5}  {:<13} {:>10}  {:>11}",
            attempt.number,
            attempt.remedies.as_deref().unwrap_or("as configured"),
            attempt.batch_size,
            outcome,
            Bytes(peak).to_string(),
            asked
        );
    }
}

fn main() -> anyhow::Result<()> {
    let device = SimulatedDevice::new(8 << 30).named("sim:0");
    println!(
        "GPT-2 medium ({}M parameters), context 2048, on {} with {}",
        parameters(2048) / 1_000_000,
        device.name(),
        Bytes(device.capacity())
    );

    let ladder = remedies();
    let (batch_size, config) = train(&ladder, &device)?;
    println!("\nrun 1: the batch size first, then the remedies in the order allowed");
    print_attempts();
    println!(
        "trained with batch size {batch_size} under {:?} (remedies in force: {})",
        config,
        ladder.applied().join(", ")
    );
    assert_eq!(config.seed, 17, "a setting not declared is never changed");

    // A new process would start from the same cache (`cache_dir` or BATCH_SIZE_CACHE_DIR).
    let rerun = remedies();
    let (batch_size, config) = train(&rerun, &device)?;
    println!("\nrun 2: from the cache");
    print_attempts();
    println!(
        "trained with batch size {batch_size}, checkpointing {}, bf16 {}, context {}",
        config.activation_checkpointing, config.bf16, config.context
    );
    Ok(())
}
