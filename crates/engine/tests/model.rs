//! Model test: random sequences of namespace, data and attribute operations run against
//! rext4 and against an in-memory reference model. Every operation's outcome (success
//! or which error) must match the model's prediction; after each sequence the tree rext4
//! reads equals the model, `e2fsck -fn` is clean, and (as root) the kernel loop-mounts
//! the image read-write, sees the same tree, keeps writing, and rext4 then reads the
//! kernel's changes with e2fsck still clean.
//!
//! Seeds: `REXT4_MODEL_SEEDS` (default 40) sequences of `REXT4_MODEL_OPS` (default 600)
//! operations, plus one long sequence of 3,000. A failure prints the seed and the
//! operation log.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::Rng;
use rext4::format::inode::mode as m;
use rext4::{Error, FallocMode, Fs, FsOptions, Ino, RenameFlags, SetAttr, XattrFlags};
use rext4_testkit::{
    diff_trees, e2fsck_fn, mkfs, skip, snapshot_dir, Compare, ContentHasher, Kind, LoopMount,
    MkfsOptions, Node, Tree,
};

#[derive(Clone, Debug)]
enum MKind {
    File(Vec<u8>),
    Dir(BTreeMap<Vec<u8>, u64>),
    Symlink(Vec<u8>),
    Fifo,
    Chr(u32, u32),
}

#[derive(Clone, Debug)]
struct MInode {
    kind: MKind,
    perm: u32,
    uid: u32,
    gid: u32,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    engine: Ino,
}

struct Model {
    inodes: HashMap<u64, MInode>,
    next: u64,
}

const ROOT: u64 = 1;
const NAMES: &[&str] = &[
    "a",
    "b",
    "c",
    "dd",
    "a-much-longer-name-0123456789",
    "x",
    "y",
    "z9",
];

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Err(&'static str),
}

fn err_kind(e: &Error) -> &'static str {
    match e {
        Error::NotFound => "ENOENT",
        Error::Exists => "EEXIST",
        Error::NotADirectory => "ENOTDIR",
        Error::IsADirectory => "EISDIR",
        Error::NotEmpty => "ENOTEMPTY",
        Error::InvalidInput(_) => "EINVAL",
        Error::NoSpace => "ENOSPC",
        Error::TooManyLinks => "EMLINK",
        Error::NotPermitted(_) => "EPERM",
        Error::PermissionDenied => "EACCES",
        other => panic!("unexpected engine error: {other}"),
    }
}

fn outcome<T>(r: rext4::Result<T>) -> Outcome {
    match r {
        Ok(_) => Outcome::Ok,
        Err(e) => Outcome::Err(err_kind(&e)),
    }
}

impl Model {
    fn new() -> Self {
        let root = MInode {
            kind: MKind::Dir(BTreeMap::new()),
            perm: 0o755,
            uid: 0,
            gid: 0,
            xattrs: BTreeMap::new(),
            engine: Ino::ROOT,
        };
        Model {
            inodes: HashMap::from([(ROOT, root)]),
            next: 2,
        }
    }

    /// Record a new inode `ino` of the engine named `name` in directory `d`.
    fn adopt(
        &mut self,
        d: u64,
        name: Vec<u8>,
        ino: Ino,
        kind: MKind,
        perm: u32,
        owner: (u32, u32),
    ) -> u64 {
        let id = self.next;
        self.next += 1;
        let n = MInode {
            kind,
            perm,
            uid: owner.0,
            gid: owner.1,
            xattrs: BTreeMap::new(),
            engine: ino,
        };
        self.inodes.insert(id, n);
        self.children_mut(d).insert(name, id);
        id
    }

    fn children(&self, d: u64) -> &BTreeMap<Vec<u8>, u64> {
        match &self.inodes[&d].kind {
            MKind::Dir(c) => c,
            _ => panic!("not a dir"),
        }
    }
    fn children_mut(&mut self, d: u64) -> &mut BTreeMap<Vec<u8>, u64> {
        match &mut self.inodes.get_mut(&d).expect("dir").kind {
            MKind::Dir(c) => c,
            _ => panic!("not a dir"),
        }
    }
    fn is_dir(&self, i: u64) -> bool {
        matches!(self.inodes[&i].kind, MKind::Dir(_))
    }
    fn dirs(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .inodes
            .keys()
            .copied()
            .filter(|&i| self.is_dir(i))
            .collect();
        v.sort();
        v
    }
    fn files(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .inodes
            .iter()
            .filter(|(_, n)| matches!(n.kind, MKind::File(_)))
            .map(|(i, _)| *i)
            .collect();
        v.sort();
        v
    }
    fn all(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inodes.keys().copied().collect();
        v.sort();
        v
    }
    /// Is `a` an ancestor of (or equal to) `d`?
    fn is_ancestor(&self, a: u64, d: u64) -> bool {
        if a == d {
            return true;
        }
        // Find the parent of d by search (the model keeps no parent pointers).
        let mut cur = d;
        loop {
            let p = self
                .inodes
                .iter()
                .find(|(_, n)| matches!(&n.kind, MKind::Dir(c) if c.values().any(|&x| x == cur) && self.is_dir(cur)))
                .map(|(i, _)| *i);
            match p {
                Some(p) if p == a => return true,
                Some(p) => cur = p,
                None => return false,
            }
        }
    }
    fn link_count(&self, i: u64) -> u64 {
        let names = self
            .inodes
            .values()
            .filter_map(|n| match &n.kind {
                MKind::Dir(c) => Some(c.values().filter(|&&x| x == i).count() as u64),
                _ => None,
            })
            .sum::<u64>();
        if self.is_dir(i) {
            let subdirs = self
                .children(i)
                .values()
                .filter(|&&c| self.is_dir(c))
                .count() as u64;
            2 + subdirs
        } else {
            names
        }
    }
    /// Drop an inode that lost its last name.
    fn gc(&mut self, i: u64) {
        if !self.is_dir(i) && self.link_count(i) == 0 {
            self.inodes.remove(&i);
        }
    }

    /// The tree in the testkit's form, with fields the model does not track zeroed.
    fn tree(&self) -> Tree {
        let mut t = Tree::new();
        let mut stack = vec![(Vec::new(), ROOT)];
        while let Some((path, i)) = stack.pop() {
            let n = &self.inodes[&i];
            let (kind, tbits, size, symlink, content, rdev) = match &n.kind {
                MKind::File(d) => (
                    Kind::File,
                    m::S_IFREG,
                    d.len() as u64,
                    None,
                    Some(ContentHasher::hash(d)),
                    None,
                ),
                MKind::Dir(c) => {
                    for (name, &ch) in c {
                        let mut p = path.clone();
                        if !p.is_empty() {
                            p.push(b'/');
                        }
                        p.extend_from_slice(name);
                        stack.push((p, ch));
                    }
                    (Kind::Dir, m::S_IFDIR, 0, None, None, None)
                }
                MKind::Symlink(s) => (
                    Kind::Symlink,
                    m::S_IFLNK,
                    s.len() as u64,
                    Some(s.clone()),
                    None,
                    None,
                ),
                MKind::Fifo => (Kind::Fifo, m::S_IFIFO, 0, None, None, None),
                MKind::Chr(a, b) => (Kind::CharDev, m::S_IFCHR, 0, None, None, Some((*a, *b))),
            };
            t.insert(
                path,
                Node {
                    kind,
                    mode: u32::from(tbits) | n.perm,
                    uid: n.uid,
                    gid: n.gid,
                    size,
                    nlink: self.link_count(i),
                    atime: (0, 0),
                    mtime: (0, 0),
                    ctime: (0, 0),
                    rdev,
                    symlink,
                    xattrs: n.xattrs.clone(),
                    content,
                    ino: 0,
                },
            );
        }
        t
    }
}

/// Zero what the model does not track: times, inode numbers, directory sizes;
/// lost+found (made by mkfs) is not in the model.
fn normalise(mut t: Tree) -> Tree {
    t.retain(|p, _| !p.starts_with(b"lost+found"));
    for n in t.values_mut() {
        n.atime = (0, 0);
        n.mtime = (0, 0);
        n.ctime = (0, 0);
        n.ino = 0;
        if n.kind == Kind::Dir {
            n.size = 0;
        }
    }
    // The root's link count includes lost+found.
    if let Some(r) = t.get_mut(&b""[..]) {
        r.nlink = 0;
    }
    t
}

struct Runner<'a> {
    fs: &'a Fs,
    m: Model,
    rng: Rng,
    log: Vec<String>,
    bs: u64,
}

impl Runner<'_> {
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.rng.below(v.len() as u64) as usize]
    }
    fn name(&mut self) -> Vec<u8> {
        self.pick(NAMES).as_bytes().to_vec()
    }
    fn eng(&self, i: u64) -> Ino {
        self.m.inodes[&i].engine
    }

    fn check(&self, what: String, want: Outcome, got: Outcome) {
        assert!(
            want == got,
            "{what}: model says {want:?}, rext4 gave {got:?}\nlog:\n{}",
            self.log.join("\n")
        );
    }

    fn step(&mut self) {
        let op = self.rng.below(100);
        let dirs = self.m.dirs();
        let d = self.pick(&dirs);
        let name = self.name();
        let exists = self.m.children(d).get(&name).copied();
        let dn = self.eng(d);
        let label = format!("{:?}", String::from_utf8_lossy(&name));
        match op {
            0..=14 => {
                // create a file
                let perm = 0o600 + self.rng.below(0o177) as u32;
                self.log.push(format!("create {d}/{label} {perm:o}"));
                let r =
                    self.fs
                        .mknod_ino(dn, &name, u32::from(m::S_IFREG) | perm, 1000, 1000, (0, 0));
                let want = if exists.is_some() {
                    Outcome::Err("EEXIST")
                } else {
                    Outcome::Ok
                };
                let got = outcome(r.as_ref().map(|_| ()).map_err(clone_err));
                self.check(format!("create {label}"), want, got);
                if let Ok(ino) = r {
                    self.m
                        .adopt(d, name, ino, MKind::File(Vec::new()), perm, (1000, 1000));
                }
            }
            15..=22 => {
                self.log.push(format!("mkdir {d}/{label}"));
                let r = self.fs.mkdir_ino(dn, &name, 0o755, 0, 0);
                let want = if exists.is_some() {
                    Outcome::Err("EEXIST")
                } else {
                    Outcome::Ok
                };
                self.check(
                    format!("mkdir {label}"),
                    want,
                    outcome(r.as_ref().map(|_| ()).map_err(clone_err)),
                );
                if let Ok(ino) = r {
                    self.m
                        .adopt(d, name, ino, MKind::Dir(BTreeMap::new()), 0o755, (0, 0));
                }
            }
            23..=40 => {
                // write into a random file
                let files = self.m.files();
                if files.is_empty() {
                    return;
                }
                let f = self.pick(&files);
                let size = match &self.m.inodes[&f].kind {
                    MKind::File(d) => d.len() as u64,
                    _ => 0,
                };
                let off = match self.rng.below(4) {
                    0 => size,
                    1 => self.rng.below(size + 1),
                    2 => self.rng.below(300_000),
                    _ => self.rng.below(size + 10_000),
                };
                let big = self.rng.below(10) == 0;
                let len = 1 + self.rng.below(if big { 200_000 } else { 9000 });
                let seed = self.rng.next_u64();
                let data: Vec<u8> = (0..len)
                    .map(|i| (seed.wrapping_add(i * 31) >> 3) as u8)
                    .collect();
                self.log.push(format!("write {f} off {off} len {len}"));
                let r = self.fs.write_ino_at(self.eng(f), &data, off);
                self.check(
                    format!("write {f}"),
                    Outcome::Ok,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if let MKind::File(c) = &mut self.m.inodes.get_mut(&f).expect("f").kind {
                    let end = (off + len) as usize;
                    if c.len() < end {
                        c.resize(end, 0);
                    }
                    c[off as usize..end].copy_from_slice(&data);
                }
            }
            41..=47 => {
                let files = self.m.files();
                if files.is_empty() {
                    return;
                }
                let f = self.pick(&files);
                let size = match &self.m.inodes[&f].kind {
                    MKind::File(d) => d.len() as u64,
                    _ => 0,
                };
                let new = match self.rng.below(3) {
                    0 => 0,
                    1 => self.rng.below(size + 1),
                    _ => self.rng.below(size + 50_000),
                };
                self.log.push(format!("truncate {f} {new}"));
                let r = self.fs.truncate_ino(self.eng(f), new);
                self.check(
                    format!("truncate {f}"),
                    Outcome::Ok,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if let MKind::File(c) = &mut self.m.inodes.get_mut(&f).expect("f").kind {
                    c.resize(new as usize, 0);
                }
            }
            48..=53 => {
                let files = self.m.files();
                if files.is_empty() {
                    return;
                }
                let f = self.pick(&files);
                let size = match &self.m.inodes[&f].kind {
                    MKind::File(d) => d.len() as u64,
                    _ => 0,
                };
                let mut off = self.rng.below(size + 20_000);
                let mut len = 1 + self.rng.below(40_000);
                let mode = match self.rng.below(6) {
                    0 => FallocMode::Allocate,
                    1 => FallocMode::KeepSize,
                    2 => FallocMode::PunchHole,
                    3 => FallocMode::ZeroRange {
                        keep_size: self.rng.below(2) == 0,
                    },
                    4 => FallocMode::CollapseRange,
                    _ => FallocMode::InsertRange,
                };
                let shift = matches!(mode, FallocMode::CollapseRange | FallocMode::InsertRange);
                if shift {
                    // Whole blocks (unaligned ones are refused; checked elsewhere).
                    off -= off % self.bs;
                    len = len.div_ceil(self.bs) * self.bs;
                }
                self.log.push(format!("fallocate {f} {mode:?} {off} {len}"));
                let r = self.fs.fallocate_ino(self.eng(f), mode, off, len);
                let want = match mode {
                    FallocMode::CollapseRange if off + len >= size => Outcome::Err("EINVAL"),
                    FallocMode::InsertRange if off >= size => Outcome::Err("EINVAL"),
                    _ => Outcome::Ok,
                };
                let ok = want == Outcome::Ok;
                self.check(
                    format!("fallocate {f}"),
                    want,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if let MKind::File(c) = &mut self.m.inodes.get_mut(&f).expect("f").kind {
                    let (o, l) = (off as usize, len as usize);
                    match mode {
                        FallocMode::CollapseRange if ok => {
                            c.drain(o..o + l);
                        }
                        FallocMode::InsertRange if ok => {
                            c.splice(o..o, std::iter::repeat_n(0, l));
                        }
                        _ => {}
                    }
                }
                if shift {
                    return;
                }
                if let MKind::File(c) = &mut self.m.inodes.get_mut(&f).expect("f").kind {
                    let end = (off + len) as usize;
                    let extend = matches!(
                        mode,
                        FallocMode::Allocate | FallocMode::ZeroRange { keep_size: false }
                    );
                    if extend && c.len() < end {
                        c.resize(end, 0);
                    }
                    if matches!(mode, FallocMode::PunchHole | FallocMode::ZeroRange { .. }) {
                        let e = end.min(c.len());
                        let s = (off as usize).min(e);
                        c[s..e].fill(0);
                    }
                }
            }
            54..=61 => {
                self.log.push(format!("unlink {d}/{label}"));
                let r = self.fs.unlink_ino(dn, &name);
                let want = match exists {
                    None => Outcome::Err("ENOENT"),
                    Some(i) if self.m.is_dir(i) => Outcome::Err("EISDIR"),
                    Some(_) => Outcome::Ok,
                };
                self.check(
                    format!("unlink {label}"),
                    want,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if let (Some(i), Outcome::Ok) = (exists, outcome::<()>(Ok(()))) {
                    if !self.m.is_dir(i) {
                        self.m.children_mut(d).remove(&name);
                        self.m.gc(i);
                    }
                }
            }
            62..=66 => {
                self.log.push(format!("rmdir {d}/{label}"));
                let r = self.fs.rmdir_ino(dn, &name);
                let want = match exists {
                    None => Outcome::Err("ENOENT"),
                    Some(i) if !self.m.is_dir(i) => Outcome::Err("ENOTDIR"),
                    Some(i) if !self.m.children(i).is_empty() => Outcome::Err("ENOTEMPTY"),
                    Some(_) => Outcome::Ok,
                };
                let ok = want == Outcome::Ok;
                self.check(
                    format!("rmdir {label}"),
                    want,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if ok {
                    let i = self.m.children_mut(d).remove(&name).expect("present");
                    self.m.inodes.remove(&i);
                }
            }
            67..=79 => self.rename(d, name, exists),
            80..=84 => {
                let files = self.m.files();
                if files.is_empty() {
                    return;
                }
                let f = self.pick(&files);
                self.log.push(format!("link {f} -> {d}/{label}"));
                let r = self.fs.link_ino(self.eng(f), dn, &name);
                let want = if exists.is_some() {
                    Outcome::Err("EEXIST")
                } else {
                    Outcome::Ok
                };
                let ok = want == Outcome::Ok;
                self.check(
                    format!("link {label}"),
                    want,
                    outcome(r.map_err(|e| clone_err(&e))),
                );
                if ok {
                    self.m.children_mut(d).insert(name, f);
                }
            }
            85..=88 => {
                let long = self.rng.below(2) == 0;
                let target: Vec<u8> = if long {
                    b"t/".repeat(40 + self.rng.below(100) as usize)
                } else {
                    b"target".to_vec()
                };
                self.log
                    .push(format!("symlink {d}/{label} len {}", target.len()));
                let r = self.fs.symlink_ino(dn, &name, &target, 0, 0);
                let want = if exists.is_some() {
                    Outcome::Err("EEXIST")
                } else {
                    Outcome::Ok
                };
                self.check(
                    format!("symlink {label}"),
                    want,
                    outcome(r.as_ref().map(|_| ()).map_err(clone_err)),
                );
                if let Ok(ino) = r {
                    let id = self
                        .m
                        .adopt(d, name, ino, MKind::Symlink(target), 0o777, (0, 0));
                    self.log.push(format!("  = model {id} ino {}", ino.0));
                }
            }
            89..=90 => {
                let fifo = self.rng.below(2) == 0;
                let (mode, kind) = if fifo {
                    (u32::from(m::S_IFIFO) | 0o644, MKind::Fifo)
                } else {
                    (u32::from(m::S_IFCHR) | 0o644, MKind::Chr(300, 70_000))
                };
                self.log.push(format!("mknod {d}/{label} {mode:o}"));
                let r = self.fs.mknod_ino(dn, &name, mode, 0, 0, (300, 70_000));
                let want = if exists.is_some() {
                    Outcome::Err("EEXIST")
                } else {
                    Outcome::Ok
                };
                self.check(
                    format!("mknod {label}"),
                    want,
                    outcome(r.as_ref().map(|_| ()).map_err(clone_err)),
                );
                if let Ok(ino) = r {
                    self.m.adopt(d, name, ino, kind, 0o644, (0, 0));
                }
            }
            91..=94 => {
                let all = self.m.all();
                let i = self.pick(&all);
                let perm = self.rng.below(0o7777) as u32;
                let owner = self.rng.below(3) as u32 * 50_000;
                self.log.push(format!("setattr {i} {perm:o} {owner}"));
                let a = SetAttr {
                    mode: Some(perm),
                    uid: Some(owner),
                    gid: Some(owner + 1),
                    ..SetAttr::default()
                };
                let r = self.fs.setattr_ino(self.eng(i), &a);
                self.check(
                    format!("setattr {i}"),
                    Outcome::Ok,
                    outcome(r.map(|_| ()).map_err(|e| clone_err(&e))),
                );
                let n = self.m.inodes.get_mut(&i).expect("i");
                n.perm = perm;
                n.uid = owner;
                n.gid = owner + 1;
            }
            _ => {
                let all = self.m.all();
                let i = self.pick(&all);
                let key = format!("user.k{}", self.rng.below(3)).into_bytes();
                let present = self.m.inodes[&i].xattrs.contains_key(&key);
                let allowed = matches!(self.m.inodes[&i].kind, MKind::File(_) | MKind::Dir(_));
                if self.rng.below(3) == 0 {
                    self.log.push(format!(
                        "removexattr {i} {:?}",
                        String::from_utf8_lossy(&key)
                    ));
                    let r = self.fs.remove_xattr_ino(self.eng(i), &key);
                    let want = if !allowed {
                        Outcome::Err("EPERM")
                    } else if present {
                        Outcome::Ok
                    } else {
                        Outcome::Err("ENOENT")
                    };
                    self.check(
                        format!("removexattr {i}"),
                        want,
                        outcome(r.map_err(|e| clone_err(&e))),
                    );
                    self.m.inodes.get_mut(&i).expect("i").xattrs.remove(&key);
                } else {
                    let len = self.rng.below(200) as usize;
                    let v: Vec<u8> = (0..len).map(|x| (x as u8).wrapping_mul(13)).collect();
                    self.log.push(format!(
                        "setxattr {i} {:?} {len}",
                        String::from_utf8_lossy(&key)
                    ));
                    let r = self
                        .fs
                        .set_xattr_ino(self.eng(i), &key, &v, XattrFlags::default());
                    let want = if allowed {
                        Outcome::Ok
                    } else {
                        Outcome::Err("EPERM")
                    };
                    self.check(
                        format!("setxattr {i}"),
                        want,
                        outcome(r.map_err(|e| clone_err(&e))),
                    );
                    if allowed {
                        self.m.inodes.get_mut(&i).expect("i").xattrs.insert(key, v);
                    }
                }
            }
        }
    }

    fn rename(&mut self, d1: u64, n1: Vec<u8>, src: Option<u64>) {
        let dirs = self.m.dirs();
        let d2 = self.pick(&dirs);
        let n2 = self.name();
        let dst = self.m.children(d2).get(&n2).copied();
        let fl = match self.rng.below(6) {
            0 => RenameFlags {
                noreplace: true,
                ..RenameFlags::default()
            },
            1 => RenameFlags {
                exchange: true,
                ..RenameFlags::default()
            },
            _ => RenameFlags::default(),
        };
        self.log.push(format!(
            "rename {d1}/{:?} -> {d2}/{:?} {fl:?}",
            String::from_utf8_lossy(&n1),
            String::from_utf8_lossy(&n2)
        ));
        let r = self.fs.rename_ino(self.eng(d1), &n1, self.eng(d2), &n2, fl);
        let want = (|| {
            let Some(s) = src else {
                return Outcome::Err("ENOENT");
            };
            if fl.exchange && dst.is_none() {
                return Outcome::Err("ENOENT");
            }
            if fl.noreplace && dst.is_some() {
                return Outcome::Err("EEXIST");
            }
            if self.m.is_dir(s) && self.m.is_ancestor(s, d2) {
                return Outcome::Err("EINVAL");
            }
            if let Some(t) = dst {
                if t == s {
                    return Outcome::Ok;
                }
                if fl.exchange {
                    if self.m.is_dir(t) && self.m.is_ancestor(t, d1) {
                        return Outcome::Err("EINVAL");
                    }
                    return Outcome::Ok;
                }
                match (self.m.is_dir(s), self.m.is_dir(t)) {
                    (true, false) => return Outcome::Err("ENOTDIR"),
                    (false, true) => return Outcome::Err("EISDIR"),
                    (true, true) if !self.m.children(t).is_empty() => {
                        return Outcome::Err("ENOTEMPTY")
                    }
                    _ => {}
                }
            }
            Outcome::Ok
        })();
        let ok = want == Outcome::Ok;
        self.check("rename".into(), want, outcome(r.map_err(|e| clone_err(&e))));
        if !ok {
            return;
        }
        let s = src.expect("src");
        if dst == Some(s) {
            return;
        }
        if fl.exchange {
            let t = dst.expect("dst");
            self.m.children_mut(d1).insert(n1, t);
            self.m.children_mut(d2).insert(n2, s);
            return;
        }
        self.m.children_mut(d1).remove(&n1);
        if let Some(t) = self.m.children_mut(d2).insert(n2, s) {
            if self.m.is_dir(t) {
                self.m.inodes.remove(&t);
            } else {
                self.m.gc(t);
            }
        }
    }
}

fn clone_err(e: &Error) -> Error {
    match e {
        Error::NotFound => Error::NotFound,
        Error::Exists => Error::Exists,
        Error::NotADirectory => Error::NotADirectory,
        Error::IsADirectory => Error::IsADirectory,
        Error::NotEmpty => Error::NotEmpty,
        Error::InvalidInput(s) => Error::InvalidInput(s.clone()),
        Error::NoSpace => Error::NoSpace,
        Error::TooManyLinks => Error::TooManyLinks,
        Error::NotPermitted(s) => Error::NotPermitted(s.clone()),
        other => panic!("unexpected engine error: {other}"),
    }
}

fn run_seed(seed: u64, ops: usize, bs: u32) {
    let img = mkfs(&MkfsOptions::new(bs, 64 << 20).upstream(seed % 2 == 1)).expect("mkfs");
    let fs = Fs::open_with(
        img.path(),
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("open");
    let mut r = Runner {
        fs: &fs,
        m: Model::new(),
        rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        log: Vec::new(),
        bs: u64::from(bs),
    };
    for _ in 0..ops {
        r.step();
    }
    let want = normalise(r.m.tree());
    eprintln!(
        "seed {seed} ({bs}): {ops} ops, {} paths in the model",
        want.len()
    );
    let ours = normalise(common::snapshot(&fs).expect("walk"));
    let d = diff_trees(&want, &ours, &Compare::exact());
    assert!(
        d.is_empty(),
        "seed {seed}: model vs rext4:\n{}\nlog:\n{}",
        d.join("\n"),
        r.log.join("\n")
    );
    // The groups' and superblock's counts equal what the bitmaps and inode table
    // hold, while open (between operations) and after reopening.
    let counts = fs.check_counts().expect("counts");
    assert!(
        counts.is_empty(),
        "seed {seed}: counts:\n{}\nlog:\n{}",
        counts.join("\n"),
        r.log.join("\n")
    );
    fs.close().expect("close");
    let fsck = e2fsck_fn(img.path());
    assert!(
        fsck.clean,
        "seed {seed}: e2fsck:\n{}\nlog:\n{}",
        fsck.output,
        r.log.join("\n")
    );
    // What close() left on the image, read back by rext4 (page cache written back,
    // sizes raised): the same tree.
    let log = std::mem::take(&mut r.log);
    drop(r);
    drop(fs);
    let again = Fs::open(img.path()).expect("reopen");
    let counts = again.check_counts().expect("counts");
    assert!(
        counts.is_empty(),
        "seed {seed}: counts after reopen:\n{}",
        counts.join("\n")
    );
    let reread = normalise(common::snapshot(&again).expect("walk"));
    let d = diff_trees(&want, &reread, &Compare::exact());
    assert!(
        d.is_empty(),
        "seed {seed}: model vs rext4 after close and reopen:\n{}\nlog:\n{}",
        d.join("\n"),
        log.join("\n")
    );
    drop(again);

    let mnt = match LoopMount::new(img.path(), false, "") {
        Ok(mnt) => mnt,
        Err(e) => return skip(&format!("seed {seed}: kernel half: {e}")),
    };
    let kernel = normalise(snapshot_dir(mnt.path()).expect("kernel snapshot"));
    let d = diff_trees(&want, &kernel, &Compare::exact());
    assert!(
        d.is_empty(),
        "seed {seed}: model vs kernel:\n{}",
        d.join("\n")
    );
    // The kernel keeps writing to what rext4 wrote.
    std::fs::write(mnt.path().join("kernel-was-here"), b"written by the kernel")
        .expect("kernel write");
    std::fs::create_dir_all(mnt.path().join("kdir/sub")).expect("kernel mkdir");
    for i in 0..50 {
        std::fs::write(
            mnt.path().join(format!("kdir/sub/f{i}")),
            vec![i as u8; 3000],
        )
        .expect("kernel write");
    }
    mnt.unmount().expect("unmount");
    let fsck = e2fsck_fn(img.path());
    assert!(
        fsck.clean,
        "seed {seed}: e2fsck after the kernel wrote:\n{}",
        fsck.output
    );
    let fs = Fs::open_with(
        img.path(),
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("reopen");
    assert_eq!(
        fs.read("/kernel-was-here").expect("read"),
        b"written by the kernel"
    );
    assert_eq!(fs.read("/kdir/sub/f7").expect("read"), vec![7u8; 3000]);
    fs.write("/after-kernel", b"rext4 again")
        .expect("write after kernel");
    fs.remove_dir_all("/kdir").expect("remove kernel tree");
    fs.close().expect("close");
    let fsck = e2fsck_fn(img.path());
    assert!(
        fsck.clean,
        "seed {seed}: e2fsck after rext4 wrote again:\n{}",
        fsck.output
    );
}

fn env_or(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

#[test]
fn model_many_seeds_1k() {
    let seeds = env_or("REXT4_MODEL_SEEDS", 40);
    let ops = env_or("REXT4_MODEL_OPS", 600) as usize;
    for seed in 0..seeds / 2 {
        run_seed(seed, ops, 1024);
    }
}

#[test]
fn model_many_seeds_4k() {
    let seeds = env_or("REXT4_MODEL_SEEDS", 40);
    let ops = env_or("REXT4_MODEL_OPS", 600) as usize;
    for seed in seeds / 2..seeds {
        run_seed(seed, ops, 4096);
    }
}

#[test]
fn model_long_sequence() {
    run_seed(1000, 3000, 4096);
}
