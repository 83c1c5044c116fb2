//! A long chunked run keeps a bounded record that still holds every failure and exact counts:
//! 10^5 chunks, a hundred of which run out of memory once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::collections::HashSet;

use batch_size_runtime::{last_report, Chunked, OutOfMemory, Outcome, SearchReport};

#[test]
fn a_long_run_keeps_every_failure_and_exact_counts_in_bounded_memory() {
    const CHUNK: usize = 8;
    const CHUNKS: usize = 100_000;
    let mut failed_once = HashSet::new();
    let mut chunked = Chunked::new(CHUNK * CHUNKS)
        .with_starting(CHUNK)
        .with_max(CHUNK)
        .with_factor(0.5)
        .with_grow_after(1);
    let outputs = chunked
        .run(|items| -> anyhow::Result<Vec<usize>> {
            // The chunk holding every 8,000th item runs out of memory the first time it runs: a
            // transient failure, which must neither stop the run nor shrink it for good.
            let marked = items.clone().find(|item| item % (1000 * CHUNK) == 0);
            if marked.is_some_and(|item| failed_once.insert(item)) {
                Err(OutOfMemory::new())?;
            }
            Ok(items.collect())
        })
        .unwrap();
    assert_eq!(outputs.len(), CHUNK * CHUNKS);
    assert!(outputs
        .iter()
        .enumerate()
        .all(|(index, &item)| index == item));

    let report = last_report().unwrap();
    let failures = failed_once.len();
    assert_eq!(failures, 100);
    // Exact counts over every attempt.
    assert_eq!(report.out_of_memory_count(), failures);
    assert_eq!(report.len(), chunked.chunk_count());
    assert!(report.len() > CHUNKS);
    assert!(report.smallest_out_of_memory().is_some());
    assert_eq!(report.largest_success(), Some(CHUNK));
    // Every failure is kept, each with its own number; the successes in between are counted.
    let kept: Vec<_> = report.attempts().collect();
    let kept_failures = kept
        .iter()
        .filter(|attempt| matches!(attempt.outcome, Outcome::OutOfMemory { .. }))
        .count();
    assert_eq!(kept_failures, failures);
    assert_eq!(kept.len() + report.elided(), report.len());
    assert!(kept.windows(2).all(|pair| pair[0].number < pair[1].number));
    assert_eq!(kept.last().unwrap().number, report.len());
    // Bounded: the first ones, the failures, the last ones.
    let bound = SearchReport::KEPT_FIRST + failures + 2 * SearchReport::KEPT_LAST_SUCCESSES + 1;
    assert!(kept.len() <= bound, "{} kept, bound {bound}", kept.len());

    // The chunk records: the same rule.
    let records = chunked.chunks();
    assert_eq!(records.iter().filter(|chunk| !chunk.done).count(), failures);
    assert!(records.len() <= bound, "{} records", records.len());
    assert_eq!(records.last().unwrap().range.end, CHUNK * CHUNKS);
}
