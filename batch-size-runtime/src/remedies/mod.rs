//! When no batch size fits: the next remedies, in the order you allow.
//!
//! The guides name what comes after the batch size (gradient accumulation, then activation
//! checkpointing, lower precision, a shorter context, an optimizer with less state). Declare
//! the ones you allow, in order, over your own settings type: switches ([`Remedy::switch`]) and
//! numeric knobs with a floor ([`Remedy::knob`]). The search runs the batch size down to `min`
//! first; only when `min` itself runs out of memory is the next remedy applied, and the batch
//! size searched again from `starting` (a remedy such as checkpointing frees much more than one
//! batch step). A knob is lowered one step at a time (halved by default) down to its floor
//! before the next remedy is taken; remedies add up: the ones applied stay in force.
//!
//! - Nothing you did not declare is changed: each attempt's settings are your settings with the
//!   declared changes in force, made afresh.
//! - Every remedy applied is logged at WARN (what, why, the failure's figures), is on each
//!   attempt's record ([`Attempt::remedies`](crate::Attempt::remedies)), and comes back with
//!   the result ([`Remedied`], with why each was applied: [`Remedied::reasons`]).
//! - With a cache key the settings are remembered with the size: a rerun starts from both.
//! - When no remedy is left the search stops with [`StopReason::NoRemedyLeft`](crate::StopReason::NoRemedyLeft), naming every
//!   remedy applied and the figures of the failure that led to each.
//! - A switch declared with [`Remedy::with_saving`] (the share of an attempt's memory it
//!   frees) that cannot close the gap the failure's figures show is applied without a trial of
//!   its own, together with the next one, saying why; the last remedy always gets a trial.
//!
//! ```
//! use batch_size_runtime::{BatchSizeSearch, remedies::Remedies, remedies::Remedy, memory::SimulatedDevice};
//!
//! #[derive(Debug, Clone)]
//! struct Config { checkpointing: bool, bf16: bool, context: usize }
//!
//! let device = SimulatedDevice::new(8 << 30); // 8 GiB
//! let remedies = Remedies::new(Config { checkpointing: false, bf16: false, context: 2048 })
//!     .then(Remedy::switch("activation checkpointing", |c: &mut Config| c.checkpointing = true))
//!     .then(Remedy::switch("bf16", |c: &mut Config| c.bf16 = true));
//!
//! let (steps, ran) = BatchSizeSearch::new(8)
//!     .with_release(device.clone())
//!     .with_remedies(&remedies)
//!     .run(|attempt| {
//!         let config = attempt.settings();
//!         let per_token = if config.checkpointing { 1 << 20 } else { 4 << 20 };
//!         let bytes = if config.bf16 { 1 } else { 2 };
//!         let _weights = device.alloc(bytes * (7 << 29))?; // 3.5 GiB of parameters
//!         let _activations = device.alloc(
//!             bytes * per_token * (attempt.batch_size() * config.context) as u64 / 2,
//!         )?;
//!         Ok::<_, anyhow::Error>(attempt.batch_size())
//!     })?;
//! assert_eq!(ran.applied(), ["activation checkpointing", "bf16"]);
//! assert!(ran.settings().bf16 && ran.settings().context == 2048); // the context: not declared
//! assert_eq!(steps, ran.batch_size());
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::attempt::AttemptError;
use crate::engine::{dispatch::Kept, drive, Search, Settings};

mod control;
mod ladder;

use crate::policy::LadderControl;
use ladder::{Change, Declared, Ladder, DEFAULT_KNOB_FACTOR};

/// One remedy the search may apply when no batch size fits: a switch turned on, or a numeric
/// knob lowered step by step to a floor, over your settings type `S`.
pub struct Remedy<S> {
    declared: Declared<S>,
}

impl<S> fmt::Debug for Remedy<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remedy")
            .field("name", &self.declared.name)
            .field("saving", &self.declared.saving)
            .finish_non_exhaustive()
    }
}

impl<S> Remedy<S> {
    /// A switch, turned on once by `apply` (activation checkpointing, bf16, an 8-bit optimizer).
    ///
    /// ```
    /// use batch_size_runtime::remedies::Remedy;
    /// struct Config { checkpointing: bool }
    /// let remedy = Remedy::switch("activation checkpointing", |c: &mut Config| c.checkpointing = true);
    /// assert_eq!(remedy.name(), "activation checkpointing");
    /// ```
    pub fn switch(name: impl Into<String>, apply: impl Fn(&mut S) + Send + Sync + 'static) -> Self {
        Remedy {
            declared: Declared {
                name: name.into(),
                change: Change::Switch(Box::new(apply)),
                saving: None,
            },
        }
    }

    /// A numeric knob (the context length): read from your settings, lowered by
    /// [`with_factor`](Self::with_factor) (default: halved) a step at a time, never below
    /// [`with_floor`](Self::with_floor) (default 1), and written back by `write`. A knob
    /// already at or below its floor is passed over.
    ///
    /// ```
    /// use batch_size_runtime::remedies::Remedy;
    /// struct Config { context: usize }
    /// let context = Remedy::knob("context length", |c: &Config| c.context, |c: &mut Config, v| c.context = v)
    ///     .with_floor(512);
    /// assert_eq!(context.name(), "context length");
    /// ```
    pub fn knob(
        name: impl Into<String>,
        read: impl Fn(&S) -> usize + Send + Sync + 'static,
        write: impl Fn(&mut S, usize) + Send + Sync + 'static,
    ) -> Self {
        Remedy {
            declared: Declared {
                name: name.into(),
                change: Change::Knob {
                    read: Box::new(read),
                    write: Box::new(write),
                    floor: 1,
                    factor: DEFAULT_KNOB_FACTOR,
                },
                saving: None,
            },
        }
    }

    /// The knob's floor: no value below it is tried (at least 1; 0 stops the search before its
    /// first attempt with [`StopReason::InvalidConfiguration`](crate::StopReason::InvalidConfiguration)).
    /// No effect on a switch.
    ///
    /// ```
    /// # use batch_size_runtime::remedies::Remedy;
    /// # struct Config { context: usize }
    /// let context = Remedy::knob("context", |c: &Config| c.context, |c: &mut Config, v| c.context = v)
    ///     .with_floor(512);
    /// # let _ = context;
    /// ```
    pub fn with_floor(mut self, floor: usize) -> Self {
        if let Change::Knob { floor: kept, .. } = &mut self.declared.change {
            *kept = floor;
        }
        self
    }

    /// The knob's step: each value is the last times `factor`, in (0, 1) (default 0.5), and at
    /// least one lower. No effect on a switch.
    ///
    /// ```
    /// # use batch_size_runtime::remedies::Remedy;
    /// # struct Config { context: usize }
    /// let context = Remedy::knob("context", |c: &Config| c.context, |c: &mut Config, v| c.context = v)
    ///     .with_factor(0.75); // 4096, 3072, 2304, ...
    /// # let _ = context;
    /// ```
    pub fn with_factor(mut self, factor: f64) -> Self {
        if let Change::Knob { factor: kept, .. } = &mut self.declared.change {
            *kept = factor;
        }
        self
    }

    /// The share of an attempt's own memory this switch is expected to free, in (0, 1]
    /// (activation checkpointing: most of the activations; bf16: half of what is in f32). With
    /// the failure's figures the search skips the trial of a switch that cannot close the gap
    /// on its own, applying the next with it. An estimate only steers the order of trials:
    /// the last remedy is always tried.
    ///
    /// ```
    /// # use batch_size_runtime::remedies::Remedy;
    /// # struct Config { bf16: bool }
    /// let bf16 = Remedy::switch("bf16", |c: &mut Config| c.bf16 = true).with_saving(0.5);
    /// # let _ = bf16;
    /// ```
    pub fn with_saving(mut self, share: f64) -> Self {
        self.declared.saving = Some(share);
        self
    }

    /// The remedy's name, as the logs and the report give it.
    pub fn name(&self) -> &str {
        &self.declared.name
    }
}

/// Your settings and the remedies the search may apply to them, in order. Cloning gives
/// another handle on the same state: what a search applied stays in force for the next search
/// with the same `Remedies` (the next training step of an [`EffectiveBatch`](crate::EffectiveBatch)).
///
/// See [the module](self) for the order of the search and an example.
pub struct Remedies<S> {
    ladder: Arc<Mutex<Ladder<S>>>,
}

impl<S> Clone for Remedies<S> {
    fn clone(&self) -> Self {
        Remedies {
            ladder: Arc::clone(&self.ladder),
        }
    }
}

impl<S: Clone + Send + 'static> fmt::Debug for Remedies<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remedies")
            .field("in_force", &self.applied())
            .finish_non_exhaustive()
    }
}

impl<S: Clone + Send + 'static> Remedies<S> {
    /// Your settings, with no remedy in force yet.
    ///
    /// ```
    /// use batch_size_runtime::remedies::Remedies;
    /// let remedies = Remedies::new(2048usize);
    /// assert_eq!(remedies.settings(), 2048);
    /// assert!(remedies.applied().is_empty());
    /// ```
    pub fn new(settings: S) -> Self {
        Remedies {
            ladder: Arc::new(Mutex::new(Ladder::new(settings))),
        }
    }

    /// Allows one more remedy, after the ones already declared.
    ///
    /// ```
    /// use batch_size_runtime::{remedies::Remedies, remedies::Remedy};
    /// #[derive(Clone)]
    /// struct Config { checkpointing: bool, context: usize }
    /// let remedies = Remedies::new(Config { checkpointing: false, context: 4096 })
    ///     .then(Remedy::switch("activation checkpointing", |c: &mut Config| c.checkpointing = true))
    ///     .then(Remedy::knob("context length", |c: &Config| c.context, |c: &mut Config, v| c.context = v)
    ///         .with_floor(512));
    /// # let _ = remedies;
    /// ```
    pub fn then(self, remedy: Remedy<S>) -> Self {
        self.ladder
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .declare(remedy.declared);
        self
    }

    /// The settings with the remedies in force: what the next attempt runs under.
    pub fn settings(&self) -> S {
        self.ladder
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .settings()
            .clone()
    }

    /// The remedies in force, in order (a knob with its value: "context length 1024").
    pub fn applied(&self) -> Vec<String> {
        self.ladder
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_force()
    }

    /// What one attempt gets: its batch size and the settings in force.
    ///
    /// ```
    /// use batch_size_runtime::remedies::Remedies;
    /// let attempt = Remedies::new("fp32").attempt(16);
    /// assert_eq!((attempt.batch_size(), *attempt.settings()), (16, "fp32"));
    /// ```
    pub fn attempt(&self, batch_size: usize) -> Remedied<S> {
        let ladder = self.ladder.lock().unwrap_or_else(PoisonError::into_inner);
        Remedied {
            batch_size,
            settings: ladder.settings().clone(),
            applied: ladder.in_force(),
            reasons: ladder.applied().iter().map(ToString::to_string).collect(),
        }
    }

    /// The state the search's policy and the cache move.
    pub(crate) fn control(&self) -> Arc<dyn LadderControl> {
        Arc::clone(&self.ladder) as Arc<dyn LadderControl>
    }
}

/// One attempt's batch size and the settings it runs under, as a [`BatchPlan`](crate::BatchPlan)
/// carries the micro-batches: the first parameter of a function searched with remedies, and
/// what comes back with the value of the attempt that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Remedied<S> {
    batch_size: usize,
    settings: S,
    applied: Vec<String>,
    reasons: Vec<String>,
}

impl<S> Remedied<S> {
    /// The batch size of this attempt.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The settings of this attempt: yours, with the remedies in force.
    pub fn settings(&self) -> &S {
        &self.settings
    }

    /// The settings, by value.
    pub fn into_settings(self) -> S {
        self.settings
    }

    /// The remedies in force, in order ("activation checkpointing", "context length 1024");
    /// empty when none was needed.
    pub fn applied(&self) -> &[String] {
        &self.applied
    }

    /// Each remedy applied, in order, with the failure that led to it and its figures, as
    /// [`StopReason::NoRemedyLeft`](crate::StopReason::NoRemedyLeft) names them when none is
    /// left: "activation checkpointing (batch size 1 ran out of memory, needing at least …)". A
    /// knob lowered twice is there twice; empty when none was needed.
    ///
    /// ```
    /// use batch_size_runtime::{BatchSizeSearch, OutOfMemory, remedies::Remedies, remedies::Remedy};
    ///
    /// let remedies = Remedies::new(false)
    ///     .then(Remedy::switch("activation checkpointing", |on: &mut bool| *on = true));
    /// let (_, ran) = BatchSizeSearch::new(4)
    ///     .with_remedies(&remedies)
    ///     .run(|attempt| {
    ///         if !*attempt.settings() { Err(OutOfMemory::new())? }
    ///         Ok::<_, anyhow::Error>(attempt.batch_size())
    ///     })?;
    /// assert_eq!(
    ///     ran.reasons(),
    ///     ["activation checkpointing (batch size 1 ran out of memory)"]
    /// );
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn reasons(&self) -> &[String] {
        &self.reasons
    }
}

/// A [`BatchSizeSearch`](crate::BatchSizeSearch) with remedies: each attempt gets a
/// [`Remedied`] (see [`BatchSizeSearch::with_remedies`](crate::BatchSizeSearch::with_remedies)).
#[derive(Debug)]
#[must_use = "a search does nothing until it is run"]
pub struct RemediedSearch<'r, S: Clone + Send + 'static> {
    starting: usize,
    settings: Settings<'r>,
    remedies: Remedies<S>,
}

impl<'r, S: Clone + Send + 'static> RemediedSearch<'r, S> {
    /// The search from `starting` with `settings`, the remedies allowed.
    pub(crate) fn new(starting: usize, mut settings: Settings<'r>, remedies: &Remedies<S>) -> Self {
        settings.remedies = Some(remedies.control());
        RemediedSearch {
            starting,
            settings,
            remedies: remedies.clone(),
        }
    }

    /// Runs the search: as [`BatchSizeSearch::run`](crate::BatchSizeSearch::run), with each
    /// attempt given its batch size and settings. Returns the value of the attempt that ran
    /// with that attempt's [`Remedied`] (its size, settings and the remedies in force). When no
    /// size fits even with every remedy, `E::from(NoExecutableBatchSize)` with
    /// [`StopReason::NoRemedyLeft`](crate::StopReason::NoRemedyLeft).
    pub fn run<T, E, M, F>(self, mut attempt: F) -> Result<(T, Remedied<S>), E>
    where
        F: FnMut(Remedied<S>) -> Result<T, E>,
        E: AttemptError<M>,
    {
        let remedies = &self.remedies;
        drive(
            Search::start(self.starting, self.settings),
            Kept::<E, M>::new(),
            Kept::<E, M>::new(),
            |batch_size| {
                let remedied = remedies.attempt(batch_size);
                attempt(remedied.clone()).map(|value| (value, remedied))
            },
        )
    }
}
