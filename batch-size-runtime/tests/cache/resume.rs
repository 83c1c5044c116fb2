//! A training run restarted from its checkpoint with the same cache key starts at the size it
//! had learned, with no out-of-memory on the way (transformers #25956): for every runner.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::path::PathBuf;

use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::policy::clear_process_cache;
use batch_size_runtime::{Chunked, EffectiveBatch, OutOfMemory};

/// A folder of this test's own, empty.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("batch-size-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// One optimizer step of `samples` samples over the plan's micro-batches: 1 MiB a sample, on a
/// device where 40 samples fit at once.
fn step(runner: &mut EffectiveBatch<'_>, device: &SimulatedDevice) -> anyhow::Result<()> {
    runner.step(|plan| -> anyhow::Result<()> {
        for micro in plan.micro_batches() {
            let _activations = device.alloc(micro.range.len() as u64 * (1 << 20))?;
        }
        Ok(())
    })
}

#[test]
fn a_resumed_effective_batch_starts_at_the_micro_size_it_learned() {
    let dir = fresh_dir("effective");
    let device = SimulatedDevice::new(40 << 20);
    let first_run = |device: &SimulatedDevice| {
        EffectiveBatch::new(256)
            .with_release(device.clone())
            .with_cache("resume effective")
            .with_cache_dir(&dir)
    };

    let mut runner = first_run(&device);
    for _ in 0..3 {
        step(&mut runner, &device).unwrap();
    }
    let learned = runner.micro();
    assert!(learned <= 40, "the micro size that ran: {learned}");
    assert!(
        !runner.recoveries().is_empty(),
        "the first run learned by running out of memory"
    );

    // A new process: nothing in memory, the file on disk.
    clear_process_cache();
    let mut resumed = first_run(&device);
    step(&mut resumed, &device).unwrap();
    assert_eq!(resumed.recoveries(), &[], "no out-of-memory on the way");
    assert_eq!(resumed.last_step_report().len(), 1);
    assert_eq!(resumed.last_step_report().out_of_memory_count(), 0);
    assert_eq!(resumed.micro(), learned);

    // Another key: learns again.
    clear_process_cache();
    let mut other = EffectiveBatch::new(256)
        .with_release(device.clone())
        .with_cache("another model")
        .with_cache_dir(&dir);
    step(&mut other, &device).unwrap();
    assert!(other.last_step_report().out_of_memory_count() > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_resumed_chunked_run_starts_at_the_chunk_size_it_learned() {
    let dir = fresh_dir("chunked");
    let device = SimulatedDevice::new(30 << 20);
    let run = |total: usize| {
        let mut chunked = Chunked::new(total)
            .with_release(device.clone())
            .with_cache("resume chunked")
            .with_cache_dir(&dir);
        chunked
            .for_each(|items| -> anyhow::Result<()> {
                let _activations = device.alloc(items.len() as u64 * (1 << 20))?;
                Ok(())
            })
            .unwrap();
        chunked.chunks().to_vec()
    };

    let first = run(1000);
    assert!(
        first.iter().any(|chunk| !chunk.done),
        "the first run ran out of memory"
    );

    // The rest of the dataset, in a new process.
    clear_process_cache();
    let resumed = run(400);
    assert!(
        resumed.iter().all(|chunk| chunk.done),
        "no out-of-memory on the way: {resumed:?}"
    );
    assert!(
        resumed[0].range.len() <= 30 && resumed[0].range.len() >= 20,
        "{resumed:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cache_key_without_figures_still_resumes_and_a_bad_file_is_ignored() {
    let dir = fresh_dir("no-figures");
    let make = || {
        EffectiveBatch::new(64)
            .with_factor(0.5)
            .with_cache("resume without figures")
            .with_cache_dir(&dir)
    };
    let body = |plan: &batch_size_runtime::BatchPlan| -> anyhow::Result<()> {
        if plan.micro() > 16 {
            Err(OutOfMemory::new())?
        }
        Ok(())
    };
    let mut runner = make();
    runner.step(body).unwrap();
    assert_eq!(runner.micro(), 16);

    clear_process_cache();
    let mut resumed = make();
    resumed.step(body).unwrap();
    assert_eq!(resumed.last_step_report().len(), 1);
    assert_eq!(resumed.micro(), 16);

    // A corrupt entry: a WARN, and the run starts from its own size.
    for entry in std::fs::read_dir(&dir).unwrap() {
        std::fs::write(entry.unwrap().path(), "not json").unwrap();
    }
    clear_process_cache();
    let mut fresh = make();
    fresh.step(body).unwrap();
    assert_eq!(fresh.last_step_report().len(), 3); // 64, 32, 16
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without memory figures, a resumed run holds growth back below the size its entry records
/// as failed, as the first run did: no out-of-memory on the way back up.
#[test]
fn a_resumed_run_remembers_the_size_that_failed() {
    let dir = fresh_dir("failed-at");
    const FITS: usize = 40;

    // Chunked: chunks above 40 items run out of memory.
    let chunked_run = |out_of_memory: &mut usize| {
        let mut chunked = Chunked::new(300)
            .with_starting(64)
            .with_grow_after(2)
            .with_cache("resume chunked failed")
            .with_cache_dir(&dir);
        chunked
            .for_each(|items| -> anyhow::Result<()> {
                if items.len() > FITS {
                    *out_of_memory += 1;
                    return Err(OutOfMemory::new().into());
                }
                Ok(())
            })
            .unwrap();
    };
    let mut first = 0;
    chunked_run(&mut first);
    assert_eq!(first, 1, "the first run ran out of memory once, at 64");
    clear_process_cache();
    let mut resumed = 0;
    chunked_run(&mut resumed);
    assert_eq!(
        resumed, 0,
        "the resumed run grew back into the size that failed"
    );

    // EffectiveBatch: micro-batches above 40 samples run out of memory.
    let effective_run = |steps: usize| {
        let mut runner = EffectiveBatch::new(256)
            .with_grow_after(2)
            .with_cache("resume effective failed")
            .with_cache_dir(&dir);
        for _ in 0..steps {
            runner
                .step(|plan| -> anyhow::Result<()> {
                    if plan.micro() > FITS {
                        return Err(OutOfMemory::new().into());
                    }
                    Ok(())
                })
                .unwrap();
        }
        runner.recoveries().len()
    };
    assert!(
        effective_run(8) > 0,
        "the first run learned by running out of memory"
    );
    clear_process_cache();
    assert_eq!(
        effective_run(8),
        0,
        "the resumed run grew back into the size that failed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
