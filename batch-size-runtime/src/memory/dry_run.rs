//! A framework's dry run, the hook a framework implements to measure a step without running it
//! (cubecl 0.11's, for burn: `BurnDryRun`, with the `burn` feature), and what the dry runs
//! measured; the tuner sizes from them ([`Tuner::with_dry_run`](crate::Tuner::with_dry_run)).

use std::fmt;

/// A framework's dry run: a step run with no work done on the device, and what it would take.
///
/// Only a step driven by shapes can be measured: values read back in a dry run are garbage, so
/// a step that branches on them (stops early on a NaN loss, sizes a tensor from a value it
/// read) measures another step than the one that will run. Such a step, or one that fails
/// under the dry run, leaves the tuner to its ordinary search.
///
/// Implemented by `memory::BurnDryRun` (feature `burn`).
pub trait DryRun: Send + fmt::Debug {
    /// Runs `step` under a dry run; the bytes its allocations held at their peak (the memory
    /// live when it began included), or `None` where the framework did not say.
    fn measure(&self, step: &mut dyn FnMut()) -> Option<u64>;

    /// The bytes a step's peak may reach on the device now: what is free plus what the
    /// framework's pools hold (a step reuses them). `None` where unknown.
    fn budget(&self) -> Option<u64>;

    /// After the last dry run, before the real trial: gives back what the dry runs left in the
    /// framework's pools. Does nothing by default.
    fn finish(&self) {}
}

/// What the dry runs measured, and the size they give.
#[derive(Debug, Clone, PartialEq)]
pub struct DrySizing {
    /// Each dry run: the size and its peak in bytes, in the order run (sizes increasing).
    pub probes: Vec<(usize, u64)>,
    /// The bytes the peak may reach ([`DryRun::budget`]).
    pub budget: u64,
    /// The largest size the peaks say fits the budget.
    pub fit: usize,
    /// [`fit`](Self::fit) less the margin: the size a real step confirms.
    pub batch_size: usize,
}

impl fmt::Display for DrySizing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dry runs")?;
        for (size, peak) in &self.probes {
            write!(f, " {size}: {} MiB,", peak >> 20)?;
        }
        write!(
            f,
            " budget {} MiB: {} fits, {} with the margin",
            self.budget >> 20,
            self.fit,
            self.batch_size
        )
    }
}
