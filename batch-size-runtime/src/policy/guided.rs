//! The default policy: after an out-of-memory attempt, estimate from its figures how memory
//! grows with the batch size, without ever ending below the size halving would have found or
//! taking more than one attempt more than halving.

use super::evidence::Evidence;
use super::{Decision, SizePolicy};
use crate::error::StopReason;
use crate::memory::Bytes;
use crate::record::{Attempt, Outcome, SearchReport};

/// Chooses each next size from the evidence of the failures so far, never ending below the size
/// halving would have found nor taking more than one attempt more than halving.
///
/// Halving from the first size `s₀` tries the rungs `s₀, s₀/2, s₀/4, ...` and ends at the
/// largest rung that fits. This policy keeps that ladder as its floor:
///
/// - **Never below halving.** After an out-of-memory attempt it never proposes a size below the
///   largest rung that the evidence has not proved to fail. A rung is proved to fail when it is at
///   or above a size that failed, or when the bytes a failure had reached (what the attempt held
///   plus what it asked for) would still exceed the device at that rung even if every one of them
///   shrank as fast as the batch squared (attention's `batch²` term; a linear or a fixed part
///   shrinks slower). Whatever the step does after the failure, and wherever in the step the
///   failure came (layers that allocate in turn, a pyramid, buffers that do not grow), the
///   figures seen so far only bound the need from below, and that bound is all it relies on.
/// - **At most one attempt more than halving.** An attempt at a rung costs nothing against
///   halving, which makes it too; a rung proved to fail is an attempt saved. Between the rungs it
///   tries one estimate of its own at a time, and only while it has an attempt in hand: after an
///   estimate that failed and saved nothing it follows the ladder until a proof gives one back.
/// - **The estimate.** After a failure at size `s` whose allocation asked for `r` bytes with
///   `u` in use on a device of `C`, it takes the failing allocation as the part that grows
///   (linearly, or at the exponent two failures of the same allocation show) and the rest as
///   fixed: `s × (C − u) / r × (1 − margin)`. One tensor that grows beside a fixed part is then
///   found in one attempt once the ladder is below it. Where the failure may have come part-way
///   through the step (the failing allocation smaller than what the attempt held) or more comes
///   after it (logits after the layers, optimizer state created at the first step) the estimate
///   may be too large: that costs the attempt in hand, never a size below the ladder. An
///   estimate at or below the next rung not proved to fail is not tried: that rung is.
/// - **Stopping early only on proof.** It stops before the engine reaches `min` only when two
///   failures at different sizes failed on their first allocation (nothing of the attempt's own in
///   use, which needs the memory backend's readings), asking for the same bytes, more than the
///   device had free: that allocation does not depend on the batch size and does not fit at any.
///   A text that repeats the same figures at every size proves nothing: it follows the ladder.
///
/// Without figures (an error that gives none and no memory backend readings) it halves exactly:
/// 128, 64, 32, ...
///
/// # Default
/// `margin`: 0.05 (an estimated size is lowered by 5 %, for allocator rounding and variation
/// between steps; see `cargo bench -p batch-size-runtime --bench search` and the README).
///
/// ```
/// use batch_size_runtime::policy::Guided;
/// use batch_size_runtime::{last_report, BatchSizeSearch, memory::SimulatedDevice};
///
/// let device = SimulatedDevice::new(16 << 30); // 16 GiB
/// let fitted: anyhow::Result<usize> = BatchSizeSearch::new(512)
///     .with_policy(Guided::new())
///     .with_release(device.clone())
///     .run(|batch_size| {
///         let _weights = device.alloc(4 << 30)?; // 4 GiB
///         let _activations = device.alloc(batch_size as u64 * (100 << 20))?; // 100 MiB a sample
///         Ok(batch_size)
///     });
/// // 122 fit. Halving tries 512, 256, 128 and stops at 64; this policy cannot rule out that
/// // 256 or 128 fit (an allocation growing as batch² would) until they fail, then estimates.
/// assert_eq!(fitted.unwrap(), 116);
/// assert_eq!(last_report().unwrap().len(), 4); // 512, 256, 128, 116
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Guided {
    margin: f64,
    rationale: Option<String>,
}

impl Default for Guided {
    fn default() -> Self {
        Guided::new()
    }
}

/// The fastest growth with the batch size the proofs allow for: attention's `batch²` term.
/// A step whose memory grows faster than this can make a rung look proved to fail when it fits.
const GROWTH_EXPONENT_BOUND: f64 = 2.0;

/// The share of the bytes a failure had reached that a proof counts on: allocator rounding and
/// the variation between steps (noise, a neighbour on the device) must not turn a rung that fits
/// into one "proved" to fail.
const PROOF_TOLERANCE: f64 = 0.9;

impl Guided {
    /// The default margin, 5 % of the device.
    ///
    /// ```
    /// use batch_size_runtime::policy::Guided;
    /// assert_eq!(Guided::new().margin(), Guided::DEFAULT_MARGIN);
    /// ```
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
    ///     BatchSizeSearch::new(8).with_policy(Guided::new().with_margin(1.5)).run(Ok);
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

    /// The size the figures of `latest` point to, and how it was reached; `None` where they
    /// point nowhere (nothing free, figures that contradict the failure).
    fn estimate(&self, latest: &Failure, failures: &[Failure]) -> Option<(f64, String)> {
        let keep = 1.0 - self.margin;
        let size = latest.size as f64;
        let own = latest.own();
        // How fast the failing allocation grows: linear unless two failures of the same
        // allocation at different sizes show more (the exponent of `requested ∝ size^k`).
        let exponent = failures
            .iter()
            .rev()
            .find(|earlier| earlier.size != latest.size && earlier.site == latest.site)
            .map(|earlier| {
                (latest.requested as f64 / earlier.requested as f64).ln()
                    / (latest.size as f64 / earlier.size as f64).ln()
            })
            .filter(|k| k.is_finite() && (1.2..=3.0).contains(k))
            .unwrap_or(1.0);
        let growth = if exponent > 1.0 {
            format!("the failing allocation growing as size^{exponent:.1}")
        } else {
            "if only the failing allocation grows".to_owned()
        };
        // The failing allocation is taken as the part that grows and everything before it as
        // fixed. Where it is smaller than what the attempt held, the failure may have come
        // part-way through the step and the estimate may be too large: then it costs the one
        // attempt in hand, never a size below the ladder.
        let room = latest.capacity.saturating_sub(latest.used) as f64;
        let estimate = size * (room / latest.requested as f64).powf(1.0 / exponent) * keep;
        let part_way = if latest.requested < own {
            "; the failure may have come part-way through the step"
        } else {
            ""
        };
        Some((
            estimate,
            format!(
                "{} in use ({} of them the attempt's) + {} asked for at size {} on {}: about {} fit ({growth}, {:.0} % margin{part_way})",
                Bytes(latest.used),
                Bytes(own),
                Bytes(latest.requested),
                latest.size,
                Bytes(latest.capacity),
                estimate.floor(),
                self.margin * 100.0,
            ),
        ))
        .filter(|(estimate, _)| estimate.is_finite() && *estimate >= 1.0)
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
    /// In use before the attempt, where the memory backend said.
    used_at_start: Option<u64>,
}

impl Failure {
    /// What the attempt itself held when it failed (all that was in use where the backend did not
    /// say what was in use before: the bound stays a bound).
    fn own(&self) -> u64 {
        self.used.saturating_sub(self.used_at_start.unwrap_or(0))
    }

    /// The size from which every size is proved to fail by this failure: its attempt had reached
    /// `own + requested` bytes of its own, and at a size `b` below its own those bytes are at
    /// least `(b / size)²` of what they were (no allocation shrinks faster than the batch
    /// squared). `None` where it proves nothing.
    fn proved_to_fail_from(&self) -> Option<f64> {
        let room = self
            .capacity
            .saturating_sub(self.used_at_start.unwrap_or(0)) as f64;
        let reached = self.own().saturating_add(self.requested) as f64 * PROOF_TOLERANCE;
        if room <= 0.0 || reached <= room {
            return None;
        }
        let from = self.size as f64 * (room / reached).powf(1.0 / GROWTH_EXPONENT_BOUND);
        from.is_finite().then_some(from)
    }

    /// Whether `other`, at another size, shows the same figures: they do not move with the batch.
    fn repeats(&self, other: &Failure) -> bool {
        other.size != self.size
            && close(other.requested, self.requested)
            && close(other.used, self.used)
            && close(other.capacity, self.capacity)
    }
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
                used_at_start: evidence.used_at_start,
            };
            // Figures that cannot be true are no evidence.
            let plausible = failure.requested > 0
                && failure.capacity > 0
                && failure.used <= failure.capacity
                && failure
                    .used_at_start
                    .is_none_or(|start| start <= failure.capacity)
                && failure.size > 0;
            plausible.then_some(failure)
        })
        .collect()
}

fn close(a: u64, b: u64) -> bool {
    let (a, b) = (a as f64, b as f64);
    (a - b).abs() <= 0.01 * a.max(b)
}

/// Two failures at different sizes that failed on their first allocation (the attempt held
/// nothing of its own yet), asking for the same bytes, more than the device had free before the
/// attempt: that allocation does not depend on the batch size and does not fit at any.
fn fixed_part_does_not_fit(failures: &[Failure]) -> Option<(&Failure, &Failure)> {
    let first_allocation = |failure: &&Failure| {
        failure.used_at_start.is_some_and(|start| {
            failure.own().saturating_mul(100) <= failure.requested
                && failure.requested > failure.capacity.saturating_sub(start)
        })
    };
    let latest = failures.last().filter(first_allocation)?;
    let earlier = failures
        .iter()
        .rev()
        .skip(1)
        .filter(first_allocation)
        .find(|earlier| {
            earlier.size != latest.size && close(earlier.requested, latest.requested)
        })?;
    Some((earlier, latest))
}

/// Halving's sizes from `first`: `first, first/2, ..., 1`.
fn ladder(first: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(first), |&rung| Some(rung / 2)).take_while(|&rung| rung > 0)
}

impl SizePolicy for Guided {
    fn accepts_every_success(&self) -> bool {
        true
    }

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
        let first = history
            .attempts()
            .next()
            .map_or(size, |attempt| attempt.batch_size);
        // Every size at or above the smallest failure fails (the engine refuses them anyway).
        let failed_at = history.smallest_out_of_memory().unwrap_or(size).min(size);
        let failures = failures(history);

        if let Some((earlier, latest)) = fixed_part_does_not_fit(&failures) {
            self.rationale = None;
            return Decision::Stop(StopReason::FixedMemoryDoesNotFit {
                sizes: (earlier.size, latest.size),
                requested: latest.requested,
                free: latest
                    .capacity
                    .saturating_sub(latest.used_at_start.unwrap_or(0)),
                capacity: latest.capacity,
            });
        }

        // Sizes from `proved` up fail: at or above a failure, or proved by a failure's bytes.
        let proved = failures
            .iter()
            .filter_map(Failure::proved_to_fail_from)
            .fold(failed_at as f64, f64::min);
        // A proof that even the smallest rung fails rests on the growth bound alone: not enough
        // to give up on, so the ladder goes on as halving's would.
        let proved = if proved <= 1.0 {
            failed_at as f64
        } else {
            proved
        };
        let (mut proved_rungs, mut next_rung) = (0usize, None);
        for rung in ladder(first) {
            if rung as f64 >= proved {
                proved_rungs += 1;
            } else {
                next_rung = Some(rung);
                break;
            }
        }
        let Some(next_rung) = next_rung else {
            // Below the last rung: as halving, 0, which the engine refuses.
            self.rationale = Some("every size of halving's ladder failed".to_owned());
            return Decision::Try(size / 2);
        };
        // Halving makes an attempt at every proved rung and one more to end. Rungs keep this
        // search within one attempt of that; an estimate may be tried only while no more
        // attempts were made than rungs were proved, so that if it fails the next rung still
        // ends within one attempt of halving.
        let in_hand = history.len() <= proved_rungs;

        let latest = failures
            .last()
            .filter(|latest| latest.size == size)
            .filter(|latest| !failures.iter().any(|earlier| latest.repeats(earlier)));
        let estimate = latest
            .filter(|_| in_hand)
            .and_then(|latest| self.estimate(latest, &failures))
            .map(|(estimate, why)| (estimate.floor().min(usize::MAX as f64) as usize, why))
            // Above the next rung and below every size proved to fail.
            .filter(|&(estimate, _)| estimate > next_rung && (estimate as f64) < proved);
        if let Some((estimate, why)) = estimate {
            self.rationale = Some(why);
            return Decision::Try(estimate);
        }
        self.rationale = Some(if latest.is_none() {
            if failures.iter().any(|failure| failure.size == size) {
                "the figures repeat at every size and say nothing: halving's next size".to_owned()
            } else {
                "no figures: halving's next size".to_owned()
            }
        } else if !in_hand {
            format!("an estimate failed: halving's next size, {next_rung}")
        } else {
            format!(
                "the largest size of halving's ladder not proved to fail ({next_rung}); sizes from {} up are",
                proved.ceil()
            )
        });
        Decision::Try(next_rung)
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone()
    }
}
