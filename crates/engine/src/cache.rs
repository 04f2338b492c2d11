//! Metadata buffer cache: whole filesystem blocks keyed by physical block number,
//! verified on read.
//!
//! A block is verified once per [`Kind`] it is read as: a corrupted image can make one
//! block look like both an extent node and a directory block, and each use must pass its
//! own verifier before its bytes are trusted. Buffers are shared `Arc<[u8]>`, and one
//! that anybody else holds (a reader, a commit writing it, the logged copy the
//! checkpoint writes) never changes: a write replaces the buffer, so readers holding
//! the old one keep a consistent copy. [`BufferCache::update`] changes a buffer in
//! place only while the cache holds the only reference, under its shard's mutex (no
//! reader can take it meanwhile). The cache is bounded by a block count and drops
//! arbitrary clean entries when full; dirty entries stay until [`BufferCache::flush`]
//! writes them. `write` and `update` are the only places where a metadata buffer is
//! declared dirty.
//!
//! With a journal a block has three states: *dirty* (changed by the running
//! transaction), *logged* (its last committed contents are in the log but not yet at
//! home: the journal's checkpoint list, kept here as the committed buffer) and clean.
//! A block can be dirty and logged at once (changed again after its commit); the
//! checkpoint writes the committed contents, never the running transaction's. Neither
//! dirty nor logged blocks are dropped when the cache is full: the device holds older
//! contents. A logged block that is freed ([`BufferCache::forget`]) is remembered as
//! *revoked*: the next commit carries a revoke record for it, so that recovery never
//! writes its logged copy over whatever the block is reused for.
//!
//! Journaled file data (`fs::data_io`: an fsync's few new blocks) lives here too, as
//! entries marked `file_data`: dirty, logged and revoked like metadata, never dropped
//! for room, and dropped by [`BufferCache::log_emptied`] once home (written by the
//! checkpoint, unchanged since). While held, the data paths read the block through
//! [`BufferCache::data_blocks`] and change it with [`BufferCache::update_data`].
//!
//! Locking: the map is split in [`SHARDS`] shards by block number, each behind its own
//! mutex (the state of a block — contents, dirty, logged, revoked, committing — is all
//! in its shard, so every rule above is per shard); no shard mutex is held across
//! device I/O or while another is taken. One `update` is atomic by itself (under the
//! shard's mutex: inode records are put into their table block that way); a caller's
//! read-modify-write of a block in separate steps (read, change a copy, `write`) is
//! atomic only under whatever keeps other writers of that block out: the inode lock of
//! the one inode a block belongs to (directory and extent blocks), the group mutex
//! (bitmaps), or `Fs::block_lock` for blocks inodes share (xattr blocks; a directory
//! leaf changed under a shared directory lock).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::inthash::{IntMap, IntSet};

/// What a block is being read as; each kind has its own verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    Raw = 0,
    GroupDesc = 1,
    Bitmap = 2,
    InodeTable = 3,
    ExtentNode = 4,
    DirLeaf = 5,
    DirIndex = 6,
    Xattr = 7,
    Indirect = 8,
    Symlink = 9,
}

thread_local! {
    /// Metadata reads of this thread that failed in [`BufferCache::read`]: device
    /// errors, and blocks that failed their checks.
    static READ_ERRORS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Metadata writes of this thread accepted by [`BufferCache::write`].
    static WRITES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many metadata writes this thread made (compare two readings: whether an
/// operation changed metadata, whatever other threads did meanwhile).
pub fn thread_writes() -> u64 {
    WRITES.with(|c| c.get())
}

/// How many metadata reads of this thread have failed, by a device error or a failed
/// check (compare two readings: an operation that failed to read after it changed
/// something aborts).
pub fn thread_read_errors() -> u64 {
    READ_ERRORS.with(|c| c.get())
}

struct Entry {
    data: Arc<[u8]>,
    verified: u32,
    /// Changed by the running transaction: must be committed before it may be dropped.
    dirty: bool,
    /// Committed contents not yet written home (the checkpoint's to write).
    logged: Option<Arc<[u8]>>,
    /// File data journaled by an fsync ([`BufferCache::put_data`]): its home holds
    /// older bytes until the checkpoint, so data reads and writes of the block go
    /// through this entry (`data_blocks`, `update_data`) until the log is emptied.
    file_data: bool,
}

impl Entry {
    /// Contents as read or verified: clean, not logged.
    fn clean(data: Arc<[u8]>) -> Entry {
        Entry {
            data,
            verified: 0,
            dirty: false,
            logged: None,
            file_data: false,
        }
    }

    fn droppable(&self) -> bool {
        !self.dirty && self.logged.is_none() && !self.file_data
    }
}

/// Shards of the map: threads working on different blocks rarely meet.
pub const SHARDS: usize = 16;

/// A value alone on its cache line: a counter or lock every thread writes must not
/// slow the reads (or the writes) of its neighbours.
#[repr(align(64))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What a shard's mutex guards: the blocks whose number is the shard's modulo
/// [`SHARDS`].
#[derive(Default)]
struct Blocks {
    map: IntMap<u64, Entry>,
    /// Logged blocks freed since the last commit: its revoke records.
    revoked: std::collections::BTreeSet<u64>,
    /// Blocks of the transaction being committed (`begin_commit`) not yet marked
    /// logged: one freed meanwhile is revoked too, and is not marked logged after.
    committing: IntSet<u64>,
    /// Every block of the transaction being committed (until `end_commit`).
    commit_all: IntSet<u64>,
    /// Committed contents of logged blocks freed by a transaction that is not
    /// committed yet: a checkpoint before that commit still writes them home (the
    /// committed state, which a crash then recovers to, still uses them); once the
    /// freeing transaction's revoke records are committed they are dropped
    /// (`revokes_committed`), before the blocks may be reused.
    freed_logged: IntMap<u64, Arc<[u8]>>,
    /// Map size at which the next eviction scan runs (raised when a scan finds too few
    /// clean entries, so a shard full of dirty blocks is not rescanned on every insert).
    scan_at: usize,
}

pub struct BufferCache {
    dev: Arc<dyn BlockDevice>,
    block_size: usize,
    blocks_count: u64,
    cap: usize,
    /// Each shard's share of `cap`.
    shard_cap: usize,
    shards: Box<[Padded<Mutex<Blocks>>]>,
    dirty: Padded<AtomicUsize>,
    logged: Padded<AtomicUsize>,
    /// Entries holding journaled file data (0: data reads and writes skip the cache).
    data: Padded<AtomicUsize>,
    /// Bumped by every accepted write (whether something changed since a moment).
    writes: crate::striped::Counter,
    /// Failed metadata reads (`errors_seen`).
    errors: Padded<std::sync::atomic::AtomicU64>,
}

impl BufferCache {
    pub fn new(
        dev: Arc<dyn BlockDevice>,
        block_size: usize,
        blocks_count: u64,
        cap: usize,
    ) -> Self {
        let cap = cap.max(16);
        let shard_cap = (cap / SHARDS).max(4);
        BufferCache {
            dev,
            block_size,
            blocks_count,
            cap,
            shard_cap,
            shards: (0..SHARDS)
                .map(|_| {
                    Padded(Mutex::new(Blocks {
                        scan_at: shard_cap,
                        ..Blocks::default()
                    }))
                })
                .collect(),
            dirty: Padded::default(),
            logged: Padded::default(),
            data: Padded::default(),
            writes: Default::default(),
            errors: Padded::default(),
        }
    }

    /// The shard of block `blk`, locked.
    fn at(&self, blk: u64) -> MutexGuard<'_, Blocks> {
        self.shards[(blk % SHARDS as u64) as usize]
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Every shard in turn, locked (one at a time).
    fn each(&self, mut f: impl FnMut(&mut Blocks)) {
        for sh in self.shards.iter() {
            f(&mut sh.0.lock().unwrap_or_else(|p| p.into_inner()));
        }
    }

    /// Metadata reads that failed, by a device error or a failed check, since the
    /// cache was made (the filesystem marks itself with errors from it: `Inner::settle_errors`).
    pub fn errors_seen(&self) -> u64 {
        self.errors.0.load(Ordering::SeqCst)
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Read block `blk`, checking it with `verify` the first time it is read as `kind`.
    pub fn read(
        &self,
        blk: u64,
        kind: Kind,
        verify: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<Arc<[u8]>> {
        if blk >= self.blocks_count {
            return Err(Error::corrupted(
                format!(
                    "{kind:?} block {blk} is past the end of the filesystem ({})",
                    self.blocks_count
                ),
                Some(blk),
            ));
        }
        let bit = 1u32 << (kind as u32);
        let cached = {
            let map = self.at(blk);
            map.map
                .get(&blk)
                .map(|e| (e.data.clone(), e.verified & bit != 0))
        };
        let data = match cached {
            Some((d, true)) => return Ok(d),
            Some((d, false)) => d,
            None => {
                let mut v = vec![0u8; self.block_size];
                if let Err(e) = self.dev.read_at(&mut v, blk * self.block_size as u64) {
                    self.count_read_error();
                    return Err(e.into());
                }
                Arc::from(v)
            }
        };
        verify(&data).map_err(|e| match e {
            Error::Corrupted { what, block } => {
                // Corruption found on the way counts as a failed read: an operation
                // that changed metadata before it aborts (`WriteGuard`).
                self.count_read_error();
                Error::Corrupted {
                    what,
                    block: block.or(Some(blk)),
                }
            }
            other => other,
        })?;
        let mut guard = self.at(blk);
        let map = &mut *guard;
        self.make_room(map);
        let e = map.map.entry(blk).or_insert(Entry::clean(data.clone()));
        e.verified |= bit;
        Ok(e.data.clone())
    }

    /// A failed metadata read (a device error, or a block that failed its check):
    /// counted for this thread and for the filesystem (`errors_seen`).
    fn count_read_error(&self) {
        READ_ERRORS.with(|c| c.set(c.get() + 1));
        self.errors.0.fetch_add(1, Ordering::SeqCst);
    }

    /// Cache `data` as block `blk`'s clean contents, unless the block is cached
    /// already (bytes read for another purpose that hold a whole block).
    pub fn insert_clean(&self, blk: u64, data: &[u8]) {
        if blk < self.blocks_count && data.len() == self.block_size {
            self.cache_clean(blk, Arc::from(data));
        }
    }

    /// Cache `data` as block `blk`'s clean contents unless it is cached already;
    /// returns what the cache holds for it.
    fn cache_clean(&self, blk: u64, data: Arc<[u8]>) -> Arc<[u8]> {
        let mut guard = self.at(blk);
        let map = &mut *guard;
        self.make_room(map);
        map.map
            .entry(blk)
            .or_insert(Entry::clean(data))
            .data
            .clone()
    }

    /// Whether block `blk` is cached (whatever its state): reading it costs no I/O.
    pub fn contains(&self, blk: u64) -> bool {
        self.at(blk).map.contains_key(&blk)
    }

    /// Blocks `blks` (in any order), as [`Self::read`] would return them unverified:
    /// the ones not cached are read in few large requests — runs of adjacent blocks,
    /// at most `max_run` blocks each, all issued together
    /// ([`BlockDevice::read_many`]) — and cached clean (a block cached meanwhile keeps
    /// its entry). Returns the contents in the order of `blks` and how many requests
    /// it issued. Used where many known blocks are needed at once: the descriptor
    /// table at open, a batch of block bitmaps.
    pub fn read_batch(&self, blks: &[u64], max_run: usize) -> Result<(Vec<Arc<[u8]>>, usize)> {
        if let Some(&b) = blks.iter().find(|&&b| b >= self.blocks_count) {
            return Err(Error::corrupted(
                format!(
                    "block {b} is past the end of the filesystem ({})",
                    self.blocks_count
                ),
                Some(b),
            ));
        }
        let mut missing: Vec<u64> = blks
            .iter()
            .copied()
            .filter(|&b| !self.contains(b))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let bs = self.block_size;
        // Runs of adjacent missing blocks, each one request.
        let mut runs: Vec<(u64, usize)> = Vec::new();
        for &b in &missing {
            match runs.last_mut() {
                Some((s, n)) if *s + *n as u64 == b && *n < max_run.max(1) => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        let mut bufs: Vec<Vec<u8>> = runs.iter().map(|&(_, n)| vec![0u8; n * bs]).collect();
        {
            let mut reqs: Vec<(u64, &mut [u8])> = runs
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(s, _), b)| (s * bs as u64, b.as_mut_slice()))
                .collect();
            if let Err(e) = self.dev.read_many(&mut reqs) {
                self.count_read_error();
                return Err(e.into());
            }
        }
        let mut got: IntMap<u64, Arc<[u8]>> = IntMap::default();
        for (&(s, n), buf) in runs.iter().zip(&bufs) {
            for i in 0..n {
                let blk = s + i as u64;
                got.insert(
                    blk,
                    self.cache_clean(blk, Arc::from(&buf[i * bs..(i + 1) * bs])),
                );
            }
        }
        let out = blks
            .iter()
            .map(|&b| match got.get(&b) {
                Some(d) => Ok(d.clone()),
                None => self.read(b, Kind::Raw, |_| Ok(())),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((out, runs.len()))
    }

    /// Drop clean entries when the shard is full (dirty and logged ones stay until
    /// committed and written home).
    fn make_room(&self, b: &mut Blocks) {
        let map = &mut b.map;
        if map.len() < b.scan_at {
            return;
        }
        let want = (self.shard_cap / 4).max(1);
        let victims: Vec<u64> = map
            .iter()
            .filter(|(_, e)| e.droppable())
            .map(|(k, _)| *k)
            .take(want)
            .collect();
        for v in &victims {
            map.remove(v);
        }
        b.scan_at = if victims.len() < want {
            map.len() + want
        } else {
            self.shard_cap
        };
    }

    /// Whether so many blocks are dirty or waiting for their checkpoint that they
    /// should be committed (and written home) now.
    pub fn wants_writeback(&self) -> bool {
        self.dirty.0.load(Ordering::Relaxed) + self.logged.0.load(Ordering::Relaxed) > self.cap / 2
    }

    /// Whether the logged blocks take so much of the cache that the checkpoint should
    /// write them home now.
    pub fn wants_checkpoint(&self) -> bool {
        self.logged.0.load(Ordering::Relaxed) > self.cap / 4
    }

    /// Replace block `blk` with `data` and mark it dirty: the one place where a metadata
    /// buffer is declared dirty (the journal will attach it to the running transaction
    /// here). `verify` checks the new contents before they are accepted (verify before
    /// write); they count as verified for `kind` afterwards.
    pub fn write(
        &self,
        blk: u64,
        kind: Kind,
        data: impl AsRef<[u8]>,
        verify: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let data = data.as_ref();
        if blk >= self.blocks_count || data.len() != self.block_size {
            return Err(Error::InvalidInput(format!(
                "metadata write of {} bytes to block {blk} outside the filesystem",
                data.len()
            )));
        }
        verify(data).map_err(|e| match e {
            Error::Corrupted { what, .. } => Error::Corrupted {
                what: format!("refusing to write bad {kind:?} block: {what}"),
                block: Some(blk),
            },
            other => other,
        })?;
        self.put(blk, kind, Arc::from(data));
        Ok(())
    }

    /// Change block `blk`: `f` gets the current contents (read as `kind`, unverified)
    /// to change, and they become the block's, dirty. When the cache holds the only
    /// reference to them — no reader, no commit writing them, no logged copy (the
    /// checkpoint's) — they are changed where they are; otherwise a copy is changed and
    /// replaces them (the frozen copy of jbd2: what a commit or a reader holds never
    /// changes), one copy where a read, a change and a `write` take two. Either way
    /// under the shard's mutex (so `f` must not use the cache), as one step: changes
    /// of different bytes of one block by threads that do not exclude each other (the
    /// records of an inode-table block) all land. `f` must fail, if it fails, before
    /// it changes anything. A caller that reads, decides and then changes in separate
    /// steps keeps other writers of the block out itself (see the module note).
    pub fn update<R>(
        &self,
        blk: u64,
        kind: Kind,
        f: impl FnOnce(&mut [u8]) -> Result<R>,
    ) -> Result<R> {
        match self.update_if(blk, kind, |b| f(b).map(Some))? {
            Some(r) => Ok(r),
            None => Err(Error::InvalidInput("a change made nothing".into())),
        }
    }

    /// [`BufferCache::update`] with a change that may find nothing to do: `f` returns
    /// `None` when it left the contents alone, and the block stays as it was (not
    /// dirtied).
    pub fn update_if<R>(
        &self,
        blk: u64,
        kind: Kind,
        f: impl FnOnce(&mut [u8]) -> Result<Option<R>>,
    ) -> Result<Option<R>> {
        // The change is one step under the shard's mutex, in place or on a copy, so
        // two changes of one block (to different bytes of it) never lose one another.
        // A block not cached is read in first (device I/O, without the mutex; `read`
        // caches it), then looked for again: what was read is not put back by hand, as
        // another thread's change may have been committed, written home and dropped
        // meanwhile (the device then holds it, and the next read gets it).
        loop {
            let mut guard = self.at(blk);
            if guard.map.contains_key(&blk) {
                return self.change_entry(&mut guard, blk, kind, f);
            }
            drop(guard);
            drop(self.read(blk, kind, |_| Ok(()))?);
        }
    }

    /// [`BufferCache::update_if`]'s change of cached block `blk` (in its shard `b`,
    /// locked).
    fn change_entry<R>(
        &self,
        b: &mut Blocks,
        blk: u64,
        kind: Kind,
        f: impl FnOnce(&mut [u8]) -> Result<Option<R>>,
    ) -> Result<Option<R>> {
        let e = b
            .map
            .get_mut(&blk)
            .ok_or_else(|| Error::InvalidInput("a change of a block not cached".into()))?;
        let r = match Arc::get_mut(&mut e.data) {
            Some(buf) => f(buf)?,
            None => {
                let mut new: Arc<[u8]> = Arc::from(&e.data[..]);
                let r = f(Arc::get_mut(&mut new)
                    .ok_or_else(|| Error::InvalidInput("a fresh buffer is shared".into()))?)?;
                if r.is_some() {
                    e.data = new;
                }
                r
            }
        };
        if r.is_some() {
            self.dirtied(b, blk, kind);
        }
        Ok(r)
    }

    /// Store `data` as the dirty contents of `blk`, verified as `kind`.
    fn put(&self, blk: u64, kind: Kind, data: Arc<[u8]>) {
        let mut guard = self.at(blk);
        let b = &mut *guard;
        self.make_room(b);
        match b.map.get_mut(&blk) {
            Some(e) => {
                e.data = data;
                if std::mem::take(&mut e.file_data) {
                    self.data.0.fetch_sub(1, Ordering::Relaxed);
                }
            }
            None => {
                b.map.insert(blk, Entry::clean(data));
            }
        }
        self.dirtied(b, blk, kind);
    }

    /// Journal `contents` as the new data of file block `blk` (an fsync's small
    /// write, see `jwrite`): dirty like metadata, committed to the log, written home
    /// by the checkpoint; until then the home holds older bytes, and the data paths
    /// read and change the block here ([`BufferCache::data_blocks`],
    /// [`BufferCache::update_data`]).
    pub fn put_data(&self, blk: u64, contents: &[u8]) -> Result<()> {
        if blk >= self.blocks_count || contents.len() != self.block_size {
            return Err(Error::InvalidInput(format!(
                "data journal write of {} bytes to block {blk} outside the filesystem",
                contents.len()
            )));
        }
        let mut guard = self.at(blk);
        let b = &mut *guard;
        self.make_room(b);
        let e = match b.map.entry(blk) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry::clean(Arc::from(contents)))
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let e = o.into_mut();
                match Arc::get_mut(&mut e.data) {
                    Some(buf) => buf.copy_from_slice(contents),
                    None => e.data = Arc::from(contents),
                }
                e
            }
        };
        if !std::mem::replace(&mut e.file_data, true) {
            self.data.0.fetch_add(1, Ordering::Relaxed);
        }
        self.dirtied(b, blk, Kind::Raw);
        Ok(())
    }

    /// Write `bytes` at byte `at` of file block `blk` if the block's data is
    /// journaled (held here); `false` when it is not, and the caller writes home.
    pub fn update_data(&self, blk: u64, at: usize, bytes: &[u8]) -> Result<bool> {
        if at
            .checked_add(bytes.len())
            .is_none_or(|end| end > self.block_size)
        {
            return Err(Error::InvalidInput(format!(
                "data write of {} bytes at {at} of block {blk}",
                bytes.len()
            )));
        }
        if self.data.0.load(Ordering::Acquire) == 0 {
            return Ok(false);
        }
        let mut guard = self.at(blk);
        if !guard.map.get(&blk).is_some_and(|e| e.file_data) {
            return Ok(false);
        }
        self.change_entry(&mut guard, blk, Kind::Raw, |b| {
            b[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(Some(()))
        })?;
        Ok(true)
    }

    /// The journaled data held for blocks `blk..blk+n` (see [`BufferCache::put_data`]):
    /// a data read takes these first, then reads the device, then lays these over
    /// what it read (an entry dropped meanwhile was written home before it went).
    pub fn data_blocks(&self, blk: u64, n: u64) -> Vec<(u64, Arc<[u8]>)> {
        if self.data.0.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut v = Vec::new();
        for k in blk..blk.saturating_add(n) {
            if let Some(e) = self.at(k).map.get(&k).filter(|e| e.file_data) {
                v.push((k, e.data.clone()));
            }
        }
        v
    }

    /// Entries holding journaled file data.
    pub fn data_count(&self) -> usize {
        self.data.0.load(Ordering::Relaxed)
    }

    /// The cached contents of `blk` (in `b`, its shard) were just changed: they are
    /// dirty, verified as `kind` only, and count as a write.
    fn dirtied(&self, b: &mut Blocks, blk: u64, kind: Kind) {
        // Logged again: this transaction's copy is replayed after the older ones, so
        // the revoke of a freed and reused block is withdrawn (as jbd2 cancels one).
        b.revoked.remove(&blk);
        if let Some(e) = b.map.get_mut(&blk) {
            if !e.dirty {
                self.dirty.0.fetch_add(1, Ordering::Relaxed);
            }
            e.verified = 1 << (kind as u32);
            e.dirty = true;
        }
        self.writes.add(1);
        WRITES.with(|c| c.set(c.get() + 1));
    }

    /// How many writes were accepted so far (compare two readings to know whether
    /// anything was written in between).
    pub fn write_count(&self) -> u64 {
        self.writes.sum()
    }

    /// Write every dirty block to the device, in block order. Blocks stay cached.
    pub fn flush(&self) -> Result<usize> {
        let dirty = self.dirty_blocks();
        self.flush_these(&dirty)?;
        Ok(dirty.len())
    }

    /// Drop blocks `start..start+len` from the cache, dirty or logged or not: they were
    /// freed, so no older contents may later be written over whatever they are reused
    /// for. Logged ones become revoked (see the module note).
    pub fn forget(&self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        if len <= 64 {
            for blk in start..end {
                self.forget_in(&mut self.at(blk), |f| {
                    f(blk);
                });
            }
        } else {
            self.each(|b| {
                let gone: Vec<u64> = b
                    .map
                    .keys()
                    .copied()
                    .filter(|&k| k >= start && k < end)
                    .collect();
                // Blocks being committed need not be cached (a clean one evicted).
                let committing: Vec<u64> = b
                    .committing
                    .iter()
                    .copied()
                    .filter(|&k| k >= start && k < end && !b.map.contains_key(&k))
                    .collect();
                self.forget_in(b, |f| {
                    for k in gone.iter().chain(&committing) {
                        f(*k);
                    }
                });
            });
        }
    }

    /// Forget, in one shard, each block `blocks` names.
    fn forget_in(&self, b: &mut Blocks, blocks: impl FnOnce(&mut dyn FnMut(u64))) {
        let mut dropped_dirty = 0;
        let mut logged_gone = 0;
        let mut data_gone = 0;
        let mut gone = |blk: u64| {
            let e = b.map.remove(&blk);
            if let Some(e) = &e {
                if e.dirty {
                    dropped_dirty += 1;
                }
                if e.file_data {
                    data_gone += 1;
                }
                if let Some(d) = &e.logged {
                    logged_gone += 1;
                    b.freed_logged.insert(blk, d.clone());
                }
            }
            // Both: the committing set must lose the block either way.
            let logged = e.as_ref().is_some_and(|e| e.logged.is_some());
            if b.committing.remove(&blk) | logged {
                b.revoked.insert(blk);
            }
        };
        blocks(&mut gone);
        self.dirty.0.fetch_sub(dropped_dirty, Ordering::Relaxed);
        self.logged.0.fetch_sub(logged_gone, Ordering::Relaxed);
        self.data.0.fetch_sub(data_gone, Ordering::Relaxed);
    }

    /// The revoke records of the next commit (logged blocks freed since the last one);
    /// they are handed over, so the set is empty afterwards.
    pub fn take_revoked(&self) -> Vec<u64> {
        let mut v = Vec::new();
        self.each(|b| v.extend(std::mem::take(&mut b.revoked)));
        v.sort_unstable();
        v
    }

    /// A commit of these blocks begins (they may change or be freed while it is
    /// written; see `committing`).
    pub fn begin_commit(&self, blocks: &[(u64, Arc<[u8]>)]) {
        let mut i = 0;
        self.each(|b| {
            b.committing = blocks
                .iter()
                .map(|(k, _)| *k)
                .filter(|k| (k % SHARDS as u64) as usize == i)
                .collect();
            b.commit_all = b.committing.clone();
            i += 1;
        });
    }

    /// The commit is over (done or failed).
    pub fn end_commit(&self) {
        self.each(|b| {
            b.committing.clear();
            b.commit_all.clear();
        });
    }

    /// These blocks were committed (they are in the log): they wait for the checkpoint
    /// with these contents, and are clean unless changed since. Blocks freed since
    /// `begin_commit` are left alone (their revoke records are on their way).
    pub fn committed(&self, blocks: &[(u64, Arc<[u8]>)]) {
        for (blk, data) in blocks {
            let mut guard = self.at(*blk);
            let map = &mut *guard;
            if !map.committing.remove(blk) {
                // Freed while the commit was written: these committed contents go
                // home at a checkpoint until the free is committed.
                map.freed_logged.insert(*blk, data.clone());
                continue;
            }
            if let Some(e) = map.map.get_mut(blk) {
                if e.logged.replace(data.clone()).is_none() {
                    self.logged.0.fetch_add(1, Ordering::Relaxed);
                }
                if e.dirty && Arc::ptr_eq(&e.data, data) {
                    e.dirty = false;
                    self.dirty.0.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Write every logged block's committed contents home, in block order (the
    /// checkpoint; the caller flushes and then empties the log), freed ones whose free
    /// is not committed included. Returns how many.
    pub fn checkpoint(&self) -> Result<usize> {
        type Contents = Vec<(u64, Arc<[u8]>)>;
        let (logged, freed): (Contents, Contents) = {
            let (mut v, mut f) = (Vec::new(), Vec::new());
            self.each(|map| {
                v.extend(
                    map.map
                        .iter()
                        .filter_map(|(k, e)| e.logged.as_ref().map(|d| (*k, d.clone()))),
                );
                f.extend(map.freed_logged.iter().map(|(k, d)| (*k, d.clone())));
            });
            v.sort_by_key(|(k, _)| *k);
            f.sort_by_key(|(k, _)| *k);
            (v, f)
        };
        for (blk, data) in logged.iter().chain(&freed) {
            self.dev.write_at(data, blk * self.block_size as u64)?;
        }
        for (blk, data) in &freed {
            let mut map = self.at(*blk);
            if map
                .freed_logged
                .get(blk)
                .is_some_and(|d| Arc::ptr_eq(d, data))
            {
                map.freed_logged.remove(blk);
            }
        }
        for (blk, data) in &logged {
            if let Some(e) = self.at(*blk).map.get_mut(blk) {
                if e.logged.as_ref().is_some_and(|d| Arc::ptr_eq(d, data)) {
                    e.logged = None;
                    self.logged.0.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        Ok(logged.len())
    }

    /// The revoke records of `blocks` are committed: their old contents are never
    /// needed again, and the blocks may be reused (call before they stop being busy).
    pub fn revokes_committed(&self, blocks: &[u64]) {
        for b in blocks {
            self.at(*b).freed_logged.remove(b);
        }
    }

    /// How many revoke records the next commit carries (logged blocks freed since the
    /// last one).
    pub fn revoked_count(&self) -> usize {
        let mut n = 0;
        self.each(|b| n += b.revoked.len());
        n
    }

    /// Whether logged blocks were freed since the last commit.
    pub fn has_revoked(&self) -> bool {
        let mut any = false;
        self.each(|b| any |= !b.revoked.is_empty());
        any
    }

    /// The log was emptied: no revoke record is needed any more, but for blocks of
    /// the transaction being committed (it is written into the emptied log) — and no
    /// freed block's committed copy needs to go home any more either: the checkpoint
    /// that emptied the log wrote every logged block, and a block freed while it ran
    /// (which the checkpoint wrote as logged, and `forget` then kept as freed) must
    /// not be written again by a later one, over whatever reuses it once its free
    /// commits — a free whose revoke record this drops, so that its commit would not
    /// drop the copy either.
    ///
    /// Journaled file data that is home now (written by the checkpoint, not changed
    /// since) leaves the cache: with the log empty no older copy can be replayed over
    /// the block, so the data paths may use its home again.
    pub fn log_emptied(&self) {
        let mut data_gone = 0;
        self.each(|map| {
            let all = &map.commit_all;
            map.revoked.retain(|b| all.contains(b));
            map.freed_logged.retain(|b, _| all.contains(b));
            map.map.retain(|b, e| {
                let home = e.file_data && !e.dirty && e.logged.is_none() && !all.contains(b);
                data_gone += usize::from(home);
                !home
            });
        });
        self.data.0.fetch_sub(data_gone, Ordering::Relaxed);
    }

    /// Number of logged blocks (committed, not yet home).
    pub fn logged_count(&self) -> usize {
        self.logged.0.load(Ordering::Relaxed)
    }

    /// Every dirty block, in block order (the next transaction's contents).
    pub fn dirty_blocks(&self) -> Vec<(u64, Arc<[u8]>)> {
        let mut v = Vec::new();
        self.each(|map| {
            v.extend(
                map.map
                    .iter()
                    .filter(|(_, e)| e.dirty)
                    .map(|(k, e)| (*k, e.data.clone())),
            )
        });
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Write these blocks home (a checkpoint) and mark them clean if unchanged since.
    pub fn flush_these(&self, blocks: &[(u64, Arc<[u8]>)]) -> Result<()> {
        for (blk, data) in blocks {
            self.dev.write_at(data, blk * self.block_size as u64)?;
        }
        for (blk, data) in blocks {
            if let Some(e) = self.at(*blk).map.get_mut(blk) {
                if Arc::ptr_eq(&e.data, data) && e.dirty {
                    e.dirty = false;
                    self.dirty.0.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Number of dirty blocks.
    pub fn dirty_count(&self) -> usize {
        self.dirty.0.load(Ordering::Relaxed)
    }

    /// Read without a verifier (data blocks of symlinks, raw dumps).
    pub fn read_raw(&self, blk: u64) -> Result<Arc<[u8]>> {
        self.read(blk, Kind::Raw, |_| Ok(()))
    }

    /// Forget every clean block (after the device changed underneath).
    pub fn invalidate(&self) {
        self.each(|b| b.map.retain(|_, e| !e.droppable()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn verifies_per_kind_and_reports_the_block() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 8]));
        let c = BufferCache::new(dev, 1024, 8, 16);
        c.read(3, Kind::Raw, |_| Ok(())).expect("raw ok");
        let e = c.read(3, Kind::DirLeaf, |_| Err(Error::corrupted("bad", None)));
        assert!(matches!(e, Err(Error::Corrupted { block: Some(3), .. })));
        assert!(matches!(
            c.read(9, Kind::Raw, |_| Ok(())),
            Err(Error::Corrupted { .. })
        ));
    }

    /// `update` changes a block where it is only while the cache holds the only
    /// reference: what a reader holds, and what a commit is writing, never change
    /// under them (a copy is changed instead), and the commit then leaves the block
    /// dirty for the next transaction; once nothing else holds it, it is changed in
    /// place again.
    #[test]
    fn update_changes_in_place_only_what_nobody_else_holds() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 8]));
        let c = BufferCache::new(dev, 1024, 8, 16);
        let set = |v: u8| {
            c.update(2, Kind::Raw, |b| {
                b[0] = v;
                Ok(())
            })
            .expect("update")
        };
        set(1);
        let held = c.read(2, Kind::Raw, |_| Ok(())).expect("read");
        set(2);
        assert_eq!(held[0], 1, "a reader's copy changed under it");
        drop(held);
        let before = Arc::as_ptr(&c.read(2, Kind::Raw, |_| Ok(())).expect("read"));
        set(3);
        let now = c.read(2, Kind::Raw, |_| Ok(())).expect("read");
        assert_eq!(Arc::as_ptr(&now), before, "not changed in place");
        assert_eq!(now[0], 3);
        drop(now);
        // A commit of the block: its copy stays as committed, the block stays dirty.
        let t = c.dirty_blocks();
        c.begin_commit(&t);
        set(4);
        assert_eq!(t[0].1[0], 3, "the commit's copy changed under it");
        c.committed(&t);
        c.end_commit();
        assert_eq!(
            c.dirty_count(),
            1,
            "a change after the commit began was lost"
        );
        assert_eq!(c.read(2, Kind::Raw, |_| Ok(())).expect("read")[0], 4);
        // A failing change leaves the block as it was.
        let r = c.update(2, Kind::Raw, |_| -> Result<()> {
            Err(Error::InvalidInput("no".into()))
        });
        assert!(r.is_err());
        assert_eq!(c.read(2, Kind::Raw, |_| Ok(())).expect("read")[0], 4);
    }

    /// A block freed while the transaction that carries it is being written: it is
    /// not marked logged afterwards (the checkpoint would write stale metadata over
    /// whatever reuses it), and its revoke record goes to the next commit, surviving a
    /// checkpoint that empties the log before this transaction is written into it.
    /// A logged block freed while a checkpoint runs (after it took the logged blocks
    /// to write home, before it emptied the log): the emptied log drops its revoke,
    /// and must drop its freed copy with it. Otherwise no commit ever drops that copy
    /// (its free commits without the revoke), and the next checkpoint writes it over
    /// whatever reused the block — a directory block of another directory, as the
    /// concurrent namespace test found.
    #[test]
    fn the_emptied_log_forgets_freed_copies_with_their_revokes() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 16]));
        let c = BufferCache::new(dev.clone(), 1024, 16, 16);
        c.write(3, Kind::Raw, vec![1u8; 1024], |_| Ok(()))
            .expect("write");
        let t1 = c.dirty_blocks();
        c.begin_commit(&t1);
        c.committed(&t1);
        c.end_commit();
        // The checkpoint has written block 3 home (as logged); now it is freed, and
        // then the checkpoint empties the log.
        c.forget(3, 1);
        c.log_emptied();
        assert!(c.take_revoked().is_empty(), "nothing in the log to revoke");
        // Its free committed: block 3 is reused, committed, checkpointed.
        c.write(3, Kind::Raw, vec![2u8; 1024], |_| Ok(()))
            .expect("write");
        let t2 = c.dirty_blocks();
        c.begin_commit(&t2);
        c.committed(&t2);
        c.end_commit();
        c.checkpoint().expect("checkpoint");
        let mut home = vec![0u8; 1024];
        dev.read_at(&mut home, 3 * 1024).expect("read");
        assert_eq!(home, vec![2u8; 1024], "the new owner's contents are home");
    }

    #[test]
    fn a_block_freed_during_its_commit_is_revoked_not_logged() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 16]));
        let c = BufferCache::new(dev, 1024, 16, 16);
        c.write(3, Kind::Raw, vec![1u8; 1024], |_| Ok(()))
            .expect("write");
        c.write(4, Kind::Raw, vec![2u8; 1024], |_| Ok(()))
            .expect("write");
        let txn = c.dirty_blocks();
        c.begin_commit(&txn);
        // Freed while the commit is written: no logged copy yet, but it will be.
        c.forget(3, 1);
        c.log_emptied();
        c.committed(&txn);
        c.end_commit();
        assert_eq!(c.logged_count(), 1, "only block 4 waits for the checkpoint");
        assert_eq!(c.take_revoked(), vec![3]);
        // Block 4, logged, freed later: revoked too; block 3 is gone for good.
        c.forget(4, 1);
        assert_eq!(c.logged_count(), 0);
        assert_eq!(c.take_revoked(), vec![4]);
        assert_eq!(c.checkpoint().expect("checkpoint"), 0);
        // Written again after its free: the revoke is withdrawn.
        c.write(5, Kind::Raw, vec![3u8; 1024], |_| Ok(()))
            .expect("write");
        let t2 = c.dirty_blocks();
        c.begin_commit(&t2);
        c.committed(&t2);
        c.end_commit();
        c.forget(5, 1);
        c.write(5, Kind::Raw, vec![4u8; 1024], |_| Ok(()))
            .expect("write");
        assert!(c.take_revoked().is_empty());
    }

    /// Journaled file data: held (and changed) here while the log may replay an
    /// older copy, home after the checkpoint, dropped once the log is empty; freed
    /// while logged, revoked like metadata.
    #[test]
    fn journaled_data_is_held_until_the_log_is_empty() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 16]));
        let c = BufferCache::new(dev.clone(), 1024, 16, 16);
        let held = |blk| c.data_blocks(blk, 1).first().map(|(_, d)| d[..4].to_vec());
        assert!(
            !c.update_data(6, 0, b"x").expect("update"),
            "nothing held yet"
        );
        c.put_data(6, &[7u8; 1024]).expect("put");
        c.put_data(7, &[8u8; 1024]).expect("put");
        assert_eq!(c.data_count(), 2);
        assert!(c.update_data(6, 1, b"ab").expect("update"));
        assert_eq!(held(6), Some(vec![7, b'a', b'b', 7]));
        let txn = c.dirty_blocks();
        assert_eq!(txn.len(), 2, "journaled data is the transaction's");
        c.begin_commit(&txn);
        c.committed(&txn);
        c.end_commit();
        // Logged block 7 freed: revoked, and no longer held.
        c.forget(7, 1);
        assert_eq!(c.take_revoked(), vec![7]);
        assert_eq!(held(7), None);
        // Changed after its commit: the checkpoint writes the committed copy home,
        // the change stays held (dirty) through the log's emptying.
        assert!(c.update_data(6, 0, b"z").expect("update"));
        c.checkpoint().expect("checkpoint");
        let mut home = vec![0u8; 4];
        dev.read_at(&mut home, 6 * 1024).expect("read");
        assert_eq!(home, vec![7, b'a', b'b', 7]);
        c.log_emptied();
        assert_eq!(held(6), Some(vec![b'z', b'a', b'b', 7]));
        // Committed and written home again: gone once the log is empty.
        let t2 = c.dirty_blocks();
        c.begin_commit(&t2);
        c.committed(&t2);
        c.end_commit();
        c.checkpoint().expect("checkpoint");
        assert_eq!(
            held(6),
            Some(vec![b'z', b'a', b'b', 7]),
            "held until the log is empty"
        );
        c.log_emptied();
        assert_eq!(held(6), None);
        assert_eq!(c.data_count(), 0);
        assert!(!c.update_data(6, 0, b"y").expect("update"), "home again");
    }
}
