//! What `batch_size_runtime::step_done()` costs where it does nothing more: outside a search, and
//! inside an attempt after its first step (a training loop's every later step). The target is at
//! most 20 ns a call.
//!
//! `cargo bench -p batch-size-tests --bench step_done -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use batch_size_runtime::memory::SimulatedDevice;
use batch_size_runtime::{step_done, BatchSizeSearch};
use criterion::{criterion_group, criterion_main, Criterion};

fn outside_a_search(c: &mut Criterion) {
    c.bench_function("step_done outside a search", |b| b.iter(step_done));
}

fn after_the_first_step(c: &mut Criterion) {
    // A watched attempt (the default policy, a device with figures) whose first step filled the
    // device: the first call measures and finds no larger size; every later call is timed.
    let device = SimulatedDevice::new(1 << 30);
    let result: anyhow::Result<()> =
        BatchSizeSearch::new(8)
            .with_release(device.clone())
            .run(|batch_size| {
                let _held = device.alloc((batch_size as u64) << 27)?; // the whole device at 8
                step_done()?;
                c.bench_function("step_done after the first step", |b| {
                    b.iter(|| black_box(step_done()))
                });
                Ok(())
            });
    assert!(result.is_ok(), "{result:?}");
}

criterion_group!(benches, outside_a_search, after_the_first_step);
criterion_main!(benches);
