//! Trains a small MLP with tch on the CPU under an address-space limit, so that libtorch's CPU
//! allocator runs out of memory and the search recovers, with the host's figures in the log.
//!
//! `LIBTORCH=/usr cargo run --manifest-path real-allocators/tch/Cargo.toml --example cpu_oom`

use batch_size_runtime::Release;
use batch_size_runtime::{find_executable_batch_size, last_report};
use real_allocators_tch::harness::leave_room;
use real_allocators_tch::{samples, Mlp};

#[find_executable_batch_size(starting = 4096, release = Release::host())]
fn train(batch_size: usize, model: &Mlp) -> anyhow::Result<f64> {
    let (x, y) = samples(0, batch_size as i64)?;
    let loss = model.f_loss_sum(&x, &y)?; // "DefaultCPUAllocator: can't allocate memory: ..."
    loss.f_backward()?;
    Ok(loss.f_double_value(&[])? / batch_size as f64)
}

fn main() -> anyhow::Result<()> {
    let model = Mlp::new()?;
    // libtorch is loaded and its pool started: 256 MiB more address space than now.
    let (x, y) = samples(0, 4)?;
    model.f_loss_sum(&x, &y)?.f_backward()?;
    leave_room(256 << 20);
    let loss = train(&model)?;
    println!("mean loss {loss:.6}");
    if let Some(report) = last_report() {
        for attempt in report.attempts() {
            println!(
                "batch size {:>5}: {}; asked for {:?} bytes; {}",
                attempt.batch_size,
                if attempt.outcome.is_success() {
                    "ran"
                } else {
                    "out of memory"
                },
                attempt.figures.requested,
                attempt
                    .memory_at_end
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}
