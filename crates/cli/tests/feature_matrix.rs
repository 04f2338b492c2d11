//! The feature matrix: one row per image layout rext4 must read and write with the
//! same trust as the default one (issue 37). Each row's image is made by mke2fs; then:
//!
//! 1. the kernel writes a tree into it (files of many sizes, up to the DIND range of a
//!    block map; a sparse file with data in the TIND range, past 4 GiB on 1 KiB
//!    blocks; holes; fast, slow and dangling symlinks; hard links; a 1,500-entry
//!    directory; xattrs in the inode and in blocks, one block shared; modes, owners,
//!    times);
//! 2. rext4 reads it identically: the tree through a read-only `rext4 mount` equals
//!    the kernel's (names, types, modes, owners, sizes, times, contents, xattrs, link
//!    groups), the far sparse file compared piece by piece;
//! 3. rext4 writes through the API, the CLI and the mount: create, write, append,
//!    truncate, punch, rename, links, xattrs, and mkdir/rmdir of a 10,000-entry
//!    directory (a 3,000-entry one is kept);
//! 4. `e2fsck -fn` is text-clean, and the kernel sees what rext4 wrote: its tree equals
//!    rext4's, and the bytes rext4 wrote (model-checked per file) read back through it.
//!
//! Rows are the table [`ROWS`]: a later layout is one more entry (its mke2fs
//! arguments, block size and image size). `REXT4_MATRIX_ROWS=ext2,ext3` runs only the
//! rows named. Every row runs (a failing one does not hide the others) and the test
//! fails listing the rows that failed. As root with FUSE and loop devices (CI);
//! elsewhere it is skipped, which fails under REXT4_REQUIRE_ALL.

mod common;
mod fuse_mount;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use rext4::{FallocMode, Fs, FsOptions, OpenOptions};
use rext4_testkit::{
    can_loop_mount, diff_trees, e2fsck_fn, mkfs, skip, snapshot_dir, snapshot_node, Compare,
    LoopMount, MkfsOptions, TempDir, Tree,
};

use common::{rext4, spec};
use fuse_mount::{cannot_mount, Mounted};

/// One layout of the matrix.
struct Row {
    name: &'static str,
    /// mke2fs arguments besides `-b`.
    mkfs: &'static [&'static str],
    block_size: u32,
    /// Image size in MiB.
    size_mib: u64,
}

/// The layouts. Append a row for each new layout rext4 takes on.
const ROWS: &[Row] = &[
    Row {
        name: "ext2",
        mkfs: &["-t", "ext2"],
        block_size: 1024,
        size_mib: 96,
    },
    Row {
        name: "ext3",
        mkfs: &["-t", "ext3"],
        block_size: 4096,
        size_mib: 128,
    },
    Row {
        name: "ext3 1k 128-byte inodes",
        mkfs: &["-t", "ext3", "-I", "128"],
        block_size: 1024,
        size_mib: 96,
    },
    Row {
        name: "meta_bg",
        mkfs: &["-O", "meta_bg,^resize_inode"],
        block_size: 4096,
        size_mib: 128,
    },
    Row {
        name: "1k blocks",
        mkfs: &[],
        block_size: 1024,
        size_mib: 96,
    },
    Row {
        name: "fast_commit",
        mkfs: &["-O", "fast_commit"],
        block_size: 4096,
        size_mib: 128,
    },
    // Every small file takes a whole cluster (3,000 kept ones: 47 MiB at 16 KiB,
    // 188 MiB at 64 KiB): larger images (sparse files). mke2fs gives a bigalloc image
    // an inode per cluster at most: 8,192 for 512 MiB of 64 KiB ones, fewer than the
    // 10,000-entry directory needs, so that row asks for more.
    Row {
        name: "bigalloc 16k",
        mkfs: &["-O", "bigalloc", "-C", "16384"],
        block_size: 4096,
        size_mib: 256,
    },
    Row {
        name: "bigalloc 64k",
        mkfs: &["-O", "bigalloc", "-C", "65536", "-N", "20000"],
        block_size: 4096,
        size_mib: 512,
    },
    Row {
        name: "inline_data",
        mkfs: &["-O", "inline_data"],
        block_size: 4096,
        size_mib: 128,
    },
];

/// Bytes that say where they are from.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed as u8)
        .collect()
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in a path")
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).expect("name");
    // SAFETY: both strings are NUL-terminated and live for the call; the value
    // pointer and length describe `value`.
    let rc = unsafe {
        libc::lsetxattr(
            cpath(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        rc,
        0,
        "setxattr {name} on {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

fn punch(f: &std::fs::File, off: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for writing for the duration of the call.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    assert_eq!(rc, 0, "punch: {}", std::io::Error::last_os_error());
}

/// Where the far piece of `sparse` goes: in the TIND range of a block map (past
/// 4 GiB on 1 KiB blocks, past the DIND range on 4 KiB ones).
fn far_offset(bs: u64) -> u64 {
    let apb = bs / 4;
    let tind = 12 + apb + apb * apb;
    ((5u64 << 30) / bs).max(tind + 3 * apb + 1) * bs + 123
}

/// The pieces of `sparse`: (offset, bytes).
fn sparse_pieces(bs: u64) -> Vec<(u64, Vec<u8>)> {
    let apb = bs / 4;
    vec![
        (5, pattern(1, 100)),
        ((12 + 3) * bs, pattern(2, bs as usize)),
        (
            (12 + apb + 2 * apb + 1) * bs + 7,
            pattern(3, 3 * bs as usize),
        ),
        (far_offset(bs), pattern(4, 2 * bs as usize + 9)),
    ]
}

/// What the kernel writes (step 1). Returns the model of the files it wrote whole.
fn kernel_populate(root: &Path, bs: u64) -> BTreeMap<String, Vec<u8>> {
    let apb = bs / 4;
    let mut model = BTreeMap::new();
    std::fs::create_dir(root.join("sizes")).expect("mkdir");
    let sizes = [
        0,
        1,
        bs as usize - 1,
        bs as usize,
        12 * bs as usize + 1,
        ((12 + apb) * bs) as usize + 5,
        ((12 + apb + 2 * apb) * bs) as usize + 77,
        (3 << 20) + 7,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let p = format!("sizes/f{i}");
        let d = pattern(10 + i as u32, n);
        std::fs::write(root.join(&p), &d).expect("write");
        model.insert(p, d);
    }
    let f = std::fs::File::create(root.join("sparse")).expect("create");
    for (off, d) in sparse_pieces(bs) {
        f.write_all_at(&d, off).expect("sparse write");
    }
    drop(f);
    // Holes in the direct and IND ranges of a small file.
    let f = std::fs::File::create(root.join("holes")).expect("create");
    let mut h = vec![0u8; (20 * bs) as usize];
    for k in [1u64, 5, 13, 19] {
        let d = pattern(30 + k as u32, bs as usize);
        f.write_all_at(&d, k * bs).expect("write");
        h[(k * bs) as usize..((k + 1) * bs) as usize].copy_from_slice(&d);
    }
    drop(f);
    model.insert("holes".into(), h);
    std::fs::create_dir(root.join("links")).expect("mkdir");
    std::os::unix::fs::symlink("../sizes/f1", root.join("links/fast")).expect("symlink");
    std::os::unix::fs::symlink("t/".repeat(100), root.join("links/slow")).expect("symlink");
    std::os::unix::fs::symlink("nowhere/at/all", root.join("links/dangling")).expect("symlink");
    std::fs::write(root.join("links/a"), b"linked").expect("write");
    std::fs::hard_link(root.join("links/a"), root.join("links/b")).expect("link");
    std::fs::hard_link(root.join("links/a"), root.join("sizes/a3")).expect("link");
    std::fs::create_dir(root.join("big")).expect("mkdir");
    for i in 0..1500 {
        let name = format!("entry-{i:04}-{}", "n".repeat(i % 40));
        std::fs::write(root.join("big").join(name), format!("{i}")).expect("create");
    }
    std::fs::create_dir(root.join("x")).expect("mkdir");
    for n in ["small", "big", "s1", "s2"] {
        std::fs::write(root.join("x").join(n), n).expect("write");
    }
    set_xattr(&root.join("x/small"), "user.small", b"hello");
    set_xattr(
        &root.join("x/big"),
        "user.big",
        &pattern(40, bs as usize / 2),
    );
    for n in ["s1", "s2"] {
        set_xattr(&root.join("x").join(n), "user.shared", &pattern(41, 300));
    }
    set_xattr(&root.join("x"), "user.dir", b"on a directory");
    std::fs::write(root.join("modes"), b"m").expect("write");
    std::fs::set_permissions(
        root.join("modes"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4751),
    )
    .expect("chmod");
    // SAFETY: a NUL-terminated path that lives for the call.
    let rc = unsafe { libc::lchown(cpath(&root.join("sizes/f2")).as_ptr(), 1000, 2000) };
    assert_eq!(rc, 0, "chown");
    let t = libc::timespec {
        tv_sec: 1_234_567_890,
        tv_nsec: 987_654_321,
    };
    // SAFETY: a NUL-terminated path and two timespecs that live for the call.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            cpath(&root.join("sizes/f4")).as_ptr(),
            [t, t].as_ptr(),
            0,
        )
    };
    assert_eq!(rc, 0, "utimensat");
    model
}

/// `sparse` is compared piece by piece (its hash would read gigabytes of holes).
const SPARSE: &[u8] = b"sparse";

fn compare() -> Compare {
    Compare {
        ignore_atime: true,
        ignore_ino: true,
        hardlinks_by_paths: true,
        ignore_paths: vec![SPARSE.to_vec()],
        ..Compare::default()
    }
}

/// The tree under `root` but `sparse` (whose content hash would read its gigabytes of
/// holes; `check_sparse` reads its pieces).
fn snapshot(root: &Path, who: &str) -> Tree {
    let fail = |e: std::io::Error| -> Tree { panic!("snapshot through {who}: {e}") };
    let mut tree = Tree::new();
    let top = snapshot_node(root).unwrap_or_else(|e| panic!("snapshot through {who}: {e}"));
    tree.insert(Vec::new(), top);
    for ent in std::fs::read_dir(root).unwrap_or_else(|e| panic!("{who}: ls: {e}")) {
        let ent = ent.unwrap_or_else(|e| panic!("{who}: ls: {e}"));
        let name = ent.file_name().as_bytes().to_vec();
        if name == SPARSE {
            continue;
        }
        let sub = snapshot_dir(&ent.path()).unwrap_or_else(fail);
        for (k, v) in sub {
            let mut key = name.clone();
            if !k.is_empty() {
                key.push(b'/');
                key.extend_from_slice(&k);
            }
            tree.insert(key, v);
        }
    }
    tree
}

/// The pieces of `sparse` and the zeros around them, read under `root`.
fn check_sparse(root: &Path, bs: u64, who: &str) {
    let f = std::fs::File::open(root.join("sparse")).expect("open sparse");
    let pieces = sparse_pieces(bs);
    let (last_off, last) = pieces.last().expect("pieces");
    let size = f.metadata().expect("stat").len();
    assert_eq!(size, last_off + last.len() as u64, "{who}: sparse size");
    for (off, d) in &pieces {
        let mut got = vec![0u8; d.len() + 64];
        let n = f.read_at(&mut got, off.saturating_sub(32)).expect("read");
        let lead = (*off).min(32) as usize;
        assert!(
            got[lead..lead + d.len()] == d[..],
            "{who}: sparse piece at {off}"
        );
        assert!(
            got[..lead].iter().all(|&b| b == 0) || *off < 32,
            "{who}: before {off}"
        );
        let tail = &got[lead + d.len()..n.max(lead + d.len())];
        assert!(tail.iter().all(|&b| b == 0), "{who}: after {off}");
    }
}

fn check_model(root: &Path, model: &BTreeMap<String, Vec<u8>>, who: &str) {
    for (p, want) in model {
        let got = std::fs::read(root.join(p)).unwrap_or_else(|e| panic!("{who}: read {p}: {e}"));
        assert!(
            got.len() == want.len(),
            "{who}: {p} has {} bytes, want {}",
            got.len(),
            want.len()
        );
        if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
            panic!("{who}: {p} differs at byte {i}");
        }
    }
}

/// Step 3 through the engine's API.
fn api_writes(img: &Path, bs: u64, model: &mut BTreeMap<String, Vec<u8>>) {
    let fs = Fs::open_with(
        img,
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("rext4 opens the image read-write");
    assert!(fs.warnings().is_empty(), "{:?}", fs.warnings());
    fs.create_dir("/api").expect("mkdir");
    let d = pattern(50, (12 + bs as usize / 4) * bs as usize + 99);
    fs.write("/api/new", &d).expect("write");
    model.insert("api/new".into(), d);
    // Append to a file whose map is in the IND range.
    let more = pattern(51, 3 * bs as usize + 5);
    let f = OpenOptions::new()
        .append(true)
        .open(&fs, "/sizes/f5")
        .expect("open append");
    f.write_all_at(&more, 0).expect("append");
    drop(f);
    model
        .get_mut("sizes/f5")
        .expect("modelled")
        .extend_from_slice(&more);
    // Truncate the DIND-range file into its IND range; punch across direct and IND.
    let keep = (12 + 10) * bs as usize + 3;
    let f = OpenOptions::new()
        .write(true)
        .open(&fs, "/sizes/f6")
        .expect("open");
    f.set_len(keep as u64).expect("truncate");
    model.get_mut("sizes/f6").expect("modelled").truncate(keep);
    drop(f);
    let f7 = fs.open_file("/sizes/f7").expect("open");
    let (off, len) = (7 * bs + 100, 40 * bs);
    fs.fallocate_ino(f7.ino(), FallocMode::PunchHole, off, len)
        .expect("punch");
    model.get_mut("sizes/f7").expect("modelled")[off as usize..(off + len) as usize].fill(0);
    drop(f7);
    fs.rename("/sizes/f1", "/api/moved").expect("rename");
    let d = model.remove("sizes/f1").expect("modelled");
    model.insert("api/moved".into(), d);
    fs.hard_link("/links/a", "/api/a4").expect("link");
    let i = fs.resolve(b"/api/new", false).expect("resolve");
    fs.set_xattr_ino(
        i,
        b"user.api",
        b"set by the api",
        rext4::XattrFlags::default(),
    )
    .expect("setxattr");
    let x = fs.resolve(b"/x/small", false).expect("resolve");
    fs.remove_xattr_ino(x, b"user.small").expect("removexattr");
    // A 10,000-entry directory made and removed; a 3,000-entry one kept.
    fs.create_dir("/api/many").expect("mkdir");
    for i in 0..10_000 {
        fs.write(format!("/api/many/file-with-a-long-name-{i:05}"), b"")
            .expect("create");
    }
    for i in 0..10_000 {
        fs.remove_file(format!("/api/many/file-with-a-long-name-{i:05}"))
            .expect("unlink");
    }
    fs.remove_dir("/api/many").expect("rmdir");
    fs.create_dir("/api/kept").expect("mkdir");
    for i in 0..3_000 {
        fs.write(format!("/api/kept/k{i:05}"), format!("{i}"))
            .expect("create");
    }
    fs.close().expect("close");
}

/// Step 3 through the command line.
fn cli_writes(img: &Path, host: &Path, model: &mut BTreeMap<String, Vec<u8>>) {
    let run = |args: &[&std::ffi::OsStr]| {
        let r = rext4(args);
        assert_eq!(r.code, 0, "rext4 {args:?}: {}", r.stderr);
    };
    let d = pattern(60, 300_000);
    let src = host.join("src");
    std::fs::write(&src, &d).expect("host file");
    let s = |x: &str| spec(img, x);
    run(&["mkdir".as_ref(), s("/cli").as_os_str()]);
    run(&["cp".as_ref(), src.as_os_str(), s("/cli/f").as_os_str()]);
    run(&[
        "mv".as_ref(),
        s("/cli/f").as_os_str(),
        s("/cli/g").as_os_str(),
    ]);
    run(&[
        "ln".as_ref(),
        s("/cli/g").as_os_str(),
        s("/cli/h").as_os_str(),
    ]);
    run(&[
        "truncate".as_ref(),
        "-s".as_ref(),
        "100000".as_ref(),
        s("/cli/g").as_os_str(),
    ]);
    run(&["rm".as_ref(), s("/big/entry-0007-nnnnnnn").as_os_str()]);
    run(&["chmod".as_ref(), "640".as_ref(), s("/cli/g").as_os_str()]);
    model.insert("cli/g".into(), d[..100_000].to_vec());
    model.insert("cli/h".into(), d[..100_000].to_vec());
}

/// Step 3 through the mount.
fn mount_writes(img: &Path, bs: u64, model: &mut BTreeMap<String, Vec<u8>>) {
    let mut m = Mounted::new(img, &[]);
    let root = m.path().to_path_buf();
    std::fs::create_dir(root.join("mnt")).expect("mkdir");
    let d = pattern(70, 2 << 20);
    std::fs::write(root.join("mnt/w"), &d).expect("write");
    let mut w = d;
    let more = pattern(71, 70_001);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(root.join("mnt/w"))
        .expect("open append");
    std::io::Write::write_all(&mut f, &more).expect("append");
    drop(f);
    w.extend_from_slice(&more);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("mnt/w"))
        .expect("open");
    punch(&f, 3 * bs + 17, 300 * bs);
    w[(3 * bs + 17) as usize..(303 * bs + 17) as usize].fill(0);
    f.set_len(1_500_000).expect("truncate");
    w.truncate(1_500_000);
    f.sync_all().expect("fsync");
    drop(f);
    // O_DIRECT into a new file.
    let dio = pattern(72, 64 << 10);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_DIRECT)
        .open(root.join("mnt/direct"))
        .expect("open O_DIRECT");
    f.write_all_at(&dio, 8192).expect("direct write");
    drop(f);
    let mut dm = vec![0u8; 8192];
    dm.extend_from_slice(&dio);
    std::fs::rename(root.join("mnt/w"), root.join("mnt/w2")).expect("rename");
    std::fs::hard_link(root.join("mnt/w2"), root.join("mnt/w3")).expect("link");
    set_xattr(&root.join("mnt/w2"), "user.mount", b"set through the mount");
    std::fs::create_dir(root.join("mnt/dir")).expect("mkdir");
    for i in 0..1000 {
        std::fs::write(root.join(format!("mnt/dir/e{i:04}")), b"e").expect("create");
    }
    for i in (0..1000).step_by(2) {
        std::fs::remove_file(root.join(format!("mnt/dir/e{i:04}"))).expect("unlink");
    }
    std::fs::remove_dir_all(root.join("big")).expect("rm -r a kernel-made directory");
    let st = m.unmount();
    assert!(st.success(), "rext4 mount exit: {st}: {}", m.stderr());
    model.insert("mnt/w2".into(), w.clone());
    model.insert("mnt/w3".into(), w);
    model.insert("mnt/direct".into(), dm);
}

fn run_row(row: &Row) {
    let name = row.name;
    let t0 = std::time::Instant::now();
    let step = |what: &str| eprintln!("[{name}] {what} at {:.1?}", t0.elapsed());
    let mut opts = MkfsOptions::new(row.block_size, row.size_mib << 20);
    for a in row.mkfs {
        opts = opts.arg(a);
    }
    let img = mkfs(&opts).expect("mkfs");
    let bs = u64::from(row.block_size);
    // 1. The kernel writes.
    let mut model = {
        let m = LoopMount::new(img.path(), false, "").expect("kernel mount");
        let model = kernel_populate(m.path(), bs);
        m.unmount().expect("kernel unmount");
        model
    };
    step("kernel wrote");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "[{name}] after the kernel: {}", r.output);
    // 2. rext4 reads what the kernel wrote.
    let kernel = {
        let m = LoopMount::new(img.path(), true, "").expect("kernel mount");
        check_sparse(m.path(), bs, "kernel");
        snapshot(m.path(), "the kernel")
    };
    step("kernel snapshot");
    {
        let mut m = Mounted::new(img.path(), &["ro"]);
        let ours = snapshot(m.path(), "rext4");
        step("rext4 snapshot");
        check_sparse(m.path(), bs, "rext4");
        check_model(m.path(), &model, "rext4");
        let d = diff_trees(&kernel, &ours, &compare());
        assert!(
            d.is_empty(),
            "[{name}] rext4 reads the kernel's tree differently:\n{}",
            d.join("\n")
        );
        m.unmount();
    }
    // 3. rext4 writes.
    step("compared");
    api_writes(img.path(), bs, &mut model);
    step("api");
    let host = TempDir::new("matrix-host").expect("tmp");
    cli_writes(img.path(), host.path(), &mut model);
    step("cli");
    mount_writes(img.path(), bs, &mut model);
    step("mount");
    // 4. e2fsck, then the kernel sees what rext4 wrote.
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "[{name}] after rext4's writes: {}", r.output);
    let ours = {
        let mut m = Mounted::new(img.path(), &["ro"]);
        let t = snapshot(m.path(), "rext4");
        m.unmount();
        t
    };
    step("rext4 snapshot");
    let m = LoopMount::new(img.path(), true, "").expect("kernel mount");
    check_model(m.path(), &model, "kernel");
    check_sparse(m.path(), bs, "kernel");
    let kernel = snapshot(m.path(), "the kernel");
    let d = diff_trees(&kernel, &ours, &compare());
    assert!(
        d.is_empty(),
        "[{name}] the kernel sees rext4's writes differently:\n{}",
        d.join("\n")
    );
    assert_eq!(
        std::fs::read_dir(m.path().join("api/kept"))
            .expect("ls")
            .count(),
        3000,
        "[{name}]"
    );
    assert!(!m.path().join("api/many").exists(), "[{name}]");
    assert!(!m.path().join("big").exists(), "[{name}]");
    let xa = rext4_testkit::read_xattrs(&m.path().join("mnt/w2")).expect("xattrs");
    assert_eq!(
        xa.get(&b"user.mount"[..]).map(Vec::as_slice),
        Some(&b"set through the mount"[..]),
        "[{name}]"
    );
}

#[test]
fn feature_matrix() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    if let Err(why) = can_loop_mount() {
        return skip(&why);
    }
    let only: Option<Vec<String>> = std::env::var("REXT4_MATRIX_ROWS")
        .ok()
        .map(|v| v.split(',').map(str::to_string).collect());
    let mut failed = Vec::new();
    for row in ROWS {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|n| n == row.name))
        {
            continue;
        }
        let t0 = std::time::Instant::now();
        match std::panic::catch_unwind(|| run_row(row)) {
            Ok(()) => eprintln!(
                "feature matrix: {} passed in {:.1?}",
                row.name,
                t0.elapsed()
            ),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                eprintln!("feature matrix: {} FAILED: {msg}", row.name);
                failed.push(row.name);
            }
        }
    }
    assert!(failed.is_empty(), "rows failed: {failed:?}");
}
