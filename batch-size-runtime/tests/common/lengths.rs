//! Work whose items differ in cost: sequences of heavy-tailed lengths on a simulated device,
//! with attention's square term. Shared by `tests/runners/by_cost.rs` and `benches/by_cost.rs`.
//!
//! A micro-batch of `n` sequences padded to the longest, `L` tokens, allocates
//! `n × L × per_token + n × L² × per_square` bytes of activations on top of the weights, which
//! are held from before the first step; the activations are freed when the micro-batch ends.

#![allow(dead_code)]

use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::OutOfMemory;

pub const GIB: u64 = 1 << 30;

/// How memory grows with a micro-batch's shape.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    pub device: u64,
    /// Weights, gradients and optimizer state: held before the first step.
    pub held: u64,
    pub per_token: u64,
    /// Bytes per token² (attention's scores); 0: none.
    pub per_square: u64,
}

/// A 24 GiB device, 8 GiB held, 400 KiB a token, attention scores equal to the linear term at
/// 2,048 tokens: one sequence of 8,192 tokens alone takes 15.7 of the 16 GiB left.
pub const TRANSFORMER: Model = Model {
    device: 24 * GIB,
    held: 8 * GIB,
    per_token: 400 << 10,
    per_square: 200,
};

/// An encoder for embeddings: no square term worth naming, less memory a token.
pub const ENCODER: Model = Model {
    device: 8 * GIB,
    held: GIB,
    per_token: 96 << 10,
    per_square: 0,
};

impl Model {
    /// The activations of `n` items padded to `longest` tokens.
    pub fn bytes(&self, n: usize, longest: u64) -> u64 {
        let n = n as u64;
        n * longest * self.per_token + n * longest * longest * self.per_square
    }

    /// Whether `n` items padded to `longest` fit next to what is held.
    pub fn fits(&self, n: usize, longest: u64) -> bool {
        self.held + self.bytes(n, longest) <= self.device
    }

    /// The device, with the held state allocated (kept alive by the caller).
    pub fn device(&self) -> (SimulatedDevice, batch_size_runtime::memory::SimAllocation) {
        let device = SimulatedDevice::new(self.device);
        let held = device.alloc(self.held).expect("the held state fits");
        (device, held)
    }

    /// Runs one micro-batch of `items` (indices into `lengths`) on `device`.
    pub fn run(
        &self,
        device: &SimulatedDevice,
        lengths: &[u64],
        items: &[usize],
    ) -> Result<(), OutOfMemory> {
        let longest = items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
        // Layer by layer, so that an out-of-memory comes part-way through the pass.
        let layers = 4;
        let mut kept = Vec::with_capacity(layers);
        for _ in 0..layers {
            kept.push(device.alloc(self.bytes(items.len(), longest) / layers as u64)?);
        }
        Ok(())
    }

    /// The fewest micro-batches the step's items need, by an oracle that knows the memory
    /// function and groups items by length (the longest together).
    pub fn fewest_passes(&self, lengths: &[u64]) -> usize {
        let mut sorted = lengths.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let mut passes = 0;
        let mut start = 0;
        while start < sorted.len() {
            let longest = sorted[start];
            let mut end = start + 1;
            while end < sorted.len() && self.fits(end + 1 - start, longest) {
                end += 1;
            }
            passes += 1;
            start = end;
        }
        passes
    }
}

/// A deterministic source of lengths.
#[derive(Debug, Clone)]
pub struct Lengths {
    state: u64,
    /// The median length.
    pub median: f64,
    /// The spread of the log-length (lognormal): 1.0 is heavy-tailed.
    pub sigma: f64,
    pub longest: u64,
}

impl Lengths {
    /// A median of 300 tokens and a tail to 8,192.
    pub fn heavy_tailed(seed: u64) -> Self {
        Lengths {
            state: seed,
            median: 300.0,
            sigma: 1.1,
            longest: 8_192,
        }
    }

    fn uniform(&mut self) -> f64 {
        // splitmix64
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// The next length: lognormal around the median, within `1..=longest`.
    pub fn next_length(&mut self) -> u64 {
        let (u, v) = (self.uniform(), self.uniform());
        let normal = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
        let length = (self.median * (self.sigma * normal).exp()).round();
        (length as u64).clamp(1, self.longest)
    }

    pub fn batch(&mut self, items: usize) -> Vec<u64> {
        (0..items).map(|_| self.next_length()).collect()
    }
}
