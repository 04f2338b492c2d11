//! Per-inode namespace locks: one lock per inode number (not striped), for the
//! operations that run as concurrent handles (`Fs::handle`).
//!
//! Owns: a sharded table of the inode numbers locked now; a shard's condition variable
//! wakes the threads waiting for one of its numbers. A number is in the table only
//! while someone holds it, so the table stays as small as the number of operations in
//! flight.
//!
//! Why not stripes (as the I/O locks are): an operation holds two inode locks at once
//! (a directory and its child, or two directories under the rename lock), and two
//! inodes that share a stripe would make a thread wait for a lock it holds, or make two
//! threads that lock in a correct order deadlock on a collision.
//!
//! The order (checked by `lockdep` ranks, documented in docs/ARCHITECTURE.md): a
//! handle first (`Rank::Write`, shared), then the rename lock when an operation
//! holds two directories, then directories (`Rank::Dir`: a parent before its child, or
//! under the rename lock in any order one thread chooses), then one non-directory
//! (`Rank::NonDir`), then block locks. A thread that holds a non-directory's lock waits
//! for no other inode lock; a thread that holds one directory's lock waits only for
//! its child's (which nobody holding that child waits against: only the rename lock's
//! holder takes a second directory above another), so there is no cycle.
//!
//! The table is generic over its shards' mutex and condition variable ([`ShardSync`]):
//! the filesystem uses std's ([`StdShard`], the default, so `InodeLocks` is the std
//! table), and `handle_model` runs this same code on shuttle's (`ShuttleShard`, tests
//! only) to explore its schedules.

use std::ops::DerefMut;
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::lockdep::Held;

const SHARDS: usize = 64;

/// Holder count of an inode held exclusively.
const EXCLUSIVE: u32 = u32::MAX;

/// The numbers of one shard locked now with their holders (a count of shared holders,
/// or [`EXCLUSIVE`]; a handful: a linear scan beats hashing), the numbers an exclusive
/// locker waits for (new shared lockers of those wait behind it, so a directory's
/// rmdir is not starved by a stream of creates in it), and how many threads wait for
/// one of them (no wake-up call when none does).
///
/// The lists are kept in the shard itself ([`Few`]), not in heap blocks: a block
/// written at every lock and unlock may share its cache line with blocks other
/// threads allocate and free (measured: with the lists in `Vec`s, unlocking cost a
/// creating thread 3.4 times as much beside a thread doing path lookups as alone, the
/// lookups' allocations landing next to the list; inline, 1.07 times).
#[derive(Default)]
pub(crate) struct Holders {
    inos: Few<(u32, u32), 6>,
    wanted: Few<u32, 2>,
    waiters: usize,
}

impl Holders {
    fn holders(&self, ino: u32) -> Option<u32> {
        self.inos.iter().find(|e| e.0 == ino).map(|e| e.1)
    }
}

/// A short list stored in place up to `N` items, on the heap beyond (all of it, until
/// it is empty again): the order of items is not kept.
pub(crate) struct Few<T, const N: usize> {
    len: usize,
    inline: [T; N],
    more: Vec<T>,
}

impl<T: Copy + Default, const N: usize> Default for Few<T, N> {
    fn default() -> Self {
        Few {
            len: 0,
            inline: [T::default(); N],
            more: Vec::new(),
        }
    }
}

impl<T: Copy + PartialEq, const N: usize> Few<T, N> {
    fn as_slice(&self) -> &[T] {
        if self.more.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.more
        }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        if self.more.is_empty() {
            &mut self.inline[..self.len]
        } else {
            &mut self.more
        }
    }

    fn iter(&self) -> std::slice::Iter<'_, T> {
        self.as_slice().iter()
    }

    fn iter_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.as_mut_slice().iter_mut()
    }

    fn contains(&self, x: &T) -> bool {
        self.as_slice().contains(x)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn push(&mut self, x: T) {
        if !self.more.is_empty() {
            self.more.push(x);
        } else if self.len < N {
            self.inline[self.len] = x;
            self.len += 1;
        } else {
            self.more.extend_from_slice(&self.inline[..self.len]);
            self.more.push(x);
            self.len = 0;
        }
    }

    /// Remove item `i`, the last one taking its place.
    fn swap_remove(&mut self, i: usize) {
        if !self.more.is_empty() {
            self.more.swap_remove(i);
            if self.more.is_empty() {
                // Back in place; the heap block is kept for the next overflow.
                self.len = 0;
            }
        } else {
            assert!(i < self.len, "swap_remove({i}) of {}", self.len);
            self.len -= 1;
            self.inline[i] = self.inline[self.len];
        }
    }
}

impl<T: Copy + PartialEq, const N: usize> std::ops::Index<usize> for Few<T, N> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.as_slice()[i]
    }
}

impl<T: Copy + PartialEq, const N: usize> std::ops::IndexMut<usize> for Few<T, N> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.as_mut_slice()[i]
    }
}

/// A shard's synchronisation: a mutex over its [`Holders`] and the condition variable
/// its waiters sleep on. Poisoning is ignored (the holders list is changed only in
/// steps that cannot panic halfway).
pub(crate) trait ShardSync: Send + Sync {
    type Guard<'a>: DerefMut<Target = Holders>
    where
        Self: 'a;
    fn new() -> Self;
    fn lock(&self) -> Self::Guard<'_>;
    /// Release the mutex, wait for a wake-up, take it again.
    fn wait<'a>(&'a self, g: Self::Guard<'a>) -> Self::Guard<'a>;
    fn notify_all(&self);
}

/// std's mutex and condition variable: the filesystem's shards.
pub(crate) struct StdShard {
    held: Mutex<Holders>,
    freed: Condvar,
}

impl ShardSync for StdShard {
    type Guard<'a> = MutexGuard<'a, Holders>;

    #[inline]
    fn new() -> StdShard {
        StdShard {
            held: Mutex::new(Holders::default()),
            freed: Condvar::new(),
        }
    }
    #[inline]
    fn lock(&self) -> MutexGuard<'_, Holders> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
    #[inline]
    fn wait<'a>(&'a self, g: MutexGuard<'a, Holders>) -> MutexGuard<'a, Holders> {
        self.freed.wait(g).unwrap_or_else(|p| p.into_inner())
    }
    #[inline]
    fn notify_all(&self) {
        self.freed.notify_all();
    }
}

/// shuttle's mutex and condition variable: the same table under shuttle's scheduler
/// (`handle_model`).
#[cfg(test)]
pub(crate) struct ShuttleShard {
    held: shuttle::sync::Mutex<Holders>,
    freed: shuttle::sync::Condvar,
}

#[cfg(test)]
impl ShardSync for ShuttleShard {
    type Guard<'a> = shuttle::sync::MutexGuard<'a, Holders>;

    fn new() -> ShuttleShard {
        ShuttleShard {
            held: shuttle::sync::Mutex::new(Holders::default()),
            freed: shuttle::sync::Condvar::new(),
        }
    }
    fn lock(&self) -> Self::Guard<'_> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn wait<'a>(&'a self, g: Self::Guard<'a>) -> Self::Guard<'a> {
        self.freed.wait(g).unwrap_or_else(|p| p.into_inner())
    }
    fn notify_all(&self) {
        self.freed.notify_all();
    }
}

/// One cache line per shard: threads locking inodes of different shards share none.
#[repr(align(64))]
struct Shard<S> {
    sync: S,
}

/// The table of locked inode numbers.
pub(crate) struct InodeLocks<S: ShardSync = StdShard> {
    shards: Box<[Shard<S>]>,
}

impl InodeLocks {
    /// The filesystem's table (std's mutexes).
    pub(crate) fn new() -> InodeLocks {
        InodeLocks::with_sync()
    }
}

impl<S: ShardSync> InodeLocks<S> {
    /// A table on the synchronisation `S`.
    pub(crate) fn with_sync() -> InodeLocks<S> {
        InodeLocks {
            shards: (0..SHARDS).map(|_| Shard { sync: S::new() }).collect(),
        }
    }

    fn shard(&self, ino: u32) -> &S {
        &self.shards[ino as usize % SHARDS].sync
    }

    /// Wait until `ino` is free and take it exclusively. `held` is the caller's
    /// lock-order record, kept by the guard.
    pub(crate) fn lock(&self, ino: u32, held: Held) -> InodeGuard<'_, S> {
        let s = self.shard(ino);
        let mut h = s.lock();
        let mut announced = false;
        while h.holders(ino).is_some() {
            if !announced {
                h.wanted.push(ino);
                announced = true;
            }
            h.waiters += 1;
            h = s.wait(h);
            h.waiters -= 1;
        }
        if announced {
            if let Some(i) = h.wanted.iter().position(|&x| x == ino) {
                h.wanted.swap_remove(i);
            }
        }
        h.inos.push((ino, EXCLUSIVE));
        InodeGuard {
            locks: self,
            ino,
            _held: held,
        }
    }

    /// Take `ino` shared with other shared holders: wait while someone holds it
    /// exclusively or waits to. See [`InodeLocks::lock`].
    pub(crate) fn lock_shared(&self, ino: u32, held: Held) -> InodeGuard<'_, S> {
        let s = self.shard(ino);
        let mut h = s.lock();
        while h.holders(ino) == Some(EXCLUSIVE) || h.wanted.contains(&ino) {
            h.waiters += 1;
            h = s.wait(h);
            h.waiters -= 1;
        }
        match h.inos.iter_mut().find(|e| e.0 == ino) {
            Some(e) => e.1 += 1,
            None => h.inos.push((ino, 1)),
        }
        InodeGuard {
            locks: self,
            ino,
            _held: held,
        }
    }

    /// Whether anyone holds `ino` now (for assertions).
    #[cfg(test)]
    pub(crate) fn is_locked(&self, ino: u32) -> bool {
        self.shard(ino).lock().holders(ino).is_some()
    }

    /// Whether no inode is locked and no thread waits (for assertions).
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.shards.iter().all(|s| {
            let h = s.sync.lock();
            h.inos.is_empty() && h.wanted.is_empty() && h.waiters == 0
        })
    }
}

/// One held inode lock; released when dropped (then its lock-order record).
pub(crate) struct InodeGuard<'a, S: ShardSync = StdShard> {
    locks: &'a InodeLocks<S>,
    ino: u32,
    _held: Held,
}

impl<S: ShardSync> Drop for InodeGuard<'_, S> {
    fn drop(&mut self) {
        let s = self.locks.shard(self.ino);
        let mut h = s.lock();
        if let Some(i) = h.inos.iter().position(|e| e.0 == self.ino) {
            // The last holder (or the exclusive one) frees it.
            match &mut h.inos[i].1 {
                n if *n > 1 && *n != EXCLUSIVE => *n -= 1,
                _ => {
                    h.inos.swap_remove(i);
                }
            }
        }
        if h.waiters > 0 {
            s.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lockdep::Rank;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    /// A `Few` keeps its items in place up to its size, on the heap past it, and in
    /// place again once emptied; removal moves the last item into the gap.
    #[test]
    fn few_spills_and_comes_back() {
        let mut f: Few<u32, 2> = Few::default();
        assert!(f.is_empty());
        f.push(1);
        f.push(2);
        assert!(f.more.is_empty(), "two fit in place");
        f.push(3);
        assert_eq!(f.as_slice(), &[1, 2, 3]);
        assert!(!f.more.is_empty());
        f.swap_remove(0);
        assert_eq!(f.as_slice(), &[3, 2]);
        f[1] = 7;
        assert!(f.contains(&7) && !f.contains(&2));
        f.swap_remove(1);
        f.swap_remove(0);
        assert!(f.is_empty() && f.more.is_empty());
        f.push(4);
        f.push(5);
        f.swap_remove(0);
        assert_eq!(f.as_slice(), &[5]);
        assert_eq!(f.iter().position(|&x| x == 5), Some(0));
        for x in f.iter_mut() {
            *x += 1;
        }
        assert_eq!(f[0], 6);
    }

    /// Shared holders hold together; an exclusive locker waits for all of them, and
    /// once it waits, new shared lockers wait behind it (no starvation by a stream of
    /// shared holders); it then holds alone.
    #[test]
    fn shared_holders_together_exclusive_alone_and_first() {
        use std::sync::atomic::AtomicBool;
        use std::time::Duration;
        let locks = Arc::new(InodeLocks::new());
        let a = locks.lock_shared(9, Held::acquire(11, Rank::Dir));
        let b = locks.lock_shared(9, Held::acquire(12, Rank::Dir));
        let excl_in = Arc::new(AtomicBool::new(false));
        let late_in = Arc::new(AtomicBool::new(false));
        let excl = {
            let (locks, excl_in) = (locks.clone(), excl_in.clone());
            std::thread::spawn(move || {
                let _g = locks.lock(9, Held::acquire(13, Rank::Dir));
                excl_in.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                excl_in.store(false, Ordering::SeqCst);
            })
        };
        // The exclusive locker is waiting: a new shared locker queues behind it.
        while locks.shard(9).lock().wanted.is_empty() {
            std::thread::yield_now();
        }
        let late = {
            let (locks, excl_in, late_in) = (locks.clone(), excl_in.clone(), late_in.clone());
            std::thread::spawn(move || {
                let _g = locks.lock_shared(9, Held::acquire(14, Rank::Dir));
                assert!(!excl_in.load(Ordering::SeqCst), "shared beside exclusive");
                late_in.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !excl_in.load(Ordering::SeqCst),
            "exclusive beside shared holders"
        );
        assert!(
            !late_in.load(Ordering::SeqCst),
            "a shared locker overtook a waiting exclusive one"
        );
        drop(a);
        std::thread::sleep(Duration::from_millis(10));
        assert!(
            !excl_in.load(Ordering::SeqCst),
            "exclusive beside one shared holder"
        );
        drop(b);
        excl.join().expect("exclusive");
        late.join().expect("late shared");
        assert!(late_in.load(Ordering::SeqCst));
        assert!(!locks.is_locked(9));
        assert!(locks.is_idle());
    }

    #[test]
    fn one_holder_per_inode_and_no_stripe_collisions() {
        let locks = Arc::new(InodeLocks::new());
        // 7 and 7 + SHARDS share a shard but are different locks: both at once.
        let a = locks.lock(7, Held::acquire(1, Rank::Dir));
        let b = locks.lock(7 + SHARDS as u32, Held::acquire(1, Rank::Dir));
        assert!(locks.is_locked(7) && locks.is_locked(7 + SHARDS as u32));
        drop((a, b));
        assert!(!locks.is_locked(7));
        // Many threads incrementing under the lock of one inode never overlap.
        let inside = Arc::new(AtomicU32::new(0));
        let total = Arc::new(AtomicU32::new(0));
        let ts: Vec<_> = (0..4)
            .map(|_| {
                let (locks, inside, total) = (locks.clone(), inside.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        let _g = locks.lock(42, Held::acquire(2, Rank::NonDir));
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                        total.fetch_add(1, Ordering::Relaxed);
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().expect("thread");
        }
        assert_eq!(total.load(Ordering::Relaxed), 8000);
        assert!(!locks.is_locked(42));
    }
}
