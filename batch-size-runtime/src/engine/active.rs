//! What a search is configured with beside its sizes: the policy in use (statically dispatched
//! for the built-in ones, so that starting a search allocates nothing) and the per-search hooks.

use std::fmt;
use std::time::Duration;

use crate::engine::dispatch::When;
use crate::error::StopReason;
use crate::policy::{Decision, PolicyWrapper, Reduction, SizePolicy};
use crate::record::{Attempt, SearchReport};

/// The policy a search runs: one of the built-in choices, statically dispatched so that
/// starting a search allocates nothing, or a policy of the user's (a tuner, a runner's).
#[derive(Debug)]
pub(crate) enum ActivePolicy<'r> {
    Shrink(Reduction<'r>),
    Custom(Box<dyn SizePolicy + 'r>),
}

impl<'r> ActivePolicy<'r> {
    /// The built-in shrinking policies accept every success and start at `starting`: the
    /// engine skips asking them, which keeps the success path short (a match, no virtual call).
    pub(crate) fn is_shrinking(&self) -> bool {
        match self {
            ActivePolicy::Shrink(_) => true,
            ActivePolicy::Custom(policy) => (**policy).accepts_every_success(),
        }
    }
}

/// The policy a search runs is itself a policy, so that wrappers (the cache, the agreement
/// between ranks) wrap whichever one was chosen. What it changes: the built-in ones are not
/// asked what the engine knows they answer.
impl<'r> PolicyWrapper for ActivePolicy<'r> {
    type Inner = dyn SizePolicy + 'r;

    fn inner(&self) -> &Self::Inner {
        match self {
            ActivePolicy::Shrink(policy) => policy,
            ActivePolicy::Custom(policy) => &**policy,
        }
    }

    fn inner_mut(&mut self) -> &mut Self::Inner {
        match self {
            ActivePolicy::Shrink(policy) => policy,
            ActivePolicy::Custom(policy) => &mut **policy,
        }
    }

    fn first(&mut self, starting: usize) -> Decision {
        match self {
            // The built-in ones start where they are told, without a call.
            ActivePolicy::Shrink(_) => Decision::Try(starting),
            ActivePolicy::Custom(policy) => (**policy).first(starting),
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        // The engine does not ask a shrinking policy after a success; a wrapper that does gets
        // the engine's answer.
        let succeeded = history.last().is_some_and(|last| last.outcome.is_success());
        if succeeded && self.is_shrinking() {
            return Decision::Accept;
        }
        self.inner_mut().after(history)
    }

    fn accepts_every_success(&self) -> bool {
        self.is_shrinking()
    }

    fn no_size_left(&mut self, reason: StopReason, history: &SearchReport) -> Decision {
        match self {
            ActivePolicy::Shrink(_) => Decision::Stop(reason),
            ActivePolicy::Custom(policy) => (**policy).no_size_left(reason, history),
        }
    }

    fn remedies_in_force(&self) -> Option<String> {
        match self {
            // The common search asks nothing of a built-in policy on its success path.
            ActivePolicy::Shrink(_) => None,
            ActivePolicy::Custom(policy) => (**policy).remedies_in_force(),
        }
    }
}

type Notify<'r> = Box<dyn FnMut(&Attempt) + Send + 'r>;
type OnReport<'r> = Box<dyn FnOnce(&SearchReport) + Send + 'r>;

/// The measure of time an attempt's duration is read with, where not the wall clock (a
/// runner's simulated clock: the tuner's `with_clock`).
pub(crate) type Clock<'r> = Box<dyn FnMut() -> Duration + Send + 'r>;

/// The per-search callbacks: `when`, `notify`, `on_report`, and a clock of the caller's.
#[derive(Default)]
pub(crate) struct Hooks<'r> {
    pub(crate) when: Option<When<'r>>,
    pub(crate) notify: Option<Notify<'r>>,
    pub(crate) on_report: Option<OnReport<'r>>,
    pub(crate) clock: Option<Clock<'r>>,
}

impl fmt::Debug for Hooks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hooks")
            .field("when", &self.when.is_some())
            .field("notify", &self.notify.is_some())
            .field("on_report", &self.on_report.is_some())
            .field("clock", &self.clock.is_some())
            .finish()
    }
}
