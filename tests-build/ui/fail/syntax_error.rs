// A body that does not parse: the one syntax error, and callers (which omit the batch size)
// see the rewritten signature, so they raise nothing of their own.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 8)]
fn train(batch_size: usize, data: &[u8]) -> usize {
    let total = batch_size + ;
    total + data.len()
}

fn main() {
    let _ = train(&[1, 2, 3]);
}
