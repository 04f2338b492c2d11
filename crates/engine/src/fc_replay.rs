//! Fast-commit replay: applying the records of a journal's fast-commit area (found by
//! `rext4_jbd2::recover`, format in `rext4_format::fast_commit`) to an open
//! read-write filesystem, as the kernel's `ext4_fc_replay` and e2fsck's do, with one
//! difference: everything is made in one transaction of rext4's journal, checked to
//! fit before it commits, so a crash during the replay leaves the fast commits to be
//! replayed again (recovery left the log needing them; see `rext4_jbd2::recover`).
//!
//! Owns: `Fs::replay_fast_commits`, called by `Fs::open_device` on a read-write open
//! made for it right after the journal is loaded, before orphans are finished.
//!
//! What each record does (in log order):
//! - INODE: the inode's record becomes the logged one, except `i_block` (the extent
//!   tree stays the filesystem's; a fast symlink's, a device's or inline data's is
//!   taken) and the checksum. A new generation, or an inode free before, means a new
//!   file in that slot: the old mapping is dropped first.
//! - ADD_RANGE / DEL_RANGE: the logical range maps to the logged blocks (what it
//!   mapped before is released) / is unmapped, in the inode's extent tree.
//! - CREAT / LINK / UNLINK: the entry is added (a directory created gets its "." and
//!   ".." block and its parent a link; an existing entry of the name for another inode
//!   is replaced, as e2fsck does) / removed when it names that inode; link counts
//!   follow as the kernel keeps them (an INODE record later sets the logged count).
//! - HEAD, PAD, TAIL: nothing.
//!
//! Then the bitmaps, as the kernel's `ext4_fc_set_bitmaps_and_counters`: blocks the
//! records mapped become used, blocks they released and nothing maps any more become
//! free, i_blocks is counted again; inodes left with links become used, inodes left
//! without are freed (or, when an orphan list names them, left to `process_orphans`).
//! While replaying, the blocks the records map are kept from the allocator (as the
//! kernel's "excluded regions"), so a directory or tree block is never put there.
//!
//! Must hold: every record is checked before anything changes (inode numbers, block
//! ranges inside the filesystem and outside its own metadata, names); a record that
//! fails is corruption, reported, and nothing is committed. Locks: the write lock for
//! the whole replay (the filesystem is not yet in use).

use std::collections::{BTreeMap, BTreeSet};

use rext4_format::dir::FileType;
use rext4_format::extent::Extent;
use rext4_format::fast_commit::Tag;
use rext4_format::inode::{flags, mode, Inode};

use crate::dir_write;
use crate::error::{Error, Result};
use crate::extent_write::ExtentTree;
use crate::fs::inode_write::{FsBlocks, FsDir};
use crate::fs::{Fs, Ino};
use crate::store::{BlockStore, DirStore, MAX_LOGICAL};

/// What a fast-commit replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FcReplay {
    /// Records applied (HEAD, PAD and TAIL included).
    pub records: usize,
    /// Inodes whose record or mapping changed.
    pub inodes: usize,
    /// Directory entries added and removed.
    pub entries_added: usize,
    pub entries_removed: usize,
}

/// Byte offsets in an inode record.
const I_BLOCK: usize = 0x28;
const I_GENERATION: usize = 0x64;
const I_FLAGS: usize = 0x20;
const EXTENT_MAGIC: [u8; 2] = [0x0A, 0xF3];

/// A [`BlockStore`] that frees nothing: blocks an extent tree lets go of (data and tree
/// blocks) are noted, to be freed at the end unless something maps them again.
struct Noting<'a, 'b> {
    inner: FsBlocks<'a>,
    released: &'b mut Vec<(u64, u64)>,
}

impl BlockStore for Noting<'_, '_> {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
        self.inner.read_meta(blk)
    }
    fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
        self.inner.write_meta(blk, data)
    }
    fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
        self.inner.alloc(goal, max_len)
    }
    fn free(&mut self, start: u64, len: u64) -> Result<()> {
        self.released.push((start, len));
        Ok(())
    }
}

/// An inode the replay touched.
#[derive(Debug, Clone, Copy)]
struct Touched {
    /// In use (its bitmap bit) before the replay, and a directory then.
    was_used: bool,
    was_dir: bool,
    /// Generation of the file its mapping belongs to; `None`: whichever the next
    /// INODE record brings (a slot that was free).
    generation: Option<u32>,
}

struct Replay<'a> {
    fs: &'a Fs,
    touched: BTreeMap<u32, Touched>,
    released: Vec<(u64, u64)>,
    /// Blocks ADD_RANGE records map.
    added: Vec<(u64, u64)>,
    /// Directories whose subdirectories changed: their link counts are counted again
    /// at the end (an INODE record may or may not have come after the change).
    recount: BTreeSet<u32>,
    report: FcReplay,
}

/// `[start, start+len)` runs, sorted and merged.
fn merged(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, n) in v {
        match out.last_mut() {
            Some(l) if s <= l.0 + l.1 => l.1 = l.1.max(s + n - l.0),
            _ => out.push((s, n)),
        }
    }
    out
}

/// The parts of `run` inside (`want_in`) or outside the merged runs `set`.
fn split_by(run: (u64, u64), set: &[(u64, u64)], want_in: bool) -> Vec<(u64, u64)> {
    let (mut cur, end) = (run.0, run.0 + run.1);
    let mut out = Vec::new();
    let i = set.partition_point(|&(s, n)| s + n <= cur);
    for &(s, n) in &set[i..] {
        if cur >= end || s >= end {
            break;
        }
        if s > cur && !want_in {
            out.push((cur, s - cur));
        }
        let (a, b) = (s.max(cur), (s + n).min(end));
        if a < b && want_in {
            out.push((a, b - a));
        }
        cur = cur.max(s + n);
    }
    if cur < end && !want_in {
        out.push((cur, end - cur));
    }
    out
}

fn bad(what: String) -> Error {
    Error::corrupted(format!("fast commit: {what}"), None)
}

impl Fs {
    /// Apply the fast-commit records `tags` (see the module note). The caller commits
    /// afterwards; an error leaves nothing to commit that the replay made (the
    /// filesystem shuts down if it had changed anything).
    pub(crate) fn replay_fast_commits(&self, tags: &[Tag]) -> Result<FcReplay> {
        let w = self.write_lock();
        self.check_writable()?;
        if self.cluster_bits() > 0 && !tags.is_empty() {
            // Its bitmap settling works block by block; a cluster two extents share
            // would be freed under one of them.
            return Err(Error::Unsupported(
                "fast-commit replay on a bigalloc image: replay it with e2fsck first".into(),
            ));
        }
        self.check_fast_commits(tags)?;
        let mut r = Replay {
            fs: self,
            touched: BTreeMap::new(),
            released: Vec::new(),
            added: Vec::new(),
            recount: BTreeSet::new(),
            report: FcReplay::default(),
        };
        // The blocks the records map: not for this replay's own allocations.
        for t in tags {
            if let Tag::AddRange { ext, .. } = t {
                if ext.len > 0 {
                    r.added.push((ext.physical, u64::from(ext.len)));
                }
            }
        }
        r.added = merged(std::mem::take(&mut r.added));
        {
            let mut busy = self.inner.busy();
            for &(s, n) in &r.added {
                busy.add(s, n);
            }
        }
        let done = r.run(tags);
        {
            let mut busy = self.inner.busy();
            let runs: BTreeMap<u64, u64> = r.added.iter().copied().collect();
            busy.remove_runs(&runs);
        }
        let done = done.and_then(|()| r.settle());
        if let Err(e) = &done {
            // Nothing of it may be committed (by a close, say): the fast commits stay
            // in the journal for the next recovery.
            self.inner
                .shut_down(format!("a fast-commit replay failed halfway: {e}"));
        }
        done?;
        if !self.dirty_fits_one_transaction() {
            self.inner
                .shut_down("a fast-commit replay is larger than one journal transaction".into());
            return Err(Error::Unsupported(
                "the fast commits to replay change more blocks than one journal transaction \
                 holds; `e2fsck -fy` replays them"
                    .into(),
            ));
        }
        drop(w);
        Ok(r.report)
    }

    /// Every record checked before anything changes.
    fn check_fast_commits(&self, tags: &[Tag]) -> Result<()> {
        let sb = &self.inner.sb;
        let ino_ok = |ino: u32| ino >= sb.first_ino && ino <= sb.inodes_count;
        let dir_ok =
            |ino: u32| ino == fmt_root() || (ino >= sb.first_ino && ino <= sb.inodes_count);
        let name_ok = |n: &[u8]| {
            !n.is_empty()
                && n.len() <= rext4_format::dir::NAME_MAX
                && n != b"."
                && n != b".."
                && !n.contains(&b'/')
                && !n.contains(&0)
        };
        for (i, t) in tags.iter().enumerate() {
            let what = |w: &str| bad(format!("record {i} ({}): {w}", t.name()));
            match t {
                Tag::AddRange { ino, ext } => {
                    if !ino_ok(*ino) {
                        return Err(what(&format!("inode {ino} out of range")));
                    }
                    if ext.end() > MAX_LOGICAL {
                        return Err(what("the range passes logical block 2^32"));
                    }
                    let (p, n) = (ext.physical, u64::from(ext.len));
                    if n > 0
                        && (p < u64::from(sb.first_data_block)
                            || p.checked_add(n).is_none_or(|e| e > sb.blocks_count))
                    {
                        return Err(what(&format!("blocks {p}+{n} are outside the filesystem")));
                    }
                    if n > 0 && self.in_system_zone(p, n) {
                        return Err(what(&format!(
                            "blocks {p}+{n} are the filesystem's own metadata"
                        )));
                    }
                }
                Tag::DelRange { ino, .. } if !ino_ok(*ino) => {
                    return Err(what(&format!("inode {ino} out of range")));
                }
                Tag::Creat { parent, ino, name }
                | Tag::Link { parent, ino, name }
                | Tag::Unlink { parent, ino, name } => {
                    if !dir_ok(*parent) || !ino_ok(*ino) {
                        return Err(what(&format!(
                            "inode {ino} in directory {parent}: out of range"
                        )));
                    }
                    if !name_ok(name) {
                        return Err(what(&format!(
                            "name {:?} is not a file name",
                            String::from_utf8_lossy(name)
                        )));
                    }
                }
                Tag::Inode { ino, raw } => {
                    if !ino_ok(*ino) {
                        return Err(what(&format!("inode {ino} out of range")));
                    }
                    let isz = usize::from(sb.inode_size);
                    let extra = raw
                        .get(0x80..0x82)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]));
                    let fits = match extra {
                        None => raw.len() == 128,
                        Some(e) => {
                            isz > 128 && usize::from(e) >= 4 && 128 + usize::from(e) <= raw.len()
                        }
                    };
                    if raw.len() > isz || !fits {
                        return Err(what(&format!(
                            "a record of {} bytes for {isz}-byte inodes",
                            raw.len()
                        )));
                    }
                    Inode::decode(&padded(raw, isz)).map_err(|e| what(&e.to_string()))?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether everything dirty now fits one journal transaction.
    fn dirty_fits_one_transaction(&self) -> bool {
        let max = self
            .inner
            .max_txn
            .load(std::sync::atomic::Ordering::Relaxed);
        max == 0 || self.cache().dirty_count() + self.inner.sb.desc_blocks() as usize + 2 <= max
    }
}

fn fmt_root() -> u32 {
    rext4_format::inode::ROOT_INO
}

/// `raw` as a whole record of `isz` bytes (zeros after it).
fn padded(raw: &[u8], isz: usize) -> Vec<u8> {
    let mut v = vec![0u8; isz.max(raw.len())];
    v[..raw.len()].copy_from_slice(raw);
    v
}

/// Whether `inode`'s i_block holds an extent tree of the inode (regular files and
/// directories with EXTENTS_FL, slow symlinks with it).
fn has_tree(inode: &Inode) -> bool {
    inode.has_flag(flags::EXTENTS) && !inode.has_flag(flags::INLINE_DATA)
}

impl<'a> Replay<'a> {
    fn run(&mut self, tags: &[Tag]) -> Result<()> {
        for t in tags {
            self.report.records += 1;
            match t {
                Tag::Inode { ino, raw } => self.inode(Ino(*ino), raw)?,
                Tag::AddRange { ino, ext } => self.add_range(Ino(*ino), ext)?,
                Tag::DelRange { ino, lblk, len } => self.del_range(Ino(*ino), *lblk, *len)?,
                Tag::Creat { parent, ino, name } => {
                    self.link(Ino(*parent), Ino(*ino), name, true)?
                }
                Tag::Link { parent, ino, name } => {
                    self.link(Ino(*parent), Ino(*ino), name, false)?
                }
                Tag::Unlink { parent, ino, name } => self.unlink(Ino(*parent), Ino(*ino), name)?,
                Tag::Head { .. } | Tag::Pad { .. } | Tag::Tail { .. } => {}
            }
        }
        Ok(())
    }

    /// The record of a slot the replay has not seen yet is noted; a free slot's stale
    /// record is replaced by an empty one (no mapping to walk).
    fn touch(&mut self, ino: Ino) -> Result<Touched> {
        if let Some(t) = self.touched.get(&ino.0) {
            return Ok(*t);
        }
        let fs = self.fs;
        let was_used = fs.inode_in_use(ino)?;
        let t = if was_used {
            let inode = fs.read_inode(ino)?;
            Touched {
                was_used,
                was_dir: inode.is_dir(),
                generation: Some(inode.generation),
            }
        } else {
            let mut blank = fs.new_inode(0, 0, 0);
            blank.links_count = 0;
            blank.atime = Default::default();
            blank.mtime = Default::default();
            blank.ctime = Default::default();
            blank.crtime = None;
            blank.generation = 0;
            fs.map_by_extents(&mut blank);
            fs.write_new_inode(ino, &blank)?;
            Touched {
                was_used,
                was_dir: false,
                generation: None,
            }
        };
        self.touched.insert(ino.0, t);
        Ok(t)
    }

    /// Run `f` on `ino`'s extent tree, noting what it lets go of; the inode is written.
    fn with_tree<R>(
        &mut self,
        ino: Ino,
        inode: &mut Inode,
        f: impl FnOnce(&mut ExtentTree<'_, Noting<'_, '_>>) -> Result<R>,
    ) -> Result<R> {
        let fs = self.fs;
        let seed = fs.owned_seed(ino, inode);
        let mut store = Noting {
            inner: FsBlocks {
                fs,
                seed,
                clusters: Default::default(),
            },
            released: &mut self.released,
        };
        let mut blocks = inode.blocks_raw;
        let mut root = inode.block;
        let r = {
            let mut t = ExtentTree::new(&mut store, &mut root, seed, &mut blocks);
            f(&mut t)
        };
        inode.block = root;
        inode.blocks_raw = blocks;
        fs.write_inode(ino, inode)?;
        r
    }

    /// The tree of `ino` for a change of its mapping.
    fn tree_inode(&mut self, ino: Ino, what: &str) -> Result<Inode> {
        self.touch(ino)?;
        let inode = self.fs.read_inode(ino)?;
        if inode.is_dir() {
            // The kernel logs the blocks of regular files only: directory blocks go
            // through full commits.
            return Err(bad(format!("{what} of directory {}", ino.0)));
        }
        if !has_tree(&inode) {
            return Err(bad(format!(
                "{what} of inode {}, which has no extent tree",
                ino.0
            )));
        }
        Ok(inode)
    }

    fn inode(&mut self, ino: Ino, raw: &[u8]) -> Result<()> {
        let fs = self.fs;
        let t = self.touch(ino)?;
        let isz = usize::from(fs.inner.sb.inode_size);
        let (cur, _) = fs.inode_bytes(ino)?;
        let old = Inode::decode(&cur)?;
        let new_gen = u32::from_le_bytes([
            raw[I_GENERATION],
            raw[I_GENERATION + 1],
            raw[I_GENERATION + 2],
            raw[I_GENERATION + 3],
        ]);
        let mut base = cur.clone();
        if t.generation.is_some_and(|g| g != new_gen) {
            // Another file in this slot: the old one's blocks and xattrs go.
            let mut o = old.clone();
            if has_tree(&o) {
                self.with_tree(ino, &mut o, |t| t.remove(0, MAX_LOGICAL).map(|_| ()))?;
            }
            let new_acl = u32::from_le_bytes([raw[0x68], raw[0x69], raw[0x6A], raw[0x6B]]);
            if o.file_acl != 0 && o.file_acl != u64::from(new_acl) {
                fs.release_xattr_block(&mut o)?;
                fs.write_inode(ino, &o)?;
            }
            base = fs.inode_bytes(ino)?.0;
            base[I_BLOCK..I_GENERATION].fill(0);
            // The in-inode xattrs were the old file's.
            if isz > raw.len() {
                base[raw.len()..].fill(0);
            }
            crate::extent_write::init_empty(
                (&mut base[I_BLOCK..I_GENERATION])
                    .try_into()
                    .map_err(|_| bad("inode record too short".into()))?,
            );
        }
        let mut rec = base;
        rec[..I_BLOCK].copy_from_slice(&raw[..I_BLOCK]);
        rec[I_GENERATION..raw.len()].copy_from_slice(&raw[I_GENERATION..]);
        let fl = u32::from_le_bytes([
            raw[I_FLAGS],
            raw[I_FLAGS + 1],
            raw[I_FLAGS + 2],
            raw[I_FLAGS + 3],
        ]);
        let ftype = u16::from_le_bytes([raw[0], raw[1]]) & mode::S_IFMT;
        if fl & flags::INLINE_DATA != 0 {
            rec[I_BLOCK..I_GENERATION].copy_from_slice(&raw[I_BLOCK..I_GENERATION]);
        } else if fl & flags::EXTENTS != 0 {
            if rec[I_BLOCK..I_BLOCK + 2] != EXTENT_MAGIC {
                let mut root = [0u8; 60];
                crate::extent_write::init_empty(&mut root);
                rec[I_BLOCK..I_GENERATION].copy_from_slice(&root);
            }
        } else if ftype == mode::S_IFREG || ftype == mode::S_IFDIR {
            return Err(Error::Unsupported(format!(
                "fast commit of inode {}, a block-mapped file; `e2fsck -fy` replays it",
                ino.0
            )));
        } else {
            // A fast symlink's target or a device's number.
            rec[I_BLOCK..I_GENERATION].copy_from_slice(&raw[I_BLOCK..I_GENERATION]);
        }
        let inode = Inode::decode(&rec)?;
        fs.write_inode_raw(ino, &rec, &inode)?;
        if let Some(t) = self.touched.get_mut(&ino.0) {
            t.generation = Some(inode.generation);
        }
        Ok(())
    }

    fn add_range(&mut self, ino: Ino, ext: &Extent) -> Result<()> {
        if ext.len == 0 {
            return Ok(());
        }
        let mut inode = self.tree_inode(ino, "ADD_RANGE")?;
        let e = *ext;
        self.with_tree(ino, &mut inode, |t| {
            t.remove(e.logical, e.end())?;
            t.insert(e)
        })
    }

    fn del_range(&mut self, ino: Ino, lblk: u32, len: u32) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let end = (u64::from(lblk) + u64::from(len)).min(MAX_LOGICAL);
        let mut inode = self.tree_inode(ino, "DEL_RANGE")?;
        self.with_tree(ino, &mut inode, |t| t.remove(lblk, end).map(|_| ()))
    }

    /// A directory of the replay: in use, a directory; `None` otherwise (the kernel
    /// skips records naming a directory it cannot find).
    fn dir(&mut self, ino: Ino) -> Result<Option<FsDir<'a>>> {
        let fs = self.fs;
        if ino.0 != fmt_root() {
            self.touch(ino)?;
        }
        let inode = fs.read_inode(ino)?;
        if !inode.is_dir() || inode.links_count == 0 {
            return Ok(None);
        }
        Ok(Some(FsDir {
            fs,
            ino,
            inode,
            dirty: false,
        }))
    }

    fn link(&mut self, parent: Ino, ino: Ino, name: &[u8], create: bool) -> Result<()> {
        let fs = self.fs;
        self.touch(ino)?;
        let mut child = fs.read_inode(ino)?;
        let ft = FileType::from_mode(child.mode);
        if child.mode & mode::S_IFMT == 0 || matches!(ft, FileType::Unknown) {
            if create {
                return Err(bad(format!(
                    "CREAT of inode {}, which no INODE record described",
                    ino.0
                )));
            }
            return Ok(());
        }
        if !create && child.links_count == 0 {
            // The kernel finds no such inode and skips the record.
            return Ok(());
        }
        let Some(mut d) = self.dir(parent)? else {
            return Ok(());
        };
        match dir_write::lookup(&d, name)? {
            Some((x, _)) if x == ino.0 => return Ok(()),
            Some((other, _)) => {
                // As e2fsck: the name now names this inode.
                dir_write::remove_entry(&mut d, name)?;
                fs.write_inode(d.ino, &d.inode)?;
                self.report.entries_removed += 1;
                self.drop_link(Ino(other), &mut d)?;
            }
            None => {}
        }
        if create && child.is_dir() {
            self.init_dir(ino, &mut child, parent)?;
        }
        let dir_index = fs
            .inner
            .sb
            .has_compat(rext4_format::superblock::feature::COMPAT_DIR_INDEX);
        dir_write::add_new_entry(&mut d, name, ino.0, ft, dir_index)?;
        self.report.entries_added += 1;
        if d.dirty {
            fs.write_inode(d.ino, &d.inode)?;
        }
        let mut child = fs.read_inode(ino)?;
        if child.is_dir() {
            self.recount.insert(parent.0);
            self.recount.insert(ino.0);
            child.links_count = child.links_count.max(2);
        } else if create {
            child.links_count = 1;
        } else {
            child.links_count = child.links_count.saturating_add(1);
        }
        fs.write_inode(ino, &child)
    }

    /// A directory created by the replay gets its first block ("." and "..") unless
    /// it has blocks already.
    fn init_dir(&mut self, ino: Ino, inode: &mut Inode, parent: Ino) -> Result<()> {
        let fs = self.fs;
        if !has_tree(inode) {
            return Err(bad(format!("directory {} has no extent tree", ino.0)));
        }
        let bs = u64::from(fs.inner.block_size);
        let mapped = {
            let seed = fs.owned_seed(ino, inode);
            let mut store = FsBlocks {
                fs,
                seed,
                clusters: Default::default(),
            };
            let mut root = inode.block;
            let mut blocks = inode.blocks_raw;
            let t = ExtentTree::new(&mut store, &mut root, seed, &mut blocks);
            !t.extents()?.is_empty()
        };
        if mapped {
            return Ok(());
        }
        inode.size = 0;
        let mut nd = FsDir {
            fs,
            ino,
            inode: inode.clone(),
            dirty: true,
        };
        DirStore::append_block(&mut nd)?;
        dir_write::init_dir(&mut nd, ino.0, parent.0)?;
        *inode = nd.inode;
        debug_assert_eq!(inode.size, bs);
        fs.write_inode(ino, inode)
    }

    /// One entry naming `ino` went (from directory `d`, written already).
    fn drop_link(&mut self, ino: Ino, d: &mut FsDir<'_>) -> Result<()> {
        let fs = self.fs;
        self.touch(ino)?;
        let mut inode = fs.read_inode(ino)?;
        if inode.is_dir() {
            inode.links_count = 0;
            self.recount.insert(d.ino.0);
        } else {
            inode.links_count = inode.links_count.saturating_sub(1);
        }
        fs.write_inode(ino, &inode)
    }

    fn unlink(&mut self, parent: Ino, ino: Ino, name: &[u8]) -> Result<()> {
        let fs = self.fs;
        let Some(mut d) = self.dir(parent)? else {
            return Ok(());
        };
        match dir_write::lookup(&d, name)? {
            Some((x, _)) if x == ino.0 => {
                dir_write::remove_entry(&mut d, name)?;
                fs.write_inode(d.ino, &d.inode)?;
                self.report.entries_removed += 1;
                self.drop_link(ino, &mut d)
            }
            // Renamed over, or gone already: as e2fsck, nothing.
            _ => Ok(()),
        }
    }

    /// Bitmaps, counts and i_blocks after the records (see the module note).
    fn settle(&mut self) -> Result<()> {
        let fs = self.fs;
        let listed = fs.orphans_listed()?;
        let bs = u64::from(fs.inner.block_size);
        // Directory link counts: 2 and one per subdirectory (dir_nlink: 1 past the
        // limit).
        for &n in &self.recount {
            let ino = Ino(n);
            let mut inode = fs.read_inode(ino)?;
            if !inode.is_dir() || inode.links_count == 0 {
                continue;
            }
            let subdirs = fs
                .read_dir_ino(ino)?
                .iter()
                .filter(|e| e.file_type == crate::FileType::Dir)
                .count() as u64;
            let links = 2 + subdirs;
            inode.links_count = if links >= LINK_MAX { 1 } else { links as u16 };
            fs.write_inode(ino, &inode)?;
        }
        // Inodes left without links and not on an orphan list lose their blocks now;
        // the listed ones are `process_orphans`'s.
        let mut dying = BTreeSet::new();
        for n in self.touched.keys().copied().collect::<Vec<_>>() {
            let ino = Ino(n);
            let mut inode = fs.read_inode(ino)?;
            if inode.links_count > 0 || listed.contains(&n) {
                continue;
            }
            dying.insert(n);
            if has_tree(&inode) {
                self.with_tree(ino, &mut inode, |t| t.remove(0, MAX_LOGICAL).map(|_| ()))?;
            }
            if inode.file_acl != 0 && self.touched[&n].was_used {
                fs.release_xattr_block(&mut inode)?;
            }
            fs.write_inode(ino, &inode)?;
        }
        // What the live touched inodes map now, tree blocks included; their trees
        // repacked as e2fsck would have them, and i_blocks counted.
        let mut mapped = Vec::new();
        for n in self.touched.keys().copied().collect::<Vec<_>>() {
            let ino = Ino(n);
            let mut inode = fs.read_inode(ino)?;
            if dying.contains(&n) || !has_tree(&inode) {
                continue;
            }
            let (data, tree) = self.with_tree(ino, &mut inode, |t| {
                t.optimize()?;
                let rep = t.check()?;
                let exts = t.extents()?;
                Ok((exts, rep.tree_blocks))
            })?;
            let mut count = tree.len() as u64;
            for e in &data {
                mapped.push((e.physical, u64::from(e.len)));
                count += u64::from(e.len);
            }
            mapped.extend(tree.iter().map(|&b| (b, 1)));
            if inode.file_acl != 0 {
                count += 1;
            }
            inode.blocks_raw = if inode.has_flag(flags::HUGE_FILE) {
                count
            } else {
                count * (bs / 512)
            };
            fs.write_inode(ino, &inode)?;
        }
        let mapped = merged(mapped);
        // Mapped blocks the bitmaps have free become used.
        for &run in &self.added {
            for (s, n) in split_by(run, &mapped, true) {
                self.mark_used(s, n)?;
            }
        }
        // Released blocks nothing maps any more become free.
        for (s, n) in merged(std::mem::take(&mut self.released)) {
            for (s, n) in split_by((s, n), &mapped, false) {
                self.free_used(s, n)?;
            }
        }
        // Inodes: used when they have links, free when not.
        let now = fs.now();
        for (&n, t) in &self.touched {
            let ino = Ino(n);
            let mut inode = fs.read_inode(ino)?;
            let live = inode.links_count > 0 || listed.contains(&n);
            let is_dir = inode.is_dir();
            if !live && inode.mode != 0 {
                // Deleted: a dtime, as the kernel leaves a freed inode.
                inode.size = 0;
                inode.dtime = now.sec as u32;
                fs.write_freed_inode(ino, &inode)?;
            }
            match (t.was_used, live) {
                (false, true) => fs.mark_inode_used(ino, is_dir)?,
                (true, true) if t.was_dir != is_dir => {
                    fs.count_dir(ino, if is_dir { 1 } else { -1 })?
                }
                (true, false) => fs.free_inode(ino, t.was_dir)?,
                _ => {}
            }
        }
        // What was built is checked before anything of it is committed: records
        // that make no sense (a kernel would not log them) refuse the replay.
        for &n in self.touched.keys() {
            if let Some(p) = fs.audit_one_inode(Ino(n))?.into_iter().next() {
                return Err(bad(format!(
                    "inode {n} does not check after the replay: {p}"
                )));
            }
        }
        self.report.inodes = self.touched.len();
        Ok(())
    }

    /// Set the bits of the blocks of `[s, s+n)` that are free.
    fn mark_used(&self, s: u64, n: u64) -> Result<()> {
        self.by_state(s, n, false, |fs, a, k| fs.mark_blocks_used(a, k))
    }

    /// Free the blocks of `[s, s+n)` that are in use.
    fn free_used(&self, s: u64, n: u64) -> Result<()> {
        self.by_state(s, n, true, |fs, a, k| fs.free_blocks(a, k))
    }

    /// `f` on each run of `[s, s+n)` whose blocks are in use (`used`) or free.
    fn by_state(
        &self,
        s: u64,
        n: u64,
        used: bool,
        f: impl Fn(&Fs, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let mut run: Option<(u64, u64)> = None;
        for b in s..s + n {
            if self.fs.block_in_use(b)? == used {
                run = match run {
                    Some((a, k)) if a + k == b => Some((a, k + 1)),
                    Some((a, k)) => {
                        f(self.fs, a, k)?;
                        Some((b, 1))
                    }
                    None => Some((b, 1)),
                };
            }
        }
        if let Some((a, k)) = run {
            f(self.fs, a, k)?;
        }
        Ok(())
    }
}

/// ext4's `EXT4_LINK_MAX`: a directory with more links counts 1 (dir_nlink).
const LINK_MAX: u64 = 65_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_inside_and_outside() {
        let set = merged(vec![(10, 5), (12, 10), (40, 2)]);
        assert_eq!(set, vec![(10, 12), (40, 2)]);
        assert_eq!(split_by((5, 40), &set, true), vec![(10, 12), (40, 2)]);
        assert_eq!(
            split_by((5, 40), &set, false),
            vec![(5, 5), (22, 18), (42, 3)]
        );
        assert_eq!(split_by((100, 3), &set, false), vec![(100, 3)]);
        assert_eq!(split_by((100, 3), &set, true), vec![]);
    }
}
