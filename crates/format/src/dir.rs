//! Directory blocks: linear dirent blocks, their checksum tail, and htree index blocks
//! (format notes §2.6, §2.7).
//!
//! Owns: the byte layout of `ext4_dir_entry_2`, the 12-byte dirent tail, `dx_root`,
//! `dx_node` and the 8-byte `dx_tail`; walking, validating, checksumming and editing one
//! directory block in place. It does not know which blocks belong to a directory, which
//! inode a name refers to, or how the tree grows — the engine decides that (a block 0 is a
//! dx root exactly when the directory inode has `INDEX_FL` 0x1000).
//!
//! Must hold (checked by [`entries`] on every entry, as the kernel's
//! `__ext4_check_dir_entry` does):
//! - `rec_len` is a multiple of 4, at least 12 and at least `(8 + name_len + 3) & !3`;
//!   an entry never crosses the end of the block, nor the tail when there is one. So a
//!   walk always advances and ends exactly at the block end (no loop on `rec_len` 0).
//! - With metadata_csum every *leaf* block ends in the 12-byte tail
//!   `{inode 0, rec_len 12, name_len 0, file_type 0xDE, csum}` with
//!   `csum = raw(inode_seed, block[0..bs-12])`. Index blocks have no dirent tail; their
//!   `dx_tail {reserved, csum}` sits after `limit` entries.
//! - A dx root is also a valid linear block ("." rec_len 12, ".." rec_len bs−12) and a
//!   dx node is one empty dirent of rec_len bs, so linear readers skip index blocks.
//! - Deleted entries (inode 0) are yielded by [`entries`] (the slack is needed to
//!   insert) but never match a lookup.
//!
//! Encoders assume the `filetype` feature (the file-type byte is written) and write
//! only into the caller's buffer; after editing a leaf the caller stores the checksum
//! with [`set_leaf_csum`] (or [`set_dx_csum`] for index blocks) before writing it out.
//!
//! Callers: the engine's directory lookup/readdir/insert/remove and htree code, fsck,
//! the buffer cache's read/write verifiers.

use crate::bytes::{le16, le32, need, put, set_le16, set_le32, set_u8, slice, u8_at};
use crate::csum::raw;
use crate::{ensure, FormatError, Result};

// ---- ext4_dir_entry_2 (offsets inside one entry) ----
pub const DIRENT_INODE: usize = 0x0;
pub const DIRENT_REC_LEN: usize = 0x4;
pub const DIRENT_NAME_LEN: usize = 0x6;
pub const DIRENT_FILE_TYPE: usize = 0x7;
pub const DIRENT_NAME: usize = 0x8;
/// Size of the fixed part of an entry.
pub const DIRENT_HEADER_LEN: usize = 8;
/// Longest name an entry can hold.
pub const NAME_MAX: usize = 255;
/// Smallest `rec_len` the kernel accepts (the record length of a one-byte name).
pub const MIN_REC_LEN: usize = 12;

// ---- ext4_dir_entry_tail ----
/// Size of the checksum tail at the end of a leaf block.
pub const TAIL_LEN: usize = 12;
/// `file_type` byte that marks the tail.
pub const TAIL_FILE_TYPE: u8 = 0xDE;
/// Offset of the checksum inside the tail.
pub const TAIL_CSUM: usize = 0x8;

// ---- dx_root (offsets inside block 0) ----
/// `dx_root_info` follows "." (rec_len 12) and the 12-byte head of "..".
pub const DX_ROOT_INFO: usize = 0x18;
pub const DX_ROOT_RESERVED_ZERO: usize = 0x18;
pub const DX_ROOT_HASH_VERSION: usize = 0x1C;
pub const DX_ROOT_INFO_LENGTH: usize = 0x1D;
pub const DX_ROOT_INDIRECT_LEVELS: usize = 0x1E;
pub const DX_ROOT_UNUSED_FLAGS: usize = 0x1F;
/// `{limit le16, count le16, block le32}` of a root: the header slot, entry 0.
pub const DX_ROOT_COUNT_OFFSET: usize = 0x20;
/// `dx_root_info.info_length`.
pub const DX_ROOT_INFO_LEN: usize = 8;
// ---- dx_node ----
/// `{limit, count, block}` of a node, after its fake 8-byte dirent.
pub const DX_NODE_COUNT_OFFSET: usize = 0x8;
// ---- dx_entry / dx_tail ----
pub const DX_ENTRY_LEN: usize = 8;
pub const DX_TAIL_LEN: usize = 8;
/// `indirect_levels` limit without / with the largedir feature (kernel
/// `ext4_dir_htree_level` minus one).
pub const DX_MAX_LEVELS: u8 = 1;
pub const DX_MAX_LEVELS_LARGEDIR: u8 = 2;

const _: () = assert!(DIRENT_NAME == DIRENT_HEADER_LEN);
const _: () = assert!(TAIL_LEN == DIRENT_HEADER_LEN + 4);
const _: () = assert!(TAIL_CSUM + 4 == TAIL_LEN);
// "." takes 12 bytes, ".." its 8-byte header plus "..\0\0" before the info.
const _: () = assert!(DX_ROOT_INFO == MIN_REC_LEN + DIRENT_HEADER_LEN + 4);
const _: () = assert!(DX_ROOT_COUNT_OFFSET == DX_ROOT_INFO + DX_ROOT_INFO_LEN);
const _: () = assert!(DX_ROOT_UNUSED_FLAGS + 1 == DX_ROOT_COUNT_OFFSET);
const _: () = assert!(DX_NODE_COUNT_OFFSET == DIRENT_HEADER_LEN);
// The kernel's limits: 507/123 for a root and 510/126 for a node at 4 KiB/1 KiB.
const _: () = assert!(dx_root_limit(4096, true) == 507 && dx_root_limit(1024, true) == 123);
const _: () = assert!(dx_node_limit(4096, true) == 510 && dx_node_limit(1024, true) == 126);
const _: () = assert!(dx_root_limit(4096, false) == 508 && dx_node_limit(1024, false) == 127);

/// The file type stored in an entry (with the `filetype` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FileType {
    Unknown = 0,
    Regular = 1,
    Directory = 2,
    CharDevice = 3,
    BlockDevice = 4,
    Fifo = 5,
    Socket = 6,
    Symlink = 7,
}

impl FileType {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => FileType::Unknown,
            1 => FileType::Regular,
            2 => FileType::Directory,
            3 => FileType::CharDevice,
            4 => FileType::BlockDevice,
            5 => FileType::Fifo,
            6 => FileType::Socket,
            7 => FileType::Symlink,
            _ => return None,
        })
    }

    /// The entry type for an inode's `i_mode` (its `S_IFMT` bits).
    pub fn from_mode(mode: u16) -> Self {
        match mode & 0o170000 {
            0o100000 => FileType::Regular,
            0o040000 => FileType::Directory,
            0o020000 => FileType::CharDevice,
            0o060000 => FileType::BlockDevice,
            0o010000 => FileType::Fifo,
            0o140000 => FileType::Socket,
            0o120000 => FileType::Symlink,
            _ => FileType::Unknown,
        }
    }
}

/// Record length needed for a name of `name_len` bytes: `(8 + name_len + 3) & !3`.
pub const fn rec_len_for(name_len: usize) -> usize {
    (DIRENT_HEADER_LEN + name_len + 3) & !3
}

/// Decode an on-disk `rec_len`. Only 64 KiB blocks use the special encoding
/// (`0` or `0xFFFF` = the whole block, low two bits = bits 16..17).
pub fn rec_len_from_disk(disk: u16, block_size: usize) -> usize {
    let len = usize::from(disk);
    if block_size < 65536 {
        len
    } else if disk == 0xFFFF || disk == 0 {
        block_size
    } else {
        (len & 0xFFFC) | ((len & 3) << 16)
    }
}

/// Encode a `rec_len` (a multiple of 4, at most the block size).
pub fn rec_len_to_disk(len: usize, block_size: usize) -> u16 {
    if block_size < 65536 {
        len as u16
    } else if len >= 65536 {
        0xFFFF
    } else {
        ((len & 0xFFFC) | ((len >> 16) & 3)) as u16
    }
}

/// One directory entry, borrowed from its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry<'a> {
    /// 0 for a deleted/empty slot.
    pub inode: u32,
    /// Decoded record length in bytes (may exceed `u16` on 64 KiB blocks).
    pub rec_len: usize,
    pub name_len: u8,
    /// Raw file-type byte; see [`DirEntry::kind`].
    pub file_type: u8,
    pub name: &'a [u8],
    /// Byte offset of the entry inside its block.
    pub offset: usize,
}

impl DirEntry<'_> {
    /// The decoded file type, `None` for a value above 7.
    pub fn kind(&self) -> Option<FileType> {
        FileType::from_u8(self.file_type)
    }
    /// Whether the entry names an inode (not a deleted slot or the tail).
    pub fn is_live(&self) -> bool {
        self.inode != 0
    }
    /// Bytes this entry needs for itself: 0 for an empty slot, else `rec_len_for(name_len)`.
    pub fn used_len(&self) -> usize {
        if self.is_live() {
            rec_len_for(usize::from(self.name_len))
        } else {
            0
        }
    }
}

/// Iterator over the entries of one block; see [`entries`].
#[derive(Debug, Clone)]
pub struct DirEntries<'a> {
    block: &'a [u8],
    off: usize,
    end: usize,
    pending: Option<FormatError>,
    done: bool,
}

/// Walk every entry of a linear block (leaf), deleted ones included, in on-disk order.
/// `has_csum_tail` is true for leaf blocks of a metadata_csum filesystem: the tail must
/// be present and is not yielded. Pass false for index blocks (a dx root then shows
/// "." and "..", a dx node one empty entry) and for non-csum filesystems.
///
/// Yields `Err(Corrupted)` for the first bad entry (or a missing tail) and then stops.
pub fn entries(block: &[u8], has_csum_tail: bool) -> DirEntries<'_> {
    let mut it = DirEntries {
        block,
        off: 0,
        end: block.len(),
        pending: None,
        done: false,
    };
    if has_csum_tail {
        if tail_present(block) {
            it.end = block.len() - TAIL_LEN;
        } else {
            it.pending = Some(FormatError::corrupted("dirent tail missing"));
        }
    }
    it
}

/// Only the entries that name an inode.
pub fn live_entries(
    block: &[u8],
    has_csum_tail: bool,
) -> impl Iterator<Item = Result<DirEntry<'_>>> {
    entries(block, has_csum_tail).filter(|e| e.as_ref().map_or(true, DirEntry::is_live))
}

impl<'a> DirEntries<'a> {
    fn parse_at(&self, off: usize) -> Result<DirEntry<'a>> {
        let block = self.block;
        ensure(off.saturating_add(DIRENT_HEADER_LEN) <= self.end, || {
            format!(
                "dirent at offset {off}: header crosses the end of the entry area ({})",
                self.end
            )
        })?;
        let rec_len = rec_len_from_disk(le16(block, off + DIRENT_REC_LEN), block.len());
        let name_len = u8_at(block, off + DIRENT_NAME_LEN);
        ensure(rec_len >= MIN_REC_LEN, || {
            format!("dirent at offset {off}: rec_len {rec_len} below minimum 12")
        })?;
        ensure(rec_len & 3 == 0, || {
            format!("dirent at offset {off}: rec_len {rec_len} not a multiple of 4")
        })?;
        ensure(rec_len >= rec_len_for(usize::from(name_len)), || {
            format!("dirent at offset {off}: rec_len {rec_len} too small for name_len {name_len}")
        })?;
        ensure(off + rec_len <= self.end, || {
            format!(
                "dirent at offset {off}: rec_len {rec_len} crosses the end of the entry area ({})",
                self.end
            )
        })?;
        let name = slice(block, off + DIRENT_NAME, usize::from(name_len)).ok_or_else(|| {
            FormatError::corrupted(format!("dirent at offset {off}: name out of block"))
        })?;
        let inode = le32(block, off + DIRENT_INODE);
        // A live entry names its inode by a name of at least one byte (e2fsck: "has a
        // zero-length name"); an insert after it would cut its record to 8 bytes.
        ensure(inode == 0 || name_len > 0, || {
            format!("dirent at offset {off}: inode {inode} with an empty name")
        })?;
        Ok(DirEntry {
            inode,
            rec_len,
            name_len,
            file_type: u8_at(block, off + DIRENT_FILE_TYPE),
            name,
            offset: off,
        })
    }
}

impl<'a> Iterator for DirEntries<'a> {
    type Item = Result<DirEntry<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        if let Some(e) = self.pending.take() {
            self.done = true;
            return Some(Err(e));
        }
        if self.off >= self.end {
            self.done = true;
            return None;
        }
        match self.parse_at(self.off) {
            Ok(e) => {
                self.off += e.rec_len;
                Some(Ok(e))
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

impl std::iter::FusedIterator for DirEntries<'_> {}

/// Walk the whole block and fail on the first bad entry (or missing tail).
pub fn check_block(block: &[u8], has_csum_tail: bool) -> Result<()> {
    entries(block, has_csum_tail).try_for_each(|e| e.map(|_| ()))
}

/// The live entry called `name`, if any; `Err` for the first bad entry before it (or
/// a missing tail), as [`entries`] reports it.
///
/// Every create, unlink and lookup of a name scans one leaf block like this, so the
/// walk is a tight loop over the fields it needs ([`lookup_fast`]); where that loop
/// meets an entry it does not like, the checked walk over [`live_entries`] runs
/// instead and names the problem.
pub fn lookup<'a>(
    block: &'a [u8],
    name: &[u8],
    has_csum_tail: bool,
) -> Result<Option<DirEntry<'a>>> {
    match lookup_fast(block, name, has_csum_tail) {
        Some(found) => Ok(found),
        None => lookup_checked(block, name, has_csum_tail),
    }
}

/// The first live entry of a leaf block whose name `matches` accepts (a casefolded
/// directory's lookup: [`crate::casefold::names_match`]).
pub fn lookup_by<'a>(
    block: &'a [u8],
    has_csum_tail: bool,
    matches: impl Fn(&[u8]) -> bool,
) -> Result<Option<DirEntry<'a>>> {
    // The fast walk of `lookup` first; the checked walk reports what it cannot judge.
    let fast = fast_walk(block, has_csum_tail, |e| {
        (e.inode != 0 && e.name != b"." && e.name != b".." && matches(e.name)).then(|| DirEntry {
            inode: e.inode,
            rec_len: e.rec_len,
            name_len: e.name_len,
            file_type: u8_at(block, e.off + DIRENT_FILE_TYPE),
            name: e.name,
            offset: e.off,
        })
    });
    if let Some(found) = fast {
        return Ok(found);
    }
    for e in live_entries(block, has_csum_tail) {
        let e = e?;
        if e.name != b"." && e.name != b".." && matches(e.name) {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// [`lookup`] without the fast walk (the reference it must agree with).
fn lookup_checked<'a>(
    block: &'a [u8],
    name: &[u8],
    has_csum_tail: bool,
) -> Result<Option<DirEntry<'a>>> {
    for e in live_entries(block, has_csum_tail) {
        let e = e?;
        if e.name == name {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// One entry as the fast walk sees it.
#[derive(Clone, Copy)]
struct Raw<'a> {
    off: usize,
    rec_len: usize,
    name_len: u8,
    inode: u32,
    name: &'a [u8],
}

/// The entry walk of [`lookup`], [`insert_entry`] and [`remove_entry`] when nothing is
/// wrong: `visit` sees each entry in order until it returns `Some`; the result is
/// `Some(answer)` when every entry up to the answer passes the checks
/// `DirEntries::parse_at` makes, in the same order, and `None` at the first that does
/// not (or a missing tail): the caller's checked walk over [`entries`] then takes over
/// and names the problem. Every create, unlink and lookup of a name walks one leaf, so
/// this is a tight loop over the fields it needs.
fn fast_walk<'a, T>(
    block: &'a [u8],
    has_csum_tail: bool,
    mut visit: impl FnMut(Raw<'a>) -> Option<T>,
) -> Option<Option<T>> {
    let end = if has_csum_tail {
        if !tail_present(block) {
            return None;
        }
        block.len() - TAIL_LEN
    } else {
        block.len()
    };
    let mut off = 0usize;
    while off < end {
        if off + DIRENT_HEADER_LEN > end {
            return None;
        }
        let rec_len = rec_len_from_disk(le16(block, off + DIRENT_REC_LEN), block.len());
        let name_len = u8_at(block, off + DIRENT_NAME_LEN);
        let nl = usize::from(name_len);
        let inode = le32(block, off + DIRENT_INODE);
        if rec_len < MIN_REC_LEN
            || rec_len & 3 != 0
            || rec_len < rec_len_for(nl)
            || off + rec_len > end
            || (inode != 0 && nl == 0)
        {
            return None;
        }
        let e = Raw {
            off,
            rec_len,
            name_len,
            inode,
            // In range: rec_len covers the name and off + rec_len <= end <= len.
            name: &block[off + DIRENT_NAME..off + DIRENT_NAME + nl],
        };
        if let Some(t) = visit(e) {
            return Some(Some(t));
        }
        off += rec_len;
    }
    Some(None)
}

/// `a == b`, with the last bytes compared before the rest: the names of one directory
/// often share a long prefix and differ at the end (file.000123, file.000124), and a
/// leaf walk compares the name sought with every entry of the same length.
#[inline]
fn same_name(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.last() == b.last() && a == b
}

/// [`lookup`]'s fast walk (see [`fast_walk`]).
fn lookup_fast<'a>(
    block: &'a [u8],
    name: &[u8],
    has_csum_tail: bool,
) -> Option<Option<DirEntry<'a>>> {
    fast_walk(block, has_csum_tail, |e| {
        (e.inode != 0 && same_name(e.name, name)).then(|| DirEntry {
            inode: e.inode,
            rec_len: e.rec_len,
            name_len: e.name_len,
            file_type: u8_at(block, e.off + DIRENT_FILE_TYPE),
            name: e.name,
            offset: e.off,
        })
    })
}

// ---------------------------------------------------------------- checksum tail

/// Whether the last 12 bytes of `block` are a dirent tail
/// `{inode 0, rec_len 12, name_len 0, file_type 0xDE}` (the checksum is not checked).
pub fn tail_present(block: &[u8]) -> bool {
    let Some(t) = block.len().checked_sub(TAIL_LEN) else {
        return false;
    };
    le32(block, t + DIRENT_INODE) == 0
        && le16(block, t + DIRENT_REC_LEN) as usize == TAIL_LEN
        && u8_at(block, t + DIRENT_NAME_LEN) == 0
        && u8_at(block, t + DIRENT_FILE_TYPE) == TAIL_FILE_TYPE
}

/// Checksum of a leaf block: `raw(inode_seed, block[0..bs-12])`.
pub fn leaf_csum(block: &[u8], inode_seed: u32) -> u32 {
    let covered = block.len().saturating_sub(TAIL_LEN);
    raw(inode_seed, block.get(..covered).unwrap_or(&[]))
}

/// Check the tail is present and its checksum matches.
pub fn verify_leaf_csum(block: &[u8], inode_seed: u32) -> Result<()> {
    ensure(tail_present(block), || "dirent tail missing".into())?;
    let stored = le32(block, block.len() - TAIL_LEN + TAIL_CSUM);
    let computed = leaf_csum(block, inode_seed);
    ensure(stored == computed, || {
        format!("dirent block checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
    })
}

/// Full read/write verifier of a metadata_csum leaf: tail, checksum, every entry.
pub fn verify_leaf(block: &[u8], inode_seed: u32) -> Result<()> {
    verify_leaf_csum(block, inode_seed)?;
    check_block(block, true)
}

/// Store the checksum in an existing tail. Fails (writing nothing) if there is no tail.
pub fn set_leaf_csum(block: &mut [u8], inode_seed: u32) -> Result<()> {
    ensure(tail_present(block), || "dirent tail missing".into())?;
    let csum = leaf_csum(block, inode_seed);
    let at = block.len() - TAIL_LEN + TAIL_CSUM;
    set_le32(block, at, csum);
    Ok(())
}

/// Write an empty tail (checksum 0) over the last 12 bytes. The entries before it must
/// already end at `bs - 12`.
pub fn write_tail(block: &mut [u8]) {
    let Some(t) = block.len().checked_sub(TAIL_LEN) else {
        return;
    };
    put(block, t, &[0u8; TAIL_LEN]);
    set_le16(block, t + DIRENT_REC_LEN, TAIL_LEN as u16);
    set_u8(block, t + DIRENT_FILE_TYPE, TAIL_FILE_TYPE);
}

// ---------------------------------------------------------------- leaf encoders

/// End of the entry area: the block end, or the tail's start.
fn area_end(block: &[u8], has_tail: bool) -> usize {
    if has_tail {
        block.len().saturating_sub(TAIL_LEN)
    } else {
        block.len()
    }
}

/// Write one entry header and name at `off`, zeroing the rest of its record.
fn write_entry(block: &mut [u8], off: usize, ino: u32, rec_len: usize, name: &[u8], ftype: u8) {
    if let Some(rec) = block.get_mut(off..off.saturating_add(rec_len)) {
        rec.fill(0);
    }
    let bs = block.len();
    set_le32(block, off + DIRENT_INODE, ino);
    set_le16(block, off + DIRENT_REC_LEN, rec_len_to_disk(rec_len, bs));
    set_u8(block, off + DIRENT_NAME_LEN, name.len() as u8);
    set_u8(block, off + DIRENT_FILE_TYPE, ftype);
    put(block, off + DIRENT_NAME, name);
}

/// Format the first block of a new directory: "." → `self_ino`, ".." → `parent_ino`
/// (rec_len to the end of the entry area), and the tail when `has_tail`. The checksum is
/// left 0: call [`set_leaf_csum`]. `block` must be at least 36 bytes (real blocks are
/// ≥ 1024).
pub fn init_block(block: &mut [u8], self_ino: u32, parent_ino: u32, has_tail: bool) {
    block.fill(0);
    let end = area_end(block, has_tail);
    let dir = FileType::Directory as u8;
    write_entry(block, 0, self_ino, MIN_REC_LEN, b".", dir);
    write_entry(
        block,
        MIN_REC_LEN,
        parent_ino,
        end.saturating_sub(MIN_REC_LEN),
        b"..",
        dir,
    );
    if has_tail {
        write_tail(block);
    }
}

/// Format an empty leaf (one deleted entry spanning the entry area, plus the tail), as
/// the kernel does for a directory's new block. The checksum is left 0.
pub fn init_empty_leaf(block: &mut [u8], has_tail: bool) {
    block.fill(0);
    let end = area_end(block, has_tail);
    write_entry(block, 0, 0, end, b"", 0);
    if has_tail {
        write_tail(block);
    }
}

/// Insert `name` → `ino` in the first place with room, kernel-style: reuse a deleted
/// entry whose record is big enough, or split the slack after a live entry. Returns the
/// new entry's offset, `None` if the block is full. Does not check for an existing entry
/// of the same name (the caller has searched the whole directory). Never call this on a
/// dx root or node. The checksum is not updated.
///
/// Errors: `ino` 0 or a name of length 0 or > 255 (caller bugs), or a corrupted block.
pub fn insert_entry(
    block: &mut [u8],
    ino: u32,
    name: &[u8],
    ftype: FileType,
    has_tail: bool,
) -> Result<Option<usize>> {
    ensure(ino != 0, || "insert_entry: inode 0".into())?;
    ensure(!name.is_empty() && name.len() <= NAME_MAX, || {
        format!("insert_entry: name length {} outside 1..=255", name.len())
    })?;
    let need_len = rec_len_for(name.len());
    Ok(
        insert_spot(block, need_len, has_tail)?
            .map(|spot| put_entry(block, spot, ino, name, ftype)),
    )
}

/// What [`insert_new_entry`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insertion {
    /// The entry is in, at this offset.
    Added(usize),
    /// A live entry already has the name: nothing changed.
    Exists,
    /// No entry has the name, and no room for it: nothing changed.
    NoRoom,
}

/// [`insert_entry`] unless a live entry already has the name: one walk of the block
/// answers both (a lookup and then an insert walk it twice).
pub fn insert_new_entry(
    block: &mut [u8],
    ino: u32,
    name: &[u8],
    ftype: FileType,
    has_tail: bool,
) -> Result<Insertion> {
    ensure(ino != 0, || "insert_new_entry: inode 0".into())?;
    ensure(!name.is_empty() && name.len() <= NAME_MAX, || {
        format!(
            "insert_new_entry: name length {} outside 1..=255",
            name.len()
        )
    })?;
    let need_len = rec_len_for(name.len());
    let mut spot = None;
    let fast = fast_walk(block, has_tail, |e| {
        if e.inode != 0 && same_name(e.name, name) {
            return Some(());
        }
        let used = if e.inode != 0 {
            rec_len_for(usize::from(e.name_len))
        } else {
            0
        };
        if spot.is_none() && e.rec_len - used >= need_len {
            spot = Some((e.off, used, e.rec_len));
        }
        None
    });
    let spot = match fast {
        Some(Some(())) => return Ok(Insertion::Exists),
        Some(None) => spot,
        None => {
            if lookup_checked(block, name, has_tail)?.is_some() {
                return Ok(Insertion::Exists);
            }
            insert_spot_checked(block, need_len, has_tail)?
        }
    };
    Ok(spot.map_or(Insertion::NoRoom, |spot| {
        Insertion::Added(put_entry(block, spot, ino, name, ftype))
    }))
}

/// Write a new entry at `spot` (as [`insert_spot`] gives it); its offset.
fn put_entry(
    block: &mut [u8],
    (off, used, rec_len): (usize, usize, usize),
    ino: u32,
    name: &[u8],
    ftype: FileType,
) -> usize {
    let bs = block.len();
    if used > 0 {
        // Shrink the live entry to what it needs; the new one takes the rest.
        set_le16(block, off + DIRENT_REC_LEN, rec_len_to_disk(used, bs));
    }
    let new_off = off + used;
    write_entry(block, new_off, ino, rec_len - used, name, ftype as u8);
    new_off
}

/// Where [`insert_entry`] puts a record of `need_len` bytes: the first entry with that
/// much slack, as (offset, bytes it keeps, its rec_len).
fn insert_spot(
    block: &[u8],
    need_len: usize,
    has_tail: bool,
) -> Result<Option<(usize, usize, usize)>> {
    let fast = fast_walk(block, has_tail, |e| {
        let used = if e.inode != 0 {
            rec_len_for(usize::from(e.name_len))
        } else {
            0
        };
        (e.rec_len - used >= need_len).then_some((e.off, used, e.rec_len))
    });
    match fast {
        Some(spot) => Ok(spot),
        None => insert_spot_checked(block, need_len, has_tail),
    }
}

/// [`insert_spot`] without the fast walk.
fn insert_spot_checked(
    block: &[u8],
    need_len: usize,
    has_tail: bool,
) -> Result<Option<(usize, usize, usize)>> {
    for e in entries(block, has_tail) {
        let e = e?;
        let used = e.used_len();
        if e.rec_len - used >= need_len {
            return Ok(Some((e.offset, used, e.rec_len)));
        }
    }
    Ok(None)
}

/// The live entry [`remove_entry`] removes, as ((offset, rec_len, inode), the
/// previous entry's (offset, rec_len)).
type Removal = ((usize, usize, u32), Option<(usize, usize)>);

fn removal(block: &[u8], name: &[u8], has_tail: bool) -> Result<Option<Removal>> {
    let mut prev = None;
    let fast = fast_walk(block, has_tail, |e| {
        if e.inode != 0 && same_name(e.name, name) {
            return Some(((e.off, e.rec_len, e.inode), prev));
        }
        prev = Some((e.off, e.rec_len));
        None
    });
    match fast {
        Some(found) => Ok(found),
        None => removal_checked(block, name, has_tail),
    }
}

/// [`removal`] without the fast walk.
fn removal_checked(block: &[u8], name: &[u8], has_tail: bool) -> Result<Option<Removal>> {
    let mut prev = None;
    for e in entries(block, has_tail) {
        let e = e?;
        if e.is_live() && e.name == name {
            return Ok(Some(((e.offset, e.rec_len, e.inode), prev)));
        }
        prev = Some((e.offset, e.rec_len));
    }
    Ok(None)
}

/// Remove the live entry called `name`, kernel-style: the previous entry's record
/// absorbs it, or, if it is the first in the block, its inode becomes 0. Returns the
/// inode it named, `None` if absent. The checksum is not updated.
pub fn remove_entry(block: &mut [u8], name: &[u8], has_tail: bool) -> Result<Option<u32>> {
    Ok(remove_entry_typed(block, name, has_tail)?.map(|(ino, _)| ino))
}

/// [`remove_entry`], also returning the raw file-type byte the entry had: one walk of
/// the block for both.
pub fn remove_entry_typed(
    block: &mut [u8],
    name: &[u8],
    has_tail: bool,
) -> Result<Option<(u32, u8)>> {
    remove_matching(block, name, has_tail, None)
}

/// [`remove_entry_typed`] only if the entry names inode `ino` (else nothing changes and
/// the answer is `None`), in the same one walk.
pub fn remove_entry_naming(
    block: &mut [u8],
    name: &[u8],
    ino: u32,
    has_tail: bool,
) -> Result<Option<(u32, u8)>> {
    remove_matching(block, name, has_tail, Some(ino))
}

fn remove_matching(
    block: &mut [u8],
    name: &[u8],
    has_tail: bool,
    expect: Option<u32>,
) -> Result<Option<(u32, u8)>> {
    let Some(((off, rec_len, ino), prev)) = removal(block, name, has_tail)? else {
        return Ok(None);
    };
    if expect.is_some_and(|want| want != ino) {
        return Ok(None);
    }
    let ftype = u8_at(block, off + DIRENT_FILE_TYPE);
    let bs = block.len();
    match prev {
        Some((poff, prec)) => {
            set_le16(
                block,
                poff + DIRENT_REC_LEN,
                rec_len_to_disk(prec + rec_len, bs),
            );
            // The old entry is now slack of the previous one: wipe it.
            if let Some(rec) = block.get_mut(off..off + rec_len) {
                rec.fill(0);
            }
        }
        None => set_le32(block, off + DIRENT_INODE, 0),
    }
    Ok(Some((ino, ftype)))
}

// ---------------------------------------------------------------- htree

/// Entries a dx root holds (header slot included): `(bs − 32)/8`, minus one for the
/// dx_tail with metadata_csum.
pub const fn dx_root_limit(block_size: usize, has_csum: bool) -> usize {
    let space = block_size.saturating_sub(DX_ROOT_COUNT_OFFSET)
        - if has_csum && block_size >= DX_ROOT_COUNT_OFFSET + DX_TAIL_LEN {
            DX_TAIL_LEN
        } else {
            0
        };
    space / DX_ENTRY_LEN
}

/// Entries a dx node holds (header slot included): `(bs − 8)/8`, minus one with
/// metadata_csum.
pub const fn dx_node_limit(block_size: usize, has_csum: bool) -> usize {
    let space = block_size.saturating_sub(DX_NODE_COUNT_OFFSET)
        - if has_csum && block_size >= DX_NODE_COUNT_OFFSET + DX_TAIL_LEN {
            DX_TAIL_LEN
        } else {
            0
        };
    space / DX_ENTRY_LEN
}

/// One index entry: names with hash ≥ `hash` (up to the next entry's hash) live under
/// logical directory block `block`. Entry 0's hash is the header slot and reads as 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DxEntry {
    pub hash: u32,
    pub block: u32,
}

/// A decoded dx root (directory block 0 of an indexed directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DxRoot {
    /// Inode of "." and "..".
    pub dot_inode: u32,
    pub dotdot_inode: u32,
    /// On-disk hash version 0..=2 (see [`crate::hash::HashVersion::effective`]).
    pub hash_version: u8,
    /// 0: the entries point at leaves; n: n levels of dx nodes below the root.
    pub indirect_levels: u8,
    /// `count` entries, the header slot first (hash 0, the block for the lowest hashes).
    pub entries: Vec<DxEntry>,
}

/// A decoded dx node (an interior index block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DxNode {
    pub entries: Vec<DxEntry>,
}

/// The entries of an index block (root or node), read in place: `{limit, count}`
/// checked against the kernel's limit and the block's end when made, each entry read
/// when asked for. The order of the hashes is checked only by [`DxEntries::check_order`]
/// (the decoders, and so the buffer cache's verifier, which runs once per block read
/// from the device): a lookup costs a binary search, not a decode of every entry.
#[derive(Debug, Clone, Copy)]
pub struct DxEntries<'a> {
    block: &'a [u8],
    at: usize,
    count: usize,
}

impl<'a> DxEntries<'a> {
    fn new(block: &'a [u8], at: usize, expect_limit: usize, what: &'static str) -> Result<Self> {
        need(block, at + DX_ENTRY_LEN, what)?;
        let limit = usize::from(le16(block, at));
        let count = usize::from(le16(block, at + 2));
        ensure(limit == expect_limit, || {
            format!("{what}: limit {limit}, expected {expect_limit}")
        })?;
        ensure(count >= 1 && count <= limit, || {
            format!("{what}: count {count} outside 1..={limit}")
        })?;
        ensure(at + count * DX_ENTRY_LEN <= block.len(), || {
            format!("{what}: entries cross the block end")
        })?;
        Ok(DxEntries { block, at, count })
    }

    /// How many entries (the header slot included): at least 1.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Never: a view has at least the header slot.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Entry `i` (`i < len()`); entry 0's hash reads as 0.
    pub fn get(&self, i: usize) -> DxEntry {
        let at = self.at + i * DX_ENTRY_LEN;
        DxEntry {
            hash: if i == 0 { 0 } else { le32(self.block, at) },
            block: le32(self.block, at + 4),
        }
    }

    /// [`lookup_index`] in place: the last entry whose hash ≤ `hash`, entry 0
    /// standing for −∞.
    pub fn lookup(&self, hash: u32) -> usize {
        let (mut lo, mut hi) = (1, self.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if le32(self.block, self.at + mid * DX_ENTRY_LEN) <= hash {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo - 1
    }

    /// Check that the hashes do not decrease.
    pub fn check_order(&self, what: &str) -> Result<()> {
        let mut prev = 0u32;
        for i in 1..self.count {
            let h = self.get(i).hash;
            ensure(h >= prev, || {
                format!("{what}: hash {h:#x} of entry {i} below {prev:#x} (unordered)")
            })?;
            prev = h;
        }
        Ok(())
    }

    /// Every entry, copied out.
    pub fn to_vec(&self) -> Vec<DxEntry> {
        (0..self.count).map(|i| self.get(i)).collect()
    }
}

/// Write `{limit, count}` and the entries at `count_offset`, zero the unused slots and
/// the dx_tail.
fn encode_dx_entries(
    block: &mut [u8],
    count_offset: usize,
    limit: usize,
    entries: &[DxEntry],
    what: &str,
) -> Result<()> {
    ensure(!entries.is_empty() && entries.len() <= limit, || {
        format!("{what}: {} entries outside 1..={limit}", entries.len())
    })?;
    if let Some(rest) = block.get_mut(count_offset..) {
        rest.fill(0);
    }
    set_le16(block, count_offset, limit as u16);
    set_le16(block, count_offset + 2, entries.len() as u16);
    for (i, e) in entries.iter().enumerate() {
        let at = count_offset + i * DX_ENTRY_LEN;
        if i > 0 {
            set_le32(block, at, e.hash);
        }
        set_le32(block, at + 4, e.block);
    }
    Ok(())
}

impl DxRoot {
    /// Decode and validate a dx root: "." (rec_len 12) and ".." (rec_len bs−12),
    /// `reserved_zero` 0, hash version 0..=2, info_length 8, no unimplemented flag,
    /// `indirect_levels` ≤ 1 (≤ 2 with `largedir`), `limit` as the kernel expects for
    /// the block size and metadata_csum, 1 ≤ count ≤ limit, hashes non-decreasing.
    /// Does not check the checksum: see [`verify_dx_csum`].
    pub fn decode(block: &[u8], has_csum: bool, largedir: bool) -> Result<DxRoot> {
        let (head, view) = Self::view(block, has_csum, largedir)?;
        view.check_order("dx root")?;
        Ok(DxRoot {
            entries: view.to_vec(),
            ..head
        })
    }

    /// What [`DxRoot::decode`] checks but the order of the hashes, with the entries
    /// left in place: the root's fields (its `entries` empty) and a view of them.
    pub fn view(block: &[u8], has_csum: bool, largedir: bool) -> Result<(DxRoot, DxEntries<'_>)> {
        need(block, DX_ROOT_COUNT_OFFSET + DX_ENTRY_LEN, "dx root")?;
        let bs = block.len();
        let rec = |off: usize| rec_len_from_disk(le16(block, off + DIRENT_REC_LEN), bs);
        let name = |off: usize, len: usize| slice(block, off + DIRENT_NAME, len);
        ensure(
            rec(0) == MIN_REC_LEN && u8_at(block, DIRENT_NAME_LEN) == 1 && name(0, 1) == Some(b"."),
            || "dx root: bad \".\" entry".into(),
        )?;
        let dd = MIN_REC_LEN;
        ensure(
            rec(dd) == bs - MIN_REC_LEN
                && u8_at(block, dd + DIRENT_NAME_LEN) == 2
                && name(dd, 2) == Some(b".."),
            || "dx root: bad \"..\" entry".into(),
        )?;
        ensure(le32(block, DX_ROOT_RESERVED_ZERO) == 0, || {
            "dx root: reserved_zero not zero".into()
        })?;
        let hash_version = u8_at(block, DX_ROOT_HASH_VERSION);
        ensure(hash_version <= 2, || {
            format!("dx root: unknown hash version {hash_version}")
        })?;
        let info_length = u8_at(block, DX_ROOT_INFO_LENGTH);
        ensure(usize::from(info_length) == DX_ROOT_INFO_LEN, || {
            format!("dx root: info_length {info_length}, expected 8")
        })?;
        let levels = u8_at(block, DX_ROOT_INDIRECT_LEVELS);
        let max = if largedir {
            DX_MAX_LEVELS_LARGEDIR
        } else {
            DX_MAX_LEVELS
        };
        ensure(levels <= max, || {
            format!("dx root: indirect_levels {levels} above {max}")
        })?;
        ensure(u8_at(block, DX_ROOT_UNUSED_FLAGS) & 1 == 0, || {
            "dx root: unimplemented hash flags".into()
        })?;
        let view = DxEntries::new(
            block,
            DX_ROOT_COUNT_OFFSET,
            dx_root_limit(bs, has_csum),
            "dx root",
        )?;
        let head = DxRoot {
            dot_inode: le32(block, DIRENT_INODE),
            dotdot_inode: le32(block, dd + DIRENT_INODE),
            hash_version,
            indirect_levels: levels,
            entries: Vec::new(),
        };
        Ok((head, view))
    }

    /// Write this root over all of `block` ("." and ".." entries, info, entries; the
    /// kernel's limit; tail checksum left 0 — call [`set_dx_csum`]).
    pub fn encode(&self, block: &mut [u8], has_csum: bool) -> Result<()> {
        need(block, DX_ROOT_COUNT_OFFSET + DX_ENTRY_LEN, "dx root")?;
        block.fill(0);
        let bs = block.len();
        let dir = FileType::Directory as u8;
        write_entry(block, 0, self.dot_inode, MIN_REC_LEN, b".", dir);
        // ".." spans the rest of the block; write only its head (the info follows).
        set_le32(block, MIN_REC_LEN + DIRENT_INODE, self.dotdot_inode);
        set_le16(
            block,
            MIN_REC_LEN + DIRENT_REC_LEN,
            rec_len_to_disk(bs - MIN_REC_LEN, bs),
        );
        set_u8(block, MIN_REC_LEN + DIRENT_NAME_LEN, 2);
        set_u8(block, MIN_REC_LEN + DIRENT_FILE_TYPE, dir);
        put(block, MIN_REC_LEN + DIRENT_NAME, b"..");
        set_u8(block, DX_ROOT_HASH_VERSION, self.hash_version);
        set_u8(block, DX_ROOT_INFO_LENGTH, DX_ROOT_INFO_LEN as u8);
        set_u8(block, DX_ROOT_INDIRECT_LEVELS, self.indirect_levels);
        encode_dx_entries(
            block,
            DX_ROOT_COUNT_OFFSET,
            dx_root_limit(bs, has_csum),
            &self.entries,
            "dx root",
        )
    }
}

impl DxNode {
    /// Decode and validate a dx node: fake dirent {inode 0, rec_len bs, name_len 0},
    /// the kernel's `limit`, 1 ≤ count ≤ limit, hashes non-decreasing. Does not check
    /// the checksum: see [`verify_dx_csum`].
    pub fn decode(block: &[u8], has_csum: bool) -> Result<DxNode> {
        let view = Self::view(block, has_csum)?;
        view.check_order("dx node")?;
        Ok(DxNode {
            entries: view.to_vec(),
        })
    }

    /// What [`DxNode::decode`] checks but the order of the hashes, with the entries
    /// left in place.
    pub fn view(block: &[u8], has_csum: bool) -> Result<DxEntries<'_>> {
        need(block, DX_NODE_COUNT_OFFSET + DX_ENTRY_LEN, "dx node")?;
        let bs = block.len();
        ensure(
            le32(block, DIRENT_INODE) == 0
                && rec_len_from_disk(le16(block, DIRENT_REC_LEN), bs) == bs
                && u8_at(block, DIRENT_NAME_LEN) == 0,
            || "dx node: bad fake dirent".into(),
        )?;
        DxEntries::new(
            block,
            DX_NODE_COUNT_OFFSET,
            dx_node_limit(bs, has_csum),
            "dx node",
        )
    }

    /// Write this node over all of `block` (tail checksum left 0 — call [`set_dx_csum`]).
    pub fn encode(&self, block: &mut [u8], has_csum: bool) -> Result<()> {
        need(block, DX_NODE_COUNT_OFFSET + DX_ENTRY_LEN, "dx node")?;
        block.fill(0);
        let bs = block.len();
        set_le16(block, DIRENT_REC_LEN, rec_len_to_disk(bs, bs));
        encode_dx_entries(
            block,
            DX_NODE_COUNT_OFFSET,
            dx_node_limit(bs, has_csum),
            &self.entries,
            "dx node",
        )
    }
}

/// Index of the child to follow for `hash`: the last entry whose hash ≤ `hash`, entry 0
/// standing for −∞ (the kernel's `dx_probe` binary search). `entries` must be sorted as
/// the decoders guarantee; returns 0 for an empty slice.
pub fn lookup_index(entries: &[DxEntry], hash: u32) -> usize {
    entries
        .get(1..)
        .map_or(0, |rest| rest.partition_point(|e| e.hash <= hash))
}

/// Whether a lookup for `hash` (low bit clear) that missed in a leaf must go on to the
/// next leaf, whose index entry has `next_index_hash`: true when that entry is a
/// collision continuation of the same hash (`next_index_hash & !1 == hash`).
pub fn collision_continues(next_index_hash: u32, hash: u32) -> bool {
    next_index_hash & !1 == hash
}

/// Offset of `{limit, count}` in an index block, recognised as the kernel's
/// `get_dx_countlimit` does: a first dirent of rec_len bs is a node (8); "." of rec_len
/// 12 followed by ".." of rec_len bs−12 with `reserved_zero` 0 and info_length 8 is a
/// root (0x20).
pub fn dx_count_offset(block: &[u8]) -> Result<usize> {
    need(block, DX_ROOT_COUNT_OFFSET + DX_ENTRY_LEN, "dx block")?;
    let bs = block.len();
    let rec0 = rec_len_from_disk(le16(block, DIRENT_REC_LEN), bs);
    if rec0 == bs {
        return Ok(DX_NODE_COUNT_OFFSET);
    }
    ensure(rec0 == MIN_REC_LEN, || {
        "dx block: neither a root nor a node".into()
    })?;
    ensure(
        rec_len_from_disk(le16(block, MIN_REC_LEN + DIRENT_REC_LEN), bs) == bs - MIN_REC_LEN,
        || "dx root: \"..\" rec_len is not bs-12".into(),
    )?;
    ensure(
        le32(block, DX_ROOT_RESERVED_ZERO) == 0
            && usize::from(u8_at(block, DX_ROOT_INFO_LENGTH)) == DX_ROOT_INFO_LEN,
        || "dx root: bad dx_root_info".into(),
    )?;
    Ok(DX_ROOT_COUNT_OFFSET)
}

/// `(count_offset, count, tail offset)` of an index block.
fn dx_layout(block: &[u8]) -> Result<(usize, usize, usize)> {
    let co = dx_count_offset(block)?;
    let limit = usize::from(le16(block, co));
    let count = usize::from(le16(block, co + 2));
    ensure(count <= limit, || {
        format!("dx block: count {count} above limit {limit}")
    })?;
    let tail = co + limit * DX_ENTRY_LEN;
    ensure(tail + DX_TAIL_LEN <= block.len(), || {
        "dx block: no space for dx tail".into()
    })?;
    Ok((co, count, tail))
}

/// Checksum of an index block: `raw(raw(raw(inode_seed, block[0..co+count*8]),
/// tail.reserved), 4 zero bytes)`. The unused entry slots are not covered.
pub fn dx_csum(block: &[u8], inode_seed: u32) -> Result<u32> {
    let (co, count, tail) = dx_layout(block)?;
    let covered = slice(block, 0, co + count * DX_ENTRY_LEN).unwrap_or(&[]);
    let reserved = slice(block, tail, 4).unwrap_or(&[]);
    Ok(raw(raw(raw(inode_seed, covered), reserved), &[0u8; 4]))
}

/// Check an index block's dx_tail checksum.
pub fn verify_dx_csum(block: &[u8], inode_seed: u32) -> Result<()> {
    let (_, _, tail) = dx_layout(block)?;
    let stored = le32(block, tail + 4);
    let computed = dx_csum(block, inode_seed)?;
    ensure(stored == computed, || {
        format!("dx block checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
    })
}

/// Store an index block's dx_tail checksum.
pub fn set_dx_csum(block: &mut [u8], inode_seed: u32) -> Result<()> {
    let (_, _, tail) = dx_layout(block)?;
    let csum = dx_csum(block, inode_seed)?;
    set_le32(block, tail + 4, csum);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csum::{fs_seed, inode_seed};
    use crate::hash::{dx_hash, HashVersion};
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    // ------------------------------------------------------------ synthetic blocks

    fn names_of(block: &[u8], tail: bool) -> Vec<Vec<u8>> {
        live_entries(block, tail)
            .map(|e| e.expect("entry").name.to_vec())
            .collect()
    }

    #[test]
    fn init_insert_lookup_remove() {
        for bs in [1024usize, 4096, 65536] {
            for tail in [false, true] {
                let mut b = vec![0xAAu8; bs];
                init_block(&mut b, 12, 2, tail);
                let all: Vec<_> = entries(&b, tail).map(|e| e.expect("entry")).collect();
                assert_eq!(all.len(), 2);
                assert_eq!(
                    (all[0].inode, all[0].rec_len, all[0].name),
                    (12, 12, &b"."[..])
                );
                let end = if tail { bs - TAIL_LEN } else { bs };
                assert_eq!(
                    (all[1].inode, all[1].rec_len, all[1].name),
                    (2, end - 12, &b".."[..])
                );
                assert_eq!(all[1].kind(), Some(FileType::Directory));
                assert_eq!(tail_present(&b), tail);

                // Fill the block; the model is the set of names inserted.
                let mut model = BTreeMap::new();
                let mut used = 24;
                for i in 0u32.. {
                    let name = format!("entry-{i}-{}", "x".repeat(i as usize % 40)).into_bytes();
                    let got = insert_entry(&mut b, 100 + i, &name, FileType::Regular, tail)
                        .expect("valid block");
                    match got {
                        Some(off) => {
                            assert_eq!(off % 4, 0);
                            used += rec_len_for(name.len());
                            model.insert(name, 100 + i);
                        }
                        None => {
                            // Full: the first fit failed, so the last entry's slack is short.
                            assert!(end - used < rec_len_for(name.len()), "room was left");
                            break;
                        }
                    }
                    check_block(&b, tail).expect("still valid");
                }
                assert!(model.len() > bs / 64);
                for (name, ino) in &model {
                    let e = lookup(&b, name, tail).expect("valid").expect("present");
                    assert_eq!(e.inode, *ino);
                    assert_eq!(e.kind(), Some(FileType::Regular));
                }
                // Remove every other name, including the first after "..".
                let victims: Vec<_> = model.keys().step_by(2).cloned().collect();
                for v in &victims {
                    let ino = remove_entry(&mut b, v, tail).expect("valid");
                    assert_eq!(ino, model.remove(v));
                    assert_eq!(remove_entry(&mut b, v, tail).expect("valid"), None);
                    check_block(&b, tail).expect("still valid");
                }
                let mut expect: BTreeSet<Vec<u8>> = model.keys().cloned().collect();
                expect.insert(b".".to_vec());
                expect.insert(b"..".to_vec());
                let got: BTreeSet<Vec<u8>> = names_of(&b, tail).into_iter().collect();
                assert_eq!(got, expect);
                // The freed space is reusable.
                assert!(insert_entry(&mut b, 7, b"again", FileType::Symlink, tail)
                    .expect("valid")
                    .is_some());
                assert_eq!(
                    lookup(&b, b"again", tail).expect("valid").map(|e| e.inode),
                    Some(7)
                );
                if tail {
                    assert!(verify_leaf(&b, 0x1234).is_err());
                    set_leaf_csum(&mut b, 0x1234).expect("tail");
                    verify_leaf(&b, 0x1234).expect("verifies");
                    assert!(verify_leaf(&b, 0x1235).is_err());
                } else {
                    assert!(set_leaf_csum(&mut b, 1).is_err());
                }
            }
        }
    }

    #[test]
    fn removing_the_first_entry_of_a_block_clears_its_inode() {
        let mut b = vec![0u8; 1024];
        init_empty_leaf(&mut b, true);
        assert_eq!(names_of(&b, true).len(), 0);
        assert_eq!(
            insert_entry(&mut b, 5, b"a", FileType::Regular, true).expect("ok"),
            Some(0)
        );
        assert_eq!(
            insert_entry(&mut b, 6, b"b", FileType::Regular, true).expect("ok"),
            Some(12)
        );
        assert_eq!(remove_entry(&mut b, b"a", true).expect("ok"), Some(5));
        let first = entries(&b, true).next().expect("one").expect("valid");
        assert_eq!((first.inode, first.rec_len), (0, 12));
        // A deleted slot of exactly the right size is reused in place.
        assert_eq!(
            insert_entry(&mut b, 9, b"c", FileType::Fifo, true).expect("ok"),
            Some(0)
        );
        assert_eq!(names_of(&b, true), vec![b"c".to_vec(), b"b".to_vec()]);
        // The typed removal gives the entry's file type too.
        assert_eq!(
            remove_entry_typed(&mut b, b"c", true).expect("ok"),
            Some((9, FileType::Fifo as u8))
        );
        assert_eq!(remove_entry_typed(&mut b, b"c", true).expect("ok"), None);
        // Removed only if it names the inode asked for.
        assert_eq!(
            remove_entry_naming(&mut b, b"b", 5, true).expect("ok"),
            None
        );
        assert_eq!(names_of(&b, true), vec![b"b".to_vec()]);
        assert_eq!(
            remove_entry_naming(&mut b, b"b", 6, true).expect("ok"),
            Some((6, FileType::Regular as u8))
        );
        assert!(names_of(&b, true).is_empty());
        insert_entry(&mut b, 6, b"b", FileType::Regular, true).expect("ok");
        // Adding a name unless present: present, added, then no room for a long one.
        assert_eq!(
            insert_new_entry(&mut b, 7, b"b", FileType::Regular, true).expect("ok"),
            Insertion::Exists
        );
        assert!(matches!(
            insert_new_entry(&mut b, 7, b"d", FileType::Regular, true).expect("ok"),
            Insertion::Added(_)
        ));
        assert_eq!(names_of(&b, true), vec![b"b".to_vec(), b"d".to_vec()]);
        let mut full = vec![0u8; 64];
        init_empty_leaf(&mut full, true);
        assert_eq!(
            insert_new_entry(&mut full, 7, &[b'x'; 60], FileType::Regular, true).expect("ok"),
            Insertion::NoRoom
        );
    }

    #[test]
    fn insert_rejects_caller_bugs() {
        let mut b = vec![0u8; 1024];
        init_empty_leaf(&mut b, false);
        assert!(insert_entry(&mut b, 0, b"a", FileType::Regular, false).is_err());
        assert!(insert_entry(&mut b, 1, b"", FileType::Regular, false).is_err());
        assert!(insert_entry(&mut b, 1, &[b'a'; 256], FileType::Regular, false).is_err());
        assert!(
            insert_entry(&mut b, 1, &[b'a'; 255], FileType::Regular, false)
                .expect("ok")
                .is_some()
        );
    }

    /// A block with one entry at offset 0 whose fields are given, followed by filler.
    fn one_entry(rec_len: u16, name_len: u8) -> Vec<u8> {
        let mut b = vec![0u8; 1024];
        init_empty_leaf(&mut b, false);
        set_le32(&mut b, 0, 11);
        set_le16(&mut b, DIRENT_REC_LEN, rec_len);
        set_u8(&mut b, DIRENT_NAME_LEN, name_len);
        b
    }

    fn first_error(b: &[u8], tail: bool) -> String {
        match entries(b, tail).find_map(|e| e.err()) {
            Some(FormatError::Corrupted { what, .. }) => what,
            other => panic!("expected a Corrupted error, got {other:?}"),
        }
    }

    #[test]
    fn bad_rec_len_and_name_len_are_corruption() {
        assert!(first_error(&one_entry(0, 1), false).contains("below minimum"));
        assert!(first_error(&one_entry(8, 0), false).contains("below minimum"));
        assert!(first_error(&one_entry(14, 1), false).contains("multiple of 4"));
        assert!(first_error(&one_entry(12, 5), false).contains("too small for name_len"));
        assert!(first_error(&one_entry(1028, 1), false).contains("crosses"));
        assert!(first_error(&one_entry(1024, 0), false).contains("inode 11 with an empty name"));
        // A last entry reaching into the tail.
        let mut b = vec![0u8; 1024];
        init_block(&mut b, 2, 2, true);
        set_le16(&mut b, 12 + DIRENT_REC_LEN, 1024 - 12);
        assert!(first_error(&b, true).contains("crosses the end of the entry area (1012)"));
        let mut b = vec![0u8; 1024];
        init_block(&mut b, 2, 2, false);
        assert!(first_error(&b, true).contains("tail missing"));
        // The iterator stops after the first error.
        assert_eq!(entries(&one_entry(0, 0), false).count(), 1);
        assert_eq!(entries(&[], false).count(), 0);
        assert!(lookup(&one_entry(0, 0), b"x", false).is_err());
        assert!(
            check_block(&one_entry(12, 1), false).is_err(),
            "filler does not fit after it"
        );
        check_block(&one_entry(1024, 255), false).expect("a 255-byte name in one record");
    }

    #[test]
    fn rec_len_encoding_for_64k_blocks() {
        assert_eq!(rec_len_from_disk(12, 4096), 12);
        assert_eq!(rec_len_from_disk(0, 4096), 0);
        assert_eq!(rec_len_from_disk(0xFFFF, 65536), 65536);
        assert_eq!(rec_len_from_disk(0, 65536), 65536);
        for len in (12..65536).step_by(4).chain([65536]) {
            assert_eq!(rec_len_from_disk(rec_len_to_disk(len, 65536), 65536), len);
        }
        assert_eq!(rec_len_to_disk(4096, 4096), 4096);
        let mut b = vec![0u8; 65536];
        init_empty_leaf(&mut b, false);
        let e = entries(&b, false).next().expect("one").expect("valid");
        assert_eq!(e.rec_len, 65536);
    }

    #[test]
    fn file_type_from_mode() {
        assert_eq!(FileType::from_mode(0o100644), FileType::Regular);
        assert_eq!(FileType::from_mode(0o040755), FileType::Directory);
        assert_eq!(FileType::from_mode(0o120777), FileType::Symlink);
        assert_eq!(FileType::from_mode(0o020600), FileType::CharDevice);
        assert_eq!(FileType::from_mode(0o060600), FileType::BlockDevice);
        assert_eq!(FileType::from_mode(0o010600), FileType::Fifo);
        assert_eq!(FileType::from_mode(0o140600), FileType::Socket);
        assert_eq!(FileType::from_mode(0), FileType::Unknown);
        for v in 0..8u8 {
            assert_eq!(FileType::from_u8(v).map(|t| t as u8), Some(v));
        }
        assert_eq!(FileType::from_u8(8), None);
    }

    #[test]
    fn lookup_index_is_last_entry_at_or_below() {
        let e = |hash, block| DxEntry { hash, block };
        let entries = [e(0, 1), e(10, 2), e(20, 3), e(20, 4), e(31, 5)];
        let cases = [
            (0, 0),
            (9, 0),
            (10, 1),
            (19, 1),
            (20, 3),
            (30, 3),
            (31, 4),
            (u32::MAX, 4),
        ];
        for (hash, want) in cases {
            assert_eq!(lookup_index(&entries, hash), want, "hash {hash}");
        }
        assert_eq!(lookup_index(&entries[..1], 5), 0);
        assert_eq!(lookup_index(&[], 5), 0);
        assert!(collision_continues(21, 20));
        assert!(collision_continues(20, 20));
        assert!(!collision_continues(23, 20));
    }

    /// The in-place view finds the child `lookup_index` finds on the decoded entries,
    /// for every hash around every entry (duplicates included); its order check is the
    /// decoder's.
    #[test]
    fn dx_view_lookup_matches_decoded_lookup() {
        for count in [1usize, 2, 3, 7, 64, 200] {
            let entries: Vec<DxEntry> = (0..count as u32)
                .map(|i| DxEntry {
                    hash: if i == 0 { 0 } else { (i / 2) * 4 + 2 },
                    block: i + 1,
                })
                .collect();
            let mut n = vec![0u8; 4096];
            DxNode {
                entries: entries.clone(),
            }
            .encode(&mut n, true)
            .expect("fits");
            let v = DxNode::view(&n, true).expect("view");
            assert_eq!(v.len(), count);
            assert_eq!(v.to_vec(), entries);
            for h in (0..count as u32 * 2 + 6).chain([u32::MAX]) {
                assert_eq!(
                    v.lookup(h),
                    lookup_index(&entries, h),
                    "count {count} hash {h}"
                );
            }
            let mut r = vec![0u8; 4096];
            let root = DxRoot {
                dot_inode: 5,
                dotdot_inode: 2,
                hash_version: 1,
                indirect_levels: 0,
                entries: entries.clone(),
            };
            root.encode(&mut r, false).expect("fits");
            let (head, rv) = DxRoot::view(&r, false, false).expect("view");
            assert_eq!((head.dot_inode, head.hash_version), (5, 1));
            assert_eq!(rv.to_vec(), entries);
            if count > 2 {
                // Out of order: the view still answers (in range), decode refuses.
                set_le32(&mut n, DX_NODE_COUNT_OFFSET + DX_ENTRY_LEN, u32::MAX);
                let v = DxNode::view(&n, true).expect("view");
                assert!(v.lookup(7) < count);
                assert!(v.check_order("dx node").is_err());
                let err = DxNode::decode(&n, true).expect_err("unordered");
                assert!(err.to_string().contains("unordered"), "{err}");
            }
        }
    }

    #[test]
    fn dx_encode_decode_and_csum() {
        for (bs, csum) in [(1024usize, true), (4096, true), (4096, false)] {
            let entries: Vec<DxEntry> = (0..40u32)
                .map(|i| DxEntry {
                    hash: i * 1000 * 2,
                    block: i + 1,
                })
                .collect();
            let root = DxRoot {
                dot_inode: 12,
                dotdot_inode: 2,
                hash_version: 1,
                indirect_levels: 1,
                entries: entries.clone(),
            };
            let mut b = vec![0xEEu8; bs];
            root.encode(&mut b, csum).expect("fits");
            assert_eq!(DxRoot::decode(&b, csum, false).expect("decodes"), root);
            assert!(
                DxRoot::decode(&b, !csum, false).is_err(),
                "limit depends on csum"
            );
            // A root is still a linear block holding "." and "..".
            assert_eq!(names_of(&b, false), vec![b".".to_vec(), b"..".to_vec()]);
            assert_eq!(dx_count_offset(&b).expect("root"), DX_ROOT_COUNT_OFFSET);
            let node = DxNode { entries };
            let mut n = vec![0x11u8; bs];
            node.encode(&mut n, csum).expect("fits");
            assert_eq!(DxNode::decode(&n, csum).expect("decodes"), node);
            assert_eq!(names_of(&n, false), Vec::<Vec<u8>>::new());
            assert_eq!(dx_count_offset(&n).expect("node"), DX_NODE_COUNT_OFFSET);
            if csum {
                for blk in [&mut b, &mut n] {
                    assert!(verify_dx_csum(blk, 77).is_err());
                    set_dx_csum(blk, 77).expect("layout");
                    verify_dx_csum(blk, 77).expect("verifies");
                    assert!(verify_dx_csum(blk, 78).is_err());
                }
            }
        }
        // Validation failures name the check.
        let mut b = vec![0u8; 1024];
        let root = DxRoot {
            dot_inode: 2,
            dotdot_inode: 2,
            hash_version: 1,
            indirect_levels: 0,
            entries: vec![DxEntry { hash: 0, block: 1 }, DxEntry { hash: 8, block: 2 }],
        };
        root.encode(&mut b, true).expect("fits");
        let err = |b: &[u8]| match DxRoot::decode(b, true, false) {
            Err(FormatError::Corrupted { what, .. }) => what,
            other => panic!("expected corruption, got {other:?}"),
        };
        let mut c = b.clone();
        set_u8(&mut c, DX_ROOT_INDIRECT_LEVELS, 2);
        assert!(err(&c).contains("indirect_levels"));
        assert_eq!(
            DxRoot::decode(&c, true, true)
                .expect("largedir")
                .indirect_levels,
            2
        );
        let mut c = b.clone();
        set_u8(&mut c, DX_ROOT_HASH_VERSION, 3);
        assert!(err(&c).contains("hash version"));
        let mut c = b.clone();
        set_u8(&mut c, DX_ROOT_INFO_LENGTH, 9);
        assert!(err(&c).contains("info_length"));
        let mut c = b.clone();
        set_le16(&mut c, DX_ROOT_COUNT_OFFSET + 2, 124);
        assert!(err(&c).contains("count"));
        let mut c = b.clone();
        set_le16(&mut c, DX_ROOT_COUNT_OFFSET + 2, 0);
        assert!(err(&c).contains("count"));
        let mut c = b.clone();
        set_le16(&mut c, DX_ROOT_COUNT_OFFSET, 124);
        assert!(err(&c).contains("limit"));
        let mut c = b.clone();
        set_le32(&mut c, DX_ROOT_COUNT_OFFSET + 8, 0);
        DxRoot::decode(&c, true, false).expect("hash 0 after the header slot is ordered");
        let mut c = b.clone();
        root.encode(&mut c, true).expect("fits");
        let three = DxRoot {
            entries: vec![
                DxEntry { hash: 0, block: 1 },
                DxEntry { hash: 8, block: 2 },
                DxEntry { hash: 4, block: 3 },
            ],
            ..root.clone()
        };
        three.encode(&mut c, true).expect("fits");
        assert!(err(&c).contains("unordered"));
        let too_many = DxRoot {
            entries: vec![DxEntry { hash: 0, block: 1 }; 124],
            ..root
        };
        assert!(too_many.encode(&mut c, true).is_err());
    }

    // ------------------------------------------------------------ fuzz

    /// Exercise every decoder and editor on `block`; none may panic.
    fn poke_everything(block: &[u8]) {
        for tail in [false, true] {
            let _ = entries(block, tail).count();
            let _ = check_block(block, tail);
            let _ = lookup(block, b"x", tail);
            let mut m = block.to_vec();
            let _ = insert_entry(&mut m, 3, b"newname", FileType::Regular, tail);
            let _ = insert_new_entry(&mut m, 4, b"newname", FileType::Regular, tail);
            let _ = remove_entry(&mut m, b"x", tail);
            let _ = check_block(&m, tail);
        }
        let _ = tail_present(block);
        let _ = verify_leaf(block, 5);
        let _ = verify_leaf_csum(block, 5);
        for csum in [false, true] {
            let _ = DxRoot::decode(block, csum, csum);
            let _ = DxNode::decode(block, csum);
        }
        let _ = dx_count_offset(block);
        let _ = verify_dx_csum(block, 5);
        let mut m = block.to_vec();
        let _ = set_dx_csum(&mut m, 5);
        let _ = set_leaf_csum(&mut m, 5);
    }

    proptest! {
        #[test]
        fn decoders_never_panic_on_random_bytes(block in proptest::collection::vec(any::<u8>(), 0..1100)) {
            poke_everything(&block);
        }

        #[test]
        fn decoders_never_panic_on_mutated_valid_blocks(
            kind in 0u8..4,
            edits in proptest::collection::vec((0usize..1024, any::<u8>()), 1..8),
        ) {
            let mut b = vec![0u8; 1024];
            match kind {
                0 => {
                    init_block(&mut b, 2, 2, true);
                    for i in 0..20u32 {
                        let _ = insert_entry(&mut b, 20 + i, format!("n{i}").as_bytes(), FileType::Regular, true);
                    }
                }
                1 => init_empty_leaf(&mut b, true),
                2 => {
                    let entries = (0..30u32).map(|i| DxEntry { hash: i << 20, block: i }).collect();
                    let r = DxRoot { dot_inode: 2, dotdot_inode: 2, hash_version: 1, indirect_levels: 1, entries };
                    r.encode(&mut b, true).expect("fits");
                }
                _ => {
                    let entries = (0..30u32).map(|i| DxEntry { hash: i << 20, block: i }).collect();
                    DxNode { entries }.encode(&mut b, true).expect("fits");
                }
            }
            for (off, v) in edits {
                b[off] = v;
            }
            poke_everything(&b);
        }
    }

    /// Every single header edit of every entry (inode cleared, rec_len or name_len
    /// moved by -8..=8) of leaves with and without a tail: the fast walks answer what
    /// the checked walks answer — lookup and removal of every name in the block and of
    /// one that is not, and where records of several sizes would be inserted.
    #[test]
    fn fast_walks_agree_after_every_single_header_edit() {
        for tail in [false, true] {
            for empty in [false, true] {
                let mut base = vec![0u8; 512];
                if empty {
                    init_empty_leaf(&mut base, tail);
                } else {
                    init_block(&mut base, 2, 2, tail);
                }
                for i in 0..12u32 {
                    insert_entry(
                        &mut base,
                        20 + i,
                        format!("name{i}").as_bytes(),
                        FileType::Regular,
                        tail,
                    )
                    .expect("fits");
                }
                remove_entry(&mut base, b"name3", tail).expect("present");
                let offs: Vec<usize> = entries(&base, tail)
                    .map(|e| e.expect("valid").offset)
                    .collect();
                let mut probes: Vec<Vec<u8>> =
                    (0..12).map(|i| format!("name{i}").into_bytes()).collect();
                probes.extend([b"absent".to_vec(), b".".to_vec(), b"..".to_vec()]);
                for &off in &offs {
                    for field in 0..3 {
                        for d in -8i16..=8 {
                            let mut b = base.clone();
                            match field {
                                0 => b[off..off + 4].fill(0),
                                1 => {
                                    let r = le16(&b, off + 4).wrapping_add_signed(d);
                                    b[off + 4..off + 6].copy_from_slice(&r.to_le_bytes());
                                }
                                _ => b[off + 6] = b[off + 6].wrapping_add_signed(d as i8),
                            }
                            let at = format!("tail {tail}, empty leaf {empty}, entry at {off}, field {field}, delta {d}");
                            for p in &probes {
                                assert_eq!(
                                    answer(lookup(&b, p, tail)),
                                    answer(lookup_checked(&b, p, tail)),
                                    "{at}, name {:?}",
                                    String::from_utf8_lossy(p)
                                );
                                assert_eq!(
                                    errs(removal(&b, p, tail)),
                                    errs(removal_checked(&b, p, tail)),
                                    "{at}, removing {:?}",
                                    String::from_utf8_lossy(p)
                                );
                                let mut ours = b.clone();
                                let got = insert_new_entry(&mut ours, 99, p, FileType::Fifo, tail);
                                assert_eq!(
                                    errs(got.map(|i| (i, ours))),
                                    errs(checked_insert_new(&b, p, tail)),
                                    "{at}, adding {:?} unless present",
                                    String::from_utf8_lossy(p)
                                );
                            }
                            for need in [12, 16, 20, 24, 64, 200, 400] {
                                assert_eq!(
                                    errs(insert_spot(&b, need, tail)),
                                    errs(insert_spot_checked(&b, need, tail)),
                                    "{at}, inserting {need} bytes"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// [`insert_new_entry`] as a checked lookup and then a checked insert: the outcome
    /// and the block after it.
    fn checked_insert_new(b: &[u8], name: &[u8], tail: bool) -> Result<(Insertion, Vec<u8>)> {
        let mut m = b.to_vec();
        if lookup_checked(&m, name, tail)?.is_some() {
            return Ok((Insertion::Exists, m));
        }
        let i = match insert_spot_checked(&m, rec_len_for(name.len()), tail)? {
            Some(spot) => Insertion::Added(put_entry(&mut m, spot, 99, name, FileType::Fifo)),
            None => Insertion::NoRoom,
        };
        Ok((i, m))
    }

    /// A result with its error as its message, comparable across the two walks.
    fn errs<T>(r: Result<T>) -> std::result::Result<T, String> {
        r.map_err(|e| e.to_string())
    }

    /// What a lookup answers, comparable across the two walks (errors by message).
    fn answer(
        r: Result<Option<DirEntry<'_>>>,
    ) -> std::result::Result<Option<(u32, usize, Vec<u8>)>, String> {
        r.map(|o| o.map(|e| (e.inode, e.offset, e.name.to_vec())))
            .map_err(|e| e.to_string())
    }

    proptest! {
        /// The fast walks (lookup, removal, insert spot) give what the checked walks
        /// give — the answer, or the same error — on leaves built by inserts and
        /// removals, with and without a tail, then with headers and bytes changed.
        #[test]
        fn fast_walks_agree_with_the_checked_walks(
            tail in any::<bool>(),
            empty_leaf in any::<bool>(),
            names in proptest::collection::vec(0u32..60, 0..40),
            removed in proptest::collection::vec(0u32..60, 0..10),
            header_edits in proptest::collection::vec((0usize..48, 0u8..3, -8i8..9), 0..3),
            edits in proptest::collection::vec((0usize..1024, any::<u8>()), 0..3),
            probe in 0u32..48,
        ) {
            let mut b = vec![0u8; 1024];
            // An empty leaf's first entry keeps its name when removed (inode 0).
            if empty_leaf {
                init_empty_leaf(&mut b, tail);
            } else {
                init_block(&mut b, 2, 2, tail);
            }
            for (i, n) in names.iter().enumerate() {
                let _ = insert_entry(&mut b, 20 + i as u32, format!("n{n}").as_bytes(), FileType::Regular, tail);
            }
            for n in &removed {
                let _ = remove_entry(&mut b, format!("n{n}").as_bytes(), tail);
            }
            // The k-th entry's header: its inode cleared, its rec_len or name_len
            // moved by a few bytes; then any byte.
            for (k, field, d) in header_edits {
                let offs: Vec<usize> = entries(&b, tail).map_while(|e| e.ok()).map(|e| e.offset).collect();
                if let Some(&off) = offs.get(k % offs.len().max(1)) {
                    match field {
                        0 => b[off..off + 4].fill(0),
                        1 => {
                            let r = le16(&b, off + 4).wrapping_add_signed(i16::from(d));
                            b[off + 4..off + 6].copy_from_slice(&r.to_le_bytes());
                        }
                        _ => b[off + 6] = b[off + 6].wrapping_add_signed(d),
                    }
                }
            }
            for (off, v) in edits {
                b[off] = v;
            }
            // Mostly a name that was inserted.
            let pick = match names.get(probe as usize) {
                Some(n) => format!("n{n}"),
                None => format!("n{probe}"),
            };
            for name in [pick, ".".into(), "..".into()] {
                let want = answer(lookup_checked(&b, name.as_bytes(), tail));
                prop_assert_eq!(answer(lookup(&b, name.as_bytes(), tail)), want);
                let want = errs(removal_checked(&b, name.as_bytes(), tail));
                prop_assert_eq!(errs(removal(&b, name.as_bytes(), tail)), want);
            }
            for need in [12, 20, 64, 300] {
                prop_assert_eq!(errs(insert_spot(&b, need, tail)), errs(insert_spot_checked(&b, need, tail)));
            }
        }
    }

    #[test]
    fn dx_decoders_on_odd_sizes() {
        for len in 0..64 {
            poke_everything(&vec![0u8; len]);
            poke_everything(&vec![0xFFu8; len]);
        }
    }

    // ------------------------------------------------------------ real images

    /// A scratch directory removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!("rext4-dir-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("create temp dir");
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A kernel loop mount, unmounted on drop (also when the test panics).
    struct Mount(PathBuf);
    impl Mount {
        /// `Err` (the reason to skip) when the mount cannot be made here.
        fn new(img: &Path, at: &Path) -> std::result::Result<Mount, String> {
            rext4_testkit::can_loop_mount()?;
            std::fs::create_dir_all(at).expect("mount point");
            let out = Command::new("mount")
                .arg("-o")
                .arg("loop")
                .arg(img)
                .arg(at)
                .output();
            match out {
                Ok(o) if o.status.success() => Ok(Mount(at.to_path_buf())),
                Ok(o) => Err(format!(
                    "mount failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => Err(format!("cannot run mount: {e}")),
            }
        }
    }
    impl Drop for Mount {
        fn drop(&mut self) {
            for _ in 0..20 {
                let ok = Command::new("umount")
                    .arg(&self.0)
                    .status()
                    .map(|s| s.success());
                if matches!(ok, Ok(true)) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
            }
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }

    /// Run a tool; `Err` if it cannot be run (not installed).
    fn run<S: AsRef<OsStr>>(cmd: &str, args: &[S]) -> std::result::Result<Output, String> {
        Command::new(cmd)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {cmd}: {e}"))
    }

    /// `Err` (the reason to skip) when a tool of e2fsprogs is missing.
    fn have_e2fsprogs() -> std::result::Result<(), String> {
        for t in ["mkfs.ext4", "debugfs", "e2fsck", "dumpe2fs"] {
            run(t, &["-V"])?;
        }
        Ok(())
    }

    fn mkfs(img: &Path, block_size: usize, features: Option<&str>) {
        let bs = block_size.to_string();
        let mut args = vec![
            OsStr::new("-q"),
            OsStr::new("-F"),
            OsStr::new("-b"),
            OsStr::new(&bs),
        ];
        if let Some(f) = features {
            args.extend([OsStr::new("-O"), OsStr::new(f)]);
        }
        args.extend([img.as_os_str(), OsStr::new("64M")]);
        let o = run("mkfs.ext4", &args).expect("mkfs.ext4");
        assert!(
            o.status.success(),
            "mkfs: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    /// Run a debugfs command script (raw bytes, so names may hold any byte but '\n').
    fn debugfs_script(img: &Path, script: &[u8], write: bool) -> Vec<u8> {
        let file = img.with_extension("cmds");
        std::fs::write(&file, script).expect("write script");
        let mut args = vec![OsStr::new("-f"), file.as_os_str()];
        if write {
            args.insert(0, OsStr::new("-w"));
        }
        args.push(img.as_os_str());
        let o = run("debugfs", &args).expect("debugfs");
        assert!(o.status.success());
        o.stdout
    }

    fn debugfs_cmd(img: &Path, cmd: &str) -> String {
        let o = run(
            "debugfs",
            &[OsStr::new("-R"), OsStr::new(cmd), img.as_os_str()],
        )
        .expect("debugfs");
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The superblock facts the directory code needs, read from the image.
    struct Fs {
        img: PathBuf,
        bs: usize,
        has_csum: bool,
        largedir: bool,
        csum_seed: u32,
        hash_seed: [u32; 4],
        s_flags: u32,
    }

    fn fs_info(img: &Path) -> Fs {
        let data = std::fs::read(img).expect("read image");
        let sb = &data[1024..2048];
        let incompat = le32(sb, 0x60);
        let ro_compat = le32(sb, 0x64);
        let uuid: [u8; 16] = sb[0x68..0x78].try_into().expect("16");
        let csum_seed = fs_seed(&uuid, (incompat & 0x2000 != 0).then(|| le32(sb, 0x270)));
        let hash_seed = [
            le32(sb, 0xEC),
            le32(sb, 0xF0),
            le32(sb, 0xF4),
            le32(sb, 0xF8),
        ];
        // Cross-check the seed bytes against dumpe2fs' "Directory Hash Seed".
        let o = run("dumpe2fs", &[OsStr::new("-h"), img.as_os_str()]).expect("dumpe2fs");
        let text = String::from_utf8_lossy(&o.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("Directory Hash Seed:"))
            .expect("seed line");
        let hex: String = line["Directory Hash Seed:".len()..]
            .trim()
            .chars()
            .filter(|c| *c != '-')
            .collect();
        let bytes: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).expect("hex"))
            .collect();
        assert_eq!(bytes, sb[0xEC..0xFC].to_vec());
        Fs {
            img: img.to_path_buf(),
            bs: 1024 << le32(sb, 0x18),
            has_csum: ro_compat & 0x400 != 0,
            largedir: incompat & 0x4000 != 0,
            csum_seed,
            hash_seed,
            s_flags: le32(sb, 0x160),
        }
    }

    /// A directory's inode facts and its blocks (logical order), from debugfs.
    struct Dir {
        seed: u32,
        indexed: bool,
        blocks: Vec<Vec<u8>>,
        physical: Vec<u64>,
    }

    fn read_dir(fs: &Fs, path: &str) -> Dir {
        let stat = debugfs_cmd(&fs.img, &format!("stat {path}"));
        let field = |key: &str| -> String {
            let at = stat.find(key).unwrap_or_else(|| panic!("{key} in {stat}")) + key.len();
            stat[at..]
                .split_whitespace()
                .next()
                .expect("value")
                .to_string()
        };
        let ino: u32 = field("Inode:").parse().expect("ino");
        let generation: u32 = field("Generation:").parse().expect("generation");
        let flags =
            u32::from_str_radix(field("Flags:").trim_start_matches("0x"), 16).expect("flags");
        let physical: Vec<u64> = debugfs_cmd(&fs.img, &format!("blocks {path}"))
            .split_whitespace()
            .map(|s| s.parse().expect("block number"))
            .collect();
        assert!(!physical.is_empty());
        let data = std::fs::read(&fs.img).expect("read image");
        let blocks = physical
            .iter()
            .map(|&p| data[p as usize * fs.bs..(p as usize + 1) * fs.bs].to_vec())
            .collect();
        Dir {
            seed: inode_seed(fs.csum_seed, ino, generation),
            indexed: flags & 0x1000 != 0,
            blocks,
            physical,
        }
    }

    #[derive(Debug, Default)]
    struct Report {
        names: BTreeSet<Vec<u8>>,
        levels: u8,
        leaves: Vec<u32>,
        nodes: Vec<u32>,
        /// Names outside their leaf's hash range (must be 0 with the right hash).
        misplaced: usize,
        /// Names the index descent did not find.
        not_found: usize,
    }

    /// Walk the index below `entries` (bounds `[lo, hi)`) and check every block.
    #[allow(clippy::too_many_arguments)]
    fn walk(
        fs: &Fs,
        dir: &Dir,
        version: HashVersion,
        entries: &[DxEntry],
        levels_left: u8,
        lo: u32,
        hi: Option<u32>,
        rep: &mut Report,
    ) {
        for (i, e) in entries.iter().enumerate() {
            let child_lo = if i == 0 { lo } else { e.hash };
            let child_hi = entries.get(i + 1).map(|n| n.hash).or(hi);
            if i > 0 {
                assert!(
                    e.hash >= lo && u64::from(e.hash) < hi.map_or(1 << 32, u64::from),
                    "index hash outside parent range"
                );
            }
            let blk = &dir.blocks[e.block as usize];
            if levels_left > 0 {
                rep.nodes.push(e.block);
                let node = DxNode::decode(blk, fs.has_csum).expect("dx node decodes");
                if fs.has_csum {
                    verify_dx_csum(blk, dir.seed).expect("dx node csum");
                }
                walk(
                    fs,
                    dir,
                    version,
                    &node.entries,
                    levels_left - 1,
                    child_lo,
                    child_hi,
                    rep,
                );
            } else {
                rep.leaves.push(e.block);
                if fs.has_csum {
                    verify_leaf(blk, dir.seed).expect("leaf verifies");
                }
                for d in live_entries(blk, fs.has_csum) {
                    let d = d.expect("entry");
                    let h = dx_hash(d.name, version, &fs.hash_seed).0;
                    if h < child_lo & !1 || child_hi.is_some_and(|hi| h >= hi) {
                        rep.misplaced += 1;
                    }
                    assert!(rep.names.insert(d.name.to_vec()), "duplicate name");
                }
            }
        }
    }

    /// Find `name` by descending the index as the kernel does.
    fn tree_lookup(
        fs: &Fs,
        dir: &Dir,
        root: &DxRoot,
        version: HashVersion,
        name: &[u8],
    ) -> Option<u32> {
        let h = dx_hash(name, version, &fs.hash_seed).0;
        let mut entries = root.entries.clone();
        for _ in 0..root.indirect_levels {
            let at = lookup_index(&entries, h);
            entries = DxNode::decode(&dir.blocks[entries[at].block as usize], fs.has_csum)
                .expect("node")
                .entries;
        }
        let mut at = lookup_index(&entries, h);
        loop {
            let leaf = &dir.blocks[entries[at].block as usize];
            if let Some(e) = lookup(leaf, name, fs.has_csum).expect("leaf parses") {
                return Some(e.inode);
            }
            match entries.get(at + 1) {
                Some(next) if collision_continues(next.hash, h) => at += 1,
                _ => return None,
            }
        }
    }

    /// Check a directory completely; `s_flags` overrides the superblock's to test the
    /// check's own sensitivity.
    fn check_dir(fs: &Fs, dir: &Dir, s_flags: u32) -> Report {
        let mut rep = Report::default();
        if !dir.indexed {
            for (i, b) in dir.blocks.iter().enumerate() {
                if fs.has_csum {
                    verify_leaf(b, dir.seed).expect("linear leaf verifies");
                }
                for e in live_entries(b, fs.has_csum) {
                    let e = e.expect("entry");
                    if i == 0 && e.offset < 24 {
                        assert_eq!(e.name, if e.offset == 0 { &b"."[..] } else { &b".."[..] });
                        continue;
                    }
                    assert!(rep.names.insert(e.name.to_vec()), "duplicate name");
                }
            }
            return rep;
        }
        let root_blk = &dir.blocks[0];
        let root = DxRoot::decode(root_blk, fs.has_csum, fs.largedir).expect("dx root decodes");
        if fs.has_csum {
            verify_dx_csum(root_blk, dir.seed).expect("dx root csum");
        }
        assert_eq!(
            names_of(root_blk, false),
            vec![b".".to_vec(), b"..".to_vec()]
        );
        rep.levels = root.indirect_levels;
        let version = HashVersion::effective(root.hash_version, s_flags).expect("known hash");
        walk(
            fs,
            dir,
            version,
            &root.entries,
            root.indirect_levels,
            0,
            None,
            &mut rep,
        );
        // Every block other than the root is referenced exactly once.
        let mut all: Vec<u32> = rep.leaves.iter().chain(&rep.nodes).copied().collect();
        all.sort_unstable();
        let want: Vec<u32> = (1..dir.blocks.len() as u32).collect();
        assert_eq!(all, want, "index does not cover each block once");
        for name in rep.names.clone() {
            if tree_lookup(fs, dir, &root, version, &name).is_none() {
                rep.not_found += 1;
            }
        }
        rep
    }

    /// Flip every bit of a leaf (all covered) and of the checksummed part of index
    /// blocks: each flip must be caught. The unused dx slots are not covered by design.
    fn check_bit_flips(fs: &Fs, dir: &Dir, rep: &Report) {
        assert!(fs.has_csum);
        let leaf = if dir.indexed {
            rep.leaves[0] as usize
        } else {
            0
        };
        let mut b = dir.blocks[leaf].clone();
        verify_leaf(&b, dir.seed).expect("clean");
        for bit in 0..b.len() * 8 {
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(
                verify_leaf(&b, dir.seed).is_err(),
                "leaf bit {bit} flip not caught"
            );
            b[bit / 8] ^= 1 << (bit % 8);
        }
        if !dir.indexed {
            return;
        }
        let mut index_blocks = vec![0usize];
        index_blocks.extend(rep.nodes.first().map(|&n| n as usize));
        for i in index_blocks {
            let mut b = dir.blocks[i].clone();
            let co = dx_count_offset(&b).expect("dx block");
            let count = usize::from(le16(&b, co + 2));
            let tail = co + usize::from(le16(&b, co)) * DX_ENTRY_LEN;
            let covered = (0..co + count * 8).chain(tail..tail + DX_TAIL_LEN);
            let decode_and_verify = |b: &[u8]| -> Result<()> {
                if i == 0 {
                    DxRoot::decode(b, true, fs.largedir)?;
                } else {
                    DxNode::decode(b, true)?;
                }
                verify_dx_csum(b, dir.seed)
            };
            decode_and_verify(&b).expect("clean");
            for byte in covered {
                for bit in 0..8 {
                    b[byte] ^= 1 << bit;
                    assert!(
                        decode_and_verify(&b).is_err(),
                        "dx block {i} byte {byte} bit {bit}"
                    );
                    b[byte] ^= 1 << bit;
                }
            }
        }
    }

    /// Re-encode the decoded index blocks and compare the checksummed bytes.
    fn check_dx_reencode(fs: &Fs, dir: &Dir, rep: &Report) {
        let mut index_blocks = vec![0u32];
        index_blocks.extend(&rep.nodes);
        for i in index_blocks {
            let orig = &dir.blocks[i as usize];
            let mut b = vec![0u8; fs.bs];
            let (co, count, limit) = if i == 0 {
                let root = DxRoot::decode(orig, fs.has_csum, fs.largedir).expect("root");
                root.encode(&mut b, fs.has_csum).expect("encode");
                assert_eq!(
                    DxRoot::decode(&b, fs.has_csum, fs.largedir).expect("again"),
                    root
                );
                (
                    DX_ROOT_COUNT_OFFSET,
                    root.entries.len(),
                    dx_root_limit(fs.bs, fs.has_csum),
                )
            } else {
                let node = DxNode::decode(orig, fs.has_csum).expect("node");
                node.encode(&mut b, fs.has_csum).expect("encode");
                assert_eq!(DxNode::decode(&b, fs.has_csum).expect("again"), node);
                (
                    DX_NODE_COUNT_OFFSET,
                    node.entries.len(),
                    dx_node_limit(fs.bs, fs.has_csum),
                )
            };
            let n = co + count * DX_ENTRY_LEN;
            assert_eq!(b[..n], orig[..n], "index block {i} re-encodes differently");
            if fs.has_csum {
                // The kernel leaves stale bytes in dx_tail.reserved (covered by the
                // checksum); the encoder writes zeros. Carry them over to compare.
                let tail = co + limit * DX_ENTRY_LEN;
                b[tail..tail + 4].copy_from_slice(&orig[tail..tail + 4]);
                set_dx_csum(&mut b, dir.seed).expect("csum");
                assert_eq!(b[tail + 4..tail + 8], orig[tail + 4..tail + 8], "dx csum");
            }
        }
    }

    fn e2fsck_clean(img: &Path) {
        let o = run("e2fsck", &[OsStr::new("-fn"), img.as_os_str()]).expect("e2fsck");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "e2fsck -fn: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let noise = out
            .lines()
            .filter(|l| !l.starts_with("Pass ") && !l.contains(" files ("))
            .count();
        assert_eq!(noise, 0, "e2fsck -fn reported: {out}");
    }

    /// `n` distinct names, about `long` bytes each, some with bytes >= 0x80 (which hash
    /// differently signed and unsigned). Never '/', NUL, whitespace or quotes.
    fn make_names(n: usize, long: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                let mut v = format!("{i:05}_").into_bytes();
                if i % 3 == 0 {
                    v.extend_from_slice(&[0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF, 0x80]);
                }
                while v.len() < long {
                    v.push(b'a' + (v.len() * 7 + i) as u8 % 26);
                }
                v
            })
            .collect()
    }

    fn debugfs_populate(img: &Path, dir: &str, names: &[Vec<u8>], empty: &Path) {
        let mut script = format!("mkdir {dir}\n").into_bytes();
        for n in names {
            script.extend_from_slice(format!("write {} {dir}/", empty.display()).as_bytes());
            script.extend_from_slice(n);
            script.push(b'\n');
        }
        debugfs_script(img, &script, true);
    }

    #[test]
    fn debugfs_linear_dirs() {
        if let Err(why) = have_e2fsprogs() {
            rext4_testkit::skip(&why);
            return;
        }
        for bs in [1024usize, 4096] {
            let tmp = TempDir::new(&format!("linear{bs}"));
            let img = tmp.0.join("fs.img");
            let empty = tmp.0.join("empty");
            std::fs::write(&empty, b"").expect("empty file");
            mkfs(&img, bs, None);
            let names = make_names(300, 12);
            debugfs_populate(&img, "lin", &names, &empty);
            // Delete some, leaving inode-0 slots and merged records.
            let mut script = b"mkdir emptydir\n".to_vec();
            for n in names.iter().step_by(7) {
                script.extend_from_slice(b"rm lin/");
                script.extend_from_slice(n);
                script.push(b'\n');
            }
            debugfs_script(&img, &script, true);
            let expect: BTreeSet<Vec<u8>> = names
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 7 != 0)
                .map(|(_, n)| n.clone())
                .collect();

            let fs = fs_info(&img);
            assert!(fs.has_csum && fs.bs == bs);
            let dir = read_dir(&fs, "/lin");
            assert!(!dir.indexed && dir.blocks.len() > 1);
            let rep = check_dir(&fs, &dir, fs.s_flags);
            assert_eq!(rep.names, expect);
            check_bit_flips(&fs, &dir, &rep);

            // init_block reproduces debugfs' empty directory byte for byte.
            let e = read_dir(&fs, "/emptydir");
            assert_eq!(e.blocks.len(), 1);
            let mut b = vec![0xFFu8; bs];
            let self_ino = le32(&e.blocks[0], 0);
            init_block(&mut b, self_ino, 2, true);
            set_leaf_csum(&mut b, e.seed).expect("tail");
            assert_eq!(b, e.blocks[0]);

            // Rename with the editors, write back, and let e2fsck judge.
            let mut blk = dir.blocks[0].clone();
            let victim = names_of(&blk, true)[2].clone();
            let old = lookup(&blk, &victim, true)
                .expect("valid")
                .expect("present");
            let (ino, ftype) = (old.inode, old.kind().expect("type"));
            assert_eq!(
                remove_entry(&mut blk, &victim, true).expect("valid"),
                Some(ino)
            );
            let new_name = b"renamed-by-rext4".to_vec();
            assert!(insert_entry(&mut blk, ino, &new_name, ftype, true)
                .expect("valid")
                .is_some());
            set_leaf_csum(&mut blk, dir.seed).expect("tail");
            verify_leaf(&blk, dir.seed).expect("verifies");
            let mut data = std::fs::read(&img).expect("image");
            let at = dir.physical[0] as usize * bs;
            data[at..at + bs].copy_from_slice(&blk);
            std::fs::write(&img, &data).expect("write image");
            e2fsck_clean(&img);
            let after = read_dir(&fs, "/lin");
            let rep = check_dir(&fs, &after, fs.s_flags);
            let mut expect2 = expect.clone();
            expect2.remove(&victim);
            expect2.insert(new_name);
            assert_eq!(rep.names, expect2);
        }
    }

    #[test]
    fn e2fsck_built_htrees() {
        if let Err(why) = have_e2fsprogs() {
            rext4_testkit::skip(&why);
            return;
        }
        for (bs, want_levels, features) in [
            (4096usize, 0u8, None),
            (1024, 1, None),
            (1024, 1, Some("^metadata_csum")),
        ] {
            let tmp = TempDir::new(&format!("e2fsckD{bs}"));
            let img = tmp.0.join("fs.img");
            let empty = tmp.0.join("empty");
            std::fs::write(&empty, b"").expect("empty file");
            mkfs(&img, bs, features);
            let names = make_names(5000, 40);
            debugfs_populate(&img, "big", &names, &empty);
            let o = run("e2fsck", &[OsStr::new("-fyD"), img.as_os_str()]).expect("e2fsck");
            assert!(
                o.status.code().is_some_and(|c| c <= 1),
                "e2fsck -fyD failed"
            );
            let fs = fs_info(&img);
            let dir = read_dir(&fs, "/big");
            assert!(dir.indexed, "e2fsck -D indexes a 5000-name directory");
            let rep = check_dir(&fs, &dir, fs.s_flags);
            assert_eq!(rep.levels, want_levels);
            assert_eq!((rep.misplaced, rep.not_found), (0, 0));
            assert_eq!(rep.names, names.iter().cloned().collect::<BTreeSet<_>>());
            assert_eq!(fs.has_csum, features.is_none());
            if fs.has_csum {
                check_bit_flips(&fs, &dir, &rep);
            } else {
                // Without metadata_csum the limits are one larger and leaves have no tail.
                assert_eq!(le16(&dir.blocks[0], DX_ROOT_COUNT_OFFSET), 124);
                assert!(!tail_present(&dir.blocks[rep.leaves[0] as usize]));
            }
            check_dx_reencode(&fs, &dir, &rep);
            eprintln!(
                "bs {bs} csum {}: {} leaves, {} nodes",
                fs.has_csum,
                rep.leaves.len(),
                rep.nodes.len()
            );
        }
    }

    /// Create `names` in a new directory with the kernel; `Err` (the reason to skip) if
    /// mounting is impossible.
    fn kernel_populate(
        tmp: &TempDir,
        img: &Path,
        names: &[Vec<u8>],
    ) -> std::result::Result<(), String> {
        let mnt = tmp.0.join("mnt");
        let m = Mount::new(img, &mnt)?;
        let d = m.0.join("big");
        std::fs::create_dir(&d).expect("mkdir");
        for n in names {
            std::fs::File::create(d.join(OsStr::from_bytes(n))).expect("create");
        }
        drop(m);
        Ok(())
    }

    #[test]
    fn kernel_built_htrees() {
        if let Err(why) = have_e2fsprogs() {
            rext4_testkit::skip(&why);
            return;
        }
        // (block size, unsigned hash flag, expected levels)
        for (bs, unsigned, want_levels) in
            [(4096usize, false, 0u8), (1024, false, 1), (1024, true, 1)]
        {
            let tmp = TempDir::new(&format!("kernel{bs}{unsigned}"));
            let img = tmp.0.join("fs.img");
            mkfs(&img, bs, None);
            if unsigned {
                debugfs_script(&img, b"ssv flags 2\n", true);
            }
            let names = make_names(5000, 40);
            if let Err(why) = kernel_populate(&tmp, &img, &names) {
                rext4_testkit::skip(&why);
                return;
            }
            let fs = fs_info(&img);
            assert_eq!(fs.s_flags & 3, if unsigned { 2 } else { 1 });
            let dir = read_dir(&fs, "/big");
            assert!(dir.indexed, "the kernel indexes a 5000-name directory");
            let rep = check_dir(&fs, &dir, fs.s_flags);
            assert_eq!(rep.levels, want_levels);
            assert_eq!((rep.misplaced, rep.not_found), (0, 0));
            assert_eq!(rep.names, names.iter().cloned().collect::<BTreeSet<_>>());
            check_bit_flips(&fs, &dir, &rep);
            check_dx_reencode(&fs, &dir, &rep);
            // The check is sensitive to signedness: the other flavour misplaces names.
            eprintln!(
                "kernel bs {bs} unsigned {unsigned}: {} leaves, {} nodes",
                rep.leaves.len(),
                rep.nodes.len()
            );
            let wrong = check_dir(&fs, &dir, fs.s_flags ^ 3);
            assert!(wrong.misplaced > 0 && wrong.not_found > 0, "{wrong:?}");
        }
    }
}
