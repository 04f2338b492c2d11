//! Fill the disk at random: 8 workers run creates, writes, truncates, symlinks, hard
//! links, renames, mkdir/rmdir, fallocate and hole punching on one image until it is
//! full, in every mount mode (default: the kernel's writeback cache over
//! FUSE-over-io_uring where offered; `nowriteback_cache`; `nouring`, over /dev/fuse;
//! `bdi_max_ratio=0`, the kernel's own dirty limit as for a mount made without root)
//! and through the API. Then: every write that returned success — write() and the
//! close() after it, which reports what the kernel's writeback could not place —
//! reads back, the groups' counts equal the bitmaps, and e2fsck -fn is clean.
//!
//! A failed operation (ENOSPC, from write(), close() or fsync) leaves its range
//! unknown: old bytes, new bytes or zeros are all right there, and a file's size is
//! then known only within bounds. Anything else must match the model exactly.
//!
//! Knobs: `REXT4_FILL_MB` (image size, default 256; the run is 2048),
//! `REXT4_FILL_SEED`, `REXT4_FILL_MODES` (comma list of: kernel — the same workload on
//! the kernel's ext4, the reference —, default, nowb, nouring, kernelwindow, api). Each
//! run prints how long it took to fill the disk.

mod fuse_mount;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_mount::{cannot_mount, Mounted, Watchdog};
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions};

const WORKERS: u64 = 8;
/// A worker stops after this many operations refused for lack of space.
const FULL_AFTER: u32 = 60;

// ---------------------------------------------------------------------------------
// Where the operations go: a mounted directory, or the API.

trait Target: Send + Sync {
    fn create(&self, p: &str) -> io::Result<()>;
    /// Open, write all of `data` at `off`, close: success only when all three are.
    fn write(&self, p: &str, off: u64, data: &[u8]) -> io::Result<()>;
    fn truncate(&self, p: &str, size: u64) -> io::Result<()>;
    fn symlink(&self, target: &str, p: &str) -> io::Result<()>;
    fn link(&self, from: &str, to: &str) -> io::Result<()>;
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    fn mkdir(&self, p: &str) -> io::Result<()>;
    fn rmdir(&self, p: &str) -> io::Result<()>;
    fn unlink(&self, p: &str) -> io::Result<()>;
    /// fallocate(2) mode (0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE).
    fn fallocate(&self, p: &str, mode: i32, off: u64, len: u64) -> io::Result<()>;
    fn fsync(&self, p: &str) -> io::Result<()>;
}

struct Posix(PathBuf);

fn cvt(r: libc::c_int) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Target for Posix {
    fn create(&self, p: &str) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(self.0.join(p))
            .map(drop)
    }
    fn write(&self, p: &str, off: u64, data: &[u8]) -> io::Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(p))?;
        f.write_all_at(data, off)?;
        // close(2) reports what the kernel's writeback of this file failed to write.
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        // SAFETY: closing the descriptor we own (taken out of the File).
        cvt(unsafe { libc::close(fd) })
    }
    fn truncate(&self, p: &str, size: u64) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(p))?
            .set_len(size)
    }
    fn symlink(&self, target: &str, p: &str) -> io::Result<()> {
        std::os::unix::fs::symlink(target, self.0.join(p))
    }
    fn link(&self, from: &str, to: &str) -> io::Result<()> {
        std::fs::hard_link(self.0.join(from), self.0.join(to))
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        std::fs::rename(self.0.join(from), self.0.join(to))
    }
    fn mkdir(&self, p: &str) -> io::Result<()> {
        std::fs::create_dir(self.0.join(p))
    }
    fn rmdir(&self, p: &str) -> io::Result<()> {
        std::fs::remove_dir(self.0.join(p))
    }
    fn unlink(&self, p: &str) -> io::Result<()> {
        std::fs::remove_file(self.0.join(p))
    }
    fn fallocate(&self, p: &str, mode: i32, off: u64, len: u64) -> io::Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(p))?;
        // SAFETY: fallocate on a descriptor we own.
        cvt(unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) })?;
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        // SAFETY: as in `write`.
        cvt(unsafe { libc::close(fd) })
    }
    fn fsync(&self, p: &str) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(p))?
            .sync_all()
    }
}

struct Api(rext4::Fs);

fn io_err(e: rext4::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl Api {
    fn path(p: &str) -> String {
        format!("/{p}")
    }
    fn file(&self, p: &str) -> io::Result<rext4::File> {
        rext4::OpenOptions::new()
            .write(true)
            .open(&self.0, Self::path(p))
            .map_err(io_err)
    }
}

impl Target for Api {
    fn create(&self, p: &str) -> io::Result<()> {
        rext4::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&self.0, Self::path(p))
            .map(drop)
            .map_err(io_err)
    }
    fn write(&self, p: &str, off: u64, data: &[u8]) -> io::Result<()> {
        self.file(p)?.write_all_at(data, off).map_err(io_err)
    }
    fn truncate(&self, p: &str, size: u64) -> io::Result<()> {
        self.file(p)?.set_len(size).map_err(io_err)
    }
    fn symlink(&self, target: &str, p: &str) -> io::Result<()> {
        self.0.symlink(target, Self::path(p)).map_err(io_err)
    }
    fn link(&self, from: &str, to: &str) -> io::Result<()> {
        self.0
            .hard_link(Self::path(from), Self::path(to))
            .map_err(io_err)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.0
            .rename(Self::path(from), Self::path(to))
            .map_err(io_err)
    }
    fn mkdir(&self, p: &str) -> io::Result<()> {
        self.0.create_dir(Self::path(p)).map_err(io_err)
    }
    fn rmdir(&self, p: &str) -> io::Result<()> {
        self.0.remove_dir(Self::path(p)).map_err(io_err)
    }
    fn unlink(&self, p: &str) -> io::Result<()> {
        self.0.remove_file(Self::path(p)).map_err(io_err)
    }
    fn fallocate(&self, p: &str, mode: i32, off: u64, len: u64) -> io::Result<()> {
        let m = match mode {
            0 => rext4::FallocMode::Allocate,
            libc::FALLOC_FL_KEEP_SIZE => rext4::FallocMode::KeepSize,
            m if m & libc::FALLOC_FL_PUNCH_HOLE != 0 => rext4::FallocMode::PunchHole,
            _ => rext4::FallocMode::ZeroRange { keep_size: false },
        };
        let ino = self.file(p)?.ino();
        self.0.fallocate_ino(ino, m, off, len).map_err(io_err)
    }
    fn fsync(&self, p: &str) -> io::Result<()> {
        self.file(p)?.sync_all().map_err(io_err)
    }
}

// ---------------------------------------------------------------------------------
// The model.

/// One file's bytes as far as they are known. `unknown` holds byte ranges a failed
/// operation may or may not have changed; while `len_lo < data.len()` the size is only
/// known to lie in `[len_lo, data.len()]`.
#[derive(Clone, Default)]
struct FileModel {
    data: Vec<u8>,
    unknown: BTreeSet<(u64, u64)>,
    len_lo: u64,
}

impl FileModel {
    fn len(&self) -> u64 {
        self.data.len() as u64
    }
    fn set_len(&mut self, n: u64) {
        self.data.resize(n as usize, 0);
        self.unknown = self
            .unknown
            .iter()
            .filter(|r| r.0 < n)
            .map(|&(a, b)| (a, b.min(n)))
            .collect();
        self.len_lo = n;
    }
    fn write(&mut self, off: u64, d: &[u8]) {
        let end = off + d.len() as u64;
        if end > self.len() {
            self.data.resize(end as usize, 0);
            self.len_lo = self.len_lo.max(end);
        }
        self.data[off as usize..end as usize].copy_from_slice(d);
    }
    /// A failed change of `[off, end)`, which may also have grown the file to `end`.
    fn fail(&mut self, off: u64, end: u64) {
        if end > self.len() {
            self.data.resize(end as usize, 0);
        }
        self.unknown.insert((off, end));
    }
    fn known(&self, at: u64) -> bool {
        !self.unknown.iter().any(|&(a, b)| a <= at && at < b)
    }
}

/// What a worker made: names (relative to the image root) of files (by inode id),
/// symlinks and directories.
#[derive(Default)]
struct Model {
    files: BTreeMap<String, usize>,
    inodes: Vec<FileModel>,
    links: BTreeMap<String, String>,
    dirs: BTreeSet<String>,
}

fn enospc(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC)
}

/// Run random operations in directory `w{id}` until `FULL_AFTER` were refused for
/// lack of space. Returns the model and the number of operations.
fn worker(t: &dyn Target, id: u64, seed: u64) -> (Model, u64) {
    let mut r = Rng(seed ^ (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut m = Model::default();
    let top = format!("w{id}");
    t.mkdir(&top).expect("worker directory");
    m.dirs.insert(top.clone());
    let mut full = 0;
    let mut ops = 0u64;
    let mut n = 0u64;
    while full < FULL_AFTER {
        ops += 1;
        n += 1;
        let dir = m
            .dirs
            .iter()
            .nth(r.below(m.dirs.len() as u64) as usize)
            .cloned()
            .unwrap_or_else(|| top.clone());
        let names: Vec<String> = m.files.keys().cloned().collect();
        let pick = |r: &mut Rng| names.get(r.below(names.len() as u64) as usize).cloned();
        let op = r.below(100);
        let res: io::Result<()> = if op < 12 || names.is_empty() {
            let p = format!("{dir}/f{n}");
            let res = t.create(&p);
            if res.is_ok() {
                m.inodes.push(FileModel::default());
                m.files.insert(p, m.inodes.len() - 1);
            }
            res
        } else if op < 62 {
            let p = pick(&mut r).expect("a file");
            let i = m.files[&p];
            let big = r.below(4) == 0;
            let len = 1 + r.below(if big { 1 << 20 } else { 64 << 10 });
            let off = r.below(m.inodes[i].len() + (2 << 20));
            let byte = (n % 251) as u8 + 1;
            let d = vec![byte; len as usize];
            let res = t.write(&p, off, &d);
            match &res {
                Ok(()) => m.inodes[i].write(off, &d),
                Err(_) => m.inodes[i].fail(off, off + len),
            }
            res
        } else if op < 68 {
            let p = pick(&mut r).expect("a file");
            let i = m.files[&p];
            let size = r.below(m.inodes[i].len() + (1 << 20));
            let res = t.truncate(&p, size);
            match &res {
                Ok(()) => m.inodes[i].set_len(size),
                Err(_) => {
                    let cur = m.inodes[i].len();
                    m.inodes[i].fail(size.min(cur), size.max(cur));
                    m.inodes[i].len_lo = m.inodes[i].len_lo.min(size);
                }
            }
            res
        } else if op < 74 {
            let p = format!("{dir}/l{n}");
            // Slow symlinks (a block each) as well as fast ones.
            let target = "t".repeat(1 + r.below(300) as usize);
            let res = t.symlink(&target, &p);
            if res.is_ok() {
                m.links.insert(p, target);
            }
            res
        } else if op < 78 {
            let p = pick(&mut r).expect("a file");
            let to = format!("{dir}/h{n}");
            let res = t.link(&p, &to);
            if res.is_ok() {
                let i = m.files[&p];
                m.files.insert(to, i);
            }
            res
        } else if op < 83 {
            let p = pick(&mut r).expect("a file");
            // Over another file of ours sometimes.
            let to = if r.below(3) == 0 {
                pick(&mut r).expect("a file")
            } else {
                format!("{dir}/r{n}")
            };
            let res = t.rename(&p, &to);
            // Two names of one file (a hard link made earlier): rename(2) does
            // nothing and succeeds, both names stay.
            let i = m.files[&p];
            if res.is_ok() && m.files.get(&to) != Some(&i) {
                m.files.remove(&p);
                m.files.insert(to, i);
            }
            res
        } else if op < 87 {
            if r.below(2) == 0 && m.dirs.len() < 20 {
                let p = format!("{dir}/d{n}");
                let res = t.mkdir(&p);
                if res.is_ok() {
                    m.dirs.insert(p);
                }
                res
            } else {
                // An empty directory of ours, if there is one.
                let empty = m
                    .dirs
                    .iter()
                    .filter(|d| **d != top)
                    .find(|d| {
                        let pre = format!("{d}/");
                        !m.files.keys().any(|f| f.starts_with(&pre))
                            && !m.links.keys().any(|f| f.starts_with(&pre))
                            && !m.dirs.iter().any(|f| f.starts_with(&pre))
                    })
                    .cloned();
                match empty {
                    Some(d) => {
                        let res = t.rmdir(&d);
                        if res.is_ok() {
                            m.dirs.remove(&d);
                        }
                        res
                    }
                    None => Ok(()),
                }
            }
        } else if op < 92 {
            let p = pick(&mut r).expect("a file");
            let res = t.unlink(&p);
            if res.is_ok() {
                m.files.remove(&p);
            }
            res
        } else if op < 98 {
            let p = pick(&mut r).expect("a file");
            let i = m.files[&p];
            let off = r.below(m.inodes[i].len() + (1 << 20));
            let len = 1 + r.below(1 << 20);
            let mode = [
                0,
                libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_ZERO_RANGE,
            ][r.below(4) as usize];
            let res = t.fallocate(&p, mode, off, len);
            let f = &mut m.inodes[i];
            let end = off + len;
            match (&res, mode) {
                (Ok(()), 0) if end > f.len() => f.set_len(end),
                (Ok(()), libc::FALLOC_FL_ZERO_RANGE) => {
                    f.write(off, &vec![0; len as usize]);
                }
                (Ok(()), m) if m & libc::FALLOC_FL_PUNCH_HOLE != 0 => {
                    let e = end.min(f.len());
                    if off < e {
                        f.data[off as usize..e as usize].fill(0);
                    }
                }
                (Ok(()), _) => {}
                (Err(_), libc::FALLOC_FL_KEEP_SIZE) => {}
                (Err(_), m) if m & libc::FALLOC_FL_PUNCH_HOLE != 0 => {
                    let e = end.min(f.len());
                    if off < e {
                        f.unknown.insert((off, e));
                    }
                }
                (Err(_), _) => f.fail(off, end),
            }
            res
        } else {
            let p = pick(&mut r).expect("a file");
            let res = t.fsync(&p);
            if res.is_err() {
                // What the kernel held of it is unknown now: the whole file.
                let i = m.files[&p];
                let l = m.inodes[i].len();
                m.inodes[i].fail(0, l);
            }
            res
        };
        match res {
            Ok(()) => {}
            Err(e) if enospc(&e) => full += 1,
            Err(e) => panic!("worker {id}: operation {ops} ({op}): {e}"),
        }
    }
    (m, ops)
}

/// Compare what the image holds with the models.
fn verify(fs: &rext4::Fs, models: &[Model], label: &str) {
    for (w, m) in models.iter().enumerate() {
        for (p, &i) in &m.files {
            let want = &m.inodes[i];
            let got = fs
                .read(format!("/{p}"))
                .unwrap_or_else(|e| panic!("{label}: worker {w}: /{p}: {e}"));
            let glen = got.len() as u64;
            assert!(
                want.len_lo <= glen && glen <= want.len(),
                "{label}: worker {w}: /{p} is {glen} bytes, not in [{}, {}]",
                want.len_lo,
                want.len()
            );
            if let Some(at) =
                (0..glen).find(|&k| want.known(k) && got[k as usize] != want.data[k as usize])
            {
                panic!(
                    "{label}: worker {w}: /{p}: byte {at} is {:#x}, acknowledged {:#x}",
                    got[at as usize], want.data[at as usize]
                );
            }
        }
        for (p, t) in &m.links {
            let got = fs
                .read_link(format!("/{p}"))
                .unwrap_or_else(|e| panic!("{label}: /{p}: {e}"));
            assert_eq!(got, t.as_bytes(), "{label}: /{p}");
        }
        for d in &m.dirs {
            assert!(
                fs.metadata(format!("/{d}")).is_ok_and(|m| m.is_dir()),
                "{label}: /{d} is missing"
            );
        }
    }
}

fn run_workers(t: Arc<dyn Target>, seed: u64) -> Vec<Model> {
    let threads: Vec<_> = (0..WORKERS)
        .map(|id| {
            let t = t.clone();
            std::thread::spawn(move || worker(t.as_ref(), id, seed))
        })
        .collect();
    let out: Vec<(Model, u64)> = threads
        .into_iter()
        .map(|h| h.join().expect("worker"))
        .collect();
    let ops: u64 = out.iter().map(|o| o.1).sum();
    eprintln!("  {ops} operations");
    out.into_iter().map(|o| o.0).collect()
}

fn after(img: &Path, models: &[Model], label: &str) {
    let r = e2fsck_fn(img);
    // The kernel's ext4 leaves extent trees e2fsck would repack after this much hole
    // punching (notices, not errors); rext4 must be clean outright.
    let clean = if label == "kernel" {
        r.clean_but_repack_hints()
    } else {
        r.clean
    };
    assert!(clean, "{label}: e2fsck -fn:\n{}", r.output);
    let fs = rext4::Fs::open(img).expect("open");
    let d = fs.check_counts().expect("counts");
    assert!(d.is_empty(), "{label}: counts:\n{}", d.join("\n"));
    verify(&fs, models, label);
    let st = fs.statfs();
    assert!(
        st.blocks_available < st.blocks / 50,
        "{label}: the workers stopped with {} of {} blocks available: not full",
        st.blocks_available,
        st.blocks
    );
}

#[test]
fn fill_the_disk_at_random() {
    let mb: u64 = std::env::var("REXT4_FILL_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let seed: u64 = std::env::var("REXT4_FILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0xF1_11);
    let modes: Vec<String> = std::env::var("REXT4_FILL_MODES")
        .unwrap_or_else(|_| "kernel,default,nowb,nouring,kernelwindow,api".into())
        .split(',')
        .map(str::to_string)
        .collect();
    eprintln!("fill stress: {mb} MiB image, {WORKERS} workers, seed {seed}");
    let mut times = Vec::new();
    for mode in &modes {
        let img = mkfs(&MkfsOptions::new(4096, mb << 20)).expect("mkfs");
        let t0 = Instant::now();
        let models = if mode == "kernel" {
            // The reference: the same workload on the kernel's ext4.
            let m = match LoopMount::new(img.path(), false, "") {
                Ok(m) => m,
                Err(e) => {
                    skip(&format!("kernel reference: {e}"));
                    continue;
                }
            };
            let models = run_workers(Arc::new(Posix(m.path().to_path_buf())), seed);
            m.unmount().expect("unmount");
            models
        } else if mode == "api" {
            // The engine's warnings (a writeback that ran out of space says why) to
            // standard error, as the mount's server log has them.
            rext4_fuse::init_stderr_log();
            let fs = rext4::Fs::open_with(
                img.path(),
                rext4::FsOptions {
                    read_only: false,
                    ..rext4::FsOptions::default()
                },
            )
            .expect("open");
            let models = run_workers(Arc::new(Api(fs.clone())), seed);
            fs.close().expect("close");
            models
        } else {
            if let Some(why) = cannot_mount() {
                skip(&why);
                continue;
            }
            let opts: &[&str] = match mode.as_str() {
                "nowb" => &["nowriteback_cache"],
                "nouring" => &["nouring"],
                "kernelwindow" => &["bdi_max_ratio=0"],
                _ => &[],
            };
            let mut m = Mounted::new(img.path(), opts);
            let _w = Watchdog::new("fill stress", m.pid(), Duration::from_secs(1800));
            let models = run_workers(Arc::new(Posix(m.path().to_path_buf())), seed);
            assert!(m.unmount().success(), "{mode}: {}", m.stderr());
            models
        };
        let secs = t0.elapsed().as_secs_f64();
        eprintln!("  {mode}: full after {secs:.1} s");
        times.push((mode.clone(), secs));
        after(img.path(), &models, mode);
    }
    eprintln!("fill stress times: {times:?}");
}
