//! The success path under a profiler: `valgrind --tool=callgrind target/release/examples/overhead_probe`
//! after `cargo build --release -p batch-size-tests --example overhead_probe` counts the
//! instructions of 100,000 calls through the attribute whose first size fits.

use batch_size_runtime::find_executable_batch_size;
#[inline(never)]
fn body(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    Ok(batch_size + input.len())
}
#[find_executable_batch_size(starting = 64, release = batch_size_runtime::Release::none())]
fn attribute_release_none(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    body(batch_size, input)
}
#[find_executable_batch_size(starting = 64)]
fn attribute_default_release(batch_size: usize, input: &[u32]) -> anyhow::Result<usize> {
    body(batch_size, input)
}
/// `overhead_probe default` calls the attribute with the default release (CUDA's, which finds
/// no libcuda here); without an argument, with `Release::none()`.
fn main() {
    let input = vec![1u32; 4];
    let default_release = std::env::args().nth(1).as_deref() == Some("default");
    let mut total = 0usize;
    for _ in 0..100_000 {
        let result = if default_release {
            attribute_default_release(std::hint::black_box(&input))
        } else {
            attribute_release_none(std::hint::black_box(&input))
        };
        total = total.wrapping_add(result.unwrap_or(0));
    }
    println!("{total}");
}
