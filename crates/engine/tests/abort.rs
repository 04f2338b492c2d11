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

use rext4::device::{BlockDevice, MemDevice};
use rext4::format::superblock::STATE_ERROR;
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::tree::{diff_trees, Compare};
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions, TempDir};

/// A memory device whose `fail_at`-th counted read fails (once). Reads are counted
/// only while `counting` is on (the operations and their commits, not the test's
/// own look at the tree).
struct FailingRead {
    mem: MemDevice,
    reads: AtomicU64,
    fail_at: AtomicU64,
    counting: AtomicBool,
}

impl FailingRead {
    fn new(image: Vec<u8>) -> FailingRead {
        FailingRead {
            mem: MemDevice::new(image),
            reads: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            counting: AtomicBool::new(false),
        }
    }

    /// `f` with reads not counted.
    fn uncounted<T>(&self, f: impl FnOnce() -> T) -> T {
        self.counting.store(false, Ordering::SeqCst);
        let r = f();
        self.counting.store(true, Ordering::SeqCst);
        r
    }
}

impl BlockDevice for FailingRead {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        if self.counting.load(Ordering::SeqCst) {
            let n = self.reads.fetch_add(1, Ordering::SeqCst);
            if n == self.fail_at.load(Ordering::SeqCst) {
                return Err(std::io::Error::other("injected read error"));
            }
        }
        self.mem.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.mem.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.mem.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        false
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
        _ => unreachable!(),
    }
}
const OPS: usize = 10;

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
    let base = base_image();
    // Reads the whole sequence makes once the filesystem is open.
    let total = {
        let dev = Arc::new(FailingRead::new(base.clone()));
        let fs = open(dev.clone());
        dev.counting.store(true, Ordering::SeqCst);
        for k in 0..OPS {
            op(&fs, k).unwrap_or_else(|e| panic!("operation {k} without faults: {e}"));
            fs.sync().expect("sync");
        }
        dev.counting.store(false, Ordering::SeqCst);
        fs.close().expect("close");
        dev.reads.load(Ordering::SeqCst)
    };
    assert!(total > 50, "the sequence read only {total} blocks");
    let tmp = TempDir::new("abort").expect("tmp");
    let path = tmp.join("img");
    let (mut aborted, mut unchanged, mut in_op) = (0, 0, 0);
    for fail in 0..total {
        let dev = Arc::new(FailingRead::new(base.clone()));
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
                failed = Some((k, "its commit", e));
                or_after = Some(done);
                break;
            }
            before = done;
        }
        let Some((k, what, err)) = failed else {
            // The failed read was not one the sequence needed (a refill after it).
            continue;
        };
        let label = format!("read {fail} of {total} failed in {what} of operation {k} ({err})");
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
        } else {
            // Not aborted: the operation must have changed nothing.
            unchanged += 1;
            assert_eq!(what, "the operation", "{label}: a failed commit must abort");
            let d = diff_trees(&before, &now, &Compare::exact());
            assert!(
                d.is_empty(),
                "{label}: not aborted, yet changed:\n{}",
                d.join("\n")
            );
        }
        // What a crash now leaves (an aborted filesystem cannot close cleanly).
        drop(fs);
        std::fs::write(&path, dev.mem.snapshot()).expect("write image");
        let rec = common::open_rw(&path);
        let after = common::snapshot(&rec).expect("snapshot");
        let mut d = diff_trees(&before, &after, &Compare::exact());
        if let Some(done) = &or_after {
            if diff_trees(done, &after, &Compare::exact()).is_empty() {
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
        "{total} reads: {aborted} failures aborted the journal ({in_op} inside an \
         operation, the rest in a commit), {unchanged} left their operation without \
         effect"
    );
    assert!(
        in_op > 0,
        "no failure came inside an operation after a change: the sweep tested no abort"
    );
    assert!(unchanged > 0, "no failure came before a change");
}
