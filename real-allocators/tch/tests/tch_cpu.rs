//! tch on the CPU under an address-space limit (RLIMIT_AS, set in a child process): libtorch's
//! "DefaultCPUAllocator: can't allocate memory" is recognised through both tch APIs, memory is
//! back after each failure, the size found fits in a fresh process, and results equal a run
//! with no limit.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::Reduction;
use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report, BatchSizeSearch, Chunked};
use batch_size_runtime::{Attempt, EffectiveBatch, SearchReport, Tuner};
use real_allocators_tch::harness::{self, child, expect_child, value};
use real_allocators_tch::{samples, sequences, Block, Mlp};

/// Bytes of address space left to a child once libtorch is warm: some hundreds of samples fit.
const ROOM: u64 = 160 << 20;
const STARTING: usize = 4096;

/// libtorch warmed up (its thread pool and first allocations made), then the limit set at the
/// virtual size now plus `ROOM`: every child starts from the same room.
fn limited_model() -> Mlp {
    let model = Mlp::new().unwrap();
    let (x, y) = samples(0, 4).unwrap();
    model.f_loss_sum(&x, &y).unwrap().backward();
    harness::leave_room(ROOM);
    model
}

/// What every search under the limit must show: out-of-memory attempts recognised (the
/// harness's check) with the bytes libtorch asked for, the host's figures, and the memory back
/// after each release.
fn check_failures(report: &SearchReport) {
    harness::check_failures(report, |failed: &Attempt| {
        assert!(
            failed.figures.requested.is_some_and(|bytes| bytes > 0),
            "{failed:?}"
        );
        let start = failed.memory_at_start.as_ref().unwrap();
        assert_eq!(start.devices[0].device, "cpu");
        let after = failed.memory_after_release.as_ref().unwrap().free();
        // Back to what was free before the attempt, within a few pages of bookkeeping.
        assert!(
            after + (4 << 20) >= start.free(),
            "{} free before, {after} after",
            start.free()
        );
    });
}

/// The loss sum of the first `batch_size` samples, through tch's fallible API.
#[find_executable_batch_size(starting = STARTING, release = Release::host(), policy = policy())]
fn train_fallible(batch_size: usize, model: &Mlp) -> anyhow::Result<(usize, f64)> {
    let (x, y) = samples(0, batch_size as i64)?;
    let loss = model.f_loss_sum(&x, &y)?;
    loss.f_backward()?;
    Ok((batch_size, loss.f_double_value(&[])?))
}

#[test]
fn fallible_api() {
    let lines = child("fallible_api_scenario", &[]);
    let found: usize = value(&lines, "found").parse().unwrap();
    // Results equal a run with no limit, here.
    let model = Mlp::new().unwrap();
    let (_, loss) = train_fallible_at(&model, found);
    let limited: f64 = value(&lines, "loss").parse().unwrap();
    assert!(
        (loss - limited).abs() <= 1e-6 * loss.abs().max(1.0),
        "{loss} vs {limited}"
    );
    fits_in_a_fresh_process(found, "train");
}

/// The attribute on tch's fallible API under the limit: prints the size found, the loss and
/// the attempts.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn fallible_api_scenario() {
    expect_child("fallible_api_scenario");
    let model = limited_model();
    let (found, loss) = train_fallible(&model).unwrap();
    let report = last_report().unwrap();
    check_failures(&report);
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{attempt} | {:?} | {:?} -> {:?}",
                attempt.rationale, attempt.memory_at_start, attempt.memory_at_end
            );
        }
    }
    println!("\nfound={found}\nloss={loss}\nattempts={}", report.len());
}

/// The default policy, or halving where the parent asks (`REAL_ALLOCATORS_POLICY=halving`).
fn policy() -> Reduction<'static> {
    if std::env::var("REAL_ALLOCATORS_POLICY").as_deref() == Ok("halving") {
        Reduction::Halve
    } else {
        Reduction::default()
    }
}

/// The attribute's search against the largest size that trains in a fresh process (by
/// bisection, each size in a child), printed beside halving's run: above halving's and at least
/// 0.80 of the largest. Not 0.90: the host's figures give the attempt's peak (its virtual size)
/// and not what it held when the allocation failed, so peak plus request counts temporaries
/// freed before the failure and the estimate lands about 0.85 of the largest.
#[test]
fn fallible_api_near_the_largest() {
    let fits = |size: usize| fits_fresh(size, "train");
    let largest = largest_that_fits("train");
    let run = |extra: &[(&str, String)]| {
        let lines = child("fallible_api_scenario", extra);
        let found: usize = value(&lines, "found").parse().unwrap();
        let attempts: usize = value(&lines, "attempts").parse().unwrap();
        (found, attempts)
    };
    let (found, attempts) = run(&[]);
    let (halving, halving_attempts) = run(&[("REAL_ALLOCATORS_POLICY", "halving".to_owned())]);
    let share = found as f64 / largest as f64;
    println!(
        "tch attribute (fallible API, Release::host()): found {found} of {largest} ({share:.3}) in {attempts} attempts; halving {halving} ({:.3}) in {halving_attempts} attempts",
        halving as f64 / largest as f64
    );
    // A fresh process's limit varies by a page or two between runs: a sample near the edge.
    assert!(found <= largest + largest / 50, "{found} above {largest}");
    assert!(fits(found), "{found} does not run in a fresh process");
    assert!(share >= 0.80, "{found} of {largest} ({share:.3})");
    assert!(found >= halving, "{found} below halving's {halving}");
}

/// The transformer block warmed up as [`limited_model`] warms the MLP, then the same room.
fn limited_block() -> Block {
    let block = Block::new().unwrap();
    block
        .f_loss_sum(&sequences(0, 4).unwrap())
        .unwrap()
        .backward();
    harness::leave_room(ROOM);
    block
}

/// Three training steps of the block at `batch_size`, each followed by `after_step` (the
/// search's step call, or nothing); the last step's loss.
fn block_steps_then<E>(
    block: &Block,
    batch_size: usize,
    mut after_step: impl FnMut() -> Result<(), E>,
) -> anyhow::Result<f64>
where
    anyhow::Error: From<E>,
{
    let mut loss = 0.0;
    for _step in 0..3 {
        let step = block.f_loss_sum(&sequences(0, batch_size as i64)?)?;
        step.f_backward()?;
        loss = step.f_double_value(&[])?;
        after_step()?;
    }
    Ok(loss)
}

/// Three training steps of the block, with nothing after them: a fresh process's run.
fn block_steps(block: &Block, batch_size: usize) -> anyhow::Result<f64> {
    block_steps_then(block, batch_size, || anyhow::Ok(()))
}

/// The block trained with `step_done()?` after each step, as `docs/GUIDE.md` teaches it.
#[find_executable_batch_size(starting = STARTING, release = Release::tch(), policy = policy())]
fn block_with_the_call(batch_size: usize, block: &Block) -> anyhow::Result<usize> {
    block_steps_then(block, batch_size, batch_size_runtime::step_done)?;
    Ok(batch_size)
}

/// The block trained by the attribute alone.
#[find_executable_batch_size(starting = STARTING, release = Release::tch(), policy = policy())]
fn block_alone(batch_size: usize, block: &Block) -> anyhow::Result<usize> {
    block_steps(block, batch_size)?;
    Ok(batch_size)
}

/// The block's search under the limit, with the call where the parent sets
/// `REAL_ALLOCATORS_CALL`: prints the size found, the runs and the sizes.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn block_scenario() {
    expect_child("block_scenario");
    let block = limited_block();
    let found = if std::env::var_os("REAL_ALLOCATORS_CALL").is_some() {
        block_with_the_call(&block)
    } else {
        block_alone(&block)
    }
    .unwrap();
    let report = last_report().unwrap();
    // Recognised with the bytes asked for; the address space is not back (glibc keeps what
    // the failed attempts grew: the point of this scenario).
    harness::check_failures(&report, |failed: &Attempt| {
        assert!(
            failed.figures.requested.is_some_and(|bytes| bytes > 0),
            "{failed:?}"
        );
    });
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{attempt} | {:?} | {:?} | {:?} -> {:?}",
                attempt.rationale, attempt.figures, attempt.memory_at_start, attempt.memory_at_end
            );
        }
    }
    let sizes: Vec<String> = report
        .attempts()
        .map(|attempt| attempt.batch_size.to_string())
        .collect();
    println!(
        "\nfound={found}\nruns={}\nout_of_memory={}\nsizes={}",
        report.len(),
        report.out_of_memory_count(),
        sizes.join(",")
    );
}

/// The tuner as taught on the block's step, with tch's release: prints the size found.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn block_tuner() {
    expect_child("block_tuner");
    let block = limited_block();
    let tuned = Tuner::new()
        .with_release(Release::tch())
        .run(|batch_size| -> anyhow::Result<()> {
            block
                .f_loss_sum(&sequences(0, batch_size as i64)?)?
                .f_backward()?;
            Ok(())
        })
        .unwrap();
    let report = tuned.report();
    println!(
        "\nfound={}\ntrials={}\nout_of_memory={}",
        tuned.batch_size(),
        report.len(),
        report.out_of_memory_count()
    );
}

/// A transformer block trained on the CPU as a user writes it, with the attribute and
/// `step_done()?` after each of three steps and `Release::tch()`, beside the attribute alone,
/// halving (with the call) and the tuner, in the same test, each against the largest size that
/// trains in a fresh process: in glibc's default configuration and with
/// `MALLOC_MMAP_THRESHOLD_=131072` in the environment (every tensor of 128 KiB or more its own
/// mapping, given back when freed).
///
/// With the threshold, the size found trains in a fresh process and is at least 0.90 of the
/// largest. With the defaults, the figures are printed and nothing is asserted of them: a
/// failed allocation under `RLIMIT_AS` leaves glibc's thread on an arena of 64 MiB heaps that
/// it created to retry it, which big tensors fill unevenly, so near the limit a size runs or
/// fails from one process to the next (the bisection's largest read 819 and 944; the call's
/// size 588 and 843 in the same configuration; docs/FRAMEWORKS.md).
#[test]
fn block_with_the_call_near_the_largest() {
    for threshold in [None, Some("131072")] {
        let setting: Vec<(&'static str, String)> = threshold
            .map(|bytes| ("MALLOC_MMAP_THRESHOLD_", bytes.to_owned()))
            .into_iter()
            .collect();
        let with = |extra: &[(&'static str, String)]| -> Vec<(&'static str, String)> {
            let mut env = setting.clone();
            env.extend_from_slice(extra);
            env
        };
        let fits = |size: usize| {
            harness::child_status(
                "one_size",
                &with(&[
                    ("REAL_ALLOCATORS_SIZE", size.to_string()),
                    ("REAL_ALLOCATORS_MODE", "block".to_owned()),
                ]),
            )
            .1
        };
        let largest = harness::largest_that_fits(2 * STARTING, fits);
        let call = ("REAL_ALLOCATORS_CALL", "1".to_owned());
        let lines = child("block_scenario", &with(&[call.clone()]));
        let found: usize = value(&lines, "found").parse().unwrap();
        let alone: usize = value(&child("block_scenario", &with(&[])), "found")
            .parse()
            .unwrap();
        let halving = child(
            "block_scenario",
            &with(&[call, ("REAL_ALLOCATORS_POLICY", "halving".to_owned())]),
        );
        let halving: usize = value(&halving, "found").parse().unwrap();
        let tuner = child("block_tuner", &with(&[]));
        let tuned: usize = value(&tuner, "found").parse().unwrap();
        let share = |size: usize| size as f64 / largest as f64;
        println!(
            "tch transformer block ({}), the attribute with step_done() (Release::tch()): found {found} of {largest} ({:.3}) in {} runs, {} out of memory, sizes {}; the attribute alone {alone} ({:.3}); halving {halving} ({:.3}); the tuner {tuned} ({:.3}) in {} trials, {} out of memory",
            threshold.map_or("glibc's defaults".to_owned(), |bytes| format!("MALLOC_MMAP_THRESHOLD_={bytes}")),
            share(found),
            value(&lines, "runs"),
            value(&lines, "out_of_memory"),
            value(&lines, "sizes"),
            share(alone),
            share(halving),
            share(tuned),
            value(&tuner, "trials"),
            value(&tuner, "out_of_memory"),
        );
        if threshold.is_some() {
            assert!(found <= largest + largest / 50, "{found} above {largest}");
            assert!(fits(found), "{found} does not run in a fresh process");
            assert!(
                share(found) >= 0.90,
                "{found} of {largest} ({:.3})",
                share(found)
            );
        }
    }
}

/// Whether `size` runs in a fresh process under the same room (`mode`: "train", "chunk" or
/// "infer"): the `one_size` scenario in a child.
fn fits_fresh(size: usize, mode: &str) -> bool {
    harness::child_status(
        "one_size",
        &[
            ("REAL_ALLOCATORS_SIZE", size.to_string()),
            ("REAL_ALLOCATORS_MODE", mode.to_owned()),
        ],
    )
    .1
}

/// The largest size that runs in a fresh process under the same room, by bisection below
/// twice `STARTING` (each size in a child of its own).
fn largest_that_fits(mode: &str) -> usize {
    harness::largest_that_fits(2 * STARTING, |size| fits_fresh(size, mode))
}

/// The tuner as `docs/GUIDE.md` teaches it, with tch's release and no bounds: each trial one
/// training step at its size. Prints the size found, the largest that ran, the trials and how
/// many ran out of memory.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn tuner_as_taught() {
    expect_child("tuner_as_taught");
    let model = limited_model();
    let tuned = Tuner::new()
        .with_release(Release::tch())
        .run(|batch_size| train_fallible_step(&model, batch_size));
    let tuned = match tuned {
        Ok(tuned) => tuned,
        Err(error) => {
            if let Some(none) = error.downcast_ref::<batch_size_runtime::NoExecutableBatchSize>() {
                for attempt in none.report().attempts() {
                    eprintln!(
                        "{attempt} | {:?} -> {:?}",
                        attempt.memory_at_start, attempt.memory_at_end
                    );
                }
            }
            panic!("{error}");
        }
    };
    let report = tuned.report();
    let failed = report
        .attempts()
        .filter(|attempt| attempt.outcome.is_out_of_memory())
        .count();
    if std::env::var_os("REAL_ALLOCATORS_VERBOSE").is_some() {
        for attempt in report.attempts() {
            eprintln!(
                "{attempt} | {:?} | {:?} -> {:?}",
                attempt.rationale, attempt.memory_at_start, attempt.memory_at_end
            );
        }
    }
    let sizes: Vec<String> = report
        .attempts()
        .map(|attempt| attempt.batch_size.to_string())
        .collect();
    println!(
        "\nfound={}\nlargest_fit={}\ntrials={}\nout_of_memory={failed}\nsizes={}",
        tuned.batch_size(),
        tuned.largest_fit(),
        report.len(),
        sizes.join(",")
    );
}

/// The tuner as taught (`Release::tch()`, from `min` 1) on a training step whose growth at
/// the first sizes is below what the host's figures resolve (a few MiB in a 620 MiB process):
/// it grows the trial until the growth shows instead of stopping with "memory does not grow"
/// (it did, after 1, 4 and 16), and lands at least 0.85 of the largest size that trains in a
/// fresh process, at most one trial out of memory, in at most 10 trials; the size found
/// trains in a fresh process. Not 0.93: the address space is full at about 850 samples by the
/// process's virtual size (the figures' line says so, and a fresh process's peak at 850 is
/// within 1 MiB of the limit); glibc, refused an mmap, serves the rest from its arenas' free
/// space, and 939 runs. No figure shows that grace before it is used, and the margin is taken
/// off the line's limit.
#[test]
fn tuner_as_taught_near_the_largest() {
    let largest = largest_that_fits("train");
    let lines = child("tuner_as_taught", &[]);
    let found: usize = value(&lines, "found").parse().unwrap();
    let trials: usize = value(&lines, "trials").parse().unwrap();
    let out_of_memory: usize = value(&lines, "out_of_memory").parse().unwrap();
    let share = found as f64 / largest as f64;
    println!(
        "tch tuner (Release::tch(), as taught): found {found} of {largest} ({share:.3}) in {trials} trials, {out_of_memory} out of memory; sizes {}",
        value(&lines, "sizes")
    );
    assert!(
        fits_fresh(found, "train"),
        "{found} does not run in a fresh process"
    );
    assert!(share >= 0.85, "{found} of {largest} ({share:.3})");
    assert!(trials <= 10, "{trials} trials");
    assert!(out_of_memory <= 1, "{out_of_memory} trials out of memory");
}

/// Items of the chunked inference: about twenty chunks of the largest that fits.
const CHUNKED_ITEMS: usize = 20_000;

/// The outputs of items `range`, without gradients, through the fallible API: one chunk.
// tch's `From<Tensor> for Vec` panics on failure; `try_from` returns the error to the runner.
#[allow(clippy::unnecessary_fallible_conversions)]
fn infer_chunk(model: &Mlp, range: std::ops::Range<usize>) -> anyhow::Result<Vec<f32>> {
    let (x, _) = samples(range.start as i64, range.len() as i64)?;
    let out = tch::no_grad(|| model.f_forward(&x))?;
    Ok(Vec::<f32>::try_from(out.f_flatten(0, -1)?)?)
}

/// `Chunked` over [`CHUNKED_ITEMS`] from [`STARTING`], with tch's release: prints the largest
/// chunk that ran, the chunks that ran out of memory, and the chunks.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn chunked_inference() {
    expect_child("chunked_inference");
    let model = limited_model();
    let mut chunked = Chunked::new(CHUNKED_ITEMS)
        .with_starting(STARTING)
        .with_release(Release::tch());
    let outputs = chunked.run(|range| infer_chunk(&model, range)).unwrap();
    assert_eq!(outputs.len(), CHUNKED_ITEMS);
    let largest = chunked
        .chunks()
        .iter()
        .filter(|chunk| chunk.done)
        .map(|chunk| chunk.range.len())
        .max()
        .unwrap();
    let failed = chunked.chunks().iter().filter(|chunk| !chunk.done).count();
    let sizes: Vec<String> = chunked
        .chunks()
        .iter()
        .map(|chunk| format!("{}{}", chunk.range.len(), if chunk.done { "" } else { "x" }))
        .collect();
    println!(
        "\nlargest={largest}\nfailed={failed}\nchunks={}\nsizes={}",
        chunked.chunk_count(),
        sizes.join(",")
    );
}

/// Chunked inference under the limit: its largest chunk at least 0.90 of the largest chunk
/// that runs in a fresh process, and that chunk runs in a fresh process too.
#[test]
fn chunked_near_the_largest() {
    let largest = largest_that_fits("chunk");
    let lines = child("chunked_inference", &[]);
    let found: usize = value(&lines, "largest").parse().unwrap();
    let failed: usize = value(&lines, "failed").parse().unwrap();
    let share = found as f64 / largest as f64;
    println!(
        "tch Chunked ({CHUNKED_ITEMS} items, Release::tch()): largest chunk {found} of {largest} ({share:.3}), {failed} out of memory in {} chunks; {}",
        value(&lines, "chunks"),
        value(&lines, "sizes")
    );
    assert!(
        fits_fresh(found, "chunk"),
        "{found} does not run in a fresh process"
    );
    assert!(share >= 0.90, "{found} of {largest} ({share:.3})");
}

/// One training step at `batch_size` through the fallible API.
fn train_fallible_step(model: &Mlp, batch_size: usize) -> anyhow::Result<()> {
    let (x, y) = samples(0, batch_size as i64)?;
    model.f_loss_sum(&x, &y)?.f_backward()?;
    Ok(())
}

fn train_fallible_at(model: &Mlp, batch_size: usize) -> (usize, f64) {
    let (x, y) = samples(0, batch_size as i64).unwrap();
    let loss = model.f_loss_sum(&x, &y).unwrap();
    loss.backward();
    (batch_size, loss.double_value(&[]))
}

#[test]
fn plain_api_panics() {
    let lines = child("plain_api_panics_scenario", &[]);
    fits_in_a_fresh_process(value(&lines, "found").parse().unwrap(), "infer");
}

/// The plain API (errors panic) under the limit: prints the size found.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn plain_api_panics_scenario() {
    expect_child("plain_api_panics_scenario");
    let model = limited_model();
    let found: anyhow::Result<usize> = BatchSizeSearch::new(STARTING)
        .with_release(Release::host())
        .run(|batch_size| {
            let (x, _) = samples(0, batch_size as i64)?;
            let _outputs = model.forward(&x); // panics on out-of-memory
            Ok(batch_size)
        });
    check_failures(&last_report().unwrap());
    println!("\nfound={}", found.unwrap());
}

/// The size found fits in a fresh process under the same room: it is not above the largest
/// that fits.
fn fits_in_a_fresh_process(size: usize, mode: &str) {
    assert!(
        fits_fresh(size, mode),
        "{size} does not run in a fresh process ({mode})"
    );
}

#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn one_size() {
    expect_child("one_size");
    let size = harness::one_size_requested();
    let mode = std::env::var("REAL_ALLOCATORS_MODE").unwrap();
    if mode == "block" {
        let block = limited_block();
        block_steps(&block, size).unwrap();
        return;
    }
    let model = limited_model();
    if mode == "train" {
        train_fallible_at(&model, size);
    } else if mode == "chunk" {
        infer_chunk(&model, 0..size).unwrap();
    } else {
        let (x, _) = samples(0, size as i64).unwrap();
        let _outputs = model.forward(&x);
    }
}

/// 1024 samples: an effective batch's gradient and a chunked inference, under the limit and
/// without it.
const SAMPLES: usize = 1024;

// tch's `From<Tensor> for Vec` panics on failure; `try_from` returns the error to the runner.
#[allow(clippy::unnecessary_fallible_conversions)]
fn effective_and_chunked(model: &mut Mlp, limited: bool) -> (f64, Vec<f32>) {
    let release = if limited {
        Release::host()
    } else {
        Release::none()
    };
    let mut runner = EffectiveBatch::new(SAMPLES).with_release(release.clone());
    runner
        .step(|plan| -> anyhow::Result<()> {
            model.zero_grad();
            for micro in plan.micro_batches() {
                let (x, y) = samples(micro.range.start as i64, micro.range.len() as i64)?;
                model.f_loss_sum(&x, &y)?.f_backward()?;
            }
            Ok(())
        })
        .unwrap();
    if limited {
        check_failures(runner.last_step_report());
    }
    let gradient = model.grad_sum();
    let outputs = Chunked::new(SAMPLES)
        .with_starting(SAMPLES)
        .with_release(release)
        .run(|range| -> anyhow::Result<Vec<f32>> {
            let (x, _) = samples(range.start as i64, range.len() as i64)?;
            let out = tch::no_grad(|| model.f_forward(&x))?;
            Ok(Vec::<f32>::try_from(out.f_flatten(0, -1)?)?)
        })
        .unwrap();
    (gradient, outputs)
}

#[test]
fn effective_batch_and_chunked_equal_a_run_without_limit() {
    let lines = child("effective_batch_and_chunked_scenario", &[]);
    let mut model = Mlp::new().unwrap();
    let (gradient, outputs) = effective_and_chunked(&mut model, false);
    let limited: f64 = value(&lines, "gradient").parse().unwrap();
    assert!(
        (gradient - limited).abs() <= 1e-4 * gradient.abs().max(1.0),
        "{gradient} vs {limited}"
    );
    let sum: f64 = outputs.iter().map(|&o| f64::from(o)).sum();
    let limited_sum: f64 = value(&lines, "outputs").parse().unwrap();
    assert!(
        (sum - limited_sum).abs() <= 1e-4 * sum.abs().max(1.0),
        "{sum} vs {limited_sum}"
    );
}

/// An effective batch's gradient and a chunked inference under the limit: prints both.
#[test]
#[ignore = "a scenario: run in a child process by this file's framework test, with --ignored"]
fn effective_batch_and_chunked_scenario() {
    expect_child("effective_batch_and_chunked_scenario");
    let mut model = limited_model();
    let (gradient, outputs) = effective_and_chunked(&mut model, true);
    assert_eq!(outputs.len(), SAMPLES);
    let sum: f64 = outputs.iter().map(|&o| f64::from(o)).sum();
    println!("\ngradient={gradient}\noutputs={sum}");
}
