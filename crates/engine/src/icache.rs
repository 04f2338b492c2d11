//! The inode cache and the dentry cache: decoded inodes by number, and directory
//! entries (positive and negative) by (directory, name), shared by all threads.
//!
//! Owns: two lock-free hash maps (papaya: a hit is a few atomic loads, no lock) with a
//! bound each, and the [`Grace`] tracker that keeps a freed inode number from being
//! reused while a lockless reader may still hold it (see `grace.rs`).
//!
//! Source of truth: the buffer cache. These caches hold what decoding it gives, so
//! they must never hold something older than it. Writers (who change the buffer cache
//! under `Fs::write_lock`, or under the inode lock of what a handle changes) call [`Cache::set`] or [`Cache::invalidate`] *after* the
//! change; readers that miss decode from the buffer cache and [`Cache::fill`] with a
//! ticket taken *before* they read. Each key hashes to one of [`STRIPES`] sequence
//! counters; `set`/`invalidate` bump the key's counter, and `fill` inserts only if the
//! counter did not move, checking again after the insert and removing the entry if it
//! did. Every interleaving ends with the new value or no entry:
//! - the writer bumped before the reader's check: the reader does not insert, or
//!   removes what it inserted;
//! - the writer bumped after it: the writer's insert (or removal) comes last.
//!
//! Bounds: when a map grows past its capacity, one thread evicts about an eighth of
//! it, giving entries hit since the last pass a second chance (CLOCK-like).
//!
//! Who calls: `Fs::read_inode` / `write_inode_*` (inodes), `Fs::lookup` and the
//! namespace operations in `ops.rs` (dentries), `alloc.rs` (grace for inode reuse).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Arc;

use papaya::{Equivalent, HashMap};
use rext4_format::inode::Inode;
use seize::Guard;

use crate::grace::Grace;
use crate::inthash::IntHash;
use crate::striped::{AlignedU64, Counter};

/// Sequence-counter stripes per cache (keys hashing to one stripe share a counter:
/// a write to one of them only makes concurrent fills of the others miss).
pub const STRIPES: usize = 64;

/// Entries a thread retires before its batch is reclaimed. Each reclamation starts
/// with a process-wide memory barrier (membarrier(2): an interrupt to every CPU that
/// runs one of the process's threads — in a VM, an exit on each); at seize's default of
/// 32, a create or unlink paid one every dozen operations, and two threads spent a
/// tenth of their time in them. Retired entries wait a little longer to be freed.
pub const RETIRE_BATCH: usize = 1024;

/// The reclaimer for the engine's lock-free maps (see [`RETIRE_BATCH`]).
pub fn collector() -> seize::Collector {
    seize::Collector::new().batch_size(RETIRE_BATCH)
}

/// Default bounds.
pub const INODES_DEFAULT: usize = 1 << 17;
pub const DENTRIES_DEFAULT: usize = 1 << 18;

/// An entry. Its value sits in a cell of its own, so that a writer's [`Cache::set`] of
/// a cached key swaps the cell instead of rewriting the map's slot for the key: the
/// map's slots share cache lines with other keys' slots, which every lookup reads, and
/// a key changed at every create or unlink (its directory's inode, the churned name's
/// dentry) cost the lookups and the writer those lines back and forth.
struct Slot<V> {
    /// A `Box<V>`, never null; replaced values are retired under the map's guard.
    v: AtomicPtr<V>,
    /// Hit since the last eviction pass.
    hot: AtomicBool,
}

impl<V> Slot<V> {
    fn new(v: V) -> Slot<V> {
        Slot {
            v: AtomicPtr::new(Box::into_raw(Box::new(v))),
            hot: AtomicBool::new(false),
        }
    }

    /// The value, read under `guard` (which keeps a replaced one alive).
    fn value(&self, guard: &impl Guard) -> &V {
        // SAFETY: the cell always holds a live Box<V>; one replaced while `guard` is
        // held is retired through the same collector, so freed only after it.
        unsafe { &*guard.protect(&self.v, Ordering::Acquire) }
    }
}

impl<V> Drop for Slot<V> {
    fn drop(&mut self) {
        // SAFETY: the slot is being reclaimed (or was never shared): no reader holds
        // it, and the cell's Box is owned by it alone.
        unsafe { drop(Box::from_raw(*self.v.get_mut())) };
    }
}

/// A bounded, validated, lock-free cache (see the module note), its keys hashed by
/// `S` (integer keys: [`IntHash`]).
pub struct Cache<K, V, S = RandomState> {
    map: HashMap<K, Slot<V>, S>,
    hasher: S,
    /// One line each: two threads setting keys of different stripes do not share one.
    seqs: Box<[AlignedU64]>,
    cap: usize,
    evicting: AtomicBool,
    hits: Counter,
    misses: Counter,
}

/// A reader's permission to fill one key (taken before reading the source).
#[derive(Clone, Copy)]
pub struct Ticket {
    stripe: usize,
    seq: u64,
}

impl<K, V, S> Cache<K, V, S>
where
    K: Hash + Eq + Clone + Send + Sync,
    V: Clone + Send + Sync,
    S: BuildHasher + Clone + Default,
{
    pub fn new(cap: usize) -> Self {
        let hasher = S::default();
        Cache {
            map: HashMap::builder()
                .hasher(hasher.clone())
                .collector(collector())
                .build(),
            hasher,
            seqs: (0..STRIPES).map(|_| AlignedU64::default()).collect(),
            cap: cap.max(64),
            evicting: AtomicBool::new(false),
            hits: Counter::default(),
            misses: Counter::default(),
        }
    }

    fn stripe<Q: Hash + ?Sized>(&self, k: &Q) -> usize {
        // Any fixed hash will do for stripes: the map's kind.
        (self.hasher.hash_one(k) as usize) % STRIPES
    }

    /// The cached value, if any.
    pub fn get<Q>(&self, k: &Q) -> Option<V>
    where
        Q: Equivalent<K> + Hash + ?Sized,
    {
        let guard = self.map.guard();
        match self.map.get(k, &guard) {
            Some(s) => {
                if !s.hot.load(Ordering::Relaxed) {
                    s.hot.store(true, Ordering::Relaxed);
                }
                self.hits.add(1);
                Some(s.value(&guard).clone())
            }
            None => {
                self.misses.add(1);
                None
            }
        }
    }

    /// Take before reading the source for a fill of `k`.
    pub fn ticket<Q: Hash + ?Sized>(&self, k: &Q) -> Ticket {
        let stripe = self.stripe(k);
        Ticket {
            stripe,
            seq: self.seqs[stripe].0.load(Ordering::SeqCst),
        }
    }

    fn moved(&self, t: Ticket) -> bool {
        self.seqs[t.stripe].0.load(Ordering::SeqCst) != t.seq
    }

    /// Insert what a reader decoded, unless a writer changed the key since `t`.
    pub fn fill(&self, k: K, v: V, t: Ticket) {
        if self.moved(t) {
            return;
        }
        let m = self.map.pin();
        m.insert(k.clone(), Slot::new(v));
        if self.moved(t) {
            m.remove(&k);
        }
        drop(m);
        self.maybe_evict();
    }

    /// A writer changed the source of `k` to what `v` says (call after the change).
    pub fn set(&self, k: K, v: V) {
        let stripe = self.stripe(&k);
        self.seqs[stripe].0.fetch_add(1, Ordering::SeqCst);
        let guard = self.map.guard();
        match self.map.get(&k, &guard) {
            // Cached: swap the value in the entry's cell (see `Slot`). An entry removed
            // meanwhile (an invalidation, an eviction) takes the value with it: the key
            // is then simply not cached, and a fill after this bump reads the source
            // as this writer left it.
            Some(s) => {
                let new = Box::into_raw(Box::new(v));
                let old = guard.swap(&s.v, new, Ordering::AcqRel);
                // SAFETY: `old` came out of the cell, where no reader that enters from
                // now on finds it; readers inside a guard keep it until they leave.
                unsafe { guard.defer_retire(old, seize::reclaim::boxed::<V>) };
            }
            None => {
                self.map.insert(k, Slot::new(v), &guard);
            }
        }
        drop(guard);
        self.maybe_evict();
    }

    /// A writer changed (or may have changed) the source of `k` (call after).
    pub fn invalidate<Q>(&self, k: &Q)
    where
        Q: Equivalent<K> + Hash + ?Sized,
    {
        let stripe = self.stripe(k);
        self.seqs[stripe].0.fetch_add(1, Ordering::SeqCst);
        self.map.pin().remove(k);
    }

    /// Drop every entry for which `f` holds (bumping every stripe first).
    pub fn invalidate_where(&self, f: impl Fn(&K) -> bool) {
        for s in self.seqs.iter() {
            s.0.fetch_add(1, Ordering::SeqCst);
        }
        self.map.pin().retain(|k, _| !f(k));
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (hits, misses) since creation.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits.sum(), self.misses.sum())
    }

    fn maybe_evict(&self) {
        if self.map.len() <= self.cap || self.evicting.swap(true, Ordering::Acquire) {
            return;
        }
        let want = self.cap / 8;
        let m = self.map.pin();
        let mut victims = Vec::with_capacity(want);
        for (k, s) in m.iter() {
            if victims.len() >= want {
                break;
            }
            if s.hot.swap(false, Ordering::Relaxed) {
                continue;
            }
            victims.push(k.clone());
        }
        if victims.len() < want {
            // Everything was hot: take the first ones anyway (their bits are clear now).
            for (k, _) in m.iter() {
                if victims.len() >= want {
                    break;
                }
                victims.push(k.clone());
            }
        }
        for k in &victims {
            // Removing is always safe for a cache: at worst the next lookup misses.
            m.remove(k);
        }
        drop(m);
        self.evicting.store(false, Ordering::Release);
    }
}

/// Key of the dentry cache: (directory inode, name).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct DentKey {
    pub dir: u32,
    pub name: Box<[u8]>,
}

/// Borrowed form of [`DentKey`] for lookups without allocating. Hashes exactly like
/// `DentKey` (same fields, same order, `[u8]` hashing as `Box<[u8]>` does).
#[derive(Hash)]
pub struct DentRef<'a> {
    pub dir: u32,
    pub name: &'a [u8],
}

impl Equivalent<DentKey> for DentRef<'_> {
    fn equivalent(&self, k: &DentKey) -> bool {
        self.dir == k.dir && *self.name == *k.name
    }
}

/// A cached directory entry: `None` means the name is known not to exist.
pub type Dent = Option<(u32, u8)>;

/// The caches of one filesystem.
pub struct Caches {
    pub inodes: Cache<u32, Arc<Inode>, IntHash>,
    pub dentries: Cache<DentKey, Dent>,
    pub grace: Grace,
}

impl Caches {
    pub fn new(inodes: usize, dentries: usize) -> Caches {
        Caches {
            inodes: Cache::new(inodes),
            dentries: Cache::new(dentries),
            grace: Grace::new(),
        }
    }
}

/// A hasher-independent check that `DentRef` and `DentKey` hash alike (papaya looks
/// borrowed keys up by hash).
#[cfg(test)]
fn same_hash(a: &impl Hash, b: &impl Hash) -> bool {
    use std::hash::BuildHasher;
    let s = std::collections::hash_map::RandomState::new();
    s.hash_one(a) == s.hash_one(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_dentry_keys_find_owned_ones() {
        let k = DentKey {
            dir: 7,
            name: b"hello".to_vec().into_boxed_slice(),
        };
        let r = DentRef {
            dir: 7,
            name: b"hello",
        };
        assert!(same_hash(&k, &r));
        let c: Cache<DentKey, Dent> = Cache::new(100);
        let t = c.ticket(&r);
        c.fill(k.clone(), Some((12, 1)), t);
        assert_eq!(c.get(&r), Some(Some((12, 1))));
        assert_eq!(
            c.get(&DentRef {
                dir: 8,
                name: b"hello"
            }),
            None
        );
    }

    #[test]
    fn a_fill_that_raced_a_writer_is_dropped() {
        let c: Cache<u32, u32> = Cache::new(100);
        // Reader takes its ticket, then a writer changes the source and sets the key.
        let t = c.ticket(&5);
        c.set(5, 2);
        c.fill(5, 1, t); // the reader's (old) value must not win
        assert_eq!(c.get(&5), Some(2));
        // Reader after an invalidation: its old value must not come back either.
        let t = c.ticket(&6);
        c.invalidate(&6);
        c.fill(6, 1, t);
        assert_eq!(c.get(&6), None);
        // A quiet fill sticks.
        let t = c.ticket(&7);
        c.fill(7, 3, t);
        assert_eq!(c.get(&7), Some(3));
    }

    /// A set of a cached key swaps the value in place: the map's slot for it stays
    /// the same entry, and readers see the new value.
    #[test]
    fn a_set_of_a_cached_key_changes_it_in_place() {
        let c: Cache<u32, u32> = Cache::new(100);
        c.set(5, 1);
        let slot = |c: &Cache<u32, u32>| {
            let g = c.map.guard();
            c.map.get(&5, &g).map(|s| s as *const Slot<u32> as usize)
        };
        let before = slot(&c).expect("cached");
        c.set(5, 2);
        assert_eq!(slot(&c), Some(before), "the entry was replaced");
        assert_eq!(c.get(&5), Some(2));
        c.invalidate(&5);
        assert_eq!(c.get(&5), None);
        c.set(5, 3);
        assert_eq!(c.get(&5), Some(3));
    }

    /// Readers of a key that writers keep setting, invalidating and evicting (a small
    /// bound) see only whole values that were set, each reader never an older one
    /// than it saw before; replaced values are freed only after their readers leave
    /// (each value checks its own contents, so a freed and reused one shows).
    #[test]
    fn readers_see_whole_values_while_writers_swap_them() {
        let c: Arc<Cache<u32, Arc<Vec<u64>>>> = Arc::new(Cache::new(64));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (c, stop) = (c.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(v) = c.get(&1) {
                            let x = v[0];
                            assert!(v.iter().all(|&y| y == x), "torn or freed value");
                            assert!(x >= seen, "went back from {seen} to {x}");
                            seen = x;
                            reads += 1;
                        }
                    }
                    reads
                })
            })
            .collect();
        const LAST: u64 = 20_000;
        for i in 1..=LAST {
            c.set(1, Arc::new(vec![i; 16]));
            if i % 97 == 0 {
                c.invalidate(&1);
            }
            if i % 13 == 0 {
                // Other keys past the bound: eviction passes run.
                for k in 0..80u32 {
                    c.set(1000 + k, Arc::new(vec![0; 16]));
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let reads: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
        assert!(reads > 0);
        if let Some(v) = c.get(&1) {
            assert_eq!(v[0], LAST);
        }
    }

    #[test]
    fn the_bound_holds() {
        let c: Cache<u32, u32> = Cache::new(1000);
        for i in 0..10_000u32 {
            let t = c.ticket(&i);
            c.fill(i, i, t);
        }
        assert!(c.len() <= 1001, "{} entries", c.len());
        // Hot entries survive a pass more often than cold ones; at least the map still
        // answers correctly for whatever it kept.
        for i in 0..10_000u32 {
            if let Some(v) = c.get(&i) {
                assert_eq!(v, i);
            }
        }
    }
}
