// A generic error type whose bounds do not let it be inspected: an out-of-memory error would
// be returned after one attempt without a warning, so it does not compile, and the message
// names the bound to add.
use batch_size_runtime::{find_executable_batch_size, NoExecutableBatchSize, OutOfMemory};

#[find_executable_batch_size(starting = 8)]
fn train<E: From<NoExecutableBatchSize> + From<OutOfMemory>>(batch_size: usize) -> Result<usize, E> {
    if batch_size > 2 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

fn main() {
    let _ = train::<anyhow::Error>();
}
