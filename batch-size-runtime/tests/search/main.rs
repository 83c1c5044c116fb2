//! The search itself, through every door: the engine's rules, the policies, the guided default,
//! the attribute's growth after a step, the host's memory, the logs a user reads. One binary, a
//! module per file (each binary links the whole crate once, not once a file).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

// The shared helpers, once for the binary; each module `use`s the ones it needs.
#[cfg(target_os = "linux")]
#[path = "../common/address_space.rs"]
mod address_space;
#[path = "../common/block_on.rs"]
mod block_on;
#[path = "../common/exact_name.rs"]
mod exact_name;
#[path = "../common/warnings.rs"]
mod warnings;
#[path = "../common/workloads.rs"]
mod workloads;

mod accelerate_port;
mod docs_layout;
mod engine_rules;
mod grow_after_a_step;
mod growth_as_a_value;
mod growth_seams;
mod growth_targets;
mod guided;
mod guided_never_worse;
mod host_memory;
mod leftovers;
mod log_words;
mod logs;
mod one_door;
mod one_way_to_build;
mod policies;
mod properties;
mod repeated_size;
