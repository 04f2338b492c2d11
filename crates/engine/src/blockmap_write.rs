//! Reading and changing an inode's ext2/3 block map: the 15 pointers of `i_block`
//! (12 direct, then the single, double and triple indirect blocks, IND, DIND and
//! TIND) and the indirect blocks below them (format notes §2.4). Every inode without
//! EXTENTS_FL that keeps block pointers in `i_block` — the regular files, directories
//! and slow symlinks of ext2/ext3 images, and the old files of an image converted with
//! `tune2fs -O extents` — is mapped, allocated, truncated and punched here, in place:
//! as the kernel's `ext4_ind_map_blocks`, a block-mapped file stays block-mapped (no
//! migration to an extent tree on write).
//!
//! Owns: the shape of one inode's block map. Not the data blocks' contents, i_size or
//! the inode record: the caller hands in `i_block` and `i_blocks` by reference and
//! writes the inode back afterwards. All block I/O and allocation go through
//! [`BlockStore`] (indirect blocks are its "meta" blocks, not verified: they carry no
//! checksum or magic), so the algorithms run unchanged on an in-memory store in the
//! tests below.
//!
//! Allocation follows `fs/ext4/indirect.c`: a hole at logical block `l` is filled by
//! [`BlockMap::alloc`], which first allocates the indirect blocks missing on `l`'s
//! path, each at the goal the previous one got (the first at the kernel's
//! `ext4_find_near` goal: the nearest mapped block before `l` in the same pointer
//! array, else that array's own indirect block, else the caller's home goal — the
//! inode's group), and then the data run at the goal the last indirect block got, so
//! an indirect block sits just before the data it maps (a sequential file reads
//! 0-11, IND, 12.., as the kernel and libext2fs lay it out). One call maps at most
//! to the end of the pointer array holding `l` (the kernel's "boundary"), and over a
//! run of holes of that array only: a call never crosses an indirect block. The data
//! blocks come from a closure the caller passes (its space claim decides which free
//! blocks they may take); indirect blocks from the store. Nothing is linked into the
//! map until every block is allocated, so a failed allocation changes nothing and
//! leaves nothing allocated.
//!
//! [`BlockMap::remove`] frees every data block of a logical range and every indirect
//! block that is left with no pointer (the kernel's truncate frees such blocks; its
//! punch may leave them, which e2fsck accepts too), except where the caller's `keep`
//! says a range of the file still needs its path (the page cache's delayed pages
//! there promised only the indirect blocks missing when they were dirtied). Whole
//! subtrees inside the range are freed without being rewritten; partly covered
//! indirect blocks are rewritten with the range's pointers zeroed.
//!
//! Must hold after every public operation (see [`BlockMap::check`]): every pointer is
//! 0 or a block inside the filesystem (`valid`), no block is pointed at twice, and
//! `i_blocks` (`blocks_512`) counts every data and indirect block of the map —
//! grown by [`BlockMap::alloc`] for both, shrunk by [`BlockMap::remove`] for both.
//! Walks go strictly down (at most three levels), so a corrupt map cannot loop;
//! pointers outside the filesystem are reported as corruption before use.
//!
//! Callers: `fs/inode_write.rs` (`map_new_blocks`, `unmap_range`), on behalf of the
//! writeback, direct writes, truncate, punch, directory growth, symlinks and the final
//! free, holding what the extent-tree callers hold; `fs/map.rs` reads through
//! [`lookup_with`]. Nothing here takes a lock.

use rext4_format::resize::{
    addr_per_block, map_path, DIND_SLOT, DIRECT_BLOCKS, IND_SLOT, TIND_SLOT,
};

use crate::error::{Error, Result};
use crate::store::{BlockStore, Mapping, MAX_LOGICAL};

/// Pointers in `i_block`.
const ROOT_SLOTS: usize = 15;

/// Logical blocks a block map of block size `bs` addresses: 12 direct, then one, two
/// and three levels of `bs / 4` pointers, within ext4's 32-bit logical space.
pub fn addressable_blocks(bs: u32) -> u64 {
    let apb = u64::from(addr_per_block(bs));
    (DIRECT_BLOCKS as u64 + apb + apb * apb + apb * apb * apb).min(MAX_LOGICAL)
}

/// The largest size of a block-mapped file: the kernel's `s_bitmap_maxbytes`
/// (`ext4_max_bitmap_size`): what the map addresses, less what `i_blocks` can count
/// of a dense file's data and indirect blocks — 2^32 - 1 sectors of 512 bytes
/// without huge_file, 2^48 - 1 with it.
pub fn max_bytes(bs: u32, huge_file: bool) -> u64 {
    let bits = bs.trailing_zeros();
    let ppb = u64::from(addr_per_block(bs));
    let ndir = DIRECT_BLOCKS as u64;
    let upper = if huge_file {
        (1u64 << 48) - 1
    } else {
        ((1u64 << 32) - 1) >> (bits - 9)
    };
    let tree = ndir + ppb + ppb * ppb + ppb * ppb * ppb;
    let meta_all = 1 + (1 + ppb) + (1 + ppb + ppb * ppb);
    let blocks = if tree + meta_all <= upper {
        tree
    } else {
        // The data blocks of a dense file whose blocks, indirect ones included,
        // fill `upper`.
        let mut rest = upper - ndir;
        let mut meta = 1u64;
        rest = rest.saturating_sub(ppb);
        if rest < ppb * ppb {
            meta += 1 + rest.div_ceil(ppb);
        } else {
            meta += 1 + ppb;
            rest -= ppb * ppb;
            meta += 1 + rest.div_ceil(ppb) + rest.div_ceil(ppb * ppb);
        }
        upper - meta
    };
    // The VFS's own limit (MAX_LFS_FILESIZE on 64-bit).
    (blocks << bits).min(i64::MAX as u64)
}

/// What [`BlockMap::check`] found in a consistent map.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MapReport {
    /// Data blocks mapped.
    pub data_blocks: u64,
    /// Every indirect block, in walk order (depth first, logical order).
    pub indirect: Vec<u64>,
    /// Indirect blocks with no pointer at all.
    pub empty_indirect: u64,
}

/// Where a pointer lives: in `i_block` (`None`) or in an indirect block.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Home {
    Root,
    Block(u64),
}

/// Route from `i_block` to one logical block: the slot, and below it the index in
/// each indirect block, outermost first.
#[derive(Clone, Copy, Debug)]
struct Route {
    slot: usize,
    depth: usize,
    idx: [usize; 3],
}

impl Route {
    fn of(lblk: u64, bs: u32) -> Option<Route> {
        let p = map_path(lblk, bs)?;
        let mut idx = [0usize; 3];
        for (d, &x) in p.indexes().iter().enumerate() {
            idx[d] = x as usize;
        }
        Some(Route {
            slot: p.slot,
            depth: p.depth,
            idx,
        })
    }

    /// Index of the pointer at level `k` (0: the slot in `i_block`).
    fn index(&self, k: usize) -> usize {
        if k == 0 {
            self.slot
        } else {
            self.idx[k - 1]
        }
    }

    /// Pointers in the array at level `k` that lie on the same side of the map as
    /// this route: 12 for the direct slots, 15 for the other slots of `i_block`,
    /// `apb` in an indirect block.
    fn array_len(&self, k: usize, apb: usize) -> usize {
        match k {
            0 if self.depth == 0 => DIRECT_BLOCKS,
            0 => ROOT_SLOTS,
            _ => apb,
        }
    }
}

/// Logical blocks under one pointer at level `k` of a route of `depth` levels:
/// `apb^(depth - k)`.
fn span(apb: u64, depth: usize, k: usize) -> u64 {
    apb.pow((depth - k) as u32)
}

/// The first logical block mapped through root slot `slot`.
fn slot_base(slot: usize, apb: u64) -> u64 {
    let d = DIRECT_BLOCKS as u64;
    match slot {
        s if s < DIRECT_BLOCKS => s as u64,
        IND_SLOT => d,
        DIND_SLOT => d + apb,
        _ => d + apb + apb * apb,
    }
}

/// Levels of indirect blocks below root slot `slot`.
fn slot_depth(slot: usize) -> usize {
    match slot {
        IND_SLOT => 1,
        DIND_SLOT => 2,
        TIND_SLOT => 3,
        _ => 0,
    }
}

fn le32(b: &[u8], i: usize) -> u64 {
    b.get(i * 4..i * 4 + 4).map_or(0, |w| {
        u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
    })
}

fn set_le32(b: &mut [u8], i: usize, v: u64) {
    b[i * 4..i * 4 + 4].copy_from_slice(&(v as u32).to_le_bytes());
}

fn bad_pointer(p: u64, at: Home) -> Error {
    let blk = match at {
        Home::Root => None,
        Home::Block(b) => Some(b),
    };
    Error::corrupted(
        format!("block map points at block {p}, outside the filesystem"),
        blk,
    )
}

/// What logical block `lblk` of the block map rooted at `root` maps to, reading
/// indirect blocks with `read` (`bs` bytes each, or more). A mapped answer covers the
/// blocks that follow physically in the same pointer array; a hole, the rest of the
/// missing subtree and the missing ones after it in the same array. Pointers outside
/// `valid` are corruption.
pub fn lookup_with<R: AsRef<[u8]>>(
    root: &[u8; 60],
    bs: u32,
    valid: (u64, u64),
    lblk: u64,
    read: impl Fn(u64) -> Result<R>,
) -> Result<Mapping> {
    let apb = u64::from(addr_per_block(bs));
    let Some(r) = Route::of(lblk, bs).filter(|_| lblk < addressable_blocks(bs)) else {
        return Ok(Mapping::Hole {
            len: MAX_LOGICAL.saturating_sub(lblk).max(1),
        });
    };
    let ok = |p: u64| p >= valid.0 && p < valid.1;
    // Blocks from `lblk` to the end of the subtree under the pointer at level `k`.
    let rest_of = |k: usize| -> u64 {
        let mut within = 0u64;
        for j in k + 1..=r.depth {
            within += r.index(j) as u64 * span(apb, r.depth, j);
        }
        span(apb, r.depth, k) - within
    };
    let mut held: Option<R> = None;
    let mut home = Home::Root;
    for k in 0..=r.depth {
        let i = r.index(k);
        let arr: &[u8] = match &held {
            None => &root[..],
            Some(b) => b.as_ref(),
        };
        let p = le32(arr, i);
        if p == 0 {
            // The hole runs on over the zero pointers after this one in its array.
            let mut len = rest_of(k);
            if k == 0 {
                // In `i_block`: over the zero slots after it, direct ones and then
                // the indirect ones with their whole spans.
                for s in r.slot + 1..ROOT_SLOTS {
                    if le32(arr, s) != 0 {
                        break;
                    }
                    len += span(apb, slot_depth(s), 0);
                }
            } else {
                let n = r.array_len(k, apb as usize);
                for j in i + 1..n {
                    if le32(arr, j) != 0 {
                        break;
                    }
                    len += span(apb, r.depth, k);
                }
            }
            return Ok(Mapping::Hole {
                len: len.min(MAX_LOGICAL - lblk).max(1),
            });
        }
        if !ok(p) {
            return Err(bad_pointer(p, home));
        }
        if k == r.depth {
            let n = r.array_len(k, apb as usize);
            let mut len = 1u64;
            for j in i + 1..n {
                if le32(arr, j) != p + len {
                    break;
                }
                len += 1;
            }
            return Ok(Mapping::Mapped {
                physical: p,
                len,
                unwritten: false,
            });
        }
        held = Some(read(p)?);
        home = Home::Block(p);
        if held
            .as_ref()
            .is_some_and(|b| b.as_ref().len() < bs as usize)
        {
            return Err(Error::corrupted("short indirect block", Some(p)));
        }
    }
    Err(Error::corrupted("block map walk past its depth", None))
}

/// Blocks from logical block `lblk` to the end of the pointer array that holds its
/// pointer (the kernel's "boundary"): the most one [`BlockMap::alloc`] maps. 0 past
/// the map.
pub fn to_boundary(lblk: u64, bs: u32) -> u64 {
    let apb = addr_per_block(bs) as usize;
    Route::of(lblk, bs)
        .filter(|_| lblk < addressable_blocks(bs))
        .map_or(0, |r| (r.array_len(r.depth, apb) - r.index(r.depth)) as u64)
}

/// The identity of an indirect block of a map: (levels of pointers below it, 1 for an
/// IND; the first logical block it maps).
pub type IndirectKey = (u8, u64);

/// The indirect block that holds the data pointer of logical block `lblk` (`None`
/// for a direct block or one past the map): blocks with the same key share their
/// whole route.
pub fn leaf_key(lblk: u64, bs: u32) -> Option<IndirectKey> {
    let r = Route::of(lblk, bs).filter(|_| lblk < addressable_blocks(bs))?;
    if r.depth == 0 {
        return None;
    }
    Some((1, lblk - r.idx[r.depth - 1] as u64))
}

/// The indirect blocks missing on the route to logical block `lblk` (what mapping it
/// would allocate besides the data block), read as [`lookup_with`] reads.
pub fn missing_with<R: AsRef<[u8]>>(
    root: &[u8; 60],
    bs: u32,
    valid: (u64, u64),
    lblk: u64,
    read: impl Fn(u64) -> Result<R>,
) -> Result<Vec<IndirectKey>> {
    let apb = u64::from(addr_per_block(bs));
    let Some(r) = Route::of(lblk, bs).filter(|_| lblk < addressable_blocks(bs)) else {
        return Ok(Vec::new());
    };
    // First logical block under the indirect block at level k (1..=depth).
    let base_at = |k: usize| -> u64 {
        let mut b = slot_base(r.slot, apb);
        for j in 1..k {
            b += r.index(j) as u64 * span(apb, r.depth, j);
        }
        b
    };
    let missing_from = |k: usize| -> Vec<IndirectKey> {
        (k..=r.depth)
            .map(|j| ((r.depth - j + 1) as u8, base_at(j)))
            .collect()
    };
    let mut held: Option<R> = None;
    for k in 0..r.depth {
        let arr: &[u8] = match &held {
            None => &root[..],
            Some(b) => b.as_ref(),
        };
        let p = le32(arr, r.index(k));
        if p == 0 {
            return Ok(missing_from(k + 1));
        }
        if p < valid.0 || p >= valid.1 {
            return Err(bad_pointer(p, Home::Root));
        }
        held = Some(read(p)?);
        if held
            .as_ref()
            .is_some_and(|b| b.as_ref().len() < bs as usize)
        {
            return Err(Error::corrupted("short indirect block", Some(p)));
        }
    }
    Ok(Vec::new())
}

/// One level of a route as walked: the array holding the pointer and where it lives.
struct Link {
    home: Home,
    /// The indirect block's contents (empty for the root, which is `i_block`).
    data: Vec<u8>,
    index: usize,
    ptr: u64,
}

/// The block map of one inode, over a [`BlockStore`].
pub struct BlockMap<'a, S: BlockStore> {
    store: &'a mut S,
    root: &'a mut [u8; 60],
    blocks_512: &'a mut u64,
    /// Goal when nothing in the map is near: the inode's group.
    home: u64,
    /// Block numbers a pointer may hold: `[first data block, blocks count)`.
    valid: (u64, u64),
    bs: u32,
}

impl<'a, S: BlockStore> BlockMap<'a, S> {
    /// The map of an inode: its `i_block` (`root`), its `i_blocks` in 512-byte units,
    /// the goal for a file with nothing mapped near (`home`), and the blocks a pointer
    /// may name (`valid`: first data block .. blocks count).
    pub fn new(
        store: &'a mut S,
        root: &'a mut [u8; 60],
        blocks_512: &'a mut u64,
        home: u64,
        valid: (u64, u64),
    ) -> Self {
        let bs = store.block_size() as u32;
        BlockMap {
            store,
            root,
            blocks_512,
            home,
            valid,
            bs,
        }
    }

    fn apb(&self) -> usize {
        addr_per_block(self.bs) as usize
    }

    fn sectors(&self) -> u64 {
        u64::from(self.bs) / 512
    }

    fn read(&self, blk: u64) -> Result<Vec<u8>> {
        let d = self.store.read_meta(blk)?;
        if d.len() < self.bs as usize {
            return Err(Error::corrupted("short indirect block", Some(blk)));
        }
        Ok(d)
    }

    fn check_ptr(&self, p: u64, at: Home) -> Result<u64> {
        if p >= self.valid.0 && p < self.valid.1 {
            Ok(p)
        } else {
            Err(bad_pointer(p, at))
        }
    }

    /// What logical block `lblk` maps to (see [`lookup_with`]).
    pub fn lookup(&self, lblk: u64) -> Result<Mapping> {
        lookup_with(self.root, self.bs, self.valid, lblk, |b| self.read(b))
    }

    /// Walk the route to `lblk` down to its data pointer or the first zero pointer.
    fn walk(&self, r: &Route) -> Result<Vec<Link>> {
        let mut links = Vec::with_capacity(r.depth + 1);
        let mut home = Home::Root;
        let mut data = Vec::new();
        for k in 0..=r.depth {
            let index = r.index(k);
            let arr: &[u8] = if k == 0 { &self.root[..] } else { &data };
            let ptr = le32(arr, index);
            if ptr != 0 {
                self.check_ptr(ptr, home)?;
            }
            let next = if ptr != 0 && k < r.depth {
                Some(self.read(ptr)?)
            } else {
                None
            };
            links.push(Link {
                home,
                data: std::mem::take(&mut data),
                index,
                ptr,
            });
            match next {
                Some(d) => {
                    data = d;
                    home = Home::Block(ptr);
                }
                None => break,
            }
        }
        Ok(links)
    }

    /// The kernel's `ext4_find_near` for the pointer of `link`: the nearest nonzero
    /// pointer before it in its array, else the array's own block, else `home`.
    fn near(&self, link: &Link) -> u64 {
        let arr: &[u8] = match link.home {
            Home::Root => &self.root[..],
            Home::Block(_) => &link.data,
        };
        for j in (0..link.index).rev() {
            let p = le32(arr, j);
            if p != 0 {
                return p;
            }
        }
        match link.home {
            Home::Block(b) => b,
            Home::Root => self.home,
        }
    }

    /// Where a new block for the hole at `lblk` would go (the goal `alloc` starts
    /// from); `None` when `lblk` is mapped or past the map.
    pub fn goal(&self, lblk: u64) -> Result<Option<u64>> {
        let Some(r) = Route::of(lblk, self.bs).filter(|_| lblk < addressable_blocks(self.bs))
        else {
            return Ok(None);
        };
        let links = self.walk(&r)?;
        Ok(links.last().filter(|l| l.ptr == 0).map(|l| self.near(l)))
    }

    /// Map new blocks at the hole starting at logical block `lblk`: the indirect blocks
    /// its route lacks (from the store, each at the goal the previous one got), then
    /// up to `max` data blocks from `data(goal, len)` — at most to the end of the
    /// pointer array and over zero pointers only — which returns a contiguous run
    /// (start, len ≥ 1). Returns the data run mapped. On any error nothing is mapped
    /// and everything allocated here (and by `data`) is freed again.
    pub fn alloc(
        &mut self,
        lblk: u64,
        max: u64,
        data: &mut dyn FnMut(u64, u32) -> Result<(u64, u32)>,
    ) -> Result<(u64, u64)> {
        let r = Route::of(lblk, self.bs)
            .filter(|_| lblk < addressable_blocks(self.bs))
            .ok_or(Error::FileTooLarge)?;
        let links = self.walk(&r)?;
        let Some(last) = links.last() else {
            return Err(Error::corrupted("empty block map route", None));
        };
        if last.ptr != 0 {
            return Err(Error::InvalidInput(format!(
                "logical block {lblk} is mapped already"
            )));
        }
        let k = links.len() - 1;
        // Indirect blocks to create: levels k+1..=depth.
        let missing = r.depth - k;
        let apb = self.apb();
        let leaf_i = r.index(r.depth);
        let to_boundary = (r.array_len(r.depth, apb) - leaf_i) as u64;
        let mut count = max.max(1).min(to_boundary);
        if missing == 0 {
            // Over the zero pointers that follow in this array.
            let arr: &[u8] = match last.home {
                Home::Root => &self.root[..],
                Home::Block(_) => &last.data,
            };
            let mut n = 1u64;
            while n < count && le32(arr, leaf_i + n as usize) == 0 {
                n += 1;
            }
            count = n;
        }
        let mut goal = self.near(last);
        let mut new_ind: Vec<u64> = Vec::with_capacity(missing);
        let undo_ind = |s: &mut Self, v: &[u64]| {
            for &b in v.iter().rev() {
                let _ = s.store.free(b, 1);
            }
        };
        for _ in 0..missing {
            match self.store.alloc(goal, 1) {
                Ok((b, _)) => {
                    new_ind.push(b);
                    goal = b;
                }
                Err(e) => {
                    undo_ind(self, &new_ind);
                    return Err(e);
                }
            }
        }
        let (p, got) = match data(goal, count.min(u64::from(u32::MAX)) as u32) {
            Ok((p, got)) if got >= 1 && u64::from(got) <= count => (p, u64::from(got)),
            Ok((p, got)) => {
                let _ = self.store.free(p, u64::from(got));
                undo_ind(self, &new_ind);
                return Err(Error::InvalidInput(format!(
                    "data allocation of {got} blocks for a request of {count}"
                )));
            }
            Err(e) => {
                undo_ind(self, &new_ind);
                return Err(e);
            }
        };
        let linked = self.link(&r, &links, &new_ind, p, got);
        if let Err(e) = linked {
            let _ = self.store.free(p, got);
            undo_ind(self, &new_ind);
            return Err(e);
        }
        *self.blocks_512 += (missing as u64 + got) * self.sectors();
        Ok((p, got))
    }

    /// Write the new indirect blocks `new_ind` (levels k+1.. of the route, `links`
    /// ending at level k) and the data run `p..p+got` into them, then set the one
    /// pointer at level k (or, without new blocks, the run's pointers there).
    fn link(&mut self, r: &Route, links: &[Link], new_ind: &[u64], p: u64, got: u64) -> Result<()> {
        let k = links.len() - 1;
        let bs = self.bs as usize;
        let leaf_i = r.index(r.depth);
        // Bottom up: the deepest new block holds the data run.
        for (n, &b) in new_ind.iter().enumerate().rev() {
            let level = k + 1 + n;
            let mut blk = vec![0u8; bs];
            if level == r.depth {
                for j in 0..got {
                    set_le32(&mut blk, leaf_i + j as usize, p + j);
                }
            } else {
                set_le32(&mut blk, r.index(level), new_ind[n + 1]);
            }
            self.store.write_meta(b, &blk)?;
        }
        let last = &links[k];
        let mut arr = match last.home {
            Home::Root => self.root.to_vec(),
            Home::Block(_) => last.data.clone(),
        };
        match new_ind.first() {
            Some(&top) => set_le32(&mut arr, last.index, top),
            None => {
                for j in 0..got {
                    set_le32(&mut arr, leaf_i + j as usize, p + j);
                }
            }
        }
        match last.home {
            Home::Root => self.root.copy_from_slice(&arr[..60]),
            Home::Block(b) => self.store.write_meta(b, &arr)?,
        }
        Ok(())
    }

    /// Free the data blocks mapped in logical blocks `[start, end)` and the indirect
    /// blocks left without a pointer — except those whose span holds a block for
    /// which `keep(first, end)` says the path must stay. Returns the data blocks freed.
    pub fn remove(&mut self, start: u64, end: u64, keep: &dyn Fn(u64, u64) -> bool) -> Result<u64> {
        let apb = self.apb() as u64;
        let end = end.min(addressable_blocks(self.bs));
        if start >= end {
            return Ok(0);
        }
        let mut runs = Runs::default();
        let mut freed_ind = 0u64;
        // Direct slots.
        for s in 0..DIRECT_BLOCKS {
            let l = s as u64;
            if l < start || l >= end {
                continue;
            }
            let p = le32(&self.root[..], s);
            if p != 0 {
                self.check_ptr(p, Home::Root)?;
                runs.add(p);
                set_le32(&mut self.root[..], s, 0);
            }
        }
        for slot in [IND_SLOT, DIND_SLOT, TIND_SLOT] {
            let depth = slot_depth(slot);
            let base = slot_base(slot, apb);
            let sp = span(apb, depth, 0);
            if base + sp <= start || base >= end {
                continue;
            }
            let p = le32(&self.root[..], slot);
            if p == 0 {
                continue;
            }
            self.check_ptr(p, Home::Root)?;
            let inside = start <= base && base + sp <= end;
            if inside && !keep(base, base + sp) {
                self.free_subtree(p, depth, &mut runs, &mut freed_ind)?;
                set_le32(&mut self.root[..], slot, 0);
                continue;
            }
            let (from, to) = (start.max(base), end.min(base + sp));
            let empty = self.prune(p, depth, base, from, to, keep, &mut runs, &mut freed_ind)?;
            if empty && !keep(base, base + sp) {
                self.store.free(p, 1)?;
                freed_ind += 1;
                set_le32(&mut self.root[..], slot, 0);
            }
        }
        let data = runs.finish(self.store)?;
        *self.blocks_512 = self
            .blocks_512
            .saturating_sub((data + freed_ind) * self.sectors());
        Ok(data)
    }

    /// Free indirect block `blk` (with `depth` levels of pointers below it, 1 for an
    /// IND) and everything below it; its own contents are left as they are.
    fn free_subtree(
        &mut self,
        blk: u64,
        depth: usize,
        runs: &mut Runs,
        freed: &mut u64,
    ) -> Result<()> {
        let data = self.read(blk)?;
        let apb = self.apb();
        for i in 0..apb {
            let p = le32(&data, i);
            if p == 0 {
                continue;
            }
            self.check_ptr(p, Home::Block(blk))?;
            if depth == 1 {
                runs.add(p);
                runs.flush_if_long(self.store)?;
            } else {
                self.free_subtree(p, depth - 1, runs, freed)?;
            }
        }
        self.store.free(blk, 1)?;
        *freed += 1;
        Ok(())
    }

    /// Remove `[start, end)` from the subtree of indirect block `blk` (`depth` levels
    /// below it, covering logical blocks from `base`), which the range covers in part.
    /// Returns whether the block is left with no pointer.
    #[allow(clippy::too_many_arguments)]
    fn prune(
        &mut self,
        blk: u64,
        depth: usize,
        base: u64,
        start: u64,
        end: u64,
        keep: &dyn Fn(u64, u64) -> bool,
        runs: &mut Runs,
        freed: &mut u64,
    ) -> Result<bool> {
        let apb = self.apb() as u64;
        let mut data = self.read(blk)?;
        let sp = span(apb, depth, 1);
        let mut changed = false;
        for i in 0..apb as usize {
            let lo = base + i as u64 * sp;
            let hi = lo + sp;
            if hi <= start || lo >= end {
                continue;
            }
            let p = le32(&data, i);
            if p == 0 {
                continue;
            }
            self.check_ptr(p, Home::Block(blk))?;
            if depth == 1 {
                runs.add(p);
                set_le32(&mut data, i, 0);
                changed = true;
                continue;
            }
            let inside = start <= lo && hi <= end;
            if inside && !keep(lo, hi) {
                self.free_subtree(p, depth - 1, runs, freed)?;
                set_le32(&mut data, i, 0);
                changed = true;
                continue;
            }
            let child_start = start.max(lo);
            let child_end = end.min(hi);
            let empty = self.prune(p, depth - 1, lo, child_start, child_end, keep, runs, freed)?;
            if empty && !keep(lo, hi) {
                self.store.free(p, 1)?;
                *freed += 1;
                set_le32(&mut data, i, 0);
                changed = true;
            }
        }
        let empty = data.iter().all(|&b| b == 0);
        if changed && (!empty || keep(base, base + apb * sp)) {
            // Kept: written with the range's pointers gone. (An emptied block that
            // goes is freed by the caller, not written.)
            self.store.write_meta(blk, &data)?;
        }
        Ok(empty)
    }

    /// Every data and indirect block of the map, checked: pointers inside the
    /// filesystem, no block twice.
    pub fn check(&self) -> Result<MapReport> {
        let apb = self.apb();
        let mut rep = MapReport::default();
        let mut seen = std::collections::HashSet::new();
        let mut dup = |b: u64| -> Result<()> {
            if !seen.insert(b) {
                return Err(Error::corrupted(
                    format!("block {b} is mapped twice"),
                    Some(b),
                ));
            }
            Ok(())
        };
        for s in 0..DIRECT_BLOCKS {
            let p = le32(&self.root[..], s);
            if p != 0 {
                self.check_ptr(p, Home::Root)?;
                dup(p)?;
                rep.data_blocks += 1;
            }
        }
        for slot in [IND_SLOT, DIND_SLOT, TIND_SLOT] {
            let p = le32(&self.root[..], slot);
            if p == 0 {
                continue;
            }
            self.check_ptr(p, Home::Root)?;
            let mut stack = vec![(p, slot_depth(slot))];
            while let Some((b, depth)) = stack.pop() {
                dup(b)?;
                rep.indirect.push(b);
                let data = self.read(b)?;
                let mut any = false;
                let mut kids = Vec::new();
                for i in 0..apb {
                    let q = le32(&data, i);
                    if q == 0 {
                        continue;
                    }
                    any = true;
                    self.check_ptr(q, Home::Block(b))?;
                    if depth == 1 {
                        dup(q)?;
                        rep.data_blocks += 1;
                    } else {
                        kids.push((q, depth - 1));
                    }
                }
                if !any {
                    rep.empty_indirect += 1;
                }
                stack.extend(kids.into_iter().rev());
            }
        }
        Ok(rep)
    }
}

/// Data blocks to free, gathered into physically contiguous runs (one free per run,
/// as the kernel's `ext4_free_data`).
#[derive(Default)]
struct Runs {
    cur: Option<(u64, u64)>,
    done: Vec<(u64, u64)>,
    total: u64,
}

impl Runs {
    fn add(&mut self, p: u64) {
        self.total += 1;
        match &mut self.cur {
            Some((s, n)) if *s + *n == p => *n += 1,
            cur => {
                if let Some(r) = cur.take() {
                    self.done.push(r);
                }
                *cur = Some((p, 1));
            }
        }
    }

    /// Free the finished runs once many have gathered (a TIND's worth of runs would
    /// otherwise be held at once).
    fn flush_if_long<S: BlockStore>(&mut self, store: &mut S) -> Result<()> {
        if self.done.len() >= 4096 {
            for (s, n) in self.done.drain(..) {
                store.free(s, n)?;
            }
        }
        Ok(())
    }

    /// Free everything gathered; returns the data blocks freed in all.
    fn finish<S: BlockStore>(mut self, store: &mut S) -> Result<u64> {
        if let Some(r) = self.cur.take() {
            self.done.push(r);
        }
        for (s, n) in self.done.drain(..) {
            store.free(s, n)?;
        }
        Ok(self.total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::{BTreeMap, HashMap, HashSet};
    use std::rc::Rc;

    /// Blocks in use and indirect blocks' contents.
    #[derive(Default)]
    struct State {
        meta: HashMap<u64, Vec<u8>>,
        used: HashSet<u64>,
        /// Allocations made; fail from this many on.
        allocs: usize,
        fail_after: Option<usize>,
    }

    /// An in-memory store; clones share the state, so a data allocator can take
    /// blocks beside the map that holds the store.
    #[derive(Clone)]
    struct MemStore {
        bs: usize,
        nblocks: u64,
        st: Rc<RefCell<State>>,
    }

    impl MemStore {
        fn new(bs: usize, nblocks: u64) -> Self {
            MemStore {
                bs,
                nblocks,
                st: Rc::default(),
            }
        }

        /// The first free run at or after `goal` (wrapping), up to `max` long.
        fn take(&self, goal: u64, max: u32) -> Result<(u64, u32)> {
            let mut st = self.st.borrow_mut();
            if st.fail_after.is_some_and(|n| st.allocs >= n) {
                return Err(Error::NoSpace);
            }
            st.allocs += 1;
            let n = self.nblocks;
            let g = goal.clamp(1, n - 1);
            for off in 0..n - 1 {
                let b = 1 + (g - 1 + off) % (n - 1);
                if st.used.contains(&b) {
                    continue;
                }
                let mut len = 0u32;
                while len < max
                    && b + u64::from(len) < n
                    && !st.used.contains(&(b + u64::from(len)))
                {
                    st.used.insert(b + u64::from(len));
                    len += 1;
                }
                return Ok((b, len));
            }
            Err(Error::NoSpace)
        }

        fn used(&self) -> HashSet<u64> {
            self.st.borrow().used.clone()
        }
    }

    impl BlockStore for MemStore {
        fn block_size(&self) -> usize {
            self.bs
        }
        fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
            let st = self.st.borrow();
            if !st.used.contains(&blk) {
                return Err(Error::corrupted("read of a free block", Some(blk)));
            }
            Ok(st
                .meta
                .get(&blk)
                .cloned()
                .unwrap_or_else(|| vec![0xEE; self.bs]))
        }
        fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
            let mut st = self.st.borrow_mut();
            if !st.used.contains(&blk) || data.len() != self.bs {
                return Err(Error::corrupted("write to a free block", Some(blk)));
            }
            st.meta.insert(blk, data.to_vec());
            Ok(())
        }
        fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
            self.take(goal, max_len)
        }
        fn free(&mut self, start: u64, len: u64) -> Result<()> {
            let mut st = self.st.borrow_mut();
            for b in start..start + len {
                if !st.used.remove(&b) {
                    return Err(Error::corrupted("double free", Some(b)));
                }
                st.meta.remove(&b);
            }
            Ok(())
        }
    }

    /// A map plus a model of it (logical → physical).
    struct Harness {
        store: MemStore,
        root: [u8; 60],
        blocks: u64,
        model: BTreeMap<u64, u64>,
    }

    impl Harness {
        fn new(bs: usize, nblocks: u64) -> Self {
            Harness {
                store: MemStore::new(bs, nblocks),
                root: [0; 60],
                blocks: 0,
                model: BTreeMap::new(),
            }
        }

        fn map(&mut self) -> BlockMap<'_, MemStore> {
            let n = self.store.nblocks;
            BlockMap::new(
                &mut self.store,
                &mut self.root,
                &mut self.blocks,
                100,
                (1, n),
            )
        }

        /// One `alloc` at `lblk` of up to `want` blocks, data from the shared store.
        fn alloc(&mut self, lblk: u64, want: u64) -> Result<(u64, u64)> {
            let data_store = self.store.clone();
            let mut data = |g: u64, k: u32| data_store.take(g, k);
            let r = self.map().alloc(lblk, want, &mut data);
            if let Ok((p, got)) = r {
                for i in 0..got {
                    self.model.insert(lblk + i, p + i);
                }
            }
            r
        }

        /// Fill the holes of `[lblk, lblk + n)` as a writer would.
        fn fill(&mut self, lblk: u64, n: u64) {
            let mut l = lblk;
            while l < lblk + n {
                match self.map().lookup(l).expect("lookup") {
                    Mapping::Mapped { len, .. } => l += len,
                    Mapping::Hole { len } => {
                        let (_, got) = self.alloc(l, len.min(lblk + n - l)).expect("alloc");
                        l += got;
                    }
                }
            }
        }

        fn remove(&mut self, start: u64, end: u64) -> u64 {
            let n = self
                .map()
                .remove(start, end, &|_, _| false)
                .expect("remove");
            let gone: Vec<u64> = self.model.range(start..end).map(|(k, _)| *k).collect();
            for k in &gone {
                self.model.remove(k);
            }
            assert_eq!(n, gone.len() as u64, "data blocks freed");
            n
        }

        fn verify(&mut self) -> MapReport {
            let rep = self.map().check().expect("check");
            assert_eq!(rep.data_blocks, self.model.len() as u64);
            assert_eq!(rep.empty_indirect, 0, "an emptied indirect block stayed");
            let spb = self.store.bs as u64 / 512;
            assert_eq!(
                self.blocks,
                (rep.data_blocks + rep.indirect.len() as u64) * spb,
                "i_blocks"
            );
            // Every mapping, by lookup, run by run.
            let top = self.model.keys().next_back().map_or(0, |k| k + 1) + 3;
            let mut l = 0;
            while l < top {
                match self.map().lookup(l).expect("lookup") {
                    Mapping::Mapped { physical, len, .. } => {
                        for i in 0..len {
                            assert_eq!(
                                self.model.get(&(l + i)),
                                Some(&(physical + i)),
                                "block {}",
                                l + i
                            );
                        }
                        l += len;
                    }
                    Mapping::Hole { len } => {
                        if let Some((k, _)) = self.model.range(l..l + len).next() {
                            panic!("a hole from {l} over mapped block {k}");
                        }
                        l += len;
                    }
                }
            }
            let mut owned: HashSet<u64> = rep.indirect.iter().copied().collect();
            owned.extend(self.model.values().copied());
            assert!(owned == self.store.used(), "leaked or foreign blocks");
            rep
        }
    }

    #[test]
    fn limits_follow_the_kernel() {
        // ext4_max_bitmap_size: 1 KiB blocks without huge_file: the tree limits.
        assert_eq!(
            max_bytes(1024, false),
            (12 + 256 + 65536 + 16_777_216) * 1024
        );
        // 4 KiB blocks without huge_file: i_blocks (2^32 - 1 sectors) limits.
        assert_eq!(max_bytes(4096, false), 536_346_110 * 4096);
        // With huge_file: the tree.
        assert_eq!(
            max_bytes(4096, true),
            (12 + 1024 + 1_048_576 + 1_073_741_824) * 4096
        );
        assert_eq!(addressable_blocks(1024), 12 + 256 + 65536 + 16_777_216);
        assert_eq!(addressable_blocks(65536), MAX_LOGICAL);
    }

    #[test]
    fn sequential_fill_puts_each_indirect_block_before_its_data() {
        let mut h = Harness::new(1024, 200_000);
        h.fill(0, 12 + 256 + 300);
        let rep = h.verify();
        // 0-11 at 100..112, the IND at 112, 12.. at 113 (the kernel's layout).
        assert_eq!(h.model[&0], 100);
        assert_eq!(h.model[&11], 111);
        assert_eq!(rep.indirect[0], 112);
        assert_eq!(h.model[&12], 113);
        // DIND, then its first IND, then block 268's data.
        let last_ind_data = h.model[&267];
        assert_eq!(
            rep.indirect[1],
            last_ind_data + 1,
            "DIND after the IND's data"
        );
        assert_eq!(rep.indirect[2], last_ind_data + 2, "its first IND next");
        assert_eq!(h.model[&268], last_ind_data + 3);
        // Lookups come back as runs up to the end of a pointer array.
        assert_eq!(
            h.map().lookup(0).expect("lookup"),
            Mapping::Mapped {
                physical: 100,
                len: 12,
                unwritten: false
            }
        );
        assert_eq!(
            h.map().lookup(12).expect("lookup"),
            Mapping::Mapped {
                physical: 113,
                len: 256,
                unwritten: false
            }
        );
    }

    #[test]
    fn holes_report_the_missing_subtrees() {
        let mut h = Harness::new(1024, 1 << 20);
        let apb = 256u64;
        assert_eq!(
            h.map().lookup(0).expect("lookup"),
            Mapping::Hole {
                len: addressable_blocks(1024)
            }
        );
        h.fill(5, 1);
        // 0..5 hole, then from 6 on: the empty direct slots and IND, DIND, TIND.
        assert_eq!(h.map().lookup(0).expect("lookup"), Mapping::Hole { len: 5 });
        assert_eq!(
            h.map().lookup(6).expect("lookup"),
            Mapping::Hole {
                len: addressable_blocks(1024) - 6
            }
        );
        // Past the direct slots: IND, DIND, TIND all missing.
        assert_eq!(
            h.map().lookup(12).expect("lookup"),
            Mapping::Hole {
                len: addressable_blocks(1024) - 12
            }
        );
        // A block deep in TIND: its path is made, the rest of its IND is a hole.
        let deep = 12 + apb + apb * apb + 5 * apb * apb + 7 * apb + 9;
        h.fill(deep, 1);
        h.verify();
        assert_eq!(
            h.map().lookup(deep + 1).expect("lookup"),
            Mapping::Hole { len: apb - 10 }
        );
        // The DIND slot is empty: its whole range is one hole.
        assert_eq!(
            h.map().lookup(12 + apb + 3).expect("lookup"),
            Mapping::Hole { len: apb * apb - 3 }
        );
        assert_eq!(h.map().goal(deep + 1).expect("goal"), Some(h.model[&deep]));
    }

    #[test]
    fn alloc_stops_at_mapped_blocks_and_boundaries() {
        let mut h = Harness::new(1024, 1 << 16);
        h.fill(20, 1);
        // A request over the hole 12..20 maps only up to block 20.
        assert_eq!(h.alloc(12, 100).expect("alloc").1, 8);
        // A mapped block is refused.
        assert!(matches!(h.alloc(20, 1), Err(Error::InvalidInput(_))));
        // A request crossing from the IND's range into DIND's stops at the IND's end.
        let mut h = Harness::new(1024, 1 << 16);
        h.fill(0, 12);
        assert_eq!(h.alloc(200, 1000).expect("alloc").1, 12 + 256 - 200);
        h.verify();
        // Past what the map addresses: too large.
        assert!(matches!(
            h.alloc(addressable_blocks(1024), 1),
            Err(Error::FileTooLarge)
        ));
    }

    #[test]
    fn failed_allocations_leave_nothing() {
        // DIND range: DIND, IND, data — the allocation fails at each step in turn.
        for fail_after in 0..3 {
            let mut h = Harness::new(1024, 1 << 16);
            h.fill(0, 12);
            let before = (h.root, h.blocks, h.store.used());
            {
                let mut st = h.store.st.borrow_mut();
                st.fail_after = Some(st.allocs + fail_after);
            }
            assert!(
                h.alloc(12 + 256 + 3, 10).is_err(),
                "fail after {fail_after}"
            );
            assert!((h.root, h.blocks, h.store.used()) == before);
        }
    }

    #[test]
    fn truncate_frees_emptied_indirect_blocks() {
        let apb = 256u64;
        let mut h = Harness::new(1024, 1 << 20);
        let top = 12 + apb + apb * apb + 3 * apb;
        h.fill(0, 12 + apb + 3 * apb);
        h.fill(top - 40, 40);
        h.verify();
        // Into the TIND range: TIND, its DIND and IND stay, cut.
        h.remove(top - 10, u64::MAX);
        h.verify();
        // Everything past the DIND range: the TIND goes.
        h.remove(12 + apb + apb * apb, u64::MAX);
        let rep = h.verify();
        assert_eq!(le32(&h.root, TIND_SLOT), 0);
        // Into the DIND's second IND: its third IND goes.
        h.remove(12 + apb + apb + 7, u64::MAX);
        let rep2 = h.verify();
        assert!(rep2.indirect.len() < rep.indirect.len());
        // Down to the direct blocks: IND and DIND go.
        h.remove(5, u64::MAX);
        let rep3 = h.verify();
        assert!(rep3.indirect.is_empty());
        assert_eq!(h.blocks, 5 * 2);
        h.remove(0, u64::MAX);
        h.verify();
        assert_eq!(h.root, [0u8; 60]);
        assert!(h.store.used().is_empty());
    }

    #[test]
    fn punch_inside_one_indirect_block_and_across_levels() {
        let apb = 256u64;
        let mut h = Harness::new(1024, 1 << 20);
        h.fill(0, 12 + apb + 3 * apb + 17);
        h.remove(20, 30);
        h.verify();
        // Across direct, IND and into DIND.
        h.remove(3, 12 + apb + apb + 5);
        h.verify();
        // Refill part of what was punched: the paths come back.
        h.fill(25, 100);
        h.verify();
        h.remove(12, 12 + apb);
        h.verify();
        h.remove(0, 12 + apb + 3 * apb + 17);
        h.verify();
        assert!(h.store.used().is_empty());
    }

    #[test]
    fn keep_holds_the_path_of_an_emptied_range() {
        let apb = 256u64;
        let mut h = Harness::new(1024, 1 << 20);
        h.fill(12 + apb + 5, 3);
        let before = h.map().check().expect("check").indirect;
        assert_eq!(before.len(), 2);
        // Punch the three blocks while blocks 100.. of the DIND's first IND still
        // need their path.
        let need = 12 + apb + 100;
        let n = h
            .map()
            .remove(0, u64::MAX, &|a, b| a <= need && need < b)
            .expect("remove");
        assert_eq!(n, 3);
        let rep = h.map().check().expect("check");
        assert_eq!(rep.indirect, before, "DIND and IND kept");
        assert_eq!((rep.data_blocks, rep.empty_indirect), (0, 1));
        assert_eq!(h.blocks, 2 * 2);
        // Without the need, they go.
        h.model.clear();
        h.remove(0, u64::MAX);
        h.verify();
        assert!(h.store.used().is_empty());
    }

    #[test]
    fn missing_indirect_blocks_are_named_by_their_range() {
        let apb = 256u64;
        let mut h = Harness::new(1024, 1 << 20);
        let n = h.store.nblocks;
        let read = |s: &MemStore, b: u64| s.read_meta(b);
        let deep = 12 + apb + apb * apb + 2 * apb * apb + 3 * apb + 4;
        let tb = 12 + apb + apb * apb;
        let miss = |h: &Harness, l: u64| {
            missing_with(&h.root, 1024, (1, n), l, |b| read(&h.store, b)).expect("walk")
        };
        assert!(miss(&h, 3).is_empty());
        assert_eq!(miss(&h, 20), vec![(1, 12)]);
        assert_eq!(
            miss(&h, deep),
            vec![
                (3, tb),
                (2, tb + 2 * apb * apb),
                (1, tb + 2 * apb * apb + 3 * apb)
            ]
        );
        assert_eq!(
            leaf_key(deep, 1024),
            Some((1, tb + 2 * apb * apb + 3 * apb))
        );
        assert_eq!(leaf_key(5, 1024), None);
        assert_eq!(to_boundary(5, 1024), 7);
        assert_eq!(to_boundary(12 + 3, 1024), apb - 3);
        assert_eq!(to_boundary(deep, 1024), apb - 4);
        assert_eq!(to_boundary(addressable_blocks(1024), 1024), 0);
        h.fill(deep + 100, 1);
        assert!(miss(&h, deep).is_empty(), "same IND");
        assert_eq!(
            miss(&h, deep + apb),
            vec![(1, tb + 2 * apb * apb + 4 * apb)]
        );
        assert_eq!(
            miss(&h, tb + 5),
            vec![(2, tb), (1, tb)],
            "TIND there, its first DIND not"
        );
    }

    #[test]
    fn pointers_outside_the_filesystem_are_corruption() {
        let mut h = Harness::new(1024, 1 << 12);
        set_le32(&mut h.root, 3, 1 << 20);
        assert!(matches!(h.map().lookup(3), Err(Error::Corrupted { .. })));
        assert!(matches!(h.map().check(), Err(Error::Corrupted { .. })));
        assert!(matches!(
            h.map().remove(0, 10, &|_, _| false),
            Err(Error::Corrupted { .. })
        ));
        set_le32(&mut h.root, 3, 0);
        set_le32(&mut h.root, IND_SLOT, 5000);
        assert!(matches!(h.map().lookup(40), Err(Error::Corrupted { .. })));
        assert!(matches!(h.alloc(40, 1), Err(Error::Corrupted { .. })));
    }

    /// Random fills and removes against the model, in every level of the map.
    #[test]
    fn random_operations_match_the_model() {
        let apb = 256u64;
        let zones = [
            0u64,
            12,
            12 + apb,
            12 + apb + apb * apb,
            12 + apb + 40 * apb * apb,
        ];
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m.max(1)
        };
        for round in 0..6 {
            let mut h = Harness::new(1024, 1 << 22);
            for step in 0..150 {
                let z = zones[next(zones.len() as u64) as usize];
                let at = z + next(3 * apb);
                let n = 1 + next(if round % 2 == 0 { 8 } else { 600 });
                if next(3) == 0 {
                    let from = at.saturating_sub(next(400));
                    h.remove(from, from + n);
                } else {
                    h.fill(at, n);
                }
                if step % 25 == 0 {
                    h.verify();
                }
            }
            h.verify();
            h.remove(0, u64::MAX);
            h.verify();
            assert!(h.store.used().is_empty(), "round {round}");
        }
    }
}
