// `crate = path` and `crate = "path"` name the runtime when it is re-exported or renamed: a
// glob re-export carries the hidden `__private` module too.
mod rt {
    pub use batch_size_runtime::*;
}

mod nested {
    pub mod runtime {
        pub use batch_size_runtime::{__private, find_executable_batch_size, OutOfMemory};
    }
}

use batch_size_runtime as renamed;

#[rt::find_executable_batch_size(starting = 16, crate = rt)]
fn through_glob(batch_size: usize) -> anyhow::Result<usize> {
    if batch_size > 5 {
        return Err(rt::OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[nested::runtime::find_executable_batch_size(starting = 16, crate = "crate::nested::runtime")]
fn through_string(batch_size: usize) -> anyhow::Result<usize> {
    if batch_size > 5 {
        return Err(nested::runtime::OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[renamed::find_executable_batch_size(crate = renamed, starting = 16)]
fn through_rename(batch_size: usize) -> anyhow::Result<usize> {
    if batch_size > 5 {
        return Err(renamed::OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[renamed::find_executable_batch_size(starting = 16, crate = ::batch_size_runtime)]
fn absolute(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    assert_eq!(through_glob().unwrap(), 4);
    assert_eq!(through_string().unwrap(), 4);
    assert_eq!(through_rename().unwrap(), 4);
    assert_eq!(absolute(), 16);
}
