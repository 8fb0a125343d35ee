//! Uncorrectable memory errors (UCE): the SIGBUS handler and the injector.
//!
//! The kernel reports a UCE in a process's memory as SIGBUS with `si_code`
//! `BUS_MCEERR_AR` (action required: the access hit it) or `BUS_MCEERR_AO`
//! (action optional), and `si_addr` in the poisoned page (sigaction(2)).
//!
//! The handler does only async-signal-safe work (atomic loads and stores,
//! mmap(2), sigaction(2), raise(3)):
//! - a UCE inside a registered state buffer: a fresh anonymous page is
//!   mapped over the poisoned one (`MAP_FIXED`), so the faulting access can
//!   proceed, and the UCE is recorded as pending; the runtime notices it at
//!   the next check, reports it to the agent and the step is recomputed from
//!   the last consistent snapshot;
//! - a UCE anywhere else (including a page the buffer shares with other
//!   memory), any other SIGBUS, or a remap that fails: the fault
//!   is recorded in the control page and the signal's default action
//!   (death) follows, so the agent handles it as a crash (worker reboot, or
//!   the last-words dump).
//!
//! Buffers are registered by the index of their part in the rank's state
//! map, so a reported UCE names the part the agent knows by that index.

use hatrain_shared::shm::FaultFlags;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// Most state buffers the handler watches (indexed by state-map part).
pub const MAX_RANGES: usize = 16;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicUsize = AtomicUsize::new(0);
static STARTS: [AtomicUsize; MAX_RANGES] = [ZERO; MAX_RANGES];
static LENS: [AtomicUsize; MAX_RANGES] = [ZERO; MAX_RANGES];
/// 0: nothing pending; else 1 + the index of the buffer hit.
static PENDING: AtomicUsize = AtomicUsize::new(0);
static PENDING_OFFSET: AtomicUsize = AtomicUsize::new(0);
/// Repaired UCEs so far: a snapshot copy that saw it change is not sealed.
static COUNT: AtomicU64 = AtomicU64::new(0);
/// The page size, read when the handler is installed (sysconf(3) is not
/// async-signal-safe).
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);
/// The control page's fault-flags word, if attached to an agent.
static FAULT_WORD: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());

/// A UCE the handler repaired and the runtime must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uce {
    /// The state-map part of the buffer hit.
    pub part: usize,
    pub offset: usize,
}

/// How the last injection was delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectPath {
    /// `madvise(MADV_HWPOISON)` poisoned the page; touching it raised the
    /// real machine-check SIGBUS.
    Hwpoison,
    /// The kernel refused `MADV_HWPOISON` (no CONFIG_MEMORY_FAILURE, or no
    /// CAP_SYS_ADMIN); the SIGBUS with `BUS_MCEERR_AR` and the address was
    /// sent to this thread with `rt_tgsigqueueinfo(2)`, which runs the same
    /// handler real hardware would.
    Sigqueue,
}

fn page_size() -> usize {
    match PAGE_SIZE.load(Ordering::Relaxed) {
        0 => nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .and_then(|p| usize::try_from(p).ok())
            .unwrap_or(4096),
        p => p,
    }
}

/// Installs the SIGBUS handler (idempotent). `fault_word` is the control
/// page's fault-flags word, which must stay mapped for the life of the
/// process.
pub fn install(fault_word: Option<&'static AtomicU64>) -> std::io::Result<()> {
    PAGE_SIZE.store(page_size(), Ordering::Relaxed);
    if let Some(w) = fault_word {
        FAULT_WORD.store(std::ptr::from_ref(w).cast_mut(), Ordering::Release);
    }
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::SigAction(handler),
        SaFlags::SA_SIGINFO | SaFlags::SA_ONSTACK,
        SigSet::empty(),
    );
    // SAFETY: the handler only does async-signal-safe work (module doc).
    unsafe { sigaction(Signal::SIGBUS, &action) }.map_err(std::io::Error::from)?;
    Ok(())
}

/// Watches `len` bytes at `start` as the buffer of state part `part`.
pub fn register(part: usize, start: *const u8, len: usize) {
    assert!(part < MAX_RANGES, "at most {MAX_RANGES} state parts");
    LENS[part].store(0, Ordering::SeqCst);
    STARTS[part].store(start as usize, Ordering::SeqCst);
    LENS[part].store(len, Ordering::SeqCst);
}

/// How many UCEs the handler has repaired in this process.
pub fn count() -> u64 {
    COUNT.load(Ordering::Acquire)
}

/// Whether a repaired UCE waits to be taken.
pub fn pending() -> bool {
    PENDING.load(Ordering::Acquire) != 0
}

/// Takes the pending repaired UCE, if any.
pub fn take_pending() -> Option<Uce> {
    let b = PENDING.swap(0, Ordering::AcqRel);
    (b != 0).then(|| Uce {
        part: b - 1,
        offset: PENDING_OFFSET.load(Ordering::Acquire),
    })
}

fn record(flag: FaultFlags) {
    let w = FAULT_WORD.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from the `&'static AtomicU64` given
    // to `install`.
    if let Some(w) = unsafe { w.as_ref() } {
        w.fetch_or(flag.bits(), Ordering::AcqRel);
    }
}

/// Maps a fresh zero page over the page at `page`; false if the kernel
/// refused.
fn remap(page: usize, size: usize) -> bool {
    // SAFETY: replaces exactly one page of a registered state buffer of
    // this process (checked by the caller) with a fresh private anonymous
    // page; mmap(2) is async-signal-safe. The page's contents are lost
    // either way and are restored from the snapshot.
    let got = unsafe {
        libc::mmap(
            page as *mut libc::c_void,
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    got as usize == page
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO handler;
    // si_addr is the faulting address for SIGBUS.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let mce = code == libc::BUS_MCEERR_AR || code == libc::BUS_MCEERR_AO;
    let mut flag = if mce {
        FaultFlags::UCE_FATAL
    } else {
        FaultFlags::SIGBUS
    };
    if mce {
        let size = PAGE_SIZE.load(Ordering::Relaxed).max(1);
        for i in 0..MAX_RANGES {
            let (start, len) = (
                STARTS[i].load(Ordering::Acquire),
                LENS[i].load(Ordering::Acquire),
            );
            if len > 0 && addr >= start && addr < start + len {
                let page = addr - addr % size;
                // INVARIANT: only a page wholly inside the buffer is
                // replaced; a page shared with other memory loses that
                // memory too, which nothing could restore.
                if page < start || page + size > start + len || !remap(page, size) {
                    break;
                }
                PENDING_OFFSET.store(addr - start, Ordering::Release);
                PENDING.store(i + 1, Ordering::Release);
                COUNT.fetch_add(1, Ordering::AcqRel);
                // Reported to the agent by the runtime when it takes the
                // pending UCE, once.
                return;
            }
        }
        flag = FaultFlags::UCE_FATAL;
    }
    record(flag);
    // Not ours to repair: die of SIGBUS. SIGBUS is blocked while the handler
    // runs, so the raised one is delivered, with the default action, on
    // return (a hardware fault would also simply recur).
    // SAFETY: sigaction(2) and raise(3) are async-signal-safe; SIG_DFL is a
    // valid disposition.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        libc::raise(libc::SIGBUS);
    }
}

/// Injects a UCE at byte `offset` (clamped to the buffer) of the buffer
/// registered for state part `part`, the way the hardware would report it,
/// and says which path ran. A part with no registered buffer is an error.
pub fn inject_in(part: usize, offset: usize) -> std::io::Result<InjectPath> {
    let (start, len) = match (STARTS.get(part), LENS.get(part)) {
        (Some(s), Some(l)) => (s.load(Ordering::Acquire), l.load(Ordering::Acquire)),
        _ => (0, 0),
    };
    if len == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no buffer is registered for state part {part}"),
        ));
    }
    let addr = (start + offset.min(len - 1)) as *const u8;
    // SAFETY: `addr` lies in a registered state buffer, which the training
    // loop never reallocates (the runtime's contract); its page is replaced
    // by the handler and restored from the snapshot.
    unsafe { inject(addr) }
}

/// Injects a UCE outside every registered buffer (in scratch memory of its
/// own): the process cannot trust its memory and dies of it.
pub fn inject_outside() -> std::io::Result<InjectPath> {
    let scratch = vec![0u8; 2 * page_size()];
    // SAFETY: a heap scratch buffer that lives until after the injection;
    // losing its page loses nothing.
    let r = unsafe { inject(scratch[page_size()..].as_ptr()) };
    std::hint::black_box(&scratch);
    r
}

/// Injects a UCE at `addr` in this process, the way the hardware would
/// report it, and says which path ran.
///
/// # Safety
/// `addr` must point to readable memory of this process that may lose its
/// page's contents (a registered state buffer, or scratch memory).
unsafe fn inject(addr: *const u8) -> std::io::Result<InjectPath> {
    let size = page_size();
    let page = (addr as usize) - (addr as usize) % size;
    // SAFETY: madvise on a page of our own memory; with MADV_HWPOISON the
    // kernel poisons it (only with CONFIG_MEMORY_FAILURE and
    // CAP_SYS_ADMIN), else it fails with EINVAL/EPERM and nothing changes.
    let rc = unsafe { libc::madvise(page as *mut libc::c_void, size, libc::MADV_HWPOISON) };
    if rc == 0 {
        // SAFETY: reading the poisoned byte raises the real SIGBUS, whose
        // handler maps a fresh page so that the read then completes.
        unsafe { std::ptr::read_volatile(addr) };
        return Ok(InjectPath::Hwpoison);
    }
    // SAFETY: a zeroed siginfo_t with signo, code and addr filled in at the
    // Linux 64-bit offsets (si_code at 8, si_addr at 16, identical on every
    // 64-bit architecture), queued to this very thread.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let p = (&raw mut info).cast::<u8>();
        p.cast::<i32>().write(libc::SIGBUS);
        p.add(8).cast::<i32>().write(libc::BUS_MCEERR_AR);
        p.add(16).cast::<usize>().write(addr as usize);
        let rc = libc::syscall(
            libc::SYS_rt_tgsigqueueinfo,
            libc::getpid(),
            libc::gettid(),
            libc::SIGBUS,
            &raw const info,
        );
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(InjectPath::Sigqueue)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injected_uce_in_a_buffer_is_repaired_and_reported() {
        install(None).unwrap();
        let size = page_size();
        let mut buf = vec![7u8; 3 * size];
        let base = buf.as_ptr() as usize;
        register(MAX_RANGES - 1, buf.as_ptr(), buf.len());
        let before = count();
        let at = size + size / 4;
        let path = inject_in(MAX_RANGES - 1, at).unwrap();
        eprintln!("injection path: {path:?}");
        assert_eq!(
            take_pending(),
            Some(Uce {
                part: MAX_RANGES - 1,
                offset: at
            })
        );
        assert_eq!(count(), before + 1);
        // The page holding the byte was replaced by a fresh zero page; the
        // others are intact.
        let page = (base + at) - (base + at) % size;
        let p = page - base;
        assert!(buf[p..p + size].iter().all(|b| *b == 0));
        assert!(buf[..p].iter().chain(&buf[p + size..]).all(|b| *b == 7));
        buf[at] = 1; // writable again
        register(MAX_RANGES - 1, std::ptr::null(), 0);
        assert!(inject_in(MAX_RANGES - 1, 0).is_err(), "unregistered");
    }
}
