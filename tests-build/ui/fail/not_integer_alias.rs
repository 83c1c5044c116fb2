// A type the macro cannot see through is checked by a trait bound, at the type.
use batch_size_runtime::find_executable_batch_size;

type Size = f64;

#[find_executable_batch_size(starting = 128)]
fn aliased(batch_size: Size) -> f64 {
    batch_size
}

fn main() {
    let _ = aliased();
}
