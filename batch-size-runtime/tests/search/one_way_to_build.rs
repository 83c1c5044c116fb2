//! Every runner builds its search one way: the same settings lent, the same cache key filter,
//! the same check before any of your code runs, the same typed errors. One test for each gap
//! the runners' separate ways of building had let through.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::remedies::{Remedies, Remedy};
use batch_size_runtime::{
    agree::ThreadRanks, BatchSizeSearch, Choice, ChunkError, Chunked, EffectiveBatch,
    NoExecutableBatchSize, OutOfMemory, StopReason, Tuner,
};

/// A step that fits up to `limit` samples.
fn fits_up_to(limit: usize, size: usize) -> anyhow::Result<()> {
    if size > limit {
        Err(OutOfMemory::new())?;
    }
    Ok(())
}

fn reason_of(error: &anyhow::Error) -> StopReason {
    error
        .downcast_ref::<NoExecutableBatchSize>()
        .unwrap_or_else(|| panic!("not NoExecutableBatchSize: {error:#}"))
        .reason()
        .clone()
}

// -------------------------------------------------------------------------------------------
// Remedies beside an agreement, wherever the agreement sits.

#[derive(Debug, Clone, Default)]
struct Config {
    checkpointing: bool,
}

#[test]
fn remedies_beside_an_agreement_are_refused_with_uneven_shares_too() {
    let remedies = Remedies::new(Config::default()).then(Remedy::switch(
        "activation checkpointing",
        |c: &mut Config| c.checkpointing = true,
    ));
    for uneven in [false, true] {
        let rank = ThreadRanks::new(1).into_iter().next().unwrap();
        let mut runner = EffectiveBatch::new(8)
            .with_agreement(rank)
            .with_remedies(&remedies);
        if uneven {
            runner = runner.with_uneven_shares();
        }
        let mut calls = 0;
        let error = runner
            .step(|_| -> anyhow::Result<()> {
                calls += 1;
                Ok(())
            })
            .unwrap_err();
        assert_eq!(calls, 0, "uneven {uneven}: the step ran");
        assert!(
            matches!(reason_of(&error), StopReason::InvalidConfiguration(why) if why.contains("remedies are not agreed")),
            "uneven {uneven}: {error:#}"
        );
    }
}

// -------------------------------------------------------------------------------------------
// A cache folder without a key caches nothing, in every runner and for either choice.

#[test]
fn a_cache_folder_without_a_key_caches_nothing_for_the_fastest_size_either() {
    for keyed_empty in [false, true] {
        let dir = std::env::temp_dir().join(format!(
            "batch-size-one-way-no-key-{}-{keyed_empty}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let tune = || {
            // A clock of its own (1 ms a reading): the trials' throughput, and so their
            // number, the same in every run.
            let mut now = std::time::Duration::ZERO;
            let mut tuner = Tuner::new()
                .with_max(64)
                .choose(Choice::Fastest)
                .with_clock(move || {
                    now += std::time::Duration::from_millis(1);
                    now
                })
                .with_release(batch_size_runtime::Release::none())
                .with_cache_dir(&dir);
            if keyed_empty {
                tuner = tuner.with_cache("");
            }
            tuner.run(|size| fits_up_to(40, size)).unwrap()
        };
        let first = tune();
        let second = tune();
        assert!(first.report().len() > 1);
        assert_eq!(
            second.report().len(),
            first.report().len(),
            "the second run was served from a cache with no key"
        );
        let files = std::fs::read_dir(&dir).map_or(0, |entries| entries.count());
        assert_eq!(files, 0, "an entry was written under no key in {dir:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

// -------------------------------------------------------------------------------------------
// `min` above the batch: the same clear error with a cache entry as without.

#[test]
fn min_above_the_effective_batch_is_a_clear_error_on_resume_from_the_cache() {
    let dir = std::env::temp_dir().join(format!("batch-size-one-way-min-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A first run leaves an entry: 16 fits.
    EffectiveBatch::new(64)
        .with_cache("min-above")
        .with_cache_dir(&dir)
        .step(|plan| fits_up_to(16, plan.micro()))
        .unwrap();
    let without_entry = EffectiveBatch::new(64)
        .with_min(100)
        .step(|plan| fits_up_to(16, plan.micro()))
        .unwrap_err();
    let with_entry = std::panic::catch_unwind(|| {
        EffectiveBatch::new(64)
            .with_min(100)
            .with_cache("min-above")
            .with_cache_dir(&dir)
            .step(|plan| fits_up_to(16, plan.micro()))
            .unwrap_err()
    })
    .unwrap_or_else(|_| panic!("a stray panic on resume"));
    assert_eq!(reason_of(&with_entry), reason_of(&without_entry));
    let _ = std::fs::remove_dir_all(&dir);
}

// -------------------------------------------------------------------------------------------
// Fewer items than `min`: one chunk holds them all.

#[test]
fn fewer_items_than_min_run_in_one_chunk() {
    let mut chunked = Chunked::new(10).with_min(16);
    let mut seen = Vec::new();
    chunked
        .for_each(|items| -> anyhow::Result<()> {
            seen.push(items);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, vec![(0..10)]);
    assert_eq!(chunked.chunk_count(), 1);
}

#[test]
fn the_rest_of_a_dataset_below_min_runs_on_resume() {
    let dir = std::env::temp_dir().join(format!("batch-size-one-way-rest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Chunked::new(1000)
        .with_min(16)
        .with_cache("rest")
        .with_cache_dir(&dir)
        .for_each(|items| fits_up_to(200, items.len()))
        .unwrap();
    // The run stopped with 7 items left; the resumed run holds them in one chunk.
    let mut rest = Chunked::new(7)
        .with_min(16)
        .with_cache("rest")
        .with_cache_dir(&dir);
    rest.for_each(|items| fits_up_to(200, items.len())).unwrap();
    assert_eq!(rest.chunks().len(), 1);
    assert_eq!(rest.chunks()[0].range, 0..7);
    let _ = std::fs::remove_dir_all(&dir);
}

// -------------------------------------------------------------------------------------------
// A first size of 0: refused alike by every runner, before any of your code.

#[test]
fn a_first_size_of_zero_is_refused_alike_by_every_runner() {
    let mut calls = 0;
    let search = BatchSizeSearch::new(0)
        .run(|size| {
            calls += 1;
            fits_up_to(8, size)
        })
        .unwrap_err();
    assert_eq!(reason_of(&search), StopReason::StartedAtZero);

    let effective = EffectiveBatch::new(8)
        .with_micro(0)
        .step(|plan| {
            calls += 1;
            fits_up_to(8, plan.micro())
        })
        .unwrap_err();
    assert_eq!(reason_of(&effective), StopReason::StartedAtZero);

    let chunked = Chunked::new(10)
        .with_starting(0)
        .for_each(|items| {
            calls += 1;
            fits_up_to(8, items.len())
        })
        .unwrap_err();
    let ChunkError::NoChunkFits { error, .. } = chunked else {
        panic!("{chunked:?}");
    };
    assert_eq!(reason_of(&error), StopReason::StartedAtZero);

    // The tuner starts at its minimum: 0 is refused there as everywhere else `min` is.
    let tuner = Tuner::new()
        .with_min(0)
        .run(|size| {
            calls += 1;
            fits_up_to(8, size)
        })
        .unwrap_err();
    assert!(
        matches!(reason_of(&tuner), StopReason::InvalidConfiguration(why) if why.contains("`min`")),
        "{tuner:#}"
    );
    assert_eq!(calls, 0);
}

// -------------------------------------------------------------------------------------------
// A chunk that failed by panicking is in the record, as one that returned its error is.

#[test]
fn a_chunk_that_panicked_is_in_the_record() {
    let record = |panics: bool| {
        let mut chunked = Chunked::new(30).with_starting(20);
        chunked
            .for_each(|items| -> anyhow::Result<()> {
                if items.len() > 10 {
                    if panics {
                        panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
                    }
                    Err(OutOfMemory::new())?;
                }
                Ok(())
            })
            .unwrap();
        let done: Vec<bool> = chunked.chunks().iter().map(|chunk| chunk.done).collect();
        (done, chunked.chunk_count())
    };
    let (returned, returned_count) = record(false);
    let (panicked, panicked_count) = record(true);
    assert_eq!(returned.first(), Some(&false), "{returned:?}");
    assert_eq!(panicked, returned);
    assert_eq!(panicked_count, returned_count);
}
