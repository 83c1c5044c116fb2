//! Growing back after a recovery, for runners that run many times at one size (the steps of an
//! [`EffectiveBatch`](crate::EffectiveBatch), the chunks of a [`Chunked`](crate::Chunked) run):
//! after a number of clean successes, a larger size is tried again, in case the memory that
//! was missing came back (another process ended, a fragmented pool was released).
//!
//! The rule, one for both runners: double, but never to a size that ran out of memory and
//! never above the cap. Where doubling would reach the smallest size that failed, go halfway
//! to it instead: each failure while growing back halves the gap, so the size converges on the
//! largest that fits in a few failures (the gap's log₂), never retrying a size that failed.

/// The grow-back state of one runner.
#[derive(Debug, Clone)]
pub(crate) struct GrowBack {
    /// Clean successes before growing; 0 never grows.
    after: usize,
    clean: usize,
    cap: usize,
    smallest_failed: Option<usize>,
}

impl GrowBack {
    /// Grows after `after` clean successes (0: never), never above `cap`.
    pub(crate) fn new(after: usize, cap: usize) -> Self {
        GrowBack {
            after,
            clean: 0,
            cap,
            smallest_failed: None,
        }
    }

    /// `size` ran out of memory: clean successes are counted afresh, and no size at or above it
    /// is grown to again.
    pub(crate) fn failed(&mut self, size: usize) {
        self.clean = 0;
        self.smallest_failed = Some(self.smallest_failed.map_or(size, |known| known.min(size)));
    }

    /// `size` succeeded: the size to run next (`size` itself, or a larger one).
    pub(crate) fn succeeded(&mut self, size: usize) -> usize {
        if self.after == 0 {
            return size;
        }
        self.clean += 1;
        if self.clean < self.after {
            return size;
        }
        let ceiling = self
            .smallest_failed
            .map_or(self.cap, |failed| failed.saturating_sub(1).min(self.cap));
        let doubled = size.saturating_mul(2);
        let next = match self.smallest_failed {
            Some(failed) if doubled >= failed => size + (failed.saturating_sub(size)) / 2,
            _ => doubled,
        }
        .min(ceiling);
        if next > size {
            // A grown size counts its own clean successes.
            self.clean = 0;
            next
        } else {
            size
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GrowBack;

    #[test]
    fn doubles_then_bisects_toward_the_smallest_failure_and_never_reaches_it() {
        let mut grow = GrowBack::new(2, 1000);
        assert_eq!(grow.succeeded(16), 16);
        assert_eq!(grow.succeeded(16), 32);
        assert_eq!(grow.succeeded(32), 32);
        assert_eq!(grow.succeeded(32), 64);
        grow.failed(64);
        // Back at 32 (the shrinking policy's choice): halfway to 64, not 64 again.
        assert_eq!(grow.succeeded(32), 32);
        assert_eq!(grow.succeeded(32), 48);
        assert_eq!(grow.succeeded(48), 48);
        assert_eq!(grow.succeeded(48), 56);
        grow.failed(56);
        assert_eq!(grow.succeeded(48), 48);
        assert_eq!(grow.succeeded(48), 52);
        grow.failed(52);
        assert_eq!(grow.succeeded(48), 48);
        assert_eq!(grow.succeeded(48), 50);
        grow.failed(51);
        grow.succeeded(50);
        // 50 and 51: nothing left between them.
        assert_eq!(grow.succeeded(50), 50);
        assert_eq!(grow.succeeded(50), 50);
    }

    #[test]
    fn never_above_the_cap_and_never_when_off() {
        let mut capped = GrowBack::new(1, 20);
        assert_eq!(capped.succeeded(8), 16);
        assert_eq!(capped.succeeded(16), 20);
        assert_eq!(capped.succeeded(20), 20);
        let mut off = GrowBack::new(0, 1000);
        for _ in 0..10 {
            assert_eq!(off.succeeded(8), 8);
        }
    }
}
