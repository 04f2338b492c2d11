//! Journaling of rext4's own metadata writes, jbd2-compatible (format notes §2.12–13):
//! the policy. Writing the log (descriptors, tags, revoke and commit blocks, the
//! journal superblock, early commits) is the `rext4-jbd2` crate's [`Journal`] (its
//! `Log`), which knows nothing of ext4; this module hands it the journal inode's
//! blocks ([`load`], through `journal::JournalMap::locate`, the map recovery uses) and
//! runs the periodic commit and early commit threads.
//!
//! Model: a transaction is everything made dirty between two commits. Operations run
//! under `Fs::write_lock` or as handles (the transaction gate shared; closing takes it
//! exclusively, so it waits for the open handles), and a transaction is closed only
//! between operations (at
//! `sync`, `fsync`, the periodic commit, or when the dirty set grows large), so every
//! transaction holds whole operations. It is written under the journal's mutex,
//! usually after the write lock was given up (`Fs::commit_concurrently`): the next
//! transaction runs meanwhile. Commit writes, after the transactions already
//! in the log (or from its start when it is empty): descriptor blocks with v3 tags
//! (escaping blocks that begin with the jbd2 magic), the metadata blocks, revoke
//! blocks, and — when the log was empty — the journal superblock pointing at them
//! (s_start, s_sequence); then flushes the device (this is where ordered mode holds:
//! file data was written to its blocks before, so it is durable before the commit that
//! points at it); then writes the commit block (into a slot zeroed before that flush,
//! so only its first sector changes and a torn write cannot leave half a record) and
//! flushes again: two flushes per commit. Log blocks that follow each other on the
//! device go out in one write (`LogBatch`).
//!
//! Checkpoint is lazy: committed blocks wait in the buffer cache (its *logged* state)
//! until the log has no room for the next transaction, the cache holds too many of
//! them, the filesystem is idle (the periodic commit thread), a chain of early commits
//! is to start, or the filesystem closes. Then every logged block is written home,
//! the device flushed, and the log emptied in the journal superblock (s_start = 0,
//! s_sequence = the next tid), which is flushed too: the next transaction overwrites
//! the old log from its start, and a lost superblock write must not leave s_start
//! pointing at transactions half overwritten (nor may the ext4 superblock, at close,
//! say that no recovery is needed while the log still points at them). The log never
//! wraps: a transaction that does not fit before the end of the journal is preceded
//! by a checkpoint. So an fsync costs two flushes, and the one in a few hundred that
//! finds the log full (or the cache crowded) four.
//!
//! Journaled data: file data is written home before the commit that maps it (ordered
//! mode), except an fsync's few new blocks, whose data goes into the log with that
//! commit and home at the checkpoint (`data_io`; held in the buffer cache meanwhile).
//!
//! Revoke: a logged block that is freed (a directory block, an extent tree or xattr
//! block, journaled file data) could be reused for file data written home while its
//! old copy is still in the log; recovery would write that copy over the data. So the commit that
//! frees it carries a revoke record (jbd2's: no copy from a transaction up to the
//! revoking one is replayed). A block freed again after a checkpoint needs none. Blocks
//! freed by the running transaction stay *busy* (not reallocated) until it commits, so
//! file data is never written into a block that the last committed metadata still
//! points at, and a block is never freed and logged again within one transaction
//! (where a revoke would hide the transaction's own copy; the cache withdraws a revoke
//! of a block written again anyway, as jbd2 does).
//!
//! Crash outcomes: before the commit block is durable, recovery finds no valid commit
//! and the image is as of the previous transaction; after it, replay writes every
//! transaction in the log (idempotently, also over a partial checkpoint).

use std::sync::Arc;

use rext4_format::jbd2;

use crate::error::{Error, Result};
use crate::fs::Fs;

pub(crate) use rext4_jbd2::{EarlyOutcome, Log as Journal};

/// Read the journal of `fs` (None without has_journal): the journal inode's blocks,
/// found by `journal::JournalMap::locate` (as recovery finds them: one map of the log,
/// `rext4_jbd2::Runs`), all mapped, handed to the log, which validates its superblock
/// against them.
pub(crate) fn load(fs: &Fs) -> Result<Option<Journal>> {
    let sb = &fs.inner.sb;
    if !sb.has_compat(rext4_format::superblock::feature::COMPAT_HAS_JOURNAL) || sb.journal_inum == 0
    {
        return Ok(None);
    }
    let bs = fs.block_size() as usize;
    let dev = fs.cache().device().clone();
    let map = crate::journal::JournalMap::locate(dev.as_ref(), sb)?;
    let nblocks = map.blocks;
    if nblocks < u64::from(jbd2::MIN_JOURNAL_BLOCKS) || nblocks > 1 << 24 {
        return Err(Error::corrupted(
            format!("journal of {nblocks} blocks"),
            None,
        ));
    }
    if let Some(l) = map.first_hole() {
        return Err(Error::corrupted(
            format!("journal has a hole at block {l}"),
            None,
        ));
    }
    Ok(Some(Journal::open_runs(dev.as_ref(), map.into_runs(), bs)?))
}

/// Commit every `secs` seconds while the filesystem is open read-write (mount's
/// `commit=`). The thread holds only a weak reference and ends with the filesystem.
pub(crate) fn start_commit_thread(fs: &Fs, secs: u64) {
    if secs == 0 {
        return;
    }
    let weak = Arc::downgrade(&fs.inner);
    let spawned = std::thread::Builder::new()
        .name("rext4-commit".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(secs));
            let Some(inner) = weak.upgrade() else { return };
            let fs = Fs { inner };
            if fs.check_writable().is_err() {
                return;
            }
            if fs.cache().dirty_count() > 0 || fs.live().dirty {
                // Metadata only, as jbd2: file data goes by the writeback thread.
                let _ = fs.sync_metadata();
            } else if fs.cache().logged_count() > 0 {
                // Idle for a whole period: write the log's blocks home.
                let _ = fs.checkpoint_idle();
            }
        });
    // Without the thread, commits still happen at sync, fsync and close.
    drop(spawned);
}

/// Early commits every `ms` milliseconds while something changed (`FsOptions::
/// early_commit_ms`; 0: none). The thread holds only a weak reference and ends with
/// the filesystem.
pub(crate) fn start_early_thread(fs: &Fs, ms: u64) {
    if ms == 0 || fs.inner.boot_id.is_none() || !fs.journaling() {
        return;
    }
    let weak = Arc::downgrade(&fs.inner);
    let spawned = std::thread::Builder::new()
        .name("rext4-early".into())
        .spawn(move || {
            let mut seen = u64::MAX;
            loop {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                let Some(inner) = weak.upgrade() else { return };
                let fs = Fs { inner };
                if fs.check_writable().is_err() {
                    return;
                }
                let dirty_data = fs.page_cache_stats().dirty_bytes > 0;
                let now = fs.cache().write_count();
                if dirty_data || now != seen {
                    if fs.early_commit().is_err() {
                        return;
                    }
                    seen = fs.cache().write_count();
                }
            }
        });
    drop(spawned);
}
