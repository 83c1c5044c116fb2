//! candle on the CPU, an MLP's training step (784 → 2048 → 2048 → 10, forward and backward)
//! under an address-space limit, sized through the attribute with a child per attempt, under
//! `cargo test` without `--nocapture`: each failed size aborts its child, whose figures (the
//! bytes its abort message asked for, what it held then) guide the search. The test then finds
//! the largest size that fits in a fresh process by bisection and prints beside it the sizes of
//! the attribute (with and without `release = trial.memory()`), halving's rung and the tuner
//! (with and without the children's figures). Figures from one run are in docs/FRAMEWORKS.md.
//!
//! `linux::mlp_sized_under_a_resident_budget` runs the same step under a resident budget
//! (`ChildTrial::with_resident_limit`, the memory a box or container counts) with no
//! allocator setting: the largest size that fits by bisection, then the attribute with
//! `step_done()` after the child's step from above the fit and from below it.
//!
//! Ignored: a debug build's matrix products make each child take seconds. Run it in release
//! (about 2 minutes, the build aside), `--nocapture` to see the table:
//! `cargo test --release -p batch-size-examples --test candle_cpu_child_mlp -- --ignored --exact linux::mlp_sized_in_children --nocapture`
//! (`linux::mlp_sized_under_a_resident_budget` likewise).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

#[cfg(target_os = "linux")]
#[path = "../../batch-size-runtime/tests/common/address_space.rs"]
mod address_space;

#[cfg(target_os = "linux")]
mod linux {
    use batch_size_runtime::{
        find_executable_batch_size, last_report, step_done, BatchSizeSearch, ChildTrial,
        ChildTrialError, Outcome, Release, Tuner,
    };
    use candle_core::{DType, Device, Tensor, Var};

    use super::address_space;

    /// Address space the child has beyond what it holds once started.
    const ROOM: u64 = 384 << 20;

    const STARTING: usize = 8192;

    fn trial() -> ChildTrial {
        ChildTrial::new("mlp_step").with_args(["--exact", "linux::child_mlp_step", "--ignored"])
    }

    /// One training step: forward, loss, backward.
    fn step(batch_size: usize) -> candle_core::Result<()> {
        let device = Device::Cpu;
        let w1 = Var::randn(0f32, 0.02, (784, 2048), &device)?;
        let w2 = Var::randn(0f32, 0.02, (2048, 2048), &device)?;
        let w3 = Var::randn(0f32, 0.02, (2048, 10), &device)?;
        let inputs = Tensor::randn(0f32, 1.0, (batch_size, 784), &device)?;
        let hidden = inputs.matmul(w1.as_tensor())?.relu()?;
        let hidden = hidden.matmul(w2.as_tensor())?.relu()?;
        let logits = hidden.matmul(w3.as_tensor())?;
        let loss = logits.sqr()?.mean_all()?;
        let gradients = loss.backward()?;
        let g1 = gradients.get(&w1).expect("w1 has a gradient");
        let total = g1
            .abs()?
            .sum_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        if !total.is_finite() {
            candle_core::bail!("the gradient is not finite");
        }
        Ok(())
    }

    #[test]
    #[ignore = "a child process of mlp_sized_in_children: run by it with --ignored"]
    fn child_mlp_step() {
        trial().serve(|batch_size| -> anyhow::Result<()> {
            address_space::leave_room(ROOM)?;
            step(batch_size)?;
            Ok(())
        });
        panic!("run only as a ChildTrial's child: it sets the batch size");
    }

    /// The resident memory the child may hold in all, its start included.
    const RESIDENT_BUDGET: u64 = 256 << 20;

    fn resident_trial() -> ChildTrial {
        ChildTrial::new("mlp_step_resident")
            .with_args(["--exact", "linux::child_mlp_step_resident", "--ignored"])
            .with_resident_limit(RESIDENT_BUDGET)
    }

    #[test]
    #[ignore = "a child process of mlp_sized_under_a_resident_budget: run by it with --ignored"]
    fn child_mlp_step_resident() {
        // No limit of its own and no allocator setting: the parent's budget is the one. Without
        // backtraces, as a release build's debug information is small: with RUST_BACKTRACE=1,
        // `serve` reads this debug test binary's first (125 MiB resident, against 5.5 MiB
        // without), and the budget counts it as the program's (see docs/FRAMEWORKS.md).
        if ChildTrial::new("mlp_step_resident").is_child() {
            std::env::set_var("RUST_BACKTRACE", "0");
        }
        ChildTrial::new("mlp_step_resident").serve(|batch_size| -> anyhow::Result<()> {
            step(batch_size)?;
            Ok(())
        });
        panic!("run only as a ChildTrial's child: it sets the batch size");
    }

    /// The attribute with `step_done()` after the child's step, under the resident budget.
    #[find_executable_batch_size(starting = STARTING, release = trial.memory())]
    fn sized_resident(batch_size: usize, trial: &ChildTrial) -> Result<usize, ChildTrialError> {
        let ran = trial.run(batch_size)?;
        step_done()?;
        Ok(ran)
    }

    #[test]
    #[ignore = "seconds a child in a debug build: run in release (see the file's docs)"]
    fn mlp_sized_under_a_resident_budget() {
        // Every attempt ran, grew or ran out of memory: none failed otherwise.
        let only_out_of_memory = |report: &batch_size_runtime::SearchReport| {
            assert!(
                report.attempts().all(|attempt| matches!(
                    attempt.outcome,
                    Outcome::Succeeded | Outcome::OutOfMemory { .. } | Outcome::Grew { .. }
                )),
                "{report}"
            );
        };
        let trial = resident_trial();
        let from_above = sized_resident(&trial).unwrap();
        let above_report = last_report().unwrap();
        only_out_of_memory(&above_report);
        // The largest size that fits in a fresh child: up from the size found, in doublings
        // of a step until one fails, then bisection.
        let (mut fits, mut fails) = (from_above, None);
        let mut stride = (from_above / 16).max(1);
        while fails.is_none() {
            match trial.run(fits + stride) {
                Ok(_) => {
                    fits += stride;
                    stride *= 2;
                }
                Err(ChildTrialError::OutOfMemory { .. } | ChildTrialError::Died { .. }) => {
                    fails = Some(fits + stride)
                }
                Err(other) => panic!("{other}"),
            }
        }
        let mut fails = fails.unwrap_or(fits + 1);
        while fails - fits > 1 {
            let middle = fits + (fails - fits) / 2;
            match trial.run(middle) {
                Ok(_) => fits = middle,
                Err(ChildTrialError::OutOfMemory { .. } | ChildTrialError::Died { .. }) => {
                    fails = middle
                }
                Err(other) => panic!("{other}"),
            }
        }
        // From below the fit: a small size, a quarter and a half of it.
        let from_below: Vec<(usize, usize, usize, usize, String)> = [16, fits / 4, fits / 2]
            .into_iter()
            .map(|start| {
                let found = BatchSizeSearch::new(start)
                    .with_release(trial.memory())
                    .run(|batch_size| -> Result<usize, ChildTrialError> {
                        let ran = trial.run(batch_size)?;
                        step_done()?;
                        Ok(ran)
                    })
                    .unwrap();
                let report = last_report().unwrap();
                only_out_of_memory(&report);
                assert!(found >= start, "{found} from {start}: {report}");
                (
                    start,
                    found,
                    report.attempts().count(),
                    report.out_of_memory_count(),
                    report.to_string(),
                )
            })
            .collect();
        let below: Vec<String> = from_below
            .iter()
            .map(|(start, found, runs, failures, report)| {
                let ratio = *found as f64 / fits as f64;
                format!(
                    "from {start}: {found} ({ratio:.3}) in {runs} runs, {failures} out of \
                     memory\n{report}"
                )
            })
            .collect();
        eprintln!(
            "candle MLP on the CPU, a resident budget of {} MiB, the largest size that fits \
             {fits} (fails at {fails}):\nthe attribute with step_done(), from {STARTING}: \
             {from_above} ({:.3}) in {} runs, {} out of memory\n{}\n{above_report}",
            RESIDENT_BUDGET >> 20,
            from_above as f64 / fits as f64,
            above_report.attempts().count(),
            above_report.out_of_memory_count(),
            below.join("\n"),
        );
        // From above, halving's rung (1024, 0.55 of the fit) grows three times to 0.97 of it in
        // the runs of docs/FRAMEWORKS.md. From below, only that it grew or stayed: from 16 it
        // reached 0.876 and 0.990 in two runs.
        let halving = (0..)
            .map(|halvings| STARTING >> halvings)
            .find(|&rung| rung <= fits)
            .unwrap_or(1);
        assert!(
            from_above >= halving,
            "{from_above} below halving's {halving}"
        );
        assert!(
            from_above as f64 >= 0.90 * fits as f64,
            "{from_above} of {fits} from {STARTING}"
        );
    }

    #[find_executable_batch_size(starting = STARTING, release = Release::none())]
    fn sized(batch_size: usize) -> Result<usize, ChildTrialError> {
        trial().run(batch_size)
    }

    #[find_executable_batch_size(starting = STARTING, release = trial.memory())]
    fn sized_with_figures(batch_size: usize, trial: &ChildTrial) -> Result<usize, ChildTrialError> {
        trial.run(batch_size)
    }

    /// The child's step ran: `step_done()` reads its peak (the children's figures, through
    /// `trial.memory()`) and grows the size where they show a larger one fits.
    #[find_executable_batch_size(starting = STARTING, release = trial.memory())]
    fn sized_growing(batch_size: usize, trial: &ChildTrial) -> Result<usize, ChildTrialError> {
        let ran = trial.run(batch_size)?;
        // The child's one step is over: a `Grow` goes back through `?` (`ChildTrialError`
        // takes it), and the engine runs the larger size the figures showed.
        batch_size_runtime::step_done()?;
        Ok(ran)
    }

    #[test]
    #[ignore = "seconds a child in a debug build: run in release (see the file's docs)"]
    fn mlp_sized_in_children() {
        // One glibc arena: each thread's own arena reserves 64 MiB of address space when that
        // thread first allocates, which makes the size that fits vary from child to child
        // with the threads' timing. Set before the first child starts, the only thread here.
        std::env::set_var("MALLOC_ARENA_MAX", "1");
        let fitted = sized().unwrap();
        let report = last_report().unwrap();
        let attempts = report.attempts().count();
        let smallest_failed = report
            .attempts()
            .filter(|attempt| !attempt.outcome.is_success())
            .map(|attempt| attempt.batch_size)
            .min()
            .unwrap_or(STARTING + 1);
        // The largest size that fits in a fresh process, between the fit and the failure.
        let (mut fits, mut fails) = (fitted, smallest_failed);
        while fails - fits > 1 {
            let middle = fits + (fails - fits) / 2;
            match trial().run(middle) {
                Ok(_) => fits = middle,
                Err(ChildTrialError::Died { .. }) => fails = middle,
                Err(other) => panic!("{other}"),
            }
        }
        let halving = (0..)
            .map(|halvings| STARTING >> halvings)
            .find(|&rung| rung <= fits)
            .unwrap();
        let table: Vec<String> = report
            .attempts()
            .map(|attempt| format!("{} {:?}", attempt.batch_size, attempt.outcome))
            .collect();
        // The tuner, which grows, with and without the children's figures.
        let tuner = |release: Release| {
            let tuned = Tuner::new()
                .with_release(release)
                .run(|batch_size| trial().run(batch_size))
                .unwrap();
            (tuned.batch_size(), tuned.report().len())
        };
        let blind = tuner(Release::none());
        let figures_trial = trial();
        let with_figures = {
            let tuned = Tuner::new()
                .with_release(figures_trial.memory())
                .run(|batch_size| figures_trial.run(batch_size))
                .unwrap();
            (tuned.batch_size(), tuned.report().len())
        };
        // The attribute again, with the children's figures as its release; then with
        // `step_done()` after each child's step.
        let attribute_figures = sized_with_figures(&trial()).unwrap();
        let growing = sized_growing(&trial()).unwrap();
        let growing_runs = last_report().unwrap().attempts().count();
        eprintln!(
            "candle MLP on the CPU, {} MiB of address space, the largest size that fits {fits}:\n\
             the attribute, a child per attempt: {fitted} in {attempts} attempts ({:.3}); \
             with release = trial.memory(): {attribute_figures} ({:.3}); with step_done() \
             after the child's step: {growing} in {growing_runs} runs ({:.3});\n\
             halving's {halving} ({:.3}); the tuner: {} in {} trials ({:.3}), with the \
             children's figures {} in {} trials ({:.3})\n{}",
            ROOM >> 20,
            fitted as f64 / fits as f64,
            attribute_figures as f64 / fits as f64,
            growing as f64 / fits as f64,
            halving as f64 / fits as f64,
            blind.0,
            blind.1,
            blind.0 as f64 / fits as f64,
            with_figures.0,
            with_figures.1,
            with_figures.0 as f64 / fits as f64,
            table.join("\n")
        );
        // With `step_done()` after the child's step, the attribute grows from the child's peak
        // to near the limit (0.940 measured), never below halving's rung.
        assert!(growing >= halving, "{growing} below halving's {halving}");
        assert!(
            growing as f64 >= 0.90 * fits as f64,
            "{growing} of {fits} with step_done()"
        );
        // Every child that aborted left its figures: what it asked for, what it held, its room.
        for attempt in report
            .attempts()
            .filter(|attempt| !attempt.outcome.is_success())
        {
            assert!(attempt.figures.requested.is_some(), "{attempt:?}");
        }
    }
}
