//! Shared helpers for the engine's integration tests: what rext4 sees, in the testkit's
//! `Tree` form, so it can be compared with what the kernel sees.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};

use rext4::{FileType, Fs, Ino};
use rext4_testkit::{ContentHasher, Kind, Node, Tree};

fn kind(t: FileType) -> Kind {
    match t {
        FileType::File => Kind::File,
        FileType::Dir => Kind::Dir,
        FileType::Symlink => Kind::Symlink,
        FileType::CharDevice => Kind::CharDev,
        FileType::BlockDevice => Kind::BlockDev,
        FileType::Fifo => Kind::Fifo,
        FileType::Socket => Kind::Socket,
        FileType::Unknown => Kind::File,
    }
}

/// Read at most `limit` bytes of each file (bounds the fuzz walks); `u64::MAX` for all.
pub fn node(fs: &Fs, ino: Ino, limit: u64) -> rext4::Result<Node> {
    let m = fs.stat_ino(ino)?;
    let symlink = if m.is_symlink() {
        Some(fs.read_link_ino(ino)?)
    } else {
        None
    };
    let content = if m.is_file() {
        let f = fs.open_ino(ino)?;
        let mut h = ContentHasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < m.size.min(limit) {
            let n = f.read_at(&mut buf, off)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            off += n as u64;
        }
        Some(h.finish())
    } else {
        None
    };
    let xattrs: BTreeMap<Vec<u8>, Vec<u8>> = fs.xattrs_ino(ino)?.into_iter().collect();
    Ok(Node {
        kind: kind(m.file_type),
        mode: m.mode,
        uid: m.uid,
        gid: m.gid,
        size: m.size,
        nlink: u64::from(m.nlink),
        atime: (m.atime.sec, m.atime.nsec),
        mtime: (m.mtime.sec, m.mtime.nsec),
        ctime: (m.ctime.sec, m.ctime.nsec),
        rdev: m.rdev,
        symlink,
        xattrs,
        content,
        ino: u64::from(ino.0),
    })
}

/// The whole tree as rext4 reads it. Stops at the first error.
pub fn snapshot(fs: &Fs) -> rext4::Result<Tree> {
    snapshot_limited(fs, u64::MAX)
}

pub fn snapshot_limited(fs: &Fs, limit: u64) -> rext4::Result<Tree> {
    let mut t = Tree::new();
    let mut seen = HashSet::new();
    let mut stack = vec![(Vec::new(), Ino::ROOT)];
    while let Some((path, ino)) = stack.pop() {
        let n = node(fs, ino, limit)?;
        if n.kind == Kind::Dir && seen.insert(ino) {
            for e in fs.read_dir_ino(ino)? {
                let mut p = path.clone();
                if !p.is_empty() {
                    p.push(b'/');
                }
                p.extend_from_slice(&e.name);
                stack.push((p, e.ino));
            }
        }
        t.insert(path, n);
    }
    Ok(t)
}

/// A device over a shared base image with a few bytes patched: cheap per-case
/// corruption of one image without copying it.
pub struct OverlayDevice {
    pub base: std::sync::Arc<Vec<u8>>,
    pub patches: Vec<(u64, u8)>,
}

impl rext4::device::BlockDevice for OverlayDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.base.len() as u64)
            .ok_or_else(|| std::io::Error::other("read outside the image"))?;
        buf.copy_from_slice(&self.base[offset as usize..end as usize]);
        for &(at, b) in &self.patches {
            if at >= offset && at < end {
                buf[(at - offset) as usize] = b;
            }
        }
        Ok(())
    }
    fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
        Err(std::io::Error::other("overlay is read-only"))
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.base.len() as u64
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

/// Open an overlay of `base` with `patches` applied.
pub fn open_patched(base: &std::sync::Arc<Vec<u8>>, patches: Vec<(u64, u8)>) -> rext4::Result<Fs> {
    let dev = OverlayDevice {
        base: base.clone(),
        patches,
    };
    Fs::open_device(std::sync::Arc::new(dev), rext4::FsOptions::default())
}

/// Everything a reader can see: open, walk the tree, audit every metadata block.
/// Returns the tree if nothing was reported, else the first error.
pub fn full_read(fs: &Fs, limit: u64) -> rext4::Result<Tree> {
    let t = snapshot_limited(fs, limit)?;
    let audit = fs.audit()?;
    if let Some(e) = audit.problems.into_iter().next() {
        return Err(e);
    }
    Ok(t)
}

/// The testkit's deterministic PRNG (xorshift64*): failures reproduce by seed.
#[allow(unused_imports)]
pub use rext4_testkit::crash::Rng;

/// A device that records every write and flush (for crash images) over a memory image.
///
/// A run that keeps writing without end (an engine loop that never finishes) would
/// fill the machine's memory with its log; past [`RECORD_CAP`] bytes of writes (or
/// `REXT4_RECORD_CAP_MB`) the recorder prints what the run was writing and aborts
/// the test process instead of waiting for the OOM killer to take it silently.
pub struct Recorder {
    pub mem: rext4::device::MemDevice,
    pub events: std::sync::Mutex<Vec<rext4_testkit::crash::Event>>,
    bytes: std::sync::atomic::AtomicU64,
    cap: u64,
}

/// The most bytes of writes a recorded run may log (no workload here comes near it).
pub const RECORD_CAP: u64 = 2 << 30;

impl Recorder {
    pub fn new(base: Vec<u8>) -> Self {
        let cap = std::env::var("REXT4_RECORD_CAP_MB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(RECORD_CAP, |mb| mb << 20);
        Recorder {
            mem: rext4::device::MemDevice::new(base),
            events: std::sync::Mutex::new(Vec::new()),
            bytes: std::sync::atomic::AtomicU64::new(0),
            cap,
        }
    }
    /// Number of events so far (a position in the log).
    pub fn len(&self) -> usize {
        self.events.lock().expect("events").len()
    }
    pub fn take(&self) -> Vec<rext4_testkit::crash::Event> {
        std::mem::take(&mut *self.events.lock().expect("events"))
    }

    /// The log has outgrown the cap: say what the run was doing and stop the process.
    /// (Written to the process's standard error directly, past the test harness's
    /// capture, which an abort would discard; a panic here could leave the other
    /// threads of the workload waiting on this one for ever.)
    fn runaway(&self, events: &[rext4_testkit::crash::Event]) -> ! {
        use rext4_testkit::crash::Event;
        use std::io::Write;
        let flushes = events.iter().filter(|e| matches!(e, Event::Flush)).count();
        let mut by_block: std::collections::BTreeMap<u64, usize> = Default::default();
        let tail = events.len().saturating_sub(100_000);
        for e in &events[tail..] {
            if let Event::Write { offset, .. } = e {
                *by_block.entry(offset >> 10).or_default() += 1;
            }
        }
        let mut hot: Vec<(u64, usize)> = by_block.into_iter().collect();
        hot.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        hot.truncate(16);
        let mut msg = format!(
            "\nrecording device: the run wrote more than {} MiB ({} events, {flushes} \
             flushes) — an engine loop that does not end?\nmost written KiB offsets in \
             the last {} events (KiB, writes): {hot:?}\nlast events:\n",
            self.cap >> 20,
            events.len(),
            events.len() - tail,
        );
        for e in &events[events.len().saturating_sub(40)..] {
            msg.push_str(&match e {
                Event::Write { offset, data } => format!("  write {offset} +{}\n", data.len()),
                Event::Flush => "  flush\n".to_string(),
            });
        }
        msg.push_str(&format!("{}\n", std::backtrace::Backtrace::force_capture()));
        let _ = std::io::stderr().write_all(msg.as_bytes());
        std::process::abort()
    }
}

impl rext4::device::BlockDevice for Recorder {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.mem.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.mem.write_at(buf, offset)?;
        let mut events = self.events.lock().expect("events");
        events.push(rext4_testkit::crash::Event::Write {
            offset,
            data: buf.to_vec(),
        });
        let total = self
            .bytes
            .fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if total + buf.len() as u64 > self.cap {
            self.runaway(&events);
        }
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        self.events
            .lock()
            .expect("events")
            .push(rext4_testkit::crash::Event::Flush);
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.mem.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        false
    }
}

/// Open an image file read-write (no periodic commit thread, for determinism).
pub fn open_rw(path: &std::path::Path) -> Fs {
    let opts = rext4::FsOptions {
        read_only: false,
        commit_secs: 0,
        ..rext4::FsOptions::default()
    };
    Fs::open_with(path, opts).expect("open rw")
}

/// A fresh mke2fs image of `size` bytes with blocks of `bs`, as bytes.
pub fn base_image(bs: u32, size: u64) -> Vec<u8> {
    let img = rext4_testkit::mkfs(&rext4_testkit::MkfsOptions::new(bs, size)).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

/// Open a device read-write (no periodic commit thread, for determinism).
pub fn open_device_rw(dev: std::sync::Arc<dyn rext4::device::BlockDevice>) -> Fs {
    let opts = rext4::FsOptions {
        read_only: false,
        commit_secs: 0,
        ..rext4::FsOptions::default()
    };
    Fs::open_device(dev, opts).expect("open rw")
}

/// The physical blocks of `path` (a directory's or a file's), in logical order.
pub fn blocks_of(fs: &Fs, path: &str) -> Vec<u64> {
    let ino = fs.metadata(path).expect("metadata").ino;
    let (_, runs) = fs.fiemap_ino(ino, u64::MAX >> 20).expect("fiemap");
    let mut v = Vec::new();
    for (_, m) in runs {
        if let rext4::Mapping::Mapped { physical, len, .. } = m {
            v.extend(physical..physical + len);
        }
    }
    v
}

/// Recover a crash image at `path` the way `how` names: "rext4" (open read-write and
/// close), "e2fsck" (-fy) or "kernel" (loop mount and unmount).
pub fn recover(path: &std::path::Path, how: &str) -> Result<(), String> {
    match how {
        "rext4" => open_rw(path).close().map_err(|e| format!("close: {e}")),
        "e2fsck" => {
            let r = rext4_testkit::e2fsck_fy(path);
            if r.exit_code > 1 {
                return Err(format!("e2fsck -fy exit {}:\n{}", r.exit_code, r.output));
            }
            Ok(())
        }
        "kernel" => rext4_testkit::LoopMount::new(path, false, "")?.unmount(),
        _ => unreachable!(),
    }
}

/// What a test's device does besides passing requests to the device it wraps
/// ([`Hooked`]): each hook runs before the request, and an error it returns fails the
/// request instead. By default a hook does nothing.
pub trait Hooks: Send + Sync {
    fn read(&self, _len: usize, _off: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn write(&self, _buf: &[u8], _off: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    /// A read-ahead hint (`BlockDevice::will_need`).
    fn will_need(&self, _off: u64, _len: u64) {}
}

/// A device (`inner`, memory unless said otherwise) with a test's [`Hooks`] around
/// its requests; the hooks' own fields are reached through it (`Deref`).
pub struct Hooked<H, D = rext4::device::MemDevice> {
    pub inner: D,
    pub hooks: H,
}

impl<H> Hooked<H> {
    /// `hooks` around a memory device holding `image`.
    pub fn mem(image: Vec<u8>, hooks: H) -> Self {
        Hooked {
            inner: rext4::device::MemDevice::new(image),
            hooks,
        }
    }
    /// What the memory device holds now.
    pub fn snapshot(&self) -> Vec<u8> {
        self.inner.snapshot()
    }
}

impl<H, D> std::ops::Deref for Hooked<H, D> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.hooks
    }
}

impl<H: Hooks, D: rext4::device::BlockDevice> rext4::device::BlockDevice for Hooked<H, D> {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.hooks.read(buf.len(), off)?;
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.hooks.write(buf, off)?;
        self.inner.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.hooks.flush()?;
        self.inner.flush()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn will_need(&self, off: u64, len: u64) {
        self.hooks.will_need(off, len);
        self.inner.will_need(off, len)
    }
}

/// A valid image to mutate (`fuzz.rs`, `fuzz_write.rs`): made with `opts` and
/// populated (the testkit's fixture, smaller), with its block size and the byte range
/// `(start, len)` of every metadata block the audit names (the superblock's 1024
/// bytes for the superblock).
pub fn fuzz_base(
    opts: &rext4_testkit::MkfsOptions,
) -> (std::sync::Arc<Vec<u8>>, u64, Vec<(u64, u64)>) {
    fuzz_base_with(opts, |_| {})
}

/// [`fuzz_base`], with `extra` changing the populated image before it is read.
pub fn fuzz_base_with(
    opts: &rext4_testkit::MkfsOptions,
    extra: impl FnOnce(&std::path::Path),
) -> (std::sync::Arc<Vec<u8>>, u64, Vec<(u64, u64)>) {
    let img = rext4_testkit::mkfs(opts).expect("mkfs");
    let spec = rext4_testkit::Fixture {
        big_dir_entries: 300,
        frag_extents: 120,
        sparse_far_offset: 2 << 20,
        deep_depth: 6,
        ..rext4_testkit::Fixture::quick()
    };
    rext4_testkit::populate_debugfs(img.path(), &spec).expect("populate");
    extra(img.path());
    let base = std::sync::Arc::new(std::fs::read(img.path()).expect("read"));
    let fs = open_patched(&base, vec![]).expect("opens");
    let bs = u64::from(fs.block_size());
    let audit = fs.audit().expect("audit");
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    let mut ranges: Vec<(u64, u64)> = audit
        .blocks
        .iter()
        .map(|&(blk, kind)| match kind {
            rext4::MetaKind::Superblock => (1024, 1024),
            _ => (blk * bs, bs),
        })
        .collect();
    ranges.sort();
    ranges.dedup();
    (base, bs, ranges)
}

/// One to `most` byte mutations of `base` inside `ranges` (`(start, len)`, as
/// `fuzz_base` gives them): bit flips, small values and extremes, which reach
/// different checks.
pub fn mutations(rng: &mut Rng, base: &[u8], ranges: &[(u64, u64)], most: u64) -> Vec<(u64, u8)> {
    (0..1 + rng.below(most))
        .map(|_| {
            let (start, len) = ranges[rng.below(ranges.len() as u64) as usize];
            let at = start + rng.below(len);
            let v = match rng.below(4) {
                0 => base[at as usize] ^ (1 << rng.below(8)),
                1 => rng.below(4) as u8,
                2 => 0xFF,
                _ => rng.next_u64() as u8,
            };
            (at, v)
        })
        .collect()
}

/// A number from the environment variable `name` (a test's knob), or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
