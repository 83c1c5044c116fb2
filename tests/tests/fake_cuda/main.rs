//! The CUDA backend end to end through the real cudarc against the fake CUDA driver
//! (`tests/fake-cuda`), by the builder and by the attribute. One binary, a module per file:
//! every test holds a `FakeCuda::session`, which serialises them and resets the driver.
//! `cuda_absent.rs` (no libcuda loaded), `nccl_fake_driver.rs` (ranks as child processes) and
//! `success_path_driver_calls.rs` (counts every driver call) keep binaries of their own.

mod attribute;
mod driver;
