//! Fault injection: a write or flush error from the device during a commit shuts the
//! filesystem down (read-only, every later change refused with a clear error), and
//! nothing that was committed before is lost: the device's contents, recovered,
//! pass e2fsck and hold every file synced before the fault.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{Hooked, Hooks};
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{e2fsck_fn, e2fsck_fy, mkfs, MkfsOptions, TempDir};

/// Fails the `fail_at`-th device operation (writes and flushes counted together) and
/// every one after it.
struct Faulty {
    ops: AtomicUsize,
    fail_at: AtomicUsize,
    flush_only: bool,
}

impl Faulty {
    /// Counts an operation; an error from the `fail_at`-th on.
    fn count(&self, what: &str) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if n >= self.fail_at.load(Ordering::SeqCst) {
            return Err(std::io::Error::other(format!("injected {what} error")));
        }
        Ok(())
    }
}

impl Hooks for Faulty {
    fn write(&self, _buf: &[u8], _off: u64) -> std::io::Result<()> {
        let r = self.count("write");
        if self.flush_only {
            return Ok(());
        }
        r
    }
    fn flush(&self) -> std::io::Result<()> {
        self.count("flush")
    }
}

fn run(flush_only: bool, delay: usize) {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    let dev = Arc::new(Hooked::mem(
        base,
        Faulty {
            ops: AtomicUsize::new(0),
            fail_at: AtomicUsize::new(usize::MAX),
            flush_only,
        },
    ));
    let fs = Fs::open_device(
        dev.clone(),
        FsOptions {
            read_only: false,
            commit_secs: 0,
            ..FsOptions::default()
        },
    )
    .expect("open");
    for i in 0..10 {
        fs.write(format!("/committed{i}"), vec![i as u8; 5000])
            .expect("write");
    }
    fs.sync().expect("commit");
    // Arm the fault inside the next commit.
    for i in 0..10 {
        fs.write(format!("/later{i}"), vec![0xEE; 5000])
            .expect("buffered write");
    }
    dev.fail_at
        .store(dev.ops.load(Ordering::SeqCst) + delay, Ordering::SeqCst);
    let err = fs.sync().expect_err("the commit must fail");
    assert!(matches!(err, Error::ShutDown(_) | Error::Io(_)), "{err}");
    let again = fs.write("/after", b"x").expect_err("shut down");
    assert!(matches!(again, Error::ShutDown(_)), "{again}");
    assert!(again.to_string().contains("shut down"), "{again}");
    drop(fs);
    // What the device holds, recovered by e2fsck's journal replay.
    let tmp = TempDir::new("fault").expect("tmp");
    let p = tmp.join("img");
    std::fs::write(&p, dev.snapshot()).expect("write");
    let r = e2fsck_fy(&p);
    assert!(r.exit_code <= 1, "e2fsck -fy: {}", r.output);
    let r = e2fsck_fn(&p);
    assert!(r.clean, "{}", r.output);
    let fs = Fs::open(&p).expect("open");
    for i in 0..10 {
        assert_eq!(
            fs.read(format!("/committed{i}")).expect("committed file"),
            vec![i as u8; 5000]
        );
    }
}

#[test]
fn write_error_during_commit() {
    for delay in [0, 1, 3, 7] {
        run(false, delay);
    }
}

#[test]
fn flush_error_during_commit() {
    for delay in [0, 2, 5] {
        run(true, delay);
    }
}
