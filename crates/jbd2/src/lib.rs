//! rext4-jbd2: writing a jbd2 log, for a filesystem that journals its metadata
//! (format notes §2.12–13). It knows nothing of ext4 — not its superblock, inodes,
//! block maps or caches: the layer above hands it the log's blocks (the device block
//! of each log block, [`Log::open`]), a [`Device`] to write them on, and each
//! transaction as (home block, contents) pairs and revoke records. The on-disk
//! codecs and the recovery scanner are `rext4_format::jbd2`'s.
//!
//! A transaction is written after the transactions already in the log (or from its
//! start when it is empty): descriptor blocks with v3 tags (escaping blocks that begin
//! with the jbd2 magic), the blocks, revoke blocks, and — when the log was empty — the
//! journal superblock pointing at them (s_start, s_sequence); then a flush; then the
//! commit block, into a slot zeroed before that flush (so only its first sector
//! changes and a torn write cannot leave half a record), and a flush again. Log blocks
//! that follow each other on the device go out in one write (`LogBatch`). The log
//! never wraps: the caller checkpoints (writes the logged blocks home, flushes, then
//! [`Log::checkpointed`]) when [`Log::has_room`] says no. It ends where a fast-commit
//! area begins (`JournalSuperblock::log_last`), which is the kernel's to write.
//!
//! Early commits (rext4's own, for a crash of the process rather than the machine):
//! transactions written to an empty log without a flush, each ending in an EARLY block
//! that carries the boot id; the chain's start is recorded in the journal
//! superblock's padding ([`Log::early_commit`]).
//!
//! Recovery ([`recover`]) replays a log through the same two seams: the log's blocks
//! ([`LogMap`]) and a [`Device`].

mod recover;

pub use recover::{recover, LogMap, Recovery};

use std::sync::Arc;

use rext4_format::jbd2::{self, CommitBlock, EarlyRecord, JournalSuperblock, LogFormat, Tag};
use rext4_format::FormatError;

/// Where the log lives: positioned reads and writes in bytes, and a flush that makes
/// every completed write durable.
pub trait Device {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()>;
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()>;
    fn flush(&self) -> std::io::Result<()>;
}

/// Why a log operation failed.
#[derive(Debug)]
pub enum Error {
    Io(std::io::Error),
    /// A journal structure failed to decode or its checks.
    Format(FormatError),
    /// The journal does not fit what it is given (`block`: where, when known).
    Corrupted {
        what: String,
        block: Option<u64>,
    },
    /// A journal feature this writer does not know.
    Unsupported(String),
    /// A request the log cannot take (a transaction larger than the log, one with no
    /// room before a checkpoint, a log not empty when it must be).
    InvalidInput(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "I/O error: {e}"),
            Error::Format(e) => write!(f, "{e}"),
            Error::Corrupted {
                what,
                block: Some(b),
            } => write!(f, "corrupted metadata at block {b}: {what}"),
            Error::Corrupted { what, block: None } => write!(f, "corrupted metadata: {what}"),
            Error::Unsupported(m) | Error::InvalidInput(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<FormatError> for Error {
    fn from(e: FormatError) -> Self {
        Error::Format(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

pub struct Log {
    /// Where the log's blocks are on the device.
    map: Runs,
    jsb: JournalSuperblock,
    /// The block holding the journal superblock, as read at open (its bytes past the
    /// superblock are kept as they were when it is written again, without a read).
    jsb_block: Vec<u8>,
    bs: usize,
    last_commit_sec: u64,
    /// The time commit blocks carry instead of now ([`Log::set_fixed_time`]).
    fixed_time: Option<u64>,
    /// The log block after the last committed transaction; `None` while the log is
    /// empty (`s_start` 0).
    head: Option<u32>,
    /// tid of the next transaction (early or not).
    next_tid: u32,
    /// The chain of early commits since the last commit, if any (only ever started on
    /// an empty log).
    early: Option<Early>,
    /// Recovery left fast commits in the journal ([`Log::adopt_fast_commit_log`]): the
    /// superblock keeps saying so until the first commit replaces them.
    fast_commits_pending: bool,
}

/// A log's map: runs of log blocks on consecutive device blocks, in log order — the one
/// map of a journal's blocks (the engine's `JournalMap` finds them in the journal
/// inode and keeps them here; recovery and the log writer look them up here).
#[derive(Debug, Clone, Default)]
pub struct Runs {
    /// (first log block, first device block, length), sorted, not overlapping; log
    /// blocks between two runs are unmapped (a journal inode with a hole).
    runs: Vec<(u64, u64, u64)>,
    /// Log blocks there are: the end of the last run, or the length set by
    /// [`Runs::set_len`] (blocks past it are not looked up).
    blocks: u64,
}

impl Runs {
    /// The map of `blocks` (the device block of each log block).
    pub fn from_blocks(blocks: &[u64]) -> Runs {
        let mut r = Runs::default();
        for &p in blocks {
            r.push(p, 1);
        }
        r
    }

    /// The logical end of the last run.
    fn end(&self) -> u64 {
        self.runs.last().map_or(0, |r| r.0 + r.2)
    }

    /// Append `len` log blocks on device blocks `physical..`.
    pub fn push(&mut self, physical: u64, len: u64) {
        let at = self.end();
        self.push_run(at, physical, len);
    }

    /// Map log blocks `logical..logical+len` to device blocks `physical..`: runs come
    /// in log order (a run starting before the end of the last one is refused); a gap
    /// between them stays unmapped.
    pub fn push_at(&mut self, logical: u64, physical: u64, len: u64) -> Result<()> {
        if logical < self.end() {
            return Err(Error::Corrupted {
                what: format!("journal block {logical} is mapped twice"),
                block: None,
            });
        }
        self.push_run(logical, physical, len);
        Ok(())
    }

    fn push_run(&mut self, logical: u64, physical: u64, len: u64) {
        if len == 0 {
            return;
        }
        match self.runs.last_mut() {
            Some((l, p, n)) if *l + *n == logical && *p + *n == physical => *n += len,
            _ => self.runs.push((logical, physical, len)),
        }
        self.blocks = self.blocks.max(logical + len);
    }

    /// The log has `blocks` blocks (a journal inode's size): runs past it are not
    /// looked up, and blocks up to it that no run maps are holes.
    pub fn set_len(&mut self, blocks: u64) {
        self.blocks = blocks;
    }

    /// The first log block below the log's length that no run maps.
    pub fn first_hole(&self) -> Option<u64> {
        let mut next = 0;
        for &(l, _, n) in &self.runs {
            if next >= self.blocks {
                return None;
            }
            if l > next {
                return Some(next);
            }
            next = l + n;
        }
        (next < self.blocks).then_some(next)
    }

    /// The device block of log block `j`: the log's superblock geometry, checked at
    /// open against [`LogMap::blocks`] and [`Runs::first_hole`], keeps the log writer
    /// inside the mapped blocks.
    fn at(&self, j: u64) -> u64 {
        let i = self.runs.partition_point(|r| r.0 <= j);
        let (l, p, _) = self.runs[i.saturating_sub(1)];
        p + (j - l)
    }
}

impl LogMap for Runs {
    fn blocks(&self) -> u64 {
        self.blocks
    }
    fn physical(&self, j: u64) -> Result<u64> {
        let i = self.runs.partition_point(|r| r.0 <= j);
        match i.checked_sub(1).and_then(|i| self.runs.get(i)) {
            Some(&(l, p, n)) if j < l + n && j < self.blocks => Ok(p + (j - l)),
            _ => Err(Error::Corrupted {
                what: format!("journal block {j} is not mapped"),
                block: None,
            }),
        }
    }
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
pub enum EarlyOutcome {
    Written,
    /// Nothing changed since the last one.
    Nothing,
    /// The log has no room for it beside the commit that must follow: commit now.
    NoRoom,
}

impl Log {
    /// The log on the device blocks `map` (the device block of each log block, in
    /// order; the journal superblock is in the first): its superblock read, checked
    /// against the map and the block size `bs`, and its features known.
    pub fn open<D: Device + ?Sized>(dev: &D, map: Vec<u64>, bs: usize) -> Result<Log> {
        Self::open_runs(dev, Runs::from_blocks(&map), bs)
    }

    /// [`Self::open`] with the map as runs of consecutive device blocks (a journal
    /// of a million blocks is a handful of extents).
    pub fn open_runs<D: Device + ?Sized>(dev: &D, map: Runs, bs: usize) -> Result<Log> {
        let Ok(sb_at) = map.physical(0) else {
            return Err(Error::Corrupted {
                what: "journal of no blocks".into(),
                block: None,
            });
        };
        let (jsb, jsb_block) = recover::read_superblock_block(dev, &map, bs)?;
        if jsb.blocksize as usize != bs
            || (jsb.maxlen as u64) > map.blocks()
            || map.first_hole().is_some_and(|h| h < u64::from(jsb.maxlen))
            || jsb.first == 0
            || jsb.first >= jsb.maxlen
        {
            return Err(Error::Corrupted {
                what: "journal superblock geometry does not fit the journal's blocks".into(),
                block: Some(sb_at),
            });
        }
        let next_tid = jsb.sequence;
        Ok(Log {
            map,
            jsb,
            jsb_block,
            bs,
            last_commit_sec: 0,
            fixed_time: None,
            head: None,
            next_tid,
            early: None,
            fast_commits_pending: false,
        })
    }

    /// Stamp commit blocks with `secs` (seconds since the epoch, no nanoseconds)
    /// instead of the time of the commit: a reproducible image's log depends only on
    /// what was committed. `None`: the time of each commit.
    pub fn set_fixed_time(&mut self, secs: Option<u64>) {
        self.fixed_time = secs;
    }

    /// Take the log as recovery leaves it when fast commits remain to be replayed (no
    /// whole transaction; `s_start` where its scan ended, `s_sequence` the fast
    /// commits' transaction; see `recover`): empty for writing — the first commit gets
    /// that transaction's number and is written from `s_first`, replacing them in one
    /// step — but its superblock is left saying so until then. Before `prepare_rw`.
    pub fn adopt_fast_commit_log(&mut self) {
        self.fast_commits_pending = true;
    }

    fn fmt(&self) -> LogFormat {
        self.jsb.log_format()
    }

    /// Before the first write: upgrade the journal to 64bit + checksum v3 as the kernel
    /// does for a metadata_csum filesystem, and require an empty log.
    pub fn prepare_rw<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        metadata_csum: bool,
        is64: bool,
    ) -> Result<()> {
        if self.jsb.start != 0 && !self.fast_commits_pending {
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

    fn write_jsb<D: Device + ?Sized>(&mut self, dev: &D) -> Result<()> {
        self.jsb.update_checksum();
        self.jsb.encode(&mut self.jsb_block[..jbd2::SB_SIZE])?;
        dev.write_at(&self.jsb_block, self.map.at(0) * self.bs as u64)?;
        Ok(())
    }

    /// Metadata blocks one transaction may carry (log size less descriptors and commit).
    pub fn max_blocks(&self) -> usize {
        self.max_blocks_with(0)
    }

    /// Metadata blocks one transaction that also carries `revokes` revoke records may
    /// carry.
    pub fn max_blocks_with(&self, revokes: usize) -> usize {
        let cap = self.jsb.log_last().saturating_sub(self.jsb.first) as usize;
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

    /// Whether the log holds no transaction (everything committed is home) and its
    /// superblock says so (not the fast commits recovery left: a checkpoint empties it).
    pub fn log_is_empty(&self) -> bool {
        self.head.is_none() && !self.fast_commits_pending
    }

    /// Whether a transaction of `n` blocks and `revokes` revoke records fits after the
    /// transactions in the log; when it does not, the log must be checkpointed first.
    pub fn has_room(&self, n: usize, revokes: usize) -> bool {
        let need = u64::from(self.log_blocks_for(n)) + u64::from(self.revoke_blocks_for(revokes));
        self.head
            .is_none_or(|h| u64::from(h) + need <= u64::from(self.jsb.log_last()))
    }

    /// Write descriptors and `blocks` of transaction `tid` at log block `pos`;
    /// returns the log block after them.
    fn write_blocks<D: Device + ?Sized>(
        &self,
        out: &mut LogBatch<D>,
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
    fn write_revokes<D: Device + ?Sized>(
        &self,
        out: &mut LogBatch<D>,
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
    pub fn early_commit<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        blocks: &[(u64, Arc<[u8]>)],
        boot_id: &[u8; 16],
    ) -> Result<EarlyOutcome> {
        if self.head.is_some() {
            return Err(Error::InvalidInput(
                "early commit into a log that holds transactions".into(),
            ));
        }
        if self.fast_commits_pending {
            // The chain's record would not replace them: commit first.
            return Ok(EarlyOutcome::NoRoom);
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
        if u64::from(next) + need > u64::from(self.jsb.log_last()) {
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
    /// first. Caller checked [`Log::has_room`].
    pub fn commit<D: Device + ?Sized>(
        &mut self,
        dev: &D,
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
        // The log ends where a fast-commit area begins.
        let maxlen = u64::from(self.jsb.log_last());
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
        let commit_at = self.map.at(u64::from(pos)) * self.bs as u64;
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
        let now = match self.fixed_time {
            Some(t) => std::time::Duration::from_secs(t),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default(),
        };
        // commit_sec must not go backwards (recovery tells stale from corrupt by it).
        let sec = now.as_secs().max(self.last_commit_sec);
        self.last_commit_sec = sec;
        let mut cb = vec![0u8; self.bs];
        CommitBlock::new(tid, sec, now.subsec_nanos()).encode(&mut cb, &fmt)?;
        dev.write_at(&cb, commit_at)?;
        dev.flush()?;
        self.head = Some(pos + 1);
        self.next_tid = tid.wrapping_add(1);
        self.fast_commits_pending = false;
        Ok(tid)
    }

    /// The journal was aborted with `errno` (negative, as jbd2 stores it): record it
    /// in the journal superblock, durably, for recovery to mark the filesystem as
    /// having errors.
    pub fn record_abort<D: Device + ?Sized>(&mut self, dev: &D, errno: i32) -> Result<()> {
        self.jsb.errno = errno;
        self.write_jsb(dev)?;
        dev.flush()?;
        Ok(())
    }

    /// Every committed block is home and flushed: empty the log (and clear the record
    /// of a chain of early commits, which a commit had ended). The caller flushes.
    pub fn checkpointed<D: Device + ?Sized>(&mut self, dev: &D) -> Result<()> {
        self.fast_commits_pending = false;
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
struct LogBatch<'d, D: ?Sized> {
    dev: &'d D,
    /// Device byte offset of `buf`'s first block.
    at: u64,
    buf: Vec<u8>,
}

impl<'d, D: Device + ?Sized> LogBatch<'d, D> {
    /// At most this many bytes per write.
    const MAX: usize = 1 << 20;

    fn new(dev: &'d D) -> Self {
        LogBatch {
            dev,
            at: 0,
            buf: Vec::new(),
        }
    }

    /// Queue `block` for log block `pos` of `j`.
    fn put(&mut self, j: &Log, pos: u32, block: &[u8]) -> Result<()> {
        let at = j.map.at(u64::from(pos)) * j.bs as u64;
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

#[cfg(test)]
mod tests {
    //! The writer against the recovery scanner, on a device in memory: what `Log`
    //! writes is what `rext4_format::jbd2::Scanner` finds, revokes included.

    use super::*;
    use rext4_format::jbd2::{LogEnd, Scanner};
    use std::sync::Mutex;

    /// The map of a fragmented journal: runs merge where device blocks follow each
    /// other, every log block maps where the block list said, and nothing past it.
    #[test]
    fn runs_map_every_log_block_and_nothing_more() {
        let blocks: Vec<u64> = (100..140).chain(500..510).chain([7, 8, 9000]).collect();
        let r = Runs::from_blocks(&blocks);
        assert_eq!(r.runs.len(), 4, "{:?}", r.runs);
        assert_eq!(r.blocks(), blocks.len() as u64);
        for (j, &p) in blocks.iter().enumerate() {
            assert_eq!(r.physical(j as u64).expect("mapped"), p, "log block {j}");
        }
        assert!(r.physical(blocks.len() as u64).is_err());
        let mut pushed = Runs::default();
        pushed.push(100, 40);
        pushed.push(500, 10);
        pushed.push(7, 2);
        pushed.push(9000, 1);
        assert_eq!(pushed.runs, r.runs);
    }

    /// Runs placed by log block: a gap is a hole, a run before the last one's end is
    /// refused, the length cuts lookups off.
    #[test]
    fn runs_placed_by_log_block_keep_their_holes() {
        let mut r = Runs::default();
        r.push_at(0, 100, 4).expect("first");
        r.push_at(6, 200, 4).expect("after a gap");
        assert!(r.push_at(8, 300, 1).is_err(), "overlap");
        assert_eq!(r.blocks(), 10);
        assert_eq!(r.first_hole(), Some(4));
        assert_eq!(r.physical(3).expect("mapped"), 103);
        assert!(r.physical(4).is_err() && r.physical(5).is_err());
        assert_eq!(r.physical(7).expect("mapped"), 201);
        r.set_len(8);
        assert!(r.physical(8).is_err(), "past the length");
        r.set_len(12);
        assert!(r.physical(10).is_err(), "a hole at the end");
        let whole = Runs::from_blocks(&[5, 6, 7]);
        assert_eq!(whole.first_hole(), None);
    }

    const BS: usize = 1024;
    /// The log's first device block (a journal of one extent).
    const AT: u64 = 10;
    const LEN: usize = 1024;

    /// Bytes in memory; flushes counted.
    struct Mem {
        bytes: Mutex<Vec<u8>>,
        flushes: Mutex<usize>,
    }

    impl Device for Mem {
        fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
            let b = self.bytes.lock().expect("bytes");
            let off = off as usize;
            buf.copy_from_slice(&b[off..off + buf.len()]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
            let mut b = self.bytes.lock().expect("bytes");
            let off = off as usize;
            b[off..off + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            *self.flushes.lock().expect("flushes") += 1;
            Ok(())
        }
    }

    fn fresh() -> (Mem, Vec<u64>) {
        let mut jsb = JournalSuperblock::new(BS as u32, LEN as u32, [7; 16]);
        jsb.update_checksum();
        let mut bytes = vec![0u8; (AT as usize + LEN) * BS];
        let at = AT as usize * BS;
        jsb.encode(&mut bytes[at..at + jbd2::SB_SIZE])
            .expect("encode jsb");
        let map = (AT..AT + LEN as u64).collect();
        (
            Mem {
                bytes: Mutex::new(bytes),
                flushes: Mutex::new(0),
            },
            map,
        )
    }

    fn block(fill: u8) -> Arc<[u8]> {
        Arc::from(vec![fill; BS])
    }

    /// What recovery's scan finds in the log.
    fn scan(dev: &Mem, map: &[u64]) -> rext4_format::jbd2::ScanResult {
        let read = |log_block: u32| {
            let mut b = vec![0u8; BS];
            dev.read_at(&mut b, map[log_block as usize] * BS as u64)
                .expect("read");
            b
        };
        let jsb = JournalSuperblock::decode(&read(0)).expect("jsb");
        let mut s = Scanner::new(&jsb);
        while let Some(p) = s.next() {
            s.feed(&read(p.0));
        }
        s.finish().expect("scan")
    }

    #[test]
    fn what_the_log_writes_recovery_finds() {
        let (dev, map) = fresh();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let before = *dev.flushes.lock().expect("flushes");
        let t1 = log
            .commit(&dev, &[(500, block(1)), (501, block(2))], &[])
            .expect("commit 1");
        // The second transaction revokes block 500: t1's copy must not be replayed.
        let t2 = log
            .commit(&dev, &[(502, block(3))], &[500])
            .expect("commit 2");
        assert_eq!(t2, t1.wrapping_add(1));
        assert_eq!(
            *dev.flushes.lock().expect("flushes") - before,
            4,
            "two flushes per commit"
        );
        let r = scan(&dev, &map);
        let seqs: Vec<u32> = r.transactions.iter().map(|t| t.sequence).collect();
        assert_eq!(seqs, vec![t1, t2]);
        let plan: Vec<(u64, u32)> = r
            .replay_plan()
            .iter()
            .map(|w| (w.tag.blocknr, w.sequence))
            .collect();
        assert_eq!(plan, vec![(501, t1), (502, t2)], "block 500 is revoked");
        // Each planned block's log copy holds what was committed.
        for w in r.replay_plan() {
            let mut b = vec![0u8; BS];
            dev.read_at(&mut b, map[w.log_block.0 as usize] * BS as u64)
                .expect("read");
            let want = if w.tag.blocknr == 501 { 2 } else { 3 };
            assert!(b.iter().all(|&x| x == want), "block {}", w.tag.blocknr);
        }
        // Checkpointed: the log is empty for recovery.
        log.checkpointed(&dev).expect("checkpointed");
        let r = scan(&dev, &map);
        assert!(r.transactions.is_empty());
        assert!(matches!(r.end, LogEnd::Empty), "{:?}", r.end);
        assert!(log.log_is_empty());
    }

    #[test]
    fn a_transaction_the_log_cannot_hold_is_refused() {
        let (dev, map) = fresh();
        let mut log = Log::open(&dev, map, BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let n = log.max_blocks() + 1;
        let blocks: Vec<(u64, Arc<[u8]>)> = (0..n as u64).map(|b| (2000 + b, block(9))).collect();
        assert!(matches!(
            log.commit(&dev, &blocks, &[]),
            Err(Error::InvalidInput(_))
        ));
        // A map shorter than the superblock says: refused at open.
        let (dev, map) = fresh();
        assert!(matches!(
            Log::open(&dev, map[..LEN / 2].to_vec(), BS),
            Err(Error::Corrupted { .. })
        ));
    }

    #[test]
    fn recovery_replays_what_was_committed_and_empties_the_log() {
        let (dev, map) = fresh();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let t1 = log
            .commit(&dev, &[(500, block(1)), (501, block(2))], &[])
            .expect("commit 1");
        log.commit(&dev, &[(502, block(3))], &[500])
            .expect("commit 2");
        let home = |b: u64| {
            let mut buf = vec![0u8; BS];
            dev.read_at(&mut buf, b * BS as u64).expect("read");
            buf
        };
        // Without `write`: what a replay would do, nothing written.
        let dry = recover(&dev, map.as_slice(), BS, 4096, 256, false, None).expect("dry run");
        assert_eq!(
            (dry.transactions, dry.blocks_replayed, dry.revoke_hits),
            (2, 2, 1)
        );
        assert!(home(501).iter().all(|&x| x == 0));
        let r = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("recover");
        assert_eq!(r, dry);
        assert_eq!(r.first_sequence, t1);
        assert_eq!(r.new_sequence, t1.wrapping_add(3), "one tid skipped");
        assert!(home(500).iter().all(|&x| x == 0), "revoked block written");
        assert!(home(501).iter().all(|&x| x == 2));
        assert!(home(502).iter().all(|&x| x == 3));
        // The log is empty now: a second recovery finds nothing.
        let again = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("again");
        assert_eq!((again.transactions, again.end), (0, LogEnd::Empty));
        // A home block past the filesystem's end is corruption, and nothing is written.
        let (dev, map) = fresh();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        log.commit(&dev, &[(9000, block(5))], &[]).expect("commit");
        let e = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect_err("outside");
        assert!(e.to_string().contains("outside"), "{e}");
    }

    /// A journal of `LEN` log blocks and a fast-commit area of 64 after them.
    fn fresh_fc() -> (Mem, Vec<u64>) {
        const FC: u32 = 64;
        let mut jsb = JournalSuperblock::new(BS as u32, LEN as u32 + FC, [7; 16]);
        jsb.feature_incompat |= jbd2::INCOMPAT_FAST_COMMIT;
        jsb.num_fc_blks = FC;
        jsb.enable_csum_v3(true);
        let total = LEN + FC as usize;
        let mut bytes = vec![0u8; (AT as usize + total) * BS];
        let at = AT as usize * BS;
        jsb.encode(&mut bytes[at..at + jbd2::SB_SIZE])
            .expect("encode jsb");
        let map = (AT..AT + total as u64).collect();
        (
            Mem {
                bytes: Mutex::new(bytes),
                flushes: Mutex::new(0),
            },
            map,
        )
    }

    /// The log of a fast-commit journal ends where the area begins: transactions
    /// fill the log up to it and never touch it.
    #[test]
    fn the_log_leaves_the_fast_commit_area_alone() {
        let (dev, map) = fresh_fc();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let mut n = 0u64;
        while log.has_room(100, 0) {
            let blocks: Vec<(u64, Arc<[u8]>)> = (0..100).map(|b| (3000 + b, block(0xAB))).collect();
            log.commit(&dev, &blocks, &[]).expect("commit");
            n += 1;
        }
        assert!(n >= 9, "{n} transactions");
        let b = dev.bytes.lock().expect("bytes");
        let area = &b[(AT as usize + LEN) * BS..];
        assert!(area.iter().all(|&x| x == 0), "the log wrote into the area");
    }

    /// Fast commits of the first transaction not in the log: recovery replays the log,
    /// returns the fast commits and leaves the journal needing them (a second recovery
    /// finds them again); the filesystem's first commit then replaces them.
    #[test]
    fn fast_commits_are_returned_and_replaced_by_the_next_commit() {
        use rext4_format::extent::Extent;
        use rext4_format::fast_commit::{Tag, Writer, TAG_CREAT};
        let (dev, map) = fresh_fc();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let t1 = log.commit(&dev, &[(500, block(1))], &[]).expect("commit");
        // The kernel's fast commits of t1 + 1, at log_last + 1.
        let mut w = Writer::new(BS, t1 + 1);
        w.inode(20, &[0u8; 160]);
        w.add_range(
            20,
            &Extent {
                logical: 0,
                len: 3,
                physical: 700,
                unwritten: false,
            },
        );
        w.dentry(TAG_CREAT, 2, 20, b"new");
        w.tail();
        for (k, blk) in w.blocks().iter().enumerate() {
            dev.write_at(blk, map[LEN + 1 + k] * BS as u64)
                .expect("write fc");
        }
        let r = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("recover");
        assert_eq!((r.transactions, r.fast_commit_count), (1, 1));
        let names: Vec<&str> = r.fast_commits.iter().map(Tag::name).collect();
        assert_eq!(names, ["HEAD", "INODE", "ADD_RANGE", "CREAT", "TAIL"]);
        assert_eq!(r.new_sequence, t1 + 1, "the journal waits for t1 + 1");
        let again = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("again");
        assert_eq!((again.transactions, again.fast_commits.len()), (0, 5));
        // The filesystem replays them and commits: its first transaction is t1 + 1.
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        assert!(log.prepare_rw(&dev, true, true).is_err(), "not empty");
        log.adopt_fast_commit_log();
        log.prepare_rw(&dev, true, true).expect("prepare");
        assert!(!log.log_is_empty());
        let t2 = log.commit(&dev, &[(501, block(2))], &[]).expect("commit");
        assert_eq!(t2, t1 + 1);
        let r = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("recover");
        assert_eq!((r.transactions, r.fast_commits.len()), (1, 0));
        // A checkpoint of a log whose fast commits changed nothing empties it too.
        let (dev, map) = fresh_fc();
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.prepare_rw(&dev, true, true).expect("prepare");
        let t = log.commit(&dev, &[(500, block(1))], &[]).expect("commit");
        let mut w = Writer::new(BS, t + 1);
        w.tail();
        dev.write_at(&w.blocks()[0], map[LEN + 1] * BS as u64)
            .expect("write fc");
        recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("recover");
        let mut log = Log::open(&dev, map.clone(), BS).expect("open");
        log.adopt_fast_commit_log();
        log.prepare_rw(&dev, true, true).expect("prepare");
        log.checkpointed(&dev).expect("checkpointed");
        let r = recover(&dev, map.as_slice(), BS, 4096, 256, true, None).expect("recover");
        assert_eq!((r.transactions, r.fast_commits.len()), (0, 0));
    }
}
