//! The loop's driver: runs the protocol for one search given how the attempt's return type is
//! classified and how it gives up ([`dispatch`](crate::dispatch)). The builder's `run*` methods
//! and the attribute's generated code are a few lines around [`Driver::begin`] and
//! [`Driver::settle`]:
//!
//! ```text
//! let mut driver = Driver::new(search, classify, give_up);
//! loop {
//!     let batch_size = match driver.begin() { Ok(size) => size, Err(no_size) => return no_size };
//!     if let Some(value) = driver.settle(catch_attempt(|| body(batch_size))) { return value; }
//! }
//! ```

use std::fmt;

use super::{BatchSizeSearch, Search};
use crate::dispatch::{Classify, GiveUp, Judged, UsableKind};
use crate::record::SearchReport;
use crate::unwind::PanicPayload;

/// Runs one search over attempts that return `R`: what to do with each outcome, and what the
/// function returns when no size fits. Generic code reaches it through the builder's `run*`
/// methods or the attribute.
pub struct Driver<'r, R, C: Classify<R>, G> {
    search: Search<'r>,
    classify: C,
    give_up: G,
    /// The latest success's value, while a policy that continues after a success runs on; it
    /// is returned if the policy accepts after a later failure.
    held: Option<R>,
    /// The last out-of-memory error itself, where the function gives up by returning it.
    last_error: Option<C::Error>,
}

impl<R, C: Classify<R>, G> fmt::Debug for Driver<'_, R, C, G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("search", &self.search)
            .finish_non_exhaustive()
    }
}

impl<'r, R, C, G> Driver<'r, R, C, G>
where
    C: Classify<R>,
    G: GiveUp<R, Error = C::Error>,
{
    /// Starts `search`, whose attempts are classified by `classify`; when no size fits, the
    /// function's value comes from `give_up`.
    #[inline]
    pub fn new(search: BatchSizeSearch<'r>, classify: C, give_up: G) -> Self
    where
        C: UsableKind,
    {
        Driver {
            search: search.start(),
            classify,
            give_up,
            held: None,
            last_error: None,
        }
    }

    /// The next attempt's size, or the value the function returns because no size fits.
    #[inline]
    pub fn begin(&mut self) -> Result<usize, G::Output> {
        self.search
            .begin()
            .map_err(|none_fit| self.give_up.give_up(none_fit, self.last_error.take()))
    }

    /// Records how an attempt ended: `Some(value)` ends the search with what the function
    /// returns; `None` means run [`begin`](Self::begin) again.
    #[inline]
    pub fn settle(&mut self, outcome: Result<R, PanicPayload>) -> Option<R> {
        match outcome {
            Ok(value) => match self.classify.judge(value, &self.search) {
                Judged::Succeeded(value) => {
                    self.search.succeeded();
                    if self.search.is_accepted() {
                        return Some(value);
                    }
                    self.held = Some(value);
                    None
                }
                Judged::Failed(value, description) => {
                    self.search.failed_with(description);
                    Some(value)
                }
                Judged::OutOfMemory(found, error) => {
                    let kept = match error {
                        Some(error) if self.give_up.returns_last_error() => {
                            self.last_error = Some(error);
                            None
                        }
                        Some(error) => self.classify.keep(error),
                        None => None,
                    };
                    self.search.record_out_of_memory(found, kept);
                    self.accepted_value()
                }
            },
            Err(payload) => {
                self.search.panicked(payload);
                self.accepted_value()
            }
        }
    }

    /// After a failure, a policy may accept the latest success (a tuner that has bracketed the
    /// limit): its value is the function's.
    fn accepted_value(&mut self) -> Option<R> {
        if self.search.is_accepted() {
            self.held.take()
        } else {
            None
        }
    }

    /// Keeps the report in the driver instead of handing it to `last_report()`.
    pub(crate) fn keep_report(&mut self) {
        self.search.keep_report();
    }

    /// The report kept by [`keep_report`](Self::keep_report).
    pub(crate) fn take_report(&mut self) -> SearchReport {
        self.search.take_report()
    }
}
