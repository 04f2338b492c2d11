//! File data between the device and whoever reads or writes it in place (the page
//! cache's reads and writeback, direct I/O, zeroing): the one seam where *journaled
//! file data* is laid over the device's bytes.
//!
//! An fsync whose pass writes a few freshly allocated blocks (at most
//! [`JOURNAL_DATA_BLOCKS`]) journals their data with the metadata that maps them
//! instead of writing it home first (ext4's data=journal, for those blocks only): the
//! commit's two flushes then carry one sequential log write, and the home write — into
//! a block the image file may not have allocated yet, which costs the host a metadata
//! commit of its own at every flush — waits for the checkpoint, where it is one of
//! many. Until the log is emptied the block's data is held in the buffer cache
//! (`BufferCache::put_data`): dirty, then logged, then written home by the checkpoint,
//! and freed like metadata (a revoke record keeps recovery from writing the old copy
//! over whatever reuses the block).
//!
//! Must hold, while a block's data is journaled and the log still holds a copy:
//! - every data read of the block sees the held copy, never the older home
//!   ([`Fs::read_data`]: the held copies are taken before the device is read, so one
//!   dropped meanwhile was home before it went);
//! - every data write of the block changes the held copy, never the home
//!   ([`Fs::write_data`]): written home, it would be overwritten by the checkpoint and,
//!   after a crash, by recovery's replay of the older copy — the next fsync commits
//!   the changed copy instead, after the older one in the log.
//!
//! DAX filesystems never journal data (stores through a mapping bypass this seam).

use std::mem::MaybeUninit;

use crate::error::Result;
use crate::fs::Fs;

/// The most blocks one fsync's writeback pass journals (larger passes write home: the
/// flushes are shared by more data, and the log would carry it twice).
pub(crate) const JOURNAL_DATA_BLOCKS: usize = 16;

impl Fs {
    /// Whether an fsync's pass of `blocks` freshly allocated blocks journals them.
    pub(crate) fn journals_data(&self, blocks: usize) -> bool {
        blocks <= JOURNAL_DATA_BLOCKS && self.journaling() && !self.inner.dax
    }

    /// Read `buf.len()` bytes of file data at device byte `at`, journaled blocks as
    /// they are held (see the module note).
    pub(crate) fn read_data(&self, buf: &mut [MaybeUninit<u8>], at: u64) -> Result<()> {
        let bs = u64::from(self.inner.block_size);
        let len = buf.len() as u64;
        let first = at / bs;
        let held = self
            .cache()
            .data_blocks(first, (at + len).div_ceil(bs) - first);
        self.cache().device().read_at_uninit(buf, at)?;
        for (blk, contents) in held {
            let from = (blk * bs).max(at);
            let to = ((blk + 1) * bs).min(at + len);
            copy_into(
                &mut buf[(from - at) as usize..(to - at) as usize],
                &contents[(from - blk * bs) as usize..(to - blk * bs) as usize],
            );
        }
        Ok(())
    }

    /// [`Fs::read_data`] into an initialized buffer.
    pub(crate) fn read_data_init(&self, buf: &mut [u8], at: u64) -> Result<()> {
        // SAFETY: `read_data` writes only initialized bytes.
        self.read_data(unsafe { crate::device::as_uninit(buf) }, at)
    }

    /// Journal `buf`, whole blocks from the block boundary at device byte `at`, as
    /// their new data (an fsync's small pass; see the module note).
    pub(crate) fn journal_data(&self, buf: &[u8], at: u64) -> Result<()> {
        let bs = u64::from(self.inner.block_size);
        if !at.is_multiple_of(bs) || !(buf.len() as u64).is_multiple_of(bs) {
            return Err(crate::error::Error::InvalidInput(format!(
                "journaled data of {} bytes at {at}: not whole blocks",
                buf.len()
            )));
        }
        for (k, block) in buf.chunks(bs as usize).enumerate() {
            self.cache().put_data(at / bs + k as u64, block)?;
        }
        Ok(())
    }

    /// Write file data home at device byte `at`, but for blocks whose data is
    /// journaled, which change where they are held.
    pub(crate) fn write_data(&self, buf: &[u8], at: u64) -> Result<()> {
        let cache = self.cache();
        let dev = cache.device();
        if cache.data_count() == 0 {
            return Ok(dev.write_at(buf, at)?);
        }
        let bs = u64::from(self.inner.block_size);
        let end = at + buf.len() as u64;
        let mut pos = at;
        // Start of the bytes not yet written that go home.
        let mut home_from = at;
        while pos < end {
            let blk = pos / bs;
            let in_blk = pos % bs;
            let n = (bs - in_blk).min(end - pos);
            let src = &buf[(pos - at) as usize..(pos - at + n) as usize];
            if cache.update_data(blk, in_blk as usize, src)? {
                if home_from < pos {
                    dev.write_at(
                        &buf[(home_from - at) as usize..(pos - at) as usize],
                        home_from,
                    )?;
                }
                home_from = pos + n;
            }
            pos += n;
        }
        if home_from < end {
            dev.write_at(&buf[(home_from - at) as usize..], home_from)?;
        }
        Ok(())
    }
}

/// `dst.copy_from_slice(src)` for a destination that need not be initialized.
pub(crate) fn copy_into(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    // SAFETY: lengths are equal, `src` and `dst` cannot overlap (one is borrowed
    // shared, the other exclusively), and `MaybeUninit<u8>` has the layout of `u8`.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast(), src.len()) }
}
