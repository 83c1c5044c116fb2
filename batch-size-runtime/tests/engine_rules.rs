//! The rules the engine holds every policy to, whatever it proposes: a size the batch-size
//! parameter's type cannot hold runs as the largest it can that has not failed (and the
//! report records what ran); `min` itself is tried before the search gives up below it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::policy::Halve;
use batch_size_runtime::{
    find_executable_batch_size, last_report, BatchSizeSearch, Decision, OutOfMemory, SearchReport,
    SizePolicy,
};

/// A policy that proposes a fixed list of sizes, whatever happened.
#[derive(Debug)]
struct Proposes(Vec<usize>);

impl SizePolicy for Proposes {
    fn first(&mut self, _starting: usize) -> Decision {
        Decision::Try(self.0.remove(0))
    }
    fn after(&mut self, history: &SearchReport) -> Decision {
        match history.last() {
            Some(last) if last.outcome.is_success() => Decision::Accept,
            _ if self.0.is_empty() => Decision::Accept,
            _ => Decision::Try(self.0.remove(0)),
        }
    }
}

#[find_executable_batch_size(starting = 200u8, policy = Proposes(vec![1000, 500, 250, 120]))]
fn narrow(batch_size: u8, ran: &mut Vec<u8>) -> anyhow::Result<u8> {
    ran.push(batch_size);
    if batch_size > 130 {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[test]
fn a_proposal_larger_than_the_type_runs_as_the_largest_size_that_has_not_failed() {
    let mut ran = Vec::new();
    assert_eq!(narrow(&mut ran).unwrap(), 120);
    // 1000 runs as 255; 500 as 254 (255 failed and never runs again); then 250 and 120.
    assert_eq!(ran, [255, 254, 250, 120]);
    let recorded: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(
        recorded,
        [255, 254, 250, 120],
        "the report records what ran"
    );
}

#[test]
fn min_is_tried_before_the_search_gives_up_below_it() {
    let fitted: anyhow::Result<usize> =
        BatchSizeSearch::new(8)
            .with_policy(Halve)
            .with_min(5)
            .run(|size| {
                if size > 6 {
                    return Err(OutOfMemory::new().into());
                }
                Ok(size)
            });
    // Halving steps from 8 to 4, below `min`: 5 runs instead, and fits.
    assert_eq!(fitted.unwrap(), 5);
    let tried: Vec<usize> = last_report()
        .unwrap()
        .attempts()
        .map(|attempt| attempt.batch_size)
        .collect();
    assert_eq!(tried, [8, 5]);

    // When `min` itself fails, the search stops there.
    let none: anyhow::Result<usize> = BatchSizeSearch::new(8)
        .with_policy(Halve)
        .with_min(5)
        .run(|_| Err(OutOfMemory::new().into()));
    let error = none.unwrap_err();
    let none_fit = error
        .downcast_ref::<batch_size_runtime::NoExecutableBatchSize>()
        .unwrap();
    assert_eq!(none_fit.tried(), &[8, 5]);
}
