//! The name the test harness gives one of its binary's tests, as `--exact` takes it: a test that
//! runs another test of its binary in a child process names it this way, so that it still finds
//! it when its file is a module of a binary of several files (`tests/<area>/main.rs`).

/// The test `test` of the module whose `module_path!()` is `module_path`: that path without the
/// crate's own name, then the test's.
pub fn exact_name(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_crate, path)) => format!("{path}::{test}"),
        None => test.to_owned(),
    }
}
