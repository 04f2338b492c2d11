//! Reproducible images (issue 39, item 1): with `SOURCE_DATE_EPOCH` set and a seed,
//! `rext4 mkfs -d` of two copies of one tree — made in opposite orders on different
//! filesystems (so their readdir orders, inode numbers, holes and xattr orders differ),
//! built a second apart — gives byte-identical images, e2fsck-clean; the same edits
//! (cp, mkdir, rm, mv, a FUSE mount and unmount) made to both keep them identical;
//! times newer than the epoch are clamped to it, older ones kept; a tar file and the
//! same archive gzipped on standard input give the same bytes.

mod common;
mod fuse_mount;

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rext4_testkit::{debugfs_r, e2fsck_fn, fixture_bytes, memory_dir, skip, TempDir};

const EPOCH: i64 = 1_700_000_000;
const SEED: &str = "repro-test-seed";

/// Run `rext4 ARGS` with SOURCE_DATE_EPOCH set (or not); panics on failure.
fn rext4_at(epoch: Option<i64>, args: &[&std::ffi::OsStr]) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rext4"));
    c.args(args).stdin(Stdio::null());
    match epoch {
        Some(t) => c.env("SOURCE_DATE_EPOCH", t.to_string()),
        None => c.env_remove("SOURCE_DATE_EPOCH"),
    };
    let out = c.output().expect("run rext4");
    assert!(
        out.status.success(),
        "rext4 {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

fn set_times(p: &Path, sec: i64) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path");
    let t = libc::timespec {
        tv_sec: sec as libc::time_t,
        tv_nsec: 123_456_789,
    };
    // SAFETY: `c` is NUL-terminated and `ts` holds two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            [t, t].as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(r, 0, "utimensat {}", p.display());
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path");
    let n = std::ffi::CString::new(name).expect("name");
    // SAFETY: both strings are NUL-terminated; `value` is valid for its length.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr {} {name}", p.display());
}

/// The test tree under `root`, created in `reverse` order or not: every step in the
/// list is the same, only their order (and the source's holes) differ.
fn make_tree(root: &Path, reverse: bool) {
    let mut dirs = vec!["d", "d/sub", "big", "empty"];
    if reverse {
        dirs.reverse();
    }
    // Parents first whatever the order.
    let mut sorted = dirs.clone();
    sorted.sort_by_key(|d| d.matches('/').count());
    for d in &sorted {
        std::fs::create_dir(root.join(d)).expect("mkdir");
    }
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("small".into(), b"hello\n".to_vec()),
        ("d/data".into(), fixture_bytes(1, 300_000)),
        ("d/sub/mid".into(), fixture_bytes(2, 5000)),
        ("d/x".into(), b"to be moved".to_vec()),
    ];
    for i in 0..300 {
        files.push((format!("big/entry-{i:04}"), format!("{i}").into_bytes()));
    }
    if reverse {
        files.reverse();
    }
    for (p, data) in &files {
        std::fs::write(root.join(p), data).expect("write");
    }
    // Zeros: a hole in one copy, written zeros in the other; and a file with a hole
    // between data.
    let zeros = root.join("zeros");
    if reverse {
        std::fs::write(&zeros, vec![0u8; 70_000]).expect("zeros");
    } else {
        std::fs::File::create(&zeros)
            .and_then(|f| f.set_len(70_000))
            .expect("sparse");
    }
    let holey = root.join("holey");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&holey).expect("holey");
        f.write_all_at(b"start", 0).expect("w");
        if reverse {
            f.write_all_at(&vec![0u8; 200_000], 5).expect("w");
        }
        f.write_all_at(b"end", 1 << 20).expect("w");
    }
    symlink("small", root.join("link")).expect("symlink");
    symlink("x".repeat(100), root.join("d/longlink")).expect("symlink");
    std::fs::hard_link(root.join("d/sub/mid"), root.join("hard")).expect("link");
    let fifo = std::ffi::CString::new(root.join("d/fifo").as_os_str().as_bytes()).expect("p");
    // SAFETY: `fifo` is NUL-terminated.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    let mut xattrs = vec![("user.a", b"1".to_vec()), ("user.b", vec![7u8; 300])];
    if reverse {
        xattrs.reverse();
    }
    for (n, v) in &xattrs {
        set_xattr(&root.join("d/data"), n, v);
        set_xattr(&root.join("d"), n, v);
    }
    // Times: old ones kept, one in the future clamped; directories last.
    let mut all = Vec::new();
    for e in walk(root) {
        all.push(e);
    }
    all.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in &all {
        set_times(p, 1_000_000_000);
    }
    set_times(&root.join("small"), 2_000_000_000);
    set_times(root, 1_000_000_000);
}

fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            if std::fs::symlink_metadata(&p).expect("lstat").is_dir() {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

fn same_bytes(a: &Path, b: &Path, what: &str) {
    let (x, y) = (std::fs::read(a).expect("a"), std::fs::read(b).expect("b"));
    assert_eq!(x.len(), y.len(), "{what}: sizes differ");
    if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
        panic!(
            "{what}: images differ first at byte {i} (block {} of 1 KiB)",
            i / 1024
        );
    }
}

fn clean(img: &Path) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "{}", r.output);
}

/// The mtime debugfs shows for `path` (seconds).
fn mtime_of(img: &Path, path: &str) -> i64 {
    let out = debugfs_r(img, &format!("stat {path}")).expect("debugfs");
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("mtime:"))
        .unwrap_or_else(|| panic!("no mtime in {out}"));
    let hex = line
        .split_whitespace()
        .nth(1)
        .and_then(|w| w.split(':').next())
        .and_then(|h| h.strip_prefix("0x"))
        .expect("mtime field");
    i64::from_str_radix(hex, 16).expect("hex")
}

#[test]
fn builds_of_one_tree_are_byte_identical_and_stay_so_after_the_same_edits() {
    let work = TempDir::new("repro").expect("tempdir");
    let mem = TempDir::new_in(&memory_dir(), "repro-src").expect("memdir");
    let (a, b) = (work.join("a"), mem.join("b"));
    std::fs::create_dir(&a).expect("a");
    std::fs::create_dir(&b).expect("b");
    make_tree(&a, false);
    make_tree(&b, true);
    let (ia, ib) = (work.join("a.img"), work.join("b.img"));
    let mkfs = |src: &Path, img: &Path| {
        rext4_at(
            Some(EPOCH),
            &[
                os("mkfs"),
                os("-q"),
                os("--seed"),
                os(SEED),
                os("-d"),
                src.as_os_str(),
                img.as_os_str(),
                os("16M"),
            ],
        )
    };
    mkfs(&a, &ia);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    mkfs(&b, &ib);
    same_bytes(&ia, &ib, "after mkfs -d");
    clean(&ia);
    // Times newer than the epoch are clamped to it, older ones kept.
    assert_eq!(mtime_of(&ia, "/small"), EPOCH);
    assert_eq!(mtime_of(&ia, "/d/data"), 1_000_000_000);
    assert_eq!(mtime_of(&ia, "/lost+found"), EPOCH);

    // The same edits on both, a second apart.
    let host = work.join("host-file");
    std::fs::write(&host, fixture_bytes(9, 40_000)).expect("host file");
    for img in [&ia, &ib] {
        let at = |p: &str| common::spec(img, p);
        rext4_at(Some(EPOCH), &[os("cp"), host.as_os_str(), &at("/d/new")]);
        rext4_at(Some(EPOCH), &[os("mkdir"), &at("/nd")]);
        rext4_at(
            Some(EPOCH),
            &[os("rm"), &at("/hard"), &at("/big/entry-0007")],
        );
        rext4_at(Some(EPOCH), &[os("mv"), &at("/d/x"), &at("/nd/x")]);
        rext4_at(Some(EPOCH), &[os("rm"), os("-r"), &at("/d/sub")]);
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    same_bytes(&ia, &ib, "after the same edits");
    clean(&ia);

    // A FUSE mount and unmount of each, a second apart.
    if let Some(why) = fuse_mount::cannot_mount() {
        return skip(&format!("FUSE mount part: {why}"));
    }
    for img in [&ia, &ib] {
        let mut m = fuse_mount::Mounted::new_with_env(
            img,
            &[],
            &[("SOURCE_DATE_EPOCH", &EPOCH.to_string())],
        );
        assert!(m.join("nd/x").exists());
        let st = m.unmount();
        assert!(st.success(), "mount: {}", m.stderr());
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    same_bytes(&ia, &ib, "after a mount and unmount");
    clean(&ia);
}

/// The control: without SOURCE_DATE_EPOCH the same two builds differ (the test above
/// would catch a lost setting).
#[test]
fn without_the_epoch_builds_differ() {
    let work = TempDir::new("repro-ctl").expect("tempdir");
    let a = work.join("a");
    std::fs::create_dir(&a).expect("a");
    std::fs::write(a.join("f"), b"x").expect("f");
    let (ia, ib) = (work.join("a.img"), work.join("b.img"));
    for img in [&ia, &ib] {
        rext4_at(
            None,
            &[
                os("mkfs"),
                os("-q"),
                os("--seed"),
                os(SEED),
                os("-d"),
                a.as_os_str(),
                img.as_os_str(),
                os("8M"),
            ],
        );
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    assert_ne!(
        std::fs::read(&ia).expect("a"),
        std::fs::read(&ib).expect("b")
    );
}

/// A malformed SOURCE_DATE_EPOCH is refused (reproducible-builds.org asks tools to
/// fail rather than build unreproducibly), by mkfs and by the write tools.
#[test]
fn a_malformed_epoch_is_refused() {
    let work = TempDir::new("repro-bad").expect("tempdir");
    let img = work.join("x.img");
    let run = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_rext4"))
            .args(args)
            .env("SOURCE_DATE_EPOCH", "yesterday")
            .stdin(Stdio::null())
            .output()
            .expect("run")
    };
    let out = run(&[os("mkfs"), os("-q"), img.as_os_str(), os("8M")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("SOURCE_DATE_EPOCH"));
    rext4_at(None, &[os("mkfs"), os("-q"), img.as_os_str(), os("8M")]);
    let out = run(&[os("mkdir"), &common::spec(&img, "/x")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("SOURCE_DATE_EPOCH"));
}

/// The same tree as a tar file and as a gzip stream on standard input, built with the
/// epoch and a seed a second apart: the same bytes (what is placed depends on the
/// archive's contents alone, not on its compression or where it is read from).
#[test]
fn archive_builds_are_byte_identical_whatever_the_compression() {
    let work = TempDir::new("repro-tar").expect("tempdir");
    let src = work.join("src");
    std::fs::create_dir(&src).expect("src");
    make_tree(&src, false);
    let tar = work.join("t.tar");
    let st = Command::new("tar")
        .args(["--format=pax", "--xattrs", "-cf"])
        .arg(&tar)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success());
    let gz = work.join("t.tar.gz");
    let st = Command::new("sh")
        .arg("-c")
        .arg("gzip -c t.tar > t.tar.gz")
        .current_dir(work.path())
        .status()
        .expect("gzip");
    assert!(st.success());
    let (ia, ib) = (work.join("a.img"), work.join("b.img"));
    rext4_at(
        Some(EPOCH),
        &[
            os("mkfs"),
            os("-q"),
            os("--seed"),
            os(SEED),
            os("-d"),
            tar.as_os_str(),
            ia.as_os_str(),
            os("16M"),
        ],
    );
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let out = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args([
            os("mkfs"),
            os("-q"),
            os("--seed"),
            os(SEED),
            os("-d"),
            os("-"),
            ib.as_os_str(),
            os("16M"),
        ])
        .env("SOURCE_DATE_EPOCH", EPOCH.to_string())
        .stdin(std::fs::File::open(&gz).expect("gz"))
        .output()
        .expect("rext4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    same_bytes(&ia, &ib, "tar file and gzip on stdin");
    clean(&ia);
    assert_eq!(mtime_of(&ia, "/small"), EPOCH);
    assert_eq!(mtime_of(&ia, "/d/data"), 1_000_000_000);
}
