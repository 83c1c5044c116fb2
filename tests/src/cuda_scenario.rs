//! A training scenario whose memory grows with the batch size, through cudarc, for the CUDA
//! end-to-end tests (on the fake driver, `tests/tests/fake_cuda/driver.rs`) and the GPU check
//! (on a real one, `src/bin/gpu_check.rs`): the model, its error type, a backend that reads
//! figures without releasing, and a log capture.

use std::io;
use std::sync::{Arc, Mutex};

use batch_size_runtime::memory::{CudaBackend, MemoryBackend, MemorySnapshot, ReleaseError};
use batch_size_runtime::NoExecutableBatchSize;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaStream, DriverError};

/// One mebibyte.
pub const MIB: u64 = 1 << 20;

/// A model whose memory grows with the batch size, as a forward pass's activations do: a step
/// allocates `layers` buffers of `batch_size * bytes_per_sample` bytes one after the other on
/// a stream (from the device's memory pool, where it has one), then optionally a workspace of
/// `batch_size * workspace_bytes_per_sample` bytes with plain `cuMemAlloc` (as cuBLAS and
/// cuDNN take theirs), then reads the last buffer back (its "loss"). Everything is freed when
/// the step returns, successful or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowingModel {
    /// Buffers allocated per step.
    pub layers: usize,
    /// Bytes of each buffer per sample of the batch.
    pub bytes_per_sample: usize,
    /// Bytes of the plain workspace per sample (0: no workspace).
    pub workspace_bytes_per_sample: usize,
}

impl GrowingModel {
    /// A model of `layers` buffers of `bytes_per_sample` bytes per sample each, no workspace.
    pub fn new(layers: usize, bytes_per_sample: usize) -> Self {
        GrowingModel {
            layers,
            bytes_per_sample,
            workspace_bytes_per_sample: 0,
        }
    }

    /// Adds a plain (`cuMemAlloc`) workspace of `bytes_per_sample` bytes per sample, taken
    /// after the buffers.
    pub fn with_workspace(mut self, bytes_per_sample: usize) -> Self {
        self.workspace_bytes_per_sample = bytes_per_sample;
        self
    }

    /// Bytes of one buffer at `batch_size`.
    pub fn layer_bytes(&self, batch_size: usize) -> u64 {
        (batch_size * self.bytes_per_sample) as u64
    }

    /// Bytes a step at `batch_size` needs at its peak.
    pub fn step_bytes(&self, batch_size: usize) -> u64 {
        self.layer_bytes(batch_size) * self.layers as u64
            + (batch_size * self.workspace_bytes_per_sample) as u64
    }

    /// The first size of the halving sequence from `starting` whose step fits in `available`
    /// bytes, if any.
    ///
    /// ```
    /// use batch_size_tests::cuda_scenario::{GrowingModel, MIB};
    ///
    /// let model = GrowingModel::new(4, MIB as usize); // 4 MiB per sample
    /// assert_eq!(model.largest_fitting(100 * MIB, 64), Some(16)); // 64 MiB of 100
    /// assert_eq!(model.largest_fitting(3 * MIB, 64), None);
    /// ```
    pub fn largest_fitting(&self, available: u64, starting: usize) -> Option<usize> {
        std::iter::successors(Some(starting), |size| Some(size / 2))
            .take_while(|&size| size > 0)
            .find(|&size| self.step_bytes(size) <= available)
    }

    /// One training step at `batch_size` on `stream`: returns `batch_size` when every buffer
    /// fits, cudarc's `DriverError(CUDA_ERROR_OUT_OF_MEMORY)` when one does not.
    pub fn step(&self, stream: &Arc<CudaStream>, batch_size: usize) -> Result<usize, DriverError> {
        let mut activations = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            activations.push(stream.alloc_zeros::<u8>(batch_size * self.bytes_per_sample)?);
        }
        let _workspace = match batch_size * self.workspace_bytes_per_sample {
            0 => None,
            bytes => Some(PlainAllocation::new(stream, bytes)?),
        };
        if let Some(last) = activations.last() {
            let loss = stream.clone_dtoh(&last.slice(..last.len().min(16)))?;
            if loss.iter().any(|&byte| byte != 0) {
                return Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
            }
        }
        Ok(batch_size)
    }
}

/// Device memory from `cuMemAlloc_v2`, freed with `cuMemFree_v2` when dropped.
#[derive(Debug)]
struct PlainAllocation(cudarc::driver::sys::CUdeviceptr);

impl PlainAllocation {
    fn new(stream: &CudaStream, bytes: usize) -> Result<Self, DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: the stream's context is current; the memory is never read uninitialised.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.map(PlainAllocation)
    }
}

impl Drop for PlainAllocation {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync above, freed once. The stream-ordered work that could
        // use it was never queued (it is only a stand-in for a library's workspace).
        let _ = unsafe { cudarc::driver::result::free_sync(self.0) };
    }
}

/// A training function's error: cudarc's errors, and no batch size fitting. `#[from]` keeps the
/// `DriverError` as the `source()`, where the search recognises it by its code.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A CUDA driver call failed.
    #[error("a CUDA driver call failed")]
    Cuda(#[from] DriverError),
    /// No batch size fitted.
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

/// The CUDA backend's figures without its release: what the figures look like when nothing is
/// given back between attempts.
#[derive(Debug, Clone, Default)]
pub struct FiguresOnly(pub CudaBackend);

impl MemoryBackend for FiguresOnly {
    fn release(&self) -> Result<(), ReleaseError> {
        Ok(())
    }

    fn memory(&self) -> MemorySnapshot {
        self.0.memory()
    }

    fn reset_peak(&self) {
        self.0.reset_peak();
    }
}

/// Runs `work` with a `tracing` subscriber that writes every event (DEBUG and up, no colours)
/// of this thread to a string, and returns both.
pub fn capture_logs<T>(work: impl FnOnce() -> T) -> (T, String) {
    let buffer = LogBuffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(buffer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let value = tracing::subscriber::with_default(subscriber, work);
    (value, buffer.contents())
}

#[derive(Debug, Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    fn contents(&self) -> String {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl io::Write for LogBuffer {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut buffer = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;

    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}
