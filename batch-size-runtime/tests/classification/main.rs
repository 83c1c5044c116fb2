//! What counts as out of memory and what its figures say: the table of patterns, every
//! framework's messages as they really are, the figures read from them. One binary, a module per
//! file, apart from the searches: `oom::add_rule` is process-wide, and `classification`'s rule
//! ("arena exhausted") would turn `search::policies`' plain error into an out-of-memory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[path = "../common/candle_cuda_error.rs"]
mod candle_cuda_error;

mod classification;
mod figures;
mod frameworks;
