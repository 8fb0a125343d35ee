//! Messages of the rendezvous store: the small key-value store, hosted by the
//! agent (never by a rank, since any rank may be the one that died), where the
//! ranks of one epoch publish their ring addresses and wait for each other.
//!
//! Each request and each response is one [`frame`](crate::frame) of the
//! [`PROTOCOL`] carrying JSON. Keys are namespaced by epoch
//! (`epoch/<e>/ring/<rank>`), so a rebuilt communicator never reads a stale
//! address.

use crate::frame::Protocol;
use serde::{Deserialize, Serialize};

/// Frame identity of the rendezvous protocol.
pub const PROTOCOL: Protocol = Protocol {
    name: "rendezvous",
    magic: *b"HTRZ",
    major: 1,
    minor: 0,
    max_payload: 64 * 1024,
};

/// Environment variable with the address (`HOST:PORT`) of the store the
/// launcher hosts; `MASTER_ADDR:MASTER_PORT` is the workers' own (rank 0 of
/// a PyTorch job listens there). Without it, rank 0 hosts the store at the
/// master address, so the trainer also runs under other launchers.
pub const ENV_AGENT_STORE: &str = "HATRAIN_AGENT_STORE";

/// A worker's place in a data-parallel group that elastic training
/// resized, `RANK/WORLD` (its `RANK` stays the launcher's, its identity
/// with the agent): given to a process restarted after a resize.
pub const ENV_GROUP_PLACE: &str = "HATRAIN_GROUP_PLACE";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// Stores `value` under `key`, replacing any older value.
    Set { key: String, value: String },
    /// Returns the value of `key`, waiting up to `wait_ms` for it to appear.
    Get { key: String, wait_ms: u64 },
    /// Adds `delta` to the counter `key` (0 when absent) and returns the sum.
    Add { key: String, delta: i64 },
    /// Nothing: a client's first request, which authenticates its
    /// connection (and the server's answer, the server) at once.
    Ping,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Response {
    Done,
    Value {
        value: String,
    },
    Counter {
        value: i64,
    },
    /// The key did not appear within the wait.
    Timeout {
        key: String,
    },
    /// The request was refused; the message says why.
    Refused {
        message: String,
    },
}

/// The key under which `rank` publishes its ring listener for `epoch`.
pub fn ring_key(epoch: u64, rank: usize) -> String {
    format!("epoch/{epoch}/ring/{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn unknown_fields_are_refused() {
        let bad = br#"{"set":{"key":"a","value":"b","extra":1}}"#;
        assert!(PROTOCOL.parse_json::<Request>(bad).is_err());
    }

    proptest! {
        #[test]
        fn request_round_trip(key in ".{0,40}", value in ".{0,40}", wait_ms in any::<u64>(), delta in any::<i64>()) {
            for req in [
                Request::Set { key: key.clone(), value: value.clone() },
                Request::Get { key: key.clone(), wait_ms },
                Request::Add { key: key.clone(), delta },
                Request::Ping,
            ] {
                let mut buf = Vec::new();
                PROTOCOL.send_json(&mut buf, &req).unwrap();
                let back: Request = PROTOCOL.recv_json(&mut &buf[..]).unwrap();
                prop_assert_eq!(back, req);
            }
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = PROTOCOL.recv_json::<_, Request>(&mut &bytes[..]);
            let _ = PROTOCOL.parse_json::<Response>(&bytes);
        }
    }
}
