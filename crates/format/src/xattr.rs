//! Extended attributes (format notes §2.10): the in-inode area, the xattr block, the
//! entry and block hashes, the name-prefix table and the POSIX ACL value formats.
//!
//! Owns the byte layout of
//! - the in-inode area: inode bytes `128 + i_extra_isize .. inode_size`, starting with
//!   the magic 0xEA020000, then entries; `e_value_offs` counts from the first entry;
//! - the xattr block: a 32-byte header (magic, refcount, `h_blocks` = 1, hash, checksum)
//!   then entries from 0x20; `e_value_offs` counts from the block start;
//! - the entry: {name_len u8, name_index u8, value_offs le16, value_inum le32,
//!   value_size le32, hash le32, name padded to 4}; the table ends at a zero le32 and
//!   values are packed from the end of the area, each padded to 4 bytes.
//!
//! Must hold on decode (else `Corrupted`, never a panic): every name and value lies
//! inside the area, no value overlaps the entry table or another value, no value is
//! larger than the kernel's `EXT4_XATTR_SIZE_MAX` (16 MiB). A missing in-inode magic
//! means "no in-inode attributes", as in the kernel. Entry hashes are not judged by
//! the decoders (the kernel does not either); [`check_entry_hashes`] does what e2fsck
//! does. Encoders sort entries by (index, name length, name), fill every hash, and
//! fail with [`EncodeError::NoSpace`] rather than write a partial area.
//!
//! Values in their own inodes (the ea_inode feature, format notes §2.10): an entry
//! with `value_inum` ≠ 0 holds no bytes in the area (`value_offs` 0); its value, of
//! `value_size` bytes, is the data of inode `value_inum` — a regular file with
//! `EXT4_EA_INODE_FL`, no name, no xattrs of its own, mode 0600, links 1 — whose
//! `i_atime` (seconds) holds the value's hash (crc32c of the value with the
//! filesystem's checksum seed) and whose `i_ctime` (seconds, high word) and
//! `i_version` (low word) hold the number of entries that name it (an xattr block
//! counts once, however many inodes share it). The entry's `e_hash` hashes the name,
//! then that value hash as the one value word ([`ea_entry_hash`]), so a decoded entry
//! carries the hash it claims ([`ValueInode::hash`]); whether the inode agrees is the
//! caller's to check ([`ValueInode::hash_matches`]: the inode is not in the area).
//! The kernel puts a value in an inode when it is larger than
//! [`min_large_value_size`], or when it fits neither the inode nor the block (a block
//! keeps [`block_reserve`] bytes for entries when values could go to inodes).
//!
//! The block checksum uses the filesystem seed (not an inode seed) and includes the
//! physical block number: raw(raw(fs_seed, le64 blocknr), block with 0x10..0x14 zeroed).
//!
//! Callers: the engine's getxattr/listxattr/setxattr paths and its buffer cache (block
//! verify on read and before write), fsck and the tests.

use crate::bytes::{le16, le32, need, put, set_le16, set_le32, set_u8, u8_at};
use crate::csum::raw;
use crate::inode::{Inode, Timestamp};
use crate::{ensure, FormatError, Result};

/// Magic of both the in-inode area and the xattr block.
pub const MAGIC: u32 = 0xEA02_0000;
/// Size of the in-inode header (just the magic).
pub const IBODY_HEADER_SIZE: usize = 4;
/// Size of the xattr block header.
pub const BLOCK_HEADER_SIZE: usize = 32;
/// Size of an entry before its name.
pub const ENTRY_HEADER_SIZE: usize = 16;
/// Size of the zero word that ends an entry table.
pub const TERMINATOR_SIZE: usize = 4;
/// Inode bytes before the extra fields; the in-inode area starts after those.
pub const GOOD_OLD_INODE_SIZE: usize = 128;
/// Offset of i_extra_isize in the inode.
const I_EXTRA_ISIZE: usize = 0x80;

// Block header offsets.
const H_MAGIC: usize = 0x0;
const H_REFCOUNT: usize = 0x4;
const H_BLOCKS: usize = 0x8;
const H_HASH: usize = 0xC;
const H_CHECKSUM: usize = 0x10;
const H_RESERVED: usize = 0x14; // 3 × le32
const _: () = assert!(H_RESERVED + 3 * 4 == BLOCK_HEADER_SIZE);
const _: () = assert!(H_CHECKSUM + 4 == H_RESERVED);

// Entry offsets.
const E_NAME_LEN: usize = 0x0;
const E_NAME_INDEX: usize = 0x1;
const E_VALUE_OFFS: usize = 0x2;
const E_VALUE_INUM: usize = 0x4;
const E_VALUE_SIZE: usize = 0x8;
const E_HASH: usize = 0xC;
const E_NAME: usize = 0x10;
const _: () = assert!(E_NAME == ENTRY_HEADER_SIZE && E_HASH + 4 == E_NAME);

/// Name indexes (`e_name_index`).
pub const INDEX_USER: u8 = 1;
pub const INDEX_POSIX_ACL_ACCESS: u8 = 2;
pub const INDEX_POSIX_ACL_DEFAULT: u8 = 3;
pub const INDEX_TRUSTED: u8 = 4;
pub const INDEX_SECURITY: u8 = 6;
pub const INDEX_SYSTEM: u8 = 7;

/// Longest name suffix an entry can store (`e_name_len` is a u8).
pub const NAME_MAX: usize = 255;

/// Largest value Linux passes to a filesystem (`XATTR_SIZE_MAX`, setxattr(2) refuses
/// more with E2BIG).
pub const XATTR_SIZE_MAX: usize = 65536;

/// Largest `e_value_size` the kernel accepts when it checks an entry table
/// (`EXT4_XATTR_SIZE_MAX`); a larger one is corruption.
pub const VALUE_SIZE_LIMIT: usize = 1 << 24;

/// `EXT4_XATTR_MIN_LARGE_EA_SIZE`: with ea_inode, the kernel stores a value whose padded
/// size is larger than this in an inode of its own at once (a block minus its header,
/// one entry with a 3-byte name and the table's terminator).
pub fn min_large_value_size(block_size: usize) -> usize {
    block_size.saturating_sub(entry_size(3) + BLOCK_HEADER_SIZE + TERMINATOR_SIZE)
}

/// `EXT4_XATTR_BLOCK_RESERVE`: with ea_inode, a value the kernel adds to an xattr block
/// must leave the block's values starting at least this far from its start (room kept
/// for entries); otherwise the value goes to an inode of its own.
pub fn block_reserve(block_size: usize) -> usize {
    (block_size / 8).min(1024)
}

/// The value of an entry stored in an inode of its own (ea_inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ValueInode {
    /// `e_value_inum`.
    pub inum: u32,
    /// `e_value_size`: the value's length, which must be the inode's size.
    pub size: u32,
    /// The value's hash the entry hash was made with: [`ea_value_hash`] of the value,
    /// as the inode stores it in `i_atime`. Decoding recovers it from `e_hash` and the
    /// name (the last step of the entry hash is `rotl(h, 16) ^ value_hash`), assuming
    /// the unsigned name hash; [`ValueInode::hash_matches`] also accepts an entry
    /// hashed with the signed one. Encoding writes `e_hash` from it.
    pub hash: u32,
}

impl ValueInode {
    /// Whether the entry `name` whose hash decoded to this one was made from the value
    /// hash `inode_hash` (the inode's `i_atime`), with either name-hash signedness.
    pub fn hash_matches(&self, name: &[u8], inode_hash: u32) -> bool {
        let e_hash = ea_entry_hash(name, self.hash);
        e_hash == ea_entry_hash(name, inode_hash)
            || e_hash == ea_entry_hash_signed(name, inode_hash)
    }
}

/// The value hash of an ea_inode value: crc32c of the value seeded with the
/// filesystem's checksum seed (the kernel's `ext4_xattr_inode_hash`, e2fsprogs'
/// `ext2fs_crc32c_le(fs->csum_seed, ...)`; the seed is computed for ea_inode
/// filesystems with or without metadata_csum).
pub fn ea_value_hash(fs_seed: u32, value: &[u8]) -> u32 {
    raw(fs_seed, value)
}

/// The value hash an EA inode stores (`i_atime`'s seconds, 32 bits).
pub fn ea_inode_hash(inode: &Inode) -> u32 {
    inode.atime.sec as u32
}

/// Store the value hash in an EA inode record (`i_atime` = hash seconds, no
/// nanoseconds, as the kernel's `ext4_xattr_inode_set_hash`).
pub fn set_ea_inode_hash(inode: &mut Inode, hash: u32) {
    inode.atime = Timestamp {
        sec: i64::from(hash),
        nsec: 0,
    };
}

/// The reference count of an EA inode: `i_ctime` seconds (32 bits) above the low word
/// of `i_version`.
pub fn ea_inode_refs(inode: &Inode) -> u64 {
    (u64::from(inode.ctime.sec as u32) << 32) | (inode.version & 0xFFFF_FFFF)
}

/// Store an EA inode's reference count (`ext4_xattr_inode_set_ref`: ctime seconds the
/// high word, no nanoseconds; the whole i_version the low word).
pub fn set_ea_inode_refs(inode: &mut Inode, refs: u64) {
    inode.ctime = Timestamp {
        sec: i64::from((refs >> 32) as u32),
        nsec: 0,
    };
    inode.version = refs & 0xFFFF_FFFF;
}

/// (index, prefix, whole-name) in the order [`split_name`] tries them: the POSIX ACL
/// names are whole names and must win over the shorter "system." prefix.
const PREFIXES: [(u8, &[u8], bool); 6] = [
    (INDEX_POSIX_ACL_ACCESS, b"system.posix_acl_access", true),
    (INDEX_POSIX_ACL_DEFAULT, b"system.posix_acl_default", true),
    (INDEX_USER, b"user.", false),
    (INDEX_TRUSTED, b"trusted.", false),
    (INDEX_SECURITY, b"security.", false),
    (INDEX_SYSTEM, b"system.", false),
];

/// The prefix of name index `index`, if rext4 knows it.
pub fn prefix(index: u8) -> Option<&'static [u8]> {
    PREFIXES.iter().find(|p| p.0 == index).map(|p| p.1)
}

/// The full (userspace) name of an attribute stored as (`index`, `suffix`); `None` for
/// an unknown index. The POSIX ACL indexes store an empty suffix.
pub fn full_name(index: u8, suffix: &[u8]) -> Option<Vec<u8>> {
    let p = prefix(index)?;
    let mut out = Vec::with_capacity(p.len() + suffix.len());
    out.extend_from_slice(p);
    out.extend_from_slice(suffix);
    Some(out)
}

/// Split a full name into (index, stored suffix). The POSIX ACL names match only
/// exactly (suffix empty); other prefixes need a non-empty suffix of at most
/// [`NAME_MAX`] bytes. `None` when no prefix fits. Whether userspace may set a
/// "system." name (only system.data exists, and it is internal) is the caller's call.
pub fn split_name(full: &[u8]) -> Option<(u8, &[u8])> {
    for &(index, p, whole) in &PREFIXES {
        if whole {
            if full == p {
                return Some((index, &[]));
            }
        } else if let Some(suffix) = full.strip_prefix(p) {
            if suffix.is_empty() || suffix.len() > NAME_MAX {
                return None;
            }
            return Some((index, suffix));
        }
    }
    None
}

/// One attribute: name index, stored name suffix and value — in the area (`value`),
/// or in an inode of its own (`inode`, and `value` empty).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Xattr {
    pub index: u8,
    pub name: Vec<u8>,
    pub value: Vec<u8>,
    pub inode: Option<ValueInode>,
}

impl Xattr {
    /// An attribute whose value is stored in the area.
    pub fn new(index: u8, name: &[u8], value: &[u8]) -> Xattr {
        Xattr {
            index,
            name: name.to_vec(),
            value: value.to_vec(),
            inode: None,
        }
    }

    /// An attribute whose value is the data of an inode of its own.
    pub fn in_inode(index: u8, name: &[u8], value: ValueInode) -> Xattr {
        Xattr {
            index,
            name: name.to_vec(),
            value: Vec::new(),
            inode: Some(value),
        }
    }

    /// The value's length, wherever it is stored.
    pub fn value_len(&self) -> usize {
        match self.inode {
            Some(v) => v.size as usize,
            None => self.value.len(),
        }
    }

    /// The userspace name, `None` for an unknown index.
    pub fn full_name(&self) -> Option<Vec<u8>> {
        full_name(self.index, &self.name)
    }

    /// The on-disk sort order of block entries: (index, name length, name).
    fn sort_key(&self) -> (u8, usize, &[u8]) {
        (self.index, self.name.len(), &self.name)
    }
}

/// An attribute as decoded from disk, with the fields the decoder does not judge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub attr: Xattr,
    /// `e_hash` as stored.
    pub e_hash: u32,
    /// `e_value_offs` as stored (relative to the first entry in-inode, to the block
    /// start in a block).
    pub value_offs: u16,
}

/// Bytes of an entry (header + name) in the table, padded to 4.
#[inline]
pub fn entry_size(name_len: usize) -> usize {
    round4(ENTRY_HEADER_SIZE + name_len)
}

/// Bytes a value occupies in the value area (padded to 4).
#[inline]
pub fn value_size_padded(value_len: usize) -> usize {
    round4(value_len)
}

#[inline]
fn round4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

// ---------------------------------------------------------------------------------
// Hashes
// ---------------------------------------------------------------------------------

const NAME_HASH_SHIFT: u32 = 5;
const VALUE_HASH_SHIFT: u32 = 16;
const BLOCK_HASH_SHIFT: u32 = 16;

fn hash_value_words(mut h: u32, value: &[u8]) -> u32 {
    for w in value.chunks(4) {
        let mut word = [0u8; 4];
        put(&mut word, 0, w);
        h = h.rotate_left(VALUE_HASH_SHIFT) ^ u32::from_le_bytes(word);
    }
    h
}

/// Entry hash as the kernel (since 6.2) and e2fsprogs 1.47 write it: name bytes as
/// unsigned chars, h = (h<<5)^(h>>27)^c, then each le32 word of the zero-padded value,
/// h = (h<<16)^(h>>16)^w. A value in an inode is hashed as [`ea_entry_hash`] says.
pub fn entry_hash(name: &[u8], value: &[u8]) -> u32 {
    let h = name
        .iter()
        .fold(0u32, |h, &c| h.rotate_left(NAME_HASH_SHIFT) ^ u32::from(c));
    hash_value_words(h, value)
}

/// The legacy entry hash of kernels that hashed names as signed chars (x86): bytes
/// ≥ 0x80 are sign-extended. Identical to [`entry_hash`] for ASCII names. Readers
/// (the kernel, e2fsck 1.47) accept either; rext4 writes [`entry_hash`].
pub fn entry_hash_signed(name: &[u8], value: &[u8]) -> u32 {
    let h = name.iter().fold(0u32, |h, &c| {
        h.rotate_left(NAME_HASH_SHIFT) ^ (i32::from(c as i8) as u32)
    });
    hash_value_words(h, value)
}

/// Whether `e_hash` is a valid hash of (`name`, `value`) in either signedness.
pub fn entry_hash_matches(e_hash: u32, name: &[u8], value: &[u8]) -> bool {
    e_hash == entry_hash(name, value) || e_hash == entry_hash_signed(name, value)
}

/// Entry hash of a value stored in an inode: the name, then the value hash (see
/// [`ea_value_hash`]) as the one value word (the kernel feeds the crc32c instead of
/// walking the value again).
pub fn ea_entry_hash(name: &[u8], value_hash: u32) -> u32 {
    entry_hash(name, &value_hash.to_le_bytes())
}

/// [`ea_entry_hash`] with the legacy signed name hash.
pub fn ea_entry_hash_signed(name: &[u8], value_hash: u32) -> u32 {
    entry_hash_signed(name, &value_hash.to_le_bytes())
}

/// The value hash an ea_inode entry's `e_hash` was made from, assuming the unsigned
/// name hash (the inverse of [`ea_entry_hash`]'s last step).
fn ea_value_hash_of(name: &[u8], e_hash: u32) -> u32 {
    e_hash ^ entry_hash(name, &[]).rotate_left(VALUE_HASH_SHIFT)
}

/// Block hash `h_hash` from the entry hashes in table order: h = (h<<16)^(h>>16)^e,
/// and 0 as soon as one entry hash is 0 (such a block is never shared).
pub fn block_hash(entry_hashes: impl IntoIterator<Item = u32>) -> u32 {
    let mut h = 0u32;
    for e in entry_hashes {
        if e == 0 {
            return 0;
        }
        h = h.rotate_left(BLOCK_HASH_SHIFT) ^ e;
    }
    h
}

/// e2fsck's entry-hash check: every block entry's hash must match (either signedness);
/// an in-inode entry may also carry 0 (the kernel writes 0 there). Entries whose value
/// is in an inode are not judged here: their hash stands for the inode's stored hash
/// ([`ValueInode::hash_matches`]).
pub fn check_entry_hashes(entries: &[Entry], in_inode: bool) -> Result<()> {
    for e in entries {
        if (in_inode && e.e_hash == 0) || e.attr.inode.is_some() {
            continue;
        }
        ensure(
            entry_hash_matches(e.e_hash, &e.attr.name, &e.attr.value),
            || {
                format!(
                    "xattr entry {:?} (index {}) hash {:#010x} is invalid (expected {:#010x})",
                    String::from_utf8_lossy(&e.attr.name),
                    e.attr.index,
                    e.e_hash,
                    entry_hash(&e.attr.name, &e.attr.value)
                )
            },
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------

/// Parse the entry table of `area` starting at `first`; values live at
/// `value_base + e_value_offs`. `need_terminator`: a block's table must end with the
/// zero word; an in-inode table may also run to the end of the area.
fn parse_entries(
    area: &[u8],
    first: usize,
    value_base: usize,
    need_terminator: bool,
    what: &str,
) -> Result<Vec<Entry>> {
    let end = area.len();
    let mut pos = first;
    // (entry offset, name_len) of each entry, in table order
    let mut raw_entries = Vec::new();
    let table_end = loop {
        if end.saturating_sub(pos) < TERMINATOR_SIZE {
            ensure(!need_terminator, || {
                format!("{what}: entry table has no terminator")
            })?;
            break end;
        }
        if le32(area, pos) == 0 {
            break pos + TERMINATOR_SIZE;
        }
        ensure(pos + ENTRY_HEADER_SIZE <= end, || {
            format!("{what}: entry header at {pos} runs past the end ({end})")
        })?;
        let name_len = usize::from(u8_at(area, pos + E_NAME_LEN));
        let next = pos + entry_size(name_len);
        ensure(next <= end, || {
            format!("{what}: entry name at {pos} runs past the end ({end})")
        })?;
        raw_entries.push((pos, name_len));
        pos = next;
    };

    let mut values: Vec<(usize, usize)> = Vec::new();
    let mut out = Vec::with_capacity(raw_entries.len());
    for (pos, name_len) in raw_entries {
        let index = u8_at(area, pos + E_NAME_INDEX);
        let value_offs = le16(area, pos + E_VALUE_OFFS);
        let size = le32(area, pos + E_VALUE_SIZE) as usize;
        let inum = le32(area, pos + E_VALUE_INUM);
        let e_hash = le32(area, pos + E_HASH);
        let name_start = pos + E_NAME;
        let name = area
            .get(name_start..name_start + name_len)
            .unwrap_or(&[])
            .to_vec();
        if inum != 0 {
            // (A value in the area is bounded by the area.)
            ensure(size <= VALUE_SIZE_LIMIT, || {
                format!(
                    "{what}: entry at {pos} has a value of {size} bytes in inode {inum}, \
                     more than {VALUE_SIZE_LIMIT}"
                )
            })?;
            // The value is the data of inode `inum`: nothing of it in the area.
            let hash = ea_value_hash_of(&name, e_hash);
            out.push(Entry {
                attr: Xattr {
                    index,
                    name,
                    value: Vec::new(),
                    inode: Some(ValueInode {
                        inum,
                        size: size as u32,
                        hash,
                    }),
                },
                e_hash,
                value_offs,
            });
            continue;
        }
        let value = if size == 0 {
            Vec::new()
        } else {
            let start = value_base + usize::from(value_offs);
            ensure(start >= table_end, || {
                format!("{what}: value of entry at {pos} (offset {start}) overlaps the entry table")
            })?;
            let padded_end = start
                .checked_add(value_size_padded(size))
                .filter(|&e| e <= end);
            ensure(padded_end.is_some(), || {
                format!(
                    "{what}: value of entry at {pos} ({size} bytes at {start}) runs past the end"
                )
            })?;
            values.push((start, start + value_size_padded(size)));
            area.get(start..start + size).unwrap_or(&[]).to_vec()
        };
        out.push(Entry {
            attr: Xattr {
                index,
                name,
                value,
                inode: None,
            },
            e_hash,
            value_offs,
        });
    }
    values.sort_unstable();
    for w in values.windows(2) {
        if let [a, b] = w {
            ensure(a.1 <= b.0, || {
                format!("{what}: values at {} and {} overlap", a.0, b.0)
            })?;
        }
    }
    Ok(out)
}

fn region_range(inode: &[u8]) -> Result<std::ops::Range<usize>> {
    let len = inode.len();
    if len <= GOOD_OLD_INODE_SIZE {
        return Ok(len..len);
    }
    let extra = usize::from(le16(inode, I_EXTRA_ISIZE));
    ensure(extra % 4 == 0 && GOOD_OLD_INODE_SIZE + extra <= len, || {
        format!("inode i_extra_isize {extra} is invalid for inode size {len}")
    })?;
    // extra_isize 0: the kernel does not look for in-inode attributes.
    if extra == 0 {
        return Ok(len..len);
    }
    Ok(GOOD_OLD_INODE_SIZE + extra..len)
}

/// The in-inode xattr area of a whole on-disk inode (`inode.len()` = inode size):
/// bytes `128 + i_extra_isize ..`. Empty for 128-byte inodes and for
/// i_extra_isize 0 (the caller must set i_extra_isize before storing attributes).
pub fn inode_region(inode: &[u8]) -> Result<&[u8]> {
    let r = region_range(inode)?;
    Ok(inode.get(r).unwrap_or(&[]))
}

/// Mutable form of [`inode_region`].
pub fn inode_region_mut(inode: &mut [u8]) -> Result<&mut [u8]> {
    let r = region_range(inode)?;
    Ok(inode.get_mut(r).unwrap_or(&mut []))
}

/// Decode the in-inode area with the stored hashes and offsets. No magic (or an area
/// shorter than the magic) means no attributes.
pub fn decode_inode_entries(region: &[u8]) -> Result<Vec<Entry>> {
    if region.len() < IBODY_HEADER_SIZE || le32(region, 0) != MAGIC {
        return Ok(Vec::new());
    }
    parse_entries(
        region,
        IBODY_HEADER_SIZE,
        IBODY_HEADER_SIZE,
        false,
        "in-inode xattrs",
    )
}

/// Decode the in-inode area (see [`decode_inode_entries`]).
pub fn decode_inode(region: &[u8]) -> Result<Vec<Xattr>> {
    Ok(decode_inode_entries(region)?
        .into_iter()
        .map(|e| e.attr)
        .collect())
}

/// The xattr block header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub refcount: u32,
    /// `h_blocks`, always 1.
    pub blocks: u32,
    pub hash: u32,
    pub checksum: u32,
}

/// A decoded xattr block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrBlock {
    pub header: BlockHeader,
    /// Entries in table order.
    pub entries: Vec<Entry>,
}

impl XattrBlock {
    pub fn attrs(&self) -> Vec<Xattr> {
        self.entries.iter().map(|e| e.attr.clone()).collect()
    }

    /// h_hash recomputed from the stored entry hashes.
    pub fn computed_hash(&self) -> u32 {
        block_hash(self.entries.iter().map(|e| e.e_hash))
    }
}

/// Decode an xattr block (all `bs` bytes): magic, `h_blocks` = 1, entry table and
/// value bounds. Does not check the checksum: see [`verify_block`].
pub fn decode_block(block: &[u8]) -> Result<XattrBlock> {
    need(block, BLOCK_HEADER_SIZE + TERMINATOR_SIZE, "xattr block")?;
    let magic = le32(block, H_MAGIC);
    ensure(magic == MAGIC, || {
        format!("xattr block magic {magic:#010x} is not {MAGIC:#010x}")
    })?;
    let header = BlockHeader {
        refcount: le32(block, H_REFCOUNT),
        blocks: le32(block, H_BLOCKS),
        hash: le32(block, H_HASH),
        checksum: le32(block, H_CHECKSUM),
    };
    ensure(header.blocks == 1, || {
        format!("xattr block h_blocks is {}, not 1", header.blocks)
    })?;
    let entries = parse_entries(block, BLOCK_HEADER_SIZE, 0, true, "xattr block")?;
    Ok(XattrBlock { header, entries })
}

/// Checksum of an xattr block stored at physical block `blocknr`.
pub fn block_csum(block: &[u8], fs_seed: u32, blocknr: u64) -> u32 {
    let c = raw(fs_seed, &blocknr.to_le_bytes());
    let c = raw(c, block.get(..H_CHECKSUM).unwrap_or(block));
    let c = raw(c, &[0u8; 4]);
    raw(c, block.get(H_RESERVED..).unwrap_or(&[]))
}

/// Check `h_checksum` (metadata_csum filesystems).
pub fn verify_block_csum(block: &[u8], fs_seed: u32, blocknr: u64) -> Result<()> {
    need(block, BLOCK_HEADER_SIZE, "xattr block")?;
    let stored = le32(block, H_CHECKSUM);
    let computed = block_csum(block, fs_seed, blocknr);
    ensure(stored == computed, || {
        format!("xattr block checksum {stored:#010x} does not match {computed:#010x}")
    })
    .map_err(|e| e.at_block(blocknr))
}

/// Store `h_checksum` for a block about to be written at `blocknr`.
pub fn set_block_csum(block: &mut [u8], fs_seed: u32, blocknr: u64) {
    let c = block_csum(block, fs_seed, blocknr);
    set_le32(block, H_CHECKSUM, c);
}

/// Full read/write verifier of the block at `blocknr`: structure, then the checksum
/// when `fs_seed` is given (metadata_csum). Errors carry the block number.
pub fn verify_block(block: &[u8], fs_seed: Option<u32>, blocknr: u64) -> Result<XattrBlock> {
    let decoded = decode_block(block).map_err(|e| e.at_block(blocknr))?;
    if let Some(seed) = fs_seed {
        verify_block_csum(block, seed, blocknr)?;
    }
    Ok(decoded)
}

// ---------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------

/// Why a set of attributes cannot be encoded into an area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// The attributes need `need_bytes`, the area has `have_bytes`.
    NoSpace {
        need_bytes: usize,
        have_bytes: usize,
    },
    /// An attribute can never be stored (name longer than 255 bytes, index 0, or a
    /// value larger than the on-disk size field).
    Invalid { what: String },
}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodeError::NoSpace {
                need_bytes,
                have_bytes,
            } => {
                write!(f, "xattrs need {need_bytes} bytes, area has {have_bytes}")
            }
            EncodeError::Invalid { what } => write!(f, "invalid xattr: {what}"),
        }
    }
}

impl std::error::Error for EncodeError {}

fn entries_and_values_size(attrs: &[Xattr]) -> usize {
    attrs.iter().fold(0usize, |acc, a| {
        acc.saturating_add(entry_size(a.name.len()))
            .saturating_add(value_size_padded(a.value.len()))
    })
}

/// Bytes of in-inode area `attrs` need (magic, entries, terminator, values); 0 for none.
pub fn inode_space_needed(attrs: &[Xattr]) -> usize {
    if attrs.is_empty() {
        return 0;
    }
    (IBODY_HEADER_SIZE + TERMINATOR_SIZE).saturating_add(entries_and_values_size(attrs))
}

/// Bytes of block `attrs` need (header, entries, terminator, values).
pub fn block_space_needed(attrs: &[Xattr]) -> usize {
    (BLOCK_HEADER_SIZE + TERMINATOR_SIZE).saturating_add(entries_and_values_size(attrs))
}

/// Whether `attrs` fit an in-inode area of `region_len` bytes.
pub fn fits_in_inode(region_len: usize, attrs: &[Xattr]) -> bool {
    inode_space_needed(attrs) <= region_len
}

/// Whether `attrs` fit an xattr block of `block_size` bytes.
pub fn fits_in_block(block_size: usize, attrs: &[Xattr]) -> bool {
    block_space_needed(attrs) <= block_size
}

fn validate(attrs: &[Xattr]) -> std::result::Result<(), EncodeError> {
    for a in attrs {
        if a.name.len() > NAME_MAX {
            return Err(EncodeError::Invalid {
                what: format!("name of {} bytes exceeds {NAME_MAX}", a.name.len()),
            });
        }
        if a.index == 0 {
            return Err(EncodeError::Invalid {
                what: "name index 0".into(),
            });
        }
        if u32::try_from(a.value.len()).is_err() {
            return Err(EncodeError::Invalid {
                what: "value larger than 4 GiB".into(),
            });
        }
        if let Some(v) = a.inode {
            if v.inum == 0 || !a.value.is_empty() {
                return Err(EncodeError::Invalid {
                    what: format!(
                        "value in inode {} with {} bytes in the area",
                        v.inum,
                        a.value.len()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Lay out sorted entries from `first` and values packed from the end of `area`;
/// `need` has been checked by the caller. Returns the entry hashes in table order.
fn lay_out(
    area: &mut [u8],
    first: usize,
    value_base: usize,
    attrs: &[Xattr],
) -> std::result::Result<Vec<u32>, EncodeError> {
    let mut sorted: Vec<&Xattr> = attrs.iter().collect();
    sorted.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
    if let Some(tail) = area.get_mut(first..) {
        tail.fill(0);
    }
    let mut pos = first;
    let mut value_start = area.len();
    let mut hashes = Vec::with_capacity(sorted.len());
    for a in sorted {
        if let Some(v) = a.inode {
            let hash = ea_entry_hash(&a.name, v.hash);
            set_u8(area, pos + E_NAME_LEN, a.name.len() as u8);
            set_u8(area, pos + E_NAME_INDEX, a.index);
            set_le16(area, pos + E_VALUE_OFFS, 0);
            set_le32(area, pos + E_VALUE_INUM, v.inum);
            set_le32(area, pos + E_VALUE_SIZE, v.size);
            set_le32(area, pos + E_HASH, hash);
            put(area, pos + E_NAME, &a.name);
            pos += entry_size(a.name.len());
            hashes.push(hash);
            continue;
        }
        let value_offs = if a.value.is_empty() {
            0
        } else {
            // The caller checked that everything fits, so this cannot underflow.
            value_start = value_start.saturating_sub(value_size_padded(a.value.len()));
            put(area, value_start, &a.value);
            u16::try_from(value_start - value_base).map_err(|_| EncodeError::NoSpace {
                need_bytes: value_start,
                have_bytes: usize::from(u16::MAX),
            })?
        };
        let hash = entry_hash(&a.name, &a.value);
        set_u8(area, pos + E_NAME_LEN, a.name.len() as u8);
        set_u8(area, pos + E_NAME_INDEX, a.index);
        set_le16(area, pos + E_VALUE_OFFS, value_offs);
        set_le32(area, pos + E_VALUE_INUM, 0);
        set_le32(area, pos + E_VALUE_SIZE, a.value.len() as u32);
        set_le32(area, pos + E_HASH, hash);
        put(area, pos + E_NAME, &a.name);
        pos += entry_size(a.name.len());
        hashes.push(hash);
    }
    Ok(hashes)
}

/// Write `attrs` as the in-inode area `region` (from [`inode_region_mut`]): magic,
/// sorted entries with hashes, values packed from the end. No attributes zeroes the
/// area. On error the area is unchanged.
pub fn encode_inode_region(
    region: &mut [u8],
    attrs: &[Xattr],
) -> std::result::Result<(), EncodeError> {
    validate(attrs)?;
    if attrs.is_empty() {
        region.fill(0);
        return Ok(());
    }
    let need_bytes = inode_space_needed(attrs);
    if need_bytes > region.len() {
        return Err(EncodeError::NoSpace {
            need_bytes,
            have_bytes: region.len(),
        });
    }
    set_le32(region, 0, MAGIC);
    lay_out(region, IBODY_HEADER_SIZE, IBODY_HEADER_SIZE, attrs)?;
    Ok(())
}

/// Write `attrs` as a whole xattr block with `h_refcount` = `refcount`: header,
/// sorted entries with hashes, h_hash, values packed from the end. The checksum is
/// left 0: call [`set_block_csum`] once the block number is known. On error the block
/// is unchanged.
pub fn encode_block(
    block: &mut [u8],
    attrs: &[Xattr],
    refcount: u32,
) -> std::result::Result<(), EncodeError> {
    validate(attrs)?;
    let need_bytes = block_space_needed(attrs);
    if need_bytes > block.len() {
        return Err(EncodeError::NoSpace {
            need_bytes,
            have_bytes: block.len(),
        });
    }
    block.fill(0);
    set_le32(block, H_MAGIC, MAGIC);
    set_le32(block, H_REFCOUNT, refcount);
    set_le32(block, H_BLOCKS, 1);
    let hashes = lay_out(block, BLOCK_HEADER_SIZE, 0, attrs)?;
    set_le32(block, H_HASH, block_hash(hashes));
    Ok(())
}

// ---------------------------------------------------------------------------------
// POSIX ACLs
// ---------------------------------------------------------------------------------

/// Version of the ext4 on-disk ACL format (`ext4_acl_header`).
pub const ACL_DISK_VERSION: u32 = 1;
/// Version of the Linux VFS xattr ACL format (`posix_acl_xattr_header`).
pub const ACL_VFS_VERSION: u32 = 2;
pub const ACL_USER_OBJ: u16 = 0x01;
pub const ACL_USER: u16 = 0x02;
pub const ACL_GROUP_OBJ: u16 = 0x04;
pub const ACL_GROUP: u16 = 0x08;
pub const ACL_MASK: u16 = 0x10;
pub const ACL_OTHER: u16 = 0x20;
/// The id the VFS format carries for entries without one.
pub const ACL_UNDEFINED_ID: u32 = u32::MAX;

const ACL_HEADER_SIZE: usize = 4;
/// Disk entry {e_tag le16 @0, e_perm le16 @2, e_id le32 @4}; short form stops at 4.
const ACL_E_TAG: usize = 0;
const ACL_E_PERM: usize = 2;
const ACL_E_ID: usize = 4;
const ACL_ENTRY_SIZE: usize = 8;
const ACL_SHORT_ENTRY_SIZE: usize = 4;
const _: () = assert!(ACL_E_ID + 4 == ACL_ENTRY_SIZE && ACL_E_PERM + 2 == ACL_SHORT_ENTRY_SIZE);

/// One ACL entry; `id` is [`ACL_UNDEFINED_ID`] for tags other than USER and GROUP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AclEntry {
    pub tag: u16,
    pub perm: u16,
    pub id: u32,
}

fn acl_tag_has_id(tag: u16) -> Result<bool> {
    match tag {
        ACL_USER | ACL_GROUP => Ok(true),
        ACL_USER_OBJ | ACL_GROUP_OBJ | ACL_MASK | ACL_OTHER => Ok(false),
        t => Err(FormatError::corrupted(format!(
            "ACL entry has unknown tag {t:#x}"
        ))),
    }
}

/// Decode an ext4 on-disk ACL (version 1; 4-byte entries except USER/GROUP).
pub fn acl_decode_disk(buf: &[u8]) -> Result<Vec<AclEntry>> {
    need(buf, ACL_HEADER_SIZE, "ext4 ACL")?;
    let version = le32(buf, 0);
    ensure(version == ACL_DISK_VERSION, || {
        format!("ext4 ACL version {version} is not 1")
    })?;
    let mut pos = ACL_HEADER_SIZE;
    let mut out = Vec::new();
    while pos < buf.len() {
        ensure(buf.len() - pos >= ACL_SHORT_ENTRY_SIZE, || {
            format!("ext4 ACL entry at {pos} is truncated")
        })?;
        let tag = le16(buf, pos + ACL_E_TAG);
        let perm = le16(buf, pos + ACL_E_PERM);
        let id = if acl_tag_has_id(tag)? {
            ensure(buf.len() - pos >= ACL_ENTRY_SIZE, || {
                format!("ext4 ACL entry at {pos} is truncated")
            })?;
            pos += ACL_ENTRY_SIZE;
            le32(buf, pos - ACL_ENTRY_SIZE + ACL_E_ID)
        } else {
            pos += ACL_SHORT_ENTRY_SIZE;
            ACL_UNDEFINED_ID
        };
        out.push(AclEntry { tag, perm, id });
    }
    Ok(out)
}

/// Encode an ext4 on-disk ACL (version 1). Entries with unknown tags are written in the
/// long form; callers pass entries from [`acl_decode_vfs`], which rejects those.
pub fn acl_encode_disk(entries: &[AclEntry]) -> Vec<u8> {
    let mut out = ACL_DISK_VERSION.to_le_bytes().to_vec();
    for e in entries {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        if acl_tag_has_id(e.tag).unwrap_or(true) {
            out.extend_from_slice(&e.id.to_le_bytes());
        }
    }
    out
}

/// Decode a VFS-format ACL (version 2, 8-byte entries). Ids of tags other than USER and
/// GROUP are normalised to [`ACL_UNDEFINED_ID`]. Entry order is not judged here.
pub fn acl_decode_vfs(buf: &[u8]) -> Result<Vec<AclEntry>> {
    need(buf, ACL_HEADER_SIZE, "VFS ACL")?;
    let version = le32(buf, 0);
    ensure(version == ACL_VFS_VERSION, || {
        format!("VFS ACL version {version} is not 2")
    })?;
    let body = buf.get(ACL_HEADER_SIZE..).unwrap_or(&[]);
    ensure(body.len() % ACL_ENTRY_SIZE == 0, || {
        format!(
            "VFS ACL body of {} bytes is not a whole number of entries",
            body.len()
        )
    })?;
    body.chunks_exact(ACL_ENTRY_SIZE)
        .map(|c| {
            let tag = le16(c, ACL_E_TAG);
            let id = if acl_tag_has_id(tag)? {
                le32(c, ACL_E_ID)
            } else {
                ACL_UNDEFINED_ID
            };
            Ok(AclEntry {
                tag,
                perm: le16(c, ACL_E_PERM),
                id,
            })
        })
        .collect()
}

/// Encode a VFS-format ACL (version 2).
pub fn acl_encode_vfs(entries: &[AclEntry]) -> Vec<u8> {
    let mut out = ACL_VFS_VERSION.to_le_bytes().to_vec();
    for e in entries {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        out.extend_from_slice(&e.id.to_le_bytes());
    }
    out
}

/// The stored system.posix_acl_* value → what getxattr returns to userspace.
pub fn acl_disk_to_vfs(disk: &[u8]) -> Result<Vec<u8>> {
    Ok(acl_encode_vfs(&acl_decode_disk(disk)?))
}

/// A system.posix_acl_* value from setxattr → the value to store.
pub fn acl_vfs_to_disk(vfs: &[u8]) -> Result<Vec<u8>> {
    Ok(acl_encode_disk(&acl_decode_vfs(vfs)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resize::test_image::*;
    use proptest::prelude::*;
    use std::path::Path;
    use std::process::Command;

    #[test]
    fn names_round_trip() {
        let cases: [(&[u8], u8, &[u8]); 7] = [
            (b"user.big", INDEX_USER, b"big"),
            (b"system.posix_acl_access", INDEX_POSIX_ACL_ACCESS, b""),
            (b"system.posix_acl_default", INDEX_POSIX_ACL_DEFAULT, b""),
            (b"trusted.x", INDEX_TRUSTED, b"x"),
            (b"security.selinux", INDEX_SECURITY, b"selinux"),
            (b"system.data", INDEX_SYSTEM, b"data"),
            (
                b"system.posix_acl_accessX",
                INDEX_SYSTEM,
                b"posix_acl_accessX",
            ),
        ];
        for (full, idx, suffix) in cases {
            assert_eq!(
                split_name(full),
                Some((idx, suffix)),
                "{}",
                String::from_utf8_lossy(full)
            );
            assert_eq!(full_name(idx, suffix).as_deref(), Some(full));
        }
        assert_eq!(split_name(b"user."), None);
        assert_eq!(split_name(b"foo.bar"), None);
        assert_eq!(split_name(b"system."), None);
        let long = [b"user.".as_slice(), &[b'a'; 256]].concat();
        assert_eq!(split_name(&long), None);
        assert_eq!(split_name(&long[..260]).map(|s| s.1.len()), Some(255));
        assert_eq!(full_name(5, b"x"), None);
        assert_eq!(full_name(0, b""), None);
    }

    #[test]
    fn hash_signedness_only_matters_for_high_bytes() {
        assert_eq!(entry_hash(b"abc", b"v"), entry_hash_signed(b"abc", b"v"));
        assert_ne!(
            entry_hash(b"\xe9t\xe9", b""),
            entry_hash_signed(b"\xe9t\xe9", b"")
        );
        // Value words are zero-padded little-endian words.
        let h = b"a"
            .iter()
            .fold(0u32, |h, &c| h.rotate_left(5) ^ u32::from(c));
        assert_eq!(entry_hash(b"a", b"\x01\x02"), h.rotate_left(16) ^ 0x0201);
        assert_eq!(block_hash([1, 2]), (1u32 << 16) ^ 2);
        assert_eq!(block_hash([1, 0, 2]), 0);
        assert_eq!(block_hash([]), 0);
    }

    fn vi(inum: u32, size: u32, hash: u32) -> ValueInode {
        ValueInode { inum, size, hash }
    }

    #[test]
    fn values_in_inodes_round_trip_and_take_only_their_entry() {
        let big = Xattr::in_inode(INDEX_USER, b"big", vi(15, 30720, 0xCFF9_E8A7));
        let acl = Xattr::in_inode(INDEX_POSIX_ACL_ACCESS, b"", vi(99, 70_000, 7));
        let small = Xattr::new(INDEX_USER, b"small", b"hello");
        let attrs = vec![big.clone(), small.clone(), acl.clone()];
        // Only the entries take room: no value bytes for the ones in inodes.
        assert_eq!(
            inode_space_needed(&attrs),
            IBODY_HEADER_SIZE + TERMINATOR_SIZE + entry_size(3) + entry_size(5) + 8 + entry_size(0)
        );
        let mut region = vec![0u8; 96];
        encode_inode_region(&mut region, &attrs).expect("fits");
        let d = decode_inode_entries(&region).expect("decodes");
        let got: Vec<Xattr> = d.iter().map(|e| e.attr.clone()).collect();
        assert_eq!(got, sorted(attrs.clone()));
        for e in &d {
            if let Some(v) = e.attr.inode {
                assert_eq!(e.value_offs, 0);
                assert_eq!(e.e_hash, ea_entry_hash(&e.attr.name, v.hash));
                assert!(v.hash_matches(&e.attr.name, v.hash));
                assert!(!v.hash_matches(&e.attr.name, v.hash ^ 1));
            }
        }
        // The kernel's layout of that entry (inode 12 of a kernel image): name "big",
        // inode 15, 30720 bytes, e_hash 0x4abee8a6 for i_atime 0xcff9e8a7.
        assert_eq!(ea_entry_hash(b"big", 0xCFF9_E8A7), 0x4ABE_E8A6);
        let mut block = vec![0u8; 1024];
        encode_block(&mut block, &attrs, 1).expect("fits");
        let b = decode_block(&block).expect("decodes");
        assert_eq!(b.attrs(), sorted(attrs));
        assert_eq!(b.header.hash, b.computed_hash());
        // An entry of a value in an inode with bytes in the area, or inode 0, is refused.
        let mut bad = big.clone();
        bad.value = b"x".to_vec();
        assert!(matches!(
            encode_block(&mut block, &[bad], 1),
            Err(EncodeError::Invalid { .. })
        ));
        let zero = Xattr::in_inode(INDEX_USER, b"z", vi(0, 10, 1));
        assert!(matches!(
            encode_block(&mut block, &[zero], 1),
            Err(EncodeError::Invalid { .. })
        ));
        // A signed-hash entry (name byte >= 0x80) matches the inode's hash too.
        let name = b"caf\xe9";
        let e_hash = ea_entry_hash_signed(name, 0x1234_5678);
        let decoded = ValueInode {
            inum: 20,
            size: 5000,
            hash: ea_value_hash_of(name, e_hash),
        };
        assert_ne!(decoded.hash, 0x1234_5678);
        assert!(decoded.hash_matches(name, 0x1234_5678));
        assert!(!decoded.hash_matches(name, 0x1234_5679));
        assert_eq!(min_large_value_size(4096), 4040);
        assert_eq!(block_reserve(4096), 512);
        assert_eq!(block_reserve(65536), 1024);
    }

    #[test]
    fn ea_inode_record_fields() {
        let mut i = crate::inode::Inode::decode(&[0u8; 256]).expect("zero record");
        i.extra_isize = 32;
        set_ea_inode_refs(&mut i, (3u64 << 32) | 5);
        set_ea_inode_hash(&mut i, 0xCFF9_E8A7);
        let mut rec = vec![0u8; 256];
        i.encode_into(&mut rec);
        let back = crate::inode::Inode::decode(&rec).expect("decodes");
        assert_eq!(ea_inode_refs(&back), (3u64 << 32) | 5);
        assert_eq!(ea_inode_hash(&back), 0xCFF9_E8A7);
        // As the kernel stores them: i_atime the hash, its extra word only the epoch
        // bit a hash >= 2^31 needs; i_ctime the high word of the count; i_version lo
        // the low word and i_version_hi 0.
        assert_eq!(le32(&rec, 0x8), 0xCFF9_E8A7);
        assert_eq!(le32(&rec, 0x8C), 1);
        assert_eq!(le32(&rec, 0xC), 3);
        assert_eq!(le32(&rec, 0x84), 0);
        assert_eq!(le32(&rec, 0x24), 5);
        assert_eq!(le32(&rec, 0x98), 0);
    }

    proptest! {
        #[test]
        fn ea_entry_hash_inverts(name in proptest::collection::vec(any::<u8>(), 0..40), h in any::<u32>()) {
            prop_assert_eq!(ea_value_hash_of(&name, ea_entry_hash(&name, h)), h);
            let v = ValueInode { inum: 1, size: 1, hash: ea_value_hash_of(&name, ea_entry_hash_signed(&name, h)) };
            prop_assert!(v.hash_matches(&name, h));
        }
    }

    fn sample() -> Vec<Xattr> {
        vec![
            Xattr::new(INDEX_USER, b"zz", b"value-z"),
            Xattr::new(INDEX_USER, b"a", b""),
            Xattr::new(INDEX_SECURITY, b"selinux", b"system_u:object_r:x\0"),
            Xattr::new(INDEX_USER, b"b", &[7u8; 33]),
        ]
    }

    fn sorted(mut v: Vec<Xattr>) -> Vec<Xattr> {
        v.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
        v
    }

    #[test]
    fn block_round_trip_and_checksum() {
        let attrs = sample();
        let mut block = vec![0u8; 1024];
        encode_block(&mut block, &attrs, 3).expect("fits");
        set_block_csum(&mut block, 0x1234_5678, 99);
        let d = verify_block(&block, Some(0x1234_5678), 99).expect("valid");
        assert_eq!(d.attrs(), sorted(attrs.clone()));
        assert_eq!(d.header.refcount, 3);
        assert_eq!(d.header.hash, d.computed_hash());
        assert_ne!(d.header.hash, 0);
        check_entry_hashes(&d.entries, false).expect("hashes");
        // The checksum binds the block number and the seed.
        assert!(verify_block_csum(&block, 0x1234_5678, 100).is_err());
        assert!(verify_block_csum(&block, 0x1234_5679, 99).is_err());
        let mut bad = block.clone();
        bad[1000] ^= 0x10;
        let err = verify_block(&bad, Some(0x1234_5678), 99).expect_err("bit flip");
        assert!(
            matches!(&err, FormatError::Corrupted { what, block: Some(99) } if what.contains("checksum")),
            "{err:?}"
        );
        // Values are packed from the end of the block, 4-aligned.
        let last_end = d
            .entries
            .iter()
            .filter(|e| !e.attr.value.is_empty())
            .map(|e| usize::from(e.value_offs) + value_size_padded(e.attr.value.len()))
            .max();
        assert_eq!(last_end, Some(1024));
        assert!(d.entries.iter().all(|e| e.value_offs % 4 == 0));
    }

    #[test]
    fn inode_round_trip_and_space() {
        let attrs = sample();
        let need_bytes = inode_space_needed(&attrs);
        let mut region = vec![0xAAu8; need_bytes];
        encode_inode_region(&mut region, &attrs).expect("exact fit");
        let d = decode_inode_entries(&region).expect("valid");
        assert_eq!(
            d.iter().map(|e| e.attr.clone()).collect::<Vec<_>>(),
            sorted(attrs.clone())
        );
        check_entry_hashes(&d, true).expect("hashes");
        let mut small = vec![0x55u8; need_bytes - 4];
        assert_eq!(
            encode_inode_region(&mut small, &attrs),
            Err(EncodeError::NoSpace {
                need_bytes,
                have_bytes: need_bytes - 4
            })
        );
        assert!(
            small.iter().all(|&b| b == 0x55),
            "failed encode must not write"
        );
        assert!(!fits_in_inode(need_bytes - 1, &attrs) && fits_in_inode(need_bytes, &attrs));
        // No attributes: the area is zeroed and decodes empty.
        encode_inode_region(&mut region, &[]).expect("empty");
        assert!(region.iter().all(|&b| b == 0));
        assert_eq!(decode_inode(&region), Ok(vec![]));
        let long = Xattr::new(INDEX_USER, &[b'n'; 256], b"");
        assert!(matches!(
            encode_block(&mut [0u8; 4096], &[long], 1),
            Err(EncodeError::Invalid { .. })
        ));
    }

    #[test]
    fn inode_region_bounds() {
        let mut inode = vec![0u8; 256];
        inode[0x80] = 32;
        assert_eq!(inode_region(&inode).map(|r| r.len()), Ok(96));
        inode[0x80] = 0;
        assert_eq!(inode_region(&inode).map(|r| r.len()), Ok(0));
        inode[0x80] = 130;
        assert!(inode_region(&inode).is_err());
        inode[0x80] = 30;
        assert!(inode_region(&inode).is_err());
        assert_eq!(inode_region(&inode[..128]).map(|r| r.len()), Ok(0));
    }

    fn expect_corrupt(r: Result<Vec<Entry>>, needle: &str) {
        match r {
            Err(FormatError::Corrupted { what, .. }) => {
                assert!(what.contains(needle), "{what:?} lacks {needle:?}")
            }
            other => panic!("expected Corrupted({needle}), got {other:?}"),
        }
    }

    #[test]
    fn decode_rejects_damage() {
        let attrs = vec![Xattr::new(INDEX_USER, b"k", b"12345678")];
        let mut region = vec![0u8; 64];
        encode_inode_region(&mut region, &attrs).expect("fits");
        let first = IBODY_HEADER_SIZE;
        // value offset pointing into the entry table
        let mut r = region.clone();
        set_le16(&mut r, first + E_VALUE_OFFS, 0);
        expect_corrupt(decode_inode_entries(&r), "overlaps the entry table");
        // value past the end
        let mut r = region.clone();
        set_le32(&mut r, first + E_VALUE_SIZE, 100);
        expect_corrupt(decode_inode_entries(&r), "runs past the end");
        let mut r = region.clone();
        set_le32(&mut r, first + E_VALUE_SIZE, u32::MAX);
        expect_corrupt(decode_inode_entries(&r), "runs past the end");
        // name past the end
        let mut r = region.clone();
        r[first + E_NAME_LEN] = 200;
        expect_corrupt(decode_inode_entries(&r), "name");
        // a value size past the kernel's limit
        let mut r = region.clone();
        set_le32(&mut r, first + E_VALUE_INUM, 13);
        set_le32(&mut r, first + E_VALUE_SIZE, (VALUE_SIZE_LIMIT + 1) as u32);
        expect_corrupt(decode_inode_entries(&r), "more than");
        // bad stored hash: decode accepts, the hash check names it
        let mut r = region.clone();
        set_le32(&mut r, first + E_HASH, 1);
        let d = decode_inode_entries(&r).expect("hash not judged by decode");
        assert!(check_entry_hashes(&d, true).is_err());
        // no magic: no attributes
        let mut r = region.clone();
        r[0] ^= 1;
        assert_eq!(decode_inode(&r), Ok(vec![]));

        let two = vec![
            Xattr::new(INDEX_USER, b"a", b"xxxx"),
            Xattr::new(INDEX_USER, b"b", b"yyyy"),
        ];
        let mut block = vec![0u8; 1024];
        encode_block(&mut block, &two, 1).expect("fits");
        // two values at the same place
        let mut b = block.clone();
        let off_a = le16(&b, BLOCK_HEADER_SIZE + E_VALUE_OFFS);
        set_le16(
            &mut b,
            BLOCK_HEADER_SIZE + entry_size(1) + E_VALUE_OFFS,
            off_a,
        );
        expect_corrupt(decode_block(&b).map(|d| d.entries), "overlap");
        let mut b = block.clone();
        b[H_MAGIC] ^= 1;
        expect_corrupt(decode_block(&b).map(|d| d.entries), "magic");
        let mut b = block.clone();
        set_le32(&mut b, H_BLOCKS, 2);
        expect_corrupt(decode_block(&b).map(|d| d.entries), "h_blocks");
        // a block whose entry table never ends
        let mut b = vec![0xFFu8; 64];
        put(&mut b, 0, &block[..BLOCK_HEADER_SIZE]);
        b[BLOCK_HEADER_SIZE + E_NAME_LEN] = 4;
        set_le32(&mut b, BLOCK_HEADER_SIZE + E_VALUE_INUM, 0);
        set_le32(&mut b, BLOCK_HEADER_SIZE + E_VALUE_SIZE, 0);
        b.truncate(BLOCK_HEADER_SIZE + entry_size(4) + 2);
        expect_corrupt(decode_block(&b).map(|d| d.entries), "terminator");
    }

    #[test]
    fn acl_formats() {
        let disk = [
            1u8, 0, 0, 0, 1, 0, 6, 0, 2, 0, 6, 0, 0xd2, 4, 0, 0, 4, 0, 4, 0, 0x10, 0, 6, 0, 0x20,
            0, 4, 0,
        ];
        let vfs = acl_disk_to_vfs(&disk).expect("valid");
        assert_eq!(vfs.len(), 4 + 5 * 8);
        assert_eq!(acl_vfs_to_disk(&vfs).expect("valid"), disk.to_vec());
        assert!(acl_disk_to_vfs(&disk[..disk.len() - 2]).is_err());
        assert!(
            acl_disk_to_vfs(&disk[..10]).is_err(),
            "USER entry cut short"
        );
        let mut bad = disk;
        bad[4] = 0x40;
        assert!(acl_disk_to_vfs(&bad).is_err());
        assert!(acl_vfs_to_disk(&disk).is_err(), "version 1 is not VFS");
        assert!(acl_vfs_to_disk(&vfs[..vfs.len() - 1]).is_err());
        assert_eq!(
            acl_disk_to_vfs(&[1, 0, 0, 0]).expect("empty"),
            vec![2, 0, 0, 0]
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_inode(&bytes);
            let _ = decode_block(&bytes);
            let _ = acl_disk_to_vfs(&bytes);
            let _ = acl_vfs_to_disk(&bytes);
            let _ = inode_region(&bytes);
            let mut magic = MAGIC.to_le_bytes().to_vec();
            magic.extend_from_slice(&bytes);
            let _ = decode_inode(&magic);
            let _ = verify_block(&bytes, Some(1), 2);
        }

        #[test]
        fn mutated_areas_never_panic(
            flips in proptest::collection::vec((0usize..1024, any::<u8>()), 1..8),
            cut in 0usize..1024,
        ) {
            let mut block = vec![0u8; 1024];
            encode_block(&mut block, &sample(), 1).expect("fits");
            let mut region = vec![0u8; 256];
            encode_inode_region(&mut region, &sample()).expect("fits");
            for (i, v) in flips {
                block[i] ^= v;
                region[i % 256] ^= v;
            }
            let _ = decode_block(&block);
            let _ = decode_block(&block[..cut]);
            let _ = decode_inode(&region);
            let _ = decode_inode(&region[..cut % 256]);
        }

        #[test]
        fn encode_fits_agree_and_round_trip(
            attrs in proptest::collection::vec(
                (1u8..8, proptest::collection::vec(any::<u8>(), 0..20),
                 proptest::collection::vec(any::<u8>(), 0..200)),
                0..12),
        ) {
            let mut attrs: Vec<Xattr> =
                attrs.into_iter().map(|(i, n, v)| Xattr::new(i, &n, &v)).collect();
            attrs.sort();
            attrs.dedup_by(|a, b| a.index == b.index && a.name == b.name);
            let mut block = vec![0u8; 1024];
            let r = encode_block(&mut block, &attrs, 1);
            prop_assert_eq!(r.is_ok(), fits_in_block(1024, &attrs));
            if r.is_ok() {
                let d = decode_block(&block).expect("own encoding decodes");
                prop_assert_eq!(d.attrs(), sorted(attrs.clone()));
                prop_assert_eq!(d.header.hash, d.computed_hash());
            }
            let mut region = vec![0u8; 96];
            let r = encode_inode_region(&mut region, &attrs);
            prop_assert_eq!(r.is_ok(), fits_in_inode(96, &attrs));
            if r.is_ok() {
                prop_assert_eq!(decode_inode(&region).expect("decodes"), sorted(attrs));
            }
        }
    }

    // ----- ground truth from e2fsprogs and the kernel -----

    fn inode_of(img: &Path, path: &str) -> u32 {
        let out = debugfs(img, &format!("stat {path}"));
        out.split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("Inode: N")
    }

    /// (inode bytes, inode byte offset, xattr block number from i_file_acl)
    fn inode_and_block(img: &Path, sb: &Sb, ino: u32) -> (Vec<u8>, u64, u64) {
        let off = inode_offset(img, ino, sb.bs);
        let inode = read_at(img, off, usize::from(sb.inode_size));
        let acl = u64::from(le32(&inode, 0x68)) | (u64::from(le16(&inode, 0x76)) << 32);
        (inode, off, acl)
    }

    /// Inode checksum (format notes §2.4), so the test can rewrite an inode.
    fn set_inode_csum(inode: &mut [u8], fs_seed: u32, ino: u32) {
        let gen = le32(inode, 0x64);
        let mut tmp = inode.to_vec();
        put(&mut tmp, 0x7C, &[0, 0]);
        put(&mut tmp, 0x82, &[0, 0]);
        let c = raw(crate::csum::inode_seed(fs_seed, ino, gen), &tmp);
        set_le16(inode, 0x7C, c as u16);
        set_le16(inode, 0x82, (c >> 16) as u16);
    }

    #[test]
    fn debugfs_xattrs_decode_and_reencode() {
        let dir = TempDir::new("xattr-debugfs");
        let img = dir.path().join("fs.img");
        mkfs(&img, "64M", &["-b", "4096", "-I", "256"], false);
        let sb = superblock(&img);
        let small = b"small-val".to_vec();
        let big: Vec<u8> = (0..300u32).map(|i| (i * 13 % 251) as u8).collect();
        let big2: Vec<u8> = (0..2000u32).map(|i| (i * 7 % 253) as u8).collect();
        for (name, v) in [("v_small", &small), ("v_big", &big), ("v_big2", &big2)] {
            std::fs::write(dir.path().join(name), v).expect("write value");
        }
        let src = dir.path().join("empty");
        std::fs::write(&src, b"").expect("write file");
        debugfs_w(&img, &format!("write {} f", src.display()));
        let d = dir.path().display();
        debugfs_w(&img, &format!("ea_set -f {d}/v_small /f user.small"));
        debugfs_w(&img, &format!("ea_set -f {d}/v_big /f user.big"));
        debugfs_w(&img, &format!("ea_set -f {d}/v_big2 /f trusted.big2"));
        let (clean, log) = e2fsck_clean(&img);
        assert!(clean, "debugfs image not clean:\n{log}");

        let ino = inode_of(&img, "/f");
        let (mut inode, inode_off, blk) = inode_and_block(&img, &sb, ino);
        assert_ne!(blk, 0, "big values must go to a block");
        let region = inode_region(&inode).expect("region");
        assert_eq!(region.len(), 96);
        let in_inode = decode_inode_entries(region).expect("in-inode decodes");
        assert_eq!(
            in_inode.iter().map(|e| e.attr.clone()).collect::<Vec<_>>(),
            vec![Xattr::new(INDEX_USER, b"small", &small)]
        );
        // libext2fs, like the kernel, stores e_hash 0 for in-inode entries.
        assert_eq!(in_inode[0].e_hash, 0);
        check_entry_hashes(&in_inode, true).expect("in-inode hashes");

        let mut block = read_block(&img, blk, sb.bs);
        let xb = verify_block(&block, Some(sb.fs_seed), blk).expect("block verifies");
        assert_eq!(
            xb.attrs(),
            vec![
                Xattr::new(INDEX_USER, b"big", &big),
                Xattr::new(INDEX_TRUSTED, b"big2", &big2)
            ]
        );
        assert_eq!(xb.header.refcount, 1);
        for e in &xb.entries {
            assert_eq!(e.e_hash, entry_hash(&e.attr.name, &e.attr.value));
        }
        // libext2fs leaves h_hash 0 (the kernel fills it; see kernel_xattrs_and_acl).
        assert_eq!(xb.header.hash, 0);
        let mut flipped = block.clone();
        flipped[2000] ^= 4;
        assert!(verify_block(&flipped, Some(sb.fs_seed), blk).is_err());

        // Our encoders produce areas e2fsck accepts, in place of libext2fs' ones.
        let mut fresh = vec![0u8; sb.bs as usize];
        // A name byte >= 0x80 checks that e2fsck 1.47 accepts the unsigned-char hash.
        let mut block_attrs = xb.attrs();
        block_attrs.push(Xattr::new(INDEX_USER, b"caf\xe9", b"high-byte name"));
        encode_block(&mut fresh, &block_attrs, 1).expect("fits");
        set_block_csum(&mut fresh, sb.fs_seed, blk);
        block.copy_from_slice(&fresh);
        write_at(&img, blk * u64::from(sb.bs), &block);
        let mut attrs = decode_inode(inode_region(&inode).expect("region")).expect("decodes");
        attrs.push(Xattr::new(INDEX_SECURITY, b"t", b"abc"));
        encode_inode_region(inode_region_mut(&mut inode).expect("region"), &attrs).expect("fits");
        set_inode_csum(&mut inode, sb.fs_seed, ino);
        write_at(&img, inode_off, &inode);
        let (clean, log) = e2fsck_clean(&img);
        assert!(clean, "re-encoded xattrs not clean:\n{log}");
        let listed = debugfs(&img, "ea_list /f");
        for n in [
            "user.small",
            "user.big",
            "trusted.big2",
            "security.t",
            "user.caf",
        ] {
            assert!(listed.contains(n), "{n} missing from:\n{listed}");
        }
        let got = debugfs(&img, "ea_get /f security.t");
        assert!(got.contains("abc"), "{got}");
    }

    #[test]
    fn kernel_xattrs_and_acl() {
        let dir = TempDir::new("xattr-kernel");
        let img = dir.path().join("fs.img");
        mkfs(&img, "64M", &["-b", "4096", "-I", "256"], false);
        let sb = superblock(&img);
        let mnt = dir.path().join("mnt");
        let acl_hex;
        {
            let _m = match Mount::new(&img, &mnt) {
                Ok(m) => m,
                Err(why) => {
                    rext4_testkit::skip(&why);
                    return;
                }
            };
            let f = mnt.join("f");
            std::fs::write(&f, b"data").expect("create file");
            run(Command::new("setfacl")
                .arg("-m")
                .arg("u:1234:rw,g:77:r")
                .arg(&f));
            run(Command::new("setfattr")
                .args(["-n", "user.k", "-v", "kv"])
                .arg(&f));
            let big = format!("0x{}", "ab".repeat(1500));
            run(Command::new("setfattr")
                .args(["-n", "user.big", "-v", &big])
                .arg(&f));
            let out = run(Command::new("getfattr")
                .args(["-e", "hex", "-n", "system.posix_acl_access"])
                .arg(&f));
            acl_hex = out
                .lines()
                .find_map(|l| l.strip_prefix("system.posix_acl_access=0x"))
                .expect("getfattr output")
                .to_string();
        }
        let ino = inode_of(&img, "/f");
        let (inode, _, blk) = inode_and_block(&img, &sb, ino);
        let mut all = decode_inode_entries(inode_region(&inode).expect("region")).expect("inode");
        check_entry_hashes(&all, true).expect("in-inode hashes (0 or valid)");
        assert_ne!(blk, 0);
        let xb = verify_block(&read_block(&img, blk, sb.bs), Some(sb.fs_seed), blk)
            .expect("kernel block verifies");
        check_entry_hashes(&xb.entries, false).expect("block hashes");
        assert_eq!(xb.header.hash, xb.computed_hash());
        all.extend(xb.entries);
        let find = |idx: u8, name: &[u8]| {
            all.iter()
                .find(|e| e.attr.index == idx && e.attr.name == name)
                .map(|e| e.attr.value.clone())
                .unwrap_or_else(|| panic!("{idx}/{name:?} missing: {all:?}"))
        };
        assert_eq!(find(INDEX_USER, b"k"), b"kv");
        assert_eq!(find(INDEX_USER, b"big"), vec![0xab; 1500]);
        let disk_acl = find(INDEX_POSIX_ACL_ACCESS, b"");
        let vfs = acl_disk_to_vfs(&disk_acl).expect("acl decodes");
        let hex: String = vfs.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, acl_hex);
        assert_eq!(acl_vfs_to_disk(&vfs).expect("back"), disk_acl);
        let entries = acl_decode_disk(&disk_acl).expect("entries");
        assert!(entries.contains(&AclEntry {
            tag: ACL_USER,
            perm: 6,
            id: 1234
        }));
        assert!(entries.contains(&AclEntry {
            tag: ACL_GROUP,
            perm: 4,
            id: 77
        }));
    }

    /// Ground truth from the kernel: values of 30 KiB (two files, one shared EA inode)
    /// and 60 KiB on an ea_inode image, with and without metadata_csum (the value hash
    /// uses the checksum seed either way). Entries decode to their inodes, the inodes'
    /// fields are what the format says, and re-encoding the areas gives bytes e2fsck
    /// accepts.
    #[test]
    fn kernel_ea_inode_values() {
        for csum in ["metadata_csum", "^metadata_csum"] {
            let dir = TempDir::new("xattr-ea-inode");
            let img = dir.path().join("fs.img");
            let features = format!("ea_inode,{csum}");
            mkfs(
                &img,
                "64M",
                &["-b", "4096", "-I", "256", "-O", &features],
                false,
            );
            let sb = superblock(&img);
            let mnt = dir.path().join("mnt");
            let v30: Vec<u8> = (0..30720u32).map(|i| (i * 31 % 251) as u8).collect();
            let v60: Vec<u8> = (0..61440u32).map(|i| (i * 17 % 241) as u8).collect();
            std::fs::write(dir.path().join("v30"), &v30).expect("write value");
            std::fs::write(dir.path().join("v60"), &v60).expect("write value");
            {
                let _m = match Mount::new(&img, &mnt) {
                    Ok(m) => m,
                    Err(why) => {
                        rext4_testkit::skip(&why);
                        return;
                    }
                };
                for f in ["a", "b"] {
                    let p = mnt.join(f);
                    std::fs::write(&p, b"").expect("create");
                    run(Command::new("setfattr")
                        .args(["-n", "user.big", "-v"])
                        .arg(format!("0x{}", hex(&v30)))
                        .arg(&p));
                }
                run(Command::new("setfattr")
                    .args(["-n", "user.small", "-v", "hello"])
                    .arg(mnt.join("a")));
                run(Command::new("setfattr")
                    .args(["-n", "trusted.k60", "-v"])
                    .arg(format!("0x{}", hex(&v60)))
                    .arg(mnt.join("b")));
            }
            let (clean, log) = e2fsck_clean(&img);
            assert!(clean, "kernel image not clean:\n{log}");
            let a = inode_of(&img, "/a");
            let b = inode_of(&img, "/b");
            let entries = |ino: u32| -> Vec<Entry> {
                let (inode, _, blk) = inode_and_block(&img, &sb, ino);
                let mut all = decode_inode_entries(inode_region(&inode).expect("region"))
                    .expect("in-inode entries");
                if blk != 0 {
                    let xb = verify_block(&read_block(&img, blk, sb.bs), Some(sb.fs_seed), blk)
                        .expect("block verifies");
                    all.extend(xb.entries);
                }
                check_entry_hashes(&all, true).expect("inline hashes");
                all
            };
            let find = |all: &[Entry], idx: u8, name: &[u8]| -> Entry {
                all.iter()
                    .find(|e| e.attr.index == idx && e.attr.name == name)
                    .cloned()
                    .unwrap_or_else(|| panic!("{name:?} missing: {all:?}"))
            };
            let ea = entries(a);
            let eb = entries(b);
            assert_eq!(find(&ea, INDEX_USER, b"small").attr.value, b"hello");
            let big_a = find(&ea, INDEX_USER, b"big")
                .attr
                .inode
                .expect("in an inode");
            let big_b = find(&eb, INDEX_USER, b"big")
                .attr
                .inode
                .expect("in an inode");
            let k60 = find(&eb, INDEX_TRUSTED, b"k60")
                .attr
                .inode
                .expect("in an inode");
            assert_eq!(big_a, big_b, "the kernel shares one inode for equal values");
            for (v, name, value, refs) in [
                (big_a, &b"big"[..], &v30, 2u64),
                (k60, &b"k60"[..], &v60, 1),
            ] {
                assert_eq!(v.size as usize, value.len());
                let off = inode_offset(&img, v.inum, sb.bs);
                let rec = read_at(&img, off, usize::from(sb.inode_size));
                let e = Inode::decode(&rec).expect("EA inode decodes");
                assert_eq!(e.mode, 0o100600);
                assert_eq!(
                    e.flags & crate::inode::flags::EA_INODE,
                    crate::inode::flags::EA_INODE
                );
                assert_eq!(e.links_count, 1);
                assert_eq!(e.size, value.len() as u64);
                assert_eq!(e.file_acl, 0);
                assert_eq!(ea_inode_refs(&e), refs);
                assert_eq!(ea_inode_hash(&e), ea_value_hash(sb.fs_seed, value));
                assert_eq!(v.hash, ea_inode_hash(&e), "decoded from e_hash");
                assert!(v.hash_matches(name, ea_inode_hash(&e)));
            }
            // Each file naming a value in an inode is charged that value's blocks in
            // i_blocks (the kernel charges quota, e2fsck checks i_blocks).
            let bs512 = u64::from(sb.bs / 512);
            for (ino, all) in [(a, &ea), (b, &eb)] {
                let (inode, _, blk) = inode_and_block(&img, &sb, ino);
                let charged: u64 = all
                    .iter()
                    .filter_map(|e| e.attr.inode)
                    .map(|v| u64::from(v.size).div_ceil(u64::from(sb.bs)) * bs512)
                    .sum();
                let xblock = if blk != 0 { bs512 } else { 0 };
                assert_eq!(
                    u64::from(le32(&inode, 0x1C)),
                    charged + xblock,
                    "i_blocks of {ino}"
                );
            }
            // Our encoding of the same areas is what e2fsck accepts.
            for ino in [a, b] {
                let (mut inode, off, blk) = inode_and_block(&img, &sb, ino);
                let attrs = decode_inode(inode_region(&inode).expect("region")).expect("decodes");
                encode_inode_region(inode_region_mut(&mut inode).expect("region"), &attrs)
                    .expect("fits");
                set_inode_csum(&mut inode, sb.fs_seed, ino);
                write_at(&img, off, &inode);
                if blk != 0 {
                    let xb = decode_block(&read_block(&img, blk, sb.bs)).expect("block");
                    let mut fresh = vec![0u8; sb.bs as usize];
                    encode_block(&mut fresh, &xb.attrs(), xb.header.refcount).expect("fits");
                    set_block_csum(&mut fresh, sb.fs_seed, blk);
                    write_at(&img, blk * u64::from(sb.bs), &fresh);
                }
            }
            let (clean, log) = e2fsck_clean(&img);
            assert!(
                clean,
                "re-encoded ea_inode entries not clean ({csum}):\n{log}"
            );
        }
    }

    fn hex(v: &[u8]) -> String {
        v.iter().map(|b| format!("{b:02x}")).collect()
    }
}
