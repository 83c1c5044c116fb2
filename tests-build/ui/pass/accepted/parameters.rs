// Parameters after the batch size: shared references are copied, mutable ones reborrowed and
// owned `Clone` values cloned for every attempt; `mut`, `_` and destructuring patterns work.
use std::rc::Rc;

use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

#[derive(Clone, Debug, PartialEq)]
struct Config {
    limit: usize,
    name: String,
}

struct NotClone(Vec<usize>);

#[find_executable_batch_size(starting = 32)]
fn all_kinds(
    batch_size: usize,
    shared: &NotClone,
    log: &mut Vec<usize>,
    mut owned: Vec<usize>,
    config: Config,
    counter: Rc<()>,
) -> anyhow::Result<(usize, Vec<usize>, String)> {
    log.push(batch_size);
    // Each attempt gets a fresh copy of `owned`: pushing does not leak into the next attempt.
    owned.push(batch_size);
    assert_eq!(owned.len(), shared.0.len() + 1);
    assert!(Rc::strong_count(&counter) >= 2);
    if batch_size > config.limit {
        return Err(OutOfMemory::new().into());
    }
    Ok((batch_size, owned, config.name))
}

#[find_executable_batch_size(starting = 8)]
fn destructured(
    batch_size: usize,
    (limit, label): (usize, &str),
    Config { name, .. }: Config,
    &offset: &usize,
    _: String,
    [first, ..]: [u8; 2],
) -> anyhow::Result<String> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(format!("{label}/{name}/{}/{first}", batch_size + offset))
}

#[find_executable_batch_size(starting = 8)]
fn mutable_reference(batch_size: usize, mut total: &mut usize, limit: usize) -> anyhow::Result<()> {
    *total += batch_size;
    total = &mut *total;
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    let _ = total;
    Ok(())
}

pub fn main() {
    let shared = NotClone(vec![1, 2]);
    let mut log = Vec::new();
    let config = Config {
        limit: 10,
        name: "cfg".to_owned(),
    };
    let counter = Rc::new(());
    let (size, owned, name) = all_kinds(
        &shared,
        &mut log,
        vec![1, 2],
        config.clone(),
        counter.clone(),
    )
    .unwrap();
    assert_eq!(size, 8);
    assert_eq!(owned, [1, 2, 8]);
    assert_eq!(name, "cfg");
    assert_eq!(log, [32, 16, 8]);
    // Every clone given to an attempt was dropped.
    assert_eq!(Rc::strong_count(&counter), 1);

    let text = destructured((3, "run"), config, &100, String::new(), [7, 9]).unwrap();
    assert_eq!(text, "run/cfg/102/7");

    let mut total = 0;
    mutable_reference(&mut total, 2).unwrap();
    assert_eq!(total, 8 + 4 + 2);
}
