// Generic functions and methods, with bounds inline and in where clauses, and lifetimes.
use std::fmt::Debug;

use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

#[find_executable_batch_size(starting = 32)]
fn first_fitting<T, F>(batch_size: usize, items: &[T], fits: F) -> anyhow::Result<Vec<T>>
where
    T: Clone + Debug,
    F: Fn(usize) -> bool + Clone,
{
    if !fits(batch_size) {
        return Err(OutOfMemory::new().into());
    }
    Ok(items.iter().take(batch_size).cloned().collect())
}

#[find_executable_batch_size(starting = 16)]
fn longest<'a, S: AsRef<str> + ?Sized>(batch_size: usize, text: &'a S) -> anyhow::Result<&'a str> {
    let text = text.as_ref();
    if batch_size > text.len() {
        return Err(OutOfMemory::new().into());
    }
    Ok(&text[..batch_size])
}

struct Model<const N: usize, B> {
    backend: B,
}

impl<const N: usize, B> Model<N, B>
where
    B: Fn(usize) -> bool,
{
    #[find_executable_batch_size(starting = N)]
    fn fit<I>(&self, batch_size: usize, input: I) -> anyhow::Result<(usize, I)>
    where
        I: Clone + Debug,
    {
        if !(self.backend)(batch_size) {
            anyhow::bail!(OutOfMemory::new());
        }
        Ok((batch_size, input))
    }
}

pub fn main() {
    let items = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    let picked = first_fitting(&items, |size| size <= 4).unwrap();
    assert_eq!(picked, [1, 2, 3, 4]);

    assert_eq!(longest("hello world").unwrap(), "hello wo");

    let model = Model::<100, _> {
        backend: |size: usize| size < 30,
    };
    assert_eq!(model.fit("input").unwrap(), (25, "input"));
}
