//! The write tools against ground truth: `rext4 cp -r` of a host tree into a
//! mkfs.ext4 image must give an image e2fsck passes and that the kernel (read-only loop
//! mount) shows equal to the host tree: names, types, modes, owners, sizes, bytes,
//! holes, symlink targets, device numbers, hard-link groups, xattrs (user., trusted.,
//! security., POSIX ACLs) and atime/mtime to the nanosecond. mkdir, rm, mv, ln, chmod,
//! chown and truncate are each read back with `rext4 ls -l`/`stat` (and the kernel where
//! root) with e2fsck clean after every step; failing operations exit 1 (2 for usage) and
//! leave the image as it was.

mod common;

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::{rext4, spec, Run};
use rext4_testkit::{
    diff_trees, e2fsck_fn, mkfs, skip, snapshot_dir, tree_path, Compare, Image, LoopMount,
    MkfsOptions, TempDir, Tree,
};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn image() -> Image {
    mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs.ext4")
}

fn args(parts: &[&OsStr]) -> Vec<OsString> {
    parts.iter().map(|p| p.to_os_string()).collect()
}

/// Run rext4 and require exit code `want`.
fn run_ok(parts: &[&OsStr], want: i32) -> Run {
    let r = rext4(&args(parts));
    assert_eq!(
        r.code,
        want,
        "rext4 {:?}: exit {}\nstdout:\n{}\nstderr:\n{}",
        parts,
        r.code,
        r.stdout_str(),
        r.stderr
    );
    r
}

fn s(x: &str) -> &OsStr {
    OsStr::new(x)
}

fn assert_fsck_clean(img: &Path, when: &str) {
    let f = e2fsck_fn(img);
    assert!(f.clean, "e2fsck after {when}:\n{}", f.output);
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in test paths")
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) -> bool {
    let c = cpath(p);
    let n = CString::new(name).expect("name");
    // SAFETY: valid NUL-terminated strings and a value buffer of the given length.
    unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        ) == 0
    }
}

fn set_times(p: &Path, at: (i64, u32), mt: (i64, u32)) {
    let c = cpath(p);
    let ts = [
        libc::timespec {
            tv_sec: at.0,
            tv_nsec: at.1 as _,
        },
        libc::timespec {
            tv_sec: mt.0,
            tv_nsec: mt.1 as _,
        },
    ];
    // SAFETY: valid path and two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(r, 0, "utimensat {}", p.display());
}

fn mknod(p: &Path, kind: libc::mode_t, major: u32, minor: u32) {
    let c = cpath(p);
    // SAFETY: valid path.
    let r = unsafe { libc::mknod(c.as_ptr(), kind | 0o640, libc::makedev(major, minor)) };
    assert_eq!(r, 0, "mknod {}", p.display());
}

fn lchown(p: &Path, uid: u32, gid: u32) {
    let c = cpath(p);
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::lchown(c.as_ptr(), uid, gid) }, 0);
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A POSIX ACL in the Linux VFS xattr format (version 2; tag, perm, id entries).
fn vfs_acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

const UNDEF: u32 = u32::MAX;

/// The host tree to copy, and the atime every path was given (taken before anything
/// read the tree: reading moves atimes under the host's relatime).
struct HostTree {
    _dir: TempDir,
    root: PathBuf,
    atimes: BTreeMap<Vec<u8>, (i64, u32)>,
    /// Paths whose holes must survive: (relative path, host st_blocks).
    sparse: Vec<(String, u64)>,
}

fn build_host_tree() -> HostTree {
    let dir = TempDir::new("wt-host").expect("tempdir");
    let root = dir.join("tree");
    let p = |rel: &str| root.join(rel);
    std::fs::create_dir(&root).expect("mkdir");
    for d in [
        "private",
        "private/nested",
        "private/nested/deeper",
        "sgid",
        "sticky",
        "many",
        "acldir",
        "ünï cödé dir",
    ] {
        std::fs::create_dir(p(d)).expect("mkdir");
    }
    std::fs::write(p("empty"), b"").expect("write");
    std::fs::write(p("small"), b"hello world\n").expect("write");
    let big: Vec<u8> = (0..(3u32 << 20) + 123)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 9)) as u8)
        .collect();
    std::fs::write(p("big"), &big).expect("write");
    std::fs::write(p("private/nested/deeper/file"), b"deep\n").expect("write");
    std::fs::write(p("sgid/inner"), b"inner").expect("write");
    std::fs::write(p("ünï cödé dir/ñame with spaces"), b"utf8").expect("write");
    std::fs::write(p(&"L".repeat(255)), b"long name").expect("write");
    for i in 0..300 {
        std::fs::write(
            p(&format!("many/entry-{i:04}-{}", "x".repeat(i % 40))),
            [i as u8],
        )
        .expect("write");
    }
    // Sparse files: data, holes, a trailing hole; and a leading hole.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(p("sparse")).expect("create");
        f.write_all_at(&[b'A'; 4096], 0).expect("write");
        f.write_all_at(&[b'B'; 8192], (1 << 20) + 100)
            .expect("write");
        f.set_len(5 << 20).expect("set_len");
        let g = std::fs::File::create(p("sparse_lead")).expect("create");
        g.write_all_at(b"0123456789", 2 << 20).expect("write");
        g.set_len(3 << 20).expect("set_len");
        let h = std::fs::File::create(p("all_hole")).expect("create");
        h.set_len(10 << 20).expect("set_len");
    }
    std::fs::write(p("suid"), b"#!/bin/sh\n").expect("write");
    std::fs::write(p("acl_file"), b"acl").expect("write");
    // Hard links: three names for "small", across directories.
    std::fs::hard_link(p("small"), p("private/small_link")).expect("link");
    std::fs::hard_link(p("small"), p("hl2")).expect("link");
    // Symlinks: fast (< 60 bytes), slow (a block), dangling, to a directory.
    std::os::unix::fs::symlink("small", p("fast")).expect("symlink");
    std::os::unix::fs::symlink(format!("{}/target", "s".repeat(100)), p("slow")).expect("symlink");
    std::os::unix::fs::symlink("nowhere", p("dangling")).expect("symlink");
    std::os::unix::fs::symlink("private", p("dirlink")).expect("symlink");
    // Special files.
    // SAFETY: valid path.
    let fifo = cpath(&p("fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o620) }, 0);
    drop(std::os::unix::net::UnixListener::bind(p("sock")).expect("bind a unix socket"));
    if is_root() {
        mknod(&p("cdev"), libc::S_IFCHR, 1, 7);
        mknod(&p("bdev"), libc::S_IFBLK, 259, 70000);
    } else {
        skip(
            "not root: the host tree has no device nodes, trusted/security xattrs or other owners",
        );
    }
    // Modes (after the files in them are created).
    chmod(&p("private"), 0o700);
    chmod(&p("sgid"), 0o2775);
    chmod(&p("sticky"), 0o1777);
    chmod(&p("suid"), 0o4755);
    chmod(&p("big"), 0o600);
    chmod(&p("small"), 0o640);
    // Xattrs: small ones in the inode, a large one in an xattr block, ACLs.
    let mut xattrs_ok = set_xattr(&p("small"), "user.color", b"blue");
    xattrs_ok &= set_xattr(&p("big"), "user.big", &vec![b'v'; 3000]);
    xattrs_ok &= set_xattr(&p("private"), "user.dir", b"");
    xattrs_ok &= set_xattr(
        &p("acl_file"),
        "system.posix_acl_access",
        &vfs_acl(&[
            (0x01, 6, UNDEF),
            (0x02, 4, 1000),
            (0x04, 4, UNDEF),
            (0x08, 6, 2000),
            (0x10, 6, UNDEF),
            (0x20, 0, UNDEF),
        ]),
    );
    xattrs_ok &= set_xattr(
        &p("acldir"),
        "system.posix_acl_default",
        &vfs_acl(&[(0x01, 7, UNDEF), (0x04, 5, UNDEF), (0x20, 5, UNDEF)]),
    );
    if is_root() {
        xattrs_ok &= set_xattr(&p("small"), "trusted.t", b"1");
        xattrs_ok &= set_xattr(&p("sgid"), "security.s", b"label");
        xattrs_ok &= set_xattr(&p("fast"), "trusted.on_symlink", b"x");
        lchown(&p("small"), 1234, 5678);
        lchown(&p("private"), 4321, 8765);
        lchown(&p("fast"), 11, 22);
        lchown(&p("cdev"), 7, 8);
        // chown clears set-id bits: set them again.
        chmod(&p("private"), 0o700);
    }
    assert!(xattrs_ok, "the host filesystem refused a test xattr");
    // Times last, children before parents, with distinct nanoseconds.
    let mut paths: Vec<Vec<u8>> = Vec::new();
    let mut stack = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let abs = tree_path(&root, &rel);
        if std::fs::symlink_metadata(&abs).expect("lstat").is_dir() {
            for e in std::fs::read_dir(&abs).expect("read_dir") {
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(e.expect("entry").file_name().as_bytes());
                stack.push(child);
            }
        }
        paths.push(rel);
    }
    paths.sort_by_key(|r| {
        std::cmp::Reverse(r.iter().filter(|&&c| c == b'/').count() + usize::from(!r.is_empty()))
    });
    let mut atimes = BTreeMap::new();
    for (i, rel) in paths.iter().enumerate() {
        let i = i as i64;
        let at = (
            1_600_000_000 + i * 1000,
            (i as u32 * 7919 + 1) % 1_000_000_000,
        );
        let mt = (
            1_500_000_000 + i * 777,
            (i as u32 * 104_729 + 3) % 1_000_000_000,
        );
        set_times(&tree_path(&root, rel), at, mt);
        atimes.insert(rel.clone(), at);
    }
    // Hard-linked names share one inode: the last time set wins for all of them.
    let small_at = ["small", "hl2", "private/small_link"]
        .iter()
        .map(|n| std::fs::symlink_metadata(p(n)).expect("lstat"))
        .map(|m| (m.atime(), m.atime_nsec() as u32))
        .next()
        .expect("small");
    for n in ["small", "hl2", "private/small_link"] {
        atimes.insert(n.as_bytes().to_vec(), small_at);
    }
    let sparse = ["sparse", "sparse_lead", "all_hole"]
        .iter()
        .map(|n| {
            let m = std::fs::symlink_metadata(p(n)).expect("lstat");
            assert!(m.blocks() * 512 < m.len(), "host kept {n} sparse");
            (n.to_string(), m.blocks())
        })
        .collect();
    HostTree {
        _dir: dir,
        root,
        atimes,
        sparse,
    }
}

/// What the comparison of a copy with its host original ignores, and why:
/// - ctime: no interface sets it; every copy gets the time it was made.
/// - inode numbers: the image allocates its own; hard-link groups are compared instead
///   (same sets of paths share an inode on both sides).
/// - directory sizes: they depend on how many blocks the directory needed (htree index
///   blocks, history of growth), not on the entries; the entries are compared.
/// - atime: reading the host tree (the copy itself, and the snapshot that hashes file
///   bytes and lists directories) moves host atimes under relatime; atimes are instead
///   checked against the values the test set (`HostTree::atimes`).
fn copy_compare() -> Compare {
    Compare {
        ignore_dir_size: true,
        ..Compare::semantic()
    }
}

fn check_atimes(t: &Tree, want: &BTreeMap<Vec<u8>, (i64, u32)>, label: &str) {
    let mut bad = Vec::new();
    for (k, at) in want {
        match t.get(k) {
            Some(n) if n.atime == *at => {}
            Some(n) => bad.push(format!(
                "/{}: atime {:?} != {:?}",
                k.escape_ascii(),
                n.atime,
                at
            )),
            None => bad.push(format!("/{}: missing", k.escape_ascii())),
        }
    }
    assert!(bad.is_empty(), "[{label}] atimes:\n{}", bad.join("\n"));
}

#[test]
fn cp_host_tree_into_image_equals_host() {
    let host = build_host_tree();
    let img = image();
    let r = run_ok(
        &[
            s("cp"),
            s("-r"),
            host.root.as_os_str(),
            &spec(img.path(), "/"),
        ],
        0,
    );
    assert!(r.stderr.is_empty(), "cp stderr:\n{}", r.stderr);
    assert_fsck_clean(img.path(), "cp -r into the image");

    // The kernel's view of the image equals the host tree.
    let host_tree = snapshot_dir(&host.root).expect("snapshot host");
    match LoopMount::new(img.path(), true, "noatime") {
        Ok(m) => {
            let copy = m.path().join("tree");
            let t = snapshot_dir(&copy).expect("snapshot mount");
            let d = diff_trees(&host_tree, &t, &copy_compare());
            assert!(
                d.is_empty(),
                "kernel view of the copy differs:\n{}",
                d.join("\n")
            );
            check_atimes(&t, &host.atimes, "kernel");
            for (name, host_blocks) in &host.sparse {
                let md = std::fs::symlink_metadata(copy.join(name)).expect("lstat");
                assert_eq!(
                    md.blocks(),
                    *host_blocks,
                    "{name}: allocated 512-byte units"
                );
            }
            // Large directory: e2fsck passed, and every entry is there.
            assert_eq!(
                std::fs::read_dir(copy.join("many")).expect("ls").count(),
                300
            );
        }
        Err(why) => skip(&format!("kernel comparison: {why}")),
    }

    // Round trip through rext4 itself: copying the tree back out gives the host tree.
    let out = TempDir::new("wt-out").expect("tempdir");
    let dest = out.join("back");
    // Copying out skips sockets (reported, exit 1): that one difference is expected.
    let r = run_ok(
        &[
            s("cp"),
            s("-r"),
            s("-q"),
            &spec(img.path(), "/tree"),
            dest.as_os_str(),
        ],
        1,
    );
    let errs: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| !l.contains("error(s) while copying"))
        .collect();
    assert!(
        errs.len() == 1 && errs[0].contains("sock"),
        "cp out:\n{}",
        r.stderr
    );
    let back = snapshot_dir(&dest).expect("snapshot round trip");
    let mut cmp = copy_compare();
    cmp.ignore_paths.push(b"sock".to_vec());
    let d = diff_trees(&host_tree, &back, &cmp);
    assert!(d.is_empty(), "round trip differs:\n{}", d.join("\n"));
}

#[test]
fn cp_into_existing_dirs_files_and_names() {
    let dir = TempDir::new("wt-cp").expect("tempdir");
    let a = dir.join("a.txt");
    let b = dir.join("b.txt");
    std::fs::write(&a, b"first version, longer than the second\n").expect("write");
    std::fs::write(&b, b"bee\n").expect("write");
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).expect("mkdir");
    std::fs::write(sub.join("x"), b"x1").expect("write");
    let img = image();
    let sp = |p: &str| spec(img.path(), p);
    run_ok(&[s("mkdir"), &sp("/d")], 0);
    // Several sources into a directory.
    run_ok(&[s("cp"), a.as_os_str(), b.as_os_str(), &sp("/d")], 0);
    // A single file to a new name.
    run_ok(&[s("cp"), b.as_os_str(), &sp("/d/renamed")], 0);
    // Over an existing file: replaced.
    std::fs::write(&a, b"v2\n").expect("write");
    run_ok(&[s("cp"), a.as_os_str(), &sp("/d/a.txt")], 0);
    let cat = |p: &str| run_ok(&[s("cat"), &sp(p)], 0).stdout;
    assert_eq!(cat("/d/a.txt"), b"v2\n");
    assert_eq!(cat("/d/b.txt"), b"bee\n");
    assert_eq!(cat("/d/renamed"), b"bee\n");
    // SRC/. merges the contents into an existing directory; again, to overwrite.
    let mut dot = sub.clone().into_os_string();
    dot.push("/.");
    run_ok(&[s("cp"), s("-r"), &dot, &sp("/d")], 0);
    std::fs::write(sub.join("x"), b"x2").expect("write");
    run_ok(&[s("cp"), s("-r"), &dot, &sp("/d")], 0);
    assert_eq!(cat("/d/x"), b"x2");
    // Directories need -r; several sources need a directory target.
    let r = run_ok(&[s("cp"), sub.as_os_str(), &sp("/d")], 1);
    assert!(r.stderr.contains("Is a directory"), "{}", r.stderr);
    let r = run_ok(&[s("cp"), a.as_os_str(), b.as_os_str(), &sp("/d/a.txt")], 1);
    assert!(r.stderr.contains("Not a directory"), "{}", r.stderr);
    // A missing source is reported and the others are still copied.
    let r = run_ok(
        &[
            s("cp"),
            dir.join("missing").as_os_str(),
            b.as_os_str(),
            &sp("/"),
        ],
        1,
    );
    assert!(
        r.stderr.contains("missing") && r.stderr.contains("1 error(s)"),
        "{}",
        r.stderr
    );
    assert_eq!(cat("/b.txt"), b"bee\n");
    // Between two images: usage error.
    let img2 = image();
    let r = run_ok(&[s("cp"), &sp("/b.txt"), &spec(img2.path(), "/")], 2);
    assert!(r.stderr.contains("between images"), "{}", r.stderr);
    assert_fsck_clean(img.path(), "cp into existing targets");
    let listing = run_ok(&[s("ls"), &sp("/d")], 0).stdout_str();
    assert_eq!(listing, "a.txt\nb.txt\nrenamed\nx\n");
}

/// `rext4 ls -l IMAGE:/dir` line for `name` (mode, links, uid, gid, size, ..., name).
fn ls_line(img: &Path, dir: &str, name: &str) -> Option<Vec<String>> {
    let out = run_ok(&[s("ls"), s("-l"), &spec(img, dir)], 0).stdout_str();
    out.lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|w| w.get(8).map(String::as_str) == Some(name))
}

/// (mode string, links, uid, gid, size) from `ls -l`.
fn ls_fields(img: &Path, dir: &str, name: &str) -> (String, u32, u32, u32, String) {
    let w = ls_line(img, dir, name).unwrap_or_else(|| panic!("{dir}/{name} not listed"));
    (
        w[0].clone(),
        w[1].parse().expect("links"),
        w[2].parse().expect("uid"),
        w[3].parse().expect("gid"),
        w[4].clone(),
    )
}

#[test]
fn namespace_and_attribute_tools() {
    let img = image();
    let p = img.path();
    let sp = |x: &str| spec(p, x);
    let step = |parts: &[&OsStr], what: &str| {
        run_ok(parts, 0);
        assert_fsck_clean(p, what);
    };
    step(&[s("mkdir"), &sp("/a")], "mkdir");
    assert_eq!(ls_fields(p, "/", "a").0, "drwxr-xr-x");
    step(
        &[s("mkdir"), s("-p"), s("-m"), s("700"), &sp("/a/b/c")],
        "mkdir -p",
    );
    assert_eq!(ls_fields(p, "/a", "b").0, "drwxr-xr-x");
    assert_eq!(ls_fields(p, "/a/b", "c").0, "drwx------");
    assert_eq!(ls_fields(p, "/a", "b").1, 3, "b holds c: 2 + 1 links");
    step(
        &[s("mkdir"), s("-p"), &sp("/a/b")],
        "mkdir -p of an existing directory",
    );

    let host = TempDir::new("wt-ops").expect("tempdir");
    let f = host.join("f");
    std::fs::write(&f, b"0123456789").expect("write");
    step(&[s("cp"), f.as_os_str(), &sp("/a/f")], "cp a file in");
    step(&[s("ln"), &sp("/a/f"), &sp("/a/b/f2")], "ln");
    assert_eq!(ls_fields(p, "/a", "f").1, 2);
    assert_eq!(ls_fields(p, "/a/b", "f2").1, 2);
    step(&[s("ln"), s("-s"), s("../f"), &sp("/a/b/sl")], "ln -s");
    let w = ls_line(p, "/a/b", "sl").expect("sl listed");
    assert_eq!(w[0], "lrwxrwxrwx");
    assert_eq!(w.last().map(String::as_str), Some("../f"));
    assert_eq!(run_ok(&[s("cat"), &sp("/a/b/sl")], 0).stdout, b"0123456789");
    // ln into a directory keeps the target's name.
    step(
        &[s("ln"), &sp("/a/f"), &sp("/a/b/c")],
        "ln into a directory",
    );
    assert_eq!(ls_fields(p, "/a/b/c", "f").1, 3);

    step(&[s("chmod"), s("4750"), &sp("/a/f")], "chmod");
    assert_eq!(ls_fields(p, "/a", "f").0, "-rwsr-x---");
    step(&[s("chown"), s("1000:2000"), &sp("/a/f")], "chown");
    let (mode, _, uid, gid, _) = ls_fields(p, "/a", "f");
    assert_eq!((uid, gid), (1000, 2000));
    assert_eq!(
        mode, "-rwxr-x---",
        "chown clears set-user-ID, as chown(2) does"
    );
    step(&[s("chown"), s(":33"), &sp("/a/f")], "chown :GID");
    assert_eq!(ls_fields(p, "/a", "f").2, 1000);
    assert_eq!(ls_fields(p, "/a", "f").3, 33);
    step(&[s("chown"), s("-h"), s("5:6"), &sp("/a/b/sl")], "chown -h");
    let (_, _, u, g, _) = ls_fields(p, "/a/b", "sl");
    assert_eq!((u, g), (5, 6));
    assert_eq!(
        ls_fields(p, "/a", "f").2,
        1000,
        "-h leaves the target alone"
    );
    step(
        &[s("chmod"), s("644"), &sp("/a/b/sl")],
        "chmod through a symlink",
    );
    assert_eq!(ls_fields(p, "/a", "f").0, "-rw-r--r--");

    step(
        &[s("truncate"), s("-s"), s("10000"), &sp("/a/f")],
        "truncate up",
    );
    assert_eq!(ls_fields(p, "/a", "f").4, "10000");
    let data = run_ok(&[s("cat"), &sp("/a/f")], 0).stdout;
    assert_eq!(&data[..10], b"0123456789");
    assert!(data[10..].iter().all(|&b| b == 0) && data.len() == 10000);
    step(
        &[s("truncate"), s("-s"), s("4"), &sp("/a/f")],
        "truncate down",
    );
    step(
        &[s("truncate"), s("-s"), s("+2"), &sp("/a/f")],
        "truncate +2",
    );
    assert_eq!(run_ok(&[s("cat"), &sp("/a/f")], 0).stdout, b"0123\0\0");
    step(
        &[s("truncate"), s("-s"), s("1M"), &sp("/a/new")],
        "truncate creates",
    );
    assert_eq!(ls_fields(p, "/a", "new").4, "1048576");
    let st = run_ok(&[s("stat"), &sp("/a/new")], 0).stdout_str();
    assert!(
        st.contains("Blocks: 0 "),
        "a truncated-up file has no blocks:\n{st}"
    );
    step(
        &[s("truncate"), s("-c"), s("-s"), s("5"), &sp("/a/none")],
        "truncate -c",
    );
    assert!(ls_line(p, "/a", "none").is_none());

    step(&[s("mv"), &sp("/a/f"), &sp("/a/moved")], "mv to a new name");
    assert!(ls_line(p, "/a", "f").is_none());
    assert_eq!(ls_fields(p, "/a", "moved").1, 3);
    step(
        &[s("mv"), &sp("/a/b/f2"), &sp("/a/b/c")],
        "mv into a directory",
    );
    assert!(ls_line(p, "/a/b", "f2").is_none());
    assert_eq!(ls_fields(p, "/a/b/c", "f2").1, 3);
    step(&[s("mv"), &sp("/a/b/c"), &sp("/top")], "mv a directory up");
    assert_eq!(ls_fields(p, "/a", "b").1, 2, "b lost its subdirectory");
    assert_eq!(ls_fields(p, "/", "top").1, 2);
    step(&[s("rm"), &sp("/a/moved")], "rm");
    assert_eq!(ls_fields(p, "/top", "f").1, 2);
    step(&[s("rm"), &sp("/top/f2")], "rm of a second link");
    assert_eq!(ls_fields(p, "/top", "f").1, 1);
    step(
        &[s("rm"), s("-d"), &sp("/a/b/sl")],
        "rm of a symlink with -d",
    );
    step(
        &[s("rm"), s("-d"), &sp("/a/b")],
        "rm -d of an empty directory",
    );
    step(&[s("rm"), s("-r"), &sp("/top")], "rm -r");
    let root = run_ok(&[s("ls"), &sp("/")], 0).stdout_str();
    assert_eq!(root, "a\nlost+found\n");
    assert_eq!(run_ok(&[s("ls"), &sp("/a")], 0).stdout_str(), "new\n");

    // The kernel agrees.
    match LoopMount::new(p, true, "noatime") {
        Ok(m) => {
            let t = snapshot_dir(m.path()).expect("snapshot");
            let keys: Vec<String> = t
                .keys()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect();
            assert_eq!(keys, ["", "a", "a/new", "lost+found"]);
            let n = &t[b"a/new".as_slice()];
            assert_eq!((n.size, n.mode, n.nlink), (1 << 20, 0o100644, 1));
            assert_eq!(t[b"a".as_slice()].nlink, 2);
            assert_eq!(t[b"".as_slice()].nlink, 4);
        }
        Err(why) => skip(&format!("kernel check: {why}")),
    }
}

#[test]
fn failing_operations_exit_nonzero_and_change_nothing() {
    let img = image();
    let p = img.path();
    let sp = |x: &str| spec(p, x);
    run_ok(&[s("mkdir"), &sp("/d")], 0);
    run_ok(&[s("mkdir"), &sp("/d/sub")], 0);
    run_ok(&[s("truncate"), s("-s"), s("5"), &sp("/d/file")], 0);
    run_ok(&[s("ln"), &sp("/d/file"), &sp("/d/hard")], 0);
    let listing = |dir: &str| run_ok(&[s("ls"), s("-l"), &sp(dir)], 0).stdout_str();
    let before = (listing("/"), listing("/d"));
    let expect_fail = |parts: &[&OsStr], code: i32, words: &[&str]| {
        let r = run_ok(parts, code);
        for w in words {
            assert!(
                r.stderr.contains(w),
                "{parts:?}: stderr lacks {w:?}:\n{}",
                r.stderr
            );
        }
    };
    let missing = sp("/missing").to_string_lossy().into_owned();
    expect_fail(
        &[s("rm"), &sp("/missing")],
        1,
        &[&missing, "No such file or directory"],
    );
    expect_fail(&[s("mkdir"), &sp("/d")], 1, &["/d", "File exists"]);
    expect_fail(
        &[s("mkdir"), &sp("/nope/x")],
        1,
        &["No such file or directory"],
    );
    expect_fail(
        &[s("mkdir"), s("-p"), &sp("/d/file/x")],
        1,
        &["Not a directory"],
    );
    expect_fail(&[s("rm"), &sp("/d")], 1, &["Is a directory"]);
    expect_fail(&[s("rm"), s("-d"), &sp("/d")], 1, &["Directory not empty"]);
    expect_fail(&[s("rm"), s("-r"), &sp("/")], 1, &["refusing"]);
    expect_fail(&[s("mv"), &sp("/d"), &sp("/d/sub/in")], 1, &["into itself"]);
    expect_fail(&[s("mv"), &sp("/missing"), &sp("/x")], 1, &["No such file"]);
    // A missing source onto its own name is missing too (it passed as a no-op), and a
    // file onto itself or onto another of its hard links is refused, as by mv(1).
    expect_fail(
        &[s("mv"), &sp("/missing"), &sp("/missing")],
        1,
        &["No such file"],
    );
    for other in ["/d/file", "/d/hard"] {
        expect_fail(
            &[s("mv"), &sp("/d/file"), &sp(other)],
            1,
            &["are the same file"],
        );
    }
    expect_fail(&[s("ln"), &sp("/missing"), &sp("/l")], 1, &["No such file"]);
    expect_fail(
        &[s("ln"), &sp("/d"), &sp("/l")],
        1,
        &["Operation not permitted"],
    );
    expect_fail(
        &[s("ln"), s("-s"), s("t"), &sp("/d/file")],
        1,
        &["File exists"],
    );
    expect_fail(
        &[s("chmod"), s("755"), &sp("/missing")],
        1,
        &["No such file"],
    );
    expect_fail(
        &[s("truncate"), s("-s"), s("1"), &sp("/d")],
        1,
        &["Is a directory"],
    );
    // Usage errors.
    expect_fail(&[s("chmod"), s("999"), &sp("/d")], 2, &["invalid mode"]);
    expect_fail(
        &[s("chown"), s("no-such-user-rext4"), &sp("/d")],
        2,
        &["invalid user"],
    );
    expect_fail(
        &[s("truncate"), s("-s"), s("1x"), &sp("/d/file")],
        2,
        &["invalid size"],
    );
    expect_fail(&[s("mkdir"), s("no-image-here")], 2, &["IMAGE:/path"]);
    let other = image();
    expect_fail(
        &[s("mv"), &sp("/d"), &spec(other.path(), "/d")],
        2,
        &["same image"],
    );
    // Several operands: the good ones are done, the exit code reports the bad one.
    run_ok(&[s("mkdir"), &sp("/d"), &sp("/e")], 1);
    run_ok(&[s("rm"), s("-d"), &sp("/e")], 0);
    // rm -f of something missing is fine.
    run_ok(&[s("rm"), s("-f"), &sp("/missing")], 0);
    assert_eq!(
        (listing("/"), listing("/d")),
        before,
        "failed operations changed the image"
    );
    assert_fsck_clean(p, "the failing operations");
    // The kernel sees what the listings show, nothing the failed operations left.
    match LoopMount::new(p, true, "noatime") {
        Ok(m) => {
            let t = snapshot_dir(m.path()).expect("snapshot");
            let keys: Vec<String> = t
                .keys()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect();
            assert_eq!(keys, ["", "d", "d/file", "d/hard", "d/sub", "lost+found"]);
            assert_eq!(t[b"d/file".as_slice()].size, 5);
        }
        Err(why) => skip(&format!("kernel check of the untouched image: {why}")),
    }
}

/// Compare a source tree with the kernel's view of an image made by `rext4 mkfs -d`:
/// the image root has lost+found besides the source's entries (so its link count is
/// one higher); everything else must be equal, attribute for attribute.
fn mkfs_d_matches(src: &Path, img: &Path, label: &str) {
    let src_tree = snapshot_dir(src).expect("snapshot source");
    match LoopMount::new(img, true, "noatime") {
        Ok(m) => {
            let mut t = snapshot_dir(m.path()).expect("snapshot mount");
            let mut cmp = copy_compare();
            cmp.ignore_paths.push(b"lost+found".to_vec());
            let mut want = src_tree.clone();
            let (a, b) = (
                want.remove(&b""[..]).expect("root"),
                t.remove(&b""[..]).expect("root"),
            );
            assert_eq!(
                (a.mode, a.uid, a.gid, a.mtime),
                (b.mode, b.uid, b.gid, b.mtime),
                "{label}: root"
            );
            assert_eq!(a.nlink + 1, b.nlink, "{label}: root links (+ lost+found)");
            let d = diff_trees(&want, &t, &cmp);
            assert!(
                d.is_empty(),
                "{label}: kernel view differs from the source:\n{}",
                d.join("\n")
            );
        }
        Err(why) => skip(&format!("{label}: kernel comparison: {why}")),
    }
}

/// `cp` of a file larger than the free space: the engine takes what fits of the chunk
/// that meets the full disk (a short write), and the copy must go on from there, so that
/// it fails at the first byte that did not fit. The error names that offset, the file
/// ends exactly there, every byte before it is the source's, and the image is clean.
/// (Before, a short write was taken for the whole chunk: the file ended below the
/// offset the error named.)
#[test]
fn cp_onto_a_full_disk_stops_at_the_first_byte_that_did_not_fit() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs.ext4");
    let p = img.path();
    let host = TempDir::new("cp-full").expect("tempdir");
    let src = host.path().join("big");
    // Incompressible and position-dependent, so that a skipped or shifted run shows.
    let data: Vec<u8> = (0..48u64 << 20)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (i >> 12) as u8)
        .collect();
    std::fs::write(&src, &data).expect("write source");
    let r = run_ok(&[s("cp"), src.as_os_str(), &spec(p, "/")], 1);
    assert!(r.stderr.contains("No space left on device"), "{}", r.stderr);
    let at: u64 = r
        .stderr
        .split("writing at ")
        .nth(1)
        .and_then(|t| t.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no offset in the error: {}", r.stderr));
    assert!(at > 0 && at < data.len() as u64, "offset {at}");
    let got = run_ok(&[s("cat"), &spec(p, "/big")], 0).stdout;
    assert_eq!(
        got.len() as u64,
        at,
        "the file ends at {} but the copy failed at {at}",
        got.len()
    );
    let bad = got.iter().zip(&data).position(|(a, b)| a != b);
    assert_eq!(bad, None, "the copy differs from the source");
    assert_fsck_clean(p, "cp onto a full disk");
}

/// As cp(1): without -r a special file named on the command line is read, so
/// `producer | rext4 cp /dev/stdin IMAGE:/f` stores what the pipe carried (before, the
/// image got a FIFO); with -r a FIFO is made again as a FIFO.
#[test]
fn cp_of_a_pipe_stores_its_bytes() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let img = image();
    let p = img.path();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args([
            OsStr::new("cp"),
            OsStr::new("/dev/stdin"),
            &spec(p, "/piped"),
        ])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rext4 cp");
    let mut stdin = child.stdin.take().expect("stdin");
    // Written from another thread: the pipe holds less than the data.
    let feed = {
        let data = data.clone();
        std::thread::spawn(move || stdin.write_all(&data))
    };
    let out = child.wait_with_output().expect("wait");
    feed.join().expect("feeder").expect("write to the pipe");
    assert!(
        out.status.success(),
        "cp /dev/stdin: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = run_ok(&[s("stat"), &spec(p, "/piped")], 0).stdout_str();
    assert!(st.contains("regular file"), "not a regular file:\n{st}");
    let got = run_ok(&[s("cat"), &spec(p, "/piped")], 0).stdout;
    assert!(
        got == data,
        "read back {} bytes, not the {} sent",
        got.len(),
        data.len()
    );
    // A character device without -r: its bytes (none, for /dev/null).
    run_ok(&[s("cp"), s("/dev/null"), &spec(p, "/empty")], 0);
    let st = run_ok(&[s("stat"), &spec(p, "/empty")], 0).stdout_str();
    assert!(
        st.contains("regular empty file"),
        "/dev/null copied as:\n{st}"
    );
    // With -r a FIFO stays a FIFO (nothing is read from it).
    let host = TempDir::new("cp-fifo").expect("tempdir");
    let fifo = host.path().join("fifo");
    let c = CString::new(fifo.as_os_str().as_bytes()).expect("path");
    // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    run_ok(&[s("cp"), s("-r"), fifo.as_os_str(), &spec(p, "/fifo")], 0);
    let st = run_ok(&[s("stat"), &spec(p, "/fifo")], 0).stdout_str();
    assert!(st.contains("fifo"), "-r made of a FIFO:\n{st}");
    assert_fsck_clean(p, "cp of a pipe");
}

/// As cp(1): a destination that is a character device or a pipe is written in
/// sequence, holes as zeros (`cp IMAGE:/f /dev/null`, `/dev/stdout` into a pipe), and
/// `/dev/stdout` writes where the shell pointed it (a file opened for appending here).
/// The named device keeps its mode, owner and times, and even with -f nothing is removed
/// or replaced (before, `cp -f IMAGE:/f /dev/null` removed /dev/null and made a regular
/// file in its place, and so for a block device; without -f these gave "File exists").
#[test]
fn cp_out_to_a_device_or_a_descriptor() {
    use std::os::unix::fs::FileTypeExt;
    use std::process::{Command, Stdio};
    let img = image();
    let p = img.path();
    run_ok(
        &[
            s("io"),
            s("-f"),
            s("-c"),
            s("pwrite -S 0x61 1m 4k"),
            s("-c"),
            s("pwrite -S 0x62 0 100"),
            &spec(p, "/sparse"),
        ],
        0,
    );
    let want = run_ok(&[s("cat"), &spec(p, "/sparse")], 0).stdout;
    assert_eq!(want.len(), (1 << 20) + 4096);
    // stdout is a pipe in `rext4()`.
    let got = run_ok(&[s("cp"), &spec(p, "/sparse"), s("/dev/stdout")], 0).stdout;
    assert!(got == want, "through /dev/stdout: {} bytes", got.len());
    // The device destinations are nodes of our own in a temp dir (the same devices as
    // /dev/null and a loop device), so that a regression that removes or replaces a
    // destination cannot harm the machine's /dev.
    let nodes = TempDir::new("cp-dev").expect("tempdir");
    let mknod = |name: &str, kind: libc::mode_t, dev: libc::dev_t| -> Result<PathBuf, String> {
        let path = nodes.path().join(name);
        let c = CString::new(path.as_os_str().as_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path; mknod reads nothing else.
        if unsafe { libc::mknod(c.as_ptr(), kind | 0o666, dev) } != 0 {
            return Err(format!("mknod: {}", std::io::Error::last_os_error()));
        }
        Ok(path)
    };
    // A character device (`cp IMAGE:/f /dev/null`), with and without -f.
    match mknod("null", libc::S_IFCHR, libc::makedev(1, 3)) {
        Err(e) => skip(&format!("cp into a character device: {e}")),
        Ok(null) => {
            let before = std::fs::symlink_metadata(&null).expect("null");
            for force in [false, true] {
                let mut a = vec![s("cp")];
                if force {
                    a.push(s("-f"));
                }
                let src = spec(p, "/sparse");
                a.extend([src.as_os_str(), null.as_os_str()]);
                run_ok(&a, 0);
                let now = std::fs::symlink_metadata(&null).expect("null");
                assert!(
                    now.file_type().is_char_device(),
                    "null replaced (-f {force})"
                );
                assert_eq!(now.mode(), before.mode(), "null's mode changed");
                assert_eq!((now.uid(), now.rdev()), (before.uid(), before.rdev()));
                assert_eq!(now.mtime(), before.mtime(), "null's times were set");
            }
        }
    }
    // A block device (`cp -f IMAGE:/disk.raw /dev/sdX`): written, holes as zeros over
    // what it held, and still the device afterwards.
    let raw = nodes.path().join("blk.raw");
    std::fs::write(&raw, vec![0xEEu8; 2 << 20]).expect("backing file");
    match rext4_testkit::LoopDevice::attach(&raw) {
        Err(e) => skip(&format!("cp into a block device: {e}")),
        Ok(dev) => {
            let rdev = std::fs::metadata(dev.path()).expect("loop device").rdev();
            let blk = mknod("blk", libc::S_IFBLK, rdev).expect("mknod of the loop device");
            run_ok(&[s("cp"), s("-f"), &spec(p, "/sparse"), blk.as_os_str()], 0);
            let md = std::fs::symlink_metadata(&blk).expect("device");
            assert!(
                md.file_type().is_block_device(),
                "the device node was replaced"
            );
            drop(dev);
            let got = std::fs::read(&raw).expect("read backing file");
            assert!(
                got[..want.len()] == want[..],
                "the device holds other bytes"
            );
            assert!(
                got[want.len()..].iter().all(|&b| b == 0xEE),
                "past the copy"
            );
        }
    }
    let host = TempDir::new("cp-fd").expect("tempdir");
    let out = host.path().join("out");
    std::fs::write(&out, b"first\n").expect("write");
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&out)
        .expect("open for appending");
    let st = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args([s("cp"), s("-f"), &spec(p, "/sparse"), s("/dev/stdout")])
        .stdin(Stdio::null())
        .stdout(f)
        .status()
        .expect("run rext4 cp");
    assert!(st.success(), "cp to /dev/stdout redirected to a file: {st}");
    let got = std::fs::read(&out).expect("read");
    assert!(
        got.len() == 6 + want.len() && got.starts_with(b"first\n") && got[6..] == want[..],
        "/dev/stdout >> file: {} bytes",
        got.len()
    );
    assert!(std::fs::symlink_metadata("/dev/stdout")
        .expect("/dev/stdout")
        .file_type()
        .is_symlink());
}

#[test]
fn mkfs_d_of_a_tree_equals_the_source() {
    let host = build_host_tree();
    let out = TempDir::new("mkfs-d").expect("tempdir");
    let img = out.join("fs.img");
    // 4 KiB blocks: the tree has an xattr larger than a 1 KiB block.
    let r = run_ok(
        &[
            s("mkfs"),
            s("-q"),
            s("-b"),
            s("4096"),
            s("-d"),
            host.root.as_os_str(),
            img.as_os_str(),
            s("64M"),
        ],
        0,
    );
    assert!(r.stderr.is_empty(), "mkfs -d stderr:\n{}", r.stderr);
    assert_fsck_clean(&img, "mkfs -d");
    mkfs_d_matches(&host.root, &img, "host tree");
}

#[test]
fn mkfs_d_of_usr_share_doc() {
    let src = Path::new("/usr/share/doc");
    if !src.is_dir() || !is_root() {
        return skip("/usr/share/doc absent or not root");
    }
    let out = TempDir::new("mkfs-doc").expect("tempdir");
    let img = out.join("doc.img");
    let r = run_ok(
        &[
            s("mkfs"),
            s("-q"),
            s("-d"),
            src.as_os_str(),
            img.as_os_str(),
            s("512M"),
        ],
        0,
    );
    assert!(r.stderr.is_empty(), "mkfs -d stderr:\n{}", r.stderr);
    assert_fsck_clean(&img, "mkfs -d /usr/share/doc");
    mkfs_d_matches(src, &img, "/usr/share/doc");
}
