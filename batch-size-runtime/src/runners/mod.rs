//! The ways into the engine, the doors users build: [`BatchSizeSearch`](crate::BatchSizeSearch)
//! (the attribute's too) and the others:
//! each is a policy (or a wrapper around one) plus what it does between searches, and each
//! enters and leaves the engine through the same door, with the same error types
//! ([`AttemptError`](crate::AttemptError)) and the same report
//! ([`last_report()`](crate::last_report)).
//!
//! - [`effective`]: one optimizer step at a time, with the effective batch kept through
//!   gradient accumulation ([`EffectiveBatch`](crate::EffectiveBatch)).
//! - [`chunked`]: work over many items in chunks that keep their progress
//!   ([`Chunked`](crate::Chunked)).
//! - [`tuner`]: the largest size, found in a few short trials before training
//!   ([`Tuner`](crate::Tuner)).

pub mod chunked;
pub mod effective;
pub(crate) mod learn;
pub mod search;
pub(crate) mod split;
pub mod tuner;
