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
    let fs = Fs::open_with(
        &p,
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
