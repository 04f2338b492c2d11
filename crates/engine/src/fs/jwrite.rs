//! Journaling of rext4's own metadata writes, jbd2-compatible (format notes §2.12–13).
//!
//! Model: a transaction is everything made dirty between two commits. Operations run
//! under `Fs::write_lock`, and a transaction is closed only between operations (at
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
//! Revoke: a logged block that is freed (a directory block, an extent tree or xattr
//! block) could be reused for file data, which is not journaled, while its old copy is
//! still in the log; recovery would write that copy over the data. So the commit that
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

use rext4_format::jbd2::{self, CommitBlock, EarlyRecord, JournalSuperblock, LogFormat, Tag};

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::fs::map::Mapping;
use crate::fs::{Fs, Ino};

pub(crate) struct Journal {
    /// Physical block of each journal block (index = journal block number).
    map: Vec<u64>,
    jsb: JournalSuperblock,
    bs: usize,
    last_commit_sec: u64,
    /// The log block after the last committed transaction; `None` while the log is
    /// empty (`s_start` 0).
    head: Option<u32>,
    /// tid of the next transaction (early or not).
    next_tid: u32,
    /// The chain of early commits since the last commit, if any (only ever started on
    /// an empty log).
    early: Option<Early>,
}

/// A chain of early commits (format crate, "rext4's early commits"): transactions
/// written to an empty log from `s_first` on, each ending in an EARLY block, with no
/// flush; the log stays empty for jbd2 (`s_start` 0) and the chain's start is in the
/// journal superblock's padding. The next commit goes after the chain, so a crash while
/// it is written still finds the chain, and ends it: with a committed transaction in
/// the log, recovery ignores the chain's record (cleared at the next checkpoint).
struct Early {
    /// The log block after the chain.
    next: u32,
    /// Checksum of the content each home block was last logged with in the chain:
    /// an early commit logs only what changed since the one before.
    logged: std::collections::HashMap<u64, u32>,
}

/// What an early commit did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum EarlyOutcome {
    Written,
    /// Nothing changed since the last one.
    Nothing,
    /// The log has no room for it beside the commit that must follow: commit now.
    NoRoom,
}

impl Journal {
    /// Read the journal of `fs` (None without has_journal). Validates the superblock
    /// and that the whole log is mapped.
    pub(crate) fn load(fs: &Fs) -> Result<Option<Journal>> {
        let sb = &fs.inner.sb;
        if !sb.has_compat(rext4_format::superblock::feature::COMPAT_HAS_JOURNAL)
            || sb.journal_inum == 0
        {
            return Ok(None);
        }
        let ino = Ino(sb.journal_inum);
        let inode = fs.read_inode(ino)?;
        let bs = fs.block_size() as usize;
        let nblocks = inode.size / bs as u64;
        if nblocks < u64::from(jbd2::MIN_JOURNAL_BLOCKS) || nblocks > 1 << 24 {
            return Err(Error::corrupted(
                format!("journal of {nblocks} blocks"),
                None,
            ));
        }
        let mut map = Vec::with_capacity(nblocks as usize);
        let mut l = 0u64;
        while l < nblocks {
            match fs.map_block(ino, &inode, l)? {
                Mapping::Mapped {
                    physical,
                    len,
                    unwritten: false,
                } => {
                    for k in 0..len.min(nblocks - l) {
                        map.push(physical + k);
                    }
                    l += len.min(nblocks - l);
                }
                _ => {
                    return Err(Error::corrupted(
                        format!("journal has a hole at block {l}"),
                        None,
                    ))
                }
            }
        }
        let mut b = vec![0u8; bs];
        fs.cache().device().read_at(&mut b, map[0] * bs as u64)?;
        let jsb = JournalSuperblock::decode(&b).map_err(|e| Error::from(e.at_block(map[0])))?;
        jsb.verify().map_err(|e| Error::from(e.at_block(map[0])))?;
        if let Err(e) = jsb.features_supported() {
            return Err(Error::Unsupported(format!("journal: {e}")));
        }
        if jsb.blocksize as usize != bs
            || (jsb.maxlen as u64) > nblocks
            || jsb.first == 0
            || jsb.first >= jsb.maxlen
        {
            return Err(Error::corrupted(
                "journal superblock geometry does not fit the journal inode",
                Some(map[0]),
            ));
        }
        let next_tid = jsb.sequence;
        Ok(Some(Journal {
            map,
            jsb,
            bs,
            last_commit_sec: 0,
            head: None,
            next_tid,
            early: None,
        }))
    }

    fn fmt(&self) -> LogFormat {
        self.jsb.log_format()
    }

    /// Before the first write: upgrade the journal to 64bit + checksum v3 as the kernel
    /// does for a metadata_csum filesystem, and require an empty log.
    pub(crate) fn prepare_rw(
        &mut self,
        dev: &dyn BlockDevice,
        metadata_csum: bool,
        is64: bool,
    ) -> Result<()> {
        if self.jsb.start != 0 {
            return Err(Error::InvalidInput(
                "journal is not empty (recovery needed)".into(),
            ));
        }
        self.head = None;
        self.next_tid = self.jsb.sequence;
        let f = self.jsb.features();
        // A chain record left by an earlier run was replayed (or was not ours to
        // replay) when the image was opened: it must not point at what we write now.
        let mut changed = EarlyRecord::from_sb(&self.jsb).is_some();
        EarlyRecord::store(None, &mut self.jsb);
        if metadata_csum && !f.csum_v3() {
            self.jsb.enable_csum_v3(is64);
            changed = true;
        } else if is64 && !f.is_64bit() {
            self.jsb.feature_incompat |= jbd2::INCOMPAT_64BIT;
            changed = true;
        }
        if changed {
            self.write_jsb(dev)?;
            dev.flush()?;
        }
        Ok(())
    }

    fn write_jsb(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.jsb.update_checksum();
        let mut b = vec![0u8; self.bs];
        dev.read_at(&mut b, self.map[0] * self.bs as u64)?;
        self.jsb.encode(&mut b[..jbd2::SB_SIZE])?;
        dev.write_at(&b, self.map[0] * self.bs as u64)?;
        Ok(())
    }

    /// Metadata blocks one transaction may carry (log size less descriptors and commit).
    pub(crate) fn max_blocks(&self) -> usize {
        self.max_blocks_with(0)
    }

    /// Metadata blocks one transaction that also carries `revokes` revoke records may
    /// carry.
    pub(crate) fn max_blocks_with(&self, revokes: usize) -> usize {
        let cap = (self.jsb.maxlen - self.jsb.first) as usize;
        let tpd = jbd2::tag_capacity(self.bs, &self.jsb.features()).max(1);
        let rb = self.revoke_blocks_for(revokes) as usize;
        cap.saturating_sub(2 + rb) * tpd / (tpd + 1)
    }

    /// Log blocks a transaction of `n` blocks takes: descriptors, the blocks, and its
    /// commit (or EARLY) block.
    fn log_blocks_for(&self, n: usize) -> u32 {
        let tpd = jbd2::tag_capacity(self.bs, &self.jsb.features()).max(1);
        (n.div_ceil(tpd) + n + 1) as u32
    }

    /// Revoke blocks `n` records take.
    fn revoke_blocks_for(&self, n: usize) -> u32 {
        let per = jbd2::revoke_capacity(self.bs, &self.jsb.features()).max(1);
        n.div_ceil(per) as u32
    }

    /// Whether the log holds no transaction (everything committed is home).
    pub(crate) fn log_is_empty(&self) -> bool {
        self.head.is_none()
    }

    /// Whether a transaction of `n` blocks and `revokes` revoke records fits after the
    /// transactions in the log; when it does not, the log must be checkpointed first.
    pub(crate) fn has_room(&self, n: usize, revokes: usize) -> bool {
        let need = u64::from(self.log_blocks_for(n)) + u64::from(self.revoke_blocks_for(revokes));
        self.head
            .is_none_or(|h| u64::from(h) + need <= u64::from(self.jsb.maxlen))
    }

    /// Write descriptors and `blocks` of transaction `tid` at log block `pos`;
    /// returns the log block after them.
    fn write_blocks(
        &self,
        out: &mut LogBatch,
        tid: u32,
        mut pos: u32,
        blocks: &[(u64, Arc<[u8]>)],
    ) -> Result<u32> {
        let fmt = self.fmt();
        let tpd = jbd2::tag_capacity(self.bs, &self.jsb.features()).max(1);
        for chunk in blocks.chunks(tpd) {
            let mut tags = Vec::with_capacity(chunk.len());
            let mut datas = Vec::with_capacity(chunk.len());
            for (home, data) in chunk {
                let mut copy = data.to_vec();
                let escaped = jbd2::escape(&mut copy);
                let csum = jbd2::tag_csum_field(&fmt, tid, &copy);
                let flags = if escaped { jbd2::TAG_FLAG_ESCAPE } else { 0 };
                tags.push(Tag {
                    blocknr: *home,
                    flags,
                    csum,
                });
                datas.push(copy);
            }
            let mut desc = vec![0u8; self.bs];
            let n = jbd2::encode_descriptor(&mut desc, tid, &tags, &self.jsb.uuid, &fmt)?;
            if n != tags.len() {
                return Err(Error::InvalidInput("descriptor capacity mismatch".into()));
            }
            out.put(self, pos, &desc)?;
            pos += 1;
            for d in &datas {
                out.put(self, pos, d)?;
                pos += 1;
            }
        }
        Ok(pos)
    }

    /// Write revoke blocks for `records` of transaction `tid` at log block `pos`;
    /// returns the log block after them.
    fn write_revokes(
        &self,
        out: &mut LogBatch,
        tid: u32,
        mut pos: u32,
        mut records: &[u64],
    ) -> Result<u32> {
        let fmt = self.fmt();
        let mut b = vec![0u8; self.bs];
        while !records.is_empty() {
            let n = jbd2::encode_revoke(&mut b, tid, records, &fmt)?;
            if n == 0 {
                return Err(Error::InvalidInput("revoke block holds no record".into()));
            }
            out.put(self, pos, &b)?;
            pos += 1;
            records = &records[n..];
        }
        Ok(pos)
    }

    /// Write the blocks changed since the last early commit to the log as an early
    /// commit (no flush: it survives a crash of this process, not of the machine;
    /// see `Early`). `boot_id` is this boot's. Caller holds the write lock and
    /// checkpointed a log that was not empty.
    pub(crate) fn early_commit(
        &mut self,
        dev: &dyn BlockDevice,
        blocks: &[(u64, Arc<[u8]>)],
        boot_id: &[u8; 16],
    ) -> Result<EarlyOutcome> {
        if self.head.is_some() {
            return Err(Error::InvalidInput(
                "early commit into a log that holds transactions".into(),
            ));
        }
        let first = self.jsb.first;
        let tid = self.next_tid;
        let next = self.early.as_ref().map_or(first, |e| e.next);
        let sums: Vec<u32> = blocks
            .iter()
            .map(|(_, d)| rext4_format::csum::raw(!0, d))
            .collect();
        let changed: Vec<(u64, Arc<[u8]>)> = blocks
            .iter()
            .zip(&sums)
            .filter(|((home, _), sum)| {
                self.early
                    .as_ref()
                    .and_then(|e| e.logged.get(home))
                    .is_none_or(|s| s != *sum)
            })
            .map(|(b, _)| b.clone())
            .collect();
        if changed.is_empty() {
            return Ok(EarlyOutcome::Nothing);
        }
        // Room for this and for the commit of everything that must follow it.
        let need = u64::from(self.log_blocks_for(changed.len()))
            + u64::from(self.log_blocks_for(blocks.len()));
        if u64::from(next) + need > u64::from(self.jsb.maxlen) {
            return Ok(EarlyOutcome::NoRoom);
        }
        if self.early.is_none() {
            // The record first: a crash before the chain is written finds no valid
            // transaction where it points.
            let rec = EarlyRecord {
                start: first,
                first_tid: tid,
                boot_id: *boot_id,
            };
            EarlyRecord::store(Some(&rec), &mut self.jsb);
            self.write_jsb(dev)?;
            self.early = Some(Early {
                next,
                logged: Default::default(),
            });
        }
        let mut out = LogBatch::new(dev);
        let pos = self.write_blocks(&mut out, tid, next, &changed)?;
        let mut eb = vec![0u8; self.bs];
        jbd2::encode_early(&mut eb, tid, boot_id, self.fmt().j_seed)?;
        out.put(self, pos, &eb)?;
        out.finish()?;
        self.next_tid = tid.wrapping_add(1);
        if let Some(e) = self.early.as_mut() {
            e.next = pos + 1;
            for ((home, _), sum) in blocks.iter().zip(&sums) {
                e.logged.insert(*home, *sum);
            }
        }
        Ok(EarlyOutcome::Written)
    }

    /// Write one transaction (its blocks and its revoke records) to the log and
    /// commit it (durable on return). It goes after the transactions in the log; into
    /// an empty log after a chain of early commits when there is room (a crash while it
    /// is written then still finds the chain), else from `s_first`, ending the chain
    /// first. Caller checked [`Journal::has_room`].
    pub(crate) fn commit(
        &mut self,
        dev: &dyn BlockDevice,
        blocks: &[(u64, Arc<[u8]>)],
        revokes: &[u64],
    ) -> Result<u32> {
        let fmt = self.fmt();
        if blocks.len() > self.max_blocks_with(revokes.len()) {
            return Err(Error::InvalidInput(
                "transaction larger than the journal".into(),
            ));
        }
        if !self.has_room(blocks.len(), revokes.len()) {
            return Err(Error::InvalidInput(
                "no room in the log for the transaction (checkpoint first)".into(),
            ));
        }
        let first = self.jsb.first;
        let maxlen = u64::from(self.jsb.maxlen);
        let need = u64::from(self.log_blocks_for(blocks.len()))
            + u64::from(self.revoke_blocks_for(revokes.len()));
        let tid = self.next_tid;
        let start = match (self.head, &self.early) {
            (Some(h), _) => h,
            (None, Some(e)) if u64::from(e.next) + need <= maxlen => e.next,
            (None, Some(_)) => {
                EarlyRecord::store(None, &mut self.jsb);
                first
            }
            (None, None) => first,
        };
        // Committed or not, the chain is over: its blocks are all in this transaction.
        self.early = None;
        let mut out = LogBatch::new(dev);
        let pos = self.write_blocks(&mut out, tid, start, blocks)?;
        let pos = self.write_revokes(&mut out, tid, pos, revokes)?;
        // The commit block's slot is zeroed first, made durable with the rest: the
        // commit record then differs from what is on disk only in its first sector, so
        // a torn commit write leaves either the whole record or none of it (a torn one
        // would read as a corrupt transaction, and recovery would refuse the log).
        out.put(self, pos, &vec![0u8; self.bs])?;
        out.finish()?;
        let commit_at = self.map[pos as usize] * self.bs as u64;
        // The revoke feature is set with the first revoke record, as jbd2 does.
        let revoke_feature =
            !revokes.is_empty() && self.jsb.feature_incompat & jbd2::INCOMPAT_REVOKE == 0;
        if revoke_feature {
            self.jsb.feature_incompat |= jbd2::INCOMPAT_REVOKE;
        }
        if self.head.is_none() || revoke_feature {
            if self.head.is_none() {
                self.jsb.start = start;
                self.jsb.sequence = tid;
            }
            self.write_jsb(dev)?;
        }
        dev.flush()?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // commit_sec must not go backwards (recovery tells stale from corrupt by it).
        let sec = now.as_secs().max(self.last_commit_sec);
        self.last_commit_sec = sec;
        let mut cb = vec![0u8; self.bs];
        CommitBlock::new(tid, sec, now.subsec_nanos()).encode(&mut cb, &fmt)?;
        dev.write_at(&cb, commit_at)?;
        dev.flush()?;
        self.head = Some(pos + 1);
        self.next_tid = tid.wrapping_add(1);
        Ok(tid)
    }

    /// The journal was aborted with `errno` (negative, as jbd2 stores it): record it
    /// in the journal superblock, durably, for recovery to mark the filesystem as
    /// having errors.
    pub(crate) fn record_abort(&mut self, dev: &dyn BlockDevice, errno: i32) -> Result<()> {
        self.jsb.errno = errno;
        self.write_jsb(dev)?;
        dev.flush()?;
        Ok(())
    }

    /// Every committed block is home and flushed: empty the log (and clear the record
    /// of a chain of early commits, which a commit had ended). The caller flushes.
    pub(crate) fn checkpointed(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.jsb.start = 0;
        self.jsb.sequence = self.next_tid;
        self.head = None;
        self.early = None;
        EarlyRecord::store(None, &mut self.jsb);
        self.write_jsb(dev)
    }
}

/// Log blocks on their way to the device: runs of blocks that follow each other on
/// the device (the journal is usually one extent) go in one write, not one each.
struct LogBatch<'d> {
    dev: &'d dyn BlockDevice,
    /// Device byte offset of `buf`'s first block.
    at: u64,
    buf: Vec<u8>,
}

impl<'d> LogBatch<'d> {
    /// At most this many bytes per write.
    const MAX: usize = 1 << 20;

    fn new(dev: &'d dyn BlockDevice) -> Self {
        LogBatch {
            dev,
            at: 0,
            buf: Vec::new(),
        }
    }

    /// Queue `block` for log block `pos` of `j`.
    fn put(&mut self, j: &Journal, pos: u32, block: &[u8]) -> Result<()> {
        let at = j.map[pos as usize] * j.bs as u64;
        if !self.buf.is_empty()
            && (self.at + self.buf.len() as u64 != at || self.buf.len() >= Self::MAX)
        {
            self.finish()?;
        }
        if self.buf.is_empty() {
            self.at = at;
        }
        self.buf.extend_from_slice(block);
        Ok(())
    }

    /// Write what is queued.
    fn finish(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            self.dev.write_at(&self.buf, self.at)?;
            self.buf.clear();
        }
        Ok(())
    }
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
