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
