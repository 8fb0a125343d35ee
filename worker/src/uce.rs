//! Uncorrectable memory errors (UCE): the SIGBUS handler and the injector.
//!
//! The kernel reports a UCE in a process's memory as SIGBUS with `si_code`
//! `BUS_MCEERR_AR` (action required: the access hit it) or `BUS_MCEERR_AO`
//! (action optional), and `si_addr` in the poisoned page (sigaction(2)).
//!
//! The handler does only async-signal-safe work (atomic stores, mmap(2),
//! sigaction(2), raise(3)):
//! - a UCE inside a registered state buffer: a fresh anonymous page is
//!   mapped over the poisoned one (`MAP_FIXED`), so the faulting access can
//!   proceed, and the UCE is recorded as pending; the runtime notices it at
//!   the next check, reports it to the agent and the step is recomputed from
//!   the last consistent snapshot;
//! - a UCE anywhere else, or any other SIGBUS: the fault is recorded in the
//!   control page and the signal's default action (death) follows, so the
//!   agent handles it as a crash (worker reboot, or the last-words dump).
//!
//! `siginfo_t` is read at the offsets of the Linux 64-bit ABI (`si_code` at
//! 8, `si_addr` at 16), which the kernel defines identically on every
//! 64-bit architecture.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// Most state buffers the handler watches.
pub const MAX_RANGES: usize = 8;

/// Fault flags in the control page.
pub const FAULT_UCE_REPAIRABLE: u64 = 1;
pub const FAULT_UCE_FATAL: u64 = 2;
pub const FAULT_SIGBUS: u64 = 4;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicUsize = AtomicUsize::new(0);
static STARTS: [AtomicUsize; MAX_RANGES] = [ZERO; MAX_RANGES];
static LENS: [AtomicUsize; MAX_RANGES] = [ZERO; MAX_RANGES];
/// 0: nothing pending; else 1 + the index of the buffer hit.
static PENDING: AtomicUsize = AtomicUsize::new(0);
static PENDING_OFFSET: AtomicUsize = AtomicUsize::new(0);
/// Repaired UCEs so far: a snapshot copy that saw it change is not sealed.
static COUNT: AtomicU64 = AtomicU64::new(0);
/// The control page's fault-flags word, if attached to an agent.
static FAULT_WORD: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());

/// A UCE the handler repaired and the runtime must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uce {
    pub buffer: usize,
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

/// Installs the SIGBUS handler (idempotent).
pub fn install(fault_word: Option<&AtomicU64>) -> std::io::Result<()> {
    if let Some(w) = fault_word {
        FAULT_WORD.store((w as *const AtomicU64).cast_mut(), Ordering::Release);
    }
    // SAFETY: a zeroed sigaction is valid; we set a handler with the
    // SA_SIGINFO signature and an empty mask, and check the result.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Watches `len` bytes at `start` as state buffer `index`.
pub fn register(index: usize, start: *const u8, len: usize) {
    assert!(index < MAX_RANGES, "at most {MAX_RANGES} state buffers");
    LENS[index].store(0, Ordering::SeqCst);
    STARTS[index].store(start as usize, Ordering::SeqCst);
    LENS[index].store(len, Ordering::SeqCst);
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
        buffer: b - 1,
        offset: PENDING_OFFSET.load(Ordering::Acquire),
    })
}

fn record(flag: u64) {
    let w = FAULT_WORD.load(Ordering::Acquire);
    if !w.is_null() {
        // SAFETY: the word lives in the control page mapping, which stays
        // mapped for the life of the process once attached.
        unsafe { (*w).fetch_or(flag, Ordering::AcqRel) };
    }
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; offsets per the module
    // doc (Linux, 64-bit).
    let (code, addr) = unsafe {
        let p = info.cast::<u8>();
        (
            p.add(8).cast::<i32>().read(),
            p.add(16).cast::<usize>().read(),
        )
    };
    let mce = code == libc::BUS_MCEERR_AR || code == libc::BUS_MCEERR_AO;
    if mce {
        for i in 0..MAX_RANGES {
            let (start, len) = (
                STARTS[i].load(Ordering::Acquire),
                LENS[i].load(Ordering::Acquire),
            );
            if len > 0 && addr >= start && addr < start + len {
                let page = addr & !(4096 - 1);
                // SAFETY: replaces exactly the poisoned page of our own
                // buffer with a fresh private anonymous page; mmap(2) is
                // async-signal-safe. Its contents are lost either way and
                // are restored from the snapshot.
                unsafe {
                    libc::mmap(
                        page as *mut libc::c_void,
                        4096,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    );
                }
                PENDING_OFFSET.store(addr - start, Ordering::Release);
                PENDING.store(i + 1, Ordering::Release);
                COUNT.fetch_add(1, Ordering::AcqRel);
                // Reported to the agent by the runtime when it takes the
                // pending UCE, once.
                return;
            }
        }
    }
    record(if mce { FAULT_UCE_FATAL } else { FAULT_SIGBUS });
    // Not ours to repair: die of SIGBUS. SIGBUS is blocked while the handler
    // runs, so the raised one is delivered, with the default action, on
    // return (a hardware fault would also simply recur).
    // SAFETY: sigaction(2) and raise(3) are async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        libc::raise(libc::SIGBUS);
    }
}

/// Injects a UCE at `addr` in this process, the way the hardware would
/// report it, and says which path ran.
///
/// # Safety
/// `addr` must point to readable memory of this process that may lose its
/// page's contents (a registered state buffer, or scratch memory).
pub unsafe fn inject(addr: *const u8) -> std::io::Result<InjectPath> {
    let page = (addr as usize) & !(4096 - 1);
    // SAFETY: madvise on a page of our own memory; with MADV_HWPOISON the
    // kernel poisons it (only with CONFIG_MEMORY_FAILURE and
    // CAP_SYS_ADMIN), else it fails with EINVAL/EPERM and nothing changes.
    let rc = unsafe { libc::madvise(page as *mut libc::c_void, 4096, libc::MADV_HWPOISON) };
    if rc == 0 {
        // SAFETY: reading the poisoned byte raises the real SIGBUS, whose
        // handler maps a fresh page so that the read then completes.
        unsafe { std::ptr::read_volatile(addr) };
        return Ok(InjectPath::Hwpoison);
    }
    // SAFETY: a zeroed siginfo_t with signo, code and addr filled in at the
    // Linux 64-bit offsets, queued to this very thread.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let p = (&mut info as *mut libc::siginfo_t).cast::<u8>();
        p.cast::<i32>().write(libc::SIGBUS);
        p.add(8).cast::<i32>().write(libc::BUS_MCEERR_AR);
        p.add(16).cast::<usize>().write(addr as usize);
        let rc = libc::syscall(
            libc::SYS_rt_tgsigqueueinfo,
            libc::getpid(),
            libc::gettid(),
            libc::SIGBUS,
            &info as *const libc::siginfo_t,
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
        let mut buf = vec![7u8; 3 * 4096];
        let base = buf.as_ptr() as usize;
        register(MAX_RANGES - 1, buf.as_ptr(), buf.len());
        let before = count();
        // SAFETY: a byte of our own buffer, whose page may be lost.
        let path = unsafe { inject(buf[5000..].as_ptr()) }.unwrap();
        eprintln!("injection path: {path:?}");
        assert_eq!(
            take_pending(),
            Some(Uce {
                buffer: MAX_RANGES - 1,
                offset: 5000
            })
        );
        assert_eq!(count(), before + 1);
        // The page holding byte 5000 was replaced by a fresh zero page; the
        // others are intact.
        let page = (base + 5000) & !4095;
        let at = page - base;
        assert!(buf[at..at + 4096].iter().all(|b| *b == 0));
        assert!(buf[..at].iter().chain(&buf[at + 4096..]).all(|b| *b == 7));
        buf[5000] = 1; // writable again
        register(MAX_RANGES - 1, std::ptr::null(), 0);
    }
}
