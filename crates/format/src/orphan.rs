//! Blocks of the orphan file (format notes §2.14; feature orphan_file, compat 0x1000).
//!
//! Owns the layout of one orphan-file block: `(bs - 8) / 4` le32 inode slots (0 =
//! free), then an 8-byte tail {magic le32 0x0B10CA04 @ bs-8, checksum le32 @ bs-4}.
//! The checksum is raw(raw(inode_seed(orphan file), le64 PHYSICAL block number),
//! block[0..bs-8]); inode_seed(orphan file) = raw(raw(fs_seed, le32 ino), le32 gen),
//! i.e. [`crate::csum::inode_seed`] of the orphan-file inode.
//!
//! Must hold: every block of the orphan file carries the magic, also without
//! metadata_csum (the kernel refuses the mount otherwise); nothing here panics on any
//! input. Slot contents are inode numbers the caller must still range-check.
//!
//! Callers: the engine at mount (orphan processing) and on unlink-while-open, mkfs
//! (fresh blocks), fsck and the tests. Setting/clearing ro_compat ORPHAN_PRESENT is the
//! engine's job.

use crate::bytes::{le32, need, set_le32};
use crate::csum::raw;
use crate::{ensure, Result};

/// Magic at `bs - 8` of every orphan-file block.
pub const MAGIC: u32 = 0x0B10_CA04;
/// Size of the tail {magic, checksum}.
pub const TAIL_SIZE: usize = 8;
/// Tail offsets, relative to `bs - TAIL_SIZE`.
const T_MAGIC: usize = 0;
const T_CHECKSUM: usize = 4;
const _: () = assert!(T_CHECKSUM + 4 == TAIL_SIZE && T_MAGIC + 4 == T_CHECKSUM);
/// Smallest block the format allows (1 KiB), so the tail never overlaps slot 0.
const MIN_BLOCK: usize = 1024;
const _: () = assert!(MIN_BLOCK > TAIL_SIZE);

/// Inode slots in one block of `bs` bytes.
#[inline]
pub fn slots_per_block(bs: usize) -> usize {
    bs.saturating_sub(TAIL_SIZE) / 4
}

#[inline]
fn tail_off(block: &[u8]) -> usize {
    block.len().saturating_sub(TAIL_SIZE)
}

fn check_size(block: &[u8]) -> Result<()> {
    need(block, MIN_BLOCK, "orphan file block")
}

/// Checksum of an orphan-file block at physical block `blocknr`; `file_seed` is the
/// orphan-file inode's seed ([`crate::csum::inode_seed`]).
pub fn block_csum(block: &[u8], file_seed: u32, blocknr: u64) -> u32 {
    let c = raw(file_seed, &blocknr.to_le_bytes());
    raw(c, block.get(..tail_off(block)).unwrap_or(&[]))
}

/// Check the tail magic and, with `file_seed` (metadata_csum), the checksum. Errors
/// carry the block number.
pub fn verify_block(block: &[u8], file_seed: Option<u32>, blocknr: u64) -> Result<()> {
    let r = (|| -> Result<()> {
        check_size(block)?;
        let t = tail_off(block);
        let magic = le32(block, t + T_MAGIC);
        ensure(magic == MAGIC, || {
            format!("orphan file block magic {magic:#010x} is not {MAGIC:#010x}")
        })?;
        if let Some(seed) = file_seed {
            let stored = le32(block, t + T_CHECKSUM);
            let computed = block_csum(block, seed, blocknr);
            ensure(stored == computed, || {
                format!("orphan file block checksum {stored:#010x} does not match {computed:#010x}")
            })?;
        }
        Ok(())
    })();
    r.map_err(|e| e.at_block(blocknr))
}

/// Store the checksum of a block about to be written at `blocknr`.
pub fn set_block_csum(block: &mut [u8], file_seed: u32, blocknr: u64) {
    let c = block_csum(block, file_seed, blocknr);
    let t = tail_off(block);
    set_le32(block, t + T_CHECKSUM, c);
}

/// Make `block` an empty orphan-file block: all slots free, magic set, checksum 0
/// (call [`set_block_csum`] with metadata_csum).
pub fn init_block(block: &mut [u8]) {
    block.fill(0);
    let t = tail_off(block);
    set_le32(block, t + T_MAGIC, MAGIC);
}

/// Slot values in order (0 = free); the tail is not a slot.
pub fn slots(block: &[u8]) -> impl Iterator<Item = u32> + '_ {
    block
        .get(..tail_off(block))
        .unwrap_or(&[])
        .chunks_exact(4)
        .map(|w| le32(w, 0))
}

/// The inode numbers recorded in the block (non-zero slots), in slot order. Checks
/// the size and magic, not the checksum.
pub fn decode(block: &[u8]) -> Result<Vec<u32>> {
    check_size(block)?;
    let t = tail_off(block);
    let magic = le32(block, t + T_MAGIC);
    ensure(magic == MAGIC, || {
        format!("orphan file block magic {magic:#010x} is not {MAGIC:#010x}")
    })?;
    Ok(slots(block).filter(|&i| i != 0).collect())
}

/// Count of used slots.
pub fn used_slots(block: &[u8]) -> usize {
    slots(block).filter(|&i| i != 0).count()
}

/// Put `ino` (non-zero) in the first free slot; the slot index, or `None` if the
/// block is full (or `ino` is 0). The caller recomputes the checksum.
pub fn add(block: &mut [u8], ino: u32) -> Option<usize> {
    if ino == 0 {
        return None;
    }
    let slot = slots(block).position(|i| i == 0)?;
    set_le32(block, slot * 4, ino);
    Some(slot)
}

/// Clear the slot holding `ino`; the slot index, or `None` if absent (or `ino` is 0).
/// The caller recomputes the checksum.
pub fn remove(block: &mut [u8], ino: u32) -> Option<usize> {
    if ino == 0 {
        return None;
    }
    let slot = slots(block).position(|i| i == ino)?;
    set_le32(block, slot * 4, 0);
    Some(slot)
}

/// Clear slot `slot`, returning what it held (`None` if `slot` is out of range).
pub fn clear_slot(block: &mut [u8], slot: usize) -> Option<u32> {
    if slot >= slots_per_block(block.len()) {
        return None;
    }
    let old = le32(block, slot * 4);
    set_le32(block, slot * 4, 0);
    Some(old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csum::inode_seed;
    use crate::resize::test_image::*;
    use crate::FormatError;
    use proptest::prelude::*;

    #[test]
    fn slots_add_remove() {
        let mut b = vec![0xFFu8; 1024];
        init_block(&mut b);
        assert_eq!(slots_per_block(1024), 254);
        assert_eq!(slots(&b).count(), 254);
        assert_eq!(decode(&b), Ok(vec![]));
        assert_eq!(add(&mut b, 13), Some(0));
        assert_eq!(add(&mut b, 14), Some(1));
        assert_eq!(add(&mut b, 0), None);
        assert_eq!(remove(&mut b, 13), Some(0));
        assert_eq!(remove(&mut b, 13), None);
        assert_eq!(add(&mut b, 15), Some(0));
        assert_eq!(decode(&b), Ok(vec![15, 14]));
        assert_eq!(used_slots(&b), 2);
        for i in 2..254 {
            assert_eq!(add(&mut b, 100 + i as u32), Some(i));
        }
        assert_eq!(add(&mut b, 99), None, "full block");
        assert_eq!(le32(&b, 1016), MAGIC, "slots never reach the tail");
        assert_eq!(clear_slot(&mut b, 1), Some(14));
        assert_eq!(clear_slot(&mut b, 254), None);
        set_block_csum(&mut b, 7, 8);
        verify_block(&b, Some(7), 8).expect("valid");
        assert!(
            verify_block(&b, Some(7), 9).is_err(),
            "physical block number is bound"
        );
        b[1019] ^= 1;
        assert!(matches!(
            verify_block(&b, None, 8),
            Err(FormatError::Corrupted { ref what, block: Some(8) }) if what.contains("magic")
        ));
        assert!(decode(&b[..512]).is_err());
    }

    proptest! {
        #[test]
        fn random_blocks_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode(&bytes);
            let _ = verify_block(&bytes, Some(1), 2);
            let mut b = bytes.clone();
            let _ = add(&mut b, 5);
            let _ = remove(&mut b, 5);
            let _ = clear_slot(&mut b, 3);
            let _ = used_slots(&bytes);
        }
    }

    #[test]
    fn mkfs_orphan_file_blocks_verify() {
        let dir = TempDir::new("orphan");
        let img = dir.path().join("fs.img");
        mkfs(&img, "256M", &[], true);
        let sb = superblock(&img);
        let ino = 12u32;
        let raw_sb = read_at(&img, 1024, 1024);
        assert_eq!(le32(&raw_sb, 0x280), ino, "s_orphan_file_inum");
        let stat = debugfs(&img, "stat <12>");
        let gen: u32 = stat
            .split("Generation:")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("Generation in stat");
        let blocks: Vec<u64> = debugfs(&img, "blocks <12>")
            .split_whitespace()
            .map(|s| s.parse().expect("block number"))
            .collect();
        // 256 MiB is mke2fs' "small" type: 256 Ki blocks of 1 KiB, so blocks/4096 = 64
        // orphan-file blocks (lib/ext2fs/orphan.c).
        assert_eq!(sb.bs, 1024);
        assert_eq!(blocks.len(), 64);
        let seed = inode_seed(sb.fs_seed, ino, gen);
        for &blk in &blocks {
            let b = read_block(&img, blk, sb.bs);
            verify_block(&b, Some(seed), blk).expect("mkfs block verifies");
            assert_eq!(decode(&b), Ok(vec![]));
        }
        let blk = blocks[5];
        let mut b = read_block(&img, blk, sb.bs);
        // Rebuilding the block from scratch gives mkfs' bytes.
        let mut fresh = vec![0u8; sb.bs as usize];
        init_block(&mut fresh);
        set_block_csum(&mut fresh, seed, blk);
        assert!(fresh == b, "init_block + set_block_csum differ from mkfs");
        assert!(
            verify_block(&b, Some(seed), blocks[6]).is_err(),
            "wrong block number"
        );
        b[100] ^= 0x20;
        let err = verify_block(&b, Some(seed), blk).expect_err("flipped bit");
        assert!(format!("{err}").contains("checksum"), "{err}");
        b[100] ^= 0x20;
        assert_eq!(add(&mut b, 11), Some(0));
        set_block_csum(&mut b, seed, blk);
        verify_block(&b, Some(seed), blk).expect("after add");
        assert_eq!(decode(&b), Ok(vec![11]));
    }

    #[test]
    fn kernel_records_unlinked_open_file() {
        use std::os::unix::fs::MetadataExt;
        use std::process::Command;
        let dir = TempDir::new("orphan-kernel");
        let img = dir.path().join("fs.img");
        mkfs(&img, "256M", &[], true);
        let sb = superblock(&img);
        let copy = dir.path().join("copy.img");
        let mnt = dir.path().join("mnt");
        let victim;
        {
            let _m = match Mount::new(&img, &mnt) {
                Ok(m) => m,
                Err(why) => {
                    rext4_testkit::skip(&why);
                    return;
                }
            };
            let f = mnt.join("victim");
            std::fs::write(&f, b"bye").expect("create");
            let held = std::fs::File::open(&f).expect("open");
            victim = held.metadata().expect("stat").ino() as u32;
            std::fs::remove_file(&f).expect("unlink");
            // Freezing checkpoints the journal, so the orphan block is in place.
            run(Command::new("fsfreeze").arg("-f").arg(&mnt));
            let copied = std::fs::copy(&img, &copy);
            run(Command::new("fsfreeze").arg("-u").arg(&mnt));
            copied.expect("copy image");
            drop(held);
        }
        let raw_sb = read_at(&copy, 1024, 1024);
        assert_ne!(
            le32(&raw_sb, 0x64) & 0x10000,
            0,
            "ORPHAN_PRESENT set while the entry exists"
        );
        let gen: u32 = debugfs(&copy, "stat <12>")
            .split("Generation:")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("Generation");
        let seed = inode_seed(sb.fs_seed, 12, gen);
        let mut found = Vec::new();
        for tok in debugfs(&copy, "blocks <12>").split_whitespace() {
            let blk: u64 = tok.parse().expect("block number");
            let b = read_block(&copy, blk, sb.bs);
            verify_block(&b, Some(seed), blk).expect("kernel block verifies");
            found.extend(decode(&b).expect("decodes"));
        }
        assert_eq!(found, vec![victim]);
    }
}
