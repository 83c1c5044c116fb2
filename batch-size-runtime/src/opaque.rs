//! A value whose `Debug` says only that it is there: the closures a user hands a runner (a
//! clock, a callback), so that the types holding one derive `Debug` like any other.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// `T`, printed as `..` by `Debug`.
pub(crate) struct Opaque<T>(pub(crate) T);

impl<T> fmt::Debug for Opaque<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("..")
    }
}

impl<T> Deref for Opaque<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Opaque<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}
