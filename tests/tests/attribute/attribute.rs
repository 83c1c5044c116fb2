//! Behaviour through the attribute: Accelerate's cases again, OOM by error and by panic,
//! async functions, methods, and parameters handed to every attempt.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::cell::Cell;

use batch_size_runtime::{
    find_executable_batch_size, last_report, NoExecutableBatchSize, OutOfMemory, StopReason,
};

fn fake_out_of_memory() -> anyhow::Error {
    anyhow::anyhow!("CUDA out of memory.")
}

#[find_executable_batch_size(starting = 128, factor = 0.9)]
fn accelerate_sequence(batch_size: usize, seen: &mut Vec<usize>) -> anyhow::Result<usize> {
    seen.push(batch_size);
    if batch_size != 8 {
        return Err(fake_out_of_memory());
    }
    Ok(batch_size)
}

#[test]
fn factor_0_9_reproduces_accelerate() {
    let mut seen = Vec::new();
    assert_eq!(accelerate_sequence(&mut seen).unwrap(), 8);
    assert_eq!(
        seen,
        [
            128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11,
            9, 8
        ]
    );
}

#[find_executable_batch_size(starting = 128)]
fn halving(batch_size: u32, seen: &mut Vec<u32>) -> anyhow::Result<()> {
    seen.push(batch_size);
    if batch_size != 8 {
        return Err(fake_out_of_memory());
    }
    Ok(())
}

#[test]
fn halving_is_the_default() {
    let mut seen = Vec::new();
    halving(&mut seen).unwrap();
    assert_eq!(seen, [128, 64, 32, 16, 8]);
}

#[find_executable_batch_size(starting = starting)]
fn explicit(batch_size: usize, starting: usize, arg1: String) -> anyhow::Result<(usize, String)> {
    if batch_size != 8 {
        return Err(fake_out_of_memory());
    }
    Ok((batch_size, arg1))
}

#[test]
fn extra_arguments_pass_through_and_starting_reads_them() {
    let (batch_size, arg) = explicit(64, "hello".to_owned()).unwrap();
    assert_eq!((batch_size, arg.as_str()), (8, "hello"));
}

#[find_executable_batch_size(starting = starting)]
fn start_zero(_batch_size: usize, starting: usize, calls: &Cell<u32>) -> anyhow::Result<()> {
    calls.set(calls.get() + 1);
    Ok(())
}

#[test]
fn start_zero_raises_without_calling() {
    let calls = Cell::new(0);
    let error = start_zero(0, &calls).unwrap_err();
    assert_eq!(calls.get(), 0);
    let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    assert_eq!(none_fit.reason(), &StopReason::StartedAtZero);
    assert!(error
        .to_string()
        .starts_with("No executable batch size found"));
}

#[find_executable_batch_size(starting = 16)]
fn approach_zero(_batch_size: usize) -> anyhow::Result<()> {
    Err(fake_out_of_memory())
}

#[test]
fn approach_zero_raises_reached_zero() {
    let error = approach_zero().unwrap_err();
    let none_fit = error.downcast_ref::<NoExecutableBatchSize>().unwrap();
    assert_eq!(none_fit.tried(), &[16, 8, 4, 2, 1]);
    assert!(error
        .to_string()
        .starts_with("No executable batch size found: reached zero"));
}

#[find_executable_batch_size(starting = 100, reduce = |failed| failed.batch_size - 30)]
fn custom_reduction(batch_size: usize) -> anyhow::Result<usize> {
    if batch_size > 50 {
        return Err(fake_out_of_memory());
    }
    Ok(batch_size)
}

#[test]
fn custom_reduction_through_the_attribute() {
    assert_eq!(custom_reduction().unwrap(), 40);
    let sizes: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(sizes, [100, 70, 40]);
}

#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error("Oops, we had an error!")]
    Oops,
    #[error(transparent)]
    Oom(#[from] OutOfMemory),
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

#[find_executable_batch_size(starting = 64, min = 4)]
fn typed_errors(
    batch_size: i64,
    fail_with_oops_at: i64,
    calls: &Cell<u32>,
) -> Result<i64, TrainError> {
    calls.set(calls.get() + 1);
    if batch_size == fail_with_oops_at {
        return Err(TrainError::Oops);
    }
    if batch_size > 4 {
        Err(OutOfMemory::new())?;
    }
    Ok(batch_size)
}

#[test]
fn other_errors_come_back_unchanged_after_one_call() {
    let calls = Cell::new(0);
    assert!(matches!(typed_errors(64, &calls), Err(TrainError::Oops)));
    assert_eq!(calls.get(), 1);

    let calls = Cell::new(0);
    assert!(matches!(typed_errors(16, &calls), Err(TrainError::Oops)));
    assert_eq!(calls.get(), 3);

    let calls = Cell::new(0);
    assert_eq!(typed_errors(-1, &calls).unwrap(), 4);
    assert_eq!(calls.get(), 5);
}

#[test]
fn typed_error_enum_carries_no_executable_batch_size() {
    #[find_executable_batch_size(starting = 8, min = 4)]
    fn never_fits(_batch_size: u8) -> Result<(), TrainError> {
        Err(OutOfMemory::new().into())
    }
    match never_fits() {
        Err(TrainError::NoBatchSize(none_fit)) => {
            assert_eq!(none_fit.tried(), &[8, 4]);
            assert_eq!(
                none_fit.reason(),
                &StopReason::BelowMinimum { next: 2, min: 4 }
            );
        }
        other => panic!("expected NoBatchSize, got {other:?}"),
    }
}

#[find_executable_batch_size(starting = 32)]
fn panics_on_oom(batch_size: usize) -> usize {
    if batch_size > 8 {
        panic!("CUDA out of memory. Tried to allocate {batch_size}.00 MiB");
    }
    batch_size
}

#[test]
fn oom_panics_are_retried_for_plain_return_types() {
    assert_eq!(panics_on_oom(), 8);
    assert_eq!(last_report().unwrap().out_of_memory_count(), 2);
}

#[find_executable_batch_size(starting = 4)]
fn never_fits_plain(_batch_size: usize) {
    panic!("CUDA out of memory.");
}

#[test]
fn plain_return_type_panics_with_the_message_when_nothing_fits() {
    let payload = std::panic::catch_unwind(never_fits_plain).unwrap_err();
    let message = payload.downcast_ref::<String>().unwrap();
    assert!(
        message.starts_with("No executable batch size found: reached zero; tried 4, 2, 1"),
        "{message}"
    );
}

#[find_executable_batch_size(starting = 4)]
fn other_panic(_batch_size: usize) -> anyhow::Result<()> {
    std::panic::panic_any(7_u8)
}

#[test]
fn other_panics_resume_with_their_payload() {
    let payload = std::panic::catch_unwind(other_panic).unwrap_err();
    assert_eq!(payload.downcast_ref::<u8>(), Some(&7));
}

struct Trainer {
    fits_at: usize,
    attempts: Vec<usize>,
}

impl Trainer {
    #[find_executable_batch_size(starting = 64)]
    fn fit(&mut self, batch_size: usize, epochs: usize) -> anyhow::Result<usize> {
        self.attempts.push(batch_size);
        if batch_size > self.fits_at {
            return Err(fake_out_of_memory());
        }
        Ok(batch_size * epochs)
    }

    #[find_executable_batch_size(starting = 64)]
    fn peek(&self, batch_size: usize) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
        if batch_size > self.fits_at {
            return Err("CUDA out of memory. Tried to allocate 1.00 GiB".into());
        }
        Ok(batch_size)
    }
}

#[test]
fn methods_with_receivers() {
    let mut trainer = Trainer {
        fits_at: 20,
        attempts: Vec::new(),
    };
    assert_eq!(trainer.fit(3).unwrap(), 48);
    assert_eq!(trainer.attempts, [64, 32, 16]);
    assert_eq!(trainer.peek().unwrap(), 16);
}

#[find_executable_batch_size(starting = 16)]
fn clones_owned_parameters(batch_size: usize, mut data: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    data.push(batch_size as u8);
    if batch_size > 4 {
        return Err(fake_out_of_memory());
    }
    Ok(data)
}

#[test]
fn owned_parameters_are_fresh_for_every_attempt() {
    assert_eq!(clones_owned_parameters(vec![1]).unwrap(), [1, 4]);
}

#[find_executable_batch_size(starting = 16)]
fn generic<T, F>(batch_size: usize, items: &[T], cost: F) -> anyhow::Result<usize>
where
    T: Copy + Into<usize>,
    F: Fn(usize) -> usize + Clone,
{
    let total: usize = items.iter().map(|&item| item.into()).sum();
    if cost(batch_size) > total {
        return Err(fake_out_of_memory());
    }
    Ok(batch_size)
}

#[test]
fn generic_functions_with_where_clauses() {
    assert_eq!(generic(&[10_u8, 20], |size| size * 10).unwrap(), 2);
}

#[find_executable_batch_size(starting = 64)]
async fn train_async(batch_size: usize, fits_at: &usize) -> anyhow::Result<usize> {
    ready().await;
    if batch_size > *fits_at {
        return Err(OutOfMemory::new().into());
    }
    if batch_size > *fits_at / 2 + 1 {
        panic!("CUDA out of memory.");
    }
    Ok(batch_size)
}

async fn ready() {}

#[test]
fn async_functions_retry_errors_and_panics() {
    assert_eq!(block_on(train_async(&40)).unwrap(), 16);
    let report = last_report().unwrap();
    let sizes: Vec<usize> = report
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(sizes, [64, 32, 16]);
}

#[test]
fn async_functions_are_send_when_their_body_is() {
    fn assert_send<F: std::future::Future + Send>(_: &F) {}
    let fits_at = 8;
    let future = train_async(&fits_at);
    assert_send(&future);
    // 64, 32 and 16 return OutOfMemory; 8 panics with it (8 > 8 / 2 + 1); 4 fits.
    assert_eq!(block_on(future).unwrap(), 4);
}

/// A minimal executor: these futures never wait on anything.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
            return value;
        }
    }
}

/// An error type like candle's or tch's: no `From<NoExecutableBatchSize>`, but `From<io::Error>`.
#[derive(Debug)]
enum FrameworkError {
    Io(std::io::Error),
    Oom,
}

impl From<std::io::Error> for FrameworkError {
    fn from(error: std::io::Error) -> Self {
        FrameworkError::Io(error)
    }
}

impl std::fmt::Display for FrameworkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameworkError::Io(error) => write!(f, "io: {error}"),
            FrameworkError::Oom => f.write_str("CUDA out of memory. Tried to allocate 2.00 GiB"),
        }
    }
}

impl std::error::Error for FrameworkError {}

#[find_executable_batch_size(starting = 4)]
fn framework_never_fits(_batch_size: usize) -> Result<(), FrameworkError> {
    Err(FrameworkError::Oom)
}

#[test]
fn an_error_type_with_from_io_error_receives_the_failure_inside_an_io_error() {
    let Err(FrameworkError::Io(io)) = framework_never_fits() else {
        panic!("expected the failure inside FrameworkError::Io");
    };
    assert_eq!(io.kind(), std::io::ErrorKind::OutOfMemory);
    let none_fit = io
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<NoExecutableBatchSize>())
        .unwrap();
    assert_eq!(none_fit.tried(), &[4, 2, 1]);
}

#[find_executable_batch_size(starting = 4)]
fn string_errors(batch_size: usize) -> Result<usize, String> {
    if batch_size > 1 {
        return Err(format!("CUDA out of memory with {batch_size}"));
    }
    Err("shape mismatch".to_owned())
}

#[find_executable_batch_size(starting = 2)]
fn string_never_fits(_batch_size: usize) -> Result<(), String> {
    Err("MPS backend out of memory".to_owned())
}

#[test]
fn string_errors_are_classified_by_text_and_receive_the_message() {
    assert_eq!(string_errors(), Err("shape mismatch".to_owned()));
    let message = string_never_fits().unwrap_err();
    assert!(
        message.starts_with("No executable batch size found: reached zero; tried 2, 1"),
        "{message}"
    );
}

#[find_executable_batch_size(starting = 8, min = 4)]
fn inner_step(micro_batch: usize, outer_batch: usize) -> anyhow::Result<usize> {
    // Needs 3 units per sample of the outer batch and 1 per micro-batch sample; 24 units free.
    if 3 * outer_batch + micro_batch > 24 {
        return Err(OutOfMemory::new().into());
    }
    Ok(micro_batch)
}

#[find_executable_batch_size(starting = 16)]
fn outer_loop(outer_batch: usize) -> anyhow::Result<(usize, usize)> {
    let micro_batch = inner_step(outer_batch)?;
    Ok((outer_batch, micro_batch))
}

#[test]
fn an_inner_search_that_gives_up_makes_the_outer_one_shrink() {
    // outer 16 and 8: no micro-batch of at least 4 fits, the inner search gives up; outer 4: 8.
    assert_eq!(outer_loop().unwrap(), (4, 8));
}

#[find_executable_batch_size(starting = 150, margin = 0.2, release = device.clone())]
fn with_margin(
    batch_size: usize,
    device: &batch_size_runtime::memory::SimulatedDevice,
) -> anyhow::Result<usize> {
    let _activations = device.alloc(batch_size as u64 * (8 << 20))?; // 8 MiB a sample
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 256, policy = batch_size_runtime::policy::Halve, release = device.clone())]
fn with_halving(
    batch_size: usize,
    device: &batch_size_runtime::memory::SimulatedDevice,
) -> anyhow::Result<usize> {
    let _activations = device.alloc(batch_size as u64 * (8 << 20))?;
    Ok(batch_size)
}

#[test]
fn margin_and_policy_arguments() {
    let device = batch_size_runtime::memory::SimulatedDevice::new(1 << 30); // 128 samples fit
    assert_eq!(with_margin(&device).unwrap(), 102); // 80 % of 128, in one retry (150 failed)
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 2);
    assert_eq!(with_halving(&device).unwrap(), 128);
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 2);
}

#[find_executable_batch_size(starting = 64, effective = 96, release = device.clone())]
fn plan_step(
    plan: batch_size_runtime::BatchPlan,
    device: &batch_size_runtime::memory::SimulatedDevice,
    seen: &mut Vec<(usize, usize)>,
) -> anyhow::Result<usize> {
    seen.push((plan.micro(), plan.accumulation()));
    for micro in plan.micro_batches() {
        let _activations = device.alloc(micro.range.len() as u64 * (1 << 20))?;
    }
    Ok(plan.micro_batches().map(|micro| micro.range.len()).sum())
}

#[test]
fn the_attribute_keeps_the_effective_batch_with_a_plan() {
    let device = batch_size_runtime::memory::SimulatedDevice::new(20 << 20); // 20 samples at once
    let mut seen = Vec::new();
    let samples = plan_step(&device, &mut seen).unwrap();
    assert_eq!(samples, 96); // every attempt covers the whole effective batch
    let (micro, accumulation) = *seen.last().unwrap();
    assert!(
        micro <= 20 && accumulation == 96usize.div_ceil(micro),
        "{seen:?}"
    );
    // The first proposal, 64, covers 96 in two passes, split evenly: 48 + 48.
    assert_eq!(seen[0], (48, 2));
}

#[find_executable_batch_size(starting = 128, cache = format!("attribute cache {key}"))]
fn cached(batch_size: usize, key: u32) -> anyhow::Result<usize> {
    if batch_size > 50 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[test]
fn the_attribute_caches_what_fit() {
    assert_eq!(cached(1).unwrap(), 32);
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 3);
    assert_eq!(cached(1).unwrap(), 32);
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 1);
    assert_eq!(cached(2).unwrap(), 32); // another key
    assert_eq!(batch_size_runtime::last_report().unwrap().len(), 3);
}

/// `agree = EXPR`: ranks of a data-parallel job (here threads, one simulated GPU each) agree
/// on one size; the body reaches the collective through its parameter for the safe point.
#[test]
fn agree_makes_every_rank_return_the_same_size() {
    use batch_size_runtime::agree::{safe_point, ThreadRank, ThreadRanks};
    use batch_size_runtime::memory::SimulatedDevice;

    #[find_executable_batch_size(starting = 256, agree = rank, release = device.clone())]
    fn train(
        batch_size: usize,
        rank: &ThreadRank,
        device: &SimulatedDevice,
    ) -> anyhow::Result<usize> {
        let forward_backward = device.alloc(batch_size as u64 * 1024);
        // The safe point: before the gradient all-reduce, every rank learns whether one ran
        // out of memory.
        safe_point(rank, forward_backward.is_err())?;
        forward_backward?;
        Ok(batch_size)
    }

    let ranks = ThreadRanks::with_timeout(3, std::time::Duration::from_secs(5));
    let sizes: Vec<usize> = std::thread::scope(|scope| {
        let workers: Vec<_> = ranks
            .iter()
            .zip([300u64, 100, 200])
            .map(|(rank, kib)| scope.spawn(move || train(rank, &SimulatedDevice::new(kib * 1024))))
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap().unwrap())
            .collect()
    });
    assert!(sizes.iter().all(|&size| size == sizes[0]), "{sizes:?}");
    assert!(sizes[0] <= 100 && sizes[0] > 0, "{sizes:?}");
}

#[derive(Debug, Clone, PartialEq)]
struct TrainSettings {
    checkpointing: bool,
    context: usize,
    seed: u64,
}

fn train_remedies() -> batch_size_runtime::remedies::Remedies<TrainSettings> {
    use batch_size_runtime::{remedies::Remedies, remedies::Remedy};
    Remedies::new(TrainSettings {
        checkpointing: false,
        context: 2048,
        seed: 7,
    })
    .then(Remedy::switch(
        "activation checkpointing",
        |s: &mut TrainSettings| s.checkpointing = true,
    ))
    .then(
        Remedy::knob(
            "context length",
            |s: &TrainSettings| s.context,
            |s: &mut TrainSettings, v| s.context = v,
        )
        .with_floor(512),
    )
}

#[find_executable_batch_size(starting = 8, min = 2, remedies = remedies, release = device.clone())]
fn remedied_step(
    attempt: batch_size_runtime::remedies::Remedied<TrainSettings>,
    remedies: &batch_size_runtime::remedies::Remedies<TrainSettings>,
    device: &batch_size_runtime::memory::SimulatedDevice,
) -> anyhow::Result<(usize, TrainSettings)> {
    let settings = attempt.settings();
    let per_token: u64 = if settings.checkpointing {
        1 << 10
    } else {
        4 << 10
    };
    let _activations =
        device.alloc(per_token * (attempt.batch_size() * settings.context) as u64)?;
    Ok((attempt.batch_size(), settings.clone()))
}

#[test]
fn the_attribute_applies_remedies_after_min_and_hands_the_settings_over() {
    // 2 samples of 2048 tokens at 4 KiB a token need 16 MiB; with checkpointing 4 MiB; the
    // device has 3 MiB: checkpointing, then the context halved to 1024 (2 MiB at 2 samples).
    let device = batch_size_runtime::memory::SimulatedDevice::new(3 << 20);
    let remedies = train_remedies();
    let (size, settings) = remedied_step(&remedies, &device).unwrap();
    assert_eq!(
        settings,
        TrainSettings {
            checkpointing: true,
            context: 1024,
            seed: 7
        }
    );
    assert_eq!(size, 2);
    assert_eq!(
        remedies.applied(),
        ["activation checkpointing", "context length 1024"]
    );
    let report = batch_size_runtime::last_report().unwrap();
    let first_remedied = report
        .attempts()
        .position(|attempt| attempt.remedies.is_some())
        .unwrap();
    // Before the first remedy the batch size went down to `min`, which failed.
    let before: Vec<_> = report.attempts().take(first_remedied).collect();
    assert!(before.iter().all(|a| a.outcome.is_out_of_memory()));
    assert_eq!(before.last().unwrap().batch_size, 2);
    // After it the search started again from `starting`.
    assert_eq!(report.attempts().nth(first_remedied).unwrap().batch_size, 8);
    assert_eq!(
        report.last().unwrap().remedies.as_deref(),
        Some("activation checkpointing, context length 1024")
    );
}
