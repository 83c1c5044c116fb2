/// A training scenario through cudarc whose memory grows with the batch size.
pub mod cuda_scenario;
/// The fake CUDA driver that the CUDA end-to-end tests load in place of libcuda (Linux only).
#[cfg(target_os = "linux")]
pub mod fake_cuda;
/// The fake NCCL that the NCCL tests load (Linux only).
#[cfg(target_os = "linux")]
pub mod fake_nccl;
