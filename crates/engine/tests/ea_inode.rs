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

use rext4::format::superblock::{Superblock, SB_OFFSET};
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

/// Write `/fill` in `chunk`-byte pieces until the filesystem says ENOSPC.
fn fill(fs: &Fs, chunk: usize) {
    let f = fs.create("/fill").expect("create fill");
    let mut off = 0u64;
    let buf = vec![0x5Au8; chunk];
    loop {
        match f.write_all_at(&buf, off) {
            Ok(()) => off += chunk as u64,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("fill: {e}"),
        }
        if chunk > 4096 && off.is_multiple_of(1 << 20) {
            f.sync_all().expect("fsync fill");
        }
    }
    f.sync_all().expect("fsync fill");
}

/// Out of blocks (none at all, or fewer than the value needs: the inode and the blocks
/// it got are given back) and out of inodes: setting a value that needs an inode of
/// its own is ENOSPC, counts are as before, nothing is leaked (e2fsck clean), and a
/// small value still goes in.
#[test]
fn no_space_or_no_inode_for_a_value_inode_leaks_nothing() {
    // Blocks.
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20).arg("-O").arg("ea_inode")).expect("mkfs");
    let fs = Fs::open_with(img.path(), rw()).expect("open rw");
    fs.write("/f", b"x").expect("create");
    fill(&fs, 1 << 20);
    fill_more(&fs);
    for leave in [0u64, 3] {
        if leave > 0 {
            let len = fs.metadata("/fill").expect("stat").len();
            fs.set_len("/fill", len - leave * 4096).expect("truncate");
        }
        fs.sync().expect("sync");
        let before = fs.statfs();
        let r = set(&fs, "/f", "user.big", &value(1, 30 << 10));
        assert!(matches!(r, Err(Error::NoSpace)), "leave {leave}: {r:?}");
        fs.sync().expect("sync");
        let after = fs.statfs();
        assert_eq!(
            (after.blocks_free, after.blocks_available, after.inodes_free),
            (
                before.blocks_free,
                before.blocks_available,
                before.inodes_free
            ),
            "leave {leave}: a refused value left something taken"
        );
        assert_eq!(get(&fs, "/f", "user.big").expect("get"), None);
    }
    set(&fs, "/f", "user.small", b"fits in the inode").expect("small value");
    // With the value's eight blocks free (and two more: the refusal above took them
    // and gave them back), it goes in.
    let len = fs.metadata("/fill").expect("stat").len();
    fs.set_len("/fill", len - 7 * 4096).expect("truncate");
    fs.sync().expect("sync");
    set(&fs, "/f", "user.big", &value(1, 30 << 10)).expect("set with room");
    fs.close().expect("close");
    let fsck = e2fsck_fn(img.path());
    assert!(fsck.clean, "after ENOSPC: {}", fsck.output);

    // Inodes.
    let img = mkfs(
        &MkfsOptions::new(4096, 16 << 20)
            .arg("-O")
            .arg("ea_inode")
            .arg("-N")
            .arg("32"),
    )
    .expect("mkfs");
    let fs = Fs::open_with(img.path(), rw()).expect("open rw");
    fs.write("/f", b"x").expect("create");
    let mut n = 0;
    loop {
        match fs.write(format!("/n{n}"), b"") {
            Ok(()) => n += 1,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("create: {e}"),
        }
    }
    assert_eq!(fs.statfs().inodes_free, 0);
    let before = fs.statfs();
    let r = set(&fs, "/f", "user.big", &value(2, 30 << 10));
    assert!(matches!(r, Err(Error::NoSpace)), "no inode left: {r:?}");
    fs.sync().expect("sync");
    let after = fs.statfs();
    assert_eq!(
        (after.blocks_free, after.inodes_free),
        (before.blocks_free, before.inodes_free)
    );
    set(&fs, "/f", "user.small", b"fits").expect("small value");
    // A name freed gives the value its inode.
    fs.remove_file("/n0").expect("unlink");
    fs.sync().expect("sync");
    set(&fs, "/f", "user.big", &value(2, 30 << 10)).expect("set with an inode free");
    fs.close().expect("close");
    let fsck = e2fsck_fn(img.path());
    assert!(fsck.clean, "after running out of inodes: {}", fsck.output);
}

/// After `fill` in large pieces: the last blocks in 4 KiB pieces.
fn fill_more(fs: &Fs) {
    let f = fs.open_file("/fill").expect("open fill");
    let mut off = f.len().expect("len");
    let buf = vec![0xA5u8; 4096];
    while f.write_all_at(&buf, off).is_ok() {
        off += 4096;
    }
    f.sync_all().expect("fsync fill");
}

/// Where inode `ino`'s record lives in the image file (debugfs imap).
fn record_offset(img: &Path, ino: u32, bs: u64) -> u64 {
    let out = rext4_testkit::debugfs_r(img, &format!("imap <{ino}>")).expect("imap");
    let blk: u64 = out
        .split("located at block ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|b| b.trim().parse().ok())
        .unwrap_or_else(|| panic!("imap: {out}"));
    let off = out
        .split("offset 0x")
        .nth(1)
        .and_then(|r| u64::from_str_radix(r.trim(), 16).ok())
        .unwrap_or_else(|| panic!("imap: {out}"));
    blk * bs + off
}

/// A kernel image to damage: /p holds a 30 KiB value in an inode (the first in-inode
/// entry), /other is an ordinary file.
struct Damaged {
    img: Image,
    bytes: Vec<u8>,
    seed: u32,
    isz: usize,
    bs: u64,
    p: u32,
    other: u32,
    ea: u32,
    /// Offset in the image of /p's first in-inode entry.
    entry: usize,
}

fn damaged_base() -> Option<Damaged> {
    let img = ea_mkfs(4096, true);
    {
        let m = match LoopMount::new(img.path(), false, "noatime") {
            Ok(m) => m,
            Err(why) => {
                skip(&why);
                return None;
            }
        };
        std::fs::write(m.path().join("p"), b"parent").expect("create");
        std::fs::write(m.path().join("other"), b"other").expect("create");
        host_set(&m.path().join("p"), "user.big", &value(7, 30 << 10));
        m.unmount().expect("unmount");
    }
    let fs = Fs::open(img.path()).expect("open");
    let p = fs.resolve(b"/p", false).expect("p").0;
    let other = fs.resolve(b"/other", false).expect("other").0;
    let ea = value_inode_of(&fs, "/p", b"user.big")
        .expect("value inode")
        .inum;
    let sb = fs.superblock();
    let seed = sb.csum_seed();
    let isz = usize::from(sb.inode_size);
    let bs = u64::from(fs.block_size());
    drop(fs);
    let bytes = std::fs::read(img.path()).expect("read image");
    let rec = record_offset(img.path(), p, bs) as usize;
    let entry = rec + fx::GOOD_OLD_INODE_SIZE + 32 + fx::IBODY_HEADER_SIZE;
    assert_eq!(&bytes[entry + 16..entry + 19], b"big", "first entry of /p");
    Some(Damaged {
        img,
        bytes,
        seed,
        isz,
        bs,
        p,
        other,
        ea,
        entry,
    })
}

impl Damaged {
    /// A copy of the image with `f` applied to inode `ino`'s record (checksum redone).
    fn with_record(&self, ino: u32, f: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let mut b = self.bytes.clone();
        let at = record_offset(self.img.path(), ino, self.bs) as usize;
        let rec = &mut b[at..at + self.isz];
        f(rec);
        rext4::format::inode::set_csum(rec, ino, self.seed);
        b
    }

    /// /p's record with its first entry's field at `field` set to `v`.
    fn with_entry_field(&self, field: usize, v: u32) -> Vec<u8> {
        let in_rec = self.entry - record_offset(self.img.path(), self.p, self.bs) as usize;
        self.with_record(self.p, |rec| {
            rec[in_rec + field..in_rec + field + 4].copy_from_slice(&v.to_le_bytes())
        })
    }
}

/// Damaged references to value inodes are `Corrupted` (naming what is wrong) for
/// getxattr, listing and the audit, never a panic; the file can still be deleted.
#[test]
fn damaged_value_references_are_corruption() {
    let Some(d) = damaged_base() else {
        return;
    };
    const INUM: usize = 4;
    const SIZE: usize = 8;
    const HASH: usize = 12;
    let fs = Fs::open(d.img.path()).expect("open");
    let inodes_count = fs.superblock().inodes_count;
    let e_hash = u32::from_le_bytes(
        d.bytes[d.entry + HASH..d.entry + HASH + 4]
            .try_into()
            .expect("4"),
    );
    drop(fs);
    let ea_data_block = {
        let fs = Fs::open(d.img.path()).expect("open");
        let ino = Ino(d.ea);
        let (_, m) = fs.fiemap_ino(ino, 1).expect("map");
        match m.first() {
            Some((_, rext4::Mapping::Mapped { physical, .. })) => *physical,
            other => panic!("value inode map: {other:?}"),
        }
    };
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("inode 0", d.with_entry_field(INUM, 0), ""),
        ("inode 1", d.with_entry_field(INUM, 1), "out of range"),
        (
            "past the last inode",
            d.with_entry_field(INUM, inodes_count + 1),
            "out of range",
        ),
        (
            "a directory",
            d.with_entry_field(INUM, 11),
            "not a regular file",
        ),
        (
            "an ordinary file",
            d.with_entry_field(INUM, d.other),
            "no EA_INODE flag",
        ),
        (
            "the file itself",
            d.with_entry_field(INUM, d.p),
            "the file itself",
        ),
        (
            "the wrong size",
            d.with_entry_field(SIZE, 30000),
            "the entry says 30000",
        ),
        (
            "the wrong hash",
            d.with_entry_field(HASH, e_hash ^ 0x10),
            "hash",
        ),
        (
            "an inode not in use",
            d.with_record(d.ea, |r| r[0x1A..0x1C].copy_from_slice(&0u16.to_le_bytes())),
            "not in use",
        ),
        (
            "a value inode naming its file back",
            // In-inode xattrs of its own: one entry whose value is /p (a loop).
            d.with_record(d.ea, |r| {
                let mut area = vec![0u8; r.len() - fx::GOOD_OLD_INODE_SIZE - 32];
                let back = fx::Xattr::in_inode(
                    fx::INDEX_USER,
                    b"loop",
                    fx::ValueInode {
                        inum: d.p,
                        size: 6,
                        hash: 0,
                    },
                );
                fx::encode_inode_region(&mut area, &[back]).expect("fits");
                r[fx::GOOD_OLD_INODE_SIZE + 32..].copy_from_slice(&area);
            }),
            "of its own",
        ),
    ];
    let mut flipped = d.bytes.clone();
    flipped[(ea_data_block * d.bs) as usize + 100] ^= 0x40;
    cases.push(("a changed value", flipped, "does not match its value hash"));
    let mut no_feature = d.bytes.clone();
    {
        let o = SB_OFFSET as usize;
        let sb = &mut no_feature[o..o + 1024];
        let inc = u32::from_le_bytes(sb[0x60..0x64].try_into().expect("4")) & !0x400;
        sb[0x60..0x64].copy_from_slice(&inc.to_le_bytes());
        let c = Superblock::compute_csum(sb);
        sb[0x3FC..0x400].copy_from_slice(&c.to_le_bytes());
    }
    cases.push((
        "no ea_inode feature",
        no_feature,
        "without the ea_inode feature",
    ));
    let dir = rext4_testkit::TempDir::new("ea-damaged").expect("tmp");
    for (what, bytes, needle) in cases {
        let path = dir.join("img");
        std::fs::write(&path, &bytes).expect("write image");
        let fs = Fs::open(&path).expect("opens read-only");
        let p = Ino(d.p);
        for r in [
            fs.get_xattr_ino(p, b"user.big").map(drop),
            fs.xattrs_ino(p).map(drop),
        ] {
            match r {
                Err(Error::Corrupted { what: w, .. }) => {
                    assert!(w.contains(needle), "{what}: {w:?} does not say {needle:?}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        assert!(
            !fs.audit().expect("audit").problems.is_empty(),
            "{what}: the audit found nothing"
        );
        drop(fs);
        // The file holding the broken reference can still be deleted.
        let fs = Fs::open_with(&path, rw()).expect("opens read-write");
        fs.remove_file("/p")
            .unwrap_or_else(|e| panic!("{what}: unlink: {e}"));
        fs.close().expect("close");
    }
}

/// A file unlinked while open holds values in inodes of their own; the image is
/// copied after a sync (a crash with the orphan on the list). rext4's open and the
/// kernel's mount free the orphan and its value inodes (e2fsck -fn clean, no value
/// inode left); e2fsck -fy leaves a clean image too. The open file's last close frees
/// them as well.
#[test]
fn an_orphan_holding_values_is_freed_on_recovery() {
    for upstream in [false, true] {
        let img = mkfs(
            &MkfsOptions::new(4096, 64 << 20)
                .upstream(upstream)
                .arg("-O")
                .arg("ea_inode"),
        )
        .expect("mkfs");
        let fs = Fs::open_with(img.path(), rw()).expect("open rw");
        fs.write("/keep", b"kept").expect("create");
        set(&fs, "/keep", "user.keep", &value(40, 20 << 10)).expect("set");
        fs.write("/f", b"orphan to be").expect("create");
        set(&fs, "/f", "user.big", &value(41, 30 << 10)).expect("set");
        set(&fs, "/f", "trusted.max", &value(42, 60 << 10)).expect("set");
        let open = fs.open_file("/f").expect("open");
        fs.remove_file("/f").expect("unlink while open");
        fs.sync().expect("sync");
        let crashed = std::fs::read(img.path()).expect("copy the image");
        assert_eq!(
            count_value_inodes(&fs),
            3,
            "values live while the file is open"
        );
        drop(open);
        assert_eq!(
            count_value_inodes(&fs),
            1,
            "the last close frees the orphan's values"
        );
        fs.close().expect("close");
        let fsck = e2fsck_fn(img.path());
        assert!(fsck.clean, "after the last close: {}", fsck.output);
        for how in ["rext4", "kernel", "e2fsck"] {
            std::fs::write(img.path(), &crashed).expect("restore the crash copy");
            match how {
                "rext4" => Fs::open_with(img.path(), rw())
                    .expect("open")
                    .close()
                    .expect("close"),
                "kernel" => match LoopMount::new(img.path(), false, "") {
                    Ok(m) => m.unmount().expect("unmount"),
                    Err(why) => {
                        skip(&why);
                        continue;
                    }
                },
                _ => {
                    rext4_testkit::e2fsck_fy(img.path());
                }
            }
            let fsck = e2fsck_fn(img.path());
            assert!(
                fsck.clean,
                "[{how}, upstream {upstream}] after recovery: {}",
                fsck.output
            );
            let fs = Fs::open(img.path()).expect("open");
            // e2fsprogs (1.47.0, and 1.47.4 still) releases an orphan's blocks and xattr
            // block but not its references to value inodes: pass 4 then finds them
            // unattached and connects them to lost+found. The kernel and rext4 free
            // them with the orphan.
            let left = count_value_inodes(&fs);
            if how == "e2fsck" {
                assert!(left >= 1, "[{how}] value inodes left: {left}");
            } else {
                assert_eq!(left, 1, "[{how}] value inodes left");
            }
            assert_eq!(
                get(&fs, "/keep", "user.keep").expect("get"),
                Some(value(40, 20 << 10))
            );
        }
    }
}

/// Files sharing one value inode (the kernel shared it between equal values) drop
/// their references from four threads at once, while other threads replace large
/// values of another file and read them: the shared inode's count goes down by one
/// per file and it is freed once, with the last; a reader sees the old value or the
/// new one, never corruption (a value inode freed under it is read again under the
/// write lock); e2fsck is clean and the kernel reads the result.
#[test]
fn concurrent_changes_of_shared_value_inodes() {
    let img = ea_mkfs(4096, true);
    let shared = value(50, 40 << 10);
    {
        let m = match LoopMount::new(img.path(), false, "noatime") {
            Ok(m) => m,
            Err(why) => return skip(&why),
        };
        for i in 0..8 {
            let p = m.path().join(format!("s{i}"));
            std::fs::write(&p, b"x").expect("create");
            host_set(&p, "user.shared", &shared);
        }
        std::fs::write(m.path().join("hot"), b"hot").expect("create");
        m.unmount().expect("unmount");
    }
    let fs = Fs::open_with(img.path(), rw()).expect("open rw");
    let v = value_inode_of(&fs, "/s0", b"user.shared").expect("shared");
    for i in 1..8 {
        assert_eq!(
            value_inode_of(&fs, &format!("/s{i}"), b"user.shared").map(|x| x.inum),
            Some(v.inum),
            "the kernel shares one inode"
        );
    }
    assert_eq!(
        fx::ea_inode_refs(&fs.read_inode(Ino(v.inum)).expect("inode")),
        8
    );
    let versions: Vec<Vec<u8>> = (0..6)
        .map(|k| value(60 + k, (20 + 7 * k as usize) << 10))
        .collect();
    set(&fs, "/hot", "user.hot", &versions[0]).expect("set");
    std::thread::scope(|sc| {
        for t in 0..4 {
            let fs = fs.clone();
            sc.spawn(move || {
                for i in [t, t + 4] {
                    remove(&fs, &format!("/s{i}"), "user.shared").expect("remove shared");
                }
            });
        }
        let w = fs.clone();
        let vs = versions.clone();
        sc.spawn(move || {
            for v in &vs[1..] {
                set(&w, "/hot", "user.hot", v).expect("replace hot");
            }
        });
        for _ in 0..2 {
            let fs = fs.clone();
            let vs = versions.clone();
            sc.spawn(move || {
                for _ in 0..200 {
                    let got = get(&fs, "/hot", "user.hot").expect("read hot");
                    assert!(
                        got.as_ref().is_some_and(|g| vs.contains(g)),
                        "a value never written: {:?} bytes",
                        got.map(|g| g.len())
                    );
                }
            });
        }
    });
    // Freed with its last reference (its number may hold /hot's value by now).
    let hot = value_inode_of(&fs, "/hot", b"user.hot").expect("hot's value inode");
    let e = fs.read_inode(Ino(v.inum)).expect("inode");
    assert!(
        v.inum == hot.inum
            || e.mode == 0
            || e.links_count == 0
            || !e.has_flag(rext4::format::inode::flags::EA_INODE),
        "the shared value inode is freed with its last reference"
    );
    assert_eq!(count_value_inodes(&fs), 1, "only /hot's value is left");
    assert_eq!(
        get(&fs, "/hot", "user.hot").expect("get"),
        versions.last().cloned()
    );
    fs.close().expect("close");
    let fsck = e2fsck_fn(img.path());
    assert!(fsck.clean, "after concurrent changes: {}", fsck.output);
    let kernel = same_as_kernel(img.path(), "concurrent");
    assert_eq!(
        kernel[&b"hot".to_vec()].xattrs.get(b"user.hot".as_slice()),
        versions.last()
    );
}
