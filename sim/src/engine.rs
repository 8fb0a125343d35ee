//! One policy over one trace: the discrete-event run.
//!
//! The run keeps the wall clock `t` and the job's progress (seconds of
//! full-speed training kept so far). Between events the job either waits
//! out a pause (a detection, a restart, a load, a blocking save) or
//! trains at a speed below 1 by its per-step overhead, the share of hosts
//! it runs on, and any slowdown. Every second of the span ends in exactly
//! one place: progress kept, or one `Cause` of loss, so that
//! `goodput + Σ lost / span = 1`.
//!
//! INVARIANT: a pause is booked in full when it starts. A fault that
//! restarts every process cuts the pause under way short and refunds the
//! part not yet spent, except a requeue still owed, which is booked again;
//! an in-place recovery (hatrain's repair, reboot, standby, shrink, grow)
//! is booked after the pause under way. The end of the span refunds what
//! lies past it.

use crate::policy::{Cause, Outcome, Params, Policy, Setting, disk_interval, step_ratio};
use crate::trace::{Fault, Kind};
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};

/// An event of the run's own: hosts back from repair, a slowdown over, a
/// slow host handed over.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Due {
    t: f64,
    what: What,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum What {
    /// Hosts back from repair.
    Back(u32),
    /// Slowdown `id` is over.
    SlowEnds(u32),
    /// Slowdown `id` has cost the price of handing its host over.
    HandOver(u32),
}

impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        self.t.total_cmp(&other.t).then(self.what.cmp(&other.what))
    }
}

/// A booked pause: its cause and its `[start, end)`.
#[derive(Debug, Clone, Copy)]
struct Segment {
    cause: Cause,
    start: f64,
    end: f64,
}

/// A background or blocking save under way: the progress it holds and
/// when it is durable.
#[derive(Debug, Clone, Copy)]
struct Save {
    progress: f64,
    done: f64,
}

#[derive(Debug)]
struct Run<'a> {
    policy: Policy,
    setting: &'a Setting,
    p: &'a Params,
    hosts: u32,
    min_hosts: u32,
    interval: f64,
    ratio: f64,
    t: f64,
    progress: f64,
    /// Progress when state was last restored (the start, a rollback): the
    /// snapshots since count from it.
    restored: f64,
    lost: [f64; 9],
    stops: u32,
    faults: [u32; 6],
    segments: Vec<Segment>,
    busy_until: f64,
    /// The end of a restart of every process under way (nothing in place
    /// is left to repair before it).
    full_until: f64,
    /// The end of a requeue under way (a fault within it does not shorten
    /// it).
    requeue_until: f64,
    missing: u32,
    /// The slowdowns under way, by id, with when each would end.
    slowing: BTreeMap<u32, f64>,
    next_slow: u32,
    spares: u32,
    durable: f64,
    next_save: f64,
    pending: Option<Save>,
    due: BinaryHeap<Reverse<Due>>,
}

/// Simulates `policy` with `setting` over `trace`.
pub fn simulate(policy: Policy, setting: &Setting, p: &Params, trace: &[Fault]) -> Outcome {
    let interval = disk_interval(policy, setting, p);
    let hosts = p.shape.hosts();
    let mut run = Run {
        policy,
        setting,
        p,
        hosts,
        min_hosts: ((f64::from(hosts) * setting.min_hosts_frac).ceil() as u32).max(1),
        interval,
        ratio: step_ratio(policy, setting, p, interval),
        t: 0.0,
        progress: 0.0,
        restored: 0.0,
        lost: [0.0; 9],
        stops: 0,
        faults: [0; 6],
        segments: Vec::new(),
        busy_until: 0.0,
        full_until: 0.0,
        requeue_until: 0.0,
        missing: 0,
        slowing: BTreeMap::new(),
        next_slow: 0,
        spares: if policy.is_hatrain() {
            setting.standby_hosts
        } else {
            0
        },
        durable: 0.0,
        next_save: interval,
        pending: None,
        due: BinaryHeap::new(),
    };
    let span = p.shape.span_s;
    let mut faults = trace.iter().peekable();
    loop {
        let tf = faults.peek().map_or(f64::INFINITY, |f| f.t);
        let td = run.due.peek().map_or(f64::INFINITY, |d| d.0.t);
        let next = tf.min(td);
        if next >= span {
            break;
        }
        run.advance(next);
        if td <= tf {
            let Reverse(d) = run.due.pop().expect("peeked");
            run.on_due(d);
        } else {
            let f = *faults.next().expect("peeked");
            run.on_fault(&f);
        }
    }
    run.advance(span);
    run.refund_after(span);
    Outcome {
        goodput: run.progress / span,
        lost: run.lost,
        stops: run.stops,
        faults: run.faults,
    }
}

impl Run<'_> {
    /// The share of hosts training, and the slowdown's speed.
    fn factors(&self) -> (f64, f64) {
        let hosts = f64::from(self.hosts - self.missing) / f64::from(self.hosts);
        let slow = if !self.slowing.is_empty() {
            self.p.rates.slow_speed
        } else {
            1.0
        };
        (hosts, slow)
    }

    /// Trains for `dt` wall seconds and books what the speed lost.
    fn train(&mut self, dt: f64) {
        if dt <= 0.0 {
            return;
        }
        let (hosts, slow) = self.factors();
        let r = self.ratio;
        self.progress += dt * hosts * slow / r;
        self.lost[Cause::Overhead as usize] += dt * (1.0 - 1.0 / r);
        self.lost[Cause::Shrunk as usize] += dt / r * (1.0 - hosts);
        self.lost[Cause::Slowdown as usize] += dt / r * hosts * (1.0 - slow);
    }

    /// Moves the clock to `t1`: waits out the pause, trains, saves.
    fn advance(&mut self, t1: f64) {
        while self.t < t1 {
            self.settle_save();
            if self.t < self.busy_until {
                self.t = self.busy_until.min(t1);
                continue;
            }
            let (hosts, slow) = self.factors();
            let to_save = (self.next_save - self.progress) * self.ratio / (hosts * slow);
            if !to_save.is_finite() || self.t + to_save > t1 {
                self.train(t1 - self.t);
                self.t = t1;
                break;
            }
            self.train(to_save);
            self.t += to_save;
            self.progress = self.next_save;
            self.next_save = self.progress + self.interval;
            if self.next_save <= self.progress {
                // An interval below the resolution of the progress: no
                // more saves rather than a loop that never ends.
                self.next_save = f64::INFINITY;
            }
            // A save whose write ended by now is durable before this one
            // is looked at.
            self.settle_save();
            let w = self.p.published.ckpt_write_s;
            if self.policy.blocking_saves() {
                self.pause(Cause::Checkpoint, w);
                self.pending = Some(Save {
                    progress: self.progress,
                    done: self.busy_until,
                });
            } else if self.pending.is_none() {
                self.pending = Some(Save {
                    progress: self.progress,
                    done: self.t + w,
                });
            }
        }
        self.settle_save();
    }

    /// A save whose write has ended is durable.
    fn settle_save(&mut self) {
        if let Some(s) = self.pending
            && s.done <= self.t
        {
            self.durable = self.durable.max(s.progress);
            self.pending = None;
        }
    }

    /// Books a pause of `dur` after whatever pause is under way.
    fn pause(&mut self, cause: Cause, dur: f64) {
        if dur <= 0.0 {
            return;
        }
        let start = self.busy_until.max(self.t);
        self.segments.retain(|s| s.end > self.t);
        self.segments.push(Segment {
            cause,
            start,
            end: start + dur,
        });
        self.lost[cause as usize] += dur;
        self.busy_until = start + dur;
    }

    /// Refunds every booked pause second after `t` (a cut-short recovery,
    /// or the end of the span).
    fn refund_after(&mut self, t: f64) {
        for s in &self.segments {
            if s.end > t {
                self.lost[s.cause as usize] -= s.end - s.start.max(t);
            }
        }
        self.segments.retain(|s| s.end <= t);
        self.busy_until = self.busy_until.min(t).max(self.t.min(t));
    }

    /// Throws away progress back to `to`, where state is restored.
    fn roll_back(&mut self, to: f64) {
        let to = to.min(self.progress);
        self.lost[Cause::Redone as usize] += self.progress - to;
        self.progress = to;
        self.restored = to;
        debug_assert!(self.progress >= 0.0, "progress {}", self.progress);
        if self.next_save <= self.progress || self.policy.blocking_saves() {
            self.next_save = self.progress + self.interval;
        }
    }

    /// The work since the last in-memory snapshot when a fault lands:
    /// none if the job was paused; hatrain snapshots every
    /// `snapshot_every` steps, the memory checkpoint every step; never
    /// more than was done since state was last restored.
    fn partial_step(&self, u: f64) -> f64 {
        if self.t < self.busy_until {
            return 0.0;
        }
        let steps = if self.policy.is_hatrain() {
            f64::from(self.setting.snapshot_every.max(1))
        } else {
            1.0
        };
        (u * steps * self.p.published.step_s).min(self.progress - self.restored)
    }

    /// Cuts the pause under way short; what is left of a requeue under way
    /// is owed all the same. Returns that.
    fn cut_short(&mut self) -> f64 {
        let owed = (self.requeue_until - self.t).max(0.0);
        self.refund_after(self.t);
        if self.pending.is_some_and(|s| s.done > self.t) {
            self.pending = None;
        }
        owed
    }

    /// Books a requeue (`dur`), then the restart of every process and the
    /// load of `load_s`.
    fn full_restart(&mut self, requeue: f64, load_s: f64) {
        let pb = self.p.published;
        if requeue > 0.0 {
            self.pause(Cause::Restart, requeue);
            self.requeue_until = self.busy_until;
        }
        self.pause(Cause::Restart, pb.init_s);
        self.pause(Cause::Load, load_s);
        self.full_until = self.busy_until;
    }

    /// Everything stops and restarts from the last durable disk save; on
    /// replacement hosts if `requeue`.
    fn restart_from_disk(&mut self, detect: f64, requeue: bool) {
        let owed = self.cut_short();
        self.roll_back(self.durable);
        let pb = self.p.published;
        self.pause(Cause::Detection, detect);
        let requeue = if requeue {
            self.stops += 1;
            self.missing = 0;
            pb.requeue_s.max(owed)
        } else {
            owed
        };
        self.full_restart(requeue, pb.disk_load_s);
        self.next_save = self.progress + self.interval;
    }

    fn on_fault(&mut self, f: &Fault) {
        self.faults[f.kind as usize] += 1;
        let pb = self.p.published;
        if f.kind == Kind::Slow {
            let (id, end) = (self.next_slow, f.t + f.dur);
            self.next_slow += 1;
            self.slowing.insert(id, end);
            self.due.push(Reverse(Due {
                t: end,
                what: What::SlowEnds(id),
            }));
            if let Some(at) = self.hand_over_at(f.t).filter(|&at| at < end) {
                self.due.push(Reverse(Due {
                    t: at,
                    what: What::HandOver(id),
                }));
            }
            return;
        }
        match self.policy {
            Policy::Disk => {
                let (detect, requeue) = match f.kind {
                    Kind::Uce | Kind::Crash => (pb.detect_crash_s, false),
                    Kind::Hang => (pb.detect_timeout_s, false),
                    _ => (pb.detect_timeout_s, true),
                };
                self.restart_from_disk(detect, requeue);
            }
            // During a requeue no memory checkpoint is left to restart
            // from.
            Policy::Memory if self.t < self.requeue_until => {
                let requeue = matches!(f.kind, Kind::Host | Kind::Domain);
                self.restart_from_disk(pb.detect_timeout_s, requeue);
            }
            Policy::Memory => match f.kind {
                Kind::Uce | Kind::Crash | Kind::Hang => {
                    let partial = self.partial_step(f.u);
                    self.cut_short();
                    self.roll_back(self.progress - partial);
                    let detect = if f.kind == Kind::Hang {
                        pb.detect_timeout_s
                    } else {
                        pb.detect_crash_s
                    };
                    self.pause(Cause::Detection, detect);
                    self.full_restart(0.0, pb.mem_load_s);
                }
                _ => self.restart_from_disk(pb.detect_timeout_s, true),
            },
            Policy::Hatrain | Policy::Elastic => self.hatrain_fault(f),
        }
    }

    fn hatrain_fault(&mut self, f: &Fault) {
        let m = &self.p.measured;
        let lost_hosts = match f.kind {
            Kind::Host => 1,
            Kind::Domain => self.p.rates.domain_hosts.min(self.hosts),
            _ => 0,
        };
        if lost_hosts > 0 {
            // Back after the repair: to the pool, or to a shrunk group.
            self.due.push(Reverse(Due {
                t: f.t + f.dur,
                what: What::Back(lost_hosts),
            }));
        }
        if self.t < self.full_until {
            // Every process is restarting: a fault in one is mended by
            // that restart, and a requeue brings replacement hosts.
            return;
        }
        let partial = self.partial_step(f.u);
        match f.kind {
            Kind::Uce => {
                self.roll_back(self.progress - partial);
                self.pause(Cause::Restart, m.uce_pause_s);
            }
            Kind::Crash => {
                self.roll_back(self.progress - partial);
                self.pause(Cause::Restart, m.crash_pause_s);
            }
            Kind::Hang => {
                self.roll_back(self.progress - partial);
                self.pause(Cause::Detection, self.p.published.hatrain_hang_detect_s());
                self.pause(Cause::Restart, m.crash_pause_s);
            }
            Kind::Host | Kind::Domain => self.lose_hosts(lost_hosts, partial),
            // Handled in `on_fault`, for every policy alike.
            Kind::Slow => {}
        }
    }

    /// hatrain loses `n` hosts: onto standbys from the peer replicas, else
    /// shrink (elastic), else last words and a requeue.
    fn lose_hosts(&mut self, n: u32, partial: f64) {
        let pb = self.p.published;
        let m = &self.p.measured;
        let active = self.hosts - self.missing;
        // Replicas live in other failure domains: with every host, or the
        // only domain, gone, no copy is left.
        let copies_left =
            self.setting.replicas > 0 && n < active && self.p.shape.domains(&self.p.rates) > 1;
        if !copies_left {
            // Back to disk: on standbys if there are enough, else requeued.
            if self.spares >= n {
                self.spares -= n;
                self.restart_from_disk(pb.host_timeout_s, false);
            } else {
                self.restart_from_disk(pb.host_timeout_s, true);
            }
            return;
        }
        let onto_standby = self.spares.min(n);
        let rest = n - onto_standby;
        if rest == 0 {
            self.spares -= onto_standby;
            self.roll_back(self.progress - partial);
            self.pause(Cause::Restart, m.host_standby_pause_s);
        } else if self.policy == Policy::Elastic && active >= rest + self.min_hosts {
            self.spares -= onto_standby;
            self.missing += rest;
            self.roll_back(self.progress - partial);
            let pause = if onto_standby > 0 {
                m.shrink_pause_s.max(m.host_standby_pause_s)
            } else {
                m.shrink_pause_s
            };
            self.pause(Cause::Restart, pause);
        } else {
            // Last words: the survivors and the replicas hold every rank's
            // state at the last step, written whole before the job stops.
            self.cut_short();
            self.pending = None;
            self.roll_back(self.progress - partial);
            self.pause(Cause::Detection, pb.host_timeout_s);
            self.pause(Cause::Checkpoint, pb.ckpt_write_s * m.dump_time_ratio);
            self.durable = self.progress;
            self.next_save = self.progress + self.interval;
            self.stops += 1;
            self.missing = 0;
            self.full_restart(pb.requeue_s, pb.disk_load_s);
        }
    }

    /// When a slowdown that began at `t` is handed over, if hatrain's
    /// detector sees it (`Measured::slow_detect_steps`) and it replaces
    /// slow hosts: once it is detected (that many slow steps) and its cost
    /// so far, the job's time lost at the slow speed, equals the price of
    /// the hand-over (a rule of ski rental, as the agent's
    /// `--on-slow replace`).
    fn hand_over_at(&self, t: f64) -> Option<f64> {
        if !(self.policy.is_hatrain() && self.setting.on_slow_replace) {
            return None;
        }
        let steps = self.p.measured.slow_detect_steps?;
        let speed = self.p.rates.slow_speed;
        if !(speed > 0.0 && speed < 1.0) {
            return None;
        }
        let detect = steps * self.p.published.step_s / speed;
        let price = self.hand_over_price()?;
        Some(t + detect.max(price / (1.0 - speed)))
    }

    /// The pause a hand-over costs now: onto a standby host, or (elastic)
    /// the group shrinking without it; `None` when neither can be done.
    fn hand_over_price(&self) -> Option<f64> {
        let m = &self.p.measured;
        if self.spares > 0 {
            Some(m.host_standby_pause_s)
        } else if self.policy == Policy::Elastic && self.hosts - self.missing > self.min_hosts {
            Some(m.shrink_pause_s)
        } else {
            None
        }
    }

    /// Slowdown `id`, still under way, is handed over: its host goes to a
    /// standby host's place or out of the group, and comes back when the
    /// slowdown would have ended.
    fn hand_over(&mut self, id: u32) {
        let Some(&end) = self.slowing.get(&id) else {
            return;
        };
        let Some(price) = self.hand_over_price() else {
            return;
        };
        if self.spares > 0 {
            self.spares -= 1;
        } else {
            self.missing += 1;
        }
        self.slowing.remove(&id);
        self.pause(Cause::Restart, price);
        self.due.push(Reverse(Due {
            t: end,
            what: What::Back(1),
        }));
    }

    fn on_due(&mut self, d: Due) {
        let hosts = match d.what {
            What::Back(n) => n,
            What::SlowEnds(id) => {
                self.slowing.remove(&id);
                return;
            }
            What::HandOver(id) => {
                self.hand_over(id);
                return;
            }
        };
        for _ in 0..hosts {
            if self.missing > 0 {
                self.missing -= 1;
                self.pause(Cause::Resync, self.p.measured.grow_pause_s);
            } else if self.spares < self.setting.standby_hosts {
                self.spares += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests;
