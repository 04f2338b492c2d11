//! What a task is writing: the size of the write(2)-family call a task is blocked in,
//! read from /proc.
//!
//! Under the kernel's writeback cache the server sees no write(): data reaches it
//! later, as cached WRITEs. While space is low the kernel asks for a file's attributes
//! (a GETATTR with the handle) before each write() on a descriptor that writes through
//! its cache (`lowspace`); the task that asks is blocked in its system call until the
//! reply, so /proc/TID/syscall shows that call and its arguments, and the server can
//! admit or refuse exactly the bytes that call may copy into the kernel's cache.
//!
//! Owns: parsing /proc/TID/syscall (`NR ARG0..ARG5 SP PC`, hex), the byte count of the
//! write calls (write, pwrite64, writev/pwritev/pwritev2 — the iovecs read from
//! /proc/TID/mem —, sendfile, splice, copy_file_range), and the scan for tasks in such
//! a call on the mount (`scan`: their descriptor's mount id, from /proc/TID/fdinfo).
//! Reading another task's syscall and memory needs ptrace access to it (root, or the
//! same user where Yama allows it); whatever cannot be read, or a call not known here
//! (a 32-bit task's numbers, io_uring workers, kernel threads), is `Call::Unknown`, which
//! the caller treats as a large write. No locks; called by request handlers (the
//! GETATTR gate) and the low-space watcher (`scan`).

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::FileExt;

/// What a task is doing in the kernel, as far as writing is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// A call that copies at most this many bytes into a file (write, pwrite, ...),
    /// through descriptor `fd`.
    Write { fd: i64, bytes: u64 },
    /// A call known to copy nothing into a file (read, lseek, ...).
    NoWrite,
    /// Not known or not readable.
    Unknown,
}

/// The system calls this module knows, by this architecture's numbers.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod nr {
    pub(super) const WRITE: i64 = libc::SYS_write;
    pub(super) const PWRITE64: i64 = libc::SYS_pwrite64;
    pub(super) const WRITEV: i64 = libc::SYS_writev;
    pub(super) const PWRITEV: i64 = libc::SYS_pwritev;
    pub(super) const PWRITEV2: i64 = libc::SYS_pwritev2;
    pub(super) const SENDFILE: i64 = libc::SYS_sendfile;
    pub(super) const SPLICE: i64 = libc::SYS_splice;
    pub(super) const COPY_FILE_RANGE: i64 = libc::SYS_copy_file_range;
    pub(super) const READS: [i64; 6] = [
        libc::SYS_read,
        libc::SYS_pread64,
        libc::SYS_readv,
        libc::SYS_preadv,
        libc::SYS_preadv2,
        libc::SYS_lseek,
    ];
}

/// Largest iovec count a writev takes (UIO_MAXIOV).
const MAX_IOV: u64 = 1024;

/// Parse the text of /proc/TID/syscall: the call number and its six arguments.
/// None for a task not in a system call ("running", "-1 SP PC") or bad text.
pub(crate) fn parse_syscall(text: &str) -> Option<(i64, [u64; 6])> {
    let mut it = text.split_whitespace();
    let nr: i64 = it.next()?.parse().ok()?;
    if nr < 0 {
        return None;
    }
    let mut args = [0u64; 6];
    for a in &mut args {
        let t = it.next()?;
        *a = u64::from_str_radix(t.strip_prefix("0x").unwrap_or(t), 16).ok()?;
    }
    Some((nr, args))
}

/// What call `(nr, args)` is; `iov_total(addr, count)` sums an iovec array of the task.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn classify(nr: i64, a: [u64; 6], iov_total: impl Fn(u64, u64) -> Option<u64>) -> Call {
    let fd = a[0] as i64;
    match nr {
        nr::WRITE | nr::PWRITE64 => Call::Write { fd, bytes: a[2] },
        nr::WRITEV | nr::PWRITEV | nr::PWRITEV2 => match iov_total(a[1], a[2]) {
            Some(bytes) => Call::Write { fd, bytes },
            None => Call::Unknown,
        },
        // sendfile(out, in, offset, count).
        nr::SENDFILE => Call::Write { fd, bytes: a[3] },
        // splice(in, off_in, out, off_out, len, flags), copy_file_range the same.
        nr::SPLICE | nr::COPY_FILE_RANGE => Call::Write {
            fd: a[2] as i64,
            bytes: a[4],
        },
        n if nr::READS.contains(&n) => Call::NoWrite,
        _ => Call::Unknown,
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(crate) fn classify(_: i64, _: [u64; 6], _: impl Fn(u64, u64) -> Option<u64>) -> Call {
    Call::Unknown
}

/// Sum of the lengths of `count` iovecs at `addr` in task `tid`'s memory.
fn iov_total(tid: u32, addr: u64, count: u64) -> Option<u64> {
    if count == 0 {
        return Some(0);
    }
    if count > MAX_IOV {
        return None;
    }
    let mem = fs::File::open(format!("/proc/{tid}/mem")).ok()?;
    let mut buf = vec![0u8; (count * 16) as usize];
    mem.read_exact_at(&mut buf, addr).ok()?;
    Some(
        buf.chunks_exact(16)
            .map(|c| u64::from_ne_bytes([c[8], c[9], c[10], c[11], c[12], c[13], c[14], c[15]]))
            .fold(0u64, u64::saturating_add),
    )
}

/// The call task `tid` is blocked in, with its text (to tell later whether it is
/// still the same call).
fn call_of(tid: u32) -> (Call, Option<String>) {
    let Ok(text) = fs::read_to_string(format!("/proc/{tid}/syscall")) else {
        return (Call::Unknown, None);
    };
    let call = match parse_syscall(&text) {
        Some((nr, args)) => classify(nr, args, |a, n| iov_total(tid, a, n)),
        None => Call::Unknown,
    };
    (call, Some(text))
}

/// The write call task `tid` is blocked in: `Ok(None)` for a call that writes
/// nothing, `Err(())` when not known.
pub(crate) fn write_call(tid: u32) -> Result<Option<Writer>, ()> {
    if tid == 0 {
        return Err(());
    }
    match call_of(tid) {
        (Call::Write { bytes, .. }, Some(text)) => Ok(Some(Writer {
            tid,
            text: Some(text),
            bytes,
        })),
        (Call::NoWrite, _) => Ok(None),
        _ => Err(()),
    }
}

/// A task in a write call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Writer {
    pub(crate) tid: u32,
    /// The call's /proc/TID/syscall text: another text means the call has returned.
    /// None for a call that could not be read, which is never known to have returned.
    pub(crate) text: Option<String>,
    pub(crate) bytes: u64,
}

/// The text a task found running (not in a readable call) is recorded with.
const RUNNING: &str = "running";

impl Writer {
    /// Whether the task may still be in the call it was found in: it is, or it runs
    /// (a task copying data shows "running", not its call). A task found running may
    /// be until it is seen in a call that writes nothing. A task that is gone is not.
    pub(crate) fn still_in_call(&self) -> bool {
        let Some(text) = self.text.as_ref() else {
            return true;
        };
        let Ok(now) = fs::read_to_string(format!("/proc/{}/syscall", self.tid)) else {
            return false;
        };
        if now.starts_with(RUNNING) {
            return true;
        }
        if text.starts_with(RUNNING) {
            return parse_syscall(&now)
                .is_some_and(|(nr, a)| !matches!(classify(nr, a, |_, _| Some(0)), Call::NoWrite));
        }
        now == *text
    }
}

/// Whether process (or task) `tid` has a descriptor open for writing on one of
/// `mounts`.
fn writes_on(tid: u32, mounts: &HashSet<u64>) -> bool {
    let Ok(fds) = fs::read_dir(format!("/proc/{tid}/fdinfo")) else {
        return false;
    };
    fds.flatten().any(|f| {
        let Ok(t) = fs::read_to_string(f.path()) else {
            return false;
        };
        let field = |name: &str| t.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let on = field("mnt_id:")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|m| mounts.contains(&m));
        let writes = field("flags:")
            .and_then(|v| i64::from_str_radix(v, 8).ok())
            .is_some_and(|f| f & i64::from(libc::O_ACCMODE) != i64::from(libc::O_RDONLY));
        on && writes
    })
}

/// The mount id of descriptor `fd` of task `tid` (fdinfo's mnt_id).
fn mnt_id_of(tid: u32, fd: i64) -> Option<u64> {
    let t = fs::read_to_string(format!("/proc/{tid}/fdinfo/{fd}")).ok()?;
    t.lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Every task in a write call on a descriptor of one of `mounts` (mount ids), except
/// the tasks of process `me`. A task shown running is looked at again a few times
/// (one copying data shows "running", not its call); one still running then, with a
/// descriptor open for writing on the mount, is returned as writing `running_bytes`.
/// Tasks whose calls cannot be read (another user's, without root) are not found.
pub(crate) fn scan(mounts: &HashSet<u64>, me: u32, running_bytes: u64) -> Vec<Writer> {
    let mut out = Vec::new();
    let mut running = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    let look = |tid: u32, running: &mut Vec<u32>, out: &mut Vec<Writer>| {
        let Ok(text) = fs::read_to_string(format!("/proc/{tid}/syscall")) else {
            return;
        };
        if text.starts_with("running") {
            running.push(tid);
            return;
        }
        let Some((nr, args)) = parse_syscall(&text) else {
            return;
        };
        if let Call::Write { fd, bytes } = classify(nr, args, |a, n| iov_total(tid, a, n)) {
            if mnt_id_of(tid, fd).is_some_and(|m| mounts.contains(&m)) {
                out.push(Writer {
                    tid,
                    text: Some(text),
                    bytes,
                });
            }
        }
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
                look(tid, &mut running, &mut out);
            }
        }
    }
    for _ in 0..20 {
        if running.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        for tid in std::mem::take(&mut running) {
            look(tid, &mut running, &mut out);
        }
    }
    for tid in running {
        if writes_on(tid, mounts) {
            out.push(Writer {
                tid,
                text: Some(RUNNING.into()),
                bytes: running_bytes,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscall_text_parses() {
        let t = "1 0x4 0x55d8e25386c0 0x3039 0x0 0x0 0x0 0x7ffe9986f798 0x7f0219b16350\n";
        assert_eq!(
            parse_syscall(t),
            Some((1, [4, 0x55d8_e253_86c0, 0x3039, 0, 0, 0]))
        );
        assert_eq!(parse_syscall("running\n"), None);
        assert_eq!(parse_syscall("-1 0x7ffe9986f798 0x7f0219b16350\n"), None);
        assert_eq!(parse_syscall("1 0x4 zz"), None);
        assert_eq!(parse_syscall(""), None);
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    fn calls_are_classified() {
        let none = |_: u64, _: u64| None;
        let a = [3, 0x1000, 4096, 7, 8, 9];
        assert_eq!(
            classify(libc::SYS_write, a, none),
            Call::Write { fd: 3, bytes: 4096 }
        );
        assert_eq!(
            classify(libc::SYS_pwrite64, a, none),
            Call::Write { fd: 3, bytes: 4096 }
        );
        assert_eq!(classify(libc::SYS_writev, a, none), Call::Unknown);
        assert_eq!(
            classify(libc::SYS_writev, a, |addr, n| (addr == 0x1000 && n == 4096)
                .then_some(77)),
            Call::Write { fd: 3, bytes: 77 }
        );
        assert_eq!(
            classify(libc::SYS_sendfile, a, none),
            Call::Write { fd: 3, bytes: 7 }
        );
        assert_eq!(
            classify(libc::SYS_splice, a, none),
            Call::Write { fd: 4096, bytes: 8 }
        );
        assert_eq!(classify(libc::SYS_read, a, none), Call::NoWrite);
        assert_eq!(classify(libc::SYS_lseek, a, none), Call::NoWrite);
        assert_eq!(classify(libc::SYS_getpid, a, none), Call::Unknown);
    }

    /// This very thread is in no write call, but a task blocked in write(2) on a pipe
    /// shows its count.
    #[test]
    fn a_blocked_writer_shows_its_count() {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        let (r, w) = (fds[0], fds[1]);
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).expect("send");
            let big = vec![7u8; 1 << 20];
            let mut done = 0;
            while done < big.len() {
                // SAFETY: writing our buffer to our pipe.
                let n = unsafe { libc::write(w, big[done..].as_ptr().cast(), big.len() - done) };
                assert!(n > 0);
                done += n as usize;
            }
        });
        let tid = rx.recv().expect("tid");
        // The pipe holds 64 KiB: the writer blocks inside its first call.
        let mut seen = None;
        for _ in 0..500 {
            seen = write_call(tid).ok().flatten().map(|w| w.bytes);
            if seen.is_some_and(|b| b > 0) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(matches!(seen, Some(b) if b > 0 && b <= 1 << 20), "{seen:?}");
        let mut sink = vec![0u8; 1 << 16];
        let mut got = 0;
        while got < 1 << 20 {
            // SAFETY: reading our pipe into our buffer.
            let n = unsafe { libc::read(r, sink.as_mut_ptr().cast(), sink.len()) };
            assert!(n > 0);
            got += n as usize;
        }
        h.join().expect("writer");
        // SAFETY: closing the pipe we made.
        unsafe {
            libc::close(r);
            libc::close(w);
        }
    }
}
