//! Builds the fake CUDA driver (`fake-cuda/fake_cuda.rs`) into `$OUT_DIR/libcuda.so`, a shared
//! library whose SONAME is `libcuda.so`, and the fake NCCL (`fake-nccl/fake_nccl.rs`) into
//! `$OUT_DIR/fake-nccl/libnccl.so.2`, SONAME `libnccl.so.2` (the name the NCCL pip wheel ships,
//! which cudarc never looks for). The tests find them through the `FAKE_CUDA_DRIVER` and
//! `FAKE_NCCL_LIBRARY` environment variables at compile time (`env!`).
//!
//! Linux only: elsewhere nothing is built and the tests that need them are compiled out.

use std::env;
use std::error::Error;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=fake-cuda/fake_cuda.rs");
    println!("cargo:rerun-if-changed=fake-cuda/counters.rs");
    println!("cargo:rerun-if-changed=fake-nccl/fake_nccl.rs");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return Ok(());
    }

    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("cargo did not set OUT_DIR")?);
    let manifest_dir = PathBuf::from(
        env::var_os("CARGO_MANIFEST_DIR").ok_or("cargo did not set CARGO_MANIFEST_DIR")?,
    );

    let driver = out_dir.join("libcuda.so");
    build_cdylib(
        &rustc,
        &manifest_dir.join("fake-cuda").join("fake_cuda.rs"),
        "fake_cuda",
        "libcuda.so",
        &driver,
    )?;
    println!("cargo:rustc-env=FAKE_CUDA_DRIVER={}", driver.display());

    let nccl_dir = out_dir.join("fake-nccl");
    fs::create_dir_all(&nccl_dir)?;
    let nccl = nccl_dir.join("libnccl.so.2");
    build_cdylib(
        &rustc,
        &manifest_dir.join("fake-nccl").join("fake_nccl.rs"),
        "fake_nccl",
        "libnccl.so.2",
        &nccl,
    )?;
    println!("cargo:rustc-env=FAKE_NCCL_LIBRARY={}", nccl.display());
    Ok(())
}

/// Compiles one dependency-free source file into a shared library with the given SONAME.
fn build_cdylib(
    rustc: &OsString,
    source: &Path,
    crate_name: &str,
    soname: &str,
    library: &Path,
) -> Result<(), Box<dyn Error>> {
    let mut command = Command::new(rustc);
    command
        .args([
            "--edition",
            "2021",
            "--crate-type",
            "cdylib",
            "--crate-name",
            crate_name,
        ])
        .args(["-C", "opt-level=1"])
        .arg("-C")
        .arg(format!("link-arg=-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(library)
        .arg(source);
    if let Ok(target) = env::var("TARGET") {
        command.args(["--target", &target]);
    }
    let output = command.output()?;
    if !output.status.success() {
        return Err(format!(
            "building {} with {} failed:\n{}",
            source.display(),
            rustc.to_string_lossy(),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(())
}
