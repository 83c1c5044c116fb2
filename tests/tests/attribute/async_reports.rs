//! Each search's report reaches its own caller through `on_report`, also for `async fn`s that
//! move between the threads of a multi-threaded executor while many searches run at once:
//! `last_report()`, per thread, cannot promise that.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_size_runtime::{find_executable_batch_size, OutOfMemory, SearchReport};

/// Where one call's report lands.
type ReportSlot = Arc<Mutex<Option<SearchReport>>>;

#[find_executable_batch_size(
    starting = 256,
    on_report = {
        let slot = Arc::clone(slot);
        move |report: &SearchReport| {
            if let Ok(mut slot) = slot.lock() {
                *slot = Some(report.clone());
            }
        }
    }
)]
async fn train(batch_size: usize, fits: usize, slot: &ReportSlot) -> anyhow::Result<usize> {
    // Yield to the executor inside every attempt, so searches interleave and hop threads.
    tokio::time::sleep(Duration::from_millis(1)).await;
    if batch_size > fits {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[test]
fn concurrent_async_searches_each_receive_their_own_report() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut tasks = Vec::new();
        for fits in 1..=64usize {
            tasks.push(tokio::spawn(async move {
                let slot: ReportSlot = Arc::default();
                let found = train(fits, &slot).await.unwrap();
                let report = slot.lock().unwrap().take().unwrap();
                (fits, found, report)
            }));
        }
        for task in tasks {
            let (fits, found, report) = task.await.unwrap();
            // Halving from 256: the largest power of two that fits.
            let expected = 1usize << fits.ilog2();
            assert_eq!(found, expected, "fits {fits}");
            assert_eq!(report.batch_size(), Some(expected), "fits {fits}");
            let sizes: Vec<usize> = report
                .attempts()
                .map(|attempt| attempt.batch_size)
                .collect();
            let mut halving = vec![256usize];
            while *halving.last().unwrap() > expected {
                halving.push(halving.last().unwrap() / 2);
            }
            assert_eq!(sizes, halving, "fits {fits}: this search's own attempts");
        }
    });
}

#[test]
fn the_builder_returns_the_report_with_the_result() {
    let (found, report) = batch_size_runtime::BatchSizeSearch::new(64).run_with_report(|size| {
        if size > 20 {
            return Err(anyhow::Error::new(OutOfMemory::new()));
        }
        Ok(size)
    });
    assert_eq!(found.unwrap(), 16);
    assert_eq!(report.len(), 3);
    // Every search, whatever door it came in by, also leaves its report in `last_report()`.
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 3);
}
