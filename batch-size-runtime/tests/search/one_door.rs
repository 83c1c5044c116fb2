//! Every runner keeps the same contract whatever door the work comes in by: a user's own
//! error enum (thiserror style), `anyhow::Error` and `Box<dyn Error + Send + Sync>` are taken
//! alike; a success, an out-of-memory error recovered, an error that is not out-of-memory
//! returned unchanged after one attempt, and "no size fits" through the user's own type; and
//! every search leaves its report in `last_report()`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::error::Error as _;

use crate::block_on;
use block_on::block_on;

use batch_size_runtime::{
    last_report, BatchPlan, BatchSizeSearch, ChunkError, Chunked, EffectiveBatch,
    NoExecutableBatchSize, OutOfMemory, Tuner,
};

/// The way every thiserror user writes it: the device's error as a source, a data error of
/// their own, and the crate's "no size fits".
#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error("forward pass failed")]
    Device(#[source] OutOfMemory),
    #[error("bad data at row {0}")]
    Data(usize),
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

impl From<OutOfMemory> for TrainError {
    fn from(error: OutOfMemory) -> Self {
        TrainError::Device(error)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An attempt that runs out of memory above `fits`, fails with a data error at `bad`, and
/// counts its calls.
fn attempt(
    size: usize,
    fits: usize,
    bad: Option<usize>,
    calls: &mut usize,
) -> Result<usize, TrainError> {
    *calls += 1;
    if bad.is_some_and(|bad| size <= bad) {
        return Err(TrainError::Data(size));
    }
    if size > fits {
        return Err(OutOfMemory::new().into());
    }
    Ok(size)
}

#[test]
fn the_builder_takes_the_users_enum() {
    let mut calls = 0;
    let fitted = BatchSizeSearch::new(64).run(|size| attempt(size, 20, None, &mut calls));
    assert_eq!(fitted.unwrap(), 16);
    assert_eq!(calls, 3);
    assert_eq!(last_report().unwrap().len(), 3);

    let mut calls = 0;
    let failed = BatchSizeSearch::new(64).run(|size| attempt(size, 100, Some(64), &mut calls));
    assert!(matches!(failed, Err(TrainError::Data(64))), "{failed:?}");
    assert_eq!(
        calls, 1,
        "an error that is not out-of-memory ends the search at once"
    );

    let mut calls = 0;
    let none = BatchSizeSearch::new(8).run(|size| attempt(size, 0, None, &mut calls));
    let Err(TrainError::NoBatchSize(none_fit)) = none else {
        panic!("{none:?}");
    };
    assert_eq!(none_fit.tried(), &[8, 4, 2, 1]);
    // The last out-of-memory error is kept as the source, as the user's own type.
    let source = none_fit.source().unwrap();
    assert!(source.downcast_ref::<TrainError>().is_some(), "{source:?}");
}

#[test]
fn the_builder_takes_anyhow_and_boxes_the_same_way() {
    let mut calls = 0;
    let fitted: anyhow::Result<usize> = BatchSizeSearch::new(64)
        .run(|size| attempt(size, 20, None, &mut calls).map_err(anyhow::Error::new));
    assert_eq!(fitted.unwrap(), 16);

    let mut calls = 0;
    let failed: Result<usize, BoxError> = BatchSizeSearch::new(64)
        .run(|size| attempt(size, 100, Some(64), &mut calls).map_err(BoxError::from));
    let error = failed.unwrap_err();
    assert!(matches!(
        error.downcast_ref::<TrainError>(),
        Some(TrainError::Data(64))
    ));
    assert_eq!(calls, 1);
}

#[test]
fn effective_batch_takes_the_users_enum() {
    let mut runner = EffectiveBatch::new(32);
    let mut calls = 0;
    let step = |plan: &BatchPlan, calls: &mut usize| attempt(plan.micro(), 8, None, calls);
    assert_eq!(runner.step(|plan| step(plan, &mut calls)).unwrap(), 8);
    assert_eq!(runner.micro(), 8);
    assert_eq!(calls, 3); // 32, 16, 8
    assert_eq!(runner.last_step_report().len(), 3);
    assert_eq!(
        last_report().unwrap().len(),
        3,
        "the same report through the thread's last_report()"
    );

    let mut calls = 0;
    let failed = runner.step(|plan| attempt(plan.micro(), 8, Some(8), &mut calls));
    assert!(matches!(failed, Err(TrainError::Data(8))), "{failed:?}");
    assert_eq!(calls, 1);

    let mut runner = EffectiveBatch::new(4);
    let none = runner.step(|plan| attempt(plan.micro(), 0, None, &mut 0));
    assert!(matches!(none, Err(TrainError::NoBatchSize(_))), "{none:?}");
}

#[test]
fn chunked_work_takes_the_users_enum() {
    let mut chunked = Chunked::new(100).with_starting(64);
    let outputs = chunked
        .run(|items| -> Result<Vec<usize>, TrainError> {
            if items.len() > 30 {
                return Err(OutOfMemory::new().into());
            }
            Ok(items.collect())
        })
        .unwrap();
    assert_eq!(outputs, (0..100).collect::<Vec<_>>());
    assert!(last_report().unwrap().out_of_memory_count() >= 1);

    // Not out of memory: the user's error, unchanged, with where to resume.
    let mut calls = 0;
    let failed = Chunked::new(100).with_starting(10).for_each(|items| {
        calls += 1;
        if items.contains(&35) {
            return Err(TrainError::Data(35));
        }
        Ok(())
    });
    match failed {
        Err(ChunkError::Failed {
            completed: 30,
            error: TrainError::Data(35),
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(calls, 4);

    // A closure that itself runs a search that found no size: its error holds the
    // out-of-memory error as its source, so the chunk counts as out of memory and is redone
    // smaller; the run ends as the chunked work's own failure, told by type, never by finding
    // a `NoExecutableBatchSize` inside the user's error.
    let mut inner_searches = 0;
    let nested = Chunked::new(10).with_starting(5).for_each(|_| {
        inner_searches += 1;
        BatchSizeSearch::new(2).run(|_| Err::<(), _>(TrainError::from(OutOfMemory::new())))
    });
    assert!(
        matches!(
            nested,
            Err(ChunkError::ItemTooLarge {
                completed: 0,
                item: 0,
                ..
            })
        ),
        "{nested:?}"
    );
    assert!(inner_searches > 1, "the chunk was redone smaller");

    let none = Chunked::new(10)
        .with_starting(4)
        .with_min(2)
        .for_each(|_| Err::<(), _>(TrainError::from(OutOfMemory::new())));
    assert!(
        matches!(
            none,
            Err(ChunkError::NoChunkFits {
                completed: 0,
                error: TrainError::NoBatchSize(_)
            })
        ),
        "{none:?}"
    );
}

#[test]
fn the_tuner_gives_the_users_error_back_unchanged() {
    let tuned = Tuner::new()
        .with_max(200)
        .run(|size| -> Result<(), TrainError> {
            if size > 100 {
                return Err(OutOfMemory::new().into());
            }
            Ok(())
        })
        .unwrap();
    assert!(
        tuned.largest_fit() <= 100 && tuned.largest_fit() >= 90,
        "{tuned:?}"
    );
    assert_eq!(last_report().unwrap().len(), tuned.report().len());

    let mut calls = 0;
    let failed = Tuner::new().run(|size| -> Result<(), TrainError> {
        calls += 1;
        Err(TrainError::Data(size))
    });
    assert!(matches!(failed, Err(TrainError::Data(_))), "{failed:?}");
    assert_eq!(calls, 1);

    let none = Tuner::new().run(|_| -> Result<(), TrainError> { Err(OutOfMemory::new().into()) });
    assert!(matches!(none, Err(TrainError::NoBatchSize(_))), "{none:?}");
}

#[test]
fn a_panic_that_is_not_out_of_memory_comes_back_with_its_payload_from_every_runner() {
    #[derive(Debug, PartialEq)]
    struct Payload(u32);
    type Door = (&'static str, Box<dyn Fn()>);
    let runners: [Door; 3] = [
        (
            "builder",
            Box::new(|| {
                let _ = BatchSizeSearch::new(4)
                    .run(|_| -> Result<(), TrainError> { std::panic::panic_any(Payload(7)) });
            }),
        ),
        (
            "effective",
            Box::new(|| {
                let _ = EffectiveBatch::new(4)
                    .step(|_| -> Result<(), TrainError> { std::panic::panic_any(Payload(7)) });
            }),
        ),
        (
            "chunked",
            Box::new(|| {
                let _ = Chunked::new(4)
                    .for_each(|_| -> Result<(), TrainError> { std::panic::panic_any(Payload(7)) });
            }),
        ),
    ];
    for (door, run) in runners {
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_err();
        assert_eq!(
            payload.downcast_ref::<Payload>(),
            Some(&Payload(7)),
            "{door}"
        );
    }
}

#[test]
fn the_async_doors_and_step_then_take_the_users_enum_too() {
    // `BatchSizeSearch::run_async`.
    let fitted = block_on(BatchSizeSearch::new(64).run_async(|size| async move {
        if size > 20 {
            return Err(TrainError::from(OutOfMemory::new()));
        }
        Ok(size)
    }));
    assert_eq!(fitted.unwrap(), 16);
    let failed = block_on(
        BatchSizeSearch::new(64)
            .run_async(|size| async move { Err::<usize, _>(TrainError::Data(size)) }),
    );
    assert!(matches!(failed, Err(TrainError::Data(64))), "{failed:?}");

    // `Chunked::run_async`.
    let mut chunked = Chunked::new(50).with_starting(32);
    let outputs = block_on(chunked.run_async(|items| async move {
        if items.len() > 10 {
            return Err(TrainError::from(OutOfMemory::new()));
        }
        Ok(items.collect::<Vec<_>>())
    }));
    assert_eq!(outputs.unwrap(), (0..50).collect::<Vec<_>>());
    let none =
        block_on(Chunked::new(4).with_starting(2).run_async(|_| async move {
            Err::<Vec<usize>, _>(TrainError::from(OutOfMemory::new()))
        }));
    assert!(
        matches!(none, Err(ChunkError::ItemTooLarge { item: 0, .. })),
        "{none:?}"
    );

    // `EffectiveBatch::step_then`: the accumulation is redone in place, the apply runs once.
    let mut runner = EffectiveBatch::new(32);
    let mut applied = 0;
    let loss = runner.step_then(
        |plan| {
            if plan.micro() > 8 {
                return Err(TrainError::from(OutOfMemory::new()));
            }
            Ok(plan.micro_batches().count())
        },
        |_plan, micro_batches| {
            applied += 1;
            Ok(micro_batches)
        },
    );
    assert_eq!((loss.unwrap(), applied), (4, 1));
    let failed = runner.step_then(|_| Err::<usize, _>(TrainError::Data(3)), |_, n| Ok(n));
    assert!(matches!(failed, Err(TrainError::Data(3))), "{failed:?}");
}
