// `AttemptError` is sealed: a type that is not an error a runner takes cannot be given it by
// hand, and the message says the trait is sealed and what to implement instead.
use batch_size_runtime::{AttemptError, NoExecutableBatchSize};

struct Mine;

impl std::fmt::Display for Mine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mine")
    }
}

enum MyMarker {}

impl AttemptError<MyMarker> for Mine {
    fn no_size_fits(_: NoExecutableBatchSize) -> Self {
        Mine
    }
}

fn main() {}
