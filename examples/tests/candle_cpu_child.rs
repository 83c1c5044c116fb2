//! candle on the CPU allocates with `Vec`: past the memory there is, the process aborts (exit
//! 134 by SIGABRT) and no retry in the process is possible. `ChildTrial` runs each size in a
//! child process, under an address-space limit here, and the search goes on after the abort.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{find_executable_batch_size, last_report, Outcome};
use batch_size_runtime::{ChildTrial, ChildTrialError};
use candle_core::{DType, Device, Tensor};

#[cfg(target_os = "linux")]
#[path = "../../batch-size-runtime/tests/common/address_space.rs"]
mod address_space;

/// Address space the child has beyond what it uses once started: 4 MiB a sample, so below 64.
const ROOM: u64 = 256 << 20;

fn trial() -> ChildTrial {
    ChildTrial::new("candle_step").with_args([
        "--exact",
        "child_candle_step",
        "--ignored",
        "--test-threads=1",
    ])
}

/// The step, in the child: candle's CPU tensor of 4 MiB a sample, summed.
#[cfg(target_os = "linux")]
#[test]
#[ignore = "a child process of candle_on_the_cpu_is_sized_in_child_processes: run by it with --ignored"]
fn child_candle_step() {
    trial().serve(|batch_size| -> anyhow::Result<()> {
        address_space::leave_room(ROOM)?;
        let inputs = Tensor::ones((batch_size, 1 << 20), DType::F32, &Device::Cpu)?;
        let total = inputs.sum_all()?.to_scalar::<f32>()?;
        anyhow::ensure!(total > 0.0, "the step summed nothing");
        Ok(())
    });
    panic!("run only as a ChildTrial's child: it sets the batch size");
}

/// The attribute, each size in a child process: the aborts count as out-of-memory.
#[find_executable_batch_size(starting = 4096, release = batch_size_runtime::Release::none())]
fn train(batch_size: usize) -> Result<usize, ChildTrialError> {
    trial().run(batch_size)
}

#[cfg(target_os = "linux")]
#[test]
fn candle_on_the_cpu_is_sized_in_child_processes() {
    let fitted = train().unwrap();
    assert!((16..64).contains(&fitted), "{fitted}");
    let report = last_report().unwrap();
    let aborted = report
        .attempts()
        .filter(|attempt| {
            matches!(&attempt.outcome, Outcome::OutOfMemory { error } if error.contains("SIGABRT"))
        })
        .count();
    assert!(aborted >= 1, "{report:?}");
    assert_eq!(aborted, report.out_of_memory_count());
}

/// A child whose arguments lead to no `serve` of its trial: an error that says so, after one
/// attempt, never a fit.
#[cfg(target_os = "linux")]
#[test]
fn a_child_that_never_started_its_trial_comes_back_as_an_error() {
    // The child test serves another trial, then panics: this trial never starts.
    let refused = ChildTrial::new("candle_step_elsewhere").with_args([
        "--exact",
        "child_candle_step",
        "--ignored",
        "--test-threads=1",
    ]);
    let error = batch_size_runtime::BatchSizeSearch::new(8)
        .with_release(batch_size_runtime::Release::none())
        .run(|batch_size| refused.run(batch_size))
        .unwrap_err();
    let ChildTrialError::NotStarted { name, .. } = &error else {
        panic!("not a trial that never started: {error}");
    };
    assert_eq!(name, "candle_step_elsewhere");
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}
