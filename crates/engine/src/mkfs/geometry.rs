//! mkfs geometry: from a device size and the options to block size, block and inode
//! counts, group sizes, reserved GDT blocks and journal/orphan-file sizes, following
//! the rules of mke2fs 1.47.0 (`misc/mke2fs.c` PRS, `lib/ext2fs/initialize.c`,
//! `mkjournal.c ext2fs_default_journal_size`, `orphan.c`).
//!
//! Must hold: every number here equals what mke2fs computes for the same size and
//! options (the tests diff `dumpe2fs` output); impossible requests fail with a message
//! instead of a panic or an overflow.

use rext4_format::superblock::feature::*;

use super::features::Features;
use crate::error::{Error, Result};

/// The inode size every mke2fs.conf size type uses.
pub(crate) const INODE_SIZE: u32 = 256;
/// `EXT2_GOOD_OLD_FIRST_INO`.
pub(crate) const FIRST_INO: u32 = 11;
/// Percentage of blocks reserved for root (mke2fs `-m` default).
const RESERVED_RATIO: f64 = 5.0;
/// `EXT2_MAX_BLOCKS_PER_GROUP`: 2^16 - 8.
const MAX_BLOCKS_PER_GROUP: u64 = 65528;

#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    pub size_type: &'static str,
    pub block_size: u32,
    pub log_block_size: u32,
    pub blocks_count: u64,
    pub r_blocks_count: u64,
    pub first_data_block: u64,
    pub blocks_per_group: u64,
    pub groups: u64,
    pub desc_size: u32,
    pub desc_blocks: u64,
    pub inodes_per_group: u32,
    pub inode_blocks_per_group: u64,
    pub inodes_count: u32,
    pub reserved_gdt_blocks: u32,
    pub log_groups_per_flex: u8,
    pub features: Features,
    /// Journal length in blocks, 0 = no journal.
    pub journal_blocks: u32,
    /// Orphan file length in blocks, 0 = none.
    pub orphan_blocks: u32,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidInput(msg.into())
}

/// `ext2fs_default_journal_size`, in filesystem blocks; `None` = too small for one.
pub(crate) fn default_journal_blocks(blocks: u64) -> Option<u32> {
    let k = 1024u64;
    Some(match blocks {
        b if b < 2048 => return None,
        b if b < 32768 => 1024,
        b if b < 256 * k => 4096,
        b if b < 512 * k => 8192,
        b if b < 4096 * k => 16384,
        b if b < 8192 * k => 32768,
        b if b < 16384 * k => 65536,
        b if b < 32768 * k => 131072,
        _ => 262144,
    })
}

/// `ext2fs_default_orphan_file_blocks`.
pub(crate) fn default_orphan_blocks(blocks: u64) -> u32 {
    if blocks < 128 * 1024 {
        32
    } else if blocks < 2 * 1024 * 1024 {
        (blocks / 4096) as u32
    } else {
        512
    }
}

/// Whether group `g` carries a superblock backup (sparse_super: 0, 1, powers of 3,5,7).
pub(crate) fn group_has_super(g: u64, sparse: bool) -> bool {
    if g <= 1 || !sparse {
        return true;
    }
    if g.is_multiple_of(2) {
        return false;
    }
    [3u64, 5, 7].iter().any(|&p| {
        let mut x = p;
        while x < g {
            x *= p;
        }
        x == g
    })
}

pub(crate) struct Request {
    pub size_bytes: u64,
    pub block_size: Option<u32>,
    pub inodes: Option<u32>,
    pub features: Features,
}

impl Geometry {
    pub(crate) fn compute(req: &Request) -> Result<Geometry> {
        let mut features = req.features;
        // PRS: the device size in units of the requested block size (1 KiB if none).
        let plog = match req.block_size {
            Some(bs) => {
                if !(1024..=65536).contains(&bs) || !bs.is_power_of_two() {
                    return Err(invalid(format!("invalid block size {bs}")));
                }
                bs.trailing_zeros() - 10
            }
            None => 0,
        };
        let pbs = 1024u64 << plog;
        let count0 = req.size_bytes >> (10 + plog);
        let meg = (1u64 << 20) / pbs;
        let size_type = if count0 < 3 * meg {
            "floppy"
        } else if count0 < 512 * meg {
            "small"
        } else if count0 < 4 * 1024 * 1024 * meg {
            "default"
        } else if count0 < 16 * 1024 * 1024 * meg {
            "big"
        } else {
            "huge"
        };
        let (profile_bs, mut inode_ratio) = match size_type {
            "floppy" => (1024u32, 8192u64),
            "small" => (1024, 4096),
            "default" => (4096, 16384),
            "big" => (4096, 32768),
            _ => (4096, 65536),
        };
        let block_size = req.block_size.unwrap_or(profile_bs);
        let bs = u64::from(block_size);
        let blocks_param = if req.block_size.is_none() {
            count0 / (bs / 1024)
        } else {
            count0
        };
        if inode_ratio < bs {
            inode_ratio = bs;
        }
        if blocks_param == 0 {
            return Err(invalid("the device is too small for a filesystem"));
        }
        if blocks_param > u64::from(u32::MAX) {
            return Err(Error::Unsupported(format!(
                "{blocks_param} blocks: rext4 mkfs supports at most 2^32-1 blocks"
            )));
        }
        let inodes_param: u64 = match req.inodes {
            Some(n) => u64::from(n),
            None => {
                let n = blocks_param * bs / inode_ratio;
                if n > u64::from(u32::MAX) {
                    if features.has_incompat(INCOMPAT_64BIT) {
                        u64::from(u32::MAX)
                    } else {
                        return Err(invalid(format!(
                            "too many inodes ({n}), raise the inode ratio"
                        )));
                    }
                } else {
                    n
                }
            }
        };
        if inodes_param * u64::from(INODE_SIZE) >= blocks_param * bs {
            return Err(invalid(format!(
                "inode_size ({INODE_SIZE}) * inodes_count ({inodes_param}) too big for a \
                 filesystem with {blocks_param} blocks, specify a higher inode ratio or fewer inodes"
            )));
        }
        let r_param = (RESERVED_RATIO * blocks_param as f64 / 100.0) as u64;

        // ext2fs_initialize.
        let first_data_block = u64::from(block_size == 1024);
        let mut bpg = (bs * 8).min(MAX_BLOCKS_PER_GROUP);
        let desc_size: u32 = if features.has_incompat(INCOMPAT_64BIT) {
            64
        } else {
            32
        };
        let sparse = features.has_ro_compat(RO_COMPAT_SPARSE_SUPER);
        let mut blocks = blocks_param;
        let mut r_blocks = r_param;
        let inodes_per_block = bs / u64::from(INODE_SIZE);
        let max_ipg = 65536 - inodes_per_block;
        'retry: loop {
            let groups = (blocks - first_data_block).div_ceil(bpg);
            if groups == 0 {
                return Err(invalid("filesystem too small"));
            }
            let desc_blocks = groups.div_ceil(bs / u64::from(desc_size));
            let inodes_req = inodes_param.max(u64::from(FIRST_INO) + 1);
            let mut ipg = inodes_req.div_ceil(groups);
            if ipg > bs * 8 {
                if bpg >= 256 {
                    bpg -= 8;
                    blocks = blocks_param;
                    continue 'retry;
                }
                return Err(invalid("too many inodes for this filesystem size"));
            }
            ipg = ipg.min(max_ipg);
            let (ipg, itb) = loop {
                let itb = (ipg * u64::from(INODE_SIZE)).div_ceil(bs);
                let mut ipg2 = itb * bs / u64::from(INODE_SIZE);
                ipg2 = ipg2.max(8) & !7;
                let itb = (ipg2 * u64::from(INODE_SIZE)).div_ceil(bs);
                if ipg2 * groups > u64::from(u32::MAX) {
                    ipg -= 1;
                    continue;
                }
                break (ipg2, itb);
            };
            let rsv = if features.has_compat(COMPAT_RESIZE_INODE) {
                reserved_gdt_blocks(blocks, first_data_block, bpg, bs, desc_size, desc_blocks)
            } else {
                0
            };
            if 3 + itb + desc_blocks + rsv > bpg {
                return Err(invalid("too many inodes for this filesystem size"));
            }
            let mut overhead = 2 + itb;
            if group_has_super(groups - 1, sparse) {
                overhead += 1 + desc_blocks + rsv;
            }
            let rem = (blocks - first_data_block) % bpg;
            if groups == 1 && rem != 0 && rem < overhead {
                return Err(invalid("filesystem too small"));
            }
            if rem != 0 && rem < overhead + 50 {
                blocks -= rem;
                let ratio = 100.0 * r_param as f64 / blocks_param as f64;
                r_blocks = (ratio * blocks as f64 / 100.0) as u64;
                continue 'retry;
            }
            let journal_blocks = if features.has_compat(COMPAT_HAS_JOURNAL) {
                match default_journal_blocks(blocks) {
                    Some(j) => j,
                    None => {
                        features.compat &= !COMPAT_HAS_JOURNAL;
                        0
                    }
                }
            } else {
                0
            };
            // Reserved inodes, lost+found and the orphan file need numbers.
            let need = FIRST_INO + u32::from(features.has_compat(COMPAT_ORPHAN_FILE));
            if ipg * groups < u64::from(need) {
                return Err(invalid(format!(
                    "{} inodes are too few: the reserved inodes and lost+found need {need}",
                    ipg * groups
                )));
            }
            // mke2fs builds the orphan file only along with a journal.
            if journal_blocks == 0 {
                features.compat &= !COMPAT_ORPHAN_FILE;
            }
            let orphan_blocks = if features.has_compat(COMPAT_ORPHAN_FILE) {
                default_orphan_blocks(blocks)
            } else {
                0
            };
            return Ok(Geometry {
                size_type,
                block_size,
                log_block_size: block_size.trailing_zeros() - 10,
                blocks_count: blocks,
                r_blocks_count: r_blocks,
                first_data_block,
                blocks_per_group: bpg,
                groups,
                desc_size,
                desc_blocks,
                inodes_per_group: ipg as u32,
                inode_blocks_per_group: itb,
                inodes_count: (ipg * groups) as u32,
                reserved_gdt_blocks: rsv as u32,
                log_groups_per_flex: if features.has_incompat(INCOMPAT_FLEX_BG) {
                    4
                } else {
                    0
                },
                features,
                journal_blocks,
                orphan_blocks,
            });
        }
    }

    pub(crate) fn group_first(&self, g: u64) -> u64 {
        self.first_data_block + g * self.blocks_per_group
    }
    pub(crate) fn group_last(&self, g: u64) -> u64 {
        (self.group_first(g) + self.blocks_per_group - 1).min(self.blocks_count - 1)
    }
    pub(crate) fn group_of(&self, blk: u64) -> u64 {
        (blk - self.first_data_block) / self.blocks_per_group
    }
    pub(crate) fn blocks_in_group(&self, g: u64) -> u64 {
        self.group_last(g) - self.group_first(g) + 1
    }
    pub(crate) fn has_super(&self, g: u64) -> bool {
        group_has_super(g, self.features.has_ro_compat(RO_COMPAT_SPARSE_SUPER))
    }
    pub(crate) fn metadata_csum(&self) -> bool {
        self.features.has_ro_compat(RO_COMPAT_METADATA_CSUM)
    }
    /// uninit_bg or metadata_csum: group descriptors carry checksums and UNINIT flags.
    pub(crate) fn group_csum(&self) -> bool {
        self.features
            .has_ro_compat(RO_COMPAT_METADATA_CSUM | RO_COMPAT_GDT_CSUM)
    }
    /// Groups other than 0 holding superblock backups, ascending.
    pub(crate) fn backup_groups(&self) -> Vec<u64> {
        (1..self.groups).filter(|&g| self.has_super(g)).collect()
    }
}

/// `calc_reserved_gdt_blocks`: descriptors for 1024x growth, capped at 2^32 blocks and
/// at one indirect block's worth of pointers.
fn reserved_gdt_blocks(
    blocks: u64,
    first_data_block: u64,
    bpg: u64,
    bs: u64,
    desc_size: u32,
    desc_blocks: u64,
) -> u64 {
    let mut max_blocks: u64 = 0xFFFF_FFFF;
    if blocks < max_blocks / 1024 {
        max_blocks = blocks * 1024;
    }
    let rsv_groups = (max_blocks - first_data_block).div_ceil(bpg);
    let rsv = rsv_groups
        .div_ceil(bs / u64::from(desc_size))
        .saturating_sub(desc_blocks);
    rsv.min(bs / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(size: u64) -> Geometry {
        Geometry::compute(&Request {
            size_bytes: size,
            block_size: None,
            inodes: None,
            features: Features::defaults(false),
        })
        .expect("geometry")
    }

    #[test]
    fn table_of_the_format_notes() {
        // (size, block, inodes, groups, ipg, resv GDT, journal blocks)
        let rows: [(u64, u32, u32, u64, u32, u32, u32); 6] = [
            (2 << 20, 1024, 256, 1, 256, 15, 1024),
            (64 << 20, 1024, 16384, 8, 2048, 256, 4096),
            (256 << 20, 1024, 65536, 32, 2048, 256, 8192),
            (512 << 20, 4096, 32768, 4, 8192, 63, 4096),
            (1 << 30, 4096, 65536, 8, 8192, 127, 8192),
            (16 << 30, 4096, 1048576, 128, 8192, 1024, 32768),
        ];
        for (size, bs, inodes, groups, ipg, rsv, jb) in rows {
            let g = geo(size);
            assert_eq!(
                (
                    g.block_size,
                    g.inodes_count,
                    g.groups,
                    g.inodes_per_group,
                    g.reserved_gdt_blocks
                ),
                (bs, inodes, groups, ipg, rsv),
                "size {size}"
            );
            assert_eq!(g.journal_blocks, jb, "size {size}");
        }
    }

    #[test]
    fn sparse_super_groups() {
        let v: Vec<u64> = (0..100).filter(|&g| group_has_super(g, true)).collect();
        assert_eq!(v, vec![0, 1, 3, 5, 7, 9, 25, 27, 49, 81]);
    }
}
