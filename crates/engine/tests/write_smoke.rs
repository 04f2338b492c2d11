//! First end-to-end checks of the write path: changes made through the API on an
//! mkfs.ext4 image pass e2fsck -fn and read back identically, also through the kernel.

mod common;

use rext4::format::inode::Timestamp;
use rext4::{Fs, OpenOptions};
use rext4_testkit::{e2fsck_fn, mkfs, skip, snapshot_dir, LoopMount, MkfsOptions};

use common::open_rw as rw;

#[test]
fn create_write_read_back_and_fsck() {
    let variants = [
        ("1k", MkfsOptions::new(1024, 64 << 20)),
        ("4k", MkfsOptions::new(4096, 64 << 20)),
        // 128-byte inodes: 16-bit inode checksums, no nanoseconds, no extra fields.
        (
            "4k -I 128",
            MkfsOptions::new(4096, 64 << 20).arg("-I").arg("128"),
        ),
    ];
    for (bs, opts) in variants {
        let small = opts.extra_args.iter().any(|a| a == "128");
        let img = mkfs(&opts).expect("mkfs");
        let fs = rw(img.path());
        fs.create_dir("/d").expect("mkdir");
        fs.write("/d/hello", b"hello world").expect("write");
        let big: Vec<u8> = (0..3_000_000u32)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        fs.write("/big", &big).expect("write big");
        fs.symlink("/d/hello", "/ln").expect("symlink");
        fs.symlink("x".repeat(200), "/slow").expect("slow symlink");
        fs.hard_link("/d/hello", "/d/hl").expect("link");
        for i in 0..300 {
            fs.write(format!("/d/f{i:04}-with-a-longer-name"), format!("{i}"))
                .expect("many");
        }
        fs.rename("/d/f0001-with-a-longer-name", "/moved")
            .expect("rename");
        fs.remove_file("/d/f0002-with-a-longer-name")
            .expect("unlink");
        let f = OpenOptions::new()
            .write(true)
            .open(&fs, "/big")
            .expect("open");
        f.set_len(1_000_000).expect("truncate");
        // Times past what the inode holds are clamped as the kernel stores them: the
        // 34-bit range with nanoseconds, or whole 32-bit seconds in 128-byte inodes.
        let (late, early) = (
            Timestamp {
                sec: 20_000_000_000,
                nsec: 9,
            },
            Timestamp {
                sec: -1_000_000,
                nsec: 9,
            },
        );
        fs.set_times("/d/hello", Some(early), Some(late))
            .expect("utimens");
        let m = fs.metadata("/d/hello").expect("stat");
        let want_mtime = if small {
            Timestamp {
                sec: i32::MAX.into(),
                nsec: 0,
            }
        } else {
            Timestamp {
                sec: 0x3_7FFF_FFFF,
                nsec: 0,
            }
        };
        let want_atime = if small {
            Timestamp {
                sec: -1_000_000,
                nsec: 0,
            }
        } else {
            early
        };
        assert_eq!((m.atime, m.mtime), (want_atime, want_mtime), "{bs}");
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "bs {bs}: {}", r.output);
        let fs = Fs::open(img.path()).expect("reopen");
        assert_eq!(fs.read("/d/hello").expect("read"), b"hello world");
        assert_eq!(fs.read("/big").expect("read"), &big[..1_000_000]);
        assert_eq!(
            fs.read_link("/slow").expect("readlink"),
            "x".repeat(200).as_bytes()
        );
        assert_eq!(fs.metadata("/d/hl").expect("stat").nlink, 2);
        let ours = common::snapshot(&fs).expect("walk");
        let m = match LoopMount::new(img.path(), true, "noatime") {
            Ok(m) => m,
            Err(e) => return skip(&e),
        };
        let kernel = snapshot_dir(m.path()).expect("kernel");
        drop(m);
        let d = rext4_testkit::diff_trees(&kernel, &ours, &rext4_testkit::Compare::exact());
        assert!(d.is_empty(), "{d:?}");
    }
}

#[test]
fn open_rw_marks_the_image_in_use_until_close() {
    // With a journal: needs_recovery while open (as the kernel), state stays clean.
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/a", b"x").expect("write");
    fs.sync().expect("sync");
    let h = rext4_testkit::dumpe2fs_h(img.path()).expect("dumpe2fs");
    assert!(h["Filesystem features"].contains("needs_recovery"), "{h:?}");
    fs.close().expect("close");
    let h = rext4_testkit::dumpe2fs_h(img.path()).expect("dumpe2fs");
    assert!(
        !h["Filesystem features"].contains("needs_recovery"),
        "{h:?}"
    );
    assert_eq!(h.get("Filesystem state").map(String::as_str), Some("clean"));
    assert!(matches!(fs.write("/b", b"y"), Err(rext4::Error::ReadOnly)));
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);

    // Without a journal: not clean on disk while open, as fuse2fs does.
    let img = mkfs(
        &MkfsOptions::new(4096, 16 << 20)
            .arg("-O")
            .arg("^has_journal"),
    )
    .expect("mkfs");
    let fs = rw(img.path());
    fs.write("/a", b"x").expect("write");
    fs.sync().expect("sync");
    let h = rext4_testkit::dumpe2fs_h(img.path()).expect("dumpe2fs");
    assert_eq!(
        h.get("Filesystem state").map(String::as_str),
        Some("not clean")
    );
    fs.close().expect("close");
    let h = rext4_testkit::dumpe2fs_h(img.path()).expect("dumpe2fs");
    assert_eq!(h.get("Filesystem state").map(String::as_str), Some("clean"));
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

#[test]
fn meta_bg_images_allocate_around_their_descriptor_blocks() {
    // 1 KiB blocks, 8 groups of 8 MiB: the file fills groups that were BLOCK_UNINIT,
    // some holding a superblock backup (3, 5, 7) but, under meta_bg, no descriptor
    // table; the groups' implicit bitmaps must match what e2fsck expects.
    let img = mkfs(
        &MkfsOptions::new(1024, 64 << 20)
            .arg("-O")
            .arg("meta_bg,^resize_inode"),
    )
    .expect("mkfs");
    let fs = rw(img.path());
    let data: Vec<u8> = (0..40u32 << 20).map(|i| (i / 1024) as u8).collect();
    fs.write("/big", &data).expect("write");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    let fs = Fs::open(img.path()).expect("reopen");
    assert!(fs.read("/big").expect("read") == data);
}

/// An image without the extent feature (ext3) opens read-write: new files get block
/// maps, as the kernel's ext4 driver gives them there.
#[test]
fn images_without_extents_open_read_write_with_block_maps() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20).arg("-t").arg("ext3")).expect("mkfs");
    let opts = rext4::FsOptions {
        read_only: false,
        ..rext4::FsOptions::default()
    };
    let fs = Fs::open_with(img.path(), opts).expect("opens");
    assert!(!fs.is_read_only(), "{:?}", fs.warnings());
    fs.write("/a", b"x").expect("write");
    let i = fs.resolve(b"/a", false).expect("resolve");
    assert_eq!(
        fs.inode_attr(i).expect("inode").flags & 0x8_0000,
        0,
        "block-mapped"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A create that fails after allocating its inode — here ENOSPC growing the directory
/// of a full filesystem — frees the inode again: no unattached inode or block is left.
#[test]
fn failed_creates_leave_no_inode_behind() {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let fill = OpenOptions::new()
        .write(true)
        .create(true)
        .open(&fs, "/fill")
        .expect("create");
    // Take every free block (ENOSPC keeps what was allocated, as on the kernel).
    let r = fs.fallocate_ino(fill.ino(), rext4::FallocMode::Allocate, 0, 64 << 20);
    assert!(matches!(r, Err(rext4::Error::NoSpace)), "{r:?}");
    drop(fill);
    let mut made = 0;
    let err = loop {
        match fs.write(format!("/file-with-a-long-name-{made:04}"), b"") {
            Ok(()) => made += 1,
            Err(e) => break e,
        }
        assert!(made < 1000, "the root directory never filled");
    };
    assert!(matches!(err, rext4::Error::NoSpace), "{err:?}");
    let long = "t".repeat(100);
    for r in [
        fs.create_dir("/new-directory-with-a-long-name"),
        fs.symlink(&long, "/new-symlink-with-a-long-name"),
        fs.symlink("short", "/new-short-symlink-with-a-long-name"),
    ] {
        assert!(matches!(r, Err(rext4::Error::NoSpace)), "{r:?}");
    }
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    let fs = Fs::open(img.path()).expect("reopen");
    // The files, /fill and lost+found (read_dir skips "." and "..").
    assert_eq!(fs.read_dir("/").expect("readdir").len(), made + 2);
}

/// The largest file is the kernel's `s_maxbytes`: 2^32 - 1 blocks. A write starting
/// there fails with EFBIG, one crossing it is short, truncate and fallocate past it
/// fail; the file stays consistent and e2fsck clean.
#[test]
fn size_limit_is_the_kernels() {
    for bs in [1024u32, 4096] {
        let img = mkfs(&MkfsOptions::new(bs, 64 << 20)).expect("mkfs");
        let fs = rw(img.path());
        let max = ((1u64 << 32) - 1) * u64::from(bs);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(&fs, "/big")
            .expect("create");
        let efbig = |r: rext4::Result<()>, what: &str| match r {
            Err(e) => assert_eq!(e.errno(), 27, "{bs}: {what}: {e}"),
            Ok(()) => panic!("{bs}: {what}: expected EFBIG"),
        };
        efbig(f.write_at(b"x", max).map(|_| ()), "write at the limit");
        efbig(
            f.write_at(b"x", u64::MAX - 1).map(|_| ()),
            "write at 2^64-2",
        );
        assert_eq!(f.write_at(&[7u8; 300], max - 100).expect("crossing"), 100);
        assert_eq!(f.len().expect("len"), max, "{bs}");
        let mut back = [0u8; 200];
        assert_eq!(f.read_at(&mut back, max - 200).expect("read"), 200);
        assert!(back[..100].iter().all(|&b| b == 0) && back[100..].iter().all(|&b| b == 7));
        efbig(f.set_len(max + 1), "truncate past the limit");
        f.set_len(max).expect("truncate to the limit");
        efbig(
            fs.fallocate_ino(f.ino(), rext4::FallocMode::KeepSize, max - 4096, 4097),
            "fallocate past the limit",
        );
        fs.fallocate_ino(
            f.ino(),
            rext4::FallocMode::KeepSize,
            max - 2 * u64::from(bs),
            2 * u64::from(bs),
        )
        .expect("fallocate up to the limit");
        drop(f);
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "{bs}: e2fsck: {}", r.output);
    }
}

/// chattr through the API: the flags that need only keeping are stored and survive a
/// reopen; bits outside ext4's modifiable set are kept whatever the caller passes;
/// changes rext4 would not act on (sync, clearing extents) are refused and change
/// nothing; immutable and append-only are enforced on every path (a descriptor opened
/// before included). The kernel's lsattr reads what was stored.
#[test]
fn inode_flags_kept_enforced_and_refused() {
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"x").expect("write");
    fs.create_dir("/d").expect("mkdir");
    let f = fs.resolve(b"/f", true).expect("f");
    let d = fs.resolve(b"/d", true).expect("d");
    let base = fs.flags_ino(f).expect("flags");
    assert_eq!(base & 0x8_0000, 0x8_0000, "extents flag: {base:#x}");
    fs.set_flags_ino(f, base | 0x40 | 0x80).expect("+dA");
    for (bad, what) in [(base | 0x8, "+S"), (base & !0x8_0000, "-e")] {
        match fs.set_flags_ino(f, bad) {
            Err(e) => assert_eq!(e.errno(), 95, "{what}: {e}"), // EOPNOTSUPP
            Ok(()) => panic!("{what} accepted"),
        }
    }
    assert_eq!(fs.flags_ino(f).expect("flags"), base | 0x40 | 0x80);
    // INDEX (0x1000) is not the caller's to change: a directory keeps what it has.
    let dflags = fs.flags_ino(d).expect("dir flags");
    fs.set_flags_ino(d, (dflags ^ 0x1000) | 0x40)
        .expect("dir +d");
    assert_eq!(fs.flags_ino(d).expect("dir flags"), dflags | 0x40);

    // Immutable, with a descriptor opened before.
    let eperm = |r: rext4::Result<()>, what: &str| match r {
        Err(e) => assert_eq!(e.errno(), 1, "{what}: {e}"),
        Ok(()) => panic!("{what}: expected EPERM"),
    };
    let w = OpenOptions::new()
        .write(true)
        .open(&fs, "/f")
        .expect("open");
    let flags = fs.flags_ino(f).expect("flags");
    fs.set_flags_ino(f, flags | 0x10).expect("+i");
    eperm(
        w.write_at(b"y", 0).map(|_| ()),
        "write through an older descriptor",
    );
    eperm(
        OpenOptions::new().write(true).open(&fs, "/f").map(|_| ()),
        "open for writing",
    );
    eperm(fs.remove_file("/f"), "unlink");
    eperm(fs.rename("/f", "/g"), "rename");
    eperm(w.set_len(0), "truncate");
    // The refused truncate left the file's cached (still dirty) data alone.
    assert_eq!(
        fs.read("/f").expect("read"),
        b"x",
        "a refused truncate cut the file"
    );
    eperm(
        fs.set_flags_ino(f, flags | 0x10 | 0x2),
        "another flag while immutable",
    );
    fs.set_flags_ino(f, flags).expect("-i");
    // Append-only: appends yes, overwrites no.
    fs.set_flags_ino(f, flags | 0x20).expect("+a");
    eperm(
        w.write_at(b"y", 0).map(|_| ()),
        "overwrite of an append-only file",
    );
    let a = OpenOptions::new()
        .append(true)
        .open(&fs, "/f")
        .expect("open append");
    a.write_at(b"z", 0).expect("append");
    fs.set_flags_ino(f, flags).expect("-a");
    drop((w, a));
    assert_eq!(fs.read("/f").expect("read"), b"xz");
    fs.close().expect("close");

    let fs = rw(img.path());
    assert_eq!(fs.flags_ino(f).expect("flags"), base | 0x40 | 0x80);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck: {}", r.output);
    let m = match LoopMount::new(img.path(), true, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    let out = std::process::Command::new("lsattr")
        .arg(m.path().join("f"))
        .output()
        .expect("lsattr");
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.starts_with("------dA------e"), "lsattr: {line}");
}

/// An ext3 image converted with `tune2fs -O extents` keeps its old files on block
/// maps. rext4 frees them whole (data and indirect blocks) when they go, and changes
/// them in place — a write that allocates, a truncate, a directory that grows — as
/// the kernel does (no migration to an extent tree); new files get extents. e2fsck
/// stays clean and the kernel reads what was written.
#[test]
fn block_mapped_files_of_a_converted_image_are_written_and_freed() {
    use rext4_testkit::{debugfs_w_checked, TempDir};
    let img = mkfs(&MkfsOptions::new(1024, 32 << 20).arg("-t").arg("ext3")).expect("mkfs");
    let host = TempDir::new("ext3src").expect("tempdir");
    // 300 KiB at 1 KiB blocks: direct, IND and DIND blocks.
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 31 + i / 977) as u8).collect();
    std::fs::write(host.join("big"), &big).expect("host file");
    std::fs::write(host.join("small"), b"small").expect("host file");
    // 300 separate 1 KiB pieces: 300 runs, across the IND and DIND ranges.
    let sparse_len = 300 * 3 * 1024;
    {
        use std::os::unix::fs::FileExt;
        let h = std::fs::File::create(host.join("sparse")).expect("host sparse file");
        for i in 0..300u64 {
            h.write_all_at(&[(i % 250) as u8 + 1; 1024], i * 3 * 1024)
                .expect("write piece");
        }
    }
    let mut script = format!(
        "write {} big\nwrite {} small\nwrite {} other\nwrite {} sparse\nmkdir d\nmkdir empty\n",
        host.join("big").display(),
        host.join("small").display(),
        host.join("big").display(),
        host.join("sparse").display()
    );
    for i in 0..20 {
        script += &format!("write {} d/f{i}\n", host.join("small").display());
    }
    script += &format!("symlink slow /{}\n", "t".repeat(100));
    debugfs_w_checked(img.path(), script).expect("populate with debugfs");
    let out = std::process::Command::new("tune2fs")
        .args(["-O", "extents"])
        .arg(img.path())
        .output()
        .expect("tune2fs");
    assert!(out.status.success(), "tune2fs: {out:?}");
    let before = e2fsck_fn(img.path());
    assert!(before.clean, "converted image: {}", before.output);

    let fs = rw(img.path());
    let flags_of = |fs: &Fs, p: &str| {
        let i = fs.resolve(p.as_bytes(), false).expect("resolve");
        fs.inode_attr(i).expect("inode").flags
    };
    assert_eq!(
        flags_of(&fs, "/big") & 0x8_0000,
        0,
        "debugfs wrote a block map"
    );
    // Freed whole.
    fs.remove_file("/other")
        .expect("unlink a block-mapped file");
    fs.remove_file("/small").expect("unlink");
    fs.remove_file("/slow").expect("unlink a slow symlink");
    fs.remove_dir("/empty").expect("rmdir");
    // Changed: overwrite in place, write past the end, truncate.
    let f = OpenOptions::new()
        .write(true)
        .open(&fs, "/big")
        .expect("open");
    f.write_all_at(&[0xAB; 5000], 100_000).expect("overwrite");
    f.write_all_at(b"tail", 400_000)
        .expect("write past the end");
    f.set_len(350_000).expect("truncate");
    drop(f);
    assert_eq!(flags_of(&fs, "/big") & 0x8_0000, 0, "still block-mapped");
    // Dropping the last piece of the sparse file.
    let sp = OpenOptions::new()
        .write(true)
        .open(&fs, "/sparse")
        .expect("open");
    sp.set_len((sparse_len - 3072) as u64).expect("truncate");
    drop(sp);
    assert_eq!(flags_of(&fs, "/sparse") & 0x8_0000, 0, "still block-mapped");
    // A block-mapped directory grows.
    for i in 0..200 {
        fs.write(format!("/d/new-file-with-a-longer-name-{i:03}"), b"n")
            .expect("create in an old directory");
    }
    assert_eq!(flags_of(&fs, "/d") & 0x8_0000, 0, "still block-mapped");
    assert_ne!(
        flags_of(&fs, "/d/new-file-with-a-longer-name-000") & 0x8_0000,
        0,
        "new files get extents"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck: {}", r.output);

    let mut want = big.clone();
    want[100_000..105_000].fill(0xAB);
    want.resize(350_000, 0);
    let m = match LoopMount::new(img.path(), true, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    assert!(
        std::fs::read(m.path().join("big")).expect("read") == want,
        "content of big"
    );
    let mut want = vec![0u8; sparse_len - 3072];
    for i in 0..299usize {
        want[i * 3072..i * 3072 + 1024].fill((i % 250) as u8 + 1);
    }
    assert!(
        std::fs::read(m.path().join("sparse")).expect("read") == want,
        "content of sparse"
    );
    assert_eq!(
        std::fs::read_dir(m.path().join("d")).expect("ls").count(),
        220
    );
    assert!(!m.path().join("other").exists());
}

/// A corrupt map pointing into the filesystem's own blocks (here a block-mapped
/// file's pointer aimed at the inode table) is refused as corruption when the file
/// goes, instead of handing inode-table blocks to the allocator.
#[test]
fn freeing_a_pointer_into_metadata_is_refused() {
    use rext4_testkit::{debugfs_r, debugfs_w_checked};
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20).arg("-t").arg("ext3")).expect("mkfs");
    debugfs_w_checked(img.path(), "write /etc/hostname f\n").expect("debugfs write");
    let stats = debugfs_r(img.path(), "stats").expect("stats");
    let itable: u64 = stats
        .lines()
        .find_map(|l| {
            let l = l.trim();
            l.starts_with("Group  0:")
                .then(|| l.split("inode table at ").nth(1))
                .flatten()
                .and_then(|n| n.trim().parse().ok())
        })
        .expect("group 0 inode table in debugfs stats");
    debugfs_w_checked(img.path(), format!("sif /f block[0] {itable}\n")).expect("corrupt");
    let st = std::process::Command::new("tune2fs")
        .args(["-O", "extents"])
        .arg(img.path())
        .output()
        .expect("tune2fs");
    assert!(st.status.success(), "{st:?}");
    let fs = rw(img.path());
    let e = fs.remove_file("/f").expect_err("freeing the inode table");
    assert!(
        matches!(e, rext4::Error::Corrupted { .. }),
        "expected corruption, got {e:?}"
    );
    // Recorded as the kernel records it: the image says it has errors, so a preening
    // e2fsck checks it fully rather than trusting "clean".
    fs.note_error(&e);
    fs.close().expect("close");
    let h = rext4_testkit::dumpe2fs_h(img.path()).expect("dumpe2fs");
    assert_eq!(
        h.get("Filesystem state").map(String::as_str),
        Some("clean with errors"),
        "{h:?}"
    );
    assert_eq!(
        h.get("FS Error count").map(String::as_str),
        Some("1"),
        "{h:?}"
    );
    // The inode table block stays allocated in the bitmap (e2fsck would list it as
    // "+N": in use but marked free). The block the edit orphaned ("-N") and the
    // unattached inode are the corruption's and the failed unlink's, for e2fsck.
    let fsck = e2fsck_fn(img.path());
    let diffs = fsck
        .output
        .lines()
        .find(|l| l.contains("Block bitmap differences"))
        .unwrap_or("");
    assert!(
        !diffs.contains(&format!("+{itable}")) && !diffs.contains(&format!("+({itable}")),
        "inode table block freed: {}",
        fsck.output
    );
}

/// `remove_dir_all` of a directory whose subdirectory holds a link back to it (a
/// loop only a corrupted image has; debugfs makes it) ends in a corruption error
/// instead of walking the loop until the stack runs out (the write fuzz's find).
#[test]
fn remove_dir_all_refuses_a_directory_loop() {
    use rext4_testkit::debugfs_w_checked;
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    debugfs_w_checked(
        img.path(),
        "mkdir /a\nmkdir /a/b\nmkdir /a/b/c\nwrite /etc/hostname /a/b/f\nln /a /a/b/c/up\n",
    )
    .expect("debugfs");
    let fs = rw(img.path());
    let e = fs.remove_dir_all("/a").expect_err("a loop");
    assert!(
        matches!(&e, rext4::Error::Corrupted { what, .. } if what.contains("loop")),
        "expected a loop reported as corruption, got {e:?}"
    );
    fs.close().expect("close");
}

/// Group descriptor counts past any right value (itable_unused above the inodes per
/// group, a free-inode count of 0 over a bitmap with free inodes: a corrupted image,
/// as the write fuzz made one) do not wrap the allocator's arithmetic: creates work,
/// and what e2fsck then finds is the corruption's, no worse.
#[test]
fn creates_survive_group_counts_past_any_right_value() {
    use rext4_testkit::debugfs_w_checked;
    for edit in [
        "set_bg 0 itable_unused 65535",
        "set_bg 0 free_inodes_count 0",
    ] {
        let img = mkfs(
            &MkfsOptions::new(1024, 16 << 20)
                .arg("-O")
                .arg("^metadata_csum"),
        )
        .expect("mkfs");
        debugfs_w_checked(
            img.path(),
            format!("{edit}\nset_super_value free_inodes_count 0\n"),
        )
        .expect("debugfs");
        let fs = rw(img.path());
        for i in 0..5 {
            fs.write(format!("/f{i}"), b"x")
                .unwrap_or_else(|e| panic!("{edit}: create {i}: {e}"));
            fs.create_dir(format!("/d{i}"))
                .unwrap_or_else(|e| panic!("{edit}: mkdir {i}: {e}"));
        }
        fs.remove_file("/f0").expect("unlink");
        fs.close().expect("close");
        assert_eq!(
            Fs::open(img.path())
                .expect("open")
                .read("/f1")
                .expect("read"),
            b"x"
        );
    }
}

/// A tree deeper than any stack would hold frame by frame goes whole.
#[test]
fn remove_dir_all_of_a_very_deep_tree() {
    let img = mkfs(&MkfsOptions::new(1024, 64 << 20).arg("-N").arg("40000")).expect("mkfs");
    let fs = rw(img.path());
    fs.create_dir("/top").expect("mkdir");
    let mut dir = fs.resolve(b"/top", true).expect("resolve");
    let depth = 30_000;
    for i in 0..depth {
        if i % 1000 == 0 {
            fs.write_ino_at(
                fs.mknod_ino(dir, b"file", 0o100644, 0, 0, (0, 0))
                    .expect("create"),
                b"data",
                0,
            )
            .expect("write");
        }
        dir = fs.mkdir_ino(dir, b"d", 0o755, 0, 0).expect("mkdir");
    }
    let free = fs.statfs().inodes_free;
    fs.remove_dir_all("/top").expect("remove_dir_all");
    assert!(fs.resolve(b"/top", true).is_err(), "/top is gone");
    assert_eq!(
        fs.statfs().inodes_free,
        free + depth + depth / 1000 + 1,
        "every directory and file freed"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// `chattr -ia` through the API: one call clears immutable and append-only together
/// (ext4 refuses other flag changes only while immutable stays set), after which the
/// file takes writes and goes away.
#[test]
fn immutable_cleared_with_other_flags_in_one_call() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"x").expect("write");
    let f = fs.resolve(b"/f", true).expect("f");
    let base = fs.flags_ino(f).expect("flags");
    let (imm, app, nodump) = (0x10, 0x20, 0x40);
    fs.set_flags_ino(f, base | imm | app).expect("+ia");
    match fs.set_flags_ino(f, base | imm) {
        Err(e) => assert_eq!(e.errno(), 1, "-a while +i stays: {e}"),
        Ok(()) => panic!("-a while +i stays: accepted"),
    }
    fs.set_flags_ino(f, base).expect("-ia in one call");
    assert_eq!(fs.flags_ino(f).expect("flags"), base);
    fs.write("/f", b"y").expect("write after -ia");
    fs.set_flags_ino(f, base | imm).expect("+i");
    fs.set_flags_ino(f, base | nodump)
        .expect("-i +d in one call");
    assert_eq!(fs.flags_ino(f).expect("flags"), base | nodump);
    fs.remove_file("/f").expect("unlink after -i");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck: {}", r.output);
}

/// renameat2(RENAME_WHITEOUT) through the API: the source name becomes a character
/// device 0:0 with mode 0 owned by the given ids, in the same change as the rename;
/// with RENAME_EXCHANGE it is refused; when no inode is free for the whiteout the
/// rename fails with ENOSPC and changes nothing. The kernel reads the whiteout back.
#[test]
fn rename_whiteout_through_the_api() {
    use rext4::{FileType, RenameFlags};
    let mut opts = MkfsOptions::new(4096, 16 << 20);
    opts.inodes = Some(64);
    let img = mkfs(&opts).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/a", b"data").expect("write");
    let wo = RenameFlags {
        whiteout: Some((7, 8)),
        ..RenameFlags::default()
    };
    fs.rename_with("/a", "/b", wo)
        .expect("rename with a whiteout");
    let m = fs.symlink_metadata("/a").expect("whiteout");
    assert_eq!(
        (m.file_type, m.mode, m.rdev, m.nlink, m.uid, m.gid, m.size),
        (FileType::CharDevice, 0o20000, Some((0, 0)), 1, 7, 8, 0)
    );
    assert_eq!(fs.read("/b").expect("moved"), b"data");
    let both = RenameFlags {
        exchange: true,
        ..wo
    };
    match fs.rename_with("/b", "/a", both) {
        Err(e) => assert_eq!(e.errno(), 22, "{e}"),
        Ok(()) => panic!("RENAME_WHITEOUT | RENAME_EXCHANGE accepted"),
    }
    // Use up the inodes, then a whiteout cannot be made.
    let mut n = 0;
    while fs.write(format!("/fill{n}"), b"").is_ok() {
        n += 1;
    }
    assert!(n > 0, "no inode was free to begin with");
    match fs.rename_with("/b", "/c", wo) {
        Err(e) => assert_eq!(e.errno(), 28, "{e}"),
        Ok(()) => panic!("a whiteout without a free inode"),
    }
    assert_eq!(fs.read("/b").expect("b kept"), b"data");
    assert!(fs.symlink_metadata("/c").is_err(), "c made");
    fs.remove_file("/fill0").expect("free one inode");
    fs.rename_with("/b", "/c", wo)
        .expect("rename with a whiteout");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck: {}", r.output);
    let m = match LoopMount::new(img.path(), true, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    for name in ["a", "b"] {
        let k = std::fs::symlink_metadata(m.path().join(name)).expect("lstat");
        assert!(k.file_type().is_char_device(), "{name}: {k:?}");
        assert_eq!((k.rdev(), k.mode(), k.uid()), (0, 0o20000, 7), "{name}");
    }
    assert_eq!(std::fs::read(m.path().join("c")).expect("c"), b"data");
}

/// Atime through the API: the default policy never changes an image that is only
/// read; relatime moves a file's atime on a read when it is not newer than the mtime,
/// once, and a directory's on a listing; a read-only open moves nothing.
#[test]
fn atime_policy_through_the_api() {
    use rext4::{AtimePolicy, FsOptions};
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let old = Timestamp { sec: 1000, nsec: 0 };
    let older = |fs: &Fs| {
        for p in ["/f", "/d"] {
            fs.set_times(p, Some(old), Some(Timestamp { sec: 2000, nsec: 0 }))
                .expect("set_times");
        }
    };
    let atimes = |fs: &Fs| ["/f", "/d"].map(|p| fs.metadata(p).expect("stat").atime);
    let fs = rw(img.path());
    fs.create_dir("/d").expect("mkdir");
    fs.write("/f", b"data").expect("write");
    older(&fs);
    fs.read("/f").expect("read");
    fs.read_dir("/d").expect("readdir");
    assert_eq!(atimes(&fs), [old, old], "the default policy");
    fs.close().expect("close");

    let open = |read_only: bool| {
        let o = FsOptions {
            read_only,
            commit_secs: 0,
            atime: AtimePolicy::RELATIME,
            ..FsOptions::default()
        };
        Fs::open_with(img.path(), o).expect("open")
    };
    let fs = open(true);
    fs.read("/f").expect("read");
    fs.read_dir("/d").expect("readdir");
    assert_eq!(atimes(&fs), [old, old], "a read-only open");
    drop(fs);

    let fs = open(false);
    let t0 = rext4::inode_write::now_ts().sec;
    fs.read("/f").expect("read");
    fs.read_dir("/d").expect("readdir");
    let moved = atimes(&fs);
    assert!(moved.iter().all(|a| a.sec >= t0), "relatime: {moved:?}");
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs.read("/f").expect("read again");
    fs.read_dir("/d").expect("readdir again");
    assert_eq!(atimes(&fs), moved, "a second access under relatime");
    fs.close().expect("close");
    let fs = rw(img.path());
    assert_eq!(atimes(&fs), moved, "after a reopen");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck: {}", r.output);
}

/// As open(2) and link(2): a regular file of a read-only filesystem does not open for
/// writing or truncation (EROFS at open, not at the first write), reading still does;
/// a hard link to a directory is EPERM.
#[test]
fn read_only_opens_and_directory_links_fail_as_the_syscalls_do() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"data").expect("write");
    fs.create_dir("/d").expect("mkdir");
    let e = fs.hard_link("/d", "/d2").expect_err("link of a directory");
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    fs.close().expect("close");
    let fs = rext4::Fs::open(img.path()).expect("open read-only");
    for (write, append, truncate) in [
        (true, false, false),
        (false, true, false),
        (true, false, true),
    ] {
        let r = rext4::OpenOptions::new()
            .read(true)
            .write(write)
            .append(append)
            .truncate(truncate)
            .open(&fs, "/f");
        assert!(
            matches!(r, Err(rext4::Error::ReadOnly)),
            "write {write} append {append} truncate {truncate}: {:?}",
            r.map(|_| ())
        );
    }
    let f = rext4::OpenOptions::new()
        .read(true)
        .open(&fs, "/f")
        .expect("open for reading");
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, 0).expect("read");
    assert_eq!(&b, b"data");
}

/// A trailing slash names a directory, as in POSIX path resolution: "f/" of a regular
/// file is ENOTDIR for every call (before, the slash was dropped and the file read,
/// written or removed), a final symlink is followed to its directory, creating a
/// regular file "new/" is EISDIR, and the image is as the calls that succeeded left it.
/// Paths that name nothing new get std's answers: "" is ENOENT, mkdir of "/" or "d/."
/// is EEXIST.
#[test]
fn trailing_slash_names_a_directory() {
    use rext4::Error;
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"file").expect("write");
    fs.create_dir("/d").expect("mkdir");
    fs.symlink("d", "/ld").expect("symlink to the dir");
    fs.symlink("f", "/lf").expect("symlink to the file");
    let enotdir = |r: Result<(), Error>, what: &str| {
        assert!(matches!(r, Err(Error::NotADirectory)), "{what}: {r:?}");
    };
    enotdir(fs.read("/f/").map(drop), "read f/");
    enotdir(fs.metadata("/f/").map(drop), "stat f/");
    enotdir(fs.symlink_metadata("/lf/").map(drop), "lstat lf/");
    enotdir(fs.write("/f/", b"x"), "write f/");
    enotdir(fs.remove_file("/f/"), "unlink f/");
    enotdir(fs.rename("/f/", "/g"), "rename f/ g");
    enotdir(fs.rename("/f", "/g/"), "rename f g/");
    enotdir(fs.rename("/f", "/d/"), "rename f d/");
    assert!(
        matches!(fs.create_dir("/f/"), Err(Error::Exists)),
        "mkdir f/"
    );
    assert!(
        matches!(fs.write("/new/", b"x"), Err(Error::IsADirectory)),
        "create new/"
    );
    assert!(matches!(fs.remove_file("/d/"), Err(Error::IsADirectory)));
    assert!(matches!(fs.symlink("f", "/sl/"), Err(Error::NotFound)));
    assert!(matches!(fs.hard_link("/f", "/f/"), Err(Error::Exists)));
    assert!(matches!(fs.hard_link("/f", "/d/"), Err(Error::Exists)));
    // Directories, and symlinks to them, with the slash.
    assert!(fs.metadata("/d/").expect("stat d/").is_dir());
    assert!(fs.symlink_metadata("/ld/").expect("lstat ld/").is_dir());
    fs.write("/ld/inside", b"through the link")
        .expect("write via ld/");
    fs.create_dir("/e/").expect("mkdir e/");
    fs.rename("/e/", "/e2/").expect("rename e/ e2/");
    fs.remove_dir("/e2/").expect("rmdir e2/");
    // std's answers for paths that name nothing new: "" is ENOENT (it opened the
    // root before), "/" and "d/." exist (they were "invalid input").
    assert!(matches!(fs.write("", b"x"), Err(Error::NotFound)));
    assert!(matches!(fs.metadata(""), Err(Error::NotFound)));
    for p in ["/", "/d/.", "/d/.."] {
        assert!(matches!(fs.create_dir(p), Err(Error::Exists)), "mkdir {p}");
    }
    fs.create_dir_all("/").expect("create_dir_all /");
    assert_eq!(fs.read("/f").expect("read f"), b"file");
    assert_eq!(fs.read("/d/inside").expect("read"), b"through the link");
    let mut names: Vec<Vec<u8>> = fs
        .read_dir("/")
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [&b"d"[..], b"f", b"ld", b"lf", b"lost+found"].map(|n| n.to_vec())
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A handle refuses what it was not opened for with EBADF, as std's `File` (it was
/// EINVAL, "invalid argument"): a write or `set_len` on a read-only handle, a read on a
/// write-only one. Nothing changes.
#[test]
fn handles_refuse_what_they_were_not_opened_for_with_ebadf() {
    use rext4::Error;
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"hello").expect("write");
    let ro = fs.open_file("/f").expect("open read-only");
    let wo = OpenOptions::new()
        .write(true)
        .open(&fs, "/f")
        .expect("open write-only");
    let mut buf = [0u8; 8];
    let refusals = [
        (
            "write on a read-only handle",
            ro.write_at(b"x", 0).map(drop),
        ),
        ("set_len on a read-only handle", ro.set_len(0)),
        (
            "read on a write-only handle",
            wo.read_at(&mut buf, 0).map(drop),
        ),
    ];
    for (what, r) in refusals {
        match r {
            Err(e @ Error::NotOpenFor(_)) => {
                assert_eq!(e.errno(), libc::EBADF, "{what}");
                assert_eq!(std::io::Error::from(e).raw_os_error(), Some(libc::EBADF));
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(fs.read("/f").expect("read"), b"hello");
    drop((ro, wo));
    fs.close().expect("close");
}
