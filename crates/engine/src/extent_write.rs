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
//! `commit` settles the path bottom-up — an overfull node is split right after the
//! inserted entry (the kernel's `ext4_ext_split` rule, so in-order writes leave full
//! nodes; several extra entries: even pieces), a full root moves into a new block and
//! the root becomes an index one level higher, an empty node is unlinked and freed,
//! index keys are corrected — allocating every new block before writing anything, so a
//! failed allocation leaves the tree as it was. Only then are nodes written and blocks
//! freed. Finally, when the root has a single child that fits in the root, the child
//! moves up (the kernel's `ext4_ext_try_to_merge_up`, applied at any depth).
//! Multi-leaf operations (punch, conversion) repeat this leaf by leaf, left to right.
//!
//! Like the kernel's, these trees can end up with more slack than e2fsck likes
//! (random-order inserts, punches): `e2fsck -fn` then prints "extent tree could be
//! narrower/shorter" (not an error, exit 0). [`TreeReport::is_compact`] states its
//! rule and [`ExtentTree::optimize`] repacks the tree as e2fsck's pass 1E would; the
//! file layer decides when to call it (e.g. after truncate/punch, on fsync or close).
//!
//! Callers: the file write/truncate/fallocate paths, holding the inode's tree lock.
//! Nothing here takes a lock.

use rext4_format::extent::{
    self, block_capacity, Extent, Header, Index, Node, ENTRY_SIZE, HEADER_SIZE, MAX_DEPTH,
    MAX_INIT_LEN, MAX_UNWRITTEN_LEN, ROOT_CAPACITY,
};

use crate::error::{AtBlock, Error, Result};
use crate::store::BlockStore;
use crate::store::{Mapping, MAX_LOGICAL};

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
    /// Per level from the root (index 0) down: nodes, entries and the sum of eh_max.
    pub levels: Vec<LevelStats>,
}

/// Occupancy of one tree level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LevelStats {
    pub nodes: u64,
    pub entries: u64,
    pub max_entries: u64,
}

impl TreeReport {
    /// Whether e2fsck (1.47, `e2fsck_should_rebuild_extents`) leaves the tree alone.
    /// It offers to rebuild ("could be narrower") when a level's free slots
    /// (sum of eh_max - sum of entries) exceed one block's worth, (bs - 12) / 12, and
    /// ("could be shorter") when a level holds fewer entries than a level above it has
    /// slots. `e2fsck -fn` prints both, though neither counts as an error.
    pub fn is_compact(&self, block_size: usize) -> bool {
        let per_block = (block_size.saturating_sub(HEADER_SIZE) / ENTRY_SIZE) as u64;
        self.levels.iter().enumerate().all(|(i, l)| {
            l.max_entries.saturating_sub(l.entries) <= per_block
                && self.levels[..i]
                    .iter()
                    .all(|up| l.entries >= up.max_entries)
        })
    }
}

/// One node on a root→leaf path, as edited in memory.
struct Level {
    /// `None` for the root in i_block.
    blk: Option<u64>,
    node: Node,
    /// For index nodes: the entry whose child is the next level.
    idx: usize,
    dirty: bool,
    /// Where the one entry added by the last change went (steers the split).
    inserted_at: Option<usize>,
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
            inserted_at: None,
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

    /// Mark the leaf changed; `inserted_at` is the new entry's index if one was added.
    fn touch_leaf(&mut self, inserted_at: Option<usize>) {
        if let Some(l) = self.levels.last_mut() {
            l.dirty = true;
            l.inserted_at = inserted_at;
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
///
/// One entry too many, added at `inserted_at`: split right after it, as the kernel's
/// `ext4_ext_split` does (entries after the insertion point move to the new node), so
/// appending — at the end, or just before a far extent — leaves full nodes behind.
/// An entry appended at the very end starts the new node alone. Anything else: even
/// pieces.
fn split_sizes(len: usize, max: usize, inserted_at: Option<usize>) -> Vec<usize> {
    let max = max.max(1);
    match inserted_at {
        Some(pos) if len == max + 1 && pos + 1 >= len => vec![max, 1],
        Some(pos) if len == max + 1 => vec![pos + 1, len - pos - 1],
        _ => {
            let k = len.div_ceil(max);
            (0..k).map(|i| len * (i + 1) / k - len * i / k).collect()
        }
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
        *self.blocks_512 += self.sectors_per_block() * self.store.tree_block_weight();
        Ok(b)
    }

    fn free_tree_block(&mut self, b: u64) -> Result<()> {
        self.store.free(b, 1)?;
        *self.blocks_512 = self
            .blocks_512
            .saturating_sub(self.sectors_per_block() * self.store.tree_block_weight());
        Ok(())
    }

    fn free_data(&mut self, start: u64, len: u64) -> Result<()> {
        let gone = self.store.free_data(start, len)?;
        *self.blocks_512 = self
            .blocks_512
            .saturating_sub(gone * self.sectors_per_block());
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
                        return Err(Error::corrupted(
                            "extent index node has no entries",
                            last.blk,
                        ));
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
        let mut inserted_at = None;
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
            inserted_at = Some(pos);
            v.insert(pos, ext);
        }
        path.touch_leaf(inserted_at);
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
            if v.iter()
                .any(|e| e.end() > cur && u64::from(e.logical) < end)
            {
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
                path.touch_leaf(None);
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
            if v.iter()
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
                path.touch_leaf(None);
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
        path.touch_leaf(None);
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
        path.touch_leaf(None);
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

    /// Repack the tree when e2fsck would offer to ([`TreeReport::is_compact`]): full
    /// nodes left to right at every level and the least depth, as e2fsck's pass 1E
    /// builds it. Tree blocks are reused in place and the surplus freed. Returns whether
    /// it rebuilt. Not crash-atomic: run it inside a journal transaction.
    pub fn optimize(&mut self) -> Result<bool> {
        let rep = self.check()?;
        if rep.is_compact(self.bs) {
            return Ok(false);
        }
        self.rebuild(rep.tree_blocks)?;
        Ok(true)
    }

    /// Replace the whole tree by one holding `exts` (sorted, non-overlapping, each
    /// within the length limits; the caller allocated their data blocks and accounts
    /// for them), packed as [`ExtentTree::optimize`] packs it: the old tree's blocks are
    /// reused where `reuse` accepts them and freed otherwise, then the blocks of
    /// `extra` (allocated by the caller and already counted in `i_blocks`; the surplus
    /// is freed), then new ones come from the store. For moving a file's blocks
    /// elsewhere (`crate::resize`). Not crash-atomic: run it inside a transaction.
    pub fn replace_all(
        &mut self,
        exts: Vec<Extent>,
        reuse: impl Fn(u64) -> bool,
        extra: Vec<u64>,
    ) -> Result<()> {
        let (mut keep, drop): (Vec<u64>, Vec<u64>) = self
            .check()?
            .tree_blocks
            .into_iter()
            .partition(|&b| reuse(b));
        keep.extend(extra);
        self.rebuild_from(exts, keep)?;
        for b in drop {
            self.free_tree_block(b)?;
        }
        Ok(())
    }

    fn rebuild(&mut self, old_blocks: Vec<u64>) -> Result<()> {
        let exts = self.extents()?;
        self.rebuild_from(exts, old_blocks)
    }

    fn rebuild_from(&mut self, exts: Vec<Extent>, old_blocks: Vec<u64>) -> Result<()> {
        let generation = self.decode_root()?.header().generation;
        let cap = usize::from(block_capacity(self.bs)).max(1);
        let root_cap = usize::from(ROOT_CAPACITY);
        let goal = exts.first().map_or(0, |e| e.physical);
        let mut spare = old_blocks.into_iter();
        let header = |entries: usize, max: usize, depth: u16, generation: u32| Header {
            entries: entries as u16,
            max: max as u16,
            depth,
            generation,
        };
        let new_root = if exts.len() <= root_cap {
            Node::Leaf(header(exts.len(), root_cap, 0, generation), exts)
        } else {
            // Leaves, then index levels, each packed full from the left; `level` holds
            // the (first block, node) entries of the level just written.
            let mut level: Vec<Index> = Vec::new();
            for chunk in exts.chunks(cap) {
                let b = match spare.next() {
                    Some(b) => b,
                    None => self.alloc_tree_block(goal)?,
                };
                let n = Node::Leaf(header(chunk.len(), cap, 0, 0), chunk.to_vec());
                self.write_node(Some(b), &n)?;
                level.push(Index {
                    logical: chunk[0].logical,
                    child: b,
                });
            }
            let mut depth = 1u16;
            while level.len() > root_cap {
                let mut up = Vec::with_capacity(level.len().div_ceil(cap));
                for chunk in level.chunks(cap) {
                    let b = match spare.next() {
                        Some(b) => b,
                        None => self.alloc_tree_block(goal)?,
                    };
                    let n = Node::Index(header(chunk.len(), cap, depth, 0), chunk.to_vec());
                    self.write_node(Some(b), &n)?;
                    up.push(Index {
                        logical: chunk[0].logical,
                        child: b,
                    });
                }
                level = up;
                depth += 1;
            }
            Node::Index(header(level.len(), root_cap, depth, generation), level)
        };
        self.write_node(None, &new_root)?;
        for b in spare {
            self.free_tree_block(b)?;
        }
        Ok(())
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
                        p.inserted_at = None;
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
                        let sizes = split_sizes(n, max, cur.inserted_at);
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
                        let _ = pv;
                        p.inserted_at = (sizes.len() == 2).then_some(p.idx + 1);
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
            levels: vec![LevelStats::default(); usize::from(h.depth) + 1],
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
        let level = usize::from(rep.depth.saturating_sub(n.header().depth));
        if let Some(l) = rep.levels.get_mut(level) {
            l.nodes += 1;
            l.entries += entry_count(n) as u64;
            l.max_entries += u64::from(n.header().max);
        }
        match n {
            Node::Leaf(_, v) => {
                for e in v {
                    let s = u64::from(e.logical);
                    if s < lo || e.end() > hi {
                        return bad(format!(
                            "extent at {s} outside its index range [{lo}, {hi})"
                        ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap, HashSet};

    /// In-memory store: metadata blocks in a map, a set of used blocks, and an
    /// allocator that can ignore its goal (`scatter_pct` of the time) to fragment.
    struct MemStore {
        bs: usize,
        nblocks: u64,
        meta: HashMap<u64, Vec<u8>>,
        used: HashSet<u64>,
        rng: u64,
        scatter_pct: u64,
        fail_allocs: bool,
    }

    impl MemStore {
        fn new(bs: usize, nblocks: u64, scatter_pct: u64, rng: u64) -> Self {
            MemStore {
                bs,
                nblocks,
                meta: HashMap::new(),
                used: HashSet::new(),
                rng: rng | 1,
                scatter_pct,
                fail_allocs: false,
            }
        }

        fn rand(&mut self) -> u64 {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            self.rng
        }
    }

    impl BlockStore for MemStore {
        fn block_size(&self) -> usize {
            self.bs
        }
        fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
            if !self.used.contains(&blk) {
                return Err(Error::corrupted("read of a free block", Some(blk)));
            }
            self.meta
                .get(&blk)
                .cloned()
                .ok_or_else(|| Error::corrupted("read of an unwritten block", Some(blk)))
        }
        fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
            if !self.used.contains(&blk) || data.len() != self.bs {
                return Err(Error::corrupted("write to a free block", Some(blk)));
            }
            self.meta.insert(blk, data.to_vec());
            Ok(())
        }
        fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
            if self.fail_allocs || self.used.len() as u64 + 1 >= self.nblocks {
                return Err(Error::Io(std::io::Error::other("no space")));
            }
            let mut b = goal;
            if self.rand() % 100 < self.scatter_pct {
                b = self.rand() % self.nblocks;
            }
            b = b.clamp(1, self.nblocks - 1);
            while self.used.contains(&b) {
                b = if b + 1 >= self.nblocks { 1 } else { b + 1 };
            }
            let mut len = 1u32;
            while len < max_len
                && b + u64::from(len) < self.nblocks
                && !self.used.contains(&(b + u64::from(len)))
            {
                len += 1;
            }
            for x in b..b + u64::from(len) {
                self.used.insert(x);
            }
            Ok((b, len))
        }
        fn free(&mut self, start: u64, len: u64) -> Result<()> {
            for b in start..start + len {
                if !self.used.remove(&b) {
                    return Err(Error::corrupted("double free", Some(b)));
                }
                self.meta.remove(&b);
            }
            Ok(())
        }
    }

    /// The tree under test plus a block-by-block model of what it must map.
    struct Harness {
        store: MemStore,
        root: [u8; 60],
        blocks_512: u64,
        seed: Option<u32>,
        model: BTreeMap<u32, (u64, bool)>,
    }

    impl Harness {
        fn new(bs: usize, nblocks: u64, scatter_pct: u64, seed: Option<u32>) -> Self {
            let mut root = [0xAAu8; 60];
            init_empty(&mut root);
            Harness {
                store: MemStore::new(bs, nblocks, scatter_pct, 0x9E37_79B9_7F4A_7C15),
                root,
                blocks_512: 0,
                seed,
                model: BTreeMap::new(),
            }
        }

        fn tree(&mut self) -> ExtentTree<'_, MemStore> {
            ExtentTree::new(
                &mut self.store,
                &mut self.root,
                self.seed,
                &mut self.blocks_512,
            )
        }

        fn spb(&self) -> u64 {
            (self.store.bs / 512) as u64
        }

        /// Allocate up to `len` data blocks near `goal` and map them at `lblk`.
        fn insert_data(&mut self, lblk: u32, len: u32, unwritten: bool, goal: u64) -> u32 {
            let len = len.min(u32::from(max_len(unwritten)));
            let (p, got) = self.store.alloc(goal, len).expect("data alloc");
            self.blocks_512 += u64::from(got) * self.spb();
            let e = Extent {
                logical: lblk,
                len: got as u16,
                physical: p,
                unwritten,
            };
            self.tree().insert(e).expect("insert");
            for i in 0..got {
                self.model.insert(lblk + i, (p + u64::from(i), unwritten));
            }
            got
        }

        fn verify(&mut self) -> TreeReport {
            let rep = self.tree().check().expect("tree check");
            let exts = self.tree().extents().expect("extents");
            let mut flat = Vec::with_capacity(self.model.len());
            for e in &exts {
                for i in 0..u32::from(e.len) {
                    flat.push((e.logical + i, (e.physical + u64::from(i), e.unwritten)));
                }
            }
            let want: Vec<(u32, (u64, bool))> = self.model.iter().map(|(k, v)| (*k, *v)).collect();
            assert!(flat == want, "tree mapping differs from the model");
            assert_eq!(rep.data_blocks, self.model.len() as u64);
            assert_eq!(
                self.blocks_512,
                (self.model.len() + rep.tree_blocks.len()) as u64 * self.spb(),
                "i_blocks"
            );
            let mut owned: HashSet<u64> = rep.tree_blocks.iter().copied().collect();
            owned.extend(self.model.values().map(|v| v.0));
            assert_eq!(
                owned.len(),
                rep.tree_blocks.len() + self.model.len(),
                "a block is used twice"
            );
            assert!(owned == self.store.used, "leaked or foreign blocks");
            if self.model.is_empty() {
                assert_eq!(rep.depth, 0, "an empty tree has a depth-0 root");
            }
            rep
        }
    }

    fn ext(logical: u32, len: u16, physical: u64, unwritten: bool) -> Extent {
        Extent {
            logical,
            len,
            physical,
            unwritten,
        }
    }

    #[test]
    fn empty_root_is_what_the_kernel_writes() {
        let mut root = [0xFFu8; 60];
        init_empty(&mut root);
        assert_eq!(&root[..12], &[0x0A, 0xF3, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
        assert!(root[12..].iter().all(|&b| b == 0));
        let mut h = Harness::new(4096, 1 << 12, 0, None);
        assert_eq!(h.tree().extents().expect("extents"), vec![]);
        assert_eq!(h.tree().lookup(0).expect("lookup"), None);
        assert_eq!(
            h.tree().mapped_len(7).expect("map"),
            Mapping::Hole {
                len: MAX_LOGICAL - 7
            }
        );
        h.verify();
    }

    #[test]
    fn contiguous_appends_merge_up_to_the_length_limits() {
        for unwritten in [false, true] {
            let mut h = Harness::new(4096, 1 << 17, 0, Some(7));
            for l in 0..40_000u32 {
                h.insert_data(l, 1, unwritten, 100 + u64::from(l));
            }
            let limit = max_len(unwritten);
            let exts = h.tree().extents().expect("extents");
            assert_eq!(
                exts,
                vec![
                    ext(0, limit, 100, unwritten),
                    ext(
                        u32::from(limit),
                        (40_000 - u32::from(limit)) as u16,
                        100 + u64::from(limit),
                        unwritten
                    ),
                ]
            );
            let rep = h.verify();
            assert_eq!(rep.depth, 0);
            // Filling a hole between two extents merges all three.
            let freed = h.tree().remove(10, 11).expect("punch");
            assert_eq!(freed, 1);
            h.model.remove(&10);
            assert_eq!(h.tree().extents().expect("extents").len(), 3);
            h.store.used.remove(&110); // hand the block back for reuse below
            h.store.used.insert(110);
            h.blocks_512 += h.spb();
            h.tree().insert(ext(10, 1, 110, unwritten)).expect("refill");
            h.model.insert(10, (110, unwritten));
            assert_eq!(h.tree().extents().expect("extents").len(), 2);
            h.verify();
        }
    }

    #[test]
    fn lookup_next_extent_and_mapped_len() {
        let mut h = Harness::new(1024, 1 << 14, 0, Some(1));
        // Every third block mapped, physically apart: 600 extents, depth ≥ 1.
        for i in 0..600u32 {
            h.insert_data(3 * i, 1, i % 2 == 1, 2000 + 5 * u64::from(i));
        }
        assert!(h.verify().depth >= 1);
        let t = h.tree();
        assert_eq!(
            t.lookup(300).expect("lookup"),
            Some(ext(300, 1, 2500, false))
        );
        assert_eq!(t.lookup(301).expect("lookup"), None);
        assert_eq!(
            t.next_extent(301).expect("next"),
            Some(ext(303, 1, 2505, true))
        );
        assert_eq!(t.next_extent(1798).expect("next"), None);
        assert_eq!(t.mapped_len(301).expect("map"), Mapping::Hole { len: 2 });
        assert_eq!(
            t.mapped_len(303).expect("map"),
            Mapping::Mapped {
                physical: 2505,
                len: 1,
                unwritten: true
            }
        );
        assert_eq!(
            t.last_extent().expect("last"),
            Some(ext(1797, 1, 2000 + 5 * 599, true))
        );
    }

    #[test]
    fn overlapping_or_invalid_inserts_are_refused_without_change() {
        let mut h = Harness::new(1024, 1 << 14, 0, Some(3));
        for i in 0..400u32 {
            h.insert_data(10 * i, 5, false, 5000 + 10 * u64::from(i));
        }
        let before = h.root;
        let bad = [
            ext(12, 1, 1, false),       // inside an extent
            ext(8, 3, 1, false),        // runs into the next extent
            ext(5, 20, 1, false),       // covers a whole extent
            ext(0, 0, 1, false),        // empty
            ext(0, 32768, 1, true),     // too long for unwritten
            ext(u32::MAX, 2, 1, false), // past 2^32
        ];
        for e in bad {
            let r = h.tree().insert(e);
            assert!(
                matches!(r, Err(Error::InvalidInput(_))),
                "{e:?} accepted: {r:?}"
            );
        }
        // Across a leaf boundary: find the first key of the second leaf and insert
        // an extent in the hole before it that runs into it.
        let rep = h.verify();
        assert!(rep.tree_blocks.len() > 2);
        let key = rep
            .tree_blocks
            .iter()
            .filter_map(|b| match Node::decode(&h.store.meta[b][..1024], false) {
                Ok(Node::Leaf(_, v)) => v.first().map(|e| e.logical),
                _ => None,
            })
            .find(|&k| k > 0)
            .expect("a second leaf");
        let r = h.tree().insert(ext(key - 3, 4, 1, false));
        assert!(matches!(r, Err(Error::InvalidInput(_))), "{r:?}");
        assert_eq!(h.root, before);
        h.verify();
    }

    #[test]
    fn punch_splits_grows_and_shrinks_back() {
        let mut h = Harness::new(4096, 1 << 12, 0, Some(9));
        for i in 0..4u32 {
            h.insert_data(100 * i, 50, false, 1000 + 100 * u64::from(i));
        }
        assert_eq!(h.verify().depth, 0);
        // Punching the middle of an extent needs a fifth entry: the root grows.
        assert_eq!(h.tree().remove(10, 20).expect("punch"), 10);
        for l in 10..20 {
            h.model.remove(&l);
        }
        let rep = h.verify();
        assert_eq!((rep.depth, rep.extents, rep.tree_blocks.len()), (1, 5, 1));
        // Removing an extent lets the single leaf fit in the root again.
        assert_eq!(h.tree().remove(300, 350).expect("punch"), 50);
        for l in 300..350 {
            h.model.remove(&l);
        }
        let rep = h.verify();
        assert_eq!((rep.depth, rep.extents, rep.tree_blocks.len()), (0, 4, 0));
        // Truncate in the middle of an extent, then to zero.
        assert_eq!(
            h.tree().remove(125, MAX_LOGICAL).expect("truncate"),
            25 + 50
        );
        h.model.retain(|&l, _| l < 125);
        h.verify();
        let left = h.model.len() as u64;
        assert_eq!(h.tree().remove(0, MAX_LOGICAL).expect("truncate"), left);
        h.model.clear();
        h.verify();
        assert_eq!(h.blocks_512, 0);
    }

    #[test]
    fn mark_written_splits_in_three_then_merges_back() {
        let mut h = Harness::new(4096, 1 << 12, 0, Some(5));
        h.insert_data(0, 100, true, 500);
        let mw = |h: &mut Harness, s: u32, n: u32| {
            h.tree().mark_written(s, n).expect("mark");
            for l in s..s + n {
                if let Some(v) = h.model.get_mut(&l) {
                    v.1 = false;
                }
            }
            h.verify();
            h.tree().extents().expect("extents")
        };
        assert_eq!(
            mw(&mut h, 10, 10),
            vec![
                ext(0, 10, 500, true),
                ext(10, 10, 510, false),
                ext(20, 80, 520, true)
            ]
        );
        assert_eq!(
            mw(&mut h, 0, 10),
            vec![ext(0, 20, 500, false), ext(20, 80, 520, true)]
        );
        // A range running past the mapping only touches mapped unwritten blocks.
        assert_eq!(mw(&mut h, 20, 1000), vec![ext(0, 100, 500, false)]);
    }

    #[test]
    fn failed_allocation_leaves_the_tree_unchanged() {
        let mut h = Harness::new(1024, 1 << 14, 0, Some(11));
        for i in 0..4u32 {
            h.insert_data(10 * i, 1, false, 100 + 10 * u64::from(i));
        }
        let (p, _) = h.store.alloc(3000, 1).expect("alloc");
        h.store.fail_allocs = true;
        let before = (h.root, h.blocks_512);
        let r = h.tree().insert(ext(100, 1, p, false));
        assert!(matches!(r, Err(Error::Io(_))), "{r:?}");
        assert_eq!((h.root, h.blocks_512), before);
        h.store.free(p, 1).expect("free");
        h.verify();
        // The same with a full leaf one level down (84 entries at 1 KiB).
        h.store.fail_allocs = false;
        for i in 4..84u32 {
            h.insert_data(10 * i, 1, false, 100 + 10 * u64::from(i));
        }
        let rep = h.verify();
        assert_eq!((rep.depth, rep.tree_blocks.len()), (1, 1));
        let leaf = h.store.meta[&rep.tree_blocks[0]].clone();
        let (p, _) = h.store.alloc(3000, 1).expect("alloc");
        h.store.fail_allocs = true;
        let before = (h.root, h.blocks_512);
        assert!(h.tree().insert(ext(5, 1, p, false)).is_err());
        assert_eq!((h.root, h.blocks_512), before);
        assert_eq!(h.store.meta[&rep.tree_blocks[0]], leaf);
        h.store.free(p, 1).expect("free");
        h.verify();
    }

    #[test]
    fn tree_blocks_carry_checksums_and_bad_ones_are_refused() {
        let mut h = Harness::new(1024, 1 << 14, 0, Some(0xDEAD_BEEF));
        for i in 0..200u32 {
            h.insert_data(2 * i, 1, false, 100 + 2 * u64::from(i));
        }
        let rep = h.verify();
        let b = rep.tree_blocks[0];
        let data = h.store.meta[&b].clone();
        extent::verify_csum(&data, 0xDEAD_BEEF).expect("checksum tail set");
        assert_eq!(rext4_format::bytes::le16(&data, 4), block_capacity(1024));
        let mut bad = data.clone();
        bad[12] ^= 1;
        h.store.meta.insert(b, bad);
        let r = h.tree().extents();
        assert!(
            matches!(r, Err(Error::Corrupted { block: Some(x), .. }) if x == b),
            "{r:?}"
        );
        // Without metadata_csum no tail is checked.
        h.seed = None;
        h.store.meta.insert(b, data);
        h.verify();
    }

    #[test]
    fn the_end_of_the_logical_space() {
        let mut h = Harness::new(4096, 1 << 12, 0, None);
        let top = u32::MAX - 9;
        h.insert_data(top, 10, false, 50);
        h.insert_data(0, 3, true, 10);
        h.verify();
        let r = h.tree().insert(ext(top - 1, 11, 2000, false));
        assert!(r.is_err());
        assert_eq!(h.tree().remove(top + 5, MAX_LOGICAL).expect("trunc"), 5);
        h.model.retain(|&l, _| l < top + 5);
        h.verify();
        let r = h.tree().insert_range(1, 10);
        assert!(matches!(r, Err(Error::InvalidInput(_))), "{r:?}");
        assert_eq!(h.tree().collapse(0, top).expect("collapse"), 3);
        h.model = h
            .model
            .iter()
            .filter(|(l, _)| **l >= top)
            .map(|(l, v)| (l - top, *v))
            .collect();
        h.verify();
        assert_eq!(
            h.tree().extents().expect("extents"),
            vec![ext(0, 5, 50, false)]
        );
    }

    #[test]
    fn collapse_and_insert_range_shift_deep_trees() {
        let mut h = Harness::new(1024, 1 << 16, 0, Some(2));
        for i in 0..3000u32 {
            h.insert_data(2 * i, 1, i % 3 == 0, 10 + 2 * u64::from(i));
        }
        assert!(h.verify().depth >= 2);
        h.tree().insert_range(1001, 7).expect("insert range");
        h.model = h
            .model
            .iter()
            .map(|(&l, &v)| (if l >= 1001 { l + 7 } else { l }, v))
            .collect();
        h.verify();
        let freed = h.tree().collapse(500, 3000).expect("collapse");
        let gone = h.model.range(500..3500).count() as u64;
        assert_eq!(freed, gone);
        h.model = h
            .model
            .iter()
            .filter(|(&l, _)| !(500..3500).contains(&l))
            .map(|(&l, &v)| (if l >= 3500 { l - 3000 } else { l }, v))
            .collect();
        h.verify();
    }

    /// Filling a file in order in front of a far extent (a write after a seek, then
    /// the gap): leaves split at the insertion point and stay full, as the kernel's.
    #[test]
    fn in_order_fill_before_a_far_extent_keeps_leaves_full() {
        let mut h = Harness::new(4096, 1 << 14, 0, Some(4));
        h.insert_data(1_000_000, 1, false, 9000);
        for i in 0..1000u32 {
            h.insert_data(i, 1, false, 100 + 2 * u64::from(i));
        }
        let rep = h.verify();
        // 340 + 340 + 320 fragments, and the far extent alone in the last leaf.
        assert_eq!((rep.depth, rep.tree_blocks.len()), (1, 4));
        assert_eq!(rep.levels[1].entries, 1001);
    }

    /// 100,000 one-block fragments appended in order: full leaves, depth 2 at 4 KiB,
    /// then a truncate to zero frees everything.
    #[test]
    fn hundred_thousand_fragments_then_truncate() {
        let mut h = Harness::new(4096, 1 << 19, 0, Some(0x1234_5678));
        for i in 0..100_000u32 {
            // Physically every other block, so nothing merges.
            h.insert_data(i, 1, false, 1000 + 2 * u64::from(i));
        }
        let rep = h.verify();
        assert_eq!(rep.depth, 2);
        assert_eq!(rep.extents, 100_000);
        // 295 full leaves (340 entries) + 1 index block: sequential appends fill leaves.
        assert_eq!(rep.tree_blocks.len(), 100_000usize.div_ceil(340) + 1);
        assert!(rep.is_compact(4096));
        let freed = h.tree().remove(0, MAX_LOGICAL).expect("truncate");
        assert_eq!(freed, 100_000);
        h.model.clear();
        let rep = h.verify();
        assert_eq!((rep.depth, rep.extents, rep.tree_blocks.len()), (0, 0, 0));
        assert_eq!(h.blocks_512, 0);
        assert!(h.store.used.is_empty());
        let mut empty = [0u8; 60];
        init_empty(&mut empty);
        assert_eq!(h.root, empty);
    }

    /// Random insertion order at 1 KiB: leaves split in the middle, index nodes split,
    /// depth 3; then random punches and a full truncate.
    #[test]
    fn random_fragments_build_a_deep_tree_and_punch_it() {
        let mut h = Harness::new(1024, 1 << 17, 30, Some(42));
        let n = 20_000u32;
        let mut order: Vec<u32> = (0..n).collect();
        for i in (1..order.len()).rev() {
            let j = (h.store.rand() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        for (k, &i) in order.iter().enumerate() {
            let l = 2 * i;
            let goal = h.model.get(&(l.wrapping_sub(1))).map_or(0, |v| v.0 + 1);
            h.insert_data(l, 1, i % 5 == 0, goal);
            if k % 5000 == 4999 {
                h.verify();
            }
        }
        let rep = h.verify();
        assert!(rep.depth >= 3, "depth {}", rep.depth);
        for _ in 0..60 {
            let s = (h.store.rand() % u64::from(2 * n)) as u32;
            let len = (h.store.rand() % 1500) as u32 + 1;
            let want = h.model.range(s..s + len).count() as u64;
            assert_eq!(h.tree().remove(s, u64::from(s + len)).expect("punch"), want);
            h.model.retain(|&l, _| !(s..s + len).contains(&l));
        }
        h.verify();
        h.tree().mark_written(0, 2 * n).expect("mark");
        for v in h.model.values_mut() {
            v.1 = false;
        }
        h.verify();
        let left = h.model.len() as u64;
        assert_eq!(h.tree().remove(0, MAX_LOGICAL).expect("truncate"), left);
        h.model.clear();
        h.verify();
        assert!(h.store.used.is_empty());
    }

    /// Tree blocks go to an image file; blocks come from `pool` (then `reserve`, top
    /// first) so the test decides exactly which blocks the inode ends up owning.
    struct ImageStore {
        file: std::fs::File,
        bs: usize,
        pool: Vec<u64>,
        reserve: Vec<u64>,
        freed: Vec<u64>,
    }

    impl BlockStore for ImageStore {
        fn block_size(&self) -> usize {
            self.bs
        }
        fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
            use std::os::unix::fs::FileExt;
            let mut b = vec![0u8; self.bs];
            self.file.read_exact_at(&mut b, blk * self.bs as u64)?;
            Ok(b)
        }
        fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
            use std::os::unix::fs::FileExt;
            self.file.write_all_at(data, blk * self.bs as u64)?;
            Ok(())
        }
        fn alloc(&mut self, _goal: u64, _max_len: u32) -> Result<(u64, u32)> {
            let b = self.pool.pop().or_else(|| self.reserve.pop());
            b.map(|b| (b, 1))
                .ok_or_else(|| Error::Io(std::io::Error::other("pool exhausted")))
        }
        fn free(&mut self, start: u64, len: u64) -> Result<()> {
            self.freed.extend(start..start + len);
            Ok(())
        }
    }

    /// Ground truth: rebuild a debugfs-written file's blocks as a depth-2 tree of
    /// fragments (written and unwritten), install it with debugfs, and require
    /// `e2fsck -fn` clean and the read path to see the same extents.
    #[test]
    fn a_built_tree_passes_e2fsck_and_reads_back() {
        use crate::fs::{Fs, Ino};
        use rext4_format::superblock::feature::RO_COMPAT_METADATA_CSUM;
        use rext4_testkit::{debugfs_w_checked, e2fsck_fn, extent_depth, mkfs, MkfsOptions};
        const NBLK: u64 = 3000;
        for (opts, shuffled) in [
            ("metadata_csum", false),
            ("metadata_csum", true),
            ("^metadata_csum", true),
        ] {
            let img = mkfs(&MkfsOptions::new(1024, 32 << 20).arg("-O").arg(opts)).expect("mkfs");
            let host = img.dir().join("data");
            std::fs::write(&host, vec![0x5Au8; (NBLK * 1024) as usize]).expect("host file");
            debugfs_w_checked(img.path(), format!("write {} f\n", host.display()))
                .expect("debugfs write");
            let fs = Fs::open(img.path()).expect("open");
            let ino = fs.metadata("/f").expect("stat").ino;
            let inode = fs.read_inode(ino).expect("inode");
            let seed = fs
                .superblock()
                .has_ro_compat(RO_COMPAT_METADATA_CSUM)
                .then(|| fs.inode_seed(ino, &inode));
            assert_eq!(seed.is_some(), opts == "metadata_csum");
            let Node::Leaf(_, old) = Node::decode(&inode.block, true).expect("root") else {
                panic!("debugfs made a deep tree for a small file");
            };
            let mut pool: Vec<u64> = old
                .iter()
                .flat_map(|e| e.physical..e.physical + u64::from(e.len))
                .collect();
            assert_eq!(pool.len() as u64, NBLK);
            let old_blocks = inode.blocks_raw;
            drop(fs);

            // Hold back a contiguous run after an anchor block: tree blocks that are
            // needed once the pool is empty come from its top, and what is left of it
            // extends the anchor at the end (a merge, which allocates nothing).
            const R: usize = 12;
            let reserve = pool.split_off(pool.len() - R);
            let anchor_p = pool.pop().expect("anchor");
            assert_eq!(
                reserve[0],
                anchor_p + 1,
                "the file's last extent is contiguous"
            );
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(img.path())
                .expect("image");
            let mut store = ImageStore {
                file,
                bs: 1024,
                pool,
                reserve,
                freed: Vec::new(),
            };
            let mut root = [0u8; 60];
            init_empty(&mut root);
            let mut blocks_512 = 0u64;
            let mut t = ExtentTree::new(&mut store, &mut root, seed, &mut blocks_512);
            let anchor_l = 100_000u32;
            t.insert(ext(anchor_l, 1, anchor_p, false)).expect("anchor");
            let mut data = 1u64;
            let mut order: Vec<u32> = (0..t.store.pool.len() as u32).collect();
            if shuffled {
                let mut r = 0x2545_F491_4F6C_DD1Du64;
                for k in (1..order.len()).rev() {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    order.swap(k, (r % (k as u64 + 1)) as usize);
                }
            }
            let mut order = order.into_iter();
            while let Some(p) = t.store.pool.pop() {
                let i = order.next().expect("more order than blocks");
                t.insert(ext(2 * i, 1, p, i % 7 == 3)).expect("fragment");
                data += 1;
            }
            // Random order leaves half-empty leaves that e2fsck would offer to
            // repack; optimize() does it, and the tree blocks it frees come back
            // here as fragments past the end (appends keep the tree compact).
            let compact = t.check().expect("check").is_compact(1024);
            assert!(!(shuffled && compact), "a shuffled build came out compact");
            assert_eq!(t.optimize().expect("optimize"), !compact);
            t.store.pool = std::mem::take(&mut t.store.freed);
            assert_eq!(t.store.pool.is_empty(), compact);
            let mut past = anchor_l + R as u32 + 2;
            while let Some(p) = t.store.pool.pop() {
                t.insert(ext(past, 1, p, false)).expect("recycle");
                data += 1;
                past += 2;
            }
            let left = std::mem::take(&mut t.store.reserve);
            let rest = left.len();
            assert!(left
                .iter()
                .enumerate()
                .all(|(k, &b)| b == anchor_p + 1 + k as u64));
            t.insert(ext(anchor_l + 1, rest as u16, anchor_p + 1, false))
                .expect("extend");
            data += rest as u64;
            let rep = t.check().expect("check");
            assert_eq!(rep.depth, 2);
            assert!(rep.is_compact(1024), "{:?}", rep.levels);
            assert_eq!(rep.data_blocks, data);
            assert_eq!(data + rep.tree_blocks.len() as u64, NBLK);
            let built = t.extents().expect("extents");
            let anchor_at = built
                .iter()
                .position(|e| e.logical == anchor_l)
                .expect("anchor");
            assert_eq!(
                built[anchor_at],
                ext(anchor_l, 1 + rest as u16, anchor_p, false)
            );
            let size = t.last_extent().expect("last").expect("some").end() * 1024;
            drop(store);
            // The tree accounts for its own blocks; the caller adds the data blocks.
            assert_eq!(blocks_512, rep.tree_blocks.len() as u64 * 2);
            assert_eq!(blocks_512 + data * 2, old_blocks, "i_blocks");

            let mut script = String::new();
            for k in 0..15 {
                let w = rext4_format::bytes::le32(&root, 4 * k);
                // debugfs names the last three slots after their block-map roles.
                let slot = match k {
                    12 => "IND".to_string(),
                    13 => "DIND".to_string(),
                    14 => "TIND".to_string(),
                    _ => k.to_string(),
                };
                script += &format!("sif <{}> block[{slot}] {w:#x}\n", ino.0);
            }
            script += &format!("sif <{}> size {size}\n", ino.0);
            debugfs_w_checked(img.path(), script).expect("install root");
            let fsck = e2fsck_fn(img.path());
            assert!(fsck.clean, "e2fsck ({opts}, {shuffled}):\n{}", fsck.output);
            assert_eq!(extent_depth(img.path(), "/f").expect("ex"), Some(2));

            let fs = Fs::open(img.path()).expect("reopen");
            let inode = fs.read_inode(Ino(ino.0)).expect("inode");
            assert_eq!(inode.block, root);
            let seen = fs.extents(ino, &inode, u64::MAX).expect("read extents");
            let want: Vec<(u64, Mapping)> = built
                .iter()
                .map(|e| {
                    (
                        u64::from(e.logical),
                        Mapping::Mapped {
                            physical: e.physical,
                            len: u64::from(e.len),
                            unwritten: e.unwritten,
                        },
                    )
                })
                .collect();
            assert_eq!(seen, want);
        }
    }

    /// Random insertion order leaves slack e2fsck complains about; optimize() packs
    /// the tree (fewer blocks, same mapping) and leaves a compact one alone.
    #[test]
    fn optimize_packs_a_sparse_tree() {
        let mut h = Harness::new(1024, 1 << 16, 0, Some(77));
        let mut order: Vec<u32> = (0..3000).collect();
        for i in (1..order.len()).rev() {
            let j = (h.store.rand() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        for i in order {
            h.insert_data(3 * i, 1, i % 4 == 0, 100 + 3 * u64::from(i));
        }
        let before = h.verify();
        assert!(!before.is_compact(1024), "{:?}", before.levels);
        assert!(h.tree().optimize().expect("optimize"));
        let after = h.verify();
        assert!(after.is_compact(1024), "{:?}", after.levels);
        assert!(after.tree_blocks.len() < before.tree_blocks.len());
        assert_eq!(after.tree_blocks.len(), 3000usize.div_ceil(84) + 1);
        assert!(!h.tree().optimize().expect("optimize again"));
        // Keep one extent in 40: every leaf keeps two or three, and the level is
        // mostly slack.
        for k in 0..75u32 {
            let (a, b) = (120 * k + 3, 120 * k + 120);
            assert_eq!(h.tree().remove(a, u64::from(b)).expect("punch"), 39);
            h.model.retain(|&l, _| !(a..b).contains(&l));
        }
        let rep = h.verify();
        assert!(rep.depth > 0 && !rep.is_compact(1024), "{:?}", rep.levels);
        assert!(h.tree().optimize().expect("optimize"));
        let rep = h.verify();
        assert_eq!((rep.depth, rep.tree_blocks.len()), (1, 1));
        assert!(rep.is_compact(1024));
    }

    #[test]
    fn compactness_follows_e2fsck_rule() {
        let lv = |entries: u64, max_entries: u64| LevelStats {
            nodes: max_entries.div_ceil(84),
            entries,
            max_entries,
        };
        let r = |levels: Vec<LevelStats>| TreeReport {
            depth: levels.len() as u16 - 1,
            extents: 0,
            data_blocks: 0,
            tree_blocks: Vec::new(),
            levels,
        };
        assert!(r(vec![lv(0, 4)]).is_compact(1024));
        assert!(r(vec![lv(1, 4), lv(5, 84)]).is_compact(1024));
        // A depth-1 tree with 3 extents fits in the root: "could be shorter".
        assert!(!r(vec![lv(1, 4), lv(3, 84)]).is_compact(1024));
        // Slack of exactly one block is tolerated, one more slot is not.
        assert!(r(vec![lv(2, 4), lv(84, 168)]).is_compact(1024));
        assert!(!r(vec![lv(3, 4), lv(167, 252)]).is_compact(1024));
        // An index level with fewer entries than the root has slots: "shorter".
        assert!(!r(vec![lv(1, 4), lv(3, 84), lv(200, 252)]).is_compact(1024));
        assert!(r(vec![lv(1, 4), lv(5, 84), lv(400, 420)]).is_compact(1024));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert {
            at: u32,
            len: u32,
            unwritten: bool,
            contig: bool,
        },
        Remove {
            at: u32,
            len: u32,
        },
        Truncate {
            at: u32,
        },
        MarkWritten {
            at: u32,
            len: u32,
        },
        Collapse {
            at: u32,
            len: u32,
        },
        InsertRange {
            at: u32,
            len: u32,
        },
        Optimize,
    }

    const SPAN: u32 = 4000;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            14 => (0..SPAN, 1..12u32, any::<bool>(), prop::bool::weighted(0.5)).prop_map(
                |(at, len, unwritten, contig)| Op::Insert { at, len, unwritten, contig }
            ),
            3 => (0..SPAN, 1..300u32).prop_map(|(at, len)| Op::Remove { at, len }),
            1 => (0..SPAN).prop_map(|at| Op::Truncate { at }),
            3 => (0..SPAN, 1..400u32).prop_map(|(at, len)| Op::MarkWritten { at, len }),
            1 => (0..SPAN, 1..100u32).prop_map(|(at, len)| Op::Collapse { at, len }),
            1 => (0..SPAN, 1..100u32).prop_map(|(at, len)| Op::InsertRange { at, len }),
            1 => Just(Op::Optimize),
        ]
    }

    fn apply(h: &mut Harness, op: &Op) {
        match *op {
            Op::Insert {
                at,
                len,
                unwritten,
                contig,
            } => {
                let mut s = at;
                while h.model.contains_key(&s) {
                    s += 1;
                }
                let hole_end = h
                    .model
                    .range(s..)
                    .next()
                    .map_or(u64::MAX, |(k, _)| u64::from(*k));
                let n = hole_end.min(u64::from(s) + u64::from(len)) - u64::from(s);
                let goal = match (contig, s.checked_sub(1).and_then(|p| h.model.get(&p))) {
                    (true, Some(v)) => v.0 + 1,
                    _ => h.store.rand() % h.store.nblocks,
                };
                h.insert_data(s, n as u32, unwritten, goal);
            }
            Op::Remove { at, len } => {
                let end = at + len;
                let want = h.model.range(at..end).count() as u64;
                assert_eq!(h.tree().remove(at, u64::from(end)).expect("remove"), want);
                h.model.retain(|&l, _| !(at..end).contains(&l));
            }
            Op::Truncate { at } => {
                let want = h.model.range(at..).count() as u64;
                assert_eq!(h.tree().remove(at, MAX_LOGICAL).expect("truncate"), want);
                h.model.retain(|&l, _| l < at);
            }
            Op::MarkWritten { at, len } => {
                h.tree().mark_written(at, len).expect("mark_written");
                for (_, v) in h.model.range_mut(at..at + len) {
                    v.1 = false;
                }
            }
            Op::Collapse { at, len } => {
                let end = at + len;
                let want = h.model.range(at..end).count() as u64;
                assert_eq!(h.tree().collapse(at, len).expect("collapse"), want);
                h.model = h
                    .model
                    .iter()
                    .filter(|(&l, _)| !(at..end).contains(&l))
                    .map(|(&l, &v)| (if l >= end { l - len } else { l }, v))
                    .collect();
            }
            Op::Optimize => {
                h.tree().optimize().expect("optimize");
                let rep = h.tree().check().expect("check");
                assert!(rep.is_compact(1024), "{:?}", rep.levels);
            }
            Op::InsertRange { at, len } => {
                h.tree().insert_range(at, len).expect("insert_range");
                h.model = h
                    .model
                    .iter()
                    .map(|(&l, &v)| (if l >= at { l + len } else { l }, v))
                    .collect();
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Random operation sequences on 1 KiB blocks (84-entry nodes) agree with a
        /// block-by-block model, keep every invariant and leak no block.
        #[test]
        fn random_operations_match_the_model(
            ops in prop::collection::vec(op(), 1..600),
            scatter in 0..60u64,
            csum in any::<bool>(),
        ) {
            let mut h = Harness::new(1024, 1 << 16, scatter, csum.then_some(0xC0FF_EE00));
            for op in &ops {
                apply(&mut h, op);
                h.verify();
            }
            h.tree().remove(0, MAX_LOGICAL).expect("final truncate");
            h.model.clear();
            h.verify();
            prop_assert!(h.store.used.is_empty());
            prop_assert_eq!(h.blocks_512, 0);
        }
    }
}
