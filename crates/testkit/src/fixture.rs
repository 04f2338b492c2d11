//! The standard populated test image: one layout, written either through a kernel loop
//! mount (`populate_kernel`, needs root) or with debugfs (`populate_debugfs`, anyone).
//!
//! Layout (paths relative to the root; bs = block size):
//! - `big/`: `big_dir_entries` empty files named `big_dir_name(i)` (1..=255 bytes, some
//!   with bytes >= 0x80), large enough for an htree with an indirect level.
//! - `frag`: `frag_extents` one-block extents (data at every other block), so the
//!   extent tree has depth >= 2 when there are more than 4 * (bs - 12) / 12 extents.
//! - `prealloc`: 16 blocks of size; blocks 4..6 hold data (the last one partly), the rest
//!   is unwritten; 8 more unwritten blocks past EOF (kernel: FALLOC_FL_KEEP_SIZE).
//! - `sparse`: data at 0, 1 MiB and `sparse_far_offset`, holes between.
//! - `small/{empty,one,b4095,b4096,b4097,m1p3}`: sizes 0, 1, 4095, 4096, 4097, 1 MiB+3.
//! - `fastlink` -> "small/one", `slowlink` -> a 120-byte path to small/one,
//!   `danglink` -> "does/not/exist", `dirlink` -> "small".
//! - `hl1` and `dir/hl2`: one inode, nlink 2.
//! - `dev/chr` (c 1:3), `dev/blk` (b 8:1), `dev/bigdev` (c 300:70000, new encoding),
//!   `dev/fifo`, and (kernel only) `dev/sock`.
//! - `xattr/small` (user.small, in-inode), `xattr/big` (user.big, 1500 B or 800 B on
//!   1 KiB blocks: an xattr block), `xattr/share1`+`share2` (identical user.shared),
//!   `xattr/trusted` (trusted.tk), `xattr/acl` (POSIX access ACL), `xattr/acldir`
//!   (access + default ACL).
//! - `modes/{setuid (04755), sticky/ (01777), none (0000), owned (1000:1000),
//!   biguid (100000:100000)}`.
//! - `deep/l01/.../lNN/leaf` with NN = `deep_depth`.
//! - `times/{nsec, pre1970, y2200}` and `times/` itself, plus `fastlink`: atime/mtime set
//!   to nanosecond precision (`TIMES`), including pre-1970 and post-2038 seconds.
//!
//! Must hold: both writers produce the same names, sizes, contents, modes, owners,
//! device numbers, link targets, xattr values and the times in `TIMES`; inode numbers,
//! ctimes, other times and physical layout differ. Each writer leaves an image that
//! `e2fsck -fn` reports clean.

use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::tmp::TempDir;
use crate::tools::{debugfs_w_checked, e2fsck_with, image_block_size};
use crate::tree::ContentHasher;

/// What to build; `Default` is the full fixture, `Fixture::quick()` a small one.
#[derive(Clone, Debug)]
pub struct Fixture {
    /// Files in `big/` (default 20,000).
    pub big_dir_entries: u32,
    /// One-block extents in `frag` (default 3,000: depth 2 on 1 KiB and 4 KiB blocks).
    pub frag_extents: u32,
    /// Offset of the last data in `sparse` (default 100 MiB).
    pub sparse_far_offset: u64,
    /// Nesting depth of `deep/` (default 20).
    pub deep_depth: u32,
    /// Build `dev/` (default true).
    pub devices: bool,
    /// Build `xattr/` (default true).
    pub xattrs: bool,
}

impl Default for Fixture {
    fn default() -> Self {
        Fixture {
            big_dir_entries: 20_000,
            frag_extents: 3_000,
            sparse_far_offset: 100 << 20,
            deep_depth: 20,
            devices: true,
            xattrs: true,
        }
    }
}

impl Fixture {
    /// A fast variant: 600 big-dir entries (multi-block, indexed), 400 extents
    /// (depth 2 on 1 KiB blocks, depth 1 on 4 KiB), 8 MiB sparse offset.
    pub fn quick() -> Self {
        Fixture {
            big_dir_entries: 600,
            frag_extents: 400,
            sparse_far_offset: 8 << 20,
            deep_depth: 20,
            devices: true,
            xattrs: true,
        }
    }
}

/// (seconds, nanoseconds).
pub type Timestamp = (i64, u32);

/// (path, atime, mtime) set by both writers, applied after everything else.
pub const TIMES: &[(&str, Timestamp, Timestamp)] = &[
    (
        "times/nsec",
        (1_234_567_890, 123_456_789),
        (1_600_000_000, 987_654_321),
    ),
    (
        "times/pre1970",
        (-1, 999_999_999),
        (-315_360_000, 250_000_000),
    ),
    (
        "times/y2200",
        (4_102_444_800, 0),
        (7_258_118_400, 999_999_999),
    ),
    ("fastlink", (1_000_000_000, 42), (1_000_000_001, 43)),
    ("times", (1_500_000_000, 5), (1_500_000_001, 6)),
];

/// Small files: (name under `small/`, size).
pub const SMALL_FILES: &[(&str, usize)] = &[
    ("empty", 0),
    ("one", 1),
    ("b4095", 4095),
    ("b4096", 4096),
    ("b4097", 4097),
    ("m1p3", (1 << 20) + 3),
];

/// Device nodes under `dev/`: (name, is_char, major, minor).
pub const DEVICES: &[(&str, bool, u32, u32)] = &[
    ("chr", true, 1, 3),
    ("blk", false, 8, 1),
    ("bigdev", true, 300, 70_000),
];

/// Target of `slowlink` (120 bytes, resolves to small/one).
pub fn slowlink_target() -> Vec<u8> {
    let mut t = b"./".repeat(55);
    t.extend_from_slice(b"/small/one");
    t
}

const NAME_ALPHA: &[u8; 64] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-";

/// Name of entry `i` of `big/`: the base-64 digits of `i`, then (if the target length
/// allows) '.' and filler up to a target length. Entries 0..255 have lengths 1..=255;
/// about one in 97 names holds bytes >= 0x80. Names never contain '.' before the
/// filler, so they are unique.
pub fn big_dir_name(i: u32) -> Vec<u8> {
    let mut digits = Vec::new();
    let mut v = i;
    loop {
        digits.push(NAME_ALPHA[(v % 64) as usize]);
        v /= 64;
        if v == 0 {
            break;
        }
    }
    digits.reverse();
    let target = if i < 255 {
        i as usize + 1
    } else {
        1 + (i as usize * 7919 + 13) % 255
    };
    let mut name = digits;
    if target > name.len() {
        name.push(b'.');
        let high = i % 97 == 5;
        let mut j = 0usize;
        while name.len() < target {
            let phase = j % 3;
            let b = if high && phase == 0 {
                0x80 + ((i as usize + j) % 0x7f) as u8
            } else {
                NAME_ALPHA[(i as usize * 31 + j * 7) % 64]
            };
            name.push(b);
            j += 1;
        }
    }
    name
}

/// Deterministic pseudo-random bytes (splitmix64 stream seeded with `seed`).
pub fn fixture_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed ^ 0x005E_ED0F_7E57;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn seed_of(name: &str) -> u64 {
    ContentHasher::hash(name.as_bytes())
}

/// Contents of `small/NAME`.
pub fn small_file_bytes(name: &str, len: usize) -> Vec<u8> {
    fixture_bytes(seed_of(name), len)
}

/// Contents of `hl1`.
pub const HARDLINK_DATA: &[u8] = b"one inode, two names\n";

/// Value of `user.big` for a block size.
pub fn big_xattr_value(block_size: u32) -> Vec<u8> {
    let len = if block_size >= 2048 { 1500 } else { 800 };
    fixture_bytes(seed_of("user.big"), len)
}

/// Value of `user.shared` on `xattr/share1` and `xattr/share2`.
pub fn shared_xattr_value() -> Vec<u8> {
    fixture_bytes(seed_of("user.shared"), 400)
}

const ACL_USER_OBJ: u16 = 0x01;
const ACL_USER: u16 = 0x02;
const ACL_GROUP_OBJ: u16 = 0x04;
const ACL_GROUP: u16 = 0x08;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;
const ACL_UNDEFINED_ID: u32 = u32::MAX;

/// A POSIX ACL in the xattr (user-space) format, version 2:
/// u:rw-, u:1000:r--, g:r--, g:1000:rw-, m:rw-, o:---.
pub fn acl_xattr_value() -> Vec<u8> {
    let entries: [(u16, u16, u32); 6] = [
        (ACL_USER_OBJ, 6, ACL_UNDEFINED_ID),
        (ACL_USER, 4, 1000),
        (ACL_GROUP_OBJ, 4, ACL_UNDEFINED_ID),
        (ACL_GROUP, 6, 1000),
        (ACL_MASK, 6, ACL_UNDEFINED_ID),
        (ACL_OTHER, 0, ACL_UNDEFINED_ID),
    ];
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Layout of `frag`: data block `k` (of `frag_extents`) sits at logical block `2k` and
/// holds `fixture_bytes(k, bs)`.
fn frag_block(k: u32, bs: u32) -> Vec<u8> {
    fixture_bytes(0xF4A6_0000 + u64::from(k), bs as usize)
}

/// Pieces of `sparse`: (offset, bytes).
fn sparse_pieces(far: u64) -> Vec<(u64, Vec<u8>)> {
    vec![
        (0, fixture_bytes(1, 5000)),
        (1 << 20, fixture_bytes(2, 4096)),
        (far, fixture_bytes(3, 333)),
    ]
}

/// Data of `prealloc`: written at block 4, length 2 blocks - 100 bytes.
fn prealloc_data(bs: u32) -> Vec<u8> {
    fixture_bytes(0x9EA1, 2 * bs as usize - 100)
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn check(rc: libc::c_int, what: &dyn Fn() -> String) -> io::Result<()> {
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{}: {e}", what())));
    }
    Ok(())
}

fn ctx<T>(r: io::Result<T>, what: impl std::fmt::Display) -> io::Result<T> {
    r.map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let c = cpath(p)?;
    let n = CString::new(name).map_err(|_| io::Error::other("xattr name with NUL"))?;
    // SAFETY: both strings are NUL-terminated; `value` is valid for `value.len()` bytes.
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(rc, &|| format!("setxattr {name} on {}", p.display()))
}

fn mknod(
    p: &Path,
    kind: libc::mode_t,
    perm: libc::mode_t,
    major: u32,
    minor: u32,
) -> io::Result<()> {
    let c = cpath(p)?;
    let dev = libc::makedev(major, minor);
    // SAFETY: `c` is a NUL-terminated path.
    let rc = unsafe { libc::mknod(c.as_ptr(), kind | perm, dev) };
    check(rc, &|| format!("mknod {}", p.display()))
}

fn lchown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let c = cpath(p)?;
    // SAFETY: `c` is a NUL-terminated path.
    let rc = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
    check(rc, &|| format!("lchown {}", p.display()))
}

fn set_times(p: &Path, atime: (i64, u32), mtime: (i64, u32)) -> io::Result<()> {
    let c = cpath(p)?;
    let ts = [
        libc::timespec {
            tv_sec: atime.0 as libc::time_t,
            tv_nsec: atime.1 as libc::c_long,
        },
        libc::timespec {
            tv_sec: mtime.0 as libc::time_t,
            tv_nsec: mtime.1 as libc::c_long,
        },
    ];
    // SAFETY: `c` is NUL-terminated and `ts` holds the two timespecs utimensat reads.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(rc, &|| format!("utimensat {}", p.display()))
}

fn fallocate(f: &File, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the fd is open for writing for the duration of the call.
    let rc =
        unsafe { libc::fallocate(f.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
    check(rc, &|| "fallocate".to_string())
}

fn chmod(p: &Path, mode: u32) -> io::Result<()> {
    ctx(
        fs::set_permissions(p, fs::Permissions::from_mode(mode)),
        format!("chmod {}", p.display()),
    )
}

/// Writes the fixture through the kernel into the mounted filesystem at `mnt` (root
/// needed for devices, ownership and trusted.*). Times in `TIMES` are applied last.
pub fn populate_kernel(mnt: &Path, spec: &Fixture) -> io::Result<()> {
    let bs = fs::metadata(mnt)?.blksize() as u32;

    // big/
    let big = mnt.join("big");
    fs::create_dir(&big)?;
    for i in 0..spec.big_dir_entries {
        let name = big_dir_name(i);
        let p = big.join(OsStr::from_bytes(&name));
        ctx(File::create(&p), format!("create {}", p.display()))?;
    }

    // frag: one block at every other logical block.
    {
        let f = File::create(mnt.join("frag"))?;
        for k in 0..spec.frag_extents {
            f.write_all_at(&frag_block(k, bs), 2 * u64::from(k) * u64::from(bs))?;
        }
        f.sync_all()?;
    }

    // prealloc
    {
        let f = File::create(mnt.join("prealloc"))?;
        let b = u64::from(bs);
        fallocate(&f, 0, 0, 16 * b)?;
        f.write_all_at(&prealloc_data(bs), 4 * b)?;
        fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 16 * b, 8 * b)?;
        f.sync_all()?;
    }

    // sparse
    {
        let f = File::create(mnt.join("sparse"))?;
        for (off, data) in sparse_pieces(spec.sparse_far_offset) {
            f.write_all_at(&data, off)?;
        }
    }

    // small/
    fs::create_dir(mnt.join("small"))?;
    for &(name, len) in SMALL_FILES {
        fs::write(mnt.join("small").join(name), small_file_bytes(name, len))?;
    }

    // symlinks
    std::os::unix::fs::symlink("small/one", mnt.join("fastlink"))?;
    std::os::unix::fs::symlink(OsStr::from_bytes(&slowlink_target()), mnt.join("slowlink"))?;
    std::os::unix::fs::symlink("does/not/exist", mnt.join("danglink"))?;
    std::os::unix::fs::symlink("small", mnt.join("dirlink"))?;

    // hard links
    fs::write(mnt.join("hl1"), HARDLINK_DATA)?;
    fs::create_dir(mnt.join("dir"))?;
    fs::hard_link(mnt.join("hl1"), mnt.join("dir/hl2"))?;

    // devices
    if spec.devices {
        let dev = mnt.join("dev");
        fs::create_dir(&dev)?;
        for &(name, chr, major, minor) in DEVICES {
            let kind = if chr { libc::S_IFCHR } else { libc::S_IFBLK };
            mknod(&dev.join(name), kind, 0o644, major, minor)?;
        }
        mknod(&dev.join("fifo"), libc::S_IFIFO, 0o644, 0, 0)?;
        // The socket inode stays after the listener is dropped.
        match std::os::unix::net::UnixListener::bind(dev.join("sock")) {
            Ok(l) => drop(l),
            Err(e) => eprintln!("rext4-testkit: no dev/sock: {e}"),
        }
    }

    // xattrs
    if spec.xattrs {
        let x = mnt.join("xattr");
        fs::create_dir(&x)?;
        fs::write(x.join("small"), b"s")?;
        set_xattr(&x.join("small"), "user.small", b"hello")?;
        fs::write(x.join("big"), b"b")?;
        set_xattr(&x.join("big"), "user.big", &big_xattr_value(bs))?;
        for n in ["share1", "share2"] {
            fs::write(x.join(n), n.as_bytes())?;
            set_xattr(&x.join(n), "user.shared", &shared_xattr_value())?;
        }
        fs::write(x.join("trusted"), b"t")?;
        set_xattr(&x.join("trusted"), "trusted.tk", b"secret")?;
        fs::write(x.join("acl"), b"a")?;
        fs::create_dir(x.join("acldir"))?;
        let acl = acl_xattr_value();
        let r = set_xattr(&x.join("acl"), "system.posix_acl_access", &acl)
            .and_then(|()| set_xattr(&x.join("acldir"), "system.posix_acl_access", &acl))
            .and_then(|()| set_xattr(&x.join("acldir"), "system.posix_acl_default", &acl));
        if let Err(e) = r {
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                eprintln!("rext4-testkit: kernel without ext4 POSIX ACLs: {e}");
            } else {
                return Err(e);
            }
        }
    }

    // modes and owners (chmod after chown: chown clears setuid).
    let m = mnt.join("modes");
    fs::create_dir(&m)?;
    fs::write(m.join("setuid"), b"#!/bin/true\n")?;
    chmod(&m.join("setuid"), 0o4755)?;
    fs::create_dir(m.join("sticky"))?;
    chmod(&m.join("sticky"), 0o1777)?;
    fs::write(m.join("none"), b"")?;
    chmod(&m.join("none"), 0)?;
    fs::write(m.join("owned"), b"o")?;
    lchown(&m.join("owned"), 1000, 1000)?;
    fs::write(m.join("biguid"), b"u")?;
    lchown(&m.join("biguid"), 100_000, 100_000)?;

    // deep/
    let mut d = mnt.join("deep");
    fs::create_dir(&d)?;
    for l in 1..=spec.deep_depth {
        d = d.join(format!("l{l:02}"));
        fs::create_dir(&d)?;
    }
    fs::write(d.join("leaf"), b"leaf\n")?;

    // times (last: creating entries would move the directories' mtimes).
    fs::create_dir(mnt.join("times"))?;
    for n in ["nsec", "pre1970", "y2200"] {
        fs::write(mnt.join("times").join(n), n.as_bytes())?;
    }
    for &(p, at, mt) in TIMES {
        set_times(&mnt.join(p), at, mt)?;
    }
    crate::mount::sync_path(mnt);
    Ok(())
}

/// Script builder for debugfs: names are raw bytes; every command is one line.
struct Script(Vec<u8>);

impl Script {
    fn line(&mut self, parts: &[&[u8]]) {
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                self.0.push(b' ');
            }
            self.0.extend_from_slice(p);
        }
        self.0.push(b'\n');
    }

    fn cmd(&mut self, s: &str) {
        self.line(&[s.as_bytes()]);
    }
}

fn host_path_bytes(p: &Path) -> &[u8] {
    p.as_os_str().as_bytes()
}

/// The inode-field value that `sif PATH Xtime_extra` needs: nanoseconds << 2 plus the
/// two epoch bits that extend the signed 32-bit seconds.
fn time_extra(secs: i64, nsec: u32) -> u32 {
    let epoch = ((secs - i64::from(secs as i32)) >> 32) & 3;
    (nsec << 2) | epoch as u32
}

/// Writes the fixture into the unmounted image `img` with debugfs (no root needed).
/// `big/` is first filled linearly, indexed with `e2fsck -fyD`, then grown through
/// debugfs' htree insert (a linear 20,000-entry build would take most of a minute).
/// There is no socket (debugfs cannot make one).
pub fn populate_debugfs(img: &Path, spec: &Fixture) -> io::Result<()> {
    let bs = image_block_size(img)?;
    let host = TempDir::new("dbgfs-host")?;
    let hp = |n: &str| host.join(n);
    fs::write(hp("empty"), b"")?;
    let null = host_path_bytes(&host.join("empty")).to_vec();

    // big/, phase 1: linear, then index it.
    const LINEAR: u32 = 300;
    let mut s = Script(Vec::new());
    s.cmd("mkdir big");
    s.cmd("cd /big");
    for i in 0..spec.big_dir_entries.min(LINEAR) {
        s.line(&[b"write", &null, &big_dir_name(i)]);
    }
    s.cmd("cd /");
    ctx(debugfs_w_checked(img, &s.0), "debugfs big/ (linear)")?;
    if spec.big_dir_entries > LINEAR {
        let r = e2fsck_with(img, &["-fyD"]);
        if r.exit_code > 1 {
            return Err(io::Error::other(format!(
                "e2fsck -fyD failed ({}):\n{}",
                r.exit_code, r.output
            )));
        }
        // Phase 2: create in an empty staging dir, hard-link into big/ (ext2fs_link
        // inserts into the htree; a lookup in big/ would be a linear scan), unlink.
        let mut s = Script(Vec::new());
        s.cmd("mkdir stage");
        s.cmd("cd /stage");
        for i in LINEAR..spec.big_dir_entries {
            let name = big_dir_name(i);
            s.line(&[b"write", &null, &name]);
            s.line(&[b"ln", &name, b"/big"]);
            s.line(&[b"unlink", &name]);
        }
        s.cmd("cd /");
        s.cmd("rmdir stage");
        ctx(debugfs_w_checked(img, &s.0), "debugfs big/ (htree)")?;
    }

    let mut s = Script(Vec::new());
    // frag
    {
        let f = File::create(hp("frag"))?;
        for k in 0..spec.frag_extents {
            f.write_all_at(&frag_block(k, bs), 2 * u64::from(k) * u64::from(bs))?;
        }
        s.line(&[b"write", host_path_bytes(&hp("frag")), b"frag"]);
    }
    // prealloc: data at block 4, holes elsewhere, then unwritten fill and past-EOF.
    {
        let f = File::create(hp("prealloc"))?;
        f.set_len(16 * u64::from(bs))?;
        f.write_all_at(&prealloc_data(bs), 4 * u64::from(bs))?;
        s.line(&[b"write", host_path_bytes(&hp("prealloc")), b"prealloc"]);
        s.cmd("fallocate /prealloc 0 15");
        s.cmd("fallocate /prealloc 16 23");
    }
    // sparse
    {
        let f = File::create(hp("sparse"))?;
        for (off, data) in sparse_pieces(spec.sparse_far_offset) {
            f.write_all_at(&data, off)?;
        }
        s.line(&[b"write", host_path_bytes(&hp("sparse")), b"sparse"]);
    }
    // small/
    s.cmd("mkdir small");
    s.cmd("cd /small");
    for &(name, len) in SMALL_FILES {
        let p = hp(&format!("small-{name}"));
        fs::write(&p, small_file_bytes(name, len))?;
        s.line(&[b"write", host_path_bytes(&p), name.as_bytes()]);
    }
    s.cmd("cd /");
    // symlinks
    s.cmd("symlink fastlink small/one");
    s.line(&[b"symlink", b"slowlink", &slowlink_target()]);
    s.cmd("symlink danglink does/not/exist");
    s.cmd("symlink dirlink small");
    // hard links
    fs::write(hp("hl"), HARDLINK_DATA)?;
    s.line(&[b"write", host_path_bytes(&hp("hl")), b"hl1"]);
    s.cmd("mkdir dir");
    s.cmd("ln /hl1 /dir/hl2");
    s.cmd("sif /hl1 links_count 2");
    // devices
    if spec.devices {
        s.cmd("mkdir dev");
        s.cmd("cd /dev");
        for &(name, chr, major, minor) in DEVICES {
            let t = if chr { 'c' } else { 'b' };
            if major < 256 && minor < 256 {
                s.cmd(&format!("mknod {name} {t} {major} {minor}"));
            } else {
                // debugfs takes minors < 65536 only: make the node, then store the new
                // (huge) encoding in i_block[1] directly.
                s.cmd(&format!("mknod {name} {t} 300 300"));
                let enc = (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12);
                s.cmd(&format!("sif /dev/{name} block[0] 0"));
                s.cmd(&format!("sif /dev/{name} block[1] {enc:#x}"));
            }
            s.cmd(&format!(
                "sif /dev/{name} mode 0{:o}",
                if chr { 0o20644 } else { 0o60644 }
            ));
        }
        s.cmd("mknod fifo p");
        s.cmd("sif /dev/fifo mode 010644");
        s.cmd("cd /");
    }
    // xattrs
    if spec.xattrs {
        s.cmd("mkdir xattr");
        s.cmd("cd /xattr");
        let mut small_file = |name: &str, data: &[u8]| -> io::Result<()> {
            let p = hp(&format!("x-{name}"));
            fs::write(&p, data)?;
            s.line(&[b"write", host_path_bytes(&p), name.as_bytes()]);
            Ok(())
        };
        small_file("small", b"s")?;
        small_file("big", b"b")?;
        small_file("share1", b"share1")?;
        small_file("share2", b"share2")?;
        small_file("trusted", b"t")?;
        small_file("acl", b"a")?;
        s.cmd("mkdir acldir");
        s.cmd("cd /");
        s.cmd("ea_set /xattr/small user.small hello");
        fs::write(hp("v-big"), big_xattr_value(bs))?;
        s.line(&[
            b"ea_set -f",
            host_path_bytes(&hp("v-big")),
            b"/xattr/big user.big",
        ]);
        fs::write(hp("v-shared"), shared_xattr_value())?;
        for n in ["share1", "share2"] {
            s.line(&[
                b"ea_set -f",
                host_path_bytes(&hp("v-shared")),
                format!("/xattr/{n} user.shared").as_bytes(),
            ]);
        }
        s.cmd("ea_set /xattr/trusted trusted.tk secret");
        fs::write(hp("v-acl"), acl_xattr_value())?;
        let acl = host_path_bytes(&hp("v-acl")).to_vec();
        s.line(&[b"ea_set -f", &acl, b"/xattr/acl system.posix_acl_access"]);
        s.line(&[b"ea_set -f", &acl, b"/xattr/acldir system.posix_acl_access"]);
        s.line(&[
            b"ea_set -f",
            &acl,
            b"/xattr/acldir system.posix_acl_default",
        ]);
        // The kernel folds an access ACL's mask into the group bits of the mode.
        s.cmd("sif /xattr/acl mode 0100660");
        s.cmd("sif /xattr/acldir mode 040660");
    }
    // modes and owners
    s.cmd("mkdir modes");
    s.cmd("cd /modes");
    for (name, data) in [
        ("setuid", &b"#!/bin/true\n"[..]),
        ("none", b""),
        ("owned", b"o"),
        ("biguid", b"u"),
    ] {
        let p = hp(&format!("m-{name}"));
        fs::write(&p, data)?;
        s.line(&[b"write", host_path_bytes(&p), name.as_bytes()]);
    }
    s.cmd("mkdir sticky");
    s.cmd("cd /");
    s.cmd("sif /modes/setuid mode 0104755");
    s.cmd("sif /modes/sticky mode 041777");
    s.cmd("sif /modes/none mode 0100000");
    s.cmd("sif /modes/owned uid 1000");
    s.cmd("sif /modes/owned gid 1000");
    s.cmd("sif /modes/biguid uid 100000");
    s.cmd("sif /modes/biguid gid 100000");
    // deep/
    s.cmd("mkdir deep");
    s.cmd("cd /deep");
    for l in 1..=spec.deep_depth {
        s.cmd(&format!("mkdir l{l:02}"));
        s.cmd(&format!("cd l{l:02}"));
    }
    fs::write(hp("leaf"), b"leaf\n")?;
    s.line(&[b"write", host_path_bytes(&hp("leaf")), b"leaf"]);
    s.cmd("cd /");
    // times
    s.cmd("mkdir times");
    s.cmd("cd /times");
    for n in ["nsec", "pre1970", "y2200"] {
        let p = hp(&format!("t-{n}"));
        fs::write(&p, n.as_bytes())?;
        s.line(&[b"write", host_path_bytes(&p), n.as_bytes()]);
    }
    s.cmd("cd /");
    for &(p, at, mt) in TIMES {
        for (field, (secs, nsec)) in [("atime", at), ("mtime", mt)] {
            // The low 32 bits as an unsigned number (debugfs cannot parse "@-1": it is
            // its error value); `_extra` then sets the epoch bits and nanoseconds.
            s.cmd(&format!("sif /{p} {field} @{}", secs as u32));
            s.cmd(&format!(
                "sif /{p} {field}_extra {}",
                time_extra(secs, nsec)
            ));
        }
    }
    ctx(debugfs_w_checked(img, &s.0), "debugfs fixture")?;
    Ok(())
}

/// Every regular file of the fixture whose bytes are fixed: (path, size, `ContentHasher`
/// digest of the bytes a reader sees, holes and unwritten ranges as zeros).
pub fn expected_files(spec: &Fixture, block_size: u32) -> Vec<(String, u64, u64)> {
    let bs = u64::from(block_size);
    let zeros = vec![0u8; block_size as usize];
    let mut out = Vec::new();
    let mut one = |path: &str, data: &[u8]| {
        out.push((
            path.to_string(),
            data.len() as u64,
            ContentHasher::hash(data),
        ));
    };
    for &(name, len) in SMALL_FILES {
        one(&format!("small/{name}"), &small_file_bytes(name, len));
    }
    one("hl1", HARDLINK_DATA);
    one("deep_leaf", b"leaf\n");
    for n in ["nsec", "pre1970", "y2200"] {
        one(&format!("times/{n}"), n.as_bytes());
    }
    // prealloc
    let mut p = vec![0u8; 16 * block_size as usize];
    let d = prealloc_data(block_size);
    p[4 * block_size as usize..4 * block_size as usize + d.len()].copy_from_slice(&d);
    one("prealloc", &p);
    // frag
    if spec.frag_extents > 0 {
        let mut h = ContentHasher::new();
        for k in 0..spec.frag_extents {
            if k > 0 {
                h.update(&zeros);
            }
            h.update(&frag_block(k, block_size));
        }
        let size = (2 * u64::from(spec.frag_extents) - 1) * bs;
        out.push(("frag".to_string(), size, h.finish()));
    }
    // sparse
    let mut h = ContentHasher::new();
    let mut pos = 0u64;
    let big_zeros = vec![0u8; 1 << 20];
    for (off, data) in sparse_pieces(spec.sparse_far_offset) {
        while pos < off {
            let n = (off - pos).min(big_zeros.len() as u64) as usize;
            h.update(&big_zeros[..n]);
            pos += n as u64;
        }
        h.update(&data);
        pos += data.len() as u64;
    }
    out.push(("sparse".to_string(), pos, h.finish()));
    if let Some(e) = out.iter_mut().find(|e| e.0 == "deep_leaf") {
        let mut path = String::from("deep");
        for l in 1..=spec.deep_depth {
            path.push_str(&format!("/l{l:02}"));
        }
        path.push_str("/leaf");
        e.0 = path;
    }
    out
}

/// Sanity checks on a populated image's shape that need only debugfs: `frag`'s extent
/// depth and `big`'s htree levels. Returns (depth, htree indirect levels).
pub fn fixture_shape(img: &Path) -> io::Result<(Option<u32>, Option<u32>)> {
    Ok((
        crate::tools::extent_depth(img, "/frag")?,
        crate::tools::htree_levels(img, "/big")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn big_names_are_unique_and_varied() {
        let names: Vec<Vec<u8>> = (0..20_000).map(big_dir_name).collect();
        let set: BTreeSet<&Vec<u8>> = names.iter().collect();
        assert_eq!(set.len(), names.len());
        let lens: BTreeSet<usize> = names.iter().map(Vec::len).collect();
        assert_eq!(lens.first(), Some(&1));
        assert_eq!(lens.last(), Some(&255));
        assert_eq!(lens.len(), 255);
        assert!(
            names
                .iter()
                .filter(|n| n.iter().any(|&b| b >= 0x80))
                .count()
                > 100
        );
        for n in &names {
            assert!(!n.contains(&b'/') && !n.contains(&0) && !n.contains(&b' '));
            assert!(n.as_slice() != b"." && n.as_slice() != b"..");
        }
    }

    #[test]
    fn time_extra_encoding() {
        assert_eq!(time_extra(7_258_118_400, 0), 2);
        assert_eq!(time_extra(-1_000_000_000, 1), 4);
        assert_eq!(time_extra(0x8000_0000, 0), 1);
        assert_eq!(time_extra(0, 999_999_999), 999_999_999 << 2);
    }

    #[test]
    fn slowlink_is_long_and_resolves() {
        let t = slowlink_target();
        assert_eq!(t.len(), 120);
        assert!(t.ends_with(b"/small/one"));
    }
}
