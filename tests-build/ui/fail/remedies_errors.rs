// A `Remedied` parameter needs `remedies`, and `remedies` needs a `Remedied` parameter.
use batch_size_runtime::{find_executable_batch_size, remedies::Remedied};

#[find_executable_batch_size(starting = 32)]
fn remedied_without_remedies(attempt: Remedied<u32>) -> usize {
    attempt.batch_size()
}

#[find_executable_batch_size(starting = 32, remedies = batch_size_runtime::remedies::Remedies::new(4096u32))]
fn remedies_with_an_integer(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 32, remedies = 4096u32)]
fn remedies_that_are_not_remedies(attempt: Remedied<u32>) -> usize {
    attempt.batch_size()
}

fn main() {
    let _ = remedied_without_remedies();
    let _ = remedies_with_an_integer();
    let _ = remedies_that_are_not_remedies();
}
