//! [`OutOfMemory`]: the error a device raises when an allocation does not fit, with the
//! figures it knows (this crate's own, which the simulated device returns and your code may).

use std::error::Error;
use std::fmt;

use super::Bytes;

/// A device ran out of memory: this crate's own out-of-memory error.
///
/// The [simulated device](crate::memory::SimulatedDevice) returns it, and your code can return it (or
/// wrap it) to make any failure count as out-of-memory. It is always recognised, through any
/// chain of `source()`s.
///
/// ```
/// use batch_size_runtime::OutOfMemory;
///
/// let error = OutOfMemory::new().with_requested(3 << 30).with_free(1 << 30).on_device("sim:0");
/// assert_eq!(
///     error.to_string(),
///     "out of device memory on sim:0: tried to allocate 3.00 GiB with 1.00 GiB free"
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes the failed allocation asked for, when known.
    pub requested: Option<u64>,
    /// Bytes free on the device when it failed, when known.
    pub free: Option<u64>,
    /// Total bytes of the device, when known.
    pub total: Option<u64>,
    /// The device, when known (`"cuda:0"`, `"sim:0"`).
    pub device: Option<String>,
}

impl OutOfMemory {
    /// An out-of-memory error with no figures.
    ///
    /// ```
    /// # use batch_size_runtime::OutOfMemory;
    /// assert_eq!(OutOfMemory::new().to_string(), "out of device memory");
    /// ```
    pub fn new() -> Self {
        OutOfMemory::default()
    }

    /// Records the bytes the failed allocation asked for.
    ///
    /// ```
    /// # use batch_size_runtime::OutOfMemory;
    /// let error = OutOfMemory::new().with_requested(2 << 20);
    /// assert_eq!(error.requested, Some(2 << 20));
    /// assert_eq!(error.to_string(), "out of device memory: tried to allocate 2.00 MiB");
    /// ```
    pub fn with_requested(mut self, bytes: u64) -> Self {
        self.requested = Some(bytes);
        self
    }

    /// Records the bytes that were free.
    ///
    /// ```
    /// # use batch_size_runtime::OutOfMemory;
    /// let error = OutOfMemory::new().with_free(512);
    /// assert_eq!(error.free, Some(512));
    /// assert_eq!(error.to_string(), "out of device memory: 512 bytes free");
    /// ```
    pub fn with_free(mut self, bytes: u64) -> Self {
        self.free = Some(bytes);
        self
    }

    /// Records the device's total bytes.
    ///
    /// ```
    /// # use batch_size_runtime::OutOfMemory;
    /// let error = OutOfMemory::new().with_free(1 << 30).with_total(80 << 30);
    /// assert_eq!(error.total, Some(80 << 30));
    /// assert_eq!(error.to_string(), "out of device memory: 1.00 GiB free of 80.00 GiB");
    /// ```
    pub fn with_total(mut self, bytes: u64) -> Self {
        self.total = Some(bytes);
        self
    }

    /// Names the device.
    ///
    /// ```
    /// # use batch_size_runtime::OutOfMemory;
    /// let error = OutOfMemory::new().on_device("cuda:1");
    /// assert_eq!(error.device.as_deref(), Some("cuda:1"));
    /// assert_eq!(error.to_string(), "out of device memory on cuda:1");
    /// ```
    pub fn on_device(mut self, device: impl Into<String>) -> Self {
        self.device = Some(device.into());
        self
    }
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Words the classification recognises as text too, where a wrapper hides this type
        // ("out of device memory" is burn's).
        if self.device.as_deref() == Some("cpu") {
            f.write_str("out of host memory")?;
        } else {
            f.write_str("out of device memory")?;
        }
        if let Some(device) = &self.device {
            write!(f, " on {device}")?;
        }
        let room = match (self.free, self.total) {
            (Some(free), Some(total)) => Some(format!("{} free of {}", Bytes(free), Bytes(total))),
            (Some(free), None) => Some(format!("{} free", Bytes(free))),
            (None, Some(total)) => Some(format!("{} total", Bytes(total))),
            (None, None) => None,
        };
        match (self.requested, room) {
            (Some(requested), Some(room)) => {
                write!(f, ": tried to allocate {} with {room}", Bytes(requested))
            }
            (Some(requested), None) => write!(f, ": tried to allocate {}", Bytes(requested)),
            (None, Some(room)) => write!(f, ": {room}"),
            (None, None) => Ok(()),
        }
    }
}

impl Error for OutOfMemory {}
