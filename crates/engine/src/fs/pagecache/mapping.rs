//! Mappings of file ranges onto the page cache: the embedding API's `mmap`.
//!
//! A [`MappedRange`] reads and writes the very pages `read_at`/`write_at` use, so it is
//! coherent with them at every moment (there is no second copy to invalidate). Writes
//! mark pages dirty like any write, so writeback, `sync` and fsync carry them to the
//! device; [`MappedRange::sync`] is msync(MS_SYNC). As with mmap(2): a mapping never
//! changes the file's size, access to a memory page ([`MMAP_PAGE`] bytes, or a block
//! if larger) wholly past the end of the file fails (the SIGBUS case), and inside the
//! last one the bytes past the end read as zeros and writes to them are dropped (the
//! kernel zeroes them at writeback).
//!
//! Locks: each access takes the inode's I/O lock shared, like a read, so it is
//! ordered with truncate (exclusive) — a truncate that cuts the mapping makes later
//! accesses past the new end fail, and the EOF page's tail reads zeros at once.
//!
//! In DAX mode (`FsOptions::dax`) a mapping is instead a real mapping of the file's
//! blocks in the backing store (`dax_file`): the same methods, plus
//! [`MappedRange::as_ptr`] for loads and stores in place and
//! [`MappedRange::mark_dirty`] to record such stores for fsync.

use crate::error::{Error, Result};
use crate::fs::{Fs, Ino};

/// A mapped range of a file (see the module note). Holds a reference on the inode
/// (it stays valid if unlinked) until dropped.
pub struct MappedRange {
    fs: Fs,
    ino: Ino,
    offset: u64,
    len: u64,
    writable: bool,
    /// DAX mode: the mapping of the file's blocks.
    dax: Option<crate::fs::dax_file::DaxMap>,
}

/// The memory page size mappings behave as if they had (the x86-64 page).
pub const MMAP_PAGE: u64 = 4096;

fn sigbus() -> Error {
    Error::InvalidInput("access past the last page of the file (SIGBUS)".into())
}

impl crate::File {
    /// Map `len` bytes from `offset` (offset a multiple of the block size, as mmap
    /// wants it page-aligned). Writable when the file was opened for writing.
    pub fn map(&self, offset: u64, len: u64) -> Result<MappedRange> {
        let bs = u64::from(self.fs.block_size());
        if len == 0 || !offset.is_multiple_of(bs) || offset.checked_add(len).is_none() {
            return Err(Error::InvalidInput(
                "mapping needs a length and a block-aligned offset".into(),
            ));
        }
        let mut inode = self.fs.read_live_inode(self.ino)?;
        if !inode.is_reg() {
            return Err(Error::InvalidInput(
                "only regular files can be mapped".into(),
            ));
        }
        if inode.has_flag(rext4_format::inode::flags::INLINE_DATA) && self.write {
            // Mapped pages are block I/O: an inline file becomes a block first.
            self.fs.uninline_file(self.ino)?;
            inode = self.fs.read_live_inode(self.ino)?;
        }
        if inode.has_flag(rext4_format::inode::flags::INLINE_DATA) {
            return Err(Error::Unsupported(
                "a read-only mapping of a file held inline".into(),
            ));
        }
        let dax = if self.fs.is_dax() {
            Some(self.fs.dax_map(self.ino, offset, len, self.write)?)
        } else {
            None
        };
        self.fs.pin(self.ino);
        Ok(MappedRange {
            fs: self.fs.clone(),
            ino: self.ino,
            offset,
            len,
            writable: self.write,
            dax,
        })
    }
}

impl MappedRange {
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// File position of mapping offset `at` for `n` bytes, checked against the
    /// mapping's bounds.
    fn span(&self, at: u64, n: usize) -> Result<u64> {
        match at.checked_add(n as u64) {
            Some(end) if end <= self.len => Ok(self.offset + at),
            _ => Err(Error::InvalidInput(format!(
                "{n} bytes at {at} are outside the {}-byte mapping",
                self.len
            ))),
        }
    }

    /// Copy `buf.len()` bytes at mapping offset `at` out of the page cache.
    pub fn read(&self, at: u64, buf: &mut [u8]) -> Result<()> {
        let pos = self.span(at, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(d) = &self.dax {
            return d.read(at, buf);
        }
        let fs = &self.fs;
        let _io = fs.io_shared(self.ino);
        let inode = fs.read_inode(self.ino)?;
        let size = fs.vfs_size(self.ino, &inode);
        let page = MMAP_PAGE.max(u64::from(fs.block_size()));
        let end = pos + buf.len() as u64;
        if end > size.div_ceil(page) * page {
            return Err(sigbus());
        }
        let n = fs.pc_read_pages(self.ino, buf, pos, size)?;
        debug_assert_eq!(n, buf.len());
        Ok(())
    }

    /// Copy `data` into the page cache at mapping offset `at` (dirtying the pages).
    pub fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(Error::InvalidInput(
                "mapping of a file not open for writing".into(),
            ));
        }
        let pos = self.span(at, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let fs = &self.fs;
        fs.check_writable()?;
        if let Some(d) = &self.dax {
            return d.write(at, data);
        }
        {
            let _io = fs.io_shared(self.ino);
            let inode = fs.read_inode(self.ino)?;
            let size = fs.vfs_size(self.ino, &inode);
            let bs = u64::from(fs.block_size());
            let page = MMAP_PAGE.max(bs);
            let end = pos + data.len() as u64;
            if end > size.div_ceil(page) * page {
                return Err(sigbus());
            }
            // A page fault on a hole must get its block (or its promise) now.
            let promise = fs.promise_pages_or_flush(self.ino, pos / bs, (end - 1) / bs)?;
            match fs.no_delalloc_on_bigalloc(self.ino, promise) {
                Some(promise) => fs.pc_write(self.ino, data, pos, size, size, promise)?,
                None => {
                    // bigalloc: the block now (through the device, as a write).
                    drop(_io);
                    fs.write_through(self.ino, data, Some(pos), false)?;
                }
            }
        }
        fs.touch_times(self.ino)?;
        fs.balance_dirty();
        fs.inner.pagecache.reclaim_if_needed();
        Ok(())
    }

    /// msync(MS_SYNC) of `len` bytes at mapping offset `at` (`len` 0: the whole
    /// mapping): write the dirty pages of the range back and commit the journal.
    pub fn sync(&self, at: u64, len: u64) -> Result<()> {
        let len = if len == 0 {
            self.len.saturating_sub(at)
        } else {
            len
        };
        let pos = self.span(at, len as usize)?;
        if self.dax.is_some() {
            // The file's dirty record is per file: its fsync covers this range.
            return self.fs.fsync_ino(self.ino);
        }
        self.fs.sync_range_ino(self.ino, pos, len.max(1))?;
        self.fs.sync_metadata()
    }

    /// DAX mode: the address of mapping offset 0 (`None` over the page cache). Pages
    /// of the file map its blocks in the backing store, holes and unwritten extents
    /// read-only zero pages, pages wholly past EOF nothing.
    ///
    /// Loads and stores through it bypass the mapping lock: a store into a hole page
    /// or a load past EOF faults (SIGSEGV), and a truncate, punch or allocating write
    /// may replace the pages under a caller that did not order itself with them.
    /// Stores must be reported with [`MappedRange::mark_dirty`], or fsync will not
    /// write them back. [`MappedRange::read`] and [`MappedRange::write`] do all this.
    pub fn as_ptr(&self) -> Option<*mut u8> {
        self.dax.as_ref().map(|d| d.base())
    }

    /// DAX mode: record stores made through [`MappedRange::as_ptr`] into
    /// `[at, at+len)`, so the next fsync writes them back (no-op over the page cache,
    /// whose writes go through `write`).
    pub fn mark_dirty(&self, at: u64, len: u64) -> Result<()> {
        self.span(at, len as usize)?;
        match &self.dax {
            Some(d) => d.mark_dirty(at, len),
            None => Ok(()),
        }
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        let _ = self.fs.unpin(self.ino);
    }
}

impl std::fmt::Debug for MappedRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MappedRange(ino {}, {}+{}{})",
            self.ino.0,
            self.offset,
            self.len,
            if self.writable { ", writable" } else { "" }
        )
    }
}
