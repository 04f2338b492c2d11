//! Permission checks for the embedding API: what the kernel's VFS decides before it
//! lets a caller touch an inode (generic_permission, may_create, may_delete,
//! setattr_prepare), so a program embedding rext4 can act on behalf of users.
//!
//! Owns: [`Creds`] (effective uid, gid, supplementary groups), `permission_ino` (mode
//! bits, owner, groups, POSIX access ACLs, root's overrides), `may_create_ino`,
//! `may_delete_ino` (sticky directories), `check_setattr` (chmod/chown/utimes rules),
//! `resolve_as` (search permission on every directory of a path) and `access`.
//! Must hold: a check never changes the image; root (uid 0) gets what CAP_DAC_OVERRIDE,
//! CAP_FOWNER and CAP_CHOWN give it; errors are EACCES (`PermissionDenied`) where Linux
//! says EACCES and EPERM (`NotPermitted`) where it says EPERM. The unchecked `*_ino`
//! calls stay as they are: the checks are for callers that ask for them (the FUSE mount
//! leaves them to the kernel via default_permissions).

use rext4_format::acl::{self, R, W, X};
use rext4_format::inode::{flags, mode as m, Inode};

use crate::error::{Error, Result};
use crate::fs::{Fs, Ino};
use crate::ops::SetAttr;

/// Who is acting: effective uid and gid and the supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Creds {
    pub fn new(uid: u32, gid: u32, groups: Vec<u32>) -> Creds {
        Creds { uid, gid, groups }
    }

    /// The superuser: every check passes except executing a file nobody may execute.
    pub fn root() -> Creds {
        Creds::new(0, 0, Vec::new())
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

impl acl::Caller for Creds {
    fn uid(&self) -> u32 {
        self.uid
    }
    fn in_group(&self, gid: u32) -> bool {
        Creds::in_group(self, gid)
    }
}

/// Access wanted, as for access(2): a mix of these.
pub mod want {
    pub const READ: u16 = super::R;
    pub const WRITE: u16 = super::W;
    pub const EXEC: u16 = super::X;
}

impl Fs {
    /// May `creds` access inode `ino` for `want` (read/write/exec-or-search bits)?
    pub fn permission_ino(&self, ino: Ino, creds: &Creds, want: u16) -> Result<()> {
        let inode = self.read_live_inode(ino)?;
        self.permission_of(ino, &inode, creds, want)
    }

    pub(crate) fn permission_of(
        &self,
        ino: Ino,
        inode: &Inode,
        creds: &Creds,
        want: u16,
    ) -> Result<()> {
        let want = want & (R | W | X);
        let ft = inode.mode & m::S_IFMT;
        if want & W != 0 {
            if self.is_read_only() && [m::S_IFREG, m::S_IFDIR, m::S_IFLNK].contains(&ft) {
                return Err(Error::ReadOnly);
            }
            if inode.flags & flags::IMMUTABLE != 0 {
                return Err(Error::NotPermitted("the inode is immutable".into()));
            }
        }
        let mode = u32::from(inode.mode);
        let bits = |b: u32| (b & 7) as u16 & want == want;
        let granted = if creds.uid == inode.uid {
            bits(mode >> 6)
        } else if mode & 0o070 != 0 {
            match self.acl_entries(ino, inode)? {
                Some(es) => acl::permits(&es, creds, inode.uid, inode.gid, want),
                None if creds.in_group(inode.gid) => bits(mode >> 3),
                None => bits(mode),
            }
        } else if creds.in_group(inode.gid) {
            bits(mode >> 3)
        } else {
            bits(mode)
        };
        if granted {
            return Ok(());
        }
        // CAP_DAC_OVERRIDE: anything but executing a file with no execute bit at all.
        if creds.is_root() && (want & X == 0 || ft == m::S_IFDIR || mode & 0o111 != 0) {
            return Ok(());
        }
        Err(Error::PermissionDenied)
    }

    /// May `creds` add a name to directory `dir` (write and search on it)?
    pub fn may_create_ino(&self, dir: Ino, creds: &Creds) -> Result<()> {
        let d = self.read_live_inode(dir)?;
        if !d.is_dir() {
            return Err(Error::NotADirectory);
        }
        self.permission_of(dir, &d, creds, W | X)
    }

    /// May `creds` remove (or rename away) `victim` from directory `dir`? Write and
    /// search on `dir`, and in a sticky directory only the owner of the file or of the
    /// directory (or root) may (EPERM otherwise); append-only or immutable victims no.
    pub fn may_delete_ino(&self, dir: Ino, victim: Ino, creds: &Creds) -> Result<()> {
        let d = self.read_live_inode(dir)?;
        if !d.is_dir() {
            return Err(Error::NotADirectory);
        }
        self.permission_of(dir, &d, creds, W | X)?;
        let v = self.read_live_inode(victim)?;
        if d.mode & m::S_ISVTX != 0 && !creds.is_root() && creds.uid != d.uid && creds.uid != v.uid
        {
            return Err(Error::NotPermitted(
                "sticky directory: not the owner of the file or the directory".into(),
            ));
        }
        if v.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
            return Err(Error::NotPermitted(
                "the inode is immutable or append-only".into(),
            ));
        }
        Ok(())
    }

    /// The checks of setattr(2)-like changes by `creds` (chmod, chown, truncate,
    /// utimes; `times_now` says the times are "now" rather than explicit values).
    /// Returns the change to apply: chmod by a caller outside the file's group loses the
    /// set-group-ID bit, as on Linux.
    pub fn check_setattr(
        &self,
        ino: Ino,
        creds: &Creds,
        a: &SetAttr,
        times_now: bool,
    ) -> Result<SetAttr> {
        let inode = self.read_live_inode(ino)?;
        let owner = creds.is_root() || creds.uid == inode.uid;
        let mut out = a.clone();
        if a.size.is_some() {
            self.permission_of(ino, &inode, creds, W)?;
        }
        if let Some(uid) = a.uid {
            if uid != inode.uid && !creds.is_root() {
                return Err(Error::NotPermitted("only root may change the owner".into()));
            }
        }
        if let Some(gid) = a.gid {
            let uid_kept = a.uid.is_none_or(|u| u == inode.uid);
            let may = creds.is_root()
                || (creds.uid == inode.uid
                    && uid_kept
                    && (gid == inode.gid || creds.in_group(gid)));
            if !may {
                return Err(Error::NotPermitted(
                    "only root, or the owner to a group of theirs, may change the group".into(),
                ));
            }
        }
        if let Some(mode) = a.mode {
            if !owner {
                return Err(Error::NotPermitted(
                    "only the owner may change the mode".into(),
                ));
            }
            let gid = a.gid.unwrap_or(inode.gid);
            if !creds.is_root() && !creds.in_group(gid) {
                out.mode = Some(mode & !u32::from(m::S_ISGID));
            }
        }
        if a.atime.is_some() || a.mtime.is_some() {
            if times_now {
                if !owner {
                    self.permission_of(ino, &inode, creds, W)?;
                }
            } else if !owner {
                return Err(Error::NotPermitted(
                    "only the owner may set explicit times".into(),
                ));
            }
        }
        Ok(out)
    }

    /// Resolve `path` as `creds`: search permission on every directory walked.
    pub fn resolve_as(&self, path: &[u8], follow: bool, creds: &Creds) -> Result<Ino> {
        self.resolve_checked(path, follow, Some(creds))
    }

    /// access(2): may `creds` reach `path` and use it for `want`?
    pub fn access(
        &self,
        path: impl AsRef<std::path::Path>,
        creds: &Creds,
        want: u16,
    ) -> Result<()> {
        let p = std::os::unix::ffi::OsStrExt::as_bytes(path.as_ref().as_os_str());
        let ino = self.resolve_as(p, true, creds)?;
        self.permission_ino(ino, creds, want)
    }
}
