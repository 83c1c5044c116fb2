//! The runners that learn across steps and trials: `EffectiveBatch`, `Chunked`, uneven shares,
//! the tuner. One binary, a module per file; each proptest's persisted failures sit beside its
//! module (`<module>.proptest-regressions`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[path = "../common/bisect.rs"]
mod bisect;
#[path = "../common/block_on.rs"]
mod block_on;
#[path = "../common/lengths.rs"]
mod lengths;
#[path = "../common/temp_folder.rs"]
mod temp_folder;
#[path = "../common/training.rs"]
mod training;

mod by_cost;
mod chunked;
mod convergence;
mod effective_batch;
mod effective_first_step;
mod long_runs;
mod tuner;
mod tuner_budget;
mod tuner_noise;
mod tuner_shapes;
mod tuner_throughput;
mod tuner_trust;
mod uneven_shares;
