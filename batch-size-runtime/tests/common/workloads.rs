//! The simulated memory workloads of the search benchmark, defined once: `benches/search.rs`
//! prints every policy's results on them and `tests/search/guided_never_worse.rs` holds the default
//! policy to halving's promise on them. Both include this file with `#[path = "…"] mod
//! workloads;` (a bench and an integration test cannot import each other); it sits in a folder of
//! `tests/` so that Cargo does not take it for a test or bench of its own.
//!
//! Workloads, on a simulated 16 GiB device:
//! - linear: one activation tensor of 120 MiB a sample;
//! - fixed + linear: 9 GiB of weights and optimizer state, then 60 MiB a sample;
//! - layered: 2 GiB of weights, then 24 layers that each keep 5 MiB a sample, so the failure
//!   comes part-way through the step;
//! - quadratic: 1 GiB, 30 MiB a sample and an attention matrix of 0.25 MiB × size²;
//! - rounded: 3 GiB, then four tensors of 7.3 MiB a sample, every allocation rounded up to
//!   2 MiB blocks;
//! - cramped: 15 GiB fixed, then 20 MiB a sample;
//! - noisy: 4 GiB, then 100 MiB a sample varying by up to ±3 % from one attempt to the next;
//! - decoder: 3 GiB of weights and optimizer state, 12 layers of 20 MiB a sample, then logits of
//!   150 MiB a sample last (34 fit): the failure comes in the layers, the largest tensor after;
//! - attention: 2 GiB, 30 MiB a sample, then 0.3 MiB × size² (174 fit);
//! - lazy Adam: 2 GiB of weights; a first step (activations of 80 MiB a sample, 2 GiB of
//!   gradients), then Adam's moments (4 GiB) appear at the first optimizer step, as in PyTorch,
//!   and a second step runs with them: a large size fails in the first step, whose figures do not
//!   show the moments to come;
//! - PyTorch allocator: a caching allocator in front of the device as PyTorch's: requests under
//!   1 MiB carved from 2 MiB segments, under 10 MiB from 20 MiB segments, larger ones rounded up
//!   to 2 MiB; freed blocks stay in the cache for the next request of their kind and go back to
//!   the device only when a request fails (then retried) or at the release between attempts.
//!   3 GiB of weights, 24 layers keeping 3 MiB a sample with a 1.5 MiB-a-sample temporary and a
//!   40 KiB-a-sample buffer each, then logits of 40 MiB a sample.
//! - pyramid: 1 GiB, then a U-Net's levels down and back up, each keeping 64, 32, 16, 8, 4 MiB a
//!   sample down and the same up (the largest tensors first and last);
//! - attention layers: 2 GiB, then 6 layers that each keep 10 MiB a sample and a batch² score
//!   matrix of 48 KiB × size²: the failure comes part-way, in a batch² term;
//! - state last: activations of 70 MiB a sample first, then 6 GiB of optimizer state created
//!   during the attempt (a fixed part that is not there when a large size fails).
//!
//! Shapes the policies were not written against ([`Workload::NEW`], in the benchmark's second
//! table only):
//! - fixed last: 1 GiB, 16 layers of 8 MiB a sample, then a 5 GiB buffer (gradients, an
//!   all-reduce bucket) allocated last;
//! - fixed first and last: 3 GiB, 30 layers of 3 MiB a sample, then 3 GiB more;
//! - wide logits: 2 GiB, 4 layers of 40 MiB a sample, logits of 300 MiB a sample last;
//! - batch² first: 1 GiB, a 0.4 MiB × size² term, then 20 layers of 4 MiB a sample;
//! - U-Net with attention: 2 GiB, levels of 48, 24, 12 MiB a sample down, a 0.2 MiB × size²
//!   attention at the bottom, the same levels up;
//! - small rounded tensors: 1 GiB, 64 tensors of 0.7 MiB a sample, on a device that rounds every
//!   allocation up to 2 MiB blocks;
//! - very little room: 15.5 GiB fixed, then 6 MiB a sample;
//! - workspace: 2 GiB, 20 layers that keep 4 MiB a sample and use a 30 MiB-a-sample temporary
//!   freed before the next layer (the peak comes mid-step, on a device that reuses memory);
//! - size^1.5: 2 GiB, 10 layers of 3 MiB a sample and a 0.5 MiB × size^1.5 term each.

use std::cell::RefCell;

use batch_size_runtime::memory::{MemorySnapshot, ReleaseError};
use batch_size_runtime::{
    memory::MemoryBackend, memory::SimAllocation, memory::SimulatedDevice, OutOfMemory,
};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
pub const KIB: u64 = 1 << 10;
pub const DEVICE: u64 = 16 * GIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Linear,
    FixedLinear,
    Layered,
    Quadratic,
    Rounded,
    Cramped,
    Noisy,
    Decoder,
    Attention,
    LazyAdam,
    PyTorchAllocator,
    Pyramid,
    AttentionLayers,
    StateLast,
    FixedLast,
    FixedBothEnds,
    WideLogits,
    QuadraticFirst,
    AttentionPyramid,
    SmallRounded,
    LittleRoom,
    Workspace,
    PowerOneHalf,
}

impl Workload {
    pub const ALL: [Workload; 14] = [
        Workload::Linear,
        Workload::FixedLinear,
        Workload::Layered,
        Workload::Quadratic,
        Workload::Rounded,
        Workload::Cramped,
        Workload::Noisy,
        Workload::Decoder,
        Workload::Attention,
        Workload::LazyAdam,
        Workload::PyTorchAllocator,
        Workload::Pyramid,
        Workload::AttentionLayers,
        Workload::StateLast,
    ];

    /// Shapes written for the growth and cache benchmark, not in [`Workload::ALL`].
    pub const NEW: [Workload; 9] = [
        Workload::FixedLast,
        Workload::FixedBothEnds,
        Workload::WideLogits,
        Workload::QuadraticFirst,
        Workload::AttentionPyramid,
        Workload::SmallRounded,
        Workload::LittleRoom,
        Workload::Workspace,
        Workload::PowerOneHalf,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::Linear => "linear",
            Workload::FixedLinear => "fixed + linear",
            Workload::Layered => "layered (24)",
            Workload::Quadratic => "quadratic",
            Workload::Rounded => "2 MiB-rounded",
            Workload::Cramped => "cramped",
            Workload::Noisy => "noisy (±3 %)",
            Workload::Decoder => "decoder (logits last)",
            Workload::Attention => "attention (size²)",
            Workload::LazyAdam => "lazy Adam moments",
            Workload::PyTorchAllocator => "PyTorch allocator",
            Workload::Pyramid => "pyramid (U-Net)",
            Workload::AttentionLayers => "attention layers (6 × size²)",
            Workload::StateLast => "optimizer state last",
            Workload::FixedLast => "5 GiB buffer last",
            Workload::FixedBothEnds => "fixed first and last",
            Workload::WideLogits => "wide logits last",
            Workload::QuadraticFirst => "size² first",
            Workload::AttentionPyramid => "U-Net with size² attention",
            Workload::SmallRounded => "small tensors, 2 MiB blocks",
            Workload::LittleRoom => "very little room",
            Workload::Workspace => "freed workspace (peak mid-step)",
            Workload::PowerOneHalf => "size^1.5 layers",
        }
    }

    /// A fresh device of the kind the workload runs on.
    pub fn device(self) -> SimulatedDevice {
        match self {
            Workload::Rounded | Workload::SmallRounded => SimulatedDevice::new(DEVICE)
                .with_caching()
                .with_block_size(2 * MIB),
            // Memory freed within the attempt is reused at once (by the device, or by the
            // allocator in front of it), as PyTorch's allocator does.
            Workload::LazyAdam | Workload::PyTorchAllocator | Workload::Workspace => {
                SimulatedDevice::new(DEVICE)
            }
            _ => SimulatedDevice::new(DEVICE).with_caching(),
        }
    }

    /// One attempt at `size`: every allocation it makes, kept until it returns. `noise` scales
    /// the noisy workload's per-sample bytes (see [`noise`]); the others ignore it.
    pub fn step(self, device: &SimulatedDevice, size: u64, noise: f64) -> Result<(), OutOfMemory> {
        let mut held = Vec::new();
        let held = &mut held;
        match self {
            Workload::Linear => hold(device, held, size * 120 * MIB),
            Workload::FixedLinear => {
                hold(device, held, 9 * GIB)?;
                hold(device, held, size * 60 * MIB)
            }
            Workload::Layered => {
                hold(device, held, 2 * GIB)?;
                (0..24).try_for_each(|_| hold(device, held, size * 5 * MIB))
            }
            Workload::Quadratic => {
                hold(device, held, GIB)?;
                hold(device, held, size * 30 * MIB)?;
                hold(device, held, size * size * MIB / 4)
            }
            Workload::Rounded => {
                hold(device, held, 3 * GIB)?;
                (0..4).try_for_each(|_| hold(device, held, (size as f64 * 7.3 * MIB as f64) as u64))
            }
            Workload::Cramped => {
                hold(device, held, 15 * GIB)?;
                hold(device, held, size * 20 * MIB)
            }
            Workload::Noisy => {
                hold(device, held, 4 * GIB)?;
                hold(
                    device,
                    held,
                    (size as f64 * 100.0 * MIB as f64 * noise) as u64,
                )
            }
            Workload::Decoder => {
                hold(device, held, 3 * GIB)?;
                (0..12).try_for_each(|_| hold(device, held, size * 20 * MIB))?;
                hold(device, held, size * 150 * MIB)
            }
            Workload::Attention => {
                hold(device, held, 2 * GIB)?;
                hold(device, held, size * 30 * MIB)?;
                hold(device, held, size * size * 3 * MIB / 10)
            }
            Workload::LazyAdam => {
                let _weights = device.alloc(2 * GIB)?;
                let mut moments = None;
                for _ in 0..2 {
                    let activations = device.alloc(size * 80 * MIB)?;
                    let gradients = device.alloc(2 * GIB)?;
                    drop(activations);
                    if moments.is_none() {
                        // Adam's exp_avg and exp_avg_sq, created at the first optimizer step.
                        moments = Some(device.alloc(4 * GIB)?);
                    }
                    // zero_grad(set_to_none=True): the gradients go until the next backward.
                    drop(gradients);
                }
                Ok(())
            }
            Workload::PyTorchAllocator => {
                pytorch_step(&CachingAllocator::new(device.clone()), size)
            }
            Workload::Pyramid => {
                hold(device, held, GIB)?;
                let levels = [64, 32, 16, 8, 4];
                levels
                    .iter()
                    .chain(levels.iter().rev())
                    .try_for_each(|&per_sample| hold(device, held, size * per_sample * MIB))
            }
            Workload::AttentionLayers => {
                hold(device, held, 2 * GIB)?;
                (0..6).try_for_each(|_| {
                    hold(device, held, size * 10 * MIB)?;
                    hold(device, held, size * size * 48 * KIB)
                })
            }
            Workload::StateLast => {
                hold(device, held, size * 70 * MIB)?;
                hold(device, held, 6 * GIB)
            }
            Workload::FixedLast => {
                hold(device, held, GIB)?;
                (0..16).try_for_each(|_| hold(device, held, size * 8 * MIB))?;
                hold(device, held, 5 * GIB)
            }
            Workload::FixedBothEnds => {
                hold(device, held, 3 * GIB)?;
                (0..30).try_for_each(|_| hold(device, held, size * 3 * MIB))?;
                hold(device, held, 3 * GIB)
            }
            Workload::WideLogits => {
                hold(device, held, 2 * GIB)?;
                (0..4).try_for_each(|_| hold(device, held, size * 40 * MIB))?;
                hold(device, held, size * 300 * MIB)
            }
            Workload::QuadraticFirst => {
                hold(device, held, GIB)?;
                hold(device, held, size * size * 2 * MIB / 5)?;
                (0..20).try_for_each(|_| hold(device, held, size * 4 * MIB))
            }
            Workload::AttentionPyramid => {
                hold(device, held, 2 * GIB)?;
                let levels = [48, 24, 12];
                levels
                    .iter()
                    .try_for_each(|&per_sample| hold(device, held, size * per_sample * MIB))?;
                hold(device, held, size * size * MIB / 5)?;
                levels
                    .iter()
                    .rev()
                    .try_for_each(|&per_sample| hold(device, held, size * per_sample * MIB))
            }
            Workload::SmallRounded => {
                hold(device, held, GIB)?;
                (0..64).try_for_each(|_| hold(device, held, size * 7 * MIB / 10))
            }
            Workload::LittleRoom => {
                hold(device, held, 15 * GIB + GIB / 2)?;
                hold(device, held, size * 6 * MIB)
            }
            Workload::Workspace => {
                hold(device, held, 2 * GIB)?;
                (0..20).try_for_each(|_| {
                    let _temporary = device.alloc(size * 30 * MIB)?;
                    hold(device, held, size * 4 * MIB)
                })
            }
            Workload::PowerOneHalf => {
                hold(device, held, 2 * GIB)?;
                (0..10).try_for_each(|_| {
                    hold(device, held, size * 3 * MIB)?;
                    hold(
                        device,
                        held,
                        ((size as f64).powf(1.5) * 0.5 * MIB as f64) as u64,
                    )
                })
            }
        }
    }

    /// The largest size whose step fits on a fresh device, the noisy workload's bytes scaled by
    /// `noise` (1.0: nominal).
    pub fn largest_fit(self, noise: f64) -> usize {
        let fits = |size: usize| self.step(&self.device(), size as u64, noise).is_ok();
        let (mut low, mut high) = (0usize, 1usize);
        while fits(high) {
            low = high;
            high *= 2;
        }
        while high - low > 1 {
            let middle = (low + high) / 2;
            if fits(middle) {
                low = middle;
            } else {
                high = middle;
            }
        }
        low
    }
}

/// Allocates `bytes` on `device` and keeps the allocation in `held`.
pub fn hold(
    device: &SimulatedDevice,
    held: &mut Vec<SimAllocation>,
    bytes: u64,
) -> Result<(), OutOfMemory> {
    held.push(device.alloc(bytes)?);
    Ok(())
}

/// Deterministic noise in [0.97, 1.03] for the n-th attempt.
pub fn noise(attempt: u64) -> f64 {
    let mut x = attempt
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0x2545_F491);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    0.97 + 0.06 * ((x % 10_000) as f64 / 10_000.0)
}

/// The device without its readings: errors keep their text (bytes asked for, free, total), the
/// release still works, the memory backend reports nothing.
#[derive(Debug)]
#[allow(dead_code)] // not every binary that includes this file runs the text-only door
pub struct TextOnly(pub SimulatedDevice);

impl MemoryBackend for TextOnly {
    fn release(&self) -> Result<(), ReleaseError> {
        self.0.release()
    }
    fn memory(&self) -> MemorySnapshot {
        MemorySnapshot::default()
    }
}

/// The step on PyTorch's allocator: weights, 24 layers that keep an activation, use a
/// temporary (freed at once, reused from the cache by the next layer) and keep a small buffer,
/// then the logits.
fn pytorch_step(allocator: &CachingAllocator, size: u64) -> Result<(), OutOfMemory> {
    let mut held = Vec::new();
    for _ in 0..200 {
        held.push(allocator.alloc(15 * MIB)?); // 3 GiB of weights in 15 MiB tensors
    }
    for _ in 0..24 {
        held.push(allocator.alloc(size * 3 * MIB)?);
        let temporary = allocator.alloc(size * 3 * MIB / 2)?;
        held.push(allocator.alloc(size * 40 * KIB)?);
        allocator.free(temporary);
    }
    held.push(allocator.alloc(size * 40 * MIB)?);
    for block in held {
        allocator.free(block);
    }
    Ok(())
}

/// PyTorch's caching allocator, as far as sizes go (c10/cuda/CUDACachingAllocator.cpp):
/// requests under 1 MiB rounded to 512 bytes inside 2 MiB segments, under 10 MiB inside 20 MiB
/// segments, larger ones rounded up to 2 MiB in a segment of their own size; a freed block stays
/// in its segment for later requests; when the device refuses a segment, the unused cached
/// segments are given back and the request retried once before the out-of-memory error.
/// Fragmentation inside a segment is not modelled (free bytes are counted, not placed).
struct CachingAllocator {
    device: SimulatedDevice,
    segments: RefCell<Vec<Segment>>,
}

struct Segment {
    memory: Option<SimAllocation>,
    size: u64,
    used: u64,
    kind: u8,
}

/// A block: its segment and its bytes.
struct Block(usize, u64);

impl CachingAllocator {
    fn new(device: SimulatedDevice) -> Self {
        CachingAllocator {
            device,
            segments: RefCell::new(Vec::new()),
        }
    }

    fn alloc(&self, bytes: u64) -> Result<Block, OutOfMemory> {
        let (kind, rounded, segment_size) = if bytes < MIB {
            (0, bytes.div_ceil(512) * 512, 2 * MIB)
        } else if bytes < 10 * MIB {
            (1, bytes.div_ceil(512) * 512, 20 * MIB)
        } else {
            let rounded = bytes.div_ceil(2 * MIB) * 2 * MIB;
            (2, rounded, rounded)
        };
        let mut segments = self.segments.borrow_mut();
        // Best fit among the cached segments of the same kind.
        let found = segments
            .iter()
            .enumerate()
            .filter(|(_, segment)| {
                segment.memory.is_some()
                    && segment.kind == kind
                    && segment.size - segment.used >= rounded
            })
            .min_by_key(|(_, segment)| segment.size - segment.used)
            .map(|(index, _)| index);
        let index = match found {
            Some(index) => index,
            None => {
                let memory = match self.device.alloc(segment_size) {
                    Ok(memory) => memory,
                    Err(_) => {
                        // Give the cached, unused segments back and try once more.
                        for segment in segments.iter_mut().filter(|segment| segment.used == 0) {
                            segment.memory = None;
                        }
                        self.device.alloc(segment_size)?
                    }
                };
                segments.push(Segment {
                    memory: Some(memory),
                    size: segment_size,
                    used: 0,
                    kind,
                });
                segments.len() - 1
            }
        };
        segments[index].used += rounded;
        Ok(Block(index, rounded))
    }

    fn free(&self, block: Block) {
        if let Some(segment) = self.segments.borrow_mut().get_mut(block.0) {
            segment.used = segment.used.saturating_sub(block.1);
        }
    }
}
