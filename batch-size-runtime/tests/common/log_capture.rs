//! Every event of the code under test, at any level, kept per thread: one global subscriber,
//! installed before the first event of the test binary, so that no callsite's interest is ever
//! computed without it (a subscriber scoped to one test, with other tests running beside it,
//! can lose events to tracing's process-wide interest cache). A test reads what its own thread
//! logged.

use std::cell::RefCell;
use std::fmt::Write as _;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

thread_local! {
    static LINES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

struct PerThread;

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl Subscriber for PerThread {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut line = Line(format!("{}", event.metadata().level()));
        event.record(&mut line);
        LINES.with(|lines| lines.borrow_mut().push(line.0));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Runs `run` and returns what it logged on this thread, each event as its level, then its
/// fields (`message=...` among them). Call it first thing in every test of a binary that
/// reads logs.
pub fn capture<T>(run: impl FnOnce() -> T) -> (T, Vec<String>) {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // Only this file sets a global subscriber in a test binary that includes it.
        let _ = tracing::subscriber::set_global_default(PerThread);
    });
    LINES.with(|lines| lines.borrow_mut().clear());
    let value = run();
    (
        value,
        LINES.with(|lines| std::mem::take(&mut *lines.borrow_mut())),
    )
}
