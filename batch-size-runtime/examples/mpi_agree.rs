//! Ranks of an MPI job agreeing on one batch size, on the CPU (feature `mpi`):
//!
//! ```text
//! cargo build -p batch-size-runtime --features mpi --example mpi_agree
//! mpiexec -n 4 target/debug/examples/mpi_agree
//! ```
//!
//! Each rank gets a simulated GPU of its own size (16, 4, 8 and 12 GiB, and so on); every rank
//! prints the size they all agreed on: the one the smallest GPU holds.

use batch_size_runtime::agree::{safe_point, Collective, MpiJob, MpiRank};
use batch_size_runtime::find_executable_batch_size;
use batch_size_runtime::memory::SimulatedDevice;

/// Activations of one sample during its forward and backward pass.
const PER_SAMPLE: u64 = 64 << 20;

#[find_executable_batch_size(starting = 512, agree = rank, release = gpu.clone())]
fn train(batch_size: usize, rank: &MpiRank, gpu: &SimulatedDevice) -> anyhow::Result<usize> {
    let forward_backward = gpu.alloc(batch_size as u64 * PER_SAMPLE); // may run out of memory
    safe_point(rank, forward_backward.is_err())?; // every rank learns whether one did
    let _activations = forward_backward?;
    // the gradient all-reduce and the optimizer step: every rank gets here, or none
    Ok(batch_size)
}

fn main() -> anyhow::Result<()> {
    // MPI_Init; MPI_Finalize at the end of `main`, or MPI_Abort if a panic unwinds out of it.
    let job = MpiJob::init()?;
    let rank = job.agreement();
    let gibibytes = [16u64, 4, 8, 12][rank.rank() % 4];
    let gpu = SimulatedDevice::new(gibibytes << 30);
    let batch_size = train(&rank, &gpu)?;
    println!(
        "rank {} of {}: {gibibytes} GiB, agreed batch size {batch_size}",
        rank.rank(),
        rank.world_size()
    );
    Ok(())
}
