// `margin` is checked where it is written, and only tunes the guided default.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 8, margin = 1.5)]
fn too_large(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 8, factor = 0.9, margin = 0.1)]
fn with_factor(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = too_large();
    let _ = with_factor();
}
