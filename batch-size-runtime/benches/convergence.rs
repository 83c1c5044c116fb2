//! Runners that learn from every step, on shapes none of the engine's tests describes:
//! `cargo bench -p batch-size-runtime --bench convergence` prints, for each shape of
//! `tests/common/training.rs` and each effective batch, the passes of each step of 40 against
//! the fewest a step needs (the effective batch over the largest micro size that fits, found by
//! trying sizes on a fresh device), and the passes lost to out-of-memory on the way; with the
//! default `EffectiveBatch` (learning from each step's figures) and with
//! `with_convergence(false)` (the size of the first step kept, as before). Then the same for
//! `Chunked`'s chunk size over a corpus.

use batch_size_runtime::{memory::SimulatedDevice, Chunked, EffectiveBatch};

#[path = "../tests/common/bisect.rs"]
mod bisect;
#[path = "../tests/common/training.rs"]
mod training;

use training::{largest_fit, Model, Shape, DEVICE, SHAPES};

const STEPS: usize = 40;

/// What one run of 40 steps did.
struct Run {
    /// Passes of each step that ran.
    passes: Vec<usize>,
    /// Micro-batches started in attempts that ran out of memory.
    lost: usize,
}

fn train(shape: Shape, effective: usize, learn: bool) -> Run {
    let device = SimulatedDevice::new(DEVICE);
    let model = Model::new(shape, &device);
    let mut runner = EffectiveBatch::new(effective)
        .with_release(device.clone())
        .with_convergence(learn);
    let mut passes = Vec::with_capacity(STEPS);
    let mut lost = 0;
    for _ in 0..STEPS {
        let before = model.passes_started.get();
        let stepped = runner.step(|plan| -> anyhow::Result<()> { Ok(model.step(plan)?) });
        if stepped.is_err() {
            break;
        }
        let ran = runner.plan().accumulation();
        lost += model.passes_started.get() - before - ran;
        passes.push(ran);
    }
    Run { passes, lost }
}

/// The first step (from 1) from which every step runs the fewest passes.
fn settled_at(passes: &[usize], fewest: usize) -> Option<usize> {
    let last_off = passes.iter().rposition(|&ran| ran != fewest);
    match last_off {
        None => Some(1),
        Some(index) if index + 1 < passes.len() => Some(index + 2),
        Some(_) => None,
    }
}

fn main() {
    println!("EffectiveBatch: passes a step over {STEPS} steps on a simulated 16 GiB device");
    println!(
        "| shape | batch | fits | fewest | learning: steps 1, 2, 3, 10, 40 | settled at | lost to OOM | fewest/run | fixed: steps 1, 10, 40 | lost | fewest/run |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut learning_ratio, mut fixed_ratio, mut cases) = (0.0, 0.0, 0.0);
    for shape in SHAPES {
        let fit = largest_fit(shape);
        for effective in [1024usize, 4096] {
            let fewest = effective.div_ceil(fit);
            let learning = train(shape, effective, true);
            let fixed = train(shape, effective, false);
            let ratio = |run: &Run| {
                (fewest * run.passes.len()) as f64 / run.passes.iter().sum::<usize>() as f64
            };
            let at = |run: &Run, step: usize| {
                run.passes
                    .get(step - 1)
                    .map_or("-".to_owned(), ToString::to_string)
            };
            println!(
                "| {} | {effective} | {fit} | {fewest} | {}, {}, {}, {}, {} | {} | {} | {:.3} | {}, {}, {} | {} | {:.3} |",
                shape.name,
                at(&learning, 1),
                at(&learning, 2),
                at(&learning, 3),
                at(&learning, 10),
                at(&learning, 40),
                settled_at(&learning.passes, fewest)
                    .map_or("never".to_owned(), |step| format!("step {step}")),
                learning.lost,
                ratio(&learning),
                at(&fixed, 1),
                at(&fixed, 10),
                at(&fixed, 40),
                fixed.lost,
                ratio(&fixed),
            );
            learning_ratio += ratio(&learning);
            fixed_ratio += ratio(&fixed);
            cases += 1.0;
        }
    }
    println!(
        "\nmean fewest/run over 40 steps: learning {:.3}, fixed {:.3}",
        learning_ratio / cases,
        fixed_ratio / cases
    );
    chunks();
}

/// `Chunked` over 100 000 items, each a pass of one sample of the shape: the chunk sizes it
/// runs, against the largest that fits.
fn chunks() {
    const ITEMS: usize = 100_000;
    println!("\nChunked: {ITEMS} items, one sample each, from a first chunk of 4096");
    println!("| shape | fits | chunks run | fewest | chunk after 1, 2, 3, 10 chunks | lost to OOM | fixed: chunks | lost |");
    println!("|---|---|---|---|---|---|---|---|");
    for shape in SHAPES {
        let fit = largest_fit(shape);
        let run = |learn: bool| {
            let device = SimulatedDevice::new(DEVICE);
            let model = Model::new(shape, &device);
            // Inference: the model's state is all there before the first chunk.
            let _ = model.pass(1).and_then(|()| model.optimizer_step());
            let mut chunked = Chunked::new(ITEMS)
                .with_starting(4096)
                .with_release(device.clone())
                .with_convergence(learn);
            let mut sizes = Vec::new();
            let outcome = chunked.for_each(|items| -> anyhow::Result<()> {
                model.pass(items.len())?;
                sizes.push(items.len());
                Ok(())
            });
            let failed = chunked.chunks().iter().filter(|chunk| !chunk.done).count();
            (outcome.is_ok(), sizes, failed)
        };
        let (ok, sizes, lost) = run(true);
        let (fixed_ok, fixed_sizes, fixed_lost) = run(false);
        let at = |index: usize| sizes.get(index).map_or("-".to_owned(), ToString::to_string);
        println!(
            "| {} | {fit} | {}{} | {} | {}, {}, {}, {} | {lost} | {}{} | {fixed_lost} |",
            shape.name,
            sizes.len(),
            if ok { "" } else { " (failed)" },
            ITEMS.div_ceil(fit),
            at(0),
            at(1),
            at(2),
            at(9),
            fixed_sizes.len(),
            if fixed_ok { "" } else { " (failed)" },
        );
    }
}
