//! Memory against the batch size, from what attempts measured: the tuner's trials and the
//! steps and chunks of the runners that learn as they run ([`converge`](super::converge)).
//!
//! An attempt's figures are what the allocator already counts: the bytes in use outside the
//! pool before it, and the pool's peak during it (CUDA's `USED_MEM_HIGH`, the simulated
//! device's peak). No synchronize is needed to read them.

use crate::memory::{DeviceMemory, MemorySnapshot};
use crate::record::{Attempt, SearchReport};

/// Bytes in use during a successful attempt (what was in use outside the pool before it, plus
/// the pool's peak), and the device's bytes.
pub(crate) fn peak_bytes(attempt: &Attempt) -> Option<(u64, u64)> {
    let start = only_device(attempt.memory_at_start.as_ref()?)?;
    let end = only_device(attempt.memory_at_end.as_ref()?)?;
    Some((outside_pool(start).saturating_add(end.peak?), end.total))
}

/// What a successful attempt's peak can hide of what it allocated: nothing where the backend
/// counts live bytes (a pool's allocations, the simulated device); where it counts only what
/// the process holds (the host's virtual or resident size, no live count), a step is served
/// from memory held already (freed heap, glibc's arenas) and the process's own threads reserve
/// and give back beside it, so growth under [`HELD_RESOLUTION`]'s share of what it holds is
/// not measured (a few MiB in a 600 MiB libtorch process, which a step of 16 samples
/// allocates).
pub(crate) fn peak_resolution(attempt: &Attempt) -> u64 {
    let Some(end) = attempt.memory_at_end.as_ref().and_then(only_device) else {
        return 0;
    };
    match (end.pool_used, end.pool_reserved) {
        (None, Some(held)) if end.peak.is_some() => held / HELD_RESOLUTION,
        _ => 0,
    }
}

/// The share of what a process holds under which its peak's growth is noise (see
/// [`peak_resolution`]): 1/64, about 10 MiB of a 600 MiB process, twice the spread measured
/// between libtorch's trials of 1 to 16 samples.
pub(crate) const HELD_RESOLUTION: u64 = 64;

/// How much an attempt's peak rose above the bytes in use (live or held) when it started:
/// the step's own growth, with one size alone.
pub(crate) fn growth_in_attempt(attempt: &Attempt) -> Option<u64> {
    let (peak, _) = peak_bytes(attempt)?;
    Some(peak.saturating_sub(held_at_start(attempt)?))
}

/// Bytes in use on the device when the attempt started, whatever holds them (live or held in
/// a pool or a process's heap): where the backend has no live count (the host's), the part
/// of the peak the attempt did not add.
pub(crate) fn held_at_start(attempt: &Attempt) -> Option<u64> {
    let start = only_device(attempt.memory_at_start.as_ref()?)?;
    Some(start.total.saturating_sub(start.free))
}

/// Bytes in use when the attempt started (outside the pool, plus what the pool held live),
/// where the pool says what it held live: the part of an attempt's memory that its size did
/// not allocate.
pub(crate) fn used_at_start(attempt: &Attempt) -> Option<u64> {
    in_use(only_device(attempt.memory_at_start.as_ref()?)?)
}

/// Bytes still in use when a successful attempt ended: what the next one starts with (the
/// weights, and state the attempt allocated and kept: gradients, an optimizer's moments).
pub(crate) fn used_at_end(attempt: &Attempt) -> Option<u64> {
    in_use(only_device(attempt.memory_at_end.as_ref()?)?)
}

/// The device an attempt's figures are about: the only one read. Where a backend reads several
/// (CUDA's, with a context active on more than one device in the process: ranks as threads),
/// nothing says which one the attempt ran on, and no figures are better than another's.
fn only_device(snapshot: &MemorySnapshot) -> Option<&DeviceMemory> {
    match snapshot.devices.as_slice() {
        [only] => Some(only),
        _ => None,
    }
}

/// Bytes in use outside the pool (other processes, the context, plain allocations).
fn outside_pool(reading: &DeviceMemory) -> u64 {
    reading
        .total
        .saturating_sub(reading.free)
        .saturating_sub(reading.pool_reserved.unwrap_or(0))
}

/// Bytes in use: outside the pool, plus what the pool holds live, where it says.
fn in_use(reading: &DeviceMemory) -> Option<u64> {
    Some(outside_pool(reading).saturating_add(reading.pool_used?))
}

/// What a failed attempt is known to have needed at least: what was in use when the
/// allocation failed plus what it asked for, where the error says both (the memory in use then
/// is not the attempt's peak: what a step frees before it fails, attention's scores say, was
/// counted in the peak); else the larger of the attempt's peak and what was in use before it
/// plus what the failing allocation asked for. A failure part-way through the step knows only
/// part of it: a lower bound.
pub(crate) fn needed_at_least(attempt: &Attempt) -> Option<u64> {
    let figures = &attempt.figures;
    if figures.free_at_failure.is_some() {
        if let Some(needed) = figures.needed_at_least() {
            return Some(needed);
        }
    }
    let (peak, _) = peak_bytes(attempt)?;
    let start = used_at_start(attempt).unwrap_or(0);
    Some(peak.max(start.saturating_add(figures.requested.unwrap_or(0))))
}

/// The sizes among `attempts` that ran at or below `largest`, with their peaks, where the
/// figures say them.
pub(crate) fn points_up_to<'a>(
    attempts: impl Iterator<Item = &'a Attempt>,
    largest: usize,
) -> Vec<Point> {
    attempts
        .filter(|attempt| attempt.outcome.is_success() && attempt.batch_size <= largest)
        .filter_map(|attempt| {
            let (peak, total) = peak_bytes(attempt)?;
            Some(Point {
                size: attempt.batch_size,
                peak,
                total,
            })
        })
        .collect()
}

/// The smallest size among `attempts` above `largest` that ran out of memory, with the bytes
/// it needed at least, where the figures say them.
pub(crate) fn failure_above<'a>(
    attempts: impl Iterator<Item = &'a Attempt>,
    largest: usize,
) -> Option<(usize, u64)> {
    attempts
        .filter(|attempt| attempt.outcome.is_out_of_memory() && attempt.batch_size > largest)
        .filter_map(|attempt| Some((attempt.batch_size, needed_at_least(attempt)?)))
        .min_by_key(|(size, _)| *size)
}

/// How much steeper a line must be than the memory between nearer sizes for the gentler slope
/// to be tried: a line `k` times too steep keeps about `0.95 / (0.95 + 0.05 k)` of what fits
/// with a 5 % margin (0.945 at 1.1), and a gentler slope that is wrong costs a failure, never a
/// size above one.
pub(crate) const GENTLER: f64 = 1.1;

/// One size that ran, with the bytes in use at its peak and the device's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Point {
    pub(crate) size: usize,
    pub(crate) peak: u64,
    pub(crate) total: u64,
}

/// Memory against the batch size: the line through two successful attempts, bent upwards
/// just enough to reach what the smallest failure above them needed (attention's size² shows
/// there, not in two small sizes). It predicts the size that fills the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MemoryFit {
    /// The largest successful size and its peak, in bytes.
    size: f64,
    peak: f64,
    /// Bytes a sample, between the two successes.
    per_sample: f64,
    /// The bend: bytes times (s - lower)(s - size), zero for a straight line.
    curvature: f64,
    /// The smaller success the line runs through.
    lower: f64,
    /// The device's bytes.
    total: f64,
}

impl MemoryFit {
    /// The fit to `history`'s attempts at or below `largest`, the largest success (see
    /// [`from_points`](Self::from_points)); the smallest failure above `largest` bends it.
    pub(crate) fn new(history: &SearchReport, largest: usize) -> Option<Self> {
        let attempts = || history.attempts();
        Self::from_points(
            &points_up_to(attempts(), largest),
            failure_above(attempts(), largest),
        )
    }

    /// As [`from_points`](Self::from_points), bent upwards as far as the points themselves
    /// demand where three sizes show the peak growing faster than a line (a `size²` term seen
    /// before any failure): the quadratic through the line's two points and the largest point
    /// below them (at least an eighth of the line's span below), where it bends more than the
    /// failure does. Extrapolating the secant of a
    /// curve that bends up predicts more room than there is; this never does on a quadratic.
    ///
    /// Where a size between the line's two shows a peak above the line (the slope from it to
    /// the largest is under the line's by more than [`GENTLER`]), a part appeared between the line's smaller
    /// size and it (a workspace chosen above some size, a buffer that does not grow with the
    /// batch): the line is drawn from that size instead, on the same side of the jump. A line
    /// across a jump is steeper than the memory above it and predicts far less room than there
    /// is, and no failure would ever show it.
    pub(crate) fn bent_by_points(points: &[Point], failure: Option<(usize, u64)>) -> Option<Self> {
        let fit = Self::from_points(points, failure)?;
        if let Some(above_the_jump) = fit.past_a_jump(points, failure) {
            return Some(above_the_jump);
        }
        if let Some(toward_the_failure) = fit.toward_the_failure(failure) {
            return Some(toward_the_failure.bent_by_a_point_below(points));
        }
        Some(fit.bent_by_a_point_below(points))
    }

    /// The line through the sizes above `edge` only, where a jump was detected between `edge`
    /// and the sizes above it (the sizes up to `edge` grow [`GENTLER`] times more gently than
    /// a line across, and a size chosen by their slope ran): from the size above `edge` whose
    /// slope to the largest is the least (the one most surely past the jump) to the largest,
    /// bent by `failure` and, where it lies above the line (a `size²` term, not a jump), by the
    /// largest size below. A line across the jump counts the part that appeared as growth and
    /// keeps a size that the sizes past the jump show to be too small, however close they are.
    /// `None` without two sizes above `edge` whose peak grows.
    pub(crate) fn past_an_edge(
        points: &[Point],
        edge: f64,
        failure: Option<(usize, u64)>,
    ) -> Option<Self> {
        let mut above: Vec<Point> = points
            .iter()
            .filter(|point| point.size as f64 > edge)
            .copied()
            .collect();
        // Peaks of the same size: the highest (noise counts against the fit).
        above.sort_by(|a, b| a.size.cmp(&b.size).then(b.peak.cmp(&a.peak)));
        above.dedup_by_key(|point| point.size);
        let (top, nearer) = above.split_last()?;
        let slope = |point: &Point| {
            (top.peak as f64 - point.peak as f64) / (top.size as f64 - point.size as f64)
        };
        let lower = nearer.iter().min_by(|a, b| slope(a).total_cmp(&slope(b)))?;
        let fit = Self::line(
            (lower.size as f64, lower.peak as f64),
            (top.size as f64, top.peak as f64),
            top.total as f64,
            failure,
        )?;
        Some(fit.bent_by_a_point_below(points))
    }

    /// This fit bent upwards by the largest of `points` below its smaller size, where that
    /// point lies above the line (three sizes showing a `size²` term) by more than any failure
    /// bends it.
    fn bent_by_a_point_below(mut self, points: &[Point]) -> Self {
        // Only where the three are spread alike: the peak of a size far smaller than the span
        // above it is mostly an allocator's rounding (2 MiB blocks at size 1), not a bend.
        let below = points
            .iter()
            .filter(|point| (point.size as f64) < self.lower)
            .max_by_key(|point| point.size)
            .filter(|point| (self.lower - point.size as f64) * 8.0 >= self.size - self.lower);
        if let Some(below) = below {
            // Peaks of the same size: the highest (as from_points dedups).
            let peak = points
                .iter()
                .filter(|point| point.size == below.size)
                .map(|point| point.peak)
                .max()
                .unwrap_or(below.peak) as f64;
            let size = below.size as f64;
            let span = (size - self.lower) * (size - self.size);
            let bend = (peak - self.bytes(size)) / span;
            if bend.is_finite() && bend > self.curvature {
                self.curvature = bend;
            }
        }
        self
    }

    /// The line through the largest point and the largest at most half of it (the slope over a
    /// wide span is not lost in an allocator's rounding), or the next largest where there is
    /// none; the highest peak where a size ran more than once (noise counts against the fit).
    /// `failure`, a size above every point with the bytes it needed at least, bends the line
    /// up to reach it (a part-way failure shows less than it needed and bends it less: the fit
    /// still predicts a size below that failure). `None` without two sizes whose peak grows.
    pub(crate) fn from_points(points: &[Point], failure: Option<(usize, u64)>) -> Option<Self> {
        let mut peaks = points.to_vec();
        peaks.sort_by(|a, b| a.size.cmp(&b.size).then(b.peak.cmp(&a.peak)));
        peaks.dedup_by_key(|point| point.size);
        let top = *peaks.last()?;
        let lower = peaks
            .iter()
            .rev()
            .find(|smaller| smaller.size.saturating_mul(2) <= top.size)
            .or_else(|| peaks.iter().rev().nth(1))?;
        Self::line(
            (lower.size as f64, lower.peak as f64),
            (top.size as f64, top.peak as f64),
            top.total as f64,
            failure,
        )
    }

    /// The line from the size between this line's two whose slope to the largest is the
    /// least, where this line is [`GENTLER`] times steeper or more and the size is at least a sixteenth
    /// below the largest (closer, an allocator's rounding and noise decide the slope).
    fn past_a_jump(&self, points: &[Point], failure: Option<(usize, u64)>) -> Option<Self> {
        let slope =
            |point: &Point| (self.peak - point.peak as f64) / (self.size - point.size as f64);
        let nearer = points
            .iter()
            .filter(|point| {
                let size = point.size as f64;
                size > self.lower && size * 16.0 <= self.size * 15.0
            })
            .min_by(|a, b| slope(a).total_cmp(&slope(b)))?;
        if slope(nearer) * GENTLER >= self.per_sample {
            return None;
        }
        Self::line(
            (nearer.size as f64, nearer.peak as f64),
            (self.size, self.peak),
            self.total,
            failure,
        )
    }

    /// The line from the largest size to what the smallest failure above it needed, where that
    /// slope is [`GENTLER`] times gentler than this line's or more: a part appeared between
    /// this line's two sizes (a workspace chosen by size), and only the largest size and the
    /// failure are on the aim's side of it. Bent upwards by a curve (a `size²` term), the slope
    /// to the failure is steeper than the line's, never gentler.
    fn toward_the_failure(&self, failure: Option<(usize, u64)>) -> Option<Self> {
        let (failed, needed) = failure?;
        let failed = failed as f64;
        let slope = (needed as f64 - self.peak) / (failed - self.size);
        if !(failed > self.size && slope > 0.0 && slope * GENTLER < self.per_sample) {
            return None;
        }
        self.with_slope(slope, failure)
    }

    /// The bytes a sample, as this fit counts them between its two sizes.
    pub(crate) fn per_sample(&self) -> f64 {
        self.per_sample
    }

    /// The smaller size the fit's line runs through.
    pub(crate) fn smaller(&self) -> f64 {
        self.lower
    }

    /// This fit's largest point with another slope: what the memory would be above it if the
    /// bytes a sample were `per_sample` (bent, as ever, by `failure`).
    pub(crate) fn with_slope(
        &self,
        per_sample: f64,
        failure: Option<(usize, u64)>,
    ) -> Option<Self> {
        Self::line(
            (self.size - 1.0, self.peak - per_sample),
            (self.size, self.peak),
            self.total,
            failure,
        )
    }

    /// The line through the bytes in use before the attempt (at size 0) and its peak: all that
    /// the attempt allocated is counted as growing with its size. Where part of it does not
    /// (gradients and optimizer state allocated at the first step), the line is steeper than
    /// the truth and predicts less than fits: a safe first guess, which the next size corrects.
    /// `failure`, a size above the point with the bytes it needed, bends it as in
    /// [`from_points`](Self::from_points).
    pub(crate) fn through_start(
        point: Point,
        used_at_start: u64,
        failure: Option<(usize, u64)>,
    ) -> Option<Self> {
        if point.size == 0 || used_at_start >= point.peak {
            return None;
        }
        Self::line(
            (0.0, used_at_start as f64),
            (point.size as f64, point.peak as f64),
            point.total as f64,
            failure,
        )
    }

    fn line(
        (lower_size, lower_peak): (f64, f64),
        (size, peak): (f64, f64),
        total: f64,
        failure: Option<(usize, u64)>,
    ) -> Option<Self> {
        let per_sample = (peak - lower_peak) / (size - lower_size);
        if !(per_sample.is_finite() && per_sample > 0.0 && size > lower_size) {
            return None;
        }
        let mut fit = MemoryFit {
            size,
            peak,
            per_sample,
            curvature: 0.0,
            lower: lower_size,
            total,
        };
        if let Some((failed, needed)) = failure.filter(|&(failed, _)| failed as f64 > size) {
            let failed = failed as f64;
            let span = (failed - lower_size) * (failed - size);
            let bend = (needed as f64 - fit.bytes(failed)) / span;
            if bend.is_finite() && bend > 0.0 {
                fit.curvature = bend;
            }
        }
        Some(fit)
    }

    /// The bytes the fit predicts at `size`.
    pub(crate) fn bytes(&self, size: f64) -> f64 {
        let above = size - self.size;
        self.peak + self.per_sample * above + self.curvature * (size - self.lower) * above
    }

    /// The largest size whose predicted bytes fit the device.
    pub(crate) fn limit(&self) -> Option<usize> {
        self.limit_within(self.total)
    }

    /// The largest size whose predicted bytes fit in `bytes`.
    pub(crate) fn limit_within(&self, bytes: f64) -> Option<usize> {
        let limit = self.size_filling(bytes)?.floor();
        (limit >= 1.0).then(|| limit.min(usize::MAX as f64) as usize)
    }

    /// The size, in fractions of a sample, whose predicted bytes fill the device: what a
    /// share of it is taken from (flooring first would lose up to a sample twice).
    pub(crate) fn size_filling_device(&self) -> Option<f64> {
        self.size_filling(self.total)
    }

    /// The size, in fractions of a sample, whose predicted bytes are `bytes`.
    fn size_filling(&self, bytes: f64) -> Option<f64> {
        let room = bytes - self.peak;
        let size = if room <= 0.0 {
            // The largest point is over (its state grew since it ran): back along the line.
            self.size + room / self.per_sample
        } else {
            // c·u² + b·u = room, with u the samples above the largest success; written so
            // that a straight line (c = 0) divides without cancelling.
            let slope = self.per_sample + self.curvature * (self.size - self.lower);
            self.size + 2.0 * room / (slope + (slope * slope + 4.0 * self.curvature * room).sqrt())
        };
        size.is_finite().then_some(size)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn point(size: usize, peak: u64) -> Point {
        Point {
            size,
            peak,
            total: 10_000,
        }
    }

    #[test]
    fn a_straight_line_predicts_the_size_that_fills_the_device() {
        // 1000 bytes fixed, 30 a sample: 300 samples fill 10 000 bytes.
        let fit = MemoryFit::from_points(&[point(64, 2920), point(128, 4840)], None).unwrap();
        assert_eq!(fit.limit(), Some(300));
        assert_eq!(fit.bytes(200.0), 7000.0);
        assert_eq!(fit.limit_within(7000.0), Some(200));
    }

    #[test]
    fn the_highest_peak_of_a_size_counts_and_the_wide_span_is_preferred() {
        let noisy = [
            point(64, 2920),
            point(128, 4840),
            point(128, 4900),
            point(120, 4600),
        ];
        let fit = MemoryFit::from_points(&noisy, None).unwrap();
        // Through (64, 2920) and (128, 4900): never more than the noisiest reading allows.
        assert!(fit.limit().unwrap() < 300);
        assert_eq!(fit.bytes(128.0), 4900.0);
    }

    #[test]
    fn a_failure_above_bends_the_line_below_it() {
        // Linear from 64 and 128 says 300 fit; 250 failed needing 10 500 bytes.
        let fit = MemoryFit::from_points(&[point(64, 2920), point(128, 4840)], Some((250, 10_500)))
            .unwrap();
        let limit = fit.limit().unwrap();
        assert!(limit < 250 && limit > 128, "{limit}");
        assert!((fit.bytes(250.0) - 10_500.0).abs() < 1e-6);
    }

    #[test]
    fn figures_of_several_devices_are_no_ones() {
        use crate::memory::{DeviceMemory, MemorySnapshot};
        use crate::record::Outcome;
        let device = |name: &str| DeviceMemory {
            device: name.to_owned(),
            total: 100,
            free: 50,
            pool_reserved: Some(50),
            pool_used: Some(50),
            peak: Some(60),
        };
        let attempt = |devices: Vec<DeviceMemory>| Attempt {
            number: 1,
            batch_size: 8,
            outcome: Outcome::Succeeded,
            duration: Default::default(),
            memory_at_start: Some(MemorySnapshot {
                devices: devices.clone(),
            }),
            memory_at_end: Some(MemorySnapshot { devices }),
            memory_after_release: None,
            figures: Default::default(),
            rationale: None,
            remedies: None,
            first_step_done: false,
        };
        assert_eq!(
            peak_bytes(&attempt(vec![device("cuda:0")])),
            Some((60, 100))
        );
        let two = attempt(vec![device("cuda:0"), device("cuda:1")]);
        assert_eq!((peak_bytes(&two), used_at_start(&two)), (None, None));
    }

    #[test]
    fn no_fit_without_a_peak_that_grows() {
        assert_eq!(MemoryFit::from_points(&[point(64, 5000)], None), None);
        assert_eq!(
            MemoryFit::from_points(&[point(64, 5000), point(128, 5000)], None),
            None
        );
        assert_eq!(MemoryFit::through_start(point(64, 5000), 5000, None), None);
    }

    #[test]
    fn the_line_through_the_start_is_never_above_the_truth_where_state_is_allocated_late() {
        // 1000 bytes of weights in use before the first step; the step allocates 2000 bytes of
        // gradients once and 30 a sample: at 100, a peak of 6000.
        let first = MemoryFit::through_start(point(100, 6000), 1000, None).unwrap();
        let truth = (10_000 - 3000) / 30; // 233 samples
        let guess = first.limit().unwrap();
        assert!(guess <= truth && guess >= 150, "{guess}");
        // A failure above bends it below that failure's size.
        let bent = MemoryFit::through_start(point(100, 6000), 1000, Some((170, 10_500))).unwrap();
        assert!(bent.limit().unwrap() < 170, "{:?}", bent.limit());
    }
}
