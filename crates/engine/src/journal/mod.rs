//! Journal recovery: finding the journal of an image, replaying a log that needs
//! recovery (format notes §2.12–§2.13), and the in-memory overlay that lets a read-only
//! open see the replayed filesystem without writing the image.
//!
//! Owns: [`JournalMap`] (where each journal block lives, read from the journal inode's
//! extent tree or block map with no `Fs`: replay runs before the filesystem is opened),
//! [`replay`] / [`examine`] and [`ReplayReport`] (in `replay.rs`), [`Overlay`] (in
//! `overlay.rs`), and `recover_for_open`, the one call `Fs::open_device` makes when the
//! superblock has has_journal + RECOVER (it returns the fast commits the log leaves to
//! replay, which need the open filesystem: `crate::fc_replay`).
//!
//! Must hold:
//! - The journal inode is read from its home location before anything is replayed (the
//!   kernel does the same: the journal inode is never journalled), and every journal
//!   block is mapped through the inode's own map: contiguity is not assumed.
//! - Extents past the journal's size are not the log's and are skipped (a shrink in
//!   progress keeps the old log there as unwritten extents: `crate::resize`).
//! - Every block number taken from disk (extent, indirect pointer, tag) is checked
//!   against the filesystem size before it is read or written.
//! - Nothing is written unless the caller asked for the write path ([`replay`]); a
//!   read-only open replays into an [`Overlay`], so the image bytes never change.
//!
//! Callers: `Fs::open_device` (through `recover_for_open`), tools and tests.

mod overlay;
mod replay;

use std::sync::Arc;

use rext4_format::bytes::le32;
use rext4_format::csum;
use rext4_format::extent::{self, Node};
use rext4_format::group::{self, GroupDesc};
use rext4_format::inode::{self as fmt_inode, flags, Inode};
use rext4_format::superblock::{Superblock, SB_OFFSET, SB_SIZE};

use crate::device::BlockDevice;
use crate::error::{Error, Result};

pub use overlay::Overlay;
pub use replay::{examine, replay, ReplayReport};

/// This boot's id (/proc/sys/kernel/random/boot_id), which early commits carry: the
/// host's page cache kept everything written during it, in order.
pub(crate) fn current_boot_id() -> Option<[u8; 16]> {
    let t = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: Vec<u8> = t.trim().bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(id)
}

/// Largest journal rext4 maps (mke2fs allows at most 10,240,000 blocks).
const MAX_JOURNAL_BLOCKS: u64 = 1 << 24;
/// Bound on extent-tree and indirect blocks read while mapping the journal.
const MAX_MAP_READS: usize = 1 << 16;

/// Read and verify the primary ext4 superblock; returns its raw bytes too.
pub(crate) fn read_superblock(dev: &dyn BlockDevice) -> Result<(Vec<u8>, Superblock)> {
    if dev.size_bytes() < SB_OFFSET + SB_SIZE as u64 {
        return Err(Error::NotExt4(
            "too small to hold an ext4 superblock".into(),
        ));
    }
    let mut raw = vec![0u8; SB_SIZE];
    dev.read_at(&mut raw, SB_OFFSET)?;
    check_ext4_magic(&raw)?;
    let sb = Superblock::decode(&raw).map_err(|e| Error::from(e.at_block(SB_OFFSET / 1024)))?;
    Ok((raw, sb))
}

/// Tell a device that holds no ext4 filesystem (another filesystem, zeros, random
/// bytes: no magic number in the superblock) from a damaged ext4 filesystem, which
/// `Superblock::decode` reports as corrupted. A magic number one or two bits away
/// from ext4's is taken for damage (1 in 480 random values would pass as such).
pub(crate) fn check_ext4_magic(raw_sb: &[u8]) -> Result<()> {
    let magic = match raw_sb.get(0x38..0x3A) {
        Some(b) => u16::from_le_bytes([b[0], b[1]]),
        None => 0,
    };
    if (magic ^ 0xEF53).count_ones() <= 2 {
        Ok(())
    } else {
        Err(Error::NotExt4(
            "no ext4 magic number in the superblock".into(),
        ))
    }
}

/// A run of journal blocks `[logical, logical+len)` stored at `physical..`.
/// Where the blocks of an internal journal live: found in the journal inode
/// ([`JournalMap::locate`]), kept as the log's one map, `rext4_jbd2::Runs`, which
/// recovery and the log writer (`fs::jwrite::load`) look blocks up in.
#[derive(Clone, Debug)]
pub struct JournalMap {
    map: rext4_jbd2::Runs,
    /// Journal size from the inode's i_size, in blocks.
    pub blocks: u64,
    block_size: u64,
}

impl JournalMap {
    /// Map the journal inode of the filesystem whose superblock is `sb`. External
    /// journals are refused as unsupported.
    pub fn locate(dev: &dyn BlockDevice, sb: &Superblock) -> Result<JournalMap> {
        let ino = sb.journal_inum;
        if ino == 0 {
            return Err(Error::Unsupported(
                "external journal device (s_journal_inum is 0)".into(),
            ));
        }
        if ino > sb.inodes_count || sb.inodes_per_group == 0 {
            return Err(Error::corrupted(
                format!("journal inode number {ino} out of range"),
                None,
            ));
        }
        let bs = u64::from(sb.block_size());
        let read_block = |blk: u64| -> Result<Vec<u8>> {
            if blk >= sb.blocks_count || blk < u64::from(sb.first_data_block) {
                return Err(Error::corrupted(
                    format!("journal metadata block {blk} outside the filesystem"),
                    None,
                ));
            }
            let mut b = vec![0u8; bs as usize];
            dev.read_at(&mut b, blk * bs)?;
            Ok(b)
        };

        // The journal inode's group descriptor.
        let seed = sb.csum_seed();
        let g = u64::from((ino - 1) / sb.inodes_per_group);
        let per_block = sb.descs_per_block();
        let ds = sb.desc_size();
        let gdt_blk = sb.desc_block_location(g / per_block);
        let gdt = read_block(gdt_blk)?;
        let off = (g % per_block) as usize * ds;
        let bytes = gdt.get(off..off + ds).unwrap_or(&[]);
        group::verify(bytes, g as u32, group::DescCsum::of(sb, seed))
            .map_err(|e| Error::from(e.at_block(gdt_blk)))?;
        let gd = GroupDesc::decode(bytes, ds).map_err(|e| Error::from(e.at_block(gdt_blk)))?;
        if gd.has_flag(group::FLAG_INODE_UNINIT) {
            return Err(Error::corrupted(
                format!("journal inode {ino} lies in an uninitialized inode table"),
                Some(gdt_blk),
            ));
        }

        // The inode record.
        let isz = u64::from(sb.inode_size);
        let idx = u64::from((ino - 1) % sb.inodes_per_group);
        let iblk = gd.inode_table.saturating_add(idx * isz / bs);
        let itable = read_block(iblk)?;
        let ioff = ((idx * isz) % bs) as usize;
        let rec = itable.get(ioff..ioff + isz as usize).ok_or_else(|| {
            Error::corrupted("journal inode record outside its block", Some(iblk))
        })?;
        if sb.metadata_csum() {
            fmt_inode::verify_csum(rec, ino, seed).map_err(|e| Error::from(e.at_block(iblk)))?;
        }
        let inode = Inode::decode(rec).map_err(|e| Error::from(e.at_block(iblk)))?;
        if !inode.is_reg() || inode.links_count == 0 {
            return Err(Error::corrupted(
                format!("journal inode {ino} is not a live regular file"),
                Some(iblk),
            ));
        }
        let blocks = (inode.size / bs).min(MAX_JOURNAL_BLOCKS);

        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        let mut reads = 0usize;
        let check = |p: u64, len: u64| -> Result<()> {
            if p < u64::from(sb.first_data_block) || p.saturating_add(len) > sb.blocks_count {
                return Err(Error::corrupted(
                    format!("journal block run {p}+{len} outside the filesystem"),
                    None,
                ));
            }
            Ok(())
        };
        if inode.has_flag(flags::INLINE_DATA) {
            return Err(Error::corrupted("journal inode has inline data", None));
        } else if inode.has_flag(flags::EXTENTS) {
            let iseed = csum::inode_seed(seed, ino, inode.generation);
            let root = Node::decode(&inode.block, true)
                .map_err(|e| Error::corrupted(format!("journal inode extent root: {e}"), None))?;
            // Depth-first, each child exactly one level below its parent: no loops.
            let mut stack = vec![(root, None::<u64>)];
            while let Some((node, at)) = stack.pop() {
                match node {
                    Node::Leaf(_, exts) => {
                        for e in exts {
                            // Past the log's size: not the log's (a shrink keeps the
                            // old log there, unwritten, until it drops its groups).
                            if u64::from(e.logical) >= blocks {
                                continue;
                            }
                            if e.unwritten {
                                return Err(Error::corrupted(
                                    format!("journal extent at {} is unwritten", e.logical),
                                    at,
                                ));
                            }
                            check(e.physical, u64::from(e.len))?;
                            runs.push((u64::from(e.logical), e.physical, u64::from(e.len)));
                        }
                    }
                    Node::Index(h, idx) => {
                        for x in idx.iter().rev() {
                            reads += 1;
                            if reads > MAX_MAP_READS {
                                return Err(Error::corrupted("journal extent tree too large", at));
                            }
                            let b = read_block(x.child)?;
                            if sb.metadata_csum() {
                                extent::verify_csum(&b, iseed)
                                    .map_err(|e| Error::from(e.at_block(x.child)))?;
                            }
                            let child = Node::decode(&b, false)
                                .map_err(|e| Error::from(e.at_block(x.child)))?;
                            if child.header().depth + 1 != h.depth {
                                return Err(Error::corrupted(
                                    "journal extent tree depth is inconsistent",
                                    Some(x.child),
                                ));
                            }
                            stack.push((child, Some(x.child)));
                        }
                    }
                }
            }
        } else {
            // ext2/3 block map: 12 direct pointers, then IND, DIND, TIND.
            let apb = bs / 4;
            let push = |l: u64, p: u64, runs: &mut Vec<(u64, u64, u64)>| -> Result<()> {
                if p == 0 || l >= blocks {
                    return Ok(());
                }
                check(p, 1)?;
                match runs.last_mut() {
                    Some((rl, rp, n)) if *rl + *n == l && *rp + *n == p => *n += 1,
                    _ => runs.push((l, p, 1)),
                }
                Ok(())
            };
            for i in 0..12u64 {
                push(i, u64::from(le32(&inode.block, i as usize * 4)), &mut runs)?;
            }
            // (pointer block, level, first logical block it covers)
            let mut todo: Vec<(u64, u32, u64)> = Vec::new();
            let mut base = 12u64;
            for level in 1..=3u32 {
                let p = u64::from(le32(&inode.block, (11 + level as usize) * 4));
                if p != 0 && base < blocks {
                    todo.push((p, level, base));
                }
                base = base.saturating_add(apb.saturating_pow(level));
            }
            // Process in logical order so runs stay sorted and mergeable.
            todo.reverse();
            while let Some((p, level, first)) = todo.pop() {
                reads += 1;
                if reads > MAX_MAP_READS {
                    return Err(Error::corrupted("journal block map too large", None));
                }
                let b = read_block(p)?;
                let span = apb.saturating_pow(level - 1);
                let mut children = Vec::new();
                for k in 0..apb {
                    let l = first.saturating_add(k.saturating_mul(span));
                    if l >= blocks {
                        break;
                    }
                    let q = u64::from(le32(&b, (k * 4) as usize));
                    if level == 1 {
                        push(l, q, &mut runs)?;
                    } else if q != 0 {
                        children.push((q, level - 1, l));
                    }
                }
                children.reverse();
                todo.extend(children);
            }
        }
        runs.sort_by_key(|r| r.0);
        let mut map = rext4_jbd2::Runs::default();
        for (l, p, n) in runs {
            map.push_at(l, p, n)
                .map_err(|e| Error::corrupted(e.to_string(), None))?;
        }
        map.set_len(blocks);
        Ok(JournalMap {
            map,
            blocks,
            block_size: bs,
        })
    }

    /// Physical block of journal block `j`.
    pub fn physical(&self, j: u64) -> Result<u64> {
        use rext4_jbd2::LogMap;
        self.map
            .physical(j)
            .map_err(|e| Error::corrupted(e.to_string(), None))
    }

    /// The first journal block the inode leaves unmapped, if any.
    pub fn first_hole(&self) -> Option<u64> {
        self.map.first_hole()
    }

    /// The map itself, for the log writer.
    pub(crate) fn into_runs(self) -> rext4_jbd2::Runs {
        self.map
    }

    /// Read journal block `j` into `buf` (one block).
    pub fn read(&self, dev: &dyn BlockDevice, j: u64, buf: &mut [u8]) -> Result<()> {
        let p = self.physical(j)?;
        dev.read_at(buf, p * self.block_size)?;
        Ok(())
    }

    /// Write one block to journal block `j`.
    pub fn write(&self, dev: &dyn BlockDevice, j: u64, buf: &[u8]) -> Result<()> {
        let p = self.physical(j)?;
        dev.write_at(buf, p * self.block_size)?;
        Ok(())
    }
}

/// What `Fs::open_device` continues with after recovery.
pub(crate) struct Recovered {
    /// The device to open: the original one (read-write open) or an [`Overlay`].
    pub(crate) device: Arc<dyn BlockDevice>,
    /// The superblock after replay (RECOVER cleared).
    pub(crate) raw: Vec<u8>,
    pub(crate) sb: Superblock,
    pub(crate) warnings: Vec<String>,
    /// The filesystem must be opened read-only (it lives in an overlay).
    pub(crate) read_only: bool,
    /// Fast commits left to replay (on `device`; RECOVER is still set there).
    pub(crate) fast_commits: Vec<rext4_format::fast_commit::Tag>,
}

/// Recover the journal of the image on `dev` for an open. Read-write (`read_only`
/// false and a writable device): replay on the device itself. Otherwise replay into an
/// [`Overlay`] so the image stays byte-for-byte unchanged.
pub(crate) fn recover_for_open(
    dev: Arc<dyn BlockDevice>,
    read_only: bool,
    boot_id: Option<[u8; 16]>,
) -> Result<Recovered> {
    let ro = read_only || dev.is_read_only();
    let (_, sb) = read_superblock(dev.as_ref())?;
    let device: Arc<dyn BlockDevice> = if ro {
        Arc::new(Overlay::new(dev, sb.block_size()))
    } else {
        dev
    };
    let report = replay::replay_in_boot(device.as_ref(), boot_id)?;
    let mut warnings = Vec::new();
    if ro {
        warnings.push(format!(
            "journal replayed in memory only (read-only open): the image is unchanged \
             ({} transactions, {} blocks)",
            report.transactions, report.blocks_replayed
        ));
    } else {
        warnings.push(format!(
            "journal replayed: {} transactions, {} blocks",
            report.transactions, report.blocks_replayed
        ));
    }
    warnings.extend(report.warnings());
    let (raw, sb) = read_superblock(device.as_ref())?;
    let fast_commits = report.log.fast_commits.clone();
    Ok(Recovered {
        device,
        raw,
        sb,
        warnings,
        read_only: ro,
        fast_commits,
    })
}
