//! What a search is configured with beside its sizes: the policy in use (statically dispatched
//! for the built-in ones, so that starting a search allocates nothing) and the per-search hooks.

use std::error::Error;
use std::fmt;

use crate::policy::{Decision, Factor, Guided, Halve, Reduce, SizePolicy};
use crate::record::{Attempt, SearchReport};
use crate::reduce::Reduction;

/// The policy a search runs.
#[derive(Debug)]
pub(crate) enum ActivePolicy<'r> {
    Guided(Guided),
    Halve(Halve),
    Factor(Factor),
    Reduce(Reduce<'r>),
    Custom(Box<dyn SizePolicy + 'r>),
}

impl<'r> From<Reduction<'r>> for ActivePolicy<'r> {
    fn from(reduction: Reduction<'r>) -> Self {
        match reduction {
            Reduction::Halve => ActivePolicy::Halve(Halve),
            Reduction::Factor(factor) => ActivePolicy::Factor(Factor(factor)),
            Reduction::Custom(reduce) => ActivePolicy::Reduce(Reduce::from_box(reduce)),
        }
    }
}

impl ActivePolicy<'_> {
    fn policy(&self) -> &dyn SizePolicy {
        match self {
            ActivePolicy::Guided(policy) => policy,
            ActivePolicy::Halve(policy) => policy,
            ActivePolicy::Factor(policy) => policy,
            ActivePolicy::Reduce(policy) => policy,
            ActivePolicy::Custom(policy) => &**policy,
        }
    }

    fn policy_mut(&mut self) -> &mut dyn SizePolicy {
        match self {
            ActivePolicy::Guided(policy) => policy,
            ActivePolicy::Halve(policy) => policy,
            ActivePolicy::Factor(policy) => policy,
            ActivePolicy::Reduce(policy) => policy,
            ActivePolicy::Custom(policy) => &mut **policy,
        }
    }

    /// The shrinking policies accept every success and start at `starting`: the engine skips
    /// asking them, which keeps the success path short.
    pub(crate) fn is_shrinking(&self) -> bool {
        matches!(
            self,
            ActivePolicy::Guided(_)
                | ActivePolicy::Halve(_)
                | ActivePolicy::Factor(_)
                | ActivePolicy::Reduce(_)
        )
    }

    pub(crate) fn first(&mut self, starting: usize) -> Decision {
        if self.is_shrinking() {
            return Decision::Try(starting);
        }
        self.policy_mut().first(starting)
    }

    pub(crate) fn after(&mut self, history: &SearchReport) -> Decision {
        self.policy_mut().after(history)
    }

    pub(crate) fn ended_by_failure(&mut self, history: &SearchReport) {
        self.policy_mut().ended_by_failure(history)
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        self.policy().check()
    }

    pub(crate) fn reads_memory_after_success(&self) -> bool {
        self.policy().reads_memory_after_success()
    }

    pub(crate) fn rationale(&self) -> Option<String> {
        match self {
            ActivePolicy::Guided(policy) => policy.rationale(),
            ActivePolicy::Custom(policy) => policy.rationale(),
            _ => None,
        }
    }
}

/// The policy a search runs is itself a policy, so that wrappers (the cache, the agreement
/// between ranks) wrap whichever one was chosen.
impl SizePolicy for ActivePolicy<'_> {
    fn first(&mut self, starting: usize) -> Decision {
        ActivePolicy::first(self, starting)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        // The engine does not ask a shrinking policy after a success; a wrapper that does gets
        // the engine's answer.
        let succeeded = history.last().is_some_and(|last| last.outcome.is_success());
        if succeeded && self.is_shrinking() {
            return Decision::Accept;
        }
        ActivePolicy::after(self, history)
    }

    fn ended_by_failure(&mut self, history: &SearchReport) {
        ActivePolicy::ended_by_failure(self, history)
    }

    fn check(&self) -> Result<(), String> {
        ActivePolicy::check(self)
    }

    fn reads_memory_after_success(&self) -> bool {
        ActivePolicy::reads_memory_after_success(self)
    }

    fn rationale(&self) -> Option<String> {
        ActivePolicy::rationale(self)
    }
}

type When<'r> = Box<dyn Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'r>;
type Notify<'r> = Box<dyn FnMut(&Attempt) + Send + 'r>;
type OnReport<'r> = Box<dyn FnOnce(&SearchReport) + Send + 'r>;

/// The per-search callbacks: `when`, `notify`, `on_report`.
#[derive(Default)]
pub(crate) struct Hooks<'r> {
    pub(crate) when: Option<When<'r>>,
    pub(crate) notify: Option<Notify<'r>>,
    pub(crate) on_report: Option<OnReport<'r>>,
}

impl fmt::Debug for Hooks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hooks")
            .field("when", &self.when.is_some())
            .field("notify", &self.notify.is_some())
            .field("on_report", &self.on_report.is_some())
            .finish()
    }
}
