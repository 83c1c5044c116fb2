use batch_size_runtime::find_executable_batch_size;

struct Trainer;

impl Trainer {
    #[find_executable_batch_size(starting = 128)]
    fn train(&self) -> usize {
        0
    }
}

fn main() {
    let _ = Trainer.train();
}
