//! The `#[find_executable_batch_size]` attribute (being written).
