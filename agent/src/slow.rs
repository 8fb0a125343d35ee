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
mod tests {
    use super::*;

    /// Cumulative times of `steps` steps of (data, compute, collective,
    /// update) ms each, the step their sum plus `other` ms.
    fn add(t: &mut StepTimes, steps: u64, [d, c, k, u]: [f64; 4], other: f64) {
        let ns = |ms: f64| (ms * 1e6) as u64 * steps;
        t.steps += steps;
        for (i, ms) in [d, c, k, u, d + c + k + u + other].into_iter().enumerate() {
            t.ns[i] += ns(ms);
        }
    }

    /// Runs `windows` windows of 4 ranks; `phase(rank, window)` gives each
    /// rank's phases in that window. Returns the changes.
    fn run(
        d: &mut Detector,
        at: &mut [StepTimes; 4],
        step: &mut u64,
        windows: usize,
        phase: impl Fn(usize, usize) -> [f64; 4],
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        for w in 0..windows {
            *step += WINDOW;
            for (r, t) in at.iter_mut().enumerate() {
                add(t, WINDOW, phase(r, w), 1.0);
            }
            let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, *step, *t)).collect();
            changes.extend(d.observe(&readings));
        }
        changes
    }

    const HEALTHY: [f64; 4] = [1.0, 80.0, 5.0, 10.0];

    #[test]
    fn a_rank_whose_compute_grew_while_the_others_waited_is_named_then_ended() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        // Rank 2's compute grows by 30 ms; the others wait that long.
        let slowed = |r: usize, _| {
            if r == 2 {
                [1.0, 110.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 35.0, 10.0]
            }
        };
        let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
        let [Change::Began(f)] = &changes[..] else {
            panic!("one finding: {changes:?}");
        };
        assert_eq!((f.rank, f.phase.as_str()), (2, "compute"));
        assert!((f.excess_ms - 30.0).abs() < 0.5, "{f:?}");
        assert!((f.over_own_history_ms - 30.0).abs() < 0.5, "{f:?}");
        assert!(f.cause.starts_with("one rank alone"), "{f:?}");
        // Still slow: nothing new; then healthy again: it ends.
        assert!(run(&mut d, &mut at, &mut step, 5, slowed).is_empty());
        let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, |_, _| HEALTHY);
        assert!(
            matches!(&changes[..], [Change::Ended(f)] if f.rank == 2 && f.ended),
            "{changes:?}"
        );
        assert_eq!(d.findings().len(), 1);
    }

    #[test]
    fn short_steps_close_a_window_only_once_it_spans_half_a_second() {
        // Steps of 10 ms: a rank that lost 2 ms a step for 30 steps (a
        // scheduler's burst) is judged over 50 steps at least, and a burst
        // that short is no finding; one lasting is.
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        let short = [0.1, 7.0, 1.0, 0.9];
        let burst = |r: usize| {
            if r == 0 {
                [0.1, 9.0, 0.0, 0.9]
            } else {
                [0.1, 7.0, 3.0, 0.9]
            }
        };
        // 10 steps per reading, as the agent reads every 100 ms.
        let mut read = |d: &mut Detector, at: &mut [StepTimes; 4], slow: bool| {
            step += 10;
            for (r, t) in at.iter_mut().enumerate() {
                add(t, 10, if slow { burst(r) } else { short }, 0.0);
            }
            let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, step, *t)).collect();
            d.observe(&readings)
        };
        let mut changes = Vec::new();
        for k in 0..60 {
            // Slow in 3 readings of 10 steps out of each 10.
            changes.extend(read(&mut d, &mut at, k % 10 < 3));
        }
        assert!(changes.is_empty(), "{changes:?}");
        for _ in 0..30 {
            changes.extend(read(&mut d, &mut at, true));
        }
        let [Change::Began(f)] = &changes[..] else {
            panic!("one finding: {changes:?}");
        };
        assert_eq!((f.rank, f.phase.as_str()), (0, "compute"));
        assert!(f.last_step - f.since_step + 1 >= 3 * 50, "{f:?}");
    }

    #[test]
    fn slow_data_is_named_as_data() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        let slowed = |r: usize, _| {
            if r == 1 {
                [40.0, 80.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 44.0, 10.0]
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
        let [Change::Began(f)] = &changes[..] else {
            panic!("one finding: {changes:?}");
        };
        assert_eq!((f.rank, f.phase.as_str()), (1, "data"));
        assert_eq!((f.since_step, f.last_step), (41, 70), "{f:?}");
        assert!(f.cause.contains("data loading"), "{f:?}");
    }

    #[test]
    fn no_finding_when_every_rank_slows_or_the_excess_is_small_or_brief() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        // Every rank twice as slow: nobody stands out.
        assert!(
            run(&mut d, &mut at, &mut step, 8, |_, _| [
                2.0, 160.0, 5.0, 20.0
            ])
            .is_empty()
        );
        // One rank 5% slower (under the minimum effect), persistently.
        let small = |r: usize, _| {
            if r == 3 {
                [1.0, 85.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 10.0, 10.0]
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 8, small).is_empty());
        // One rank much slower in single windows, never CONFIRM in a row.
        let brief = |r: usize, w: usize| {
            if r == 0 && w.is_multiple_of(2) {
                [1.0, 140.0, 5.0, 10.0]
            } else if w.is_multiple_of(2) {
                [1.0, 80.0, 65.0, 10.0]
            } else {
                HEALTHY
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 12, brief).is_empty());
        // One rank with more work whom nobody waits for (as much collective
        // as the others): not slow.
        let unwaited = |r: usize, _| {
            if r == 0 {
                [1.0, 100.0, 5.0, 10.0]
            } else {
                HEALTHY
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 8, unwaited).is_empty());
        assert!(d.findings().is_empty());
    }

    #[test]
    fn a_difference_there_from_the_start_is_no_change() {
        // Rank 3 always took 15 ms more, and the others waited: it did not
        // grow against its own history.
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        let always = |r: usize, _| {
            if r == 3 {
                [1.0, 95.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 20.0, 10.0]
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 12, always).is_empty());
        // Nor is a rank judged before its history: slow from the first
        // window, it is never seen healthy.
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        let slowed = |r: usize, _| {
            if r == 2 {
                [1.0, 110.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 35.0, 10.0]
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 8, slowed).is_empty());
    }

    /// A slow rank's process replaced (its host handed over): absent from
    /// the readings a while, its finding stays open; read again and not
    /// slow, the finding ends.
    #[test]
    fn a_slow_rank_read_again_after_a_while_away_ends_its_finding() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        let slowed = |r: usize, _| {
            if r == 2 {
                [1.0, 110.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 35.0, 10.0]
            }
        };
        let began = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
        assert!(
            matches!(&began[..], [Change::Began(f)] if f.rank == 2),
            "{began:?}"
        );
        // Rank 2 unread for two windows (its new process not registered).
        for _ in 0..2 {
            step += WINDOW;
            for t in &mut at {
                add(t, WINDOW, HEALTHY, 1.0);
            }
            let without: Vec<_> = (at.iter().enumerate())
                .filter(|(r, _)| *r != 2)
                .map(|(r, t)| (r, step, *t))
                .collect();
            assert!(d.observe(&without).is_empty());
        }
        assert!(!d.findings()[0].ended);
        // Read again from a fresh process (its sums start over).
        at[2] = StepTimes::default();
        let ended = run(&mut d, &mut at, &mut step, CONFIRM as usize + 1, |_, _| {
            HEALTHY
        });
        assert!(
            matches!(&ended[..], [Change::Ended(f)] if f.rank == 2 && f.ended),
            "{ended:?}"
        );
    }

    #[test]
    fn several_ranks_at_once_are_named_as_imbalance() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        let band = |r: usize, _| {
            if r < 2 {
                [1.0, 110.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 35.0, 10.0]
            }
        };
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, band);
        assert_eq!(changes.len(), 2, "{changes:?}");
        for c in &changes {
            let Change::Began(f) = c else { panic!("{c:?}") };
            assert!(f.cause.contains("imbalance"), "{f:?}");
        }
    }

    #[test]
    fn a_restarted_rank_starts_its_windows_again() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        run(&mut d, &mut at, &mut step, 2, |_, _| HEALTHY);
        // Rank 1's page sums restart lower: no window of negative time.
        at[1] = StepTimes::default();
        d.forget(1);
        assert!(run(&mut d, &mut at, &mut step, 6, |_, _| HEALTHY).is_empty());
    }

    #[test]
    fn a_hand_over_pays_once_the_slowdown_cost_its_price_and_only_for_one_rank_slow_in_its_own_work()
     {
        let f = SlowFinding {
            rank: 1,
            phase: "compute".into(),
            excess_ms: 20.0,
            step_ms: 100.0,
            over_own_history_ms: 20.0,
            since_step: 100,
            last_step: 149,
            cause: String::new(),
            alone: true,
            host: None,
            whole_host: false,
            ended: false,
        };
        assert_eq!(f.cost_ms(), 1000.0, "50 steps of 20 ms");
        assert!(replace_pays(&f, 1000.0));
        assert!(!hand_host_over_pays(&f, 0.0), "one rank: not its host");
        assert!(!replace_pays(&f, 1000.1), "not yet");
        let data = SlowFinding {
            phase: "data".into(),
            ..f.clone()
        };
        assert!(
            !replace_pays(&data, 1.0),
            "its data loading: not cured by a new process"
        );
        let several = SlowFinding {
            alone: false,
            ..f.clone()
        };
        assert!(!replace_pays(&several, 1.0), "an imbalance across ranks");
        let ended = SlowFinding { ended: true, ..f };
        assert!(!replace_pays(&ended, 1.0));
    }

    #[test]
    fn a_rank_whose_garbage_collector_took_the_excess_is_named_with_gc_and_not_handed_over() {
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        // Rank 3's compute grows by 30 ms, 25 of them in its collector.
        let mut changes = Vec::new();
        for _ in 0..CONFIRM {
            step += WINDOW;
            for (r, t) in at.iter_mut().enumerate() {
                if r == 3 {
                    add(t, WINDOW, [1.0, 110.0, 5.0, 10.0], 1.0);
                    t.gc_ns += 25_000_000 * WINDOW;
                } else {
                    add(t, WINDOW, [1.0, 80.0, 35.0, 10.0], 1.0);
                }
            }
            let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, step, *t)).collect();
            changes.extend(d.observe(&readings));
        }
        let [Change::Began(f)] = &changes[..] else {
            panic!("one finding: {changes:?}");
        };
        assert_eq!((f.rank, f.phase.as_str()), (3, "gc"), "{f:?}");
        assert!(f.cause.starts_with("garbage collection"), "{f:?}");
        assert!(
            !replace_pays(f, 0.0),
            "a fresh process keeps the same collector"
        );
    }

    /// With the hosts known (a controller's detector): both ranks of host
    /// 1 slow, and no other, is that host; one of them alone is not.
    #[test]
    fn every_rank_of_one_host_slow_together_is_that_host() {
        let hosts = BTreeMap::from([(0, 0), (1, 0), (2, 1), (3, 1)]);
        let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
        d.set_hosts(hosts);
        assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
        let host1 = |r: usize, _| {
            if r >= 2 {
                [1.0, 110.0, 5.0, 10.0]
            } else {
                [1.0, 80.0, 35.0, 10.0]
            }
        };
        let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, host1);
        assert_eq!(changes.len(), 2, "{changes:?}");
        for c in &changes {
            let Change::Began(f) = c else {
                panic!("{changes:?}")
            };
            assert_eq!(f.host, Some(1), "{f:?}");
            assert!(f.cause.contains("every rank of host 1"), "{f:?}");
            assert!(!f.alone && !replace_pays(f, 0.0), "{f:?}");
            assert!(f.whole_host && hand_host_over_pays(f, 0.0), "{f:?}");
            let data = SlowFinding {
                phase: "data".into(),
                ..f.clone()
            };
            assert!(!hand_host_over_pays(&data, 0.0), "{f:?}");
        }
    }

    #[test]
    fn the_median_without_one_value_is_the_median_of_the_others() {
        let xs = [5.0, 1.0, 9.0, 3.0, 3.0, 7.0, 2.0];
        let s = Sorted::new(xs.to_vec());
        for (i, &v) in xs.iter().enumerate() {
            let rest: Vec<f64> = xs
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, x)| *x)
                .collect();
            assert_eq!(s.median_without(v), median(rest), "without {v}");
        }
        assert_eq!(Sorted::new(vec![4.0]).median_without(4.0), 0.0);
    }
}
