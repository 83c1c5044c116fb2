//! Remedies, when even the smallest batch runs out of memory: the order they are applied in,
//! the settings restored from the cache, the contract on a second cost model. One binary, a
//! module per file; the tests that clear the process's cache take `remedies::cache_lock`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[path = "../common/warnings.rs"]
mod warnings;

mod remedies;
mod remedies_contract;
