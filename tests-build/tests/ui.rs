//! Compile-time behaviour of `#[find_executable_batch_size]`: what it accepts (`ui/pass`, each
//! program built and run; `accepted.rs` holds most cases, a module each) and how it reports what
//! it cannot rewrite (`ui/fail`, each checked against its `.stderr` snapshot). Regenerate the
//! snapshots with `TRYBUILD=overwrite cargo test -p batch-size-tests-build --test ui` and read
//! every one in `git diff`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/fail/*.rs");
}
