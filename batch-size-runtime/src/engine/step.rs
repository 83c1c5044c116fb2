//! The function's report of its steps, [`step_done`]: inside an attempt whose policy grows after
//! a step ([`SizePolicy::grow_after_a_step`](crate::policy::SizePolicy::grow_after_a_step)), the
//! first call reads the attempt's peak from the release's figures and, where the policy's rule
//! finds a larger size that fits, answers [`Grow`]: a value the function returns (`?`), never an
//! unwind. The watch keeps the growth, so the engine's one loop records the attempt as
//! [`Outcome::Grew`](crate::Outcome::Grew) whatever the function returned once told (the `Grow`
//! itself, a value of its own, or nothing at all): no second loop, no panic, no poisoned mutex.
//!
//! The attempt in progress is found through a thread-local set around each call of the
//! attempt (and around each poll of an async attempt's future, which may move between threads);
//! a step that runs on a thread of its own takes a [`StepHandle`] there.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use crate::memory::{MemorySnapshot, Release};
use crate::policy::{measured_step, GrowRule, StepFigures};

/// A grown size is at least this many percent above the attempt's: below it, running the
/// function again costs more than the larger batch gains.
const LEAST_GAIN_PERCENT: usize = 3;

/// How many times one search grows at most, long reaches from far below aside: two measured
/// steps give the step's line, a third corrects a curved step; more would only chase noise.
pub(crate) const MAX_GROWTHS: usize = 3;

thread_local! {
    static WATCHED: RefCell<Option<Arc<StepWatch>>> = const { RefCell::new(None) };
    /// Whether this thread was already told, at DEBUG, that a call found no attempt to grow.
    static TOLD_UNWATCHED: Cell<bool> = const { Cell::new(false) };
}

/// The search's answer to a step that left room: this attempt ends here, and the function runs
/// again at [`grown_to`](Self::grown_to). Return it from the function (`step_done()?`): it
/// converts into `anyhow::Error`, `Box<dyn Error>` and an error enum with `#[from] Grow`, and
/// the engine finds it in the error's chain as it finds an out-of-memory. It is not a failure:
/// the attempt is recorded as [`Outcome::Grew`](crate::Outcome::Grew), and the caller never
/// sees it.
///
/// Once a call answered `Grow`, the attempt's value is not the caller's whatever the function
/// returns (a function with no `Result` returns early with any value), except an error of its
/// own, which comes back unchanged, and an out-of-memory, which is retried as ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the first step with batch size {batch_size} left room for {grown_to}: \
     the search runs the function again at {grown_to} (return this value, e.g. with `?`)"
)]
pub struct Grow {
    batch_size: usize,
    grown_to: usize,
}

impl Grow {
    /// The size whose first step ran.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The size the function runs at next.
    pub fn grown_to(&self) -> usize {
        self.grown_to
    }
}

/// Tells the batch-size search that one step of the function ran (call it after each
/// optimizer step, and return its error with `?`). After the first step of an attempt it reads
/// the attempt's peak from the release's figures (CUDA's pool high-water mark, the host's peak,
/// the simulated device's); where they show that a size at least a few percent larger fits,
/// below every size that ran out of memory and within `max`, it answers [`Grow`]: the function
/// returns, and runs again at that size, as after an out-of-memory, at most three times a
/// search near the fit (growths that more than double the size, from far below, aside; six in
/// all). It is logged at INFO, and the size found says why it stays there.
///
/// It answers `Ok(())` outside a search, after the first step of an attempt (a thread-local
/// read and two flags: a few nanoseconds), on a thread the attempt did not start (take a
/// [`step_handle`] there), during an unwind (a step guard's `Drop`), without the release's
/// figures and no failure above to bisect toward (with one, it guesses halfway to it, and says
/// so at INFO), under an agreement between
/// ranks (each rank would grow on its own), with a policy that does not grow (only the default,
/// `Guided`, does), in a loop of your own around [`Search`](crate::Search), and in
/// `EffectiveBatch` and `Chunked`, which learn from their steps without it. Where a search runs
/// but the call cannot act, it says why once, at DEBUG.
///
/// Nothing unwinds: code after the call runs, guards drop as usual, a mutex held across it is
/// not poisoned, a `catch_unwind` of yours sees nothing, and it works with `panic = "abort"`.
/// Everything a step changes belongs inside the function, as for an out-of-memory retry.
///
/// ```
/// use batch_size_runtime::{find_executable_batch_size, last_report, memory::SimulatedDevice};
/// use batch_size_runtime::Outcome;
///
/// #[find_executable_batch_size(starting = 1000, release = device.clone())]
/// fn train(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
///     let _weights = device.alloc(2 << 30)?; // 2 GiB
///     for _step in 0..3 {
///         // 24 layers of 5 MiB a sample: a failure comes part-way and says only "smaller".
///         let layers = (0..24)
///             .map(|_| device.alloc(batch_size as u64 * (5 << 20)))
///             .collect::<Result<Vec<_>, _>>()?;
///         drop(layers);
///         batch_size_runtime::step_done()?;
///     }
///     Ok(batch_size)
/// }
///
/// // Memory a step frees is reused by the next, as PyTorch's allocator does.
/// let device = SimulatedDevice::new(16 << 30);
/// let fitted = train(&device)?;
/// assert!((110..=119).contains(&fitted), "{fitted}"); // 119 fit; without the call, 62
/// let report = last_report().unwrap();
/// assert!(report.attempts().any(|attempt| matches!(attempt.outcome, Outcome::Grew { .. })));
/// # Ok::<(), anyhow::Error>(())
/// ```
#[inline]
#[must_use = "a `Grow` ends the attempt only once the function returns it (`step_done()?`): \
              ignored, the search grows all the same, but the function runs on at this size to \
              its end, its value is thrown away, and it runs again from the start at the larger size"]
pub fn step_done() -> Result<(), Grow> {
    // The common call (after the first step, or outside a search) reads the thread-local and
    // two flags; the first step of a watched attempt goes on out of line.
    let open = WATCHED.with(|watched| {
        let watched = watched.try_borrow().ok()?;
        watched.as_ref().filter(|watch| watch.open()).cloned()
    });
    match open {
        Some(watch) => watch.step_done(),
        None => {
            unwatched();
            Ok(())
        }
    }
}

/// The attempt running on this thread, for a step that runs on another (a rayon or
/// `spawn_blocking` thread): `Clone + Send`, its [`step_done`](StepHandle::step_done) acts as
/// [`step_done`] does on the attempt's own thread. Taken outside an attempt, it does nothing;
/// kept past its attempt, it does nothing either (it answers for its own attempt only): take
/// one in each attempt.
///
/// ```
/// use batch_size_runtime::{find_executable_batch_size, memory::SimulatedDevice, step_handle};
///
/// #[find_executable_batch_size(starting = 8, release = device.clone())]
/// fn train(batch_size: usize, device: &SimulatedDevice) -> anyhow::Result<usize> {
///     let handle = step_handle();
///     let device = device.clone();
///     std::thread::spawn(move || -> anyhow::Result<usize> {
///         let _batch = device.alloc(batch_size as u64 * 100)?;
///         handle.step_done()?;
///         Ok(batch_size)
///     })
///     .join()
///     .expect("the step's thread")
/// }
///
/// let device = SimulatedDevice::new(10_000);
/// assert!(train(&device)? > 8); // the step ran on its own thread and grew
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn step_handle() -> StepHandle {
    StepHandle {
        watch: WATCHED.with(|watched| watched.try_borrow().ok().and_then(|w| w.clone())),
    }
}

/// The attempt a step belongs to, on any thread ([`step_handle`]).
#[derive(Debug, Clone, Default)]
pub struct StepHandle {
    watch: Option<Arc<StepWatch>>,
}

impl StepHandle {
    /// [`step_done`] for the attempt the handle was taken in. Once that attempt has returned,
    /// `Ok(())`, said once at DEBUG: a `Grow` it answered then has been acted on, and answered
    /// again from a later attempt it would end the search as that attempt's own error.
    #[must_use = "a `Grow` returned by this call ends the attempt only once the function returns it \
                  (`?`): ignored, the function runs on at this size to its end, and then runs again \
                  from the start at the larger size"]
    pub fn step_done(&self) -> Result<(), Grow> {
        match &self.watch {
            Some(watch) if watch.has_ended() => {
                watch.stale_handle();
                Ok(())
            }
            Some(watch) if watch.open() => watch.step_done(),
            Some(_) => Ok(()),
            None => {
                unwatched();
                Ok(())
            }
        }
    }
}

/// A call with no attempt on its thread: said once a thread, at DEBUG (a call outside a search
/// is common and fine; one on a step's own thread is the mistake worth a line).
#[cold]
fn unwatched() {
    if !TOLD_UNWATCHED.with(|told| told.replace(true)) {
        tracing::debug!(
            "step_done() found no attempt on this thread: nothing grows (outside a search, or on a \
             thread the attempt did not start: take a step_handle() there)"
        );
    }
}

/// What an attempt's first step is measured against and the policy's rule from the measurement
/// to a size, or why the attempt does not grow; and, once the step said so, the growth.
pub(crate) struct StepWatch {
    batch_size: usize,
    /// Why a call cannot grow this attempt, where it cannot.
    growth: Result<Growth, &'static str>,
    measured: AtomicBool,
    grown: OnceLock<Grown>,
    /// The attempt's peak before a search nested in its step restarted the backend's peak (the
    /// inner search's attempts measure their own): the step's peak is the larger of the two.
    peak_before_nested: AtomicU64,
    /// Whether the attempt has returned: a handle kept past it answers nothing.
    ended: AtomicBool,
    /// Whether a handle kept past the attempt was told so, at DEBUG (once an attempt).
    told_stale: AtomicBool,
    /// Why the attempt's first step, measured, did not grow it: said at INFO with the size
    /// the search found.
    stayed: OnceLock<&'static str>,
}

struct Growth {
    /// The figures at the attempt's start; none where they come with the attempt (a child
    /// trial's: the first child brings the first figures).
    at_start: Option<MemorySnapshot>,
    release: Release,
    /// The largest size it may grow to: below every size that failed, within `max`.
    ceiling: usize,
    rule: GrowRule,
}

impl std::fmt::Debug for StepWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepWatch")
            .field("batch_size", &self.batch_size)
            .field(
                "ceiling",
                &self.growth.as_ref().map(|growth| growth.ceiling),
            )
            .field("measured", &self.measured)
            .field("grown", &self.grown.get())
            .finish_non_exhaustive()
    }
}

/// A growth the first step found: the engine's loop records it as the attempt's outcome.
#[derive(Debug, Clone)]
pub(crate) struct Grown {
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) step: StepFigures,
    /// The figures the step was measured against: at the attempt's start, and after its step.
    pub(crate) at_start: MemorySnapshot,
    pub(crate) memory: MemorySnapshot,
}

impl Grown {
    pub(crate) fn signal(&self) -> Grow {
        Grow {
            batch_size: self.from,
            grown_to: self.to,
        }
    }
}

impl StepWatch {
    /// A watch over the attempt at `batch_size` that may grow to `ceiling` by `rule`.
    pub(crate) fn new(
        batch_size: usize,
        at_start: Option<MemorySnapshot>,
        release: Release,
        ceiling: usize,
        rule: GrowRule,
    ) -> Arc<StepWatch> {
        let growth = if ceiling >= least_growth(batch_size) {
            Ok(Growth {
                at_start,
                release,
                ceiling,
                rule,
            })
        } else {
            Err("no size a few percent larger is below every size that failed and within `max`")
        };
        StepWatch::with(batch_size, growth)
    }

    /// A watch over an attempt that cannot grow, saying why to a call that asks.
    pub(crate) fn idle(batch_size: usize, why: &'static str) -> Arc<StepWatch> {
        StepWatch::with(batch_size, Err(why))
    }

    fn with(batch_size: usize, growth: Result<Growth, &'static str>) -> Arc<StepWatch> {
        Arc::new(StepWatch {
            batch_size,
            growth,
            measured: AtomicBool::new(false),
            grown: OnceLock::new(),
            peak_before_nested: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            told_stale: AtomicBool::new(false),
            stayed: OnceLock::new(),
        })
    }

    /// The attempt has returned (or its future completed or was dropped).
    fn end(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// Whether the attempt has returned.
    fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// A handle kept past its attempt was called: says so once, at DEBUG.
    #[cold]
    fn stale_handle(&self) {
        if !self.told_stale.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                batch_size = self.batch_size,
                "StepHandle::step_done() on a handle kept past its attempt: that attempt has \
                 returned, so the call does nothing (take a step_handle() in each attempt)"
            );
        }
    }

    /// Why the attempt's measured first step did not grow it, where it did not.
    pub(crate) fn stayed(&self) -> Option<&'static str> {
        self.stayed.get().copied()
    }

    /// Whether the attempt's first step was reported.
    pub(crate) fn measured(&self) -> bool {
        self.measured.load(Ordering::Relaxed)
    }

    /// The growth a step asked for, for the engine's loop once the attempt returned.
    pub(crate) fn grown(&self) -> Option<&Grown> {
        self.grown.get()
    }

    /// Whether a call still has something to do: the first step, or repeating the growth.
    #[inline]
    fn open(&self) -> bool {
        !self.measured.load(Ordering::Relaxed) || self.grown.get().is_some()
    }

    #[cold]
    #[inline(never)]
    fn step_done(&self) -> Result<(), Grow> {
        if let Some(grown) = self.grown.get() {
            return Err(grown.signal());
        }
        // A step guard's `Drop` while a panic unwinds: the step did not end, and nothing may
        // unwind or allocate much from here.
        if std::thread::panicking() || self.measured.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        let batch_size = self.batch_size;
        let growth = match &self.growth {
            Ok(growth) => growth,
            Err(why) => {
                tracing::debug!(batch_size, "step_done(): {why}; the attempt does not grow");
                let _ = self.stayed.set(why);
                return Ok(());
            }
        };
        let mut memory = growth.release.memory();
        let nested = self.peak_before_nested.load(Ordering::Relaxed);
        if let Some(device) = memory.devices.first_mut().filter(|_| nested > 0) {
            device.peak = device.peak.map(|peak| peak.max(nested));
        }
        let at_start = growth
            .at_start
            .clone()
            .unwrap_or_else(|| empty_start(&memory));
        let step = measured_step(batch_size, Some(&at_start), Some(&memory));
        let Some(to) = (growth.rule)(batch_size, step.as_ref()).map(|to| to.min(growth.ceiling))
        else {
            if step.is_none() {
                tracing::debug!(
                    batch_size,
                    "step_done(): the release read no figures for the step (no peak, or no \
                     total) and no failure bounds it; the attempt does not grow"
                );
                let _ = self.stayed.set("the release read no figures for the step");
            } else {
                let _ = self
                    .stayed
                    .set("its figures leave no room for a larger size below every failure");
            }
            return Ok(());
        };
        if to < least_growth(batch_size) {
            let _ = self
                .stayed
                .set("its figures leave room for less than 3 % more");
            return Ok(());
        }
        let grown = self.grown.get_or_init(|| Grown {
            from: batch_size,
            to,
            step: step.unwrap_or(StepFigures::new(batch_size, 0, 0)),
            at_start,
            memory,
        });
        Err(grown.signal())
    }

    /// A search starts inside this attempt's step on the same thread: its release restarts the
    /// backend's peak, so the peak so far is kept here.
    fn nested_search_starts(&self) {
        if let (false, Ok(growth)) = (self.measured(), &self.growth) {
            let memory = growth.release.memory();
            if let Some(peak) = memory.devices.first().and_then(|device| device.peak) {
                self.peak_before_nested.fetch_max(peak, Ordering::Relaxed);
            }
        }
    }
}

/// The start of an attempt whose figures came with it (a child trial's, read from the child
/// that ran its step): all the room, nothing held, as a fresh process starts.
fn empty_start(end: &MemorySnapshot) -> MemorySnapshot {
    MemorySnapshot {
        devices: end
            .devices
            .iter()
            .map(|device| crate::memory::DeviceMemory {
                device: device.device.clone(),
                total: device.total,
                free: device.total,
                pool_reserved: Some(0),
                pool_used: None,
                peak: None,
            })
            .collect(),
    }
}

/// The smallest size worth growing to from `batch_size`.
pub(crate) fn least_growth(batch_size: usize) -> usize {
    batch_size
        .saturating_add((batch_size.saturating_mul(LEAST_GAIN_PERCENT)).div_ceil(100))
        .max(batch_size.saturating_add(1))
}

/// A search is about to start an attempt on this thread. Where it runs inside another search's
/// attempt whose first step is not measured yet, that attempt's peak so far is kept first: the
/// new attempt's release restarts the backend's peak.
pub(crate) fn keep_the_outer_peak() {
    let outer = WATCHED.with(|watched| {
        watched
            .try_borrow()
            .ok()
            .and_then(|watched| watched.clone())
    });
    if let Some(outer) = outer {
        outer.nested_search_starts();
    }
}

/// Puts `watch` (or none: a search nested in another's attempt hides the outer one) in place
/// for the current thread until dropped, then restores what was there.
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

/// Marks the attempt's watch ended when dropped: once the attempt returns, unwinds or its
/// future is dropped, handles kept from it answer nothing.
#[derive(Debug)]
struct EndsOnDrop(Option<Arc<StepWatch>>);

impl Drop for EndsOnDrop {
    fn drop(&mut self) {
        if let Some(watch) = &self.0 {
            watch.end();
        }
    }
}

/// Runs `attempt` with `watch` in place on this thread; the watch ends with it.
#[inline]
pub(crate) fn watching<R>(watch: Option<Arc<StepWatch>>, attempt: impl FnOnce() -> R) -> R {
    let _ends = EndsOnDrop(watch.clone());
    let _installed = Installed::new(watch);
    attempt()
}

/// An async attempt's future with its watch in place on whichever thread polls it.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Watched<F> {
    future: Pin<Box<F>>,
    watch: Option<Arc<StepWatch>>,
    /// Ends the watch when the future is dropped, done or not.
    _ends: EndsOnDrop,
}

impl<F: Future> Watched<F> {
    pub(crate) fn new(future: F, watch: Option<Arc<StepWatch>>) -> Self {
        Watched {
            future: Box::pin(future),
            _ends: EndsOnDrop(watch.clone()),
            watch,
        }
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let watch = self.watch.clone();
        let _installed = Installed::new(watch);
        let polled = self.future.as_mut().poll(cx);
        if let (Poll::Ready(_), Some(watch)) = (&polled, &self.watch) {
            watch.end();
        }
        polled
    }
}
