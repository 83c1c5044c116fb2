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
fn main() {
    let input = vec![1u32; 4];
    let mut total = 0usize;
    for _ in 0..100_000 {
        total =
            total.wrapping_add(attribute_release_none(std::hint::black_box(&input)).unwrap_or(0));
    }
    println!("{total}");
}
