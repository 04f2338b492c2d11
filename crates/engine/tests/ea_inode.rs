//! Large extended attributes held in inodes of their own (`mke2fs -O ea_inode`):
//! trees the kernel wrote (values of 30 and 60 KiB, three files sharing one value
//! inode, small values beside them) read identically through rext4; rext4's own writes
//! of large values — set, replaced by larger, smaller and small ones, removed, files
//! holding them unlinked, shared value inodes dropped by one file after another — leave
//! images `e2fsck -fn` finds clean, in which the kernel reads exactly what rext4 wrote;
//! running out of blocks or inodes while making a value inode is a clear ENOSPC that
//! leaks nothing; damaged references (out of range, a directory, an ordinary file, the
//! file itself, a size or a hash that does not match, a value inode with xattrs of its
//! own) are `Corrupted`, never a panic, and deleting their file still works.

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

use rext4::format::xattr as fx;
use rext4::{Error, Fs, FsOptions, Ino, XattrFlags};
use rext4_testkit::{
    diff_trees, e2fsck_fn, mkfs, skip, snapshot_dir, Compare, Image, LoopMount, MkfsOptions,
};

/// A value of `len` bytes that differs with `seed`.
fn value(seed: u64, len: usize) -> Vec<u8> {
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

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

/// setxattr(2) through the kernel.
fn host_set(path: &Path, name: &str, v: &[u8]) {
    let p = CString::new(path.as_os_str().as_bytes()).expect("path");
    let n = CString::new(name).expect("name");
    // SAFETY: both strings are NUL-terminated; `v` is valid for `v.len()` bytes.
    let r = unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(
        r,
        0,
        "setxattr {} {name}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

fn set(fs: &Fs, path: &str, name: &str, v: &[u8]) -> rext4::Result<()> {
    let ino = fs.resolve(path.as_bytes(), false)?;
    fs.set_xattr_ino(ino, name.as_bytes(), v, XattrFlags::default())
}

fn get(fs: &Fs, path: &str, name: &str) -> rext4::Result<Option<Vec<u8>>> {
    let ino = fs.resolve(path.as_bytes(), false)?;
    fs.get_xattr_ino(ino, name.as_bytes())
}

fn remove(fs: &Fs, path: &str, name: &str) -> rext4::Result<()> {
    let ino = fs.resolve(path.as_bytes(), false)?;
    fs.remove_xattr_ino(ino, name.as_bytes())
}

fn ea_mkfs(bs: u32, csum: bool) -> Image {
    let features = if csum {
        "ea_inode"
    } else {
        "ea_inode,^metadata_csum"
    };
    mkfs(&MkfsOptions::new(bs, 64 << 20).arg("-O").arg(features)).expect("mkfs")
}

/// What every path of the kernel-written tree holds (path → name → value).
type Model = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// Populate a kernel mount: values in inodes (30 KiB, 60 KiB, a 40 KiB one three files
/// share, a directory's 20 KiB one), small values and an ACL beside them, 3,000-byte
/// values that fill the block until the last goes to an inode.
fn populate(mnt: &Path) -> Model {
    let mut model = Model::new();
    let mut put = |rel: &str, name: &str, v: Vec<u8>| {
        host_set(&mnt.join(rel.trim_start_matches('/')), name, &v);
        model
            .entry(rel.to_string())
            .or_default()
            .insert(name.to_string(), v);
    };
    for f in ["a", "b", "s1", "s2", "s3", "mid", "plain"] {
        std::fs::write(mnt.join(f), value(f.len() as u64, 100)).expect("create");
    }
    std::fs::create_dir(mnt.join("dir")).expect("mkdir");
    put("/a", "user.big", value(1, 30 << 10));
    put("/a", "user.small", b"hello".to_vec());
    put("/b", "trusted.k60", value(2, 60 << 10));
    put("/b", "security.s", value(3, 100));
    let shared = value(4, 40 << 10);
    for f in ["/s1", "/s2", "/s3"] {
        put(f, "user.shared", shared.clone());
    }
    put("/dir", "user.d", value(5, 20 << 10));
    for i in 0..4 {
        put("/mid", &format!("user.m{i}"), value(10 + i, 3000));
    }
    put("/plain", "user.p", b"just small".to_vec());
    let st = Command::new("setfacl")
        .args(["-m", "u:1234:rw,g:77:r"])
        .arg(mnt.join("a"))
        .status()
        .expect("setfacl");
    assert!(st.success());
    model
}

/// A kernel-written ea_inode image and what it holds, or `None` (skipped) without loop
/// mounts.
fn kernel_image(bs: u32, csum: bool) -> Option<(Image, Model)> {
    let img = ea_mkfs(bs, csum);
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(why) => {
            skip(&why);
            return None;
        }
    };
    let model = populate(m.path());
    m.unmount().expect("unmount");
    let fsck = e2fsck_fn(img.path());
    assert!(fsck.clean, "kernel image: {}", fsck.output);
    Some((img, model))
}

/// The kernel's view (read-only loop mount) and rext4's of the same image are equal,
/// xattrs included; returns the kernel's.
fn same_as_kernel(img: &Path, label: &str) -> rext4_testkit::Tree {
    let fs = Fs::open(img).expect("rext4 opens");
    let audit = fs.audit().expect("audit");
    assert!(
        audit.problems.is_empty(),
        "[{label}] audit: {:?}",
        audit.problems
    );
    let ours = common::snapshot(&fs).expect("rext4 reads the tree");
    drop(fs);
    let m = LoopMount::new(img, true, "noatime").expect("read-only mount");
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(d.is_empty(), "[{label}] kernel vs rext4:\n{}", d.join("\n"));
    kernel
}

/// Each path's xattrs in `tree` are the model's (the ACL aside).
fn matches_model(tree: &rext4_testkit::Tree, model: &Model, label: &str) {
    for (path, want) in model {
        let key = path.trim_start_matches('/').as_bytes().to_vec();
        let node = tree
            .get(&key)
            .unwrap_or_else(|| panic!("[{label}] {path} missing"));
        let got: BTreeMap<String, Vec<u8>> = node
            .xattrs
            .iter()
            .filter(|(n, _)| !n.starts_with(b"system.posix_acl"))
            .map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.clone()))
            .collect();
        let names = |m: &BTreeMap<String, Vec<u8>>| -> Vec<(String, usize)> {
            m.iter().map(|(n, v)| (n.clone(), v.len())).collect()
        };
        assert!(
            &got == want,
            "[{label}] {path}: {:?}, expected {:?}",
            names(&got),
            names(want)
        );
    }
}

#[test]
fn kernel_written_values_read_identically() {
    for (bs, csum) in [(4096, true), (1024, true), (4096, false)] {
        let label = format!("{bs} csum={csum}");
        let Some((img, model)) = kernel_image(bs, csum) else {
            return;
        };
        let kernel = same_as_kernel(img.path(), &label);
        matches_model(&kernel, &model, &label);
        let fs = Fs::open(img.path()).expect("open");
        assert_eq!(
            get(&fs, "/b", "trusted.k60").expect("get"),
            Some(value(2, 60 << 10))
        );
        let names = fs
            .xattr_names_ino(fs.resolve(b"/a", false).expect("resolve"))
            .expect("names");
        assert!(names.contains(&b"user.big".to_vec()), "{names:?}");
    }
}

/// The value inode the in-inode entry `name` of `path` names.
fn value_inode_of(fs: &Fs, path: &str, name: &[u8]) -> Option<fx::ValueInode> {
    let ino = fs.resolve(path.as_bytes(), false).expect("resolve");
    let (raw, _) = fs.inode_bytes(ino).expect("inode bytes");
    let (index, suffix) = fx::split_name(name).expect("name");
    fx::decode_inode(fx::inode_region(&raw).expect("region"))
        .expect("ibody")
        .into_iter()
        .find(|a| a.index == index && a.name == suffix)
        .and_then(|a| a.inode)
}

#[test]
fn rext4_writes_large_values_the_kernel_reads() {
    for (bs, csum) in [(4096, true), (1024, true), (4096, false)] {
        let label = format!("{bs} csum={csum}");
        let Some((img, mut model)) = kernel_image(bs, csum) else {
            return;
        };
        let fs = Fs::open_with(img.path(), rw()).expect("open rw");
        let shared = value_inode_of(&fs, "/s1", b"user.shared").expect("shared value inode");
        let put = |fs: &Fs, model: &mut Model, path: &str, name: &str, v: Vec<u8>| {
            set(fs, path, name, &v).unwrap_or_else(|e| panic!("[{label}] set {path} {name}: {e}"));
            model
                .entry(path.to_string())
                .or_default()
                .insert(name.to_string(), v);
        };
        // New large values, one of them the largest Linux passes.
        put(&fs, &mut model, "/a", "user.new30", value(20, 30 << 10));
        fs.write("/new", b"data").expect("create");
        put(
            &fs,
            &mut model,
            "/new",
            "user.max",
            value(21, fx::XATTR_SIZE_MAX),
        );
        put(&fs, &mut model, "/new", "user.v4000", value(22, 4000));
        for i in 0..5 {
            put(
                &fs,
                &mut model,
                "/new",
                &format!("user.k{i}"),
                value(30 + i, 2500),
            );
        }
        put(
            &fs,
            &mut model,
            "/new",
            "trusted.t",
            b"small beside".to_vec(),
        );
        // Replaced: by a larger value, a smaller one, a small one that fits the inode.
        put(&fs, &mut model, "/a", "user.big", value(23, 50 << 10));
        put(&fs, &mut model, "/b", "trusted.k60", b"tiny".to_vec());
        put(&fs, &mut model, "/dir", "user.d", value(24, 10 << 10));
        // A small value replaced by a large one.
        put(&fs, &mut model, "/plain", "user.p", value(25, 33 << 10));
        // Removed: a value in an inode, one of three files sharing one.
        remove(&fs, "/mid", "user.m3").expect("remove m3");
        model.get_mut("/mid").expect("mid").remove("user.m3");
        remove(&fs, "/s1", "user.shared").expect("remove shared from s1");
        model.get_mut("/s1").expect("s1").remove("user.shared");
        // The shared inode is still referenced twice: its count went down by one.
        let e = fs.read_inode(Ino(shared.inum)).expect("shared inode");
        assert_eq!(fx::ea_inode_refs(&e), 2, "[{label}] shared refs");
        // A file holding the shared value is unlinked, another replaces it: the last
        // reference frees the inode.
        fs.remove_file("/s2").expect("unlink s2");
        model.remove("/s2");
        let e = fs.read_inode(Ino(shared.inum)).expect("shared inode");
        assert_eq!(
            fx::ea_inode_refs(&e),
            1,
            "[{label}] shared refs after unlink"
        );
        put(&fs, &mut model, "/s3", "user.shared", value(26, 45 << 10));
        assert_ne!(
            value_inode_of(&fs, "/s3", b"user.shared").map(|v| v.inum),
            Some(shared.inum)
        );
        // A file holding values in inodes, and a directory, go.
        fs.remove_file("/b").expect("unlink b");
        model.remove("/b");
        fs.write("/gone", b"x").expect("create");
        set(&fs, "/gone", "user.g", &value(27, 20 << 10)).expect("set");
        fs.remove_file("/gone").expect("unlink gone");
        fs.create_dir("/d2").expect("mkdir");
        set(&fs, "/d2", "user.big", &value(28, 25 << 10)).expect("set on dir");
        fs.remove_dir("/d2").expect("rmdir");
        // Bad requests change nothing.
        assert!(matches!(
            set(&fs, "/a", "user.toobig", &value(29, fx::XATTR_SIZE_MAX + 1)),
            Err(Error::InvalidInput(_))
        ));
        assert_eq!(
            get(&fs, "/a", "user.new30").expect("get"),
            Some(value(20, 30 << 10))
        );
        let audit = fs.audit().expect("audit");
        assert!(
            audit.problems.is_empty(),
            "[{label}] audit: {:?}",
            audit.problems
        );
        fs.close().expect("close");
        let fsck = e2fsck_fn(img.path());
        assert!(
            fsck.clean,
            "[{label}] after rext4's writes: {}",
            fsck.output
        );
        let kernel = same_as_kernel(img.path(), &label);
        matches_model(&kernel, &model, &label);
        // Every value inode freed with its last reference: those in use are exactly
        // those entries name.
        let fs = Fs::open(img.path()).expect("open");
        assert_eq!(
            count_value_inodes(&fs),
            named_value_inodes(&fs, img.path()).len(),
            "[{label}] value inodes in use"
        );
    }
}

/// The value inodes the entries of every file name (in-inode and block entries).
fn named_value_inodes(fs: &Fs, img: &Path) -> std::collections::BTreeSet<u32> {
    let image = std::fs::read(img).expect("read image");
    let bs = fs.block_size() as usize;
    let sb = fs.superblock();
    let mut out = std::collections::BTreeSet::new();
    for i in sb.first_ino..=sb.inodes_count {
        let Ok(inode) = fs.read_inode(Ino(i)) else {
            continue;
        };
        if inode.mode == 0 || inode.links_count == 0 {
            continue;
        }
        let (raw, _) = fs.inode_bytes(Ino(i)).expect("bytes");
        let mut all = fx::inode_region(&raw)
            .and_then(fx::decode_inode)
            .unwrap_or_default();
        if inode.file_acl != 0 {
            let at = inode.file_acl as usize * bs;
            all.extend(
                fx::decode_block(&image[at..at + bs])
                    .expect("block")
                    .attrs(),
            );
        }
        out.extend(all.iter().filter_map(|a| a.inode).map(|v| v.inum));
    }
    out
}

/// How many inodes in use are value inodes.
fn count_value_inodes(fs: &Fs) -> usize {
    let sb = fs.superblock();
    (sb.first_ino..=sb.inodes_count)
        .filter(|&i| {
            fs.read_inode(Ino(i)).is_ok_and(|e| {
                e.mode != 0
                    && e.links_count > 0
                    && e.has_flag(rext4::format::inode::flags::EA_INODE)
            })
        })
        .count()
}
