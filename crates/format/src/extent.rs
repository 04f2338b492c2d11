//! Extent tree nodes (format notes §2.5).
//!
//! A node is a 12-byte header followed by `eh_max` 12-byte entries: index entries
//! (depth > 0) pointing at child blocks, or leaf extents (depth 0) mapping logical to
//! physical blocks. The root lives in the inode's 60-byte i_block (eh_max 4); other
//! nodes fill a block and carry a 4-byte checksum tail after `eh_max` entries.
//!
//! Must hold (checked by [`Node::decode`]): magic 0xF30A, entries ≤ max, max fits the
//! buffer (and, for blocks, is within [cap-2, cap] as e2fsck requires), entries sorted
//! by logical block, leaf extents non-overlapping and inside the 32-bit logical space.

use crate::bytes::*;
use crate::csum;
use crate::{ensure, Result};

pub const MAGIC: u16 = 0xF30A;
pub const HEADER_SIZE: usize = 12;
pub const ENTRY_SIZE: usize = 12;
/// Longest initialized extent; longer ee_len values mark unwritten extents.
pub const MAX_INIT_LEN: u16 = 32768;
pub const MAX_UNWRITTEN_LEN: u16 = 32767;
/// Deepest tree the kernel builds (EXT4_MAX_EXTENT_DEPTH).
pub const MAX_DEPTH: u16 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub entries: u16,
    pub max: u16,
    pub depth: u16,
    pub generation: u32,
}

/// A leaf extent: logical blocks `[logical, logical+len)` at `physical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub logical: u32,
    pub len: u16,
    pub physical: u64,
    pub unwritten: bool,
}

impl Extent {
    pub fn end(&self) -> u64 {
        u64::from(self.logical) + u64::from(self.len)
    }
}

/// An index entry: the subtree for logical blocks ≥ `logical` is at block `child`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Index {
    pub logical: u32,
    pub child: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Leaf(Header, Vec<Extent>),
    Index(Header, Vec<Index>),
}

/// Entries that fit in a block node (340 at 4 KiB, 84 at 1 KiB).
pub fn block_capacity(block_size: usize) -> u16 {
    ((block_size.saturating_sub(HEADER_SIZE + 4)) / ENTRY_SIZE).min(usize::from(u16::MAX)) as u16
}
/// Entries that fit in the inode root (4).
pub const ROOT_CAPACITY: u16 = 4;

/// A node read in place: the header checked, entries decoded one at a time. For
/// lookups, which read a few entries of a node by binary search instead of decoding all
/// of them; [`NodeRef::check`] checks every entry as [`Node::decode`] does, without
/// allocating (a caller that has checked the bytes before, as a verifying cache does,
/// need not again).
#[derive(Debug, Clone, Copy)]
pub struct NodeRef<'a> {
    b: &'a [u8],
    pub header: Header,
}

impl<'a> NodeRef<'a> {
    /// Read the header of a node from the inode's i_block (`in_inode`) or a tree block.
    #[inline]
    pub fn new(b: &'a [u8], in_inode: bool) -> Result<NodeRef<'a>> {
        need(b, HEADER_SIZE, "extent header")?;
        let magic = le16(b, 0);
        ensure(magic == MAGIC, || {
            format!("extent header magic {magic:#06x}")
        })?;
        let h = Header {
            entries: le16(b, 2),
            max: le16(b, 4),
            depth: le16(b, 6),
            generation: le32(b, 8),
        };
        let fits = (b.len() - HEADER_SIZE) / ENTRY_SIZE;
        ensure(usize::from(h.max) <= fits, || {
            format!(
                "extent eh_max {} exceeds the {} entries that fit",
                h.max, fits
            )
        })?;
        if !in_inode {
            let cap = block_capacity(b.len());
            ensure(h.max + 2 >= cap && h.max <= cap, || {
                format!(
                    "extent block eh_max {} not within [{}, {cap}]",
                    h.max,
                    cap - 2
                )
            })?;
        }
        ensure(h.entries <= h.max, || {
            format!("extent entries {} > max {}", h.entries, h.max)
        })?;
        ensure(h.depth <= MAX_DEPTH, || {
            format!("extent depth {} too deep", h.depth)
        })?;
        Ok(NodeRef { b, header: h })
    }

    /// Number of entries.
    #[inline]
    pub fn len(&self) -> usize {
        usize::from(self.header.entries)
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.header.entries == 0
    }

    /// Whether the entries are extents (depth 0) rather than index entries.
    #[inline]
    pub fn is_leaf(&self) -> bool {
        self.header.depth == 0
    }

    #[inline]
    fn at(i: usize) -> usize {
        HEADER_SIZE + i * ENTRY_SIZE
    }

    /// The first logical block of entry `i` (< `len`), extent or index.
    #[inline]
    pub fn logical(&self, i: usize) -> u32 {
        le32(self.b, Self::at(i))
    }

    /// Leaf entry `i` (< `len`).
    #[inline]
    pub fn extent(&self, i: usize) -> Extent {
        let o = Self::at(i);
        let raw_len = le16(self.b, o + 4);
        let (len, unwritten) = if raw_len > MAX_INIT_LEN {
            (raw_len - MAX_INIT_LEN, true)
        } else {
            (raw_len, false)
        };
        Extent {
            logical: le32(self.b, o),
            len,
            physical: lohi(le32(self.b, o + 8), u32::from(le16(self.b, o + 6))),
            unwritten,
        }
    }

    /// Index entry `i` (< `len`).
    #[inline]
    pub fn index(&self, i: usize) -> Index {
        let o = Self::at(i);
        Index {
            logical: le32(self.b, o),
            child: lohi(le32(self.b, o + 4), u32::from(le16(self.b, o + 8))),
        }
    }

    /// How many entries start at or before logical block `lblk` (entries are sorted:
    /// a binary search).
    #[inline]
    pub fn count_at_or_before(&self, lblk: u64) -> usize {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if u64::from(self.logical(mid)) <= lblk {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Check every entry as [`Node::decode`] does: extents non-empty, within 2^32
    /// blocks and in order without overlap; index entries strictly increasing.
    #[inline]
    pub fn check(&self) -> Result<()> {
        if self.is_leaf() {
            let mut prev_end: Option<u64> = None;
            for i in 0..self.len() {
                let e = self.extent(i);
                ensure(e.len > 0, || format!("extent {i} has length 0"))?;
                ensure(e.end() <= 1 << 32, || {
                    format!("extent {i} passes logical block 2^32")
                })?;
                if let Some(end) = prev_end {
                    ensure(end <= u64::from(e.logical), || {
                        format!(
                            "extent {i} at {} overlaps or precedes the previous",
                            e.logical
                        )
                    })?;
                }
                prev_end = Some(e.end());
            }
        } else {
            for i in 1..self.len() {
                ensure(self.logical(i - 1) < self.logical(i), || {
                    format!("extent index {i} not sorted")
                })?;
            }
        }
        Ok(())
    }
}

impl Node {
    /// Decode a node from the inode's i_block (`in_inode`) or from a tree block.
    pub fn decode(b: &[u8], in_inode: bool) -> Result<Node> {
        let r = NodeRef::new(b, in_inode)?;
        r.check()?;
        let h = r.header;
        if r.is_leaf() {
            Ok(Node::Leaf(h, (0..r.len()).map(|i| r.extent(i)).collect()))
        } else {
            Ok(Node::Index(h, (0..r.len()).map(|i| r.index(i)).collect()))
        }
    }

    pub fn header(&self) -> &Header {
        match self {
            Node::Leaf(h, _) | Node::Index(h, _) => h,
        }
    }

    /// Encode into `b` (i_block or a whole tree block); entries past `entries` are zeroed.
    pub fn encode_into(&self, b: &mut [u8]) {
        let h = self.header();
        set_le16(b, 0, MAGIC);
        set_le16(b, 4, h.max);
        set_le16(b, 6, h.depth);
        set_le32(b, 8, h.generation);
        let body_end = HEADER_SIZE + usize::from(h.max) * ENTRY_SIZE;
        if let Some(body) = b.get_mut(HEADER_SIZE..body_end) {
            body.fill(0);
        }
        let at = |i: usize| HEADER_SIZE + i * ENTRY_SIZE;
        match self {
            Node::Leaf(_, v) => {
                set_le16(b, 2, v.len() as u16);
                for (i, e) in v.iter().enumerate() {
                    let o = at(i);
                    set_le32(b, o, e.logical);
                    let l = if e.unwritten {
                        e.len + MAX_INIT_LEN
                    } else {
                        e.len
                    };
                    set_le16(b, o + 4, l);
                    set_le16(b, o + 6, (e.physical >> 32) as u16);
                    set_le32(b, o + 8, e.physical as u32);
                }
            }
            Node::Index(_, v) => {
                set_le16(b, 2, v.len() as u16);
                for (i, ix) in v.iter().enumerate() {
                    let o = at(i);
                    set_le32(b, o, ix.logical);
                    set_le32(b, o + 4, ix.child as u32);
                    set_le16(b, o + 8, (ix.child >> 32) as u16);
                }
            }
        }
    }
}

fn tail_offset(b: &[u8]) -> usize {
    HEADER_SIZE + usize::from(le16(b, 4)) * ENTRY_SIZE
}

/// Checksum of a tree block: raw(inode_seed, block[0..12+12*eh_max]).
pub fn compute_csum(b: &[u8], inode_seed: u32) -> u32 {
    csum::raw(inode_seed, b.get(..tail_offset(b)).unwrap_or(b))
}

pub fn verify_csum(b: &[u8], inode_seed: u32) -> Result<()> {
    let off = tail_offset(b);
    ensure(off + 4 <= b.len(), || {
        "extent block has no room for its checksum tail".into()
    })?;
    let have = le32(b, off);
    let want = compute_csum(b, inode_seed);
    ensure(have == want, || {
        format!("extent block checksum {have:#010x}, computed {want:#010x}")
    })
}

pub fn set_csum(b: &mut [u8], inode_seed: u32) {
    let c = compute_csum(b, inode_seed);
    let off = tail_offset(b);
    set_le32(b, off, c);
}

#[cfg(test)]
mod tests {
    use super::*;

    const _: () = assert!(HEADER_SIZE == 12 && ENTRY_SIZE == 12);

    #[test]
    fn capacities_match_the_format_notes() {
        assert_eq!(block_capacity(4096), 340);
        assert_eq!(block_capacity(1024), 84);
    }

    #[test]
    fn leaf_round_trip_with_checksum() {
        let h = Header {
            entries: 2,
            max: 340,
            depth: 0,
            generation: 0,
        };
        let n = Node::Leaf(
            h,
            vec![
                Extent {
                    logical: 0,
                    len: 10,
                    physical: 1 << 40,
                    unwritten: false,
                },
                Extent {
                    logical: 20,
                    len: 5,
                    physical: 99,
                    unwritten: true,
                },
            ],
        );
        let mut b = vec![0u8; 4096];
        n.encode_into(&mut b);
        set_csum(&mut b, 42);
        verify_csum(&b, 42).expect("csum");
        assert_eq!(Node::decode(&b, false).expect("decode"), n);
        for bit in 0..(12 + 2 * 12 + 4) * 8 {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            let ok = verify_csum(&m, 42).is_ok() && Node::decode(&m, false).is_ok();
            assert!(!ok, "bit {bit} flip accepted");
        }
    }

    #[test]
    fn rejects_overlap_and_bad_max() {
        let h = Header {
            entries: 2,
            max: 4,
            depth: 0,
            generation: 0,
        };
        let n = Node::Leaf(
            h,
            vec![
                Extent {
                    logical: 0,
                    len: 10,
                    physical: 1,
                    unwritten: false,
                },
                Extent {
                    logical: 5,
                    len: 5,
                    physical: 99,
                    unwritten: false,
                },
            ],
        );
        let mut b = vec![0u8; 60];
        n.encode_into(&mut b);
        assert!(Node::decode(&b, true).is_err());
        set_le16(&mut b, 4, 5);
        assert!(
            Node::decode(&b, true).is_err(),
            "max 5 cannot fit in 60 bytes"
        );
    }
}
