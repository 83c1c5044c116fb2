//! The cache of sizes that fit: a rerun makes one attempt; a cached size that fails goes on
//! downward; more room starts again from `starting`; bad files and folders never fail a search;
//! two processes can write one folder.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::Path;
use std::process::Command;

use batch_size_runtime::policy::{clear_process_cache, CacheEntry};
use batch_size_runtime::{last_report, memory::SimulatedDevice, BatchSizeSearch, OutOfMemory};

use crate::exact_name;
use exact_name::exact_name;

use crate::temp_folder;
use temp_folder::TempFolder;

fn folder(name: &str) -> TempFolder {
    TempFolder::new("batch-size-cache-test", name)
}

/// One search of `key` that fits up to `fits`, caching in `dir`. Returns the size and attempts.
fn search(key: &str, dir: Option<&Path>, fits: usize) -> (usize, usize) {
    let mut search = BatchSizeSearch::new(256).with_cache(key);
    if let Some(dir) = dir {
        search = search.with_cache_dir(dir);
    }
    let found = search
        .run(|size| -> anyhow::Result<usize> {
            if size > fits {
                Err(OutOfMemory::new())?;
            }
            Ok(size)
        })
        .unwrap();
    (found, last_report().unwrap().len())
}

fn entries(dir: &Path) -> Vec<CacheEntry> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|file| {
            let path = file.ok()?.path();
            (path.extension()? == "json")
                .then(|| serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap())
        })
        .collect()
}

#[test]
fn a_rerun_makes_one_attempt_in_the_process_and_from_disk() {
    assert_eq!(search("rerun in process", None, 100), (64, 3));
    assert_eq!(search("rerun in process", None, 100), (64, 1));

    let dir = folder("rerun");
    assert_eq!(search("rerun on disk", Some(dir.path()), 100), (64, 3));
    let written = entries(&dir);
    assert_eq!(written.len(), 1);
    assert_eq!((written[0].fits, written[0].failed_at), (64, Some(128)));
    // A new process: nothing in memory, the file is read.
    clear_process_cache();
    assert_eq!(search("rerun on disk", Some(dir.path()), 100), (64, 1));
    // Another key, another entry.
    assert_eq!(search("another key", Some(dir.path()), 100), (64, 3));
    assert_eq!(entries(&dir).len(), 2);
}

#[test]
fn a_cached_size_that_fails_goes_on_downward_and_updates_the_entry() {
    let dir = folder("downward");
    assert_eq!(search("downward", Some(dir.path()), 100), (64, 3));
    // Less room now: 64 fails, the search goes on from there.
    assert_eq!(search("downward", Some(dir.path()), 40), (32, 2));
    let written = entries(&dir);
    assert_eq!((written[0].fits, written[0].failed_at), (32, Some(64)));
    assert_eq!(search("downward", Some(dir.path()), 40), (32, 1));
}

#[test]
fn more_room_than_when_written_starts_again_from_starting() {
    let device = SimulatedDevice::new(1 << 30);
    // A folder of its own: `the_environment_names_the_folder` sets BATCH_SIZE_CACHE_DIR for
    // the whole process while it runs, which would otherwise move this entry under it.
    let dir = folder("room");
    let run = |device: &SimulatedDevice| {
        let found = BatchSizeSearch::new(64)
            .with_cache("room")
            .with_cache_dir(&dir)
            .with_release(device.clone())
            .run(|size| -> anyhow::Result<usize> {
                let _activations = device.alloc(size as u64 * (16 << 20))?; // 16 MiB a sample
                Ok(size)
            })
            .unwrap();
        (found, last_report().unwrap().len())
    };
    // Another process holds half the device at first.
    let held = device.alloc(512 << 20).unwrap();
    let (first, _) = run(&device);
    assert!(first <= 32);
    assert_eq!(run(&device), (first, 1));
    drop(held);
    // Twice the room: the search starts from 64 again, and 64 fits.
    assert_eq!(run(&device), (64, 1));
}

#[test]
fn bad_files_and_folders_never_fail_a_search() {
    // Corrupt, truncated, a folder where the file should be (unreadable), an entry of another
    // key: each ignored, the search runs whole and still finds its size.
    let dir = folder("bad");
    assert_eq!(search("bad file", Some(dir.path()), 100), (64, 3));
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let good = std::fs::read_to_string(&file).unwrap();
    for broken in [
        "{ not json",
        &good[..good.len() / 2],
        "{\"key\": \"another\", \"fits\": 8, \"failed_at\": null, \"free_when_written\": 0}",
    ] {
        std::fs::write(&file, broken).unwrap();
        clear_process_cache();
        assert_eq!(
            search("bad file", Some(dir.path()), 100),
            (64, 3),
            "{broken}"
        );
    }
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    clear_process_cache();
    assert_eq!(search("bad file", Some(dir.path()), 100), (64, 3));

    // A folder that cannot be created (a file stands in its way): the search still succeeds,
    // and the process keeps the entry.
    let blocked = folder("blocked");
    std::fs::write(&blocked, "a file, not a folder").unwrap();
    assert_eq!(
        search("blocked", Some(&blocked.join("cache")), 100),
        (64, 3)
    );
    assert_eq!(
        search("blocked", Some(&blocked.join("cache")), 100),
        (64, 1)
    );
}

#[test]
fn the_environment_names_the_folder() {
    let dir = folder("environment");
    // Only this test reads the variable through a search without a folder of its own.
    // SAFETY: the other tests of this binary read the environment only through `std::env`,
    // which takes the same lock as `set_var`; none calls C's `getenv` on a thread of its own.
    unsafe { std::env::set_var("BATCH_SIZE_CACHE_DIR", &dir) };
    let found = search("from the environment", None, 50);
    // SAFETY: as above.
    unsafe { std::env::remove_var("BATCH_SIZE_CACHE_DIR") };
    assert_eq!(found, (32, 4));
    // Other tests running at the same time may write there too: look for this one's entry.
    assert!(entries(&dir)
        .iter()
        .any(|entry| entry.key.starts_with("from the environment") && entry.fits == 32));
}

/// In a child process (see below): searches that all write one entry in the folder.
#[test]
#[ignore = "a child process of two_processes_write_one_folder: run by it with --ignored"]
fn writer_child() {
    let dir = std::env::var("BATCH_SIZE_TEST_WRITER_DIR")
        .expect("run by two_processes_write_one_folder, which sets the folder");
    for round in 0..50 {
        clear_process_cache();
        let fits = if round % 2 == 0 { 100 } else { 40 };
        let _ = search("shared", Some(Path::new(&dir)), fits);
    }
}

#[test]
fn two_processes_write_one_folder() {
    let dir = folder("shared");
    std::fs::create_dir_all(&dir).unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            // The child's own `test result` line stays in the pipe, out of this run's output.
            Command::new(std::env::current_exe().unwrap())
                .args([
                    &exact_name(module_path!(), "writer_child"),
                    "--exact",
                    "--ignored",
                    "--quiet",
                ])
                .env("BATCH_SIZE_TEST_WRITER_DIR", &dir)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "a writer failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        // It ran its one test, not nothing.
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "{}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
    // One entry, whole and valid, and no temporary file left behind.
    let written = entries(&dir);
    assert_eq!(written.len(), 1);
    assert!([32, 64].contains(&written[0].fits), "{:?}", written[0]);
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|file| file.ok())
        .filter(|file| file.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_cached_size_runs_again_after_a_search_that_left_memory_in_the_pool() {
    // A caching device keeps what the last trial freed until released: the rerun starts from an
    // empty pool all the same.
    let device = SimulatedDevice::new(1 << 30).with_caching();
    let tune = || {
        batch_size_runtime::Tuner::new()
            .with_release(device.clone())
            .with_cache("pool kept")
            .run(|size| -> anyhow::Result<()> {
                let _activations = device.alloc(size as u64 * (8 << 20))?;
                Ok(())
            })
            .unwrap()
    };
    let first = tune();
    assert!(
        device.cached() > 0,
        "the last trial's memory is kept in the pool"
    );
    let again = tune();
    assert_eq!(again.batch_size(), first.batch_size());
    assert_eq!(again.report().len(), 1);
    assert!(again.report().last().unwrap().outcome.is_success());
}

/// A tuner rerun from the cache reports what the run that wrote the entry reported: the size,
/// the largest with its headroom, the largest that ran; for the largest size and the fastest.
#[test]
fn a_tuner_rerun_says_what_the_first_run_said() {
    use batch_size_runtime::{Choice, Tuner};
    use std::time::Duration;

    for (choice, per_sample) in [
        (Choice::Largest, 3 << 20),
        (Choice::Fastest, 3 << 20),
        (Choice::Largest, 7 << 20),
        (Choice::Fastest, 5 << 20),
    ] {
        let device = SimulatedDevice::new(1 << 30);
        let key = format!("tuner rerun {choice:?} {per_sample}");
        // A step takes 1 ms up to 32 samples, then in proportion: the fastest size is below
        // the largest.
        let now = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
        let tune = || {
            let clock = std::sync::Arc::clone(&now);
            Tuner::new()
                .choose(choice)
                .with_release(device.clone())
                .with_cache(key.clone())
                .with_clock(move || *clock.lock().unwrap())
                .run(|size| -> anyhow::Result<()> {
                    let _weights = device.alloc(64 << 20)?;
                    let _activations = device.alloc(size as u64 * per_sample)?;
                    *now.lock().unwrap() += Duration::from_micros(1000 * size.max(32) as u64 / 32);
                    Ok(())
                })
                .unwrap()
        };
        let first = tune();
        let rerun = tune();
        assert!(
            rerun.report().from_cache(),
            "{choice:?}: the rerun ran the cached size"
        );
        assert_eq!(
            (rerun.batch_size(), rerun.largest(), rerun.largest_fit()),
            (first.batch_size(), first.largest(), first.largest_fit()),
            "{choice:?}, {per_sample} bytes a sample"
        );
    }
}
