//! A WARN line reads as a sentence: what ran out (the error's own words), then what the search
//! does next and why, with no notation to decode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use crate::warnings;

use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
use warnings::Warnings;

/// Runs `run` with a subscriber of its own; the WARN lines it logged.
fn warnings_of<T>(run: impl FnOnce() -> T) -> Vec<String> {
    let warnings = Warnings::default();
    tracing::subscriber::with_default(warnings.clone(), run);
    warnings.all()
}

#[test]
fn an_error_without_figures_says_why_halving_comes_next() {
    let lines = warnings_of(|| {
        BatchSizeSearch::new(64).run(|size| -> anyhow::Result<usize> {
            if size > 16 {
                Err(OutOfMemory::new())?;
            }
            Ok(size)
        })
    });
    // The why comes on an INFO line of its own (`runner_logs.rs` reads it): the WARN stays short.
    assert!(
        lines[0].contains("out of memory; retrying")
            && lines[0].contains("batch_size=64 next_batch_size=32"),
        "{lines:#?}"
    );
}
