//! Counting and slow devices: what a disk or a network volume costs, on any backend.
//!
//! [`Counted`] counts requests and bytes of the device under it; every filesystem opens
//! through one (`Fs::io_stats`). [`LatencyDevice`] adds a fixed or random delay to each
//! request and serves at most `queue_depth` of them at a time (the rest wait for a
//! slot, as on a device queue): on a device where a read costs milliseconds what counts
//! is how many reads are issued one after another, and tests and `rext4 bench
//! firstwrite` measure exactly that with it.
//!
//! Parallel requests: [`BlockDevice::read_many`] issues a batch of reads; its default
//! runs up to [`MAX_IN_FLIGHT`] of them at once on scoped threads, so a batch on a
//! latency device costs about one latency per queue-depth's worth of requests instead
//! of one per request.

use std::io;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::BlockDevice;

/// A counter alone on its cache line (every thread bumps it).
#[repr(align(64))]
#[derive(Default)]
struct Padded<T>(T);

/// Reads a batch keeps in flight at once (the kernel's mballoc prefetch keeps 8).
pub const MAX_IN_FLIGHT: usize = 8;

/// Requests and bytes a device has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCounts {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
}

impl IoCounts {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &IoCounts) -> IoCounts {
        IoCounts {
            reads: self.reads - earlier.reads,
            read_bytes: self.read_bytes - earlier.read_bytes,
            writes: self.writes - earlier.writes,
            write_bytes: self.write_bytes - earlier.write_bytes,
            flushes: self.flushes - earlier.flushes,
        }
    }
}

#[derive(Default)]
struct Counters {
    reads: Padded<AtomicU64>,
    read_bytes: AtomicU64,
    writes: Padded<AtomicU64>,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
}

impl Counters {
    fn read(&self, n: usize) {
        self.reads.0.fetch_add(1, Relaxed);
        self.read_bytes.fetch_add(n as u64, Relaxed);
    }
    fn write(&self, n: usize) {
        self.writes.0.fetch_add(1, Relaxed);
        self.write_bytes.fetch_add(n as u64, Relaxed);
    }
    fn get(&self) -> IoCounts {
        IoCounts {
            reads: self.reads.0.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            writes: self.writes.0.load(Relaxed),
            write_bytes: self.write_bytes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
        }
    }
}

thread_local! {
    /// This thread's requests are background work ([`mark_background`]).
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Mark the calling thread's requests as background work: [`Counted`] does not count
/// them as foreground activity (the background prefetcher waits for a quiet device).
pub fn mark_background() {
    BACKGROUND.with(|b| b.set(true));
}

/// Counts what goes to the device under it (and passes everything through), and,
/// while someone watches ([`Counted::watch_foreground`]: the background prefetcher
/// while it runs), tracks foreground activity: requests in flight from threads not
/// marked background and when the last one ended. Unwatched, a request costs only its
/// two counters.
pub struct Counted {
    inner: Arc<dyn BlockDevice>,
    /// Foreground requests.
    counts: Counters,
    /// Requests of threads marked background.
    background: Counters,
    /// Foreground requests in flight.
    in_flight: Padded<AtomicU64>,
    /// When the last foreground request started or ended (since `epoch`, ns).
    last: AtomicU64,
    /// Foreground activity is tracked (`in_flight`, `last`).
    watched: std::sync::atomic::AtomicBool,
    epoch: std::time::Instant,
}

impl Counted {
    pub fn new(inner: Arc<dyn BlockDevice>) -> Self {
        Counted {
            inner,
            counts: Counters::default(),
            background: Counters::default(),
            in_flight: Padded::default(),
            last: AtomicU64::new(0),
            watched: std::sync::atomic::AtomicBool::new(false),
            epoch: std::time::Instant::now(),
        }
    }

    /// Requests of threads not marked background.
    pub fn counts(&self) -> IoCounts {
        self.counts.get()
    }

    /// Requests of threads marked background ([`mark_background`]).
    pub fn background_counts(&self) -> IoCounts {
        self.background.get()
    }

    /// Whose counters this request goes to.
    fn counters(&self) -> &Counters {
        match BACKGROUND.with(|b| b.get()) {
            true => &self.background,
            false => &self.counts,
        }
    }

    /// Track foreground activity from now on (`on`), or stop. A request that started
    /// before tracking did is not seen in flight.
    pub fn watch_foreground(&self, on: bool) {
        self.watched.store(on, Relaxed);
    }

    /// How long the device has been without foreground requests (zero while one is
    /// in flight), as tracked while watched ([`Self::watch_foreground`]).
    pub fn foreground_idle(&self) -> Duration {
        if self.in_flight.0.load(Relaxed) > 0 {
            return Duration::ZERO;
        }
        let now = self.epoch.elapsed().as_nanos() as u64;
        Duration::from_nanos(now.saturating_sub(self.last.load(Relaxed)))
    }

    fn track<R>(&self, f: impl FnOnce() -> R) -> R {
        // The page cache's rule, checked in debug builds: no device I/O under its
        // mutexes (every request of an open filesystem passes here).
        crate::lockdep::no_page_cache_lock("a device request");
        if !self.watched.load(Relaxed) || BACKGROUND.with(|b| b.get()) {
            return f();
        }
        self.in_flight.0.fetch_add(1, Relaxed);
        let r = f();
        self.last
            .fetch_max(self.epoch.elapsed().as_nanos() as u64, Relaxed);
        self.in_flight.0.fetch_sub(1, Relaxed);
        r
    }
}

impl BlockDevice for Counted {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.counters().read(buf.len());
        self.track(|| self.inner.read_at(buf, offset))
    }
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        self.counters().read(buf.len());
        self.track(|| self.inner.read_at_uninit(buf, offset))
    }
    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (_, b) in reqs.iter() {
            self.counters().read(b.len());
        }
        self.track(|| self.inner.read_many(reqs))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.counters().write(buf.len());
        self.track(|| self.inner.write_at(buf, offset))
    }
    fn will_need(&self, offset: u64, len: u64) {
        self.inner.will_need(offset, len);
    }
    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        for (_, b) in reqs {
            self.counters().write(b.len());
        }
        self.track(|| self.inner.write_many(reqs))
    }
    fn flush(&self) -> io::Result<()> {
        self.counters().flushes.fetch_add(1, Relaxed);
        self.track(|| self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.track(|| self.inner.discard(offset, len))
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn dax(&self) -> Option<&super::dax::DaxDevice> {
        self.inner.dax()
    }
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.counters().read(buf.len());
        self.inner.read_fresh(buf, offset)
    }
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.counters().write(buf.len());
        self.inner.write_through(buf, offset)
    }
}

/// A delay per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Latency {
    Fixed(Duration),
    /// Uniformly between the two bounds.
    Random(Duration, Duration),
}

impl Latency {
    pub const NONE: Latency = Latency::Fixed(Duration::ZERO);

    fn pick(&self, seed: u64) -> Duration {
        match *self {
            Latency::Fixed(d) => d,
            Latency::Random(lo, hi) if hi > lo => {
                // splitmix64 of the request number: no shared generator state.
                let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let span = (hi - lo).as_nanos() as u64;
                lo + Duration::from_nanos(z % (span + 1))
            }
            Latency::Random(lo, _) => lo,
        }
    }
}

/// A device that delays every request and serves at most `queue_depth` at a time.
pub struct LatencyDevice {
    inner: Arc<dyn BlockDevice>,
    read: Latency,
    write: Latency,
    flush: Latency,
    depth: usize,
    /// Requests being served.
    busy: Mutex<usize>,
    freed: Condvar,
    counts: Counters,
    /// Most requests served at once (what `queue_depth` allowed in practice).
    peak: AtomicU64,
    /// The longest a request of a thread not marked background waited for a slot
    /// (ns).
    fg_wait: AtomicU64,
}

impl LatencyDevice {
    /// Reads delayed by `read`; writes and flushes by nothing (see [`Self::writes`]);
    /// `queue_depth` requests at a time (at least 1).
    pub fn new(inner: Arc<dyn BlockDevice>, read: Latency, queue_depth: usize) -> Self {
        LatencyDevice {
            inner,
            read,
            write: Latency::NONE,
            flush: Latency::NONE,
            depth: queue_depth.max(1),
            busy: Mutex::new(0),
            freed: Condvar::new(),
            counts: Counters::default(),
            peak: AtomicU64::new(0),
            fg_wait: AtomicU64::new(0),
        }
    }

    /// Delay writes by `write` and flushes by `flush` too.
    pub fn writes(mut self, write: Latency, flush: Latency) -> Self {
        self.write = write;
        self.flush = flush;
        self
    }

    pub fn counts(&self) -> IoCounts {
        self.counts.get()
    }

    /// The longest a foreground request (of a thread not marked background) waited
    /// for the device to take it: how far background work delayed it.
    pub fn max_foreground_wait(&self) -> Duration {
        Duration::from_nanos(self.fg_wait.load(Relaxed))
    }

    /// The most requests that were ever served at once.
    pub fn peak_in_flight(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    /// Serve one request: wait for a slot, wait the latency, do it.
    fn serve<R>(&self, lat: Latency, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
        let asked = std::time::Instant::now();
        let n = {
            let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
            while *busy >= self.depth {
                busy = self.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
            }
            *busy += 1;
            *busy as u64
        };
        self.peak.fetch_max(n, Relaxed);
        if !BACKGROUND.with(|b| b.get()) {
            self.fg_wait
                .fetch_max(asked.elapsed().as_nanos() as u64, Relaxed);
        }
        struct Slot<'a>(&'a LatencyDevice);
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                *self.0.busy.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
                self.0.freed.notify_one();
            }
        }
        let _slot = Slot(self);
        let c = self.counts.get();
        let d = lat.pick(c.reads + c.writes + c.flushes);
        if !d.is_zero() {
            std::thread::sleep(d);
        }
        f()
    }
}

impl BlockDevice for LatencyDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.counts.read(buf.len());
        self.serve(self.read, || self.inner.read_at(buf, offset))
    }
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        self.counts.read(buf.len());
        self.serve(self.read, || self.inner.read_at_uninit(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.counts.write(buf.len());
        self.serve(self.write, || self.inner.write_at(buf, offset))
    }
    fn flush(&self) -> io::Result<()> {
        self.counts.flushes.fetch_add(1, Relaxed);
        self.serve(self.flush, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.serve(self.write, || self.inner.discard(offset, len))
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.counts.read(buf.len());
        self.serve(self.read, || self.inner.read_fresh(buf, offset))
    }
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.counts.write(buf.len());
        self.serve(self.write, || self.inner.write_through(buf, offset))
    }
}

/// Read every request of `reqs`, up to [`MAX_IN_FLIGHT`] at a time (the default of
/// [`BlockDevice::read_many`]): one thread per request in flight, each taking the next
/// request left; the first error is returned after all have finished.
pub(crate) fn read_parallel(
    dev: &(impl BlockDevice + ?Sized),
    reqs: &mut [(u64, &mut [u8])],
) -> io::Result<()> {
    if reqs.len() <= 1 {
        for (off, b) in reqs.iter_mut() {
            dev.read_at(b, *off)?;
        }
        return Ok(());
    }
    let workers = reqs.len().min(MAX_IN_FLIGHT);
    let queue = Mutex::new(reqs.iter_mut());
    let first_err: Mutex<Option<io::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some((off, b)) = next else { break };
                if let Err(e) = dev.read_at(b, *off) {
                    first_err
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            });
        }
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;
    use std::time::Instant;

    fn mem(n: usize) -> Arc<dyn BlockDevice> {
        Arc::new(MemDevice::new((0..n).map(|i| (i / 4096) as u8).collect()))
    }

    #[test]
    fn latency_device_delays_counts_and_keeps_to_its_queue_depth() {
        let d = LatencyDevice::new(mem(1 << 20), Latency::Fixed(Duration::from_millis(20)), 4);
        let mut b = vec![0u8; 4096];
        let t = Instant::now();
        d.read_at(&mut b, 3 * 4096).expect("read");
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert_eq!(b[0], 3);
        // 8 reads in a batch, 4 at a time: two rounds of the latency, not eight.
        let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 4096]).collect();
        let mut reqs: Vec<(u64, &mut [u8])> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| (i as u64 * 4096, b.as_mut_slice()))
            .collect();
        let t = Instant::now();
        d.read_many(&mut reqs).expect("batch");
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(40), "{took:?}");
        assert!(
            took < Duration::from_millis(8 * 20),
            "{took:?}: not parallel"
        );
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8), "request {i} misread");
        }
        assert_eq!(d.peak_in_flight(), 4);
        let c = d.counts();
        assert_eq!((c.reads, c.read_bytes), (9, 9 * 4096));
        d.write_at(&[1; 512], 0).expect("write");
        d.flush().expect("flush");
        let c2 = d.counts().since(&c);
        assert_eq!(
            (c2.reads, c2.writes, c2.write_bytes, c2.flushes),
            (0, 1, 512, 1)
        );
    }

    /// While watched, a foreground request in flight makes the device busy; a
    /// background thread's request does not; unwatched, nothing is tracked.
    #[test]
    fn counted_tracks_foreground_requests_only_while_watched() {
        let slow = Arc::new(LatencyDevice::new(
            mem(1 << 20),
            Latency::Fixed(Duration::from_millis(200)),
            4,
        ));
        let c = Arc::new(Counted::new(slow.clone()));
        let read_in_thread = |background: bool| {
            let c = c.clone();
            let before = slow.counts().reads;
            let t = std::thread::spawn(move || {
                if background {
                    mark_background();
                }
                let mut b = vec![0u8; 4096];
                c.read_at(&mut b, 0).expect("read");
            });
            while slow.counts().reads == before {
                std::thread::yield_now();
            }
            t
        };
        c.watch_foreground(true);
        let t = read_in_thread(false);
        assert_eq!(c.foreground_idle(), Duration::ZERO, "a request in flight");
        t.join().expect("reader");
        let t = read_in_thread(true);
        assert!(c.foreground_idle() > Duration::ZERO, "background counted");
        t.join().expect("reader");
        c.watch_foreground(false);
        let t = read_in_thread(false);
        assert!(c.foreground_idle() > Duration::ZERO, "tracked unwatched");
        t.join().expect("reader");
        assert_eq!(c.counts().reads, 2);
        assert_eq!(c.background_counts().reads, 1);
    }

    #[test]
    fn random_latency_stays_in_its_bounds() {
        let l = Latency::Random(Duration::from_millis(1), Duration::from_millis(3));
        let picks: Vec<Duration> = (0..200).map(|i| l.pick(i)).collect();
        assert!(picks
            .iter()
            .all(|&d| d >= Duration::from_millis(1) && d <= Duration::from_millis(3)));
        assert!(picks.iter().any(|&d| d != picks[0]), "not random");
    }

    #[test]
    fn counted_device_counts_batches_and_passes_errors() {
        let c = Counted::new(mem(64 << 10));
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 8192];
        let mut reqs: Vec<(u64, &mut [u8])> = vec![(0, &mut a), (4096, &mut b)];
        c.read_many(&mut reqs).expect("batch");
        assert_eq!(b[4096], 2);
        let mut far = vec![0u8; 4096];
        let mut reqs: Vec<(u64, &mut [u8])> = vec![(0, &mut a), (1 << 30, &mut far)];
        assert!(
            c.read_many(&mut reqs).is_err(),
            "a read past the end must fail"
        );
        let n = c.counts();
        assert_eq!((n.reads, n.read_bytes), (4, 4096 + 8192 + 4096 + 4096));
    }
}
