//! Directories: reading entries (linear and htree directories alike) and looking names
//! up (hash-directed in htree directories, a linear scan otherwise).
//!
//! An htree directory's block 0 is the dx root and its interior index blocks (dx nodes)
//! are found by walking the index from the root; every other block is a leaf, an
//! ordinary dirent block. Every block is verified before use: leaves with their dirent
//! tail checksum (metadata_csum), index blocks with their dx tail checksum.
//!
//! Must hold on any image: a directory's logical blocks are bounded by i_size (checked
//! against the device size), the index walk is bounded by its levels (≤ 3), and a
//! collision chain is bounded by the number of index entries, so no lookup loops.
//! Entry names containing '/' or NUL are corruption, never returned to callers.

use std::borrow::Cow;
use std::collections::HashSet;

use rext4_format::casefold;
use rext4_format::dir::{self as fdir, DxNode, DxRoot};
use rext4_format::hash::{dx_hash, dx_hash_casefold, HashVersion};
use rext4_format::inode::{flags, Inode};
use rext4_format::superblock::feature;

use crate::cache::Kind;
use crate::error::{AtBlock, Error, Result};
use crate::file::FileType;
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};
use crate::icache::{DentKey, DentRef};

/// One directory entry, as `std::fs::DirEntry` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: Ino,
    pub file_type: FileType,
}

impl DirEntry {
    pub fn file_name(&self) -> &[u8] {
        &self.name
    }
}

fn bad_name(name: &[u8]) -> bool {
    name.is_empty() || name.contains(&b'/') || name.contains(&0)
}

impl Fs {
    fn dir_nblocks(&self, ino: Ino, inode: &Inode) -> Result<u64> {
        if !inode.is_dir() {
            return Err(Error::NotADirectory);
        }
        let bs = u64::from(self.inner.block_size);
        let dev = self.cache().device().size_bytes();
        if !inode.size.is_multiple_of(bs) || inode.size > dev {
            return Err(Error::corrupted(
                format!("directory {} has impossible size {}", ino.0, inode.size),
                None,
            ));
        }
        Ok(inode.size / bs)
    }

    fn dir_block_phys(&self, ino: Ino, inode: &Inode, lblk: u64) -> Result<u64> {
        match self.map_block(ino, inode, lblk)? {
            Mapping::Mapped {
                physical,
                unwritten: false,
                ..
            } => Ok(physical),
            _ => Err(Error::corrupted(
                format!("directory {} has a hole at block {lblk}", ino.0),
                None,
            )),
        }
    }

    /// `Some(strict)` when directory `inode` is casefolded: its CASEFOLD flag on a
    /// filesystem with the casefold feature (the flag alone is ignored, as e2fsck
    /// reports it).
    pub(crate) fn casefold_of(&self, inode: &Inode) -> Option<bool> {
        let sb = &self.inner.sb;
        (inode.has_flag(flags::CASEFOLD) && sb.has_incompat(feature::INCOMPAT_CASEFOLD))
            .then_some(sb.encoding_flags & casefold::ENCODING_FLAG_STRICT != 0)
    }

    /// The dentry cache's key for `name` in directory `dir`: the name itself, or in a
    /// casefolded directory its folded form (the raw bytes when it does not fold, which
    /// no folded form can equal: those are valid UTF-8), so every case variant shares
    /// one entry and a change through one variant is seen by all.
    pub(crate) fn dent_name<'a>(&self, dir: Ino, name: &'a [u8]) -> Result<Cow<'a, [u8]>> {
        if !self.inner.sb.has_incompat(feature::INCOMPAT_CASEFOLD) {
            return Ok(Cow::Borrowed(name));
        }
        let inode = self.read_live_inode(dir)?;
        if self.casefold_of(&inode).is_none() {
            return Ok(Cow::Borrowed(name));
        }
        Ok(casefold::casefold(name).map_or(Cow::Borrowed(name), Cow::Owned))
    }

    fn is_indexed(&self, inode: &Inode) -> bool {
        inode.has_flag(flags::INDEX) && self.inner.sb.has_compat(feature::COMPAT_DIR_INDEX)
    }

    /// Read logical block `lblk` of a directory as a leaf (dirent block).
    fn read_leaf(&self, ino: Ino, inode: &Inode, lblk: u64) -> Result<std::sync::Arc<[u8]>> {
        let phys = self.dir_block_phys(ino, inode, lblk)?;
        self.read_leaf_at(phys, ino, inode)
    }

    /// Read physical block `phys` as a leaf of directory `ino`, verified once per
    /// time it enters the cache (a leaf the directory writer wrote counts as verified:
    /// `FsDir::write_leaf`).
    pub(crate) fn read_leaf_at(
        &self,
        phys: u64,
        ino: Ino,
        inode: &Inode,
    ) -> Result<std::sync::Arc<[u8]>> {
        let verify = self.leaf_verifier(ino, inode);
        self.cache().read(phys, Kind::DirLeaf, verify)
    }

    /// The check a leaf of directory `ino` passes: with metadata_csum the tail and its
    /// checksum, always every entry's bounds.
    pub(crate) fn leaf_verifier(&self, ino: Ino, inode: &Inode) -> impl Fn(&[u8]) -> Result<()> {
        let csum = self.inner.metadata_csum;
        let seed = self.inode_seed(ino, inode);
        move |b| {
            if csum {
                fdir::verify_leaf(b, seed)?;
            } else {
                fdir::check_block(b, false)?;
            }
            Ok(())
        }
    }

    /// Read logical block `lblk` as a dx index block (root if `lblk == 0`), verified
    /// as `DirStore::read_index` promises, once per read from the device.
    pub(crate) fn read_index(
        &self,
        ino: Ino,
        inode: &Inode,
        lblk: u64,
    ) -> Result<(std::sync::Arc<[u8]>, u64)> {
        let phys = self.dir_block_phys(ino, inode, lblk)?;
        let csum = self.inner.metadata_csum;
        let seed = self.inode_seed(ino, inode);
        let largedir = self.inner.sb.has_incompat(feature::INCOMPAT_LARGEDIR);
        let data = self.cache().read(phys, Kind::DirIndex, |b| {
            crate::store::verify_index(b, lblk, csum.then_some(seed), largedir)
        })?;
        Ok((data, phys))
    }

    fn dx_root(&self, ino: Ino, inode: &Inode) -> Result<DxRoot> {
        let (b, phys) = self.read_index(ino, inode, 0)?;
        let largedir = self.inner.sb.has_incompat(feature::INCOMPAT_LARGEDIR);
        DxRoot::decode(&b, self.inner.metadata_csum, largedir).at(phys)
    }

    fn dx_node(&self, ino: Ino, inode: &Inode, lblk: u64, nblocks: u64) -> Result<DxNode> {
        if lblk == 0 {
            return Err(self.bad_index_target(ino, lblk, nblocks));
        }
        let (b, phys) = self.index_block(ino, inode, lblk, nblocks)?;
        DxNode::decode(&b, self.inner.metadata_csum).at(phys)
    }

    /// Logical blocks of the index (root and dx nodes) of an htree directory.
    fn index_blocks(&self, ino: Ino, inode: &Inode, nblocks: u64) -> Result<HashSet<u64>> {
        let root = self.dx_root(ino, inode)?;
        let mut set = HashSet::from([0u64]);
        let mut level: Vec<u64> = root.entries.iter().map(|e| u64::from(e.block)).collect();
        for _ in 0..root.indirect_levels {
            let mut next = Vec::new();
            for b in level {
                if !set.insert(b) {
                    return Err(Error::corrupted(
                        format!("directory {} index block {b} referenced twice", ino.0),
                        None,
                    ));
                }
                let n = self.dx_node(ino, inode, b, nblocks)?;
                next.extend(n.entries.iter().map(|e| u64::from(e.block)));
            }
            level = next;
        }
        Ok(set)
    }

    /// A read of directory metadata, which takes no lock: a `Corrupted` result may be
    /// a change seen half done across blocks (a directory just converted to an htree,
    /// a leaf split whose inode is not written yet). On a read-write filesystem it is
    /// tried again under the write lock, where no change is in progress; only a
    /// second failure is reported.
    fn settled<T>(&self, read: impl Fn() -> Result<T>) -> Result<T> {
        match read() {
            Err(Error::Corrupted { .. }) if !self.inner.read_only && !Fs::holds_write_lock() => {
                let _w = self.write_lock();
                read()
            }
            r => r,
        }
    }

    /// Every live entry of directory `ino` except "." and "..", in on-disk order.
    pub fn read_dir_ino(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        self.settled(|| self.read_dir_once(ino))
    }

    fn read_dir_once(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        let inode = self.read_live_inode(ino)?;
        if inode.is_dir() && inode.has_flag(flags::INLINE_DATA) {
            return Ok(self.inline_dir_list(ino, &inode)?.1);
        }
        let n = self.dir_nblocks(ino, &inode)?;
        let skip = if self.is_indexed(&inode) {
            self.index_blocks(ino, &inode, n)?
        } else {
            HashSet::new()
        };
        let csum = self.inner.metadata_csum;
        let indexed = !skip.is_empty();
        let mut out = Vec::new();
        for lblk in 0..n {
            if skip.contains(&lblk) {
                continue;
            }
            let b = self.read_leaf(ino, &inode, lblk)?;
            for (i, e) in fdir::live_entries(&b, csum).enumerate() {
                let e = e.map_err(|x| {
                    Error::from(x.at_block(self.dir_block_phys(ino, &inode, lblk).unwrap_or(0)))
                })?;
                if e.name == b"." || e.name == b".." {
                    // Only the first two entries of a linear directory's block 0 may be
                    // "." and ".." (an htree keeps them in the dx root, skipped above).
                    let expected = !indexed && lblk == 0 && i < 2;
                    if expected {
                        continue;
                    }
                    return Err(Error::corrupted(
                        format!(
                            "directory {} has a stray {:?} entry",
                            ino.0,
                            String::from_utf8_lossy(e.name)
                        ),
                        self.dir_block_phys(ino, &inode, lblk).ok(),
                    ));
                }
                if bad_name(e.name) {
                    return Err(Error::corrupted(
                        format!("directory {} holds an invalid name {:?}", ino.0, e.name),
                        None,
                    ));
                }
                out.push(DirEntry {
                    name: e.name.to_vec(),
                    ino: Ino(e.inode),
                    file_type: FileType::from_dirent(e.file_type),
                });
            }
        }
        // The ".." of an htree root lives in the dx root, which the loop skipped.
        Ok(out)
    }

    /// Look `name` up in directory `dir`; "." and ".." included. Other names are
    /// answered from the dentry cache when it knows them (also that they do not
    /// exist), else from the directory blocks, and then cached.
    pub fn lookup(&self, dir: Ino, name: &[u8]) -> Result<Option<DirEntry>> {
        if name.len() > fdir::NAME_MAX {
            return Err(Error::NameTooLong);
        }
        if name.is_empty() || name.contains(&b'/') {
            return Err(Error::InvalidInput("bad file name".into()));
        }
        if name == b"." || name == b".." {
            return self.settled(|| self.lookup_uncached(dir, name));
        }
        let dc = &self.inner.caches.dentries;
        let dname = self.dent_name(dir, name)?;
        let key = DentRef {
            dir: dir.0,
            name: &dname,
        };
        if let Some(hit) = dc.get(&key) {
            return Ok(hit.map(|(ino, ft)| DirEntry {
                name: name.to_vec(),
                ino: Ino(ino),
                file_type: FileType::from_dirent(ft),
            }));
        }
        let ticket = dc.ticket(&key);
        let found = self.settled(|| self.lookup_uncached(dir, name))?;
        dc.fill(
            DentKey {
                dir: dir.0,
                name: (*dname).into(),
            },
            found.as_ref().map(|e| (e.ino.0, e.file_type.dirent_code())),
            ticket,
        );
        Ok(found)
    }

    fn lookup_uncached(&self, dir: Ino, name: &[u8]) -> Result<Option<DirEntry>> {
        let inode = self.read_live_inode(dir)?;
        if inode.is_dir() && inode.has_flag(flags::INLINE_DATA) {
            return self.inline_dir_lookup(dir, &inode, name);
        }
        let n = self.dir_nblocks(dir, &inode)?;
        if self.is_indexed(&inode) {
            if name == b"." || name == b".." {
                let root = self.dx_root(dir, &inode)?;
                let ino = if name == b"." {
                    root.dot_inode
                } else {
                    root.dotdot_inode
                };
                return Ok(Some(DirEntry {
                    name: name.to_vec(),
                    ino: Ino(ino),
                    file_type: FileType::Dir,
                }));
            }
            return self.htree_lookup(dir, &inode, n, name);
        }
        for lblk in 0..n {
            if let Some(e) = self.search_leaf(dir, &inode, lblk, name)? {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }

    /// The entry of leaf block `b` that `name` names: the same bytes, or in a
    /// casefolded directory a name that folds the same.
    fn match_in_leaf<'a>(
        &self,
        inode: &Inode,
        b: &'a [u8],
        name: &[u8],
    ) -> Result<Option<fdir::DirEntry<'a>>> {
        let csum = self.inner.metadata_csum;
        if self.casefold_of(inode).is_none() {
            return Ok(fdir::lookup(b, name, csum)?);
        }
        let m = casefold::Matcher::new(name);
        Ok(fdir::lookup_by(b, csum, |n| m.matches(n))?)
    }

    fn search_leaf(
        &self,
        dir: Ino,
        inode: &Inode,
        lblk: u64,
        name: &[u8],
    ) -> Result<Option<DirEntry>> {
        let b = self.read_leaf(dir, inode, lblk)?;
        let found = self.match_in_leaf(inode, &b, name)?;
        Ok(found.map(|e| DirEntry {
            name: e.name.to_vec(),
            ino: Ino(e.inode),
            file_type: FileType::from_dirent(e.file_type),
        }))
    }

    /// A verified index block of directory `ino` (`lblk` 0: the root), checked to be
    /// in range. The cache's verifier decoded it whole (the order of its hashes
    /// included) when it was read from the device; lookups read it in place.
    fn index_block(
        &self,
        ino: Ino,
        inode: &Inode,
        lblk: u64,
        nblocks: u64,
    ) -> Result<(std::sync::Arc<[u8]>, u64)> {
        if lblk >= nblocks {
            return Err(self.bad_index_target(ino, lblk, nblocks));
        }
        self.read_index(ino, inode, lblk)
    }

    /// The entries of an index block from `index_block`, in place.
    fn index_entries<'a>(&self, b: &'a [u8], root: bool, phys: u64) -> Result<fdir::DxEntries<'a>> {
        let csum = self.inner.metadata_csum;
        if root {
            let largedir = self.inner.sb.has_incompat(feature::INCOMPAT_LARGEDIR);
            Ok(DxRoot::view(b, csum, largedir).at(phys)?.1)
        } else {
            DxNode::view(b, csum).at(phys)
        }
    }

    fn htree_lookup(
        &self,
        dir: Ino,
        inode: &Inode,
        n: u64,
        name: &[u8],
    ) -> Result<Option<DirEntry>> {
        let (rb, rphys) = self.index_block(dir, inode, 0, n)?;
        let largedir = self.inner.sb.has_incompat(feature::INCOMPAT_LARGEDIR);
        let (root, _) = DxRoot::view(&rb, self.inner.metadata_csum, largedir).at(rphys)?;
        let sb = &self.inner.sb;
        let version = HashVersion::effective(root.hash_version, sb.flags).ok_or_else(|| {
            Error::corrupted(
                format!("directory {} has unknown hash {}", dir.0, root.hash_version),
                None,
            )
        })?;
        let (hash, _) = if self.casefold_of(inode).is_some() {
            dx_hash_casefold(name, version, &sb.hash_seed)
        } else {
            dx_hash(name, version, &sb.hash_seed)
        };
        let levels = usize::from(root.indirect_levels);
        // Path from the root down to the leaf's parent: (index block, where it is,
        // chosen entry).
        let mut path: Vec<(std::sync::Arc<[u8]>, u64, usize)> = Vec::with_capacity(levels + 1);
        let mut blk = (rb, rphys);
        loop {
            let i = self
                .index_entries(&blk.0, path.is_empty(), blk.1)?
                .lookup(hash);
            path.push((blk.0, blk.1, i));
            if path.len() > levels {
                break;
            }
            let child = self.path_child(&path)?;
            if child == 0 {
                return Err(self.bad_index_target(dir, child, n));
            }
            blk = self.index_block(dir, inode, child, n)?;
        }
        // Bound: a collision chain cannot visit more leaves than the directory has.
        for _ in 0..n.max(1) {
            let leaf = self.path_child(&path)?;
            if leaf == 0 || leaf >= n {
                return Err(self.bad_index_target(dir, leaf, n));
            }
            if let Some(e) = self.search_leaf(dir, inode, leaf, name)? {
                return Ok(Some(e));
            }
            // Move to the next leaf only while its index hash continues ours.
            let mut lvl = path.len();
            let next_hash = loop {
                if lvl == 0 {
                    return Ok(None);
                }
                lvl -= 1;
                let (b, phys, i) = &mut path[lvl];
                let ents = self.index_entries(b, lvl == 0, *phys)?;
                if *i + 1 < ents.len() {
                    *i += 1;
                    break ents.get(*i).hash;
                }
            };
            if !fdir::collision_continues(next_hash, hash) {
                return Ok(None);
            }
            // Descend to the leftmost leaf under the new position.
            path.truncate(lvl + 1);
            while path.len() <= levels {
                let child = self.path_child(&path)?;
                if child == 0 {
                    return Err(self.bad_index_target(dir, child, n));
                }
                let (b, phys) = self.index_block(dir, inode, child, n)?;
                path.push((b, phys, 0));
            }
        }
        Ok(None)
    }

    /// The block the last step of an index path points at.
    fn path_child(&self, path: &[(std::sync::Arc<[u8]>, u64, usize)]) -> Result<u64> {
        let (b, phys, i) = &path[path.len() - 1];
        let ents = self.index_entries(b, path.len() == 1, *phys)?;
        Ok(u64::from(ents.get(*i).block))
    }

    /// An index entry of directory `dir` pointing at block `blk`, outside its `n`
    /// blocks or at the root.
    fn bad_index_target(&self, dir: Ino, blk: u64, n: u64) -> Error {
        Error::corrupted(
            format!("directory {} index points at block {blk} of {n}", dir.0),
            None,
        )
    }
}
