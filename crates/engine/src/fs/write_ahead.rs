//! Read-ahead for streams of partial-page direct overwrites on a buffered image.
//!
//! A direct overwrite that covers only part of a host page (2 KiB writes, or any write
//! into an image of 1 KiB blocks) is a partial write into the image file's page cache
//! on the host, which must read the page from its disk first when it is not cached —
//! synchronously, in the serving thread. A stream of such writes moving through a file
//! after a cold start (fio `--rw=write --bs=2k --direct=1` after a drop_caches) then
//! waits for one host read per page. The kernel's ext4 on a loop device does not: its
//! block layer merges the queued 2 KiB writes into whole pages before the loop device
//! writes them. Here, the device range ahead of such a stream is handed to the device
//! as a hint (`BlockDevice::will_need`: `posix_fadvise(WILLNEED)` on a buffered image
//! file), so the host reads it ahead in large requests, asynchronously, and the
//! stream's partial writes find their pages cached.
//!
//! Detection, per stripe of inode numbers (one atomic each, no lock): the stripe keeps
//! the device offset up to which it has hinted (`ahead`). A write that starts at most
//! [`LAG`] behind it belongs to the stream (jobs of one stream drift apart; the ones
//! behind write into pages already read) and, when it ends less than half a
//! [`WINDOW`] before `ahead`, hints the next window from `ahead` on. A write anywhere
//! else starts a candidate stream at its end, with no hint: the next write right after
//! it hints. Random writes thus almost never hint (one must land within half a window
//! before the last one's end).
//!
//! Only a hint: contents and ordering never depend on it; a device that cannot use it
//! ignores it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::striped::AlignedU64;

/// Bytes hinted at a time.
const WINDOW: u64 = 2 << 20;
/// How far behind the hinted end a write may start and still be the stream's.
const LAG: u64 = 64 << 20;
/// Host page size assumed for "partial" (the common 4 KiB).
const HOST_PAGE: u64 = 4096;
const STRIPES: usize = 16;

/// Per-stripe stream state (see the module note).
pub(crate) struct WriteAhead {
    ahead: [AlignedU64; STRIPES],
}

impl Default for WriteAhead {
    fn default() -> Self {
        WriteAhead {
            ahead: std::array::from_fn(|_| AlignedU64(AtomicU64::new(u64::MAX))),
        }
    }
}

/// Whether `len` bytes at device offset `at` leave part of a host page unwritten.
fn partial(at: u64, len: u64) -> bool {
    !at.is_multiple_of(HOST_PAGE) || !len.is_multiple_of(HOST_PAGE)
}

/// The stream rule: given the stripe's hinted end `ahead` (`u64::MAX`: none) and a
/// write of `len` bytes at device offset `at`, the new hinted end and the range to hint.
fn step(ahead: u64, at: u64, len: u64) -> (u64, Option<(u64, u64)>) {
    let end = at.saturating_add(len);
    let in_stream = ahead != u64::MAX && at <= ahead && ahead - at <= LAG;
    if !in_stream {
        return (end, None);
    }
    if ahead.saturating_sub(end) >= WINDOW / 2 {
        return (ahead, None);
    }
    let to = end.saturating_add(WINDOW);
    (to, Some((ahead.max(end), to)))
}

impl WriteAhead {
    /// A direct overwrite of `len` bytes at device offset `at` for inode `ino` was
    /// written: the range to hint, if any. Partial-page writes only; a stripe changed
    /// by another thread meanwhile is left to it.
    pub(crate) fn note(&self, ino: u32, at: u64, len: u64) -> Option<(u64, u64)> {
        if !partial(at, len) {
            return None;
        }
        let cell = &self.ahead[ino as usize % STRIPES].0;
        let cur = cell.load(Ordering::Relaxed);
        let (next, hint) = step(cur, at, len);
        if next == cur {
            return None;
        }
        cell.compare_exchange(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            .ok()
            .and(hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequential_stream_hints_ahead_of_itself_once_per_half_window() {
        let wa = WriteAhead::default();
        let mut hints = Vec::new();
        let base = 1 << 30;
        for k in 0..4096u64 {
            if let Some(h) = wa.note(7, base + k * 2048, 2048) {
                hints.push(h);
            }
        }
        // 8 MiB written: the first hint at the second write, then one per half window
        // (and a block) of progress.
        assert_eq!(hints[0], (base + 4096, base + 4096 + WINDOW));
        assert_eq!(hints.len(), 8, "{hints:?}");
        for w in hints.windows(2) {
            assert_eq!(
                w[1].0, w[0].1,
                "hints follow each other without gaps: {w:?}"
            );
        }
        // Every written byte past the first write was hinted before it was written.
        let last = hints.last().expect("hints").1;
        assert!(last >= base + (8 << 20));
    }

    #[test]
    fn random_and_whole_page_writes_hint_nothing() {
        let wa = WriteAhead::default();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut hinted = 0;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let at = (x % (1 << 30)) / 2048 * 2048;
            hinted += usize::from(wa.note(3, at, 2048).is_some());
        }
        assert!(hinted < 200, "random 2 KiB writes hinted {hinted} times");
        let wa = WriteAhead::default();
        assert!((0..1000u64).all(|k| wa.note(3, k * 4096, 4096).is_none()));
    }

    #[test]
    fn jobs_of_one_stream_behind_its_front_keep_it() {
        // Eight writers on the same offsets, one of them 3 MiB behind: the front's
        // hints continue, the laggard neither hints nor resets.
        let wa = WriteAhead::default();
        let mut front = 0u64;
        let mut hints = 0;
        for k in 0..20_000u64 {
            let at = if k % 8 == 7 {
                front.saturating_sub(3 << 20)
            } else {
                front
            };
            hints += usize::from(wa.note(1, at, 2048).is_some());
            if k % 8 == 6 {
                front += 2048;
            }
        }
        let written = front;
        assert!(
            hints as u64 >= written / (WINDOW / 2) - 1,
            "{hints} hints over {written} bytes"
        );
        assert_eq!(
            step(LAG + 4096, 2048, 2048),
            (4096, None),
            "past the lag: a new one"
        );
    }
}
