//! The one model of a step's memory as the batch grows: what the measured steps (each size
//! that ran, with its own peak and its room) prove about the size that fills the room, with the
//! one set of margins every reader uses. Growth after a step, the cache's restart and the proofs
//! of the default policy ([`Guided`](super::Guided)) all read it here.
//!
//! The model: a step's own bytes at size `s` are `fixed + a·s + b·s²`, with each term zero or
//! more, the batch squared being the fastest growth allowed for (attention's scores). From the
//! steps measured, the size given is the smallest that any such step agreeing with them could
//! fit: one step, as if all of it grew as `s²`; two, with as much of their difference as the
//! `s²` term can hold; three or more, the curve through them. So a grown size never overshoots
//! a step of that family, whatever its fixed part, and each step measured brings it closer.

use super::StepFigures;
use crate::memory::MemorySnapshot;

/// The fastest growth with the batch size the model allows for: attention's `batch²` term.
/// A step whose memory grows faster than this can make a rung look proved to fail when it fits.
pub(crate) const GROWTH_EXPONENT_BOUND: f64 = 2.0;

/// The share of the bytes a failure had reached that a proof counts on: allocator rounding and
/// the variation between steps (noise, a neighbour on the device) must not turn a rung that fits
/// into one "proved" to fail.
pub(crate) const PROOF_TOLERANCE: f64 = 0.9;

/// The share of a size estimated from measured steps kept: a measured peak is the whole step,
/// not a bound, so less is kept back than from a failure; what remains covers allocator
/// rounding and steps that vary by a few percent. A grown size also stays this share below the
/// smallest size that failed.
pub(crate) const GROWN_KEEP: f64 = 0.97;

/// How far a probe grows where one measured step proves no gain (its peak near the room) and no
/// failure bounds the size: a bet that most of the peak is a fixed part, which the second
/// measured size then separates from the part that grows.
pub(crate) const PROBE_GROWTH: f64 = 1.25;

/// What a step measured: the attempt's own peak (the pool's peak less what the pool held in use
/// at the attempt's start, or the process where the backend counts no pool use) against its
/// room (free at the start, plus what the pool held there unallocated, which it reuses). `None`
/// without a peak, or where the device changed.
pub(crate) fn measured_step(
    batch_size: usize,
    at_start: Option<&MemorySnapshot>,
    at_end: Option<&MemorySnapshot>,
) -> Option<StepFigures> {
    let start = at_start?.devices.first()?;
    let end = at_end?.devices.first()?;
    if start.total != end.total || start.total == 0 || batch_size == 0 {
        return None;
    }
    // The peak counts what its pool had in use at the start: CUDA's and the simulated device's
    // pool count what is allocated, the host's counts what the process holds (no pool in use).
    let used_in_pool = start
        .pool_used
        .or(start.pool_reserved)
        .unwrap_or_else(|| start.total.saturating_sub(start.free));
    let held_unallocated = start
        .pool_reserved
        .zip(start.pool_used)
        .map_or(0, |(reserved, used)| reserved.saturating_sub(used));
    let peak = end.peak?.saturating_sub(used_in_pool);
    let room = start.free.saturating_add(held_unallocated).min(start.total);
    (peak > 0 && room > 0).then_some(StepFigures::new(batch_size, peak, room))
}

/// The size the measured steps point to in `step`'s room, as the module's docs say, less the
/// share kept back; `None` where it is not above `step`'s size (or the peaks did not grow with
/// the size: then nothing can be said of how they grow). `exponent` is the fastest growth
/// allowed for: [`GROWTH_EXPONENT_BOUND`], or 1 where the figures show the step grows no faster
/// than a line ([`growth_shown`]).
pub(crate) fn grown_size(
    step: &StepFigures,
    earlier: &[StepFigures],
    exponent: f64,
) -> Option<usize> {
    let room = step.room as f64;
    // Each size once, with its largest peak: steps of the same size vary by a few percent.
    let mut points: Vec<(f64, f64)> = Vec::with_capacity(earlier.len() + 1);
    for figures in earlier.iter().chain(std::iter::once(step)) {
        let (size, peak) = (figures.batch_size as f64, figures.peak as f64);
        match points.iter_mut().find(|(known, _)| *known == size) {
            Some(point) => point.1 = point.1.max(peak),
            None => points.push((size, peak)),
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let quadratic = exponent > 1.0;
    let fit = match points.as_slice() {
        [] => return None,
        [(size, peak)] => size * (room / peak).powf(1.0 / exponent),
        [one, two] => through_two(*one, *two, room, quadratic)?,
        [first, .., middle, last] => through_three(*first, *middle, *last, room, quadratic)?,
    };
    let fit = (fit * GROWN_KEEP).floor();
    (fit.is_finite() && fit > step.batch_size as f64).then(|| fit.min(usize::MAX as f64) as usize)
}

/// Two measured steps: the line through them where growth is linear; else the step with the
/// largest `s²` term that agrees with both (no linear part), which fills the room first. Where
/// even that bends less than the peaks do (a negative fixed part), the power law through them.
fn through_two(
    (x1, y1): (f64, f64),
    (x2, y2): (f64, f64),
    room: f64,
    quadratic: bool,
) -> Option<f64> {
    let slope = (y2 - y1) / (x2 - x1);
    if slope <= 0.0 {
        return None;
    }
    let power = || {
        let exponent = (y2 / y1).ln() / (x2 / x1).ln();
        x2 * (room / y2).powf(1.0 / exponent.max(1.0))
    };
    if !quadratic {
        let fixed = y2 - slope * x2;
        return Some(if fixed >= 0.0 {
            (room - fixed) / slope
        } else {
            power()
        });
    }
    let square = slope / (x1 + x2);
    let fixed = y1 - square * x1 * x1;
    Some(if fixed >= 0.0 {
        ((room - fixed) / square).max(0.0).sqrt()
    } else {
        power()
    })
}

/// Three measured steps or more: the smallest and the two largest give the step's curve
/// (`fixed + a·s + b·s²`); where it does not bend up (rounding, noise), the line through the two
/// largest.
fn through_three(
    (x0, y0): (f64, f64),
    (x1, y1): (f64, f64),
    (x2, y2): (f64, f64),
    room: f64,
    quadratic: bool,
) -> Option<f64> {
    let (d01, d12) = ((y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1));
    let square = (d12 - d01) / (x2 - x0);
    if !quadratic || square <= 0.0 {
        return through_two((x1, y1), (x2, y2), room, false);
    }
    let linear = d12 - square * (x1 + x2);
    let fixed = y2 - linear * x2 - square * x2 * x2;
    let discriminant = linear * linear - 4.0 * square * (fixed - room);
    (discriminant >= 0.0).then(|| (-linear + discriminant.sqrt()) / (2.0 * square))
}

/// How fast a step measured at one size may grow (the exponent of the size): linear (1) unless
/// a failure above it had reached more than a line through the measured peak with a fixed
/// part of zero or more can reach there (`peak × failed / size`), which only a step that grows
/// faster does; then the batch squared (2), the fastest growth the policy allows for.
pub(crate) fn growth_shown(step: &StepFigures, failures: &[(usize, u64)]) -> f64 {
    let faster = failures.iter().any(|&(failed, reached)| {
        failed > step.batch_size
            && reached as f64 * PROOF_TOLERANCE
                > step.peak as f64 * failed as f64 / step.batch_size as f64
    });
    if faster {
        GROWTH_EXPONENT_BOUND
    } else {
        1.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn one_step_grows_as_the_batch_squared_and_two_bound_the_square_term() {
        // One step at 64 using a quarter of the room: twice the size at most (as size²), less
        // the 3 % kept back.
        let one = StepFigures::new(64, 4 * GIB, 16 * GIB);
        assert_eq!(grown_size(&one, &[], GROWTH_EXPONENT_BOUND), Some(124));
        // As a line with no fixed part: four times, less 3 %.
        assert_eq!(grown_size(&one, &[], 1.0), Some(248));
        // Two steps, 2 GiB fixed and 32 MiB a sample: the line meets 16 GiB at 448; a step with
        // no linear part through both (2.67 GiB + s²/3 MiB... ) fills it first.
        let earlier = StepFigures::new(32, 3 * GIB, 16 * GIB);
        let step = StepFigures::new(64, 4 * GIB, 16 * GIB);
        assert_eq!(grown_size(&step, &[earlier], 1.0), Some(434));
        let bounded = grown_size(&step, &[earlier], GROWTH_EXPONENT_BOUND).unwrap();
        assert!((150..=200).contains(&bounded), "{bounded}");
        // A third step on the line: the curve through the three is the line.
        let third = StepFigures::new(bounded, 2 * GIB + bounded as u64 * 32 * MIB, 16 * GIB);
        assert_eq!(
            grown_size(&third, &[earlier, step], GROWTH_EXPONENT_BOUND),
            Some(434)
        );
        // A peak that did not grow with the size says nothing.
        let flat = StepFigures::new(64, 3 * GIB, 16 * GIB);
        assert_eq!(grown_size(&flat, &[earlier], GROWTH_EXPONENT_BOUND), None);
    }

    /// Whatever the step's terms (each zero or more, the square at most), the size given is
    /// never above the one that fits: the model's promise, on a grid of shapes and sizes.
    #[test]
    fn never_above_the_fit_for_any_step_of_the_family() {
        let room = 16.0 * GIB as f64;
        for fixed in [0.0, 2.0, 8.0, 15.0] {
            for linear in [0.0, 1.0, 20.0, 120.0] {
                for square in [0.0, 0.01, 0.3] {
                    if linear == 0.0 && square == 0.0 {
                        continue;
                    }
                    let bytes = |s: f64| {
                        (fixed * GIB as f64 + (linear * s + square * s * s) * MIB as f64) as u64
                    };
                    let fits = (1..100_000)
                        .take_while(|&s| bytes(s as f64) as f64 <= room)
                        .last();
                    let Some(fits) = fits else { continue };
                    for start in [fits / 4, fits / 2, fits * 9 / 10]
                        .into_iter()
                        .filter(|&s| s > 0)
                    {
                        let mut measured =
                            vec![StepFigures::new(start, bytes(start as f64), room as u64)];
                        for _ in 0..3 {
                            let (last, earlier) = measured.split_last().unwrap();
                            let Some(next) = grown_size(last, earlier, GROWTH_EXPONENT_BOUND)
                            else {
                                break;
                            };
                            assert!(
                                next <= fits,
                                "{fixed} GiB + {linear} MiB·s + {square} MiB·s²: {next} > {fits} from {start}"
                            );
                            measured.push(StepFigures::new(next, bytes(next as f64), room as u64));
                        }
                    }
                }
            }
        }
    }
}
