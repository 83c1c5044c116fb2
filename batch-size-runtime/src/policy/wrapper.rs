//! One way to wrap a policy: a wrapper (the cache, the agreement between ranks, remedies, the
//! even split, a runner's policy) names the policy it holds and states only the hooks it
//! changes; every other hook of [`SizePolicy`] reaches the inner policy through the defaults
//! here. A hook added to `SizePolicy` is added here once, with its forward, and reaches every
//! wrapper: none can leave it out by accident (remedies lost behind an agreement, say).

use std::fmt;

use super::{Decision, GrowRule, SizePolicy};
use crate::error::StopReason;
use crate::record::SearchReport;

/// A policy around another; see the [module docs](self). Each method is the [`SizePolicy`]
/// hook of the same name, forwarded to [`inner`](Self::inner) unless the wrapper says otherwise.
pub(crate) trait PolicyWrapper: Send + fmt::Debug {
    /// The policy held.
    type Inner: SizePolicy + ?Sized;

    fn inner(&self) -> &Self::Inner;

    fn inner_mut(&mut self) -> &mut Self::Inner;

    fn first(&mut self, starting: usize) -> Decision {
        self.inner_mut().first(starting)
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        self.inner_mut().after(history)
    }

    fn ended_by_failure(&mut self, history: &SearchReport) {
        self.inner_mut().ended_by_failure(history)
    }

    fn check(&self) -> Result<(), String> {
        self.inner().check()
    }

    fn accepts_every_success(&self) -> bool {
        self.inner().accepts_every_success()
    }

    fn each_success_is_new_work(&self) -> bool {
        self.inner().each_success_is_new_work()
    }

    fn reads_memory_after_success(&self) -> bool {
        self.inner().reads_memory_after_success()
    }

    fn rationale(&self) -> Option<String> {
        self.inner().rationale()
    }

    fn no_size_left(&mut self, reason: StopReason, history: &SearchReport) -> Decision {
        self.inner_mut().no_size_left(reason, history)
    }

    fn remedies_in_force(&self) -> Option<String> {
        self.inner().remedies_in_force()
    }

    fn agrees_with_others(&self) -> bool {
        self.inner().agrees_with_others()
    }

    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        self.inner().grow_after_a_step(history)
    }
}

impl<W: PolicyWrapper> SizePolicy for W {
    fn first(&mut self, starting: usize) -> Decision {
        PolicyWrapper::first(self, starting)
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        PolicyWrapper::after(self, history)
    }
    fn ended_by_failure(&mut self, history: &SearchReport) {
        PolicyWrapper::ended_by_failure(self, history)
    }
    fn check(&self) -> Result<(), String> {
        PolicyWrapper::check(self)
    }
    fn accepts_every_success(&self) -> bool {
        PolicyWrapper::accepts_every_success(self)
    }
    fn each_success_is_new_work(&self) -> bool {
        PolicyWrapper::each_success_is_new_work(self)
    }
    fn reads_memory_after_success(&self) -> bool {
        PolicyWrapper::reads_memory_after_success(self)
    }
    fn rationale(&self) -> Option<String> {
        PolicyWrapper::rationale(self)
    }
    fn no_size_left(&mut self, reason: StopReason, history: &SearchReport) -> Decision {
        PolicyWrapper::no_size_left(self, reason, history)
    }
    fn remedies_in_force(&self) -> Option<String> {
        PolicyWrapper::remedies_in_force(self)
    }
    fn agrees_with_others(&self) -> bool {
        PolicyWrapper::agrees_with_others(self)
    }
    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        PolicyWrapper::grow_after_a_step(self, history)
    }
}

/// The policy a wrapper holds in its field `inner`, of type `$inner`: the two accessors every
/// such wrapper would otherwise write out.
macro_rules! holds_inner {
    ($inner:ty) => {
        type Inner = $inner;

        fn inner(&self) -> &Self::Inner {
            &self.inner
        }

        fn inner_mut(&mut self) -> &mut Self::Inner {
            &mut self.inner
        }
    };
}
pub(crate) use holds_inner;

/// A boxed policy is the policy it holds.
impl<P: SizePolicy + ?Sized> PolicyWrapper for Box<P> {
    type Inner = P;
    fn inner(&self) -> &P {
        self
    }
    fn inner_mut(&mut self) -> &mut P {
        self
    }
}

/// A lent policy is the policy it lends: a runner keeps its policy, lends it to the loop with
/// `with_policy(&mut policy)`, and reads what it learned when the loop returns.
impl<P: SizePolicy + ?Sized> PolicyWrapper for &mut P {
    type Inner = P;
    fn inner(&self) -> &P {
        self
    }
    fn inner_mut(&mut self) -> &mut P {
        self
    }
}
