//! High-availability modes: the four MindSpeed-LLM switches and the
//! `HIGH_AVAILABILITY` environment variable.
//!
//! | flag                          | env value          | feature            |
//! |-------------------------------|--------------------|--------------------|
//! | `--enable-high-availability`  | any value below    | master switch, `dump` |
//! | `--enable-hbmfault-repair`    | `retry`            | UCE step repair    |
//! | `--enable-worker-reboot`      | `recover`          | in-place restart   |
//! | `--enable-elastic-training`   | `elastic-training` | scale down / up    |
//!
//! `HIGH_AVAILABILITY` is a comma-separated set; each value turns on the
//! master switch and its own feature. The variable takes precedence over the
//! flags in the only way it can: it turns features on, never off. A
//! sub-feature without the master switch is an error, and so is high
//! availability with a data-parallel size of 1 (no replica can exist).

use serde::{Deserialize, Serialize};

/// Name of the environment variable.
pub const ENV: &str = "HIGH_AVAILABILITY";

/// The switches as given on the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HaFlags {
    pub enable_high_availability: bool,
    pub enable_hbmfault_repair: bool,
    pub enable_worker_reboot: bool,
    pub enable_elastic_training: bool,
}

/// The resolved modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaModes {
    /// Master switch; last-words dump.
    pub dump: bool,
    /// UCE step-level repair.
    pub retry: bool,
    /// In-place worker reboot.
    pub recover: bool,
    /// Elastic scale-down / scale-up.
    pub elastic: bool,
}

impl HaModes {
    pub fn any(&self) -> bool {
        self.dump || self.retry || self.recover || self.elastic
    }

    /// The modes as `HIGH_AVAILABILITY` values.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.dump {
            v.push("dump");
        }
        if self.retry {
            v.push("retry");
        }
        if self.recover {
            v.push("recover");
        }
        if self.elastic {
            v.push("elastic-training");
        }
        v
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HaError {
    #[error("{flag} needs --enable-high-availability (or {ENV} set)")]
    NoMasterSwitch { flag: &'static str },
    #[error(
        "{ENV}={value:?}: unknown value {item:?}; expected a comma-separated set of dump, retry, recover, elastic-training"
    )]
    UnknownValue { value: String, item: String },
    #[error(
        "high availability needs a data-parallel size above 1 (a replica must exist), but the job has {dp}"
    )]
    NoReplica { dp: usize },
}

/// Resolves the modes from the flags, the environment variable's value (if
/// set) and the data-parallel size.
pub fn resolve(flags: HaFlags, env: Option<&str>, dp_size: usize) -> Result<HaModes, HaError> {
    for (on, flag) in [
        (flags.enable_hbmfault_repair, "--enable-hbmfault-repair"),
        (flags.enable_worker_reboot, "--enable-worker-reboot"),
        (flags.enable_elastic_training, "--enable-elastic-training"),
    ] {
        let env_master = env.is_some_and(|v| !v.trim().is_empty());
        if on && !flags.enable_high_availability && !env_master {
            return Err(HaError::NoMasterSwitch { flag });
        }
    }
    let mut m = HaModes {
        dump: flags.enable_high_availability,
        retry: flags.enable_hbmfault_repair,
        recover: flags.enable_worker_reboot,
        elastic: flags.enable_elastic_training,
    };
    if let Some(value) = env.filter(|v| !v.trim().is_empty()) {
        for item in value.split(',').map(str::trim) {
            match item {
                "dump" => {}
                "retry" => m.retry = true,
                "recover" => m.recover = true,
                "elastic-training" => m.elastic = true,
                other => {
                    return Err(HaError::UnknownValue {
                        value: value.to_string(),
                        item: other.to_string(),
                    });
                }
            }
            m.dump = true;
        }
    }
    if m.any() && dp_size < 2 {
        return Err(HaError::NoReplica { dp: dp_size });
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(bits: u8) -> HaFlags {
        HaFlags {
            enable_high_availability: bits & 1 != 0,
            enable_hbmfault_repair: bits & 2 != 0,
            enable_worker_reboot: bits & 4 != 0,
            enable_elastic_training: bits & 8 != 0,
        }
    }

    /// The specification, written out independently of `resolve`.
    fn expected(bits: u8, env: Option<&str>, dp: usize) -> Result<HaModes, &'static str> {
        let items: Vec<&str> = env
            .filter(|v| !v.trim().is_empty())
            .map(|v| v.split(',').map(str::trim).collect())
            .unwrap_or_default();
        let master = bits & 1 != 0 || !items.is_empty();
        if bits & 0b1110 != 0 && !master {
            return Err("master");
        }
        if items
            .iter()
            .any(|i| !["dump", "retry", "recover", "elastic-training"].contains(i))
        {
            return Err("unknown");
        }
        let m = HaModes {
            dump: master,
            retry: bits & 2 != 0 || items.contains(&"retry"),
            recover: bits & 4 != 0 || items.contains(&"recover"),
            elastic: bits & 8 != 0 || items.contains(&"elastic-training"),
        };
        if m.any() && dp < 2 {
            return Err("replica");
        }
        Ok(m)
    }

    #[test]
    fn every_combination() {
        let envs = [
            None,
            Some(""),
            Some("dump"),
            Some("retry"),
            Some("recover"),
            Some("elastic-training"),
            Some("retry,recover"),
            Some(" recover , dump "),
            Some("dump,retry,recover,elastic-training"),
            Some("recover,bogus"),
            Some("RETRY"),
        ];
        let mut checked = 0;
        for bits in 0..16u8 {
            for env in envs {
                for dp in [1, 2, 8] {
                    let got = resolve(flags(bits), env, dp);
                    match (expected(bits, env, dp), &got) {
                        (Ok(want), Ok(m)) => assert_eq!(*m, want, "{bits:04b} {env:?} {dp}"),
                        (Err("master"), Err(HaError::NoMasterSwitch { .. }))
                        | (Err("unknown"), Err(HaError::UnknownValue { .. }))
                        | (Err("replica"), Err(HaError::NoReplica { .. })) => {}
                        (want, got) => {
                            panic!("{bits:04b} {env:?} dp {dp}: want {want:?}, got {got:?}")
                        }
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 16 * envs.len() * 3);
    }

    #[test]
    fn messages_name_what_is_wrong() {
        let e = resolve(flags(4), None, 4).unwrap_err().to_string();
        assert!(
            e.contains("--enable-worker-reboot needs --enable-high-availability"),
            "{e}"
        );
        let e = resolve(flags(0), Some("retry,oops"), 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown value \"oops\""), "{e}");
        let e = resolve(flags(1), None, 1).unwrap_err().to_string();
        assert!(e.contains("a replica must exist"), "{e}");
        // The env turns the master switch on for a flag's sub-feature.
        let m = resolve(flags(4), Some("dump"), 2).unwrap();
        assert!(m.dump && m.recover && !m.retry);
        assert_eq!(resolve(flags(0), None, 1).unwrap(), HaModes::default());
    }
}
