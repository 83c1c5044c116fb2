//! cubecl 0.11's dry run under burn 0.22 (feature `burn`): a tuner's trial measured with no
//! device memory spent and no out-of-memory ([`Tuner::with_dry_run`](crate::Tuner::with_dry_run)).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

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
/// therefore counted pool by pool: a pool that is new, or whose peak rose, counts its peak; a
/// pool held before the sizing's first dry run whose peak did not rise counts the pages it held
/// then; a size run after a larger one would read the larger one's pages, which is why the
/// tuner dry-runs sizes increasing. The cleanup after each dry run moves live allocations (the
/// weights) into the newest, largest pages, which a fresh process would not: a pool an earlier
/// dry run left, whose peak did not rise, counts nothing (its allocations are counted where
/// they were before the sizing). Only the pools that carve pages are reported by burn: the
/// zero-sized allocations' pool, the persistent and dedicated ones are not counted (the margin
/// covers them).
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
    /// The pools before the sizing's first dry run (cleared by [`DryRun::finish`]).
    start: Arc<Mutex<Option<Pools>>>,
}

/// Each pool's page size, pages held and page peak.
type Pools = Vec<(u64, u64, u64)>;

impl BurnDryRun {
    /// Dry runs on `device`, on the host's memory.
    pub fn new(device: &Device) -> Self {
        BurnDryRun {
            device: device.clone(),
            memory: Arc::new(BurnMemory::new(device)),
            dry_runs: Arc::default(),
            start: Arc::default(),
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
    fn pools(&self) -> Option<Pools> {
        let pools = self.device.memory_pool_report()?;
        Some(
            pools
                .iter()
                .map(|pool| (pool.page_size, pool.pages, pool.pages_peak))
                .collect(),
        )
    }
}

/// The bytes a dry run's pools held at their peak, from the pools at the sizing's start, before
/// this dry run and after it.
fn dry_peak(
    start: &[(u64, u64, u64)],
    before: &[(u64, u64, u64)],
    after: &[(u64, u64, u64)],
) -> u64 {
    let find = |pools: &[(u64, u64, u64)], size: u64| {
        pools
            .iter()
            .find(|pool| pool.0 == size)
            .map(|&(_, pages, peak)| (pages, peak))
    };
    let mut bytes = 0u64;
    for &(size, _, peak) in after {
        let raised = find(before, size).is_none_or(|(_, old_peak)| peak > old_peak);
        // A pool an earlier dry run made holds weights its cleanup moved, which `start` counts.
        let counted = match find(start, size) {
            _ if raised => peak,
            Some((pages, _)) => pages,
            None => 0,
        };
        bytes = bytes.saturating_add(counted.saturating_mul(size));
    }
    // Pools held before the sizing that a growth drained: their pages at the start.
    for &(size, pages, _) in start {
        if find(after, size).is_none() {
            bytes = bytes.saturating_add(pages.saturating_mul(size));
        }
    }
    bytes
}

impl DryRun for BurnDryRun {
    fn measure(&self, step: &mut dyn FnMut()) -> Option<u64> {
        self.dry_runs.fetch_add(1, Ordering::Relaxed);
        let before = self.pools()?;
        let start = self
            .start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| before.clone())
            .clone();
        {
            let _dry_run = CubeclDryRun::new();
            step();
            // The launches reach the device thread's memory manager before the report is read.
            if let Err(error) = self.device.sync() {
                tracing::debug!(%error, "burn's Device::sync after a dry run");
            }
        }
        let after = self.pools();
        // The dry run's pages go back (unmapped): else the next dry run, or the real trial, counts
        // them too.
        self.device.memory_cleanup();
        Some(dry_peak(&start, &before, &after?))
    }

    fn finish(&self) {
        *self.start.lock().unwrap_or_else(PoisonError::into_inner) = None;
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
        assert_eq!(dry_peak(&before, &before, &after), (8 + 202 + 65) * MIB);

        // A pool whose peak rose counts it; a drained one, the pages it held.
        let after = [(8 * MIB, 1, 3)];
        assert_eq!(dry_peak(&before, &before, &after), (24 + 65) * MIB);
    }

    #[test]
    fn the_pages_an_earlier_dry_run_left_the_weights_in_are_not_counted() {
        // Before the sizing: the small pool and the weights in a 33 MiB page. The first dry run
        // grew 68 MiB pages, and its cleanup moved the weights there; the second grows 83 MiB
        // pages. The weights count at 33 MiB, as in a fresh process, not at 68.
        let start = [(8 * MIB, 1, 1), (33 * MIB, 1, 2)];
        let before = [(8 * MIB, 1, 1), (68 * MIB, 1, 2)];
        let after = [(8 * MIB, 1, 1), (68 * MIB, 1, 2), (83 * MIB, 2, 2)];
        assert_eq!(dry_peak(&start, &before, &after), (8 + 33 + 166) * MIB);
    }
}
