//! Sizing from dry runs: where a framework can run a step without running it (cubecl 0.11's
//! dry run under burn 0.22: launches compiled and dropped, pages carved but not mapped), the
//! step's peak is measured at a few sizes with no device memory spent and no out-of-memory, a
//! line through the peaks gives the size that fills the device, and one real trial confirms it.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::search::TunerPolicy;
use crate::memory::{DryRun, DrySizing};
use crate::policy::{Decision, SizePolicy};
use crate::record::SearchReport;

/// The first dry run's size at least, so that the line is not drawn through page rounding.
const FIRST_PROBE: usize = 16;
/// The second dry run, this many times the first.
const PROBE_RATIO: usize = 4;
/// How many dry runs may measure the same peak before the sizing gives up: from 16, up to
/// 16 × 4⁵ = 16384.
const MAX_PROBES_FLAT: usize = 6;
/// How far past the second dry run the line may send the third, without a `max`.
const MAX_JUMP: usize = 1024;
/// The third dry run aims this far below the line's size, so that it likely fits and a fourth,
/// on the line through the second and third (points close to the answer), refines it upwards.
const UNDER_AIM: f64 = 0.9;

/// The largest size on the line through `a` and `b` whose peak is at most `budget`; `None`
/// where the line does not rise.
fn on_line(a: (usize, u64), b: (usize, u64), budget: u64) -> Option<usize> {
    let (s1, p1) = (a.0 as f64, a.1 as f64);
    let (s2, p2) = (b.0 as f64, b.1 as f64);
    let slope = (p2 - p1) / (s2 - s1);
    if !(slope.is_finite() && slope > 0.0) {
        return None;
    }
    let size = s2 + (budget as f64 - p2) / slope;
    Some(if size < 1.0 { 0 } else { size.floor() as usize })
}

/// Sizes a step from dry runs, sizes increasing (cubecl's page peak has no reset, and its
/// pages only grow: a size measured after a larger one would read the larger one's pages):
/// `min` (at least 16) and four times that give a line, the line gives the size that fills
/// `budget`, and a third dry run a tenth below it checks it. Where the third's peak is above
/// the budget (the peak bends upwards: a `batch²` term, pages rounding up), the line through
/// the last two gives the size, below the third; where it fits, a fourth dry run on that line
/// refines it upwards (and the line through the third and fourth, where the fourth does not
/// fit). `None` where a dry run failed, measured nothing,
/// or the peaks do not grow with the size.
pub(super) fn size_from_dry_runs(
    measure: &mut dyn FnMut(usize) -> Option<u64>,
    budget: u64,
    min: usize,
    max: Option<usize>,
    headroom: f64,
) -> Option<DrySizing> {
    let cap = |size: usize| max.map_or(size, |max| size.min(max));
    let first = cap(min.max(FIRST_PROBE));
    let second = cap(first.saturating_mul(PROBE_RATIO));
    let mut probes = vec![(first, measure(first)?)];
    if second > first {
        probes.push((second, measure(second)?));
    }
    // Where the pools already hold pages larger than the step needs at these sizes (a warm-up
    // or an earlier step at a larger size: cubecl's pages only grow), the dry runs fit in them
    // and measure the same peak: no line. The next size, four times larger, until the step
    // outgrows those pages (on burn's autodiff MLP, 16 to 1024 read the same 41 MiB, held by a
    // warm-up at 2048, and 4096 rose above them).
    while let [.., a, b] = probes[..] {
        let next = cap(b.0.saturating_mul(PROBE_RATIO));
        if b.1 > a.1 || b.1 > budget || next <= b.0 || probes.len() >= MAX_PROBES_FLAT {
            break;
        }
        probes.push((next, measure(next)?));
    }
    let fit = match probes[..] {
        [only] if only.1 <= budget => only.0, // `max` reached at the first dry run
        [.., a, b] => {
            let predicted = on_line(a, b, budget)?;
            let aimed = ((predicted as f64) * UNDER_AIM) as usize;
            let third = cap(aimed.min(b.0.saturating_mul(MAX_JUMP)));
            if third <= b.0 {
                // The line (or `max`) puts the size at or below the second dry run.
                if b.1 <= budget {
                    b.0
                } else {
                    predicted.min(b.0 - 1)
                }
            } else {
                let peak = measure(third)?;
                probes.push((third, peak));
                if peak > budget {
                    on_line(b, (third, peak), budget)?.min(third - 1)
                } else {
                    let fourth = cap(on_line(b, (third, peak), budget).unwrap_or(third));
                    if fourth <= third {
                        third
                    } else {
                        let last = measure(fourth)?;
                        probes.push((fourth, last));
                        if last <= budget {
                            fourth
                        } else {
                            on_line((third, peak), (fourth, last), budget)
                                .unwrap_or(third)
                                .clamp(third, fourth - 1)
                        }
                    }
                }
            }
        }
        _ => return None,
    };
    if fit < min.max(1) {
        return None;
    }
    Some(DrySizing {
        batch_size: super::search::kept_size(fit, headroom, min.max(1)),
        probes,
        budget,
        fit,
    })
}

/// Runs `trial` under `dry_run` at the sizes [`size_from_dry_runs`] asks for. A trial that
/// returns an error or panics under the dry run measured nothing: the sizing gives up.
pub(super) fn dry_sizing<T, E>(
    dry_run: &dyn DryRun,
    trial: &mut impl FnMut(usize) -> Result<T, E>,
    min: usize,
    max: Option<usize>,
    headroom: f64,
) -> Option<DrySizing> {
    let budget = dry_run.budget()?;
    let mut measure = |size: usize| {
        let mut ran = false;
        let peak = catch_unwind(AssertUnwindSafe(|| {
            dry_run.measure(&mut || ran = trial(size).is_ok())
        }))
        .ok()
        .flatten();
        if !ran {
            tracing::info!(
                batch_size = size,
                "the trial failed under a dry run: the tuner searches with real trials"
            );
        }
        peak.filter(|_| ran)
    };
    let sizing = size_from_dry_runs(&mut measure, budget, min, max, headroom);
    dry_run.finish();
    match &sizing {
        Some(sizing) => tracing::info!(batch_size = sizing.batch_size, "{sizing}"),
        None => tracing::info!("no size from the dry runs: the tuner searches with real trials"),
    }
    sizing
}

/// The tuner's policy once dry runs gave a size: that size first; where it runs out of
/// memory, the ordinary search below it.
#[derive(Debug)]
pub(super) struct DryRunPolicy {
    sizing: DrySizing,
    /// The ordinary search, capped below the dry runs' size, once that size failed.
    fallback: Option<TunerPolicy>,
    below: Option<TunerPolicy>,
    min: usize,
}

impl DryRunPolicy {
    /// `sizing`'s size first, then `below` (a search capped under it) if it fails.
    pub(super) fn new(sizing: DrySizing, below: TunerPolicy, min: usize) -> Self {
        DryRunPolicy {
            sizing,
            fallback: None,
            below: Some(below),
            min,
        }
    }
}

impl DryRunPolicy {
    /// The headroom's size the ordinary search below the dry runs' size kept, once it ran (0
    /// when the dry runs' size ran, or nothing was kept).
    pub(super) fn kept_size(&self) -> usize {
        self.fallback.as_ref().map_or(0, TunerPolicy::kept_size)
    }

    /// Whether the budget ended the search below the dry runs' size with a larger size left.
    pub(super) fn cut_by_budget(&self) -> bool {
        self.fallback
            .as_ref()
            .is_some_and(TunerPolicy::cut_by_budget)
    }
}

impl SizePolicy for DryRunPolicy {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(self.sizing.batch_size)
    }

    fn reads_memory_after_success(&self) -> bool {
        true
    }

    fn rationale(&self) -> Option<String> {
        match &self.fallback {
            Some(fallback) => fallback.rationale(),
            None => Some(self.sizing.to_string()),
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        if let Some(fallback) = &mut self.fallback {
            return fallback.after(history);
        }
        match history.last() {
            Some(last) if last.outcome.is_out_of_memory() => {
                tracing::warn!(
                    batch_size = last.batch_size,
                    "the dry runs' size ran out of memory: searching below it"
                );
                let Some(below) = self.below.take() else {
                    return Decision::Accept;
                };
                let fallback = self.fallback.insert(below);
                if self.sizing.batch_size <= self.min {
                    return fallback.after(history);
                }
                fallback.first(self.min)
            }
            _ => Decision::Accept,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// 100 MiB fixed, 1 MiB a sample, 2 MiB pages; budget 1 GiB: 924 samples fit.
    fn paged(size: usize) -> Option<u64> {
        let bytes = (100u64 << 20) + size as u64 * (1 << 20);
        Some(bytes.next_multiple_of(2 << 20))
    }

    #[test]
    fn a_line_is_sized_in_four_dry_runs() {
        let sizing = size_from_dry_runs(&mut paged, 1 << 30, 1, None, 0.05).unwrap();
        assert!(sizing.probes.len() <= 4, "{sizing:?}");
        assert!((920..=924).contains(&sizing.fit), "{sizing:?}");
        assert_eq!(sizing.batch_size, (sizing.fit as f64 * 0.95) as usize);
        assert!(sizing.probes.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn a_bend_upwards_stays_below_the_budget() {
        // 64 KiB × size²: the line through 16 and 64 overshoots; the third dry run says so.
        let mut square = |size: usize| Some((10u64 << 20) + (size * size) as u64 * (64 << 10));
        let sizing = size_from_dry_runs(&mut square, 1 << 30, 1, None, 0.0).unwrap();
        let fits = |size: usize| square(size).unwrap() <= 1 << 30;
        assert!(fits(sizing.fit), "{sizing:?}");
        assert!(sizing.fit >= 100, "{sizing:?}"); // 126 fit
    }

    #[test]
    fn pages_held_from_a_larger_step_are_probed_past() {
        // A 300 MiB page held from a warm-up: every size up to 300 reads the same peak; above
        // it, the paged line. The dry runs grow until the peak rises.
        let mut held = |size: usize| Some(paged(size)?.max(400 << 20));
        let sizing = size_from_dry_runs(&mut held, 1 << 30, 1, None, 0.0).unwrap();
        // 924 fit; the line from the last size the held page served (256) to 1024 is a little
        // steep, and lands just below.
        assert!((900..=924).contains(&sizing.fit), "{sizing:?}");
        assert!(sizing.probes.len() <= 6, "{sizing:?}");
    }

    #[test]
    fn max_caps_the_dry_runs() {
        let sizing = size_from_dry_runs(&mut paged, 1 << 30, 1, Some(50), 0.0).unwrap();
        assert_eq!(sizing.fit, 50);
        assert!(sizing.probes.iter().all(|(size, _)| *size <= 50));
    }

    #[test]
    fn no_size_where_memory_does_not_grow_or_a_dry_run_fails() {
        assert_eq!(
            size_from_dry_runs(&mut |_| Some(1 << 20), 1 << 30, 1, None, 0.05),
            None
        );
        assert_eq!(
            size_from_dry_runs(&mut |_| None, 1 << 30, 1, None, 0.05),
            None
        );
        // Not even the first fits.
        assert_eq!(
            size_from_dry_runs(&mut paged, 50 << 20, 1, None, 0.05),
            None
        );
    }

    /// A dry run that says 1 MiB a sample where the trial takes 2: its size runs out of memory,
    /// and the ordinary search runs below it, never above.
    #[test]
    fn a_size_the_dry_runs_got_wrong_falls_back_below_it() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        use std::sync::Arc;

        use crate::{memory::SimulatedDevice, Tuner};

        #[derive(Debug)]
        struct Wrong(Arc<AtomicUsize>, Arc<AtomicBool>);
        impl DryRun for Wrong {
            fn measure(&self, step: &mut dyn FnMut()) -> Option<u64> {
                self.1.store(true, Relaxed);
                step();
                self.1.store(false, Relaxed);
                Some(self.0.load(Relaxed) as u64 * (1 << 20))
            }
            fn budget(&self) -> Option<u64> {
                Some(1 << 30)
            }
        }
        let (size, dry) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let device = SimulatedDevice::new(1 << 30);
        let tuned = Tuner::new()
            .with_release(device.clone())
            .with_dry_run(Wrong(Arc::clone(&size), Arc::clone(&dry)))
            .run(|batch_size| -> anyhow::Result<()> {
                size.store(batch_size, Relaxed);
                if !dry.load(Relaxed) {
                    let _activations = device.alloc(batch_size as u64 * (2 << 20))?;
                }
                Ok(())
            })
            .unwrap();
        let mut attempts = tuned.report().attempts();
        let first = attempts.next().unwrap();
        assert_eq!(first.batch_size, 1024 * 95 / 100);
        assert!(first.outcome.is_out_of_memory());
        assert!(attempts.all(|a| a.batch_size < first.batch_size));
        assert!(
            tuned.batch_size() <= 512 && tuned.batch_size() >= 400,
            "{tuned:?}"
        );
    }
}
