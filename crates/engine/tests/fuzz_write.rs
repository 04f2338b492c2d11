//! Robustness of the write paths: random byte mutations of the metadata of valid,
//! populated images (as `fuzz.rs` makes them), then the image opened read-write and
//! one fixed run of changes made to it: a new file written, an append to the
//! fragmented file (a deep extent tree), writes into the sparse file's data and holes,
//! truncates down and up, unlinks (one of two hard links, a small file), renames within
//! and between directories, creates and unlinks in the indexed directory, a directory
//! made and removed in the deep tree, a symlink, xattrs set in the inode and in a block
//! and removed, fallocate, a punch and a zero range, the deep tree removed whole, an
//! fsync, a sync and the close. Then the image as they left it is opened again and
//! walked. The replay runs (`fuzz_replay_*`) mutate instead the log, and the journal
//! superblock, of an image a crash left with committed transactions: the open replays
//! the damage before the same changes.
//!
//! Each step must end in a value or an error: no panic, no hang (a watchdog fails a
//! case after 30 s), and no write outside the image or changing its first 1024 bytes
//! (the boot area, which ext4 never changes; a replay may, writing a mutated logged
//! copy of block 0): the device refuses such a write and the case fails. A corrupted
//! image may well end in a shut-down filesystem; that is an error, not a failure.
//!
//! Cases: `REXT4_FUZZ_CASES` (default 250 per test); `REXT4_FUZZ_SEED` adds to each
//! test's seed, so a campaign of seeds in release explores other mutations;
//! `REXT4_FUZZ_TRACE` prints each case's mutations before it runs, and why an open
//! was refused.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{env_u64, fuzz_base, mutations, snapshot_limited, Hooked, Hooks, Rng};
use rext4::device::MemDevice;
use rext4::{FallocMode, Fs, FsOptions, OpenOptions, XattrFlags};
use rext4_testkit::fixture::big_dir_name;
use rext4_testkit::MkfsOptions;

/// Refuses, and counts, any write past the image's end or changing its first 1024
/// bytes (the boot area: ext4 writes block 0 of a 4 KiB-block image for the
/// superblock in it, but leaves those bytes as they were).
struct Bounds {
    size: u64,
    boot: Vec<u8>,
    outside: AtomicU64,
}

impl Hooks for Bounds {
    fn write(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        let past_end = off
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.size);
        let boot = self.boot.len() as u64;
        let boot_changed = off < boot && {
            let n = buf.len().min((boot - off) as usize);
            buf[..n] != self.boot[off as usize..off as usize + n]
        };
        if past_end || boot_changed {
            self.outside.fetch_add(1, Ordering::SeqCst);
            return Err(std::io::Error::other(format!(
                "write of {} bytes at {off}: outside the image's filesystem area",
                buf.len()
            )));
        }
        Ok(())
    }
}

/// The run of changes (see the module note); returns how many steps succeeded.
fn changes(fs: &Fs) -> usize {
    let mut ok = 0;
    let mut step = |r: rext4::Result<()>| ok += usize::from(r.is_ok());
    let rw = |p: &str| OpenOptions::new().read(true).write(true).open(fs, p);
    step(fs.write("/new", vec![0x4e; 20 << 10]));
    step(rw("/frag").and_then(|f| {
        let len = f.len()?;
        f.write_all_at(&[0x46; 8192], len)
    }));
    step(rw("/sparse").and_then(|f| {
        f.write_all_at(&[0x53; 4096], (1 << 20) - 100)?;
        f.write_all_at(&[0x54; 6000], 5 << 20)
    }));
    step(rw("/small/m1p3").and_then(|f| f.set_len(1000)));
    step(rw("/small/b4097").and_then(|f| f.set_len(3 << 20)));
    step(fs.remove_file("/small/b4096"));
    step(fs.remove_file("/hl1"));
    step(fs.rename("/small/one", "/dir/one2"));
    let big = |i: u32| {
        let mut p = b"/big/".to_vec();
        p.extend_from_slice(&big_dir_name(i));
        std::path::PathBuf::from(
            <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(p),
        )
    };
    step(fs.rename(big(5), "/big/renamed"));
    for i in 0..40 {
        step(fs.write(format!("/big/added-{i:03}"), b"x"));
    }
    for i in (10..50).step_by(2) {
        step(fs.remove_file(big(i)));
    }
    step(fs.create_dir("/deep/l01/new"));
    step(fs.remove_dir("/deep/l01/new"));
    step(fs.symlink("small/b4095", "/newlink"));
    let on_ino = |p: &str, f: &dyn Fn(rext4::Ino) -> rext4::Result<()>| {
        fs.resolve(p.as_bytes(), true).and_then(f)
    };
    step(on_ino("/xattr/big", &|ino| {
        fs.set_xattr_ino(ino, b"user.new", &[0x58; 100], XattrFlags::default())
    }));
    step(on_ino("/xattr/small", &|ino| {
        fs.set_xattr_ino(ino, b"user.more", b"in the inode", XattrFlags::default())
    }));
    step(on_ino("/xattr/small", &|ino| {
        fs.remove_xattr_ino(ino, b"user.small")
    }));
    step(on_ino("/prealloc", &|ino| {
        fs.fallocate_ino(ino, FallocMode::KeepSize, 0, 64 << 10)
    }));
    step(on_ino("/frag", &|ino| {
        fs.fallocate_ino(ino, FallocMode::PunchHole, 10 << 10, 30 << 10)
    }));
    step(on_ino("/sparse", &|ino| {
        fs.fallocate_ino(ino, FallocMode::ZeroRange { keep_size: true }, 0, 12 << 10)
    }));
    step(fs.remove_dir_all("/deep"));
    step(rw("/new").and_then(|f| f.sync_all()));
    step(fs.sync());
    step(fs.close());
    ok
}

/// One case: `patches` applied to `base`, the changes made, the result walked again.
/// Returns the steps that succeeded, or the writes refused as outside the image (or,
/// with `boot`, changing its boot area).
fn case(base: &[u8], patches: &[(u64, u8)], boot: bool) -> Result<usize, u64> {
    let mut img = base.to_vec();
    for &(at, v) in patches {
        img[at as usize] = v;
    }
    let dev = Arc::new(Hooked::mem(
        img,
        Bounds {
            size: base.len() as u64,
            boot: if boot {
                base[..1024].to_vec()
            } else {
                Vec::new()
            },
            outside: AtomicU64::new(0),
        },
    ));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let done = match Fs::open_device(dev.clone(), opts) {
        Ok(fs) => changes(&fs),
        Err(e) => {
            if std::env::var_os("REXT4_FUZZ_TRACE").is_some() {
                eprintln!("  open refused: {e}");
            }
            0
        }
    };
    let outside = dev.outside.load(Ordering::SeqCst);
    if outside > 0 {
        return Err(outside);
    }
    let after = Arc::new(MemDevice::read_only(dev.snapshot()));
    if let Ok(fs) = Fs::open_device(after, FsOptions::default()) {
        let _ = snapshot_limited(&fs, 1 << 20);
        let _ = fs.audit();
    }
    Ok(done)
}

/// Where a run's mutations land.
#[derive(Clone, Copy, PartialEq)]
enum Area {
    /// The metadata blocks of a clean image.
    Metadata,
    /// The used part of the log (and the journal superblock) of an image a crash left
    /// with committed transactions to replay.
    Log,
}

/// `base` after two committed transactions of changes of several kinds, as a crash
/// leaves it (the log not checkpointed), and the byte ranges of the log blocks they
/// take and of the journal superblock.
fn with_log(base: &[u8], bs: u64) -> (Vec<u8>, Vec<(u64, u64)>) {
    let dev = Arc::new(MemDevice::new(base.to_vec()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts).expect("open");
    fs.write("/logged", vec![0x4c; 9000]).expect("write");
    fs.create_dir("/logged-dir").expect("mkdir");
    fs.rename("/small/one", "/logged-dir/one").expect("rename");
    fs.sync().expect("commit");
    fs.remove_file("/small/b4096").expect("unlink");
    fs.write("/big/logged-entry", b"x").expect("create");
    let ino = fs.resolve(b"/xattr/small", true).expect("resolve");
    fs.set_xattr_ino(ino, b"user.logged", b"v", XattrFlags::default())
        .expect("xattr");
    fs.sync().expect("commit");
    let img = dev.snapshot();
    let (_, runs) = fs
        .fiemap_ino(rext4::Ino(8), u64::MAX >> 20)
        .expect("the journal's map");
    drop(fs);
    let r = rext4::journal::examine(&MemDevice::read_only(img.clone())).expect("examine");
    assert!(
        r.needed && r.transactions >= 2 && r.log_head > r.log_start,
        "the image holds no log to replay: {r:?}"
    );
    let physical = |j: u64| {
        runs.iter()
            .find_map(|&(l, m)| match m {
                rext4::Mapping::Mapped { physical, len, .. } if (l..l + len).contains(&j) => {
                    Some(physical + j - l)
                }
                _ => None,
            })
            .expect("a journal block")
    };
    let ranges = std::iter::once(0)
        .chain(u64::from(r.log_start)..u64::from(r.log_head))
        .map(|j| (physical(j) * bs, bs))
        .collect();
    (img, ranges)
}

fn fuzz_writes(opts: MkfsOptions, label: &str, seed: u64, area: Area) {
    let seed = seed + env_u64("REXT4_FUZZ_SEED", 0);
    let (base, bs, ranges) = fuzz_base(&opts);
    let (base, ranges) = match area {
        Area::Metadata => (base, ranges),
        Area::Log => {
            let (img, log) = with_log(&base, bs);
            (Arc::new(img), log)
        }
    };
    // A replay writes logged copies of block 0 whole, boot area included: only the
    // metadata runs check that area.
    let boot = area == Area::Metadata;
    // The unmutated image takes every step.
    let clean = case(&base, &[], boot).expect("no write outside the image");
    let trace = std::env::var_os("REXT4_FUZZ_TRACE").is_some();
    let mut rng = Rng(seed);
    let (mut all, mut some, mut none) = (0u64, 0u64, 0u64);
    for n in 0..env_u64("REXT4_FUZZ_CASES", 250) {
        let patches = mutations(&mut rng, &base, &ranges, 8);
        if trace {
            // What a crash that takes the process (a stack overflow aborts it) ran.
            eprintln!("[{label}] case {n}: patches {patches:?}");
        }
        let b = base.clone();
        let p = patches.clone();
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            let _ = tx.send(case(&b, &p, boot));
        });
        let what = || format!("[{label}] case {n} (seed {seed}, patches {patches:?})");
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(k)) if k == clean => all += 1,
            Ok(Ok(0)) => none += 1,
            Ok(Ok(_)) => some += 1,
            Ok(Err(outside)) => panic!("{}: {outside} writes outside the image", what()),
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("{} hangs", what()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = worker.join();
                panic!("{} panicked", what());
            }
        }
        worker.join().expect("case thread");
    }
    eprintln!(
        "[{label}] {} cases: {all} took all {clean} steps, {some} some, {none} none",
        all + some + none
    );
    // The mutations must reach the write paths: some cases fail a step, others not.
    assert!(
        some + none > 0 && all + some > 0,
        "[{label}] the mutations changed nothing"
    );
}

#[test]
fn fuzz_writes_no_csum_1k() {
    let opts = MkfsOptions::new(1024, 16 << 20)
        .arg("-O")
        .arg("^metadata_csum");
    fuzz_writes(opts, "writes no-csum 1k", 11, Area::Metadata);
}

#[test]
fn fuzz_writes_csum_4k_upstream() {
    let opts = MkfsOptions::new(4096, 16 << 20).upstream(true);
    fuzz_writes(opts, "writes csum 4k upstream", 12, Area::Metadata);
}

#[test]
fn fuzz_replay_no_csum_4k() {
    let opts = MkfsOptions::new(4096, 16 << 20)
        .arg("-O")
        .arg("^metadata_csum");
    fuzz_writes(opts, "replay no-csum 4k", 13, Area::Log);
}

#[test]
fn fuzz_replay_csum_1k() {
    let opts = MkfsOptions::new(1024, 16 << 20);
    fuzz_writes(opts, "replay csum 1k", 14, Area::Log);
}
