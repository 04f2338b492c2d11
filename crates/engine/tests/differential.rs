//! Differential test: for images made by mkfs.ext4 (1 KiB and 4 KiB blocks, Debian and
//! upstream feature sets) and populated by debugfs and by the kernel, the tree rext4
//! reads equals the tree the kernel shows through a read-only loop mount: names, types,
//! modes, owners, sizes, nanosecond times, link counts, symlink targets, xattrs and a
//! hash of every file's bytes. Every metadata checksum verifies and e2fsck agrees the
//! image is clean (so the comparison is against a sound reference).

mod common;

use rext4::Fs;
use rext4_testkit::{
    diff_trees, e2fsck_fn, fixture_shape, mkfs, populate_debugfs, populate_kernel, skip,
    snapshot_dir, Compare, Fixture, Image, LoopMount, MkfsOptions,
};

fn compare_with_kernel(img: &Image, label: &str) {
    let fs = Fs::open(img.path()).expect("rext4 opens the image");
    assert!(
        fs.warnings().is_empty(),
        "[{label}] warnings: {:?}",
        fs.warnings()
    );
    let audit = fs.audit().expect("audit");
    assert!(
        audit.problems.is_empty(),
        "[{label}] audit: {:?}",
        audit.problems
    );
    assert!(
        audit.inodes_checked > 20_000,
        "[{label}] only {} inodes",
        audit.inodes_checked
    );
    let ours = common::snapshot(&fs).expect("rext4 walks the whole tree");
    let fsck = e2fsck_fn(img.path());
    assert!(fsck.clean, "[{label}] e2fsck: {}", fsck.output);
    let m = match LoopMount::new(img.path(), true, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel comparison: {e}")),
    };
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");
    assert!(
        kernel.len() > 20_000,
        "[{label}] kernel tree has {} entries",
        kernel.len()
    );
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] kernel vs rext4:\n{}",
        d[..d.len().min(40)].join("\n")
    );
    eprintln!("[{label}] {} paths identical", ours.len());
}

fn variant(bs: u32, upstream: bool) {
    let conf = if upstream { "upstream" } else { "debian" };
    let spec = Fixture::default();
    let opts = MkfsOptions::new(bs, 256 << 20).upstream(upstream);

    let img = mkfs(&opts).expect("mkfs");
    populate_debugfs(img.path(), &spec).expect("populate with debugfs");
    let (depth, levels) = fixture_shape(img.path()).expect("shape");
    assert!(
        depth >= Some(2) && levels.is_some(),
        "debugfs shape {depth:?} {levels:?}"
    );
    compare_with_kernel(&img, &format!("{bs} {conf} debugfs"));

    let img = mkfs(&opts).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("kernel-populated variant: {e}")),
    };
    populate_kernel(m.path(), &spec).expect("populate through the kernel");
    m.unmount().expect("unmount");
    let (depth, levels) = fixture_shape(img.path()).expect("shape");
    assert!(depth >= Some(2), "kernel frag depth {depth:?}");
    if bs == 1024 {
        assert!(
            levels >= Some(1),
            "20,000 entries on 1 KiB blocks need an indirect level"
        );
    }
    compare_with_kernel(&img, &format!("{bs} {conf} kernel"));
}

#[test]
fn differential_1k_debian() {
    variant(1024, false);
}

#[test]
fn differential_4k_debian() {
    variant(4096, false);
}

#[test]
fn differential_1k_upstream() {
    variant(1024, true);
}

#[test]
fn differential_4k_upstream() {
    variant(4096, true);
}
