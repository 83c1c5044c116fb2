//! Reruns start from what fit: the cache entry keeps what the step needed at the size that fit
//! (its peak and room), a rerun on the same device starts at the size those figures give, never
//! at or above a size that failed there, and returns to the cached size after one failure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::{Path, PathBuf};

use batch_size_runtime::policy::{clear_process_cache, CacheEntry};
use batch_size_runtime::{last_report, memory::SimulatedDevice, BatchSizeSearch, OutOfMemory};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// 2 GiB, then 24 layers of 5 MiB a sample: 119 fit on 16 GiB.
const FIT: usize = 119;

use crate::temp_folder;
use temp_folder::TempFolder;

fn folder(name: &str) -> TempFolder {
    TempFolder::new("batch-size-cache-figures", name)
}

/// One search of the layered step from `starting`, cached under `key` in `dir`: the size it
/// returned and the sizes it ran.
fn layered(key: &str, dir: &Path, starting: usize) -> (usize, Vec<usize>) {
    let device = SimulatedDevice::new(16 * GIB);
    let found = BatchSizeSearch::new(starting)
        .with_release(device.clone())
        .with_cache(key)
        .with_cache_dir(dir)
        .run(|size| -> anyhow::Result<usize> {
            let mut held = vec![device.alloc(2 * GIB)?];
            for _ in 0..24 {
                held.push(device.alloc(size as u64 * 5 * MIB)?);
            }
            Ok(size)
        })
        .unwrap();
    (found, last_report().unwrap().tried())
}

fn entry(dir: &Path) -> (PathBuf, CacheEntry) {
    let file = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|file| Some(file.ok()?.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "json"))
        .unwrap();
    let entry = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    (file, entry)
}

#[test]
fn a_rerun_starts_at_the_size_the_kept_figures_give() {
    let dir = folder("rerun");
    let (first, _) = layered("figures rerun", &dir, 1000);
    let (_, kept) = entry(&dir);
    assert_eq!(kept.fits, first);
    assert!(
        kept.peak_at_fits.is_some() && kept.room == Some(16 * GIB),
        "{kept:?}"
    );

    // Figures from one step: the peak grown as a line with a fixed part of zero or more, which
    // never overshoots such a step.
    let (second, tried) = layered("figures rerun", &dir, 1000);
    assert_eq!(tried, [second], "one run");
    assert!(second > first && second <= FIT, "{first} then {second}");

    // Two measured steps give the line: near the limit, still in one run.
    let (third, tried) = layered("figures rerun", &dir, 1000);
    assert_eq!(tried, [third], "one run");
    assert!(
        third <= FIT && third as f64 >= 0.95 * FIT as f64,
        "{second} then {third}"
    );
}

#[test]
fn a_figures_start_that_fails_returns_to_the_cached_size_and_is_never_run_again() {
    let dir = folder("fails");
    let (first, _) = layered("figures fail", &dir, 1000);
    // Figures that understate the step (as a step that changed would): the start they give
    // runs out of memory.
    let (file, kept) = entry(&dir);
    let mut edited: serde_json::Value = serde_json::to_value(&kept).unwrap();
    edited["peak_at_fits"] = serde_json::json!(kept.peak_at_fits.unwrap() / 2);
    edited["failed_at"] = serde_json::Value::Null;
    edited["failure_reached"] = serde_json::Value::Null;
    std::fs::write(&file, serde_json::to_string(&edited).unwrap()).unwrap();
    clear_process_cache(); // read the edited file

    let (second, tried) = layered("figures fail", &dir, 1000);
    assert_eq!(
        tried.len(),
        2,
        "one failure, then the cached size: {tried:?}"
    );
    assert!(tried[0] > FIT, "{tried:?}");
    assert_eq!((tried[1], second), (first, first));
    let (_, kept) = entry(&dir);
    assert_eq!(kept.failed_at, Some(tried[0]));

    // The next rerun stays below the size that failed there.
    let (_, again) = layered("figures fail", &dir, 1000);
    assert_eq!(again.len(), 1, "{again:?}");
    assert!(again[0] < tried[0], "{again:?} after {tried:?}");
}

#[test]
fn without_figures_a_rerun_runs_the_cached_size() {
    let dir = folder("plain");
    let run = || {
        BatchSizeSearch::new(256)
            .with_cache("figures plain")
            .with_cache_dir(&dir)
            .run(|size| -> anyhow::Result<usize> {
                if size > 100 {
                    Err(OutOfMemory::new())?;
                }
                Ok(size)
            })
            .unwrap()
    };
    let first = run();
    assert_eq!(run(), first);
    assert_eq!(last_report().unwrap().len(), 1);
}
