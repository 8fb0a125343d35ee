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

mod common;
use common::median;
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
        },
    );
    let epoch = m.epoch();
    let paused: Vec<RankView> = (0..n)
        .map(|r| {
            view(
                r,
                step,
                epoch0,
                Some(Directive::Pause { epoch }),
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

fn run(agents: usize) {
    let n = agents * RANKS_PER_AGENT;
    let cfg = MachineConfig {
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
    };
    let mut m = Machine::new(cfg, (0..n).collect(), 0.0);
    let mut now = Duration::ZERO;
    for r in 0..n {
        m.step(
            now,
            Event::Registered {
                rank: r,
                checkpoint: true,
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
}
