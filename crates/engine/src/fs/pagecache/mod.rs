//! The page cache for file data: pages keyed by (inode, page index), dirty and
//! writeback state, delayed allocation, read-ahead, a memory bound with reclaim, and
//! the writeback thread with dirty limits.
//!
//! Owns: one [`FileCache`] per regular file with cached data (its pages, the size the
//! file has in memory when buffered writes ran past the on-disk size, read-ahead state,
//! the first writeback error since the last fsync), global page and dirty counts, the
//! delayed-allocation reservation, the reclaim queue, the dirty-file list and the
//! writeback thread's control block. A page is one filesystem block (`block_size`
//! bytes), so page `i` of a file is logical block `i`.
//!
//! Data flow: `read_ino_at` copies from pages, instantiating missing ones from the
//! device (one read per contiguous physical run, with read-ahead of a window that
//! doubles while reads stay sequential); `write_ino_at` copies into pages and marks
//! them dirty — a page over a hole reserves one block instead of allocating it
//! (delayed allocation) unless free space is low, when the write goes to the device
//! with allocation at once (ext4's nodelalloc fallback). Writeback (`writeback.rs`)
//! takes dirty pages in index order, allocates each hole run as one unwritten extent,
//! writes the data, then marks the extents written and raises the on-disk size, so a
//! large file written in any order comes out contiguous and a crash never exposes
//! unwritten data (the extents read as zeros until the conversion, which commits after
//! the data is on the device: ordered mode).
//!
//! Must hold:
//! - Bytes of a cached page at or past the file's size are zero (a page loaded from
//!   the device is zeroed past EOF; truncate zeroes the tail of the EOF page), so
//!   mmap-style reads of the EOF page never show stale data (SEEDS lesson B).
//! - The on-disk i_size covers only data that was written: it is raised by writeback
//!   after the data, never past a dirty page that is not yet written. The size in
//!   memory ([`FileCache::size`]) is the larger one while they differ; writers of both
//!   write the inode first and the in-memory size second, readers read the in-memory
//!   size first, so a lockless stat never sees a size from neither before nor after.
//! - A dirty page over a hole holds one reserved block (`delalloc`); the reservation is
//!   released when writeback allocates it or the page is dropped.
//! - Writeback pins the inode while it runs, so an unlink cannot free the inode (and
//!   its blocks) under a data write; a discarded [`FileCache`] is marked dead and no
//!   writeback starts on it.
//!
//! Locking (extends the order in docs/ARCHITECTURE.md): inode I/O lock → tree lock →
//! `Fs::write_lock` → ... ; a `FileCache`'s state mutex and then one page's mutex are
//! taken inside any of those, held only for map updates and memcpy, never across
//! device I/O, never while waiting for another lock. The reclaim queue and the
//! dirty-file list are leaf mutexes. The tree lock (striped RwLock per inode) is taken
//! shared by lockless readers of a file's extent tree (page instantiation, direct I/O,
//! SEEK_DATA, FIEMAP) and exclusively by writeback around its extent changes, which
//! it makes under the write lock; every other tree change holds the inode's I/O lock
//! exclusively, which already keeps those readers out.

pub mod mapping;
pub(crate) mod rw;
pub(crate) mod writeback;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::error::Error;
use crate::fs::Ino;
use crate::lockdep::PageCacheGuard;

/// Page-aligned writes at least this large go to the device at once when the frontend
/// caches clean data itself (`write_now`).
pub const WRITE_NOW_BYTES: u64 = 128 << 10;
/// Reads at least this large go around the cache (`read_around`).
pub const READ_AROUND_BYTES: u64 = 256 << 10;
/// Read-ahead window bounds, in bytes.
pub const READAHEAD_MIN_BYTES: u64 = 128 << 10;
pub const READAHEAD_MAX_BYTES: u64 = 2 << 20;
/// Largest run one writeback pass snapshots and writes (bytes).
pub const WRITEBACK_CHUNK_BYTES: u64 = 8 << 20;
/// Dirty data older than this is written back by the writeback thread.
pub const DIRTY_EXPIRE_SECS: u64 = 5;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How much memory the page cache may use (bytes) when the user does not say:
/// 1/16 of RAM, between 64 MiB and 2 GiB.
pub fn default_limit_bytes() -> u64 {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024);
    (ram / 16).clamp(64 << 20, 2 << 30)
}

/// One cached block of a file.
pub(crate) struct Page {
    pub(crate) data: Mutex<PageData>,
    /// Read or written since the reclaim clock last passed (second chance).
    pub(crate) hot: AtomicBool,
}

pub(crate) struct PageData {
    pub(crate) buf: Box<[u8]>,
    /// Newer than the device.
    pub(crate) dirty: bool,
    /// A writeback has snapshotted this page and not finished yet.
    pub(crate) writeback: bool,
    /// Bumped by every change; writeback cleans the page only if it did not move.
    pub(crate) seq: u64,
    /// Dirty over a hole: one block is reserved for it (delayed allocation).
    pub(crate) delalloc: bool,
}

impl Page {
    fn new(buf: Box<[u8]>) -> Arc<Page> {
        Arc::new(Page {
            data: Mutex::new(PageData {
                buf,
                dirty: false,
                writeback: false,
                seq: 0,
                delalloc: false,
            }),
            hot: AtomicBool::new(true),
        })
    }
    pub(crate) fn lock(&self) -> PageCacheGuard<'_, PageData> {
        PageCacheGuard::lock(&self.data)
    }
}

/// An error writeback met, kept for the next fsync (like the kernel's AS_EIO/ENOSPC).
#[derive(Debug, Clone)]
pub(crate) enum WbError {
    NoSpace,
    Io(String),
}

impl WbError {
    pub(crate) fn to_error(&self) -> Error {
        match self {
            WbError::NoSpace => Error::NoSpace,
            WbError::Io(m) => Error::Io(std::io::Error::other(m.clone())),
        }
    }
}

/// The cached data of one file.
pub(crate) struct FileCache {
    pub(crate) ino: Ino,
    pub(crate) state: Mutex<FileState>,
    /// Signalled when writeback finishes on some of this file's pages.
    pub(crate) wb_done: Condvar,
    /// Readers and writers working with this cache (`FileRef`): an empty cache is not
    /// retired while any is, so none of them finds it dead halfway.
    users: AtomicUsize,
}

/// A live file cache in use (see `PageCache::live_file`).
pub(crate) struct FileRef(Arc<FileCache>);

impl std::ops::Deref for FileRef {
    type Target = FileCache;
    fn deref(&self) -> &FileCache {
        &self.0
    }
}

impl FileRef {
    pub(crate) fn arc(&self) -> &Arc<FileCache> {
        &self.0
    }
}

impl Drop for FileRef {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `FileState::tree_shape` of a block-mapped file (no extent tree has that depth).
pub(crate) const BLOCK_MAP_SHAPE: (u16, u16) = (u16::MAX, 0);

pub(crate) struct FileState {
    pub(crate) pages: BTreeMap<u64, Arc<Page>>,
    /// Indices of the dirty pages.
    pub(crate) dirty_idx: BTreeSet<u64>,
    /// The file's size when it is larger than the inode record's (buffered writes past
    /// the on-disk size, not yet written back).
    pub(crate) size: Option<u64>,
    /// Pages of this file under writeback.
    pub(crate) writeback: usize,
    /// Writes going to the device at once (`write_now`) whose end `size` already
    /// shows: until they finish, the gap between the record's size and `size` is
    /// their data on its way, not a hole a whole-file pass may settle (`settle_size`).
    pub(crate) writing_now: usize,
    /// Read-ahead: the page a sequential reader asks for next, and the window.
    pub(crate) ra_next: u64,
    pub(crate) ra_pages: u64,
    /// First writeback error since the last fsync.
    pub(crate) error: Option<WbError>,
    /// Dirty pages over holes, each holding one promised block (`delalloc`).
    pub(crate) delalloc: u64,
    /// Promises taken by writes that have not marked their pages yet.
    pub(crate) pending: u64,
    /// Pages whose promised blocks a writeback chunk has allocated, until the chunk is
    /// done: their extents are inserted and then converted, which may take tree
    /// blocks, so the tree promise still counts them.
    pub(crate) inflight: u64,
    /// Extent-tree blocks promised for the writeback of those pages, and the tree's
    /// (depth, root entries) they were reckoned for (`space::tree_blocks_for`).
    pub(crate) resv_tree: u64,
    pub(crate) tree_shape: (u16, u16),
    /// A block-mapped file (`tree_shape` is [`BLOCK_MAP_SHAPE`]): the indirect blocks
    /// its tree promise counted lately, so that the pages of one missing indirect
    /// block dirtied by successive writes promise it once (`Fs::promise_pages`).
    /// Forgotten when the file holds no promise any more, and when a truncate or punch
    /// frees indirect blocks.
    pub(crate) bm_counted: Vec<crate::blockmap_write::IndirectKey>,
    /// Discarded (the inode was freed): nothing may be added or written back.
    pub(crate) dead: bool,
    /// Pages being read in from the device (`instantiate`): while any is, no clean
    /// page of the file is dropped, so a page written back meanwhile is still cached
    /// when the older copy arrives, and wins (`dio_cache_model`).
    pub(crate) loading: usize,
    /// Direct overwrites on their way to the device, as page ranges (first, last): a
    /// page of such a range read from the device is not cached until they are done.
    pub(crate) direct_in_flight: Vec<(u64, u64)>,
    /// Direct overwrites done: their count, and the page ranges of the last
    /// `DIRECT_DONE_KEPT` with the count each made; a page read while one overlapping
    /// it ended is read again (`instantiate`).
    pub(crate) direct_done: u64,
    pub(crate) direct_done_ranges: VecDeque<(u64, u64, u64)>,
}

/// How many ended direct overwrites a file keeps the ranges of (`FileState`): a read
/// that saw more end while it ran is read again whatever they covered.
pub(crate) const DIRECT_DONE_KEPT: usize = 32;

impl FileState {
    /// Whether a direct overwrite of a page in `[first, last]` is in flight.
    pub(crate) fn direct_in_flight_over(&self, first: u64, last: u64) -> bool {
        self.direct_in_flight
            .iter()
            .any(|&(a, b)| a <= last && first <= b)
    }

    /// Whether a direct overwrite of a page in `[first, last]` ended after the count
    /// was `seen` (or may have: its range is no longer kept).
    pub(crate) fn direct_done_over_since(&self, seen: u64, first: u64, last: u64) -> bool {
        if self.direct_done == seen {
            return false;
        }
        let kept_from = self.direct_done - self.direct_done_ranges.len() as u64;
        seen < kept_from
            || self
                .direct_done_ranges
                .iter()
                .any(|&(n, a, b)| n > seen && a <= last && first <= b)
    }
}

impl FileCache {
    pub(crate) fn lock(&self) -> PageCacheGuard<'_, FileState> {
        PageCacheGuard::lock(&self.state)
    }
    /// Block until no page of this file in `[first, last]` is under writeback.
    pub(crate) fn wait_writeback<'a>(
        &'a self,
        mut st: PageCacheGuard<'a, FileState>,
        first: u64,
        last: u64,
    ) -> PageCacheGuard<'a, FileState> {
        loop {
            let busy = st.writeback > 0
                && st
                    .pages
                    .range(first..=last)
                    .any(|(_, p)| p.lock().writeback);
            if !busy {
                return st;
            }
            st = st.wait(&self.wb_done);
        }
    }

    /// Block until none of `pages` (taken out of the map) is under writeback.
    pub(crate) fn wait_pages<'a>(
        &'a self,
        mut st: PageCacheGuard<'a, FileState>,
        pages: &[Arc<Page>],
    ) -> PageCacheGuard<'a, FileState> {
        while pages.iter().any(|p| p.lock().writeback) {
            st = st.wait(&self.wb_done);
        }
        st
    }
}

/// Writeback thread control, shared with the thread (which must not hold the
/// filesystem while it sleeps).
#[derive(Default)]
pub(crate) struct WbCtl {
    /// Set to make the thread look for work now.
    pub(crate) kick: bool,
    pub(crate) started: bool,
    /// Set when the filesystem closes: the thread exits.
    pub(crate) stop: bool,
}

#[derive(Default)]
pub(crate) struct WbShared {
    pub(crate) ctl: Mutex<WbCtl>,
    pub(crate) cv: Condvar,
}

impl WbShared {
    pub(crate) fn ctl(&self) -> MutexGuard<'_, WbCtl> {
        lock(&self.ctl)
    }
}

/// The page cache of one filesystem.
pub(crate) struct PageCache {
    pub(crate) page_size: usize,
    /// `FsOptions::cache_clean`.
    pub(crate) keep_clean: bool,
    files: papaya::HashMap<u32, Arc<FileCache>, crate::inthash::IntHash>,
    /// Pages cached, and the bound.
    pub(crate) pages: AtomicUsize,
    pub(crate) limit_pages: usize,
    /// Dirty pages (all files), and the thresholds: writers wait above `dirty_limit`,
    /// the writeback thread starts above `dirty_background`.
    pub(crate) dirty: AtomicUsize,
    pub(crate) dirty_limit: usize,
    pub(crate) dirty_background: usize,
    /// The filesystem's space accounting: dirty pages over holes hold promises there.
    pub(crate) space: Arc<crate::fs::space::Space>,
    /// Reclaim order (CLOCK): (inode, page index), oldest first; may hold stale keys.
    lru: Mutex<VecDeque<(u32, u64)>>,
    reclaiming: AtomicBool,
    /// Files with dirty pages, and since when.
    dirty_files: Mutex<DirtyFiles>,
    pub(crate) wb: Arc<WbShared>,
    /// Recycled page buffers (see `alloc_buf`).
    pool: Mutex<Vec<Box<[u8]>>>,
    pool_max: usize,
}

impl PageCache {
    pub(crate) fn new(
        page_size: usize,
        limit_bytes: u64,
        keep_clean: bool,
        space: Arc<crate::fs::space::Space>,
    ) -> PageCache {
        let limit_pages = (limit_bytes / page_size as u64).max(256) as usize;
        PageCache {
            page_size,
            keep_clean,
            files: papaya::HashMap::builder()
                .hasher(Default::default())
                .collector(crate::icache::collector())
                .build(),
            pages: AtomicUsize::new(0),
            limit_pages,
            dirty: AtomicUsize::new(0),
            dirty_limit: limit_pages / 2,
            // Under a frontend that delays writes itself (the kernel's writeback cache)
            // what reaches us is already old: start writing it soon, in parallel with
            // what keeps coming, instead of collecting an eighth of the cache first.
            dirty_background: if keep_clean {
                limit_pages / 8
            } else {
                (limit_pages / 8).min((32 << 20) / page_size)
            },
            space,
            lru: Mutex::new(VecDeque::new()),
            reclaiming: AtomicBool::new(false),
            dirty_files: Mutex::new(DirtyFiles::default()),
            wb: Arc::new(WbShared::default()),
            pool: Mutex::new(Vec::new()),
            pool_max: (limit_pages / 8).clamp(64, 8192),
        }
    }

    /// A page buffer with unspecified contents (the caller fills all of it). Buffers
    /// of dropped pages are recycled: a fresh allocation per page would cost a page
    /// fault and the kernel's zeroing each time, which showed as a third of the CPU of
    /// a sequential write.
    pub(crate) fn alloc_buf(&self) -> Box<[u8]> {
        lock(&self.pool)
            .pop()
            .unwrap_or_else(|| vec![0u8; self.page_size].into_boxed_slice())
    }

    /// A zeroed page buffer.
    pub(crate) fn alloc_zeroed(&self) -> Box<[u8]> {
        let mut b = self.alloc_buf();
        b.fill(0);
        b
    }

    /// Give the buffer of a page nobody else holds back to the pool.
    pub(crate) fn recycle(&self, page: Arc<Page>) {
        if let Ok(p) = Arc::try_unwrap(page) {
            self.recycle_buf(p.data.into_inner().unwrap_or_else(|e| e.into_inner()).buf);
        }
    }

    /// Give a page buffer back to the pool.
    pub(crate) fn recycle_buf(&self, buf: Box<[u8]>) {
        let mut pool = lock(&self.pool);
        if pool.len() < self.pool_max && buf.len() == self.page_size {
            pool.push(buf);
        }
    }

    /// The cache of `ino`, if it has one (lock-free).
    pub(crate) fn file(&self, ino: Ino) -> Option<Arc<FileCache>> {
        self.files.pin().get(&ino.0).cloned()
    }

    /// The cache of `ino`, created if needed. The caller must check `dead` under the
    /// state lock before adding pages (and retry when it is set).
    pub(crate) fn file_or_new(&self, ino: Ino) -> Arc<FileCache> {
        self.files
            .pin()
            .get_or_insert_with(ino.0, || {
                Arc::new(FileCache {
                    ino,
                    state: Mutex::new(FileState {
                        pages: BTreeMap::new(),
                        dirty_idx: BTreeSet::new(),
                        size: None,
                        writeback: 0,
                        writing_now: 0,
                        ra_next: u64::MAX,
                        ra_pages: 0,
                        error: None,
                        delalloc: 0,
                        pending: 0,
                        inflight: 0,
                        resv_tree: 0,
                        tree_shape: (0, 0),
                        bm_counted: Vec::new(),
                        dead: false,
                        loading: 0,
                        direct_in_flight: Vec::new(),
                        direct_done: 0,
                        direct_done_ranges: VecDeque::new(),
                    }),
                    wb_done: Condvar::new(),
                    users: AtomicUsize::new(0),
                })
            })
            .clone()
    }

    /// A live cache for `ino` (created if needed), held in use until dropped.
    pub(crate) fn live_file(&self, ino: Ino) -> FileRef {
        loop {
            let fc = self.file_or_new(ino);
            // Counted before the check: `drop_if_empty` looks at the count under the
            // same lock, so either it sees us or we see it dead.
            fc.users.fetch_add(1, Ordering::SeqCst);
            if !fc.lock().dead {
                return FileRef(fc);
            }
            fc.users.fetch_sub(1, Ordering::SeqCst);
            // A dead cache leaves the map right after it dies; a racing lookup may
            // still see it for a moment.
            std::thread::yield_now();
        }
    }

    /// The in-memory size of `ino` when it runs ahead of the inode record.
    pub(crate) fn size_override(&self, ino: Ino) -> Option<u64> {
        self.file(ino).and_then(|f| f.lock().size)
    }

    /// Every file cache (for sync and reclaim).
    pub(crate) fn all_files(&self) -> Vec<Arc<FileCache>> {
        self.files.pin().values().cloned().collect()
    }

    /// Account page `idx` of a file becoming dirty (state and page locked by the
    /// caller, who sets the page's flag).
    pub(crate) fn note_dirty(&self, st: &mut FileState, ino: Ino, idx: u64) {
        if st.dirty_idx.insert(idx) {
            self.dirty.fetch_add(1, Ordering::Relaxed);
            if st.dirty_idx.len() == 1 {
                lock(&self.dirty_files).insert(ino.0, Instant::now());
            }
        }
    }

    /// Account page `idx` of a file becoming clean (or leaving the cache).
    pub(crate) fn note_clean(&self, st: &mut FileState, ino: Ino, idx: u64) {
        if st.dirty_idx.remove(&idx) {
            self.dirty.fetch_sub(1, Ordering::Relaxed);
            if st.dirty_idx.is_empty() {
                lock(&self.dirty_files).remove(ino.0);
            }
        }
    }

    /// Put a new page in `st` (which must be live); returns the page now at `idx`
    /// (an existing one wins).
    pub(crate) fn insert_page(
        &self,
        st: &mut FileState,
        ino: Ino,
        idx: u64,
        page: Arc<Page>,
    ) -> Arc<Page> {
        if let Some(p) = st.pages.get(&idx) {
            return p.clone();
        }
        st.pages.insert(idx, page.clone());
        self.pages.fetch_add(1, Ordering::Relaxed);
        lock(&self.lru).push_back((ino.0, idx));
        page
    }

    /// Remove page `idx` of a file (state locked): clean-up of its dirty and
    /// reservation accounting. Returns the page.
    pub(crate) fn remove_page(&self, st: &mut FileState, ino: Ino, idx: u64) -> Option<Arc<Page>> {
        let p = st.pages.remove(&idx)?;
        self.pages.fetch_sub(1, Ordering::Relaxed);
        let mut d = p.lock();
        if d.dirty {
            d.dirty = false;
            d.seq += 1;
            self.note_clean(st, ino, idx);
        }
        if d.delalloc {
            d.delalloc = false;
            drop(d);
            self.drop_delalloc(st, 1, true);
        } else {
            drop(d);
        }
        Some(p)
    }

    /// `n` pages of a file (state locked) stopped holding a promised block: by
    /// writeback taking their blocks (`consumed`: the promise was used), or by being
    /// dropped or cleaned otherwise (the promise goes back). The file's tree promise
    /// shrinks to what its remaining pages need.
    pub(crate) fn drop_delalloc(&self, st: &mut FileState, n: u64, give_back: bool) {
        st.delalloc = st.delalloc.saturating_sub(n);
        if give_back {
            self.space.unreserve(n, 0);
        }
        self.settle_tree(st);
    }

    /// Give back the part of the file's tree promise its delalloc pages no longer need.
    /// A block-mapped file's promise names indirect blocks, not a count a formula
    /// could shrink: it goes back whole when no page holds a promise any more.
    pub(crate) fn settle_tree(&self, st: &mut FileState) {
        if st.tree_shape == BLOCK_MAP_SHAPE {
            if st.delalloc + st.pending + st.inflight == 0 {
                if st.resv_tree > 0 {
                    self.space.unreserve(0, st.resv_tree);
                    st.resv_tree = 0;
                }
                st.bm_counted.clear();
            }
            return;
        }
        let per_leaf = (self.page_size as u64 - 12) / 12;
        let (depth, entries) = st.tree_shape;
        let need = crate::fs::space::tree_blocks_for(
            st.delalloc + st.pending + st.inflight,
            depth,
            entries,
            per_leaf,
        );
        if st.resv_tree > need {
            self.space.unreserve(0, st.resv_tree - need);
            st.resv_tree = need;
        }
    }

    /// Retire a file cache that holds nothing (no pages, no size ahead of the record,
    /// no kept error, no writeback running): one per file ever touched would pile up.
    pub(crate) fn drop_if_empty(&self, fc: &Arc<FileCache>) {
        let mut st = fc.lock();
        let empty = !st.dead
            && fc.users.load(Ordering::SeqCst) == 0
            && st.loading == 0
            && st.direct_in_flight.is_empty()
            && st.pages.is_empty()
            && st.size.is_none()
            && st.error.is_none()
            && st.writeback == 0
            && st.writing_now == 0;
        if empty {
            st.dead = true;
            drop(st);
            self.forget_file(fc);
        }
    }

    /// Take a dead cache out of the map (exactly that one: a new cache for the same
    /// inode may already be there).
    fn forget_file(&self, fc: &Arc<FileCache>) {
        let _ = self
            .files
            .pin()
            .remove_if(&fc.ino.0, |_, v| Arc::ptr_eq(v, fc));
    }

    /// Throw away everything cached for `ino` (it was freed). Pages under writeback
    /// are not waited for: writeback pins the inode, so it cannot be freed under one.
    pub(crate) fn discard(&self, ino: Ino) {
        let Some(fc) = self.file(ino) else { return };
        let mut st = fc.lock();
        st.dead = true;
        let idxs: Vec<u64> = st.pages.keys().copied().collect();
        for i in idxs {
            if let Some(p) = self.remove_page(&mut st, ino, i) {
                self.recycle(p);
            }
        }
        st.size = None;
        lock(&self.dirty_files).remove(ino.0);
        drop(st);
        self.forget_file(&fc);
        fc.wb_done.notify_all();
    }

    /// Drop clean pages until the cache is back under its bound (CLOCK over the
    /// reclaim queue: pages used since the last pass get a second chance, dirty ones
    /// are skipped and the writeback thread is kicked). One thread reclaims at a time.
    pub(crate) fn reclaim_if_needed(&self) {
        if self.pages.load(Ordering::Relaxed) <= self.limit_pages
            || self.reclaiming.swap(true, Ordering::Acquire)
        {
            return;
        }
        let target = self.limit_pages - self.limit_pages / 16;
        let mut budget = lock(&self.lru).len() * 2;
        let mut skipped_dirty = 0usize;
        while self.pages.load(Ordering::Relaxed) > target && budget > 0 {
            budget -= 1;
            let Some((ino, idx)) = lock(&self.lru).pop_front() else {
                break;
            };
            let Some(fc) = self.file(Ino(ino)) else {
                continue;
            };
            let mut st = fc.lock();
            let Some(p) = st.pages.get(&idx).cloned() else {
                continue;
            };
            let requeue = {
                let d = p.lock();
                // A page of the file on its way in may be older than this one
                // (`instantiate`): the file's pages wait for the next pass.
                if st.loading > 0 {
                    true
                } else if d.dirty || d.writeback {
                    skipped_dirty += 1;
                    true
                } else {
                    p.hot.swap(false, Ordering::Relaxed)
                }
            };
            if requeue {
                lock(&self.lru).push_back((ino, idx));
                continue;
            }
            if let Some(p) = self.remove_page(&mut st, Ino(ino), idx) {
                self.recycle(p);
            }
            drop(st);
            self.drop_if_empty(&fc);
        }
        self.reclaiming.store(false, Ordering::Release);
        if skipped_dirty > 0 {
            self.kick_writeback();
        }
    }

    /// Ask the writeback thread to look for work now.
    pub(crate) fn kick_writeback(&self) {
        self.wb.ctl().kick = true;
        self.wb.cv.notify_all();
    }

    /// Tell the writeback thread to exit.
    pub(crate) fn stop_writeback(&self) {
        self.wb.ctl().stop = true;
        self.wb.cv.notify_all();
    }

    /// The file dirty longest, with how long it has been dirty.
    pub(crate) fn oldest_dirty_file(&self) -> Option<(Ino, std::time::Duration)> {
        let (ino, since) = lock(&self.dirty_files).oldest()?;
        Some((Ino(ino), Instant::now().saturating_duration_since(since)))
    }

    /// (cached pages, dirty pages, blocks promised to data, limit pages).
    pub(crate) fn stats(&self) -> (usize, usize, u64, usize) {
        (
            self.pages.load(Ordering::Relaxed),
            self.dirty.load(Ordering::Relaxed),
            self.space.figures().1,
            self.limit_pages,
        )
    }
}

/// The files with dirty pages, by inode and in the order they got dirty, so that
/// writeback finds the oldest in O(log n) however many files a tar leaves dirty.
#[derive(Default)]
struct DirtyFiles {
    since: crate::inthash::IntMap<u32, Instant>,
    order: std::collections::BTreeSet<(Instant, u32)>,
}

impl DirtyFiles {
    /// Note `ino` dirty from `now` unless it already is (its first time counts).
    fn insert(&mut self, ino: u32, now: Instant) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.since.entry(ino) {
            e.insert(now);
            self.order.insert((now, ino));
        }
    }

    fn remove(&mut self, ino: u32) {
        if let Some(t) = self.since.remove(&ino) {
            self.order.remove(&(t, ino));
        }
    }

    fn oldest(&self) -> Option<(u32, Instant)> {
        self.order.first().map(|&(t, i)| (i, t))
    }
}

/// Page cache figures, for tools and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCacheStats {
    pub cached_bytes: u64,
    pub dirty_bytes: u64,
    /// Blocks promised to dirty pages over holes (delayed allocation).
    pub reserved_blocks: u64,
    /// Extent-tree blocks promised for their writeback.
    pub reserved_tree_blocks: u64,
    pub limit_bytes: u64,
}

impl crate::fs::Fs {
    /// What the page cache holds now.
    pub fn page_cache_stats(&self) -> PageCacheStats {
        let pc = &self.inner.pagecache;
        let (p, d, r, l) = pc.stats();
        let ps = pc.page_size as u64;
        PageCacheStats {
            cached_bytes: p as u64 * ps,
            dirty_bytes: d as u64 * ps,
            reserved_blocks: r,
            reserved_tree_blocks: self.inner.space.figures().2,
            limit_bytes: l as u64 * ps,
        }
    }
}

impl std::fmt::Debug for FileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileCache({})", self.ino.0)
    }
}

/// A page holding `buf` (one page long).
pub(crate) fn new_page(buf: Box<[u8]>) -> Arc<Page> {
    Page::new(buf)
}

/// The number of pages a byte range `[off, off+len)` touches (len > 0).
pub(crate) fn pages_spanned(off: u64, len: u64, ps: u64) -> (u64, u64) {
    (off / ps, (off + len - 1) / ps)
}

#[cfg(test)]
mod tests {
    use super::DirtyFiles;
    use std::time::{Duration, Instant};

    #[test]
    fn dirty_files_oldest_is_first_dirtied_and_survives_removals() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut d = DirtyFiles::default();
        assert_eq!(d.oldest(), None);
        d.insert(30, at(3));
        d.insert(10, at(1));
        d.insert(20, at(2));
        // Dirtying an already dirty file keeps its first time.
        d.insert(10, at(9));
        assert_eq!(d.oldest(), Some((10, at(1))));
        d.remove(10);
        assert_eq!(d.oldest(), Some((20, at(2))));
        // Two files dirtied at the same instant are both kept.
        d.insert(40, at(2));
        d.remove(20);
        assert_eq!(d.oldest(), Some((40, at(2))));
        d.remove(99);
        d.remove(40);
        d.remove(30);
        assert_eq!(d.oldest(), None);
        assert!(d.since.is_empty() && d.order.is_empty());
    }
}
