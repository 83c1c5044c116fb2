//! candle: an MLP classifier trained with candle on the CPU, its batch size found by
//! `#[find_executable_batch_size]`.
//!
//! ```text
//! cargo run -p batch-size-examples --example candle
//! ```
//!
//! candle runs on the CPU here (its `cuda` feature needs nvcc to build), where running out of
//! memory aborts the process instead of returning an error. So that the retry shows, a
//! simulated 2 MiB GPU accounts for the tensors of each step, and its out-of-memory error is
//! returned inside a `candle_core::Error`, as candle's CUDA backend returns
//! `DriverError(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")` inside one: both are recognised from
//! the error's text. To train on a GPU instead, see "candle on CUDA" in the README.

use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{find_executable_batch_size, last_report, memory::SimulatedDevice};
use candle_core::{DType, Device, Tensor, Var, D};

const FEATURES: usize = 32;
const HIDDEN: usize = 128;
const CLASSES: usize = 4;
const SAMPLES: usize = 4096;
const EPOCHS: usize = 3;
const LEARNING_RATE: f64 = 0.1;

/// Synthetic data: four Gaussian clusters in 32 dimensions.
#[derive(Debug)]
struct Data {
    features: Tensor,
    labels: Tensor,
}

/// What a successful run returns.
#[derive(Debug)]
struct Trained {
    batch_size: usize,
    first_loss: f32,
    last_loss: f32,
    accuracy: f32,
}

/// The parameters live inside the function: each attempt starts from fresh weights, and
/// nothing an out-of-memory attempt allocated outlives it.
///
/// The return type is candle's own `candle_core::Result`, as it is: its out-of-memory errors
/// are recognised from their text, and when no size fits the attribute returns the
/// `NoExecutableBatchSize` inside `candle_core::Error::Io` (candle's error has
/// `From<std::io::Error>`), as an `io::Error` of kind `OutOfMemory`.
#[find_executable_batch_size(starting = SAMPLES, min = 8, release = gpu.clone())]
fn train(
    batch_size: usize,
    data: &Data,
    device: &Device,
    gpu: &SimulatedDevice,
) -> candle_core::Result<Trained> {
    let mut rng = XorShift(0x5eed);
    let w1 = Var::from_tensor(&rng.tensor(&[FEATURES, HIDDEN], 0.2, device)?)?;
    let b1 = Var::zeros(HIDDEN, DType::F32, device)?;
    let w2 = Var::from_tensor(&rng.tensor(&[HIDDEN, CLASSES], 0.05, device)?)?;
    let b2 = Var::zeros(CLASSES, DType::F32, device)?;
    let parameters = (FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES) as u64;
    // Weights, gradients and momentum, as an optimizer on a GPU would hold them.
    let _parameters_on_gpu = gpu
        .alloc(parameters * 12)
        .map_err(|oom| candle_core::Error::Wrapped(Box::new(oom)))?;

    let mut first_loss = None;
    let mut last_loss = 0.0;
    for _epoch in 0..EPOCHS {
        let mut epoch_loss = 0.0;
        let mut batches = 0;
        for start in (0..SAMPLES).step_by(batch_size) {
            let len = batch_size.min(SAMPLES - start);
            // Inputs, the two layers' outputs and their gradients, in f32.
            let _step_on_gpu = gpu
                .alloc((len * (FEATURES + 3 * HIDDEN + 3 * CLASSES) * 4) as u64)
                .map_err(|oom| candle_core::Error::Wrapped(Box::new(oom)))?;
            let x = data.features.narrow(0, start, len)?;
            let y = data.labels.narrow(0, start, len)?;

            let hidden = x.matmul(w1.as_tensor())?.broadcast_add(&b1)?.relu()?;
            let logits = hidden.matmul(w2.as_tensor())?.broadcast_add(&b2)?;
            let loss = cross_entropy(&logits, &y)?;
            let gradients = loss.backward()?;
            for var in [&w1, &b1, &w2, &b2] {
                let gradient = gradients
                    .get(var)
                    .ok_or_else(|| candle_core::Error::Msg("no gradient".to_owned()))?;
                var.set(&var.as_tensor().sub(&gradient.affine(LEARNING_RATE, 0.0)?)?)?;
            }
            epoch_loss += loss.to_scalar::<f32>()?;
            batches += 1;
        }
        last_loss = epoch_loss / batches as f32;
        first_loss.get_or_insert(last_loss);
    }

    let hidden = data
        .features
        .matmul(w1.as_tensor())?
        .broadcast_add(&b1)?
        .relu()?;
    let predictions = hidden
        .matmul(w2.as_tensor())?
        .broadcast_add(&b2)?
        .argmax(D::Minus1)?;
    let accuracy = predictions
        .eq(&data.labels)?
        .to_dtype(DType::F32)?
        .mean_all()?
        .to_scalar::<f32>()?;
    Ok(Trained {
        batch_size,
        first_loss: first_loss.unwrap_or(last_loss),
        last_loss,
        accuracy,
    })
}

/// Mean softmax cross-entropy of `logits` (batch x classes) against `labels` (u32 indices).
fn cross_entropy(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let shifted = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
    let log_sum_exp = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let log_probabilities = shifted.broadcast_sub(&log_sum_exp)?;
    log_probabilities
        .gather(&labels.unsqueeze(1)?, 1)?
        .mean_all()?
        .neg()
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();

    let device = Device::Cpu;
    let data = synthetic_data(&device)?;
    let gpu = SimulatedDevice::new(2 << 20).named("sim:0");
    println!(
        "Training a {FEATURES}-{HIDDEN}-{CLASSES} MLP with candle on the CPU, {SAMPLES} samples, \
         {EPOCHS} epochs; a simulated GPU of {} holds each step's tensors. Starting with the \
         whole set as one batch ({SAMPLES}).\n",
        Bytes(gpu.capacity())
    );

    let trained = train(&data, &device, &gpu)?;

    println!(
        "\nBatch size {}: loss {:.3} after the first epoch, {:.3} after the last; accuracy {:.1}%.",
        trained.batch_size,
        trained.first_loss,
        trained.last_loss,
        trained.accuracy * 100.0
    );
    if let Some(report) = last_report() {
        println!("\n{report}");
    }
    Ok(())
}

fn synthetic_data(device: &Device) -> candle_core::Result<Data> {
    let mut rng = XorShift(42);
    let centers: Vec<f32> = (0..CLASSES * FEATURES)
        .map(|_| if rng.next_f32() < 0.5 { -1.0 } else { 1.0 })
        .collect();
    let mut features = Vec::with_capacity(SAMPLES * FEATURES);
    let mut labels = Vec::with_capacity(SAMPLES);
    for sample in 0..SAMPLES {
        let class = sample % CLASSES;
        labels.push(class as u32);
        for feature in 0..FEATURES {
            features.push(centers[class * FEATURES + feature] + 1.5 * rng.normal());
        }
    }
    Ok(Data {
        features: Tensor::from_vec(features, (SAMPLES, FEATURES), device)?,
        labels: Tensor::from_vec(labels, SAMPLES, device)?,
    })
}

/// A small deterministic generator, so that every run prints the same numbers.
#[derive(Debug)]
struct XorShift(u64);

impl XorShift {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately standard normal (the sum of 12 uniforms, less 6).
    fn normal(&mut self) -> f32 {
        (0..12).map(|_| self.next_f32()).sum::<f32>() - 6.0
    }

    fn tensor(
        &mut self,
        shape: &[usize],
        scale: f32,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let values: Vec<f32> = (0..shape.iter().product::<usize>())
            .map(|_| scale * self.normal())
            .collect();
        Tensor::from_vec(values, shape, device)
    }
}
