//! The child process of a trial, which never outlives the code that started it (as nextest's
//! test processes and rusty-fork's children do not): it runs in a process group of its own,
//! so that the processes it starts are ended with it; where the parent stops waiting (a
//! deadline) or leaves `run` early (an error, a panic), the group gets SIGTERM, a short grace
//! to finish, then SIGKILL.

use std::io;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// How long the child's group has between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// How often the parent looks whether the group has ended within the grace.
const POLL: Duration = Duration::from_millis(10);

/// A running child, ended on drop unless it was waited for.
#[derive(Debug)]
pub(crate) struct Running {
    child: Child,
    /// Whether the child was reaped: then its id is no longer this trial's to signal.
    reaped: bool,
}

impl Running {
    /// Starts `command` in a process group of its own (Unix).
    pub(crate) fn spawn(command: &mut Command) -> io::Result<Running> {
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            command.process_group(0);
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // In a group of its own the child no longer hears the terminal's Ctrl-C, and a
            // parent killed outright runs no `Drop`: the kernel ends the child when the thread
            // that started it (which waits in `run` until the child ends) is gone.
            let parent = std::process::id();
            // SAFETY: the closure runs in the forked child before `exec`; it makes only the
            // async-signal-safe system calls `prctl` and `getppid`, and allocates nothing.
            unsafe { command.pre_exec(move || death_signal::follow_parent(parent)) };
        }
        Ok(Running {
            child: command.spawn()?,
            reaped: false,
        })
    }

    pub(crate) fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits for the child itself (not for the processes it started).
    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = self.child.wait()?;
        self.reaped = true;
        Ok(status)
    }

    /// The child's status where it has ended.
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        let status = self.child.try_wait()?;
        self.reaped |= status.is_some();
        Ok(status)
    }

    /// Ends the child and the processes of its group: SIGTERM, then SIGKILL to those left
    /// after [`TERM_GRACE`], and reaps the child.
    pub(crate) fn end(&mut self) {
        #[cfg(unix)]
        {
            let group = self.child.id();
            if !self.reaped {
                group::signal(group, group::SIGTERM);
            }
            let until = Instant::now() + TERM_GRACE;
            while Instant::now() < until {
                if !self.reaped {
                    let _ = self.try_wait();
                }
                // Once the child is reaped its id may be another process's; the group is
                // signalled only while some process of it is left.
                if self.reaped && !group::alive(group) {
                    return;
                }
                std::thread::sleep(POLL);
            }
            if self.reaped && !group::alive(group) {
                return;
            }
            group::signal(group, group::SIGKILL);
        }
        #[cfg(not(unix))]
        if !self.reaped {
            let _ = self.child.kill();
        }
        if !self.reaped {
            let _ = self.wait();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.reaped {
            tracing::debug!(
                pid = self.child.id(),
                "the trial's child is still running as its parent leaves: ending it"
            );
            self.end();
        }
    }
}

#[cfg(target_os = "linux")]
mod death_signal {
    use std::ffi::{c_int, c_ulong};
    use std::io;

    unsafe extern "C" {
        fn prctl(option: c_int, argument: c_ulong, ...) -> c_int;
        fn getppid() -> i32;
    }

    const PR_SET_PDEATHSIG: c_int = 1;
    const SIGKILL: c_ulong = 9;
    /// `ESRCH`: no such process (the parent), for an error that needs no allocation.
    const ESRCH: i32 = 3;

    /// In the forked child: asks for SIGKILL when the parent's thread ends, and fails the start
    /// where the parent is already gone (it died between the fork and the `prctl`).
    pub(super) fn follow_parent(parent: u32) -> io::Result<()> {
        // SAFETY: `prctl(PR_SET_PDEATHSIG, signal)` takes a signal number and touches no memory;
        // `getppid` takes nothing.
        unsafe {
            if prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if u32::try_from(getppid()).ok() != Some(parent) {
                return Err(io::Error::from_raw_os_error(ESRCH));
            }
        }
        Ok(())
    }
}

#[cfg(unix)]
mod group {
    use std::ffi::c_int;

    unsafe extern "C" {
        fn kill(pid: i32, signal: c_int) -> c_int;
    }

    pub(super) const SIGTERM: c_int = 15;
    pub(super) const SIGKILL: c_int = 9;

    /// The process group led by the child: its id as a negative pid (`kill(2)`).
    fn target(group: u32) -> Option<i32> {
        i32::try_from(group).ok().filter(|&id| id > 1).map(|id| -id)
    }

    /// Sends `signal` to every process of the group.
    pub(super) fn signal(group: u32, signal: c_int) {
        if let Some(target) = target(group) {
            // SAFETY: `kill` takes a pid and a signal number and touches no memory of ours.
            unsafe { kill(target, signal) };
        }
    }

    /// Whether any process of the group is left (zombies included).
    pub(super) fn alive(group: u32) -> bool {
        // SAFETY: as above; signal 0 only checks that the group exists.
        target(group).is_some_and(|target| unsafe { kill(target, 0) } == 0)
    }
}

#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    /// Whether process `pid` has ended (gone, or a zombie no one reaped yet).
    fn ended(pid: &str) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    #[test]
    fn a_child_left_running_is_ended_with_what_it_started() {
        let mut running = Running::spawn(
            Command::new("sh")
                .args(["-c", "sleep 60 & echo $!; wait"])
                .stdout(Stdio::piped()),
        )
        .unwrap();
        let stdout = running.child_mut().stdout.take().unwrap();
        let mut helper = String::new();
        BufReader::new(stdout).read_line(&mut helper).unwrap();
        let helper = helper.trim().to_owned();
        let child = running.child_mut().id().to_string();
        assert!(!ended(&helper) && !ended(&child));
        drop(running);
        // The drop reaped the child; the helper's new parent reaps it in its own time.
        assert!(ended(&child));
        for _ in 0..100 {
            if ended(&helper) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the helper {helper} outlived the child's drop");
    }
}
