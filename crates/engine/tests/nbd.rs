//! Images on NBD servers (`nbd+unix:///?socket=PATH`, `crate::device::nbd`), against
//! real nbdkit servers (`rext4_testkit::NbdServer`):
//! - a tree the kernel wrote into the file nbdkit serves reads identically; rext4
//!   writes through the export (whole, and at an offset); then the file is e2fsck
//!   text-clean and the kernel reads what rext4 wrote;
//! - the device: many requests in flight on several connections, batches, flush,
//!   FUA writes, trim (zeros after), a read-only export;
//! - faults: a server answering errors (nbdkit's error filter) fails writes and
//!   fsyncs like a failing disk, a transient error is retried, a killed server's
//!   errors reach the caller with nothing fsynced lost, a hung server times out;
//! - discard: `Fs::trim` through the file plugin punches the served file's holes;
//! - bad input: unreachable servers and bad URIs are clear errors.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rext4::device::nbd::{NbdDevice, NbdOptions};
use rext4::device::BlockDevice;
use rext4::{Error, Fs, FsOptions, ImageSpec};
use rext4_testkit::nbd::{have_libnbd, have_nbdkit};
use rext4_testkit::{
    diff_trees, e2fsck_fn, populate_kernel, skip, snapshot_dir, Compare, Fixture, LoopMount,
    NbdServer, TempDir,
};

const MIB: u64 = 1 << 20;

/// nbdkit and libnbd are there (else skipped).
fn ready(label: &str) -> bool {
    if let Err(e) = have_nbdkit().and_then(|_| have_libnbd()) {
        skip(&format!("[{label}] {e}"));
        return false;
    }
    true
}

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    }
}

fn spec(text: &str) -> ImageSpec {
    ImageSpec::parse(text).expect("spec")
}

fn mkfs(img: &Path, offset: u64, size: u64) {
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-E"])
        .arg(format!("offset={offset}"))
        .arg(img)
        .arg(format!("{}k", size / 1024))
        .output()
        .expect("mkfs.ext4");
    assert!(
        out.status.success(),
        "mkfs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sparse(path: &Path, size: u64) {
    std::fs::File::create(path)
        .and_then(|f| f.set_len(size))
        .expect("image file");
}

/// The kernel writes a tree into the image file; nbdkit serves the file; rext4 reads
/// it through `nbd+unix://...{fields}` identically, writes through it, and then the
/// file is e2fsck-clean and the kernel reads rext4's bytes.
fn kernel_then_rext4_over_nbd(offset: u64, fields: &str, label: &str) {
    if !ready(label) {
        return;
    }
    let dir = TempDir::new("nbd-kernel").expect("tmp");
    let img = dir.join("disk.img");
    let size = 64 * MIB;
    sparse(&img, offset + size + MIB);
    mkfs(&img, offset, size);
    let loop_opts = format!("offset={offset},sizelimit={size}");
    let m = match LoopMount::new(&img, false, &loop_opts) {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel loop mount: {e}")),
    };
    populate_kernel(m.path(), &Fixture::quick()).expect("kernel populates");
    m.unmount().expect("unmount");
    let m = LoopMount::new(&img, true, &format!("{loop_opts},noatime")).expect("mount ro");
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");

    let server = NbdServer::file(&img).expect("nbdkit");
    let s = spec(&format!("{}{fields}", server.uri()));
    let fs = Fs::open_spec(&s, FsOptions::default()).expect("rext4 opens the export");
    let ours = common::snapshot(&fs).expect("rext4 walks the tree");
    drop(fs);
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] kernel vs rext4:\n{}",
        d[..d.len().min(40)].join("\n")
    );

    let fs = Fs::open_spec(&s, rw()).expect("open rw");
    fs.create_dir("/from-rext4").expect("mkdir");
    let data: Vec<u8> = (0..3 * MIB as usize + 123)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    fs.write("/from-rext4/data", &data).expect("write");
    fs.remove_file("/small/f0").ok();
    fs.close().expect("close");
    drop(server);

    let fsck = e2fsck_fn(Path::new(&format!("{}?offset={offset}", img.display())));
    assert!(fsck.clean, "[{label}] e2fsck: {}", fsck.output);
    let m = LoopMount::new(&img, true, &format!("{loop_opts},noatime")).expect("mount ro");
    let seen = std::fs::read(m.path().join("from-rext4/data")).expect("kernel reads");
    let gone = m.path().join("small/f0").exists();
    m.unmount().expect("unmount");
    assert!(seen == data, "[{label}] the kernel reads other bytes");
    assert!(!gone, "[{label}] the kernel still sees the removed file");
}

#[test]
fn kernel_tree_over_nbd() {
    kernel_then_rext4_over_nbd(0, "", "whole export");
}

#[test]
fn kernel_tree_at_an_offset_of_an_nbd_export() {
    kernel_then_rext4_over_nbd(MIB, &format!("&offset={MIB}&size={}", 64 * MIB), "offset");
}

/// A memory export of `size` bytes as a device (`connections` at most).
fn memory_device(size: u64, connections: usize) -> Option<(NbdServer, NbdDevice)> {
    if !ready("memory device") {
        return None;
    }
    let server = NbdServer::memory(size).expect("nbdkit memory");
    let mut o = NbdOptions::new(server.uri());
    o.connections = connections;
    let dev = NbdDevice::open(&o, false).expect("connect");
    Some((server, dev))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn device_requests_in_flight_flush_fua_and_trim() {
    let Some((_server, dev)) = memory_device(256 * MIB, 4) else {
        return;
    };
    assert_eq!(dev.size_bytes(), 256 * MIB);
    assert!(!dev.is_read_only());
    assert_eq!(
        dev.connections(),
        4,
        "nbdkit's memory plugin allows multi-conn"
    );
    let dev = Arc::new(dev);
    // Eight threads, each its own 8 MiB region, single requests and batches mixed.
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let dev = dev.clone();
            sc.spawn(move || {
                let base = t * 8 * MIB;
                for i in 0..32u64 {
                    let b = pattern(t * 1000 + i, 64 << 10);
                    dev.write_at(&b, base + i * (64 << 10)).expect("write");
                }
                let bufs: Vec<Vec<u8>> = (32..64u64)
                    .map(|i| pattern(t * 1000 + i, 64 << 10))
                    .collect();
                let reqs: Vec<(u64, &[u8])> = bufs
                    .iter()
                    .enumerate()
                    .map(|(k, b)| (base + (32 + k as u64) * (64 << 10), b.as_slice()))
                    .collect();
                dev.write_many(&reqs).expect("write_many");
                dev.flush().expect("flush");
                let mut out: Vec<Vec<u8>> = vec![vec![0u8; 64 << 10]; 64];
                let mut rq: Vec<(u64, &mut [u8])> = out
                    .iter_mut()
                    .enumerate()
                    .map(|(k, b)| (base + k as u64 * (64 << 10), b.as_mut_slice()))
                    .collect();
                dev.read_many(&mut rq).expect("read_many");
                for (k, b) in out.iter().enumerate() {
                    assert!(
                        *b == pattern(t * 1000 + k as u64, 64 << 10),
                        "thread {t} block {k}"
                    );
                }
            });
        }
    });
    // A request larger than the largest NBD request is split.
    let big = pattern(77, 40 << 20);
    dev.write_at(&big, 100 * MIB).expect("big write");
    let mut back = vec![0u8; 40 << 20];
    dev.read_at(&mut back, 100 * MIB).expect("big read");
    assert!(back == big);
    // FUA write, read back fresh.
    let b = pattern(5, 4096);
    dev.write_through(&b, 200 * MIB).expect("write_through");
    let mut r = vec![0u8; 4096];
    dev.read_fresh(&mut r, 200 * MIB).expect("read_fresh");
    assert_eq!(r, b);
    // Trim: the memory plugin reads zeros there afterwards.
    dev.discard(100 * MIB, 8 * MIB).expect("trim");
    let mut z = vec![1u8; 8 << 20];
    dev.read_at(&mut z, 100 * MIB).expect("read trimmed");
    assert!(z.iter().all(|&x| x == 0));
    // Outside the export: refused here, before the server.
    assert!(dev.read_at(&mut r, 256 * MIB - 100).is_err());
    assert!(dev.write_at(&b, u64::MAX - 10).is_err());
}

#[test]
fn read_only_export() {
    if !ready("read-only export") {
        return;
    }
    let dir = TempDir::new("nbd-ro").expect("tmp");
    let img = dir.join("fs.img");
    sparse(&img, 32 * MIB);
    mkfs(&img, 0, 32 * MIB);
    let a = format!("file={}", img.display());
    let server = NbdServer::start("file", &[], &["-r", &a]).expect("nbdkit -r");
    let Err(e) = Fs::open_spec(&spec(&server.uri()), rw()) else {
        panic!("a read-write open of a read-only export succeeded");
    };
    assert!(e.to_string().contains("read-only"), "{e}");
    let fs = Fs::open_spec(&spec(&server.uri()), FsOptions::default()).expect("ro open");
    assert!(fs.read_dir("/").is_ok());
}

#[test]
fn many_writers_with_fsync_over_nbd() {
    if !ready("writers") {
        return;
    }
    let dir = TempDir::new("nbd-writers").expect("tmp");
    let img = dir.join("fs.img");
    sparse(&img, 128 * MIB);
    mkfs(&img, 0, 128 * MIB);
    let server = NbdServer::file(&img).expect("nbdkit");
    let fs = Fs::open_spec(&spec(&server.uri()), rw()).expect("open rw");
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let fs = &fs;
            sc.spawn(move || {
                fs.create_dir(format!("/t{t}")).expect("mkdir");
                for i in 0..25u64 {
                    let p = format!("/t{t}/f{i}");
                    fs.write(&p, pattern(t * 100 + i, (i as usize + 1) * 9000))
                        .expect("write");
                    fs.open_file(&p).and_then(|f| f.sync_all()).expect("fsync");
                }
            });
        }
    });
    fs.close().expect("close");
    drop(server);
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "e2fsck: {}", fsck.output);
    let fs = Fs::open(&img).expect("reopen the file");
    for t in 0..4u64 {
        for i in 0..25u64 {
            let got = fs.read(format!("/t{t}/f{i}")).expect("read");
            assert!(
                got == pattern(t * 100 + i, (i as usize + 1) * 9000),
                "t{t}/f{i}"
            );
        }
    }
}

/// nbdkit's file plugin under the error filter: every request fails while
/// `errors` exists.
fn failing_server(img: &Path, errors: &Path) -> NbdServer {
    let a = format!("file={}", img.display());
    let ef = format!("error-file={}", errors.display());
    NbdServer::start(
        "file",
        &["error"],
        &[&a, "error=EIO", "error-rate=100%", &ef],
    )
    .expect("nbdkit with the error filter")
}

/// Recover the image file with rext4 (its journal replayed) and check it.
fn recover_and_check(img: &Path) -> Fs {
    let fs = Fs::open_with(img, rw()).expect("recovering open");
    fs.close().expect("close");
    let fsck = e2fsck_fn(img);
    assert!(fsck.clean, "e2fsck after recovery: {}", fsck.output);
    Fs::open(img).expect("reopen")
}

#[test]
fn server_errors_fail_like_a_disk() {
    if !ready("server errors") {
        return;
    }
    let dir = TempDir::new("nbd-errors").expect("tmp");
    let img = dir.join("fs.img");
    let errors = dir.join("errors-on");
    sparse(&img, 64 * MIB);
    mkfs(&img, 0, 64 * MIB);
    let server = failing_server(&img, &errors);
    let fs = Fs::open_spec(&spec(&server.uri()), rw()).expect("open rw");
    let kept = pattern(1, 300_000);
    fs.write("/kept", &kept).expect("write");
    fs.open_file("/kept")
        .and_then(|f| f.sync_all())
        .expect("fsync");
    // The disk starts failing: the next fsync is an error, and nothing after it
    // is acknowledged, also once the server answers again.
    std::fs::write(&errors, b"").expect("error file");
    let w = fs
        .write("/lost", pattern(2, 300_000))
        .and_then(|_| fs.open_file("/lost").and_then(|f| f.sync_all()));
    assert!(w.is_err(), "an fsync on a failing disk succeeded");
    std::fs::remove_file(&errors).expect("rm error file");
    let again = fs
        .write("/after", b"x")
        .and_then(|_| fs.open_file("/after").and_then(|f| f.sync_all()));
    assert!(
        again.is_err(),
        "an fsync after the failure was acknowledged"
    );
    let _ = fs.close();
    drop(fs);
    drop(server);
    let fs = recover_and_check(&img);
    assert!(
        fs.read("/kept").expect("kept") == kept,
        "an fsynced file changed"
    );
}

#[test]
fn transient_errors_are_retried() {
    if !ready("transient errors") {
        return;
    }
    let dir = TempDir::new("nbd-transient").expect("tmp");
    let img = dir.join("disk.img");
    let errors = dir.join("errors-on");
    sparse(&img, 16 * MIB);
    let server = failing_server(&img, &errors);
    let dev = NbdDevice::open(&NbdOptions::new(server.uri()), false).expect("connect");
    // Errors for a moment: the request's retries (after 40, 160 and 640 ms) outlast it.
    std::fs::write(&errors, b"").expect("error file");
    let b = pattern(3, 64 << 10);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(60));
            std::fs::remove_file(&errors).expect("rm");
        });
        dev.write_at(&b, 4 * MIB)
            .expect("write retried past the errors");
    });
    dev.flush().expect("flush");
    let mut r = vec![0u8; 64 << 10];
    dev.read_at(&mut r, 4 * MIB).expect("read");
    assert_eq!(r, b);
    // Errors that last: the write fails after its retries; the device still works.
    std::fs::write(&errors, b"").expect("error file");
    let e = dev.write_at(&b, 0).expect_err("a lasting error");
    assert!(
        e.to_string().contains("Input/output error") || e.to_string().contains("NBD"),
        "{e}"
    );
    std::fs::remove_file(&errors).expect("rm");
    dev.write_at(&b, 0).expect("the server answers again");
}

#[test]
fn killed_server_errors_reach_the_caller_and_nothing_fsynced_is_lost() {
    if !ready("killed server") {
        return;
    }
    let dir = TempDir::new("nbd-kill").expect("tmp");
    let img = dir.join("fs.img");
    sparse(&img, 128 * MIB);
    mkfs(&img, 0, 128 * MIB);
    let mut server = NbdServer::file(&img).expect("nbdkit");
    let fs = Fs::open_spec(&spec(&server.uri()), rw()).expect("open rw");
    let synced = std::sync::Mutex::new(Vec::new());
    let errors = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (fs, synced, errors) = (&fs, &synced, &errors);
            sc.spawn(move || {
                let _ = fs.create_dir(format!("/t{t}"));
                for i in 0..10_000u64 {
                    let p = format!("/t{t}/f{i}");
                    let r = fs
                        .write(&p, pattern(t << 32 | i, 20_000))
                        .and_then(|_| fs.open_file(&p).and_then(|f| f.sync_all()));
                    match r {
                        Ok(()) => synced.lock().expect("lock").push((t, i)),
                        Err(_) => {
                            errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            return;
                        }
                    }
                }
            });
        }
        // Kill the server once some files are fsynced.
        while synced.lock().expect("lock").len() < 40 {
            std::thread::sleep(Duration::from_millis(5));
        }
        server.kill();
    });
    assert_eq!(
        errors.load(std::sync::atomic::Ordering::Relaxed),
        4,
        "every writer saw an error"
    );
    let _ = fs.close();
    drop(fs);
    let fs = recover_and_check(&img);
    let synced = synced.into_inner().expect("lock");
    for (t, i) in &synced {
        let got = fs
            .read(format!("/t{t}/f{i}"))
            .expect("an fsynced file is there");
        assert!(got == pattern(t << 32 | i, 20_000), "t{t}/f{i} changed");
    }
}

#[test]
fn hung_server_times_out() {
    if !ready("hung server") {
        return;
    }
    let dir = TempDir::new("nbd-hung").expect("tmp");
    let img = dir.join("fs.img");
    sparse(&img, 32 * MIB);
    mkfs(&img, 0, 32 * MIB);
    let server = NbdServer::file(&img).expect("nbdkit");
    let fs = Fs::open_spec(&spec(&format!("{}&timeout=2", server.uri())), rw()).expect("open");
    fs.write("/a", b"before").expect("write");
    server.pause();
    // Every request now waits for ever on the server's side: the device gives up
    // after its timeout, the fsync fails and the close returns.
    let r = fs.open_file("/a").and_then(|f| f.sync_all());
    assert!(r.is_err(), "an fsync on a hung server succeeded");
    let _ = fs.close();
}

#[test]
fn trim_punches_holes_in_the_served_file() {
    if !ready("trim") {
        return;
    }
    let dir = TempDir::new("nbd-trim").expect("tmp");
    let img = dir.join("fs.img");
    sparse(&img, 256 * MIB);
    mkfs(&img, 0, 256 * MIB);
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&img).expect("stat").blocks() * 512
    };
    let fresh = allocated();
    let server = NbdServer::file(&img).expect("nbdkit");
    let fs = Fs::open_spec(&spec(&server.uri()), rw()).expect("open rw");
    fs.write("/big", pattern(9, 96 << 20))
        .expect("write 96 MiB");
    fs.sync().expect("sync");
    let full = allocated();
    assert!(
        full > fresh + (90 << 20),
        "the file grew by {} bytes",
        full - fresh
    );
    fs.remove_file("/big").expect("rm");
    fs.sync_metadata().expect("commit");
    let trimmed = fs.trim(0, u64::MAX, 0).expect("trim");
    assert!(trimmed >= 96 << 20, "trimmed {trimmed} bytes");
    fs.close().expect("close");
    drop(server);
    let after = allocated();
    assert!(
        after < fresh + (4 << 20),
        "after trim the file holds {after} bytes (fresh: {fresh})"
    );
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "e2fsck: {}", fsck.output);
}

#[test]
fn unreachable_servers_and_bad_uris_are_clear_errors() {
    if !ready("bad input") {
        return;
    }
    let dir = TempDir::new("nbd-bad").expect("tmp");
    let msg = |t: &str| {
        let s = ImageSpec::parse(t).map_err(|e| e.to_string());
        match s {
            Err(e) => e,
            Ok(s) => Fs::open_spec(&s, FsOptions::default())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("{t} opened")),
        }
    };
    let e = msg(&format!(
        "nbd+unix:///?socket={}",
        dir.join("none.sock").display()
    ));
    assert!(e.contains("No such file"), "{e}");
    // A port nobody listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let e = msg(&format!("nbd://127.0.0.1:{port}/x"));
    assert!(e.contains("refused"), "{e}");
    // A server that accepts and never answers: the connect times out.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let e = msg(&format!("nbd://127.0.0.1:{port}/x?timeout=1"));
    assert!(e.contains("no answer") || e.contains("NBD"), "{e}");
    drop(listener);
    // Not an NBD server at all: something that answers garbage.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let t = std::thread::spawn(move || {
        if let Ok((mut c, _)) = listener.accept() {
            use std::io::Write;
            let _ = c.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
        }
    });
    let e = msg(&format!("nbd://127.0.0.1:{port}/x?timeout=5"));
    assert!(e.contains("NBD"), "{e}");
    t.join().expect("join");
    let e = msg("nbd://h:70000/x");
    assert!(e.contains("port '70000'"), "{e}");
    let e = msg("nbd+unix:///x");
    assert!(e.contains("socket=PATH"), "{e}");
    // An export that is not ext4.
    let server = NbdServer::memory(16 * MIB).expect("nbdkit memory");
    match Fs::open_spec(&spec(&server.uri()), FsOptions::default()) {
        Err(Error::NotExt4(_)) => {}
        r => panic!("an empty export: {:?}", r.err()),
    }
}

const WORKER_TEST: &str = "nbd_fsync_worker";
const ENV_WORKER_URI: &str = "REXT4_NBD_WORKER_URI";

/// The child of [`kill_9_during_fsyncs_over_nbd`]: four threads write files over the
/// NBD URI in `REXT4_NBD_WORKER_URI` and fsync each, printing `t i` once it is durable,
/// until killed. Does nothing when run as a test of its own.
#[test]
fn nbd_fsync_worker() {
    let Ok(uri) = std::env::var(ENV_WORKER_URI) else {
        return;
    };
    let fs = Fs::open_spec(&spec(&uri), rw()).expect("worker opens");
    let out = std::sync::Mutex::new(std::io::stdout());
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (fs, out) = (&fs, &out);
            sc.spawn(move || {
                let _ = fs.create_dir(format!("/t{t}"));
                for i in 0..1_000_000u64 {
                    let p = format!("/t{t}/f{i}");
                    fs.write(&p, pattern(t << 32 | i, 4096 + (i as usize % 7) * 3000))
                        .expect("write");
                    fs.open_file(&p).and_then(|f| f.sync_all()).expect("fsync");
                    use std::io::Write;
                    let mut o = out.lock().expect("lock");
                    writeln!(o, "{t} {i}").expect("print");
                    o.flush().expect("flush");
                }
            });
        }
    });
}

/// `kill -9` of rext4 during a 4-thread fsync workload over NBD, REXT4_NBD_KILL_RUNS
/// times (default 8), each killed after a different number of fsyncs: every file
/// fsynced before the kill is intact after recovery, and e2fsck is clean.
#[test]
fn kill_9_during_fsyncs_over_nbd() {
    if !ready("kill -9") {
        return;
    }
    let runs = common::env_u64("REXT4_NBD_KILL_RUNS", 8);
    let exe = std::env::current_exe().expect("test binary");
    for run in 0..runs {
        let dir = TempDir::new("nbd-kill9").expect("tmp");
        let img = dir.join("fs.img");
        sparse(&img, 64 * MIB);
        mkfs(&img, 0, 64 * MIB);
        let server = NbdServer::file(&img).expect("nbdkit");
        let mut child = Command::new(&exe)
            .args(["--exact", WORKER_TEST, "--nocapture", "--test-threads=1"])
            .env(ENV_WORKER_URI, server.uri())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the worker");
        let stdout = child.stdout.take().expect("stdout");
        let kill_after = 10 + run * 13;
        let mut synced = Vec::new();
        let mut killed = false;
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let mut w = line.split_whitespace().map(|x| x.parse::<u64>());
            if let (Some(Ok(t)), Some(Ok(i))) = (w.next(), w.next()) {
                synced.push((t, i));
            }
            if !killed && synced.len() as u64 >= kill_after {
                // SAFETY: kill(2) on the child this test spawned.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
                killed = true;
            }
        }
        let st = child.wait().expect("wait");
        assert!(killed, "run {run}: the worker ended by itself: {st}");
        drop(server);
        let fs = recover_and_check(&img);
        for (t, i) in &synced {
            let got = fs
                .read(format!("/t{t}/f{i}"))
                .unwrap_or_else(|e| panic!("run {run}: fsynced t{t}/f{i}: {e}"));
            assert!(
                got == pattern(t << 32 | i, 4096 + (*i as usize % 7) * 3000),
                "run {run}: t{t}/f{i} changed"
            );
        }
    }
}
