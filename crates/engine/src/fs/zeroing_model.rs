//! Page-cache-aware zeroing (SEEDS lesson B) under shuttle: the seed's reproducer, a
//! truncate that shrinks into a page holding dirty data over an unwritten extent, while
//! writeback and the dropping of clean pages run beside it. Random and PCT schedules.
//!
//! The model file has 4 KiB blocks, one page per block (as `pagecache`). Its state: the
//! device's blocks (`Disk::blocks`, holding another file's old bytes at the start), the
//! inode record (`Inode`: each logical block a hole, unwritten or written, and the
//! on-disk size), the file's cache (`FileState`: pages with their dirty and writeback
//! flags and change count `seq`, the dirty set, the in-memory size when it runs ahead of
//! the record). The locks are the ones the real code takes, on shuttle's types, in its
//! order: the inode's I/O lock → the tree lock → the transaction (`Fs::handle` shared,
//! `Fs::write_lock` exclusive) → the inode's lock (`Fs::lock_nondir`) → the
//! `FileCache` state mutex → one page's mutex; `FileCache::wb_done` is the condition
//! variable. The device and the record sit behind a plain mutex held for one read or
//! write of them (no scheduling point: the model's atomic steps); explicit yields split
//! the multi-step changes, so that whoever is not excluded sees them half done.
//!
//! Threads (the seed's two loops):
//! - the user, three rounds of: `truncate 0` (`Fs::truncate_ino`: `prepare_size_change`
//!   → `pc_truncate`, then `truncate_locked` under the write lock: the blocks freed, a
//!   yield, the record written, `pc_disk_size_is`); `fallocate 0 32K`
//!   (`Fs::fallocate_ino` with `FallocMode::Allocate`: unwritten extents over the holes,
//!   `zero_past_eof`, the size); `pwrite 0 4K` of 0xcd (`write_buffered` → `pc_write`
//!   under the shared I/O lock: one whole page, dirty, over the unwritten extent); a
//!   pause (`PAUSES`: none in the first round, long enough in the others for the
//!   flusher to write the page back and often to drop it); `truncate 2K` (`pc_truncate`
//!   zeroes the tail of page 0 in memory, whatever its state, then the extents past
//!   block 0 go); then a mapping's read (`Mapping::read` → `pc_read_pages`: the cached
//!   page, or one instantiated by `read_pages`, which zeroes past EOF) of the 16 bytes
//!   at 2K and the 16 before them;
//! - the flusher, until the user is done (at most `FLUSH_ROUNDS`, a yield after each):
//!   `sync_file_range` of the whole file (`writeback_ino`: snapshot the dirty pages and
//!   mark them under writeback; `map_for_writeback` under the tree lock and a handle;
//!   the data write without locks; `finish_chunk`: mark the extent written and raise the
//!   on-disk size, not past a dirty page still unwritten; clean the pages whose `seq`
//!   did not move, wake the waiters; `settle_size`), then `fadvise DONTNEED`
//!   (`drop_cache_ino` → `drop_clean_pages`).
//!
//! What must hold: after every truncate to 2K, the 16 bytes at 2K read as zeros and the
//! 16 before them as 0xcd; writeback writes only a block that stayed the file's since
//! it mapped it, and marks written only the block it wrote; at the end, every cached
//! page is zero at and past the size and a read through the cache shows the data and
//! zeros past it; then, after a final writeback with the clean pages dropped, the file
//! grows to two blocks (`truncate_locked` → `zero_past_eof`) and shows zeros past its
//! old end, through the cache and on the device; no schedule deadlocks (shuttle's own
//! check). The truncate to 2K finds page 0 dirty, under writeback, clean or gone, and
//! the device's block 0 often holds 0xcd past EOF (written before the truncate): by
//! design, it is zeroed when the file grows, and a page read from it is zeroed past EOF.
//!
//! The broken variants (`Broken`) must each be caught:
//! - `SkipUnwrittenTail`, the seed's bug: the truncate leaves the EOF page's tail alone
//!   when its block is unwritten ("the disk reads zeros anyway"), so the dirty 0xcd shows
//!   past EOF.
//! - `MappingThenCache`, the seed's race: the truncate's zeroing looks the EOF block up
//!   first and the cached page second, after waiting for the page's writeback (as the
//!   kernel's `truncate_inode_partial_folio` does, which also makes the window as wide
//!   as the pass: without the wait the model seldom finds it), and over an unwritten
//!   block zeroes the page only if it is dirty. Writeback converts the block and cleans
//!   the page in between: the clean page keeps 0xcd past EOF. rext4's `pc_truncate`
//!   zeroes the cached page whatever the mapping says (and `zero_partial` looks at the
//!   cache first). When the page is dropped in between as well, what stays stale is the
//!   device block's tail, which rext4 covers twice (above): that half of the race does
//!   not show here.
//! - `DropBusyPages`: `drop_clean_pages` drops pages that are dirty or under writeback
//!   (the check it shares with `reclaim_if_needed`): data before EOF is lost, the page
//!   read again from the still unwritten block shows zeros.
//!
//! Not modelled: delayed-allocation promises (the page always lies over a preallocated
//! extent), read-ahead, the cache's memory bound (the flusher drops the pages instead),
//! the inode pin, the journal; freed blocks are reused at once (the lowest free one, not
//! after the commit), which makes a late data write land on someone else's block.

#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use shuttle::sync::atomic::{AtomicBool, Ordering::SeqCst};
use shuttle::sync::{Condvar, Mutex, MutexGuard, RwLock};
use shuttle::thread;

/// The block size, which is the page size (and `MMAP_PAGE`).
const BS: u64 = 4096;
/// Logical blocks the model file may map: the fallocated 0..32K.
const FILE_BLOCKS: usize = 8;
const FALLOC_END: u64 = FILE_BLOCKS as u64 * BS;
/// The truncate's new end, inside page 0.
const EOF: u64 = 2048;
/// The mapping's read: this many bytes at EOF, and as many before it.
const PEEK: u64 = 16;
/// The pwrite's bytes.
const DATA: u8 = 0xcd;
/// What the device holds where nothing was written: another file's old data.
const STALE: u8 = 0x5a;
/// What a recycled page buffer holds before it is filled (`PageCache::alloc_buf`).
const RECYCLED: u8 = 0xee;
/// Physical blocks of the model device.
const DEV_BLOCKS: usize = 12;
/// The user's rounds, each with the yields between its pwrite and its truncate: none
/// (the race at its tightest), then long enough for the flusher to write the page back
/// and often to drop it as well.
const PAUSES: [usize; 3] = [0, 15, 40];
/// The flusher's loop runs until the user is done, at most this many rounds (a bound
/// for PCT, which lets a thread run alone).
const FLUSH_ROUNDS: usize = 100;

/// Which protection the model leaves out (`None`: the code as it is).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Broken {
    None,
    /// The truncate does not zero the EOF page's tail over an unwritten block.
    SkipUnwrittenTail,
    /// The truncate's zeroing decides from the mapping first, the cached page second.
    MappingThenCache,
    /// Dropping clean pages also drops dirty ones and ones under writeback.
    DropBusyPages,
}

/// What a logical block maps to (physical block numbers).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ext {
    Hole,
    Unwritten(usize),
    Written(usize),
}

impl Ext {
    fn physical(self) -> Option<usize> {
        match self {
            Ext::Hole => None,
            Ext::Unwritten(p) | Ext::Written(p) => Some(p),
        }
    }
}

/// The inode record: its extents (a depth-0 tree lives in the record) and i_size.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Inode {
    ext: [Ext; FILE_BLOCKS],
    size: u64,
}

impl Inode {
    /// `Fs::map_block`: past the blocks the model file may map, a hole.
    fn map(&self, lblk: u64) -> Ext {
        usize::try_from(lblk)
            .ok()
            .and_then(|l| self.ext.get(l).copied())
            .unwrap_or(Ext::Hole)
    }
}

/// The device, the block bitmap and the inode record.
struct Disk {
    blocks: Vec<Box<[u8]>>,
    used: [bool; DEV_BLOCKS],
    /// Bumped at each allocation of a block: a writer that mapped it before can tell
    /// whether it is still the same allocation.
    generation: [u32; DEV_BLOCKS],
    inode: Inode,
}

impl Disk {
    /// `Fs::alloc_blocks`: the lowest free block.
    fn alloc(&mut self) -> usize {
        let p = (0..DEV_BLOCKS)
            .find(|&p| !self.used[p])
            .expect("the model device is full");
        self.used[p] = true;
        self.generation[p] += 1;
        p
    }
}

struct PageData {
    buf: Box<[u8]>,
    dirty: bool,
    writeback: bool,
    seq: u64,
}

/// `pagecache::Page`.
struct Page {
    data: Mutex<PageData>,
}

impl Page {
    fn new(buf: Box<[u8]>) -> Arc<Page> {
        Arc::new(Page {
            data: Mutex::new(PageData {
                buf,
                dirty: false,
                writeback: false,
                seq: 0,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, PageData> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `pagecache::FileState`, the parts the zeroing path uses.
struct FileState {
    pages: BTreeMap<u64, Arc<Page>>,
    dirty_idx: BTreeSet<u64>,
    /// The size in memory when it runs ahead of the record's.
    size: Option<u64>,
    /// Pages under writeback.
    writeback: usize,
}

/// One page a writeback pass took: its bytes then, and its `seq` then.
struct Snap {
    idx: u64,
    page: Arc<Page>,
    seq: u64,
    bytes: Box<[u8]>,
}

/// A block a writeback pass writes: where, which allocation of it, and how.
#[derive(Clone, Copy)]
struct Target {
    physical: usize,
    generation: u32,
    convert: bool,
}

struct Model {
    broken: Broken,
    /// `Fs::io_shared` / `Fs::io_exclusive`.
    io: RwLock<()>,
    /// `Fs::tree_shared` / `Fs::tree_exclusive`.
    tree: RwLock<()>,
    /// The running transaction: `Fs::handle` shared, `Fs::write_lock` exclusive.
    txn: RwLock<()>,
    /// `Fs::lock_nondir` of the file.
    inode_lock: Mutex<()>,
    /// `FileCache::state` and `FileCache::wb_done`.
    state: Mutex<FileState>,
    wb_done: Condvar,
    /// Not a lock of the real code: the atomic steps on the device and the record.
    disk: std::sync::Mutex<Disk>,
    /// The user's loop has ended (the flusher's stops).
    user_done: AtomicBool,
}

impl Model {
    fn new(broken: Broken) -> Model {
        Model {
            broken,
            io: RwLock::new(()),
            tree: RwLock::new(()),
            txn: RwLock::new(()),
            inode_lock: Mutex::new(()),
            state: Mutex::new(FileState {
                pages: BTreeMap::new(),
                dirty_idx: BTreeSet::new(),
                size: None,
                writeback: 0,
            }),
            wb_done: Condvar::new(),
            disk: std::sync::Mutex::new(Disk {
                blocks: (0..DEV_BLOCKS)
                    .map(|_| vec![STALE; BS as usize].into_boxed_slice())
                    .collect(),
                used: [false; DEV_BLOCKS],
                generation: [0; DEV_BLOCKS],
                inode: Inode {
                    ext: [Ext::Hole; FILE_BLOCKS],
                    size: 0,
                },
            }),
            user_done: AtomicBool::new(false),
        }
    }

    fn st(&self) -> MutexGuard<'_, FileState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn disk(&self) -> std::sync::MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_inode(&self) -> Inode {
        self.disk().inode
    }

    fn write_inode(&self, inode: &Inode) {
        self.disk().inode = *inode;
    }

    // --- Size helpers (`rw.rs`) ---

    /// `Fs::vfs_size`: the in-memory size if there is one, else the record read again.
    fn vfs_size(&self, inode: &Inode) -> u64 {
        let o = self.st().size;
        match o {
            Some(s) => s.max(inode.size),
            None => self.read_inode().size.max(inode.size),
        }
    }

    /// `Fs::inode_and_vfs_size`: the in-memory size first, then the record.
    fn inode_and_vfs_size(&self) -> (Inode, u64) {
        let o = self.st().size;
        let inode = self.read_inode();
        (inode, o.map_or(inode.size, |s| s.max(inode.size)))
    }

    /// `Fs::pc_disk_size_is`.
    fn pc_disk_size_is(&self, disk_size: u64, authoritative: bool) {
        let mut st = self.st();
        if authoritative || st.size.is_some_and(|s| s <= disk_size) {
            st.size = None;
        }
    }

    // --- The page cache (`pagecache/mod.rs`) ---

    /// `PageCache::remove_page`.
    fn remove_page(&self, st: &mut FileState, idx: u64) -> Option<Arc<Page>> {
        let p = st.pages.remove(&idx)?;
        let mut d = p.lock();
        if d.dirty {
            d.dirty = false;
            d.seq += 1;
            st.dirty_idx.remove(&idx);
        }
        drop(d);
        Some(p)
    }

    /// `FileCache::wait_writeback`.
    fn wait_writeback<'a>(
        &'a self,
        mut st: MutexGuard<'a, FileState>,
        first: u64,
        last: u64,
    ) -> MutexGuard<'a, FileState> {
        loop {
            let busy = st.writeback > 0
                && st
                    .pages
                    .range(first..=last)
                    .any(|(_, p)| p.lock().writeback);
            if !busy {
                return st;
            }
            st = self.wb_done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// `FileCache::wait_pages`.
    fn wait_pages<'a>(
        &'a self,
        mut st: MutexGuard<'a, FileState>,
        pages: &[Arc<Page>],
    ) -> MutexGuard<'a, FileState> {
        while pages.iter().any(|p| p.lock().writeback) {
            st = self.wb_done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st
    }

    // --- The user's operations ---

    /// `Fs::truncate_ino`.
    fn truncate(&self, size: u64) {
        let _io = self.io.write().unwrap_or_else(|p| p.into_inner());
        self.prepare_size_change(size);
        let _w = self.txn.write().unwrap_or_else(|p| p.into_inner());
        self.truncate_locked(size);
    }

    /// `Fs::prepare_size_change` (the I/O lock held exclusively, not the write lock).
    fn prepare_size_change(&self, size: u64) {
        let inode = self.read_inode();
        let vfs = self.vfs_size(&inode);
        if size < vfs {
            self.pc_truncate(size, inode.size);
        }
        if size > inode.size && vfs > inode.size {
            self.writeback_pass(inode.size / BS, u64::MAX, true);
        }
    }

    /// `Fs::truncate_locked` (the write lock held).
    fn truncate_locked(&self, size: u64) {
        let mut inode = self.read_inode();
        if size < inode.size {
            // `with_tree(.. t.remove ..)`: the blocks are freed as the extents go, the
            // record follows.
            let first_gone = size.div_ceil(BS) as usize;
            let mut disk = self.disk();
            for e in &mut inode.ext[first_gone..] {
                if let Some(p) = e.physical() {
                    disk.used[p] = false;
                }
                *e = Ext::Hole;
            }
            drop(disk);
            thread::yield_now();
        } else {
            self.zero_past_eof(&inode, size);
            thread::yield_now();
        }
        inode.size = size;
        self.write_inode(&inode);
        self.pc_disk_size_is(size, true);
    }

    /// `Fs::pc_truncate`: drop the pages past the new end (waiting for their
    /// writeback), zero the tail of the EOF page in memory. The variants change how
    /// the tail is zeroed.
    fn pc_truncate(&self, new_size: u64, disk_size: u64) {
        let idx = new_size / BS;
        let tail = !new_size.is_multiple_of(BS);
        // `MappingThenCache`: the scan's first look, at the mapping.
        let said =
            (self.broken == Broken::MappingThenCache && tail).then(|| self.read_inode().map(idx));
        if said.is_some() {
            thread::yield_now();
        }
        let mut st = self.st();
        let gone: Vec<u64> = st
            .pages
            .range(new_size.div_ceil(BS)..)
            .map(|(&i, _)| i)
            .collect();
        let removed: Vec<Arc<Page>> = gone
            .into_iter()
            .filter_map(|i| self.remove_page(&mut st, i))
            .collect();
        let mut st = self.wait_pages(st, &removed);
        drop(removed);
        if tail {
            if said.is_some() {
                st = self.wait_writeback(st, idx, idx);
            }
            if let Some(p) = st.pages.get(&idx).cloned() {
                let mut d = p.lock();
                let skip = match self.broken {
                    Broken::SkipUnwrittenTail => {
                        matches!(self.read_inode().map(idx), Ext::Unwritten(_))
                    }
                    Broken::MappingThenCache => !matches!(said, Some(Ext::Written(_))) && !d.dirty,
                    Broken::None | Broken::DropBusyPages => false,
                };
                if !skip {
                    d.buf[(new_size % BS) as usize..].fill(0);
                    d.seq += 1;
                }
            }
        }
        if new_size > disk_size && st.size.is_some_and(|s| s > new_size) {
            st.size = Some(new_size);
        }
        drop(st);
        self.wb_done.notify_all();
    }

    /// `Fs::zero_past_eof`: before the size grows to `new_size`, zero the old EOF
    /// block's tail on the device where it is written (`zero_on_disk`).
    fn zero_past_eof(&self, inode: &Inode, new_size: u64) {
        let old = inode.size;
        if new_size <= old || old.is_multiple_of(BS) {
            return;
        }
        let end = (old - old % BS + BS).min(new_size);
        if let Ext::Written(p) = inode.map(old / BS) {
            self.disk().blocks[p][(old % BS) as usize..(end - old / BS * BS) as usize].fill(0);
        }
    }

    /// `Fs::fallocate_ino` with `FallocMode::Allocate` from 0 to `end`.
    fn fallocate(&self, end: u64) {
        let _io = self.io.write().unwrap_or_else(|p| p.into_inner());
        let i = self.read_inode();
        let vfs = self.vfs_size(&i);
        if end > i.size && vfs > i.size {
            self.prepare_size_change(end.max(vfs));
        }
        let _w = self.txn.write().unwrap_or_else(|p| p.into_inner());
        let mut inode = self.read_inode();
        let vfs = self.vfs_size(&inode);
        // `alloc_unwritten`: blocks taken in the bitmap, the extents in the record.
        let mut disk = self.disk();
        for l in 0..end.div_ceil(BS) as usize {
            if inode.ext[l] == Ext::Hole {
                inode.ext[l] = Ext::Unwritten(disk.alloc());
            }
        }
        drop(disk);
        thread::yield_now();
        if end > vfs {
            self.zero_past_eof(&inode, end);
            inode.size = end;
        }
        self.write_inode(&inode);
        self.pc_disk_size_is(inode.size, false);
    }

    /// `Fs::write_buffered` of page `idx` wholly (0xcd): the I/O lock shared when the
    /// write ends inside the file, exclusive otherwise.
    fn pwrite_page(&self, idx: u64) {
        let (offset, end) = (idx * BS, (idx + 1) * BS);
        let _io = loop {
            if end <= self.vfs_size(&self.read_inode()) {
                let g = self.io.read().unwrap_or_else(|p| p.into_inner());
                if self.vfs_size(&self.read_inode()) >= end {
                    break (Some(g), None);
                }
            } else {
                break (
                    None,
                    Some(self.io.write().unwrap_or_else(|p| p.into_inner())),
                );
            }
        };
        let (inode, size) = self.inode_and_vfs_size();
        if offset > size && size == inode.size {
            let _w = self.txn.write().unwrap_or_else(|p| p.into_inner());
            self.zero_past_eof(&inode, offset);
        }
        self.pc_write_page(idx, size);
    }

    /// `Fs::pc_write` of one whole page: nothing to read first.
    fn pc_write_page(&self, idx: u64, size: u64) {
        let mut st = self.st();
        let p = match st.pages.get(&idx) {
            Some(p) => p.clone(),
            None => {
                let p = Page::new(vec![RECYCLED; BS as usize].into_boxed_slice());
                st.pages.insert(idx, p.clone());
                p
            }
        };
        let mut d = p.lock();
        d.buf.fill(DATA);
        d.seq += 1;
        if !d.dirty {
            d.dirty = true;
            st.dirty_idx.insert(idx);
        }
        drop(d);
        let end = (idx + 1) * BS;
        if end > size {
            st.size = Some(end);
        }
    }

    /// `Mapping::read`: `len` bytes at `pos` through the cache, under the shared I/O
    /// lock (past the size up to the end of its page: zeros).
    fn mmap_read(&self, pos: u64, len: u64) -> Vec<u8> {
        let _io = self.io.read().unwrap_or_else(|p| p.into_inner());
        let inode = self.read_inode();
        let size = self.vfs_size(&inode);
        assert!(
            pos + len <= size.div_ceil(BS) * BS,
            "the model's mapping read at {pos} would take SIGBUS (size {size})"
        );
        self.copy_from_pages(pos, len, size)
    }

    /// `Fs::copy_from_pages` (no read-ahead, as `pc_read_pages`).
    fn copy_from_pages(&self, pos: u64, len: u64, size: u64) -> Vec<u8> {
        let (first, last) = (pos / BS, (pos + len - 1) / BS);
        let pages = self.get_pages(first, last, size);
        let mut out = Vec::with_capacity(len as usize);
        for (k, p) in pages.iter().enumerate() {
            let base = (first + k as u64) * BS;
            let from = (pos.max(base) - base) as usize;
            let to = ((pos + len).min(base + BS) - base) as usize;
            out.extend_from_slice(&p.lock().buf[from..to]);
        }
        out
    }

    /// `Fs::get_pages`: the cached pages, the missing ones instantiated.
    fn get_pages(&self, first: u64, last: u64, size: u64) -> Vec<Arc<Page>> {
        let mut out: Vec<Option<Arc<Page>>> = Vec::new();
        let mut missing = Vec::new();
        {
            let st = self.st();
            for i in first..=last {
                let p = st.pages.get(&i).cloned();
                if p.is_none() {
                    missing.push(i);
                }
                out.push(p);
            }
        }
        if let (Some(&start), Some(&end)) = (missing.first(), missing.last()) {
            // The missing pages of one read are consecutive here: one run.
            let bufs = self.read_pages(start, end - start + 1, size);
            // `Fs::instantiate`: a page cached meanwhile wins.
            let mut st = self.st();
            for (j, b) in bufs.into_iter().enumerate() {
                let i = start + j as u64;
                let p = st.pages.entry(i).or_insert_with(|| Page::new(b)).clone();
                out[(i - first) as usize] = Some(p);
            }
        }
        out.into_iter()
            .map(|p| p.expect("page cache lost a page"))
            .collect()
    }

    /// `Fs::read_pages`: under the tree lock shared, the record read again; written
    /// blocks from the device, the rest zeros; everything at or past `size` zeroed.
    fn read_pages(&self, first: u64, n: u64, size: u64) -> Vec<Box<[u8]>> {
        let mut out: Vec<Box<[u8]>> = (0..n)
            .map(|_| vec![0u8; BS as usize].into_boxed_slice())
            .collect();
        let _t = self.tree.read().unwrap_or_else(|p| p.into_inner());
        let inode = self.read_inode();
        let end_page = size.div_ceil(BS);
        // The device read is I/O: others run meanwhile.
        thread::yield_now();
        for (l, b) in (first..first + n).zip(&mut out) {
            if l >= end_page {
                break;
            }
            if let Ext::Written(p) = inode.map(l) {
                b.copy_from_slice(&self.disk().blocks[p]);
            }
        }
        if !size.is_multiple_of(BS) && end_page > first && end_page <= first + n {
            out[(size / BS - first) as usize][(size % BS) as usize..].fill(0);
        }
        out
    }

    // --- The flusher's operations ---

    /// `Fs::sync_range_ino` of the whole file.
    fn sync_range(&self) {
        self.writeback_pass(0, u64::MAX, true);
    }

    /// `Fs::writeback_pass` (the cache keeps clean pages: `FsOptions::cache_clean`).
    fn writeback_pass(&self, first: u64, last: u64, wait: bool) {
        let whole = first == 0 && last == u64::MAX;
        {
            let st = self.st();
            let idle = st.dirty_idx.range(first..=last).next().is_none() && st.writeback == 0;
            if idle && !(whole && st.size.is_some()) {
                return;
            }
        }
        self.writeback_pinned(first, last, wait);
        if whole {
            self.settle_size();
        }
    }

    /// `Fs::writeback_pinned`, one chunk after the other. (Its start below `first`
    /// for dirty pages past the on-disk size is left out: the model's passes start
    /// at 0 or at the on-disk size.)
    fn writeback_pinned(&self, first: u64, last: u64, wait: bool) {
        let mut from = first;
        loop {
            // 1. Snapshot.
            let snaps = {
                let mut st = self.st();
                if wait {
                    st = self.wait_writeback(st, from, last);
                }
                let idxs: Vec<u64> = st
                    .dirty_idx
                    .range(from..=last)
                    .copied()
                    .filter(|i| st.pages.get(i).is_some_and(|p| !p.lock().writeback))
                    .collect();
                let Some(&end) = idxs.last() else {
                    return;
                };
                let mut snaps = Vec::with_capacity(idxs.len());
                for i in idxs {
                    let page = st.pages[&i].clone();
                    let mut d = page.lock();
                    d.writeback = true;
                    let (seq, bytes) = (d.seq, d.buf.clone());
                    drop(d);
                    snaps.push(Snap {
                        idx: i,
                        page,
                        seq,
                        bytes,
                    });
                }
                st.writeback += snaps.len();
                from = end + 1;
                snaps
            };
            thread::yield_now();
            // 2 and 3.
            self.write_chunk(&snaps);
            // 4. Completion.
            let mut st = self.st();
            for s in &snaps {
                let mut d = s.page.lock();
                d.writeback = false;
                if d.seq == s.seq && d.dirty {
                    d.dirty = false;
                    st.dirty_idx.remove(&s.idx);
                }
            }
            st.writeback -= snaps.len();
            drop(st);
            self.wb_done.notify_all();
            if from > last {
                return;
            }
        }
    }

    /// `Fs::write_chunk_pieces`: map each page, write it without locks, then
    /// `finish_chunk`.
    fn write_chunk(&self, snaps: &[Snap]) {
        let mut converts = Vec::new();
        for s in snaps {
            let t = self.map_for_writeback(s.idx);
            thread::yield_now();
            self.write_data(s.idx, t, &s.bytes);
            thread::yield_now();
            if t.convert {
                converts.push((s.idx, t));
            }
        }
        self.finish_chunk(snaps, &converts);
    }

    /// `Fs::map_for_writeback`: under the tree lock, a handle and the inode's lock,
    /// where the page goes; a hole gets a block at once, as an unwritten extent.
    fn map_for_writeback(&self, idx: u64) -> Target {
        let _t = self.tree.write().unwrap_or_else(|p| p.into_inner());
        let _h = self.txn.read().unwrap_or_else(|p| p.into_inner());
        let _i = self.inode_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut disk = self.disk();
        let l = idx as usize;
        let (physical, convert) = match disk.inode.ext[l] {
            Ext::Written(p) => (p, false),
            Ext::Unwritten(p) => (p, true),
            Ext::Hole => {
                let p = disk.alloc();
                disk.inode.ext[l] = Ext::Unwritten(p);
                (p, true)
            }
        };
        Target {
            physical,
            generation: disk.generation[physical],
            convert,
        }
    }

    /// `Fs::write_data` of one page, without locks: the block must still be the
    /// allocation the pass mapped (a truncate waits for writeback on the pages it
    /// drops before it frees their blocks).
    fn write_data(&self, idx: u64, t: Target, bytes: &[u8]) {
        let mut disk = self.disk();
        let p = t.physical;
        let same = disk.used[p] && disk.generation[p] == t.generation;
        if same {
            disk.blocks[p].copy_from_slice(bytes);
        }
        drop(disk);
        assert!(
            same,
            "writeback wrote page {idx} into block {p} after the file let the block go"
        );
    }

    /// `Fs::finish_chunk`: mark the converted pieces written, raise the on-disk size
    /// up to the in-memory size but not past a dirty page still unwritten.
    fn finish_chunk(&self, snaps: &[Snap], converts: &[(u64, Target)]) {
        let _t = self.tree.write().unwrap_or_else(|p| p.into_inner());
        let _h = self.txn.read().unwrap_or_else(|p| p.into_inner());
        let _i = self.inode_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut inode = self.read_inode();
        let before = inode;
        let mut wrong = None;
        for &(l, t) in converts {
            // `mark_written` converts whatever unwritten extent is there now.
            if let Ext::Unwritten(p) = inode.ext[l as usize] {
                let same = p == t.physical && self.disk().generation[p] == t.generation;
                if !same {
                    wrong = Some((l, p));
                }
                inode.ext[l as usize] = Ext::Written(p);
            }
        }
        let ours = |i: u64| snaps.iter().any(|s| s.idx == i);
        let (vfs, bound) = {
            let st = self.st();
            let unwritten = st
                .dirty_idx
                .range(inode.size / BS..)
                .copied()
                .find(|&i| !ours(i));
            (
                st.size.map_or(inode.size, |s| s.max(inode.size)),
                unwritten.map_or(u64::MAX, |i| i * BS),
            )
        };
        inode.size = inode.size.max(vfs.min(bound));
        if inode != before {
            self.write_inode(&inode);
        }
        let new_disk = inode.size;
        let mut st = self.st();
        if st.size.is_some_and(|s| s <= new_disk) {
            st.size = None;
        }
        drop(st);
        if let Some((l, p)) = wrong {
            panic!("writeback marked block {p} at {l} written, not the block it wrote");
        }
    }

    /// `Fs::settle_size`: an in-memory size ahead of the record with nothing left to
    /// write below it becomes the record's (the old tail zeroed on the device first).
    fn settle_size(&self) {
        let _t = self.tree.write().unwrap_or_else(|p| p.into_inner());
        let _h = self.txn.read().unwrap_or_else(|p| p.into_inner());
        let _i = self.inode_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut inode = self.read_inode();
        let target = {
            let mut st = self.st();
            let Some(s) = st.size else { return };
            if s <= inode.size {
                st.size = None;
                return;
            }
            let pending = st.dirty_idx.range(inode.size / BS..).next().is_some();
            if pending || st.writeback > 0 {
                return;
            }
            s
        };
        self.zero_past_eof(&inode, target);
        inode.size = target;
        self.write_inode(&inode);
        let mut st = self.st();
        if st.size == Some(target) {
            st.size = None;
        }
    }

    /// `Fs::drop_cache_ino` of the whole file (`drop_clean_pages`): the pages neither
    /// dirty nor under writeback go.
    fn drop_cache(&self) {
        let mut st = self.st();
        let idxs: Vec<u64> = st.pages.keys().copied().collect();
        for i in idxs {
            let clean = st.pages.get(&i).is_some_and(|p| {
                let d = p.lock();
                self.broken == Broken::DropBusyPages || (!d.dirty && !d.writeback)
            });
            if clean {
                self.remove_page(&mut st, i);
            }
        }
    }
}

/// The first byte of `got` (file bytes from 0) that is not the data before `eof` or a
/// zero past it: (offset, byte).
fn first_wrong(got: &[u8], eof: u64) -> Option<(usize, u8)> {
    got.iter()
        .enumerate()
        .find(|&(i, &b)| b != if (i as u64) < eof { DATA } else { 0 })
        .map(|(i, &b)| (i, b))
}

/// The user's loop (the seed's loop 1).
fn user(m: &Model) {
    for (round, pause) in PAUSES.into_iter().enumerate() {
        m.truncate(0);
        m.fallocate(FALLOC_END);
        m.pwrite_page(0);
        for _ in 0..pause {
            thread::yield_now();
        }
        m.truncate(EOF);
        let got = m.mmap_read(EOF - PEEK, 2 * PEEK);
        let (before, past) = got.split_at(PEEK as usize);
        assert!(
            past.iter().all(|&b| b == 0),
            "round {round}: the mapping's read of {PEEK} bytes at {EOF} after the truncate \
             shows stale bytes {past:x?}"
        );
        assert!(
            before.iter().all(|&b| b == DATA),
            "round {round}: the {PEEK} bytes before EOF lost their data: {before:x?}"
        );
    }
    m.user_done.store(true, SeqCst);
}

/// The flusher's loop (the seed's loop 2).
fn flusher(m: &Model) {
    for _ in 0..FLUSH_ROUNDS {
        if m.user_done.load(SeqCst) {
            break;
        }
        m.sync_range();
        m.drop_cache();
        thread::yield_now();
    }
}

/// The checks once both loops are done (see the module note).
fn at_the_end(m: &Model) {
    let size = m.vfs_size(&m.read_inode());
    assert_eq!(size, EOF, "the file's size at the end");
    let stale: Vec<(u64, usize, u8)> = m
        .st()
        .pages
        .iter()
        .filter_map(|(&i, p)| {
            let from = size.saturating_sub(i * BS).min(BS) as usize;
            let d = p.lock();
            d.buf[from..]
                .iter()
                .position(|&b| b != 0)
                .map(|k| (i, from + k, d.buf[from + k]))
        })
        .collect();
    assert!(
        stale.is_empty(),
        "at the end, cached pages hold bytes past EOF (page, offset, byte): {stale:x?}"
    );
    let got = m.mmap_read(0, BS);
    let wrong = first_wrong(&got, EOF);
    assert!(
        wrong.is_none(),
        "at the end, the EOF page read through the cache shows {wrong:x?} (offset, byte)"
    );
    // Everything on the device, nothing cached; then the file grows over the old tail.
    m.sync_range();
    m.drop_cache();
    let (cached, dirty) = {
        let st = m.st();
        (st.pages.len(), st.dirty_idx.len())
    };
    assert!(
        cached == 0 && dirty == 0,
        "after the final writeback {cached} pages stay cached, {dirty} dirty"
    );
    assert!(
        matches!(m.read_inode().map(0), Ext::Written(_)),
        "after the final writeback block 0 is not written: {:?}",
        m.read_inode().map(0)
    );
    m.truncate(2 * BS);
    let got = m.mmap_read(0, 2 * BS);
    let wrong = first_wrong(&got, EOF);
    assert!(
        wrong.is_none(),
        "after the file grew, a read through the cache shows {wrong:x?} (offset, byte)"
    );
    let disk = m.disk();
    let on_disk = match disk.inode.map(0) {
        Ext::Written(p) => first_wrong(&disk.blocks[p], EOF),
        _ => None,
    };
    drop(disk);
    assert!(
        on_disk.is_none(),
        "after the file grew, the device's block 0 holds {on_disk:x?} (offset, byte)"
    );
}

/// One run: the two loops on one model, joined, then the final checks.
fn scenario(broken: Broken) {
    let m = Arc::new(Model::new(broken));
    let u = {
        let m = m.clone();
        thread::spawn(move || user(&m))
    };
    let f = {
        let m = m.clone();
        thread::spawn(move || flusher(&m))
    };
    u.join().expect("user");
    f.join().expect("flusher");
    at_the_end(&m);
}

/// Schedules of the model as it is, and of each broken variant (it fails within a few
/// at most: the first failure ends the run).
const RANDOM_SCHEDULES: usize = 10_000;
const PCT_SCHEDULES: usize = 10_000;
const BROKEN_SCHEDULES: usize = 2_000;

#[test]
fn zeroing_random() {
    shuttle::check_random(|| scenario(Broken::None), RANDOM_SCHEDULES);
}

#[test]
fn zeroing_pct() {
    shuttle::check_pct(|| scenario(Broken::None), PCT_SCHEDULES, 3);
}

/// Run the broken variant `b` over `n` random schedules: it must fail, with a message
/// containing `expect`.
fn caught(b: Broken, n: usize, expect: &str) {
    super::model_check::expect_caught(&b, expect, || shuttle::check_random(move || scenario(b), n));
}

/// The seed's bug: the tail of a dirty page over an unwritten block is left alone.
#[test]
fn broken_skip_unwritten_tail_is_caught() {
    caught(
        Broken::SkipUnwrittenTail,
        BROKEN_SCHEDULES,
        "after the truncate shows stale bytes",
    );
}

/// The seed's race: the mapping looked up before writeback converts the block, the
/// page looked at after writeback cleaned it.
#[test]
fn broken_mapping_then_cache_is_caught() {
    caught(
        Broken::MappingThenCache,
        BROKEN_SCHEDULES,
        "after the truncate shows stale bytes",
    );
}

/// Dropping a dirty page loses its data (the block is still unwritten).
#[test]
fn broken_drop_busy_pages_is_caught() {
    caught(Broken::DropBusyPages, BROKEN_SCHEDULES, "lost their data");
}
