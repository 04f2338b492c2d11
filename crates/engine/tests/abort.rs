//! ext4's abort, in the engine: a device read error inside an operation that had
//! already changed metadata aborts the journal (the filesystem shuts down, nothing of
//! the half-done operation is ever committed, the journal superblock records the
//! error); one before any change leaves the operation without effect. A sweep fails
//! the k-th metadata read of a fixed sequence of operations, for every k, each
//! operation committed on its own: after the failure, the image recovered by rext4
//! holds exactly the tree as of the last committed operation (for a failure in a
//! commit, the one before it or, when the failure came after the commit block, its
//! own), and e2fsck -fn is clean.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{Hooked, Hooks};
use rext4::format::superblock::STATE_ERROR;
use rext4::{Error, FallocMode, Fs, FsOptions, OpenOptions};
use rext4_testkit::tree::{diff_trees, Compare};
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions, TempDir};
use rext4_testkit::{Kind, Tree};

/// A memory device whose `fail_at`-th counted read — or, for [`Fault::Write`], write —
/// fails (once). Requests are counted only while `counting` is on (the operations and
/// their commits, not the test's own look at the tree).
type FailingRead = Hooked<Failing>;

/// [`FailingRead`]'s hooks.
struct Failing {
    fault: Fault,
    reads: AtomicU64,
    writes: AtomicU64,
    fail_at: AtomicU64,
    counting: AtomicBool,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    Read,
    Write,
}

fn failing(image: Vec<u8>, fault: Fault) -> FailingRead {
    Hooked::mem(
        image,
        Failing {
            fault,
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            counting: AtomicBool::new(false),
        },
    )
}

impl Failing {
    /// The counted requests of the kind that fails.
    fn counted(&self) -> u64 {
        match self.fault {
            Fault::Read => self.reads.load(Ordering::SeqCst),
            Fault::Write => self.writes.load(Ordering::SeqCst),
        }
    }

    /// Counts a request of `kind`; true when it is the one to fail.
    fn fails(&self, kind: Fault) -> bool {
        if !self.counting.load(Ordering::SeqCst) {
            return false;
        }
        let n = match kind {
            Fault::Read => self.reads.fetch_add(1, Ordering::SeqCst),
            Fault::Write => self.writes.fetch_add(1, Ordering::SeqCst),
        };
        kind == self.fault && n == self.fail_at.load(Ordering::SeqCst)
    }

    /// `f` with requests not counted.
    fn uncounted<T>(&self, f: impl FnOnce() -> T) -> T {
        self.counting.store(false, Ordering::SeqCst);
        let r = f();
        self.counting.store(true, Ordering::SeqCst);
        r
    }
}

impl Hooks for Failing {
    fn read(&self, _len: usize, _off: u64) -> std::io::Result<()> {
        if self.fails(Fault::Read) {
            return Err(std::io::Error::other("injected read error"));
        }
        Ok(())
    }
    fn write(&self, _buf: &[u8], _off: u64) -> std::io::Result<()> {
        if self.fails(Fault::Write) {
            return Err(std::io::Error::other("injected write error"));
        }
        Ok(())
    }
}

/// An image with a few directories of files, so operations read directory blocks,
/// inode tables and bitmaps.
fn base_image() -> Vec<u8> {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    {
        let fs = common::open_rw(img.path());
        for d in 0..4 {
            fs.create_dir(format!("/d{d}")).expect("mkdir");
            for f in 0..40 {
                fs.write(
                    format!("/d{d}/file-with-a-longish-name-{f:03}"),
                    vec![f as u8; 700 + f * 13],
                )
                .expect("write");
            }
        }
        fs.close().expect("close");
    }
    std::fs::read(img.path()).expect("read")
}

/// The operations, in order; each is committed on its own. Each is one operation
/// (no data to write back), so its sync only commits.
fn op(fs: &Fs, k: usize) -> rext4::Result<()> {
    let name = |d: usize, f: usize| format!("/d{d}/file-with-a-longish-name-{f:03}");
    match k {
        0 => fs.create("/d0/new").map(drop),
        1 => fs.create_dir("/d1/sub"),
        2 => fs.rename(name(2, 5), "/d3/moved"),
        3 => fs.remove_file(name(1, 7)),
        4 => fs.symlink("../d0/new", "/d2/link"),
        5 => fs.set_permissions(name(3, 4), 0o600),
        6 => fs.hard_link(name(3, 9), "/d2/hard"),
        7 => fs.rename("/d1/sub", "/d0/sub-moved"),
        8 => fs.remove_dir("/d0/sub-moved"),
        9 => fs.rename(name(0, 1), name(0, 2)),
        // File data: a new file, an append past the last block, an overwrite inside
        // the file, a shrinking truncate, a preallocation. O_DIRECT: the data goes
        // to the device inside the operation, into blocks it allocates (a new
        // file's) or that the file has (an overwrite). Each operation is one call:
        // opening a file changes nothing.
        10 => fs.write("/d1/data", pattern(10, 37_000)),
        11 => {
            let f = open_w(fs, &name(2, 11), false)?;
            f.write_all_at(&pattern(11, 9_000), f.metadata()?.size)
        }
        12 => open_w(fs, &name(3, 20), false)?.write_all_at(&pattern(12, 300), 200),
        13 => open_w(fs, "/d1/data", false)?.set_len(5_000),
        14 => {
            let f = open_w(fs, &name(0, 30), false)?;
            fs.fallocate_ino(f.ino(), FallocMode::KeepSize, 0, 64 << 10)
        }
        15 => fs.create("/d2/direct").map(drop),
        16 => open_w(fs, "/d2/direct", true)?.write_all_at(&pattern(16, 8192), 0),
        17 => open_w(fs, "/d2/direct", true)?.write_all_at(&pattern(17, 4096), 4096),
        _ => unreachable!(),
    }
}
const OPS: usize = 18;
/// The first of the operations that write file data (their syncs write it back).
const DATA_OPS: usize = 10;

/// `path` opened for writing, with O_DIRECT when `direct`.
fn open_w(fs: &Fs, path: &str, direct: bool) -> rext4::Result<rext4::File> {
    OpenOptions::new().write(true).direct(direct).open(fs, path)
}

/// `before` with the contents of `done` in every file whose size did not change:
/// what an overwrite in place leaves when its data reached the device and its
/// metadata was never committed.
fn in_place_data(before: &Tree, done: &Tree) -> Tree {
    let mut t = before.clone();
    for (path, n) in t.iter_mut() {
        if let Some(d) = done.get(path) {
            if n.kind == Kind::File && d.kind == Kind::File && n.size == d.size {
                n.content = d.content;
            }
        }
    }
    t
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 31 + seed * 7 + i / 253) as u8)
        .collect()
}

fn open(dev: Arc<FailingRead>) -> Fs {
    Fs::open_device(
        dev,
        FsOptions {
            read_only: false,
            commit_secs: 0,
            // The smallest cache: metadata reads reach the device.
            cache_blocks: 16,
            ..FsOptions::default()
        },
    )
    .expect("open")
}

#[test]
fn a_read_error_inside_an_operation_aborts_or_changes_nothing() {
    sweep(Fault::Read);
}

#[test]
fn a_write_error_inside_an_operation_aborts_or_changes_nothing() {
    sweep(Fault::Write);
}

/// Fails the k-th request of kind `fault` of the sequence, for every k.
fn sweep(fault: Fault) {
    let base = base_image();
    // Reads the whole sequence makes once the filesystem is open.
    let total = {
        let dev = Arc::new(failing(base.clone(), fault));
        let fs = open(dev.clone());
        dev.counting.store(true, Ordering::SeqCst);
        for k in 0..OPS {
            op(&fs, k).unwrap_or_else(|e| panic!("operation {k} without faults: {e}"));
            fs.sync().expect("sync");
        }
        dev.counting.store(false, Ordering::SeqCst);
        fs.close().expect("close");
        dev.counted()
    };
    // A floor that says the 16-block cache sends metadata reads to the device: the
    // sequence made 64 reads until #14 stopped reading the journal's superblock back
    // before each write of it (now 33: each remaining read is still failed once);
    // writes, 149.
    let floor = match fault {
        Fault::Read => 25,
        _ => 50,
    };
    assert!(
        total > floor,
        "the sequence made only {total} {fault:?} requests"
    );
    let tmp = TempDir::new("abort").expect("tmp");
    let path = tmp.join("img");
    let (mut aborted, mut unchanged, mut in_op, mut retried) = (0, 0, 0, 0);
    for fail in 0..total {
        let dev = Arc::new(failing(base.clone(), fault));
        let fs = open(dev.clone());
        let snap = |fs: &Fs| dev.uncounted(|| common::snapshot(fs).expect("snapshot"));
        let mut before = snap(&fs);
        dev.fail_at.store(fail, Ordering::SeqCst);
        dev.counting.store(true, Ordering::SeqCst);
        let mut failed = None;
        // A failure in a commit may come after its commit block (in the checkpoint
        // that follows): then the operation is committed.
        let mut or_after = None;
        for k in 0..OPS {
            if let Err(e) = op(&fs, k) {
                failed = Some((k, "the operation", e));
                break;
            }
            let done = snap(&fs);
            if let Err(e) = fs.sync() {
                failed = Some((k, "its sync", e));
                or_after = Some(done);
                break;
            }
            before = done;
        }
        let Some((k, what, err)) = failed else {
            // The failed read was not one the sequence needed (a refill after it).
            continue;
        };
        let label =
            format!("{fault:?} {fail} of {total} failed in {what} of operation {k} ({err})");
        let now = snap(&fs);
        dev.counting.store(false, Ordering::SeqCst);
        let shut = match fs.sync() {
            Err(Error::ShutDown(_)) => true,
            Ok(()) => false,
            Err(e) => panic!("{label}: sync after the failure: {e}"),
        };
        if shut {
            aborted += 1;
            if what == "the operation" {
                in_op += 1;
            }
        } else if what == "the operation" {
            // Not aborted: the operation must have changed nothing.
            unchanged += 1;
            let d = diff_trees(&before, &now, &Compare::exact());
            assert!(
                d.is_empty(),
                "{label}: not aborted, yet changed:\n{}",
                d.join("\n")
            );
        } else {
            // A sync that failed without aborting: only the data writeback before the
            // commit may fail so, before it changed anything. The operation had
            // returned; its result stays whole in memory, and the sync just retried
            // made it durable, so the recovered image must hold it (checked below).
            assert!(k >= DATA_OPS, "{label}: a failed commit must abort");
            retried += 1;
            let done = or_after.as_ref().expect("the operation's tree");
            let d = diff_trees(done, &now, &Compare::exact());
            assert!(
                d.is_empty(),
                "{label}: the failed writeback changed the operation's result:\n{}",
                d.join("\n")
            );
            before = done.clone();
            or_after = None;
        }
        // What a crash now leaves (an aborted filesystem cannot close cleanly).
        drop(fs);
        std::fs::write(&path, dev.snapshot()).expect("write image");
        let rec = common::open_rw(&path);
        let after = common::snapshot(&rec).expect("snapshot");
        let mut d = diff_trees(&before, &after, &Compare::exact());
        if let Some(done) = &or_after {
            // Data written in place goes to the file's blocks, not to the log (ordered
            // mode): the overwrite may be there with the rest of its operation (the
            // times) not committed, as after the kernel's crash.
            if diff_trees(done, &after, &Compare::exact()).is_empty()
                || diff_trees(&in_place_data(&before, done), &after, &Compare::exact()).is_empty()
            {
                d.clear();
            }
        }
        assert!(
            d.is_empty(),
            "{label}: the recovered tree is not the one of the last committed \
             operation:\n{}",
            d.join("\n")
        );
        if shut {
            assert!(
                rec.superblock().state & STATE_ERROR != 0,
                "{label}: the abort was not recorded (no errors state after recovery)"
            );
        }
        rec.close().expect("close");
        let r = e2fsck_fn(&path);
        assert!(r.clean, "{label}: e2fsck:\n{}", r.output);
    }
    eprintln!(
        "{total} {fault:?}s: {aborted} failures aborted the journal ({in_op} inside an \
         operation, the rest in a commit), {unchanged} left their operation without \
         effect, {retried} failed a data writeback that a later sync redid"
    );
    // Reads fail inside operations after their changes; writes inside an operation
    // are data (O_DIRECT) and come before its change, so there a failure must leave
    // the operation without effect, and failures in commits must abort.
    if fault == Fault::Read {
        assert!(
            in_op > 0,
            "no failure came inside an operation after a change: the sweep tested no abort"
        );
    } else {
        assert!(aborted > 0, "no failed commit: the sweep tested no abort");
    }
    assert!(unchanged > 0, "no failure came before a change");
}

/// A stat whose metadata read fails: the operation reports the error, and the
/// filesystem marks itself as having errors (no frontend calls `note_error`), then
/// follows `errors=`: with continue it goes on (the mark is committed with the next
/// change), with remount-ro it aborts the journal and refuses every change. `None`
/// follows the superblock's `s_errors` (what `tune2fs -e` sets).
fn stat_fails_then(errors: Option<rext4::Errors>, s_errors: Option<&str>) -> (bool, u16, u32) {
    let tmp = TempDir::new("errors").expect("tmp");
    let path = tmp.join("img");
    std::fs::write(&path, base_image()).expect("write image");
    if let Some(e) = s_errors {
        let out = std::process::Command::new("tune2fs")
            .args(["-e", e])
            .arg(&path)
            .output()
            .expect("tune2fs");
        assert!(out.status.success(), "tune2fs -e {e}: {out:?}");
    }
    let dev = Arc::new(failing(std::fs::read(&path).expect("read"), Fault::Read));
    let fs = Fs::open_device(
        dev.clone(),
        FsOptions {
            read_only: false,
            commit_secs: 0,
            cache_blocks: 16,
            errors,
            ..FsOptions::default()
        },
    )
    .expect("open");
    fs.write("/d0/before", b"committed before the error")
        .expect("write");
    fs.sync().expect("sync");
    dev.fail_at.store(0, Ordering::SeqCst);
    dev.counting.store(true, Ordering::SeqCst);
    let err = fs
        .metadata("/d3/file-with-a-longish-name-033")
        .expect_err("the stat's read fails");
    dev.counting.store(false, Ordering::SeqCst);
    assert!(matches!(err, Error::Io(_)), "stat: {err}");
    // A frontend reports it too (the mount's `fail`): counted once all the same.
    fs.note_error(&err);
    let went_on = match fs.write("/d0/after", b"x") {
        Ok(()) => true,
        Err(Error::ShutDown(_)) => false,
        Err(e) => panic!("a change after the error: {e}"),
    };
    if went_on {
        fs.close().expect("close");
    }
    drop(fs);
    std::fs::write(&path, dev.snapshot()).expect("write image");
    let rec = common::open_rw(&path);
    let sb = rec.superblock();
    let (state, count) = (sb.state, sb.error_count);
    assert_eq!(
        rec.read("/d0/before").expect("committed file"),
        b"committed before the error"
    );
    assert_eq!(
        rec.read("/d0/after").is_ok(),
        went_on,
        "the change after the error"
    );
    rec.close().expect("close");
    let r = e2fsck_fn(&path);
    assert!(r.clean, "e2fsck:\n{}", r.output);
    (went_on, state & STATE_ERROR, count)
}

#[test]
fn a_metadata_error_marks_the_filesystem_and_follows_errors() {
    // Continue, as mke2fs sets it: the filesystem goes on, marked.
    let (went_on, state, count) = stat_fails_then(None, None);
    assert!(went_on, "errors=continue refused a change");
    assert_ne!(state, 0, "errors=continue: the superblock is not marked");
    assert_eq!(count, 1, "one failed read, reported by the frontend too");
    // remount-ro asked by the opener: aborted, marked by recovery.
    let (went_on, state, _) = stat_fails_then(Some(rext4::Errors::RemountRo), None);
    assert!(!went_on, "errors=remount-ro took a change after the error");
    assert_ne!(state, 0, "errors=remount-ro: the superblock is not marked");
    // ...and asked by the superblock (tune2fs -e), unless the opener says continue.
    let (went_on, _, _) = stat_fails_then(None, Some("remount-ro"));
    assert!(
        !went_on,
        "s_errors=remount-ro took a change after the error"
    );
    let (went_on, _, _) = stat_fails_then(Some(rext4::Errors::Continue), Some("remount-ro"));
    assert!(
        went_on,
        "errors=continue over s_errors=remount-ro refused a change"
    );
}
