use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(starting = 128)]
fn float(batch_size: f32) -> f32 {
    batch_size
}

#[find_executable_batch_size(starting = 128)]
fn reference(batch_size: &usize) -> usize {
    *batch_size
}

#[find_executable_batch_size(starting = 128)]
fn string(batch_size: String) -> String {
    batch_size
}

fn main() {
    let _ = (float(), reference(), string());
}
