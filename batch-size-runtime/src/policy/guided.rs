//! The default policy: after an out-of-memory attempt, estimate from its figures how memory
//! grows with the batch size and try the size that lands just under the device's capacity.

use super::evidence::Evidence;
use super::{Decision, SizePolicy};
use crate::error::StopReason;
use crate::memory::Bytes;
use crate::record::{Attempt, Outcome, SearchReport};

/// Chooses each next size from the evidence of the failures so far.
///
/// After an out-of-memory attempt at size `s` that asked for `r` bytes with `u` bytes in use on
/// a device of `C` bytes, it assumes the least it can: that the failing allocation is the part
/// of memory that grows with the batch, the rest is fixed. The next size is the one whose
/// allocation fits in what was free, less the margin: `s × (C − u) / r × (1 − margin)`. One
/// tensor that grows with the batch, alone or beside a fixed part, is then found in one retry.
///
/// Where that estimate is below half of `s` and the failing allocation is smaller than what the
/// attempt had already allocated, the failure may have come part-way through the step (a model
/// whose layers allocate in turn): only a lower bound is known, the evidence is weak, and it
/// halves. When an estimate fails too, the failing allocation was not the whole
/// growth: it halves, unless two failures show the allocation growing faster than the batch
/// (attention's quadratic term), whose exponent then refines the estimate. Without figures (an
/// error that gives none and no memory backend readings) it halves exactly: 128, 64, 32, ...
///
/// When two failures at different sizes asked for the same bytes with the same memory in use,
/// and those alone exceed the device, the part that does not depend on the batch does not fit:
/// it stops at once with [`StopReason::Policy`] and the figures, instead of walking down to 1.
///
/// # Default
/// `margin`: 0.05 (the estimated size is lowered by 5 %, for allocator rounding and variation
/// between steps; chosen with `cargo bench -p batch-size-runtime --bench search`, see the
/// README).
///
/// ```
/// use batch_size_runtime::policy::Guided;
/// use batch_size_runtime::{last_report, BatchSizeSearch, SimulatedDevice};
///
/// let device = SimulatedDevice::new(16 << 30); // 16 GiB
/// let fitted: anyhow::Result<usize> = BatchSizeSearch::new(512)
///     .with_policy(Guided::new())
///     .with_release(device.clone())
///     .run_dyn(|batch_size| {
///         let _weights = device.alloc(4 << 30)?; // 4 GiB
///         let _activations = device.alloc(batch_size as u64 * (100 << 20))?; // 100 MiB a sample
///         Ok(batch_size)
///     });
/// // 122 fit; halving would have stopped at 64.
/// assert_eq!(fitted.unwrap(), 116);
/// assert_eq!(last_report().unwrap().len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Guided {
    margin: f64,
    last_choice: Choice,
    rationale: Option<String>,
}

/// How the size being tried was chosen: what its failure says about the estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// `starting`, or a halving step.
    Plain,
    /// Estimated from the figures.
    Estimate,
}

impl Default for Guided {
    fn default() -> Self {
        Guided::new()
    }
}

impl Guided {
    /// The default margin, 5 % of the device.
    pub const DEFAULT_MARGIN: f64 = 0.05;

    /// The policy with the default margin.
    ///
    /// ```
    /// use batch_size_runtime::policy::Guided;
    /// assert_eq!(Guided::new().margin(), Guided::DEFAULT_MARGIN);
    /// ```
    pub fn new() -> Self {
        Guided {
            margin: Guided::DEFAULT_MARGIN,
            last_choice: Choice::Plain,
            rationale: None,
        }
    }

    /// Keeps `margin` of the device free (0 ≤ margin < 1). Outside that range the search stops
    /// before its first attempt with [`StopReason::InvalidConfiguration`].
    ///
    /// ```
    /// use batch_size_runtime::policy::Guided;
    /// use batch_size_runtime::{BatchSizeSearch, NoExecutableBatchSize, StopReason};
    ///
    /// let result: anyhow::Result<usize> =
    ///     BatchSizeSearch::new(8).with_policy(Guided::new().with_margin(1.5)).run_dyn(Ok);
    /// let error = result.unwrap_err();
    /// let reason = error.downcast_ref::<NoExecutableBatchSize>().unwrap().reason();
    /// assert!(matches!(reason, StopReason::InvalidConfiguration(_)));
    /// ```
    pub fn with_margin(mut self, margin: f64) -> Self {
        self.margin = margin;
        self
    }

    /// The margin in use.
    ///
    /// ```
    /// use batch_size_runtime::policy::Guided;
    /// assert_eq!(Guided::new().with_margin(0.1).margin(), 0.1);
    /// ```
    pub fn margin(&self) -> f64 {
        self.margin
    }

    fn halve(&mut self, size: usize, why: &str) -> Decision {
        self.last_choice = Choice::Plain;
        self.rationale = Some(format!("{why}: halving"));
        Decision::Try(size / 2)
    }
}

/// One failure with every figure the estimate needs.
#[derive(Debug, Clone)]
struct Failure {
    /// Which allocation failed, as far as the text tells.
    site: String,
    size: usize,
    requested: u64,
    used: u64,
    capacity: u64,
    /// In use before the attempt (0 where unknown: everything counts as the attempt's own).
    used_at_start: u64,
}

/// The error's text up to its first figure: two failures of the same allocation read the same
/// ("activations: out of device memory ..." is not "logits: out of device memory ...").
fn site(attempt: &Attempt) -> String {
    match &attempt.outcome {
        Outcome::OutOfMemory { error } => {
            error.chars().take_while(|c| !c.is_ascii_digit()).collect()
        }
        _ => String::new(),
    }
}

fn failures(history: &SearchReport) -> Vec<Failure> {
    history
        .attempts()
        .filter_map(|attempt| {
            let evidence = Evidence::of(attempt)?;
            let failure = Failure {
                site: site(attempt),
                size: attempt.batch_size,
                requested: evidence.requested?,
                used: evidence.used_at_failure?,
                capacity: evidence.capacity?,
                used_at_start: evidence.used_at_start.unwrap_or(0),
            };
            // Figures that cannot be true are no evidence.
            let plausible = failure.requested > 0
                && failure.capacity > 0
                && failure.used <= failure.capacity
                && failure.size > 0;
            plausible.then_some(failure)
        })
        .collect()
}

fn close(a: u64, b: u64) -> bool {
    let (a, b) = (a as f64, b as f64);
    (a - b).abs() <= 0.01 * a.max(b)
}

impl SizePolicy for Guided {
    fn check(&self) -> Result<(), String> {
        if self.margin.is_finite() && (0.0..1.0).contains(&self.margin) {
            Ok(())
        } else {
            Err(format!(
                "`margin` must be at least 0 and below 1, got {}",
                self.margin
            ))
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        if !matches!(last.outcome, Outcome::OutOfMemory { .. }) {
            return Decision::Accept;
        }
        let size = last.batch_size;
        let failures = failures(history);
        let Some(latest) = failures.last().filter(|failure| failure.size == size) else {
            return self.halve(size, "no figures");
        };

        // Two failures at different sizes that asked for the same bytes with the same memory
        // in use: that allocation does not depend on the batch size.
        if let Some(earlier) = failures.iter().rev().nth(1) {
            let fixed = latest.used.saturating_add(latest.requested);
            if earlier.size != latest.size
                && close(earlier.requested, latest.requested)
                && close(earlier.used, latest.used)
                && fixed > latest.capacity
            {
                self.rationale = None;
                return Decision::Stop(StopReason::Policy(format!(
                    "the part of memory that does not depend on the batch size needs about {} of the device's {}: sizes {} and {} both failed asking for {} with {} in use",
                    Bytes(fixed),
                    Bytes(latest.capacity),
                    earlier.size,
                    latest.size,
                    Bytes(latest.requested),
                    Bytes(latest.used),
                )));
            }
        }

        // How fast the failing allocation grows with the batch: linear unless two failures
        // show more (the exponent of `requested ∝ size^k`).
        let exponent = failures
            .iter()
            .rev()
            .nth(1)
            // The same allocation at two sizes (two different ones say nothing of its growth).
            .filter(|earlier| earlier.size != latest.size && earlier.site == latest.site)
            .map(|earlier| {
                (latest.requested as f64 / earlier.requested as f64).ln()
                    / (latest.size as f64 / earlier.size as f64).ln()
            })
            .filter(|k| k.is_finite() && (1.2..=3.0).contains(k))
            .unwrap_or(1.0);
        let half = size / 2;
        let keep = 1.0 - self.margin;
        let to_size = |estimate: f64| -> usize {
            if estimate.is_finite() && estimate > 0.0 {
                estimate.floor().min(usize::MAX as f64) as usize
            } else {
                0
            }
        };
        // The least growth: only the failing allocation grows with the batch (at `exponent`),
        // the rest is fixed. Exact for one tensor that grows beside a fixed part.
        let room = latest.capacity.saturating_sub(latest.used) as f64;
        let conservative =
            to_size(size as f64 * (room / latest.requested as f64).powf(1.0 / exponent) * keep);
        let own = latest.used.saturating_sub(latest.used_at_start);
        // The failing allocation is at least as large as all the attempt held before it: it is
        // the part that grows, and the estimate stands even below halving.
        let dominant = latest.requested >= own;
        let (next, choice) = match self.last_choice {
            // An estimate failed and no faster growth explains it: the allocation that failed
            // was not the whole growth. No bolder than halving.
            Choice::Estimate if exponent == 1.0 => {
                return self.halve(size, "the last estimate failed")
            }
            // Two failures show the failing allocation growing faster than the batch, or it
            // dominates the attempt's memory, or the estimate keeps more than halving would.
            _ if exponent > 1.0 || dominant || conservative > half => {
                (conservative, Choice::Estimate)
            }
            // The failure may have come part-way through the step (layers that allocate in
            // turn): only a lower bound is known, and halving is as far as it goes.
            _ => (half, Choice::Plain),
        };
        if next == 0 || next >= size {
            return self.halve(size, "the figures contradict the failure");
        }
        if choice == Choice::Plain {
            return self.halve(size, "the failure may have come part-way through the step");
        }
        self.last_choice = choice;
        self.rationale = Some(format!(
            "{} in use ({} of them the attempt's) + {} asked for at size {size} on {}: about {next} fit ({}, {:.0} % margin)",
            Bytes(latest.used),
            Bytes(own),
            Bytes(latest.requested),
            Bytes(latest.capacity),
            if exponent > 1.0 {
                format!("the failing allocation growing as size^{exponent:.1}")
            } else {
                "if only the failing allocation grows".to_owned()
            },
            self.margin * 100.0,
        ));
        Decision::Try(next)
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone()
    }
}
