//! The weight of a step's square term, learned from the steps that ran by cost.
//!
//! A micro-batch of `n` items padded to `L` costs `n·L + n·L²/from` ([`BatchCost`]); the user
//! declares `from` (or none), and a wrong declaration makes memory stop following the cost: a
//! budget that fits short items fails on long ones, or wastes the device on them. Each step
//! that ran measured its peak, and its micro-batches' shapes are known, so for each candidate
//! `from` the peaks fall on a line against the costliest micro-batch's cost (a fixed part plus
//! memory per unit) only where the candidate is the step's own. [`SquareTerm`] fits that line
//! for every candidate over the last steps and names the one that explains the peaks best,
//! where it explains them clearly better than the one in use.

use std::collections::VecDeque;

use crate::runners::split::BatchCost;

/// Steps kept for the fit: enough to span lengths, bounded for a long run.
const KEPT: usize = 32;

/// Steps needed before a change: a line through fewer says little.
const AT_LEAST: usize = 6;

/// The candidates for `from`: none (no square term), then powers of two.
fn candidates() -> impl Iterator<Item = Option<u64>> {
    std::iter::once(None).chain((4..=17).map(|power| Some(1u64 << power)))
}

/// One step that ran: its peak, and each micro-batch's items and costliest item's cost.
#[derive(Debug, Clone)]
struct Step {
    peak: f64,
    shapes: Vec<(usize, u64)>,
}

/// What the steps by cost measured, for the square term's weight.
#[derive(Debug, Clone, Default)]
pub(crate) struct SquareTerm {
    steps: VecDeque<Step>,
}

/// A candidate's line through the steps' peaks: its fixed part, bytes per unit of cost, and how
/// far the peaks fall from it (the root mean square, in bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Line {
    from: Option<u64>,
    fixed: f64,
    per_unit: f64,
    error: f64,
}

impl SquareTerm {
    /// Records a step that ran with `peak` bytes above its start, in micro-batches of
    /// `shapes` (items, the costliest item's cost).
    fn record(&mut self, peak: u64, shapes: Vec<(usize, u64)>) {
        if shapes.is_empty() {
            return;
        }
        if self.steps.len() == KEPT {
            self.steps.pop_front();
        }
        self.steps.push_back(Step {
            peak: peak as f64,
            shapes,
        });
    }

    /// The line of `from` through the steps' peaks; `None` where they do not span two costs.
    fn line(&self, from: Option<u64>) -> Option<Line> {
        let shape = match from {
            Some(from) => BatchCost::padded().with_square_term(from),
            None => BatchCost::padded(),
        };
        let points: Vec<(f64, f64)> = self
            .steps
            .iter()
            .map(|step| {
                let cost = step
                    .shapes
                    .iter()
                    .map(|&(items, longest)| shape.of(items, longest))
                    .max()
                    .unwrap_or(0);
                (cost as f64, step.peak)
            })
            .collect();
        let count = points.len() as f64;
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / count;
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / count;
        let spread: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        if spread <= f64::EPSILON * mean_x.max(1.0).powi(2) {
            return None;
        }
        let per_unit = points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum::<f64>()
            / spread;
        if per_unit <= 0.0 {
            return None;
        }
        let fixed = mean_y - per_unit * mean_x;
        let error = (points
            .iter()
            .map(|p| (p.1 - fixed - per_unit * p.0).powi(2))
            .sum::<f64>()
            / count)
            .sqrt();
        Some(Line {
            from,
            fixed,
            per_unit,
            error,
        })
    }

    /// A `from` that explains the peaks clearly better than `in_use`'s (its line's error under
    /// half of `in_use`'s, and `in_use`'s more than 1 % of the peaks): its line. `None` while
    /// too few steps ran, or where `in_use` explains them as well as any.
    fn better_than(&self, in_use: Option<u64>) -> Option<Line> {
        if self.steps.len() < AT_LEAST {
            return None;
        }
        let mean_peak =
            self.steps.iter().map(|step| step.peak).sum::<f64>() / self.steps.len() as f64;
        let current = self.line(in_use);
        let best = candidates()
            .filter_map(|from| self.line(from))
            .min_by(|a, b| a.error.total_cmp(&b.error))?;
        match current {
            Some(current)
                if current.error <= 0.01 * mean_peak || best.error >= 0.5 * current.error =>
            {
                None
            }
            _ if best.from == in_use => None,
            _ => Some(best),
        }
    }

    /// Records a step (or chunk) that ran with `peak` bytes above its start in `room`, in
    /// micro-batches of `shapes`; where the peaks follow a square term other than `in_use`
    /// clearly better, says so at INFO and returns it with the budget its line says fits the
    /// room (3 % kept back, as the figures' fit of any size).
    pub(crate) fn observe(
        &mut self,
        peak: u64,
        room: u64,
        shapes: Vec<(usize, u64)>,
        in_use: Option<u64>,
    ) -> Option<(Option<u64>, usize)> {
        self.record(peak, shapes);
        let line = self.better_than(in_use)?;
        let fits = ((room as f64 - line.fixed.max(0.0)) / line.per_unit).max(1.0);
        let budget = (fits * 0.97) as usize;
        let said = |from: Option<u64>| from.map_or("none".to_owned(), |from| from.to_string());
        tracing::info!(
            was = %said(in_use),
            now = %said(line.from),
            budget,
            "the peaks follow the cost with a square term from {} (was {}): micro-batches and \
             chunks now cost at most {budget} by it; an effective batch is unchanged",
            said(line.from),
            said(in_use)
        );
        Some((line.from, budget))
    }

    /// Forgets the steps: they ran under other settings.
    pub(crate) fn forget(&mut self) {
        self.steps.clear();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Peaks of a step whose memory is `n·L·4096 + n·L²·2` (equal terms at 2,048).
    fn peak(shapes: &[(usize, u64)]) -> u64 {
        shapes
            .iter()
            .map(|&(n, l)| n as u64 * l * 4096 + n as u64 * l * l * 2)
            .max()
            .unwrap_or(0)
            + (100 << 20)
    }

    #[test]
    fn the_square_term_is_found_from_steps_of_different_lengths() {
        let mut learned = SquareTerm::default();
        let steps: [&[(usize, u64)]; 8] = [
            &[(1, 8_000), (30, 300)],
            &[(2, 3_000), (40, 200)],
            &[(8, 1_000)],
            &[(60, 120)],
            &[(1, 5_000), (10, 700)],
            &[(3, 2_500)],
            &[(20, 400)],
            &[(1, 6_500), (5, 1_500)],
        ];
        for (index, shapes) in steps.iter().enumerate() {
            learned.record(peak(shapes), shapes.to_vec());
            if index + 1 < AT_LEAST {
                assert_eq!(learned.better_than(None), None);
            }
        }
        let line = learned.better_than(None).unwrap();
        assert_eq!(line.from, Some(2_048));
        assert!((line.per_unit - 4096.0).abs() < 1.0, "{line:?}");
        // Within the cost's integer rounding of the square term.
        assert!(
            (line.fixed / (100 << 20) as f64 - 1.0).abs() < 1e-3,
            "{line:?}"
        );
        // Declared right, nothing better.
        assert_eq!(learned.better_than(Some(2_048)), None);
    }

    #[test]
    fn a_linear_step_keeps_no_square_term() {
        let mut learned = SquareTerm::default();
        for (n, l) in [
            (10, 100),
            (3, 900),
            (50, 30),
            (7, 400),
            (1, 3_000),
            (20, 120),
            (2, 2_000),
        ] {
            learned.record(n as u64 * l * 1000 + 5_000, vec![(n, l)]);
        }
        assert_eq!(learned.better_than(None), None);
        assert_eq!(
            learned.better_than(Some(256)).map(|line| line.from),
            Some(None)
        );
    }
}
