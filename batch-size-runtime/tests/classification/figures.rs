//! One table of out-of-memory messages for classification and for the guided policy's figures:
//! every message the policy reads figures from is classified as out-of-memory, every pattern
//! that states figures has them read, and both read the same bytes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use batch_size_runtime::oom::{self, OomKind, OOM_PATTERNS};
use batch_size_runtime::OutOfMemory;

/// For each pattern that states figures, messages as their frameworks print them.
fn examples(pattern: &str) -> &'static [&'static str] {
    match pattern {
        "CUDA out of memory" => &["CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 228.38 MiB is free. Of the allocated memory 76.10 GiB is allocated by PyTorch"],
        "out of device memory" => &[
            "out of device memory on sim:0: tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB",
            "out of device memory allocating 1073741824 bytes",
        ],
        "out of host memory" => &[
            "out of host memory on cpu: tried to allocate 64.00 MiB with 7.08 MiB free of 384.00 MiB",
        ],
        "OutOfMemory { size:" => &["called `Result::unwrap()` on an `Err` value: OutOfMemory { size: 4096 }"],
        "DefaultCPUAllocator: can't allocate memory" => &["DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12 (Cannot allocate memory)"],
        "can't allocate buffer of size: " => &["can't allocate buffer of size: 1073741824"],
        "HIP out of memory" => &["HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 63.98 GiB of which 1.00 GiB is free."],
        "XPU out of memory" => &["XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.11 GiB of which 1.00 GiB is free."],
        "NPU out of memory" => &["NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 32.00 GiB total capacity; 30.12 GiB already allocated)"],
        "MPS backend out of memory" => &["MPS backend out of memory (MPS allocated: 8.00 GB, other allocations: 1.00 MB, max allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool."],
        "Failed to allocate memory for requested buffer" => &["Failed to allocate memory for requested buffer of size 1048576"],
        "is smaller than requested bytes of" => &["Non-zero status code returned while running MatMul node. Name:'matmul' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Available memory of 62914304 is smaller than requested bytes of 268435456"],
        "every page size the memory tracks still holds live allocations" => &["Can't allocate 8388608 bytes: every page size the memory tracks still holds live allocations"],
        "RESOURCE_EXHAUSTED: Out of memory" => &["RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes."],
        " out of memory." => &["RuntimeError: MUSA out of memory. Tried to allocate 2.00 GiB"],
        _ => &[],
    }
}

/// Messages that look like they carry figures but are not out-of-memory.
const NOT_OUT_OF_MEMORY: &[&str] = &[
    "checkpoint: tried to allocate 4.00 GiB with 1.00 GiB free of 16.00 GiB",
    "Tried to allocate 2.00 GiB for the page cache",
    "allocating 4096 bytes for the tokenizer",
    "failed to read a buffer of size: 4096",
    "GPU 0 has a total capacity of 80.00 GiB of which 1.00 GiB is free",
];

#[test]
fn every_pattern_with_figures_is_recognised_and_has_its_figures_read() {
    for pattern in OOM_PATTERNS
        .iter()
        .filter(|pattern| !pattern.figures.is_empty())
    {
        let messages = examples(pattern.text);
        assert!(
            !messages.is_empty(),
            "{:?} states figures: add an example message here",
            pattern.text
        );
        for message in messages {
            let found = oom::classify_text(message)
                .unwrap_or_else(|| panic!("{message:?} is not recognised"));
            assert_eq!(found.kind, OomKind::Pattern(*pattern), "{message:?}");
            let figures = oom::figures(message);
            assert!(figures.requested.is_some(), "{message:?}: {figures:?}");
            // Classification and the record read the same bytes, once.
            assert_eq!(found.figures.requested, figures.requested, "{message:?}");
            assert_eq!(found.figures.total, figures.total, "{message:?}");
            assert_eq!(found.figures.free_at_failure, figures.free, "{message:?}");
        }
    }
}

#[test]
fn every_message_the_policy_reads_figures_from_is_out_of_memory() {
    let with_figures = OOM_PATTERNS
        .iter()
        .flat_map(|pattern| examples(pattern.text))
        .copied();
    for message in with_figures.chain(NOT_OUT_OF_MEMORY.iter().copied()) {
        let found = oom::classify_text(message);
        if oom::figures(message) != Default::default() {
            assert!(found.is_some(), "figures read from {message:?}, not OOM");
        }
    }
    for message in NOT_OUT_OF_MEMORY {
        assert!(oom::classify_text(message).is_none(), "{message:?}");
    }
}

#[test]
fn pytorch_and_this_crate_give_the_whole_picture() {
    let pytorch = oom::classify_text(examples("CUDA out of memory")[0])
        .unwrap()
        .figures;
    assert_eq!(pytorch.requested, Some(2 << 30));
    let capacity = (79.15 * (1u64 << 30) as f64).round() as u64;
    assert_eq!(pytorch.total, Some(capacity));
    let free = (228.38 * (1u64 << 20) as f64).round() as u64;
    assert_eq!(pytorch.used_at_failure(), Some(capacity - free));

    // This crate's own error, as text (a wrapper that hides its type): the figures it holds.
    let error = OutOfMemory::new()
        .with_requested(3 << 30)
        .with_free(1 << 30)
        .with_total(16 << 30)
        .on_device("sim:0");
    let text = anyhow::Error::new(error).context("forward pass");
    let text = format!("{text:#}"); // "forward pass: out of device memory on sim:0: ..."
    let figures = oom::figures(&text);
    assert_eq!(figures.requested, Some(3 << 30));
    assert_eq!(
        (figures.free, figures.total),
        (Some(1 << 30), Some(16 << 30))
    );
    assert_eq!(
        oom::classify_text(&text).unwrap().figures.requested,
        Some(3 << 30)
    );
    let found = oom::classify_text(&text).unwrap().figures;
    assert_eq!(found.used_at_failure(), Some(15 << 30));
}
