//! Directory writes: adding, removing and replacing entries in linear and htree
//! directories, converting a full one-block directory to an htree, and growing the
//! htree (leaf splits, index-node splits, a new index level).
//!
//! Everything works on one directory through [`DirStore`] (logical blocks only), so the
//! algorithms are unit-tested on an in-memory store. Behaviour follows the kernel's
//! `fs/ext4/namei.c` (facts, not code):
//! - Linear directories: a new name goes into the first block with room, scanning every
//!   block; when none has room, a directory of exactly one block is converted to an
//!   htree if the filesystem has dir_index (`make_indexed_dir`), otherwise a new empty
//!   block is appended. Multi-block linear directories stay linear.
//! - Conversion: block 0 becomes the dx root (hash version = `s_def_hash_version`,
//!   levels 0); its entries after ".." move to a new block 1, which is split by hash
//!   into blocks 1 and 2 exactly as a full leaf is.
//! - Leaf split (`do_split`): the live entries are sorted by hash; from the top, entries
//!   move to a new block while more than half of the next one would still be in the
//!   upper half of the block (by count if that leaves nothing behind); the parent gets
//!   `(hash of the first moved entry) | 1-if-it-equals-the-last-kept-hash` (the
//!   collision bit) right after the split leaf's entry. The kept block stays in on-disk
//!   order, the moved block is in hash order, both packed.
//! - A full leaf whose parent index block is full: walk up while the parent is full
//!   too. Reaching the root (full), add a level: the root's entries move to a new node
//!   and the root points at it (0→1 always, 1→2 only with large_dir, else
//!   [`Error::NoSpace`]). Otherwise split the index node reached in half by count and
//!   insert the upper half's first hash in its parent. Then start over from the root.
//! - Removal merges the entry into the previous one's record (or zeroes the inode of a
//!   block's first entry). Directories never shrink and leaves are never merged.
//!
//! Must hold after every call: every block written carries its dirent-tail checksum
//! (leaves) or dx-tail checksum (root, nodes) when [`DirStore::csum_seed`] is `Some`;
//! without metadata_csum no tails and the larger dx limits. Index hashes stay
//! non-decreasing and every leaf holds only names hashing into its index range (with
//! the collision-bit rule of [`fdir::collision_continues`]). Every block read is
//! verified first; bad blocks are [`Error::Corrupted`] naming the logical block.
//!
//! [`DirStore::is_indexed`] must mean the kernel's `is_dx` (INDEX flag *and* dir_index).
//!
//! Callers: the filesystem's create/link/unlink/rename/mkdir/rmdir paths, through a
//! [`DirStore`] for the parent directory.

use std::collections::BTreeSet;
use std::sync::Arc;

use rext4_format::casefold;
use rext4_format::dir::{self as fdir, DxEntries, DxEntry, DxNode, DxRoot, FileType};
use rext4_format::hash::{dx_hash, dx_hash_casefold, HashVersion};
use rext4_format::FormatError;

use crate::error::{Error, Result};
use crate::store::DirStore;

/// Bound on restarts of one insertion (each restart splits an index node or adds a
/// level; at most 3 levels exist).
const MAX_RESTARTS: usize = 16;

/// Per-directory constants read once from the store.
struct Ctx {
    bs: usize,
    seed: Option<u32>,
    hash_seed: [u32; 4],
    s_flags: u32,
    def_hash: u8,
    largedir: bool,
    /// `Some(strict)` in a casefolded directory.
    casefold: Option<bool>,
}

impl Ctx {
    fn new(dir: &impl DirStore) -> Ctx {
        let (hash_seed, s_flags, def_hash) = dir.hash_params();
        Ctx {
            bs: dir.block_size(),
            seed: dir.csum_seed(),
            hash_seed,
            s_flags,
            def_hash,
            largedir: dir.largedir(),
            casefold: dir.casefold(),
        }
    }
    fn csum(&self) -> bool {
        self.seed.is_some()
    }
    fn root_limit(&self) -> usize {
        fdir::dx_root_limit(self.bs, self.csum())
    }
    fn node_limit(&self) -> usize {
        fdir::dx_node_limit(self.bs, self.csum())
    }
    fn max_levels(&self) -> u8 {
        if self.largedir {
            fdir::DX_MAX_LEVELS_LARGEDIR
        } else {
            fdir::DX_MAX_LEVELS
        }
    }
    fn version(&self, on_disk: u8) -> Result<HashVersion> {
        HashVersion::effective(on_disk, self.s_flags)
            .ok_or_else(|| Error::Unsupported(format!("directory hash version {on_disk}")))
    }
    fn hash(&self, name: &[u8], v: HashVersion) -> u32 {
        if self.casefold.is_some() {
            dx_hash_casefold(name, v, &self.hash_seed).0
        } else {
            dx_hash(name, v, &self.hash_seed).0
        }
    }

    /// The live entry of leaf `b` (logical block `lblk`) that `name` names: the same
    /// bytes, or in a casefolded directory a name folding the same (the kernel's
    /// `generic_ci_match`).
    fn find_in<'a>(
        &self,
        b: &'a [u8],
        name: &[u8],
        lblk: u64,
    ) -> Result<Option<fdir::DirEntry<'a>>> {
        let found = if self.casefold.is_some() {
            let m = casefold::Matcher::new(name);
            fdir::lookup_by(b, self.csum(), |n| m.matches(n))
        } else {
            fdir::lookup(b, name, self.csum())
        };
        found.map_err(in_block(lblk))
    }

    /// The bytes of the entry `name` names in leaf `b` (in a casefolded directory, the
    /// name as stored; `name` itself when no entry matches or the directory is not
    /// casefolded).
    fn stored_name(&self, b: &[u8], name: &[u8], lblk: u64) -> Result<Vec<u8>> {
        if self.casefold.is_none() {
            return Ok(name.to_vec());
        }
        Ok(self
            .find_in(b, name, lblk)?
            .map_or_else(|| name.to_vec(), |e| e.name.to_vec()))
    }

    /// Refuse a new `name` a strict casefolded directory cannot hold (not valid UTF-8:
    /// EINVAL, as the kernel's `ext4_add_entry`).
    fn check_new_name(&self, name: &[u8]) -> Result<()> {
        if self.casefold == Some(true) && !casefold::is_valid_name(name) {
            return Err(Error::InvalidInput(
                "name is not valid UTF-8, which this casefolded directory requires \
                 (strict encoding)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// A format error found in logical block `lblk` of the directory.
fn in_block(lblk: u64) -> impl Fn(FormatError) -> Error {
    move |e| match Error::from(e) {
        Error::Corrupted { what, block } => Error::Corrupted {
            what: format!("{what} (directory block {lblk})"),
            block,
        },
        other => other,
    }
}

fn corrupt(what: String) -> Error {
    Error::corrupted(what, None)
}

/// A store's error about logical block `lblk` of the directory, naming the block.
fn from_block(lblk: u64) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Corrupted { what, block } if !what.contains("(directory block") => {
            Error::Corrupted {
                what: format!("{what} (directory block {lblk})"),
                block,
            }
        }
        other => other,
    }
}

/// Block `lblk` as the store gave it, checked to be one block long.
fn whole_block<B: AsRef<[u8]>>(c: &Ctx, lblk: u64, b: B) -> Result<B> {
    let len = b.as_ref().len();
    if len != c.bs {
        return Err(corrupt(format!(
            "directory block {lblk} read as {len} bytes, block size {}",
            c.bs
        )));
    }
    Ok(b)
}

/// Read a verified index block (`lblk` 0: the root; see `DirStore::read_index`).
fn read_index(dir: &impl DirStore, c: &Ctx, lblk: u64) -> Result<Arc<[u8]>> {
    whole_block(c, lblk, dir.read_index(lblk).map_err(from_block(lblk))?)
}

/// Read a verified leaf (dirent block): the store verifies it (`DirStore::read_leaf`).
fn read_leaf(dir: &impl DirStore, c: &Ctx, lblk: u64) -> Result<Vec<u8>> {
    whole_block(c, lblk, dir.read_leaf(lblk).map_err(from_block(lblk))?)
}

/// Change leaf `lblk` with `f` (true: it changed the block; it fails, if it fails,
/// before changing anything), and checksum it when changed — in place where the store
/// allows (`DirStore::change_leaf`). Whether `f` changed it.
fn change_leaf(
    dir: &mut impl DirStore,
    c: &Ctx,
    lblk: u64,
    mut f: impl FnMut(&mut [u8]) -> Result<bool>,
) -> Result<bool> {
    dir.change_leaf(lblk, &mut |b| {
        if b.len() != c.bs || (c.csum() && !fdir::tail_present(b)) {
            return Err(corrupt(format!(
                "directory block {lblk}: not a leaf of this directory"
            )));
        }
        if !f(b)? {
            return Ok(false);
        }
        if let Some(s) = c.seed {
            fdir::set_leaf_csum(b, s).map_err(in_block(lblk))?;
        }
        Ok(true)
    })
    .map_err(from_block(lblk))
}

/// Checksum and write a leaf.
fn write_leaf(dir: &mut impl DirStore, c: &Ctx, lblk: u64, mut b: Vec<u8>) -> Result<()> {
    if let Some(s) = c.seed {
        fdir::set_leaf_csum(&mut b, s).map_err(in_block(lblk))?;
    }
    dir.write_leaf(lblk, &b)
}

/// Checksum and write an index block (root or node).
fn write_index(dir: &mut impl DirStore, c: &Ctx, lblk: u64, mut b: Vec<u8>) -> Result<()> {
    if let Some(s) = c.seed {
        fdir::set_dx_csum(&mut b, s).map_err(in_block(lblk))?;
    }
    dir.write_block(lblk, &b)
}

/// The verified root: its fields (`entries` left empty: read them in place with
/// [`root_view`]) and its bytes.
fn read_root(dir: &impl DirStore, c: &Ctx) -> Result<(DxRoot, Arc<[u8]>)> {
    let b = read_index(dir, c, 0)?;
    let (root, _) = root_view(c, &b)?;
    Ok((root, b))
}

/// The root's fields and its entries, in place.
fn root_view<'a>(c: &Ctx, b: &'a [u8]) -> Result<(DxRoot, DxEntries<'a>)> {
    DxRoot::view(b, c.csum(), c.largedir).map_err(in_block(0))
}

fn write_root(dir: &mut impl DirStore, c: &Ctx, root: &DxRoot) -> Result<()> {
    let mut b = vec![0u8; c.bs];
    root.encode(&mut b, c.csum()).map_err(in_block(0))?;
    write_index(dir, c, 0, b)
}

fn write_node(dir: &mut impl DirStore, c: &Ctx, lblk: u64, entries: Vec<DxEntry>) -> Result<()> {
    let mut b = vec![0u8; c.bs];
    DxNode { entries }
        .encode(&mut b, c.csum())
        .map_err(in_block(lblk))?;
    write_index(dir, c, lblk, b)
}

fn to_u32_block(lblk: u64) -> Result<u32> {
    u32::try_from(lblk).map_err(|_| Error::NoSpace)
}

/// One level of a descent: the index block (verified) and the chosen entry.
#[derive(Clone)]
struct Frame {
    lblk: u64,
    data: Arc<[u8]>,
    at: usize,
}

impl Frame {
    /// The block's entries, in place.
    fn entries(&self, c: &Ctx) -> Result<DxEntries<'_>> {
        if self.lblk == 0 {
            Ok(root_view(c, &self.data)?.1)
        } else {
            DxNode::view(&self.data, c.csum()).map_err(in_block(self.lblk))
        }
    }

    fn child(&self, c: &Ctx) -> Result<u64> {
        let e = self.entries(c)?;
        if self.at >= e.len() {
            return Err(corrupt(format!(
                "directory index block {} is empty",
                self.lblk
            )));
        }
        Ok(u64::from(e.get(self.at).block))
    }
}

/// Check an index entry's target: a block of the directory other than the root and the
/// index blocks above it.
fn check_child(child: u64, n: u64, frames: &[Frame]) -> Result<()> {
    if child == 0 || child >= n || frames.iter().any(|f| f.lblk == child) {
        return Err(corrupt(format!(
            "directory index points at block {child} of {n}"
        )));
    }
    Ok(())
}

/// Descend from the root (`root`, with `levels` index levels below it) to the leaf
/// for `hash` (the kernel's `dx_probe`). The last frame's chosen entry names the leaf,
/// which is checked to be in range.
fn probe(
    dir: &impl DirStore,
    c: &Ctx,
    root: &Arc<[u8]>,
    levels: u8,
    hash: u32,
) -> Result<Vec<Frame>> {
    let n = dir.nblocks();
    let mut frames: Vec<Frame> = Vec::with_capacity(usize::from(levels) + 1);
    let mut f = Frame {
        lblk: 0,
        data: root.clone(),
        at: 0,
    };
    loop {
        f.at = f.entries(c)?.lookup(hash);
        let child = f.child(c)?;
        frames.push(f);
        check_child(child, n, &frames)?;
        if frames.len() > usize::from(levels) {
            return Ok(frames);
        }
        f = Frame {
            lblk: child,
            data: read_index(dir, c, child)?,
            at: 0,
        };
    }
}

/// After a miss in the leaf under `frames`, move to the next leaf if its index hash
/// continues `hash` (collision bit); false when the search is over.
fn next_leaf(
    dir: &impl DirStore,
    c: &Ctx,
    levels: u8,
    frames: &mut Vec<Frame>,
    hash: u32,
) -> Result<bool> {
    let mut lvl = frames.len();
    let next_hash = loop {
        if lvl == 0 {
            return Ok(false);
        }
        lvl -= 1;
        let f = &mut frames[lvl];
        let next = {
            let e = f.entries(c)?;
            (f.at + 1 < e.len()).then(|| e.get(f.at + 1).hash)
        };
        if let Some(h) = next {
            f.at += 1;
            break h;
        }
    };
    if !fdir::collision_continues(next_hash, hash) {
        return Ok(false);
    }
    frames.truncate(lvl + 1);
    let n = dir.nblocks();
    while frames.len() <= usize::from(levels) {
        let child = frames[frames.len() - 1].child(c)?;
        check_child(child, n, frames)?;
        frames.push(Frame {
            lblk: child,
            data: read_index(dir, c, child)?,
            at: 0,
        });
    }
    let child = frames[frames.len() - 1].child(c)?;
    check_child(child, n, frames)?;
    Ok(true)
}

/// Whether the leaf after the one `frames` lead to may hold names of `hash` (the next
/// index entry, at the lowest level that has one, continues it: `next_leaf` would
/// move there).
fn chain_continues(c: &Ctx, frames: &[Frame], hash: u32) -> Result<bool> {
    for f in frames.iter().rev() {
        let e = f.entries(c)?;
        if f.at + 1 < e.len() {
            return Ok(fdir::collision_continues(e.get(f.at + 1).hash, hash));
        }
    }
    Ok(false)
}

/// The leaves that may hold `name`, in order: every block of a linear directory; in
/// an htree the leaf its hash picks, then the next ones while their index hash
/// continues the hash (collision bit). Each leaf is visited at most once.
struct NameLeaves {
    /// An htree's walk: index levels below the root, the name's hash, the index path.
    hashed: Option<(u8, u32, Vec<Frame>)>,
    /// Leaves given so far, and the bound on them.
    given: u64,
    limit: u64,
}

impl NameLeaves {
    fn new(dir: &impl DirStore, c: &Ctx, name: &[u8]) -> Result<NameLeaves> {
        let n = dir.nblocks();
        if !dir.is_indexed() {
            return Ok(NameLeaves {
                hashed: None,
                given: 0,
                limit: n,
            });
        }
        let (root, rb) = read_root(dir, c)?;
        let hash = c.hash(name, c.version(root.hash_version)?);
        let frames = probe(dir, c, &rb, root.indirect_levels, hash)?;
        Ok(NameLeaves {
            hashed: Some((root.indirect_levels, hash, frames)),
            given: 0,
            limit: n.max(1),
        })
    }

    /// The next leaf to look in, `None` when the search is over.
    fn next(&mut self, dir: &impl DirStore, c: &Ctx) -> Result<Option<u64>> {
        let i = self.given;
        if i >= self.limit {
            return Ok(None);
        }
        self.given += 1;
        let Some((levels, hash, frames)) = &mut self.hashed else {
            return Ok(Some(i));
        };
        if i > 0 && !next_leaf(dir, c, *levels, frames, *hash)? {
            return Ok(None);
        }
        Ok(Some(frames[frames.len() - 1].child(c)?))
    }
}

/// The leaf holding the live entry `name` (not "." or ".."), with its verified bytes.
fn find(dir: &impl DirStore, c: &Ctx, name: &[u8]) -> Result<Option<(u64, Vec<u8>)>> {
    first_holding(&mut NameLeaves::new(dir, c, name)?, dir, c, name)
}

/// The first of `leaves` holding the live entry `name`, with its verified bytes.
fn first_holding(
    leaves: &mut NameLeaves,
    dir: &impl DirStore,
    c: &Ctx,
    name: &[u8],
) -> Result<Option<(u64, Vec<u8>)>> {
    while let Some(leaf) = leaves.next(dir, c)? {
        let b = read_leaf(dir, c, leaf)?;
        if c.find_in(&b, name, leaf)?.is_some() {
            return Ok(Some((leaf, b)));
        }
    }
    Ok(None)
}

fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > fdir::NAME_MAX {
        return Err(Error::NameTooLong);
    }
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(Error::InvalidInput("bad file name".into()));
    }
    Ok(())
}

fn check_entry_name(name: &[u8]) -> Result<()> {
    check_name(name)?;
    if name == b"." || name == b".." {
        return Err(Error::InvalidInput(
            "\".\" and \"..\" are not ordinary entries".into(),
        ));
    }
    Ok(())
}

/// Look `name` up ("." and ".." included): `(inode, raw file-type byte)`.
pub fn lookup(dir: &impl DirStore, name: &[u8]) -> Result<Option<(u32, u8)>> {
    check_name(name)?;
    let c = Ctx::new(dir);
    if dir.is_indexed() && (name == b"." || name == b"..") {
        let (root, _) = read_root(dir, &c)?;
        let ino = if name == b"." {
            root.dot_inode
        } else {
            root.dotdot_inode
        };
        return Ok(Some((ino, FileType::Directory as u8)));
    }
    let Some((lblk, b)) = find(dir, &c, name)? else {
        return Ok(None);
    };
    let e = c.find_in(&b, name, lblk)?;
    Ok(e.map(|e| (e.inode, e.file_type)))
}

/// One live entry, owned.
#[derive(Debug, Clone)]
struct Ent {
    name: Vec<u8>,
    ino: u32,
    ftype: u8,
}

impl Ent {
    /// A new entry `name` → `ino`, checked: an ordinary name, a real inode.
    fn new(name: &[u8], ino: u32, ftype: FileType) -> Result<Ent> {
        check_entry_name(name)?;
        if ino == 0 {
            return Err(Error::InvalidInput("directory entry for inode 0".into()));
        }
        Ok(Ent {
            name: name.to_vec(),
            ino,
            ftype: ftype as u8,
        })
    }
}

/// Insert keeping the raw file-type byte (values above 7 survive a split unchanged).
fn insert_raw(b: &mut [u8], e: &Ent, tail: bool) -> std::result::Result<bool, FormatError> {
    let kind = FileType::from_u8(e.ftype).unwrap_or(FileType::Unknown);
    match fdir::insert_entry(b, e.ino, &e.name, kind, tail)? {
        Some(off) => {
            if let Some(t) = b.get_mut(off + fdir::DIRENT_FILE_TYPE) {
                *t = e.ftype;
            }
            Ok(true)
        }
        None => Ok(false),
    }
}

/// [`insert_raw`] unless a live entry has the name (one walk for both).
fn insert_new(
    b: &mut [u8],
    e: &Ent,
    tail: bool,
) -> std::result::Result<fdir::Insertion, FormatError> {
    let kind = FileType::from_u8(e.ftype).unwrap_or(FileType::Unknown);
    let r = fdir::insert_new_entry(b, e.ino, &e.name, kind, tail)?;
    if let fdir::Insertion::Added(off) = r {
        if let Some(t) = b.get_mut(off + fdir::DIRENT_FILE_TYPE) {
            *t = e.ftype;
        }
    }
    Ok(r)
}

/// A packed leaf holding `ents` in the given order.
fn pack(c: &Ctx, ents: &[&Ent], lblk: u64) -> Result<Vec<u8>> {
    let mut b = vec![0u8; c.bs];
    fdir::init_empty_leaf(&mut b, c.csum());
    for e in ents {
        if !insert_raw(&mut b, e, c.csum()).map_err(in_block(lblk))? {
            return Err(corrupt(format!(
                "directory block {lblk}: entries do not fit when repacked"
            )));
        }
    }
    Ok(b)
}

/// Live entries of a leaf, "." and ".." excluded when `skip_dots`.
fn live(b: &[u8], c: &Ctx, lblk: u64, skip_dots: bool) -> Result<Vec<Ent>> {
    let mut out = Vec::new();
    for e in fdir::live_entries(b, c.csum()) {
        let e = e.map_err(in_block(lblk))?;
        if skip_dots && (e.name == b"." || e.name == b"..") {
            continue;
        }
        out.push(Ent {
            name: e.name.to_vec(),
            ino: e.inode,
            ftype: e.file_type,
        });
    }
    Ok(out)
}

/// Split the full leaf `lblk` holding `ents` (the kernel's `do_split`) and insert `new`
/// in the half its hash belongs to. Appends the new leaf and writes both; returns the
/// index entry the parent must get right after the old leaf's.
///
/// The split point is the kernel's (by size from the top, or by count when that walk
/// reaches the first entry) whenever the new entry fits the half it goes to. It does
/// not always: by count, large names can all land in one half (1 KiB blocks, a block
/// of four ~240-byte names under four short ones, a ~240-byte newcomer). Then the
/// point is the one, of all that keep hash order, where the new entry fits and the
/// fuller half is least full; one always exists (see `split_point`).
fn split_leaf(
    dir: &mut impl DirStore,
    c: &Ctx,
    v: HashVersion,
    lblk: u64,
    ents: &[Ent],
    new: &Ent,
) -> Result<DxEntry> {
    let count = ents.len();
    if count < 2 {
        return Err(corrupt(format!(
            "directory block {lblk} is full with {count} entries"
        )));
    }
    // (hash, on-disk index), sorted by hash; ties keep on-disk order.
    let mut map: Vec<(u32, usize)> = ents
        .iter()
        .enumerate()
        .map(|(i, e)| (c.hash(&e.name, v), i))
        .collect();
    map.sort_by_key(|&(h, _)| h);
    let sizes: Vec<usize> = map
        .iter()
        .map(|&(_, i)| fdir::rec_len_for(ents[i].name.len()))
        .collect();
    let usable = c.bs - if c.csum() { fdir::TAIL_LEN } else { 0 };
    let new_hash = c.hash(&new.name, v);
    let split = split_point(
        &map,
        &sizes,
        c.bs,
        usable,
        new_hash,
        fdir::rec_len_for(new.name.len()),
    )
    .ok_or_else(|| {
        corrupt(format!(
            "directory block {lblk}: no split leaves room for a new entry"
        ))
    })?;
    let hash2 = map[split].0;
    let continued = hash2 == map[split - 1].0;

    let mut kept_idx: Vec<usize> = map[..split].iter().map(|&(_, i)| i).collect();
    kept_idx.sort_unstable();
    let kept: Vec<&Ent> = kept_idx.iter().map(|&i| &ents[i]).collect();
    let moved_ents: Vec<&Ent> = map[split..].iter().map(|&(_, i)| &ents[i]).collect();

    let new_lblk = dir.append_block()?;
    let new_block = to_u32_block(new_lblk)?;
    let mut old_b = pack(c, &kept, lblk)?;
    let mut new_b = pack(c, &moved_ents, new_lblk)?;
    let (target, tl) = if new_hash >= hash2 {
        (&mut new_b, new_lblk)
    } else {
        (&mut old_b, lblk)
    };
    if !insert_raw(target, new, c.csum()).map_err(in_block(tl))? {
        return Err(corrupt(format!(
            "directory block {tl}: no room for a new entry after a split"
        )));
    }
    write_leaf(dir, c, new_lblk, new_b)?;
    write_leaf(dir, c, lblk, old_b)?;
    Ok(DxEntry {
        hash: hash2 | u32::from(continued),
        block: new_block,
    })
}

/// Where to split a full leaf whose entries, in hash order, have hashes `map[i].0` and
/// record sizes `sizes[i]`: an index `s` in `1..len`, the first `s` staying. A new entry
/// of hash `new_hash` goes to the upper half when `new_hash >= map[s].0`, and must fit
/// there (`new_size` more bytes within `usable`). `None` only if no point fits, which a
/// leaf that held these entries cannot produce: with `q` entries hashed at or below the
/// new one, the point `q - 1` sends it up with the entries from `q - 1`, the point `q`
/// keeps it down with the first `q`, and those two halves together hold the leaf plus
/// one entry (at most `usable + 264` bytes), so the smaller leaves the room a name
/// needs; at the ends one of the two is a single entry.
fn split_point(
    map: &[(u32, usize)],
    sizes: &[usize],
    bs: usize,
    usable: usize,
    new_hash: u32,
    new_size: usize,
) -> Option<usize> {
    let count = map.len();
    // Bytes of the half the new entry joins at point `s`, itself excluded.
    let joined = |s: usize| -> usize {
        if new_hash >= map[s].0 {
            sizes[s..].iter().sum()
        } else {
            sizes[..s].iter().sum()
        }
    };
    let fits = |s: usize| joined(s) + new_size <= usable;
    // The kernel's point: from the top, move entries while more than half of the next
    // one would still lie in the upper half of the block.
    let mut size = 0usize;
    let mut moved = 0usize;
    let mut broke_at = None;
    for i in (0..count).rev() {
        if size + sizes[i] / 2 > bs / 2 {
            broke_at = Some(i);
            break;
        }
        size += sizes[i];
        moved += 1;
    }
    let kernel = match broke_at {
        Some(i) if i > 0 => count - moved,
        _ => count / 2,
    };
    if fits(kernel) {
        return Some(kernel);
    }
    let total: usize = sizes.iter().sum();
    (1..count).filter(|&s| fits(s)).min_by_key(|&s| {
        let lower: usize = sizes[..s].iter().sum();
        let (lower, upper) = if new_hash >= map[s].0 {
            (lower, total - lower + new_size)
        } else {
            (lower + new_size, total - lower)
        };
        lower.max(upper)
    })
}

/// Write index block `lblk` (0: the root, whose other fields are `root`'s) with
/// `entries`.
fn write_frame(
    dir: &mut impl DirStore,
    c: &Ctx,
    root: &DxRoot,
    lblk: u64,
    entries: Vec<DxEntry>,
) -> Result<()> {
    if lblk == 0 {
        let r = DxRoot {
            entries,
            ..root.clone()
        };
        write_root(dir, c, &r)
    } else {
        write_node(dir, c, lblk, entries)
    }
}

/// Add `name` → `ino` to a directory. The caller guarantees the name is absent.
/// `dir_index`: the filesystem has the dir_index feature (a full one-block directory
/// then becomes an htree). Errors: bad names, [`Error::NoSpace`] when the htree is at
/// its maximum depth and full (or the store cannot grow), corruption.
pub fn add_entry(
    dir: &mut impl DirStore,
    name: &[u8],
    ino: u32,
    ftype: FileType,
    dir_index: bool,
) -> Result<()> {
    debug_assert!(
        check_entry_name(name).is_err() || !matches!(lookup(dir, name), Ok(Some(_))),
        "add_entry: name already present"
    );
    add(dir, name, ino, ftype, dir_index, false)
}

/// [`add_entry`] for a name that may be present: [`Error::Exists`] (nothing changed)
/// when it is. In an htree the leaf the name hashes to is searched and given the entry
/// in one walk (a lookup before [`add_entry`] walks it twice), after the leaves its
/// hash may continue into (collision bit) are searched.
pub fn add_new_entry(
    dir: &mut impl DirStore,
    name: &[u8],
    ino: u32,
    ftype: FileType,
    dir_index: bool,
) -> Result<()> {
    add(dir, name, ino, ftype, dir_index, true)
}

fn add(
    dir: &mut impl DirStore,
    name: &[u8],
    ino: u32,
    ftype: FileType,
    dir_index: bool,
    unique: bool,
) -> Result<()> {
    let new = Ent::new(name, ino, ftype)?;
    let c = Ctx::new(dir);
    c.check_new_name(name)?;
    if dir.is_indexed() {
        return add_indexed(dir, &c, &new, unique);
    }
    if unique && find(dir, &c, name)?.is_some() {
        return Err(Error::Exists);
    }
    let n = dir.nblocks();
    if n == 0 {
        return Err(corrupt("directory has no blocks".into()));
    }
    for lblk in 0..n {
        if change_leaf(dir, &c, lblk, |b| {
            insert_raw(b, &new, c.csum()).map_err(in_block(lblk))
        })? {
            return Ok(());
        }
        if n == 1 && dir_index {
            let b = read_leaf(dir, &c, lblk)?;
            return make_indexed(dir, &c, b, &new);
        }
    }
    let lblk = dir.append_block()?;
    let mut b = vec![0u8; c.bs];
    fdir::init_empty_leaf(&mut b, c.csum());
    if !insert_raw(&mut b, &new, c.csum()).map_err(in_block(lblk))? {
        return Err(corrupt(format!("directory block {lblk}: new block full")));
    }
    write_leaf(dir, &c, lblk, b)
}

/// Convert the full one-block directory whose block 0 is `b0` to an htree and add `new`.
fn make_indexed(dir: &mut impl DirStore, c: &Ctx, b0: Vec<u8>, new: &Ent) -> Result<()> {
    let mut it = fdir::entries(&b0, c.csum());
    let dot = it.next().transpose().map_err(in_block(0))?;
    let dotdot = it.next().transpose().map_err(in_block(0))?;
    let (dot_inode, dotdot_inode) = match (dot, dotdot) {
        (Some(d), Some(dd)) if d.name == b"." && dd.name == b".." => (d.inode, dd.inode),
        _ => {
            return Err(corrupt(
                "directory block 0 does not start with \".\" and \"..\"".into(),
            ))
        }
    };
    let ents = live(&b0, c, 0, true)?;
    let v = c.version(c.def_hash)?;
    let leaf = dir.append_block()?;
    let mut root = DxRoot {
        dot_inode,
        dotdot_inode,
        hash_version: c.def_hash,
        indirect_levels: 0,
        entries: vec![DxEntry {
            hash: 0,
            block: to_u32_block(leaf)?,
        }],
    };
    if ents.len() >= 2 {
        let e = split_leaf(dir, c, v, leaf, &ents, new)?;
        root.entries.push(e);
    } else {
        // Cannot happen with real block sizes; keep everything in one leaf.
        let mut all: Vec<&Ent> = ents.iter().collect();
        all.push(new);
        let b = pack(c, &all, leaf)?;
        write_leaf(dir, c, leaf, b)?;
    }
    write_root(dir, c, &root)?;
    dir.set_indexed(true)
}

/// Add `new` to an htree; with `unique`, [`Error::Exists`] when the name is there.
fn add_indexed(dir: &mut impl DirStore, c: &Ctx, new: &Ent, unique: bool) -> Result<()> {
    // Once searched, the name stays absent: a restart only grew the index above.
    let mut search = unique;
    for _ in 0..MAX_RESTARTS {
        let (root, rb) = read_root(dir, c)?;
        let v = c.version(root.hash_version)?;
        let hash = c.hash(&new.name, v);
        let frames = probe(dir, c, &rb, root.indirect_levels, hash)?;
        let last = frames.len() - 1;
        let leaf = frames[last].child(c)?;
        let added = if search {
            search = false;
            // The leaves after this one that the hash continues into come first.
            if chain_continues(c, &frames, hash)? {
                let mut rest = NameLeaves {
                    hashed: Some((root.indirect_levels, hash, frames.clone())),
                    given: 1,
                    limit: dir.nblocks().max(1),
                };
                if first_holding(&mut rest, dir, c, &new.name)?.is_some() {
                    return Err(Error::Exists);
                }
            }
            insert_unique_in(dir, c, leaf, new)?
        } else {
            change_leaf(dir, c, leaf, |b| {
                insert_raw(b, new, c.csum()).map_err(in_block(leaf))
            })?
        };
        if added {
            return Ok(());
        }
        let b = read_leaf(dir, c, leaf)?;
        let limit = |k: usize| {
            if k == 0 {
                c.root_limit()
            } else {
                c.node_limit()
            }
        };
        if frames[last].entries(c)?.len() >= limit(last) {
            grow_index(dir, c, &root, &frames, limit)?;
            continue;
        }
        let ents = live(&b, c, leaf, false)?;
        let e = split_leaf(dir, c, v, leaf, &ents, new)?;
        let f = &frames[last];
        let mut entries = f.entries(c)?.to_vec();
        entries.insert(f.at + 1, e);
        return write_frame(dir, c, &root, f.lblk, entries);
    }
    Err(corrupt(
        "directory index keeps growing while adding one name".into(),
    ))
}

/// Add `new` to leaf `leaf` unless a live entry has its name ([`Error::Exists`]):
/// whether it had room.
fn insert_unique_in(dir: &mut impl DirStore, c: &Ctx, leaf: u64, new: &Ent) -> Result<bool> {
    let mut exists = false;
    let added = change_leaf(dir, c, leaf, |b| {
        if c.casefold.is_some() && c.find_in(b, &new.name, leaf)?.is_some() {
            exists = true;
            return Ok(false);
        }
        match insert_new(b, new, c.csum()).map_err(in_block(leaf))? {
            fdir::Insertion::Added(_) => Ok(true),
            fdir::Insertion::Exists => {
                exists = true;
                Ok(false)
            }
            fdir::Insertion::NoRoom => Ok(false),
        }
    })?;
    if exists {
        return Err(Error::Exists);
    }
    Ok(added)
}

/// The one leaf of an htree that holds `name` or would take it — `None` when there is
/// no such single leaf (a linear directory; a hash whose group continues into the
/// next leaf). With it, adding or removing `name` changes that leaf alone
/// ([`add_to_leaf`], [`remove_from_leaf`]) while the index stays as it is, so callers
/// that keep the index from changing (a shared directory lock: splits and growth take
/// it exclusively) may do that beside each other, one leaf lock each.
pub fn only_leaf_for(dir: &impl DirStore, name: &[u8]) -> Result<Option<u64>> {
    check_entry_name(name)?;
    if !dir.is_indexed() {
        return Ok(None);
    }
    let c = Ctx::new(dir);
    let (root, rb) = read_root(dir, &c)?;
    let hash = c.hash(name, c.version(root.hash_version)?);
    let frames = probe(dir, &c, &rb, root.indirect_levels, hash)?;
    if chain_continues(&c, &frames, hash)? {
        return Ok(None);
    }
    Ok(Some(frames[frames.len() - 1].child(&c)?))
}

/// Add `name` → `ino` to leaf `leaf` (from [`only_leaf_for`]) unless present
/// ([`Error::Exists`]): whether it had room (if not, nothing changed and the caller
/// adds it with [`add_new_entry`], which may split the leaf).
pub fn add_to_leaf(
    dir: &mut impl DirStore,
    leaf: u64,
    name: &[u8],
    ino: u32,
    ftype: FileType,
) -> Result<bool> {
    let new = Ent::new(name, ino, ftype)?;
    let c = Ctx::new(dir);
    c.check_new_name(name)?;
    insert_unique_in(dir, &c, leaf, &new)
}

/// Remove `name` from leaf `leaf` (from [`only_leaf_for`]) if it names inode `ino`:
/// `(inode, raw file type)` it named, `None` (nothing changed) if the leaf has no
/// such entry.
pub fn remove_from_leaf(
    dir: &mut impl DirStore,
    leaf: u64,
    name: &[u8],
    ino: u32,
) -> Result<Option<(u32, u8)>> {
    check_entry_name(name)?;
    let c = Ctx::new(dir);
    let mut removed = None;
    change_leaf(dir, &c, leaf, |b| {
        let stored = c.stored_name(b, name, leaf)?;
        removed = fdir::remove_entry_naming(b, &stored, ino, c.csum()).map_err(in_block(leaf))?;
        Ok(removed.is_some())
    })?;
    Ok(removed)
}

/// Make room in the index above a full leaf whose parent is full (the kernel's
/// index-split half of `ext4_dx_add_entry`); the caller then starts over.
fn grow_index(
    dir: &mut impl DirStore,
    c: &Ctx,
    root: &DxRoot,
    frames: &[Frame],
    limit: impl Fn(usize) -> usize,
) -> Result<()> {
    // The highest full index block below a parent with room, or the root.
    let mut k = frames.len() - 1;
    while k > 0 && frames[k - 1].entries(c)?.len() >= limit(k - 1) {
        k -= 1;
    }
    if k == 0 {
        if root.indirect_levels >= c.max_levels() {
            return Err(Error::NoSpace);
        }
        let nb = dir.append_block()?;
        write_node(dir, c, nb, frames[0].entries(c)?.to_vec())?;
        let r = DxRoot {
            indirect_levels: root.indirect_levels + 1,
            entries: vec![DxEntry {
                hash: 0,
                block: to_u32_block(nb)?,
            }],
            ..root.clone()
        };
        return write_root(dir, c, &r);
    }
    let f = &frames[k];
    let fentries = f.entries(c)?.to_vec();
    let icount1 = fentries.len() / 2;
    let right = fentries[icount1..].to_vec();
    let hash2 = right[0].hash;
    let nb = dir.append_block()?;
    let nb32 = to_u32_block(nb)?;
    write_node(dir, c, nb, right)?;
    write_node(dir, c, f.lblk, fentries[..icount1].to_vec())?;
    let parent = &frames[k - 1];
    let mut pentries = parent.entries(c)?.to_vec();
    pentries.insert(
        parent.at + 1,
        DxEntry {
            hash: hash2,
            block: nb32,
        },
    );
    write_frame(dir, c, root, parent.lblk, pentries)
}

/// Remove the entry `name`: `(inode, raw file type)` it named, `None` if absent. Each
/// leaf the name may be in is searched and changed in one walk, in place.
pub fn remove_entry(dir: &mut impl DirStore, name: &[u8]) -> Result<Option<(u32, u8)>> {
    check_entry_name(name)?;
    let c = Ctx::new(dir);
    let mut leaves = NameLeaves::new(dir, &c, name)?;
    while let Some(leaf) = leaves.next(dir, &c)? {
        let mut removed = None;
        change_leaf(dir, &c, leaf, |b| {
            let stored = c.stored_name(b, name, leaf)?;
            removed = fdir::remove_entry_typed(b, &stored, c.csum()).map_err(in_block(leaf))?;
            Ok(removed.is_some())
        })?;
        if removed.is_some() {
            return Ok(removed);
        }
    }
    Ok(None)
}

/// Point the existing entry `name` at `new_ino` (rename over an existing name); returns
/// the inode it named before, `None` if absent.
pub fn replace_entry(
    dir: &mut impl DirStore,
    name: &[u8],
    new_ino: u32,
    new_ftype: FileType,
) -> Result<Option<u32>> {
    check_entry_name(name)?;
    if new_ino == 0 {
        return Err(Error::InvalidInput("directory entry for inode 0".into()));
    }
    let c = Ctx::new(dir);
    let Some((lblk, mut b)) = find(dir, &c, name)? else {
        return Ok(None);
    };
    let Some(e) = c.find_in(&b, name, lblk)? else {
        return Ok(None);
    };
    let (off, old) = (e.offset, e.inode);
    rext4_format::bytes::set_le32(&mut b, off + fdir::DIRENT_INODE, new_ino);
    rext4_format::bytes::set_u8(&mut b, off + fdir::DIRENT_FILE_TYPE, new_ftype as u8);
    write_leaf(dir, &c, lblk, b)?;
    Ok(Some(old))
}

/// Set ".." of the directory (block 0, linear or dx root) to `parent_ino`.
pub fn set_dotdot(dir: &mut impl DirStore, parent_ino: u32) -> Result<()> {
    let c = Ctx::new(dir);
    if dir.is_indexed() {
        let mut b = read_index(dir, &c, 0)?.to_vec();
        rext4_format::bytes::set_le32(&mut b, fdir::MIN_REC_LEN + fdir::DIRENT_INODE, parent_ino);
        return write_index(dir, &c, 0, b);
    }
    let mut b = read_leaf(dir, &c, 0)?;
    let off = {
        let mut it = fdir::entries(&b, c.csum());
        let _dot = it.next();
        match it.next().transpose().map_err(in_block(0))? {
            Some(e) if e.name == b".." => e.offset,
            _ => return Err(corrupt("directory block 0 has no \"..\" entry".into())),
        }
    };
    rext4_format::bytes::set_le32(&mut b, off + fdir::DIRENT_INODE, parent_ino);
    write_leaf(dir, &c, 0, b)
}

/// Logical blocks of the htree index (root and nodes); empty for a linear directory.
fn index_blocks(dir: &impl DirStore, c: &Ctx) -> Result<BTreeSet<u64>> {
    let mut set = BTreeSet::new();
    if !dir.is_indexed() {
        return Ok(set);
    }
    let n = dir.nblocks();
    let (root, rb) = read_root(dir, c)?;
    set.insert(0);
    let mut level: Vec<u64> = root_view(c, &rb)?
        .1
        .to_vec()
        .iter()
        .map(|e| u64::from(e.block))
        .collect();
    for _ in 0..root.indirect_levels {
        let mut next = Vec::new();
        for b in level {
            if b == 0 || b >= n || !set.insert(b) {
                return Err(corrupt(format!(
                    "directory index block {b} out of range or referenced twice"
                )));
            }
            let node = read_index(dir, c, b)?;
            let ents = DxNode::view(&node, c.csum()).map_err(in_block(b))?;
            next.extend((0..ents.len()).map(|i| u64::from(ents.get(i).block)));
        }
        level = next;
    }
    Ok(set)
}

/// Whether the directory holds nothing but "." and "..".
pub fn is_empty(dir: &impl DirStore) -> Result<bool> {
    let c = Ctx::new(dir);
    let skip = index_blocks(dir, &c)?;
    for lblk in 0..dir.nblocks() {
        if skip.contains(&lblk) {
            continue;
        }
        let b = read_leaf(dir, &c, lblk)?;
        if !live(&b, &c, lblk, true)?.is_empty() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Format block 0 of a new directory ("." → `self_ino`, ".." → `parent_ino`); the
/// caller has appended it.
pub fn init_dir(dir: &mut impl DirStore, self_ino: u32, parent_ino: u32) -> Result<()> {
    let c = Ctx::new(dir);
    if dir.nblocks() == 0 {
        return Err(Error::InvalidInput("init_dir: no block 0".into()));
    }
    let mut b = vec![0u8; c.bs];
    fdir::init_block(&mut b, self_ino, parent_ino, c.csum());
    write_leaf(dir, &c, 0, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rext4_format::hash::{FLAG_SIGNED_HASH, FLAG_UNSIGNED_HASH};
    use std::collections::{BTreeMap, HashMap, HashSet};
    use std::sync::OnceLock;

    // ------------------------------------------------------------ in-memory store

    #[derive(Clone, Copy, Debug)]
    struct Cfg {
        bs: usize,
        csum: bool,
        flags: u32,
        def_hash: u8,
        largedir: bool,
        dir_index: bool,
    }

    const SELF_INO: u32 = 100;
    const PARENT_INO: u32 = 2;

    struct MemDir {
        cfg: Cfg,
        blocks: Vec<Vec<u8>>,
        indexed: bool,
        self_ino: u32,
        /// Inode checksum seed used when `cfg.csum`.
        inode_seed: u32,
        hash_seed: [u32; 4],
    }

    impl MemDir {
        fn new(cfg: Cfg) -> MemDir {
            let seeds = [0x1234_5678, 0x9abc_def0, 0x0fed_cba9, 0x8765_4321];
            MemDir::with(cfg, SELF_INO, 0x5EED_1234, seeds)
        }
        fn with(cfg: Cfg, self_ino: u32, inode_seed: u32, hash_seed: [u32; 4]) -> MemDir {
            let mut d = MemDir {
                cfg,
                blocks: Vec::new(),
                indexed: false,
                self_ino,
                inode_seed,
                hash_seed,
            };
            d.append_block().expect("append");
            init_dir(&mut d, self_ino, PARENT_INO).expect("init_dir");
            d
        }
        fn seed(&self) -> Option<u32> {
            self.cfg.csum.then_some(self.inode_seed)
        }
    }

    impl DirStore for MemDir {
        fn block_size(&self) -> usize {
            self.cfg.bs
        }
        fn nblocks(&self) -> u64 {
            self.blocks.len() as u64
        }
        fn read_block(&self, lblk: u64) -> Result<Vec<u8>> {
            self.blocks
                .get(lblk as usize)
                .cloned()
                .ok_or_else(|| Error::InvalidInput(format!("read past end: {lblk}")))
        }
        fn write_block(&mut self, lblk: u64, data: &[u8]) -> Result<()> {
            assert_eq!(data.len(), self.cfg.bs);
            let b = self
                .blocks
                .get_mut(lblk as usize)
                .expect("write past the end of the directory");
            b.copy_from_slice(data);
            Ok(())
        }
        fn read_leaf(&self, lblk: u64) -> Result<Vec<u8>> {
            let b = self.read_block(lblk)?;
            match self.seed() {
                Some(s) => fdir::verify_leaf(&b, s),
                None => fdir::check_block(&b, false),
            }?;
            Ok(b)
        }
        fn append_block(&mut self) -> Result<u64> {
            // Garbage, so nothing relies on a zeroed new block.
            self.blocks.push(vec![0xA5; self.cfg.bs]);
            Ok(self.blocks.len() as u64 - 1)
        }
        fn is_indexed(&self) -> bool {
            self.indexed
        }
        fn set_indexed(&mut self, on: bool) -> Result<()> {
            self.indexed = on;
            Ok(())
        }
        fn csum_seed(&self) -> Option<u32> {
            self.seed()
        }
        fn hash_params(&self) -> ([u32; 4], u32, u8) {
            (self.hash_seed, self.cfg.flags, self.cfg.def_hash)
        }
        fn largedir(&self) -> bool {
            self.cfg.largedir
        }
    }

    fn cfg(bs: usize, csum: bool, flags: u32, def_hash: u8) -> Cfg {
        Cfg {
            bs,
            csum,
            flags,
            def_hash,
            largedir: false,
            dir_index: true,
        }
    }

    type Model = BTreeMap<Vec<u8>, (u32, u8)>;

    // ------------------------------------------------------------ independent checker

    #[derive(Debug, Default)]
    struct Stats {
        levels: u8,
        leaves: usize,
        /// Index entries carrying the collision bit.
        continuations: usize,
        /// Leaves holding a name whose hash equals the next index entry's (continued
        /// collision groups split across leaves).
        split_groups: usize,
    }

    fn verify_leaf_block(d: &MemDir, lblk: usize) -> Vec<(Vec<u8>, u32, u8)> {
        let b = &d.blocks[lblk];
        match d.seed() {
            Some(s) => fdir::verify_leaf(b, s).expect("leaf verifies"),
            None => {
                fdir::check_block(b, false).expect("leaf parses");
                assert!(!fdir::tail_present(b), "tail without metadata_csum");
            }
        }
        fdir::live_entries(b, d.cfg.csum)
            .map(|e| {
                let e = e.expect("entry");
                (e.name.to_vec(), e.inode, e.file_type)
            })
            .collect()
    }

    fn verify_index_block(d: &MemDir, lblk: usize) {
        if let Some(s) = d.seed() {
            fdir::verify_dx_csum(&d.blocks[lblk], s).expect("dx csum");
        }
    }

    /// Flatten the index: `(effective index hash, leaf)` in order. A node's first entry
    /// inherits its parent entry's hash.
    fn walk(
        d: &MemDir,
        entries: &[DxEntry],
        first_hash: u32,
        depth: u8,
        flat: &mut Vec<(u32, usize)>,
        index: &mut HashSet<usize>,
    ) {
        for (i, e) in entries.iter().enumerate() {
            let h = if i == 0 { first_hash } else { e.hash };
            let b = e.block as usize;
            assert!(b > 0 && b < d.blocks.len(), "index points at {b}");
            if depth == 0 {
                flat.push((h, b));
            } else {
                assert!(index.insert(b), "index node {b} twice");
                verify_index_block(d, b);
                let node = DxNode::decode(&d.blocks[b], d.cfg.csum).expect("dx node");
                walk(d, &node.entries, h, depth - 1, flat, index);
            }
        }
    }

    /// Check every structural invariant and the contents against `model`.
    fn check(d: &MemDir, model: &Model) -> Stats {
        let v = |on_disk| HashVersion::effective(on_disk, d.cfg.flags).expect("version");
        let (seed, _, _) = d.hash_params();
        let mut stats = Stats::default();
        let mut seen: Model = BTreeMap::new();
        let add = |names: Vec<(Vec<u8>, u32, u8)>, seen: &mut Model| {
            for (n, i, t) in names {
                if n == b"." || n == b".." {
                    continue;
                }
                assert!(seen.insert(n.clone(), (i, t)).is_none(), "{n:?} twice");
            }
        };
        if d.indexed {
            verify_index_block(d, 0);
            let root = DxRoot::decode(&d.blocks[0], d.cfg.csum, d.cfg.largedir).expect("root");
            assert_eq!(
                (root.dot_inode, root.hash_version),
                (d.self_ino, d.cfg.def_hash)
            );
            stats.levels = root.indirect_levels;
            let ver = v(root.hash_version);
            let mut flat = Vec::new();
            let mut index = HashSet::from([0usize]);
            walk(
                d,
                &root.entries,
                0,
                root.indirect_levels,
                &mut flat,
                &mut index,
            );
            let leaves: HashSet<usize> = flat.iter().map(|&(_, b)| b).collect();
            assert_eq!(leaves.len(), flat.len(), "a leaf referenced twice");
            assert!(leaves.is_disjoint(&index));
            assert_eq!(leaves.len() + index.len(), d.blocks.len(), "orphan blocks");
            stats.leaves = flat.len();
            for (i, &(h, leaf)) in flat.iter().enumerate() {
                if h & 1 == 1 {
                    stats.continuations += 1;
                }
                let next = flat.get(i + 1).map(|&(nh, _)| nh);
                if let Some(nh) = next {
                    assert!(nh >= h, "index hashes out of order");
                }
                let names = verify_leaf_block(d, leaf);
                for (n, _, _) in &names {
                    let nh = dx_hash(n, ver, &seed).0;
                    assert!(nh >= h & !1, "{n:?} below its leaf's range");
                    if let Some(next) = next {
                        let ok = nh < next & !1 || (nh == next & !1 && next & 1 == 1);
                        assert!(ok, "{n:?} above its leaf's range");
                        if nh == next & !1 {
                            stats.split_groups += 1;
                        }
                    }
                }
                add(names, &mut seen);
            }
        } else {
            for lblk in 0..d.blocks.len() {
                let names = verify_leaf_block(d, lblk);
                if lblk == 0 {
                    assert_eq!(names[0], (b".".to_vec(), d.self_ino, 2));
                    assert_eq!(names[1].0, b"..".to_vec());
                }
                add(names, &mut seen);
            }
        }
        assert_eq!(&seen, model, "readdir differs from the model");
        for (n, &want) in model {
            assert_eq!(lookup(d, n).expect("lookup"), Some(want), "lookup {n:?}");
            let mut absent = n.clone();
            if absent.len() < 255 {
                absent.push(b'~');
                if !model.contains_key(&absent) {
                    assert_eq!(lookup(d, &absent).expect("lookup"), None);
                }
            }
        }
        assert_eq!(lookup(d, b".").expect("."), Some((d.self_ino, 2)));
        stats
    }

    // ------------------------------------------------------------ names

    fn xorshift(x: &mut u32) -> u32 {
        *x ^= *x << 13;
        *x ^= *x >> 17;
        *x ^= *x << 5;
        *x
    }

    /// A name of `len` bytes (all values except NUL, '/', '.'), unique per `idx` for
    /// len ≥ 4.
    fn name_of(idx: u32, len: usize) -> Vec<u8> {
        let mut x = idx.wrapping_mul(0x9E37_79B9) | 1;
        let mut v: Vec<u8> = idx.to_le_bytes().iter().map(|b| b | 0x80).collect();
        v.truncate(len);
        while v.len() < len {
            let b = (xorshift(&mut x) >> 24) as u8;
            v.push(match b {
                0 => 1,
                b'/' => b'_',
                b'.' => b'-',
                b => b,
            });
        }
        v
    }

    /// Pool name `idx` for the property tests: mixed lengths, high bytes included.
    fn pool_name(idx: u32) -> Vec<u8> {
        if let Some(p) = idx.checked_sub(POOL) {
            let pairs = legacy_pairs();
            let (a, b) = &pairs[(p / 2) as usize % pairs.len()];
            return if p % 2 == 0 { a.clone() } else { b.clone() };
        }
        let len = if idx.is_multiple_of(4) {
            1 + (idx / 4 % 12) as usize
        } else {
            12 + (idx.wrapping_mul(7919) % 244) as usize
        };
        name_of(idx, len)
    }

    const POOL: u32 = 300;
    const COLLIDERS: u32 = 120;

    /// ASCII names with equal legacy hashes (signed = unsigned for ASCII), found by a
    /// birthday search.
    fn legacy_pairs() -> &'static Vec<(Vec<u8>, Vec<u8>)> {
        static PAIRS: OnceLock<Vec<(Vec<u8>, Vec<u8>)>> = OnceLock::new();
        PAIRS.get_or_init(|| {
            let cname = |i: u32| format!("c{i:07x}").into_bytes();
            let mut seen: HashMap<u32, u32> = HashMap::with_capacity(1 << 20);
            let mut out = Vec::new();
            for i in 0..(1u32 << 20) {
                let h = dx_hash(&cname(i), HashVersion::Legacy, &[0; 4]).0;
                if let Some(j) = seen.insert(h, i) {
                    out.push((cname(j), cname(i)));
                }
            }
            assert!(out.len() >= 100, "only {} legacy collisions", out.len());
            for (a, b) in &out {
                let u = HashVersion::LegacyUnsigned;
                assert_eq!(dx_hash(a, u, &[0; 4]).0, dx_hash(b, u, &[0; 4]).0);
            }
            out
        })
    }

    // ------------------------------------------------------------ model runner

    #[derive(Debug, Clone)]
    enum Op {
        Add(u32, u8, u32),
        Remove(u32),
        Replace(u32, u8, u32),
    }

    fn ftype(t: u8) -> FileType {
        FileType::from_u8(t).expect("type 1..=7")
    }

    fn apply(d: &mut MemDir, model: &mut Model, op: &Op) {
        match *op {
            Op::Add(idx, t, ino) => {
                let n = pool_name(idx);
                let di = d.cfg.dir_index;
                if model.contains_key(&n) {
                    // Refused, nothing changed (the check after the run sees it).
                    let r = add_new_entry(d, &n, ino, ftype(t), di);
                    assert!(matches!(r, Err(Error::Exists)), "add {n:?} again: {r:?}");
                    return;
                }
                if idx % 2 == 0 {
                    add_entry(d, &n, ino, ftype(t), di).expect("add");
                } else {
                    add_new_entry(d, &n, ino, ftype(t), di).expect("add new");
                }
                model.insert(n, (ino, t));
            }
            Op::Remove(idx) => {
                let n = pool_name(idx);
                let got = remove_entry(d, &n).expect("remove");
                assert_eq!(got, model.remove(&n), "remove {n:?}");
            }
            Op::Replace(idx, t, ino) => {
                let n = pool_name(idx);
                let got = replace_entry(d, &n, ino, ftype(t)).expect("replace");
                let old = model.get(&n).map(|&(i, _)| i);
                assert_eq!(got, old, "replace {n:?}");
                if old.is_some() {
                    model.insert(n, (ino, t));
                }
            }
        }
    }

    fn op_strategy(colliders: bool) -> impl Strategy<Value = Op> {
        let hi = if colliders { POOL + COLLIDERS } else { POOL };
        prop_oneof![
            4 => (0..hi, 1u8..=7, 11u32..100_000).prop_map(|(i, t, n)| Op::Add(i, t, n)),
            1 => (0..hi).prop_map(Op::Remove),
            1 => (0..hi, 1u8..=7, 11u32..100_000).prop_map(|(i, t, n)| Op::Replace(i, t, n)),
        ]
    }

    fn run_model(c: Cfg, ops: &[Op]) -> Stats {
        let mut d = MemDir::new(c);
        let mut model = Model::new();
        for op in ops {
            apply(&mut d, &mut model, op);
        }
        let s = check(&d, &model);
        assert_eq!(is_empty(&d).expect("is_empty"), model.is_empty());
        s
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn model_1k_csum_signed_half_md4(ops in prop::collection::vec(op_strategy(false), 1..400)) {
            run_model(cfg(1024, true, FLAG_SIGNED_HASH, 1), &ops);
        }

        #[test]
        fn model_1k_nocsum_unsigned_tea(ops in prop::collection::vec(op_strategy(false), 1..400)) {
            run_model(cfg(1024, false, FLAG_UNSIGNED_HASH, 2), &ops);
        }

        #[test]
        fn model_1k_csum_legacy_collisions(ops in prop::collection::vec(op_strategy(true), 1..400)) {
            run_model(cfg(1024, true, FLAG_SIGNED_HASH, 0), &ops);
        }

        #[test]
        fn model_4k_csum_unsigned_half_md4(ops in prop::collection::vec(op_strategy(true), 1..400)) {
            run_model(cfg(4096, true, FLAG_UNSIGNED_HASH, 1), &ops);
        }

        #[test]
        fn model_4k_nocsum_signed_legacy(ops in prop::collection::vec(op_strategy(true), 1..400)) {
            run_model(cfg(4096, false, FLAG_SIGNED_HASH, 0), &ops);
        }

        #[test]
        fn model_1k_linear_without_dir_index(ops in prop::collection::vec(op_strategy(false), 1..300)) {
            let mut c = cfg(1024, true, FLAG_SIGNED_HASH, 1);
            c.dir_index = false;
            run_model(c, &ops);
        }
    }

    #[test]
    fn all_pool_names_in_one_directory() {
        for c in [
            cfg(1024, true, FLAG_SIGNED_HASH, 0),
            cfg(1024, false, FLAG_UNSIGNED_HASH, 0),
            cfg(4096, true, FLAG_SIGNED_HASH, 0),
        ] {
            let ops: Vec<Op> = (0..POOL + COLLIDERS)
                .map(|i| Op::Add(i, 1 + (i % 7) as u8, 11 + i))
                .collect();
            let s = run_model(c, &ops);
            assert!(s.leaves > 10, "{c:?}: {s:?}");
        }
    }

    /// The leaf proptest found (1 KiB blocks, metadata_csum): by count, the kernel's
    /// point keeps the four large names together, and a 237-byte name hashed among
    /// them no longer fits beside them. Another point must be taken, one where it fits.
    #[test]
    fn split_point_moves_when_the_new_entry_would_not_fit() {
        let hashes = [
            0xd7b4_fbc6,
            0xddbb_a990,
            0xe002_7e66,
            0xe73b_ebea,
            0xf3b9_3900,
            0xf3b9_3900,
            0xf51e_67ee,
            0xfbef_f310,
        ];
        let sizes = [252, 200, 92, 228, 16, 16, 12, 16];
        let map: Vec<(u32, usize)> = hashes.iter().copied().zip(0..).collect();
        let usable = 1024 - fdir::TAIL_LEN;
        let (new_hash, new_size) = (0xe89b_c94e, fdir::rec_len_for(237));
        let s = split_point(&map, &sizes, 1024, usable, new_hash, new_size).expect("a point");
        assert_ne!(
            s, 4,
            "the kernel's point by count, where the name does not fit"
        );
        let joined: usize = if new_hash >= hashes[s] {
            sizes[s..].iter().sum()
        } else {
            sizes[..s].iter().sum()
        };
        assert!(
            joined + new_size <= usable,
            "point {s}: {joined} + {new_size}"
        );
    }

    proptest! {
        // Cheap cases, and the failing shapes are rare: many of them.
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        /// Every full leaf of 1 KiB (the tightest), with or without the checksum tail
        /// and with colliding hashes, has a point where any new name fits.
        #[test]
        fn split_point_always_leaves_room(
            // Short and long names mixed: the shapes where halves by count differ most
            // from halves by size.
            lens in prop::collection::vec(prop_oneof![1usize..=16, 180usize..=255], 24..80),
            hashes in prop::collection::vec(0u32..16, 80),
            new_len in 1usize..=255,
            new_hash in 0u32..16,
            csum in any::<bool>(),
        ) {
            let usable = 1024 - if csum { fdir::TAIL_LEN } else { 0 };
            // The longest prefix of `lens` that fits a leaf: a leaf full for the next
            // name, whose room is less than that name's record.
            let mut sizes = Vec::new();
            let mut full = false;
            for &l in &lens {
                if sizes.iter().sum::<usize>() + fdir::rec_len_for(l) > usable {
                    full = true;
                    break;
                }
                sizes.push(fdir::rec_len_for(l));
            }
            prop_assume!(full && sizes.len() >= 2);
            // The new name is at least as long as the room allows, so it must split.
            let room = usable - sizes.iter().sum::<usize>();
            let new_size = fdir::rec_len_for(new_len.max(room.saturating_sub(7)));
            prop_assert!(new_size > room);
            let mut h: Vec<u32> = hashes[..sizes.len()].iter().map(|x| x * 2).collect();
            h.sort_unstable();
            let map: Vec<(u32, usize)> = h.iter().copied().zip(0..).collect();
            let nh = new_hash * 2;
            let s = split_point(&map, &sizes, 1024, usable, nh, new_size);
            let Some(s) = s else {
                return Err(TestCaseError::fail(format!("no point: {sizes:?} {h:?} new {nh} {new_size}")));
            };
            prop_assert!((1..sizes.len()).contains(&s));
            let joined: usize = if nh >= h[s] { sizes[s..].iter().sum() } else { sizes[..s].iter().sum() };
            prop_assert!(joined + new_size <= usable);
        }
    }

    /// Only colliding names, short ones so a leaf holds many: splits land inside
    /// collision groups and lookups must follow the collision bit to the next leaf.
    #[test]
    fn collision_groups_split_across_leaves() {
        let pairs = legacy_pairs();
        for c in [
            cfg(1024, true, FLAG_SIGNED_HASH, 0),
            cfg(1024, false, FLAG_UNSIGNED_HASH, 0),
        ] {
            let mut d = MemDir::new(c);
            let mut model = Model::new();
            // A filler between the two names of a pair, so that a pair's names do not
            // always sit at an even position in hash order (the split point is then
            // odd, between pairs, for equal-size names).
            for (i, (a, b)) in pairs.iter().enumerate() {
                let filler = format!("f{i:07x}").into_bytes();
                for n in [a, &filler, b] {
                    add_entry(&mut d, n, 11 + i as u32, FileType::Regular, true).expect("add");
                    model.insert(n.clone(), (11 + i as u32, 1));
                }
            }
            let s = check(&d, &model);
            assert!(s.continuations >= 3 && s.split_groups >= 3, "{s:?}");
            // Every name again, unless present: refused, also where its hash's group
            // continues into the next leaf; nothing changed.
            for n in model.keys() {
                let r = add_new_entry(&mut d, n, 5, FileType::Fifo, true);
                assert!(matches!(r, Err(Error::Exists)), "{n:?}: {r:?}");
            }
            check(&d, &model);
            // Remove the first name of every pair, then the rest.
            for (a, _) in pairs {
                assert!(remove_entry(&mut d, a).expect("remove").is_some());
                model.remove(a);
            }
            check(&d, &model);
            for (_, b) in pairs {
                assert_eq!(lookup(&d, b).expect("lookup").map(|(_, t)| t), Some(1));
                assert!(remove_entry(&mut d, b).expect("remove").is_some());
                assert_eq!(remove_entry(&mut d, b).expect("remove again"), None);
            }
            model.retain(|n, _| n[0] == b'f');
            check(&d, &model);
            assert!(!is_empty(&d).expect("is_empty"));
        }
    }

    /// Add `count` names of `len` bytes (and, if asked, every legacy collision pair
    /// spread among them) until done or `NoSpace`.
    fn fill(c: Cfg, count: u32, len: usize, colliders: bool) -> (MemDir, Model, bool) {
        let mut d = MemDir::new(c);
        let mut model = Model::new();
        let pairs = if colliders {
            legacy_pairs().as_slice()
        } else {
            &[]
        };
        let every = (count as usize / pairs.len().max(1)).max(1);
        let mut next_pair = 0;
        for i in 0..count {
            let mut names = vec![name_of(i, len)];
            if (i as usize).is_multiple_of(every) {
                if let Some((a, b)) = pairs.get(next_pair) {
                    names.push(a.clone());
                    names.push(b.clone());
                    next_pair += 1;
                }
            }
            for n in names {
                let ino = 11 + i;
                match add_entry(&mut d, &n, ino, FileType::Regular, true) {
                    Ok(()) => {
                        model.insert(n, (ino, 1));
                    }
                    Err(Error::NoSpace) => return (d, model, true),
                    Err(e) => panic!("add {i}: {e}"),
                }
            }
        }
        (d, model, false)
    }

    #[test]
    fn hundred_thousand_names_1k_csum_legacy() {
        let c = cfg(1024, true, FLAG_SIGNED_HASH, 0);
        let (mut d, mut model, full) = fill(c, 100_000, 40, true);
        assert!(!full);
        let s = check(&d, &model);
        eprintln!("{s:?} blocks {}", d.blocks.len());
        assert_eq!(s.levels, 1);
        assert!(s.continuations >= 1 && s.split_groups >= 1, "{s:?}");
        // Remove every other name; the directory keeps its size.
        let n = d.blocks.len();
        let names: Vec<Vec<u8>> = model.keys().step_by(2).cloned().collect();
        for name in names {
            let want = model.remove(&name);
            assert_eq!(remove_entry(&mut d, &name).expect("remove"), want);
        }
        assert_eq!(d.blocks.len(), n);
        check(&d, &model);
    }

    #[test]
    fn hundred_thousand_names_4k_nocsum_unsigned() {
        let c = cfg(4096, false, FLAG_UNSIGNED_HASH, 1);
        let (d, model, full) = fill(c, 100_000, 40, false);
        assert!(!full);
        let s = check(&d, &model);
        eprintln!("{s:?} blocks {}", d.blocks.len());
        assert_eq!(s.levels, 1);
    }

    /// Long names on 1 KiB blocks overflow two levels: `NoSpace` without large_dir (the
    /// directory intact), a third level with it.
    #[test]
    fn third_level_only_with_largedir() {
        let c = cfg(1024, true, FLAG_SIGNED_HASH, 1);
        let (d, model, full) = fill(c, 60_000, 250, false);
        assert!(full, "expected the index to fill up");
        let s = check(&d, &model);
        eprintln!("{s:?} names {}", model.len());
        assert_eq!(s.levels, 1);

        let c = Cfg {
            largedir: true,
            ..c
        };
        let (d, model, full) = fill(c, 60_000, 250, false);
        assert!(!full);
        let s = check(&d, &model);
        eprintln!("{s:?} names {}", model.len());
        assert_eq!(s.levels, 2);
    }

    /// Fill a fresh directory with `len`-byte names until it has `blocks` blocks.
    fn grow_to(d: &mut MemDir, model: &mut Model, len: usize, blocks: usize) {
        let mut i = model.len() as u32;
        while d.blocks.len() < blocks {
            let n = name_of(i, len);
            add_entry(d, &n, 11 + i, FileType::Regular, d.cfg.dir_index).expect("add");
            model.insert(n, (11 + i, 1));
            i += 1;
        }
    }

    #[test]
    fn full_one_block_dir_becomes_htree_of_three_blocks() {
        for c in [
            cfg(1024, true, FLAG_SIGNED_HASH, 1),
            cfg(4096, false, FLAG_UNSIGNED_HASH, 2),
        ] {
            let mut d = MemDir::new(c);
            let mut model = Model::new();
            grow_to(&mut d, &mut model, 30, 2);
            assert!(d.indexed);
            assert_eq!(
                d.blocks.len(),
                3,
                "block 0 → root, entries split into 1 and 2"
            );
            let root = DxRoot::decode(&d.blocks[0], c.csum, false).expect("root");
            assert_eq!(root.indirect_levels, 0);
            assert_eq!(root.hash_version, c.def_hash);
            assert_eq!((root.dot_inode, root.dotdot_inode), (SELF_INO, PARENT_INO));
            let blocks: Vec<u32> = root.entries.iter().map(|e| e.block).collect();
            assert_eq!(blocks, [1, 2]);
            check(&d, &model);
            // ".." is still found through the root.
            assert_eq!(lookup(&d, b"..").expect(".."), Some((PARENT_INO, 2)));
        }
    }

    #[test]
    fn without_dir_index_a_full_dir_grows_linearly() {
        let mut c = cfg(1024, true, FLAG_SIGNED_HASH, 1);
        c.dir_index = false;
        let mut d = MemDir::new(c);
        let mut model = Model::new();
        grow_to(&mut d, &mut model, 100, 5);
        assert!(!d.indexed);
        check(&d, &model);
        // Space freed in block 0 is reused before any new block.
        let first = fdir::live_entries(&d.blocks[0], true)
            .map(|e| e.expect("entry").name.to_vec())
            .nth(3)
            .expect("third name");
        remove_entry(&mut d, &first).expect("remove");
        model.remove(&first);
        add_entry(&mut d, b"short", 77, FileType::Symlink, false).expect("add");
        model.insert(b"short".to_vec(), (77, 7));
        assert!(fdir::lookup(&d.blocks[0], b"short", true)
            .expect("block 0")
            .is_some());
        assert_eq!(d.blocks.len(), 5);
        check(&d, &model);
    }

    #[test]
    fn dotdot_replace_and_emptiness() {
        for blocks in [1, 4] {
            let mut d = MemDir::new(cfg(1024, true, FLAG_SIGNED_HASH, 1));
            let mut model = Model::new();
            assert!(is_empty(&d).expect("empty"));
            for i in 0..5 {
                add_entry(&mut d, &name_of(5000 + i, 9), 50 + i, FileType::Fifo, true)
                    .expect("add");
                model.insert(name_of(5000 + i, 9), (50 + i, 5));
            }
            grow_to(&mut d, &mut model, 60, blocks);
            assert_eq!(d.indexed, blocks > 1);
            set_dotdot(&mut d, 4242).expect("set_dotdot");
            assert_eq!(lookup(&d, b"..").expect(".."), Some((4242, 2)));
            let name = model.keys().nth(model.len() / 2).expect("a name").clone();
            assert_eq!(
                replace_entry(&mut d, &name, 999, FileType::Directory).expect("replace"),
                Some(model[&name].0)
            );
            model.insert(name.clone(), (999, 2));
            assert_eq!(
                replace_entry(&mut d, b"absent", 5, FileType::Regular).expect("replace"),
                None
            );
            check(&d, &model);
            assert!(!is_empty(&d).expect("not empty"));
            for n in model.keys() {
                assert!(remove_entry(&mut d, n).expect("remove").is_some());
            }
            assert!(is_empty(&d).expect("empty again"));
            check(&d, &Model::new());
            assert_eq!(lookup(&d, b"..").expect(".."), Some((4242, 2)));
        }
    }

    #[test]
    fn bad_names_are_refused() {
        let mut d = MemDir::new(cfg(1024, true, FLAG_SIGNED_HASH, 1));
        for n in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
            assert!(matches!(
                add_entry(&mut d, n, 12, FileType::Regular, true),
                Err(Error::InvalidInput(_))
            ));
            assert!(remove_entry(&mut d, n).is_err());
        }
        assert!(matches!(
            add_entry(&mut d, &[b'x'; 256], 12, FileType::Regular, true),
            Err(Error::NameTooLong)
        ));
        assert!(matches!(
            add_entry(&mut d, b"x", 0, FileType::Regular, true),
            Err(Error::InvalidInput(_))
        ));
        // A 255-byte name is fine.
        add_entry(&mut d, &[b'y'; 255], 12, FileType::Regular, true).expect("255 bytes");
    }

    #[test]
    fn corrupted_blocks_are_reported() {
        // A flipped byte in a leaf of a checksummed directory.
        let mut d = MemDir::new(cfg(1024, true, FLAG_SIGNED_HASH, 1));
        let mut model = Model::new();
        grow_to(&mut d, &mut model, 60, 4);
        let name = model.keys().next().expect("a name").clone();
        for b in 1..d.blocks.len() {
            d.blocks[b][20] ^= 0x40;
        }
        assert!(matches!(lookup(&d, &name), Err(Error::Corrupted { .. })));
        assert!(matches!(
            add_entry(&mut d, b"new", 12, FileType::Regular, true),
            Err(Error::Corrupted { .. })
        ));
        // An index pointing outside the directory.
        let mut d = MemDir::new(cfg(1024, false, FLAG_SIGNED_HASH, 1));
        grow_to(&mut d, &mut Model::new(), 60, 4);
        let mut root = DxRoot::decode(&d.blocks[0], false, false).expect("root");
        for e in &mut root.entries {
            e.block = 4000;
        }
        root.encode(&mut d.blocks[0], false).expect("encode");
        let e = add_entry(&mut d, b"new", 12, FileType::Regular, true);
        let Err(Error::Corrupted { what, .. }) = e else {
            panic!("expected corruption, got {e:?}");
        };
        assert!(what.contains("4000"), "{what}");
    }

    // ------------------------------------------------------------ real tools

    /// Build a directory with this module into an image made by mkfs.ext4 (debugfs
    /// provides the inode and its blocks), then ask e2fsck and, where possible, the
    /// kernel. 1 KiB: legacy hash with collisions, two levels; 4 KiB: half_md4 with
    /// high-byte names (signed hash), one level.
    #[test]
    fn e2fsck_and_kernel_accept_built_directories() {
        use rext4_format::superblock::Superblock;
        use rext4_testkit::tools::{debugfs_r, debugfs_w_checked, e2fsck_fn, htree_levels};
        use rext4_testkit::tools::{mkfs, MkfsOptions};
        use rext4_testkit::{mount::LoopMount, skip};
        use std::io::{Seek, SeekFrom, Write};
        use std::os::unix::ffi::OsStrExt;

        for (bs, legacy, count, len, want_levels) in [
            (1024u32, true, 3000u32, 40usize, 1u8),
            (4096, false, 600, 60, 0),
        ] {
            let img = mkfs(&MkfsOptions::new(bs, 32 << 20)).expect("mkfs");
            let p = img.path();
            let mut script = String::from("write /dev/null f\nmkdir d\n");
            if legacy {
                script.push_str("ssv def_hash_version legacy\n");
            }
            debugfs_w_checked(p, &script).expect("debugfs setup");
            let raw = std::fs::read(p).expect("read image");
            let sb = Superblock::decode(&raw[1024..2048]).expect("superblock");
            assert_eq!(sb.def_hash_version, if legacy { 0 } else { 1 });
            let stat = debugfs_r(p, "stat d").expect("stat d");
            let field = |key: &str| -> u32 {
                let at = stat.find(key).expect(key) + key.len();
                stat[at..]
                    .split_whitespace()
                    .next()
                    .and_then(|w| w.parse().ok())
                    .expect(key)
            };
            let (ino, generation) = (field("Inode:"), field("Generation:"));
            let seed = rext4_format::csum::inode_seed(sb.csum_seed(), ino, generation);
            let c = Cfg {
                bs: bs as usize,
                csum: sb.metadata_csum(),
                flags: sb.flags,
                def_hash: sb.def_hash_version,
                largedir: false,
                dir_index: true,
            };
            assert!(c.csum);
            let mut d = MemDir::with(c, ino, seed, sb.hash_seed);
            let mut model = Model::new();
            let mut add = |d: &mut MemDir, n: Vec<u8>| {
                add_entry(d, &n, 12, FileType::Regular, true).expect("add");
                model.insert(n, (12, 1));
            };
            for i in 0..count {
                add(&mut d, name_of(i, len));
                if legacy && (i as usize) < legacy_pairs().len() && i % 2 == 0 {
                    let (a, b) = &legacy_pairs()[i as usize];
                    add(&mut d, a.clone());
                    add(&mut d, b.clone());
                }
            }
            // Holes: every third name removed, and a few replaced in place.
            let gone: Vec<Vec<u8>> = model.keys().step_by(3).cloned().collect();
            for n in &gone {
                assert_eq!(remove_entry(&mut d, n).expect("remove"), Some((12, 1)));
                model.remove(n);
            }
            for n in model.keys().step_by(5) {
                assert_eq!(
                    replace_entry(&mut d, n, 12, FileType::Regular).expect("replace"),
                    Some(12)
                );
            }
            let s = check(&d, &model);
            assert_eq!(s.levels, want_levels, "{s:?}");
            if legacy {
                assert!(s.continuations >= 1, "{s:?}");
            }

            // Give the inode exactly as many blocks, then write ours over them.
            let k = d.blocks.len();
            debugfs_w_checked(p, "expand_dir d\n".repeat(k - 1)).expect("expand_dir");
            let phys: Vec<u64> = debugfs_r(p, "blocks d")
                .expect("blocks")
                .split_whitespace()
                .map(|w| w.parse().expect("block number"))
                .collect();
            assert_eq!(phys.len(), k);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .expect("open image");
            for (b, &pb) in d.blocks.iter().zip(&phys) {
                f.seek(SeekFrom::Start(pb * u64::from(bs))).expect("seek");
                f.write_all(b).expect("write");
            }
            drop(f);
            let flags = 0x80000 | if d.indexed { 0x1000 } else { 0 };
            debugfs_w_checked(
                p,
                format!(
                    "sif d flags {flags:#x}\nsif f links_count {}\n",
                    model.len() + 1
                ),
            )
            .expect("set inode fields");
            let r = e2fsck_fn(p);
            assert!(r.clean, "e2fsck -fn:\n{}", r.output);
            assert_eq!(
                htree_levels(p, "/d").expect("htree_dump"),
                Some(u32::from(want_levels))
            );

            match LoopMount::new(p, true, "") {
                Err(why) => skip(&why),
                Ok(m) => {
                    let dir = m.path().join("d");
                    let listed = std::fs::read_dir(&dir).expect("readdir").count();
                    assert_eq!(listed, model.len());
                    eprintln!("kernel lists {listed} entries in a {bs}-byte-block htree");
                    for n in model.keys() {
                        let path = dir.join(std::ffi::OsStr::from_bytes(n));
                        let md = std::fs::symlink_metadata(&path).expect("kernel lookup");
                        assert!(md.is_file());
                    }
                    for n in &gone {
                        let path = dir.join(std::ffi::OsStr::from_bytes(n));
                        assert!(std::fs::symlink_metadata(&path).is_err());
                    }
                    m.unmount().expect("unmount");
                    kernel_extends(p, &d, &mut model, len);
                }
            }
        }
    }

    /// The kernel adds names to the tree built here; e2fsck stays clean and this
    /// module's lookup finds every name in the kernel's blocks.
    fn kernel_extends(p: &std::path::Path, d: &MemDir, model: &mut Model, len: usize) {
        use rext4_testkit::tools::{debugfs_r, e2fsck_fn};
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::MetadataExt;

        let m = rext4_testkit::mount::LoopMount::new(p, false, "").expect("rw mount");
        let dir = m.path().join("d");
        for i in 0..1500 {
            let n = name_of(200_000 + i, len);
            let path = dir.join(std::ffi::OsStr::from_bytes(&n));
            std::fs::File::create(&path).expect("kernel create");
            let ino = std::fs::metadata(&path).expect("stat").ino();
            model.insert(n, (ino as u32, 1));
        }
        m.unmount().expect("unmount");
        let r = e2fsck_fn(p);
        assert!(r.clean, "e2fsck -fn after kernel inserts:\n{}", r.output);
        let bs = d.cfg.bs as u64;
        let raw = std::fs::read(p).expect("read image");
        let blocks: Vec<Vec<u8>> = debugfs_r(p, "blocks d")
            .expect("blocks")
            .split_whitespace()
            .map(|w| {
                let pb: u64 = w.parse().expect("block number");
                raw[(pb * bs) as usize..((pb + 1) * bs) as usize].to_vec()
            })
            .collect();
        assert!(
            blocks.len() > d.blocks.len(),
            "the kernel grew the directory"
        );
        let k = MemDir {
            cfg: d.cfg,
            blocks,
            indexed: true,
            self_ino: d.self_ino,
            inode_seed: d.inode_seed,
            hash_seed: d.hash_seed,
        };
        let s = check(&k, model);
        eprintln!("after kernel inserts: {s:?}");
    }
}
