//! The tuner's aim: where the figures give a line of memory against the size, the size that
//! keeps the headroom below the size the line fills the device at, run to confirm it; the
//! checks that keep the line honest (a part that appears above some size, a gentler slope
//! below, a line drawn far below its answer, a failure the line does not explain).

use super::*;

impl TunerPolicy {
    /// Memory against the size, from the trials since the memory last changed: the line
    /// through two sizes that ran (bent by a third below them and by the smallest failure
    /// above), or through one size and what was in use before it (plus the fixed bytes the user
    /// declared). `true` with two sizes: only then does the fit judge a trial's headroom.
    ///
    /// Where a jump was detected and the gentler slope's size ran past it, the line is drawn
    /// through the sizes past the jump only, however close they are: a line from below the
    /// jump is steeper than the memory on the aim's side, and would keep the size below the
    /// one that just ran (the search would swing between the two).
    fn fit(&self, history: &SearchReport, low: usize) -> Option<(MemoryFit, bool)> {
        let since = since_memory_changed(history);
        let attempts = || history.attempts().skip(since);
        let failure = failure_above(attempts(), low);
        if let Some(edge) = self.bracket.jump_above {
            let points = points_up_to(attempts(), low);
            if let Some(fit) = MemoryFit::past_an_edge(&points, edge, failure) {
                return Some((fit, true));
            }
        }
        let mut points = points_up_to(attempts(), low);
        // Where a size between half and seven eighths of the largest ran, the line is drawn
        // over that span only: probes far below show mostly what does not grow, and may be of
        // another regime (a workspace chosen by size); the span is still wide enough that an
        // allocator's rounding and noise move its slope little.
        let top = points.iter().map(|point| point.size).max().unwrap_or(0);
        let local = |size: usize| {
            size.saturating_mul(2) >= top && size.saturating_mul(8) <= top.saturating_mul(7)
        };
        if points.iter().any(|point| local(point.size)) {
            points.retain(|point| point.size == top || local(point.size));
        }
        if let Some(fit) = MemoryFit::bent_by_points(&points, failure) {
            return Some((
                self.steeper_from_noise(history, fit, &points, failure),
                true,
            ));
        }
        let (attempt, point) = attempts()
            .filter(|attempt| attempt.outcome.is_success() && attempt.batch_size == low)
            .filter_map(|attempt| {
                let (peak, total) = peak_bytes(attempt)?;
                Some((
                    attempt,
                    Point {
                        size: low,
                        peak,
                        total,
                    },
                ))
            })
            .last()?;
        let start = used_at_start(attempt)?;
        let declared = self.fixed_memory.and_then(|fixed| {
            MemoryFit::through_start(point, start.saturating_add(fixed), failure)
        });
        declared
            .or_else(|| MemoryFit::through_start(point, start, failure))
            .map(|fit| (fit, false))
    }

    /// Where the figures resolve growth only above some bytes (the host's, see
    /// [`peak_resolution`]) and the fit's smaller size grew no more than that: the line drawn
    /// as steep as that size's error allows (the largest point counted that much higher), so
    /// that the first aim errs below the limit. The next fit, from a size that grew past the
    /// resolution, is drawn as measured.
    fn steeper_from_noise(
        &self,
        history: &SearchReport,
        fit: MemoryFit,
        points: &[Point],
        failure: Option<(usize, u64)>,
    ) -> MemoryFit {
        let Some(resolution) = history.last().map(peak_resolution).filter(|&r| r > 0) else {
            return fit;
        };
        let smaller_is_noise = history
            .attempts()
            .filter(|attempt| attempt.outcome.is_success())
            .filter(|attempt| attempt.batch_size as f64 == fit.smaller())
            .filter_map(growth_in_attempt)
            .any(|growth| growth <= resolution);
        let top = points.iter().map(|point| point.size).max().unwrap_or(0);
        if !smaller_is_noise {
            return fit;
        }
        let raised: Vec<Point> = points
            .iter()
            .map(|&point| Point {
                peak: if point.size == top {
                    point.peak.saturating_add(resolution)
                } else {
                    point.peak
                },
                ..point
            })
            .collect();
        MemoryFit::bent_by_points(&raised, failure).unwrap_or(fit)
    }

    /// Where the fit's slope is [`GENTLER`] times that of the sizes up to its smaller or more
    /// (asked only where no size failed): the headroom's size with the gentler slope from the largest. Two sizes far
    /// apart cannot tell a bend (a `size²` term) from a part that appears above some size and
    /// does not grow (a workspace chosen by size): the bend would be right, the jump leaves
    /// room the steep line never shows. The gentler size is tried; a failure there bends the
    /// fit, a success puts a size on the same side of the jump.
    fn gentler(&self, history: &SearchReport, low: usize, fit: &MemoryFit) -> Option<usize> {
        let slope = gentler_slope_below(history, low, fit)?;
        let filling = fit.with_slope(slope, None)?.size_filling_device()?;
        let size = self.kept_below(filling, None);
        // A size at or below the largest that ran has had its trial: its peak is in the fit.
        Some(self.cap(size.min(low.saturating_mul(FARTHEST_JUMP)))).filter(|&size| size > low)
    }

    /// Where the fit's line is drawn from a size under half the largest and the sizes up to
    /// that one grew [`GENTLER`] times more gently (a part appeared between: a workspace chosen
    /// by size), and the gentler slope's size is too close to try: three quarters of the
    /// largest, so that the line is drawn on the aim's side of the jump (see
    /// [`fit`](Self::fit)). The line across the jump is steeper than the memory above it by an
    /// amount no two sizes near the aim have measured. Asked only where no size failed.
    fn beside_the_aim(&self, history: &SearchReport, low: usize, fit: &MemoryFit) -> Option<usize> {
        if fit.smaller() * 2.0 >= low as f64 {
            return None;
        }
        gentler_slope_below(history, low, fit)?;
        let size = low.saturating_mul(3) / 4;
        (size as f64 > fit.smaller()).then_some(size)
    }

    /// The fit's own choice: the size that keeps the headroom below the size it predicts fills
    /// the device, run to confirm it. A trial that ran there (within the resolution below it)
    /// is the answer; one that fit with more room, or less, is followed by the fit's new size;
    /// one that failed bends the fit. `None` where the figures give no fit (the search grows
    /// and bisects as without figures), or once the fit stops choosing (see
    /// [`aiming_over`](TunerPolicy::aiming_over)).
    pub(super) fn aim(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
        low: usize,
        high: Option<usize>,
    ) -> Option<Decision> {
        if self.aiming_over {
            return None;
        }
        let aimed = self
            .bracket
            .aimed
            .take()
            .filter(|&(size, _)| size == last.batch_size);
        if aimed.is_some() && !last.outcome.is_success() {
            self.overshoots += 1;
        }
        let predicted = self.bracket.predicted.take().filter(|_| aimed.is_some());
        let far_check = self.bracket.far_check.take();
        if let Some((size, edge)) = self.bracket.gentler_aim.take() {
            if last.batch_size == size && last.outcome.is_success() {
                self.bracket.jump_above = Some(edge);
            }
        }
        let (fit, measured) = self.fit(history, low)?;
        let filling = fit.size_filling_device().filter(|&size| size >= 1.0);
        if self.fit_does_not_explain(history, last, &fit, filling, low, high, predicted) {
            // What fails is not what the fit explains (a limit that is not the memory, an
            // allocator that cannot use all of it, a part that appears above some size), or it
            // does not settle: bisect.
            self.aiming_over = true;
            self.overshoots = self.overshoots.max(2);
            return Some(match high {
                Some(high) if high.saturating_sub(low) > self.resolution(low) => {
                    Decision::Try(geometric_middle(low, high))
                }
                _ => self.finish(history),
            });
        }
        let target = self.kept_below(filling.unwrap_or(low as f64), high);
        if let Some(kept_before) = far_check {
            return Some(self.after_the_near_check(history, last, kept_before, target, high));
        }
        let judged = measured || self.fixed_memory.is_some();
        let confirms = last.outcome.is_success()
            && last.batch_size <= low
            && aimed.is_some_and(|(_, judged)| judged);
        if confirms && last.batch_size <= target {
            if let Some(decision) = self.confirmed(history, last, &fit, target, low, high) {
                return Some(decision);
            }
        }
        if self.aims >= MOST_AIMS {
            // As many aims and not settled. Where the fit's size is below a size that ran, it
            // runs, and its trial is the answer; else the estimate keeps moving up (a part
            // that appears above some size, an allocator's rounding): the search brackets the
            // limit with trials, as before the fit aimed.
            self.aiming_over = true;
            if judged && target < low {
                self.bracket.phase = Phase::Confirming;
                return Some(Decision::Try(target));
            }
            return None;
        }
        Some(self.next_aim(history, last, &fit, target, judged, low, high))
    }

    /// Whether the fit cannot choose the next trial: it puts the limit above a size that
    /// failed, a failure was a part that appeared ([`failure_jumped`](Self::failure_jumped)),
    /// its aims failed twice, or a failure's bend was refuted.
    #[allow(clippy::too_many_arguments)] // the fit's view of one decision, each part named
    fn fit_does_not_explain(
        &self,
        history: &SearchReport,
        last: &Attempt,
        fit: &MemoryFit,
        filling: Option<f64>,
        low: usize,
        high: Option<usize>,
        predicted: Option<f64>,
    ) -> bool {
        let contradicted = match (filling, high) {
            (Some(filling), Some(high)) => filling >= high as f64,
            (None, _) => true,
            _ => false,
        };
        contradicted
            || high.is_some_and(|high| self.failure_jumped(history, fit, low, high))
            || self.overshoots >= 2
            || self.bend_refuted(last, predicted, fit)
    }

    /// After the size a headroom above the one kept (`kept_before`) ran, or failed: the line
    /// through the two measures the slope where the answer is, whatever the far line saw
    /// between. A failure there brackets the limit: bisected, and the headroom taken below the
    /// largest that runs, as without figures.
    fn after_the_near_check(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
        kept_before: usize,
        target: usize,
        high: Option<usize>,
    ) -> Decision {
        if !last.outcome.is_success() {
            self.aiming_over = true;
            if last.batch_size - kept_before > 1 {
                return Decision::Try(geometric_middle(kept_before, last.batch_size));
            }
            return self.finish(history);
        }
        let near: Vec<Point> = points_up_to(history.attempts(), last.batch_size)
            .into_iter()
            .filter(|point| point.size >= kept_before)
            .collect();
        let near_target = MemoryFit::from_points(&near, None)
            .and_then(|near| near.size_filling_device())
            .map(|filling| self.kept_below(filling, high));
        match near_target {
            // The size just above is the answer: it ran last.
            Some(near_target) if near_target == last.batch_size => self.kept(history, near_target),
            Some(near_target) if near_target > last.batch_size => {
                // A part appeared below the size kept: from now on the line is drawn past it,
                // through the sizes from the one kept up.
                self.bracket.jump_above = Some(kept_before as f64 - 0.5);
                self.aims += 1;
                self.bracket.aimed = Some((near_target, true));
                Decision::Try(near_target)
            }
            // The slope next to the size kept keeps less than the size just above: that size
            // is the answer, run last.
            near_target => {
                self.aiming_over = true;
                self.bracket.phase = Phase::Confirming;
                Decision::Try(near_target.unwrap_or(target.min(kept_before)))
            }
        }
    }

    /// The last aim ran and the fit with its own peak keeps the headroom at or above it: the
    /// answer, unless the sizes below it grew far more gently (see [`gentler`](Self::gentler))
    /// or a measurement beside it is due. `None` where the aim missed (it ran with more room
    /// than the resolution): the misses are counted and the next aim follows.
    fn confirmed(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
        fit: &MemoryFit,
        target: usize,
        low: usize,
        high: Option<usize>,
    ) -> Option<Decision> {
        let resolution = self.resolution(last.batch_size);
        // A line drawn from a size under half the aim measured its slope far from it: whatever
        // appears between (a workspace chosen by size, small tensors rounded up to whole
        // blocks) counts as growth, and the refit predicts less room than there is, by an
        // amount no trial has measured. Its size, when above the aim, runs once before the
        // resolution's slack is taken as well.
        let far = fit.smaller() * 2.0 < last.batch_size as f64;
        let slack = if far && !self.ran_past_far_line {
            0
        } else {
            resolution
        };
        if last.batch_size.saturating_add(slack) >= target {
            if high.is_none() {
                let gentler = self
                    .gentler(history, low, fit)
                    .filter(|&size| size > last.batch_size.saturating_add(resolution));
                if let Some(size) = gentler {
                    self.aims += 1;
                    self.bracket.aimed = Some((size, true));
                    self.bracket.gentler_aim = Some((size, fit.smaller()));
                    return Some(Decision::Try(size));
                }
                // A measurement below a size that ran, not an aim: it counts as none.
                if let Some(size) = self.beside_the_aim(history, low, fit) {
                    self.bracket.aimed = Some((size, true));
                    return Some(Decision::Try(size));
                }
            }
            return Some(self.kept(history, last.batch_size));
        }
        if last.batch_size.saturating_add(resolution) >= target {
            self.ran_past_far_line = true;
        } else {
            self.aim_misses += 1;
        }
        None
    }

    /// The next aim at the fit's `target`: a step above a miss that doubles with each miss, a
    /// probe of at least [`GROWTH`] times with one size run; a check a headroom above where the
    /// fit keeps the size that just ran from a line drawn far below it; the answer where the
    /// fit settles on a size that ran.
    #[allow(clippy::too_many_arguments)] // the fit's view of one decision, each part named
    fn next_aim(
        &mut self,
        history: &SearchReport,
        last: &Attempt,
        fit: &MemoryFit,
        target: usize,
        judged: bool,
        low: usize,
        high: Option<usize>,
    ) -> Decision {
        let resolution = self.resolution(last.batch_size);
        let next = if judged {
            let step = resolution
                .saturating_mul(1usize.checked_shl(self.aim_misses).unwrap_or(usize::MAX));
            if target > last.batch_size && self.aim_misses > 0 {
                target.max(last.batch_size.saturating_add(step))
            } else {
                target
            }
        } else {
            // One size ran: the line through the memory before it counts every byte the trial
            // allocated as growing with its size; a probe of at least `GROWTH` times puts the
            // second point on a wide span.
            target.max(low.saturating_mul(GROWTH))
        };
        let next = self
            .cap(next.min(low.saturating_mul(FARTHEST_JUMP)))
            .min(high.map_or(usize::MAX, |high| high.saturating_sub(1)))
            .max(self.goal.min);
        let ran_last = last.outcome.is_success();
        if next <= last.batch_size && ran_last && judged && self.drawn_far_below(history, last, fit)
        {
            if let Some(above) = self.near_check(last, resolution, high) {
                return Decision::Try(above);
            }
        }
        if next == last.batch_size && ran_last && judged {
            // The fit's size is the one that just ran: nothing else to try.
            return self.kept(history, next);
        }
        if next < last.batch_size && ran_last && judged && ran_below_failures(history, next) {
            // Back to a size that ran, below the one that just did: the fit has settled on it.
            // It runs last, as the answer; nothing else is explored after it.
            self.aiming_over = true;
            self.bracket.phase = Phase::Confirming;
            return Decision::Try(next);
        }
        self.aims += 1;
        self.bracket.aimed = Some((next, judged));
        self.bracket.predicted = high.map(|_| fit.bytes(next as f64));
        Decision::Try(next)
    }

    /// Whether the fit's line was drawn from a size under half of `last` with no size run
    /// between: it cannot tell a steep slope from a part that appeared between (a workspace
    /// chosen by size).
    fn drawn_far_below(&self, history: &SearchReport, last: &Attempt, fit: &MemoryFit) -> bool {
        let ran_near = history
            .attempts()
            .skip(since_memory_changed(history))
            .filter(|attempt| attempt.outcome.is_success())
            .any(|attempt| {
                attempt.batch_size < last.batch_size
                    && attempt.batch_size.saturating_mul(2) >= last.batch_size
            });
        fit.smaller() * 2.0 < last.batch_size as f64 && !ran_near
    }

    /// The size a headroom's width above `last`, run once to measure the slope where the answer
    /// is before the fit keeps `last` (wide enough that an allocator's rounding moves the slope
    /// little; a failure there brackets the limit within a headroom). `None` where it was run
    /// already or there is no room for it.
    fn near_check(
        &mut self,
        last: &Attempt,
        resolution: usize,
        high: Option<usize>,
    ) -> Option<usize> {
        let span = ((last.batch_size as f64 * self.goal.headroom).ceil() as usize).max(resolution);
        let above = last.batch_size.saturating_add(span.max(1));
        let room =
            high.is_none_or(|high| above < high) && self.goal.max.is_none_or(|max| above <= max);
        if !room || self.ran_past_far_line {
            return None;
        }
        self.ran_past_far_line = true;
        self.bracket.far_check = Some(last.batch_size);
        self.aims += 1;
        self.bracket.aimed = Some((above, true));
        Some(above)
    }

    /// Whether the smallest failure, at `high`, failed on one allocation larger than twice the
    /// growth the line predicts between `low` and `high`: a part that appears above some size
    /// (a workspace an algorithm chooses, a buffer past a threshold), not a steeper slope.
    /// Bending the line to reach it would keep the headroom below a cliff as if it were a slope;
    /// the bracket is bisected instead.
    fn failure_jumped(
        &self,
        history: &SearchReport,
        fit: &MemoryFit,
        low: usize,
        high: usize,
    ) -> bool {
        let Some(failed) = history
            .attempts()
            .find(|attempt| attempt.batch_size == high && attempt.outcome.is_out_of_memory())
        else {
            return false;
        };
        let requested = failed.figures.requested;
        let growth = fit.per_sample() * high.saturating_sub(low) as f64;
        if !requested.is_some_and(|requested| requested as f64 > 2.0 * growth) {
            return false;
        }
        // A size² term also fails on one large allocation: it shows as a slope that steepens
        // between the sizes that ran. Only a straight run of successes (the slope between the
        // two largest no more than twice that between the two before: allocators' rounding
        // bends a short span that much) makes the failure a part that appeared.
        let mut points = points_up_to(history.attempts().skip(since_memory_changed(history)), low);
        points.sort_by_key(|point| point.size);
        points.dedup_by_key(|point| point.size);
        let slope = |a: &Point, b: &Point| {
            (b.peak as f64 - a.peak as f64) / (b.size as f64 - a.size as f64)
        };
        match points.as_slice() {
            [.., a, b, c] => slope(b, c) <= 2.0 * slope(a, b).max(0.0),
            _ => false,
        }
    }

    /// The size that keeps the headroom below `filling` (a size that fills the device), within
    /// the bounds and below the smallest failure `high`.
    fn kept_below(&self, filling: f64, high: Option<usize>) -> usize {
        let mut target =
            ((filling * (1.0 - self.goal.headroom)).floor() as usize).max(self.goal.min);
        if let Some(max) = self.goal.max {
            target = target.min(kept_size(max, self.goal.headroom, self.goal.min));
        }
        if let Some(high) = high {
            target = target.min(high.saturating_sub(1)).max(self.goal.min);
        }
        target
    }

    /// Whether the last aim ran with a peak well below what the fit that chose it predicted
    /// (by more than a quarter of the headroom's bytes there), that fit being bent by a failure
    /// above. A `size²` term shows in the sizes below the failure as the bend predicts; a part
    /// that appears only above some size (a workspace chosen by size, a buffer allocated late)
    /// bends the fit through the failure as if it were one, and the fit then predicts far less
    /// room than there is below the failure: bisecting between the two finds it.
    fn bend_refuted(&self, last: &Attempt, predicted: Option<f64>, fit: &MemoryFit) -> bool {
        let Some(predicted) = predicted else {
            return false;
        };
        let Some((peak, _)) = peak_bytes(last).filter(|_| last.outcome.is_success()) else {
            return false;
        };
        let tolerance = self.goal.headroom / 4.0 * last.batch_size as f64 * fit.per_sample();
        (peak as f64) < predicted - tolerance
    }
}
