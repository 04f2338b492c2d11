//! Write-path acceptance at scale: a 100,000-entry directory (htree, lookups touch a
//! handful of blocks), a file written in 100,000 random 4 KiB pieces (deep extent tree,
//! exact space accounting after truncate), and filling the filesystem (ENOSPC leaves a
//! consistent image that is usable again after deletes). Each ends with e2fsck -fn and,
//! as root, the kernel's view.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{Hooked, Hooks, Rng};
use rext4::device::FileDevice;
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{e2fsck_fn, extent_depth, htree_levels, mkfs, skip, LoopMount, MkfsOptions};

use common::open_rw as rw;

/// Counts device reads, to show lookups touch few blocks.
struct Counting {
    reads: AtomicU64,
}

impl Hooks for Counting {
    fn read(&self, _len: usize, _off: u64) -> std::io::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// e2fsck -fn must find nothing wrong. Allowed are only its extent-tree optimization
/// notices (`FsckReport::clean_but_repack_hints`): random-order writes leave half-full
/// tree nodes, and the kernel's own tree for the same workload gets the same notice.
fn assert_fsck_clean_but_narrower(img: &std::path::Path) {
    let r = e2fsck_fn(img);
    assert!(r.clean_but_repack_hints(), "{}", r.output);
}

fn name(i: u32) -> String {
    format!("entry-{i:06}-{}", "n".repeat((i % 40) as usize))
}

fn big_directory(bs: u32) {
    let img = mkfs(&MkfsOptions::new(bs, 512 << 20).arg("-N").arg("120000")).expect("mkfs");
    let fs = rw(img.path());
    fs.create_dir("/big").expect("mkdir");
    let dir = fs.resolve(b"/big", true).expect("resolve");
    let n = 100_000u32;
    for i in 0..n {
        fs.mknod_ino(dir, name(i).as_bytes(), 0o100644, 0, 0, (0, 0))
            .expect("create");
    }
    for i in (0..n).step_by(2) {
        fs.unlink_ino(dir, name(i).as_bytes()).expect("unlink");
    }
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "bs {bs}: {}", r.output);
    let levels = htree_levels(img.path(), "/big").expect("htree");
    assert!(
        levels >= Some(1),
        "bs {bs}: 100,000 entries need an indexed directory with an indirect level, got {levels:?}"
    );

    // Lookups walk the index: with a cold cache each costs a few block reads.
    let dev = Arc::new(Hooked {
        inner: FileDevice::open(img.path(), true, false).expect("dev"),
        hooks: Counting {
            reads: AtomicU64::new(0),
        },
    });
    let fs = Fs::open_device(dev.clone(), FsOptions::default()).expect("open");
    let dir = fs.resolve(b"/big", true).expect("resolve");
    let mut rng = Rng(7);
    let before = dev.reads.load(Ordering::Relaxed);
    let probes = 200u64;
    for _ in 0..probes {
        let i = rng.below(u64::from(n)) as u32;
        let found = fs.lookup(dir, name(i).as_bytes()).expect("lookup");
        assert_eq!(found.is_some(), i % 2 == 1, "entry {i}");
    }
    let per = (dev.reads.load(Ordering::Relaxed) - before) as f64 / probes as f64;
    // Root + one index node + one leaf (+ an inode-table block now and then); a linear
    // scan would read thousands of blocks.
    assert!(per <= 5.0, "bs {bs}: {per} device reads per cold lookup");
    eprintln!("bs {bs}: htree levels {levels:?}, {per:.2} device reads per lookup");
    let names: BTreeSet<Vec<u8>> = fs
        .read_dir("/big")
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names.len(), (n / 2) as usize);
    drop(fs);

    let m = match LoopMount::new(img.path(), true, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&e),
    };
    let kernel: BTreeSet<Vec<u8>> = std::fs::read_dir(m.path().join("big"))
        .expect("kernel readdir")
        .map(|e| {
            std::os::unix::ffi::OsStrExt::as_bytes(e.expect("entry").file_name().as_os_str())
                .to_vec()
        })
        .collect();
    assert_eq!(kernel, names, "bs {bs}: the kernel sees other entries");
    for i in [1u32, 99_999, 50_001] {
        assert!(
            m.path().join("big").join(name(i)).exists(),
            "kernel lookup of {}",
            name(i)
        );
    }
}

#[test]
fn directory_100k_1k_blocks() {
    big_directory(1024);
}

#[test]
fn directory_100k_4k_blocks() {
    big_directory(4096);
}

#[test]
fn fragmented_file_and_exact_free_counts() {
    let img = mkfs(&MkfsOptions::new(4096, 1 << 30)).expect("mkfs");
    let fs = rw(img.path());
    let free0 = fs.superblock().free_blocks_count;
    let f = fs.create("/frag").expect("create");
    let pieces = 100_000u64;
    let mut order: Vec<u64> = (0..pieces).collect();
    let mut rng = Rng(42);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    // Piece p goes to logical block 2p: no two pieces are adjacent, so each is an
    // extent of its own wherever the allocator puts it (it places a block next to its
    // logical neighbours, so a dense file written in random order comes out contiguous).
    let mut block = vec![0u8; 4096];
    for &p in &order {
        block[..8].copy_from_slice(&p.to_le_bytes());
        f.write_all_at(&block, 2 * p * 4096).expect("piece");
    }
    let nexts = f.extents().expect("extents").len();
    assert!(
        nexts > 10_000,
        "only {nexts} extents: the test wants fragmentation"
    );
    fs.close().expect("close");
    assert_fsck_clean_but_narrower(img.path());
    let depth = extent_depth(img.path(), "/frag").expect("depth");
    assert!(
        depth >= Some(2),
        "extent depth {depth:?} with {nexts} extents"
    );
    match LoopMount::new(img.path(), true, "noatime") {
        Ok(m) => {
            let data = std::fs::read(m.path().join("frag")).expect("kernel read");
            assert_eq!(data.len() as u64, (2 * pieces - 1) * 4096);
            for p in [0u64, 1, 77_777, pieces - 1] {
                let off = (2 * p * 4096) as usize;
                assert_eq!(
                    u64::from_le_bytes(data[off..off + 8].try_into().expect("8")),
                    p
                );
            }
        }
        Err(why) => skip(&format!("kernel read of the fragmented file: {why}")),
    }
    let fs = rw(img.path());
    fs.set_len("/frag", 0).expect("truncate");
    let free1 = fs.superblock().free_blocks_count;
    assert_eq!(
        free1, free0,
        "truncating to 0 must free every block it used"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

#[test]
fn enospc_is_clean_and_recoverable() {
    let img = mkfs(&MkfsOptions::new(1024, 8 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let chunk = vec![0xABu8; 64 * 1024];
    let mut files = 0;
    let err = 'fill: loop {
        let p = format!("/f{files}");
        let f = match fs.create(&p) {
            Ok(f) => f,
            Err(e) => break 'fill e,
        };
        files += 1;
        for k in 0..16u64 {
            if let Err(e) = f.write_all_at(&chunk, k * chunk.len() as u64) {
                break 'fill e;
            }
        }
    };
    assert!(matches!(err, Error::NoSpace), "filling ended with {err}");
    assert!(files > 3);
    fs.sync().expect("sync");
    let sb = fs.superblock();
    // Full means: all but the pool ext4 keeps for changes that must not fail (2% of
    // the blocks, at most 4096), which new data never takes.
    let pool = (sb.blocks_count / 50).min(4096);
    assert!(
        (pool..pool + 64).contains(&sb.free_blocks_count),
        "free blocks {}, pool {pool}",
        sb.free_blocks_count
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "after ENOSPC: {}", r.output);
    let fs = rw(img.path());
    for i in 0..files / 2 {
        fs.remove_file(format!("/f{i}")).expect("delete");
    }
    fs.write("/after", vec![1u8; 512 * 1024])
        .expect("space is usable again");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "after deletes: {}", r.output);
}

/// A dense file whose chunks arrive in random order (as the parallel FUSE workers
/// deliver the kernel's writeback) still comes out as one run on disk: each allocation
/// is placed where its logical neighbours say it belongs.
#[test]
fn out_of_order_writes_come_out_contiguous() {
    let img = mkfs(&MkfsOptions::new(4096, 256 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let f = fs.create("/dense").expect("create");
    let chunk = 64 * 1024u64;
    let n = 256u64; // 16 MiB
    let mut order: Vec<u64> = (0..n).collect();
    let mut rng = Rng(7);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for &c in &order {
        f.write_all_at(&vec![c as u8; chunk as usize], c * chunk)
            .expect("chunk");
    }
    let exts = f.extents().expect("extents");
    assert!(exts.len() <= 2, "{} extents: {exts:?}", exts.len());
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}
