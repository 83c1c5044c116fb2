use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 128, factor = 1.5)]
fn above_one(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 128, factor = 0.0)]
fn zero(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 128, factor = -0.5)]
fn negative(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = (above_one(), zero(), negative());
}
