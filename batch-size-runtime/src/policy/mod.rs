//! How sizes are chosen: a [`SizePolicy`] decides the first size and, after every attempt,
//! whether to try another size, accept, or stop. The engine runs the attempts and applies what
//! is common to every policy.
//!
//! The engine owns the loop: it runs each attempt (catching panics), classifies its outcome,
//! releases memory after an out-of-memory failure, reads the memory figures, logs, and keeps
//! the report. A policy owns only the choice, and sees every attempt so far. Whatever a policy
//! proposes, the engine holds it to the same rules:
//! - never below `min` ([`StopReason::BelowMinimum`]), never 0 ([`StopReason::ReachedZero`]);
//! - never a size at or above one that already ran out of memory in this search
//!   ([`StopReason::NotSmaller`]);
//! - at most `max_attempts` attempts ([`StopReason::MaxAttempts`]);
//! - [`Decision::Accept`] ends the search with the value of the latest successful attempt, so it
//!   needs one ([`StopReason::NothingToAccept`] otherwise).
//!
//! The policies here: [`Guided`] (the default: the next size estimated from each failure's
//! figures), [`Halve`], [`Factor`] and [`Reduce`] (the `reduce = ...` closure).
//!
//! # Writing a policy
//! A policy that shrinks implements [`after`](SizePolicy::after) for out-of-memory attempts and
//! accepts the first success. Start at `starting`, then try 3/4 of the last failure:
//!
//! ```
//! use batch_size_runtime::policy::{Decision, SizePolicy};
//! use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Outcome, SearchReport};
//!
//! #[derive(Debug)]
//! struct ThreeQuarters;
//!
//! impl SizePolicy for ThreeQuarters {
//!     fn after(&mut self, history: &SearchReport) -> Decision {
//!         match history.last() {
//!             Some(last) if last.outcome == Outcome::Succeeded => Decision::Accept,
//!             Some(last) => Decision::Try(last.batch_size * 3 / 4),
//!             None => Decision::Accept, // not called before an attempt
//!         }
//!     }
//! }
//!
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(100)
//!     .with_policy(ThreeQuarters)
//!     .run(|batch_size| {
//!         if batch_size > 50 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
//!     });
//! assert_eq!(fitted.unwrap(), 42); // 100, 75, 56, 42
//! ```
//!
//! A policy that grows (a tuner) tries larger sizes after each success and accepts once it has
//! bracketed the limit; the engine still refuses any size at or above one that failed. Double
//! from 1 until out of memory, then accept the largest size that ran:
//!
//! ```
//! use batch_size_runtime::policy::{Decision, SizePolicy};
//! use batch_size_runtime::{BatchSizeSearch, OutOfMemory, Outcome, SearchReport};
//!
//! #[derive(Debug)]
//! struct Doubling;
//!
//! impl SizePolicy for Doubling {
//!     fn first(&mut self, _starting: usize) -> Decision {
//!         Decision::Try(1)
//!     }
//!     fn after(&mut self, history: &SearchReport) -> Decision {
//!         match history.last() {
//!             Some(last) if last.outcome == Outcome::Succeeded => Decision::Try(last.batch_size * 2),
//!             _ => Decision::Accept, // the value of the latest success comes back
//!         }
//!     }
//! }
//!
//! let fitted: Result<usize, anyhow::Error> = BatchSizeSearch::new(1)
//!     .with_policy(Doubling)
//!     .run(|batch_size| {
//!         if batch_size > 20 { Err(OutOfMemory::new().into()) } else { Ok(batch_size) }
//!     });
//! assert_eq!(fitted.unwrap(), 16); // 1, 2, 4, 8, 16 ran; 32 did not
//! ```
//!
//! Other shapes build on the same two methods without touching the engine:
//! - work that succeeds many times (chunks of a dataset, training steps) answers `Try(next)`
//!   after each success until the work is done, then `Accept`; the attempt closure keeps its
//!   own progress;
//! - a wrapper that makes several processes agree holds another policy, exchanges each
//!   outcome with the other ranks before calling the inner policy with the shared verdict, and
//!   proposes the smallest of the ranks' sizes.

use std::fmt;

use crate::error::StopReason;
use crate::record::SearchReport;

mod cache;

mod guided;
mod model;
mod remediate;
mod shrink;
mod wrapper;

pub use cache::{clear_process_cache, CacheEntry, CACHE_DIR_VARIABLE};
pub(crate) use cache::{CacheSettings, CacheSlot, Cached};

pub use guided::Guided;
pub(crate) use model::reached_by_failures;
pub(crate) use model::{figures_of, grown_size, growth_shown, measured_step, GROWN_KEEP};
pub(crate) use remediate::{Applied, LadderControl, Remediate};
pub use shrink::{Factor, FailedAttempt, Halve, Reduce, Reduction};
pub(crate) use wrapper::{holds_inner, PolicyWrapper};

/// What a policy wants after an attempt (or before the first).
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Run an attempt with this size.
    Try(usize),
    /// End the search with the value of the latest successful attempt.
    Accept,
    /// End the search without a size.
    Stop(StopReason),
}

/// Chooses the batch size of each attempt from the history of the search.
///
/// The engine calls [`first`](Self::first) once, then [`after`](Self::after) after every attempt
/// that succeeded or ran out of memory (an error or panic that is not out-of-memory ends the
/// search without asking). See the [module docs](self) for the rules the engine adds and for
/// examples of a shrinking and a growing policy.
pub trait SizePolicy: Send + fmt::Debug {
    /// The first size to try, given the search's `starting` (default: `starting` itself).
    fn first(&mut self, starting: usize) -> Decision {
        Decision::Try(starting)
    }

    /// What to do after the attempt that just ended, the last of `history`.
    fn after(&mut self, history: &SearchReport) -> Decision;

    /// The attempt that just ended (the last of `history`) failed with an error or a panic that
    /// is not out-of-memory: the search ends and returns it, whatever the policy says. A wrapper
    /// that makes several processes agree tells the other ranks here, so that none waits for
    /// this one.
    fn ended_by_failure(&mut self, history: &SearchReport) {
        let _ = history;
    }

    /// Why this policy cannot run as configured, if it cannot: the search stops before its
    /// first attempt with [`StopReason::InvalidConfiguration`].
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Whether the policy ends the search at every success (a shrinking policy): the engine
    /// then skips asking it after one, which keeps the success path short, and the cache
    /// knows a cached size is a size to run, not a size to grow from.
    fn accepts_every_success(&self) -> bool {
        false
    }

    /// Whether the attempt after a success runs other work (the next chunk) rather than the
    /// same work at another size (a tuner's trial). The engine's rule "never a size at or above
    /// one that ran out of memory" then counts the failures since the last success only: in a
    /// long run, a transient out-of-memory (a spike, fragmentation) must not lower the ceiling
    /// for good, chunk after chunk, until no size is left.
    fn each_success_is_new_work(&self) -> bool {
        false
    }

    /// Whether the engine should read the memory figures after a successful attempt too
    /// (a tuner fitting memory against the size needs them; a shrinking policy does not, and
    /// the success path stays free of device queries).
    fn reads_memory_after_success(&self) -> bool {
        false
    }

    /// A line on how the latest decision was reached (an estimate, a fitted limit), shown in
    /// the retry's log and kept on the next attempt's record.
    fn rationale(&self) -> Option<String> {
        None
    }

    /// No size is left: the last attempt ran out of memory and `reason` would end the search
    /// (below `min`, no smaller size, the policy's own stop). A policy that can change what the
    /// attempts run under besides the size (a remedy: activation checkpointing, lower
    /// precision, a shorter context, see [`Remedies`](crate::remedies::Remedies)) changes it here and
    /// answers `Try` with the first size to try under the new settings. The engine then forgets
    /// the sizes that failed before: they ran under other settings. `Stop` ends the search with
    /// the reason given (the one passed in, or one that says more). Default: `Stop(reason)`.
    fn no_size_left(&mut self, reason: StopReason, history: &SearchReport) -> Decision {
        let _ = history;
        Decision::Stop(reason)
    }

    /// Whether every size this policy proposes is agreed with other ranks (the agreement
    /// between ranks wraps it): the engine then never runs a size of its own choosing, such as
    /// the retry of a size whose pool held memory from earlier work, which the other ranks
    /// would not run. Default: `false`.
    fn agrees_with_others(&self) -> bool {
        false
    }

    /// The remedies the next attempt runs under, kept on its record
    /// ([`Attempt::remedies`](crate::Attempt::remedies)). Default: `None`.
    fn remedies_in_force(&self) -> Option<String> {
        None
    }

    /// How the attempt about to run may grow once its first step ran: a rule from the step (its
    /// size, and its figures, [`StepFigures`], where the release read them) to a larger size to
    /// run the function at instead, or `None` to leave the attempt alone. Asked before each
    /// attempt, where
    /// the function reports its steps with [`step_done`](crate::step_done); the engine grows
    /// only to a size a few percent larger than the attempt's, below every size that failed,
    /// within `max` and the attempts left. Default: `None` (no growing).
    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        let _ = history;
        None
    }
}

/// What the first step of an attempt measured, for [`SizePolicy::grow_after_a_step`]'s rule:
/// the attempt's own bytes, what was in use before it left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepFigures {
    /// The attempt's batch size.
    pub batch_size: usize,
    /// The most bytes the attempt held at once up to the end of its first step.
    pub peak: u64,
    /// The bytes the attempt could use: the device's total less what was in use before it.
    pub room: u64,
}

impl StepFigures {
    /// The figures of a step at `batch_size` that peaked at `peak` bytes of `room`.
    ///
    /// ```
    /// use batch_size_runtime::policy::StepFigures;
    /// let step = StepFigures::new(64, 8 << 30, 16 << 30);
    /// assert_eq!((step.batch_size, step.peak, step.room), (64, 8 << 30, 16 << 30));
    /// ```
    pub fn new(batch_size: usize, peak: u64, room: u64) -> Self {
        StepFigures {
            batch_size,
            peak,
            room,
        }
    }
}

/// A policy's rule from a step that ran to the size to grow to
/// ([`SizePolicy::grow_after_a_step`]): the attempt's batch size, and the step's figures where
/// the release read them (a framework that counts what it holds but not the device's total
/// gives none).
pub type GrowRule = Box<dyn Fn(usize, Option<&StepFigures>) -> Option<usize> + Send + Sync>;
