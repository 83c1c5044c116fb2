//! Grows after a step in a build where a panic aborts: exits 0 only where the search grew and
//! landed near the fit.

use batch_size_runtime::{find_executable_batch_size, last_report, memory::SimulatedDevice, Outcome};

const MIB: u64 = 1 << 20;

/// 100 MiB fixed, 1 MiB a sample, on 1 GiB: 924 fit.
#[find_executable_batch_size(starting = 64, release = device.clone())]
fn train(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
    let _weights = device.alloc(100 * MIB)?;
    for _step in 0..6 {
        let _activations = device.alloc(batch_size as u64 * MIB)?;
        batch_size_runtime::step_done()?;
    }
    Ok(batch_size)
}

fn main() -> anyhow::Result<()> {
    assert!(cfg!(panic = "abort"), "built with panic = \"abort\"");
    let fitted = train(&SimulatedDevice::new(1 << 30))?;
    let report = last_report().ok_or_else(|| anyhow::anyhow!("no report"))?;
    let grew = report
        .attempts()
        .filter(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
        .count();
    println!("panic = abort: {fitted} of 924 after {grew} growths\n{report}");
    anyhow::ensure!(grew >= 1 && (850..=924).contains(&fitted), "no growth under panic = abort");
    Ok(())
}
