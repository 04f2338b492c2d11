//! Buffered reads and writes through the page cache, and the page-cache side of size
//! changes, hole punching, SEEK_DATA/SEEK_HOLE, direct I/O coherence and mappings.
//!
//! Locks (see `mod.rs`): callers of the `pc_*` helpers hold the inode's I/O lock as
//! noted on each; page instantiation takes the tree lock shared around the extent
//! lookups and re-reads the inode under it, because writeback may have changed the
//! extent tree since the caller read it.

use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::sync::Arc;

use rext4_format::inode::{flags, Inode};

use super::{
    new_page, pages_spanned, FileCache, Page, PageCache, PageData, READ_AROUND_BYTES,
    WRITE_NOW_BYTES,
};
use crate::error::{Error, Result};
use crate::fs::data_io::copy_into;
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};

/// Blocks promised to a buffered write before it marks its pages (`promise_pages`):
/// the pages over holes, sorted.
#[derive(Default)]
pub(crate) struct Promise {
    pages: Vec<u64>,
}

/// (depth, root entries) of an extent-mapped inode's tree, for the tree estimate;
/// [`super::BLOCK_MAP_SHAPE`] for a block-mapped one.
fn tree_shape(inode: &Inode) -> (u16, u16) {
    if !inode.has_flag(flags::EXTENTS) {
        return if crate::fs::inode_write::uses_block_map(inode) {
            super::BLOCK_MAP_SHAPE
        } else {
            (0, 0)
        };
    }
    let le16 = |o: usize| u16::from_le_bytes([inode.block[o], inode.block[o + 1]]);
    (le16(6), le16(2))
}

/// Where a byte of a file comes from, for SEEK_DATA / SEEK_HOLE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whence {
    Data,
    Hole,
}

impl Fs {
    fn pc(&self) -> &PageCache {
        &self.inner.pagecache
    }

    fn page_size(&self) -> u64 {
        self.inner.pagecache.page_size as u64
    }

    /// The size of `ino` as readers see it: the inode's, or the larger size in memory
    /// when buffered writes ran past it. `inode` is the record as the caller read it,
    /// under a lock that keeps the size from shrinking (the I/O lock); writeback may
    /// still raise the record and then drop the in-memory size, after the caller's
    /// read: with no in-memory size the record is read again (cheaply, from the inode
    /// cache), else a size from before the last writes would come back (a reader
    /// cut short; a writer zeroing written data as a stale tail past EOF).
    pub(crate) fn vfs_size(&self, ino: Ino, inode: &Inode) -> u64 {
        match self.pc().size_override(ino) {
            Some(s) => s.max(inode.size),
            None => self
                .record_size(ino)
                .map_or(inode.size, |r| r.max(inode.size)),
        }
    }

    /// Whether a dirty page of `ino` in pages `[from, to)` holds a promised block
    /// (delayed allocation): a block map keeps the indirect blocks such a page needs.
    pub(crate) fn pc_delalloc_in(&self, ino: Ino, from: u64, to: u64) -> bool {
        self.pc().file(ino).is_some_and(|fc| {
            let st = fc.lock();
            st.delalloc > 0
                && st
                    .dirty_idx
                    .range(from..to.max(from))
                    .any(|i| st.pages.get(i).is_some_and(|p| p.lock().delalloc))
        })
    }

    /// A truncate or punch changed the indirect blocks of `ino`: what its promise
    /// counted by name may be gone, so it is counted again from now on.
    pub(crate) fn pc_forget_indirect(&self, ino: Ino) {
        if let Some(fc) = self.pc().file(ino) {
            fc.lock().bm_counted.clear();
        }
    }

    /// 512-byte units of the blocks promised to dirty pages of `ino` over holes
    /// (delayed allocation): `stat` counts them with the allocated ones, as ext4 counts
    /// its reserved data blocks, so `du` sees a file's data before writeback.
    pub fn delalloc_blocks_512(&self, ino: Ino) -> u64 {
        self.pc()
            .file(ino)
            .map_or(0, |fc| fc.lock().delalloc * (self.page_size() / 512))
    }

    /// The record of `ino` and the size readers see, read in the order the module
    /// note gives (in-memory size first), so the two agree: the size equals the
    /// record's exactly when nothing runs ahead of it.
    pub(crate) fn inode_and_vfs_size(&self, ino: Ino) -> Result<(Inode, u64)> {
        let o = self.pc().size_override(ino);
        let inode = self.read_live_inode(ino)?;
        let size = o.map_or(inode.size, |s| s.max(inode.size));
        Ok((inode, size))
    }

    /// The inode as `stat` shows it (size from memory when it runs ahead). Reads the
    /// in-memory size before the record: see the ordering rule in `mod.rs`.
    pub(crate) fn read_inode_vfs(&self, ino: Ino) -> Result<Inode> {
        let o = self.pc().size_override(ino);
        let mut i = self.read_live_inode(ino)?;
        if let Some(s) = o {
            i.size = i.size.max(s);
        }
        Ok(i)
    }

    /// After the inode record's size became `disk_size`: drop the in-memory size if
    /// the record caught up with it (or a truncate replaced it).
    pub(crate) fn pc_disk_size_is(&self, ino: Ino, disk_size: u64, authoritative: bool) {
        if let Some(fc) = self.pc().file(ino) {
            let mut st = fc.lock();
            if authoritative || st.size.is_some_and(|s| s <= disk_size) {
                st.size = None;
            }
        }
    }

    /// Read pages `first..first+n` of `ino` from the device (holes and unwritten
    /// blocks as zeros), zeroing everything at or past `size`. Takes the tree lock.
    fn read_pages(&self, ino: Ino, first: u64, n: u64, size: u64) -> Result<Vec<Box<[u8]>>> {
        let ps = self.page_size();
        let mut out: Vec<Box<[u8]>> = (0..n).map(|_| self.pc().alloc_zeroed()).collect();
        let _t = self.tree_shared(ino);
        let inode = self.read_inode(ino)?;
        let end_page = size.div_ceil(ps);
        let mut i = 0u64;
        let mut tmp = Vec::new();
        while i < n {
            let l = first + i;
            if l >= end_page {
                break;
            }
            let (len, phys) = self.map_block(ino, &inode, l)?.data_run();
            let k = len.max(1).min(n - i).min(end_page - l);
            if let Some(p) = phys {
                tmp.resize((k * ps) as usize, 0);
                self.read_data_init(&mut tmp, p * ps)?;
                for (j, chunk) in tmp.chunks(ps as usize).enumerate() {
                    out[i as usize + j].copy_from_slice(chunk);
                }
            }
            i += k;
        }
        // Past EOF: zeros (stale bytes after a shrinking truncate stay on the device).
        if size.div_ceil(ps) > first && size.div_ceil(ps) <= first + n && !size.is_multiple_of(ps) {
            let last = (size / ps - first) as usize;
            out[last][(size % ps) as usize..].fill(0);
        }
        Ok(out)
    }

    /// Make sure pages `idxs` (sorted) of `ino` are cached, reading the missing ones in
    /// runs; returns the page now at each index (one cached meanwhile wins). Caller
    /// holds the I/O lock (either mode).
    fn instantiate(
        &self,
        fc: &FileCache,
        ino: Ino,
        idxs: &[u64],
        size: u64,
    ) -> Result<Vec<(u64, Arc<Page>)>> {
        let mut got = Vec::with_capacity(idxs.len());
        let mut k = 0;
        let mut attempts = 0;
        while k < idxs.len() {
            let start = idxs[k];
            let mut n = 1;
            while k + n < idxs.len() && idxs[k + n] == start + n as u64 {
                n += 1;
            }
            // While these pages are read, no clean page of the file is dropped (a
            // page written back meanwhile is still cached when this older copy
            // arrives, and wins); and a direct overwrite may land (under the shared
            // I/O lock too): the pages are not cached while one over them is in
            // flight, and are read again when one ended during the read
            // (`pc_direct_begin`; `dio_cache_model`).
            let (first, last) = (start, start + n as u64 - 1);
            let seen = {
                let mut st = fc.lock();
                st.loading += 1;
                st.direct_done
            };
            let read = self.read_pages(ino, start, n as u64, size);
            let mut st = fc.lock();
            st.loading -= 1;
            let bufs = read?;
            if st.dead {
                return Err(Error::NotFound);
            }
            let in_flight = st.direct_in_flight_over(first, last);
            if in_flight || st.direct_done_over_since(seen, first, last) {
                while st.direct_in_flight_over(first, last) {
                    st = st.wait(&fc.wb_done);
                }
                drop(st);
                for b in bufs {
                    self.pc().recycle_buf(b);
                }
                attempts += 1;
                if attempts > 1000 {
                    return Err(Error::Io(std::io::Error::other(
                        "page cache: direct writes kept landing while pages were read",
                    )));
                }
                continue;
            }
            for (j, b) in bufs.into_iter().enumerate() {
                let i = start + j as u64;
                got.push((i, self.pc().insert_page(&mut st, ino, i, new_page(b))));
            }
            drop(st);
            k += n;
        }
        self.pc().reclaim_if_needed();
        Ok(got)
    }

    /// Pages `first..=last` of `ino`, instantiating missing ones; with `readahead`,
    /// also reads ahead a window past `last` when reads look sequential. Caller holds
    /// the I/O lock.
    fn get_pages(
        &self,
        fc: &FileCache,
        ino: Ino,
        first: u64,
        last: u64,
        size: u64,
        readahead: bool,
    ) -> Result<Vec<Arc<Page>>> {
        let ps = self.page_size();
        let eof_page = size.div_ceil(ps);
        let mut missing = Vec::new();
        let mut out: Vec<Option<Arc<Page>>> = Vec::with_capacity((last - first + 1) as usize);
        {
            let mut st = fc.lock();
            if st.dead {
                return Err(Error::NotFound);
            }
            for i in first..=last {
                match st.pages.get(&i) {
                    Some(p) => out.push(Some(p.clone())),
                    None => {
                        out.push(None);
                        missing.push(i);
                    }
                }
            }
            if readahead {
                let seq = first == st.ra_next;
                if !missing.is_empty() {
                    let min = (super::READAHEAD_MIN_BYTES / ps).max(1);
                    let max = (super::READAHEAD_MAX_BYTES / ps).max(min);
                    st.ra_pages = if seq {
                        (st.ra_pages * 2).clamp(min, max)
                    } else {
                        min
                    };
                    if seq || missing.len() as u64 > min {
                        let ra_end = (last + st.ra_pages).min(eof_page.saturating_sub(1));
                        for i in last + 1..=ra_end {
                            if !st.pages.contains_key(&i) {
                                missing.push(i);
                            }
                        }
                    }
                }
                st.ra_next = last + 1;
            }
        }
        if !missing.is_empty() {
            for (i, p) in self.instantiate(fc, ino, &missing, size)? {
                if i <= last {
                    out[(i - first) as usize] = Some(p);
                }
            }
        }
        out.into_iter()
            .map(|p| p.ok_or_else(|| Error::corrupted("page cache lost a page", None)))
            .collect()
    }

    /// Buffered read of a regular file. Caller holds the I/O lock; `inode` is current.
    pub(crate) fn pc_read(
        &self,
        ino: Ino,
        inode: &Inode,
        buf: &mut [u8],
        offset: u64,
        readahead: bool,
    ) -> Result<usize> {
        let Some((size, want)) = self.read_span(ino, inode, buf.len(), offset) else {
            return Ok(0);
        };
        if self.reads_around(want) {
            // SAFETY: `read_around` writes only initialized bytes.
            let b = unsafe { crate::device::as_uninit(&mut buf[..want]) };
            return self.read_around(ino, b, offset, size);
        }
        self.copy_from_pages(ino, &mut buf[..want], offset, size, readahead)
    }

    /// What a read of `len` bytes at `offset` of regular file `ino` covers: the
    /// file's size and the bytes to read (`None`: nothing, at or past the end).
    fn read_span(&self, ino: Ino, inode: &Inode, len: usize, offset: u64) -> Option<(u64, usize)> {
        let size = self.vfs_size(ino, inode);
        (offset < size && len > 0).then(|| (size, (len as u64).min(size - offset) as usize))
    }

    /// Whether a read of `want` bytes goes around the cache (`read_around`).
    fn reads_around(&self, want: usize) -> bool {
        !self.pc().keep_clean || want as u64 >= READ_AROUND_BYTES
    }

    /// A buffered read of regular file `ino` into a buffer that need not be
    /// initialized, when it goes around the cache (`read_around`, which fills any
    /// buffer); `None` when it would go through the cache (the caller reads into
    /// an initialized buffer instead). Takes the I/O lock as `read_ino_at` does.
    pub(crate) fn pc_read_around_into(
        &self,
        ino: Ino,
        buf: &mut [MaybeUninit<u8>],
        offset: u64,
    ) -> Result<Option<usize>> {
        let _io = self.io_shared(ino);
        let inode = self.read_inode(ino)?;
        if inode.mode == 0 {
            return Err(Error::NotFound);
        }
        if !inode.is_reg() || inode.has_flag(flags::INLINE_DATA) {
            return Ok(None);
        }
        let Some((size, want)) = self.read_span(ino, &inode, buf.len(), offset) else {
            return Ok(Some(0));
        };
        if !self.reads_around(want) {
            return Ok(None);
        }
        self.read_around(ino, &mut buf[..want], offset, size)
            .map(Some)
    }

    /// A read that does not fill the cache: what is cached (dirty or not) is copied,
    /// the gaps are read straight from the device. For large reads (they are their own
    /// read-ahead, and would only push other pages out) and for frontends that cache
    /// clean data themselves. Caller holds the I/O lock; `size` is the file's size.
    fn read_around(
        &self,
        ino: Ino,
        buf: &mut [MaybeUninit<u8>],
        offset: u64,
        size: u64,
    ) -> Result<usize> {
        let ps = self.page_size();
        let len = buf.len() as u64;
        let (first, last) = pages_spanned(offset, len, ps);
        let cached: Vec<(u64, Arc<Page>)> = match self.pc().file(ino) {
            Some(fc) => fc
                .lock()
                .pages
                .range(first..=last)
                .map(|(&i, p)| (i, p.clone()))
                .collect(),
            None => Vec::new(),
        };
        let _t = self.tree_shared(ino);
        // The record as it is now (writeback may have changed the tree), sized as the
        // file: past the record's size there is nothing on the device (holes).
        let mut dev_inode = self.read_inode(ino)?;
        dev_inode.size = size;
        let end = offset + len;
        let mut pos = offset;
        let mut next = cached.iter().peekable();
        while pos < end {
            let idx = pos / ps;
            while next.peek().is_some_and(|(i, _)| *i < idx) {
                next.next();
            }
            let at = (pos - offset) as usize;
            match next.peek() {
                Some((i, p)) if *i == idx => {
                    let upto = end.min((idx + 1) * ps);
                    let from = (pos - idx * ps) as usize;
                    let n = (upto - pos) as usize;
                    copy_into(&mut buf[at..at + n], &p.lock().buf[from..from + n]);
                    pos = upto;
                }
                other => {
                    let upto = other.map_or(end, |(i, _)| (i * ps).min(end));
                    let n = (upto - pos) as usize;
                    let got = self.read_device_into(ino, &dev_inode, &mut buf[at..at + n], pos)?;
                    buf[at + got..at + n].fill(MaybeUninit::new(0));
                    pos = upto;
                }
            }
        }
        Ok(len as usize)
    }

    /// Copy `buf.len()` bytes at `offset` out of the cached pages (instantiating
    /// them), whatever the size says: for mappings, which may read the EOF page's tail
    /// (zeros). Caller holds the I/O lock and checked the range.
    pub(crate) fn pc_read_pages(
        &self,
        ino: Ino,
        buf: &mut [u8],
        offset: u64,
        size: u64,
    ) -> Result<usize> {
        self.copy_from_pages(ino, buf, offset, size, false)
    }

    fn copy_from_pages(
        &self,
        ino: Ino,
        buf: &mut [u8],
        offset: u64,
        size: u64,
        readahead: bool,
    ) -> Result<usize> {
        let want = buf.len();
        if want == 0 {
            return Ok(0);
        }
        let ps = self.page_size();
        let (first, last) = pages_spanned(offset, want as u64, ps);
        let fc = self.pc().live_file(ino);
        let pages = self.get_pages(&fc, ino, first, last, size, readahead)?;
        let mut done = 0usize;
        for (k, p) in pages.iter().enumerate() {
            let idx = first + k as u64;
            let pstart = idx * ps;
            let from = (offset + done as u64 - pstart) as usize;
            let n = (ps as usize - from).min(want - done);
            p.hot.store(true, std::sync::atomic::Ordering::Relaxed);
            let d = p.lock();
            buf[done..done + n].copy_from_slice(&d.buf[from..from + n]);
            drop(d);
            done += n;
        }
        Ok(done)
    }

    /// A buffered write (`offset` `None`: O_APPEND, at the end under the exclusive
    /// lock). The I/O lock is shared for a write that ends inside the file (no size
    /// changes: such writes run in parallel) and exclusive for one that extends it.
    /// Files the page cache does not write (not extent-mapped) and writes when free
    /// space is low go to the device with allocation at once (`write_through`).
    pub(crate) fn write_buffered(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: Option<u64>,
        update_times: bool,
    ) -> Result<usize> {
        self.check_writable()?;
        if self.is_dax() {
            return self.dax_write(ino, buf, offset, update_times);
        }
        let len = buf.len() as u64;
        let ps = self.page_size();
        // A large page-aligned write under a frontend that caches and delays writes
        // itself (the kernel's writeback cache) is already writeback: it goes to the
        // device at once, through writeback's own path, unless pages of its range are
        // cached. It takes the exclusive lock, so no partial write can slip in.
        let now = !self.pc().keep_clean
            && len >= WRITE_NOW_BYTES
            && len.is_multiple_of(ps)
            && offset.is_some_and(|o| o.is_multiple_of(ps));
        let guard = loop {
            let size = self.read_inode_vfs(ino)?.size;
            match offset {
                Some(off) if off.saturating_add(len) <= size && !now => {
                    let g = self.io_shared(ino);
                    if self.read_inode_vfs(ino)?.size >= off + len {
                        break IoGuard::Shared(g);
                    }
                }
                _ => break IoGuard::Exclusive(self.io_exclusive(ino)),
            }
        };
        let (inode, size) = self.inode_and_vfs_size(ino)?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        let append = offset.is_none();
        let offset = offset.unwrap_or(size);
        if buf.is_empty() {
            return Ok(0);
        }
        let buf = self.clamp_write(&inode, buf, offset)?;
        let len = buf.len() as u64;
        let end = offset + len;
        let (first, last) = pages_spanned(offset, len, self.page_size());
        let go_now = now && self.pc_uncached(ino, first, last);
        // Pages over holes promise their blocks now (delayed allocation); when the
        // space is not there the write allocates at once instead, so ENOSPC (or a
        // short write) comes from this call, as ext4's nodelalloc fallback.
        // Inline files, and an empty file whose first bytes may go inline, are
        // written in the record (inline.rs), never through pages.
        let inline = inode.has_flag(flags::INLINE_DATA)
            || (self.may_inline(&inode) && end <= self.inline_capacity_bound());
        let promise = if !cacheable(&inode) || inline {
            None
        } else if go_now {
            Some(Promise::default())
        } else {
            match self.promise_pages_or_flush(ino, first, last) {
                Ok(p) => self.no_delalloc_on_bigalloc(ino, p),
                Err(Error::NoSpace) => None,
                Err(e) => return Err(e),
            }
        };
        let Some(promise) = promise else {
            drop(guard);
            let at = if append { None } else { Some(offset) };
            return self.write_through(ino, buf, at, update_times);
        };
        if offset > size && size == inode.size {
            // Growing past a partial last block whose device copy may hold stale bytes
            // from an earlier shrink: zero them before a size that shows them commits.
            let zeroed = {
                let _w = self.write_lock();
                self.check_writable()
                    .and_then(|()| self.zero_past_eof(ino, &inode, offset))
            };
            if let Err(e) = zeroed {
                self.cancel_promise(ino, promise);
                return Err(e);
            }
        }
        if go_now {
            self.write_now(ino, buf, offset, end.max(size))?;
        } else {
            self.pc_write(ino, buf, offset, size, u64::MAX, promise)?;
        }
        if update_times {
            if let Err(e) = self.touch_times(ino) {
                // The data is written: the write succeeded, only its times did not
                // move (a failed inode read). As the kernel's time update after a
                // failed inode read: the error is recorded, the write stands.
                log::error!(
                    "rext4: inode {}: times not updated after a write: {e}",
                    ino.0
                );
                self.note_error(&e);
            }
        }
        drop(guard);
        self.balance_dirty();
        self.pc().reclaim_if_needed();
        Ok(buf.len())
    }

    /// Whether no page of `ino` in `[first, last]` is cached.
    fn pc_uncached(&self, ino: Ino, first: u64, last: u64) -> bool {
        self.pc()
            .file(ino)
            .is_none_or(|fc| fc.lock().pages.range(first..=last).next().is_none())
    }

    /// Write whole pages straight to the device the way writeback would (unwritten
    /// extents for holes, the data, then conversion and the size), from `buf` at
    /// page-aligned `offset`; `new_size` is the file's size after the write. Caller
    /// holds the I/O lock exclusively and found no cached page in the range.
    fn write_now(&self, ino: Ino, buf: &[u8], offset: u64, new_size: u64) -> Result<()> {
        let ps = self.page_size();
        let fc = self.pc().live_file(ino);
        let last = (offset + buf.len() as u64) / ps - 1;
        // Buffered data between the on-disk size and this write goes first, so the
        // size can follow this write's data (no data may lie past the on-disk size).
        let disk_page = self.read_inode(ino)?.size / ps;
        let below =
            disk_page <= last && fc.lock().dirty_idx.range(disk_page..=last).next().is_some();
        if below {
            self.writeback_ino(ino, disk_page, last, true)?;
        }
        let disk = self.read_inode(ino)?.size;
        let before = {
            let mut st = fc.lock();
            let before = st.size;
            if new_size > disk {
                st.size = Some(before.map_or(new_size, |s| s.max(new_size)));
            }
            // Until this write is done, a whole-file pass (another thread's sync, an
            // early commit) must not take the size just set for a hole and write it
            // to the record: a failed write would leave the file longer than any
            // write that succeeded (the full_disk flake).
            st.writing_now += 1;
            before
        };
        self.pin(ino);
        // Dirty pages past this write keep the on-disk size below them (`finish_chunk`).
        let runs = [(offset / ps, buf.len() as u64 / ps)];
        let how = super::writeback::ChunkWrite {
            pages: &[],
            journal: false,
        };
        let r = self.write_chunk(fc.arc(), ino, &runs, buf, how);
        let disk_now = self.read_inode(ino).map(|i| i.size);
        let mut st = fc.lock();
        st.writing_now -= 1;
        if r.is_err() {
            // The write did not happen: the file keeps the size it had.
            if disk_now.map_or(true, |d| before.is_none_or(|b| b > d)) {
                st.size = before;
            }
        }
        drop(st);
        let u = self.unpin(ino);
        r.and(u)
    }

    /// Promise a block for each page of `[first, last]` of `ino` that lies over a hole
    /// and holds no promise yet, and the extent-tree blocks their writeback may need
    /// (`space`): all or nothing, `NoSpace` when the space is not there. The caller
    /// holds the I/O lock and hands the promise to `pc_write` (or `cancel_promise`).
    pub(crate) fn promise_pages(&self, ino: Ino, first: u64, last: u64) -> Result<Promise> {
        let fc = self.pc().live_file(ino);
        let (pages, shape, missing) = {
            let _t = self.tree_shared(ino);
            let inode = self.read_inode(ino)?;
            let held = |i: u64| {
                let st = fc.lock();
                st.pages.get(&i).is_some_and(|p| p.lock().delalloc)
            };
            let mut pages = Vec::new();
            let mut lblk = first;
            while lblk <= last {
                match self.map_block(ino, &inode, lblk)? {
                    Mapping::Hole { len } => {
                        let end = lblk.saturating_add(len.max(1)).min(last + 1);
                        pages.extend((lblk..end).filter(|&i| !held(i)));
                        lblk = end;
                    }
                    Mapping::Mapped { len, .. } => lblk = lblk.saturating_add(len.max(1)),
                }
            }
            let shape = tree_shape(&inode);
            // A block map: the indirect blocks these pages would need, by name.
            let missing = if shape == super::BLOCK_MAP_SHAPE {
                self.indirect_missing(&inode, &pages)?
            } else {
                Vec::new()
            };
            (pages, shape, missing)
        };
        if pages.is_empty() {
            return Ok(Promise::default());
        }
        let n = pages.len() as u64;
        let per_leaf = (self.page_size() - 12) / 12;
        let mut st = fc.lock();
        if shape == super::BLOCK_MAP_SHAPE {
            // Each missing indirect block once, however many writes dirty pages
            // under it (the last ones counted are remembered; one forgotten is
            // counted again, which only promises more).
            let fresh: Vec<_> = missing
                .into_iter()
                .filter(|k| !st.bm_counted.contains(k))
                .collect();
            let extra = fresh.len() as u64;
            self.inner.space.reserve(n, extra)?;
            st.pending += n;
            st.resv_tree += extra;
            st.tree_shape = shape;
            st.bm_counted.extend(fresh);
            let over = st.bm_counted.len().saturating_sub(64);
            st.bm_counted.drain(..over);
            return Ok(Promise { pages });
        }
        let need = crate::fs::space::tree_blocks_for(
            st.delalloc + st.pending + n,
            shape.0,
            shape.1,
            per_leaf,
        );
        let extra = need.saturating_sub(st.resv_tree);
        self.inner.space.reserve(n, extra)?;
        st.pending += n;
        st.resv_tree += extra;
        st.tree_shape = shape;
        Ok(Promise { pages })
    }

    /// `promise_pages`, and when the space is not there, first write back every dirty
    /// file and ask again: the tree blocks promised to dirty data are estimates, and
    /// writeback turns them into what was really used (ext4 likewise flushes delayed
    /// allocations before it reports ENOSPC).
    pub(crate) fn promise_pages_or_flush(
        &self,
        ino: Ino,
        first: u64,
        last: u64,
    ) -> Result<Promise> {
        match self.promise_pages(ino, first, last) {
            Err(Error::NoSpace) if self.inner.space.figures().2 > 0 => {
                self.writeback_every_file(false)?;
                self.promise_pages(ino, first, last)
            }
            r => r,
        }
    }

    /// bigalloc: pages over holes are not delayed (their blocks' clusters are found
    /// at once, as the kernel's nodelalloc): a promise that holds any page is given
    /// back and `None` returned, so the caller writes through with allocation.
    /// Overwrites of mapped blocks keep the page cache.
    pub(crate) fn no_delalloc_on_bigalloc(&self, ino: Ino, promise: Promise) -> Option<Promise> {
        if self.cluster_bits() == 0 || promise.pages.is_empty() {
            return Some(promise);
        }
        self.cancel_promise(ino, promise);
        None
    }

    /// Give back a promise that no page will take.
    pub(crate) fn cancel_promise(&self, ino: Ino, promise: Promise) {
        if promise.pages.is_empty() {
            return;
        }
        let fc = self.pc().live_file(ino);
        let mut st = fc.lock();
        self.settle_promise(&mut st, &promise, 0);
    }

    /// The write holding `promise` marked `used` of its pages as holding a block:
    /// the rest goes back.
    fn settle_promise(&self, st: &mut super::FileState, promise: &Promise, used: u64) {
        let n = promise.pages.len() as u64;
        st.pending = st.pending.saturating_sub(n);
        st.delalloc += used;
        self.inner.space.unreserve(n - used, 0);
        self.pc().settle_tree(st);
    }

    /// Copy `buf` into the cached pages of `ino` at `offset` and mark them dirty; pages
    /// that become dirty over holes reserve a block each. `size` is the file's current
    /// size (the caller holds the I/O lock: shared when the write ends within `size`,
    /// exclusive otherwise). `limit` bounds what may be written (mappings never write
    /// past the end of the file): bytes past it are dropped. `promise` (from
    /// `promise_pages` for this range) is spent on the pages that become dirty over
    /// holes; what they do not take goes back, also on failure.
    pub(crate) fn pc_write(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: u64,
        size: u64,
        limit: u64,
        promise: Promise,
    ) -> Result<()> {
        let ps = self.page_size();
        let end = offset + buf.len() as u64;
        let (first, last) = pages_spanned(offset, buf.len() as u64, ps);
        let fc = self.pc().live_file(ino);
        // Pages only partly overwritten need their old contents: read the missing
        // ones, then copy under the state lock only once all of them are there. A
        // page read earlier may have left the cache meanwhile (reclaim, or dropped
        // after writeback by a frontend that caches clean data itself) while another
        // writer under the shared I/O lock changed its block: it is read again, never
        // put back as it was, never replaced by a fresh buffer.
        let partial = |i: u64| !(offset <= i * ps && end >= (i + 1) * ps);
        let mut attempts = 0;
        let mut st = loop {
            let need: Vec<u64> = {
                let st = fc.lock();
                if st.dead {
                    drop(st);
                    self.settle_promise(&mut fc.lock(), &promise, 0);
                    return Err(Error::NotFound);
                }
                [first, last]
                    .into_iter()
                    .filter(|&i| partial(i) && !st.pages.contains_key(&i))
                    .collect::<BTreeSet<u64>>()
                    .into_iter()
                    .collect()
            };
            if !need.is_empty() {
                if let Err(e) = self.instantiate(&fc, ino, &need, size) {
                    self.settle_promise(&mut fc.lock(), &promise, 0);
                    return Err(e);
                }
            }
            let st = fc.lock();
            let present = [first, last]
                .into_iter()
                .all(|i| !partial(i) || st.pages.contains_key(&i));
            if present || st.dead {
                break st;
            }
            drop(st);
            attempts += 1;
            if attempts > 1000 {
                self.settle_promise(&mut fc.lock(), &promise, 0);
                return Err(Error::Io(std::io::Error::other(
                    "page cache: a page kept leaving the cache before it could be written",
                )));
            }
        };
        {
            if st.dead {
                self.settle_promise(&mut st, &promise, 0);
                return Err(Error::NotFound);
            }
            let mut used = 0;
            for i in first..=last {
                let p = match st.pages.get(&i) {
                    Some(p) => p.clone(),
                    None => {
                        // Wholly overwritten below (it was not read), unless the limit
                        // cuts the write: then the rest must read as zeros.
                        let buf = if limit >= end {
                            self.pc().alloc_buf()
                        } else {
                            self.pc().alloc_zeroed()
                        };
                        self.pc().insert_page(&mut st, ino, i, new_page(buf))
                    }
                };
                let pstart = i * ps;
                let from = offset.max(pstart);
                let to = end.min(pstart + ps).min(limit.max(from));
                let mut d = p.lock();
                if to > from {
                    d.buf[(from - pstart) as usize..(to - pstart) as usize]
                        .copy_from_slice(&buf[(from - offset) as usize..(to - offset) as usize]);
                }
                d.seq += 1;
                if !d.dirty {
                    d.dirty = true;
                    self.pc().note_dirty(&mut st, ino, i);
                }
                // Dirty over a hole: it holds a promised block from now on (set with
                // `dirty`, under the page lock, so writeback never sees one without).
                if !d.delalloc && promise.pages.binary_search(&i).is_ok() {
                    d.delalloc = true;
                    used += 1;
                }
                drop(d);
                p.hot.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            if end > size && limit >= end {
                st.size = Some(end);
            }
            self.settle_promise(&mut st, &promise, used);
        }
        Ok(())
    }

    /// Before the size of `ino` changes to `new_size` (truncate): drop the pages past
    /// it (waiting for writeback on them) and zero the tail of the page holding the new
    /// end. The tail is zeroed in memory only: the device keeps its bytes until the file
    /// grows again (`zero_past_eof`), so nothing committed changes before the truncate
    /// commits. Caller holds the I/O lock exclusively, not the write lock.
    pub(crate) fn pc_truncate(&self, ino: Ino, new_size: u64, disk_size: u64) {
        let Some(fc) = self.pc().file(ino) else {
            return;
        };
        let ps = self.page_size();
        let first_gone = new_size.div_ceil(ps);
        let mut st = fc.lock();
        let gone: Vec<u64> = st.pages.range(first_gone..).map(|(&i, _)| i).collect();
        let mut removed = Vec::with_capacity(gone.len());
        for i in gone {
            if let Some(p) = self.pc().remove_page(&mut st, ino, i) {
                removed.push(p);
            }
        }
        let mut st = fc.wait_pages(st, &removed);
        for p in removed {
            self.pc().recycle(p);
        }
        if !new_size.is_multiple_of(ps) {
            if let Some(p) = st.pages.get(&(new_size / ps)) {
                let mut d = p.lock();
                d.buf[(new_size % ps) as usize..].fill(0);
                d.seq += 1;
            }
        }
        // Past the record's size the in-memory size changes now (readers see the new
        // size at once); below it, after the record is written (`pc_disk_size_is`),
        // so until then readers see the old size, never a mix.
        if new_size > disk_size && st.size.is_some_and(|s| s > new_size) {
            st.size = Some(new_size);
        }
        drop(st);
        fc.wb_done.notify_all();
    }

    /// Drop the cached pages wholly inside `[start, end)` (bytes), waiting for
    /// writeback on them: their blocks are about to be punched. Caller holds the I/O
    /// lock exclusively.
    pub(crate) fn pc_drop_range(&self, ino: Ino, start: u64, end: u64) {
        let Some(fc) = self.pc().file(ino) else {
            return;
        };
        let ps = self.page_size();
        let (a, b) = (start.div_ceil(ps), end / ps);
        if a >= b {
            return;
        }
        let mut st = fc.lock();
        let gone: Vec<u64> = st.pages.range(a..b).map(|(&i, _)| i).collect();
        let mut removed = Vec::new();
        for i in gone {
            if let Some(p) = self.pc().remove_page(&mut st, ino, i) {
                removed.push(p);
            }
        }
        drop(fc.wait_pages(st, &removed));
        for p in removed {
            self.pc().recycle(p);
        }
    }

    /// Zero `[from, to)` (within one page) of `ino`: in the cached page if there is one
    /// (dirtying it when the device copy is written data), else on the device where the
    /// block is written. The cache is checked first: under the exclusive I/O lock no
    /// page can appear meanwhile, while one that was there and was written back and
    /// reclaimed is already reflected by the mapping (SEEDS lesson B's race).
    ///
    /// A dirty page, or one under writeback, is zeroed and left (or made) dirty: its
    /// next writeback carries the zeros whatever the block is. A clean page needs the
    /// mapping (zeros over an unwritten block need no write), which may read extent
    /// blocks from the device: it is looked up with no page-cache mutex held, and the
    /// page is zeroed only if it is still the same clean page, unchanged (`seq`), when
    /// the locks are taken again; else the look starts over. Caller holds the I/O lock
    /// exclusively and the write lock, so no writer dirties the page and the mapping
    /// cannot move meanwhile: one retry at most in practice.
    pub(crate) fn zero_partial(&self, ino: Ino, inode: &Inode, from: u64, to: u64) -> Result<()> {
        let ps = self.page_size();
        let idx = from / ps;
        let base = idx * ps;
        let zero = |d: &mut PageData| {
            d.buf[(from - base) as usize..(to - base) as usize].fill(0);
            d.seq += 1;
        };
        let Some(fc) = self.pc().file(ino) else {
            return self.zero_on_disk(ino, inode, from, to - from);
        };
        // The mapping found for a clean page: (the page, its seq then, written?).
        let mut looked: Option<(Arc<Page>, u64, bool)> = None;
        for _ in 0..1000 {
            let mut st = fc.lock();
            let Some(p) = st.pages.get(&idx).cloned() else {
                drop(st);
                return self.zero_on_disk(ino, inode, from, to - from);
            };
            let mut d = p.lock();
            if d.dirty || d.writeback {
                zero(&mut d);
                if !d.dirty {
                    d.dirty = true;
                    self.pc().note_dirty(&mut st, ino, idx);
                }
                return Ok(());
            }
            match looked.take() {
                Some((q, seq, written)) if Arc::ptr_eq(&p, &q) && d.seq == seq => {
                    zero(&mut d);
                    if written {
                        d.dirty = true;
                        self.pc().note_dirty(&mut st, ino, idx);
                    }
                    return Ok(());
                }
                _ => {
                    let seq = d.seq;
                    drop(d);
                    drop(st);
                    // A failed lookup leaves the page as it was, not zeroed over data
                    // the device still holds.
                    let written = matches!(
                        self.map_block(ino, inode, idx)?,
                        Mapping::Mapped {
                            unwritten: false,
                            ..
                        }
                    );
                    looked = Some((p, seq, written));
                }
            }
        }
        Err(Error::Io(std::io::Error::other(
            "page cache: a page kept changing while a partial block was zeroed",
        )))
    }

    /// Direct overwrites of `ino` (`(bytes, file offset)` each) are about to go to the
    /// device: copy their bytes into the cached pages they cover and mark their ranges
    /// in flight until the returned guard is dropped (after the data is written, still
    /// under the shared I/O lock, success or not), so the cache stays coherent with the
    /// device. The overwrites run under the shared I/O lock, beside buffered writers
    /// that may read a page from the device before the data lands and cache (and
    /// dirty) it: without the copy, that page's writeback would put the old bytes back
    /// over a direct write that returned. The copy bumps `seq`, so a writeback of an
    /// older snapshot in flight leaves the page dirty; a page read while a range is in
    /// flight waits for it, one read while an overwrite over it ended is read again
    /// (`instantiate`). The copy comes before the data write: made after it, a stale
    /// page could be dirtied, written back over the new data and dropped in between.
    /// The shared I/O lock keeps the file's size and mapping those the overwrites were
    /// checked against (`dio_cache_model` models this protocol).
    pub(crate) fn pc_direct_begin(&self, ino: Ino, writes: &[(&[u8], u64)]) -> DirectInFlight<'_> {
        let ps = self.page_size();
        let fc = self.pc().live_file(ino);
        let ranges: Vec<(u64, u64)> = writes
            .iter()
            .filter(|(b, _)| !b.is_empty())
            .map(|&(b, off)| pages_spanned(off, b.len() as u64, ps))
            .collect();
        let mut st = fc.lock();
        st.direct_in_flight.extend_from_slice(&ranges);
        for &(buf, offset) in writes {
            if buf.is_empty() || st.pages.is_empty() {
                continue;
            }
            let (first, last) = pages_spanned(offset, buf.len() as u64, ps);
            let end = offset + buf.len() as u64;
            for (&i, p) in st.pages.range(first..=last) {
                let pstart = i * ps;
                let from = offset.max(pstart);
                let to = end.min(pstart + ps);
                let mut d = p.lock();
                d.buf[(from - pstart) as usize..(to - pstart) as usize]
                    .copy_from_slice(&buf[(from - offset) as usize..(to - offset) as usize]);
                d.seq += 1;
            }
        }
        drop(st);
        DirectInFlight {
            fs: self,
            fc: Some(fc),
            ranges,
        }
    }

    /// Write back and drop the cached pages of `ino` overlapping `[off, off+len)`, so
    /// the device holds everything and no page can shadow a direct write.
    pub(crate) fn pc_flush_invalidate(&self, ino: Ino, off: u64, len: u64) -> Result<()> {
        if len == 0 || self.pc().file(ino).is_none() {
            return Ok(());
        }
        let (first, last) = pages_spanned(off, len, self.page_size());
        self.writeback_ino(ino, first, last, true)?;
        self.drop_clean_pages(ino, first, last);
        Ok(())
    }

    /// Drop the clean cached pages of `ino` in `[off, off+len)` (`len` 0: to the end),
    /// like POSIX_FADV_DONTNEED: dirty pages and pages under writeback stay.
    pub fn drop_cache_ino(&self, ino: Ino, off: u64, len: u64) {
        let ps = self.page_size();
        let last = if len == 0 {
            u64::MAX
        } else {
            (off.saturating_add(len) - 1) / ps
        };
        self.drop_clean_pages(ino, off / ps, last);
    }

    /// Drop the pages of `ino` in `[first, last]` that are neither dirty nor under
    /// writeback.
    fn drop_clean_pages(&self, ino: Ino, first: u64, last: u64) {
        let Some(fc) = self.pc().file(ino) else {
            return;
        };
        let mut st = fc.lock();
        if st.loading > 0 {
            // A page on its way in may be older than one dropped now (`instantiate`).
            return;
        }
        let idxs: Vec<u64> = st.pages.range(first..=last).map(|(&i, _)| i).collect();
        for i in idxs {
            let clean = st.pages.get(&i).is_some_and(|p| {
                let d = p.lock();
                !d.dirty && !d.writeback
            });
            if clean {
                if let Some(p) = self.pc().remove_page(&mut st, ino, i) {
                    self.pc().recycle(p);
                }
            }
        }
    }

    /// copy_file_range(2) within the image: up to `len` bytes of `src` from `off_in`
    /// to `dst` at `off_out`, through the page cache (ext4 has no shared extents, so
    /// the kernel copies too). Returns the bytes copied: fewer at the source's end.
    /// Overlapping ranges of one file are EINVAL, as in Linux.
    pub fn copy_range_ino(
        &self,
        src: Ino,
        off_in: u64,
        dst: Ino,
        off_out: u64,
        len: u64,
        update_times: bool,
    ) -> Result<u64> {
        if src == dst
            && off_in < off_out.saturating_add(len)
            && off_out < off_in.saturating_add(len)
        {
            return Err(Error::InvalidInput(
                "copy_file_range of overlapping ranges of one file".into(),
            ));
        }
        let si = self.read_live_inode(src)?;
        let di = self.read_live_inode(dst)?;
        if si.is_dir() || di.is_dir() {
            return Err(Error::IsADirectory);
        }
        if !si.is_reg() || !di.is_reg() {
            return Err(Error::InvalidInput(
                "copy_file_range between non-regular files".into(),
            ));
        }
        let mut buf = vec![0u8; len.min(1 << 20) as usize];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            let inode = self.read_inode(src)?;
            let got = self.read_ino_at(src, &inode, &mut buf[..n], off_in + done)?;
            if got == 0 {
                break;
            }
            self.write_buffered(dst, &buf[..got], Some(off_out + done), update_times)?;
            done += got as u64;
        }
        Ok(done)
    }

    /// SEEK_DATA / SEEK_HOLE from `offset`: data is a written extent or a dirty page
    /// (delayed allocation or not yet converted); `None` is ENXIO.
    pub fn seek_ino(&self, ino: Ino, offset: u64, whence: Whence) -> Result<Option<u64>> {
        let _io = self.io_shared(ino);
        let _t = self.tree_shared(ino);
        let inode = self.read_inode_vfs(ino)?;
        let size = inode.size;
        if offset >= size {
            return Ok(None);
        }
        if inode.has_flag(flags::INLINE_DATA) {
            // All of an inline file is data.
            return Ok(match whence {
                Whence::Data => Some(offset),
                Whence::Hole => Some(size),
            });
        }
        let ps = self.page_size();
        let end_blk = size.div_ceil(ps);
        let dirty: Vec<u64> = match self.pc().file(ino) {
            Some(fc) => fc
                .lock()
                .dirty_idx
                .range(offset / ps..end_blk)
                .copied()
                .collect(),
            None => Vec::new(),
        };
        let is_dirty = |l: u64| dirty.binary_search(&l).is_ok();
        let next_dirty = |l: u64| dirty.get(dirty.partition_point(|&d| d < l)).copied();
        let mut l = offset / ps;
        while l < end_blk {
            let (len, data) = match self.map_block(ino, &inode, l)? {
                Mapping::Hole { len } => (len, false),
                Mapping::Mapped { len, unwritten, .. } => (len, !unwritten),
            };
            let run_end = l.saturating_add(len.max(1)).min(end_blk);
            // Split a non-data run at the dirty pages inside it.
            let (is_data, upto) = if data {
                (true, run_end)
            } else if is_dirty(l) {
                let mut e = l + 1;
                while e < run_end && is_dirty(e) {
                    e += 1;
                }
                (true, e)
            } else {
                (false, next_dirty(l).map_or(run_end, |d| d.min(run_end)))
            };
            if is_data == (whence == Whence::Data) {
                return Ok(Some((l * ps).max(offset).min(size)));
            }
            l = upto;
        }
        Ok(match whence {
            Whence::Data => None,
            Whence::Hole => Some(size),
        })
    }
}

/// The inode I/O lock a buffered write holds (kept for its `Drop`).
#[allow(dead_code)]
enum IoGuard<'a> {
    Shared(crate::lockdep::Ranked<std::sync::RwLockReadGuard<'a, ()>>),
    Exclusive(crate::lockdep::Ranked<std::sync::RwLockWriteGuard<'a, ()>>),
}

/// Whether `inode` is a regular file mapped by extents or a block map (what the page
/// cache writes).
pub(crate) fn cacheable(inode: &Inode) -> bool {
    inode.is_reg()
        && (inode.has_flag(flags::EXTENTS) || crate::fs::inode_write::uses_block_map(inode))
}

/// Direct overwrites in flight over a file's pages (`Fs::pc_direct_begin`): dropped
/// once their data write is done, which takes the ranges off, counts them and wakes
/// readers waiting to cache those pages.
pub(crate) struct DirectInFlight<'a> {
    fs: &'a Fs,
    fc: Option<super::FileRef>,
    ranges: Vec<(u64, u64)>,
}

impl Drop for DirectInFlight<'_> {
    fn drop(&mut self) {
        let Some(fc) = self.fc.take() else {
            return;
        };
        let mut st = fc.lock();
        for r in &self.ranges {
            if let Some(k) = st.direct_in_flight.iter().position(|x| x == r) {
                st.direct_in_flight.swap_remove(k);
            }
        }
        for &(a, b) in &self.ranges {
            st.direct_done += 1;
            let n = st.direct_done;
            if st.direct_done_ranges.len() == super::DIRECT_DONE_KEPT {
                st.direct_done_ranges.pop_front();
            }
            st.direct_done_ranges.push_back((n, a, b));
        }
        drop(st);
        fc.wb_done.notify_all();
        // A file the cache held nothing of: not kept for this write alone.
        let arc = fc.arc().clone();
        drop(fc);
        self.fs.pc().drop_if_empty(&arc);
    }
}
