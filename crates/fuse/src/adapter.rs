//! The `fuser::Filesystem` implementation: FUSE requests in, engine calls out.
//!
//! Owns: the FUSE inode-number mapping (FUSE's root is 1, ext4's is 2; every other
//! number is the ext4 inode number), the kernel's lookup counts, the open-handle table,
//! directory snapshots for readdir, and the translation of engine errors to errno.
//!
//! Must hold:
//! - Lookup counts (FUSE-NOTES pitfall 1): every successful LOOKUP/CREATE/MKNOD/MKDIR/
//!   SYMLINK/LINK reply and every READDIRPLUS entry other than "." and ".." adds one;
//!   FORGET/BATCH_FORGET subtract. The first reference pins the inode in the engine
//!   (`Fs::pin`), the count reaching 0 unpins it, so an unlinked inode the kernel still
//!   knows stays valid (an orphan) until the kernel forgets it. Open file handles hold
//!   their own pin. Whatever is left at unmount is released by [`Shared::release_all`].
//! - Reads and writes go by inode number, never by handle: with the writeback cache the
//!   kernel sends WRITEs (and read-modify-write READs) on any handle, even after close.
//! - Readdir offsets are indices into a snapshot of the directory taken at opendir (and
//!   refreshed when a reader starts again at offset 0), "." and ".." first: stable for
//!   the life of a handle.
//! - Every request gets exactly one reply.
//! - Atime is ours (the kernel never updates it on a FUSE inode): READ, READDIR(PLUS),
//!   READLINK and an OPEN for reading apply the mount's policy before their reply
//!   (`Shared::accessed`, which says why OPEN counts as the read).
//!
//! Concurrency: fuser calls these methods from several worker threads at once. The
//! engine serializes its own changes (its write lock) and reads without locks; the
//! maps here are behind short-lived mutexes that are never held across engine calls
//! except `lookups`, held while pinning (a map update plus the engine's pin counter).

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BsdFileFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType,
    Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner,
    OpenAccMode, OpenFlags, RenameFlags as FuseRenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyStatx, ReplyWrite, ReplyXattr, Request, StatxAttr, StatxAttributes,
    StatxMask, TimeOrNow, WriteFlags,
};
use rext4::format::acl;
use rext4::format::inode::Inode;
use rext4::format::superblock::feature;
use rext4::{
    Creds, Error, FallocMode, Fs, Ino, RenameFlags, SetAttr, Timestamp, Whence, XattrFlags,
};

use crate::lowspace::Gate;

/// How long the kernel may trust attributes and entries we return. Nothing changes
/// the image behind this mount's back (it holds the image lock), and what the server
/// changes on its own (the mode after an ACL change or a set-ID drop) it invalidates
/// with a notification, so the kernel may keep what it has: a short TTL would cost a
/// LOOKUP or GETATTR per path walk component and per stat after it expires
/// (FUSE-NOTES pitfall 6).
const TTL: Duration = Duration::from_secs(3600);
/// Largest READ/WRITE request we ask for (FUSE_MAX_PAGES; the kernel's limit here is
/// 256 pages).
pub(crate) const MAX_IO: u32 = 1 << 20;

const S_IFMT: u16 = 0o170_000;
const S_ISGID: u32 = 0o2000;
const XATTR_CREATE: i32 = 1;
const XATTR_REPLACE: i32 = 2;
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;
const FALLOC_FL_COLLAPSE_RANGE: i32 = 0x08;
const FALLOC_FL_INSERT_RANGE: i32 = 0x20;
const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
/// FITRIM, `_IOWR('X', 121, struct fstrim_range)`: `fstrim MNT` (on the directory).
const FITRIM: u32 = 0xC018_5879;
const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;
/// (inode flag, FS_XFLAG_*) pairs that the xflags form of the flag ioctls carries.
const XFLAGS: [(u32, u32); 7] = {
    use rext4::format::inode::flags as f;
    [
        (f::SYNC, 0x20),
        (f::IMMUTABLE, 0x8),
        (f::APPEND, 0x10),
        (f::NODUMP, 0x80),
        (f::NOATIME, 0x40),
        (f::PROJINHERIT, 0x200),
        (f::DAX, 0x8000),
    ]
};

/// The STATX_ATTR_* flags of ext4 inode flags `flags`, and the mask of those ext4
/// reports at all (what ext4_getattr fills in).
fn statx_attributes(flags: u32) -> (u64, u64) {
    use rext4::format::inode::flags as f;
    const TABLE: [(u32, u64); 6] = [
        (f::COMPR, 0x4),        // STATX_ATTR_COMPRESSED
        (f::IMMUTABLE, 0x10),   // STATX_ATTR_IMMUTABLE
        (f::APPEND, 0x20),      // STATX_ATTR_APPEND
        (f::NODUMP, 0x40),      // STATX_ATTR_NODUMP
        (f::ENCRYPT, 0x800),    // STATX_ATTR_ENCRYPTED
        (f::VERITY, 0x10_0000), // STATX_ATTR_VERITY
    ];
    TABLE.iter().fold((0, 0), |(a, m), &(fl, x)| {
        (if flags & fl != 0 { a | x } else { a }, m | x)
    })
}

/// Whether `handles` has a file handle of `ino`.
fn has_file(handles: &HashMap<u64, Handle>, ino: Ino) -> bool {
    handles
        .values()
        .any(|h| matches!(h, Handle::File { ino: i, .. } if *i == ino))
}

fn xflags_of(flags: u32) -> u32 {
    XFLAGS
        .iter()
        .filter(|(f, _)| flags & f != 0)
        .fold(0, |x, (_, xf)| x | xf)
}

/// The inode flags `cur` with those the xflags form carries taken from `x`.
fn flags_from_xflags(cur: u32, x: u32) -> u32 {
    XFLAGS.iter().fold(
        cur,
        |f, &(fl, xf)| {
            if x & xf != 0 {
                f | fl
            } else {
                f & !fl
            }
        },
    )
}

/// The kernel page size assumed when rounding offsets for page-cache notifications.
const PAGE: u64 = 4096;
const SEEK_DATA: i32 = 3;
const SEEK_HOLE: i32 = 4;

/// What the adapter needs from the mount options.
#[derive(Debug, Clone)]
pub(crate) struct AdapterConfig {
    pub(crate) writeback_cache: bool,
    pub(crate) default_permissions: bool,
    /// errors=remount-ro: after an I/O or corruption error, refuse further changes.
    pub(crate) remount_ro_on_error: bool,
    pub(crate) debug: bool,
}

/// One open file or directory.
enum Handle {
    /// `direct`: opened with O_DIRECT (reads and writes around the page cache).
    /// `cached_write`: open for writing through the kernel's page cache (neither
    /// O_DIRECT nor opened while space was low, `lowspace`).
    File {
        ino: Ino,
        append: bool,
        direct: bool,
        cached_write: bool,
    },
    Dir(Arc<Mutex<DirSnap>>),
}

/// A directory's entries as of opendir (or the last rewind): "." and ".." first.
struct DirSnap {
    entries: Vec<(Vec<u8>, Ino, Option<FileType>)>,
}

/// State shared by the worker threads and by `mount` (which releases what is left
/// after the session ends).
pub(crate) struct Shared {
    pub(crate) fs: Fs,
    cfg: AdapterConfig,
    /// Kernel lookup count per inode (root excluded: the kernel never forgets it).
    lookups: Mutex<HashMap<Ino, u64>>,
    handles: Mutex<HashMap<u64, Handle>>,
    /// Signalled after a RELEASE while a SETATTR waits for one (`await_release`).
    released: std::sync::Condvar,
    /// How many SETATTRs wait on `released`.
    release_waiters: AtomicU64,
    next_fh: AtomicU64,
    huge_file: bool,
    block_size: u32,
    /// The image has casefolded directories (`entry_ttl`).
    casefold: bool,
    /// errors=remount-ro latched.
    latched_ro: AtomicBool,
    /// Whether the kernel accepted FUSE_WRITEBACK_CACHE.
    writeback: AtomicBool,
    /// Whether the kernel accepted FUSE_HANDLE_KILLPRIV_V2: dropping set-ID bits and
    /// file capabilities on write, truncate and chown is then ours to do.
    killpriv: AtomicBool,
    /// Sends invalidations and epoch bumps to the kernel (set once the session exists).
    pub(crate) notifier: std::sync::OnceLock<fuser::Notifier>,
    /// Regular files of which the kernel may still hold what the image does not (an
    /// unclamped mtime, see `setattr`; a size past ext4's limit, see `write`) because
    /// an open descriptor kept its inode alive when the epoch was bumped: bumped again
    /// when the last of their handles is released.
    stale_times: Mutex<HashSet<Ino>>,
    /// Whether `stale_times` may be non-empty (spares RELEASE the lock).
    stale_any: AtomicBool,
    /// Free space under the writeback cache (see `lowspace`).
    pub(crate) lowspace: crate::lowspace::LowSpace,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A cached WRITE being answered: when dropped (after the engine took the data or
/// refused it), the kernel no longer holds those pages (`LowSpace::arrived`).
struct Arrival<'a> {
    s: &'a Shared,
    offset: u64,
    len: u64,
}

impl Drop for Arrival<'_> {
    fn drop(&mut self) {
        self.s.lowspace.arrived(&self.s.fs, self.offset, self.len);
    }
}

/// FUSE node id -> ext4 inode number.
fn to_ext4(n: INodeNo) -> Ino {
    match n.0 {
        1 => Ino::ROOT,
        // 0 is never a valid inode; the engine rejects it.
        x => Ino(u32::try_from(x).unwrap_or(0)),
    }
}

/// ext4 inode number -> FUSE node id.
fn to_fuse(i: Ino) -> INodeNo {
    if i == Ino::ROOT {
        INodeNo(1)
    } else {
        INodeNo(u64::from(i.0))
    }
}

fn kind_of(mode: u16) -> Option<FileType> {
    Some(match mode & S_IFMT {
        0o100_000 => FileType::RegularFile,
        0o040_000 => FileType::Directory,
        0o120_000 => FileType::Symlink,
        0o020_000 => FileType::CharDevice,
        0o060_000 => FileType::BlockDevice,
        0o010_000 => FileType::NamedPipe,
        0o140_000 => FileType::Socket,
        _ => return None,
    })
}

fn kind_of_entry(t: rext4::FileType) -> Option<FileType> {
    use rext4::FileType as T;
    Some(match t {
        T::File => FileType::RegularFile,
        T::Dir => FileType::Directory,
        T::Symlink => FileType::Symlink,
        T::CharDevice => FileType::CharDevice,
        T::BlockDevice => FileType::BlockDevice,
        T::Fifo => FileType::NamedPipe,
        T::Socket => FileType::Socket,
        T::Unknown => return None,
    })
}

pub(crate) fn system_time(t: Timestamp) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec.min(999_999_999))
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs())
            + Duration::from_nanos(u64::from(t.nsec.min(999_999_999)))
    }
}

pub(crate) fn timestamp(t: SystemTime) -> Timestamp {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            if d.subsec_nanos() == 0 {
                Timestamp {
                    sec: -(d.as_secs() as i64),
                    nsec: 0,
                }
            } else {
                Timestamp {
                    sec: -(d.as_secs() as i64) - 1,
                    nsec: 1_000_000_000 - d.subsec_nanos(),
                }
            }
        }
    }
}

/// A SETATTR time as the caller meant it. fuser 0.18 turns a wire time before the
/// epoch, (sec < 0, nsec), into `EPOCH - Duration(-sec, nsec)` (its own TODO notes the
/// missing `1e9 - nsec`), so the wire value is recovered here rather than converted.
fn time_or_now(t: TimeOrNow) -> Timestamp {
    match t {
        TimeOrNow::SpecificTime(t) => match UNIX_EPOCH.duration_since(t) {
            Ok(d) if !d.is_zero() => Timestamp {
                sec: -(d.as_secs() as i64),
                nsec: d.subsec_nanos(),
            },
            _ => timestamp(t),
        },
        TimeOrNow::Now => timestamp(SystemTime::now()),
    }
}

/// Linux's `new_encode_dev`, the dev_t encoding FUSE attributes carry.
fn encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

fn decode_dev(dev: u32) -> (u32, u32) {
    ((dev & 0xfff00) >> 8, (dev & 0xff) | ((dev >> 12) & 0xfff00))
}

fn errno(e: &Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// The supplementary groups of process `pid` (from /proc; none if it is gone).
fn supplementary_groups(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("Groups:").map(|g| {
                    g.split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect()
                })
            })
        })
        .unwrap_or_default()
}

fn name_bytes(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

impl Shared {
    pub(crate) fn new(fs: Fs, cfg: AdapterConfig) -> Shared {
        let sb = fs.superblock();
        Shared {
            huge_file: sb.has_ro_compat(feature::RO_COMPAT_HUGE_FILE),
            block_size: fs.block_size(),
            casefold: fs.superblock().has_incompat(feature::INCOMPAT_CASEFOLD),
            fs,
            cfg,
            lookups: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            released: std::sync::Condvar::new(),
            release_waiters: AtomicU64::new(0),
            next_fh: AtomicU64::new(1),
            latched_ro: AtomicBool::new(false),
            writeback: AtomicBool::new(false),
            killpriv: AtomicBool::new(false),
            notifier: std::sync::OnceLock::new(),
            stale_times: Mutex::new(HashSet::new()),
            stale_any: AtomicBool::new(false),
            lowspace: crate::lowspace::LowSpace::default(),
        }
    }

    /// Make the kernel look every name up again before using its cached dentry
    /// (FUSE_NOTIFY_INC_EPOCH, Linux 6.16+): a dentry older than the new epoch fails
    /// revalidation, and an inode no dentry or open file holds is then dropped, so the
    /// next lookup builds it from our attributes. It takes no lock in the kernel, so a
    /// request handler may send it. False when the kernel refused (older kernels: EINVAL;
    /// protocol before 7.44: ENOTSUP) or there is no session.
    fn bump_epoch(&self) -> bool {
        self.notifier.get().is_some_and(|n| n.inc_epoch().is_ok())
    }

    /// Tell the kernel to drop its cached attributes of `ino` (after a change it cannot
    /// see, such as an ACL that changed the mode: with the writeback cache the kernel
    /// would otherwise keep its copy). Sent from another thread so no request handler
    /// waits on the kernel.
    fn invalidate_attrs(&self, ino: Ino) {
        if let Some(n) = self.notifier.get() {
            let n = n.clone();
            let _ = std::thread::Builder::new()
                .name("rext4-inval".into())
                .spawn(move || {
                    let _ = n.inval_inode(to_fuse(ino), 0, 0);
                });
        }
    }

    /// `ino` was read (file data, a directory listing, a symlink's target): apply the
    /// mount's atime policy. The kernel never updates the atime of a FUSE inode
    /// (S_NOATIME), so the server does, on the requests it sees; an OPEN for reading
    /// counts as the read, since the kernel may then serve all of it from its page
    /// cache (see `open`). Called before the
    /// reply, so a stat after it cannot fetch the old atime. After READ, READDIR and
    /// READLINK the kernel marks its cached atime stale by itself
    /// (fuse_invalidate_atime); after OPEN it does not, so `notify` sends an
    /// attribute invalidation then. Never on a read-only mount (the engine checks)
    /// or once errors=remount-ro has latched.
    fn accessed(&self, ino: Ino, notify: bool) {
        if self.writable().is_err() {
            return;
        }
        match self.fs.touch_atime_ino(ino) {
            Ok(true) if notify => self.invalidate_attrs_only(ino),
            Ok(_) => {}
            Err(e) => {
                self.fail("atime update", &e);
            }
        }
    }

    /// Make the kernel fetch the attributes of `ino` again, keeping its cached pages.
    /// Sent from the request handler itself: with offset -1 the kernel's handler
    /// (fuse_reverse_inval_inode) only marks the attributes stale and touches no page
    /// and no inode lock, so nothing in it waits for a reply from this server.
    pub(crate) fn invalidate_attrs_only(&self, ino: Ino) {
        if let Some(n) = self.notifier.get() {
            let _ = n.inval_inode(to_fuse(ino), -1, 0);
        }
    }

    /// The server changed attributes of `ino` (its ctime, at least) by a request after
    /// which the kernel updates nothing of its own (the inode-flag ioctls): before the
    /// reply, make the kernel fetch them again. Under the writeback cache the kernel
    /// keeps its own ctime (and mtime, size) of a regular file and never takes the
    /// server's, so that inode is dropped instead (`drop_kernel_inode`: at once if
    /// nothing holds it, else when its last handle is released — the ioctl's own).
    fn attrs_changed(&self, ino: Ino) {
        self.invalidate_attrs_only(ino);
        if self.writeback.load(Ordering::Relaxed)
            && self
                .load(ino)
                .is_ok_and(|i| kind_of(i.mode) == Some(FileType::RegularFile))
        {
            self.drop_kernel_inode(ino);
        }
    }

    /// The kernel's inode of regular file `ino` holds what the image does not (with
    /// the writeback cache it keeps its own size and mtime and never takes ours): bump
    /// the epoch so that it is dropped and read again, and when a handle keeps it
    /// alive, again at the last release. Returns whether the kernel took the bump.
    fn drop_kernel_inode(&self, ino: Ino) -> bool {
        let bumped = self.bump_epoch();
        if bumped && self.has_open_file(ino) {
            lock(&self.stale_times).insert(ino);
            self.stale_any.store(true, Ordering::SeqCst);
        }
        bumped
    }

    /// Whether a file handle of `ino` is open.
    fn has_open_file(&self, ino: Ino) -> bool {
        has_file(&lock(&self.handles), ino)
    }

    /// A direct write of `ino` that grew the file to `end` failed part way: give the
    /// size back to `before` (and the blocks past it), unless another write moved it
    /// meanwhile. The kernel extends a file by direct writes one at a time.
    fn undo_growth(&self, ino: Ino, before: Option<u64>, end: u64) {
        let Some(before) = before else { return };
        let grew = self
            .fs
            .inode_attr(ino)
            .is_ok_and(|i| i.size == end && end > before);
        if grew {
            if let Err(e) = self.fs.truncate_ino(ino, before) {
                self.fail("undo a failed direct write", &e);
            }
        }
    }

    /// Before making the kernel drop its inode of `ino`: a handle we still have may be
    /// one the application already closed, whose RELEASE is on its way — the kernel
    /// holds the inode until that RELEASE is answered, and a lookup meanwhile would
    /// find the old inode again. Wait a little for such releases (`STALE_WAIT`); a
    /// handle that stays open keeps the kernel's inode until it is closed
    /// (`stale_times`).
    fn await_release(&self, ino: Ino) {
        const STALE_WAIT: Duration = Duration::from_millis(50);
        let handles = lock(&self.handles);
        if !has_file(&handles, ino) {
            return;
        }
        // Counted under the handles lock, which RELEASE takes before it signals.
        self.release_waiters.fetch_add(1, Ordering::SeqCst);
        let _ = self
            .released
            .wait_timeout_while(handles, STALE_WAIT, |h| has_file(h, ino));
        self.release_waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// After a handle of `ino` is released: when it was the last one and the kernel
    /// may hold an unclamped mtime or an impossible size of `ino`, bump the epoch
    /// again so that the inode, now held by dentries alone, is dropped at the next
    /// lookup.
    fn release_stale_time(&self, ino: Ino) {
        if !self.stale_any.load(Ordering::Relaxed) {
            return;
        }
        if !lock(&self.stale_times).contains(&ino) {
            return;
        }
        if !self.has_open_file(ino) && lock(&self.stale_times).remove(&ino) {
            self.bump_epoch();
        }
    }

    fn debug(&self, f: impl FnOnce() -> String) {
        if self.cfg.debug {
            log::debug!("{}", f());
        }
    }

    /// The errno for an engine error; latches errors=remount-ro on I/O and corruption.
    fn fail(&self, what: &str, e: &Error) -> Errno {
        self.fs.note_error(e);
        if matches!(e, Error::NoSpace) && self.fs.held_for_client() > 0 {
            // Refused beside space held for the kernel's cache, which is a bound:
            // have what it holds counted again.
            self.lowspace.blocked();
        }
        if self.cfg.remount_ro_on_error
            && matches!(
                e,
                Error::Io(_) | Error::Corrupted { .. } | Error::ShutDown(_)
            )
            && !self.latched_ro.swap(true, Ordering::SeqCst)
        {
            log::error!("{what}: {e}; errors=remount-ro: refusing further changes");
        }
        if self.cfg.debug || matches!(e, Error::Io(_) | Error::Corrupted { .. }) {
            log::warn!("{what}: {e}");
        }
        errno(e)
    }

    /// Remove security.capability (KILLPRIV_V2: with the set-ID bits it guards).
    fn drop_caps(&self, ino: Ino) -> Result<(), Errno> {
        match self.fs.remove_xattr_ino(ino, b"security.capability") {
            Ok(()) | Err(Error::NotFound) => Ok(()),
            Err(e) => Err(self.fail("drop capabilities", &e)),
        }
    }

    /// Refuse changes once errors=remount-ro has latched.
    fn writable(&self) -> Result<(), Errno> {
        if self.latched_ro.load(Ordering::SeqCst) {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    /// The inode record as it is now, whatever its link count (an orphan the kernel
    /// still holds is served like any other inode). A freed record is ENOENT.
    fn load(&self, ino: Ino) -> Result<Inode, Errno> {
        if ino.0 < 2 {
            return Err(Errno::ENOENT);
        }
        let i = self
            .fs
            .inode_attr(ino)
            .map_err(|e| self.fail("read inode", &e))?;
        if i.mode == 0 {
            return Err(Errno::ENOENT);
        }
        Ok(i)
    }

    fn attr_of(&self, ino: Ino, i: &Inode) -> Result<FileAttr, Errno> {
        let kind = kind_of(i.mode).ok_or_else(|| {
            log::error!("inode {} has an unknown file type", ino.0);
            Errno::EIO
        })?;
        let rdev = match kind {
            FileType::CharDevice | FileType::BlockDevice => {
                let (ma, mi) = i.device();
                encode_dev(ma, mi)
            }
            _ => 0,
        };
        Ok(FileAttr {
            ino: to_fuse(ino),
            size: i.size,
            blocks: i.blocks_512(self.huge_file, self.block_size)
                + self.fs.delalloc_blocks_512(ino),
            atime: system_time(i.atime),
            mtime: system_time(i.mtime),
            ctime: system_time(i.ctime),
            crtime: i.crtime.map_or(UNIX_EPOCH, system_time),
            kind,
            perm: i.mode & 0o7777,
            nlink: u32::from(i.links_count),
            uid: i.uid,
            gid: i.gid,
            rdev,
            blksize: self.block_size,
            flags: 0,
        })
    }

    fn getattr_ino(&self, ino: Ino) -> Result<FileAttr, Errno> {
        let i = self.load(ino)?;
        self.attr_of(ino, &i)
    }

    /// Add `n` kernel references to `ino`, pinning it on the first.
    fn add_lookup(&self, ino: Ino, n: u64) {
        if ino == Ino::ROOT || n == 0 {
            return;
        }
        let mut l = lock(&self.lookups);
        let c = l.entry(ino).or_insert(0);
        if *c == 0 {
            self.fs.pin(ino);
        }
        *c += n;
    }

    /// Drop `n` kernel references; the last one unpins (and may free an orphan).
    fn forget_ino(&self, ino: Ino, n: u64) {
        if ino == Ino::ROOT {
            return;
        }
        let last = {
            let mut l = lock(&self.lookups);
            match l.get_mut(&ino) {
                Some(c) if *c > n => {
                    *c -= n;
                    false
                }
                Some(_) => {
                    l.remove(&ino);
                    true
                }
                None => false,
            }
        };
        if last {
            if self.stale_any.load(Ordering::Relaxed) {
                lock(&self.stale_times).remove(&ino);
            }
            if let Err(e) = self.fs.unpin(ino) {
                self.fail("forget", &e);
            }
        }
    }

    /// Reply material for a new kernel reference to `ino` (counted here).
    fn entry(&self, ino: Ino) -> Result<(FileAttr, Generation), Errno> {
        if ino.0 < 2 {
            return Err(Errno::EIO);
        }
        self.add_lookup(ino, 1);
        let r = self.load(ino).and_then(|i| {
            let a = self.attr_of(ino, &i)?;
            Ok((a, Generation(u64::from(i.generation))))
        });
        if r.is_err() {
            self.forget_ino(ino, 1);
        }
        r
    }

    fn new_fh(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, h);
        fh
    }

    /// Owner and group for a new inode in `parent` (a set-group-ID directory passes
    /// its group on, and its set-group-ID bit to new directories).
    fn new_owner(&self, req: &Request, parent: Ino) -> Result<(u32, u32, bool), Errno> {
        let p = self.load(parent)?;
        if u32::from(p.mode) & S_ISGID != 0 {
            Ok((req.uid(), p.gid, true))
        } else {
            Ok((req.uid(), req.gid(), false))
        }
    }

    /// The mode a new inode gets: the umask applies unless the parent has a default
    /// ACL (the kernel leaves both to us under POSIX_ACL and DONT_MASK).
    fn new_mode(&self, parent: Ino, mode: u32, umask: u32) -> Result<u32, Errno> {
        self.fs
            .create_mode(parent, mode, umask)
            .map_err(|e| self.fail("create mode", &e))
    }

    /// For a new inode in `parent` asked with `mode` and `umask`: the mount must be
    /// writable; then its owner, group, whether the parent passes set-group-ID on, and
    /// its mode.
    fn new_inode_args(
        &self,
        req: &Request,
        parent: Ino,
        mode: u32,
        umask: u32,
    ) -> Result<(u32, u32, bool, u32), Errno> {
        self.writable()?;
        let (uid, gid, sgid) = self.new_owner(req, parent)?;
        Ok((uid, gid, sgid, self.new_mode(parent, mode, umask)?))
    }

    /// Undo `open_file` whose reply cannot be sent: drop handle `fh` and its pin.
    fn undo_open(&self, fh: u64) {
        let h = lock(&self.handles).remove(&fh);
        if let Some(Handle::File {
            ino, cached_write, ..
        }) = h
        {
            if cached_write {
                self.lowspace.released(&self.fs);
            }
            let _ = self.fs.unpin(ino);
        }
    }

    /// Open `ino` for I/O: pin it and make a handle.
    fn open_file(&self, ino: Ino, flags: i32) -> Result<(u64, FopenFlags), Errno> {
        let i = self.load(ino)?;
        let write = matches!(
            OpenFlags(flags).acc_mode(),
            OpenAccMode::O_WRONLY | OpenAccMode::O_RDWR
        );
        if write {
            self.writable()?;
            if kind_of(i.mode) == Some(FileType::Directory) {
                return Err(Errno::EISDIR);
            }
        }
        // Immutable and append-only: the kernel cannot see these flags on a FUSE inode.
        let trunc = flags & libc::O_TRUNC != 0 && write;
        self.fs
            .may_open_ino(ino, write, flags & libc::O_APPEND != 0, trunc)
            .map_err(|e| self.fail("open", &e))?;
        if trunc && kind_of(i.mode) == Some(FileType::RegularFile) {
            self.fs
                .truncate_ino(ino, 0)
                .map_err(|e| self.fail("open O_TRUNC", &e))?;
        }
        self.fs.pin(ino);
        let direct = flags & libc::O_DIRECT != 0;
        let append = flags & libc::O_APPEND != 0;
        let handle = |cached_write| Handle::File {
            ino,
            append,
            direct,
            cached_write,
        };
        // A file opened for writing through the kernel's cache has the window the
        // kernel may fill held back for it; while space is low it gets no write cache
        // instead: each write() is a WRITE, answered (ENOSPC included) before write()
        // returns (`lowspace`).
        let (fh, write_through) = if write
            && !direct
            && self.writeback.load(Ordering::Relaxed)
            && kind_of(i.mode) == Some(FileType::RegularFile)
        {
            self.lowspace
                .open_for_writing(&self.fs, |cached| (self.new_fh(handle(cached)), !cached))
        } else {
            (self.new_fh(handle(false)), false)
        };
        if write && !write_through && !direct && self.lowspace.gated() {
            // The kernel may hold attributes of the file from before writes were gated:
            // its first write() must ask too.
            self.invalidate_attrs_only(ino);
        }
        let fl = if direct {
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
        } else if write_through {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            // Every change goes through this mount, so cached pages stay valid.
            FopenFlags::FOPEN_KEEP_CACHE
        };
        Ok((fh, fl))
    }

    fn snapshot(&self, ino: Ino) -> Result<DirSnap, Errno> {
        let list = self
            .fs
            .read_dir_ino(ino)
            .map_err(|e| self.fail("readdir", &e))?;
        let parent = match self.fs.lookup(ino, b"..") {
            Ok(Some(e)) if e.ino.0 >= 2 => e.ino,
            _ => ino,
        };
        let mut entries = Vec::with_capacity(list.len() + 2);
        entries.push((b".".to_vec(), ino, Some(FileType::Directory)));
        entries.push((b"..".to_vec(), parent, Some(FileType::Directory)));
        for e in list {
            // Inode 1 (bad blocks) would alias FUSE's root id; never expose it.
            if e.ino.0 < 2 {
                continue;
            }
            let k = kind_of_entry(e.file_type);
            entries.push((e.name, e.ino, k));
        }
        Ok(DirSnap { entries })
    }

    fn dir_handle(&self, fh: FileHandle) -> Option<Arc<Mutex<DirSnap>>> {
        match lock(&self.handles).get(&fh.0) {
            Some(Handle::Dir(d)) => Some(d.clone()),
            _ => None,
        }
    }

    /// The snapshot for a readdir at `offset`: the handle's, refreshed at offset 0, or
    /// a fresh one when the handle is unknown.
    fn dir_for(&self, ino: Ino, fh: FileHandle, offset: u64) -> Result<Arc<Mutex<DirSnap>>, Errno> {
        match self.dir_handle(fh) {
            Some(d) => {
                if offset == 0 {
                    let fresh = self.snapshot(ino)?;
                    *lock(&d) = fresh;
                }
                Ok(d)
            }
            None => Ok(Arc::new(Mutex::new(self.snapshot(ino)?))),
        }
    }

    /// Release every pin this session still holds (lookup counts the kernel never
    /// forgot, handles never released): called after the session ends, before close.
    pub(crate) fn release_all(&self) {
        let handles: Vec<Handle> = lock(&self.handles).drain().map(|(_, h)| h).collect();
        for h in handles {
            if let Handle::File { ino, .. } = h {
                if let Err(e) = self.fs.unpin(ino) {
                    self.fail("release at unmount", &e);
                }
            }
        }
        let lookups: Vec<Ino> = lock(&self.lookups).drain().map(|(i, _)| i).collect();
        for ino in lookups {
            if let Err(e) = self.fs.unpin(ino) {
                self.fail("forget at unmount", &e);
            }
        }
    }

    /// SEEK_DATA / SEEK_HOLE (the engine counts dirty cached pages as data).
    fn seek(&self, ino: Ino, offset: u64, whence: i32) -> Result<u64, Errno> {
        let w = if whence == SEEK_DATA {
            Whence::Data
        } else {
            Whence::Hole
        };
        match self.fs.seek_ino(ino, offset, w) {
            Ok(Some(o)) => Ok(o),
            Ok(None) => Err(Errno::ENXIO),
            Err(e) => Err(self.fail("lseek", &e)),
        }
    }

    /// The handle's (direct, append) flags; a handle we do not know is neither.
    /// Whether `fh` is a descriptor that writes through the kernel's page cache.
    fn is_cached_writer(&self, fh: FileHandle) -> bool {
        matches!(
            lock(&self.handles).get(&fh.0),
            Some(Handle::File {
                cached_write: true,
                ..
            })
        )
    }

    /// Files some descriptor writes through the kernel's page cache.
    pub(crate) fn files_open_cached_for_writing(&self) -> Vec<Ino> {
        let mut v: Vec<Ino> = lock(&self.handles)
            .values()
            .filter_map(|h| match h {
                Handle::File {
                    ino,
                    cached_write: true,
                    ..
                } => Some(*ino),
                _ => None,
            })
            .collect();
        v.sort_unstable_by_key(|i| i.0);
        v.dedup();
        v
    }

    /// Whether a caller may use the root reserve, as ext4 decides it: root, the
    /// superblock's reserved uid, or its reserved gid (when that is not 0).
    pub(crate) fn privileged(&self, uid: u32, gid: u32) -> bool {
        let sb = self.fs.superblock();
        uid == 0
            || uid == u32::from(sb.def_resuid)
            || (sb.def_resgid != 0 && gid == u32::from(sb.def_resgid))
    }

    /// Bytes an unprivileged writer could still allocate (statfs's f_bavail).
    pub(crate) fn available_bytes(&self) -> u64 {
        self.fs.statfs().blocks_available * u64::from(self.block_size)
    }

    /// How long the kernel may keep `attr`: while space is low, a regular file's
    /// attributes not at all, so that every write() through the kernel's cache asks
    /// first (`lowspace`).
    fn ttl(&self, attr: &FileAttr) -> Duration {
        if attr.kind == FileType::RegularFile && self.lowspace.gated() {
            Duration::ZERO
        } else {
            TTL
        }
    }

    /// How long the kernel may keep an entry of directory `parent`: in a casefolded
    /// directory not at all. The kernel's dentry cache compares names byte for byte, so
    /// each case variant looked up becomes a dentry of its own; one kept after the name
    /// was unlinked or renamed through another variant would still answer.
    fn entry_ttl(&self, parent: Ino, attr: &FileAttr) -> Duration {
        let casefolded = self.casefold
            && self
                .fs
                .flags_ino(parent)
                .is_ok_and(|f| f & rext4::format::inode::flags::CASEFOLD != 0);
        if casefolded {
            Duration::ZERO
        } else {
            self.ttl(attr)
        }
    }

    /// Make the kernel write back its dirty pages of `ino` now and drop its cached
    /// pages (an invalidation launders dirty pages with synchronous WRITEs). Waits for
    /// those WRITEs: never call it from a request handler.
    /// Whether the kernel took the invalidation (an inode it no longer has counts).
    pub(crate) fn kernel_writeback(&self, ino: Ino) -> bool {
        self.notifier
            .get()
            .is_some_and(|n| n.inval_inode(to_fuse(ino), 0, 0).is_ok())
    }

    fn handle_flags(&self, fh: FileHandle) -> (bool, bool) {
        match lock(&self.handles).get(&fh.0) {
            Some(Handle::File { direct, append, .. }) => (*direct, *append),
            _ => (false, false),
        }
    }

    fn access_check(&self, req: &Request, ino: Ino, mask: AccessFlags) -> Result<(), Errno> {
        if self.cfg.default_permissions {
            // The kernel checked already (it does not even send ACCESS then).
            return Ok(());
        }
        let want = (mask.bits() & 7) as u16;
        if want == 0 {
            self.load(ino)?;
            return Ok(());
        }
        let creds = Creds::new(req.uid(), req.gid(), supplementary_groups(req.pid()));
        self.fs
            .permission_ino(ino, &creds, want)
            .map_err(|e| self.fail("access", &e))
    }
}

/// The FUSE filesystem: a handle on the shared state.
pub(crate) struct Adapter {
    pub(crate) s: Arc<Shared>,
}

macro_rules! tri {
    ($reply:ident, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => {
                $reply.error(err);
                return;
            }
        }
    };
}

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        let mut want = InitFlags::FUSE_ASYNC_READ
            | InitFlags::FUSE_BIG_WRITES
            | InitFlags::FUSE_MAX_PAGES
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_CACHE_SYMLINKS
            // A file opened with O_DIRECT (FOPEN_DIRECT_IO) may be mapped MAP_SHARED,
            // as on ext4: the kernel then writes back and invalidates the mapped
            // pages around each direct read and write, so the two stay coherent
            // (Linux 6.6+; without it such an mmap fails with ENODEV).
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP;
        if self.s.cfg.writeback_cache && !self.s.fs.is_read_only() {
            want |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        // The server drops set-ID bits and capabilities on write, truncate and chown
        // (the WRITE flag, and Linux's rules in setattr and open), so the kernel can
        // mark the superblock SB_NOSEC: without it every write() asks for the
        // security.capability xattr first, a second request per write.
        want |= InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        if self.s.cfg.default_permissions {
            // The kernel enforces ACLs (it reads system.posix_acl_* through getxattr)
            // and leaves the umask to us: the engine applies a parent's default ACL, and
            // the umask only where there is none (FUSE-NOTES: POSIX_ACL + DONT_MASK).
            want |= InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK;
        }
        let got = want & caps;
        if config.add_capabilities(got).is_err() {
            log::warn!("kernel refused capabilities {got:?}");
        }
        self.s.writeback.store(
            got.contains(InitFlags::FUSE_WRITEBACK_CACHE),
            Ordering::SeqCst,
        );
        self.s.killpriv.store(
            got.contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2),
            Ordering::SeqCst,
        );
        let _ = config.set_max_write(MAX_IO);
        if let Err(max) = config.set_max_readahead(MAX_IO) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        // ext4 keeps nanoseconds only in inodes larger than 128 bytes (like the
        // kernel's s_time_gran), so the kernel's cached times match what is stored.
        let gran = if self.s.fs.superblock().inode_size > 128 {
            Duration::from_nanos(1)
        } else {
            Duration::from_secs(1)
        };
        let _ = config.set_time_granularity(gran);
        self.s
            .debug(|| format!("init: kernel caps {caps:?}, using {got:?}"));
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let s = &self.s;
        let p = to_ext4(parent);
        s.debug(|| format!("lookup {} {name:?}", p.0));
        // From the name to a pinned inode under one grace guard, so the number the
        // lookup returns cannot be freed and handed to a new file before the pin.
        let _g = s.fs.read_guard();
        let e = tri!(
            reply,
            s.fs.lookup(p, name_bytes(name))
                .map_err(|e| s.fail("lookup", &e))
        );
        let Some(e) = e else {
            reply.error(Errno::ENOENT);
            return;
        };
        let (attr, generation) = tri!(reply, s.entry(e.ino));
        reply.entry(&s.entry_ttl(p, &attr), &attr, generation);
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.s.forget_ino(to_ext4(ino), nlookup);
    }

    // BATCH_FORGET: fuser's default calls `forget` per node (its ForgetOne type is
    // not exported, so it cannot be overridden).

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = &self.s;
        let ino = to_ext4(ino);
        // With a handle, under the writeback cache: the kernel refreshing size and
        // mode before a write() (or a read past its size, an lseek to the end) on a
        // descriptor that writes through its page cache, while the caller waits in
        // its system call. While space is low that is where a write() is admitted or
        // refused (`lowspace`): admitted when the space left covers what the call
        // writes beside what the kernel's cache may still hand over (an overwrite
        // counts too: the server cannot tell it from an extending write here).
        // A gate that must wait for what is owed to arrive waits on a thread of its
        // own: the request threads serve the WRITEs it waits for.
        if let Some(fh) = fh.filter(|_| s.lowspace.gated()) {
            if s.is_cached_writer(fh) {
                let privileged = s.privileged(req.uid(), req.gid());
                let tid = req.pid();
                match s.lowspace.admit(&s.fs, tid, privileged, false) {
                    Gate::Admitted => {}
                    Gate::Refused => {
                        reply.error(Errno::ENOSPC);
                        return;
                    }
                    Gate::Wait => {
                        if !s.lowspace.gate_slot() {
                            reply.error(Errno::ENOSPC);
                            return;
                        }
                        let s2 = Arc::clone(s);
                        // Kept here until the thread has it: a failed spawn leaves it
                        // to be answered on this thread.
                        let slot = Arc::new(Mutex::new(Some(reply)));
                        let theirs = Arc::clone(&slot);
                        let spawned = std::thread::Builder::new().name("rext4-gate".into()).spawn(
                            move || {
                                if let Some(reply) = lock(&theirs).take() {
                                    let s = &s2;
                                    if s.lowspace.admit(&s.fs, tid, privileged, true)
                                        == Gate::Admitted
                                    {
                                        match s.getattr_ino(ino) {
                                            Ok(attr) => reply.attr(&s.ttl(&attr), &attr),
                                            Err(e) => reply.error(e),
                                        }
                                    } else {
                                        reply.error(Errno::ENOSPC);
                                    }
                                }
                                s2.lowspace.gate_done();
                            },
                        );
                        if spawned.is_err() {
                            s.lowspace.gate_done();
                            if let Some(reply) = lock(&slot).take() {
                                reply.error(Errno::ENOSPC);
                            }
                        }
                        return;
                    }
                }
            }
        }
        let attr = tri!(reply, s.getattr_ino(ino));
        reply.attr(&s.ttl(&attr), &attr);
    }

    /// statx with the birth time (ext4's i_crtime, kept by inodes larger than 128
    /// bytes) and the STATX_ATTR_* flags ext4 reports.
    fn statx(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: Option<FileHandle>,
        _flags: u32,
        _mask: StatxMask,
        reply: ReplyStatx,
    ) {
        let s = &self.s;
        let e = to_ext4(ino);
        let i = tri!(reply, s.load(e));
        let attr = tri!(reply, s.attr_of(e, &i));
        let (attributes, mask) = statx_attributes(i.flags);
        reply.statx(
            &s.ttl(&attr),
            &StatxAttr {
                attr,
                btime: i.crtime.map(system_time),
                attributes: StatxAttributes::from_bits_retain(attributes),
                attributes_mask: StatxAttributes::from_bits_retain(mask),
            },
        );
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let s = &self.s;
        let ino = to_ext4(ino);
        s.debug(|| {
            format!(
                "setattr {} mode {mode:?} uid {uid:?} gid {gid:?} size {size:?} \
                 atime {atime:?} mtime {mtime:?} ctime {ctime:?}",
                ino.0
            )
        });
        let mut a = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(time_or_now),
            mtime: mtime.map(time_or_now),
            ctime: ctime.map(timestamp),
        };
        // KILLPRIV_V2: the kernel no longer sends the mode change that drops set-ID
        // bits on chown (any caller) and on truncate (unprivileged callers); its
        // FATTR_KILL_SUIDGID flag is not passed on by fuser, so apply Linux's rules.
        let chown = uid.is_some() || gid.is_some();
        let trunc = size.is_some() && req.uid() != 0;
        let mut drop_caps = false;
        if s.killpriv.load(Ordering::Relaxed) && a.mode.is_none() && (chown || trunc) {
            a.mode = tri!(
                reply,
                s.fs.mode_without_privs(ino)
                    .map_err(|e| s.fail("setattr", &e))
            );
            drop_caps = true;
        }
        let any = a.mode.is_some()
            || a.uid.is_some()
            || a.gid.is_some()
            || a.size.is_some()
            || a.atime.is_some()
            || a.mtime.is_some()
            || a.ctime.is_some();
        if any {
            tri!(reply, s.writable());
            // Explicit times on an append-only file are refused (ext4's ATTR_TIMES_SET
            // rule), but the engine must take the kernel's own flush of an appending
            // file's mtime/ctime, which comes as explicit times too. That flush never
            // carries atime, so an explicit atime marks the caller's utimensat.
            if matches!(atime, Some(TimeOrNow::SpecificTime(_))) {
                let f = tri!(
                    reply,
                    s.fs.flags_ino(ino).map_err(|e| s.fail("setattr", &e))
                );
                if f & rext4::format::inode::flags::APPEND != 0 {
                    reply.error(Errno::EPERM);
                    return;
                }
            }
            tri!(
                reply,
                s.fs.setattr_ino(ino, &a).map_err(|e| s.fail("setattr", &e))
            );
            if drop_caps {
                tri!(reply, s.drop_caps(ino));
            }
        }
        let attr = tri!(reply, s.getattr_ino(ino));
        // With the writeback cache the kernel keeps the mtime it sent for a regular
        // file and never takes ours, and the FUSE superblock has no time limits: a time
        // ext4 cannot hold (before 1901, after 2446) would stay unclamped in the
        // kernel's inode. When the stored time differs from the one asked for, make
        // the kernel drop that inode (once the caller lets go of it) and read ours.
        if s.writeback.load(Ordering::Relaxed)
            && attr.kind == FileType::RegularFile
            && a.mtime.is_some_and(|m| m != timestamp(attr.mtime))
        {
            s.await_release(ino);
            let bumped = s.drop_kernel_inode(ino);
            s.debug(|| format!("setattr {}: mtime clamped, epoch bumped: {bumped}", ino.0));
        }
        reply.attr(&s.ttl(&attr), &attr);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let s = &self.s;
        let ino = to_ext4(ino);
        let t = tri!(
            reply,
            s.fs.read_link_ino(ino).map_err(|e| s.fail("readlink", &e))
        );
        s.accessed(ino, false);
        reply.data(&t);
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let s = &self.s;
        let p = to_ext4(parent);
        let (uid, gid, _, mode) = tri!(reply, s.new_inode_args(req, p, mode, umask));
        let ino = tri!(
            reply,
            s.fs.mknod_ino(p, name_bytes(name), mode, uid, gid, decode_dev(rdev))
                .map_err(|e| s.fail("mknod", &e))
        );
        let (attr, generation) = tri!(reply, s.entry(ino));
        reply.entry(&s.entry_ttl(p, &attr), &attr, generation);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let s = &self.s;
        let p = to_ext4(parent);
        let (uid, gid, sgid, mode) = tri!(reply, s.new_inode_args(req, p, mode, umask));
        let perm = (mode & 0o7777) | if sgid { S_ISGID } else { 0 };
        let ino = tri!(
            reply,
            s.fs.mkdir_ino(p, name_bytes(name), perm, uid, gid)
                .map_err(|e| s.fail("mkdir", &e))
        );
        let (attr, generation) = tri!(reply, s.entry(ino));
        reply.entry(&s.entry_ttl(p, &attr), &attr, generation);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let s = &self.s;
        tri!(reply, s.writable());
        tri!(
            reply,
            s.fs.unlink_ino(to_ext4(parent), name_bytes(name))
                .map_err(|e| s.fail("unlink", &e))
        );
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let s = &self.s;
        tri!(reply, s.writable());
        tri!(
            reply,
            s.fs.rmdir_ino(to_ext4(parent), name_bytes(name))
                .map_err(|e| s.fail("rmdir", &e))
        );
        reply.ok();
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let s = &self.s;
        let p = to_ext4(parent);
        tri!(reply, s.writable());
        let (uid, gid, _) = tri!(reply, s.new_owner(req, p));
        let ino = tri!(
            reply,
            s.fs.symlink_ino(
                p,
                name_bytes(link_name),
                target.as_os_str().as_bytes(),
                uid,
                gid
            )
            .map_err(|e| s.fail("symlink", &e))
        );
        let (attr, generation) = tri!(reply, s.entry(ino));
        reply.entry(&s.entry_ttl(p, &attr), &attr, generation);
    }

    /// rename and renameat2: RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT
    /// (overlayfs asks for it in an upper directory; the whiteout belongs to the
    /// caller, as a node it made with mknod would). The kernel has checked the caller
    /// may change both directories and refused WHITEOUT or NOREPLACE with EXCHANGE.
    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRenameFlags,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        let known = FuseRenameFlags::RENAME_NOREPLACE
            | FuseRenameFlags::RENAME_EXCHANGE
            | FuseRenameFlags::RENAME_WHITEOUT;
        if !(flags - known).is_empty() {
            reply.error(Errno::EINVAL);
            return;
        }
        tri!(reply, s.writable());
        let whiteout = if flags.contains(FuseRenameFlags::RENAME_WHITEOUT) {
            let (uid, gid, _) = tri!(reply, s.new_owner(req, to_ext4(parent)));
            Some((uid, gid))
        } else {
            None
        };
        let fl = RenameFlags {
            noreplace: flags.contains(FuseRenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(FuseRenameFlags::RENAME_EXCHANGE),
            whiteout,
        };
        tri!(
            reply,
            s.fs.rename_ino(
                to_ext4(parent),
                name_bytes(name),
                to_ext4(newparent),
                name_bytes(newname),
                fl
            )
            .map_err(|e| s.fail("rename", &e))
        );
        reply.ok();
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let s = &self.s;
        let ino = to_ext4(ino);
        tri!(reply, s.writable());
        tri!(
            reply,
            s.fs.link_ino(ino, to_ext4(newparent), name_bytes(newname))
                .map_err(|e| s.fail("link", &e))
        );
        let (attr, generation) = tri!(reply, s.entry(ino));
        reply.entry(&s.entry_ttl(to_ext4(newparent), &attr), &attr, generation);
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let s = &self.s;
        let ino = to_ext4(ino);
        let (fh, fl) = tri!(reply, s.open_file(ino, flags.0));
        // KILLPRIV_V2: an unprivileged O_TRUNC drops the set-ID bits (open_file did
        // the truncate).
        if flags.0 & libc::O_TRUNC != 0 && req.uid() != 0 && s.killpriv.load(Ordering::Relaxed) {
            match s.fs.kill_privs_ino(ino) {
                Ok(true) => s.invalidate_attrs(ino),
                Ok(false) => {}
                Err(e) => {
                    s.undo_open(fh);
                    reply.error(s.fail("open O_TRUNC", &e));
                    return;
                }
            }
        }
        // An open for reading counts as the read for atime: with the cache kept across
        // opens (KEEP_CACHE) the kernel may serve every read of it from its page
        // cache, and then no READ arrives. Under relatime this moves the atime at
        // most once per change of the file (or per day); opens for writing only, and
        // truncating ones, do not count, as writes do not on ext4.
        let read_open = matches!(
            flags.acc_mode(),
            OpenAccMode::O_RDONLY | OpenAccMode::O_RDWR
        );
        if read_open && flags.0 & libc::O_TRUNC == 0 {
            s.accessed(ino, true);
        }
        reply.opened(FileHandle(fh), fl);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let s = &self.s;
        let ino = to_ext4(ino);
        let i = tri!(reply, s.load(ino));
        if kind_of(i.mode) == Some(FileType::Directory) {
            reply.error(Errno::EISDIR);
            return;
        }
        let want = size.min(MAX_IO) as u64;
        let n = i.size.saturating_sub(offset).min(want) as usize;
        let (direct, _) = s.handle_flags(fh);
        // The engine reads straight into the buffer the reply goes out of (the ring
        // entry's payload buffer over io_uring): no buffer of our own to allocate and
        // zero, and no copy of the data after the read.
        reply.data_with(n, |buf| {
            let r = if direct {
                s.fs.read_direct_ino(ino, buf, offset)
            } else {
                s.fs.read_ino_at(ino, &i, buf, offset)
            };
            let got = r.map_err(|e| s.fail("read", &e))?;
            // `flags` are the reading file's: on one opened write-only this READ is
            // the kernel filling a page before a partial write (writeback cache), no
            // read.
            if flags.acc_mode() != OpenAccMode::O_WRONLY {
                s.accessed(ino, false);
            }
            Ok(got.min(n))
        });
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let s = &self.s;
        let ino = to_ext4(ino);
        // A WRITE from the kernel's writeback: data a write() was told was written,
        // which the space held back for the kernel's cache is there for (`lowspace`).
        // Once answered, whatever the answer, the kernel no longer holds it.
        let cached = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        let _arrival = cached.then(|| Arrival {
            s,
            offset,
            len: data.len() as u64,
        });
        let _spend = cached.then(rext4::spend_held);
        // A write the caller waits for allocates as that caller: the root reserve is
        // not an unprivileged writer's (ext4's rule). Cached data was admitted with
        // the writer's privilege at its write() (`lowspace`).
        let privileged = cached || s.privileged(req.uid(), req.gid());
        let _as = rext4::act_as_privileged(privileged);
        tri!(reply, s.writable());
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            let changed = tri!(
                reply,
                s.fs.kill_privs_ino(ino)
                    .map_err(|e| s.fail("write: drop privileges", &e))
            );
            if changed {
                s.invalidate_attrs(ino);
            }
        }
        let (direct, append) = s.handle_flags(fh);
        // With the writeback cache the kernel owns mtime/ctime of regular files and
        // places O_APPEND writes itself (it may send them on another handle).
        let wb = s.writeback.load(Ordering::Relaxed);
        // The size before an O_DIRECT write, to undo what a write that fails part way
        // added to it.
        let size_before = if direct {
            s.fs.inode_attr(ino).ok().map(|i| i.size)
        } else {
            None
        };
        let attempt = |off: u64, buf: &[u8]| {
            if append && !wb {
                s.fs.append_ino(ino, buf, direct)
            } else if direct {
                s.fs.write_direct_ino(ino, buf, off, !wb)
            } else if wb {
                s.fs.write_ino_at_keep_times(ino, buf, off)
            } else {
                s.fs.write_ino_at(ino, buf, off)
            }
        };
        let mut r = attempt(offset, data);
        if !cached {
            // A write the caller waits for that ran out beside space held back for
            // the kernel's cache (a bound of what it may still hand over): wait a
            // little for that to arrive, and go on with the rest (`lowspace`).
            let mut done = match r {
                Ok(n) => n,
                Err(Error::NoSpace) => 0,
                _ => data.len(),
            };
            let deadline = std::time::Instant::now() + crate::lowspace::ROOM_WAIT;
            while done < data.len()
                && s.lowspace
                    .wait_for_room(&s.fs, (data.len() - done) as u64, privileged, deadline)
            {
                match attempt(offset + done as u64, &data[done..]) {
                    Ok(n) => done += n,
                    Err(Error::NoSpace) => {}
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                }
                if done > 0 {
                    r = Ok(done);
                }
            }
        }
        // Past ext4's largest file size. The FUSE superblock has no such limit, so under
        // the writeback cache the application's write succeeded into the kernel's page
        // cache and the error reaches it only at fsync or close; the kernel's inode
        // meanwhile shows the size the write made. Make it read ours again.
        // A WRITE that the engine took only in part (the space or the size ran out on
        // the way) is an error when it comes from the kernel's writeback (the kernel
        // takes any count as done and would drop the rest without a word; the error is
        // kept for fsync and close) or from an O_DIRECT descriptor (the kernel turns a
        // short answer to an asynchronous direct write into EIO, and a synchronous one
        // may have been sent as asynchronous pieces): the part written stays written,
        // and what it added to the size is taken back, as the kernel's size does not
        // move for a failed write.
        let r = match r {
            Ok(n) if (cached || direct) && n < data.len() => {
                let end = offset.saturating_add(data.len() as u64);
                let max =
                    s.fs.max_size_of_ino(ino)
                        .unwrap_or_else(|_| s.fs.max_file_size());
                let e = if end > max {
                    Error::FileTooLarge
                } else {
                    Error::NoSpace
                };
                if direct && !append {
                    s.undo_growth(ino, size_before, offset + n as u64);
                }
                Err(e)
            }
            r => r,
        };
        match &r {
            // The kernel's writeback of data a write() was told was written: refused
            // for lack of space, which the space held back for the kernel's cache
            // should have made impossible. The data is lost; every write() through the
            // kernel's cache fails from now on while space is low (`lowspace`), and
            // the kernel is made to drop the size that data gave its inode.
            Err(Error::NoSpace) if cached => {
                log::warn!(
                    "inode {}: the kernel's cached write of {} bytes at {offset} was refused \
                     for lack of space; the application sees ENOSPC at fsync or close \
                     ({} KiB owed to the kernel's cache, {} blocks held, {} free)",
                    ino.0,
                    data.len(),
                    s.lowspace.owed() >> 10,
                    s.fs.held_for_client(),
                    s.fs.blocks_available_to(true)
                );
                s.lowspace.note_refused();
                s.drop_kernel_inode(ino);
            }
            Ok(_) => s.lowspace.after_change(s.available_bytes()),
            _ => {}
        }
        if wb && matches!(r, Err(Error::FileTooLarge)) {
            let bumped = s.drop_kernel_inode(ino);
            s.debug(|| {
                format!(
                    "write {}: past the size limit, epoch bumped: {bumped}",
                    ino.0
                )
            });
        }
        let n = tri!(reply, r.map_err(|e| s.fail("write", &e)));
        reply.written(n as u32);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to do at close (data goes by the kernel's writeback and fsync; locks
        // are the kernel's): ENOSYS makes the kernel stop sending FLUSH, one request
        // less per close.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        let h = lock(&s.handles).remove(&fh.0);
        if let Some(Handle::File {
            ino, cached_write, ..
        }) = h
        {
            if cached_write {
                // The kernel wrote the file's dirty pages back before releasing it.
                s.lowspace.released(&s.fs);
            }
            s.release_stale_time(ino);
            if let Err(e) = s.fs.unpin(ino) {
                reply.error(s.fail("release", &e));
                return;
            }
        }
        reply.ok();
        if s.release_waiters.load(Ordering::SeqCst) > 0 {
            s.released.notify_all();
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        tri!(
            reply,
            s.fs.fsync_ino(to_ext4(ino))
                .map_err(|e| s.fail("fsync", &e))
        );
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let s = &self.s;
        let snap = tri!(reply, s.snapshot(to_ext4(ino)));
        let fh = s.new_fh(Handle::Dir(Arc::new(Mutex::new(snap))));
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let s = &self.s;
        let d = tri!(reply, s.dir_for(to_ext4(ino), fh, offset));
        let snap = lock(&d);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (idx, (name, e_ino, kind)) in snap.entries.iter().enumerate().skip(start) {
            let kind = match kind {
                Some(k) => *k,
                None => match s.load(*e_ino).ok().and_then(|i| kind_of(i.mode)) {
                    Some(k) => k,
                    None => continue,
                },
            };
            if reply.add(
                to_fuse(*e_ino),
                idx as u64 + 1,
                kind,
                OsStr::from_bytes(name),
            ) {
                break;
            }
        }
        drop(snap);
        s.accessed(to_ext4(ino), false);
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let s = &self.s;
        let d = tri!(reply, s.dir_for(to_ext4(ino), fh, offset));
        let snap = lock(&d);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (idx, (name, e_ino, _)) in snap.entries.iter().enumerate().skip(start) {
            let dot = name == b"." || name == b"..";
            let Ok(i) = s.load(*e_ino) else { continue };
            let Ok(attr) = s.attr_of(*e_ino, &i) else {
                continue;
            };
            // Count before the kernel can forget: the entry may be linked as soon as
            // the reply is out.
            if !dot {
                s.add_lookup(*e_ino, 1);
            }
            let full = reply.add(
                to_fuse(*e_ino),
                idx as u64 + 1,
                OsStr::from_bytes(name),
                &s.ttl(&attr),
                &attr,
                Generation(u64::from(i.generation)),
            );
            if full {
                if !dot {
                    s.forget_ino(*e_ino, 1);
                }
                break;
            }
        }
        drop(snap);
        s.accessed(to_ext4(ino), false);
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.s.handles).remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        // fsync of a directory commits the journal, as on ext4. Of the mount's root it
        // makes the whole filesystem durable (`sync MNT`, which opens the mount point
        // and fsyncs it: this kernel sends no SYNCFS to a FUSE server).
        let r = if to_ext4(ino) == Ino::ROOT {
            s.fs.sync()
        } else {
            s.fs.sync_metadata()
        };
        tri!(reply, r.map_err(|e| s.fail("fsyncdir", &e)));
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let st = self.s.fs.statfs();
        // Space held back for what the kernel's cache may still hand over counts as
        // used, as ext4 counts the blocks its dirty pages reserved.
        let held = self.s.fs.held_for_client();
        reply.statfs(
            st.blocks,
            st.blocks_free.saturating_sub(held),
            st.blocks_available.saturating_sub(held),
            st.inodes,
            st.inodes_free,
            st.block_size,
            st.name_max,
            st.block_size,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        if position != 0 || flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 {
            reply.error(Errno::EINVAL);
            return;
        }
        tri!(reply, s.writable());
        let fl = XattrFlags {
            create: flags & XATTR_CREATE != 0,
            replace: flags & XATTR_REPLACE != 0,
        };
        let ino = to_ext4(ino);
        let name = name_bytes(name);
        match s.fs.set_xattr_ino(ino, name, value, fl) {
            Ok(()) => {
                reply.ok();
                if name == acl::ACCESS {
                    s.invalidate_attrs(ino);
                }
            }
            // XATTR_REPLACE of a missing attribute.
            Err(Error::NotFound) => reply.error(Errno::NO_XATTR),
            Err(e) => reply.error(s.fail("setxattr", &e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let s = &self.s;
        let v = match s.fs.get_xattr_ino(to_ext4(ino), name_bytes(name)) {
            Ok(Some(v)) => v,
            Ok(None) | Err(Error::NotFound) => {
                reply.error(Errno::NO_XATTR);
                return;
            }
            Err(e) => {
                reply.error(s.fail("getxattr", &e));
                return;
            }
        };
        xattr_reply(reply, &v, size);
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let s = &self.s;
        // The names alone: values kept in inodes of their own are not read.
        let all = tri!(
            reply,
            s.fs.xattr_names_ino(to_ext4(ino))
                .map_err(|e| s.fail("listxattr", &e))
        );
        let mut names = Vec::new();
        // As ext4: trusted.* names are listed only to privileged callers.
        let privileged = req.uid() == 0;
        for n in all
            .into_iter()
            .filter(|n| privileged || !n.starts_with(b"trusted."))
        {
            names.extend_from_slice(&n);
            names.push(0);
        }
        xattr_reply(reply, &names, size);
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let s = &self.s;
        tri!(reply, s.writable());
        match s.fs.remove_xattr_ino(to_ext4(ino), name_bytes(name)) {
            Ok(()) => {
                reply.ok();
                if name_bytes(name) == acl::ACCESS {
                    s.invalidate_attrs(to_ext4(ino));
                }
            }
            Err(Error::NotFound) => reply.error(Errno::NO_XATTR),
            Err(e) => reply.error(s.fail("removexattr", &e)),
        }
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        tri!(reply, self.s.access_check(req, to_ext4(ino), mask));
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let s = &self.s;
        let p = to_ext4(parent);
        let mode = if u32::from(S_IFMT) & mode == 0 {
            mode | 0o100_000
        } else {
            mode
        };
        let (uid, gid, _, mode) = tri!(reply, s.new_inode_args(req, p, mode, umask));
        let ino = match s.fs.mknod_ino(p, name_bytes(name), mode, uid, gid, (0, 0)) {
            Ok(ino) => ino,
            // Created by someone else since the kernel's lookup: open it, unless O_EXCL.
            Err(Error::Exists) if flags & libc::O_EXCL == 0 => {
                match s.fs.lookup(p, name_bytes(name)) {
                    Ok(Some(e)) => e.ino,
                    Ok(None) => {
                        reply.error(Errno::ENOENT);
                        return;
                    }
                    Err(e) => {
                        reply.error(s.fail("create", &e));
                        return;
                    }
                }
            }
            Err(e) => {
                reply.error(s.fail("create", &e));
                return;
            }
        };
        let (fh, fl) = tri!(reply, s.open_file(ino, flags));
        let (attr, generation) = match s.entry(ino) {
            Ok(v) => v,
            Err(e) => {
                s.undo_open(fh);
                reply.error(e);
                return;
            }
        };
        reply.created(
            &s.entry_ttl(to_ext4(parent), &attr),
            &attr,
            generation,
            FileHandle(fh),
            fl,
        );
    }

    /// O_TMPFILE: an unnamed file, open, that a later LINK may name (the kernel sends
    /// LINK only when it was opened without O_EXCL; the engine checks that too).
    fn tmpfile(
        &self,
        req: &Request,
        parent: INodeNo,
        mode: u32,
        umask: u32,
        flags: i32,
        _kill_suid_gid: bool,
        reply: ReplyCreate,
    ) {
        let s = &self.s;
        let p = to_ext4(parent);
        let regular = (mode & 0o7777) | 0o100_000;
        let (uid, gid, _, mode) = tri!(reply, s.new_inode_args(req, p, regular, umask));
        let excl = flags & libc::O_EXCL != 0;
        let ino = match s.fs.tmpfile_ino(p, mode, uid, gid, excl) {
            Ok(ino) => ino,
            Err(e) => {
                reply.error(s.fail("tmpfile", &e));
                return;
            }
        };
        // The handle and the kernel's reference take over the one tmpfile_ino returned.
        let opened = s
            .open_file(ino, flags & !libc::O_TRUNC)
            .and_then(|(fh, fl)| {
                s.entry(ino)
                    .map(|e| (fh, fl, e))
                    .inspect_err(|_| s.undo_open(fh))
            });
        if let Err(e) = s.fs.unpin(ino) {
            s.fail("tmpfile", &e);
        }
        match opened {
            Ok((fh, fl, (attr, generation))) => {
                reply.created(&s.ttl(&attr), &attr, generation, FileHandle(fh), fl)
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let s = &self.s;
        let keep = mode & FALLOC_FL_KEEP_SIZE != 0;
        let m = match mode & !FALLOC_FL_KEEP_SIZE {
            0 if keep => FallocMode::KeepSize,
            0 => FallocMode::Allocate,
            FALLOC_FL_PUNCH_HOLE if keep => FallocMode::PunchHole,
            FALLOC_FL_ZERO_RANGE => FallocMode::ZeroRange { keep_size: keep },
            // The kernel's FUSE does not pass these on today; ready for when it does.
            FALLOC_FL_COLLAPSE_RANGE if !keep => FallocMode::CollapseRange,
            FALLOC_FL_INSERT_RANGE if !keep => FallocMode::InsertRange,
            _ => {
                reply.error(Errno::EOPNOTSUPP);
                return;
            }
        };
        tri!(reply, s.writable());
        let _as = rext4::act_as_privileged(s.privileged(req.uid(), req.gid()));
        tri!(
            reply,
            s.fs.fallocate_ino(to_ext4(ino), m, offset, length)
                .map_err(|e| s.fail("fallocate", &e))
        );
        s.lowspace.after_change(s.available_bytes());
        reply.ok();
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let s = &self.s;
        if !flags.is_empty() {
            reply.error(Errno::EINVAL);
            return;
        }
        tri!(reply, s.writable());
        // One reply carries at most u32::MAX bytes; the caller loops for the rest.
        let len = len.min(u64::from(u32::MAX) & !0xFFF);
        let _as = rext4::act_as_privileged(s.privileged(req.uid(), req.gid()));
        let wb = s.writeback.load(Ordering::Relaxed);
        let n = tri!(
            reply,
            s.fs.copy_range_ino(
                to_ext4(ino_in),
                offset_in,
                to_ext4(ino_out),
                offset_out,
                len,
                !wb
            )
            .map_err(|e| s.fail("copy_file_range", &e))
        );
        reply.written(n as u32);
    }

    /// The inode-flag ioctls behind lsattr and chattr, which the kernel sends for
    /// regular files and directories (FS_IOC_GETFLAGS/SETFLAGS, and the xflags form
    /// FS_IOC_FSGETXATTR/FSSETXATTR); it has checked ownership and CAP_LINUX_IMMUTABLE
    /// already. Any other command is ENOTTY, as on ext4 for commands it does not know.
    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        let s = &self.s;
        let ino = to_ext4(ino);
        let flags = || s.fs.flags_ino(ino).map_err(|e| s.fail("ioctl", &e));
        let projid = || {
            s.fs.inode_attr(ino)
                .map(|i| i.projid)
                .map_err(|e| s.fail("ioctl", &e))
        };
        let set = |f: u32| {
            s.writable()?;
            s.fs.set_flags_ino(ino, f)
                .map_err(|e| s.fail("ioctl", &e))?;
            s.attrs_changed(ino);
            Ok::<(), Errno>(())
        };
        match cmd {
            crate::REXT4_IOC_SYNC => {
                // `rext4 sync`: everything the server has durable; the caller made the
                // kernel hand over its dirty pages first (syncfs).
                tri!(reply, s.fs.sync().map_err(|e| s.fail("sync", &e)));
                reply.ioctl(0, &[]);
            }
            FITRIM => {
                // struct fstrim_range { start, len, minlen } (u64s); len comes back
                // as the bytes trimmed. CAP_SYS_ADMIN in the kernel: root here.
                let Some(b) = in_data.get(..24) else {
                    reply.error(Errno::EINVAL);
                    return;
                };
                if req.uid() != 0 {
                    reply.error(Errno::EPERM);
                    return;
                }
                tri!(reply, s.writable());
                let word = |i: usize| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(&b[i..i + 8]);
                    u64::from_ne_bytes(a)
                };
                let (start, len, minlen) = (word(0), word(8), word(16));
                // Blocks freed by the running transaction are busy, which the trim
                // skips: committed first, what was deleted before `fstrim` (the
                // kernel's FUSE sends no syncfs) is given back too.
                let done = tri!(
                    reply,
                    s.fs.sync_metadata()
                        .and_then(|()| s.fs.trim(start, len, minlen))
                        .map_err(|e| s.fail("fitrim", &e))
                );
                let mut out = [0u8; 24];
                out[0..8].copy_from_slice(&start.to_ne_bytes());
                out[8..16].copy_from_slice(&done.to_ne_bytes());
                out[16..24].copy_from_slice(&minlen.to_ne_bytes());
                reply.ioctl(0, &out);
            }
            FS_IOC_GETFLAGS => {
                let f = tri!(reply, flags());
                reply.ioctl(0, &f.to_ne_bytes());
            }
            FS_IOC_SETFLAGS => {
                let Some(b) = in_data.get(..4) else {
                    reply.error(Errno::EINVAL);
                    return;
                };
                tri!(reply, set(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])));
                reply.ioctl(0, &[]);
            }
            FS_IOC_FSGETXATTR => {
                let f = tri!(reply, flags());
                let projid = tri!(reply, projid());
                // struct fsxattr: xflags, extsize, nextents, projid, cowextsize, pad[8].
                let mut out = [0u8; 28];
                out[0..4].copy_from_slice(&xflags_of(f).to_ne_bytes());
                out[12..16].copy_from_slice(&projid.to_ne_bytes());
                reply.ioctl(0, &out);
            }
            FS_IOC_FSSETXATTR => {
                let Some(b) = in_data.get(..28) else {
                    reply.error(Errno::EINVAL);
                    return;
                };
                let word = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
                let cur = tri!(reply, flags());
                let projid = tri!(reply, projid());
                if word(12) != projid {
                    reply.error(Errno::EOPNOTSUPP);
                    return;
                }
                tri!(reply, set(flags_from_xflags(cur, word(0))));
                reply.ioctl(0, &[]);
            }
            _ => reply.error(Errno::ENOTTY),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let s = &self.s;
        if whence != SEEK_DATA && whence != SEEK_HOLE {
            reply.error(Errno::EINVAL);
            return;
        }
        let Ok(off) = u64::try_from(offset) else {
            reply.error(Errno::ENXIO);
            return;
        };
        // With the writeback cache, data may still sit in dirty kernel pages that the
        // engine has not seen. Invalidating the file's pages from `off` on makes the
        // kernel write the dirty ones back first (its launder step sends WRITEs, which
        // other workers serve) before the notification returns; only then is the
        // engine's extent map the whole truth. Without a notifier, or when the kernel
        // refuses, let it fall back to "all data" (always correct).
        if s.writeback.load(Ordering::Relaxed) {
            let flushed = s.notifier.get().is_some_and(|n| {
                let start = off & !(PAGE - 1);
                n.inval_inode(ino, start as i64, 0).is_ok()
            });
            if !flushed {
                reply.error(Errno::ENOSYS);
                return;
            }
        }
        let r = tri!(reply, s.seek(to_ext4(ino), off, whence));
        reply.offset(r as i64);
    }
}

/// The size-probe / ERANGE protocol of getxattr and listxattr.
fn xattr_reply(reply: ReplyXattr, v: &[u8], size: u32) {
    if size == 0 {
        reply.size(v.len() as u32);
    } else if v.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_encoding_round_trips() {
        for (ma, mi) in [(0, 0), (1, 3), (8, 1), (259, 65_536), (4095, 0xfffff)] {
            let d = encode_dev(ma, mi);
            assert_eq!(decode_dev(d), (ma, mi), "{ma}:{mi}");
        }
        // Linux's makedev(8, 1) in the old 16-bit space is 0x801.
        assert_eq!(encode_dev(8, 1), 0x801);
    }

    #[test]
    fn timestamps_round_trip_both_sides_of_the_epoch() {
        for t in [
            Timestamp { sec: 0, nsec: 0 },
            Timestamp {
                sec: 1_700_000_000,
                nsec: 123_456_789,
            },
            Timestamp { sec: -1, nsec: 5 },
            Timestamp {
                sec: -2_000_000_000,
                nsec: 999_999_999,
            },
        ] {
            assert_eq!(timestamp(system_time(t)), t);
        }
    }

    #[test]
    fn root_maps_both_ways() {
        assert_eq!(to_ext4(INodeNo(1)), Ino::ROOT);
        assert_eq!(to_fuse(Ino::ROOT), INodeNo(1));
        assert_eq!(to_ext4(INodeNo(12)), Ino(12));
        assert_eq!(to_fuse(Ino(12)), INodeNo(12));
        assert_eq!(to_ext4(INodeNo(u64::MAX)), Ino(0));
    }
}
