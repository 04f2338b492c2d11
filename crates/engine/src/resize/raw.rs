//! The filesystem as the switch sees it: read straight from the device while no `Fs`
//! has it open (superblock, descriptors, bitmaps, inode records), and the one
//! journaled write the switch and the journal move make (`commit`): a jbd2
//! transaction in the filesystem's own log, then its blocks home in a given order.
//!
//! Must hold: everything read is verified (superblock and descriptor checksums) before
//! it is used; `commit` sets RECOVER in the on-disk superblock before the transaction's
//! commit block can be durable, writes nothing home before the commit, and clears
//! RECOVER only after every block is home and the log is empty.

use std::collections::BTreeMap;
use std::sync::Arc;

use rext4_format::bitmap;
use rext4_format::extent::{self, Extent, Node};
use rext4_format::group::{self, DescCsum, GroupDesc, FLAG_BLOCK_UNINIT};
use rext4_format::inode::{self as fi, Inode};
use rext4_format::superblock::{feature, Superblock, SB_OFFSET, SB_SIZE};

use crate::device::BlockDevice;
use crate::error::{AtBlock, Error, Result};

/// The on-disk filesystem, decoded.
pub(crate) struct Raw<'d> {
    pub dev: &'d dyn BlockDevice,
    pub sb: Superblock,
    /// The superblock's 1024 bytes as read (fields not modelled are kept from here).
    pub sb_raw: Vec<u8>,
    pub bs: u64,
    pub descs: Vec<GroupDesc>,
    /// The descriptor blocks as read (reserved bytes of each descriptor kept).
    pub gdt: Vec<Vec<u8>>,
    pub kind: DescCsum,
    pub seed: u32,
}

impl<'d> Raw<'d> {
    /// Read and verify the superblock and every group descriptor.
    pub fn open(dev: &'d dyn BlockDevice) -> Result<Raw<'d>> {
        let (sb_raw, sb) = crate::journal::read_superblock(dev)?;
        let bs = u64::from(sb.block_size());
        let seed = sb.csum_seed();
        let kind = DescCsum::of(&sb, seed);
        let ds = sb.desc_size();
        let per = sb.descs_per_block();
        let groups = sb.group_count();
        let mut descs = Vec::with_capacity(groups as usize);
        let mut gdt = Vec::new();
        for i in 0..sb.desc_blocks() {
            let blk = sb.desc_block_location(i);
            let b = read_block(dev, bs, blk)?;
            for k in 0..per {
                let g = i * per + k;
                if g >= groups {
                    break;
                }
                let off = (k as usize) * ds;
                let d = &b[off..off + ds];
                if kind != DescCsum::None {
                    group::verify(d, g as u32, kind).at(blk)?;
                }
                descs.push(GroupDesc::decode(d, ds).at(blk)?);
            }
            gdt.push(b);
        }
        Ok(Raw {
            dev,
            sb,
            sb_raw,
            bs,
            descs,
            gdt,
            kind,
            seed,
        })
    }

    pub fn read(&self, blk: u64) -> Result<Vec<u8>> {
        if blk >= self.dev.size_bytes() / self.bs {
            return Err(Error::corrupted(
                format!("block {blk} is past the end of the device"),
                Some(blk),
            ));
        }
        read_block(self.dev, self.bs, blk)
    }

    /// The block holding the primary superblock (1 with 1 KiB blocks, else 0).
    pub fn sb_block(&self) -> u64 {
        SB_OFFSET / self.bs
    }

    /// Group `g`'s block bitmap with its padding set: read, or for a BLOCK_UNINIT group
    /// the implicit one (its superblock backup and descriptor copies, and every group's
    /// bitmaps and inode table that lie in it).
    pub fn block_bitmap(&self, g: u64) -> Result<Vec<u8>> {
        let d = &self.descs[g as usize];
        let n = self.sb.blocks_in_group(g);
        if !d.has_flag(FLAG_BLOCK_UNINIT) {
            let mut b = self.read(d.block_bitmap)?;
            for x in n..self.bs * 8 {
                bitmap::set(&mut b, x, true);
            }
            return Ok(b);
        }
        let first = self.sb.group_first_block(g);
        let mut b = vec![0u8; self.bs as usize];
        for x in 0..self.sb.group_base_meta_blocks(g).min(n) {
            bitmap::set(&mut b, x, true);
        }
        let itb = self.sb.inode_table_blocks();
        for h in &self.descs {
            for (s, len) in [
                (h.block_bitmap, 1),
                (h.inode_bitmap, 1),
                (h.inode_table, itb),
            ] {
                for blk in s..s + len {
                    if blk >= first && blk < first + n {
                        bitmap::set(&mut b, blk - first, true);
                    }
                }
            }
        }
        for x in n..self.bs * 8 {
            bitmap::set(&mut b, x, true);
        }
        Ok(b)
    }

    /// Where inode `ino`'s record is: (table block, byte offset in it).
    pub fn inode_loc(&self, ino: u32) -> Result<(u64, usize)> {
        let sb = &self.sb;
        if ino == 0 || ino > sb.inodes_count {
            return Err(Error::corrupted(format!("inode {ino} out of range"), None));
        }
        let ipg = sb.inodes_per_group;
        let g = ((ino - 1) / ipg) as usize;
        let idx = u64::from((ino - 1) % ipg) * u64::from(sb.inode_size);
        let d = self
            .descs
            .get(g)
            .ok_or_else(|| Error::corrupted(format!("inode {ino}: no group {g}"), None))?;
        Ok((d.inode_table + idx / self.bs, (idx % self.bs) as usize))
    }

    /// Inode `ino`'s record bytes and decoded fields, checksum verified.
    pub fn inode(&self, ino: u32) -> Result<(Vec<u8>, Inode)> {
        let (blk, off) = self.inode_loc(ino)?;
        let b = self.read(blk)?;
        let isz = usize::from(self.sb.inode_size);
        let rec = b
            .get(off..off + isz)
            .ok_or_else(|| Error::corrupted("inode record outside its block", Some(blk)))?
            .to_vec();
        if self.sb.metadata_csum() {
            fi::verify_csum(&rec, ino, self.seed).at(blk)?;
        }
        let inode = Inode::decode(&rec).at(blk)?;
        Ok((rec, inode))
    }

    /// The extents of an extent-mapped inode and the tree blocks below its root (at
    /// most two levels below the root: the journal's tree, which this is for, has at
    /// most one).
    pub fn extents(&self, ino: u32, inode: &Inode) -> Result<(Vec<Extent>, Vec<u64>)> {
        let seed = rext4_format::csum::inode_seed(self.seed, ino, inode.generation);
        let mut exts = Vec::new();
        let mut tree = Vec::new();
        let root = Node::decode(&inode.block, true)
            .map_err(|e| Error::corrupted(format!("inode {ino} extent root: {e}"), None))?;
        let mut todo = vec![root];
        while let Some(n) = todo.pop() {
            match n {
                Node::Leaf(_, v) => exts.extend(v),
                Node::Index(_, v) => {
                    for ix in v.iter().rev() {
                        if tree.len() > 4096 || ix.child >= self.sb.blocks_count {
                            return Err(Error::corrupted(
                                format!("inode {ino}: extent tree block {} out of range", ix.child),
                                Some(ix.child),
                            ));
                        }
                        let b = self.read(ix.child)?;
                        if self.sb.metadata_csum() {
                            extent::verify_csum(&b, seed).at(ix.child)?;
                        }
                        tree.push(ix.child);
                        todo.push(Node::decode(&b, false).at(ix.child)?);
                    }
                }
            }
        }
        exts.sort_by_key(|e| e.logical);
        Ok((exts, tree))
    }

    /// Seal an inode record: encode `inode` over `rec` and set its checksum.
    pub fn seal_inode(&self, ino: u32, inode: &Inode, rec: &mut [u8]) {
        inode.encode_into(rec);
        if self.sb.metadata_csum() {
            fi::set_csum(rec, ino, self.seed);
        }
    }

    /// A bitmap checksum as a descriptor of this filesystem holds it.
    pub fn bitmap_csum(&self, b: &[u8], nbits: u32) -> u32 {
        if !self.sb.metadata_csum() {
            return 0;
        }
        let c = bitmap::compute_csum(b, nbits, self.seed);
        if self.sb.desc_size() >= 64 {
            c
        } else {
            c & 0xFFFF
        }
    }
}

pub(crate) fn read_block(dev: &dyn BlockDevice, bs: u64, blk: u64) -> Result<Vec<u8>> {
    let mut b = vec![0u8; bs as usize];
    dev.read_at(&mut b, blk * bs)?;
    Ok(b)
}

/// Free blocks (bits clear) among the first `n` bits of bitmap `b`.
pub(crate) fn free_in(b: &[u8], n: u64) -> u64 {
    n - bitmap::count_set(b, n)
}

/// The superblock block's contents with `sb` (over the 1024 bytes `sb_raw`) in place:
/// `block` is the block as it is on disk.
pub(crate) fn with_superblock(
    mut block: Vec<u8>,
    sb: &Superblock,
    sb_raw: &[u8],
    bs: u64,
) -> Vec<u8> {
    let mut raw = sb_raw.to_vec();
    sb.encode_into(&mut raw);
    let at = (SB_OFFSET % bs) as usize;
    block[at..at + SB_SIZE].copy_from_slice(&raw);
    block
}

/// A backup superblock block for group `g` (the copy at the start of the group's first
/// block): `sb` with its group number, never marked as needing recovery. `block` is
/// what the block holds now (bytes past the superblock are kept).
pub(crate) fn backup_superblock(
    mut block: Vec<u8>,
    sb: &Superblock,
    sb_raw: &[u8],
    g: u64,
) -> Vec<u8> {
    let mut s = sb.clone();
    s.block_group_nr = g as u16;
    s.feature_incompat &= !feature::INCOMPAT_RECOVER;
    let mut raw = sb_raw.to_vec();
    s.encode_into(&mut raw);
    block[..SB_SIZE].copy_from_slice(&raw);
    block
}

/// How a transaction's blocks go home after its commit.
pub(crate) struct HomeOrder {
    /// Written before all others, stage by stage, each stage flushed: the superblock
    /// and the descriptor blocks, in the order that keeps a kernel that reads them
    /// before it replays the log consistent (see `switch`).
    pub first: Vec<Vec<u64>>,
    /// Written (and flushed) after all others: the journal inode's table block when
    /// the journal moves (until then a recoverer must find the old log).
    pub last: Option<u64>,
}

/// Write `blocks` as one transaction into the filesystem's journal and home (see the
/// module note of `crate::resize`, steps 3 and 4). `new_sb` is the superblock the
/// transaction leaves (with RECOVER set in the transaction; cleared on disk at the
/// end). `post` is written home after the log is empty (backups that did not fit).
pub(crate) fn commit(
    raw: &Raw<'_>,
    blocks: &BTreeMap<u64, Vec<u8>>,
    order: &HomeOrder,
    new_sb: (&Superblock, &[u8]),
    post: &[(u64, Vec<u8>)],
) -> Result<()> {
    let dev = raw.dev;
    let bs = raw.bs;
    let map = crate::journal::JournalMap::locate(dev, &raw.sb)?;
    let mut runs = rext4_jbd2::Runs::default();
    for j in 0..map.blocks {
        runs.push(map.physical(j)?, 1);
    }
    let mut log = rext4_jbd2::Log::open_runs(dev, runs, bs as usize)?;
    let epoch = crate::repro::source_date_epoch().ok().flatten();
    log.set_fixed_time(epoch.map(|t| t.max(0) as u64));
    let is64 = raw.sb.has_incompat(feature::INCOMPAT_64BIT);
    log.prepare_rw(dev, raw.sb.metadata_csum(), is64)?;
    let list: Vec<(u64, Arc<[u8]>)> = blocks
        .iter()
        .map(|(&b, d)| (b, Arc::from(d.as_slice())))
        .collect();
    if list.len() > log.max_blocks() {
        return Err(Error::Unsupported(format!(
            "the change takes {} blocks, more than the journal's {} per transaction",
            list.len(),
            log.max_blocks()
        )));
    }
    // RECOVER on disk before the commit block can be: a recoverer that finds the
    // commit must know to replay it.
    let mut marked = raw.sb.clone();
    marked.feature_incompat |= feature::INCOMPAT_RECOVER;
    let mut sbr = raw.sb_raw.clone();
    marked.encode_into(&mut sbr);
    dev.write_at(&sbr, SB_OFFSET)?;
    dev.flush()?;
    log.commit(dev, &list, &[])?;
    // Home: the superblock first, then the rest, then the one block that must be
    // last; each step flushed.
    let put = |blk: u64| -> Result<()> {
        if let Some(d) = blocks.get(&blk) {
            dev.write_at(d, blk * bs)?;
        }
        Ok(())
    };
    let early: std::collections::BTreeSet<u64> = order.first.iter().flatten().copied().collect();
    for stage in &order.first {
        for &blk in stage {
            put(blk)?;
        }
        dev.flush()?;
    }
    for &blk in blocks.keys() {
        if !early.contains(&blk) && Some(blk) != order.last {
            put(blk)?;
        }
    }
    dev.flush()?;
    if let Some(l) = order.last {
        put(l)?;
        dev.flush()?;
    }
    log.checkpointed(dev)?;
    dev.flush()?;
    for (blk, d) in post {
        dev.write_at(d, blk * bs)?;
    }
    let (sb, sb_raw) = new_sb;
    let mut done = sb.clone();
    done.feature_incompat &= !feature::INCOMPAT_RECOVER;
    let mut r = sb_raw.to_vec();
    done.encode_into(&mut r);
    dev.write_at(&r, SB_OFFSET)?;
    dev.flush()?;
    Ok(())
}

/// A tree block to write: (block, contents).
pub(crate) type LeafBlock = (u64, Vec<u8>);

/// Encode an extent tree holding `exts` (sorted): in the inode's root when at most four
/// fit, else in the leaf block `leaf` (one leaf: enough for the journal). Returns the
/// root bytes and the leaf block's contents when used.
pub(crate) fn encode_tree(
    exts: &[Extent],
    leaf: Option<u64>,
    bs: usize,
    inode_seed: Option<u32>,
) -> Result<([u8; 60], Option<LeafBlock>)> {
    use rext4_format::extent::{block_capacity, Header, Index, ROOT_CAPACITY};
    let mut root = [0u8; 60];
    if exts.len() <= usize::from(ROOT_CAPACITY) {
        let h = Header {
            entries: exts.len() as u16,
            max: ROOT_CAPACITY,
            depth: 0,
            generation: 0,
        };
        Node::Leaf(h, exts.to_vec()).encode_into(&mut root);
        return Ok((root, None));
    }
    let cap = block_capacity(bs);
    let Some(leaf) = leaf else {
        return Err(Error::InvalidInput("extent tree needs a leaf block".into()));
    };
    if exts.len() > usize::from(cap) {
        return Err(Error::Unsupported(format!(
            "{} extents do not fit one extent block",
            exts.len()
        )));
    }
    let mut b = vec![0u8; bs];
    let h = Header {
        entries: exts.len() as u16,
        max: cap,
        depth: 0,
        generation: 0,
    };
    Node::Leaf(h, exts.to_vec()).encode_into(&mut b);
    if let Some(s) = inode_seed {
        extent::set_csum(&mut b, s);
    }
    let rh = Header {
        entries: 1,
        max: ROOT_CAPACITY,
        depth: 1,
        generation: 0,
    };
    let first = exts.first().map_or(0, |e| e.logical);
    Node::Index(
        rh,
        vec![Index {
            logical: first,
            child: leaf,
        }],
    )
    .encode_into(&mut root);
    Ok((root, Some((leaf, b))))
}
