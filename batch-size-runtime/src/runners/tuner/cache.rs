//! The tuner's cache entry: read before the trials and judged by the tuner's own range, so
//! that nothing read from outside steers it; written after them under a key that names the
//! memory the trials ran in.
//!
//! A rerun starts from the size the entry kept. Where the run that wrote it ended its search
//! (the usual case), that size is the answer in one trial; where its budget ended the search
//! while a larger size was left to try, or the device has clearly more room now, the rerun
//! spends its trials growing from it. A cached size that fails is not trusted: the search starts
//! at `min`, as a first run does.

use crate::memory::Release;
use crate::policy::{CacheEntry, CacheSettings, CacheSlot};
use crate::record::CacheHit;

use super::search::CachedStart;
use super::Choice;

/// The runner's name in the entry's key.
const LABEL: &str = "tuner";

/// What the tuner read of its cache, and where it writes what it found.
#[derive(Debug)]
pub(super) struct TunerCache {
    settings: CacheSettings,
    what: String,
    /// The slot under the key of the memory read before the first trial.
    slot: CacheSlot,
    /// Whether that memory named no device (a child trial's figures come with its first
    /// trial): the entry is then also written under the key of the memory the trials ran in.
    memory_unknown_at_start: bool,
    /// The entry the rerun starts from, where one is usable.
    entry: Option<CacheEntry>,
    start: Option<CachedStart>,
    /// Free bytes on the device before the trials (after the release, where an entry is used).
    free_at_start: u64,
}

/// The tuner's range, `min..=max`: never above `with_max`, nor above what the device holds at
/// a byte a sample where its total is known, nor above what any address space holds
/// (`isize::MAX` bytes). A size outside it was not written by a tuner with these settings.
#[derive(Debug, Clone, Copy)]
pub(super) struct Range {
    pub(super) min: usize,
    pub(super) max: Option<usize>,
}

impl Range {
    fn highest(&self, device_total: Option<u64>) -> usize {
        let by_device = device_total
            .filter(|&total| total > 0)
            .map_or(usize::MAX, |total| {
                usize::try_from(total).unwrap_or(usize::MAX)
            });
        let by_address_space = usize::try_from(isize::MAX).unwrap_or(usize::MAX);
        self.max
            .unwrap_or(usize::MAX)
            .min(by_device)
            .min(by_address_space)
    }

    /// Why `entry` cannot steer the tuner: a size outside the range, or sizes the tuner never
    /// writes together (what it kept above the largest that ran).
    fn refuses(&self, entry: &CacheEntry, device_total: Option<u64>) -> Option<String> {
        let highest = self.highest(device_total);
        let outside = |size: usize| !(self.min.max(1)..=highest).contains(&size);
        if outside(entry.fits) {
            return Some(format!(
                "its size {} is outside the tuner's range {}..={highest}",
                entry.fits,
                self.min.max(1)
            ));
        }
        let above = [entry.largest, entry.largest_fit]
            .into_iter()
            .flatten()
            .find(|&size| outside(size) || size < entry.fits);
        if let Some(size) = above {
            return Some(format!(
                "its largest size {size} is outside the tuner's range {}..={highest} or below \
                 the size it kept, {}",
                self.min.max(1),
                entry.fits
            ));
        }
        if entry
            .largest
            .zip(entry.largest_fit)
            .is_some_and(|(largest, fit)| largest > fit)
        {
            return Some("it keeps a size above the largest that ran".to_owned());
        }
        let ran = entry.largest_fit.unwrap_or(entry.fits).max(entry.fits);
        match entry.failed_at {
            Some(failed) if failed <= ran || outside(failed) => Some(format!(
                "its failed size {failed} is not above the largest size that ran, {ran}, or is \
                 outside the tuner's range"
            )),
            _ => None,
        }
    }
}

/// What the run found, for its entry.
#[derive(Debug)]
pub(super) struct Found {
    /// The size returned.
    pub(super) batch_size: usize,
    pub(super) largest: usize,
    pub(super) largest_fit: usize,
    /// The smallest size that failed above the size returned, in this run.
    pub(super) failed_above: Option<usize>,
    pub(super) unfinished: bool,
}

impl TunerCache {
    /// The entry of the tuner's search (`min` is its `starting`, as the key has always said;
    /// the fastest size is another answer than the largest: another entry), judged by `range`.
    pub(super) fn open(
        settings: &CacheSettings,
        choice: Choice,
        range: Range,
        release: &Release,
    ) -> Self {
        let mut settings = settings.clone();
        if choice == Choice::Fastest {
            settings.key = format!("{} | fastest", settings.key);
        }
        let what = format!("starting {}", range.min);
        let memory = release.memory_backend().memory();
        let device_total = memory.devices.first().map(|device| device.total);
        let slot = CacheSlot::open(&settings, LABEL, &what, release, |entry| {
            range.refuses(entry, device_total)
        });
        let mut free_at_start = memory.free();
        let entry = slot.entry().cloned();
        if entry.is_some() {
            // The cached size was measured with nothing held for this search: give back what
            // a pool kept from earlier work (a tuning just before, say).
            match release.release() {
                Ok(()) => free_at_start = release.memory_backend().memory().free(),
                Err(error) => {
                    tracing::warn!(%error, "could not release device memory before the cached size")
                }
            }
        }
        let start = entry.as_ref().map(|entry| {
            // Clearly more room than when it was written: a size that failed then may fit.
            let more_room = entry.free_when_written > 0
                && free_at_start as f64 >= entry.free_when_written as f64 * 1.1;
            let grow = entry.unfinished || more_room;
            let size = match choice {
                // Grown from the largest found, not from the fastest below it.
                Choice::Fastest if grow => entry.largest.unwrap_or(entry.fits),
                _ => entry.fits,
            };
            tracing::info!(
                function = LABEL,
                batch_size = size,
                grow,
                "starting from the cached size{}",
                if grow { ", growing from it" } else { "" }
            );
            CachedStart {
                size,
                grow,
                failed_at: entry.failed_at.filter(|_| !more_room),
            }
        });
        TunerCache {
            settings,
            what,
            slot,
            memory_unknown_at_start: memory.is_empty(),
            entry,
            start,
            free_at_start,
        }
    }

    /// Where the rerun starts, if it does.
    pub(super) fn start(&self) -> Option<CachedStart> {
        self.start
    }

    /// For the search's report: the size the rerun runs first and what its entry says, where
    /// that size is the answer when it runs (the search did not have to grow).
    pub(super) fn offer(&self) -> Option<(usize, CacheHit)> {
        let start = self.start.filter(|start| !start.grow)?;
        let entry = self.entry.as_ref()?;
        Some((
            start.size,
            CacheHit {
                largest_fit: entry.largest_fit,
            },
        ))
    }

    /// The entry a rerun served in one trial: what the run that wrote it reported.
    pub(super) fn served(&self) -> Option<&CacheEntry> {
        self.entry.as_ref()
    }

    /// Writes what the run found, under the key it was read with and, where the memory was
    /// unknown before the first trial, under the key of the memory the trials ran in (the
    /// first key is what the next run can read before its first trial).
    pub(super) fn remember(mut self, found: &Found, release: &Release) {
        let earlier_failure = self
            .start
            .and_then(|start| start.failed_at)
            .filter(|&failed| failed > found.batch_size);
        let failed_at = match (found.failed_above, earlier_failure) {
            (Some(now), Some(before)) => Some(now.min(before)),
            (now, before) => now.or(before),
        }
        .filter(|&failed| failed > found.batch_size);
        let free = self.free_at_start;
        let fill = |blank: CacheEntry| CacheEntry {
            fits: found.batch_size,
            largest_fit: Some(found.largest_fit.max(found.largest).max(found.batch_size)),
            largest: Some(found.largest.max(found.batch_size)),
            failed_at,
            free_when_written: free,
            unfinished: found.unfinished,
            ..blank
        };
        tracing::debug!(
            function = LABEL,
            fits = found.batch_size,
            ?failed_at,
            unfinished = found.unfinished,
            "batch size cached"
        );
        if self.memory_unknown_at_start {
            let mut ran_in = CacheSlot::open(&self.settings, LABEL, &self.what, release, |_| None);
            ran_in.write_own(fill);
        }
        self.slot.write_own(fill);
    }
}
