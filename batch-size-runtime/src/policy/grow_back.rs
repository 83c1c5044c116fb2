//! Growing back after a recovery, for runners that run many times at one size (the steps of an
//! [`EffectiveBatch`](crate::EffectiveBatch), the chunks of a [`Chunked`](crate::Chunked) run):
//! after a number of clean successes, a larger size is tried again, in case the memory that
//! was missing came back (another process ended, a fragmented pool was released).
//!
//! The rule, one for both runners: double, but never to a size that ran out of memory and
//! never above the cap. Where doubling would reach the smallest size that failed, go halfway
//! to it instead: each failure while growing back halves the gap, so the size converges on the
//! largest that fits in a few failures (the gap's log₂). A failure is remembered until it has
//! held growth back [`FORGET_AFTER`] times: the memory missing then (a spike, another
//! process, fragmentation) may be back, and a long run must not shrink for good, failure after
//! transient failure, until no size is left. Then that very size is tried once: if it fits,
//! growing goes on as before; if it fails again, it is remembered twice as long (a limit that
//! stays costs one failure per 16, 32, 64, ... growth steps).

/// Growth steps a remembered failure first holds back before that size is tried again.
pub(crate) const FORGET_AFTER: usize = 16;

/// The grow-back state of one runner.
#[derive(Debug, Clone)]
pub(crate) struct GrowBack {
    /// Clean successes before growing; 0 never grows.
    after: usize,
    clean: usize,
    cap: usize,
    smallest_failed: Option<usize>,
    /// Growth steps the remembered failure has held back.
    held_back: usize,
    /// Growth steps it holds back before that size is tried again: doubles each time the retry
    /// fails.
    patience: usize,
    /// The failed size being tried again.
    retrying: Option<usize>,
}

impl GrowBack {
    /// Grows after `after` clean successes (0: never), never above `cap`.
    pub(crate) fn new(after: usize, cap: usize) -> Self {
        GrowBack {
            after,
            clean: 0,
            cap,
            smallest_failed: None,
            held_back: 0,
            patience: FORGET_AFTER,
            retrying: None,
        }
    }

    /// `size` ran out of memory: clean successes are counted afresh, and no size at or above it
    /// is grown to again.
    pub(crate) fn failed(&mut self, size: usize) {
        self.clean = 0;
        self.held_back = 0;
        if self.retrying.take().is_some_and(|retried| size >= retried) {
            // The limit is still there: wait twice as long before the next try.
            self.patience = self.patience.saturating_mul(2);
        }
        self.smallest_failed = Some(self.smallest_failed.map_or(size, |known| known.min(size)));
    }

    /// `size` succeeded: the size to run next (`size` itself, or a larger one).
    pub(crate) fn succeeded(&mut self, size: usize) -> usize {
        if self.after == 0 {
            return size;
        }
        if self.retrying.is_some_and(|retried| size >= retried) {
            // A size that failed fits now: the memory is back.
            self.retrying = None;
            self.patience = FORGET_AFTER;
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
            if let Some(failed) = self.smallest_failed.filter(|_| size < self.cap) {
                self.held_back += 1;
                if self.held_back >= self.patience {
                    // Long enough below it: that failure may have been the moment's. Try that
                    // very size once.
                    self.smallest_failed = None;
                    self.held_back = 0;
                    self.clean = 0;
                    self.retrying = Some(failed);
                    return failed.min(self.cap).max(size);
                }
            }
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
    fn a_failure_is_forgotten_after_holding_growth_back_long_enough() {
        let mut grow = GrowBack::new(1, 64);
        grow.failed(8);
        assert_eq!(grow.succeeded(4), 6);
        assert_eq!(grow.succeeded(6), 7);
        // 7 is as close to 8 as it gets: growth is held back...
        for _ in 0..super::FORGET_AFTER - 1 {
            assert_eq!(grow.succeeded(7), 7);
        }
        // ...until the failure is forgotten, and 8 itself is tried once.
        assert_eq!(grow.succeeded(7), 8);
        // It fits: growing goes on from there.
        assert_eq!(grow.succeeded(8), 16);

        // A limit that stays: each retry fails, and the next comes twice as late.
        let mut grow = GrowBack::new(1, 64);
        grow.failed(8);
        let mut retries = Vec::new();
        let mut size = 4;
        for step in 0..200 {
            let next = grow.succeeded(size);
            if next >= 8 {
                retries.push(step);
                grow.failed(next);
                size = 7;
            } else {
                size = next;
            }
        }
        let gaps: Vec<usize> = retries.windows(2).map(|pair| pair[1] - pair[0]).collect();
        assert!(gaps.windows(2).all(|pair| pair[1] > pair[0]), "{retries:?}");
        assert!(retries.len() <= 4, "{retries:?}");
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
