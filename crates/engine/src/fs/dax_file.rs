//! File data in DAX mode (`FsOptions::dax`): reads and writes copy straight between the
//! caller's buffer and the mapped image, and [`crate::File::map`] maps the file's
//! blocks themselves (SEEDS lesson E).
//!
//! What it owns, per file with live mappings or dirty data ([`DaxFile`]):
//! - the **mapping lock** (the kernel's invalidate lock): shared by every access
//!   through a mapping's methods and by setting a mapping up; exclusive around every
//!   change of which blocks back the file — an allocating write, truncate (also by
//!   setattr), fallocate (punch, zero, collapse, insert, unwritten allocation) — and,
//!   before the lock is
//!   released, every live mapping of the file is rebuilt from the new extent tree
//!   ([`DaxChange`]). So no access through a mapping's methods sees a block after it
//!   was freed, or zeros of a hole after the write that filled it returned;
//! - the **dirty record**: device pages stored into through a mapping (cached
//!   stores, not yet written back). It belongs to the file, not to a mapping, so it
//!   survives the rebuild of a mapping and the mapping's end; fsync writes back
//!   exactly these pages (`clwb` per line), then commits and fences: work in
//!   proportion to the dirty bytes, not to the file size;
//! - the live mappings: each a reserved range of address space, with every file page
//!   mapped MAP_FIXED onto its block of the backing store (MAP_SHARED, so stores are
//!   the very bytes `read_at` reads), holes and unwritten extents onto read-only zero
//!   pages, and pages wholly past EOF inaccessible (PROT_NONE). Accesses through the
//!   methods first check that the backing file was not cut under the mapping (a page
//!   past the cut would fault).
//!
//! `write_at` itself stores non-temporally (durable at the next fence; no dirty
//! record needed); a pure overwrite of written blocks takes only the shared I/O lock,
//! so it needs no mapping lock (no mapping changes).
//!
//! Lock order: the inode's I/O lock → its mapping lock → tree lock → write lock → …
//! (docs/ARCHITECTURE.md). A `DaxFile`'s state mutex is taken under any of these, for
//! bookkeeping and the mmap calls of a rebuild only; the registry mutex is a leaf.
//!
//! Mappings need blocks that are whole memory pages (block size a multiple of 4 KiB)
//! and a backing store that maps at that granularity: tmpfs, a file on a disk
//! filesystem, devdax with 4 KiB alignment. hugetlbfs maps only whole huge pages, so
//! there `File::map` fails with the kernel's EINVAL (the read/write path works).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::fs::{Fs, Ino};
use crate::lockdep::{Held, Rank};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Per-file DAX state (see the module note).
#[derive(Default)]
pub(crate) struct DaxFile {
    map_lock: MapLock,
    state: Mutex<FileState>,
}

/// A readers-writer lock whose guards own a reference to their file (so a guard can
/// outlive the registry lookup that found it). Waiting writers keep new readers out.
#[derive(Default)]
struct MapLock {
    st: Mutex<MapLockState>,
    cv: Condvar,
}

#[derive(Default)]
struct MapLockState {
    readers: usize,
    writer: bool,
    writers_waiting: usize,
}

impl MapLock {
    fn read(&self) {
        let mut st = lock(&self.st);
        while st.writer || st.writers_waiting > 0 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.readers += 1;
    }
    fn read_done(&self) {
        let mut st = lock(&self.st);
        st.readers -= 1;
        if st.readers == 0 {
            self.cv.notify_all();
        }
    }
    fn write(&self) {
        let mut st = lock(&self.st);
        st.writers_waiting += 1;
        while st.writer || st.readers > 0 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.writers_waiting -= 1;
        st.writer = true;
    }
    fn write_done(&self) {
        lock(&self.st).writer = false;
        self.cv.notify_all();
    }
}

/// The mapping lock held shared (and the lock-order record of it, dropped after).
struct Shared<'a>(&'a MapLock, #[allow(dead_code)] Held);

impl Drop for Shared<'_> {
    fn drop(&mut self) {
        self.0.read_done();
    }
}

impl MapLock {
    /// Shared, for filesystem `fs_id` (`Fs::lock_id`).
    #[track_caller]
    fn shared(&self, fs_id: usize) -> Shared<'_> {
        let held = Held::acquire(fs_id, Rank::DaxMap);
        self.read();
        Shared(self, held)
    }
}

#[derive(Default)]
struct FileState {
    /// Device pages (byte offset / page size) stored into through a mapping and not
    /// yet written back.
    dirty: BTreeSet<u64>,
    /// Live mappings by id.
    maps: HashMap<u64, Slot>,
    next_id: u64,
}

/// Where a live mapping lives.
#[derive(Clone, Copy)]
struct Slot {
    base: usize,
    /// File offset of the first byte (page-aligned).
    offset: u64,
    /// Reserved bytes (whole pages).
    span: usize,
    writable: bool,
}

/// The registry of per-file state, in `Inner`.
#[derive(Default)]
pub(crate) struct DaxFiles {
    files: Mutex<HashMap<Ino, Arc<DaxFile>>>,
}

impl DaxFiles {
    fn get(&self, ino: Ino) -> Arc<DaxFile> {
        lock(&self.files).entry(ino).or_default().clone()
    }

    fn existing(&self, ino: Ino) -> Option<Arc<DaxFile>> {
        lock(&self.files).get(&ino).cloned()
    }

    /// Forget `ino`'s state when nothing uses it (no mapping, nothing dirty, no
    /// other reference).
    fn retire(&self, ino: Ino) {
        let mut files = lock(&self.files);
        if let Some(f) = files.get(&ino) {
            let idle = Arc::strong_count(f) == 1 && {
                let st = lock(&f.state);
                st.maps.is_empty() && st.dirty.is_empty()
            };
            if idle {
                files.remove(&ino);
            }
        }
    }
}

/// The memory page.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).unwrap_or(4096).max(1)
}

/// The mapping lock of a file held exclusively around a change of its block mapping;
/// dropping it rebuilds the file's live mappings first (after the caller's write lock
/// is gone: declare it before that guard).
pub(crate) struct DaxChange<'a> {
    fs: &'a Fs,
    ino: Ino,
    file: Option<Arc<DaxFile>>,
    /// The lock-order record (dropped after `drop` released the lock).
    _held: Held,
}

impl Drop for DaxChange<'_> {
    fn drop(&mut self) {
        let Some(file) = self.file.take() else { return };
        if let Err(e) = self.fs.dax_rebuild(self.ino, &file) {
            log::warn!(
                "inode {}: rebuilding DAX mappings failed ({e}); they now fault",
                self.ino.0
            );
        }
        file.map_lock.write_done();
        // This reference must go before the registry can see the file idle.
        drop(file);
        self.fs.inner.dax_files.retire(self.ino);
    }
}

/// What one page of a mapping shows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Show {
    /// The block at this device byte offset.
    Block(u64),
    Zeros,
    /// Wholly past EOF.
    Nothing,
}

impl Fs {
    /// Whether file data bypasses the page cache (`FsOptions::dax` on a DAX device).
    pub fn is_dax(&self) -> bool {
        self.inner.dax
    }

    fn dax_dev(&self) -> Result<&crate::device::dax::DaxDevice> {
        // The device lives as long as the cache, which lives as long as `self`.
        self.cache()
            .device()
            .dax()
            .ok_or_else(|| Error::Unsupported("not a DAX device".into()))
    }

    /// The mapping lock of `ino` exclusively, for a change of its block mapping (None
    /// when not in DAX mode). Caller holds the I/O lock exclusively and takes the
    /// write lock after this.
    pub(crate) fn dax_change(&self, ino: Ino) -> Option<DaxChange<'_>> {
        if !self.inner.dax {
            return None;
        }
        let held = Held::acquire(self.lock_id(), Rank::DaxMap);
        let file = self.inner.dax_files.get(ino);
        file.map_lock.write();
        Some(DaxChange {
            fs: self,
            ino,
            file: Some(file),
            _held: held,
        })
    }

    /// DAX write (`offset` None: append): an overwrite of written blocks in place under
    /// the shared I/O lock, anything else through the allocating path under the
    /// exclusive I/O lock and the mapping lock.
    pub(crate) fn dax_write(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: Option<u64>,
        update_times: bool,
    ) -> Result<usize> {
        if let Some(off) = offset {
            if let Some(n) = self.try_overwrite(ino, buf, off)? {
                if update_times {
                    self.touch_times(ino)?;
                }
                return Ok(n);
            }
        }
        self.write_through(ino, buf, offset, update_times)
    }

    /// Write back the pages stored into through mappings (all files when `ino` is
    /// None); durable at the caller's next device flush.
    pub(crate) fn dax_write_back_dirty(&self, ino: Option<Ino>) -> Result<()> {
        if !self.inner.dax {
            return Ok(());
        }
        let files: Vec<(Ino, Arc<DaxFile>)> = match ino {
            Some(i) => self
                .inner
                .dax_files
                .existing(i)
                .map(|f| (i, f))
                .into_iter()
                .collect(),
            None => lock(&self.inner.dax_files.files)
                .iter()
                .map(|(i, f)| (*i, f.clone()))
                .collect(),
        };
        let dev = self.dax_dev()?;
        let ps = page_size();
        for (i, f) in files {
            let pages: Vec<u64> = lock(&f.state).dirty.iter().copied().collect();
            // Contiguous runs: one write-back call each.
            let mut k = 0;
            while k < pages.len() {
                let mut e = k + 1;
                while e < pages.len() && pages[e] == pages[e - 1] + 1 {
                    e += 1;
                }
                dev.persist_lines(pages[k] * ps, (e - k) as u64 * ps)?;
                k = e;
            }
            {
                let mut st = lock(&f.state);
                for p in &pages {
                    st.dirty.remove(p);
                }
            }
            drop(f);
            self.inner.dax_files.retire(i);
        }
        Ok(())
    }

    /// Bytes recorded dirty through mappings of `ino` (what its fsync will write
    /// back).
    pub fn dax_dirty_bytes(&self, ino: Ino) -> u64 {
        self.inner
            .dax_files
            .existing(ino)
            .map_or(0, |f| lock(&f.state).dirty.len() as u64 * page_size())
    }

    /// What the pages of `[offset, offset+span)` of `ino` show now, as runs of
    /// (what the first page shows, pages; a `Block` run's pages are consecutive
    /// blocks): one run per extent, hole or EOF tail, so the work follows the extents,
    /// not the length. Caller holds the mapping lock (either way).
    fn dax_runs(&self, ino: Ino, offset: u64, span: u64) -> Result<Vec<(Show, u64)>> {
        let _t = self.tree_shared(ino);
        let inode = self.read_inode(ino)?;
        let size = if inode.mode == 0 { 0 } else { inode.size };
        let bs = u64::from(self.inner.block_size);
        let ps = page_size();
        let npages = span / ps;
        let eof_page = size.div_ceil(ps);
        let mut out: Vec<(Show, u64)> = Vec::new();
        let mut p = 0;
        while p < npages {
            let pos = offset + p * ps;
            let page = pos / ps;
            if page >= eof_page {
                out.push((Show::Nothing, npages - p));
                break;
            }
            let lblk = pos / bs;
            let (run, phys) = self.map_block(ino, &inode, lblk)?.data_run();
            let run_pages = (run.saturating_mul(bs) - pos % bs) / ps;
            let n = run_pages.max(1).min(npages - p).min(eof_page - page);
            let show = match phys {
                Some(ph) => Show::Block(ph * bs + pos % bs),
                None => Show::Zeros,
            };
            match out.last_mut() {
                Some((Show::Zeros, k)) if show == Show::Zeros => *k += n,
                Some((Show::Block(a), k)) if show == Show::Block(*a + *k * ps) => *k += n,
                _ => out.push((show, n)),
            }
            p += n;
        }
        Ok(out)
    }

    /// What each page of `[offset, offset+span)` shows (for ranges as small as one
    /// access).
    fn dax_pages(&self, ino: Ino, offset: u64, span: usize) -> Result<Vec<Show>> {
        let ps = page_size();
        let mut out = Vec::with_capacity(span / ps as usize);
        for (show, n) in self.dax_runs(ino, offset, span as u64)? {
            for k in 0..n {
                out.push(match show {
                    Show::Block(a) => Show::Block(a + k * ps),
                    other => other,
                });
            }
        }
        Ok(out)
    }

    /// Map the pages of one live mapping as `runs` says (under the mapping lock).
    fn dax_establish(&self, slot: &Slot, runs: &[(Show, u64)]) -> Result<()> {
        let fd = self.dax_dev()?.backing_fd();
        let ps = page_size() as usize;
        let mut page = 0usize;
        for &(show, n) in runs {
            let n = n as usize;
            if (page + n) * ps > slot.span {
                return Err(Error::InvalidInput("mapping runs past its range".into()));
            }
            let addr = (slot.base + page * ps) as *mut libc::c_void;
            let len = n * ps;
            // SAFETY: addr..addr+len lies inside the range this mapping reserved
            // (checked against span just above); MAP_FIXED replaces only those pages,
            // which belong to this mapping alone.
            let r = unsafe {
                match show {
                    Show::Block(dev_off) => libc::mmap(
                        addr,
                        len,
                        if slot.writable {
                            libc::PROT_READ | libc::PROT_WRITE
                        } else {
                            libc::PROT_READ
                        },
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        fd,
                        dev_off as libc::off_t,
                    ),
                    Show::Zeros => libc::mmap(
                        addr,
                        len,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    ),
                    Show::Nothing => libc::mmap(
                        addr,
                        len,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    ),
                }
            };
            if r == libc::MAP_FAILED {
                return Err(Error::Io(std::io::Error::last_os_error()));
            }
            page += n;
        }
        Ok(())
    }

    /// Rebuild every live mapping of `ino` from its extent tree (mapping lock held
    /// exclusively). A mapping that cannot be rebuilt is made inaccessible.
    fn dax_rebuild(&self, ino: Ino, file: &DaxFile) -> Result<()> {
        let slots: Vec<Slot> = lock(&file.state).maps.values().copied().collect();
        let mut first_err = None;
        for s in slots {
            let r = self
                .dax_runs(ino, s.offset, s.span as u64)
                .and_then(|runs| self.dax_establish(&s, &runs));
            if let Err(e) = r {
                let none = [(Show::Nothing, s.span as u64 / page_size())];
                let _ = self.dax_establish(&s, &none);
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Set up a mapping of `[offset, offset+len)` of `ino` (see [`DaxMap`]).
    pub(crate) fn dax_map(
        &self,
        ino: Ino,
        offset: u64,
        len: u64,
        writable: bool,
    ) -> Result<DaxMap> {
        let ps = page_size();
        let bs = u64::from(self.inner.block_size);
        if !bs.is_multiple_of(ps) {
            return Err(Error::Unsupported(format!(
                "DAX mappings need blocks of whole memory pages ({bs}-byte blocks, \
                 {ps}-byte pages)"
            )));
        }
        if !offset.is_multiple_of(ps) {
            return Err(Error::InvalidInput(
                "mapping offset must be a multiple of the page size".into(),
            ));
        }
        let span = len
            .checked_next_multiple_of(ps)
            .and_then(|s| usize::try_from(s).ok())
            .filter(|_| {
                offset
                    .checked_add(len)
                    .is_some_and(|end| end <= self.max_file_size().next_multiple_of(ps))
            })
            .ok_or_else(|| {
                Error::InvalidInput("mapping reaches past ext4's largest file size".into())
            })?;
        // SAFETY: a fresh reservation, no fixed address; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Io(std::io::Error::last_os_error()));
        }
        let slot = Slot {
            base: base as usize,
            offset,
            span,
            writable,
        };
        let file = self.inner.dax_files.get(ino);
        let built = {
            let _m = file.map_lock.shared(self.lock_id());
            let r = self
                .dax_runs(ino, offset, span as u64)
                .and_then(|runs| self.dax_establish(&slot, &runs));
            r.map(|()| {
                let mut st = lock(&file.state);
                st.next_id += 1;
                let id = st.next_id;
                st.maps.insert(id, slot);
                id
            })
        };
        let id = match built {
            Ok(id) => id,
            Err(e) => {
                // SAFETY: the reservation made above, used by nobody else.
                unsafe { libc::munmap(base, span) };
                drop(file);
                self.inner.dax_files.retire(ino);
                return Err(e);
            }
        };
        self.pin(ino);
        Ok(DaxMap {
            fs: self.clone(),
            ino,
            file,
            id,
            slot,
        })
    }
}

/// A mapping of a file's blocks in the backing store (DAX mode; see the module note).
pub(crate) struct DaxMap {
    fs: Fs,
    ino: Ino,
    file: Arc<DaxFile>,
    id: u64,
    slot: Slot,
}

// SAFETY: the raw base address is only used under the file's mapping lock or by
// callers of the unsafe accessor; the struct owns nothing thread-bound.
unsafe impl Send for DaxMap {}
// SAFETY: as above.
unsafe impl Sync for DaxMap {}

impl DaxMap {
    pub(crate) fn base(&self) -> *mut u8 {
        self.slot.base as *mut u8
    }

    #[track_caller]
    fn shared(&self) -> Shared<'_> {
        self.file.map_lock.shared(self.fs.lock_id())
    }

    /// The file size now, and the check that `[pos, pos+n)` is not wholly past the
    /// page of EOF (the SIGBUS case).
    fn size_for(&self, pos: u64, n: usize) -> Result<u64> {
        let inode = self.fs.read_live_inode(self.ino)?;
        let ps = page_size();
        if pos + n as u64 > inode.size.div_ceil(ps) * ps {
            return Err(Error::InvalidInput(
                "access past the last page of the file (SIGBUS)".into(),
            ));
        }
        Ok(inode.size)
    }

    /// Copy out of the mapping at mapping offset `at` (`at + buf.len()` checked by the
    /// caller against the mapping's length). Bytes past EOF read as zeros.
    pub(crate) fn read(&self, at: u64, buf: &mut [u8]) -> Result<()> {
        let _m = self.shared();
        let pos = self.slot.offset + at;
        let size = self.size_for(pos, buf.len())?;
        self.fs.dax_dev()?.check_intact()?;
        // SAFETY: at..at+len is inside this mapping's reservation (checked by the
        // caller against len <= span); under the shared mapping lock every page of it
        // is mapped readable (file pages up to the EOF page, checked above).
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.base().add(at as usize),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        if pos + buf.len() as u64 > size {
            let keep = size.saturating_sub(pos) as usize;
            buf[keep..].fill(0);
        }
        Ok(())
    }

    /// Store `data` at mapping offset `at`: in place (cached stores, recorded dirty)
    /// where the pages are written blocks; through the allocating write path (which
    /// rebuilds the mapping) where a page is a hole or unwritten.
    pub(crate) fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        let pos = self.slot.offset + at;
        let n;
        {
            let _m = self.shared();
            let size = self.size_for(pos, data.len())?;
            // Bytes past EOF are dropped, as the kernel drops them at writeback.
            n = (size.saturating_sub(pos) as usize).min(data.len());
            let ps = page_size();
            let first = at / ps;
            let last = (at + n.max(1) as u64 - 1) / ps;
            let shows = self.fs.dax_pages(
                self.ino,
                self.slot.offset + first * ps,
                ((last - first + 1) * ps) as usize,
            )?;
            if shows.iter().all(|s| matches!(s, Show::Block(_))) {
                self.fs.dax_dev()?.check_intact()?;
                if n > 0 {
                    // SAFETY: at..at+n is inside the reservation, and every page of
                    // it maps a written block read-write (shows, under the mapping
                    // lock; the mapping was made writable: checked by the caller).
                    unsafe {
                        core::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            self.base().add(at as usize),
                            n,
                        )
                    };
                    self.record_dirty(&shows, first, at, n)?;
                }
                drop(_m);
                self.fs.touch_times(self.ino)?;
                return Ok(());
            }
        }
        // A fault on a hole allocates: the write path allocates, stores the data and
        // rebuilds this mapping under the exclusive mapping lock.
        self.fs
            .write_through(self.ino, &data[..n], Some(pos), true)?;
        Ok(())
    }

    /// Record `[at, at+n)` (mapping offsets) dirty; `shows` are the pages from `first`.
    fn record_dirty(&self, shows: &[Show], first: u64, at: u64, n: usize) -> Result<()> {
        let ps = page_size();
        let dev = self.fs.dax_dev()?;
        let mut st = lock(&self.file.state);
        for (k, s) in shows.iter().enumerate() {
            if let Show::Block(off) = s {
                st.dirty.insert(off / ps);
                // The observer sees the bytes of this page the store touched.
                let pstart = (first + k as u64) * ps;
                let a = at.max(pstart);
                let b = (at + n as u64).min(pstart + ps);
                if b > a {
                    dev.note_cached_store(off + (a - pstart), (b - a) as usize);
                }
            }
        }
        Ok(())
    }

    /// Record that `[at, at+len)` was stored into through the raw pointer.
    pub(crate) fn mark_dirty(&self, at: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _m = self.shared();
        let ps = page_size();
        let first = at / ps;
        let last = (at + len - 1) / ps;
        let shows = self.fs.dax_pages(
            self.ino,
            self.slot.offset + first * ps,
            ((last - first + 1) * ps) as usize,
        )?;
        self.record_dirty(&shows, first, at, len as usize)
    }
}

impl Drop for DaxMap {
    fn drop(&mut self) {
        {
            self.file.map_lock.write();
            lock(&self.file.state).maps.remove(&self.id);
            // SAFETY: the reservation this mapping made; removed from the file's live
            // mappings first, so no rebuild maps into it again.
            unsafe { libc::munmap(self.slot.base as *mut libc::c_void, self.slot.span) };
            self.file.map_lock.write_done();
        }
        let ino = self.ino;
        let fs = self.fs.clone();
        self.file = Arc::new(DaxFile::default());
        fs.inner.dax_files.retire(ino);
        let _ = fs.unpin(ino);
    }
}
