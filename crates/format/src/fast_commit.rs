//! ext4 fast commits: the blocks of the journal's fast-commit area (compat feature
//! fast_commit; journal incompat FAST_COMMIT), their tags and the scan that decides
//! which of them a recovery replays. Facts from the kernel's `fs/ext4/fast_commit.c`
//! (6.x), e2fsprogs' `e2fsck/journal.c` and `Documentation/filesystems/ext4/
//! journal.rst`, "Fast Commits".
//!
//! Where: the area is the journal's last `num_fc_blocks` blocks; jbd2 sets
//! `j_fc_first = j_last + 1` with `j_last = s_maxlen - num_fc_blocks`, so the first
//! fast-commit block is journal block `log_last + 1` and the block at `log_last` is
//! never used (`JournalSuperblock::log_last`). A recovery reads them from there, in
//! order, until the scan stops.
//!
//! Layout: tag-length-value records, little-endian, packed from each block's start:
//! `tag le16, len le16` (4 bytes) then `len` bytes of value. No record crosses a block:
//! the writer pads the rest of a block with a PAD record, and each fast commit ends
//! with a TAIL whose length runs to the block's end (older kernels left the last byte
//! out; both read the same here). Values:
//! - HEAD (9): `features le32` (none are defined), `tid le32`: the first record of the
//!   first fast commit of a transaction;
//! - ADD_RANGE (1): `ino le32`, an ext4 extent (12 bytes: `ee_block le32, ee_len le16,
//!   ee_start_hi le16, ee_start_lo le32`; a length above 32768 means unwritten): these
//!   logical blocks of the inode now map there;
//! - DEL_RANGE (2): `ino le32, lblk le32, len le32`: these logical blocks are unmapped;
//! - CREAT (3), LINK (4), UNLINK (5): `parent le32, ino le32`, then the name (1 to 255
//!   bytes, not NUL-terminated): a directory entry created with its inode, added, or
//!   removed;
//! - INODE (6): `ino le32` then the raw inode, 128 bytes plus its `i_extra_isize`;
//! - PAD (7): zeros; TAIL (8): `tid le32, crc le32`.
//!
//! Checksum: each fast commit's TAIL carries raw crc32c (seed 0) over every byte of its
//! records, from the byte after the previous TAIL (or the area's start) through the
//! TAIL's `tid` (PAD records and their zeros included).
//!
//! The scan ([`Scan`], the kernel's `ext4_fc_replay_scan`): the area holds nothing to
//! replay unless its first record is a HEAD. A HEAD whose tid is not the one recovery
//! expects (the first transaction not in the log) ends the scan; a record whose length
//! is not its tag's, that runs past its block, or whose tag is unknown, and a TAIL
//! whose tid or checksum is wrong, end it too — cleanly once a fast commit has been
//! found whole, as an error before (a damaged area must not pass for an empty one).
//! Replay takes every record up to the last valid TAIL, in order.
//!
//! Must hold: nothing here panics on any input; every length is checked against the
//! block before it is used.
//!
//! Callers: `rext4_jbd2::recover` (scan), the engine's fast-commit replay (the
//! records), tests (the [`Writer`], which lays records out as the kernel does).

use crate::bytes::{le16, le32, set_le16, set_le32};
use crate::csum::raw;
use crate::extent::{Extent, MAX_INIT_LEN};
use crate::{FormatError, Result};

/// Record tags (`EXT4_FC_TAG_*`).
pub const TAG_ADD_RANGE: u16 = 0x0001;
pub const TAG_DEL_RANGE: u16 = 0x0002;
pub const TAG_CREAT: u16 = 0x0003;
pub const TAG_LINK: u16 = 0x0004;
pub const TAG_UNLINK: u16 = 0x0005;
pub const TAG_INODE: u16 = 0x0006;
pub const TAG_PAD: u16 = 0x0007;
pub const TAG_TAIL: u16 = 0x0008;
pub const TAG_HEAD: u16 = 0x0009;

/// Size of a record's tag and length.
pub const TL_SIZE: usize = 4;
const HEAD_SIZE: usize = 8;
const ADD_RANGE_SIZE: usize = 16;
const DEL_RANGE_SIZE: usize = 12;
const DENTRY_SIZE: usize = 8;
const INODE_INO_SIZE: usize = 4;
const TAIL_SIZE: usize = 8;
const _: () = assert!(ADD_RANGE_SIZE == 4 + crate::extent::ENTRY_SIZE);
/// `EXT4_FC_SUPPORTED_FEATURES`: none.
pub const SUPPORTED_FEATURES: u32 = 0;
/// The raw inode's fixed part (`EXT4_GOOD_OLD_INODE_SIZE`).
pub const GOOD_OLD_INODE_SIZE: usize = 128;
/// Longest name (`EXT4_NAME_LEN`).
pub const NAME_LEN: usize = 255;

/// One fast-commit record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tag {
    Head {
        features: u32,
        tid: u32,
    },
    AddRange {
        ino: u32,
        ext: Extent,
    },
    DelRange {
        ino: u32,
        lblk: u32,
        len: u32,
    },
    Creat {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
    Link {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
    Unlink {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
    /// The inode's first 128 bytes plus its extra part.
    Inode {
        ino: u32,
        raw: Vec<u8>,
    },
    Pad {
        len: u16,
    },
    Tail {
        tid: u32,
        crc: u32,
    },
}

impl Tag {
    /// The record's tag number.
    pub fn code(&self) -> u16 {
        match self {
            Tag::Head { .. } => TAG_HEAD,
            Tag::AddRange { .. } => TAG_ADD_RANGE,
            Tag::DelRange { .. } => TAG_DEL_RANGE,
            Tag::Creat { .. } => TAG_CREAT,
            Tag::Link { .. } => TAG_LINK,
            Tag::Unlink { .. } => TAG_UNLINK,
            Tag::Inode { .. } => TAG_INODE,
            Tag::Pad { .. } => TAG_PAD,
            Tag::Tail { .. } => TAG_TAIL,
        }
    }

    /// The record's name, as the kernel's `tag2str` has it.
    pub fn name(&self) -> &'static str {
        match self {
            Tag::Head { .. } => "HEAD",
            Tag::AddRange { .. } => "ADD_RANGE",
            Tag::DelRange { .. } => "DEL_RANGE",
            Tag::Creat { .. } => "CREAT",
            Tag::Link { .. } => "LINK",
            Tag::Unlink { .. } => "UNLINK",
            Tag::Inode { .. } => "INODE",
            Tag::Pad { .. } => "PAD",
            Tag::Tail { .. } => "TAIL",
        }
    }
}

/// Decode the 12-byte ext4 extent of an ADD_RANGE record.
fn decode_extent(b: &[u8]) -> Extent {
    let ee_len = le16(b, 4);
    let (len, unwritten) = if ee_len > MAX_INIT_LEN {
        (ee_len - MAX_INIT_LEN, true)
    } else {
        (ee_len, false)
    };
    Extent {
        logical: le32(b, 0),
        len,
        physical: (u64::from(le16(b, 6)) << 32) | u64::from(le32(b, 8)),
        unwritten,
    }
}

fn encode_extent(e: &Extent, b: &mut [u8]) {
    set_le32(b, 0, e.logical);
    let ee_len = if e.unwritten {
        e.len.saturating_add(MAX_INIT_LEN)
    } else {
        e.len
    };
    set_le16(b, 4, ee_len);
    set_le16(b, 6, (e.physical >> 32) as u16);
    set_le32(b, 8, e.physical as u32);
}

/// Whether `len` is a valid value length for `tag` (the kernel's
/// `ext4_fc_value_len_isvalid`); `inode_size` is the filesystem's.
fn value_len_valid(tag: u16, len: usize, inode_size: usize) -> bool {
    match tag {
        TAG_ADD_RANGE => len == ADD_RANGE_SIZE,
        TAG_DEL_RANGE => len == DEL_RANGE_SIZE,
        TAG_CREAT | TAG_LINK | TAG_UNLINK => len > DENTRY_SIZE && len - DENTRY_SIZE <= NAME_LEN,
        TAG_INODE => {
            len >= INODE_INO_SIZE + GOOD_OLD_INODE_SIZE && len - INODE_INO_SIZE <= inode_size
        }
        TAG_PAD => true,
        TAG_TAIL => len >= TAIL_SIZE,
        TAG_HEAD => len == HEAD_SIZE,
        _ => false,
    }
}

/// Decode a record's value (its length already checked).
fn decode_value(tag: u16, v: &[u8]) -> Option<Tag> {
    let dentry = |v: &[u8]| {
        (
            le32(v, 0),
            le32(v, 4),
            v.get(DENTRY_SIZE..).unwrap_or(&[]).to_vec(),
        )
    };
    Some(match tag {
        TAG_HEAD => Tag::Head {
            features: le32(v, 0),
            tid: le32(v, 4),
        },
        TAG_ADD_RANGE => Tag::AddRange {
            ino: le32(v, 0),
            ext: decode_extent(v.get(4..)?),
        },
        TAG_DEL_RANGE => Tag::DelRange {
            ino: le32(v, 0),
            lblk: le32(v, 4),
            len: le32(v, 8),
        },
        TAG_CREAT => {
            let (parent, ino, name) = dentry(v);
            Tag::Creat { parent, ino, name }
        }
        TAG_LINK => {
            let (parent, ino, name) = dentry(v);
            Tag::Link { parent, ino, name }
        }
        TAG_UNLINK => {
            let (parent, ino, name) = dentry(v);
            Tag::Unlink { parent, ino, name }
        }
        TAG_INODE => Tag::Inode {
            ino: le32(v, 0),
            raw: v.get(INODE_INO_SIZE..)?.to_vec(),
        },
        TAG_PAD => Tag::Pad {
            len: u16::try_from(v.len()).ok()?,
        },
        TAG_TAIL => Tag::Tail {
            tid: le32(v, 0),
            crc: le32(v, 4),
        },
        _ => return None,
    })
}

/// What a fed block tells the scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Read the next block.
    Continue,
    /// Nothing more belongs to this area's fast commits.
    Stop,
}

/// The SCAN pass over a fast-commit area (see the module note): feed its blocks in
/// order until [`Step::Stop`] (or the area's end), then [`Scan::finish`].
#[derive(Debug, Clone)]
pub struct Scan {
    expected_tid: u32,
    inode_size: usize,
    blocks: u32,
    tags: Vec<Tag>,
    /// Records of the fast commits found whole (through their TAIL).
    valid: usize,
    crc: u32,
    stopped: bool,
}

impl Scan {
    /// A scan for the fast commits of transaction `expected_tid` (the first one not
    /// in the log) on a filesystem with `inode_size`-byte inodes.
    pub fn new(expected_tid: u32, inode_size: usize) -> Scan {
        Scan {
            expected_tid,
            inode_size,
            blocks: 0,
            tags: Vec::new(),
            valid: 0,
            crc: 0,
            stopped: false,
        }
    }

    /// Stop, or fail when nothing whole was found yet.
    fn bad(&mut self, what: String) -> Result<Step> {
        self.stopped = true;
        if self.valid > 0 {
            Ok(Step::Stop)
        } else {
            Err(FormatError::corrupted(format!(
                "fast commit area block {}: {what}",
                self.blocks.saturating_sub(1)
            )))
        }
    }

    /// Scan the area's next block.
    pub fn feed(&mut self, block: &[u8]) -> Result<Step> {
        if self.stopped {
            return Ok(Step::Stop);
        }
        let first = self.blocks == 0;
        self.blocks += 1;
        if first && (block.len() < TL_SIZE || le16(block, 0) != TAG_HEAD) {
            // Nothing was written to the area in this transaction.
            self.stopped = true;
            return Ok(Step::Stop);
        }
        let mut cur = 0usize;
        while cur + TL_SIZE <= block.len() {
            let tag = le16(block, cur);
            let len = usize::from(le16(block, cur + 2));
            let val = cur + TL_SIZE;
            if len > block.len() - val || !value_len_valid(tag, len, self.inode_size) {
                return self.bad(format!(
                    "record at byte {cur} (tag {tag}, length {len}) is not a valid record"
                ));
            }
            let value = &block[val..val + len];
            let Some(t) = decode_value(tag, value) else {
                return self.bad(format!("record at byte {cur} has unknown tag {tag}"));
            };
            match &t {
                Tag::Head { features, tid } => {
                    if features & !SUPPORTED_FEATURES != 0 {
                        self.stopped = true;
                        return Err(FormatError::corrupted(format!(
                            "fast commit HEAD has unknown features {features:#x}"
                        )));
                    }
                    if *tid != self.expected_tid {
                        self.stopped = true;
                        return Ok(Step::Stop);
                    }
                    self.crc = raw(self.crc, &block[cur..val + len]);
                }
                Tag::Tail { tid, crc } => {
                    self.crc = raw(self.crc, &block[cur..val + 4]);
                    if *tid == self.expected_tid && *crc == self.crc {
                        self.tags.push(t);
                        self.valid = self.tags.len();
                        self.crc = 0;
                        cur = val + len;
                        continue;
                    }
                    let why = if *tid != self.expected_tid {
                        format!("TAIL of transaction {tid}, not {}", self.expected_tid)
                    } else {
                        format!(
                            "TAIL checksum {crc:#010x} does not match the records' {:#010x}",
                            self.crc
                        )
                    };
                    return self.bad(why);
                }
                _ => self.crc = raw(self.crc, &block[cur..val + len]),
            }
            self.tags.push(t);
            cur = val + len;
        }
        Ok(Step::Continue)
    }

    /// Fast commits found whole.
    pub fn commits(&self) -> usize {
        self.tags[..self.valid]
            .iter()
            .filter(|t| matches!(t, Tag::Tail { .. }))
            .count()
    }

    /// The records to replay: every record up to the last valid TAIL, in order (none
    /// when no fast commit was found whole).
    pub fn finish(mut self) -> Vec<Tag> {
        self.tags.truncate(self.valid);
        self.tags
    }
}

/// Lays records out in fast-commit blocks as the kernel's writer does (PAD to a
/// block's end when a record does not fit, TAIL with the checksum and to the block's
/// end): for tests, fuzzing and synthetic journals.
#[derive(Debug, Clone)]
pub struct Writer {
    bs: usize,
    tid: u32,
    blocks: Vec<Vec<u8>>,
    off: usize,
    crc: u32,
}

impl Writer {
    /// Blocks of `bs` bytes for transaction `tid`; starts with a HEAD.
    pub fn new(bs: usize, tid: u32) -> Writer {
        let mut w = Writer {
            bs,
            tid,
            blocks: Vec::new(),
            off: 0,
            crc: 0,
        };
        let mut v = [0u8; HEAD_SIZE];
        set_le32(&mut v, 0, SUPPORTED_FEATURES);
        set_le32(&mut v, 4, tid);
        w.record(TAG_HEAD, &v);
        w
    }

    /// Room in the current block for a record with a `len`-byte value, leaving room
    /// for another record's tag and length after it; else pad the block out.
    fn reserve(&mut self, len: usize) {
        if self.blocks.is_empty() || self.off + TL_SIZE > self.bs {
            // The first record, or the block a TAIL filled: a new block.
            self.blocks.push(vec![0u8; self.bs]);
            self.off = 0;
        }
        if self.off + TL_SIZE + len + TL_SIZE <= self.bs {
            return;
        }
        let pad = self.bs - self.off - TL_SIZE;
        let b = self
            .blocks
            .last_mut()
            .map(Vec::as_mut_slice)
            .unwrap_or(&mut []);
        set_le16(b, self.off, TAG_PAD);
        set_le16(b, self.off + 2, pad as u16);
        self.crc = raw(self.crc, b.get(self.off..self.bs).unwrap_or(&[]));
        self.blocks.push(vec![0u8; self.bs]);
        self.off = 0;
    }

    fn record(&mut self, tag: u16, value: &[u8]) {
        self.reserve(value.len());
        let off = self.off;
        let b = self
            .blocks
            .last_mut()
            .map(Vec::as_mut_slice)
            .unwrap_or(&mut []);
        set_le16(b, off, tag);
        set_le16(b, off + 2, value.len() as u16);
        if let Some(d) = b.get_mut(off + TL_SIZE..off + TL_SIZE + value.len()) {
            d.copy_from_slice(value);
        }
        self.crc = raw(
            self.crc,
            b.get(off..off + TL_SIZE + value.len()).unwrap_or(&[]),
        );
        self.off += TL_SIZE + value.len();
    }

    pub fn add_range(&mut self, ino: u32, ext: &Extent) {
        let mut v = [0u8; ADD_RANGE_SIZE];
        set_le32(&mut v, 0, ino);
        encode_extent(ext, &mut v[4..]);
        self.record(TAG_ADD_RANGE, &v);
    }

    pub fn del_range(&mut self, ino: u32, lblk: u32, len: u32) {
        let mut v = [0u8; DEL_RANGE_SIZE];
        set_le32(&mut v, 0, ino);
        set_le32(&mut v, 4, lblk);
        set_le32(&mut v, 8, len);
        self.record(TAG_DEL_RANGE, &v);
    }

    /// A CREAT, LINK or UNLINK record.
    pub fn dentry(&mut self, tag: u16, parent: u32, ino: u32, name: &[u8]) {
        let mut v = vec![0u8; DENTRY_SIZE + name.len()];
        set_le32(&mut v, 0, parent);
        set_le32(&mut v, 4, ino);
        v[DENTRY_SIZE..].copy_from_slice(name);
        self.record(tag, &v);
    }

    /// An INODE record of `raw` (128 bytes plus the extra part).
    pub fn inode(&mut self, ino: u32, raw_inode: &[u8]) {
        let mut v = vec![0u8; INODE_INO_SIZE + raw_inode.len()];
        set_le32(&mut v, 0, ino);
        v[INODE_INO_SIZE..].copy_from_slice(raw_inode);
        self.record(TAG_INODE, &v);
    }

    /// End a fast commit: a TAIL with the checksum, running to the block's end (the
    /// next fast commit starts in a new block).
    pub fn tail(&mut self) {
        self.reserve(TAIL_SIZE);
        let off = self.off;
        let len = self.bs - off - TL_SIZE;
        let b = self
            .blocks
            .last_mut()
            .map(Vec::as_mut_slice)
            .unwrap_or(&mut []);
        set_le16(b, off, TAG_TAIL);
        set_le16(b, off + 2, len as u16);
        set_le32(b, off + TL_SIZE, self.tid);
        let crc = raw(self.crc, b.get(off..off + TL_SIZE + 4).unwrap_or(&[]));
        set_le32(b, off + TL_SIZE + 4, crc);
        self.crc = 0;
        // The next record starts a block.
        self.off = self.bs;
    }

    /// The blocks written so far.
    pub fn blocks(&self) -> &[Vec<u8>] {
        &self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(l: u32, n: u16, p: u64, u: bool) -> Extent {
        Extent {
            logical: l,
            len: n,
            physical: p,
            unwritten: u,
        }
    }

    /// Two fast commits of tid 7 as the kernel lays them out.
    fn sample(bs: usize) -> Writer {
        let mut w = Writer::new(bs, 7);
        w.inode(15, &[0x11; 160]);
        w.add_range(15, &ext(0, 13, 0x1_0000_2598, false));
        w.dentry(TAG_CREAT, 2, 15, b"t");
        w.tail();
        w.add_range(15, &ext(1, 1, 2599, true));
        w.del_range(15, 2, 0x7fff_ffff);
        w.dentry(TAG_LINK, 2, 15, b"t2");
        w.dentry(TAG_UNLINK, 12, 14, b"gone");
        w.tail();
        w
    }

    fn scan(blocks: &[Vec<u8>], tid: u32) -> Result<Vec<Tag>> {
        let mut s = Scan::new(tid, 256);
        for b in blocks {
            if s.feed(b)? == Step::Stop {
                break;
            }
        }
        Ok(s.finish())
    }

    #[test]
    fn what_the_writer_lays_out_scans_back() {
        for bs in [1024, 4096] {
            let w = sample(bs);
            let tags = scan(w.blocks(), 7).expect("scan");
            let names: Vec<&str> = tags.iter().map(Tag::name).collect();
            assert_eq!(
                names,
                [
                    "HEAD",
                    "INODE",
                    "ADD_RANGE",
                    "CREAT",
                    "TAIL",
                    "ADD_RANGE",
                    "DEL_RANGE",
                    "LINK",
                    "UNLINK",
                    "TAIL"
                ]
            );
            assert_eq!(
                tags[2],
                Tag::AddRange {
                    ino: 15,
                    ext: ext(0, 13, 0x1_0000_2598, false)
                }
            );
            assert_eq!(
                tags[5],
                Tag::AddRange {
                    ino: 15,
                    ext: ext(1, 1, 2599, true)
                }
            );
            assert_eq!(
                tags[8],
                Tag::Unlink {
                    parent: 12,
                    ino: 14,
                    name: b"gone".to_vec()
                }
            );
        }
    }

    #[test]
    fn records_pad_to_the_block_end_when_they_do_not_fit() {
        let mut w = Writer::new(1024, 3);
        for i in 0..20 {
            w.inode(20 + i, &[i as u8; 160]);
        }
        w.tail();
        assert!(w.blocks().len() > 3);
        let tags = scan(w.blocks(), 3).expect("scan");
        assert_eq!(
            tags.iter()
                .filter(|t| matches!(t, Tag::Inode { .. }))
                .count(),
            20
        );
        assert!(tags.iter().any(|t| matches!(t, Tag::Pad { .. })));
    }

    #[test]
    fn the_scan_stops_where_the_kernel_stops() {
        let bs = 1024;
        // Another transaction's area: nothing to replay.
        assert!(scan(sample(bs).blocks(), 8).expect("scan").is_empty());
        // Not a HEAD first: nothing written in this transaction.
        assert!(scan(&[vec![0u8; bs]], 7).expect("scan").is_empty());
        // A damaged second fast commit: the first is replayed.
        let w = sample(bs);
        let mut blocks = w.blocks().to_vec();
        let last = blocks.len() - 1;
        blocks[last][30] ^= 1;
        let tags = scan(&blocks, 7).expect("scan");
        assert_eq!(tags.len(), 5, "{tags:?}");
        // A damaged first one: an error, not an empty area.
        let mut blocks = w.blocks().to_vec();
        blocks[0][20] ^= 1;
        assert!(scan(&blocks, 7).is_err());
        // Stale blocks after the commits end the scan.
        let mut blocks = w.blocks().to_vec();
        blocks.push(vec![0xEE; bs]);
        assert_eq!(scan(&blocks, 7).expect("scan").len(), 10);
        // Unknown HEAD features are refused.
        let mut blocks = w.blocks().to_vec();
        set_le32(&mut blocks[0], 4, 1);
        assert!(scan(&blocks, 7).is_err());
    }

    #[test]
    fn absurd_lengths_and_tags_never_panic_and_end_the_scan() {
        let w = sample(1024);
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for round in 0..3000 {
            let mut blocks = w.blocks().to_vec();
            for _ in 0..1 + round % 6 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = (x as usize) % blocks.len();
                let i = (x >> 20) as usize % 1024;
                blocks[b][i] = (x >> 40) as u8;
            }
            let _ = scan(&blocks, 7);
            // Truncated blocks too.
            let cut: Vec<Vec<u8>> = blocks
                .iter()
                .map(|b| b[..(x as usize) % 1024].to_vec())
                .collect();
            let _ = scan(&cut, 7);
        }
        // A length running past the block.
        let mut b = w.blocks()[0].clone();
        set_le16(&mut b, 2, 4000);
        assert!(scan(&[b], 7).is_err());
    }
}
