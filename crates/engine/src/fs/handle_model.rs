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
const FIRST_FREE: u32 = ROOT + 4 * 64;

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
    /// Inodes whose lock a thread holds now (the table's exclusion, checked).
    holding: BTreeSet<u32>,
    next_ino: u32,
}

struct Model {
    broken: Broken,
    /// The running transaction's gate (`Inner::txn`).
    gate: RwLock<()>,
    rename: Mutex<()>,
    locks: InodeLocks<ShuttleShard>,
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
    _g: InodeGuard<'a, ShuttleShard>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Before the real guard (a field) goes: nobody can take it in between.
        if !std::thread::panicking() {
            assert!(self.m.st().holding.remove(&self.ino));
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
            state: Mutex::new(State {
                links: [(A, 1), (B, 1), (X, 1)].into_iter().collect(),
                dirs: dirs.into_iter().collect(),
                holding: BTreeSet::new(),
                next_ino: FIRST_FREE,
            }),
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("model state")
    }

    /// `Fs::lock_dir` / `Fs::lock_nondir`: the real table.
    fn lock(&self, ino: u32) -> Locked<'_> {
        let g = self.locks.lock(ino, neutral());
        assert!(
            self.st().holding.insert(ino),
            "two threads hold inode {ino}'s lock"
        );
        Locked {
            m: self,
            ino,
            _g: g,
        }
    }

    fn rename_lock(&self) -> Option<MutexGuard<'_, ()>> {
        (self.broken != Broken::NoRenameLock).then(|| self.rename.lock().expect("rename"))
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
        let _h = self.gate.read().expect("gate");
        let _p = self.lock(parent);
        if self.broken != Broken::CreateInRemoved && self.st().dirs[&parent].removed {
            return Err(Errno::NoEnt);
        }
        if self.lookup(parent, name).is_ok() {
            return Err(Errno::Exist);
        }
        let ino = {
            let mut st = self.st();
            st.next_ino += 64;
            st.next_ino - 64
        };
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
        let _h = self.gate.read().expect("gate");
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
            st.links.remove(&ino);
        }
        Ok(())
    }

    /// rmdir(2): the rename lock, the parent's lock, look up, the child's lock.
    fn rmdir(&self, parent: u32, name: &'static str) -> Result<(), Errno> {
        let _h = self.gate.read().expect("gate");
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
        st.links.remove(&ino);
        Ok(())
    }

    /// rename(2) of a file from directory `from` to `to` (same name): the rename lock,
    /// then `from`'s lock and `to`'s (in that order, whichever is the parent), then
    /// the file's.
    fn mv(&self, from: u32, name: &'static str, to: u32) -> Result<(), Errno> {
        let _h = self.gate.read().expect("gate");
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

    /// Close the transaction (`Fs::write_lock`, then close): no handle is open, so
    /// the state holds only whole operations.
    fn commit(&self) {
        let _w =
            (self.broken != Broken::CommitWithoutGate).then(|| self.gate.write().expect("gate"));
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
    for (&ino, &l) in &st.links {
        assert_eq!(
            named.get(&ino).copied().unwrap_or(0),
            l,
            "half-done operation {when}: inode {ino} has {l} links but other names"
        );
    }
}

/// One run: the threads of the module note, joined, then the final checks.
fn scenario(broken: Broken) {
    let m = Arc::new(Model::new(broken));
    let spawn = |f: fn(&Model)| {
        let m = m.clone();
        thread::spawn(move || f(&m))
    };
    let threads = [
        spawn(|m| {
            let _ = m.create(B, "g");
            let _ = m.create(A, "f");
            let _ = m.create(B, "h");
        }),
        spawn(|m| {
            let _ = m.mv(B, "x", A);
            let _ = m.unlink(B, "g");
            let _ = m.unlink(A, "x");
        }),
        spawn(|m| {
            // Until `/a/b` is gone or found not empty three times.
            for _ in 0..3 {
                if m.rmdir(A, "b") != Err(Errno::NotEmpty) {
                    break;
                }
                thread::yield_now();
            }
        }),
        spawn(|m| {
            for _ in 0..2 {
                m.commit();
            }
        }),
    ];
    for t in threads {
        t.join().expect("thread");
    }
    let st = m.st();
    check(&st, "at the end");
    assert!(
        st.holding.is_empty(),
        "inode locks left held: {:?}",
        st.holding
    );
    drop(st);
    assert!(m.locks.is_idle(), "the lock table is not empty at the end");
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
    let r = std::panic::catch_unwind(|| shuttle::check_random(move || scenario(b), n));
    let err = r.expect_err("the broken variant passed every schedule");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains(expect), "{b:?}: {msg}");
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
