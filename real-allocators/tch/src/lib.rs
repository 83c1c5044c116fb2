//! A small MLP in tch on the CPU, for the runtime's tests against libtorch's real allocator:
//! deterministic weights and data (no random generator, one intra-op thread), so that a run
//! under an address-space limit can be compared with one without.

use tch::{Device, Kind, TchError, Tensor};

/// The harness every real-allocator test shares (children, bisection, the limit), as the
/// other frameworks' tests use it.
#[path = "../../src/harness.rs"]
pub mod harness;

/// Input features a sample.
pub const FEATURES: i64 = 64;
/// Hidden units: 64 KiB of activations a sample and layer, so that memory grows with the batch.
pub const HIDDEN: i64 = 16384;

/// The model: `relu(x · w1) · w2`.
#[derive(Debug)]
pub struct Mlp {
    pub w1: Tensor,
    pub w2: Tensor,
}

fn options() -> (Kind, Device) {
    (Kind::Float, Device::Cpu)
}

/// Values in [-scale, scale] that depend only on their index.
fn wave(count: i64, scale: f64) -> Result<Tensor, TchError> {
    Tensor::f_arange(count, options())?
        .f_mul_scalar(0.37)?
        .f_sin()?
        .f_mul_scalar(scale)
}

impl Mlp {
    /// The same weights in every process, with gradients.
    pub fn new() -> Result<Mlp, TchError> {
        tch::set_num_threads(1);
        let w1 = wave(FEATURES * HIDDEN, 0.05)?
            .f_reshape(&[FEATURES, HIDDEN])?
            .set_requires_grad(true);
        let w2 = wave(HIDDEN, 0.01)?
            .f_reshape(&[HIDDEN, 1])?
            .set_requires_grad(true);
        Ok(Mlp { w1, w2 })
    }

    /// Outputs of samples `x`, through the fallible API (`f_*`: errors are returned).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_mm(&self.w1)?.f_relu()?.f_mm(&self.w2)
    }

    /// Outputs of samples `x`, through the plain API (errors panic).
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.mm(&self.w1).relu().mm(&self.w2)
    }

    /// The squared error summed over `x`'s samples, against targets `y`.
    pub fn f_loss_sum(&self, x: &Tensor, y: &Tensor) -> Result<Tensor, TchError> {
        self.f_forward(x)?.f_sub(y)?.f_square()?.f_sum(Kind::Float)
    }

    /// Clears the gradients.
    pub fn zero_grad(&mut self) {
        for weight in [&mut self.w1, &mut self.w2] {
            let mut grad = weight.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
    }

    /// The sum of w1's gradient (a scalar that changes with every sample's contribution).
    pub fn grad_sum(&self) -> f64 {
        self.w1.grad().sum(Kind::Double).double_value(&[])
    }
}

/// Samples `start..start + count`: inputs and targets that depend only on the sample's index.
pub fn samples(start: i64, count: i64) -> Result<(Tensor, Tensor), TchError> {
    let x = Tensor::f_arange_start(start * FEATURES, (start + count) * FEATURES, options())?
        .f_mul_scalar(0.013)?
        .f_cos()?
        .f_reshape(&[count, FEATURES])?;
    let y = Tensor::f_arange_start(start, start + count, options())?
        .f_mul_scalar(0.1)?
        .f_sin()?
        .f_reshape(&[count, 1])?;
    Ok((x, y))
}

/// Positions a sequence of the transformer block.
pub const SEQUENCE: i64 = 32;
/// The block's width.
pub const WIDTH: i64 = 64;

/// A transformer block (one attention head, then a feed-forward of four times the width, each
/// after a layer norm and with a residual), as a user writes one in tch: its step allocates
/// many tensors of a few MiB each, which glibc serves from its heap once it has given one such
/// block back, so that the process keeps address space after a step.
#[derive(Debug)]
pub struct Block {
    pub weights: Vec<Tensor>,
}

impl Block {
    /// The same weights in every process, with gradients.
    pub fn new() -> Result<Block, TchError> {
        tch::set_num_threads(1);
        let shapes = [
            [WIDTH, WIDTH],
            [WIDTH, WIDTH],
            [WIDTH, WIDTH],
            [WIDTH, WIDTH],
            [WIDTH, 4 * WIDTH],
            [4 * WIDTH, WIDTH],
        ];
        let weights = shapes
            .iter()
            .map(|shape| {
                Ok(wave(shape[0] * shape[1], 0.1)?
                    .f_reshape(shape)?
                    .set_requires_grad(true))
            })
            .collect::<Result<Vec<_>, TchError>>()?;
        Ok(Block { weights })
    }

    /// Outputs of sequences `x` (`[batch, SEQUENCE, WIDTH]`), through the fallible API.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let [wq, wk, wv, wo, w1, w2] = self.weights.as_slice() else {
            return Err(TchError::Shape("a block has six weights".to_owned()));
        };
        let norm = |t: &Tensor| t.f_layer_norm::<Tensor>(&[WIDTH], None, None, 1e-5, false);
        let h = norm(x)?;
        let (q, k, v) = (h.f_matmul(wq)?, h.f_matmul(wk)?, h.f_matmul(wv)?);
        let scores = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(1.0 / (WIDTH as f64).sqrt())?;
        let attended = scores.f_softmax(-1, Kind::Float)?.f_matmul(&v)?;
        let y = x.f_add(&attended.f_matmul(wo)?)?;
        // ReLU, not GELU: libtorch 1.13 runs GELU through oneDNN, which crashes (SIGSEGV) when an
        // allocation inside it fails rather than returning the error.
        let hidden = norm(&y)?.f_matmul(w1)?.f_relu()?;
        y.f_add(&hidden.f_matmul(w2)?)
    }

    /// The squared outputs summed over `x`'s sequences.
    pub fn f_loss_sum(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.f_forward(x)?.f_square()?.f_sum(Kind::Float)
    }
}

/// Sequences `start..start + count` for the block: values that depend only on their index.
pub fn sequences(start: i64, count: i64) -> Result<Tensor, TchError> {
    let per = SEQUENCE * WIDTH;
    Tensor::f_arange_start(start * per, (start + count) * per, options())?
        .f_mul_scalar(0.011)?
        .f_cos()?
        .f_reshape(&[count, SEQUENCE, WIDTH])
}
