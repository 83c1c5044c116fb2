// An error type that is neither `Error` nor `Display` could hide an out-of-memory error: a
// compile error at the return type, also behind an alias.
use batch_size_runtime::find_executable_batch_size;

#[derive(Debug)]
struct MyError;

type Fallible<T> = Result<T, MyError>;

#[find_executable_batch_size(starting = 128)]
fn train(batch_size: usize) -> Fallible<usize> {
    Ok(batch_size)
}

fn main() {
    let _ = train();
}
