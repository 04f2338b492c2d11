//! The shrink's evacuation (step 1 of the module note of `crate::resize`): everything
//! in use at or past the new end — but the removed groups' own metadata and the
//! journal (moved by `jmove`) — is moved into the kept part through the engine, one
//! journaled operation per move, each leaving the tree exactly as it was.
//!
//! Moves, in order:
//! 1. blocks: per inode, its extents past the end get new blocks below it (data copied
//!    first: through `Fs::read_data`/`write_data` for files and symlinks, which go home
//!    before the commit; through the buffer cache, journaled, for directories and the
//!    orphan file, whose blocks carry a block-number checksum), then its extent tree is
//!    rebuilt over the new extents (`ExtentTree::replace_all`: tree blocks past the end
//!    are not reused), then the old blocks are freed. A large file moves in pieces, one
//!    operation each; every piece leaves a whole, valid mapping.
//! 2. xattr blocks past the end: copied with the checksum of their new number, every
//!    inode that shares one repointed in the same operation.
//! 3. inodes past the new inode count: each copied to a free number in the kept groups
//!    (same generation), its extent tree and directory blocks re-checksummed for the
//!    new number, every directory entry naming it and, for a directory, its own `.`
//!    and its subdirectories' `..` changed, the old record freed: one operation.
//!
//! Must hold: allocations stay below the end (`Fs::set_alloc_limit`); a move never
//! frees a block before the block holding its copy is in the same transaction (so a
//! crash finds the old or the new, each whole); nothing here changes a name, a size,
//! a time or an attribute.
//!
//! Locks: each move takes `Fs::write_lock` (no handle runs beside it; nothing else
//! uses the image during a resize).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rext4_format::dir as fdir;
use rext4_format::extent::{self, Extent, MAX_INIT_LEN, MAX_UNWRITTEN_LEN};
use rext4_format::group::FLAG_INODE_UNINIT;
use rext4_format::inode::{flags, Inode};
use rext4_format::superblock::feature;

use crate::cache::Kind;
use crate::error::{Error, Result};
use crate::fs::inode_write::with_tree;
use crate::fs::map::Mapping;
use crate::fs::space::{claim_as, Claim};
use crate::fs::{Fs, Ino};

/// What the evacuation moved.
#[derive(Debug, Default)]
pub(crate) struct Moved {
    pub blocks: u64,
    pub inodes: u64,
    /// Moves so far, and how often to commit (0: the engine's policy).
    moves: u32,
    commit_every: u32,
}

impl Moved {
    /// One move done: commit when the caller asked for it this often.
    fn one(&mut self, fs: &Fs) -> Result<()> {
        self.moves += 1;
        if self.commit_every > 0 && self.moves.is_multiple_of(self.commit_every) {
            fs.sync()?;
        }
        Ok(())
    }
}

/// The most directory (journaled) blocks one move copies; the rest of the directory
/// moves in the next operation.
const META_PIECE: u64 = 256;
/// The most data blocks one move copies.
const DATA_PIECE: u64 = 16384;

/// Move everything in use at or past `end` (blocks) and every inode past the inode
/// count of a filesystem that size into the part that stays. With `grow_on_full`, a
/// move that finds no room raises `end` by a group's worth (up to the current size)
/// and goes on (a shrink to `min`); else it fails with `NoSpace`.
pub(crate) fn evacuate(
    fs: &Fs,
    end: &mut u64,
    grow_on_full: bool,
    commit_every: u32,
) -> Result<Moved> {
    let _claim = claim_as(Claim::NoFail);
    let sb = fs.superblock();
    let mut moved = Moved {
        commit_every,
        ..Moved::default()
    };
    if grow_on_full {
        // Block-mapped files are not moved: `min` stops past their last block.
        let floor = block_map_floor(fs)?.min(sb.blocks_count);
        if floor > *end {
            let mut e = super::layout::adjust_size(&sb, floor)?;
            if e < floor {
                // Rounded down (a last group too small for its metadata): to the end
                // of the floor's group instead.
                let first = u64::from(sb.first_data_block);
                let bpg = u64::from(sb.blocks_per_group);
                let g = (floor - 1 - first) / bpg;
                e = super::layout::adjust_size(&sb, (first + (g + 1) * bpg).min(sb.blocks_count))?;
            }
            *end = e;
        }
    }
    loop {
        fs.set_alloc_limit(*end);
        match evacuate_to(fs, *end, &mut moved) {
            Err(Error::NoSpace) if grow_on_full && *end < sb.blocks_count => {
                fs.sync()?;
                let step = u64::from(sb.blocks_per_group) / 8;
                *end = super::layout::adjust_size(&sb, (*end + step.max(1)).min(sb.blocks_count))?;
            }
            r => {
                r?;
                break;
            }
        }
    }
    fs.sync()?;
    Ok(moved)
}

/// One past the last block (data or indirect) of any block-mapped file; 0 if none.
fn block_map_floor(fs: &Fs) -> Result<u64> {
    let bs = u64::from(fs.block_size());
    let mut floor = 0u64;
    for (ino, inode) in inodes_in_use(fs)? {
        if !crate::fs::inode_write::uses_block_map(&inode) {
            continue;
        }
        let rep = crate::fs::inode_write::block_map_report(fs, ino, &inode)?;
        for b in rep.indirect {
            floor = floor.max(b + 1);
        }
        for (_, m) in fs.extents(ino, &inode, inode.size.div_ceil(bs))? {
            if let Mapping::Mapped { physical, len, .. } = m {
                floor = floor.max(physical + len);
            }
        }
    }
    Ok(floor)
}

/// Every inode in use: (number, record).
fn inodes_in_use(fs: &Fs) -> Result<Vec<(Ino, Inode)>> {
    let sb = fs.superblock();
    let ipg = sb.inodes_per_group;
    let mut out = Vec::new();
    for g in 0..fs.inner.groups.len() {
        let (uninit, ib) = {
            let grp = fs.group(g)?;
            (grp.desc.has_flag(FLAG_INODE_UNINIT), grp.desc.inode_bitmap)
        };
        if uninit {
            continue;
        }
        let b = fs.cache().read(ib, Kind::Bitmap, |_| Ok(()))?;
        for x in 0..u64::from(ipg) {
            if rext4_format::bitmap::test(&b, x) {
                let ino = Ino(g as u32 * ipg + x as u32 + 1);
                if ino.0 < sb.first_ino && ino != Ino::ROOT {
                    continue;
                }
                let inode = fs.read_inode(ino)?;
                if inode.links_count == 0 && inode.mode == 0 {
                    continue;
                }
                out.push((ino, inode));
            }
        }
    }
    Ok(out)
}

/// Whether an inode's blocks live in an extent tree (or a block map the engine
/// migrates when it changes it).
fn has_blocks(inode: &Inode, bs: u32) -> bool {
    if inode.has_flag(flags::INLINE_DATA) {
        return false;
    }
    if inode.is_symlink() && inode.is_fast_symlink(bs) {
        return false;
    }
    inode.is_reg() || inode.is_dir() || inode.is_symlink()
}

fn evacuate_to(fs: &Fs, end: u64, moved: &mut Moved) -> Result<()> {
    let sb = fs.superblock();
    let bs = sb.block_size();
    let new_groups =
        (end - u64::from(sb.first_data_block)).div_ceil(u64::from(sb.blocks_per_group));
    let new_inodes = new_groups * u64::from(sb.inodes_per_group);
    let orphan_file = (sb.has_compat(feature::COMPAT_ORPHAN_FILE) && sb.orphan_file_inum != 0)
        .then_some(Ino(sb.orphan_file_inum));
    let all = inodes_in_use(fs)?;
    // 1. Blocks.
    let mut xattr_refs: BTreeMap<u64, Vec<Ino>> = BTreeMap::new();
    for (ino, inode) in &all {
        if inode.file_acl != 0 {
            xattr_refs.entry(inode.file_acl).or_default().push(*ino);
        }
        if Some(*ino) == orphan_file || has_blocks(inode, bs) {
            while move_blocks(fs, *ino, end, orphan_file == Some(*ino), moved)? {
                moved.one(fs)?;
            }
            moved.one(fs)?;
        }
    }
    // 2. Xattr blocks.
    for (&blk, refs) in xattr_refs.range(end..) {
        move_xattr_block(fs, blk, refs)?;
        moved.blocks += 1;
        moved.one(fs)?;
    }
    // 3. Inodes.
    let far: Vec<&(Ino, Inode)> = all
        .iter()
        .filter(|(i, _)| u64::from(i.0) > new_inodes)
        .collect();
    if far.is_empty() {
        return Ok(());
    }
    if far.iter().any(|(_, i)| i.has_flag(flags::EA_INODE)) {
        return Err(Error::Unsupported(
            "an xattr value inode (ea_inode) lies in a group the shrink removes".into(),
        ));
    }
    let mut names = Names::scan(fs, &all, far.iter().map(|(i, _)| *i).collect())?;
    for (old, _) in far {
        renumber(fs, *old, &mut names)?;
        moved.inodes += 1;
        moved.one(fs)?;
    }
    Ok(())
}

/// Merge neighbours (same state, contiguous on both sides, within the length limit).
fn merged(v: Vec<Extent>) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::with_capacity(v.len());
    for e in v {
        if let Some(p) = out.last_mut() {
            let max = if e.unwritten {
                MAX_UNWRITTEN_LEN
            } else {
                MAX_INIT_LEN
            };
            if p.unwritten == e.unwritten
                && p.end() == u64::from(e.logical)
                && p.physical + u64::from(p.len) == e.physical
                && u32::from(p.len) + u32::from(e.len) <= u32::from(max)
            {
                p.len += e.len;
                continue;
            }
        }
        out.push(e);
    }
    out
}

/// Tree blocks below the root that a tree of `m` extents packed full takes.
fn tree_blocks_for(m: u64, bs: u64) -> u64 {
    let root = u64::from(extent::ROOT_CAPACITY);
    let cap = u64::from(extent::block_capacity(bs as usize)).max(1);
    if m <= root {
        return 0;
    }
    let mut level = m.div_ceil(cap);
    let mut total = level;
    while level > root {
        level = level.div_ceil(cap);
        total += level;
    }
    total
}

/// Give back what a move allocated before it found no room (nothing was written).
fn roll_back(fs: &Fs, runs: &[(u64, u64)]) {
    for &(s, n) in runs {
        let _ = fs.free_blocks(s, n);
    }
}

/// Move one piece of `ino`'s blocks at or past `end` below it; returns whether
/// another piece is left. One operation: every block it needs is allocated before
/// anything is written (a refusal gives them back and changes nothing else).
fn move_blocks(fs: &Fs, ino: Ino, end: u64, orphan_file: bool, moved: &mut Moved) -> Result<bool> {
    let _w = fs.write_lock();
    let mut inode = fs.read_inode(ino)?;
    let bs = u64::from(fs.block_size());
    let past = |p: u64, n: u64| p + n > end;
    if !inode.has_flag(flags::EXTENTS) {
        if !crate::fs::inode_write::uses_block_map(&inode) {
            return Ok(false);
        }
        // The engine keeps block maps as the kernel does (it writes no extent tree
        // over them), and has no operation that remaps one block of a map: such a
        // file stays where it is, and a shrink that would cut it off is refused.
        let rep = crate::fs::inode_write::block_map_report(fs, ino, &inode)?;
        let limit = inode.size.div_ceil(bs);
        let cut = rep.indirect.iter().any(|&b| b >= end)
            || fs.extents(ino, &inode, limit)?.iter().any(|(_, m)| {
                matches!(m, Mapping::Mapped { physical, len, .. } if past(*physical, *len))
            });
        if cut {
            return Err(Error::Unsupported(format!(
                "inode {} is block-mapped (an ext2/ext3-style file) and has blocks past \
                 the new end (block {end}); rext4 resize moves extent-mapped files only: \
                 choose a larger size",
                ino.0
            )));
        }
        return Ok(false);
    }
    let (exts, tree) = with_tree(fs, ino, &mut inode, |t| {
        let rep = t.check()?;
        Ok((t.extents()?, rep.tree_blocks))
    })?;
    if !exts.iter().any(|e| past(e.physical, u64::from(e.len))) && !tree.iter().any(|&b| b >= end) {
        return Ok(false);
    }
    let meta = inode.is_dir() || orphan_file;
    let budget = if meta { META_PIECE } else { DATA_PIECE };
    // What moves in this piece: (logical, old physical, length, unwritten).
    let mut out: Vec<Extent> = Vec::with_capacity(exts.len() + 4);
    let mut pieces: Vec<(u64, u64, u64, bool)> = Vec::new();
    let mut planned = 0u64;
    let mut more = false;
    for e in &exts {
        let (l0, p0, n0) = (u64::from(e.logical), e.physical, u64::from(e.len));
        if !past(p0, n0) {
            out.push(*e);
            continue;
        }
        let keep = end.saturating_sub(p0).min(n0);
        if keep > 0 {
            out.push(Extent {
                len: keep as u16,
                ..*e
            });
        }
        let take = (n0 - keep).min(budget - planned);
        if take > 0 {
            pieces.push((l0 + keep, p0 + keep, take, e.unwritten));
            planned += take;
        }
        if keep + take < n0 {
            more = true;
            out.push(Extent {
                logical: (l0 + keep + take) as u32,
                len: (n0 - keep - take) as u16,
                physical: p0 + keep + take,
                unwritten: e.unwritten,
            });
        }
    }
    // Allocate every new run first.
    let mut allocated: Vec<(u64, u64)> = Vec::new();
    let mut new_runs: Vec<(u64, u64, u64, bool)> = Vec::new();
    let mut goal = exts
        .iter()
        .find(|e| !past(e.physical, u64::from(e.len)))
        .map_or(u64::from(fs.inner.sb.first_data_block), |e| e.physical);
    for &(l, _, n, unwritten) in &pieces {
        let mut off = 0;
        while off < n {
            let want = (n - off).min(u64::from(MAX_INIT_LEN));
            let got = match fs.alloc_blocks(goal, want as u32) {
                Ok((np, got)) if np + u64::from(got) <= end => (np, u64::from(got)),
                Ok((np, got)) => {
                    allocated.push((np, u64::from(got)));
                    roll_back(fs, &allocated);
                    return Err(Error::NoSpace);
                }
                Err(e) => {
                    roll_back(fs, &allocated);
                    return Err(e);
                }
            };
            allocated.push(got);
            new_runs.push((l + off, got.0, got.1, unwritten));
            goal = got.0 + got.1;
            off += got.1;
        }
    }
    for &(l, p, n, unwritten) in &new_runs {
        out.push(Extent {
            logical: l as u32,
            len: n as u16,
            physical: p,
            unwritten,
        });
    }
    out.sort_by_key(|e| e.logical);
    let out = merged(out);
    // The new tree's blocks: the old ones below the end, and new ones for the rest.
    let reusable = tree.iter().filter(|&&b| b < end).count() as u64;
    let need = tree_blocks_for(out.len() as u64, bs).saturating_sub(reusable);
    let mut extra = Vec::new();
    for _ in 0..need {
        match fs.alloc_meta_block(goal) {
            Ok(b) if b < end => {
                allocated.push((b, 1));
                extra.push(b);
            }
            Ok(b) => {
                allocated.push((b, 1));
                roll_back(fs, &allocated);
                return Err(Error::NoSpace);
            }
            Err(e) => {
                roll_back(fs, &allocated);
                return Err(e);
            }
        }
    }
    // Nothing is written before this point.
    let seed = fs.owned_seed(ino, &inode);
    let mut from_it = pieces
        .iter()
        .flat_map(|&(_, p, n, _)| (p..p + n).map(|b| (b, 1u64)));
    for &(_, np, n, unwritten) in &new_runs {
        let old: Vec<u64> = from_it.by_ref().take(n as usize).map(|x| x.0).collect();
        if !unwritten {
            if let Some(&first) = old.first() {
                copy_blocks(
                    fs,
                    first,
                    np,
                    n,
                    meta,
                    orphan_file.then_some(seed).flatten(),
                )?;
            }
        }
    }
    inode.blocks_raw += extra.len() as u64 * (bs / 512);
    with_tree(fs, ino, &mut inode, |t| {
        t.replace_all(out, |b| b < end, extra)
    })?;
    for &(_, p, n, _) in &pieces {
        fs.free_blocks(p, n)?;
    }
    fs.write_inode(ino, &inode)?;
    moved.blocks += planned;
    Ok(more)
}

/// Copy `n` blocks from `from` to `to`: file data home, or metadata (directory,
/// orphan file) through the buffer cache; orphan-file blocks get the checksum of
/// their new number.
fn copy_blocks(
    fs: &Fs,
    from: u64,
    to: u64,
    n: u64,
    meta: bool,
    orphan_seed: Option<u32>,
) -> Result<()> {
    let bs = u64::from(fs.block_size());
    if meta {
        for i in 0..n {
            let mut b = fs.cache().read(from + i, Kind::Raw, |_| Ok(()))?.to_vec();
            if let Some(s) = orphan_seed {
                rext4_format::orphan::set_block_csum(&mut b, s, to + i);
            }
            fs.cache().write(to + i, Kind::Raw, b, |_| Ok(()))?;
        }
        return Ok(());
    }
    let chunk = 256u64;
    let mut buf = vec![0u8; (chunk * bs) as usize];
    let mut i = 0;
    while i < n {
        let k = (n - i).min(chunk);
        let b = &mut buf[..(k * bs) as usize];
        fs.read_data_init(b, (from + i) * bs)?;
        fs.write_data(b, (to + i) * bs)?;
        i += k;
    }
    Ok(())
}

/// Move xattr block `blk` below the end: a copy under its new number's checksum,
/// every inode in `refs` pointed at it, the old one freed. One operation.
fn move_xattr_block(fs: &Fs, blk: u64, refs: &[Ino]) -> Result<()> {
    let _w = fs.write_lock();
    let mut data = fs.cache().read(blk, Kind::Raw, |_| Ok(()))?.to_vec();
    let goal = refs.first().map_or(0, |i| {
        fs.inner
            .sb
            .group_first_block(u64::from((i.0 - 1) / fs.inner.sb.inodes_per_group))
    });
    let nb = fs.alloc_meta_block(goal)?;
    if fs.inner.metadata_csum {
        rext4_format::xattr::set_block_csum(&mut data, fs.inner.csum_seed, nb);
    }
    fs.cache().write(nb, Kind::Raw, data, |_| Ok(()))?;
    for &ino in refs {
        let mut inode = fs.read_inode(ino)?;
        if inode.file_acl == blk {
            inode.file_acl = nb;
            fs.write_inode(ino, &inode)?;
        }
    }
    fs.free_blocks(blk, 1)?;
    Ok(())
}

/// Where the names of the inodes to renumber are: (directory, logical block, offset
/// in it) of every entry naming one, and of every `..` (which names a parent).
struct Names {
    /// Entries naming an inode to move.
    naming: HashMap<u32, Vec<(u32, u64, usize)>>,
    /// Directory -> its `..` entry (logical block 0, offset) and the inode it names.
    dotdot: HashMap<u32, (usize, u32)>,
    /// Parent -> its subdirectories.
    children: HashMap<u32, Vec<u32>>,
    /// Renumbered so far: old -> new.
    renamed: HashMap<u32, u32>,
}

impl Names {
    fn scan(fs: &Fs, all: &[(Ino, Inode)], far: BTreeSet<Ino>) -> Result<Names> {
        let bs = fs.block_size();
        let csum = fs.inner.metadata_csum;
        let mut n = Names {
            naming: HashMap::new(),
            dotdot: HashMap::new(),
            children: HashMap::new(),
            renamed: HashMap::new(),
        };
        for (dir, inode) in all.iter().filter(|(_, i)| i.is_dir()) {
            let blocks = inode.size / u64::from(bs);
            let indexed = inode.has_flag(flags::INDEX);
            for lblk in 0..blocks {
                let p = match fs.map_block(*dir, inode, lblk)? {
                    Mapping::Mapped {
                        physical,
                        unwritten: false,
                        ..
                    } => physical,
                    _ => continue,
                };
                let b = fs.cache().read(p, Kind::Raw, |_| Ok(()))?;
                let kind = block_kind(&b, lblk, indexed);
                if kind == DirBlock::Node {
                    continue;
                }
                let tail = csum && kind == DirBlock::Leaf;
                for e in fdir::entries(&b, tail) {
                    let e = e.map_err(|e| Error::from(e.at_block(p)))?;
                    if !e.is_live() {
                        continue;
                    }
                    if e.name == b".." {
                        n.dotdot.insert(dir.0, (e.offset, e.inode));
                        n.children.entry(e.inode).or_default().push(dir.0);
                    } else if e.name != b"." && far.contains(&Ino(e.inode)) {
                        n.naming
                            .entry(e.inode)
                            .or_default()
                            .push((dir.0, lblk, e.offset));
                    }
                }
            }
        }
        Ok(n)
    }

    /// The number directory `d` has now.
    fn now(&self, d: u32) -> u32 {
        self.renamed.get(&d).copied().unwrap_or(d)
    }
}

/// What a directory block is: a dx root or node (index), or a leaf of entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DirBlock {
    Root,
    Node,
    Leaf,
}

fn block_kind(b: &[u8], lblk: u64, indexed: bool) -> DirBlock {
    if indexed && lblk == 0 {
        return DirBlock::Root;
    }
    let ino = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let rec = fdir::rec_len_from_disk(u16::from_le_bytes([b[4], b[5]]), b.len());
    if indexed && ino == 0 && rec == b.len() {
        DirBlock::Node
    } else {
        DirBlock::Leaf
    }
}

/// Change directory `dir`'s block `lblk` with `f` (given the block), then set its
/// checksum for `dir`'s seed, through the journal.
fn change_dir_block(
    fs: &Fs,
    dir: Ino,
    inode: &Inode,
    lblk: u64,
    f: impl FnOnce(&mut [u8]),
) -> Result<()> {
    let p = match fs.map_block(dir, inode, lblk)? {
        Mapping::Mapped {
            physical,
            unwritten: false,
            ..
        } => physical,
        _ => {
            return Err(Error::corrupted(
                format!("directory {} has a hole at block {lblk}", dir.0),
                None,
            ))
        }
    };
    let mut b = fs.cache().read(p, Kind::Raw, |_| Ok(()))?.to_vec();
    f(&mut b);
    seal_dir_block(&mut b, lblk, inode, fs.owned_seed(dir, inode))?;
    fs.cache().write(p, Kind::Raw, b, |_| Ok(()))
}

/// Set a directory block's checksum for `seed` (none without metadata_csum).
fn seal_dir_block(b: &mut [u8], lblk: u64, inode: &Inode, seed: Option<u32>) -> Result<()> {
    let Some(s) = seed else { return Ok(()) };
    match block_kind(b, lblk, inode.has_flag(flags::INDEX)) {
        DirBlock::Root | DirBlock::Node => fdir::set_dx_csum(b, s)?,
        DirBlock::Leaf => fdir::set_leaf_csum(b, s)?,
    }
    Ok(())
}

fn set_entry_inode(b: &mut [u8], off: usize, ino: u32) {
    b[off..off + 4].copy_from_slice(&ino.to_le_bytes());
}

/// Give inode `old` a number in the kept groups. One operation.
fn renumber(fs: &Fs, old: Ino, names: &mut Names) -> Result<()> {
    let _w = fs.write_lock();
    let inode = fs.read_inode(old)?;
    let (raw, _) = fs.inode_bytes(old)?;
    let is_dir = inode.is_dir();
    let parent = names
        .naming
        .get(&old.0)
        .and_then(|v| v.first())
        .map_or(Ino::ROOT, |&(d, _, _)| Ino(names.now(d)));
    let new = fs.alloc_inode(parent, is_dir)?;
    fs.write_inode_raw(new, &raw, &inode)?;
    let new_seed = fs.owned_seed(new, &inode);
    // Blocks checksummed with the inode's seed: its extent tree, a directory's blocks.
    if new_seed.is_some() && inode.has_flag(flags::EXTENTS) {
        let mut copy = inode.clone();
        let tree = with_tree(fs, new, &mut copy, |t| Ok(t.check()?.tree_blocks))?;
        for b in tree {
            let mut d = fs.cache().read(b, Kind::Raw, |_| Ok(()))?.to_vec();
            if let Some(s) = new_seed {
                extent::set_csum(&mut d, s);
            }
            fs.cache().write(b, Kind::Raw, d, |_| Ok(()))?;
        }
    }
    if is_dir {
        let blocks = inode.size / u64::from(fs.block_size());
        for lblk in 0..blocks {
            change_dir_block(fs, new, &inode, lblk, |b| {
                if lblk == 0 {
                    // "." names the directory itself.
                    if let Some(Ok(e)) = fdir::entries(b, false).next() {
                        if e.name == b"." {
                            set_entry_inode(b, e.offset, new.0);
                        }
                    }
                }
            })?;
        }
        // Its subdirectories' "..".
        for &c in names
            .children
            .get(&old.0)
            .cloned()
            .unwrap_or_default()
            .iter()
        {
            if c == old.0 {
                continue;
            }
            let child = Ino(names.now(c));
            let cinode = fs.read_inode(child)?;
            if let Some(&(off, _)) = names.dotdot.get(&c) {
                change_dir_block(fs, child, &cinode, 0, |b| set_entry_inode(b, off, new.0))?;
            }
        }
    }
    // The entries naming it.
    for &(d, lblk, off) in names.naming.get(&old.0).cloned().unwrap_or_default().iter() {
        let dir = Ino(names.now(d));
        let dinode = fs.read_inode(dir)?;
        change_dir_block(fs, dir, &dinode, lblk, |b| set_entry_inode(b, off, new.0))?;
    }
    // The old record: unused, as a deleted inode's.
    let mut dead = inode.clone();
    dead.links_count = 0;
    dead.dtime = super::switch::now_secs() as u32;
    fs.write_freed_inode(old, &dead)?;
    fs.free_inode(old, is_dir)?;
    names.renamed.insert(old.0, new.0);
    fs.inner.caches.dentries.invalidate_where(|_| true);
    fs.inner.caches.inodes.invalidate(&old.0);
    Ok(())
}
