//! Namespace, attribute and data operations of the embedding API, by inode number.
//! The path-based, std::fs-like API (`path.rs`, `file.rs`) is built on these; FUSE
//! will call them directly.
//!
//! Namespace and attribute operations run as handles (`Fs::handle`), beside other
//! handles: creating and removing names (mknod, mkdir, symlink, unlink) under the
//! inode locks of the directory they change and of the inode they unlink (tmpfile:
//! its directory's, shared); link under
//! the new parent's and the inode's; setattr without a size (and xattrs, ACLs) under
//! the inode's own; rename under its directory's and its files' when it stays in one
//! directory and names none, else — as rmdir — under the rename lock, then its
//! parents, the directories it names and its files (see docs/ARCHITECTURE.md,
//! Locking); a write's new times under the file's own. What changes a file's mapping
//! under its exclusive I/O lock (truncate, fallocate, writes that allocate straight
//! to the device) or the orphan list's chain takes `Fs::write_lock`, which excludes
//! all handles, for its whole duration. Each checks POSIX preconditions first and only
//! then changes anything, so a failed precondition leaves the image untouched. Inode
//! link counts follow ext4: a directory has 2 + subdirectories (dir_nlink: 1 once that
//! would pass 64999); an inode whose last link goes is truncated and freed at once
//! (open handles are not tracked until the mount issue; the journal issue adds orphans).

use rext4_format::dir::{FileType as DirFt, NAME_MAX};
use rext4_format::extent::Extent;
use rext4_format::inode::{flags, mode as m, Inode, Timestamp};
use rext4_format::superblock::feature;

use crate::dir_write;
use crate::error::{Error, Result};
use crate::fs::inode_write::{map_new_blocks, now_ts, unmap_range, with_tree, FsDir};
use crate::fs::map::{Mapping, MAX_LOGICAL};
use crate::fs::{Fs, Ino};
use crate::icache::{Dent, DentKey, DentRef};

/// ext4's limit on i_links_count for non-directories (EXT4_LINK_MAX).
pub const LINK_MAX: u16 = 65000;

/// Flags for [`Fs::rename_ino`] (renameat2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
    /// RENAME_WHITEOUT: leave a whiteout at the source name — a character device 0:0
    /// with no permission bits, owned by this (uid, gid), as overlayfs asks of its
    /// upper directory. Not with `exchange`.
    pub whiteout: Option<(u32, u32)>,
}

/// What a rename names (see `Fs::rename_names`).
struct RenameNames<'a> {
    parent: Ino,
    name: &'a [u8],
    new_parent: Ino,
    new_name: &'a [u8],
    /// The old and new parents' inodes.
    od: Inode,
    nd: Inode,
    src: crate::DirEntry,
    src_inode: Inode,
    dst: Option<(crate::DirEntry, Inode)>,
}

/// Attribute changes for [`Fs::setattr_ino`]; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    /// Permission bits (the file type is kept).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Timestamp>,
    pub mtime: Option<Timestamp>,
    pub ctime: Option<Timestamp>,
}

/// ext4's user-visible inode flags (EXT4_FL_USER_VISIBLE).
pub const FL_USER_VISIBLE: u32 = 0x705B_DFFF;
/// The flags FS_IOC_SETFLAGS may change on ext4 (EXT4_FL_USER_MODIFIABLE).
const FL_USER_MODIFIABLE: u32 = 0x604B_C0FF;
/// The modifiable flags that only need keeping.
const FL_KEPT_ONLY: u32 = flags::SECRM
    | flags::UNRM
    | flags::COMPR
    | flags::NODUMP
    | flags::NOATIME
    | flags::NOTAIL
    | flags::TOPDIR;

/// The flags rext4 enforces itself: IMMUTABLE and APPEND.
const FL_ENFORCED: u32 = flags::IMMUTABLE | flags::APPEND;

/// The checks of a truncate of `inode` to `size`: a regular file, within the size
/// limit, neither immutable nor append-only.
fn truncate_allowed(inode: &Inode, size: u64, max: u64) -> Result<()> {
    if inode.is_dir() {
        return Err(Error::IsADirectory);
    }
    if !inode.is_reg() {
        return Err(Error::InvalidInput("truncate of a non-regular file".into()));
    }
    if size > max {
        return Err(Error::FileTooLarge);
    }
    may_change(inode, "truncate", false)
}

/// Write all of `buf` at `offset` through `write`, which may take part of it (as
/// `write(2)`): on until it is all written, `NoSpace` when a call takes nothing.
pub(crate) fn write_whole(
    mut buf: &[u8],
    mut offset: u64,
    mut write: impl FnMut(&[u8], u64) -> Result<usize>,
) -> Result<()> {
    while !buf.is_empty() {
        let n = write(buf, offset)?;
        if n == 0 {
            return Err(Error::NoSpace);
        }
        buf = &buf[n..];
        offset += n as u64;
    }
    Ok(())
}

/// EPERM when `inode` may not change because of its flags (as `what`): an immutable
/// inode takes no change at all; an append-only one only what `append_ok` allows
/// (appends, new times, names added to a directory). The kernel's VFS checks these on
/// its own inodes, but over FUSE it cannot see them, so every engine operation does.
pub(crate) fn may_change(inode: &Inode, what: &str, append_ok: bool) -> Result<()> {
    if inode.flags & flags::IMMUTABLE != 0 {
        return Err(Error::NotPermitted(format!(
            "{what}: the inode is immutable"
        )));
    }
    if !append_ok && inode.flags & flags::APPEND != 0 {
        return Err(Error::NotPermitted(format!(
            "{what}: the inode is append-only"
        )));
    }
    Ok(())
}

/// fallocate(2) takes regular files only: EISDIR for a directory, EINVAL otherwise.
fn falloc_target(inode: &Inode) -> Result<()> {
    if inode.is_reg() {
        return Ok(());
    }
    Err(if inode.is_dir() {
        Error::IsADirectory
    } else {
        Error::InvalidInput("fallocate of a non-regular file".into())
    })
}

/// fallocate(2) modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallocMode {
    /// Allocate (as unwritten) and extend the size.
    Allocate,
    /// Allocate without changing the size (FALLOC_FL_KEEP_SIZE).
    KeepSize,
    /// Deallocate the range; size unchanged (PUNCH_HOLE | KEEP_SIZE).
    PunchHole,
    /// Make the range read as zeros, allocated; `keep_size` as KEEP_SIZE.
    ZeroRange { keep_size: bool },
    /// Remove the range and move everything after it down (COLLAPSE_RANGE): offset
    /// and length whole blocks, the range ending before the end of the file.
    CollapseRange,
    /// Move everything from the offset up by the length, leaving a hole there
    /// (INSERT_RANGE): offset and length whole blocks, the offset inside the file.
    InsertRange,
}

/// statfs(2) figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    pub blocks: u64,
    pub blocks_free: u64,
    /// Free blocks available to unprivileged users (minus the reserve).
    pub blocks_available: u64,
    pub inodes: u64,
    pub inodes_free: u64,
    pub name_max: u32,
}

fn dirent_type(mode: u16) -> DirFt {
    DirFt::from_mode(mode)
}

/// The set behind `m`, whether or not a panicking thread poisoned it.
pub(crate) fn lock_set(
    m: &std::sync::Mutex<crate::inthash::IntSet<Ino>>,
) -> std::sync::MutexGuard<'_, crate::inthash::IntSet<Ino>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(Error::InvalidInput(format!(
            "invalid file name {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(())
}

impl Fs {
    /// Directory `dir` for a change by the block-directory code: an inline directory
    /// is converted to a block first (in the caller's handle, under its lock).
    fn dir_handle(&self, dir: Ino) -> Result<FsDir<'_>> {
        let mut d = self.dir_view(dir)?;
        if d.inode.has_flag(flags::INLINE_DATA) {
            self.check_writable()?;
            self.uninline_dir(&mut d)?;
        }
        Ok(d)
    }

    /// Directory `dir` as it is (an inline one stays inline: its callers handle it).
    fn dir_view(&self, dir: Ino) -> Result<FsDir<'_>> {
        let inode = self.read_live_inode(dir)?;
        if !inode.is_dir() {
            return Err(Error::NotADirectory);
        }
        if inode.links_count == 0 {
            // Removed, still referenced (a FUSE lookup, a walk that raced the rmdir):
            // no name is added to or taken from it (the kernel's IS_DEADDIR, ENOENT).
            return Err(Error::NotFound);
        }
        Ok(FsDir {
            fs: self,
            ino: dir,
            inode,
            dirty: false,
        })
    }

    /// Directory `parent`, for adding `name`: the fs must be writable, `parent` a
    /// directory. Whether `name` is in it already, the dentry cache answers when it
    /// knows; otherwise the insert finds out (`link_into`: EEXIST, nothing changed), in
    /// the walk of the leaf that adds the entry — a lookup first walked it twice. A
    /// refusal on the way there passes through [`Fs::exists_first`]. Caller holds the
    /// directory's inode lock.
    fn dir_for_new_name(&self, parent: Ino, name: &[u8]) -> Result<FsDir<'_>> {
        self.check_writable()?;
        let d = self.dir_view(parent)?;
        if name == b"." || name == b".." {
            return Err(Error::Exists);
        }
        let dname = self.dent_name(parent, name)?;
        let known = self.inner.caches.dentries.get(&DentRef {
            dir: parent.0,
            name: &dname,
        });
        if matches!(known, Some(Some(_))) {
            return Err(Error::Exists);
        }
        self.exists_first(parent, name, may_change(&d.inode, "add a name", true))?;
        Ok(d)
    }

    /// `r`, unless it is an error and `name` is in `parent`: EEXIST then, as when the
    /// name is looked up before anything else (a create that finds no free inode, no
    /// permission or no room reports an existing name as existing).
    fn exists_first<T>(&self, parent: Ino, name: &[u8], r: Result<T>) -> Result<T> {
        match r {
            Err(e) if !matches!(e, Error::Exists) => match self.lookup(parent, name) {
                Ok(Some(_)) => Err(Error::Exists),
                _ => Err(e),
            },
            r => r,
        }
    }

    fn dir_index(&self) -> bool {
        self.inner.sb.has_compat(feature::COMPAT_DIR_INDEX)
    }

    /// Tell the dentry cache what `dir`'s entry `name` is after a change that returned
    /// `r` (`now`: the entry if it succeeded). A failed change may have done part of
    /// its work, so the entry is dropped then. Call after the directory blocks changed.
    fn dent_changed<T>(&self, dir: Ino, name: &[u8], r: &Result<T>, now: Dent) {
        let dc = &self.inner.caches.dentries;
        let Ok(dname) = self.dent_name(dir, name) else {
            // The directory cannot be read: forget everything cached about it.
            dc.invalidate_where(|k| k.dir == dir.0);
            return;
        };
        if r.is_ok() {
            dc.set(
                DentKey {
                    dir: dir.0,
                    name: (*dname).into(),
                },
                now,
            );
        } else {
            dc.invalidate(&DentRef {
                dir: dir.0,
                name: &dname,
            });
        }
    }

    /// Add `name -> ino` to directory `dir`, updating its times. On failure the
    /// directory's record is written as the steps that did complete left it (a
    /// block appended, an index level added before a later step ran out of space):
    /// every step leaves the directory well formed, but only with its size and
    /// extent root on disk too.
    fn link_into(&self, d: &mut FsDir<'_>, name: &[u8], ino: Ino, mode: u16) -> Result<()> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            // In the inode while it has room, else converted to a block first.
            let r = self.inline_add_entry(d, name, ino, dirent_type(mode));
            if !matches!(r, Ok(false)) {
                self.dent_changed(d.ino, name, &r, Some((ino.0, dirent_type(mode) as u8)));
                r?;
                d.dirty = true;
                return Ok(());
            }
            self.uninline_dir(d)?;
        }
        let r = dir_write::add_new_entry(d, name, ino.0, dirent_type(mode), self.dir_index());
        self.dent_changed(d.ino, name, &r, Some((ino.0, dirent_type(mode) as u8)));
        if r.is_err() && d.dirty {
            self.write_inode(d.ino, &d.inode)?;
            d.dirty = false;
        }
        r?;
        let t = self.now();
        d.inode.mtime = t;
        d.inode.ctime = t;
        d.dirty = true;
        Ok(())
    }

    /// Remove `name` from directory `d`, inline or not: the (inode, type) it named.
    fn dir_remove(&self, d: &mut FsDir<'_>, name: &[u8]) -> Result<Option<(u32, u8)>> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            return self.inline_remove_entry(d, name, None);
        }
        dir_write::remove_entry(d, name)
    }

    /// Add `name -> ino` to directory `d` (a rename's new name): in place in an
    /// inline directory while it has room, else after converting it.
    fn dir_add(&self, d: &mut FsDir<'_>, name: &[u8], ino: Ino, ft: DirFt) -> Result<()> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            if self.inline_add_entry(d, name, ino, ft)? {
                return Ok(());
            }
            self.uninline_dir(d)?;
        }
        dir_write::add_entry(d, name, ino.0, ft, self.dir_index())
    }

    /// Point `name` of directory `d` (inline or not) at `ino`.
    fn dir_replace(
        &self,
        d: &mut FsDir<'_>,
        name: &[u8],
        ino: Ino,
        ft: DirFt,
    ) -> Result<Option<u32>> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            return self.inline_replace_entry(d, name, ino, ft);
        }
        dir_write::replace_entry(d, name, ino.0, ft)
    }

    /// Set ".." of directory `d` (inline or not).
    fn dir_set_parent(&self, d: &mut FsDir<'_>, parent: Ino) -> Result<()> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            return self.inline_set_parent(d, parent.0);
        }
        dir_write::set_dotdot(d, parent.0)
    }

    /// Whether directory `d` (inline or not) has no entry but "." and "..".
    fn dir_empty(&self, d: &FsDir<'_>) -> Result<bool> {
        if d.inode.has_flag(flags::INLINE_DATA) {
            return self.inline_dir_is_empty(d.ino, &d.inode);
        }
        dir_write::is_empty(d)
    }

    fn finish_dir(&self, d: FsDir<'_>) -> Result<()> {
        if d.dirty {
            self.write_inode(d.ino, &d.inode)?;
        }
        Ok(())
    }

    fn inc_dir_links(inode: &mut Inode) {
        // dir_nlink: past the limit the count sticks at 1 ("many").
        if inode.links_count >= LINK_MAX - 1 || inode.links_count == 1 {
            inode.links_count = 1;
        } else {
            inode.links_count += 1;
        }
    }

    fn dec_dir_links(inode: &mut Inode) {
        if inode.links_count > 2 {
            inode.links_count -= 1;
        }
    }

    /// Create a non-directory inode (regular file, fifo, socket, device) named `name`
    /// in `parent`. `mode` holds the type and permission bits.
    pub fn mknod_ino(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: (u32, u32),
    ) -> Result<Ino> {
        self.mknod_pinning(parent, name, mode, (uid, gid), rdev, false)
    }

    /// [`Fs::mknod_ino`], the new inode pinned (when `pin`) before its directory is
    /// unlocked: an unlink of the new name then leaves an orphan for the caller's
    /// reference, never frees the inode under it (open with O_CREAT).
    pub(crate) fn mknod_pinning(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        (uid, gid): (u32, u32),
        rdev: (u32, u32),
        pin: bool,
    ) -> Result<Ino> {
        check_name(name)?;
        let mut mode = mode as u16;
        let ft = mode & m::S_IFMT;
        if ![m::S_IFREG, m::S_IFIFO, m::S_IFSOCK, m::S_IFCHR, m::S_IFBLK].contains(&ft) {
            return Err(Error::InvalidInput(
                "mknod of an unsupported file type".into(),
            ));
        }
        let _h = self.handle();
        // An htree is taken shared: creates and unlinks of names in different leaves go
        // on beside each other (`link_in_leaf`); another directory, or a create that
        // needs more than its name's leaf, takes the directory whole.
        let mut shared = self.is_htree(parent).then(|| self.lock_dir_shared(parent));
        let mut whole = shared.is_none().then(|| self.lock_dir(parent));
        let mut d = self.dir_for_new_name(parent, name)?;
        let inherited = self.inherit_acl(&d.inode, parent, &mut mode);
        let inherited = self.exists_first(parent, name, inherited)?;
        let ino = self.exists_first(parent, name, self.alloc_inode(parent, false))?;
        // Nobody knows the number yet; its lock keeps an unlink of the new name (beside
        // this create, the directory shared) out until the inode is pinned.
        let mut own = shared.is_some().then(|| self.lock_nondir(ino));
        let mut written = false;
        let made = (|| {
            let mut inode = self.new_inode(mode, uid, gid);
            if ft == m::S_IFREG {
                self.map_by_extents(&mut inode);
            }
            if ft == m::S_IFCHR || ft == m::S_IFBLK {
                inode.set_device(rdev.0, rdev.1);
            }
            self.write_new_inode(ino, &inode)?;
            written = true;
            self.store_inherited(ino, inherited)?;
            if whole.is_some() {
                self.link_into(&mut d, name, ino, mode)?;
                return Ok(true);
            }
            self.link_in_leaf(&mut d, name, ino, mode)
        })();
        let made = match made {
            Ok(false) => {
                // No room in the name's leaf, or no one leaf for it: the whole
                // directory, exclusively.
                own = None;
                shared = None;
                whole = Some(self.lock_dir(parent));
                self.dir_for_new_name(parent, name).and_then(|mut whole_d| {
                    self.link_into(&mut whole_d, name, ino, mode)?;
                    d = whole_d;
                    Ok(())
                })
            }
            other => other.map(drop),
        };
        let kept = self.keep_or_abandon(ino, false, written, made);
        self.exists_first(parent, name, kept)?;
        if whole.is_some() {
            self.finish_dir(d)?;
        }
        if pin {
            self.pin(ino);
        }
        if shared.is_some() {
            self.touch_dir(parent)?;
        }
        drop((own, shared, whole));
        Ok(ino)
    }

    /// Whether directory `dir` is an htree (hashed index) — read before its lock is
    /// taken, so a hint to choose the lock by: one that became an htree meanwhile is
    /// taken whole when a create or unlink finds no single leaf to change.
    fn is_htree(&self, dir: Ino) -> bool {
        self.dir_index()
            && self
                .read_live_inode(dir)
                .is_ok_and(|i| i.has_flag(flags::INDEX))
    }

    /// Link `name -> ino` into the one leaf of `d` that can take it
    /// (`dir_write::only_leaf_for`), under that leaf's block lock — the directory held
    /// shared, other creates and unlinks change other leaves meanwhile — and tell the
    /// dentry cache under the same lock, so it sees the changes to one name in their
    /// order. False (nothing changed) when there is no such leaf or no room in it.
    fn link_in_leaf(&self, d: &mut FsDir<'_>, name: &[u8], ino: Ino, mode: u16) -> Result<bool> {
        let Some(leaf) = dir_write::only_leaf_for(d, name)? else {
            return Ok(false);
        };
        let _l = self.block_lock(d.phys(leaf)?);
        let r = dir_write::add_to_leaf(d, leaf, name, ino.0, dirent_type(mode));
        if !matches!(r, Ok(false)) {
            self.dent_changed(d.ino, name, &r, Some((ino.0, dirent_type(mode) as u8)));
        }
        r
    }

    /// A name was added to or removed from directory `dir` (its inode lock held shared,
    /// see `link_in_leaf`): its mtime and ctime become now, as one change of its
    /// record among the others' (`Fs::change_inode_record`).
    fn touch_dir(&self, dir: Ino) -> Result<()> {
        self.change_inode_record(dir, |i| {
            let t = self.now();
            i.mtime = t;
            i.ctime = t;
        })
    }

    /// Create an unnamed regular file in directory `parent` (O_TMPFILE): an inode with
    /// no links, on the orphan list from the start as ext4 puts it (a crash frees it at
    /// the next read-write open), which gets a name only through [`Fs::link_ino`] — and
    /// not even then when `excl` (O_TMPFILE | O_EXCL). It comes back pinned once: the
    /// caller owns that reference, whose last [`Fs::unpin`] frees a file still unnamed.
    /// `mode` holds S_IFREG (or no type) and the permission bits.
    pub fn tmpfile_ino(
        &self,
        parent: Ino,
        mode: u32,
        uid: u32,
        gid: u32,
        excl: bool,
    ) -> Result<Ino> {
        let mut mode = mode as u16;
        match mode & m::S_IFMT {
            0 => mode |= m::S_IFREG,
            m::S_IFREG => {}
            _ => {
                return Err(Error::InvalidInput(
                    "an unnamed file must be a regular file".into(),
                ))
            }
        }
        // A handle: the directory is only read (its default ACL), under its lock
        // shared (no ACL change meanwhile); the new inode is nobody else's until it is
        // returned, and goes on the orphan list under that list's lock.
        let _h = self.handle();
        let _p = self.lock_dir_shared(parent);
        self.check_writable()?;
        let d = self.dir_view(parent)?;
        may_change(&d.inode, "add a name", true)?;
        let inherited = self.inherit_acl(&d.inode, parent, &mut mode)?;
        let ino = self.alloc_inode(parent, false)?;
        let mut written = false;
        let made = (|| {
            let mut inode = self.new_inode(mode, uid, gid);
            inode.links_count = 0;
            self.map_by_extents(&mut inode);
            self.write_new_inode(ino, &inode)?;
            written = true;
            self.store_inherited(ino, inherited)?;
            let inode = self.orphan_add(ino, self.read_inode(ino)?)?;
            self.write_inode(ino, &inode)
        })();
        self.keep_or_abandon(ino, false, written, made)?;
        self.pin(ino);
        if !excl {
            lock_set(&self.inner.linkable).insert(ino);
        }
        Ok(ino)
    }

    /// After the steps that make new inode `ino` and link it: on success keep it; on
    /// failure (ENOSPC growing the directory, a block-mapped parent, an I/O error) free
    /// it with whatever it got, so no unattached inode is left, and return the error.
    /// `written` says whether the new record reached the inode table: until it did, the
    /// slot holds whatever inode used the number before (a freed directory, say),
    /// whose blocks and type are not this inode's.
    fn keep_or_abandon(
        &self,
        ino: Ino,
        is_dir: bool,
        written: bool,
        made: Result<()>,
    ) -> Result<()> {
        let Err(e) = made else {
            return Ok(());
        };
        // Best effort: the first error is the one to report.
        let _ = match self.read_inode(ino) {
            Ok(i) if written && i.mode != 0 => self.free_inode_and_blocks(ino, i),
            _ => self.free_inode(ino, is_dir),
        };
        Err(e)
    }

    /// Create a directory.
    pub fn mkdir_ino(
        &self,
        parent: Ino,
        name: &[u8],
        perm: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Ino> {
        check_name(name)?;
        let _h = self.handle();
        let _p = self.lock_dir(parent);
        let mut pd = self.dir_for_new_name(parent, name)?;
        if pd.inode.links_count >= LINK_MAX
            && !self.inner.sb.has_ro_compat(feature::RO_COMPAT_DIR_NLINK)
        {
            return self.exists_first(parent, name, Err(Error::TooManyLinks));
        }
        let mut mode = m::S_IFDIR | (perm as u16 & 0o7777);
        let inherited = self.inherit_acl(&pd.inode, parent, &mut mode);
        let inherited = self.exists_first(parent, name, inherited)?;
        let ino = self.exists_first(parent, name, self.alloc_inode(parent, true))?;
        let mut written = false;
        let made = (|| {
            let mut inode = self.new_inode(mode, uid, gid);
            inode.links_count = 2;
            // A casefolded directory's subdirectories are casefolded (EXT4_FL_INHERITED).
            inode.flags |= pd.inode.flags & flags::CASEFOLD;
            self.map_by_extents(&mut inode);
            self.write_new_inode(ino, &inode)?;
            written = true;
            let mut nd = FsDir {
                fs: self,
                ino,
                inode,
                dirty: true,
            };
            // inline_data: a new directory starts in its inode, as the kernel's.
            if !self.create_inline_dir(&mut nd, parent)? {
                nd.append_block_checked()?;
                dir_write::init_dir(&mut nd, ino.0, parent.0)?;
            }
            self.finish_dir(nd)?;
            self.store_inherited(ino, inherited)?;
            self.link_into(&mut pd, name, ino, mode)
        })();
        let kept = self.keep_or_abandon(ino, true, written, made);
        self.exists_first(parent, name, kept)?;
        Self::inc_dir_links(&mut pd.inode);
        self.finish_dir(pd)?;
        Ok(ino)
    }

    /// Create a symbolic link `name -> target` in `parent`.
    pub fn symlink_ino(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Ino> {
        check_name(name)?;
        let bs = self.inner.block_size as usize;
        if target.is_empty() || target.contains(&0) {
            return Err(Error::InvalidInput("bad symlink target".into()));
        }
        if target.len() >= bs.min(4096) {
            return Err(Error::NameTooLong);
        }
        let _h = self.handle();
        let _p = self.lock_dir(parent);
        let mut d = self.dir_for_new_name(parent, name)?;
        let ino = self.exists_first(parent, name, self.alloc_inode(parent, false))?;
        let mut written = false;
        let made = (|| {
            let mut inode = self.new_inode(m::S_IFLNK | 0o777, uid, gid);
            inode.size = target.len() as u64;
            if target.len() < 60 {
                inode.block[..target.len()].copy_from_slice(target);
                self.write_new_inode(ino, &inode)?;
                written = true;
            } else {
                // A slow symlink: one block, mapped as the filesystem maps new files
                // (the kernel's ext4_new_inode).
                self.map_by_extents(&mut inode);
                let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
                let (p, _) = map_new_blocks(self, ino, &mut inode, 0, 1, false, &mut alloc)?;
                // Recorded first, so that a failure below frees the block with it.
                self.write_new_inode(ino, &inode)?;
                written = true;
                let mut data = vec![0u8; bs];
                data[..target.len()].copy_from_slice(target);
                self.cache().device().write_at(&data, p * bs as u64)?;
            }
            self.link_into(&mut d, name, ino, m::S_IFLNK)
        })();
        let kept = self.keep_or_abandon(ino, false, written, made);
        self.exists_first(parent, name, kept)?;
        self.finish_dir(d)?;
        Ok(ino)
    }

    /// Add a hard link `new_parent/new_name` to `ino` (not a directory). A handle,
    /// under the new parent's inode lock and then the inode's; an unnamed file (no
    /// links, O_TMPFILE) leaves the orphan list, whose legacy chain runs through other
    /// inodes' records, under the write lock instead.
    pub fn link_ino(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<()> {
        check_name(new_name)?;
        if self.read_live_inode(ino)?.links_count == 0 {
            return self.link_unnamed(ino, new_parent, new_name);
        }
        let _h = self.handle();
        let _p = self.lock_dir(new_parent);
        let mut d = self.dir_for_new_name(new_parent, new_name)?;
        // No inode number freed while this guard lives is handed out again: the inode
        // locked below as a non-directory is the one whose kind is read here (a number
        // reused by a directory could be held by one waiting for `new_parent`).
        let g = self.read_guard();
        // The kernel looks the new name up first: EEXIST before any other refusal.
        let not_dir = self.read_live_inode(ino).and_then(|i| match i.is_dir() {
            // link(2): EPERM.
            true => Err(Error::NotPermitted(
                "hard links to directories are not allowed".into(),
            )),
            false => Ok(()),
        });
        self.exists_first(new_parent, new_name, not_dir)?;
        let _c = self.lock_nondir(ino);
        drop(g);
        let inode = self.read_live_inode(ino).and_then(|i| {
            may_change(&i, "link", false)?;
            match i.links_count {
                // Unlinked meanwhile: gone (an unnamed file never comes this way).
                0 => Err(Error::NotFound),
                n if n >= LINK_MAX => Err(Error::TooManyLinks),
                _ => Ok(i),
            }
        });
        let mut inode = self.exists_first(new_parent, new_name, inode)?;
        self.link_into(&mut d, new_name, ino, inode.mode)?;
        inode.links_count += 1;
        inode.ctime = self.now();
        self.write_inode(ino, &inode)?;
        self.finish_dir(d)
    }

    /// [`Fs::link_ino`] of a file with no links: only an unnamed file made to be linked
    /// (O_TMPFILE without O_EXCL) may get a name back, leaving the orphan list; any
    /// other is gone (the kernel's ENOENT).
    fn link_unnamed(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<()> {
        let _w = self.write_lock();
        self.check_writable()?;
        let mut inode = self.read_live_inode(ino)?;
        if inode.is_dir() {
            return Err(Error::NotPermitted(
                "hard links to directories are not allowed".into(),
            ));
        }
        let unnamed = inode.links_count == 0;
        if unnamed && !lock_set(&self.inner.linkable).contains(&ino) {
            return Err(Error::NotFound);
        }
        let mut d = self.dir_view(new_parent)?;
        if self.lookup(new_parent, new_name)?.is_some() {
            return Err(Error::Exists);
        }
        may_change(&inode, "link", false)?;
        may_change(&d.inode, "add a name", true)?;
        if inode.links_count >= LINK_MAX {
            return Err(Error::TooManyLinks);
        }
        self.link_into(&mut d, new_name, ino, inode.mode)?;
        if unnamed {
            self.orphan_remove(ino, &inode)?;
            inode.dtime = 0;
            lock_set(&self.inner.linkable).remove(&ino);
        }
        inode.links_count += 1;
        inode.ctime = self.now();
        self.write_inode(ino, &inode)?;
        self.finish_dir(d)
    }

    /// Remove the non-directory `name` from `parent`.
    pub fn unlink_ino(&self, parent: Ino, name: &[u8]) -> Result<()> {
        let r = self.unlink_in_handle(parent, name);
        // A file too large to free in the handle was left an orphan: freed now.
        r.and(self.free_deferred())
    }

    fn unlink_in_handle(&self, parent: Ino, name: &[u8]) -> Result<()> {
        check_name(name)?;
        let _h = self.handle();
        if self.is_htree(parent) {
            let _p = self.lock_dir_shared(parent);
            if self.unlink_in_leaf(parent, name)? {
                return Ok(());
            }
        }
        let _p = self.lock_dir(parent);
        self.check_writable()?;
        let mut d = self.dir_view(parent)?;
        let e = self.lookup(parent, name)?.ok_or(Error::NotFound)?;
        // A directory is refused before its lock is taken: a non-directory's lock is
        // the last of the order, and a directory's holder may wait for this parent.
        // (Its flags are checked first, unlocked, for the kernel's order of errors.)
        if e.file_type == crate::FileType::Dir {
            may_change(&d.inode, "remove a name", false)?;
            may_change(&self.read_live_inode(e.ino)?, "unlink", false)?;
            return Err(Error::IsADirectory);
        }
        let _c = self.lock_nondir(self.not_itself(parent, e.ino)?);
        let inode = self.read_live_inode(e.ino)?;
        may_change(&d.inode, "remove a name", false)?;
        may_change(&inode, "unlink", false)?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        let r = self.dir_remove(&mut d, name);
        self.dent_changed(parent, name, &r, None);
        r?;
        let t = self.now();
        d.inode.mtime = t;
        d.inode.ctime = t;
        d.dirty = true;
        self.finish_dir(d)?;
        self.drop_link(e.ino, inode)
    }

    /// [`Fs::unlink_ino`] with `parent`'s inode lock shared: the name's entry removed
    /// from the one leaf that holds it (`dir_write::only_leaf_for`), under that leaf's
    /// block lock, with the dentry cache told under it (see `link_in_leaf`). False
    /// (nothing changed) when the whole directory is needed: a directory is named (for
    /// the exclusive path's order of errors), there is no one leaf for the name, or the
    /// name no longer names the inode looked up.
    fn unlink_in_leaf(&self, parent: Ino, name: &[u8]) -> Result<bool> {
        self.check_writable()?;
        let mut d = self.dir_handle(parent)?;
        let e = self.lookup(parent, name)?.ok_or(Error::NotFound)?;
        if e.file_type == crate::FileType::Dir {
            return Ok(false);
        }
        let Some(leaf) = dir_write::only_leaf_for(&d, name)? else {
            return Ok(false);
        };
        let _c = self.lock_nondir(self.not_itself(parent, e.ino)?);
        // Another unlink of the name (beside this one) may have freed the inode while
        // this one waited for its lock: the name must still name it.
        if self.lookup(parent, name)?.map(|now| now.ino) != Some(e.ino) {
            return Ok(false);
        }
        let inode = self.read_live_inode(e.ino)?;
        may_change(&d.inode, "remove a name", false)?;
        may_change(&inode, "unlink", false)?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        let removed = {
            let _l = self.block_lock(d.phys(leaf)?);
            let r = dir_write::remove_from_leaf(&mut d, leaf, name, e.ino.0);
            if !matches!(r, Ok(None)) {
                self.dent_changed(parent, name, &r, None);
            }
            r?
        };
        if removed.is_none() {
            return Ok(false);
        }
        self.touch_dir(parent)?;
        self.drop_link(e.ino, inode)?;
        Ok(true)
    }

    /// One link of `ino` went away: update it, or free it with the last link.
    fn drop_link(&self, ino: Ino, mut inode: Inode) -> Result<()> {
        inode.links_count = inode.links_count.saturating_sub(1);
        inode.ctime = self.now();
        if inode.links_count > 0 {
            return self.write_inode(ino, &inode);
        }
        self.release_unlinked(ino, inode)
    }

    /// An inode lost its last name: free it, or — while referenced (open handles, FUSE
    /// lookups) — make it an orphan that the last reference frees.
    fn release_unlinked(&self, ino: Ino, mut inode: Inode) -> Result<()> {
        inode.links_count = 0;
        let pinned = self.is_pinned(ino);
        if pinned || self.too_big_for_a_handle(&inode) {
            let inode = self.orphan_add(ino, inode)?;
            if !pinned {
                // Freed in parts once this handle is gone (`orphan`'s module note).
                self.inner
                    .deferred_frees
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(ino);
            }
            return self.write_inode(ino, &inode);
        }
        self.free_inode_and_blocks(ino, inode)
    }

    /// Free `ino` (links_count 0, on no orphan list) and its blocks in the running
    /// transaction (a handle's: the file is small enough, see `too_big_for_a_handle`).
    pub(crate) fn free_inode_and_blocks(&self, ino: Ino, inode: Inode) -> Result<()> {
        self.free_inode_parts(ino, inode, false)
    }

    /// [`Fs::free_inode_and_blocks`] committing between parts where the file is too
    /// large for one transaction, on the orphan list meanwhile. Caller holds the write
    /// lock and the inode's I/O lock exclusively.
    pub(crate) fn free_inode_and_blocks_in_parts(&self, ino: Ino, inode: Inode) -> Result<()> {
        self.free_inode_parts(ino, inode, true)
    }

    fn free_inode_parts(&self, ino: Ino, mut inode: Inode, in_parts: bool) -> Result<()> {
        // Cached data goes with the inode (no writeback can be running: it pins).
        self.inner.pagecache.discard(ino);
        let is_dir = inode.is_dir();
        {
            // Removing extents may split one (a new leaf): from the pool if need be.
            // A block map frees its data and indirect blocks.
            let _c = crate::fs::space::claim_as(crate::fs::space::Claim::NoFail);
            if in_parts {
                let mut listed = false;
                self.unmap_tail_in_parts(ino, &mut inode, 0, &mut listed)?;
                if listed {
                    self.orphan_remove(ino, &inode)?;
                }
            } else {
                unmap_range(self, ino, &mut inode, 0, MAX_LOGICAL)?;
            }
        }
        if crate::fs::inode_write::uses_block_map(&inode) {
            inode.block = [0; 60];
        }
        self.release_xattrs(ino, &mut inode)?;
        inode.links_count = 0;
        inode.size = 0;
        inode.dtime = self.now().sec as u32;
        self.write_freed_inode(ino, &inode)?;
        self.free_inode(ino, is_dir)
    }

    /// Remove the empty directory `name` from `parent`.
    pub fn rmdir_ino(&self, parent: Ino, name: &[u8]) -> Result<()> {
        check_name(name)?;
        let _h = self.handle();
        // Two directories: the rename lock first (see `inode_locks`).
        let _r = self.rename_lock();
        let _p = self.lock_dir(parent);
        self.check_writable()?;
        let mut d = self.dir_view(parent)?;
        let e = self.lookup(parent, name)?.ok_or(Error::NotFound)?;
        let _c = self.lock_dir(self.not_itself(parent, e.ino)?);
        let child = self.dir_view(e.ino)?;
        may_change(&d.inode, "remove a name", false)?;
        may_change(&child.inode, "rmdir", false)?;
        if !self.dir_empty(&child)? {
            return Err(Error::NotEmpty);
        }
        let inode = child.inode;
        let r = self.dir_remove(&mut d, name);
        self.dent_changed(parent, name, &r, None);
        r?;
        Self::dec_dir_links(&mut d.inode);
        let t = self.now();
        d.inode.mtime = t;
        d.inode.ctime = t;
        d.dirty = true;
        self.finish_dir(d)?;
        self.release_unlinked(e.ino, inode)
    }

    /// `child`, named in directory `dir`, unless it is `dir` itself (a corrupted
    /// entry: its inode lock would be one this thread holds).
    fn not_itself(&self, dir: Ino, child: Ino) -> Result<Ino> {
        if child == dir {
            return Err(Error::corrupted(
                format!("directory {} has an entry for itself", dir.0),
                None,
            ));
        }
        Ok(child)
    }

    /// Is `anc` an ancestor of (or equal to) directory `dir`? Walks ".." to the root.
    fn is_ancestor(&self, anc: Ino, mut dir: Ino) -> Result<bool> {
        for _ in 0..self.inner.sb.inodes_count {
            if dir == anc {
                return Ok(true);
            }
            if dir == Ino::ROOT {
                return Ok(false);
            }
            let up = self.lookup(dir, b"..")?.ok_or_else(|| {
                Error::corrupted(format!("directory {} has no \"..\"", dir.0), None)
            })?;
            dir = up.ino;
        }
        Err(Error::corrupted(
            "\"..\" chain does not reach the root",
            None,
        ))
    }

    /// rename(2) / renameat2(2).
    pub fn rename_ino(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        fl: RenameFlags,
    ) -> Result<()> {
        let r = self.rename_in_handle(parent, name, new_parent, new_name, fl);
        // A replaced file too large to free in the handle was left an orphan.
        r.and(self.free_deferred())
    }

    fn rename_in_handle(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        fl: RenameFlags,
    ) -> Result<()> {
        check_name(name)?;
        check_name(new_name)?;
        if fl.exchange && (fl.noreplace || fl.whiteout.is_some()) {
            return Err(Error::InvalidInput(
                "RENAME_EXCHANGE with RENAME_NOREPLACE or RENAME_WHITEOUT".into(),
            ));
        }
        let _h = self.handle();
        if parent == new_parent {
            // Files renamed in one directory: its lock, then theirs (no rename lock,
            // as in the kernel).
            let _p = self.lock_dir(parent);
            let n = self.rename_names(parent, name, new_parent, new_name)?;
            if !n.src_inode.is_dir() && !n.dst.as_ref().is_some_and(|d| d.1.is_dir()) {
                let _c = self.lock_nondirs(n.src.ino, n.dst.as_ref().map(|d| d.0.ino));
                return self.rename_locked(fl, n);
            }
        }
        // A directory moves, goes or is exchanged, or two directories change: the
        // rename lock, then the parents, then the directories named (every thread
        // that holds two directories' locks holds the rename lock, so none waits for
        // another), then the files, in number order.
        let _r = self.rename_lock();
        let _p = self.lock_dir(parent);
        let _np = (new_parent != parent).then(|| self.lock_dir(new_parent));
        let n = self.rename_names(parent, name, new_parent, new_name)?;
        let src_ino = self.not_itself(parent, n.src.ino)?;
        let named = std::iter::once((src_ino, n.src_inode.is_dir()));
        let named = named.chain(n.dst.as_ref().map(|(e, i)| (e.ino, i.is_dir())));
        let (mut dirs, mut files) = (vec![parent, new_parent], Vec::new());
        let mut dir_locks = Vec::new();
        for (ino, is_dir) in named {
            if !is_dir {
                files.push(ino);
            } else if !dirs.contains(&ino) {
                // One of the parents itself (moved into itself, or an ancestor
                // replaced) is held already; the checks below refuse it.
                dirs.push(ino);
                dir_locks.push(self.lock_dir(ino));
            }
        }
        let _c = files
            .first()
            .map(|&a| self.lock_nondirs(a, files.get(1).copied()));
        self.rename_locked(fl, n)
    }

    /// What a rename names, looked up under its parents' locks: the source's entry and
    /// inode, the destination's when there is one, and both parents' inodes.
    fn rename_names<'a>(
        &self,
        parent: Ino,
        name: &'a [u8],
        new_parent: Ino,
        new_name: &'a [u8],
    ) -> Result<RenameNames<'a>> {
        self.check_writable()?;
        let od = self.dir_view(parent)?.inode;
        let nd = self.dir_view(new_parent)?.inode;
        let src = self.lookup(parent, name)?.ok_or(Error::NotFound)?;
        let dst = self.lookup(new_parent, new_name)?;
        let src_inode = self.read_live_inode(src.ino)?;
        let dst = dst
            .map(|e| self.read_live_inode(e.ino).map(|i| (e, i)))
            .transpose()?;
        Ok(RenameNames {
            parent,
            name,
            new_parent,
            new_name,
            od,
            nd,
            src,
            src_inode,
            dst,
        })
    }

    /// [`Fs::rename_ino`] with every lock it needs held.
    fn rename_locked(&self, fl: RenameFlags, n: RenameNames<'_>) -> Result<()> {
        let RenameNames {
            parent,
            name,
            new_parent,
            new_name,
            od,
            nd,
            src,
            src_inode,
            dst: named,
        } = n;
        let dst = named.as_ref().map(|d| &d.0);
        let src_dir = src_inode.is_dir();
        // Moving a name away is removing it; replacing one removes the old one too.
        may_change(&od, "remove a name", false)?;
        may_change(&nd, "add a name", dst.is_none())?;
        may_change(&src_inode, "rename", false)?;
        if let Some((dst, di)) = &named {
            if dst.ino != src.ino {
                may_change(di, "replace", false)?;
            }
        }
        // Checks in the order Linux makes them (do_renameat2, vfs_rename).
        if fl.exchange && dst.is_none() {
            return Err(Error::NotFound);
        }
        if fl.noreplace && dst.is_some() {
            return Err(Error::Exists);
        }
        if src_dir && self.is_ancestor(src.ino, new_parent)? {
            return Err(Error::InvalidInput(
                "cannot move a directory into itself".into(),
            ));
        }
        if let Some((dst, dst_inode)) = &named {
            if dst.ino == src.ino {
                return Ok(()); // the same inode: POSIX says do nothing
            }
            if fl.exchange {
                if dst_inode.is_dir() && self.is_ancestor(dst.ino, parent)? {
                    return Err(Error::InvalidInput(
                        "cannot move a directory into itself".into(),
                    ));
                }
                return self.exchange(parent, name, src.ino, new_parent, new_name, dst.ino);
            }
            match (src_dir, dst_inode.is_dir()) {
                (true, false) => return Err(Error::NotADirectory),
                (false, true) => return Err(Error::IsADirectory),
                (true, true) => {
                    let dd = FsDir {
                        fs: self,
                        ino: dst.ino,
                        inode: dst_inode.clone(),
                        dirty: false,
                    };
                    if !self.dir_empty(&dd)? {
                        return Err(Error::NotEmpty);
                    }
                }
                (false, false) => {}
            }
        }
        // Preconditions hold: change things. The whiteout first, as ext4 makes it: when
        // it cannot be made (no free inode) nothing has changed yet.
        let whiteout = match fl.whiteout {
            Some((uid, gid)) => Some(self.new_whiteout(parent, uid, gid)?),
            None => None,
        };
        let t = self.now();
        let mut victim = None;
        let added = (|| {
            let mut nd = self.dir_view(new_parent)?;
            let now = Some((src.ino.0, dirent_type(src_inode.mode) as u8));
            match &dst {
                Some(dst) => {
                    let r =
                        self.dir_replace(&mut nd, new_name, src.ino, dirent_type(src_inode.mode));
                    self.dent_changed(new_parent, new_name, &r, now);
                    r?;
                    victim = Some(dst.ino);
                }
                None => {
                    let r = self.dir_add(&mut nd, new_name, src.ino, dirent_type(src_inode.mode));
                    self.dent_changed(new_parent, new_name, &r, now);
                    if r.is_err() && nd.dirty {
                        // As in `link_into`: the completed steps' record.
                        self.write_inode(new_parent, &nd.inode)?;
                    }
                    r?;
                    if src_dir && parent != new_parent {
                        Self::inc_dir_links(&mut nd.inode);
                    }
                }
            }
            nd.inode.mtime = t;
            nd.inode.ctime = t;
            nd.dirty = true;
            self.finish_dir(nd)
        })();
        match whiteout {
            // The new name could not be added (no room to grow the directory): the
            // whiteout goes again.
            Some(w) => self.keep_or_abandon(w, false, true, added)?,
            None => added?,
        }
        {
            let mut od = self.dir_view(parent)?;
            let r = match whiteout {
                Some(w) => self
                    .dir_replace(&mut od, name, w, DirFt::CharDevice)
                    .map(drop),
                None => self.dir_remove(&mut od, name).map(drop),
            };
            let now = whiteout.map(|w| (w.0, DirFt::CharDevice as u8));
            self.dent_changed(parent, name, &r, now);
            r?;
            if src_dir && (parent != new_parent || victim.is_some()) {
                Self::dec_dir_links(&mut od.inode);
            }
            od.inode.mtime = t;
            od.inode.ctime = t;
            od.dirty = true;
            self.finish_dir(od)?;
        }
        if src_dir && parent != new_parent {
            let mut sd = self.dir_view(src.ino)?;
            self.dir_set_parent(&mut sd, new_parent)?;
            sd.inode.ctime = t;
            sd.dirty = true;
            self.finish_dir(sd)?;
        } else {
            let mut si = self.read_live_inode(src.ino)?;
            si.ctime = t;
            self.write_inode(src.ino, &si)?;
        }
        if let Some(v) = victim {
            let vi = self.read_live_inode(v)?;
            if vi.is_dir() {
                // The moved directory's link replaces the victim's in new_parent.
                self.release_unlinked(v, vi)?;
            } else {
                self.drop_link(v, vi)?;
            }
        }
        Ok(())
    }

    /// A new whiteout inode for a rename out of directory `parent` (caller holds the
    /// write lock): a character device 0:0 with mode 0, one link (the source name,
    /// which the rename points at it).
    fn new_whiteout(&self, parent: Ino, uid: u32, gid: u32) -> Result<Ino> {
        let ino = self.alloc_inode(parent, false)?;
        let mut inode = self.new_inode(m::S_IFCHR, uid, gid);
        inode.set_device(0, 0);
        let made = self.write_new_inode(ino, &inode);
        self.keep_or_abandon(ino, false, made.is_ok(), made)?;
        Ok(ino)
    }

    fn exchange(&self, p1: Ino, n1: &[u8], i1: Ino, p2: Ino, n2: &[u8], i2: Ino) -> Result<()> {
        let a = self.read_live_inode(i1)?;
        let b = self.read_live_inode(i2)?;
        let t = self.now();
        // Each parent now names the other inode; across parents, a directory moving
        // out takes a link from its old parent and gives one to the new.
        for (p, name, new_ino, now, was, other) in
            [(p1, n1, i2, &b, &a, p2), (p2, n2, i1, &a, &b, p1)]
        {
            let mut d = self.dir_view(p)?;
            let r = self.dir_replace(&mut d, name, new_ino, dirent_type(now.mode));
            self.dent_changed(p, name, &r, Some((new_ino.0, dirent_type(now.mode) as u8)));
            r?;
            d.inode.mtime = t;
            d.inode.ctime = t;
            d.dirty = true;
            if p != other {
                if was.is_dir() && !now.is_dir() {
                    Self::dec_dir_links(&mut d.inode);
                } else if now.is_dir() && !was.is_dir() {
                    Self::inc_dir_links(&mut d.inode);
                }
            }
            self.finish_dir(d)?;
        }
        for (ino, newp) in [(i1, p2), (i2, p1)] {
            let inode = self.read_live_inode(ino)?;
            if inode.is_dir() && p1 != p2 {
                let mut sd = self.dir_view(ino)?;
                self.dir_set_parent(&mut sd, newp)?;
                sd.inode.ctime = t;
                sd.dirty = true;
                self.finish_dir(sd)?;
            } else {
                let mut i = inode;
                i.ctime = t;
                self.write_inode(ino, &i)?;
            }
        }
        Ok(())
    }

    /// chmod/chown/utimens/truncate in one call (like FUSE setattr). Without a size,
    /// one record changes: a handle under the inode's own lock, beside other
    /// operations; a size change (the file's mapping) takes the write lock.
    pub fn setattr_ino(&self, ino: Ino, a: &SetAttr) -> Result<crate::Metadata> {
        let Some(size) = a.size else {
            let _h = self.handle();
            let _i = self.lock_alone(ino)?;
            self.check_writable()?;
            return self.set_attrs(ino, a);
        };
        let _io = self.io_exclusive(ino);
        let _dax = self.dax_change(ino);
        self.check_writable()?;
        let i = self.read_live_inode(ino)?;
        truncate_allowed(&i, size, self.max_size_of(&i))?;
        let cut = self.prepare_size_change(ino, size)?;
        let _w = self.write_lock();
        self.check_writable()?;
        let r = self.truncate_locked(ino, size);
        self.cut_failed(cut, &r);
        r?;
        self.set_attrs(ino, a)
    }

    /// The inode lock of `ino` for a change of its own record and attributes alone
    /// (setattr, xattrs; under a handle, holding no other inode lock): a directory's
    /// or a non-directory's by its kind.
    pub(crate) fn lock_alone(&self, ino: Ino) -> Result<crate::fs::InodeGuard<'_>> {
        Ok(if self.read_live_inode(ino)?.is_dir() {
            self.lock_dir(ino)
        } else {
            self.lock_nondir(ino)
        })
    }

    /// The attributes of `a` but its size, on `ino` (its inode lock or the write lock
    /// held), and the metadata they leave.
    fn set_attrs(&self, ino: Ino, a: &SetAttr) -> Result<crate::Metadata> {
        let mut inode = self.read_live_inode(ino)?;
        // An append-only file still takes new times (its appends move mtime, and the
        // kernel's writeback cache sends them as explicit times).
        let times_only = a.mode.is_none() && a.uid.is_none() && a.gid.is_none() && a.size.is_none();
        may_change(&inode, "setattr", times_only)?;
        if let Some(mode) = a.mode {
            inode.mode = (inode.mode & m::S_IFMT) | (mode as u16 & 0o7777);
        }
        if let Some(uid) = a.uid {
            inode.uid = uid;
        }
        if let Some(gid) = a.gid {
            inode.gid = gid;
        }
        // Times are clamped to what ext4 can store, as the kernel does, so the reply
        // shows what a later read will see.
        if let Some(t) = a.atime {
            inode.atime = self.settable_time(t);
        }
        if let Some(t) = a.mtime {
            inode.mtime = self.settable_time(t);
        }
        let ctime = match &self.inner.repro {
            Some(r) => a.ctime.unwrap_or(r.now()),
            None => a.ctime.unwrap_or_else(now_ts),
        };
        inode.ctime = self.settable_time(ctime);
        self.write_inode(ino, &inode)?;
        if let Some(mode) = a.mode {
            self.chmod_acl(ino, &inode, mode)?;
        }
        // As stored: a 128-byte inode keeps whole seconds in the 32-bit range.
        inode = self.read_live_inode(ino)?;
        inode.size = self.vfs_size(ino, &inode);
        Ok(self.metadata_of(ino, &inode))
    }

    /// Whether `ino` may be opened for writing (`write`), with O_APPEND (`append`) or
    /// O_TRUNC (`trunc`) as its flags allow: EPERM for any of them on an immutable
    /// inode, and for writing without O_APPEND or truncating an append-only one.
    pub fn may_open_ino(&self, ino: Ino, write: bool, append: bool, trunc: bool) -> Result<()> {
        if write || trunc {
            may_change(
                &self.read_live_inode(ino)?,
                "open for writing",
                append && !trunc,
            )?;
        }
        Ok(())
    }

    /// The inode flags a user sees (FS_IOC_GETFLAGS, lsattr): ext4's user-visible set.
    pub fn flags_ino(&self, ino: Ino) -> Result<u32> {
        Ok(self.read_live_inode(ino)?.flags & FL_USER_VISIBLE)
    }

    /// FS_IOC_SETFLAGS (chattr) with ext4's rules: bits outside the modifiable set are
    /// kept as they are, whatever `new` says, and a file that is immutable and stays
    /// so takes no other change (clearing immutable may come with other changes).
    /// rext4 changes the flags that ask nothing of the filesystem but being kept
    /// (s u c d t T in chattr's letters), A (no atime updates, which the atime policy
    /// honours: `atime.rs`) and the two it enforces, immutable and append-only (i, a:
    /// see `may_change`); changing another (sync, dirsync, data journaling, project
    /// inheritance, extents) is refused as unsupported rather than stored
    /// and ignored. The caller checks ownership and CAP_LINUX_IMMUTABLE (the kernel
    /// does before the ioctl reaches a FUSE server). Setting immutable writes the
    /// file's cached data back first, as ext4 does.
    pub fn set_flags_ino(&self, ino: Ino, new: u32) -> Result<()> {
        let old = self.read_live_inode(ino)?.flags;
        if new & flags::IMMUTABLE != 0 && old & flags::IMMUTABLE == 0 {
            self.writeback_ino(ino, 0, u64::MAX, true)?;
        }
        // Casefold (chattr +F/-F), as ext4_ioctl_setflags: only with the feature, only
        // on a directory, only an empty one — checked under the directory's lock, which
        // keeps names out until the flag is written.
        let casefold_change = (new ^ old) & flags::CASEFOLD != 0;
        let (_h, _d) = if casefold_change {
            if !self.inner.sb.has_incompat(feature::INCOMPAT_CASEFOLD) {
                return Err(Error::Unsupported(
                    "casefolded directories need the casefold feature (mkfs -O casefold)".into(),
                ));
            }
            let h = self.handle();
            let d = self.lock_dir(ino);
            let dir = self.dir_handle(ino)?;
            if !dir_write::is_empty(&dir)? {
                return Err(Error::NotEmpty);
            }
            (Some(h), Some(d))
        } else {
            (None, None)
        };
        // The handle taken for a casefold change stands for the write lock (one or
        // the other, in the lock order).
        let _w = (!casefold_change).then(|| self.write_lock());
        self.check_writable()?;
        let mut inode = self.read_live_inode(ino)?;
        let want = (new & FL_USER_MODIFIABLE) | (inode.flags & !FL_USER_MODIFIABLE);
        let changed = inode.flags ^ want;
        let allowed = FL_KEPT_ONLY | FL_ENFORCED | (flags::CASEFOLD * u32::from(casefold_change));
        if changed & !allowed != 0 {
            return Err(Error::Unsupported(format!(
                "changing inode flags {:#x}: rext4 keeps only flags it needs not act on \
                 (secrm, unrm, compr, nodump, noatime, notail, topdir) and enforces \
                 immutable and append-only",
                changed & !(FL_KEPT_ONLY | FL_ENFORCED)
            )));
        }
        // ext4's rule (ext4_ioctl_check_immutable): an immutable inode that stays
        // immutable takes no other flag change; one call may clear immutable and
        // change the rest (`chattr -ia`).
        if inode.flags & want & flags::IMMUTABLE != 0 && changed & !flags::IMMUTABLE != 0 {
            return Err(Error::NotPermitted(
                "the inode is immutable: clear that flag first (or in the same call)".into(),
            ));
        }
        inode.flags = want;
        inode.ctime = self.now();
        self.write_inode(ino, &inode)?;
        if casefold_change {
            // Names are keyed differently now (folded or not): forget the old keys.
            self.inner
                .caches
                .dentries
                .invalidate_where(|k| k.dir == ino.0);
        }
        Ok(())
    }

    /// The mode `ino` keeps after privileges are dropped, as Linux drops them before
    /// an unprivileged write or truncate and on chown: set-user-ID goes, set-group-ID
    /// goes when the group may execute (without that it marks mandatory locking and
    /// stays). Directories keep both. `None` when nothing would change.
    pub fn mode_without_privs(&self, ino: Ino) -> Result<Option<u32>> {
        let inode = self.read_live_inode(ino)?;
        if inode.is_dir() {
            return Ok(None);
        }
        let mut m = inode.mode;
        m &= !m::S_ISUID;
        if m & m::S_ISGID != 0 && m & 0o010 != 0 {
            m &= !m::S_ISGID;
        }
        Ok((m != inode.mode).then_some(u32::from(m & 0o7777)))
    }

    /// Drop set-user-ID, set-group-ID (see [`Fs::mode_without_privs`]) and file
    /// capabilities (security.capability) of `ino`, as a write or truncate by an
    /// unprivileged caller does (FUSE's KILLPRIV_V2 leaves this to the server).
    /// Returns whether anything changed.
    pub fn kill_privs_ino(&self, ino: Ino) -> Result<bool> {
        let mut changed = false;
        if let Some(mode) = self.mode_without_privs(ino)? {
            self.setattr_ino(
                ino,
                &SetAttr {
                    mode: Some(mode),
                    ..SetAttr::default()
                },
            )?;
            changed = true;
        }
        match self.remove_xattr_ino(ino, b"security.capability") {
            Ok(()) => Ok(true),
            Err(Error::NotFound) => Ok(changed),
            Err(e) => Err(e),
        }
    }

    /// Change the size of a regular file (ftruncate).
    pub fn truncate_ino(&self, ino: Ino, size: u64) -> Result<()> {
        let _io = self.io_exclusive(ino);
        let _dax = self.dax_change(ino);
        self.check_writable()?;
        let i = self.read_live_inode(ino)?;
        truncate_allowed(&i, size, self.max_size_of(&i))?;
        let cut = self.prepare_size_change(ino, size)?;
        let _w = self.write_lock();
        self.check_writable()?;
        let r = self.truncate_locked(ino, size);
        self.cut_failed(cut, &r);
        r
    }

    /// Page-cache work before the size of `ino` becomes `size` (caller holds the I/O
    /// lock exclusively, not the write lock): pages past the new end go, and buffered
    /// data between the on-disk size and the new one is written back first, so the
    /// size that commits never covers data that is not on the device (a crash must
    /// not show zeros where the file had data). A truncate's checks
    /// (`truncate_allowed`) come before it, so a refused one leaves the pages alone.
    /// True when pages were cut: a truncate that fails after that has changed the
    /// file (see `Fs::cut_failed`).
    pub(crate) fn prepare_size_change(&self, ino: Ino, size: u64) -> Result<bool> {
        let inode = self.read_live_inode(ino)?;
        if !inode.is_reg() {
            return Ok(false);
        }
        let vfs = self.vfs_size(ino, &inode);
        let cut = size < vfs;
        if cut {
            self.pc_truncate(ino, size, inode.size);
        }
        if size > inode.size && vfs > inode.size {
            let ps = u64::from(self.inner.block_size);
            self.writeback_ino(ino, inode.size / ps, u64::MAX, true)?;
        }
        Ok(cut)
    }

    /// After `prepare_size_change` cut the page cache, a truncate that failed (a read
    /// error halfway) has changed the file in memory without its new size: abort, so
    /// nothing of it is committed and the error is recorded, as for any failure after
    /// a change.
    fn cut_failed(&self, cut: bool, r: &Result<()>) {
        if let (true, Err(e)) = (cut, r) {
            self.inner
                .abort(format!("truncate failed after its pages were cut: {e}"));
        }
    }

    /// The largest size of a file, the kernel's `s_maxbytes` for extent-mapped files:
    /// 2^32 - 1 blocks (logical block 2^32 - 1 is never mapped).
    pub fn max_file_size(&self) -> u64 {
        (MAX_LOGICAL - 1) * u64::from(self.inner.block_size)
    }

    /// The largest size of `inode`: [`Fs::max_file_size`], or for a block-mapped file
    /// the kernel's `s_bitmap_maxbytes` (what its map and `i_blocks` can hold: 16 GiB
    /// at 1 KiB blocks, about 2 TiB at 4 KiB without huge_file).
    pub fn max_size_of(&self, inode: &Inode) -> u64 {
        if inode.has_flag(flags::EXTENTS) {
            return self.max_file_size();
        }
        crate::blockmap_write::max_bytes(
            self.inner.block_size,
            self.inner.sb.has_ro_compat(feature::RO_COMPAT_HUGE_FILE),
        )
        .min(self.max_file_size())
    }

    /// [`Fs::max_size_of`] inode `ino`.
    pub fn max_size_of_ino(&self, ino: Ino) -> Result<u64> {
        Ok(self.max_size_of(&self.read_live_inode(ino)?))
    }

    /// The part of a write of `buf` at `offset` of `inode` that fits under its size
    /// limit: a write that starts at or past it fails with EFBIG, one that crosses it
    /// is short (as the kernel's `generic_write_checks`).
    pub(crate) fn clamp_write<'b>(
        &self,
        inode: &Inode,
        buf: &'b [u8],
        offset: u64,
    ) -> Result<&'b [u8]> {
        let max = self.max_size_of(inode);
        if offset >= max {
            return Err(Error::FileTooLarge);
        }
        Ok(&buf[..buf
            .len()
            .min(usize::try_from(max - offset).unwrap_or(usize::MAX))])
    }

    fn truncate_locked(&self, ino: Ino, size: u64) -> Result<()> {
        let mut inode = self.read_live_inode(ino)?;
        truncate_allowed(&inode, size, self.max_size_of(&inode))?;
        if inode.has_flag(flags::INLINE_DATA)
            && self.truncate_inline_locked(ino, &mut inode, size)?
        {
            return Ok(());
        }
        let bs = u64::from(self.inner.block_size);
        let t = self.now();
        if size < inode.size {
            let first_gone = size.div_ceil(bs);
            // Removing extents may split one (a new leaf): from the pool if need be.
            let _c = crate::fs::space::claim_as(crate::fs::space::Claim::NoFail);
            // A huge one commits between parts with the new size on record and the
            // file an orphan (`orphan`'s module note); an unlinked file is one already.
            inode.size = size;
            inode.mtime = t;
            inode.ctime = t;
            let was_listed = inode.links_count == 0;
            let mut listed = was_listed;
            self.unmap_tail_in_parts(ino, &mut inode, first_gone, &mut listed)?;
            if listed && !was_listed {
                self.orphan_remove(ino, &inode)?;
                inode.dtime = 0;
            }
            // The bytes past the new EOF in its last block stay on disk until the file
            // grows again (`zero_past_eof`): zeroing them now would change the
            // committed file before this truncate commits.
        } else {
            self.zero_past_eof(ino, &inode, size)?;
        }
        inode.size = size;
        inode.mtime = t;
        inode.ctime = t;
        self.write_inode(ino, &inode)?;
        self.pc_disk_size_is(ino, size, true);
        Ok(())
    }

    /// Before the size grows to `new_size`: zero what lies between the old EOF and the
    /// end of its block on disk (left there by an earlier shrinking truncate), so the
    /// file never shows stale bytes past its old end.
    pub(crate) fn zero_past_eof(&self, ino: Ino, inode: &Inode, new_size: u64) -> Result<()> {
        let bs = u64::from(self.inner.block_size);
        let old = inode.size;
        if new_size <= old || old.is_multiple_of(bs) {
            return Ok(());
        }
        let end = (old - old % bs + bs).min(new_size);
        self.zero_on_disk(ino, inode, old, end - old)
    }

    /// Write zeros over `[off, off+len)` where it is mapped to written blocks.
    pub(crate) fn zero_on_disk(&self, ino: Ino, inode: &Inode, off: u64, len: u64) -> Result<()> {
        let bs = u64::from(self.inner.block_size);
        let mut pos = off;
        let end = off + len;
        while pos < end {
            let lblk = pos / bs;
            let in_blk = pos % bs;
            let n = (bs - in_blk).min(end - pos);
            if let Mapping::Mapped {
                physical,
                unwritten: false,
                ..
            } = self.map_block(ino, inode, lblk)?
            {
                self.write_data(&vec![0u8; n as usize], physical * bs + in_blk)?;
            }
            pos += n;
        }
        Ok(())
    }

    /// Positional write through the page cache; extends the file as needed and
    /// updates mtime/ctime. Returns the bytes written.
    pub fn write_ino_at(&self, ino: Ino, buf: &[u8], offset: u64) -> Result<usize> {
        self.write_buffered(ino, buf, Some(offset), true)
    }

    /// A buffered write whose caller keeps mtime/ctime itself (FUSE with the kernel's
    /// writeback cache: the kernel owns them and sends them by SETATTR). A write inside
    /// the file changes no metadata at all and runs under the inode's shared I/O lock,
    /// in parallel with other such writes and with every metadata operation.
    pub fn write_ino_at_keep_times(&self, ino: Ino, buf: &[u8], offset: u64) -> Result<usize> {
        self.write_buffered(ino, buf, Some(offset), false)
    }

    /// O_APPEND write: at the end of the file, which is read and written under the
    /// exclusive I/O lock, so concurrent appends never overlap.
    pub fn append_ino(&self, ino: Ino, buf: &[u8], direct: bool) -> Result<usize> {
        if direct {
            self.uninline_file(ino)?;
            self.write_through(ino, buf, None, true)
        } else {
            self.write_buffered(ino, buf, None, true)
        }
    }

    /// O_DIRECT write: straight to the device, around the page cache (cached pages of
    /// the range are written back and dropped first, and again afterwards in case a
    /// reader cached the old bytes meanwhile). An overwrite of written blocks inside
    /// the on-disk size runs under the shared I/O lock, concurrently with other such
    /// writes (SEEDS lesson A); anything that allocates, converts or zeroes takes it
    /// exclusively.
    pub fn write_direct_ino(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: u64,
        update_times: bool,
    ) -> Result<usize> {
        let len = buf.len() as u64;
        // As the kernel: an inline file becomes a block before direct I/O.
        self.uninline_file(ino)?;
        self.pc_flush_invalidate(ino, offset, len)?;
        let r = match self.try_overwrite(ino, buf, offset)? {
            Some(n) => {
                self.inner.dio_shared.add(1);
                if update_times {
                    self.touch_times(ino)?;
                }
                Ok(n)
            }
            None => {
                self.inner.dio_exclusive.add(1);
                self.write_through(ino, buf, Some(offset), update_times)
            }
        };
        self.drop_cache_ino(ino, offset, len.max(1));
        r
    }

    /// Set mtime and ctime to now after a data write, unless they are already within
    /// a millisecond of it (as the kernel's coarse clock makes back-to-back writes
    /// change nothing).
    pub(crate) fn touch_times(&self, ino: Ino) -> Result<()> {
        let near = |x: Timestamp, t: Timestamp| {
            let a = i128::from(x.sec) * 1_000_000_000 + i128::from(x.nsec);
            let b = i128::from(t.sec) * 1_000_000_000 + i128::from(t.nsec);
            (b - a).abs() < 1_000_000
        };
        // Lockless first look: back-to-back writes (the common case) need no lock.
        let i = self.read_live_inode(ino)?;
        let t = self.now();
        if near(i.mtime, t) && near(i.ctime, t) {
            return Ok(());
        }
        // The record alone: a handle under the inode's lock.
        let _h = self.handle();
        let _i = self.lock_nondir(ino);
        self.check_writable()?;
        let mut inode = self.read_live_inode(ino)?;
        let t = self.now();
        if near(inode.mtime, t) && near(inode.ctime, t) {
            return Ok(());
        }
        inode.mtime = t;
        inode.ctime = t;
        self.write_inode(ino, &inode)
    }

    /// Write straight to the device with allocation at once (direct I/O, files the
    /// page cache does not write, and buffered writes when free space is low — exact
    /// ENOSPC). `offset` `None` appends. Dirty cached data of the file is written back
    /// first (so the on-disk size is the file's size), and clean pages of the range
    /// are dropped under the exclusive I/O lock.
    pub(crate) fn write_through(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: Option<u64>,
        update_times: bool,
    ) -> Result<usize> {
        let ps = u64::from(self.inner.block_size);
        for _ in 0..100 {
            self.writeback_ino(ino, 0, u64::MAX, true)?;
            let _io = self.io_exclusive(ino);
            // DAX: live mappings of the file are rebuilt before this lock goes.
            let _dax = self.dax_change(ino);
            // A buffered writer may have dirtied pages between the writeback and the
            // lock, and the writeback thread may be writing some: let them finish
            // first (without the lock), then try again. A pass still running could
            // otherwise have written data past the record's size that the zeroing of
            // the old EOF block below would wipe before the pass raises the size.
            let racing = self.inner.pagecache.file(ino).is_some_and(|fc| {
                let st = fc.lock();
                !st.dirty_idx.is_empty() || st.writeback > 0
            });
            if racing {
                continue;
            }
            let _w = self.write_lock();
            self.check_writable()?;
            let inode = self.read_live_inode(ino)?;
            let vfs = self.vfs_size(ino, &inode);
            if vfs > inode.size && inode.is_reg() {
                // The file's tail past the record's size is a hole (nothing dirty is
                // left): make the record say so before writing through.
                self.truncate_locked(ino, vfs)?;
            }
            let off = offset.unwrap_or(vfs);
            let len = buf.len() as u64;
            if len > 0 {
                self.drop_cache_ino(ino, off - off % ps, len + off % ps);
            }
            let n = self.write_locked(ino, buf, off, update_times)?;
            let disk = self.read_inode(ino)?.size;
            self.pc_disk_size_is(ino, disk, false);
            return Ok(n);
        }
        Err(Error::Io(std::io::Error::other(
            "direct write kept racing buffered writers",
        )))
    }

    /// Write `buf` at `offset` in place if every block of the range is mapped and
    /// written and the range ends within the size; `None` when it is not such a write
    /// (the caller takes the full path). The shared I/O lock keeps the mapping fixed:
    /// everything that changes it holds the lock exclusively, except writeback, which
    /// the tree lock keeps out. Buffered writers of the file may run beside it: the
    /// data is copied into the cached pages of the range before it goes to the device,
    /// and the range stays marked in flight until it is there (`pc_direct_begin`).
    pub(crate) fn try_overwrite(&self, ino: Ino, buf: &[u8], offset: u64) -> Result<Option<usize>> {
        self.check_writable()?;
        let _io = self.io_shared(ino);
        let _t = self.tree_shared(ino);
        let inode = self.read_live_inode(ino)?;
        let Some(runs) = self.overwrite_runs(ino, &inode, buf.len(), offset)? else {
            return Ok(None);
        };
        let _in_flight = self.pc_direct_begin(ino, &[(buf, offset)]);
        for (from, to, at) in runs {
            self.write_data(&buf[(from - offset) as usize..(to - offset) as usize], at)?;
            self.write_ahead(ino, at, to - from);
        }
        Ok(Some(buf.len()))
    }

    /// A direct overwrite of `len` bytes went to device offset `at`: the device range
    /// ahead of a stream of partial-page ones is hinted (`fs::write_ahead`).
    fn write_ahead(&self, ino: Ino, at: u64, len: u64) {
        if let Some((from, to)) = self.inner.write_ahead.note(ino.0, at, len) {
            self.cache().device().will_need(from, to - from);
        }
    }

    /// Where `len` bytes at `offset` of `ino` go on the device, as `(from, to, device
    /// offset)` runs, when every block of the range is mapped and written and the range
    /// ends within the size; `None` otherwise. The caller holds the shared I/O and tree
    /// locks (see [`Fs::try_overwrite`]).
    fn overwrite_runs(
        &self,
        ino: Ino,
        inode: &Inode,
        len: usize,
        offset: u64,
    ) -> Result<Option<Vec<(u64, u64, u64)>>> {
        let Some(end) = offset.checked_add(len as u64) else {
            return Ok(None);
        };
        if len == 0 || !inode.is_reg() || end > inode.size || inode.has_flag(flags::INLINE_DATA) {
            return Ok(None);
        }
        let bs = u64::from(self.inner.block_size);
        let mut runs = Vec::new();
        let mut pos = offset;
        while pos < end {
            let lblk = pos / bs;
            match self.map_block(ino, inode, lblk)? {
                Mapping::Mapped {
                    physical,
                    len,
                    unwritten: false,
                } => {
                    let run_end = ((lblk + len) * bs).min(end);
                    runs.push((pos, run_end, physical * bs + pos % bs));
                    pos = run_end;
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(runs))
    }

    /// O_DIRECT writes of `ino` in flight together (an application's queue depth, as
    /// io_submit(2) or an io_uring gives one): each `(bytes, offset)` written whole, as
    /// by [`Fs::write_direct_ino`] until done. When every one is an overwrite of
    /// written blocks inside the size, they all go to the device in one batch under
    /// the shared I/O lock ([`BlockDevice::write_many`](crate::device::BlockDevice::write_many));
    /// otherwise each takes [`Fs::write_direct_ino`]'s path in turn. Writes of one
    /// batch must not overlap (their order is not defined). On an error some may have
    /// been written.
    pub fn write_direct_batch_ino(
        &self,
        ino: Ino,
        writes: &[(&[u8], u64)],
        update_times: bool,
    ) -> Result<()> {
        let all_or_one = |buf: &[u8], offset: u64| {
            write_whole(buf, offset, |b, o| {
                self.write_direct_ino(ino, b, o, update_times)
            })
        };
        if writes.len() <= 1 {
            return writes.iter().try_for_each(|&(b, o)| all_or_one(b, o));
        }
        self.uninline_file(ino)?;
        for &(b, o) in writes {
            self.pc_flush_invalidate(ino, o, b.len() as u64)?;
        }
        let batched = self.try_overwrite_batch(ino, writes)?;
        let r = if batched {
            self.inner.dio_shared.add(writes.len() as u64);
            if update_times {
                self.touch_times(ino)
            } else {
                Ok(())
            }
        } else {
            writes.iter().try_for_each(|&(b, o)| all_or_one(b, o))
        };
        if batched {
            for &(b, o) in writes {
                self.drop_cache_ino(ino, o, (b.len() as u64).max(1));
            }
        }
        r
    }

    /// [`Fs::try_overwrite`] for a batch: all of them in place under one shared lock,
    /// or none (false) when any is not a pure overwrite.
    fn try_overwrite_batch(&self, ino: Ino, writes: &[(&[u8], u64)]) -> Result<bool> {
        self.check_writable()?;
        let _io = self.io_shared(ino);
        let _t = self.tree_shared(ino);
        let inode = self.read_live_inode(ino)?;
        let mut to_device = Vec::with_capacity(writes.len());
        for &(buf, offset) in writes {
            let Some(runs) = self.overwrite_runs(ino, &inode, buf.len(), offset)? else {
                return Ok(false);
            };
            for (from, to, at) in runs {
                to_device.push((at, &buf[(from - offset) as usize..(to - offset) as usize]));
            }
        }
        let _in_flight = self.pc_direct_begin(ino, writes);
        let cache = self.cache();
        if cache.data_count() == 0 {
            cache.device().write_many(&to_device)?;
        } else {
            // Some data blocks live in the journal's cache (data journaling): through
            // it, one by one.
            for &(at, b) in &to_device {
                self.write_data(b, at)?;
            }
        }
        for (at, b) in to_device {
            self.write_ahead(ino, at, b.len() as u64);
        }
        Ok(true)
    }

    pub(crate) fn write_locked(
        &self,
        ino: Ino,
        buf: &[u8],
        offset: u64,
        update_times: bool,
    ) -> Result<usize> {
        let mut inode = self.read_live_inode(ino)?;
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let buf = self.clamp_write(&inode, buf, offset)?;
        // Inline data: written in the record while it fits, else converted first.
        if inode.has_flag(flags::INLINE_DATA) || self.may_inline(&inode) {
            if let Some(n) = self.write_inline_locked(ino, &mut inode, buf, offset, update_times)? {
                return Ok(n);
            }
        }
        let before = inode.clone();
        if offset > inode.size {
            self.zero_past_eof(ino, &inode, offset)?;
        }
        let mut pos = offset;
        let r = self.write_blocks(ino, &mut inode, buf, offset, &mut pos);
        // Whatever was done is recorded, even when the rest failed (e.g. ENOSPC): the
        // inode must reference every block the loop allocated.
        let done = pos - offset;
        // A write that wrote nothing (ENOSPC at its first block) leaves the size as it
        // was, even when it started past the end.
        if done > 0 && pos > inode.size {
            inode.size = pos;
        }
        if done > 0 && update_times {
            let t = self.now();
            inode.mtime = t;
            inode.ctime = t;
        }
        if inode != before {
            self.write_inode(ino, &inode)?;
        }
        match r {
            Ok(()) => Ok(buf.len()),
            Err(_) if done > 0 => Ok(done as usize),
            Err(e) => Err(e),
        }
    }

    /// The block loop of a write; `pos` tracks how far the data got.
    fn write_blocks(
        &self,
        ino: Ino,
        inode: &mut Inode,
        buf: &[u8],
        offset: u64,
        pos: &mut u64,
    ) -> Result<()> {
        let end = offset + buf.len() as u64;
        let bs = u64::from(self.inner.block_size);
        let inode = &mut *inode;
        while *pos < end {
            let pos_now = *pos;
            let lblk = pos_now / bs;
            let mapping = self.map_block(ino, inode, lblk)?;
            match mapping {
                Mapping::Mapped {
                    physical,
                    len,
                    unwritten: false,
                } => {
                    // Overwrite in place, up to the end of this extent.
                    let run_end = ((lblk + len) * bs).min(end);
                    let n = (run_end - pos_now) as usize;
                    let src = &buf[(pos_now - offset) as usize..][..n];
                    self.write_data(src, physical * bs + pos_now % bs)?;
                    *pos = run_end;
                }
                Mapping::Mapped {
                    physical,
                    len,
                    unwritten: true,
                } => {
                    // Write whole blocks (zeros around the data), then mark them written.
                    let run_end_blk = (lblk + len).min(end.div_ceil(bs));
                    let nblk = run_end_blk - lblk;
                    let run_end = (run_end_blk * bs).min(end);
                    let start_in = (pos_now - lblk * bs) as usize;
                    let n = (run_end - pos_now) as usize;
                    write_zero_padded(
                        self,
                        &buf[(pos_now - offset) as usize..][..n],
                        start_in,
                        (nblk * bs) as usize,
                        physical * bs,
                    )?;
                    {
                        // The conversion's extent splits may use the pool.
                        let _c = crate::fs::space::claim_as(crate::fs::space::Claim::NoFail);
                        with_tree(self, ino, inode, |t| {
                            t.mark_written(lblk as u32, nblk as u32)
                        })?;
                    }
                    *pos = run_end;
                }
                Mapping::Hole { len } if crate::fs::inode_write::uses_block_map(inode) => {
                    // A block map: the blocks (and the indirect blocks they need) are
                    // mapped first, then written; the write lock keeps the mapping from
                    // being committed before the data is on the device. A failed data
                    // write unmaps them again.
                    let want_blk = len.min(end.div_ceil(bs) - lblk);
                    let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
                    let (p, got) =
                        map_new_blocks(self, ino, inode, lblk, want_blk, false, &mut alloc)?;
                    let run_end = ((lblk + got) * bs).min(end);
                    let start_in = (pos_now - lblk * bs) as usize;
                    let n = (run_end - pos_now) as usize;
                    if let Err(e) = write_zero_padded(
                        self,
                        &buf[(pos_now - offset) as usize..][..n],
                        start_in,
                        (got * bs) as usize,
                        p * bs,
                    ) {
                        let _ = unmap_range(self, ino, inode, lblk, lblk + got);
                        return Err(e);
                    }
                    *pos = run_end;
                }
                Mapping::Hole { len } => {
                    let want_blk = len
                        .min(end.div_ceil(bs) - lblk)
                        .min(u64::from(rext4_format::extent::MAX_INIT_LEN));
                    let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
                    let run = crate::fs::inode_write::alloc_data_run(
                        self, ino, inode, lblk, want_blk, &mut alloc,
                    )?;
                    let (p, got) = (run.physical, run.len);
                    let run_end = ((lblk + got) * bs).min(end);
                    let start_in = (pos_now - lblk * bs) as usize;
                    let n = (run_end - pos_now) as usize;
                    if let Err(e) = write_zero_padded(
                        self,
                        &buf[(pos_now - offset) as usize..][..n],
                        start_in,
                        (got * bs) as usize,
                        p * bs,
                    ) {
                        // The blocks hold nothing of the file yet: give them back, so
                        // the failed write leaves no block allocated to no one.
                        crate::fs::inode_write::undo_data_run(self, &run);
                        return Err(e);
                    }
                    let ext = Extent {
                        logical: lblk as u32,
                        len: got as u16,
                        physical: p,
                        unwritten: false,
                    };
                    if let Err(e) = with_tree(self, ino, inode, |t| t.insert(ext)) {
                        crate::fs::inode_write::undo_data_run(self, &run);
                        return Err(e);
                    }
                    inode.blocks_raw += run.fresh * bs / 512;
                    *pos = run_end;
                }
            }
        }
        Ok(())
    }

    /// fallocate(2).
    pub fn fallocate_ino(&self, ino: Ino, mode: FallocMode, offset: u64, len: u64) -> Result<()> {
        // As the kernel: an inline file becomes a block first.
        self.uninline_file(ino)?;
        let _io = self.io_exclusive(ino);
        let _dax = self.dax_change(ino);
        self.check_writable()?;
        if len == 0 {
            return Err(Error::InvalidInput("fallocate of length 0".into()));
        }
        let end = offset.checked_add(len).ok_or(Error::FileTooLarge)?;
        if end > self.max_file_size() {
            return Err(Error::FileTooLarge);
        }
        if mode != FallocMode::PunchHole {
            // The kernel's ext4 fallocates only extent-mapped files: on a block map
            // every mode but punching a hole is EOPNOTSUPP (after the VFS's checks).
            let i = self.read_live_inode(ino)?;
            if !i.has_flag(flags::EXTENTS) {
                may_change(
                    &i,
                    "fallocate",
                    matches!(mode, FallocMode::Allocate | FallocMode::KeepSize),
                )?;
                falloc_target(&i)?;
                return Err(Error::Unsupported(format!(
                    "inode {} is block-mapped: of fallocate's modes only punching a hole \
                     works on it (as on the kernel's ext4)",
                    ino.0
                )));
            }
        }
        if matches!(mode, FallocMode::CollapseRange | FallocMode::InsertRange) {
            return self.shift_range(ino, mode, offset, len);
        }
        // Page cache first (it may wait for writeback, which needs the write lock):
        // cached pages of a punched range go; a size that grows past buffered data
        // not yet written waits for it (see `prepare_size_change`).
        match mode {
            FallocMode::PunchHole | FallocMode::ZeroRange { .. } => {
                self.pc_drop_range(ino, offset, end)
            }
            _ => {}
        }
        let grows = matches!(
            mode,
            FallocMode::Allocate | FallocMode::ZeroRange { keep_size: false }
        );
        if grows {
            let i = self.read_live_inode(ino)?;
            if end > i.size && self.vfs_size(ino, &i) > i.size {
                self.prepare_size_change(ino, end.max(self.vfs_size(ino, &i)))?;
            }
        }
        let _w = self.write_lock();
        self.check_writable()?;
        let mut inode = self.read_live_inode(ino)?;
        let vfs = self.vfs_size(ino, &inode);
        may_change(
            &inode,
            "fallocate",
            matches!(mode, FallocMode::Allocate | FallocMode::KeepSize),
        )?;
        falloc_target(&inode)?;
        let bs = u64::from(self.inner.block_size);
        match mode {
            FallocMode::Allocate | FallocMode::KeepSize => {
                if let Err(e) = self.alloc_unwritten(ino, &mut inode, offset / bs, end.div_ceil(bs))
                {
                    // Keep what was allocated referenced (as the kernel does on ENOSPC).
                    self.write_inode(ino, &inode)?;
                    return Err(e);
                }
                if mode == FallocMode::Allocate && end > vfs {
                    self.zero_past_eof(ino, &inode, end)?;
                    inode.size = end;
                }
            }
            FallocMode::PunchHole => {
                self.punch(ino, &mut inode, offset, end)?;
            }
            FallocMode::CollapseRange | FallocMode::InsertRange => unreachable!(),
            FallocMode::ZeroRange { keep_size } => {
                self.punch(ino, &mut inode, offset, end)?;
                if let Err(e) = self.alloc_unwritten(ino, &mut inode, offset / bs, end.div_ceil(bs))
                {
                    self.write_inode(ino, &inode)?;
                    return Err(e);
                }
                if !keep_size && end > vfs {
                    self.zero_past_eof(ino, &inode, end)?;
                    inode.size = end;
                }
            }
        }
        inode.ctime = self.now();
        if matches!(mode, FallocMode::PunchHole | FallocMode::ZeroRange { .. }) {
            inode.mtime = inode.ctime;
        }
        self.write_inode(ino, &inode)?;
        self.pc_disk_size_is(ino, inode.size, false);
        Ok(())
    }

    /// COLLAPSE_RANGE and INSERT_RANGE (caller holds the exclusive I/O lock and
    /// checked `offset + len` against the size limit), with the kernel's rules: whole
    /// blocks, a collapse ending before the end of the file, an insert starting inside
    /// it and not growing it past the limit. The file's data from `offset` on is
    /// written back and dropped from the page cache first, then the extents move in
    /// one transaction.
    fn shift_range(&self, ino: Ino, mode: FallocMode, offset: u64, len: u64) -> Result<()> {
        // Whole clusters with bigalloc, as the kernel asks.
        let bs = u64::from(self.inner.block_size);
        let unit = bs << self.cluster_bits();
        if !offset.is_multiple_of(unit) || !len.is_multiple_of(unit) {
            return Err(Error::InvalidInput(
                "collapse/insert range: offset and length must be whole blocks (clusters)".into(),
            ));
        }
        let inode = self.read_live_inode(ino)?;
        may_change(&inode, "fallocate", false)?;
        falloc_target(&inode)?;
        if !inode.has_flag(flags::EXTENTS) {
            return Err(Error::Unsupported(format!(
                "inode {} uses block maps; collapse and insert need extents",
                ino.0
            )));
        }
        let size = self.vfs_size(ino, &inode);
        let collapse = mode == FallocMode::CollapseRange;
        if collapse && offset + len >= size {
            return Err(Error::InvalidInput(
                "collapse range reaches the end of the file".into(),
            ));
        }
        if !collapse && offset >= size {
            return Err(Error::InvalidInput(
                "insert range starts at or past the end of the file".into(),
            ));
        }
        if !collapse && len > self.max_file_size() - size {
            return Err(Error::FileTooLarge);
        }
        // Everything from `offset` on moves: its data must be on the device (which also
        // brings the on-disk size up to `size`) and no cached page may keep an old place.
        self.writeback_ino(ino, 0, u64::MAX, true)?;
        self.pc_drop_range(ino, offset, u64::MAX);
        let _w = self.write_lock();
        self.check_writable()?;
        let mut inode = self.read_live_inode(ino)?;
        let (first, n) = ((offset / bs) as u32, (len / bs) as u32);
        if collapse {
            with_tree(self, ino, &mut inode, |t| t.collapse(first, n).map(|_| ()))?;
            inode.size -= len;
        } else {
            with_tree(self, ino, &mut inode, |t| t.insert_range(first, n))?;
            inode.size += len;
        }
        inode.ctime = self.now();
        inode.mtime = inode.ctime;
        self.write_inode(ino, &inode)?;
        self.pc_disk_size_is(ino, inode.size, true);
        Ok(())
    }

    /// Unwritten extents over every hole in logical blocks [first, end).
    fn alloc_unwritten(&self, ino: Ino, inode: &mut Inode, first: u64, end: u64) -> Result<()> {
        let mut l = first;
        while l < end {
            match self.map_block(ino, inode, l)? {
                Mapping::Mapped { len, .. } => l += len,
                Mapping::Hole { len } => {
                    let want = len
                        .min(end - l)
                        .min(u64::from(rext4_format::extent::MAX_UNWRITTEN_LEN));
                    let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
                    let run = crate::fs::inode_write::alloc_data_run(
                        self, ino, inode, l, want, &mut alloc,
                    )?;
                    let ext = Extent {
                        logical: l as u32,
                        len: run.len as u16,
                        physical: run.physical,
                        unwritten: true,
                    };
                    if let Err(e) = with_tree(self, ino, inode, |t| t.insert(ext)) {
                        crate::fs::inode_write::undo_data_run(self, &run);
                        return Err(e);
                    }
                    inode.blocks_raw += run.fresh * u64::from(self.inner.block_size) / 512;
                    l += run.len;
                }
            }
        }
        Ok(())
    }

    /// Deallocate whole blocks inside [start, end) and zero the partial edges.
    fn punch(&self, ino: Ino, inode: &mut Inode, start: u64, end: u64) -> Result<()> {
        let bs = u64::from(self.inner.block_size);
        let first_full = start.div_ceil(bs);
        let end_full = end / bs;
        if first_full < end_full {
            // Removing extents may split one (a new leaf): from the pool if need be.
            let _c = crate::fs::space::claim_as(crate::fs::space::Claim::NoFail);
            unmap_range(self, ino, inode, first_full, end_full)?;
        }
        // Partial blocks at the edges: zeroed in the cached page if there is one (the
        // device copy follows at writeback), else on the device.
        let head_end = (first_full * bs).min(end);
        if start < head_end {
            self.zero_partial(ino, inode, start, head_end)?;
        }
        let tail_start = (end_full * bs).max(start);
        if tail_start < end && end_full >= first_full {
            self.zero_partial(ino, inode, tail_start, end)?;
        }
        Ok(())
    }

    /// Blocks new data could still take, for a privileged caller (who may use the
    /// root reserve) or not: statfs's f_bavail is the unprivileged figure.
    pub fn blocks_available_to(&self, privileged: bool) -> u64 {
        self.inner.space.available_to(privileged)
    }

    /// Keep `blocks` back for data a client of the engine has accepted and will hand
    /// over later (a FUSE mount: what the kernel's page cache may still write back),
    /// replacing the previous figure: allocations and buffered-write promises leave
    /// them, except on a thread that hands that data over ([`crate::spend_held`]), so
    /// it always finds its blocks. Not counted by [`Fs::statfs`] or
    /// [`Fs::blocks_available_to`]; 0 (the default) holds nothing.
    pub fn hold_for_client(&self, blocks: u64) {
        self.inner.space.hold(blocks);
    }

    /// Blocks kept back by [`Fs::hold_for_client`].
    pub fn held_for_client(&self) -> u64 {
        self.inner.space.held()
    }

    /// statfs(2), as ext4 answers it: blocks promised to delayed allocations count as
    /// used (the kernel's dirty clusters); the available blocks leave out the root
    /// reserve and the pool kept for changes that must not fail.
    pub fn statfs(&self) -> StatFs {
        let sb = self.superblock();
        let overhead = u64::from(sb.overhead_clusters);
        let (free, _, _) = self.inner.space.figures();
        StatFs {
            block_size: self.inner.block_size,
            blocks: sb.blocks_count.saturating_sub(overhead),
            blocks_free: free,
            blocks_available: self.inner.space.available(),
            inodes: u64::from(sb.inodes_count),
            inodes_free: u64::from(sb.free_inodes_count),
            name_max: NAME_MAX as u32,
        }
    }
}

impl FsDir<'_> {
    /// Append a block, for a directory being created.
    fn append_block_checked(&mut self) -> Result<u64> {
        crate::store::DirStore::append_block(self)
    }
}

/// Write `data` at byte `start_in` of the `whole` fresh bytes at device offset `at`,
/// zeros around it: straight from the caller's buffer when it fills them all (a DAX
/// device then copies once), else through one zero-padded buffer (one device write).
fn write_zero_padded(fs: &Fs, data: &[u8], start_in: usize, whole: usize, at: u64) -> Result<()> {
    if start_in == 0 && data.len() == whole {
        return fs.write_data(data, at);
    }
    let mut v = vec![0u8; whole];
    v[start_in..start_in + data.len()].copy_from_slice(data);
    fs.write_data(&v, at)
}
