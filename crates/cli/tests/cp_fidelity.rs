//! `rext4 cp -r` fidelity: the tree extracted from a debugfs-populated fixture image
//! (1 KiB and 4 KiB blocks) equals what the kernel shows through a read-only loop mount
//! of the same image: names, types, modes, owners, sizes, file bytes, symlink targets,
//! device numbers, link counts, hard-link groups, xattrs (user., trusted., POSIX ACLs),
//! and atime and mtime to the nanosecond. Needs root (the fixture holds device nodes,
//! trusted.* xattrs and foreign owners); when loop mounts are unavailable
//! (`REXT4_NO_MOUNT`, no loop device), the file bytes are still checked against the
//! fixture's known contents.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::{rext4, spec};
use rext4_testkit::fixture::expected_files;
use rext4_testkit::tree::hash_file;
use rext4_testkit::{
    diff_trees, mkfs, populate_debugfs, skip, snapshot_dir, tree_path, Compare, Fixture, LoopMount,
    MkfsOptions, TempDir, Tree,
};

/// atime of every path under `root`, taken before anything under it is read: `lstat`
/// each path before listing it, and never open a file. `snapshot_dir` hashes file bytes
/// and lists directories, which under the host's `relatime` moves atimes (a hard-linked
/// file is read once per name, so its second `lstat` would see the first read).
fn pristine_atimes(root: &Path) -> BTreeMap<Vec<u8>, (i64, u32)> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let p = tree_path(root, &rel);
        let md = std::fs::symlink_metadata(&p).expect("lstat");
        out.insert(rel.clone(), (md.atime(), md.atime_nsec() as u32));
        if md.is_dir() {
            for e in std::fs::read_dir(&p).expect("read_dir") {
                let name = e.expect("entry").file_name();
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()));
                stack.push(child);
            }
        }
    }
    out
}

/// Snapshot of the extracted tree with the atimes rext4 left (see `pristine_atimes`).
fn snapshot_extracted(root: &Path) -> Tree {
    let atimes = pristine_atimes(root);
    let mut t = snapshot_dir(root).expect("snapshot dest");
    assert_eq!(
        t.keys().collect::<Vec<_>>(),
        atimes.keys().collect::<Vec<_>>(),
        "tree changed between walks"
    );
    for (k, n) in t.iter_mut() {
        n.atime = atimes[k];
    }
    t
}

fn variant(bs: u32) {
    let label = format!("{bs}");
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        // Device nodes, trusted.* xattrs and owners can only be recreated by root.
        return skip(&format!("[{label}] cp -r fidelity needs root"));
    }
    let img = mkfs(&MkfsOptions::new(bs, 48 << 20)).expect("mkfs");
    let fixture = Fixture::quick();
    populate_debugfs(img.path(), &fixture).expect("populate");

    let work = TempDir::new("cpfid").expect("tempdir");
    let dest: PathBuf = work.join("dest");
    let r = rext4(&[
        OsStr::new("cp"),
        OsStr::new("-r"),
        OsStr::new("-q"),
        &spec(img.path(), "/"),
        dest.as_os_str(),
    ]);
    assert_eq!(r.code, 0, "[{label}] cp -r failed:\n{}", r.stderr);
    assert!(r.stderr.is_empty(), "[{label}] stderr:\n{}", r.stderr);
    let ours = snapshot_extracted(&dest);

    // Known bytes, kernel or not.
    for (path, size, hash) in expected_files(&fixture, bs) {
        let p = dest.join(&path);
        let md = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(md.is_file(), "[{label}] {path} is not a regular file");
        assert_eq!(md.len(), size, "[{label}] {path} size");
        assert_eq!(hash_file(&p).expect("hash"), hash, "[{label}] {path} bytes");
    }
    // Holes stay holes: `sparse` (8 MiB + 333 bytes) holds 3 small pieces of data at
    // 0, 1 MiB and 8 MiB. rext4 skips all-zero 1 MiB read chunks, so the two chunks
    // holding data at 0 and 1 MiB are written whole (2 MiB); the 6 MiB between must
    // not be allocated.
    let sparse = std::fs::metadata(dest.join("sparse")).expect("sparse");
    assert!(
        sparse.blocks() * 512 < 4 << 20,
        "[{label}] sparse file takes {} 512-byte blocks",
        sparse.blocks()
    );

    let m = match LoopMount::new(img.path(), true, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel comparison: {e}")),
    };
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");
    assert!(
        kernel.len() > 600,
        "[{label}] kernel tree: {}",
        kernel.len()
    );

    let cmp = Compare {
        // ctime cannot be set from user space: every extracted inode's ctime is the time
        // of the copy.
        ignore_ctime: true,
        // Two filesystems, two inode number spaces...
        ignore_ino: true,
        // ...so hard links are compared as groups of paths sharing an inode.
        hardlinks_by_paths: true,
        // A directory's size is its block count on each filesystem (the host's ext4
        // lays out `big/`, lost+found's preallocated blocks etc. differently).
        ignore_dir_size: true,
        // Everything else is compared: atime and mtime of files, symlinks and
        // directories (nanoseconds; the mount is `noatime`, the extracted side is
        // read after recording its atimes), modes, owners (we run as root, else the
        // mount above skipped), sizes, nlink, rdev, symlink targets, xattrs, content.
        // lost+found needs no exception (it is an ordinary empty directory) and the
        // debugfs fixture holds no socket (rext4 cp skips sockets with an error).
        ..Compare::exact()
    };
    let d = diff_trees(&kernel, &ours, &cmp);
    assert!(
        d.is_empty(),
        "[{label}] kernel vs rext4 cp -r ({} differences):\n{}",
        d.len(),
        d[..d.len().min(40)].join("\n")
    );
    // The comparison saw the interesting parts.
    for p in [
        &b"dev/bigdev"[..],
        b"xattr/acldir",
        b"times/pre1970",
        b"dir/hl2",
        b"slowlink",
        b"lost+found",
    ] {
        assert!(
            ours.contains_key(p),
            "[{label}] missing {:?}",
            p.escape_ascii()
        );
    }
    eprintln!("[{label}] {} paths identical", ours.len());
}

#[test]
fn cp_r_matches_kernel_view_1k() {
    variant(1024);
}

#[test]
fn cp_r_matches_kernel_view_4k() {
    variant(4096);
}

/// setxattr(2) / getxattr(2) on a host path.
fn host_set(p: &Path, name: &str, v: &[u8]) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path");
    let n = std::ffi::CString::new(name).expect("name");
    // SAFETY: NUL-terminated strings; `v` is valid for `v.len()` bytes.
    let r = unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, 0, "setxattr {name}: {}", std::io::Error::last_os_error());
}

/// Large xattr values (ea_inode) survive `rext4 cp` both ways: from a kernel-mounted
/// ea_inode filesystem into an ea_inode image (the values go to inodes of their own:
/// e2fsck clean, the kernel reads them back), and out of that image onto a kernel
/// ea_inode mount.
#[test]
fn cp_keeps_large_xattrs_both_ways() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return skip("trusted.* xattrs and loop mounts need root");
    }
    let host = mkfs(&MkfsOptions::new(4096, 64 << 20).arg("-O").arg("ea_inode")).expect("mkfs");
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20).arg("-O").arg("ea_inode")).expect("mkfs");
    let m = match LoopMount::new(host.path(), false, "") {
        Ok(m) => m,
        Err(e) => return skip(&format!("host ea_inode mount: {e}")),
    };
    let v30: Vec<u8> = (0..30 << 10).map(|i: u32| (i * 7 % 251) as u8).collect();
    let v64: Vec<u8> = (0..64 << 10).map(|i: u32| (i * 13 % 241) as u8).collect();
    let src = m.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    let f = src.join("f");
    std::fs::write(&f, b"data").expect("write");
    host_set(&f, "user.big", &v30);
    host_set(&f, "trusted.max", &v64);
    host_set(&f, "user.small", b"small");
    let r = rext4(&[
        OsStr::new("cp"),
        OsStr::new("-r"),
        OsStr::new("-q"),
        src.as_os_str(),
        &spec(img.path(), "/in"),
    ]);
    assert_eq!(r.code, 0, "cp in: {}", r.stderr);
    let fsck = rext4_testkit::e2fsck_fn(img.path());
    assert!(fsck.clean, "after cp in: {}", fsck.output);
    let want: BTreeMap<Vec<u8>, Vec<u8>> = [
        (b"user.big".to_vec(), v30.clone()),
        (b"trusted.max".to_vec(), v64.clone()),
        (b"user.small".to_vec(), b"small".to_vec()),
    ]
    .into_iter()
    .collect();
    {
        let k = LoopMount::new(img.path(), true, "").expect("mount the copy");
        let got = rext4_testkit::read_xattrs(&k.path().join("in/f")).expect("xattrs");
        assert_eq!(got, want, "the kernel reads what cp wrote");
    }
    let out = m.path().join("out");
    let r = rext4(&[
        OsStr::new("cp"),
        OsStr::new("-q"),
        &spec(img.path(), "/in/f"),
        out.as_os_str(),
    ]);
    assert_eq!(r.code, 0, "cp out: {}", r.stderr);
    let got = rext4_testkit::read_xattrs(&out).expect("xattrs");
    assert_eq!(got, want, "cp out keeps the values");
    m.unmount().expect("unmount");
}
