//! The child's report to its parent: small text files in the trial's private folder
//! (`super::files`): `started`, written before the step; `ended`, written whole (by a
//! rename) when the step returned; `panicking`, by the panic hook. The parent reads them once
//! the child has ended. It travels beside the child's stdout and stderr, never through them: a test harness
//! captures those, and whatever the step printed is the user's, not a message to classify.
//!
//! ```text
//! batch-size-runtime child report 1
//! batch_size 64
//! start_in_use 123456        (the figures the child read before the trial, where it read any)
//! start_own 123456
//! start_total 716177408
//! start_kind address_space
//! start_virtual 123456       (the process's own VmSize and VmRSS before the trial)
//! start_resident 65536
//! start_data 4096            (VmData and RssAnon: what it allocated, without mapped files)
//! start_resident_anonymous 4096
//! used_room 536870912       (what the trial used, in the room it had, read as it ended;
//!                            under a resident budget: the budget less VmRSS at the step's
//!                            start, VmRSS and its peak above that start)
//! used_held 1048576
//! used_peak 402653184
//! outcome out_of_memory      (fit | out_of_memory | failed | panicking; absent: started only)
//! requested 1048576          (figures of an out-of-memory, each where known)
//! free 4096
//! total 268435456
//! message
//! the error's or the panic's text, whole, to the end of the file
//! ```

use std::fs;

use crate::memory::OutOfMemory;
use crate::memory::{HostLimit, HostLimitKind};

const HEADER: &str = "batch-size-runtime child report 1";

/// How the trial ended, as the child saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The trial returned `Ok`.
    Fit,
    /// The trial returned an out-of-memory error or panicked with one.
    OutOfMemory {
        message: String,
        figures: OutOfMemory,
    },
    /// The trial returned another error: its text, whole.
    Failed { message: String },
    /// A panic was under way (its hook ran): what the parent reads if the process then ended
    /// without a later outcome (`panic = "abort"`, a panic while panicking).
    Panicking {
        message: String,
        out_of_memory: bool,
    },
}

/// What the child reported: that the trial started, at which size, with the memory it found,
/// and how it ended where it got that far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) batch_size: usize,
    pub(crate) start: Option<HostLimit>,
    /// The process's own counters before the trial: its virtual and resident size (the limit
    /// that binds at the failure may be another than at the start: the trial may set one).
    pub(crate) start_own: Option<Own>,
    /// What the trial used, read by the child as it ended (not where it aborted).
    pub(crate) used: Option<Used>,
    pub(crate) ended: Option<Ended>,
}

/// What one trial used, in the room it had: the limit that bound at its end less what was in
/// use before it (other processes, the program's own start), each rounded down to a MiB where
/// it is the room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Used {
    /// The room.
    pub(crate) room: u64,
    /// The trial's own bytes at its end (at the failure, where it aborted).
    pub(crate) held: u64,
    /// The most the trial held at once.
    pub(crate) peak: u64,
}

/// A process's own bytes, as each kind of limit counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Own {
    /// `VmSize`, against an address-space limit.
    pub(crate) virtual_size: u64,
    /// `VmRSS`, against a cgroup's or the machine's memory.
    pub(crate) resident: u64,
    /// `VmData`: the process's private writable mappings (its heap, its anonymous maps, thread
    /// stacks), without the files it maps read-only.
    pub(crate) data: u64,
    /// `RssAnon`: its resident anonymous pages, without the file pages it reads.
    pub(crate) resident_anonymous: u64,
}

impl Own {
    /// This process's counters now (Linux's `/proc/self/status`).
    pub(crate) fn now() -> Option<Own> {
        Own::parse(&fs::read_to_string("/proc/self/status").ok()?)
    }

    /// The counters in the text of a `/proc/<pid>/status`.
    pub(crate) fn parse(status: &str) -> Option<Own> {
        let kilobytes = |key: &str| {
            status.lines().find_map(|line| {
                let kib: u64 = line
                    .strip_prefix(key)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()?;
                kib.checked_mul(1024)
            })
        };
        let virtual_size = kilobytes("VmSize:")?;
        let resident = kilobytes("VmRSS:")?;
        Some(Own {
            virtual_size,
            resident,
            data: kilobytes("VmData:").unwrap_or(virtual_size),
            resident_anonymous: kilobytes("RssAnon:").unwrap_or(resident),
        })
    }

    /// The bytes `kind` counts.
    pub(crate) fn counted_by(&self, kind: HostLimitKind) -> u64 {
        match kind {
            HostLimitKind::AddressSpace => self.virtual_size,
            HostLimitKind::Cgroup | HostLimitKind::Physical => self.resident,
        }
    }

    /// What the process allocated since `start`, as `kind` counts it: its anonymous memory's
    /// growth only. Between a failed allocation and the abort, Rust's hook may print a
    /// backtrace, which maps and reads the program's debug information (14 MiB for a test
    /// binary): those are file pages, not the trial's.
    pub(crate) fn allocated_since(&self, start: &Own, kind: HostLimitKind) -> u64 {
        match kind {
            HostLimitKind::AddressSpace => self.data.saturating_sub(start.data),
            HostLimitKind::Cgroup | HostLimitKind::Physical => self
                .resident_anonymous
                .saturating_sub(start.resident_anonymous),
        }
    }
}

impl Ended {
    /// How a trial ended, from the report's `outcome` line, its message and figures; `None`
    /// for an outcome this parent does not know.
    fn parse(outcome: &str, message: String, figures: OutOfMemory) -> Option<Ended> {
        Some(match outcome {
            "fit" => Ended::Fit,
            "out_of_memory" => Ended::OutOfMemory { message, figures },
            "failed" => Ended::Failed { message },
            "panicking" => Ended::Panicking {
                message,
                out_of_memory: false,
            },
            "panicking_out_of_memory" => Ended::Panicking {
                message,
                out_of_memory: true,
            },
            _ => return None,
        })
    }
}

impl Report {
    pub(crate) fn to_text(&self) -> String {
        let mut text = format!("{HEADER}\nbatch_size {}\n", self.batch_size);
        if let Some(start) = &self.start {
            let kind = match start.kind {
                HostLimitKind::AddressSpace => "address_space",
                HostLimitKind::Cgroup => "cgroup",
                HostLimitKind::Physical => "physical",
            };
            text.push_str(&format!(
                "start_in_use {}\nstart_own {}\nstart_total {}\nstart_kind {kind}\n",
                start.in_use, start.own, start.total
            ));
        }
        if let Some(own) = &self.start_own {
            text.push_str(&format!(
                "start_virtual {}\nstart_resident {}\nstart_data {}\nstart_resident_anonymous {}\n",
                own.virtual_size, own.resident, own.data, own.resident_anonymous
            ));
        }
        if let Some(used) = &self.used {
            text.push_str(&format!(
                "used_room {}\nused_held {}\nused_peak {}\n",
                used.room, used.held, used.peak
            ));
        }
        let message = match &self.ended {
            None => None,
            Some(Ended::Fit) => {
                text.push_str("outcome fit\n");
                None
            }
            Some(Ended::OutOfMemory { message, figures }) => {
                text.push_str("outcome out_of_memory\n");
                for (key, value) in [
                    ("requested", figures.requested),
                    ("free", figures.free),
                    ("total", figures.total),
                ] {
                    if let Some(value) = value {
                        text.push_str(&format!("{key} {value}\n"));
                    }
                }
                Some(message)
            }
            Some(Ended::Failed { message }) => {
                text.push_str("outcome failed\n");
                Some(message)
            }
            Some(Ended::Panicking {
                message,
                out_of_memory,
            }) => {
                text.push_str(if *out_of_memory {
                    "outcome panicking_out_of_memory\n"
                } else {
                    "outcome panicking\n"
                });
                Some(message)
            }
        };
        if let Some(message) = message {
            text.push_str("message\n");
            text.push_str(message);
        }
        text
    }

    /// The report in `text`; `None` for anything that is not one whole report (a file of
    /// another program, a version this parent does not read).
    pub(crate) fn parse(text: &str) -> Option<Report> {
        let (head, message) = text
            .split_once("\nmessage\n")
            .map_or((text, None), |(head, message)| (head, Some(message)));
        let mut lines = head.lines();
        if lines.next()? != HEADER {
            return None;
        }
        // `key value` lines; a key a later version added is not this parent's to read.
        let mut fields = std::collections::HashMap::new();
        for line in lines {
            let (key, value) = line.split_once(' ')?;
            fields.insert(key, value);
        }
        let number = |key: &str| fields.get(key).and_then(|value| value.parse::<u64>().ok());
        let kind = match fields.get("start_kind").copied() {
            Some("address_space") => Some(HostLimitKind::AddressSpace),
            Some("cgroup") => Some(HostLimitKind::Cgroup),
            Some("physical") => Some(HostLimitKind::Physical),
            _ => None,
        };
        // The limit at the start, where the child read all of it.
        let start = (|| {
            Some(HostLimit {
                kind: kind?,
                total: number("start_total")?,
                in_use: number("start_in_use")?,
                own: number("start_own")?,
            })
        })();
        let start_own = (|| {
            Some(Own {
                virtual_size: number("start_virtual")?,
                resident: number("start_resident")?,
                data: number("start_data")?,
                resident_anonymous: number("start_resident_anonymous")?,
            })
        })();
        let used = (|| {
            Some(Used {
                room: number("used_room")?,
                held: number("used_held")?,
                peak: number("used_peak")?,
            })
        })();
        let figures = OutOfMemory {
            requested: number("requested"),
            free: number("free"),
            total: number("total"),
            ..OutOfMemory::new()
        };
        let ended = match fields.get("outcome") {
            None => None,
            Some(outcome) => Some(Ended::parse(
                outcome,
                message.unwrap_or_default().to_owned(),
                figures,
            )?),
        };
        Some(Report {
            batch_size: fields.get("batch_size")?.parse().ok()?,
            start,
            start_own,
            used,
            ended,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_reads_back_as_written() {
        let start = Some(HostLimit {
            kind: HostLimitKind::AddressSpace,
            total: 700 << 20,
            in_use: 90 << 20,
            own: 90 << 20,
        });
        let outcomes = [
            None,
            Some(Ended::Fit),
            Some(Ended::OutOfMemory {
                message: "CUDA out of memory.\nmessage\nsecond line".to_owned(),
                figures: OutOfMemory::new().with_requested(4096).with_free(10),
            }),
            Some(Ended::Failed {
                message: String::new(),
            }),
            Some(Ended::Panicking {
                message: "corrupt record 17".to_owned(),
                out_of_memory: false,
            }),
        ];
        for ended in outcomes {
            let report = Report {
                batch_size: 64,
                start,
                start_own: Some(Own {
                    virtual_size: 90 << 20,
                    resident: 20 << 20,
                    data: 30 << 20,
                    resident_anonymous: 10 << 20,
                }),
                used: Some(Used {
                    room: 600 << 20,
                    held: 10 << 20,
                    peak: 500 << 20,
                }),
                ended,
            };
            assert_eq!(Report::parse(&report.to_text()), Some(report));
        }
        assert_eq!(Report::parse("running 1 test\n"), None);
    }
}
