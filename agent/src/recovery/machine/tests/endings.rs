//! A recovery whose first step after s* is the job's last: the ranks
//! finish instead of being seen past s*, and the recovery still completes.

use super::*;

#[test]
fn a_recovery_whose_first_step_is_the_last_completes_as_the_ranks_finish() {
    let mut sim = Sim::new(2);
    sim.run(10);
    sim.crash(1);
    sim.run_until("the resume", 300, |s| {
        s.posted(|d| matches!(d, Directive::Resume { .. })) > 0
    });
    // Every rank takes step s*+1 and its loop ends there: the machine sees
    // each dead at that step, then its exit 0, never one alive past s*.
    let s_star = sim.m.faults()[0].s_star.expect("resumed from s*");
    for r in [0, 1] {
        sim.ranks[r].step = s_star + 1;
        sim.ranks[r].phase = Phase::Finished;
        sim.ranks[r].alive = false;
    }
    let views = sim.views();
    sim.feed(Event::Tick(views));
    assert!(sim.m.recovering(), "not seen past s* alive");
    for r in [0, 1] {
        sim.feed(Event::Exited {
            rank: r,
            status: ExitStatus::Exited(0),
            cause: ExitCause::Status,
        });
    }
    assert_eq!(sim.outcome, Some(Outcome::Succeeded));
    let f = &sim.m.faults()[0];
    assert!(f.recovery_s.is_some(), "{f:?}");
    assert_eq!(f.steps_lost, Some(0));
}
