use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 128)]
struct Trainer {
    batch_size: usize,
}

fn main() {
    let _ = Trainer { batch_size: 1 };
}
