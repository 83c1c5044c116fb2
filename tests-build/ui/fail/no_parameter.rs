use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 128)]
fn train() -> usize {
    0
}

fn main() {
    let _ = train();
}
