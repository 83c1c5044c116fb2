//! Remembering what fit, so that a rerun does not fail again: off by default, on with a key you
//! choose (`with_cache(key)`, `cache = KEY`).
//!
//! The entry's key joins your key with the function's path, the `starting` value, and the
//! device's name and total memory (from the release backend): stable across runs, unlike a call
//! stack or the free memory. In the process it is always kept; on disk when a folder is named
//! (`with_cache_dir`, `cache_dir = ...`, or the `BATCH_SIZE_CACHE_DIR` environment variable),
//! one JSON file an entry, written atomically (a temporary file, then a rename), so several
//! processes may share the folder.
//!
//! An entry keeps the size that fit, the smallest size that failed, and the free memory when it
//! was written. A later search starts at the size that fit (one attempt when it still fits);
//! if that runs out of memory the search goes on downward and the entry is updated. When the
//! device has at least 10 % more free memory than when the entry was written, the search starts
//! again from `starting`, so that a size that failed then may fit now.
//!
//! A missing file is a first run. A cached size is used only when it lies in `1..=starting`
//! and the entry is this search's (the same key, so the same device): a size of 0, one larger
//! than `starting`, a negative or fractional number, an entry of another device, a corrupt,
//! truncated or unreadable file, or a folder that cannot be read or written (a file in its place,
//! a path under a file) is ignored and the search starts at `starting`. Whatever went wrong, a
//! search gives at most one WARN about its cache: the cache never fails or steers a search.
//!
//! ```
//! use batch_size_runtime::{last_report, BatchSizeSearch, OutOfMemory};
//!
//! let train = || -> anyhow::Result<usize> {
//!     BatchSizeSearch::new(256)
//!         .with_cache("doc-example")
//!         .run(|batch_size| {
//!             if batch_size > 100 { Err(OutOfMemory::new())? }
//!             Ok(batch_size)
//!         })
//! };
//! assert_eq!(train()?, 64);
//! assert_eq!(last_report().unwrap().len(), 3); // 256, 128, 64
//! assert_eq!(train()?, 64);
//! assert_eq!(last_report().unwrap().len(), 1); // from the cache: one attempt
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::memory::{MemorySnapshot, Release};
use crate::policy::LadderControl;
use crate::policy::{grown_size, growth_shown, measured_step, reached_by_failures, StepFigures};
use crate::policy::{holds_inner, Decision, GrowRule, PolicyWrapper, SizePolicy};
use crate::record::{CacheHit, Outcome, SearchReport};

/// The environment variable that names the cache's folder when none is given.
pub const CACHE_DIR_VARIABLE: &str = "BATCH_SIZE_CACHE_DIR";

/// What is remembered of one search. More may be remembered later: it is read, not built.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheEntry {
    /// The whole key (also the check that the file is this entry's).
    pub key: String,
    /// The size that fit last: the size a search returned (a tuner's, with its margin).
    pub fits: usize,
    /// The largest size that ran, when it was above `fits` (a tuner's, before its margin);
    /// absent in entries written before it was kept.
    #[serde(default)]
    pub largest_fit: Option<usize>,
    /// A tuner's [`largest()`](crate::Tuned::largest): the size it kept below the largest that
    /// ran, with its headroom, and confirmed; absent for other searches and in entries written
    /// before it was kept. A rerun reports it as the first run did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest: Option<usize>,
    /// The smallest size that ran out of memory, if one did.
    pub failed_at: Option<usize>,
    /// Free bytes on the device when the entry was written (0 where unknown).
    pub free_when_written: u64,
    /// With [`Remedies`](crate::remedies::Remedies): the level of each declared remedy when the size fit
    /// (`null`: not in force; 1 for a switch; a knob's value), restored with the size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remedies: Option<Vec<Option<usize>>>,
    /// What the step needed at `fits`: its own peak (bytes), where the search read it (a
    /// release with figures). A rerun starts at the size it and [`room`](Self::room) give.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_at_fits: Option<u64>,
    /// The bytes the step could use when `peak_at_fits` was read: the device's total less what
    /// was in use before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<u64>,
    /// Another step measured in the same search, at another size: `(size, own peak)`. With the
    /// peak at `fits` it gives the step's line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_step: Option<(usize, u64)>,
    /// A failure above `fits` and the bytes it had reached of its own, `(size, bytes)`: the one
    /// that reached the most for its size. It tells a step that grows faster than a line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reached: Option<(usize, u64)>,
    /// A tuner's search that its budget ended while it had a larger size to try: a rerun grows
    /// from `fits` with the trials it is given, rather than stopping there.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unfinished: bool,
    /// The size that fit was reached by growing after a step ([`step_done`](crate::step_done)):
    /// a shrinking search serves it above its starting size, which it could not reach
    /// otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grown: bool,
}

impl CacheEntry {
    /// Why the entry's fields cannot all be true together (a damaged or forged file): no search
    /// writes a failure at or below a size that ran, nor a peak above the room it ran in.
    fn inconsistency(&self) -> Option<String> {
        let failed = self.failed_at.unwrap_or(usize::MAX);
        let why = if self.fits == 0 {
            "its size is 0"
        } else if failed <= self.fits {
            "its failed size is not above its size"
        } else if self.largest_fit.is_some_and(|largest| largest < self.fits) {
            "its largest size is below its size"
        } else if self
            .other_step
            .is_some_and(|(size, peak)| size == 0 || peak == 0)
        {
            "its other measured step is empty"
        } else if self
            .failure_reached
            .is_some_and(|(size, _)| size <= self.fits)
        {
            "its failure's size is not above its size"
        } else if self
            .room
            .zip(self.peak_at_fits)
            .is_some_and(|(room, peak)| peak > room || room == 0)
        {
            "its peak is above its room"
        } else {
            return None;
        };
        Some(why.to_owned())
    }
}

/// The entries kept in this process, each with the thread whose search wrote it.
static IN_PROCESS: Mutex<Option<HashMap<String, (std::thread::ThreadId, CacheEntry)>>> =
    Mutex::new(None);

/// Forgets the entries this thread's searches kept in the process (the files on disk stay), as
/// a new process would find them; other threads' entries stay, so that searches running beside
/// it (tests in one binary) keep theirs.
///
/// ```
/// batch_size_runtime::policy::clear_process_cache();
/// ```
pub fn clear_process_cache() {
    let this_thread = std::thread::current().id();
    let mut entries = IN_PROCESS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(entries) = entries.as_mut() {
        entries.retain(|_, (writer, _)| *writer != this_thread);
    }
}

/// Where a search's entry lives.
#[derive(Debug, Clone)]
pub(crate) struct CacheSettings {
    pub(crate) key: String,
    pub(crate) dir: Option<PathBuf>,
}

/// One search's view of the cache, as a policy around the search's own: the cached size first,
/// accepted once it ran, and what fit remembered in its [`CacheSlot`].
pub(crate) struct Cached<P> {
    inner: P,
    slot: CacheSlot,
    label: &'static str,
    /// The first attempt is the cached size.
    from_cache: bool,
    /// The remedies the search may apply, whose levels are kept with the size.
    remedies: Option<Arc<dyn LadderControl>>,
    /// Set when the search ran the cached size and returned it.
    hit: Option<CacheHit>,
    /// Where the entry kept what the step needed: the size its figures give in the room there
    /// is now, above the size that fit, where the search starts instead.
    figures_start: Option<usize>,
    /// Why the latest decision was the wrapper's own.
    rationale: Option<String>,
}

impl<P: fmt::Debug> fmt::Debug for Cached<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cached")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// The whole key of an entry: the user's key, the runner, what it runs, and the device's name
/// and total memory (another device is another entry).
fn entry_key(user_key: &str, label: &str, what: &str, memory: &MemorySnapshot) -> String {
    let (device, total) = memory
        .devices
        .first()
        .map_or(("none".to_owned(), 0), |device| {
            (device.device.clone(), device.total)
        });
    format!("{user_key} | {label} | {what} | {device} with {total} bytes")
}

/// Where an entry's file lives: the folder given, else the environment's, else nowhere.
fn entry_file(dir: Option<PathBuf>, key: &str) -> Option<PathBuf> {
    dir.or_else(|| std::env::var_os(CACHE_DIR_VARIABLE).map(PathBuf::from))
        .map(|dir| dir.join(file_name(key)))
}

/// The entry for `key`: this process's, else the file's; `warn` is told why a file is unusable.
fn load(key: &str, file: Option<&Path>, warn: &mut impl FnMut(&Path, &str)) -> Option<CacheEntry> {
    let in_process = {
        let entries = IN_PROCESS.lock().unwrap_or_else(PoisonError::into_inner);
        entries
            .as_ref()
            .and_then(|entries| entries.get(key).map(|(_, entry)| entry.clone()))
    };
    match (in_process, file) {
        (Some(entry), _) => Some(entry),
        (None, Some(file)) => read_entry(file, key).unwrap_or_else(|why| {
            warn(file, &why);
            None
        }),
        (None, None) => None,
    }
}

/// Keeps `entry` in this process and, where a file is named, on disk (one WARN a search if it
/// cannot be written).
fn store(file: Option<&Path>, entry: &CacheEntry, warned: &mut bool) {
    {
        let mut entries = IN_PROCESS.lock().unwrap_or_else(PoisonError::into_inner);
        entries.get_or_insert_with(HashMap::new).insert(
            entry.key.clone(),
            (std::thread::current().id(), entry.clone()),
        );
    }
    if let Some(file) = file {
        if let Err(error) = write_entry(file, entry) {
            if !std::mem::replace(warned, true) {
                tracing::warn!(file = %file.display(), %error, "the batch size cache could not be written; the search's result is kept in this process only");
            }
        }
    }
}

/// One entry of the cache, the one mechanism every runner uses: its key (the user's key, the
/// runner, what it runs, the device), its file, what it holds, and the device's free memory
/// when it was opened. [`Cached`] holds one for a search (`BatchSizeSearch`, the tuner);
/// [`EffectiveBatch`](crate::EffectiveBatch) and [`Chunked`](crate::Chunked) hold one for the
/// size their searches settled on, so that a run resumed from its checkpoint starts there. It
/// is its holder's own value: nothing is shared with a policy.
#[derive(Debug)]
pub(crate) struct CacheSlot {
    key: String,
    file: Option<PathBuf>,
    entry: Option<CacheEntry>,
    free_now: u64,
    /// This holder gave its WARN about the cache already: one is enough, whatever else fails.
    warned: bool,
}

impl CacheSlot {
    /// The entry of `label` running `what` on the device `release` reads; an entry `unusable`
    /// refuses (saying why) is ignored, with a WARN that the holder `starts_at` its own size.
    pub(crate) fn open(
        settings: &CacheSettings,
        label: &str,
        what: &str,
        release: &Release,
        unusable: impl Fn(&CacheEntry) -> Option<String>,
    ) -> Self {
        let memory = release.memory_backend().memory();
        let key = entry_key(&settings.key, label, what, &memory);
        let file = entry_file(settings.dir.clone(), &key);
        let mut warned = false;
        let mut warn = |file: &Path, why: &str| {
            if !std::mem::replace(&mut warned, true) {
                tracing::warn!(file = %file.display(), reason = why, "the batch size cache is ignored: the search starts at its starting size");
            }
        };
        let entry = load(&key, file.as_deref(), &mut warn).filter(|entry| {
            match entry.inconsistency().or_else(|| unusable(entry)) {
                Some(why) => {
                    warn(
                        file.as_deref().unwrap_or(Path::new("(in this process)")),
                        &why,
                    );
                    false
                }
                None => true,
            }
        });
        CacheSlot {
            key,
            file,
            entry,
            free_now: memory.free(),
            warned,
        }
    }

    /// The entry of a runner of many searches (`label` running `what`, its work's size).
    pub(crate) fn for_runner(
        settings: &CacheSettings,
        label: &str,
        what: &str,
        release: &Release,
    ) -> Self {
        let slot = CacheSlot::open(settings, label, what, release, |_| None);
        if let Some(fits) = slot.fits() {
            tracing::info!(
                function = label,
                batch_size = fits,
                "starting from the cached size"
            );
        }
        slot
    }

    /// The size the last run settled on, if one was remembered.
    pub(crate) fn fits(&self) -> Option<usize> {
        self.entry.as_ref().map(|entry| entry.fits)
    }

    /// The smallest size above [`fits`](Self::fits) that ran out of memory in the run that wrote
    /// the entry: a resumed run holds growth back below it, as that run did.
    pub(crate) fn failed_at(&self) -> Option<usize> {
        self.entry.as_ref().and_then(|entry| entry.failed_at)
    }

    /// Writes `entry` where it differs from what the slot holds.
    fn write(&mut self, entry: CacheEntry) {
        if self.entry.as_ref() == Some(&entry) {
            return;
        }
        store(self.file.as_deref(), &entry, &mut self.warned);
        self.entry = Some(entry);
    }

    /// A runner's result: `fits` (and the smallest size above it that failed), where it changed.
    pub(crate) fn remember(&mut self, fits: usize, failed_at: Option<usize>) {
        let failed_at = failed_at.filter(|&failed| failed > fits);
        self.write_own(|blank| CacheEntry {
            fits,
            failed_at,
            ..blank
        });
    }

    /// The entry read, for a runner that judges and writes its own (the tuner).
    pub(crate) fn entry(&self) -> Option<&CacheEntry> {
        self.entry.as_ref()
    }

    /// Writes a runner's own entry: `fill` completes one that holds the slot's key only.
    pub(crate) fn write_own(&mut self, fill: impl FnOnce(CacheEntry) -> CacheEntry) {
        let blank = CacheEntry {
            key: self.key.clone(),
            fits: 0,
            largest_fit: None,
            largest: None,
            failed_at: None,
            free_when_written: self.free_now,
            remedies: None,
            peak_at_fits: None,
            room: None,
            other_step: None,
            failure_reached: None,
            unfinished: false,
            grown: false,
        };
        let entry = CacheEntry {
            key: self.key.clone(),
            ..fill(blank)
        };
        self.write(entry);
    }
}

/// FNV-1a: a stable file name for a key (not for security).
fn file_name(key: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("batch-size-{hash:016x}.json")
}

/// The entry in `file` for `key`: `Ok(None)` for a first run (no file), `Err(why)` for a file
/// that cannot be used.
fn read_entry(file: &Path, key: &str) -> Result<Option<CacheEntry>, String> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(format!("it could not be read: {error}")),
    };
    match serde_json::from_str::<CacheEntry>(&text) {
        Ok(entry) if entry.key == key => Ok(Some(entry)),
        // Another search's entry (another device, another `starting`) under the same name: a
        // copied folder, or a file edited by hand.
        Ok(entry) => Err(format!(
            "it holds the entry of another search or device (\"{}\")",
            entry.key
        )),
        Err(error) => Err(format!("it is not a valid entry: {error}")),
    }
}

/// How far above its starting size a shrinking search that grows after its steps
/// ([`step_done`](crate::step_done)) is taken to reach, where no `max` says: three growths of a
/// small step. A cached size further above was not this search's.
const GROWN_REACH: usize = 16;

/// Why a cached size cannot start this search: only a size the search could have reached itself
/// is used, so that nothing read from outside steers it out of its range. A shrinking search
/// tries `min..=starting`, and where the entry says it grew (`grown`) up to `max` (or [`GROWN_REACH`] times
/// `starting`); a growing one (a tuner) starts at `starting`, its smallest size, and goes up.
fn unusable(
    entry: &CacheEntry,
    starting: usize,
    (min, max): (usize, Option<usize>),
    shrinking: bool,
) -> Option<String> {
    let (low, high) = if shrinking {
        // Above `starting` only a size its growth reached, and no further than growth goes.
        let grown = match entry.grown {
            true => max.unwrap_or_else(|| starting.saturating_mul(GROWN_REACH)),
            false => starting,
        };
        (min.max(1), grown.max(starting))
    } else {
        (starting.max(min).max(1), usize::MAX)
    };
    (!(low..=high).contains(&entry.fits)).then(|| {
        if shrinking {
            format!(
                "its size {} is not between the search's `min` {low} and {high}, the most it reaches \
                 from {starting}",
                entry.fits
            )
        } else {
            format!(
                "its size {} is below the search's smallest size {low}",
                entry.fits
            )
        }
    })
}

fn write_entry(file: &Path, entry: &CacheEntry) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let Some(dir) = file.parent() else {
        return Ok(());
    };
    (|| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let text = serde_json::to_string_pretty(entry).map_err(std::io::Error::other)?;
        // Written whole under a name of this process's own, then renamed over the entry: a
        // reader sees the old entry or the new one, never half of one.
        let temporary = dir.join(format!(
            ".{}.{}.{}.tmp",
            file.file_name()
                .map_or_else(Default::default, |name| name.to_string_lossy()),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&temporary, text)?;
        std::fs::rename(&temporary, file).inspect_err(|_| {
            let _ = std::fs::remove_file(&temporary);
        })
    })()
}

impl<P: SizePolicy> Cached<P> {
    /// The cache around `inner`, for a search of `label` from `starting` (no size below `min`,
    /// none above `max` where it is set), over the device `release` reads.
    pub(crate) fn new(
        inner: P,
        settings: CacheSettings,
        label: &'static str,
        starting: usize,
        (min, max): (usize, Option<usize>),
        release: &Release,
        remedies: Option<Arc<dyn LadderControl>>,
    ) -> Self {
        let mut what = format!("starting {starting}");
        if let Some(remedies) = &remedies {
            // Another list of remedies is another search: its levels would mean other things.
            what.push_str(&format!(" | remedies {}", remedies.names()));
        }
        let shrinking = inner.accepts_every_success();
        let mut slot = CacheSlot::open(&settings, label, &what, release, |entry| {
            unusable(entry, starting, (min, max), shrinking)
        });
        if slot.entry.is_some() {
            // The cached size was measured on a device with nothing held for this search: give
            // back what a pool kept from the last search (a tuning just before, say) so that the
            // size that ran then runs now.
            match release.release() {
                Ok(()) => slot.free_now = release.memory_backend().memory().free(),
                Err(error) => {
                    tracing::warn!(%error, "could not release device memory before the cached size")
                }
            }
        }
        let mut cached = Cached {
            inner,
            slot,
            label,
            hit: None,
            from_cache: false,
            remedies,
            figures_start: None,
            rationale: None,
        };
        // Decided here, once, with the remedies restored: the search's first size is the
        // cached one, and the engine knows it before the first attempt (`offer`).
        if let Some(entry) = cached.slot.entry.clone() {
            cached.from_cache = !cached.more_room(&entry) && cached.restore_remedies(&entry);
            if cached.from_cache && shrinking {
                cached.figures_start = figures_start(&entry, cached.slot.free_now, starting);
            }
        }
        cached
    }

    /// The cached size the search starts from, and what its entry says, where it does: the
    /// search was served from the cache if that size ran, first and alone.
    pub(crate) fn offer(&self) -> Option<(usize, CacheHit)> {
        let entry = self.slot.entry.as_ref().filter(|_| self.from_cache)?;
        Some((
            self.figures_start.unwrap_or(entry.fits),
            CacheHit {
                largest_fit: entry.largest_fit,
            },
        ))
    }

    /// Whether the device has clearly more room than when the entry was written.
    fn more_room(&self, entry: &CacheEntry) -> bool {
        entry.free_when_written > 0
            && self.slot.free_now as f64 >= entry.free_when_written as f64 * 1.1
    }

    fn remember(&mut self, history: &SearchReport) {
        let Some(fits) = history.batch_size() else {
            return;
        };
        let earlier = self
            .slot
            .entry
            .as_ref()
            .filter(|entry| !self.more_room(entry));
        let earlier_failure = earlier.and_then(|entry| entry.failed_at);
        // With remedies, only the failures under the settings that fit bound the size.
        let failed_now = if self.remedies.is_some() {
            history
                .under_final_remedies()
                .filter(|a| a.outcome.is_out_of_memory())
                .map(|a| a.batch_size)
                .min()
        } else {
            history.smallest_out_of_memory()
        };
        let failed_at = match (failed_now, earlier_failure) {
            (Some(now), Some(before)) => Some(now.min(before)),
            (now, before) => now.or(before),
        }
        .filter(|&failed| failed > fits);
        // A rerun from the cache runs `fits` only: the largest that ran when the entry was
        // written stays, unless something at or below it failed since.
        let earlier_largest = earlier
            .and_then(|entry| entry.largest_fit)
            .filter(|&largest| failed_at.is_none_or(|failed| largest < failed));
        let largest_fit = history
            .largest_success()
            .max(earlier_largest)
            .filter(|&largest| largest > fits);
        // A runner's own figure (the tuner's kept size) stays while the sizes it rests on do.
        let largest = earlier
            .filter(|entry| entry.fits == fits && entry.largest_fit == largest_fit)
            .and_then(|entry| entry.largest);
        let steps = steps_measured(history, fits, earlier, failed_at);
        let entry = CacheEntry {
            key: self.slot.key.clone(),
            fits,
            largest_fit,
            largest,
            failed_at,
            free_when_written: self.slot.free_now,
            remedies: self.remedies.as_ref().map(|remedies| remedies.levels()),
            peak_at_fits: steps.peak_at_fits,
            room: steps.room,
            other_step: steps.other_step,
            failure_reached: steps.failure_reached,
            unfinished: false,
            // Grown in this search, or started from an entry that was (whatever it ended at:
            // a size above `starting` is reached no other way).
            grown: history
                .attempts()
                .any(|attempt| matches!(attempt.outcome, Outcome::Grew { .. }))
                || earlier.is_some_and(|entry| entry.grown),
        };
        tracing::debug!(function = self.label, fits, ?failed_at, "batch size cached");
        self.slot.write(entry);
    }
}

/// The size a cached entry's figures give in `room_now`: the step's line where the entry keeps
/// two measured steps, else its peak at the size that fit grown as a line through it with a
/// fixed part of zero or more (as the batch squared where a kept failure reached more than such
/// a line does); at least a few percent above the size that fit, below the size that failed there by
/// the estimate's margin, and never above `starting`. `None` where the figures give nothing
/// larger, or are missing.
fn figures_start(entry: &CacheEntry, room_now: u64, starting: usize) -> Option<usize> {
    let room = entry.room?.min(room_now);
    let step = StepFigures::new(entry.fits, entry.peak_at_fits?, room);
    let other: Vec<StepFigures> = entry
        .other_step
        .map(|(size, peak)| StepFigures::new(size, peak, room))
        .into_iter()
        .collect();
    let ceiling = entry.failed_at.map_or(starting, |failed| {
        (failed as f64 * super::GROWN_KEEP) as usize
    });
    let exponent = growth_shown(&step, entry.failure_reached.as_slice());
    let size = grown_size(&step, &other, exponent)?
        .min(ceiling)
        .min(starting);
    (size as f64 >= entry.fits as f64 * 1.03 && size > entry.fits).then_some(size)
}

impl<P> Cached<P> {
    /// Puts the remedies in force that were when the entry's size fit (said at WARN: the
    /// settings differ from the caller's). False for levels that do not fit the declared
    /// remedies: the entry is not used.
    fn restore_remedies(&mut self, entry: &CacheEntry) -> bool {
        let (Some(remedies), Some(levels)) = (&self.remedies, &entry.remedies) else {
            return true;
        };
        if !remedies.restore(levels) {
            if !std::mem::replace(&mut self.slot.warned, true) {
                tracing::warn!(
                    function = self.label,
                    "the batch size cache is ignored: its remedies do not fit the ones declared"
                );
            }
            return false;
        }
        if let Some(settings) = remedies.describe() {
            tracing::warn!(
                function = self.label,
                settings = %settings,
                batch_size = entry.fits,
                "starting from the cached size with the remedies that fit then: {settings}"
            );
        }
        true
    }
}

impl<P: SizePolicy> PolicyWrapper for Cached<P> {
    holds_inner!(P);

    /// A success is remembered here before it is accepted: the engine must ask.
    fn accepts_every_success(&self) -> bool {
        false
    }

    fn first(&mut self, starting: usize) -> Decision {
        match self.slot.entry.as_ref().filter(|_| self.from_cache) {
            Some(entry) => match self.figures_start {
                Some(start) => {
                    tracing::info!(
                        function = self.label,
                        batch_size = start,
                        cached = entry.fits,
                        "starting from the size the cached step's figures give ({} fit)",
                        entry.fits
                    );
                    Decision::Try(start)
                }
                None => {
                    tracing::info!(
                        function = self.label,
                        batch_size = entry.fits,
                        "starting from the cached size"
                    );
                    Decision::Try(entry.fits)
                }
            },
            None => self.inner.first(starting),
        }
    }

    /// A shrinking policy accepts its first success: the figures the entry keeps are read once,
    /// after it, at the end of the search.
    fn reads_memory_after_success(&self) -> bool {
        self.inner.accepts_every_success() || self.inner.reads_memory_after_success()
    }

    fn rationale(&self) -> Option<String> {
        self.rationale.clone().or_else(|| self.inner.rationale())
    }

    /// Served from the cache, the size is what the entry measured in this room (its failures
    /// and growths included): a rerun does not grow again, and so never into a failure the
    /// entry remembers. Once a cached size failed, the room is not what the entry measured:
    /// the rerun goes on as a first run, growing included, as without an entry.
    fn grow_after_a_step(&self, history: &SearchReport) -> Option<GrowRule> {
        if self.from_cache && history.out_of_memory_count() == 0 {
            None
        } else {
            self.inner.grow_after_a_step(history)
        }
    }

    fn after(&mut self, history: &SearchReport) -> Decision {
        self.rationale = None;
        // The size the cached figures gave failed: back to the size that fit, one failure at
        // most; the entry then keeps that failure, and the next estimate stays below it.
        let first_failed = history.len() == 1
            && history
                .last()
                .is_some_and(|last| last.outcome.is_out_of_memory());
        if let (true, Some(start), Some(entry)) =
            (first_failed, self.figures_start, self.slot.entry.as_ref())
        {
            self.rationale = Some(format!(
                "batch size {start}, from the cached step's figures, ran out of memory: back to {}, the cached size",
                entry.fits
            ));
            return Decision::Try(entry.fits);
        }
        let success = history.last().is_some_and(|last| last.outcome.is_success());
        // The cached size ran: that is the answer, whatever the policy would explore (a tuner
        // reruns in one trial).
        let cached_and_ran = success && self.from_cache && history.len() == 1;
        let decision = if success && (self.inner.accepts_every_success() || cached_and_ran) {
            Decision::Accept
        } else {
            self.inner.after(history)
        };
        if decision == Decision::Accept {
            self.remember(history);
            if cached_and_ran {
                let largest_fit = self.slot.entry.as_ref().and_then(|entry| entry.largest_fit);
                self.hit = Some(CacheHit { largest_fit });
            }
        }
        decision
    }
}

/// What an entry keeps of the steps measured: the peak and the room of the step at the size
/// that fit, another step for the line, and the failure that reached the most for its size.
struct StepsMeasured {
    peak_at_fits: Option<u64>,
    room: Option<u64>,
    other_step: Option<(usize, u64)>,
    failure_reached: Option<(usize, u64)>,
}

/// What the step needed at `fits` (the success's figures, read after it), and another step
/// measured at another size for the line: a growth's in this search, else the `earlier`
/// entry's own measurement at the size that fit then (below `failed_at`).
fn steps_measured(
    history: &SearchReport,
    fits: usize,
    earlier: Option<&CacheEntry>,
    failed_at: Option<usize>,
) -> StepsMeasured {
    let measured = |attempt: &crate::record::Attempt| {
        measured_step(
            attempt.batch_size,
            attempt.memory_at_start.as_ref(),
            attempt.memory_at_end.as_ref(),
        )
    };
    let at_fits = history
        .last()
        .filter(|last| last.outcome.is_success() && last.batch_size == fits)
        .and_then(measured);
    let grown = history
        .attempts()
        .filter(|attempt| {
            matches!(attempt.outcome, Outcome::Grew { .. }) && attempt.batch_size != fits
        })
        .filter_map(measured)
        .max_by_key(|step| step.batch_size)
        .map(|step| (step.batch_size, step.peak));
    // The failure that reached the most for its size, this search's or the entry's.
    let failure_reached = reached_by_failures(history)
        .into_iter()
        .chain(earlier.and_then(|entry| entry.failure_reached))
        .filter(|&(failed, _)| failed > fits)
        .max_by(|a, b| (a.1 as f64 / a.0 as f64).total_cmp(&(b.1 as f64 / b.0 as f64)));
    let earlier_step = earlier
        .filter(|entry| entry.fits != fits && failed_at.is_none_or(|failed| entry.fits < failed))
        .and_then(|entry| Some((entry.fits, entry.peak_at_fits?)));
    StepsMeasured {
        peak_at_fits: at_fits.map(|step| step.peak),
        room: at_fits.map(|step| step.room),
        other_step: at_fits.and(grown.or(earlier_step)),
        failure_reached,
    }
}
