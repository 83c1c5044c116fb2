//! How one chunk's call ended: the closure's own error, classified as every runner classifies
//! it, or a wrong number of outputs; and where a chunk's outputs go.

use std::ops::Range;

use crate::attempt::InspectError;
use crate::engine::dispatch::{Classify, Judged, Kept, OomRules};
use crate::error::KeptError;

/// How one chunk's call ended, when it did not succeed.
#[derive(Debug)]
pub(super) enum ChunkAttempt<E> {
    /// The closure's own error.
    Work(E),
    /// `run`'s closure returned a number of outputs that is not its number of items.
    WrongOutputCount { range: Range<usize>, got: usize },
}

/// Appends a chunk's outputs where its items are (a chunk taken back is redone), or says
/// their number is wrong.
pub(super) fn keep_outputs<T, E>(
    outputs: &mut Vec<T>,
    range: Range<usize>,
    values: Vec<T>,
) -> Result<(), ChunkAttempt<E>> {
    if values.len() != range.len() {
        return Err(ChunkAttempt::WrongOutputCount {
            range,
            got: values.len(),
        });
    }
    outputs.truncate(range.start);
    outputs.extend(values);
    Ok(())
}

/// Classifies a chunk's call as every runner does; a wrong number of outputs fails the run.
pub(super) struct ChunkKind<E, M>(Kept<E, M>);

impl<E, M> ChunkKind<E, M> {
    pub(super) fn new() -> Self {
        ChunkKind(Kept::new())
    }
}

impl<E: InspectError<M>, M> Classify<Result<(), ChunkAttempt<E>>> for ChunkKind<E, M> {
    type Error = E;
    fn judge(
        &self,
        value: Result<(), ChunkAttempt<E>>,
        rules: &OomRules<'_>,
    ) -> Judged<Result<(), ChunkAttempt<E>>, E> {
        match value {
            Ok(()) => Judged::Succeeded(Ok(())),
            Err(ChunkAttempt::Work(error)) => match self.0.judge(Err::<(), E>(error), rules) {
                Judged::Succeeded(_) => Judged::Succeeded(Ok(())),
                // A chunk never grows by `step_done` (its runner learns from its chunks).
                Judged::Failed(value, description) | Judged::Grew(value, description) => {
                    Judged::Failed(value.map_err(ChunkAttempt::Work), description)
                }
                Judged::OutOfMemory(found, error) => Judged::OutOfMemory(found, error),
            },
            Err(wrong @ ChunkAttempt::WrongOutputCount { .. }) => {
                Judged::Failed(Err(wrong), "wrong number of outputs".to_owned())
            }
        }
    }
    fn keep(&self, error: E) -> Option<KeptError> {
        Some(error.into_kept())
    }
}
