//! Free-space accounting: who may take the free blocks that are left.
//!
//! Owns the promises made against the free-block count: the blocks delayed allocation
//! reserved for dirty pages over holes (`data`), the extent-tree blocks their
//! writeback may need (`tree`), a pool kept for changes that must not fail for lack
//! of space (ext4's `s_resv_clusters`: 2% of the filesystem, at most 4096 blocks),
//! the root reserve (the superblock's `r_blocks_count`, closed to unprivileged
//! callers), and what a client of the engine holds back for data it has accepted but
//! not handed over yet (`held`: a FUSE mount's kernel page cache under the writeback
//! cache, set by the mount's `lowspace`; 0 for everyone else).
//!
//! Must hold: `unpromised` = free blocks − `data` − `tree`, and it never goes below
//! zero, so every promise is backed by a free block. Every allocation is admitted here
//! by the claim it is made under ([`Claim`], set per thread by [`claim_as`]):
//! - `Fresh` (the default: new data written at once, directories, symlinks, xattr
//!   blocks, fallocate, and the tree blocks these need) may take only what is neither
//!   promised nor in the pool (nor, unprivileged, in the root reserve), nor held —
//!   unless the thread hands over held data ([`spend_held`]), which may take that too;
//! - `NoFail` (unwritten-extent conversion, extent splits of truncate and punch) may
//!   also take the pool;
//! - `Reserved` (writeback of delalloc pages: their data blocks) takes from `data`;
//! - `Writeback(file)` (tree blocks of that writeback) takes from the file's own tree
//!   reservation, then from the pool.
//!
//! So once a buffered write has returned, its writeback finds its blocks: ENOSPC is
//! reported by the call that runs out (the write's reservation, or an allocation made
//! at once), never by a background writeback.
//!
//! Locking: none of its own — the counters are atomics changed by compare-and-swap,
//! so reservations (writers under their I/O lock) and allocations (under the write
//! lock and a group lock) can both admit without a lock order between them.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::fs::pagecache::FileCache;

/// What an allocation is for (see the module note).
#[derive(Clone, Default)]
pub(crate) enum Claim {
    #[default]
    Fresh,
    NoFail,
    Reserved,
    Writeback(Arc<FileCache>),
}

thread_local! {
    static CLAIM: RefCell<Claim> = const { RefCell::new(Claim::Fresh) };
    static UNPRIVILEGED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static REFUSED: std::cell::Cell<&'static str> = const { std::cell::Cell::new("") };
    static SPENDS_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Restores the previous held-space rule of this thread when dropped.
pub struct HeldGuard(bool);

impl Drop for HeldGuard {
    fn drop(&mut self) {
        SPENDS_HELD.with(|x| x.set(self.0));
    }
}

/// The calling thread hands over data the client held space for (a FUSE mount's
/// cached WRITE from the kernel's writeback) until the guard is dropped: its
/// allocations and promises may take the blocks held back from everyone else
/// ([`Fs::hold_for_client`](crate::Fs::hold_for_client)).
pub fn spend_held() -> HeldGuard {
    HeldGuard(SPENDS_HELD.with(|x| x.replace(true)))
}

/// Remember why this thread's last allocation was refused (for the message of a
/// writeback that runs out of space, which the module note says must not happen).
pub(crate) fn note_refusal(why: &'static str) {
    REFUSED.with(|r| r.set(why));
}

/// Why this thread's last allocation was refused ("" if none was).
pub(crate) fn last_refusal() -> &'static str {
    REFUSED.with(|r| r.get())
}

/// Restores the previous claim of this thread when dropped.
pub(crate) struct ClaimGuard(Option<Claim>);

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            CLAIM.with(|x| *x.borrow_mut() = c);
        }
    }
}

/// Make this thread's allocations claim `c` until the guard is dropped.
pub(crate) fn claim_as(c: Claim) -> ClaimGuard {
    ClaimGuard(Some(
        CLAIM.with(|x| std::mem::replace(&mut *x.borrow_mut(), c)),
    ))
}

fn current_claim() -> Claim {
    CLAIM.with(|x| x.borrow().clone())
}

/// Restores the previous privilege of this thread when dropped.
pub struct PrivilegeGuard(bool);

impl Drop for PrivilegeGuard {
    fn drop(&mut self) {
        UNPRIVILEGED.with(|x| x.set(self.0));
    }
}

/// Whether the calling thread acts for a privileged caller (root, or the superblock's
/// resuid/resgid) until the guard is dropped: unprivileged callers may not allocate
/// the root reserve (`r_blocks_count`), as on the kernel's ext4. Threads are
/// privileged unless told otherwise (the API's user owns the image; the mount tells
/// per request).
pub fn act_as_privileged(privileged: bool) -> PrivilegeGuard {
    PrivilegeGuard(UNPRIVILEGED.with(|x| x.replace(!privileged)))
}

/// Extent-tree blocks that writing back `pages` delalloc pages of a file could need,
/// given its tree's depth and root entry count now: none while the new extents still
/// fit in the inode, else a new leaf per half-full leaf of new extents plus one block
/// per level for the splits and a new level above them.
pub(crate) fn tree_blocks_for(pages: u64, depth: u16, root_entries: u16, per_leaf: u64) -> u64 {
    if pages == 0 || (depth == 0 && u64::from(root_entries) + pages <= 4) {
        return 0;
    }
    pages.div_ceil((per_leaf / 2).max(1)) + u64::from(depth) + 1
}

/// The counters (see the module note).
pub(crate) struct Space {
    unpromised: AtomicU64,
    data: AtomicU64,
    tree: AtomicU64,
    pool: u64,
    root: u64,
    /// Blocks kept back for a client's data (see the module note): a bound the client
    /// sets, not a promise — `unpromised` is not changed by it.
    held: AtomicU64,
}

impl Space {
    /// `free` blocks, nothing promised; `pool` and `root` as in the module note.
    pub(crate) fn new(free: u64, pool: u64, root: u64) -> Space {
        Space {
            unpromised: AtomicU64::new(free),
            data: AtomicU64::new(0),
            tree: AtomicU64::new(0),
            pool,
            root,
            held: AtomicU64::new(0),
        }
    }

    /// Keep `n` blocks back for the client's data (replacing what was kept before).
    pub(crate) fn hold(&self, n: u64) {
        self.held.store(n, Ordering::Release);
    }

    /// Blocks kept back for the client's data.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// The pool ext4 keeps for a filesystem of `blocks` blocks (none without extents:
    /// block maps need no splits).
    pub(crate) fn pool_for(blocks: u64, extents: bool) -> u64 {
        if extents {
            (blocks / 50).min(4096)
        } else {
            0
        }
    }

    /// What a `Fresh` claim of this thread must leave free besides the promises.
    fn kept(&self) -> u64 {
        let root = if UNPRIVILEGED.with(|x| x.get()) {
            self.root
        } else {
            0
        };
        let held = if SPENDS_HELD.with(|x| x.get()) {
            0
        } else {
            self.held()
        };
        self.pool + root + held
    }

    /// Take up to `want` from `unpromised`, leaving `keep`: how many were taken.
    fn take_unpromised(&self, want: u64, keep: u64) -> u64 {
        let mut got = 0;
        let _ = self
            .unpromised
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                got = want.min(u.saturating_sub(keep));
                Some(u - got)
            });
        got
    }

    /// Promise `data` blocks and `tree` tree blocks for delayed allocation, all or
    /// nothing: `NoSpace` when they would eat the pool or (unprivileged) the root
    /// reserve.
    pub(crate) fn reserve(&self, data: u64, tree: u64) -> Result<()> {
        let n = data + tree;
        if n == 0 {
            return Ok(());
        }
        let keep = self.kept();
        self.unpromised
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u >= n.saturating_add(keep)).then(|| u - n)
            })
            .map_err(|_| Error::NoSpace)?;
        self.data.fetch_add(data, Ordering::AcqRel);
        self.tree.fetch_add(tree, Ordering::AcqRel);
        Ok(())
    }

    /// Take back promises of `data` and `tree` blocks that will not be used.
    pub(crate) fn unreserve(&self, data: u64, tree: u64) {
        let d = sub_at_most(&self.data, data);
        let t = sub_at_most(&self.tree, tree);
        self.unpromised.fetch_add(d + t, Ordering::AcqRel);
    }

    /// Admit an allocation of up to `want` blocks found free by the allocator, under
    /// the calling thread's claim: how many may be taken (≥ 1), or `NoSpace`. The
    /// caller then takes exactly that many out of the free count.
    pub(crate) fn admit(&self, want: u64) -> Result<u64> {
        let got = match current_claim() {
            Claim::Fresh => self.take_unpromised(want, self.kept()),
            Claim::NoFail => self.take_unpromised(want, 0),
            Claim::Reserved => {
                // Blocks promised to this writeback; past them (a page that did not
                // reserve), only what a fresh allocation could have.
                let r = sub_at_most(&self.data, want);
                r + self.take_unpromised(want - r, self.kept())
            }
            Claim::Writeback(fc) => {
                let mut own = 0;
                {
                    let mut st = fc.lock();
                    if st.resv_tree > 0 {
                        own = sub_at_most(&self.tree, want.min(st.resv_tree));
                        st.resv_tree -= own;
                    }
                }
                own + self.take_unpromised(want - own, 0)
            }
        };
        if got == 0 {
            note_refusal(match current_claim() {
                Claim::Fresh => "a fresh claim found nothing unpromised past the pool",
                Claim::NoFail => "a no-fail claim found nothing unpromised",
                Claim::Reserved => "a reserved claim found no data promise left",
                Claim::Writeback(_) => "a writeback tree claim found no promise and no pool",
            });
            return Err(Error::NoSpace);
        }
        Ok(got)
    }

    /// Promise again up to `n` blocks just returned to the free count (an allocation
    /// that spent promises was undone).
    pub(crate) fn repromise(&self, n: u64) {
        let got = sub_at_most(&self.unpromised, n);
        self.data.fetch_add(got, Ordering::AcqRel);
    }

    /// Blocks returned to the free count.
    pub(crate) fn freed(&self, n: u64) {
        self.unpromised.fetch_add(n, Ordering::AcqRel);
    }

    /// (free blocks not promised, promised to data, promised to tree blocks).
    pub(crate) fn figures(&self) -> (u64, u64, u64) {
        (
            self.unpromised.load(Ordering::Acquire),
            self.data.load(Ordering::Acquire),
            self.tree.load(Ordering::Acquire),
        )
    }

    /// What an unprivileged caller could still allocate (statfs's f_bavail).
    pub(crate) fn available(&self) -> u64 {
        self.available_to(false)
    }

    /// What a fresh allocation could still take, by a privileged caller or not, not
    /// counting what is held for the client (the client's own data may take it).
    pub(crate) fn available_to(&self, privileged: bool) -> u64 {
        let keep = self.pool + if privileged { 0 } else { self.root };
        self.unpromised.load(Ordering::Acquire).saturating_sub(keep)
    }
}

/// Subtract up to `n` from `a` (not below zero): how much was subtracted.
fn sub_at_most(a: &AtomicU64, n: u64) -> u64 {
    let mut got = 0;
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        got = n.min(v);
        Some(v - got)
    });
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_leaves_promises_pool_and_root() {
        let s = Space::new(100, 10, 5);
        s.reserve(50, 2).expect("fits");
        // 48 unpromised, 10 in the pool: a fresh claim gets 38.
        assert_eq!(s.admit(1000).expect("some"), 38);
        assert!(matches!(s.admit(1), Err(Error::NoSpace)));
        {
            let _c = claim_as(Claim::NoFail);
            assert_eq!(s.admit(1000).expect("pool"), 10);
        }
        {
            let _c = claim_as(Claim::Reserved);
            assert_eq!(s.admit(20).expect("reserved"), 20);
        }
        assert_eq!(s.figures(), (0, 30, 2));
    }

    #[test]
    fn reservations_are_all_or_nothing_and_keep_the_root_reserve() {
        let s = Space::new(100, 10, 20);
        let _p = act_as_privileged(false);
        assert!(matches!(s.reserve(71, 0), Err(Error::NoSpace)));
        s.reserve(70, 0).expect("fits beside pool and root reserve");
        assert_eq!(s.available(), 0);
        let _q = act_as_privileged(true);
        s.reserve(20, 0).expect("root may use its reserve");
        s.unreserve(90, 0);
        assert_eq!(s.figures(), (100, 0, 0));
    }

    #[test]
    fn a_reserved_claim_past_its_promise_is_fresh() {
        let s = Space::new(20, 5, 0);
        s.reserve(3, 0).expect("fits");
        let _c = claim_as(Claim::Reserved);
        // 3 promised plus 12 of the 17 unpromised (5 stay for the pool).
        assert_eq!(s.admit(100).expect("some"), 15);
    }

    #[test]
    fn held_blocks_are_left_to_the_client_s_data() {
        let s = Space::new(100, 10, 0);
        s.hold(30);
        // 100 free, 10 in the pool, 30 held: fresh allocations and promises get 60.
        assert!(matches!(s.reserve(61, 0), Err(Error::NoSpace)));
        s.reserve(50, 0).expect("fits beside the hold");
        assert_eq!(s.admit(1000).expect("some"), 10);
        assert!(matches!(s.admit(1), Err(Error::NoSpace)));
        {
            // The client's data takes what was held for it.
            let _g = spend_held();
            s.reserve(25, 0).expect("held for it");
            assert_eq!(s.admit(1000).expect("the rest of the hold"), 5);
        }
        assert!(matches!(s.reserve(1, 0), Err(Error::NoSpace)));
        // The hold is a bound the client lowers as its data comes.
        s.hold(0);
        s.unreserve(75, 0);
        assert_eq!(s.admit(1000).expect("all but the pool"), 75);
        assert_eq!(s.available_to(true), 0);
    }

    #[test]
    fn tree_estimate() {
        assert_eq!(tree_blocks_for(0, 2, 4, 340), 0);
        assert_eq!(tree_blocks_for(3, 0, 1, 340), 0);
        assert_eq!(tree_blocks_for(4, 0, 1, 340), 2);
        assert_eq!(tree_blocks_for(171, 1, 2, 340), 4);
    }
}
