//! A trial in a child process, for frameworks whose failed allocation ends the process: candle's
//! CPU backend, ndarray, anything that allocates with `Vec` (a failed Rust allocation aborts,
//! exit 134 by SIGABRT, and no `catch_unwind` sees it). The trial runs in a copy of this
//! program; an abort, a segfault or a kill (the kernel's out-of-memory killer) ends the child,
//! not the search, and counts as out-of-memory.

use std::ffi::OsString;
use std::fmt;
use std::process::{Command, ExitStatus, Stdio};

use crate::error::NoExecutableBatchSize;
use crate::memory::OutOfMemory;
use crate::oom;

/// The environment variable that tells a copy of the program it is a trial's child: the
/// trial's name, `=`, the batch size.
const CHILD_VARIABLE: &str = "BATCH_SIZE_CHILD_TRIAL";

/// The exit code of a child whose trial returned an error (its text on stderr).
const TRIAL_FAILED: i32 = 3;

/// Runs a trial in a child process: this program again, which calls [`serve`](Self::serve)
/// first thing and runs the trial at the size the parent asked for. In the parent,
/// [`run`](Self::run) starts the child and waits: `Ok(batch_size)` when the trial returned `Ok`; an
/// out-of-memory [`ChildTrialError`] when the child was ended by a signal (an abort, a
/// segfault, a kill) or failed with an out-of-memory error or panic; the child's own error,
/// which a search returns unchanged, otherwise.
///
/// The child is a new process: what the trial needs it builds itself (the model, the data),
/// and what it learns dies with it. Use it where a failed allocation cannot be caught in the
/// process (candle on the CPU), to size the step once; then train in the process at that size.
///
/// ```no_run
/// use batch_size_runtime::oom::{ChildTrial, ChildTrialError};
/// use batch_size_runtime::{BatchSizeSearch, Release};
///
/// /// A step on the CPU that allocates with `Vec`, as candle's CPU backend does: past the
/// /// machine's memory it aborts the process.
/// fn step(batch_size: usize) -> Result<(), String> {
///     let inputs = vec![1.0f32; batch_size << 20]; // 4 MiB a sample
///     if inputs.iter().sum::<f32>() == 0.0 {
///         return Err("no data".into());
///     }
///     Ok(())
/// }
///
/// fn main() -> Result<(), ChildTrialError> {
///     let trial = ChildTrial::new("step");
///     trial.serve(step); // in the child: runs the step and exits; here: returns at once
///     let fitted = BatchSizeSearch::new(4096)
///         .with_release(Release::none()) // the child's memory went with it
///         .run(|batch_size| trial.run(batch_size))?;
///     println!("batch size {fitted} fits");
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct ChildTrial {
    name: String,
    args: Option<Vec<OsString>>,
}

impl ChildTrial {
    /// A trial called `name` (one program may serve several).
    pub fn new(name: impl Into<String>) -> Self {
        ChildTrial {
            name: name.into(),
            args: None,
        }
    }

    /// The arguments the child is started with (default: this process's own, so that `main`
    /// reaches [`serve`](Self::serve) as it did here). A test binary passes the test that
    /// serves: `["--exact", "my_test", "--ignored"]`.
    pub fn with_args<I, A>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: Into<OsString>,
    {
        self.args = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// In the child this trial's parent started: runs `trial` at the size asked for and exits
    /// (0 when it returned `Ok`; otherwise with its error's text on stderr, for the parent).
    /// In any other process, returns at once. Call it first in `main` (or in the test the
    /// child runs).
    pub fn serve<E: fmt::Display>(&self, trial: impl FnOnce(usize) -> Result<(), E>) {
        let Some(batch_size) = self.asked() else {
            return;
        };
        match trial(batch_size) {
            Ok(()) => std::process::exit(0),
            Err(error) => {
                // The child's stderr is the parent's to read, not the user's terminal.
                eprintln!("{error}");
                std::process::exit(TRIAL_FAILED)
            }
        }
    }

    /// Whether this process is this trial's child.
    pub fn is_child(&self) -> bool {
        self.asked().is_some()
    }

    fn asked(&self) -> Option<usize> {
        let value = std::env::var(CHILD_VARIABLE).ok()?;
        let (name, size) = value.rsplit_once('=')?;
        (name == self.name).then(|| size.parse().ok()).flatten()
    }

    /// Runs the trial at `batch_size` in a child process and waits for it; the size that ran,
    /// for the search to return.
    pub fn run(&self, batch_size: usize) -> Result<usize, ChildTrialError> {
        let program = std::env::current_exe().map_err(ChildTrialError::Start)?;
        let args = match &self.args {
            Some(args) => args.clone(),
            None => std::env::args_os().skip(1).collect(),
        };
        let output = Command::new(program)
            .args(args)
            .env(CHILD_VARIABLE, format!("{}={batch_size}", self.name))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(ChildTrialError::Start)?;
        if output.status.success() {
            return Ok(batch_size);
        }
        // What the child said: its stderr, then its stdout (a test harness captures a panic's
        // message and prints it there).
        let said = format!(
            "{}\n{}",
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout)
        );
        if let Some(signal) = ended_by_signal(output.status) {
            return Err(ChildTrialError::Died {
                batch_size,
                how: signal,
                out_of_memory: OutOfMemory::new(),
            });
        }
        // A Rust child that panicked, or whose trial returned an error: what it said.
        let said = said
            .lines()
            .find(|line| oom::classify_text(line).is_some())
            .or_else(|| last_words(&said))
            .unwrap_or("no message")
            .trim()
            .to_owned();
        match oom::classify_text(&said) {
            Some(_) => Err(ChildTrialError::OutOfMemory {
                batch_size,
                message: said,
            }),
            None => Err(ChildTrialError::Failed {
                batch_size,
                status: output.status.code(),
                message: said,
            }),
        }
    }
}

/// A failed child's own words: a panic's message (the line after "panicked at"), or the
/// first line it wrote (stderr before stdout).
fn last_words(said: &str) -> Option<&str> {
    let mut lines = said.lines();
    if lines.by_ref().any(|line| line.contains("panicked at")) {
        if let Some(message) = lines.next().filter(|line| !line.trim().is_empty()) {
            return Some(message);
        }
    }
    said.lines().find(|line| !line.trim().is_empty())
}

#[cfg(unix)]
fn ended_by_signal(status: ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let signal = status.signal()?;
    Some(match signal {
        6 => "SIGABRT (a failed allocation aborts a Rust process)".to_owned(),
        9 => "SIGKILL (the kernel's out-of-memory killer, or a kill)".to_owned(),
        11 => "SIGSEGV".to_owned(),
        other => format!("signal {other}"),
    })
}

#[cfg(not(unix))]
fn ended_by_signal(status: ExitStatus) -> Option<String> {
    // Windows: an abort exits with code 3, a failed allocation with 0xC0000017 (no memory).
    match status.code() {
        Some(3) => Some("an abort".to_owned()),
        Some(code) if code as u32 == 0xC000_0017 => Some("STATUS_NO_MEMORY".to_owned()),
        _ => None,
    }
}

/// How a [`ChildTrial`] failed. The first two are out-of-memory (a search retries smaller);
/// the others come back from a search unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChildTrialError {
    /// The child was ended by a signal: counted as out-of-memory.
    #[error("the trial's child process at batch size {batch_size} was ended by {how}: counted as out of memory")]
    Died {
        /// The size the child ran.
        batch_size: usize,
        /// The signal.
        how: String,
        /// What makes it out-of-memory to the classification.
        #[source]
        out_of_memory: OutOfMemory,
    },
    /// The child's trial ran out of memory and said so (an error or a panic).
    #[error("the trial's child process at batch size {batch_size} ran out of memory: {message}")]
    OutOfMemory {
        /// The size the child ran.
        batch_size: usize,
        /// The line that said so.
        message: String,
    },
    /// The child's trial failed otherwise: its error's or panic's last line.
    #[error("the trial's child process at batch size {batch_size} failed: {message}")]
    Failed {
        /// The size the child ran.
        batch_size: usize,
        /// Its exit code.
        status: Option<i32>,
        /// What it said last on stderr.
        message: String,
    },
    /// The child could not be started.
    #[error("could not start the trial's child process: {0}")]
    Start(#[source] std::io::Error),
    /// No size fit (what a search returns through this type).
    #[error(transparent)]
    NoSizeFits(#[from] NoExecutableBatchSize),
}
