//! Python workers forked from a server that has done their imports
//! (`--preload MODULES`).
//!
//! A PyTorch worker spends seconds of its start importing torch, and a
//! rank restarted after a fault spends them again while the job waits. With
//! `--preload torch`, the agent starts `python [OPTIONS] -m
//! hatrain.forkserver torch` once per host (the worker command's
//! interpreter and interpreter options), and each worker, at the start, in
//! a worker reboot, a group restart or as a warm standby, is forked from it
//! (`python/hatrain/forkserver.py` says how, and the protocol).
//!
//! The worker is still the agent's child: the server's go-between exits at
//! once, and the worker is reparented here (the agent is a child
//! subreaper), so the [`Reaper`] collects it and its exit arrives like any
//! worker's. The reaper's lock is held from the request until its pid is
//! registered ([`Reaper::spawn_with`]).
//!
//! The server is the agent's helper, never in the way: a worker it cannot
//! fork (not ready yet, gone, an environment that is not UTF-8, no answer
//! within [`REPLY_TIMEOUT`]) is started as a fresh process. A server that
//! dies after it was ready is started again, up to [`MAX_STARTS`] times; one
//! that cannot import its modules is not.

use crate::reaper::{ExitEvent, Reaper};
use nix::sys::signal::Signal;
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, recv, sendmsg, setsockopt,
    socketpair, sockopt,
};
use nix::sys::time::TimeVal;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;

/// The variable that names the server's socket.
pub const ENV_FD: &str = "HATRAIN_FORKSERVER_FD";
/// The descriptor the server's socket has in the server.
const SERVER_FD: i32 = 3;
/// How long a fork may take before the server counts as broken.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Servers started per job, the first included.
pub const MAX_STARTS: u32 = 4;
/// Largest message the server sends.
const MAX_REPLY: usize = 64 * 1024;

/// What a worker runs: a script's path or a module's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Script(OsString),
    Module(String),
}

/// Why a worker command cannot be forked from the server, or the server
/// cannot be started.
#[derive(Debug, thiserror::Error)]
pub enum ForkServerError {
    #[error(
        "the worker command runs {0}, not a Python interpreter (python SCRIPT or python -m MODULE)"
    )]
    NotPython(PathBuf),
    #[error("the Python option {0:?} is not UTF-8")]
    OptionNotUtf8(OsString),
    #[error("python -c CODE: only a script or -m MODULE can be forked from a preloaded server")]
    Code,
    #[error("python -m without a module")]
    NoModule,
    #[error("the module name is not UTF-8")]
    ModuleNotUtf8,
    #[error("the Python command names no script (python SCRIPT or python -m MODULE)")]
    NoScript,
    #[error("--preload {0:?} is not a Python module name")]
    ModuleName(String),
    #[error("socketpair")]
    Socket(#[source] nix::Error),
    #[error("{0}")]
    Spawn(PathBuf, #[source] std::io::Error),
    #[error("{0:?} is not UTF-8")]
    NotUtf8(OsString),
    #[error("the value of the environment variable {0} is not UTF-8")]
    EnvNotUtf8(String),
}

/// A Python worker command, read as the interpreter reads its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonCommand {
    pub program: PathBuf,
    /// The interpreter's own options (`-u`, `-X dev`), before the target.
    pub options: Vec<OsString>,
    pub target: Target,
    pub args: Vec<OsString>,
}

impl PythonCommand {
    /// Reads `program args` as `python [OPTIONS] SCRIPT ARGS` or `python
    /// [OPTIONS] -m MODULE ARGS`; anything else is refused with what it was.
    pub fn parse(program: &Path, args: &[OsString]) -> Result<Self, ForkServerError> {
        let name = program.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.starts_with("python") {
            return Err(ForkServerError::NotPython(program.to_path_buf()));
        }
        let mut options = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let Some(a) = args[i].to_str() else {
                return Err(ForkServerError::OptionNotUtf8(args[i].clone()));
            };
            if a == "--" {
                i += 1;
                break;
            }
            if !a.starts_with('-') || a == "-" {
                break;
            }
            if a == "--check-hash-based-pycs" {
                options.extend(args.get(i..i + 2).unwrap_or(&args[i..]).iter().cloned());
                i += 2;
                continue;
            }
            if a.starts_with("--") {
                options.push(args[i].clone());
                i += 1;
                continue;
            }
            // Letters, the last of which may take the rest or the next
            // argument: `-uB`, `-Wignore`, `-X dev`, `-m mod`.
            let letters = &a[1..];
            for (at, c) in letters.char_indices() {
                let rest = &letters[at + c.len_utf8()..];
                match c {
                    'c' => return Err(ForkServerError::Code),
                    'm' => {
                        let (module, next) = if rest.is_empty() {
                            let m = args.get(i + 1).ok_or(ForkServerError::NoModule)?;
                            (m.to_str().ok_or(ForkServerError::ModuleNotUtf8)?, i + 2)
                        } else {
                            (rest, i + 1)
                        };
                        if !letters[..at].is_empty() {
                            options.push(format!("-{}", &letters[..at]).into());
                        }
                        return Ok(Self {
                            program: program.to_path_buf(),
                            options,
                            target: Target::Module(module.to_string()),
                            args: args[next.min(args.len())..].to_vec(),
                        });
                    }
                    'W' | 'X' => {
                        options.push(args[i].clone());
                        if rest.is_empty() {
                            if let Some(v) = args.get(i + 1) {
                                options.push(v.clone());
                            }
                            i += 1;
                        }
                        break;
                    }
                    _ if at + c.len_utf8() == letters.len() => options.push(args[i].clone()),
                    _ => {}
                }
            }
            i += 1;
        }
        match args.get(i) {
            Some(s) if s != "-" => Ok(Self {
                program: program.to_path_buf(),
                options,
                target: Target::Script(s.clone()),
                args: args[i + 1..].to_vec(),
            }),
            _ => Err(ForkServerError::NoScript),
        }
    }
}

/// Checks a module name given to `--preload`.
pub fn check_module(name: &str) -> Result<(), ForkServerError> {
    let ok = !name.is_empty()
        && name.split('.').all(|p| {
            p.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
                && p.chars().all(|c| c.is_alphanumeric() || c == '_')
        });
    if ok {
        Ok(())
    } else {
        Err(ForkServerError::ModuleName(name.to_string()))
    }
}

#[derive(Debug)]
enum State {
    Starting {
        pid: i32,
        sock: OwnedFd,
    },
    Ready {
        pid: i32,
        sock: OwnedFd,
    },
    /// SIGKILLed, its exit not yet recorded; `again`: start another then.
    Stopping {
        pid: i32,
        again: bool,
    },
    /// Not running; `again`: start another.
    Down {
        again: bool,
    },
}

/// A worker forked by the server: its pid and the read ends of its stdout
/// and stderr.
pub(super) type Forked = (i32, OwnedFd, OwnedFd);

/// This host's fork server.
#[derive(Debug)]
pub(super) struct ForkServer {
    modules: Vec<String>,
    state: State,
    starts: u32,
}

impl ForkServer {
    pub(super) fn new(modules: Vec<String>) -> Self {
        Self {
            modules,
            state: State::Down { again: true },
            starts: 0,
        }
    }

    /// The server's pid until its exit is recorded.
    pub(super) fn pid(&self) -> Option<i32> {
        match &self.state {
            State::Starting { pid, .. }
            | State::Ready { pid, .. }
            | State::Stopping { pid, .. } => Some(*pid),
            State::Down { .. } => None,
        }
    }

    /// Starts a server for `template`'s command with the environment the
    /// ranks share (`env`), unless one runs or none may be started.
    pub(super) fn start(
        &mut self,
        reaper: &Reaper,
        exits: &UnboundedSender<ExitEvent>,
        template: &super::WorkerSpec,
        env: &[(String, String)],
    ) {
        if !matches!(self.state, State::Down { again: true }) || self.starts >= MAX_STARTS {
            return;
        }
        match self.launch(reaper, exits, template, env) {
            Ok((pid, sock)) => {
                self.starts += 1;
                tracing::info!(pid, modules = ?self.modules, "fork server started");
                self.state = State::Starting { pid, sock };
            }
            Err(e) => {
                tracing::error!(error = %crate::error_chain(&e), "cannot start the fork server: workers start as fresh processes");
                self.state = State::Down { again: false };
            }
        }
    }

    fn launch(
        &self,
        reaper: &Reaper,
        exits: &UnboundedSender<ExitEvent>,
        template: &super::WorkerSpec,
        env: &[(String, String)],
    ) -> Result<(i32, OwnedFd), ForkServerError> {
        let py = PythonCommand::parse(&template.program, &template.args)?;
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(ForkServerError::Socket)?;
        let mut cmd = Command::new(&py.program);
        cmd.args(&py.options)
            .args(["-m", "hatrain.forkserver"])
            .args(&self.modules)
            // Room for a worker's own command in its `ps` line.
            .arg("--")
            .arg(&template.program)
            .args(&template.args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(ENV_FD, SERVER_FD.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let raw = theirs.as_raw_fd();
        // SAFETY: between fork and exec only fcntl(2), dup2(2), setpgid(2),
        // prctl(2), open(2), write(2), close(2), getrlimit(2) and
        // setrlimit(2): async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 clears close-on-exec on the copy; a socket that is
                // already descriptor 3 must have it cleared by hand.
                let r = if raw == SERVER_FD {
                    libc::fcntl(raw, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, SERVER_FD)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0))?;
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                crate::oom::prefer_as_oom_victim();
                crate::limits::restore_nofile_in_child();
                Ok(())
            });
        }
        let child = reaper
            .spawn(&mut cmd, exits)
            .map_err(|e| ForkServerError::Spawn(py.program.clone(), e))?;
        drop(theirs);
        let pid = i32::try_from(child.id()).expect("pids fit in i32");
        Ok((pid, ours))
    }

    /// Takes the server's ready message if it has come; true while it
    /// imports still.
    fn poll_ready(&mut self) -> bool {
        let State::Starting { pid, sock } = &self.state else {
            return false;
        };
        let pid = *pid;
        let mut buf = vec![0u8; MAX_REPLY];
        let said = match recv(sock.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Err(nix::errno::Errno::EAGAIN) => return true,
            Err(e) => Err(format!("its socket: {e}")),
            Ok(0) => Err(
                "it ended before it was ready (is the hatrain package installed for the worker command's Python?)"
                    .to_string(),
            ),
            Ok(n) => serde_json::from_slice::<serde_json::Value>(&buf[..n])
                .map_err(|e| format!("its message is not JSON: {e}")),
        };
        let said = said.and_then(|m| match (&m["ready"], m["error"].as_str()) {
            (serde_json::Value::Bool(true), _) => Ok(m["seconds"].as_f64().unwrap_or(f64::NAN)),
            (_, Some(why)) => Err(why.to_string()),
            _ => Err(format!("an unknown message: {m}")),
        });
        let limit = TimeVal::new(REPLY_TIMEOUT.as_secs() as _, 0);
        let said = said.and_then(|seconds| {
            setsockopt(sock, sockopt::ReceiveTimeout, &limit)
                .map(|()| seconds)
                .map_err(|e| format!("cannot bound its replies: {e}"))
        });
        match said {
            Ok(seconds) => {
                tracing::info!(pid, seconds, modules = ?self.modules, "fork server ready: workers are forked from it");
                if let State::Starting { sock, .. } =
                    std::mem::replace(&mut self.state, State::Down { again: false })
                {
                    self.state = State::Ready { pid, sock };
                }
            }
            Err(why) => {
                tracing::error!(pid, error = %why, modules = ?self.modules, "the fork server failed: workers start as fresh processes");
                self.kill(false);
            }
        }
        false
    }

    /// Waits up to `limit` for the server to be ready.
    pub(super) async fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.poll_ready() {
            if Instant::now() >= deadline {
                let pid = self.pid().unwrap_or(0);
                tracing::error!(
                    pid,
                    ?limit,
                    "the fork server is not ready in time: stopped, workers start as fresh processes"
                );
                self.kill(false);
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Forks `spec`'s worker from the server; `None` if it cannot (the
    /// caller starts a fresh process), with the reason logged.
    ///
    /// This blocks the calling thread for the exchange: a few tens of
    /// milliseconds, [`REPLY_TIMEOUT`] at most.
    pub(super) fn fork(
        &mut self,
        reaper: &Reaper,
        exits: &UnboundedSender<ExitEvent>,
        spec: &super::WorkerSpec,
    ) -> Option<Forked> {
        self.poll_ready();
        let State::Ready { pid: server, sock } = &self.state else {
            return None;
        };
        let server = *server;
        let request = match request(spec) {
            Ok(r) => r,
            Err(why) => {
                tracing::warn!(
                    rank = spec.rank,
                    why = %why,
                    "not forked from the fork server: a fresh process instead"
                );
                return None;
            }
        };
        let result = (|| {
            let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
            let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
            // The worker waits here until its pid is registered; closed
            // unwritten, it exits.
            let (gate_r, gate_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
            let fds = [out_w.as_raw_fd(), err_w.as_raw_fd(), gate_r.as_raw_fd()];
            let pid = reaper.spawn_with(exits, || {
                // A signal to the agent (a worker's exit) interrupts a
                // call here: it is made again.
                retry_eintr(|| {
                    sendmsg::<()>(
                        sock.as_raw_fd(),
                        &[IoSlice::new(&request)],
                        &[ControlMessage::ScmRights(&fds)],
                        MsgFlags::empty(),
                        None,
                    )
                })?;
                let mut buf = vec![0u8; MAX_REPLY];
                let n = retry_eintr(|| recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()))?;
                if n == 0 {
                    return Err(std::io::Error::other("the fork server closed its socket"));
                }
                let reply: serde_json::Value = serde_json::from_slice(&buf[..n])
                    .map_err(|e| std::io::Error::other(format!("a reply that is not JSON: {e}")))?;
                match reply["pid"].as_i64().and_then(|p| i32::try_from(p).ok()) {
                    Some(pid) if pid > 0 => Ok(pid),
                    _ => Err(std::io::Error::other(match reply["error"].as_str() {
                        Some(why) => why.to_string(),
                        None => format!("a reply with no pid: {reply}"),
                    })),
                }
            })?;
            // A worker that died already has no gate to read: its exit
            // is registered all the same.
            let _ = nix::unistd::write(&gate_w, &[1]);
            Ok::<_, std::io::Error>((pid, out_r, err_r))
        })();
        match result {
            Ok(forked) => Some(forked),
            Err(e) => {
                tracing::error!(server, rank = spec.rank, error = %e, "the fork server did not fork the worker: it is started again, and the worker starts as a fresh process");
                self.kill(true);
                None
            }
        }
    }

    /// Records the server's exit; false if `ev` is not its.
    pub(super) fn exited(&mut self, ev: &ExitEvent) -> bool {
        if self.pid() != Some(ev.pid) {
            return false;
        }
        let again = match self.state {
            State::Ready { .. } => true,
            State::Stopping { again, .. } => again,
            State::Starting { .. } | State::Down { .. } => false,
        };
        if again && self.starts < MAX_STARTS {
            tracing::warn!(pid = ev.pid, status = %ev.status, "the fork server ended: starting another");
        } else if !matches!(self.state, State::Stopping { again: false, .. }) {
            tracing::error!(pid = ev.pid, status = %ev.status, "the fork server ended: workers start as fresh processes");
        }
        self.state = State::Down { again };
        true
    }

    /// SIGKILL to the server and its go-between (its process group: it
    /// holds nothing); another is started after its exit if `again`.
    fn kill(&mut self, again: bool) {
        if let Some(pid) = self.pid() {
            super::signal(-pid, Signal::SIGKILL);
            self.state = State::Stopping { pid, again };
        } else {
            self.state = State::Down { again };
        }
    }

    /// Stops the server for good.
    pub(super) fn stop(&mut self) {
        self.kill(false);
    }
}

impl Drop for ForkServer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            super::signal(-pid, Signal::SIGKILL);
        }
    }
}

/// The request for `spec`'s worker: its target, arguments and whole
/// environment (the agent's, with the worker's own over it).
fn request(spec: &super::WorkerSpec) -> Result<Vec<u8>, ForkServerError> {
    let py = PythonCommand::parse(&spec.program, &spec.args)?;
    let utf8 = |s: OsString| s.into_string().map_err(ForkServerError::NotUtf8);
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in std::env::vars_os() {
        let k = utf8(k)?;
        let v = v
            .into_string()
            .map_err(|_| ForkServerError::EnvNotUtf8(k.clone()))?;
        env.insert(k, v);
    }
    env.extend(spec.env.iter().cloned());
    let args = py
        .args
        .into_iter()
        .map(utf8)
        .collect::<Result<Vec<_>, _>>()?;
    let argv = std::iter::once(spec.program.clone().into_os_string())
        .chain(spec.args.iter().cloned())
        .map(utf8)
        .collect::<Result<Vec<_>, _>>()?;
    let mut req = serde_json::json!({
        "args": args,
        "argv": argv,
        "env": env.into_iter().collect::<Vec<_>>(),
        "oom_score_adj": String::from_utf8_lossy(crate::oom::WORKER_OOM_SCORE_ADJ),
    });
    match py.target {
        Target::Script(s) => req["script"] = utf8(s)?.into(),
        Target::Module(m) => req["module"] = m.into(),
    }
    Ok(req.to_string().into_bytes())
}

/// `call`, made again while a signal interrupts it.
fn retry_eintr<T>(mut call: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    loop {
        match call() {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(cmd: &[&str]) -> Result<PythonCommand, ForkServerError> {
        let args: Vec<OsString> = cmd[1..].iter().map(Into::into).collect();
        PythonCommand::parse(Path::new(cmd[0]), &args)
    }

    /// What refusing `cmd` says.
    fn refusal(cmd: &[&str]) -> String {
        parse(cmd).unwrap_err().to_string()
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(Into::into).collect()
    }

    #[test]
    fn a_python_command_is_read_as_the_interpreter_reads_it() {
        let c = parse(&["python3", "-u", "train.py", "--steps", "5", "-m", "x"]).unwrap();
        assert_eq!(c.options, os(&["-u"]));
        assert_eq!(c.target, Target::Script("train.py".into()));
        assert_eq!(c.args, os(&["--steps", "5", "-m", "x"]));

        let c = parse(&[
            "/usr/bin/python3.11",
            "-X",
            "dev",
            "-Wignore",
            "-um",
            "pkg.main",
            "a",
        ])
        .unwrap();
        assert_eq!(c.options, os(&["-X", "dev", "-Wignore", "-u"]));
        assert_eq!(c.target, Target::Module("pkg.main".into()));
        assert_eq!(c.args, os(&["a"]));

        let c = parse(&["python", "-mpkg", "--x"]).unwrap();
        assert_eq!(c.target, Target::Module("pkg".into()));
        assert_eq!(c.args, os(&["--x"]));

        let c = parse(&["python", "-OO", "--", "-script.py"]).unwrap();
        assert_eq!(c.options, os(&["-OO"]));
        assert_eq!(c.target, Target::Script("-script.py".into()));
    }

    #[test]
    fn what_cannot_be_forked_is_refused_with_what_it_was() {
        let e = refusal(&["./hatrain-train", "--steps", "5"]);
        assert!(
            e.contains("hatrain-train") && e.contains("not a Python"),
            "{e}"
        );
        assert!(refusal(&["python", "-c", "print(1)"]).contains("-c"));
        assert!(refusal(&["python", "-u"]).contains("no script"));
        assert!(refusal(&["python", "-"]).contains("no script"));
        assert!(refusal(&["python", "-m"]).contains("without a module"));
    }

    #[test]
    fn preloaded_module_names_are_checked() {
        for ok in ["torch", "torch._dynamo", "_x.y2"] {
            check_module(ok).unwrap();
        }
        for bad in ["", "torch.", "2x", "a b", "a-b", "a..b"] {
            assert!(
                check_module(bad)
                    .unwrap_err()
                    .to_string()
                    .contains("module name"),
                "{bad}"
            );
        }
    }
}
