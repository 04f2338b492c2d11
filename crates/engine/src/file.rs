//! Files and metadata in the std::fs style: [`Metadata`] (like `std::fs::Metadata` plus
//! ext4's extra fields) and [`File`] with positional reads.
//!
//! Reads of regular files go through the page cache (`pagecache`); reads of other
//! inodes (slow symlinks) and direct-I/O reads map each run through [`Fs::map_block`]
//! and read the device: holes and unwritten extents read as zeros. Sizes are checked
//! against ext4's maximum file size so a corrupt i_size cannot make a reader loop for
//! ever.

use std::mem::MaybeUninit;

use rext4_format::inode::{mode, Inode, Timestamp};
use rext4_format::superblock::feature;

use crate::error::{Error, Result};
use crate::fs::map::{Mapping, MAX_LOGICAL};
use crate::fs::{Fs, Ino};

/// The type of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    File,
    Dir,
    Symlink,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
    Unknown,
}

impl FileType {
    pub fn from_mode(m: u16) -> FileType {
        match m & mode::S_IFMT {
            mode::S_IFREG => FileType::File,
            mode::S_IFDIR => FileType::Dir,
            mode::S_IFLNK => FileType::Symlink,
            mode::S_IFCHR => FileType::CharDevice,
            mode::S_IFBLK => FileType::BlockDevice,
            mode::S_IFIFO => FileType::Fifo,
            mode::S_IFSOCK => FileType::Socket,
            _ => FileType::Unknown,
        }
    }
    /// The directory entry file_type byte (0 for `Unknown`).
    pub fn dirent_code(self) -> u8 {
        match self {
            FileType::File => 1,
            FileType::Dir => 2,
            FileType::CharDevice => 3,
            FileType::BlockDevice => 4,
            FileType::Fifo => 5,
            FileType::Socket => 6,
            FileType::Symlink => 7,
            FileType::Unknown => 0,
        }
    }
    /// From a directory entry's file_type byte.
    pub fn from_dirent(t: u8) -> FileType {
        match t {
            1 => FileType::File,
            2 => FileType::Dir,
            3 => FileType::CharDevice,
            4 => FileType::BlockDevice,
            5 => FileType::Fifo,
            6 => FileType::Socket,
            7 => FileType::Symlink,
            _ => FileType::Unknown,
        }
    }
}

/// What `stat` says about an inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    pub ino: Ino,
    pub file_type: FileType,
    /// Full st_mode (type and permission bits).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub crtime: Option<Timestamp>,
    /// Allocated space in 512-byte units, like st_blocks.
    pub blocks: u64,
    pub block_size: u32,
    /// (major, minor) for device files.
    pub rdev: Option<(u32, u32)>,
    pub generation: u32,
    /// ext4 inode flags (i_flags).
    pub flags: u32,
}

impl Metadata {
    pub fn is_dir(&self) -> bool {
        self.file_type == FileType::Dir
    }
    pub fn is_file(&self) -> bool {
        self.file_type == FileType::File
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type == FileType::Symlink
    }
    pub fn len(&self) -> u64 {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    /// Permission bits (mode & 0o7777).
    pub fn permissions(&self) -> u32 {
        self.mode & 0o7777
    }
}

impl Fs {
    /// Metadata of inode `ino` (no path resolution).
    pub fn stat_ino(&self, ino: Ino) -> Result<Metadata> {
        let inode = self.read_inode_vfs(ino)?;
        Ok(self.metadata_of(ino, &inode))
    }

    /// Inode `ino` as a frontend presents it: the record, whatever its link count (an
    /// orphan still referenced is served like any other inode), with the size the file
    /// has in memory when buffered writes ran past the record's.
    pub fn inode_attr(&self, ino: Ino) -> Result<Inode> {
        let o = self.inner.pagecache.size_override(ino);
        let mut i = self.read_inode(ino)?;
        if let Some(s) = o {
            i.size = i.size.max(s);
        }
        Ok(i)
    }

    /// Read an inode that a directory entry or handle refers to: it must be in use.
    pub fn read_live_inode(&self, ino: Ino) -> Result<Inode> {
        let inode = self.read_inode(ino)?;
        // links 0 with a dtime is a deleted inode — unless it is referenced: then it is
        // an orphan, and on the legacy list i_dtime holds the next orphan's number.
        if inode.mode == 0 || (inode.links_count == 0 && inode.dtime != 0 && !self.is_pinned(ino)) {
            return Err(Error::corrupted(
                format!("entry refers to deleted inode {}", ino.0),
                None,
            ));
        }
        self.check_size(ino, &inode)?;
        Ok(inode)
    }

    fn check_size(&self, ino: Ino, inode: &Inode) -> Result<()> {
        let max = MAX_LOGICAL * u64::from(self.inner.block_size);
        if inode.size > max {
            return Err(Error::corrupted(
                format!(
                    "inode {} size {} exceeds the ext4 maximum {max}",
                    ino.0, inode.size
                ),
                None,
            ));
        }
        Ok(())
    }

    pub(crate) fn metadata_of(&self, ino: Ino, inode: &Inode) -> Metadata {
        let ft = FileType::from_mode(inode.mode);
        let sb = &self.inner.sb;
        let huge = sb.has_ro_compat(feature::RO_COMPAT_HUGE_FILE);
        Metadata {
            ino,
            file_type: ft,
            mode: u32::from(inode.mode),
            uid: inode.uid,
            gid: inode.gid,
            size: inode.size,
            nlink: u32::from(inode.links_count),
            atime: inode.atime,
            mtime: inode.mtime,
            ctime: inode.ctime,
            crtime: inode.crtime,
            blocks: inode.blocks_512(huge, self.inner.block_size) + self.delalloc_blocks_512(ino),
            block_size: self.inner.block_size,
            rdev: matches!(ft, FileType::CharDevice | FileType::BlockDevice)
                .then(|| inode.device()),
            generation: inode.generation,
            flags: inode.flags,
        }
    }

    /// Read up to `buf.len()` bytes of inode `ino` at byte `offset`; returns the count
    /// (0 at or past EOF). `_inode` is the caller's copy; size and mapping are taken
    /// from the inode as it is under the I/O lock. Regular files are read through the
    /// page cache.
    pub fn read_ino_at(
        &self,
        ino: Ino,
        _inode: &Inode,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<usize> {
        // The mapping stays fixed while we read (no block freed and reused under us);
        // the caller's copy of the inode may predate a truncate, so size and mapping
        // come from the inode as it is under the lock.
        let _io = self.io_shared(ino);
        let inode = self.read_inode(ino)?;
        if inode.mode == 0 {
            return Err(Error::NotFound);
        }
        if inode.has_flag(rext4_format::inode::flags::INLINE_DATA) {
            // Inline bytes are read from the record, never cached (inline.rs).
            // SAFETY: `read_inline` writes only initialized bytes.
            return self.read_inline(
                ino,
                &inode,
                unsafe { crate::device::as_uninit(buf) },
                offset,
            );
        }
        if inode.is_reg() && self.inner.dax {
            let _t = self.tree_shared(ino);
            return self.read_device(ino, &inode, buf, offset);
        }
        if inode.is_reg() {
            return self.pc_read(ino, &inode, buf, offset, true);
        }
        let _t = self.tree_shared(ino);
        self.read_device(ino, &inode, buf, offset)
    }

    /// Read bypassing the page cache (O_DIRECT): dirty cached pages of the range are
    /// written back first, so the device holds the latest data.
    pub fn read_direct_ino(&self, ino: Ino, buf: &mut [u8], offset: u64) -> Result<usize> {
        if !buf.is_empty() && !self.inner.read_only {
            let ps = u64::from(self.inner.block_size);
            let len = buf.len() as u64;
            let (first, last) = (offset / ps, offset.saturating_add(len - 1) / ps);
            self.writeback_ino(ino, first, last, true)?;
        }
        let _io = self.io_shared(ino);
        let _t = self.tree_shared(ino);
        let inode = self.read_inode_vfs(ino)?;
        self.read_device(ino, &inode, buf, offset)
    }

    /// Read from the device through the block mapping (caller holds the I/O lock and,
    /// for a regular file, the tree lock; `inode` is current).
    pub(crate) fn read_device(
        &self,
        ino: Ino,
        inode: &Inode,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<usize> {
        // SAFETY: `read_device_into` writes only initialized bytes.
        self.read_device_into(ino, inode, unsafe { crate::device::as_uninit(buf) }, offset)
    }

    /// [`Fs::read_device`] into a buffer that need not be initialized: the bytes it
    /// returns the count of are.
    pub(crate) fn read_device_into(
        &self,
        ino: Ino,
        inode: &Inode,
        buf: &mut [MaybeUninit<u8>],
        offset: u64,
    ) -> Result<usize> {
        if inode.has_flag(rext4_format::inode::flags::INLINE_DATA) {
            return self.read_inline(ino, inode, buf, offset);
        }
        if offset >= inode.size {
            return Ok(0);
        }
        let want = (buf.len() as u64).min(inode.size - offset) as usize;
        let bs = u64::from(self.inner.block_size);
        let mut done = 0usize;
        while done < want {
            let pos = offset + done as u64;
            let lblk = pos / bs;
            let in_blk = pos % bs;
            let (run_blocks, phys) = self.map_block(ino, inode, lblk)?.data_run();
            let run_bytes = run_blocks.saturating_mul(bs).saturating_sub(in_blk);
            let n = (want - done)
                .min(run_bytes.min(usize::MAX as u64) as usize)
                .max(1);
            let n = n.min(want - done);
            let dst = &mut buf[done..done + n];
            match phys {
                None => dst.fill(MaybeUninit::new(0)),
                Some(p) => self.read_data(dst, p * bs + in_blk)?,
            }
            done += n;
        }
        Ok(done)
    }

    /// FIEMAP of inode `ino` with FIEMAP_FLAG_SYNC (as xfs_io asks for it): the file's
    /// dirty data is written back first (read-write filesystems), so delayed
    /// allocations and conversions show; then every mapped run up to logical block
    /// `limit_blocks`, with the inode as `stat` shows it.
    pub fn fiemap_ino(&self, ino: Ino, limit_blocks: u64) -> Result<(Inode, Vec<(u64, Mapping)>)> {
        if !self.inner.read_only && self.check_writable().is_ok() {
            self.sync_range_ino(ino, 0, 0)?;
        }
        let _t = self.tree_shared(ino);
        let inode = self.inode_attr(ino)?;
        if inode.is_symlink() && inode.is_fast_symlink(self.inner.block_size) {
            return Ok((inode, Vec::new())); // the target lives in i_block: no blocks
        }
        let ext = self.extents(ino, &inode, limit_blocks)?;
        Ok((inode, ext))
    }

    /// Open inode `ino` for reading, and for writing too when `write` (the
    /// filesystem must be writable then).
    pub fn open_ino_with(&self, ino: Ino, write: bool) -> Result<File> {
        if write {
            self.check_writable()?;
        }
        let mut f = self.open_ino(ino)?;
        f.write = write;
        Ok(f)
    }

    /// Open inode `ino` as a read-only [`File`].
    pub fn open_ino(&self, ino: Ino) -> Result<File> {
        // Pinned before the check: an unlink after it leaves an orphan this handle
        // keeps; one before it freed the inode, which the check sees.
        self.pin(ino);
        if let Err(e) = self.read_live_inode(ino) {
            let _ = self.unpin(ino);
            return Err(e);
        }
        Ok(self.file_pinned(ino))
    }

    /// A read-only [`File`] for `ino`, which the caller has pinned (the pin becomes
    /// the handle's).
    pub(crate) fn file_pinned(&self, ino: Ino) -> File {
        File {
            fs: self.clone(),
            ino,
            read: true,
            write: false,
            append: false,
            direct: false,
        }
    }
}

/// An open file. Like `std::fs::File` with positional I/O (`read_at`, `write_at`);
/// the inode is read afresh on every call, so handles see each other's changes.
/// I/O goes through the page cache unless the file was opened with
/// `OpenOptions::direct` (O_DIRECT).
pub struct File {
    pub(crate) fs: Fs,
    pub(crate) ino: Ino,
    pub(crate) read: bool,
    pub(crate) write: bool,
    pub(crate) append: bool,
    pub(crate) direct: bool,
}

impl Drop for File {
    fn drop(&mut self) {
        // The last reference to an unlinked file frees it (errors surface at sync).
        let _ = self.fs.unpin(self.ino);
    }
}

impl File {
    pub fn ino(&self) -> Ino {
        self.ino
    }
    /// linkat(fd, "", AT_FDCWD, `path`, AT_EMPTY_PATH): a new name for this file,
    /// also for an unnamed one from [`Fs::create_unnamed`] made linkable.
    pub fn link(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let (parent, name) = self
            .fs
            .parent_and_name(std::os::unix::ffi::OsStrExt::as_bytes(
                path.as_ref().as_os_str(),
            ))?;
        self.fs.link_ino(self.ino, parent, name)
    }
    fn inode(&self) -> Result<Inode> {
        self.fs.read_inode_vfs(self.ino)
    }
    pub fn metadata(&self) -> Result<Metadata> {
        let i = self.inode()?;
        Ok(self.fs.metadata_of(self.ino, &i))
    }
    pub fn len(&self) -> Result<u64> {
        Ok(self.inode()?.size)
    }
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Positional read, like `std::os::unix::fs::FileExt::read_at`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if !self.read {
            return Err(Error::NotOpenFor("reading"));
        }
        let inode = self.inode()?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        // DAX reads of regular files go straight to the mapping (`read_ino_at`),
        // O_DIRECT or not: there is no page cache to go around.
        let n = if self.direct && !(self.fs.is_dax() && inode.is_reg()) {
            self.fs.read_direct_ino(self.ino, buf, offset)?
        } else {
            self.fs.read_ino_at(self.ino, &inode, buf, offset)?
        };
        self.fs.accessed(self.ino);
        Ok(n)
    }

    /// [`File::read_at`] into a buffer that need not be initialized (a fresh
    /// allocation, such as a Python `bytes` object being filled): returns the count
    /// `n`, and `buf[..n]` is initialized. Large reads of a file go from the device
    /// (or the cached pages) straight into it, with no pass to zero it first.
    pub fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> Result<usize> {
        if !self.read {
            return Err(Error::NotOpenFor("reading"));
        }
        if !self.direct && !self.fs.is_dax() {
            if let Some(n) = self.fs.pc_read_around_into(self.ino, buf, offset)? {
                self.fs.accessed(self.ino);
                return Ok(n);
            }
        }
        self.read_at(crate::device::zeroed(buf), offset)
    }

    /// Read exactly `buf.len()` bytes or fail with `InvalidInput` at EOF.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.read_at(buf, offset)?;
        if n != buf.len() {
            return Err(Error::InvalidInput("read past end of file".into()));
        }
        Ok(())
    }
    /// Positional write (`FileExt::write_at`); with `append` the offset is ignored and
    /// the data goes to the end, as O_APPEND does.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        if !self.write {
            return Err(Error::NotOpenFor("writing"));
        }
        // A file made immutable (or append-only) after it was opened takes no more
        // writes (appends only), as on ext4.
        crate::ops::may_change(&self.fs.read_live_inode(self.ino)?, "write", self.append)?;
        if self.fs.is_dax() {
            let off = (!self.append).then_some(offset);
            return self.fs.dax_write(self.ino, buf, off, true);
        }
        if self.append {
            return self.fs.append_ino(self.ino, buf, self.direct);
        }
        if self.direct {
            return self.fs.write_direct_ino(self.ino, buf, offset, true);
        }
        self.fs.write_ino_at(self.ino, buf, offset)
    }
    /// Write all of `buf` at `offset` (retrying after short writes).
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        crate::ops::write_whole(buf, offset, |b, o| self.write_at(b, o))
    }
    /// Write each `(bytes, offset)` whole, as [`File::write_all_at`] each. On a file
    /// opened with [`OpenOptions::direct`] they are in flight together: overwrites of
    /// written blocks go to the device in one batch under the shared I/O lock (a queue
    /// depth, as io_submit(2) gives; `Fs::write_direct_batch_ino`). Other files write
    /// them one after the other. The writes must not overlap (their order is not
    /// defined); on an error some may have been written.
    pub fn write_all_at_batch(&self, writes: &[(&[u8], u64)]) -> Result<()> {
        if !self.direct || self.append || self.fs.is_dax() || writes.len() <= 1 {
            return writes
                .iter()
                .try_for_each(|&(buf, off)| self.write_all_at(buf, off));
        }
        if !self.write {
            return Err(Error::NotOpenFor("writing"));
        }
        crate::ops::may_change(&self.fs.read_live_inode(self.ino)?, "write", false)?;
        self.fs.write_direct_batch_ino(self.ino, writes, true)
    }
    /// Truncate or extend (`File::set_len`).
    pub fn set_len(&self, size: u64) -> Result<()> {
        if !self.write {
            return Err(Error::NotOpenFor("writing"));
        }
        self.fs.truncate_ino(self.ino, size)
    }
    /// Flush the file's data and the journal to the device (`File::sync_all`). In DAX
    /// mode: the pages stored into through mappings are written back, the journal
    /// commits, and a fence makes every earlier store durable.
    pub fn sync_all(&self) -> Result<()> {
        self.fs.fsync_ino(self.ino)
    }
    /// `File::sync_data`: the same as `sync_all` (the journal commit is what makes the
    /// size and the block mapping durable).
    pub fn sync_data(&self) -> Result<()> {
        self.fs.fsync_ino(self.ino)
    }
    /// sync_file_range(WRITE|WAIT_AFTER) of `[offset, offset+len)` (`len` 0: to EOF):
    /// write the range's dirty pages to the device, without a journal commit.
    pub fn sync_range(&self, offset: u64, len: u64) -> Result<()> {
        self.fs.sync_range_ino(self.ino, offset, len)
    }
    /// posix_fadvise(DONTNEED): drop the range's clean cached pages.
    pub fn drop_cache(&self, offset: u64, len: u64) {
        self.fs.drop_cache_ino(self.ino, offset, len)
    }
    /// Mapped extents (logical block, mapping), like FIEMAP with FIEMAP_FLAG_SYNC: the
    /// file's dirty data is written back first, so delayed allocations show.
    pub fn extents(&self) -> Result<Vec<(u64, Mapping)>> {
        let bs = u64::from(self.fs.block_size());
        let size = self.len()?;
        Ok(self.fs.fiemap_ino(self.ino, size.div_ceil(bs))?.1)
    }
    /// SEEK_DATA / SEEK_HOLE from `offset` (`None`: ENXIO).
    pub fn seek(&self, offset: u64, whence: crate::Whence) -> Result<Option<u64>> {
        self.fs.seek_ino(self.ino, offset, whence)
    }
}
