// Arguments of the wrong type are reported under the argument.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 1.5)]
fn float_starting(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 8, min = "4")]
fn text_min(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 8, factor = "0.5")]
fn text_factor(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 8, release = 5)]
fn number_release(batch_size: usize) -> usize {
    batch_size
}

#[find_executable_batch_size(starting = 8, reduce = |failed| failed.batch_size as f64 / 2.0)]
fn float_reduce(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = (
        float_starting(),
        text_min(),
        text_factor(),
        number_release(),
        float_reduce(),
    );
}
