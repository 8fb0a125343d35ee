//! Worker output, as torchrun handles it.
//!
//! Each worker's stdout and stderr are pipes the agent reads. What it reads
//! goes on in segments that end at a newline, a carriage return (so a
//! progress bar that redraws itself with `\r` passes through as it is
//! drawn) or [`CHUNK`] bytes (so a line of any length takes bounded
//! memory). The unfinished end of a line waits for the rest of it, up to
//! [`PARTIAL_WAIT`], so that ranks writing at once do not break each
//! other's lines. On the console every line or redraw starts with the
//! rank, `[rank N] `; the piece of a long line that follows a size cut does
//! not.
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
//!
//! A rank's stderr is also read for torch_npu's error texts ([`TextScan`]):
//! each is classified by the fault table and reported to the job.

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

/// A `--redirects`, `--tee` or `--local-ranks-filter` value that does not
/// parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputFlagError {
    #[error(
        "{0:?} is not a stream choice: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:N pairs separated by commas (0:1,1:2)"
    )]
    Streams(String),
    #[error("local rank {rank} is named twice in {value:?}")]
    Twice { rank: usize, value: String },
    #[error("{0:?} is not a list of local ranks (give them separated by commas: 0,2)")]
    Ranks(String),
}

impl std::str::FromStr for PerRank {
    type Err = OutputFlagError;

    fn from_str(v: &str) -> Result<Self, OutputFlagError> {
        let bad = || OutputFlagError::Streams(v.to_string());
        if !v.contains(':') {
            return Streams::from_digit(v).map(Self::All).ok_or_else(bad);
        }
        let mut each = Vec::new();
        for pair in v.split(',') {
            let (r, s) = pair.split_once(':').ok_or_else(bad)?;
            let r: usize = r.trim().parse().map_err(|_| bad())?;
            let s = Streams::from_digit(s).ok_or_else(bad)?;
            if each.iter().any(|(q, _)| *q == r) {
                return Err(OutputFlagError::Twice {
                    rank: r,
                    value: v.to_string(),
                });
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
    type Err = OutputFlagError;

    fn from_str(v: &str) -> Result<Self, OutputFlagError> {
        v.split(',')
            .map(|r| {
                r.trim()
                    .parse()
                    .map_err(|_| OutputFlagError::Ranks(v.to_string()))
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

/// Where one stream of one worker goes.
#[derive(Debug)]
pub struct Sink {
    /// Who writes: `rank N` or `standby N`.
    pub label: String,
    pub stderr: bool,
    /// To the agent's own stdout or stderr, with the rank prefix.
    pub console: bool,
    /// Into this file, as written.
    pub file: Option<std::fs::File>,
    pub path: Option<PathBuf>,
    /// Reads the stream's lines for device error texts (a rank's stderr).
    pub scan: Option<TextScan>,
}

/// Longest line the text scan reads (the rest of a longer one is skipped).
const SCANNED_LINE: usize = 4096;

/// Reads a rank's stderr line by line for torch_npu's error texts
/// ([`hatrain_shared::npu::classify_text`]) and reports each fault text to
/// the job, once the job has said where ([`TextScan::to`]).
#[derive(Debug)]
pub struct TextScan {
    pub rank: usize,
    pub local_rank: usize,
    pub to:
        std::sync::Arc<std::sync::OnceLock<tokio::sync::mpsc::Sender<crate::faults::DeviceFault>>>,
    line: Vec<u8>,
}

impl TextScan {
    pub fn new(
        rank: usize,
        local_rank: usize,
        to: std::sync::Arc<
            std::sync::OnceLock<tokio::sync::mpsc::Sender<crate::faults::DeviceFault>>,
        >,
    ) -> Self {
        Self {
            rank,
            local_rank,
            to,
            line: Vec::new(),
        }
    }

    fn feed(&mut self, data: &[u8]) {
        for piece in data.split_inclusive(|&b| b == b'\n') {
            let room = SCANNED_LINE.saturating_sub(self.line.len());
            self.line.extend_from_slice(&piece[..piece.len().min(room)]);
            if piece.ends_with(b"\n") {
                self.check();
                self.line.clear();
            }
        }
    }

    fn check(&self) {
        use hatrain_shared::npu::{Action, classify_text};
        let text = String::from_utf8_lossy(&self.line);
        let Some((action, words)) = classify_text(&text) else {
            return;
        };
        if action == Action::Ignore {
            return;
        }
        if let Some(tx) = self.to.get() {
            let f = crate::faults::DeviceFault::worker_text(
                self.rank,
                self.local_rank,
                action,
                words,
                text.trim(),
            );
            // Never holds up the worker's output: a full queue drops it.
            let _ = tx.try_send(f);
        }
    }
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

/// How long the unfinished end of a line is held back from the console for
/// the rest of it: a worker that writes a line in several pieces (Rust's
/// unbuffered stderr writes each formatted piece on its own) still gets it
/// shown whole, not broken by another rank's line. A prompt with no newline
/// shows after this wait.
pub const PARTIAL_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The unfinished end of a worker's console output, held back for
/// [`PARTIAL_WAIT`] at most.
#[derive(Debug, Default)]
struct Held {
    bytes: Vec<u8>,
    since: Option<tokio::time::Instant>,
}

impl Held {
    /// Takes a read; returns how many of the held bytes may go to the
    /// console now: up to the last line end or redraw, or all of them once
    /// an unfinished line reaches [`CHUNK`].
    fn push(&mut self, data: &[u8]) -> usize {
        self.bytes.extend_from_slice(data);
        let ready = if self.bytes.len() >= CHUNK {
            self.bytes.len()
        } else {
            self.bytes
                .iter()
                .rposition(|b| *b == b'\n' || *b == b'\r')
                .map_or(0, |i| i + 1)
        };
        if ready == self.bytes.len() {
            self.since = None;
        } else if ready > 0 || self.since.is_none() {
            self.since = Some(tokio::time::Instant::now());
        }
        ready
    }

    /// The held bytes; [`Held::consume`] drops those written.
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn consume(&mut self, n: usize) {
        self.bytes.drain(..n);
        if self.bytes.is_empty() {
            self.since = None;
        }
    }

    fn pending(&self) -> bool {
        !self.bytes.is_empty()
    }

    /// When the held piece has waited long enough.
    fn due(&self) -> tokio::time::Sleep {
        let at = self
            .since
            .map_or_else(tokio::time::Instant::now, |s| s + PARTIAL_WAIT);
        tokio::time::sleep_until(at)
    }
}

/// Forwards one worker stream until it closes.
///
/// A warm standby's stream is forwarded under its own label until the
/// standby takes a rank's place: then `retarget` brings the rank's sink,
/// and what follows goes where the rank's output goes.
pub async fn forward(
    mut rx: tokio::net::unix::pipe::Receiver,
    mut sink: Sink,
    mut retarget: Option<tokio::sync::oneshot::Receiver<Sink>>,
) {
    let mut prefix = format!("[{}] ", sink.label).into_bytes();
    let mut buf = vec![0u8; CHUNK];
    let mut out = Vec::with_capacity(CHUNK + 64);
    let mut at_start = true;
    let mut held = Held::default();
    loop {
        let read = tokio::select! {
            r = rx.read(&mut buf) => r,
            new = async { retarget.as_mut().expect("guarded").await }, if retarget.is_some() => {
                retarget = None;
                if let Ok(new) = new {
                    at_start = show(&sink, &prefix, &mut held, None, at_start, &mut out);
                    end_line(&sink, at_start);
                    at_start = true;
                    sink = new;
                    prefix = format!("[{}] ", sink.label).into_bytes();
                }
                continue;
            }
            () = held.due(), if held.pending() => {
                at_start = show(&sink, &prefix, &mut held, None, at_start, &mut out);
                continue;
            }
        };
        let n = match read {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let data = &buf[..n];
        if let Some(scan) = sink.scan.as_mut() {
            scan.feed(data);
        }
        if let Some(f) = sink.file.as_mut()
            && let Err(e) = f.write_all(data)
        {
            tracing::warn!(worker = %sink.label, file = ?sink.path, error = %e, "cannot write the worker's log file; it goes on to the console only");
            sink.file = None;
            sink.console = true;
        }
        if sink.console {
            at_start = show(&sink, &prefix, &mut held, Some(data), at_start, &mut out);
        }
    }
    // A last line without its newline still ends the line on the console.
    at_start = show(&sink, &prefix, &mut held, None, at_start, &mut out);
    end_line(&sink, at_start);
}

/// Writes to the sink's console what `data` completes (or, with no data,
/// everything held); returns whether the next byte begins a line.
fn show(
    sink: &Sink,
    prefix: &[u8],
    held: &mut Held,
    data: Option<&[u8]>,
    at_start: bool,
    out: &mut Vec<u8>,
) -> bool {
    let ready = match data {
        Some(d) => held.push(d),
        None => held.bytes().len(),
    };
    if ready == 0 || !sink.console {
        held.consume(ready);
        return at_start;
    }
    let stderr = sink.stderr;
    let at_start = render(
        &held.bytes()[..ready],
        prefix,
        at_start,
        out,
        &mut |bytes| {
            let _ = if stderr {
                io::stderr().lock().write_all(bytes)
            } else {
                // The agent's stdout is line-buffered: an unfinished line
                // (a prompt) must not wait there for a newline.
                let mut o = io::stdout().lock();
                o.write_all(bytes).and_then(|()| o.flush())
            };
        },
    );
    held.consume(ready);
    at_start
}

/// Ends a console line left open by a sink's last write.
fn end_line(sink: &Sink, at_start: bool) {
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

    #[test]
    fn torch_npu_error_texts_in_a_ranks_stderr_are_reported_across_reads() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let to = std::sync::Arc::new(std::sync::OnceLock::new());
        let mut scan = TextScan::new(3, 1, std::sync::Arc::clone(&to));
        // Before the job says where, nothing is reported (nor kept).
        scan.feed(b"NPU function error: HCCS LINK ERROR, error code is 507056\n");
        to.set(tx).unwrap();
        // A text split across reads, an ordinary line, a deliberate stop,
        // a line longer than the scan reads, and a hang.
        scan.feed(b"Traceback: RuntimeError: npu_forward: NPU function err");
        scan.feed(b"or: UCE ERROR, error code is 507053\nloss 1.25\nFORCE STOP\n");
        scan.feed(&[b'x'; 2 * SCANNED_LINE]);
        scan.feed(b"UCE ERROR\nEI0002: The wait execution of the Notify register times out.\n");
        let mut got = Vec::new();
        while let Ok(f) = rx.try_recv() {
            got.push((f.rank, f.device, f.action, f.acts, f.source));
        }
        use hatrain_shared::npu::Action;
        assert_eq!(
            got,
            vec![
                (Some(3), 1, Some(Action::Uce), false, "worker-text"),
                (Some(3), 1, Some(Action::Hang), false, "worker-text"),
            ]
        );
    }

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
    fn a_line_written_in_pieces_is_held_until_it_ends() {
        let mut h = Held::default();
        assert_eq!(h.push(b"rank "), 0);
        assert_eq!(h.push(b"1: resumed"), 0);
        assert!(h.pending());
        let line = b"rank 1: resumed at step 8\n";
        assert_eq!(h.push(b" at step 8\nnext"), line.len());
        assert_eq!(&h.bytes()[..line.len()], line);
        h.consume(line.len());
        assert_eq!(h.bytes(), b"next");
        // A redraw goes out at its `\r`; an unfinished line of CHUNK bytes
        // goes out whole.
        assert_eq!(h.push(b" 10%\r"), 9);
        h.consume(9);
        assert!(!h.pending());
        assert_eq!(h.push(&vec![b'x'; CHUNK]), CHUNK);
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
