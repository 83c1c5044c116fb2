//! What a step could not get under the room the crate limits its child to
//! (`ChildTrial::with_memory_limit`): past the limit the kernel refuses any mapping, so a
//! thread's stack (`pthread_create` answers EAGAIN) or a `mmap` (ENOMEM) fails where a larger
//! batch left no room, and the step reports it as its own error or panic. Under the crate's
//! limit, and only there, those refusals are running out of memory: the parent retries
//! smaller. Anything else the step returns stays its own.

use std::any::Any;
use std::error::Error;
use std::io;

/// `EAGAIN`: `pthread_create` could not map a stack (Linux; the limit is set only there).
const EAGAIN: i32 = 11;
/// `ENOMEM`: a mapping refused.
const ENOMEM: i32 = 12;

/// Whether a step's error is a resource its limit refused: by type where the error is one
/// this module can view as an error chain, else by the one text std's thread spawn leaves.
pub(crate) fn error_refused<E: Any>(error: &E, text: &str) -> bool {
    as_chain(error).is_some_and(chain_refused) || says_a_thread_could_not_start(text)
}

/// Whether a step's panic is a resource its limit refused: `std::thread::spawn` panics with
/// the `io::Error` as text; a panic carrying an error is read by type.
pub(crate) fn panic_refused(payload: &(dyn Any + Send), text: &str) -> bool {
    let typed = payload
        .downcast_ref::<io::Error>()
        .map(|error| error as &(dyn Error + 'static))
        .or_else(|| {
            payload
                .downcast_ref::<Box<dyn Error + Send + Sync>>()
                .map(|error| &**error as &(dyn Error + 'static))
        });
    typed.is_some_and(chain_refused) || says_a_thread_could_not_start(text)
}

/// The error types whose chain can be read without a bound on the step's error type.
fn as_chain<E: Any>(error: &E) -> Option<&(dyn Error + 'static)> {
    let any: &dyn Any = error;
    if let Some(error) = any.downcast_ref::<io::Error>() {
        return Some(error);
    }
    if let Some(error) = any.downcast_ref::<Box<dyn Error + Send + Sync>>() {
        return Some(&**error);
    }
    if let Some(error) = any.downcast_ref::<Box<dyn Error + Send>>() {
        return Some(&**error);
    }
    if let Some(error) = any.downcast_ref::<Box<dyn Error>>() {
        return Some(&**error);
    }
    #[cfg(feature = "anyhow")]
    if let Some(error) = any.downcast_ref::<anyhow::Error>() {
        let error: &(dyn Error + Send + Sync + 'static) = error.as_ref();
        return Some(error);
    }
    None
}

/// An `io::Error` in the chain that says a mapping or a thread was refused: EAGAIN or ENOMEM
/// from the system, or `ErrorKind::OutOfMemory`.
fn chain_refused(error: &(dyn Error + 'static)) -> bool {
    crate::oom::chain_of(error)
        .filter_map(|layer| layer.downcast_ref::<io::Error>())
        .any(|error| {
            matches!(error.raw_os_error(), Some(EAGAIN | ENOMEM))
                || error.kind() == io::ErrorKind::OutOfMemory
        })
}

/// The words `std::thread::spawn` panics with where it could not start a thread (its
/// `expect`), which a step that formats its errors often keeps: the one text match here.
fn says_a_thread_could_not_start(text: &str) -> bool {
    text.contains("failed to spawn thread")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_the_limits_refusals_count() {
        let eagain = io::Error::from_raw_os_error(EAGAIN);
        assert!(error_refused(&eagain, &eagain.to_string()));
        let boxed: Box<dyn Error + Send + Sync> = Box::new(io::Error::from_raw_os_error(ENOMEM));
        assert!(error_refused(&boxed, &boxed.to_string()));
        let kind = io::Error::from(io::ErrorKind::OutOfMemory);
        assert!(error_refused(&kind, &kind.to_string()));
        let own = io::Error::other("corrupt record 17");
        assert!(!error_refused(&own, &own.to_string()));
        let text = "failed to spawn thread: Resource temporarily unavailable".to_owned();
        assert!(error_refused(&text, &text));
        let other = "no data".to_owned();
        assert!(!error_refused(&other, &other));
        let payload: Box<dyn Any + Send> = Box::new(format!(
            "failed to spawn thread: {:?}",
            io::Error::from_raw_os_error(EAGAIN)
        ));
        assert!(panic_refused(
            &*payload,
            payload.downcast_ref::<String>().unwrap()
        ));
    }
}
