//! What one out-of-memory attempt tells about the device: the bytes the failing allocation asked
//! for, the bytes in use when it failed, and the device's total, from the figures its error
//! states (read by [`oom::figures`] from the one table of messages, [`oom::OOM_PATTERNS`]) and
//! from the memory backend's readings around the attempt. Here the figures become the policy's
//! view: in use = total - free, and figures that contradict each other are dropped.
//!
//! ```
//! use batch_size_runtime::policy::Evidence;
//!
//! let pytorch = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
//!                80.00 GiB of which 1.00 GiB is free.";
//! let figures = Evidence::from_text(pytorch);
//! assert_eq!(figures.requested, Some(2 << 30));
//! assert_eq!(figures.total, Some(80 << 30));
//! assert_eq!(figures.used_at_failure, Some(79 << 30));
//! ```

use crate::oom;
use crate::record::{Attempt, Outcome};

/// The figures of one failure; each `None` where nothing said it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Evidence {
    /// Bytes the failing allocation asked for.
    pub requested: Option<u64>,
    /// Bytes in use on the device when the allocation failed.
    pub used_at_failure: Option<u64>,
    /// The device's total bytes.
    pub total: Option<u64>,
    /// Bytes in use on the device when the attempt started (what it did not allocate itself).
    pub used_at_start: Option<u64>,
    /// Bytes free when the allocation failed, as the error said: kept where the text gives no
    /// total (ONNX Runtime's "Available memory of A"), to be read against the backend's total
    /// or, with none, against the bytes asked for.
    pub free_at_failure: Option<u64>,
    /// The most bytes in use on the device during the attempt (what was in use before it plus
    /// the attempt's peak), where the backend keeps a peak: above what was in use at the failure
    /// when the attempt freed memory before failing.
    pub peak: Option<u64>,
}

impl Evidence {
    /// The figures an out-of-memory message carries (none for a message that is not one).
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    ///
    /// let ours = Evidence::from_text(
    ///     "out of device memory on sim:0: tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB",
    /// );
    /// assert_eq!(ours.used_at_failure, Some(15 << 30));
    /// let burn = Evidence::from_text("out of device memory allocating 4096 bytes");
    /// assert_eq!((burn.requested, burn.total), (Some(4096), None));
    /// assert_eq!(Evidence::from_text("tried to allocate 4.00 GiB"), Evidence::default());
    /// ```
    pub fn from_text(text: &str) -> Evidence {
        let figures = oom::figures(text);
        let used_at_failure = match (figures.free, figures.total) {
            (Some(free), Some(total)) if free <= total => Some(total - free),
            _ => None,
        };
        Evidence {
            requested: figures.requested,
            used_at_failure,
            // Figures that contradict each other (free above total) are not used at all.
            total: figures.total.filter(|_| used_at_failure.is_some()),
            used_at_start: None,
            free_at_failure: figures
                .free
                .filter(|free| figures.total.is_none_or(|total| *free <= total)),
            peak: None,
        }
    }

    /// The figures of an out-of-memory attempt: its error's text first, then the memory
    /// backend's readings (the device's total; the bytes in use before the attempt plus the
    /// attempt's peak). `None` for an attempt that did not run out of memory.
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    /// use batch_size_runtime::{last_report, BatchSizeSearch, memory::SimulatedDevice};
    ///
    /// let device = SimulatedDevice::new(1000);
    /// let _: anyhow::Result<usize> = BatchSizeSearch::new(64)
    ///     .with_release(device.clone())
    ///     .run(|batch_size| {
    ///         let _weights = device.alloc(200)?;
    ///         let _batch = device.alloc(batch_size as u64 * 20)?;
    ///         Ok(batch_size)
    ///     });
    /// let report = last_report().unwrap();
    /// let first = Evidence::of(report.attempts().next().unwrap()).unwrap();
    /// assert_eq!(first.requested, Some(64 * 20));
    /// assert_eq!(first.used_at_failure, Some(200));
    /// assert_eq!(first.total, Some(1000));
    /// assert_eq!(first.used_at_start, Some(0));
    /// ```
    pub fn of(attempt: &Attempt) -> Option<Evidence> {
        let Outcome::OutOfMemory { error } = &attempt.outcome else {
            return None;
        };
        let mut evidence = Evidence::from_text(error);
        if evidence.requested.is_none() {
            evidence.requested = attempt.requested;
        }
        let at_start = attempt
            .memory_at_start
            .as_ref()
            .and_then(|memory| memory.devices.first());
        let at_end = attempt
            .memory_at_end
            .as_ref()
            .and_then(|memory| memory.devices.first());
        if evidence.total.is_none() {
            evidence.total = at_end.or(at_start).map(|device| device.total);
        }
        evidence.used_at_start = at_start.map(|device| device.total.saturating_sub(device.free));
        // In use before the attempt outside the pool (other processes, the context), plus the
        // pool's peak during the attempt, which counts what was in the pool at the start.
        evidence.peak = match (at_start, at_end.and_then(|device| device.peak)) {
            (Some(start), Some(peak)) => Some(
                start
                    .total
                    .saturating_sub(start.free)
                    .saturating_sub(start.pool_reserved.unwrap_or(0))
                    .saturating_add(peak),
            ),
            _ => None,
        };
        if evidence.used_at_failure.is_none() {
            // The text's free bytes against the backend's total say what was in use at the
            // failure itself; the peak, which may be later than the failure, only where they
            // cannot.
            evidence.used_at_failure = match (evidence.total, evidence.free_at_failure) {
                (Some(total), Some(free)) if free <= total => Some(total - free),
                _ => evidence.peak,
            };
        }
        Some(evidence)
    }

    /// Bytes the attempt needed at least: what was in use plus what it asked for.
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    /// let figures = Evidence::from_text(
    ///     "out of device memory: tried to allocate 1.00 KiB with 0 bytes free of 4.00 KiB",
    /// );
    /// assert_eq!(figures.needed_at_least(), Some(5 << 10));
    /// ```
    pub fn needed_at_least(&self) -> Option<u64> {
        Some(self.used_at_failure?.saturating_add(self.requested?))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_form() {
        let ort =
            Evidence::from_text("Failed to allocate memory for requested buffer of size 1048576");
        assert_eq!(ort.requested, Some(1 << 20));
        let ours = Evidence::from_text(
            "out of device memory on sim:0: tried to allocate 5.34 GiB with 786.00 MiB free of 24.00 GiB",
        );
        assert_eq!(ours.total, Some(24 << 30));
        assert_eq!(ours.used_at_failure, Some((24 << 30) - (786 << 20)));
    }

    #[test]
    fn contradicting_figures_are_ignored() {
        // Free above total contradicts itself: neither is used.
        let contradiction = Evidence::from_text(
            "out of device memory: tried to allocate 1.00 GiB with 9.00 GiB free of 4.00 GiB",
        );
        assert_eq!(contradiction.total, None);
        assert_eq!(contradiction.used_at_failure, None);
        assert_eq!(contradiction.requested, Some(1 << 30));
    }
}
