//! # rext4-fuse: mount an ext4 image through FUSE with the rext4 engine
//!
//! Owns: mount options (`parse_options`, mount(8)-style comma lists), the mount's
//! lifetime (`mount`: open the engine, mount with fuser, serve, unmount, close), and —
//! in `adapter` — the translation of FUSE requests to engine calls; in `life`, what
//! `rext4 umount` waits for and how a mount whose server died is cleaned up; in
//! `serverlog`, where the server's messages go; in `lowspace` (with `inflight`), the
//! space held back for what the kernel's writeback cache may still hand over, so that a
//! full disk fails write() itself. errno values appear here and in the CLI only.
//!
//! Lifetime of a mount:
//! 1. The engine's open claims the image (`rext4::claim`: exclusive flock for
//!    read-write, shared for read-only; refused under a loop device, a kernel mount or
//!    another rext4 writer, naming them): a second rext4 mount of an image in use fails
//!    with "image is in use" instead of two engines writing one journal. The server
//!    also holds a shared flock on the directory under its mount point until the image
//!    is closed, which `rext4 umount` waits for (`life`).
//! 2. Without `-f` the process forks first (before any thread exists); the parent waits
//!    on a pipe until the child reports the mount up (or its error) and returns.
//! 3. SIGINT, SIGTERM and SIGHUP are blocked in every thread and taken by one signal
//!    thread (`sigwait`), which unmounts the mount point (`umount`, and `umount -l` when
//!    it is busy). Unmounting ends the session: the kernel aborts the connection, the
//!    fuser workers see ENODEV and return.
//! 4. After the session ends — whether by signal, `fusermount3 -u` or `umount` — the
//!    pins the kernel never released (no FORGETs arrive at unmount, FUSE-NOTES
//!    pitfalls 1 and 8) are dropped, so orphans are freed, and `Fs::close` commits the
//!    journal and marks the image clean.
//!
//! Permissions: `default_permissions` is on unless `nodefault_permissions` is given,
//! so the kernel checks modes against the attributes we return (the adapter's
//! `access` is a minimal owner/group/other check for the other case; without
//! `default_permissions` no other operation is checked). POSIX ACLs are stored as
//! xattrs and kept in step with the mode (setting an access ACL sets the permission
//! bits, an ACL equal to them is not stored, chmod rewrites the ACL); with
//! `default_permissions` the mount asks for FUSE_POSIX_ACL, so the kernel enforces them
//! and the engine applies default ACLs to new inodes. FUSE_HANDLE_KILLPRIV_V2 leaves
//! dropping set-ID bits and capabilities to the adapter (see `adapter`).
//!
//! Caching: the kernel's page cache holds file data (writeback cache on by default);
//! the engine is opened with `cache_clean: false`, so its page cache keeps only dirty
//! data (delayed allocation) and `cache_mb=` bounds it. Entries and attributes are
//! cached by the kernel for an hour: only this mount changes the image.
//!
//! Workers: `threads` fuser worker threads (default 2x CPUs, at least 2), each reading
//! its own cloned /dev/fuse descriptor (FUSE_DEV_IOC_CLONE), all calling one shared
//! `rext4::Fs`; where the kernel offers FUSE-over-io_uring (option `uring`, the
//! default), two more threads per CPU, pinned to it (unless that starves them), serve
//! that CPU's request queue, and the /dev/fuse workers see only FORGET, INTERRUPT and
//! the like (vendor/fuser/src/uring.rs).

mod adapter;
mod inflight;
mod life;
mod lowspace;
mod serverlog;

pub use serverlog::init_stderr_log;

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::thread::JoinHandleExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fuser::{Config, MountOption, Session, SessionACL};
use rext4::{AtimeMode, Fs, FsOptions};

use adapter::{Adapter, AdapterConfig, Shared};

/// The ioctl (`_IO('r', 0xE4)`) on any file or directory of a rext4 mount that makes
/// everything the server holds durable (file data, then a journal commit and device
/// flushes) before it returns. `rext4 sync` calls syncfs(2) first, so that the kernel's
/// dirty pages of the mount reach the server too (this kernel sends no SYNCFS to a FUSE
/// server).
pub const REXT4_IOC_SYNC: u32 = 0x72E4;

/// What to do after an I/O error or detected corruption (ext4's errors=).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorsPolicy {
    /// Report the error and carry on.
    Continue,
    /// Report it and refuse every further change (EROFS).
    RemountRo,
}

/// Options of `rext4 mount -o ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// Read-only (the image is opened read-only and the mount is `ro`).
    pub ro: bool,
    /// Read-write (the default; `rw` after `ro` wins, as in mount(8)).
    pub rw: bool,
    pub errors: ErrorsPolicy,
    /// Journal commit interval in seconds (ext4's commit=; 0 disables periodic commits).
    pub commit_secs: u64,
    /// Milliseconds after a change that it reaches the image file as an early commit
    /// (`early_commit=`, default 200; 0: never): file data written to the image and
    /// metadata to the log, without a flush, so a crash of the server process alone
    /// loses only the last moment (`FsOptions::early_commit_ms`).
    pub early_commit_ms: u64,
    /// Block bitmaps one allocation reads together (`mb_prefetch=`, the kernel's
    /// tunable; engine default when `None`: 8 x groups per flex group).
    pub mb_prefetch: Option<u32>,
    /// Block bitmaps one allocation may prefetch in all (`mb_prefetch_limit=`).
    pub mb_prefetch_limit: Option<u32>,
    /// Summarize the block bitmaps in the background after mount
    /// (`prefetch_block_bitmaps`, the default; `no_prefetch_block_bitmaps` turns it off).
    pub prefetch_block_bitmaps: bool,
    /// Discard blocks as they are freed, once their transaction commits (`discard`;
    /// `nodiscard`, the default, leaves it to `fstrim`).
    pub discard: bool,
    /// Page cache (file data) size in MiB (engine default when `None`: 1/16 of RAM,
    /// 64 MiB to 2 GiB).
    pub cache_mb: Option<u64>,
    /// Let other users use the mount (FUSE allow_other).
    pub allow_other: bool,
    /// Let the kernel check permissions (default on; `nodefault_permissions` turns it off).
    pub default_permissions: bool,
    /// Log every request and error to stderr (implies foreground).
    pub debug: bool,
    /// Serve in the calling process instead of forking a daemon.
    pub foreground: bool,
    /// FUSE worker threads; 0 = 2x the number of CPUs (at least 2).
    pub threads: usize,
    /// Ask for the kernel's writeback cache (FUSE_WRITEBACK_CACHE); default on.
    pub writeback_cache: bool,
    /// Serve through FUSE-over-io_uring when the kernel offers it (`uring`, default;
    /// `nouring` keeps to /dev/fuse). The kernel offers it from Linux 6.14 when the
    /// fuse module's `enable_uring` parameter is set.
    pub uring: bool,
    /// Honour device files (default `nodev`).
    pub dev: bool,
    /// Honour set-user-ID bits (default `nosuid`).
    pub suid: bool,
    /// Allow execution (default `exec`).
    pub exec: bool,
    /// The largest share of the system's dirty-page threshold this mount's dirty pages
    /// may use, in percent (`bdi_max_ratio=`). The kernel gives every FUSE mount 1%,
    /// which throttles writers long before the disk is busy; when this is set (default
    /// 40) and we may write the mount's /sys/class/bdi entry (root), the server gives
    /// the mount a dirty window (min_bytes = max_bytes, strict) of this share, or of
    /// a quarter of the space left when that is less; the space the window may fill
    /// is held back for it (`lowspace`). 0 leaves the kernel's setting.
    pub bdi_max_ratio: u32,
    /// When reads move atimes: `relatime` (default), `strictatime`, `noatime`,
    /// `nodiratime`. FUSE inodes never get atime updates from the kernel, so the
    /// server applies this (see `adapter`).
    pub atime: rext4::AtimePolicy,
    /// Append the server's messages to this file (`log=FILE`) instead of syslog (a
    /// daemon) or standard error (`-f`).
    pub log: Option<PathBuf>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            ro: false,
            rw: true,
            errors: ErrorsPolicy::Continue,
            commit_secs: 5,
            early_commit_ms: 200,
            mb_prefetch: None,
            mb_prefetch_limit: None,
            prefetch_block_bitmaps: true,
            discard: false,
            cache_mb: None,
            allow_other: false,
            default_permissions: true,
            debug: false,
            foreground: false,
            threads: 0,
            writeback_cache: true,
            uring: true,
            dev: false,
            suid: false,
            exec: true,
            bdi_max_ratio: 40,
            atime: rext4::AtimePolicy::RELATIME,
            log: None,
        }
    }
}

/// CLOCK_REALTIME_COARSE, the clock of the kernel's current_time() (the last tick).
fn coarse_now() -> rext4::Timestamp {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut t) } != 0 {
        return rext4::inode_write::now_ts();
    }
    rext4::Timestamp {
        sec: t.tv_sec,
        nsec: t.tv_nsec as u32,
    }
}

fn parse_num(opt: &str, v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .map_err(|_| format!("bad value for mount option {opt}: {v:?}"))
}

/// Parse a mount(8)-style comma-separated option list (later options override
/// earlier ones). Known: ro, rw, errors=continue|remount-ro, commit=N, cache_mb=N,
/// early_commit=MS, threads=N, bdi_max_ratio=N, mb_prefetch=N, mb_prefetch_limit=N,
/// prefetch_block_bitmaps, no_prefetch_block_bitmaps, discard, nodiscard, log=FILE, allow_other, default_permissions,
/// nodefault_permissions, debug, writeback_cache, nowriteback_cache, uring, nouring, dev,
/// nodev, suid, nosuid, exec, noexec, atime, relatime, nostrictatime, strictatime,
/// norelatime, noatime, nodiratime, diratime, and the no-ops lazytime, nolazytime,
/// defaults, async, auto, noauto.
pub fn parse_options(s: &str) -> Result<MountOptions, String> {
    let mut o = MountOptions::default();
    apply_options(&mut o, s)?;
    Ok(o)
}

/// Apply an option list to `o` (see [`parse_options`]).
pub fn apply_options(o: &mut MountOptions, s: &str) -> Result<(), String> {
    for opt in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        let flag = |o: &mut MountOptions, f: fn(&mut MountOptions)| -> Result<(), String> {
            if v.is_some() {
                return Err(format!("mount option {k} takes no value"));
            }
            f(o);
            Ok(())
        };
        match (k, v) {
            ("ro", _) => flag(o, |o| {
                o.ro = true;
                o.rw = false;
            })?,
            ("rw", _) => flag(o, |o| {
                o.rw = true;
                o.ro = false;
            })?,
            ("errors", Some("continue")) => o.errors = ErrorsPolicy::Continue,
            ("errors", Some("remount-ro")) => o.errors = ErrorsPolicy::RemountRo,
            ("errors", Some(x)) => {
                return Err(format!(
                    "bad value for mount option errors: {x:?} (continue or remount-ro)"
                ))
            }
            ("commit", Some(x)) => o.commit_secs = parse_num(k, x)?,
            ("early_commit", Some(x)) => o.early_commit_ms = parse_num(k, x)?,
            ("cache_mb", Some(x)) => o.cache_mb = Some(parse_num(k, x)?),
            ("mb_prefetch" | "mb_prefetch_limit", Some(x)) => {
                let n = parse_num(k, x)?;
                if n == 0 || n > u64::from(u32::MAX) {
                    return Err(format!("{k} must be 1..={}, not {n}", u32::MAX));
                }
                match k {
                    "mb_prefetch" => o.mb_prefetch = Some(n as u32),
                    _ => o.mb_prefetch_limit = Some(n as u32),
                }
            }
            ("prefetch_block_bitmaps", _) => flag(o, |o| o.prefetch_block_bitmaps = true)?,
            ("no_prefetch_block_bitmaps", _) => flag(o, |o| o.prefetch_block_bitmaps = false)?,
            ("discard", _) => flag(o, |o| o.discard = true)?,
            ("nodiscard", _) => flag(o, |o| o.discard = false)?,
            ("threads", Some(x)) => {
                let n = parse_num(k, x)?;
                if n == 0 || n > 256 {
                    return Err(format!("threads must be 1..=256, not {n}"));
                }
                o.threads = n as usize;
            }
            ("bdi_max_ratio", Some(x)) => {
                let n = parse_num(k, x)?;
                if n > 100 {
                    return Err(format!("bdi_max_ratio is a percentage (0..=100), not {n}"));
                }
                o.bdi_max_ratio = n as u32;
            }
            ("log", Some(x)) if !x.is_empty() => o.log = Some(PathBuf::from(x)),
            (
                "errors" | "commit" | "early_commit" | "cache_mb" | "threads" | "bdi_max_ratio"
                | "log" | "mb_prefetch" | "mb_prefetch_limit",
                _,
            ) => return Err(format!("mount option {k} needs a value ({k}=...)")),
            ("allow_other", _) => flag(o, |o| o.allow_other = true)?,
            ("default_permissions", _) => flag(o, |o| o.default_permissions = true)?,
            ("nodefault_permissions", _) => flag(o, |o| o.default_permissions = false)?,
            ("debug", _) => flag(o, |o| {
                o.debug = true;
                o.foreground = true;
            })?,
            ("writeback_cache", _) => flag(o, |o| o.writeback_cache = true)?,
            ("nowriteback_cache", _) => flag(o, |o| o.writeback_cache = false)?,
            ("uring", _) => flag(o, |o| o.uring = true)?,
            ("nouring", _) => flag(o, |o| o.uring = false)?,
            ("dev", _) => flag(o, |o| o.dev = true)?,
            ("nodev", _) => flag(o, |o| o.dev = false)?,
            ("suid", _) => flag(o, |o| o.suid = true)?,
            ("nosuid", _) => flag(o, |o| o.suid = false)?,
            ("exec", _) => flag(o, |o| o.exec = true)?,
            ("noexec", _) => flag(o, |o| o.exec = false)?,
            ("atime" | "relatime" | "nostrictatime", _) => {
                flag(o, |o| o.atime.mode = AtimeMode::Relative)?
            }
            ("strictatime" | "norelatime", _) => flag(o, |o| o.atime.mode = AtimeMode::Always)?,
            ("noatime", _) => flag(o, |o| o.atime.mode = AtimeMode::Never)?,
            ("nodiratime", _) => flag(o, |o| o.atime.nodiratime = true)?,
            ("diratime", _) => flag(o, |o| o.atime.nodiratime = false)?,
            // Inode times are written with the next journal commit already.
            ("lazytime" | "nolazytime", _) => flag(o, |_| {})?,
            ("defaults" | "async" | "auto" | "noauto", _) => flag(o, |_| {})?,
            _ => return Err(format!("unknown mount option: {opt}")),
        }
    }
    Ok(())
}

/// Mount `image` at `mountpoint` and serve it until it is unmounted (`fusermount3 -u`,
/// `umount`) or the server gets SIGINT/SIGTERM/SIGHUP. With `opts.foreground` this
/// returns when the mount is gone and the image is closed; otherwise the process forks,
/// the child serves, and this returns in the parent once the mount is up. A rext4
/// mount at `mountpoint` whose server died is detached first (see `life`); the
/// engine's open then recovers the image.
///
/// `image` may be an image spec (`rext4::image`: `DISK?partition=N`,
/// `DISK?offset=BYTES`); the mount's source (mountinfo) is then the spec over the
/// file's absolute path, which `rext4 umount` reads back.
pub fn mount(image: &Path, mountpoint: &Path, opts: &MountOptions) -> Result<(), String> {
    let spec = spec_of(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let image = match spec.local_file() {
        // A network source (an NBD URI) is its own name.
        None => PathBuf::from(spec.to_string()),
        Some(p) => {
            let file = p
                .canonicalize()
                .map_err(|e| format!("{}: {e}", p.display()))?;
            if spec.is_plain() {
                file
            } else {
                PathBuf::from(spec.with_path(file).to_string())
            }
        }
    };
    clear_dead_mount(mountpoint)?;
    let mnt = mountpoint
        .canonicalize()
        .map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    if !mnt.is_dir() {
        return Err(format!("{}: not a directory", mnt.display()));
    }
    let mut opts = opts.clone();
    if let Some(l) = &opts.log {
        // The daemon works in /.
        opts.log = Some(std::path::absolute(l).map_err(|e| format!("{}: {e}", l.display()))?);
    }
    if opts.foreground || opts.debug {
        return serve(&image, &mnt, &opts, None);
    }
    daemonize(&image, &mnt, &opts)
}

/// Detach a dead rext4 mount at `mountpoint`, if there is one, saying so.
fn clear_dead_mount(mountpoint: &Path) -> Result<(), String> {
    let Ok(mnt) = life::resolve_mountpoint(mountpoint) else {
        return Ok(());
    };
    let Some(dead) = life::dead_rext4_mount(&mnt) else {
        return Ok(());
    };
    life::detach(&mnt)?;
    log::warn!(
        "{}: the server of the rext4 mount of {} there had died: detached it",
        mnt.display(),
        dead.source.display()
    );
    Ok(())
}

/// Take a non-blocking flock on the image: exclusive for read-write, shared for ro
/// (the lock every rext4 user of an image takes: `rext4::claim`). The lock lasts as
/// long as the returned claim lives.
pub fn lock_image(image: &Path, exclusive: bool) -> Result<rext4::Claim, String> {
    let spec = spec_of(image).map_err(|e| format!("{}: {e}", image.display()))?;
    rext4::claim::lock_path(spec.path(), exclusive).map_err(|e| format!("{}: {e}", image.display()))
}

/// The image spec a mount's image text names (a path that exists is that file).
pub fn spec_of(image: &Path) -> Result<rext4::ImageSpec, rext4::Error> {
    match image.to_str() {
        Some(t) => rext4::ImageSpec::from_arg(t),
        None => Ok(rext4::ImageSpec::file(image)),
    }
}

/// `rext4 umount MNT`: unmount a rext4 mount and wait until its server has closed the
/// image (journal committed, image marked clean), which a bare `fusermount3 -u` does not
/// wait for. The server is known to be done when its hold on the mount point is gone
/// (`life`), so other mounts of the same image do not delay it. `limit` bounds the
/// wait. A mount whose server died is detached and its image recovered at once (said
/// as a warning).
pub fn umount_and_wait(mountpoint: &Path, limit: std::time::Duration) -> Result<PathBuf, String> {
    let mnt = life::resolve_mountpoint(mountpoint)?;
    let entry = life::mount_entry(&mnt)
        .filter(|e| matches!(e.fstype.as_str(), "fuse.rext4" | "fuse"))
        .ok_or_else(|| format!("{}: not a rext4 mount", mnt.display()))?;
    let image = entry.source.clone();
    if let Some(dead) = life::dead_rext4_mount(&mnt) {
        life::detach(&mnt)?;
        let what = if dead.read_only {
            "the image was mounted read-only and is as it was".to_string()
        } else {
            match life::recover(&image) {
                Ok(true) => format!("{} recovered (journal replayed)", image.display()),
                Ok(false) => format!("{} needed no recovery", image.display()),
                Err(e) => format!(
                    "{} will be recovered (journal replayed) when it is next opened ({e})",
                    image.display()
                ),
            }
        };
        log::warn!(
            "{}: the mount's server had died (the mount was not connected): detached it; {what}",
            mnt.display()
        );
        return Ok(image);
    }
    // A root mount shows type "fuse" only: it is ours if a server holds the image lock.
    if lock_image(&image, true).is_ok() {
        return Err(format!(
            "{}: not a rext4 mount (no rext4 server holds {})",
            mnt.display(),
            image.display()
        ));
    }
    unmount(&mnt)?;
    life::wait_for_server(&mnt, &image, entry.read_only, limit)?;
    Ok(image)
}

/// Undo mountinfo's octal escapes (\040 for a space, ...).
fn unescape_mountinfo(s: &str) -> Vec<u8> {
    rext4::claim::unescape_mountinfo(s.as_bytes())
}

/// The sysfs directory of the FUSE mount's bdi (its dirty-page limits, which
/// `lowspace` reads and, as root, sets), and the mount's device number (major:minor).
/// Found in /proc/self/mountinfo (a stat of the mount point would ask our own, not yet
/// serving, session).
fn mount_bdi(mnt: &Path) -> Result<(PathBuf, String), String> {
    let info = std::fs::read("/proc/self/mountinfo").map_err(|e| format!("mountinfo: {e}"))?;
    let want = mnt.as_os_str().as_encoded_bytes();
    let dev = info
        .split(|&b| b == b'\n')
        .filter_map(|l| {
            let f: Vec<&[u8]> = l.split(|&b| b == b' ').collect();
            (f.len() > 4 && unescape_mountinfo(&String::from_utf8_lossy(f[4])) == want)
                .then(|| String::from_utf8_lossy(f[2]).into_owned())
        })
        .next_back()
        .ok_or_else(|| format!("{} not in mountinfo", mnt.display()))?;
    let dir = Path::new("/sys/class/bdi").join(&dev);
    if dir.is_dir() {
        Ok((dir, dev))
    } else {
        Err(format!("{}: no such bdi", dir.display()))
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get() * 2)
        .clamp(2, 64)
}

/// The signals that end a mount.
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

/// Blocks the stop signals in this thread (and so in every thread it starts from now
/// on); restores the previous mask on drop.
struct SignalMask {
    old: libc::sigset_t,
}

impl SignalMask {
    fn block() -> SignalMask {
        let set = stop_signals();
        // SAFETY: pthread_sigmask with valid set pointers.
        unsafe {
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            SignalMask { old }
        }
    }
}

impl Drop for SignalMask {
    fn drop(&mut self) {
        // SAFETY: restores a mask obtained from pthread_sigmask.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

/// Unmount `mnt`: umount(2), lazily when busy, else `fusermount3 -u -z` (not root).
fn unmount(mnt: &Path) -> Result<(), String> {
    let c = CString::new(mnt.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: umount2 with a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EBUSY) => {
            // SAFETY: as above.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
                log::warn!(
                    "{} is busy: detached; the image is closed when the last user goes",
                    mnt.display()
                );
                return Ok(());
            }
            Err(format!(
                "umount -l {}: {}",
                mnt.display(),
                std::io::Error::last_os_error()
            ))
        }
        Some(libc::EPERM) => {
            let st = std::process::Command::new("fusermount3")
                .args(["-u", "-z", "--"])
                .arg(mnt)
                .status()
                .map_err(|e| format!("fusermount3: {e}"))?;
            if st.success() {
                Ok(())
            } else {
                Err(format!("fusermount3 -u -z {} failed", mnt.display()))
            }
        }
        _ => Err(format!("umount {}: {e}", mnt.display())),
    }
}

/// Report from the serving process to a waiting parent (daemon mode).
struct Ready(Option<File>);

impl Ready {
    fn ok(&mut self) {
        if let Some(mut f) = self.0.take() {
            let _ = f.write_all(b"0");
        }
    }
    fn err(&mut self, msg: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = f.write_all(format!("1{msg}").as_bytes());
        }
    }
}

fn daemonize(image: &Path, mnt: &Path, opts: &MountOptions) -> Result<(), String> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the descriptors were just created and are owned here.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fork; the child only runs Rust code of this process (no thread exists
    // yet in a CLI that calls mount before starting any).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(r);
        // SAFETY: setsid/chdir have no memory preconditions.
        unsafe {
            libc::setsid();
            libc::chdir(c"/".as_ptr());
        }
        // Errors go to the parent through the pipe (before the mount is up) or to
        // /dev/null (after it: stdio is detached then).
        let code = i32::from(serve(image, mnt, opts, Some(File::from(w))).is_err());
        std::process::exit(code);
    }
    drop(w);
    let mut msg = Vec::new();
    let _ = File::from(r).read_to_end(&mut msg);
    match msg.split_first() {
        Some((b'0', _)) => Ok(()),
        Some((_, m)) => Err(String::from_utf8_lossy(m).into_owned()),
        None => {
            let mut st = 0;
            // SAFETY: waits for our own child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            Err("the mount daemon exited before the mount was up".into())
        }
    }
}

/// Redirect stdin/stdout/stderr to /dev/null (a daemon after start-up).
fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

fn serve(image: &Path, mnt: &Path, opts: &MountOptions, ready: Option<File>) -> Result<(), String> {
    let mut ready = Ready(ready);
    let r = serve_inner(image, mnt, opts, &mut ready);
    if let Err(e) = &r {
        ready.err(e);
    }
    r
}

fn serve_inner(
    image: &Path,
    mnt: &Path,
    opts: &MountOptions,
    ready: &mut Ready,
) -> Result<(), String> {
    start_log(mnt, opts, ready.0.is_some())?;
    let ro = opts.ro && !opts.rw;
    // Held until this function returns, after the image is closed: `rext4 umount`
    // waits for it (see `life`). Taken before the mount covers the directory.
    let _mountpoint_hold = life::hold_mountpoint(mnt);
    // Block the stop signals before any thread starts (the engine's commit thread,
    // fuser's workers), so only the signal thread below receives them.
    let _mask = SignalMask::block();
    let mut fo = FsOptions {
        read_only: ro,
        commit_secs: opts.commit_secs,
        early_commit_ms: opts.early_commit_ms,
        mb_prefetch: opts.mb_prefetch,
        mb_prefetch_limit: opts.mb_prefetch_limit,
        prefetch_block_bitmaps: opts.prefetch_block_bitmaps,
        discard: opts.discard,
        // The kernel's page cache holds file data (KEEP_CACHE, and the writeback
        // cache): the engine keeps only dirty pages, for delayed allocation.
        cache_clean: false,
        // The kernel stamps mtime/ctime itself under the writeback cache, from its
        // coarse clock: the engine's times come from the same clock, so they stay in
        // order with the kernel's (a file is never born after its first write).
        clock: Some(coarse_now),
        atime: opts.atime,
        // The engine claims the image (exclusive for rw, shared for ro); a read-only
        // mount refuses an image someone writes, as the kernel caches what it reads.
        keep_writers_out: true,
        // The engine marks the image and, with remount-ro, aborts its journal on a
        // metadata error by itself; the adapter also refuses changes (EROFS).
        errors: Some(match opts.errors {
            ErrorsPolicy::Continue => rext4::Errors::Continue,
            ErrorsPolicy::RemountRo => rext4::Errors::RemountRo,
        }),
        ..FsOptions::default()
    };
    if let Some(mb) = opts.cache_mb {
        // The engine's page cache (file data); the metadata cache keeps its default.
        fo.cache_bytes = Some(mb.max(1).saturating_mul(1 << 20));
    }
    let fs = spec_of(image)
        .and_then(|spec| Fs::open_spec(&spec, fo))
        .map_err(|e| format!("{}: {e}", image.display()))?;
    for w in fs.warnings() {
        log::warn!("{}: {w}", image.display());
    }
    let fs_ro = fs.is_read_only();
    if fs_ro && !ro {
        log::warn!(
            "{}: the image can only be opened read-only; mounting ro",
            image.display()
        );
    }
    let shared = Arc::new(Shared::new(
        fs.clone(),
        AdapterConfig {
            writeback_cache: opts.writeback_cache,
            default_permissions: opts.default_permissions,
            remount_ro_on_error: opts.errors == ErrorsPolicy::RemountRo,
            debug: opts.debug,
        },
    ));
    let mut mo = vec![
        MountOption::FSName(image.display().to_string()),
        MountOption::Subtype("rext4".into()),
    ];
    if opts.default_permissions {
        mo.push(MountOption::DefaultPermissions);
    }
    mo.push(if fs_ro {
        MountOption::RO
    } else {
        MountOption::RW
    });
    if opts.dev {
        mo.push(MountOption::Dev);
    }
    if opts.suid {
        mo.push(MountOption::Suid);
    }
    if !opts.exec {
        mo.push(MountOption::NoExec);
    }
    if opts.atime.mode == AtimeMode::Never {
        mo.push(MountOption::NoAtime);
    }
    let mut config = Config::default();
    config.mount_options = mo;
    config.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(if opts.threads == 0 {
        default_threads()
    } else {
        opts.threads
    });
    config.clone_fd = true;
    config.uring = opts.uring;
    config.uring_threads_per_queue = 2;
    // Every mount needs /dev/fuse (fusermount3 too opens it as the calling user): say
    // why when it cannot be had, rather than fuser's bare EACCES.
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        let _ = fs.close();
        return Err(match e.kind() {
            std::io::ErrorKind::PermissionDenied => format!(
                "mount {}: /dev/fuse is not open to this user, so only root can mount FUSE \
                 filesystems here (udev's rule gives it mode 0666)",
                mnt.display()
            ),
            std::io::ErrorKind::NotFound => format!(
                "mount {}: /dev/fuse does not exist: load the fuse module (modprobe fuse)",
                mnt.display()
            ),
            _ => format!("mount {}: /dev/fuse: {e}", mnt.display()),
        });
    }
    let adapter = Adapter { s: shared.clone() };
    let session = match Session::new(adapter, mnt, &config) {
        Ok(s) => s,
        Err(e) => {
            let _ = fs.close();
            return Err(format!("mount {}: {e}", mnt.display()));
        }
    };
    let transport = match session.uring_queues() {
        0 => "/dev/fuse".to_string(),
        n => format!("FUSE-over-io_uring, {n} queues"),
    };
    let _ = shared.notifier.set(session.notifier());
    if !fs_ro && opts.writeback_cache {
        let bdi = match mount_bdi(mnt) {
            Ok(d) => Some(d),
            Err(e) => {
                log::warn!("the mount's dirty-page limit was not found: {e}");
                None
            }
        };
        // The threads that serve GETATTR and WRITE: the ring's where it is used.
        let threads = match session.uring_queues() {
            0 => config.n_threads.unwrap_or(2),
            q => q * config.uring_threads_per_queue.max(1),
        };
        lowspace::LowSpace::start(&shared, bdi, opts.bdi_max_ratio, threads);
    }
    log::info!(
        "mounted {} ({}), serving through {transport}",
        image.display(),
        if fs_ro { "read-only" } else { "read-write" }
    );
    ready.ok();
    if ready_was_daemon(opts) {
        detach_stdio();
        serverlog::stop_mirror();
    }

    // The signal thread: unmount on SIGINT/SIGTERM/SIGHUP; woken with `done` set when
    // the session ends by itself.
    let done = Arc::new(AtomicBool::new(false));
    let sig_thread = {
        let done = done.clone();
        let mnt: PathBuf = mnt.to_path_buf();
        std::thread::Builder::new()
            .name("rext4-signals".into())
            .spawn(move || loop {
                let set = stop_signals();
                let mut sig = 0;
                // SAFETY: sigwait on a valid set; the signals are blocked in all threads.
                unsafe { libc::sigwait(&set, &mut sig) };
                if done.load(Ordering::SeqCst) {
                    return;
                }
                if let Err(e) = unmount(&mnt) {
                    log::error!("signal {sig}: {e}");
                }
            })
            .map_err(|e| format!("signal thread: {e}"))?
    };

    let run = session.run();
    done.store(true, Ordering::SeqCst);
    // SAFETY: the thread has not been joined, so its pthread_t is valid; it waits for
    // exactly this signal.
    unsafe { libc::pthread_kill(sig_thread.as_pthread_t(), libc::SIGTERM) };
    let _ = sig_thread.join();

    shared.lowspace.stop();
    shared.release_all();
    let closed = fs.close();
    drop(shared);
    let r = run
        .map_err(|e| format!("FUSE session: {e}"))
        .and(closed.map_err(|e| format!("{}: closing: {e}", image.display())));
    match &r {
        Ok(()) => log::info!("unmounted; {} closed", image.display()),
        // A foreground server's caller prints its error; a daemon's has gone.
        Err(e) if ready_was_daemon(opts) || opts.log.is_some() => log::error!("{e}"),
        Err(_) => {}
    }
    r
}

/// Route the server's messages (see `serverlog`): `-o log=FILE` appends to FILE, a
/// daemon logs to syslog, a foreground server to standard error.
fn start_log(mnt: &Path, opts: &MountOptions, daemon: bool) -> Result<(), String> {
    let sink = match &opts.log {
        Some(p) => {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(p)
                .map_err(|e| format!("log file {}: {e}", p.display()))?;
            serverlog::Sink::File(f)
        }
        None if daemon => serverlog::Sink::Syslog,
        None => serverlog::Sink::Stderr,
    };
    serverlog::configure(sink, mnt, opts.debug, daemon);
    Ok(())
}

fn ready_was_daemon(opts: &MountOptions) -> bool {
    !(opts.foreground || opts.debug)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let o = parse_options("").expect("empty list");
        assert_eq!(o, MountOptions::default());
        assert!(o.rw && !o.ro && o.default_permissions && o.writeback_cache);
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b"), b"/tmp/a b");
        assert_eq!(unescape_mountinfo(r"x\134y\011"), b"x\\y\t");
        // Not an escape (too short, not octal, too big): kept as is, no panic.
        assert_eq!(unescape_mountinfo(r"a\04"), br"a\04");
        assert_eq!(unescape_mountinfo(r"a\089"), br"a\089");
        assert_eq!(unescape_mountinfo(r"a\777"), br"a\777");
    }

    #[test]
    fn known_options_parse() {
        let o = parse_options(
            "ro,errors=remount-ro,commit=30,cache_mb=64,allow_other,debug,threads=3,\
             nowriteback_cache,nodefault_permissions,noatime,dev,suid,noexec,bdi_max_ratio=0",
        )
        .expect("valid list");
        assert_eq!(o.bdi_max_ratio, 0);
        assert_eq!(MountOptions::default().bdi_max_ratio, 40);
        assert!(o.ro && !o.rw);
        assert_eq!(o.errors, ErrorsPolicy::RemountRo);
        assert_eq!(o.commit_secs, 30);
        assert_eq!(o.cache_mb, Some(64));
        assert!(o.allow_other && o.debug && o.foreground);
        assert_eq!(o.threads, 3);
        assert!(!o.writeback_cache && !o.default_permissions);
        assert!(o.dev && o.suid && !o.exec);
        assert_eq!(o.log, None);
        let o = parse_options("log=/var/log/rext4.log").expect("valid");
        assert_eq!(o.log, Some(PathBuf::from("/var/log/rext4.log")));
        // Later options win.
        let o = parse_options("ro,rw").expect("valid");
        assert!(o.rw && !o.ro);
        // The kernel's bitmap prefetch tunables, as mount options.
        let d = MountOptions::default();
        assert!(d.prefetch_block_bitmaps && d.mb_prefetch.is_none());
        let o = parse_options("mb_prefetch=32,mb_prefetch_limit=64,no_prefetch_block_bitmaps")
            .expect("valid");
        assert_eq!((o.mb_prefetch, o.mb_prefetch_limit), (Some(32), Some(64)));
        assert!(!o.prefetch_block_bitmaps);
        let o = parse_options("no_prefetch_block_bitmaps,prefetch_block_bitmaps").expect("valid");
        assert!(o.prefetch_block_bitmaps);
    }

    #[test]
    fn atime_options_parse() {
        use rext4::{AtimeMode, AtimePolicy};
        assert_eq!(MountOptions::default().atime, AtimePolicy::RELATIME);
        for (list, mode, nodiratime) in [
            ("noatime", AtimeMode::Never, false),
            ("strictatime", AtimeMode::Always, false),
            ("norelatime", AtimeMode::Always, false),
            ("strictatime,relatime", AtimeMode::Relative, false),
            ("noatime,atime", AtimeMode::Relative, false),
            ("nodiratime,lazytime", AtimeMode::Relative, true),
            (
                "nodiratime,diratime,nostrictatime",
                AtimeMode::Relative,
                false,
            ),
        ] {
            let o = parse_options(list).expect(list);
            assert_eq!(o.atime, AtimePolicy { mode, nodiratime }, "{list}");
        }
        assert!(parse_options("noatime=1").is_err());
    }

    #[test]
    fn bad_options_name_themselves() {
        for (s, needle) in [
            ("rw,frobnicate", "frobnicate"),
            ("errors=panic", "panic"),
            ("commit=soon", "commit"),
            ("commit", "commit"),
            ("ro=1", "ro"),
            ("threads=0", "threads"),
            ("bdi_max_ratio=101", "bdi_max_ratio"),
            ("bdi_max_ratio", "bdi_max_ratio"),
            ("log", "log"),
            ("log=", "log"),
            ("mb_prefetch=0", "mb_prefetch"),
            ("mb_prefetch_limit", "mb_prefetch_limit"),
            ("prefetch_block_bitmaps=1", "prefetch_block_bitmaps"),
        ] {
            let e = parse_options(s).expect_err(s);
            assert!(e.contains(needle), "{s}: {e}");
        }
    }

    #[test]
    fn second_exclusive_lock_is_refused() {
        let dir = rext4_testkit::TempDir::new("fuselock").expect("tempdir");
        let p = dir.join("img");
        std::fs::write(&p, b"x").expect("write");
        let a = lock_image(&p, true).expect("first lock");
        let e = lock_image(&p, true).expect_err("second lock");
        assert!(e.contains("in use"), "{e}");
        let e = lock_image(&p, false).expect_err("shared while exclusive");
        assert!(e.contains("in use"), "{e}");
        drop(a);
        let _s1 = lock_image(&p, false).expect("shared");
        let _s2 = lock_image(&p, false).expect("second shared");
        assert!(lock_image(&p, true).is_err());
    }
}
