//! The geometry of a filesystem of a given size, as resize2fs 1.47 works it out
//! (`adjust_new_size`, `adjust_fs_info`, `adjust_reserved_gdt_blocks`, main.c's limits):
//! the size rounded down when the last group would be too small for its metadata, the
//! group and descriptor-block counts, the reserved GDT blocks, inode and reserved-block
//! counts. Pure: no I/O.
//!
//! Must hold: every result equals resize2fs's for the same superblock and size;
//! impossible sizes are errors that say why, never a panic or an overflow.

use rext4_format::superblock::{feature, Superblock};

use crate::error::{Error, Result};

/// The most blocks a filesystem without the 64bit feature can have.
pub const MAX_BLOCKS_32: u64 = (1 << 32) - 1;

/// The geometry of the filesystem of one size (the others come from the superblock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub blocks: u64,
    pub groups: u64,
    pub desc_blocks: u64,
    pub reserved_gdt: u64,
    pub inodes: u32,
    pub r_blocks: u64,
}

fn invalid(m: String) -> Error {
    Error::InvalidInput(m)
}

/// Blocks the last of `groups` groups needs for its own metadata (bitmaps, inode
/// table, and its superblock backup and descriptor copies when it has one), with the
/// current reserved GDT count, as resize2fs counts it.
fn last_group_overhead(sb: &Superblock, groups: u64) -> u64 {
    let per = sb.descs_per_block();
    let desc_blocks = groups.div_ceil(per);
    let mut overhead = 2 + sb.inode_table_blocks();
    if sb.group_has_super(groups - 1) {
        overhead += 1 + desc_blocks + u64::from(sb.reserved_gdt_blocks);
    }
    overhead
}

/// The size (in blocks) a resize to `requested` blocks gives: a last group too small
/// to hold its metadata and 50 blocks is dropped (resize2fs's rule), and the size is
/// checked against what the format allows.
pub(crate) fn adjust_size(sb: &Superblock, requested: u64) -> Result<u64> {
    let bs = u64::from(sb.block_size());
    let first = u64::from(sb.first_data_block);
    let bpg = u64::from(sb.blocks_per_group);
    if requested == 0 {
        return Err(invalid(
            "new size 0: a filesystem needs at least one group".into(),
        ));
    }
    let mut size = requested;
    if !sb.has_incompat(feature::INCOMPAT_64BIT) {
        if size == 1 << 32 {
            size -= 1;
        } else if size > 1 << 32 {
            return Err(invalid(format!(
                "{requested} blocks do not fit in 32 bits: the image has no 64bit feature \
                 (at most {MAX_BLOCKS_32} blocks of {bs} bytes)"
            )));
        }
    }
    // A group count that fits the descriptors' 32-bit group numbers.
    if size.saturating_sub(first).div_ceil(bpg) > u64::from(u32::MAX) {
        return Err(invalid(format!("{requested} blocks is too large")));
    }
    loop {
        if size <= first {
            return Err(invalid(format!(
                "{requested} blocks is too small for a filesystem"
            )));
        }
        let groups = (size - first).div_ceil(bpg);
        let overhead = last_group_overhead(sb, groups);
        let rem = (size - first) % bpg;
        if groups == 1 && rem != 0 && rem < overhead {
            return Err(invalid(format!(
                "{requested} blocks is too small: the first group alone needs {} blocks",
                overhead + first
            )));
        }
        if groups > 1 && rem != 0 && rem < overhead + 50 {
            size -= rem;
            continue;
        }
        let inodes = u64::from(sb.inodes_per_group) * groups;
        if inodes > u64::from(u32::MAX) {
            if groups == 1 || u64::from(sb.inodes_per_group) * (groups - 1) > u64::from(u32::MAX) {
                return Err(invalid(format!(
                    "{requested} blocks would need more than 2^32 inodes"
                )));
            }
            size = bpg * (groups - 1) + first;
            continue;
        }
        let desc_blocks = groups.div_ceil(sb.descs_per_block());
        if desc_blocks + first > bpg {
            return Err(invalid(format!(
                "{requested} blocks would need {desc_blocks} descriptor blocks, more than a \
                 group holds"
            )));
        }
        return Ok(size);
    }
}

/// The geometry at `blocks` (a size `adjust_size` returned) of the filesystem whose
/// superblock is `sb`.
pub(crate) fn layout(sb: &Superblock, blocks: u64) -> Result<Layout> {
    let first = u64::from(sb.first_data_block);
    let bpg = u64::from(sb.blocks_per_group);
    let groups = (blocks - first).div_ceil(bpg);
    let desc_blocks = groups.div_ceil(sb.descs_per_block());
    let old_desc = sb.desc_blocks();
    let old_rsv = u64::from(sb.reserved_gdt_blocks);
    let bs = u64::from(sb.block_size());
    // The descriptor table and the blocks reserved for its growth keep their size
    // together (resize2fs's adjust_reserved_gdt_blocks).
    let reserved_gdt = if sb.has_compat(feature::COMPAT_RESIZE_INODE) && desc_blocks != old_desc {
        (old_rsv + old_desc).saturating_sub(desc_blocks).min(bs / 4)
    } else {
        old_rsv
    };
    if desc_blocks > old_desc + old_rsv {
        return Err(Error::Unsupported(format!(
            "{blocks} blocks need {desc_blocks} group descriptor blocks, and the image has \
             room for {} ({old_desc} and {old_rsv} reserved for growth); rext4 does not \
             move data out of the way of new descriptor blocks nor convert to meta_bg",
            old_desc + old_rsv
        )));
    }
    let old_blocks = sb.blocks_count.max(1);
    let percent = (sb.r_blocks_count as f64 * 100.0) / old_blocks as f64;
    let r_blocks = (percent * blocks as f64 / 100.0) as u64;
    Ok(Layout {
        blocks,
        groups,
        desc_blocks,
        reserved_gdt,
        inodes: (u64::from(sb.inodes_per_group) * groups) as u32,
        r_blocks,
    })
}

/// The backup groups (superblock copies) among the first `groups`, ascending, 0 left
/// out.
pub(crate) fn backup_groups(sb: &Superblock, groups: u64) -> Vec<u64> {
    (1..groups).filter(|&g| sb.group_has_super(g)).collect()
}
