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
//! the damage before the same changes; the fast-commit runs
//! (`fuzz_replay_fast_commits_*`) mutate the fast-commit area (and the journal
//! superblock) of an image left with two fast commits to replay, made as the kernel
//! lays them out: a new file over free blocks, a hard link, an unlink of a file's last
//! name, an inode cut short.
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
    /// The fast-commit blocks (and the journal superblock) of an image left with fast
    /// commits to replay.
    FastCommits,
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

/// `base` as the kernel leaves an image whose last changes went out as fast commits:
/// no whole transaction in the log (`s_start` at a zeroed `s_first`), needs_recovery
/// set, and after the log two fast commits (`rext4_format::fast_commit::Writer`): a new
/// file in a free inode over free blocks; a hard link, the last name of another file
/// unlinked, and a file cut to 1000 bytes. Returns the image and the byte ranges of
/// the fast-commit blocks and of the journal superblock.
fn with_fast_commits(base: &[u8], bs: u64) -> (Vec<u8>, Vec<(u64, u64)>) {
    use rext4::format::extent::Extent;
    use rext4::format::fast_commit::{Writer, TAG_CREAT, TAG_LINK, TAG_UNLINK};
    use rext4::format::jbd2::{JournalSuperblock, INCOMPAT_FAST_COMMIT, SB_SIZE};
    use rext4::format::superblock::{feature, Superblock};
    let dev = Arc::new(MemDevice::new(base.to_vec()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts).expect("open");
    // A file made and removed: its inode and blocks are free again for the new one.
    fs.write("/fc-tmp", vec![0x46u8; 3 * bs as usize])
        .expect("write");
    fs.sync().expect("sync");
    let tmp = fs.metadata("/fc-tmp").expect("stat").ino;
    let (mut new_rec, _) = fs.inode_bytes(tmp).expect("record");
    let (_, tmp_runs) = fs.fiemap_ino(tmp, 64).expect("map");
    fs.remove_file("/fc-tmp").expect("unlink");
    let cut = fs.metadata("/small/b4097").expect("stat").ino;
    let (mut cut_rec, _) = fs.inode_bytes(cut).expect("record");
    let gone = fs.metadata("/small/one").expect("stat").ino;
    let small = fs.metadata("/small").expect("stat").ino;
    let (_, jruns) = fs
        .fiemap_ino(rext4::Ino(8), u64::MAX >> 20)
        .expect("the journal's map");
    fs.close().expect("close");
    drop(fs);
    let mut img = dev.snapshot();
    let physical = |j: u64| {
        jruns
            .iter()
            .find_map(|&(l, m)| match m {
                rext4::Mapping::Mapped { physical, len, .. } if (l..l + len).contains(&j) => {
                    Some(physical + j - l)
                }
                _ => None,
            })
            .expect("a journal block")
    };
    let at = |j: u64| (physical(j) * bs) as usize;
    let mut jsb = JournalSuperblock::decode(&img[at(0)..at(0) + SB_SIZE]).expect("jsb");
    jsb.feature_incompat |= INCOMPAT_FAST_COMMIT;
    let tid = jsb.sequence;
    jsb.start = jsb.first;
    let first = u64::from(jsb.first);
    img[at(first)..at(first) + bs as usize].fill(0);
    jsb.update_checksum();
    jsb.encode(&mut img[at(0)..at(0) + SB_SIZE])
        .expect("encode jsb");
    let mut sb = Superblock::decode(&img[1024..2048]).expect("superblock");
    sb.feature_incompat |= feature::INCOMPAT_RECOVER;
    sb.encode_into(&mut img[1024..2048]);
    // The records: inode records as the kernel logs them (128 + i_extra_isize bytes).
    let logged = |rec: &[u8]| {
        let extra = usize::from(u16::from_le_bytes([rec[0x80], rec[0x81]]));
        rec[..(128 + extra).min(rec.len())].to_vec()
    };
    let set32 = |rec: &mut Vec<u8>, off: usize, v: u32| {
        rec[off..off + 4].copy_from_slice(&v.to_le_bytes());
    };
    let generation =
        u32::from_le_bytes([new_rec[0x64], new_rec[0x65], new_rec[0x66], new_rec[0x67]]);
    set32(&mut new_rec, 0x64, generation.wrapping_add(1));
    new_rec[0x1A..0x1C].copy_from_slice(&1u16.to_le_bytes());
    set32(&mut new_rec, 0x14, 0);
    let mut w = Writer::new(bs as usize, tid);
    w.inode(tmp.0, &logged(&new_rec));
    for &(l, m) in &tmp_runs {
        if let rext4::Mapping::Mapped { physical, len, .. } = m {
            w.add_range(
                tmp.0,
                &Extent {
                    logical: l as u32,
                    len: len as u16,
                    physical,
                    unwritten: false,
                },
            );
        }
    }
    w.dentry(TAG_CREAT, 2, tmp.0, b"fc-new");
    w.inode(tmp.0, &logged(&new_rec));
    w.tail();
    w.dentry(TAG_LINK, 2, cut.0, b"fc-link");
    w.dentry(TAG_UNLINK, small.0, gone.0, b"one");
    w.del_range(cut.0, 1, 0x7fff_ffff);
    cut_rec[0x1A..0x1C].copy_from_slice(&2u16.to_le_bytes());
    set32(&mut cut_rec, 0x04, 1000);
    w.inode(cut.0, &logged(&cut_rec));
    w.tail();
    let area = u64::from(jsb.log_last()) + 1;
    let mut ranges = vec![(at(0) as u64, bs)];
    for (k, b) in w.blocks().iter().enumerate() {
        let o = at(area + k as u64);
        img[o..o + b.len()].copy_from_slice(b);
        ranges.push((o as u64, bs));
    }
    // The image replays to what the records say.
    let probe = Arc::new(MemDevice::new(img.clone()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(probe, opts).expect("the fast commits replay");
    assert_eq!(
        fs.read("/fc-new").expect("new file"),
        vec![0x46u8; 3 * bs as usize]
    );
    assert_eq!(fs.metadata("/fc-link").expect("link").nlink, 2);
    assert_eq!(fs.metadata("/small/b4097").expect("cut").size, 1000);
    assert!(fs.metadata("/small/one").is_err(), "unlinked");
    assert!(
        fs.check_counts().expect("counts").is_empty(),
        "the replay left counts wrong"
    );
    fs.close().expect("close");
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
        Area::FastCommits => {
            let (img, fc) = with_fast_commits(&base, bs);
            (Arc::new(img), fc)
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

#[test]
fn fuzz_replay_fast_commits_csum_4k() {
    let opts = MkfsOptions::new(4096, 16 << 20)
        .arg("-O")
        .arg("fast_commit");
    fuzz_writes(opts, "fast commits csum 4k", 15, Area::FastCommits);
}

#[test]
fn fuzz_replay_fast_commits_no_csum_1k() {
    let opts = MkfsOptions::new(1024, 16 << 20)
        .arg("-O")
        .arg("fast_commit,^metadata_csum");
    fuzz_writes(opts, "fast commits no-csum 1k", 16, Area::FastCommits);
}

/// Records that pass every checksum but say anything: random sequences of INODE,
/// ADD_RANGE, DEL_RANGE, CREAT, LINK and UNLINK over free and used inodes and blocks,
/// the filesystem's own blocks, blocks past its end, files that are not directories
/// and names that are not names, laid out as the kernel does. Each image is opened
/// read-write (the replay): refused with an error, or replayed — then the free counts
/// and bitmaps must agree and every metadata block verify (`Fs::audit`), and the image
/// reopen and walk. No panic, no hang, no write outside the image.
#[test]
fn fuzz_fast_commit_records() {
    use rext4::format::extent::Extent;
    use rext4::format::fast_commit::{Writer, TAG_CREAT, TAG_LINK, TAG_UNLINK};
    let opts = MkfsOptions::new(4096, 16 << 20)
        .arg("-O")
        .arg("fast_commit");
    let (base, bs, _) = fuzz_base(&opts);
    let (img, ranges) = with_fast_commits(&base, bs);
    // The image with its area emptied: each case writes its own records there.
    let mut empty = img.clone();
    let jsb = ranges[0];
    let area: Vec<u64> = ranges[1..].iter().map(|r| r.0).collect();
    for &o in &area {
        empty[o as usize..(o + bs) as usize].fill(0);
    }
    let _ = jsb;
    // What the records may name.
    let fs = Fs::open_device(
        Arc::new(MemDevice::read_only(base.to_vec())),
        FsOptions::default(),
    )
    .expect("open");
    let sb = fs.superblock();
    let ino_of = |p: &str| fs.metadata(p).expect("stat").ino.0;
    // Values a kernel could log first, then ones it could not (each picked less often).
    let inodes = [
        ino_of("/small/b4097"),
        ino_of("/small/one"),
        ino_of("/small"),
        ino_of("/frag"),
        sb.first_ino + 40,
        sb.first_ino + 41,
        2,
        sb.inodes_count,
        sb.inodes_count + 1,
        0,
    ];
    let record = |p: &str| {
        let (r, _) = fs
            .inode_bytes(fs.metadata(p).expect("stat").ino)
            .expect("record");
        r[..160].to_vec()
    };
    let records = [
        record("/small/b4097"),
        record("/small"),
        record("/fastlink"),
    ];
    let (_, used) = fs
        .fiemap_ino(fs.metadata("/frag").expect("stat").ino, 8)
        .expect("map");
    let used_blk = used
        .iter()
        .find_map(|&(_, m)| match m {
            rext4::Mapping::Mapped { physical, .. } => Some(physical),
            _ => None,
        })
        .expect("a used block");
    let blocks = [
        sb.blocks_count - 30,
        sb.blocks_count - 100,
        sb.blocks_count - 1,
        used_blk,
        1,
        sb.blocks_count,
        u64::MAX >> 17,
    ];
    let names: [&[u8]; 6] = [b"one", b"b4097", b"fc-new", b"x/y", b".", b"\xffname"];
    // Mostly among the first `good` of `n`, sometimes any.
    let pick = |rng: &mut Rng, n: usize, good: usize| {
        if rng.below(8) == 0 {
            rng.below(n as u64) as usize
        } else {
            rng.below(good as u64) as usize
        }
    };
    drop(fs);
    let tid = {
        let r = rext4::journal::examine(&MemDevice::read_only(img.clone())).expect("examine");
        r.end_sequence
    };
    let seed = 21 + env_u64("REXT4_FUZZ_SEED", 0);
    let mut rng = Rng(seed);
    let (mut replayed, mut refused) = (0u64, 0u64);
    for n in 0..env_u64("REXT4_FUZZ_CASES", 250) {
        let mut w = Writer::new(bs as usize, tid);
        let mut log = Vec::new();
        for _ in 0..1 + rng.below(12) {
            let ino = inodes[pick(&mut rng, inodes.len(), 6)];
            match rng.below(6) {
                0 => {
                    let mut r = records[rng.below(3) as usize].clone();
                    for _ in 0..rng.below(4) {
                        let at =
                            [0x0, 0x1, 0x4, 0x1A, 0x20, 0x22, 0x64, 0x80][rng.below(8) as usize];
                        r[at] = rng.next_u64() as u8;
                    }
                    w.inode(ino, &r[..128 + rng.below(33) as usize]);
                    log.push(format!("INODE {ino}"));
                }
                1 => {
                    let e = Extent {
                        logical: [0, 1, 7, u32::MAX - 3][pick(&mut rng, 4, 3)],
                        len: rng.below(40) as u16,
                        physical: blocks[pick(&mut rng, blocks.len(), 4)],
                        unwritten: rng.below(3) == 0,
                    };
                    w.add_range(ino, &e);
                    log.push(format!("ADD_RANGE {ino} {e:?}"));
                }
                2 => {
                    let (l, k) = (
                        [0, 1, 3][rng.below(3) as usize],
                        [1, 2, 0x7fff_ffff][rng.below(3) as usize],
                    );
                    w.del_range(ino, l, k);
                    log.push(format!("DEL_RANGE {ino} {l} {k}"));
                }
                _ => {
                    let tag = [TAG_CREAT, TAG_LINK, TAG_UNLINK][rng.below(3) as usize];
                    let parent = [2, inodes[2], inodes[0], inodes[pick(&mut rng, 10, 10)]]
                        [pick(&mut rng, 4, 2)];
                    let name = names[pick(&mut rng, names.len(), 3)];
                    w.dentry(tag, parent, ino, name);
                    log.push(format!("dentry {tag} {parent} {ino} {name:?}"));
                }
            }
            if rng.below(4) == 0 {
                w.tail();
                log.push("TAIL".into());
            }
        }
        w.tail();
        let mut case_img = empty.clone();
        for (k, b) in w.blocks().iter().enumerate().take(area.len()) {
            let o = area[k] as usize;
            case_img[o..o + b.len()].copy_from_slice(b);
        }
        if std::env::var_os("REXT4_FUZZ_TRACE").is_some() {
            eprintln!("[fast-commit records] case {n}: {log:?}");
        }
        let what = format!("[fast-commit records] case {n} (seed {seed}): {log:?}");
        let size = case_img.len() as u64;
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            let dev = Arc::new(Hooked::mem(
                case_img,
                Bounds {
                    size,
                    boot: Vec::new(),
                    outside: AtomicU64::new(0),
                },
            ));
            let opts = FsOptions {
                read_only: false,
                commit_secs: 0,
                ..FsOptions::default()
            };
            let out = match Fs::open_device(dev.clone(), opts) {
                Ok(fs) => {
                    let counts = fs.check_counts().expect("counts");
                    let audit = fs.audit().expect("audit");
                    let _ = fs.close();
                    let problems: Vec<String> =
                        audit.problems.iter().map(|e| e.to_string()).collect();
                    Ok((counts, problems))
                }
                Err(e) => Err(e.to_string()),
            };
            let outside = dev.outside.load(Ordering::SeqCst);
            if let Ok(fs) = Fs::open_device(
                Arc::new(MemDevice::read_only(dev.snapshot())),
                FsOptions::default(),
            ) {
                let _ = snapshot_limited(&fs, 1 << 20);
            }
            let _ = tx.send((out, outside));
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok((_, outside)) if outside > 0 => panic!("{what}: {outside} writes outside"),
            Ok((Ok((counts, problems)), _)) => {
                assert!(
                    counts.is_empty(),
                    "{what}: counts after the replay: {counts:?}"
                );
                assert!(problems.is_empty(), "{what}: the audit found {problems:?}");
                replayed += 1;
            }
            Ok((Err(_), _)) => refused += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what} hangs"),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = worker.join();
                panic!("{what} panicked");
            }
        }
        worker.join().expect("case thread");
    }
    eprintln!("[fast-commit records] {replayed} replayed, {refused} refused");
    assert!(
        replayed > 0 && refused > 0,
        "the cases did not reach both outcomes"
    );
}
