//! Stress test of `rext4 mount`: several processes at once run random file operations on
//! one FUSE mount (default options, so the kernel's writeback cache is on), every read
//! checked against an exact model; afterwards the image is checked offline.
//!
//! What it checks:
//! - Private files. Each worker owns a directory `wN/` and knows the exact bytes of each of
//!   its files. It creates (O_CREAT|O_EXCL, and O_EXCL on an existing name must fail with
//!   EEXIST), pwrites 1 byte .. 1 MiB (unaligned, past EOF leaving holes), reads ranges
//!   (also past EOF) and whole files (through its descriptor or a fresh open), ftruncates
//!   (shrink, grow, O_TRUNC), renames (also over another of its files, whose open
//!   descriptor then holds an unlinked file), unlinks (also while open, then keeps reading
//!   and writing through the descriptor), reads and writes through MAP_SHARED mappings
//!   (msync(MS_SYNC) sometimes; writes are verified through pread), fsyncs, fdatasyncs,
//!   fallocates (mode 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE), punches every
//!   other block of a range (many extents) and drops the file's cached pages
//!   (POSIX_FADV_DONTNEED) so that reads go to the server.
//! - One striped file written by all workers at once: 64 KiB chunk `c` belongs to worker
//!   `c % workers`, which pwrites, preads, maps, punches and syncs only its own chunks
//!   and checks them (the file may grow under it by the others' writes).
//! - A shared directory `shared/`. All workers publish files there (write a temp file, in
//!   `shared/` or in their own directory, then rename it in, plain or RENAME_NOREPLACE),
//!   link, rename and unlink them. A published file is never changed and every 4 KiB block
//!   of it names the file (id, generation, length), so whatever a reader opens must be
//!   whole and consistent. The races make ENOENT and EEXIST expected there; any other
//!   error fails.
//! - Afterwards: every worker writes its model outside the mount and exits 0; the test
//!   checks every modelled file (names and bytes), the striped file and the shared
//!   directory once more through the mount, unmounts (the server must exit 0), requires
//!   `e2fsck -fn` to be clean (its extent-tree repack notices aside, which the kernel's
//!   ext4 gets on this workload too: `FsckReport::clean_but_repack_hints`), and checks
//!   the same through the kernel's ext4 (a read-only loop mount).
//!
//! Workers are processes, not threads: the test re-executes its own binary
//! (`--exact stress_worker`) with environment variables giving the worker's id, seed,
//! directories, deadline and output directory; without them `stress_worker` does nothing.
//! Each worker logs one line per operation to its log; a failure names the worker, seed,
//! operation number, file and the offset of the first differing byte (with the writer and
//! operation decoded from the bytes found), and shows the log's tail and the mount log. A
//! worker that hangs is killed (its kernel stack printed) and fails the test.
//!
//! Knobs, read in one place (`Config::from_env`) and printed at the start:
//! `REXT4_STRESS_SECS` (length of the random phase, default 25 s; the checks afterwards
//! take a few seconds more), `REXT4_STRESS_SEED` (default from the clock; printed, set it
//! to replay: a worker's private operations depend only on its seed, not on timing, so
//! the failing operation comes back at the same number), `REXT4_STRESS_WORKERS` (default
//! 4), `REXT4_STRESS_MOUNT_OPTS` (`-o` options for `rext4 mount`, e.g.
//! `nowriteback_cache`), `REXT4_STRESS_KEEP=1` (keep the image, path printed) and
//! `REXT4_STRESS_TARGET=kernel` (run the same workload on a kernel ext4 loop mount
//! instead: a check of the test and its model).
//! Long form: `REXT4_STRESS_SECS=300 cargo test -p rext4-cli --test stress -- --nocapture`.
//! Skips (printing why) without root or /dev/fuse.

mod fuse_mount;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuse_mount::{renameat2, wait_child, Mounted, Watchdog};
use rext4_testkit::crash::Rng;
use rext4_testkit::{can_loop_mount, e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions, TempDir};

// ---------------------------------------------------------------------------------
// Configuration: duration, seed, worker count (the one place that reads the knobs).

/// Length of the random phase by default (the checks afterwards take a few seconds).
const DEFAULT_SECS: u64 = 25;
const DEFAULT_WORKERS: u64 = 4;
/// Time a worker gets after the random phase to finish its operation, check its files
/// and write its model; past it, it counts as hung.
const GRACE: Duration = Duration::from_secs(90);
/// A worker that finishes no operation for this long counts as hung.
const STALL: Duration = Duration::from_secs(60);

/// The worker "test" that `stress_worker` re-executions run.
const WORKER_TEST: &str = "stress_worker";
const ENV_ID: &str = "REXT4_STRESS_WORKER_ID";
const ENV_SEED: &str = "REXT4_STRESS_WORKER_SEED";
const ENV_DIR: &str = "REXT4_STRESS_WORKER_DIR";
const ENV_SHARED: &str = "REXT4_STRESS_WORKER_SHARED";
const ENV_DEADLINE: &str = "REXT4_STRESS_WORKER_DEADLINE_MS";
const ENV_OUT: &str = "REXT4_STRESS_WORKER_OUT";
const ENV_STRIPED: &str = "REXT4_STRESS_WORKER_STRIPED";
const ENV_COUNT: &str = "REXT4_STRESS_WORKER_COUNT";

/// No private file grows past this (writes, truncates, fallocates stay below it).
const MAX_FILE: u64 = 8 << 20;
/// Private files (named or unlinked-but-open) per worker: with `MAX_FILE`, bounds the
/// space a worker can use, so the image never fills up.
const MAX_OBJS: usize = 8;
/// Unlinked-but-open files a worker makes on purpose.
const MAX_ORPHANS: usize = 3;
/// Private names `f0..`: few, so that renames often land on an existing file.
const NAMES: u64 = 12;
/// Shared names `s0..`.
const SHARED_NAMES: u64 = 24;
/// Longest single read, write or mapping.
const MAX_IO: u64 = 1 << 20;
/// The striped file: chunk `c` belongs to worker `c % workers`.
const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 256;
const STRIPED_SIZE: u64 = CHUNK * CHUNKS;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// `rext4 mount` (the test).
    Rext4,
    /// The kernel's ext4 on a loop device (a check of the test and its model).
    Kernel,
}

struct Config {
    secs: u64,
    seed: u64,
    workers: usize,
    target: Target,
    /// `-o` options for `rext4 mount` (empty: the defaults).
    mount_opts: String,
    /// Keep the image after the test.
    keep: bool,
}

impl Config {
    fn from_env() -> Config {
        let secs = env_u64("REXT4_STRESS_SECS").unwrap_or(DEFAULT_SECS);
        let seed = env_u64("REXT4_STRESS_SEED").unwrap_or_else(|| {
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            mix(t ^ u64::from(std::process::id()))
        });
        let workers = env_u64("REXT4_STRESS_WORKERS")
            .unwrap_or(DEFAULT_WORKERS)
            .clamp(1, 64) as usize;
        let target = match std::env::var("REXT4_STRESS_TARGET").as_deref() {
            Err(_) | Ok("") | Ok("rext4") => Target::Rext4,
            Ok("kernel") => Target::Kernel,
            Ok(other) => panic!("REXT4_STRESS_TARGET={other}: want rext4 or kernel"),
        };
        Config {
            secs,
            seed,
            workers,
            target,
            mount_opts: std::env::var("REXT4_STRESS_MOUNT_OPTS").unwrap_or_default(),
            keep: std::env::var_os("REXT4_STRESS_KEEP").is_some(),
        }
    }

    /// Worker `id`'s seed, derived from the run's seed.
    fn worker_seed(&self, id: usize) -> u64 {
        mix(self.seed ^ mix(id as u64 + 1)) | 1
    }

    fn print(&self) {
        eprintln!(
            "stress: {} workers for {} s on {:?} (-o {:?}), seed {:#018x} \
             (replay: REXT4_STRESS_SEED={:#x}; long form: REXT4_STRESS_SECS=300)",
            self.workers, self.secs, self.target, self.mount_opts, self.seed, self.seed
        );
        for id in 0..self.workers {
            eprintln!("stress:   worker {id} seed {:#018x}", self.worker_seed(id));
        }
    }
}

/// A decimal or 0x-hex number from the environment.
fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    let n = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(n.unwrap_or_else(|e| panic!("{name}={v}: {e}")))
}

/// splitmix64's finaliser: seeds from seeds.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

// ---------------------------------------------------------------------------------
// Data: what the workers write, and how a mismatch is told.

/// The bytes worker `w`'s operation `op` writes at file offset `off`: 16-byte records
/// aligned to the file offset, each naming its writer, operation and offset, so that a
/// failure can say where stale or misplaced bytes came from (`decode`).
fn pattern(w: usize, op: u64, off: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut a = off & !15;
    while v.len() < len {
        let rec = record(w, op, a);
        let from = off.saturating_sub(a) as usize;
        let take = (16 - from).min(len - v.len());
        v.extend_from_slice(&rec[from..from + take]);
        a += 16;
    }
    v
}

fn record(w: usize, op: u64, a: u64) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[0] = 0xA5;
    r[1] = w as u8;
    r[2..6].copy_from_slice(&(op as u32).to_le_bytes());
    r[6..13].copy_from_slice(&a.to_le_bytes()[..7]);
    r[13] = 0x5A;
    r[14] = 0xC3;
    r[15] = r[..15].iter().fold(0u8, |x, b| x.wrapping_add(*b));
    r
}

/// " (record by worker W op N for offset A)" when the 16-byte record holding offset
/// `base + i` of `buf` is a whole `record`.
fn decode(buf: &[u8], base: u64, i: usize) -> String {
    let abs = base + i as u64;
    let start = abs & !15;
    if start < base || (start - base) as usize + 16 > buf.len() {
        return String::new();
    }
    let s = (start - base) as usize;
    let r = &buf[s..s + 16];
    let sum = r[..15].iter().fold(0u8, |x, b| x.wrapping_add(*b));
    if r[0] != 0xA5 || r[13] != 0x5A || r[14] != 0xC3 || r[15] != sum {
        return if r.iter().all(|&b| b == 0) {
            " (a zero record)".into()
        } else {
            " (not a pattern record)".into()
        };
    }
    let mut a = [0u8; 8];
    a[..7].copy_from_slice(&r[6..13]);
    let op = u32::from_le_bytes([r[2], r[3], r[4], r[5]]);
    format!(
        " (record by worker {} op {op} (mod 2^32) for offset {})",
        r[1],
        u64::from_le_bytes(a)
    )
}

fn hex(buf: &[u8], from: usize, n: usize) -> String {
    let from = from.min(buf.len());
    let to = (from + n).min(buf.len());
    buf[from..to]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `None` when `got == want`, else what differs: lengths, the offset of the first
/// differing byte (the bytes read at `base` on), both bytes, the extent of the damage
/// and where the bytes found came from.
fn mismatch(got: &[u8], want: &[u8], base: u64) -> Option<String> {
    if got == want {
        return None;
    }
    let mut s = String::new();
    if got.len() != want.len() {
        let _ = write!(
            s,
            "read {} bytes from offset {base}, expected {}; ",
            got.len(),
            want.len()
        );
    }
    let n = got.len().min(want.len());
    match (0..n).find(|&i| got[i] != want[i]) {
        None => {
            let _ = write!(s, "the common {n} bytes agree");
        }
        Some(i) => {
            let last = (i..n).rev().find(|&j| got[j] != want[j]).unwrap_or(i);
            let bad = (i..=last).filter(|&j| got[j] != want[j]).count();
            let _ = write!(
                s,
                "first differing byte at offset {} (got {:#04x}, expected {:#04x}); \
                 {bad} bytes differ in {}..={}",
                base + i as u64,
                got[i],
                want[i],
                base + i as u64,
                base + last as u64
            );
            if got[i..=last].iter().all(|&b| b == 0) {
                s.push_str(" (zeros were read there)");
            }
            let at = i & !15;
            let _ = write!(
                s,
                "\n    got  @{}: {}{}\n    want @{}: {}{}",
                base + at as u64,
                hex(got, at, 32),
                decode(got, base, i),
                base + at as u64,
                hex(want, at, 32),
                decode(want, base, i)
            );
        }
    }
    Some(s)
}

/// `model[off..off+len]` clipped to its length (a read past EOF is short).
fn model_slice(model: &[u8], off: u64, len: u64) -> &[u8] {
    let end = off.saturating_add(len).min(model.len() as u64) as usize;
    let off = (off as usize).min(end);
    &model[off..end]
}

/// pread until `len` bytes or EOF.
fn read_full_at(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(done);
    Ok(buf)
}

/// Drops the file's clean cached pages (and starts writeback of dirty ones), so the
/// next reads ask the server.
fn drop_cache(f: &File) -> io::Result<()> {
    // SAFETY: posix_fadvise on an open descriptor; it only advises the page cache.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// A MAP_SHARED mapping of part of a file, unmapped on drop.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of `f` from `start` (a multiple of the page size).
    fn new(f: &File, start: u64, len: usize, write: bool) -> io::Result<Mapping> {
        let prot = libc::PROT_READ | if write { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping at an address the kernel picks (NULL hint), of an open
        // descriptor; it overlaps nothing Rust owns. The result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr, len })
    }

    /// Copies `n` bytes at `at` out of the mapping. The caller keeps `at + n` within the
    /// file's size (no SIGBUS): only the calling worker changes its files, and shared
    /// files never change.
    fn read(&self, at: usize, n: usize) -> Vec<u8> {
        assert!(
            at + n <= self.len,
            "read {at}+{n} past a {}-byte mapping",
            self.len
        );
        let mut v = vec![0u8; n];
        // SAFETY: [at, at+n) lies inside the live mapping (asserted) and within the file
        // (caller); `v` has n bytes and does not overlap the mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.cast::<u8>().add(at), v.as_mut_ptr(), n) };
        v
    }

    /// memcpy `data` into the mapping at `at` (within the file's size, as for `read`).
    fn write(&self, at: usize, data: &[u8]) {
        assert!(
            at + data.len() <= self.len,
            "write {at}+{} past a {}-byte mapping",
            data.len(),
            self.len
        );
        // SAFETY: [at, at+len) lies inside the live, writable mapping (asserted; mapped
        // with PROT_WRITE by the caller) and within the file; `data` is a separate buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.cast::<u8>().add(at), data.len())
        };
    }

    fn msync(&self) -> io::Result<()> {
        // SAFETY: the whole live mapping, page-aligned by mmap.
        if unsafe { libc::msync(self.ptr, self.len, libc::MS_SYNC) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this guard made; no reference into it
        // outlives the guard (reads and writes copy).
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

fn fallocate(f: &File, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open descriptor with in-range offsets.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

// ---------------------------------------------------------------------------------
// Shared files: self-describing, immutable once published.

const SHARED_MAGIC: &[u8; 4] = b"RXS1";
/// Header at the start of every 4 KiB block: magic, id, generation, block, length.
const SHARED_HDR: usize = 28;
const SHARED_BLOCK: usize = 4096;

/// The content of shared file `id`/`gen` of `len` bytes: each 4 KiB block starts with
/// the header and is filled with a non-zero byte derived from id, generation and block.
fn shared_content(id: u64, gen: u32, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (b, chunk) in v.chunks_mut(SHARED_BLOCK).enumerate() {
        let mut h = [0u8; SHARED_HDR];
        h[0..4].copy_from_slice(SHARED_MAGIC);
        h[4..12].copy_from_slice(&id.to_le_bytes());
        h[12..16].copy_from_slice(&gen.to_le_bytes());
        h[16..20].copy_from_slice(&(b as u32).to_le_bytes());
        h[20..28].copy_from_slice(&(len as u64).to_le_bytes());
        let fill = (mix(id ^ (u64::from(gen) << 32) ^ b as u64) as u8) | 1;
        for (i, x) in chunk.iter_mut().enumerate() {
            *x = if i < SHARED_HDR { h[i] } else { fill };
        }
    }
    v
}

/// What a published file says it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SharedId {
    id: u64,
    gen: u32,
    len: u64,
}

/// Reads a whole shared file (through read() or a mapping, optionally after dropping
/// its cached pages) and checks that it is one whole published file.
fn check_shared(f: &File, via_mmap: bool, evict: bool) -> Result<SharedId, String> {
    let size = f.metadata().map_err(|e| format!("fstat: {e}"))?.len();
    if evict {
        drop_cache(f).map_err(|e| format!("fadvise DONTNEED: {e}"))?;
    }
    let got = if via_mmap && size > 0 {
        let m = Mapping::new(f, 0, size as usize, false).map_err(|e| format!("mmap: {e}"))?;
        m.read(0, size as usize)
    } else {
        let got = read_full_at(f, 0, size as usize + 4096).map_err(|e| format!("read: {e}"))?;
        if got.len() as u64 != size {
            return Err(format!("read {} bytes, fstat says {size}", got.len()));
        }
        got
    };
    if got.len() < SHARED_HDR || &got[..4] != SHARED_MAGIC {
        return Err(format!(
            "not a published file: {} bytes, starting {}",
            got.len(),
            hex(&got, 0, 32)
        ));
    }
    let word = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b[..r.len()].copy_from_slice(&got[r]);
        u64::from_le_bytes(b)
    };
    let sid = SharedId {
        id: word(4..12),
        gen: word(12..16) as u32,
        len: word(20..28),
    };
    if sid.len != size {
        return Err(format!(
            "header says {} bytes, fstat {size}: {sid:?}",
            sid.len
        ));
    }
    let want = shared_content(sid.id, sid.gen, sid.len as usize);
    match mismatch(&got, &want, 0) {
        Some(m) => Err(format!("{sid:?} inconsistent: {m}")),
        None => Ok(sid),
    }
}

// ---------------------------------------------------------------------------------
// The worker: random operations on its own files and the shared directory.

/// One of a worker's files.
struct Obj {
    /// Its name in the worker's directory; `None` once unlinked (still open).
    name: Option<String>,
    /// For messages: the name, and whether it is unlinked.
    label: String,
    /// Exactly the bytes the file holds.
    data: Vec<u8>,
    /// An open O_RDWR descriptor (always `Some` for an unlinked file).
    fd: Option<File>,
}

struct Worker {
    id: usize,
    seed: u64,
    dir: PathBuf,
    shared: PathBuf,
    out: PathBuf,
    deadline_ms: u64,
    /// Private operations: a function of the seed only.
    rng: Rng,
    /// Shared-directory operations (whose outcome depends on the other workers).
    srng: Rng,
    objs: Vec<Obj>,
    op: u64,
    desc: String,
    serial: u64,
    page: u64,
    stats: BTreeMap<&'static str, u64>,
    /// Most files and bytes held at once (for the summary).
    peak: (usize, usize),
    /// How many workers share the striped file.
    workers: u64,
    /// The striped file, open O_RDWR.
    striped: File,
    /// The striped file as this worker knows it: its own chunks exactly (others' chunks
    /// stay zero here), `STRIPED_SIZE` long.
    stripe: Vec<u8>,
    /// The end of this worker's furthest write to the striped file: the file is at
    /// least this long.
    stripe_end: u64,
}

impl Worker {
    fn from_env() -> Option<Worker> {
        let id: usize = std::env::var(ENV_ID).ok()?.parse().expect("worker id");
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
        let seed = env_u64(ENV_SEED).expect("worker seed");
        let deadline_ms = env_u64(ENV_DEADLINE).expect("worker deadline");
        let striped = OpenOptions::new()
            .read(true)
            .write(true)
            .open(var(ENV_STRIPED))
            .expect("open the striped file");
        Some(Worker {
            id,
            seed,
            dir: PathBuf::from(var(ENV_DIR)),
            shared: PathBuf::from(var(ENV_SHARED)),
            out: PathBuf::from(var(ENV_OUT)),
            deadline_ms,
            rng: Rng(seed),
            srng: Rng(mix(seed ^ 0x5348_4152_4544) | 1),
            objs: Vec::new(),
            op: 0,
            desc: String::new(),
            serial: 0,
            page: page_size(),
            stats: BTreeMap::new(),
            peak: (0, 0),
            workers: env_u64(ENV_COUNT).expect("worker count"),
            striped,
            stripe: vec![0; STRIPED_SIZE as usize],
            stripe_end: 0,
        })
    }

    fn run(mut self) {
        eprintln!(
            "worker {} seed {:#018x} dir {} until {}",
            self.id,
            self.seed,
            self.dir.display(),
            self.deadline_ms
        );
        while now_ms() < self.deadline_ms {
            self.op += 1;
            self.step();
            let bytes = self.objs.iter().map(|o| o.data.len()).sum();
            self.peak = (self.peak.0.max(self.objs.len()), self.peak.1.max(bytes));
        }
        self.finish();
    }

    /// Names the operation about to run (for the log and for failures).
    fn begin(&mut self, kind: &'static str, desc: String) {
        *self.stats.entry(kind).or_default() += 1;
        eprintln!("{} {desc}", self.op);
        self.desc = desc;
    }

    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!(
            "worker {} (seed {:#018x}) op {} [{}]: {what}",
            self.id, self.seed, self.op, self.desc
        )
    }

    fn check<T>(&self, r: io::Result<T>, what: &str) -> T {
        r.unwrap_or_else(|e| self.fail(format_args!("{what}: {e}")))
    }

    fn step(&mut self) {
        match self.rng.below(100) {
            0..=5 => self.op_create(),
            6..=24 => self.op_write(),
            25..=34 => self.op_read_range(),
            35..=40 => self.op_read_all(),
            41..=45 => self.op_truncate(),
            46..=50 => self.op_rename(),
            51..=53 => self.op_unlink(),
            54..=58 => self.op_mmap_read(),
            59..=64 => self.op_mmap_write(),
            65..=68 => self.op_sync(),
            69..=73 => self.op_fallocate(),
            74 => self.op_fragment(),
            75..=77 => self.op_close(),
            78..=80 => self.op_evict(),
            81..=88 => self.op_striped(),
            _ => self.op_shared(),
        }
    }

    // -- choosing --

    fn pick(&mut self, ok: impl Fn(&Obj) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.objs.len())
            .filter(|&i| ok(&self.objs[i]))
            .collect();
        if c.is_empty() {
            None
        } else {
            Some(c[self.rng.below(c.len() as u64) as usize])
        }
    }

    fn named(&self, name: &str) -> Option<usize> {
        self.objs
            .iter()
            .position(|o| o.name.as_deref() == Some(name))
    }

    /// A read or write length: 1 byte .. 1 MiB, often small, sometimes page multiples.
    fn io_len(&mut self) -> u64 {
        let r = &mut self.rng;
        match r.below(8) {
            0 => 1 + r.below(16),
            1 | 2 => 1 + r.below(4096),
            3 => 4096 * (1 + r.below(4)),
            4 => 4096 * (1 + r.below(64)),
            5 => 1 + r.below(MAX_IO),
            6 => MAX_IO - r.below(2) * r.below(4096),
            _ => 1 + r.below(64 << 10),
        }
    }

    /// An offset for `len` bytes in a file of `size`: inside, aligned, at EOF, or past
    /// EOF (leaving a hole); never past `MAX_FILE`.
    fn io_off(&mut self, size: u64, len: u64) -> u64 {
        let r = &mut self.rng;
        let off = match r.below(7) {
            0 => 0,
            1 | 2 => r.below(size + 1),
            3 => r.below(size / 4096 + 1) * 4096,
            4 => size,
            5 => size + 1 + r.below(2 << 20),
            _ => (size + r.below(64 << 10)) & !4095,
        };
        off.min(MAX_FILE - len)
    }

    /// Opens a named file's O_RDWR descriptor if it has none.
    fn ensure_open(&mut self, i: usize) {
        if self.objs[i].fd.is_some() {
            return;
        }
        let name = self.objs[i]
            .name
            .clone()
            .expect("a file without a descriptor has a name");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.dir.join(&name));
        let f = self.check(f, &format!("open {name} O_RDWR"));
        self.objs[i].fd = Some(f);
    }

    fn fd(&self, i: usize) -> &File {
        self.objs[i].fd.as_ref().expect("descriptor opened")
    }

    // -- checking --

    /// pread `len` bytes at `off` through the file's descriptor and compare.
    fn verify_range(&mut self, i: usize, off: u64, len: u64, how: &str) {
        self.ensure_open(i);
        let got = self.check(read_full_at(self.fd(i), off, len as usize), "pread");
        let o = &self.objs[i];
        if let Some(m) = mismatch(&got, model_slice(&o.data, off, len), off) {
            self.fail(format_args!("{} ({how}): {m}", o.label));
        }
    }

    fn verify_size(&self, f: &File, i: usize) {
        let md = self.check(f.metadata(), "fstat");
        let o = &self.objs[i];
        if md.len() != o.data.len() as u64 {
            self.fail(format_args!(
                "{}: fstat size {}, expected {}",
                o.label,
                md.len(),
                o.data.len()
            ));
        }
    }

    /// The whole file, through its descriptor or (`by_path`) a fresh read-only open.
    fn verify_all(&mut self, i: usize, by_path: bool) {
        let label = self.objs[i].label.clone();
        let got = match (by_path, self.objs[i].name.clone()) {
            (true, Some(name)) => {
                let mut f = self.check(File::open(self.dir.join(&name)), "open O_RDONLY");
                self.verify_size(&f, i);
                let mut got = Vec::new();
                self.check(f.read_to_end(&mut got), "read");
                got
            }
            _ => {
                self.ensure_open(i);
                self.verify_size(self.fd(i), i);
                let n = self.objs[i].data.len() + 1 + self.rng.below(8192) as usize;
                self.check(read_full_at(self.fd(i), 0, n), "pread")
            }
        };
        if let Some(m) = mismatch(&got, &self.objs[i].data, 0) {
            self.fail(format_args!("{label} (whole file): {m}"));
        }
    }

    fn expect_gone(&self, p: &Path) {
        match fs::symlink_metadata(p) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => self.fail(format_args!("stat {}: {e}", p.display())),
            Ok(_) => self.fail(format_args!("{} still exists", p.display())),
        }
    }

    // -- private operations --

    fn op_create(&mut self) {
        let named: Vec<String> = self.objs.iter().filter_map(|o| o.name.clone()).collect();
        if !named.is_empty() && self.rng.below(5) == 0 {
            let name = named[self.rng.below(named.len() as u64) as usize].clone();
            self.begin(
                "create-excl-existing",
                format!("create {name} O_EXCL over itself"),
            );
            let r = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(self.dir.join(&name));
            match r {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => self.fail(format_args!("expected EEXIST, got {e}")),
                Ok(_) => self.fail("O_CREAT|O_EXCL of an existing file succeeded"),
            }
            return;
        }
        let k = self.rng.below(NAMES);
        let keep = self.rng.below(3) != 0;
        let name = format!("f{k}");
        if self.objs.len() >= MAX_OBJS || named.contains(&name) {
            return;
        }
        self.begin("create", format!("create {name}"));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(self.dir.join(&name));
        let f = self.check(f, "open O_CREAT|O_EXCL");
        self.objs.push(Obj {
            name: Some(name.clone()),
            label: name,
            data: Vec::new(),
            fd: keep.then_some(f),
        });
    }

    fn op_write(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let size = self.objs[i].data.len() as u64;
        let len = self.io_len();
        let off = self.io_off(size, len);
        let verify = self.rng.below(3) == 0;
        let buf = pattern(self.id, self.op, off, len as usize);
        let label = &self.objs[i].label;
        self.begin(
            "pwrite",
            format!("pwrite {label} {off}+{len} (size {size})"),
        );
        self.ensure_open(i);
        self.check(self.fd(i).write_all_at(&buf, off), "pwrite");
        let d = &mut self.objs[i].data;
        let (off, end) = (off as usize, (off + len) as usize);
        if d.len() < end {
            d.resize(end, 0);
        }
        d[off..end].copy_from_slice(&buf);
        if verify {
            self.verify_range(i, off as u64, len, "read back after pwrite");
        }
    }

    fn op_read_range(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let size = self.objs[i].data.len() as u64;
        let len = self.io_len();
        let off = match self.rng.below(4) {
            0 => self.rng.below(size + 1),
            1 => self.rng.below(size / 4096 + 1) * 4096,
            2 => size.saturating_sub(self.rng.below(8192)),
            _ => self.rng.below(size + (64 << 10)),
        };
        let label = &self.objs[i].label;
        self.begin("pread", format!("pread {label} {off}+{len} (size {size})"));
        self.verify_range(i, off, len, "pread");
    }

    fn op_read_all(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let by_path = self.rng.below(2) == 0 && self.objs[i].name.is_some();
        let o = &self.objs[i];
        let how = if by_path { "fresh open" } else { "descriptor" };
        self.begin(
            "read-all",
            format!("read all of {} via {how} (size {})", o.label, o.data.len()),
        );
        self.verify_all(i, by_path);
    }

    fn op_truncate(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let size = self.objs[i].data.len() as u64;
        let r = &mut self.rng;
        let new = match r.below(6) {
            0 => r.below(size + 1),
            1 => r.below(size / 4096 + 1) * 4096,
            2 => size.saturating_sub(1 + r.below(4096)),
            3 | 4 => size + 1 + r.below(4 << 20),
            _ => (size + 1 + r.below(1 << 20)) & !4095,
        }
        .min(MAX_FILE);
        let o_trunc = r.below(8) == 0 && self.objs[i].name.is_some();
        let label = &self.objs[i].label;
        if o_trunc {
            self.begin("o_trunc", format!("open {label} O_TRUNC (size {size})"));
            let name = self.objs[i].name.clone().expect("named");
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .truncate(true)
                .open(self.dir.join(name));
            let f = self.check(f, "open O_TRUNC");
            self.objs[i].data.clear();
            self.objs[i].fd = Some(f);
        } else {
            self.begin("ftruncate", format!("ftruncate {label} {size} -> {new}"));
            self.ensure_open(i);
            self.check(self.fd(i).set_len(new), "ftruncate");
            self.objs[i].data.resize(new as usize, 0);
        }
        self.verify_size(self.fd(i), i);
        let new = self.objs[i].data.len() as u64;
        self.verify_range(i, new.saturating_sub(5000), 10000, "around the new EOF");
    }

    fn op_rename(&mut self) {
        let Some(i) = self.pick(|o| o.name.is_some()) else {
            return self.op_create();
        };
        let src = self.objs[i].name.clone().expect("named");
        let dst = format!("f{}", self.rng.below(NAMES));
        let verify = self.rng.below(2) == 0;
        let over = self.named(&dst).filter(|&j| j != i);
        let what = if over.is_some() {
            " (over an existing file)"
        } else {
            ""
        };
        self.begin("rename", format!("rename {src} -> {dst}{what}"));
        self.check(
            fs::rename(self.dir.join(&src), self.dir.join(&dst)),
            "rename",
        );
        if src == dst {
            return;
        }
        let mut i = i;
        if let Some(j) = over {
            // The replaced file lives on while a descriptor holds it.
            if self.objs[j].fd.is_some() {
                self.objs[j].name = None;
                self.objs[j].label = format!("{dst} (replaced by op {})", self.op);
            } else {
                self.objs.remove(j);
                if j < i {
                    i -= 1;
                }
            }
        }
        self.objs[i].name = Some(dst.clone());
        self.objs[i].label = dst.clone();
        self.expect_gone(&self.dir.join(&src));
        if verify {
            self.verify_all(i, true);
        }
    }

    fn op_unlink(&mut self) {
        let Some(i) = self.pick(|o| o.name.is_some()) else {
            return self.op_create();
        };
        let orphans = self.objs.iter().filter(|o| o.name.is_none()).count();
        let keep_open = orphans < MAX_ORPHANS && self.rng.below(2) == 0;
        let name = self.objs[i].name.clone().expect("named");
        let what = if keep_open { " (kept open)" } else { "" };
        self.begin("unlink", format!("unlink {name}{what}"));
        if keep_open {
            self.ensure_open(i);
        }
        self.check(fs::remove_file(self.dir.join(&name)), "unlink");
        self.expect_gone(&self.dir.join(&name));
        if keep_open {
            self.objs[i].name = None;
            self.objs[i].label = format!("{name} (unlinked at op {})", self.op);
            let nlink = self.check(self.fd(i).metadata(), "fstat").nlink();
            if nlink != 0 {
                self.fail(format_args!("nlink {nlink} after unlink"));
            }
            self.verify_size(self.fd(i), i);
        } else {
            self.objs.remove(i);
        }
    }

    /// A range inside the file (for mappings): `None` for an empty file.
    fn inner_range(&mut self, size: u64) -> Option<(u64, u64)> {
        if size == 0 {
            return None;
        }
        let off = match self.rng.below(3) {
            0 => self.rng.below(size / self.page + 1) * self.page,
            _ => self.rng.below(size),
        }
        .min(size - 1);
        let len = 1 + self.rng.below((size - off).min(MAX_IO));
        Some((off, len))
    }

    fn op_mmap_read(&mut self) {
        let Some(i) = self.pick(|o| !o.data.is_empty()) else {
            return self.op_write();
        };
        let size = self.objs[i].data.len() as u64;
        let (off, len) = self.inner_range(size).expect("non-empty");
        let label = &self.objs[i].label;
        self.begin(
            "mmap-read",
            format!("mmap read {label} {off}+{len} (size {size})"),
        );
        self.ensure_open(i);
        let start = off & !(self.page - 1);
        let delta = (off - start) as usize;
        let m = self.check(
            Mapping::new(self.fd(i), start, delta + len as usize, false),
            "mmap",
        );
        let got = m.read(delta, len as usize);
        drop(m);
        let o = &self.objs[i];
        if let Some(m) = mismatch(&got, model_slice(&o.data, off, len), off) {
            self.fail(format_args!("{} (read through mmap): {m}", o.label));
        }
    }

    fn op_mmap_write(&mut self) {
        let Some(i) = self.pick(|o| !o.data.is_empty()) else {
            return self.op_write();
        };
        let size = self.objs[i].data.len() as u64;
        let (off, len) = self.inner_range(size).expect("non-empty");
        let sync = self.rng.below(2) == 0;
        let fresh = self.rng.below(4) == 0;
        let buf = pattern(self.id, self.op, off, len as usize);
        let label = &self.objs[i].label;
        let what = if sync { " + msync" } else { "" };
        self.begin(
            "mmap-write",
            format!("mmap write {label} {off}+{len}{what} (size {size})"),
        );
        self.ensure_open(i);
        let start = off & !(self.page - 1);
        let delta = (off - start) as usize;
        let m = self.check(
            Mapping::new(self.fd(i), start, delta + len as usize, true),
            "mmap",
        );
        m.write(delta, &buf);
        if sync {
            self.check(m.msync(), "msync(MS_SYNC)");
        }
        drop(m);
        let (a, b) = (off as usize, (off + len) as usize);
        self.objs[i].data[a..b].copy_from_slice(&buf);
        self.verify_range(i, off, len, "pread after the mmap write");
        if fresh && self.objs[i].name.is_some() {
            self.verify_all(i, true);
        }
    }

    fn op_sync(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let data_only = self.rng.below(2) == 0;
        let label = &self.objs[i].label;
        let what = if data_only { "fdatasync" } else { "fsync" };
        self.begin(what, format!("{what} {label}"));
        self.ensure_open(i);
        let r = if data_only {
            self.fd(i).sync_data()
        } else {
            self.fd(i).sync_all()
        };
        self.check(r, what);
    }

    fn op_fallocate(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let size = self.objs[i].data.len() as u64;
        let (kind, mode) = match self.rng.below(6) {
            0 => ("fallocate", 0),
            1 => ("fallocate-keep-size", libc::FALLOC_FL_KEEP_SIZE),
            2 | 3 => (
                "punch-hole",
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            ),
            4 => ("zero-range", libc::FALLOC_FL_ZERO_RANGE),
            _ => (
                "zero-range-keep-size",
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            ),
        };
        let len = self.io_len();
        let off = self.io_off(size, len);
        let verify = self.rng.below(2) == 0;
        let label = &self.objs[i].label;
        self.begin(kind, format!("{kind} {label} {off}+{len} (size {size})"));
        self.ensure_open(i);
        self.check(fallocate(self.fd(i), mode, off, len), kind);
        let d = &mut self.objs[i].data;
        let end = off + len;
        if mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
            let (a, b) = ((off as usize).min(d.len()), (end as usize).min(d.len()));
            d[a..b].fill(0);
        }
        if mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > d.len() as u64 {
            d.resize(end as usize, 0);
        }
        self.verify_size(self.fd(i), i);
        if verify {
            let from = off.saturating_sub(100);
            self.verify_range(i, from, len + 200, "after fallocate");
        }
    }

    fn op_close(&mut self) {
        let Some(i) = self.pick(|o| o.fd.is_some()) else {
            return self.op_read_all();
        };
        let label = self.objs[i].label.clone();
        self.begin("close", format!("close {label}"));
        if self.objs[i].name.is_some() {
            self.objs[i].fd = None;
        } else {
            self.verify_all(i, false);
            self.objs.remove(i);
        }
    }

    fn op_evict(&mut self) {
        let Some(i) = self.pick(|_| true) else {
            return self.op_create();
        };
        let sync = self.rng.below(2) == 0;
        let label = &self.objs[i].label;
        let what = if sync { "fsync, " } else { "" };
        self.begin(
            "evict",
            format!("{what}drop cached pages of {label} and read it all"),
        );
        self.ensure_open(i);
        if sync {
            self.check(self.fd(i).sync_all(), "fsync");
        }
        self.check(drop_cache(self.fd(i)), "fadvise DONTNEED");
        self.verify_all(i, false);
    }

    /// Punches every other block of a range: many extents (a deeper extent tree).
    fn op_fragment(&mut self) {
        let Some(i) = self.pick(|o| o.data.len() >= 8 * 4096) else {
            return self.op_write();
        };
        let blocks = self.objs[i].data.len() as u64 / 4096;
        let n = 2 + self.rng.below(blocks.min(1024) - 1);
        let b0 = self.rng.below(blocks - n + 1);
        let odd = self.rng.below(2);
        let label = &self.objs[i].label;
        self.begin(
            "fragment",
            format!(
                "punch every other block of {label}, blocks {b0}..{}",
                b0 + n
            ),
        );
        self.ensure_open(i);
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        for b in (b0..b0 + n).filter(|b| b % 2 == odd) {
            self.check(fallocate(self.fd(i), mode, b * 4096, 4096), "punch");
            let at = (b * 4096) as usize;
            self.objs[i].data[at..at + 4096].fill(0);
        }
        self.verify_range(i, b0 * 4096, n * 4096, "after punching every other block");
    }

    // -- the striped file: written by every worker at once, each in its own chunks --

    /// One of this worker's chunks: (start, end) in the striped file.
    fn own_chunk(&mut self) -> (u64, u64) {
        let per = CHUNKS / self.workers;
        let c = self.rng.below(per) * self.workers + self.id as u64;
        (c * CHUNK, (c + 1) * CHUNK)
    }

    /// Checks `got`, read at `off` from the striped file (asked for `len` bytes): this
    /// worker's bytes there, and at least up to its own furthest write.
    fn check_striped(&self, got: &[u8], off: u64, len: u64, how: &str) {
        let at_least = (off + len).min(self.stripe_end).saturating_sub(off);
        if (got.len() as u64) < at_least || got.len() as u64 > len {
            self.fail(format_args!(
                "striped file ({how}): read {} bytes at {off}, asked {len}, the file is at \
                 least {} long",
                got.len(),
                self.stripe_end
            ));
        }
        let want = &self.stripe[off as usize..off as usize + got.len()];
        if let Some(m) = mismatch(got, want, off) {
            self.fail(format_args!("striped file ({how}): {m}"));
        }
    }

    fn op_striped(&mut self) {
        let (base, end) = self.own_chunk();
        let off = base + self.rng.below(CHUNK);
        let len = 1 + self.rng.below(end - off);
        let kind = self.rng.below(10);
        let d = format!("{off}+{len} (chunk at {base}; own end {})", self.stripe_end);
        match kind {
            0..=3 => {
                let verify = self.rng.below(2) == 0;
                self.begin("striped-pwrite", format!("striped pwrite {d}"));
                let buf = pattern(self.id, self.op, off, len as usize);
                self.check(self.striped.write_all_at(&buf, off), "pwrite");
                self.stripe[off as usize..(off + len) as usize].copy_from_slice(&buf);
                self.stripe_end = self.stripe_end.max(off + len);
                if verify {
                    let got = self.check(read_full_at(&self.striped, off, len as usize), "pread");
                    self.check_striped(&got, off, len, "read back after pwrite");
                }
            }
            4 | 5 => {
                self.begin("striped-pread", format!("striped pread {d}"));
                let got = self.check(read_full_at(&self.striped, off, len as usize), "pread");
                self.check_striped(&got, off, len, "pread");
            }
            6 | 7 => {
                // Inside the file only (no SIGBUS): below this worker's own end.
                let len = len.min(self.stripe_end.saturating_sub(off));
                let write = kind == 7;
                let what = if write { "write" } else { "read" };
                self.begin("striped-mmap", format!("striped mmap {what} {off}+{len}"));
                if len == 0 {
                    return;
                }
                let start = off & !(self.page - 1);
                let delta = (off - start) as usize;
                let m = Mapping::new(&self.striped, start, delta + len as usize, write);
                let m = self.check(m, "mmap");
                if write {
                    let buf = pattern(self.id, self.op, off, len as usize);
                    m.write(delta, &buf);
                    drop(m);
                    self.stripe[off as usize..(off + len) as usize].copy_from_slice(&buf);
                    let got = self.check(read_full_at(&self.striped, off, len as usize), "pread");
                    self.check_striped(&got, off, len, "pread after the mmap write");
                } else {
                    let got = m.read(delta, len as usize);
                    drop(m);
                    self.check_striped(&got, off, len, "read through mmap");
                }
            }
            8 => {
                self.begin("striped-punch", format!("striped punch hole {d}"));
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                self.check(fallocate(&self.striped, mode, off, len), "punch");
                self.stripe[off as usize..(off + len) as usize].fill(0);
            }
            _ => {
                let what = match self.rng.below(3) {
                    0 => "fsync",
                    1 => "fdatasync",
                    _ => "evict",
                };
                self.begin("striped-sync", format!("striped {what}, then read {d}"));
                let r = match what {
                    "fsync" => self.striped.sync_all(),
                    "fdatasync" => self.striped.sync_data(),
                    _ => drop_cache(&self.striped),
                };
                self.check(r, what);
                let got = self.check(read_full_at(&self.striped, off, len as usize), "pread");
                self.check_striped(&got, off, len, "pread");
            }
        }
    }

    // -- shared directory --

    fn sname(&mut self) -> String {
        format!("s{}", self.srng.below(SHARED_NAMES))
    }

    /// Ok, or one of the errnos a race may give.
    fn race_ok(&self, r: io::Result<()>, allowed: &[i32], what: &str) {
        if let Err(e) = r {
            if !allowed.contains(&errno(&e)) {
                self.fail(format_args!("{what}: {e}"));
            }
        }
    }

    fn op_shared(&mut self) {
        match self.srng.below(10) {
            0..=2 => self.sh_publish(),
            3 => {
                let (a, b) = (self.sname(), self.sname());
                self.begin("shared-link", format!("link shared/{a} shared/{b}"));
                let r = fs::hard_link(self.shared.join(&a), self.shared.join(&b));
                self.race_ok(r, &[libc::ENOENT, libc::EEXIST], "link");
            }
            4 | 5 => {
                let (a, b) = (self.sname(), self.sname());
                let noreplace = self.srng.below(2) == 0;
                let what = if noreplace { " RENAME_NOREPLACE" } else { "" };
                self.begin("shared-rename", format!("rename shared/{a} -> {b}{what}"));
                let (pa, pb) = (self.shared.join(&a), self.shared.join(&b));
                if noreplace {
                    let r = renameat2(&pa, &pb, libc::RENAME_NOREPLACE);
                    self.race_ok(r, &[libc::ENOENT, libc::EEXIST], "renameat2");
                } else {
                    self.race_ok(fs::rename(&pa, &pb), &[libc::ENOENT], "rename");
                }
            }
            6 => {
                let a = self.sname();
                self.begin("shared-unlink", format!("unlink shared/{a}"));
                let r = fs::remove_file(self.shared.join(&a));
                self.race_ok(r, &[libc::ENOENT], "unlink");
            }
            7 | 8 => {
                let a = self.sname();
                self.sh_read(&a);
            }
            _ => self.sh_list(),
        }
    }

    /// Writes a new file under a temp name, then renames it in.
    fn sh_publish(&mut self) {
        self.serial += 1;
        let id = ((self.id as u64 + 1) << 40) | self.serial;
        let gen = (self.srng.next_u64() as u32) | 1;
        let len = SHARED_HDR + self.srng.below(16 * SHARED_BLOCK as u64) as usize;
        let in_own = self.srng.below(3) == 0;
        let dst = self.sname();
        let noreplace = self.srng.below(2) == 0;
        let split = self.srng.below(len as u64) as usize;
        let fsync = self.srng.below(4) == 0;
        let (tmp, tmp_label) = if in_own {
            let n = format!("pub.{}", self.serial);
            (self.dir.join(&n), format!("w{}/{n}", self.id))
        } else {
            let n = format!("tmp.w{}.{}", self.id, self.serial);
            (self.shared.join(&n), format!("shared/{n}"))
        };
        let what = if noreplace { " RENAME_NOREPLACE" } else { "" };
        self.begin(
            "shared-publish",
            format!("publish shared/{dst} id {id:#x} gen {gen} len {len} from {tmp_label}{what}"),
        );
        let content = shared_content(id, gen, len);
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp);
        let f = self.check(f, "create the temp file");
        // The tail first (leaving a hole for a moment), then the head.
        self.check(
            f.write_all_at(&content[split..], split as u64),
            "pwrite tail",
        );
        self.check(f.write_all_at(&content[..split], 0), "pwrite head");
        if fsync {
            self.check(f.sync_all(), "fsync");
        }
        drop(f);
        let to = self.shared.join(&dst);
        if noreplace {
            match renameat2(&tmp, &to, libc::RENAME_NOREPLACE) {
                Ok(()) => {}
                Err(e) if errno(&e) == libc::EEXIST => {
                    self.check(fs::remove_file(&tmp), "unlink the unused temp file");
                }
                Err(e) => self.fail(format_args!("renameat2 RENAME_NOREPLACE: {e}")),
            }
        } else {
            self.check(fs::rename(&tmp, &to), "rename");
        }
    }

    fn sh_read(&mut self, name: &str) {
        let via_mmap = self.srng.below(3) == 0;
        let evict = self.srng.below(4) == 0;
        self.begin(
            "shared-read",
            format!("read shared/{name} (mmap {via_mmap}, evict {evict})"),
        );
        match File::open(self.shared.join(name)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => self.fail(format_args!("open: {e}")),
            Ok(f) => {
                if let Err(e) = check_shared(&f, via_mmap, evict) {
                    self.fail(format_args!("shared/{name}: {e}"));
                }
            }
        }
    }

    fn sh_list(&mut self) {
        self.begin("shared-list", "readdir shared/".into());
        let rd = self.check(fs::read_dir(&self.shared), "opendir");
        let mut names = Vec::new();
        for e in rd {
            let e = self.check(e, "readdir");
            let n = e.file_name().to_string_lossy().into_owned();
            if shared_name_ok(&n) {
                names.push(n);
            } else if !n.starts_with("tmp.w") {
                self.fail(format_args!("unexpected name in shared/: {n:?}"));
            }
        }
        for _ in 0..3.min(names.len()) {
            let n = names[self.srng.below(names.len() as u64) as usize].clone();
            self.sh_read(&n);
        }
    }

    // -- the end --

    fn finish(mut self) {
        self.op += 1;
        self.begin("final", "final check of every file".into());
        let mut listed: Vec<String> = self
            .check(fs::read_dir(&self.dir), "opendir")
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<io::Result<_>>()
            .unwrap_or_else(|e| self.fail(format_args!("readdir: {e}")));
        listed.sort();
        let mut want: Vec<String> = self.objs.iter().filter_map(|o| o.name.clone()).collect();
        want.sort();
        if listed != want {
            self.fail(format_args!(
                "directory lists {listed:?}, expected {want:?}"
            ));
        }
        for i in 0..self.objs.len() {
            let by_path = self.objs[i].name.is_some();
            self.verify_all(i, by_path);
        }
        let end = self.stripe_end;
        let got = self.check(read_full_at(&self.striped, 0, end as usize), "pread");
        if (got.len() as u64) < end {
            self.fail(format_args!(
                "striped file: {} bytes, written up to {end}",
                got.len()
            ));
        }
        for c in (self.id as u64..CHUNKS).step_by(self.workers as usize) {
            let (a, b) = (
                (c * CHUNK).min(end) as usize,
                ((c + 1) * CHUNK).min(end) as usize,
            );
            self.check_striped(&got[a..b], a as u64, (b - a) as u64, "final check");
        }
        self.stripe.truncate(end as usize);
        self.check(fs::create_dir_all(&self.out), "output dir");
        self.check(
            fs::write(self.out.join("stripe"), &self.stripe),
            "write stripe model",
        );
        // Close everything (unlinked files go away), then save the model.
        self.objs.retain(|o| o.name.is_some());
        for o in &mut self.objs {
            o.fd = None;
        }
        let files = self.out.join("files");
        self.check(fs::create_dir_all(&files), "model dir");
        for o in &self.objs {
            let name = o.name.as_deref().expect("named");
            self.check(fs::write(files.join(name), &o.data), "write model");
        }
        let total: u64 = self.stats.values().sum();
        let mut line = format!(
            "worker {}: {} ops, at most {} files / {} KiB at once (",
            self.id,
            total,
            self.peak.0,
            self.peak.1 >> 10
        );
        for (k, n) in &self.stats {
            let _ = write!(line, "{k} {n}, ");
        }
        line.truncate(line.len() - 2);
        line.push(')');
        eprintln!("{line}");
        self.check(fs::write(self.out.join("stats"), &line), "write stats");
        self.check(fs::write(self.out.join("done"), b"done\n"), "write done");
    }
}

fn shared_name_ok(n: &str) -> bool {
    n.strip_prefix('s')
        .and_then(|k| k.parse::<u64>().ok())
        .is_some_and(|k| k < SHARED_NAMES && n == format!("s{k}"))
}

/// A worker process (see the module doc); a no-op unless run by the stress test.
#[test]
fn stress_worker() {
    if let Some(w) = Worker::from_env() {
        w.run();
    }
}

// ---------------------------------------------------------------------------------
// The parent: mount, run the workers, check everything.

/// Why this test cannot run here, if it cannot.
fn cannot_run(target: Target) -> Option<String> {
    if target == Target::Kernel {
        return can_loop_mount().err();
    }
    fuse_mount::cannot_mount()
}

/// What the workers run on: a `rext4 mount` or (to check the test) the kernel's ext4.
enum Subject {
    Rext4(Mounted),
    Kernel(LoopMount),
}

impl Subject {
    fn mount(cfg: &Config, img: &Path) -> Subject {
        match cfg.target {
            Target::Rext4 if cfg.mount_opts.is_empty() => Subject::Rext4(Mounted::new(img, &[])),
            Target::Rext4 => Subject::Rext4(Mounted::new(img, &[&cfg.mount_opts])),
            Target::Kernel => Subject::Kernel(LoopMount::new(img, false, "").expect("loop mount")),
        }
    }

    fn path(&self) -> &Path {
        match self {
            Subject::Rext4(m) => m.path(),
            Subject::Kernel(m) => m.path(),
        }
    }

    fn server_pid(&self) -> Option<i32> {
        match self {
            Subject::Rext4(m) => Some(m.pid()),
            Subject::Kernel(_) => None,
        }
    }

    /// The mount log's last lines (rext4 only).
    fn log_tail(&self) -> String {
        match self {
            Subject::Rext4(m) => {
                let log = m.stderr();
                let log = if log.trim().is_empty() {
                    "(empty)".into()
                } else {
                    tail(&log, 60)
                };
                format!("rext4 mount log (tail):\n{log}")
            }
            Subject::Kernel(_) => String::new(),
        }
    }

    /// Unmounts; the rext4 server must exit successfully.
    fn finish(self) {
        match self {
            Subject::Rext4(mut m) => {
                let st = m.unmount();
                assert!(st.success(), "rext4 mount exited {st}:\n{}", m.stderr());
            }
            Subject::Kernel(m) => m.unmount().expect("kernel unmount"),
        }
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The worker processes; any still running on drop are killed and reaped.
struct Workers {
    procs: Vec<Proc>,
}

struct Proc {
    id: usize,
    seed: u64,
    child: Child,
    log: PathBuf,
    status: Option<ExitStatus>,
    /// The log's length and when it last changed (a worker logs every operation).
    progress: (u64, Instant),
}

impl Workers {
    fn spawn(cfg: &Config, root: &Path, scratch: &Path, deadline_ms: u64) -> Workers {
        let exe = std::env::current_exe().expect("path of the test binary");
        let mut procs = Vec::new();
        for id in 0..cfg.workers {
            let seed = cfg.worker_seed(id);
            let log = scratch.join(format!("w{id}.log"));
            let out = File::create(&log).expect("worker log");
            let err = out.try_clone().expect("worker log");
            let child = Command::new(&exe)
                .args(["--exact", WORKER_TEST, "--nocapture", "--test-threads=1"])
                .env(ENV_ID, id.to_string())
                .env(ENV_SEED, format!("{seed:#x}"))
                .env(ENV_DIR, root.join(format!("w{id}")))
                .env(ENV_SHARED, root.join("shared"))
                .env(ENV_DEADLINE, deadline_ms.to_string())
                .env(ENV_OUT, scratch.join(format!("w{id}")))
                .env(ENV_STRIPED, root.join("striped"))
                .env(ENV_COUNT, cfg.workers.to_string())
                .env("RUST_BACKTRACE", "0")
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .expect("spawn a worker");
            procs.push(Proc {
                id,
                seed,
                child,
                log,
                status: None,
                progress: (0, Instant::now()),
            });
        }
        Workers { procs }
    }

    /// Waits for every worker until `limit`. `Err` describes the failed or hung ones
    /// (the others are killed then): hung means still running at `limit`, or no
    /// operation finished for `STALL`.
    fn wait(&mut self, limit: Instant, server: Option<i32>) -> Result<(), String> {
        loop {
            let now = Instant::now();
            for p in &mut self.procs {
                if p.status.is_none() {
                    p.status = p.child.try_wait().expect("waitpid");
                    let len = fs::metadata(&p.log).map_or(0, |m| m.len());
                    if len != p.progress.0 {
                        p.progress = (len, now);
                    }
                }
            }
            let failed: Vec<&Proc> = self
                .procs
                .iter()
                .filter(|p| p.status.is_some_and(|s| !s.success()))
                .collect();
            if !failed.is_empty() {
                let mut msg = String::new();
                for p in failed {
                    let st = p.status.expect("exited");
                    let log = fs::read_to_string(&p.log).unwrap_or_default();
                    let _ = write!(
                        msg,
                        "worker {} (seed {:#018x}) exited {st}; its log (tail):\n{}\n",
                        p.id,
                        p.seed,
                        tail(&log, 40)
                    );
                }
                self.kill_all(server);
                return Err(msg);
            }
            if self.procs.iter().all(|p| p.status.is_some()) {
                return Ok(());
            }
            let stalled = |p: &Proc| p.status.is_none() && now - p.progress.1 > STALL;
            let any_stalled = self.procs.iter().any(stalled);
            if now > limit || any_stalled {
                let mut msg = String::new();
                for p in self.procs.iter().filter(|p| p.status.is_none()) {
                    let pid = p.child.id();
                    if any_stalled && !stalled(p) {
                        let _ = writeln!(msg, "worker {} (pid {pid}) was still working", p.id);
                        continue;
                    }
                    let log = fs::read_to_string(&p.log).unwrap_or_default();
                    let _ = write!(
                        msg,
                        "worker {} (seed {:#018x}, pid {pid}) {}; last log line {:.0} s ago; \
                         its threads:\n{}its log (tail):\n{}\n",
                        p.id,
                        p.seed,
                        if any_stalled {
                            "hangs"
                        } else {
                            "still runs long after the random phase"
                        },
                        (now - p.progress.1).as_secs_f64(),
                        thread_stacks(pid as i32),
                        tail(&log, 20)
                    );
                }
                if let Some(spid) = server {
                    let _ = write!(msg, "rext4 server threads:\n{}", thread_stacks(spid));
                }
                self.kill_all(server);
                return Err(msg);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL every running worker and reap it; if one cannot die (stuck in the
    /// kernel on a request), kill the server too, which aborts the connection.
    fn kill_all(&mut self, server: Option<i32>) {
        for p in &mut self.procs {
            if p.status.is_none() {
                let _ = p.child.kill();
            }
        }
        for pass in 0..2 {
            for p in &mut self.procs {
                if p.status.is_none() {
                    p.status = wait_child(&mut p.child, Duration::from_secs(10));
                }
            }
            if pass == 0 && self.procs.iter().any(|p| p.status.is_none()) {
                if let Some(spid) = server {
                    eprintln!("stress: a worker does not die; killing the rext4 server {spid}");
                    // SAFETY: signalling the server process this test spawned.
                    unsafe { libc::kill(spid, libc::SIGKILL) };
                }
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.kill_all(None);
    }
}

/// Each thread's kernel stack and wchan of process `pid`.
fn thread_stacks(pid: i32) -> String {
    let mut s = String::new();
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return s;
    };
    for t in rd.flatten() {
        let p = t.path();
        let comm = fs::read_to_string(p.join("comm")).unwrap_or_default();
        let wchan = fs::read_to_string(p.join("wchan")).unwrap_or_default();
        let stack = fs::read_to_string(p.join("stack")).unwrap_or_default();
        let _ = writeln!(
            s,
            "  task {} {} wchan {wchan}\n{stack}",
            t.file_name().to_string_lossy(),
            comm.trim()
        );
    }
    s
}

fn sorted_names(dir: &Path) -> io::Result<Vec<String>> {
    let mut v = fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<io::Result<Vec<_>>>()?;
    v.sort();
    Ok(v)
}

/// Reads a whole file, optionally after dropping its cached pages (so the FUSE server,
/// not the kernel's page cache, answers); checks fstat's size against what was read.
fn read_file(p: &Path, evict: bool) -> Result<Vec<u8>, String> {
    let mut f = File::open(p).map_err(|e| format!("open: {e}"))?;
    let size = f.metadata().map_err(|e| format!("fstat: {e}"))?.len();
    if evict {
        drop_cache(&f).map_err(|e| format!("fadvise DONTNEED: {e}"))?;
    }
    let mut v = Vec::new();
    f.read_to_end(&mut v).map_err(|e| format!("read: {e}"))?;
    if v.len() as u64 != size {
        return Err(format!("read {} bytes, fstat says {size}", v.len()));
    }
    Ok(v)
}

/// Checks every worker's directory against its model and the shared directory for
/// whole, consistent files, as seen at `root`; returns the problems and what the shared
/// directory holds.
fn verify_view(
    root: &Path,
    scratch: &Path,
    workers: usize,
    evict: bool,
) -> (Vec<String>, BTreeMap<String, SharedId>) {
    let mut problems = Vec::new();
    let mut files = 0;
    let mut bytes = 0;
    for id in 0..workers {
        let model = scratch.join(format!("w{id}")).join("files");
        let dir = root.join(format!("w{id}"));
        let want = sorted_names(&model).expect("list a model");
        match sorted_names(&dir) {
            Ok(got) if got != want => {
                problems.push(format!("w{id}/ lists {got:?}, the model {want:?}"));
            }
            Ok(_) => {}
            Err(e) => problems.push(format!("w{id}/: readdir: {e}")),
        }
        for name in &want {
            let m = fs::read(model.join(name)).expect("read a model file");
            files += 1;
            bytes += m.len();
            match read_file(&dir.join(name), evict) {
                Err(e) => problems.push(format!("w{id}/{name}: {e}")),
                Ok(got) => {
                    if let Some(d) = mismatch(&got, &m, 0) {
                        problems.push(format!("w{id}/{name}: {d}"));
                    }
                }
            }
        }
    }
    // The striped file: each chunk as its owner knows it, as long as the furthest write.
    let stripes: Vec<Vec<u8>> = (0..workers)
        .map(|id| fs::read(scratch.join(format!("w{id}")).join("stripe")).expect("stripe model"))
        .collect();
    let mut want = vec![0u8; stripes.iter().map(Vec::len).max().unwrap_or(0)];
    for (c, chunk) in want.chunks_mut(CHUNK as usize).enumerate() {
        let m = &stripes[c % workers];
        let a = c * CHUNK as usize;
        if let Some(have) = m.get(a..) {
            let n = have.len().min(chunk.len());
            chunk[..n].copy_from_slice(&have[..n]);
        }
    }
    match read_file(&root.join("striped"), evict) {
        Err(e) => problems.push(format!("striped: {e}")),
        Ok(got) => {
            if let Some(d) = mismatch(&got, &want, 0) {
                problems.push(format!("striped: {d}"));
            }
        }
    }
    let mut expected: Vec<String> = (0..workers).map(|id| format!("w{id}")).collect();
    expected.extend(["lost+found", "shared", "striped"].map(String::from));
    expected.sort();
    match sorted_names(root) {
        Ok(got) if got != expected => problems.push(format!("/ lists {got:?}, not {expected:?}")),
        Ok(_) => {}
        Err(e) => problems.push(format!("/: readdir: {e}")),
    }
    let mut shared = BTreeMap::new();
    match sorted_names(&root.join("shared")) {
        Err(e) => problems.push(format!("shared/: readdir: {e}")),
        Ok(names) => {
            for n in names {
                if !shared_name_ok(&n) {
                    problems.push(format!("shared/{n}: unexpected name (a temp file left?)"));
                    continue;
                }
                let r = File::open(root.join("shared").join(&n))
                    .map_err(|e| format!("open: {e}"))
                    .and_then(|f| check_shared(&f, false, evict));
                match r {
                    Ok(sid) => {
                        shared.insert(n, sid);
                    }
                    Err(e) => problems.push(format!("shared/{n}: {e}")),
                }
            }
        }
    }
    eprintln!(
        "stress:   {} modelled files, {} MiB, {} shared files, a striped file of {} MiB",
        files,
        bytes >> 20,
        shared.len(),
        want.len() >> 20
    );
    (problems, shared)
}

fn report(problems: &[String]) -> String {
    let n = problems.len();
    let mut s = problems
        .iter()
        .take(20)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n  ");
    if n > 20 {
        let _ = write!(s, "\n  ... and {} more", n - 20);
    }
    s
}

#[test]
fn stress_random_operations_over_the_mount() {
    if std::env::var_os(ENV_ID).is_some() {
        return; // a worker process runs only `stress_worker`
    }
    let cfg = Config::from_env();
    if let Some(why) = cannot_run(cfg.target) {
        skip(&why);
        return;
    }
    cfg.print();
    let t0 = Instant::now();
    // Room for every worker's files at their largest, the shared files and the journal.
    let size = (256 << 20) + cfg.workers as u64 * MAX_OBJS as u64 * MAX_FILE + STRIPED_SIZE;
    let img = mkfs(&MkfsOptions::new(4096, size)).expect("mkfs.ext4");
    let img_path = img.path().to_path_buf();
    let _img = if cfg.keep {
        eprintln!("stress: the image is kept: {}", img.keep().display());
        None
    } else {
        Some(img)
    };
    let scratch = TempDir::new("stress").expect("scratch directory");
    let subject = Subject::mount(&cfg, &img_path);
    let root = subject.path().to_path_buf();
    for id in 0..cfg.workers {
        fs::create_dir(root.join(format!("w{id}"))).expect("mkdir worker dir");
    }
    fs::create_dir(root.join("shared")).expect("mkdir shared");
    File::create(root.join("striped")).expect("create the striped file");
    let server = subject.server_pid();
    let dog =
        server.map(|pid| Watchdog::new("stress", pid, GRACE * 2 + Duration::from_secs(cfg.secs)));

    let deadline_ms = now_ms() + cfg.secs * 1000;
    let limit = Instant::now() + Duration::from_secs(cfg.secs) + GRACE;
    let mut workers = Workers::spawn(&cfg, &root, scratch.path(), deadline_ms);
    if let Err(e) = workers.wait(limit, server) {
        panic!(
            "stress (seed {:#018x}) failed:\n{e}\n{}",
            cfg.seed,
            subject.log_tail()
        );
    }
    drop(workers);
    let t_run = t0.elapsed();
    for id in 0..cfg.workers {
        let w = scratch.join(format!("w{id}"));
        assert!(
            w.join("done").exists(),
            "worker {id} exited 0 without its model"
        );
        eprintln!(
            "stress:   {}",
            fs::read_to_string(w.join("stats")).unwrap_or_default()
        );
    }

    eprintln!("stress: checking the files through the mount");
    let (problems, shared) = verify_view(&root, scratch.path(), cfg.workers, true);
    assert!(
        problems.is_empty(),
        "stress (seed {:#018x}): the mount after the run:\n  {}\n{}",
        cfg.seed,
        report(&problems),
        subject.log_tail()
    );
    subject.finish();
    drop(dog);

    let fsck = e2fsck_fn(&img_path);
    // Only e2fsck's repack notices are allowed (see `clean_but_repack_hints`): the
    // punched-pattern and striped files end with half-empty tree nodes on the kernel
    // as on rext4.
    assert!(
        fsck.clean_but_repack_hints(),
        "stress (seed {:#018x}): e2fsck -fn not clean:\n{}",
        cfg.seed,
        fsck.output
    );

    match LoopMount::new(&img_path, true, "") {
        Err(e) => skip(&format!("the kernel's view of the image: {e}")),
        Ok(k) => {
            eprintln!("stress: checking the files through the kernel's ext4");
            let (problems, kshared) = verify_view(k.path(), scratch.path(), cfg.workers, false);
            assert!(
                problems.is_empty(),
                "stress (seed {:#018x}): the kernel's view of the image:\n  {}",
                cfg.seed,
                report(&problems)
            );
            assert!(
                kshared == shared,
                "stress (seed {:#018x}): shared/ differs: the mount showed {shared:?}, \
                 the kernel shows {kshared:?}",
                cfg.seed
            );
        }
    }
    eprintln!(
        "stress: passed ({:.1} s of workers, {:.1} s in all)",
        t_run.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
