//! The tuner on step shapes the benchmark does not have: a fixed part,
//! layers allocating in turn, a `size²` term, a pool rounding to blocks, a buffer that does not
//! grow with the batch, a buffer that appears only above some size. Whatever the shape, no size
//! above a failure is returned and the size returned ran; on the smooth shapes it is at least
//! 0.94 of the largest size that fits, in few trials.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{memory::SimulatedDevice, OutOfMemory, Release, Tuned, Tuner};
use proptest::prelude::*;

use crate::bisect;

const MIB: u64 = 1 << 20;
const DEVICE: u64 = 16 << 30;

/// A step: `fixed` bytes, `layers` tensors of `per_sample / layers` bytes a sample allocated in
/// turn, `squared` bytes a sample², a `buffer` that does not grow with the batch allocated after
/// the layers, and `above` bytes allocated only above the size `threshold`.
#[derive(Debug, Clone, Copy)]
struct Step {
    fixed: u64,
    per_sample: u64,
    layers: u64,
    squared: u64,
    buffer: u64,
    above: (u64, usize),
    block: Option<u64>,
}

impl Step {
    const fn linear(fixed: u64, per_sample: u64) -> Step {
        Step {
            fixed,
            per_sample,
            layers: 1,
            squared: 0,
            buffer: 0,
            above: (0, usize::MAX),
            block: None,
        }
    }

    fn device(&self) -> SimulatedDevice {
        let device = SimulatedDevice::new(DEVICE);
        match self.block {
            Some(block) => device.with_block_size(block),
            None => device,
        }
    }

    fn run(&self, device: &SimulatedDevice, size: usize) -> Result<(), OutOfMemory> {
        let samples = size as u64;
        let mut held = vec![device.alloc(self.fixed)?];
        for _ in 0..self.layers {
            held.push(device.alloc(samples * self.per_sample / self.layers)?);
        }
        held.push(device.alloc(self.buffer)?);
        if size > self.above.1 {
            held.push(device.alloc(self.above.0)?);
        }
        held.push(device.alloc(samples * samples * self.squared)?);
        Ok(())
    }

    /// The largest size that runs on a fresh device, by bisection (every shape is monotone).
    fn largest_fit(&self) -> usize {
        let fits = |size: usize| self.run(&self.device(), size).is_ok();
        bisect::largest_that_fits(fits)
    }

    fn try_tune(&self) -> anyhow::Result<Tuned> {
        let device = self.device();
        Tuner::new()
            .with_release(Release::from(device.clone()))
            .run(|size| -> anyhow::Result<()> { Ok(self.run(&device, size)?) })
    }

    fn tune(&self) -> Tuned {
        self.try_tune().unwrap()
    }
}

/// What holds on every shape: the size returned ran, successfully, as the last trial; it is
/// below every size that failed and below what fits; the trials are bounded.
fn assert_sound(step: &Step, tuned: &Tuned) -> usize {
    let fit = step.largest_fit();
    let report = tuned.report();
    let last = report.last().unwrap();
    assert!(last.outcome.is_success(), "{report}");
    assert_eq!(last.batch_size, tuned.batch_size(), "{report}");
    for failed in report
        .attempts()
        .filter(|attempt| attempt.outcome.is_out_of_memory())
    {
        assert!(tuned.batch_size() < failed.batch_size, "{report}");
    }
    assert!(tuned.batch_size() <= fit, "fit {fit}: {report}");
    assert!(report.len() <= 20, "{report}");
    fit
}

/// At least 0.94 of the largest size that fits: the tuner keeps a 5 % headroom, so on a smooth
/// step it lands within about 1 % of it.
fn assert_near_the_fit(fit: usize, tuned: &Tuned) {
    assert!(
        tuned.batch_size() as f64 >= 0.94 * fit as f64,
        "fit {fit}: {}",
        tuned.report()
    );
}

/// The smooth shapes: within 0.94 of the fit, in at most four trials on average (the bench's
/// bound) and six for any one (a pool's 20 MiB blocks hide the growth of the smallest sizes).
#[test]
fn smooth_shapes_are_tuned_near_the_fit_in_few_trials() {
    let shapes = [
        // A fixed part: 11 GiB of weights and Adam's moments, 45 MiB a sample.
        Step::linear(11 << 30, 45 * MIB),
        // Layers allocating in turn: a failure comes part-way through the step.
        Step {
            layers: 32,
            ..Step::linear(3 << 30, 70 * MIB)
        },
        // A size² term (attention's scores) on top of a line.
        Step {
            squared: 96 << 10,
            ..Step::linear(2 << 30, 25 * MIB)
        },
        // A pool rounding every allocation to 20 MiB blocks, 12 layers.
        Step {
            layers: 12,
            block: Some(20 * MIB),
            ..Step::linear(4 << 30, 36 * MIB)
        },
        // A buffer that does not grow with the batch, allocated after the activations.
        Step {
            buffer: 3 << 30,
            ..Step::linear(2 << 30, 50 * MIB)
        },
    ];
    let mut trials = 0;
    for step in &shapes {
        let tuned = step.tune();
        let fit = assert_sound(step, &tuned);
        assert_near_the_fit(fit, &tuned);
        assert!(tuned.report().len() <= 6, "{step:?}: {}", tuned.report());
        trials += tuned.report().len();
    }
    assert!(
        trials as f64 <= 4.0 * shapes.len() as f64,
        "{trials} trials"
    );
}

/// A buffer that appears only above some size (a workspace an algorithm chooses by size): a
/// line through sizes on both sides of the jump is steeper than the memory above it and would
/// keep far less than fits, with no failure to show it.
#[test]
fn a_buffer_appearing_above_a_threshold_is_not_taken_for_a_steep_line() {
    for threshold in [4usize, 16, 100, 300] {
        let step = Step {
            above: (3500 * MIB, threshold),
            ..Step::linear(3 << 30, 14 * MIB)
        };
        let tuned = step.tune();
        let fit = assert_sound(&step, &tuned);
        // The tuner's own bound (tests/runners/tuner.rs): its trials stop within a quarter of the
        // margin, so the margin's size is within about 1 % (and a sample) of 95 % of the fit.
        assert!(
            tuned.batch_size() as f64 >= 0.95 * fit as f64 / 1.0125 - 1.0,
            "fit {fit}: {}",
            tuned.report()
        );
        assert!(tuned.report().len() <= 8, "{}", tuned.report());
    }
}

fn step() -> impl Strategy<Value = Step> {
    (
        0u64..11_000,
        1u64..150,
        1u64..32,
        prop_oneof![Just(0u64), 1u64..512],
        prop_oneof![Just(0u64), 1u64..3_000],
        prop_oneof![Just((0u64, usize::MAX)), (1u64..4_000, 1usize..600)],
        prop_oneof![Just(None), Just(Some(2 * MIB)), Just(Some(20 * MIB))],
    )
        .prop_map(
            |(
                fixed_mib,
                per_sample_mib,
                layers,
                squared_kib,
                buffer_mib,
                (above_mib, from),
                block,
            )| {
                Step {
                    fixed: fixed_mib * MIB,
                    per_sample: per_sample_mib * MIB,
                    layers,
                    squared: squared_kib << 10,
                    buffer: buffer_mib * MIB,
                    above: (above_mib * MIB, from),
                    block,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any mix of the parts: never above a failure or the fit, and the size returned ran.
    #[test]
    fn on_any_mix_never_above_a_failure(step in step()) {
        let fit = step.largest_fit();
        prop_assume!(fit >= 1);
        // A step whose memory does not show its size (20 MiB blocks over a few MiB a sample)
        // is stopped with an error, never tuned to a size that was not measured.
        if let Ok(tuned) = step.try_tune() {
            assert_sound(&step, &tuned);
        }
    }
}

/// How near the fit the tuner lands on the smooth mixes (no part that appears above a size),
/// over 300 mixes drawn from a fixed seed, so the figure is the same on every run: printed, and
/// held to its measured floor (measured: mean 0.948, worst 0.918; held to 0.94 and 0.90). 20 MiB blocks
/// over a few MiB a sample are where it keeps least: the growth hides in the rounding.
#[test]
fn near_the_fit_on_smooth_mixes_from_a_fixed_seed() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let (mut sum, mut count, mut worst) = (0.0, 0usize, (f64::MAX, String::new()));
    for _ in 0..300 {
        let step = step().new_tree(&mut runner).unwrap().current();
        let fit = step.largest_fit();
        if fit < 1 || step.above.1 != usize::MAX {
            continue;
        }
        let Ok(tuned) = step.try_tune() else {
            continue;
        };
        assert_sound(&step, &tuned);
        let near = tuned.batch_size() as f64 / fit as f64;
        sum += near;
        count += 1;
        if near < worst.0 {
            worst = (
                near,
                format!("{step:?}: fit {fit}, {:?}", tuned.report().tried()),
            );
        }
    }
    let mean = sum / count as f64;
    eprintln!(
        "smooth mixes: {count}, mean {mean:.3} of the fit, worst {:.3} ({})",
        worst.0, worst.1
    );
    assert!(count >= 100, "{count}");
    assert!(mean >= 0.94, "mean {mean:.3}");
    assert!(worst.0 >= 0.90, "worst {:.3}: {}", worst.0, worst.1);
}
