//! Checksums: on images made by mkfs.ext4 and populated by debugfs (and the kernel as
//! root), every checksum of every metadata block verifies; and a single flipped bit in
//! any metadata block is reported as `Corrupted { what, block }` — or, where the bit
//! lies in bytes no reader uses (unused slots past a count), leaves what rext4 reads
//! exactly as it was. It is never read as good, different data.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::{full_read, open_patched, Rng};
use rext4::{Error, Fs, MetaKind};
use rext4_testkit::{
    mkfs, populate_debugfs, populate_kernel, skip, Fixture, LoopMount, MkfsOptions,
};

fn metadata_blocks(fs: &Fs) -> Vec<(u64, MetaKind)> {
    let audit = fs.audit().expect("audit runs");
    assert!(
        audit.problems.is_empty(),
        "clean image has problems: {:?}",
        audit.problems
    );
    let set: BTreeSet<(u64, MetaKind)> = audit.blocks.into_iter().collect();
    set.into_iter().collect()
}

/// Flip one bit in each metadata block (several per block), and classify.
fn flip_every_block(base: Arc<Vec<u8>>, label: &str, flips_per_block: usize, seed: u64) {
    let fs = open_patched(&base, vec![]).expect("opens");
    let want = full_read(&fs, u64::MAX).expect("clean read");
    let bs = u64::from(fs.block_size());
    let blocks = metadata_blocks(&fs);
    drop(fs);
    let kinds: BTreeSet<MetaKind> = blocks.iter().map(|b| b.1).collect();
    eprintln!(
        "[{label}] {} metadata blocks of kinds {kinds:?}",
        blocks.len()
    );
    let mut rng = Rng(seed);
    let (mut detected, mut benign) = (0u64, 0u64);
    // A slow symlink's target block is file data to ext4: no checksum covers it; nor
    // does one cover an indirect block of a block map.
    let unchecked = [MetaKind::SymlinkBlock, MetaKind::IndirectBlock];
    for &(blk, kind) in blocks.iter().filter(|b| !unchecked.contains(&b.1)) {
        for _ in 0..flips_per_block {
            // The superblock is 1024 bytes at byte 1024 whatever the block size.
            let (start, len) = if kind == MetaKind::Superblock {
                (1024, 1024)
            } else {
                (blk * bs, bs)
            };
            let at = start + rng.below(len);
            let bit = 1u8 << rng.below(8);
            let patched = base[at as usize] ^ bit;
            let got =
                open_patched(&base, vec![(at, patched)]).and_then(|fs| full_read(&fs, u64::MAX));
            match got {
                Err(Error::Corrupted { block: Some(_), .. }) => detected += 1,
                Err(Error::Corrupted { what, block: None }) => {
                    // Detected, but the report must say where.
                    panic!("[{label}] {kind:?} block {blk} byte {at}: corruption without block: {what}")
                }
                Err(e) => panic!("[{label}] {kind:?} block {blk} byte {at}: unexpected error {e}"),
                Ok(t) => {
                    assert!(
                        t == want,
                        "[{label}] {kind:?} block {blk}: flipped bit at byte {at} read as good, different data"
                    );
                    benign += 1;
                }
            }
        }
    }
    eprintln!("[{label}] {detected} flips reported as corruption, {benign} in unused bytes");
    assert!(
        detected > 0 && detected >= 9 * benign,
        "[{label}] too few detections"
    );
}

fn image_bytes(path: &std::path::Path) -> Arc<Vec<u8>> {
    Arc::new(std::fs::read(path).expect("read image"))
}

fn small_fixture() -> Fixture {
    Fixture {
        big_dir_entries: 600,
        frag_extents: 400,
        sparse_far_offset: 4 << 20,
        ..Fixture::quick()
    }
}

#[test]
fn bit_flips_debugfs_images() {
    for (bs, upstream) in [(1024, false), (4096, true), (1024, true), (4096, false)] {
        let img = mkfs(&MkfsOptions::new(bs, 32 << 20).upstream(upstream)).expect("mkfs");
        populate_debugfs(img.path(), &small_fixture()).expect("populate");
        let label = format!("debugfs {bs} upstream={upstream}");
        flip_every_block(image_bytes(img.path()), &label, 3, 0x5EED ^ u64::from(bs));
    }
}

#[test]
fn bit_flips_kernel_image() {
    let img = mkfs(&MkfsOptions::new(1024, 32 << 20).upstream(true)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("kernel-written image: {e}")),
    };
    populate_kernel(m.path(), &small_fixture()).expect("populate");
    m.unmount().expect("unmount");
    flip_every_block(image_bytes(img.path()), "kernel 1024 upstream", 3, 0xC0FFEE);
}
