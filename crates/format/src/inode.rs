//! On-disk inodes (format notes §2.4).
//!
//! An inode record is `s_inode_size` bytes (256 by default): a 128-byte base and, with
//! extra_isize, `i_extra_isize` more bytes of extended fields (checksum hi, nanosecond
//! times, crtime, ...); the rest holds in-inode xattrs (see [`crate::xattr`]).
//!
//! Checksum: raw(inode_seed, whole record with 0x7C..0x7E and 0x82..0x84 zeroed); lo16
//! at 0x7C, hi16 at 0x82 only when extra_isize ≥ 4 (so the checksum field fits).
//! An all-zero record is valid (never-used inode).

use crate::bytes::*;
use crate::csum;
use crate::{ensure, Result};

pub const GOOD_OLD_INODE_SIZE: usize = 128;

/// Reserved inode numbers.
pub const ROOT_INO: u32 = 2;
pub const RESIZE_INO: u32 = 7;
pub const JOURNAL_INO: u32 = 8;

/// i_flags bits.
pub mod flags {
    pub const SECRM: u32 = 0x1;
    pub const UNRM: u32 = 0x2;
    pub const COMPR: u32 = 0x4;
    pub const SYNC: u32 = 0x8;
    pub const IMMUTABLE: u32 = 0x10;
    pub const APPEND: u32 = 0x20;
    pub const NODUMP: u32 = 0x40;
    pub const NOATIME: u32 = 0x80;
    pub const INDEX: u32 = 0x1000;
    pub const NOTAIL: u32 = 0x8000;
    pub const TOPDIR: u32 = 0x20000;
    pub const HUGE_FILE: u32 = 0x40000;
    pub const EXTENTS: u32 = 0x80000;
    pub const EA_INODE: u32 = 0x200000;
    pub const ENCRYPT: u32 = 0x800;
    pub const VERITY: u32 = 0x0010_0000;
    pub const DAX: u32 = 0x0200_0000;
    pub const INLINE_DATA: u32 = 0x10000000;
    pub const PROJINHERIT: u32 = 0x2000_0000;
    pub const CASEFOLD: u32 = 0x40000000;
}

/// File type bits of i_mode.
pub mod mode {
    pub const S_IFMT: u16 = 0o170000;
    pub const S_IFSOCK: u16 = 0o140000;
    pub const S_IFLNK: u16 = 0o120000;
    pub const S_IFREG: u16 = 0o100000;
    pub const S_IFBLK: u16 = 0o060000;
    pub const S_IFDIR: u16 = 0o040000;
    pub const S_IFCHR: u16 = 0o020000;
    pub const S_IFIFO: u16 = 0o010000;
    pub const S_ISUID: u16 = 0o4000;
    pub const S_ISGID: u16 = 0o2000;
    pub const S_ISVTX: u16 = 0o1000;
}

/// A timestamp as seconds since the epoch plus nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

impl Timestamp {
    /// Decode a base 32-bit field and, when present, its `_extra` word: the low two bits
    /// of extra extend the seconds (epoch bits), the upper 30 hold nanoseconds.
    pub fn decode(base: u32, extra: Option<u32>) -> Self {
        let mut sec = i64::from(base as i32);
        let mut nsec = 0;
        if let Some(x) = extra {
            sec += i64::from(x & 3) << 32;
            nsec = x >> 2;
        }
        Timestamp { sec, nsec }
    }

    /// Earliest and latest seconds an inode time can hold (signed 32-bit base plus two
    /// epoch bits).
    pub const MIN_SEC: i64 = -(1 << 31);
    pub const MAX_SEC: i64 = 0x3_7FFF_FFFF;

    /// Clamp to the representable range as the kernel does (nanoseconds dropped at
    /// the limits).
    pub fn clamped(self) -> Self {
        if self.sec <= Self::MIN_SEC {
            Timestamp {
                sec: Self::MIN_SEC,
                nsec: 0,
            }
        } else if self.sec >= Self::MAX_SEC {
            Timestamp {
                sec: Self::MAX_SEC,
                nsec: 0,
            }
        } else {
            self
        }
    }

    /// The base field alone (no `_extra` word: 128-byte inodes, or an extra area too
    /// short): whole seconds clamped to the signed 32-bit range, as the kernel stores it.
    pub fn encode_base_only(self) -> u32 {
        self.sec.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32 as u32
    }

    /// Encode into (base, extra), clamped to the representable range.
    pub fn encode(self) -> (u32, u32) {
        let t = self.clamped();
        let base = t.sec as u32;
        let epoch = ((t.sec - i64::from(base as i32)) >> 32) as u32 & 3;
        (base, epoch | (t.nsec.min(999_999_999) << 2))
    }
}

/// The fields of an inode record rext4 uses. `raw` keeps the whole record so that
/// fields rext4 does not model survive a read-modify-write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime: Timestamp,
    pub ctime: Timestamp,
    pub mtime: Timestamp,
    pub crtime: Option<Timestamp>,
    pub dtime: u32,
    pub links_count: u16,
    /// i_blocks as stored (lo32 + hi16), in the unit given by [`Inode::blocks_512`].
    pub blocks_raw: u64,
    pub flags: u32,
    pub version: u64,
    pub block: [u8; 60],
    pub generation: u32,
    pub file_acl: u64,
    pub extra_isize: u16,
    pub projid: u32,
    pub checksum: u32,
}

/// Does the record have room for the extra field that ends at `end` (offset from 0)?
fn has_extra(extra_isize: u16, end: usize) -> bool {
    GOOD_OLD_INODE_SIZE + usize::from(extra_isize) >= end
}

impl Inode {
    /// Decode an inode record (`inode_size` bytes). Checks only what makes the record
    /// self-consistent; [`verify_csum`] checks the checksum.
    pub fn decode(b: &[u8]) -> Result<Self> {
        need(b, GOOD_OLD_INODE_SIZE, "inode")?;
        let extra_isize = if b.len() > GOOD_OLD_INODE_SIZE {
            le16(b, 0x80)
        } else {
            0
        };
        ensure(
            GOOD_OLD_INODE_SIZE + usize::from(extra_isize) <= b.len() && extra_isize % 4 == 0,
            || {
                format!(
                    "inode extra size {extra_isize} does not fit a {}-byte inode",
                    b.len()
                )
            },
        )?;
        let ex = |end: usize, off: usize| has_extra(extra_isize, end).then(|| le32(b, off));
        let mut block = [0u8; 60];
        block.copy_from_slice(slice(b, 0x28, 60).unwrap_or(&[0; 60]));
        let crtime = ex(0x94, 0x90).map(|base| Timestamp::decode(base, ex(0x98, 0x94)));
        let csum_hi = if has_extra(extra_isize, 0x84) {
            u32::from(le16(b, 0x82))
        } else {
            0
        };
        Ok(Inode {
            mode: le16(b, 0x0),
            uid: u32::from(le16(b, 0x2)) | (u32::from(le16(b, 0x78)) << 16),
            gid: u32::from(le16(b, 0x18)) | (u32::from(le16(b, 0x7A)) << 16),
            size: lohi(le32(b, 0x4), le32(b, 0x6C)),
            atime: Timestamp::decode(le32(b, 0x8), ex(0x90, 0x8C)),
            ctime: Timestamp::decode(le32(b, 0xC), ex(0x88, 0x84)),
            mtime: Timestamp::decode(le32(b, 0x10), ex(0x8C, 0x88)),
            crtime,
            dtime: le32(b, 0x14),
            links_count: le16(b, 0x1A),
            blocks_raw: lohi(le32(b, 0x1C), u32::from(le16(b, 0x74))),
            flags: le32(b, 0x20),
            version: lohi(le32(b, 0x24), ex(0x9C, 0x98).unwrap_or(0)),
            block,
            generation: le32(b, 0x64),
            file_acl: lohi(le32(b, 0x68), u32::from(le16(b, 0x76))),
            extra_isize,
            projid: ex(0xA0, 0x9C).unwrap_or(0),
            checksum: u32::from(le16(b, 0x7C)) | (csum_hi << 16),
        })
    }

    /// Write the modelled fields into `b` (the old record, so other bytes survive).
    /// Call [`set_csum`] afterwards.
    pub fn encode_into(&self, b: &mut [u8]) {
        set_le16(b, 0x0, self.mode);
        set_le16(b, 0x2, self.uid as u16);
        set_le16(b, 0x78, (self.uid >> 16) as u16);
        set_le16(b, 0x18, self.gid as u16);
        set_le16(b, 0x7A, (self.gid >> 16) as u16);
        set_le32(b, 0x4, self.size as u32);
        set_le32(b, 0x6C, (self.size >> 32) as u32);
        set_le32(b, 0x14, self.dtime);
        set_le16(b, 0x1A, self.links_count);
        set_le32(b, 0x1C, self.blocks_raw as u32);
        set_le16(b, 0x74, (self.blocks_raw >> 32) as u16);
        set_le32(b, 0x20, self.flags);
        set_le32(b, 0x24, self.version as u32);
        put(b, 0x28, &self.block);
        set_le32(b, 0x64, self.generation);
        set_le32(b, 0x68, self.file_acl as u32);
        set_le16(b, 0x76, (self.file_acl >> 32) as u16);
        if b.len() > GOOD_OLD_INODE_SIZE {
            set_le16(b, 0x80, self.extra_isize);
        }
        let x = self.extra_isize;
        let times = [
            (self.ctime, 0xC, 0x84, 0x88),
            (self.mtime, 0x10, 0x88, 0x8C),
            (self.atime, 0x8, 0x8C, 0x90),
        ];
        for (t, base_off, extra_off, end) in times {
            if has_extra(x, end) {
                let (base, extra) = t.encode();
                set_le32(b, base_off, base);
                set_le32(b, extra_off, extra);
            } else {
                set_le32(b, base_off, t.encode_base_only());
            }
        }
        if let Some(cr) = self.crtime {
            let (base, extra) = cr.encode();
            if has_extra(x, 0x94) {
                set_le32(b, 0x90, base);
            }
            if has_extra(x, 0x98) {
                set_le32(b, 0x94, extra);
            }
        }
        if has_extra(x, 0x9C) {
            set_le32(b, 0x98, (self.version >> 32) as u32);
        }
        if has_extra(x, 0xA0) {
            set_le32(b, 0x9C, self.projid);
        }
    }

    pub fn file_type(&self) -> u16 {
        self.mode & mode::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type() == mode::S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.file_type() == mode::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type() == mode::S_IFLNK
    }
    pub fn has_flag(&self, f: u32) -> bool {
        self.flags & f != 0
    }

    /// i_blocks in 512-byte units (HUGE_FILE makes the stored value fs blocks).
    pub fn blocks_512(&self, huge_file_feature: bool, block_size: u32) -> u64 {
        if huge_file_feature && self.has_flag(flags::HUGE_FILE) {
            self.blocks_raw.saturating_mul(u64::from(block_size / 512))
        } else {
            self.blocks_raw
        }
    }

    /// A symlink whose target lives in i_block (format notes §2.9): no extents flag, no
    /// xattr-independent data blocks, size < 60.
    pub fn is_fast_symlink(&self, block_size: u32) -> bool {
        if !self.is_symlink() || self.has_flag(flags::EXTENTS) || self.has_flag(flags::INLINE_DATA)
        {
            return false;
        }
        let xattr_blocks = if self.file_acl != 0 {
            u64::from(block_size / 512)
        } else {
            0
        };
        self.size < 60 && self.blocks_raw.saturating_sub(xattr_blocks) == 0
    }

    /// Device number from i_block (old or new encoding) as (major, minor).
    pub fn device(&self) -> (u32, u32) {
        let w0 = le32(&self.block, 0);
        let w1 = le32(&self.block, 4);
        if w0 != 0 {
            ((w0 >> 8) & 0xFF, w0 & 0xFF)
        } else {
            ((w1 & 0xFFF00) >> 8, (w1 & 0xFF) | ((w1 >> 12) & 0xFFF00))
        }
    }

    /// Store a device number the way the kernel does.
    pub fn set_device(&mut self, major: u32, minor: u32) {
        self.block = [0; 60];
        if major < 256 && minor < 256 {
            set_le32(&mut self.block, 0, (major << 8) | minor);
        } else {
            let w = (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & !0xFF) << 12);
            set_le32(&mut self.block, 4, w);
        }
    }
}

/// Checksum of an inode record as it should be stored.
pub fn compute_csum(b: &[u8], inode_seed: u32) -> u32 {
    let extra_isize = if b.len() > GOOD_OLD_INODE_SIZE {
        le16(b, 0x80)
    } else {
        0
    };
    let wide = has_extra(extra_isize, 0x84);
    let c = csum::raw(inode_seed, b.get(..0x7C).unwrap_or(b));
    let c = csum::raw(c, &[0, 0]);
    let c = csum::raw(c, b.get(0x7E..GOOD_OLD_INODE_SIZE).unwrap_or(&[]));
    if b.len() <= GOOD_OLD_INODE_SIZE {
        return c & 0xFFFF;
    }
    let c = csum::raw(c, b.get(GOOD_OLD_INODE_SIZE..0x82).unwrap_or(&[]));
    let c = if wide {
        csum::raw(c, &[0, 0])
    } else {
        csum::raw(c, b.get(0x82..0x84).unwrap_or(&[]))
    };
    let c = csum::raw(c, b.get(0x84..).unwrap_or(&[]));
    if wide {
        c
    } else {
        c & 0xFFFF
    }
}

/// Verify an inode record's checksum. All-zero records are valid.
pub fn verify_csum(b: &[u8], ino: u32, fs_seed: u32) -> Result<()> {
    let gen = le32(b, 0x64);
    let extra_isize = if b.len() > GOOD_OLD_INODE_SIZE {
        le16(b, 0x80)
    } else {
        0
    };
    let wide = has_extra(extra_isize, 0x84);
    let have = u32::from(le16(b, 0x7C))
        | if wide {
            u32::from(le16(b, 0x82)) << 16
        } else {
            0
        };
    let want = compute_csum(b, csum::inode_seed(fs_seed, ino, gen));
    if have == want {
        return Ok(());
    }
    if b.iter().all(|&x| x == 0) {
        return Ok(());
    }
    ensure(false, || {
        format!("inode {ino} checksum {have:#x}, computed {want:#x}")
    })
}

/// Store the checksum into an encoded record.
pub fn set_csum(b: &mut [u8], ino: u32, fs_seed: u32) {
    let gen = le32(b, 0x64);
    let c = compute_csum(b, csum::inode_seed(fs_seed, ino, gen));
    set_le16(b, 0x7C, c as u16);
    let extra_isize = if b.len() > GOOD_OLD_INODE_SIZE {
        le16(b, 0x80)
    } else {
        0
    };
    if has_extra(extra_isize, 0x84) {
        set_le16(b, 0x82, (c >> 16) as u16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_across_epochs() {
        for sec in [
            0i64,
            -1,
            -(1 << 31),
            (1 << 31) - 1,
            1 << 31,
            7_258_118_400,
            (3 << 32) + (1 << 31) - 1,
        ] {
            for nsec in [0u32, 1, 999_999_999] {
                let t = Timestamp { sec, nsec };
                let (b, x) = t.encode();
                // At the limits the kernel keeps the seconds and drops the nanoseconds.
                let at_limit = sec == Timestamp::MIN_SEC || sec == Timestamp::MAX_SEC;
                let want = if at_limit {
                    Timestamp { sec, nsec: 0 }
                } else {
                    t
                };
                assert_eq!(Timestamp::decode(b, Some(x)), want, "{sec}.{nsec}");
            }
        }
        // Out of range: clamped, as the kernel does.
        for (sec, want) in [
            (16_000_000_000i64, Timestamp::MAX_SEC),
            (-100_000_000_000, Timestamp::MIN_SEC),
        ] {
            let (b, x) = Timestamp { sec, nsec: 7 }.encode();
            assert_eq!(
                Timestamp::decode(b, Some(x)),
                Timestamp { sec: want, nsec: 0 }
            );
        }
    }

    #[test]
    fn record_round_trip_and_checksum() {
        let mut b = vec![0u8; 256];
        let mut ino = Inode::decode(&b).expect("zero inode decodes");
        ino.mode = mode::S_IFREG | 0o644;
        ino.uid = 100_000;
        ino.gid = 70_000;
        ino.size = 5 << 32;
        ino.extra_isize = 32;
        ino.mtime = Timestamp { sec: -5, nsec: 7 };
        ino.crtime = Some(Timestamp {
            sec: 1 << 33,
            nsec: 9,
        });
        ino.generation = 77;
        ino.links_count = 1;
        ino.encode_into(&mut b);
        set_csum(&mut b, 12, 0xABCD);
        verify_csum(&b, 12, 0xABCD).expect("valid");
        assert!(verify_csum(&b, 13, 0xABCD).is_err());
        let back = Inode::decode(&b).expect("decode");
        assert_eq!(back.uid, ino.uid);
        assert_eq!(back.size, ino.size);
        assert_eq!(back.mtime, ino.mtime);
        assert_eq!(back.crtime, ino.crtime);
        for bit in 0..256 * 8 {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert!(verify_csum(&m, 12, 0xABCD).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn small_records_keep_clamped_whole_seconds_and_a_16_bit_checksum() {
        let mut b = vec![0u8; GOOD_OLD_INODE_SIZE];
        let mut ino = Inode::decode(&b).expect("zero inode decodes");
        ino.mode = mode::S_IFREG | 0o600;
        ino.links_count = 1;
        ino.mtime = Timestamp {
            sec: 4_102_444_800,
            nsec: 5,
        };
        ino.atime = Timestamp {
            sec: -3_000_000_000,
            nsec: 5,
        };
        ino.ctime = Timestamp {
            sec: 1_000_000_000,
            nsec: 5,
        };
        ino.encode_into(&mut b);
        let back = Inode::decode(&b).expect("decode");
        assert_eq!(
            back.mtime,
            Timestamp {
                sec: i32::MAX.into(),
                nsec: 0
            }
        );
        assert_eq!(
            back.atime,
            Timestamp {
                sec: i32::MIN.into(),
                nsec: 0
            }
        );
        assert_eq!(
            back.ctime,
            Timestamp {
                sec: 1_000_000_000,
                nsec: 0
            }
        );
        set_csum(&mut b, 12, 0xABCD);
        verify_csum(&b, 12, 0xABCD).expect("valid");
        // Every byte but the checksum field is covered, 0x7E..0x80 included.
        for bit in (0..GOOD_OLD_INODE_SIZE * 8).filter(|b| !(0x7C * 8..0x7E * 8).contains(b)) {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert!(verify_csum(&m, 12, 0xABCD).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn devices_old_and_new_encoding() {
        let mut i = Inode::decode(&[0u8; 256]).expect("zero");
        for (ma, mi) in [(1, 3), (8, 1), (300, 70000), (4095, 0xFFFFF), (0, 256)] {
            i.set_device(ma, mi);
            assert_eq!(i.device(), (ma, mi));
        }
    }
}
