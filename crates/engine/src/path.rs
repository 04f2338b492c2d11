//! Path resolution and the path-based, std::fs-like API.
//!
//! Paths are byte strings interpreted inside the image: "/" is the image root, absolute
//! symlink targets resolve against the image root (like a chroot), ".." of the root is
//! the root. At most [`MAX_SYMLINKS`] symlinks are followed per resolution (ELOOP after
//! that), components longer than 255 bytes are ENAMETOOLONG.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rext4_format::inode::Inode;

use crate::dir::DirEntry;
use crate::error::{Error, Result};
use crate::file::{File, Metadata};
use crate::fs::{Fs, Ino};

pub const MAX_SYMLINKS: u32 = 40;
/// Longest symlink target ext4 stores (one block; the kernel caps at PATH_MAX).
const MAX_TARGET: u64 = 4096;

fn path_bytes(p: &Path) -> &[u8] {
    p.as_os_str().as_bytes()
}

impl Fs {
    /// The target of symlink inode `ino`.
    pub fn read_link_ino(&self, ino: Ino) -> Result<Vec<u8>> {
        let inode = self.read_live_inode(ino)?;
        self.symlink_target(ino, &inode)
    }

    pub(crate) fn symlink_target(&self, ino: Ino, inode: &Inode) -> Result<Vec<u8>> {
        if !inode.is_symlink() {
            return Err(Error::NotASymlink);
        }
        let bs = self.inner.block_size;
        if inode.size == 0 || inode.size > MAX_TARGET.min(u64::from(bs)) {
            return Err(Error::corrupted(
                format!("symlink {} has impossible length {}", ino.0, inode.size),
                None,
            ));
        }
        let len = inode.size as usize;
        if inode.is_fast_symlink(bs) {
            return Ok(inode.block[..len.min(60)].to_vec());
        }
        let mut buf = vec![0u8; len];
        let n = self.read_ino_at(ino, inode, &mut buf, 0)?;
        buf.truncate(n);
        if buf.contains(&0) {
            return Err(Error::corrupted(
                format!("symlink {} target contains NUL", ino.0),
                None,
            ));
        }
        Ok(buf)
    }

    /// Resolve `path` to an inode; `follow` says whether a final symlink is followed.
    pub fn resolve(&self, path: &[u8], follow: bool) -> Result<Ino> {
        let mut budget = MAX_SYMLINKS;
        self.walk(Ino::ROOT, path, follow, &mut budget)
    }

    fn walk(&self, start: Ino, path: &[u8], follow: bool, budget: &mut u32) -> Result<Ino> {
        let mut cur = if path.first() == Some(&b'/') {
            Ino::ROOT
        } else {
            start
        };
        let comps: Vec<&[u8]> = path
            .split(|&c| c == b'/')
            .filter(|c| !c.is_empty())
            .collect();
        for (i, comp) in comps.iter().enumerate() {
            let last = i + 1 == comps.len();
            if comp.len() > rext4_format::dir::NAME_MAX {
                return Err(Error::NameTooLong);
            }
            let dir_inode = self.read_live_inode(cur)?;
            if !dir_inode.is_dir() {
                return Err(Error::NotADirectory);
            }
            if *comp == b"." {
                continue;
            }
            let e = self.lookup(cur, comp)?.ok_or(Error::NotFound)?;
            let child = e.ino;
            let inode = self.read_live_inode(child)?;
            if inode.is_symlink() && (!last || follow) {
                if *budget == 0 {
                    return Err(Error::Loop);
                }
                *budget -= 1;
                let target = self.symlink_target(child, &inode)?;
                cur = self.walk(cur, &target, true, budget)?;
            } else {
                cur = child;
            }
        }
        Ok(cur)
    }

    /// Metadata of `path`, following a final symlink (`std::fs::metadata`).
    pub fn metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat_ino(self.resolve(path_bytes(path.as_ref()), true)?)
    }

    /// Metadata of `path` itself (`std::fs::symlink_metadata`).
    pub fn symlink_metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat_ino(self.resolve(path_bytes(path.as_ref()), false)?)
    }

    /// Entries of directory `path`, without "." and ".." (`std::fs::read_dir`).
    pub fn read_dir(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        self.read_dir_ino(self.resolve(path_bytes(path.as_ref()), true)?)
    }

    /// Target of symlink `path` (`std::fs::read_link`).
    pub fn read_link(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        self.read_link_ino(self.resolve(path_bytes(path.as_ref()), false)?)
    }

    /// Open a file for reading (`std::fs::File::open`).
    pub fn open_file(&self, path: impl AsRef<Path>) -> Result<File> {
        let ino = self.resolve(path_bytes(path.as_ref()), true)?;
        let f = self.open_ino(ino)?;
        if f.metadata().is_dir() {
            return Err(Error::IsADirectory);
        }
        Ok(f)
    }

    /// The whole contents of a file (`std::fs::read`). Memory grows with what is read.
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let f = self.open_file(path)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = f.read_at(&mut buf, off)?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf[..n]);
            off += n as u64;
        }
    }

    /// Extended attributes of `path` (not following a final symlink, like llistxattr).
    pub fn xattrs(&self, path: impl AsRef<Path>) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.xattrs_ino(self.resolve(path_bytes(path.as_ref()), false)?)
    }
}
