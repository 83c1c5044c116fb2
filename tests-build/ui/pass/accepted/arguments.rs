// Every argument: `starting` from another parameter, `min`, `factor`, `reduce`,
// `max_attempts`, `release`, expressions and constants, in any order.
use batch_size_runtime::{
    find_executable_batch_size,
    last_report,
    NoExecutableBatchSize,
    OutOfMemory,
    Release,
    memory::SimulatedDevice,
    StopReason,
};

struct Config {
    batch_size: usize,
    limit: usize,
}

fn oom_above(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

fn no_size(error: anyhow::Error) -> NoExecutableBatchSize {
    error.downcast::<NoExecutableBatchSize>().unwrap()
}

#[find_executable_batch_size(starting = cfg.batch_size)]
fn from_config(batch_size: usize, cfg: &Config) -> anyhow::Result<usize> {
    oom_above(batch_size, cfg.limit)
}

#[find_executable_batch_size(starting = 64, min = 16)]
fn with_min(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(starting = 128, factor = 0.9)]
fn with_factor(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

const FACTOR: f32 = 0.75;

#[find_executable_batch_size(starting = 100, factor = FACTOR)]
fn with_factor_const(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(starting = 10, reduce = |failed| failed.batch_size - 1)]
fn with_reduce(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(
    starting = 10,
    reduce = move |failed: &batch_size_runtime::policy::FailedAttempt<'_>| failed.batch_size - step,
)]
fn with_reduce_capture(batch_size: usize, step: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(starting = 64, max_attempts = 2)]
fn with_max_attempts(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(starting = 8, release = batch_size_runtime::Release::none())]
fn with_release_none(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    oom_above(batch_size, limit)
}

#[find_executable_batch_size(starting = 8, release = device.clone())]
fn with_release_device(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
    let _buffer = device.alloc(batch_size as u64 * 100)?;
    Ok(batch_size)
}

#[find_executable_batch_size(
    release = Release::none(),
    max_attempts = 10u8,
    min = 2,
    factor = 0.5,
    starting = 1 << 5,
)]
fn everything(batch_size: u32, limit: u32) -> anyhow::Result<usize> {
    oom_above(batch_size as usize, limit as usize)
}

pub fn main() {
    let cfg = Config {
        batch_size: 48,
        limit: 20,
    };
    assert_eq!(from_config(&cfg).unwrap(), 12);

    assert_eq!(with_min(20).unwrap(), 16);
    let error = no_size(with_min(10).unwrap_err());
    assert_eq!(error.tried(), &[64, 32, 16]);
    assert!(matches!(
        error.reason(),
        StopReason::BelowMinimum { next: 8, min: 16 }
    ));

    assert_eq!(with_factor(100).unwrap(), 92);
    assert_eq!(last_report().unwrap().len(), 4); // 128, 115, 103, 92

    assert_eq!(with_factor_const(60).unwrap(), 56); // 100, 75, 56

    assert_eq!(with_reduce(7).unwrap(), 7);
    assert_eq!(last_report().unwrap().len(), 4); // 10, 9, 8, 7

    assert_eq!(with_reduce_capture(3, 5).unwrap(), 4); // 10, 7, 4

    let error = no_size(with_max_attempts(1).unwrap_err());
    assert_eq!(error.reason(), &StopReason::MaxAttempts(2));
    assert_eq!(error.tried(), &[64, 32]);

    assert_eq!(with_release_none(3).unwrap(), 2);

    let device = SimulatedDevice::new(500);
    assert_eq!(with_release_device(&device).unwrap(), 4);

    assert_eq!(everything(5).unwrap(), 4); // 32, 16, 8, 4
}
