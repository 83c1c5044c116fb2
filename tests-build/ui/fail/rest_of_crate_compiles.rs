// After an argument error, callers (which omit the batch size) and the body still compile:
// the only error is the attribute's, and there is no "takes 1 argument but 2 were supplied",
// no "unused variable" and no error from the body.
use batch_size_runtime::find_executable_batch_size;

#[find_executable_batch_size(startng = 128)]
fn train(batch_size: usize, data: &[u8], mut log: Vec<usize>) -> Result<usize, std::io::Error> {
    log.push(batch_size);
    let _first = data.first().copied();
    Ok(batch_size + log.len())
}

struct Trainer;

impl Trainer {
    #[find_executable_batch_size(factor = 0.5)]
    fn fit(&self, batch_size: u32) -> u32 {
        batch_size
    }
}

fn caller() -> std::io::Result<usize> {
    let size = train(&[1, 2, 3], Vec::new())?;
    Ok(size + Trainer.fit() as usize)
}

fn main() {
    let _ = caller();
}
