//! Deadlines for the Id exchange: one for the whole exchange, one for each try of a rank and
//! each connection rank 0 serves, and a stream whose every read and write ends by one.
//!
//! A time limit per read does not bound a connection: a peer that sends one byte just before
//! each read's limit keeps it open as long as it likes. [`Bounded`] sets the socket's timeout
//! from the time left before every read and write, so a connection ends by its deadline
//! whatever the peer sends or how slowly.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// An instant after which an exchange, a try or a connection gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Deadline(Instant);

impl Deadline {
    /// `limit` from now. A limit too large for the clock (`Duration::MAX`) is as good as none:
    /// a century, rather than a panic on overflow.
    pub(crate) fn after(limit: Duration) -> Self {
        const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
        let now = Instant::now();
        Deadline(
            now.checked_add(limit)
                .or_else(|| now.checked_add(CENTURY))
                .unwrap_or(now),
        )
    }

    /// The earlier of the two: a try ends with its exchange.
    pub(crate) fn min(self, other: Deadline) -> Self {
        Deadline(self.0.min(other.0))
    }

    /// The time left, zero once passed.
    pub(crate) fn left(&self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Whether it has passed.
    pub(crate) fn passed(&self) -> bool {
        self.left().is_zero()
    }

    /// The error of an operation begun after the deadline.
    fn passed_error() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "the deadline passed")
    }
}

/// A stream whose reads and writes all end by one [`Deadline`]: each sets the socket's timeout
/// to the time left, so the limit holds for the whole connection, not for each read.
pub(crate) struct Bounded<'a> {
    stream: &'a TcpStream,
    deadline: Deadline,
}

impl<'a> Bounded<'a> {
    pub(crate) fn new(stream: &'a TcpStream, deadline: Deadline) -> Self {
        Bounded { stream, deadline }
    }

    /// The socket itself, for what needs no deadline (a shutdown).
    pub(crate) fn stream(&self) -> &TcpStream {
        self.stream
    }

    /// The time left, as a socket timeout; an error once the deadline has passed (a zero
    /// timeout would mean "wait forever" to the socket).
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.left();
        if left.is_zero() {
            return Err(Deadline::passed_error());
        }
        Ok(left)
    }
}

impl Read for Bounded<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.read(buffer)
    }
}

impl Write for Bounded<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.write(bytes)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether an error is a socket's timeout (Linux says `WouldBlock`, others `TimedOut`).
pub(crate) fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::net::TcpListener;
    use std::thread;

    #[test]
    fn a_huge_limit_is_no_panic() {
        assert!(!Deadline::after(Duration::MAX).passed());
        assert!(Deadline::after(Duration::ZERO).passed());
    }

    #[test]
    fn a_trickle_does_not_stretch_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let trickler = thread::spawn(move || {
            let mut stream = TcpStream::connect(address).unwrap();
            // One byte every 100 ms: under any per-read limit of 300 ms.
            for _ in 0..20 {
                if stream.write_all(b"x").is_err() {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
        });
        let (stream, _) = listener.accept().unwrap();
        let started = Instant::now();
        let mut bounded = Bounded::new(&stream, Deadline::after(Duration::from_millis(300)));
        let error = bounded.read_exact(&mut [0u8; 64]).unwrap_err();
        let took = started.elapsed();
        assert!(is_timeout(&error), "{error}");
        assert!(took < Duration::from_millis(300 + 30 + 100), "{took:?}");
        drop(stream);
        trickler.join().unwrap();
    }
}
