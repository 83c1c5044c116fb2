use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 128, minimum = 4)]
fn train(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = train();
}
