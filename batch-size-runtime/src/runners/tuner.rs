//! A tuner that finds the largest batch size in a few short trials before training: probe
//! small sizes, fit memory against the size from their peaks, jump close to the predicted limit,
//! confirm, and bisect only what is left; then keep a margin, and run that size too.

use crate::attempt::AttemptError;
use crate::engine::BatchSizeSearch;
use crate::memory::Release;
use crate::policy::{Decision, SizePolicy};
use crate::record::{Attempt, Outcome, SearchReport};

/// Finds the largest batch size whose trial runs, in few trials.
///
/// Each trial is a call of your closure with a size: run a few training steps **on the longest
/// inputs** (the memory of a batch grows with its sequences: lhotse and OpenNMT probe the
/// longest batch first), and return as an attempt would. Out-of-memory errors and panics are
/// recognised as everywhere in this crate; memory is released between trials.
///
/// With memory figures (the release backend reads the device, or the errors carry them), it
/// probes two small sizes, fits memory = fixed + per-sample × size to their peaks, jumps to the
/// predicted limit, and bisects only between the largest size that ran and the smallest that
/// failed. Without figures it doubles, then bisects. Bisection stops once the bracket is
/// within half the margin; the margin is then taken off the largest size that ran, and that
/// size's trial is run too. It never returns a size larger than one whose trial succeeded, and
/// never tries one above `with_max`.
///
/// # Default
/// `min` 1, no `max`, `margin` 0.05 (as Lightning's), `max_trials` 25, release
/// [`Release::cuda()`], no cache.
///
/// ```
/// use batch_size_runtime::{SimulatedDevice, Tuner};
///
/// let device = SimulatedDevice::new(16 << 30); // 16 GiB
/// let tuned = Tuner::new()
///     .with_release(device.clone())
///     .run(|batch_size| -> anyhow::Result<()> {
///         let _weights = device.alloc(4 << 30)?;                             // 4 GiB
///         let _activations = device.alloc(batch_size as u64 * (100 << 20))?; // 100 MiB a sample
///         Ok(())
///     })?;
/// assert_eq!(tuned.largest_fit(), 122);                    // the largest that fits
/// assert!(tuned.batch_size() >= 115 && tuned.batch_size() < 122); // 5 % kept
/// assert!(tuned.report().len() <= 6);                      // Lightning's binsearch: 13 trials
/// # Ok::<(), anyhow::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "a tuner does nothing until it is run"]
pub struct Tuner {
    min: usize,
    max: Option<usize>,
    margin: f64,
    max_trials: usize,
    release: Option<Release>,
    cache: Option<(String, Option<std::path::PathBuf>)>,
}

/// What a [`Tuner`] found.
#[derive(Debug, Clone)]
pub struct Tuned {
    batch_size: usize,
    largest_fit: usize,
    report: SearchReport,
}

impl Tuned {
    /// The size to train with: the largest that fit, less the margin (its trial ran too).
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(64).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), 60); // 64 ran; 5 % kept
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The largest size whose trial succeeded.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(64).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.largest_fit(), 64);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn largest_fit(&self) -> usize {
        self.largest_fit
    }

    /// Every trial, in order.
    ///
    /// ```
    /// # use batch_size_runtime::{OutOfMemory, Tuner};
    /// let tuned = Tuner::new().run(|size| -> anyhow::Result<()> {
    ///     if size > 40 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// assert!(tuned.report().out_of_memory_count() >= 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn report(&self) -> &SearchReport {
        &self.report
    }
}

impl Default for Tuner {
    fn default() -> Self {
        Tuner::new()
    }
}

impl Tuner {
    /// A tuner with the defaults.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuner = Tuner::new();
    /// # let _ = tuner;
    /// ```
    pub fn new() -> Self {
        Tuner {
            min: 1,
            max: None,
            margin: 0.05,
            max_trials: 25,
            release: None,
            cache: None,
        }
    }

    /// Remembers the tuned size under `key` (see [`cache`](crate::cache)): a rerun with the
    /// same key, function and device runs that size once and returns it.
    ///
    /// ```
    /// # use batch_size_runtime::{OutOfMemory, Tuner};
    /// let tune = || Tuner::new().with_cache("tuner doc").run(|size| -> anyhow::Result<()> {
    ///     if size > 300 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// });
    /// let first = tune()?;
    /// let again = tune()?;
    /// assert_eq!(again.batch_size(), first.batch_size());
    /// assert_eq!(again.report().len(), 1);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_cache(mut self, key: impl Into<String>) -> Self {
        let dir = self.cache.take().and_then(|(_, dir)| dir);
        self.cache = Some((key.into(), dir));
        self
    }

    /// Keeps the cache's entries in `dir` too (see
    /// [`BatchSizeSearch::with_cache_dir`]).
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuner = Tuner::new().with_cache("key").with_cache_dir(std::env::temp_dir().join("tuned"));
    /// # let _ = tuner;
    /// ```
    pub fn with_cache_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        let key = self.cache.take().map(|(key, _)| key).unwrap_or_default();
        self.cache = Some((key, Some(dir.into())));
        self
    }

    /// The largest size tried (and returned), exactly.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(100).with_margin(0.0).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), 100);
    /// assert!(tuned.report().attempts().all(|trial| trial.batch_size <= 100));
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_max(mut self, max: usize) -> Self {
        self.max = Some(max);
        self
    }

    /// The smallest size tried; the first probe.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_min(8).with_max(8).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.report().attempts().next().unwrap().batch_size, 8);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_min(mut self, min: usize) -> Self {
        self.min = min;
        self
    }

    /// The share taken off the largest size that ran (0 ≤ margin < 1; default 0.05).
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max(100).with_margin(0.2).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(tuned.batch_size(), 80);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_margin(mut self, margin: f64) -> Self {
        self.margin = margin;
        self
    }

    /// At most this many trials (default 25, as Lightning).
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let tuned = Tuner::new().with_max_trials(3).run(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert!(tuned.report().len() <= 3);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_max_trials(mut self, max_trials: usize) -> Self {
        self.max_trials = max_trials;
        self
    }

    /// What releases device memory between trials, and reads the figures the fit uses.
    ///
    /// ```
    /// # use batch_size_runtime::{SimulatedDevice, Tuner};
    /// let device = SimulatedDevice::new(1 << 30);
    /// let tuner = Tuner::new().with_release(device.clone());
    /// # let _ = tuner;
    /// ```
    pub fn with_release(mut self, release: impl Into<Release>) -> Self {
        self.release = Some(release.into());
        self
    }

    /// Runs the trials. Takes the error types every runner takes ([`AttemptError`] and
    /// `From<NoExecutableBatchSize>`): a trial that fails with an error that is not
    /// out-of-memory ends the tuning and the error comes back unchanged; a panic that is not
    /// out-of-memory resumes; when not even `min` fits, `E::from(NoExecutableBatchSize)`.
    ///
    /// ```
    /// # use batch_size_runtime::Tuner;
    /// let error = Tuner::new().run(|_| -> anyhow::Result<()> { anyhow::bail!("no data") }).unwrap_err();
    /// assert_eq!(error.to_string(), "no data"); // your error, not a string in another one
    /// ```
    pub fn run<T, E, M>(self, trial: impl FnMut(usize) -> Result<T, E>) -> Result<Tuned, E>
    where
        E: AttemptError<M>,
    {
        let margin = self.margin;
        let policy = TunerPolicy {
            min: self.min.max(1),
            max: self.max,
            margin,
            max_trials: self.max_trials,
            phase: Phase::Probing,
        };
        let mut search = BatchSizeSearch::new(self.min.max(1))
            .with_label("tuner")
            .with_min(self.min)
            .with_policy(policy);
        if !(margin.is_finite() && (0.0..1.0).contains(&margin)) {
            search.invalidate(format!(
                "`margin` must be at least 0 and below 1, got {margin}"
            ));
        }
        if self.max_trials == 0 {
            search.invalidate("`max_trials` must be at least 1, got 0".to_owned());
        }
        if let Some(release) = self.release {
            search = search.with_release(release);
        }
        if let Some((key, dir)) = self.cache {
            search = search.with_cache(key);
            if let Some(dir) = dir {
                search = search.with_cache_dir(dir);
            }
        }
        let (result, report) = search.run_with_report(trial);
        result?;
        let largest_fit = report.largest_success().unwrap_or(0);
        let batch_size = report.batch_size().unwrap_or(largest_fit);
        Ok(Tuned {
            batch_size,
            largest_fit,
            report,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Growing: small probes, then a jump to the fitted limit or doubling.
    Probing,
    /// Bisecting between the largest success and the smallest failure.
    Bisecting,
    /// The margin's size is being confirmed.
    Confirming,
}

#[derive(Debug)]
struct TunerPolicy {
    min: usize,
    max: Option<usize>,
    margin: f64,
    max_trials: usize,
    phase: Phase,
}

/// Bytes in use during a successful trial: what was in use outside the pool before it, plus
/// the pool's peak.
fn peak_bytes(attempt: &Attempt) -> Option<(u64, u64)> {
    let start = attempt.memory_at_start.as_ref()?.devices.first()?;
    let end = attempt.memory_at_end.as_ref()?.devices.first()?;
    let outside = start
        .total
        .saturating_sub(start.free)
        .saturating_sub(start.pool_reserved.unwrap_or(0));
    Some((outside.saturating_add(end.peak?), end.total))
}

impl TunerPolicy {
    fn cap(&self, size: usize) -> usize {
        self.max.map_or(size, |max| size.min(max))
    }

    /// The size predicted to fill the device, from the peaks of the successful trials.
    fn predicted_limit(history: &SearchReport) -> Option<usize> {
        let points: Vec<(f64, f64, f64)> = history
            .attempts()
            .filter(|attempt| attempt.outcome.is_success())
            .filter_map(|attempt| {
                let (peak, total) = peak_bytes(attempt)?;
                Some((attempt.batch_size as f64, peak as f64, total as f64))
            })
            .collect();
        let [.., (s1, m1, _), (s2, m2, total)] = points.as_slice() else {
            return None;
        };
        if s2 <= s1 {
            return None;
        }
        let per_sample = (m2 - m1) / (s2 - s1);
        if !(per_sample.is_finite() && per_sample > 0.0) {
            return None;
        }
        let fixed = (m2 - per_sample * s2).max(0.0);
        // Aim a little under the device: the fit comes from small sizes.
        let limit = ((total * 0.98 - fixed) / per_sample).floor();
        (limit.is_finite() && limit >= 1.0).then(|| limit.min(usize::MAX as f64) as usize)
    }

    /// The end: the margin's size if it has not run yet, else accept.
    fn finish(&mut self, history: &SearchReport) -> Decision {
        let largest = history.largest_success().unwrap_or(0);
        let target = ((largest as f64) * (1.0 - self.margin)).floor() as usize;
        let target = target.max(self.min).min(largest);
        let last_ran = history
            .last()
            .is_some_and(|last| last.outcome.is_success() && last.batch_size == target);
        if self.phase == Phase::Confirming || last_ran || target == 0 {
            return Decision::Accept;
        }
        self.phase = Phase::Confirming;
        Decision::Try(target)
    }
}

impl SizePolicy for TunerPolicy {
    fn first(&mut self, starting: usize) -> Decision {
        Decision::Try(self.cap(starting.max(self.min)))
    }

    fn reads_memory_after_success(&self) -> bool {
        true
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        let Some(last) = history.last() else {
            return Decision::Accept;
        };
        if self.phase == Phase::Confirming {
            return Decision::Accept;
        }
        let Some(low) = history.largest_success() else {
            // Even the first probe failed: smaller, as a shrinking search would.
            return match last.outcome {
                Outcome::OutOfMemory { .. } if last.batch_size / 2 >= self.min => {
                    Decision::Try(last.batch_size / 2)
                }
                _ => Decision::Stop(crate::StopReason::BelowMinimum {
                    next: last.batch_size / 2,
                    min: self.min,
                }),
            };
        };
        // One trial is kept for the margin's size.
        if history.len() + 1 >= self.max_trials {
            return self.finish(history);
        }
        let high = history.smallest_out_of_memory();
        let tolerance = ((low as f64) * self.margin / 2.0).max(1.0);
        match high {
            None => {
                if self.max.is_some_and(|max| low >= max) {
                    return self.finish(history);
                }
                let next = match Self::predicted_limit(history) {
                    Some(limit) if limit > low => self.cap(limit),
                    // At the fitted limit already: a step of the margin above it, to bracket.
                    Some(_) => {
                        let step = ((low as f64) * self.margin).ceil().max(1.0) as usize;
                        self.cap(low.saturating_add(step))
                    }
                    None => self.cap(low.saturating_mul(2)),
                };
                if next <= low {
                    return self.finish(history);
                }
                Decision::Try(next)
            }
            Some(high) => {
                self.phase = Phase::Bisecting;
                if ((high - low) as f64) <= tolerance {
                    return self.finish(history);
                }
                let middle = low + (high - low) / 2;
                Decision::Try(middle.max(low + 1).min(high - 1))
            }
        }
    }
}
