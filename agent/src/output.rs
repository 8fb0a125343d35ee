//! Worker output, as torchrun handles it.
//!
//! Each worker's stdout and stderr are pipes the agent reads. What it reads
//! goes on at once, in segments that end at a newline, a carriage return
//! (so a progress bar that redraws itself with `\r` passes through as it is
//! drawn) or [`CHUNK`] bytes (so a line of any length takes bounded
//! memory). On the console every line or redraw starts with the rank,
//! `[rank N] `; the piece of a long line that follows a size cut does not.
//!
//! torchrun's switches choose where each stream goes, per local rank:
//!
//! - `--redirects S` or `--redirects LR:S,LR:S`: into a log file only;
//! - `--tee S` (same forms): into a log file and to the console;
//! - `--local-ranks-filter 0,2`: only these local ranks on the console
//!   (files are not filtered);
//!
//! where `S` is 0 (none), 1 (stdout), 2 (stderr) or 3 (both). The files are
//! `<run dir>/attempt_<restart>/<local rank>/{stdout,stderr}.log`, with the
//! run dir under `--log-dir` (see `crate::launch`).

use std::io::{self, Write};
use std::path::PathBuf;
use tokio::io::AsyncReadExt;

/// Most bytes read or written in one piece.
pub const CHUNK: usize = 64 * 1024;

/// Which standard streams a switch names: torchrun's `Std` (0, 1, 2, 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    fn from_digit(d: &str) -> Option<Self> {
        Some(match d.trim() {
            "0" => Self::default(),
            "1" => Self {
                stdout: true,
                stderr: false,
            },
            "2" => Self {
                stdout: false,
                stderr: true,
            },
            "3" => Self {
                stdout: true,
                stderr: true,
            },
            _ => return None,
        })
    }

    /// Whether the stream (`stderr` or not) is named.
    pub fn has(self, stderr: bool) -> bool {
        if stderr { self.stderr } else { self.stdout }
    }
}

/// A `--redirects`/`--tee` value: one [`Streams`] for every local rank, or
/// one per local rank named (the others: none).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PerRank {
    #[default]
    None,
    All(Streams),
    Each(Vec<(usize, Streams)>),
}

impl PerRank {
    pub fn of(&self, local_rank: usize) -> Streams {
        match self {
            Self::None => Streams::default(),
            Self::All(s) => *s,
            Self::Each(v) => v
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams::default(), |(_, s)| *s),
        }
    }

    pub fn any(&self) -> bool {
        match self {
            Self::None => false,
            Self::All(s) => s.stdout || s.stderr,
            Self::Each(v) => v.iter().any(|(_, s)| s.stdout || s.stderr),
        }
    }
}

impl std::str::FromStr for PerRank {
    type Err = String;

    fn from_str(v: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{v:?} is not a stream choice: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:N pairs separated by commas (0:1,1:2)"
            )
        };
        if !v.contains(':') {
            return Streams::from_digit(v).map(Self::All).ok_or_else(bad);
        }
        let mut each = Vec::new();
        for pair in v.split(',') {
            let (r, s) = pair.split_once(':').ok_or_else(bad)?;
            let r: usize = r.trim().parse().map_err(|_| bad())?;
            let s = Streams::from_digit(s).ok_or_else(bad)?;
            if each.iter().any(|(q, _)| *q == r) {
                return Err(format!("local rank {r} is named twice in {v:?}"));
            }
            each.push((r, s));
        }
        Ok(Self::Each(each))
    }
}

/// A `--local-ranks-filter` value: local ranks separated by commas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFilter(pub Vec<usize>);

impl std::str::FromStr for RankFilter {
    type Err = String;

    fn from_str(v: &str) -> Result<Self, String> {
        v.split(',')
            .map(|r| {
                r.trim().parse().map_err(|_| {
                    format!(
                        "{v:?} is not a list of local ranks (give them separated by commas: 0,2)"
                    )
                })
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

/// Where one stream of one worker goes.
#[derive(Debug)]
pub struct Sink {
    pub rank: usize,
    pub stderr: bool,
    /// To the agent's own stdout or stderr, with the rank prefix.
    pub console: bool,
    /// Into this file, as written.
    pub file: Option<std::fs::File>,
    pub path: Option<PathBuf>,
}

/// Splits `data` into console segments and writes them, each started by
/// `prefix` when it begins a line; returns whether the next byte begins a
/// line. The output is built in `out` and flushed at [`CHUNK`] bytes.
pub fn render(
    data: &[u8],
    prefix: &[u8],
    mut at_start: bool,
    out: &mut Vec<u8>,
    flush: &mut dyn FnMut(&[u8]),
) -> bool {
    let mut rest = data;
    while !rest.is_empty() {
        let end = rest
            .iter()
            .position(|b| *b == b'\n' || *b == b'\r')
            .map_or(rest.len(), |i| i + 1);
        let (piece, tail) = rest.split_at(end);
        // A bare `\r` at the start of a line (a redraw about to come) needs
        // no prefix of its own: the redrawn text gets one.
        if at_start && piece != b"\r" {
            out.extend_from_slice(prefix);
        }
        out.extend_from_slice(piece);
        at_start = matches!(piece.last(), Some(b'\n' | b'\r'));
        if out.len() >= CHUNK {
            flush(out);
            out.clear();
        }
        rest = tail;
    }
    if !out.is_empty() {
        flush(out);
        out.clear();
    }
    at_start
}

/// Forwards one worker stream until it closes.
pub async fn forward(mut rx: tokio::net::unix::pipe::Receiver, mut sink: Sink) {
    let prefix = format!("[rank {}] ", sink.rank).into_bytes();
    let mut buf = vec![0u8; CHUNK];
    let mut out = Vec::with_capacity(CHUNK + 64);
    let mut at_start = true;
    loop {
        let n = match rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let data = &buf[..n];
        if let Some(f) = sink.file.as_mut()
            && let Err(e) = f.write_all(data)
        {
            tracing::warn!(rank = sink.rank, file = ?sink.path, error = %e, "cannot write the worker's log file; it goes on to the console only");
            sink.file = None;
            sink.console = true;
        }
        if sink.console {
            let stderr = sink.stderr;
            at_start = render(data, &prefix, at_start, &mut out, &mut |bytes| {
                let _ = if stderr {
                    io::stderr().lock().write_all(bytes)
                } else {
                    io::stdout().lock().write_all(bytes)
                };
            });
        }
    }
    // A last line without its newline still ends the line on the console.
    if sink.console && !at_start {
        let _ = if sink.stderr {
            io::stderr().lock().write_all(b"\n")
        } else {
            io::stdout().lock().write_all(b"\n")
        };
    }
}

/// The run's folder: the workers' error files (`TORCHELASTIC_ERROR_FILE`)
/// and the log files of `--redirects`/`--tee`, in torchrun's layout
/// `<run dir>/attempt_<restart>/<local rank>/`. Under `--log-dir` it is
/// `<log dir>/<job>_<random>` and stays; without, a temporary folder that
/// is removed at exit unless it holds log files.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    temporary: bool,
    keep: bool,
}

impl RunDir {
    /// Makes the folder (mode 0700), under `log_dir` if given; `logs` when
    /// log files will be written into it.
    pub fn create(log_dir: Option<&std::path::Path>, job: &str, logs: bool) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let base = match log_dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                d.to_path_buf()
            }
            None => std::env::temp_dir(),
        };
        for _ in 0..16 {
            let tag = crate::random_tag()?;
            let name = match log_dir {
                Some(_) => format!("{job}_{tag}"),
                None => format!("hatrain-{job}-{tag}"),
            };
            let path = base.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    return Ok(Self {
                        path,
                        temporary: log_dir.is_none(),
                        keep: logs,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::other(format!(
            "cannot make a run folder under {}",
            base.display()
        )))
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Removes a temporary folder that holds no logs; says where kept
    /// logs are.
    pub fn finish(self) {
        if self.temporary && !self.keep {
            if let Err(e) = std::fs::remove_dir_all(&self.path) {
                tracing::warn!(dir = %self.path.display(), error = %e, "cannot remove the run's temporary folder");
            }
        } else if self.keep {
            tracing::info!(dir = %self.path.display(), "the workers' log files are kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rendered(chunks: &[&[u8]]) -> Vec<u8> {
        let mut all = Vec::new();
        let mut at = true;
        let mut out = Vec::new();
        for c in chunks {
            at = render(c, b"[r] ", at, &mut out, &mut |b| all.extend_from_slice(b));
        }
        all
    }

    #[test]
    fn lines_and_redraws_get_the_prefix_and_cut_lines_do_not() {
        assert_eq!(rendered(&[b"a\nb\n"]), b"[r] a\n[r] b\n");
        assert_eq!(
            rendered(&[b"\r 10%", b"\r 20%", b"\r100%\n"]),
            b"\r[r]  10%\r[r]  20%\r[r] 100%\n"
        );
        assert_eq!(rendered(&[b"abc", b"def\n", b"g"]), b"[r] abcdef\n[r] g");
    }

    #[test]
    fn stream_choices_parse_as_torchrun_takes_them() {
        let all: PerRank = "3".parse().unwrap();
        assert_eq!(
            all.of(7),
            Streams {
                stdout: true,
                stderr: true
            }
        );
        let each: PerRank = "0:1,1:2".parse().unwrap();
        assert_eq!(
            each.of(0),
            Streams {
                stdout: true,
                stderr: false
            }
        );
        assert_eq!(
            each.of(1),
            Streams {
                stdout: false,
                stderr: true
            }
        );
        assert_eq!(each.of(2), Streams::default());
        assert!(!"0".parse::<PerRank>().unwrap().any());
        for bad in ["4", "x", "0:1,0:2", "0:9", "a:1", ""] {
            assert!(bad.parse::<PerRank>().is_err(), "{bad}");
        }
        assert_eq!("0, 2".parse::<RankFilter>().unwrap().0, vec![0, 2]);
        assert!("0,x".parse::<RankFilter>().is_err());
    }

    proptest! {
        #[test]
        fn rendering_keeps_every_byte_and_bounds_its_pieces(
            data in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a'), Just(b'b')], 0..3000),
            cut in 1usize..500,
        ) {
            let mut all = Vec::new();
            let mut pieces = Vec::new();
            let mut at = true;
            let mut out = Vec::new();
            for c in data.chunks(cut) {
                at = render(c, b"P", at, &mut out, &mut |b| { pieces.push(b.len()); all.extend_from_slice(b) });
            }
            // The prefix comes only where a line (or a redraw) begins, and
            // without it the bytes are the worker's.
            for (i, b) in all.iter().enumerate() {
                if *b == b'P' {
                    prop_assert!(i == 0 || matches!(all[i - 1], b'\n' | b'\r'));
                }
            }
            let stripped: Vec<u8> = all.iter().copied().filter(|b| *b != b'P').collect();
            prop_assert_eq!(stripped, data);
            prop_assert!(pieces.iter().all(|n| *n <= CHUNK + 64));
        }
    }
}
