// `cache_dir` alone would cache nothing: a compile error that says what to add.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 64, cache_dir = "/tmp/sizes")]
fn train(batch_size: usize) -> anyhow::Result<usize> {
    Ok(batch_size)
}

fn main() {
    let _ = train();
}
