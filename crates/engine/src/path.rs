//! Path resolution and the path-based, std::fs-like API.
//!
//! Paths are byte strings interpreted inside the image: "/" is the image root, absolute
//! symlink targets resolve against the image root (like a chroot), ".." of the root is
//! the root. At most [`MAX_SYMLINKS`] symlinks are followed per resolution (ELOOP after
//! that), components longer than 255 bytes are ENAMETOOLONG. A trailing slash names a
//! directory, as in POSIX: a final symlink is followed, "file/" is ENOTDIR, a regular
//! file is never created under such a name (EISDIR). The empty path names nothing
//! (ENOENT).

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rext4_format::inode::{Inode, Timestamp};

use crate::dir::DirEntry;
use crate::error::{Error, Result};
use crate::file::{File, Metadata};
use crate::fs::{Fs, Ino};
use crate::ops::{RenameFlags, SetAttr};
use crate::perm::{want, Creds};

pub const MAX_SYMLINKS: u32 = 40;
/// Longest symlink target ext4 stores (one block; the kernel caps at PATH_MAX).
const MAX_TARGET: u64 = 4096;

pub(crate) fn path_bytes(p: &Path) -> &[u8] {
    p.as_os_str().as_bytes()
}

/// Whether `path` names something and ends with "/" (then it must be a directory).
fn trailing_slash(path: &[u8]) -> bool {
    path.last() == Some(&b'/') && path.iter().any(|&c| c != b'/')
}

/// `path` without its trailing slashes ("/" stays "/").
fn trim_trailing_slashes(mut path: &[u8]) -> &[u8] {
    while path.len() > 1 && path.last() == Some(&b'/') {
        path = &path[..path.len() - 1];
    }
    path
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
        self.resolve_checked(path, follow, None)
    }

    /// `resolve`, checking search permission for `creds` on every directory walked.
    pub(crate) fn resolve_checked(
        &self,
        path: &[u8],
        follow: bool,
        creds: Option<&Creds>,
    ) -> Result<Ino> {
        // As open(""): an empty path names nothing (the CLI's "IMAGE:" means "/").
        if path.is_empty() {
            return Err(Error::NotFound);
        }
        // Name -> inode number -> inode, lockless: the number may not be reused meanwhile.
        let _g = self.read_guard();
        let mut budget = MAX_SYMLINKS;
        let root = (Ino::ROOT, self.read_live_inode(Ino::ROOT)?);
        Ok(self.walk(root, path, follow, &mut budget, creds)?.0)
    }

    /// The inode `name` in directory `dir` names, read. A name found without a lock
    /// may lose its inode to an unlink, rmdir or rename beside the walk before the
    /// inode is read, which reads as an entry to a deleted inode: the name is looked up
    /// again, and the error stands only when it still names the same inode (the
    /// corruption is really there) — the rule `Fs::once_more` applies to whole
    /// operations. Each retry means another thread freed an inode meanwhile; the
    /// caller's read guard keeps the number from reuse, so the next lookup sees the
    /// name gone (ENOENT) or naming another inode.
    fn lookup_live(&self, dir: Ino, name: &[u8]) -> Result<(Ino, Inode)> {
        let mut ino = self.lookup(dir, name)?.ok_or(Error::NotFound)?.ino;
        for _ in 0..16 {
            match self.read_live_inode(ino) {
                Err(e @ Error::Corrupted { .. }) => {
                    let now = self.lookup(dir, name)?.ok_or(Error::NotFound)?.ino;
                    if now == ino {
                        return Err(e);
                    }
                    ino = now;
                }
                r => return r.map(|inode| (ino, inode)),
            }
        }
        Ok((ino, self.read_live_inode(ino)?))
    }

    /// Walk `path` from `start` (a directory and its inode, as read; an absolute path
    /// starts at the root): what it names, and its inode.
    fn walk(
        &self,
        start: (Ino, Inode),
        path: &[u8],
        follow: bool,
        budget: &mut u32,
        creds: Option<&Creds>,
    ) -> Result<(Ino, Inode)> {
        // The inode of `cur`, read once: as the walk's start, then as what each
        // component's lookup found (`lookup_live`).
        let (mut cur, mut cur_inode) = if path.first() == Some(&b'/') {
            (Ino::ROOT, self.read_live_inode(Ino::ROOT)?)
        } else {
            start
        };
        let comps: Vec<&[u8]> = path
            .split(|&c| c == b'/')
            .filter(|c| !c.is_empty())
            .collect();
        // POSIX: a trailing slash names a directory (a final symlink is followed to
        // it); "f/" of a regular file is ENOTDIR.
        let dir_required = trailing_slash(path);
        for (i, comp) in comps.iter().enumerate() {
            let last = i + 1 == comps.len();
            if comp.len() > rext4_format::dir::NAME_MAX {
                return Err(Error::NameTooLong);
            }
            if !cur_inode.is_dir() {
                return Err(Error::NotADirectory);
            }
            if let Some(c) = creds {
                self.permission_of(cur, &cur_inode, c, crate::perm::want::EXEC)?;
            }
            if *comp == b"." {
                continue;
            }
            let (child, inode) = self.lookup_live(cur, comp)?;
            if inode.is_symlink() && (!last || follow || dir_required) {
                if *budget == 0 {
                    return Err(Error::Loop);
                }
                *budget -= 1;
                let target = self.symlink_target(child, &inode)?;
                (cur, cur_inode) = self.walk((cur, cur_inode), &target, true, budget, creds)?;
            } else {
                cur = child;
                cur_inode = inode;
            }
        }
        if dir_required && !cur_inode.is_dir() {
            return Err(Error::NotADirectory);
        }
        Ok((cur, cur_inode))
    }

    /// Metadata of `path`, following a final symlink (`std::fs::metadata`).
    pub fn metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        let _g = self.read_guard();
        self.stat_ino(self.resolve(path_bytes(path.as_ref()), true)?)
    }

    /// Metadata of `path` itself (`std::fs::symlink_metadata`).
    pub fn symlink_metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        let _g = self.read_guard();
        self.stat_ino(self.resolve(path_bytes(path.as_ref()), false)?)
    }

    /// Entries of directory `path`, without "." and ".." (`std::fs::read_dir`).
    pub fn read_dir(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        // The guard stays over the atime update: the number cannot be reused meanwhile
        // (writers never wait for readers, so taking the write lock under it is safe).
        let _g = self.read_guard();
        let ino = self.resolve(path_bytes(path.as_ref()), true)?;
        let list = self.read_dir_ino(ino)?;
        self.accessed(ino);
        Ok(list)
    }

    /// Target of symlink `path` (`std::fs::read_link`).
    pub fn read_link(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let _g = self.read_guard();
        let ino = self.resolve(path_bytes(path.as_ref()), false)?;
        let target = self.read_link_ino(ino)?;
        self.accessed(ino);
        Ok(target)
    }

    /// Open a file for reading (`std::fs::File::open`).
    pub fn open_file(&self, path: impl AsRef<Path>) -> Result<File> {
        let g = self.read_guard();
        let ino = self.resolve(path_bytes(path.as_ref()), true)?;
        let f = self.open_ino(ino)?;
        drop(g); // pinned now
        if f.metadata()?.is_dir() {
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
        let _g = self.read_guard();
        self.xattrs_ino(self.resolve(path_bytes(path.as_ref()), false)?)
    }
}

/// Options for opening files, like `std::fs::OpenOptions` (plus the mode and owner a
/// created file gets, since the engine has no process credentials).
#[derive(Debug, Clone)]
pub struct OpenOptions {
    read: bool,
    write: bool,
    append: bool,
    truncate: bool,
    create: bool,
    create_new: bool,
    direct: bool,
    mode: u32,
    uid: u32,
    gid: u32,
    creds: Option<Creds>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl OpenOptions {
    pub fn new() -> Self {
        OpenOptions {
            read: false,
            write: false,
            append: false,
            truncate: false,
            create: false,
            create_new: false,
            direct: false,
            mode: 0o644,
            uid: 0,
            gid: 0,
            creds: None,
        }
    }
    pub fn read(&mut self, v: bool) -> &mut Self {
        self.read = v;
        self
    }
    pub fn write(&mut self, v: bool) -> &mut Self {
        self.write = v;
        self
    }
    /// O_APPEND: every write goes to the end of the file.
    pub fn append(&mut self, v: bool) -> &mut Self {
        self.append = v;
        self
    }
    pub fn truncate(&mut self, v: bool) -> &mut Self {
        self.truncate = v;
        self
    }
    /// O_CREAT.
    pub fn create(&mut self, v: bool) -> &mut Self {
        self.create = v;
        self
    }
    /// O_CREAT | O_EXCL.
    pub fn create_new(&mut self, v: bool) -> &mut Self {
        self.create_new = v;
        self
    }
    /// O_DIRECT: reads and writes go to the device, around the page cache.
    pub fn direct(&mut self, v: bool) -> &mut Self {
        self.direct = v;
        self
    }
    /// Permission bits of a created file (default 0o644).
    pub fn mode(&mut self, mode: u32) -> &mut Self {
        self.mode = mode;
        self
    }
    /// Owner of a created file (default 0:0).
    pub fn owner(&mut self, uid: u32, gid: u32) -> &mut Self {
        self.uid = uid;
        self.gid = gid;
        self
    }

    /// Open as `creds`: search permission on the path, write and search on the parent
    /// to create, read/write permission on the file as the flags ask (open(2)'s checks);
    /// a created file is owned by `creds` (the parent's group when it is set-group-ID).
    pub fn creds(&mut self, creds: Creds) -> &mut Self {
        self.creds = Some(creds);
        self
    }

    /// Open `path` in `fs`.
    pub fn open(&self, fs: &Fs, path: impl AsRef<Path>) -> Result<File> {
        let p = path_bytes(path.as_ref());
        // The walk and what follows under one read guard: no number it found is
        // handed to another inode before the open pins or creates.
        let _g = fs.read_guard();
        // The name is resolved without a lock: an unlink may free its inode before
        // this open reads it; then the open goes on with what the path names now (the
        // walk's result is the open's to judge: ENOENT may mean "create").
        let c = self.creds.as_ref();
        fs.once_more(
            || Ok(fs.resolve_checked(p, true, c)),
            |found| found.as_ref().ok().copied(),
            |found| self.open_found(fs, p, found),
        )
    }

    /// Open `p`, which the walk resolved to `found`.
    fn open_found(&self, fs: &Fs, p: &[u8], found: Result<Ino>) -> Result<File> {
        let writing = self.write || self.append;
        if (self.truncate || self.create || self.create_new) && !writing {
            return Err(Error::InvalidInput(
                "create or truncate needs write access".into(),
            ));
        }
        let c = self.creds.as_ref();
        let mut created = false;
        // A file this open made is pinned from its creation on (its `File` holds the
        // pin, released if the open fails later).
        let mut made: Option<File> = None;
        let ino = match found {
            Ok(ino) => {
                if self.create_new {
                    return Err(Error::Exists);
                }
                ino
            }
            Err(Error::NotFound) if (self.create || self.create_new) && !p.is_empty() => {
                // open("new/", O_CREAT): a regular file cannot be what "new/" names.
                if trailing_slash(p) {
                    return Err(Error::IsADirectory);
                }
                let (parent, name) = fs.parent_and_name_checked(p, c)?;
                let (uid, gid) = match c {
                    Some(c) => {
                        fs.may_create_ino(parent, c)?;
                        let d = fs.read_live_inode(parent)?;
                        let sgid = d.mode & rext4_format::inode::mode::S_ISGID != 0;
                        (c.uid, if sgid { d.gid } else { c.gid })
                    }
                    None => (self.uid, self.gid),
                };
                let mode = u32::from(rext4_format::inode::mode::S_IFREG) | (self.mode & 0o7777);
                match fs.mknod_pinning(parent, name, mode, (uid, gid), (0, 0), true) {
                    Ok(ino) => {
                        created = true;
                        made = Some(fs.file_pinned(ino));
                        ino
                    }
                    Err(Error::Exists) if !self.create_new => fs.resolve_checked(p, true, c)?,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        if let (Some(c), false) = (c, created) {
            let mut w = 0;
            if self.read {
                w |= want::READ;
            }
            if writing || self.truncate {
                w |= want::WRITE;
            }
            fs.permission_ino(ino, c, w)?;
        }
        fs.may_open_ino(ino, writing, self.append, self.truncate)?;
        let f = match made {
            Some(f) => f,
            None => fs.open_ino(ino)?,
        };
        let meta = f.metadata()?;
        if meta.is_dir() && writing {
            return Err(Error::IsADirectory);
        }
        // As open(2): a regular file on a read-only filesystem is not opened for
        // writing at all (EROFS now, not at the first write).
        if (writing || self.truncate) && meta.is_file() {
            fs.check_writable()?;
        }
        if self.truncate && meta.is_file() && meta.size > 0 {
            fs.truncate_ino(ino, 0)?;
        }
        let mut f = f;
        f.read = self.read;
        f.write = writing;
        f.append = self.append;
        f.direct = self.direct;
        Ok(f)
    }
}

impl Fs {
    /// Split `path` into its resolved parent directory and final name.
    pub fn parent_and_name<'p>(&self, path: &'p [u8]) -> Result<(Ino, &'p [u8])> {
        self.parent_and_name_checked(path, None)
    }

    /// `parent_and_name`, with search permission checked for `creds` on the way.
    pub fn parent_and_name_checked<'p>(
        &self,
        path: &'p [u8],
        creds: Option<&Creds>,
    ) -> Result<(Ino, &'p [u8])> {
        let trimmed = trim_trailing_slashes(path);
        let cut = trimmed.iter().rposition(|&c| c == b'/');
        let (dir, name) = match cut {
            Some(i) => (&trimmed[..i.max(1)], &trimmed[i + 1..]),
            None => (&b"."[..], trimmed),
        };
        if name.is_empty() || name == b"." || name == b".." {
            return Err(Error::InvalidInput("path has no final name".into()));
        }
        let parent = self.resolve_checked(if dir.is_empty() { b"/" } else { dir }, true, creds)?;
        Ok((parent, name))
    }

    /// Create (or truncate) a file for writing (`std::fs::File::create`).
    pub fn create(&self, path: impl AsRef<Path>) -> Result<File> {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(self, path)
    }

    /// open(`dir`, O_TMPFILE | O_RDWR, `mode`): an unnamed regular file in directory
    /// `dir`, open for reading and writing and owned by root. It is freed when the
    /// returned [`File`] (and every clone of its reference) is gone, unless
    /// [`File::link`] gave it a name first; with `linkable` false (O_EXCL) it never
    /// gets one.
    pub fn create_unnamed(&self, dir: impl AsRef<Path>, mode: u32, linkable: bool) -> Result<File> {
        let parent = self.resolve(path_bytes(dir.as_ref()), true)?;
        let ino = self.tmpfile_ino(parent, mode & 0o7777, 0, 0, !linkable)?;
        // The file takes over the reference tmpfile_ino returned.
        let f = self.open_ino_with(ino, true);
        let _ = self.unpin(ino);
        f
    }

    /// Write a whole file (`std::fs::write`).
    pub fn write(&self, path: impl AsRef<Path>, data: impl AsRef<[u8]>) -> Result<()> {
        let f = self.create(path)?;
        let d = data.as_ref();
        if !d.is_empty() {
            f.write_all_at(d, 0)?;
        }
        Ok(())
    }

    /// `std::fs::create_dir` (mode 0o755, owner 0:0; see [`Fs::mkdir_ino`] for more).
    pub fn create_dir(&self, path: impl AsRef<Path>) -> Result<()> {
        let r = self.on_parent(path.as_ref(), |p, n| {
            self.mkdir_ino(p, n, 0o755, 0, 0).map(drop)
        });
        match r {
            // "/", "d/." or "d/..": no name to make, but a directory is there (mkdir(2)
            // and std answer EEXIST).
            Err(Error::InvalidInput(_))
                if self.resolve(path_bytes(path.as_ref()), true).is_ok() =>
            {
                Err(Error::Exists)
            }
            r => r,
        }
    }

    /// `std::fs::create_dir_all`.
    pub fn create_dir_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = path_bytes(path.as_ref());
        let mut cur = Vec::new();
        for comp in p.split(|&c| c == b'/').filter(|c| !c.is_empty()) {
            cur.push(b'/');
            cur.extend_from_slice(comp);
            match self.resolve(&cur, true) {
                Ok(ino) if self.stat_ino(ino)?.is_dir() => continue,
                Ok(_) => return Err(Error::NotADirectory),
                Err(Error::NotFound) => {
                    let (parent, name) = self.parent_and_name(&cur)?;
                    match self.mkdir_ino(parent, name, 0o755, 0, 0) {
                        Ok(_) | Err(Error::Exists) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// `std::fs::remove_file`.
    pub fn remove_file(&self, path: impl AsRef<Path>) -> Result<()> {
        if trailing_slash(path_bytes(path.as_ref())) {
            // "f/" of a file is ENOTDIR (from the walk); of a directory, EISDIR.
            self.resolve(path_bytes(path.as_ref()), false)?;
            return Err(Error::IsADirectory);
        }
        self.on_parent(path.as_ref(), |p, n| self.unlink_ino(p, n))
    }

    /// `std::fs::remove_dir` (must be empty).
    pub fn remove_dir(&self, path: impl AsRef<Path>) -> Result<()> {
        self.on_parent(path.as_ref(), |p, n| self.rmdir_ino(p, n))
    }

    /// `std::fs::remove_dir_all`: a directory and everything below it.
    pub fn remove_dir_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let ino = self.resolve(path_bytes(path.as_ref()), false)?;
        self.empty_dir_ino(ino, &|| false)?;
        self.remove_dir(path)
    }

    /// Remove everything below directory `top` (leaving `top`), depth first, as
    /// `std::fs::remove_dir_all` does before its last step; `stop` is asked before each
    /// entry and, once true, ends the walk (what is removed stays removed, the rest
    /// whole). Returns whether the walk finished. Without recursion: a tree of any
    /// depth takes no stack, and a directory met again below itself (a loop, which only
    /// a corrupted image holds) is refused as corruption instead of walked for ever.
    pub fn empty_dir_ino(&self, top: Ino, stop: &dyn Fn() -> bool) -> Result<bool> {
        /// A directory being emptied: its name in the one above, the entries left.
        struct Level {
            dir: Ino,
            name: Vec<u8>,
            rest: std::vec::IntoIter<DirEntry>,
        }
        let mut on_path = std::collections::HashSet::from([top]);
        let mut stack = vec![Level {
            dir: top,
            name: Vec::new(),
            rest: self.read_dir_ino(top)?.into_iter(),
        }];
        while let Some(level) = stack.last_mut() {
            if stop() {
                return Ok(false);
            }
            let dir = level.dir;
            let Some(e) = level.rest.next() else {
                let done = stack.pop().expect("the level just seen");
                on_path.remove(&done.dir);
                if let Some(parent) = stack.last() {
                    self.rmdir_ino(parent.dir, &done.name)?;
                }
                continue;
            };
            if !self.stat_ino(e.ino)?.is_dir() {
                self.unlink_ino(dir, &e.name)?;
                continue;
            }
            if !on_path.insert(e.ino) {
                return Err(Error::corrupted(
                    format!(
                        "directory {} holds directory {} that holds it (a loop)",
                        dir.0, e.ino.0
                    ),
                    None,
                ));
            }
            let rest = self.read_dir_ino(e.ino)?.into_iter();
            stack.push(Level {
                dir: e.ino,
                name: e.name,
                rest,
            });
        }
        Ok(true)
    }

    /// `std::fs::rename`.
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<()> {
        self.rename_with(from, to, RenameFlags::default())
    }

    /// renameat2 with RENAME_NOREPLACE / RENAME_EXCHANGE.
    pub fn rename_with(
        &self,
        from: impl AsRef<Path>,
        to: impl AsRef<Path>,
        fl: RenameFlags,
    ) -> Result<()> {
        let (from, to) = (path_bytes(from.as_ref()), path_bytes(to.as_ref()));
        // rename("f", "g/") or ("f/", "g"): both must be directories. The source's
        // walk says so for "f/"; a target that exists is checked the same way.
        if trailing_slash(from) || trailing_slash(to) {
            let mut src = from.to_vec();
            if !trailing_slash(&src) {
                src.push(b'/');
            }
            self.resolve(&src, false)?;
            if trailing_slash(to) {
                match self.resolve(to, false) {
                    Ok(_) | Err(Error::NotFound) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.once_more(
            || {
                let g = self.read_guard();
                Ok((g, self.parent_and_name(from)?, self.parent_and_name(to)?))
            },
            |(_, (p1, _), (p2, _))| (*p1, *p2),
            |(_, (p1, n1), (p2, n2))| self.rename_ino(p1, n1, p2, n2, fl),
        )
    }

    /// `std::fs::hard_link(original, link)`.
    pub fn hard_link(&self, original: impl AsRef<Path>, link: impl AsRef<Path>) -> Result<()> {
        self.no_dir_name(link.as_ref())?;
        let (original, link) = (path_bytes(original.as_ref()), path_bytes(link.as_ref()));
        self.once_more(
            || {
                let g = self.read_guard();
                Ok((
                    g,
                    self.resolve(original, false)?,
                    self.parent_and_name(link)?,
                ))
            },
            |(_, ino, (p, _))| (*ino, *p),
            |(_, ino, (p, n))| self.link_ino(ino, p, n),
        )
    }

    /// `std::os::unix::fs::symlink(target, link)`.
    pub fn symlink(&self, target: impl AsRef<Path>, link: impl AsRef<Path>) -> Result<()> {
        self.no_dir_name(link.as_ref())?;
        let target = path_bytes(target.as_ref());
        self.on_parent(link.as_ref(), |p, n| {
            self.symlink_ino(p, n, target, 0, 0).map(drop)
        })
    }

    /// mknod(2): `mode` holds the file type and permission bits.
    pub fn mknod(&self, path: impl AsRef<Path>, mode: u32, rdev: (u32, u32)) -> Result<()> {
        self.no_dir_name(path.as_ref())?;
        self.on_parent(path.as_ref(), |p, n| {
            self.mknod_ino(p, n, mode, 0, 0, rdev).map(drop)
        })
    }

    /// chmod (follows symlinks, like `std::fs::set_permissions`).
    pub fn set_permissions(&self, path: impl AsRef<Path>, mode: u32) -> Result<()> {
        let a = SetAttr {
            mode: Some(mode),
            ..SetAttr::default()
        };
        self.on_path(path.as_ref(), true, |ino| {
            self.setattr_ino(ino, &a).map(drop)
        })
    }

    /// A new non-directory name given with a trailing slash ("l/"), as symlink(2),
    /// link(2) and mknod(2) answer it: EEXIST when something is there, else ENOENT.
    fn no_dir_name(&self, path: &Path) -> Result<()> {
        let p = path_bytes(path);
        if !trailing_slash(p) {
            return Ok(());
        }
        match self.resolve(trim_trailing_slashes(p), false) {
            Ok(_) => Err(Error::Exists),
            Err(e) => Err(e),
        }
    }

    /// `op` on the inode `path` names. The walk holds no lock: an unlink beside it may
    /// free the inode before `op` reads it, which reads as an entry to a deleted inode;
    /// then `op` runs again on what the path names now (see `Fs::once_more`). A read
    /// guard spans each walk and its `op`, so the number is not handed to another file
    /// meanwhile.
    fn on_path<T>(&self, path: &Path, follow: bool, op: impl Fn(Ino) -> Result<T>) -> Result<T> {
        let path = path_bytes(path);
        self.once_more(
            || Ok((self.read_guard(), self.resolve(path, follow)?)),
            |(_, ino)| *ino,
            |(_, ino)| op(ino),
        )
    }

    /// `op` on the parent directory and final name of `path`, under a read guard from
    /// the walk on (the parent's number is not another directory's by the time `op`
    /// locks it), again when the parent was removed and freed after the walk (see
    /// `Fs::on_path`).
    fn on_parent<T>(&self, path: &Path, op: impl Fn(Ino, &[u8]) -> Result<T>) -> Result<T> {
        let path = path_bytes(path);
        self.once_more(
            || Ok((self.read_guard(), self.parent_and_name(path)?)),
            |(_, (p, _))| *p,
            |(_, (p, n))| op(p, n),
        )
    }

    /// `op` on what `walk` finds, and again on what it finds then when `op` reports a
    /// corrupted entry and the walk no longer leads to the same inodes (`key`): a name
    /// resolved without a lock may lose its inode to an unlink, rmdir or rename beside
    /// it before `op` reads it — the next walk sees the name gone (ENOENT) or naming
    /// another inode (whose own loss is retried likewise, a bounded number of times:
    /// each retry means another thread freed an inode meanwhile). When the walk leads
    /// to the same inodes, the corruption is really there (and `op` may have changed
    /// something first): the error stands.
    fn once_more<W, K: PartialEq, T>(
        &self,
        walk: impl Fn() -> Result<W>,
        key: impl Fn(&W) -> K,
        op: impl Fn(W) -> Result<T>,
    ) -> Result<T> {
        let mut w = walk()?;
        let mut k = key(&w);
        for _ in 0..16 {
            match op(w) {
                Err(e @ Error::Corrupted { .. }) => {
                    w = walk()?;
                    let now = key(&w);
                    if now == k {
                        return Err(e);
                    }
                    k = now;
                }
                r => return r,
            }
        }
        op(w)
    }

    /// lchown (does not follow a final symlink).
    pub fn lchown(&self, path: impl AsRef<Path>, uid: Option<u32>, gid: Option<u32>) -> Result<()> {
        let a = SetAttr {
            uid,
            gid,
            ..SetAttr::default()
        };
        self.on_path(path.as_ref(), false, |ino| {
            self.setattr_ino(ino, &a).map(drop)
        })
    }

    /// utimensat with AT_SYMLINK_NOFOLLOW.
    pub fn set_times(
        &self,
        path: impl AsRef<Path>,
        atime: Option<Timestamp>,
        mtime: Option<Timestamp>,
    ) -> Result<()> {
        let a = SetAttr {
            atime,
            mtime,
            ..SetAttr::default()
        };
        self.on_path(path.as_ref(), false, |ino| {
            self.setattr_ino(ino, &a).map(drop)
        })
    }

    /// Truncate or extend a file by path (truncate(2)).
    pub fn set_len(&self, path: impl AsRef<Path>, size: u64) -> Result<()> {
        self.on_path(path.as_ref(), true, |ino| self.truncate_ino(ino, size))
    }
}
