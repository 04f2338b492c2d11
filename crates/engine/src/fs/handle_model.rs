//! The handle gate and the per-inode locks under shuttle: namespace operations run as
//! handles (the transaction's gate shared, as `Fs::handle`) and take the real inode
//! lock table (`inode_locks::InodeLocks`, on shuttle's mutex and condition variable)
//! in the documented order, while a committer closes the transaction (the gate
//! exclusive, as `Fs::write_lock` when it closes for commit). Random and PCT schedules.
//!
//! The model filesystem: `/a` (a directory), `/a/b` (a directory), `/a/b/x` (a file).
//! Threads: a creator (`g` in `/a/b`, `f` in `/a`, `h` in `/a/b`); a mover and
//! unlinker (moves `x` from `/a/b` up to `/a`, locking the child directory before its
//! parent — legal only under the rename lock — then unlinks `g` and `x`); an rmdir of
//! `/a/b` (up to three tries while it is not empty); the committer (closes twice). Each
//! change is made in two steps with a yield between them, so a half-done operation is
//! visible to anyone not excluded.
//! All inode numbers share one shard of the table, so every wait and wake-up goes
//! through the same condition variable.
//!
//! What must hold, whenever the committer has closed the transaction and at the end:
//! every entry names an inode with a link, every inode with a link is named (once), no
//! named directory is removed and no removed directory has entries; no schedule
//! deadlocks; at the end no inode lock is held or waited for. Two threads never hold
//! one inode's lock (checked at each acquisition). The broken variants (`Broken`)
//! must each be caught.
//!
//! The shared mode (`InodeLocks::lock_shared`, `scenario_shared`): creates and
//! unlinks take their directory shared and change one leaf under the leaf's block
//! lock (here one mutex per directory, with room for one entry; the dentry cache is
//! told under the same lock), as `Fs::mknod_pinning` / `link_in_leaf` and
//! `Fs::unlink_ino` / `unlink_in_leaf`. Two threads unlink and create the same names
//! in `/a/b` (which starts with `x`; one unlinks `x`, creates `x`, unlinks `y`; the
//! other unlinks `x`, creates `x` and `y`, unlinks `x`). A create holds its new
//! inode's lock until it is pinned, and falls back to the directory exclusively when
//! the leaf has no room; an unlink looks the name up again under the child's lock and
//! falls back to the exclusive path unless it still names that inode. Beside them an
//! rmdir of `/a/b` (exclusive: it waits for every shared holder; up to three tries,
//! after a delay) and the committer. Freed inode numbers are reused (the lowest
//! first), so an unlink's stale number may name a new file. Also checked: shared and
//! exclusive holders of one inode never overlap; an inode is freed only while in use
//! and an unlink never reads a freed one; no entry names a freed inode and the dentry
//! cache agrees with the entries (at each close and at the end, and when it is told);
//! a create's new inode is still in use when it is pinned. Broken variant: the unlink
//! without its second look-up (`UnlinkWithoutRecheck`).

#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use shuttle::sync::{Mutex, MutexGuard, RwLock};
use shuttle::thread;

use super::inode_locks::{InodeGuard, InodeLocks, ShuttleShard};
use crate::lockdep::{Held, Rank};

/// The root; the other numbers are 64 apart: one shard of the table.
const ROOT: u32 = 2;
const A: u32 = ROOT + 64;
const B: u32 = ROOT + 2 * 64;
const X: u32 = ROOT + 3 * 64;

/// How many entries a directory's one leaf takes on the shared path (`link_in_leaf`);
/// a create that finds it full takes the directory exclusively (`link_into`, room
/// made there).
const LEAF_ROOM: usize = 1;

/// The yields before the shared scenario's rmdir first tries.
const RMDIR_DELAY: usize = 40;

/// Which part of the protocol the model leaves out (`None`: the protocol as is).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Broken {
    None,
    /// The committer closes without taking the gate exclusively.
    CommitWithoutGate,
    /// The two-directory operations (rmdir, the move) skip the rename lock.
    NoRenameLock,
    /// A create does not check, under its parent's lock, that the parent is there.
    CreateInRemoved,
    /// The shared unlink does not look the name up again under the child's lock.
    UnlinkWithoutRecheck,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Errno {
    NoEnt,
    Exist,
    NotEmpty,
    IsDir,
    NotDir,
}

struct Dir {
    entries: BTreeMap<&'static str, u32>,
    removed: bool,
}

struct State {
    /// Link counts (absent: 0).
    links: BTreeMap<u32, u32>,
    dirs: BTreeMap<u32, Dir>,
    /// Inodes in use (allocated); the others are free.
    used: BTreeSet<u32>,
    /// The dentry cache: what it was last told about a name (`Fs::dent_changed`).
    dcache: BTreeMap<(u32, &'static str), Option<u32>>,
    /// Inodes whose lock a thread holds now (the table's exclusion, checked).
    holding: BTreeSet<u32>,
    /// Inodes held shared now, with their holder counts.
    shared: BTreeMap<u32, u32>,
}

struct Model {
    broken: Broken,
    /// The running transaction's gate (`Inner::txn`).
    gate: RwLock<()>,
    rename: Mutex<()>,
    locks: InodeLocks<ShuttleShard>,
    /// Each directory's leaf block lock (`Fs::block_lock` of the name's leaf).
    leaves: BTreeMap<u32, Mutex<()>>,
    state: Mutex<State>,
}

/// A lock-order record that orders nothing: shuttle's threads share one OS thread,
/// so lockdep's per-thread records would mix them. Each gets a filesystem id of its
/// own (no address: never a real filesystem's).
fn neutral() -> Held {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    Held::acquire(usize::MAX - NEXT.fetch_add(1, Relaxed), Rank::Live)
}

/// One inode lock held in the model: the real guard, and the check that nobody else
/// holds it.
struct Locked<'a> {
    m: &'a Model,
    ino: u32,
    shared: bool,
    _g: InodeGuard<'a, ShuttleShard>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Before the real guard (a field) goes: nobody can take it in between.
        if !std::thread::panicking() {
            let mut st = self.m.st();
            if self.shared {
                let n = st.shared.get_mut(&self.ino).expect("held shared");
                *n -= 1;
                if *n == 0 {
                    st.shared.remove(&self.ino);
                }
            } else {
                assert!(st.holding.remove(&self.ino));
            }
        }
    }
}

impl Model {
    fn new(broken: Broken) -> Model {
        let dir = |entries: &[(&'static str, u32)]| Dir {
            entries: entries.iter().copied().collect(),
            removed: false,
        };
        let dirs = [
            (ROOT, dir(&[("a", A)])),
            (A, dir(&[("b", B)])),
            (B, dir(&[("x", X)])),
        ];
        Model {
            broken,
            gate: RwLock::new(()),
            rename: Mutex::new(()),
            locks: InodeLocks::with_sync(),
            leaves: [ROOT, A, B].map(|d| (d, Mutex::new(()))).into(),
            state: Mutex::new(State {
                links: [(A, 1), (B, 1), (X, 1)].into_iter().collect(),
                dirs: dirs.into_iter().collect(),
                used: [ROOT, A, B, X].into(),
                dcache: BTreeMap::new(),
                holding: BTreeSet::new(),
                shared: BTreeMap::new(),
            }),
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Fs::lock_dir` / `Fs::lock_nondir`: the real table.
    fn lock(&self, ino: u32) -> Locked<'_> {
        let g = self.locks.lock(ino, neutral());
        let mut st = self.st();
        assert!(
            !st.shared.contains_key(&ino),
            "inode {ino} held exclusively beside shared holders"
        );
        assert!(
            st.holding.insert(ino),
            "two threads hold inode {ino}'s lock"
        );
        Locked {
            m: self,
            ino,
            shared: false,
            _g: g,
        }
    }

    /// `Fs::lock_dir_shared`: the real table's shared mode.
    fn lock_shared(&self, ino: u32) -> Locked<'_> {
        let g = self.locks.lock_shared(ino, neutral());
        let mut st = self.st();
        assert!(
            !st.holding.contains(&ino),
            "inode {ino} held shared beside an exclusive holder"
        );
        *st.shared.entry(ino).or_default() += 1;
        Locked {
            m: self,
            ino,
            shared: true,
            _g: g,
        }
    }

    /// The block lock of `dir`'s leaf.
    fn leaf(&self, dir: u32) -> MutexGuard<'_, ()> {
        self.leaves[&dir].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Fs::alloc_inode`: the lowest free number (a removed directory's stays taken:
    /// its record answers "removed").
    fn alloc(&self) -> u32 {
        let mut st = self.st();
        let ino = (1..)
            .map(|k| ROOT + k * 64)
            .find(|i| !st.used.contains(i) && !st.dirs.contains_key(i))
            .expect("a free number");
        st.used.insert(ino);
        ino
    }

    /// `Fs::free_inode`: only an inode in use. Takes the caller's state guard and
    /// releases it before asserting: a failure does not poison the state, so the
    /// failure reported is this one, not another thread's `PoisonError`.
    fn free(mut st: MutexGuard<'_, State>, ino: u32) {
        let was_used = st.used.remove(&ino);
        st.links.remove(&ino);
        drop(st);
        assert!(was_used, "freed inode {ino} freed again");
    }

    /// `Fs::read_live_inode` by an unlink (its lock held): its link count. The real
    /// one fails ("entry refers to deleted inode") on a freed inode: never reached.
    fn read_live(&self, ino: u32) -> u32 {
        let st = self.st();
        let (used, links) = (st.used.contains(&ino), st.links.get(&ino).copied());
        drop(st);
        assert!(
            used,
            "an unlink reads freed inode {ino} (entry refers to deleted inode)"
        );
        links.unwrap_or(0)
    }

    /// `Fs::dent_changed`: under the leaf lock (or the directory exclusively) nobody
    /// else changes the name, so the cache learns what the entry is now.
    fn tell_dcache(&self, dir: u32, name: &'static str, now: Option<u32>) {
        let mut st = self.st();
        st.dcache.insert((dir, name), now);
        let entry = st.dirs[&dir].entries.get(name).copied();
        drop(st);
        assert_eq!(
            entry, now,
            "the dentry cache told {now:?} for {name} in {dir}, out of order"
        );
    }

    /// `Fs::drop_link`: one link fewer, freed with the last (the model pins nothing).
    fn drop_link(&self, ino: u32, links: u32) {
        let mut st = self.st();
        if links > 1 {
            st.links.insert(ino, links - 1);
        } else {
            Model::free(st, ino);
        }
    }

    fn rename_lock(&self) -> Option<MutexGuard<'_, ()>> {
        (self.broken != Broken::NoRenameLock)
            .then(|| self.rename.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn lookup(&self, dir: u32, name: &str) -> Result<u32, Errno> {
        let st = self.st();
        st.dirs[&dir].entries.get(name).copied().ok_or(Errno::NoEnt)
    }

    fn is_dir(&self, ino: u32) -> bool {
        self.st().dirs.contains_key(&ino)
    }

    /// create(2) of a file: the parent's lock, then the new inode's.
    fn create(&self, parent: u32, name: &'static str) -> Result<u32, Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let _p = self.lock(parent);
        if self.broken != Broken::CreateInRemoved && self.st().dirs[&parent].removed {
            return Err(Errno::NoEnt);
        }
        if self.lookup(parent, name).is_ok() {
            return Err(Errno::Exist);
        }
        let ino = self.alloc();
        let _c = self.lock(ino);
        let mut st = self.st();
        st.dirs
            .get_mut(&parent)
            .expect("parent")
            .entries
            .insert(name, ino);
        drop(st);
        thread::yield_now();
        self.st().links.insert(ino, 1);
        Ok(ino)
    }

    /// unlink(2): the parent's lock, look up, the child's lock.
    fn unlink(&self, parent: u32, name: &'static str) -> Result<(), Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let _p = self.lock(parent);
        let ino = self.lookup(parent, name)?;
        if self.is_dir(ino) {
            return Err(Errno::IsDir);
        }
        let _c = self.lock(ino);
        self.st()
            .dirs
            .get_mut(&parent)
            .expect("parent")
            .entries
            .remove(name);
        thread::yield_now();
        let mut st = self.st();
        let l = st.links.get_mut(&ino).expect("a named inode has links");
        *l -= 1;
        if *l == 0 {
            Model::free(st, ino);
        }
        Ok(())
    }

    /// rmdir(2): the rename lock, the parent's lock, look up, the child's lock.
    fn rmdir(&self, parent: u32, name: &'static str) -> Result<(), Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let _r = self.rename_lock();
        let _p = self.lock(parent);
        let ino = self.lookup(parent, name)?;
        if !self.is_dir(ino) {
            return Err(Errno::NotDir);
        }
        let _c = self.lock(ino);
        if !self.st().dirs[&ino].entries.is_empty() {
            return Err(Errno::NotEmpty);
        }
        self.st().dirs.get_mut(&ino).expect("dir").removed = true;
        thread::yield_now();
        let mut st = self.st();
        st.dirs
            .get_mut(&parent)
            .expect("parent")
            .entries
            .remove(name);
        Model::free(st, ino);
        Ok(())
    }

    /// rename(2) of a file from directory `from` to `to` (same name): the rename lock,
    /// then `from`'s lock and `to`'s (in that order, whichever is the parent), then
    /// the file's.
    fn mv(&self, from: u32, name: &'static str, to: u32) -> Result<(), Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let _r = self.rename_lock();
        let _f = self.lock(from);
        let _t = self.lock(to);
        if self.st().dirs[&from].removed || self.st().dirs[&to].removed {
            return Err(Errno::NoEnt);
        }
        let ino = self.lookup(from, name)?;
        if self.lookup(to, name).is_ok() {
            return Err(Errno::Exist);
        }
        let _c = self.lock(ino);
        self.st()
            .dirs
            .get_mut(&from)
            .expect("from")
            .entries
            .remove(name);
        thread::yield_now();
        self.st()
            .dirs
            .get_mut(&to)
            .expect("to")
            .entries
            .insert(name, ino);
        Ok(())
    }

    /// create(2) of a file, the parent shared (`Fs::mknod_pinning`): allocate, take the
    /// new inode's lock, write it (one link), link the name into the leaf under its
    /// lock — or, no room there, the whole directory exclusively — then pin it (its
    /// lock, or the directory's, still held).
    fn create_shared(&self, parent: u32, name: &'static str) -> Result<u32, Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let shared = self.lock_shared(parent);
        if self.st().dirs[&parent].removed {
            return Err(Errno::NoEnt);
        }
        if self.lookup(parent, name).is_ok() {
            return Err(Errno::Exist);
        }
        let ino = self.alloc();
        let own = self.lock(ino);
        self.st().links.insert(ino, 1);
        thread::yield_now();
        // `link_in_leaf`: Some(result) when done or refused, None: no room.
        let linked = {
            let _l = self.leaf(parent);
            let mut st = self.st();
            let entries = &mut st.dirs.get_mut(&parent).expect("parent").entries;
            if entries.contains_key(name) {
                Some(Err(Errno::Exist))
            } else if entries.len() >= LEAF_ROOM {
                None
            } else {
                entries.insert(name, ino);
                drop(st);
                thread::yield_now();
                self.tell_dcache(parent, name, Some(ino));
                Some(Ok(()))
            }
        };
        let (linked, _whole) = match linked {
            Some(r) => (r, None),
            None => {
                drop(own);
                drop(shared);
                let whole = self.lock(parent);
                let r = self.link_whole(parent, name, ino);
                (r, Some(whole))
            }
        };
        if let Err(e) = linked {
            // `keep_or_abandon`.
            Model::free(self.st(), ino);
            return Err(e);
        }
        thread::yield_now();
        let used = self.st().used.contains(&ino);
        assert!(
            used,
            "a create's new inode {ino} was freed before it was pinned"
        );
        Ok(ino)
    }

    /// `link_into` (the directory held exclusively).
    fn link_whole(&self, parent: u32, name: &'static str, ino: u32) -> Result<(), Errno> {
        let mut st = self.st();
        let dir = st.dirs.get_mut(&parent).expect("parent");
        if dir.removed {
            return Err(Errno::NoEnt);
        }
        if dir.entries.contains_key(name) {
            return Err(Errno::Exist);
        }
        dir.entries.insert(name, ino);
        drop(st);
        thread::yield_now();
        self.tell_dcache(parent, name, Some(ino));
        Ok(())
    }

    /// unlink(2), the parent shared (`Fs::unlink_ino`): the name removed in its leaf,
    /// else (false) the exclusive path.
    fn unlink_shared(&self, parent: u32, name: &'static str) -> Result<(), Errno> {
        let _h = self.gate.read().unwrap_or_else(|p| p.into_inner());
        {
            let _p = self.lock_shared(parent);
            if self.unlink_in_leaf(parent, name)? {
                return Ok(());
            }
        }
        let _p = self.lock(parent);
        let ino = self.lookup(parent, name)?;
        if self.is_dir(ino) {
            return Err(Errno::IsDir);
        }
        let _c = self.lock(ino);
        let links = self.read_live(ino);
        self.st()
            .dirs
            .get_mut(&parent)
            .expect("parent")
            .entries
            .remove(name);
        thread::yield_now();
        self.tell_dcache(parent, name, None);
        thread::yield_now();
        self.drop_link(ino, links);
        Ok(())
    }

    /// `unlink_in_leaf`: look up (no lock), the child's lock, look up again (unless
    /// `UnlinkWithoutRecheck`), then remove the entry under the leaf lock if it names
    /// the inode, and drop its link.
    fn unlink_in_leaf(&self, parent: u32, name: &'static str) -> Result<bool, Errno> {
        let ino = self.lookup(parent, name)?;
        if self.is_dir(ino) {
            return Ok(false);
        }
        let _c = self.lock(ino);
        if self.broken != Broken::UnlinkWithoutRecheck && self.lookup(parent, name) != Ok(ino) {
            return Ok(false);
        }
        let links = self.read_live(ino);
        let removed = {
            let _l = self.leaf(parent);
            let mut st = self.st();
            let entries = &mut st.dirs.get_mut(&parent).expect("parent").entries;
            if entries.get(name) != Some(&ino) {
                false
            } else {
                entries.remove(name);
                drop(st);
                thread::yield_now();
                self.tell_dcache(parent, name, None);
                true
            }
        };
        if !removed {
            return Ok(false);
        }
        thread::yield_now();
        self.drop_link(ino, links);
        Ok(true)
    }

    /// Close the transaction (`Fs::write_lock`, then close): no handle is open, so
    /// the state holds only whole operations.
    fn commit(&self) {
        let _w = (self.broken != Broken::CommitWithoutGate)
            .then(|| self.gate.write().unwrap_or_else(|p| p.into_inner()));
        check(&self.st(), "in a closed transaction");
    }
}

/// The state's invariants (see the module note).
fn check(st: &State, when: &str) {
    let mut named: BTreeMap<u32, u32> = BTreeMap::new();
    for (&d, dir) in &st.dirs {
        assert!(
            !dir.removed || dir.entries.is_empty(),
            "an entry inside removed directory {d} {when}: {:?}",
            dir.entries
        );
        for (name, &ino) in &dir.entries {
            assert!(
                st.used.contains(&ino),
                "entry {name} in {d} names freed inode {ino} {when}"
            );
            assert!(
                st.links.get(&ino).is_some_and(|&l| l >= 1),
                "half-done operation {when}: entry {name} in {d} names inode {ino} without links"
            );
            assert!(
                st.dirs.get(&ino).is_none_or(|c| !c.removed),
                "half-done operation {when}: removed directory {ino} still named {name} in {d}"
            );
            *named.entry(ino).or_default() += 1;
        }
    }
    for (&(d, name), &ino) in &st.dcache {
        assert_eq!(
            st.dirs[&d].entries.get(name).copied(),
            ino,
            "half-done operation {when}: the dentry cache disagrees on {name} in {d}"
        );
    }
    for (&ino, &l) in &st.links {
        assert!(
            st.used.contains(&ino),
            "freed inode {ino} has {l} links {when}"
        );
        assert_eq!(
            named.get(&ino).copied().unwrap_or(0),
            l,
            "half-done operation {when}: inode {ino} has {l} links but other names"
        );
    }
}

/// One run: `threads` started on one model, joined, then the final checks.
fn run(broken: Broken, threads: [fn(&Model); 4]) {
    let m = Arc::new(Model::new(broken));
    let threads = threads.map(|f| {
        let m = m.clone();
        thread::spawn(move || f(&m))
    });
    for t in threads {
        t.join().expect("thread");
    }
    at_the_end(&m);
}

/// rmdir `/a/b` until it is gone or was found not empty three times.
fn rmdir_b(m: &Model) {
    for _ in 0..3 {
        if m.rmdir(A, "b") != Err(Errno::NotEmpty) {
            break;
        }
        thread::yield_now();
    }
}

/// The committer: closes the transaction twice.
fn commit_twice(m: &Model) {
    for _ in 0..2 {
        m.commit();
    }
}

/// One run of the threads of the module note's first part.
fn scenario(broken: Broken) {
    run(
        broken,
        [
            |m| {
                let _ = m.create(B, "g");
                let _ = m.create(A, "f");
                let _ = m.create(B, "h");
            },
            |m| {
                let _ = m.mv(B, "x", A);
                let _ = m.unlink(B, "g");
                let _ = m.unlink(A, "x");
            },
            rmdir_b,
            commit_twice,
        ],
    );
}

/// The final checks of a run (its threads joined).
fn at_the_end(m: &Model) {
    let st = m.st();
    check(&st, "at the end");
    assert!(
        st.holding.is_empty() && st.shared.is_empty(),
        "inode locks left held: {:?} {:?}",
        st.holding,
        st.shared
    );
    drop(st);
    assert!(m.locks.is_idle(), "the lock table is not empty at the end");
}

/// One run of the shared mode: the threads of the module note's second part.
fn scenario_shared(broken: Broken) {
    run(
        broken,
        [
            |m| {
                let _ = m.unlink_shared(B, "x");
                let _ = m.create_shared(B, "x");
                let _ = m.unlink_shared(B, "y");
            },
            |m| {
                let _ = m.unlink_shared(B, "x");
                let _ = m.create_shared(B, "x");
                let _ = m.create_shared(B, "y");
                let _ = m.unlink_shared(B, "x");
            },
            |m| {
                // Late enough that the creates often find `/a/b` there.
                for _ in 0..RMDIR_DELAY {
                    thread::yield_now();
                }
                rmdir_b(m);
            },
            commit_twice,
        ],
    );
}

#[test]
fn handles_and_inode_locks_under_random_schedules() {
    shuttle::check_random(|| scenario(Broken::None), 10_000);
}

#[test]
fn handles_and_inode_locks_under_pct_schedules() {
    shuttle::check_pct(|| scenario(Broken::None), 10_000, 3);
}

/// Run the broken variant `b` over `n` random schedules: it must fail, with a message
/// containing `expect`.
fn caught(b: Broken, n: usize, expect: &str) {
    let run = match b {
        Broken::UnlinkWithoutRecheck => scenario_shared,
        _ => scenario,
    };
    super::model_check::expect_caught(&b, expect, || shuttle::check_random(move || run(b), n));
}

/// A commit that does not wait for the open handles closes half-done operations.
#[test]
fn the_model_catches_a_commit_without_the_exclusive_gate() {
    caught(
        Broken::CommitWithoutGate,
        3000,
        "half-done operation in a closed",
    );
}

/// rmdir locks `/a` then `/a/b`, the move `/a/b` then `/a`: without the rename lock
/// the two deadlock.
#[test]
fn the_model_catches_two_directories_locked_without_the_rename_lock() {
    caught(Broken::NoRenameLock, 3000, "deadlock");
}

/// A create into a directory removed before it took the directory's lock.
#[test]
fn the_model_catches_a_create_in_a_removed_directory() {
    caught(Broken::CreateInRemoved, 3000, "inside removed directory");
}

#[test]
fn shared_creates_and_unlinks_under_random_schedules() {
    shuttle::check_random(|| scenario_shared(Broken::None), 10_000);
}

#[test]
fn shared_creates_and_unlinks_under_pct_schedules() {
    shuttle::check_pct(|| scenario_shared(Broken::None), 10_000, 3);
}

/// Two unlinks of `x` look it up; one frees it while the other waits for its lock,
/// which then, without looking again, reads the freed inode.
#[test]
fn the_model_catches_an_unlink_without_the_second_lookup() {
    caught(Broken::UnlinkWithoutRecheck, 1000, "freed inode");
}
