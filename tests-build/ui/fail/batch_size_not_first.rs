// The batch size written after another parameter: one error, saying to move it first, and
// none at the caller (which already omits the batch size).
use batch_size_runtime::find_executable_batch_size;

struct Data;

#[find_executable_batch_size(starting = 64)]
fn train(data: &Data, batch_size: usize) -> anyhow::Result<usize> {
    let _ = data;
    Ok(batch_size)
}

fn main() {
    let _ = train(&Data);
}
