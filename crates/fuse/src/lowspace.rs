//! Free space under the kernel's writeback cache.
//!
//! With FUSE_WRITEBACK_CACHE a write() lands in the kernel's page cache and returns;
//! the server sees the data later, as a WRITE from the kernel's writeback, when no
//! application waits for it. The kernel's ext4 reserves space at write() time; a FUSE
//! server gets no request at write() — so on a full disk the writeback's ENOSPC would
//! drop data the application was told was written, and the writer would go on without
//! end. What a server does see, and what this module builds on:
//! - the *dirty window*: the kernel holds at most so many bytes dirty for one mount,
//!   the bdi's strict limit. As root the server sets it (min_bytes = max_bytes; the
//!   kernel refuses the minimum while other bdis hold too much of the system's share:
//!   the watcher asks again at every look, the maximum alone bounds the window) to
//!   seven eighths of the space left, at most `bdi_max_ratio` of the system's
//!   threshold, so everything the kernel holds always fits (the eighth left covers what
//!   others take before the watcher shrinks the window: it looks again whenever the
//!   space moves by a sixteenth, and shrinks at once); without root it is the kernel's 1%, to which the
//!   WRITEs it may have queued to us are added (`IN_FLIGHT_BYTES`).
//! - OPEN: a file opened while space is low gets FOPEN_DIRECT_IO, so each write()
//!   becomes a WRITE answered before write() returns — ENOSPC exactly, as ext4.
//! - GETATTR: under the writeback cache the kernel refreshes size and mode before a
//!   write() when its cached attributes have expired, and fails the write() with the
//!   GETATTR's error. While space is low the attributes of regular files are given
//!   with no lifetime, so each write() on a descriptor opened earlier first sends a
//!   GETATTR with its handle; it is answered ENOSPC once a cached WRITE was refused
//!   for lack of space, or when less is left for the writer than the kernel may be
//!   holding for the mount (`holding`: the window, plus without root what it may have
//!   in flight), else with the attributes — and the watcher is asked to make the
//!   kernel write that file's dirty pages back now (not waited for: a reply handed to
//!   another thread keeps the request's FUSE-over-io_uring entry busy, and the
//!   launder's WRITEs may need that entry).
//!
//! Low space: the space an unprivileged writer could still take is less than the
//! dirty window plus `MARGIN_BYTES` (with a hysteresis on the way back). What the
//! kernel held dirty when space became low fits; while it is low, the window (root)
//! is `LOW_WINDOW_BYTES`.
//!
//! Threads: handlers call [`LowSpace::after_change`] (two atomic loads, a kick when the
//! space left the band the watcher set); the watcher re-reads the space, tunes the
//! bdi, flips the mode and sends the kernel its notifications — never a request
//! handler: a page invalidation waits for WRITEs that handlers serve.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rext4::Ino;

use crate::adapter::Shared;

/// Headroom on top of the dirty window before space counts as low.
pub(crate) const MARGIN_BYTES: u64 = 2 << 20;
/// The smallest dirty window the server sets (root).
pub(crate) const FLOOR_BYTES: u64 = 1 << 20;
/// The dirty window while space is low (root).
pub(crate) const LOW_WINDOW_BYTES: u64 = 256 << 10;
/// What the kernel may have on its way to us beyond a dirty limit we cannot set:
/// max_background (64) WRITEs of up to 1 MiB.
pub(crate) const IN_FLIGHT_BYTES: u64 = 64 << 20;
/// How often the watcher looks at the space without being kicked (frees).
const POLL: Duration = Duration::from_millis(500);

/// Work for the watcher thread.
enum Job {
    Check,
    /// Make the kernel write its dirty pages of the inode back now.
    Launder(Ino),
}

/// The mount's bdi in sysfs and what we set there.
struct Bdi {
    dir: PathBuf,
    /// We may write it (root) and the user did not ask to leave it alone.
    tunable: bool,
    /// The largest window we set (bdi_max_ratio of the system's dirty threshold).
    cap: u64,
}

pub(crate) struct LowSpace {
    low: AtomicBool,
    /// `after_change` kicks the watcher when the space left leaves this band.
    band_lo: AtomicU64,
    band_hi: AtomicU64,
    /// The kernel's writeback of some file was refused for lack of space since space
    /// became low: the filesystem is full for cached data, and every write() through
    /// the kernel's cache fails from now on (see the module note) until space is no
    /// longer low.
    refused: AtomicBool,
    bdi: Mutex<Option<Bdi>>,
    tx: Mutex<Option<Sender<Job>>>,
    /// Inodes with a launder queued (one at a time each).
    launders: Mutex<std::collections::HashSet<Ino>>,
    /// What the kernel may hold dirty for the mount now (its window, and without
    /// root the WRITEs it may have in flight): while space is low, a descriptor
    /// opened before gets ENOSPC once less than this is left.
    holding: AtomicU64,
}

impl Default for LowSpace {
    fn default() -> Self {
        LowSpace {
            low: AtomicBool::new(false),
            band_lo: AtomicU64::new(0),
            band_hi: AtomicU64::new(u64::MAX),
            refused: AtomicBool::new(false),
            bdi: Mutex::new(None),
            tx: Mutex::new(None),
            launders: Mutex::new(std::collections::HashSet::new()),
            holding: AtomicU64::new(u64::MAX),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The system's dirty-page threshold in bytes (what the kernel lets all writers hold
/// dirty at once), from /proc/vmstat.
fn dirty_threshold_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/vmstat").ok()?;
    let pages: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("nr_dirty_threshold "))?
        .trim()
        .parse()
        .ok()?;
    Some(pages * 4096)
}

fn read_u64(p: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The dirty window to set for `avail` bytes of space left: seven eighths of it,
/// within [`FLOOR_BYTES`, `cap`].
pub(crate) fn window_for(avail: u64, cap: u64) -> u64 {
    (avail - avail / 8).clamp(FLOOR_BYTES.min(cap), cap.max(FLOOR_BYTES.min(cap)))
}

/// Whether `avail` bytes left is low space for `window`, given the mode now
/// (leaving it takes another margin: no flapping at the edge).
pub(crate) fn is_low(avail: u64, window: u64, low_now: bool) -> bool {
    let edge = window + MARGIN_BYTES;
    if low_now {
        avail < edge + MARGIN_BYTES
    } else {
        avail < edge
    }
}

impl LowSpace {
    /// Space is low now.
    pub(crate) fn low(&self) -> bool {
        self.low.load(Ordering::Relaxed)
    }

    /// Whether cached data was refused for lack of space while space is low.
    pub(crate) fn refused(&self) -> bool {
        self.low() && self.refused.load(Ordering::SeqCst)
    }

    /// A cached write (the kernel's writeback) failed with ENOSPC.
    pub(crate) fn note_refused(&self) {
        self.refused.store(true, Ordering::SeqCst);
        self.kick(Job::Check);
    }

    /// After a change that may have used or freed space: `avail` is the space an
    /// unprivileged writer could take now. Kicks the watcher when it left the band
    /// the watcher last set.
    pub(crate) fn after_change(&self, avail: u64) {
        if avail < self.band_lo.load(Ordering::Relaxed)
            || avail > self.band_hi.load(Ordering::Relaxed)
        {
            self.kick(Job::Check);
        }
    }

    /// What the kernel may hold dirty for the mount now (see `holding`).
    pub(crate) fn holding(&self) -> u64 {
        self.holding.load(Ordering::Relaxed)
    }

    /// A write() on a descriptor of `ino` opened before space ran low is coming (its
    /// GETATTR): have the watcher make the kernel push that file's dirty pages to us
    /// now, so a refusal shows at the next write(). Not waited for: a reply handed to
    /// another thread keeps the FUSE-over-io_uring entry of its request busy, and the
    /// kernel's WRITEs for the launder may need that very entry.
    pub(crate) fn launder(&self, ino: Ino) {
        if lock(&self.launders).insert(ino) {
            self.kick(Job::Launder(ino));
        }
    }

    fn kick(&self, j: Job) {
        if let Some(tx) = lock(&self.tx).as_ref() {
            let _ = tx.send(j);
        }
    }

    /// Start the watcher for the mount whose bdi lives at `bdi_dir` (None: not
    /// found), tuning it when `tunable`, with `cap_ratio` percent of the system's
    /// dirty threshold as the largest window (0: leave the bdi as the kernel set it).
    pub(crate) fn start(shared: &Arc<Shared>, bdi_dir: Option<PathBuf>, cap_ratio: u32) {
        let ls = &shared.lowspace;
        if let Some(dir) = bdi_dir {
            let writable = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("max_bytes"))
                .is_ok();
            let cap = dirty_threshold_bytes().map_or(1 << 30, |t| t / 100 * u64::from(cap_ratio));
            let tunable = writable && cap_ratio > 0 && cap > 0;
            if tunable {
                // Strict: the mount's own limit holds even while the rest of the
                // system dirties little (without it the kernel lets any bdi fill the
                // system's free-running share, whatever its max_bytes).
                let _ = std::fs::write(dir.join("strict_limit"), "1");
            }
            *lock(&ls.bdi) = Some(Bdi { dir, tunable, cap });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        *lock(&ls.tx) = Some(tx);
        let weak = Arc::downgrade(shared);
        let spawned = std::thread::Builder::new()
            .name("rext4-space".into())
            .spawn(move || watch(&weak, &rx));
        if spawned.is_err() {
            *lock(&ls.tx) = None;
        } else {
            ls.kick(Job::Check);
        }
    }

    /// Stop the watcher (the session ended).
    pub(crate) fn stop(&self) {
        *lock(&self.tx) = None;
    }
}

fn watch(weak: &Weak<Shared>, rx: &Receiver<Job>) {
    let mut set_window = 0u64;
    let mut min_refused = false;
    loop {
        let job = match rx.recv_timeout(POLL) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => Job::Check,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let Some(s) = weak.upgrade() else { return };
        match job {
            Job::Check => check(&s, &mut set_window, &mut min_refused),
            Job::Launder(ino) => {
                lock(&s.lowspace.launders).remove(&ino);
                s.kernel_writeback(ino);
            }
        }
    }
}

/// Re-read the space, tune the window, flip the mode. `min_refused`: the kernel
/// refused the window as the mount's guaranteed minimum (other bdis held too much of
/// the system's share); it is asked again at every look until it takes it.
fn check(s: &Shared, set_window: &mut u64, min_refused: &mut bool) {
    let ls = &s.lowspace;
    let avail = s.available_bytes();
    let was = ls.low();
    let bdi = lock(&ls.bdi);
    let tunable = bdi.as_ref().is_some_and(|b| b.tunable);
    // The window the mount has (or, tunable, would have with space not low).
    let normal = match bdi.as_ref() {
        Some(b) if b.tunable => window_for(avail, b.cap),
        // Not ours to set: the kernel's limit, plus what it may have in flight
        // beyond it (its per-writer slack between two throttling checks and the
        // background WRITEs queued to us), which it does not count as dirty the
        // moment it is queued.
        Some(b) => read_u64(&b.dir.join("max_bytes"))
            .map_or(u64::MAX, |w| w.saturating_add(IN_FLIGHT_BYTES)),
        // Unknown: assume the kernel may hold the system's whole threshold.
        None => dirty_threshold_bytes().unwrap_or(u64::MAX),
    };
    let low = is_low(avail, normal, was);
    // What the kernel may hold now: the window we set (root), else its own.
    let mut window = normal;
    if let Some(b) = bdi.as_ref().filter(|b| b.tunable) {
        // Low: a window so small that the kernel's own throttling writes each
        // writer's data back almost as it comes.
        let want = if low { LOW_WINDOW_BYTES } else { normal };
        // Shrink at once (what the kernel may hold must keep fitting); grow only by
        // an eighth or more (a sysfs write per WRITE would cost).
        if *set_window == 0
            || want < *set_window - *set_window / 64
            || want > *set_window + *set_window / 8
        {
            let v = want.to_string();
            // The kernel keeps min <= max: min goes first when shrinking, max first
            // when growing.
            let order: [&str; 2] = if want < *set_window {
                ["min_bytes", "max_bytes"]
            } else {
                ["max_bytes", "min_bytes"]
            };
            let mut ok = true;
            for name in order {
                // The minimum is a guaranteed share, refused when other bdis hold
                // too much of it: the maximum is what bounds us.
                let wrote = std::fs::write(b.dir.join(name), &v).is_ok();
                if name == "min_bytes" {
                    *min_refused = !wrote;
                }
                ok &= wrote || name == "min_bytes";
            }
            if ok {
                *set_window = want;
            }
        } else if *min_refused && *set_window != 0 {
            *min_refused = std::fs::write(b.dir.join("min_bytes"), set_window.to_string()).is_err();
        }
        if *set_window != 0 {
            window = *set_window;
        }
    }
    drop(bdi);
    ls.holding.store(window, Ordering::Relaxed);
    // The band in which nothing needs a look: the mode stays and (tunable) the
    // space stays within a sixteenth of what the window was set for — the eighth
    // of it the window leaves free covers what others take meanwhile.
    let edge = normal + MARGIN_BYTES;
    let (lo, hi) = if low {
        (0, edge + MARGIN_BYTES)
    } else if tunable {
        (edge.max(avail - avail / 16), avail + avail / 16)
    } else {
        (edge, u64::MAX)
    };
    ls.band_lo.store(lo, Ordering::Relaxed);
    ls.band_hi.store(hi, Ordering::Relaxed);
    if low == was {
        return;
    }
    ls.low.store(low, Ordering::SeqCst);
    if low {
        // Descriptors opened before: their next write() must ask (GETATTR), and
        // what the kernel holds of them comes now, while it still fits.
        for ino in s.files_open_cached_for_writing() {
            s.invalidate_attrs_only(ino);
            s.kernel_writeback(ino);
        }
        if tunable {
            log::warn!(
                "space is low ({} KiB left, dirty window {} KiB): files opened for \
                 writing from now on write through",
                avail >> 10,
                window >> 10
            );
        } else {
            // Without root this fires on any image smaller than the kernel's own
            // window, empty or not: say why, and that nothing is wrong.
            log::warn!(
                "{} KiB free is less than the kernel may hold unwritten for this mount \
                 ({} KiB, its own limit; only root can lower it): files opened for \
                 writing from now on write through, so that write() itself reports a \
                 full disk",
                avail >> 10,
                window >> 10
            );
        }
    } else {
        ls.refused.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_half_the_space_within_floor_and_cap() {
        assert_eq!(window_for(1 << 40, 1 << 30), 1 << 30);
        assert_eq!(window_for(128 << 20, 1 << 30), 112 << 20);
        assert_eq!(window_for(1 << 20, 1 << 30), FLOOR_BYTES);
        assert_eq!(window_for(100 << 20, 4 << 20), 4 << 20);
        assert_eq!(window_for(100 << 20, 512 << 10), 512 << 10);
    }

    #[test]
    fn low_space_has_a_hysteresis() {
        let w = 8 << 20;
        assert!(!is_low(w + MARGIN_BYTES, w, false));
        assert!(is_low(w + MARGIN_BYTES - 1, w, false));
        assert!(is_low(w + MARGIN_BYTES + 1, w, true));
        assert!(!is_low(w + 2 * MARGIN_BYTES, w, true));
    }
}
