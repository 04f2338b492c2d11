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

/// The numbers of one shard locked now (a handful: a linear scan beats hashing), and
/// how many threads wait for one of them (no wake-up call when none does).
#[derive(Default)]
pub(crate) struct Holders {
    inos: Vec<u32>,
    waiters: usize,
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

    /// Wait until `ino` is free and take it. `held` is the caller's lock-order record,
    /// kept by the guard.
    pub(crate) fn lock(&self, ino: u32, held: Held) -> InodeGuard<'_, S> {
        let s = self.shard(ino);
        let mut h = s.lock();
        while h.inos.contains(&ino) {
            h.waiters += 1;
            h = s.wait(h);
            h.waiters -= 1;
        }
        h.inos.push(ino);
        InodeGuard {
            locks: self,
            ino,
            _held: held,
        }
    }

    /// Whether anyone holds `ino` now (for assertions).
    #[cfg(test)]
    pub(crate) fn is_locked(&self, ino: u32) -> bool {
        self.shard(ino).lock().inos.contains(&ino)
    }

    /// Whether no inode is locked and no thread waits (for assertions).
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.shards.iter().all(|s| {
            let h = s.sync.lock();
            h.inos.is_empty() && h.waiters == 0
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
        if let Some(i) = h.inos.iter().position(|&x| x == self.ino) {
            h.inos.swap_remove(i);
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
