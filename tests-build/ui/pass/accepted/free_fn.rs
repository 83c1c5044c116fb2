// A free function: the batch size disappears from the signature and halves on out-of-memory.
use batch_size_runtime::{find_executable_batch_size, last_report, OutOfMemory};

#[find_executable_batch_size(starting = 128)]
fn train(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

pub fn main() {
    assert_eq!(train(40).unwrap(), 32);
    let report = last_report().unwrap();
    assert_eq!(report.len(), 3);
    assert_eq!(report.batch_size(), Some(32));

    let error = train(0).unwrap_err();
    let error = error
        .downcast_ref::<batch_size_runtime::NoExecutableBatchSize>()
        .unwrap();
    assert_eq!(error.tried(), &[128, 64, 32, 16, 8, 4, 2, 1]);
}
