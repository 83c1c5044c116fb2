//! The remedies' state: which of the declared remedies are in force, at which value, and the
//! settings that makes. Shared between the search's policy (which moves up the ladder when no
//! batch size is left) and the attempt (which runs under the settings), behind one lock.

use crate::memory::Bytes;
use crate::policy::Applied;
use crate::record::Attempt;

/// The default step of a numeric knob: halve it (as the batch size without figures).
pub(crate) const DEFAULT_KNOB_FACTOR: f64 = 0.5;

type Apply<S> = Box<dyn Fn(&mut S) + Send + Sync>;
type Read<S> = Box<dyn Fn(&S) -> usize + Send + Sync>;
type Write<S> = Box<dyn Fn(&mut S, usize) + Send + Sync>;

/// What a remedy changes.
pub(crate) enum Change<S> {
    /// Turned on once (activation checkpointing, bf16, an 8-bit optimizer).
    Switch(Apply<S>),
    /// Lowered step by step to a floor (the context length).
    Knob {
        read: Read<S>,
        write: Write<S>,
        floor: usize,
        factor: f64,
    },
}

/// One declared remedy (see [`Remedy`](super::Remedy), its public face).
pub(crate) struct Declared<S> {
    pub(crate) name: String,
    pub(crate) change: Change<S>,
    /// The share of an attempt's own memory it is expected to free, if the user said.
    pub(crate) saving: Option<f64>,
}

/// The declared remedies, the level of each (`None`: not in force; a switch's level is 1, a
/// knob's its value) and the settings they make from the user's own.
pub(crate) struct Ladder<S> {
    base: S,
    declared: Vec<Declared<S>>,
    levels: Vec<Option<usize>>,
    current: S,
    applied: Vec<Applied>,
}

impl<S: Clone> Ladder<S> {
    pub(crate) fn new(base: S) -> Self {
        Ladder {
            current: base.clone(),
            base,
            declared: Vec::new(),
            levels: Vec::new(),
            applied: Vec::new(),
        }
    }

    pub(crate) fn declare(&mut self, remedy: Declared<S>) {
        self.declared.push(remedy);
        self.levels.push(None);
    }

    pub(crate) fn settings(&self) -> &S {
        &self.current
    }

    pub(crate) fn applied(&self) -> &[Applied] {
        &self.applied
    }

    pub(crate) fn levels(&self) -> &[Option<usize>] {
        &self.levels
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.declared.iter().map(|remedy| remedy.name.as_str())
    }

    /// Why the remedies cannot run as declared, if they cannot.
    pub(crate) fn check(&self) -> Result<(), String> {
        for remedy in &self.declared {
            if let Some(saving) = remedy.saving {
                if !(saving > 0.0 && saving <= 1.0) {
                    return Err(format!(
                        "the remedy `{}` is said to save {saving} of an attempt's memory: a share in (0, 1]",
                        remedy.name
                    ));
                }
            }
            if let Change::Knob { floor, factor, .. } = &remedy.change {
                if *floor == 0 {
                    return Err(format!(
                        "the remedy `{}` has a floor of 0: at least 1",
                        remedy.name
                    ));
                }
                if !(*factor > 0.0 && *factor < 1.0) {
                    return Err(format!(
                        "the remedy `{}` steps by a factor of {factor}: it must be in (0, 1)",
                        remedy.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// The remedies in force, in order ("activation checkpointing, context length 1024").
    pub(crate) fn in_force(&self) -> Vec<String> {
        self.declared
            .iter()
            .zip(&self.levels)
            .filter_map(|(remedy, level)| {
                level.map(|value| match remedy.change {
                    Change::Switch(_) => remedy.name.clone(),
                    Change::Knob { .. } => format!("{} {value}", remedy.name),
                })
            })
            .collect()
    }

    pub(crate) fn describe(&self) -> Option<String> {
        let in_force = self.in_force();
        (!in_force.is_empty()).then(|| in_force.join(", "))
    }

    /// The settings made again from the user's own and the levels: nothing that was not
    /// declared is ever touched.
    fn rebuild(&mut self) {
        let mut settings = self.base.clone();
        for (remedy, level) in self.declared.iter().zip(&self.levels) {
            match (&remedy.change, level) {
                (Change::Switch(apply), Some(_)) => apply(&mut settings),
                (Change::Knob { write, .. }, Some(value)) => write(&mut settings, *value),
                (_, None) => {}
            }
        }
        self.current = settings;
    }

    /// Puts back levels read from the cache. Levels of another ladder (another length, a knob
    /// below its floor or above the user's value) are refused, and nothing changes.
    pub(crate) fn restore(&mut self, levels: &[Option<usize>]) -> bool {
        if levels.len() != self.declared.len() {
            return false;
        }
        let valid =
            self.declared
                .iter()
                .zip(levels)
                .all(|(remedy, level)| match (&remedy.change, level) {
                    (_, None) => true,
                    (Change::Switch(_), Some(value)) => *value == 1,
                    (Change::Knob { read, floor, .. }, Some(value)) => {
                        (*floor..read(&self.base)).contains(value)
                    }
                });
        if valid {
            self.levels = levels.to_vec();
            self.rebuild();
            // Said as applied, so that a search that still finds no size names them too.
            self.applied = self
                .in_force()
                .into_iter()
                .map(|what| Applied {
                    what,
                    why: "restored from the cache: a size fit with it before".to_owned(),
                })
                .collect();
        }
        valid
    }

    /// The next step up the ladder after `failure` (the attempt at the smallest size, which ran
    /// out of memory): the next level of the knob in use, else the next remedy in order. A
    /// switch whose declared saving cannot close the gap the failure's figures show is applied
    /// without a trial of its own, and the next one with it (their savings add up); the last
    /// remedy always gets a trial. `None` when every remedy is at its end.
    pub(crate) fn advance(&mut self, failure: Option<&Attempt>) -> Option<Vec<Applied>> {
        let gap = failure.and_then(Gap::of);
        let because = failure.map_or_else(
            || "no batch size was left".to_owned(),
            |attempt| {
                let mut why = format!("batch size {} ran out of memory", attempt.batch_size);
                if let Some(gap) = &gap {
                    why.push_str(&format!(
                        ", needing at least {} of {}",
                        Bytes(gap.needed),
                        Bytes(gap.total)
                    ));
                }
                why
            },
        );
        let mut steps = Vec::new();
        let mut estimated_saving = 0u64;
        while let Some(index) = self.next_movable() {
            let remedy = &self.declared[index];
            let (level, what, estimate) = match &remedy.change {
                Change::Switch(_) => (1, remedy.name.clone(), remedy.saving),
                Change::Knob {
                    read,
                    floor,
                    factor,
                    ..
                } => {
                    let now = self.levels[index].unwrap_or_else(|| read(&self.base));
                    let stepped = ((now as f64) * factor).floor() as usize;
                    let next = stepped.min(now.saturating_sub(1)).max(*floor);
                    (next, format!("{} {next}", remedy.name), None)
                }
            };
            self.levels[index] = Some(level);
            let mut why = because.clone();
            let saving = match (estimate, &gap) {
                (Some(share), Some(gap)) => {
                    let saving = (share * gap.own as f64) as u64;
                    estimated_saving = estimated_saving.saturating_add(saving);
                    Some(saving)
                }
                _ => None,
            };
            let short = match (saving, &gap) {
                (Some(_), Some(gap)) if estimated_saving < gap.over => Some(gap.over),
                _ => None,
            };
            let skip_trial = short.is_some() && self.next_movable().is_some();
            if let (Some(over), true) = (short, skip_trial) {
                why.push_str(&format!(
                    "; applied without a trial of its own: it saves about {} with what came before, short of the {} over the device, so the next remedy comes with it",
                    Bytes(estimated_saving),
                    Bytes(over)
                ));
            }
            steps.push(Applied { what, why });
            if !skip_trial {
                break;
            }
        }
        if steps.is_empty() {
            return None;
        }
        self.rebuild();
        self.applied.extend(steps.iter().cloned());
        Some(steps)
    }

    /// The remedy that moves next: the latest in force if it is a knob above its floor, else
    /// the first after it that can change (a knob already at or below its floor cannot).
    fn next_movable(&self) -> Option<usize> {
        let frontier = self.levels.iter().rposition(Option::is_some);
        if let Some(index) = frontier {
            if let (Change::Knob { floor, .. }, Some(value)) =
                (&self.declared[index].change, self.levels[index])
            {
                if value > *floor {
                    return Some(index);
                }
            }
        }
        let from = frontier.map_or(0, |index| index + 1);
        (from..self.declared.len()).find(|&index| match &self.declared[index].change {
            Change::Switch(_) => true,
            Change::Knob { read, floor, .. } => read(&self.base) > *floor,
        })
    }
}

/// How far past the device a failed attempt was, from its figures.
struct Gap {
    /// Bytes it needed at least (in use when it failed plus what it asked for).
    needed: u64,
    total: u64,
    /// `needed` over the device.
    over: u64,
    /// What of `needed` the attempt itself held (without what was in use before it started).
    own: u64,
}

impl Gap {
    fn of(attempt: &Attempt) -> Option<Gap> {
        if !attempt.outcome.is_out_of_memory() {
            return None;
        }
        let figures = &attempt.figures;
        let needed = figures.needed_at_least()?;
        let total = figures.total?;
        Some(Gap {
            needed,
            total,
            over: needed.saturating_sub(total),
            own: needed.saturating_sub(figures.held_at_start.unwrap_or(0)),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Config {
        checkpointing: bool,
        bf16: bool,
        context: usize,
        seed: u64,
    }

    fn ladder() -> Ladder<Config> {
        let mut ladder = Ladder::new(Config {
            checkpointing: false,
            bf16: false,
            context: 4096,
            seed: 7,
        });
        ladder.declare(Declared {
            name: "activation checkpointing".into(),
            change: Change::Switch(Box::new(|c: &mut Config| c.checkpointing = true)),
            saving: None,
        });
        ladder.declare(Declared {
            name: "context length".into(),
            change: Change::Knob {
                read: Box::new(|c: &Config| c.context),
                write: Box::new(|c: &mut Config, v| c.context = v),
                floor: 512,
                factor: DEFAULT_KNOB_FACTOR,
            },
            saving: None,
        });
        ladder.declare(Declared {
            name: "bf16".into(),
            change: Change::Switch(Box::new(|c: &mut Config| c.bf16 = true)),
            saving: None,
        });
        ladder
    }

    #[test]
    fn the_ladder_goes_in_order_and_a_knob_stops_at_its_floor() {
        let mut ladder = ladder();
        let mut seen = Vec::new();
        while let Some(steps) = ladder.advance(None) {
            seen.extend(steps.into_iter().map(|step| step.what));
            assert_eq!(ladder.settings().seed, 7); // undeclared: untouched
        }
        assert_eq!(
            seen,
            [
                "activation checkpointing",
                "context length 2048",
                "context length 1024",
                "context length 512",
                "bf16"
            ]
        );
        assert_eq!(
            ladder.describe().unwrap(),
            "activation checkpointing, context length 512, bf16"
        );
        assert!(ladder.advance(None).is_none());
    }

    #[test]
    fn levels_restore_and_foreign_levels_are_refused() {
        let mut ladder = ladder();
        assert!(ladder.restore(&[Some(1), Some(1024), None]));
        assert_eq!(ladder.settings().context, 1024);
        assert!(ladder.settings().checkpointing && !ladder.settings().bf16);
        assert!(!ladder.restore(&[Some(1), Some(256), None])); // below the floor
        assert!(!ladder.restore(&[Some(1)])); // another ladder
        assert_eq!(ladder.settings().context, 1024);
    }
}
