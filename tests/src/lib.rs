/// The fake CUDA driver that the CUDA end-to-end tests load in place of libcuda (Linux only).
#[cfg(target_os = "linux")]
pub mod fake_cuda;
