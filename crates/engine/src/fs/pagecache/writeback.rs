//! Writeback: dirty pages to the device, with delayed allocation, and the background
//! thread with its dirty limits.
//!
//! One pass over a file (`writeback_ino`): pin the inode (so an unlink turns it into
//! an orphan instead of freeing it under the pass), then, chunk by chunk in page order:
//! 1. snapshot up to [`WRITEBACK_CHUNK_BYTES`] of dirty pages (mark them `writeback`,
//!    copy their bytes, remember their `seq`), under the file's state lock;
//! 2. for each run of consecutive pages: under the tree lock (exclusive) and a handle
//!    with the inode's lock (`Fs::lock_nondir`: other files' passes and namespace
//!    operations go on beside it), map the run's next piece; a hole gets blocks at
//!    once, inserted as one *unwritten* extent (so a commit at any moment sees zeros
//!    there, never stale blocks); then, without locks, write the data where the piece
//!    maps. Pages a truncate or punch took out of the cache meanwhile are skipped
//!    (their blocks are about to go, and their promises went with them);
//! 3. under the tree lock and a handle with the inode's lock again: mark the pieces
//!    written, and raise the on-disk size up to the in-memory size, but not past the
//!    first dirty page that is still unwritten (looked for at this step: pages
//!    dirtied while the chunk was on its way count) — so the i_size that commits
//!    covers only written data;
//! 4. clear `dirty` on the pages whose `seq` did not move (a write during the pass
//!    leaves its page dirty for the next one), release their reservations, wake
//!    waiters.
//!
//! Block-mapped files (ext2/ext3 maps, `blockmap_write`) have no unwritten state, so
//! step 2 cannot park their new blocks until the data is there. Such a hole is a
//! *fresh* piece: the tree lock, the handle and the inode lock taken to map it are
//! kept ([`Hold`]) while its data is written (or journaled, for an fsync's small pass)
//! and while the on-disk size is raised over it (`size_over_fresh`), then released.
//! The open handle keeps the running transaction from closing — a commit waits for
//! it as for any handle (jbd2's t_updates) — so no commit holds the mapping without
//! its data (ordered mode) or a written block past i_size (which e2fsck refuses).
//! Chosen over jbd2's ordered-data list (a commit waiting for the data writes of the
//! transaction it closed) because it adds no state to the commit protocol
//! (`group_commit`); the cost is that a commit starting meanwhile waits for one
//! piece's write (at most an indirect block's span), and handles behind it for that
//! commit. The size goes up to the in-memory size only; dirty pages below it still to
//! be written show the device's bytes (zeros over holes) until their own writeback.
//!
//! Space: a dirty page over a hole holds a promised block (`space`), spent when step 2
//! allocates it (`Claim::Reserved`); the tree blocks step 2 and 3 need (a block map's
//! indirect blocks, which its pages promised by name) come from the file's tree
//! promise, then the pool (`Claim::Writeback`; a filesystem without extents has none). The pages a chunk has
//! allocated for still count toward the tree promise until the chunk is done
//! (`FileState::inflight`): given back at the allocation, it would be gone before the
//! insert and the conversion that need it. So writeback does not run
//! out of space; should it anyway (a tree far more fragmented than the estimate), the
//! chunk's dirty data is dropped with a message, as the kernel does, and ENOSPC is
//! reported at fsync. A device write error shuts the filesystem down (as a failed
//! commit does) and is kept for the next fsync.
//!
//! The writeback thread wakes every second (or when kicked): it writes back files
//! oldest-dirty first while the dirty count is above the background threshold or a
//! file has been dirty longer than [`DIRTY_EXPIRE_SECS`]. Writers over the dirty
//! limit write back the oldest file themselves before returning (`balance_dirty`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{FileCache, WbError, DIRTY_EXPIRE_SECS, WRITEBACK_CHUNK_BYTES};
use crate::error::{Error, Result};
use crate::fs::inode_write::{map_new_blocks, uses_block_map, with_tree};
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};

/// One snapshotted page: index, the page, its `seq` at snapshot time.
pub(crate) type Snap = (u64, Arc<super::Page>, u64);

/// How a chunk's data goes out (`Fs::write_chunk`).
#[derive(Clone, Copy)]
pub(crate) struct ChunkWrite<'a> {
    /// The runs' pages, in order, for a writeback pass of the page cache: holes under
    /// them hold promised blocks. None for a write going out at once (`write_now`):
    /// its blocks are claimed afresh.
    pub(crate) pages: &'a [Snap],
    /// The data of blocks that are unwritten (just allocated, or preallocated) is
    /// journaled instead of written home (`data_io`).
    pub(crate) journal: bool,
}

/// What a piece of a run maps to when its data is written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// Written blocks: overwrite in place.
    Overwrite,
    /// Unwritten blocks (found so, or just allocated): write, then mark written.
    Convert,
    /// Pages a truncate or punch dropped from the cache while the chunk was on its
    /// way: not written (see `Fs::map_for_writeback`).
    Dropped,
    /// Blocks just mapped in a block map (no unwritten state): written while the
    /// piece's locks and handle are still held ([`Hold`]), then the on-disk size is
    /// raised over them under the same handle, so no commit sees the mapping before
    /// the data, nor a mapped block past the size.
    Fresh,
}

/// A piece of a writeback run as mapped: physical start, blocks, kind, and the locks
/// a fresh piece keeps until its data is written.
type Mapped<'a> = (u64, u64, Piece, Option<Hold<'a>>);

/// The locks a [`Piece::Fresh`] keeps from its mapping until its data is on the
/// device and the size covers it: the file's inode lock, the handle (the running
/// transaction cannot close while it is open) and the tree lock (no reader maps the
/// blocks before their data is there), released in that order.
pub(crate) struct Hold<'a> {
    _i: crate::fs::inode_locks::InodeGuard<'a>,
    _h: crate::fs::Handle<'a>,
    _t: crate::lockdep::Ranked<std::sync::RwLockWriteGuard<'a, ()>>,
}

impl Fs {
    /// Write back the dirty pages of `ino` in pages `[first, last]`. With `wait`, first
    /// wait for passes already running on that range, so that everything dirty before
    /// the call is on the device when it returns (fsync).
    /// Returns the number of pages written.
    pub(crate) fn writeback_ino(
        &self,
        ino: Ino,
        first: u64,
        last: u64,
        wait: bool,
    ) -> Result<usize> {
        self.writeback_pass(ino, first, last, wait, false)
    }

    /// [`Fs::writeback_ino`]; `for_fsync`: a commit follows at once, so a pass that
    /// allocates only a few blocks journals their data (`data_io`).
    fn writeback_pass(
        &self,
        ino: Ino,
        first: u64,
        last: u64,
        wait: bool,
        for_fsync: bool,
    ) -> Result<usize> {
        let Some(fc) = self.inner.pagecache.file(ino) else {
            return Ok(0);
        };
        let whole = first == 0 && last == u64::MAX;
        {
            let st = fc.lock();
            let idle = st.dirty_idx.range(first..=last).next().is_none() && st.writeback == 0;
            if st.dead || (idle && !(whole && st.size.is_some())) {
                return Ok(0);
            }
        }
        self.pin(ino);
        let r = self
            .writeback_pinned(&fc, ino, first, last, wait, for_fsync)
            .and_then(|n| {
                if whole {
                    self.settle_size(&fc, ino)?;
                }
                Ok(n)
            });
        if !self.inner.pagecache.keep_clean {
            self.inner.pagecache.drop_if_empty(&fc);
        }
        let u = self.unpin(ino);
        let n = r?;
        u?;
        Ok(n)
    }

    /// After a whole-file pass: if the in-memory size is still ahead of the record but
    /// no data past the record's size waits to be written (a punch or truncate dropped
    /// the dirty pages there), the rest is a hole — raise the record's size to it.
    /// The stale tail of the old last block is zeroed on the device first.
    fn settle_size(&self, fc: &FileCache, ino: Ino) -> Result<()> {
        let ps = self.inner.pagecache.page_size as u64;
        let _t = self.tree_exclusive(ino);
        let _h = self.handle();
        let _i = self.lock_nondir(ino);
        self.check_writable()?;
        let mut inode = self.read_inode(ino)?;
        let target = {
            let mut st = fc.lock();
            let Some(s) = st.size else { return Ok(()) };
            if st.dead || inode.mode == 0 || !inode.is_reg() {
                return Ok(());
            }
            if s <= inode.size {
                st.size = None;
                return Ok(());
            }
            let pending = st.dirty_idx.range(inode.size / ps..).next().is_some();
            // A write going out at once set the size ahead of its data: not a hole.
            if pending || st.writeback > 0 || st.writing_now > 0 {
                return Ok(());
            }
            s
        };
        self.zero_past_eof(ino, &inode, target)?;
        inode.size = target;
        self.write_inode(ino, &inode)?;
        let mut st = fc.lock();
        // A writer may have moved the in-memory size on meanwhile (it holds the I/O
        // lock, which this pass does not): keep that.
        if st.size == Some(target) {
            st.size = None;
        }
        Ok(())
    }

    fn writeback_pinned(
        &self,
        fc: &Arc<FileCache>,
        ino: Ino,
        first: u64,
        last: u64,
        wait: bool,
        for_fsync: bool,
    ) -> Result<usize> {
        let pc = &self.inner.pagecache;
        let ps = pc.page_size as u64;
        let chunk_pages = (WRITEBACK_CHUNK_BYTES / ps).max(1) as usize;
        // Data past the on-disk size is written in page order, from the first dirty
        // page past it: the size then follows the data and no data ever lies past it
        // (so the stale tail of the last block may always be zeroed when it grows).
        let disk_page = self.read_inode(ino)?.size / ps;
        let lower = if disk_page < first {
            fc.lock().dirty_idx.range(disk_page..first).next().copied()
        } else {
            None
        };
        let mut from = lower.unwrap_or(first);
        let mut written = 0usize;
        // One snapshot buffer for the whole pass (a fresh one per chunk would fault in
        // up to 8 MiB of new memory each time).
        let mut scratch: Vec<u8> = Vec::with_capacity(chunk_pages * ps as usize);
        loop {
            // 1. Snapshot.
            let (snaps, runs) = {
                let mut st = fc.lock();
                if st.dead {
                    return Ok(written);
                }
                if wait {
                    st = fc.wait_writeback(st, from, last);
                }
                let idxs: Vec<u64> = st
                    .dirty_idx
                    .range(from..=last)
                    .copied()
                    .filter(|i| st.pages.get(i).is_some_and(|p| !p.lock().writeback))
                    .take(chunk_pages)
                    .collect();
                if idxs.is_empty() {
                    return Ok(written);
                }
                let mut snaps: Vec<Snap> = Vec::with_capacity(idxs.len());
                // Runs of consecutive pages: (first page, pages), their bytes one after
                // the other in `scratch`.
                let mut runs: Vec<(u64, u64)> = Vec::new();
                scratch.clear();
                for &i in &idxs {
                    let Some(p) = st.pages.get(&i).cloned() else {
                        continue;
                    };
                    let mut d = p.lock();
                    d.writeback = true;
                    scratch.extend_from_slice(&d.buf);
                    match runs.last_mut() {
                        Some((s, n)) if *s + *n == i => *n += 1,
                        _ => runs.push((i, 1)),
                    }
                    snaps.push((i, p.clone(), d.seq));
                }
                st.writeback += snaps.len();
                from = idxs.last().map_or(from, |&l| l + 1);
                (snaps, runs)
            };
            // 2 and 3.
            crate::fs::space::note_refusal("");
            // The whole pass in one small chunk, for an fsync: its new blocks'
            // data goes to the log with the commit that follows.
            let journal = for_fsync && written == 0 && self.journals_data(snaps.len());
            let how = ChunkWrite {
                pages: &snaps,
                journal,
            };
            let r = self.write_chunk(fc, ino, &runs, &scratch, how);
            // 4. Completion.
            let mut st = fc.lock();
            let drop_data = matches!(r, Err(Error::NoSpace));
            let mut released = 0;
            for (i, p, seq) in &snaps {
                let mut d = p.lock();
                d.writeback = false;
                if (r.is_ok() && d.seq == *seq) || drop_data {
                    if d.dirty {
                        d.dirty = false;
                        pc.note_clean(&mut st, ino, *i);
                    }
                    if d.delalloc {
                        d.delalloc = false;
                        released += 1;
                    }
                }
            }
            pc.drop_delalloc(&mut st, released, true);
            st.writeback -= snaps.len();
            if !pc.keep_clean && st.loading == 0 {
                // The frontend keeps its own copy: hold only dirty data (kept while a
                // page of the file is read in: it may be older, `instantiate`).
                for (i, p, _) in &snaps {
                    let clean = {
                        let d = p.lock();
                        !d.dirty && !d.writeback
                    };
                    let same = st.pages.get(i).is_some_and(|q| Arc::ptr_eq(q, p));
                    if clean && same {
                        pc.remove_page(&mut st, ino, *i);
                    }
                }
            }
            if let Err(e) = &r {
                let we = match e {
                    Error::NoSpace => {
                        let (unpromised, data, tree) = self.inner.space.figures();
                        log::warn!(
                            "writeback of inode {} ran out of space: {} dirty pages \
                             dropped ({}; blocks unpromised {unpromised}, promised to \
                             data {data}, to tree blocks {tree})",
                            ino.0,
                            snaps.len(),
                            match crate::fs::space::last_refusal() {
                                "" => "no refusal recorded",
                                why => why,
                            }
                        );
                        WbError::NoSpace
                    }
                    other => WbError::Io(other.to_string()),
                };
                st.error.get_or_insert(we);
            }
            drop(st);
            fc.wb_done.notify_all();
            r?;
            written += snaps.len();
            for (_, p, _) in snaps {
                pc.recycle(p); // only pages that left the cache (ours is the last Arc)
            }
            if from > last {
                return Ok(written);
            }
        }
    }

    /// Write the snapshotted runs of one chunk: steps 2 and 3 of the module note.
    pub(crate) fn write_chunk(
        &self,
        fc: &Arc<FileCache>,
        ino: Ino,
        runs: &[(u64, u64)],
        scratch: &[u8],
        how: ChunkWrite,
    ) -> Result<()> {
        // Pages whose promises this chunk's allocations spent (`FileState::inflight`):
        // the tree promise counts them until the chunk is finished, whatever happens.
        let mut inflight = 0u64;
        let r = self.write_chunk_pieces(fc, ino, runs, scratch, how, &mut inflight);
        if inflight > 0 {
            let mut st = fc.lock();
            st.inflight = st.inflight.saturating_sub(inflight);
            self.inner.pagecache.settle_tree(&mut st);
        }
        r
    }

    /// `write_chunk`'s work; `inflight` counts the promises its allocations spent.
    fn write_chunk_pieces(
        &self,
        fc: &Arc<FileCache>,
        ino: Ino,
        runs: &[(u64, u64)],
        scratch: &[u8],
        how: ChunkWrite,
        inflight: &mut u64,
    ) -> Result<()> {
        let ChunkWrite {
            pages: snaps,
            journal,
        } = how;
        let ps = self.inner.pagecache.page_size as u64;
        let mut converts: Vec<(u64, u64)> = Vec::new();
        let mut at = 0usize;
        for &(start, n) in runs {
            let data = &scratch[at..at + (n * ps) as usize];
            let first = at / ps as usize;
            at += data.len();
            let mut i = 0u64;
            while i < n {
                let lblk = start + i;
                let pages = snaps
                    .get(first + i as usize..first + n as usize)
                    .unwrap_or(&[]);
                let Some((phys, len, piece, hold)) =
                    self.map_for_writeback(fc, ino, lblk, n - i, pages, inflight)?
                else {
                    return Ok(()); // the inode was freed: nothing to write
                };
                if piece == Piece::Dropped {
                    i += len;
                    continue;
                }
                let bytes = &data[(i * ps) as usize..((i + len) * ps) as usize];
                let fresh = matches!(piece, Piece::Convert | Piece::Fresh);
                let r = if journal && fresh {
                    self.journal_data(bytes, phys * ps)
                } else {
                    self.write_data(bytes, phys * ps)
                };
                if let Err(e) = r {
                    // The chunk's extents may already be in the running transaction:
                    // abort, so none of it is committed over data that never arrived,
                    // and whoever recovers the image sees the error.
                    self.inner.abort(format!("data write failed: {e}"));
                    return Err(e);
                }
                if let Some(hold) = hold {
                    self.size_over_fresh(fc, ino, (lblk + len) * ps)?;
                    drop(hold);
                }
                if piece == Piece::Convert {
                    match converts.last_mut() {
                        Some((l, k)) if *l + *k == lblk => *k += len,
                        _ => converts.push((lblk, len)),
                    }
                }
                i += len;
            }
        }
        self.finish_chunk(fc, ino, runs, &converts)
    }

    /// Step 2's metadata part for logical block `lblk` (at most `max` blocks): the
    /// physical start, length and kind of the piece. `None` when the inode is gone.
    /// Pages whose promises an allocation here spends are added to `inflight` (and to
    /// the file's `FileState::inflight`, which the caller takes them out of).
    ///
    /// `pages` are the chunk's snapshots from `lblk` on (none for a write going out
    /// at once, which promised nothing). Those no longer the file's page at their index were dropped by a
    /// truncate or punch (the only ones that take pages under writeback out, and
    /// they wait for the chunk before they cut its blocks): a `Dropped` piece, not
    /// written. An allocation for them would be a fresh claim — their promises went
    /// back with them — which a full disk refuses, failing the whole chunk: the
    /// pages it should have written were dropped with an ENOSPC nobody caused.
    fn map_for_writeback(
        &self,
        fc: &Arc<FileCache>,
        ino: Ino,
        lblk: u64,
        max: u64,
        pages: &[Snap],
        inflight: &mut u64,
    ) -> Result<Option<Mapped<'_>>> {
        let delayed = !pages.is_empty();
        use crate::fs::space::{claim_as, Claim};
        // Tree blocks of a writeback pass come from the file's promise (then the
        // pool); a write going out at once claims them afresh.
        let _c = delayed.then(|| claim_as(Claim::Writeback(fc.clone())));
        let t = self.tree_exclusive(ino);
        let h = self.handle();
        let i = self.lock_nondir(ino);
        self.check_writable()?;
        // How many leading pages are (`true`) or are not still the file's: the
        // dropped ones are checked again under the state lock that takes the promises,
        // since a drop needs only that lock.
        let leading = |st: &super::FileState, kept: bool| {
            pages
                .iter()
                .zip(lblk..)
                .take_while(|((_, p, _), i)| {
                    st.pages.get(i).is_some_and(|q| Arc::ptr_eq(q, p)) == kept
                })
                .count() as u64
        };
        let kept = {
            let st = fc.lock();
            if st.dead {
                return Ok(None);
            }
            match leading(&st, false) {
                0 => {}
                n => return Ok(Some((0, n, Piece::Dropped, None))),
            }
            // A piece over mapped blocks stops at the next dropped page too.
            if delayed {
                leading(&st, true)
            } else {
                max
            }
        };
        let mut inode = self.read_inode(ino)?;
        if inode.mode == 0 || !inode.is_reg() {
            return Ok(None);
        }
        Ok(Some(match self.map_block(ino, &inode, lblk)? {
            Mapping::Mapped {
                physical,
                len,
                unwritten,
            } => (
                physical,
                len.min(max).min(kept),
                if unwritten {
                    Piece::Convert
                } else {
                    Piece::Overwrite
                },
                None,
            ),
            Mapping::Hole { len } => {
                // Unwritten extents hold at most 32767 blocks; one allocation in a
                // block map reaches the end of its pointer array at most (pages past
                // it would take their promises only to give them back).
                let mut want = len.min(max).min(32767);
                if uses_block_map(&inode) {
                    let bs = self.inner.block_size;
                    want = want.min(crate::blockmap_write::to_boundary(lblk, bs).max(1));
                }
                // Pages holding promised blocks spend them on this allocation (their
                // flags cleared first, so a truncate that drops one meanwhile gives
                // nothing back); a run of pages without (a write going out at once, or
                // a page that never reserved) claims afresh.
                let promised = if delayed {
                    let mut st = fc.lock();
                    match leading(&st, false) {
                        0 => {}
                        n => return Ok(Some((0, n, Piece::Dropped, None))),
                    }
                    let mut k = 0;
                    while k < want {
                        let Some(pg) = st.pages.get(&(lblk + k)) else {
                            break;
                        };
                        let mut d = pg.lock();
                        if !d.delalloc {
                            break;
                        }
                        d.delalloc = false;
                        k += 1;
                    }
                    st.delalloc -= k;
                    st.inflight += k;
                    if k == 0 {
                        // Pages without a promise (none should be: a page over a hole
                        // takes one when it is dirtied), up to a dropped one.
                        want = (lblk..lblk + want)
                            .take_while(|i| st.pages.get(i).is_some_and(|p| !p.lock().delalloc))
                            .count()
                            .max(1) as u64;
                    }
                    k
                } else {
                    0
                };
                if promised > 0 {
                    want = promised;
                }
                // The data blocks: the pages' promises, or a fresh claim. Tree and
                // indirect blocks the mapping needs come under the claim above.
                let taken = std::cell::Cell::new(0u64);
                let mut alloc = |goal: u64, n: u32| {
                    let _c = claim_as(if promised > 0 {
                        Claim::Reserved
                    } else {
                        Claim::Fresh
                    });
                    let r = self.alloc_blocks(goal, n);
                    if let Ok((_, got)) = r {
                        taken.set(u64::from(got));
                    }
                    r
                };
                let block_map = uses_block_map(&inode);
                // A failed mapping freed the data blocks it had: their promises are
                // made again.
                let undo = |taken: u64| {
                    let spent = taken.min(promised);
                    if spent > 0 {
                        self.inner.space.repromise(spent);
                    }
                };
                let mut r =
                    map_new_blocks(self, ino, &mut inode, lblk, want, !block_map, &mut alloc);
                if matches!(r, Err(Error::NoSpace)) {
                    // Blocks freed by the running transaction become usable at its
                    // commit.
                    undo(taken.replace(0));
                    r = self.inner.sync_locked().and_then(|()| {
                        map_new_blocks(self, ino, &mut inode, lblk, want, !block_map, &mut alloc)
                    });
                }
                let (p, got) = match r {
                    Ok(x) => x,
                    Err(e) => {
                        undo(taken.get());
                        self.restore_promises(fc, lblk, lblk + promised);
                        return Err(e);
                    }
                };
                let spent = got.min(promised);
                self.restore_promises(fc, lblk + spent, lblk + promised);
                // The spent ones stay in flight until the chunk is done (`write_chunk`).
                *inflight += spent;
                self.write_inode(ino, &inode)?;
                if block_map {
                    let hold = Hold {
                        _i: i,
                        _h: h,
                        _t: t,
                    };
                    (p, got, Piece::Fresh, Some(hold))
                } else {
                    (p, got, Piece::Convert, None)
                }
            }
        }))
    }

    /// After the data of a [`Piece::Fresh`] ending at byte `end` is on the device
    /// (its [`Hold`] still held): raise the on-disk size over it, up to the in-memory
    /// size, so no committed state has a block-mapped block past the size (e2fsck's
    /// "i_size is X, should be Y"). Block maps have no unwritten extents to keep
    /// blocks past the size until the size follows, as extent files do
    /// (`finish_chunk`); pages below it that are dirty and not yet written show what
    /// they held on the device until their own writeback.
    fn size_over_fresh(&self, fc: &Arc<FileCache>, ino: Ino, end: u64) -> Result<()> {
        let mut inode = self.read_inode(ino)?;
        if inode.mode == 0 || !inode.is_reg() {
            return Ok(());
        }
        let vfs = fc.lock().size.map_or(inode.size, |s| s.max(inode.size));
        let target = inode.size.max(vfs.min(end));
        if target == inode.size {
            return Ok(());
        }
        inode.size = target;
        self.write_inode(ino, &inode)?;
        let mut st = fc.lock();
        if st.size.is_some_and(|s| s <= target) {
            st.size = None;
        }
        Ok(())
    }

    /// Pages `[from, to)` of a writeback run spent their promises on an allocation
    /// that did not take them: they hold them again (a page dropped meanwhile gives
    /// its promise back), and are no longer in flight. Then the file's tree promise is
    /// settled. A page at one of those indexes is the snapshotted one, not a newer one:
    /// only a truncate or a punch takes a page under writeback out, holding the
    /// inode's I/O lock exclusively until the chunk is done, and every path that puts
    /// a page in (reads, writes, faults) takes that lock first.
    fn restore_promises(&self, fc: &FileCache, from: u64, to: u64) {
        let pc = &self.inner.pagecache;
        let mut st = fc.lock();
        st.inflight = st.inflight.saturating_sub(to - from);
        let mut gone = 0;
        for i in from..to {
            match st.pages.get(&i) {
                Some(pg) => pg.lock().delalloc = true,
                None => gone += 1,
            }
        }
        st.delalloc += to - from - gone;
        if gone > 0 {
            pc.space.unreserve(gone, 0);
        }
        pc.settle_tree(&mut st);
    }

    /// Step 3: mark the converted pieces written and raise the on-disk size: up to
    /// the in-memory size, not past the first page that is dirty now, past the
    /// on-disk size, and not one this chunk wrote (`runs`). That page is looked for
    /// now, not when the chunk was snapshotted: pages dirtied meanwhile (a writer
    /// appending while the chunk was on its way) are not on the device, and a size
    /// raised over them would commit zeros for their data — and leave the on-disk
    /// size inside a page that a later chunk writes without being allowed to raise
    /// the size over it, so that `settle_size` would take its written tail for a
    /// shrink's stale bytes and zero it on the device.
    fn finish_chunk(
        &self,
        fc: &Arc<FileCache>,
        ino: Ino,
        runs: &[(u64, u64)],
        converts: &[(u64, u64)],
    ) -> Result<()> {
        // Splitting an unwritten extent to mark part of it written takes tree blocks
        // the file's promise covers, or the pool: it must not fail.
        let _c = crate::fs::space::claim_as(crate::fs::space::Claim::Writeback(fc.clone()));
        let _t = self.tree_exclusive(ino);
        let _h = self.handle();
        let _i = self.lock_nondir(ino);
        self.check_writable()?;
        if fc.lock().dead {
            return Ok(());
        }
        let mut inode = self.read_inode(ino)?;
        if inode.mode == 0 || !inode.is_reg() {
            return Ok(());
        }
        let before = inode.clone();
        for &(l, n) in converts {
            let mut at = l;
            while at < l + n {
                let k = (l + n - at).min(32768);
                with_tree(self, ino, &mut inode, |t| {
                    t.mark_written(at as u32, k as u32)
                })?;
                at += k;
            }
        }
        let ps = self.inner.pagecache.page_size as u64;
        let ours = |i: u64| runs.iter().any(|&(first, n)| first <= i && i < first + n);
        let (vfs, bound) = {
            let st = fc.lock();
            let unwritten = st
                .dirty_idx
                .range(inode.size / ps..)
                .copied()
                .find(|&i| !ours(i));
            (
                st.size.map_or(inode.size, |s| s.max(inode.size)),
                unwritten.map_or(u64::MAX, |i| i * ps),
            )
        };
        let new_disk = inode.size.max(vfs.min(bound));
        inode.size = new_disk;
        if inode != before {
            self.write_inode(ino, &inode)?;
        }
        let mut st = fc.lock();
        if st.size.is_some_and(|s| s <= new_disk) {
            st.size = None;
        }
        Ok(())
    }

    /// Write back every dirty file and wait for it (syncfs's data part). Returns the
    /// first error met, also errors kept from background writeback since the last
    /// sync.
    pub(crate) fn writeback_all(&self) -> Result<()> {
        self.writeback_every_file(true)
    }

    /// Write back every dirty file and wait; with `report`, take and return the errors
    /// kept for fsync too (syncfs), else leave them to each file's next fsync.
    pub(crate) fn writeback_every_file(&self, report: bool) -> Result<()> {
        let mut first_err = None;
        // In inode order, not the file map's hash order: the same dirty files get
        // their blocks in the same order in every run (reproducible images).
        let mut files = self.inner.pagecache.all_files();
        files.sort_unstable_by_key(|fc| fc.ino.0);
        for fc in files {
            let r = self.writeback_ino(fc.ino, 0, u64::MAX, true).map(|_| ());
            if !report {
                r?;
                continue;
            }
            let kept = fc.lock().error.take();
            if first_err.is_none() {
                if let Err(e) = r {
                    first_err = Some(e);
                } else if let Some(k) = kept {
                    first_err = Some(k.to_error());
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// fsync/fdatasync of one file: its dirty pages, then the journal.
    pub fn fsync_ino(&self, ino: Ino) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        self.writeback_pass(ino, 0, u64::MAX, true, true)?;
        if let Some(fc) = self.inner.pagecache.file(ino) {
            if let Some(e) = fc.lock().error.take() {
                return Err(e.to_error());
            }
        }
        if self.is_dax() {
            // Stores through mappings are written back; the commit's flushes fence
            // them before its commit block, and the last flush fences the file's own
            // non-temporal stores even when there was nothing to commit.
            self.dax_write_back_dirty(Some(ino))?;
            self.fsync_commit()?;
            return Ok(self.cache().device().flush()?);
        }
        self.fsync_commit()
    }

    /// sync_file_range(WRITE | WAIT_AFTER) of bytes `[off, off+len)` (`len` 0: to the
    /// end): write the range's dirty pages back, without a journal commit.
    pub fn sync_range_ino(&self, ino: Ino, off: u64, len: u64) -> Result<()> {
        if self.inner.read_only {
            return Ok(());
        }
        let ps = self.inner.pagecache.page_size as u64;
        let last = if len == 0 {
            u64::MAX
        } else {
            (off.saturating_add(len) - 1) / ps
        };
        self.writeback_ino(ino, off / ps, last, true).map(|_| ())
    }

    /// After a buffered write: kick the writeback thread above the background
    /// threshold, and above the dirty limit write back the oldest files here until
    /// under it again (the writer pays for the dirt it makes, like the kernel's
    /// balance_dirty_pages).
    pub(crate) fn balance_dirty(&self) {
        let pc = &self.inner.pagecache;
        let dirty = pc.dirty.load(Ordering::Relaxed);
        if dirty > pc.dirty_background {
            pc.kick_writeback();
        }
        let mut rounds = 0;
        while pc.dirty.load(Ordering::Relaxed) > pc.dirty_limit && rounds < 1000 {
            rounds += 1;
            let Some((ino, _)) = pc.oldest_dirty_file() else {
                break;
            };
            match self.writeback_ino(ino, 0, u64::MAX, false) {
                // Everything there is under writeback already: let it finish.
                Ok(0) => std::thread::sleep(Duration::from_millis(1)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
}

/// Start the writeback thread of a read-write `fs` (it holds only a weak reference and
/// ends with the filesystem).
pub(crate) fn start_writeback_thread(fs: &Fs) {
    let weak = Arc::downgrade(&fs.inner);
    let ctl = fs.inner.pagecache.wb.clone();
    {
        let mut c = ctl.ctl();
        if c.started {
            return;
        }
        c.started = true;
    }
    let spawned = std::thread::Builder::new()
        .name("rext4-writeback".into())
        .spawn(move || loop {
            // Sleep on the shared control block, not holding the filesystem.
            {
                let c = ctl.ctl();
                let (mut c, _) = ctl
                    .cv
                    .wait_timeout_while(c, Duration::from_secs(1), |w| !w.kick && !w.stop)
                    .unwrap_or_else(|p| p.into_inner());
                if c.stop {
                    return;
                }
                c.kick = false;
            }
            let Some(inner) = weak.upgrade() else { return };
            let fs = Fs { inner };
            if fs.check_writable().is_err() {
                return;
            }
            let pc = &fs.inner.pagecache;
            let expire = Duration::from_secs(DIRTY_EXPIRE_SECS);
            for _ in 0..10_000 {
                let over = pc.dirty.load(Ordering::Relaxed) > pc.dirty_background;
                let Some((ino, age)) = pc.oldest_dirty_file() else {
                    break;
                };
                if !over && age < expire {
                    break;
                }
                match fs.writeback_ino(ino, 0, u64::MAX, false) {
                    Ok(n) if n > 0 => {}
                    // Nothing to take (others are writing it), or an error (kept for
                    // the next fsync): do not spin.
                    _ => break,
                }
            }
        });
    drop(spawned);
}
