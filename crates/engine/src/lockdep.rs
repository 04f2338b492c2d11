//! Lock-order checking in debug builds: a small lockdep for the engine's own locks.
//!
//! Owns: the ranks of the lock order docs/ARCHITECTURE.md gives (one inode's I/O lock
//! → its DAX mapping lock → its tree lock → `Fs::write_lock` or a handle → the rename
//! lock → directory inode locks → one non-directory's inode lock (a rename: two, in
//! inode number order) → the orphan list →
//! one block lock → the journal → one group mutex → `busy` → `live`), and, per thread,
//! the locks of that order it holds.
//!
//! Every helper that takes one of these locks first calls [`Held::acquire`] with the
//! lock's rank and the filesystem it belongs to: in debug builds (the tests) that
//! panics, naming both places, when the thread already holds a lock of the same
//! filesystem with the same or a later rank — a wait that could deadlock against a
//! thread taking the two in the documented order, caught on the thread that broke the
//! order even when no other thread was there to deadlock with. Two locks of one rank
//! are refused too: the order says no thread holds two I/O locks, two tree locks or
//! two group mutexes. Locks of different filesystems are not ordered against each
//! other. In release builds [`Held`] is empty and does nothing.
//!
//! [`Ranked`] pairs a std guard with its [`Held`]; it derefs to the guard, and the
//! thread's record of the lock goes when the guard does.
//!
//! In every build, a thread counts the I/O locks it holds ([`holds_io_lock`]): the
//! I/O locks are striped, so a thread that holds one must not wait for another (it
//! may be the same lock); code that would (the free of an inode whose last reference
//! goes while another inode is being written) hands its work over instead.

use std::ops::{Deref, DerefMut};

/// Where a lock sits in the order: a thread takes locks in increasing rank only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// One inode's I/O lock (`Fs::io_shared` / `io_exclusive`).
    Io = 10,
    /// A DAX file's mapping lock (`dax_file.rs`).
    DaxMap = 15,
    /// One inode's tree lock (`Fs::tree_shared` / `tree_exclusive`).
    Tree = 20,
    /// The transaction: `Fs::write_lock` (exclusive) or a handle (`Fs::handle`,
    /// shared).
    Write = 30,
    /// The rename lock: held by an operation that locks two directories.
    Rename = 32,
    /// A directory's inode lock (`Fs::lock_dir`). The one rank a thread may hold
    /// twice: a parent and then its child, or two under the rename lock.
    Dir = 34,
    /// A non-directory's inode lock (`Fs::lock_nondir`), or the lower-numbered of the
    /// two a rename locks (`Fs::lock_nondirs`).
    NonDir = 35,
    /// The higher-numbered of the two non-directories a rename locks: taken only after
    /// the lower (the two in number order, so two renames never wait on each other).
    SecondNonDir = 36,
    /// The orphan list (`Fs::orphan_lock`).
    Orphan = 37,
    /// One metadata block's read-modify-write lock (`Fs::block_lock`): inode table
    /// and extended-attribute blocks that several inodes share.
    Block = 38,
    /// The journal's mutex.
    Journal = 40,
    /// One group's mutex (`Fs::group`).
    Group = 50,
    /// Blocks freed by the running transaction (`busy`).
    Busy = 60,
    /// The live superblock state (`live`).
    Live = 70,
}

#[cfg(debug_assertions)]
mod imp {
    use super::Rank;
    use std::cell::RefCell;
    use std::panic::Location;

    thread_local! {
        /// (filesystem, rank, where it was taken) for each lock this thread holds.
        static HELD: RefCell<Vec<(usize, Rank, &'static Location<'static>)>> =
            const { RefCell::new(Vec::new()) };
    }

    #[track_caller]
    pub(super) fn acquire(fs: usize, rank: Rank) {
        let here = Location::caller();
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            // Directories may nest (see `Rank::Dir`); every other rank is taken once.
            let later = |r: Rank| r > rank || (r == rank && rank != Rank::Dir);
            if let Some((_, r, at)) = h.iter().find(|(f, r, _)| *f == fs && later(*r)) {
                let (r, at) = (*r, *at);
                drop(h);
                panic!(
                    "lock order: taking {rank:?} at {here} while holding {r:?} (taken at {at}); \
                     the order is I/O lock -> DAX mapping lock -> tree lock -> write lock or \
                     handle -> rename lock -> directories -> one non-directory (two in number \
                     order) -> orphan list -> one block -> journal -> one group -> busy -> live \
                     (docs/ARCHITECTURE.md)"
                );
            }
            h.push((fs, rank, here));
        });
    }

    pub(super) fn release(fs: usize, rank: Rank) {
        // `try_with`: a guard dropped while the thread's locals are torn down.
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|(f, r, _)| *f == fs && *r == rank) {
                h.remove(i);
            }
        });
    }
}

thread_local! {
    /// I/O locks this thread holds (all builds).
    static IO_HELD: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether this thread holds an I/O lock (of any filesystem).
pub(crate) fn holds_io_lock() -> bool {
    IO_HELD.with(|c| c.get() > 0)
}

/// This thread's record of holding one lock of the order (in release builds only
/// whether it is an I/O lock).
#[must_use]
pub(crate) struct Held {
    #[cfg(debug_assertions)]
    fs: usize,
    rank: Rank,
}

impl Held {
    /// Record that this thread is about to wait for a lock of `rank` belonging to the
    /// filesystem `fs` (any address unique to it); call before taking the lock.
    #[track_caller]
    #[cfg_attr(not(debug_assertions), allow(unused_variables))]
    pub(crate) fn acquire(fs: usize, rank: Rank) -> Held {
        #[cfg(debug_assertions)]
        imp::acquire(fs, rank);
        if rank == Rank::Io {
            IO_HELD.with(|c| c.set(c.get() + 1));
        }
        Held {
            #[cfg(debug_assertions)]
            fs,
            rank,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        imp::release(self.fs, self.rank);
        if self.rank == Rank::Io {
            // `try_with`: a guard dropped while the thread's locals are torn down.
            let _ = IO_HELD.try_with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
}

thread_local! {
    /// Page-cache mutexes (a file's state, one page's) this thread holds (counted in
    /// debug builds only).
    static PAGE_CACHE_HELD: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn page_cache_held(delta: i32) {
    if cfg!(debug_assertions) {
        // `try_with`: a guard dropped while the thread's locals are torn down.
        let _ = PAGE_CACHE_HELD.try_with(|c| c.set(c.get().saturating_add_signed(delta)));
    }
}

/// A held page-cache mutex (a `FileCache`'s state or one page's). The page cache's
/// rule is that these are held only for map updates and memcpy, never across device
/// I/O: debug builds count them per thread, and every device request of an open
/// filesystem checks the count ([`no_page_cache_lock`]).
pub(crate) struct PageCacheGuard<'a, T> {
    guard: Option<std::sync::MutexGuard<'a, T>>,
}

impl<'a, T> PageCacheGuard<'a, T> {
    /// Lock `m` (a poisoned mutex is taken as it is: its holder panicked, the data
    /// stays consistent per change).
    pub(crate) fn lock(m: &'a std::sync::Mutex<T>) -> PageCacheGuard<'a, T> {
        let guard = m.lock().unwrap_or_else(|p| p.into_inner());
        page_cache_held(1);
        PageCacheGuard { guard: Some(guard) }
    }

    /// Wait on `cv`, which releases the mutex until it is woken.
    pub(crate) fn wait(mut self, cv: &std::sync::Condvar) -> PageCacheGuard<'a, T> {
        let Some(g) = self.guard.take() else {
            return self;
        };
        page_cache_held(-1);
        let g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        page_cache_held(1);
        PageCacheGuard { guard: Some(g) }
    }
}

impl<T> Drop for PageCacheGuard<'_, T> {
    fn drop(&mut self) {
        if self.guard.take().is_some() {
            page_cache_held(-1);
        }
    }
}

impl<T> Deref for PageCacheGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard
            .as_deref()
            .expect("a page-cache guard holds its lock")
    }
}

impl<T> DerefMut for PageCacheGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard
            .as_deref_mut()
            .expect("a page-cache guard holds its lock")
    }
}

/// Debug builds: panic when this thread holds a page-cache mutex (`what` is the
/// device request about to be made under it).
#[track_caller]
pub(crate) fn no_page_cache_lock(what: &str) {
    if cfg!(debug_assertions) {
        let n = PAGE_CACHE_HELD.try_with(|c| c.get()).unwrap_or(0);
        assert!(n == 0, "{what} while holding {n} page-cache mutex(es)");
    }
}

/// A lock guard with the thread's record of holding it (released after the lock).
pub(crate) struct Ranked<G> {
    guard: G,
    _held: Held,
}

impl<G> Ranked<G> {
    pub(crate) fn new(held: Held, guard: G) -> Ranked<G> {
        Ranked { guard, _held: held }
    }
}

impl<G: Deref> Deref for Ranked<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Ranked<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    #[test]
    fn locks_in_order_pass_and_are_forgotten_when_dropped() {
        let a = Held::acquire(1, Rank::Io);
        let b = Held::acquire(1, Rank::Write);
        let c = Held::acquire(1, Rank::Group);
        drop(c);
        // The group lock is gone: another one may be taken now.
        let c2 = Held::acquire(1, Rank::Group);
        drop((c2, b, a));
        // Nothing held: any rank.
        let _ = Held::acquire(1, Rank::Io);
    }

    #[test]
    fn filesystems_are_not_ordered_against_each_other() {
        let _w = Held::acquire(1, Rank::Write);
        let _io = Held::acquire(2, Rank::Io);
    }

    /// `r` panicked with the checker's message for an I/O lock under the write lock.
    fn says_io_under_write(r: std::thread::Result<()>) {
        let msg = r
            .expect_err("an I/O lock under the write lock")
            .downcast::<String>()
            .expect("a message");
        assert!(
            msg.contains("taking Io") && msg.contains("holding Write"),
            "{msg}"
        );
    }

    #[test]
    fn an_out_of_order_lock_panics_naming_both() {
        let r = std::panic::catch_unwind(|| {
            let _w = Held::acquire(7, Rank::Write);
            let _io = Held::acquire(7, Rank::Io);
        });
        says_io_under_write(r);
        // The unwinding dropped the write lock's record.
        let _io = Held::acquire(7, Rank::Io);
    }

    /// The helpers of a real filesystem record their locks: in order they pass, and a
    /// thread that waits for an I/O lock under the write lock (the deadlock the
    /// order rules out) panics instead of waiting.
    #[test]
    fn a_filesystem_s_locks_are_checked() {
        use crate::fs::{Fs, FsOptions, Ino};
        let dev = crate::mkfs::mem_image(8 << 20);
        let fs = Fs::open_device(dev, FsOptions::default()).expect("open");
        {
            let _io = fs.io_exclusive(Ino(2));
            let _t = fs.tree_exclusive(Ino(2));
            let _w = fs.write_lock();
            let _g = fs.group(0).expect("group 0");
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _w = fs.write_lock();
            let _io = fs.io_shared(Ino(2));
        }));
        says_io_under_write(r);
        // Everything was released on the way out: the filesystem works on.
        fs.sync().expect("sync");
        fs.close().expect("close");
    }

    #[test]
    fn directories_nest_and_nothing_else_does() {
        let _a = Held::acquire(4, Rank::Dir);
        let _b = Held::acquire(4, Rank::Dir);
        let _f = Held::acquire(4, Rank::NonDir);
        let r = std::panic::catch_unwind(|| {
            let _c = Held::acquire(5, Rank::NonDir);
            let _d = Held::acquire(5, Rank::Dir);
        });
        assert!(r.is_err(), "a directory after a non-directory");
        let r = std::panic::catch_unwind(|| {
            let _c = Held::acquire(6, Rank::NonDir);
            let _d = Held::acquire(6, Rank::NonDir);
        });
        assert!(r.is_err(), "two non-directories");
        // A rename's two: the lower number, then the higher.
        {
            let _c = Held::acquire(7, Rank::NonDir);
            let _d = Held::acquire(7, Rank::SecondNonDir);
        }
        let r = std::panic::catch_unwind(|| {
            let _d = Held::acquire(8, Rank::SecondNonDir);
            let _c = Held::acquire(8, Rank::NonDir);
        });
        assert!(r.is_err(), "the second non-directory before the first");
    }

    #[test]
    fn two_locks_of_one_rank_panic() {
        let r = std::panic::catch_unwind(|| {
            let _a = Held::acquire(3, Rank::Group);
            let _b = Held::acquire(3, Rank::Group);
        });
        assert!(r.is_err());
    }

    /// A device request under a page-cache mutex panics (debug builds); the count
    /// follows the guard through a condition-variable wait and its drop.
    #[test]
    fn device_io_under_a_page_cache_mutex_panics() {
        let m = std::sync::Mutex::new(0u32);
        no_page_cache_lock("nothing held");
        let r = std::panic::catch_unwind(|| {
            let _g = PageCacheGuard::lock(&m);
            no_page_cache_lock("a device read");
        });
        let msg = r.expect_err("a request under the mutex passed");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("a device read while holding 1"), "{msg}");
        // Released by the unwind: nothing held any more.
        no_page_cache_lock("after the guard went");
        let cv = std::sync::Condvar::new();
        let g = PageCacheGuard::lock(&m);
        let g = std::thread::scope(|s| {
            s.spawn(|| {
                *PageCacheGuard::lock(&m) += 1;
                cv.notify_all();
            });
            let mut g = g;
            while *g == 0 {
                g = g.wait(&cv);
            }
            g
        });
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            no_page_cache_lock("after a wait")
        }));
        assert!(r.is_err(), "the guard is held again after the wait");
        drop(g);
        no_page_cache_lock("after the drop");
    }
}
