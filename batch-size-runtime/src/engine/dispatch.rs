//! How an attempt's return type is handled (how its error is classified, what it returns when no
//! size fits), chosen by autoref specialization as anyhow's `kind.rs` does: the generated code
//! calls `(&&&&&&&tag::<R>()).batch_size_classify_kind()` and `batch_size_give_up_kind()`, and
//! method lookup takes the [`ladder`]'s rung with the most references whose bounds hold. A
//! `Result` whose error can be neither inspected nor printed fails to compile: it could hide an
//! out-of-memory error.

use std::convert::Infallible;
use std::error::Error;
use std::fmt::{self, Display};
use std::marker::PhantomData;

use crate::attempt::{AttemptError, Dynamic, InspectError, Typed};
use crate::engine::step::Grow;
use crate::error::{KeptError, NoExecutableBatchSize};
use crate::oom::{self, OomKind, OomMatch};

/// A search's own predicate that counts more errors as out-of-memory (`when`).
pub(crate) type When<'r> = Box<dyn Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'r>;

/// What counts as out-of-memory for one search: the process-wide rules ([`oom`]), then `when`.
#[derive(Clone, Copy)]
pub struct OomRules<'a> {
    when: Option<&'a When<'a>>,
    side_threads: Option<&'a crate::panic_filter::SideWatch>,
}

impl fmt::Debug for OomRules<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OomRules")
            .field("when", &self.when.is_some())
            .finish()
    }
}

impl<'a> OomRules<'a> {
    pub(crate) fn new(when: Option<&'a When<'a>>) -> Self {
        OomRules {
            when,
            side_threads: None,
        }
    }

    /// Also counts a failure that is a device thread's lost work after its out-of-memory.
    pub(crate) fn with_side_threads(
        mut self,
        side_threads: Option<&'a crate::panic_filter::SideWatch>,
    ) -> Self {
        self.side_threads = side_threads;
        self
    }

    fn side_thread_oom(&self, failed_with: impl FnOnce() -> String) -> Option<OomMatch> {
        let side = self.side_threads?.out_of_memory(&failed_with())?;
        // The line was recognised on its thread: read again here for its kind and figures.
        let mut found = oom::classify_text(&side.line)?;
        found.description = side.description;
        Some(found)
    }

    /// Whether `error` is out-of-memory, through its `source()` chain.
    pub(crate) fn classify_error(&self, error: &(dyn Error + 'static)) -> Option<OomMatch> {
        oom::classify_error(error)
            .or_else(|| {
                let when = self.when?;
                oom::chain_of(error).any(when).then(|| OomMatch {
                    kind: OomKind::Rule,
                    description: oom::describe(error),
                    figures: Default::default(),
                })
            })
            // The whole chain: what lost device work says may be below the first line.
            .or_else(|| self.side_thread_oom(|| oom::chain_text(error)))
    }

    /// Whether a message is out-of-memory, by the same rules.
    pub(crate) fn classify_text(&self, text: &str) -> Option<OomMatch> {
        oom::classify_text(text)
            .or_else(|| {
                let when = self.when?;
                when(&TextError(text.to_owned())).then(|| OomMatch {
                    kind: OomKind::Rule,
                    description: text.lines().next().unwrap_or_default().to_owned(),
                    figures: Default::default(),
                })
            })
            .or_else(|| self.side_thread_oom(|| text.to_owned()))
    }

    /// Whether a panic's payload is out-of-memory, by the same rules.
    pub(crate) fn classify_panic(&self, payload: &(dyn std::any::Any + Send)) -> Option<OomMatch> {
        let text = || crate::panic_filter::panic_text(payload);
        oom::classify_panic(payload)
            .or_else(|| self.classify_text(text()?))
            .or_else(|| self.side_thread_oom(|| text().unwrap_or("a panic").to_owned()))
    }
}

/// A panic's message shown to a `when` predicate as an error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TextError(String);

/// How one attempt ended, once its value is classified.
#[derive(Debug)]
pub enum Judged<R, E> {
    /// A success: the value, for the caller if the policy accepts.
    Succeeded(R),
    /// An error that is not out-of-memory: the value goes back unchanged, with a description.
    Failed(R, String),
    /// Out of memory, with the error value where there is one.
    OutOfMemory(OomMatch, Option<E>),
    /// The error is (or holds in its chain) the [`Grow`] that
    /// [`step_done`](crate::step_done) answered: the attempt grew, where its watch says so;
    /// else a failure, with its description.
    Grew(R, String),
}

/// Classifies the values of one return type `R`.
pub trait Classify<R> {
    /// The error type of `R` (or [`Infallible`] where there is none).
    type Error;
    /// Sorts an attempt's value, with the search's own `when` rules.
    fn judge(&self, value: R, rules: &OomRules<'_>) -> Judged<R, Self::Error>;
    /// Keeps an out-of-memory error as `NoExecutableBatchSize::source()`, where it can be.
    fn keep(&self, _error: Self::Error) -> Option<KeptError> {
        None
    }
}

/// Whether the search keeps the last out-of-memory error itself, for a caller that gives up by
/// returning it (a return type with no way to say "no size fits").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LastError {
    /// Kept beside [`NoExecutableBatchSize`], to be returned as it is.
    Returned,
    /// Kept, where it can be, as the `source()` of [`NoExecutableBatchSize`].
    AsSource,
}

/// What a function returns when no size fits.
pub trait GiveUp<R> {
    /// The error type of `R`, as [`Classify::Error`].
    type Error;
    /// What the driver ([`drive`](crate::engine::driver::drive)) returns when no size fits: the
    /// function's value (or the `NoExecutableBatchSize` for `BatchSizeSearch::call`).
    type Output;
    /// Whether the last out-of-memory error is returned as it is (it is then not boxed).
    fn last_error(&self) -> LastError {
        LastError::AsSource
    }
    /// The value for `none_fit`, given the last out-of-memory error where it was kept.
    fn give_up(&self, none_fit: NoExecutableBatchSize, last: Option<Self::Error>) -> Self::Output;
}

macro_rules! zero_sized_kind {
    ($($(#[$doc:meta])* $name:ident<$($param:ident),+>;)*) => {$(
        $(#[$doc])*
        pub struct $name<$($param),+>(PhantomData<fn() -> ($($param,)+)>);

        impl<$($param),+> $name<$($param),+> {
            /// The kind.
            #[allow(clippy::new_without_default)]
            pub const fn new() -> Self {
                $name(PhantomData)
            }
        }

        impl<$($param),+> fmt::Debug for $name<$($param),+> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    )*};
}

zero_sized_kind! {
    /// An error a runner takes ([`AttemptError`]): `E: Error + Send + Sync + 'static` (marker
    /// [`Typed`]), `anyhow::Error` or `Box<dyn Error + Send + Sync>` (marker [`Dynamic`]);
    /// classified through its chain and kept as `source()`.
    Kept<E, M>;
    /// `E: Error + 'static`: classified by type.
    TypedView<E>;
    /// `Box<dyn Error>`: the chain classified.
    DynView<E>;
    /// `E: Display`: classified by text.
    Text<E>;
    /// A `Result` whose error cannot be inspected: a compile error.
    Unclassifiable<E>;
    /// Not a `Result`: only a panic can be out-of-memory.
    PanicOnly<R>;
    /// `E: From<NoExecutableBatchSize>`.
    ViaFrom<E>;
    /// `E: From<std::io::Error>` (candle's and tch's errors).
    ViaIo<E>;
    /// `E: From<String>`.
    ViaString<E>;
    /// `E: From<Box<dyn Error + Send + Sync>>` (ort's error).
    ViaBox<E>;
    /// Any other `Result`: the last out-of-memory error itself.
    ReturnLastError<E>;
    /// Not a `Result`: a panic with the message.
    PanicWithError<R>;
}

/// A success as it is; an error as `failed` judges it.
#[inline]
fn judge_result<T, E>(
    value: Result<T, E>,
    failed: impl FnOnce(E) -> Judged<Result<T, E>, E>,
) -> Judged<Result<T, E>, E> {
    match value {
        Ok(value) => Judged::Succeeded(Ok(value)),
        Err(error) => failed(error),
    }
}

fn judge_error<T, E>(
    error: E,
    rules: &OomRules<'_>,
    view: impl Fn(&E) -> &(dyn Error + 'static),
) -> Judged<Result<T, E>, E> {
    match rules.classify_error(view(&error)) {
        Some(found) => Judged::OutOfMemory(found, Some(error)),
        None => {
            let description = oom::describe(view(&error));
            if oom::chain_of(view(&error)).any(|layer| layer.is::<Grow>()) {
                Judged::Grew(Err(error), description)
            } else {
                Judged::Failed(Err(error), description)
            }
        }
    }
}

impl<T, E: InspectError<M>, M> Classify<Result<T, E>> for Kept<E, M> {
    type Error = E;
    #[inline]
    fn judge(&self, value: Result<T, E>, rules: &OomRules<'_>) -> Judged<Result<T, E>, E> {
        judge_result(value, |error| {
            judge_error(error, rules, InspectError::as_error)
        })
    }
    fn keep(&self, error: E) -> Option<KeptError> {
        Some(error.into_kept())
    }
}

/// A runner gives up with `E::from(NoExecutableBatchSize)` ([`AttemptError`]).
impl<T, E: AttemptError<M>, M> GiveUp<Result<T, E>> for Kept<E, M> {
    type Error = E;
    type Output = Result<T, E>;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<E>) -> Result<T, E> {
        Err(E::no_size_fits(none_fit))
    }
}

impl<T, E: Error + 'static> Classify<Result<T, E>> for TypedView<E> {
    type Error = E;
    fn judge(&self, value: Result<T, E>, rules: &OomRules<'_>) -> Judged<Result<T, E>, E> {
        judge_result(value, |error| judge_error(error, rules, |error| error))
    }
}

impl<T, E: AsRef<dyn Error + 'static>> Classify<Result<T, E>> for DynView<E> {
    type Error = E;
    fn judge(&self, value: Result<T, E>, rules: &OomRules<'_>) -> Judged<Result<T, E>, E> {
        judge_result(value, |error| {
            judge_error(error, rules, |error| error.as_ref())
        })
    }
}

impl<T, E: Display> Classify<Result<T, E>> for Text<E> {
    type Error = E;
    fn judge(&self, value: Result<T, E>, rules: &OomRules<'_>) -> Judged<Result<T, E>, E> {
        judge_result(value, |error| {
            let text = error.to_string();
            match rules.classify_text(&text) {
                Some(found) => Judged::OutOfMemory(found, Some(error)),
                None => Judged::Failed(Err(error), text),
            }
        })
    }
}

impl<T, E> Classify<Result<T, E>> for Unclassifiable<E> {
    type Error = E;
    fn judge(&self, value: Result<T, E>, _: &OomRules<'_>) -> Judged<Result<T, E>, E> {
        judge_result(value, |error| Judged::Failed(Err(error), String::new()))
    }
}

impl<R> Classify<R> for PanicOnly<R> {
    type Error = Infallible;
    fn judge(&self, value: R, _: &OomRules<'_>) -> Judged<R, Infallible> {
        Judged::Succeeded(value)
    }
}

impl<T, E: From<NoExecutableBatchSize>> GiveUp<Result<T, E>> for ViaFrom<E> {
    type Error = E;
    type Output = Result<T, E>;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<E>) -> Result<T, E> {
        Err(E::from(none_fit))
    }
}

impl<T, E: From<std::io::Error>> GiveUp<Result<T, E>> for ViaIo<E> {
    type Error = E;
    type Output = Result<T, E>;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<E>) -> Result<T, E> {
        Err(E::from(std::io::Error::from(none_fit)))
    }
}

impl<T, E: From<String>> GiveUp<Result<T, E>> for ViaString<E> {
    type Error = E;
    type Output = Result<T, E>;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<E>) -> Result<T, E> {
        Err(E::from(none_fit.to_string()))
    }
}

impl<T, E: From<Box<dyn Error + Send + Sync>>> GiveUp<Result<T, E>> for ViaBox<E> {
    type Error = E;
    type Output = Result<T, E>;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<E>) -> Result<T, E> {
        let boxed: Box<dyn Error + Send + Sync> = Box::new(none_fit);
        Err(E::from(boxed))
    }
}

impl<T, E> GiveUp<Result<T, E>> for ReturnLastError<E> {
    type Error = E;
    type Output = Result<T, E>;
    fn last_error(&self) -> LastError {
        LastError::Returned
    }
    fn give_up(&self, none_fit: NoExecutableBatchSize, last: Option<E>) -> Result<T, E> {
        match last {
            Some(error) => Err(error),
            // No attempt returned an error (none ran, or every one panicked): nothing of type
            // `E` exists to return.
            None => panic_no_executable_batch_size(none_fit),
        }
    }
}

impl<R> GiveUp<R> for PanicWithError<R> {
    type Error = Infallible;
    type Output = R;
    fn give_up(&self, none_fit: NoExecutableBatchSize, _: Option<Infallible>) -> R {
        panic_no_executable_batch_size(none_fit)
    }
}

/// A function that cannot return the failure panics with it.
#[allow(clippy::panic)]
pub fn panic_no_executable_batch_size(error: NoExecutableBatchSize) -> ! {
    panic!("{error}")
}

/// The return type `R`, as a value the ladders can take references of.
pub struct Tag<R>(PhantomData<fn() -> R>);

impl<R> fmt::Debug for Tag<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tag")
    }
}

/// The tag of the return type `R`, written as `PhantomData::<R>` where the generated code
/// needs an expression.
pub const fn tag_of<R>(_: PhantomData<R>) -> Tag<R> {
    Tag(PhantomData)
}

/// The rungs: one trait per rung (method lookup tries them by the number of references), each
/// returning the kind for its bound. Imported together by the generated code.
pub mod ladder {
    use super::*;

    macro_rules! rung {
        ($(#[$doc:meta])* $rung:ident, $method:ident, $self_ty:ty, $kind:ty, [$($bounds:tt)*]) => {
            $(#[$doc])*
            #[doc = concat!("The rung that chooses `", stringify!($kind), "`.")]
            pub trait $rung {
                /// The kind chosen.
                type Kind;
                /// The kind chosen.
                fn $method(&self) -> Self::Kind;
            }
            impl<T, E> $rung for $self_ty where $($bounds)* {
                type Kind = $kind;
                fn $method(&self) -> $kind {
                    <$kind>::new()
                }
            }
        };
    }

    rung!(ClassifyTypedKept, batch_size_classify_kind, &&&&&&Tag<Result<T, E>>, Kept<E, Typed>,
        [E: Error + Send + Sync + 'static]);
    rung!(ClassifyDynKept, batch_size_classify_kind, &&&&&Tag<Result<T, E>>, Kept<E, Dynamic>,
        [E: AsRef<dyn Error + Send + Sync + 'static> + Into<Box<dyn Error + Send + Sync + 'static>> + 'static]);
    rung!(ClassifyTypedView, batch_size_classify_kind, &&&&Tag<Result<T, E>>, TypedView<E>,
        [E: Error + 'static]);
    rung!(ClassifyDynView, batch_size_classify_kind, &&&Tag<Result<T, E>>, DynView<E>,
        [E: AsRef<dyn Error + 'static>]);
    rung!(ClassifyText, batch_size_classify_kind, &&Tag<Result<T, E>>, Text<E>, [E: Display]);
    rung!(
        ClassifyUnclassifiable,
        batch_size_classify_kind,
        &Tag<Result<T, E>>,
        Unclassifiable<E>,
        []
    );

    /// The bottom rung, for any return type: the kind when it is not a `Result`.
    macro_rules! not_a_result {
        ($(#[$doc:meta])* $trait:ident, $method:ident, $kind:ident) => {
            $(#[$doc])*
            pub trait $trait {
                /// The kind chosen.
                type Kind;
                /// The kind chosen.
                fn $method(&self) -> Self::Kind;
            }
            impl<R> $trait for Tag<R> {
                type Kind = $kind<R>;
                fn $method(&self) -> $kind<R> {
                    $kind::new()
                }
            }
        };
    }

    not_a_result!(
        /// Not a `Result`: only a panic can be out-of-memory.
        ClassifyPanicOnly, batch_size_classify_kind, PanicOnly
    );

    rung!(GiveUpViaFrom, batch_size_give_up_kind, &&&&&Tag<Result<T, E>>, ViaFrom<E>,
        [E: From<NoExecutableBatchSize>]);
    rung!(GiveUpViaIo, batch_size_give_up_kind, &&&&Tag<Result<T, E>>, ViaIo<E>,
        [E: From<std::io::Error>]);
    rung!(GiveUpViaString, batch_size_give_up_kind, &&&Tag<Result<T, E>>, ViaString<E>,
        [E: From<String>]);
    rung!(GiveUpViaBox, batch_size_give_up_kind, &&Tag<Result<T, E>>, ViaBox<E>,
        [E: From<Box<dyn Error + Send + Sync>>]);
    rung!(
        GiveUpReturnLastError,
        batch_size_give_up_kind,
        &Tag<Result<T, E>>,
        ReturnLastError<E>,
        []
    );

    not_a_result!(
        /// Not a `Result`: a panic with the message.
        GiveUpPanic, batch_size_give_up_kind, PanicWithError
    );
}
