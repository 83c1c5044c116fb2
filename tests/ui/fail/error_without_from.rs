use batch_size_runtime::find_executable_batch_size;

#[derive(Debug)]
struct MyError;

impl std::fmt::Display for MyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("my error")
    }
}

impl std::error::Error for MyError {}

#[find_executable_batch_size(starting = 128)]
fn train(batch_size: usize) -> Result<usize, MyError> {
    Ok(batch_size)
}

fn main() {
    let _ = train();
}
