//! The cache of sizes that fit, on disk and in the process, and runs resumed from it. One
//! binary, a module per file. `cache::the_environment_names_the_folder` sets
//! `BATCH_SIZE_CACHE_DIR`: every other search of this binary names its own folder.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[path = "../common/exact_name.rs"]
mod exact_name;
#[path = "../common/temp_folder.rs"]
mod temp_folder;
#[path = "../common/warnings.rs"]
mod warnings;

mod cache;
mod cache_figures;
mod cache_validation;
mod resume;
