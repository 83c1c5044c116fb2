// A one-line body draws no lint the user did not cause (`unused_braces` at the function's own
// braces once did, and `cargo fix` then broke the code).
#![deny(warnings)]

use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 8)]
fn train(batch_size: usize) -> anyhow::Result<usize> { Ok(batch_size) }

#[find_executable_batch_size(starting = 8)]
async fn train_async(batch_size: usize) -> anyhow::Result<usize> { Ok(batch_size) }

pub fn main() {
    assert_eq!(train().unwrap(), 8);
    let _ = train_async();
}
