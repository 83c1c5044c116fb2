//! The effective batch kept exactly through 12 optimizer steps of a linear model, on a simulated
//! GPU that loses room at step 6 (another process starts): step 6 is redone in place with
//! smaller micro-batches, the steps before it are not, and the gradient of every step is the
//! full batch's.
//!
//! ```text
//! cargo run -p batch-size-examples --example effective_batch
//! ```

use batch_size_runtime::memory::Bytes;
use batch_size_runtime::{memory::SimulatedDevice, EffectiveBatch};

const EFFECTIVE: usize = 256;
const PER_SAMPLE: u64 = 24 << 20; // 24 MiB of activations a sample

fn main() -> anyhow::Result<()> {
    batch_size_examples::init_tracing();
    let device = SimulatedDevice::new(8 << 30); // 8 GiB: 341 samples fit
    println!(
        "Effective batch {EFFECTIVE}, {} of activations a sample, on {} of {}.\n",
        Bytes(PER_SAMPLE),
        device.name(),
        Bytes(device.capacity())
    );

    // Samples of y = 2x + 1 with a little noise, and the model's two parameters.
    let xs: Vec<f64> = (0..EFFECTIVE * 12)
        .map(|i| (i % 97) as f64 / 97.0)
        .collect();
    let ys: Vec<f64> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| 2.0 * x + 1.0 + 0.01 * ((i * 7919 % 13) as f64 - 6.0))
        .collect();
    let (mut w, mut b) = (0.0f64, 0.0f64);

    let mut runner = EffectiveBatch::new(EFFECTIVE).with_release(device.clone());
    let mut other_process = None;
    for step in 0..12 {
        if step == 6 {
            other_process = Some(device.alloc(4 << 30)?); // 4 GiB taken by someone else
            println!("   (another process takes 4 GiB of the device)");
        }
        let offset = step * EFFECTIVE;
        let mut tries = 0;
        runner.step(|plan| -> anyhow::Result<()> {
            tries += 1;
            let (mut grad_w, mut grad_b) = (0.0, 0.0);
            for micro in plan.micro_batches() {
                // The forward and backward pass of one micro-batch: its activations live
                // while it runs.
                let _activations = device.alloc(micro.range.len() as u64 * PER_SAMPLE)?;
                let count = micro.range.len() as f64;
                let (mut gw, mut gb) = (0.0, 0.0);
                for i in micro.range.clone() {
                    let error = w * xs[offset + i] + b - ys[offset + i];
                    gw += 2.0 * error * xs[offset + i] / count;
                    gb += 2.0 * error / count;
                }
                // Its mean loss's gradient, weighted by its share of the batch.
                grad_w += micro.weight * gw;
                grad_b += micro.weight * gb;
            }
            // The optimizer steps once, after every micro-batch ran.
            w -= 0.5 * grad_w;
            b -= 0.5 * grad_b;
            Ok(())
        })?;
        let plan = runner.plan();
        println!(
            "step {step:>2}: {} micro-batch(es) of {:>3}{}  w = {w:.4}, b = {b:.4}",
            plan.accumulation(),
            plan.micro(),
            if tries > 1 {
                format!("  (recovered in place after {} attempts)", tries)
            } else {
                String::new()
            },
        );
    }
    drop(other_process);

    println!("\nRecoveries: {:?}", runner.recoveries());
    println!(
        "Every step used all {EFFECTIVE} samples: the effective batch never changed, only how it \
         was divided."
    );
    Ok(())
}
