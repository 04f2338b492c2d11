//! Extended attributes: in-inode entries and the external xattr block, merged into the
//! names userspace sees (`user.foo`, `trusted.bar`, `system.posix_acl_access`, ...).
//!
//! POSIX ACLs are stored in ext4's compact format and presented in the Linux VFS
//! format (version 2), as the kernel does. The xattr block is verified (magic, bounds,
//! checksum with the fs seed and its block number) before use.

use rext4_format::xattr as fx;

use crate::cache::Kind;
use crate::error::{AtBlock, Error, Result};
use crate::fs::{Fs, Ino};
use rext4_format::inode::Inode;

/// The (index, suffix) of an attribute name, with the kernel's errors: EOPNOTSUPP for
/// an unknown namespace, EINVAL for an empty name after a known prefix, ERANGE-like
/// `NameTooLong` past 255 bytes.
fn resolve_name(name: &[u8]) -> Result<(u8, &[u8])> {
    if let Some(r) = fx::split_name(name) {
        return Ok(r);
    }
    for p in [&b"user."[..], b"trusted.", b"security.", b"system."] {
        if let Some(rest) = name.strip_prefix(p) {
            return Err(if rest.is_empty() {
                Error::InvalidInput("empty attribute name".into())
            } else {
                Error::NameTooLong
            });
        }
    }
    Err(Error::Unsupported(format!(
        "xattr namespace of {:?}",
        String::from_utf8_lossy(name)
    )))
}

impl Fs {
    /// All extended attributes of inode `ino` as (full name, value), in-inode first.
    pub fn xattrs_ino(&self, ino: Ino) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let inode = self.read_live_inode(ino)?;
        self.xattrs_ino_raw(ino, &inode)
    }

    pub(crate) fn xattrs_ino_raw(
        &self,
        ino: Ino,
        inode: &Inode,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let (ibody, block) = self.stored_xattrs(ino, inode)?;
        let attrs = ibody.into_iter().chain(block);
        let mut out = Vec::new();
        for a in attrs {
            let Some(name) = a.full_name() else {
                // Unknown name index: not visible to userspace (the kernel skips it).
                continue;
            };
            let value = if a.index == fx::INDEX_POSIX_ACL_ACCESS
                || a.index == fx::INDEX_POSIX_ACL_DEFAULT
            {
                fx::acl_disk_to_vfs(&a.value)
                    .map_err(|e| Error::from(e.at_block(inode.file_acl)))?
            } else {
                a.value
            };
            out.push((name, value));
        }
        Ok(out)
    }

    /// One attribute's value, `None` when absent.
    pub fn get_xattr_ino(&self, ino: Ino, name: &[u8]) -> Result<Option<Vec<u8>>> {
        resolve_name(name)?;
        Ok(self
            .xattrs_ino(ino)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v))
    }
}

/// How `set_xattr` treats an existing attribute (setxattr(2) flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XattrFlags {
    /// XATTR_CREATE: fail with `Exists` if present.
    pub create: bool,
    /// XATTR_REPLACE: fail with `NotFound` if absent.
    pub replace: bool,
}

impl Fs {
    /// All attributes of `ino` in ext4's stored form (ACLs in disk format).
    fn stored_xattrs(&self, ino: Ino, inode: &Inode) -> Result<(Vec<fx::Xattr>, Vec<fx::Xattr>)> {
        let (raw, blk) = self.inode_bytes(ino)?;
        let mut ibody = Vec::new();
        if raw.len() > fx::GOOD_OLD_INODE_SIZE {
            ibody = fx::decode_inode(fx::inode_region(&raw).at(blk)?).at(blk)?;
        }
        let mut block = Vec::new();
        if inode.file_acl != 0 {
            let b = inode.file_acl;
            let seed = self.inner.metadata_csum.then_some(self.inner.csum_seed);
            let data = self.cache().read(b, Kind::Xattr, |d| {
                fx::verify_block(d, seed, b)?;
                Ok(())
            })?;
            block = fx::decode_block(&data).at(b)?.attrs();
        }
        Ok((ibody, block))
    }

    /// setxattr(2). ACL values are given in the VFS format, validated, and stored in
    /// ext4's; setting the access ACL also sets the permission bits (see `acl.rs`).
    pub fn set_xattr_ino(&self, ino: Ino, name: &[u8], value: &[u8], fl: XattrFlags) -> Result<()> {
        let (index, suffix) = resolve_name(name)?;
        if suffix.len() > fx::NAME_MAX {
            return Err(Error::NameTooLong);
        }
        crate::ops::may_change(&self.read_live_inode(ino)?, "setxattr", false)?;
        if index == fx::INDEX_POSIX_ACL_ACCESS || index == fx::INDEX_POSIX_ACL_DEFAULT {
            let entries = crate::acl::parse_vfs(value)?;
            return self.set_acl_ino(ino, index, entries);
        }
        if value.len() > self.inner.block_size as usize {
            return Err(Error::NoSpace);
        }
        let _h = self.handle();
        let _i = self.lock_alone(ino)?;
        self.check_writable()?;
        self.check_user_namespace(ino, index)?;
        crate::ops::may_change(&self.read_live_inode(ino)?, "setxattr", false)?;
        self.update_xattrs(ino, |all, _| {
            let pos = all
                .iter()
                .position(|a| a.index == index && a.name == suffix);
            match (pos, fl.create, fl.replace) {
                (Some(_), true, _) => return Err(Error::Exists),
                (None, _, true) => return Err(Error::NotFound),
                (Some(i), _, _) => all[i].value = value.to_vec(),
                (None, _, _) => all.push(fx::Xattr::new(index, suffix, value)),
            }
            Ok(())
        })
    }

    /// removexattr(2); `NotFound` when absent (ENODATA at the edge). Removing an ACL
    /// that is not there succeeds, as on Linux (the ACL layer asks for "no ACL").
    pub fn remove_xattr_ino(&self, ino: Ino, name: &[u8]) -> Result<()> {
        let (index, suffix) = resolve_name(name)?;
        let is_acl = index == fx::INDEX_POSIX_ACL_ACCESS || index == fx::INDEX_POSIX_ACL_DEFAULT;
        let _h = self.handle();
        let _i = self.lock_alone(ino)?;
        self.check_writable()?;
        self.check_user_namespace(ino, index)?;
        let inode = self.read_live_inode(ino)?;
        crate::ops::may_change(&inode, "removexattr", false)?;
        if is_acl && self.stored_attr(ino, &inode, index, suffix)?.is_none() {
            return Ok(());
        }
        self.update_xattrs(ino, |all, _| {
            let pos = all
                .iter()
                .position(|a| a.index == index && a.name == suffix);
            let i = pos.ok_or(Error::NotFound)?;
            all.remove(i);
            Ok(())
        })
    }

    /// The stored value of attribute (index, suffix) of `ino`, disk form.
    pub(crate) fn stored_attr(
        &self,
        ino: Ino,
        inode: &Inode,
        index: u8,
        suffix: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let (ibody, block) = self.stored_xattrs(ino, inode)?;
        Ok(ibody
            .into_iter()
            .chain(block)
            .find(|a| a.index == index && a.name == suffix)
            .map(|a| a.value))
    }

    /// As in Linux: user.* attributes only on regular files and directories (EPERM).
    fn check_user_namespace(&self, ino: Ino, index: u8) -> Result<()> {
        if index == fx::INDEX_USER {
            let i = self.read_live_inode(ino)?;
            if !i.is_reg() && !i.is_dir() {
                return Err(Error::NotPermitted(
                    "user.* xattrs on this file type".into(),
                ));
            }
        }
        Ok(())
    }

    /// Change the attribute list (and, in the same step, the inode: the ACL code sets
    /// the mode) and lay it out again: as many as fit in the inode (smallest first), the
    /// rest in an xattr block (copy-on-write when shared). Caller holds the inode's lock
    /// (under a handle) or the write lock.
    pub(crate) fn update_xattrs(
        &self,
        ino: Ino,
        f: impl FnOnce(&mut Vec<fx::Xattr>, &mut Inode) -> Result<()>,
    ) -> Result<()> {
        let mut inode = self.read_live_inode(ino)?;
        let (ibody, block) = self.stored_xattrs(ino, &inode)?;
        let mut all: Vec<fx::Xattr> = ibody.into_iter().chain(block).collect();
        f(&mut all, &mut inode)?;
        let (mut raw, _) = self.inode_bytes(ino)?;
        let region_len = fx::inode_region(&raw).map(|r| r.len()).unwrap_or(0);
        all.sort_by_key(|a| fx::entry_size(a.name.len()) + fx::value_size_padded(a.value.len()));
        let mut inside = Vec::new();
        let mut outside = Vec::new();
        for a in all {
            let mut trial = inside.clone();
            trial.push(a.clone());
            if outside.is_empty() && region_len > 0 && fx::fits_in_inode(region_len, &trial) {
                inside = trial;
            } else {
                outside.push(a);
            }
        }
        let bs = self.inner.block_size as usize;
        if !outside.is_empty() && !fx::fits_in_block(bs, &outside) {
            return Err(Error::NoSpace);
        }
        if let Ok(region) = fx::inode_region_mut(&mut raw) {
            fx::encode_inode_region(region, &inside)
                .map_err(|e| Error::InvalidInput(format!("xattr: {e:?}")))?;
        }
        // The block: reuse ours when unshared, else allocate a new one.
        let old = inode.file_acl;
        let old_refs = if old != 0 {
            let d = self.cache().read(old, Kind::Xattr, |_| Ok(()))?;
            u32::from_le_bytes([d[4], d[5], d[6], d[7]])
        } else {
            0
        };
        if outside.is_empty() {
            self.release_xattr_block(&mut inode)?;
        } else {
            let target = if old != 0 && old_refs <= 1 {
                old
            } else {
                if old != 0 {
                    self.release_xattr_block(&mut inode)?;
                }
                let goal = self.data_goal(ino, &inode, 0);
                let (b, _) = self.alloc_blocks(goal, 1)?;
                inode.blocks_raw += bs as u64 / 512;
                b
            };
            let mut data = vec![0u8; bs];
            fx::encode_block(&mut data, &outside, 1)
                .map_err(|e| Error::InvalidInput(format!("xattr: {e:?}")))?;
            if self.inner.metadata_csum {
                fx::set_block_csum(&mut data, self.inner.csum_seed, target);
            }
            self.cache().write(target, Kind::Xattr, data, |_| Ok(()))?;
            inode.file_acl = target;
        }
        inode.ctime = self.now();
        self.write_inode_raw(ino, &raw, &inode)
    }
}
