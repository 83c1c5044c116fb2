use batch_size_runtime::find_executable_batch_size;

struct Dataset {
    rows: Vec<u8>,
}

#[find_executable_batch_size(starting = 128)]
fn train(batch_size: usize, epochs: u32, data: Dataset) -> usize {
    batch_size + data.rows.len() + epochs as usize
}

fn main() {
    let _ = train(1, Dataset { rows: Vec::new() });
}
