//! A stand-in for candle's `Error::Cuda`, which holds its `CudaError::Cuda(DriverError)`:
//! formatting it formats cudarc's error, which calls into libcuda and panics where libcuda is
//! absent (as in these tests), and it hides the `DriverError` from `source()`.

use std::error::Error;
use std::fmt;

use cudarc::driver::DriverError;

#[derive(Debug)]
pub struct CandleCudaError(pub DriverError);

impl fmt::Display for CandleCudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Error for CandleCudaError {}
