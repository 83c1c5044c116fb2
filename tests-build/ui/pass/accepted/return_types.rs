// Every kind of return type: `anyhow::Result`, boxed errors, a thiserror enum holding
// `NoExecutableBatchSize`, `std::io::Result`, a `Result` alias, `()`, a plain value and
// `impl Trait`. When no size fits, `Result`s return the error and the others panic.
use std::error::Error;

use batch_size_runtime::{find_executable_batch_size, NoExecutableBatchSize, OutOfMemory};

#[derive(Debug, thiserror::Error)]
enum TrainError {
    #[error(transparent)]
    Oom(#[from] OutOfMemory),
    #[error("bad data at row {0}")]
    BadData(usize),
    #[error(transparent)]
    NoBatchSize(#[from] NoExecutableBatchSize),
}

#[find_executable_batch_size(starting = 8)]
fn with_anyhow(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn with_box(batch_size: usize, limit: usize) -> Result<usize, Box<dyn Error + Send + Sync>> {
    if batch_size > limit {
        return Err(Box::new(OutOfMemory::new()));
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn with_thiserror(batch_size: usize, limit: usize, bad: bool) -> Result<usize, TrainError> {
    if bad {
        return Err(TrainError::BadData(batch_size));
    }
    if batch_size > limit {
        Err(OutOfMemory::new())?;
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn with_io(batch_size: usize, limit: usize) -> std::io::Result<usize> {
    if batch_size > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            OutOfMemory::new(),
        ));
    }
    Ok(batch_size)
}

type Fallible<T> = Result<T, TrainError>;

#[find_executable_batch_size(starting = 8)]
fn with_alias(batch_size: usize, limit: usize) -> Fallible<usize> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn with_unit(batch_size: usize, sizes: &mut Vec<usize>) {
    sizes.push(batch_size);
    if batch_size > 2 {
        panic!("CUDA error: out of memory");
    }
}

#[find_executable_batch_size(starting = 8)]
fn with_value(batch_size: usize) -> String {
    if batch_size > 4 {
        panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
    }
    batch_size.to_string()
}

#[find_executable_batch_size(starting = 8)]
fn with_impl_trait(batch_size: usize) -> impl Iterator<Item = usize> {
    0..batch_size
}

/// An error known only by its text (no `Error` impl), as some frameworks' are.
#[derive(Debug, PartialEq)]
struct TextError(String);

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<NoExecutableBatchSize> for TextError {
    fn from(error: NoExecutableBatchSize) -> Self {
        TextError(error.to_string())
    }
}

#[find_executable_batch_size(starting = 8)]
fn with_text_error(batch_size: usize, limit: usize) -> Result<usize, TextError> {
    if batch_size > limit {
        return Err(TextError("CUDA_ERROR_OUT_OF_MEMORY".to_owned()));
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn with_local_box(batch_size: usize, limit: usize) -> Result<usize, Box<dyn Error>> {
    if batch_size > limit {
        return Err(Box::new(OutOfMemory::new()));
    }
    Ok(batch_size)
}

pub fn main() {
    batch_size_runtime::oom::set_quiet_oom_panics(true);

    assert_eq!(with_anyhow(3).unwrap(), 2);
    let error = with_anyhow(0).unwrap_err();
    assert!(error.downcast_ref::<NoExecutableBatchSize>().is_some());

    assert_eq!(with_box(3).unwrap(), 2);
    let error = with_box(0).unwrap_err();
    assert!(error.downcast_ref::<NoExecutableBatchSize>().is_some());

    assert_eq!(with_thiserror(3, false).unwrap(), 2);
    assert!(matches!(
        with_thiserror(3, true),
        Err(TrainError::BadData(8))
    ));
    assert!(matches!(
        with_thiserror(0, false),
        Err(TrainError::NoBatchSize(_))
    ));

    assert_eq!(with_io(3).unwrap(), 2);
    assert!(with_io(0).is_err());

    assert_eq!(with_alias(3).unwrap(), 2);
    assert!(matches!(with_alias(0), Err(TrainError::NoBatchSize(_))));

    let mut sizes = Vec::new();
    with_unit(&mut sizes);
    assert_eq!(sizes, [8, 4, 2]);

    assert_eq!(with_value(), "4");
    assert_eq!(with_impl_trait().count(), 8);
    assert_eq!(with_text_error(3), Ok(2));
    let error = with_text_error(0).unwrap_err();
    assert!(
        error.0.starts_with("No executable batch size found"),
        "{}",
        error.0
    );
    assert_eq!(with_local_box(3).unwrap(), 2);
    let error = with_local_box(0).unwrap_err();
    assert!(error.downcast_ref::<NoExecutableBatchSize>().is_some());

    // No size fits a function that cannot return the error: it panics with it (kept from
    // the default hook, which would print it).
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let panic = std::panic::catch_unwind(|| {
        let mut sizes = Vec::new();
        #[find_executable_batch_size(starting = 2)]
        fn always(batch_size: usize, sizes: &mut Vec<usize>) {
            sizes.push(batch_size);
            panic!("CUDA out of memory");
        }
        always(&mut sizes)
    })
    .unwrap_err();
    std::panic::set_hook(hook);
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(
        message.starts_with("No executable batch size found"),
        "{message}"
    );
}
