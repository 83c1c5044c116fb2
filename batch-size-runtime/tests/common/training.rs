//! Training steps on a simulated 16 GiB device, for the runners that learn from every step:
//! shared by `tests/runners/convergence.rs` and `benches/convergence.rs`.
//!
//! Each shape keeps its model state between steps, as a framework does: the weights from the
//! start, gradients allocated at the first backward and optimizer state at the first optimizer
//! step where the shape says so (so that a step's memory differs between step 1 and step 2), and
//! activations per micro-batch, layer by layer (so that an out-of-memory comes part-way through
//! a pass).

#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::ops::Range;

use batch_size_runtime::{memory::SimAllocation, memory::SimulatedDevice, BatchPlan, OutOfMemory};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const DEVICE: u64 = 16 * GIB;

/// How a model's memory grows with the micro size.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub name: &'static str,
    /// Weights, allocated before training.
    pub weights: u64,
    /// Gradients, allocated at the first backward (0: none kept).
    pub lazy_gradients: u64,
    /// Optimizer state, allocated at the first optimizer step (0: none).
    pub lazy_optimizer: u64,
    /// Activations kept for the backward pass: bytes a sample, for each layer.
    pub layers: &'static [u64],
    /// Attention scores: bytes a sample², held while a layer runs (0: none).
    pub quadratic: u64,
    /// A workspace that appears above a micro size (a convolution algorithm that needs it):
    /// (size, bytes).
    pub workspace_above: Option<(usize, u64)>,
}

/// The shapes of the convergence bench and tests: none of them a straight line from step 1.
pub const SHAPES: [Shape; 4] = [
    // A 24-layer model whose gradients appear at the first backward.
    Shape {
        name: "layered, lazy gradients",
        weights: 2 * GIB,
        lazy_gradients: 2304 * MIB,
        lazy_optimizer: 0,
        layers: &[2 * MIB; 24],
        quadratic: 0,
        workspace_above: None,
    },
    // Attention: activations and scores that grow with the square of the micro size's rows.
    Shape {
        name: "attention",
        weights: GIB,
        lazy_gradients: GIB,
        lazy_optimizer: 0,
        layers: &[6 * MIB; 12],
        quadratic: 96 * 1024,
        workspace_above: None,
    },
    // Adam: two moments as large as the weights, allocated at the first optimizer step.
    Shape {
        name: "lazy Adam state",
        weights: 1536 * MIB,
        lazy_gradients: 1536 * MIB,
        lazy_optimizer: 3 * GIB,
        layers: &[(3 * MIB) / 2; 24],
        quadratic: 0,
        workspace_above: None,
    },
    // A pyramid of feature maps (each stage half the last), and a workspace above 64 samples.
    Shape {
        name: "feature pyramid + workspace",
        weights: 512 * MIB,
        lazy_gradients: 512 * MIB,
        lazy_optimizer: GIB,
        layers: &[32 * MIB, 16 * MIB, 8 * MIB, 4 * MIB, 2 * MIB, MIB],
        quadratic: 0,
        workspace_above: Some((64, 1536 * MIB)),
    },
];

/// A model of `shape` training on `device`: its state, and the passes it ran.
pub struct Model<'d> {
    pub shape: Shape,
    pub device: &'d SimulatedDevice,
    weights: RefCell<Option<SimAllocation>>,
    gradients: RefCell<Option<SimAllocation>>,
    optimizer: RefCell<Option<SimAllocation>>,
    /// Micro-batches started, whether they finished or not.
    pub passes_started: Cell<usize>,
}

impl<'d> Model<'d> {
    pub fn new(shape: Shape, device: &'d SimulatedDevice) -> Self {
        let weights = device.alloc(shape.weights).ok();
        Model {
            shape,
            device,
            weights: RefCell::new(weights),
            gradients: RefCell::new(None),
            optimizer: RefCell::new(None),
            passes_started: Cell::new(0),
        }
    }

    /// One pass (forward and backward) of `samples`.
    pub fn pass(&self, samples: usize) -> Result<(), OutOfMemory> {
        self.passes_started.set(self.passes_started.get() + 1);
        let shape = &self.shape;
        let samples = samples as u64;
        let mut kept = Vec::with_capacity(shape.layers.len() + 1);
        if let Some((above, bytes)) = shape.workspace_above {
            if samples > above as u64 {
                kept.push(self.device.alloc(bytes)?);
            }
        }
        for &per_sample in shape.layers {
            kept.push(self.device.alloc(per_sample * samples)?);
            if shape.quadratic > 0 {
                // The scores live while the layer runs.
                let _scores = self.device.alloc(shape.quadratic * samples * samples)?;
            }
        }
        // The backward pass: the gradients appear at the first, before activations are freed.
        if shape.lazy_gradients > 0 && self.gradients.borrow().is_none() {
            let gradients = self.device.alloc(shape.lazy_gradients)?;
            *self.gradients.borrow_mut() = Some(gradients);
        }
        drop(kept);
        Ok(())
    }

    /// The optimizer step: its state appears at the first.
    pub fn optimizer_step(&self) -> Result<(), OutOfMemory> {
        if self.shape.lazy_optimizer > 0 && self.optimizer.borrow().is_none() {
            let state = self.device.alloc(self.shape.lazy_optimizer)?;
            *self.optimizer.borrow_mut() = Some(state);
        }
        Ok(())
    }

    /// One step of a plan: every micro-batch, then the optimizer.
    pub fn step(&self, plan: &BatchPlan) -> Result<(), OutOfMemory> {
        for micro in plan.micro_batches() {
            self.pass(micro.range.len())?;
        }
        self.optimizer_step()
    }

    /// Whether `holds` is at least the size the weights took (a device too small for the
    /// model says so here, not as a failed step).
    pub fn loaded(&self) -> bool {
        self.weights.borrow().is_some()
    }
}

/// The largest micro size whose steps fit once the model's state is all allocated (step 2 on):
/// found on a fresh device by trying sizes, not from the shape's formula.
pub fn largest_fit(shape: Shape) -> usize {
    let fits = |samples: usize| {
        let device = SimulatedDevice::new(DEVICE);
        let model = Model::new(shape, &device);
        model.pass(1).is_ok() && model.optimizer_step().is_ok() && model.pass(samples).is_ok()
    };
    // At least 1: every shape here runs one sample.
    crate::bisect::largest_that_fits(fits).max(1)
}

/// A linear model `y = w · x` with a mean squared error; sample `i` of step `s` is a
/// deterministic function of both.
pub fn sample(step: usize, i: usize) -> ([f64; 2], f64) {
    let a = ((step * 7919 + i * 104_729) % 1000) as f64 / 500.0 - 1.0;
    let b = ((step * 31 + i * 613) % 997) as f64 / 498.5 - 1.0;
    ([a, b], 3.0 * a - 0.5 * b + 0.25)
}

pub fn mean_gradient(w: &[f64; 2], step: usize, samples: Range<usize>) -> [f64; 2] {
    let count = samples.len() as f64;
    let mut gradient = [0.0; 2];
    for i in samples {
        let (x, y) = sample(step, i);
        let error = w[0] * x[0] + w[1] * x[1] - y;
        gradient[0] += 2.0 * error * x[0] / count;
        gradient[1] += 2.0 * error * x[1] / count;
    }
    gradient
}
