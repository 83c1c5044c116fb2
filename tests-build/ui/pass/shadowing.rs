// User items named like what the expansion uses (`core`, `std`, `Result`, `Option`, `Ok`,
// `Verdict`, a module `batch_size_runtime`, locals like the generated ones) do not disturb it.
#![allow(dead_code, non_camel_case_types, clippy::all)]

mod core {}
mod std {}

mod batch_size_runtime {
    pub mod __private {}
    pub struct OutOfMemory;
}

struct Result;
struct Option;
struct Verdict;
struct Tag;
struct Search;
enum Shadow {
    Ok,
    Err,
    Some,
    None,
}
use Shadow::*;

fn concat() {}
fn module_path() {}
fn unreachable() {}
trait Into {}

trait __BatchSizeJudge1 {
    fn judge(&self, value: u8) -> u8;
}

type Fallible<T> = ::core::result::Result<T, ::anyhow::Error>;

#[::batch_size_runtime::find_executable_batch_size(starting = 16, factor = 0.5)]
fn train(batch_size: usize, limit: usize) -> Fallible<usize> {
    let __batch_size_search = "user local";
    let __batch_size_next = 1;
    let _ = (__batch_size_search, __batch_size_next);
    if batch_size > limit {
        return ::core::result::Result::Err(::batch_size_runtime::OutOfMemory::new().into());
    }
    ::core::result::Result::Ok(batch_size)
}

#[::batch_size_runtime::find_executable_batch_size(starting = 16)]
fn plain(batch_size: usize) -> usize {
    batch_size
}

#[::batch_size_runtime::find_executable_batch_size(starting = 16)]
fn written_result(batch_size: usize) -> ::core::result::Result<usize, ::anyhow::Error> {
    if batch_size > 3 {
        return ::core::result::Result::Err(::batch_size_runtime::OutOfMemory::new().into());
    }
    ::core::result::Result::Ok(batch_size)
}

fn main() {
    let _ = (Ok, Err, Some, None, Result, Option, Verdict, Tag, Search);
    ::core::assert_eq!(train(5).unwrap(), 4);
    ::core::assert_eq!(plain(), 16);
    ::core::assert_eq!(written_result().unwrap(), 2);
}
