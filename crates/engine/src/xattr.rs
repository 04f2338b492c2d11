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
        let (raw, blk) = self.inode_bytes(ino)?;
        let mut attrs = Vec::new();
        if raw.len() > fx::GOOD_OLD_INODE_SIZE {
            let region = fx::inode_region(&raw).at(blk)?;
            attrs.extend(fx::decode_inode(region).at(blk)?);
        }
        if inode.file_acl != 0 {
            let b = inode.file_acl;
            let seed = self.inner.metadata_csum.then_some(self.inner.csum_seed);
            let data = self.cache().read(b, Kind::Xattr, |d| {
                fx::verify_block(d, seed, b)?;
                Ok(())
            })?;
            attrs.extend(fx::decode_block(&data).at(b)?.attrs());
        }
        let mut out = Vec::with_capacity(attrs.len());
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
        Ok(self
            .xattrs_ino(ino)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v))
    }
}
