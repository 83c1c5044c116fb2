use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size]
fn bare(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(min = 4)]
fn with_min_only(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = (bare(), with_min_only());
}
