//! Agreement between ranks (threads as ranks) and the Id's file exchange, with ranks as threads
//! and as child processes of this binary. One binary, a module per file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[path = "../common/exact_name.rs"]
mod exact_name;

mod agree;
mod exchange;
mod safe_point_composes;
