//! cubecl 0.11's dry run under burn 0.22 (feature `burn`): a tuner's trial measured with no
//! device memory spent and no out-of-memory ([`Tuner::with_dry_run`](crate::Tuner::with_dry_run)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn_tensor::Device;
use cubecl_runtime::dry_run::DryRun as CubeclDryRun;

use super::{BurnMemory, MemoryBackend};
use crate::memory::DryRun;

/// burn's device under cubecl's dry run (`cubecl_runtime::dry_run::DryRun`, process-wide while
/// it lasts): each launch is compiled and dropped, and the memory manager still carves the
/// pages the step's allocations take, unmapped. The step's peak is read from
/// `Device::memory_pool_report()` (each pool's `pages_peak` times its page size).
///
/// # What the peak counts
/// cubecl keeps each pool's page peak for the process, with no reset, and its pages only grow
/// (a pool per page size, sized to the largest allocation served). A dry run's peak is
/// therefore counted pool by pool: a pool that is new, or whose peak rose, counts its peak; one
/// whose peak did not rise counts the pages it held (before or after, the larger): a size run
/// after a larger one would read the larger one's pages, which is why the tuner dry-runs sizes
/// increasing. The cleanup after each dry run moves live allocations (the weights) into the
/// newest, largest pages, which a fresh process at that size would not: the peak counts their
/// page at that size, an overestimate (see docs/BENCHMARKS.md). The pages the pools hold at the end, before the cleanup, are a floor. Only the
/// pools that carve pages are reported by burn: the zero-sized allocations' pool, the
/// persistent and dedicated ones are not counted (the margin covers them).
///
/// # The budget
/// burn reads no device total: as for [`BurnMemory`], the host's memory (Mesa's llvmpipe, burn's
/// CPU backends: the tightest of `RLIMIT_AS`, the cgroup and physical memory), or the bytes
/// given with [`with_total`](Self::with_total). The budget is what is free plus what the pools
/// hold now, which the step reuses.
///
/// ```ignore
/// let tuned = Tuner::new()
///     .with_release(Release::burn(&device))
///     .with_dry_run(BurnDryRun::new(&device))
///     .run(|batch_size| step(&device, batch_size))?;
/// ```
#[derive(Debug, Clone)]
pub struct BurnDryRun {
    device: Device,
    memory: Arc<BurnMemory>,
    dry_runs: Arc<AtomicUsize>,
}

impl BurnDryRun {
    /// Dry runs on `device`, on the host's memory.
    pub fn new(device: &Device) -> Self {
        BurnDryRun {
            device: device.clone(),
            memory: Arc::new(BurnMemory::new(device)),
            dry_runs: Arc::default(),
        }
    }

    /// The device's bytes, for a GPU (burn reads no total).
    pub fn with_total(self, bytes: u64) -> Self {
        BurnDryRun {
            memory: Arc::new(BurnMemory::new(&self.device).with_total(bytes)),
            ..self
        }
    }

    /// How many dry runs this value (and its clones) ran.
    pub fn dry_runs(&self) -> usize {
        self.dry_runs.load(Ordering::Relaxed)
    }

    /// Each pool's page size, pages held and page peak.
    fn pools(&self) -> Option<Vec<(u64, u64, u64)>> {
        let pools = self.device.memory_pool_report()?;
        Some(
            pools
                .iter()
                .map(|pool| (pool.page_size, pool.pages, pool.pages_peak))
                .collect(),
        )
    }
}

/// The bytes a dry run's pools held at their peak, from the pools before and after it.
fn dry_peak(before: &[(u64, u64, u64)], after: &[(u64, u64, u64)]) -> u64 {
    let before: HashMap<u64, (u64, u64)> = before
        .iter()
        .map(|&(size, pages, peak)| (size, (pages, peak)))
        .collect();
    let mut seen = Vec::new();
    let mut bytes = 0u64;
    for &(size, pages, peak) in after {
        seen.push(size);
        let counted = match before.get(&size) {
            Some(&(_, old_peak)) if peak > old_peak => peak,
            Some(&(old_pages, _)) => old_pages.max(pages),
            None => peak,
        };
        bytes = bytes.saturating_add(counted.saturating_mul(size));
    }
    // Pools a growth left behind that drained during the step held their pages at its start.
    for (size, (pages, _)) in &before {
        if !seen.contains(size) {
            bytes = bytes.saturating_add(pages.saturating_mul(*size));
        }
    }
    bytes
}

impl DryRun for BurnDryRun {
    fn measure(&self, step: &mut dyn FnMut()) -> Option<u64> {
        self.dry_runs.fetch_add(1, Ordering::Relaxed);
        let before = self.pools()?;
        let held_at_end = {
            let _dry_run = CubeclDryRun::new();
            step();
            // The launches reach the device thread's memory manager before the report is read.
            if let Err(error) = self.device.sync() {
                tracing::debug!(%error, "burn's Device::sync after a dry run");
            }
            self.device
                .memory_pool_usage()
                .map(|usage| usage.bytes_reserved)
        };
        let after = self.pools();
        // The dry run's pages go back (unmapped: nothing to free but the bookkeeping). Without
        // it, the next dry run counts them, held in the pools a growth left behind. (Leaving
        // the last dry run's pages for the real trial to map made that trial run out of memory
        // on llvmpipe, a size that ran after this cleanup.)
        self.device.memory_cleanup();
        let peak = dry_peak(&before, &after?);
        Some(peak.max(held_at_end.unwrap_or(0)))
    }

    fn budget(&self) -> Option<u64> {
        let snapshot = self.memory.memory();
        let device = snapshot.devices.first()?;
        Some(
            device
                .free
                .saturating_add(device.pool_reserved.unwrap_or(0)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::dry_peak;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_new_pool_counts_its_peak_and_a_stale_one_its_pages() {
        // Before: small pool (8 MiB, 1 page), a 65 MiB pool holding the weights with a stale
        // peak of 2. The step grows a 101 MiB pool to 2 pages.
        let before = [(8 * MIB, 1, 1), (65 * MIB, 1, 2)];
        let after = [(8 * MIB, 1, 1), (101 * MIB, 2, 2), (65 * MIB, 1, 2)];
        assert_eq!(dry_peak(&before, &after), (8 + 202 + 65) * MIB);

        // A pool whose peak rose counts it; a drained one, the pages it held.
        let after = [(8 * MIB, 1, 3)];
        assert_eq!(dry_peak(&before, &after), (24 + 65) * MIB);
    }
}
