//! Block group descriptors (format notes §2.2): 32 bytes, or `s_desc_size` (64) with the
//! 64bit feature, where the high halves of block numbers and counts live at 0x20..0x40.
//!
//! Checksum: with metadata_csum, `raw(raw(csum_seed, le32 group), desc with 0x1E..0x20
//! zeroed) & 0xFFFF`; with only uninit_bg (gdt_csum), crc16 over uuid, group and the
//! descriptor minus the checksum field. Neither: no checksum.

use crate::bytes::*;
use crate::csum;
use crate::{ensure, Result};

pub const FLAG_INODE_UNINIT: u16 = 0x1;
pub const FLAG_BLOCK_UNINIT: u16 = 0x2;
pub const FLAG_ITABLE_ZEROED: u16 = 0x4;

const CSUM_OFF: usize = 0x1E;

/// A decoded group descriptor with lo/hi halves merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupDesc {
    pub block_bitmap: u64,
    pub inode_bitmap: u64,
    pub inode_table: u64,
    pub free_blocks_count: u32,
    pub free_inodes_count: u32,
    pub used_dirs_count: u32,
    pub flags: u16,
    pub exclude_bitmap: u64,
    pub block_bitmap_csum: u32,
    pub inode_bitmap_csum: u32,
    pub itable_unused: u32,
    pub checksum: u16,
}

/// How descriptors are checksummed in this filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescCsum {
    None,
    /// uninit_bg: crc16 seeded with the uuid.
    Crc16 {
        uuid: [u8; 16],
    },
    /// metadata_csum: crc32c seeded with the fs checksum seed.
    Crc32c {
        seed: u32,
    },
}

impl DescCsum {
    /// The checksum a filesystem with superblock `sb` (checksum seed `seed`) puts on
    /// its descriptors: crc32c with metadata_csum, else crc16 with uninit_bg.
    pub fn of(sb: &crate::superblock::Superblock, seed: u32) -> DescCsum {
        use crate::superblock::feature;
        if sb.metadata_csum() {
            DescCsum::Crc32c { seed }
        } else if sb.has_ro_compat(feature::RO_COMPAT_GDT_CSUM) {
            DescCsum::Crc16 { uuid: sb.uuid }
        } else {
            DescCsum::None
        }
    }
}

impl GroupDesc {
    /// Decode a descriptor of `desc_size` bytes (32 or ≥ 64).
    pub fn decode(b: &[u8], desc_size: usize) -> Result<Self> {
        need(b, desc_size.max(32), "group descriptor")?;
        let wide = desc_size >= 64;
        let hi32 = |off: usize| if wide { le32(b, off) } else { 0 };
        let hi16 = |off: usize| if wide { u32::from(le16(b, off)) } else { 0 };
        Ok(GroupDesc {
            block_bitmap: lohi(le32(b, 0x0), hi32(0x20)),
            inode_bitmap: lohi(le32(b, 0x4), hi32(0x24)),
            inode_table: lohi(le32(b, 0x8), hi32(0x28)),
            free_blocks_count: u32::from(le16(b, 0xC)) | (hi16(0x2C) << 16),
            free_inodes_count: u32::from(le16(b, 0xE)) | (hi16(0x2E) << 16),
            used_dirs_count: u32::from(le16(b, 0x10)) | (hi16(0x30) << 16),
            flags: le16(b, 0x12),
            exclude_bitmap: lohi(le32(b, 0x14), hi32(0x34)),
            block_bitmap_csum: u32::from(le16(b, 0x18)) | (hi16(0x38) << 16),
            inode_bitmap_csum: u32::from(le16(b, 0x1A)) | (hi16(0x3A) << 16),
            itable_unused: u32::from(le16(b, 0x1C)) | (hi16(0x32) << 16),
            checksum: le16(b, CSUM_OFF),
        })
    }

    /// Encode into `b` (`desc_size` bytes, pre-filled with the old descriptor so
    /// reserved bytes survive) and set the checksum for group `group`.
    pub fn encode_into(&self, b: &mut [u8], desc_size: usize, group: u32, kind: DescCsum) {
        let wide = desc_size >= 64;
        set_le32(b, 0x0, self.block_bitmap as u32);
        set_le32(b, 0x4, self.inode_bitmap as u32);
        set_le32(b, 0x8, self.inode_table as u32);
        set_le16(b, 0xC, self.free_blocks_count as u16);
        set_le16(b, 0xE, self.free_inodes_count as u16);
        set_le16(b, 0x10, self.used_dirs_count as u16);
        set_le16(b, 0x12, self.flags);
        set_le32(b, 0x14, self.exclude_bitmap as u32);
        set_le16(b, 0x18, self.block_bitmap_csum as u16);
        set_le16(b, 0x1A, self.inode_bitmap_csum as u16);
        set_le16(b, 0x1C, self.itable_unused as u16);
        if wide {
            set_le32(b, 0x20, (self.block_bitmap >> 32) as u32);
            set_le32(b, 0x24, (self.inode_bitmap >> 32) as u32);
            set_le32(b, 0x28, (self.inode_table >> 32) as u32);
            set_le16(b, 0x2C, (self.free_blocks_count >> 16) as u16);
            set_le16(b, 0x2E, (self.free_inodes_count >> 16) as u16);
            set_le16(b, 0x30, (self.used_dirs_count >> 16) as u16);
            set_le16(b, 0x32, (self.itable_unused >> 16) as u16);
            set_le32(b, 0x34, (self.exclude_bitmap >> 32) as u32);
            set_le16(b, 0x38, (self.block_bitmap_csum >> 16) as u16);
            set_le16(b, 0x3A, (self.inode_bitmap_csum >> 16) as u16);
        }
        let c = compute_csum(b.get(..desc_size).unwrap_or(b), group, kind);
        set_le16(b, CSUM_OFF, c);
    }

    pub fn has_flag(&self, f: u16) -> bool {
        self.flags & f != 0
    }
}

/// The checksum a descriptor should carry.
pub fn compute_csum(desc: &[u8], group: u32, kind: DescCsum) -> u16 {
    let before = desc.get(..CSUM_OFF).unwrap_or(desc);
    let after = desc.get(CSUM_OFF + 2..).unwrap_or(&[]);
    match kind {
        DescCsum::None => 0,
        DescCsum::Crc32c { seed } => {
            let c = csum::raw(seed, &group.to_le_bytes());
            let c = csum::raw_chain(c, &[before, &[0, 0], after]);
            (c & 0xFFFF) as u16
        }
        DescCsum::Crc16 { uuid } => {
            let c = crc16(0xFFFF, &uuid);
            let c = crc16(c, &group.to_le_bytes());
            let c = crc16(c, before);
            crc16(c, after)
        }
    }
}

/// Verify the checksum of descriptor bytes `desc` for group `group`.
pub fn verify(desc: &[u8], group: u32, kind: DescCsum) -> Result<()> {
    if kind == DescCsum::None {
        return Ok(());
    }
    let have = le16(desc, CSUM_OFF);
    let want = compute_csum(desc, group, kind);
    ensure(have == want, || {
        format!("group {group} descriptor checksum {have:#06x}, computed {want:#06x}")
    })
}

/// crc16 (reflected 0xA001, as used by uninit_bg descriptors).
pub fn crc16(mut crc: u16, data: &[u8]) -> u16 {
    for &byte in data {
        crc ^= u16::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xA001
            } else {
                crc >> 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bit_flips() {
        let d = GroupDesc {
            block_bitmap: 0x1_0000_0081,
            inode_bitmap: 137,
            inode_table: 145,
            free_blocks_count: 70000,
            free_inodes_count: 8181,
            used_dirs_count: 2,
            flags: FLAG_ITABLE_ZEROED,
            block_bitmap_csum: 0xDEAD_BEEF,
            inode_bitmap_csum: 0x1234_5678,
            itable_unused: 8181,
            ..Default::default()
        };
        let kind = DescCsum::Crc32c { seed: 0x1234 };
        let mut b = vec![0u8; 64];
        d.encode_into(&mut b, 64, 5, kind);
        let back = GroupDesc::decode(&b, 64).expect("decode");
        assert_eq!(
            GroupDesc {
                checksum: 0,
                ..back.clone()
            },
            d
        );
        verify(&b, 5, kind).expect("csum");
        assert!(
            verify(&b, 6, kind).is_err(),
            "group number is part of the checksum"
        );
        for bit in 0..64 * 8 {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert!(verify(&m, 5, kind).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn crc16_check_value() {
        // CRC-16/ARC of "123456789" with init 0 is 0xBB3D.
        assert_eq!(crc16(0, b"123456789"), 0xBB3D);
    }
}
