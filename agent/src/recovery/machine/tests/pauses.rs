//! What a pause tells the ranks: the step past which the job cannot
//! resume, from the ranks whose processes have ended.

use super::*;

fn pauses(sim: &Sim) -> Vec<(usize, Directive)> {
    sim.commands
        .iter()
        .filter_map(|c| match c {
            Command::Post { rank, directive } if matches!(directive, Directive::Pause { .. }) => {
                Some((*rank, *directive))
            }
            _ => None,
        })
        .collect()
}

/// Every pause posted is of epoch 1 and says `upto`.
fn assert_paused_upto(sim: &Sim, upto: Option<u64>) {
    let posted = pauses(sim);
    assert!(!posted.is_empty());
    assert!(
        posted
            .iter()
            .all(|(_, d)| *d == Directive::Pause { epoch: 1, upto }),
        "{posted:?}"
    );
}

/// A rank killed with step 9 its newest sealed snapshot: the others'
/// copies of step 10 could not be resumed from, and the pause says so.
#[test]
fn a_pause_after_a_crash_says_the_newest_step_the_dead_rank_sealed() {
    let mut sim = Sim::new(3);
    sim.run(10);
    assert_eq!(sim.steps(), vec![10, 10, 10]);
    sim.ranks[1].slots = vec![8, 9];
    sim.commands.clear();
    sim.crash(1);
    let upto = Some(9);
    assert_eq!(
        pauses(&sim),
        vec![
            (0, Directive::Pause { epoch: 1, upto }),
            (2, Directive::Pause { epoch: 1, upto })
        ]
    );
    // The ranks acknowledge it like any pause, and the job resumes at 9.
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    assert_eq!(sim.m.faults()[0].s_star, Some(9));
}

/// Two ranks ended: the older of their newest steps bounds the job. One
/// ended with nothing sealed known: no bound, the copies are finished.
#[test]
fn the_bound_is_the_oldest_of_the_ended_ranks_newest_steps_or_none() {
    let mut sim = Sim::new(4);
    sim.run(10);
    sim.ranks[1].slots = vec![9, 10];
    sim.ranks[3].slots = vec![8, 9];
    sim.ranks[3].alive = false;
    sim.commands.clear();
    sim.crash(1);
    assert_paused_upto(&sim, Some(9));

    let mut sim = Sim::new(3);
    sim.run(10);
    sim.ranks[1].slots.clear();
    sim.commands.clear();
    sim.crash(1);
    assert_paused_upto(&sim, None);
}

/// A memory error repaired in place ends no process: nothing bounds the
/// step, and the ranks finish their copies.
#[test]
fn a_pause_with_every_process_alive_has_no_bound() {
    let mut sim = Sim::new(2);
    sim.run(5);
    sim.commands.clear();
    sim.feed(Event::Uce {
        rank: 0,
        part: "exp_avg".into(),
        offset: 4096,
    });
    assert_paused_upto(&sim, None);
}

/// A hung rank is killed before the job pauses: its newest sealed step,
/// final once it is dead, bounds the others'.
#[test]
fn a_pause_after_a_hung_rank_is_killed_is_bounded_by_it() {
    let mut sim = Sim::new(3);
    sim.run(30);
    sim.ranks[1].hung = true;
    sim.commands.clear();
    sim.run_until("a pause", 500, |s| !pauses(s).is_empty());
    let newest = sim.ranks[1].slots.iter().max().copied();
    assert!(newest.is_some());
    assert!(
        pauses(&sim)
            .iter()
            .all(|(_, d)| matches!(d, Directive::Pause { upto, .. } if *upto == newest)),
        "{:?}",
        pauses(&sim)
    );
}
