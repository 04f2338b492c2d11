//! Orphans: a file unlinked while open stays readable through its handle, is recorded
//! on the orphan list (the orphan file with the upstream feature set, the legacy list
//! otherwise), freed when the last handle goes, and — after a crash while still open —
//! finished at the next read-write open. e2fsck is clean at every step.

mod common;

use std::sync::Arc;

use common::Recorder;
use rext4::device::BlockDevice;
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{dumpe2fs_h, e2fsck_fn, mkfs, MkfsOptions, TempDir};

fn rw_dev(dev: Arc<dyn BlockDevice>) -> Fs {
    Fs::open_device(
        dev,
        FsOptions {
            read_only: false,
            commit_secs: 0,
            ..FsOptions::default()
        },
    )
    .expect("open")
}

/// Open the crash image at `p` read-write: the open finishes its orphans and says so.
fn reopen_finishing_orphans(p: &std::path::Path) -> Fs {
    let fs = Fs::open_with(
        p,
        FsOptions {
            read_only: false,
            commit_secs: 0,
            ..FsOptions::default()
        },
    )
    .expect("reopen");
    assert!(
        fs.warnings().iter().any(|w| w.contains("orphan")),
        "{:?}",
        fs.warnings()
    );
    fs
}

fn case(upstream: bool) {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20).upstream(upstream)).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    let dev = Arc::new(Recorder::new(base));
    let fs = rw_dev(dev.clone());
    let free0 = fs.superblock().free_blocks_count;
    fs.write("/victim", vec![7u8; 300_000]).expect("write");
    let f = fs.open_file("/victim").expect("open");
    fs.remove_file("/victim").expect("unlink while open");
    assert!(matches!(fs.metadata("/victim"), Err(Error::NotFound)));
    let mut buf = vec![0u8; 16];
    f.read_exact_at(&mut buf, 1000)
        .expect("still readable through the handle");
    assert_eq!(buf, [7u8; 16]);
    fs.sync().expect("commit");
    // A crash now: the image as the device has it.
    let crashed = dev.mem.snapshot();
    let sb = fs.superblock();
    if upstream {
        assert!(sb.has_ro_compat(rext4::format::superblock::feature::RO_COMPAT_ORPHAN_PRESENT));
    } else {
        assert_ne!(sb.last_orphan, 0, "legacy orphan list");
    }
    drop(f);
    assert_eq!(
        fs.superblock().free_blocks_count,
        free0,
        "last close frees the blocks"
    );
    assert_eq!(fs.superblock().last_orphan, 0);
    fs.close().expect("close");
    let done = dev.mem.snapshot();
    let tmp = TempDir::new("orphan").expect("tmp");
    let p = tmp.join("done.img");
    std::fs::write(&p, done).expect("write");
    let r = e2fsck_fn(&p);
    assert!(r.clean, "after close: {}", r.output);

    // The crash image: the next open finishes the orphan.
    let p = tmp.join("crash.img");
    std::fs::write(&p, crashed).expect("write");
    let fs = reopen_finishing_orphans(&p);
    assert_eq!(fs.superblock().free_blocks_count, free0);
    fs.close().expect("close");
    let h = dumpe2fs_h(&p).expect("dumpe2fs");
    assert!(
        !h["Filesystem features"].contains("orphan_present"),
        "{h:?}"
    );
    let r = e2fsck_fn(&p);
    assert!(r.clean, "after orphan processing: {}", r.output);
}

#[test]
fn orphan_file_upstream() {
    case(true);
}

#[test]
fn legacy_orphan_list_debian() {
    case(false);
}

/// O_TMPFILE (`Fs::create_unnamed`): the unnamed inode is an orphan from the start, so
/// a crash while it is open frees it at the next read-write open; a linkable one takes
/// a name (and leaves the orphan list), an O_EXCL one never does, and closing an
/// unnamed one frees it. e2fsck is clean after each.
fn unnamed_case(upstream: bool) {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20).upstream(upstream)).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    let dev = Arc::new(Recorder::new(base));
    let fs = rw_dev(dev.clone());
    fs.create_dir("/d").expect("mkdir");
    fs.sync().expect("sync");
    let (inodes0, blocks0) = {
        let sb = fs.superblock();
        (sb.free_inodes_count, sb.free_blocks_count)
    };
    let f = fs.create_unnamed("/d", 0o640, true).expect("O_TMPFILE");
    f.write_all_at(&[9u8; 300_000], 0).expect("write");
    assert_eq!(f.metadata().expect("fstat").nlink, 0);
    assert!(fs.read_dir("/d").expect("readdir").is_empty(), "no name");
    fs.sync().expect("commit");
    assert_eq!(fs.superblock().free_inodes_count, inodes0 - 1);
    let crashed = dev.mem.snapshot();

    // O_EXCL: never linkable; freed at close.
    let g = fs
        .create_unnamed("/d", 0o600, false)
        .expect("O_TMPFILE|O_EXCL");
    g.write_all_at(b"gone", 0).expect("write");
    assert!(matches!(g.link("/d/g"), Err(Error::NotFound)));
    drop(g);
    fs.sync().expect("sync");
    assert_eq!(fs.superblock().free_inodes_count, inodes0 - 1);

    // Linkable: takes a name, keeps its data, leaves the orphan list.
    f.link("/d/named").expect("linkat");
    assert!(matches!(f.link("/d/named"), Err(Error::Exists)));
    let m = fs.metadata("/d/named").expect("stat");
    assert_eq!((m.nlink, m.len(), m.mode & 0o7777), (1, 300_000, 0o640));
    drop(f);
    fs.sync().expect("sync");
    assert_eq!(fs.read("/d/named").expect("read"), vec![9u8; 300_000]);
    assert_eq!(fs.superblock().last_orphan, 0);
    assert!(!fs
        .superblock()
        .has_ro_compat(rext4::format::superblock::feature::RO_COMPAT_ORPHAN_PRESENT));
    // A name given to a file unlinked while open is refused (linkat's ENOENT).
    let h = fs.open_file("/d/named").expect("open");
    fs.remove_file("/d/named").expect("unlink");
    assert!(matches!(h.link("/d/again"), Err(Error::NotFound)));
    drop(h);
    fs.close().expect("close");
    let tmp = TempDir::new("unnamed").expect("tmp");
    let p = tmp.join("done.img");
    std::fs::write(&p, dev.mem.snapshot()).expect("write");
    let r = e2fsck_fn(&p);
    assert!(r.clean, "after close: {}", r.output);

    // The crash image with the unnamed file open: the next open frees it.
    let p = tmp.join("crash.img");
    std::fs::write(&p, crashed).expect("write");
    let fs = reopen_finishing_orphans(&p);
    let sb = fs.superblock();
    assert_eq!(
        (sb.free_inodes_count, sb.free_blocks_count),
        (inodes0, blocks0)
    );
    fs.close().expect("close");
    let r = e2fsck_fn(&p);
    assert!(r.clean, "after orphan processing: {}", r.output);
}

#[test]
fn unnamed_file_upstream() {
    unnamed_case(true);
}

#[test]
fn unnamed_file_legacy_orphan_list() {
    unnamed_case(false);
}
