//! Records the WARN events of the code under test, for the tests that count or read them
//! (`tracing-subscriber` is not a dependency): each as the module it came from and its message
//! and fields on one line.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// The WARNs seen while it was the subscriber (`tracing::subscriber::with_default`).
#[derive(Clone, Default)]
pub struct Warnings(Arc<Mutex<Vec<(String, String)>>>);

impl Warnings {
    /// Every WARN, as its message and fields.
    #[allow(dead_code)] // not every test binary that includes this reads them all
    pub fn all(&self) -> Vec<String> {
        let seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        seen.iter().map(|(_, line)| line.clone()).collect()
    }

    /// How many WARNs came from a module whose path ends with `suffix` (`"::cache"`).
    #[allow(dead_code)] // not every test binary that includes this counts by module
    pub fn count_from_module(&self, suffix: &str) -> usize {
        let seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        seen.iter()
            .filter(|(module, _)| module.ends_with(suffix))
            .count()
    }
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let metadata = event.metadata();
        if *metadata.level() == Level::WARN {
            let mut line = Line(String::new());
            event.record(&mut line);
            let module = metadata.module_path().unwrap_or_default().to_owned();
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((module, line.0));
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
