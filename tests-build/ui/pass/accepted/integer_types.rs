// Every primitive integer type can be the batch size, with `mut` and `_` patterns; `starting`
// is capped to what the type holds.
use batch_size_runtime::{find_executable_batch_size, last_report, OutOfMemory};

macro_rules! each_integer {
    ($($name:ident: $int:ty),* $(,)?) => {$(
        #[find_executable_batch_size(starting = 100)]
        fn $name(batch_size: $int, limit: $int) -> anyhow::Result<$int> {
            if batch_size > limit {
                return Err(OutOfMemory::new().into());
            }
            Ok(batch_size)
        }
    )*
    fn check_all() {
        $(assert_eq!($name(30).unwrap(), 25, stringify!($int));)*
    }};
}

each_integer!(
    with_u8: u8, with_u16: u16, with_u32: u32, with_u64: u64, with_u128: u128, with_usize: usize,
    with_i8: i8, with_i16: i16, with_i32: i32, with_i64: i64, with_i128: i128, with_isize: isize,
);

#[find_executable_batch_size(starting = 1000)]
fn capped(batch_size: i8) -> i8 {
    batch_size
}

#[find_executable_batch_size(starting = 8)]
fn mutable(mut batch_size: u16, limit: u16) -> anyhow::Result<u16> {
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    batch_size += 1000;
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 8)]
fn ignored(_: usize, calls: &mut u32) -> anyhow::Result<u32> {
    *calls += 1;
    if *calls < 3 {
        return Err(OutOfMemory::new().into());
    }
    Ok(*calls)
}

#[find_executable_batch_size(starting = 8)]
fn unused(_batch_size: u64) -> &'static str {
    "ran"
}

#[find_executable_batch_size(starting = 4_u8)]
fn typed_starting(batch_size: u64) -> u64 {
    batch_size
}

pub fn main() {
    check_all();
    assert_eq!(capped(), 127);
    assert_eq!(mutable(3).unwrap(), 1002);
    let mut calls = 0;
    assert_eq!(ignored(&mut calls).unwrap(), 3);
    assert_eq!(last_report().unwrap().batch_size(), Some(2));
    assert_eq!(unused(), "ran");
    assert_eq!(typed_starting(), 4);
}
