//! A full disk through the mount, in each write mode: writers stop with ENOSPC from
//! write() with no overshoot, nothing fsynced is lost, the image is clean.
//!
//! The overshoot is what write() acknowledged that writeback then could not place
//! (those bytes read as zeros, or the file ends before them). There is none in any
//! mode, as on the kernel's ext4: under the kernel's writeback cache the server holds
//! back the space the kernel's cached data may take, and a descriptor opened before
//! space ran low has each write() admitted by the server first (`lowspace` in
//! crates/fuse); files opened while space is low, and every file without the writeback
//! cache, get ENOSPC from the write() that does not fit.

mod fuse_mount;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fuse_mount::{bin, cannot_mount, Mounted, Watchdog};
use rext4_testkit::{e2fsck_fn, mkfs, skip, MkfsOptions};

const MIB: u64 = 1 << 20;
/// Longest a writer may take to be stopped (it must stop, not churn).
const STOP_WITHIN: Duration = Duration::from_secs(60);

/// The overshoot allowed per writer, in every mount mode (the server's dirty window,
/// the kernel's own one of `bdi_max_ratio=0` as for a non-root user, no writeback
/// cache): none.
fn bound_per_writer(_opts: &[&str]) -> u64 {
    0
}

/// What one writer saw: bytes acknowledged by write(), the error that stopped it,
/// what fsync then said.
struct Outcome {
    acked: u64,
    stopped_by: Option<i32>,
    fsync_ok: bool,
}

/// Fill the mount with `n` writers, each writing 1 MiB pieces of its own byte to its
/// own file (opened before any of them starts) until write() fails.
fn fill(dir: &Path, n: usize) -> Vec<Outcome> {
    let files: Vec<File> = (0..n)
        .map(|i| File::create(dir.join(format!("w{i}"))).expect("create"))
        .collect();
    let start = Arc::new(Barrier::new(n));
    let threads: Vec<_> = files
        .into_iter()
        .enumerate()
        .map(|(i, mut f)| {
            let start = start.clone();
            std::thread::spawn(move || {
                let buf = vec![i as u8 + 1; MIB as usize];
                start.wait();
                let t0 = Instant::now();
                let mut acked = 0u64;
                let stopped_by = loop {
                    match f.write(&buf) {
                        Ok(k) => acked += k as u64,
                        Err(e) => break e.raw_os_error(),
                    }
                    if t0.elapsed() > STOP_WITHIN {
                        break None;
                    }
                };
                let fsync_ok = f.sync_all().is_ok();
                Outcome {
                    acked,
                    stopped_by,
                    fsync_ok,
                }
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("writer"))
        .collect()
}

/// statvfs's f_bavail in bytes.
fn avail_bytes(p: &Path) -> u64 {
    let st = fuse_mount::statvfs(p).expect("statvfs");
    st.f_bavail * st.f_frsize
}

fn run(opts: &[&str], writers: usize) {
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let mut m = Mounted::new(img.path(), opts);
    let _w = Watchdog::new("full disk", m.pid(), Duration::from_secs(180));
    // Acknowledged by fsync before the disk fills: must survive it.
    let keep = vec![0x5au8; 3 * MIB as usize];
    {
        let mut f = File::create(m.join("kept")).expect("create");
        f.write_all(&keep).expect("write");
        f.sync_all().expect("fsync");
    }
    let out = fill(m.path(), writers);
    // The writers stopped within a moment of full (a descriptor opened before space
    // ran low stops once less is left than the kernel may be holding). A file opened
    // now writes through: to the last block, then ENOSPC from write() itself, every
    // byte acknowledged on the image (checked below).
    let left = avail_bytes(m.path());
    assert!(
        left <= bound_per_writer(opts).max(2 * MIB),
        "{opts:?} x{writers}: the writers stopped with {left} bytes left"
    );
    let mut late_acked = 0u64;
    let late = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(m.join("late"))
        .and_then(|mut f| loop {
            match f.write(&[0x77u8; 65536]) {
                Ok(k) => late_acked += k as u64,
                Err(e) => break Err::<(), _>(e),
            }
            assert!(late_acked < 64 * MIB, "the late writer does not stop");
        });
    assert!(m.unmount().success(), "{}", m.stderr());
    // The server's log, for the messages below (what it refused, and when).
    let log = m.stderr();
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{opts:?} x{writers}: e2fsck -fn:\n{}", r.output);

    let fs = rext4::Fs::open(img.path()).expect("open");
    assert_eq!(
        fs.read("/kept").expect("read"),
        keep,
        "{opts:?}: fsynced file"
    );
    let bound = bound_per_writer(opts);
    let mut report = Vec::new();
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.stopped_by,
            Some(libc::ENOSPC),
            "{opts:?} x{writers}: writer {i} after {} bytes: stopped by errno {:?}, not \
             ENOSPC from write()",
            o.acked,
            o.stopped_by
        );
        let data = fs.read(format!("/w{i}")).expect("read back");
        // Refused pieces read as zeros (the kernel's writeback sends pieces in
        // parallel, so a refused one may lie before one that got the last blocks);
        // nothing else may be there.
        assert!(
            data.iter().all(|&b| b == i as u8 + 1 || b == 0),
            "{opts:?}: writer {i}'s file holds bytes it never wrote"
        );
        assert!(
            data.len() as u64 <= o.acked,
            "{opts:?} x{writers}: writer {i}'s file is {} bytes, longer than the {} \
             acknowledged (stopped by {:?}, fsync ok: {})\nserver log:\n{log}",
            data.len(),
            o.acked,
            o.stopped_by,
            o.fsync_ok
        );
        let on_image = data.iter().filter(|&&b| b == i as u8 + 1).count() as u64;
        let over = o.acked - on_image;
        report.push(over);
        assert!(
            over <= bound,
            "{opts:?} x{writers}: writer {i} acknowledged {} bytes, {on_image} are on the \
             image: overshoot {over} > {bound}",
            o.acked
        );
        if o.fsync_ok {
            let bad: Vec<usize> = data
                .iter()
                .enumerate()
                .filter(|(_, &b)| b != i as u8 + 1)
                .map(|(k, _)| k)
                .collect();
            assert_eq!(
                over,
                0,
                "{opts:?}: fsync succeeded but acknowledged data is gone: writer {i} acked {} \
                 image {} bytes, other bytes at {:?}..{:?}\nserver log:\n{log}",
                o.acked,
                data.len(),
                bad.first(),
                bad.last()
            );
        }
    }
    assert!(
        matches!(&late, Err(e) if e.raw_os_error() == Some(libc::ENOSPC)),
        "{opts:?}: a file opened on the full disk: {late:?}"
    );
    let got = fs.read("/late").expect("late");
    assert!(
        got.len() as u64 == late_acked && got.iter().all(|&b| b == 0x77),
        "{opts:?}: the late writer's {late_acked} acknowledged bytes: {} on the image",
        got.len()
    );
    eprintln!("{opts:?} x{writers}: overshoot per writer (bytes) {report:?}");
}

#[test]
fn writers_stop_with_enospc_on_a_full_mount() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    for opts in [
        &[][..],
        &["bdi_max_ratio=0"][..],
        &["nowriteback_cache"][..],
        &["nouring"][..],
    ] {
        for writers in [1, 4] {
            run(opts, writers);
        }
    }
}

/// `dd` as the issue ran it: it stops with "No space left on device" from a write,
/// not only at close, and soon.
#[test]
fn dd_stops_with_enospc() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let mut m = Mounted::new(img.path(), &[]);
    let _w = Watchdog::new("dd", m.pid(), Duration::from_secs(120));
    let out = Command::new("timeout")
        .arg("60")
        .arg("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", m.join("fill").display()))
        .arg("bs=1M")
        .output()
        .expect("dd");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "dd: {err}");
    assert!(
        err.contains("error writing") && err.contains("No space left on device"),
        "dd did not get ENOSPC from write(): {err}"
    );
    let len = fs::metadata(m.join("fill")).expect("stat").len();
    assert!(len <= 32 * MIB, "the file grew past the disk: {len}");
    assert!(m.unmount().success(), "{}", m.stderr());
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    let _ = bin();
}
