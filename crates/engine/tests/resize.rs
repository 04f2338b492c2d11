//! `rext4::resize`: offline grow and shrink (issue 39, item 4).
//!
//! - `grow_4x_then_min_*`: on the default layouts (Debian's and upstream's mke2fs
//!   profiles, 1 KiB and 4 KiB blocks, an image made by mke2fs and one made by rext4's
//!   mkfs), a tree is written, the image grown to 4x, more written (into the new
//!   groups), then shrunk to `min`: each step e2fsck -fn clean, the tree unchanged
//!   (inode numbers aside: the shrink renumbers), the geometry as dumpe2fs reports it;
//!   the grow's group tables equal resize2fs's for the same size (mke2fs images); `min`
//!   at most 1.2x the size `resize2fs -M` reaches on the same image; the kernel mounts
//!   the result and sees the same tree (as root).
//! - `crash_*`: a grow 4x and a shrink to min run on a recording device, every move
//!   committed on its own; the image after a cut at a flush (and with the writes since
//!   lost or torn) opens — recovered by rext4, by e2fsck -fy, by the kernel (as root) —
//!   e2fsck -fn clean, with the old geometry or the new one and the tree unchanged.
//!   `REXT4_RESIZE_CRASH_POINTS` (default 12 per resize: the last half of them and a
//!   random choice of the rest) cut points, `REXT4_CRASH_VARIANTS` (default 2)
//!   lost/torn variants per cut.
//! - `refuses_*`: bad sizes (0, too small for the first group or the contents, past
//!   2^32 blocks without 64bit), a claimed image, a corrupt descriptor, bigalloc and no
//!   journal: a clear error and the image's bytes unchanged.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{env_u64, Recorder};
use rext4::resize::{self, Target};
use rext4::{Fs, FsOptions};
use rext4_testkit::crash::{self, Rng};
use rext4_testkit::{
    diff_trees, dumpe2fs_h, e2fsck_fn, mkfs, skip, snapshot_dir, Compare, Image, LoopMount,
    MkfsOptions, Tree,
};

/// What a resize may change in the tree: inode numbers (hard links compared by paths).
fn same_tree() -> Compare {
    Compare {
        ignore_ino: true,
        hardlinks_by_paths: true,
        ..Compare::default()
    }
}

fn tree_of(path: &Path) -> Tree {
    let fs = Fs::open(path).expect("open ro");
    common::snapshot(&fs).expect("snapshot")
}

fn tree_of_dev(dev: Arc<dyn rext4::device::BlockDevice>) -> rext4::Result<Tree> {
    let fs = Fs::open_device(dev, FsOptions::default())?;
    common::snapshot(&fs)
}

fn assert_same(a: &Tree, b: &Tree, what: &str) {
    let d = diff_trees(a, b, &same_tree());
    assert!(d.is_empty(), "{what}: the tree changed:\n{}", d.join("\n"));
}

fn assert_clean(path: &Path, what: &str) {
    let r = e2fsck_fn(path);
    assert!(r.clean, "{what}: e2fsck -fn is not clean:\n{}", r.output);
}

fn bytes_of(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// Write a tree that exercises what a shrink moves: files of many sizes in directories
/// spread over the groups, a directory big enough for an htree, files with many
/// extents, sparse files, fast and slow symlinks, hard links, in-inode and block
/// xattrs, devices and fifos, nested directories (their `..` entries).
fn populate(fs: &Fs, tag: &str, seed: u64) {
    let mut rng = Rng(seed | 1);
    let top = format!("/{tag}");
    fs.create_dir(&top).expect("mkdir");
    for d in 0..10 {
        let dir = format!("{top}/d{d}");
        fs.create_dir(&dir).expect("mkdir");
        for f in 0..12 {
            let len = (rng.below(5000) + if f == 0 { 0 } else { 1 }) as usize;
            let data = bytes_of(&mut rng, len);
            fs.write(format!("{dir}/f{f}"), &data).expect("write");
        }
        fs.create_dir_all(format!("{dir}/x/y/z")).expect("mkdir -p");
    }
    // An htree directory.
    let big = format!("{top}/big");
    fs.create_dir(&big).expect("mkdir");
    for i in 0..300 {
        fs.write(format!("{big}/entry-with-a-longish-name-{i:05}"), [i as u8])
            .expect("write");
    }
    // Two files written in turns: many extents each (a tree below the inode).
    for name in ["frag1", "frag2"] {
        fs.write(format!("{top}/{name}"), []).expect("create");
    }
    let chunk = 4096usize;
    for i in 0..160u64 {
        for name in ["frag1", "frag2"] {
            let f = rext4::OpenOptions::new()
                .write(true)
                .open(fs, format!("{top}/{name}"))
                .expect("open");
            let data = bytes_of(&mut rng, chunk);
            f.write_at(&data, i * chunk as u64).expect("write");
            f.sync_all().expect("fsync");
        }
    }
    // Sparse.
    let sp = rext4::OpenOptions::new()
        .write(true)
        .create(true)
        .open(fs, format!("{top}/sparse"))
        .expect("create");
    for off in [0u64, 300 << 10, 3 << 20] {
        sp.write_at(&bytes_of(&mut rng, 5000), off).expect("write");
    }
    drop(sp);
    fs.symlink("d0/f1", format!("{top}/fast")).expect("symlink");
    fs.symlink("x".repeat(300), format!("{top}/slow"))
        .expect("symlink");
    fs.hard_link(format!("{top}/d1/f1"), format!("{top}/hl1"))
        .expect("link");
    fs.hard_link(format!("{top}/d1/f1"), format!("{top}/d2/hl2"))
        .expect("link");
    for (i, path) in [
        format!("{top}/d3/f2"),
        format!("{top}/d4/f3"),
        format!("{top}/d5"),
    ]
    .iter()
    .enumerate()
    {
        let ino = fs.metadata(path).expect("stat").ino;
        fs.set_xattr_ino(ino, b"user.small", b"v", Default::default())
            .expect("xattr");
        let big = vec![b'a' + i as u8; 700];
        fs.set_xattr_ino(ino, b"user.big", &big, Default::default())
            .expect("xattr");
    }
    fs.mknod(format!("{top}/chr"), 0o20644, (1, 3))
        .expect("mknod");
    fs.mknod(format!("{top}/fifo"), 0o10600, (0, 0))
        .expect("mknod");
}

/// The "Group N" section of `dumpe2fs` with checksums blanked.
fn group_tables(path: &Path) -> Vec<String> {
    let out = std::process::Command::new("dumpe2fs")
        .arg(path)
        .output()
        .expect("dumpe2fs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines: Vec<String> = Vec::new();
    let mut on = false;
    for l in text.lines() {
        if l.starts_with("Group 0:") {
            on = true;
        }
        if on {
            let mut s = String::new();
            let mut words = l.split(' ').peekable();
            while let Some(w) = words.next() {
                s.push_str(w);
                s.push(' ');
                if w == "csum" {
                    words.next();
                    s.push_str("X ");
                }
            }
            lines.push(s);
        }
    }
    lines
}

fn dumpe2fs_num(path: &Path, key: &str) -> u64 {
    let h = dumpe2fs_h(path).expect("dumpe2fs -h");
    h.get(key)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("dumpe2fs -h has no {key}"))
}

/// Resize a copy with resize2fs (`size` None: -M); returns its block count.
fn resize2fs(src: &Path, size: Option<u64>, bs: u32) -> (Image, u64) {
    let copy = Image::create_sparse(std::fs::metadata(src).expect("stat").len()).expect("img");
    std::fs::copy(src, copy.path()).expect("copy");
    if let Some(n) = size {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(copy.path())
            .expect("open");
        f.set_len(n * u64::from(bs)).expect("extend");
    }
    let mut cmd = std::process::Command::new("resize2fs");
    cmd.env("RESIZE2FS_FORCE_ITABLE_INIT", "1").arg("-f");
    match size {
        Some(n) => cmd.arg(copy.path()).arg(n.to_string()),
        None => cmd.arg("-M").arg(copy.path()),
    };
    let out = cmd.output().expect("resize2fs");
    assert!(
        out.status.success(),
        "resize2fs: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let n = dumpe2fs_num(copy.path(), "Block count");
    (copy, n)
}

/// How the image under test is made.
#[derive(Clone, Copy, Debug)]
enum Maker {
    Mke2fs,
    Rext4,
}

fn grow_then_min(maker: Maker, upstream: bool, bs: u32, size: u64) {
    let label = format!("{maker:?} upstream={upstream} bs={bs} size={size}");
    let img = match maker {
        Maker::Mke2fs => mkfs(&MkfsOptions::new(bs, size).upstream(upstream)).expect("mkfs"),
        Maker::Rext4 => {
            let img = Image::create_sparse(0).expect("img");
            std::fs::remove_file(img.path()).expect("rm");
            let opts = rext4::mkfs::MkfsOptions {
                block_size: Some(bs),
                upstream_defaults: upstream,
                ..Default::default()
            };
            rext4::mkfs::mkfs_file(img.path(), size, &opts).expect("rext4 mkfs");
            img
        }
    };
    let path = img.path();
    {
        let fs = common::open_rw(path);
        populate(&fs, "before", 7);
        fs.close().expect("close");
    }
    assert_clean(path, &format!("{label}: populated"));
    let before = tree_of(path);
    let old_blocks = dumpe2fs_num(path, "Block count");
    let ipg = dumpe2fs_num(path, "Inodes per group");

    // Grow to 4x.
    let want = old_blocks * 4;
    let reference = matches!(maker, Maker::Mke2fs).then(|| resize2fs(path, Some(want), bs));
    let r = resize::resize(path, Target::Blocks(want)).expect("grow");
    assert_eq!((r.old_blocks, r.new_blocks), (old_blocks, want), "{label}");
    assert_clean(path, &format!("{label}: grown"));
    assert_same(&before, &tree_of(path), &format!("{label}: grown"));
    assert_eq!(dumpe2fs_num(path, "Block count"), want, "{label}");
    assert_eq!(
        dumpe2fs_num(path, "Inode count"),
        r.new_groups * ipg,
        "{label}"
    );
    assert_eq!(
        std::fs::metadata(path).expect("stat").len(),
        want * u64::from(bs)
    );
    if let Some((copy, n)) = reference {
        assert_eq!(n, want, "{label}: resize2fs's size");
        let (ours, theirs) = (group_tables(path), group_tables(copy.path()));
        let diffs: Vec<String> = ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| a != b)
            .map(|(a, b)| format!("rext4:     {a}\nresize2fs: {b}"))
            .take(10)
            .collect();
        assert!(
            diffs.is_empty() && ours.len() == theirs.len(),
            "{label}: group tables differ from resize2fs's:\n{}",
            diffs.join("\n")
        );
    }

    // More files, now spread over the new groups too.
    {
        let fs = common::open_rw(path);
        populate(&fs, "after", 11);
        fs.close().expect("close");
    }
    assert_clean(path, &format!("{label}: populated again"));
    let grown = tree_of(path);
    let (_theirs_img, theirs) = resize2fs(path, None, bs);

    // Shrink to min.
    let r = resize::resize(path, Target::Min).expect("shrink to min");
    assert!(r.new_blocks < want, "{label}: min did not shrink ({r:?})");
    assert!(
        r.moved_blocks > 0 && r.moved_inodes > 0,
        "{label}: the shrink moved nothing ({r:?})"
    );
    assert_clean(path, &format!("{label}: shrunk to min"));
    assert_same(&grown, &tree_of(path), &format!("{label}: shrunk"));
    assert_eq!(dumpe2fs_num(path, "Block count"), r.new_blocks, "{label}");
    assert_eq!(
        dumpe2fs_num(path, "Inode count"),
        r.new_groups * ipg,
        "{label}"
    );
    assert_eq!(
        std::fs::metadata(path).expect("stat").len(),
        r.new_blocks * u64::from(bs),
        "{label}: the file is not truncated"
    );
    assert!(
        r.new_blocks as f64 <= 1.2 * theirs as f64,
        "{label}: min is {} blocks, resize2fs -M reaches {theirs}",
        r.new_blocks
    );
    eprintln!(
        "{label}: {old_blocks} -> {want} -> {} blocks (resize2fs -M: {theirs}); moved {} \
         blocks, {} inodes, journal: {}",
        r.new_blocks, r.moved_blocks, r.moved_inodes, r.journal_moved
    );
    // min again: nothing more to do.
    let again = resize::resize(path, Target::Min).expect("min again");
    assert!(again.new_blocks <= r.new_blocks, "{label}: {again:?}");
    assert_clean(path, &format!("{label}: min again"));

    // The kernel sees the same tree.
    let m = match LoopMount::new(path, true, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel view: {e}")),
    };
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    drop(m);
    assert_same(&tree_of(path), &kernel, &format!("{label}: kernel view"));
}

#[test]
fn grow_4x_then_min_mke2fs_debian_1k() {
    grow_then_min(Maker::Mke2fs, false, 1024, 24 << 20);
}

#[test]
fn grow_4x_then_min_mke2fs_upstream_4k() {
    grow_then_min(Maker::Mke2fs, true, 4096, 96 << 20);
}

#[test]
fn grow_4x_then_min_mke2fs_upstream_1k() {
    grow_then_min(Maker::Mke2fs, true, 1024, 24 << 20);
}

#[test]
fn grow_4x_then_min_mke2fs_debian_4k() {
    grow_then_min(Maker::Mke2fs, false, 4096, 96 << 20);
}

#[test]
fn grow_4x_then_min_rext4_mkfs_debian_4k() {
    grow_then_min(Maker::Rext4, false, 4096, 96 << 20);
}

#[test]
fn grow_4x_then_min_rext4_mkfs_upstream_1k() {
    grow_then_min(Maker::Rext4, true, 1024, 24 << 20);
}

/// Write `img` into a fresh sparse file (only its non-zero 4 KiB pieces).
fn sparse_file(img: &[u8]) -> Image {
    use std::os::unix::fs::FileExt;
    let f = Image::create_sparse(img.len() as u64).expect("img");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(f.path())
        .expect("open");
    for (i, c) in img.chunks(4096).enumerate() {
        if c.iter().any(|&b| b != 0) {
            file.write_at(c, (i * 4096) as u64).expect("write");
        }
    }
    f
}

/// Geometry of an image: its block count.
fn blocks_of_image(path: &Path) -> u64 {
    let fs = Fs::open(path).expect("open");
    fs.superblock().blocks_count
}

/// Whether the geometry in `img`'s superblock is not the one its journal replays to
/// (cut between the switch's commit and its superblock's home write).
fn in_switch_window(img: &[u8]) -> bool {
    let raw = rext4::format::superblock::Superblock::decode(&img[1024..2048]);
    let dev = Arc::new(rext4::device::MemDevice::new(img.to_vec()));
    match (raw, Fs::open_device(dev, FsOptions::default())) {
        (Ok(raw), Ok(fs)) => raw.blocks_count != fs.superblock().blocks_count,
        _ => false,
    }
}

/// Run `target` on a recording device over `base`, then check the image after a cut
/// at every flush (and with the writes since lost or torn): recovered (by rext4 or
/// e2fsck -fy, in turn; by the kernel too as root), it is e2fsck -fn clean, holds
/// `before`, and has `base`'s size or the new one. Returns the number of images.
fn crash_sweep(label: &str, base: &[u8], target: Target, before: &Tree) -> usize {
    let rec = Arc::new(Recorder::new(base.to_vec()));
    let old_blocks = {
        let fs = Fs::open_device(
            Arc::new(rext4::device::MemDevice::new(base.to_vec())),
            FsOptions::default(),
        )
        .expect("open base");
        fs.superblock().blocks_count
    };
    // Every move committed on its own: each is a state a cut can leave.
    let opts = resize::ResizeOptions { commit_every: 1 };
    let report = resize::resize_device_with(rec.clone(), target, &opts).expect("resize");
    let events = rec.take();
    let flushes = crash::flush_points(&events);
    let variants = env_u64("REXT4_CRASH_VARIANTS", 2);
    let kernel_ok = rext4_testkit::can_loop_mount().is_ok();
    let mut rng = Rng(0x5eed ^ old_blocks);
    let mut points: Vec<usize> = flushes.iter().map(|&p| p + 1).collect();
    points.insert(0, 0);
    points.push(events.len());
    // CI checks a sample: the last cuts (the switch, its checkpoint, the finish) and a
    // random choice of the others (the evacuation's moves, the preparation);
    // REXT4_RESIZE_CRASH_POINTS raises the count (every cut when it is large enough).
    let all = points.len();
    let max = env_u64("REXT4_RESIZE_CRASH_POINTS", 12) as usize;
    if all > max {
        let tail = points.split_off(all - (max / 2).min(all));
        while points.len() > max - tail.len() {
            let i = rng.below(points.len() as u64) as usize;
            points.remove(i);
        }
        points.extend(tail);
    }
    eprintln!(
        "{label}: {} events, {all} cut points, checking {}",
        events.len(),
        points.len()
    );
    let (mut n, mut window) = (0, 0);
    for (k, &p) in points.iter().enumerate() {
        let mut imgs = vec![crash::image_at(base, &events, p)];
        if p < events.len() && crash::writes_after(&events, p) > 0 {
            for _ in 0..variants {
                imgs.push(crash::image_with_lost_writes(base, &events, p, &mut rng));
            }
        }
        for (v, img) in imgs.into_iter().enumerate() {
            let mut how = match (k + v) % 3 {
                0 if kernel_ok => "kernel",
                1 => "e2fsck",
                _ => "rext4",
            };
            // The kernel reads the geometry before it replays the log: an image cut
            // between the switch's commit and its superblock's home write is not its
            // to recover (the module note of rext4::resize; the kernel's own online
            // resize has the same window).
            if how == "kernel" && in_switch_window(&img) {
                how = "rext4";
                window += 1;
            }
            let what = format!(
                "{label}: cut at event {p}/{} (variant {v}), {how}",
                events.len()
            );
            let f = sparse_file(&img);
            if let Err(e) = common::recover(f.path(), how) {
                if let Ok(d) = std::env::var("REXT4_CRASH_DUMP") {
                    let _ = std::fs::create_dir_all(&d);
                    let _ = std::fs::write(format!("{d}/crash.img"), &img);
                }
                panic!("{what}: recovery: {e}");
            }
            assert_clean(f.path(), &what);
            let blocks = blocks_of_image(f.path());
            assert!(
                blocks == old_blocks || blocks == report.new_blocks,
                "{what}: {blocks} blocks, neither {old_blocks} nor {}",
                report.new_blocks
            );
            assert_same(before, &tree_of(f.path()), &what);
            n += 1;
        }
    }
    eprintln!(
        "{label}: {} events, {} flushes, {n} crash images checked ({old_blocks} -> {} \
         blocks; {window} in the switch's window given to rext4 instead of the kernel)",
        events.len(),
        flushes.len(),
        report.new_blocks
    );
    n
}

#[test]
fn crash_during_grow_and_shrink_leaves_the_old_or_the_new_filesystem() {
    let bs = 1024u32;
    let small = 8u64 << 20;
    let img = mkfs(&MkfsOptions::new(bs, small)).expect("mkfs");
    {
        let fs = common::open_rw(img.path());
        populate(&fs, "t", 3);
        fs.close().expect("close");
    }
    let before = tree_of(img.path());
    // Grow to 4x: the device is the new size from the start (as the file would be).
    let mut base = std::fs::read(img.path()).expect("read");
    base.resize((small * 4) as usize, 0);
    let n_grow = crash_sweep(
        "grow",
        &base,
        Target::Blocks(small * 4 / u64::from(bs)),
        &before,
    );
    // The grown image with more files in the new groups, shrunk to min.
    let grown = Arc::new(rext4::device::MemDevice::new(base));
    resize::resize_device(grown.clone(), Target::Blocks(small * 4 / u64::from(bs))).expect("grow");
    {
        let fs = common::open_device_rw(grown.clone());
        populate(&fs, "u", 5);
        fs.close().expect("close");
    }
    let before = tree_of_dev(grown.clone()).expect("tree");
    let n_shrink = crash_sweep("shrink to min", &grown.snapshot(), Target::Min, &before);
    assert!(n_grow >= 8 && n_shrink >= 8, "too few crash images");
}

/// `resize` on `img` to `target` fails with an error whose text has `words`, and the
/// image's bytes and length are as they were.
fn refused(img: &Path, target: Target, words: &str) -> rext4::Error {
    let before = std::fs::read(img).expect("read");
    let e = resize::resize(img, target).expect_err("resize must be refused");
    assert!(
        e.to_string().contains(words),
        "{target:?}: expected an error saying {words:?}, got: {e}"
    );
    assert!(
        std::fs::read(img).expect("read") == before,
        "{target:?}: the image changed"
    );
    e
}

#[test]
fn refuses_absurd_sizes_a_claimed_image_and_corrupt_metadata_unchanged() {
    let img = mkfs(&MkfsOptions::new(1024, 8 << 20)).expect("mkfs");
    {
        let fs = common::open_rw(img.path());
        populate(&fs, "t", 7);
        fs.close().expect("close");
    }
    let e = refused(img.path(), Target::Blocks(0), "at least one group");
    assert!(matches!(e, rext4::Error::InvalidInput(_)), "{e:?}");
    refused(img.path(), Target::Blocks(20), "too small");
    // Past 2^32 blocks without 64bit (mke2fs's Debian default has 64bit; this
    // image is made without).
    let img32 = mkfs(&MkfsOptions::new(1024, 8 << 20).arg("-O").arg("^64bit")).expect("mkfs");
    refused(img32.path(), Target::Blocks(1 << 33), "no 64bit feature");
    // Smaller than the contents (the data alone is more than 1,000 blocks).
    refused(img.path(), Target::Blocks(1500), "contents");
    // Claimed: a read-write open holds it.
    {
        let fs = common::open_rw(img.path());
        let before = std::fs::read(img.path()).expect("read");
        let e = resize::resize(img.path(), Target::Blocks(16384)).expect_err("claimed");
        assert!(matches!(e, rext4::Error::InUse(_)), "{e:?}");
        assert!(std::fs::read(img.path()).expect("read") == before);
        fs.close().expect("close");
    }
    // A corrupt descriptor (its checksum no longer matches): refused before anything
    // is written.
    let mut raw = std::fs::read(img.path()).expect("read");
    let gdt = 2 * 1024; // 1 KiB blocks: the descriptors follow the superblock's block
    raw[gdt + 12] ^= 0x40; // group 0's free-blocks count
    std::fs::write(img.path(), &raw).expect("write");
    refused(img.path(), Target::Blocks(16384), "");
    refused(img.path(), Target::Min, "");
}

#[test]
fn refuses_bigalloc_and_no_journal_by_name() {
    let big = mkfs(&MkfsOptions::new(4096, 64 << 20).arg("-O").arg("bigalloc")).expect("mkfs");
    let e = refused(big.path(), Target::Blocks(32768), "bigalloc");
    assert!(matches!(e, rext4::Error::Unsupported(_)), "{e:?}");
    let nj = mkfs(
        &MkfsOptions::new(4096, 16 << 20)
            .arg("-O")
            .arg("^has_journal"),
    )
    .expect("mkfs");
    refused(nj.path(), Target::Blocks(8192), "journal");
}

/// One past the last data block of any block-mapped file in the tree (0 if none).
fn block_map_high(path: &Path) -> u64 {
    let fs = Fs::open(path).expect("open");
    let bs = u64::from(fs.block_size());
    let mut high = 0;
    let mut stack = vec![rext4::Ino::ROOT];
    while let Some(dir) = stack.pop() {
        for e in fs.read_dir_ino(dir).expect("read_dir") {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let inode = fs.read_inode(e.ino).expect("inode");
            if e.file_type == rext4::FileType::Dir {
                stack.push(e.ino);
            }
            let mapped = inode.mode & 0o170000 == 0o100000 || e.file_type == rext4::FileType::Dir;
            if !mapped || inode.has_flag(rext4::format::inode::flags::EXTENTS) {
                continue;
            }
            for (_, m) in fs
                .extents(e.ino, &inode, inode.size.div_ceil(bs))
                .expect("map")
            {
                if let rext4::map::Mapping::Mapped { physical, len, .. } = m {
                    high = high.max(physical + len);
                }
            }
        }
    }
    high
}

/// A block-mapped journal is refused; block-mapped files (an ext4 image made without
/// extents, converted with tune2fs -O extents, its journal made again) are not moved: a shrink that would cut one off is refused by name, the
/// image left as it was (old geometry, same tree, e2fsck clean); `min` stops past
/// them.
#[test]
fn block_mapped_files_bound_a_shrink() {
    let img = mkfs(
        &MkfsOptions::new(1024, 32 << 20)
            .arg("-O")
            .arg("^extents,^64bit"),
    )
    .expect("mkfs");
    {
        let fs = common::open_rw(img.path());
        populate(&fs, "t", 11);
        fs.close().expect("close");
    }
    let out = std::process::Command::new("tune2fs")
        .args(["-O", "extents"])
        .arg(img.path())
        .output()
        .expect("tune2fs");
    assert!(out.status.success(), "tune2fs: {out:?}");
    // The journal mke2fs made is block-mapped too: refused by name, image unchanged.
    let e = refused(img.path(), Target::Min, "block-mapped journal");
    assert!(matches!(e, rext4::Error::Unsupported(_)), "{e:?}");
    // Made again, now with extents, as libext2fs makes it.
    for args in [["-O", "^has_journal"], ["-O", "has_journal"]] {
        let out = std::process::Command::new("tune2fs")
            .args(args)
            .arg(img.path())
            .output()
            .expect("tune2fs");
        assert!(out.status.success(), "tune2fs {args:?}: {out:?}");
    }
    {
        let fs = common::open_rw(img.path());
        populate(&fs, "u", 12);
        fs.close().expect("close");
    }
    let before = tree_of(img.path());
    let high = block_map_high(img.path());
    assert!(high > 0, "no block-mapped file");
    let old = blocks_of_image(img.path());
    let min = resize::min_size(img.path()).expect("min size");
    if min < high {
        let e = resize::resize(img.path(), Target::Blocks(min)).expect_err("must refuse");
        assert!(e.to_string().contains("block-mapped"), "{e}");
        assert_clean(img.path(), "refused shrink");
        assert_eq!(blocks_of_image(img.path()), old);
        assert_same(&before, &tree_of(img.path()), "refused shrink");
    } else {
        eprintln!("the block-mapped files end at {high}, below min {min}: no refusal to see");
    }
    let r = resize::resize(img.path(), Target::Min).expect("min");
    assert!(
        r.new_blocks >= high && r.new_blocks <= old,
        "{r:?}, block maps end at {high}"
    );
    assert_clean(img.path(), "min");
    assert_same(&before, &tree_of(img.path()), "min");
}
