//! Nothing to export: this crate holds the trybuild suite (`tests/ui.rs`), whose cases use only
//! its dependencies (`batch_size_runtime`, `anyhow`, `thiserror`).
