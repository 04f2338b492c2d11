//! Fault injection: a write or flush error from the device during a commit shuts the
//! filesystem down (read-only, every later change refused with a clear error), and
//! nothing that was committed before is lost: the device's contents, recovered,
//! pass e2fsck and hold every file synced before the fault.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rext4::device::{BlockDevice, MemDevice};
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{e2fsck_fn, e2fsck_fy, mkfs, MkfsOptions, TempDir};

/// Fails the `fail_at`-th device operation (writes and flushes counted together) and
/// every one after it.
struct Faulty {
    mem: MemDevice,
    ops: AtomicUsize,
    fail_at: AtomicUsize,
    flush_only: bool,
}

impl BlockDevice for Faulty {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.mem.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if !self.flush_only && n >= self.fail_at.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected write error"));
        }
        self.mem.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if n >= self.fail_at.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected flush error"));
        }
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.mem.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        false
    }
}

fn run(flush_only: bool, delay: usize) {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    let dev = Arc::new(Faulty {
        mem: MemDevice::new(base),
        ops: AtomicUsize::new(0),
        fail_at: AtomicUsize::new(usize::MAX),
        flush_only,
    });
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
    std::fs::write(&p, dev.mem.snapshot()).expect("write");
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
