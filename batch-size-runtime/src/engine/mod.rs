//! The retry engine, the loop alone: [`Search`] is the state machine (try a size, and on
//! out-of-memory release memory and ask the policy for the next size, until an attempt
//! succeeds or no size is left), one loop for every policy ([`SizePolicy`](crate::policy::SizePolicy)),
//! sync and async. Every runner and the attribute's generated code enter it through the same
//! `drive` ([`driver`]); how an attempt's return type is classified is [`dispatch`]'s; what a
//! search runs with is one [`Settings`] value.

mod active;
pub(crate) mod dispatch;
pub(crate) mod driver;
mod search;
mod settings;
pub(crate) mod step;

pub(crate) use active::{ActivePolicy, Clock, Hooks};
pub(crate) use driver::{drive, drive_async};
pub(crate) use driver::{drive_ended, drive_ended_async, drive_reporting, Ended};
pub use search::Search;
pub(crate) use settings::{settings_setters, Invalid, Settings};
pub use step::{step_done, step_handle, Grow, StepHandle};
