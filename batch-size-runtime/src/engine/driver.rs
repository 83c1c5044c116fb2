//! The one door into the engine: [`drive`] and [`drive_async`] run a search's loop (begin an
//! attempt, run it under `catch_unwind`, classify its outcome, record it, release memory, let
//! the policy decide) for every runner and for the attribute's generated code. How an
//! attempt's value is classified and what comes back when no size fits are the two kinds of
//! [`dispatch`](crate::engine::dispatch); every runner leaves through the same typed [`Ended`].

use std::fmt;
use std::future::Future;

use super::{step, Search};
use crate::attempt::InspectableError;
use crate::engine::dispatch::{Classify, GiveUp, Judged, LastError};
use crate::error::NoExecutableBatchSize;
use crate::record::{self, SearchReport};
use crate::unwind::{self, CatchUnwind, PanicPayload};

/// How a search ended, for a runner: never a downcast to tell "no size fits" from "the
/// closure failed".
#[derive(Debug)]
pub(crate) enum Ended<R, E> {
    /// The attempt's own value: the accepted success, or an error that is not out-of-memory,
    /// unchanged.
    Returned(R),
    /// No size fits; the last out-of-memory error itself where it was asked for.
    NoSizeFits(NoExecutableBatchSize, Option<E>),
}

/// What leaves the loop: how the search ended, and its report, as values. Only a public edge
/// publishes the report for [`last_report()`](crate::last_report); a runner reads it here.
#[derive(Debug)]
pub(crate) struct Finished<R, E> {
    pub(crate) ended: Ended<R, E>,
    pub(crate) report: SearchReport,
}

impl<R, E> Finished<R, E> {
    /// For a public edge: the report goes to `last_report()`, how the search ended to the
    /// caller.
    #[inline]
    pub(crate) fn published(self) -> Ended<R, E> {
        record::store_last_report(self.report);
        self.ended
    }
}

/// Runs the search: the attempt's value, or `give_up`'s when no size fits. What the attribute
/// expands into (through `drive_attempts!`, which picks `classify` and `give_up` from the return type).
#[inline]
pub fn drive<R, C, G>(
    search: Search<'_>,
    classify: C,
    give_up: G,
    attempt: impl FnMut(usize) -> R,
) -> R
where
    C: Classify<R>,
    C::Error: InspectableError,
    G: GiveUp<R, Error = C::Error, Output = R>,
{
    // The public edge: the report goes from the search to `last_report()`.
    let ended = drive_ended(search, &classify, give_up.last_error(), attempt).published();
    returned_or_given_up(ended, &give_up)
}

/// [`drive`] for a runner that reads the report itself: the value and the report, nothing
/// published.
#[inline]
pub(crate) fn drive_reporting<R, C, G>(
    search: Search<'_>,
    classify: C,
    give_up: G,
    attempt: impl FnMut(usize) -> R,
) -> (R, SearchReport)
where
    C: Classify<R>,
    G: GiveUp<R, Error = C::Error, Output = R>,
{
    let Finished { ended, report } = drive_ended(search, &classify, give_up.last_error(), attempt);
    (returned_or_given_up(ended, &give_up), report)
}

/// The async form of [`drive`]: `attempt` is a closure returning a future ([`Returning`]) or
/// an async closure ([`Lending`]), whose panics are caught like a synchronous attempt's.
#[inline]
pub async fn drive_async<R, C, G>(
    search: Search<'_>,
    classify: C,
    give_up: G,
    attempt: impl AsyncAttempt<R>,
) -> R
where
    C: Classify<R>,
    C::Error: InspectableError,
    G: GiveUp<R, Error = C::Error, Output = R>,
{
    let ended = drive_ended_async(search, &classify, give_up.last_error(), attempt)
        .await
        .published();
    returned_or_given_up(ended, &give_up)
}

#[inline]
fn returned_or_given_up<R, E, G: GiveUp<R, Error = E, Output = R>>(
    ended: Ended<R, E>,
    give_up: &G,
) -> R {
    match ended {
        Ended::Returned(value) => value,
        Ended::NoSizeFits(none_fit, last) => give_up.give_up(none_fit, last),
    }
}

/// The loop, for runners that act on how the search ended: its end and its report, as values.
#[inline]
pub(crate) fn drive_ended<R, C: Classify<R>>(
    mut search: Search<'_>,
    classify: &C,
    last_error: LastError,
    attempt: impl FnMut(usize) -> R,
) -> Finished<R, C::Error> {
    let ended = run_loop(&mut search, classify, last_error, attempt);
    let report = search.take_report();
    Finished { ended, report }
}

/// The async loop, for runners that act on how the search ended.
pub(crate) async fn drive_ended_async<R, C: Classify<R>>(
    mut search: Search<'_>,
    classify: &C,
    last_error: LastError,
    attempt: impl AsyncAttempt<R>,
) -> Finished<R, C::Error> {
    let ended = run_loop_async(&mut search, classify, last_error, attempt).await;
    let report = search.take_report();
    Finished { ended, report }
}

/// The one loop: begin an attempt, run it under `catch_unwind`, record how it ended, until the
/// search ends. The report stays in the search, for the caller to take or publish.
#[inline]
fn run_loop<R, C: Classify<R>>(
    search: &mut Search<'_>,
    classify: &C,
    last_error: LastError,
    mut attempt: impl FnMut(usize) -> R,
) -> Ended<R, C::Error> {
    let mut driver = Driver::new(search, classify, last_error);
    loop {
        let batch_size = match driver.begin() {
            Ok(batch_size) => batch_size,
            Err(ended) => return ended,
        };
        let watch = driver.search.step_watch();
        let outcome = step::watching(watch, || unwind::catch_attempt(|| attempt(batch_size)));
        if let Some(ended) = driver.record(outcome) {
            return ended;
        }
    }
}

/// [`run_loop`] over attempts that return futures.
async fn run_loop_async<R, C: Classify<R>>(
    search: &mut Search<'_>,
    classify: &C,
    last_error: LastError,
    mut attempt: impl AsyncAttempt<R>,
) -> Ended<R, C::Error> {
    let mut driver = Driver::new(search, classify, last_error);
    loop {
        let batch_size = match driver.begin() {
            Ok(batch_size) => batch_size,
            Err(ended) => return ended,
        };
        let watch = driver.search.step_watch();
        let attempt = step::Watched::new(attempt.start(batch_size), watch);
        if let Some(ended) = driver.record(CatchUnwind::new(attempt).await) {
            return ended;
        }
    }
}

/// An attempt of an async search. Two forms, because rustc cannot yet prove the future of a
/// generic async closure `Send` (rust-lang/rust#110338): a closure that returns a future
/// ([`Returning`]), which keeps the search's future `Send` when the attempt's is, and an
/// async closure ([`Lending`]), which may lend its captures (`&mut self`) to each attempt.
pub trait AsyncAttempt<R> {
    /// Starts the attempt at `batch_size`.
    fn start(&mut self, batch_size: usize) -> impl Future<Output = R>;
}

/// A closure that returns a future, as an `AsyncAttempt`.
#[derive(Debug)]
pub struct Returning<F>(pub F);

impl<R, F, Fut> AsyncAttempt<R> for Returning<F>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = R>,
{
    #[inline]
    fn start(&mut self, batch_size: usize) -> impl Future<Output = R> {
        (self.0)(batch_size)
    }
}

/// An async closure, as an `AsyncAttempt`.
#[derive(Debug)]
pub struct Lending<F>(pub F);

impl<R, F: AsyncFnMut(usize) -> R> AsyncAttempt<R> for Lending<F> {
    #[inline]
    fn start(&mut self, batch_size: usize) -> impl Future<Output = R> {
        (self.0)(batch_size)
    }
}

/// One search over attempts that return `R`, between attempts.
/// It borrows the search rather than holding it: the search is large, and moving it into the
/// driver would copy it on every call, the success path included.
struct Driver<'s, 'r, 'c, R, C: Classify<R>> {
    search: &'s mut Search<'r>,
    classify: &'c C,
    last_error_kept: LastError,
    /// The latest success's value, while a policy that continues after a success runs on; it
    /// is returned if the policy accepts after a later failure.
    latest_success: Option<R>,
    /// The last out-of-memory error itself, where the caller gives up by returning it.
    last_error: Option<C::Error>,
}

impl<R, C: Classify<R>> fmt::Debug for Driver<'_, '_, '_, R, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("search", &self.search)
            .finish_non_exhaustive()
    }
}

impl<'s, 'r, 'c, R, C: Classify<R>> Driver<'s, 'r, 'c, R, C> {
    #[inline]
    fn new(search: &'s mut Search<'r>, classify: &'c C, last_error_kept: LastError) -> Self {
        Driver {
            search,
            classify,
            last_error_kept,
            latest_success: None,
            last_error: None,
        }
    }

    /// The next attempt's size, or how the search ended because no size is left.
    #[inline]
    fn begin(&mut self) -> Result<usize, Ended<R, C::Error>> {
        self.search
            .begin_attempt()
            .map_err(|none_fit| Ended::NoSizeFits(none_fit, self.last_error.take()))
    }

    /// Records how an attempt ended: `Some` ends the search; `None` means begin again.
    #[inline]
    fn record(&mut self, outcome: Result<R, PanicPayload>) -> Option<Ended<R, C::Error>> {
        let grown = self.search.asked_to_grow();
        match outcome {
            Ok(value) => match self.classify.judge(value, &self.search.rules()) {
                // `step_done` answered `Grow`: whatever the function returned but an error of
                // its own or an out-of-memory, the attempt grew.
                Judged::Succeeded(_) | Judged::Grew(..) if grown.is_some() => {
                    if let Some(grown) = grown {
                        self.search.record_growth(grown);
                    }
                    self.accepted_value()
                }
                Judged::Failed(_, description)
                    if grown
                        .as_ref()
                        .is_some_and(|grown| description.contains(&grown.signal().to_string())) =>
                {
                    // An error that holds the `Grow` where no chain reaches it (candle's
                    // `Error::wrap`, an `E: Display`): found by the signal's own words.
                    if let Some(grown) = grown {
                        self.search.record_growth(grown);
                    }
                    self.accepted_value()
                }
                Judged::Succeeded(value) => {
                    self.search.record_success();
                    if self.search.is_accepted() {
                        return Some(Ended::Returned(value));
                    }
                    self.latest_success = Some(value);
                    None
                }
                Judged::Failed(value, description) | Judged::Grew(value, description) => {
                    self.search.failed_with(description);
                    Some(Ended::Returned(value))
                }
                Judged::OutOfMemory(found, error) => {
                    let kept = match error {
                        Some(error) if self.last_error_kept == LastError::Returned => {
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
                self.search.record_panic(payload);
                self.accepted_value()
            }
        }
    }

    /// After a failure, a policy may accept the latest success (a tuner that has bracketed the
    /// limit): its value is the caller's.
    fn accepted_value(&mut self) -> Option<Ended<R, C::Error>> {
        if self.search.is_accepted() {
            self.latest_success.take().map(Ended::Returned)
        } else {
            None
        }
    }
}
