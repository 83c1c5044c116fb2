//! cuda_mlp: an MLP trained on a GPU with cudarc, its batch size found by
//! `#[find_executable_batch_size]`.
//!
//! ```text
//! cargo run --release -p batch-size-examples --example cuda_mlp
//! ```
//!
//! Matrix products go through cuBLAS; the element-wise work (synthetic data, bias and ReLU,
//! softmax cross-entropy, SGD) through small kernels compiled at run time with NVRTC. The
//! starting batch size is chosen to need 2 to 4 times the GPU's memory, so the first attempts run
//! out of memory (`DriverError(CUDA_ERROR_OUT_OF_MEMORY)` from an allocation) and the search
//! halves the size until the step fits; between attempts the default `release`, the CUDA
//! backend, gives the freed memory back to the device.
//!
//! It builds everywhere (cudarc loads libcuda, libcublas and libnvrtc at run time). Where no
//! GPU, driver or library is present it says so and exits with status 0.

use std::sync::Arc;
use std::time::Instant;

use anyhow::ensure;
use batch_size_examples::{cuda_device, quietly, CudaDevice};
use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{find_executable_batch_size, last_report};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

/// Input features, hidden units and classes of the MLP.
const FEATURES: usize = 1024;
const HIDDEN: usize = 2048;
const CLASSES: usize = 16;
const LEARNING_RATE: f32 = 0.1;

/// Every `n` is a `u64` and every loop strides over the grid: a batch of millions of samples
/// has more than 2^31 elements.
const KERNELS: &str = r#"
typedef unsigned long long u64;

__device__ unsigned int mix(u64 x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return (unsigned int)x;
}

__device__ float uniform(u64 x) { return (mix(x) >> 8) * (1.0f / 16777216.0f); }

#define FOR_EACH(i, n) \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Sample s has label mix(s) % classes and features center(label) + uniform noise in [-1, 1).
extern "C" __global__ void make_batch(float* x, unsigned int* labels, u64 first, u64 rows,
                                      u64 features, unsigned int classes) {
    FOR_EACH(i, rows * features) {
        u64 row = i / features, col = i % features, sample = first + row;
        unsigned int label = mix(sample) % classes;
        if (col == 0) labels[row] = label;
        float center = (mix(((u64)label << 32) ^ (col * 0x9e3779b97f4a7c15ULL)) & 1) ? 0.25f : -0.25f;
        x[i] = center + 2.0f * uniform(sample * features + col + 0x5eedULL) - 1.0f;
    }
}

extern "C" __global__ void init_uniform(float* w, u64 n, u64 seed, float scale) {
    FOR_EACH(i, n) { w[i] = scale * (2.0f * uniform(seed * 0x100000001b3ULL + i) - 1.0f); }
}

extern "C" __global__ void fill(float* x, u64 n, float value) {
    FOR_EACH(i, n) { x[i] = value; }
}

// y = max(y + b, 0) with b broadcast over rows.
extern "C" __global__ void bias_relu(float* y, const float* b, u64 n, u64 cols) {
    FOR_EACH(i, n) { y[i] = fmaxf(y[i] + b[i % cols], 0.0f); }
}

extern "C" __global__ void add_bias(float* y, const float* b, u64 n, u64 cols) {
    FOR_EACH(i, n) { y[i] += b[i % cols]; }
}

// One row per thread: the mean loss and the gradient (softmax - one_hot) / rows.
extern "C" __global__ void softmax_xent(const float* logits, const unsigned int* labels,
                                        float* grad, float* loss, unsigned int* correct,
                                        u64 rows, unsigned int classes) {
    FOR_EACH(r, rows) {
        const float* z = logits + r * classes;
        float* g = grad + r * classes;
        unsigned int label = labels[r], best = 0;
        float top = z[0];
        for (unsigned int c = 1; c < classes; c++) if (z[c] > top) { top = z[c]; best = c; }
        float sum = 0.0f;
        for (unsigned int c = 0; c < classes; c++) sum += expf(z[c] - top);
        for (unsigned int c = 0; c < classes; c++) {
            float p = expf(z[c] - top) / sum;
            g[c] = (p - (c == label ? 1.0f : 0.0f)) / (float)rows;
        }
        atomicAdd(loss, (logf(sum) - (z[label] - top)) / (float)rows);
        if (best == label) atomicAdd(correct, 1u);
    }
}

// The gradient through ReLU: zero where the activation was zero.
extern "C" __global__ void relu_backward(float* grad, const float* activation, u64 n) {
    FOR_EACH(i, n) { if (activation[i] <= 0.0f) grad[i] = 0.0f; }
}

extern "C" __global__ void sgd(float* w, const float* grad, u64 n, float lr) {
    FOR_EACH(i, n) { w[i] -= lr * grad[i]; }
}
"#;

/// The GPU and the compiled kernels. None of it holds memory that grows with the batch.
#[derive(Debug)]
struct Gpu {
    stream: Arc<CudaStream>,
    make_batch: CudaFunction,
    init_uniform: CudaFunction,
    fill: CudaFunction,
    bias_relu: CudaFunction,
    add_bias: CudaFunction,
    softmax_xent: CudaFunction,
    relu_backward: CudaFunction,
    sgd: CudaFunction,
}

/// A grid for `n` elements: 256 threads a block, the kernels stride over the rest.
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Bytes the attempt allocates per sample: inputs, hidden activations and their gradient,
/// logits and their gradient, the label and a 1 of the ones vector (for bias gradients).
const BYTES_PER_SAMPLE: usize = 4 * (FEATURES + 2 * HIDDEN + 2 * CLASSES + 2);

/// How to train.
#[derive(Debug)]
struct Plan {
    starting_batch_size: usize,
    steps: usize,
}

/// What a successful run returns.
#[derive(Debug)]
struct Trained {
    batch_size: usize,
    first_loss: f32,
    last_loss: f32,
    accuracy: f32,
    samples_per_second: f64,
}

/// Everything that holds device memory (cuBLAS's handle, the weights, the activations) is
/// created inside the function, so that an attempt that ran out of memory frees all of it.
#[find_executable_batch_size(starting = plan.starting_batch_size, min = 1024)]
fn train(batch_size: usize, gpu: &Gpu, plan: &Plan) -> anyhow::Result<Trained> {
    let stream = &gpu.stream;
    let rows = batch_size;
    tracing::info!(
        "trying batch size {rows}: about {} of activations",
        Bytes((rows * BYTES_PER_SAMPLE) as u64)
    );
    let blas = CudaBlas::new(stream.clone())?;

    let mut w1 = stream.alloc_zeros::<f32>(FEATURES * HIDDEN)?;
    let mut b1 = stream.alloc_zeros::<f32>(HIDDEN)?;
    let mut w2 = stream.alloc_zeros::<f32>(HIDDEN * CLASSES)?;
    let mut b2 = stream.alloc_zeros::<f32>(CLASSES)?;
    let mut dw1 = stream.alloc_zeros::<f32>(FEATURES * HIDDEN)?;
    let mut db1 = stream.alloc_zeros::<f32>(HIDDEN)?;
    let mut dw2 = stream.alloc_zeros::<f32>(HIDDEN * CLASSES)?;
    let mut db2 = stream.alloc_zeros::<f32>(CLASSES)?;
    for (weights, fan_in, seed) in [(&mut w1, FEATURES, 1u64), (&mut w2, HIDDEN, 2)] {
        let (n, scale) = (weights.len() as u64, (3.0 / fan_in as f32).sqrt());
        // SAFETY: init_uniform(float* w, u64 n, u64 seed, float scale); `weights` holds n floats.
        unsafe {
            stream
                .launch_builder(&gpu.init_uniform)
                .arg(&mut *weights)
                .arg(&n)
                .arg(&seed)
                .arg(&scale)
                .launch(grid(n as usize))
        }?;
    }

    let mut x = stream.alloc_zeros::<f32>(rows * FEATURES)?;
    let mut labels = stream.alloc_zeros::<u32>(rows)?;
    let mut hidden = stream.alloc_zeros::<f32>(rows * HIDDEN)?;
    let mut d_hidden = stream.alloc_zeros::<f32>(rows * HIDDEN)?;
    let mut logits = stream.alloc_zeros::<f32>(rows * CLASSES)?;
    let mut d_logits = stream.alloc_zeros::<f32>(rows * CLASSES)?;
    let mut ones = stream.alloc_zeros::<f32>(rows)?;
    let mut loss = stream.alloc_zeros::<f32>(1)?;
    let mut correct = stream.alloc_zeros::<u32>(1)?;
    // SAFETY: fill(float* x, u64 n, float value); `ones` holds `rows` floats.
    unsafe {
        stream
            .launch_builder(&gpu.fill)
            .arg(&mut ones)
            .arg(&(rows as u64))
            .arg(&1.0f32)
            .launch(grid(rows))
    }?;

    let started = Instant::now();
    let (mut first_loss, mut last_loss, mut accuracy) = (None, 0.0, 0.0);
    for step in 0..plan.steps {
        // SAFETY: make_batch(float* x, unsigned* labels, u64 first, u64 rows, u64 features,
        // unsigned classes); x holds rows·FEATURES floats and labels `rows` values.
        unsafe {
            stream
                .launch_builder(&gpu.make_batch)
                .arg(&mut x)
                .arg(&mut labels)
                .arg(&((step * rows) as u64))
                .arg(&(rows as u64))
                .arg(&(FEATURES as u64))
                .arg(&(CLASSES as u32))
                .launch(grid(rows * FEATURES))
        }?;

        // Forward: hidden = relu(x·w1 + b1), logits = hidden·w2 + b2.
        matmul(
            &blas,
            (&x, false),
            (&w1, false),
            &mut hidden,
            (rows, FEATURES, HIDDEN),
        )?;
        // SAFETY: bias_relu(float* y, const float* b, u64 n, u64 cols); y holds n = rows·HIDDEN
        // floats and b HIDDEN.
        unsafe {
            stream
                .launch_builder(&gpu.bias_relu)
                .arg(&mut hidden)
                .arg(&b1)
                .arg(&((rows * HIDDEN) as u64))
                .arg(&(HIDDEN as u64))
                .launch(grid(rows * HIDDEN))
        }?;
        matmul(
            &blas,
            (&hidden, false),
            (&w2, false),
            &mut logits,
            (rows, HIDDEN, CLASSES),
        )?;
        // SAFETY: add_bias(float* y, const float* b, u64 n, u64 cols); y holds rows·CLASSES
        // floats and b CLASSES.
        unsafe {
            stream
                .launch_builder(&gpu.add_bias)
                .arg(&mut logits)
                .arg(&b2)
                .arg(&((rows * CLASSES) as u64))
                .arg(&(CLASSES as u64))
                .launch(grid(rows * CLASSES))
        }?;

        // Loss and its gradient.
        stream.memset_zeros(&mut loss)?;
        stream.memset_zeros(&mut correct)?;
        // SAFETY: softmax_xent(const float* logits, const unsigned* labels, float* grad,
        // float* loss, unsigned* correct, u64 rows, unsigned classes); logits and grad hold
        // rows·CLASSES floats, labels `rows` values, loss and correct one each.
        unsafe {
            stream
                .launch_builder(&gpu.softmax_xent)
                .arg(&logits)
                .arg(&labels)
                .arg(&mut d_logits)
                .arg(&mut loss)
                .arg(&mut correct)
                .arg(&(rows as u64))
                .arg(&(CLASSES as u32))
                .launch(grid(rows))
        }?;

        // Backward.
        matmul(
            &blas,
            (&hidden, true),
            (&d_logits, false),
            &mut dw2,
            (HIDDEN, rows, CLASSES),
        )?;
        matmul(
            &blas,
            (&ones, false),
            (&d_logits, false),
            &mut db2,
            (1, rows, CLASSES),
        )?;
        matmul(
            &blas,
            (&d_logits, false),
            (&w2, true),
            &mut d_hidden,
            (rows, CLASSES, HIDDEN),
        )?;
        // SAFETY: relu_backward(float* grad, const float* activation, u64 n); both hold
        // rows·HIDDEN floats.
        unsafe {
            stream
                .launch_builder(&gpu.relu_backward)
                .arg(&mut d_hidden)
                .arg(&hidden)
                .arg(&((rows * HIDDEN) as u64))
                .launch(grid(rows * HIDDEN))
        }?;
        matmul(
            &blas,
            (&x, true),
            (&d_hidden, false),
            &mut dw1,
            (FEATURES, rows, HIDDEN),
        )?;
        matmul(
            &blas,
            (&ones, false),
            (&d_hidden, false),
            &mut db1,
            (1, rows, HIDDEN),
        )?;

        for (weights, gradient) in [
            (&mut w1, &dw1),
            (&mut b1, &db1),
            (&mut w2, &dw2),
            (&mut b2, &db2),
        ] {
            let n = weights.len() as u64;
            // SAFETY: sgd(float* w, const float* grad, u64 n, float lr); both hold n floats.
            unsafe {
                stream
                    .launch_builder(&gpu.sgd)
                    .arg(&mut *weights)
                    .arg(gradient)
                    .arg(&n)
                    .arg(&LEARNING_RATE)
                    .launch(grid(n as usize))
            }?;
        }

        // Reading the loss waits for the step: an asynchronous error surfaces here.
        let step_loss = stream.clone_dtoh(&loss)?[0];
        let step_correct = stream.clone_dtoh(&correct)?[0];
        accuracy = step_correct as f32 / rows as f32;
        first_loss.get_or_insert(step_loss);
        last_loss = step_loss;
        tracing::info!(
            "step {}/{}: loss {step_loss:.4}, accuracy {:.1}%",
            step + 1,
            plan.steps,
            accuracy * 100.0
        );
    }
    stream.synchronize()?;
    Ok(Trained {
        batch_size,
        first_loss: first_loss.unwrap_or(last_loss),
        last_loss,
        accuracy,
        samples_per_second: (plan.steps * rows) as f64 / started.elapsed().as_secs_f64(),
    })
}

/// Row-major `c (m×n) = op(a) · op(b)`, with `op(a)` m×k and `op(b)` k×n; a transposed `a` is
/// stored k×m and a transposed `b` n×k. cuBLAS is column-major, where a row-major matrix reads
/// as its transpose, so this asks cuBLAS for `cᵀ = op(b)ᵀ · op(a)ᵀ`.
fn matmul(
    blas: &CudaBlas,
    (a, transpose_a): (&CudaSlice<f32>, bool),
    (b, transpose_b): (&CudaSlice<f32>, bool),
    c: &mut CudaSlice<f32>,
    (m, k, n): (usize, usize, usize),
) -> anyhow::Result<()> {
    use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    ensure!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
        "matmul: operands too small for ({m}×{k})·({k}×{n})"
    );
    let config = GemmConfig {
        transa: if transpose_b {
            CUBLAS_OP_T
        } else {
            CUBLAS_OP_N
        },
        transb: if transpose_a {
            CUBLAS_OP_T
        } else {
            CUBLAS_OP_N
        },
        m: i32::try_from(n)?,
        n: i32::try_from(m)?,
        k: i32::try_from(k)?,
        alpha: 1.0f32,
        lda: i32::try_from(if transpose_b { k } else { n })?,
        ldb: i32::try_from(if transpose_a { m } else { k })?,
        beta: 0.0f32,
        ldc: i32::try_from(n)?,
    };
    // SAFETY: the lengths were checked above against the shapes `config` describes.
    unsafe { blas.gemm(config, b, a, c) }?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();

    let device = match cuda_device() {
        Ok(device) => device,
        Err(why) => {
            println!("cuda_mlp trains on an NVIDIA GPU, and there is none here ({why}). Exiting.");
            return Ok(());
        }
    };
    let gpu = match load(&device) {
        Ok(gpu) => gpu,
        Err(why) => {
            println!("Found {device}, but {why}. Exiting.");
            return Ok(());
        }
    };

    // 2 to 4 times the device's memory (a power of two), so that the search has work to do.
    let plan = Plan {
        starting_batch_size: (2 * device.total as usize / BYTES_PER_SAMPLE).next_power_of_two(),
        steps: 10,
    };
    println!(
        "Found {device}. Training a {FEATURES}-{HIDDEN}-{CLASSES} MLP for {} steps; {} of \
         activations per sample, so batch size {} needs about {}.\n",
        plan.steps,
        Bytes(BYTES_PER_SAMPLE as u64),
        plan.starting_batch_size,
        Bytes((plan.starting_batch_size * BYTES_PER_SAMPLE) as u64)
    );

    let trained = train(&gpu, &plan)?;

    println!(
        "\nBatch size {}: loss {:.4} at the first step, {:.4} at the last; accuracy {:.1}% on \
         the last batch; {:.0} samples/s.",
        trained.batch_size,
        trained.first_loss,
        trained.last_loss,
        trained.accuracy * 100.0,
        trained.samples_per_second
    );
    if let Some(report) = last_report() {
        println!("\n{report}");
    }
    Ok(())
}

/// Compiles the kernels with NVRTC and checks that cuBLAS loads, or says what is missing.
fn load(device: &CudaDevice) -> Result<Gpu, String> {
    quietly(|| {
        let context = &device.context;
        let ptx = compile_ptx(KERNELS).map_err(|error| format!("NVRTC failed: {error}"))?;
        let module = context.load_module(ptx).map_err(|error| {
            format!(
                "loading the kernels failed ({error}; a driver older than NVRTC cannot load \
                     its PTX)"
            )
        })?;
        let stream = context.default_stream();
        // Loads libcublas now rather than inside an attempt, where a panic would not be retried.
        drop(CudaBlas::new(stream.clone()).map_err(|error| format!("cuBLAS failed: {error}"))?);
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|error| format!("kernel {name}: {error}"))
        };
        Ok(Gpu {
            make_batch: function("make_batch")?,
            init_uniform: function("init_uniform")?,
            fill: function("fill")?,
            bias_relu: function("bias_relu")?,
            add_bias: function("add_bias")?,
            softmax_xent: function("softmax_xent")?,
            relu_backward: function("relu_backward")?,
            sgd: function("sgd")?,
            stream,
        })
    })
    .map_err(|why| format!("the GPU libraries are not all usable: {why}"))
}
