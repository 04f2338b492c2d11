//! Counters that every thread adds to on every operation (cache hits, metadata
//! writes): one atomic per stripe, each on its own cache line, a thread adding to the
//! stripe it was given. One shared atomic would move its cache line between the CPUs
//! at every add — and the struct fields beside it with it — so two threads working on
//! unrelated inodes would wait on each other's counting.
//!
//! A sum reads every stripe: it is exact once the adds have stopped, and while they
//! go on it counts every add that finished before the sum started (so two sums tell
//! whether anything was added in between).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Stripes per counter: more than the threads that usually run at once.
const STRIPES: usize = 16;

/// An atomic alone on its cache line (and the next: the adjacent-line prefetcher
/// fetches pairs).
#[repr(align(128))]
#[derive(Default, Debug)]
pub struct AlignedU64(pub AtomicU64);

type Line = AlignedU64;

/// A striped counter (see the module note).
pub struct Counter {
    stripes: Box<[Line]>,
}

impl Default for Counter {
    fn default() -> Counter {
        Counter {
            stripes: (0..STRIPES).map(|_| Line::default()).collect(),
        }
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counter({})", self.sum())
    }
}

/// This thread's number, given in the order threads first ask (0, 1, 2, ...): for
/// spreading threads over stripes or slots round-robin (here, and `grace`'s slots).
pub fn thread_ordinal() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    MINE.with(|s| *s)
}

/// This thread's stripe.
fn stripe() -> usize {
    thread_ordinal() % STRIPES
}

impl Counter {
    /// Add `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.stripes[stripe()].0.fetch_add(n, Ordering::Relaxed);
    }

    /// The sum of every stripe.
    pub fn sum(&self) -> u64 {
        self.stripes
            .iter()
            .fold(0u64, |s, l| s.wrapping_add(l.0.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn adds_from_many_threads_sum_up() {
        let c = Arc::new(Counter::default());
        let ts: Vec<_> = (0..20)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add(i);
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().expect("thread");
        }
        assert_eq!(c.sum(), 1000 * (0..20).sum::<u64>());
        assert_eq!(format!("{c:?}"), format!("Counter({})", c.sum()));
    }
}
