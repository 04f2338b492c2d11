//! POSIX ACLs as ext4 on Linux keeps them: the access ACL and the permission bits move
//! together, and a directory's default ACL is inherited by what is created in it.
//!
//! Owns: `set_acl_ino` (setxattr of system.posix_acl_*: validation, the mode update of
//! posix_acl_update_mode, an ACL equivalent to the mode is not stored), `chmod_acl`
//! (chmod rewrites the stored access ACL), `inherit_acl` (the mode and attributes of a new
//! inode from its parent's default ACL), `create_mode` (the umask applies only where no
//! default ACL does) and `acl_entries` (the access ACL for permission checks).
//! Must hold: each change is made under the inode's lock (a handle) or the write lock,
//! in one step with the inode it belongs to, so a crash never separates an ACL from
//! its mode; ACL values on disk are ext4's compact form (`format::xattr`), VFS form at
//! the API.

use rext4_format::acl;
use rext4_format::inode::Inode;
use rext4_format::xattr::{self as fx, AclEntry};

use crate::error::{Error, Result};
use crate::fs::{Fs, Ino};

/// A VFS-form ACL value from the API → its entries, refused unless well-formed.
pub(crate) fn parse_vfs(value: &[u8]) -> Result<Vec<AclEntry>> {
    let es =
        fx::acl_decode_vfs(value).map_err(|e| Error::InvalidInput(format!("ACL value: {e}")))?;
    if !acl::valid(&es) {
        return Err(Error::InvalidInput(
            "ACL entries are not a valid ACL".into(),
        ));
    }
    Ok(es)
}

/// Attributes to give a new inode, and its mode, under a parent's default ACL.
pub(crate) struct Inherited {
    pub(crate) attrs: Vec<fx::Xattr>,
}

impl Fs {
    /// setxattr of an ACL (index ACCESS or DEFAULT), flags ignored as Linux does.
    pub(crate) fn set_acl_ino(&self, ino: Ino, index: u8, es: Vec<AclEntry>) -> Result<()> {
        let stored = fx::acl_encode_disk(&es);
        if stored.len() > self.max_value_len() {
            return Err(Error::NoSpace);
        }
        let _h = self.handle();
        let _i = self.lock_alone(ino)?;
        self.check_writable()?;
        let inode = self.read_live_inode(ino)?;
        crate::ops::may_change(&inode, "setxattr", false)?;
        if index == fx::INDEX_POSIX_ACL_DEFAULT && !inode.is_dir() {
            // Linux: a default ACL only on directories (EACCES).
            return Err(Error::PermissionDenied);
        }
        if inode.is_symlink() {
            return Err(Error::Unsupported("ACLs on symbolic links".into()));
        }
        let (bits, equiv) = acl::equiv_mode(&es);
        let access = index == fx::INDEX_POSIX_ACL_ACCESS;
        self.update_xattrs(ino, |all, inode| {
            all.retain(|a| a.index != index);
            if access {
                inode.mode = (inode.mode & !0o777) | bits as u16;
            }
            if !(access && equiv) {
                all.push(fx::Xattr::new(index, b"", &stored));
            }
            Ok(())
        })
    }

    /// After chmod to `mode`: rewrite a stored access ACL to match (posix_acl_chmod).
    /// Caller holds the inode's lock or the write lock, and has written the inode.
    pub(crate) fn chmod_acl(&self, ino: Ino, inode: &Inode, mode: u32) -> Result<()> {
        let Some(disk) = self.stored_attr(ino, inode, fx::INDEX_POSIX_ACL_ACCESS, b"")? else {
            return Ok(());
        };
        let mut es = fx::acl_decode_disk(&disk)?;
        acl::chmod(&mut es, mode);
        let new = fx::acl_encode_disk(&es);
        if new == disk {
            return Ok(());
        }
        self.update_xattrs(ino, |all, _| {
            for a in all.iter_mut() {
                if a.index == fx::INDEX_POSIX_ACL_ACCESS {
                    *a = fx::Xattr::new(a.index, b"", &new);
                }
            }
            Ok(())
        })
    }

    /// The default ACL of directory `dir`, if it has one.
    pub(crate) fn default_acl(&self, dir: Ino, inode: &Inode) -> Result<Option<Vec<AclEntry>>> {
        match self.stored_attr(dir, inode, fx::INDEX_POSIX_ACL_DEFAULT, b"")? {
            Some(disk) => {
                let es = fx::acl_decode_disk(&disk)?;
                // An invalid stored default ACL is not applied (the kernel refuses to
                // load it); the create still succeeds with the plain mode.
                Ok(acl::valid(&es).then_some(es))
            }
            None => Ok(None),
        }
    }

    /// The access ACL of `ino` for permission checks, if it has one that is valid.
    pub fn acl_entries(&self, ino: Ino, inode: &Inode) -> Result<Option<Vec<AclEntry>>> {
        match self.stored_attr(ino, inode, fx::INDEX_POSIX_ACL_ACCESS, b"")? {
            Some(disk) => {
                let es = fx::acl_decode_disk(&disk)?;
                Ok(acl::valid(&es).then_some(es))
            }
            None => Ok(None),
        }
    }

    /// The mode a new inode in `parent` gets from a requested `mode` and the caller's
    /// `umask`: with a default ACL on `parent` the umask is not applied (the ACL masks the
    /// mode at creation instead), without one it is.
    pub fn create_mode(&self, parent: Ino, mode: u32, umask: u32) -> Result<u32> {
        let dir = self.read_live_inode(parent)?;
        if dir.is_dir() && self.default_acl(parent, &dir)?.is_some() {
            Ok(mode)
        } else {
            Ok(mode & !(umask & 0o777))
        }
    }

    /// For a new inode of `mode` (type and permission bits) in directory `dir`: masks
    /// `mode` by the default ACL and returns the attributes to store with the inode
    /// (access ACL when it says more than the mode; the default ACL again for a
    /// directory). Symbolic links inherit nothing.
    pub(crate) fn inherit_acl(
        &self,
        dir: &Inode,
        parent: Ino,
        mode: &mut u16,
    ) -> Result<Inherited> {
        let mut attrs = Vec::new();
        let ft = *mode & rext4_format::inode::mode::S_IFMT;
        if ft == rext4_format::inode::mode::S_IFLNK {
            return Ok(Inherited { attrs });
        }
        let Some(default) = self.default_acl(parent, dir)? else {
            return Ok(Inherited { attrs });
        };
        if ft == rext4_format::inode::mode::S_IFDIR {
            attrs.push(fx::Xattr::new(
                fx::INDEX_POSIX_ACL_DEFAULT,
                b"",
                &fx::acl_encode_disk(&default),
            ));
        }
        let mut access = default;
        let mut m = u32::from(*mode);
        if acl::create_masq(&mut access, &mut m) {
            attrs.push(fx::Xattr::new(
                fx::INDEX_POSIX_ACL_ACCESS,
                b"",
                &fx::acl_encode_disk(&access),
            ));
        }
        *mode = m as u16;
        Ok(Inherited { attrs })
    }

    /// Store inherited attributes on a just-written new inode (caller holds the lock).
    pub(crate) fn store_inherited(&self, ino: Ino, inh: Inherited) -> Result<()> {
        if inh.attrs.is_empty() {
            return Ok(());
        }
        self.update_xattrs(ino, |all, _| {
            all.extend(inh.attrs);
            Ok(())
        })
    }
}
