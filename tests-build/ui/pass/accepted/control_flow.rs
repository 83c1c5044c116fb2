// `?` and `return` in the body leave the attempt with the function's return type; a
// non-out-of-memory error is returned at once, unchanged.
use std::num::ParseIntError;

use batch_size_runtime::{find_executable_batch_size, last_report, OutOfMemory, Outcome};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Parse(#[from] ParseIntError),
    #[error(transparent)]
    Oom(#[from] OutOfMemory),
    #[error(transparent)]
    NoBatchSize(#[from] batch_size_runtime::NoExecutableBatchSize),
}

fn allocate(batch_size: usize, limit: usize) -> Result<Vec<u8>, OutOfMemory> {
    if batch_size > limit {
        return Err(OutOfMemory::new());
    }
    Ok(vec![0; batch_size])
}

#[find_executable_batch_size(starting = 16)]
fn parse_then_train(batch_size: usize, text: &str, limit: usize) -> Result<usize, Error> {
    let extra: usize = text.parse()?;
    let buffer = allocate(batch_size, limit)?;
    if buffer.len() == 2 {
        return Ok(200 + extra);
    }
    for round in 0.. {
        if round == 3 {
            break;
        }
    }
    let closure = |value: usize| -> Result<usize, Error> { Ok(value) };
    let value = closure(buffer.len())?;
    Ok(value + extra)
}

#[find_executable_batch_size(starting = 16)]
fn early_plain(batch_size: usize) -> usize {
    if batch_size > 4 {
        return batch_size * 10;
    }
    batch_size
}

#[find_executable_batch_size(starting = 16)]
fn labelled(batch_size: usize) -> Option<usize> {
    let found = 'outer: {
        for candidate in 0..batch_size {
            if candidate == 3 {
                break 'outer Some(candidate);
            }
        }
        None
    };
    let _double = found? * 2;
    found
}

pub fn main() {
    assert_eq!(parse_then_train("1", 10).unwrap(), 9);
    assert_eq!(parse_then_train("1", 2).unwrap(), 201);
    assert!(matches!(parse_then_train("x", 10), Err(Error::Parse(_))));
    let report = last_report().unwrap();
    assert_eq!(report.len(), 1);
    assert!(matches!(
        report.attempts().next().unwrap().outcome,
        Outcome::Failed { .. }
    ));
    assert!(matches!(
        parse_then_train("1", 0),
        Err(Error::NoBatchSize(_))
    ));

    assert_eq!(early_plain(), 160);
    assert_eq!(labelled(), Some(3));
}
