//! The mounted filesystem object: superblock, group descriptors, the buffer cache, and
//! inode access. Everything above (paths, directories, files, xattrs) goes through here.
//!
//! Opening (`Fs::open_device`): read and verify the superblock, gate on features
//! (unknown incompat ⇒ refuse, naming them; unknown ro_compat ⇒ read-only), check the
//! geometry against the device size (so no later allocation or loop is bounded only by
//! on-disk numbers), take the MMP block for a read-write open of an image with
//! multi-mount protection (`crate::mmp`, released last by close), read and verify
//! every group descriptor. An image whose journal
//! needs recovery is replayed first (`crate::journal`): on the device for a read-write
//! open, into an in-memory overlay for a read-only one; fast commits left after the
//! log are replayed by a read-write filesystem opened for that on the same device
//! (`crate::fc_replay`), before this open goes on. A read-write open then loads
//! the journal for rext4's own commits (`crate::fs::jwrite`), sets needs_recovery (or,
//! without a journal, clears VALID_FS), and finishes orphans (`crate::orphan`).
//!
//! Must hold: every block number read from disk is checked against `blocks_count`
//! before use (the buffer cache refuses others), every inode number against
//! `inodes_count`.

mod data_io;
pub(crate) mod dax_file;
#[cfg(test)]
mod dio_cache_model;
#[cfg(test)]
mod dio_model;
mod group_commit;
#[cfg(test)]
mod handle_model;
mod inode_locks;
#[cfg(test)]
pub(crate) mod model_check;
pub(crate) use inode_locks::InodeGuard;
pub mod inode_write;
pub(crate) mod jwrite;
pub mod map;
pub mod pagecache;
pub mod prefetch;
pub(crate) mod space;
pub(crate) mod write_ahead;
#[cfg(test)]
mod zeroing_model;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Stripes of the per-inode I/O and tree lock tables (`Inner::io_locks`, `tree_locks`).
const IO_LOCK_STRIPES: usize = 256;

use rext4_format::group::{self, DescCsum, GroupDesc};
use rext4_format::inode::{self as fmt_inode, Inode};
use rext4_format::superblock::{feature, Superblock, SB_OFFSET, SB_SIZE, STATE_VALID};

use crate::cache::{BufferCache, Kind, Padded};
use crate::device::BlockDevice;
use crate::error::{AtBlock, Error, Result};
use crate::lockdep::{Held, Rank, Ranked};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

/// A transaction closed for commit (`Inner::close_transaction`).
struct Closed {
    /// Its sync number (`syncs_started` before it).
    n: u64,
    dirty: Vec<(u64, Arc<[u8]>)>,
    revoked: Vec<u64>,
    /// Blocks freed by it: busy until it is committed.
    freed: std::collections::BTreeMap<u64, u64>,
    /// Nothing changed: a device flush is all it takes.
    flush_only: bool,
}

/// What the journal wrote since the filesystem was opened ([`Fs::journal_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// Transactions committed (each two device flushes).
    pub commits: u64,
    /// Checkpoints (committed blocks written home and the log emptied).
    pub checkpoints: u64,
}

/// How to open a filesystem.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Open without writing anything to the image.
    pub read_only: bool,
    /// Use O_DIRECT on the image file.
    pub direct_io: bool,
    /// Metadata cache size in blocks.
    pub cache_blocks: usize,
    /// Commit the running transaction every this many seconds (mount's commit=; 0
    /// disables the periodic commit).
    pub commit_secs: u64,
    /// Memory the page cache (file data) may use, in bytes; `None`: 1/16 of RAM
    /// between 64 MiB and 2 GiB (`pagecache::default_limit_bytes`).
    pub cache_bytes: Option<u64>,
    /// Keep clean pages cached (read pages, and written pages after writeback). A
    /// frontend that caches file data itself (the FUSE mount under the kernel's
    /// writeback cache) turns this off: the engine then holds only dirty data, and
    /// reads copy what is cached and read the rest from the device.
    pub cache_clean: bool,
    /// Where the times of changes come from (`None`: the system's realtime clock,
    /// [`crate::fs::inode_write::now_ts`]). A frontend whose kernel also stamps times — the
    /// FUSE mount, where the kernel's writeback cache sets mtime and ctime from its
    /// coarse clock — passes that clock, so a file is never born after its mtime.
    pub clock: Option<fn() -> rext4_format::inode::Timestamp>,
    /// When reads move atimes ([`crate::Fs::touch_atime_ino`]); the default,
    /// [`crate::AtimeMode::Never`], leaves an image as it was when only read.
    pub atime: crate::AtimePolicy,
    /// Read-only opens of a path: fail with [`Error::InUse`] instead of going on with
    /// a warning when another user may be writing the image, and keep rext4 writers
    /// out while open (a shared flock; see [`crate::claim`]). The read-only mount sets
    /// it: its kernel caches what it reads for an hour.
    pub keep_writers_out: bool,
    /// Write what changed to the journal this many milliseconds after it changed,
    /// without a flush (0: never): file data goes to the image and metadata into the
    /// log as an *early commit*, so a crash of this process (not of the machine)
    /// loses only the last moment; the next open replays it when the machine has not
    /// restarted since (see `jwrite`). The durable commit still follows every
    /// `commit_secs`, at fsync and sync. The mount uses it.
    pub early_commit_ms: u64,
    /// This boot's id (`None`: /proc/sys/kernel/random/boot_id). Early commits carry
    /// it, and only an open in the same boot replays them; tests pass another one to
    /// act as after a restart.
    pub boot_id: Option<[u8; 16]>,
    /// DAX (`crate::device::dax`): map the image (a file on tmpfs or hugetlbfs, a dax device)
    /// and read and write file data straight between the caller's buffer and the
    /// mapping, without the page cache; metadata still goes through the buffer cache
    /// and the journal. [`Fs::open_with`] maps the path; [`Fs::open_device`] needs a
    /// device that is a [`crate::device::dax::DaxDevice`]. Not with `direct_io`.
    pub dax: bool,
    /// What a metadata error (a failed read, corruption found) does, as ext4's
    /// `errors=`; `None`: what the superblock says (`s_errors`, set by mke2fs -e or
    /// tune2fs -e; continue when unset). Whatever the behaviour, the superblock is
    /// marked as having errors, so e2fsck checks the image fully.
    pub errors: Option<Errors>,
    /// Block bitmaps one allocation reads together when its search meets one that is
    /// not cached (the kernel's `mb_prefetch`; `None`: 8 x groups per flex group, or
    /// 32 without flex_bg). See [`prefetch`].
    pub mb_prefetch: Option<u32>,
    /// Block bitmaps one allocation may prefetch in all (`mb_prefetch_limit`; `None`:
    /// 4 x `mb_prefetch`).
    pub mb_prefetch_limit: Option<u32>,
    /// Summarize every group's block bitmap in the background after a read-write
    /// open, at idle priority (the kernel's `prefetch_block_bitmaps`, on by default).
    pub prefetch_block_bitmaps: bool,
    /// An operation that frees inodes returns only once the lockless readers that
    /// began before the frees are done, and the numbers are then free for reuse at
    /// once, instead of cooling (`grace.rs`): the synchronous design (an RCU
    /// `synchronize_rcu` per free, waited for after the operation's locks are
    /// released) that SEEDS lesson C compares against, for benchmarks (`rext4 bench
    /// churn --sync-grace`). Off by default: a free then never waits for readers.
    pub sync_grace: bool,
    /// Discard blocks as they are freed (the mount's `discard`): once the
    /// transaction that freed them has committed (never before: until then a crash
    /// recovers a state that uses them), and before they may be allocated again.
    /// Failures are ignored (discard only gives space back). Journaled images only;
    /// [`Fs::trim`] gives back every free block at once.
    pub discard: bool,
    /// Reproducible mode (`crate::repro`): every time a change stamps is this
    /// (seconds since the epoch), times set are clamped to it, generation numbers come
    /// from the image's identity, and no timer or cache state decides where anything
    /// goes, so the same changes to the same image give the same bytes. Periodic and
    /// early commits, the writeback thread and the bitmap prefetcher do not run (data
    /// is written back at the dirty limit, fsync, sync and close). The default is
    /// `SOURCE_DATE_EPOCH` from the environment (unset or malformed: off; a frontend
    /// that wants to refuse a malformed one checks `repro::source_date_epoch`).
    pub source_date_epoch: Option<i64>,
}

/// ext4's `errors=` behaviours after a metadata error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Errors {
    /// Mark the superblock and go on (operations that changed something before
    /// their error abort all the same).
    Continue,
    /// Abort the journal: nothing more is committed and every change is refused
    /// (`Error::ShutDown`), as the kernel's remount read-only.
    RemountRo,
    /// As `RemountRo` (a library does not stop its process; the kernel panics).
    Panic,
}

impl Errors {
    /// The behaviour a superblock's `s_errors` asks for.
    pub fn from_superblock(v: u16) -> Errors {
        match v {
            2 => Errors::RemountRo,
            3 => Errors::Panic,
            _ => Errors::Continue,
        }
    }
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            read_only: true,
            direct_io: false,
            cache_blocks: 16384,
            commit_secs: 5,
            cache_bytes: None,
            cache_clean: true,
            clock: None,
            atime: crate::AtimePolicy::default(),
            keep_writers_out: false,
            early_commit_ms: 0,
            boot_id: None,
            dax: false,
            errors: None,
            mb_prefetch: None,
            mb_prefetch_limit: None,
            prefetch_block_bitmaps: true,
            sync_grace: false,
            discard: false,
            source_date_epoch: crate::repro::source_date_epoch().ok().flatten(),
        }
    }
}

/// Space freed since the last commit (see `Inner::busy`).
#[derive(Default)]
pub(crate) struct Busy {
    /// start -> length, non-overlapping.
    pub(crate) blocks: std::collections::BTreeMap<u64, u64>,
    pub(crate) block_count: u64,
    /// Inodes freed while lockless readers may still hold their number: inode ->
    /// grace stamp (`grace.rs`). Not reused until the stamp has passed; unlike the
    /// rest of `Busy` this outlives commits.
    pub(crate) cooling: crate::inthash::IntMap<u32, u64>,
}

impl Busy {
    /// Record `[start, start+len)` as freed by the running transaction, merged with
    /// the runs it touches.
    pub(crate) fn add(&mut self, start: u64, len: u64) {
        let (mut s, mut e) = (start, start + len);
        if let Some((&ps, &pl)) = self.blocks.range(..=s).next_back() {
            if ps + pl >= s {
                s = ps;
                e = e.max(ps + pl);
                self.blocks.remove(&ps);
                self.block_count -= pl;
            }
        }
        while let Some((&ns, &nl)) = self.blocks.range(s..=e).next() {
            e = e.max(ns + nl);
            self.blocks.remove(&ns);
            self.block_count -= nl;
        }
        self.blocks.insert(s, e - s);
        self.block_count += e - s;
    }

    /// Forget the runs of `freed` (a committed transaction's frees: reusable now).
    /// Every block of them is in a run here (frees of later transactions are other
    /// blocks: these were free until the commit).
    pub(crate) fn remove_runs(&mut self, freed: &std::collections::BTreeMap<u64, u64>) {
        for (&start, &len) in freed {
            let end = start + len;
            let overlapping: Vec<(u64, u64)> = self
                .blocks
                .range(..end)
                .rev()
                .take_while(|(&s, &l)| s + l > start)
                .map(|(&s, &l)| (s, l))
                .collect();
            for (s, l) in overlapping {
                self.blocks.remove(&s);
                self.block_count -= l;
                if s < start {
                    self.blocks.insert(s, start - s);
                    self.block_count += start - s;
                }
                if s + l > end {
                    self.blocks.insert(end, s + l - end);
                    self.block_count += s + l - end;
                }
            }
        }
    }

    /// The end of the busy run holding `blk`, if it is busy.
    pub(crate) fn run_end(&self, blk: u64) -> Option<u64> {
        let (&s, &l) = self.blocks.range(..=blk).next_back()?;
        (s + l > blk).then_some(s + l)
    }

    /// First busy block in `[start, end)`, if any.
    pub(crate) fn first_in(&self, start: u64, end: u64) -> Option<u64> {
        if let Some((&s, &l)) = self.blocks.range(..=start).next_back() {
            if s + l > start {
                return Some(start);
            }
        }
        self.blocks.range(start..end).next().map(|(&s, _)| s)
    }
}

/// A group descriptor as it is now, and what the allocator knows of its bitmap.
pub(crate) struct Group {
    pub(crate) desc: GroupDesc,
    /// At least the longest free run of the block bitmap, once known (`prefetch`):
    /// allocating keeps it true, a free adds the run around what it freed.
    pub(crate) longest_free: Option<u32>,
    /// Bumped by every change of the block bitmap (a summary made from a read
    /// without the mutex is kept only if this did not move meanwhile).
    pub(crate) bitmap_gen: u32,
    /// The group's number (its bit in `Inner::dirty_groups`, set while the
    /// descriptor differs from its on-disk copy).
    pub(crate) no: u32,
}

/// Superblock state that changes while the filesystem is open.
pub(crate) struct Live {
    pub(crate) sb: Superblock,
    /// The 1024 bytes read at open: fields rext4 does not model are kept from here.
    pub(crate) raw: Vec<u8>,
    pub(crate) dirty: bool,
    /// Whether the filesystem was clean (VALID_FS) when opened read-write.
    pub(crate) was_clean: bool,
    pub(crate) closed: bool,
}

pub(crate) struct Inner {
    pub(crate) cache: BufferCache,
    /// Geometry and features as opened; they do not change while open. Counters and
    /// state live in `live`.
    pub(crate) sb: Superblock,
    pub(crate) live: Padded<Mutex<Live>>,
    pub(crate) groups: Vec<Padded<Mutex<Group>>>,
    /// One bit per group whose descriptor differs from its on-disk copy
    /// (`Fs::group_changed`): a commit writes those without visiting every group
    /// (131,072 at 16 TiB).
    pub(crate) dirty_groups: Box<[std::sync::atomic::AtomicU64]>,
    /// The blocks that belong to the filesystem itself, as sorted disjoint
    /// `[start, end)` runs: superblock and descriptor copies, reserved descriptor
    /// blocks, bitmaps and inode tables. No file frees one (see `Fs::in_system_zone`).
    pub(crate) system_zone: Vec<(u64, u64)>,
    /// Each group's inode table (first block), as opened: tables never move.
    pub(crate) inode_tables: Vec<u64>,
    /// The running transaction's gate: shared by each handle (an operation that
    /// changes metadata under inode locks, `Fs::handle`), exclusive for the
    /// operations that still run alone (`Fs::write_lock`) and to close the transaction
    /// for commit (which so waits for the open handles: jbd2's t_updates).
    pub(crate) txn: Padded<RwLock<()>>,
    /// Per-inode namespace locks of the handles (`inode_locks`).
    inode_locks: inode_locks::InodeLocks,
    /// Held by a handle that locks two directories (rmdir, and rename when it runs as
    /// a handle), as the VFS's rename mutex.
    rename_lock: Mutex<()>,
    /// Read-modify-write locks of metadata blocks that several inodes share (inode
    /// table blocks, xattr blocks), striped by block number.
    block_locks: Box<[Padded<Mutex<()>>]>,
    /// The orphan list (the superblock's chain head, the orphan file's blocks).
    orphan_lock: Mutex<()>,
    /// The journal when the filesystem has one and is open read-write.
    pub(crate) journal: Mutex<Option<crate::fs::jwrite::Journal>>,
    /// Blocks freed by the running transaction: not reallocated until it commits
    /// (ext4's busy extents), so no data lands in a block that committed metadata
    /// still references. Also the inodes still cooling after a free (grace periods).
    pub(crate) busy: Padded<Mutex<Busy>>,
    /// Syncs (commits, or flushes when nothing was dirty) started and completed, for
    /// group commit: an fsync whose changes were made before sync `n` started is
    /// durable once `syncs_done > n` (see `Fs::fsync_commit`).
    syncs_started: std::sync::atomic::AtomicU64,
    syncs_done: std::sync::atomic::AtomicU64,
    /// Journal commits and checkpoints written (`Fs::journal_stats`).
    commits: std::sync::atomic::AtomicU64,
    checkpoints: std::sync::atomic::AtomicU64,
    /// Blocks one transaction may carry (0: no journal). Read without the journal's
    /// mutex, which a commit holds while it writes.
    pub(crate) max_txn: std::sync::atomic::AtomicUsize,
    /// Allocations stay below this block (and in the groups that start below it): a
    /// shrink in progress empties the groups it removes (`crate::resize`). Unlimited
    /// (`u64::MAX`) unless `Fs::set_alloc_limit` was called.
    pub(crate) alloc_limit: std::sync::atomic::AtomicU64,
    /// Set when a commit failed: the filesystem is shut down (read-only) with this reason.
    pub(crate) shutdown: Mutex<Option<String>>,
    /// Set once no change may be made any more (read-only, shut down or closed): the
    /// check at the start of every change reads it alone (the mutexes behind it are
    /// taken only once it is set), so threads making changes share no lock there.
    unwritable: std::sync::atomic::AtomicBool,
    /// References held on inodes (open handles): an inode with references is not freed
    /// when its last link goes; it becomes an orphan (see `orphan.rs`).
    pub(crate) pins: Padded<Mutex<crate::inthash::IntMap<Ino, u32>>>,
    /// Orphans whose last reference went while that thread held an I/O lock: freed
    /// later by a thread that holds none (`Fs::free_deferred`; see `orphan.rs`).
    pub(crate) deferred_frees: Mutex<Vec<Ino>>,
    /// Unnamed files made by `tmpfile_ino` without `excl`: `link_ino` may give them a
    /// name although they have no links (the kernel's I_LINKABLE).
    pub(crate) linkable: Padded<Mutex<crate::inthash::IntSet<Ino>>>,
    /// Source of the times of changes (`FsOptions::clock`).
    pub(crate) clock: fn() -> rext4_format::inode::Timestamp,
    /// When reads move atimes (`FsOptions::atime`).
    pub(crate) atime: crate::AtimePolicy,
    /// Per-inode I/O locks, striped by inode number: shared for reads and in-place
    /// overwrites of written blocks (which then need no other lock), exclusive for
    /// anything that changes which blocks an inode maps (allocating writes, truncate,
    /// fallocate, the final free). Taken before `write_lock`, one at a time.
    pub(crate) io_locks: Box<[Padded<RwLock<()>>]>,
    /// Per-inode extent-tree locks, striped: shared for lockless readers of a regular
    /// file's mapping, exclusive for writeback's changes to it (see `pagecache`).
    pub(crate) tree_locks: Box<[Padded<RwLock<()>>]>,
    /// File data: pages, dirty state, writeback (see `pagecache`).
    pub(crate) pagecache: crate::fs::pagecache::PageCache,
    /// Who may take the free blocks: delalloc promises, the pool, the root reserve
    /// (see `space`); shared with the page cache.
    pub(crate) space: Arc<crate::fs::space::Space>,
    /// Decoded inodes and directory entries, lock-free on hits, and the grace periods
    /// that keep freed inode numbers from reuse while lockless readers may hold them.
    pub(crate) caches: crate::icache::Caches,
    pub(crate) block_size: u32,
    pub(crate) csum_seed: u32,
    pub(crate) metadata_csum: bool,
    pub(crate) read_only: bool,
    pub(crate) warnings: Vec<String>,
    /// This boot's id, for early commits (`FsOptions::boot_id`).
    pub(crate) boot_id: Option<[u8; 16]>,
    /// The image claimed against other users (opens by path), released by `close`.
    pub(crate) claim: Mutex<Option<crate::claim::Claim>>,
    /// The MMP block held while open read-write (`crate::mmp`), marked clean by
    /// `close` after its last write.
    mmp: Mutex<Option<crate::mmp::Session>>,
    /// File data bypasses the page cache (`FsOptions::dax`; the device is a
    /// `DaxDevice`).
    pub(crate) dax: bool,
    /// DAX mode: per file, the mapping lock, live mappings and dirty ranges
    /// (`dax_file`).
    pub(crate) dax_files: crate::fs::dax_file::DaxFiles,
    /// `FsOptions::errors`, resolved.
    pub(crate) errors: Errors,
    /// The cache's failed metadata reads already marked in the superblock.
    errors_noted: std::sync::atomic::AtomicU64,
    /// Counts every request to the device (the device under `cache` is this one).
    pub(crate) io: Arc<crate::device::latency::Counted>,
    /// What open read and wrote (`Fs::io_stats`).
    pub(crate) io_at_open: std::sync::OnceLock<crate::device::latency::IoCounts>,
    /// Bitmap prefetch settings, counters and the background prefetcher.
    pub(crate) prefetch: prefetch::Prefetch,
    /// Direct writes that overwrote in place under the shared I/O lock, and those
    /// that took it exclusively (`Fs::write_direct_ino`; SEEDS lesson A).
    pub(crate) dio_shared: crate::striped::Counter,
    pub(crate) dio_exclusive: crate::striped::Counter,
    /// Streams of partial-page direct overwrites, for the device's read-ahead hints.
    pub(crate) write_ahead: crate::fs::write_ahead::WriteAhead,
    /// `FsOptions::sync_grace`: frees wait for their grace period.
    pub(crate) sync_grace: bool,
    /// `FsOptions::discard`: committed frees are discarded.
    pub(crate) discard: bool,
    /// Reproducible mode (`FsOptions::source_date_epoch`).
    pub(crate) repro: Option<crate::repro::Repro>,
}

/// An open ext4 filesystem. Cheap to clone; shareable across threads.
#[derive(Clone)]
pub struct Fs {
    pub(crate) inner: Arc<Inner>,
}

/// An inode number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ino(pub u32);

impl Ino {
    pub const ROOT: Ino = Ino(fmt_inode::ROOT_INO);
}

impl Fs {
    /// Open an image file read-only (std::fs-style entry point).
    pub fn open(path: impl AsRef<Path>) -> Result<Fs> {
        Self::open_with(path, FsOptions::default())
    }

    /// Open the image file or block device at `path`. It is claimed first (see
    /// [`crate::claim`]): a read-write open fails with [`Error::InUse`] while a loop
    /// device, a mount or another rext4 process uses it; a read-only one goes on with
    /// a warning when someone may be writing it (unless `opts.keep_writers_out`).
    /// A qcow2 file is found by its magic; `path` is taken as it is ('?' and all:
    /// [`Fs::open_spec`] takes partitions and offsets).
    pub fn open_with(path: impl AsRef<Path>, opts: FsOptions) -> Result<Fs> {
        Self::open_spec(&crate::image::ImageSpec::file(path.as_ref()), opts)
    }

    /// Open what an image spec names (`crate::image`): a partition or byte range of a
    /// disk image or of a qcow2 image's guest disk. The file under it is claimed as
    /// by [`Fs::open_with`], whole: a second writer of another partition of the same
    /// file is refused too.
    pub fn open_spec(spec: &crate::image::ImageSpec, opts: FsOptions) -> Result<Fs> {
        let path = spec.path();
        let whole_disk = |e: Error| match e {
            Error::InUse(m) if !spec.is_plain() => Error::InUse(format!(
                "{m} (rext4 claims a disk image whole, also to use one partition of it)"
            )),
            e => e,
        };
        // A network source has no file here to claim (`crate::image`).
        let (claim, note) = match spec.local_file() {
            None => (None, None),
            Some(path) if opts.read_only => {
                let (c, note) = crate::claim::Claim::read(path, opts.keep_writers_out)?;
                match note {
                    Some(n) if opts.keep_writers_out => return Err(whole_disk(Error::InUse(n))),
                    n => (Some(c), n),
                }
            }
            Some(path) => (
                Some(crate::claim::Claim::write(path).map_err(whole_disk)?),
                None,
            ),
        };
        let dev: Arc<dyn BlockDevice> = if opts.dax {
            if opts.direct_io {
                return Err(Error::InvalidInput(
                    "DAX and O_DIRECT exclude each other (DAX has no page cache to bypass)".into(),
                ));
            }
            if !spec.is_plain() || spec.local_file().is_none() {
                return Err(Error::InvalidInput(
                    "DAX maps a whole raw image file, not a partition or offset of one".into(),
                ));
            }
            Arc::new(crate::device::dax::DaxDevice::open(path, opts.read_only)?)
        } else {
            crate::image::open_device(spec, opts.read_only, opts.direct_io)?
        };
        let part_whole = spec.part == crate::image::Part::Whole;
        let hint_dev = dev.clone();
        use std::os::unix::ffi::OsStrExt;
        let name = path.as_os_str().as_bytes();
        Self::open_claimed(dev, opts, claim, note.into_iter().collect(), name, false).map_err(|e| {
            match e {
                // A whole disk with a partition table: say which partitions to open.
                Error::NotExt4(why) if part_whole => match crate::image::partition_hint(&*hint_dev)
                {
                    Some(h) => Error::NotExt4(format!("{why}; {h}")),
                    None => Error::NotExt4(why),
                },
                e => e,
            }
        })
    }

    /// Open a filesystem on `dev` (not claimed: the caller keeps others away; an MMP
    /// image is still protected against other nodes, see [`crate::mmp`]).
    pub fn open_device(dev: Arc<dyn BlockDevice>, opts: FsOptions) -> Result<Fs> {
        Self::open_claimed(dev, opts, None, Vec::new(), b"", false)
    }

    fn open_claimed(
        under: Arc<dyn BlockDevice>,
        opts: FsOptions,
        claim: Option<crate::claim::Claim>,
        mut warnings: Vec<String>,
        dev_name: &[u8],
        replaying: bool,
    ) -> Result<Fs> {
        // Multi-mount protection reads and writes its block on the device itself,
        // around the request counters, and closes the fence under everything else
        // when another node takes the image.
        let mmp_dev = under.clone();
        let fence = Arc::new(crate::mmp::Fence::new(under));
        // Every request is counted (`Fs::io_stats`), open's included.
        let counted = Arc::new(crate::device::latency::Counted::new(fence.clone()));
        let mut dev: Arc<dyn BlockDevice> = counted.clone();
        if opts.dax && dev.dax().is_none() {
            return Err(Error::InvalidInput(
                "FsOptions::dax needs a DAX device (a mapped image: crate::device::dax::DaxDevice)"
                    .into(),
            ));
        }
        let mut raw = vec![0u8; SB_SIZE];
        if dev.size_bytes() < SB_OFFSET + SB_SIZE as u64 {
            return Err(Error::NotExt4(
                "too small to hold an ext4 superblock".into(),
            ));
        }
        // The first 4 KiB in the one request: the block holding the superblock is then
        // cached for the first commit, which journals it (a slow device charges per
        // request, not per byte).
        let mut head = vec![0u8; 4096.min(dev.size_bytes()) as usize];
        dev.read_at(&mut head, 0)?;
        raw.copy_from_slice(&head[SB_OFFSET as usize..SB_OFFSET as usize + SB_SIZE]);
        crate::journal::check_ext4_magic(&raw)?;
        let sb = Superblock::decode(&raw).map_err(|e| Error::from(e.at_block(SB_OFFSET / 1024)))?;
        let mut read_only = opts.read_only;
        let fc = sb.check_features();
        if !fc.unsupported_incompat.is_empty() {
            return Err(unsupported_incompat(&fc.unsupported_incompat));
        }
        check_encoding(&sb)?;
        if !fc.unsupported_ro_compat.is_empty() && !read_only {
            warnings.push(format!(
                "read-only: image uses features rext4 cannot write: {}",
                fc.unsupported_ro_compat.join(", ")
            ));
            read_only = true;
        }
        if !read_only && dev.is_read_only() {
            read_only = true;
        }
        // ---- multi-mount protection (owner: crate::mmp) ----
        // Before anything is written, journal replay included; read-only opens leave
        // the MMP block alone, as the kernel's.
        let mmp = if !read_only && !replaying && sb.has_incompat(feature::INCOMPAT_MMP) {
            Some(crate::mmp::Session::start(mmp_dev, &sb, dev_name, fence)?)
        } else {
            None
        };
        let mut sb = sb;
        let boot_id = opts.boot_id.or_else(crate::journal::current_boot_id);
        let mut fast_commits = Vec::new();
        if sb.has_incompat(feature::INCOMPAT_RECOVER) && sb.has_compat(feature::COMPAT_HAS_JOURNAL)
        {
            // ---- journal recovery (owner: crate::journal) ----
            // Read-write: replay on the device. Read-only (asked, forced above, or a
            // read-only device): replay into an in-memory overlay and open that, so
            // the image is unchanged. Continue with the superblock as replayed.
            let mut r = crate::journal::recover_for_open(dev.clone(), read_only, boot_id)?;
            warnings.extend(r.warnings);
            read_only |= r.read_only;
            if !r.fast_commits.is_empty() {
                if replaying {
                    // Replayed below, once this filesystem is open read-write.
                    fast_commits = std::mem::take(&mut r.fast_commits);
                } else {
                    // Fast commits need an open filesystem: one of their own, read-write
                    // on the recovered device (the image, or a read-only open's
                    // overlay), replays and commits them and closes; this open then
                    // goes on from the superblock it left.
                    let nested = Fs::open_claimed(
                        r.device.clone(),
                        FsOptions {
                            read_only: false,
                            direct_io: false,
                            commit_secs: 0,
                            early_commit_ms: 0,
                            prefetch_block_bitmaps: false,
                            dax: false,
                            boot_id,
                            errors: opts.errors,
                            ..FsOptions::default()
                        },
                        None,
                        Vec::new(),
                        b"",
                        true,
                    )?;
                    warnings.extend(
                        nested
                            .warnings()
                            .iter()
                            .filter(|w| w.starts_with("fast commits replayed"))
                            .cloned(),
                    );
                    nested.close()?;
                    drop(nested);
                    let (raw, sb) = crate::journal::read_superblock(r.device.as_ref())?;
                    r.raw = raw;
                    r.sb = sb;
                }
            }
            let fc = r.sb.check_features();
            if !fc.unsupported_incompat.is_empty() {
                return Err(unsupported_incompat(&fc.unsupported_incompat));
            }
            check_encoding(&r.sb)?;
            if !fc.unsupported_ro_compat.is_empty() {
                read_only = true;
            }
            dev = r.device;
            raw = r.raw;
            sb = r.sb;
            head.clear();
            // ---- end journal recovery ----
        }
        let bs = sb.block_size();
        let dev_blocks = dev.size_bytes() / u64::from(bs);
        if sb.blocks_count > dev_blocks {
            return Err(Error::corrupted(
                format!(
                    "block count {} exceeds the device size ({} blocks of {bs} bytes)",
                    sb.blocks_count, dev_blocks
                ),
                Some(SB_OFFSET / u64::from(bs)),
            ));
        }
        // A read-only open that replayed into an overlay reads file data through the
        // page cache: the overlay is not memory that can be mapped.
        let dax = opts.dax && dev.dax().is_some();
        let cache = BufferCache::new(dev, bs as usize, sb.blocks_count, opts.cache_blocks);
        let sb_blk = SB_OFFSET / u64::from(bs);
        if let Some(b) =
            head.get((sb_blk * u64::from(bs)) as usize..((sb_blk + 1) * u64::from(bs)) as usize)
        {
            cache.insert_clean(sb_blk, b);
        }
        let csum_seed = sb.csum_seed();
        let metadata_csum = sb.metadata_csum();
        let groups = read_groups(&cache, &sb, csum_seed)?;
        // As the kernel at mount: the superblock's free counts are a summary of the
        // group descriptors (the kernel does not journal them).
        let (free_blocks, free_inodes) = groups.iter().fold((0u64, 0u64), |(b, i), g| {
            (
                b + u64::from(g.free_blocks_count),
                i + u64::from(g.free_inodes_count),
            )
        });
        // Descriptors count clusters, the superblock blocks (bigalloc).
        let free_blocks = free_blocks << sb.cluster_bits();
        let system_zone = system_zone(&sb, &groups);
        let inode_tables = groups.iter().map(|g| g.inode_table).collect();
        if !read_only && cache.device().is_read_only() {
            read_only = true;
        }
        let prefetch = prefetch::Prefetch::new(&sb, opts.mb_prefetch, opts.mb_prefetch_limit);
        let was_clean = sb.state & STATE_VALID != 0;
        let errors_field = sb.errors;
        let space = Arc::new(crate::fs::space::Space::new(
            0,
            // In clusters, as ext4's s_resv_clusters (whole clusters, counted in blocks).
            crate::fs::space::Space::pool_for(
                sb.blocks_count >> sb.cluster_bits(),
                sb.has_incompat(feature::INCOMPAT_EXTENTS),
            ) << sb.cluster_bits(),
            sb.r_blocks_count,
        ));
        let (uuid, mnt_count) = (sb.uuid, sb.mnt_count);
        let hash_seed: Vec<u8> = sb.hash_seed.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut fs = Fs {
            inner: Arc::new(Inner {
                cache,
                live: Padded(Mutex::new(Live {
                    sb: sb.clone(),
                    raw,
                    dirty: false,
                    was_clean,
                    closed: read_only,
                })),
                sb,
                dirty_groups: (0..groups.len().div_ceil(64))
                    .map(|_| std::sync::atomic::AtomicU64::new(0))
                    .collect(),
                groups: groups
                    .into_iter()
                    .enumerate()
                    .map(|(no, desc)| {
                        Padded(Mutex::new(Group {
                            desc,
                            longest_free: None,
                            bitmap_gen: 0,
                            no: no as u32,
                        }))
                    })
                    .collect(),
                inode_tables,
                txn: Padded(RwLock::new(())),
                inode_locks: inode_locks::InodeLocks::new(),
                rename_lock: Mutex::new(()),
                block_locks: (0..IO_LOCK_STRIPES)
                    .map(|_| Padded(Mutex::new(())))
                    .collect(),
                orphan_lock: Mutex::new(()),
                journal: Mutex::new(None),
                busy: Padded(Mutex::new(Busy::default())),
                syncs_started: Default::default(),
                syncs_done: Default::default(),
                commits: Default::default(),
                checkpoints: Default::default(),
                max_txn: Default::default(),
                alloc_limit: std::sync::atomic::AtomicU64::new(u64::MAX),
                shutdown: Mutex::new(None),
                unwritable: std::sync::atomic::AtomicBool::new(read_only),
                pins: Padded(Mutex::new(Default::default())),
                deferred_frees: Mutex::new(Vec::new()),
                linkable: Padded(Mutex::new(Default::default())),
                clock: opts.clock.unwrap_or(crate::fs::inode_write::now_ts),
                atime: opts.atime,
                io_locks: (0..IO_LOCK_STRIPES)
                    .map(|_| Padded(RwLock::new(())))
                    .collect(),
                tree_locks: (0..IO_LOCK_STRIPES)
                    .map(|_| Padded(RwLock::new(())))
                    .collect(),
                pagecache: crate::fs::pagecache::PageCache::new(
                    bs as usize,
                    opts.cache_bytes
                        .unwrap_or_else(crate::fs::pagecache::default_limit_bytes),
                    opts.cache_clean,
                    space.clone(),
                ),
                space,
                caches: crate::icache::Caches::new(
                    crate::icache::INODES_DEFAULT,
                    crate::icache::DENTRIES_DEFAULT,
                ),
                block_size: bs,
                csum_seed,
                metadata_csum,
                read_only,
                warnings,
                system_zone,
                claim: Mutex::new(claim),
                mmp: Mutex::new(mmp),
                boot_id,
                dax,
                dax_files: crate::fs::dax_file::DaxFiles::default(),
                errors: opts
                    .errors
                    .unwrap_or_else(|| Errors::from_superblock(errors_field)),
                errors_noted: Default::default(),
                io: counted,
                io_at_open: std::sync::OnceLock::new(),
                prefetch,
                dio_shared: Default::default(),
                dio_exclusive: Default::default(),
                write_ahead: Default::default(),
                sync_grace: opts.sync_grace,
                discard: opts.discard,
                repro: opts
                    .source_date_epoch
                    .map(|t| crate::repro::Repro::new(t, &uuid, &hash_seed, mnt_count)),
            }),
        };
        {
            let mut live = fs.live();
            live.sb.free_blocks_count = free_blocks;
            fs.inner.space.freed(free_blocks);
            live.sb.free_inodes_count = free_inodes.min(u64::from(u32::MAX)) as u32;
        }
        if !read_only {
            let journal = crate::fs::jwrite::load(&fs)?;
            let journaled = match journal {
                Some(mut j) => {
                    j.set_fixed_time(fs.inner.repro.as_ref().map(|r| r.epoch.max(0) as u64));
                    let is64 = fs.inner.sb.has_incompat(feature::INCOMPAT_64BIT);
                    if !fast_commits.is_empty() {
                        j.adopt_fast_commit_log();
                    }
                    j.prepare_rw(fs.cache().device().as_ref(), metadata_csum, is64)?;
                    fs.inner.max_txn.store(j.max_blocks().max(1), Relaxed);
                    *fs.inner.journal() = Some(j);
                    true
                }
                None => false,
            };
            let mut live = fs.live();
            match journaled {
                // As the kernel: RECOVER marks the journal as in use while open.
                true => live.sb.feature_incompat |= feature::INCOMPAT_RECOVER,
                false => {
                    // No journal: marked not clean on disk while open, as fuse2fs does,
                    // so an interrupted session is caught by e2fsck.
                    live.sb.state &= !STATE_VALID;
                }
            }
            live.sb.mnt_count = live.sb.mnt_count.wrapping_add(1);
            live.sb.mtime = fs.inner.sb_time();
            live.dirty = true;
            drop(live);
            fs.inner.write_superblock()?;
            fs.cache().device().flush()?;
            if !fast_commits.is_empty() {
                // Before orphans, as the kernel's recovery: one commit, which replaces
                // them in the journal (`crate::fc_replay`).
                let rep = fs.replay_fast_commits(&fast_commits)?;
                fs.sync()?;
                let w = format!(
                    "fast commits replayed: {} records, {} inodes, {} entries added, {} removed",
                    rep.records, rep.inodes, rep.entries_added, rep.entries_removed
                );
                if let Some(i) = Arc::get_mut(&mut fs.inner) {
                    i.warnings.push(w);
                }
            }
            // Finish what a crash left on the orphan list (as the kernel does at mount).
            let sbn = fs.superblock();
            if sbn.last_orphan != 0 || sbn.has_ro_compat(feature::RO_COMPAT_ORPHAN_PRESENT) {
                let n = fs.process_orphans()?;
                fs.sync()?;
                if n > 0 {
                    let w = format!("finished {n} orphan inode(s) left by an interrupted session");
                    if let Some(i) = Arc::get_mut(&mut fs.inner) {
                        i.warnings.push(w);
                    }
                }
            }
            // Reproducible mode: nothing on a timer decides what is written when.
            if fs.inner.repro.is_none() {
                crate::fs::jwrite::start_commit_thread(&fs, opts.commit_secs);
                crate::fs::jwrite::start_early_thread(&fs, opts.early_commit_ms);
                crate::fs::pagecache::writeback::start_writeback_thread(&fs);
            }
        }
        let _ = fs.inner.io_at_open.set(fs.inner.io.counts());
        // Last, so that the open's `Arc::get_mut`s above still work (meanwhile the
        // fence kept every write off the device if the block was lost).
        if let Some(m) = fs
            .inner
            .mmp
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            // Another node took the block: shut down, as the kernel's error handling
            // makes the filesystem read-only (the fence already refuses writes, so
            // the journal's error record is not written either).
            let inner = Arc::downgrade(&fs.inner);
            m.on_lost(Box::new(move |why| {
                if let Some(i) = inner.upgrade() {
                    i.shut_down(why);
                }
            }));
        }

        if !fs.inner.read_only && opts.prefetch_block_bitmaps && fs.inner.repro.is_none() {
            prefetch::start_prefetcher(&fs);
        }
        Ok(fs)
    }

    #[track_caller]
    pub(crate) fn live(&self) -> Ranked<MutexGuard<'_, Live>> {
        self.inner.live()
    }

    #[track_caller]
    pub(crate) fn group(&self, g: usize) -> Result<Ranked<MutexGuard<'_, Group>>> {
        self.inner.group(g)
    }

    /// The identity the lock-order check (`lockdep`) knows this filesystem by.
    pub(crate) fn lock_id(&self) -> usize {
        self.inner.lock_id()
    }

    /// The I/O lock of `ino`, shared (reads, in-place overwrites).
    #[track_caller]
    pub(crate) fn io_shared(&self, ino: Ino) -> Ranked<RwLockReadGuard<'_, ()>> {
        self.ranked_read(Rank::Io, self.io_stripe(ino))
    }

    /// The I/O lock of `ino`, exclusive (mapping changes); before `write_lock`.
    #[track_caller]
    pub(crate) fn io_exclusive(&self, ino: Ino) -> Ranked<RwLockWriteGuard<'_, ()>> {
        self.ranked_write(Rank::Io, self.io_stripe(ino))
    }

    fn io_stripe(&self, ino: Ino) -> &RwLock<()> {
        &self.inner.io_locks[ino.0 as usize % IO_LOCK_STRIPES]
    }

    fn tree_stripe(&self, ino: Ino) -> &RwLock<()> {
        &self.inner.tree_locks[ino.0 as usize % IO_LOCK_STRIPES]
    }

    /// `lock` shared, recorded at `rank` for the lock-order check.
    #[track_caller]
    fn ranked_read<'a>(&self, rank: Rank, lock: &'a RwLock<()>) -> Ranked<RwLockReadGuard<'a, ()>> {
        let held = Held::acquire(self.lock_id(), rank);
        Ranked::new(held, lock.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// `lock` exclusive, recorded at `rank` for the lock-order check.
    #[track_caller]
    fn ranked_write<'a>(
        &self,
        rank: Rank,
        lock: &'a RwLock<()>,
    ) -> Ranked<RwLockWriteGuard<'a, ()>> {
        let held = Held::acquire(self.lock_id(), rank);
        Ranked::new(held, lock.write().unwrap_or_else(|p| p.into_inner()))
    }

    /// The tree lock of `ino`, shared: a lockless reader of its extent tree (not
    /// under the write lock) keeps writeback from changing it meanwhile.
    #[track_caller]
    pub(crate) fn tree_shared(&self, ino: Ino) -> Ranked<RwLockReadGuard<'_, ()>> {
        self.ranked_read(Rank::Tree, self.tree_stripe(ino))
    }

    /// The tree lock of `ino`, exclusive (writeback, before the write lock).
    #[track_caller]
    pub(crate) fn tree_exclusive(&self, ino: Ino) -> Ranked<RwLockWriteGuard<'_, ()>> {
        self.ranked_write(Rank::Tree, self.tree_stripe(ino))
    }

    /// Take the write lock: the transaction, exclusively (no handle is open while it
    /// is held). When the guard goes and too many metadata blocks are dirty, they are
    /// committed (errors surface at the next `sync`, whose flush retries them).
    #[track_caller]
    pub(crate) fn write_lock(&self) -> WriteGuard<'_> {
        let held = Held::acquire(self.lock_id(), Rank::Write);
        let g = WriteGuard {
            inner: &self.inner,
            _g: self.inner.txn.write().unwrap_or_else(|p| {
                // A thread panicked holding it: what it left half done must never be
                // committed (its own release aborted already; this is the latch).
                self.inner
                    .shut_down("an operation panicked holding the write lock".into());
                p.into_inner()
            }),
            _held: held,
            check_on_drop: true,
            read_errors_at: crate::cache::thread_read_errors(),
            writes_at: crate::cache::thread_writes(),
        };
        HOLDS_WRITE_LOCK.with(|h| h.set(true));
        g
    }

    /// Start a handle: join the running transaction beside other handles (the
    /// transaction shared). The operation then takes the inode locks of what it
    /// changes (`lock_dir`, `lock_nondir`), and block locks for blocks other inodes
    /// share. Before it joins, a transaction grown past its commit threshold is
    /// committed; the threshold keeps half the journal's transaction size as room for
    /// the handles open at once, each of which changes a bounded number of blocks (a
    /// namespace operation: its directory's blocks and index, two inodes, bitmaps; the
    /// final free of a file — one extent tree — like the write lock's operations).
    /// On release the same checks as the write lock's run (abort after a failure
    /// halfway; commit when grown), the commit after the handle is closed and by
    /// group commit (`commit_concurrently`: only closing the transaction excludes the
    /// other handles, not writing it).
    #[track_caller]
    pub(crate) fn handle(&self) -> Handle<'_> {
        if !self.inner.read_only && self.inner.txn_full() {
            // Errors latch the shutdown, which the operation then meets.
            let _ = self.commit_concurrently(None);
        }
        let held = Held::acquire(self.lock_id(), Rank::Write);
        let g = self.inner.txn.read().unwrap_or_else(|p| {
            self.inner
                .shut_down("an operation panicked holding the write lock".into());
            p.into_inner()
        });
        HOLDS_WRITE_LOCK.with(|h| h.set(true));
        Handle {
            fs: self,
            g: Some(g),
            held: Some(held),
            read_errors_at: crate::cache::thread_read_errors(),
            writes_at: crate::cache::thread_writes(),
        }
    }

    /// The inode lock of directory `ino` (under a handle; see `inode_locks`).
    #[track_caller]
    pub(crate) fn lock_dir(&self, ino: Ino) -> inode_locks::InodeGuard<'_> {
        let held = Held::acquire(self.lock_id(), Rank::Dir);
        self.inner.inode_locks.lock(ino.0, held)
    }

    /// The inode lock of directory `ino`, shared with others who take it shared: for
    /// a change to one leaf of its htree that leaves the index, the directory's size
    /// and its other leaves alone (`ops`: a create or unlink in the name's leaf alone,
    /// under that leaf's block lock). Whoever takes it exclusively waits for them and
    /// keeps new ones out.
    #[track_caller]
    pub(crate) fn lock_dir_shared(&self, ino: Ino) -> inode_locks::InodeGuard<'_> {
        let held = Held::acquire(self.lock_id(), Rank::Dir);
        self.inner.inode_locks.lock_shared(ino.0, held)
    }

    /// The inode lock of `ino`, a non-directory or an inode whose kind is not known
    /// yet (under a handle, after any directory's lock).
    #[track_caller]
    pub(crate) fn lock_nondir(&self, ino: Ino) -> inode_locks::InodeGuard<'_> {
        let held = Held::acquire(self.lock_id(), Rank::NonDir);
        self.inner.inode_locks.lock(ino.0, held)
    }

    /// The inode locks of a rename's non-directories: `a`, and `b` when it is another
    /// inode, the lower number first (as every thread that holds two does; one that
    /// holds one waits for no other inode lock, so there is no cycle).
    #[track_caller]
    pub(crate) fn lock_nondirs(
        &self,
        a: Ino,
        b: Option<Ino>,
    ) -> (
        inode_locks::InodeGuard<'_>,
        Option<inode_locks::InodeGuard<'_>>,
    ) {
        match b.filter(|&b| b != a) {
            None => (self.lock_nondir(a), None),
            Some(b) => {
                let (lo, hi) = (a.min(b), a.max(b));
                let first = self.lock_nondir(lo);
                let held = Held::acquire(self.lock_id(), Rank::SecondNonDir);
                (first, Some(self.inner.inode_locks.lock(hi.0, held)))
            }
        }
    }

    /// The rename lock: taken before a second directory's lock.
    #[track_caller]
    pub(crate) fn rename_lock(&self) -> Ranked<MutexGuard<'_, ()>> {
        let held = Held::acquire(self.lock_id(), Rank::Rename);
        Ranked::new(
            held,
            self.inner
                .rename_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// The read-modify-write lock of metadata block `blk` (a stripe of them).
    #[track_caller]
    pub(crate) fn block_lock(&self, blk: u64) -> Ranked<MutexGuard<'_, ()>> {
        let held = Held::acquire(self.lock_id(), Rank::Block);
        let m = &self.inner.block_locks[(blk % IO_LOCK_STRIPES as u64) as usize];
        Ranked::new(held, m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The orphan list's lock.
    #[track_caller]
    pub(crate) fn orphan_lock(&self) -> Ranked<MutexGuard<'_, ()>> {
        let held = Held::acquire(self.lock_id(), Rank::Orphan);
        Ranked::new(
            held,
            self.inner
                .orphan_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// Whether this thread holds the write lock (of any filesystem).
    pub(crate) fn holds_write_lock() -> bool {
        HOLDS_WRITE_LOCK.with(|h| h.get())
    }

    /// Fail with `ReadOnly` unless the filesystem is writable.
    pub(crate) fn check_writable(&self) -> Result<()> {
        self.inner.settle_errors(0);
        if !self
            .inner
            .unwritable
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        if let Some(why) = self
            .inner
            .shutdown
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(Error::ShutDown(why));
        }
        if self.inner.read_only || self.live().closed {
            Err(Error::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Write every change to the device and flush it (`syncfs`): all dirty file data,
    /// then a journal commit.
    pub fn sync(&self) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        let freed = self.free_deferred();
        let data = self.writeback_all();
        let dax = self.dax_write_back_dirty(None);
        self.sync_metadata()?;
        if self.is_dax() {
            self.cache().device().flush()?;
        }
        freed.and(data).and(dax)
    }

    /// Commit the metadata changes made so far (what jbd2's periodic commit does):
    /// dirty file data stays in the page cache.
    /// Make everything changed so far survive a crash of this process (not of the
    /// machine): file data written to the image, metadata to the log as an early
    /// commit (`FsOptions::early_commit_ms`; the next open in the same boot replays
    /// it). Nothing is flushed; [`Fs::sync`] makes it durable.
    pub fn early_commit(&self) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        self.writeback_every_file(false)?;
        let _w = self.write_lock();
        self.inner.early_commit_locked()
    }

    /// Write the committed metadata waiting in the log home and empty the log (the
    /// periodic commit thread does this when the filesystem is idle).
    pub(crate) fn checkpoint_idle(&self) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        let _w = self.write_lock();
        self.inner.checkpoint_locked()
    }

    /// The commit an fsync waits for (after writing the file's data back): the first
    /// sync that started after this call's changes were made. When another thread's
    /// sync started later and has finished, it committed (and flushed) them already
    /// and nothing is written: concurrent fsyncs share one commit (group commit).
    pub(crate) fn fsync_commit(&self) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        // Every change this fsync must make durable was made before this load: it is
        // in the transaction of sync `mine` or an earlier one.
        let mine = self.inner.syncs_started.load(SeqCst);
        self.commit_concurrently(Some(mine))
    }

    /// Commit (or, for `Some(mine)`, make sure a sync numbered `mine` or later has
    /// completed). The write lock is held only while the running transaction is
    /// closed; it is written under the journal's mutex alone, so operations go on
    /// meanwhile (into the next transaction), and fsyncs that arrive meanwhile share
    /// the next commit.
    fn commit_concurrently(&self, mine: Option<u64>) -> Result<()> {
        group_commit::commit(&CommitSteps(self), mine)
    }

    /// Journal commits and checkpoints written since the filesystem was opened.
    pub fn journal_stats(&self) -> JournalStats {
        JournalStats {
            commits: self.inner.commits.load(Relaxed),
            checkpoints: self.inner.checkpoints.load(Relaxed),
        }
    }

    pub fn sync_metadata(&self) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        self.commit_concurrently(None)
    }

    /// Write everything and mark the filesystem clean again. Further writes fail with
    /// `ReadOnly`. Dropping the last handle of a read-write `Fs` does this too, but only
    /// `close` reports errors.
    pub fn close(&self) -> Result<()> {
        let data = if self.inner.read_only || self.live().closed {
            Ok(())
        } else {
            // DAX: stores through mappings are written back; the close's commit
            // fences them (as the kernel syncs a DAX filesystem at unmount).
            let freed = self.free_deferred();
            freed
                .and(self.writeback_all())
                .and(self.dax_write_back_dirty(None))
        };
        self.inner.pagecache.stop_writeback();
        self.inner.prefetch.stop();
        let _w = self.write_lock();
        self.inner.close()?;
        // Closed and clean: others may have the image now.
        self.inner
            .claim
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        data
    }

    pub fn superblock(&self) -> Superblock {
        self.live().sb.clone()
    }

    /// The MMP block as the device holds it now (read past every cache: another node
    /// may have written it), when the image has multi-mount protection.
    pub fn mmp_block(&self) -> Result<Option<rext4_format::mmp::MmpBlock>> {
        let sb = &self.inner.sb;
        if !sb.has_incompat(feature::INCOMPAT_MMP) {
            return Ok(None);
        }
        let blk = sb.mmp_block;
        if blk <= u64::from(sb.first_data_block) || blk >= sb.blocks_count {
            return Err(Error::corrupted(
                format!("MMP block number {blk} is outside the filesystem"),
                None,
            ));
        }
        let bs = u64::from(self.inner.block_size);
        let mut b = vec![0u8; bs as usize];
        self.cache().device().read_fresh(&mut b, blk * bs)?;
        let seed = self.inner.metadata_csum.then_some(self.inner.csum_seed);
        let m = rext4_format::mmp::MmpBlock::decode(&b, seed)
            .map_err(|e| Error::from(e.at_block(blk)))?;
        Ok(Some(m))
    }
    /// Every group descriptor as it is now.
    pub fn group_descs(&self) -> Vec<GroupDesc> {
        (0..self.inner.groups.len())
            .filter_map(|g| self.group(g).ok().map(|grp| grp.desc.clone()))
            .collect()
    }
    pub fn block_size(&self) -> u32 {
        self.inner.block_size
    }
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }
    /// Messages the user should see about how the image was opened.
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }
    pub(crate) fn cache(&self) -> &BufferCache {
        &self.inner.cache
    }

    /// Read and verify inode `ino` (from the inode cache when it holds it).
    pub fn read_inode(&self, ino: Ino) -> Result<Inode> {
        let cache = &self.inner.caches.inodes;
        if let Some(i) = cache.get(&ino.0) {
            return Ok((*i).clone());
        }
        let ticket = cache.ticket(&ino.0);
        let (raw, blk) = self.inode_bytes(ino)?;
        if self.inner.metadata_csum {
            fmt_inode::verify_csum(&raw, ino.0, self.inner.csum_seed).at(blk)?;
        }
        let inode = Inode::decode(&raw).at(blk)?;
        cache.fill(ino.0, Arc::new(inode.clone()), ticket);
        Ok(inode)
    }

    /// The size in the inode record of `ino` (no copy of the record when cached).
    pub(crate) fn record_size(&self, ino: Ino) -> Result<u64> {
        if let Some(i) = self.inner.caches.inodes.get(&ino.0) {
            return Ok(i.size);
        }
        Ok(self.read_inode(ino)?.size)
    }

    /// Begin a lockless read that goes from a name to an inode (path walk, FUSE
    /// lookup): no inode number freed while the guard lives is handed out again
    /// before it is dropped (SEEDS lesson C; see `grace.rs`).
    pub fn read_guard(&self) -> crate::grace::ReadGuard<'_> {
        self.inner.caches.grace.read()
    }

    /// (hits, misses) of the inode cache and of the dentry cache.
    pub fn cache_stats(&self) -> ((u64, u64), (u64, u64)) {
        let c = &self.inner.caches;
        (c.inodes.stats(), c.dentries.stats())
    }

    /// Where inode `ino`'s record lives: (inode table block, byte offset in it).
    /// Inode tables do not move while the filesystem is open, so no group lock.
    pub(crate) fn inode_location(&self, ino: Ino) -> Result<(u64, usize)> {
        let (g, idx) = self.inode_slot(ino)?;
        let table = *self.inner.inode_tables.get(g).ok_or_else(|| {
            Error::corrupted(
                format!("inode {} in a group that does not exist", ino.0),
                None,
            )
        })?;
        Ok(self.in_table(table, idx))
    }

    /// (group, index in the group's table) of inode `ino`, checked against the count.
    fn inode_slot(&self, ino: Ino) -> Result<(usize, u64)> {
        let sb = &self.inner.sb;
        if ino.0 == 0 || ino.0 > sb.inodes_count {
            return Err(Error::corrupted(
                format!("inode number {} out of range", ino.0),
                None,
            ));
        }
        let ipg = sb.inodes_per_group;
        Ok((((ino.0 - 1) / ipg) as usize, u64::from((ino.0 - 1) % ipg)))
    }

    /// (block, byte offset) of the record at `idx` of the table starting at `table`.
    fn in_table(&self, table: u64, idx: u64) -> (u64, usize) {
        let isz = u64::from(self.inner.sb.inode_size);
        let bs = u64::from(self.inner.block_size);
        (
            table.saturating_add(idx * isz / bs),
            ((idx * isz) % bs) as usize,
        )
    }

    /// The raw record of inode `ino` and the block it lives in.
    pub fn inode_bytes(&self, ino: Ino) -> Result<(Vec<u8>, u64)> {
        let (g, idx) = self.inode_slot(ino)?;
        let (table, uninit) = {
            let gd = &self.group(g)?.desc;
            (gd.inode_table, gd.has_flag(group::FLAG_INODE_UNINIT))
        };
        let isz = u64::from(self.inner.sb.inode_size);
        if uninit {
            // Never initialized: reads as a zeroed record.
            return Ok((vec![0u8; isz as usize], table));
        }
        let (blk, off) = self.in_table(table, idx);
        let data = self.inner.cache.read(blk, Kind::InodeTable, |_| Ok(()))?;
        let rec = data
            .get(off..off + isz as usize)
            .ok_or_else(|| Error::corrupted("inode record outside its block", Some(blk)))?;
        Ok((rec.to_vec(), blk))
    }

    /// Inode seed for checksums of blocks owned by this inode.
    pub(crate) fn inode_seed(&self, ino: Ino, inode: &Inode) -> u32 {
        rext4_format::csum::inode_seed(self.inner.csum_seed, ino.0, inode.generation)
    }
}

pub(crate) fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Inner {
    /// The time the superblock records for a mount or a write: now, or the epoch in
    /// reproducible mode.
    pub(crate) fn sb_time(&self) -> i64 {
        match &self.repro {
            Some(r) => r.epoch,
            None => now(),
        }
    }

    /// Whether the running transaction should be committed now: the cache is half
    /// dirty, the dirty set approaches half the log, or freed-but-busy blocks crowd the
    /// free space (they are reusable only after a commit).
    /// Whether the operation that began when this thread had `read_errors_at` failed
    /// metadata reads and `writes_at` metadata writes both read in error and changed
    /// metadata since: then it aborted here (ext4's abort: what it left in the
    /// running transaction must never be committed).
    fn failed_halfway(&self, read_errors_at: u64, writes_at: u64) -> bool {
        if crate::cache::thread_read_errors() > read_errors_at
            && crate::cache::thread_writes() > writes_at
        {
            self.abort(
                "a metadata read failed (device error or corruption) in an operation \
                 that had changed metadata; the running transaction is dropped"
                    .into(),
            );
            return true;
        }
        false
    }

    /// The running transaction has grown to its commit threshold (atomics only: the
    /// check at every handle's start).
    fn txn_full(&self) -> bool {
        if self.cache.wants_writeback() {
            return true;
        }
        let max = self.max_txn.load(Relaxed);
        max > 0 && self.cache.dirty_count() + self.groups.len() / 8 + 2 > max / 2
    }

    fn wants_commit(&self) -> bool {
        if self.txn_full() {
            return true;
        }
        if self.max_txn.load(Relaxed) == 0 {
            return false;
        }
        let busy = self.busy().block_count;
        busy > 0 && self.live().sb.free_blocks_count < 2 * busy + 1024
    }

    #[track_caller]
    fn live(&self) -> Ranked<MutexGuard<'_, Live>> {
        let held = Held::acquire(self.lock_id(), Rank::Live);
        Ranked::new(held, self.live.lock().unwrap_or_else(|p| p.into_inner()))
    }

    #[track_caller]
    fn group(&self, g: usize) -> Result<Ranked<MutexGuard<'_, Group>>> {
        let m = self
            .groups
            .get(g)
            .ok_or_else(|| Error::corrupted(format!("group {g} does not exist"), None))?;
        let held = Held::acquire(self.lock_id(), Rank::Group);
        Ok(Ranked::new(
            held,
            m.lock().unwrap_or_else(|p| p.into_inner()),
        ))
    }

    #[track_caller]
    pub(crate) fn journal(&self) -> Ranked<MutexGuard<'_, Option<crate::fs::jwrite::Journal>>> {
        let held = Held::acquire(self.lock_id(), Rank::Journal);
        Ranked::new(held, self.journal.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The journal's mutex unless a commit holds it (no waiting).
    #[track_caller]
    fn try_journal(&self) -> Option<Ranked<MutexGuard<'_, Option<crate::fs::jwrite::Journal>>>> {
        let held = Held::acquire(self.lock_id(), Rank::Journal);
        match self.journal.try_lock() {
            Ok(g) => Some(Ranked::new(held, g)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(Ranked::new(held, p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    #[track_caller]
    pub(crate) fn busy(&self) -> Ranked<MutexGuard<'_, Busy>> {
        let held = Held::acquire(self.lock_id(), Rank::Busy);
        Ranked::new(held, self.busy.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn lock_id(&self) -> usize {
        self as *const Inner as usize
    }

    /// Encode the live superblock and write it to byte 1024 (the primary copy).
    pub(crate) fn write_superblock(&self) -> Result<()> {
        let mut live = self.live();
        live.sb.wtime = self.sb_time();
        let mut raw = live.raw.clone();
        live.sb.encode_into(&mut raw);
        self.cache.device().write_at(&raw, SB_OFFSET)?;
        live.raw = raw;
        live.dirty = false;
        Ok(())
    }

    /// Write changed group descriptors into their GDT blocks (through the cache): the
    /// groups `dirty_groups` names (a change sets the bit under the group's mutex; the
    /// bit is taken before the mutex here, so a change after that is written by the
    /// next commit too).
    fn write_group_descs(&self) -> Result<()> {
        let sb = &self.sb;
        let ds = sb.desc_size();
        let per_block = sb.descs_per_block();
        let kind = DescCsum::of(sb, self.csum_seed);
        let mut by_block: std::collections::BTreeMap<u64, Vec<(usize, GroupDesc)>> =
            Default::default();
        for (w, word) in self.dirty_groups.iter().enumerate() {
            let mut bits = word.swap(0, Relaxed);
            while bits != 0 {
                let g = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let desc = self.group(g)?.desc.clone();
                let blk = sb.desc_block_location(g as u64 / per_block);
                by_block.entry(blk).or_default().push((g, desc));
            }
        }
        for (blk, descs) in by_block {
            let mut data = self.cache.read(blk, Kind::GroupDesc, |_| Ok(()))?.to_vec();
            for (g, d) in descs {
                let off = (g as u64 % per_block) as usize * ds;
                if let Some(bytes) = data.get_mut(off..off + ds) {
                    d.encode_into(bytes, ds, g as u32, kind);
                }
            }
            self.cache.write(blk, Kind::GroupDesc, data, |_| Ok(()))?;
        }
        Ok(())
    }

    /// Latch the shutdown (a failed commit, early commit or checkpoint): every later
    /// change fails with `ShutDown` naming the first reason, which is also logged —
    /// an error of a background commit reaches the next fsync or sync and the log.
    pub(crate) fn shut_down(&self, why: String) {
        let mut s = self.shutdown.lock().unwrap_or_else(|p| p.into_inner());
        if s.is_none() {
            log::error!("rext4: shutting the filesystem down: {why}");
            *s = Some(why);
        }
        self.unwritable
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Abort the journal (jbd2's abort): shut down, so nothing of the running
    /// transaction is committed, and record the error in the journal superblock, so
    /// whoever recovers the image marks it as having errors (the running
    /// transaction's superblock, with the error state, is never committed). Takes the
    /// journal's mutex: never called holding it.
    pub(crate) fn abort(&self, why: String) {
        let mut jguard = self.journal();
        self.abort_journal(jguard.as_mut(), why);
    }

    /// [`Inner::abort`] for a caller that holds the journal (a failed commit, early
    /// commit or checkpoint).
    fn abort_journal(&self, j: Option<&mut crate::fs::jwrite::Journal>, why: String) {
        self.shut_down(why);
        if let Some(j) = j {
            // Best effort: the device may be what failed.
            let _ = j.record_abort(self.cache.device().as_ref(), -5);
        }
    }

    /// Mark the superblock with the metadata errors the cache met since the last call
    /// and `extra` found elsewhere, and follow `errors=` (ext4_error's handling): with
    /// remount-ro or panic, abort. Read-only opens and closed filesystems change
    /// nothing. Takes `live` and, to abort, the journal's mutex.
    pub(crate) fn settle_errors(&self, extra: u64) {
        use std::sync::atomic::Ordering::SeqCst;
        if self.read_only {
            return;
        }
        // Every change's start comes here: a load when nothing is new. Of threads
        // that find new errors at once, one takes them (fetch_max).
        let seen = self.cache.errors_seen();
        if extra == 0 && seen <= self.errors_noted.load(SeqCst) {
            return;
        }
        let noted = self.errors_noted.fetch_max(seen, SeqCst);
        let n = seen.saturating_sub(noted) + extra;
        if n == 0 {
            return;
        }
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            if live.closed {
                return;
            }
            live.sb.state |= rext4_format::superblock::STATE_ERROR;
            live.sb.error_count = live.sb.error_count.saturating_add(n as u32);
            live.dirty = true;
        }
        log::error!("rext4: {n} metadata error(s) found; the filesystem is marked with errors");
        if self.errors != Errors::Continue {
            self.abort(format!(
                "errors={}: a metadata read failed or found corruption",
                if self.errors == Errors::Panic {
                    "panic"
                } else {
                    "remount-ro"
                }
            ));
        }
    }

    /// `ShutDown` once a failed commit latched the shutdown.
    fn not_shut_down(&self) -> Result<()> {
        match self
            .shutdown
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            Some(why) => Err(Error::ShutDown(why)),
            None => Ok(()),
        }
    }

    /// Caller holds the write lock. With a journal, a failure shuts the filesystem
    /// down: nothing more is written, and what was committed stays committed.
    pub(crate) fn sync_locked(&self) -> Result<()> {
        self.not_shut_down()?;
        let mut jguard = self.journal();
        if jguard.is_none() {
            drop(jguard);
            let n = self.syncs_started.fetch_add(1, SeqCst);
            self.write_group_descs()?;
            self.cache.flush()?;
            self.write_superblock()?;
            self.cache.device().flush()?;
            self.syncs_done.fetch_max(n + 1, SeqCst);
            return Ok(());
        }
        let txn = self.close_transaction();
        self.write_transaction(&mut jguard, txn)
    }

    /// Close the running transaction (caller holds the write lock and the journal):
    /// number the sync, put descriptors and superblock into the cache, and take what
    /// the commit will write — the dirty blocks, the revoke records, the blocks freed
    /// so far (busy until the commit is done). From here on, changes go to the next
    /// transaction; the write lock may be given up while this one is written.
    fn close_transaction(&self) -> Result<Closed> {
        let n = self.syncs_started.fetch_add(1, SeqCst);
        if self.nothing_to_commit() {
            return Ok(Closed {
                n,
                dirty: Vec::new(),
                revoked: Vec::new(),
                freed: Default::default(),
                flush_only: true,
            });
        }
        self.write_group_descs()?;
        self.superblock_into_cache()?;
        let dirty = self.cache.dirty_blocks();
        self.cache.begin_commit(&dirty);
        let revoked = self.cache.take_revoked();
        let freed = self.busy().blocks.clone();
        Ok(Closed {
            n,
            dirty,
            revoked,
            freed,
            flush_only: false,
        })
    }

    /// Write a closed transaction (caller holds the journal; the write lock is not
    /// needed): commit it, or only flush when nothing was dirty. A failure latches
    /// the shutdown.
    fn write_transaction(
        &self,
        jguard: &mut Option<crate::fs::jwrite::Journal>,
        txn: Result<Closed>,
    ) -> Result<()> {
        let r = txn.and_then(|txn| {
            let n = txn.n;
            if txn.flush_only {
                // File data written since the last flush still needs one.
                self.cache.device().flush()?;
            } else if let Some(j) = jguard.as_mut() {
                let r = self.commit_and_checkpoint(j, txn.dirty, txn.revoked);
                self.cache.end_commit();
                r?;
                if self.discard {
                    // Still busy here: nobody allocates them while they go.
                    let bs = u64::from(self.block_size);
                    for (&start, &len) in &txn.freed {
                        let _ = self.cache.device().discard(start * bs, len * bs);
                    }
                }
                self.busy().remove_runs(&txn.freed);
            }
            self.syncs_done.fetch_max(n + 1, SeqCst);
            Ok(())
        });
        if let Err(e) = &r {
            self.abort_journal(jguard.as_mut(), format!("journal commit failed: {e}"));
        }
        r
    }

    /// No metadata changed since the last commit: no dirty block, revoke, group
    /// descriptor or superblock counter.
    fn nothing_to_commit(&self) -> bool {
        if self.cache.dirty_count() > 0 || self.cache.has_revoked() || self.live().dirty {
            return false;
        }
        // A changed descriptor has its bit set until a commit writes it.
        self.dirty_groups.iter().all(|w| w.load(Relaxed) == 0)
    }

    /// An early commit of the metadata changed since the last one (no flush; see
    /// `FsOptions::early_commit_ms`), or a commit when the log has no room for it.
    /// Caller holds the write lock and wrote the file data back first.
    pub(crate) fn early_commit_locked(&self) -> Result<()> {
        let Some(boot) = self.boot_id else {
            return Ok(());
        };
        self.not_shut_down()?;
        // A commit being written covers all this and more: no early commit now.
        let Some(mut jguard) = self.try_journal() else {
            return Ok(());
        };
        let Some(j) = jguard.as_mut() else {
            return Ok(());
        };
        self.write_group_descs()?;
        self.superblock_into_cache()?;
        let dirty = self.cache.dirty_blocks();
        if dirty.is_empty() {
            return Ok(());
        }
        let dev = self.cache.device().clone();
        // A chain only starts on an empty log (recovery replays it only there).
        if let Err(e) = self.checkpoint(j) {
            self.abort_journal(Some(j), format!("journal checkpoint failed: {e}"));
            return Err(e);
        }
        match j.early_commit(dev.as_ref(), &dirty, &boot) {
            Ok(crate::fs::jwrite::EarlyOutcome::NoRoom) => {
                drop(jguard);
                self.sync_locked()
            }
            Ok(_) => Ok(()),
            Err(e) => {
                self.abort_journal(Some(j), format!("journal early commit failed: {e}"));
                Err(e.into())
            }
        }
    }

    /// Commit a closed transaction (with the revoke records of the logged blocks it
    /// freed); checkpoint first when the log has no room for it, and after it when
    /// the logged blocks crowd the cache. Caller holds the journal.
    fn commit_and_checkpoint(
        &self,
        j: &mut crate::fs::jwrite::Journal,
        dirty: Vec<(u64, Arc<[u8]>)>,
        mut revoked: Vec<u64>,
    ) -> Result<()> {
        let dev = self.cache.device().clone();
        // One transaction per sync; larger dirty sets (only possible for a single huge
        // operation, since writeback starts at half the log) are split.
        let mut rest = &dirty[..];
        while !rest.is_empty() || !revoked.is_empty() {
            let take = rest.len().min(j.max_blocks_with(revoked.len()).max(1));
            let (txn, after) = rest.split_at(take);
            if !j.has_room(txn.len(), revoked.len()) {
                self.checkpoint(j)?;
                // Nothing they name is in the log any more.
                revoked.clear();
                if txn.is_empty() {
                    break;
                }
            }
            j.commit(dev.as_ref(), txn, &revoked)?;
            self.commits.fetch_add(1, Relaxed);
            self.cache.committed(txn);
            self.cache.revokes_committed(&revoked);
            revoked.clear();
            rest = after;
        }
        if self.cache.wants_checkpoint() {
            self.checkpoint(j)?;
        }
        Ok(())
    }

    /// Write every committed block home, flush, and empty the log (nothing to do when
    /// it is empty). Caller holds the write lock and the journal.
    fn checkpoint(&self, j: &mut crate::fs::jwrite::Journal) -> Result<()> {
        if j.log_is_empty() {
            return Ok(());
        }
        let dev = self.cache.device().clone();
        self.cache.checkpoint()?;
        self.checkpoints.fetch_add(1, Relaxed);
        dev.flush()?;
        j.checkpointed(dev.as_ref())?;
        // The empty log must be durable before anything overwrites the old one (a
        // lost superblock write would leave it pointing at half-overwritten
        // transactions) and before the superblock may say no recovery is needed.
        dev.flush()?;
        self.cache.log_emptied();
        Ok(())
    }

    /// Checkpoint an idle filesystem's log (the periodic commit thread, when nothing
    /// is dirty). Caller holds the write lock.
    pub(crate) fn checkpoint_locked(&self) -> Result<()> {
        self.not_shut_down()?;
        let mut jguard = self.journal();
        let Some(j) = jguard.as_mut() else {
            return Ok(());
        };
        let r = self.checkpoint(j);
        if let Err(e) = &r {
            self.abort_journal(Some(j), format!("journal checkpoint failed: {e}"));
        }
        r
    }

    /// Put the live superblock into its block in the cache (journaled like any block).
    fn superblock_into_cache(&self) -> Result<()> {
        let bs = self.block_size as u64;
        let blk = SB_OFFSET / bs;
        let off = (SB_OFFSET % bs) as usize;
        let mut data = self.cache.read(blk, Kind::Raw, |_| Ok(()))?.to_vec();
        let mut live = self.live();
        live.sb.wtime = self.sb_time();
        let mut raw = live.raw.clone();
        live.sb.encode_into(&mut raw);
        data[off..off + SB_SIZE].copy_from_slice(&raw);
        live.raw = raw;
        live.dirty = false;
        drop(live);
        self.cache.write(blk, Kind::Raw, data, |_| Ok(()))
    }

    /// Caller holds the write lock (or is the last owner). The MMP block is released
    /// last, whatever the rest did: nothing more is written after a close.
    fn close(&self) -> Result<()> {
        let r = self.close_journaled();
        let mmp = self.mmp.lock().unwrap_or_else(|p| p.into_inner()).take();
        match mmp {
            Some(m) => r.and(m.stop()),
            None => r,
        }
    }

    fn close_journaled(&self) -> Result<()> {
        if self.read_only || self.live().closed {
            return Ok(());
        }
        self.sync_locked()?;
        // Everything home before the superblock says no recovery is needed.
        self.checkpoint_locked()?;
        let journaled = self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .is_some();
        let mut live = self.live();
        if live.was_clean {
            live.sb.state |= STATE_VALID;
        }
        if journaled {
            live.sb.feature_incompat &= !feature::INCOMPAT_RECOVER;
        }
        live.closed = true;
        self.unwritable
            .store(true, std::sync::atomic::Ordering::Release);
        drop(live);
        self.write_superblock()?;
        self.cache.device().flush()?;
        Ok(())
    }
}

/// Guard of [`Inner::write_lock`]; see [`Fs::write_lock`].
pub(crate) struct WriteGuard<'a> {
    inner: &'a Inner,
    _g: RwLockWriteGuard<'a, ()>,
    /// Dropped after the lock (fields drop in order).
    _held: Held,
    /// On release: abort after a failure halfway, or commit when the running
    /// transaction has grown large (not when the caller commits itself).
    check_on_drop: bool,
    /// This thread's metadata read errors and the cache's accepted writes when the
    /// lock was taken: both grown at release means the operation failed halfway.
    read_errors_at: u64,
    writes_at: u64,
}

impl WriteGuard<'_> {
    /// Give the lock up without the checks of a release (the caller holds the
    /// journal's mutex and commits, or aborts when closing the transaction failed).
    fn release_without_commit(mut self) {
        self.check_on_drop = false;
    }
}

/// A handle: the running transaction shared (see [`Fs::handle`]).
pub(crate) struct Handle<'a> {
    fs: &'a Fs,
    g: Option<RwLockReadGuard<'a, ()>>,
    held: Option<Held>,
    read_errors_at: u64,
    writes_at: u64,
}

impl Drop for Handle<'_> {
    fn drop(&mut self) {
        let inner = &*self.fs.inner;
        let mut settled = false;
        if inner.read_only {
            // Nothing to check.
        } else if std::thread::panicking() {
            inner.abort(
                "an operation panicked in a handle; the running transaction is dropped".into(),
            );
        } else if !inner.failed_halfway(self.read_errors_at, self.writes_at) {
            inner.settle_errors(0);
            settled = true;
        }
        drop(self.g.take());
        drop(self.held.take());
        HOLDS_WRITE_LOCK.with(|h| h.set(false));
        self.fs.finish_sync_grace();
        // Looked at once, after the handle is closed (another thread may have
        // committed meanwhile).
        if settled && inner.wants_commit() {
            // Written outside the write lock: the other handles go on meanwhile.
            // Errors latch the shutdown (the next operation or sync meets it).
            let _ = self.fs.commit_concurrently(None);
        }
    }
}

thread_local! {
    /// This thread's failed metadata reads when it last called `note_error`.
    static NOTED_READ_ERRORS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static HOLDS_WRITE_LOCK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.check_on_drop || self.inner.read_only {
            // Nothing to check.
        } else if std::thread::panicking() {
            // The operation stopped halfway: abort rather than commit any of it.
            self.inner.abort(
                "an operation panicked holding the write lock; the running \
                 transaction is dropped"
                    .into(),
            );
        } else if self
            .inner
            .failed_halfway(self.read_errors_at, self.writes_at)
        {
            // Aborted.
        } else {
            self.inner.settle_errors(0);
            if self.inner.wants_commit() {
                let _ = self.inner.sync_locked();
            }
        }
        HOLDS_WRITE_LOCK.with(|h| h.set(false));
    }
}

/// The filesystem's steps of the commit protocol (`group_commit`).
struct CommitSteps<'a>(&'a Fs);

type JournalGuard<'a> = Ranked<MutexGuard<'a, Option<crate::fs::jwrite::Journal>>>;

impl<'a> group_commit::Steps for CommitSteps<'a> {
    type Write = WriteGuard<'a>;
    type Journal = JournalGuard<'a>;
    type Closed = Closed;
    type Error = Error;

    fn lock_write(&self) -> WriteGuard<'a> {
        self.0.write_lock()
    }
    fn release_write(&self, w: WriteGuard<'a>) {
        w.release_without_commit();
    }
    fn try_journal(&self) -> Option<JournalGuard<'a>> {
        self.0.inner.try_journal()
    }
    fn wait_journal(&self) {
        drop(self.0.inner.journal());
    }
    fn syncs_done(&self) -> u64 {
        self.0.inner.syncs_done.load(SeqCst)
    }
    fn refused(&self) -> Result<()> {
        self.0.inner.settle_errors(0);
        self.0.inner.not_shut_down()
    }
    fn journaled(&self, j: &JournalGuard<'a>) -> bool {
        j.is_some()
    }
    fn sync_in_place(&self, w: WriteGuard<'a>, j: JournalGuard<'a>) -> Result<()> {
        drop(j);
        let r = self.0.inner.sync_locked();
        drop(w);
        r
    }
    fn close(&self, _w: &mut WriteGuard<'a>, _j: &mut JournalGuard<'a>) -> Result<Closed> {
        self.0.inner.close_transaction()
    }
    fn write(&self, mut j: JournalGuard<'a>, closed: Result<Closed>) -> Result<()> {
        self.0.inner.write_transaction(&mut j, closed)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Best effort when the last handle goes away without close() (file data was
        // written back by the last `Fs` handle's drop).
        self.pagecache.stop_writeback();
        self.prefetch.stop();
        let _ = self.close();
    }
}

impl Drop for Fs {
    fn drop(&mut self) {
        // The last handle: write the page cache back while an `Fs` still exists to do
        // it with (Inner's drop then commits and marks the image clean).
        if Arc::strong_count(&self.inner) == 1 && !self.inner.read_only && !self.live().closed {
            let _ = self.writeback_all();
        }
    }
}

/// A casefold filesystem's encoding must be one rext4 folds exactly (utf8-12.1, the
/// strict flag or none), else the image is refused, as the kernel refuses an unknown
/// encoding.
fn check_encoding(sb: &Superblock) -> Result<()> {
    use rext4_format::casefold::{encoding_name, ENCODING_FLAGS_KNOWN};
    if !sb.has_incompat(feature::INCOMPAT_CASEFOLD) {
        return Ok(());
    }
    if encoding_name(sb.encoding).is_none() {
        return Err(Error::Unsupported(format!(
            "casefold image with unknown filename encoding {} (rext4 knows 1, utf8-12.1)",
            sb.encoding
        )));
    }
    if sb.encoding_flags & !ENCODING_FLAGS_KNOWN != 0 {
        return Err(Error::Unsupported(format!(
            "casefold image with unknown encoding flags {:#x}",
            sb.encoding_flags
        )));
    }
    Ok(())
}

/// The feature gate's refusal, naming the features.
fn unsupported_incompat(names: &[String]) -> Error {
    Error::Unsupported(format!(
        "image uses incompatible features rext4 does not support: {}",
        names.join(", ")
    ))
}

/// The filesystem's own blocks (the kernel's "system zone"), merged and sorted.
fn system_zone(sb: &Superblock, groups: &[GroupDesc]) -> Vec<(u64, u64)> {
    let itable = sb.inode_table_blocks();
    // Four lists, each in group order — which is block order in mke2fs's layouts
    // (flex_bg packs a flex group's bitmaps and tables in group order) — one after
    // the other: the stable sort merges such runs in linear time (131,072 groups at
    // 16 TiB), and still sorts any other layout.
    let mut v = Vec::with_capacity(groups.len() * 4);
    for g in 0..groups.len() as u64 {
        let base = sb.group_base_meta_blocks(g);
        if base > 0 {
            let first = sb.group_first_block(g);
            v.push((first, first + base));
        }
    }
    v.extend(
        groups
            .iter()
            .map(|gd| (gd.block_bitmap, gd.block_bitmap + 1)),
    );
    v.extend(
        groups
            .iter()
            .map(|gd| (gd.inode_bitmap, gd.inode_bitmap + 1)),
    );
    v.extend(
        groups
            .iter()
            .map(|gd| (gd.inode_table, gd.inode_table + itable)),
    );
    // The MMP block belongs to no file either (e2fsck marks it as the filesystem's).
    let mmp = sb.mmp_block;
    if sb.has_incompat(feature::INCOMPAT_MMP)
        && mmp > u64::from(sb.first_data_block)
        && mmp < sb.blocks_count
    {
        v.push((mmp, mmp + 1));
    }
    v.sort();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

impl Fs {
    /// Record that an operation found the image corrupt or the device failing, as the
    /// kernel's ext4_error does: the superblock's state gets the "errors" bit and its
    /// error count goes up (written with the next commit and at close, which keeps the
    /// bit), so `e2fsck -p` checks the image fully instead of trusting "clean". Other
    /// errors, and read-only opens, change nothing.
    pub fn note_error(&self, e: &Error) {
        if !matches!(e, Error::Corrupted { .. } | Error::Io(_)) {
            return;
        }
        // An error the cache met (a failed read of this thread since its last call)
        // is counted there; one found elsewhere (a decoded record, file data) counts
        // once here.
        let reads = crate::cache::thread_read_errors();
        let from_cache = NOTED_READ_ERRORS.with(|c| c.replace(reads)) < reads;
        self.inner.settle_errors(if from_cache { 0 } else { 1 });
    }

    /// Whether any of `len` blocks from `start` is one of the filesystem's own (a
    /// pointer there in a file's map is corruption: freeing it would hand a bitmap or
    /// an inode table to the allocator).
    pub(crate) fn in_system_zone(&self, start: u64, len: u64) -> bool {
        let end = start.saturating_add(len);
        self.system_zone_in(start, end).next().is_some()
    }

    /// The runs of the filesystem's own blocks that overlap `[start, end)`, clipped
    /// to it.
    pub(crate) fn system_zone_in(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let z = &self.inner.system_zone;
        let i = z.partition_point(|&(_, e)| e <= start);
        z[i..]
            .iter()
            .take_while(move |&&(s, _)| s < end)
            .map(move |&(s, e)| (s.max(start), e.min(end)))
    }
}

/// The largest request batched reads make (the descriptor table, bitmap batches).
pub(crate) const MAX_REQUEST_BYTES: usize = 1 << 20;

fn read_groups(cache: &BufferCache, sb: &Superblock, seed: u32) -> Result<Vec<GroupDesc>> {
    let ngroups = sb.group_count();
    let ds = sb.desc_size();
    let per_block = sb.descs_per_block();
    let kind = DescCsum::of(sb, seed);
    let mut out = Vec::with_capacity(ngroups.min(1 << 20) as usize);
    // The whole table in few large requests, all in flight together (16 TiB has
    // 2,048 descriptor blocks: one read each would cost seconds on a slow device).
    let locations: Vec<u64> = (0..sb.desc_blocks())
        .map(|i| sb.desc_block_location(i))
        .collect();
    let (table, _) = cache.read_batch(&locations, MAX_REQUEST_BYTES / cache.block_size())?;
    for (i, (&blk, data)) in locations.iter().zip(table).enumerate() {
        let i = i as u64;
        for j in 0..per_block {
            let g = i * per_block + j;
            if g >= ngroups {
                break;
            }
            let off = (j as usize) * ds;
            let bytes = data.get(off..off + ds).unwrap_or(&[]);
            group::verify(bytes, g as u32, kind).at(blk)?;
            let gd = GroupDesc::decode(bytes, ds).at(blk)?;
            check_group(sb, g, &gd).at(blk)?;
            out.push(gd);
        }
    }
    Ok(out)
}

fn check_group(sb: &Superblock, g: u64, gd: &GroupDesc) -> rext4_format::Result<()> {
    let itable_blocks = sb.inode_table_blocks();
    let n = sb.blocks_count;
    let ok = |b: u64, len: u64| b >= u64::from(sb.first_data_block) && b.saturating_add(len) <= n;
    rext4_format::ensure(ok(gd.block_bitmap, 1), || {
        format!("group {g} block bitmap {} out of range", gd.block_bitmap)
    })?;
    rext4_format::ensure(ok(gd.inode_bitmap, 1), || {
        format!("group {g} inode bitmap {} out of range", gd.inode_bitmap)
    })?;
    rext4_format::ensure(ok(gd.inode_table, itable_blocks), || {
        format!("group {g} inode table {} out of range", gd.inode_table)
    })?;
    rext4_format::ensure(gd.free_inodes_count <= sb.inodes_per_group, || {
        format!(
            "group {g} free inodes {} > inodes per group",
            gd.free_inodes_count
        )
    })
}

/// A read-write filesystem (no periodic commit) on a fresh memory image of `size`
/// bytes (unit tests).
#[cfg(test)]
pub(crate) fn mem_fs_rw(size: usize) -> Fs {
    Fs::open_device(
        crate::mkfs::mem_image(size),
        FsOptions {
            read_only: false,
            commit_secs: 0,
            ..FsOptions::default()
        },
    )
    .expect("open")
}

#[cfg(test)]
mod tests {
    use super::Busy;

    /// The MMP block is the filesystem's own: no file map may free it.
    #[test]
    fn the_mmp_block_is_in_the_system_zone() {
        let fs = super::mem_fs_rw(8 << 20);
        let mut sb = fs.superblock();
        let groups = fs.group_descs();
        let free_blk = sb.blocks_count - 10;
        let inside = |z: &[(u64, u64)]| z.iter().any(|&(a, b)| a <= free_blk && free_blk < b);
        assert!(!inside(&super::system_zone(&sb, &groups)));
        sb.feature_incompat |= rext4_format::superblock::feature::INCOMPAT_MMP;
        sb.mmp_block = free_blk;
        assert!(inside(&super::system_zone(&sb, &groups)));
    }

    #[test]
    fn busy_runs_merge_and_answer_run_ends() {
        let mut b = Busy::default();
        b.add(10, 5); // 10..15
        b.add(20, 5); // 20..25
        b.add(15, 5); // joins both: 10..25
        assert_eq!(b.blocks.len(), 1, "{:?}", b.blocks);
        assert_eq!(b.block_count, 15);
        assert_eq!(b.run_end(10), Some(25));
        assert_eq!(b.run_end(24), Some(25));
        assert_eq!(b.run_end(25), None);
        assert_eq!(b.run_end(9), None);
        b.add(12, 2); // inside
        assert_eq!((b.blocks.len(), b.block_count), (1, 15));
        b.add(30, 1);
        assert_eq!(b.first_in(25, 31), Some(30));
        assert_eq!(b.first_in(26, 30), None);
        assert_eq!(b.block_count, 16);
    }

    /// A panic in the middle of an operation (under the write lock) aborts: nothing
    /// of the running transaction is committed, later changes fail with ShutDown.
    #[test]
    fn a_panic_under_the_write_lock_aborts() {
        use super::Error;
        let fs = super::mem_fs_rw(8 << 20);
        fs.write("/kept", b"committed").expect("write");
        fs.sync().expect("sync");
        let f2 = fs.clone();
        let r = std::thread::spawn(move || {
            let _w = f2.write_lock();
            panic!("halfway");
        })
        .join();
        assert!(r.is_err());
        assert!(
            matches!(fs.sync(), Err(Error::ShutDown(_))),
            "not shut down"
        );
        assert!(matches!(fs.create_dir("/more"), Err(Error::ShutDown(_))));
        assert_eq!(fs.read("/kept").expect("read"), b"committed");
    }

    /// A committed transaction's frees leave the busy set; frees of the next one,
    /// merged into the same runs meanwhile, stay.
    #[test]
    fn busy_runs_of_a_commit_are_removed_and_later_frees_stay() {
        let mut b = Busy::default();
        b.add(10, 5); // 10..15, freed by the committing transaction
        b.add(30, 2); // 30..32, too
        let committing = b.blocks.clone();
        b.add(15, 3); // 15..18, freed by the next: merged into 10..18
        b.add(8, 2); // 8..10, the next: merged into 8..18
        b.add(40, 1);
        b.remove_runs(&committing);
        let runs: Vec<(u64, u64)> = b.blocks.iter().map(|(&s, &l)| (s, l)).collect();
        assert_eq!(runs, vec![(8, 2), (15, 3), (40, 1)]);
        assert_eq!(b.block_count, 6);
    }
}
