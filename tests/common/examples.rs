//! PyTorch examples (`examples/`) run under `hatrain-agent launch` to
//! their end, and what their logs say.

use super::python::{example, launch};
use std::path::Path;

/// An example's run under `hatrain-agent launch`: each rank's JSON-lines
/// log (`--log-jsonl log.{rank}.jsonl`), and the launch's output.
pub struct ExampleRun {
    pub logs: Vec<Vec<serde_json::Value>>,
    pub output: String,
}

/// What an example run is: the script of `examples/`, its ranks, the
/// launch's flags, the script's arguments, a fault plan and environment.
pub struct Example<'a> {
    pub script: &'a str,
    pub ranks: usize,
    pub flags: &'a [&'a str],
    pub args: &'a [&'a str],
    pub plan: Option<&'a str>,
    pub env: &'a [(&'a str, &'a Path)],
}

impl Example<'_> {
    /// Runs it to its end, which must be a success.
    pub fn run(&self) -> ExampleRun {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.{rank}.jsonl");
        let script = example(self.script);
        let mut args = vec![
            script.to_str().unwrap(),
            "--log-jsonl",
            log.to_str().unwrap(),
        ];
        args.extend(self.args);
        let mut cmd = launch(self.ranks, self.flags, &args, dir.path());
        cmd.env_remove("HATRAIN_FAULT_PLAN");
        if let Some(p) = self.plan {
            cmd.env("HATRAIN_FAULT_PLAN", p);
        }
        for (k, v) in self.env {
            cmd.env(k, v);
        }
        let tag = super::job_id(self.script.trim_end_matches(".py"));
        let out = super::Job::spawn(cmd, &tag).wait_output(std::time::Duration::from_secs(300));
        let output = super::text(&out);
        assert!(
            out.status.success(),
            "{} {:?} {:?}: {output}",
            self.script,
            self.args,
            self.plan
        );
        let logs = (0..self.ranks)
            .map(|r| super::read_log(&dir.path().join(format!("log.{r}.jsonl"))))
            .collect();
        ExampleRun { logs, output }
    }
}

/// The events of a log named `name`.
pub fn events<'a>(log: &'a [serde_json::Value], name: &str) -> Vec<&'a serde_json::Value> {
    log.iter().filter(|e| e["event"] == name).collect()
}

/// The SHA-256 of the parameters the log's one `final` event gives, at
/// step `steps`.
pub fn final_digest(log: &[serde_json::Value], steps: u64) -> String {
    let f = events(log, "final");
    assert_eq!(f.len(), 1, "{log:?}");
    assert_eq!(f[0]["step"], steps);
    f[0]["model_sha256"].as_str().unwrap().to_string()
}

/// `examples/torch_ddp.py` on 2 ranks for 24 steps ([`DDP_STEPS`]), with
/// the script's `args`, a fault plan and environment.
pub fn torch_ddp(plan: Option<&str>, args: &[&str], env: &[(&str, &Path)]) -> ExampleRun {
    let steps = DDP_STEPS.to_string();
    let mut all = vec!["--steps", steps.as_str()];
    all.extend(args);
    Example {
        script: "torch_ddp.py",
        ranks: 2,
        flags: &[],
        args: &all,
        plan,
        env,
    }
    .run()
}

/// The steps [`torch_ddp`] runs.
pub const DDP_STEPS: u64 = 24;
