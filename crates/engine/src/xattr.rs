//! Extended attributes: in-inode entries, the external xattr block and values kept in
//! inodes of their own (ea_inode), merged into the names userspace sees (`user.foo`,
//! `trusted.bar`, `system.posix_acl_access`, ...).
//!
//! POSIX ACLs are stored in ext4's compact format and presented in the Linux VFS
//! format (version 2), as the kernel does. The xattr block is verified (magic, bounds,
//! checksum with the fs seed and its block number) before use.
//!
//! Values in inodes (format notes §2.10, `rext4_format::xattr`): before a value is
//! returned, its inode is checked as the kernel and e2fsck check it (in range, not the
//! file itself, in use, a regular file with EA_INODE_FL, no inline data, no xattrs of
//! its own, its size the entry's, the entry's hash made from the inode's value hash,
//! the value's crc32c that hash, no hole); anything else is `Corrupted`. An EA inode
//! with xattrs is refused, so references never chain. Writing follows the kernel's
//! placement: with ea_inode, a new value whose padded size passes
//! `min_large_value_size` goes to a new inode at once; others are laid out in the
//! inode and the block as before, and while they do not fit (or a new value in the
//! block would eat into `block_reserve`) the largest new value moves to an inode of
//! its own. Existing values stay where they are. rext4 does not share value inodes
//! between equal values on write (the kernel's mbcache does); it reads shared ones and
//! keeps their reference counts exact.
//!
//! Must hold after every change, in the one transaction that makes it: an EA inode's
//! reference count is the number of entries naming it — one per in-inode entry, one per
//! entry of an xattr block whatever the block's own count — and an inode that reaches
//! 0 is freed with its blocks; a file's i_blocks counts, besides its data and xattr
//! block, every value in an inode it names, rounded up to blocks (the kernel charges
//! them there, `ext4_xattr_inode_alloc_quota`; e2fsck checks i_blocks so). A new value
//! inode is created whole — record, extents, data — and named in the same transaction,
//! so a crash leaves either both or neither; its data goes to new blocks before the
//! commit (as a slow symlink's target). A change that fails (no inode, no space) gives
//! back every inode and block it took.
//!
//! Locks: callers hold a handle and the file's inode lock (or the write lock). Reference
//! counts of EA inodes — which several files may share — change as one read-modify-write
//! of their record under its table block's lock (`Fs::change_inode_record`), never with
//! another block lock held. Lockless readers that meet a half-made change (a value
//! inode freed under them) try once more under the write lock before they believe the
//! corruption (as directory reads do).
//!
//! Callers: getxattr/listxattr/setxattr/removexattr of the path API, the mount, the
//! CLI and the bindings; the ACL code (`acl.rs`); the final free of an inode
//! (`ops.rs`, `release_xattrs`); the audit (`check.rs`).

use std::collections::BTreeMap;

use rext4_format::extent::Extent;
use rext4_format::inode::{flags, mode as m, Inode};
use rext4_format::superblock::feature;
use rext4_format::xattr as fx;

use crate::cache::Kind;
use crate::error::{AtBlock, Error, Result};
use crate::fs::inode_write::with_tree;
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};

/// The (index, suffix) of an attribute name, with the kernel's errors: EOPNOTSUPP for
/// an unknown namespace, EINVAL for an empty name after a known prefix, ERANGE-like
/// `NameTooLong` past 255 bytes.
fn resolve_name(name: &[u8]) -> Result<(u8, &[u8])> {
    if let Some(r) = fx::split_name(name) {
        if r.0 == rext4_format::inline::XATTR_INDEX && r.1 == rext4_format::inline::XATTR_NAME {
            // The inline data's own attribute, not userspace's (EOPNOTSUPP, as the
            // kernel answers for it).
            return Err(Error::Unsupported("xattr system.data".into()));
        }
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

/// Whether userspace sees attribute `a`: not `system.data`, the inline data's (the
/// kernel has no handler for its index: not listed, not read, not set).
fn visible(a: &fx::Xattr) -> bool {
    !rext4_format::inline::is_data_attr(a)
}

fn is_acl(index: u8) -> bool {
    index == fx::INDEX_POSIX_ACL_ACCESS || index == fx::INDEX_POSIX_ACL_DEFAULT
}

impl Fs {
    /// All extended attributes of inode `ino` as (full name, value), in-inode first.
    pub fn xattrs_ino(&self, ino: Ino) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.xattrs_settled(|| {
            let inode = self.read_live_inode(ino)?;
            self.xattrs_ino_raw(ino, &inode)
        })
    }

    pub(crate) fn xattrs_ino_raw(
        &self,
        ino: Ino,
        inode: &Inode,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let (ibody, block) = self.stored_xattrs(ino, inode)?;
        let mut out = Vec::new();
        for a in ibody.into_iter().chain(block).filter(visible) {
            let Some(name) = a.full_name() else {
                // Unknown name index: not visible to userspace (the kernel skips it).
                continue;
            };
            let value = self.vfs_value(ino, inode, a)?;
            out.push((name, value));
        }
        Ok(out)
    }

    /// The names of `ino`'s attributes (listxattr), in-inode first: no value is read.
    pub fn xattr_names_ino(&self, ino: Ino) -> Result<Vec<Vec<u8>>> {
        self.xattrs_settled(|| {
            let inode = self.read_live_inode(ino)?;
            let (ibody, block) = self.stored_xattrs(ino, &inode)?;
            Ok(ibody
                .into_iter()
                .chain(block)
                .filter(visible)
                .filter_map(|a| a.full_name())
                .collect())
        })
    }

    /// One attribute's value, `None` when absent.
    pub fn get_xattr_ino(&self, ino: Ino, name: &[u8]) -> Result<Option<Vec<u8>>> {
        resolve_name(name)?;
        self.xattrs_settled(|| {
            let inode = self.read_live_inode(ino)?;
            let (ibody, block) = self.stored_xattrs(ino, &inode)?;
            let found = ibody
                .into_iter()
                .chain(block)
                .filter(visible)
                .find(|a| a.full_name().as_deref() == Some(name));
            found.map(|a| self.vfs_value(ino, &inode, a)).transpose()
        })
    }

    /// A read of attributes that met corruption is tried once more under the write
    /// lock, where no change is in progress: a value inode another thread's setxattr
    /// freed between this reader's look at the entry and at the inode is a change half
    /// seen, not damage. Only a second failure is reported.
    fn xattrs_settled<T>(&self, read: impl Fn() -> Result<T>) -> Result<T> {
        match read() {
            Err(Error::Corrupted { .. }) if !self.inner.read_only && !Fs::holds_write_lock() => {
                let _w = self.write_lock();
                read()
            }
            r => r,
        }
    }

    /// The value of stored attribute `a` of `ino` as userspace sees it: read from its
    /// inode when it lives in one, ACLs in the VFS format.
    fn vfs_value(&self, ino: Ino, inode: &Inode, a: fx::Xattr) -> Result<Vec<u8>> {
        let index = a.index;
        let value = self.stored_value(ino, inode, a)?;
        if is_acl(index) {
            return fx::acl_disk_to_vfs(&value)
                .map_err(|e| Error::from(e.at_block(inode.file_acl)));
        }
        Ok(value)
    }

    /// The value of stored attribute `a` of `ino` in its stored form.
    fn stored_value(&self, ino: Ino, inode: &Inode, a: fx::Xattr) -> Result<Vec<u8>> {
        let Some(v) = a.inode else {
            return Ok(a.value);
        };
        let (ea, lustre) = self.value_inode(ino, inode, &a.name, v)?;
        self.read_value_inode(ino, &a.name, v, &ea, lustre)
    }

    fn has_ea_inode(&self) -> bool {
        self.inner.sb.has_incompat(feature::INCOMPAT_EA_INODE)
    }

    /// Inode `v.inum`, checked as the value of entry `name` of `parent` (see the module
    /// note), and whether it is an old Lustre-style one (no value hash: its mtime names
    /// the parent and its generation is the parent's, which the kernel and e2fsck
    /// accept in place of a matching hash).
    fn value_inode(
        &self,
        parent: Ino,
        parent_inode: &Inode,
        name: &[u8],
        v: fx::ValueInode,
    ) -> Result<(Inode, bool)> {
        let bad = |why: String| {
            Error::corrupted(
                format!(
                    "xattr {:?} of inode {}: value inode {}: {why}",
                    String::from_utf8_lossy(name),
                    parent.0,
                    v.inum
                ),
                None,
            )
        };
        if !self.has_ea_inode() {
            return Err(bad("named without the ea_inode feature".into()));
        }
        let sb = &self.inner.sb;
        if v.inum < sb.first_ino || v.inum > sb.inodes_count {
            return Err(bad(format!(
                "out of range ({}..={})",
                sb.first_ino, sb.inodes_count
            )));
        }
        if v.inum == parent.0 {
            return Err(bad("is the file itself".into()));
        }
        if v.size == 0 {
            return Err(bad("an empty value in an inode".into()));
        }
        let ea_ino = Ino(v.inum);
        let e = self.read_inode(ea_ino)?;
        if e.mode == 0 || e.links_count == 0 {
            return Err(bad("not in use".into()));
        }
        if !e.is_reg() {
            return Err(bad(format!("not a regular file (mode {:o})", e.mode)));
        }
        if !e.has_flag(flags::EA_INODE) {
            return Err(bad("has no EA_INODE flag".into()));
        }
        if e.has_flag(flags::INLINE_DATA) {
            return Err(bad("has inline data".into()));
        }
        if e.file_acl != 0 || self.has_ibody_xattrs(ea_ino)? {
            return Err(bad("has extended attributes of its own".into()));
        }
        if e.size != u64::from(v.size) {
            return Err(bad(format!(
                "holds {} bytes, the entry says {}",
                e.size, v.size
            )));
        }
        let hash = fx::ea_inode_hash(&e);
        if v.hash_matches(name, hash) {
            return Ok((e, false));
        }
        if e.mtime.sec as u32 == parent.0 && e.generation == parent_inode.generation {
            return Ok((e, true));
        }
        Err(bad(format!(
            "the entry's hash is not made from the inode's value hash {hash:#010x}"
        )))
    }

    /// Whether inode `ino`'s record holds in-inode attributes.
    fn has_ibody_xattrs(&self, ino: Ino) -> Result<bool> {
        let (raw, blk) = self.inode_bytes(ino)?;
        if raw.len() <= fx::GOOD_OLD_INODE_SIZE {
            return Ok(false);
        }
        let region = fx::inode_region(&raw).at(blk)?;
        Ok(region.len() >= fx::IBODY_HEADER_SIZE
            && u32::from_le_bytes([region[0], region[1], region[2], region[3]]) == fx::MAGIC)
    }

    /// The value held by value inode `e` (checked by `value_inode`): its blocks in
    /// order, no hole, and their crc32c the inode's value hash.
    fn read_value_inode(
        &self,
        parent: Ino,
        name: &[u8],
        v: fx::ValueInode,
        e: &Inode,
        lustre: bool,
    ) -> Result<Vec<u8>> {
        let bad = |why: &str| {
            Error::corrupted(
                format!(
                    "xattr {:?} of inode {}: value inode {}: {why}",
                    String::from_utf8_lossy(name),
                    parent.0,
                    v.inum
                ),
                None,
            )
        };
        let bs = self.inner.block_size as usize;
        let len = v.size as usize;
        let mut buf = vec![0u8; len];
        let mut done = 0usize;
        while done < len {
            let lblk = (done / bs) as u64;
            match self.map_block(Ino(v.inum), e, lblk)? {
                Mapping::Mapped {
                    physical,
                    len: run,
                    unwritten: false,
                } => {
                    let run_bytes = usize::try_from(run)
                        .unwrap_or(usize::MAX)
                        .saturating_mul(bs);
                    let n = (len - done).min(run_bytes);
                    self.read_data_init(&mut buf[done..done + n], physical * bs as u64)?;
                    done += n;
                }
                _ => return Err(bad("has a hole")),
            }
        }
        if !lustre && fx::ea_value_hash(self.inner.csum_seed, &buf) != fx::ea_inode_hash(e) {
            return Err(bad("its data does not match its value hash"));
        }
        Ok(buf)
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

/// The attributes of an inode laid out: indexes into the list, in the inode's area and
/// in the block (empty: no block).
struct Layout {
    inside: Vec<usize>,
    outside: Vec<usize>,
}

/// Bytes a stored attribute takes in an area (entry and, for a value kept there, the
/// padded value).
fn area_bytes(a: &fx::Xattr) -> usize {
    fx::entry_size(a.name.len()) + fx::value_size_padded(a.value.len())
}

/// As many attributes as fit in the inode's area of `region_len` bytes (smallest
/// first), the rest in the block; `None` when the rest do not fit a block of `bs`.
fn lay_out(all: &[fx::Xattr], region_len: usize, bs: usize) -> Option<Layout> {
    let mut order: Vec<usize> = (0..all.len()).collect();
    // The inline data's `system.data` is placed first and must stay in the inode.
    order.sort_by_key(|&i| {
        (
            !rext4_format::inline::is_data_attr(&all[i]),
            area_bytes(&all[i]),
        )
    });
    let mut inside: Vec<usize> = Vec::new();
    let mut outside = Vec::new();
    for i in order {
        let mut trial: Vec<fx::Xattr> = inside.iter().map(|&j| all[j].clone()).collect();
        trial.push(all[i].clone());
        if outside.is_empty() && region_len > 0 && fx::fits_in_inode(region_len, &trial) {
            inside.push(i);
        } else if rext4_format::inline::is_data_attr(&all[i]) {
            return None;
        } else {
            outside.push(i);
        }
    }
    let block: Vec<fx::Xattr> = outside.iter().map(|&i| all[i].clone()).collect();
    (outside.is_empty() || fx::fits_in_block(bs, &block)).then_some(Layout { inside, outside })
}

/// i_blocks (512-byte units) a file is charged for a value of `size` bytes in an inode
/// of its own: the value's blocks (clusters, were there bigalloc).
fn value_charge_512(size: u32, bs: u32) -> u64 {
    u64::from(size).div_ceil(u64::from(bs)) * u64::from(bs / 512)
}

impl Fs {
    /// All attributes of `ino` in ext4's stored form (ACLs in disk format; values in
    /// inodes not read: `inode` set, `value` empty).
    fn stored_xattrs(&self, ino: Ino, inode: &Inode) -> Result<(Vec<fx::Xattr>, Vec<fx::Xattr>)> {
        let (raw, blk) = self.inode_bytes(ino)?;
        let mut ibody = Vec::new();
        if raw.len() > fx::GOOD_OLD_INODE_SIZE {
            ibody = fx::decode_inode(fx::inode_region(&raw).at(blk)?).at(blk)?;
        }
        let mut block = Vec::new();
        if inode.file_acl != 0 {
            block = self.xattr_block(inode.file_acl)?.attrs();
        }
        Ok((ibody, block))
    }

    /// The verified xattr block `b`.
    fn xattr_block(&self, b: u64) -> Result<fx::XattrBlock> {
        let seed = self.inner.metadata_csum.then_some(self.inner.csum_seed);
        let data = self.cache().read(b, Kind::Xattr, |d| {
            fx::verify_block(d, seed, b)?;
            Ok(())
        })?;
        fx::decode_block(&data).at(b)
    }

    /// setxattr(2). ACL values are given in the VFS format, validated, and stored in
    /// ext4's; setting the access ACL also sets the permission bits (see `acl.rs`).
    /// Values larger than what fits go to an inode of their own with ea_inode (up to
    /// `XATTR_SIZE_MAX`); without it, ENOSPC as the kernel answers.
    pub fn set_xattr_ino(&self, ino: Ino, name: &[u8], value: &[u8], fl: XattrFlags) -> Result<()> {
        let (index, suffix) = resolve_name(name)?;
        if suffix.len() > fx::NAME_MAX {
            return Err(Error::NameTooLong);
        }
        if value.len() > fx::XATTR_SIZE_MAX {
            return Err(Error::InvalidInput(format!(
                "xattr value of {} bytes: more than XATTR_SIZE_MAX ({})",
                value.len(),
                fx::XATTR_SIZE_MAX
            )));
        }
        crate::ops::may_change(&self.read_live_inode(ino)?, "setxattr", false)?;
        if is_acl(index) {
            let entries = crate::acl::parse_vfs(value)?;
            return self.set_acl_ino(ino, index, entries);
        }
        if value.len() > self.max_value_len() {
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
                // (The same value again stays where it is; one that lives in an inode
                // is stored anew, as the kernel stores it.)
                (Some(i), _, _) => all[i] = fx::Xattr::new(index, suffix, value),
                (None, _, _) => all.push(fx::Xattr::new(index, suffix, value)),
            }
            Ok(())
        })
    }

    /// The largest value this filesystem stores: XATTR_SIZE_MAX with ea_inode, else
    /// what one block holds.
    pub(crate) fn max_value_len(&self) -> usize {
        if self.has_ea_inode() {
            fx::XATTR_SIZE_MAX
        } else {
            self.inner.block_size as usize
        }
    }

    /// removexattr(2); `NotFound` when absent (ENODATA at the edge). Removing an ACL
    /// that is not there succeeds, as on Linux (the ACL layer asks for "no ACL").
    pub fn remove_xattr_ino(&self, ino: Ino, name: &[u8]) -> Result<()> {
        let (index, suffix) = resolve_name(name)?;
        let _h = self.handle();
        let _i = self.lock_alone(ino)?;
        self.check_writable()?;
        self.check_user_namespace(ino, index)?;
        let inode = self.read_live_inode(ino)?;
        crate::ops::may_change(&inode, "removexattr", false)?;
        let (ibody, block) = self.stored_xattrs(ino, &inode)?;
        let present = ibody
            .iter()
            .chain(&block)
            .any(|a| a.index == index && a.name == suffix);
        if is_acl(index) && !present {
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

    /// The stored value of attribute (index, suffix) of `ino`, disk form (read from its
    /// inode when it lives in one).
    pub(crate) fn stored_attr(
        &self,
        ino: Ino,
        inode: &Inode,
        index: u8,
        suffix: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let (ibody, block) = self.stored_xattrs(ino, inode)?;
        let found = ibody
            .into_iter()
            .chain(block)
            .find(|a| a.index == index && a.name == suffix);
        found.map(|a| self.stored_value(ino, inode, a)).transpose()
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
    /// rest in an xattr block (copy-on-write when shared), values the closure added in
    /// inodes of their own where the kernel would put them (see the module note). The
    /// closure sees values in inodes as entries with `inode` set; it replaces an
    /// attribute by a new `Xattr` (never edits one in place). Caller holds the inode's
    /// lock (under a handle) or the write lock.
    pub(crate) fn update_xattrs(
        &self,
        ino: Ino,
        f: impl FnOnce(&mut Vec<fx::Xattr>, &mut Inode) -> Result<()>,
    ) -> Result<()> {
        let mut inode = self.read_live_inode(ino)?;
        let (ibody, block) = self.stored_xattrs(ino, &inode)?;
        let old: Vec<fx::Xattr> = ibody.iter().chain(&block).cloned().collect();
        let mut all = old.clone();
        f(&mut all, &mut inode)?;
        let (mut raw, _) = self.inode_bytes(ino)?;
        let region_len = fx::inode_region(&raw).map(|r| r.len()).unwrap_or(0);
        let bs = self.inner.block_size as usize;
        let ea = self.has_ea_inode();

        // Where each value goes: new values (not in the old list) may go to inodes of
        // their own; `to_inode[i]` marks them, `all[i]` keeps the value meanwhile.
        let fresh: Vec<bool> = all
            .iter()
            .map(|a| a.inode.is_none() && !old.contains(a))
            .collect();
        for a in &all {
            if a.inode.is_none() && a.value.len() > self.max_value_len() {
                return Err(Error::NoSpace);
            }
        }
        let mut to_inode: Vec<bool> = all
            .iter()
            .zip(&fresh)
            .map(|(a, &new)| {
                ea && new && fx::value_size_padded(a.value.len()) > fx::min_large_value_size(bs)
            })
            .collect();
        let placeholder = |all: &[fx::Xattr], to_inode: &[bool]| -> Vec<fx::Xattr> {
            all.iter()
                .zip(to_inode)
                .map(|(a, &out)| {
                    if out {
                        // Only its entry takes room: a stand-in for the inode to come.
                        fx::Xattr::in_inode(
                            a.index,
                            &a.name,
                            fx::ValueInode {
                                inum: u32::MAX,
                                size: a.value.len() as u32,
                                hash: 0,
                            },
                        )
                    } else {
                        a.clone()
                    }
                })
                .collect()
        };
        let layout = loop {
            let trial = placeholder(&all, &to_inode);
            let laid = lay_out(&trial, region_len, bs);
            let ok = laid.as_ref().is_some_and(|l| {
                // With ea_inode a new value in the block leaves the kernel's reserve.
                let values: usize = l
                    .outside
                    .iter()
                    .map(|&i| fx::value_size_padded(trial[i].value.len()))
                    .sum();
                let new_in_block = l
                    .outside
                    .iter()
                    .any(|&i| fresh[i] && !to_inode[i] && !trial[i].value.is_empty());
                !ea || !new_in_block || bs.saturating_sub(values) >= fx::block_reserve(bs)
            });
            if ok {
                if let Some(l) = laid {
                    break l;
                }
            }
            // Too much: the largest new value still in an area goes to an inode.
            let next = (0..all.len())
                .filter(|&i| ea && fresh[i] && !to_inode[i] && !all[i].value.is_empty())
                .max_by_key(|&i| all[i].value.len());
            match next {
                Some(i) => to_inode[i] = true,
                None => return Err(Error::NoSpace),
            }
        };

        // Reference changes of the value inodes that exist already: -1 for each entry
        // that goes away, +1 for each entry made (a rewritten or new block names its
        // values anew; a shared block copied leaves its own references as they are).
        let old_blk = inode.file_acl;
        let old_refs = if old_blk != 0 {
            self.xattr_block(old_blk)?.header.refcount
        } else {
            0
        };
        let in_place = old_blk != 0 && old_refs <= 1 && !layout.outside.is_empty();
        let mut delta: BTreeMap<u32, i64> = BTreeMap::new();
        let mut named: BTreeMap<u32, (Vec<u8>, fx::ValueInode)> = BTreeMap::new();
        let mut count = |a: &fx::Xattr, d: i64| {
            if let Some(v) = a.inode {
                *delta.entry(v.inum).or_default() += d;
                named.entry(v.inum).or_insert_with(|| (a.name.clone(), v));
            }
        };
        for a in &ibody {
            count(a, -1);
        }
        if old_blk != 0 && old_refs <= 1 {
            for a in &block {
                count(a, -1);
            }
        }
        for &i in &layout.inside {
            count(&all[i], 1);
        }
        for &i in &layout.outside {
            count(&all[i], 1);
        }
        delta.retain(|_, d| *d != 0);
        // Every inode whose count changes must be a sound value inode first: nothing
        // changes when one is not.
        for inum in delta.keys() {
            let (name, v) = &named[inum];
            self.value_inode(ino, &inode, name, *v)?;
        }

        // What may fail for lack of space comes first, and is given back on failure:
        // the new block, then the new value inodes.
        let new_blk = if !layout.outside.is_empty() && !in_place {
            let goal = self.data_goal(ino, &inode, 0);
            Some(self.alloc_blocks(goal, 1)?.0)
        } else {
            None
        };
        let mut made: Vec<Ino> = Vec::new();
        let written = (|| {
            for i in 0..all.len() {
                if to_inode[i] {
                    let v = self.create_value_inode(ino, &inode, &all[i].value)?;
                    made.push(Ino(v.inum));
                    all[i] = fx::Xattr::in_inode(all[i].index, &all[i].name, v);
                }
            }
            let inside: Vec<fx::Xattr> = layout.inside.iter().map(|&i| all[i].clone()).collect();
            let outside: Vec<fx::Xattr> = layout.outside.iter().map(|&i| all[i].clone()).collect();
            if let Ok(region) = fx::inode_region_mut(&mut raw) {
                fx::encode_inode_region(region, &inside)
                    .map_err(|e| Error::InvalidInput(format!("xattr: {e}")))?;
            }
            let target = if in_place { Some(old_blk) } else { new_blk };
            if let Some(t) = target {
                let mut data = vec![0u8; bs];
                fx::encode_block(&mut data, &outside, 1)
                    .map_err(|e| Error::InvalidInput(format!("xattr: {e}")))?;
                if self.inner.metadata_csum {
                    fx::set_block_csum(&mut data, self.inner.csum_seed, t);
                }
                self.cache().write(t, Kind::Xattr, data, |_| Ok(()))?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            // Best effort: the first error is the one to report.
            for &v in &made {
                if let Ok(i) = self.read_inode(v) {
                    let _ = self.free_inode_and_blocks(v, i);
                }
            }
            if let Some(b) = new_blk {
                let _ = self.free_blocks(b, 1);
            }
            return Err(e);
        }

        // The old block: kept (rewritten in place), or given up — freed with its last
        // reference, whose values then lose the block's entries.
        let mut dropped = Vec::new();
        if old_blk != 0 && !in_place {
            dropped = self.release_xattr_block(&mut inode)?;
            if old_refs <= 1 {
                // Counted above already.
                dropped.clear();
            }
        }
        if let Some(b) = new_blk {
            inode.file_acl = b;
            // The block's whole cluster (bigalloc).
            inode.blocks_raw += (bs as u64 / 512) << self.cluster_bits();
        }
        self.charge_values(&mut inode, &old, &all);
        inode.ctime = self.now();
        self.write_inode_raw(ino, &raw, &inode)?;
        let mut first_err = None;
        for (inum, d) in delta {
            if let Err(e) = self.change_value_refs(Ino(inum), d) {
                first_err.get_or_insert(e);
            }
        }
        for a in dropped {
            if let Err(e) = self.drop_value_ref(ino, &inode, &a) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The quota hook of values in inodes of their own. The kernel charges the owner of
    /// a file naming such a value one inode and the value's size in clusters, however
    /// many files share the value inode (`ext4_xattr_inode_alloc_quota`, given back by
    /// `ext4_xattr_inode_free_quota`), and charges the value inode itself to nobody;
    /// the charge shows in the file's i_blocks, which e2fsck checks. rext4 has no quota
    /// yet: this moves i_blocks from what the file named (`before`) to what it names
    /// (`after`); quota accounting belongs here too. (A file's final free takes its
    /// charges with it: `release_xattrs`.)
    fn charge_values(&self, inode: &mut Inode, before: &[fx::Xattr], after: &[fx::Xattr]) {
        // Charged in clusters with bigalloc.
        let bs = self.inner.block_size << self.cluster_bits();
        let charge = |attrs: &[fx::Xattr]| -> u64 {
            attrs
                .iter()
                .filter_map(|a| a.inode)
                .map(|v| value_charge_512(v.size, bs))
                .sum()
        };
        inode.blocks_raw = (inode.blocks_raw + charge(after)).saturating_sub(charge(before));
    }

    /// A new value inode holding `value` for file `parent` (as the kernel's
    /// `ext4_xattr_inode_create`: a regular file, mode 0600, the parent's owner, flags
    /// EA_INODE and EXTENTS, one link, reference count 1, the value's hash in its atime,
    /// ctime 0; its blocks allocated near the parent, the data written to them). On
    /// failure nothing of it is left.
    fn create_value_inode(
        &self,
        parent: Ino,
        parent_inode: &Inode,
        value: &[u8],
    ) -> Result<fx::ValueInode> {
        if !self.uses_extents() {
            return Err(Error::Unsupported(
                "values in inodes on a filesystem without extents".into(),
            ));
        }
        let hash = fx::ea_value_hash(self.inner.csum_seed, value);
        let ino = self.alloc_inode(parent, false)?;
        let mut written = false;
        let made = (|| {
            let mut e = self.new_inode(m::S_IFREG | 0o600, parent_inode.uid, parent_inode.gid);
            e.flags |= flags::EA_INODE;
            self.map_by_extents(&mut e);
            fx::set_ea_inode_refs(&mut e, 1);
            fx::set_ea_inode_hash(&mut e, hash);
            // Recorded first, so that a failure below frees what it got with it.
            self.write_new_inode(ino, &e)?;
            written = true;
            let bs = self.inner.block_size as usize;
            let nblocks = value.len().div_ceil(bs) as u64;
            let mut lblk = 0u64;
            while lblk < nblocks {
                let want = (nblocks - lblk).min(u64::from(u16::MAX >> 1));
                let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
                let run =
                    crate::fs::inode_write::alloc_data_run(self, ino, &e, lblk, want, &mut alloc)?;
                let (p, n) = (run.physical, run.len as u32);
                let put = with_tree(self, ino, &mut e, |t| {
                    t.insert(Extent {
                        logical: lblk as u32,
                        len: n as u16,
                        physical: p,
                        unwritten: false,
                    })
                });
                if let Err(err) = put {
                    crate::fs::inode_write::undo_data_run(self, &run);
                    return Err(err);
                }
                e.blocks_raw += run.fresh * bs as u64 / 512;
                self.write_inode(ino, &e)?;
                let from = lblk as usize * bs;
                let to = (from + n as usize * bs).min(value.len());
                let mut data = vec![0u8; n as usize * bs];
                data[..to - from].copy_from_slice(&value[from..to]);
                self.write_data(&data, p * bs as u64)?;
                lblk += u64::from(n);
            }
            e.size = value.len() as u64;
            self.write_inode(ino, &e)
        })();
        if let Err(err) = made {
            // Best effort: the first error is the one to report.
            let _ = match self.read_inode(ino) {
                Ok(i) if written && i.mode != 0 => self.free_inode_and_blocks(ino, i),
                _ => self.free_inode(ino, false),
            };
            return Err(err);
        }
        Ok(fx::ValueInode {
            inum: ino.0,
            size: value.len() as u32,
            hash,
        })
    }

    /// Change value inode `ea`'s reference count by `delta` (one read-modify-write of
    /// its record under its table block's lock: files sharing it change it beside each
    /// other); free it with its blocks when no entry names it any more.
    fn change_value_refs(&self, ea: Ino, delta: i64) -> Result<()> {
        let mut left = 1u64;
        self.change_inode_record(ea, |e| {
            let refs = fx::ea_inode_refs(e);
            left = if delta < 0 {
                refs.saturating_sub(delta.unsigned_abs())
            } else {
                refs.saturating_add(delta as u64)
            };
            fx::set_ea_inode_refs(e, left);
        })?;
        if left == 0 {
            // No entry names it: nobody else can reach it.
            let e = self.read_inode(ea)?;
            self.free_inode_and_blocks(ea, e)?;
        }
        Ok(())
    }

    /// Drop the reference entry `a` of `parent` holds on its value inode, if it has
    /// one — checked first; a broken reference is left alone and reported.
    fn drop_value_ref(&self, parent: Ino, parent_inode: &Inode, a: &fx::Xattr) -> Result<()> {
        let Some(v) = a.inode else {
            return Ok(());
        };
        self.value_inode(parent, parent_inode, &a.name, v)?;
        self.change_value_refs(Ino(v.inum), -1)
    }

    /// On the final free of inode `ino`: drop the references its in-inode entries hold
    /// on value inodes, and its xattr block (freed with its last reference, and then the
    /// block's references too). A broken reference does not stop the free (the kernel
    /// skips it as well): it is reported as an error of the filesystem, for e2fsck.
    /// (Quota, once there, gives back the file's charges for every value it names here,
    /// as `ext4_xattr_delete_inode` does: see `charge_values`.)
    pub(crate) fn release_xattrs(&self, ino: Ino, inode: &mut Inode) -> Result<()> {
        let mut values = Vec::new();
        if self.has_ea_inode() {
            let (raw, blk) = self.inode_bytes(ino)?;
            if raw.len() > fx::GOOD_OLD_INODE_SIZE {
                match fx::inode_region(&raw).and_then(fx::decode_inode) {
                    Ok(ibody) => values.extend(ibody.into_iter().filter(|a| a.inode.is_some())),
                    Err(e) => self.note_error(&Error::from(e.at_block(blk))),
                }
            }
        }
        values.extend(self.release_xattr_block(inode)?);
        for a in &values {
            if let Err(e) = self.drop_value_ref(ino, inode, a) {
                if !matches!(e, Error::Corrupted { .. }) {
                    return Err(e);
                }
                log::warn!("rext4: freeing inode {}: {e}", ino.0);
                self.note_error(&e);
            }
        }
        Ok(())
    }

    /// Drop this inode's reference to its xattr block, freeing the block with the last
    /// one. Returns the block's entries whose values live in inodes when it was freed
    /// (their references are the caller's to drop), else nothing.
    pub(crate) fn release_xattr_block(&self, inode: &mut Inode) -> Result<Vec<fx::Xattr>> {
        let blk = inode.file_acl;
        if blk == 0 {
            return Ok(Vec::new());
        }
        let mut values = Vec::new();
        {
            // A shared block's count is changed by each of its inodes' writers.
            let _b = self.block_lock(blk);
            let data = self.cache().read(blk, Kind::Xattr, |_| Ok(()))?.to_vec();
            let refs = u32::from_le_bytes([data[4], data[5], data[6], data[7]]);
            if refs <= 1 {
                if self.has_ea_inode() {
                    match fx::decode_block(&data) {
                        Ok(b) => values.extend(b.attrs().into_iter().filter(|a| a.inode.is_some())),
                        Err(e) => self.note_error(&Error::from(e.at_block(blk))),
                    }
                }
                self.free_blocks(blk, 1)?;
            } else {
                let mut d = data;
                d[4..8].copy_from_slice(&(refs - 1).to_le_bytes());
                if self.inner.metadata_csum {
                    fx::set_block_csum(&mut d, self.inner.csum_seed, blk);
                }
                self.cache().write(blk, Kind::Xattr, d, |_| Ok(()))?;
            }
        }
        inode.file_acl = 0;
        inode.blocks_raw = inode
            .blocks_raw
            .saturating_sub((u64::from(self.inner.block_size) / 512) << self.cluster_bits());
        Ok(values)
    }
}
