//! Free space under the kernel's writeback cache: no write() the kernel accepted is
//! ever refused at writeback.
//!
//! With FUSE_WRITEBACK_CACHE a write() lands in the kernel's page cache and returns;
//! the server sees the data later, as a cached WRITE from the kernel's writeback, when
//! no application waits for it. The kernel's ext4 reserves space at write() time; a
//! FUSE server gets no request at write(). So the server keeps an account of what the
//! kernel may still hand over (`owed`, bytes) and holds that much space back in the
//! engine (`Fs::hold_for_client`, with the extent-tree blocks it may need): every other
//! allocation — direct and write-through writes, fallocate, directories, xattrs —
//! leaves it, and a cached WRITE spends it (`rext4::spend_held`). What bounds `owed`:
//! - the *dirty window*: the kernel holds at most so many bytes dirty or under
//!   writeback for one mount, the bdi's strict limit. As root the server sets it
//!   (max_bytes, and min_bytes when the kernel grants it; strict_limit) to a quarter of
//!   the space left, at most `bdi_max_ratio` of the system's dirty threshold; without
//!   root it is the kernel's (1% of the threshold, read from sysfs, with an eighth
//!   more for the threshold moving). While a descriptor that writes through the
//!   kernel's cache is open, `owed` is at least the window plus what the kernel's
//!   throttling lets writers overshoot it by (`slack`). A window is raised only after
//!   `owed` is, and `owed` falls only as cached WRITEs arrive (the kernel must write
//!   back what it holds above a lowered window before it lets anyone dirty more) or
//!   after a *re-sync round* (below). Once no such descriptor is open, nothing is owed:
//!   the kernel writes a file's dirty pages back before it releases its last handle.
//! - the *gate*: when what is left beyond the window is less than `GATE_MARGIN`
//!   (64 MiB), every write() on a descriptor writing through the kernel's cache is
//!   checked first: attributes of files open that way are invalidated (and those of
//!   files opened later), and every attribute reply has no lifetime, so the kernel
//!   sends a GETATTR with the handle before each write(), while the writer waits in
//!   its system call. `inflight` reads how many bytes that call writes; the gate
//!   admits it only if the space left covers `owed` plus the pages those bytes may
//!   dirty (which it adds to `owed`: the kernel writes back whole pages, so
//!   everything here is counted in pages), else answers ENOSPC — the write() fails,
//!   nothing of it was accepted. Before refusing, `owed` is counted again (`recount`:
//!   no more than the whole system's dirty and writeback pages plus what admitted
//!   calls may still copy), and a write() that would fit beside less waits up to
//!   `GATE_WAIT` for what is owed to arrive — on a thread of its own, at most half
//!   the request threads' worth at once (over io_uring the request thread waits for
//!   the reply), so the rest serve the WRITEs it waits for. Gated, `owed` has no
//!   floor: it is what was owed when the gate closed (the window, and the write calls
//!   then under way, found by `inflight::scan`), plus what the gate admitted, less
//!   what arrived.
//! - *low space*: below the window, its slack and `LOW_MARGIN` (8 MiB), a file opened
//!   for writing gets FOPEN_DIRECT_IO (each write() a WRITE answered before write()
//!   returns: ENOSPC exactly, as ext4), and the window (root) shrinks to 256 KiB.
//! - a *re-sync round* (when the gate closes, and when the hold is what made a
//!   call fail): the watcher makes the kernel write back every file open for cached
//!   writing (a page invalidation launders its dirty pages); after it, the kernel holds
//!   only what was written since — no more than the window in normal mode, no more
//!   than the gate admitted since the round began (and the calls under way then)
//!   while gated — and `owed` is cut to that.
//!
//! Not covered (the kernel asks nothing first): writes through a shared writable
//! mapping, and a single write() already copying when space turned low beyond what
//! the scan could read (another user's task without root). Neither exists on the
//! kernel's ext4 either way: there they fail with SIGBUS or ENOSPC.
//!
//! Locks: `ledger` (the account, the mode, and the decision to open a file cached)
//! before the adapter's handle table; nothing waits on the kernel under either.
//! Threads: handlers call `open_cached`, `released`, `arrived`, `admit` (all short,
//! under the ledger lock; a gate that must wait runs `admit` again on a `rext4-gate`
//! thread, which waits on `fell` without the lock) and `after_change`/`blocked`
//! (kicks); the watcher thread
//! re-reads the space, tunes the bdi, flips the mode and runs re-sync rounds — never a
//! request handler: a page invalidation waits for WRITEs that handlers serve.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rext4::Fs;

use crate::adapter::Shared;
use crate::inflight;

/// Space beyond the window (and its slack) below which space is low.
pub(crate) const LOW_MARGIN: u64 = 8 << 20;
/// Space beyond the window (and its slack) below which every write() on a descriptor
/// writing through the kernel's cache is checked first (the gate): room for the write
/// calls under way when checking starts, which the gate never sees (sixteen 4 MiB
/// writes).
pub(crate) const GATE_MARGIN: u64 = 64 << 20;
/// The smallest dirty window the server sets (root).
pub(crate) const FLOOR_BYTES: u64 = 1 << 20;
/// The dirty window while space is low (root): the kernel's throttling then writes
/// each writer's data back almost as it comes, so little stays owed.
pub(crate) const LOW_WINDOW_BYTES: u64 = 256 << 10;
/// What a write call whose size cannot be read is assumed to write.
pub(crate) const UNKNOWN_WRITE_BYTES: u64 = 8 << 20;
/// Admitted calls remembered before the returned ones are weeded out.
const MAX_CALLS: usize = 256;
/// How often the watcher looks at the space without being kicked.
const POLL: Duration = Duration::from_millis(500);
/// The least time between two re-sync rounds asked for by refusals.
const RESYNC_GAP: Duration = Duration::from_millis(100);
/// How long a write the caller waits for (write-through or direct) waits, on a
/// request thread, for what is owed to arrive before it fails for lack of space.
pub(crate) const ROOM_WAIT: Duration = Duration::from_millis(1000);
/// How long the gate waits for what is owed to arrive before it refuses a write()
/// that would fit beside less (the writer waits in its system call meanwhile; the
/// wait takes no request thread).
pub(crate) const GATE_WAIT: Duration = Duration::from_millis(2000);

/// What the gate answers a write() (`LowSpace::admit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    Admitted,
    Refused,
    /// It would fit once what is owed has arrived: ask again on a thread of its own.
    Wait,
}

/// What the kernel's throttling lets the dirty data of a mount exceed its strict
/// window by: each dirtying task checks the limit only every few pages (at most a
/// few hundred KiB apart), and per-CPU counters lag.
pub(crate) fn slack(window: u64) -> u64 {
    (4 << 20) + window / 8
}

/// The dirty window to set (root) for `avail` bytes left: a quarter of it, within
/// [`FLOOR_BYTES`, `cap`].
pub(crate) fn window_for(avail: u64, cap: u64) -> u64 {
    (avail / 4).clamp(FLOOR_BYTES.min(cap), cap.max(FLOOR_BYTES.min(cap)))
}

/// Whether `avail` bytes left is less than `margin` beyond what a mount whose normal
/// window is `window` may hold, given whether it was (leaving takes another `margin`,
/// at most 8 MiB: no flapping).
pub(crate) fn is_below(avail: u64, window: u64, margin: u64, now: bool) -> bool {
    let edge = window + slack(window) + margin;
    if now {
        avail < edge + margin.min(LOW_MARGIN)
    } else {
        avail < edge
    }
}

/// The kernel's page size: its cache holds, and its writeback sends, whole pages.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p >= 4096).unwrap_or(4096)
}

/// The page-cache bytes a write of `bytes` at an offset not known may dirty: its pages,
/// and one more where it straddles a page boundary (the kernel writes back whole
/// pages, so a write of 100 bytes costs a page).
pub(crate) fn pages_for_write(bytes: u64, page: u64) -> u64 {
    if bytes == 0 {
        return 0;
    }
    (bytes.div_ceil(page) + 1).saturating_mul(page)
}

/// The page-cache bytes a cached WRITE of `len` bytes at `offset` hands over: the
/// pages it spans.
pub(crate) fn pages_spanned(offset: u64, len: u64, page: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let end = offset.saturating_add(len);
    (end.div_ceil(page) - offset / page).saturating_mul(page)
}

/// Blocks to hold for `bytes` of data in `files` files: the data blocks, and the
/// extent-tree blocks their writeback may need (a leaf per half-full leaf of
/// one-block extents, and per file with data a split of every level and a new one).
pub(crate) fn hold_blocks(bytes: u64, files: u64, block_size: u32) -> u64 {
    if bytes == 0 {
        return 0;
    }
    let bs = u64::from(block_size);
    let data = bytes.div_ceil(bs);
    let per_leaf = (bs - 12) / 12;
    data + data.div_ceil((per_leaf / 2).max(1)) + 6 * (files.min(data) + 1)
}

/// Work for the watcher thread.
enum Job {
    Check,
    /// Run a re-sync round.
    Resync,
}

/// The mount's bdi in sysfs and what we set there.
struct Bdi {
    dir: PathBuf,
    /// We may write it (root) and the user did not ask to leave it alone.
    tunable: bool,
    /// The largest window we set (bdi_max_ratio of the system's dirty threshold).
    cap: u64,
}

/// What the kernel may still hand over, and the mode (see the module note).
#[derive(Default)]
struct Ledger {
    /// Every write() through the kernel's cache is checked by the gate.
    gated: bool,
    low: bool,
    /// Bytes the kernel may still hand over as cached WRITEs.
    owed: u64,
    /// What `owed` stays at or above: the window and its slack while descriptors
    /// writing through the kernel's cache are open (normal mode), else 0.
    floor: u64,
    /// The window of the mount now (set by us, or the kernel's).
    window: u64,
    /// Handles open for writing through the kernel's cache.
    cached: u64,
    /// Bytes the gate admitted since the running re-sync round began, and those that
    /// calls under way when it began may still copy.
    round_admitted: Option<u64>,
    round_running: u64,
    /// Write calls that may still be copying into the kernel's cache: those under way
    /// when space turned low (the gate never saw them) and those the gate admitted
    /// (the latest of each task), until seen returned.
    calls: Vec<inflight::Writer>,
    /// The engine's hold was last set for this `owed` and file count.
    held_for: (u64, u64),
}

pub(crate) struct LowSpace {
    gated: AtomicBool,
    low: AtomicBool,
    /// Gate threads running (`gate_thread`).
    gate_threads: AtomicU64,
    /// `after_change` kicks the watcher when the space left leaves this band.
    band_lo: AtomicU64,
    band_hi: AtomicU64,
    /// The kernel's writeback of some file was refused for lack of space while space
    /// was low (the account was wrong): every write() through the kernel's cache fails
    /// from now on until space is no longer low.
    refused: AtomicBool,
    ledger: Mutex<Ledger>,
    /// Signalled when `owed` falls (gates waiting for it).
    fell: Condvar,
    /// Gates waiting on `fell`, and how many may (a request thread each: some must
    /// stay free to serve the WRITEs they wait for).
    waiters: AtomicU64,
    max_waiters: AtomicU64,
    bdi: Mutex<Option<Bdi>>,
    /// The mount's device (major:minor), for the scan of write calls on it.
    dev: Mutex<Option<String>>,
    tx: Mutex<Option<Sender<Job>>>,
    /// When the last re-sync round was asked for by a refusal.
    last_resync: Mutex<Option<Instant>>,
    /// Whether the account is kept (the watcher runs): otherwise nothing is held.
    active: AtomicBool,
}

impl Default for LowSpace {
    fn default() -> Self {
        LowSpace {
            gated: AtomicBool::new(false),
            low: AtomicBool::new(false),
            gate_threads: AtomicU64::new(0),
            band_lo: AtomicU64::new(0),
            band_hi: AtomicU64::new(u64::MAX),
            refused: AtomicBool::new(false),
            ledger: Mutex::new(Ledger::default()),
            fell: Condvar::new(),
            waiters: AtomicU64::new(0),
            max_waiters: AtomicU64::new(0),
            bdi: Mutex::new(None),
            dev: Mutex::new(None),
            tx: Mutex::new(None),
            last_resync: Mutex::new(None),
            active: AtomicBool::new(false),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The system's dirty-page threshold in bytes (what the kernel lets all writers hold
/// dirty at once), from /proc/vmstat.
fn dirty_threshold_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/vmstat").ok()?;
    let pages: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("nr_dirty_threshold "))?
        .trim()
        .parse()
        .ok()?;
    Some(pages * 4096)
}

/// Bytes the whole system holds dirty or under writeback (/proc/vmstat), with room
/// for what the per-CPU counters have not folded in yet (at most 125 pages each per
/// CPU): a bound on what the kernel's cache holds for this mount.
fn system_dirty_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/vmstat").ok()?;
    let mut pages = 0u64;
    let mut seen = 0;
    for l in t.lines() {
        let Some((k, v)) = l.split_once(' ') else {
            continue;
        };
        if matches!(k, "nr_dirty" | "nr_writeback" | "nr_writeback_temp") {
            pages = pages.saturating_add(v.trim().parse::<u64>().ok()?);
            seen += u32::from(k != "nr_writeback_temp");
        }
    }
    if seen < 2 {
        return None;
    }
    let cpus = std::thread::available_parallelism().map_or(64, |n| n.get() as u64);
    Some(
        pages
            .saturating_add(cpus * 2 * 256)
            .saturating_mul(page_size()),
    )
}

fn read_u64(p: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The mount ids of every mount of device `dev` (bind mounts included).
fn mount_ids(dev: &str) -> HashSet<u64> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| {
            t.lines()
                .filter_map(|l| {
                    let mut f = l.split(' ');
                    let id = f.next()?.parse().ok()?;
                    let _parent = f.next()?;
                    (f.next()? == dev).then_some(id)
                })
                .collect()
        })
        .unwrap_or_default()
}

impl Ledger {
    /// While writes are gated: cut `owed` to what the kernel can hold now — what the
    /// whole system holds dirty or under writeback, and what the write calls the gate
    /// admitted (or found under way) may still copy. Every page the kernel can still
    /// hand over is in one or the other: a call that returned has marked its pages
    /// dirty, and no write() gets into the cache without the gate.
    fn recount(&mut self, fs: &Fs) {
        if !self.gated || self.owed == 0 {
            return;
        }
        let Some(dirty) = system_dirty_bytes() else {
            return;
        };
        if dirty >= self.owed {
            return;
        }
        self.calls.retain(|w| w.still_in_call());
        let page = page_size();
        let running: u64 = self
            .calls
            .iter()
            .map(|w| pages_for_write(w.bytes, page))
            .sum();
        let bound = dirty.saturating_add(running);
        if bound < self.owed {
            self.owed = bound.max(self.floor);
            self.sync_hold(fs);
        }
    }

    /// Set the engine's hold to what is owed now. With no handle writing through the
    /// kernel's cache open, nothing is owed (whatever was counted meanwhile).
    fn sync_hold(&mut self, fs: &Fs) {
        if self.cached == 0 {
            self.owed = 0;
            self.floor = 0;
            self.calls.clear();
        }
        let files = self.cached;
        if self.held_for != (self.owed, files) {
            self.held_for = (self.owed, files);
            fs.hold_for_client(hold_blocks(self.owed, files, fs.block_size()));
        }
    }

    /// Raise the floor (and `owed` with it) to `floor`, or lower it.
    fn set_floor(&mut self, floor: u64, fs: &Fs) {
        self.floor = floor;
        self.owed = self.owed.max(floor);
        self.sync_hold(fs);
    }
}

impl LowSpace {
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        lock(&self.ledger)
    }

    /// Space is low now (files opened for writing write through).
    pub(crate) fn low(&self) -> bool {
        self.low.load(Ordering::Relaxed)
    }

    /// Every write() through the kernel's cache goes through the gate now (their
    /// attributes have no lifetime).
    pub(crate) fn gated(&self) -> bool {
        self.gated.load(Ordering::Relaxed)
    }

    /// Whether cached data was refused for lack of space while writes are gated.
    pub(crate) fn refused(&self) -> bool {
        self.gated() && self.refused.load(Ordering::SeqCst)
    }

    /// A cached write (the kernel's writeback) failed with ENOSPC: the account was
    /// wrong. Every write() on a cached descriptor fails while space stays low.
    pub(crate) fn note_refused(&self) {
        self.refused.store(true, Ordering::SeqCst);
        self.kick(Job::Check);
    }

    /// Bytes owed now (tests and messages).
    pub(crate) fn owed(&self) -> u64 {
        self.ledger().owed
    }

    /// A handle for writing is being opened; `insert` records it in the handle table
    /// with whether it writes through the kernel's cache (the answer). It does when
    /// the account is kept, space is not low, and the window it may fill is held
    /// back now; else it writes through (FOPEN_DIRECT_IO). Decided and recorded under
    /// the ledger lock, so the turn to low space sees every cached handle.
    pub(crate) fn open_for_writing<R>(&self, fs: &Fs, insert: impl FnOnce(bool) -> R) -> R {
        if !self.active.load(Ordering::Relaxed) {
            return insert(true);
        }
        let mut l = self.ledger();
        if l.low {
            return insert(false);
        }
        if l.gated {
            // Its every write() is checked (the caller makes the kernel ask first).
            l.cached += 1;
            l.sync_hold(fs);
            return insert(true);
        }
        let floor = l.window + slack(l.window);
        let left = fs.blocks_available_to(false);
        let bs = fs.block_size();
        if left < hold_blocks(l.owed.max(floor), l.cached + 1, bs) {
            // The window no longer fits: the watcher has not turned to low space yet.
            drop(l);
            self.kick(Job::Check);
            return insert(false);
        }
        l.cached += 1;
        l.set_floor(floor, fs);
        insert(true)
    }

    /// A handle that wrote through the kernel's cache was released. The kernel wrote
    /// the file's dirty pages back before releasing it; with the last such handle
    /// nothing is owed any more.
    pub(crate) fn released(&self, fs: &Fs) {
        if !self.active.load(Ordering::Relaxed) {
            return;
        }
        let mut l = self.ledger();
        l.cached = l.cached.saturating_sub(1);
        l.sync_hold(fs);
    }

    /// A cached WRITE of `len` bytes at `offset` was taken by the engine (or refused):
    /// the pages it spans are no longer owed.
    pub(crate) fn arrived(&self, fs: &Fs, offset: u64, len: u64) {
        if !self.active.load(Ordering::Relaxed) {
            return;
        }
        let len = pages_spanned(offset, len, page_size());
        let mut l = self.ledger();
        l.owed = l.owed.saturating_sub(len).max(l.floor);
        l.sync_hold(fs);
        drop(l);
        if self.waiters.load(Ordering::Relaxed) > 0 {
            self.fell.notify_all();
        }
    }

    /// The gate, in low space: task `tid` is about to write() on a descriptor that
    /// writes through the kernel's cache. Admit the bytes its call writes if the
    /// space left (to a privileged caller or not) covers them beside what is owed.
    /// When they would fit beside less, wait a little for what is owed to arrive
    /// (a re-sync round makes the kernel hand it over) before refusing — as long as
    /// enough request threads stay free to serve the WRITEs that brings.
    ///
    /// On a request thread (`on_own_thread` false) it never waits: it answers
    /// [`Gate::Wait`] instead, and the caller runs it again on a thread of its own
    /// (`gate_thread`), which waits up to `GATE_WAIT`.
    pub(crate) fn admit(&self, fs: &Fs, tid: u32, privileged: bool, on_own_thread: bool) -> Gate {
        if self.refused() {
            return Gate::Refused;
        }
        let call = match inflight::write_call(tid) {
            Ok(None) => return Gate::Admitted,
            Ok(Some(w)) => Some(w),
            Err(()) => None,
        };
        // A call that cannot be read is remembered as never returning.
        let call = call.unwrap_or(inflight::Writer {
            tid,
            text: None,
            bytes: UNKNOWN_WRITE_BYTES,
        });
        if call.bytes == 0 {
            return Gate::Admitted;
        }
        // Counted in pages, as they will arrive.
        let bytes = pages_for_write(call.bytes, page_size());
        let bs = fs.block_size();
        let t0 = Instant::now();
        let mut waiting = false;
        let mut l = self.ledger();
        // The task's previous call has returned (it is in this one).
        l.calls.retain(|w| w.tid != tid);
        let admitted = loop {
            let left = fs.blocks_available_to(privileged);
            let fits = |l: &Ledger| left >= hold_blocks(l.owed.saturating_add(bytes), l.cached, bs);
            if fits(&l) {
                break true;
            }
            // What is owed is a bound: count it again from what the kernel holds.
            l.recount(fs);
            if fits(&l) {
                break true;
            }
            let could = left >= hold_blocks(bytes, l.cached, bs) && l.owed > 0;
            let spent = t0.elapsed();
            if !could || spent >= GATE_WAIT {
                log::debug!(
                    "write() of {bytes} bytes by task {tid} refused: {} KiB left, {} KiB owed",
                    (left * u64::from(bs)) >> 10,
                    l.owed >> 10
                );
                break false;
            }
            if !on_own_thread {
                return Gate::Wait;
            }
            if !waiting {
                self.waiters.fetch_add(1, Ordering::SeqCst);
                waiting = true;
            }
            drop(l);
            // What is owed may be more than the kernel holds, and what it holds may
            // sit in its cache for a while: have it handed over and counted again.
            self.blocked();
            l = self.ledger();
            let step = (GATE_WAIT - spent).min(Duration::from_millis(50));
            l = self
                .fell
                .wait_timeout(l, step)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        if waiting {
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
        if !admitted {
            return Gate::Refused;
        }
        l.owed = l.owed.saturating_add(bytes);
        if let Some(r) = l.round_admitted.as_mut() {
            *r = r.saturating_add(bytes);
        }
        if l.calls.len() >= MAX_CALLS {
            l.calls.retain(|w| w.still_in_call());
        }
        l.calls.push(call);
        l.sync_hold(fs);
        Gate::Admitted
    }

    /// A slot for a gate that must wait (`admit` answered [`Gate::Wait`]) on a thread
    /// of its own; false when as many wait already as may (the write() is refused).
    /// Given back by `gate_done`. As many as half the request threads: over
    /// FUSE-over-io_uring the request thread waits for a reply handed to another
    /// thread, and the rest must stay free to serve the WRITEs the gates wait for.
    pub(crate) fn gate_slot(&self) -> bool {
        let n = self.gate_threads.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_waiters.load(Ordering::Relaxed) {
            self.gate_threads.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub(crate) fn gate_done(&self) {
        self.gate_threads.fetch_sub(1, Ordering::SeqCst);
    }

    /// A write the caller waits for (write-through or direct) found no room for
    /// `bytes` beside the space held back for the kernel's cache: wait, until
    /// `deadline` at most, for what is owed to fall far enough that they would fit.
    /// False at once when nothing is held, or when enough request threads wait
    /// already; then the write fails as it is.
    pub(crate) fn wait_for_room(
        &self,
        fs: &Fs,
        bytes: u64,
        privileged: bool,
        deadline: Instant,
    ) -> bool {
        if !self.active.load(Ordering::Relaxed) || fs.held_for_client() == 0 {
            return false;
        }
        let n = self.waiters.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_waiters.load(Ordering::Relaxed) {
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        let bs = fs.block_size();
        let need = bytes.div_ceil(u64::from(bs));
        let mut l = self.ledger();
        let room = loop {
            let held = fs.held_for_client();
            let left = fs.blocks_available_to(privileged);
            if left >= need.saturating_add(held) {
                break true;
            }
            let now = Instant::now();
            if held == 0 || left < need || now >= deadline {
                break false;
            }
            drop(l);
            self.blocked();
            l = self.ledger();
            let step = (deadline - now).min(Duration::from_millis(50));
            l = self
                .fell
                .wait_timeout(l, step)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        drop(l);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        room
    }

    /// A call failed for lack of space while space was held back: what is owed may
    /// be well above what the kernel holds (a bound, not a count), so have it counted
    /// again (a re-sync round), at most every `RESYNC_GAP`.
    pub(crate) fn blocked(&self) {
        if !self.active.load(Ordering::Relaxed) {
            return;
        }
        let mut last = lock(&self.last_resync);
        if last.is_some_and(|t| t.elapsed() < RESYNC_GAP) {
            return;
        }
        *last = Some(Instant::now());
        drop(last);
        self.kick(Job::Resync);
    }

    /// After a change that may have used or freed space: `avail` is the space an
    /// unprivileged writer could take now. Kicks the watcher when it left the band
    /// the watcher last set.
    pub(crate) fn after_change(&self, avail: u64) {
        if avail < self.band_lo.load(Ordering::Relaxed)
            || avail > self.band_hi.load(Ordering::Relaxed)
        {
            self.kick(Job::Check);
        }
    }

    fn kick(&self, j: Job) {
        if let Some(tx) = lock(&self.tx).as_ref() {
            let _ = tx.send(j);
        }
    }

    /// Start the watcher for the mount whose bdi lives at `bdi` (its sysfs directory
    /// and the mount's device; None: not found), tuning the bdi when we may, with
    /// `cap_ratio` percent of the system's dirty threshold as the largest window (0:
    /// leave the bdi as the kernel set it); `threads` request threads serve the mount.
    pub(crate) fn start(
        shared: &Arc<Shared>,
        bdi: Option<(PathBuf, String)>,
        cap_ratio: u32,
        threads: usize,
    ) {
        let ls = &shared.lowspace;
        // Gates may wait on half the request threads: the rest serve the WRITEs
        // they wait for (a wait also ends by itself, `GATE_WAIT`).
        ls.max_waiters
            .store((threads / 2) as u64, Ordering::Relaxed);
        if let Some((dir, dev)) = bdi {
            let writable = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("max_bytes"))
                .is_ok();
            let cap = dirty_threshold_bytes().map_or(1 << 30, |t| t / 100 * u64::from(cap_ratio));
            let tunable = writable && cap_ratio > 0 && cap > 0;
            if tunable {
                // Strict: the mount's own limit holds even while the rest of the
                // system dirties little (without it the kernel lets any bdi fill the
                // system's free-running share, whatever its max_bytes).
                let _ = std::fs::write(dir.join("strict_limit"), "1");
            }
            let strict = read_u64(&dir.join("strict_limit")) == Some(1);
            if !tunable {
                let w = read_u64(&dir.join("max_bytes")).unwrap_or(0);
                if strict {
                    log::info!(
                        "the mount's dirty-page window is the kernel's ({} KiB{}): only root \
                         may set it, so files opened for writing write through once less \
                         than about {} KiB is free",
                        w >> 10,
                        if cap_ratio == 0 {
                            ", bdi_max_ratio=0"
                        } else {
                            ", not root"
                        },
                        (kernel_window(w) + slack(kernel_window(w)) + LOW_MARGIN) >> 10
                    );
                }
            }
            *lock(&ls.bdi) = Some(Bdi { dir, tunable, cap });
            *lock(&ls.dev) = Some(dev);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        *lock(&ls.tx) = Some(tx);
        // The first look, before any request: the window and the mode are known from
        // the start.
        let mut w = Watcher {
            set_window: 0,
            min_refused: false,
        };
        ls.active.store(true, Ordering::SeqCst);
        w.check(shared);
        let weak = Arc::downgrade(shared);
        let spawned = std::thread::Builder::new()
            .name("rext4-space".into())
            .spawn(move || w.run(&weak, &rx));
        if spawned.is_err() {
            *lock(&ls.tx) = None;
            // Without the watcher the window would never follow the space: hold
            // nothing and write through, as without the writeback cache.
            let mut l = ls.ledger();
            l.low = true;
            ls.low.store(true, Ordering::SeqCst);
            log::warn!("no low-space watcher thread: files opened for writing write through");
        }
    }

    /// Stop the watcher (the session ended).
    pub(crate) fn stop(&self) {
        *lock(&self.tx) = None;
    }
}

/// The window the kernel keeps for a mount we may not tune, from its max_bytes `w`: an
/// eighth more, for the system's threshold (of which it is a share) moving.
fn kernel_window(w: u64) -> u64 {
    w + w / 8
}

/// The watcher thread's own state.
struct Watcher {
    /// The window last written to max_bytes (root), 0 before the first.
    set_window: u64,
    /// The kernel refused the window as the mount's guaranteed minimum (other bdis
    /// held too much of the system's share); asked again at every look.
    min_refused: bool,
}

impl Watcher {
    fn run(&mut self, weak: &Weak<Shared>, rx: &Receiver<Job>) {
        loop {
            let job = match rx.recv_timeout(POLL) {
                Ok(j) => j,
                Err(RecvTimeoutError::Timeout) => Job::Check,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let Some(s) = weak.upgrade() else { return };
            match job {
                Job::Check => self.check(&s),
                Job::Resync => {
                    self.check(&s);
                    resync(&s);
                }
            }
        }
    }

    /// Write `want` as the mount's window (max_bytes, and min_bytes as far as the
    /// kernel grants it). False when the kernel refused the maximum.
    fn set_bdi(&mut self, b: &Bdi, want: u64) -> bool {
        let v = want.to_string();
        // The kernel keeps min <= max: min goes first when shrinking, max first when
        // growing.
        let order: [&str; 2] = if want < self.set_window {
            ["min_bytes", "max_bytes"]
        } else {
            ["max_bytes", "min_bytes"]
        };
        let mut ok = true;
        for name in order {
            // The minimum is a guaranteed share, refused when other bdis hold too
            // much of it: the maximum is what bounds us.
            let wrote = std::fs::write(b.dir.join(name), &v).is_ok();
            if name == "min_bytes" {
                self.min_refused = !wrote;
            }
            ok &= wrote || name == "min_bytes";
        }
        if ok {
            self.set_window = want;
        }
        ok
    }

    /// Re-read the space, tune the window, flip the mode.
    fn check(&mut self, s: &Shared) {
        let ls = &s.lowspace;
        let fs = &s.fs;
        let avail = s.available_bytes();
        let bdi = lock(&ls.bdi);
        let tunable = bdi.as_ref().is_some_and(|b| b.tunable);
        // The window the mount has, or (tunable) would have with space not low.
        let normal = match bdi.as_ref() {
            Some(b) if b.tunable => window_for(avail, b.cap),
            Some(b) if read_u64(&b.dir.join("strict_limit")) == Some(1) => {
                read_u64(&b.dir.join("max_bytes")).map_or(u64::MAX / 4, kernel_window)
            }
            // Not a strict limit, or unknown: the kernel may hold the system's whole
            // threshold.
            _ => dirty_threshold_bytes().unwrap_or(u64::MAX / 4),
        };
        let was_gated = ls.gated();
        let gated = is_below(avail, normal, GATE_MARGIN, was_gated);
        let was = ls.low();
        let low = gated && is_below(avail, normal, LOW_MARGIN, was);
        let mut l = ls.ledger();
        // The floor follows the window while cached handles are open and writes are
        // not (or no longer) gated.
        let floors = |l: &Ledger| l.cached > 0 && !gated;
        if let Some(b) = bdi.as_ref().filter(|b| b.tunable) {
            let want = if low { LOW_WINDOW_BYTES } else { normal };
            // Shrink at once; grow only by an eighth or more (a sysfs write per WRITE
            // would cost).
            let set = self.set_window;
            if set == 0 || want < set - set / 64 || want > set + set / 8 {
                if want > l.window {
                    // Raised: held back first, then granted.
                    l.window = want;
                    if floors(&l) {
                        l.set_floor(want + slack(want), fs);
                    }
                    if !self.set_bdi(b, want) {
                        l.window = set;
                    }
                } else if self.set_bdi(b, want) {
                    // Lowered: what the kernel holds above it arrives before it lets
                    // anyone dirty more; `owed` falls with the arrivals.
                    l.window = want;
                    if floors(&l) {
                        l.floor = want + slack(want);
                    }
                }
            } else if self.min_refused && set != 0 {
                self.min_refused =
                    std::fs::write(b.dir.join("min_bytes"), set.to_string()).is_err();
            }
        } else {
            // The kernel's window, re-read: it moves with the system's threshold.
            l.window = normal;
            if floors(&l) {
                l.set_floor(normal + slack(normal), fs);
            }
        }
        drop(bdi);
        // The band in which nothing needs a look: the modes stay and (tunable) the
        // space stays within a sixteenth of what the window was set for.
        let edge = normal + slack(normal) + GATE_MARGIN;
        let (lo, hi) = if gated {
            (0, edge + LOW_MARGIN)
        } else if tunable {
            (edge.max(avail - avail / 16), avail + avail / 16)
        } else {
            (edge, u64::MAX)
        };
        ls.band_lo.store(lo, Ordering::Relaxed);
        ls.band_hi.store(hi, Ordering::Relaxed);
        if gated != was_gated {
            l.gated = gated;
            ls.gated.store(gated, Ordering::SeqCst);
            if gated {
                // No floor: from now on the kernel gets more only through the gate.
                l.floor = 0;
                let cached = l.cached;
                drop(l);
                self.start_gating(s, cached);
                l = ls.ledger();
            } else {
                ls.refused.store(false, Ordering::SeqCst);
                l.calls.clear();
                if l.cached > 0 {
                    let w = l.window;
                    l.set_floor(w + slack(w), fs);
                }
            }
        }
        if low == was {
            return;
        }
        l.low = low;
        ls.low.store(low, Ordering::SeqCst);
        if !low {
            return;
        }
        let (owed, calls) = (l.owed, l.calls.len());
        drop(l);
        if tunable {
            log::warn!(
                "space is low ({} KiB left, {} KiB owed to the kernel's cache, {calls} write \
                 calls counted): files opened for writing from now on write through",
                avail >> 10,
                owed >> 10
            );
        } else {
            // Without root this fires on any image smaller than the kernel's own
            // window, empty or not: say why, and that nothing is wrong.
            log::warn!(
                "{} KiB free is little beside what the kernel may hold unwritten for this \
                 mount ({} KiB, its own limit; only root can lower it): files opened for \
                 writing from now on write through, so that write() itself reports a full \
                 disk",
                avail >> 10,
                normal >> 10
            );
        }
    }

    /// Writes just became gated, with `cached` handles writing through the kernel's
    /// cache open: make their next write() ask, count what the calls already past that
    /// point may still copy, and run a re-sync round.
    fn start_gating(&self, s: &Shared, cached: u64) {
        let ls = &s.lowspace;
        let fs = &s.fs;
        // Descriptors opened before: their next write() must ask (GETATTR). Handles
        // opened from now on are made to ask by the adapter.
        for ino in s.files_open_cached_for_writing() {
            s.invalidate_attrs_only(ino);
        }
        if cached == 0 {
            return;
        }
        // Write calls already past that point: what they may still copy is owed too.
        let writers = scan_writers(ls);
        let mut l = ls.ledger();
        if l.cached == 0 {
            return;
        }
        let page = page_size();
        let more: u64 = writers.iter().map(|w| pages_for_write(w.bytes, page)).sum();
        l.owed = l.owed.saturating_add(more);
        for w in writers {
            l.calls.retain(|c| c.tid != w.tid);
            l.calls.push(w);
        }
        l.sync_hold(fs);
        log::debug!(
            "write() through the kernel's cache is checked from now on: {} KiB owed, {} \
             write calls under way",
            l.owed >> 10,
            l.calls.len()
        );
        drop(l);
        *lock(&ls.last_resync) = Some(Instant::now());
        resync(s);
    }
}

/// The write calls under way on the mount, each read again while it shows the task
/// running in it (a task copying shows "running", not its call).
fn scan_writers(ls: &LowSpace) -> Vec<inflight::Writer> {
    let Some(dev) = lock(&ls.dev).clone() else {
        return Vec::new();
    };
    let ids = mount_ids(&dev);
    if ids.is_empty() {
        return Vec::new();
    }
    inflight::scan(&ids, std::process::id(), UNKNOWN_WRITE_BYTES)
}

/// Re-sync: make the kernel write back every file open for cached writing, then cut
/// `owed` to what the kernel may have taken since (see the module note). In low space
/// a round counts all the gate admitted while it ran, so a round that cut `owed` a lot
/// is followed by another (quick: the first dropped the files' cached pages) to count
/// less of what arrived meanwhile.
fn resync(s: &Shared) {
    let mut before = u64::MAX;
    for _ in 0..3 {
        match round(s) {
            Some(owed) if owed < before / 2 => before = owed,
            _ => return,
        }
    }
}

/// One re-sync round; `owed` after it (None: nothing is open for cached writing).
fn round(s: &Shared) -> Option<u64> {
    let ls = &s.lowspace;
    let fs = &s.fs;
    let (inodes, start_floor) = {
        let mut l = ls.ledger();
        if l.cached == 0 {
            return None;
        }
        // Calls that have returned are done copying: what they copied is in the
        // kernel's cache, which the round flushes.
        l.calls.retain(|w| w.still_in_call());
        l.round_admitted = Some(0);
        let page = page_size();
        l.round_running = l.calls.iter().map(|w| pages_for_write(w.bytes, page)).sum();
        (s.files_open_cached_for_writing(), l.floor)
    };
    let mut flushed = true;
    for ino in inodes {
        flushed &= s.kernel_writeback(ino);
    }
    let mut l = ls.ledger();
    let admitted = l.round_admitted.take();
    // Gates held back by the round go on.
    ls.fell.notify_all();
    let admitted = admitted?;
    if !flushed {
        // Some file kept what it held: nothing is known.
        log::debug!("re-sync round: a file kept its cached pages");
        return None;
    }
    let bound = if l.gated {
        // Only what the gate admitted since the round began, and what calls under
        // way then may still copy, can be in the kernel's cache now.
        admitted.saturating_add(l.round_running)
    } else {
        // The window in force when the round began bounds what was dirtied since.
        start_floor.max(l.floor)
    };
    log::debug!(
        "re-sync round: {} KiB admitted and {} KiB of calls under way since it began, {} \
         KiB owed",
        admitted >> 10,
        l.round_running >> 10,
        l.owed >> 10
    );
    if bound < l.owed {
        l.owed = bound.max(l.floor);
        l.sync_hold(fs);
    }
    let owed = l.owed;
    drop(l);
    ls.fell.notify_all();
    Some(owed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_a_quarter_of_the_space_within_floor_and_cap() {
        assert_eq!(window_for(1 << 40, 1 << 30), 1 << 30);
        assert_eq!(window_for(128 << 20, 1 << 30), 32 << 20);
        assert_eq!(window_for(1 << 20, 1 << 30), FLOOR_BYTES);
        assert_eq!(window_for(100 << 20, 4 << 20), 4 << 20);
        assert_eq!(window_for(100 << 20, 512 << 10), 512 << 10);
    }

    #[test]
    fn low_space_has_a_hysteresis() {
        let w = 8 << 20;
        let edge = w + slack(w) + LOW_MARGIN;
        assert!(!is_below(edge, w, LOW_MARGIN, false));
        assert!(is_below(edge - 1, w, LOW_MARGIN, false));
        assert!(is_below(edge + 1, w, LOW_MARGIN, true));
        assert!(!is_below(edge + LOW_MARGIN, w, LOW_MARGIN, true));
        // The gate starts well before space is low.
        assert!(is_below(edge + (32 << 20), w, GATE_MARGIN, false));
    }

    #[test]
    fn the_systems_dirty_pages_bound_what_is_owed() {
        // Read from /proc/vmstat, with room for each CPU's unfolded counts.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let d = system_dirty_bytes().expect("nr_dirty and nr_writeback in /proc/vmstat");
        assert!(d >= cpus * 512 * page_size(), "{d}");
    }

    #[test]
    fn writes_count_the_pages_they_dirty() {
        assert_eq!(pages_for_write(0, 4096), 0);
        assert_eq!(pages_for_write(100, 4096), 8192);
        assert_eq!(pages_for_write(4096, 4096), 8192);
        assert_eq!(pages_for_write(4097, 4096), 12288);
        assert_eq!(pages_spanned(0, 4096, 4096), 4096);
        assert_eq!(pages_spanned(4095, 2, 4096), 8192);
        assert_eq!(pages_spanned(8192, 100, 4096), 4096);
        assert_eq!(pages_spanned(8192, 0, 4096), 0);
    }

    #[test]
    fn the_hold_covers_data_and_tree_blocks() {
        assert_eq!(hold_blocks(0, 3, 4096), 0);
        // 1 MiB in one file: 256 blocks, a leaf for up to 170 extents (two), and a
        // split of each level in two files' worth.
        assert_eq!(hold_blocks(1 << 20, 1, 4096), 256 + 2 + 12);
        assert_eq!(hold_blocks(1, 0, 1024), 1 + 1 + 6);
        // No more files can hold data than there are blocks of it.
        assert_eq!(hold_blocks(4096, 1000, 4096), 1 + 1 + 12);
    }
}
