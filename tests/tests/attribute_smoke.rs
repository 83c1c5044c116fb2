use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

#[find_executable_batch_size(starting = 64)]
fn fits_at_16(batch_size: usize, calls: &mut Vec<usize>) -> anyhow::Result<usize> {
    calls.push(batch_size);
    if batch_size > 16 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[test]
fn smoke() {
    let mut calls = Vec::new();
    assert_eq!(fits_at_16(&mut calls).unwrap(), 16);
    assert_eq!(calls, [64, 32, 16]);
}
