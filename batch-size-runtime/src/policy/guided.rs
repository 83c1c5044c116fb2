//! The default policy: after an out-of-memory attempt, estimate from its figures how memory
//! grows with the batch size, without ever ending below the size halving would have found or
//! taking more than three attempts more than halving.

use super::model::{
    exponent, failures, fixed_part_does_not_fit, grown_size, line_through_failures, measured,
    reached_by_failures, toward_failure, Failure, GROWN_KEEP, GROWTH_EXPONENT_BOUND, PROBE_GROWTH,
};
use super::{Decision, GrowRule, SizePolicy, StepFigures};
use crate::error::StopReason;
use crate::memory::Bytes;
use crate::record::{Attempt, Outcome, SearchReport};

/// Chooses each next size from the evidence of the failures so far, never ending below the size
/// halving would have found nor taking more than three attempts more than halving (0.9 more on
/// the mean of the search benchmark's cases).
///
/// Halving from the first size `s₀` tries the rungs `s₀, s₀/2, s₀/4, ...` and ends at the
/// largest rung that fits. This policy keeps that ladder as its floor:
///
/// - **Never below halving.** After an out-of-memory attempt it never proposes a size below the
///   largest rung that the evidence has not proved to fail. A rung is proved to fail when it is at
///   or above a size that failed, or when the bytes a failure had reached (what the attempt held
///   plus what it asked for, or its peak) would still exceed the device at that rung even if every
///   one of them shrank as fast as the batch squared (attention's `batch²` term; a linear or a
///   fixed part shrinks slower). Whatever the step does after the failure, and wherever in the
///   step the failure came, the figures seen so far only bound the need from below, and that
///   bound is all it relies on.
/// - **At most three attempts more than halving.** An attempt at a rung costs nothing against
///   halving, which makes it too; a rung proved to fail is an attempt saved. Between the rungs it
///   tries an estimate of its own only while at most two attempts more were made than rungs were
///   proved, so that a failed estimate still leaves the ladder within three attempts of halving.
///   An estimate from one failure that came part-way through the step is little more than a
///   step down of a tenth (the bytes reached are about the room, wherever the failure came); it
///   is still tried, since the ladder's next rung is half.
/// - **The estimate reads the whole step.** From one failure: every byte the attempt had reached
///   (its own bytes at the failure plus the request, or its peak) grows with the size and what
///   was in use before it is fixed, `s × room / reached`; for a linear step that is never below
///   the largest size that fits, whatever its fixed part or wherever the failure came. From two
///   failures: the line through the bytes each reached, `fixed + k × size` (`size^e` where two
///   failures of one allocation show its exponent), met with the room; a line steeper than the
///   failing allocation grows, or one a third failure lies off, says the failures came at
///   different points of the step and is not used. After an estimate that failed only a line may
///   follow it: the same reading would miss the same way. Without the device's total (a text
///   with the bytes asked for and free only, as ONNX Runtime's): the failing allocation grows
///   and the rest is fixed, `s × free / requested`. An estimate at or below the next rung not
///   proved to fail is not tried: that rung is.
/// - **Stopping early only on proof.** It stops before the engine reaches `min` only when two
///   failures at different sizes failed on their first allocation (nothing of the attempt's own in
///   use, which needs the memory backend's readings), asking for the same bytes, more than the
///   device had free: that allocation does not depend on the batch size and does not fit at any.
///   A text that repeats the same figures at every size proves nothing: it follows the ladder.
///
/// - **After a step that ran.** Where the function reports its steps
///   ([`step_done`](crate::step_done)), the first step of an attempt is measured (its own peak
///   against its room) and the attempt grows to the size that fills the room: from one step, the
///   peak grown as the batch squared (never above the limit of a step that grows no faster); from
///   two, their line; 3 % kept back and 3 % below every failure; at most three times near the fit. A grown size
///   that fails sends the search back once, to the largest size whose first step ran (or, where
///   the failure came after the first step, to the size before growing).
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

/// Without figures, growth bisects between the size that ran and the smallest that failed
/// until the size that ran is this share of it: each bisection may cost a failure, and past it
/// the gain is less than the risk.
const BISECTED_NEAR: f64 = 0.9;

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

    /// The size the figures point to after the failure `latest` (the smallest so far), and how
    /// it was reached; `None` where they point nowhere (nothing free, figures that contradict
    /// the failure).
    ///
    /// Two failures at different sizes give a line: the bytes each attempt had reached against
    /// its size, as `fixed + k × size^e` (`e` from the failing allocations where two of the same
    /// one show it, else 1), and the size where that line meets the room. A line along which the
    /// bytes did not shrink with the size (each failure came part-way, where the room ran out,
    /// wherever that was in the step) says nothing, and neither does one that puts the fixed part
    /// above the room. One failure, or no line: every byte the attempt had reached grows with
    /// the size, none of it fixed, which for a linear step is never below the largest that fits
    /// (a fixed part or a failure part-way only lowers it); the next failure then gives the line.
    /// Without the device's total (a text that says only what was asked for and what was free):
    /// the failing allocation as the part that grows and the rest as fixed.
    fn estimate(
        &self,
        latest: &Failure,
        failures: &[Failure],
        whole: bool,
    ) -> Option<(f64, String)> {
        let keep = 1.0 - self.margin;
        let size = latest.size as f64;
        let exponent = exponent(latest, failures);
        let growth = if exponent > 1.0 {
            format!(", growing as size^{exponent:.1}")
        } else {
            String::new()
        };
        let estimate = |estimate: f64, how: String| {
            let estimate = estimate * keep;
            (estimate.is_finite() && estimate >= 1.0).then(|| {
                (
                    estimate,
                    format!(
                        "{how}: about {} fit{growth}, {:.0} % margin",
                        estimate.floor(),
                        self.margin * 100.0
                    ),
                )
            })
        };
        let Some(room) = latest.room() else {
            // The failing allocation alone grows, in what the text said was free.
            let fit = size * (latest.free as f64 / latest.requested as f64).powf(1.0 / exponent);
            return estimate(
                fit,
                format!(
                    "{} asked for at size {} with {} free, if only that allocation grows",
                    Bytes(latest.requested),
                    latest.size,
                    Bytes(latest.free)
                ),
            );
        };
        let line = line_through_failures(latest, failures, exponent, room);
        if let Some((fit, earlier, fixed)) = line {
            return estimate(
                fit,
                format!(
                    "the failures at {} and {} reached {} and {} of {} of room: {} fixed and the rest growing with the size",
                    earlier.size,
                    latest.size,
                    Bytes(earlier.reached()),
                    Bytes(latest.reached()),
                    Bytes(room),
                    Bytes(fixed.max(0.0) as u64),
                ),
            );
        }
        if !whole {
            return None;
        }
        let fit = size * (room as f64 / latest.reached() as f64).powf(1.0 / exponent);
        estimate(
            fit,
            format!(
                "the attempt at {} reached {} of its own ({} in use, {} asked for) with {} of room, if all of it grows with the size",
                latest.size,
                Bytes(latest.reached()),
                Bytes(latest.used().unwrap_or(0)),
                Bytes(latest.requested),
                Bytes(room),
            ),
        )
    }
}

/// Halving's sizes from `first`: `first, first/2, ..., 1`.
fn ladder(first: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(first), |&rung| Some(rung / 2)).take_while(|&rung| rung > 0)
}

/// The steps measured so far in this search: the attempts that grew.
fn grown_steps(history: &SearchReport) -> impl Iterator<Item = (&Attempt, StepFigures)> {
    history.attempts().filter_map(|attempt| {
        matches!(attempt.outcome, Outcome::Grew { .. })
            .then(|| measured(attempt.batch_size, &attempt.figures))
            .flatten()
            .map(|step| (attempt, step))
    })
}

impl SizePolicy for Guided {
    fn accepts_every_success(&self) -> bool {
        true
    }

    /// After a step, the size the model of the step's memory gives from the steps measured
    /// (`policy::model`), kept below every size that failed; where the first step measured
    /// proves no gain and no failure bounds the size, a probe a quarter larger (its step is the second measured
    /// size that separates a fixed part from growth). Not once a grown size ran out of memory
    /// after its first step ran: later steps need more than the first, so no first step's
    /// figures can be grown from. A grown size that failed within its first step is one more
    /// bound: growth goes on below it.
    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        let mut grew = false;
        for attempt in history.attempts() {
            grew |= matches!(attempt.outcome, Outcome::Grew { .. });
            if grew && attempt.outcome.is_out_of_memory() && attempt.first_step_done {
                return None;
            }
        }
        let earlier: Vec<StepFigures> = grown_steps(history).map(|(_, step)| step).collect();
        let failed = history.smallest_out_of_memory();
        let reached = reached_by_failures(history);
        // No closer to a size that failed than the margin kept from the estimate: a failure
        // just above a curved step's estimate says the curve bends there.
        let below_failures =
            failed.map_or(usize::MAX, |failed| (failed as f64 * GROWN_KEEP) as usize);
        Some(Box::new(move |batch_size, step| {
            let Some(step) = step else {
                // No figures (a framework that counts what it holds but not the device's
                // total): halfway to the smallest size that failed, a bisection that each
                // growth or failure narrows, until the size that ran is within 10 % of it.
                return failed
                    .filter(|&failed| (batch_size as f64) < failed as f64 * BISECTED_NEAR)
                    .map(|failed| batch_size + (failed - batch_size) / 2);
            };
            let grown = grown_size(step, &earlier, GROWTH_EXPONENT_BOUND);
            let least = step.batch_size + step.batch_size.div_ceil(33);
            let probe = || (step.batch_size as f64 * PROBE_GROWTH).ceil() as usize;
            match grown {
                Some(size) if size >= least => Some(size),
                // The first step measured in the search, with no size above it known to fail.
                _ if earlier.is_empty() && failed.is_none() && step.peak <= step.room => {
                    Some(probe())
                }
                // A grown size failed above: toward it, along the line the failure gives.
                _ => toward_failure(step, &reached).filter(|&size| size >= least),
            }
            .map(|size| size.min(below_failures))
        }))
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
        if let Outcome::Grew { to } = last.outcome {
            self.rationale = Some(format!(
                "the first step with batch size {} fit, and its peak says {to} fits",
                last.batch_size
            ));
            return Decision::Try(to);
        }
        if !matches!(last.outcome, Outcome::OutOfMemory { .. }) {
            return Decision::Accept;
        }
        if let Some(back) = self.back_from_a_grown_size(history, last) {
            return back;
        }
        self.after_a_failure(history, last.batch_size)
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone()
    }
}

impl Guided {
    /// A size the search grew to failed. Within its first step (the estimate overshot, or a
    /// bisection without figures went past the limit): back to the largest size whose first
    /// step ran, from which growth may go on below the new bound. After it (a later step needed
    /// more than the first: state created at the first optimizer step): back to the size the
    /// search had reached before growing, and no more growing. `None` for any other failure.
    fn back_from_a_grown_size(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
    ) -> Option<Decision> {
        let size = last.batch_size;
        // Only a size the search grew to; a failure after a later step ends growing (the
        // rule says so), so this comes once for those, and once a growth for the others.
        let grown_to = history
            .attempts()
            .any(|attempt| attempt.outcome == Outcome::Grew { to: size });
        if !grown_to {
            return None;
        }
        // Every size that grew had its first step run, with figures or without.
        let mut measured = history
            .attempts()
            .filter(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
            .map(|attempt| attempt.batch_size)
            .filter(|&before| before < size);
        let (back, which) = if last.first_step_done {
            measured
                .next()
                .map(|before| (before, "the size before growing"))?
        } else {
            // It failed within its first step: the largest step measured ran that step.
            measured
                .max()
                .map(|largest| (largest, "the largest size whose first step ran"))?
        };
        self.rationale = Some(format!(
            "batch size {size}, grown to from measured steps, ran out of memory: back to {back}, {which}"
        ));
        Some(Decision::Try(back))
    }

    /// After an out-of-memory at `size`: an estimate from the failures' figures where one is in
    /// hand, above halving's next rung and below every size proved to fail; else that rung.
    fn after_a_failure(&mut self, history: &SearchReport, size: usize) -> Decision {
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
                free: latest.room().unwrap_or(latest.free),
                total: latest.total.unwrap_or(0),
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
        let (proved_rungs, next_rung) = rungs_proved(first, proved);
        let Some(next_rung) = next_rung else {
            // Below the last rung: as halving, 0, which the engine refuses.
            self.rationale = Some("every size down to 1 ran out of memory".to_owned());
            return Decision::Try(size / 2);
        };
        // Halving makes an attempt at every proved rung and one more to end. Rungs keep this
        // search within its attempts; an estimate may be tried only while at most two attempts
        // more were made than rungs were proved, so that if it fails the next rung still ends
        // within three attempts of halving.
        let in_hand = history.len() <= proved_rungs + 2;

        let latest = failures
            .last()
            .filter(|latest| latest.size == size)
            .filter(|latest| !failures.iter().any(|earlier| latest.repeats(earlier)));
        let estimate = latest
            .filter(|_| in_hand)
            .and_then(|latest| {
                // An estimate that failed showed the step larger than all its bytes growing
                // would make it (the failure came part-way): the next estimate from those bytes
                // would miss the same way, so only a line may follow it, else the ladder.
                let after_a_failed_estimate =
                    history.len() > 1 && !ladder(first).any(|rung| rung == size);
                self.estimate(latest, &failures, !after_a_failed_estimate)
            })
            .map(|(estimate, why)| (estimate.floor().min(usize::MAX as f64) as usize, why))
            // Above the next rung and below every size proved to fail.
            .filter(|&(estimate, _)| estimate > next_rung && (estimate as f64) < proved);
        if let Some((estimate, why)) = estimate {
            self.rationale = Some(why);
            return Decision::Try(estimate);
        }
        self.rationale = Some(if latest.is_none() {
            if failures.iter().any(|failure| failure.size == size) {
                "the failures' memory figures are the same at every size and say nothing of \
                 it, so the size is halved"
                    .to_owned()
            } else {
                "the error gave no memory figures, so the size is halved".to_owned()
            }
        } else if !in_hand {
            format!(
                "a size estimated from the figures ran out of memory too, so the size is halved \
                 to {next_rung}"
            )
        } else {
            format!(
                "the figures show that every size from {} up is too large, and {next_rung} is \
                 the largest halving step below that",
                proved.ceil()
            )
        });
        Decision::Try(next_rung)
    }
}

/// How many rungs of halving's ladder from `first` are proved to fail (at or above `proved`),
/// and the next rung below them, where there is one.
fn rungs_proved(first: usize, proved: f64) -> (usize, Option<usize>) {
    let mut proved_rungs = 0;
    for rung in ladder(first) {
        if rung as f64 >= proved {
            proved_rungs += 1;
        } else {
            return (proved_rungs, Some(rung));
        }
    }
    (proved_rungs, None)
}
