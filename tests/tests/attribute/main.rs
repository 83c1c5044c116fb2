//! The attribute's behaviour, compiled as users write it: Accelerate's cases, signatures at the
//! edges, reports of `async fn`s on a multi-threaded executor. One binary, a module per file.

mod async_reports;
mod attribute;
mod signatures;
