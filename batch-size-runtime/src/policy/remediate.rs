//! The remedies as a wrapper around the search's policy: the inner policy searches the batch
//! size under the settings in force; when the engine finds no size left, the wrapper applies the
//! next remedy and starts the inner policy again from `starting`, showing it only the attempts
//! made under the new settings. The settings themselves, of the user's type, live with
//! [`Remedies`](crate::remedies::Remedies); the policy, the engine and the cache move them through
//! [`LadderControl`], which knows no type.

use std::fmt;
use std::sync::Arc;

use super::{holds_inner, Decision, GrowRule, PolicyWrapper, SizePolicy};
use crate::error::StopReason;
use crate::record::{Attempt, SearchReport};

/// What one step up the ladder did, for the logs, the report and the final error.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Applied {
    /// "activation checkpointing", "context length 1024".
    pub(crate) what: String,
    /// Why, with the failure's figures.
    pub(crate) why: String,
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.what, self.why)
    }
}

/// The ladder without its settings type, for the policy and the cache.
pub(crate) trait LadderControl: Send + Sync {
    fn check(&self) -> Result<(), String>;
    fn advance(&self, failure: Option<&Attempt>) -> Option<Vec<Applied>>;
    fn describe(&self) -> Option<String>;
    fn applied(&self) -> Vec<Applied>;
    fn is_empty(&self) -> bool;
    fn levels(&self) -> Vec<Option<usize>>;
    /// The declared remedies' names, joined: part of the cache's key.
    fn names(&self) -> String;
    fn restore(&self, levels: &[Option<usize>]) -> bool;
}

impl fmt::Debug for dyn LadderControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remedies")
            .field("in_force", &self.describe())
            .finish_non_exhaustive()
    }
}

/// The search's policy with the remedies around it.
pub(crate) struct Remediate<P> {
    inner: P,
    ladder: Arc<dyn LadderControl>,
    /// Where the batch-size search starts again after a remedy.
    starting: usize,
    /// The search's `min`: it runs out of memory before any remedy is applied.
    min: usize,
    /// The attempts numbered up to this ran under other settings: the inner policy does not
    /// see them (its figures would mislead it).
    since: usize,
    label: &'static str,
    rationale: Option<String>,
}

impl<P: fmt::Debug> fmt::Debug for Remediate<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remediate")
            .field("inner", &self.inner)
            .field("in_force", &self.ladder.describe())
            .field("starting", &self.starting)
            .finish_non_exhaustive()
    }
}

impl<P> Remediate<P> {
    pub(crate) fn new(
        inner: P,
        ladder: Arc<dyn LadderControl>,
        starting: usize,
        min: usize,
        label: &'static str,
    ) -> Self {
        Remediate {
            inner,
            ladder,
            starting,
            min,
            since: 0,
            label,
            rationale: None,
        }
    }
}

impl<P: SizePolicy> PolicyWrapper for Remediate<P> {
    holds_inner!(P);

    fn after(&mut self, history: &SearchReport) -> Decision {
        self.rationale = None;
        if self.since == 0 {
            self.inner.after(history)
        } else {
            self.inner.after(&history.since(self.since))
        }
    }

    /// Grows from the steps measured and the failures met under the remedies in force: those
    /// under the old settings say nothing of the step now.
    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        if self.since == 0 {
            self.inner.grow_after_a_step(history)
        } else {
            self.inner.grow_after_a_step(&history.since(self.since))
        }
    }

    fn no_size_left(&mut self, reason: StopReason, history: &SearchReport) -> Decision {
        if self.ladder.is_empty() {
            return Decision::Stop(reason);
        }
        // A remedy comes only once `min` itself ran out of memory under the settings in force:
        // a policy that stopped short of it (a reduction that does not shrink, a proof from
        // figures) gets `min` tried first.
        let smallest_failed_here = history
            .attempts()
            .filter(|attempt| attempt.number > self.since && attempt.outcome.is_out_of_memory())
            .map(|attempt| attempt.batch_size)
            .min();
        if smallest_failed_here.is_some_and(|smallest| smallest > self.min) {
            self.rationale = Some(format!(
                "the smallest size, {}, before any remedy ({reason})",
                self.min
            ));
            return Decision::Try(self.min);
        }
        let Some(steps) = self.ladder.advance(history.last()) else {
            let applied = self.ladder.applied();
            return Decision::Stop(StopReason::NoRemedyLeft {
                last: Box::new(reason),
                applied: applied.iter().map(ToString::to_string).collect(),
            });
        };
        let settings = self.ladder.describe().unwrap_or_default();
        for step in &steps {
            tracing::warn!(
                function = self.label,
                remedy = %step.what,
                settings = %settings,
                why = %step.why,
                "no batch size fits: applying {} ({}); the batch size is searched again from {}",
                step.what,
                step.why,
                self.starting
            );
        }
        self.since = history.len();
        let what: Vec<&str> = steps.iter().map(|step| step.what.as_str()).collect();
        self.rationale = Some(format!("{} applied: now {settings}", what.join(" and ")));
        self.inner.first(self.starting)
    }

    fn check(&self) -> Result<(), String> {
        self.ladder.check()?;
        self.inner.check()
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone().or_else(|| self.inner.rationale())
    }

    fn remedies_in_force(&self) -> Option<String> {
        self.ladder.describe()
    }
}
