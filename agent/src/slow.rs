//! The slow-rank detector: a pure machine fed each rank's step times (the
//! control pages' phase sums) and the steps they were read at; it names
//! the ranks that hold the job back, the phase that grew, by how much and
//! since when.
//!
//! A rank's times close a window every [`WINDOW`] steps, and not before
//! they span [`WINDOW_MIN_MS`]: its mean ms per step in each phase. Short
//! steps are noisy: the operating system's scheduler shares a busy core
//! in slices of milliseconds, and a rank that lost a few of them in a
//! tenth of a second was not slowed; over half a second that averages out. Once every rank has closed a window, the detector
//! compares each rank with the others in the same steps:
//!
//! - its own work (data, compute and update) exceeds the others' median
//!   by at least [`MIN_EFFECT`] of the job's step, and
//! - the others waited for it: their collective time exceeds its own by
//!   at least half that excess (a rank that is merely given more work in
//!   a step everyone waits for anyway is not slow), and
//! - its work grew against its own history by at least [`MIN_EFFECT`] of
//!   the step: a rank is judged once [`HISTORY`] windows of it were seen
//!   not slow (their moving mean is its history), so that a lasting
//!   difference between ranks that was always there (one rank's extra
//!   work, a scheduler's lasting preference under load) is not a change.
//!
//! A rank slow in [`CONFIRM`] windows in a row is a finding (a change
//! point with a minimum effect: one slow window is noise); slow in none of
//! [`CONFIRM`] windows in a row, the finding ends. A slowdown of every
//! rank together (the host, the network) raises nothing: no rank stands
//! out from the others. The phase named is the one that grew most against
//! the others; the rank's own history (its work before the finding) says
//! how much it grew. With the ranks' hosts known (a controller's detector,
//! over every host's ranks), every rank of one host slow and no other is
//! that host. The others' medians come from each phase's values sorted
//! once per window: O(n log n) for n ranks.

use hatrain_shared::shm::{StepPhase, StepTimes};
use hatrain_shared::slowness::SlowFinding;
use std::collections::{BTreeMap, BTreeSet};

/// Steps per window, at least.
pub const WINDOW: u64 = 10;
/// The least time a window spans, in ms of its steps.
pub const WINDOW_MIN_MS: f64 = 500.0;
/// The least excess, as a fraction of the step, that counts.
pub const MIN_EFFECT: f64 = 0.10;
/// Windows in a row that begin or end a finding.
pub const CONFIRM: u32 = 3;
/// Windows of a rank seen not slow before it is judged.
pub const HISTORY: u32 = 2;
/// The indices of [`Window::values`].
const WORK: usize = 0;
const COLLECTIVE: usize = 1;
const DATA: usize = 2;
const COMPUTE: usize = 3;
const UPDATE: usize = 4;
const GC: usize = 5;

/// The cause of a finding whose time went to the garbage collector.
const GC_CAUSE: &str = "garbage collection: the interpreter's collector ran long on it (hatrain.torch.Job(gc=\"planned\") collects at the same step on every rank)";
/// Findings kept (the oldest ended ones go first).
const KEEP: usize = 64;

/// One window of a rank: mean ms per step in each phase.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Window {
    data: f64,
    compute: f64,
    collective: f64,
    update: f64,
    step: f64,
    /// A Python worker's garbage collections, within the phases above.
    gc: f64,
    /// The first and last steps in it.
    first_step: u64,
    last_step: u64,
}

impl Window {
    fn of(t: &StepTimes, (first_step, last_step): (u64, u64)) -> Option<Self> {
        Some(Self {
            data: t.mean_ms(StepPhase::Data)?,
            compute: t.mean_ms(StepPhase::Compute)?,
            collective: t.mean_ms(StepPhase::Collective)?,
            update: t.mean_ms(StepPhase::Update)?,
            step: t.mean_ms(StepPhase::Step)?,
            gc: t.gc_ns as f64 / t.steps as f64 / 1e6,
            first_step,
            last_step,
        })
    }

    fn work(&self) -> f64 {
        self.data + self.compute + self.update
    }

    /// What ranks are compared on, by [`WORK`], [`COLLECTIVE`], ...
    fn values(&self) -> [f64; 6] {
        [
            self.work(),
            self.collective,
            self.data,
            self.compute,
            self.update,
            self.gc,
        ]
    }
}

/// A rank's state in the detector.
#[derive(Debug, Default)]
struct Rank {
    /// The reading its next window starts from, and the step it was at.
    from: Option<(StepTimes, u64)>,
    /// Its newest closed window, not yet compared.
    pending: Option<Window>,
    /// Windows in a row it was slow, or (with a finding open) not slow,
    /// and the first step of the first of them.
    streak: u32,
    since: u64,
    /// Its work per step while not slow (a moving mean), and the windows
    /// it is of.
    history: Option<f64>,
    healthy: u32,
    /// Its open finding, by index.
    open: Option<usize>,
}

/// A finding that began or ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Began(SlowFinding),
    Ended(SlowFinding),
}

/// The detector of one job (or of the ranks one agent sees).
#[derive(Debug, Default)]
pub struct Detector {
    ranks: BTreeMap<usize, Rank>,
    /// Ranks with an open finding not read now (their process being
    /// replaced, their host handed over): they come back with it.
    away: BTreeMap<usize, Rank>,
    findings: Vec<SlowFinding>,
    /// The host of each rank, where known (a controller's detector sees
    /// every host's ranks).
    hosts: BTreeMap<usize, u64>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Values sorted, for the median of all but one of them.
struct Sorted(Vec<f64>);

impl Sorted {
    fn new(mut xs: Vec<f64>) -> Self {
        xs.sort_by(f64::total_cmp);
        Self(xs)
    }

    /// The median of the values with one `v` left out (0 when none is
    /// left); `v` must be one of them.
    fn median_without(&self, v: f64) -> f64 {
        let a = &self.0;
        let Some(m) = a.len().checked_sub(1).filter(|&m| m > 0) else {
            return 0.0;
        };
        let gone = a.partition_point(|x| x.total_cmp(&v).is_lt()).min(m);
        let at = |k: usize| if k < gone { a[k] } else { a[k + 1] };
        if m % 2 == 1 {
            at(m / 2)
        } else {
            (at(m / 2 - 1) + at(m / 2)) / 2.0
        }
    }
}

impl Detector {
    /// Every finding so far, open and ended, oldest first.
    pub fn findings(&self) -> &[SlowFinding] {
        &self.findings
    }

    /// The host each rank runs on: findings name it, and every rank of one
    /// host slow together, and no other, is that host's doing.
    pub fn set_hosts(&mut self, hosts: BTreeMap<usize, u64>) {
        self.hosts = hosts;
    }

    /// A rank's process started again (its page's sums may restart): its
    /// windows begin anew.
    pub fn forget(&mut self, rank: usize) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            r.from = None;
            r.pending = None;
        }
    }

    /// Each rank's step times as read now, with the step it completed.
    /// Ranks absent are no longer compared; one with an open finding
    /// keeps it (and its history) until it is read again, and the finding
    /// ends once it is not slow there.
    pub fn observe(&mut self, readings: &[(usize, u64, StepTimes)]) -> Vec<Change> {
        let seen: BTreeSet<usize> = readings.iter().map(|(r, _, _)| *r).collect();
        let absent: Vec<usize> = (self.ranks.keys())
            .filter(|r| !seen.contains(r))
            .copied()
            .collect();
        for rank in absent {
            let Some(r) = self.ranks.remove(&rank).filter(|r| r.open.is_some()) else {
                continue;
            };
            let r = Rank {
                from: None,
                pending: None,
                streak: 0,
                ..r
            };
            self.away.insert(rank, r);
        }
        let away = &mut self.away;
        for &(rank, step, t) in readings {
            let r =
                (self.ranks.entry(rank)).or_insert_with(|| away.remove(&rank).unwrap_or_default());
            let Some((from, at)) = r.from.filter(|(f, _)| f.steps <= t.steps) else {
                r.from = Some((t, step));
                continue;
            };
            let d = t.since(&from);
            if d.steps >= WINDOW && d.of(StepPhase::Step) as f64 >= WINDOW_MIN_MS * 1e6 {
                r.pending = Window::of(&d, (at + 1, step));
                r.from = Some((t, step));
            }
        }
        if self.ranks.len() < 2 || self.ranks.values().any(|r| r.pending.is_none()) {
            return Vec::new();
        }
        let windows: BTreeMap<usize, Window> = self
            .ranks
            .iter_mut()
            .filter_map(|(&rank, r)| Some((rank, r.pending.take()?)))
            .collect();
        self.compare(&windows)
    }

    fn compare(&mut self, w: &BTreeMap<usize, Window>) -> Vec<Change> {
        let step = median(w.values().map(|x| x.step).collect());
        // Each phase's values sorted once: the others' median of each rank
        // is then a lookup (a controller compares every rank of the job).
        let by: [Sorted; 6] =
            std::array::from_fn(|i| Sorted::new(w.values().map(|x| x.values()[i]).collect()));
        let others = |rank: usize, i: usize| by[i].median_without(w[&rank].values()[i]);
        let min = MIN_EFFECT * step;
        let slow: BTreeMap<usize, (f64, &'static str, f64)> = w
            .iter()
            .filter_map(|(&rank, x)| {
                let excess = x.work() - others(rank, WORK);
                let waited = others(rank, COLLECTIVE) - x.collective;
                let r = &self.ranks[&rank];
                let grew = r
                    .history
                    .filter(|_| r.healthy >= HISTORY)
                    .map(|h| x.work() - h);
                if excess < min || waited < 0.5 * excess || grew.is_none_or(|g| g < min) {
                    return None;
                }
                let grew = [
                    ("data", x.data - others(rank, DATA)),
                    ("compute", x.compute - others(rank, COMPUTE)),
                    ("update", x.update - others(rank, UPDATE)),
                ];
                let (phase, _) = grew.into_iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
                // Its collector took half the excess or more: the time
                // went to garbage collection, whichever phase it ran in.
                let gc = x.gc - others(rank, GC) >= 0.5 * excess;
                Some((rank, (excess, if gc { "gc" } else { phase }, x.work())))
            })
            .collect();
        // Every rank of one host, and only they, with another host beside.
        let one_host = self.one_host(slow.keys().copied().collect(), w);
        let cause = |phase: &str| match (slow.len(), phase, one_host) {
            (_, "gc", _) => GC_CAUSE.to_string(),
            (n, _, Some(h)) => format!(
                "{n} ranks, every rank of host {h} and no other: that host (its devices, its network, a noisy neighbour)"
            ),
            (1, "data", _) => {
                "one rank's data loading (its input, storage or preprocessing)".to_string()
            }
            (1, _, _) => format!(
                "one rank alone ({phase}): hardware-like (a throttled or failing device, a noisy neighbour)"
            ),
            (n, _, _) => format!(
                "{n} ranks at once, not all: data or stage imbalance across the data-parallel ranks"
            ),
        };
        let mut changes = Vec::new();
        for (&rank, x) in w {
            let r = self.ranks.get_mut(&rank).expect("a rank in the window");
            match (slow.get(&rank), r.open) {
                (Some(&(excess, phase, work)), None) => {
                    if r.streak == 0 {
                        r.since = x.first_step;
                    }
                    r.streak += 1;
                    if r.streak >= CONFIRM {
                        r.streak = 0;
                        let f = SlowFinding {
                            rank,
                            phase: phase.to_string(),
                            excess_ms: excess,
                            step_ms: step,
                            over_own_history_ms: r.history.map_or(0.0, |h| work - h),
                            since_step: r.since,
                            last_step: x.last_step,
                            cause: cause(phase),
                            alone: slow.len() == 1,
                            host: self.hosts.get(&rank).copied(),
                            whole_host: one_host.is_some(),
                            ended: false,
                        };
                        r.open = Some(self.findings.len());
                        self.findings.push(f.clone());
                        changes.push(Change::Began(f));
                    }
                }
                (None, None) => {
                    r.streak = 0;
                    r.healthy += 1;
                    r.history = Some(r.history.map_or(x.work(), |h| 0.8 * h + 0.2 * x.work()));
                }
                (Some(&(excess, _, _)), Some(i)) => {
                    r.streak = 0;
                    let f = &mut self.findings[i];
                    f.last_step = x.last_step;
                    f.excess_ms = f.excess_ms.max(excess);
                }
                (None, Some(i)) => {
                    r.streak += 1;
                    self.findings[i].last_step = x.last_step;
                    if r.streak >= CONFIRM {
                        r.streak = 0;
                        r.open = None;
                        self.findings[i].ended = true;
                        changes.push(Change::Ended(self.findings[i].clone()));
                    }
                }
            }
        }
        self.trim();
        changes
    }

    /// The host whose ranks, every one and no other, are `slow`, with
    /// another host's ranks in the window `w`: two ranks or more.
    fn one_host(&self, slow: BTreeSet<usize>, w: &BTreeMap<usize, Window>) -> Option<u64> {
        let of: BTreeSet<u64> = slow
            .iter()
            .filter_map(|r| self.hosts.get(r))
            .copied()
            .collect();
        let (&h, 1) = (of.first()?, of.len()) else {
            return None;
        };
        let on_h: BTreeSet<usize> = w
            .keys()
            .filter(|r| self.hosts.get(r) == Some(&h))
            .copied()
            .collect();
        let beside = w.keys().any(|r| self.hosts.get(r).is_some_and(|&o| o != h));
        (slow.len() >= 2 && on_h == slow && beside).then_some(h)
    }

    /// Drops the oldest ended findings past [`KEEP`].
    fn trim(&mut self) {
        while self.findings.len() > KEEP {
            let Some(i) = self.findings.iter().position(|f| f.ended) else {
                return;
            };
            self.findings.remove(i);
            for r in self.ranks.values_mut().chain(self.away.values_mut()) {
                if let Some(o) = r.open.as_mut().filter(|o| **o > i) {
                    *o -= 1;
                }
            }
        }
    }
}

/// What the agent does with a rank its detector finds slow (`--on-slow`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum OnSlow {
    /// Report it (`agentctl slow`, the metrics, the log) and nothing more.
    #[default]
    Report,
    /// Also hand one rank slow in its own compute or update to a fresh
    /// process (a warm standby where there is one), through the worker
    /// reboot path, once what the slowdown has cost the job equals the
    /// price of a hand-over.
    Replace,
}

/// Whether handing the rank of open finding `f` to a fresh process pays
/// (`--on-slow replace`), for a hand-over that costs `price_ms`: a rule of
/// ski rental, which never loses more than twice the best choice made in
/// hindsight: act once what the slowdown has cost so far
/// ([`SlowFinding::cost_ms`]) equals the price. Only one rank alone, slow
/// in its own compute or update, is handed over: a fresh process cures a
/// throttled or failing device or a noisy neighbour of its process, not
/// its data loading, its garbage collector, nor an imbalance across
/// several ranks.
pub fn replace_pays(f: &SlowFinding, price_ms: f64) -> bool {
    f.alone && moving_pays(f, price_ms)
}

/// Whether handing the host of open finding `f` (one of its ranks) to a
/// standby host pays, by the same rule as [`replace_pays`] for a
/// hand-over of the host that costs `price_ms`: only a host whose every
/// rank, and no other, is slow in its own compute or update (a
/// throttled or failing host: its devices, its cooling, a noisy
/// neighbour).
pub fn hand_host_over_pays(f: &SlowFinding, price_ms: f64) -> bool {
    f.whole_host && f.host.is_some() && moving_pays(f, price_ms)
}

/// `f` is open, in a phase a move cures, and has cost `price_ms`.
fn moving_pays(f: &SlowFinding, price_ms: f64) -> bool {
    !f.ended && !["data", "gc"].contains(&f.phase.as_str()) && f.cost_ms() >= price_ms
}

#[cfg(test)]
mod tests;
