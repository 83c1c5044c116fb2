// Everything wrong is reported at once, and callers still see the rewritten signature.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 8, maximum = 2)]
const fn train(batch_size: f32, data: &[u8]) -> usize {
    data.len() + batch_size as usize
}

fn main() {
    let _ = train(&[1, 2]);
}
