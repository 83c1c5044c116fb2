//! A folder under the system's temporary folder for one test, removed when the test ends
//! (passed or failed): `cargo test` leaves nothing behind in `/tmp`.

use std::ffi::OsStr;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// The path `<temp>/<prefix>-<process id>-<name>`, emptied now and removed on drop. Nothing is
/// created: a test that needs the folder itself (or a file in its place) makes it.
#[derive(Debug)]
pub struct TempFolder(PathBuf);

impl TempFolder {
    pub fn new(prefix: &str, name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{prefix}-{}-{name}", std::process::id()));
        // Left by a run killed before its drop: start empty.
        remove(&path);
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

/// Whatever is at `path`, a folder or a file.
fn remove(path: &Path) {
    let _ = std::fs::remove_dir_all(path);
    let _ = std::fs::remove_file(path);
}

impl Drop for TempFolder {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

impl Deref for TempFolder {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempFolder {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

/// `&TempFolder` where an `Into<PathBuf>` or an `AsRef<OsStr>` is asked for (a cache folder, an
/// environment variable's value).
impl AsRef<OsStr> for TempFolder {
    fn as_ref(&self) -> &OsStr {
        self.0.as_os_str()
    }
}
