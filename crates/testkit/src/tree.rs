//! Snapshots of a mounted directory tree, and their differences.
//!
//! Owns: `Node`/`Tree` (what `lstat`, `readlink` and the xattr calls report for every
//! path under a root, plus a hash of each regular file's bytes), `ContentHasher`, and
//! `diff_trees`. Differential tests snapshot what the kernel sees and compare it with
//! what the engine reports (the engine side builds the same `Tree` and hashes file bytes
//! with the same `ContentHasher`).
//! Must hold: symlinks are never followed; names are raw bytes (no UTF-8 assumption);
//! the hash depends only on the byte sequence, never on how it was split into `update`
//! calls.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsStr};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// File type, from the `S_IFMT` bits of `st_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    CharDev,
    BlockDev,
    Fifo,
    Socket,
}

impl Kind {
    /// Kind of a full `st_mode`; `None` for an unknown type.
    pub fn from_mode(mode: u32) -> Option<Kind> {
        Some(match mode & 0o170000 {
            0o100000 => Kind::File,
            0o040000 => Kind::Dir,
            0o120000 => Kind::Symlink,
            0o020000 => Kind::CharDev,
            0o060000 => Kind::BlockDev,
            0o010000 => Kind::Fifo,
            0o140000 => Kind::Socket,
            _ => return None,
        })
    }
}

/// One path's metadata, as `lstat` and friends report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub kind: Kind,
    /// Full `st_mode` (type and permission bits).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u64,
    /// (seconds, nanoseconds)
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// (major, minor) for character and block devices.
    pub rdev: Option<(u32, u32)>,
    /// Target of a symlink.
    pub symlink: Option<Vec<u8>>,
    /// Every extended attribute the kernel lists (user., trusted., security., system.).
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// `ContentHasher` digest of a regular file's bytes.
    pub content: Option<u64>,
    pub ino: u64,
}

/// Path relative to the root (components joined with b'/'; the root itself is b"") to
/// its node.
pub type Tree = BTreeMap<Vec<u8>, Node>;

/// Splits a Linux `dev_t` into (major, minor) (glibc's encoding).
pub fn dev_major_minor(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// A deterministic, streaming 64-bit hash (not cryptographic). Four independent lanes
/// take 32 bytes per round, so it runs at memory speed; the result depends only on the
/// bytes fed in, not on how they were split between `update` calls.
#[derive(Clone, Debug)]
pub struct ContentHasher {
    lanes: [u64; 4],
    buf: [u8; 32],
    buf_len: usize,
    total_len: u64,
}

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const K3: u64 = 0x1656_67B1_9E37_79F9;

#[inline]
fn round(acc: u64, word: u64) -> u64 {
    (acc ^ word.wrapping_mul(K1))
        .rotate_left(31)
        .wrapping_mul(K2)
}

#[inline]
fn word_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(i..i + 8) {
        w.copy_from_slice(s);
    }
    u64::from_le_bytes(w)
}

fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

impl Default for ContentHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl ContentHasher {
    pub fn new() -> Self {
        ContentHasher {
            lanes: [K3, K3 ^ K1, K3 ^ K2, K3.rotate_left(17)],
            buf: [0; 32],
            buf_len: 0,
            total_len: 0,
        }
    }

    #[inline]
    fn block(&mut self, b: &[u8]) {
        for (l, lane) in self.lanes.iter_mut().enumerate() {
            *lane = round(*lane, word_at(b, l * 8));
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.total_len = self.total_len.wrapping_add(data.len() as u64);
        if self.buf_len > 0 {
            let take = (32 - self.buf_len).min(data.len());
            let (head, rest) = data.split_at(take);
            self.buf[self.buf_len..self.buf_len + take].copy_from_slice(head);
            self.buf_len += take;
            data = rest;
            if self.buf_len < 32 {
                return;
            }
            let b = self.buf;
            self.block(&b);
            self.buf_len = 0;
        }
        let mut chunks = data.chunks_exact(32);
        for c in &mut chunks {
            self.block(c);
        }
        let rest = chunks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buf_len = rest.len();
    }

    pub fn finish(&self) -> u64 {
        let [a, b, c, d] = self.lanes;
        let mut h = a
            .rotate_left(1)
            .wrapping_add(b.rotate_left(7))
            .wrapping_add(c.rotate_left(12))
            .wrapping_add(d.rotate_left(18));
        let tail = &self.buf[..self.buf_len];
        let mut i = 0;
        while i < tail.len() {
            let mut w = [0u8; 8];
            let n = (tail.len() - i).min(8);
            w[..n].copy_from_slice(&tail[i..i + n]);
            h = round(h, u64::from_le_bytes(w));
            i += 8;
        }
        fmix64(h ^ self.total_len.wrapping_mul(K3))
    }

    /// Hash of one byte string.
    pub fn hash(data: &[u8]) -> u64 {
        let mut h = ContentHasher::new();
        h.update(data);
        h.finish()
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// All extended attributes of `path` (not following symlinks).
pub fn read_xattrs(path: &Path) -> io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let c = cpath(path)?;
    let mut out = BTreeMap::new();
    let names = loop {
        // SAFETY: `c` is NUL-terminated; a null buffer with size 0 asks for the length.
        let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOTSUP) {
                return Ok(out);
            }
            return Err(e);
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: `buf` has `buf.len()` writable bytes.
        let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue;
            }
            return Err(e);
        }
        buf.truncate(m as usize);
        break buf;
    };
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "xattr name with NUL"))?;
        let value = loop {
            // SAFETY: both strings are NUL-terminated; null buffer asks for the length.
            let n = unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), std::ptr::null_mut(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut buf = vec![0u8; n as usize];
            // SAFETY: `buf` has `buf.len()` writable bytes.
            let m = unsafe {
                libc::lgetxattr(
                    c.as_ptr(),
                    cname.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if m < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ERANGE) {
                    continue;
                }
                return Err(e);
            }
            buf.truncate(m as usize);
            break buf;
        };
        out.insert(name.to_vec(), value);
    }
    Ok(out)
}

/// `ContentHasher` digest of the file at `path`.
pub fn hash_file(path: &Path) -> io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let mut h = ContentHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finish())
}

/// The node for one path (lstat, readlink, xattrs, content hash).
pub fn snapshot_node(path: &Path) -> io::Result<Node> {
    let md = std::fs::symlink_metadata(path)?;
    let mode = md.mode();
    let kind = Kind::from_mode(mode).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: unknown file type {mode:o}", path.display()),
        )
    })?;
    let rdev = matches!(kind, Kind::CharDev | Kind::BlockDev).then(|| dev_major_minor(md.rdev()));
    let symlink = if kind == Kind::Symlink {
        Some(
            std::fs::read_link(path)?
                .into_os_string()
                .as_bytes()
                .to_vec(),
        )
    } else {
        None
    };
    let content = if kind == Kind::File {
        Some(hash_file(path)?)
    } else {
        None
    };
    Ok(Node {
        kind,
        mode,
        uid: md.uid(),
        gid: md.gid(),
        size: md.size(),
        nlink: md.nlink(),
        atime: (md.atime(), md.atime_nsec() as u32),
        mtime: (md.mtime(), md.mtime_nsec() as u32),
        ctime: (md.ctime(), md.ctime_nsec() as u32),
        rdev,
        symlink,
        xattrs: read_xattrs(path)?,
        content,
        ino: md.ino(),
    })
}

/// Walks `root` without following symlinks and records every path (`lost+found` and
/// its contents included). Reading files updates atimes under `relatime`: mount with
/// `noatime`, or ignore atime when comparing.
pub fn snapshot_dir(root: &Path) -> io::Result<Tree> {
    let mut tree = Tree::new();
    let mut stack: Vec<(Vec<u8>, PathBuf)> = vec![(Vec::new(), root.to_path_buf())];
    while let Some((rel, abs)) = stack.pop() {
        let node = snapshot_node(&abs)
            .map_err(|e| io::Error::new(e.kind(), format!("snapshot {}: {e}", abs.display())))?;
        if node.kind == Kind::Dir {
            for ent in std::fs::read_dir(&abs)? {
                let ent = ent?;
                let name = ent.file_name();
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(name.as_bytes());
                stack.push((child, abs.join(&name)));
            }
        }
        tree.insert(rel, node);
    }
    Ok(tree)
}

/// The absolute path of `rel` (a `Tree` key) under `root`.
pub fn tree_path(root: &Path, rel: &[u8]) -> PathBuf {
    if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(OsStr::from_bytes(rel))
    }
}

/// What `diff_trees` ignores.
#[derive(Clone, Debug, Default)]
pub struct Compare {
    pub ignore_atime: bool,
    pub ignore_ctime: bool,
    /// Ignore inode numbers...
    pub ignore_ino: bool,
    /// ...and instead require the same hard-link groups: two non-directory paths share
    /// an inode on one side iff they do on the other.
    pub hardlinks_by_paths: bool,
    /// Ignore directory sizes (both sides ext4 normally agree; a rebuilt directory may not).
    pub ignore_dir_size: bool,
    /// Ignore these paths and everything below them (keys as in `Tree`).
    pub ignore_paths: Vec<Vec<u8>>,
}

impl Compare {
    /// Everything compared, inode numbers included.
    pub fn exact() -> Compare {
        Compare::default()
    }

    /// For two mounts of different images holding the "same" tree: atime, ctime and
    /// inode numbers ignored, hard-link groups compared by path sets.
    pub fn semantic() -> Compare {
        Compare {
            ignore_atime: true,
            ignore_ctime: true,
            ignore_ino: true,
            hardlinks_by_paths: true,
            ..Compare::default()
        }
    }

    fn ignored(&self, path: &[u8]) -> bool {
        self.ignore_paths.iter().any(|p| {
            p.is_empty()
                || path == p.as_slice()
                || (path.starts_with(p) && path.get(p.len()) == Some(&b'/'))
        })
    }
}

/// A `Tree` key for messages: "/" + escaped bytes.
pub fn show_path(p: &[u8]) -> String {
    format!("/{}", p.escape_ascii())
}

fn show_bytes(b: &[u8]) -> String {
    if b.len() > 64 {
        format!(
            "\"{}\"... ({} bytes, hash {:016x})",
            b[..64].escape_ascii(),
            b.len(),
            ContentHasher::hash(b)
        )
    } else {
        format!("\"{}\"", b.escape_ascii())
    }
}

fn link_groups(t: &Tree, cmp: &Compare) -> BTreeMap<Vec<u8>, BTreeSet<Vec<u8>>> {
    let mut by_ino: BTreeMap<u64, BTreeSet<Vec<u8>>> = BTreeMap::new();
    for (p, n) in t {
        if n.kind != Kind::Dir && !cmp.ignored(p) {
            by_ino.entry(n.ino).or_default().insert(p.clone());
        }
    }
    let mut out = BTreeMap::new();
    for set in by_ino.into_values() {
        for p in &set {
            out.insert(p.clone(), set.clone());
        }
    }
    out
}

/// Human-readable differences between two trees ("/path: mtime (1, 2) != (1, 3)"),
/// empty if they agree under `cmp`.
pub fn diff_trees(a: &Tree, b: &Tree, cmp: &Compare) -> Vec<String> {
    let mut out = Vec::new();
    for (p, na) in a {
        if cmp.ignored(p) {
            continue;
        }
        match b.get(p) {
            None => out.push(format!("{}: only in a ({:?})", show_path(p), na.kind)),
            Some(nb) => diff_node(p, na, nb, cmp, &mut out),
        }
    }
    for (p, nb) in b {
        if !cmp.ignored(p) && !a.contains_key(p) {
            out.push(format!("{}: only in b ({:?})", show_path(p), nb.kind));
        }
    }
    if cmp.hardlinks_by_paths {
        let (ga, gb) = (link_groups(a, cmp), link_groups(b, cmp));
        for (p, sa) in &ga {
            if let Some(sb) = gb.get(p) {
                if sa != sb {
                    let show = |s: &BTreeSet<Vec<u8>>| {
                        s.iter()
                            .map(|x| show_path(x))
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    out.push(format!(
                        "{}: hard-link group [{}] != [{}]",
                        show_path(p),
                        show(sa),
                        show(sb)
                    ));
                }
            }
        }
    }
    out
}

fn diff_node(p: &[u8], a: &Node, b: &Node, cmp: &Compare, out: &mut Vec<String>) {
    let path = show_path(p);
    macro_rules! field {
        ($name:literal, $x:expr, $y:expr) => {
            if $x != $y {
                out.push(format!("{path}: {} {:?} != {:?}", $name, $x, $y));
            }
        };
    }
    field!("kind", a.kind, b.kind);
    if a.mode != b.mode {
        out.push(format!("{path}: mode {:o} != {:o}", a.mode, b.mode));
    }
    field!("uid", a.uid, b.uid);
    field!("gid", a.gid, b.gid);
    if !(cmp.ignore_dir_size && a.kind == Kind::Dir && b.kind == Kind::Dir) {
        field!("size", a.size, b.size);
    }
    field!("nlink", a.nlink, b.nlink);
    if !cmp.ignore_atime {
        field!("atime", a.atime, b.atime);
    }
    field!("mtime", a.mtime, b.mtime);
    if !cmp.ignore_ctime {
        field!("ctime", a.ctime, b.ctime);
    }
    field!("rdev", a.rdev, b.rdev);
    if a.symlink != b.symlink {
        let s = |v: &Option<Vec<u8>>| v.as_deref().map_or("none".to_string(), show_bytes);
        out.push(format!(
            "{path}: symlink {} != {}",
            s(&a.symlink),
            s(&b.symlink)
        ));
    }
    if a.xattrs != b.xattrs {
        let keys: BTreeSet<&Vec<u8>> = a.xattrs.keys().chain(b.xattrs.keys()).collect();
        for k in keys {
            let (va, vb) = (a.xattrs.get(k), b.xattrs.get(k));
            if va != vb {
                let s = |v: Option<&Vec<u8>>| v.map_or("absent".to_string(), |v| show_bytes(v));
                out.push(format!(
                    "{path}: xattr {} {} != {}",
                    k.escape_ascii(),
                    s(va),
                    s(vb)
                ));
            }
        }
    }
    if a.content != b.content {
        let s = |v: Option<u64>| v.map_or("none".to_string(), |h| format!("{h:016x}"));
        out.push(format!(
            "{path}: content {} != {}",
            s(a.content),
            s(b.content)
        ));
    }
    if !cmp.ignore_ino {
        field!("ino", a.ino, b.ino);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hasher_is_split_independent_and_sensitive() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = ContentHasher::hash(&data);
        for split in [0, 1, 7, 8, 31, 32, 33, 500, 999, 1000] {
            let mut h = ContentHasher::new();
            h.update(&data[..split]);
            h.update(&data[split..]);
            assert_eq!(h.finish(), whole, "split {split}");
        }
        let mut h = ContentHasher::new();
        for b in &data {
            h.update(std::slice::from_ref(b));
        }
        assert_eq!(h.finish(), whole);
        // Every single-bit flip and every length change alters the hash.
        for i in [0usize, 5, 31, 32, 63, 500, 999] {
            let mut d = data.clone();
            d[i] ^= 1;
            assert_ne!(ContentHasher::hash(&d), whole, "flip at {i}");
        }
        assert_ne!(ContentHasher::hash(&data[..999]), whole);
        let mut longer = data.clone();
        longer.push(0);
        assert_ne!(ContentHasher::hash(&longer), whole);
        assert_ne!(ContentHasher::hash(&[]), ContentHasher::hash(&[0]));
        assert_ne!(
            ContentHasher::hash(&[0u8; 4096]),
            ContentHasher::hash(&[0u8; 8192])
        );
        // Pinned values: digests must not change between releases of the testkit.
        assert_eq!(
            (
                ContentHasher::hash(b""),
                ContentHasher::hash(b"rext4"),
                ContentHasher::hash(&data)
            ),
            (
                13644080490710218382,
                14290574395921268759,
                1907327554747070784
            )
        );
    }

    #[test]
    fn dev_split() {
        // makedev(300, 70000) with glibc's encoding.
        let (ma, mi) = (300u64, 70000u64);
        let dev = ((ma & 0xfff) << 8) | ((ma & !0xfff) << 32) | (mi & 0xff) | ((mi & !0xff) << 12);
        assert_eq!(dev_major_minor(dev), (300, 70000));
        assert_eq!(dev_major_minor(0x0801), (8, 1));
    }

    fn node(ino: u64) -> Node {
        Node {
            kind: Kind::File,
            mode: 0o100644,
            uid: 0,
            gid: 0,
            size: 1,
            nlink: 1,
            atime: (1, 0),
            mtime: (2, 0),
            ctime: (3, 0),
            rdev: None,
            symlink: None,
            xattrs: BTreeMap::new(),
            content: Some(5),
            ino,
        }
    }

    #[test]
    fn diff_reports_fields_and_link_groups() {
        let mut a = Tree::new();
        a.insert(b"x".to_vec(), node(12));
        a.insert(b"y".to_vec(), node(12));
        a.insert(b"z".to_vec(), node(13));
        let mut b = a.clone();
        assert!(diff_trees(&a, &b, &Compare::exact()).is_empty());
        // Renumbered inodes with the same grouping: only an exact compare objects.
        for n in b.values_mut() {
            n.ino += 100;
        }
        assert!(!diff_trees(&a, &b, &Compare::exact()).is_empty());
        assert!(diff_trees(&a, &b, &Compare::semantic()).is_empty());
        // Different grouping is caught when inode numbers are ignored.
        if let Some(n) = b.get_mut(b"z".as_slice()) {
            n.ino = 112;
        }
        let d = diff_trees(&a, &b, &Compare::semantic());
        assert!(d.iter().any(|s| s.contains("hard-link group")), "{d:?}");
        // A field change is named.
        let mut c = a.clone();
        if let Some(n) = c.get_mut(b"x".as_slice()) {
            n.mtime = (2, 1);
            n.xattrs.insert(b"user.a".to_vec(), b"v".to_vec());
        }
        let d = diff_trees(&a, &c, &Compare::exact());
        assert!(
            d.contains(&"/x: mtime (2, 0) != (2, 1)".to_string()),
            "{d:?}"
        );
        assert!(d.iter().any(|s| s.starts_with("/x: xattr user.a")), "{d:?}");
        let mut ign = Compare::exact();
        ign.ignore_paths.push(b"x".to_vec());
        assert!(diff_trees(&a, &c, &ign).is_empty());
        c.remove(b"y".as_slice());
        let d = diff_trees(&a, &c, &Compare::exact());
        assert!(d.iter().any(|s| s == "/y: only in a (File)"), "{d:?}");
    }

    #[test]
    fn snapshot_of_host_dir() {
        let d = crate::TempDir::new("snap").expect("tempdir");
        std::fs::create_dir(d.join("sub")).expect("mkdir");
        std::fs::write(d.join("sub/f"), b"hello").expect("write");
        std::os::unix::fs::symlink("sub/f", d.join("l")).expect("symlink");
        std::fs::hard_link(d.join("sub/f"), d.join("h")).expect("link");
        let t = snapshot_dir(d.path()).expect("snapshot");
        let keys: Vec<&[u8]> = t.keys().map(Vec::as_slice).collect();
        assert_eq!(keys, [&b""[..], b"h", b"l", b"sub", b"sub/f"]);
        let f = &t[b"sub/f".as_slice()];
        assert_eq!(f.content, Some(ContentHasher::hash(b"hello")));
        assert_eq!(f.nlink, 2);
        assert_eq!(f.ino, t[b"h".as_slice()].ino);
        assert_eq!(t[b"l".as_slice()].symlink.as_deref(), Some(&b"sub/f"[..]));
        assert_eq!(t[b"".as_slice()].kind, Kind::Dir);
    }
}
