//! Where a child and its parent exchange a trial's files: a folder of the trial's own, made by
//! the parent under the temporary folder with a name no one can guess ahead and, on Unix, mode
//! 0700, so that no other user can plant a file or a symlink in it; every file in it is
//! created with `O_EXCL` (`create_new`), which never follows a symlink; the parent removes the
//! folder when the trial is over, whichever way `run` returns (a parent killed outright runs
//! no code, and leaves it: a few hundred bytes). A name shared in the temporary
//! folder would be seen, removed or replaced by another process (another run of the same
//! program whose process id is the same in another PID namespace, a cleaner of `/tmp`).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The file the child creates first thing in `serve`, before anything that may fail, and
/// fills with its report of the start before the step: its presence proves the child entered
/// `serve` for the trial.
pub(crate) const STARTED: &str = "started";
/// The trial's outcome, written once by the thread that ran the step.
pub(crate) const ENDED: &str = "ended";
/// A panic under way, written by the panic hook, read only where there is no outcome.
pub(crate) const PANICKING: &str = "panicking";
/// What the abort handler copied from `/proc` as the child aborted.
pub(crate) const ABORT: &str = "abort";
/// The trial whose `run` a child reached before `serve` (where it stopped).
pub(crate) const RAN_BEFORE_SERVING: &str = "ran-before-serving";

/// How many names the parent tries before it gives up: each is new, so a clash is another
/// process's folder of the same name, which is never taken over.
const ATTEMPTS: usize = 64;

/// A trial's private folder, removed on drop.
#[derive(Debug)]
pub(crate) struct TrialFolder {
    path: PathBuf,
}

impl TrialFolder {
    /// Makes a new folder under the temporary folder.
    pub(crate) fn create() -> io::Result<TrialFolder> {
        static FOLDERS: AtomicUsize = AtomicUsize::new(0);
        let temporary = std::env::temp_dir();
        let mut last_error = None;
        for _ in 0..ATTEMPTS {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.subsec_nanos());
            let path = temporary.join(format!(
                "batch-size-child-{}-{}-{nanos:08x}",
                std::process::id(),
                FOLDERS.fetch_add(1, Ordering::Relaxed),
            ));
            match private_folder(&path) {
                Ok(()) => return Ok(TrialFolder { path }),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                    last_error = Some(error);
                }
                Err(error) => return Err(in_folder(&temporary, error)),
            }
        }
        Err(in_folder(
            &temporary,
            last_error.unwrap_or_else(|| io::Error::other("no name was free")),
        ))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The text of one of the child's files; `None` where the child did not write it.
    pub(crate) fn read(&self, name: &str) -> Option<String> {
        read(&self.path, name)
    }
}

impl Drop for TrialFolder {
    fn drop(&mut self) {
        if let Err(error) = fs::remove_dir_all(&self.path) {
            tracing::debug!(folder = %self.path.display(), %error, "could not remove a trial's folder");
        }
    }
}

/// What an error making the folder says: where, and what to do.
fn in_folder(temporary: &Path, error: io::Error) -> io::Error {
    io::Error::new(
        error.kind(),
        format!(
            "could not make a private folder for the trial's report in {} ({error}): set TMPDIR \
             to a folder this user may write",
            temporary.display()
        ),
    )
}

#[cfg(unix)]
fn private_folder(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(path)
}

#[cfg(not(unix))]
fn private_folder(path: &Path) -> io::Result<()> {
    fs::DirBuilder::new().create(path)
}

/// The text of `name` in `folder`; `None` where it is not there.
pub(crate) fn read(folder: &Path, name: &str) -> Option<String> {
    fs::read_to_string(folder.join(name)).ok()
}

/// Creates `name` in `folder`, which must not exist (`O_EXCL`: a symlink is never followed).
pub(crate) fn create_new(folder: &Path, name: &str) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(folder.join(name))
}

/// Writes `text` whole as `name` in `folder`: to a new file of its own first, then renamed over
/// it, so that the parent reads this text or the one before, never part of one (a panic hook on
/// another thread may write at the same moment).
pub(crate) fn write_whole(folder: &Path, name: &str, text: &str) -> io::Result<()> {
    static WRITES: AtomicUsize = AtomicUsize::new(0);
    let partial = format!("{name}.{}.partial", WRITES.fetch_add(1, Ordering::Relaxed));
    let mut file = create_new(folder, &partial)?;
    file.write_all(text.as_bytes())?;
    drop(file);
    fs::rename(folder.join(&partial), folder.join(name))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn each_folder_is_new_private_and_removed() {
        let (first, second) = (
            TrialFolder::create().unwrap(),
            TrialFolder::create().unwrap(),
        );
        assert_ne!(first.path(), second.path());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(first.path()).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        write_whole(first.path(), ENDED, "outcome fit\n").unwrap();
        write_whole(first.path(), ENDED, "outcome failed\n").unwrap();
        assert_eq!(first.read(ENDED).as_deref(), Some("outcome failed\n"));
        assert!(create_new(first.path(), ENDED).is_err());
        let path = first.path().to_owned();
        drop(first);
        assert!(!path.exists());
    }
}
