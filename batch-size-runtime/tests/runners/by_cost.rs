//! Steps whose items differ in cost (tokens): `EffectiveBatch::step_by_cost` groups the items by
//! length and packs them to a budget of cost that it learns while it runs; accumulation is exact
//! in tokens; an item that cannot fit alone is named; a second run starts from the cache.

use batch_size_runtime::agree::{Collective, ThreadRanks};
use batch_size_runtime::{BatchCost, Chunked, EffectiveBatch, NoExecutableBatchSize, StopReason};

use crate::lengths::{Lengths, Model, ENCODER, TRANSFORMER};
use crate::temp_folder::TempFolder;

/// What a run of steps did.
#[derive(Debug, Default)]
struct Run {
    failures: usize,
    /// The step of the last out-of-memory failure.
    last_failure: Option<usize>,
    passes: usize,
    /// The fewest passes an oracle that knows the memory function would run.
    oracle: usize,
}

#[test]
fn heavy_tailed_lengths_run_near_the_fewest_passes_with_failures_only_at_the_start() {
    // Declared as the model has it, twice too large, or not at all: the steps' peaks say
    // which square term memory follows.
    let shapes = [
        BatchCost::padded().with_square_term(2_048),
        BatchCost::padded().with_square_term(1_024),
        BatchCost::padded(),
    ];
    for shape in shapes {
        for seed in [7, 8, 9] {
            let (device, _held) = TRANSFORMER.device();
            let mut runner = EffectiveBatch::new(64)
                .with_release(device.clone())
                .with_batch_cost(shape);
            let run = train_on(&mut runner, &device, TRANSFORMER, 400, seed);
            let declared_right = shape == shapes[0];
            assert!(
                !declared_right || run.failures <= 3,
                "{shape:?}, seed {seed}: {run:?}"
            );
            assert!(
                run.last_failure.is_none_or(|step| step < 20),
                "{shape:?}, seed {seed}: {run:?}"
            );
            assert!(
                run.passes as f64 <= 1.15 * run.oracle as f64,
                "{shape:?}, seed {seed}: {run:?}"
            );
        }
    }
}

/// Runs `steps` steps of 64 sequences drawn from `seed` on `model` on `device`.
fn train_on(
    runner: &mut EffectiveBatch<'_>,
    device: &batch_size_runtime::memory::SimulatedDevice,
    model: Model,
    steps: usize,
    seed: u64,
) -> Run {
    let mut lengths = Lengths::heavy_tailed(seed);
    let mut run = Run::default();
    for step in 0..steps {
        let batch = lengths.batch(64);
        let mut ran = 0;
        runner
            .step_by_cost(&batch, |plan| -> anyhow::Result<()> {
                for micro in plan.micro_batches() {
                    model.run(device, &batch, &micro.items)?;
                }
                ran = plan.accumulation();
                Ok(())
            })
            .unwrap_or_else(|error| panic!("step {step}: {error}"));
        let failures = runner.last_step_report().out_of_memory_count();
        if failures > 0 {
            run.failures += failures;
            run.last_failure = Some(step);
        }
        run.passes += ran;
        run.oracle += model.fewest_passes(&batch);
    }
    run
}

#[test]
fn a_second_run_starts_at_the_cached_budget_with_no_failure() {
    let folder = TempFolder::new("by-cost", "cache");
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (device, _held) = TRANSFORMER.device();
        let mut runner = EffectiveBatch::new(64)
            .with_release(device.clone())
            .with_batch_cost(BatchCost::padded().with_square_term(2_048))
            .with_cache("tokens")
            .with_cache_dir(folder.path());
        runs.push(train_on(&mut runner, &device, TRANSFORMER, 100, 11));
    }
    assert!(
        runs[0].failures > 0,
        "the first run found its budget: {:?}",
        runs[0]
    );
    assert_eq!(runs[1].failures, 0, "{:?}", runs[1]);
    assert!(
        runs[1].passes as f64 <= 1.15 * runs[1].oracle as f64,
        "{:?}",
        runs[1]
    );
}

/// A token-mean loss whose gradient is exact: each token `t` of item `i` has the value
/// `v(i, t)`, and the loss is the mean over every token of the batch.
fn token_value(item: usize, token: u64) -> f64 {
    ((item as f64 + 1.0) * 0.37 + token as f64 * 0.011).sin()
}

#[test]
fn accumulation_by_tokens_is_the_whole_batchs_token_mean_whatever_the_division() {
    let lengths: Vec<u64> = Lengths::heavy_tailed(3).batch(64);
    let tokens: u64 = lengths.iter().sum();
    let whole: f64 = lengths
        .iter()
        .enumerate()
        .map(|(item, &length)| (0..length).map(|t| token_value(item, t)).sum::<f64>())
        .sum::<f64>()
        / tokens as f64;
    let mut divisions = std::collections::BTreeSet::new();
    for capacity in [u64::MAX / 4, 3_000_000, 600_000, 90_000, 20_000] {
        let device = batch_size_runtime::memory::SimulatedDevice::new(capacity);
        let mut runner = EffectiveBatch::new(64).with_release(device.clone());
        let accumulated = runner
            .step_by_cost(&lengths, |plan| -> anyhow::Result<f64> {
                let mut sum = 0.0;
                for micro in plan.micro_batches() {
                    let longest = micro.items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
                    let _activations = device.alloc(micro.items.len() as u64 * longest)?;
                    let micro_tokens: u64 = micro.items.iter().map(|&i| lengths[i]).sum();
                    let micro_mean = micro
                        .items
                        .iter()
                        .map(|&i| (0..lengths[i]).map(|t| token_value(i, t)).sum::<f64>())
                        .sum::<f64>()
                        / micro_tokens as f64;
                    sum += micro.weight * micro_mean;
                }
                Ok(sum)
            })
            .unwrap();
        divisions.insert(
            runner.last_step_report().len() * 1000 + runner.plan_of(&lengths).accumulation(),
        );
        assert!(
            (accumulated - whole).abs() < 1e-9,
            "capacity {capacity}: {accumulated} against {whole}"
        );
    }
    assert!(
        divisions.len() >= 3,
        "the capacities divided the batch alike: {divisions:?}"
    );
}

#[test]
fn weights_by_samples_sum_each_micro_batchs_share_of_samples() {
    let lengths = [500u64, 20, 20, 20];
    let plan = EffectiveBatch::new(4)
        .with_micro(500)
        .with_batch_cost(BatchCost::padded().weighted_by_samples())
        .plan_of(&lengths);
    let weights: Vec<(Vec<usize>, f64)> =
        plan.micro_batches().map(|m| (m.items, m.weight)).collect();
    assert_eq!(weights, [(vec![0], 0.25), (vec![1, 2, 3], 0.75)]);
    let by_tokens = EffectiveBatch::new(4).with_micro(500).plan_of(&lengths);
    let first = by_tokens.micro_batches().next().unwrap();
    assert!((first.weight - 500.0 / 560.0).abs() < 1e-12);
}

#[test]
fn an_item_that_does_not_fit_alone_is_named_and_the_steps_before_it_are_kept() {
    let (device, _held) = TRANSFORMER.device();
    let mut runner = EffectiveBatch::new(64)
        .with_release(device.clone())
        .with_batch_cost(BatchCost::padded().with_square_term(2_048));
    let mut passes = 0;
    let mut step = |runner: &mut EffectiveBatch<'_>, batch: &[u64]| {
        runner.step_by_cost(batch, |plan| -> anyhow::Result<()> {
            for micro in plan.micro_batches() {
                passes += 1;
                TRANSFORMER.run(&device, batch, &micro.items)?;
            }
            Ok(())
        })
    };
    step(&mut runner, &[300; 64]).unwrap();
    // 12,000 tokens: its square term alone is more than the device.
    let mut long = vec![300u64; 64];
    long[17] = 12_000;
    let error = step(&mut runner, &long).unwrap_err();
    let error = error.downcast::<NoExecutableBatchSize>().unwrap();
    assert_eq!(
        error.reason(),
        &StopReason::ItemDoesNotFit {
            item: 17,
            cost: BatchCost::padded().with_square_term(2_048).of(1, 12_000)
        }
    );
    assert!(error.to_string().contains("item 17"), "{error}");
    assert_eq!(runner.steps(), 1);
    // The next batch runs, at the budget learned before.
    step(&mut runner, &[300; 64]).unwrap();
    assert_eq!(runner.steps(), 2);
    assert!(
        passes > 3,
        "the long item's step ran passes before it stopped"
    );
}

#[test]
fn bad_costs_are_clear_errors_before_any_pass() {
    let mut calls = 0;
    let mut runner = EffectiveBatch::new(4);
    let mut reason = |runner: &mut EffectiveBatch<'_>, costs: &[u64]| {
        let error = runner
            .step_by_cost(costs, |_| -> anyhow::Result<()> {
                calls += 1;
                Ok(())
            })
            .unwrap_err()
            .downcast::<NoExecutableBatchSize>()
            .unwrap();
        match error.reason() {
            StopReason::InvalidConfiguration(why) => why.clone(),
            other => panic!("{other:?}"),
        }
    };
    assert!(reason(&mut runner, &[3, 0, 2]).contains("item 1 has a cost of 0"));
    assert!(reason(&mut runner, &[]).contains("at least one item"));
    let mut by_count = EffectiveBatch::new(4);
    by_count.step(|_| Ok::<_, anyhow::Error>(())).unwrap();
    assert!(reason(&mut by_count, &[3, 2]).contains("not both"));
    assert_eq!(calls, 0);
}

/// An embedding pass over `documents` of heavy-tailed lengths drawn from `seed`, grouped by
/// cost: returns (out-of-memory failures, the index of the last failed chunk, chunks that ran,
/// the oracle's chunks).
fn embed(documents: usize, seed: u64) -> (usize, Option<usize>, usize, usize) {
    let model = ENCODER;
    let (device, _held) = model.device();
    let lengths = Lengths::heavy_tailed(seed).batch(documents);
    let mut chunked = Chunked::new(documents)
        .with_release(device.clone())
        .with_cost(|i| lengths[i]);
    let embeddings = chunked
        .run_by_cost(|items| -> anyhow::Result<Vec<(usize, u64)>> {
            model.run(&device, &lengths, items)?;
            Ok(items.iter().map(|&i| (i, lengths[i])).collect())
        })
        .unwrap();
    // Every document's output, in the caller's order.
    assert!(embeddings
        .iter()
        .enumerate()
        .all(|(i, &(item, length))| item == i && length == lengths[i]));
    let records = chunked.chunks();
    let failed: Vec<usize> = (0..records.len()).filter(|&i| !records[i].done).collect();
    let done = chunked.chunk_count() - failed.len();
    (
        failed.len(),
        failed.last().copied(),
        done,
        model.fewest_passes(&lengths),
    )
}

#[test]
fn an_embedding_pass_grouped_by_cost_runs_near_the_fewest_chunks() {
    for seed in [21, 22] {
        let (failures, last, chunks, oracle) = embed(100_000, seed);
        assert!(failures <= 3, "seed {seed}: {failures} failures");
        assert!(
            last.is_none_or(|chunk| chunk < 20),
            "seed {seed}: the last failure at chunk {last:?}"
        );
        assert!(
            chunks as f64 <= 1.15 * oracle as f64,
            "seed {seed}: {chunks} chunks against the oracle's {oracle}"
        );
    }
}

#[test]
fn a_cost_function_that_panics_is_the_users_panic() {
    let mut chunked = Chunked::new(4).with_cost(|i| if i == 2 { panic!("my own bug") } else { 1 });
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = chunked.run_by_cost(|items| Ok::<_, anyhow::Error>(items.to_vec()));
    }))
    .unwrap_err();
    assert_eq!(caught.downcast_ref::<&str>(), Some(&"my own bug"));
}

/// Every rank of `world` trains on its own batches (its own seed), on its own device; returns
/// each rank's micro-batch counts, step by step.
fn ranks_train(world: usize, steps: usize) -> Vec<Vec<usize>> {
    let ranks = ThreadRanks::new(world);
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                scope.spawn(move || {
                    let seed = 100 + rank.rank() as u64;
                    let (device, _held) = TRANSFORMER.device();
                    let mut runner = EffectiveBatch::new(64)
                        .with_release(device.clone())
                        .with_batch_cost(BatchCost::padded().with_square_term(2_048))
                        .with_agreement(rank);
                    let mut lengths = Lengths::heavy_tailed(seed);
                    let mut counts = Vec::new();
                    for step in 0..steps {
                        let batch = lengths.batch(64);
                        let mut count = 0;
                        runner
                            .step_by_cost(&batch, |plan| -> anyhow::Result<()> {
                                count = 0;
                                for micro in plan.micro_batches() {
                                    count += 1;
                                    TRANSFORMER.run(&device, &batch, &micro.items)?;
                                }
                                let weights: f64 = plan.micro_batches().map(|m| m.weight).sum();
                                assert!((weights - 1.0).abs() < 1e-9);
                                Ok(())
                            })
                            .unwrap_or_else(|error| panic!("step {step}: {error}"));
                        counts.push(count);
                    }
                    counts
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    })
}

#[test]
fn every_rank_runs_as_many_micro_batches_as_the_rank_that_needs_the_most() {
    for world in [2, 4] {
        let counts = ranks_train(world, 60);
        for step in 0..60 {
            let at_step: Vec<usize> = counts.iter().map(|rank| rank[step]).collect();
            assert!(
                at_step.iter().all(|&count| count == at_step[0]),
                "{world} ranks, step {step}: {at_step:?}"
            );
        }
        // The ranks' own items differ: without the agreement their counts would.
        let mut alone = Vec::new();
        for rank in 0..world {
            let mut lengths = Lengths::heavy_tailed(100 + rank as u64);
            alone.push(
                (0..60)
                    .map(|_| TRANSFORMER.fewest_passes(&lengths.batch(64)))
                    .collect::<Vec<_>>(),
            );
        }
        assert!(
            (0..60).any(|step| alone.iter().any(|rank| rank[step] != alone[0][step])),
            "{world} ranks: the ranks' items never needed different counts"
        );
    }
}

#[test]
fn a_document_that_does_not_fit_alone_is_named_by_its_own_index() {
    let lengths = [40u64, 900, 30, 20];
    let device = batch_size_runtime::memory::SimulatedDevice::new(500);
    let mut chunked = Chunked::new(lengths.len())
        .with_release(device.clone())
        .with_cost(|i| lengths[i]);
    let error = chunked
        .run_by_cost(|items| -> anyhow::Result<Vec<u64>> {
            let longest = items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
            let _activations = device.alloc(items.len() as u64 * longest)?;
            Ok(items.iter().map(|&i| lengths[i]).collect())
        })
        .unwrap_err();
    match error {
        batch_size_runtime::ChunkError::ItemTooLarge {
            item,
            cost,
            completed,
            ..
        } => assert_eq!((item, cost, completed), (1, 900, 0)),
        other => panic!("{other}"),
    }
}

#[test]
fn chunks_learn_the_square_term_they_were_not_told() {
    // Attention's square term, declared as none: the chunks' peaks say it.
    let model = TRANSFORMER;
    let (device, _held) = model.device();
    let lengths = Lengths::heavy_tailed(31).batch(20_000);
    let mut chunked = Chunked::new(lengths.len())
        .with_release(device.clone())
        .with_cost(|i| lengths[i]);
    chunked
        .run_by_cost(|items| -> anyhow::Result<Vec<()>> {
            model.run(&device, &lengths, items)?;
            Ok(vec![(); items.len()])
        })
        .unwrap();
    let records = chunked.chunks();
    let failed: Vec<usize> = (0..records.len()).filter(|&i| !records[i].done).collect();
    let chunks = chunked.chunk_count() - failed.len();
    let oracle = model.fewest_passes(&lengths);
    assert!(
        failed.len() <= 3 && failed.iter().all(|&chunk| chunk < 20),
        "out of memory at chunks {failed:?}"
    );
    assert!(
        chunks as f64 <= 1.15 * oracle as f64,
        "{chunks} chunks against the oracle's {oracle}"
    );
}

#[test]
fn a_second_run_over_the_cache_that_learned_a_square_term_fails_no_more_and_never_late() {
    // Declared without the square term the steps have: the first run learns it, and the entry
    // keeps only budgets in the declared unit (the one its key names).
    let folder = TempFolder::new("by-cost", "learned-unit");
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (device, _held) = TRANSFORMER.device();
        let mut runner = EffectiveBatch::new(64)
            .with_release(device.clone())
            .with_batch_cost(BatchCost::padded())
            .with_cache("tokens, declared none")
            .with_cache_dir(folder.path());
        runs.push(train_on(&mut runner, &device, TRANSFORMER, 150, 12));
    }
    for run in &runs {
        assert!(run.last_failure.is_none_or(|step| step < 20), "{runs:?}");
        assert!(run.passes as f64 <= 1.15 * run.oracle as f64, "{runs:?}");
    }
    assert!(runs[1].failures <= runs[0].failures, "{runs:?}");
}

#[test]
fn ranks_run_their_own_corpora_by_cost_in_step_and_every_document_once() {
    let ranks =
        batch_size_runtime::agree::ThreadRanks::with_timeout(2, std::time::Duration::from_secs(30));
    let outputs: Vec<(usize, Vec<usize>, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                scope.spawn(move || {
                    let me = rank.rank();
                    let model = ENCODER;
                    let (device, _held) = model.device();
                    // Rank 1's documents are longer: its chunks would differ alone.
                    let mut lengths =
                        Lengths::heavy_tailed(40 + me as u64).batch(3_000 + 1_000 * me);
                    if me == 1 {
                        lengths
                            .iter_mut()
                            .for_each(|length| *length = (*length * 3).min(8_192));
                    }
                    let mut chunked = Chunked::new(lengths.len())
                        .with_release(device.clone())
                        .with_cost(|i| lengths[i])
                        .with_agreement(rank);
                    let embedded = chunked
                        .run_by_cost(|items| -> anyhow::Result<Vec<usize>> {
                            model.run(&device, &lengths, items)?;
                            Ok(items.to_vec())
                        })
                        .unwrap();
                    (me, embedded, lengths.len())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    });
    for (rank, embedded, documents) in outputs {
        assert_eq!(embedded, (0..documents).collect::<Vec<_>>(), "rank {rank}");
    }
}

#[test]
fn run_by_cost_asks_the_cost_of_each_item_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let asked = AtomicUsize::new(0);
    let lengths = Lengths::heavy_tailed(5).batch(500);
    let device = batch_size_runtime::memory::SimulatedDevice::new(20_000);
    let mut chunked = Chunked::new(lengths.len())
        .with_release(device.clone())
        .with_cost(|i| {
            asked.fetch_add(1, Ordering::Relaxed);
            lengths[i]
        });
    let out = chunked
        .run_by_cost(|items| -> anyhow::Result<Vec<usize>> {
            let longest = items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
            let _activations = device.alloc(items.len() as u64 * longest)?;
            Ok(items.to_vec())
        })
        .unwrap();
    assert_eq!(out, (0..lengths.len()).collect::<Vec<_>>());
    assert!(chunked.chunk_count() > 1);
    assert_eq!(asked.load(Ordering::Relaxed), lengths.len());
}
