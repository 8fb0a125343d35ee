//! `hatrain-agent launch` command lines, built one way for the scenario
//! tests and the benchmarks (which include this file by path; `super`
//! gives `agent()` and `trainer()` in both).
//!
//! A line reads `[ip netns exec NS] hatrain-agent launch FLAGS -- PROGRAM
//! ARGS`. The flags with a method of their own come first, in a fixed
//! order (the agent takes its flags in any order, each given once); the
//! flags given with [`Launch::flags`] and [`Launch::option`] follow in the
//! order they were given; everything after `--` belongs to the program.
//!
//! [`Launch::new`] carries the defaults of the scenario tests;
//! [`Launch::bare`] carries none, for a line made only of what its caller
//! gives (a refused value, a benchmark's own settings). The environment is
//! one entry per variable, so the last call about a variable decides it,
//! as with [`Command`], and a default never overrides a caller's choice.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Variables through which the agent would take the environment's job id
/// (the harness's, or a Slurm allocation's) instead of making its own.
const JOB_VARS: [&str; 2] = ["HATRAIN_JOB_ID", "SLURM_JOB_ID"];

/// What the launched agent gets of one environment variable.
#[derive(Debug, Clone)]
enum Var {
    Set(OsString),
    Removed,
}

/// A `hatrain-agent launch` command line; [`Launch::command`] makes the
/// [`Command`].
#[derive(Debug, Clone)]
pub struct Launch {
    netns: Option<OsString>,
    nproc_per_node: usize,
    job: Option<OsString>,
    threads_per_worker: Option<usize>,
    stop_grace_secs: Option<u64>,
    high_availability: bool,
    worker_reboot: bool,
    shm_root: Option<PathBuf>,
    flags: Vec<OsString>,
    /// `None`: the reference trainer.
    program: Option<OsString>,
    args: Vec<OsString>,
    env: BTreeMap<OsString, Var>,
    default_env: bool,
    dir: Option<PathBuf>,
}

impl Launch {
    /// `nproc_per_node` ranks of the reference trainer with the scenario
    /// tests' defaults: `--threads-per-worker 1 --stop-grace-secs 3`,
    /// `RAYON_NUM_THREADS` removed (a value the agent inherits overrides
    /// `--threads-per-worker`), `RUST_LOG=info`, and, while no job id is
    /// given, `HATRAIN_JOB_ID` and `SLURM_JOB_ID` removed, so that the
    /// agent makes the job id. [`Launch::keep_env`] lets a variable through.
    pub fn new(nproc_per_node: usize) -> Self {
        Self {
            threads_per_worker: Some(1),
            stop_grace_secs: Some(3),
            default_env: true,
            ..Self::bare(nproc_per_node)
        }
    }

    /// `hatrain-agent launch --nproc-per-node N -- hatrain-train`, with no
    /// other flag and the test process's environment unchanged.
    pub fn bare(nproc_per_node: usize) -> Self {
        Self {
            netns: None,
            nproc_per_node,
            job: None,
            threads_per_worker: None,
            stop_grace_secs: None,
            high_availability: false,
            worker_reboot: false,
            shm_root: None,
            flags: Vec::new(),
            program: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            default_env: false,
            dir: None,
        }
    }

    /// `--job-id ID`.
    pub fn job(mut self, id: impl AsRef<OsStr>) -> Self {
        self.job = Some(id.as_ref().to_owned());
        self
    }

    /// `--threads-per-worker N`.
    pub fn threads_per_worker(mut self, n: usize) -> Self {
        self.threads_per_worker = Some(n);
        self
    }

    /// `--stop-grace-secs S`.
    pub fn stop_grace_secs(mut self, secs: u64) -> Self {
        self.stop_grace_secs = Some(secs);
        self
    }

    /// `--enable-high-availability`.
    pub fn high_availability(mut self) -> Self {
        self.high_availability = true;
        self
    }

    /// `--enable-high-availability --enable-worker-reboot`.
    pub fn worker_reboot(mut self) -> Self {
        self.high_availability = true;
        self.worker_reboot = true;
        self
    }

    /// `--shm-root DIR`.
    pub fn shm_root(mut self, dir: impl AsRef<Path>) -> Self {
        self.shm_root = Some(dir.as_ref().to_owned());
        self
    }

    /// More agent arguments, as given, after the ones above.
    pub fn flags<I>(mut self, flags: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        self.flags
            .extend(flags.into_iter().map(|f| f.as_ref().to_owned()));
        self
    }

    /// One more agent option and its value (`--secret-file PATH`).
    pub fn option(self, name: &str, value: impl AsRef<OsStr>) -> Self {
        self.flags([OsStr::new(name), value.as_ref()])
    }

    /// The program the ranks run, instead of the reference trainer.
    pub fn program(mut self, program: impl AsRef<OsStr>) -> Self {
        self.program = Some(program.as_ref().to_owned());
        self
    }

    /// One argument of the program.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Arguments of the program.
    pub fn args<I>(mut self, args: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// `HATRAIN_FAULT_PLAN=PLAN` (the trainer's deterministic faults).
    pub fn fault_plan(self, plan: impl AsRef<OsStr>) -> Self {
        self.env("HATRAIN_FAULT_PLAN", plan)
    }

    /// No `HATRAIN_FAULT_PLAN`, whatever the test process has.
    pub fn no_fault_plan(self) -> Self {
        self.env_remove("HATRAIN_FAULT_PLAN")
    }

    /// `KEY=VALUE` for the agent, and so for its workers.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .insert(key.as_ref().to_owned(), Var::Set(value.as_ref().to_owned()));
        self
    }

    /// `KEY` unset for the agent, and so for its workers.
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.env.insert(key.as_ref().to_owned(), Var::Removed);
        self
    }

    /// The agent's working directory.
    pub fn current_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.dir = Some(dir.as_ref().to_owned());
        self
    }

    /// The agent started by `ip netns exec NS`, in that network namespace.
    pub fn netns(mut self, ns: impl AsRef<OsStr>) -> Self {
        self.netns = Some(ns.as_ref().to_owned());
        self
    }

    /// The command line, ready to spawn (or to change further, as any
    /// [`Command`]).
    pub fn command(&self) -> Command {
        let mut c = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args([OsStr::new("netns"), OsStr::new("exec"), ns])
                    .arg(super::agent());
                c
            }
            None => Command::new(super::agent()),
        };
        c.args(["launch", "--nproc-per-node"])
            .arg(self.nproc_per_node.to_string());
        if let Some(job) = &self.job {
            c.arg("--job-id").arg(job);
        }
        if let Some(n) = self.threads_per_worker {
            c.arg("--threads-per-worker").arg(n.to_string());
        }
        if let Some(secs) = self.stop_grace_secs {
            c.arg("--stop-grace-secs").arg(secs.to_string());
        }
        if self.high_availability {
            c.arg("--enable-high-availability");
        }
        if self.worker_reboot {
            c.arg("--enable-worker-reboot");
        }
        if let Some(root) = &self.shm_root {
            c.arg("--shm-root").arg(root);
        }
        c.args(&self.flags).arg("--");
        match &self.program {
            Some(p) => c.arg(p),
            None => c.arg(super::trainer()),
        };
        c.args(&self.args);
        if let Some(dir) = &self.dir {
            c.current_dir(dir);
        }
        let mut env = self.env.clone();
        if self.default_env {
            let mut default = |key: &str, var: Var| {
                env.entry(key.into()).or_insert(var);
            };
            default("RAYON_NUM_THREADS", Var::Removed);
            default("RUST_LOG", Var::Set("info".into()));
            if self.job.is_none() {
                for key in JOB_VARS {
                    default(key, Var::Removed);
                }
            }
        }
        for (key, var) in &env {
            match var {
                Var::Set(value) => {
                    c.env(key, value);
                }
                Var::Removed => {
                    c.env_remove(key);
                }
            }
        }
        c
    }
}
