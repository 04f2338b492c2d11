//! bigalloc images (clusters of several blocks) read and written: a file's logical
//! cluster maps to one physical cluster (two extents of a file in one cluster share
//! it), truncate and punch free a cluster only once no block of the file uses it,
//! xattr and extent-tree blocks take whole clusters, i_blocks and the free counts
//! count clusters; e2fsck -fn text-clean after each, filling to ENOSPC and freeing
//! everything gives every cluster back, and the kernel reads what rext4 wrote.

mod common;

use rext4::{FallocMode, Fs, OpenOptions};
use rext4_testkit::{e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions};

use common::open_rw as rw;

/// A mke2fs bigalloc image: blocks of `bs`, clusters of `cluster` bytes.
fn image(bs: u32, cluster: u32, size: u64) -> Option<rext4_testkit::Image> {
    let opts = MkfsOptions::new(bs, size)
        .arg("-O")
        .arg("bigalloc")
        .arg("-C")
        .arg(&cluster.to_string());
    match mkfs(&opts) {
        Ok(i) => Some(i),
        Err(e) => {
            skip(&format!("mkfs -O bigalloc -C {cluster}: {e}"));
            None
        }
    }
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(29).wrapping_add(seed.wrapping_mul(11)) ^ (i >> 9)) as u8)
        .collect()
}

/// Free blocks as statfs reports them (a multiple of the cluster).
fn free(fs: &Fs) -> u64 {
    fs.statfs().blocks_free
}

/// i_blocks of `p` in 512-byte units.
fn sectors(fs: &Fs, p: &str) -> u64 {
    fs.metadata(p).expect("stat").blocks
}

fn clean(fs: Fs, img: &std::path::Path, what: &str) {
    assert!(
        fs.check_counts().expect("counts").is_empty(),
        "{what}: counts"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img);
    assert!(r.clean, "{what}: e2fsck: {}", r.output);
}

fn read_all(fs: &Fs, p: &str) -> Vec<u8> {
    fs.read(p).expect("read")
}

/// Opens read-write, counts exact; a file written, appended, rewritten; directories,
/// symlinks, xattrs: e2fsck clean, at 16 KiB and 64 KiB clusters on 4 KiB blocks and
/// 16 KiB clusters on 1 KiB blocks.
#[test]
fn written_files_are_e2fsck_clean() {
    for (bs, cl) in [
        (4096u32, 16384u32),
        (4096, 65536),
        (1024, 16384),
        (4096, 1 << 20),
    ] {
        let what = format!("{bs}/{cl}");
        let Some(img) = image(bs, cl, 128 << 20) else {
            return;
        };
        let fs = rw(img.path());
        assert!(!fs.is_read_only(), "{what}: read-write");
        let before = free(&fs);
        let mut want = Vec::new();
        for (n, len) in [0usize, 1, 4095, 4096, 5000, 70_000, 1 << 20, 3_000_001]
            .iter()
            .enumerate()
        {
            let p = format!("/f{n}");
            let d = pattern(n as u32, *len);
            fs.write(&p, &d).expect("write");
            want.push((p, d));
        }
        fs.create_dir("/d").expect("mkdir");
        // Each small file takes a cluster: a few hundred of them, fewer at 1 MiB.
        let smalls = if cl >= 1 << 20 { 40 } else { 300 };
        for i in 0..smalls {
            fs.write(format!("/d/small-{i:04}"), pattern(i, 100 + i as usize))
                .unwrap_or_else(|e| panic!("{what}: small file {i}: {e}"));
        }
        fs.symlink("x".repeat(200), "/d/slow").expect("symlink");
        let f = fs.metadata("/f1").expect("stat").ino;
        fs.set_xattr_ino(
            f,
            b"user.big",
            &vec![7u8; bs as usize / 2],
            Default::default(),
        )
        .expect("xattr");
        // Append one byte at a time across a cluster boundary.
        let mut tail = want[3].1.clone();
        let ap = OpenOptions::new()
            .append(true)
            .open(&fs, "/f3")
            .expect("open append");
        for k in 0..10u8 {
            ap.write_at(&[k], 0).expect("append");
            tail.push(k);
        }
        drop(ap);
        want[3].1 = tail;
        for (p, d) in &want {
            assert_eq!(&read_all(&fs, p), d, "{what}: {p}");
        }
        assert!(free(&fs) < before);
        assert_eq!(free(&fs) % (u64::from(cl) / u64::from(bs)), 0, "{what}");
        clean(fs, img.path(), &what);
        // And everything given back.
        let fs = rw(img.path());
        for (p, d) in &want {
            assert_eq!(&read_all(&fs, p), d, "{what}: {p} reopened");
        }
        for (p, _) in &want {
            fs.remove_file(p).expect("rm");
        }
        fs.remove_dir_all("/d").expect("rm -r");
        assert_eq!(free(&fs), before, "{what}: every cluster back");
        clean(fs, img.path(), &what);
    }
}

/// Two writes into one cluster of a file (blocks 0 and 2 of a 4-block cluster, then
/// block 1 between them) share its physical cluster: one cluster taken, the blocks
/// at their logical offsets in it, i_blocks one cluster.
#[test]
fn extents_of_one_cluster_share_it() {
    let Some(img) = image(4096, 16384, 64 << 20) else {
        return;
    };
    let fs = rw(img.path());
    let before = free(&fs);
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .direct(true)
        .open(&fs, "/f")
        .expect("create");
    f.write_all_at(&pattern(1, 4096), 0).expect("block 0");
    f.write_all_at(&pattern(2, 4096), 8192).expect("block 2");
    assert_eq!(before - free(&fs), 4, "one cluster for blocks 0 and 2");
    let b = common::blocks_of(&fs, "/f");
    assert_eq!(b.len(), 2, "{b:?}");
    assert_eq!(b[0] % 4, 0);
    assert_eq!(b[1], b[0] + 2, "block 2 at its offset in the cluster");
    f.write_all_at(&pattern(3, 4096), 4096).expect("block 1");
    assert_eq!(before - free(&fs), 4, "block 1 too");
    // Block 5 (second cluster), then 4.
    f.write_all_at(&pattern(4, 4096), 5 * 4096)
        .expect("block 5");
    f.write_all_at(&pattern(5, 4096), 4 * 4096)
        .expect("block 4");
    assert_eq!(before - free(&fs), 8, "two clusters");
    drop(f);
    assert_eq!(sectors(&fs, "/f"), 2 * 16384 / 512);
    let d = read_all(&fs, "/f");
    assert_eq!(&d[..4096], &pattern(1, 4096)[..]);
    assert_eq!(&d[4096..8192], &pattern(3, 4096)[..]);
    assert_eq!(&d[8192..12288], &pattern(2, 4096)[..]);
    assert_eq!(&d[12288..16384], &[0u8; 4096][..]);
    assert_eq!(&d[16384..20480], &pattern(5, 4096)[..]);
    // Buffered writes into the holes left (block 3, block 6) join the clusters too.
    let f = OpenOptions::new()
        .write(true)
        .open(&fs, "/f")
        .expect("open");
    f.write_all_at(&pattern(6, 4096), 3 * 4096)
        .expect("block 3");
    f.write_all_at(&pattern(7, 100), 6 * 4096 + 5)
        .expect("block 6");
    f.sync_all().expect("fsync");
    drop(f);
    assert_eq!(before - free(&fs), 8, "no third cluster");
    assert_eq!(sectors(&fs, "/f"), 2 * 16384 / 512);
    clean(fs, img.path(), "shared cluster");
}

/// Truncate and punch inside a cluster keep it while any block of the file in it is
/// still mapped, and free it with its last block.
#[test]
fn truncate_and_punch_keep_a_cluster_in_use() {
    let Some(img) = image(4096, 16384, 64 << 20) else {
        return;
    };
    let fs = rw(img.path());
    let before = free(&fs);
    // 3 clusters: blocks 0..12.
    fs.write("/f", pattern(9, 12 * 4096)).expect("write");
    assert_eq!(before - free(&fs), 12);
    let ino = fs.metadata("/f").expect("stat").ino;
    // Punch blocks 1..3 (inside the first cluster): kept.
    fs.fallocate_ino(ino, FallocMode::PunchHole, 4096, 2 * 4096)
        .expect("punch");
    assert_eq!(before - free(&fs), 12, "cluster 0 still has blocks 0 and 3");
    // Punch 0..1 and 3..6: cluster 0 now empty, cluster 1 keeps blocks 6 and 7.
    fs.fallocate_ino(ino, FallocMode::PunchHole, 0, 4096)
        .expect("punch 0");
    assert_eq!(before - free(&fs), 12, "block 3 still in cluster 0");
    fs.fallocate_ino(ino, FallocMode::PunchHole, 3 * 4096, 3 * 4096)
        .expect("punch 3..6");
    assert_eq!(before - free(&fs), 8, "cluster 0 freed with its last block");
    assert_eq!(sectors(&fs, "/f"), 2 * 16384 / 512);
    // Truncate to 9 blocks and a byte: cluster 2 keeps blocks 8 and 9.
    fs.set_len("/f", 9 * 4096 + 1).expect("truncate");
    assert_eq!(before - free(&fs), 8);
    fs.set_len("/f", 8 * 4096).expect("truncate to 8 blocks");
    assert_eq!(before - free(&fs), 4, "cluster 2 freed");
    // A write into the punched cluster 0 takes a cluster again, one for both blocks.
    let f = OpenOptions::new()
        .write(true)
        .direct(true)
        .open(&fs, "/f")
        .expect("open");
    f.write_all_at(&pattern(1, 4096), 2 * 4096)
        .expect("block 2");
    f.write_all_at(&pattern(2, 4096), 0).expect("block 0");
    drop(f);
    assert_eq!(before - free(&fs), 8);
    let d = read_all(&fs, "/f");
    let orig = pattern(9, 12 * 4096);
    assert_eq!(d.len(), 8 * 4096);
    assert_eq!(&d[..4096], &pattern(2, 4096)[..]);
    assert_eq!(&d[4096..8192], &[0u8; 4096][..]);
    assert_eq!(&d[8192..12288], &pattern(1, 4096)[..]);
    assert_eq!(&d[6 * 4096..], &orig[6 * 4096..8 * 4096]);
    fs.set_len("/f", 0).expect("truncate 0");
    assert_eq!(free(&fs), before, "everything back");
    clean(fs, img.path(), "truncate/punch");
}

/// fallocate (unwritten extents) by cluster, a zero range, collapse only by whole
/// clusters (EINVAL otherwise, as the kernel): e2fsck clean.
#[test]
fn fallocate_by_cluster() {
    let Some(img) = image(4096, 65536, 64 << 20) else {
        return;
    };
    let fs = rw(img.path());
    let before = free(&fs);
    fs.write("/f", b"").expect("create");
    let ino = fs.metadata("/f").expect("stat").ino;
    fs.fallocate_ino(ino, FallocMode::Allocate, 4096 * 3, 4096 * 20)
        .expect("fallocate");
    // Blocks 3..23: clusters 0 and 1 (16 blocks each).
    assert_eq!(before - free(&fs), 32);
    fs.fallocate_ino(ino, FallocMode::KeepSize, 4096 * 40, 4096)
        .expect("keep size");
    assert_eq!(before - free(&fs), 48);
    let err = fs.fallocate_ino(ino, FallocMode::CollapseRange, 4096, 4096);
    assert!(err.is_err(), "collapse of less than a cluster");
    fs.fallocate_ino(ino, FallocMode::ZeroRange { keep_size: false }, 100, 9000)
        .expect("zero range");
    let f = OpenOptions::new()
        .write(true)
        .open(&fs, "/f")
        .expect("open");
    f.write_all_at(&pattern(3, 30_000), 50_000).expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    clean(fs, img.path(), "fallocate");
}

/// Filling the filesystem ends in ENOSPC with the counts exact, and removing
/// everything gives every cluster back.
#[test]
fn fill_to_enospc_in_clusters() {
    let Some(img) = image(4096, 16384, 32 << 20) else {
        return;
    };
    let fs = rw(img.path());
    let before = free(&fs);
    let mut n = 0;
    let chunk = pattern(5, 4096 * 3 + 17);
    'fill: loop {
        let p = format!("/f{n}");
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .open(&fs, &p)
            .expect("create");
        for k in 0..50u64 {
            match f.write_all_at(&chunk, k * chunk.len() as u64) {
                Ok(()) => {}
                Err(rext4::Error::NoSpace) => break 'fill,
                Err(e) => panic!("write: {e}"),
            }
        }
        n += 1;
    }
    assert!(n > 3, "wrote {n} files");
    assert!(fs.check_counts().expect("counts").is_empty());
    fs.sync().expect("sync");
    assert!(free(&fs) < 64 * 4, "full: {} free", free(&fs));
    for k in 0..=n {
        fs.remove_file(format!("/f{k}")).expect("rm");
    }
    assert_eq!(free(&fs), before);
    clean(fs, img.path(), "fill");
}

/// The kernel reads what rext4 wrote on a bigalloc image, and rext4 what the kernel
/// wrote.
#[test]
fn kernel_reads_what_rext4_wrote() {
    let Some(img) = image(4096, 65536, 64 << 20) else {
        return;
    };
    let fs = rw(img.path());
    let mut want = Vec::new();
    for (n, len) in [1usize, 65536, 65537, 300_000].iter().enumerate() {
        let p = format!("/f{n}");
        let d = pattern(n as u32 + 40, *len);
        fs.write(&p, &d).expect("write");
        want.push((p, d));
    }
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .open(&fs, "/sparse")
        .expect("sparse");
    f.write_all_at(&pattern(1, 5000), 3 * 4096 + 7).expect("w");
    f.write_all_at(&pattern(2, 5000), 100 * 4096).expect("w");
    f.sync_all().expect("fsync");
    drop(f);
    want.push(("/sparse".into(), read_all(&fs, "/sparse")));
    fs.close().expect("close");
    let m = match LoopMount::new(img.path(), false, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    for (p, d) in &want {
        let got = std::fs::read(m.path().join(&p[1..])).expect("kernel read");
        assert_eq!(&got, d, "kernel: {p}");
    }
    let k = pattern(77, 200_000);
    std::fs::write(m.path().join("kern"), &k).expect("kernel write");
    m.unmount().expect("umount");
    let fs = rw(img.path());
    assert_eq!(read_all(&fs, "/kern"), k);
    fs.set_len("/kern", 5000).expect("truncate kernel's file");
    clean(fs, img.path(), "after kernel");
}
