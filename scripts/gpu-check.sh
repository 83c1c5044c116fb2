#!/usr/bin/env bash
# Checks, on a machine with an NVIDIA GPU, that the CUDA backend gives the memory of failed
# attempts back to the device: builds tests/src/bin/gpu_check.rs and runs the CUDA end-to-end
# scenario of tests/tests/fake_cuda/driver.rs against the real driver (no CUDA toolkit needed:
# cudarc loads libcuda at run time).
#
# A model is sized from the device's free memory so that batch sizes 64 and 32 overflow it on
# purpose and 16 fits; each attempt's size, outcome and free memory before it, at its failure
# and after the release are printed (the retries' WARN logs go to stderr). Then, when NCCL is
# found (the pip wheel's libnccl.so.2 too, or BATCH_SIZE_NCCL_LIBRARY), the agreement over NCCL:
# world size 1, and two ranks on two GPUs or both on one; on two GPUs, also one global batch in
# uneven shares (EffectiveBatch::with_uneven_shares), the second GPU with half its room taken.
# Exits 1 when a check fails, 0 when they pass or when there is no CUDA driver or device to check.
#
# Usage: scripts/gpu-check.sh [DEVICE_ORDINAL]      (default 0)
# Needs only this repository and a Rust toolchain (the crates come from the registry, or from
# ~/.cargo when fetched before: CARGO_NET_OFFLINE=true works then).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "gpu-check: cargo is not on PATH (install Rust: https://rustup.rs)" >&2
    exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv || true
fi

exec cargo run --quiet -p batch-size-tests --bin gpu_check -- "$@"
