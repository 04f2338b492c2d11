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

use std::sync::{Condvar, Mutex};

use crate::lockdep::Held;

const SHARDS: usize = 64;

/// The numbers of one shard locked now (a handful: a linear scan beats hashing), and
/// how many threads wait for one of them (no wake-up call when none does).
#[derive(Default)]
struct Holders {
    inos: Vec<u32>,
    waiters: usize,
}

/// One cache line per shard: threads locking inodes of different shards share none.
#[repr(align(64))]
struct Shard {
    held: Mutex<Holders>,
    freed: Condvar,
}

/// The table of locked inode numbers.
pub(crate) struct InodeLocks {
    shards: Box<[Shard]>,
}

impl InodeLocks {
    pub(crate) fn new() -> InodeLocks {
        InodeLocks {
            shards: (0..SHARDS)
                .map(|_| Shard {
                    held: Mutex::new(Holders::default()),
                    freed: Condvar::new(),
                })
                .collect(),
        }
    }

    fn shard(&self, ino: u32) -> &Shard {
        &self.shards[ino as usize % SHARDS]
    }

    /// Wait until `ino` is free and take it. `held` is the caller's lock-order record,
    /// kept by the guard.
    pub(crate) fn lock(&self, ino: u32, held: Held) -> InodeGuard<'_> {
        let s = self.shard(ino);
        let mut h = s.held.lock().unwrap_or_else(|p| p.into_inner());
        while h.inos.contains(&ino) {
            h.waiters += 1;
            h = s.freed.wait(h).unwrap_or_else(|p| p.into_inner());
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
        let s = self.shard(ino);
        s.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .inos
            .contains(&ino)
    }
}

/// One held inode lock; released when dropped (then its lock-order record).
pub(crate) struct InodeGuard<'a> {
    locks: &'a InodeLocks,
    ino: u32,
    _held: Held,
}

impl Drop for InodeGuard<'_> {
    fn drop(&mut self) {
        let s = self.locks.shard(self.ino);
        let mut h = s.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = h.inos.iter().position(|&x| x == self.ino) {
            h.inos.swap_remove(i);
        }
        if h.waiters > 0 {
            s.freed.notify_all();
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
