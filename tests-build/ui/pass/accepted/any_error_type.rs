// Any error type can be decorated: with none of `From<NoExecutableBatchSize>`,
// `From<io::Error>`, `From<String>` or `From<Box<dyn Error + Send + Sync>>`, the function
// returns the last out-of-memory error itself when no size fits (toma's rule), as
// `Result<T, wgpu::Error>` or cubecl's `IoError` functions need.
use batch_size_runtime::{find_executable_batch_size, last_report, OutOfMemory};

#[derive(Debug)]
enum DeviceError {
    OutOfMemory(OutOfMemory),
    Lost,
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceError::OutOfMemory(_) => f.write_str("Out of Memory"),
            DeviceError::Lost => f.write_str("device lost"),
        }
    }
}

impl std::error::Error for DeviceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DeviceError::OutOfMemory(inner) => Some(inner),
            DeviceError::Lost => None,
        }
    }
}

#[find_executable_batch_size(starting = 128)]
fn train(batch_size: usize, fits: usize) -> Result<usize, DeviceError> {
    if batch_size > fits {
        return Err(DeviceError::OutOfMemory(
            OutOfMemory::new().with_requested(batch_size as u64),
        ));
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn lost(_batch_size: usize) -> Result<(), DeviceError> {
    Err(DeviceError::Lost)
}

// A generic error type with the bounds to classify it, and no `From` conversion.
#[find_executable_batch_size(starting = 8)]
fn generic<E: std::error::Error + Send + Sync + 'static>(
    batch_size: usize,
    make: fn(usize) -> Option<E>,
) -> Result<usize, E> {
    match make(batch_size) {
        Some(error) => Err(error),
        None => Ok(batch_size),
    }
}

pub fn main() {
    assert_eq!(train(40).unwrap(), 32);

    // Nothing fits: the last out-of-memory error comes back, the sizes are in the report.
    let error = train(0).unwrap_err();
    assert!(matches!(&error, DeviceError::OutOfMemory(oom) if oom.requested == Some(1)));
    let tried: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(tried, [128, 64, 32, 16, 8, 4, 2, 1]);

    // Not out of memory: returned unchanged after one attempt.
    assert!(matches!(lost(), Err(DeviceError::Lost)));

    let oom_above_2 = |batch_size: usize| {
        (batch_size > 2).then(|| DeviceError::OutOfMemory(OutOfMemory::new()))
    };
    assert_eq!(generic::<DeviceError>(oom_above_2).unwrap(), 2);
}
