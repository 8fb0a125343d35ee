//! The host agent's socket protocol: what `hatrain-agent exec` shims and
//! `agentctl jobs` say to `hatrain-agent serve`, and what it answers. JSON
//! in the project's frames ([`hatrain_shared::frame`]), with a magic of its
//! own, so that a client of a job's control socket that reaches the host
//! agent's by mistake is told so instead of misread.
//!
//! A shim opens two connections: its *events* connection (registration,
//! then its worker's exits, shim to agent), and its *commands* connection
//! (start a worker, finish; agent to shim, each answered). Keeping the
//! directions apart lets the agent start a worker with one blocking round
//! trip, and reads the events when it is done.

use crate::reaper::ExitStatus;
use hatrain_shared::frame::Protocol;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

pub const PROTOCOL: Protocol = Protocol {
    name: "host agent",
    magic: *b"HTSV",
    major: 1,
    minor: 0,
    max_payload: 1 << 20,
};

/// A rank of a job another launcher started, as its shim saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub job: String,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Which launcher's variables these came from (for messages).
    pub launcher: String,
    /// The high-availability flags given to `exec`.
    pub ha: crate::cli::HaArgs,
    /// The worker command: program and arguments.
    pub command: Vec<String>,
    /// The shim's environment (its UTF-8 entries), which the worker starts
    /// from.
    pub env: Vec<(String, String)>,
    /// A shim whose agent went away comes back to the next one with its
    /// worker as it is.
    #[serde(default)]
    pub resume: Option<Resume>,
}

/// A returning shim's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The worker that runs.
    pub running: Option<i32>,
    /// Its last exit that no agent has answered with a new start (it ended
    /// while no agent ran, or just before the agent went).
    pub exited: Option<(i32, ExitStatus)>,
}

/// Shim (or `agentctl`) to agent: the first message of a connection, and
/// on an events connection, every later one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ToAgent {
    Register(Box<Registration>),
    /// This connection carries the agent's commands to the shim of `rank`
    /// of `job` (the same process that registered it).
    Commands {
        job: String,
        rank: usize,
    },
    /// The shim's worker ended.
    Exited {
        pid: i32,
        status: ExitStatus,
    },
    /// The jobs served.
    Jobs,
}

/// Agent to shim or `agentctl`: the answer to the first message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Reply {
    /// The rank is taken; its job's control socket.
    Registered {
        job_socket: PathBuf,
    },
    Attached,
    Refused {
        message: String,
    },
    Jobs(Vec<JobSummary>),
}

/// One served job, for `agentctl jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSummary {
    pub job: String,
    pub launcher: String,
    pub world_size: usize,
    /// Ranks registered so far (all of them once it runs).
    pub registered: usize,
    pub running: bool,
    pub started_unix_s: f64,
    pub socket: PathBuf,
}

/// Agent to shim, on its commands connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ToShim {
    /// Start the worker with `env` over the shim's own environment.
    Start {
        program: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// The job is over: exit with the worker's last status; with `error`,
    /// the job could not run. With `detach`, a worker that still runs
    /// trains on without the agent (a job that could not be re-adopted).
    Finish {
        error: Option<String>,
        #[serde(default)]
        detach: bool,
    },
}

/// Shim to agent: the answer to [`ToShim::Start`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Started {
    Pid(i32),
    Failed { message: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever arrives on the socket, decoding answers and never
        /// panics.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = PROTOCOL.decode(&bytes).map(|p| PROTOCOL.parse_json::<ToAgent>(p).is_ok());
            let _ = PROTOCOL.parse_json::<ToAgent>(&bytes);
            let _ = PROTOCOL.parse_json::<ToShim>(&bytes);
            let _ = PROTOCOL.parse_json::<Started>(&bytes);
            let _ = PROTOCOL.parse_json::<Reply>(&bytes);
        }
    }

    #[test]
    fn a_control_client_is_told_it_reached_the_host_agent() {
        let frame = hatrain_shared::control::PROTOCOL
            .encode(b"\"status\"")
            .unwrap();
        let e = PROTOCOL
            .parse_header(&frame[..hatrain_shared::frame::HEADER_LEN])
            .unwrap_err();
        assert!(e.to_string().contains("host agent: bad magic"), "{e}");
    }
}
