// A parameter the body never uses still gets rustc's warning, at the parameter; one used only by
// the attribute's arguments does not.
#![deny(unused_variables)]

use batch_size_runtime::find_executable_batch_size;

struct Config {
    batch_size: usize,
}

#[find_executable_batch_size(starting = cfg.batch_size)]
fn train(batch_size: usize, cfg: &Config, epochs: usize) -> usize {
    batch_size
}

fn main() {
    let _ = train(&Config { batch_size: 8 }, 3);
}
