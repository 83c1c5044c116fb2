//! What a runner needs of the error type a closure returns (the docs users read are on
//! [`AttemptError`]).

use std::error::Error;

use crate::error::{KeptError, NoExecutableBatchSize};

/// An error type that can be told out-of-memory or not: every
/// `E: Error + Send + Sync + 'static` (marker [`Typed`]), `anyhow::Error` and
/// `Box<dyn Error + Send + Sync>` (marker [`Dynamic`]). What the attribute needs of an error
/// type it keeps; a runner needs [`AttemptError`] as well.
///
/// Sealed: the two blanket implementations are the whole list, so that a bound on it says
/// exactly which error types a runner takes.
#[diagnostic::on_unimplemented(
    message = "`AttemptError` is sealed: `{Self}` cannot be given it by hand",
    label = "not an error type a runner takes",
    note = "a runner takes `std::error::Error + Send + Sync + 'static` types, `anyhow::Error` and `Box<dyn std::error::Error + Send + Sync>`, with `From<NoExecutableBatchSize>`: implement `std::error::Error` for `{Self}` instead"
)]
pub trait InspectError<Marker>:
    Sized + 'static + InspectableError + sealed::Sealed<Marker>
{
    /// The error as a trait object, for classification and descriptions.
    #[doc(hidden)]
    fn as_error(&self) -> &(dyn Error + 'static);
    /// The error kept as `NoExecutableBatchSize::source()`, downcastable to what it was.
    #[doc(hidden)]
    fn into_kept(self) -> KeptError;
}

/// Sealed on purpose (as anyhow and tracing do): the trait is public in a private module, so no
/// one outside the crate can name it, and [`InspectError`] (hence [`AttemptError`]) has exactly
/// the implementations below.
mod sealed {
    pub trait Sealed<Marker> {}
}

impl<E: Error + Send + Sync + 'static> sealed::Sealed<Typed> for E {}

impl<E> sealed::Sealed<Dynamic> for E where
    E: AsRef<dyn Error + Send + Sync + 'static>
        + Into<Box<dyn Error + Send + Sync + 'static>>
        + std::fmt::Display
        + 'static
{
}

impl<E: Error + Send + Sync + 'static> InspectError<Typed> for E {
    #[inline]
    fn as_error(&self) -> &(dyn Error + 'static) {
        self
    }
    fn into_kept(self) -> KeptError {
        let boxed: Box<dyn Error + Send + Sync> = Box::new(self);
        KeptError::from(boxed)
    }
}

impl<E> InspectError<Dynamic> for E
where
    E: AsRef<dyn Error + Send + Sync + 'static>
        + Into<Box<dyn Error + Send + Sync + 'static>>
        + std::fmt::Display
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

/// An error type a runner can classify and give back unchanged, and build when no size fits.
///
/// What a runner needs of the error type your closure returns: a way to look at it (is it
/// out-of-memory?), a way to keep it as the `source()` of [`NoExecutableBatchSize`], and
/// `From<NoExecutableBatchSize>` for what it returns when no size fits. Every runner ([`BatchSizeSearch::run`](crate::BatchSizeSearch::run),
/// [`EffectiveBatch::step`](crate::EffectiveBatch::step), [`Chunked::run`](crate::Chunked::run),
/// [`Tuner::run`](crate::Tuner::run)) takes the same error types:
///
/// - your own error type: `Error + Send + Sync + 'static` with `From<NoExecutableBatchSize>` (a
///   `thiserror` enum with a `#[error(transparent)] NoBatchSize(#[from] NoExecutableBatchSize)`
///   variant), looked at through its `source()` chain;
/// - `anyhow::Error` and `Box<dyn Error + Send + Sync>`, looked at through their chain;
/// - a framework's error type (cudarc's `DriverError`, candle's `Error`) has no
///   `From<NoExecutableBatchSize>`: hold it in your enum with `#[from]`, or return `anyhow::Error`.
///   (A generic method cannot choose between "convert" and "give the last error back" by
///   whether the conversion exists; the attribute can, and gives the last out-of-memory error
///   back for such a type.)
///
/// An error that is not out-of-memory comes back from the runner unchanged: same type, same
/// value. The marker type parameter is inferred; you never write it. It is what lets one
/// signature take both kinds without overlapping impls (`anyhow::Error` is not an `Error`).
///
/// Sealed: the types above are the whole list, and no other implementation can be written
/// (`tests-build/ui/fail/sealed_attempt_error.rs` shows the error, which says so).
#[diagnostic::on_unimplemented(
    message = "a batch-size runner cannot take `{Self}` as the closure's error type",
    label = "the closure's error type",
    note = "a runner needs an error it can inspect (`std::error::Error + Send + Sync + 'static`, `anyhow::Error` or `Box<dyn std::error::Error + Send + Sync>`) and can build when no size fits (`From<NoExecutableBatchSize>`)",
    note = "for your own enum, add `#[error(transparent)] NoBatchSize(#[from] batch_size_runtime::NoExecutableBatchSize)`; hold a framework's error in it with `#[from]`, or return `anyhow::Error`"
)]
pub trait AttemptError<Marker>: InspectError<Marker> {
    /// What the runner returns when no size fits.
    #[doc(hidden)]
    fn no_size_fits(none_fit: NoExecutableBatchSize) -> Self;
}

#[diagnostic::do_not_recommend]
impl<E: InspectError<M> + From<NoExecutableBatchSize>, M> AttemptError<M> for E {
    fn no_size_fits(none_fit: NoExecutableBatchSize) -> Self {
        E::from(none_fit)
    }
}

/// What the attribute needs of a function's error type for its out-of-memory errors to be
/// recognised: at least `Display` (classified by text); `Error + Send + Sync + 'static`,
/// `anyhow::Error` and boxed errors are classified through their `source()` chain. A type
/// that is neither is a compile error at the return type: it could hide an out-of-memory error.
#[diagnostic::on_unimplemented(
    message = "`#[find_executable_batch_size]` cannot tell whether an error of type `{Self}` is out-of-memory",
    label = "the error type of this return type can be neither inspected nor printed",
    note = "for a generic error type, add the bound `{Self}: std::error::Error + Send + Sync + 'static` (or at least `std::fmt::Display`); for your own type, implement `std::error::Error` or `Display`"
)]
pub trait InspectableError {}

// Recommended (no `do_not_recommend`): rustc's help then names the public bound, `Display`.
impl<E: std::fmt::Display + ?Sized> InspectableError for E {}

/// The marker of error types that implement [`Error`] themselves.
#[derive(Debug)]
pub enum Typed {}

/// The marker of `anyhow::Error` and `Box<dyn Error + Send + Sync>`, which are not themselves
/// [`Error`]s but hold one.
#[derive(Debug)]
pub enum Dynamic {}
