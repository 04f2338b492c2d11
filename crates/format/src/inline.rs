//! Inline data (incompat `inline_data`, inode flag `INLINE_DATA_FL`): a small file's or
//! directory's bytes kept in the inode — the first 60 in `i_block`, the rest in the
//! value of the in-inode xattr `system.data` (name index 7, name "data"), which every
//! inline inode carries, possibly empty. Facts from the kernel's `fs/ext4/inline.c` and
//! e2fsprogs' `lib/ext2fs/inline_data.c`.
//!
//! A file's data is `i_block ++ value`, cut at `i_size` (which may not pass
//! `60 + value length`). A directory's is two areas of entries: `i_block[4..60]` after
//! the 4-byte parent inode number, and the whole value; the records of each area cover
//! it exactly (no "." or "..", no tail, no checksum), and `i_size` is `60 + value
//! length`. When it outgrows that, a directory becomes one block: ".", "..", then the
//! two areas' records in a row, the last one stretched to the block's end.
//!
//! Nothing here does I/O; decoders never panic on any bytes.

use crate::bytes::{le32, set_le16, set_le32};
use crate::dir::{self, rec_len_to_disk, DirEntry};
use crate::xattr::{self, Xattr, INDEX_SYSTEM};
use crate::{FormatError, Result};

/// Bytes of inline data `i_block` holds (EXT4_MIN_INLINE_DATA_SIZE).
pub const I_BLOCK_BYTES: usize = 60;
/// An inline directory's first bytes: the parent's inode number.
pub const DOTDOT_BYTES: usize = 4;
/// The xattr holding the bytes past `i_block`: `system.data`.
pub const XATTR_INDEX: u8 = INDEX_SYSTEM;
pub const XATTR_NAME: &[u8] = b"data";

/// Whether `a` is the `system.data` attribute.
pub fn is_data_attr(a: &Xattr) -> bool {
    a.index == XATTR_INDEX && a.name == XATTR_NAME
}

/// The `system.data` attribute holding `value`.
pub fn data_attr(value: &[u8]) -> Xattr {
    Xattr::new(XATTR_INDEX, XATTR_NAME, value)
}

/// The largest `system.data` value the in-inode area of `region_len` bytes can hold
/// beside the `others` attributes (which stay there); `None` when not even an empty
/// one fits (no inline data possible).
pub fn max_value_len(region_len: usize, others: &[Xattr]) -> Option<usize> {
    let mut all: Vec<Xattr> = others.to_vec();
    all.push(data_attr(&[]));
    let need = xattr::inode_space_needed(&all);
    if need > region_len {
        return None;
    }
    Some((region_len - need) & !3)
}

/// The inline bytes of an inode: `i_block` then the value (60 + value length bytes).
pub fn join(i_block: &[u8; I_BLOCK_BYTES], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(I_BLOCK_BYTES + value.len());
    out.extend_from_slice(i_block);
    out.extend_from_slice(value);
    out
}

/// An inline file's `i_size` checked against what it holds (`inline_len` bytes).
pub fn check_file_size(size: u64, inline_len: usize) -> Result<()> {
    if size > inline_len as u64 {
        return Err(FormatError::corrupted(format!(
            "inline data: size {size} exceeds the {inline_len} bytes held in the inode"
        )));
    }
    Ok(())
}

/// The parent inode number of an inline directory (`i_block[0..4]`).
pub fn dir_parent(i_block: &[u8; I_BLOCK_BYTES]) -> u32 {
    le32(i_block, 0)
}

/// Every entry of an inline directory's two areas (live and empty ones), each with
/// its area (0: `i_block`, 1: the value) and offset there. The first bad record is
/// `Corrupted`.
pub fn dir_entries<'a>(
    i_block: &'a [u8; I_BLOCK_BYTES],
    value: &'a [u8],
) -> Result<Vec<(usize, DirEntry<'a>)>> {
    let mut out = Vec::new();
    for (area, bytes) in [(0, &i_block[DOTDOT_BYTES..]), (1, value)] {
        for e in dir::entries(bytes, false) {
            let e = e.map_err(|e| {
                FormatError::corrupted(format!("inline directory area {area}: {e}"))
            })?;
            out.push((area, e));
        }
    }
    Ok(out)
}

/// The `i_block` of a new, empty inline directory under `parent`: the parent's number
/// and one empty record over the other 56 bytes.
pub fn new_dir(parent: u32) -> [u8; I_BLOCK_BYTES] {
    let mut b = [0u8; I_BLOCK_BYTES];
    set_le32(&mut b, 0, parent);
    let rest = I_BLOCK_BYTES - DOTDOT_BYTES;
    set_le16(&mut b, DOTDOT_BYTES + 4, rec_len_to_disk(rest, rest));
    b
}

/// A new value area of `len` bytes for a directory: one empty record over it all
/// (`len` ≥ 12 and a multiple of 4).
pub fn empty_dir_area(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    if len >= dir::MIN_REC_LEN {
        set_le16(&mut v, 4, rec_len_to_disk(len, len));
    }
    v
}

/// The records of both areas in a row (what follows "." and ".." once the directory
/// is a block): their byte string, whose records cover it exactly.
pub fn dir_records(i_block: &[u8; I_BLOCK_BYTES], value: &[u8]) -> Vec<u8> {
    let mut out = i_block[DOTDOT_BYTES..].to_vec();
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_of_a_256_byte_inode_matches_the_kernel() {
        // 256-byte inode, extra_isize 32: 96 bytes of area; the kernel's
        // get_max_inline_xattr_value_size gives 68 with no other attribute.
        assert_eq!(max_value_len(96, &[]), Some(68));
        let other = Xattr::new(crate::xattr::INDEX_USER, b"k", b"12345");
        // entry 20 + value 8.
        assert_eq!(max_value_len(96, &[other]), Some(40));
        assert_eq!(max_value_len(20, &[]), None);
        assert_eq!(max_value_len(0, &[]), None);
    }

    #[test]
    fn new_dir_is_empty_and_well_formed() {
        let b = new_dir(2);
        assert_eq!(dir_parent(&b), 2);
        let all = dir_entries(&b, &[]).expect("entries");
        assert_eq!(all.len(), 1);
        assert!(!all[0].1.is_live());
        let v = empty_dir_area(68);
        let all = dir_entries(&b, &v).expect("entries");
        assert_eq!(all.len(), 2);
    }

    #[test]
    fn bad_records_are_corruption_not_panics() {
        let mut b = new_dir(2);
        b[8] = 3; // rec_len 3
        assert!(dir_entries(&b, &[]).is_err());
        let mut b = new_dir(2);
        b[8] = 200; // past the area
        assert!(dir_entries(&b, &[]).is_err());
        for len in 0..40 {
            let v: Vec<u8> = (0..len).map(|i| (i * 37) as u8).collect();
            let _ = dir_entries(&new_dir(2), &v);
        }
        assert!(check_file_size(61, 60).is_err());
        assert!(check_file_size(60, 60).is_ok());
    }
}
