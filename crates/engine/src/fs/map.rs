//! Logical-to-physical block mapping for an inode: extent trees of any depth and
//! ext2/3-style block maps (direct, IND, DIND, TIND).
//!
//! [`Fs::map_block`] answers for one logical block and says how many following blocks
//! share the answer, so readers move extent by extent, not block by block.
//!
//! Must hold on any image: a tree walk goes strictly down (each child's depth is its
//! parent's minus one), so a corrupt tree cannot loop; every child block is checked
//! against the fs size by the buffer cache and verified (magic, bounds, checksum) before
//! use; extents pointing outside the filesystem are reported as corruption.

use rext4_format::extent::{self, Node, NodeRef};
use rext4_format::inode::{flags, Inode};

use crate::cache::Kind;
use crate::error::{AtBlock, Error, Result};
use crate::fs::{Fs, Ino};

pub use crate::store::{Mapping, MAX_LOGICAL};

impl Fs {
    /// Map logical block `lblk` of inode `ino`.
    pub fn map_block(&self, ino: Ino, inode: &Inode, lblk: u64) -> Result<Mapping> {
        if lblk >= MAX_LOGICAL {
            return Ok(Mapping::Hole {
                len: u64::MAX - lblk,
            });
        }
        if inode.has_flag(flags::INLINE_DATA) {
            return Err(Error::Unsupported("inline data".into()));
        }
        if inode.has_flag(flags::EXTENTS) {
            self.map_extent(ino, inode, lblk)
        } else {
            self.map_indirect(inode, lblk)
        }
    }

    fn check_physical(&self, physical: u64, len: u64, blk: Option<u64>) -> Result<()> {
        let n = self.inner.sb.blocks_count;
        let first = u64::from(self.inner.sb.first_data_block);
        if physical < first || physical.saturating_add(len) > n {
            return Err(Error::corrupted(
                format!("extent {physical}+{len} lies outside the filesystem ({n} blocks)"),
                blk,
            ));
        }
        Ok(())
    }

    /// One block's mapping, by binary search in each node of the path (a node is
    /// not decoded whole: tree blocks come from the cache, which checked every entry
    /// when it read them; the root in the inode is checked here).
    fn map_extent(&self, ino: Ino, inode: &Inode, lblk: u64) -> Result<Mapping> {
        let root_err = |e: rext4_format::FormatError| {
            Error::corrupted(format!("inode {} extent root: {e}", ino.0), None)
        };
        let root = NodeRef::new(&inode.block, true).map_err(root_err)?;
        root.check().map_err(root_err)?;
        let mut here: Option<u64> = None;
        // Logical end of the subtree we are in (exclusive).
        let mut upper = MAX_LOGICAL;
        let seed = self.inode_seed(ino, inode);
        let bs = self.inner.block_size as usize;
        // The tree block the current node lives in (none: the root), and the depth
        // its parent index says it has.
        let mut block: Option<std::sync::Arc<[u8]>> = None;
        let mut parent_depth = 0;
        loop {
            let node = match &block {
                None => root,
                Some(b) => {
                    let n = NodeRef::new(&b[..bs.min(b.len())], false).at(here.unwrap_or(0))?;
                    if n.header.depth + 1 != parent_depth {
                        return Err(Error::corrupted(
                            format!(
                                "extent node depth {} under a parent of depth {}",
                                n.header.depth, parent_depth
                            ),
                            here,
                        ));
                    }
                    n
                }
            };
            let i = node.count_at_or_before(lblk);
            if node.is_leaf() {
                if i > 0 {
                    let e = node.extent(i - 1);
                    if lblk < e.end() {
                        self.check_physical(e.physical, u64::from(e.len), here)?;
                        let off = lblk - u64::from(e.logical);
                        return Ok(Mapping::Mapped {
                            physical: e.physical + off,
                            len: u64::from(e.len) - off,
                            unwritten: e.unwritten,
                        });
                    }
                }
                let next = if i < node.len() {
                    u64::from(node.logical(i)).min(upper)
                } else {
                    upper
                };
                return Ok(Mapping::Hole {
                    len: next.saturating_sub(lblk).max(1),
                });
            }
            if i == 0 {
                let next = if node.is_empty() {
                    upper
                } else {
                    u64::from(node.logical(0)).min(upper)
                };
                return Ok(Mapping::Hole {
                    len: next.saturating_sub(lblk).max(1),
                });
            }
            if i < node.len() {
                upper = upper.min(u64::from(node.logical(i)));
            }
            parent_depth = node.header.depth;
            let child = node.index(i - 1).child;
            let data = self.read_extent_node(child, seed)?;
            here = Some(child);
            block = Some(data);
        }
    }

    /// Extent tree block `blk` through the cache, whose verifier checks it (checksum
    /// with the inode's `seed`, every entry) the first time it is read as one.
    fn read_extent_node(&self, blk: u64, seed: u32) -> Result<std::sync::Arc<[u8]>> {
        self.cache().read(blk, Kind::ExtentNode, |b| {
            if self.inner.metadata_csum {
                extent::verify_csum(b, seed)?;
            }
            Node::decode(b, false)?;
            Ok(())
        })
    }

    /// Where block `lblk` of an extent-mapped file would continue its neighbours: the
    /// nearest extent at or before `lblk` extended to it, else the first extent after it
    /// extended backwards (ext4's goal). `None` for an empty tree or a block-mapped file.
    /// A write arriving before the one that precedes it in the file (parallel FUSE
    /// writeback) thus leaves exactly the gap the earlier one will fill.
    pub(crate) fn goal_near(&self, ino: Ino, inode: &Inode, lblk: u64) -> Result<Option<u64>> {
        if !inode.has_flag(flags::EXTENTS) || inode.has_flag(flags::INLINE_DATA) {
            return Ok(None);
        }
        let mut node = Node::decode(&inode.block, true)
            .map_err(|e| Error::corrupted(format!("inode {} extent root: {e}", ino.0), None))?;
        let seed = self.inode_seed(ino, inode);
        let bs = self.inner.block_size as usize;
        loop {
            match node {
                Node::Leaf(_, exts) => {
                    let i = exts.partition_point(|e| u64::from(e.logical) <= lblk);
                    return Ok(match (i.checked_sub(1).map(|j| exts[j]), exts.get(i)) {
                        (Some(e), _) => Some(e.physical + (lblk - u64::from(e.logical))),
                        (None, Some(e)) => e.physical.checked_sub(u64::from(e.logical) - lblk),
                        (None, None) => None,
                    });
                }
                Node::Index(h, idx) => {
                    let i = idx.partition_point(|x| u64::from(x.logical) <= lblk);
                    let Some(x) = idx.get(i.saturating_sub(1)) else {
                        return Ok(None);
                    };
                    let child = x.child;
                    let data = self.read_extent_node(child, seed)?;
                    let n = Node::decode(&data[..bs.min(data.len())], false).at(child)?;
                    if n.header().depth + 1 != h.depth {
                        return Err(Error::corrupted("extent node depth", Some(child)));
                    }
                    node = n;
                }
            }
        }
    }

    /// One block's mapping in an ext2/3 block map, as a run: the blocks that follow
    /// it physically in the same pointer array, or the hole up to the next pointer
    /// (`blockmap_write::lookup_with`); indirect blocks through the cache.
    fn map_indirect(&self, inode: &Inode, lblk: u64) -> Result<Mapping> {
        crate::blockmap_write::lookup_with(
            &inode.block,
            self.inner.block_size,
            self.valid_blocks(),
            lblk,
            |b| self.cache().read(b, Kind::Indirect, |_| Ok(())),
        )
    }

    /// The indirect blocks a block-mapped `inode` lacks to map the logical blocks
    /// `lblks` (ascending), each named once: what allocating them would add besides
    /// the data blocks (the page cache promises them).
    pub(crate) fn indirect_missing(
        &self,
        inode: &Inode,
        lblks: &[u64],
    ) -> Result<Vec<crate::blockmap_write::IndirectKey>> {
        let bs = self.inner.block_size;
        let mut out = Vec::new();
        let mut last_leaf = None;
        for &l in lblks {
            let Some(leaf) = crate::blockmap_write::leaf_key(l, bs) else {
                continue;
            };
            if last_leaf == Some(leaf) {
                continue;
            }
            last_leaf = Some(leaf);
            let missing = crate::blockmap_write::missing_with(
                &inode.block,
                bs,
                self.valid_blocks(),
                l,
                |b| self.cache().read(b, Kind::Indirect, |_| Ok(())),
            )?;
            for k in missing {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        Ok(out)
    }

    /// The block numbers a file's map may name: first data block .. blocks count.
    pub(crate) fn valid_blocks(&self) -> (u64, u64) {
        (
            u64::from(self.inner.sb.first_data_block),
            self.inner.sb.blocks_count,
        )
    }

    /// Every extent of an extent-mapped inode, in logical order (for fiemap-like tools
    /// and fsck). Block-mapped inodes are reported block by block.
    pub fn extents(
        &self,
        ino: Ino,
        inode: &Inode,
        limit_blocks: u64,
    ) -> Result<Vec<(u64, Mapping)>> {
        let mut out = Vec::new();
        if inode.has_flag(flags::INLINE_DATA) {
            return Ok(out); // the bytes live in the inode: no block
        }
        let mut l = 0u64;
        while l < limit_blocks.min(MAX_LOGICAL) {
            let m = self.map_block(ino, inode, l)?;
            let len = match m {
                Mapping::Hole { len } => len,
                Mapping::Mapped { len, .. } => {
                    out.push((l, m));
                    len
                }
            };
            l = l.saturating_add(len.max(1));
        }
        Ok(out)
    }
}
