//! What a runner needs of the error type your closure returns: a way to look at it (is it
//! out-of-memory?) and a way to keep it as the `source()` of [`NoExecutableBatchSize`] when no
//! size fits. Every runner ([`BatchSizeSearch::run`](crate::BatchSizeSearch::run),
//! [`EffectiveBatch::step`](crate::EffectiveBatch::step), [`Chunked::run`](crate::Chunked::run),
//! [`Tuner::run`](crate::Tuner::run)) takes the same error types:
//!
//! - your own error type: anything `Error + Send + Sync + 'static` (a `thiserror` enum, cudarc's
//!   `DriverError`, candle's `Error`), looked at through its `source()` chain;
//! - `anyhow::Error` and `Box<dyn Error + Send + Sync>`, looked at through their chain.
//!
//! An error that is not out-of-memory comes back from the runner unchanged: same type, same
//! value. The marker type parameter is inferred; you never write it. It is what lets one
//! signature take both kinds without overlapping impls (`anyhow::Error` is not an `Error`).

use std::error::Error;

#[allow(unused_imports)] // for the docs' links
use crate::error::NoExecutableBatchSize;
use crate::kept::KeptError;

/// An error type a runner can classify and give back unchanged. Implemented for every
/// `E: Error + Send + Sync + 'static` (marker [`Typed`]) and for `anyhow::Error` and
/// `Box<dyn Error + Send + Sync>` (marker [`Dynamic`]); see the [module](self).
#[diagnostic::on_unimplemented(
    message = "a batch-size runner cannot tell whether `{Self}` is out-of-memory",
    label = "the closure's error type",
    note = "return an error type that implements `std::error::Error + Send + Sync + 'static` (your own enum, a framework's error), `anyhow::Error` or `Box<dyn std::error::Error + Send + Sync>`"
)]
pub trait AttemptError<Marker>: Sized + 'static {
    /// The error as a trait object, for classification and descriptions.
    #[doc(hidden)]
    fn as_error(&self) -> &(dyn Error + 'static);
    /// The error kept as `NoExecutableBatchSize::source()`, downcastable to what it was.
    #[doc(hidden)]
    fn into_kept(self) -> KeptError;
}

/// The marker of error types that implement [`Error`] themselves.
#[derive(Debug)]
pub enum Typed {}

/// The marker of `anyhow::Error` and `Box<dyn Error + Send + Sync>`, which are not themselves
/// [`Error`]s but hold one.
#[derive(Debug)]
pub enum Dynamic {}

impl<E: Error + Send + Sync + 'static> AttemptError<Typed> for E {
    #[inline]
    fn as_error(&self) -> &(dyn Error + 'static) {
        self
    }
    fn into_kept(self) -> KeptError {
        let boxed: Box<dyn Error + Send + Sync> = Box::new(self);
        KeptError::from(boxed)
    }
}

impl<E> AttemptError<Dynamic> for E
where
    E: AsRef<dyn Error + Send + Sync + 'static>
        + Into<Box<dyn Error + Send + Sync + 'static>>
        + 'static,
{
    #[inline]
    fn as_error(&self) -> &(dyn Error + 'static) {
        self.as_ref()
    }
    fn into_kept(self) -> KeptError {
        KeptError::keep(self)
    }
}
