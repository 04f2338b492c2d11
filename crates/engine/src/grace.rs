//! Grace periods for lockless readers (SEEDS lesson C, "RCU-safe inode reuse").
//!
//! Owns: a global epoch counter and a table of reader slots. A lockless reader (a path
//! walk or a FUSE lookup going name → inode number → inode through the dentry and
//! inode caches) holds a [`ReadGuard`] for the whole sequence; the guard publishes the
//! epoch it started in. Freeing an inode takes a [`Grace::stamp`] (the epoch before an
//! increment) after the inode has left the caches; the number may be handed out again
//! only once [`Grace::passed`] says every reader that could have seen the old inode has
//! finished. The allocator *polls* this and skips inodes still cooling (like busy
//! blocks); it never waits for readers, so allocation speed does not depend on how
//! many lookups are running.
//!
//! Must hold: a reader's loads of cache entries happen after its slot is published,
//! and a free's stamp is taken after the entries are gone (both SeqCst), so a reader
//! either published before the stamp (and is waited for) or cannot find the old entry.
//!
//! Slots: each thread gets a slot index once (thread-local, round-robin over
//! [`SLOTS`]); threads that share a slot share it through a count, and the slot keeps
//! the oldest epoch of the readers in it until the count drops to zero — conservative
//! (a busy shared slot delays reuse), never unsafe. Entering and leaving are a
//! compare-and-swap loop each: no locks on the read side.

use std::sync::atomic::{AtomicU64, Ordering};

/// Reader slots. More threads than this share slots (safe, only more conservative).
pub const SLOTS: usize = 64;

/// Slot word: the oldest epoch of its readers in the high 48 bits, the reader count in
/// the low 16. Zero means idle.
const COUNT_BITS: u32 = 16;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// The atomic word grace periods are built on (every access sequentially consistent):
/// std's in the engine, shuttle's in the model (`grace_model.rs`), so the model runs
/// this file's code under an adversarial scheduler.
pub trait Word: Send + Sync {
    fn with(v: u64) -> Self;
    fn get(&self) -> u64;
    /// Compare-and-swap; `Err` carries the value found.
    fn swap_if(&self, cur: u64, new: u64) -> Result<u64, u64>;
    fn add(&self, v: u64) -> u64;
}

impl Word for AtomicU64 {
    #[inline]
    fn with(v: u64) -> Self {
        AtomicU64::new(v)
    }
    #[inline]
    fn get(&self) -> u64 {
        self.load(Ordering::SeqCst)
    }
    #[inline]
    fn swap_if(&self, cur: u64, new: u64) -> Result<u64, u64> {
        self.compare_exchange_weak(cur, new, Ordering::SeqCst, Ordering::SeqCst)
    }
    #[inline]
    fn add(&self, v: u64) -> u64 {
        self.fetch_add(v, Ordering::SeqCst)
    }
}

#[repr(align(64))]
struct Slot<W>(W);

pub struct Grace<W: Word = AtomicU64> {
    epoch: W,
    slots: Box<[Slot<W>]>,
}

impl Default for Grace {
    fn default() -> Self {
        Grace::new()
    }
}

/// This thread's slot among `n` (a power of two: a mask, no division on the read path).
fn thread_slot(n: usize) -> usize {
    crate::striped::thread_ordinal() & (n - 1)
}

thread_local! {
    /// The reads this thread has active: (the `Grace` they belong to, how many) — the
    /// address `usize::MAX` once reads of two `Grace`s overlap (then unknown).
    static OWN: std::cell::Cell<(usize, u32)> = const { std::cell::Cell::new((0, 0)) };
}

impl Grace {
    pub fn new() -> Grace {
        Grace::with_slots(SLOTS)
    }
}

impl<W: Word> Grace<W> {
    /// A tracker with `n` reader slots (at least one; rounded up to a power of two).
    pub fn with_slots(n: usize) -> Grace<W> {
        Grace {
            // Epoch 0 would read as "idle" in a slot word; start at 1.
            epoch: W::with(1),
            slots: (0..n.max(1).next_power_of_two())
                .map(|_| Slot(W::with(0)))
                .collect(),
        }
    }

    /// Start a lockless read; the returned guard ends it.
    pub fn read(&self) -> ReadGuard<'_, W> {
        let g = self.read_in(thread_slot(self.slots.len()));
        let me = self as *const Grace<W> as usize;
        OWN.with(|o| {
            let (at, n) = o.get();
            o.set((if n == 0 || at == me { me } else { usize::MAX }, n + 1));
        });
        g
    }

    /// Start a read in slot `slot` (the model picks slots itself; its threads share
    /// one OS thread and so its thread-locals).
    fn read_in(&self, slot: usize) -> ReadGuard<'_, W> {
        let s = &self.slots[slot].0;
        let mut cur = s.get();
        loop {
            let count = cur & COUNT_MASK;
            let word = if count == 0 {
                // An epoch read before a concurrent stamp is older than it, which
                // only makes the stamp wait for us: safe either way.
                (self.epoch.get() << COUNT_BITS) | 1
            } else if count == COUNT_MASK {
                // Saturated (65535 readers in one slot): spin until one leaves.
                std::hint::spin_loop();
                cur = s.get();
                continue;
            } else {
                cur + 1
            };
            match s.swap_if(cur, word) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        ReadGuard { grace: self, slot }
    }

    /// Whether a read this thread has active holds `stamp` back (its slot's oldest
    /// epoch is not past it): this thread waiting for the stamp would wait for itself.
    /// False when unsure (reads of another `Grace` overlapped).
    pub fn held_by_this_thread(&self, stamp: u64) -> bool {
        let mine = OWN.with(|o| o.get()).0 == self as *const Grace<W> as usize;
        let w = self.slots[thread_slot(self.slots.len())].0.get();
        mine && w & COUNT_MASK != 0 && (w >> COUNT_BITS) <= stamp
    }

    /// Mark the moment something left the reader-visible structures; readers that
    /// started before it are what [`Grace::passed`] waits out.
    pub fn stamp(&self) -> u64 {
        self.epoch.add(1)
    }

    /// Whether every reader that was active at `stamp` has finished. Never blocks.
    pub fn passed(&self, stamp: u64) -> bool {
        self.slots.iter().all(|s| {
            let w = s.0.get();
            w & COUNT_MASK == 0 || (w >> COUNT_BITS) > stamp
        })
    }

    /// A bound every stamp below has passed: the oldest epoch an active reader started
    /// in, or the epoch when the scan began if that is older. Lets a caller check many
    /// stamps with one scan.
    ///
    /// The epoch is read first: a stamp taken while the slots are scanned (by a free
    /// that a reader, already past its slot when the scan read it, may have seen the
    /// old inode of) is at least that epoch, so it is never below the bound. Without it
    /// a scan that found no reader, followed by a free and the pruning of its new stamp
    /// against that stale "no reader", reused the number under the reader (the shuttle
    /// model below found the schedule).
    pub fn oldest_reader(&self) -> u64 {
        let now = self.epoch.get();
        self.slots
            .iter()
            .filter_map(|s| {
                let w = s.0.get();
                (w & COUNT_MASK != 0).then_some(w >> COUNT_BITS)
            })
            .min()
            .map_or(now, |m| m.min(now))
    }
}

/// An active lockless read (see [`Grace::read`]).
pub struct ReadGuard<'a, W: Word = AtomicU64> {
    grace: &'a Grace<W>,
    slot: usize,
}

impl<W: Word> Drop for ReadGuard<'_, W> {
    fn drop(&mut self) {
        // `try_with`: a guard dropped while the thread's locals are torn down.
        let _ = OWN.try_with(|o| {
            let (at, n) = o.get();
            o.set(if n <= 1 { (0, 0) } else { (at, n - 1) });
        });
        let s = &self.grace.slots[self.slot].0;
        let mut cur = s.get();
        loop {
            let word = if cur & COUNT_MASK <= 1 { 0 } else { cur - 1 };
            match s.swap_if(cur, word) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_stamp_passes_once_older_readers_leave() {
        let g = Grace::new();
        let s0 = g.stamp();
        assert!(g.passed(s0), "no readers: passed at once");
        let r = g.read();
        let s1 = g.stamp();
        assert!(
            !g.passed(s1),
            "a reader from before the stamp is still active"
        );
        let later = g.read(); // same thread, same slot: shares it
        assert!(!g.passed(s1));
        drop(r);
        assert!(
            !g.passed(s1),
            "the slot keeps its oldest epoch while shared"
        );
        assert!(g.held_by_this_thread(s1), "this thread's own reads hold it");
        drop(later);
        assert!(g.passed(s1));
        assert!(!g.held_by_this_thread(s1));
        // A reader that starts after the stamp does not hold it back.
        let s2 = g.stamp();
        let _r = g.read();
        assert!(g.passed(s2));
        assert!(g.oldest_reader() > s2);
    }

    #[test]
    fn readers_on_other_threads_hold_stamps() {
        let g = Arc::new(Grace::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let g2 = g.clone();
        let t = std::thread::spawn(move || {
            let _r = g2.read();
            tx.send(()).expect("send");
            go_rx.recv().expect("recv");
        });
        rx.recv().expect("reader started");
        let s = g.stamp();
        assert!(!g.passed(s));
        go_tx.send(()).expect("go");
        t.join().expect("join");
        assert!(g.passed(s));
    }
}

/// SEEDS lesson C under shuttle: this file's [`Grace`] (on shuttle's atomics) with the
/// free and the allocation of `alloc.rs` and lockless readers of the dentry and inode
/// caches around it. Random and PCT schedules.
///
/// The model filesystem: the name `link` names inode 1, a symlink whose target is
/// `OLD`; inode 2 is free. Each inode number has an on-disk record and an inode-cache
/// entry (0: none). Threads:
/// - three readers, as a FUSE LOOKUP or a path walk (`Fs::read_guard`), twice each:
///   under one guard, name → number from the dentry, then the inode in three reads
///   (a target read piecewise), each from the cache, the record on a miss; two of them share a reader slot (the slot's count and
///   oldest epoch);
/// - the unlinker, as `unlink` then `Fs::free_inode`: the name leaves the dentry cache
///   and the directory, then the inode leaves the cache and the record is cleared, the
///   stamp is taken, the number goes into the cooling map (the allocator's `busy`
///   mutex) and its bitmap bit is cleared (the group's mutex);
/// - the creator, as `alloc_inode` twice (two new files, `NEW`; the second once inode 1
///   was freed): forget stamps older
///   than every reader (`oldest_reader`), take the first number free in the bitmap and
///   not cooling; with none, wait for the newest cooling stamp once (`wait_grace`) and
///   look again. It writes the new record and caches it.
///
/// Must hold: a reader that found `link` gets `OLD` or nothing (the inode is gone) —
/// never `NEW`, another file's inode read as the link's; the creator always gets its
/// two numbers (inode 1 once its stamp passed). The broken variants must each be
/// caught: the number reused at once (no cooling), the stamp taken before the name
/// and the inode left the caches, and a reader whose guard ends between the name and
/// the inode.
#[cfg(test)]
mod model {
    use super::{Grace, Word};
    use shuttle::sync::atomic::{AtomicU64 as Atom, Ordering};
    use shuttle::sync::{Arc, Mutex};
    use shuttle::thread;
    use std::collections::HashMap;

    impl Word for Atom {
        fn with(v: u64) -> Self {
            Atom::new(v)
        }
        fn get(&self) -> u64 {
            self.load(Ordering::SeqCst)
        }
        fn swap_if(&self, cur: u64, new: u64) -> Result<u64, u64> {
            self.compare_exchange_weak(cur, new, Ordering::SeqCst, Ordering::SeqCst)
        }
        fn add(&self, v: u64) -> u64 {
            self.fetch_add(v, Ordering::SeqCst)
        }
    }

    const OLD: u64 = 0xA;
    const NEW: u64 = 0xB;
    /// Inode numbers 1 and 2 (index 0 unused).
    const INODES: usize = 3;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Broken {
        None,
        /// The free records no cooling stamp: the number may be handed out at once.
        ReuseAtOnce,
        /// The stamp is taken before the name and the inode leave the caches.
        StampFirst,
        /// A reader drops its guard after the name, before the inode.
        GuardTooShort,
        /// The allocator prunes cooling stamps against a scan of the readers alone,
        /// without the epoch read before it (a stamp taken during the scan is pruned
        /// against a stale "no reader"): the bug the random schedules found in CI.
        StaleBound,
    }

    struct World {
        grace: Grace<Atom>,
        /// The dentry of `link`: its inode number, 0 once removed.
        link: Atom,
        /// Inode cache entries and on-disk records, by number (0: none / cleared).
        cached: [Atom; INODES],
        record: [Atom; INODES],
        /// The group's inode bitmap (true: in use), under the group's mutex.
        bitmap: Mutex<[bool; INODES]>,
        /// Freed numbers and their stamps (`busy.cooling`).
        cooling: Mutex<HashMap<usize, u64>>,
        /// Set once the unlinker is done.
        freed: Atom,
    }

    /// Two lookups of `link`, each under its own guard.
    fn reader(w: &World, slot: usize, b: Broken) {
        for _ in 0..2 {
            lookup(w, slot, b);
            thread::yield_now();
        }
    }

    fn lookup(w: &World, slot: usize, b: Broken) {
        let g = w.grace.read_in(slot);
        let ino = w.link.load(Ordering::SeqCst) as usize;
        if ino == 0 {
            return;
        }
        let g = if b == Broken::GuardTooShort {
            drop(g);
            None
        } else {
            Some(g)
        };
        // The inode is read in three steps (a symlink's target read piecewise), each
        // through the cache, the record on a miss.
        for _ in 0..3 {
            thread::yield_now();
            let mut got = w.cached[ino].load(Ordering::SeqCst);
            if got == 0 {
                got = w.record[ino].load(Ordering::SeqCst);
            }
            assert!(
                got == OLD || got == 0,
                "a reader of `link` got inode {ino} of another file ({got:#x})"
            );
        }
        drop(g);
    }

    fn unlink_and_free(w: &World, b: Broken) {
        let ino = 1usize;
        let early = (b == Broken::StampFirst).then(|| w.grace.stamp());
        w.link.store(0, Ordering::SeqCst);
        thread::yield_now();
        w.cached[ino].store(0, Ordering::SeqCst);
        w.record[ino].store(0, Ordering::SeqCst);
        let stamp = early.unwrap_or_else(|| w.grace.stamp());
        let mut bits = w.bitmap.lock().unwrap_or_else(|p| p.into_inner());
        if b != Broken::ReuseAtOnce {
            w.cooling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ino, stamp);
        }
        bits[ino] = false;
        w.freed.store(1, Ordering::SeqCst);
    }

    /// `StaleBound`'s bound: the oldest active reader's epoch, `u64::MAX` with none.
    fn readers_only(g: &Grace<Atom>) -> u64 {
        g.slots
            .iter()
            .filter_map(|s| {
                let w = s.0.get();
                (w & super::COUNT_MASK != 0).then_some(w >> super::COUNT_BITS)
            })
            .min()
            .unwrap_or(u64::MAX)
    }

    /// One pass of `alloc_inode_pass`.
    fn alloc_pass(w: &World, b: Broken) -> Option<usize> {
        let oldest = if b == Broken::StaleBound {
            readers_only(&w.grace)
        } else {
            w.grace.oldest_reader()
        };
        w.cooling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, s| *s >= oldest);
        let mut bits = w.bitmap.lock().unwrap_or_else(|p| p.into_inner());
        let cooling = w.cooling.lock().unwrap_or_else(|p| p.into_inner());
        let ino = (1..INODES).find(|&i| !bits[i] && !cooling.contains_key(&i))?;
        bits[ino] = true;
        Some(ino)
    }

    /// `wait_grace` for the newest cooling stamp; false when nothing is cooling.
    fn wait_newest_cooling(w: &World) -> bool {
        let newest = w
            .cooling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .max();
        let Some(stamp) = newest else {
            return false;
        };
        while !w.grace.passed(stamp) {
            thread::yield_now();
        }
        true
    }

    fn alloc(w: &World, b: Broken) -> usize {
        for attempt in 0..2 {
            if let Some(ino) = alloc_pass(w, b) {
                return ino;
            }
            if attempt == 1 || !wait_newest_cooling(w) {
                break;
            }
        }
        panic!("no inode for the creator");
    }

    /// Two creates, the second after the unlink freed inode 1 (before it, there may be
    /// no number for it: ENOSPC, not what the model is about).
    fn create_two(w: &World, b: Broken) {
        for n in 0..2 {
            while n == 1 && w.freed.load(Ordering::SeqCst) == 0 {
                thread::yield_now();
            }
            let ino = alloc(w, b);
            w.record[ino].store(NEW, Ordering::SeqCst);
            thread::yield_now();
            w.cached[ino].store(NEW, Ordering::SeqCst);
        }
    }

    /// `link` naming inode 1 (`OLD`, cached and on disk), the bitmap as given.
    fn world(bitmap: [bool; INODES]) -> Arc<World> {
        Arc::new(World {
            grace: Grace::with_slots(2),
            link: Atom::new(1),
            cached: [Atom::new(0), Atom::new(OLD), Atom::new(0)],
            record: [Atom::new(0), Atom::new(OLD), Atom::new(0)],
            bitmap: Mutex::new(bitmap),
            cooling: Mutex::new(HashMap::new()),
            freed: Atom::new(0),
        })
    }

    fn scenario(b: Broken) {
        let w = world([true, true, false]);
        let mut ts = Vec::new();
        // Two readers in slot 0 (shared), one in slot 1.
        for slot in [0, 0, 1] {
            let w = w.clone();
            ts.push(thread::spawn(move || reader(&w, slot, b)));
        }
        let w1 = w.clone();
        ts.push(thread::spawn(move || unlink_and_free(&w1, b)));
        let w2 = w.clone();
        ts.push(thread::spawn(move || create_two(&w2, b)));
        for t in ts {
            t.join().expect("join");
        }
        assert_eq!(w.link.load(Ordering::SeqCst), 0);
        assert!(
            w.bitmap.lock().unwrap_or_else(|p| p.into_inner())[1..]
                .iter()
                .all(|&u| u),
            "the creator did not end up with both numbers"
        );
    }

    /// The free racing the creator's first pass: no number is free until the unlinker
    /// frees inode 1, and the creator looks again and again (a pass, then a wait for
    /// the newest cooling stamp), while one reader looks `link` up once. The schedule
    /// the random search found in CI, made short: the creator's scan sees no reader,
    /// the reader then finds the name, the unlinker frees the number, and the creator
    /// prunes the new stamp.
    fn race_scenario(b: Broken) {
        let w = world([true, true, true]);
        let wr = w.clone();
        let r = thread::spawn(move || lookup(&wr, 0, b));
        let wu = w.clone();
        let u = thread::spawn(move || unlink_and_free(&wu, b));
        let wc = w.clone();
        let c = thread::spawn(move || loop {
            if let Some(ino) = alloc_pass(&wc, b) {
                wc.record[ino].store(NEW, Ordering::SeqCst);
                thread::yield_now();
                wc.cached[ino].store(NEW, Ordering::SeqCst);
                return;
            }
            wait_newest_cooling(&wc);
            thread::yield_now();
        });
        for t in [r, u, c] {
            t.join().expect("join");
        }
    }

    #[test]
    fn inode_reuse_waits_for_readers_under_random_schedules() {
        shuttle::check_random(|| scenario(Broken::None), 10_000);
        shuttle::check_random(|| race_scenario(Broken::None), 10_000);
    }

    #[test]
    fn inode_reuse_waits_for_readers_under_pct_schedules() {
        shuttle::check_pct(|| scenario(Broken::None), 10_000, 3);
        shuttle::check_pct(|| race_scenario(Broken::None), 10_000, 3);
    }

    /// Run the broken variant `b` over `n` random schedules, then `n` PCT schedules of
    /// depth 3, of both scenarios: it must fail, with a message containing `expect`.
    fn caught(b: Broken, n: usize, expect: &str) {
        crate::fs::model_check::expect_caught(&b, expect, || {
            shuttle::check_random(move || scenario(b), n);
            shuttle::check_pct(move || scenario(b), n, 3);
            shuttle::check_random(move || race_scenario(b), n);
            shuttle::check_pct(move || race_scenario(b), n, 3);
        });
    }

    /// The seed's bug: a freed number handed out again while a reader that found the
    /// old name still reads it.
    #[test]
    fn the_model_catches_reuse_without_a_grace_period() {
        caught(Broken::ReuseAtOnce, 5000, "of another file");
    }

    /// A stamp taken while the name is still reachable does not wait for the readers
    /// that find it after the stamp.
    #[test]
    fn the_model_catches_a_stamp_taken_before_the_caches_forget() {
        caught(Broken::StampFirst, 5000, "of another file");
    }

    /// A guard must cover the whole walk from the name to the inode.
    #[test]
    fn the_model_catches_a_guard_that_ends_before_the_inode_is_read() {
        caught(Broken::GuardTooShort, 5000, "of another file");
    }

    /// The allocator's bound must not be older than its scan: the epoch is read first.
    #[test]
    fn the_model_catches_a_prune_bound_without_the_epoch() {
        // Rarer than the others (the creator must stop between its scan and its prune
        // for a whole lookup and free): more schedules of the short scenario.
        crate::fs::model_check::expect_caught(&Broken::StaleBound, "of another file", || {
            shuttle::check_random(|| race_scenario(Broken::StaleBound), 100_000);
            shuttle::check_pct(|| race_scenario(Broken::StaleBound), 100_000, 3);
        });
    }
}
