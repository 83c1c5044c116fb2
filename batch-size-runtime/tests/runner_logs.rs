//! What the runners log: each line names the user's work (the function its closure is written
//! in, or `with_label`'s), the tuner tells each trial as it runs, and a growth after a step is
//! INFO, not WARN. Every test here reads the logs of its own thread through one global
//! subscriber ([`log_capture`]).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

#[path = "common/log_capture.rs"]
mod log_capture;

use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::{step_done, BatchSizeSearch, Chunked, EffectiveBatch, OutOfMemory, Tuner};
use log_capture::capture;

/// A step that fits up to `limit` samples.
fn fits_up_to(limit: usize, size: usize) -> anyhow::Result<()> {
    if size > limit {
        Err(OutOfMemory::new())?;
    }
    Ok(())
}

// -------------------------------------------------------------------------------------------
// The log lines name the user's work, and the tuner's trials are logged as they run.

fn tune_the_classifier() -> Vec<String> {
    capture(|| {
        Tuner::new()
            .with_max(64)
            .with_release(batch_size_runtime::Release::none())
            .run(|size| fits_up_to(40, size))
            .unwrap()
    })
    .1
}

#[test]
fn the_tuners_log_lines_name_the_function_that_tuned() {
    let lines = tune_the_classifier();
    let labelled: Vec<&String> = lines.iter().filter(|l| l.contains("function=")).collect();
    assert!(!labelled.is_empty(), "{lines:#?}");
    for line in &labelled {
        assert!(
            line.contains("tune_the_classifier"),
            "a line not naming the work: {line}"
        );
        assert!(!line.contains("batch_size_search"), "{line}");
    }
    // Each trial that ran is told at INFO as it runs, not only the answer at the end.
    let trials_told = lines
        .iter()
        .filter(|l| l.starts_with("INFO") && l.contains("trial"))
        .count();
    let ran = batch_size_runtime::last_report()
        .unwrap()
        .attempts()
        .filter(|a| a.outcome.is_success())
        .count();
    assert!(trials_told >= ran - 1, "{trials_told} of {ran}: {lines:#?}");
}

fn embed_the_corpus() -> Vec<String> {
    capture(|| {
        Chunked::new(100)
            .with_starting(64)
            .for_each(|items| fits_up_to(20, items.len()))
            .unwrap()
    })
    .1
}

#[test]
fn chunked_log_lines_name_the_function_that_ran_the_chunks() {
    let lines = embed_the_corpus();
    let labelled: Vec<&String> = lines.iter().filter(|l| l.contains("function=")).collect();
    assert!(!labelled.is_empty(), "{lines:#?}");
    for line in labelled {
        assert!(line.contains("embed_the_corpus"), "{line}");
    }
}

fn pretrain_the_encoder() -> Vec<String> {
    capture(|| {
        EffectiveBatch::new(64)
            .step(|plan| fits_up_to(20, plan.micro()))
            .unwrap()
    })
    .1
}

#[test]
fn effective_batch_log_lines_name_the_function_that_stepped() {
    let lines = pretrain_the_encoder();
    let labelled: Vec<&String> = lines.iter().filter(|l| l.contains("function=")).collect();
    assert!(!labelled.is_empty(), "{lines:#?}");
    for line in labelled {
        assert!(line.contains("pretrain_the_encoder"), "{line}");
    }
}

#[test]
fn a_label_given_is_the_label_logged_by_every_runner() {
    let ((), lines) = capture(|| {
        Tuner::new()
            .with_label("sizing")
            .with_max(8)
            .run(|size| fits_up_to(4, size))
            .unwrap();
        Chunked::new(10)
            .with_label("embeddings")
            .with_starting(8)
            .for_each(|items| fits_up_to(4, items.len()))
            .unwrap();
        EffectiveBatch::new(8)
            .with_label("pretraining")
            .step(|plan| fits_up_to(4, plan.micro()))
            .unwrap();
    });
    for label in ["sizing", "embeddings", "pretraining"] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("function=\"{label}\""))),
            "{label}: {lines:#?}"
        );
    }
}

// -------------------------------------------------------------------------------------------
// A growth after a step is INFO, never WARN.

/// 2 GiB of weights, then 24 layers of 5 MiB a sample: each failure comes part-way through the
/// step and says only "smaller"; a step that completes measures the whole step.
fn layered_step(device: &SimulatedDevice, batch_size: usize) -> Result<(), OutOfMemory> {
    let mut held = vec![device.alloc(2 << 30)?];
    for _ in 0..24 {
        held.push(device.alloc(batch_size as u64 * (5 << 20))?);
    }
    Ok(())
}

#[test]
fn a_growth_is_logged_at_info_not_warn() {
    let device = SimulatedDevice::new(16 << 30);
    let (_, lines) = capture(|| {
        BatchSizeSearch::new(64)
            .with_release(device.clone())
            .run(|batch_size| -> anyhow::Result<usize> {
                layered_step(&device, batch_size)?;
                step_done()?;
                Ok(batch_size)
            })
            .unwrap()
    });
    assert!(
        lines
            .iter()
            .any(|line| line.starts_with("INFO")
                && line.contains("the first step with batch size 64")),
        "{lines:#?}"
    );
    assert!(
        !lines.iter().any(|line| line.starts_with("WARN")),
        "{lines:#?}"
    );
}

/// Where the call measured the step and the size stops growing, the line that reports the
/// size found says why it stays there.
#[test]
fn the_size_found_says_why_it_stops_growing() {
    let device = SimulatedDevice::new(16 << 30);
    let (found, lines) = capture(|| {
        BatchSizeSearch::new(64)
            .with_release(device.clone())
            .run(|batch_size| -> anyhow::Result<usize> {
                layered_step(&device, batch_size)?;
                step_done()?;
                Ok(batch_size)
            })
            .unwrap()
    });
    assert!(found > 64, "grew from 64 to {found}");
    let reported: Vec<&String> = lines
        .iter()
        .filter(|line| line.starts_with("INFO") && line.contains("found executable batch size"))
        .collect();
    assert_eq!(reported.len(), 1, "{lines:#?}");
    assert!(reported[0].contains("it stays there: "), "{reported:#?}");
}

// -------------------------------------------------------------------------------------------
// A retry's WARN line is a sentence a newcomer reads: what happened, what comes next, and why.

#[test]
fn a_retry_says_what_happened_and_what_comes_next_in_words() {
    let (_, lines) = capture(|| {
        BatchSizeSearch::new(64)
            .with_release(batch_size_runtime::Release::none())
            .run(|size| -> anyhow::Result<usize> {
                fits_up_to(20, size)?;
                Ok(size)
            })
            .unwrap()
    });
    let warns: Vec<&String> = lines.iter().filter(|l| l.starts_with("WARN")).collect();
    assert!(
        warns
            .iter()
            .any(|line| line.contains("out of memory; retrying")
                && line.contains("batch_size=64 next_batch_size=32")),
        "{lines:#?}"
    );
    // Why, on the INFO line that follows: the retry's line stays short.
    assert!(
        lines.iter().any(|line| line.starts_with("INFO")
            && line.contains("why 32: the error gave no memory figures, so the size is halved")),
        "{lines:#?}"
    );
    // No jargon from the source: the ladder, rungs, "proved".
    for line in &warns {
        for jargon in ["ladder", "rung", "proved"] {
            assert!(!line.contains(jargon), "{jargon}: {line}");
        }
    }
}

#[test]
fn a_rank_that_retries_because_another_ran_out_says_so_first() {
    let (_, lines) = capture(|| {
        BatchSizeSearch::new(64)
            .with_release(batch_size_runtime::Release::none())
            .run(|size| -> anyhow::Result<usize> {
                if size > 32 {
                    // What `safe_point` answers on a rank whose own step fitted.
                    Err(batch_size_runtime::agree::OutOfMemoryOnAnotherRank)?;
                }
                Ok(size)
            })
            .unwrap()
    });
    assert!(
        lines.iter().any(|line| line.starts_with("WARN")
            && line.contains("another rank ran out of memory (this rank's step fitted); retrying")
            && line.contains("batch_size=64 next_batch_size=32")),
        "{lines:#?}"
    );
}
