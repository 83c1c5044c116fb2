//! What every runner is configured with, written once: each runner holds one [`Settings`] and
//! gets the setters of the groups it honours from [`settings_setters!`].

use std::path::PathBuf;
use std::sync::Arc;

use crate::agree::Collective;
use crate::engine::Hooks;
use crate::memory::Release;
use crate::policy::{CacheSettings, CacheSlot, Guided, LadderControl, Reduction, SizePolicy};
use crate::record::CacheHit;

/// A setting that cannot produce a size, reported before the first attempt as
/// [`StopReason::InvalidConfiguration`](crate::StopReason::InvalidConfiguration)'s text.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Invalid {
    /// `min` of 0.
    MinIsZero,
    /// `max` of 0.
    MaxIsZero,
    /// `max` below `min`.
    MaxBelowMin { min: usize, max: usize },
    /// `with_max_attempts(0)`.
    MaxAttemptsIsZero,
    /// An attribute's argument that is not a batch size (negative): its name and value.
    NotABatchSize {
        setting: &'static str,
        value: String,
    },
    /// `EffectiveBatch::new(0)`, or the attribute's `effective = 0`.
    EffectiveIsZero,
    /// Uneven shares of a global batch smaller than the ranks.
    FewerSamplesThanRanks { effective: usize, ranks: usize },
    /// Remedies and an agreement between ranks on one search.
    RemediesWithAgreement,
    /// A step by cost with an item of cost 0 (its index).
    ItemCostIsZero(usize),
    /// A step by cost with no items.
    NoItems,
    /// Steps by count and by cost on one `EffectiveBatch` (their sizes are in other units), or
    /// a step by cost with uneven shares.
    MixedUnits,
    /// The tuner's `with_headroom` outside [0, 1).
    Headroom(f64),
    /// The tuner's `with_tolerance` outside [0, 1).
    Tolerance(f64),
    /// The tuner's `with_max_trials(0)`.
    MaxTrialsIsZero,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::MinIsZero => f.write_str("`min` must be at least 1, got 0"),
            Invalid::MaxIsZero => f.write_str("`max` must be at least 1, got 0"),
            Invalid::MaxBelowMin { min, max } => {
                write!(f, "`max` ({max}) must not be below `min` ({min})")
            }
            Invalid::MaxAttemptsIsZero => f.write_str("`max_attempts` must be at least 1, got 0"),
            Invalid::NotABatchSize { setting, value } => {
                write!(
                    f,
                    "`{setting}` must be a non-negative batch size, got {value}"
                )
            }
            Invalid::EffectiveIsZero => f.write_str("`effective` must be at least 1, got 0"),
            Invalid::FewerSamplesThanRanks { effective, ranks } => write!(
                f,
                "uneven shares need a global batch of at least one sample a rank: `effective` \
                 is {effective} for {ranks} ranks"
            ),
            Invalid::ItemCostIsZero(item) => write!(
                f,
                "item {item} has a cost of 0: give every item its cost (its length, at least 1)"
            ),
            Invalid::NoItems => f.write_str("a step by cost needs at least one item, got none"),
            Invalid::MixedUnits => f.write_str(
                "one `EffectiveBatch` steps either by count (`step`) or by cost (`step_by_cost`), \
                 not both, and a step by cost takes no uneven shares: use one runner for each",
            ),
            Invalid::RemediesWithAgreement => f.write_str(
                "remedies are not agreed between ranks yet: use remedies on one rank, or no \
                 agreement",
            ),
            Invalid::Headroom(headroom) => write!(
                f,
                "`headroom` must be at least 0 and below 1, got {headroom}"
            ),
            Invalid::Tolerance(tolerance) => write!(
                f,
                "`tolerance` must be at least 0 and below 1, got {tolerance}"
            ),
            Invalid::MaxTrialsIsZero => f.write_str("`max_trials` must be at least 1, got 0"),
        }
    }
}

/// Everything a runner is configured with, and everything a search runs with.
#[derive(Debug)]
pub(crate) struct Settings<'r> {
    /// No size below it is tried (at least 1).
    pub(crate) min: usize,
    /// No size above it is tried (`with_max`).
    pub(crate) max: Option<usize>,
    /// The largest size the batch-size parameter's type holds (the attribute's `u8`, ...).
    pub(crate) type_max: usize,
    /// At most this many attempts in one search.
    pub(crate) max_attempts: Option<usize>,
    /// How the next size is chosen after an out-of-memory failure.
    pub(crate) shrink: Reduction<'r>,
    /// A policy of the user's or a runner's instead (`with_policy`), until a shrink setter.
    pub(crate) policy: Option<Box<dyn SizePolicy + 'r>>,
    /// What gives memory back between attempts and reads the figures ([`Release::default`]).
    pub(crate) release: Release,
    /// Where the sizes that fit are remembered, if anywhere.
    pub(crate) cache: Option<CacheSettings>,
    /// The other ranks the runner agrees with, if any.
    pub(crate) agreement: Option<Arc<dyn Collective + 'r>>,
    /// The remedies allowed when no size fits, and the size to start again from after one.
    pub(crate) remedies: Option<Arc<dyn LadderControl>>,
    pub(crate) restart_after_remedy: Option<usize>,
    /// Whether a runner of many searches learns from every one (where figures are read).
    pub(crate) learn: bool,
    /// Clean searches before a runner of many searches grows back blindly (0: never).
    pub(crate) grow_after: usize,
    /// The name in the logs: the one given, else [`name_the_work`](Self::name_the_work)'s.
    pub(crate) label: &'static str,
    /// The per-search hooks (`when`, `notify`, `on_report`, a clock), boxed until one is set.
    pub(crate) hooks: Option<Box<Hooks<'r>>>,
    /// Searches run once per step or chunk log a first-try success at DEBUG, not INFO.
    pub(crate) first_fit_at_debug: bool,
    /// The size a cache wrapper (`policy::Cached`) starts from and its entry, for the report.
    pub(crate) cache_offer: Option<(usize, CacheHit)>,
    /// The first setting found unusable.
    pub(crate) invalid: Option<Invalid>,
}

impl Default for Settings<'_> {
    fn default() -> Self {
        Settings {
            min: 1,
            max: None,
            type_max: usize::MAX,
            max_attempts: None,
            shrink: Reduction::default(),
            policy: None,
            release: Release::default(),
            cache: None,
            agreement: None,
            remedies: None,
            restart_after_remedy: None,
            learn: true,
            grow_after: 0,
            label: DEFAULT_LABEL,
            hooks: None,
            first_fit_at_debug: false,
            cache_offer: None,
            invalid: None,
        }
    }
}

impl<'r> Settings<'r> {
    /// Keeps the first problem found.
    pub(crate) fn invalidate(&mut self, why: Invalid) {
        self.invalid.get_or_insert(why);
    }

    pub(crate) fn set_min(&mut self, min: usize) {
        if min == 0 {
            self.invalidate(Invalid::MinIsZero);
        }
        self.min = min.max(1);
    }

    pub(crate) fn set_max(&mut self, max: usize) {
        if max == 0 {
            self.invalidate(Invalid::MaxIsZero);
        }
        self.max = Some(max.max(1));
    }

    pub(crate) fn set_max_attempts(&mut self, max_attempts: usize) {
        if max_attempts == 0 {
            self.invalidate(Invalid::MaxAttemptsIsZero);
        }
        self.max_attempts = Some(max_attempts.max(1));
    }

    pub(crate) fn set_shrink(&mut self, shrink: Reduction<'r>) {
        self.policy = None;
        self.shrink = shrink;
    }

    pub(crate) fn set_factor(&mut self, factor: f64) {
        self.set_shrink(Reduction::Factor(factor));
    }

    pub(crate) fn set_margin(&mut self, margin: f64) {
        self.set_shrink(Reduction::Guided(Guided::new().with_margin(margin)));
    }

    pub(crate) fn set_cache_key(&mut self, key: String) {
        let dir = self.cache.take().and_then(|cache| cache.dir);
        self.cache = Some(CacheSettings { key, dir });
    }

    pub(crate) fn set_cache_dir(&mut self, dir: PathBuf) {
        let key = self.cache.take().map(|cache| cache.key).unwrap_or_default();
        self.cache = Some(CacheSettings {
            key,
            dir: Some(dir),
        });
    }

    /// The hooks, made where the first is set.
    pub(crate) fn hooks_mut(&mut self) -> &mut Hooks<'r> {
        self.hooks.get_or_insert_with(Box::default)
    }

    /// The cache, where a key was given (a folder alone caches nothing).
    pub(crate) fn cache(&self) -> Option<&CacheSettings> {
        self.cache.as_ref().filter(|cache| !cache.key.is_empty())
    }

    /// The cache slot of a runner of many searches (`door`, for `what`), where a key was given.
    pub(crate) fn open_cache(&self, door: &'static str, what: &str) -> Option<CacheSlot> {
        self.cache()
            .map(|cache| CacheSlot::for_runner(cache, door, what, &self.release))
    }

    /// Names the logs after the function `work` was written in, where no label was given.
    pub(crate) fn name_the_work<W>(&mut self, _work: &W) {
        if self.label == DEFAULT_LABEL {
            self.label = work_name::<W>().unwrap_or(DEFAULT_LABEL);
        }
    }

    /// What a runner of many searches hands each: bounds, attempt cap, release, label, and the
    /// first unusable setting (the rest it lends where its searches use them).
    pub(crate) fn lend_to_search(&self, search: &mut Settings<'_>) {
        search.min = self.min;
        search.max = self.max;
        search.max_attempts = self.max_attempts;
        search.release = self.release.clone();
        search.label = self.label;
        search.invalid = self.invalid.clone();
        search.first_fit_at_debug = true;
    }

    /// Checks what only the whole can say, `max` against `min`, where a search starts.
    pub(crate) fn check(&mut self) {
        if let Some(max) = self.max {
            if max < self.min {
                self.invalidate(Invalid::MaxBelowMin { min: self.min, max });
            }
        }
    }
}

/// The label of a search no one named, and no work could name.
pub(crate) const DEFAULT_LABEL: &str = "batch_size_search";

/// The path of the function a closure of type `W` was written in, or a function item's own.
fn work_name<W>() -> Option<&'static str> {
    let mut name = std::any::type_name::<W>();
    while let Some(outer) = name.strip_suffix("::{{closure}}") {
        name = outer;
    }
    // A closure's type name may carry generic arguments of its function: not part of a name.
    let name = name.split('<').next().unwrap_or(name);
    (!name.is_empty()).then_some(name)
}

/// The setters of the settings' groups, for a runner that holds `settings: Settings`:
/// - `bounds`: `with_min`, `with_max`;
/// - `label`: `with_label`;
/// - `clock`: `with_clock`;
/// - `release`: `with_release`, `with_cache`, `with_cache_dir`;
/// - `shrink`: `with_factor`, `with_reduce`, `with_margin`;
/// - `learning`: `with_convergence`, `with_grow_after`;
/// - `agreement`: `with_agreement`.
macro_rules! settings_setters {
    // One setter: its doc, then an example calling it on the runner's constructor, then the
    // method, which changes the settings (bound to `$settings` in `$change`).
    (@setter $new:literal, $call:literal, $(#[$doc:meta])*
        fn $name:ident($value:ident: $ty:ty) |$settings:ident| $change:expr_2021) => {
        $(#[$doc])*
        ///
        /// ```
        #[doc = concat!("let runner = batch_size_runtime::", $new, ".", $call, ";")]
        /// # let _ = runner;
        /// ```
        pub fn $name(mut self, $value: $ty) -> Self {
            let $settings = &mut self.settings;
            $change;
            self
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, bounds) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_min(8)",
                /// The smallest size tried (default 1). 0 is refused: the runner stops before
                /// its first attempt with
                /// [`StopReason::InvalidConfiguration`](crate::StopReason::InvalidConfiguration).
                fn with_min(min: usize) |settings| settings.set_min(min));

            settings_setters!(@setter $new, "with_max(512)",
                /// The largest size tried, where the runner grows (default: no cap but the
                /// work's own size). 0, or a `max` below `min`, is refused as `with_min(0)` is.
                fn with_max(max: usize) |settings| settings.set_max(max));
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, release) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_release(batch_size_runtime::Release::none())",
                /// What gives device memory back between attempts, and reads the figures the
                /// search is guided by: anything `Into<`[`Release`](crate::Release)`>` (a
                /// [`SimulatedDevice`](crate::memory::SimulatedDevice), your
                /// [`MemoryBackend`](crate::memory::MemoryBackend); default:
                /// [`Release::cuda()`](crate::Release::cuda)).
                fn with_release(release: impl Into<crate::memory::Release>)
                    |settings| settings.release = release.into());

            settings_setters!(@setter $new, "with_cache(\"my-model on a100\")",
                /// Remembers the size that fit under `key` (with what the runner runs and the
                /// device's name and total memory), in this process and, with
                /// [`with_cache_dir`](Self::with_cache_dir) or
                /// [`BATCH_SIZE_CACHE_DIR`](crate::policy::CACHE_DIR_VARIABLE), on disk: the
                /// next run with the same key (a training run resumed from its checkpoint)
                /// starts at that size, with no out-of-memory on the way. See
                /// [`CacheEntry`](crate::policy::CacheEntry).
                fn with_cache(key: impl Into<String>) |settings| settings.set_cache_key(key.into()));

            settings_setters!(@setter $new, "with_cache(\"key\").with_cache_dir(std::env::temp_dir())",
                /// The folder of the cache's files (with [`with_cache`](Self::with_cache);
                /// alone it caches nothing).
                fn with_cache_dir(dir: impl Into<std::path::PathBuf>)
                    |settings| settings.set_cache_dir(dir.into()));
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, shrink) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_factor(0.5)",
                /// Multiplies the size by `factor` (0 < f < 1) after each out-of-memory
                /// failure, rounding down: `0.9` is Accelerate 1.x, `0.5` toma's and
                /// Composer's halving. A factor outside (0, 1) stops the runner before its
                /// first attempt with
                /// [`StopReason::InvalidConfiguration`](crate::StopReason::InvalidConfiguration).
                fn with_factor(factor: f64) |settings| settings.set_factor(factor));

            settings_setters!(@setter $new, "with_reduce(|failed| failed.batch_size - 8)",
                /// Picks the next size with your function of the failed attempt
                /// ([`FailedAttempt`](crate::policy::FailedAttempt): its size, number, error
                /// and memory figures). It must return a smaller size; anything else stops the
                /// search with [`StopReason::NotSmaller`](crate::StopReason::NotSmaller).
                fn with_reduce(
                    reduce: impl FnMut(&crate::policy::FailedAttempt<'_>) -> usize + Send + $($life)?
                ) |settings| settings.set_shrink(crate::policy::Reduction::Custom(Box::new(reduce))));

            settings_setters!(@setter $new, "with_margin(0.1)",
                /// The margin of the default guided policy
                /// ([`Guided`](crate::policy::Guided)): the share of the device kept free when
                /// it estimates the next size from a failure's figures (default 0.05;
                /// 0 ≤ margin < 1, otherwise the runner stops before its first attempt with
                /// [`StopReason::InvalidConfiguration`](crate::StopReason::InvalidConfiguration)).
                /// Selects the guided policy if another was chosen.
                fn with_margin(margin: f64) |settings| settings.set_margin(margin));
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, label) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_label(\"train_gpt2\")",
                /// The name its log lines carry (`function="train_gpt2"`). Default: the path of
                /// the function your closure is written in (`my_crate::train`), as the
                /// attribute logs the function it annotates.
                fn with_label(label: &'static str) |settings| settings.label = label);
        }
    };
    ($runner:ident <$life:lifetime>, $new:literal, clock) => {
        settings_setters!(@clock $runner<$life>, $new, $life);
    };
    ($runner:ident, $new:literal, clock) => {
        settings_setters!(@clock $runner, $new, 'static);
    };
    (@clock $runner:ident $(<$life:lifetime>)?, $new:literal, $bound:lifetime) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_clock(|| std::time::Duration::from_millis(1))",
                /// What times the attempts ([`Attempt::duration`](crate::Attempt::duration): a
                /// tuner's trials and their throughput, the steps whose uneven shares follow
                /// speed): the time since any fixed instant, read before and after each
                /// (default: [`Instant`](std::time::Instant)). A simulated clock makes throughput
                /// and balance testable without real speeds; one that synchronizes the device
                /// first makes it exact where the device runs asynchronously.
                fn with_clock(clock: impl FnMut() -> std::time::Duration + Send + $bound)
                    |settings| settings.hooks_mut().clock = Some(Box::new(clock)));
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, learning) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new, "with_convergence(false)",
                /// Whether the runner learns from every search (default: on). With a release
                /// that reads figures (CUDA's pool counters, a
                /// [`SimulatedDevice`](crate::memory::SimulatedDevice), the host's memory),
                /// each success's peak and the memory in use before it fit memory against the
                /// size, and the next search starts at the size that takes the fewest passes
                /// the figures say fit. A growth attempt that runs out of memory is redone in
                /// place at the size that fitted, and not tried again for 16 searches (32, 64,
                /// ... while it keeps failing). It reads the allocator's counters once after
                /// each success: no synchronize, no trim. Without figures nothing is learned:
                /// the size that fitted is kept ([`with_grow_after`](Self::with_grow_after)
                /// grows back blindly).
                fn with_convergence(learn: bool) |settings| settings.learn = learn);

            settings_setters!(@setter $new, "with_grow_after(4)",
                /// After `successes` clean searches in a row, tries a larger size again:
                /// double, capped, while twice the size stays below the smallest size that ran
                /// out of memory; that size itself is tried again once it has held growth back
                /// for 16 searches (32, 64, ... while it keeps failing). 0 never grows.
                fn with_grow_after(successes: usize) |settings| settings.grow_after = successes);
        }
    };
    ($runner:ident $(<$life:lifetime>)?, $new:literal, agreement) => {
        impl$(<$life>)? $runner$(<$life>)? {
            settings_setters!(@setter $new,
                "with_agreement(batch_size_runtime::agree::ThreadRanks::new(1).remove(0))",
                /// Agrees with the other ranks of a data-parallel job through `collective` (a
                /// [`ThreadRank`](crate::agree::ThreadRank), an
                /// `NcclRank` with the `nccl` feature, yours; borrowed, boxed or shared), so
                /// that every rank runs the same sizes: an out-of-memory on any rank makes every
                /// rank release and retry at the smallest size the ranks propose, and an error
                /// on one stops the others naming it. A [`BatchSizeSearch`](crate::BatchSizeSearch)
                /// agrees after every attempt, an [`EffectiveBatch`](crate::EffectiveBatch) on
                /// every step (with [`step_then`](crate::EffectiveBatch::step_then), whose
                /// `apply` is the safe point), a [`Chunked`](crate::Chunked) run after every
                /// chunk (a chunk that failed anywhere is redone everywhere). Not with remedies
                /// (refused before the first attempt). See [`agree`](crate::agree).
                fn with_agreement(collective: impl crate::agree::Collective $(+ $life)?)
                    |settings| settings.agreement = Some(std::sync::Arc::new(collective)));
        }
    };
    ($runner:ident <$life:lifetime>, $new:literal, $($group:ident),+) => {
        $(settings_setters!($runner<$life>, $new, $group);)+
    };
    ($runner:ident, $new:literal, $($group:ident),+) => {
        $(settings_setters!($runner, $new, $group);)+
    };
}

pub(crate) use settings_setters;
