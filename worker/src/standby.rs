//! Warm standbys: a process the agent starts ahead of time with the job's
//! command (and [`ENV_STANDBY`] set) does its expensive start-up (imports,
//! model build, buffer allocation), then parks in [`standby`] until the
//! agent gives it the place of a failed rank. It then registers as that
//! rank and restores the rank's state from shared memory, as a replacement
//! process would, without paying for its start-up after the fault.

use crate::runtime::{ENV_RESTART_COUNT, RuntimeError};
use hatrain_shared::control::{self, ENV_STANDBY, PROTOCOL, Request, Response};
use std::path::PathBuf;
use std::sync::OnceLock;

/// torchrun's variable for the file a worker's error handler writes.
pub const ENV_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";

/// The place the agent gave this standby.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assigned {
    pub rank: usize,
    pub local_rank: usize,
    /// Which process of the rank this is (its `HATRAIN_RESTART_COUNT`).
    pub restarts: u32,
    /// The rank's `TORCHELASTIC_ERROR_FILE`, when the launch has one.
    pub error_file: Option<PathBuf>,
}

impl Assigned {
    /// The environment a process started as this rank has and a standby
    /// lacks: set these, and remove [`Assigned::CLEARED`], for the process
    /// and whatever it starts to see the rank's.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("ROLE_RANK", self.rank.to_string()),
            (ENV_RESTART_COUNT, self.restarts.to_string()),
        ];
        if let Some(f) = &self.error_file {
            env.push((ENV_ERROR_FILE, f.display().to_string()));
        }
        env
    }

    /// The variable that made this process a standby: a promoted one is not.
    pub const CLEARED: &'static str = ENV_STANDBY;
}

static ASSIGNED: OnceLock<Assigned> = OnceLock::new();

/// Whether this process was started as a standby.
pub fn is_standby() -> bool {
    std::env::var_os(ENV_STANDBY).is_some_and(|v| v == "1")
}

/// For a standby: parks until the agent gives it a rank, and returns that
/// place (the same on later calls). `None` for any other process. Call it
/// after the expensive start-up, before anything that depends on the rank.
pub fn standby() -> Result<Option<Assigned>, RuntimeError> {
    if let Some(a) = ASSIGNED.get() {
        return Ok(Some(a.clone()));
    }
    if !is_standby() {
        return Ok(None);
    }
    let socket = std::env::var_os(control::ENV_SOCKET)
        .map(PathBuf::from)
        .ok_or_else(|| {
            RuntimeError::Refused(format!(
                "{ENV_STANDBY}=1 without {}: a standby is started by the agent",
                control::ENV_SOCKET
            ))
        })?;
    let mut conn = control::connect(&socket)?;
    PROTOCOL.send_json(
        &mut conn,
        &Request::Standby {
            pid: std::process::id(),
        },
    )?;
    // Parked: the agent answers when a rank fails (or closes the
    // connection when the job ends, which ends this process's wait).
    match PROTOCOL.recv_json(&mut conn)? {
        Response::Assigned {
            rank,
            local_rank,
            restarts,
            error_file,
        } => {
            let a = Assigned {
                rank,
                local_rank,
                restarts,
                error_file,
            };
            let _ = ASSIGNED.set(a.clone());
            Ok(Some(a))
        }
        Response::Error { message } => Err(RuntimeError::Refused(message)),
        other => Err(RuntimeError::Unexpected {
            expected: "assigned",
            got: format!("{other:?}"),
        }),
    }
}

/// The place given to this standby, if it was one and has been given one.
pub fn assigned() -> Option<Assigned> {
    ASSIGNED.get().cloned()
}

/// Which process of its rank this is: the restart count the agent gave a
/// standby, else `HATRAIN_RESTART_COUNT` (0 without it).
pub fn restart_count() -> u64 {
    match ASSIGNED.get() {
        Some(a) => u64::from(a.restarts),
        None => std::env::var(ENV_RESTART_COUNT)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    }
}
