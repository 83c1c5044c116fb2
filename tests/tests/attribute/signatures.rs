//! Signatures at the edges: elided and named lifetimes in the return type, `impl Trait` in
//! argument and return position, destructuring and `mut` parameters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

struct Data {
    items: Vec<String>,
}

#[find_executable_batch_size(starting = 8)]
fn first_item(batch_size: usize, data: &Data) -> anyhow::Result<&str> {
    if batch_size > 2 {
        return Err(OutOfMemory::new().into());
    }
    Ok(&data.items[0])
}

#[find_executable_batch_size(starting = 8)]
fn named<'a>(
    batch_size: usize,
    data: &'a Data,
    _n: impl Iterator<Item = u8> + Clone,
) -> Result<&'a String, Box<dyn std::error::Error>> {
    if batch_size > 2 {
        return Err(Box::new(OutOfMemory::new()));
    }
    Ok(&data.items[0])
}

#[find_executable_batch_size(starting = 8)]
fn displayed(batch_size: usize) -> impl std::fmt::Display {
    if batch_size > 2 {
        panic!("CUDA out of memory.");
    }
    batch_size
}

#[find_executable_batch_size(starting = 8)]
fn tuple_arg(batch_size: usize, (a, b): (u32, u32), mut counter: u32) -> Option<u32> {
    counter += 1;
    if batch_size > 2 {
        panic!("CUDA out of memory.");
    }
    Some(a + b + counter)
}

#[test]
fn lifetimes_impl_trait_and_patterns_survive_the_rewrite() {
    let data = Data {
        items: vec!["x".into()],
    };
    assert_eq!(first_item(&data).unwrap(), "x");
    assert_eq!(named(&data, [1u8].into_iter()).unwrap(), "x");
    assert_eq!(displayed().to_string(), "2");
    assert_eq!(tuple_arg((1, 2), 0), Some(4));
}
