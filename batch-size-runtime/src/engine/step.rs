//! The function's report of its steps, [`step_done`]: inside an attempt whose policy grows after
//! a step ([`SizePolicy::grow_after_a_step`](crate::policy::SizePolicy::grow_after_a_step)), the
//! first call reads the attempt's peak from the release's figures and, where the policy's rule
//! finds a larger size that fits, ends the attempt by unwinding with a payload of this module's
//! own. The engine's one loop catches it as it catches any panic and records the attempt as
//! [`Outcome::Grew`](crate::Outcome::Grew): no second loop, and it works whatever the function
//! returns, sync or async, in methods too.
//!
//! The attempt in progress is found through a thread-local set around each call of the
//! attempt (and around each poll of an async attempt's future, which may move between threads).

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::memory::{MemorySnapshot, Release};
use crate::policy::{measured_step, GrowRule, StepFigures};

/// A grown size is at least this many percent above the attempt's: below it, running the
/// function again costs more than the larger batch gains.
const LEAST_GAIN_PERCENT: usize = 3;

/// How many times one search grows at most: two measured steps give the step's line, a third
/// corrects a curved step; more would only chase noise.
pub(crate) const MAX_GROWTHS: usize = 3;

thread_local! {
    static WATCHED: RefCell<Option<Arc<StepWatch>>> = const { RefCell::new(None) };
}

/// Tells the batch-size search that one step of the function ran (call it after each
/// optimizer step). After the first step of an attempt it reads the attempt's peak from the
/// release's figures (CUDA's pool high-water mark, the host's peak, the simulated device's);
/// where they show that a size at least a few percent larger fits, below every size that ran
/// out of memory and within `max`, the attempt ends there and the function runs again at that
/// size, as after an out-of-memory, at most three times a search. It is logged at INFO.
///
/// It does nothing outside a search, after the first step of an attempt (a thread-local read
/// and a flag: a few nanoseconds), on a thread the attempt did not start (call it where the
/// step's loop runs), without the release's figures (a release that reads none, a backend
/// without a peak), under an agreement between ranks (each rank would grow on its own), with a
/// policy that does not grow (only the default, `Guided`, does), in a loop of your own around
/// [`Search`](crate::Search) (nothing puts the attempt in place), in a build with
/// `panic = "abort"`, and in `EffectiveBatch` and `Chunked`, which learn from their steps
/// without it.
///
/// The attempt ends by unwinding out of the function (without the panic hook: nothing is
/// printed): values it dropped are dropped, and the function runs again from its start, so
/// everything a step changes belongs inside it, as for an out-of-memory retry. Do not call it
/// inside a `catch_unwind` of your own, which would catch the end of the attempt.
///
/// ```
/// use batch_size_runtime::{find_executable_batch_size, last_report, memory::SimulatedDevice};
/// use batch_size_runtime::{OutOfMemory, Outcome};
///
/// #[find_executable_batch_size(starting = 1000, release = device.clone())]
/// fn train(batch_size: usize, device: &SimulatedDevice) -> Result<usize, OutOfMemory> {
///     let _weights = device.alloc(2 << 30)?; // 2 GiB
///     for _step in 0..3 {
///         // 24 layers of 5 MiB a sample: a failure comes part-way and says only "smaller".
///         let layers = (0..24)
///             .map(|_| device.alloc(batch_size as u64 * (5 << 20)))
///             .collect::<Result<Vec<_>, _>>()?;
///         drop(layers);
///         batch_size_runtime::step_done();
///     }
///     Ok(batch_size)
/// }
///
/// // Memory a step frees is reused by the next, as PyTorch's allocator does.
/// let device = SimulatedDevice::new(16 << 30);
/// let fitted = train(&device).unwrap();
/// assert!((110..=119).contains(&fitted), "{fitted}"); // 119 fit; without the call, 62
/// let report = last_report().unwrap();
/// assert!(report.attempts().any(|attempt| matches!(attempt.outcome, Outcome::Grew { .. })));
/// ```
#[inline]
pub fn step_done() {
    // The common call (after the first step, or outside a search) reads the thread-local and a
    // flag; the first step of a watched attempt goes on out of line.
    let first = WATCHED.with(|watched| {
        let watched = watched.try_borrow().ok()?;
        watched
            .as_ref()
            .filter(|watch| !watch.measured.load(Ordering::Relaxed))
            .cloned()
    });
    if let Some(watch) = first {
        watch.first_step();
    }
}

/// What an attempt's first step is measured against, and the policy's rule from the
/// measurement to a size.
pub(crate) struct StepWatch {
    batch_size: usize,
    at_start: MemorySnapshot,
    release: Release,
    /// The largest size it may grow to: below every size that failed, within `max`.
    ceiling: usize,
    rule: GrowRule,
    measured: AtomicBool,
}

impl std::fmt::Debug for StepWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepWatch")
            .field("batch_size", &self.batch_size)
            .field("ceiling", &self.ceiling)
            .field("measured", &self.measured)
            .finish_non_exhaustive()
    }
}

/// The unwinding payload that ends a grown attempt: only the engine's loop reads it.
#[derive(Debug)]
pub(crate) struct Grown {
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) step: StepFigures,
    pub(crate) memory: MemorySnapshot,
}

impl StepWatch {
    /// A watch over the attempt at `batch_size`, or `None` where it could grow to nothing (the
    /// ceiling leaves no size a few percent larger) or cannot end an attempt (`panic = "abort"`).
    pub(crate) fn new(
        batch_size: usize,
        at_start: MemorySnapshot,
        release: Release,
        ceiling: usize,
        rule: GrowRule,
    ) -> Option<Arc<StepWatch>> {
        (cfg!(panic = "unwind") && ceiling >= least_growth(batch_size)).then(|| {
            Arc::new(StepWatch {
                batch_size,
                at_start,
                release,
                ceiling,
                rule,
                measured: AtomicBool::new(false),
            })
        })
    }

    /// Whether the attempt's first step was reported.
    pub(crate) fn measured(&self) -> bool {
        self.measured.load(Ordering::Relaxed)
    }

    #[cold]
    #[inline(never)]
    fn first_step(&self) {
        if self.measured.swap(true, Ordering::Relaxed) {
            return;
        }
        let memory = self.release.memory();
        let Some(step) = measured_step(self.batch_size, Some(&self.at_start), Some(&memory)) else {
            return;
        };
        let Some(to) = (self.rule)(&step).map(|to| to.min(self.ceiling)) else {
            return;
        };
        if to < least_growth(self.batch_size) {
            return;
        }
        // Not a panic: `resume_unwind` skips the panic hook, so nothing is printed; the
        // engine's catch recognises the payload.
        std::panic::resume_unwind(Box::new(Grown {
            from: self.batch_size,
            to,
            step,
            memory,
        }))
    }
}

/// The smallest size worth growing to from `batch_size`.
pub(crate) fn least_growth(batch_size: usize) -> usize {
    batch_size
        .saturating_add((batch_size.saturating_mul(LEAST_GAIN_PERCENT)).div_ceil(100))
        .max(batch_size.saturating_add(1))
}

/// Puts `watch` (or no watch: a search nested in another's attempt hides the outer one) in
/// place for the current thread until dropped, then restores what was there.
struct Installed(Option<Arc<StepWatch>>);

impl Installed {
    fn new(watch: Option<Arc<StepWatch>>) -> Self {
        Installed(WATCHED.with(|watched| match watched.try_borrow_mut() {
            Ok(mut watched) => std::mem::replace(&mut *watched, watch),
            Err(_) => None,
        }))
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let previous = self.0.take();
        WATCHED.with(|watched| {
            if let Ok(mut watched) = watched.try_borrow_mut() {
                *watched = previous;
            }
        });
    }
}

/// Runs `attempt` with `watch` in place on this thread.
#[inline]
pub(crate) fn watching<R>(watch: Option<Arc<StepWatch>>, attempt: impl FnOnce() -> R) -> R {
    let _installed = Installed::new(watch);
    attempt()
}

/// An async attempt's future with its watch in place on whichever thread polls it.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Watched<F> {
    future: Pin<Box<F>>,
    watch: Option<Arc<StepWatch>>,
}

impl<F: Future> Watched<F> {
    pub(crate) fn new(future: F, watch: Option<Arc<StepWatch>>) -> Self {
        Watched {
            future: Box::pin(future),
            watch,
        }
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let watch = self.watch.clone();
        let _installed = Installed::new(watch);
        self.future.as_mut().poll(cx)
    }
}
