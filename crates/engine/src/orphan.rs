//! Orphans: inodes whose last name is gone while something still uses them (an open
//! handle, later a FUSE lookup reference), and their cleanup after a crash.
//!
//! While `Fs` has a reference to an inode (`pin`/`unpin`, taken by `File` handles), the
//! last unlink does not free it: the inode keeps links_count 0 and goes on the orphan
//! list — the orphan file (orphan_file feature, with ro_compat ORPHAN_PRESENT set while
//! it has entries) or else the legacy list (s_last_orphan → i_dtime chain). The last
//! unpin frees it and takes it off the list. Both steps are ordinary metadata changes,
//! journaled with the operation. An unnamed file (O_TMPFILE, `Fs::tmpfile_ino`) is on
//! the list from its creation; `Fs::link_ino` takes it off when it gets a name. At the
//! next read-write open after a crash, every listed inode is finished: freed when it has no links, else truncated to i_size
//! (a truncate the kernel had in progress).
//!
//! Huge removals (`unmap_tail_in_parts`, as the kernel's `ext4_ext_remove_space` and
//! `ext4_ind_truncate` restart their handles): a truncate, a final free or an orphan's
//! cleanup at open that would dirty more than one transaction holds (a file of a
//! million extents, or with its blocks spread over thousands of groups) removes the
//! mapping from the end backwards, a few mapped runs at a time, and commits between
//! parts whenever the running transaction has no room for the next one. Before the
//! first such commit the inode goes on the orphan list (a truncate's i_size already the
//! new one, a freed file's links_count 0), and the record written at every commit maps
//! exactly what is left (a prefix of the file, i_blocks to match), so a crash between
//! parts leaves an orphan that rext4's open and the kernel's mount finish the same way:
//! truncated to i_size, or freed when it has no link. (e2fsprogs frees such orphans and
//! truncates block maps, but its orphan truncate of an extent file aborts at the first
//! leaf it empties — "Already cleared block" — and pass 1 then clears the inode; the
//! kernel's own restarted truncates meet the same. tests/huge_ops.rs counts it.) A
//! removal whose worst case (two blocks per block the file holds) fits what the running
//! transaction still takes goes in one step, without parts. The caller holds the
//! write lock (no handle is open beside it, so the commit may close the transaction)
//! and the inode's I/O lock exclusively. An unlink under a handle cannot commit: a
//! file too large for the handle's share of the transaction is made an orphan there
//! and freed in parts once the handle is gone (`deferred_frees`, as the kernel's evict
//! comes after the unlink's handle).
//!
//! The last unpin may come while its thread holds another inode's I/O lock (writeback
//! of other files from inside a write, which pins each file it writes). The I/O locks
//! are striped, so waiting there for the orphan's could wait for a lock the thread
//! holds itself: the free is queued instead (`deferred_frees`) and done by the next
//! unpin, sync or close on a thread holding no I/O lock (the inode stays on the orphan
//! list meanwhile, so a crash still finishes it).

use rext4_format::inode::{flags, Inode};
use rext4_format::orphan as fo;
use rext4_format::superblock::feature;

use crate::cache::Kind;
use crate::error::{Error, Result};
use crate::fs::inode_write::{unmap_range, uses_block_map};
use crate::fs::map::{Mapping, MAX_LOGICAL};
use crate::fs::{Fs, Ino};

/// Mapped runs one part of a huge removal takes away at most.
const PART_RUNS: usize = 32;
/// Blocks one part may add to the running transaction at most: per run, a bitmap and a
/// descriptor block (each run may lie in a group of its own) and the indirect or tree
/// blocks around it (changed, or freed and revoked), with the inode's and superblock's.
const PART_BUDGET: usize = 4 * PART_RUNS + 16;

impl Fs {
    /// Take a reference on `ino` (an open handle): it is not freed while referenced.
    pub fn pin(&self, ino: Ino) {
        *self
            .inner
            .pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(ino)
            .or_insert(0) += 1;
    }

    /// Drop a reference; the last one frees an orphaned inode.
    pub fn unpin(&self, ino: Ino) -> Result<()> {
        let last = {
            let mut pins = self.inner.pins.lock().unwrap_or_else(|p| p.into_inner());
            match pins.get_mut(&ino) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => {
                    pins.remove(&ino);
                    crate::ops::lock_set(&self.inner.linkable).remove(&ino);
                    true
                }
                None => false,
            }
        };
        if crate::lockdep::holds_io_lock() {
            if last {
                self.inner
                    .deferred_frees
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(ino);
            }
            return Ok(());
        }
        let r = if last {
            self.free_if_orphan(ino)
        } else {
            Ok(())
        };
        r.and(self.free_deferred())
    }

    /// Free the orphans whose last reference went while an I/O lock was held (see the
    /// module note); nothing while this thread holds an I/O lock.
    pub(crate) fn free_deferred(&self) -> Result<()> {
        if crate::lockdep::holds_io_lock() {
            return Ok(());
        }
        let queued = std::mem::take(
            &mut *self
                .inner
                .deferred_frees
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let mut first_err = Ok(());
        for ino in queued {
            // Pinned again meanwhile (a lookup): the next last unpin frees it.
            if self.is_pinned(ino) {
                continue;
            }
            let r = self.free_if_orphan(ino);
            if first_err.is_ok() {
                first_err = r;
            }
        }
        first_err
    }

    /// Free `ino`, which nothing references any more, if it has no name left.
    fn free_if_orphan(&self, ino: Ino) -> Result<()> {
        if self.check_writable().is_err() {
            return Ok(());
        }
        // Cheap common case: the file still has names. Read under the inode's lock:
        // an unlink that found this inode pinned (before the last unpin) writes it as
        // an orphan under that lock, and that write must be seen here, or the orphan
        // would stay on the list with no reference left to free it.
        let linked = {
            let _l = self.lock_nondir(ino);
            self.read_inode(ino).map_or(true, |i| i.links_count > 0)
        };
        if linked {
            return Ok(());
        }
        let _io = self.io_exclusive(ino);
        let _w = self.write_lock();
        // Referenced again while this thread waited for the locks: that reference's
        // last unpin frees it. The number may even be another file's by now — freed
        // by another last unpin of this one (a writeback's pin and unpin make a second
        // "last"), then reused and pinned by its opener — which must not be freed
        // under its handle. (No pin can come meanwhile that matters: a new file needs
        // a handle, which the write lock excludes, and writeback finds a freed file's
        // cache dead.)
        if self.is_pinned(ino) {
            return Ok(());
        }
        let inode = self.read_inode(ino)?;
        // A lookup that raced an unlink can pin an inode that was freed before the pin
        // (the grace period keeps its number from reuse meanwhile): nothing to free.
        if inode.links_count == 0 && inode.mode != 0 && self.inode_in_use(ino)? {
            self.orphan_remove(ino, &inode)?;
            let inode = self.read_inode(ino)?;
            self.free_inode_and_blocks_in_parts(ino, inode)?;
        }
        Ok(())
    }

    /// Whether freeing `inode` (its blocks and tree) could dirty more than a handle's
    /// share of a transaction: each block it holds may lie in a group of its own (a
    /// bitmap and a descriptor block each) or be a logged tree block (a revoke record).
    pub(crate) fn too_big_for_a_handle(&self, inode: &Inode) -> bool {
        let max = self
            .inner
            .max_txn
            .load(std::sync::atomic::Ordering::Relaxed);
        if max == 0 || !inode.is_reg() {
            return false;
        }
        self.removal_estimate(inode) > (max / 4) as u64
    }

    /// The most blocks removing all of `inode`'s mapping can add to a transaction:
    /// two per block it holds (its bitmap and descriptor block, or a tree block's
    /// revoke record and its parent), and a few more.
    fn removal_estimate(&self, inode: &Inode) -> u64 {
        let bs = self.inner.block_size;
        let huge = self.inner.sb.has_ro_compat(feature::RO_COMPAT_HUGE_FILE);
        let blocks = inode.blocks_512(huge, bs) / u64::from(bs / 512).max(1);
        blocks.saturating_mul(2).saturating_add(16)
    }

    /// Whether the running transaction has room for `more` blocks within its commit
    /// threshold (half of what one transaction may carry, as `txn_full`): dirty
    /// blocks, revoke records (counted as blocks: generous) and a descriptor block for
    /// each changed group (an upper bound).
    fn txn_has_room(&self, more: usize) -> bool {
        let max = self
            .inner
            .max_txn
            .load(std::sync::atomic::Ordering::Relaxed);
        if max == 0 {
            return true;
        }
        let groups: usize = self
            .inner
            .dirty_groups
            .iter()
            .map(|w| w.load(std::sync::atomic::Ordering::Relaxed).count_ones() as usize)
            .sum();
        let used = self.cache().dirty_count() + self.cache().revoked_count() + groups + 2;
        used + more <= max / 2
    }

    /// The logical blocks from `from` on where mapped runs begin (an extent, or what a
    /// block map's lookup answers in one run), in order.
    fn run_starts(&self, ino: Ino, inode: &Inode, from: u64) -> Result<Vec<u64>> {
        let mut starts = Vec::new();
        let mut l = from;
        while l < MAX_LOGICAL {
            match self.map_block(ino, inode, l)? {
                Mapping::Mapped { len, .. } => {
                    starts.push(l);
                    l = l.saturating_add(len.max(1));
                }
                Mapping::Hole { len } => l = l.saturating_add(len.max(1)),
            }
        }
        Ok(starts)
    }

    /// Remove the mapping of `ino` from logical block `from` to the end in parts that
    /// each fit the running transaction, committing between them (see the module
    /// note). `inode` is the record as it must read at every commit (the new i_size of
    /// a truncate, links_count 0 of a file being freed); `listed` says whether it is on
    /// the orphan list, and becomes true when a commit between parts put it there (the
    /// caller takes it off when done). Caller holds the write lock and the inode's I/O
    /// lock exclusively.
    pub(crate) fn unmap_tail_in_parts(
        &self,
        ino: Ino,
        inode: &mut Inode,
        from: u64,
        listed: &mut bool,
    ) -> Result<()> {
        let mapped = inode.has_flag(flags::EXTENTS) || uses_block_map(inode);
        let fits =
            usize::try_from(self.removal_estimate(inode)).is_ok_and(|n| self.txn_has_room(n));
        if fits || !self.journaling() || inode.has_flag(flags::INLINE_DATA) || !mapped {
            // At most what the running transaction still takes: one step.
            return unmap_range(self, ino, inode, from, MAX_LOGICAL);
        }
        let starts = self.run_starts(ino, inode, from)?;
        let mut hi = starts.len();
        loop {
            if !self.txn_has_room(PART_BUDGET) {
                self.commit_between_parts(ino, inode, listed)?;
            }
            let Some(lo) = hi.checked_sub(1).map(|h| h.saturating_sub(PART_RUNS - 1)) else {
                // Last, whatever lies between `from` and the first run (an extent
                // tree's empty leaves), with the tree's final shrink.
                return unmap_range(self, ino, inode, from, MAX_LOGICAL);
            };
            unmap_range(self, ino, inode, starts[lo], MAX_LOGICAL)?;
            hi = lo;
        }
    }

    /// Commit the running transaction between two parts of a huge removal, with `ino`
    /// on the orphan list and its record as the parts so far left it.
    fn commit_between_parts(&self, ino: Ino, inode: &mut Inode, listed: &mut bool) -> Result<()> {
        if !*listed {
            *inode = self.orphan_add(ino, inode.clone())?;
            *listed = true;
        }
        self.write_inode(ino, inode)?;
        self.inner.sync_locked()
    }

    pub(crate) fn is_pinned(&self, ino: Ino) -> bool {
        self.inner
            .pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&ino)
    }

    fn orphan_file(&self) -> Option<Ino> {
        let sb = &self.inner.sb;
        (sb.has_compat(feature::COMPAT_ORPHAN_FILE) && sb.orphan_file_inum != 0)
            .then_some(Ino(sb.orphan_file_inum))
    }

    /// Physical blocks of the orphan file and its checksum seed.
    fn orphan_blocks(&self, of: Ino) -> Result<(Vec<u64>, Option<u32>)> {
        let inode = self.read_inode(of)?;
        let bs = u64::from(self.inner.block_size);
        let mut v = Vec::new();
        for l in 0..(inode.size / bs).min(1 << 16) {
            match self.map_block(of, &inode, l)? {
                Mapping::Mapped {
                    physical,
                    unwritten: false,
                    ..
                } => v.push(physical),
                _ => return Err(Error::corrupted("orphan file has a hole", None)),
            }
        }
        Ok((v, self.owned_seed(of, &inode)))
    }

    fn write_orphan_block(&self, blk: u64, mut data: Vec<u8>, seed: Option<u32>) -> Result<()> {
        if let Some(s) = seed {
            fo::set_block_csum(&mut data, s, blk);
        }
        self.cache().write(blk, Kind::Raw, data, |_| Ok(()))
    }

    /// Put `ino` (links_count already 0, not yet written) on the orphan list; returns
    /// the inode to write (the legacy list links through i_dtime).
    pub(crate) fn orphan_add(&self, ino: Ino, mut inode: Inode) -> Result<Inode> {
        let _o = self.orphan_lock();
        if let Some(of) = self.orphan_file() {
            let (blocks, seed) = self.orphan_blocks(of)?;
            for b in blocks {
                let mut data = self.cache().read(b, Kind::Raw, |_| Ok(()))?.to_vec();
                if fo::add(&mut data, ino.0).is_some() {
                    self.write_orphan_block(b, data, seed)?;
                    let mut live = self.live();
                    live.sb.feature_ro_compat |= feature::RO_COMPAT_ORPHAN_PRESENT;
                    live.dirty = true;
                    return Ok(inode);
                }
            }
            // Orphan file full: fall back to the legacy list, as the kernel does.
        }
        let mut live = self.live();
        inode.dtime = live.sb.last_orphan;
        live.sb.last_orphan = ino.0;
        live.dirty = true;
        Ok(inode)
    }

    /// Take `ino` off the orphan list.
    pub(crate) fn orphan_remove(&self, ino: Ino, inode: &Inode) -> Result<()> {
        let _o = self.orphan_lock();
        if let Some(of) = self.orphan_file() {
            let (blocks, seed) = self.orphan_blocks(of)?;
            let mut found = false;
            let mut any_left = false;
            for b in blocks {
                let mut data = self.cache().read(b, Kind::Raw, |_| Ok(()))?.to_vec();
                if !found && fo::remove(&mut data, ino.0).is_some() {
                    found = true;
                    any_left |= fo::used_slots(&data) > 0;
                    self.write_orphan_block(b, data, seed)?;
                } else {
                    any_left |= fo::used_slots(&data) > 0;
                }
            }
            if !any_left {
                let mut live = self.live();
                live.sb.feature_ro_compat &= !feature::RO_COMPAT_ORPHAN_PRESENT;
                live.dirty = true;
            }
            if found {
                return Ok(());
            }
        }
        // Legacy list: unlink `ino` from the chain through i_dtime.
        let head = self.live().sb.last_orphan;
        if head == ino.0 {
            let mut live = self.live();
            live.sb.last_orphan = inode.dtime;
            live.dirty = true;
            return Ok(());
        }
        let mut cur = head;
        for _ in 0..self.inner.sb.inodes_count {
            if cur == 0 {
                break;
            }
            let mut ci = self.read_inode(Ino(cur))?;
            if ci.dtime == ino.0 {
                ci.dtime = inode.dtime;
                return self.write_inode(Ino(cur), &ci);
            }
            cur = ci.dtime;
        }
        Ok(())
    }

    /// Finish every orphan left by a crash (read-write open, after journal replay).
    /// Returns how many were processed.
    /// The inodes the orphan lists name now (the orphan file's slots and the legacy
    /// chain, which is followed at most `inodes_count` steps): what `process_orphans`
    /// will finish. Reads only.
    pub(crate) fn orphans_listed(&self) -> Result<std::collections::BTreeSet<u32>> {
        let mut out = std::collections::BTreeSet::new();
        if let Some(of) = self.orphan_file() {
            let (blocks, _) = self.orphan_blocks(of)?;
            for b in blocks {
                let data = self.cache().read(b, Kind::Raw, |_| Ok(()))?;
                out.extend(fo::decode(&data).map_err(|e| Error::from(e.at_block(b)))?);
            }
        }
        let limit = self.inner.sb.inodes_count;
        let mut cur = self.live().sb.last_orphan;
        let mut steps = 0;
        while cur != 0 && cur <= limit && steps < limit && out.insert(cur) {
            cur = self.read_inode(Ino(cur))?.dtime;
            steps += 1;
        }
        Ok(out)
    }

    /// Each orphan is taken off its list as it is finished (not the whole list first),
    /// so a cleanup that commits between the parts of a huge one (see the module note)
    /// leaves the ones not reached yet listed; the list is emptied at the end (entries
    /// a damaged chain hid, or repeated ones).
    pub(crate) fn process_orphans(&self) -> Result<usize> {
        let _w = self.write_lock();
        // (inode, whether the legacy chain named it: taken off by moving the head on)
        let mut todo: Vec<(Ino, bool)> = Vec::new();
        if let Some(of) = self.orphan_file() {
            let (blocks, _) = self.orphan_blocks(of)?;
            for b in blocks {
                let data = self.cache().read(b, Kind::Raw, |_| Ok(()))?;
                let inos = fo::decode(&data).map_err(|e| Error::from(e.at_block(b)))?;
                todo.extend(inos.into_iter().map(|i| (Ino(i), false)));
            }
        }
        // Legacy chain.
        let mut cur = self.live().sb.last_orphan;
        let limit = self.inner.sb.inodes_count;
        let mut steps = 0;
        while cur != 0 && steps < limit {
            if cur > limit {
                return Err(Error::corrupted(
                    format!("orphan list points at inode {cur}"),
                    None,
                ));
            }
            todo.push((Ino(cur), true));
            cur = self.read_inode(Ino(cur))?.dtime;
            steps += 1;
        }
        let n = todo.len();
        let mut done = std::collections::HashSet::new();
        for (k, &(ino, chained)) in todo.iter().enumerate() {
            if chained {
                // The chain is finished in order: its head moves on to the next one
                // (as collected: a freed inode's dtime is no link).
                let next = match todo.get(k + 1) {
                    Some(&(n, true)) => n.0,
                    _ => 0,
                };
                let mut live = self.live();
                live.sb.last_orphan = next;
                live.dirty = true;
            }
            if !done.insert(ino) {
                continue;
            }
            if !chained {
                let inode = self.read_inode(ino)?;
                self.orphan_remove(ino, &inode)?;
            }
            let mut inode = self.read_inode(ino)?;
            if inode.mode == 0 {
                continue;
            }
            inode.dtime = 0;
            if inode.links_count == 0 {
                self.free_inode_and_blocks_in_parts(ino, inode)?;
            } else if inode.is_reg() || inode.is_dir() {
                // A truncate in progress: drop blocks past i_size.
                let bs = u64::from(self.inner.block_size);
                let first_gone = inode.size.div_ceil(bs);
                let mut listed = false;
                self.unmap_tail_in_parts(ino, &mut inode, first_gone, &mut listed)?;
                if listed {
                    self.orphan_remove(ino, &inode)?;
                    inode.dtime = 0;
                }
                self.write_inode(ino, &inode)?;
            } else {
                self.write_inode(ino, &inode)?;
            }
        }
        // Whatever is still listed (a chain cut short, a slot named twice) goes too.
        if let Some(of) = self.orphan_file() {
            let (blocks, seed) = self.orphan_blocks(of)?;
            for b in blocks {
                let data = self.cache().read(b, Kind::Raw, |_| Ok(()))?.to_vec();
                if fo::used_slots(&data) > 0 {
                    let mut clean = data;
                    for s in 0..fo::slots_per_block(clean.len()) {
                        fo::clear_slot(&mut clean, s);
                    }
                    self.write_orphan_block(b, clean, seed)?;
                }
            }
            let mut live = self.live();
            live.sb.feature_ro_compat &= !feature::RO_COMPAT_ORPHAN_PRESENT;
            live.dirty = true;
        }
        {
            let mut live = self.live();
            live.sb.last_orphan = 0;
            live.dirty = true;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    /// The last reference of an unlinked file goes while the thread holds another
    /// inode's I/O lock (which may be the same striped lock): the free waits in the
    /// queue instead of waiting for the lock, and the next unpin on a thread holding
    /// none does it.
    #[test]
    fn a_last_unpin_under_an_io_lock_frees_later() {
        let fs = crate::fs::mem_fs_rw(8 << 20);
        fs.write("/other", b"x").expect("create");
        fs.write("/gone", vec![7u8; 10_000]).expect("create");
        let other = fs.metadata("/other").expect("stat").ino;
        let gone = fs.metadata("/gone").expect("stat").ino;
        let free_before = fs.statfs().inodes_free;
        fs.pin(gone);
        fs.remove_file("/gone").expect("unlink");
        {
            // Same stripe or not, this thread must not wait for another I/O lock.
            let _io = fs.io_shared(other);
            fs.unpin(gone).expect("unpin");
            assert_eq!(fs.statfs().inodes_free, free_before, "freed under the lock");
        }
        assert_eq!(
            fs.inner
                .deferred_frees
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_slice(),
            &[gone]
        );
        fs.pin(other);
        fs.unpin(other).expect("unpin");
        assert_eq!(fs.statfs().inodes_free, free_before + 1, "not freed later");
        fs.close().expect("close");
    }

    /// Two last unpins of one orphan (a writeback's pin and unpin after the opener's
    /// make a second "last"): the first frees it, its number goes to a new file, which
    /// its opener has pinned and another thread unlinks — the second, which waited for
    /// the locks meanwhile, must leave that file alone. (It freed it under its open
    /// handle: the opener's data then went into a freed inode, and writeback gave it a
    /// block no inode referred to.)
    #[test]
    fn a_stale_last_unpin_leaves_the_numbers_next_file_alone() {
        let fs = crate::fs::mem_fs_rw(8 << 20);
        fs.write("/old", b"x").expect("create");
        let n = fs.metadata("/old").expect("stat").ino;
        let free_before = fs.statfs().inodes_free;
        fs.pin(n);
        fs.remove_file("/old").expect("unlink");
        // The stale freer: it passes the link check and waits for the I/O lock.
        let io = fs.io_exclusive(n);
        let stale = {
            let fs = fs.clone();
            std::thread::spawn(move || fs.unpin(n))
        };
        while fs.is_pinned(n) {
            std::thread::yield_now();
        }
        // Meanwhile the orphan is freed by the other last unpin (done here, as
        // `free_if_orphan` does it) and its number reused by a file that is open and
        // then unlinked.
        {
            let _w = fs.write_lock();
            let inode = fs.read_inode(n).expect("read");
            fs.orphan_remove(n, &inode).expect("orphan remove");
            let inode = fs.read_inode(n).expect("read");
            fs.free_inode_and_blocks(n, inode).expect("free");
        }
        let f = crate::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&fs, "/new")
            .expect("create");
        assert_eq!(f.ino(), n, "the freed number is reused");
        fs.remove_file("/new").expect("unlink");
        drop(io);
        stale.join().expect("stale unpin").expect("unpin");
        assert!(
            fs.inode_in_use(n).expect("bitmap"),
            "freed under its handle"
        );
        assert_ne!(fs.read_inode(n).expect("read").mode, 0);
        f.write_all_at(b"still mine", 0).expect("write");
        let mut back = [0u8; 10];
        f.read_exact_at(&mut back, 0).expect("read");
        assert_eq!(&back, b"still mine");
        drop(f);
        assert_eq!(
            fs.statfs().inodes_free,
            free_before + 1,
            "freed at its close"
        );
        fs.close().expect("close");
    }
}
