//! SEEDS lesson B over `rext4 mount` (issue #16): the stale-data reproducer through the
//! kernel, with forced reclaim at every step, on a fresh image mounted with the default
//! options and on one mounted `-o nowriteback_cache`.
//!
//! Per iteration: ftruncate 0, fallocate 0..32 KiB, pwrite 4 KiB of 0xcd at 0,
//! ftruncate 2 KiB, each step followed by sync_file_range(WRITE|WAIT_AFTER) and
//! posix_fadvise(DONTNEED) of the whole file; then page 0 is mapped afresh and bytes
//! [2 KiB, 4 KiB) must be zero, and pread must return 2048 bytes of 0xcd, then EOF;
//! then the file is extended back to 4 KiB (reclaimed again) and the old tail read
//! from the server must be zero (the kernel zero-fills past EOF in its own pages, so
//! only this read sees the server's zeroing when the kernel's pages are gone). A
//! second thread does sync_file_range + fadvise DONTNEED on the same descriptor without
//! pause. `REXT4_STALE_ITERS` iterations (default 10000). After the unmount the server
//! must have exited cleanly and e2fsck -fn must find the image clean.
//!
//! The mount is a `Mounted` guard (unmounted and reaped on drop, also on panic), with a
//! watchdog that kills a stuck server. Skips (printing why) without root or /dev/fuse.

mod fuse_mount;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fuse_mount::{cannot_mount, Mounted, Watchdog};
use rext4_testkit::{e2fsck_fn, mkfs, skip, MkfsOptions};

const PAGE: usize = 4096;
const EOF_BYTES: usize = 2048;

fn iters() -> u64 {
    std::env::var("REXT4_STALE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Write the file back and drop its clean pages: sync_file_range(WRITE|WAIT_AFTER) +
/// posix_fadvise(DONTNEED) of the whole file.
fn reclaim(f: &File) -> Result<(), String> {
    let fd = f.as_raw_fd();
    // SAFETY: a descriptor this test owns; offset 0, length 0 (to EOF), valid flags.
    let r = unsafe {
        libc::sync_file_range(
            fd,
            0,
            0,
            libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        )
    };
    if r != 0 {
        return Err(format!("sync_file_range: {}", io::Error::last_os_error()));
    }
    // SAFETY: as above; posix_fadvise returns the error number rather than setting errno.
    let r = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(format!("fadvise: {}", io::Error::from_raw_os_error(r)));
    }
    Ok(())
}

/// Step `what` of an iteration, then reclaim.
fn step(f: &File, what: &str, r: io::Result<()>) -> Result<(), String> {
    r.map_err(|e| format!("{what}: {e}"))?;
    reclaim(f)
}

/// Nonzero bytes in [2 KiB, 4 KiB) of a fresh shared mapping of page 0.
fn mapped_stale(f: &File) -> Result<usize, String> {
    // SAFETY: a read-only shared mapping of one page of a file this test owns; checked
    // for MAP_FAILED below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap: {}", io::Error::last_os_error()));
    }
    // SAFETY: the mapping is PAGE bytes long and readable; the file's 2048 bytes reach
    // into page 0, so no access to it faults (SIGBUS), and nothing else maps or
    // truncates the file while the slice lives.
    let tail =
        unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(EOF_BYTES), PAGE - EOF_BYTES) };
    let stale = tail.iter().filter(|&&b| b != 0).count();
    // SAFETY: unmapping the mapping made above; `tail` is not used after this.
    let r = unsafe { libc::munmap(p, PAGE) };
    if r != 0 {
        return Err(format!("munmap: {}", io::Error::last_os_error()));
    }
    Ok(stale)
}

/// One iteration (see the module note): the stale bytes it saw, and what they were.
fn iteration(f: &File) -> Result<(usize, String), String> {
    step(f, "ftruncate 0", f.set_len(0))?;
    // SAFETY: a descriptor this test owns; mode 0 (allocate, extending the size).
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 32 << 10) };
    step(
        f,
        "fallocate",
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        },
    )?;
    step(f, "pwrite", f.write_all_at(&[0xcd; PAGE], 0))?;
    step(f, "ftruncate 2k", f.set_len(EOF_BYTES as u64))?;
    let mapped = mapped_stale(f)?;
    let mut buf = [0u8; PAGE];
    let n = f.read_at(&mut buf, 0).map_err(|e| format!("pread: {e}"))?;
    let past_eof = f
        .read_at(&mut buf[n..], n as u64)
        .map_err(|e| format!("pread at EOF: {e}"))?;
    let read_wrong = buf[..n.min(EOF_BYTES)]
        .iter()
        .filter(|&&b| b != 0xcd)
        .count()
        + n.abs_diff(EOF_BYTES)
        + past_eof;
    // The kernel zero-fills a page past EOF itself, so the checks above see the
    // server's zeroing only through its own pages. Extending the file back over the old
    // tail, with the kernel's pages dropped, makes the server answer for those bytes.
    step(f, "ftruncate 4k", f.set_len(PAGE as u64))?;
    let mut tail = [0xffu8; PAGE - EOF_BYTES];
    f.read_exact_at(&mut tail, EOF_BYTES as u64)
        .map_err(|e| format!("pread of the old tail: {e}"))?;
    let old_tail = tail.iter().filter(|&&b| b != 0).count();
    Ok((
        mapped + read_wrong + old_tail,
        format!(
            "{mapped} nonzero bytes past EOF in the mapping; pread returned {n} bytes, then \
             {past_eof} at EOF, {read_wrong} wrong; {old_tail} nonzero bytes of the old \
             tail after extending to 4 KiB"
        ),
    ))
}

/// SEEDS lesson B's reproducer through the kernel on a fresh image mounted with `opts`.
fn reproduce_over_mount(opts: &[&str]) {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    let iters = iters();
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs.ext4");
    let mut m = Mounted::new(img.path(), opts);
    // A stuck request fails the test instead of blocking it.
    let limit = Duration::from_secs(120) + Duration::from_millis(20 * iters);
    let _dog = Watchdog::new("stale_past_eof", m.pid(), limit);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.join("stale"))
        .expect("create the file");
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (done, stale_bytes, bad, first, raced, failed) = std::thread::scope(|sc| {
        let racer = sc.spawn(|| {
            let mut passes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                reclaim(&f)?;
                passes += 1;
            }
            Ok::<u64, String>(passes)
        });
        // No panic before `stop` is set: the scope would wait for the racer forever.
        let (mut done, mut stale_bytes, mut bad, mut first) = (0u64, 0u64, 0u64, None);
        let mut failed = None;
        while done < iters && !racer.is_finished() {
            let (stale, what) = match iteration(&f) {
                Ok(seen) => seen,
                Err(e) => {
                    failed = Some(format!("iteration {done}: {e}"));
                    break;
                }
            };
            if stale > 0 {
                stale_bytes += stale as u64;
                bad += 1;
                first.get_or_insert(format!("iteration {done}: {what}"));
            }
            done += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let raced = racer.join().expect("racer");
        (done, stale_bytes, bad, first, raced, failed)
    });
    if let Some(e) = failed {
        panic!("{e}");
    }
    let raced = raced.expect("racer");
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "stale_past_eof {opts:?}: {done} iterations in {secs:.1} s, {stale_bytes} stale bytes \
         in {bad} iterations, racer {raced} passes"
    );
    assert_eq!(done, iters, "the loop ran every iteration");
    assert_eq!(
        stale_bytes, 0,
        "{stale_bytes} stale bytes in {bad} of {iters} iterations; first at {first:?}"
    );
    assert!(raced > 0, "the racer ran");
    drop(f);
    let st = m.unmount();
    assert!(st.success(), "rext4 mount exit {st}: {}", m.stderr());
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck -fn not clean:\n{}", r.output);
}

/// The default mount: the kernel's page cache holds the written data and zeroes the
/// EOF page's tail itself (writeback cache).
#[test]
fn no_stale_bytes_past_eof_over_the_mount_with_reclaim_at_every_step() {
    reproduce_over_mount(&[]);
}

/// Without the writeback cache every write and truncate reaches the server at once, so
/// the zeroing past EOF is the engine's.
#[test]
fn no_stale_bytes_past_eof_over_a_nowriteback_cache_mount() {
    reproduce_over_mount(&["nowriteback_cache"]);
}
