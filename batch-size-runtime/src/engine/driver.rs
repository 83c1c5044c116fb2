//! The one door into the engine: [`drive`] and [`drive_async`] run a search's loop for every
//! runner and the attribute's code, with [`dispatch`](crate::engine::dispatch)'s two kinds.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::step::{self, StepWatch};
use super::Search;
use crate::attempt::InspectableError;
use crate::engine::dispatch::{Classify, GiveUp, Judged, LastError};
use crate::error::NoExecutableBatchSize;
use crate::record::{self, SearchReport};
use crate::unwind::{self, CatchUnwind, PanicPayload};

/// How a search ended, for a runner (no downcast tells "no size fits" from "the closure failed").
#[derive(Debug)]
pub(crate) enum Ended<R, E> {
    /// The attempt's own value: the accepted success, or an error that is not out-of-memory.
    Returned(R),
    /// No size fits; the last out-of-memory error itself where it was asked for.
    NoSizeFits(NoExecutableBatchSize, Option<E>),
}

/// What leaves the loop: how the search ended, and its report (published only by a public edge).
#[derive(Debug)]
pub(crate) struct Finished<R, E> {
    pub(crate) ended: Ended<R, E>,
    pub(crate) report: SearchReport,
}

impl<R, E> Finished<R, E> {
    /// For a public edge: the report goes to `last_report()`, how the search ended to the caller.
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

/// [`drive`] for a runner that reads the report itself: the value and the report, unpublished.
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

/// The one loop: begin an attempt, run it under `catch_unwind`, record how it ended.
#[inline]
fn run_loop<R, C: Classify<R>>(
    search: &mut Search<'_>,
    classify: &C,
    last_error: LastError,
    mut attempt: impl FnMut(usize) -> R,
) -> Ended<R, C::Error> {
    let mut driver = Driver::new(search, classify, last_error);
    loop {
        let (batch_size, watch) = match driver.begin() {
            Ok(next) => next,
            Err(ended) => return ended,
        };
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
        let (batch_size, watch) = match driver.begin() {
            Ok(next) => next,
            Err(ended) => return ended,
        };
        let attempt = step::Watched::new(attempt.start(batch_size), watch);
        if let Some(ended) = driver.record(CatchUnwind::new(attempt).await) {
            return ended;
        }
    }
}

/// An attempt of an async search: a closure returning a future ([`Returning`], whose future can
/// be proved `Send`, rust-lang/rust#110338) or an async closure ([`Lending`], lending `&mut self`).
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

/// The running attempt's step watch, if any.
type Watch = Option<Arc<StepWatch>>;

/// One search over attempts that return `R`; it borrows the search, which is too large to move.
struct Driver<'s, 'r, 'c, R, C: Classify<R>> {
    search: &'s mut Search<'r>,
    classify: &'c C,
    last_error_kept: LastError,
    /// The latest success's value, returned if the policy accepts after a later failure.
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

    /// The next attempt's size and step watch, or how the search ended because no size is left.
    #[inline]
    fn begin(&mut self) -> Result<(usize, Watch), Ended<R, C::Error>> {
        match self.search.begin_attempt() {
            Ok(batch_size) => Ok((batch_size, self.search.step_watch())),
            Err(none_fit) => Err(Ended::NoSizeFits(none_fit, self.last_error.take())),
        }
    }

    /// Records how an attempt ended: `Some` ends the search; `None` means begin again.
    #[inline]
    fn record(&mut self, outcome: Result<R, PanicPayload>) -> Option<Ended<R, C::Error>> {
        let grown = self.search.asked_to_grow();
        let value = match outcome {
            Ok(value) => value,
            Err(payload) => {
                self.search.record_panic(payload);
                return self.accepted_value();
            }
        };
        let judged = self.classify.judge(value, &self.search.rules());
        // `step_done` answered `Grow`: whatever the function returned but an error of its own or
        // an out-of-memory, the attempt grew. An error that holds the `Grow` where no chain
        // reaches it (candle's `Error::wrap`, an `E: Display`) is found by the signal's words.
        let grew = grown.filter(|grown| match &judged {
            Judged::Succeeded(_) | Judged::Grew(..) => true,
            Judged::Failed(_, description) => description.contains(&grown.signal().to_string()),
            Judged::OutOfMemory(..) => false,
        });
        if let Some(grown) = grew {
            self.search.record_growth(grown);
            return self.accepted_value();
        }
        match judged {
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
        }
    }

    /// After a failure, the latest success's value, where the policy accepts it (a tuner).
    fn accepted_value(&mut self) -> Option<Ended<R, C::Error>> {
        if self.search.is_accepted() {
            self.latest_success.take().map(Ended::Returned)
        } else {
            None
        }
    }
}
