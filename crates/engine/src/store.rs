//! The seams between the tree/directory algorithms and the filesystem.
//!
//! Extent-tree writes (`extent_write`) and directory writes (`dir_write`) are written
//! against these traits, not against `Fs`, so they can be unit-tested on an in-memory
//! store and so the filesystem can put every metadata write through one place
//! (`Fs::write_meta`, where the journal will attach them to a transaction).
//!
//! Contract for implementors:
//! - `read_meta` returns the current contents of a metadata block (including writes
//!   made earlier through `write_meta`), verified as the caller asks.
//! - `write_meta` takes the complete new contents of a block; the caller has already
//!   set its checksum. The store may verify it again before accepting it.
//! - `alloc` returns a run of free blocks, near `goal` when possible, at least 1 and
//!   at most `max_len` long, already marked in use; `free` returns a run.
//!   Accounting of `i_blocks` is the caller's job (see each algorithm's notes).

use crate::error::Result;

/// Block-level services the extent-tree code needs.
pub trait BlockStore {
    /// Filesystem block size in bytes.
    fn block_size(&self) -> usize;
    /// Read a tree block (extent node). The store verifies magic/checksum with `seed`.
    fn read_meta(&self, blk: u64) -> Result<Vec<u8>>;
    /// Replace a tree block's contents (checksum already set by the caller).
    fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()>;
    /// Allocate up to `max_len` contiguous blocks near `goal`; returns (start, len ≥ 1).
    fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)>;
    /// Free `len` blocks starting at `start`.
    fn free(&mut self, start: u64, len: u64) -> Result<()>;
    /// Free the data blocks `[start, start + len)` a file no longer maps: how many
    /// blocks its i_blocks loses. With bigalloc a store gives back only the clusters
    /// no block of the file still uses, and counts whole clusters.
    fn free_data(&mut self, start: u64, len: u64) -> Result<u64> {
        self.free(start, len)?;
        Ok(len)
    }
    /// Blocks a tree block counts for in i_blocks (a whole cluster with bigalloc).
    fn tree_block_weight(&self) -> u64 {
        1
    }
}

/// Services the directory code needs for one directory inode.
pub trait DirStore {
    fn block_size(&self) -> usize;
    /// Number of logical blocks (i_size / block size).
    fn nblocks(&self) -> u64;
    /// Read logical block `lblk` (unverified bytes; the dir code verifies).
    fn read_block(&self, lblk: u64) -> Result<Vec<u8>>;
    /// Write logical block `lblk` (< nblocks); checksums already set by the caller.
    fn write_block(&mut self, lblk: u64, data: &[u8]) -> Result<()>;
    /// Read logical block `lblk` as a leaf, verified: with a checksum seed the dirent
    /// tail and its checksum, always every entry's bounds. A store that remembers what
    /// it verified (or what `write_leaf` gave it) need not check again.
    fn read_leaf(&self, lblk: u64) -> Result<Vec<u8>>;
    /// Change leaf `lblk` (verified as `read_leaf` promises) with `f`, which returns
    /// whether it changed it (and sets its checksum when it did) and fails, if it
    /// fails, before changing anything; a change is then written as `write_leaf`
    /// writes. A store may change its copy in place.
    fn change_leaf(
        &mut self,
        lblk: u64,
        f: &mut dyn FnMut(&mut [u8]) -> Result<bool>,
    ) -> Result<bool> {
        let mut b = self.read_leaf(lblk)?;
        let changed = f(&mut b)?;
        if changed {
            self.write_leaf(lblk, &b)?;
        }
        Ok(changed)
    }
    /// Read logical block `lblk` as an index block (0: the dx root), verified: with a
    /// checksum seed its dx tail and checksum, always its header, limit and count and
    /// the order of its hashes (the directory code then reads its entries in place).
    /// A store that remembers what it verified need not check again.
    fn read_index(&self, lblk: u64) -> Result<std::sync::Arc<[u8]>> {
        let b = self.read_block(lblk)?;
        verify_index(&b, lblk, self.csum_seed(), self.largedir())?;
        Ok(b.into())
    }
    /// Write a leaf the directory code built from a verified one (checksum set): the
    /// store may count it as verified for later `read_leaf`s.
    fn write_leaf(&mut self, lblk: u64, data: &[u8]) -> Result<()> {
        self.write_block(lblk, data)
    }
    /// Add one block at the end (allocating and mapping it, growing i_size by one block)
    /// and return its logical number. Its contents are undefined until written.
    fn append_block(&mut self) -> Result<u64>;
    /// Whether the directory has the htree INDEX flag.
    fn is_indexed(&self) -> bool;
    /// Set the INDEX flag (conversion of a linear directory to an htree).
    fn set_indexed(&mut self, on: bool) -> Result<()>;
    /// Inode seed for dirent-tail and dx-tail checksums (None without metadata_csum).
    fn csum_seed(&self) -> Option<u32>;
    /// Hash seed, signedness flags (superblock s_flags) and default hash version.
    fn hash_params(&self) -> ([u32; 4], u32, u8);
    /// Whether the filesystem has large_dir (3-level htrees, > 2 GiB dirs).
    fn largedir(&self) -> bool;
    /// `Some(strict)` when the directory is casefolded (its CASEFOLD flag on a casefold
    /// filesystem): names are hashed and matched by their folded form, and with
    /// `strict` new names must be valid UTF-8.
    fn casefold(&self) -> Option<bool> {
        None
    }
}

/// What a logical block maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// No block: reads as zeros. `len` blocks from here are unmapped.
    Hole { len: u64 },
    /// `len` blocks from here live at `physical..`; unwritten ones read as zeros.
    Mapped {
        physical: u64,
        len: u64,
        unwritten: bool,
    },
}

impl Mapping {
    /// (blocks in this run, where its data starts on the device): `None` for a hole or
    /// an unwritten extent, which read as zeros.
    pub fn data_run(&self) -> (u64, Option<u64>) {
        match *self {
            Mapping::Hole { len }
            | Mapping::Mapped {
                len,
                unwritten: true,
                ..
            } => (len, None),
            Mapping::Mapped {
                physical,
                len,
                unwritten: false,
            } => (len, Some(physical)),
        }
    }
}

/// Logical blocks are 32-bit.
pub const MAX_LOGICAL: u64 = 1 << 32;

/// Verify an index block as `DirStore::read_index` promises (`lblk` 0: the root).
pub fn verify_index(b: &[u8], lblk: u64, seed: Option<u32>, largedir: bool) -> Result<()> {
    use rext4_format::dir as fdir;
    if let Some(s) = seed {
        fdir::verify_dx_csum(b, s)?;
    }
    if lblk == 0 {
        fdir::DxRoot::decode(b, seed.is_some(), largedir)?;
    } else {
        fdir::DxNode::decode(b, seed.is_some())?;
    }
    Ok(())
}
