//! Block and inode allocation.
//!
//! Data: each group's descriptor (free counts, flags, bitmap checksums) lives in
//! `Inner::groups` behind a per-group mutex; bitmaps live in the buffer cache and are
//! loaded on first use. A BLOCK_UNINIT / INODE_UNINIT group has no bitmap on disk: its
//! bitmap is computed (format notes §2.3), written, and the flag cleared the first time
//! anything is allocated in it. Free counts (group and superblock) and itable_unused
//! stay exact; bitmap and descriptor checksums are refreshed on every change. A bitmap
//! is searched in the cached buffer itself and changed in place where nothing else
//! holds it (`BufferCache::update`): a change checks everything it needs first, so a
//! refused one (a double free) leaves the bitmap as it was.
//!
//! bigalloc: a bitmap bit and a descriptor's free count stand for a cluster (2^n
//! blocks, `Superblock::cluster_bits`), the superblock's free count for blocks (whole
//! clusters). Everything here takes and gives whole clusters: an allocation returns a
//! run starting at a cluster's first block, and every cluster it touches is taken (a
//! caller that wants fewer blocks still owns the rest of the last cluster, as an xattr
//! or extent-tree block owns its whole cluster on the kernel); a free gives back every
//! cluster its range touches, so callers free a cluster only once none of its blocks
//! is used (`inode_write::unmap_range`). Which block inside a cluster a file's data
//! takes (the kernel's rule: the offset of its logical block in its logical cluster)
//! is the caller's (`inode_write::alloc_data_run`).
//!
//! Policy (in the spirit of mballoc, simplified): block allocation is goal-directed —
//! the search starts at the goal block (the file's previous physical block + 1, or its
//! inode's group) and takes the first free run there, extended up to the wanted length;
//! groups without free blocks are skipped by their counters without I/O. Inodes: files
//! go to their parent's group, directories are spread (Orlov-like: the next group with
//! at least average free inodes and blocks).
//!
//! Every allocation is admitted by `space` under the calling thread's claim before its
//! bits are set: free blocks promised to delayed allocation or kept back (the pool,
//! the root reserve) are not there for every caller.
//!
//! An allocation limit (`Fs::set_alloc_limit`, used by a shrink: `crate::resize`) keeps
//! block and inode allocations below a block and in the groups that start below it.
//!
//! Locking: callers hold `Fs::write_lock` or a handle (handles allocate side by
//! side); inside, one group mutex at a time — around each bitmap's read-modify-write —
//! then the superblock (`live`), never the other way round; a free marks its blocks
//! busy before their bits go, so no other allocator takes them in between.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use rext4_format::bitmap;
use rext4_format::group::{FLAG_BLOCK_UNINIT, FLAG_INODE_UNINIT};

use crate::cache::Kind;
use crate::error::{Error, Result};
use crate::fs::{Fs, Group, Ino};

thread_local! {
    /// Inodes this thread freed under `FsOptions::sync_grace` whose grace periods its
    /// operation waits for when its handle closes: (filesystem, inode, stamp).
    static SYNC_PENDING: std::cell::RefCell<Vec<(usize, u32, u64)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl Fs {
    /// Whether metadata changes go through the journal (busy tracking needed).
    pub(crate) fn journaling(&self) -> bool {
        // Not the journal's mutex: a commit holds it while it writes.
        self.inner
            .max_txn
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    }

    /// Keep every later allocation below block `end` and inode allocations in the
    /// groups that start below it (a shrink empties the groups it removes:
    /// `crate::resize`). Blocks and inodes already in use there stay where they are.
    pub(crate) fn set_alloc_limit(&self, end: u64) {
        self.inner.alloc_limit.store(end, Relaxed);
    }

    /// The end of the blocks allocation may take (`set_alloc_limit`), at least one
    /// block past the first data block.
    fn alloc_end(&self) -> u64 {
        let sb = &self.inner.sb;
        self.inner
            .alloc_limit
            .load(Relaxed)
            .min(sb.blocks_count)
            .max(u64::from(sb.first_data_block) + 1)
    }

    /// Groups allocation may use: those that start below `alloc_end`.
    fn alloc_groups(&self) -> usize {
        let sb = &self.inner.sb;
        let data = self.alloc_end() - u64::from(sb.first_data_block);
        (data.div_ceil(u64::from(sb.blocks_per_group)) as usize).min(self.inner.groups.len())
    }

    /// Clusters (blocks without bigalloc) of group `g` allocation may use (its first
    /// ones: `alloc_end` cuts the last usable group short).
    fn alloc_span(&self, g: usize) -> u64 {
        let sb = &self.inner.sb;
        let first = sb.group_first_block(g as u64);
        sb.clusters_in_group(g as u64).min(
            self.alloc_end()
                .saturating_sub(first)
                .div_ceil(sb.cluster_ratio()),
        )
    }

    fn group_of_block(&self, blk: u64) -> usize {
        let sb = &self.inner.sb;
        (blk.saturating_sub(u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group))
            as usize
    }

    /// log2 of the blocks in a cluster (0 without bigalloc).
    pub(crate) fn cluster_bits(&self) -> u32 {
        self.inner.sb.cluster_bits()
    }

    /// Take up to `want` clusters' worth of blocks under this thread's claim
    /// (`space`): the whole clusters admitted (≥ 1), the rest of a partial admission
    /// given back.
    fn admit_clusters(&self, want: u64) -> Result<u64> {
        let cb = self.cluster_bits();
        let got = self.inner.space.admit(want << cb)?;
        let whole = got >> cb;
        if got != whole << cb {
            self.inner.space.freed(got - (whole << cb));
        }
        if whole == 0 {
            crate::fs::space::note_refusal("less than a cluster was left to admit");
            return Err(Error::NoSpace);
        }
        Ok(whole)
    }

    /// The bitmap a BLOCK_UNINIT group implicitly has: the filesystem's own blocks
    /// inside it (its superblock backup, GDT and reserved GDT blocks, and any group's
    /// bitmaps and inode table that lie there with flex_bg: the system zone, whose
    /// locations never change while open), plus the padding past the group's end.
    pub(crate) fn uninit_block_bitmap(&self, g: usize) -> Vec<u8> {
        let sb = &self.inner.sb;
        let bs = self.inner.block_size as usize;
        let cb = sb.cluster_bits();
        let mut b = vec![0u8; bs];
        let first = sb.group_first_block(g as u64);
        let n = sb.blocks_in_group(g as u64);
        for (s, e) in self.system_zone_in(first, first + n) {
            for x in s..e {
                bitmap::set(&mut b, (x - first) >> cb, true);
            }
        }
        for x in sb.clusters_in_group(g as u64)..(bs as u64 * 8) {
            bitmap::set(&mut b, x, true);
        }
        b
    }

    fn store_block_bitmap(&self, grp: &mut Group, b: Vec<u8>) -> Result<()> {
        let sb = &self.inner.sb;
        grp.desc.flags &= !FLAG_BLOCK_UNINIT;
        if self.inner.metadata_csum {
            let c = bitmap::compute_csum(&b, sb.clusters_per_group, self.inner.csum_seed);
            grp.desc.block_bitmap_csum = self.desc_bitmap_csum(c);
        }
        self.group_changed(grp);
        self.cache()
            .write(grp.desc.block_bitmap, Kind::Bitmap, b, |_| Ok(()))
    }

    fn store_inode_bitmap(&self, grp: &mut Group, b: Vec<u8>) -> Result<()> {
        let sb = &self.inner.sb;
        if self.inner.metadata_csum {
            let c = bitmap::compute_csum(&b, sb.inodes_per_group, self.inner.csum_seed);
            grp.desc.inode_bitmap_csum = self.desc_bitmap_csum(c);
        }
        self.group_changed(grp);
        self.cache()
            .write(grp.desc.inode_bitmap, Kind::Bitmap, b, |_| Ok(()))
    }

    /// Group `g`'s block bitmap to look at: the cached block, or the implicit one of a
    /// BLOCK_UNINIT group. Drop it before changing the bitmap (`change_block_bitmap`),
    /// or the change copies the block.
    pub(crate) fn block_bitmap(&self, g: usize, grp: &Group) -> Result<Arc<[u8]>> {
        if grp.desc.has_flag(FLAG_BLOCK_UNINIT) {
            return Ok(self.uninit_block_bitmap(g).into());
        }
        self.cache()
            .read(grp.desc.block_bitmap, Kind::Bitmap, |_| Ok(()))
    }

    /// Change group `g`'s block bitmap with `f` (which cannot fail) and its checksum in
    /// the descriptor: in the cached block, in place where nothing else holds it.
    fn change_block_bitmap(
        &self,
        g: usize,
        grp: &mut Group,
        f: impl FnOnce(&mut [u8]),
    ) -> Result<()> {
        grp.bitmap_gen = grp.bitmap_gen.wrapping_add(1);
        if grp.desc.has_flag(FLAG_BLOCK_UNINIT) {
            let mut b = self.uninit_block_bitmap(g);
            f(&mut b);
            return self.store_block_bitmap(grp, b);
        }
        let per_group = self.inner.sb.clusters_per_group;
        let c = self.change_bitmap(grp.desc.block_bitmap, per_group, f)?;
        self.note_bitmap_change(grp, c, |d, c| d.block_bitmap_csum = c);
        Ok(())
    }

    /// `grp`'s descriptor changed: the next commit writes it.
    pub(crate) fn group_changed(&self, grp: &mut Group) {
        let no = grp.no as usize;
        if let Some(w) = self.inner.dirty_groups.get(no / 64) {
            w.fetch_or(1 << (no % 64), Relaxed);
        }
    }

    /// A bitmap of `grp` changed: its new checksum `c` (if any) goes in the descriptor
    /// through `set`, and the descriptor is to be written (`group_changed`).
    fn note_bitmap_change(
        &self,
        grp: &mut Group,
        c: Option<u32>,
        set: impl FnOnce(&mut rext4_format::group::GroupDesc, u32),
    ) {
        if let Some(c) = c {
            set(&mut grp.desc, self.desc_bitmap_csum(c));
        }
        self.group_changed(grp);
    }

    /// Change group `grp`'s (initialized) inode bitmap with `f`, as
    /// `change_block_bitmap` does its block bitmap.
    fn change_inode_bitmap(&self, grp: &mut Group, f: impl FnOnce(&mut [u8])) -> Result<()> {
        let per_group = self.inner.sb.inodes_per_group;
        let c = self.change_bitmap(grp.desc.inode_bitmap, per_group, f)?;
        self.note_bitmap_change(grp, c, |d, c| d.inode_bitmap_csum = c);
        Ok(())
    }

    /// Change bitmap block `blk` (of `per_group` bits) with `f`; its new checksum with
    /// metadata_csum.
    fn change_bitmap(
        &self,
        blk: u64,
        per_group: u32,
        f: impl FnOnce(&mut [u8]),
    ) -> Result<Option<u32>> {
        let (csum, seed) = (self.inner.metadata_csum, self.inner.csum_seed);
        self.cache().update(blk, Kind::Bitmap, |b| {
            f(b);
            Ok(csum.then(|| bitmap::compute_csum(b, per_group, seed)))
        })
    }

    /// A bitmap checksum as the descriptor holds it (its high half only in 64-byte
    /// descriptors).
    fn desc_bitmap_csum(&self, c: u32) -> u32 {
        if self.inner.sb.desc_size() >= 64 {
            c
        } else {
            c & 0xFFFF
        }
    }

    /// Allocate up to `max_len` (≥ 1) contiguous blocks, as near `goal` as possible.
    /// Returns (first block, length ≥ 1). Caller holds the write lock.
    pub(crate) fn alloc_blocks(&self, goal: u64, max_len: u32) -> Result<(u64, u32)> {
        self.check_writable()?;
        self.inner.prefetch.allocations.fetch_add(1, Relaxed);
        // Counted in clusters (blocks without bigalloc) from here on.
        let cb = self.cluster_bits();
        let want = u64::from(max_len.max(1)).div_ceil(1 << cb);
        // First a free run long enough for the whole request (up to 8 MiB of blocks),
        // so large writes come out contiguous instead of filling small holes; then any
        // free block. Each first where it costs no I/O, then anywhere (`prefetch`).
        let need = want.min(2048);
        let mut budget = self.inner.prefetch.limit;
        let passes: &[u64] = if need > 1 { &[need, 1] } else { &[1] };
        // Reproducible mode: where blocks go must not depend on which bitmaps the cache
        // happens to hold, so only the pass that searches every group in order runs.
        let at_hand_passes: &[bool] = if self.inner.repro.is_some() {
            &[false]
        } else {
            &[true, false]
        };
        for &n in passes {
            for &at_hand in at_hand_passes {
                if let Some((c, n)) = self.alloc_pass(goal, want, n, at_hand, &mut budget)? {
                    let len = (u64::from(n) << cb).min(u64::from(max_len.max(1)));
                    return Ok((c << cb, len as u32));
                }
            }
        }
        crate::fs::space::note_refusal("the allocator found no free block that is not busy");
        Err(Error::NoSpace)
    }

    /// One block for file metadata (extent tree nodes), taken from the end of the group
    /// holding `goal` (then earlier groups, wrapping): data is placed forward from the
    /// start of a group, next to its logical neighbours, and tree blocks taken from the
    /// same area would sit in the gaps that later writes of the file are meant to fill.
    pub(crate) fn alloc_meta_block(&self, goal: u64) -> Result<u64> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let cb = sb.cluster_bits();
        let ngroups = self.alloc_groups();
        let goal = goal.clamp(u64::from(sb.first_data_block), self.alloc_end() - 1);
        let g0 = self.group_of_block(goal);
        for i in 0..ngroups {
            let g = (g0 + ngroups - i) % ngroups;
            let mut grp = self.group(g)?;
            if grp.desc.free_blocks_count == 0 {
                continue;
            }
            let first = sb.group_first_block(g as u64);
            let n = self.alloc_span(g);
            let b = self.block_bitmap(g, &grp)?;
            let found = {
                let busy = self.inner.busy();
                (0..n).rev().find(|&x| {
                    let at = first + (x << cb);
                    !bitmap::test(&b, x) && busy.first_in(at, at + (1 << cb)).is_none()
                })
            };
            drop(b);
            let Some(x) = found else { continue };
            self.admit_clusters(1)?;
            self.change_block_bitmap(g, &mut grp, |b| bitmap::set(b, x, true))?;
            grp.desc.free_blocks_count = grp.desc.free_blocks_count.saturating_sub(1);
            drop(grp);
            let mut live = self.live();
            live.sb.free_blocks_count = live.sb.free_blocks_count.saturating_sub(1 << cb);
            live.dirty = true;
            return Ok(first + (x << cb));
        }
        crate::fs::space::note_refusal("no free tree block that is not busy");
        Err(Error::NoSpace)
    }

    /// The first usable (free, not busy) block of group `g`, without allocating it.
    pub(crate) fn first_free_in_group(&self, g: usize) -> Result<Option<u64>> {
        let sb = &self.inner.sb;
        let cb = sb.cluster_bits();
        let first = sb.group_first_block(g as u64);
        let n = sb.clusters_in_group(g as u64);
        let grp = self.group(g)?;
        if grp.desc.free_blocks_count == 0 {
            return Ok(None);
        }
        let b = self.block_bitmap(g, &grp)?;
        let busy = self.inner.busy();
        let mut x = 0;
        while x < n {
            if x % 8 == 0 && x + 8 <= n && b.get((x / 8) as usize) == Some(&0xFF) {
                x += 8;
                continue;
            }
            let at = first + (x << cb);
            if !bitmap::test(&b, x) && busy.first_in(at, at + (1 << cb)).is_none() {
                return Ok(Some(at));
            }
            x += 1;
        }
        Ok(None)
    }

    /// Take the first run of at least `need` usable clusters (free and not busy) at or
    /// after the cluster of block `goal` (wrapping around the filesystem), up to `want`
    /// clusters long (blocks without bigalloc). Returns (first cluster, clusters). With
    /// `at_hand`, only in the goal group and groups whose bitmap costs no read to search
    /// (`Fs::bitmap_at_hand`); otherwise a bitmap that is not cached brings in a batch
    /// of the next ones while `budget` (groups this allocation may still prefetch)
    /// lasts.
    fn alloc_pass(
        &self,
        goal: u64,
        want: u64,
        need: u64,
        at_hand: bool,
        budget: &mut usize,
    ) -> Result<Option<(u64, u32)>> {
        let sb = &self.inner.sb;
        let cb = sb.cluster_bits();
        let ngroups = self.alloc_groups();
        let goal = goal.clamp(u64::from(sb.first_data_block), self.alloc_end() - 1);
        let g0 = self.group_of_block(goal);
        for i in 0..=ngroups {
            let g = (g0 + i) % ngroups;
            let mut grp = self.group(g)?;
            if !grp.may_hold(need) {
                continue;
            }
            if !self.bitmap_at_hand(&grp, need) {
                if at_hand && i != 0 {
                    continue;
                }
                if !at_hand && *budget > 0 {
                    drop(grp);
                    let order = (i..=ngroups).map(|k| (g0 + k) % ngroups);
                    let batch = self.inner.prefetch.batch.min(*budget);
                    *budget -= self.prefetch_groups(order, need, batch)?.min(*budget);
                    grp = self.group(g)?;
                    if !grp.may_hold(need) {
                        continue;
                    }
                }
            }
            if !self.bitmap_in_memory(&grp) {
                self.inner.prefetch.bitmaps_read.fetch_add(1, Relaxed);
            }
            let first = sb.group_first_block(g as u64);
            let n = self.alloc_span(g);
            let b = self.block_bitmap(g, &grp)?;
            // The goal group is searched from the goal first, and again from its start
            // when the search comes back round to it.
            // (Only the goal's own group holds the goal: no other subtracts it.)
            let goal_x = goal.saturating_sub(first) >> cb;
            let (from, to) = match i {
                0 => (goal_x, n),
                _ if i == ngroups => (0, goal_x.min(n)),
                _ => (0, n),
            };
            let busy = self.inner.busy();
            let usable = |x: u64| {
                let at = first + (x << cb);
                !bitmap::test(&b, x) && busy.first_in(at, at + (1 << cb)).is_none()
            };
            let mut x = from;
            let mut found = None;
            let mut met_busy = false;
            while x < to {
                if x % 8 == 0 && x + 8 <= to && b.get((x / 8) as usize) == Some(&0xFF) {
                    x += 8;
                    continue;
                }
                if !usable(x) {
                    // A busy run (free in the bitmap, freed by the running
                    // transaction) is skipped in one step: many frees since the last
                    // commit must not make every allocation walk them bit by bit.
                    let at = first + (x << cb);
                    let busy_at = busy.first_in(at, at + (1 << cb));
                    x = match busy_at.and_then(|f| busy.run_end(f)) {
                        Some(end) if !bitmap::test(&b, x) => {
                            met_busy = true;
                            (end - first).div_ceil(1 << cb).max(x + 1)
                        }
                        _ => x + 1,
                    };
                    continue;
                }
                let mut len = 1;
                while len < want.max(need) && x + len < n && usable(x + len) {
                    len += 1;
                }
                if len >= need {
                    found = Some((x, len.min(want)));
                    break;
                }
                x += len;
            }
            drop(busy);
            if found.is_none() && need > 1 && from == 0 && to == n && !met_busy {
                // The whole bitmap was searched: remember how long its runs are. Not
                // when busy blocks failed it: they count as free in the summary, which
                // would not keep the next search away (a loop of frees and
                // allocations between two commits summarized at every allocation).
                grp.summarize(&b, n);
            }
            drop(b);
            let Some((x, len)) = found else { continue };
            // Free is not the same as available: what is promised or kept back
            // (`space`) is not this claim's to take.
            let len = self.admit_clusters(len)?;
            self.change_block_bitmap(g, &mut grp, |b| {
                for k in x..x + len {
                    bitmap::set(b, k, true);
                }
            })?;
            grp.desc.free_blocks_count = grp.desc.free_blocks_count.saturating_sub(len as u32);
            drop(grp);
            let mut live = self.live();
            live.sb.free_blocks_count = live.sb.free_blocks_count.saturating_sub(len << cb);
            live.dirty = true;
            return Ok(Some(((first >> cb) + x, len as u32)));
        }
        Ok(None)
    }

    /// Return `len` blocks starting at `start` to the free pool: with bigalloc, every
    /// cluster the range touches (the caller knows no block of them is still used).
    pub(crate) fn free_blocks(&self, start: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let cb = sb.cluster_bits();
        let end = start.saturating_add(len);
        if start < u64::from(sb.first_data_block) || end > sb.blocks_count {
            return Err(Error::corrupted(
                format!("freeing blocks {start}+{len} outside the fs"),
                None,
            ));
        }
        // Whole clusters from here on (the last one may be short).
        let (start, end) = (
            (start >> cb) << cb,
            (end.div_ceil(1 << cb) << cb).min(sb.blocks_count),
        );
        let len = end - start;
        let mut blk = start;
        if self.in_system_zone(start, len) {
            return Err(Error::corrupted(
                format!("freeing blocks {start}+{len}: filesystem metadata, not file data"),
                None,
            ));
        }
        self.cache().forget(start, len);
        if self.journaling() {
            let mut busy = self.inner.busy();
            busy.add(start, len);
        }
        while blk < end {
            let g = self.group_of_block(blk);
            let first = sb.group_first_block(g as u64);
            let gend = (first + sb.blocks_in_group(g as u64)).min(end);
            // Bits [x0, x1) of the group's bitmap.
            let (x0, x1) = ((blk - first) >> cb, (gend - first).div_ceil(1 << cb));
            let mut grp = self.group(g)?;
            // Every bit is checked before any is cleared: a refused free changes
            // nothing.
            let b = self.block_bitmap(g, &grp)?;
            if let Some(x) = (x0..x1).find(|&x| !bitmap::test(&b, x)) {
                return Err(Error::corrupted(
                    format!("freeing free block {}", first + (x << cb)),
                    Some(grp.desc.block_bitmap),
                ));
            }
            drop(b);
            let freed = (x1 - x0) as u32;
            self.change_block_bitmap(g, &mut grp, |b| {
                for x in x0..x1 {
                    bitmap::set(b, x, false);
                }
            })?;
            grp.desc.free_blocks_count = grp.desc.free_blocks_count.saturating_add(freed);
            // Only the run around what was freed can have grown: measure it (in the
            // bitmap just changed, cached) and keep the larger bound.
            if let Some(l) = grp.longest_free {
                let b = self.block_bitmap(g, &grp)?;
                let n = sb.clusters_in_group(g as u64);
                let around = crate::fs::prefetch::free_run_around(&b, x0, x1, n);
                grp.longest_free = Some(l.max(u32::try_from(around).unwrap_or(u32::MAX)));
            }
            drop(grp);
            let freed = u64::from(freed) << cb;
            self.inner.space.freed(freed);
            let mut live = self.live();
            live.sb.free_blocks_count = live.sb.free_blocks_count.saturating_add(freed);
            live.dirty = true;
            blk = gend;
        }
        Ok(())
    }

    /// Give the free blocks in `[start, start + len)` (bytes of the filesystem) back to
    /// the device (`BlockDevice::discard`: holes punched in an image file, BLKDISCARD,
    /// freed qcow2 clusters), runs shorter than `min_len` bytes left alone: FITRIM
    /// (`fstrim`), `rext4 trim`. Returns the bytes discarded.
    ///
    /// Only blocks free in the bitmap and not busy are discarded: a block freed by a
    /// transaction not yet committed may still be what the committed state (what a
    /// crash recovers) uses: a caller that wants what it freed just before given back
    /// too commits first ([`Fs::sync_metadata`], as the mount's FITRIM does). Each
    /// group's mutex is held across its discards, so no allocation takes a block of
    /// the group meanwhile and writes data that a discard would then drop.
    pub fn trim(&self, start: u64, len: u64, min_len: u64) -> Result<u64> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let bs = u64::from(self.inner.block_size);
        let first_blk = (start.div_ceil(bs)).max(u64::from(sb.first_data_block));
        let end_blk = (start.saturating_add(len) / bs).min(sb.blocks_count);
        let min_blocks = min_len.div_ceil(bs).max(1);
        let dev = self.cache().device().clone();
        let mut trimmed = 0u64;
        if first_blk >= end_blk {
            return Ok(0);
        }
        let cb = sb.cluster_bits();
        for g in self.group_of_block(first_blk)..=self.group_of_block(end_blk - 1) {
            let first = sb.group_first_block(g as u64);
            let n = sb.blocks_in_group(g as u64);
            let grp = self.group(g)?;
            if grp.desc.free_blocks_count == 0 {
                continue;
            }
            let b = self.block_bitmap(g, &grp)?;
            // Blocks [from, to) of the group, looked up by their clusters' bits.
            let b: Arc<[u8]> = if cb == 0 {
                b
            } else {
                // A bitmap by block, so the walk below stays in blocks.
                let mut by_block = vec![0u8; (n as usize).div_ceil(8)];
                for x in 0..n {
                    bitmap::set(&mut by_block, x, bitmap::test(&b, x >> cb));
                }
                by_block.into()
            };
            let from = first_blk.max(first) - first;
            let to = end_blk.min(first + n) - first;
            let mut runs = Vec::new();
            {
                let busy = self.inner.busy();
                let mut x = from;
                while x < to {
                    // A free run of the bitmap (whole bytes skipped), less its busy runs.
                    let s = next_bit(&b, x, to, false);
                    let e = next_bit(&b, s, to, true);
                    x = e;
                    let mut y = s;
                    while y < e {
                        let stop = busy.first_in(first + y, first + e).map_or(e, |b| b - first);
                        if stop - y >= min_blocks {
                            runs.push((first + y, stop - y));
                        }
                        y = match busy.run_end(first + stop) {
                            Some(end) if stop < e => (end - first).min(e),
                            _ => e,
                        };
                    }
                }
            }
            drop(b);
            for (blk, count) in runs {
                dev.discard(blk * bs, count * bs).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::Unsupported {
                        Error::Unsupported(e.to_string())
                    } else {
                        Error::Io(e)
                    }
                })?;
                trimmed += count * bs;
            }
            drop(grp);
        }
        if trimmed > 0 {
            // Discards are done when durable: a device that frees what it was given only
            // at a flush (a qcow2 image, once the unmapping is on disk) frees it now.
            dev.flush()?;
        }
        Ok(trimmed)
    }

    /// Allocate an inode near `parent` (directories spread across groups).
    pub(crate) fn alloc_inode(&self, parent: Ino, is_dir: bool) -> Result<Ino> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let ipg = sb.inodes_per_group;
        let ngroups = self.alloc_groups();
        let pg = ((parent.0.max(1) - 1) / ipg) as usize % ngroups.max(1);
        let start = if is_dir && ngroups > 1 {
            // Orlov-like: the next group after the parent's with at least average free
            // inodes and blocks, so directories spread out.
            let live = self.live();
            let avg_i = live.sb.free_inodes_count / ngroups as u32;
            // The groups count clusters, the superblock blocks.
            let avg_b = (live.sb.free_blocks_count >> sb.cluster_bits()) / ngroups as u64;
            drop(live);
            (1..=ngroups)
                .map(|i| (pg + i) % ngroups)
                .find(|&g| {
                    self.group(g).is_ok_and(|grp| {
                        grp.desc.free_inodes_count >= avg_i.max(1)
                            && u64::from(grp.desc.free_blocks_count) >= avg_b
                    })
                })
                .unwrap_or(pg)
        } else {
            pg
        };
        // Cooling inodes (freed while lockless readers may hold them) are skipped, not
        // waited for; only when nothing else is free does the allocator wait for them.
        for attempt in 0..2 {
            if let Some(ino) = self.alloc_inode_pass(start, is_dir)? {
                return Ok(ino);
            }
            let cooling = {
                let busy = self.inner.busy();
                busy.cooling.values().copied().max()
            };
            match cooling {
                Some(stamp) if attempt == 0 => {
                    self.wait_grace(stamp);
                }
                _ => break,
            }
        }
        Err(Error::NoSpace)
    }

    /// Wait (briefly: readers hold their guards for one lookup) until every reader
    /// that was active at `stamp` is done.
    /// Not when this thread's own read holds it back (a path operation walks and
    /// changes under one guard): the free came after that read began, so the
    /// allocation may be ordered before it — ENOSPC, as if it had come first.
    /// Returns whether it has passed.
    fn wait_grace(&self, stamp: u64) -> bool {
        let grace = &self.inner.caches.grace;
        if grace.held_by_this_thread(stamp) {
            return false;
        }
        let t0 = std::time::Instant::now();
        let mut polls = 0u32;
        while !grace.passed(stamp) {
            if t0.elapsed() >= std::time::Duration::from_secs(5) {
                return false;
            }
            // A few yields, then sleeps: a waiter that spins takes the CPU from the
            // readers it waits for (two cores, more threads).
            polls += 1;
            if polls < 32 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        true
    }

    /// `FsOptions::sync_grace` (the synchronous design, to compare): called when an
    /// operation's handle has closed, no lock held: wait for the grace periods of the
    /// inodes this thread freed in it, then take them off the cooling list, free for
    /// reuse at once. Waiting where the free happens, under the operation's locks,
    /// would deadlock against a reader that holds its guard and waits for one of them
    /// (RCU's rule: no `synchronize_rcu` under a lock a reader takes).
    pub(crate) fn finish_sync_grace(&self) {
        if !self.inner.sync_grace {
            return;
        }
        let me = self.lock_id();
        let mine: Vec<(u32, u64)> = SYNC_PENDING.with(|p| {
            let mut p = p.borrow_mut();
            let (mine, rest): (Vec<_>, Vec<_>) = p.drain(..).partition(|e| e.0 == me);
            *p = rest;
            mine.into_iter()
                .map(|(_, ino, stamp)| (ino, stamp))
                .collect()
        });
        let Some(newest) = mine.iter().map(|e| e.1).max() else {
            return;
        };
        if self.wait_grace(newest) {
            let mut busy = self.inner.busy();
            for (ino, stamp) in mine {
                if busy.cooling.get(&ino) == Some(&stamp) {
                    busy.cooling.remove(&ino);
                }
            }
        }
    }

    fn alloc_inode_pass(&self, start: usize, is_dir: bool) -> Result<Option<Ino>> {
        let sb = &self.inner.sb;
        let ipg = sb.inodes_per_group;
        let ngroups = self.alloc_groups();
        // Stamps older than every active reader have passed: forget them.
        let oldest = self.inner.caches.grace.oldest_reader();
        self.inner
            .busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cooling
            .retain(|_, stamp| *stamp >= oldest);
        for i in 0..ngroups {
            let g = (start + i) % ngroups;
            let mut grp = self.group(g)?;
            if grp.desc.free_inodes_count == 0 {
                continue;
            }
            let bs = self.inner.block_size as usize;
            let uninit = grp.desc.has_flag(FLAG_INODE_UNINIT);
            let b: Arc<[u8]> = if uninit {
                let mut b = vec![0u8; bs];
                for x in u64::from(ipg)..(bs as u64 * 8) {
                    bitmap::set(&mut b, x, true);
                }
                b.into()
            } else {
                self.cache()
                    .read(grp.desc.inode_bitmap, Kind::Bitmap, |_| Ok(()))?
            };
            // Allocating an inode in a group also initializes its block bitmap.
            if grp.desc.has_flag(FLAG_BLOCK_UNINIT) {
                self.store_block_bitmap(&mut grp, self.uninit_block_bitmap(g))?;
            }
            let lo = if g == 0 { u64::from(sb.first_ino) } else { 0 };
            let busy = self.inner.busy();
            let base = g as u32 * ipg + 1;
            let free_now = |x: u64| {
                let ino = base + x as u32;
                !bitmap::test(&b, x) && !busy.cooling.contains_key(&ino)
            };
            // Whole words of used inodes are skipped without looking at their bits.
            let mut found = None;
            let mut x = lo;
            while x < u64::from(ipg) {
                if x % 64 == 0 {
                    let at = (x / 8) as usize;
                    if b.get(at..at + 8).is_some_and(|w| w == [0xFF; 8]) {
                        x += 64;
                        continue;
                    }
                }
                if free_now(x) {
                    found = Some(x);
                    break;
                }
                x += 1;
            }
            drop(busy);
            let Some(x) = found else {
                continue;
            };
            if uninit {
                let mut b = b.to_vec();
                bitmap::set(&mut b, x, true);
                grp.desc.flags &= !FLAG_INODE_UNINIT;
                self.store_inode_bitmap(&mut grp, b)?;
            } else {
                drop(b);
                self.change_inode_bitmap(&mut grp, |b| bitmap::set(b, x, true))?;
            }
            // Counts and itable_unused a corrupted descriptor holds may be past any
            // right value (e2fsck's to fix): the arithmetic saturates instead of
            // wrapping.
            grp.desc.free_inodes_count = grp.desc.free_inodes_count.saturating_sub(1);
            if is_dir {
                grp.desc.used_dirs_count = grp.desc.used_dirs_count.saturating_add(1);
            }
            let used = x as u32 + 1;
            if ipg.saturating_sub(grp.desc.itable_unused) < used {
                grp.desc.itable_unused = ipg - used;
            }
            drop(grp);
            let mut live = self.live();
            live.sb.free_inodes_count = live.sb.free_inodes_count.saturating_sub(1);
            live.dirty = true;
            return Ok(Some(Ino(g as u32 * ipg + used)));
        }
        Ok(None)
    }

    /// Whether inode `ino` is allocated in its group's bitmap.
    pub(crate) fn inode_in_use(&self, ino: Ino) -> Result<bool> {
        let ipg = self.inner.sb.inodes_per_group;
        if ino.0 == 0 || ino.0 > self.inner.sb.inodes_count {
            return Ok(false);
        }
        let g = ((ino.0 - 1) / ipg) as usize;
        let x = u64::from((ino.0 - 1) % ipg);
        let grp = self.group(g)?;
        if grp.desc.has_flag(FLAG_INODE_UNINIT) {
            return Ok(false);
        }
        let b = self
            .cache()
            .read(grp.desc.inode_bitmap, Kind::Bitmap, |_| Ok(()))?;
        Ok(bitmap::test(&b, x))
    }

    /// Mark `[start, start+len)`, free in the bitmaps, as used: blocks a journal
    /// replay (fast commits) found mapped by a file. Every block is checked before any
    /// bit is set: a block already in use refuses the whole run.
    pub(crate) fn mark_blocks_used(&self, start: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let end = start.saturating_add(len);
        if start < u64::from(sb.first_data_block) || end > sb.blocks_count {
            return Err(Error::corrupted(
                format!("blocks {start}+{len} are outside the filesystem"),
                None,
            ));
        }
        if self.in_system_zone(start, len) {
            return Err(Error::corrupted(
                format!("blocks {start}+{len} are the filesystem's own metadata"),
                None,
            ));
        }
        // Whole clusters (bigalloc).
        let cb = sb.cluster_bits();
        let (start, end) = (
            (start >> cb) << cb,
            (end.div_ceil(1 << cb) << cb).min(sb.blocks_count),
        );
        let mut blk = start;
        while blk < end {
            let g = self.group_of_block(blk);
            let first = sb.group_first_block(g as u64);
            let gend = (first + sb.blocks_in_group(g as u64)).min(end);
            let (x0, x1) = ((blk - first) >> cb, (gend - first).div_ceil(1 << cb));
            let mut grp = self.group(g)?;
            let b = self.block_bitmap(g, &grp)?;
            if let Some(x) = (x0..x1).find(|&x| bitmap::test(&b, x)) {
                return Err(Error::corrupted(
                    format!("block {} is in use already", first + (x << cb)),
                    Some(grp.desc.block_bitmap),
                ));
            }
            drop(b);
            let n = x1 - x0;
            let _c = crate::fs::space::claim_as(crate::fs::space::Claim::NoFail);
            if self.inner.space.admit(n << cb)? < n << cb {
                return Err(Error::NoSpace);
            }
            self.change_block_bitmap(g, &mut grp, |b| {
                for x in x0..x1 {
                    bitmap::set(b, x, true);
                }
            })?;
            grp.desc.free_blocks_count = grp.desc.free_blocks_count.saturating_sub(n as u32);
            grp.longest_free = None;
            drop(grp);
            let mut live = self.live();
            live.sb.free_blocks_count = live.sb.free_blocks_count.saturating_sub(n << cb);
            live.dirty = true;
            blk = gend;
        }
        Ok(())
    }

    /// Whether block `blk` is in use in its group's bitmap.
    pub(crate) fn block_in_use(&self, blk: u64) -> Result<bool> {
        let g = self.group_of_block(blk);
        let first = self.inner.sb.group_first_block(g as u64);
        let grp = self.group(g)?;
        let b = self.block_bitmap(g, &grp)?;
        Ok(bitmap::test(&b, (blk - first) >> self.cluster_bits()))
    }

    /// Mark inode `ino`, free in its bitmap, as used (a journal replay found it live):
    /// counts, itable_unused and an uninitialized group's bitmaps as an allocation
    /// there would leave them.
    pub(crate) fn mark_inode_used(&self, ino: Ino, is_dir: bool) -> Result<()> {
        self.check_writable()?;
        let sb = &self.inner.sb;
        let ipg = sb.inodes_per_group;
        if ino.0 == 0 || ino.0 > sb.inodes_count {
            return Err(Error::corrupted(
                format!("inode number {} out of range", ino.0),
                None,
            ));
        }
        let g = ((ino.0 - 1) / ipg) as usize;
        let x = u64::from((ino.0 - 1) % ipg);
        let mut grp = self.group(g)?;
        if grp.desc.has_flag(FLAG_BLOCK_UNINIT) {
            self.store_block_bitmap(&mut grp, self.uninit_block_bitmap(g))?;
        }
        if grp.desc.has_flag(FLAG_INODE_UNINIT) {
            let bs = self.inner.block_size as usize;
            let mut b = vec![0u8; bs];
            for k in u64::from(ipg)..(bs as u64 * 8) {
                bitmap::set(&mut b, k, true);
            }
            bitmap::set(&mut b, x, true);
            grp.desc.flags &= !FLAG_INODE_UNINIT;
            self.store_inode_bitmap(&mut grp, b)?;
        } else {
            let b = self
                .cache()
                .read(grp.desc.inode_bitmap, Kind::Bitmap, |_| Ok(()))?;
            if bitmap::test(&b, x) {
                return Err(Error::corrupted(
                    format!("inode {} is in use already", ino.0),
                    Some(grp.desc.inode_bitmap),
                ));
            }
            drop(b);
            self.change_inode_bitmap(&mut grp, |b| bitmap::set(b, x, true))?;
        }
        grp.desc.free_inodes_count = grp.desc.free_inodes_count.saturating_sub(1);
        if is_dir {
            grp.desc.used_dirs_count = grp.desc.used_dirs_count.saturating_add(1);
        }
        let used = x as u32 + 1;
        if ipg.saturating_sub(grp.desc.itable_unused) < used {
            grp.desc.itable_unused = ipg - used;
        }
        self.group_changed(&mut grp);
        drop(grp);
        let mut live = self.live();
        live.sb.free_inodes_count = live.sb.free_inodes_count.saturating_sub(1);
        live.dirty = true;
        Ok(())
    }

    /// A used inode became a directory (`1`) or stopped being one (`-1`): its group's
    /// directory count follows.
    pub(crate) fn count_dir(&self, ino: Ino, delta: i32) -> Result<()> {
        let ipg = self.inner.sb.inodes_per_group;
        let g = ((ino.0.max(1) - 1) / ipg) as usize;
        let mut grp = self.group(g)?;
        grp.desc.used_dirs_count = if delta > 0 {
            grp.desc.used_dirs_count.saturating_add(1)
        } else {
            grp.desc.used_dirs_count.saturating_sub(1)
        };
        self.group_changed(&mut grp);
        Ok(())
    }

    /// Return inode `ino` to the free pool.
    pub(crate) fn free_inode(&self, ino: Ino, is_dir: bool) -> Result<()> {
        self.check_writable()?;
        let ipg = self.inner.sb.inodes_per_group;
        let g = ((ino.0 - 1) / ipg) as usize;
        let x = u64::from((ino.0 - 1) % ipg);
        let mut grp = self.group(g)?;
        let used = bitmap::test(
            &self
                .cache()
                .read(grp.desc.inode_bitmap, Kind::Bitmap, |_| Ok(()))?,
            x,
        );
        if !used {
            return Err(Error::corrupted(
                format!("freeing free inode {}", ino.0),
                None,
            ));
        }
        // Out of the inode cache first, then stamp: a lockless reader that could
        // still reach the old inode started before the stamp (grace.rs).
        self.inner.caches.inodes.invalidate(&ino.0);
        let stamp = self.inner.caches.grace.stamp();
        // No commit needs to come first: the inode record is journaled metadata, so
        // its reuse within the running transaction commits (or not) atomically with
        // its free. Only its data blocks must wait (busy blocks).
        self.inner
            .busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cooling
            .insert(ino.0, stamp);
        if self.inner.sync_grace {
            SYNC_PENDING.with(|p| p.borrow_mut().push((self.lock_id(), ino.0, stamp)));
        }
        grp.desc.free_inodes_count = grp.desc.free_inodes_count.saturating_add(1);
        if is_dir {
            grp.desc.used_dirs_count = grp.desc.used_dirs_count.saturating_sub(1);
        }
        self.change_inode_bitmap(&mut grp, |b| bitmap::set(b, x, false))?;
        drop(grp);
        let mut live = self.live();
        live.sb.free_inodes_count = live.sb.free_inodes_count.saturating_add(1);
        live.dirty = true;
        Ok(())
    }
}

/// The first bit in `[from, to)` of bitmap `b` equal to `set`, or `to`; whole bytes
/// of the other value are skipped at once (a trim of a large image walks every
/// group's bitmap).
fn next_bit(b: &[u8], from: u64, to: u64, set: bool) -> u64 {
    let skip = if set { 0x00 } else { 0xFF };
    let mut x = from;
    while x < to {
        if x.is_multiple_of(8) && to - x >= 8 && b.get((x / 8) as usize) == Some(&skip) {
            x += 8;
            continue;
        }
        if bitmap::test(b, x) == set {
            return x;
        }
        x += 1;
    }
    to
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte-skipping search finds what a bit-by-bit walk finds, at every start.
    #[test]
    fn next_bit_matches_a_bit_by_bit_walk() {
        let mut b = vec![0u8; 64];
        let mut r = 0x1234_5678_9abc_def1u64;
        for (i, x) in b.iter_mut().enumerate() {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            *x = match i % 4 {
                0 => 0xFF,
                1 => 0x00,
                _ => r as u8,
            };
        }
        for set in [false, true] {
            for from in 0..512u64 {
                for to in [from, from + 1, from + 9, 300, 512] {
                    if to < from {
                        continue;
                    }
                    let slow = (from..to)
                        .find(|&x| bitmap::test(&b, x) == set)
                        .unwrap_or(to);
                    assert_eq!(next_bit(&b, from, to, set), slow, "{set} {from}..{to}");
                }
            }
        }
    }
}
