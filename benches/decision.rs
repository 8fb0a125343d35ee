//! How long the controller takes to decide at scale: the recovery machine
//! (the code a controller runs) fed with the reports of 4,096 and of
//! 16,384 simulated agents of 8 ranks each (32,768 and 131,072 ranks),
//! in-process, no processes.
//!
//! One rank dies; every rank pauses; then:
//! - `pause report -> collect`: the tick that brings the last rank's
//!   acknowledged pause, until the machine asks for the snapshots;
//! - `collected -> resume`: the report of every rank's verified snapshot
//!   steps (the last report of a recovery), until s\* is chosen and every
//!   rank has its `Resume` directive: the decision.
//!
//! Medians of `ROUNDS` recoveries (`HATRAIN_BENCH_AGENTS` sets one size
//! of its own).
//!
//! Then the same through the job's controller as the agents drive it
//! ([`Controller::step`]): one report per agent, each a step of the
//! cluster machine, whose orders go back to every agent. The controller
//! takes the reported views with its own at its tick. Timed: its tick
//! after every pause report until every agent has its collect order, the
//! last collected steps until every agent has its resume order (the
//! decision), and the whole of each round of reports.

mod common;
use common::median;
use hatrain_agent::job::cluster::{Controller, Facts, Input, Ready, Up};
use hatrain_agent::reaper::ExitStatus;
use hatrain_agent::recovery::{
    Command, Event, ExitCause, HangPolicy, Machine, MachineConfig, RankView, RestartPolicy,
};
use hatrain_shared::ha::HaModes;
use hatrain_shared::shm::{Directive, Phase};
use std::time::{Duration, Instant};

const ROUNDS: usize = 9;
const RANKS_PER_AGENT: usize = 8;

fn view(rank: usize, step: u64, epoch: u64, acked: Option<Directive>, phase: Phase) -> RankView {
    RankView {
        rank,
        alive: true,
        registered: true,
        phase,
        step,
        epoch,
        heartbeat: step,
        in_collective: false,
        acked,
        times: Default::default(),
        final_sealed: None,
    }
}

/// One recovery: (pause report -> collect, collected -> resume) seconds.
fn recovery(m: &mut Machine, n: usize, now: &mut Duration, step: u64) -> (f64, f64) {
    let dead = (step as usize * 7919) % n;
    *now += Duration::from_millis(10);
    let epoch0 = m.epoch();
    let running: Vec<RankView> = (0..n)
        .map(|r| view(r, step, epoch0, None, Phase::Computing))
        .collect();
    m.step(*now, Event::Tick(running.clone()));
    let mut dying = running;
    dying[dead].alive = false;
    m.step(*now, Event::Tick(dying));
    let out = m.step(
        *now,
        Event::Exited {
            rank: dead,
            status: ExitStatus::Signaled(9),
            cause: ExitCause::Status,
        },
    );
    assert!(
        out.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { .. }))
    );
    m.step(
        *now,
        Event::Registered {
            rank: dead,
            checkpoint: true,
            global_batch: None,
        },
    );
    let epoch = m.epoch();
    let paused: Vec<RankView> = (0..n)
        .map(|r| {
            view(
                r,
                step,
                epoch0,
                Some(Directive::Pause { epoch, upto: None }),
                Phase::Paused,
            )
        })
        .collect();
    *now += Duration::from_millis(10);
    let t = Instant::now();
    let out = m.step(*now, Event::Tick(paused));
    let to_collect = t.elapsed().as_secs_f64();
    assert!(
        out.commands
            .iter()
            .any(|c| matches!(c, Command::Collect { .. })),
        "no collect: {:?}",
        out.notes
    );
    let steps: Vec<(usize, Vec<u64>)> = (0..n).map(|r| (r, vec![step, step - 1])).collect();
    let t = Instant::now();
    let out = m.step(*now, Event::Collected { epoch, steps });
    let to_resume = t.elapsed().as_secs_f64();
    let resumes = out
        .commands
        .iter()
        .filter(|c| matches!(c, Command::Post { directive: Directive::Resume { step: s, .. }, .. } if *s == step))
        .count();
    assert_eq!(resumes, n, "every rank resumes from s* = {step}");
    // Every rank completes s*+1 under the new epoch: the recovery ends.
    *now += Duration::from_millis(10);
    let done: Vec<RankView> = (0..n)
        .map(|r| {
            view(
                r,
                step + 1,
                epoch,
                Some(Directive::Resume { epoch, step }),
                Phase::Computing,
            )
        })
        .collect();
    m.step(*now, Event::Tick(done));
    assert!(!m.recovering(), "the recovery did not complete");
    (to_collect, to_resume)
}

fn main() {
    let sizes: Vec<usize> = match std::env::var("HATRAIN_BENCH_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(agents) => vec![agents],
        None => vec![4096, 16384],
    };
    for agents in sizes {
        run(agents);
    }
}

fn config() -> MachineConfig {
    MachineConfig {
        modes: HaModes {
            dump: true,
            retry: true,
            recover: true,
            elastic: false,
        },
        restart: RestartPolicy {
            max_restarts: 1000,
            max_in_window: 1000,
            ..RestartPolicy::default()
        },
        hang: HangPolicy::default(),
        pause_timeout: Duration::from_secs(60),
        group_restarts: 0,
        register_timeout: Duration::from_secs(60),
        min_nodes: 1,
    }
}

fn run(agents: usize) {
    let n = agents * RANKS_PER_AGENT;
    let mut m = Machine::new(config(), (0..n).collect(), 0.0);
    let mut now = Duration::ZERO;
    for r in 0..n {
        m.step(
            now,
            Event::Registered {
                rank: r,
                checkpoint: true,
                global_batch: None,
            },
        );
    }
    let (mut collect, mut resume) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS {
        let (c, r) = recovery(&mut m, n, &mut now, 100 + 10 * i as u64);
        collect.push(c);
        resume.push(r);
    }
    let (c, r) = (median(collect), median(resume));
    println!(
        "{agents} agents x {RANKS_PER_AGENT} ranks = {n} ranks, median of {ROUNDS} recoveries"
    );
    println!("{:<32} {:>10}", "", "ms");
    println!("{:<32} {:>10.3}", "pause report -> collect", c * 1e3);
    println!("{:<32} {:>10.3}", "collected -> resume (decision)", r * 1e3);
    println!("{:<32} {:>10.3}", "both", (c + r) * 1e3);
    through_the_controller(agents);
}

/// Host `h`'s ranks.
fn ranks_of(h: usize) -> std::ops::Range<usize> {
    h * RANKS_PER_AGENT..(h + 1) * RANKS_PER_AGENT
}

/// Agent `h` reports `views` of its ranks (and `events`): one step (the
/// controller's own agent feeds its machine directly); the step's time.
fn report(
    c: &mut Controller,
    now: Duration,
    h: usize,
    views: Vec<RankView>,
    events: Vec<Event>,
) -> (Ready, f64) {
    let inputs = match h {
        0 => std::iter::once(Event::Tick(views))
            .chain(events)
            .map(Input::Event)
            .collect(),
        _ => vec![Input::Up {
            from: h as u64,
            up: Up::Report {
                views,
                events,
                held: Vec::new(),
                hold: None,
            },
        }],
    };
    let mut ready = Ready::default();
    let t = Instant::now();
    for input in inputs {
        let r = c.step(now, &Facts::default(), input);
        ready.orders.extend(r.orders);
    }
    (ready, t.elapsed().as_secs_f64())
}

/// Whether `ready` orders every other agent to do `what`.
fn everyone(ready: &Ready, agents: usize, what: impl Fn(&Command) -> bool) -> bool {
    let told: std::collections::BTreeSet<u64> = ready
        .orders
        .iter()
        .filter(|(_, d)| d.commands.iter().any(&what))
        .map(|(n, _)| *n)
        .collect();
    told.len() == agents - 1
}

/// One recovery through the controller: (last pause report -> collect
/// orders, last collected -> resume orders, every pause report, every
/// collected report) seconds.
fn round(c: &mut Controller, agents: usize, now: &mut Duration, step: u64) -> [f64; 4] {
    let n = agents * RANKS_PER_AGENT;
    let dead = (step as usize * 7919) % n;
    let host = dead / RANKS_PER_AGENT;
    let epoch0 = c.mirror().epoch;
    let views = |h: usize, acked, phase, step, epoch| -> Vec<RankView> {
        ranks_of(h)
            .map(|r| view(r, step, epoch, acked, phase))
            .collect()
    };
    *now += Duration::from_millis(10);
    let mut dying = views(host, None, Phase::Computing, step, epoch0);
    dying[dead - host * RANKS_PER_AGENT].alive = false;
    let exit = Event::Exited {
        rank: dead,
        status: ExitStatus::Signaled(9),
        cause: ExitCause::Status,
    };
    report(c, *now, host, dying, vec![exit]);
    let registered = Event::Registered {
        rank: dead,
        checkpoint: true,
        global_batch: None,
    };
    report(c, *now, host, Vec::new(), vec![registered]);
    let epoch = c.mirror().epoch;
    *now += Duration::from_millis(10);
    let pause = Some(Directive::Pause { epoch, upto: None });
    let (mut last, mut all) = (0.0, 0.0);
    let mut collect = false;
    for h in (1..agents).chain([0]) {
        let (ready, t) = report(
            c,
            *now,
            h,
            views(h, pause, Phase::Paused, step, epoch0),
            vec![],
        );
        (last, all) = (t, all + t);
        collect |= everyone(&ready, agents, |c| matches!(c, Command::Collect { .. }));
    }
    assert!(collect, "no collect order to every agent");
    let (mut decision, mut collected) = (0.0, 0.0);
    let mut resumed = false;
    for h in (1..agents).chain([0]) {
        let steps = ranks_of(h).map(|r| (r, vec![step, step - 1])).collect();
        let replicas = Vec::new();
        let input = match h {
            0 => Input::Verified {
                epoch,
                steps,
                replicas,
            },
            _ => Input::Up {
                from: h as u64,
                up: Up::Collected {
                    epoch,
                    steps,
                    replicas,
                },
            },
        };
        let t = Instant::now();
        let ready = c.step(*now, &Facts::default(), input);
        let took = t.elapsed().as_secs_f64();
        (decision, collected) = (took, collected + took);
        resumed |= everyone(
            &ready,
            agents,
            |c| matches!(c, Command::Post { directive: Directive::Resume { step: s, .. }, .. } if *s == step),
        );
    }
    assert!(resumed, "no resume order to every agent from s* = {step}");
    *now += Duration::from_millis(10);
    let resume = Some(Directive::Resume { epoch, step });
    for h in (1..agents).chain([0]) {
        report(
            c,
            *now,
            h,
            views(h, resume, Phase::Computing, step + 1, epoch),
            vec![],
        );
    }
    assert!(!c.mirror().recovering, "the recovery did not complete");
    [last, decision, all, collected]
}

fn through_the_controller(agents: usize) {
    let n = agents * RANKS_PER_AGENT;
    let machine = Machine::new(config(), (0..n).collect(), 0.0);
    let mut c = Controller::new(machine, agents, 0, RANKS_PER_AGENT, 0);
    let mut now = Duration::ZERO;
    for h in 0..agents {
        let events = ranks_of(h)
            .map(|rank| Event::Registered {
                rank,
                checkpoint: true,
                global_batch: None,
            })
            .collect();
        report(&mut c, now, h, Vec::new(), events);
    }
    let mut rows: [Vec<f64>; 4] = Default::default();
    for i in 0..ROUNDS {
        let r = round(&mut c, agents, &mut now, 100 + 10 * i as u64);
        for (row, t) in rows.iter_mut().zip(r) {
            row.push(t);
        }
    }
    let [last, decision, all, collected] = rows.map(median);
    println!("through the controller ({agents} agents' reports, one step each)");
    println!("{:<32} {:>10.3}", "pause tick -> collect", last * 1e3);
    println!(
        "{:<32} {:>10.3}",
        "last collected -> resume",
        decision * 1e3
    );
    println!("{:<32} {:>10.3}", "every pause report", all * 1e3);
    println!("{:<32} {:>10.3}", "every collected report", collected * 1e3);
}
