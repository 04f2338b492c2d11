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

#[repr(align(64))]
struct Slot(AtomicU64);

pub struct Grace {
    epoch: AtomicU64,
    slots: Box<[Slot]>,
}

impl Default for Grace {
    fn default() -> Self {
        Grace::new()
    }
}

fn thread_slot() -> usize {
    crate::striped::thread_ordinal() % SLOTS
}

thread_local! {
    /// The reads this thread has active: (the `Grace` they belong to, how many) — the
    /// address `usize::MAX` once reads of two `Grace`s overlap (then unknown).
    static OWN: std::cell::Cell<(usize, u32)> = const { std::cell::Cell::new((0, 0)) };
}

impl Grace {
    pub fn new() -> Grace {
        Grace {
            // Epoch 0 would read as "idle" in a slot word; start at 1.
            epoch: AtomicU64::new(1),
            slots: (0..SLOTS).map(|_| Slot(AtomicU64::new(0))).collect(),
        }
    }

    /// Start a lockless read; the returned guard ends it.
    pub fn read(&self) -> ReadGuard<'_> {
        let slot = thread_slot();
        let s = &self.slots[slot].0;
        let mut cur = s.load(Ordering::SeqCst);
        loop {
            let count = cur & COUNT_MASK;
            let word = if count == 0 {
                // An epoch read before a concurrent stamp is older than it, which
                // only makes the stamp wait for us: safe either way.
                (self.epoch.load(Ordering::SeqCst) << COUNT_BITS) | 1
            } else if count == COUNT_MASK {
                // Saturated (65535 readers in one slot): spin until one leaves.
                std::hint::spin_loop();
                cur = s.load(Ordering::SeqCst);
                continue;
            } else {
                cur + 1
            };
            match s.compare_exchange_weak(cur, word, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let me = self as *const Grace as usize;
        OWN.with(|o| {
            let (at, n) = o.get();
            o.set((if n == 0 || at == me { me } else { usize::MAX }, n + 1));
        });
        ReadGuard { grace: self, slot }
    }

    /// Whether a read this thread has active holds `stamp` back (its slot's oldest
    /// epoch is not past it): this thread waiting for the stamp would wait for itself.
    /// False when unsure (reads of another `Grace` overlapped).
    pub fn held_by_this_thread(&self, stamp: u64) -> bool {
        let mine = OWN.with(|o| o.get()).0 == self as *const Grace as usize;
        let w = self.slots[thread_slot()].0.load(Ordering::SeqCst);
        mine && w & COUNT_MASK != 0 && (w >> COUNT_BITS) <= stamp
    }

    /// Mark the moment something left the reader-visible structures; readers that
    /// started before it are what [`Grace::passed`] waits out.
    pub fn stamp(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether every reader that was active at `stamp` has finished. Never blocks.
    pub fn passed(&self, stamp: u64) -> bool {
        self.slots.iter().all(|s| {
            let w = s.0.load(Ordering::SeqCst);
            w & COUNT_MASK == 0 || (w >> COUNT_BITS) > stamp
        })
    }

    /// The oldest epoch any active reader started in (`u64::MAX` with none): every
    /// stamp below it has passed. Lets a caller check many stamps with one scan.
    pub fn oldest_reader(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|s| {
                let w = s.0.load(Ordering::SeqCst);
                (w & COUNT_MASK != 0).then_some(w >> COUNT_BITS)
            })
            .min()
            .unwrap_or(u64::MAX)
    }
}

/// An active lockless read (see [`Grace::read`]).
pub struct ReadGuard<'a> {
    grace: &'a Grace,
    slot: usize,
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        // `try_with`: a guard dropped while the thread's locals are torn down.
        let _ = OWN.try_with(|o| {
            let (at, n) = o.get();
            o.set(if n <= 1 { (0, 0) } else { (at, n - 1) });
        });
        let s = &self.grace.slots[self.slot].0;
        let mut cur = s.load(Ordering::SeqCst);
        loop {
            let word = if cur & COUNT_MASK <= 1 { 0 } else { cur - 1 };
            match s.compare_exchange_weak(cur, word, Ordering::SeqCst, Ordering::SeqCst) {
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
