//! A rank whose exit never reached the machine (it went to a controller
//! that was lost) is taken as a crash once it has been seen dead for
//! [`EXIT_UNREPORTED`]; an exit that does come in time is taken once.

use super::*;
use crate::recovery::machine::unreported::EXIT_UNREPORTED;

#[test]
fn a_rank_seen_dead_whose_exit_never_comes_is_restarted_like_a_crash() {
    let mut sim = Sim::new(3);
    sim.run(10);
    // Its process is gone; the exit is never fed.
    sim.ranks[1].alive = false;
    let ticks = (EXIT_UNREPORTED.as_millis() / TICK.as_millis()) as usize;
    sim.run(ticks - 2);
    assert!(sim.kinds().is_empty(), "not before {EXIT_UNREPORTED:?}");
    sim.run(3);
    assert_eq!(sim.kinds(), vec![FaultKind::Crash]);
    assert!(sim.m.faults()[0].detail.contains("not reported"));
    assert!(sim.commands.contains(&Command::Respawn {
        rank: 1,
        restarts: 1
    }));
    sim.run_until("recovery", 400, |s| !s.m.recovering());
    let steps = sim.steps();
    assert!(steps.iter().all(|s| *s == steps[0]), "{steps:?}");
    assert!(sim.m.faults()[0].recovery_s.is_some());
}

#[test]
fn an_exit_that_comes_is_taken_once_and_never_again_as_unreported() {
    let mut sim = Sim::new(2);
    sim.run(10);
    // Its exit is fed with the view that shows it dead: one fault, and
    // none more once EXIT_UNREPORTED has passed.
    sim.crash(0);
    sim.run(400);
    assert_eq!(sim.kinds(), vec![FaultKind::Crash]);
    assert!(!sim.m.recovering());
}
