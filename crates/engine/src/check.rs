//! A read-only metadata audit: visit every metadata block of the filesystem and verify
//! it the way the readers do, collecting problems instead of stopping at the first.
//!
//! Visits: group descriptors (at open), block and inode bitmaps (checksums, padding),
//! every in-use inode record (checksum, decodable), each inode's extent-tree blocks or
//! block map (its indirect blocks),
//! directory blocks (leaf or index), xattr block, slow-symlink target, the orphan-file
//! blocks and the journal superblock. It is the basis of `fsck` and of the tests that
//! check "every checksum of every metadata block verifies".
//!
//! Bounded on any image: per inode, tree walks follow the same depth rules as the
//! readers; the list of visited blocks is capped by the filesystem size.

use rext4_format::extent::{self, Node};
use rext4_format::group::{FLAG_BLOCK_UNINIT, FLAG_INODE_UNINIT};
use rext4_format::inode::{flags, Inode};
use rext4_format::{bitmap, jbd2, orphan};

use crate::cache::Kind;
use crate::error::{Error, Result};
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};

/// A metadata block and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetaKind {
    Superblock,
    GroupDesc,
    BlockBitmap,
    InodeBitmap,
    InodeTable,
    ExtentNode,
    DirBlock,
    XattrBlock,
    SymlinkBlock,
    /// An IND, DIND or TIND block of an ext2/3 block map (no checksum of its own).
    IndirectBlock,
    OrphanBlock,
    JournalSuperblock,
}

/// What the audit found.
#[derive(Debug, Default)]
pub struct Audit {
    /// Every metadata block visited, with its kind (inode tables: only blocks holding
    /// in-use inodes).
    pub blocks: Vec<(u64, MetaKind)>,
    pub inodes_checked: u64,
    pub problems: Vec<Error>,
}

impl Fs {
    /// Verify every metadata block; problems are collected, not returned early.
    pub fn audit(&self) -> Result<Audit> {
        let mut a = Audit::default();
        let sb = self.superblock().clone();
        let bs = u64::from(self.block_size());
        a.blocks
            .push((u64::from(sb.first_data_block), MetaKind::Superblock));
        for i in 0..sb.desc_blocks() {
            a.blocks
                .push((sb.desc_block_location(i), MetaKind::GroupDesc));
        }
        let seed = self.inner.csum_seed;
        let wide = sb.desc_size() >= 64;
        let csum = self.inner.metadata_csum;
        let ipg = sb.inodes_per_group;
        let isz = u64::from(sb.inode_size);
        for (g, gd) in self.group_descs().iter().enumerate() {
            let g = g as u64;
            if !gd.has_flag(FLAG_BLOCK_UNINIT) {
                a.blocks.push((gd.block_bitmap, MetaKind::BlockBitmap));
                let r = self.cache().read(gd.block_bitmap, Kind::Bitmap, |b| {
                    if csum {
                        bitmap::verify_csum(
                            b,
                            sb.clusters_per_group,
                            seed,
                            gd.block_bitmap_csum,
                            wide,
                        )?;
                    }
                    // A bit per cluster (per block without bigalloc).
                    let valid = sb.clusters_in_group(g);
                    bitmap::verify_padding(b, valid, u64::from(sb.clusters_per_group))?;
                    Ok(())
                });
                if let Err(e) = r {
                    a.problems.push(e);
                }
            }
            if gd.has_flag(FLAG_INODE_UNINIT) {
                continue;
            }
            a.blocks.push((gd.inode_bitmap, MetaKind::InodeBitmap));
            let ib = self.cache().read(gd.inode_bitmap, Kind::Bitmap, |b| {
                if csum {
                    bitmap::verify_csum(b, ipg, seed, gd.inode_bitmap_csum, wide)?;
                }
                bitmap::verify_padding(b, u64::from(ipg), bs * 8)?;
                Ok(())
            });
            let ib = match ib {
                Ok(b) => b,
                Err(e) => {
                    a.problems.push(e);
                    continue;
                }
            };
            let mut last_tbl = None;
            for i in 0..u64::from(ipg) {
                if !bitmap::test(&ib, i) {
                    continue;
                }
                let ino = Ino((g * u64::from(ipg) + i + 1) as u32);
                let tbl = gd.inode_table + i * isz / bs;
                if last_tbl != Some(tbl) {
                    a.blocks.push((tbl, MetaKind::InodeTable));
                    last_tbl = Some(tbl);
                }
                a.inodes_checked += 1;
                match self.read_inode(ino) {
                    Ok(inode) => self.audit_inode(ino, &inode, &mut a),
                    Err(e) => a.problems.push(e),
                }
            }
        }
        if sb.journal_inum != 0 {
            self.audit_journal(Ino(sb.journal_inum), &mut a);
        }
        for d in self.check_counts()? {
            a.problems.push(Error::corrupted(d, None));
        }
        Ok(a)
    }

    /// Compare each group's free-block, free-inode and used-directory counts with
    /// what its bitmaps and inode table hold, and the superblock's totals with their
    /// sums (what e2fsck's pass 5 checks): one line per difference, none when they
    /// agree. On a read-write filesystem it holds the write lock, so it sees the
    /// counts between operations.
    pub fn check_counts(&self) -> Result<Vec<String>> {
        let _w = (!self.inner.read_only).then(|| self.write_lock());
        let sb = self.superblock();
        let ipg = u64::from(sb.inodes_per_group);
        let mut diffs = Vec::new();
        let (mut free_blocks, mut free_inodes) = (0u64, 0u64);
        for (g, gd) in self.group_descs().iter().enumerate() {
            let bb = if gd.has_flag(FLAG_BLOCK_UNINIT) {
                self.uninit_block_bitmap(g)
            } else {
                self.cache()
                    .read(gd.block_bitmap, Kind::Bitmap, |_| Ok(()))?
                    .to_vec()
            };
            // Bits and the group's count are clusters, the superblock's total blocks.
            let n = sb.clusters_in_group(g as u64);
            let fb = n - bitmap::count_set(&bb, n);
            if fb != u64::from(gd.free_blocks_count) {
                diffs.push(format!(
                    "group {g}: {} free clusters counted, the bitmap has {fb}",
                    gd.free_blocks_count
                ));
            }
            free_blocks += fb << sb.cluster_bits();
            let (fi, dirs) = if gd.has_flag(FLAG_INODE_UNINIT) {
                (ipg, 0)
            } else {
                let ib = self
                    .cache()
                    .read(gd.inode_bitmap, Kind::Bitmap, |_| Ok(()))?
                    .to_vec();
                let mut fi = 0;
                let mut dirs = 0;
                for i in 0..ipg {
                    if !bitmap::test(&ib, i) {
                        fi += 1;
                    } else if self
                        .read_inode(Ino((g as u64 * ipg + i + 1) as u32))
                        .is_ok_and(|inode| inode.is_dir())
                    {
                        dirs += 1;
                    }
                }
                (fi, dirs)
            };
            if fi != u64::from(gd.free_inodes_count) {
                diffs.push(format!(
                    "group {g}: {} free inodes counted, the bitmap has {fi}",
                    gd.free_inodes_count
                ));
            }
            if dirs != u64::from(gd.used_dirs_count) {
                diffs.push(format!(
                    "group {g}: {} directories counted, the inode table has {dirs}",
                    gd.used_dirs_count
                ));
            }
            free_inodes += fi;
        }
        if free_blocks != sb.free_blocks_count {
            diffs.push(format!(
                "superblock: {} free blocks, the groups have {free_blocks}",
                sb.free_blocks_count
            ));
        }
        if free_inodes != u64::from(sb.free_inodes_count) {
            diffs.push(format!(
                "superblock: {} free inodes, the groups have {free_inodes}",
                sb.free_inodes_count
            ));
        }
        Ok(diffs)
    }

    /// What the audit finds wrong with inode `ino` as its record is now: for a change
    /// that checks what it built before it commits (fast-commit replay).
    pub(crate) fn audit_one_inode(&self, ino: Ino) -> Result<Vec<Error>> {
        let inode = self.read_inode(ino)?;
        let mut a = Audit::default();
        self.audit_inode(ino, &inode, &mut a);
        Ok(a.problems)
    }

    fn audit_inode(&self, ino: Ino, inode: &Inode, a: &mut Audit) {
        if inode.mode == 0 || (inode.links_count == 0 && inode.dtime != 0) {
            return; // reserved-but-unused or deleted
        }
        if inode.file_acl != 0 {
            a.blocks.push((inode.file_acl, MetaKind::XattrBlock));
        }
        if let Err(e) = self.xattrs_ino_raw(ino, inode) {
            a.problems.push(e);
        }
        if inode.has_flag(flags::EXTENTS) {
            if let Err(e) = self.audit_extents(ino, inode, a) {
                a.problems.push(e);
            }
        } else if crate::fs::inode_write::uses_block_map(inode) {
            // Every pointer inside the filesystem, no block mapped twice.
            match crate::fs::inode_write::block_map_report(self, ino, inode) {
                Ok(rep) => a
                    .blocks
                    .extend(rep.indirect.iter().map(|&b| (b, MetaKind::IndirectBlock))),
                Err(e) => a.problems.push(e),
            }
        }
        let sb = self.superblock();
        if inode.is_dir() {
            if let Err(e) = self.read_dir_ino(ino) {
                a.problems.push(e);
            }
            let bs = u64::from(self.block_size());
            for l in 0..(inode.size / bs).min(sb.blocks_count) {
                if let Ok(Mapping::Mapped { physical, .. }) = self.map_block(ino, inode, l) {
                    a.blocks.push((physical, MetaKind::DirBlock));
                }
            }
        } else if inode.is_symlink() {
            if !inode.is_fast_symlink(self.block_size()) {
                if let Ok(Mapping::Mapped { physical, .. }) = self.map_block(ino, inode, 0) {
                    a.blocks.push((physical, MetaKind::SymlinkBlock));
                }
            }
            if let Err(e) = self.symlink_target(ino, inode) {
                a.problems.push(e);
            }
        }
        if sb.orphan_file_inum != 0 && ino.0 == sb.orphan_file_inum {
            self.audit_orphan_file(ino, inode, a);
        }
    }

    /// Walk every node of the extent tree, verifying each block.
    fn audit_extents(&self, ino: Ino, inode: &Inode, a: &mut Audit) -> Result<()> {
        let root = Node::decode(&inode.block, true)
            .map_err(|e| Error::corrupted(format!("inode {} extent root: {e}", ino.0), None))?;
        let seed = self.inode_seed(ino, inode);
        let csum = self.inner.metadata_csum;
        let mut stack = vec![root];
        let mut budget = self.superblock().blocks_count;
        while let Some(node) = stack.pop() {
            let Node::Index(h, idx) = node else { continue };
            for ix in idx {
                budget = budget.saturating_sub(1);
                if budget == 0 {
                    return Err(Error::corrupted(
                        format!("inode {} extent tree too big", ino.0),
                        None,
                    ));
                }
                a.blocks.push((ix.child, MetaKind::ExtentNode));
                let data = self.cache().read(ix.child, Kind::ExtentNode, |b| {
                    if csum {
                        extent::verify_csum(b, seed)?;
                    }
                    Node::decode(b, false)?;
                    Ok(())
                })?;
                let child =
                    Node::decode(&data, false).map_err(|e| Error::from(e.at_block(ix.child)))?;
                if child.header().depth + 1 != h.depth {
                    return Err(Error::corrupted(
                        "extent node depth mismatch",
                        Some(ix.child),
                    ));
                }
                stack.push(child);
            }
        }
        Ok(())
    }

    fn audit_orphan_file(&self, ino: Ino, inode: &Inode, a: &mut Audit) {
        let bs = u64::from(self.block_size());
        let seed = self
            .inner
            .metadata_csum
            .then(|| self.inode_seed(ino, inode));
        for l in 0..inode.size / bs {
            match self.map_block(ino, inode, l) {
                Ok(Mapping::Mapped { physical, .. }) => {
                    a.blocks.push((physical, MetaKind::OrphanBlock));
                    let r = self
                        .cache()
                        .read(physical, Kind::Raw, |_| Ok(()))
                        .and_then(|b| {
                            orphan::verify_block(&b, seed, physical)
                                .map_err(|e| Error::from(e.at_block(physical)))
                        });
                    if let Err(e) = r {
                        a.problems.push(e);
                    }
                }
                Ok(_) => a
                    .problems
                    .push(Error::corrupted("orphan file has a hole", None)),
                Err(e) => a.problems.push(e),
            }
        }
    }

    fn audit_journal(&self, ino: Ino, a: &mut Audit) {
        let r = self
            .read_inode(ino)
            .and_then(|inode| match self.map_block(ino, &inode, 0)? {
                Mapping::Mapped { physical, .. } => {
                    a.blocks.push((physical, MetaKind::JournalSuperblock));
                    let b = self.cache().read(physical, Kind::Raw, |_| Ok(()))?;
                    let jsb = jbd2::JournalSuperblock::decode(&b)
                        .map_err(|e| Error::from(e.at_block(physical)))?;
                    jsb.verify().map_err(|e| Error::from(e.at_block(physical)))
                }
                _ => Err(Error::corrupted("journal has no first block", None)),
            });
        if let Err(e) = r {
            a.problems.push(e);
        }
    }
}
