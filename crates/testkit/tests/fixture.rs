//! The testkit checked against the real tools and the kernel: both fixture writers give
//! e2fsck-clean images of the promised shape (extent depth >= 2, indexed `big/`), and
//! the kernel sees the same tree from both.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use rext4_testkit::fixture::{
    acl_xattr_value, big_xattr_value, expected_files, shared_xattr_value, slowlink_target, DEVICES,
    TIMES,
};
use rext4_testkit::{
    big_dir_name, diff_trees, e2fsck_fn, fixture_shape, mkfs, populate_debugfs, populate_kernel,
    skip, snapshot_dir, Compare, Fixture, Kind, LoopMount, MkfsOptions, Tree,
};

fn node<'a>(t: &'a Tree, p: &str) -> &'a rext4_testkit::Node {
    t.get(p.as_bytes())
        .unwrap_or_else(|| panic!("{p} missing from the snapshot"))
}

/// Everything the fixture promises, checked on a kernel snapshot.
fn check_tree(t: &Tree, spec: &Fixture, bs: u32, kernel: bool) {
    let big = t
        .keys()
        .filter(|k| k.starts_with(b"big/") && !k[4..].contains(&b'/'))
        .count();
    assert_eq!(big, spec.big_dir_entries as usize);
    for i in [0, 5, 254, spec.big_dir_entries - 1] {
        let mut k = b"big/".to_vec();
        k.extend_from_slice(&big_dir_name(i));
        assert!(t.contains_key(&k), "big/{} missing", k.escape_ascii());
    }
    for (path, size, hash) in expected_files(spec, bs) {
        let n = node(t, &path);
        assert_eq!(n.kind, Kind::File, "{path}");
        assert_eq!(n.size, size, "{path}");
        assert_eq!(n.content, Some(hash), "{path} content");
    }
    assert_eq!(
        node(t, "fastlink").symlink.as_deref(),
        Some(&b"small/one"[..])
    );
    assert_eq!(node(t, "slowlink").symlink, Some(slowlink_target()));
    assert_eq!(node(t, "slowlink").size, 120);
    assert_eq!(
        node(t, "danglink").symlink.as_deref(),
        Some(&b"does/not/exist"[..])
    );
    assert_eq!(node(t, "dirlink").symlink.as_deref(), Some(&b"small"[..]));
    let (h1, h2) = (node(t, "hl1"), node(t, "dir/hl2"));
    assert_eq!((h1.nlink, h2.nlink), (2, 2));
    assert_eq!(h1.ino, h2.ino);
    if spec.devices {
        for &(name, chr, major, minor) in DEVICES {
            let n = node(t, &format!("dev/{name}"));
            assert_eq!(
                n.kind,
                if chr { Kind::CharDev } else { Kind::BlockDev },
                "{name}"
            );
            assert_eq!(n.rdev, Some((major, minor)), "{name}");
            assert_eq!(n.mode & 0o7777, 0o644, "{name}");
        }
        assert_eq!(node(t, "dev/fifo").kind, Kind::Fifo);
        if kernel {
            assert_eq!(node(t, "dev/sock").kind, Kind::Socket);
        }
    }
    if spec.xattrs {
        let x = |p: &str, k: &str| node(t, p).xattrs.get(k.as_bytes()).cloned();
        assert_eq!(
            x("xattr/small", "user.small").as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(x("xattr/big", "user.big"), Some(big_xattr_value(bs)));
        assert_eq!(x("xattr/share1", "user.shared"), Some(shared_xattr_value()));
        assert_eq!(x("xattr/share2", "user.shared"), Some(shared_xattr_value()));
        assert_eq!(
            x("xattr/trusted", "trusted.tk").as_deref(),
            Some(&b"secret"[..])
        );
        let acl = Some(acl_xattr_value());
        assert_eq!(x("xattr/acl", "system.posix_acl_access"), acl);
        assert_eq!(x("xattr/acldir", "system.posix_acl_access"), acl);
        assert_eq!(x("xattr/acldir", "system.posix_acl_default"), acl);
        assert_eq!(node(t, "xattr/acl").mode, 0o100660);
        assert_eq!(node(t, "xattr/acldir").mode, 0o40660);
    }
    assert_eq!(node(t, "modes/setuid").mode, 0o104755);
    assert_eq!(node(t, "modes/sticky").mode, 0o41777);
    assert_eq!(node(t, "modes/none").mode, 0o100000);
    let o = node(t, "modes/owned");
    assert_eq!((o.uid, o.gid), (1000, 1000));
    let o = node(t, "modes/biguid");
    assert_eq!((o.uid, o.gid), (100_000, 100_000));
    for &(p, at, mt) in TIMES {
        let n = node(t, p);
        assert_eq!((n.atime, n.mtime), (at, mt), "{p} times");
    }
}

/// The comparable part of a tree: times outside `TIMES`, ctimes, inode numbers and
/// directory sizes cleared (they depend on the writer).
fn normalise(t: &Tree) -> Tree {
    let keep: BTreeMap<&[u8], ()> = TIMES.iter().map(|e| (e.0.as_bytes(), ())).collect();
    let mut out = t.clone();
    for (p, n) in out.iter_mut() {
        if !keep.contains_key(p.as_slice()) {
            n.atime = (0, 0);
            n.mtime = (0, 0);
        }
        n.ctime = (0, 0);
        if n.kind == Kind::Dir {
            n.size = 0;
        }
    }
    out.remove(b"dev/sock".as_slice());
    out
}

fn snapshot_ro(img: &Path) -> Result<Tree, String> {
    let m = LoopMount::new(img, true, "noatime")?;
    let t = snapshot_dir(m.path()).map_err(|e| format!("snapshot: {e}"))?;
    m.unmount()?;
    Ok(t)
}

fn run_variant(bs: u32, upstream: bool, spec: &Fixture) {
    let label = format!(
        "{}K {}",
        bs / 1024,
        if upstream { "upstream" } else { "debian" }
    );
    let opts = MkfsOptions::new(bs, 256 << 20).upstream(upstream);

    // debugfs writer: works for everyone.
    let dimg = mkfs(&opts).expect("mkfs");
    let t0 = Instant::now();
    populate_debugfs(dimg.path(), spec).expect("populate_debugfs");
    eprintln!("[{label}] populate_debugfs: {:?}", t0.elapsed());
    let r = e2fsck_fn(dimg.path());
    assert!(r.clean, "[{label}] debugfs image not clean");
    let (depth, levels) = fixture_shape(dimg.path()).expect("shape");
    eprintln!("[{label}] debugfs image: frag depth {depth:?}, big/ htree levels {levels:?}");
    let want_depth2 = spec.frag_extents > 4 * ((bs - 12) / 12);
    if want_depth2 {
        assert!(depth >= Some(2), "[{label}] debugfs frag depth {depth:?}");
    }
    assert!(levels.is_some(), "[{label}] debugfs big/ not indexed");

    let dtree = match snapshot_ro(dimg.path()) {
        Ok(t) => t,
        Err(e) => {
            skip(&format!("[{label}] kernel half: {e}"));
            return;
        }
    };
    check_tree(&dtree, spec, bs, false);

    // kernel writer
    let kimg = mkfs(&opts).expect("mkfs");
    let m = match LoopMount::new(kimg.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => {
            skip(&format!("[{label}] kernel half: {e}"));
            return;
        }
    };
    let t0 = Instant::now();
    populate_kernel(m.path(), spec).expect("populate_kernel");
    eprintln!("[{label}] populate_kernel: {:?}", t0.elapsed());
    let ktree = snapshot_dir(m.path()).expect("snapshot");
    let again = snapshot_dir(m.path()).expect("snapshot");
    let d = diff_trees(&ktree, &again, &Compare::exact());
    assert!(d.is_empty(), "[{label}] two snapshots differ: {d:?}");
    m.unmount().expect("unmount");
    check_tree(&ktree, spec, bs, true);

    let r = e2fsck_fn(kimg.path());
    assert!(r.clean, "[{label}] kernel image not clean");
    let (depth, levels) = fixture_shape(kimg.path()).expect("shape");
    eprintln!("[{label}] kernel image: frag depth {depth:?}, big/ htree levels {levels:?}");
    if want_depth2 {
        assert!(depth >= Some(2), "[{label}] kernel frag depth {depth:?}");
    }
    assert!(levels >= Some(1), "[{label}] kernel big/ levels {levels:?}");

    // Both writers give the kernel the same tree.
    let d = diff_trees(&normalise(&dtree), &normalise(&ktree), &Compare::semantic());
    assert!(
        d.is_empty(),
        "[{label}] debugfs vs kernel: {:#?}",
        &d[..d.len().min(40)]
    );
}

#[test]
fn fixture_1k_debian() {
    run_variant(1024, false, &Fixture::default());
}

#[test]
fn fixture_1k_upstream() {
    run_variant(1024, true, &Fixture::default());
}

#[test]
fn fixture_4k_debian() {
    run_variant(4096, false, &Fixture::default());
}

#[test]
fn fixture_4k_upstream() {
    run_variant(4096, true, &Fixture::default());
}

#[test]
fn quick_fixture_and_snapshot_diff() {
    let spec = Fixture::quick();
    let img = mkfs(&MkfsOptions::new(1024, 64 << 20)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => {
            skip(&e);
            return;
        }
    };
    populate_kernel(m.path(), &spec).expect("populate_kernel");
    let a = snapshot_dir(m.path()).expect("snapshot");
    check_tree(&a, &spec, 1024, true);
    // A changed mtime is reported, naming the path and both values.
    let f = m.path().join("small/one");
    let t = std::fs::File::options().write(true).open(&f).expect("open");
    t.set_modified(std::time::UNIX_EPOCH + std::time::Duration::new(5, 7))
        .expect("set mtime");
    drop(t);
    let b = snapshot_dir(m.path()).expect("snapshot");
    let d = diff_trees(&a, &b, &Compare::semantic());
    assert!(
        d.iter()
            .any(|l| l.starts_with("/small/one: mtime") && l.ends_with("!= (5, 7)")),
        "{d:?}"
    );
    assert_eq!(d.len(), 1, "{d:?}");
    // The exact compare also sees the ctime change.
    assert_eq!(diff_trees(&a, &b, &Compare::exact()).len(), 2);
    m.unmount().expect("unmount");
    assert!(e2fsck_fn(img.path()).clean);
    let (depth, levels) = fixture_shape(img.path()).expect("shape");
    assert_eq!(depth, Some(2));
    assert!(levels.is_some());
}

fn mounted_at(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let d = dir.to_string_lossy().into_owned();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(d.as_str()))
}

fn loop_attached(img: &Path) -> bool {
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(img)
        .output()
        .expect("losetup");
    !out.stdout.is_empty()
}

#[test]
fn mount_is_released_on_panic_and_when_busy() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    // A panicking test still unmounts and frees the loop device.
    let mut seen = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let m = match LoopMount::new(img.path(), false, "") {
            Ok(m) => m,
            Err(e) => {
                skip(&e);
                return;
            }
        };
        assert!(mounted_at(m.path()));
        assert!(loop_attached(img.path()));
        seen = Some(m.path().to_path_buf());
        panic!("test panics while mounted");
    }));
    let Some(dir) = seen else {
        return;
    };
    assert!(r.is_err());
    assert!(!mounted_at(&dir));
    assert!(!dir.exists(), "mount point left behind");
    assert!(!loop_attached(img.path()));

    // A busy mount is lazily unmounted; the loop device goes when the file closes.
    let m = LoopMount::new(img.path(), false, "").expect("mount");
    let dir = m.path().to_path_buf();
    let f = std::fs::File::create(dir.join("held")).expect("create");
    let res = m.unmount();
    assert!(res.is_err(), "a busy unmount reports that it went lazy");
    assert!(!mounted_at(&dir));
    drop(f);
    let mut tries = 0;
    while loop_attached(img.path()) && tries < 50 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        tries += 1;
    }
    assert!(
        !loop_attached(img.path()),
        "loop device not freed after lazy unmount"
    );
    assert!(e2fsck_fn(img.path()).clean);
}
