// A runner gives the closure's error type back when no size fits, so it needs
// `From<NoExecutableBatchSize>`: a framework's error type alone gets an error saying what to
// do, not a wall of trait bounds.
use batch_size_runtime::BatchSizeSearch;

#[derive(Debug)]
struct FrameworkError;

impl std::fmt::Display for FrameworkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CUDA_ERROR_OUT_OF_MEMORY")
    }
}

impl std::error::Error for FrameworkError {}

fn main() {
    let _ = BatchSizeSearch::new(64).run(|size| -> Result<usize, FrameworkError> { Ok(size) });
}
