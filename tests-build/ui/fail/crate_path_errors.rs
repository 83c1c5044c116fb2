use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 8, crate = "not a path")]
fn text_not_a_path(batch_size: usize) -> usize {
    batch_size
}

mod empty {}

#[find_executable_batch_size(starting = 8, crate = empty)]
fn wrong_module(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = (text_not_a_path(), wrong_module());
}
