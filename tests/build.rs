//! Builds the fake CUDA driver (`fake-cuda/fake_cuda.rs`) into `$OUT_DIR/libcuda.so`, a shared
//! library whose SONAME is `libcuda.so`, and tells the tests where it is through the
//! `FAKE_CUDA_DRIVER` environment variable at compile time (`env!("FAKE_CUDA_DRIVER")`).
//!
//! Linux only: elsewhere nothing is built and the tests that need it are compiled out.

use std::env;
use std::error::Error;
use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=fake-cuda/fake_cuda.rs");
    println!("cargo:rerun-if-changed=fake-cuda/counters.rs");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return Ok(());
    }

    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("cargo did not set OUT_DIR")?);
    let manifest_dir = PathBuf::from(
        env::var_os("CARGO_MANIFEST_DIR").ok_or("cargo did not set CARGO_MANIFEST_DIR")?,
    );
    let source = manifest_dir.join("fake-cuda").join("fake_cuda.rs");
    let library = out_dir.join("libcuda.so");

    let mut command = Command::new(&rustc);
    command
        .args([
            "--edition",
            "2021",
            "--crate-type",
            "cdylib",
            "--crate-name",
            "fake_cuda",
        ])
        .args(["-C", "opt-level=1", "-C", "link-arg=-Wl,-soname,libcuda.so"])
        .arg("-o")
        .arg(&library)
        .arg(&source);
    if let Ok(target) = env::var("TARGET") {
        command.args(["--target", &target]);
    }
    let output = command.output()?;
    if !output.status.success() {
        return Err(format!(
            "building the fake CUDA driver with {} failed:\n{}",
            rustc.to_string_lossy(),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    println!("cargo:rustc-env=FAKE_CUDA_DRIVER={}", library.display());
    Ok(())
}
