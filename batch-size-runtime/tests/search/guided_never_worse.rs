//! The default policy is never worse than halving, case by case: on every workload of the search
//! benchmark (`common/workloads.rs`, the one definition `benches/search.rs` runs too), from every
//! start above the fit, with the device's figures and with the error's text only, it ends at a
//! size at least as large as halving's and in no more attempts than halving's + 3; and the same
//! over random step shapes (a fixed part, layers that allocate in turn, a batch² term, a tail
//! after the layers).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::{Guided, Halve, SizePolicy};
use batch_size_runtime::{
    memory::MemoryBackend, memory::SimulatedDevice, BatchSizeSearch, OutOfMemory,
};
use proptest::prelude::*;

use crate::workloads;

use workloads::{hold, noise, TextOnly, Workload, DEVICE, GIB, MIB};

/// The size found (0 for none) and the attempts made.
fn search(
    start: usize,
    policy: impl SizePolicy + 'static,
    figures: bool,
    device: &SimulatedDevice,
    step: impl Fn(&SimulatedDevice, u64, u64) -> Result<(), OutOfMemory>,
) -> (usize, usize) {
    // What an earlier search left in the device's cache.
    device.release().unwrap();
    let search = if figures {
        BatchSizeSearch::new(start).with_release(device.clone())
    } else {
        BatchSizeSearch::new(start).with_release(TextOnly(device.clone()))
    };
    let mut attempt = 0;
    let (found, report) =
        search
            .with_policy(policy)
            .run_with_report(|size| -> anyhow::Result<usize> {
                attempt += 1;
                step(device, size as u64, attempt)?;
                Ok(size)
            });
    (found.unwrap_or(0), report.len())
}

#[test]
fn on_every_benchmark_workload_never_below_halving_nor_over_its_attempts_plus_three() {
    let mut utilisation = Vec::new();
    let (mut attempts, mut halving_attempts) = (0, 0);
    for workload in Workload::ALL {
        let name = workload.name();
        // The fit at the noise of an attempt numbered u64::MAX (1.014: the noisy workload's fit
        // is 121, one below its nominal 122), which bounds the size found from above.
        let fit = workload.largest_fit(noise(u64::MAX));
        // The n-th attempt of a search (from 1) draws the n-th noise.
        let step = |device: &SimulatedDevice, size: u64, attempt: u64| {
            workload.step(device, size, noise(attempt))
        };
        assert!(fit > 0, "{name}");
        // The benchmark's starts: those above the fit, and 4¼ and 16¼ times the fit (halving's
        // worst case, near half the fit).
        let nominal = workload.largest_fit(1.0);
        let largest = workload.largest_fit(0.97);
        for start in [128usize, 256, 512]
            .into_iter()
            .filter(|&start| start > nominal)
            .chain([nominal * 4 + nominal / 4, nominal * 16 + nominal / 4])
        {
            let halving = search(start, Halve, true, &workload.device(), step);
            for figures in [true, false] {
                let guided = search(start, Guided::new(), figures, &workload.device(), step);
                assert!(
                    guided.0 >= halving.0,
                    "{name} from {start} (figures: {figures}): {} below halving's {}",
                    guided.0,
                    halving.0
                );
                assert!(
                    guided.1 <= halving.1 + 3,
                    "{name} from {start} (figures: {figures}): {} attempts, halving {}",
                    guided.1,
                    halving.1
                );
                // A size that ran at an attempt's lower noise may be above `fit`, never above the
                // fit at the least noise.
                assert!(
                    guided.0 <= largest,
                    "{name} from {start}: {} of {largest}",
                    guided.0
                );
                utilisation.push(guided.0 as f64 / fit as f64);
                attempts += guided.1;
                halving_attempts += halving.1;
            }
        }
    }
    // Over the cases, with and without the device's figures: at least 0.90 of the fit on the
    // mean (halving gets 0.62 here), in at most two attempts more than halving on the mean.
    let cases = utilisation.len() as f64;
    let mean = utilisation.iter().sum::<f64>() / cases;
    assert!(mean >= 0.90, "mean utilisation {mean:.3}");
    let extra = (attempts as f64 - halving_attempts as f64) / cases;
    assert!(
        extra <= 2.0,
        "{extra:.2} attempts more than halving on the mean"
    );
    println!("mean utilisation {mean:.3}, {extra:.2} attempts more than halving on the mean");
}

/// On the shapes written after the policy ([`Workload::NEW`]), from 1.25 to 16¼ times the fit:
/// never below halving's size, never more than three attempts more.
#[test]
fn on_shapes_it_was_not_written_against_never_below_halving_nor_over_its_attempts_plus_three() {
    for workload in Workload::NEW {
        let name = workload.name();
        let fit = workload.largest_fit(1.0);
        let step = |device: &SimulatedDevice, size: u64, _: u64| workload.step(device, size, 1.0);
        for factor in [1.25, 1.7, 2.5, 4.25, 8.5, 16.25] {
            let start = ((fit as f64 * factor).round() as usize).max(fit + 1);
            let halving = search(start, Halve, true, &workload.device(), step);
            let guided = search(start, Guided::new(), true, &workload.device(), step);
            assert!(
                guided.0 >= halving.0 && guided.0 <= fit,
                "{name} from {start}: {} (halving {}, fit {fit})",
                guided.0,
                halving.0
            );
            assert!(
                guided.1 <= halving.1 + 3,
                "{name} from {start}: {} attempts, halving {}",
                guided.1,
                halving.1
            );
        }
    }
}

/// A step of random shape: a fixed part, layers that each keep a linear and a batch² part,
/// then a tail; the order the memory is allocated in is the same at every size.
#[derive(Debug, Clone)]
struct Shape {
    fixed: u64,
    layers: u64,
    per_sample: u64,
    squared: u64,
    tail_per_sample: u64,
    held_before: u64,
}

impl Shape {
    fn step(&self, device: &SimulatedDevice, size: u64) -> Result<(), OutOfMemory> {
        let mut held = Vec::new();
        hold(device, &mut held, self.fixed)?;
        for _ in 0..self.layers {
            hold(device, &mut held, size * self.per_sample)?;
            if self.squared > 0 {
                hold(device, &mut held, size * size * self.squared)?;
            }
        }
        if self.tail_per_sample > 0 {
            hold(device, &mut held, size * self.tail_per_sample)?;
        }
        Ok(())
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        0u64..14 * GIB,
        1u64..40,
        (1u64 << 10)..200 * MIB,
        prop_oneof![Just(0u64), (1u64 << 10)..MIB],
        prop_oneof![Just(0u64), (1u64 << 10)..400 * MIB],
        prop_oneof![Just(0u64), 0u64..4 * GIB],
    )
        .prop_map(
            |(fixed, layers, per_sample, squared, tail_per_sample, held_before)| Shape {
                fixed,
                layers,
                per_sample,
                squared,
                tail_per_sample,
                held_before,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// On any such step, from any start, with or without the device's figures: at least
    /// halving's size, at most halving's attempts + 3, and a size that fits.
    #[test]
    fn any_step_shape_never_below_halving_nor_over_its_attempts_plus_three(
        shape in shape(),
        start in 1usize..3000,
        figures in any::<bool>(),
    ) {
        let device = SimulatedDevice::new(DEVICE).with_caching();
        // Another process's memory, there before and during the search.
        let _neighbour = device.alloc(shape.held_before).unwrap();
        let step = |device: &SimulatedDevice, size: u64, _: u64| shape.step(device, size);
        let halving = search(start, Halve, true, &device, step);
        let guided = search(start, Guided::new(), figures, &device, step);
        prop_assert!(guided.0 >= halving.0, "{:?} from {}: {:?} against halving's {:?}", shape, start, guided, halving);
        prop_assert!(guided.1 <= halving.1 + 3, "{:?} from {}: {:?} against halving's {:?}", shape, start, guided, halving);
        if guided.0 > 0 {
            device.release().unwrap(); // what the last attempt left in the cache
            prop_assert!(shape.step(&device, guided.0 as u64).is_ok());
        }
    }
}
