//! `EffectiveBatch`'s first step, which learns nothing yet: it runs out of memory no more often
//! than halving would on any of the convergence benchmark's shapes, and at most 6 times, since
//! the steps after it grow from its figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use crate::training;

use batch_size_runtime::{memory::SimulatedDevice, EffectiveBatch};
use training::{Model, DEVICE, SHAPES};

/// The out-of-memory passes of the first step of `effective` on `shape`, the default policy or
/// halving.
fn first_step_failures(shape: training::Shape, effective: usize, halving: bool) -> usize {
    let device = SimulatedDevice::new(DEVICE);
    let model = Model::new(shape, &device);
    let mut runner = EffectiveBatch::new(effective).with_release(device.clone());
    if halving {
        runner = runner.with_factor(0.5);
    }
    runner
        .step(|plan| -> anyhow::Result<()> { Ok(model.step(plan)?) })
        .unwrap();
    runner.last_step_report().out_of_memory_count()
}

#[test]
fn the_first_step_fails_no_more_often_than_halving() {
    for shape in SHAPES {
        for effective in [1024, 4096] {
            let failures = first_step_failures(shape, effective, false);
            let halving = first_step_failures(shape, effective, true);
            assert!(
                failures <= halving && failures <= 6,
                "{} from {effective}: {failures} out-of-memory passes, halving {halving}",
                shape.name
            );
        }
    }
}
