//! The one model of a step's memory as the batch grows: each attempt's figures in one frame
//! ([`figures_of`]), what the measured steps (each size that ran, with its own peak and its
//! room) prove about the size that fills the room, and what the failures prove about the sizes
//! above and below them, with the one set of margins every reader uses. The default policy
//! ([`Guided`](super::Guided)), growth after a step, the cache's restart and the remedies' gap
//! read it here.
//!
//! The frame: what was held at an attempt's start is what it could not use (other processes,
//! the context, what a pool had allocated); its room is the rest (free plus a pool's
//! unallocated reserve, which it reuses); its peak is the most it held above that.
//!
//! Measured steps: a step's own bytes at size `s` are `fixed + a·s + b·s²`, with each term zero
//! or more, the batch squared being the fastest growth allowed for (attention's scores). From
//! the steps measured, the size given is the smallest that any such step agreeing with them
//! could fit: one step, as if all of it grew as `s²`; two, with as much of their difference as
//! the `s²` term can hold; three or more, the curve through them. So a grown size never
//! overshoots a step of that family, whatever its fixed part, and each step measured brings it
//! closer.
//!
//! Failures: one bounds the need from below only (it may have come part-way through the step):
//! the sizes from which it proves failure assume every byte it reached shrinks as fast as the
//! batch squared ([`Failure::proved_to_fail_from`]); two at different sizes give a line where
//! every other failure lies on it and it is no steeper than the failing allocations grow
//! ([`line_through_failures`]); two that failed on the same first allocation, larger than the
//! room, prove a part that does not fit at any size ([`fixed_part_does_not_fit`]).

use super::StepFigures;
use crate::memory::{DeviceMemory, MemorySnapshot};
use crate::record::{Attempt, Figures, Outcome, SearchReport};

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

/// An attempt's [`Figures`] in the model's one frame, from what its error stated and the
/// backend's readings at its start, its end and after the release. The peak counts what its
/// pool had in use at the start (CUDA's and the simulated device's pool count what is allocated,
/// the host's what the process holds); no peak where the device changed during the attempt.
pub(crate) fn figures_of(
    stated: Figures,
    at_start: Option<&MemorySnapshot>,
    at_end: Option<&MemorySnapshot>,
    after_release: Option<&MemorySnapshot>,
) -> Figures {
    let start = at_start.and_then(|snapshot| snapshot.devices.first());
    let end = at_end.and_then(|snapshot| snapshot.devices.first());
    let unallocated = |device: &DeviceMemory| {
        device
            .pool_reserved
            .zip(device.pool_used)
            .map_or(0, |(reserved, used)| reserved.saturating_sub(used))
    };
    let room = |device: &DeviceMemory| {
        device
            .free
            .saturating_add(unallocated(device))
            .min(device.total)
    };
    let held = |device: &DeviceMemory| device.total.saturating_sub(room(device));
    let peak = start.zip(end).and_then(|(start, end)| {
        let used_in_pool = start
            .pool_used
            .or(start.pool_reserved)
            .unwrap_or_else(|| start.total.saturating_sub(start.free));
        (start.total == end.total).then_some(end.peak?.saturating_sub(used_in_pool))
    });
    let after = after_release.and_then(|snapshot| snapshot.devices.first());
    Figures {
        total: stated.total.or(end.or(start).map(|device| device.total)),
        held_at_start: start.map(held),
        peak,
        room: start.map(room),
        held_after_release: after.map(held),
        ..stated
    }
}

/// What a step measured, as the model grows from it: its own peak against its room; `None`
/// without either.
pub(crate) fn measured(batch_size: usize, figures: &Figures) -> Option<StepFigures> {
    let (peak, room) = (figures.peak?, figures.room?);
    (peak > 0 && room > 0 && batch_size > 0).then_some(StepFigures::new(batch_size, peak, room))
}

/// [`measured`] from the readings at a step's start and end, for the step call.
pub(crate) fn measured_step(
    batch_size: usize,
    at_start: Option<&MemorySnapshot>,
    at_end: Option<&MemorySnapshot>,
) -> Option<StepFigures> {
    measured(
        batch_size,
        &figures_of(Figures::default(), at_start, at_end, None),
    )
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

/// Where the sound bound of the measured steps gives too little and a size above failed (an
/// overshoot): the size where the line through the step and the bytes the nearest failure above
/// it had reached (a lower bound of its need there) meets the room, less the kept share. Not a
/// proof (the failure may have come part-way through the step), so it is used only below a
/// failure, where a wrong guess costs one out-of-memory and bounds the next.
pub(crate) fn toward_failure(step: &StepFigures, reached: &[(usize, u64)]) -> Option<usize> {
    let &(failed, bytes) = reached
        .iter()
        .filter(|&&(size, _)| size > step.batch_size)
        .min_by_key(|&&(size, _)| size)?;
    let slope = (bytes as f64 - step.peak as f64) / (failed - step.batch_size) as f64;
    if slope <= 0.0 || step.peak >= step.room {
        return None;
    }
    let fit = step.batch_size as f64 + (step.room - step.peak) as f64 / slope;
    let size = (fit * GROWN_KEEP).floor();
    (size.is_finite() && size > step.batch_size as f64)
        .then(|| size.min(usize::MAX as f64) as usize)
}

// The failures: what each proves about the sizes above and below it.

/// The line through `latest` and a larger failure on the same device (each failure's bytes
/// reached, against the size to `exponent`), where every other failure lies on it, its slope
/// is no steeper than the failing allocations' own growth, and it meets the `room` below
/// `latest`'s size: the size it fits at, the failure it was drawn to, and its fixed part.
pub(crate) fn line_through_failures<'f>(
    latest: &Failure,
    failures: &'f [Failure],
    exponent: f64,
    room: u64,
) -> Option<(f64, &'f Failure, f64)> {
    let size = latest.size as f64;
    let reached = latest.reached() as f64;
    failures
        .iter()
        .rev()
        .filter(|earlier| earlier.size > latest.size && earlier.total == latest.total)
        .find_map(|earlier| {
            let earlier_reached = earlier.reached() as f64;
            let (x0, x1) = (size.powf(exponent), (earlier.size as f64).powf(exponent));
            let slope = (earlier_reached - reached) / (x1 - x0);
            let fixed = reached - slope * x0;
            let fit = ((room as f64 - fixed) / slope).powf(1.0 / exponent);
            // A line steeper than the failing allocation's own growth says that the failures
            // came at different points of the step (where the room ran out each time), not
            // that the rest is fixed: nothing to read from it.
            let per_unit = (latest.requested as f64 / x0).max(earlier.requested as f64 / x1);
            // Every other failure must lie on it too: a failure off the line came at another
            // point of the step, and the line between these two is a coincidence.
            let on_line = failures.iter().all(|other| {
                other.total != latest.total || {
                    let predicted = fixed + slope * (other.size as f64).powf(exponent);
                    (predicted - other.reached() as f64).abs() <= 0.01 * other.reached() as f64
                }
            });
            (slope > 0.0
                && on_line
                && (slope <= 1.5 * per_unit
                    // A failing allocation of the same bytes at both sizes does not grow:
                    // the growth is elsewhere, and its own says nothing of the line.
                    || close(latest.requested, earlier.requested))
                && fixed < room as f64
                && fit.is_finite()
                && fit < size)
                .then_some((fit, earlier, fixed))
        })
}

/// How fast the failing allocation grows with the size: linear unless two failures of the
/// same allocation at different sizes show more (the exponent of `requested ∝ size^k`).
pub(crate) fn exponent(latest: &Failure, failures: &[Failure]) -> f64 {
    failures
        .iter()
        .rev()
        .find(|earlier| earlier.size != latest.size && earlier.site == latest.site)
        .map(|earlier| {
            (latest.requested as f64 / earlier.requested as f64).ln()
                / (latest.size as f64 / earlier.size as f64).ln()
        })
        .filter(|k| k.is_finite() && (1.2..=3.0).contains(k))
        .unwrap_or(1.0)
}

/// One failure with every figure the estimate needs.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// Which allocation failed, as far as the text tells.
    pub(crate) site: String,
    pub(crate) size: usize,
    pub(crate) requested: u64,
    /// Free when the allocation failed.
    pub(crate) free: u64,
    /// The device's total, where the text or the backend said.
    pub(crate) total: Option<u64>,
    /// In use before the attempt, where the memory backend said.
    pub(crate) used_at_start: Option<u64>,
    /// In use once the release after the attempt ran, where the backend said: less than at the
    /// start where the release gave back what a pool kept from earlier work.
    pub(crate) used_after_release: Option<u64>,
    /// The most the attempt held above what was held at its start, where the backend keeps a peak.
    pub(crate) peak: Option<u64>,
}

impl Failure {
    /// In use when the allocation failed.
    pub(crate) fn used(&self) -> Option<u64> {
        Some(self.total?.saturating_sub(self.free))
    }

    /// What the attempt itself held when it failed (all that was in use where the backend did not
    /// say what was in use before: the bound stays a bound).
    pub(crate) fn own(&self) -> u64 {
        self.used()
            .unwrap_or(0)
            .saturating_sub(self.used_at_start.unwrap_or(0))
    }

    /// What the attempt needed at least: its own bytes plus the allocation that failed, or its
    /// peak where it freed memory before failing and the peak was higher.
    pub(crate) fn reached(&self) -> u64 {
        self.own()
            .saturating_add(self.requested)
            .max(self.peak.unwrap_or(0))
    }

    /// The bytes the next attempt can use: the total less what was in use before this one, or
    /// less what is in use after the release where that is less (a pool's leftovers from
    /// earlier work given back: ONNX Runtime's arena keeps the regions an earlier run grew, and
    /// counts them as taken until its release). Never more room than the release left, so a
    /// size proved to fail in it fails in the next attempt too.
    pub(crate) fn room(&self) -> Option<u64> {
        let used = self.used_at_start.map_or(0, |start| {
            self.used_after_release
                .map_or(start, |after| start.min(after))
        });
        Some(self.total?.saturating_sub(used))
    }

    /// The size from which every size is proved to fail by this failure: its attempt had reached
    /// `reached` bytes of its own, and at a size `b` below its own those bytes are at least
    /// `(b / size)²` of what they were (no allocation shrinks faster than the batch squared).
    /// `None` where it proves nothing (no total to compare with).
    pub(crate) fn proved_to_fail_from(&self) -> Option<f64> {
        let room = self.room()? as f64;
        let reached = self.reached() as f64 * PROOF_TOLERANCE;
        if room <= 0.0 || reached <= room {
            return None;
        }
        let from = self.size as f64 * (room / reached).powf(1.0 / GROWTH_EXPONENT_BOUND);
        from.is_finite().then_some(from)
    }

    /// Whether `other`, at another size, shows the same figures: they do not move with the batch.
    pub(crate) fn repeats(&self, other: &Failure) -> bool {
        other.size != self.size
            && close(other.requested, self.requested)
            && close(other.free, self.free)
            && other.total.zip(self.total).is_none_or(|(a, b)| close(a, b))
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

pub(crate) fn failures(history: &SearchReport) -> Vec<Failure> {
    history
        .attempts()
        .filter(|attempt| attempt.outcome.is_out_of_memory())
        .filter_map(|attempt| {
            let figures = &attempt.figures;
            // In use at the failure against the total, or, with no total, the error's free bytes.
            let (free, total) = match (figures.used_at_failure(), figures.total) {
                (Some(used), Some(total)) if used <= total => (total - used, Some(total)),
                (Some(_), Some(_)) => return None,
                _ => (figures.free_at_failure?, None),
            };
            let failure = Failure {
                site: site(attempt),
                size: attempt.batch_size,
                requested: figures.requested?,
                free,
                total,
                used_at_start: figures.held_at_start,
                used_after_release: figures.held_after_release,
                peak: figures.peak,
            };
            // Figures that cannot be true are no evidence.
            let plausible = failure.requested > 0
                && failure.total.is_none_or(|total| {
                    total > 0 && failure.used_at_start.is_none_or(|start| start <= total)
                })
                && failure.size > 0;
            plausible.then_some(failure)
        })
        .collect()
}

pub(crate) fn close(a: u64, b: u64) -> bool {
    let (a, b) = (a as f64, b as f64);
    (a - b).abs() <= 0.01 * a.max(b)
}

/// Two failures at different sizes that failed on their first allocation (the attempt held
/// nothing of its own yet), asking for the same bytes, more than the device had free before the
/// attempt: that allocation does not depend on the batch size and does not fit at any.
pub(crate) fn fixed_part_does_not_fit(failures: &[Failure]) -> Option<(&Failure, &Failure)> {
    let first_allocation = |failure: &&Failure| {
        failure
            .used_at_start
            .zip(failure.total)
            .is_some_and(|(start, total)| {
                failure.own().saturating_mul(100) <= failure.requested
                    && failure.requested > total.saturating_sub(start)
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

/// Each failure of `history` with a device total, and the bytes it had reached of its own.
pub(crate) fn reached_by_failures(history: &SearchReport) -> Vec<(usize, u64)> {
    failures(history)
        .iter()
        .filter(|failure| failure.total.is_some())
        .map(|failure| (failure.size, failure.reached()))
        .collect()
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

    fn snapshot(
        free: u64,
        pool_reserved: Option<u64>,
        pool_used: Option<u64>,
        peak: Option<u64>,
    ) -> MemorySnapshot {
        MemorySnapshot {
            devices: vec![DeviceMemory {
                device: "d".to_owned(),
                total: 80 * GIB,
                free,
                pool_reserved,
                pool_used,
                peak,
            }],
        }
    }

    #[test]
    fn a_step_is_measured_against_what_its_pool_had_in_use() {
        // CUDA: 6 GiB allocated and 2 GiB cached in the pool at the start, which it reuses.
        let start = snapshot(70 * GIB, Some(8 * GIB), Some(6 * GIB), Some(6 * GIB));
        let end = snapshot(50 * GIB, Some(30 * GIB), Some(6 * GIB), Some(30 * GIB));
        let step = measured_step(64, Some(&start), Some(&end)).unwrap();
        assert_eq!((step.peak, step.room), (24 * GIB, 72 * GIB));
        // The host: what the process holds, and its resident peak; no pool use counted.
        let start = snapshot(70 * GIB, Some(GIB), None, Some(GIB));
        let end = snapshot(66 * GIB, Some(GIB), None, Some(5 * GIB));
        let step = measured_step(64, Some(&start), Some(&end)).unwrap();
        assert_eq!((step.peak, step.room), (4 * GIB, 70 * GIB));
        // No peak, or another device: nothing measured.
        let no_peak = snapshot(66 * GIB, Some(GIB), None, None);
        assert!(measured_step(64, Some(&start), Some(&no_peak)).is_none());
        assert!(measured_step(64, None, Some(&end)).is_none());
    }
}
