//! Job ids: names, never paths.
//!
//! A job id becomes a folder name under the shared-memory root and a key in
//! logs and sockets, and it arrives from flags, launchers' environments,
//! workers' registrations and `agentctl`. So it is checked wherever it
//! enters, against one small rule: 1 to [`MAX_LEN`] characters, each an
//! ASCII letter or digit, `.`, `_` or `-`, and not starting with `.` (which
//! excludes `.`, `..` and hidden names). Nothing else can reach a path.

use std::fmt;
use std::str::FromStr;

/// Longest job id.
pub const MAX_LEN: usize = 64;

/// The rule, for messages.
pub const RULE: &str = "1 to 64 ASCII letters, digits, '.', '_' or '-', not starting with '.'";

/// A checked job id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

/// Why a job id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job id {id:?} is refused: {why}; a job id is {RULE}")]
pub struct JobIdError {
    /// The id as given (shown escaped).
    pub id: String,
    pub why: &'static str,
}

impl JobId {
    /// Checks `id` against the rule.
    pub fn new(id: &str) -> Result<Self, JobIdError> {
        let refuse = |why| {
            Err(JobIdError {
                id: id.chars().take(MAX_LEN + 16).collect(),
                why,
            })
        };
        if id.is_empty() {
            return refuse("it is empty");
        }
        if id.len() > MAX_LEN {
            return refuse("it is too long");
        }
        if id.starts_with('.') {
            return refuse("it starts with '.'");
        }
        if !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return refuse("it has a character outside the set");
        }
        Ok(Self(id.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for JobId {
    type Err = JobIdError;
    fn from_str(s: &str) -> Result<Self, JobIdError> {
        Self::new(s)
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<std::path::Path> for JobId {
    fn as_ref(&self) -> &std::path::Path {
        std::path::Path::new(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_pass_and_paths_do_not() {
        for ok in ["hatrain", "job-7", "a.b_c", "X", &"a".repeat(MAX_LEN)] {
            assert_eq!(JobId::new(ok).unwrap().as_str(), ok);
        }
        for (bad, why) in [
            ("", "empty"),
            (".", "starts with"),
            ("..", "starts with"),
            ("../x", "starts with"),
            ("a/b", "outside the set"),
            ("/abs", "outside the set"),
            ("a\0b", "outside the set"),
            ("a\nb", "outside the set"),
            ("é", "outside the set"),
            (&"a".repeat(MAX_LEN + 1), "too long"),
        ] {
            let e = JobId::new(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(RULE), "{bad:?}: {e}");
        }
        // The refused id is shown escaped: a newline cannot forge a log line.
        let e = JobId::new("a\nb").unwrap_err().to_string();
        assert!(e.contains("\"a\\nb\""), "{e}");
    }

    proptest! {
        #[test]
        fn an_accepted_id_is_one_plain_path_component(id in ".{0,80}") {
            if let Ok(j) = JobId::new(&id) {
                let p = std::path::Path::new(j.as_str());
                let parts: Vec<_> = p.components().collect();
                prop_assert_eq!(parts.len(), 1);
                prop_assert!(matches!(parts[0], std::path::Component::Normal(_)));
            }
        }
    }
}
