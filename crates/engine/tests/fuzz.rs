//! Robustness: random byte mutations of the metadata of valid images (with and without
//! metadata_csum, so mutations also reach the parsers behind the checksums), then a
//! full walk: open, every directory, every file's first MiB, every symlink and xattr,
//! and the metadata audit. Each case must end in a value or an error: no panic, no hang
//! (a watchdog fails a case after 30 s), and no single allocation larger than the image.
//!
//! A fourth image holds xattr values in inodes of their own (ea_inode: references, value
//! inode records and the entries naming them are mutated too).
//!
//! Case count: `REXT4_FUZZ_CASES` (default 1500 per image, 4 images); `REXT4_FUZZ_SEED`
//! adds to each image's seed (a campaign of seeds explores other mutations).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::{env_u64, fuzz_base_with, mutations, open_patched, snapshot_limited, Rng};

use rext4_testkit::MkfsOptions;

/// Largest allocation made by an armed thread (a walk in progress).
static LARGEST: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
}

struct Watch;

// SAFETY: every call is forwarded unchanged to the system allocator; the wrapper only
// records sizes in an atomic and reads a const-initialized thread-local (no allocation).
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if ARMED.with(|a| a.get()) {
            LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from System.alloc with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if ARMED.with(|a| a.get()) {
            LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if ARMED.with(|a| a.get()) {
            LARGEST.fetch_max(new, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Watch = Watch;

fn fuzz_image(opts: MkfsOptions, label: &str, seed: u64) {
    fuzz_image_with(opts, label, seed, |_| {})
}

fn fuzz_image_with(opts: MkfsOptions, label: &str, seed: u64, extra: impl FnOnce(&Path)) {
    let seed = seed + env_u64("REXT4_FUZZ_SEED", 0);
    let (base, _, ranges) = fuzz_base_with(&opts, extra);
    let image_len = base.len();
    let mut rng = Rng(seed);
    let (mut ok, mut errs) = (0u64, 0u64);
    for case in 0..env_u64("REXT4_FUZZ_CASES", 1500) {
        let patches = mutations(&mut rng, &base, &ranges, 16);
        let b = base.clone();
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            ARMED.with(|a| a.set(true));
            let r = open_patched(&b, patches).and_then(|fs| {
                let t = snapshot_limited(&fs, 1 << 20)?;
                let a = fs.audit()?;
                Ok((t.len(), a.problems.len()))
            });
            ARMED.with(|a| a.set(false));
            let _ = tx.send(r.is_ok());
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(true) => ok += 1,
            Ok(false) => errs += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("[{label}] case {case} (seed {seed}) hangs")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = worker.join();
                panic!("[{label}] case {case} (seed {seed}) panicked");
            }
        }
        worker.join().expect("walk thread");
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            largest <= image_len,
            "[{label}] case {case}: allocation of {largest} bytes > image of {image_len}"
        );
    }
    eprintln!(
        "[{label}] {} cases: {ok} read fully, {errs} ended in an error; largest allocation {} bytes",
        ok + errs,
        LARGEST.load(Ordering::Relaxed)
    );
}

#[test]
fn fuzz_metadata_csum_1k() {
    fuzz_image(MkfsOptions::new(1024, 16 << 20), "csum 1k", 1);
}

#[test]
fn fuzz_no_csum_4k() {
    let opts = MkfsOptions::new(4096, 16 << 20)
        .arg("-O")
        .arg("^metadata_csum");
    fuzz_image(opts, "no-csum 4k", 2);
}

#[test]
fn fuzz_no_csum_1k_upstream() {
    let opts = MkfsOptions::new(1024, 16 << 20)
        .upstream(true)
        .arg("-O")
        .arg("^metadata_csum,^metadata_csum_seed,^orphan_file");
    fuzz_image(opts, "no-csum 1k", 3);
}

/// Values of 30 KiB and 60 KiB in inodes of their own (debugfs makes them as libext2fs
/// does) on a file and a directory of the fixture; no metadata_csum, so mutations of
/// the entries and the value inodes reach the checks behind the checksums.
#[test]
fn fuzz_ea_inode_4k() {
    let opts = MkfsOptions::new(4096, 16 << 20)
        .arg("-O")
        .arg("ea_inode,^metadata_csum");
    fuzz_image_with(opts, "ea_inode no-csum 4k", 4, |img| {
        let dir = rext4_testkit::TempDir::new("fuzz-ea").expect("tmp");
        let mut script = String::from("write /dev/null eaf\nmkdir ead\n");
        for (name, len, target) in [
            ("user.big", 30 << 10, "/eaf"),
            ("trusted.max", 60 << 10, "/eaf"),
            ("user.d", 20 << 10, "/ead"),
        ] {
            let v: Vec<u8> = (0..len).map(|i: u32| (i * 31 % 251) as u8).collect();
            let f = dir.join(name);
            std::fs::write(&f, v).expect("value file");
            script.push_str(&format!("ea_set -f {} {target} {name}\n", f.display()));
        }
        rext4_testkit::debugfs_w_checked(img, script).expect("debugfs ea_set");
        // libext2fs 1.47.0 does not charge the files' i_blocks for their values in
        // inodes (the kernel does, e2fsck expects it): let e2fsck set them.
        rext4_testkit::e2fsck_fy(img);
        let fsck = rext4_testkit::e2fsck_fn(img);
        assert!(fsck.clean, "ea_inode fuzz base: {}", fsck.output);
    });
}
