//! What a user reads at WARN: one line per failed attempt, whatever the runner; the line that
//! says what ran out, without stack frames or `unwrap` wrappers; no field left empty.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use crate::warnings;

use batch_size_runtime::{BatchSizeSearch, Chunked, EffectiveBatch, OutOfMemory, Tuner};
use warnings::Warnings;

/// Runs `run` with a subscriber of its own; the WARN lines it logged.
fn warnings_of(run: impl FnOnce()) -> Vec<String> {
    let warnings = Warnings::default();
    tracing::subscriber::with_default(warnings.clone(), run);
    warnings.all()
}

/// What `unwrap()` on tch's error panics with: libtorch's C++ stack escaped on one line.
const TCH_PANIC: &str = "called `Result::unwrap()` on an `Err` value: Torch(\"DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12 (Cannot allocate memory)\\nException raised from alloc_cpu at ../c10/core/impl/alloc_cpu.cpp:72 (most recent call first):\\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in /usr/lib/libc10.so)\\nframe #1: <unknown function> + 0x4c062 (0x7f in /usr/lib/libc10.so)\")";

fn out_of_memory_above(limit: usize, size: usize) -> anyhow::Result<()> {
    if size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(())
}

#[test]
fn one_warn_per_failed_attempt_whatever_the_runner() {
    // 64 and 32 fail, 16 fits: two WARNs through every door.
    let search = warnings_of(|| {
        let _ = BatchSizeSearch::new(64)
            .with_factor(0.5)
            .run(|size| out_of_memory_above(16, size));
    });
    assert_eq!(search.len(), 2, "{search:#?}");

    let effective = warnings_of(|| {
        let mut runner = EffectiveBatch::new(64).with_factor(0.5);
        runner
            .step(|plan| out_of_memory_above(16, plan.micro()))
            .unwrap();
    });
    assert_eq!(effective.len(), 2, "{effective:#?}");

    let chunked = warnings_of(|| {
        let mut chunked = Chunked::new(64).with_starting(64).with_factor(0.5);
        chunked
            .for_each(|items| out_of_memory_above(16, items.len()))
            .unwrap();
    });
    assert_eq!(chunked.len(), 2, "{chunked:#?}");

    let mut failed = 0;
    let tuner = warnings_of(|| {
        let tuned = Tuner::new()
            .with_max(64)
            .with_release(batch_size_runtime::Release::none())
            .run(|size| out_of_memory_above(40, size))
            .unwrap();
        assert!(tuned.largest_fit() <= 40);
        failed = tuned.report().out_of_memory_count();
    });
    // The tuner's trials: a WARN for each that ran out, none for the others.
    assert!(failed > 0);
    assert_eq!(tuner.len(), failed, "{tuner:#?}");
}

#[test]
fn the_warn_says_what_ran_out_and_leaves_no_field_empty() {
    // The panicking form of tch, without figures (no release that reads any).
    let lines = warnings_of(|| {
        let fitted = BatchSizeSearch::new(8)
            .with_release(batch_size_runtime::Release::none())
            .call(|size| {
                if size > 4 {
                    panic!("{TCH_PANIC}");
                }
                size
            });
        assert_eq!(fitted.unwrap(), 4);
    });
    assert_eq!(lines.len(), 1, "{lines:#?}");
    let line = &lines[0];
    assert!(
        line.contains("error=DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12 (Cannot allocate memory)"),
        "{line}"
    );
    for noise in ["frame #", "Exception raised", "unwrap", "Torch(\""] {
        assert!(!line.contains(noise), "{noise} in {line}");
    }
    // No figures: no memory fields at all, rather than empty ones.
    assert!(!line.contains("memory="), "{line}");
    assert!(!line.contains("free_after_release="), "{line}");
    assert!(!line.contains("= ") && !line.ends_with('='), "{line}");
}

#[test]
fn a_cpu_process_has_no_pool_in_the_words() {
    let host = batch_size_runtime::memory::DeviceMemory {
        device: "cpu".to_owned(),
        total: 2 << 30,
        free: 1 << 30,
        pool_reserved: Some(544 << 20),
        pool_used: None,
        peak: None,
    };
    let text = host.to_string();
    assert!(text.contains("the process holds 544.00 MiB"), "{text}");
    assert!(!text.contains("pool"), "{text}");
}

const MIB: u64 = 1 << 20;

/// The failure a child trial reports under a 768 MiB limit: less asked than said free.
fn sixty_four_with_more_free(size: usize) -> anyhow::Result<usize> {
    if size > 16 {
        Err(OutOfMemory::new()
            .with_requested(64 * MIB)
            .with_free(208 * MIB)
            .with_total(768 * MIB))?;
    }
    Ok(size)
}

#[batch_size_runtime::find_executable_batch_size(starting = 64, release = device.clone())]
fn train(
    batch_size: usize,
    device: &batch_size_runtime::memory::SimulatedDevice,
) -> anyhow::Result<usize> {
    let _activations = device.alloc(batch_size as u64 * (100 * MIB))?;
    Ok(batch_size)
}

/// The line as a user's function `train` logs it: the tests' labels are their module paths.
fn readable(line: &str) -> String {
    let Some((before, rest)) = line.split_once(" function=\"") else {
        return line.to_owned();
    };
    let after = rest.split_once('"').map_or("", |(_, after)| after);
    format!("{before} function=\"train\"{after}")
}

/// Before, a retry's line ran past 600 characters, the error in its message, in `error` and
/// its figures again in `memory`. Counted as the message and the fields (a subscriber adds
/// its timestamp and target before them).
#[test]
fn a_retry_line_is_short_and_says_the_error_once() {
    let device = batch_size_runtime::memory::SimulatedDevice::new(4 << 30);
    let lines = warnings_of(|| assert!(train(&device).is_ok()));
    assert!(!lines.is_empty());
    for line in &lines {
        let length = readable(line).len();
        assert!(length < 200, "{length} characters: {line}");
        assert_eq!(line.matches("tried to allocate").count(), 1, "{line}");
        assert!(
            !line.contains("memory=sim:0"),
            "the error states the figures: {line}"
        );
    }
}

#[test]
fn figures_that_look_contradictory_say_why_in_the_same_line() {
    let on_a_device = warnings_of(|| {
        let fitted = BatchSizeSearch::new(64)
            .with_release(batch_size_runtime::Release::none())
            .run(sixty_four_with_more_free);
        assert!(fitted.is_ok());
    });
    assert!(!on_a_device.is_empty());
    for line in &on_a_device {
        assert!(
            line.contains("out of memory (the pool's reserve)"),
            "{line}"
        );
        let length = readable(line).len();
        assert!(length < 200, "{length} characters: {line}");
    }
    let on_the_host = warnings_of(|| {
        let fitted = BatchSizeSearch::new(64)
            .with_release(batch_size_runtime::Release::host())
            .run(sixty_four_with_more_free);
        assert!(fitted.is_ok());
    });
    assert!(!on_the_host.is_empty());
    for line in &on_the_host {
        assert!(line.contains("the process's own memory"), "{line}");
    }
    // Figures that do not conflict need no excuse.
    let plain = warnings_of(|| {
        let _ = BatchSizeSearch::new(64)
            .with_release(batch_size_runtime::Release::none())
            .run(|size| out_of_memory_above(16, size));
    });
    assert!(
        plain.iter().all(|line| !line.contains("the pool's")),
        "{plain:#?}"
    );
}

/// Before, a limit below what size 1 needs ended with "Lower `min`", `min` being 1.
#[test]
fn when_size_one_does_not_fit_the_error_says_to_raise_the_limit() {
    let error = BatchSizeSearch::new(8)
        .with_release(batch_size_runtime::Release::none())
        .run(|size| out_of_memory_above(0, size))
        .unwrap_err();
    let message = error.to_string();
    assert!(message.contains("raise the memory limit"), "{message}");
    assert!(!message.contains("Lower `min`"), "{message}");
    // With a `min` above 1, lowering it is still the advice.
    let error = BatchSizeSearch::new(8)
        .with_min(4)
        .with_release(batch_size_runtime::Release::none())
        .run(|size| out_of_memory_above(0, size))
        .unwrap_err();
    assert!(error.to_string().contains("Lower `min`"), "{error}");
}
