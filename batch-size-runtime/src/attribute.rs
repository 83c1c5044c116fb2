//! What `#[find_executable_batch_size]` asks of the types and arguments you write: a batch size
//! of a primitive integer type ([`BatchSizeInt`]) and parameters that each attempt can have
//! afresh ([`ClonePerAttempt`] for the owned ones). A compile error names these traits when a
//! type does not fit; the functions here (hidden) are what the generated code calls, so that
//! such an error points at your argument.

use crate::engine::Invalid;
use crate::runners::search::BatchSizeSearch;

/// An argument of the attribute that is not a batch size (a negative `starting`): name and value.
#[derive(Debug, Clone)]
pub struct NotABatchSize {
    setting: &'static str,
    value: String,
}

impl NotABatchSize {
    fn of(setting: &'static str, value: impl std::fmt::Display) -> Self {
        NotABatchSize {
            setting,
            value: value.to_string(),
        }
    }

    fn into_invalid(self) -> Invalid {
        Invalid::NotABatchSize {
            setting: self.setting,
            value: self.value,
        }
    }
}

/// The search for the attribute's `starting`, its sizes capped to what `P` can hold.
#[inline]
pub fn search<'r, P: BatchSizeInt>(
    label: &'static str,
    starting: Result<usize, NotABatchSize>,
) -> BatchSizeSearch<'r> {
    match starting {
        Ok(starting) => {
            let mut search =
                BatchSizeSearch::new(starting.min(P::MAX_BATCH_SIZE)).with_label(label);
            search.settings.type_max = P::MAX_BATCH_SIZE;
            search
        }
        Err(why) => {
            let mut search = BatchSizeSearch::new(1).with_label(label);
            search.invalidate(why.into_invalid());
            search
        }
    }
}

/// `starting` of any integer type, checked where it is written.
pub fn starting_of<S: BatchSizeInt>(starting: S) -> Result<usize, NotABatchSize> {
    starting
        .to_batch_size()
        .ok_or_else(|| NotABatchSize::of("starting", starting))
}

/// `min = EXPR` of any integer type; 0 or below is an invalid configuration.
#[inline]
pub fn with_min<'r, M: BatchSizeInt>(search: BatchSizeSearch<'r>, min: M) -> BatchSizeSearch<'r> {
    with_count(search, min, "min", BatchSizeSearch::with_min)
}

/// `max_attempts = EXPR` of any integer type; 0 or below is an invalid configuration.
pub fn with_max_attempts<'r, M: BatchSizeInt>(
    search: BatchSizeSearch<'r>,
    max_attempts: M,
) -> BatchSizeSearch<'r> {
    with_count(
        search,
        max_attempts,
        "max_attempts",
        BatchSizeSearch::with_max_attempts,
    )
}

/// A count argument of any integer type, set with `set`, or the search made invalid.
#[inline]
fn with_count<'r, M: BatchSizeInt>(
    mut search: BatchSizeSearch<'r>,
    value: M,
    name: &'static str,
    set: fn(BatchSizeSearch<'r>, usize) -> BatchSizeSearch<'r>,
) -> BatchSizeSearch<'r> {
    match value.to_batch_size() {
        Some(value) => set(search, value),
        None => {
            search.invalidate(NotABatchSize::of(name, value).into_invalid());
            search
        }
    }
}

/// `effective = EXPR`: the search's sizes are micro sizes, at most `effective`; 0 or below is an
/// invalid configuration.
pub fn with_effective<'r>(
    search: BatchSizeSearch<'r>,
    effective: &Result<usize, NotABatchSize>,
) -> BatchSizeSearch<'r> {
    let mut search = search;
    match effective {
        Ok(0) => search.invalidate(Invalid::EffectiveIsZero),
        Ok(effective) => {
            search.starting = search.starting.min(*effective);
            // A micro size never passes the effective batch: growth after a step stops there.
            let max = search
                .settings
                .max
                .map_or(*effective, |max| max.min(*effective));
            search.settings.set_max(max);
        }
        Err(why) => search.invalidate(
            NotABatchSize {
                setting: "effective",
                ..why.clone()
            }
            .into_invalid(),
        ),
    }
    search
}

/// The attempt's plan: `effective` samples in micro-batches of `micro`.
pub fn plan(effective: &Result<usize, NotABatchSize>, micro: usize) -> crate::BatchPlan {
    crate::BatchPlan::new(effective.as_ref().map_or(0, |effective| *effective), micro)
}

/// `remedies = EXPR`: a `Remedies<S>` or a reference to one; the attribute keeps a handle.
#[diagnostic::on_unimplemented(
    message = "`remedies = ...` takes a `Remedies<S>` (or `&Remedies<S>`), not `{Self}`",
    label = "not a `Remedies`",
    note = "build one with `Remedies::new(settings).then(Remedy::switch(..))`"
)]
pub trait RemediesArgument<S> {
    /// A handle on the same state.
    fn handle(&self) -> crate::remedies::Remedies<S>;
}

impl<S: Clone + Send + 'static> RemediesArgument<S> for crate::remedies::Remedies<S> {
    fn handle(&self) -> crate::remedies::Remedies<S> {
        self.clone()
    }
}

impl<S: Clone + Send + 'static> RemediesArgument<S> for &crate::remedies::Remedies<S> {
    fn handle(&self) -> crate::remedies::Remedies<S> {
        (*self).clone()
    }
}

/// The handle the attempts share.
pub fn remedies_handle<S, R: RemediesArgument<S>>(remedies: &R) -> crate::remedies::Remedies<S> {
    remedies.handle()
}

/// `remedies = EXPR`: the search may apply them when no size fits.
pub fn with_remedies<'r, S: Clone + Send + 'static>(
    mut search: BatchSizeSearch<'r>,
    remedies: &crate::remedies::Remedies<S>,
) -> BatchSizeSearch<'r> {
    search.settings.remedies = Some(remedies.control());
    search
}

/// The attempt's batch size in the parameter's own type.
pub fn batch_size_as<P: BatchSizeInt>(size: usize) -> P {
    P::from_batch_size(size)
}

/// An owned parameter is cloned for every attempt.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is passed by value to a `#[find_executable_batch_size]` function, so it is cloned for every attempt, but it does not implement `Clone`",
    label = "this parameter is cloned for each attempt",
    note = "take it by reference (`&{Self}` or `&mut {Self}`), or implement `Clone` for it"
)]
pub trait ClonePerAttempt: Sized {
    /// The copy for one attempt.
    fn clone_for_attempt(&self) -> Self;
}

impl<T: Clone> ClonePerAttempt for T {
    fn clone_for_attempt(&self) -> Self {
        self.clone()
    }
}

/// A primitive integer that can be a batch size.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a batch size",
    label = "expected a primitive integer type (`usize`, `u32`, `i64`, ...)"
)]
pub trait BatchSizeInt: Copy + std::fmt::Display {
    /// The largest batch size this type holds.
    const MAX_BATCH_SIZE: usize;
    /// The size as `usize`, or `None` where it cannot be one (negative).
    fn to_batch_size(self) -> Option<usize>;
    /// The size in this type (sizes never exceed `MAX_BATCH_SIZE`).
    fn from_batch_size(size: usize) -> Self;
}

macro_rules! batch_size_int {
    ($($int:ty),*) => {$(
        impl BatchSizeInt for $int {
            const MAX_BATCH_SIZE: usize = if (<$int>::MAX as u128) > (usize::MAX as u128) {
                usize::MAX
            } else {
                <$int>::MAX as usize
            };
            fn to_batch_size(self) -> Option<usize> {
                usize::try_from(self).ok()
            }
            fn from_batch_size(size: usize) -> Self {
                // The search never goes above `MAX_BATCH_SIZE`, so this does not saturate.
                <$int>::try_from(size).unwrap_or(<$int>::MAX)
            }
        }
    )*};
}

batch_size_int!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);
