//! Chunked work keeps its progress: every item done once by a chunk that completed, in order,
//! a chunk that ran out of memory redone smaller from its own start.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{memory::SimulatedDevice, ChunkError, Chunked};
use proptest::prelude::*;

use crate::block_on;
use block_on::block_on;

const UNIT: u64 = 1 << 20; // 1 MiB of activations a unit of cost

/// The outputs, every completed chunk's items, and the runner.
type Embedded<'a> = (
    Result<Vec<usize>, ChunkError<anyhow::Error>>,
    Vec<std::ops::Range<usize>>,
    Chunked<'a>,
);

/// Runs `Chunked` over `costs` on a device of `capacity` units, the device losing `lost` units
/// once `lose_at` items are done. Returns the outputs and every successful chunk's range.
fn embed(
    costs: &[u64],
    capacity: u64,
    starting: usize,
    lose_at: Option<(usize, u64)>,
    grow_after: usize,
) -> Embedded<'_> {
    let device = SimulatedDevice::new(capacity * UNIT);
    let mut held = None;
    let mut completed_chunks = Vec::new();
    let mut chunked = Chunked::new(costs.len())
        .with_starting(starting)
        .with_grow_after(grow_after)
        .with_release(device.clone())
        .with_cost(|i| costs[i]);
    let result = chunked.run(|items| -> anyhow::Result<Vec<usize>> {
        if let Some((at, lost)) = lose_at {
            if items.start >= at && held.is_none() {
                held = Some(device.alloc(lost * UNIT)?);
            }
        }
        let cost: u64 = items.clone().map(|i| costs[i]).sum();
        let _activations = device.alloc(cost * UNIT)?;
        completed_chunks.push(items.clone());
        Ok(items.collect())
    });
    (result, completed_chunks, chunked)
}

#[test]
fn a_late_out_of_memory_redoes_only_the_failing_chunk() {
    let costs = vec![1u64; 1000];
    // 100 units fit until item 900, then another process takes 70.
    let (result, chunks, chunked) = embed(&costs, 100, 100, Some((900, 70)), 0);
    let outputs = result.unwrap();
    assert_eq!(outputs, (0..1000).collect::<Vec<_>>());
    // Nine chunks of 100 ran once each; then the chunk at 900 failed and was redone smaller.
    assert_eq!(
        &chunks[..9],
        &(0..9).map(|c| c * 100..c * 100 + 100).collect::<Vec<_>>()[..]
    );
    let failed: Vec<_> = chunked
        .chunks()
        .iter()
        .filter(|chunk| !chunk.done)
        .collect();
    // Redone from its own start, never below what halving would have tried: 50, then 25.
    assert!(
        !failed.is_empty() && failed.len() <= 2,
        "{:?}",
        chunked.chunks()
    );
    assert!(failed.iter().all(|chunk| chunk.range.start == 900));
    assert!(chunks[9].start == 900 && chunks[9].len() <= 30 && chunks[9].len() >= 25);
}

#[test]
fn growing_back_never_reaches_a_size_that_failed_and_stops_at_max() {
    let device = SimulatedDevice::new(50 * UNIT);
    // Doubling is the rule without figures (the device's figures would take the chunk to 50
    // at once): the rule under test here.
    let mut chunked = Chunked::new(2000)
        .with_starting(16)
        .with_grow_after(2)
        .with_factor(0.5)
        .with_convergence(false)
        .with_release(device.clone());
    chunked
        .for_each(|items| -> anyhow::Result<()> {
            let _activations = device.alloc(items.len() as u64 * UNIT)?;
            Ok(())
        })
        .unwrap();
    let budgets: Vec<usize> = chunked.chunks().iter().map(|chunk| chunk.budget).collect();
    // 16, 16, then 32, 32, then 64 fails; back to 32, and 2 × 32 is not below 64: no growth,
    // until 64 has held growth back for 16 clean chunks; then 64 is tried once more (the failure
    // might have been the moment's), fails, and waits twice as long: 32, 64, 128 chunks.
    assert_eq!(&budgets[..6], &[16, 16, 32, 32, 64, 32]);
    let failed: Vec<usize> = (0..budgets.len())
        .filter(|&i| !chunked.chunks()[i].done)
        .collect();
    assert!(failed.iter().all(|&i| budgets[i] == 64), "{budgets:?}");
    let gaps: Vec<usize> = failed.windows(2).map(|pair| pair[1] - pair[0]).collect();
    assert!(gaps.first().is_some_and(|&gap| gap > 16), "{budgets:?}");
    assert!(gaps.windows(2).all(|pair| pair[1] > pair[0]), "{budgets:?}");
    assert!(
        budgets[5..]
            .iter()
            .all(|&budget| budget == 32 || budget == 64),
        "{budgets:?}"
    );

    let mut capped = Chunked::new(500)
        .with_starting(4)
        .with_grow_after(1)
        .with_max(16);
    capped.for_each(|_| Ok::<_, anyhow::Error>(())).unwrap();
    assert!(capped.chunks().iter().all(|chunk| chunk.budget <= 16));
    assert_eq!(
        capped.chunks().iter().map(|chunk| chunk.budget).max(),
        Some(16)
    );
}

#[test]
fn costs_budget_the_chunks() {
    // Short and long sequences: chunks of short ones hold more items.
    let costs: Vec<u64> = (0..200).map(|i| if i < 100 { 1 } else { 8 }).collect();
    let (result, chunks, _) = embed(&costs, 40, 40, None, 4);
    assert_eq!(result.unwrap().len(), 200);
    let short = chunks.iter().find(|chunk| chunk.start < 100).unwrap();
    let long = chunks
        .iter()
        .rev()
        .find(|chunk| chunk.start >= 100)
        .unwrap();
    assert!(short.len() > long.len(), "{short:?} {long:?}");
}

#[test]
fn bad_input() {
    // No items: no call.
    let mut calls = 0;
    let none = Chunked::new(0)
        .run(|_| -> anyhow::Result<Vec<u8>> {
            calls += 1;
            Ok(Vec::new())
        })
        .unwrap();
    assert!(none.is_empty() && calls == 0);

    // Items of cost 0 are packed with the rest and cost nothing.
    let costs = [0u64, 0, 5, 0, 5];
    let (result, _, _) = embed(&costs, 100, 10, None, 4);
    assert_eq!(result.unwrap(), [0, 1, 2, 3, 4]);

    // One item too large for the device: named.
    let costs = [1u64, 1, 500, 1];
    let (result, _, _) = embed(&costs, 100, 10, None, 4);
    match result.unwrap_err() {
        ChunkError::ItemTooLarge {
            item,
            cost,
            completed,
            ..
        } => {
            assert_eq!((item, cost, completed), (2, 500, 2));
        }
        other => panic!("{other}"),
    }

    // The wrong number of outputs: a clear error, not a silent misalignment.
    let error = Chunked::new(10)
        .with_starting(4)
        .run(|items| -> anyhow::Result<Vec<usize>> { Ok(items.skip(1).collect()) })
        .unwrap_err();
    match &error {
        ChunkError::WrongOutputCount {
            range,
            expected,
            got,
            completed,
        } => {
            assert_eq!(
                (range.clone(), *expected, *got, *completed),
                (0..4, 4, 3, 0)
            );
        }
        other => panic!("{other}"),
    }
    assert!(error.to_string().contains("one output per item"));

    // An error that is not out-of-memory stops the work, with the items done.
    let error = Chunked::new(10)
        .with_starting(3)
        .for_each(|items| -> anyhow::Result<()> {
            if items.contains(&7) {
                anyhow::bail!("bad record");
            }
            Ok(())
        })
        .unwrap_err();
    assert_eq!(error.completed(), 6);
    assert!(matches!(error, ChunkError::Failed { .. }));
}

#[test]
fn an_out_of_memory_panic_is_retried_and_the_outputs_stay_in_order() {
    let out = Chunked::new(50)
        .with_starting(50)
        .run(|items| -> anyhow::Result<Vec<usize>> {
            if items.len() > 10 {
                panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
            }
            Ok(items.collect())
        })
        .unwrap();
    assert_eq!(out, (0..50).collect::<Vec<_>>());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn every_item_once_in_order(
        costs in proptest::collection::vec(0u64..20, 0..300),
        capacity in 35u64..200, // room for the costliest item (19) after the largest loss (14)
        starting in 1usize..400,
        lose in proptest::option::of((0usize..300, 1u64..15)),
        grow_after in 0usize..4,
    ) {
        let (result, chunks, chunked) = embed(&costs, capacity, starting, lose, grow_after);
        let outputs = result.unwrap();
        prop_assert_eq!(outputs, (0..costs.len()).collect::<Vec<_>>());
        // The completed chunks tile 0..len exactly once, in order.
        let mut next = 0;
        for chunk in &chunks {
            prop_assert_eq!(chunk.start, next);
            next = chunk.end;
        }
        prop_assert_eq!(next, costs.len());
        prop_assert_eq!(chunked.chunks().iter().filter(|chunk| chunk.done).count(), chunks.len());
    }
}

#[test]
fn the_async_form_keeps_progress_and_order_and_is_send() {
    fn assert_send<F: std::future::Future + Send>(future: F) -> F {
        future
    }
    let device = SimulatedDevice::new(30 * UNIT);
    let mut seen = Vec::new();
    let mut chunked = Chunked::new(200)
        .with_starting(100)
        .with_release(device.clone())
        .on_chunk(|progress| seen.push(progress.completed));
    let outputs = block_on(assert_send(chunked.run_async(|items| {
        let device = device.clone();
        async move {
            let _activations = device.alloc(items.len() as u64 * UNIT)?;
            Ok::<_, anyhow::Error>(items.collect::<Vec<_>>())
        }
    })))
    .unwrap();
    assert_eq!(outputs, (0..200).collect::<Vec<_>>());
    assert!(chunked.chunks().iter().any(|chunk| !chunk.done));
    drop(chunked);
    assert_eq!(seen.last(), Some(&200));
    assert!(seen.windows(2).all(|pair| pair[0] < pair[1]));

    // The wrong number of outputs is caught in the async form too.
    let error = block_on(
        Chunked::new(10)
            .with_starting(5)
            .run_async(
                |items| async move { Ok::<_, anyhow::Error>(items.skip(1).collect::<Vec<_>>()) },
            ),
    )
    .unwrap_err();
    assert!(matches!(error, ChunkError::WrongOutputCount { got: 4, .. }));
}

/// The size of every chunk a run of `chunked` ran, over work that always fits.
fn chunk_sizes(mut chunked: Chunked<'_>) -> Vec<usize> {
    let mut sizes = Vec::new();
    chunked
        .for_each(|items| -> anyhow::Result<()> {
            sizes.push(items.len());
            Ok(())
        })
        .unwrap();
    sizes
}

#[test]
fn with_max_caps_the_first_chunk_whatever_the_start() {
    // No start given (the whole work), a start above `max`: never a chunk above 8.
    for chunked in [
        Chunked::new(100).with_max(8),
        Chunked::new(100).with_starting(50).with_max(8),
    ] {
        let ran = chunk_sizes(chunked);
        assert_eq!(ran.iter().sum::<usize>(), 100);
        assert!(ran.iter().all(|&size| size <= 8), "{ran:?}");
    }
}

#[test]
fn with_max_caps_a_cached_chunk_size() {
    let dir = std::env::temp_dir().join(format!("batch-size-chunked-max-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let device = SimulatedDevice::new(1 << 30);
    let run = |chunked: Chunked<'_>| {
        chunk_sizes(
            chunked
                .with_release(device.clone())
                .with_cache("chunked max")
                .with_cache_dir(&dir),
        )
    };
    // The first run settles on chunks of 100 and caches that.
    assert_eq!(run(Chunked::new(300).with_starting(100)), [100, 100, 100]);
    let capped = run(Chunked::new(300).with_max(8));
    assert!(capped.iter().all(|&size| size <= 8), "{capped:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_reduce_that_does_not_shrink_stops_with_not_smaller() {
    for same_or_larger in [0, 5] {
        let mut chunks = 0;
        let mut chunked = Chunked::new(200)
            .with_starting(100)
            .with_reduce(move |failed| failed.batch_size + same_or_larger);
        let error = chunked
            .for_each(|_| -> anyhow::Result<()> {
                chunks += 1;
                Err(batch_size_runtime::OutOfMemory::new().into())
            })
            .unwrap_err();
        let ChunkError::NoChunkFits { error, .. } = error else {
            panic!("not NoChunkFits: {error}");
        };
        let none_fit = error
            .downcast_ref::<batch_size_runtime::NoExecutableBatchSize>()
            .unwrap();
        assert!(
            matches!(
                none_fit.reason(),
                batch_size_runtime::StopReason::NotSmaller { failed: 100, .. }
            ),
            "{:?}",
            none_fit.reason()
        );
        assert_eq!(chunks, 1, "one chunk ran out of memory, then the stop");
    }
}
