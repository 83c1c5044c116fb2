//! What one out-of-memory attempt tells about the device: the bytes the failing allocation asked
//! for, the bytes in use when it failed, and the device's capacity, read from the error's text
//! (this crate's `OutOfMemory`, PyTorch, burn/cubecl, ONNX Runtime) and from the memory backend's
//! readings around the attempt.
//!
//! ```
//! use batch_size_runtime::policy::Evidence;
//!
//! let pytorch = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
//!                80.00 GiB of which 1.00 GiB is free.";
//! let figures = Evidence::from_text(pytorch);
//! assert_eq!(figures.requested, Some(2 << 30));
//! assert_eq!(figures.capacity, Some(80 << 30));
//! assert_eq!(figures.used_at_failure, Some(79 << 30));
//! ```

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
    pub capacity: Option<u64>,
    /// Bytes in use on the device when the attempt started (what it did not allocate itself).
    pub used_at_start: Option<u64>,
}

impl Evidence {
    /// The figures an error message carries.
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    ///
    /// let ours = Evidence::from_text(
    ///     "out of device memory on sim:0: tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB",
    /// );
    /// assert_eq!(ours.used_at_failure, Some(15 << 30));
    /// let burn = Evidence::from_text("out of device memory allocating 4096 bytes");
    /// assert_eq!((burn.requested, burn.capacity), (Some(4096), None));
    /// ```
    pub fn from_text(text: &str) -> Evidence {
        let requested = after_any(
            text,
            &[
                "Tried to allocate ",
                "tried to allocate ",
                "allocating ",
                "requested buffer of size ",
            ],
        );
        // This crate: "with F free of T"; PyTorch: "total capacity of T of which F is free".
        let (free, capacity) = match (
            after_any(text, &[" with "]),
            after_any(text, &[" free of "]),
        ) {
            (Some(free), Some(total)) => (Some(free), Some(total)),
            _ => (
                after_any(text, &[" of which "]),
                after_any(text, &["total capacity of "]),
            ),
        };
        let used_at_failure = match (free, capacity) {
            (Some(free), Some(total)) if free <= total => Some(total - free),
            _ => None,
        };
        Evidence {
            requested,
            used_at_failure,
            // Figures that contradict each other (free above total) are not used at all.
            capacity: capacity.filter(|_| used_at_failure.is_some()),
            used_at_start: None,
        }
    }

    /// The figures of an out-of-memory attempt: its error's text first, then the memory
    /// backend's readings (the device's total; the bytes in use before the attempt plus the
    /// attempt's peak). `None` for an attempt that did not run out of memory.
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    /// use batch_size_runtime::{last_report, BatchSizeSearch, SimulatedDevice};
    ///
    /// let device = SimulatedDevice::new(1000);
    /// let _: anyhow::Result<usize> = BatchSizeSearch::new(64)
    ///     .with_release(device.clone())
    ///     .run_dyn(|batch_size| {
    ///         let _weights = device.alloc(200)?;
    ///         let _batch = device.alloc(batch_size as u64 * 20)?;
    ///         Ok(batch_size)
    ///     });
    /// let report = last_report().unwrap();
    /// let first = Evidence::of(report.attempts().next().unwrap()).unwrap();
    /// assert_eq!(first.requested, Some(64 * 20));
    /// assert_eq!(first.used_at_failure, Some(200));
    /// assert_eq!(first.capacity, Some(1000));
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
        if evidence.capacity.is_none() {
            evidence.capacity = at_end.or(at_start).map(|device| device.total);
        }
        evidence.used_at_start = at_start.map(|device| device.total.saturating_sub(device.free));
        if evidence.used_at_failure.is_none() {
            // In use before the attempt outside the pool (other processes, the context), plus
            // the pool's peak during the attempt, which counts what was in the pool at the start.
            evidence.used_at_failure = match (at_start, at_end.and_then(|device| device.peak)) {
                (Some(start), Some(peak)) => Some(
                    start
                        .total
                        .saturating_sub(start.free)
                        .saturating_sub(start.pool_reserved.unwrap_or(0))
                        .saturating_add(peak),
                ),
                _ => None,
            };
        }
        Some(evidence)
    }

    /// Bytes the attempt needed at least: what was in use plus what it asked for.
    ///
    /// ```
    /// use batch_size_runtime::policy::Evidence;
    /// let figures = Evidence::from_text("tried to allocate 1.00 KiB with 0 bytes free of 4.00 KiB");
    /// assert_eq!(figures.needed_at_least(), Some(5 << 10));
    /// ```
    pub fn needed_at_least(&self) -> Option<u64> {
        Some(self.used_at_failure?.saturating_add(self.requested?))
    }
}

/// The byte figure after the first of `markers` found in `text`.
fn after_any(text: &str, markers: &[&str]) -> Option<u64> {
    markers
        .iter()
        .find_map(|marker| text.split_once(marker).map(|(_, rest)| rest))
        .and_then(bytes_at_start)
}

/// "2.00 GiB", "786.00 MiB", "4096 bytes", "4096": the bytes, or `None` for anything else
/// (a negative, NaN or infinite number, an unknown unit).
fn bytes_at_start(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    let number: f64 = words
        .next()?
        .trim_end_matches([',', '.', ';', ')'])
        .parse()
        .ok()?;
    if !number.is_finite() || number < 0.0 {
        return None;
    }
    let unit = words
        .next()
        .map(|unit| unit.trim_end_matches([',', '.', ';', ')']))
        .unwrap_or("");
    let scale: f64 = match unit {
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        // A bare count is bytes (ONNX Runtime: "buffer of size 4096").
        _ => 1.0,
    };
    let bytes = number * scale;
    (bytes < u64::MAX as f64).then_some(bytes.round() as u64)
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
        assert_eq!(ours.capacity, Some(24 << 30));
        assert_eq!(ours.used_at_failure, Some((24 << 30) - (786 << 20)));
    }

    #[test]
    fn bad_figures_are_ignored() {
        assert_eq!(bytes_at_start("NaN GiB"), None);
        assert_eq!(bytes_at_start("inf GiB"), None);
        assert_eq!(bytes_at_start("-3 GiB"), None);
        assert_eq!(bytes_at_start("1e30 TiB"), None);
        // Free above total contradicts itself: neither is used.
        let contradiction =
            Evidence::from_text("tried to allocate 1.00 GiB with 9.00 GiB free of 4.00 GiB");
        assert_eq!(contradiction.capacity, None);
        assert_eq!(contradiction.used_at_failure, None);
        assert_eq!(contradiction.requested, Some(1 << 30));
    }
}
