//! Growing back after a recovery, for runners that run many times at one size (the steps of an
//! [`EffectiveBatch`](crate::EffectiveBatch), the chunks of a [`Chunked`](crate::Chunked) run):
//! after a number of clean successes, a larger size is tried again, in case the memory that
//! was missing came back (another process ended, a fragmented pool was released).
//!
//! The rule, one for both runners, deepmd's: double while twice the size stays below the
//! smallest size that ran out of memory, and never above the cap, so that growing back fails at
//! most once a size. (Going halfway to the failure instead was tried: on `embed_corpus`, whose
//! chunks already sat at the device's limit, it spent five more failed chunks out of 29 for
//! nothing.) A failure is remembered until it has
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

    /// The failures so far ran under other settings (a remedy was applied): none of them bounds
    /// the growth any longer.
    pub(crate) fn forget_failures(&mut self) {
        *self = GrowBack::new(self.after, self.cap);
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

    /// The smallest size remembered to have run out of memory.
    pub(crate) fn smallest_failed(&self) -> Option<usize> {
        self.smallest_failed
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
        let doubled = size.saturating_mul(2);
        let next = match self.smallest_failed {
            Some(failed) if doubled >= failed => size,
            _ => doubled.min(self.cap),
        };
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
    fn doubles_while_twice_the_size_stays_below_the_smallest_failure() {
        let mut grow = GrowBack::new(2, 1000);
        assert_eq!(grow.succeeded(16), 16);
        assert_eq!(grow.succeeded(16), 32);
        assert_eq!(grow.succeeded(32), 32);
        assert_eq!(grow.succeeded(32), 64);
        grow.failed(64);
        // Back at 32 (the shrinking policy's choice): twice 32 is not below 64, so it stays.
        for _ in 0..10 {
            assert_eq!(grow.succeeded(32), 32);
        }
        // Lower, it doubles again, as far as below the failure.
        let mut grow = GrowBack::new(1, 1000);
        grow.failed(64);
        assert_eq!(grow.succeeded(16), 32);
        assert_eq!(grow.succeeded(32), 32);
    }

    #[test]
    fn a_failure_is_forgotten_after_holding_growth_back_long_enough() {
        let mut grow = GrowBack::new(1, 64);
        grow.failed(8);
        // Twice 4 is not below 8: growth is held back...
        for _ in 0..super::FORGET_AFTER - 1 {
            assert_eq!(grow.succeeded(4), 4);
        }
        // ...until the failure is forgotten, and 8 itself is tried once.
        assert_eq!(grow.succeeded(4), 8);
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
                size = 4;
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
