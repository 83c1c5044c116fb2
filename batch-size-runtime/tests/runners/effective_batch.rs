//! The effective batch is kept exactly, whatever the micro size, and an out-of-memory step in
//! the middle of training is recovered in place without redoing the steps before it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping
#![allow(clippy::needless_range_loop)] // steps are numbered

use batch_size_runtime::{
    memory::SimulatedDevice, BatchPlan, EffectiveBatch, NoExecutableBatchSize, OutOfMemory,
    StopReason,
};
use proptest::prelude::*;

/// A linear regression: `y ≈ w · x`, mean squared error.
struct Data {
    x: Vec<[f64; 3]>,
    y: Vec<f64>,
}

impl Data {
    fn new(n: usize, seed: u64) -> Data {
        let mut state = seed;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        };
        let x: Vec<[f64; 3]> = (0..n).map(|_| [next(), next(), next()]).collect();
        let y = x
            .iter()
            .map(|x| 0.5 * x[0] - 2.0 * x[1] + 3.0 * x[2] + 0.1 * next())
            .collect();
        Data { x, y }
    }

    /// The gradient of the mean loss over `samples`.
    fn mean_gradient(&self, w: &[f64; 3], samples: std::ops::Range<usize>) -> [f64; 3] {
        let count = samples.len() as f64;
        let mut gradient = [0.0; 3];
        for i in samples {
            let error: f64 = w.iter().zip(&self.x[i]).map(|(w, x)| w * x).sum::<f64>() - self.y[i];
            for (g, x) in gradient.iter_mut().zip(&self.x[i]) {
                *g += 2.0 * error * x / count;
            }
        }
        gradient
    }

    /// The gradient of one step, accumulated over the plan's micro-batches with their weights.
    fn accumulated(&self, w: &[f64; 3], offset: usize, plan: &BatchPlan) -> [f64; 3] {
        let mut gradient = [0.0; 3];
        for micro in plan.micro_batches() {
            let range = offset + micro.range.start..offset + micro.range.end;
            let part = self.mean_gradient(w, range);
            for (g, p) in gradient.iter_mut().zip(part) {
                *g += micro.weight * p;
            }
        }
        gradient
    }
}

#[test]
fn micro_batches_of_every_size_give_the_full_batch_gradient() {
    let effective = 37; // prime: most sizes leave a shorter last micro-batch
    let data = Data::new(effective, 7);
    let w = [0.3, -0.2, 0.9];
    let full = data.mean_gradient(&w, 0..effective);
    for micro in 1..=effective {
        let accumulated = data.accumulated(&w, 0, &BatchPlan::new(effective, micro));
        for (a, f) in accumulated.iter().zip(full) {
            assert!((a - f).abs() < 1e-12, "micro {micro}: {a} vs {f}");
        }
    }
}

const PER_SAMPLE: u64 = 1 << 20; // 1 MiB of activations a sample

/// 100 SGD steps of 64 samples. With `lose_room_at`, another allocation appears on the device
/// before that step and stays. With `fixed_micro`, the micro size of each step is forced.
fn train(
    lose_room_at: Option<usize>,
    fixed_micro: Option<&dyn Fn(usize) -> usize>,
) -> ([f64; 3], Vec<usize>, EffectiveBatch<'static>) {
    let effective = 64;
    let data = Data::new(effective * 100, 11);
    let device = SimulatedDevice::new(80 * PER_SAMPLE);
    let mut runner = EffectiveBatch::new(effective)
        .with_micro(64)
        .with_release(device.clone());
    let mut w = [0.0; 3];
    let mut calls = vec![0usize; 100];
    let mut other_process = None;
    for step in 0..100 {
        if Some(step) == lose_room_at {
            other_process = Some(device.alloc(40 * PER_SAMPLE).unwrap());
        }
        let offset = step * effective;
        runner
            .step(|plan| -> anyhow::Result<()> {
                calls[step] += 1;
                let plan = match fixed_micro {
                    Some(micro) => BatchPlan::new(effective, micro(step)),
                    None => plan.clone(),
                };
                // Each micro-batch's activations live while it runs.
                for micro in plan.micro_batches() {
                    let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                }
                // The optimizer steps last, once the whole batch ran.
                let gradient = data.accumulated(&w, offset, &plan);
                for (w, g) in w.iter_mut().zip(gradient) {
                    *w -= 0.05 * g;
                }
                Ok(())
            })
            .unwrap();
    }
    drop(other_process);
    (w, calls, runner)
}

#[test]
fn a_late_out_of_memory_is_recovered_in_place() {
    let (w, calls, runner) = train(Some(60), None);
    // Steps 0 to 59 ran once each, step 60 more than once, the rest once.
    assert!(calls[..60].iter().all(|&calls| calls == 1), "{calls:?}");
    assert!(calls[60] > 1);
    assert!(calls[61..].iter().all(|&calls| calls == 1));
    assert_eq!(runner.steps(), 100);
    assert_eq!(runner.recoveries().len(), 1);
    let recovery = &runner.recoveries()[0];
    assert_eq!(recovery.step, 60);
    assert_eq!(recovery.tried[0], 64);
    let smaller = runner.micro();
    // 40 samples of room are left.
    assert!(smaller <= 40, "{smaller}");
    assert_eq!(recovery.tried.last(), Some(&smaller));

    // The same parameters as a run that used the smaller micro-batch from step 60 on.
    let schedule = move |step: usize| if step < 60 { 64 } else { smaller };
    let (expected, _, _) = train(None, Some(&schedule));
    for (a, b) in w.iter().zip(expected) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    // And, the division being exact, as a run that never divided its batches.
    let (undivided, _, _) = train(None, Some(&|_| 64));
    for (a, b) in w.iter().zip(undivided) {
        assert!((a - b).abs() < 1e-9, "{a} vs {b}");
    }
}

#[test]
fn errors_and_panics_that_are_not_out_of_memory_come_back_unchanged() {
    let mut runner = EffectiveBatch::new(8);
    let error = runner
        .step(|_| -> anyhow::Result<()> { anyhow::bail!("corrupt shard") })
        .unwrap_err();
    assert_eq!(error.to_string(), "corrupt shard");
    assert_eq!(runner.steps(), 0);

    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = runner.step(|_| -> anyhow::Result<()> { panic!("index out of bounds") });
    }))
    .unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"index out of bounds"));
}

#[test]
fn bad_configuration_is_refused() {
    for mut runner in [EffectiveBatch::new(0), EffectiveBatch::new(8).with_min(0)] {
        let mut calls = 0;
        let error = runner
            .step(|_| -> anyhow::Result<()> {
                calls += 1;
                Ok(())
            })
            .unwrap_err();
        let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
        assert!(matches!(
            none_fit.reason(),
            StopReason::InvalidConfiguration(_)
        ));
        assert_eq!(calls, 0);
    }
    // Nothing fits at the smallest micro size: the step fails, saying so.
    let mut runner = EffectiveBatch::new(8).with_min(2).with_factor(0.5);
    let error = runner
        .step(|_| -> anyhow::Result<()> { Err(OutOfMemory::new().into()) })
        .unwrap_err();
    assert_eq!(
        error
            .downcast_ref::<NoExecutableBatchSize>()
            .unwrap()
            .tried(),
        &[8, 4, 2]
    );
}

proptest! {
    #[test]
    fn micro_batches_cover_the_batch_once_in_order(effective in 1usize..500, micro in 0usize..600) {
        let plan = BatchPlan::new(effective, micro);
        let batches: Vec<_> = plan.micro_batches().collect();
        prop_assert_eq!(batches.len(), plan.accumulation());
        let mut next = 0;
        let mut weights = 0.0;
        for (index, batch) in batches.iter().enumerate() {
            prop_assert_eq!(batch.index, index);
            prop_assert_eq!(batch.range.start, next);
            prop_assert!(!batch.range.is_empty() && batch.range.len() <= plan.micro());
            next = batch.range.end;
            weights += batch.weight;
        }
        prop_assert_eq!(next, effective);
        prop_assert!((weights - 1.0).abs() < 1e-9);
    }
}
