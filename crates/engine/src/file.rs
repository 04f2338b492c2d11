//! Files and metadata in the std::fs style: [`Metadata`] (like `std::fs::Metadata` plus
//! ext4's extra fields) and [`File`] with positional reads.
//!
//! Reads go through [`Fs::map_block`]: holes and unwritten extents read as zeros, mapped
//! runs are read straight from the device (no page cache yet; that comes with the
//! mount). Sizes are checked against ext4's maximum file size so a corrupt i_size
//! cannot make a reader loop for ever.

use rext4_format::inode::{mode, Inode, Timestamp};
use rext4_format::superblock::feature;

use crate::error::{Error, Result};
use crate::fs::{Fs, Ino};
use crate::map::{Mapping, MAX_LOGICAL};

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
        let inode = self.read_live_inode(ino)?;
        Ok(self.metadata_of(ino, &inode))
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
            blocks: inode.blocks_512(huge, self.inner.block_size),
            block_size: self.inner.block_size,
            rdev: matches!(ft, FileType::CharDevice | FileType::BlockDevice)
                .then(|| inode.device()),
            generation: inode.generation,
            flags: inode.flags,
        }
    }

    /// Read up to `buf.len()` bytes of inode `ino` at byte `offset`; returns the count
    /// (0 at or past EOF). `_inode` is the caller's copy; size and mapping are taken
    /// from the inode as it is under the I/O lock.
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
        if offset >= inode.size {
            return Ok(0);
        }
        let want = (buf.len() as u64).min(inode.size - offset) as usize;
        let bs = u64::from(self.inner.block_size);
        let dev = self.cache().device().clone();
        let mut done = 0usize;
        while done < want {
            let pos = offset + done as u64;
            let lblk = pos / bs;
            let in_blk = pos % bs;
            let m = self.map_block(ino, &inode, lblk)?;
            let (run_blocks, phys) = match m {
                Mapping::Hole { len } => (len, None),
                Mapping::Mapped {
                    unwritten: true,
                    len,
                    ..
                } => (len, None),
                Mapping::Mapped {
                    physical,
                    len,
                    unwritten: false,
                } => (len, Some(physical)),
            };
            let run_bytes = run_blocks.saturating_mul(bs).saturating_sub(in_blk);
            let n = (want - done)
                .min(run_bytes.min(usize::MAX as u64) as usize)
                .max(1);
            let n = n.min(want - done);
            let dst = &mut buf[done..done + n];
            match phys {
                None => dst.fill(0),
                Some(p) => dev.read_at(dst, p * bs + in_blk)?,
            }
            done += n;
        }
        Ok(done)
    }

    /// Open inode `ino` as a read-only [`File`].
    pub fn open_ino(&self, ino: Ino) -> Result<File> {
        self.read_live_inode(ino)?;
        self.pin(ino);
        Ok(File {
            fs: self.clone(),
            ino,
            read: true,
            write: false,
            append: false,
        })
    }
}

/// An open file. Like `std::fs::File` with positional I/O (`read_at`, `write_at`);
/// the inode is read afresh on every call, so handles see each other's changes.
pub struct File {
    pub(crate) fs: Fs,
    pub(crate) ino: Ino,
    pub(crate) read: bool,
    pub(crate) write: bool,
    pub(crate) append: bool,
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
    fn inode(&self) -> Result<Inode> {
        self.fs.read_live_inode(self.ino)
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
            return Err(Error::InvalidInput("file not open for reading".into()));
        }
        let inode = self.inode()?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        self.fs.read_ino_at(self.ino, &inode, buf, offset)
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
            return Err(Error::InvalidInput("file not open for writing".into()));
        }
        let _io = self.fs.io_exclusive(self.ino);
        let _w = self.fs.write_lock();
        self.fs.check_writable()?;
        let off = if self.append {
            self.inode()?.size
        } else {
            offset
        };
        self.fs.write_locked(self.ino, buf, off, true)
    }
    /// Write all of `buf` at `offset` (retrying after short writes).
    pub fn write_all_at(&self, mut buf: &[u8], mut offset: u64) -> Result<()> {
        while !buf.is_empty() {
            let n = self.write_at(buf, offset)?;
            if n == 0 {
                return Err(Error::NoSpace);
            }
            buf = &buf[n..];
            offset += n as u64;
        }
        Ok(())
    }
    /// Truncate or extend (`File::set_len`).
    pub fn set_len(&self, size: u64) -> Result<()> {
        if !self.write {
            return Err(Error::InvalidInput("file not open for writing".into()));
        }
        self.fs.truncate_ino(self.ino, size)
    }
    /// Flush data and metadata to the device (`File::sync_all`). Without a journal this
    /// writes all dirty metadata of the filesystem.
    pub fn sync_all(&self) -> Result<()> {
        self.fs.sync()
    }
    /// `File::sync_data`: the same as `sync_all` for now.
    pub fn sync_data(&self) -> Result<()> {
        self.fs.sync()
    }
    /// Mapped extents (logical block, mapping), like FIEMAP.
    pub fn extents(&self) -> Result<Vec<(u64, Mapping)>> {
        let inode = self.inode()?;
        let bs = u64::from(self.fs.block_size());
        self.fs.extents(self.ino, &inode, inode.size.div_ceil(bs))
    }
}
