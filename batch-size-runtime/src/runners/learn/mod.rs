//! What the runners of many searches learn as they run, and the tuner from its trials: memory
//! fitted against the size ([`fit`]), the size that fills the device step after step or chunk
//! after chunk ([`converge`]), and growing back after a recovery ([`grow_back`]). Plumbing of
//! the runners, not an extension point: users choose policies, these they do not see.

mod converge;
pub(crate) mod fit;
mod grow_back;
mod square_term;

pub(crate) use converge::{larger_budget, Convergence, Probing};
pub(crate) use grow_back::GrowBack;
pub(crate) use square_term::SquareTerm;
