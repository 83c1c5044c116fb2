//! candle on the CPU allocates with `Vec`: past the memory there is, the process aborts (exit
//! 134 by SIGABRT) and no retry in the process is possible. `ChildTrial` runs each size in a
//! child process, under an address-space limit here, and the search goes on after the abort.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::oom::{ChildTrial, ChildTrialError};
use batch_size_runtime::{find_executable_batch_size, last_report, Outcome};
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

/// A child whose step fails otherwise: the error comes back, after one attempt.
#[cfg(target_os = "linux")]
#[test]
fn a_childs_own_error_comes_back_unchanged() {
    // The child test serves another trial: it panics, which is not out of memory.
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
    let ChildTrialError::Failed { message, .. } = &error else {
        panic!("not the child's own failure: {error}");
    };
    assert!(message.contains("run only as"), "{message}");
    assert_eq!(last_report().unwrap().attempts().count(), 1);
}
