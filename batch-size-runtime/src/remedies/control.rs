//! The ladder of one settings type behind [`LadderControl`], the face the search's policy,
//! the engine and the cache see.

use std::sync::{Mutex, PoisonError};

use super::ladder::Ladder;
use crate::policy::{Applied, LadderControl};
use crate::record::Attempt;

impl<S: Clone + Send> LadderControl for Mutex<Ladder<S>> {
    fn check(&self) -> Result<(), String> {
        self.lock().unwrap_or_else(PoisonError::into_inner).check()
    }
    fn advance(&self, failure: Option<&Attempt>) -> Option<Vec<Applied>> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .advance(failure)
    }
    fn describe(&self) -> Option<String> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .describe()
    }
    fn applied(&self) -> Vec<Applied> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .applied()
            .to_vec()
    }
    fn is_empty(&self) -> bool {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .levels()
            .is_empty()
    }
    fn levels(&self) -> Vec<Option<usize>> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .levels()
            .to_vec()
    }
    fn names(&self) -> String {
        let ladder = self.lock().unwrap_or_else(PoisonError::into_inner);
        ladder.names().collect::<Vec<_>>().join(", ")
    }
    fn restore(&self, levels: &[Option<usize>]) -> bool {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .restore(levels)
    }
}
