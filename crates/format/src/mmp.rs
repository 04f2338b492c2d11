//! The multi-mount protection block (incompat feature mmp, 0x100): one filesystem block
//! at `s_mmp_block` whose first 1024 bytes say who last claimed the filesystem and
//! when. Facts from the kernel's `fs/ext4/mmp.c` and e2fsprogs' `lib/ext2fs/mmp.c`.
//!
//! Layout (little-endian): magic le32 @0x0 (0x004D4D50), sequence le32 @0x4, time le64
//! @0x8 (seconds), node name 64 bytes @0x10, device name 32 bytes @0x50 (neither needs a
//! NUL), check interval le16 @0x70, padding to 0x3FC, checksum le32 @0x3FC =
//! raw(csum_seed, bytes[0..0x3FC]) when metadata_csum is on. The rest of the block is
//! not part of the structure (mke2fs zeroes it).
//!
//! The sequence says what the filesystem is doing: [`SEQ_CLEAN`] (nobody has it),
//! [`SEQ_FSCK`] (an e2fsprogs tool has it), or a number up to [`SEQ_MAX`] that the
//! holder changes every `s_mmp_update_interval` seconds, so another node that sees it
//! unchanged for longer than the check interval knows the holder is gone.
//!
//! Must hold: decoding never panics on any input; the checksum covers every byte
//! before it (the names included), so a torn or foreign write is caught.
//!
//! Callers: the engine's MMP protocol (`rext4::mmp`), mkfs, `rext4 info`, tests.

use crate::bytes::{arr, le16, le32, le64, need, put, set_le16, set_le32, set_le64};
use crate::csum::raw;
use crate::{ensure, Result};

/// `mmp_magic`.
pub const MAGIC: u32 = 0x004D_4D50;
/// Sequence of a filesystem nobody has open (clean unmount, mkfs).
pub const SEQ_CLEAN: u32 = 0xFF4D_4D50;
/// Sequence while e2fsck (or another e2fsprogs tool) has the filesystem.
pub const SEQ_FSCK: u32 = 0xE24D_4D50;
/// Largest sequence a live holder writes.
pub const SEQ_MAX: u32 = 0xE24D_4D4F;
/// mke2fs's `s_mmp_update_interval` when none is given, in seconds.
pub const DEFAULT_UPDATE_INTERVAL: u16 = 5;
/// Largest update interval mke2fs and tune2fs accept, in seconds.
pub const MAX_UPDATE_INTERVAL: u16 = 300;
/// Smallest check interval anyone waits with, in seconds (the kernel and e2fsprogs
/// raise smaller ones to this).
pub const MIN_CHECK_INTERVAL: u16 = 5;
/// Largest check interval the kernel's updater writes, in seconds.
pub const MAX_CHECK_INTERVAL: u16 = 300;

/// Size of the structure; the block may be larger.
pub const SIZE: usize = 1024;
const O_MAGIC: usize = 0x0;
const O_SEQ: usize = 0x4;
const O_TIME: usize = 0x8;
const O_NODENAME: usize = 0x10;
const O_BDEVNAME: usize = 0x50;
const O_CHECK_INTERVAL: usize = 0x70;
const O_PAD1: usize = 0x72;
const O_PAD2: usize = 0x74;
const O_CHECKSUM: usize = 0x3FC;
/// Length of the node and device names.
pub const NODENAME_LEN: usize = 64;
pub const BDEVNAME_LEN: usize = 32;
const _: () = assert!(O_SEQ == O_MAGIC + 4 && O_TIME == O_SEQ + 4 && O_NODENAME == O_TIME + 8);
const _: () = assert!(O_BDEVNAME == O_NODENAME + NODENAME_LEN);
const _: () = assert!(O_CHECK_INTERVAL == O_BDEVNAME + BDEVNAME_LEN);
const _: () = assert!(O_PAD1 == O_CHECK_INTERVAL + 2 && O_PAD2 == O_PAD1 + 2);
// mmp_pad2 is 226 le32 words.
const _: () = assert!(O_CHECKSUM == O_PAD2 + 226 * 4 && O_CHECKSUM + 4 == SIZE);

/// The fields of an MMP block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmpBlock {
    pub seq: u32,
    /// Seconds since the epoch of the last update.
    pub time: u64,
    pub nodename: [u8; NODENAME_LEN],
    pub bdevname: [u8; BDEVNAME_LEN],
    /// Seconds a node that finds the block in use should wait at least (the holder's
    /// view of how late its updates may be).
    pub check_interval: u16,
}

/// What the sequence says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    Clean,
    Fsck,
    /// A holder's number (or an unknown value above [`SEQ_MAX`], which the kernel
    /// treats the same way: wait and see whether it moves).
    Live(u32),
}

/// `bytes` up to the first NUL (the whole field when it has none), as text.
fn field_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Copy `s` into a fixed field, cut to its length (as `strncpy`: no NUL when it fills
/// the field), the rest zero.
pub fn name_field<const N: usize>(s: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = s.len().min(N);
    out[..n].copy_from_slice(&s[..n]);
    out
}

impl MmpBlock {
    /// A block with sequence `seq` written at `time` by `nodename` for `bdevname`.
    pub fn new(seq: u32, time: u64, nodename: &[u8], bdevname: &[u8], check_interval: u16) -> Self {
        MmpBlock {
            seq,
            time,
            nodename: name_field(nodename),
            bdevname: name_field(bdevname),
            check_interval,
        }
    }

    /// Decode the first [`SIZE`] bytes of `buf` and check the magic and, given
    /// `csum_seed` (metadata_csum), the checksum.
    pub fn decode(buf: &[u8], csum_seed: Option<u32>) -> Result<Self> {
        need(buf, SIZE, "MMP block")?;
        let magic = le32(buf, O_MAGIC);
        ensure(magic == MAGIC, || {
            format!("MMP block magic {magic:#010x} is not {MAGIC:#010x}")
        })?;
        if let Some(seed) = csum_seed {
            let stored = le32(buf, O_CHECKSUM);
            let computed = Self::checksum(buf, seed);
            ensure(stored == computed, || {
                format!("MMP block checksum {stored:#010x} does not match {computed:#010x}")
            })?;
        }
        Ok(MmpBlock {
            seq: le32(buf, O_SEQ),
            time: le64(buf, O_TIME),
            nodename: arr(buf, O_NODENAME),
            bdevname: arr(buf, O_BDEVNAME),
            check_interval: le16(buf, O_CHECK_INTERVAL),
        })
    }

    /// Write the structure over the first [`SIZE`] bytes of `buf` (padding zeroed, the
    /// rest of the block left as it is), with the checksum when `csum_seed` is given.
    pub fn encode_into(&self, buf: &mut [u8], csum_seed: Option<u32>) -> Result<()> {
        need(buf, SIZE, "MMP block")?;
        buf[..SIZE].fill(0);
        set_le32(buf, O_MAGIC, MAGIC);
        set_le32(buf, O_SEQ, self.seq);
        set_le64(buf, O_TIME, self.time);
        put(buf, O_NODENAME, &self.nodename);
        put(buf, O_BDEVNAME, &self.bdevname);
        set_le16(buf, O_CHECK_INTERVAL, self.check_interval);
        if let Some(seed) = csum_seed {
            let c = Self::checksum(buf, seed);
            set_le32(buf, O_CHECKSUM, c);
        }
        Ok(())
    }

    /// raw(csum_seed, bytes[0..0x3FC]).
    pub fn checksum(buf: &[u8], csum_seed: u32) -> u32 {
        raw(csum_seed, buf.get(..O_CHECKSUM).unwrap_or(buf))
    }

    pub fn state(&self) -> SeqState {
        match self.seq {
            SEQ_CLEAN => SeqState::Clean,
            SEQ_FSCK => SeqState::Fsck,
            s => SeqState::Live(s),
        }
    }

    /// The node name as text (up to its first NUL).
    pub fn nodename_text(&self) -> String {
        field_text(&self.nodename)
    }

    /// The device name as text (up to its first NUL).
    pub fn bdevname_text(&self) -> String {
        field_text(&self.bdevname)
    }
}

/// The check interval a node waits with before taking a filesystem whose MMP block
/// shows a live sequence: the superblock's update interval raised to
/// [`MIN_CHECK_INTERVAL`], or the block's own check interval when that is larger.
pub fn check_interval(sb_update_interval: u16, block: &MmpBlock) -> u16 {
    sb_update_interval
        .max(MIN_CHECK_INTERVAL)
        .max(block.check_interval)
}

/// How long to wait, in seconds, with check interval `ci`: twice it plus one, at most
/// a minute over it (the kernel's and e2fsprogs' rule).
pub fn wait_secs(ci: u16) -> u64 {
    let ci = u64::from(ci);
    (2 * ci + 1).min(ci + 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seed: Option<u32>) -> Vec<u8> {
        let m = MmpBlock::new(0x1234, 1_700_000_000, b"node-a", b"/dev/sdb1", 5);
        let mut b = vec![0u8; 4096];
        m.encode_into(&mut b, seed).expect("encode");
        b
    }

    #[test]
    fn round_trip() {
        for seed in [None, Some(0xdead_beef)] {
            let b = sample(seed);
            let m = MmpBlock::decode(&b, seed).expect("decode");
            assert_eq!(m.seq, 0x1234);
            assert_eq!(m.time, 1_700_000_000);
            assert_eq!(m.nodename_text(), "node-a");
            assert_eq!(m.bdevname_text(), "/dev/sdb1");
            assert_eq!(m.check_interval, 5);
            assert_eq!(m.state(), SeqState::Live(0x1234));
            let mut again = vec![0u8; 4096];
            m.encode_into(&mut again, seed).expect("encode");
            assert_eq!(again, b);
        }
    }

    #[test]
    fn names_fill_their_fields_without_a_nul() {
        let long = [b'x'; 100];
        let m = MmpBlock::new(SEQ_CLEAN, 0, &long, &long, 5);
        assert_eq!(m.nodename_text().len(), NODENAME_LEN);
        assert_eq!(m.bdevname_text().len(), BDEVNAME_LEN);
        assert_eq!(m.state(), SeqState::Clean);
        assert_eq!(
            MmpBlock::new(SEQ_FSCK, 0, b"", b"", 5).state(),
            SeqState::Fsck
        );
    }

    #[test]
    fn every_bit_flip_of_the_structure_is_caught_with_metadata_csum() {
        let seed = Some(0x0bad_cafe);
        let b = sample(seed);
        for bit in 0..SIZE * 8 {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert!(
                MmpBlock::decode(&m, seed).is_err(),
                "bit {bit} flip accepted"
            );
        }
        // Without metadata_csum only the magic is checked.
        let plain = sample(None);
        let mut m = plain.clone();
        m[0] ^= 1;
        assert!(MmpBlock::decode(&m, None).is_err());
        m = plain;
        m[O_SEQ] ^= 1;
        assert!(MmpBlock::decode(&m, None).is_ok());
    }

    #[test]
    fn short_or_random_buffers_never_panic() {
        assert!(MmpBlock::decode(&[0u8; 100], None).is_err());
        assert!(MmpBlock::new(1, 1, b"", b"", 5)
            .encode_into(&mut [0u8; 100], None)
            .is_err());
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            let mut b = sample(Some(7));
            for _ in 0..6 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % b.len();
                b[i] = (x >> 40) as u8;
            }
            let _ = MmpBlock::decode(&b, Some(7));
            let _ = MmpBlock::decode(&b, None);
        }
    }

    #[test]
    fn waits_follow_the_kernel() {
        let b = MmpBlock::new(1, 0, b"", b"", 0);
        // Intervals below the minimum are raised to it: 2 * 5 + 1.
        assert_eq!(check_interval(1, &b), 5);
        assert_eq!(wait_secs(check_interval(1, &b)), 11);
        let slow = MmpBlock::new(1, 0, b"", b"", 40);
        assert_eq!(check_interval(5, &slow), 40);
        assert_eq!(wait_secs(40), 81);
        assert_eq!(wait_secs(300), 360);
    }
}
