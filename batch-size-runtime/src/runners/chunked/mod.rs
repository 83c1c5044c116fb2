//! Work over many items in chunks that keeps its progress (the docs users read are on
//! [`Chunked`]).

use std::fmt;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use crate::attempt::AttemptError;
use crate::engine::dispatch::LastError;
use crate::engine::driver::Returning;
use crate::engine::{drive_ended, drive_ended_async, Ended};
use crate::engine::{settings_setters, Settings};
use crate::error::StopReason;
use crate::policy::{CacheSlot, Reduction};
use crate::record;
use crate::runners::learn::{Convergence, GrowBack, SquareTerm};
use crate::runners::search::BatchSizeSearch;
use crate::runners::split::BatchCost;

mod attempt;
mod policy;
mod progress;

use attempt::{keep_outputs, ChunkAttempt, ChunkKind};
use policy::ChunkPolicy;
use progress::{lock, lock_any, Progress, Run};
pub use progress::{ChunkProgress, ChunkRecord};

/// Why chunked work stopped before every item was done. `completed` items (from 0) are done
/// in every case: resume from there.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkError<E> {
    /// Your closure returned an error that is not out-of-memory (a panic that is not
    /// out-of-memory resumes unwinding instead).
    #[error("{error} (chunked work stopped after {completed} items)")]
    Failed {
        /// Items done before the failing chunk.
        completed: usize,
        /// What the closure returned.
        error: E,
    },
    /// Even the smallest chunk ran out of memory.
    #[error("no chunk size fits after {completed} items: {error}")]
    NoChunkFits {
        /// Items done.
        completed: usize,
        /// The search's failure, through your error type.
        error: E,
    },
    /// One item alone needs more than any budget that fits.
    #[error("item {item} alone does not fit: its cost is {cost}, and chunks of cost {largest_failed} and below already ran out of memory")]
    ItemTooLarge {
        /// Items done (the item's index).
        completed: usize,
        /// The item.
        item: usize,
        /// Its cost (1 without `with_cost`).
        cost: u64,
        /// The smallest budget that failed with this item alone.
        largest_failed: usize,
    },
    /// `run`'s closure returned a number of outputs that is not the number of items it was given.
    #[error("the closure returned {got} outputs for the {expected} items {range:?}: one output per item, in order")]
    WrongOutputCount {
        /// Items done before this chunk.
        completed: usize,
        /// The chunk's items.
        range: Range<usize>,
        /// Outputs expected.
        expected: usize,
        /// Outputs returned.
        got: usize,
    },
}

impl<E> ChunkError<E> {
    /// Items done before the work stopped: resume from this index.
    ///
    /// ```
    /// use batch_size_runtime::Chunked;
    /// let error = Chunked::new(10).with_starting(4).for_each(|items| -> anyhow::Result<()> {
    ///     if items.contains(&6) { anyhow::bail!("bad record") }
    ///     Ok(())
    /// }).unwrap_err();
    /// assert_eq!(error.completed(), 4);
    /// ```
    pub fn completed(&self) -> usize {
        match self {
            ChunkError::Failed { completed, .. }
            | ChunkError::NoChunkFits { completed, .. }
            | ChunkError::ItemTooLarge { completed, .. }
            | ChunkError::WrongOutputCount { completed, .. } => *completed,
        }
    }
}

type Cost<'r> = Box<dyn Fn(usize) -> u64 + Send + Sync + 'r>;
type OnChunk<'r> = Box<dyn FnMut(&ChunkProgress) + Send + 'r>;

/// Work over many items in chunks (evaluation, inference, embeddings) that keeps its progress:
/// a chunk that runs out of memory is redone smaller from its own start, the chunks before it
/// are kept, and the chunk size grows back after a few clean chunks.
///
/// ```
/// use batch_size_runtime::{Chunked, OutOfMemory};
///
/// let squares = Chunked::new(1000)
///     .with_starting(256)
///     .run(|items| -> anyhow::Result<Vec<u64>> {
///         if items.len() > 100 { Err(OutOfMemory::new())? } // 100 items at once fit
///         Ok(items.map(|i| (i * i) as u64).collect())
///     })?;
/// assert_eq!(squares.len(), 1000);
/// assert_eq!(squares[999], 999 * 999);
/// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
/// ```
///
/// # Default
/// - first chunk: all the items (`with_starting`);
/// - minimum: 1 item (or cost unit), no maximum;
/// - sizes after an out-of-memory chunk: the guided policy, `with_factor` for a fixed factor;
/// - growing: with a release that reads figures, toward the largest chunk they say fits
///   (`with_convergence`); without, after 4 clean chunks, double while twice the size stays
///   below the smallest size that failed (`with_grow_after`; 0 never grows);
/// - release: [`Release::cuda()`](crate::Release::cuda).
pub struct Chunked<'r> {
    total: usize,
    starting: Option<usize>,
    settings: Settings<'r>,
    /// With `with_cache`: the budget the runs settled on, for a resumed run.
    cache: Option<CacheSlot>,
    cost: Option<Cost<'r>>,
    /// How a chunk of items of different cost costs (with `with_cost`).
    batch_cost: BatchCost,
    /// In `run_by_cost`: the items with their costs, the costliest first; chunks are ranges
    /// of it (the cost function ran once an item).
    ordered: Option<Vec<(usize, u64)>>,
    on_chunk: Option<OnChunk<'r>>,
    chunks: Vec<ChunkRecord>,
    chunk_count: usize,
}

impl fmt::Debug for Chunked<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunked")
            .field("total", &self.total)
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

settings_setters!(
    Chunked<'r>,
    "Chunked::new(1000)",
    bounds,
    label,
    release,
    shrink,
    learning,
    agreement
);

impl<'r> Chunked<'r> {
    /// Work over items `0..total_items`.
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let none: Vec<u8> = Chunked::new(0).run(|_| -> anyhow::Result<Vec<u8>> { unreachable!() })?;
    /// assert!(none.is_empty());
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn new(total_items: usize) -> Self {
        Chunked {
            total: total_items,
            starting: None,
            settings: Settings {
                grow_after: 4,
                ..Settings::default()
            },
            cache: None,
            cost: None,
            batch_cost: BatchCost::padded(),
            ordered: None,
            on_chunk: None,
            chunks: Vec::new(),
            chunk_count: 0,
        }
    }

    /// The first chunk's size (items, or cost with `with_cost`).
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let mut chunked = Chunked::new(10).with_starting(4);
    /// chunked.for_each(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(chunked.chunks()[0].range, 0..4);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn with_starting(mut self, size: usize) -> Self {
        self.starting = Some(size);
        self
    }

    /// Items of different cost (a sequence's tokens, say): chunks hold a budget of cost
    /// instead of a count of items, and the budget is what the policy searches, so the guided
    /// policy learns memory per unit of cost. A chunk costs what the framework allocates for it
    /// ([`with_batch_cost`](Self::with_batch_cost): by default its items × the costliest, every
    /// item padded to the longest). A chunk holds at least one item. With
    /// [`run_by_cost`](Self::run_by_cost) the items are also grouped by cost, so that padding
    /// stays small.
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let lengths = [10u64, 10, 50, 5, 5, 5];
    /// let mut chunked = Chunked::new(6).with_starting(40).with_cost(|i| lengths[i]);
    /// chunked.for_each(|_| Ok::<_, anyhow::Error>(()))?;
    /// let ranges: Vec<_> = chunked.chunks().iter().map(|chunk| chunk.range.clone()).collect();
    /// assert_eq!(ranges, [0..2, 2..3, 3..6]); // item 2 alone is over budget, still run
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn with_cost(mut self, cost: impl Fn(usize) -> u64 + Send + Sync + 'r) -> Self {
        self.cost = Some(Box::new(cost));
        self
    }

    /// How a chunk of items costs with [`with_cost`](Self::with_cost): by default
    /// [`BatchCost::padded()`], items × the costliest; a square term where the work has one.
    /// With a release that reads figures, the run starts from it and takes the square term
    /// its chunks' peaks follow where another explains them clearly better (said at INFO).
    ///
    /// ```
    /// # use batch_size_runtime::{BatchCost, Chunked};
    /// let lengths = [100u64, 100, 100, 100];
    /// let mut chunked = Chunked::new(4)
    ///     .with_starting(400)
    ///     .with_cost(|i| lengths[i])
    ///     .with_batch_cost(BatchCost::padded().with_square_term(100)); // 100 tokens cost 200
    /// chunked.for_each(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(chunked.chunks().len(), 2);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn with_batch_cost(mut self, cost: BatchCost) -> Self {
        self.batch_cost = cost;
        self
    }

    /// Called after every chunk that completed, with the progress (drive a progress bar). Its
    /// own name: the other runners' `notify` is told of every attempt.
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let mut seen = Vec::new();
    /// Chunked::new(10)
    ///     .with_starting(5)
    ///     .on_chunk(|progress| seen.push(progress.completed))
    ///     .for_each(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(seen, [5, 10]);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn on_chunk(mut self, callback: impl FnMut(&ChunkProgress) + Send + 'r) -> Self {
        self.on_chunk = Some(Box::new(callback));
        self
    }

    /// The chunks of the last run, in order, with their range, budget, cost and whether they
    /// completed. A long run keeps a bounded record, as [`SearchReport`](crate::SearchReport)
    /// does: the first 256 chunks, every chunk that did not complete, and the last 64 that did
    /// ([`chunk_count`](Self::chunk_count) counts them all).
    ///
    /// ```
    /// # use batch_size_runtime::{Chunked, OutOfMemory};
    /// let mut chunked = Chunked::new(8).with_starting(8).with_factor(0.5);
    /// chunked.for_each(|items| -> anyhow::Result<()> {
    ///     if items.len() > 4 { Err(OutOfMemory::new())? }
    ///     Ok(())
    /// })?;
    /// let done: Vec<bool> = chunked.chunks().iter().map(|chunk| chunk.done).collect();
    /// assert_eq!(done, [false, true, true]);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn chunks(&self) -> &[ChunkRecord] {
        &self.chunks
    }

    /// How many chunks the last run ran, done or not, kept in [`chunks`](Self::chunks) or not.
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let mut chunked = Chunked::new(100_000).with_starting(10).with_grow_after(0);
    /// chunked.for_each(|_| Ok::<_, anyhow::Error>(()))?;
    /// assert_eq!(chunked.chunk_count(), 10_000);
    /// assert!(chunked.chunks().len() < 1_000); // the first ones, every failure, the last ones
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn chunk_count(&self) -> usize {
        self.chunk_count
    }

    /// Runs `work` over every item, chunk by chunk, and returns its outputs concatenated in item
    /// order (one per item). Takes the error types every runner takes
    /// ([`AttemptError`]): your own
    /// enum, `anyhow::Error`, `Box<dyn Error + Send + Sync>`. The search's report goes to
    /// [`last_report()`](crate::last_report), as for every runner.
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let doubled = Chunked::new(5).with_starting(2).run(|items| {
    ///     Ok::<_, anyhow::Error>(items.map(|i| i * 2).collect())
    /// })?;
    /// assert_eq!(doubled, [0, 2, 4, 6, 8]);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn run<T, E, M>(
        &mut self,
        mut work: impl FnMut(Range<usize>) -> Result<Vec<T>, E>,
    ) -> Result<Vec<T>, ChunkError<E>>
    where
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&work);
        let mut outputs = Vec::with_capacity(self.total);
        self.drive(|range| {
            let values = work(range.clone()).map_err(ChunkAttempt::Work)?;
            keep_outputs(&mut outputs, range, values)
        })?;
        Ok(outputs)
    }

    /// Runs `work` over every item with the items grouped by cost
    /// ([`with_cost`](Self::with_cost)), the costliest first, and returns its outputs in item
    /// order (one per item, as `run` does). `work` receives each chunk's items, indices in
    /// `0..total_items`: chunks of items of like cost waste little on padding (an embedding
    /// pass over documents of very unequal lengths runs an order of magnitude fewer chunks
    /// than in the corpus's order), and the costliest chunk runs first, so that an
    /// out-of-memory comes at the start, not hours in. [`chunks()`](Self::chunks)'s ranges and
    /// the progress's `completed` count items in that order.
    ///
    /// ```
    /// use batch_size_runtime::{Chunked, OutOfMemory};
    ///
    /// let lengths = [5u64, 400, 6, 390, 7, 5];
    /// let mut chunked = Chunked::new(6).with_cost(|i| lengths[i]);
    /// let sizes = chunked.run_by_cost(|items| -> anyhow::Result<Vec<u64>> {
    ///     let longest = items.iter().map(|&i| lengths[i]).max().unwrap_or(0);
    ///     if items.len() as u64 * longest > 800 { Err(OutOfMemory::new())? } // 800 padded tokens fit
    ///     Ok(items.iter().map(|&i| lengths[i]).collect())
    /// })?;
    /// assert_eq!(sizes, lengths); // in the caller's order
    /// assert_eq!(chunked.chunk_count(), 3); // 2 long ones together, then the 4 short ones
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn run_by_cost<T, E, M>(
        &mut self,
        mut work: impl FnMut(&[usize]) -> Result<Vec<T>, E>,
    ) -> Result<Vec<T>, ChunkError<E>>
    where
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&work);
        let starting = self.starting;
        // The user's cost function, once an item (a panic in it is the user's).
        let mut ordered: Vec<(usize, u64)> = (0..self.total)
            .map(|item| (item, self.cost.as_ref().map_or(1, |cost| cost(item))))
            .collect();
        ordered.sort_by_key(|&(_, cost)| std::cmp::Reverse(cost));
        // Without a first budget, the costliest item alone runs first: it proves at the start
        // that the worst of the work fits, and its figures size the next chunks (a corpus at
        // once would fail many times on the way down).
        if let (None, Some(_), Some(&(_, costliest))) = (starting, &self.cost, ordered.first()) {
            let alone = self.batch_cost.of(1, costliest);
            self.starting = Some(usize::try_from(alone).unwrap_or(usize::MAX));
        }
        let order: Vec<usize> = ordered.iter().map(|&(item, _)| item).collect();
        let mut outputs: Vec<Option<T>> =
            std::iter::repeat_with(|| None).take(self.total).collect();
        self.ordered = Some(ordered);
        let ran = self.drive(|range| {
            let items = &order[range.clone()];
            let values = work(items).map_err(ChunkAttempt::Work)?;
            if values.len() != items.len() {
                return Err(ChunkAttempt::WrongOutputCount {
                    range,
                    got: values.len(),
                });
            }
            for (&item, value) in items.iter().zip(values) {
                outputs[item] = Some(value);
            }
            Ok(())
        });
        (self.ordered, self.starting) = (None, starting);
        ran?;
        Ok(outputs.into_iter().flatten().collect())
    }

    /// Runs `work` over every item for its side effects (writing embeddings out, say).
    ///
    /// ```
    /// # use batch_size_runtime::Chunked;
    /// let mut total = 0;
    /// Chunked::new(100).with_starting(30).for_each(|items| {
    ///     total += items.len();
    ///     Ok::<_, anyhow::Error>(())
    /// })?;
    /// assert_eq!(total, 100);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub fn for_each<E, M>(
        &mut self,
        mut work: impl FnMut(Range<usize>) -> Result<(), E>,
    ) -> Result<(), ChunkError<E>>
    where
        E: AttemptError<M>,
    {
        self.settings.name_the_work(&work);
        self.drive(|range| work(range).map_err(ChunkAttempt::Work))
    }

    /// The async form of [`run`](Self::run), for inference servers: `work` returns a future.
    /// The run's future is `Send` when the work's futures are.
    ///
    /// ```
    /// # use batch_size_runtime::{Chunked, OutOfMemory};
    /// # fn block_on<F: std::future::Future>(future: F) -> F::Output {
    /// #     let mut future = std::pin::pin!(future);
    /// #     let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    /// #     loop {
    /// #         if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
    /// #             break value;
    /// #         }
    /// #     }
    /// # }
    /// let mut chunked = Chunked::new(100).with_starting(64);
    /// let outputs = block_on(chunked.run_async(|items| async move {
    ///     if items.len() > 40 { Err(OutOfMemory::new())? }
    ///     Ok::<_, anyhow::Error>(items.map(|i| i * 10).collect::<Vec<_>>())
    /// }))?;
    /// assert_eq!(outputs.len(), 100);
    /// assert_eq!(outputs[99], 990);
    /// # Ok::<(), batch_size_runtime::ChunkError<anyhow::Error>>(())
    /// ```
    pub async fn run_async<T, E, M, Fut>(
        &mut self,
        mut work: impl FnMut(Range<usize>) -> Fut,
    ) -> Result<Vec<T>, ChunkError<E>>
    where
        Fut: std::future::Future<Output = Result<Vec<T>, E>>,
        E: AttemptError<M>,
    {
        if self.total == 0 {
            self.chunks.clear();
            self.chunk_count = 0;
            return Ok(Vec::new());
        }
        // Lent to this run's policy, and back when it ends.
        let mut shrink = std::mem::take(&mut self.settings.shrink);
        let run = self.new_run();
        let search = self.prepare(shrink.borrowed(), &run);
        // Shared with each chunk's future by reference, so that the run's future is `Send`
        // when the work's is.
        let outputs = Mutex::new(Vec::with_capacity(self.total));
        let on_chunk = Mutex::new(self.on_chunk.take());
        let costs = self.costs();
        let (run_ref, outputs_ref, on_chunk_ref) = (&run, &outputs, &on_chunk);
        let attempt = Returning(move |budget| {
            let (range, cost) = begin_chunk(&costs, run_ref, budget);
            let running = Running::new(run_ref, range.clone(), budget, cost);
            let pending = work(range.clone());
            async move {
                let outcome = match pending.await {
                    Ok(values) => keep_outputs(&mut lock_any(outputs_ref), range.clone(), values),
                    Err(error) => Err(ChunkAttempt::Work(error)),
                };
                running.ended();
                let mut on_chunk = lock_any(on_chunk_ref);
                Self::end_chunk(run_ref, &mut on_chunk, range, budget, cost, outcome.is_ok());
                outcome
            }
        });
        let ended = drive_ended_async(
            search.start(),
            &ChunkKind::<E, M>::new(),
            LastError::AsSource,
            attempt,
        )
        .await
        .published();
        self.settings.shrink = shrink;
        self.on_chunk = on_chunk
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        self.conclude(&run, ended)?;
        Ok(outputs.into_inner().unwrap_or_else(PoisonError::into_inner))
    }

    /// A run's progress, before its first chunk.
    fn new_run(&mut self) -> Mutex<Run> {
        self.chunks.clear();
        self.chunk_count = 0;
        Mutex::new(Run {
            progress: Progress {
                completed: 0,
                total: self.total,
                current: 0..0,
                current_cost: 0,
                current_longest: 0,
                shape: self.batch_cost,
            },
            records: Vec::new(),
            chunks_run: 0,
            thin_at: 0,
            retries: 0,
        })
    }

    /// The search of one run; its policy borrows the run's progress, which it reads between chunks.
    fn prepare<'s>(&mut self, inner: Reduction<'s>, run: &'s Mutex<Run>) -> BatchSizeSearch<'s>
    where
        'r: 's,
    {
        let whole = match &self.cost {
            None => self.total,
            Some(cost) => {
                let costliest = match &self.ordered {
                    Some(ordered) => ordered.first().map_or(0, |&(_, cost)| cost),
                    None => (0..self.total).map(cost).max().unwrap_or(0),
                };
                let whole = self.batch_cost.of(self.total, costliest);
                usize::try_from(whole).unwrap_or(usize::MAX)
            }
        };
        self.settings.check();
        if self.cache.is_none() {
            // The budget learned does not depend on how many items are left: a run resumed
            // over the rest of a dataset finds its entry.
            let what = if self.cost.is_some() {
                format!("cost budget, {}", self.batch_cost.unit())
            } else {
                "items".to_owned()
            };
            self.cache = self.settings.open_cache("chunked", &what);
        }
        let cached = self.cache.as_ref().and_then(CacheSlot::fits);
        let starting = match cached.or(self.starting) {
            // Refused by the search as every runner's first size of 0 is.
            Some(0) => 0,
            Some(starting) => starting.clamp(1, whole.max(1)),
            None => whole.max(1),
        };
        let mut grow = GrowBack::new(
            self.settings.grow_after,
            self.settings.max.unwrap_or(usize::MAX),
        );
        // The failure that held an earlier run's growth back holds this one's back too.
        if let Some(failed) = self.cache.as_ref().and_then(CacheSlot::failed_at) {
            grow.failed(failed);
        }
        let policy = ChunkPolicy {
            inner,
            run,
            grow,
            convergence: Convergence::new(self.settings.learn),
            square_term: (self.cost.is_some() && self.settings.learn).then(SquareTerm::default),
            probing: None,
            max: self.settings.max.unwrap_or(usize::MAX),
            // The chunks agree themselves, between chunks: the search does not wrap them.
            agreement: self.settings.agreement.clone(),
        };
        let mut search = BatchSizeSearch::new(starting).with_policy(policy);
        self.settings.lend_to_search(&mut search.settings);
        // Fewer items (or less cost) left than `min`: one chunk holds them all, and nothing
        // smaller is tried.
        search.settings.min = search.settings.min.min(whole.max(1));
        search
    }

    /// Records how a chunk ended; on success, moves the progress past it and tells `on_chunk`.
    fn end_chunk(
        run: &Mutex<Run>,
        on_chunk: &mut Option<OnChunk<'r>>,
        range: Range<usize>,
        budget: usize,
        cost: u64,
        done: bool,
    ) {
        let progress = record_chunk(run, range, budget, cost, done);
        if let (Some(progress), Some(on_chunk)) = (progress, on_chunk.as_mut()) {
            on_chunk(&progress);
        }
    }
}

/// Records how a chunk ended; where it completed, moves the progress past it and returns it.
fn record_chunk(
    run: &Mutex<Run>,
    range: Range<usize>,
    budget: usize,
    cost: u64,
    done: bool,
) -> Option<ChunkProgress> {
    let mut run = lock(run);
    run.records.push(ChunkRecord {
        range: range.clone(),
        budget,
        cost,
        done,
    });
    run.chunks_run += 1;
    let Run {
        records, thin_at, ..
    } = &mut *run;
    record::thin_out(records, thin_at, |chunk| chunk.done);
    if done {
        run.progress.completed = range.end;
        Some(ChunkProgress {
            completed: run.progress.completed,
            total: run.progress.total,
            retries: run.retries,
        })
    } else {
        run.retries += 1;
        // The engine's WARN says the chunk ran out of memory and what comes next: one WARN
        // a failure.
        tracing::debug!(
            items = ?range,
            budget,
            cost,
            "chunk of items {range:?} did not complete; it is redone smaller if it ran out of memory"
        );
        None
    }
}

/// A chunk while its work runs: dropped by an unwinding panic, it records the chunk as not done.
struct Running<'a> {
    run: &'a Mutex<Run>,
    chunk: Option<(Range<usize>, usize, u64)>,
}

impl<'a> Running<'a> {
    fn new(run: &'a Mutex<Run>, range: Range<usize>, budget: usize, cost: u64) -> Self {
        Running {
            run,
            chunk: Some((range, budget, cost)),
        }
    }

    /// The work returned: its outcome is recorded by the caller, with what it returned.
    fn ended(mut self) {
        self.chunk = None;
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if let Some((range, budget, cost)) = self.chunk.take() {
            record_chunk(self.run, range, budget, cost, false);
        }
    }
}

impl<'r> Chunked<'r> {
    /// With a cache: the budget the run settled on, and the smallest above it that ran out.
    fn remember_budget(&mut self) {
        let Some(cache) = &mut self.cache else {
            return;
        };
        // The last chunk is often short (the items left): an earlier one filled its budget; a
        // run of one chunk proved only what that chunk held.
        let done = || self.chunks.iter().rev().filter(|chunk| chunk.done);
        let settled = done()
            .find(|chunk| chunk.range.end < self.total)
            .map(|chunk| chunk.budget)
            .or_else(|| {
                done()
                    .next()
                    .map(|chunk| usize::try_from(chunk.cost).unwrap_or(usize::MAX))
            });
        let Some(settled) = settled.filter(|&settled| settled > 0) else {
            return;
        };
        // An earlier run's failure still stands unless this run ran that size.
        let failed_above = self
            .chunks
            .iter()
            .filter(|chunk| !chunk.done && chunk.budget > settled)
            .map(|chunk| chunk.budget)
            .chain(cache.failed_at())
            .filter(|&failed| failed > settled)
            .min();
        cache.remember(settled, failed_above);
    }

    /// The run's result, from how its search ended: typed, never a downcast of your error.
    fn conclude<E: AttemptError<M>, M>(
        &mut self,
        run: &Mutex<Run>,
        ended: Ended<Result<(), ChunkAttempt<E>>, E>,
    ) -> Result<(), ChunkError<E>> {
        let (completed, shape) = {
            let mut run = lock(run);
            self.chunks = std::mem::take(&mut run.records);
            self.chunk_count = run.chunks_run;
            (run.progress.completed, run.progress.shape)
        };
        // A run that learned another square term ends with budgets in another unit than the
        // one its key names: nothing is kept for the next run to misread.
        if shape == self.batch_cost {
            self.remember_budget();
        }
        let none_fit = match ended {
            Ended::Returned(Ok(())) => return Ok(()),
            Ended::Returned(Err(ChunkAttempt::Work(error))) => {
                return Err(ChunkError::Failed { completed, error })
            }
            Ended::Returned(Err(ChunkAttempt::WrongOutputCount { range, got })) => {
                return Err(ChunkError::WrongOutputCount {
                    completed,
                    expected: range.len(),
                    range,
                    got,
                })
            }
            Ended::NoSizeFits(none_fit, _) => none_fit,
        };
        // The last chunk that ran out of memory held one item: that item is too large.
        let last_failed = self.chunks.iter().rev().find(|chunk| !chunk.done);
        match last_failed {
            Some(chunk)
                if chunk.range.len() == 1
                    && !matches!(none_fit.reason(), StopReason::InvalidConfiguration(_)) =>
            {
                Err(ChunkError::ItemTooLarge {
                    completed,
                    item: self
                        .ordered
                        .as_ref()
                        .and_then(|ordered| ordered.get(chunk.range.start))
                        .map_or(chunk.range.start, |&(item, _)| item),
                    cost: chunk.cost,
                    largest_failed: chunk.budget,
                })
            }
            _ => Err(ChunkError::NoChunkFits {
                completed,
                error: E::no_size_fits(none_fit),
            }),
        }
    }

    fn drive<E, M>(
        &mut self,
        mut work: impl FnMut(Range<usize>) -> Result<(), ChunkAttempt<E>>,
    ) -> Result<(), ChunkError<E>>
    where
        E: AttemptError<M>,
    {
        if self.total == 0 {
            self.chunks.clear();
            self.chunk_count = 0;
            return Ok(());
        }
        // Lent to this run's policy, and back when it ends.
        let mut shrink = std::mem::take(&mut self.settings.shrink);
        let run = self.new_run();
        let search = self.prepare(shrink.borrowed(), &run);
        let mut on_chunk = self.on_chunk.take();
        let costs = self.costs();
        let finished = drive_ended(
            search.start(),
            &ChunkKind::<E, M>::new(),
            LastError::AsSource,
            |budget| {
                let (range, cost) = begin_chunk(&costs, &run, budget);
                let running = Running::new(&run, range.clone(), budget, cost);
                let outcome = work(range.clone());
                running.ended();
                Self::end_chunk(&run, &mut on_chunk, range, budget, cost, outcome.is_ok());
                outcome
            },
        );
        self.settings.shrink = shrink;
        self.on_chunk = on_chunk;
        self.conclude(&run, finished.published())
    }
}

/// What the chunks of a run cost: the items' costs (in the run's order) and how a chunk of
/// them costs.
struct ChunkCosts<'a> {
    cost: Option<&'a Cost<'a>>,
    /// The run's items with their costs, where the order is not `0..total`.
    ordered: Option<&'a [(usize, u64)]>,
    total: usize,
}

impl<'r> Chunked<'r> {
    fn costs(&self) -> ChunkCosts<'_> {
        ChunkCosts {
            cost: self.cost.as_ref(),
            ordered: self.ordered.as_deref(),
            total: self.total,
        }
    }
}

impl ChunkCosts<'_> {
    /// The items of the chunk at `offset` for `budget`: at least one, then while the chunk's
    /// cost by `shape` (its items padded to the costliest) fits. With its costliest item's.
    fn pack(&self, offset: usize, budget: u64, shape: BatchCost) -> (Range<usize>, u64, u64) {
        let total = self.total;
        let Some(cost) = self.cost else {
            let end = offset.saturating_add(budget.max(1) as usize).min(total);
            return (offset..end, (end - offset) as u64, 1);
        };
        let cost_at = |position: usize| match self.ordered {
            Some(ordered) => ordered[position].1,
            None => cost(position),
        };
        let mut end = offset;
        let (mut costliest, mut spent) = (0u64, 0u64);
        while end < total {
            let longest = costliest.max(cost_at(end));
            let with_it = shape.of(end + 1 - offset, longest);
            if end > offset && with_it > budget {
                break;
            }
            (costliest, spent) = (longest, with_it);
            end += 1;
        }
        (offset..end, spent, costliest)
    }
}

/// The items of the next chunk for `budget`, marked as the one running.
fn begin_chunk(costs: &ChunkCosts<'_>, run: &Mutex<Run>, budget: usize) -> (Range<usize>, u64) {
    let mut run = lock(run);
    let shape = run.progress.shape;
    let (range, spent, longest) = costs.pack(run.progress.completed, budget as u64, shape);
    run.progress.current = range.clone();
    run.progress.current_cost = spent;
    run.progress.current_longest = longest;
    (range, spent)
}
