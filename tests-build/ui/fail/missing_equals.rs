use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting 128)]
fn train(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 128 min = 4)]
fn no_comma(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 128, crate)]
fn bare_crate(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = (train(), no_comma(), bare_crate());
}
