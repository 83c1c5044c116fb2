use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 0)]
fn start_zero(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 128, min = 0)]
fn min_zero(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = -8)]
fn negative(batch_size: i32) -> i32 {
    batch_size
}

fn main() {
    let _ = (start_zero(), min_zero(), negative());
}
