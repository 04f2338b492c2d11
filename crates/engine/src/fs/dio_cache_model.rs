//! Direct overwrites against the page cache under shuttle: an O_DIRECT overwrite of
//! part of a page (`Fs::write_direct_ino` → `try_overwrite`, the inode's I/O lock
//! shared) beside a buffered write into another part of the same page (`write_buffered`
//! → `pc_write`, also under the shared lock), a buffered read that caches the page
//! (`pc_read` → `get_pages` → `instantiate`), and a flusher (writeback passes, then the
//! clean pages dropped, as `sync_file_range` + `fadvise DONTNEED`). Random and PCT
//! schedules.
//!
//! The hazard: both writers run under the shared lock, so the buffered writer may read
//! the page from the device (to merge its partial write) before the direct write lands,
//! put it in the cache after the direct write's flush of the range, and dirty it; the
//! page's copy of the direct write's bytes is then the old one, and its writeback puts
//! the old bytes back over a direct write that had returned. The kernel's ext4 keeps
//! the two apart with i_rwsem (a buffered write takes it exclusively); rext4 keeps
//! buffered writes inside a file parallel and makes the cache coherent instead
//! (`pc_direct_begin` / `pc_direct_end`), all under the file's state mutex:
//! - before its data goes to the device, a direct overwrite copies its bytes into every
//!   cached page of its range (`seq` bumped, so a writeback of an older snapshot in
//!   flight leaves the page dirty) and marks its range in flight; after, it unmarks
//!   the range, counts itself (`FileState::direct_done`, with its range) and wakes waiters;
//! - a page read from the device is put in the cache only if no direct write over it
//!   finished while it was read (else it is read again) and none is in
//!   flight over it (else it waits for it to end, then reads again).
//!
//! So every page cached while a direct write is on its way holds that write's bytes,
//! and a writeback can never put the old ones back after the data landed. Patching
//! only after the data landed is not enough: between the data write and the patch, a
//! stale page can be dirtied, written back over the new data and dropped (this model's
//! first version found that schedule).
//!
//! The same model found a race of buffered I/O alone: a reader finds page 0 missing and
//! reads it from the device; meanwhile the buffered writer caches and dirties it, the
//! flusher writes it back and drops it; the reader then caches its copy, older than the
//! write (a completed write no longer shows). So a file's clean pages are not dropped
//! while one of its pages is being read in (`FileState::loading`): the writer's page
//! is still cached when the reader's copy arrives, and wins.
//!
//! The model file: one page of four sectors (a byte stands for each sector), over a
//! written block holding `OLD`. The direct write covers sectors 0 and 1 with `DIRECT`,
//! the buffered write sector 3 with `BUFFERED`; each device read or write of a sector
//! is a step of its own (yields between), so half-done transfers are visible. Locks as
//! the real code takes them: the I/O lock (shuttle `RwLock`), the `FileCache` state
//! mutex (with `wb_done`, its condition variable), then the page's mutex.
//!
//! What must hold at the end (after a final writeback): the device holds `DIRECT` in
//! sectors 0-1, `OLD` in 2 and `BUFFERED` in 3, and a cached page says the same.
//!
//! The broken variants (`Broken`) must each be caught:
//! - `NoRecheck`, the code before this model: no copy into cached pages, no mark, no
//!   count;
//! - `PatchAfter`: the copy made after the data landed instead of before (and no mark):
//!   the schedule above;
//! - `NoWait`: a page read while the direct write is in flight (its old bytes) is
//!   cached;
//! - `NoCount`: a page read before the direct write began and cached after it ended;
//! - `NoSeqBump`: pages are patched without a new `seq`: a writeback of an older
//!   snapshot, whose device write lands after the direct write's, cleans the page;
//! - `DropWhileLoading`: clean pages dropped while a page is read in (the reader's
//!   race above).

#![cfg(test)]

use std::sync::Arc;

use shuttle::sync::{Condvar, Mutex, MutexGuard, RwLock};
use shuttle::thread;

const SECTORS: usize = 4;
const OLD: u8 = 0x0D;
const DIRECT: u8 = 0xD1;
const BUFFERED: u8 = 0xB2;
/// The direct write's sectors and the buffered write's.
const DIRECT_SECTORS: std::ops::Range<usize> = 0..2;
const BUFFERED_SECTOR: usize = 3;
/// Writeback-and-drop rounds of the flusher.
const FLUSH_ROUNDS: usize = 3;

/// Which part of the protocol the model leaves out (`None`: the protocol as is).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Broken {
    None,
    NoRecheck,
    PatchAfter,
    NoWait,
    NoCount,
    NoSeqBump,
    DropWhileLoading,
}

struct PageData {
    buf: [u8; SECTORS],
    dirty: bool,
    writeback: bool,
    seq: u64,
}

struct Page {
    data: Mutex<PageData>,
}

impl Page {
    fn lock(&self) -> MutexGuard<'_, PageData> {
        self.data.lock().expect("page mutex")
    }
}

/// The file's cache: its one page (index 0), if cached, the direct writes done,
/// whether one is in flight over the page, and how many reads of pages are on their
/// way into the cache.
struct FileState {
    page: Option<Arc<Page>>,
    direct_writes: u64,
    in_flight: bool,
    loading: usize,
}

struct Model {
    broken: Broken,
    io: RwLock<()>,
    st: Mutex<FileState>,
    /// `FileCache::wb_done`: a direct write ended.
    done: Condvar,
    /// The device's copy of the block (a plain mutex: one sector per step).
    disk: std::sync::Mutex<[u8; SECTORS]>,
}

impl Model {
    fn new(broken: Broken) -> Model {
        Model {
            broken,
            io: RwLock::new(()),
            st: Mutex::new(FileState {
                page: None,
                direct_writes: 0,
                in_flight: false,
                loading: 0,
            }),
            done: Condvar::new(),
            disk: std::sync::Mutex::new([OLD; SECTORS]),
        }
    }

    fn st(&self) -> MutexGuard<'_, FileState> {
        self.st.lock().expect("state mutex")
    }

    fn read_sector(&self, s: usize) -> u8 {
        thread::yield_now();
        self.disk.lock().expect("disk")[s]
    }

    fn write_sector(&self, s: usize, b: u8) {
        thread::yield_now();
        self.disk.lock().expect("disk")[s] = b;
    }

    /// `instantiate`: the page read from the device and put in the cache (a page
    /// cached meanwhile wins); read again when a direct write ended during the read,
    /// after waiting for one in flight.
    fn instantiate(&self) -> Arc<Page> {
        loop {
            let seen = {
                let mut st = self.st();
                st.loading += 1;
                st.direct_writes
            };
            let mut buf = [0u8; SECTORS];
            for (s, b) in buf.iter_mut().enumerate() {
                *b = self.read_sector(s);
            }
            let mut st = self.st();
            st.loading -= 1;
            if let Some(p) = &st.page {
                return p.clone();
            }
            let (wait, count) = match self.broken {
                Broken::NoRecheck | Broken::PatchAfter => (false, false),
                Broken::NoWait => (false, true),
                Broken::NoCount => (true, false),
                Broken::None | Broken::NoSeqBump | Broken::DropWhileLoading => (true, true),
            };
            if wait && st.in_flight {
                while st.in_flight {
                    st = self.done.wait(st).expect("state mutex");
                }
                continue;
            }
            if count && st.direct_writes != seen {
                continue;
            }
            let p = Arc::new(Page {
                data: Mutex::new(PageData {
                    buf,
                    dirty: false,
                    writeback: false,
                    seq: 0,
                }),
            });
            st.page = Some(p.clone());
            return p;
        }
    }

    /// A buffered read of the page (`pc_read`), under the shared I/O lock.
    fn buffered_read(&self) {
        let _io = self.io.read().expect("io lock");
        let cached = self.st().page.clone();
        if cached.is_none() {
            self.instantiate();
        }
    }

    /// `write_buffered` of `BUFFERED` into sector 3 (`pc_write`): the partial page
    /// read first if missing, then, under the state mutex with the page present, the
    /// copy and the dirty mark.
    fn buffered_write(&self) {
        let _io = self.io.read().expect("io lock");
        loop {
            if self.st().page.is_none() {
                self.instantiate();
            }
            let st = self.st();
            let Some(p) = st.page.clone() else {
                continue;
            };
            let mut d = p.lock();
            d.buf[BUFFERED_SECTOR] = BUFFERED;
            d.seq += 1;
            d.dirty = true;
            return;
        }
    }

    /// One writeback pass (`writeback_ino`): snapshot the dirty page (marked under
    /// writeback), write it, then clean it if it did not change meanwhile.
    fn writeback(&self) {
        let snap = {
            let st = self.st();
            let Some(p) = st.page.clone() else { return };
            let mut d = p.lock();
            if !d.dirty || d.writeback {
                return;
            }
            d.writeback = true;
            (p.clone(), d.buf, d.seq)
        };
        let (p, buf, seq) = snap;
        for (s, &b) in buf.iter().enumerate() {
            self.write_sector(s, b);
        }
        let _st = self.st();
        let mut d = p.lock();
        d.writeback = false;
        if d.seq == seq {
            d.dirty = false;
        }
    }

    /// `drop_clean_pages` (fadvise DONTNEED, and the direct write's drops): the page
    /// goes if it is neither dirty nor under writeback, and no page is being read in.
    fn drop_clean(&self) {
        let mut st = self.st();
        if st.loading > 0 && self.broken != Broken::DropWhileLoading {
            return;
        }
        let clean = st.page.as_ref().is_some_and(|p| {
            let d = p.lock();
            !d.dirty && !d.writeback
        });
        if clean {
            st.page = None;
        }
    }

    /// `write_direct_ino` of `DIRECT` into sectors 0-1, a pure overwrite: the range
    /// flushed and its clean pages dropped (`pc_flush_invalidate`), then under the
    /// shared lock (`try_overwrite`) the cached page patched and the range marked in
    /// flight (`pc_direct_begin`), the data written, the mark taken off, the write
    /// counted and the waiters woken (`pc_direct_end`); then the clean pages dropped
    /// again.
    fn direct_write(&self) {
        self.writeback();
        self.drop_clean();
        {
            let _io = self.io.read().expect("io lock");
            let before = !matches!(self.broken, Broken::NoRecheck | Broken::PatchAfter);
            if before {
                let mut st = self.st();
                st.in_flight = true;
                self.patch(&st);
            }
            for s in DIRECT_SECTORS {
                self.write_sector(s, DIRECT);
            }
            if self.broken != Broken::NoRecheck {
                let mut st = self.st();
                if self.broken == Broken::PatchAfter {
                    self.patch(&st);
                }
                st.in_flight = false;
                st.direct_writes += 1;
                self.done.notify_all();
            }
        }
        self.drop_clean();
    }

    /// The direct write's bytes into the cached page, if any.
    fn patch(&self, st: &FileState) {
        if let Some(p) = &st.page {
            let mut d = p.lock();
            d.buf[DIRECT_SECTORS].fill(DIRECT);
            if self.broken != Broken::NoSeqBump {
                d.seq += 1;
            }
        }
    }

    fn flusher(&self) {
        for _ in 0..FLUSH_ROUNDS {
            self.writeback();
            self.drop_clean();
            thread::yield_now();
        }
    }

    /// Everything written back; the device and a cached page hold both writes.
    fn at_the_end(&self) {
        self.writeback();
        let disk = *self.disk.lock().expect("disk");
        let want = {
            let mut w = [OLD; SECTORS];
            w[DIRECT_SECTORS].fill(DIRECT);
            w[BUFFERED_SECTOR] = BUFFERED;
            w
        };
        for (s, (&got, &w)) in disk.iter().zip(want.iter()).enumerate() {
            assert!(
                got == w,
                "a completed write's bytes lost: sector {s} of the device holds {got:#04x}, \
                 the writes give {w:#04x} (device {disk:02x?})"
            );
        }
        if let Some(p) = &self.st().page {
            let d = p.lock();
            assert!(!d.dirty, "the page is still dirty after the last writeback");
            assert_eq!(
                d.buf, want,
                "the cached page differs from the device after the last writeback"
            );
        }
    }
}

fn scenario(broken: Broken) {
    let m = Arc::new(Model::new(broken));
    let spawn = |f: fn(&Model)| {
        let m = m.clone();
        thread::spawn(move || f(&m))
    };
    let threads = [
        spawn(Model::direct_write),
        spawn(Model::buffered_write),
        spawn(Model::buffered_read),
        spawn(Model::flusher),
    ];
    for t in threads {
        t.join().expect("thread");
    }
    m.at_the_end();
}

const RANDOM_SCHEDULES: usize = 20_000;
const PCT_SCHEDULES: usize = 20_000;

#[test]
fn dio_cache_random() {
    shuttle::check_random(|| scenario(Broken::None), RANDOM_SCHEDULES);
}

#[test]
fn dio_cache_pct() {
    shuttle::check_pct(|| scenario(Broken::None), PCT_SCHEDULES, 3);
}

fn caught(b: Broken, n: usize, expect: &str) {
    super::model_check::expect_caught(&b, expect, || shuttle::check_random(move || scenario(b), n));
}

/// The code before the protocol: the buffered writer's page, read before the direct
/// write landed, is written back over it.
#[test]
fn broken_no_recheck_is_caught() {
    caught(Broken::NoRecheck, 20_000, "a completed write's bytes lost");
}

/// The patch after the data landed: the stale page is dirtied, written back over the
/// new data and dropped before the patch comes.
#[test]
fn broken_patch_after_is_caught() {
    caught(Broken::PatchAfter, 50_000, "a completed write's bytes lost");
}

/// A page read while the direct write is in flight, cached without waiting.
#[test]
fn broken_no_wait_is_caught() {
    caught(Broken::NoWait, 50_000, "a completed write's bytes lost");
}

/// A page read before the direct write began, cached after it ended.
#[test]
fn broken_no_count_is_caught() {
    caught(Broken::NoCount, 50_000, "a completed write's bytes lost");
}

/// The patch without a new `seq`: a writeback of the older snapshot cleans the page.
#[test]
fn broken_no_seq_bump_is_caught() {
    caught(Broken::NoSeqBump, 50_000, "a completed write's bytes lost");
}

/// The buffered writer's page written back and dropped while a reader's older copy
/// was on its way in: the copy is cached, the write no longer shows.
#[test]
fn broken_drop_while_loading_is_caught() {
    caught(
        Broken::DropWhileLoading,
        50_000,
        "the cached page differs from the device",
    );
}
