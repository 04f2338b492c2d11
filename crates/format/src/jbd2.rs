//! jbd2: the journal's on-disk format, its checksums and a pure log scanner.
//!
//! Owns: every jbd2 structure (block header, journal superblock, descriptor block and
//! its tags, commit block, revoke block, the 4-byte block tail), data-block escaping, the
//! jbd2 checksum recipes, log-position arithmetic and the pass-1 (SCAN) state machine of
//! recovery. Nothing here reads or writes a device: the engine's journal layer reads
//! journal blocks, hands them to [`Scanner::feed`] / [`classify`], and writes what
//! [`ScanResult::replay_plan`] says.
//!
//! Must hold:
//! - jbd2 is **big-endian**. This module is the only place in rext4 that converts
//!   big-endian fields; it does so through the private bounds-checked `be*`/`set_be*`
//!   helpers below, so no decoder can panic on any byte string.
//! - Checksums are the raw crc32c of [`crate::csum::raw`]. `j_seed = raw(!0, s_uuid)`.
//!   superblock: `raw(!0, 1024 B with s_checksum zeroed)`; descriptor and revoke tail
//!   (at bs-4): `raw(j_seed, block with the tail zeroed)`; commit: `raw(j_seed, block
//!   with h_chksum[0] zeroed)`; data tag: `raw(raw(j_seed, be32 sequence), block as
//!   stored in the log)`, all 32 bits in a tag3 (CSUM_V3), the low 16 in a CSUM_V2 tag.
//! - Tag size follows the kernel's `journal_tag_bytes`: 16 with CSUM_V3; otherwise 8,
//!   +4 with 64BIT, +2 with CSUM_V2 (the 16-bit checksum lives inside the 8 bytes; the
//!   extra 2 bytes are an on-disk quirk kept for compatibility). Tag flags are read as
//!   the 16-bit word at tag offset 6 in both layouts, as the kernel's recovery does.
//! - The first tag of a descriptor lacks SAME_UUID and is followed by the 16-byte UUID.
//!
//! Replay (format notes §2.13; the kernel's `fs/jbd2/recovery.c`). Recovery walks the
//! log from `(s_start, s_sequence)`, wrapping within `[s_first, log_last)` where
//! `log_last` is `s_maxlen` less the fast-commit area. The SCAN pass ([`Scanner`]):
//! - A block whose magic is wrong, whose `h_sequence` is not the expected tid, or whose
//!   type is unknown ends the log (not an error). A transaction without its commit block
//!   is not part of the log.
//! - A descriptor (or revoke) block whose tail checksum fails is *stale or corrupt*: the
//!   decision waits for the transaction's commit block. If that commit's `h_commit_sec`
//!   is `>=` the previous commit's, the log is corrupt and recovery fails; if it is older,
//!   the block is stale data of an earlier pass over the log and the log ends cleanly.
//! - A commit block whose checksum fails: an older `h_commit_sec` than the previous
//!   commit means stale, the log ends cleanly; otherwise the log ends there and, unless
//!   ASYNC_COMMIT, the kernel refuses the mount ("journal transaction N is corrupt").
//! - The REVOKE pass maps each revoked block to the newest revoking tid; a revoke block
//!   whose `r_count` is out of range fails recovery.
//! - The REPLAY pass writes each tagged block (unescaped) unless it is revoked by a tid
//!   `>=` its own; a block whose tag checksum fails is skipped and recovery reports it.
//!
//! Writers must therefore make `h_commit_sec` non-decreasing and write the commit block
//! last, after a flush. v1 (COMPAT_CHECKSUM crc32) transaction checksums are decoded but
//! not verified.
//!
//! Callers: the engine's journal (commit, checkpoint, replay), mkfs (fresh superblock),
//! fsck, and tests.

use std::collections::HashMap;

use crate::bytes::{arr, need, put, slice, u8_at};
use crate::csum::raw;
use crate::{ensure, FormatError, Result};

// ---------------------------------------------------------------------------------
// Big-endian field access: the only big-endian conversions in rext4.
// Out-of-range reads give 0 and out-of-range writes are dropped (see `bytes::arr`/`put`);
// decoders check lengths first with `need`.
// ---------------------------------------------------------------------------------

#[inline]
fn be16(buf: &[u8], off: usize) -> u16 {
    u16::from_be_bytes(arr(buf, off))
}
#[inline]
fn be32(buf: &[u8], off: usize) -> u32 {
    u32::from_be_bytes(arr(buf, off))
}
#[inline]
fn be64(buf: &[u8], off: usize) -> u64 {
    u64::from_be_bytes(arr(buf, off))
}
#[inline]
fn set_be16(buf: &mut [u8], off: usize, v: u16) {
    put(buf, off, &v.to_be_bytes());
}
#[inline]
fn set_be32(buf: &mut [u8], off: usize, v: u32) {
    put(buf, off, &v.to_be_bytes());
}
#[inline]
fn set_be64(buf: &mut [u8], off: usize, v: u64) {
    put(buf, off, &v.to_be_bytes());
}

// ---------------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------------

/// `h_magic` of every jbd2 block ("the first 4 bytes of /dev/random").
pub const JBD2_MAGIC: u32 = 0xC03B_3998;

/// Block types (`h_blocktype`).
pub const BLOCKTYPE_DESCRIPTOR: u32 = 1;
pub const BLOCKTYPE_COMMIT: u32 = 2;
pub const BLOCKTYPE_SUPERBLOCK_V1: u32 = 3;
pub const BLOCKTYPE_SUPERBLOCK_V2: u32 = 4;
pub const BLOCKTYPE_REVOKE: u32 = 5;
pub const BLOCKTYPE_FAST_COMMIT: u32 = 6;

/// Common header: h_magic 0x0, h_blocktype 0x4, h_sequence 0x8.
pub const HEADER_SIZE: usize = 12;
const H_MAGIC: usize = 0x0;
const H_BLOCKTYPE: usize = 0x4;
const H_SEQUENCE: usize = 0x8;
const _: () = assert!(H_SEQUENCE + 4 == HEADER_SIZE);

/// Feature bits.
pub const COMPAT_CHECKSUM: u32 = 0x1;
pub const INCOMPAT_REVOKE: u32 = 0x1;
pub const INCOMPAT_64BIT: u32 = 0x2;
pub const INCOMPAT_ASYNC_COMMIT: u32 = 0x4;
pub const INCOMPAT_CSUM_V2: u32 = 0x8;
pub const INCOMPAT_CSUM_V3: u32 = 0x10;
pub const INCOMPAT_FAST_COMMIT: u32 = 0x20;
/// The feature bits jbd2 knows (`JBD2_KNOWN_*_FEATURES`).
pub const KNOWN_COMPAT: u32 = COMPAT_CHECKSUM;
pub const KNOWN_INCOMPAT: u32 = INCOMPAT_REVOKE
    | INCOMPAT_64BIT
    | INCOMPAT_ASYNC_COMMIT
    | INCOMPAT_CSUM_V2
    | INCOMPAT_CSUM_V3
    | INCOMPAT_FAST_COMMIT;
pub const KNOWN_RO_COMPAT: u32 = 0;

/// `s_checksum_type` / `h_chksum_type` values.
pub const CHECKSUM_TYPE_CRC32: u8 = 1;
pub const CHECKSUM_TYPE_MD5: u8 = 2;
pub const CHECKSUM_TYPE_SHA1: u8 = 3;
pub const CHECKSUM_TYPE_CRC32C: u8 = 4;

/// Tag flags.
pub const TAG_FLAG_ESCAPE: u16 = 0x1;
pub const TAG_FLAG_SAME_UUID: u16 = 0x2;
pub const TAG_FLAG_DELETED: u16 = 0x4;
pub const TAG_FLAG_LAST_TAG: u16 = 0x8;

/// Smallest log the kernel accepts, and the default fast-commit area.
pub const MIN_JOURNAL_BLOCKS: u32 = 1024;
pub const DEFAULT_FAST_COMMIT_BLOCKS: u32 = 256;
/// Maximum number of filesystems sharing one journal (`s_users` slots).
pub const USERS_MAX: usize = 48;

/// Journal superblock: 1024 bytes at journal block 0.
pub const SB_SIZE: usize = 1024;
const SB_BLOCKSIZE: usize = 0xC;
const SB_MAXLEN: usize = 0x10;
const SB_FIRST: usize = 0x14;
const SB_SEQUENCE: usize = 0x18;
const SB_START: usize = 0x1C;
const SB_ERRNO: usize = 0x20;
const SB_FEATURE_COMPAT: usize = 0x24;
const SB_FEATURE_INCOMPAT: usize = 0x28;
const SB_FEATURE_RO_COMPAT: usize = 0x2C;
const SB_UUID: usize = 0x30;
const SB_NR_USERS: usize = 0x40;
const SB_DYNSUPER: usize = 0x44;
const SB_MAX_TRANSACTION: usize = 0x48;
const SB_MAX_TRANS_DATA: usize = 0x4C;
const SB_CHECKSUM_TYPE: usize = 0x50;
const SB_PADDING2: usize = 0x51;
const SB_NUM_FC_BLKS: usize = 0x54;
const SB_HEAD: usize = 0x58;
const SB_PADDING: usize = 0x5C;
const SB_PADDING_LEN: usize = 40 * 4;
const SB_CHECKSUM: usize = 0xFC;
const SB_USERS: usize = 0x100;
const SB_USERS_LEN: usize = 16 * USERS_MAX;
const _: () = assert!(SB_PADDING2 + 3 == SB_NUM_FC_BLKS);
const _: () = assert!(SB_PADDING + SB_PADDING_LEN == SB_CHECKSUM);
const _: () = assert!(SB_CHECKSUM + 4 == SB_USERS);
const _: () = assert!(SB_USERS + SB_USERS_LEN == SB_SIZE);
const _: () = assert!(SB_SIZE == 1024);

/// Block tail {t_checksum be32} at bs-4 of descriptor and revoke blocks (CSUM_V2/V3).
pub const TAIL_SIZE: usize = 4;

/// Tags: tag3 (CSUM_V3) {t_blocknr 0x0, t_flags be32 0x4, t_blocknr_high 0x8,
/// t_checksum be32 0xC}; tag {t_blocknr 0x0, t_checksum be16 0x4, t_flags be16 0x6,
/// t_blocknr_high 0x8 (64BIT only)}.
pub const TAG3_SIZE: usize = 16;
const TAG_BLOCKNR: usize = 0x0;
const TAG3_FLAGS: usize = 0x4;
const TAG_CSUM16: usize = 0x4;
/// The 16-bit flags word read by recovery for both layouts (low half of tag3's be32).
const TAG_FLAGS16: usize = 0x6;
const TAG_BLOCKNR_HIGH: usize = 0x8;
const TAG3_CSUM: usize = 0xC;
const _: () = assert!(TAG3_CSUM + 4 == TAG3_SIZE);
/// Size of the UUID that follows a tag without SAME_UUID.
pub const TAG_UUID_SIZE: usize = 16;

/// Commit block: header, h_chksum_type u8 0xC, h_chksum_size u8 0xD, h_padding[2],
/// h_chksum[8] be32 0x10, h_commit_sec be64 0x30, h_commit_nsec be32 0x38.
pub const COMMIT_HEADER_SIZE: usize = 0x3C;
const CH_CHKSUM_TYPE: usize = 0xC;
const CH_CHKSUM_SIZE: usize = 0xD;
const CH_CHKSUM: usize = 0x10;
/// Number of be32 words in `h_chksum` (`JBD2_CHECKSUM_BYTES`).
pub const COMMIT_CHKSUM_WORDS: usize = 8;
const CH_COMMIT_SEC: usize = 0x30;
const CH_COMMIT_NSEC: usize = 0x38;
const _: () = assert!(CH_CHKSUM + 4 * COMMIT_CHKSUM_WORDS == CH_COMMIT_SEC);
const _: () = assert!(CH_COMMIT_NSEC + 4 == COMMIT_HEADER_SIZE);

/// Revoke block: header, r_count be32 0xC (bytes used including this 16-byte header).
pub const REVOKE_HEADER_SIZE: usize = 16;
const R_COUNT: usize = 0xC;
const _: () = assert!(R_COUNT + 4 == REVOKE_HEADER_SIZE);

// ---------------------------------------------------------------------------------
// Header and features
// ---------------------------------------------------------------------------------

/// The 12-byte header that starts every jbd2 metadata block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub blocktype: u32,
    pub sequence: u32,
}

impl Header {
    /// Decode; fails unless the buffer holds 12 bytes starting with [`JBD2_MAGIC`].
    pub fn decode(buf: &[u8]) -> Result<Header> {
        need(buf, HEADER_SIZE, "jbd2 header")?;
        ensure(be32(buf, H_MAGIC) == JBD2_MAGIC, || {
            format!("jbd2 magic (found {:#010x})", be32(buf, H_MAGIC))
        })?;
        Ok(Header {
            blocktype: be32(buf, H_BLOCKTYPE),
            sequence: be32(buf, H_SEQUENCE),
        })
    }

    /// Write magic, type and sequence into the first 12 bytes.
    pub fn encode(&self, buf: &mut [u8]) {
        set_be32(buf, H_MAGIC, JBD2_MAGIC);
        set_be32(buf, H_BLOCKTYPE, self.blocktype);
        set_be32(buf, H_SEQUENCE, self.sequence);
    }
}

/// Decode a header and require a block type.
fn header_of_type(buf: &[u8], blocktype: u32, what: &'static str) -> Result<Header> {
    let h = Header::decode(buf)?;
    ensure(h.blocktype == blocktype, || {
        format!("{what}: blocktype {} (expected {blocktype})", h.blocktype)
    })?;
    Ok(h)
}

/// The three feature words of a journal superblock (zero for a v1 superblock).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub compat: u32,
    pub incompat: u32,
    pub ro_compat: u32,
}

impl Features {
    /// The features the kernel sets on first rw mount of an ext4 with 64bit.
    pub const KERNEL_V3: Features = Features {
        compat: 0,
        incompat: INCOMPAT_64BIT | INCOMPAT_CSUM_V3,
        ro_compat: 0,
    };

    pub fn is_64bit(&self) -> bool {
        self.incompat & INCOMPAT_64BIT != 0
    }
    pub fn csum_v2(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V2 != 0
    }
    pub fn csum_v3(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V3 != 0
    }
    /// Blocks carry crc32c checksums (tails, commit, tags).
    pub fn csum_v2or3(&self) -> bool {
        self.csum_v2() || self.csum_v3()
    }
    pub fn async_commit(&self) -> bool {
        self.incompat & INCOMPAT_ASYNC_COMMIT != 0
    }
    pub fn fast_commit(&self) -> bool {
        self.incompat & INCOMPAT_FAST_COMMIT != 0
    }
    /// v1 transaction checksums (crc32 in the commit block).
    pub fn compat_checksum(&self) -> bool {
        self.compat & COMPAT_CHECKSUM != 0
    }

    /// Bytes per descriptor tag (kernel `journal_tag_bytes`): 16 with CSUM_V3, else
    /// 8 (+4 with 64BIT, +2 with CSUM_V2).
    pub fn tag_bytes(&self) -> usize {
        if self.csum_v3() {
            return TAG3_SIZE;
        }
        let mut n = 8;
        if self.is_64bit() {
            n += 4;
        }
        if self.csum_v2() {
            n += 2;
        }
        n
    }

    /// Bytes of block tail at the end of descriptor and revoke blocks.
    pub fn tail_bytes(&self) -> usize {
        if self.csum_v2or3() {
            TAIL_SIZE
        } else {
            0
        }
    }

    /// Bytes per revoke record: 8 with 64BIT, else 4.
    pub fn revoke_record_bytes(&self) -> usize {
        if self.is_64bit() {
            8
        } else {
            4
        }
    }

    /// The bits outside what jbd2 knows.
    pub fn unknown(&self) -> Features {
        Features {
            compat: self.compat & !KNOWN_COMPAT,
            incompat: self.incompat & !KNOWN_INCOMPAT,
            ro_compat: self.ro_compat & !KNOWN_RO_COMPAT,
        }
    }

    /// Names of the set bits, e.g. `["64bit", "csum_v3"]`; unknown bits as
    /// `"incompat 0x40"`.
    pub fn names(&self) -> Vec<String> {
        let mut out = Vec::new();
        let named = |word: u32, table: &[(u32, &str)], kind: &str, out: &mut Vec<String>| {
            for bit in 0..32 {
                let mask = 1u32 << bit;
                if word & mask == 0 {
                    continue;
                }
                match table.iter().find(|(m, _)| *m == mask) {
                    Some((_, name)) => out.push((*name).to_string()),
                    None => out.push(format!("{kind} {mask:#x}")),
                }
            }
        };
        named(
            self.compat,
            &[(COMPAT_CHECKSUM, "checksum")],
            "compat",
            &mut out,
        );
        named(
            self.incompat,
            &[
                (INCOMPAT_REVOKE, "revoke"),
                (INCOMPAT_64BIT, "64bit"),
                (INCOMPAT_ASYNC_COMMIT, "async_commit"),
                (INCOMPAT_CSUM_V2, "csum_v2"),
                (INCOMPAT_CSUM_V3, "csum_v3"),
                (INCOMPAT_FAST_COMMIT, "fast_commit"),
            ],
            "incompat",
            &mut out,
        );
        named(self.ro_compat, &[], "ro_compat", &mut out);
        out
    }
}

/// What every log-block decoder needs: the features and the checksum seed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogFormat {
    pub features: Features,
    /// `raw(!0, s_uuid)`; used only when [`Features::csum_v2or3`].
    pub j_seed: u32,
}

/// `j_seed = raw(!0, s_uuid)`.
pub fn j_seed(uuid: &[u8; 16]) -> u32 {
    raw(!0, uuid)
}

// ---------------------------------------------------------------------------------
// Journal superblock
// ---------------------------------------------------------------------------------

/// The journal superblock, every field kept (including padding) so that
/// `encode(decode(b)) == b` for any 1024 bytes that decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalSuperblock {
    /// [`BLOCKTYPE_SUPERBLOCK_V1`] or [`BLOCKTYPE_SUPERBLOCK_V2`].
    pub blocktype: u32,
    /// `h_sequence` of the superblock's own header (0 as written by mkfs).
    pub header_sequence: u32,
    pub blocksize: u32,
    /// Total blocks in the journal, superblock included.
    pub maxlen: u32,
    /// First block of log information (1 for an internal journal).
    pub first: u32,
    /// First transaction ID expected in the log.
    pub sequence: u32,
    /// Journal block where the log starts; 0 = the log is empty.
    pub start: u32,
    /// Error recorded by an abort (a negative errno).
    pub errno: i32,
    pub feature_compat: u32,
    pub feature_incompat: u32,
    pub feature_ro_compat: u32,
    pub uuid: [u8; 16],
    pub nr_users: u32,
    pub dynsuper: u32,
    pub max_transaction: u32,
    pub max_trans_data: u32,
    pub checksum_type: u8,
    pub padding2: [u8; 3],
    /// Fast-commit blocks; 0 means [`DEFAULT_FAST_COMMIT_BLOCKS`] when FAST_COMMIT is set.
    pub num_fc_blks: u32,
    /// Head of the log, valid only while the filesystem is clean.
    pub head: u32,
    pub padding: [u8; SB_PADDING_LEN],
    pub checksum: u32,
    pub users: [u8; SB_USERS_LEN],
}

impl JournalSuperblock {
    /// A fresh v2 superblock as mkfs.ext4 writes it for an internal journal: first 1,
    /// sequence 1, start 0, one user, no features, checksum type 0.
    pub fn new(blocksize: u32, maxlen: u32, uuid: [u8; 16]) -> JournalSuperblock {
        JournalSuperblock {
            blocktype: BLOCKTYPE_SUPERBLOCK_V2,
            header_sequence: 0,
            blocksize,
            maxlen,
            first: 1,
            sequence: 1,
            start: 0,
            errno: 0,
            feature_compat: 0,
            feature_incompat: 0,
            feature_ro_compat: 0,
            uuid,
            nr_users: 1,
            dynsuper: 0,
            max_transaction: 0,
            max_trans_data: 0,
            checksum_type: 0,
            padding2: [0; 3],
            num_fc_blks: 0,
            head: 0,
            padding: [0; SB_PADDING_LEN],
            checksum: 0,
            users: [0; SB_USERS_LEN],
        }
    }

    /// Decode 1024 bytes; checks only the magic and the superblock block type (call
    /// [`verify`](Self::verify) for the rest).
    pub fn decode(buf: &[u8]) -> Result<JournalSuperblock> {
        need(buf, SB_SIZE, "jbd2 superblock")?;
        let h = Header::decode(buf)?;
        ensure(
            h.blocktype == BLOCKTYPE_SUPERBLOCK_V1 || h.blocktype == BLOCKTYPE_SUPERBLOCK_V2,
            || format!("jbd2 sb blocktype {} (expected 3 or 4)", h.blocktype),
        )?;
        Ok(JournalSuperblock {
            blocktype: h.blocktype,
            header_sequence: h.sequence,
            blocksize: be32(buf, SB_BLOCKSIZE),
            maxlen: be32(buf, SB_MAXLEN),
            first: be32(buf, SB_FIRST),
            sequence: be32(buf, SB_SEQUENCE),
            start: be32(buf, SB_START),
            errno: i32::from_be_bytes(arr(buf, SB_ERRNO)),
            feature_compat: be32(buf, SB_FEATURE_COMPAT),
            feature_incompat: be32(buf, SB_FEATURE_INCOMPAT),
            feature_ro_compat: be32(buf, SB_FEATURE_RO_COMPAT),
            uuid: arr(buf, SB_UUID),
            nr_users: be32(buf, SB_NR_USERS),
            dynsuper: be32(buf, SB_DYNSUPER),
            max_transaction: be32(buf, SB_MAX_TRANSACTION),
            max_trans_data: be32(buf, SB_MAX_TRANS_DATA),
            checksum_type: u8_at(buf, SB_CHECKSUM_TYPE),
            padding2: arr(buf, SB_PADDING2),
            num_fc_blks: be32(buf, SB_NUM_FC_BLKS),
            head: be32(buf, SB_HEAD),
            padding: arr(buf, SB_PADDING),
            checksum: be32(buf, SB_CHECKSUM),
            users: arr(buf, SB_USERS),
        })
    }

    /// Write all 1024 bytes as stored in `self` (call
    /// [`update_checksum`](Self::update_checksum) first after changing fields).
    pub fn encode(&self, buf: &mut [u8]) -> Result<()> {
        need(buf, SB_SIZE, "jbd2 superblock")?;
        Header {
            blocktype: self.blocktype,
            sequence: self.header_sequence,
        }
        .encode(buf);
        set_be32(buf, SB_BLOCKSIZE, self.blocksize);
        set_be32(buf, SB_MAXLEN, self.maxlen);
        set_be32(buf, SB_FIRST, self.first);
        set_be32(buf, SB_SEQUENCE, self.sequence);
        set_be32(buf, SB_START, self.start);
        put(buf, SB_ERRNO, &self.errno.to_be_bytes());
        set_be32(buf, SB_FEATURE_COMPAT, self.feature_compat);
        set_be32(buf, SB_FEATURE_INCOMPAT, self.feature_incompat);
        set_be32(buf, SB_FEATURE_RO_COMPAT, self.feature_ro_compat);
        put(buf, SB_UUID, &self.uuid);
        set_be32(buf, SB_NR_USERS, self.nr_users);
        set_be32(buf, SB_DYNSUPER, self.dynsuper);
        set_be32(buf, SB_MAX_TRANSACTION, self.max_transaction);
        set_be32(buf, SB_MAX_TRANS_DATA, self.max_trans_data);
        put(buf, SB_CHECKSUM_TYPE, &[self.checksum_type]);
        put(buf, SB_PADDING2, &self.padding2);
        set_be32(buf, SB_NUM_FC_BLKS, self.num_fc_blks);
        set_be32(buf, SB_HEAD, self.head);
        put(buf, SB_PADDING, &self.padding);
        set_be32(buf, SB_CHECKSUM, self.checksum);
        put(buf, SB_USERS, &self.users);
        Ok(())
    }

    /// The 1024 encoded bytes.
    pub fn to_bytes(&self) -> [u8; SB_SIZE] {
        let mut b = [0u8; SB_SIZE];
        // The buffer is exactly SB_SIZE, so encode cannot fail.
        let _ = self.encode(&mut b);
        b
    }

    /// 1 or 2.
    pub fn version(&self) -> u32 {
        if self.blocktype == BLOCKTYPE_SUPERBLOCK_V2 {
            2
        } else {
            1
        }
    }

    /// Effective features: a v1 superblock has none, whatever its bytes say.
    pub fn features(&self) -> Features {
        if self.version() < 2 {
            return Features::default();
        }
        Features {
            compat: self.feature_compat,
            incompat: self.feature_incompat,
            ro_compat: self.feature_ro_compat,
        }
    }

    pub fn j_seed(&self) -> u32 {
        j_seed(&self.uuid)
    }

    pub fn log_format(&self) -> LogFormat {
        LogFormat {
            features: self.features(),
            j_seed: self.j_seed(),
        }
    }

    /// Fast-commit blocks at the end of the journal (0 without FAST_COMMIT).
    pub fn num_fc_blocks(&self) -> u32 {
        if !self.features().fast_commit() {
            0
        } else if self.num_fc_blks == 0 {
            DEFAULT_FAST_COMMIT_BLOCKS
        } else {
            self.num_fc_blks
        }
    }

    /// One past the last block of the jbd2 log: `maxlen` less the fast-commit area
    /// (the kernel keeps the whole journal as log when the area would leave fewer than
    /// [`MIN_JOURNAL_BLOCKS`]).
    pub fn log_last(&self) -> u32 {
        let fc = self.num_fc_blocks();
        match self.maxlen.checked_sub(fc) {
            Some(last) if fc > 0 && last >= MIN_JOURNAL_BLOCKS => last,
            _ => self.maxlen,
        }
    }

    /// The log holds no transactions (`s_start == 0`).
    pub fn is_empty(&self) -> bool {
        self.start == 0
    }

    /// `raw(!0, 1024-byte superblock with s_checksum zeroed)`.
    pub fn compute_checksum(&self) -> u32 {
        let mut b = self.to_bytes();
        set_be32(&mut b, SB_CHECKSUM, 0);
        raw(!0, &b)
    }

    /// Store the checksum when CSUM_V2/V3 is on; otherwise leave `checksum` untouched.
    pub fn update_checksum(&mut self) {
        if self.features().csum_v2or3() {
            self.checksum = self.compute_checksum();
        }
    }

    /// Switch to the checksum scheme the kernel uses: CSUM_V3 (and 64BIT when
    /// `bit64`), crc32c, no v1/v2 checksums; recomputes `s_checksum`.
    pub fn enable_csum_v3(&mut self, bit64: bool) {
        self.blocktype = BLOCKTYPE_SUPERBLOCK_V2;
        self.feature_compat &= !COMPAT_CHECKSUM;
        self.feature_incompat &= !INCOMPAT_CSUM_V2;
        self.feature_incompat |= INCOMPAT_CSUM_V3;
        if bit64 {
            self.feature_incompat |= INCOMPAT_64BIT;
        }
        self.checksum_type = CHECKSUM_TYPE_CRC32C;
        self.update_checksum();
    }

    /// The checks the kernel makes when loading a journal (`journal_check_superblock`),
    /// plus bounds on `s_start` and `s_nr_users`. Does not check feature support.
    pub fn verify(&self) -> Result<()> {
        ensure(
            self.blocksize.is_power_of_two() && (1024..=65536).contains(&self.blocksize),
            || format!("jbd2 sb s_blocksize {}", self.blocksize),
        )?;
        ensure(self.first != 0 && self.first < self.maxlen, || {
            format!(
                "jbd2 sb s_first {} out of range (s_maxlen {})",
                self.first, self.maxlen
            )
        })?;
        ensure(
            self.start == 0 || (self.start >= self.first && self.start < self.log_last()),
            || format!("jbd2 sb s_start {} outside the log", self.start),
        )?;
        ensure(self.nr_users as usize <= USERS_MAX, || {
            format!("jbd2 sb s_nr_users {}", self.nr_users)
        })?;
        let f = self.features();
        ensure(!(f.csum_v2() && f.csum_v3()), || {
            "jbd2 sb has both CSUM_V2 and CSUM_V3".into()
        })?;
        if f.csum_v2or3() {
            ensure(!f.compat_checksum(), || {
                "jbd2 sb has CHECKSUM with CSUM_V2/V3".into()
            })?;
            ensure(self.checksum_type == CHECKSUM_TYPE_CRC32C, || {
                format!(
                    "jbd2 sb checksum_type {} (expected 4, crc32c)",
                    self.checksum_type
                )
            })?;
            let want = self.compute_checksum();
            ensure(self.checksum == want, || {
                format!(
                    "jbd2 sb checksum {:#010x} (computed {want:#010x})",
                    self.checksum
                )
            })?;
        }
        if f.fast_commit() {
            let fc = self.num_fc_blocks();
            ensure(fc <= self.maxlen, || {
                format!("jbd2 sb s_num_fc_blks {fc} > s_maxlen")
            })?;
        }
        Ok(())
    }

    /// Refuse feature bits jbd2 does not know (the kernel refuses unknown incompat and
    /// ro_compat bits; unknown compat bits are harmless). The error lists them.
    pub fn features_supported(&self) -> Result<()> {
        let mut unknown = self.features().unknown();
        unknown.compat = 0;
        ensure(unknown == Features::default(), || {
            format!(
                "jbd2 sb unsupported features: {}",
                unknown.names().join(", ")
            )
        })
    }
}

// ---------------------------------------------------------------------------------
// Block tail (descriptor, revoke)
// ---------------------------------------------------------------------------------

/// `raw(j_seed, block with its last 4 bytes zeroed)`.
pub fn block_tail_csum(block: &[u8], j_seed: u32) -> u32 {
    let body = block.len().saturating_sub(TAIL_SIZE);
    let c = raw(j_seed, slice(block, 0, body).unwrap_or(&[]));
    raw(c, &[0u8; TAIL_SIZE][..block.len().min(TAIL_SIZE)])
}

/// Store the tail checksum at bs-4.
pub fn set_block_tail(block: &mut [u8], j_seed: u32) {
    let c = block_tail_csum(block, j_seed);
    let off = block.len().saturating_sub(TAIL_SIZE);
    set_be32(block, off, c);
}

/// Check the tail checksum at bs-4; `what` names the block kind in the error.
pub fn verify_block_tail(block: &[u8], j_seed: u32, what: &str) -> Result<()> {
    need(block, HEADER_SIZE + TAIL_SIZE, "jbd2 block with tail")?;
    let stored = be32(block, block.len() - TAIL_SIZE);
    let want = block_tail_csum(block, j_seed);
    ensure(stored == want, || {
        format!("jbd2 {what} tail checksum {stored:#010x} (computed {want:#010x})")
    })
}

// ---------------------------------------------------------------------------------
// Descriptor blocks and tags
// ---------------------------------------------------------------------------------

/// One descriptor tag: the filesystem block the next log block belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tag {
    /// Filesystem block number (high 32 bits only with 64BIT).
    pub blocknr: u64,
    /// TAG_FLAG_* bits.
    pub flags: u16,
    /// Data checksum: 32 bits in a tag3, 16 bits (zero-extended) in a CSUM_V2 tag.
    pub csum: u32,
}

impl Tag {
    pub fn escaped(&self) -> bool {
        self.flags & TAG_FLAG_ESCAPE != 0
    }
}

fn decode_tag(block: &[u8], off: usize, f: &Features) -> Tag {
    let lo = u64::from(be32(block, off + TAG_BLOCKNR));
    let hi = if f.is_64bit() {
        u64::from(be32(block, off + TAG_BLOCKNR_HIGH))
    } else {
        0
    };
    let csum = if f.csum_v3() {
        be32(block, off + TAG3_CSUM)
    } else {
        u32::from(be16(block, off + TAG_CSUM16))
    };
    Tag {
        blocknr: lo | (hi << 32),
        flags: be16(block, off + TAG_FLAGS16),
        csum,
    }
}

fn encode_tag(block: &mut [u8], off: usize, t: &Tag, f: &Features) {
    // Truncation to the low 32 bits is the on-disk split of blocknr.
    set_be32(block, off + TAG_BLOCKNR, t.blocknr as u32);
    if f.is_64bit() {
        set_be32(block, off + TAG_BLOCKNR_HIGH, (t.blocknr >> 32) as u32);
    }
    if f.csum_v3() {
        set_be32(block, off + TAG3_FLAGS, u32::from(t.flags));
        set_be32(block, off + TAG3_CSUM, t.csum);
    } else {
        set_be16(block, off + TAG_FLAGS16, t.flags);
        if f.csum_v2() {
            set_be16(block, off + TAG_CSUM16, t.csum as u16);
        }
    }
}

/// Decode the tags of a descriptor block (header checked; the tail checksum is not:
/// see [`verify_descriptor`]). Stops after a tag with LAST_TAG or when the next tag
/// would not fit before the tail, exactly like the kernel's `count_tags`.
pub fn parse_descriptor(block: &[u8], features: &Features) -> Result<Vec<Tag>> {
    header_of_type(block, BLOCKTYPE_DESCRIPTOR, "jbd2 descriptor")?;
    let tb = features.tag_bytes();
    let end = block.len().saturating_sub(features.tail_bytes());
    let mut tags = Vec::new();
    let mut off = HEADER_SIZE;
    while off.saturating_add(tb) <= end {
        let t = decode_tag(block, off, features);
        tags.push(t);
        off += tb;
        if t.flags & TAG_FLAG_SAME_UUID == 0 {
            off = off.saturating_add(TAG_UUID_SIZE);
        }
        if t.flags & TAG_FLAG_LAST_TAG != 0 {
            break;
        }
    }
    Ok(tags)
}

/// Check a descriptor's header and, with CSUM_V2/V3, its tail checksum.
pub fn verify_descriptor(block: &[u8], fmt: &LogFormat) -> Result<()> {
    header_of_type(block, BLOCKTYPE_DESCRIPTOR, "jbd2 descriptor")?;
    if fmt.features.csum_v2or3() {
        verify_block_tail(block, fmt.j_seed, "descriptor")?;
    }
    Ok(())
}

/// How many tags one descriptor block of `block_size` bytes holds, with a UUID after
/// the first tag and room for the tail (the exact bound [`parse_descriptor`] accepts).
pub fn tag_capacity(block_size: usize, features: &Features) -> usize {
    let tb = features.tag_bytes();
    let room = block_size.saturating_sub(features.tail_bytes());
    match room.checked_sub(HEADER_SIZE + TAG_UUID_SIZE) {
        Some(r) => r / tb,
        None => 0,
    }
}

/// Build a descriptor block: zero `block`, write the header, as many of `tags` as fit
/// (the first followed by `uuid`; SAME_UUID on all later ones; LAST_TAG on the last
/// written; the callers' ESCAPE/DELETED bits kept), and the tail checksum with
/// CSUM_V2/V3. Tag checksums are written as given (see [`tag_csum`]). Returns how many
/// tags were written; with an empty `tags` nothing is written and 0 is returned.
pub fn encode_descriptor(
    block: &mut [u8],
    sequence: u32,
    tags: &[Tag],
    uuid: &[u8; 16],
    fmt: &LogFormat,
) -> Result<usize> {
    let f = &fmt.features;
    let n = tags.len().min(tag_capacity(block.len(), f));
    if n == 0 {
        return Ok(0);
    }
    block.fill(0);
    Header {
        blocktype: BLOCKTYPE_DESCRIPTOR,
        sequence,
    }
    .encode(block);
    let tb = f.tag_bytes();
    let mut off = HEADER_SIZE;
    for (i, t) in tags.iter().take(n).enumerate() {
        let mut t = *t;
        t.flags &= !(TAG_FLAG_SAME_UUID | TAG_FLAG_LAST_TAG);
        if i > 0 {
            t.flags |= TAG_FLAG_SAME_UUID;
        }
        if i + 1 == n {
            t.flags |= TAG_FLAG_LAST_TAG;
        }
        encode_tag(block, off, &t, f);
        off += tb;
        if i == 0 {
            put(block, off, uuid);
            off += TAG_UUID_SIZE;
        }
    }
    if f.csum_v2or3() {
        set_block_tail(block, fmt.j_seed);
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------
// Data blocks: tag checksum and escaping
// ---------------------------------------------------------------------------------

/// Full 32-bit data checksum `raw(raw(j_seed, be32 sequence), block)`, over the block
/// as stored in the log (escaped).
pub fn tag_csum(j_seed: u32, sequence: u32, block: &[u8]) -> u32 {
    raw(raw(j_seed, &sequence.to_be_bytes()), block)
}

/// The value a tag's `csum` field holds for this data block: all 32 bits with CSUM_V3,
/// the low 16 with CSUM_V2, 0 without block checksums.
pub fn tag_csum_field(fmt: &LogFormat, sequence: u32, block: &[u8]) -> u32 {
    let f = &fmt.features;
    if f.csum_v3() {
        tag_csum(fmt.j_seed, sequence, block)
    } else if f.csum_v2() {
        tag_csum(fmt.j_seed, sequence, block) & 0xFFFF
    } else {
        0
    }
}

/// Check a logged data block (as read from the log, before unescaping) against its tag.
/// Always passes without CSUM_V2/V3.
pub fn verify_tag(tag: &Tag, sequence: u32, block: &[u8], fmt: &LogFormat) -> Result<()> {
    if !fmt.features.csum_v2or3() {
        return Ok(());
    }
    let want = tag_csum_field(fmt, sequence, block);
    ensure(tag.csum == want, || {
        format!(
            "jbd2 data block checksum for fs block {} in transaction {sequence}: \
             {:#010x} (computed {want:#010x})",
            tag.blocknr, tag.csum
        )
    })
}

/// Prepare a data block for the log: if it starts with the jbd2 magic, zero those 4
/// bytes and return true (the caller sets TAG_FLAG_ESCAPE).
pub fn escape(block: &mut [u8]) -> bool {
    if block.len() >= 4 && be32(block, 0) == JBD2_MAGIC {
        set_be32(block, 0, 0);
        true
    } else {
        false
    }
}

/// Undo [`escape`] on a block whose tag has TAG_FLAG_ESCAPE: restore the magic.
pub fn unescape(block: &mut [u8]) {
    set_be32(block, 0, JBD2_MAGIC);
}

// ---------------------------------------------------------------------------------
// rext4's early commits (not part of jbd2)
// ---------------------------------------------------------------------------------
//
// An early commit is a transaction written to the log without a flush, so that a
// crash of the writing process (not of the machine) loses nothing older than a
// moment: its descriptor and data blocks are ordinary jbd2 blocks, but it ends with an
// EARLY block instead of a commit block. jbd2's recovery (the kernel's, e2fsck's) ends
// its scan at a block type it does not know, so for them an early commit does not
// exist; rext4 replays a chain of them only when the machine has not restarted since
// they were written (the boot id matches: everything written then is still in the
// host's page cache, in order) and every checksum verifies. Where the chain starts is
// kept in the journal superblock's padding (`EarlyRecord`), so the log itself can stay
// empty for the others.

/// Block type of an EARLY block (rext4's; jbd2 defines 1..=6).
pub const BLOCKTYPE_EARLY: u32 = 0x7265_7834;
/// What follows the header of an EARLY block.
const EARLY_MARK: &[u8; 16] = b"rext4 early cmt\0";
const EB_MARK: usize = HEADER_SIZE;
const EB_BOOT: usize = EB_MARK + 16;
const EB_END: usize = EB_BOOT + 16;

/// Write the EARLY block of transaction `sequence`, written during boot `boot_id`.
pub fn encode_early(
    block: &mut [u8],
    sequence: u32,
    boot_id: &[u8; 16],
    j_seed: u32,
) -> Result<()> {
    need(block, EB_END + TAIL_SIZE, "rext4 early commit block")?;
    block.fill(0);
    Header {
        blocktype: BLOCKTYPE_EARLY,
        sequence,
    }
    .encode(block);
    put(block, EB_MARK, EARLY_MARK);
    put(block, EB_BOOT, boot_id);
    set_block_tail(block, j_seed);
    Ok(())
}

/// Whether `block` is the verified EARLY block of transaction `sequence` written
/// during boot `boot_id`.
pub fn is_early(block: &[u8], sequence: u32, boot_id: &[u8; 16], j_seed: u32) -> bool {
    block.len() >= EB_END + TAIL_SIZE
        && Header::decode(block)
            .is_ok_and(|h| h.blocktype == BLOCKTYPE_EARLY && h.sequence == sequence)
        && block[EB_MARK..EB_BOOT] == EARLY_MARK[..]
        && block[EB_BOOT..EB_END] == boot_id[..]
        && verify_block_tail(block, j_seed, "early commit").is_ok()
}

/// Where a chain of early commits starts, kept in the journal superblock's padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EarlyRecord {
    /// Log block of the chain's first descriptor.
    pub start: u32,
    /// tid of its first transaction (the journal superblock's `s_sequence` when the
    /// chain began).
    pub first_tid: u32,
    pub boot_id: [u8; 16],
}

const ER_MAGIC: &[u8; 8] = b"rext4ecr";
const ER_LEN: usize = 8 + 4 + 4 + 16 + 4;
const _: () = assert!(ER_LEN <= SB_PADDING_LEN);

impl EarlyRecord {
    /// The record in `sb`'s padding, if one is there and its checksum verifies.
    pub fn from_sb(sb: &JournalSuperblock) -> Option<EarlyRecord> {
        let p = &sb.padding;
        if p[..8] != ER_MAGIC[..] || be32(p, 32) != raw(!0, &p[..32]) {
            return None;
        }
        Some(EarlyRecord {
            start: be32(p, 8),
            first_tid: be32(p, 12),
            boot_id: arr(p, 16),
        })
    }

    /// Store the record in `sb`'s padding (`None`: clear it).
    pub fn store(rec: Option<&EarlyRecord>, sb: &mut JournalSuperblock) {
        let p = &mut sb.padding;
        p[..ER_LEN].fill(0);
        if let Some(r) = rec {
            put(p, 0, ER_MAGIC);
            set_be32(p, 8, r.start);
            set_be32(p, 12, r.first_tid);
            put(p, 16, &r.boot_id);
            let c = raw(!0, &p[..32]);
            set_be32(p, 32, c);
        }
    }
}

// ---------------------------------------------------------------------------------
// Commit blocks
// ---------------------------------------------------------------------------------

/// A commit block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitBlock {
    pub sequence: u32,
    /// 0 with CSUM_V2/V3; CHECKSUM_TYPE_* with v1 COMPAT_CHECKSUM.
    pub chksum_type: u8,
    pub chksum_size: u8,
    /// `h_chksum[0]` holds the block checksum with CSUM_V2/V3.
    pub chksum: [u32; COMMIT_CHKSUM_WORDS],
    pub commit_sec: u64,
    pub commit_nsec: u32,
}

impl CommitBlock {
    pub fn new(sequence: u32, commit_sec: u64, commit_nsec: u32) -> CommitBlock {
        CommitBlock {
            sequence,
            commit_sec,
            commit_nsec,
            ..CommitBlock::default()
        }
    }

    /// Decode the header fields (checksum not checked: see [`verify_commit`]).
    pub fn decode(block: &[u8]) -> Result<CommitBlock> {
        need(block, COMMIT_HEADER_SIZE, "jbd2 commit block")?;
        let h = header_of_type(block, BLOCKTYPE_COMMIT, "jbd2 commit")?;
        let mut chksum = [0u32; COMMIT_CHKSUM_WORDS];
        for (i, c) in chksum.iter_mut().enumerate() {
            *c = be32(block, CH_CHKSUM + 4 * i);
        }
        Ok(CommitBlock {
            sequence: h.sequence,
            chksum_type: u8_at(block, CH_CHKSUM_TYPE),
            chksum_size: u8_at(block, CH_CHKSUM_SIZE),
            chksum,
            commit_sec: be64(block, CH_COMMIT_SEC),
            commit_nsec: be32(block, CH_COMMIT_NSEC),
        })
    }

    /// Zero `block` and write the commit block. With CSUM_V2/V3 the checksum type and
    /// size are written as 0 and `h_chksum[0]` is computed over the whole block;
    /// otherwise the fields are written as stored.
    pub fn encode(&self, block: &mut [u8], fmt: &LogFormat) -> Result<()> {
        need(block, COMMIT_HEADER_SIZE, "jbd2 commit block")?;
        block.fill(0);
        Header {
            blocktype: BLOCKTYPE_COMMIT,
            sequence: self.sequence,
        }
        .encode(block);
        set_be64(block, CH_COMMIT_SEC, self.commit_sec);
        set_be32(block, CH_COMMIT_NSEC, self.commit_nsec);
        if fmt.features.csum_v2or3() {
            let c = commit_csum(block, fmt.j_seed);
            set_be32(block, CH_CHKSUM, c);
        } else {
            put(block, CH_CHKSUM_TYPE, &[self.chksum_type, self.chksum_size]);
            for (i, c) in self.chksum.iter().enumerate() {
                set_be32(block, CH_CHKSUM + 4 * i, *c);
            }
        }
        Ok(())
    }
}

/// `raw(j_seed, whole block with h_chksum[0] zeroed)`.
pub fn commit_csum(block: &[u8], j_seed: u32) -> u32 {
    let head = slice(block, 0, CH_CHKSUM).unwrap_or(&[]);
    let rest = block.get(CH_CHKSUM + 4..).unwrap_or(&[]);
    raw(raw(raw(j_seed, head), &[0u8; 4]), rest)
}

/// Check a commit block's header and, with CSUM_V2/V3, `h_chksum[0]`.
pub fn verify_commit(block: &[u8], fmt: &LogFormat) -> Result<()> {
    need(block, COMMIT_HEADER_SIZE, "jbd2 commit block")?;
    header_of_type(block, BLOCKTYPE_COMMIT, "jbd2 commit")?;
    if fmt.features.csum_v2or3() {
        let stored = be32(block, CH_CHKSUM);
        let want = commit_csum(block, fmt.j_seed);
        ensure(stored == want, || {
            format!("jbd2 commit block checksum {stored:#010x} (computed {want:#010x})")
        })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Revoke blocks
// ---------------------------------------------------------------------------------

/// A revoke block: filesystem blocks whose earlier logged copies must not be replayed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RevokeBlock {
    pub sequence: u32,
    pub records: Vec<u64>,
}

/// Decode a revoke block (tail checksum not checked: see [`verify_revoke`]).
/// `r_count` must lie in `[16, bs - tail]` and cover whole records.
pub fn decode_revoke(block: &[u8], features: &Features) -> Result<RevokeBlock> {
    need(block, REVOKE_HEADER_SIZE, "jbd2 revoke block")?;
    let h = header_of_type(block, BLOCKTYPE_REVOKE, "jbd2 revoke")?;
    let count = be32(block, R_COUNT) as usize;
    let limit = block.len().saturating_sub(features.tail_bytes());
    let rl = features.revoke_record_bytes();
    ensure((REVOKE_HEADER_SIZE..=limit).contains(&count), || {
        format!("jbd2 revoke r_count {count} outside [{REVOKE_HEADER_SIZE}, {limit}]")
    })?;
    let used = count - REVOKE_HEADER_SIZE;
    ensure(used / rl * rl == used, || {
        format!("jbd2 revoke r_count {count} not a whole number of {rl}-byte records")
    })?;
    let records = (REVOKE_HEADER_SIZE..count)
        .step_by(rl)
        .map(|off| {
            if rl == 8 {
                be64(block, off)
            } else {
                u64::from(be32(block, off))
            }
        })
        .collect();
    Ok(RevokeBlock {
        sequence: h.sequence,
        records,
    })
}

/// Check a revoke block's header and, with CSUM_V2/V3, its tail checksum.
pub fn verify_revoke(block: &[u8], fmt: &LogFormat) -> Result<()> {
    header_of_type(block, BLOCKTYPE_REVOKE, "jbd2 revoke")?;
    if fmt.features.csum_v2or3() {
        verify_block_tail(block, fmt.j_seed, "revoke")?;
    }
    Ok(())
}

/// How many records one revoke block of `block_size` bytes holds.
pub fn revoke_capacity(block_size: usize, features: &Features) -> usize {
    block_size.saturating_sub(REVOKE_HEADER_SIZE + features.tail_bytes())
        / features.revoke_record_bytes()
}

/// Build a revoke block from as many of `records` as fit (and the tail checksum with
/// CSUM_V2/V3); returns how many were written. Without 64BIT a record above 32 bits
/// cannot be represented and is an error.
pub fn encode_revoke(
    block: &mut [u8],
    sequence: u32,
    records: &[u64],
    fmt: &LogFormat,
) -> Result<usize> {
    let f = &fmt.features;
    need(
        block,
        REVOKE_HEADER_SIZE + f.tail_bytes(),
        "jbd2 revoke block",
    )?;
    let n = records.len().min(revoke_capacity(block.len(), f));
    let rl = f.revoke_record_bytes();
    if !f.is_64bit() {
        if let Some(r) = records.iter().take(n).find(|r| **r > u64::from(u32::MAX)) {
            return Err(FormatError::corrupted(format!(
                "jbd2 revoke record {r} needs 64BIT"
            )));
        }
    }
    block.fill(0);
    Header {
        blocktype: BLOCKTYPE_REVOKE,
        sequence,
    }
    .encode(block);
    let mut off = REVOKE_HEADER_SIZE;
    for r in records.iter().take(n) {
        if rl == 8 {
            set_be64(block, off, *r);
        } else {
            set_be32(block, off, *r as u32);
        }
        off += rl;
    }
    // off <= block.len() <= u32::MAX in practice; saturate rather than wrap.
    set_be32(block, R_COUNT, u32::try_from(off).unwrap_or(u32::MAX));
    if f.csum_v2or3() {
        set_block_tail(block, fmt.j_seed);
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------
// Log positions and transaction IDs
// ---------------------------------------------------------------------------------

/// A block number inside the journal (0 = the journal superblock).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogPos(pub u32);

/// The block after `pos` in the circular log `[first, last)`.
pub fn next_block(pos: LogPos, first: u32, last: u32) -> LogPos {
    advance(pos, 1, first, last)
}

/// `pos` moved forward by `n` blocks in the circular log `[first, last)`. A position
/// outside the log is first clamped to `first`; an empty log yields `first`.
pub fn advance(pos: LogPos, n: u64, first: u32, last: u32) -> LogPos {
    let len = u64::from(last.saturating_sub(first));
    if len == 0 {
        return LogPos(first);
    }
    let off = if pos.0 >= first && pos.0 < last {
        u64::from(pos.0 - first)
    } else {
        0
    };
    let off = (off + n % len) % len;
    // off < len <= u32::MAX, so the sum fits in u32.
    LogPos(first + off as u32)
}

/// Transaction IDs wrap: `a` is newer than `b` (kernel `tid_gt`).
pub fn tid_gt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// `a` is `b` or newer (kernel `tid_geq`).
pub fn tid_geq(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

// ---------------------------------------------------------------------------------
// Pass-1 classification and scanning
// ---------------------------------------------------------------------------------

/// Why a block is not part of the log (the log ends before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotLog {
    /// Shorter than a header.
    Short,
    /// No jbd2 magic.
    NoMagic,
    /// A jbd2 block of another transaction.
    WrongSequence { found: u32 },
    /// A block type that cannot appear in the log (superblock, fast commit, unknown).
    UnexpectedType(u32),
}

/// What a log block is, for the transaction `expected_seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// A descriptor; its tags describe the data blocks that follow it. `csum_ok` false
    /// means stale or corrupt, decided at the transaction's commit block.
    Descriptor { tags: Vec<Tag>, csum_ok: bool },
    /// A commit block; `csum_ok` is always true without CSUM_V2/V3.
    Commit {
        commit_sec: u64,
        commit_nsec: u32,
        csum_ok: bool,
    },
    /// A revoke block; `records` fails when `r_count` is out of range, which matters
    /// only if the transaction turns out to be committed.
    Revoke {
        records: Result<Vec<u64>>,
        csum_ok: bool,
    },
    /// Not part of the log: the log ends here.
    Other(NotLog),
}

/// Classify one log block read at the current scan position.
pub fn classify(block: &[u8], expected_seq: u32, fmt: &LogFormat) -> BlockKind {
    if block.len() < HEADER_SIZE {
        return BlockKind::Other(NotLog::Short);
    }
    let h = match Header::decode(block) {
        Ok(h) => h,
        Err(_) => return BlockKind::Other(NotLog::NoMagic),
    };
    if h.sequence != expected_seq {
        return BlockKind::Other(NotLog::WrongSequence { found: h.sequence });
    }
    let f = &fmt.features;
    match h.blocktype {
        BLOCKTYPE_DESCRIPTOR => BlockKind::Descriptor {
            tags: parse_descriptor(block, f).unwrap_or_default(),
            csum_ok: verify_descriptor(block, fmt).is_ok(),
        },
        BLOCKTYPE_COMMIT => match CommitBlock::decode(block) {
            Ok(c) => BlockKind::Commit {
                commit_sec: c.commit_sec,
                commit_nsec: c.commit_nsec,
                csum_ok: verify_commit(block, fmt).is_ok(),
            },
            Err(_) => BlockKind::Other(NotLog::Short),
        },
        BLOCKTYPE_REVOKE => BlockKind::Revoke {
            records: decode_revoke(block, f).map(|r| r.records),
            csum_ok: verify_revoke(block, fmt).is_ok(),
        },
        t => BlockKind::Other(NotLog::UnexpectedType(t)),
    }
}

/// A data block logged by a transaction: read it at `log_block`, check it with
/// [`verify_tag`], unescape it if `tag` says so, and write it to `tag.blocknr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedBlock {
    pub log_block: LogPos,
    pub tag: Tag,
}

/// A committed transaction found by the scan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transaction {
    pub sequence: u32,
    /// Journal block of the transaction's first block.
    pub start: LogPos,
    pub blocks: Vec<LoggedBlock>,
    pub revoked: Vec<u64>,
    pub commit_sec: u64,
    pub commit_nsec: u32,
}

/// How the log ended (all of these are clean ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogEnd {
    /// `s_start == 0`: nothing to replay.
    Empty,
    /// A block that is not part of the log.
    NotLog(NotLog),
    /// A checksum failure judged stale by the commit-time rule.
    Stale,
    /// A bad commit checksum with ASYNC_COMMIT: the log ends before that transaction.
    AsyncCommitFailed,
}

/// The outcome of a successful scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanResult {
    /// Committed transactions in log order.
    pub transactions: Vec<Transaction>,
    /// The first transaction ID not in the log (the kernel's `end_transaction`); the
    /// new `s_sequence` must be at least this.
    pub end_sequence: u32,
    /// The journal block after the last commit block (`s_start` when none).
    pub head: LogPos,
    pub end: LogEnd,
}

/// Newest revoking transaction per filesystem block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RevokeTable(pub HashMap<u64, u32>);

impl RevokeTable {
    /// Record that transaction `sequence` revokes `blocknr`, keeping the newest tid.
    pub fn insert(&mut self, blocknr: u64, sequence: u32) {
        let e = self.0.entry(blocknr).or_insert(sequence);
        if tid_gt(sequence, *e) {
            *e = sequence;
        }
    }

    /// A copy of `blocknr` logged by transaction `sequence` must not be replayed.
    pub fn is_revoked(&self, blocknr: u64, sequence: u32) -> bool {
        match self.0.get(&blocknr) {
            Some(r) => !tid_gt(sequence, *r),
            None => false,
        }
    }
}

/// One write of the replay pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayWrite {
    pub sequence: u32,
    pub log_block: LogPos,
    pub tag: Tag,
}

impl ScanResult {
    /// The revoke pass over all committed transactions.
    pub fn revoke_table(&self) -> RevokeTable {
        let mut t = RevokeTable::default();
        for tx in &self.transactions {
            for b in &tx.revoked {
                t.insert(*b, tx.sequence);
            }
        }
        t
    }

    /// The replay pass: every logged block not revoked by its own or a later
    /// transaction, in log order (later writes to the same block win).
    pub fn replay_plan(&self) -> Vec<ReplayWrite> {
        let revoked = self.revoke_table();
        let mut out = Vec::new();
        for tx in &self.transactions {
            for b in &tx.blocks {
                if !revoked.is_revoked(b.tag.blocknr, tx.sequence) {
                    out.push(ReplayWrite {
                        sequence: tx.sequence,
                        log_block: b.log_block,
                        tag: b.tag,
                    });
                }
            }
        }
        out
    }
}

/// The SCAN pass as a pure state machine. Loop: `while let Some(p) = s.next() {
/// s.feed(&read(p)) }`, then [`finish`](Self::finish). Descriptor data blocks are
/// skipped, not read.
#[derive(Clone, Debug)]
pub struct Scanner {
    fmt: LogFormat,
    first: u32,
    last: u32,
    pos: LogPos,
    seq: u32,
    last_commit_sec: u64,
    /// A descriptor or revoke checksum failed in the current transaction.
    need_check_commit_time: bool,
    cur: Transaction,
    revoke_err: Option<FormatError>,
    done: Vec<Transaction>,
    head: LogPos,
    /// Blocks consumed so far; bounded by the log length.
    consumed: u64,
    outcome: Option<Result<LogEnd>>,
}

impl Scanner {
    /// Start at `(s_start, s_sequence)`. The superblock should have passed
    /// [`JournalSuperblock::verify`]; an empty log gives a scanner that is already done.
    pub fn new(sb: &JournalSuperblock) -> Scanner {
        let first = sb.first;
        let last = sb.log_last();
        let start = LogPos(sb.start);
        let mut s = Scanner {
            fmt: sb.log_format(),
            first,
            last,
            pos: start,
            seq: sb.sequence,
            last_commit_sec: 0,
            need_check_commit_time: false,
            cur: Transaction {
                sequence: sb.sequence,
                start,
                ..Transaction::default()
            },
            revoke_err: None,
            done: Vec::new(),
            head: start,
            consumed: 0,
            outcome: None,
        };
        if sb.start == 0 {
            s.outcome = Some(Ok(LogEnd::Empty));
        } else if first == 0 || first >= last || sb.start < first || sb.start >= last {
            s.outcome = Some(Err(FormatError::corrupted(format!(
                "jbd2 log bounds: s_start {} s_first {first} log end {last}",
                sb.start
            ))));
        }
        s
    }

    /// The journal block to read and [`feed`](Self::feed) next, or `None` when the
    /// scan is over.
    pub fn next(&self) -> Option<LogPos> {
        if self.outcome.is_some() {
            None
        } else {
            Some(self.pos)
        }
    }

    /// The transaction ID the scan expects next.
    pub fn sequence(&self) -> u32 {
        self.seq
    }

    fn log_len(&self) -> u64 {
        u64::from(self.last.saturating_sub(self.first))
    }

    fn step(&mut self, n: u64) {
        self.pos = advance(self.pos, n, self.first, self.last);
        self.consumed = self.consumed.saturating_add(n);
        if self.consumed > self.log_len() && self.outcome.is_none() {
            self.outcome = Some(Err(FormatError::corrupted(format!(
                "jbd2 log from s_start is longer than the log ({} blocks) in transaction {}",
                self.log_len(),
                self.seq
            ))));
        }
    }

    fn fail(&mut self, what: String) {
        self.outcome = Some(Err(FormatError::corrupted(what)));
    }

    /// Process the block read at [`next`](Self::next).
    pub fn feed(&mut self, block: &[u8]) {
        if self.outcome.is_some() {
            return;
        }
        match classify(block, self.seq, &self.fmt) {
            BlockKind::Other(why) => self.outcome = Some(Ok(LogEnd::NotLog(why))),
            BlockKind::Descriptor { tags, csum_ok } => {
                if !csum_ok {
                    self.need_check_commit_time = true;
                }
                let mut p = self.pos;
                for tag in &tags {
                    p = next_block(p, self.first, self.last);
                    self.cur.blocks.push(LoggedBlock {
                        log_block: p,
                        tag: *tag,
                    });
                }
                self.step(1 + tags.len() as u64);
            }
            BlockKind::Revoke { records, csum_ok } => {
                if !csum_ok {
                    self.need_check_commit_time = true;
                }
                match records {
                    Ok(r) => self.cur.revoked.extend(r),
                    Err(e) => {
                        if self.revoke_err.is_none() {
                            self.revoke_err = Some(e);
                        }
                    }
                }
                self.step(1);
            }
            BlockKind::Commit {
                commit_sec,
                commit_nsec,
                csum_ok,
            } => {
                let older = commit_sec < self.last_commit_sec;
                if self.need_check_commit_time {
                    if older {
                        self.outcome = Some(Ok(LogEnd::Stale));
                    } else {
                        self.fail(format!(
                            "jbd2 descriptor or revoke block checksum in transaction {}",
                            self.seq
                        ));
                    }
                    return;
                }
                if !csum_ok {
                    if older {
                        self.outcome = Some(Ok(LogEnd::Stale));
                    } else if self.fmt.features.async_commit() {
                        self.outcome = Some(Ok(LogEnd::AsyncCommitFailed));
                    } else {
                        self.fail(format!(
                            "jbd2 commit block checksum in transaction {}",
                            self.seq
                        ));
                    }
                    return;
                }
                if let Some(e) = self.revoke_err.take() {
                    self.outcome = Some(Err(e));
                    return;
                }
                self.step(1);
                self.last_commit_sec = commit_sec;
                self.head = self.pos;
                let mut tx = std::mem::take(&mut self.cur);
                tx.commit_sec = commit_sec;
                tx.commit_nsec = commit_nsec;
                self.done.push(tx);
                self.seq = self.seq.wrapping_add(1);
                self.cur = Transaction {
                    sequence: self.seq,
                    start: self.pos,
                    ..Transaction::default()
                };
            }
        }
    }

    /// The scan's result: committed transactions, or the corruption that makes
    /// recovery fail. Finishing early (while [`next`](Self::next) is `Some`) treats
    /// the log as ending at the current block.
    pub fn finish(self) -> Result<ScanResult> {
        let end = match self.outcome {
            Some(Err(e)) => return Err(e),
            Some(Ok(end)) => end,
            None => LogEnd::NotLog(NotLog::Short),
        };
        Ok(ScanResult {
            transactions: self.done,
            end_sequence: self.seq,
            head: self.head,
            end,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 1024;
    const UUID: [u8; 16] = *b"0123456789abcdef";

    fn all_feature_sets() -> Vec<Features> {
        let mut v = Vec::new();
        for incompat in [
            0,
            INCOMPAT_64BIT,
            INCOMPAT_CSUM_V2,
            INCOMPAT_CSUM_V2 | INCOMPAT_64BIT,
            INCOMPAT_CSUM_V3,
            INCOMPAT_CSUM_V3 | INCOMPAT_64BIT,
            INCOMPAT_CSUM_V3 | INCOMPAT_64BIT | INCOMPAT_REVOKE | INCOMPAT_ASYNC_COMMIT,
        ] {
            v.push(Features {
                compat: 0,
                incompat,
                ro_compat: 0,
            });
        }
        v
    }

    fn fmt_of(features: Features) -> LogFormat {
        LogFormat {
            features,
            j_seed: j_seed(&UUID),
        }
    }

    #[test]
    fn big_endian_helpers_are_big_endian_and_bounded() {
        let mut b = [0u8; 8];
        set_be32(&mut b, 0, 0xC03B_3998);
        assert_eq!(b[..4], [0xC0, 0x3B, 0x39, 0x98]);
        set_be16(&mut b, 4, 0x0102);
        assert_eq!(b[4..6], [1, 2]);
        assert_eq!(be16(&b, 4), 0x0102);
        set_be64(&mut b, 0, 0x0102_0304_0506_0708);
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(be64(&b, 0), 0x0102_0304_0506_0708);
        assert_eq!(be32(&b, 6), 0, "out-of-range read is zero");
        set_be32(&mut b, 6, 0xFFFF_FFFF);
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8], "out-of-range write is dropped");
    }

    #[test]
    fn header_round_trip_and_bad_magic() {
        let mut b = [0u8; 12];
        Header {
            blocktype: BLOCKTYPE_COMMIT,
            sequence: 77,
        }
        .encode(&mut b);
        assert_eq!(b[..4], [0xC0, 0x3B, 0x39, 0x98]);
        assert_eq!(
            Header::decode(&b),
            Ok(Header {
                blocktype: 2,
                sequence: 77
            })
        );
        b[0] = 0;
        assert!(
            matches!(Header::decode(&b), Err(FormatError::Corrupted { what, .. }) if what.contains("magic"))
        );
        assert!(matches!(
            Header::decode(&b[..11]),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn tag_sizes_follow_the_kernel() {
        let sizes: Vec<usize> = all_feature_sets().iter().map(|f| f.tag_bytes()).collect();
        assert_eq!(sizes, vec![8, 12, 10, 14, 16, 16, 16]);
        let f = Features::KERNEL_V3;
        assert_eq!(f.tail_bytes(), 4);
        assert_eq!(f.revoke_record_bytes(), 8);
        // 1 KiB: (1024 - 4 - 12 - 16) / 16
        assert_eq!(tag_capacity(1024, &f), 62);
        assert_eq!(tag_capacity(4096, &f), 254);
        assert_eq!(tag_capacity(1024, &Features::default()), (1024 - 28) / 8);
        assert_eq!(tag_capacity(20, &f), 0);
    }

    #[test]
    fn superblock_round_trip_checksum_and_checks() {
        let mut sb = JournalSuperblock::new(1024, 4096, UUID);
        let bytes = sb.to_bytes();
        assert_eq!(JournalSuperblock::decode(&bytes).as_ref(), Ok(&sb));
        sb.verify().expect("fresh sb verifies");
        sb.features_supported().expect("no features");
        assert!(sb.is_empty());
        assert_eq!(sb.log_last(), 4096);

        sb.enable_csum_v3(true);
        assert_eq!(sb.feature_incompat, 0x12);
        assert_eq!(sb.checksum_type, 4);
        sb.verify().expect("v3 sb verifies");
        let mut bytes = sb.to_bytes();
        let back = JournalSuperblock::decode(&bytes).expect("decodes");
        assert_eq!(back, sb);
        back.verify().expect("decoded sb verifies");
        bytes[0x300] ^= 1; // inside s_users: covered by the checksum
        let bad = JournalSuperblock::decode(&bytes).expect("still decodes");
        assert!(
            matches!(bad.verify(), Err(FormatError::Corrupted { what, .. }) if what.contains("jbd2 sb checksum"))
        );

        let mut s = sb.clone();
        s.first = 0;
        assert!(
            matches!(s.verify(), Err(FormatError::Corrupted { what, .. }) if what.contains("s_first"))
        );
        let mut s = sb.clone();
        s.start = 5000;
        s.update_checksum();
        assert!(
            matches!(s.verify(), Err(FormatError::Corrupted { what, .. }) if what.contains("s_start"))
        );
        let mut s = sb.clone();
        s.feature_incompat |= INCOMPAT_CSUM_V2;
        s.update_checksum();
        assert!(
            matches!(s.verify(), Err(FormatError::Corrupted { what, .. }) if what.contains("both"))
        );
        let mut s = sb.clone();
        s.checksum_type = 1;
        s.update_checksum();
        assert!(
            matches!(s.verify(), Err(FormatError::Corrupted { what, .. }) if what.contains("checksum_type"))
        );

        let mut s = sb.clone();
        s.feature_incompat |= 0x40 | INCOMPAT_FAST_COMMIT;
        s.feature_ro_compat = 0x1;
        let err = s.features_supported().expect_err("unknown bits refused");
        let FormatError::Corrupted { what, .. } = err else {
            panic!("wrong error kind")
        };
        assert!(
            what.contains("incompat 0x40") && what.contains("ro_compat 0x1"),
            "{what}"
        );
        assert!(
            !what.contains("fast_commit"),
            "known bits are not listed: {what}"
        );
        assert_eq!(
            s.features().names()[..2],
            ["64bit".to_string(), "csum_v3".to_string()]
        );

        // Fast commit shortens the log; v1 has no features whatever its bytes say.
        let mut s = sb.clone();
        s.feature_incompat |= INCOMPAT_FAST_COMMIT;
        assert_eq!(s.num_fc_blocks(), 256);
        assert_eq!(s.log_last(), 4096 - 256);
        s.blocktype = BLOCKTYPE_SUPERBLOCK_V1;
        assert_eq!(s.features(), Features::default());
        assert_eq!(s.log_last(), 4096);
    }

    #[test]
    fn superblock_rejects_wrong_type() {
        let mut b = JournalSuperblock::new(1024, 4096, UUID).to_bytes();
        set_be32(&mut b, H_BLOCKTYPE, BLOCKTYPE_COMMIT);
        assert!(
            matches!(JournalSuperblock::decode(&b), Err(FormatError::Corrupted { what, .. }) if what.contains("blocktype"))
        );
        assert!(matches!(
            JournalSuperblock::decode(&b[..1000]),
            Err(FormatError::Truncated { .. })
        ));
    }

    fn sample_tags(n: usize) -> Vec<Tag> {
        (0..n)
            .map(|i| Tag {
                blocknr: 0x1_0000_0000u64 * (i as u64 % 3) + 1000 + i as u64,
                flags: if i % 4 == 1 { TAG_FLAG_ESCAPE } else { 0 },
                csum: 0xABCD_0000 + i as u32,
            })
            .collect()
    }

    fn expected_tag(t: &Tag, f: &Features) -> Tag {
        Tag {
            blocknr: if f.is_64bit() {
                t.blocknr
            } else {
                t.blocknr & 0xFFFF_FFFF
            },
            flags: t.flags,
            csum: if f.csum_v3() {
                t.csum
            } else if f.csum_v2() {
                t.csum & 0xFFFF
            } else {
                0
            },
        }
    }

    #[test]
    fn descriptor_round_trip_every_layout() {
        for f in all_feature_sets() {
            let fmt = fmt_of(f);
            let cap = tag_capacity(BS, &f);
            for n in [1, 2, 7, cap, cap + 5] {
                let tags = sample_tags(n);
                let mut block = vec![0xEEu8; BS];
                let written = encode_descriptor(&mut block, 9, &tags, &UUID, &fmt).expect("encode");
                assert_eq!(written, n.min(cap), "{f:?}");
                assert_eq!(
                    Header::decode(&block),
                    Ok(Header {
                        blocktype: 1,
                        sequence: 9
                    })
                );
                let got = parse_descriptor(&block, &f).expect("parse");
                assert_eq!(got.len(), written, "{f:?} n={n}");
                for (i, (g, t)) in got.iter().zip(&tags).enumerate() {
                    let mut want = expected_tag(t, &f);
                    if i > 0 {
                        want.flags |= TAG_FLAG_SAME_UUID;
                    }
                    if i + 1 == written {
                        want.flags |= TAG_FLAG_LAST_TAG;
                    }
                    assert_eq!(*g, want, "{f:?} tag {i}");
                }
                // The UUID follows the first tag.
                let tb = f.tag_bytes();
                assert_eq!(block[HEADER_SIZE + tb..HEADER_SIZE + tb + 16], UUID);
                verify_descriptor(&block, &fmt).expect("verifies");
                if f.csum_v2or3() {
                    block[HEADER_SIZE] ^= 0x80;
                    assert!(
                        matches!(verify_descriptor(&block, &fmt), Err(FormatError::Corrupted { what, .. }) if what.contains("descriptor tail"))
                    );
                }
            }
        }
    }

    #[test]
    fn descriptor_without_last_tag_stops_before_the_tail() {
        let f = Features::KERNEL_V3;
        let mut block = vec![0u8; BS];
        Header {
            blocktype: BLOCKTYPE_DESCRIPTOR,
            sequence: 1,
        }
        .encode(&mut block);
        // All tags have SAME_UUID and no LAST_TAG: 1024-12-4 = 1008 = 63 tags of 16.
        for i in 0..63 {
            set_be32(
                &mut block,
                HEADER_SIZE + 16 * i + TAG3_FLAGS,
                u32::from(TAG_FLAG_SAME_UUID),
            );
        }
        assert_eq!(parse_descriptor(&block, &f).expect("parse").len(), 63);
        // Without tails (no csum), tags may use the last 4 bytes too: (1024-12)/8 = 126.
        let f0 = Features { incompat: 0, ..f };
        for i in 0..126 {
            set_be16(
                &mut block,
                HEADER_SIZE + 8 * i + TAG_FLAGS16,
                TAG_FLAG_SAME_UUID,
            );
        }
        assert_eq!(parse_descriptor(&block, &f0).expect("parse").len(), 126);
    }

    #[test]
    fn data_tag_checksum_and_escape() {
        let fmt = fmt_of(Features::KERNEL_V3);
        let mut data = vec![7u8; BS];
        set_be32(&mut data, 0, JBD2_MAGIC);
        let orig = data.clone();
        assert!(escape(&mut data));
        assert_eq!(data[..4], [0, 0, 0, 0]);
        assert!(
            !escape(&mut data),
            "an escaped block no longer starts with the magic"
        );
        let csum = tag_csum_field(&fmt, 42, &data);
        assert_eq!(csum, raw(raw(fmt.j_seed, &[0, 0, 0, 42]), &data));
        let tag = Tag {
            blocknr: 5,
            flags: TAG_FLAG_ESCAPE,
            csum,
        };
        verify_tag(&tag, 42, &data, &fmt).expect("verifies");
        assert!(
            verify_tag(&tag, 43, &data, &fmt).is_err(),
            "sequence is covered"
        );
        unescape(&mut data);
        assert_eq!(data, orig);
        let v2 = fmt_of(Features {
            incompat: INCOMPAT_CSUM_V2,
            ..Features::default()
        });
        assert_eq!(
            tag_csum_field(&v2, 42, &data),
            tag_csum(v2.j_seed, 42, &data) & 0xFFFF
        );
        let none = fmt_of(Features::default());
        verify_tag(&Tag::default(), 1, &data, &none).expect("no checksums, always ok");
        let mut short = [0xC0u8, 0x3B];
        assert!(!escape(&mut short));
    }

    #[test]
    fn commit_round_trip_and_checksum() {
        for f in all_feature_sets() {
            let fmt = fmt_of(f);
            let mut c = CommitBlock::new(12, 1_700_000_000, 123_456_789);
            if !f.csum_v2or3() {
                c.chksum_type = CHECKSUM_TYPE_CRC32;
                c.chksum_size = 4;
                c.chksum[0] = 0xDEAD_BEEF;
            }
            let mut block = vec![0x55u8; BS];
            c.encode(&mut block, &fmt).expect("encode");
            let back = CommitBlock::decode(&block).expect("decode");
            assert_eq!(back.sequence, 12);
            assert_eq!(back.commit_sec, 1_700_000_000);
            assert_eq!(back.commit_nsec, 123_456_789);
            assert_eq!(be64(&block, 0x30), 1_700_000_000);
            if f.csum_v2or3() {
                assert_eq!((back.chksum_type, back.chksum_size), (0, 0));
                assert_eq!(back.chksum[0], commit_csum(&block, fmt.j_seed));
            } else {
                assert_eq!(back, c);
            }
            verify_commit(&block, &fmt).expect("verifies");
            block[BS - 1] ^= 1;
            assert_eq!(
                verify_commit(&block, &fmt).is_err(),
                f.csum_v2or3(),
                "{f:?}"
            );
        }
        let mut tiny = [0u8; 20];
        Header {
            blocktype: 2,
            sequence: 1,
        }
        .encode(&mut tiny);
        assert!(matches!(
            CommitBlock::decode(&tiny),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn revoke_round_trip_and_bounds() {
        for f in all_feature_sets() {
            let fmt = fmt_of(f);
            let cap = revoke_capacity(BS, &f);
            let recs: Vec<u64> = (0..cap as u64 + 3)
                .map(|i| if f.is_64bit() { i << 33 | i } else { i * 3 })
                .collect();
            let mut block = vec![0u8; BS];
            let n = encode_revoke(&mut block, 3, &recs, &fmt).expect("encode");
            assert_eq!(n, cap);
            let r = decode_revoke(&block, &f).expect("decode");
            assert_eq!(r.sequence, 3);
            assert_eq!(r.records, recs[..cap]);
            assert_eq!(
                be32(&block, R_COUNT) as usize,
                16 + cap * f.revoke_record_bytes()
            );
            verify_revoke(&block, &fmt).expect("verifies");
            // r_count past the tail, misaligned, or below the header: refused.
            for bad in [BS as u32 - f.tail_bytes() as u32 + 1, 17, 8] {
                let mut b = block.clone();
                set_be32(&mut b, R_COUNT, bad);
                assert!(
                    matches!(decode_revoke(&b, &f), Err(FormatError::Corrupted { what, .. }) if what.contains("r_count")),
                    "{bad}"
                );
            }
            if f.csum_v2or3() {
                block[20] ^= 1;
                assert!(verify_revoke(&block, &fmt).is_err());
            }
        }
        assert_eq!(revoke_capacity(1024, &Features::KERNEL_V3), (1024 - 20) / 8);
        let fmt32 = fmt_of(Features::default());
        let mut b = vec![0u8; BS];
        assert!(encode_revoke(&mut b, 1, &[1 << 40], &fmt32).is_err());
    }

    #[test]
    fn log_positions_wrap() {
        assert_eq!(next_block(LogPos(5), 1, 10), LogPos(6));
        assert_eq!(next_block(LogPos(9), 1, 10), LogPos(1));
        assert_eq!(advance(LogPos(8), 3, 1, 10), LogPos(2));
        assert_eq!(advance(LogPos(8), 9 * 1000 + 3, 1, 10), LogPos(2));
        assert_eq!(
            advance(LogPos(0), 1, 1, 10),
            LogPos(2),
            "outside the log clamps to first"
        );
        assert_eq!(advance(LogPos(3), 1, 5, 5), LogPos(5));
        assert_eq!(
            advance(LogPos(u32::MAX - 1), u64::MAX, 1, u32::MAX),
            advance(
                LogPos(u32::MAX - 1),
                u64::MAX % (u32::MAX as u64 - 1),
                1,
                u32::MAX
            )
        );
        assert!(tid_gt(1, u32::MAX));
        assert!(!tid_gt(5, 5));
        assert!(tid_geq(5, 5));
    }

    /// An in-memory journal for scanner tests.
    struct MemLog {
        sb: JournalSuperblock,
        blocks: Vec<Vec<u8>>,
    }

    impl MemLog {
        fn new(maxlen: u32, start: u32, seq: u32, features: Features) -> MemLog {
            let mut sb = JournalSuperblock::new(BS as u32, maxlen, UUID);
            sb.feature_incompat = features.incompat;
            sb.checksum_type = CHECKSUM_TYPE_CRC32C;
            sb.start = start;
            sb.sequence = seq;
            sb.update_checksum();
            MemLog {
                sb,
                blocks: vec![vec![0u8; BS]; maxlen as usize],
            }
        }

        fn fmt(&self) -> LogFormat {
            self.sb.log_format()
        }

        fn put(&mut self, pos: LogPos, b: Vec<u8>) {
            self.blocks[pos.0 as usize] = b;
        }

        /// Write one transaction at `pos`; returns the position after its commit.
        fn write_tx(
            &mut self,
            mut pos: LogPos,
            seq: u32,
            data: &[(u64, Vec<u8>)],
            revokes: &[u64],
            sec: u64,
        ) -> LogPos {
            let fmt = self.fmt();
            let (first, last) = (self.sb.first, self.sb.log_last());
            if !revokes.is_empty() {
                let mut b = vec![0u8; BS];
                assert_eq!(
                    encode_revoke(&mut b, seq, revokes, &fmt).expect("revoke"),
                    revokes.len()
                );
                self.put(pos, b);
                pos = next_block(pos, first, last);
            }
            if !data.is_empty() {
                let mut tags = Vec::new();
                let mut logged = Vec::new();
                for (nr, d) in data {
                    let mut d = d.clone();
                    let esc = escape(&mut d);
                    let csum = tag_csum_field(&fmt, seq, &d);
                    tags.push(Tag {
                        blocknr: *nr,
                        flags: if esc { TAG_FLAG_ESCAPE } else { 0 },
                        csum,
                    });
                    logged.push(d);
                }
                let mut b = vec![0u8; BS];
                assert_eq!(
                    encode_descriptor(&mut b, seq, &tags, &UUID, &fmt).expect("desc"),
                    tags.len()
                );
                self.put(pos, b);
                for d in logged {
                    pos = next_block(pos, first, last);
                    self.put(pos, d);
                }
                pos = next_block(pos, first, last);
            }
            let mut b = vec![0u8; BS];
            CommitBlock::new(seq, sec, 0)
                .encode(&mut b, &fmt)
                .expect("commit");
            self.put(pos, b);
            next_block(pos, first, last)
        }

        fn scan(&self) -> Result<ScanResult> {
            let mut s = Scanner::new(&self.sb);
            let mut guard = 0;
            while let Some(p) = s.next() {
                s.feed(&self.blocks[p.0 as usize]);
                guard += 1;
                assert!(guard < 10_000, "scanner does not terminate");
            }
            s.finish()
        }
    }

    fn block_of(byte: u8) -> Vec<u8> {
        vec![byte; BS]
    }

    #[test]
    fn scanner_collects_committed_transactions_and_wraps() {
        let f = Features::KERNEL_V3;
        let mut log = MemLog::new(64, 58, 100, f);
        let mut magic_block = block_of(9);
        set_be32(&mut magic_block, 0, JBD2_MAGIC);
        let p = log.write_tx(
            LogPos(58),
            100,
            &[(500, block_of(1)), (501, magic_block.clone())],
            &[],
            10,
        );
        let p = log.write_tx(
            p,
            101,
            &[(502, block_of(2)), (503, block_of(3)), (500, block_of(4))],
            &[501],
            11,
        );
        let end = log.write_tx(p, 102, &[(501, block_of(5))], &[], 12);
        // Transaction 103 never committed: descriptor only.
        let mut d = vec![0u8; BS];
        encode_descriptor(
            &mut d,
            103,
            &[Tag {
                blocknr: 1,
                flags: 0,
                csum: 0,
            }],
            &UUID,
            &log.fmt(),
        )
        .expect("desc");
        log.put(end, d);

        let r = log.scan().expect("scan");
        assert_eq!(r.transactions.len(), 3);
        assert_eq!(r.end_sequence, 103);
        assert_eq!(r.head, end);
        assert!(end.0 < 58, "the log wrapped: {end:?}");
        // Transaction 103's descriptor and data block are skipped; the zero block after
        // them ends the log.
        assert_eq!(r.end, LogEnd::NotLog(NotLog::NoMagic));
        let plan = r.replay_plan();
        let targets: Vec<(u32, u64)> = plan.iter().map(|w| (w.sequence, w.tag.blocknr)).collect();
        // 501 of tx 100 is revoked by 101; 501 of 102 is newer than the revoke.
        assert_eq!(
            targets,
            vec![(100, 500), (101, 502), (101, 503), (101, 500), (102, 501)]
        );
        for w in &plan {
            let mut b = log.blocks[w.log_block.0 as usize].clone();
            verify_tag(&w.tag, w.sequence, &b, &log.fmt()).expect("tag csum");
            if w.tag.escaped() {
                unescape(&mut b);
            }
            let want = match (w.sequence, w.tag.blocknr) {
                (100, 500) => block_of(1),
                (101, 502) => block_of(2),
                (101, 503) => block_of(3),
                (101, 500) => block_of(4),
                _ => block_of(5),
            };
            assert_eq!(b, want);
        }
        let table = r.revoke_table();
        assert!(table.is_revoked(501, 100));
        assert!(table.is_revoked(501, 101));
        assert!(!table.is_revoked(501, 102));
        // The escaped block was logged with ESCAPE.
        let esc: Vec<&Transaction> = r
            .transactions
            .iter()
            .filter(|t| t.blocks.iter().any(|b| b.tag.escaped()))
            .collect();
        assert_eq!(esc.len(), 1);
        assert_eq!(esc[0].sequence, 100);
    }

    #[test]
    fn scanner_empty_log_and_bad_bounds() {
        let log = MemLog::new(64, 0, 7, Features::KERNEL_V3);
        let r = log.scan().expect("empty");
        assert_eq!(
            (r.transactions.len(), r.end_sequence, r.end),
            (0, 7, LogEnd::Empty)
        );
        let mut log = MemLog::new(64, 1, 7, Features::KERNEL_V3);
        log.sb.first = 70;
        assert!(
            matches!(log.scan(), Err(FormatError::Corrupted { what, .. }) if what.contains("bounds"))
        );
    }

    /// Two committed transactions, then a third whose descriptor tail is damaged;
    /// the third's commit time decides stale (older) vs corrupt (not older).
    #[test]
    fn scanner_stale_versus_corrupt_descriptor() {
        for (sec3, stale) in [(5u64, true), (20, false), (11, false)] {
            let mut log = MemLog::new(64, 1, 1, Features::KERNEL_V3);
            let p = log.write_tx(LogPos(1), 1, &[(10, block_of(1))], &[], 10);
            let p = log.write_tx(p, 2, &[(11, block_of(2))], &[], 11);
            let d = p;
            log.write_tx(p, 3, &[(12, block_of(3))], &[], sec3);
            log.blocks[d.0 as usize][HEADER_SIZE + 1] ^= 1;
            let r = log.scan();
            if stale {
                let r = r.expect("stale is a clean end");
                assert_eq!(
                    (r.transactions.len(), r.end, r.end_sequence),
                    (2, LogEnd::Stale, 3)
                );
            } else {
                assert!(
                    matches!(r, Err(FormatError::Corrupted { what, .. }) if what.contains("descriptor or revoke") && what.contains("transaction 3")),
                    "sec3={sec3}"
                );
            }
        }
    }

    #[test]
    fn scanner_stale_versus_corrupt_commit_and_revoke() {
        for (sec2, async_commit, want) in [
            (5u64, false, "stale"),
            (20, false, "corrupt"),
            (20, true, "async"),
        ] {
            let mut f = Features::KERNEL_V3;
            if async_commit {
                f.incompat |= INCOMPAT_ASYNC_COMMIT;
            }
            let mut log = MemLog::new(64, 1, 1, f);
            let p = log.write_tx(LogPos(1), 1, &[(10, block_of(1))], &[], 10);
            let end = log.write_tx(p, 2, &[(11, block_of(2))], &[], sec2);
            let commit = LogPos(end.0 - 1);
            log.blocks[commit.0 as usize][0x40] ^= 1;
            let r = log.scan();
            match want {
                "stale" => assert_eq!(
                    r.map(|r| (r.transactions.len(), r.end)),
                    Ok((1, LogEnd::Stale))
                ),
                "async" => assert_eq!(
                    r.map(|r| (r.transactions.len(), r.end)),
                    Ok((1, LogEnd::AsyncCommitFailed))
                ),
                _ => assert!(
                    matches!(r, Err(FormatError::Corrupted { what, .. }) if what.contains("commit block checksum in transaction 2"))
                ),
            }
        }
        // A damaged revoke tail is judged like a descriptor.
        let mut log = MemLog::new(64, 1, 1, Features::KERNEL_V3);
        let p = log.write_tx(LogPos(1), 1, &[(10, block_of(1))], &[], 10);
        log.write_tx(p, 2, &[], &[10], 30);
        log.blocks[p.0 as usize][17] ^= 1;
        assert!(
            matches!(log.scan(), Err(FormatError::Corrupted { what, .. }) if what.contains("descriptor or revoke"))
        );
        // A revoke with a bad r_count but a valid tail fails once its transaction commits.
        let mut log = MemLog::new(64, 1, 1, Features::KERNEL_V3);
        log.write_tx(LogPos(1), 1, &[], &[10, 11], 30);
        let fmt = log.fmt();
        let b = &mut log.blocks[1];
        set_be32(b, R_COUNT, 9999);
        set_block_tail(b, fmt.j_seed);
        assert!(
            matches!(log.scan(), Err(FormatError::Corrupted { what, .. }) if what.contains("r_count"))
        );
    }

    #[test]
    fn scanner_stops_on_a_self_overlapping_log() {
        // A descriptor at block 1 whose tags cover the whole log: the data blocks never
        // end, so the scan must stop on the length bound rather than loop.
        let f = Features::KERNEL_V3;
        let mut log = MemLog::new(40, 1, 1, f);
        let fmt = log.fmt();
        for i in 1..40u32 {
            let mut d = vec![0u8; BS];
            encode_descriptor(&mut d, 1, &sample_tags(30), &UUID, &fmt).expect("desc");
            log.put(LogPos(i), d);
        }
        assert!(
            matches!(log.scan(), Err(FormatError::Corrupted { what, .. }) if what.contains("longer than the log"))
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn features() -> impl Strategy<Value = Features> {
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(compat, incompat, ro_compat)| {
                Features {
                    compat,
                    incompat,
                    ro_compat,
                }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            #[test]
            fn decoders_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..2100),
                                    f in features(), seq in any::<u32>(), magic in any::<bool>(),
                                    bt in 0u32..8) {
                if magic && bytes.len() >= 12 {
                    set_be32(&mut bytes, 0, JBD2_MAGIC);
                    set_be32(&mut bytes, 4, bt);
                    set_be32(&mut bytes, 8, seq);
                }
                let fmt = LogFormat { features: f, j_seed: seq };
                let _ = Header::decode(&bytes);
                if let Ok(sb) = JournalSuperblock::decode(&bytes) {
                    let _ = sb.verify();
                    let _ = sb.features_supported();
                    let _ = sb.log_last();
                    let mut again = vec![0u8; SB_SIZE];
                    sb.encode(&mut again).expect("1024 bytes");
                    prop_assert_eq!(&again[..], &bytes[..SB_SIZE]);
                    let mut s = Scanner::new(&sb);
                    let mut n = 0;
                    while s.next().is_some() && n < 64 {
                        s.feed(&bytes);
                        n += 1;
                    }
                    let _ = s.finish();
                }
                let _ = parse_descriptor(&bytes, &f);
                let _ = verify_descriptor(&bytes, &fmt);
                let _ = CommitBlock::decode(&bytes);
                let _ = verify_commit(&bytes, &fmt);
                let _ = decode_revoke(&bytes, &f);
                let _ = verify_revoke(&bytes, &fmt);
                let _ = verify_block_tail(&bytes, seq, "x");
                let _ = block_tail_csum(&bytes, seq);
                let _ = commit_csum(&bytes, seq);
                let _ = classify(&bytes, seq, &fmt);
                let _ = verify_tag(&Tag::default(), seq, &bytes, &fmt);
                let mut m = bytes.clone();
                let _ = escape(&mut m);
                unescape(&mut m);
                let _ = encode_descriptor(&mut m, seq, &sample_tags(3), &UUID, &fmt);
                let _ = encode_revoke(&mut m, seq, &[1, 2], &fmt);
                let _ = CommitBlock::new(seq, 1, 2).encode(&mut m, &fmt);
            }

            #[test]
            fn descriptor_encode_parse_agree(f in features(), n in 1usize..80, seq in any::<u32>(),
                                             nrs in proptest::collection::vec(any::<u64>(), 80),
                                             flags in proptest::collection::vec(any::<u16>(), 80),
                                             csums in proptest::collection::vec(any::<u32>(), 80)) {
                let fmt = LogFormat { features: f, j_seed: 1 };
                let tags: Vec<Tag> = (0..n).map(|i| Tag { blocknr: nrs[i], flags: flags[i], csum: csums[i] }).collect();
                let mut block = vec![0u8; BS];
                let w = encode_descriptor(&mut block, seq, &tags, &UUID, &fmt).expect("encode");
                prop_assert_eq!(w, n.min(tag_capacity(BS, &f)));
                let got = parse_descriptor(&block, &f).expect("parse");
                prop_assert_eq!(got.len(), w);
                for (g, t) in got.iter().zip(&tags) {
                    let want = expected_tag(t, &f);
                    prop_assert_eq!(g.blocknr, want.blocknr);
                    prop_assert_eq!(g.csum, want.csum);
                    prop_assert_eq!(g.flags & !(TAG_FLAG_SAME_UUID | TAG_FLAG_LAST_TAG),
                                    t.flags & !(TAG_FLAG_SAME_UUID | TAG_FLAG_LAST_TAG));
                }
                prop_assert!(verify_descriptor(&block, &fmt).is_ok());
            }
        }
    }

    /// Ground truth from mkfs.ext4, debugfs, dumpe2fs and kernel loop mounts.
    mod ground_truth {
        use super::*;
        use std::fs::{self, File};
        use std::io::Write;
        use std::os::unix::fs::FileExt;
        use std::path::{Path, PathBuf};
        use std::process::Command;

        struct TempDir(PathBuf);

        impl TempDir {
            fn new(tag: &str) -> TempDir {
                let p =
                    std::env::temp_dir().join(format!("rext4-jbd2-{tag}-{}", std::process::id()));
                let _ = fs::remove_dir_all(&p);
                fs::create_dir_all(&p).expect("create temp dir");
                TempDir(p)
            }
        }

        impl Drop for TempDir {
            fn drop(&mut self) {
                let _ = fs::remove_dir_all(&self.0);
            }
        }

        /// Unmounts on drop, also when the test panics.
        struct Mount {
            dir: PathBuf,
            mounted: bool,
        }

        impl Mount {
            fn new(img: &Path, dir: &Path, opts: &str) -> Mount {
                fs::create_dir_all(dir).expect("mount point");
                run(Command::new("mount")
                    .arg("-o")
                    .arg(format!("loop,{opts}"))
                    .arg(img)
                    .arg(dir));
                Mount {
                    dir: dir.to_path_buf(),
                    mounted: true,
                }
            }

            fn unmount(&mut self) {
                if self.mounted {
                    self.mounted = false;
                    let ok = Command::new("umount")
                        .arg(&self.dir)
                        .status()
                        .map(|s| s.success());
                    if !matches!(ok, Ok(true)) {
                        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
                    }
                }
            }
        }

        impl Drop for Mount {
            fn drop(&mut self) {
                self.unmount();
            }
        }

        fn have(tool: &str) -> bool {
            ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .any(|d| Path::new(d).join(tool).exists())
        }

        fn run(cmd: &mut Command) -> String {
            let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
            assert!(
                out.status.success(),
                "{cmd:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }

        fn mkfs(img: &Path) {
            File::create(img)
                .and_then(|f| f.set_len(64 << 20))
                .expect("image file");
            run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(img));
        }

        fn debugfs(img: &Path, req: &str) -> String {
            run(Command::new("debugfs").arg("-R").arg(req).arg(img))
        }

        /// The filesystem block size (ext4 superblock at byte 1024, s_log_block_size 0x18).
        fn fs_block_size(img: &Path) -> u64 {
            let mut sb = [0u8; 1024];
            File::open(img)
                .and_then(|f| f.read_exact_at(&mut sb, 1024))
                .expect("read ext4 sb");
            1024u64 << crate::bytes::le32(&sb, 0x18)
        }

        struct Journal {
            file: File,
            phys_start: u64,
            bs: u64,
        }

        impl Journal {
            /// Locate inode 8's (contiguous) journal with debugfs.
            fn open(img: &Path) -> Journal {
                let phys_start: u64 = debugfs(img, "bmap <8> 0")
                    .trim()
                    .parse()
                    .expect("bmap output");
                assert!(phys_start > 0, "journal block 0 is mapped");
                Journal {
                    file: File::open(img).expect("open image"),
                    phys_start,
                    bs: fs_block_size(img),
                }
            }

            fn block(&self, n: u32) -> Vec<u8> {
                let mut b = vec![0u8; self.bs as usize];
                self.file
                    .read_exact_at(&mut b, (self.phys_start + u64::from(n)) * self.bs)
                    .expect("read journal block");
                b
            }

            fn sb(&self) -> JournalSuperblock {
                JournalSuperblock::decode(&self.block(0)).expect("journal sb decodes")
            }
        }

        fn dumpe2fs_field(img: &Path, key: &str) -> String {
            let out = run(Command::new("dumpe2fs").arg("-h").arg(img));
            out.lines()
                .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
                .unwrap_or_else(|| panic!("dumpe2fs has no {key:?}"))
        }

        #[test]
        fn fresh_mkfs_journal_superblock() {
            if !have("mkfs.ext4") || !have("debugfs") || !have("dumpe2fs") {
                rext4_testkit::skip("mkfs.ext4/debugfs/dumpe2fs not installed");
                return;
            }
            let tmp = TempDir::new("mkfs");
            let img = tmp.0.join("fresh.img");
            mkfs(&img);
            let j = Journal::open(&img);
            let sb = j.sb();
            sb.verify().expect("fresh journal sb verifies");
            sb.features_supported().expect("fresh journal features");
            assert_eq!(sb.blocktype, BLOCKTYPE_SUPERBLOCK_V2);
            assert_eq!(sb.features(), Features::default());
            assert_eq!(sb.checksum_type, 0);
            assert_eq!((sb.start, sb.sequence, sb.first, sb.nr_users), (0, 1, 1, 1));
            assert_eq!(u64::from(sb.blocksize), j.bs);
            let blocks: u32 = dumpe2fs_field(&img, "Total journal blocks:")
                .parse()
                .expect("journal blocks");
            assert_eq!(sb.maxlen, blocks);
            let size = dumpe2fs_field(&img, "Total journal size:");
            let kib: u64 = size
                .trim_end_matches('k')
                .parse()
                .expect("journal size in k");
            assert_eq!(u64::from(sb.maxlen) * u64::from(sb.blocksize), kib * 1024);
            // The journal uuid is the filesystem's.
            let fs_uuid = dumpe2fs_field(&img, "Filesystem UUID:").replace('-', "");
            let hex: String = sb.uuid.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, fs_uuid);
            // Contiguous: the last journal block maps right after the first.
            let last: u64 = debugfs(&img, &format!("bmap <8> {}", sb.maxlen - 1))
                .trim()
                .parse()
                .expect("bmap");
            assert_eq!(last, j.phys_start + u64::from(sb.maxlen) - 1);
            // Our fresh superblock is byte-identical to mkfs's.
            let ours = JournalSuperblock::new(sb.blocksize, sb.maxlen, sb.uuid).to_bytes();
            assert_eq!(&ours[..], &j.block(0)[..SB_SIZE]);
        }

        /// Deterministic file contents.
        fn pattern(seed: u32, len: usize) -> Vec<u8> {
            let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
            (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (x >> 16) as u8
                })
                .collect()
        }

        fn write_fsync(path: &Path, data: &[u8]) {
            let mut f = File::create(path).expect("create file");
            f.write_all(data).expect("write");
            f.sync_all().expect("fsync");
        }

        /// What a walk of a kernel-written log found.
        #[derive(Debug, Default)]
        struct Walk {
            /// (sequence, blocktype, journal block) of every log block header.
            headers: Vec<(u32, u32, u32)>,
            tags_verified: usize,
            escaped: usize,
            revoked: usize,
        }

        /// Walk the log with the block decoders, asserting every checksum, and check
        /// that the Scanner agrees.
        fn walk(j: &Journal, sb: &JournalSuperblock) -> Walk {
            let fmt = sb.log_format();
            let (first, last) = (sb.first, sb.log_last());
            let mut w = Walk::default();
            let mut pos = LogPos(sb.start);
            let mut seq = sb.sequence;
            let mut committed = 0usize;
            for _ in 0..last {
                let b = j.block(pos.0);
                match classify(&b, seq, &fmt) {
                    BlockKind::Descriptor { tags, csum_ok } => {
                        assert!(csum_ok, "descriptor tail at journal block {}", pos.0);
                        w.headers.push((seq, BLOCKTYPE_DESCRIPTOR, pos.0));
                        for t in &tags {
                            pos = next_block(pos, first, last);
                            let data = j.block(pos.0);
                            verify_tag(t, seq, &data, &fmt).expect("kernel tag checksum verifies");
                            w.tags_verified += 1;
                            w.escaped += usize::from(t.escaped());
                        }
                    }
                    BlockKind::Revoke { records, csum_ok } => {
                        assert!(csum_ok, "revoke tail at journal block {}", pos.0);
                        w.revoked += records.expect("revoke r_count").len();
                        w.headers.push((seq, BLOCKTYPE_REVOKE, pos.0));
                    }
                    BlockKind::Commit { csum_ok, .. } => {
                        assert!(csum_ok, "commit checksum at journal block {}", pos.0);
                        w.headers.push((seq, BLOCKTYPE_COMMIT, pos.0));
                        committed += 1;
                        seq = seq.wrapping_add(1);
                    }
                    BlockKind::Other(_) => break,
                }
                pos = next_block(pos, first, last);
            }
            // The Scanner sees the same committed transactions.
            let mut s = Scanner::new(sb);
            while let Some(p) = s.next() {
                s.feed(&j.block(p.0));
            }
            let r = s.finish().expect("scan of a kernel log");
            assert!(
                matches!(r.end, LogEnd::NotLog(_)),
                "log ended on a checksum: {:?}",
                r.end
            );
            assert_eq!(r.transactions.len(), committed);
            assert_eq!(r.end_sequence, seq);
            w
        }

        /// debugfs logdump's "Found expected sequence S, type T (...) at block B" lines.
        fn logdump_headers(img: &Path) -> Vec<(u32, u32, u32)> {
            debugfs(img, "logdump")
                .lines()
                .filter_map(|l| {
                    let rest = l.strip_prefix("Found expected sequence ")?;
                    let (seq, rest) = rest.split_once(", type ")?;
                    let (ty, rest) = rest.split_once(' ')?;
                    let blk = rest.rsplit_once("at block ")?.1;
                    Some((
                        seq.parse().ok()?,
                        ty.parse().ok()?,
                        blk.trim().parse().ok()?,
                    ))
                })
                .collect()
        }

        /// Mount, run `work`, copy the image while still mounted, unmount. Returns the
        /// copy's journal superblock and the walk (None when the log was empty).
        fn crash_copy(
            tmp: &TempDir,
            name: &str,
            opts: &str,
            work: &dyn Fn(&Path),
        ) -> (PathBuf, PathBuf, Option<Walk>) {
            let img = tmp.0.join(format!("{name}.img"));
            let copy = tmp.0.join(format!("{name}-copy.img"));
            mkfs(&img);
            let mut m = Mount::new(&img, &tmp.0.join(format!("{name}-mnt")), opts);
            work(&m.dir);
            run(Command::new("cp")
                .arg("--sparse=always")
                .arg(&img)
                .arg(&copy));
            m.unmount();

            let j = Journal::open(&copy);
            let sb = j.sb();
            assert_eq!(sb.feature_incompat, INCOMPAT_64BIT | INCOMPAT_CSUM_V3);
            assert_eq!(sb.checksum_type, CHECKSUM_TYPE_CRC32C);
            sb.verify()
                .expect("kernel journal sb verifies (s_checksum)");
            sb.features_supported().expect("kernel journal features");
            if sb.is_empty() {
                eprintln!("{name}: the copied log was empty (s_start 0)");
                return (img, copy, None);
            }
            let w = walk(&j, &sb);
            assert!(!w.headers.is_empty(), "s_start set but no log block found");
            assert_eq!(
                w.headers,
                logdump_headers(&copy),
                "our walk and debugfs logdump differ"
            );
            (img, copy, Some(w))
        }

        #[test]
        fn kernel_written_log_decodes_and_verifies() {
            if let Err(why) = rext4_testkit::can_loop_mount() {
                rext4_testkit::skip(&why);
                return;
            }
            if !have("mkfs.ext4") || !have("debugfs") || !have("mount") {
                rext4_testkit::skip("mkfs.ext4/debugfs/mount not installed");
                return;
            }
            let tmp = TempDir::new("mount");

            // Ordered mode: directory blocks logged in one transaction and freed in the
            // next give a revoke block.
            let ordered = |dir: &Path| {
                let d = dir.join("d");
                fs::create_dir(&d).expect("mkdir");
                for i in 0..100 {
                    fs::write(
                        d.join(format!("file_with_a_longish_name_{i}")),
                        pattern(i, 10),
                    )
                    .expect("write");
                }
                run(Command::new("sync").arg("-f").arg(dir));
                fs::remove_dir_all(&d).expect("rm -r");
                run(Command::new("sync").arg("-f").arg(dir));
                for i in 0..3 {
                    write_fsync(&dir.join(format!("f{i}")), &pattern(100 + i, 5000));
                }
            };
            // Journalled data: blocks that start with the jbd2 magic are logged escaped.
            let journalled = |dir: &Path| {
                let mut data = Vec::new();
                for i in 0..4u8 {
                    let mut blk = vec![i; 1024];
                    set_be32(&mut blk, 0, JBD2_MAGIC);
                    data.extend(blk);
                }
                write_fsync(&dir.join("esc"), &data);
                write_fsync(&dir.join("plain"), &pattern(7, 3000));
            };

            let mut found = None;
            for attempt in 0..3 {
                let (_img, _copy, w) =
                    crash_copy(&tmp, &format!("ordered{attempt}"), "commit=60", &ordered);
                if let Some(w) = w {
                    found = Some(w);
                    break;
                }
            }
            let w = found.expect("ordered mode: the copied log was empty 3 times");
            assert!(w.tags_verified > 0 && w.revoked > 0, "{w:?}");

            let mut found = None;
            for attempt in 0..3 {
                let (img, copy, w) = crash_copy(
                    &tmp,
                    &format!("journal{attempt}"),
                    "data=journal,commit=60",
                    &journalled,
                );
                if let Some(w) = w {
                    found = Some((img, copy, w));
                    break;
                }
            }
            let (img, copy, w) = found.expect("data=journal: the copied log was empty 3 times");
            assert!(
                w.escaped >= 4,
                "the 4 magic-led data blocks are escaped: {w:?}"
            );
            // Replaying an escaped block restores what the kernel checkpointed at unmount.
            let j = Journal::open(&copy);
            let sb = j.sb();
            let mut s = Scanner::new(&sb);
            while let Some(p) = s.next() {
                s.feed(&j.block(p.0));
            }
            let plan = s.finish().expect("scan").replay_plan();
            let home = File::open(&img).expect("open unmounted image");
            let mut checked = 0;
            for wr in plan.iter().filter(|w| w.tag.escaped()) {
                let mut b = j.block(wr.log_block.0);
                assert_eq!(
                    be32(&b, 0),
                    0,
                    "escaped block is stored with the magic zeroed"
                );
                unescape(&mut b);
                let mut disk = vec![0u8; b.len()];
                home.read_exact_at(&mut disk, wr.tag.blocknr * j.bs)
                    .expect("read home block");
                assert_eq!(b, disk, "fs block {}", wr.tag.blocknr);
                checked += 1;
            }
            assert!(checked >= 4, "{checked}");
        }
    }

    #[test]
    fn early_blocks_and_records_round_trip() {
        let boot = [7u8; 16];
        let mut b = vec![0u8; 1024];
        encode_early(&mut b, 41, &boot, 99).expect("encode");
        assert!(is_early(&b, 41, &boot, 99));
        assert!(!is_early(&b, 42, &boot, 99), "another transaction");
        assert!(!is_early(&b, 41, &[8u8; 16], 99), "another boot");
        assert!(!is_early(&b, 41, &boot, 98), "another journal");
        for i in [0, 5, EB_MARK + 3, EB_BOOT + 1, 1020] {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(!is_early(&c, 41, &boot, 99), "bit flip at {i} not caught");
        }
        // jbd2's recovery sees no block it knows (its scan ends here).
        assert!(matches!(
            classify(
                &b,
                41,
                &LogFormat {
                    features: Features::KERNEL_V3,
                    j_seed: 99
                }
            ),
            BlockKind::Other(NotLog::UnexpectedType(BLOCKTYPE_EARLY))
        ));
        let mut sb = JournalSuperblock::new(1024, 1024, [1; 16]);
        assert_eq!(EarlyRecord::from_sb(&sb), None);
        let r = EarlyRecord {
            start: 1,
            first_tid: 77,
            boot_id: boot,
        };
        EarlyRecord::store(Some(&r), &mut sb);
        assert_eq!(EarlyRecord::from_sb(&sb), Some(r));
        let mut bad = sb.clone();
        bad.padding[13] ^= 1;
        assert_eq!(EarlyRecord::from_sb(&bad), None);
        EarlyRecord::store(None, &mut sb);
        assert_eq!(EarlyRecord::from_sb(&sb), None);
        assert!(sb.padding.iter().all(|&x| x == 0));
    }
}
