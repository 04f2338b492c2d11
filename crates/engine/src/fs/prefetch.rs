//! Block bitmaps on a huge filesystem: loaded on demand, prefetched in batches, warmed
//! in the background, and what it all cost ([`IoStats`]).
//!
//! On a device where a read costs milliseconds what counts is how many reads are
//! issued one after another (SEEDS §D). Open reads the superblock, the descriptor table
//! (in large requests, all in flight: `read_groups`) and the journal's superblock;
//! bitmaps and inode tables are read when first needed. Then:
//!
//! - **Summaries.** Each group keeps `Group::longest_free`, an upper bound on its
//!   longest free run, known once its bitmap has been looked at (here, or by a failed
//!   search). Allocating only shortens runs, so the bound stays true; a free can only
//!   join runs around what it freed, so it measures that one run in the bitmap it just
//!   changed (in the cache) and keeps the larger of it and the bound (a whole-bitmap
//!   scan at every free cost the pwrite/ftruncate loop of SEEDS lesson B half its
//!   rate).
//!   A search for a long run skips groups whose bound is too short, without I/O, as it
//!   skips groups whose free count is.
//! - **The allocator's passes** (`alloc::alloc_blocks`): first only groups that cost no
//!   I/O — BLOCK_UNINIT ones, those whose bitmap is cached or whose summary says the
//!   request fits — besides the goal group itself (the kernel's cheap criteria skip
//!   groups whose buddy is not loaded the same way); then every group, and the first
//!   bitmap missing from the cache brings in a batch ([`Fs::prefetch_groups`]): the
//!   next `mb_prefetch` groups of the scan that could satisfy the request, their
//!   bitmaps read as runs of adjacent blocks (a flex group's bitmaps are adjacent: one
//!   request for 16 groups), all in flight together. One allocation prefetches at most
//!   `mb_prefetch_limit` groups; past that, bitmaps load one at a time. Defaults are
//!   the kernel's: `mb_prefetch` = 8 x groups per flex group (32 without flex_bg),
//!   `mb_prefetch_limit` = 4 x that, both at most the group count.
//! - **The background prefetcher** (`start_prefetcher`, mount option
//!   `prefetch_block_bitmaps`, on by default for read-write opens) summarizes every
//!   group from [`START_DELAY`] after open, at idle I/O and CPU priority, one request
//!   at a time, and only after the
//!   device has had no foreground request for [`QUIET`]: a foreground request waits for
//!   at most the one prefetch request in flight. Its reads bypass the buffer cache (a
//!   16 TiB filesystem has 512 MiB of bitmaps) and count as background in
//!   [`crate::device::latency::Counted`]. It stops at close, between two requests.
//!
//! A summary computed from a bitmap read without the group's mutex is kept only if the
//! group did not change meanwhile (`Group::bitmap_gen`) and its bitmap is not cached
//! (a cached one may be newer than the device's: dirty or logged blocks are never
//! dropped, so an uncached bitmap's home copy is its latest).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use rext4_format::group::FLAG_BLOCK_UNINIT;
use rext4_format::superblock::feature;

use crate::device::latency::IoCounts;
use crate::error::Result;
use crate::fs::{Fs, Group, MAX_REQUEST_BYTES};

/// How long the device must have been free of foreground requests before the
/// background prefetcher issues its next one.
pub const QUIET: Duration = Duration::from_millis(10);

/// How long after open the background prefetcher waits before its first request.
pub const START_DELAY: Duration = Duration::from_secs(1);

/// What the filesystem has read and written, and what its allocator cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Every request to the device since open (open's included).
    pub device: IoCounts,
    /// The requests open made (superblock, descriptor table, journal, orphans).
    pub at_open: IoCounts,
    /// Block allocations (calls into the block allocator).
    pub allocations: u64,
    /// Block bitmaps the allocator read one at a time.
    pub bitmaps_read: u64,
    /// Block bitmaps the allocator read in batches, and the requests they took.
    pub bitmaps_prefetched: u64,
    pub prefetch_requests: u64,
    /// Groups the background prefetcher summarized, and its requests.
    pub background_groups: u64,
    pub background_requests: u64,
    /// Direct writes that overwrote written blocks under the shared I/O lock, and
    /// those that took it exclusively (allocating, converting, zeroing, extending).
    pub direct_shared: u64,
    pub direct_exclusive: u64,
}

impl IoStats {
    /// Device reads made by allocations (bitmaps, singly and in batches).
    pub fn allocation_reads(&self) -> u64 {
        self.bitmaps_read + self.prefetch_requests
    }
}

/// The prefetch settings and counters of one open filesystem.
pub(crate) struct Prefetch {
    /// Groups one batch reads (`mb_prefetch`).
    pub(crate) batch: usize,
    /// Groups one allocation may prefetch (`mb_prefetch_limit`).
    pub(crate) limit: usize,
    pub(crate) allocations: AtomicU64,
    pub(crate) bitmaps_read: AtomicU64,
    bitmaps_prefetched: AtomicU64,
    prefetch_requests: AtomicU64,
    background_groups: AtomicU64,
    background_requests: AtomicU64,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Prefetch {
    /// The kernel's defaults for `sb`, or the given values (each at least 1 and at
    /// most the group count).
    pub(crate) fn new(
        sb: &rext4_format::superblock::Superblock,
        batch: Option<u32>,
        limit: Option<u32>,
    ) -> Prefetch {
        let groups = sb.group_count().max(1) as usize;
        let default_batch = if sb.has_incompat(feature::INCOMPAT_FLEX_BG) {
            let flex = 1usize << sb.log_groups_per_flex.min(20);
            flex.min(8192) * 8
        } else {
            32
        };
        let batch = batch
            .map(|b| b as usize)
            .unwrap_or(default_batch)
            .clamp(1, groups);
        let limit = limit
            .map(|l| l as usize)
            .unwrap_or(batch * 4)
            .clamp(1, groups);
        Prefetch {
            batch,
            limit,
            allocations: AtomicU64::new(0),
            bitmaps_read: AtomicU64::new(0),
            bitmaps_prefetched: AtomicU64::new(0),
            prefetch_requests: AtomicU64::new(0),
            background_groups: AtomicU64::new(0),
            background_requests: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
        }
    }

    /// Stop the background prefetcher and wait for it (unless called from it).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Relaxed);
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// The longest run of clear bits among the first `n` of `b` (bit `i` is bit `i % 8`
/// of byte `i / 8`, as in every ext4 bitmap), a 64-bit word at a time.
/// The length of the free run of the first `n` bits of `b` that holds the free bits
/// `[start, end)`: from the nearest used bit (or the start) before them to the nearest
/// used bit (or `n`) after them. Whole free words and bytes are stepped over at once.
pub(crate) fn free_run_around(b: &[u8], start: u64, end: u64, n: u64) -> u64 {
    let n = n.min(b.len() as u64 * 8);
    let used = |x: u64| (b[(x / 8) as usize] >> (x % 8)) & 1 == 1;
    // The 64 bits from bit `x` (a multiple of 64) are all free.
    let free64 = |x: u64| {
        b[(x / 8) as usize..(x / 8 + 8) as usize]
            .iter()
            .all(|&v| v == 0)
    };
    let mut lo = start.min(n);
    while lo > 0 {
        if lo.is_multiple_of(64) && lo >= 64 && free64(lo - 64) {
            lo -= 64;
        } else if lo.is_multiple_of(8) && b[(lo / 8 - 1) as usize] == 0 {
            lo -= 8;
        } else if used(lo - 1) {
            break;
        } else {
            lo -= 1;
        }
    }
    let mut hi = end.min(n).max(lo);
    while hi < n {
        if hi.is_multiple_of(64) && hi + 64 <= n && free64(hi) {
            hi += 64;
        } else if hi.is_multiple_of(8) && hi + 8 <= n && b[(hi / 8) as usize] == 0 {
            hi += 8;
        } else if used(hi) {
            break;
        } else {
            hi += 1;
        }
    }
    hi - lo
}

pub(crate) fn longest_free_run(b: &[u8], n: u64) -> u32 {
    let n = n.min(b.len() as u64 * 8);
    let (mut best, mut run) = (0u64, 0u64);
    let mut at = 0u64;
    while at < n {
        let i = (at / 8) as usize;
        let mut bytes = [0xFFu8; 8];
        let avail = (b.len() - i).min(8);
        bytes[..avail].copy_from_slice(&b[i..i + avail]);
        let mut w = u64::from_le_bytes(bytes);
        let bits = (n - at).min(64);
        if bits < 64 {
            // Bits past `n` count as used.
            w |= !0u64 << bits;
        }
        match w {
            0 => run += 64,
            u64::MAX => {
                best = best.max(run);
                run = 0;
            }
            _ => {
                // The zeros below the lowest set bit end the run coming in; the
                // zeros above the highest set bit start the one going out; between,
                // each gap between set bits is a run of its own.
                best = best.max(run + u64::from(w.trailing_zeros()));
                let mut x = w >> w.trailing_zeros();
                while x != 0 {
                    x >>= x.trailing_ones().min(63);
                    if x & 1 == 1 {
                        // All 64 bits were ones (only when the shift was capped).
                        x >>= 1;
                    }
                    if x == 0 {
                        break;
                    }
                    let gap = u64::from(x.trailing_zeros());
                    best = best.max(gap);
                    x >>= gap;
                }
                run = u64::from(w.leading_zeros());
            }
        }
        at += 64;
    }
    best.max(run).min(u64::from(u32::MAX)) as u32
}

impl Group {
    /// Whether the group may hold a free run of `need` blocks, as far as its
    /// descriptor (free count) and summary (longest run) tell.
    pub(crate) fn may_hold(&self, need: u64) -> bool {
        u64::from(self.desc.free_blocks_count) >= need
            && (need == 1 || self.longest_free.is_none_or(|l| u64::from(l) >= need))
    }

    /// Record the longest free run of `bitmap`, the group's block bitmap as it is
    /// now, over its `blocks` blocks.
    pub(crate) fn summarize(&mut self, bitmap: &[u8], blocks: u64) {
        self.longest_free = Some(longest_free_run(bitmap, blocks));
    }
}

impl Fs {
    /// What this filesystem has read and written since open, and what its allocator
    /// cost.
    pub fn io_stats(&self) -> IoStats {
        let p = &self.inner.prefetch;
        IoStats {
            device: self.inner.io.counts(),
            at_open: self.inner.io_at_open.get().copied().unwrap_or_default(),
            allocations: p.allocations.load(Relaxed),
            bitmaps_read: p.bitmaps_read.load(Relaxed),
            bitmaps_prefetched: p.bitmaps_prefetched.load(Relaxed),
            prefetch_requests: p.prefetch_requests.load(Relaxed),
            background_groups: p.background_groups.load(Relaxed),
            background_requests: p.background_requests.load(Relaxed),
            direct_shared: self.inner.dio_shared.sum(),
            direct_exclusive: self.inner.dio_exclusive.sum(),
        }
    }

    /// Whether `grp`'s block bitmap is in memory: implicit (BLOCK_UNINIT) or cached.
    pub(crate) fn bitmap_in_memory(&self, grp: &Group) -> bool {
        grp.desc.has_flag(FLAG_BLOCK_UNINIT) || self.cache().contains(grp.desc.block_bitmap)
    }

    /// Whether `grp`'s block bitmap costs no I/O to search: in memory, or summarized
    /// with a run of `need` (then one read finds it).
    pub(crate) fn bitmap_at_hand(&self, grp: &Group, need: u64) -> bool {
        self.bitmap_in_memory(grp) || grp.longest_free.is_some_and(|l| u64::from(l) >= need)
    }

    /// Read the block bitmaps of the groups `order` yields that may hold a run of
    /// `need` blocks and are not at hand, up to `max` of them, as one batch (runs of
    /// adjacent blocks, all in flight) into the cache, and summarize each. Returns
    /// how many groups it read. No group mutex may be held by the caller.
    pub(crate) fn prefetch_groups(
        &self,
        order: impl Iterator<Item = usize>,
        need: u64,
        max: usize,
    ) -> Result<usize> {
        let mut picked: Vec<(usize, u64)> = Vec::new();
        for g in order {
            if picked.len() >= max {
                break;
            }
            let grp = self.group(g)?;
            if !grp.may_hold(need) || self.bitmap_in_memory(&grp) {
                continue;
            }
            picked.push((g, grp.desc.block_bitmap));
        }
        if picked.is_empty() {
            return Ok(0);
        }
        let blocks: Vec<u64> = picked.iter().map(|&(_, b)| b).collect();
        let max_run = MAX_REQUEST_BYTES / self.cache().block_size();
        let (_, requests) = self.cache().read_batch(&blocks, max_run)?;
        let p = &self.inner.prefetch;
        p.bitmaps_prefetched.fetch_add(picked.len() as u64, Relaxed);
        p.prefetch_requests.fetch_add(requests as u64, Relaxed);
        for &(g, _) in &picked {
            let mut grp = self.group(g)?;
            if grp.desc.has_flag(FLAG_BLOCK_UNINIT) || !self.cache().contains(grp.desc.block_bitmap)
            {
                continue;
            }
            let b = self.block_bitmap(g, &grp)?;
            grp.summarize(&b, self.inner.sb.clusters_in_group(g as u64));
        }
        Ok(picked.len())
    }
}

/// Start the background prefetcher of a read-write filesystem (see the module note).
pub(crate) fn start_prefetcher(fs: &Fs) {
    let weak = std::sync::Arc::downgrade(&fs.inner);
    let spawned = std::thread::Builder::new()
        .name("rext4-prefetch".into())
        .spawn(move || {
            crate::device::latency::mark_background();
            set_idle_priority();
            // Not while the filesystem is being put to use (a mount's first requests,
            // a tool's first operations): the kernel's prefetch starts late too.
            let start = std::time::Instant::now();
            while start.elapsed() < START_DELAY {
                std::thread::sleep(Duration::from_millis(10));
                match weak.upgrade() {
                    Some(inner) if !inner.prefetch.stop.load(Relaxed) => {}
                    _ => return,
                }
            }
            let ngroups = match weak.upgrade() {
                Some(inner) => {
                    // Its quiet rule needs the device's foreground activity.
                    inner.io.watch_foreground(true);
                    inner.groups.len()
                }
                None => return,
            };
            let mut g = 0usize;
            while g < ngroups {
                let Some(inner) = weak.upgrade() else { return };
                let fs = Fs { inner };
                match background_step(&fs, g) {
                    Some(next) => g = next,
                    None => break,
                }
            }
            if let Some(inner) = weak.upgrade() {
                inner.io.watch_foreground(false);
            }
        });
    if let Ok(t) = spawned {
        *fs.inner
            .prefetch
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(t);
    }
}

/// One request of the background prefetcher, from group `g` on: wait for a quiet
/// device, read the next run of adjacent bitmaps of unsummarized groups, summarize
/// them. Returns the group to go on from, or `None` to stop.
fn background_step(fs: &Fs, g: usize) -> Option<usize> {
    let p = &fs.inner.prefetch;
    let ngroups = fs.inner.groups.len();
    let bs = fs.cache().block_size();
    let max_run = (MAX_REQUEST_BYTES / bs).max(1);
    // The next run: groups whose bitmaps lie next to each other on the device.
    let mut run: Vec<(usize, u64, u32)> = Vec::new();
    let mut next = g;
    while next < ngroups && run.len() < max_run {
        if p.stop.load(Relaxed) || fs.check_writable().is_err() {
            return None;
        }
        let grp = fs.group(next).ok()?;
        let d = &grp.desc;
        let wanted =
            d.free_blocks_count > 0 && grp.longest_free.is_none() && !fs.bitmap_in_memory(&grp);
        let adjacent = run.last().is_none_or(|&(_, b, _)| b + 1 == d.block_bitmap);
        if wanted && !adjacent {
            break;
        }
        if wanted {
            run.push((next, d.block_bitmap, grp.bitmap_gen));
        } else if !run.is_empty() {
            next += 1;
            break;
        }
        next += 1;
    }
    if run.is_empty() {
        return Some(next);
    }
    // Wait for a quiet device.
    loop {
        if p.stop.load(Relaxed) || fs.check_writable().is_err() {
            return None;
        }
        let idle = fs.inner.io.foreground_idle();
        if idle >= QUIET {
            break;
        }
        std::thread::sleep((QUIET - idle).max(Duration::from_millis(1)));
    }
    let mut buf = vec![0u8; run.len() * bs];
    let dev = fs.cache().device();
    if dev.read_at(&mut buf, run[0].1 * bs as u64).is_err() {
        // Not this thread's to report: the allocator meets the error itself.
        return Some(next);
    }
    p.background_requests.fetch_add(1, Relaxed);
    for (i, &(grp_no, blk, gen)) in run.iter().enumerate() {
        let Ok(mut grp) = fs.group(grp_no) else {
            continue;
        };
        if grp.bitmap_gen != gen
            || grp.desc.block_bitmap != blk
            || grp.longest_free.is_some()
            || fs.cache().contains(blk)
        {
            continue;
        }
        let n = fs.inner.sb.clusters_in_group(grp_no as u64);
        grp.summarize(&buf[i * bs..(i + 1) * bs], n);
        p.background_groups.fetch_add(1, Relaxed);
    }
    Some(next)
}

/// Run this thread at idle priority: its I/O in the idle class, its CPU at nice 19
/// (best effort).
fn set_idle_priority() {
    // SAFETY: setpriority(2) on the calling thread (its tid) with integer arguments.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: libc::c_long = 3;
    const IOPRIO_CLASS_SHIFT: libc::c_long = 13;
    // SAFETY: ioprio_set(2) on the calling thread (0) with plain integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{free_run_around, longest_free_run};

    #[test]
    fn longest_free_run_counts_clear_bits_within_n() {
        let mut b = vec![0xFFu8; 16];
        assert_eq!(longest_free_run(&b, 128), 0);
        b[2] = 0; // bits 16..24
        b[3] = 0b1111_1100; // bits 24, 25 free
        assert_eq!(longest_free_run(&b, 128), 10);
        b[15] = 0; // bits 120..128, but only 124 count
        assert_eq!(longest_free_run(&b, 124), 10);
        assert_eq!(longest_free_run(&[0u8; 16], 100), 100);
        assert_eq!(longest_free_run(&[0b0101_0101u8; 4], 32), 1);
        assert_eq!(longest_free_run(&[0u8; 4096], 32768), 32768);
    }

    /// The run around a freed range, against a bit-by-bit walk, on random bitmaps of
    /// every density and length.
    #[test]
    fn free_run_around_matches_a_bit_by_bit_walk() {
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..3000 {
            let len = 1 + (next() % 64) as usize;
            let n = 1 + next() % (len as u64 * 8);
            let density = next() % 9;
            let mut b: Vec<u8> = (0..len)
                .map(|_| (0..8).fold(0u8, |a, k| a | (u8::from(next() % 8 < density) << k)))
                .collect();
            let start = next() % n;
            let end = (start + 1 + next() % 40).min(n);
            for k in start..end {
                b[(k / 8) as usize] &= !(1 << (k % 8));
            }
            let used = |k: u64| k >= n || (b[(k / 8) as usize] >> (k % 8)) & 1 == 1;
            let mut lo = start;
            while lo > 0 && !used(lo - 1) {
                lo -= 1;
            }
            let mut hi = end;
            while hi < n && !used(hi) {
                hi += 1;
            }
            assert_eq!(
                free_run_around(&b, start, end, n),
                hi - lo,
                "round {round}: {len} bytes, n {n}, freed {start}..{end}"
            );
        }
    }

    /// The word-at-a-time count agrees with a bit-by-bit one on random bitmaps of
    /// every density and length.
    #[test]
    fn longest_free_run_matches_a_bit_by_bit_count() {
        fn slow(b: &[u8], n: u64) -> u32 {
            let (mut best, mut run) = (0u32, 0u32);
            for x in 0..n {
                if b[(x / 8) as usize] >> (x % 8) & 1 == 1 {
                    run = 0;
                } else {
                    run += 1;
                    best = best.max(run);
                }
            }
            best
        }
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..2000 {
            let len = 1 + (next() % 40) as usize;
            let density = next() % 100;
            let b: Vec<u8> = (0..len)
                .map(|_| (0..8).fold(0u8, |acc, k| acc | (u8::from(next() % 100 < density) << k)))
                .collect();
            let n = 1 + next() % (len as u64 * 8);
            assert_eq!(
                longest_free_run(&b, n),
                slow(&b, n),
                "case {case}: {b:?} n={n}"
            );
        }
    }
}
