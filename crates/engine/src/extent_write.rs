//! Changing an inode's extent tree: insert, punch/truncate, unwritten→written
//! conversion, and collapse/insert-range shifts (format notes §2.5).
//!
//! Owns: the shape of one inode's extent tree — the root node in the inode's 60-byte
//! i_block and the tree blocks below it. It does not own data blocks' contents, i_size
//! or the inode record: the caller hands in `i_block` and `i_blocks` by reference and
//! writes the inode back afterwards. All block I/O and allocation go through
//! [`BlockStore`], so the algorithms run unchanged on an in-memory store in tests.
//!
//! Must hold after every public operation (see [`ExtentTree::check`]):
//! - extents are sorted and non-overlapping across the whole tree, each within the
//!   32-bit logical space and the ext4 length limits (32768 written, 32767 unwritten);
//! - every node has `entries <= max`; every non-root node has at least one entry; an
//!   empty tree is a depth-0 root with no entries (as the kernel makes new files);
//! - each child's depth is its parent's minus one, and each index entry's `ei_block`
//!   equals the first logical block of its child (the kernel keeps them equal with
//!   `ext4_ext_correct_indexes`; e2fsck only needs `<=`);
//! - tree blocks carry `eh_max = block_capacity(bs)` when made here, generation 0, and a
//!   checksum tail with the inode seed when metadata_csum is on;
//! - `i_blocks` (`blocks_512`) grows by `bs/512` for every tree block allocated here and
//!   shrinks for every tree block and data block freed here. Data blocks handed to
//!   [`ExtentTree::insert`] were allocated by the caller, who accounts for them.
//!
//! How a change is made: walk root→leaf to the leaf covering the target block (a
//! [`Path`]), edit the leaf in memory (it may overflow or become empty), then
//! `commit` settles the path bottom-up — an overfull node is split (a node that grew
//! by appending keeps a full left half, so sequential writes fill leaves; otherwise
//! halves), a full root moves into a new block and the root becomes an index one level
//! higher, an empty node is unlinked and freed, index keys are corrected — allocating
//! every new block before writing anything, so a failed allocation leaves the tree as
//! it was. Only then are nodes written and blocks freed. Finally, when the root has a
//! single child that fits in the root, the child moves up (the kernel's
//! `ext4_ext_try_to_merge_up`, applied at any depth). Multi-leaf operations (punch,
//! conversion) repeat this leaf by leaf from left to right.
//!
//! Callers: the file write/truncate/fallocate paths, holding the inode's tree lock.
//! Nothing here takes a lock.

use rext4_format::extent::{
    self, block_capacity, Extent, Header, Index, Node, MAX_DEPTH, MAX_INIT_LEN,
    MAX_UNWRITTEN_LEN, ROOT_CAPACITY,
};

use crate::error::{AtBlock, Error, Result};
use crate::map::{Mapping, MAX_LOGICAL};
use crate::store::BlockStore;

/// Write an empty depth-0 extent root (magic, 0 entries, max 4) into `i_block`, as the
/// kernel does for a new file. The caller sets the inode's EXTENTS flag.
pub fn init_empty(root: &mut [u8; 60]) {
    root.fill(0);
    empty_root(0).encode_into(&mut root[..]);
}

fn empty_root(generation: u32) -> Node {
    Node::Leaf(
        Header {
            entries: 0,
            max: ROOT_CAPACITY,
            depth: 0,
            generation,
        },
        Vec::new(),
    )
}

/// The longest extent of the given kind.
pub fn max_len(unwritten: bool) -> u16 {
    if unwritten {
        MAX_UNWRITTEN_LEN
    } else {
        MAX_INIT_LEN
    }
}

/// What [`ExtentTree::check`] found in a consistent tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeReport {
    /// Depth of the root (0: the extents live in i_block).
    pub depth: u16,
    /// Number of leaf extents.
    pub extents: u64,
    /// Blocks mapped by the extents (written and unwritten).
    pub data_blocks: u64,
    /// Every tree block below the root, in walk order.
    pub tree_blocks: Vec<u64>,
}

/// One node on a root→leaf path, as edited in memory.
struct Level {
    /// `None` for the root in i_block.
    blk: Option<u64>,
    node: Node,
    /// For index nodes: the entry whose child is the next level.
    idx: usize,
    dirty: bool,
    /// The last change appended an entry at the end (split keeps a full left part).
    appended: bool,
    /// Unlinked from its parent; freed on commit.
    deleted: bool,
}

impl Level {
    fn new(blk: Option<u64>, node: Node) -> Level {
        Level {
            blk,
            node,
            idx: 0,
            dirty: false,
            appended: false,
            deleted: false,
        }
    }
}

/// Root→leaf path to the leaf covering some logical block.
struct Path {
    levels: Vec<Level>,
    /// Exclusive upper bound of the leaf's key range: the next subtree's first block
    /// (`MAX_LOGICAL` for the rightmost leaf).
    upper: u64,
}

impl Path {
    fn leaf_mut(&mut self) -> Result<&mut Vec<Extent>> {
        match self.levels.last_mut().map(|l| &mut l.node) {
            Some(Node::Leaf(_, v)) => Ok(v),
            _ => Err(Error::corrupted("extent path does not end in a leaf", None)),
        }
    }

    fn leaf(&self) -> &[Extent] {
        match self.levels.last().map(|l| &l.node) {
            Some(Node::Leaf(_, v)) => v,
            _ => &[],
        }
    }

    /// Mark the leaf changed.
    fn touch_leaf(&mut self, appended: bool) {
        if let Some(l) = self.levels.last_mut() {
            l.dirty = true;
            l.appended = appended;
        }
    }

    fn leaf_blk(&self) -> Option<u64> {
        self.levels.last().and_then(|l| l.blk)
    }
}

fn entry_count(n: &Node) -> usize {
    match n {
        Node::Leaf(_, v) => v.len(),
        Node::Index(_, v) => v.len(),
    }
}

fn first_key(n: &Node) -> Option<u32> {
    match n {
        Node::Leaf(_, v) => v.first().map(|e| e.logical),
        Node::Index(_, v) => v.first().map(|x| x.logical),
    }
}

/// Split `n` after `at` entries; the right part gets a fresh header with `max`.
fn split_off(n: &mut Node, at: usize, max: u16) -> Node {
    let depth = n.header().depth;
    let h = |entries: usize| Header {
        entries: entries as u16,
        max,
        depth,
        generation: 0,
    };
    match n {
        Node::Leaf(_, v) => {
            let r = v.split_off(at);
            Node::Leaf(h(r.len()), r)
        }
        Node::Index(_, v) => {
            let r = v.split_off(at);
            Node::Index(h(r.len()), r)
        }
    }
}

/// Sizes of the pieces an overfull node of `len` entries is cut into.
fn split_sizes(len: usize, max: usize, appended: bool) -> Vec<usize> {
    let max = max.max(1);
    if appended {
        // Sequential growth: keep full nodes on the left.
        let mut v = Vec::new();
        let mut left = len;
        while left > 0 {
            let s = left.min(max);
            v.push(s);
            left -= s;
        }
        v
    } else {
        let k = len.div_ceil(max);
        (0..k).map(|i| len * (i + 1) / k - len * i / k).collect()
    }
}

/// Whether `a` followed by `b` can be one extent.
fn can_merge(a: &Extent, b: &Extent) -> bool {
    a.unwritten == b.unwritten
        && a.end() == u64::from(b.logical)
        && a.physical.checked_add(u64::from(a.len)) == Some(b.physical)
        && u32::from(a.len) + u32::from(b.len) <= u32::from(max_len(a.unwritten))
}

/// Merge every mergeable neighbour pair in a leaf's entries.
fn merge_all(v: &mut Vec<Extent>) {
    let mut out: Vec<Extent> = Vec::with_capacity(v.len());
    for e in v.drain(..) {
        match out.last_mut() {
            Some(p) if can_merge(p, &e) => p.len += e.len,
            _ => out.push(e),
        }
    }
    *v = out;
}

fn sub_extent(e: &Extent, from: u64, to: u64, unwritten: bool) -> Extent {
    let off = from - u64::from(e.logical);
    Extent {
        logical: from as u32,
        len: (to - from) as u16,
        physical: e.physical + off,
        unwritten,
    }
}

fn shifted(logical: u32, delta: i64) -> Result<u32> {
    u32::try_from(i64::from(logical) + delta)
        .map_err(|_| Error::InvalidInput("extent shift leaves the 32-bit logical space".into()))
}

/// An inode's extent tree, borrowed for one or more changes.
pub struct ExtentTree<'a, S: BlockStore> {
    store: &'a mut S,
    root: &'a mut [u8; 60],
    seed: Option<u32>,
    blocks_512: &'a mut u64,
    bs: usize,
}

impl<'a, S: BlockStore> ExtentTree<'a, S> {
    /// `root` is the inode's i_block (already holding an extent root: see
    /// [`init_empty`]); `seed` the inode checksum seed (None without metadata_csum);
    /// `blocks_512` the inode's i_blocks in 512-byte units.
    pub fn new(
        store: &'a mut S,
        root: &'a mut [u8; 60],
        seed: Option<u32>,
        blocks_512: &'a mut u64,
    ) -> Self {
        let bs = store.block_size();
        ExtentTree {
            store,
            root,
            seed,
            blocks_512,
            bs,
        }
    }

    fn sectors_per_block(&self) -> u64 {
        (self.bs / 512) as u64
    }

    fn decode_root(&self) -> Result<Node> {
        Node::decode(&self.root[..], true)
            .map_err(|e| Error::corrupted(format!("extent root: {e}"), None))
    }

    fn read_node(&self, blk: u64, depth: u16) -> Result<Node> {
        let data = self.store.read_meta(blk)?;
        let b = data.get(..self.bs).ok_or_else(|| {
            Error::corrupted(format!("extent block is {} bytes", data.len()), Some(blk))
        })?;
        if let Some(seed) = self.seed {
            extent::verify_csum(b, seed).at(blk)?;
        }
        let n = Node::decode(b, false).at(blk)?;
        if n.header().depth != depth {
            return Err(Error::corrupted(
                format!(
                    "extent node depth {} where {depth} was expected",
                    n.header().depth
                ),
                Some(blk),
            ));
        }
        Ok(n)
    }

    fn write_node(&mut self, blk: Option<u64>, n: &Node) -> Result<()> {
        match blk {
            None => {
                self.root.fill(0);
                n.encode_into(&mut self.root[..]);
                Ok(())
            }
            Some(b) => {
                let mut buf = vec![0u8; self.bs];
                n.encode_into(&mut buf);
                if let Some(seed) = self.seed {
                    extent::set_csum(&mut buf, seed);
                }
                self.store.write_meta(b, &buf)
            }
        }
    }

    fn alloc_tree_block(&mut self, goal: u64) -> Result<u64> {
        let (b, _) = self.store.alloc(goal, 1)?;
        *self.blocks_512 += self.sectors_per_block();
        Ok(b)
    }

    fn free_tree_block(&mut self, b: u64) -> Result<()> {
        self.store.free(b, 1)?;
        *self.blocks_512 = self.blocks_512.saturating_sub(self.sectors_per_block());
        Ok(())
    }

    fn free_data(&mut self, start: u64, len: u64) -> Result<()> {
        self.store.free(start, len)?;
        *self.blocks_512 = self
            .blocks_512
            .saturating_sub(len * self.sectors_per_block());
        Ok(())
    }

    /// Walk to the leaf covering `lblk` (the first leaf when `lblk` precedes all keys).
    fn find(&self, lblk: u64) -> Result<Path> {
        let mut levels = vec![Level::new(None, self.decode_root()?)];
        let mut upper = MAX_LOGICAL;
        loop {
            let Some(last) = levels.last_mut() else {
                return Err(Error::corrupted("empty extent path", None));
            };
            let (child, depth) = match &last.node {
                Node::Leaf(..) => break,
                Node::Index(h, v) => {
                    if v.is_empty() {
                        return Err(Error::corrupted("extent index node has no entries", last.blk));
                    }
                    let i = v
                        .partition_point(|x| u64::from(x.logical) <= lblk)
                        .saturating_sub(1);
                    if let Some(n) = v.get(i + 1) {
                        upper = upper.min(u64::from(n.logical));
                    }
                    last.idx = i;
                    (v[i].child, h.depth - 1)
                }
            };
            let node = self.read_node(child, depth)?;
            levels.push(Level::new(Some(child), node));
        }
        Ok(Path { levels, upper })
    }

    /// The extent containing `lblk`, if any.
    pub fn lookup(&self, lblk: u32) -> Result<Option<Extent>> {
        let path = self.find(u64::from(lblk))?;
        let l = u64::from(lblk);
        Ok(path
            .leaf()
            .iter()
            .find(|e| u64::from(e.logical) <= l && l < e.end())
            .copied())
    }

    /// The first extent that ends after `lblk`: the one containing `lblk`, else the
    /// first one starting after it.
    pub fn next_extent(&self, lblk: u32) -> Result<Option<Extent>> {
        self.next_from(u64::from(lblk))
    }

    fn next_from(&self, mut cur: u64) -> Result<Option<Extent>> {
        while cur < MAX_LOGICAL {
            let path = self.find(cur)?;
            if let Some(e) = path.leaf().iter().find(|e| e.end() > cur) {
                return Ok(Some(*e));
            }
            cur = path.upper;
        }
        Ok(None)
    }

    /// How `lblk` maps and for how many blocks the answer holds (to the end of its
    /// extent, or of the hole before the next one).
    pub fn mapped_len(&self, lblk: u32) -> Result<Mapping> {
        let l = u64::from(lblk);
        Ok(match self.next_extent(lblk)? {
            Some(e) if u64::from(e.logical) <= l => {
                let off = l - u64::from(e.logical);
                Mapping::Mapped {
                    physical: e.physical + off,
                    len: u64::from(e.len) - off,
                    unwritten: e.unwritten,
                }
            }
            Some(e) => Mapping::Hole {
                len: u64::from(e.logical) - l,
            },
            None => Mapping::Hole {
                len: MAX_LOGICAL - l,
            },
        })
    }

    /// Every extent, in logical order.
    pub fn extents(&self) -> Result<Vec<Extent>> {
        let mut out = Vec::new();
        self.collect(&self.decode_root()?, &mut out)?;
        Ok(out)
    }

    fn collect(&self, n: &Node, out: &mut Vec<Extent>) -> Result<()> {
        match n {
            Node::Leaf(_, v) => out.extend_from_slice(v),
            Node::Index(h, v) => {
                for x in v {
                    let c = self.read_node(x.child, h.depth - 1)?;
                    self.collect(&c, out)?;
                }
            }
        }
        Ok(())
    }

    /// Map the hole `[ext.logical, ext.end())` to `ext.physical..` (blocks the caller
    /// allocated and accounts for in i_blocks). Merges with a contiguous neighbour of
    /// the same kind in the same leaf. Fails with `InvalidInput` if the range is not a
    /// hole or the extent is empty, too long, or passes logical block 2^32.
    pub fn insert(&mut self, ext: Extent) -> Result<()> {
        if ext.len == 0 || ext.len > max_len(ext.unwritten) || ext.end() > MAX_LOGICAL {
            return Err(Error::InvalidInput(format!(
                "bad extent {}+{} (unwritten {})",
                ext.logical, ext.len, ext.unwritten
            )));
        }
        let overlap = || {
            Error::InvalidInput(format!(
                "extent {}+{} overlaps a mapped block",
                ext.logical, ext.len
            ))
        };
        let mut path = self.find(u64::from(ext.logical))?;
        let upper = path.upper;
        let v = path.leaf_mut()?;
        let pos = v.partition_point(|e| e.logical <= ext.logical);
        if pos > 0 && v[pos - 1].end() > u64::from(ext.logical) {
            return Err(overlap());
        }
        let next_in_leaf = v.get(pos).map(|n| u64::from(n.logical));
        match next_in_leaf {
            Some(n) if n < ext.end() => return Err(overlap()),
            None if ext.end() > upper => {
                if let Some(n) = self.next_from(upper)? {
                    if u64::from(n.logical) < ext.end() {
                        return Err(overlap());
                    }
                }
            }
            _ => {}
        }
        let v = path.leaf_mut()?;
        let mut appended = false;
        let merged_left = pos > 0 && can_merge(&v[pos - 1], &ext);
        if merged_left {
            v[pos - 1].len += ext.len;
            let left = v[pos - 1];
            if v.get(pos).is_some_and(|r| can_merge(&left, r)) {
                v[pos - 1].len += v[pos].len;
                v.remove(pos);
            }
        } else if v.get(pos).is_some_and(|r| can_merge(&ext, r)) {
            let r = v[pos];
            v[pos] = Extent {
                len: ext.len + r.len,
                ..ext
            };
        } else {
            appended = pos == v.len();
            v.insert(pos, ext);
        }
        path.touch_leaf(appended);
        self.commit(path, ext.physical.saturating_sub(1))
    }

    /// Unmap `[start, end)` (`end` exclusive, up to 2^32 for a truncate), splitting
    /// extents that straddle either boundary, freeing their data blocks and any tree
    /// blocks left empty. Returns the number of data blocks freed.
    pub fn remove(&mut self, start: u32, end: u64) -> Result<u64> {
        let end = end.min(MAX_LOGICAL);
        let mut cur = u64::from(start);
        let mut freed_total = 0u64;
        while cur < end {
            let mut path = self.find(cur)?;
            let upper = path.upper;
            let v = path.leaf_mut()?;
            if v.iter().any(|e| e.end() > cur && u64::from(e.logical) < end) {
                let mut out = Vec::with_capacity(v.len() + 1);
                let mut frees: Vec<(u64, u64)> = Vec::new();
                for e in v.iter() {
                    let (s, t) = (u64::from(e.logical), e.end());
                    if t <= cur || s >= end {
                        out.push(*e);
                        continue;
                    }
                    if s < cur {
                        out.push(sub_extent(e, s, cur, e.unwritten));
                    }
                    let (a, b) = (s.max(cur), t.min(end));
                    frees.push((e.physical + (a - s), b - a));
                    if t > end {
                        out.push(sub_extent(e, end, t, e.unwritten));
                    }
                }
                *v = out;
                let goal = path
                    .leaf_blk()
                    .or_else(|| frees.first().map(|f| f.0))
                    .unwrap_or(0);
                path.touch_leaf(false);
                self.commit(path, goal)?;
                for (p, n) in frees {
                    self.free_data(p, n)?;
                    freed_total += n;
                }
            }
            cur = upper;
        }
        Ok(freed_total)
    }

    /// Convert the unwritten blocks in `[start, start+len)` to written, splitting
    /// extents at the range's ends and merging neighbours afterwards.
    pub fn mark_written(&mut self, start: u32, len: u32) -> Result<()> {
        let end = u64::from(start) + u64::from(len);
        if end > MAX_LOGICAL {
            return Err(Error::InvalidInput(
                "range passes logical block 2^32".into(),
            ));
        }
        let mut cur = u64::from(start);
        while cur < end {
            let mut path = self.find(cur)?;
            let upper = path.upper;
            let v = path.leaf_mut()?;
            if v
                .iter()
                .any(|e| e.unwritten && e.end() > cur && u64::from(e.logical) < end)
            {
                let mut out = Vec::with_capacity(v.len() + 2);
                for e in v.iter() {
                    let (s, t) = (u64::from(e.logical), e.end());
                    if !e.unwritten || t <= cur || s >= end {
                        out.push(*e);
                        continue;
                    }
                    if s < cur {
                        out.push(sub_extent(e, s, cur, true));
                    }
                    out.push(sub_extent(e, s.max(cur), t.min(end), false));
                    if t > end {
                        out.push(sub_extent(e, end, t, true));
                    }
                }
                merge_all(&mut out);
                *v = out;
                let goal = path.leaf_blk().unwrap_or(0);
                path.touch_leaf(false);
                self.commit(path, goal)?;
            }
            cur = upper;
        }
        Ok(())
    }

    /// Split the extent containing `lblk` so that one starts at `lblk` (no-op if none
    /// straddles it).
    fn split_at(&mut self, lblk: u64) -> Result<()> {
        let mut path = self.find(lblk)?;
        let v = path.leaf_mut()?;
        let Some(i) = v
            .iter()
            .position(|e| u64::from(e.logical) < lblk && lblk < e.end())
        else {
            return Ok(());
        };
        let e = v[i];
        v[i] = sub_extent(&e, u64::from(e.logical), lblk, e.unwritten);
        v.insert(i + 1, sub_extent(&e, lblk, e.end(), e.unwritten));
        let goal = path.leaf_blk().unwrap_or(e.physical);
        path.touch_leaf(false);
        self.commit(path, goal)
    }

    /// Merge the extent starting at `lblk` into its left neighbour when they are
    /// contiguous and in the same leaf.
    fn merge_at(&mut self, lblk: u64) -> Result<()> {
        let mut path = self.find(lblk)?;
        let v = path.leaf_mut()?;
        let Some(i) = v.iter().position(|e| u64::from(e.logical) == lblk) else {
            return Ok(());
        };
        if i == 0 || !can_merge(&v[i - 1], &v[i]) {
            return Ok(());
        }
        v[i - 1].len += v[i].len;
        v.remove(i);
        let goal = path.leaf_blk().unwrap_or(0);
        path.touch_leaf(false);
        self.commit(path, goal)
    }

    /// ext4 COLLAPSE_RANGE on the mapping: unmap `[start, start+len)` (freeing its
    /// blocks) and move every later extent `len` blocks down. Returns data blocks freed.
    pub fn collapse(&mut self, start: u32, len: u32) -> Result<u64> {
        let end = u64::from(start) + u64::from(len);
        if end > MAX_LOGICAL {
            return Err(Error::InvalidInput(
                "collapse range passes logical block 2^32".into(),
            ));
        }
        if len == 0 {
            return Ok(0);
        }
        let freed = self.remove(start, end)?;
        self.shift(end, -i64::from(len))?;
        self.merge_at(u64::from(start))?;
        Ok(freed)
    }

    /// ext4 INSERT_RANGE on the mapping: move every extent at or after `start` up by
    /// `len` blocks, leaving a hole. Fails if the last extent would pass 2^32.
    pub fn insert_range(&mut self, start: u32, len: u32) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if let Some(last) = self.last_extent()? {
            if last.end() + u64::from(len) > MAX_LOGICAL {
                return Err(Error::InvalidInput(
                    "insert range would move extents past logical block 2^32".into(),
                ));
            }
        }
        self.split_at(u64::from(start))?;
        self.shift(u64::from(start), i64::from(len))
    }

    /// The extent with the highest logical block.
    pub fn last_extent(&self) -> Result<Option<Extent>> {
        let mut n = self.decode_root()?;
        loop {
            match n {
                Node::Leaf(_, v) => return Ok(v.last().copied()),
                Node::Index(h, v) => {
                    let Some(x) = v.last() else {
                        return Ok(None);
                    };
                    n = self.read_node(x.child, h.depth - 1)?;
                }
            }
        }
    }

    /// Move every extent at or after `from` by `delta` blocks. The caller guarantees
    /// the move cannot make extents collide or leave the logical space.
    fn shift(&mut self, from: u64, delta: i64) -> Result<()> {
        let mut root = self.decode_root()?;
        if self.shift_node(&mut root, from, delta)? {
            self.write_node(None, &root)?;
        }
        Ok(())
    }

    fn shift_node(&mut self, n: &mut Node, from: u64, delta: i64) -> Result<bool> {
        let mut changed = false;
        match n {
            Node::Leaf(_, v) => {
                for e in v.iter_mut() {
                    if u64::from(e.logical) >= from {
                        e.logical = shifted(e.logical, delta)?;
                        changed = true;
                    }
                }
            }
            Node::Index(h, v) => {
                let depth = h.depth - 1;
                for i in 0..v.len() {
                    // Subtree i holds blocks below the next key, which is not shifted yet.
                    let next = v.get(i + 1).map_or(MAX_LOGICAL, |x| u64::from(x.logical));
                    if next <= from {
                        continue;
                    }
                    let blk = v[i].child;
                    let mut c = self.read_node(blk, depth)?;
                    if self.shift_node(&mut c, from, delta)? {
                        self.write_node(Some(blk), &c)?;
                    }
                    if let Some(k) = first_key(&c) {
                        if v[i].logical != k {
                            v[i].logical = k;
                            changed = true;
                        }
                    }
                }
            }
        }
        Ok(changed)
    }

    /// Settle an edited path (splits, growth, unlinking, key fixes), write it, free
    /// what was unlinked, then pull a lone child up into the root while it fits.
    fn commit(&mut self, mut path: Path, goal: u64) -> Result<()> {
        let mut new_nodes: Vec<(u64, Node)> = Vec::new();
        let mut unlinked: Vec<u64> = Vec::new();
        if let Err(e) = self.settle(&mut path.levels, goal, &mut new_nodes, &mut unlinked) {
            // Nothing has been written: give back what was allocated.
            for (b, _) in new_nodes {
                let _ = self.free_tree_block(b);
            }
            return Err(e);
        }
        for (b, n) in &new_nodes {
            self.write_node(Some(*b), n)?;
        }
        for l in &path.levels {
            if l.dirty && !l.deleted {
                self.write_node(l.blk, &l.node)?;
            }
        }
        for b in unlinked {
            self.free_tree_block(b)?;
        }
        self.try_shrink(&path.levels)
    }

    fn settle(
        &mut self,
        levels: &mut [Level],
        goal: u64,
        new_nodes: &mut Vec<(u64, Node)>,
        unlinked: &mut Vec<u64>,
    ) -> Result<()> {
        let cap = block_capacity(self.bs);
        for lvl in (0..levels.len()).rev() {
            let (above, rest) = levels.split_at_mut(lvl);
            let Some(cur) = rest.first_mut() else {
                continue;
            };
            if !cur.dirty {
                continue;
            }
            let mut parent = above.last_mut();
            let n = entry_count(&cur.node);
            if n == 0 {
                match parent.as_deref_mut() {
                    Some(p) => {
                        if let Node::Index(_, v) = &mut p.node {
                            if p.idx < v.len() {
                                v.remove(p.idx);
                            }
                        }
                        p.dirty = true;
                        p.appended = false;
                        cur.deleted = true;
                        if let Some(b) = cur.blk {
                            unlinked.push(b);
                        }
                    }
                    None => cur.node = empty_root(cur.node.header().generation),
                }
                continue;
            }
            let max = usize::from(cur.node.header().max);
            if n > max {
                match parent.as_deref_mut() {
                    None => {
                        // The root is full: move it into a new block, one level down.
                        let h = *cur.node.header();
                        if h.depth >= MAX_DEPTH {
                            return Err(Error::InvalidInput(
                                "extent tree would exceed the maximum depth".into(),
                            ));
                        }
                        let first = first_key(&cur.node).unwrap_or(0);
                        let b = self.alloc_tree_block(goal)?;
                        let child = split_off(&mut cur.node, 0, cap);
                        if entry_count(&child) > usize::from(cap) {
                            // Only reachable with a root far larger than i_block holds.
                            return Err(Error::corrupted("extent root too large to grow", None));
                        }
                        new_nodes.push((b, child));
                        cur.node = Node::Index(
                            Header {
                                entries: 1,
                                max: h.max,
                                depth: h.depth + 1,
                                generation: h.generation,
                            },
                            vec![Index {
                                logical: first,
                                child: b,
                            }],
                        );
                    }
                    Some(p) => {
                        let sizes = split_sizes(n, max, cur.appended);
                        // Cut from the right so earlier cut points stay valid.
                        let mut pieces = Vec::new();
                        let mut at = n;
                        for s in sizes.iter().skip(1).rev() {
                            at -= s;
                            pieces.push(split_off(&mut cur.node, at, cap));
                        }
                        pieces.reverse();
                        let Node::Index(_, pv) = &mut p.node else {
                            return Err(Error::corrupted("extent parent is a leaf", p.blk));
                        };
                        p.appended = p.idx + 1 == pv.len();
                        let pgoal = cur.blk.unwrap_or(goal);
                        for (k, piece) in pieces.into_iter().enumerate() {
                            let b = self.alloc_tree_block(pgoal)?;
                            let Node::Index(_, pv) = &mut p.node else {
                                return Err(Error::corrupted("extent parent is a leaf", p.blk));
                            };
                            pv.insert(
                                p.idx + 1 + k,
                                Index {
                                    logical: first_key(&piece).unwrap_or(0),
                                    child: b,
                                },
                            );
                            new_nodes.push((b, piece));
                        }
                        p.dirty = true;
                    }
                }
            }
            if let Some(p) = parent {
                let k = first_key(&cur.node);
                if let (Node::Index(_, pv), Some(k)) = (&mut p.node, k) {
                    if let Some(x) = pv.get_mut(p.idx) {
                        if x.logical != k {
                            x.logical = k;
                            p.dirty = true;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// While the root is an index with one child whose entries fit in the root, move
    /// the child's entries up and free it.
    fn try_shrink(&mut self, levels: &[Level]) -> Result<()> {
        loop {
            let root = self.decode_root()?;
            let (h, child_blk) = match &root {
                Node::Index(h, v) if v.len() == 1 => (*h, v[0].child),
                _ => return Ok(()),
            };
            let child = match levels
                .iter()
                .find(|l| l.blk == Some(child_blk) && !l.deleted)
            {
                Some(l) if entry_count(&l.node) > usize::from(h.max) => return Ok(()),
                Some(l) => l.node.clone(),
                None => self.read_node(child_blk, h.depth - 1)?,
            };
            if entry_count(&child) > usize::from(h.max) {
                return Ok(());
            }
            let ch = child.header();
            let hdr = Header {
                entries: entry_count(&child) as u16,
                max: h.max,
                depth: ch.depth,
                generation: h.generation,
            };
            let new_root = match child {
                Node::Leaf(_, v) => Node::Leaf(hdr, v),
                Node::Index(_, v) => Node::Index(hdr, v),
            };
            self.write_node(None, &new_root)?;
            self.free_tree_block(child_blk)?;
        }
    }

    /// Walk the whole tree and verify the module's invariants (see the module note);
    /// returns what it found. For tests and fsck.
    pub fn check(&self) -> Result<TreeReport> {
        let root = self.decode_root()?;
        let h = *root.header();
        if h.depth > 0 && entry_count(&root) == 0 {
            return Err(Error::corrupted("empty extent root of depth > 0", None));
        }
        let mut rep = TreeReport {
            depth: h.depth,
            extents: 0,
            data_blocks: 0,
            tree_blocks: Vec::new(),
        };
        let mut last_end = 0u64;
        self.check_node(&root, None, 0, MAX_LOGICAL, &mut last_end, &mut rep)?;
        let mut seen = rep.tree_blocks.clone();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::corrupted("extent tree block used twice", None));
        }
        Ok(rep)
    }

    fn check_node(
        &self,
        n: &Node,
        blk: Option<u64>,
        lo: u64,
        hi: u64,
        last_end: &mut u64,
        rep: &mut TreeReport,
    ) -> Result<()> {
        let bad = |what: String| Err(Error::corrupted(what, blk));
        if entry_count(n) > usize::from(n.header().max) {
            return bad("extent node has more entries than max".into());
        }
        if blk.is_some() && entry_count(n) == 0 {
            return bad("empty extent block".into());
        }
        match n {
            Node::Leaf(_, v) => {
                for e in v {
                    let s = u64::from(e.logical);
                    if s < lo || e.end() > hi {
                        return bad(format!("extent at {s} outside its index range [{lo}, {hi})"));
                    }
                    if s < *last_end {
                        return bad(format!("extent at {s} overlaps or precedes the previous"));
                    }
                    if e.len == 0 || e.len > max_len(e.unwritten) {
                        return bad(format!("extent at {s} has length {}", e.len));
                    }
                    *last_end = e.end();
                    rep.extents += 1;
                    rep.data_blocks += u64::from(e.len);
                }
            }
            Node::Index(h, v) => {
                for (i, x) in v.iter().enumerate() {
                    let k = u64::from(x.logical);
                    let next = v.get(i + 1).map_or(hi, |y| u64::from(y.logical));
                    if k < lo || k >= next || next > hi {
                        return bad(format!("extent index key {k} out of order"));
                    }
                    let c = self.read_node(x.child, h.depth - 1)?;
                    if first_key(&c) != Some(x.logical) {
                        return Err(Error::corrupted(
                            format!(
                                "extent index key {k} differs from its child's first block {:?}",
                                first_key(&c)
                            ),
                            Some(x.child),
                        ));
                    }
                    let cap = block_capacity(self.bs);
                    if c.header().max + 2 < cap || c.header().max > cap {
                        return Err(Error::corrupted("extent block eh_max", Some(x.child)));
                    }
                    rep.tree_blocks.push(x.child);
                    self.check_node(&c, Some(x.child), k, next, last_end, rep)?;
                }
            }
        }
        Ok(())
    }
}
