//! Writing inodes and the filesystem-side implementations of the write seams
//! ([`BlockStore`] for extent trees, [`DirStore`] for directories).
//!
//! Every inode change goes through [`Fs::write_inode`]: encode over the old record,
//! refresh the checksum, hand the inode-table block to the buffer cache (the single
//! place where metadata becomes dirty). New inodes get a zeroed record first, so stale
//! bytes of a previously used slot never survive.
//!
//! bigalloc (clusters of 2^n blocks): a file's logical cluster maps to one physical
//! cluster, each block at its own offset in it (the kernel's EXT4_PBLK_COFF rule). New
//! data goes where [`alloc_data_run`] puts it: into the cluster the file already has
//! for that logical cluster (another extent of it maps a block there: the kernel's
//! implied cluster), else into fresh clusters; i_blocks counts whole clusters. An
//! unmap ([`unmap_range`]) keeps the clusters of its edges that blocks outside it still
//! use (the kernel's partial-cluster rule) and frees each other cluster once.

use rext4_format::extent;
use rext4_format::inode::{self as fi, flags, Inode, Timestamp};
use rext4_format::superblock::feature;

use crate::blockmap_write::BlockMap;
use crate::cache::Kind;
use crate::error::{Error, Result};
use crate::extent_write::ExtentTree;
use crate::fs::map::{Mapping, MAX_LOGICAL};
use crate::fs::{Fs, Ino};
use crate::store::{BlockStore, DirStore};

/// The current time as an inode timestamp.
pub fn now_ts() -> Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        sec: d.as_secs() as i64,
        nsec: d.subsec_nanos(),
    }
}

impl Fs {
    /// The time of a change now (`FsOptions::clock`; the epoch in reproducible mode).
    pub(crate) fn now(&self) -> Timestamp {
        match &self.inner.repro {
            Some(r) => r.now(),
            None => (self.inner.clock)(),
        }
    }

    /// A time a caller sets (utimes, setattr), as it is stored: clamped to what ext4
    /// holds, and in reproducible mode to the epoch.
    pub(crate) fn settable_time(&self, t: Timestamp) -> Timestamp {
        match &self.inner.repro {
            Some(r) => r.clamp(t.clamped()),
            None => t.clamped(),
        }
    }

    /// Store `inode` as inode `ino`. Caller holds the write lock.
    pub(crate) fn write_inode(&self, ino: Ino, inode: &Inode) -> Result<()> {
        self.write_inode_record(ino, inode, false)
    }

    /// Store the last record of an inode being freed: not kept in the inode cache
    /// (the free takes it out anyway; setting it first cost an insert and a removal).
    pub(crate) fn write_freed_inode(&self, ino: Ino, inode: &Inode) -> Result<()> {
        self.write_inode_record_with(ino, inode, Base::Current, false)
    }

    /// Store a brand-new inode (the slot's old bytes are discarded).
    pub(crate) fn write_new_inode(&self, ino: Ino, inode: &Inode) -> Result<()> {
        self.write_inode_record(ino, inode, true)
    }

    /// Store `inode` over the record bytes `raw` (for changes of the in-inode xattr area,
    /// which `Inode` does not model).
    pub(crate) fn write_inode_raw(&self, ino: Ino, raw: &[u8], inode: &Inode) -> Result<()> {
        self.write_inode_record_with(ino, inode, Base::Raw(raw), true)
    }

    fn write_inode_record(&self, ino: Ino, inode: &Inode, fresh: bool) -> Result<()> {
        let base = if fresh { Base::Zero } else { Base::Current };
        self.write_inode_record_with(ino, inode, base, true)
    }

    /// Write `inode` into its record over `base`, and into the inode cache when
    /// `cached`.
    fn write_inode_record_with(
        &self,
        ino: Ino,
        inode: &Inode,
        base: Base<'_>,
        cached: bool,
    ) -> Result<()> {
        self.check_writable()?;
        let (blk, off) = self.inode_location(ino)?;
        let isz = usize::from(self.inner.sb.inode_size);
        let outside = || Error::corrupted("inode record outside its block", Some(blk));
        // The new record is made first: its bytes have one writer at a time (this
        // inode's, under its inode lock or the write lock), and putting it in is one
        // step of the buffer cache (`update`, under its shard's mutex), so writers of
        // the block's other records (handles on other inodes) wait for no more than
        // the copy of one record.
        let mut rec = match base {
            Base::Raw(b) if b.len() != isz => {
                return Err(Error::InvalidInput("inode record of the wrong size".into()))
            }
            Base::Raw(b) => b.to_vec(),
            Base::Zero => vec![0u8; isz],
            Base::Current => {
                let data = self.cache().read(blk, Kind::InodeTable, |_| Ok(()))?;
                data.get(off..off + isz).ok_or_else(outside)?.to_vec()
            }
        };
        self.seal_record(ino, inode, &mut rec);
        // What a reader decoding the new record would get, for the inode cache.
        let decoded = cached.then(|| Inode::decode(&rec).ok()).flatten();
        self.cache().update(blk, Kind::InodeTable, |data| {
            data.get_mut(off..off + isz)
                .ok_or_else(outside)?
                .copy_from_slice(&rec);
            Ok(())
        })?;
        // (This inode's record has one writer at a time, under its inode lock or the
        // write lock: the inode cache's entry for it is set by that writer alone.)
        self.cache_inode(ino, decoded);
        Ok(())
    }

    /// Encode `inode` into record bytes `rec` (keeping what `Inode` does not model)
    /// and checksum them.
    fn seal_record(&self, ino: Ino, inode: &Inode, rec: &mut [u8]) {
        inode.encode_into(rec);
        if self.inner.metadata_csum {
            fi::set_csum(rec, ino.0, self.inner.csum_seed);
        }
    }

    /// Tell the inode cache what `ino`'s record now decodes to (`None`: forget it).
    fn cache_inode(&self, ino: Ino, decoded: Option<Inode>) {
        let icache = &self.inner.caches.inodes;
        match decoded {
            Some(i) => icache.set(ino.0, std::sync::Arc::new(i)),
            None => icache.invalidate(&ino.0),
        }
    }

    /// Change inode `ino`'s record with `f` as one read-modify-write under its table
    /// block's lock, the inode cache set under the same lock: for records several
    /// threads may change at once — a directory's times, changed by creates and
    /// unlinks that hold its inode lock shared — so neither the record nor the cache
    /// loses a change or takes them out of order.
    pub(crate) fn change_inode_record(&self, ino: Ino, f: impl FnOnce(&mut Inode)) -> Result<()> {
        self.check_writable()?;
        let (blk, off) = self.inode_location(ino)?;
        let isz = usize::from(self.inner.sb.inode_size);
        let _b = self.block_lock(blk);
        let decoded = self.cache().update(blk, Kind::InodeTable, |data| {
            let rec = data
                .get_mut(off..off + isz)
                .ok_or_else(|| Error::corrupted("inode record outside its block", Some(blk)))?;
            let mut inode = Inode::decode(rec).map_err(Error::from)?;
            f(&mut inode);
            self.seal_record(ino, &inode, rec);
            Ok(Inode::decode(rec).ok())
        })?;
        self.cache_inode(ino, decoded);
        Ok(())
    }

    /// A fresh in-memory inode of `mode` (type and permissions).
    pub(crate) fn new_inode(&self, mode: u16, uid: u32, gid: u32) -> Inode {
        let t = self.now();
        let mut i = Inode::decode(&[0u8; 256]).unwrap_or_else(|_| unreachable_inode());
        i.mode = mode;
        i.uid = uid;
        i.gid = gid;
        i.atime = t;
        i.mtime = t;
        i.ctime = t;
        i.crtime = Some(t);
        i.links_count = 1;
        i.extra_isize = self.inner.sb.inode_extra_size();
        i.generation = self.next_generation();
        i
    }

    fn next_generation(&self) -> u32 {
        use std::sync::atomic::{AtomicU32, Ordering};
        if let Some(r) = &self.inner.repro {
            return r.next_generation();
        }
        // A step per thread (no shared counter for creates on different CPUs to bounce),
        // started apart for each thread.
        static THREADS: AtomicU32 = AtomicU32::new(0);
        thread_local! {
            static GEN: std::cell::Cell<u32> = std::cell::Cell::new(
                THREADS.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9),
            );
        }
        let t = now_ts();
        let mix = (t.nsec ^ (t.sec as u32).rotate_left(13)).wrapping_mul(0x9E37_79B9);
        GEN.with(|g| {
            let v = g.get();
            g.set(v.wrapping_add(0x6F4F_2A35));
            v.wrapping_add(mix)
        })
    }

    /// Give new inode `inode` an empty extent tree when the filesystem uses extents
    /// (else it keeps an empty block map).
    pub(crate) fn map_by_extents(&self, inode: &mut Inode) {
        if self.uses_extents() {
            inode.flags |= flags::EXTENTS;
            crate::extent_write::init_empty(&mut inode.block);
        }
    }

    /// Whether new regular files and directories use extents.
    pub(crate) fn uses_extents(&self) -> bool {
        self.inner.sb.has_incompat(feature::INCOMPAT_EXTENTS)
    }

    /// Checksum seed for blocks owned by `ino` (None without metadata_csum).
    pub(crate) fn owned_seed(&self, ino: Ino, inode: &Inode) -> Option<u32> {
        self.inner
            .metadata_csum
            .then(|| self.inode_seed(ino, inode))
    }

    /// Goal block for new data of `ino` at logical `lblk`: right after the previous
    /// mapped block when there is one, else the start of the inode's group.
    pub(crate) fn data_goal(&self, ino: Ino, inode: &Inode, lblk: u64) -> u64 {
        let sb = &self.inner.sb;
        let in_fs = |g: u64| g >= u64::from(sb.first_data_block) && g < sb.blocks_count;
        match self.goal_near(ino, inode, lblk) {
            Ok(Some(g)) if in_fs(g) => return g,
            // No extent yet and not the start of the file (writes arriving out of
            // order): leave room before it for the blocks that precede it.
            Ok(None) if lblk > 0 && inode.has_flag(rext4_format::inode::flags::EXTENTS) => {
                let g = ((ino.0 - 1) / sb.inodes_per_group) as usize;
                if let Ok(Some(f)) = self.first_free_in_group(g) {
                    if in_fs(f.saturating_add(lblk)) {
                        return f + lblk;
                    }
                }
            }
            _ => {}
        }
        if lblk > 0 {
            if let Ok(Mapping::Mapped { physical, .. }) = self.map_block(ino, inode, lblk - 1) {
                return physical + 1;
            }
        }
        self.home_goal(ino)
    }

    /// Where a file with nothing mapped near starts: its inode's group.
    pub(crate) fn home_goal(&self, ino: Ino) -> u64 {
        let sb = &self.inner.sb;
        let g = u64::from((ino.0 - 1) / sb.inodes_per_group);
        sb.group_first_block(g)
    }
}

fn unreachable_inode() -> Inode {
    // Inode::decode of 256 zero bytes cannot fail; keep a total fallback anyway.
    Inode {
        mode: 0,
        uid: 0,
        gid: 0,
        size: 0,
        atime: Timestamp::default(),
        ctime: Timestamp::default(),
        mtime: Timestamp::default(),
        crtime: None,
        dtime: 0,
        links_count: 0,
        blocks_raw: 0,
        flags: 0,
        version: 0,
        block: [0; 60],
        generation: 0,
        file_acl: 0,
        extra_isize: 0,
        projid: 0,
        checksum: 0,
    }
}

/// [`BlockStore`] over the filesystem for one inode's extent tree.
pub(crate) struct FsBlocks<'a> {
    pub fs: &'a Fs,
    pub seed: Option<u32>,
    /// bigalloc: clusters its data frees must leave alone, and those freed already.
    pub clusters: ClusterFrees,
}

/// What the data frees of one tree change know of clusters (bigalloc): the clusters
/// blocks outside the unmapped range still use, and the clusters given back so far (a
/// cluster two removed extents shared is given back once).
#[derive(Default)]
pub(crate) struct ClusterFrees {
    keep: Vec<u64>,
    freed: std::collections::HashSet<u64>,
}

impl BlockStore for FsBlocks<'_> {
    fn block_size(&self) -> usize {
        self.fs.inner.block_size as usize
    }
    fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
        let seed = self.seed;
        let d = self.fs.cache().read(blk, Kind::ExtentNode, |b| {
            if let Some(s) = seed {
                extent::verify_csum(b, s)?;
            }
            extent::Node::decode(b, false)?;
            Ok(())
        })?;
        Ok(d.to_vec())
    }
    fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
        let seed = self.seed;
        self.fs.cache().write(blk, Kind::ExtentNode, data, |b| {
            if let Some(s) = seed {
                extent::verify_csum(b, s)?;
            }
            extent::Node::decode(b, false)?;
            Ok(())
        })
    }
    /// Extent tree blocks: from the end of the goal's group (see `alloc_meta_block`).
    fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
        if max_len == 1 {
            return self.fs.alloc_meta_block(goal).map(|b| (b, 1));
        }
        self.fs.alloc_blocks(goal, max_len)
    }
    fn free(&mut self, start: u64, len: u64) -> Result<()> {
        self.fs.free_blocks(start, len)
    }
    fn free_data(&mut self, start: u64, len: u64) -> Result<u64> {
        let cb = self.fs.cluster_bits();
        if cb == 0 || len == 0 {
            self.fs.free_blocks(start, len)?;
            return Ok(len);
        }
        // The run's clusters: only its first and last can be shared (with a kept edge
        // or another run); those in between are its own.
        let (c0, c1) = (start >> cb, (start + len - 1) >> cb);
        let mut gone = 0;
        let mut run: Option<(u64, u64)> = None;
        for c in c0..=c1 {
            let edge = c == c0 || c == c1;
            let skip = edge && (self.clusters.keep.contains(&c) || !self.clusters.freed.insert(c));
            if skip {
                if let Some((a, n)) = run.take() {
                    self.fs.free_blocks(a << cb, n << cb)?;
                    gone += n << cb;
                }
                continue;
            }
            run = match run {
                Some((a, n)) => Some((a, n + 1)),
                None => Some((c, 1)),
            };
        }
        if let Some((a, n)) = run {
            self.fs.free_blocks(a << cb, n << cb)?;
            gone += n << cb;
        }
        Ok(gone)
    }
    fn tree_block_weight(&self) -> u64 {
        1 << self.fs.cluster_bits()
    }
}

/// The first block of the physical cluster that `ino` maps some block of logical
/// `[from, to)` into (bigalloc: the blocks of one logical cluster share one physical
/// cluster), or None when none of them is mapped.
fn cluster_mapped_in(fs: &Fs, ino: Ino, inode: &Inode, from: u64, to: u64) -> Result<Option<u64>> {
    let cb = fs.cluster_bits();
    let mut l = from;
    while l < to {
        match fs.map_block(ino, inode, l)? {
            Mapping::Mapped { physical, .. } => return Ok(Some((physical >> cb) << cb)),
            Mapping::Hole { len } => l = l.saturating_add(len.max(1)),
        }
    }
    Ok(None)
}

/// Where new data of a file goes (see [`alloc_data_run`]).
pub(crate) struct DataRun {
    /// First physical block and blocks to map from logical `lblk` on.
    pub physical: u64,
    pub len: u64,
    /// Blocks newly taken for the file (whole clusters with bigalloc; none when the
    /// run lies in a cluster the file had): what its i_blocks gains, and what
    /// [`undo_data_run`] gives back.
    pub fresh: u64,
}

/// Blocks for a hole of `ino` at logical `lblk`, up to `want` (≥ 1) of them, from
/// `data(goal, len)` (the caller's allocation under its claim). With bigalloc the run
/// keeps each block at its logical offset within its cluster: in the physical cluster
/// the file already maps for that logical cluster (no allocation), else in fresh
/// clusters, stopping before a last logical cluster the file already has.
pub(crate) fn alloc_data_run(
    fs: &Fs,
    ino: Ino,
    inode: &Inode,
    lblk: u64,
    want: u64,
    data: &mut dyn FnMut(u64, u32) -> Result<(u64, u32)>,
) -> Result<DataRun> {
    let want = want.clamp(1, u64::from(u32::MAX >> 1));
    let goal = fs.data_goal(ino, inode, lblk);
    let cb = fs.cluster_bits();
    if cb == 0 {
        let (p, got) = data(goal, want as u32)?;
        let got = u64::from(got);
        return Ok(DataRun {
            physical: p,
            len: got,
            fresh: got,
        });
    }
    let ratio = 1u64 << cb;
    let off = lblk & (ratio - 1);
    let base = lblk - off;
    if let Some(c) = cluster_mapped_in(fs, ino, inode, base, base + ratio)? {
        return Ok(DataRun {
            physical: c + off,
            len: want.min(ratio - off),
            fresh: 0,
        });
    }
    let mut want = want;
    let last_base = ((lblk + want - 1) >> cb) << cb;
    if last_base > base
        && lblk + want < last_base + ratio
        && cluster_mapped_in(fs, ino, inode, last_base, last_base + ratio)?.is_some()
    {
        want = last_base - lblk;
    }
    let (p, got) = data((goal >> cb) << cb, (off + want) as u32)?;
    // `p` starts a cluster (the allocator gives whole clusters) and `got` covers at
    // least the first of them, so more than `off`.
    let got = u64::from(got);
    if p & (ratio - 1) != 0 || got <= off {
        let _ = fs.free_blocks(p, got);
        return Err(Error::corrupted(
            format!("allocator gave {p}+{got}, not a run of whole clusters"),
            None,
        ));
    }
    Ok(DataRun {
        physical: p + off,
        len: (got - off).min(want),
        fresh: got.div_ceil(ratio) << cb,
    })
}

/// Give back what [`alloc_data_run`] took, when its blocks could not be mapped.
pub(crate) fn undo_data_run(fs: &Fs, run: &DataRun) {
    if run.fresh > 0 {
        let _ = fs.free_blocks(run.physical, run.len);
    }
}

/// Whether `inode`'s `i_block` holds block pointers: regular files, directories and
/// slow symlinks without EXTENTS_FL (a fast symlink keeps its target there, a device
/// its number).
pub(crate) fn uses_block_map(inode: &Inode) -> bool {
    if inode.has_flag(flags::EXTENTS) || inode.has_flag(flags::INLINE_DATA) {
        return false;
    }
    let ft = inode.mode & rext4_format::inode::mode::S_IFMT;
    ft == rext4_format::inode::mode::S_IFREG
        || ft == rext4_format::inode::mode::S_IFDIR
        || (ft == rext4_format::inode::mode::S_IFLNK && inode.size >= 60)
}

/// Run `f` on the extent tree of `inode`, which must have EXTENTS_FL: a block-mapped
/// inode is changed through [`map_new_blocks`] and [`unmap_range`] instead (it keeps
/// its block map, as the kernel keeps it), and has no operation that needs a tree
/// (unwritten extents, collapse and insert range: EOPNOTSUPP, as on the kernel). The
/// caller holds the write lock (or the tree lock in a handle) and writes the inode.
pub(crate) fn with_tree<R>(
    fs: &Fs,
    ino: Ino,
    inode: &mut Inode,
    f: impl FnOnce(&mut ExtentTree<'_, FsBlocks<'_>>) -> Result<R>,
) -> Result<R> {
    with_tree_freeing(fs, ino, inode, ClusterFrees::default(), f)
}

/// [`with_tree`], its data frees knowing `clusters` (bigalloc).
fn with_tree_freeing<R>(
    fs: &Fs,
    ino: Ino,
    inode: &mut Inode,
    clusters: ClusterFrees,
    f: impl FnOnce(&mut ExtentTree<'_, FsBlocks<'_>>) -> Result<R>,
) -> Result<R> {
    if !inode.has_flag(flags::EXTENTS) {
        return Err(Error::Unsupported(format!(
            "inode {} is not extent-mapped",
            ino.0
        )));
    }
    let seed = fs.owned_seed(ino, inode);
    let mut store = FsBlocks { fs, seed, clusters };
    let mut blocks = inode.blocks_raw;
    let mut root = inode.block;
    let r = {
        let mut tree = ExtentTree::new(&mut store, &mut root, seed, &mut blocks);
        f(&mut tree)
    };
    inode.block = root;
    inode.blocks_raw = blocks;
    r
}

/// [`BlockStore`] over the filesystem for one inode's block map: indirect blocks
/// through the buffer cache (no checksum and no magic: nothing to verify), allocated
/// at the goal the map gives, as the kernel's `ext4_new_meta_blocks` (next to the
/// data, not at the end of the group as extent-tree blocks), under the caller's claim.
pub(crate) struct FsIndirect<'a> {
    pub fs: &'a Fs,
}

impl BlockStore for FsIndirect<'_> {
    fn block_size(&self) -> usize {
        self.fs.inner.block_size as usize
    }
    fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
        Ok(self
            .fs
            .cache()
            .read(blk, Kind::Indirect, |_| Ok(()))?
            .to_vec())
    }
    fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
        self.fs.cache().write(blk, Kind::Indirect, data, |_| Ok(()))
    }
    fn alloc(&mut self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
        self.fs.alloc_blocks(goal, max_len)
    }
    fn free(&mut self, start: u64, len: u64) -> Result<()> {
        self.fs.free_blocks(start, len)
    }
}

/// Run `f` on the block map of `inode` (one for which [`uses_block_map`] holds).
fn with_block_map<R>(
    fs: &Fs,
    ino: Ino,
    inode: &mut Inode,
    f: impl FnOnce(&mut BlockMap<'_, FsIndirect<'_>>) -> Result<R>,
) -> Result<R> {
    let home = fs.home_goal(ino);
    let valid = fs.valid_blocks();
    let mut store = FsIndirect { fs };
    let mut blocks = inode.blocks_raw;
    let mut root = inode.block;
    let r = f(&mut BlockMap::new(
        &mut store,
        &mut root,
        &mut blocks,
        home,
        valid,
    ));
    inode.block = root;
    inode.blocks_raw = blocks;
    r
}

/// The block map of `inode` walked whole and checked (the audit): pointers inside the
/// filesystem, no block twice.
pub(crate) fn block_map_report(
    fs: &Fs,
    ino: Ino,
    inode: &Inode,
) -> Result<crate::blockmap_write::MapReport> {
    let mut copy = inode.clone();
    with_block_map(fs, ino, &mut copy, |m| m.check())
}

/// Map new blocks at the hole at logical block `lblk` of `ino`, whichever map it has:
/// up to `want` blocks from `data(goal, len)` (the caller's allocation under its own
/// space claim; tree and indirect blocks come under the claim the caller holds around
/// this call). An extent-mapped file gets them as one extent, unwritten when asked; a
/// block-mapped one through its map, after the indirect blocks it lacks (no unwritten
/// state: the caller must have the data on the device before the mapping can be
/// committed — it holds the write lock or its handle until then). `i_blocks` grows by
/// every block mapped or made. Returns the run (physical start, blocks). On error
/// nothing is mapped and the blocks `data` gave are freed.
pub(crate) fn map_new_blocks(
    fs: &Fs,
    ino: Ino,
    inode: &mut Inode,
    lblk: u64,
    want: u64,
    unwritten: bool,
    data: &mut dyn FnMut(u64, u32) -> Result<(u64, u32)>,
) -> Result<(u64, u64)> {
    if uses_block_map(inode) {
        return with_block_map(fs, ino, inode, |m| m.alloc(lblk, want, data));
    }
    if lblk >= MAX_LOGICAL {
        return Err(Error::FileTooLarge);
    }
    let want = want.clamp(1, u64::from(crate::extent_write::max_len(unwritten)));
    let run = alloc_data_run(fs, ino, inode, lblk, want, data)?;
    let ext = extent::Extent {
        logical: lblk as u32,
        len: run.len as u16,
        physical: run.physical,
        unwritten,
    };
    if let Err(e) = with_tree(fs, ino, inode, |t| t.insert(ext)) {
        undo_data_run(fs, &run);
        return Err(e);
    }
    inode.blocks_raw += run.fresh * u64::from(fs.inner.block_size) / 512;
    Ok((run.physical, run.len))
}

/// Free the blocks of logical `[start, end)` of `ino`, whichever map it has. Extent
/// removal may split an extent (a new leaf: the caller's claim decides whether the
/// pool may be used); a block map frees its emptied indirect blocks too, but keeps
/// the path of a range where the page cache holds delayed pages (their promises
/// counted only the indirect blocks missing when they were dirtied). An inode with
/// no block map (a fast symlink, a device) has nothing to free.
pub(crate) fn unmap_range(
    fs: &Fs,
    ino: Ino,
    inode: &mut Inode,
    start: u64,
    end: u64,
) -> Result<()> {
    if start >= end.min(MAX_LOGICAL) {
        return Ok(());
    }
    if inode.has_flag(flags::EXTENTS) {
        // bigalloc: a cluster at either edge stays while blocks outside the range use it.
        let mut clusters = ClusterFrees::default();
        let cb = fs.cluster_bits();
        if cb > 0 {
            let mask = (1u64 << cb) - 1;
            let edges = [
                (start & !mask, start),
                (
                    end,
                    if end < MAX_LOGICAL {
                        (end | mask) + 1
                    } else {
                        end
                    },
                ),
            ];
            for (a, b) in edges {
                if let Some(c) = cluster_mapped_in(fs, ino, inode, a, b.min(MAX_LOGICAL))? {
                    clusters.keep.push(c >> cb);
                }
            }
        }
        return with_tree_freeing(fs, ino, inode, clusters, |t| {
            t.remove(start as u32, end).map(|_| ())
        });
    }
    if !uses_block_map(inode) {
        return Ok(());
    }
    let keep = |a: u64, b: u64| fs.pc_delalloc_in(ino, a, b);
    fs.pc_forget_indirect(ino);
    with_block_map(fs, ino, inode, |m| m.remove(start, end, &keep).map(|_| ()))
}

/// What a record write starts from: zeros (a new inode), given bytes (the in-inode
/// xattr area changed too), or the record as it is.
enum Base<'a> {
    Zero,
    Raw(&'a [u8]),
    Current,
}

/// [`DirStore`] for one directory inode; the inode is written back by the caller
/// (`dirty` says whether it changed).
pub(crate) struct FsDir<'a> {
    pub fs: &'a Fs,
    pub ino: Ino,
    pub inode: Inode,
    pub dirty: bool,
}

impl FsDir<'_> {
    pub(crate) fn phys(&self, lblk: u64) -> Result<u64> {
        match self.fs.map_block(self.ino, &self.inode, lblk)? {
            Mapping::Mapped {
                physical,
                unwritten: false,
                ..
            } => Ok(physical),
            _ => Err(Error::corrupted(
                format!("directory {} has a hole at block {lblk}", self.ino.0),
                None,
            )),
        }
    }
}

impl DirStore for FsDir<'_> {
    fn block_size(&self) -> usize {
        self.fs.inner.block_size as usize
    }
    fn nblocks(&self) -> u64 {
        self.inode.size / u64::from(self.fs.inner.block_size)
    }
    fn read_block(&self, lblk: u64) -> Result<Vec<u8>> {
        let p = self.phys(lblk)?;
        Ok(self.fs.cache().read(p, Kind::Raw, |_| Ok(()))?.to_vec())
    }
    fn write_block(&mut self, lblk: u64, data: &[u8]) -> Result<()> {
        let p = self.phys(lblk)?;
        self.fs.cache().write(p, Kind::Raw, data, |_| Ok(()))
    }
    fn read_leaf(&self, lblk: u64) -> Result<Vec<u8>> {
        let p = self.phys(lblk)?;
        Ok(self.fs.read_leaf_at(p, self.ino, &self.inode)?.to_vec())
    }
    fn change_leaf(
        &mut self,
        lblk: u64,
        f: &mut dyn FnMut(&mut [u8]) -> Result<bool>,
    ) -> Result<bool> {
        let p = self.phys(lblk)?;
        // Verified as a leaf first (once per read from the device); then changed in
        // the cache, in place where nothing else holds it.
        drop(self.fs.read_leaf_at(p, self.ino, &self.inode)?);
        let verify = cfg!(debug_assertions).then(|| self.fs.leaf_verifier(self.ino, &self.inode));
        let changed = self.fs.cache().update_if(p, Kind::DirLeaf, |b| {
            if !f(b)? {
                return Ok(None);
            }
            // As `write_leaf`: debug builds (the tests) check what the directory code
            // built.
            if let Some(v) = &verify {
                if let Err(e) = v(b) {
                    panic!(
                        "directory {} block {lblk}: a change left a bad leaf: {e}",
                        self.ino.0
                    );
                }
            }
            Ok(Some(()))
        })?;
        Ok(changed.is_some())
    }
    fn read_index(&self, lblk: u64) -> Result<std::sync::Arc<[u8]>> {
        Ok(self.fs.read_index(self.ino, &self.inode, lblk)?.0)
    }
    fn write_leaf(&mut self, lblk: u64, data: &[u8]) -> Result<()> {
        let p = self.phys(lblk)?;
        // The directory code built this leaf from verified ones; checking it again on
        // every write (and on the next read) was a quarter of a create's time. Debug
        // builds (the tests) still check it.
        let verify = cfg!(debug_assertions).then(|| self.fs.leaf_verifier(self.ino, &self.inode));
        self.fs
            .cache()
            .write(p, Kind::DirLeaf, data, |b| verify.map_or(Ok(()), |v| v(b)))
    }
    fn append_block(&mut self) -> Result<u64> {
        let bs = u64::from(self.fs.inner.block_size);
        let lblk = self.inode.size / bs;
        if lblk >= u64::from(u32::MAX) {
            return Err(Error::NoSpace);
        }
        let ino = self.ino;
        let fs = self.fs;
        let mut alloc = |goal: u64, n: u32| fs.alloc_blocks(goal, n);
        let (p, _) = map_new_blocks(fs, ino, &mut self.inode, lblk, 1, false, &mut alloc)?;
        // The new block starts as a valid empty leaf, never stale bytes: should the
        // change that appended it stop here (ENOSPC at its next step), the directory
        // written as it stands is still well formed.
        let mut b = vec![0u8; bs as usize];
        let seed = self.fs.owned_seed(ino, &self.inode);
        rext4_format::dir::init_empty_leaf(&mut b, seed.is_some());
        if let Some(s) = seed {
            rext4_format::dir::set_leaf_csum(&mut b, s)?;
        }
        self.fs.cache().write(p, Kind::Raw, b, |_| Ok(()))?;
        self.inode.size += bs;
        self.dirty = true;
        Ok(lblk)
    }
    fn is_indexed(&self) -> bool {
        // As the readers see it: the flag counts only with the dir_index feature.
        self.inode.has_flag(flags::INDEX) && self.fs.inner.sb.has_compat(feature::COMPAT_DIR_INDEX)
    }
    fn set_indexed(&mut self, on: bool) -> Result<()> {
        if on {
            self.inode.flags |= flags::INDEX;
        } else {
            self.inode.flags &= !flags::INDEX;
        }
        self.dirty = true;
        Ok(())
    }
    fn csum_seed(&self) -> Option<u32> {
        self.fs.owned_seed(self.ino, &self.inode)
    }
    fn hash_params(&self) -> ([u32; 4], u32, u8) {
        let sb = &self.fs.inner.sb;
        (sb.hash_seed, sb.flags, sb.def_hash_version)
    }
    fn largedir(&self) -> bool {
        self.fs.inner.sb.has_incompat(feature::INCOMPAT_LARGEDIR)
    }
    fn casefold(&self) -> Option<bool> {
        self.fs.casefold_of(&self.inode)
    }
}
