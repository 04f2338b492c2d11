//! Inline data (`mke2fs -O inline_data`): trees the kernel wrote (small files, small
//! directories and long symlinks in their inodes, big ones in blocks) read identically
//! through rext4; rext4's writes keep small files and new directories inline as the
//! kernel does, convert them to a block when they outgrow the inode (files by writes,
//! truncates, O_DIRECT and fallocate; directories by names), shrink them back in place
//! by truncate, rename, link and unlink names inside inline directories, keep xattrs
//! beside `system.data` — and every image is `e2fsck -fn` clean and reads the same
//! through the kernel. Damaged inline data is `Corrupted`, never a panic.

mod common;

use std::path::Path;

use rext4::format::inode::flags;
use rext4::{Error, FallocMode, Fs, FsOptions, Ino, XattrFlags};
use rext4_testkit::{
    diff_trees, e2fsck_fn, mkfs, skip, snapshot_dir, Compare, Image, LoopMount, MkfsOptions,
};

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn inline_mkfs(bs: u32) -> Image {
    mkfs(&MkfsOptions::new(bs, 32 << 20).arg("-O").arg("inline_data")).expect("mkfs")
}

fn flags_of(fs: &Fs, path: &str) -> u32 {
    fs.metadata(path).expect("stat").flags
}

fn is_inline(fs: &Fs, path: &str) -> bool {
    flags_of(fs, path) & flags::INLINE_DATA != 0
}

fn clean(img: &Path, label: &str) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "[{label}] e2fsck:\n{}", r.output);
}

/// The kernel's view (read-only loop mount) equals rext4's; `None` without loop
/// mounts (skipped).
fn same_as_kernel(img: &Path, label: &str) -> Option<()> {
    let fs = Fs::open(img).expect("rext4 opens");
    let audit = fs.audit().expect("audit");
    assert!(
        audit.problems.is_empty(),
        "[{label}] audit: {:?}",
        audit.problems
    );
    let ours = common::snapshot(&fs).expect("rext4 reads the tree");
    drop(fs);
    let m = match LoopMount::new(img, true, "noatime") {
        Ok(m) => m,
        Err(why) => {
            skip(&why);
            return None;
        }
    };
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(d.is_empty(), "[{label}] kernel vs rext4:\n{}", d.join("\n"));
    Some(())
}

/// Files of sizes around the inline limits, small and large directories, symlinks,
/// xattrs: written by the kernel.
fn kernel_tree(mnt: &Path) {
    for (i, len) in [0usize, 1, 59, 60, 61, 100, 128, 129, 150, 4096, 70_000]
        .iter()
        .enumerate()
    {
        std::fs::write(mnt.join(format!("f{len}")), bytes(i as u64, *len)).expect("write");
    }
    std::fs::create_dir(mnt.join("small")).expect("mkdir");
    for i in 0..3 {
        std::fs::write(mnt.join(format!("small/n{i}")), b"x").expect("write");
    }
    std::fs::create_dir(mnt.join("mid")).expect("mkdir");
    for i in 0..6 {
        std::fs::write(mnt.join(format!("mid/name{i}")), b"y").expect("write");
    }
    std::fs::create_dir(mnt.join("big")).expect("mkdir");
    for i in 0..200 {
        std::fs::write(mnt.join(format!("big/entry-{i:04}")), bytes(i, 30)).expect("write");
    }
    std::fs::create_dir(mnt.join("empty")).expect("mkdir");
    std::os::unix::fs::symlink("short", mnt.join("ls")).expect("symlink");
    std::os::unix::fs::symlink("t".repeat(100), mnt.join("ll")).expect("symlink");
    std::os::unix::fs::symlink("u".repeat(300), mnt.join("lll")).expect("symlink");
    std::fs::hard_link(mnt.join("f100"), mnt.join("small/link100")).expect("link");
}

fn kernel_image(bs: u32) -> Option<Image> {
    let img = inline_mkfs(bs);
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(why) => {
            skip(&why);
            return None;
        }
    };
    kernel_tree(m.path());
    m.unmount().expect("unmount");
    clean(img.path(), "kernel image");
    Some(img)
}

#[test]
fn kernel_written_tree_reads_identically() {
    for bs in [4096, 1024] {
        let Some(img) = kernel_image(bs) else {
            return;
        };
        let fs = Fs::open(img.path()).expect("open");
        // The kernel put the small ones inline: this test reads inline data.
        assert!(is_inline(&fs, "/f100"), "kernel made f100 inline");
        assert!(is_inline(&fs, "/small"), "kernel made small/ inline");
        assert!(!is_inline(&fs, "/f4096"));
        assert_eq!(fs.read("/f129").expect("read"), bytes(7, 129));
        assert_eq!(
            fs.read_link("/ll").expect("readlink"),
            "t".repeat(100).as_bytes()
        );
        let names: Vec<Vec<u8>> = fs
            .read_dir("/mid")
            .expect("readdir")
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names.len(), 6);
        assert!(fs
            .xattrs("/f100")
            .expect("xattrs")
            .iter()
            .all(|(n, _)| n != b"system.data"));
        drop(fs);
        same_as_kernel(img.path(), &format!("kernel tree {bs}"));
    }
}

#[test]
fn files_stay_inline_grow_to_blocks_and_shrink() {
    let img = inline_mkfs(4096);
    {
        let fs = Fs::open_with(img.path(), rw()).expect("open");
        fs.write("/a", bytes(1, 40)).expect("write");
        assert!(is_inline(&fs, "/a"), "a new small file goes inline");
        fs.write("/b", bytes(2, 120)).expect("write");
        assert!(is_inline(&fs, "/b"), "120 bytes fit a 256-byte inode");
        // Grow past what the inode holds: one block, the bytes kept.
        let f = rext4::OpenOptions::new()
            .write(true)
            .open(&fs, "/b")
            .expect("open b");
        f.write_at(&bytes(3, 100), 120).expect("append");
        drop(f);
        assert!(!is_inline(&fs, "/b"), "grown past the inode");
        let mut want = bytes(2, 120);
        want.extend(bytes(3, 100));
        assert_eq!(fs.read("/b").expect("read"), want);
        // Truncate inside the inline area keeps it inline; the tail reads as zeros
        // once grown again.
        fs.write("/c", bytes(4, 128)).expect("write");
        fs.set_len("/c", 70).expect("shrink");
        assert!(is_inline(&fs, "/c"));
        fs.set_len("/c", 100).expect("grow");
        assert!(is_inline(&fs, "/c"));
        let mut c = bytes(4, 70);
        c.resize(100, 0);
        assert_eq!(fs.read("/c").expect("read"), c);
        // Truncate past it converts.
        fs.set_len("/c", 10_000).expect("grow past");
        assert!(!is_inline(&fs, "/c"));
        c.resize(10_000, 0);
        assert_eq!(fs.read("/c").expect("read"), c);
        // Overwrite inside an inline file.
        fs.write("/d", bytes(5, 90)).expect("write");
        let f = rext4::OpenOptions::new()
            .write(true)
            .open(&fs, "/d")
            .expect("open d");
        f.write_at(b"HELLO", 58).expect("overwrite");
        drop(f);
        let mut d = bytes(5, 90);
        d[58..63].copy_from_slice(b"HELLO");
        assert_eq!(fs.read("/d").expect("read"), d);
        assert!(is_inline(&fs, "/d"));
        // xattrs beside system.data, then growth into them.
        let ino = fs.resolve(b"/d", false).expect("resolve");
        fs.set_xattr_ino(ino, b"user.k", b"value", XattrFlags::default())
            .expect("setxattr");
        assert_eq!(
            fs.get_xattr_ino(ino, b"user.k").expect("get"),
            Some(b"value".to_vec())
        );
        assert!(matches!(
            fs.get_xattr_ino(ino, b"system.data"),
            Err(Error::Unsupported(_))
        ));
        assert!(is_inline(&fs, "/d"));
        assert_eq!(fs.read("/d").expect("read"), d);
        fs.close().expect("close");
    }
    clean(img.path(), "files");
    same_as_kernel(img.path(), "files");
}

#[test]
fn o_direct_and_fallocate_convert_first() {
    let img = inline_mkfs(4096);
    {
        let fs = Fs::open_with(img.path(), rw()).expect("open");
        fs.write("/a", bytes(1, 50)).expect("write");
        fs.write("/b", bytes(2, 50)).expect("write");
        assert!(is_inline(&fs, "/a") && is_inline(&fs, "/b"));
        let a = fs.resolve(b"/a", false).expect("resolve");
        let mut buf = vec![0u8; 4096];
        // A direct read of an inline file reads its bytes.
        let f = rext4::OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&fs, "/a")
            .expect("open");
        let n = f.read_at(&mut buf, 0).expect("direct read");
        assert_eq!(&buf[..n], &bytes(1, 50)[..]);
        drop(f);
        let blk = vec![7u8; 4096];
        fs.write_direct_ino(a, &blk, 4096, true)
            .expect("direct write");
        assert!(!is_inline(&fs, "/a"));
        let mut want = bytes(1, 50);
        want.resize(4096, 0);
        want.extend_from_slice(&blk);
        assert_eq!(fs.read("/a").expect("read"), want);
        let b = fs.resolve(b"/b", false).expect("resolve");
        fs.fallocate_ino(b, FallocMode::KeepSize, 0, 8192)
            .expect("fallocate");
        assert!(!is_inline(&fs, "/b"));
        assert_eq!(fs.read("/b").expect("read"), bytes(2, 50));
        fs.close().expect("close");
    }
    clean(img.path(), "direct");
    same_as_kernel(img.path(), "direct");
}

#[test]
fn directories_inline_then_converted() {
    let img = inline_mkfs(4096);
    {
        let fs = Fs::open_with(img.path(), rw()).expect("open");
        fs.create_dir("/d").expect("mkdir");
        assert!(is_inline(&fs, "/d"), "a new directory starts inline");
        assert_eq!(fs.metadata("/d").expect("stat").size, 60);
        fs.write("/d/one", b"1").expect("create");
        fs.create_dir("/d/sub").expect("mkdir");
        fs.hard_link("/d/one", "/d/two").expect("link");
        assert!(is_inline(&fs, "/d"));
        fs.rename("/d/two", "/d/three").expect("rename");
        fs.write("/d/r", b"new").expect("create");
        fs.rename("/d/r", "/d/three2").expect("rename");
        fs.hard_link("/d/three", "/d/three2-old").expect("link");
        fs.rename("/d/three2", "/d/three2-old")
            .expect("rename over");
        fs.remove_file("/d/three2-old").expect("unlink");
        assert!(is_inline(&fs, "/d"), "renames stay in the inode");
        fs.remove_file("/d/one").expect("unlink");
        assert!(fs.remove_dir("/d").is_err(), "not empty");
        fs.remove_dir("/d/sub").expect("rmdir");
        let names: Vec<Vec<u8>> = fs
            .read_dir("/d")
            .expect("readdir")
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, vec![b"three".to_vec()]);
        // Grow it past the inode: it becomes a block, every name kept.
        for i in 0..40 {
            fs.write(format!("/d/file-with-a-long-name-{i:03}"), b"z")
                .expect("create");
        }
        assert!(!is_inline(&fs, "/d"));
        assert_eq!(fs.read_dir("/d").expect("readdir").len(), 41);
        assert_eq!(fs.read("/d/three").expect("read"), b"1");
        // ".." of an inline directory, and a move to another parent.
        fs.create_dir("/e").expect("mkdir");
        fs.create_dir("/e/f").expect("mkdir");
        assert_eq!(
            fs.resolve(b"/e/f/..", false).expect("dotdot"),
            fs.resolve(b"/e", false).expect("e")
        );
        fs.rename("/e/f", "/d/f").expect("move dir");
        assert_eq!(
            fs.resolve(b"/d/f/..", false).expect("dotdot"),
            fs.resolve(b"/d", false).expect("d")
        );
        fs.remove_dir("/e").expect("rmdir empty inline");
        // A move between two inline directories keeps both inline.
        fs.create_dir("/g").expect("mkdir");
        fs.create_dir("/h").expect("mkdir");
        fs.create_dir("/g/k").expect("mkdir");
        fs.rename("/g/k", "/h/k").expect("move");
        assert!(is_inline(&fs, "/g") && is_inline(&fs, "/h") && is_inline(&fs, "/h/k"));
        assert_eq!(
            fs.resolve(b"/h/k/..", false).expect("dotdot"),
            fs.resolve(b"/h", false).expect("h")
        );
        assert_eq!(fs.metadata("/h").expect("stat").nlink, 3);
        assert_eq!(fs.metadata("/g").expect("stat").nlink, 2);
        fs.close().expect("close");
    }
    clean(img.path(), "dirs");
    same_as_kernel(img.path(), "dirs");
}

#[test]
fn damaged_inline_data_is_an_error_not_a_panic() {
    let img = inline_mkfs(4096);
    {
        let fs = Fs::open_with(img.path(), rw()).expect("open");
        fs.write("/a", bytes(1, 100)).expect("write");
        fs.create_dir("/d").expect("mkdir");
        fs.write("/d/x", b"x").expect("create");
        fs.close().expect("close");
    }
    let (a, d) = {
        let fs = Fs::open(img.path()).expect("open");
        (
            fs.resolve(b"/a", false).expect("a"),
            fs.resolve(b"/d", false).expect("d"),
        )
    };
    // Patch records with debugfs: a size past the inline bytes, a directory record
    // crossing its area, system.data gone.
    let debugfs = |cmd: &str| {
        let out = std::process::Command::new("debugfs")
            .args(["-w", "-R", cmd])
            .arg(img.path())
            .output()
            .expect("debugfs");
        assert!(out.status.success(), "{cmd}: {:?}", out);
    };
    debugfs(&format!("sif <{}> size 5000", a.0));
    debugfs(&format!("sif <{}> block[2] 0x00000003", d.0));
    let fs = Fs::open(img.path()).expect("open");
    assert!(matches!(fs.read("/a"), Err(Error::Corrupted { .. })));
    assert!(matches!(fs.read_dir("/d"), Err(Error::Corrupted { .. })));
    drop(fs);
    debugfs(&format!("ea_rm <{}> system.data", a.0));
    let fs = Fs::open(img.path()).expect("open");
    match fs.read("/a") {
        Err(Error::Corrupted { what, .. }) => assert!(what.contains("system.data"), "{what}"),
        other => panic!("expected Corrupted, got {other:?}"),
    }
    let _ = Ino(0);
}
