//! Nothing read from the cache steers a search out of its range: a cached size of 0, one larger
//! than `starting`, a negative or fractional number, or another device's entry is ignored with
//! one WARN and the search starts at `starting`; a cache folder that cannot be used gives one
//! WARN per search, whatever the reason. (Its own test binary: it clears the process's cache.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use batch_size_runtime::policy::clear_process_cache;
use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};

use crate::warnings;
use warnings::Warnings;

/// The tests share the process's cache: one at a time.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

use crate::temp_folder;
use temp_folder::TempFolder;

fn folder(name: &str) -> TempFolder {
    TempFolder::new("batch-size-cache-validation", name)
}

/// One search from 64 where 16 fits, with a fresh process cache, caching in `dir`: the size, the
/// sizes tried and the cache's WARNs.
fn search(key: &str, dir: &Path) -> (usize, Vec<usize>, usize) {
    search_with_min(key, dir, 1)
}

/// [`search`] with `min`.
fn search_with_min(key: &str, dir: &Path, min: usize) -> (usize, Vec<usize>, usize) {
    clear_process_cache();
    // The cache's own WARNs (the engine's, one per retry, are not counted).
    let warnings = Warnings::default();
    let found = tracing::subscriber::with_default(warnings.clone(), || {
        BatchSizeSearch::new(64)
            .with_min(min)
            .with_cache(key)
            .with_cache_dir(dir)
            .run(|size| -> anyhow::Result<usize> {
                if size > 16 {
                    Err(OutOfMemory::new())?;
                }
                Ok(size)
            })
            .unwrap()
    });
    let tried = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    (found, tried, warnings.count_from_module("::cache"))
}

/// `text`'s entry with `failed_at` set to `size`.
fn with_failed_at(text: &str, size: u64) -> String {
    let mut entry: serde_json::Value = serde_json::from_str(text).unwrap();
    entry["failed_at"] = size.into();
    serde_json::to_string_pretty(&entry).unwrap()
}

fn entry_file(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|file| file.ok().map(|file| file.path()))
        .find(|path| {
            path.extension()
                .is_some_and(|extension| extension == "json")
        })
        .unwrap()
}

#[test]
fn cached_values_out_of_range_or_of_another_device_are_ignored_with_one_warn() {
    let _one = one_at_a_time();
    let dir = folder("values");
    assert_eq!(search("values", &dir), (16, vec![64, 32, 16], 0));
    let file = entry_file(&dir);
    let good = std::fs::read_to_string(&file).unwrap();
    let entry: serde_json::Value = serde_json::from_str(&good).unwrap();
    assert_eq!(entry["fits"], 16);
    // A valid entry is used: one attempt, no WARN.
    assert_eq!(search("values", &dir), (16, vec![16], 0));

    let key = entry["key"].as_str().unwrap().to_owned();
    let foreign_key = key.replace("sim:0", "cuda:3").replace(" none ", " cuda:3 ");
    let foreign_key = if foreign_key == key {
        format!("{key} on another device")
    } else {
        foreign_key
    };
    let with_fits = |fits: &str| good.replace("\"fits\": 16", &format!("\"fits\": {fits}"));
    let cases = [
        ("0", with_fits("0")),
        ("10^15", with_fits("1000000000000000")),
        ("above starting", with_fits("65")),
        ("negative", with_fits("-3")),
        ("fractional", with_fits("12.5")),
        ("a string", with_fits("\"16\"")),
        ("beyond u64", with_fits("1e30")),
        ("another device", good.replace(&key, &foreign_key)),
        // Fields that cannot be true together: a failure at or below the size that ran, a
        // grown size at its own failure (it would be served above `starting`).
        ("failed at its size", with_failed_at(&good, 16)),
        ("failed below its size", with_failed_at(&good, 8)),
        (
            "grown at its own failure",
            with_failed_at(&with_fits("32"), 32).replace("\"key\"", "\"grown\": true, \"key\""),
        ),
    ];
    for (what, text) in cases {
        assert_ne!(text, good, "{what}: the case must change the file");
        std::fs::write(&file, &text).unwrap();
        let (found, tried, warnings) = search("values", &dir);
        assert_eq!(tried.first(), Some(&64), "{what}: starts at `starting`");
        assert_eq!((found, warnings), (16, 1), "{what}: {tried:?}");
        assert_eq!(tried, vec![64, 32, 16], "{what}");
        // The search wrote its own entry over the bad one.
        let rewritten: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(rewritten["fits"], 16, "{what}");
        assert_eq!(rewritten["key"], key.as_str(), "{what}");
    }
}

#[test]
fn a_cache_folder_that_cannot_be_used_gives_one_warn_per_search() {
    let _one = one_at_a_time();
    // A file where the folder should be.
    let file_in_place = folder("a-file");
    std::fs::write(&file_in_place, "a file, not a folder").unwrap();
    // A folder under a file.
    let under_a_file = folder("under-a-file");
    std::fs::write(&under_a_file, "a file, not a folder").unwrap();
    for dir in [file_in_place.path(), &under_a_file.join("cache")] {
        for round in 0..3 {
            let (found, tried, warnings) = search("unusable folder", dir);
            assert_eq!(found, 16, "{}: round {round}", dir.display());
            assert_eq!(tried, vec![64, 32, 16], "{}: round {round}", dir.display());
            assert_eq!(warnings, 1, "{}: round {round}", dir.display());
        }
    }
    assert_eq!(
        std::fs::read_to_string(&file_in_place).unwrap(),
        "a file, not a folder"
    );
}

#[test]
fn a_cached_size_below_min_is_ignored_with_one_warn() {
    let _one = one_at_a_time();
    let dir = folder("below-min");
    assert_eq!(search("below min", &dir), (16, vec![64, 32, 16], 0));
    let file = entry_file(&dir);
    let good = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, good.replace("\"fits\": 16", "\"fits\": 8")).unwrap();
    // Written by a search with `min` 1; this one refuses sizes below 12.
    let (found, tried, warnings) = search_with_min("below min", &dir, 12);
    assert_eq!((found, warnings), (16, 1), "{tried:?}");
    assert_eq!(tried, vec![64, 32, 16]);
}
