//! `hatrain-mapworker`: see [`hatrain_scenarios::mapworker`].

use hatrain_scenarios::mapworker::{BETA, alpha, alpha_len, beta, header, map};
use hatrain_shared::shm::Directive;
use hatrain_shared::statemap::{Dtype, Part, Sharing};
use hatrain_worker::comm::NoHooks;
use hatrain_worker::runtime::{CommitOf, Runtime, SharedBuf, Start};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num(name: &str, default: u64) -> u64 {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn fill(buf: &SharedBuf, f: impl Fn(u64) -> f32) {
    let mut g = buf.write().unwrap_or_else(|p| p.into_inner());
    for (i, v) in g.iter_mut().enumerate() {
        *v = f(i as u64);
    }
}

fn main() -> ExitCode {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let (rank, world) = (env("RANK").unwrap_or(0), env("WORLD_SIZE").unwrap_or(1));
    let steps = num("--steps", 30);
    let interval = num("--interval", 5);
    let step_ms = num("--step-ms", 10);
    let dir = PathBuf::from(arg("--save").unwrap_or_else(|| "mapworker-ckpt".into()));
    // `--delay-rank R --delay-ms MS`: rank R registers MS late (a test
    // takes the shm root's space meanwhile).
    if arg("--delay-rank").and_then(|r| r.parse::<usize>().ok()) == Some(rank) {
        std::thread::sleep(Duration::from_millis(num("--delay-ms", 0)));
    }
    let a: SharedBuf = Arc::new(RwLock::new(vec![0.0; alpha_len(rank) as usize]));
    let b: SharedBuf = Arc::new(RwLock::new(vec![0.0; BETA as usize]));
    let mut state_map = map(rank, world, &dir, interval);
    let mut buffers = vec![Arc::clone(&a), Arc::clone(&b)];
    // `--pad-mib N`: N MiB more state, in a part of its own that no
    // checkpoint holds, so the stores are as large as a test needs.
    let pad = num("--pad-mib", 0) * (1 << 18);
    if pad > 0 {
        state_map.parts.push(Part {
            name: "pad".into(),
            dtype: Dtype::F32,
            len: pad,
            sharing: Sharing::Unique,
        });
        buffers.push(Arc::new(RwLock::new(vec![0.0; pad as usize])));
    }
    let (mut rt, start) = match Runtime::connect(rank, state_map, buffers, 1, Arc::new(NoHooks)) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("mapworker rank {rank}: {e}");
            return ExitCode::from(2);
        }
    };
    let mut step = 0;
    let mut epoch = 0;
    // A replacement's buffers hold nothing until it restores them.
    let mut live = !matches!(start, Start::AwaitDirective);
    let mut wait = !live;
    if live {
        fill(&a, |i| alpha(0, rank, i));
        fill(&b, |i| beta(0, rank, i));
        rt.commit(0, epoch, header(0, rank), CommitOf::Start);
    }
    while step < steps {
        if wait || rt.directive_pending() {
            wait = false;
            match rt.await_directive() {
                Directive::Resume { epoch: e, step: s } => {
                    epoch = e;
                    if !live || s != step {
                        match rt.restore(s) {
                            Ok(meta) if meta == header(s, rank) => {}
                            Ok(_) => {
                                eprintln!(
                                    "mapworker rank {rank}: restored header is not step {s}'s"
                                );
                                return ExitCode::from(3);
                            }
                            Err(e) => {
                                eprintln!("mapworker rank {rank}: cannot restore step {s}: {e}");
                                return ExitCode::from(3);
                            }
                        }
                        step = s;
                        live = true;
                    }
                    continue;
                }
                _ => return ExitCode::from(5),
            }
        }
        let next = step + 1;
        rt.begin_step(next);
        std::thread::sleep(Duration::from_millis(step_ms));
        rt.start_update();
        fill(&a, |i| alpha(next, rank, i));
        fill(&b, |i| beta(next, rank, i));
        rt.end_update(next);
        step = next;
        let of = if step == steps {
            CommitOf::Last
        } else {
            CommitOf::Step
        };
        rt.commit(step, epoch, header(step, rank), of);
    }
    rt.finish(step);
    ExitCode::SUCCESS
}
