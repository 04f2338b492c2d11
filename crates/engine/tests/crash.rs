//! Crash sweep: workloads run on a recording device; from the recorded writes and
//! flushes, crash images are built at every flush point and with the writes since the
//! last flush lost or torn. Each image is recovered (rext4's replay on open; as root
//! also the kernel's; and e2fsck -fy), then `e2fsck -fn` must be clean and every file
//! whose fsync completed before the crash must hold exactly its fsynced content.
//!
//! Workloads: many small files written and fsynced; atomic replace (write temp, fsync,
//! rename over, fsync); deep trees with unlinks; large appends and truncates; files
//! with early commits (unflushed log writes, as the mount makes) between fsyncs;
//! batches of O_DIRECT writes in flight together (`crash_direct_batches`: overwrites in
//! place with no journal, which a crash may tear sector by sector, so each byte is
//! checked against the versions it may come from, and batches that extend the file);
//! four threads writing, rewriting and fsyncing at once (group commit); four threads running
//! random operations at once (`crash_random_ops`): creates, atomic replaces, appends,
//! truncates, overwrites in place, unlinks, renames within and between directories,
//! mkdir/rmdir, syncs, mostly fsynced but some not, in directories of their own and in
//! one they share, with files from empty to ~200 KiB; on an ea_inode image, two threads
//! setting, replacing and removing xattr values of up to 64 KiB (kept in inodes of
//! their own) and unlinking files that hold them (`crash_xattr_values`), each value
//! checked as a file is (keys `PATH#NAME`); on a casefold image, creates, renames and
//! unlinks through case variants in a casefolded htree directory (`crash_casefold`),
//! every file read back through a case variant of its name (the kernel here cannot
//! mount casefold images: rext4 and e2fsck recover those).
//!
//! The random workload's model ([`PathLog`]) keeps, per path, every state it went
//! through, when the change to it began and when an fsync or sync made it durable.
//! Another thread's commit can catch a change half made (a file truncated but not yet
//! rewritten), so after a crash a path must hold exactly its last durable state when
//! no later change of it had begun, either of them when the later changes were whole
//! (a rename of an fsynced file, an unlink), and is skipped only while a partial
//! change was in flight. Each sweep prints how many paths it checked; the random one
//! asserts it checked and read many.
//!
//! `REXT4_CRASH_VARIANTS` (default 3, what CI runs) lost/torn variants per flush point;
//! the long sweep (`REXT4_CRASH_VARIANTS=40`) builds ≥ 50,000 images. Each sweep asserts
//! the least number of images its workload must give (one per fsync/sync, plus the
//! variants after each but the last) and that every recoverer recovered some. The
//! random workload also reads `REXT4_CRASH_STEPS` (operations per thread, default 60),
//! `REXT4_CRASH_SEED` (the threads' operation seeds) and `REXT4_CRASH_MIN_IMAGES` (fail
//! when it built fewer images). `REXT4_CRASH_DUMP=dir` keeps a failed image and the
//! device log in `dir`.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{env_u64, Recorder};
use rext4::{Fs, FsOptions, OpenOptions};
use rext4_testkit::crash::{self, Event, Rng};
use rext4_testkit::{e2fsck_fn, e2fsck_fy, mkfs, skip, LoopMount, MkfsOptions, TempDir};

/// The fsynced history of one file: version `i` was being written from `start` on and
/// was durable (its fsync had completed) from `durable` on. After a crash at event
/// index `p`, the file holds the last durable version, or — if the next version's
/// write had started — either of the two. From `deleted_from` on it may be gone.
#[derive(Clone, Debug, Default)]
struct History {
    versions: Vec<(usize, usize, Vec<u8>)>,
    deleted_from: Option<usize>,
}

impl History {
    fn allowed(&self, p: usize) -> Option<(Vec<&Vec<u8>>, bool)> {
        let i = self.versions.iter().rposition(|v| v.1 <= p)?;
        let mut ok = vec![&self.versions[i].2];
        if let Some(next) = self.versions.get(i + 1) {
            if next.0 <= p {
                ok.push(&next.2);
            }
        }
        Some((ok, self.deleted_from.is_some_and(|d| p >= d)))
    }
}

/// One state of a path in a concurrent run: the change that made it began at event
/// `start` (the log's length before its first write) and was durable from `durable`
/// on (the log's length after the fsync or sync that covered it returned; `None`:
/// nothing covered it before the path changed again). `content` `None`: no file
/// there. `whole`: the change made the state in one step no commit can split (an
/// unlink; a rename of a file whose content was durable already).
#[derive(Clone, Debug)]
struct State {
    start: usize,
    durable: Option<usize>,
    content: Option<Arc<Vec<u8>>>,
    whole: bool,
}

/// Every state a path went through in a concurrent run, in order. Before its first
/// state the path had no file, durably.
#[derive(Clone, Debug, Default)]
struct PathLog {
    states: Vec<State>,
}

impl PathLog {
    /// What the path may hold after a crash whose image has every write before event
    /// `lo` and any of those before `hi`: the last state durable at `lo`, or, when
    /// later changes had begun before `hi`, any of them as long as each was whole.
    /// `None` when one was not: another thread's commit may have caught it half made,
    /// and the path is not checked at this point.
    fn allowed(&self, lo: usize, hi: usize) -> Option<Vec<Option<&[u8]>>> {
        let last = self
            .states
            .iter()
            .rposition(|s| s.durable.is_some_and(|d| d <= lo));
        let mut ok = vec![last.and_then(|i| self.states[i].content.as_deref().map(|c| &c[..]))];
        for s in &self.states[last.map_or(0, |i| i + 1)..] {
            if s.start >= hi {
                break;
            }
            if !s.whole {
                return None;
            }
            ok.push(s.content.as_deref().map(|c| &c[..]));
        }
        Some(ok)
    }

    fn describe(&self) -> String {
        let states: Vec<String> = self
            .states
            .iter()
            .map(|s| {
                format!(
                    "[from {} durable {:?}: {}{}]",
                    s.start,
                    s.durable,
                    s.content
                        .as_ref()
                        .map_or("absent".to_string(), |c| format!("{} bytes", c.len())),
                    if s.whole { ", whole" } else { "" }
                )
            })
            .collect();
        states.join(" ")
    }
}

/// One version of a file changed in place (`Run::torn`): its writes began at event
/// `start`, and it was durable from `durable` on (an fsync that covered it returned;
/// `None`: none had yet when the file changed again).
#[derive(Clone, Debug)]
struct Version {
    start: usize,
    durable: Option<usize>,
    content: Vec<u8>,
}

/// The versions whose bytes a file changed in place may show after a crash whose
/// image has every write before event `lo` and any of those before `hi`: the last one
/// durable at `lo` and every later one begun before `hi` (their writes may have landed
/// in part, torn sector by sector). `None` before the first was durable.
fn torn_allowed(versions: &[Version], lo: usize, hi: usize) -> Option<&[Version]> {
    let last = versions
        .iter()
        .rposition(|v| v.durable.is_some_and(|d| d <= lo))?;
    let begun = versions[last + 1..]
        .iter()
        .take_while(|v| v.start < hi)
        .count();
    Some(&versions[last..=last + begun])
}

/// Why `content` is none of the mixtures `ok` allows (its size is one of theirs and
/// each byte is what one of them holds there), if it is not.
fn torn_mismatch(ok: &[Version], content: &[u8]) -> Option<String> {
    let sizes: Vec<usize> = ok.iter().map(|v| v.content.len()).collect();
    if !sizes.contains(&content.len()) {
        return Some(format!(
            "{} bytes, none of the sizes {sizes:?}",
            content.len()
        ));
    }
    let bad =
        (0..content.len()).find(|&i| !ok.iter().any(|v| v.content.get(i) == Some(&content[i])))?;
    let held: Vec<Option<&u8>> = ok.iter().map(|v| v.content.get(bad)).collect();
    Some(format!(
        "byte {bad} is {:#04x}; the versions it may come from ({} of them, the first \
         durable) hold {held:?} there",
        content[bad],
        ok.len()
    ))
}

/// The boot the workloads write in, and the one recovery runs in (after a power loss
/// the machine restarted).
const WRITER_BOOT: [u8; 16] = [0xB0; 16];
const RESTARTED_BOOT: [u8; 16] = [0xB1; 16];

struct Run {
    base: Vec<u8>,
    events: Vec<Event>,
    files: BTreeMap<String, History>,
    /// The paths of a concurrent workload, whose changes other threads' commits may
    /// catch half made.
    logs: BTreeMap<String, PathLog>,
    /// Files changed in place by writes a crash may tear (direct overwrites,
    /// `direct_batches`): after a crash each byte holds what one of the versions
    /// `torn_allowed` gives holds there.
    torn: BTreeMap<String, Vec<Version>>,
    /// fsync and sync calls that returned: each flushed the device at least once.
    syncs: usize,
}

/// The most address space this test process may take. The sweeps need well under
/// 1 GiB; CI once saw the binary reach 24 GB and the OOM killer end it without a word.
/// Under the cap the allocation that would pass it fails instead, and Rust's handler
/// prints its size before it aborts.
const ADDRESS_SPACE_CAP: u64 = 12 << 30;

fn cap_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit fills the struct it is given; setrlimit reads it.
        let r = unsafe {
            if libc::getrlimit(libc::RLIMIT_AS, &mut lim) != 0 {
                -1
            } else {
                lim.rlim_cur = lim.rlim_cur.min(ADDRESS_SPACE_CAP);
                libc::setrlimit(libc::RLIMIT_AS, &lim)
            }
        };
        if r != 0 {
            eprintln!(
                "crash: could not cap the address space: {}",
                std::io::Error::last_os_error()
            );
        }
    });
}

fn rw(dev: Arc<Recorder>) -> Fs {
    cap_memory();
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    Fs::open_device(dev, opts).expect("open rw")
}

fn base_image() -> Vec<u8> {
    base_image_of(false)
}

/// The image a sweep starts from: mke2fs's ext4 at 1 KiB blocks, or (`ext3`) its
/// ext3 — block-mapped files, a journal without checksum features (8-byte tags), no
/// flex_bg — so block maps are swept too.
fn base_image_of(ext3: bool) -> Vec<u8> {
    let mut opts = MkfsOptions::new(1024, 8 << 20);
    if ext3 {
        opts = opts.arg("-t").arg("ext3");
    }
    let img = mkfs(&opts).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

fn small_files() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    fs.create_dir("/s").expect("mkdir");
    for i in 0..60u64 {
        let p = format!("/s/f{i}");
        let d = data(i, 100 + (i as usize * 37) % 3000);
        let start = dev.len();
        let f = fs.create(&p).expect("create");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync");
        syncs += 1;
        files.insert(
            p,
            History {
                versions: vec![(start, dev.len(), d)],
                deleted_from: None,
            },
        );
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files,
    }
}

/// Files written with early commits between them (as the mount makes every moment):
/// unflushed transactions in the log, which a power loss may tear; every third file
/// fsynced. The boot that wrote them is `WRITER_BOOT`; recovery acts as after a
/// restart (`recover`), where only what was committed counts.
fn early_commits() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        boot_id: Some(WRITER_BOOT),
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts).expect("open rw");
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    fs.create_dir("/e").expect("mkdir");
    for i in 0..30u64 {
        let p = format!("/e/f{i}");
        let d = data(i + 500, 200 + (i as usize * 53) % 5000);
        let start = dev.len();
        let f = fs.create(&p).expect("create");
        f.write_all_at(&d, 0).expect("write");
        if i % 3 == 2 {
            f.sync_all().expect("fsync");
            syncs += 1;
            files.insert(
                p,
                History {
                    versions: vec![(start, dev.len(), d)],
                    deleted_from: None,
                },
            );
        } else {
            fs.early_commit().expect("early commit");
        }
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files,
    }
}

/// Four threads write and fsync files of their own at once (and replace every third
/// one by rename), so fsyncs share commits (group commit): an fsync that found its
/// changes committed by another thread's commit returned without one, and its file
/// must be there all the same. (A rewrite in place would not do here: other threads'
/// commits may catch it truncated, which is no fsynced version.)
fn concurrent_fsyncs() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    fs.create_dir("/c").expect("mkdir");
    fs.sync().expect("sync");
    let before = fs.journal_stats().commits;
    let histories: Vec<BTreeMap<String, History>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (fs, dev) = (fs.clone(), dev.clone());
                sc.spawn(move || {
                    let mut files: BTreeMap<String, History> = BTreeMap::new();
                    for i in 0..15u64 {
                        let p = format!("/c/t{t}-f{i}");
                        let d = data(t * 100 + i, 300 + (i as usize * 211) % 4000);
                        let start = dev.len();
                        let f = fs.create(&p).expect("create");
                        f.write_all_at(&d, 0).expect("write");
                        f.sync_all().expect("fsync");
                        files
                            .entry(p)
                            .or_default()
                            .versions
                            .push((start, dev.len(), d));
                        if i % 3 == 2 {
                            // Replace an earlier file of this thread atomically: a new
                            // version fsynced under a temporary name, renamed over it,
                            // and the rename made durable by an fsync of the file.
                            let q = format!("/c/t{t}-f{}", i - 2);
                            let tmp = format!("/c/t{t}-tmp");
                            let d2 = data(t * 100 + i + 50, 100 + (i as usize * 97) % 3000);
                            let f = fs.create(&tmp).expect("create tmp");
                            f.write_all_at(&d2, 0).expect("write tmp");
                            f.sync_all().expect("fsync tmp");
                            let start = dev.len();
                            fs.rename(&tmp, &q).expect("rename");
                            f.sync_all().expect("fsync");
                            files
                                .entry(q)
                                .or_default()
                                .versions
                                .push((start, dev.len(), d2));
                        }
                    }
                    files
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    // The sweep needs one image per flush that ended a commit; fsyncs that shared a
    // commit made no flush of their own.
    let syncs = (fs.journal_stats().commits - before) as usize;
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files: histories.into_iter().flatten().collect(),
    }
}

/// How many bytes of files one `random_ops` thread keeps at most (four of them share
/// the 8 MiB image with its 1 MiB journal).
const WORKER_BYTES: usize = 700 << 10;
/// How many files one `random_ops` thread keeps at most.
const WORKER_FILES: usize = 40;

/// One thread of `random_ops`: what its files hold now, its directories, and every
/// state of the paths it used. Its names are its own (`/r/tN/...`, `/r/shared/tN-...`),
/// so no other thread changes its paths.
struct Worker {
    t: u64,
    fs: Fs,
    dev: Arc<Recorder>,
    rng: Rng,
    /// Path → content, as this thread left it.
    files: BTreeMap<String, Vec<u8>>,
    /// Directories made by this thread below `/r/tN` (removable when empty).
    subdirs: Vec<String>,
    logs: BTreeMap<String, PathLog>,
    /// Paths whose last state no fsync or sync covered yet → whether that state is a
    /// change of names only (an unlink, a rename of a durable file), which any later
    /// fsync makes durable (an fsync commits every change made before it); a change of
    /// data waits for an fsync of that file or a sync.
    pending: BTreeMap<String, bool>,
    /// Path → the older names of the file there (path, index of the state that took
    /// the name away), while that rename may not be committed: a crash may still show
    /// the file under an old name, with whatever was changed in place since.
    aliases: BTreeMap<String, Vec<(String, usize)>>,
    names: u64,
    /// Sizes mostly around what an inode holds inline (the inline_data sweep).
    small: bool,
}

impl Worker {
    fn new(t: u64, seed: u64, fs: Fs, dev: Arc<Recorder>) -> Worker {
        Worker {
            t,
            fs,
            dev,
            rng: Rng((seed ^ (t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1),
            files: BTreeMap::new(),
            subdirs: Vec::new(),
            logs: BTreeMap::new(),
            pending: BTreeMap::new(),
            aliases: BTreeMap::new(),
            names: 0,
            small: false,
        }
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.rng.below(100) < percent
    }

    /// A size from 0 to ~200 KiB, mostly small (with `small`, half of them at most
    /// 200 bytes: inline data and its limits).
    fn size(&mut self) -> usize {
        if self.small && self.chance(50) {
            return self.rng.below(201) as usize;
        }
        match self.rng.below(100) {
            0..=59 => self.rng.below(4097) as usize,
            60..=89 => self.rng.below(20 << 10) as usize,
            _ => (20 << 10) + self.rng.below(180 << 10) as usize,
        }
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        data(self.rng.next_u64(), len)
    }

    /// A new name in one of this thread's directories or in the shared one.
    fn new_path(&mut self) -> String {
        self.names += 1;
        let (t, n) = (self.t, self.names);
        match self.rng.below(4) {
            0 => format!("/r/shared/t{t}-f{n}"),
            1 if !self.subdirs.is_empty() => {
                let d = &self.subdirs[self.rng.below(self.subdirs.len() as u64) as usize];
                format!("{d}/f{n}")
            }
            _ => format!("/r/t{t}/f{n}"),
        }
    }

    fn pick_file(&mut self) -> Option<String> {
        let n = self.files.len() as u64;
        (n > 0).then(|| {
            let i = self.rng.below(n) as usize;
            self.files.keys().nth(i).cloned().expect("file")
        })
    }

    fn live_bytes(&self) -> usize {
        self.files.values().map(Vec::len).sum()
    }

    /// Record that a change of `path` to `content` began at event `start`.
    fn begin(&mut self, path: &str, start: usize, content: Option<Vec<u8>>, whole: bool) {
        let names_only = whole;
        match &content {
            Some(c) => {
                self.files.insert(path.to_string(), c.clone());
            }
            None => {
                self.files.remove(path);
            }
        }
        self.logs
            .entry(path.to_string())
            .or_default()
            .states
            .push(State {
                start,
                durable: None,
                content: content.map(Arc::new),
                whole,
            });
        self.pending.insert(path.to_string(), names_only);
    }

    /// The file at `path` is about to change in place: under an old name whose rename
    /// is not durable yet it may be caught half changed, so that rename is no longer
    /// whole.
    fn changing_in_place(&mut self, path: &str) {
        let Some(old) = self.aliases.get_mut(path) else {
            return;
        };
        let logs = &mut self.logs;
        old.retain(|(o, i)| {
            let s = &mut logs.get_mut(o).expect("old name").states[*i];
            s.whole &= s.durable.is_some();
            s.durable.is_none()
        });
    }

    /// `from` was renamed to `to`: the file's old names go with it, `from` among them.
    fn renamed(&mut self, from: &str, to: &str) {
        let mut old = self.aliases.remove(from).unwrap_or_default();
        old.push((from.to_string(), self.logs[from].states.len() - 1));
        self.aliases.insert(to.to_string(), old);
    }

    /// Mark durable now the states `covered` says an fsync or sync covered.
    fn covered(&mut self, covered: impl Fn(&str, bool) -> bool) {
        let now = self.dev.len();
        let logs = &mut self.logs;
        self.pending.retain(|path, names_only| {
            if !covered(path, *names_only) {
                return true;
            }
            let s = logs
                .get_mut(path)
                .and_then(|l| l.states.last_mut())
                .expect("state");
            s.durable = Some(now);
            false
        });
    }

    /// fsync of the file at `path` returned: its state and every change of names made
    /// before are durable.
    fn fsynced(&mut self, path: &str) {
        self.covered(|p, names_only| names_only || p == path);
    }

    /// An fsync of a directory returned: the changes of names made before are durable.
    fn names_synced(&mut self) {
        self.covered(|_, names_only| names_only);
    }

    fn synced(&mut self) {
        self.covered(|_, _| true);
    }

    fn open_rw(&self, path: &str) -> rext4::File {
        rext4::OpenOptions::new()
            .write(true)
            .open(&self.fs, path)
            .unwrap_or_else(|e| panic!("t{}: open {path}: {e}", self.t))
    }

    /// fsync `f` (at `path`) unless this step goes without one.
    fn maybe_fsync(&mut self, f: &rext4::File, path: &str) {
        if self.chance(88) {
            f.sync_all().expect("fsync");
            self.fsynced(path);
        }
    }

    fn create(&mut self) {
        let path = self.new_path();
        let len = self.size();
        let d = self.bytes(len);
        let start = self.dev.len();
        let f = self.fs.create(&path).expect("create");
        f.write_all_at(&d, 0).expect("write");
        self.begin(&path, start, Some(d), false);
        self.maybe_fsync(&f, &path);
    }

    /// Atomic replace: the new content fsynced under a temporary name in the same
    /// directory, renamed over the file, the rename fsynced (mostly).
    fn replace(&mut self, path: String) {
        let dir = &path[..path.rfind('/').expect("dir")];
        let tmp = format!("{dir}/t{}.tmp", self.t);
        let len = self.size();
        let d = self.bytes(len);
        let start = self.dev.len();
        let f = self.fs.create(&tmp).expect("create tmp");
        f.write_all_at(&d, 0).expect("write tmp");
        self.begin(&tmp, start, Some(d.clone()), false);
        f.sync_all().expect("fsync tmp");
        self.fsynced(&tmp);
        let start = self.dev.len();
        self.fs.rename(&tmp, &path).expect("rename over");
        self.begin(&tmp, start, None, true);
        self.begin(&path, start, Some(d), true);
        self.renamed(&tmp, &path);
        self.maybe_fsync(&f, &path);
    }

    fn append(&mut self, path: String) {
        let len = self.size() / 2;
        let add = self.bytes(len);
        let mut c = self.files[&path].clone();
        self.changing_in_place(&path);
        let start = self.dev.len();
        let f = self.open_rw(&path);
        f.write_all_at(&add, c.len() as u64).expect("append");
        c.extend_from_slice(&add);
        self.begin(&path, start, Some(c), false);
        self.maybe_fsync(&f, &path);
    }

    fn truncate(&mut self, path: String) {
        let mut c = self.files[&path].clone();
        let len = if self.chance(50) {
            self.rng.below(c.len() as u64 + 1) as usize
        } else {
            c.len() + self.rng.below(30 << 10) as usize
        };
        self.changing_in_place(&path);
        let start = self.dev.len();
        let f = self.open_rw(&path);
        f.set_len(len as u64).expect("truncate");
        c.resize(len, 0);
        self.begin(&path, start, Some(c), false);
        self.maybe_fsync(&f, &path);
    }

    fn overwrite(&mut self, path: String) {
        let mut c = self.files[&path].clone();
        let off = self.rng.below(c.len() as u64 + 1) as usize;
        let len = 1 + self
            .rng
            .below(((c.len() - off) as u64 + 2048).min(30 << 10)) as usize;
        let d = self.bytes(len);
        self.changing_in_place(&path);
        let start = self.dev.len();
        let f = self.open_rw(&path);
        f.write_all_at(&d, off as u64).expect("overwrite");
        if c.len() < off + len {
            c.resize(off + len, 0);
        }
        c[off..off + len].copy_from_slice(&d);
        self.begin(&path, start, Some(c), false);
        self.maybe_fsync(&f, &path);
    }

    /// Unlink, then fsync the directory, sync, or neither (a later fsync makes it
    /// durable).
    fn unlink(&mut self, path: String) {
        let start = self.dev.len();
        self.fs.remove_file(&path).expect("unlink");
        self.begin(&path, start, None, true);
        self.aliases.remove(&path);
        match self.rng.below(10) {
            0..=3 => {
                let dir = &path[..path.rfind('/').expect("dir")];
                let ino = self.fs.metadata(dir).expect("stat dir").ino;
                self.fs
                    .open_ino(ino)
                    .expect("open dir")
                    .sync_all()
                    .expect("fsync dir");
                self.names_synced();
            }
            4..=6 => {
                self.fs.sync().expect("sync");
                self.synced();
            }
            _ => {}
        }
    }

    /// Rename a file to a new name or over another of this thread's files, in any of
    /// its directories, then fsync it (mostly).
    fn rename(&mut self, from: String) {
        let to = match self.pick_file() {
            Some(q) if q != from && self.chance(40) => q,
            _ => self.new_path(),
        };
        // The file's content was durable before: the rename is a change of names only,
        // and the target holds the old state or the new one.
        let durable = self.pending.get(&from).is_none_or(|&names_only| names_only);
        let c = self.files[&from].clone();
        let start = self.dev.len();
        self.fs.rename(&from, &to).expect("rename");
        self.begin(&from, start, None, true);
        self.begin(&to, start, Some(c), durable);
        self.renamed(&from, &to);
        if self.chance(70) {
            let f = self.fs.open_file(&to).expect("open renamed");
            f.sync_all().expect("fsync renamed");
            self.fsynced(&to);
        }
    }

    fn mkdir(&mut self) {
        self.names += 1;
        let parent = if self.subdirs.is_empty() || self.chance(60) {
            format!("/r/t{}", self.t)
        } else {
            self.subdirs[self.rng.below(self.subdirs.len() as u64) as usize].clone()
        };
        let d = format!("{parent}/d{}", self.names);
        self.fs.create_dir(&d).expect("mkdir");
        self.subdirs.push(d);
    }

    fn rmdir(&mut self) {
        let empty: Vec<usize> = (0..self.subdirs.len())
            .filter(|&i| {
                let prefix = format!("{}/", self.subdirs[i]);
                !self.files.keys().any(|k| k.starts_with(&prefix))
                    && !self.subdirs.iter().any(|k| k.starts_with(&prefix))
            })
            .collect();
        if let Some(&i) = empty.get(self.rng.below(empty.len() as u64) as usize) {
            let d = self.subdirs.swap_remove(i);
            self.fs.remove_dir(&d).expect("rmdir");
        }
    }

    fn step(&mut self) {
        let full = self.live_bytes() > WORKER_BYTES || self.files.len() >= WORKER_FILES;
        let Some(path) = self.pick_file() else {
            return self.create();
        };
        if full {
            return self.unlink(path);
        }
        match self.rng.below(100) {
            0..=21 => self.create(),
            22..=33 => self.replace(path),
            34..=45 => self.append(path),
            46..=53 => self.truncate(path),
            54..=64 => self.overwrite(path),
            65..=74 => self.unlink(path),
            75..=84 => self.rename(path),
            85..=89 => self.mkdir(),
            90..=94 => self.rmdir(),
            _ => {
                self.fs.sync().expect("sync");
                self.synced();
            }
        }
    }
}

/// Four threads run random operations at once on one filesystem (see the module
/// note), `REXT4_CRASH_STEPS` each.
fn random_ops(base: Vec<u8>, default_steps: u64) -> Run {
    random_ops_sized(base, default_steps, false)
}

/// [`random_ops`], with mostly tiny files when `small`.
fn random_ops_sized(base: Vec<u8>, default_steps: u64, small: bool) -> Run {
    let steps = env_u64("REXT4_CRASH_STEPS", default_steps);
    let seed = env_u64("REXT4_CRASH_SEED", 0x5_EED0_F0B5);
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    for d in ["/r", "/r/shared", "/r/t0", "/r/t1", "/r/t2", "/r/t3"] {
        fs.create_dir(d).expect("mkdir");
    }
    fs.sync().expect("sync");
    let before = fs.journal_stats().commits;
    let logs: Vec<BTreeMap<String, PathLog>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let mut w = Worker::new(t, seed, fs.clone(), dev.clone());
                w.small = small;
                sc.spawn(move || {
                    for _ in 0..steps {
                        w.step();
                    }
                    w.logs
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let syncs = (fs.journal_stats().commits - before) as usize;
    fs.close().expect("close");
    Run {
        base,
        logs: logs.into_iter().flatten().collect(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files: BTreeMap::new(),
    }
}

fn atomic_replace() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut h = History::default();
    let mut syncs = 0;
    for v in 0..40u64 {
        let d = data(1000 + v, 500 + (v as usize * 91) % 2500);
        let f = fs.create("/config.tmp").expect("create tmp");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync tmp");
        let start = dev.len();
        fs.rename("/config.tmp", "/config").expect("rename");
        fs.sync().expect("fsync dir");
        syncs += 2;
        h.versions.push((start, dev.len(), d));
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files: BTreeMap::from([("/config".to_string(), h)]),
    }
}

fn deep_trees() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    for t in 0..6u64 {
        let start = dev.len();
        let mut p = format!("/t{t}");
        fs.create_dir(&p).expect("mkdir");
        for depth in 0..8 {
            p.push_str(&format!("/d{depth}"));
            fs.create_dir(&p).expect("mkdir");
            fs.write(format!("{p}/leaf"), data(t * 100 + depth, 200))
                .expect("write");
        }
        fs.sync().expect("sync");
        syncs += 1;
        let durable = dev.len();
        let mut p = format!("/t{t}");
        for depth in 0..8 {
            p.push_str(&format!("/d{depth}"));
            let h = History {
                versions: vec![(start, durable, data(t * 100 + depth, 200))],
                deleted_from: None,
            };
            files.insert(format!("{p}/leaf"), h);
        }
        if t % 2 == 1 {
            let from = dev.len();
            fs.remove_dir_all(format!("/t{t}/d0/d1")).expect("rm -r");
            fs.sync().expect("sync");
            syncs += 1;
            for (k, h) in files.iter_mut() {
                if k.starts_with(&format!("/t{t}/d0/d1/")) {
                    h.deleted_from = Some(from);
                }
            }
        }
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files,
    }
}

fn appends_and_truncates(base: Vec<u8>) -> Run {
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let f = fs.create("/log").expect("create");
    let mut content: Vec<u8> = Vec::new();
    let mut h = History::default();
    let mut syncs = 0;
    for i in 0..40u64 {
        let start = dev.len();
        if i % 7 == 6 {
            let n = content.len() / 2;
            f.set_len(n as u64).expect("truncate");
            content.truncate(n);
        } else {
            let d = data(5000 + i, 3000 + (i as usize * 517) % 40_000);
            f.write_all_at(&d, content.len() as u64).expect("append");
            content.extend_from_slice(&d);
        }
        f.sync_all().expect("fsync");
        syncs += 1;
        h.versions.push((start, dev.len(), content.clone()));
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files: BTreeMap::from([("/log".to_string(), h)]),
    }
}

/// Batches of O_DIRECT writes in flight together into one file (a queue depth, as
/// io_submit(2) or the mount's io_uring gives one: `File::write_all_at_batch`). Mostly
/// overwrites of written blocks, which go to the device in one batch under the shared
/// lock and no journal (a crash may tear any of them, sector by sector); every fifth
/// batch also extends the file and every seventh writes past its end (a gap of zeros):
/// those batches fall back to one write after the other, allocating. Every fourth
/// batch is not fsynced (the next fsync covers it).
fn direct_batches() -> Run {
    const SLOT: u64 = 8 << 10;
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut content = data(7000, 48 << 10);
    let start = dev.len();
    let f = fs.create("/d").expect("create");
    f.write_all_at(&content, 0).expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    let mut versions = vec![Version {
        start,
        durable: Some(dev.len()),
        content: content.clone(),
    }];
    let mut syncs = 1;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .direct(true)
        .open(&fs, "/d")
        .expect("open direct");
    let before = fs.io_stats();
    let mut rng = Rng(0xD1EC_7BA7);
    let mut batched = 0;
    for i in 0..40u64 {
        // Two to five overwrites, each inside an 8 KiB slot of its own (so they never
        // overlap), 512-byte aligned as O_DIRECT asks, of 512 bytes to 4 KiB.
        let slots = content.len() as u64 / SLOT;
        let mut picked: Vec<u64> = Vec::new();
        while picked.len() < 2 + rng.below(4) as usize {
            let s = rng.below(slots);
            if !picked.contains(&s) {
                picked.push(s);
            }
        }
        let mut writes: Vec<(u64, Vec<u8>)> = picked
            .iter()
            .map(|&s| {
                let len = 512 * (1 + rng.below(8)) as usize;
                (s * SLOT + 512 * rng.below(8), data(rng.next_u64(), len))
            })
            .collect();
        let size = content.len() as u64;
        if i % 5 == 4 {
            writes.push((
                size,
                data(rng.next_u64(), 512 * (1 + rng.below(6)) as usize),
            ));
        } else if i % 7 == 6 {
            writes.push((size + 512 * (1 + rng.below(4)), data(rng.next_u64(), 1024)));
        } else {
            batched += 1;
        }
        for (off, d) in &writes {
            let (o, end) = (*off as usize, *off as usize + d.len());
            if content.len() < end {
                content.resize(end, 0);
            }
            content[o..end].copy_from_slice(d);
        }
        let start = dev.len();
        let batch: Vec<(&[u8], u64)> = writes.iter().map(|(o, d)| (&d[..], *o)).collect();
        f.write_all_at_batch(&batch)
            .expect("batch of direct writes");
        versions.push(Version {
            start,
            durable: None,
            content: content.clone(),
        });
        if i % 4 != 3 || i == 39 {
            f.sync_all().expect("fsync");
            syncs += 1;
            let now = dev.len();
            for v in versions
                .iter_mut()
                .rev()
                .take_while(|v| v.durable.is_none())
            {
                v.durable = Some(now);
            }
        }
    }
    // The batches of pure overwrites went to the device under the shared lock, each
    // write counted; the others did not.
    let shared = fs.io_stats().direct_shared - before.direct_shared;
    assert!(
        shared >= 2 * batched,
        "direct-batches: {shared} writes took the shared lock; {batched} batches of at \
         least two pure overwrites should have"
    );
    assert_eq!(
        fs.read("/d").expect("read back"),
        content,
        "direct-batches: the file"
    );
    drop(f);
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::from([("/d".to_string(), versions)]),
        events: dev.take(),
        syncs,
        files: BTreeMap::new(),
    }
}

/// The image of the xattr sweep: 16 MiB, 4 KiB blocks (values from a few bytes to a
/// block's worth go in the inode or the xattr block, larger ones to inodes of their
/// own), with ea_inode.
fn ea_base_image() -> Vec<u8> {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20).arg("-O").arg("ea_inode")).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

/// The casefold sweep's image: 1 KiB blocks (the directory becomes a deep htree soon),
/// `-O casefold`.
fn casefold_base_image() -> Vec<u8> {
    let img = mkfs(&MkfsOptions::new(1024, 8 << 20).arg("-O").arg("casefold")).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

/// A name as created and a case variant of it (what the checks read it by).
fn casefold_names(i: u64) -> (String, String) {
    const FORMS: &[(&str, &str)] = &[
        ("Größe-Straße", "GRÖSSE-STRASSE"),
        ("ΟΔΟΣ-οδος", "οδοσ-ΟΔΟΣ"),
        ("Привет-Мир", "пРИВЕТ-мИР"),
        ("caf\u{e9}-\u{fb01}le", "CAFE\u{301}-FILE"),
        ("zero\u{200b}width", "ZEROWIDTH"),
    ];
    let (a, b) = FORMS[(i % FORMS.len() as u64) as usize];
    (format!("{a}-{i:04}-name"), format!("{b}-{i:04}-NAME"))
}

/// Files created (each fsynced), renamed and unlinked through case variants of their
/// names in a casefolded directory, each rename and unlink followed by a sync;
/// `REXT4_CRASH_STEPS` creates (default 60). Histories are keyed by the variant.
fn casefold_htree() -> Run {
    let steps = env_u64("REXT4_CRASH_STEPS", 60);
    let base = casefold_base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    fs.create_dir("/cf").expect("mkdir");
    let ino = fs.resolve(b"/cf", true).expect("cf");
    let fl = fs.flags_ino(ino).expect("flags");
    fs.set_flags_ino(ino, fl | rext4::format::inode::flags::CASEFOLD)
        .expect("chattr +F");
    fs.sync().expect("sync");
    let mut syncs = 1;
    let mut files: BTreeMap<String, History> = BTreeMap::new();
    let mut live: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..steps {
        let (created, variant) = casefold_names(i);
        let d = data(7000 + i, 50 + (i as usize * 53) % 1500);
        let start = dev.len();
        let f = fs.create(format!("/cf/{created}")).expect("create");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync");
        syncs += 1;
        let key = format!("/cf/{variant}");
        files.insert(
            key.clone(),
            History {
                versions: vec![(start, dev.len(), d.clone())],
                deleted_from: None,
            },
        );
        live.push((key, d));
        if i % 5 == 4 && live.len() > 3 {
            // Rename an older file through its variant to a new name.
            let (from, d) = live.remove((i as usize * 7) % live.len());
            let to_created = format!("/cf/Umbenannt-Ä-{i:04}");
            let to_variant = format!("/cf/umbenannt-ä-{i:04}");
            let start = dev.len();
            fs.rename(&from, &to_created).expect("rename by variant");
            fs.sync().expect("sync");
            syncs += 1;
            if let Some(h) = files.get_mut(&from) {
                h.deleted_from = Some(start);
            }
            files.insert(
                to_variant.clone(),
                History {
                    versions: vec![(start, dev.len(), d.clone())],
                    deleted_from: None,
                },
            );
            live.push((to_variant, d));
        }
        if i % 7 == 6 && live.len() > 3 {
            let (gone, _) = live.remove((i as usize * 3) % live.len());
            let start = dev.len();
            fs.remove_file(&gone).expect("unlink by variant");
            fs.sync().expect("sync");
            syncs += 1;
            if let Some(h) = files.get_mut(&gone) {
                h.deleted_from = Some(start);
            }
        }
    }
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files,
    }
}

/// Two threads, each on files of its own in `/x`, set xattr values (small ones in the
/// inode, 1-3.5 KiB ones in the block or an inode of their own, 4-64 KiB ones in inodes
/// of their own), replace and remove them, unlink files holding them and make new
/// ones, fsyncing every change; `REXT4_CRASH_STEPS` changes per thread (default 30).
/// Every value (`PATH#NAME`) and file has a history of its own.
fn xattr_values() -> Run {
    let steps = env_u64("REXT4_CRASH_STEPS", 30);
    let base = ea_base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    fs.create_dir("/x").expect("mkdir");
    fs.sync().expect("sync");
    let before = fs.journal_stats().commits;
    let histories: Vec<BTreeMap<String, History>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2u64)
            .map(|t| {
                let (fs, dev) = (fs.clone(), dev.clone());
                sc.spawn(move || xattr_worker(t, &fs, &dev, steps))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    // As in `concurrent_fsyncs`: one image per flush that ended a commit.
    let syncs = (fs.journal_stats().commits - before) as usize;
    fs.close().expect("close");
    Run {
        base,
        logs: BTreeMap::new(),
        torn: BTreeMap::new(),
        events: dev.take(),
        syncs,
        files: histories.into_iter().flatten().collect(),
    }
}

fn xattr_worker(t: u64, fs: &Fs, dev: &Recorder, steps: u64) -> BTreeMap<String, History> {
    let mut rng = Rng((t + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut files: BTreeMap<String, History> = BTreeMap::new();
    // This thread's files and the names of the values each holds now.
    let mut live: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let (mut nfiles, mut nnames) = (0u64, 0u64);
    let mut done = 0;
    while done < steps {
        if live.len() < 2 || (live.len() < 4 && rng.below(8) == 0) {
            nfiles += 1;
            let p = format!("/x/t{t}-f{nfiles}");
            let d = data(rng.next_u64(), rng.below(3000) as usize);
            let start = dev.len();
            let f = fs.create(&p).expect("create");
            f.write_all_at(&d, 0).expect("write");
            f.sync_all().expect("fsync");
            files
                .entry(p.clone())
                .or_default()
                .versions
                .push((start, dev.len(), d));
            live.insert(p, Vec::new());
            continue;
        }
        done += 1;
        let i = rng.below(live.len() as u64) as usize;
        let p = live.keys().nth(i).cloned().expect("file");
        let start = dev.len();
        let op = rng.below(100);
        if op >= 90 {
            fs.remove_file(&p).expect("unlink");

            for (k, h) in files.iter_mut() {
                if k == &p || k.starts_with(&format!("{p}{XATTR_KEY}")) {
                    // (A value removed before keeps the first point it may be gone.)
                    h.deleted_from.get_or_insert(start);
                }
            }
            live.remove(&p);
            continue;
        }
        let names = live.get_mut(&p).expect("names");
        match op {
            0..=69 => {
                let name = if names.is_empty() || (names.len() < 4 && rng.below(2) == 0) {
                    nnames += 1;
                    let n = format!(
                        "{}.v{nnames}",
                        if rng.below(4) == 0 { "trusted" } else { "user" }
                    );
                    names.push(n.clone());
                    n
                } else {
                    names[rng.below(names.len() as u64) as usize].clone()
                };
                let len = match rng.below(100) {
                    0..=29 => 1 + rng.below(400),
                    30..=54 => 1000 + rng.below(2600),
                    _ => 4041 + rng.below(65536 - 4041 + 1),
                } as usize;
                let v = data(rng.next_u64(), len);
                let ino = fs.resolve(p.as_bytes(), false).expect("resolve");
                fs.set_xattr_ino(ino, name.as_bytes(), &v, rext4::XattrFlags::default())
                    .unwrap_or_else(|e| panic!("set {p} {name} ({len} bytes): {e}"));
                fs.open_file(&p).expect("open").sync_all().expect("fsync");
                files
                    .entry(format!("{p}{XATTR_KEY}{name}"))
                    .or_default()
                    .versions
                    .push((start, dev.len(), v));
            }
            _ if !names.is_empty() => {
                let name = names.remove(rng.below(names.len() as u64) as usize);
                let ino = fs.resolve(p.as_bytes(), false).expect("resolve");
                fs.remove_xattr_ino(ino, name.as_bytes())
                    .expect("removexattr");
                fs.open_file(&p).expect("open").sync_all().expect("fsync");

                files
                    .get_mut(&format!("{p}{XATTR_KEY}{name}"))
                    .expect("history")
                    .deleted_from = Some(start);
            }
            _ => {}
        }
    }
    files
}

/// Recover an image file the way `how` says; returns a description of a failure.
fn recover(path: &std::path::Path, how: &str) -> Result<(), String> {
    match how {
        "rext4" => {
            // A crash image is what a power loss leaves: the machine restarted, so
            // early commits (written without a flush, in `WRITER_BOOT`) do not count.
            let opts = FsOptions {
                read_only: false,
                commit_secs: 0,
                boot_id: Some(RESTARTED_BOOT),
                ..FsOptions::default()
            };
            let fs = Fs::open_with(path, opts).map_err(|e| format!("rext4 open: {e}"))?;
            fs.close().map_err(|e| format!("rext4 close: {e}"))
        }
        "e2fsck" => {
            let r = e2fsck_fy(path);
            // 0 or 1 (fixed: the journal was replayed) are fine; more is a failure.
            if r.exit_code > 1 {
                return Err(format!("e2fsck -fy exit {}:\n{}", r.exit_code, r.output));
            }
            Ok(())
        }
        "kernel" => {
            let m = LoopMount::new(path, false, "")?;
            m.unmount()
        }
        _ => unreachable!(),
    }
}

/// What the checks of one image or sweep covered.
#[derive(Clone, Copy, Debug, Default)]
struct Checked {
    /// Paths compared with what they may hold.
    paths: usize,
    /// Of those, files read whole and found right.
    files: usize,
    /// Paths of a concurrent workload skipped: a partial change was in flight.
    skipped: usize,
}

impl std::ops::AddAssign for Checked {
    fn add_assign(&mut self, o: Checked) {
        self.paths += o.paths;
        self.files += o.files;
        self.skipped += o.skipped;
    }
}

/// No workload here writes a file larger than this; a recovered file that claims more
/// is wrong, and reading it whole would take the machine's memory.
const MOST_BYTES: u64 = 16 << 20;

/// A key `PATH#NAME` of `Run::files` names xattr NAME of the file at PATH: its value
/// is checked as a file's content, an absent one is `NotFound`.
const XATTR_KEY: char = '#';

/// Read `file` whole after recovery, failing on a size no workload wrote.
fn read_checked(fs: &Fs, file: &str, label: &str) -> rext4::Result<Vec<u8>> {
    if let Some((path, name)) = file.split_once(XATTR_KEY) {
        let ino = fs.resolve(path.as_bytes(), false)?;
        return fs
            .get_xattr_ino(ino, name.as_bytes())?
            .ok_or(rext4::Error::NotFound);
    }
    let len = fs.metadata(file)?.len();
    assert!(
        len <= MOST_BYTES,
        "{label}: {file} claims {len} bytes after recovery; no workload wrote more than \
         {MOST_BYTES}"
    );
    fs.read(file)
}

/// Check one crash image (written to `path`) against the histories: the image has
/// every write before event `lo` and some of those before `hi`.
fn check(path: &std::path::Path, run: &Run, lo: usize, hi: usize, label: &str) -> Checked {
    let fsck = e2fsck_fn(path);
    assert!(
        fsck.clean,
        "{label}: e2fsck after recovery:\n{}",
        fsck.output
    );
    let fs = Fs::open(path).expect("open after recovery");
    let mut n = Checked::default();
    for (file, h) in &run.files {
        let Some((ok, may_be_gone)) = h.allowed(lo) else {
            continue;
        };
        n.paths += 1;
        match read_checked(&fs, file, label) {
            Ok(c) => {
                assert!(
                    ok.contains(&&c),
                    "{label}: {file} has {} bytes, not what was fsynced before the crash",
                    c.len()
                );
                n.files += 1;
            }
            Err(rext4::Error::NotFound) if may_be_gone => {}
            Err(err) => panic!(
                "{label}: {file} unreadable after its fsync completed: {err} (crash at event \
                 {lo}; versions (begun, durable) {:?}, may be gone from {:?})",
                h.versions.iter().map(|v| (v.0, v.1)).collect::<Vec<_>>(),
                h.deleted_from
            ),
        }
    }
    for (file, versions) in &run.torn {
        let Some(ok) = torn_allowed(versions, lo, hi) else {
            continue;
        };
        n.paths += 1;
        let c = read_checked(&fs, file, label).unwrap_or_else(|e| {
            panic!("{label}: {file} unreadable after its fsync completed: {e}")
        });
        if let Some(why) = torn_mismatch(ok, &c) {
            panic!("{label}: {file} changed in place (at events {lo}..{hi}): {why}");
        }
        n.files += 1;
    }
    for (file, log) in &run.logs {
        let Some(ok) = log.allowed(lo, hi) else {
            n.skipped += 1;
            continue;
        };
        n.paths += 1;
        match read_checked(&fs, file, label) {
            Ok(c) => {
                assert!(
                    ok.contains(&Some(&c[..])),
                    "{label}: {file} has {} bytes, none of the states it may have (at \
                     events {lo}..{hi}): {}",
                    c.len(),
                    log.describe()
                );
                n.files += 1;
            }
            Err(rext4::Error::NotFound) => assert!(
                ok.contains(&None),
                "{label}: {file} is missing, but it was durable (at events {lo}..{hi}): {}",
                log.describe()
            ),
            Err(err) => panic!("{label}: {file} unreadable: {err}: {}", log.describe()),
        }
    }
    n
}

/// What a sweep built and checked.
struct Swept {
    images: usize,
    checked: Checked,
}

fn sweep(name: &str, run: Run, recoverers: &[&str]) -> Swept {
    let variants = env_u64("REXT4_CRASH_VARIANTS", 3);
    let tmp = TempDir::new("crash").expect("tmp");
    let mut rng = Rng(0xC4A5_0000 ^ name.len() as u64);
    let mut images = 0;
    let mut checked = Checked::default();
    let mut used = BTreeMap::new();
    let points = crash::flush_points(&run.events);
    // The image at the flush point, kept up to date from one point to the next (a long
    // run's log is too long to replay for every image).
    let mut at = run.base.clone();
    let mut applied = 0;
    for (k, &fp) in points.iter().enumerate() {
        let durable = fp + 1;
        for e in &run.events[applied..durable] {
            if let Event::Write { offset, data } = e {
                let o = *offset as usize;
                if let Some(dst) = at.get_mut(o..o + data.len()) {
                    dst.copy_from_slice(data);
                }
            }
        }
        applied = durable;
        let next = points.get(k + 1).copied().unwrap_or(run.events.len());
        let mut imgs = vec![(at.clone(), durable, "at flush".to_string())];
        if crash::writes_after(&run.events, durable) > 0 {
            for v in 0..variants {
                imgs.push((
                    crash::image_with_lost_writes(&at, &run.events[durable..], 0, &mut rng),
                    next,
                    format!("lost/torn {v}"),
                ));
            }
        }
        for (img, hi, what) in imgs {
            let how = recoverers[(k + images) % recoverers.len()];
            // A file of its own for each image: the loop device of the kernel's
            // recovery of the one before may linger a moment after its detach (udev
            // still probing it), and rext4 refuses to write to a file under a loop.
            let path = tmp.join(format!("img-{images}"));
            std::fs::write(&path, &img).expect("write image");
            let label = format!(
                "{name} flush {k}/{} ({what}), recovered by {how}",
                points.len()
            );
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if let Err(e) = recover(&path, how) {
                    panic!("{label}: recovery failed: {e}");
                }
                check(&path, &run, durable, hi, &label)
            }));
            match r {
                Ok(c) => checked += c,
                Err(panic) => {
                    if let Ok(dir) = std::env::var("REXT4_CRASH_DUMP") {
                        dump(&dir, name, &run, &img, durable, hi);
                    }
                    std::panic::resume_unwind(panic);
                }
            }
            images += 1;
            *used.entry(how).or_insert(0usize) += 1;
            let _ = std::fs::remove_file(&path);
        }
    }
    eprintln!(
        "{name}: {images} crash images from {} flush points passed ({} fsync/sync calls, \
         {variants} variants per point; recovered by {used:?}); {} paths checked, {} files \
         read and right, {} paths skipped while a partial change was in flight",
        points.len(),
        run.syncs,
        checked.paths,
        checked.files,
        checked.skipped,
    );
    // Every fsync or sync that returned flushed the device, and every one but the last
    // was followed by writes of the next step: at least one image at each, plus the
    // lost/torn variants after all but the last. A sweep that found no flush points or
    // built fewer images than that has not checked what it claims.
    let least = run.syncs + variants as usize * run.syncs.saturating_sub(1);
    assert!(
        run.syncs > 0 && images >= least,
        "{name}: {images} crash images from {} flush points; {} fsync/sync calls with \
         {variants} variants each need at least {least}",
        points.len(),
        run.syncs
    );
    for how in recoverers {
        assert!(
            used.get(how).copied().unwrap_or(0) > 0,
            "{name}: no image was recovered by {how}"
        );
    }
    Swept { images, checked }
}

/// After a failed image, with `REXT4_CRASH_DUMP=dir`: keep the image as the crash left
/// it (`dir/name.img`) and the run's device log (`dir/name-events.txt`, one line per
/// write or flush), and say how each recoverer fares on it.
fn dump(dir: &str, name: &str, run: &Run, img: &[u8], lo: usize, hi: usize) {
    std::fs::create_dir_all(dir).expect("dump dir");
    let pre = std::path::PathBuf::from(format!("{dir}/{name}.img"));
    std::fs::write(&pre, img).expect("dump image");
    let mut log = String::new();
    for (i, e) in run.events.iter().enumerate() {
        log.push_str(&match e {
            Event::Write { offset, data } => format!("{i} write {offset} +{}\n", data.len()),
            Event::Flush => format!("{i} flush\n"),
        });
    }
    std::fs::write(format!("{dir}/{name}-events.txt"), log).expect("dump events");
    let tried = std::path::PathBuf::from(format!("{dir}/{name}-recovered.img"));
    for how in ["rext4", "e2fsck", "kernel"] {
        std::fs::write(&tried, img).expect("dump copy");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            recover(&tried, how).map(|()| check(&tried, run, lo, hi, how))
        }));
        let verdict = match r {
            Ok(Ok(_)) => "passes".to_string(),
            Ok(Err(e)) => format!("recovery fails: {e}"),
            Err(_) => "fails the checks".to_string(),
        };
        eprintln!("{name}: {} recovered by {how}: {verdict}", pre.display());
    }
}

fn recoverers() -> Vec<&'static str> {
    if let Ok(v) = std::env::var("REXT4_CRASH_RECOVER") {
        // e.g. "e2fsck,kernel": only these recoverers.
        return v
            .split(',')
            .map(|w| match w {
                "rext4" => "rext4",
                "e2fsck" => "e2fsck",
                _ => "kernel",
            })
            .collect();
    }
    if rext4_testkit::can_loop_mount().is_ok() {
        vec!["rext4", "rext4", "e2fsck", "kernel"]
    } else {
        skip("kernel replay of crash images needs loop mounts");
        vec!["rext4", "e2fsck"]
    }
}

#[test]
fn crash_small_files_fsync() {
    sweep("small-files", small_files(), &recoverers());
}

#[test]
fn crash_atomic_replace() {
    sweep("atomic-replace", atomic_replace(), &recoverers());
}

#[test]
fn crash_deep_trees_unlink() {
    sweep("deep-trees", deep_trees(), &recoverers());
}

#[test]
fn crash_appends_truncates() {
    sweep(
        "appends-truncates",
        appends_and_truncates(base_image()),
        &recoverers(),
    );
}

/// Appends and truncates of one file on ext3: its block map grows through the IND
/// and into the DIND range and is cut back, each step fsynced.
#[test]
fn crash_appends_truncates_ext3() {
    sweep(
        "appends-truncates-ext3",
        appends_and_truncates(base_image_of(true)),
        &recoverers(),
    );
}

#[test]
fn crash_concurrent_fsyncs() {
    sweep("concurrent-fsyncs", concurrent_fsyncs(), &recoverers());
}

#[test]
fn crash_direct_batches() {
    sweep("direct-batches", direct_batches(), &recoverers());
}

/// The ea_inode sweep: CI runs a short one (~520 images). The long one:
/// `REXT4_CRASH_STEPS=150 REXT4_CRASH_VARIANTS=10 REXT4_CRASH_MIN_IMAGES=5000` (6,493
/// images from 593 flush points, 23 minutes on a loaded 2-core machine).
#[test]
fn crash_xattr_values() {
    let s = sweep("xattr-values", xattr_values(), &recoverers());
    assert!(
        s.checked.files >= s.images,
        "xattr-values: only {} values and files read in {} images",
        s.checked.files,
        s.images
    );
    let least = env_u64("REXT4_CRASH_MIN_IMAGES", 0) as usize;
    assert!(
        s.images >= least,
        "xattr-values: {} crash images, fewer than REXT4_CRASH_MIN_IMAGES={least}",
        s.images
    );
}

/// Casefolded htrees: CI runs a short sweep (~650 images; 120 steps gave 1,322 in 3.5
/// minutes on a loaded 2-core machine). The long one: `REXT4_CRASH_STEPS=300
/// REXT4_CRASH_VARIANTS=6 REXT4_CRASH_MIN_IMAGES=5000` (5,714 images from 818 flush
/// points, 737,835 files read and right, 19 minutes). No kernel recovery: this
/// machine's kernel (no CONFIG_UNICODE) refuses casefold images.
#[test]
fn crash_casefold() {
    let recoverers: Vec<&str> = recoverers()
        .into_iter()
        .filter(|r| *r != "kernel")
        .collect();
    let s = sweep("casefold", casefold_htree(), &recoverers);
    assert!(s.checked.files > 0, "casefold: nothing read back");
    let least = env_u64("REXT4_CRASH_MIN_IMAGES", 0) as usize;
    assert!(
        s.images >= least,
        "casefold: {} crash images, fewer than REXT4_CRASH_MIN_IMAGES={least}",
        s.images
    );
}

#[test]
fn crash_early_commits() {
    sweep("early-commits", early_commits(), &recoverers());
}

/// The acceptance sweep of random concurrent operations: CI runs a short one (~1,600
/// images). The long one: `REXT4_CRASH_MIN_IMAGES=50000 REXT4_CRASH_VARIANTS=10
/// REXT4_CRASH_STEPS=850` in release (the flush points vary with the interleaving:
/// 750 steps gave 4,637 to 5,153 of them, 49,600 to 56,000 images).
#[test]
fn crash_random_ops() {
    random_ops_sweep("random-ops", random_ops(base_image(), 60));
}

/// The random concurrent sweep on ext3: block-mapped files and directories, the
/// journal without checksums, recovered by rext4, the kernel and e2fsck. CI runs 30
/// steps per thread (~800 images); the long run (≥ 5,000 images):
/// `REXT4_CRASH_MIN_IMAGES=5000 REXT4_CRASH_VARIANTS=10 REXT4_CRASH_STEPS=120`, in
/// release.
#[test]
fn crash_random_ops_ext3() {
    random_ops_sweep("random-ops-ext3", random_ops(base_image_of(true), 30));
}

/// A bigalloc image: 1 KiB blocks in 16 KiB clusters (a file's blocks share clusters,
/// truncates and unlinks free a cluster with its last block).
fn bigalloc_base_image() -> Vec<u8> {
    let opts = MkfsOptions::new(1024, 16 << 20)
        .arg("-O")
        .arg("bigalloc")
        .arg("-C")
        .arg("16384");
    let img = mkfs(&opts).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

/// Appends and truncates of one file on bigalloc, each step fsynced.
#[test]
fn crash_appends_truncates_bigalloc() {
    sweep(
        "appends-truncates-bigalloc",
        appends_and_truncates(bigalloc_base_image()),
        &recoverers(),
    );
}

/// The random concurrent sweep on bigalloc (1 KiB blocks, 16 KiB clusters), recovered
/// by rext4, the kernel and e2fsck. CI runs 30 steps per thread; the long run
/// (≥ 5,000 images): `REXT4_CRASH_MIN_IMAGES=5000 REXT4_CRASH_VARIANTS=10
/// REXT4_CRASH_STEPS=120` built 8,592 images from 802 flush points, all recovered
/// (rext4 4,267, the kernel 1,977, e2fsck 2,348) and checked (39 minutes, debug build,
/// on a loaded 2-core machine).
#[test]
fn crash_random_ops_bigalloc() {
    random_ops_sweep("random-ops-bigalloc", random_ops(bigalloc_base_image(), 30));
}

/// The random concurrent sweep on an inline_data image (1 KiB blocks): small files and
/// new directories start in their inodes, grow past them (converted to a block in one
/// change), shrink, are renamed and removed; recovered by rext4, the kernel and
/// e2fsck. CI runs 30 steps per thread (~800 images, ~2 min); the long run
/// `REXT4_CRASH_MIN_IMAGES=5000 REXT4_CRASH_VARIANTS=12 REXT4_CRASH_STEPS=60` built
/// 5,274 images, all recovered and checked (~9 min).
#[test]
fn crash_random_ops_inline() {
    let img = mkfs(&MkfsOptions::new(1024, 8 << 20).arg("-O").arg("inline_data")).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    random_ops_sweep("random-ops-inline", random_ops_sized(base, 30, true));
}

fn random_ops_sweep(name: &str, run: Run) {
    let s = sweep(name, run, &recoverers());
    eprintln!(
        "{name}: built {} crash images, made {} file checks",
        s.images, s.checked.paths
    );
    // Most paths are at rest most of the time: on average every image must have
    // compared several and read several files whole, or the model let them all off.
    assert!(
        s.checked.paths >= 8 * s.images && s.checked.files >= 4 * s.images,
        "{name}: only {} paths checked and {} files read in {} images",
        s.checked.paths,
        s.checked.files,
        s.images
    );
    let least = env_u64("REXT4_CRASH_MIN_IMAGES", 0) as usize;
    assert!(
        s.images >= least,
        "{name}: {} crash images, fewer than REXT4_CRASH_MIN_IMAGES={least}",
        s.images
    );
}
