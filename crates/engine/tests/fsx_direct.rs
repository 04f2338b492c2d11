//! fsx-style random I/O on one file, O_DIRECT first (SEEDS lesson A): direct writes and
//! reads of any size at sector-aligned and unaligned offsets, mixed with buffered
//! writes and reads, truncates up and down, fallocate (allocate, keep-size, punch,
//! zero range), batches of direct writes in flight together (`write_direct_batch_ino`),
//! fsyncs, dropped caches and whole close/reopen cycles, each checked
//! against a byte array. Every read must return the model's bytes; every few hundred
//! operations, and after each reopen, the whole file is compared; at the end e2fsck
//! -fn must be clean.
//!
//! `REXT4_FSX_OPS` operations per run (default 12,000 for each block size; a long run:
//! `REXT4_FSX_OPS=1000000 cargo test --release -p rext4 --test fsx_direct`),
//! `REXT4_FSX_SEED` to replay one seed. A failure names the seed and the operation.

use rext4::{FallocMode, Fs, Ino};
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions};

/// The file never grows past this.
const MAX: u64 = 1 << 20;
/// The longest single write or read.
const MAXLEN: u64 = 96 << 10;

#[derive(Debug, Clone)]
enum Op {
    DirectWrite {
        off: u64,
        len: u64,
    },
    DirectRead {
        off: u64,
        len: u64,
    },
    /// Non-overlapping direct writes submitted as one batch.
    DirectBatch {
        writes: Vec<(u64, u64)>,
    },
    Write {
        off: u64,
        len: u64,
    },
    Read {
        off: u64,
        len: u64,
    },
    Truncate {
        size: u64,
    },
    Falloc {
        mode: FallocMode,
        off: u64,
        len: u64,
    },
    Fsync,
    DropCache,
    Reopen,
}

/// An offset: a quarter at a sector boundary, a quarter at a block boundary, a quarter
/// just around the current end, the rest anywhere.
fn offset(rng: &mut Rng, size: u64, bs: u64) -> u64 {
    let any = rng.below(MAX);
    match rng.below(4) {
        0 => any / 512 * 512,
        1 => any / bs * bs,
        2 => (size + rng.below(2 * bs)).saturating_sub(bs).min(MAX - 1),
        _ => any,
    }
}

fn length(rng: &mut Rng, bs: u64) -> u64 {
    match rng.below(4) {
        0 => 512 * (1 + rng.below(8)),
        1 => bs * (1 + rng.below(8)),
        2 => 1 + rng.below(bs),
        _ => 1 + rng.below(MAXLEN),
    }
}

fn pick(rng: &mut Rng, size: u64, bs: u64) -> Op {
    let off = offset(rng, size, bs);
    let len = length(rng, bs).min(MAX - off).max(1);
    match rng.below(100) {
        0..=21 => Op::DirectWrite { off, len },
        22..=29 => {
            let mut writes: Vec<(u64, u64)> = Vec::new();
            for _ in 0..2 + rng.below(7) {
                let off = offset(rng, size, bs);
                let len = length(rng, bs).clamp(1, (MAX - off).min(16 << 10));
                if writes.iter().all(|&(o, l)| off + len <= o || o + l <= off) {
                    writes.push((off, len));
                }
            }
            Op::DirectBatch { writes }
        }
        30..=49 => Op::DirectRead { off, len },
        50..=61 => Op::Write { off, len },
        62..=71 => Op::Read { off, len },
        72..=77 => Op::Truncate {
            size: match rng.below(3) {
                0 => rng.below(MAX),
                1 => size / 2,
                _ => (size + rng.below(MAXLEN)).min(MAX),
            },
        },
        78..=89 => {
            let mode = match rng.below(5) {
                0 => FallocMode::Allocate,
                1 => FallocMode::KeepSize,
                2 | 3 => FallocMode::PunchHole,
                _ => FallocMode::ZeroRange {
                    keep_size: rng.below(2) == 0,
                },
            };
            Op::Falloc { mode, off, len }
        }
        90..=94 => Op::Fsync,
        95..=98 => Op::DropCache,
        _ => Op::Reopen,
    }
}

/// The model of `op` applied to `m`.
fn apply(m: &mut Vec<u8>, op: &Op, data: &[u8]) {
    let grow = |m: &mut Vec<u8>, end: u64| {
        if (m.len() as u64) < end {
            m.resize(end as usize, 0);
        }
    };
    match *op {
        Op::DirectWrite { off, len } | Op::Write { off, len } => {
            grow(m, off + len);
            m[off as usize..(off + len) as usize].copy_from_slice(data);
        }
        Op::DirectBatch { ref writes } => {
            let mut at = 0;
            for &(off, len) in writes {
                grow(m, off + len);
                m[off as usize..(off + len) as usize].copy_from_slice(&data[at..at + len as usize]);
                at += len as usize;
            }
        }
        Op::Truncate { size } => m.resize(size as usize, 0),
        Op::Falloc { mode, off, len } => {
            let end = off + len;
            match mode {
                FallocMode::Allocate | FallocMode::ZeroRange { keep_size: false } => grow(m, end),
                _ => {}
            }
            if matches!(mode, FallocMode::PunchHole | FallocMode::ZeroRange { .. }) {
                let to = end.min(m.len() as u64);
                if off < to {
                    m[off as usize..to as usize].fill(0);
                }
            }
        }
        _ => {}
    }
}

struct Run {
    img: rext4_testkit::Image,
    fs: Fs,
    ino: Ino,
}

impl Run {
    fn file(&self, direct: bool) -> rext4::File {
        rext4::OpenOptions::new()
            .read(true)
            .write(true)
            .direct(direct)
            .open(&self.fs, "/fsx")
            .expect("open /fsx")
    }
}

/// The whole file, read through the page cache and then O_DIRECT, against the model.
fn compare_all(r: &Run, m: &[u8], ctx: &str) {
    let size = r.fs.stat_ino(r.ino).expect("stat").len();
    assert_eq!(size, m.len() as u64, "{ctx}: size");
    let mut buf = vec![0u8; m.len()];
    let f = r.file(false);
    let n = f.read_at(&mut buf, 0).expect("buffered read all");
    assert_eq!(n, m.len(), "{ctx}: buffered read length");
    if let Some(i) = (0..m.len()).find(|&i| buf[i] != m[i]) {
        panic!(
            "{ctx}: buffered byte {i} is {:#x}, model {:#x}",
            buf[i], m[i]
        );
    }
    buf.fill(0xee);
    let n =
        r.fs.read_direct_ino(r.ino, &mut buf, 0)
            .expect("direct read all");
    assert_eq!(n, m.len(), "{ctx}: direct read length");
    if let Some(i) = (0..m.len()).find(|&i| buf[i] != m[i]) {
        panic!("{ctx}: direct byte {i} is {:#x}, model {:#x}", buf[i], m[i]);
    }
}

/// The image opened read-write, its own I/O through the host's page cache or O_DIRECT.
fn open(path: &std::path::Path, direct_backing: bool) -> Fs {
    let opts = rext4::FsOptions {
        read_only: false,
        commit_secs: 0,
        direct_io: direct_backing,
        ..rext4::FsOptions::default()
    };
    Fs::open_with(path, opts).expect("open rw")
}

fn run_seed(seed: u64, ops: u64, bs: u32, direct_backing: bool) {
    run_seed_on(seed, ops, MkfsOptions::new(bs, 32 << 20), direct_backing)
}

/// [`run_seed`] on an image `opts` makes. On an image without extents (ext2, ext3) the
/// file is block-mapped: fallocate modes other than punching are EOPNOTSUPP, as on the
/// kernel, and leave the file as it was.
fn run_seed_on(seed: u64, ops: u64, opts: MkfsOptions, direct_backing: bool) {
    let bs = opts.block_size;
    let img = mkfs(&opts).expect("mkfs");
    let fs = open(img.path(), direct_backing);
    let ino = fs.create("/fsx").expect("create").ino();
    let block_map = fs.inode_attr(ino).expect("inode").flags & 0x8_0000 == 0;
    let mut r = Run { img, fs, ino };
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut m: Vec<u8> = Vec::new();
    let bsz = u64::from(bs);
    let mut buf = vec![0u8; MAXLEN as usize];
    for i in 0..ops {
        let op = pick(&mut rng, m.len() as u64, bsz);
        let ctx = format!("seed {seed} bs {bs} op {i} {op:?}");
        // Each write's bytes name the operation, so a misplaced byte says where from.
        let total = match op {
            Op::DirectWrite { len, .. } | Op::Write { len, .. } => len,
            Op::DirectBatch { ref writes } => writes.iter().map(|w| w.1).sum(),
            _ => 0,
        };
        let data: Vec<u8> = (0..total)
            .map(|k| (i as u8).wrapping_mul(31) ^ (k as u8) ^ ((k >> 8) as u8) | 1)
            .collect();
        match op {
            Op::DirectBatch { ref writes } => {
                let mut at = 0;
                let mut batch = Vec::new();
                for &(off, len) in writes {
                    batch.push((&data[at..at + len as usize], off));
                    at += len as usize;
                }
                r.fs.write_direct_batch_ino(r.ino, &batch, true)
                    .expect(&ctx);
            }
            Op::DirectWrite { off, .. } => {
                let n = r.fs.write_direct_ino(r.ino, &data, off, true).expect(&ctx);
                assert_eq!(n, data.len(), "{ctx}: short direct write");
            }
            Op::Write { off, .. } => {
                let n = r.fs.write_ino_at(r.ino, &data, off).expect(&ctx);
                assert_eq!(n, data.len(), "{ctx}: short write");
            }
            Op::DirectRead { off, len } | Op::Read { off, len } => {
                let b = &mut buf[..len as usize];
                b.fill(0xee);
                let n = if matches!(op, Op::DirectRead { .. }) {
                    r.fs.read_direct_ino(r.ino, b, off).expect(&ctx)
                } else {
                    r.file(false).read_at(b, off).expect(&ctx)
                };
                let want = (m.len() as u64).saturating_sub(off).min(len) as usize;
                assert_eq!(n, want, "{ctx}: read length");
                if let Some(k) = (0..n).find(|&k| b[k] != m[off as usize + k]) {
                    panic!(
                        "{ctx}: byte {} is {:#x}, model {:#x}",
                        off as usize + k,
                        b[k],
                        m[off as usize + k]
                    );
                }
            }
            Op::Truncate { size } => r.fs.truncate_ino(r.ino, size).expect(&ctx),
            Op::Falloc { mode, off, len } if block_map && mode != FallocMode::PunchHole => {
                let e = r.fs.fallocate_ino(r.ino, mode, off, len).expect_err(&ctx);
                assert_eq!(e.errno(), 95, "{ctx}: {e}");
                // Nothing happened: the model stays.
                continue;
            }
            Op::Falloc { mode, off, len } => r.fs.fallocate_ino(r.ino, mode, off, len).expect(&ctx),
            Op::Fsync => r.file(false).sync_all().expect(&ctx),
            Op::DropCache => r.file(false).drop_cache(0, u64::MAX),
            Op::Reopen => {
                let Run { img, fs, ino } = r;
                fs.close().expect(&ctx);
                let fs = open(img.path(), direct_backing);
                r = Run { img, fs, ino };
            }
        }
        apply(&mut m, &op, &data);
        if matches!(op, Op::Reopen) || i % 500 == 499 {
            compare_all(&r, &m, &ctx);
        }
    }
    compare_all(&r, &m, &format!("seed {seed} bs {bs} at the end"));
    let Run { img, fs, .. } = r;
    fs.close().expect("close");
    let out = e2fsck_fn(img.path());
    assert!(
        out.clean,
        "seed {seed} bs {bs} direct backing {direct_backing}: e2fsck -fn:\n{}",
        out.output
    );
}

fn ops() -> u64 {
    std::env::var("REXT4_FSX_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12_000)
}

fn seeds() -> Vec<u64> {
    match std::env::var("REXT4_FSX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(s) => vec![s],
        None => vec![1, 2],
    }
}

#[test]
fn fsx_direct_io_4k_blocks() {
    for s in seeds() {
        run_seed(s, ops(), 4096, false);
    }
}

#[test]
fn fsx_direct_io_1k_blocks() {
    for s in seeds() {
        run_seed(s + 100, ops(), 1024, false);
    }
}

/// Block-mapped files: ext2 at 1 KiB blocks (the file reaches the DIND range) and
/// ext3 at 4 KiB blocks.
#[test]
fn fsx_direct_io_ext2_1k_blocks() {
    for s in seeds() {
        let opts = MkfsOptions::new(1024, 32 << 20).arg("-t").arg("ext2");
        run_seed_on(s + 300, ops(), opts, false);
    }
}

#[test]
fn fsx_direct_io_ext3_4k_blocks() {
    for s in seeds() {
        let opts = MkfsOptions::new(4096, 32 << 20).arg("-t").arg("ext3");
        run_seed_on(s + 400, ops(), opts, false);
    }
}

/// bigalloc: 4 KiB blocks in 64 KiB clusters and 1 KiB blocks in 16 KiB clusters (the
/// writes land inside clusters the file has, punches and truncates cut them).
#[test]
fn fsx_direct_io_bigalloc() {
    for s in seeds() {
        for (k, (bs, cl)) in [(4096u32, "65536"), (1024, "16384")]
            .into_iter()
            .enumerate()
        {
            let opts = MkfsOptions::new(bs, 32 << 20)
                .arg("-O")
                .arg("bigalloc")
                .arg("-C")
                .arg(cl);
            run_seed_on(s + 500 + 50 * k as u64, ops(), opts, false);
        }
    }
}

/// The image itself O_DIRECT (`FsOptions::direct_io`): batches go to the device through
/// aligned buffers on the O_DIRECT descriptor, the rest through the buffered one.
#[test]
fn fsx_direct_io_4k_blocks_direct_backing() {
    for s in seeds() {
        run_seed(s + 200, ops() / 2, 4096, true);
    }
}

/// SEEDS lesson A with a queue depth: four threads each submit batches of 16
/// non-overlapping 2 KiB direct overwrites (into their own quarter of a prewritten
/// file, at random 2 KiB slots), on both backings. Every write of every batch goes
/// out under the shared lock (none retried exclusively), and the file ends with each
/// slot's last write.
#[test]
fn batches_of_overwrites_go_out_together_under_the_shared_lock() {
    const SIZE: u64 = 4 << 20;
    const SLOT: u64 = 2048;
    const BATCHES: u64 = 150;
    const DEPTH: usize = 16;
    for direct_backing in [false, true] {
        let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
        let fs = open(img.path(), direct_backing);
        let f = fs.create("/q").expect("create");
        f.write_all_at(&vec![0xcd; SIZE as usize], 0)
            .expect("prewrite");
        f.sync_all().expect("fsync");
        let ino = f.ino();
        drop(f);
        let before = fs.io_stats();
        let quarter = SIZE / SLOT / 4;
        let models: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4u64)
                .map(|t| {
                    let fs = &fs;
                    s.spawn(move || {
                        let file = rext4::OpenOptions::new()
                            .write(true)
                            .direct(true)
                            .open(fs, "/q")
                            .expect("open direct");
                        // The last value written to each of this thread's slots.
                        let mut model = vec![0xcdu8; quarter as usize];
                        let mut rng = Rng((t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
                        for b in 0..BATCHES {
                            let mut slots: Vec<u64> = Vec::new();
                            while slots.len() < DEPTH {
                                let x = rng.below(quarter);
                                if !slots.contains(&x) {
                                    slots.push(x);
                                }
                            }
                            let bufs: Vec<Vec<u8>> = slots
                                .iter()
                                .enumerate()
                                .map(|(k, _)| {
                                    vec![((b as usize * DEPTH + k) % 251) as u8 | 1; SLOT as usize]
                                })
                                .collect();
                            let batch: Vec<(&[u8], u64)> = slots
                                .iter()
                                .zip(&bufs)
                                .map(|(&x, buf)| (&buf[..], (t * quarter + x) * SLOT))
                                .collect();
                            file.write_all_at_batch(&batch).expect("batch");
                            for (&x, buf) in slots.iter().zip(&bufs) {
                                model[x as usize] = buf[0];
                            }
                        }
                        model
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("writer")).collect()
        });
        let after = fs.io_stats();
        let writes = 4 * BATCHES * DEPTH as u64;
        assert_eq!(
            (
                after.direct_shared - before.direct_shared,
                after.direct_exclusive - before.direct_exclusive
            ),
            (writes, 0),
            "direct backing {direct_backing}: (shared, exclusive) writes"
        );
        let mut buf = vec![0u8; SIZE as usize];
        assert_eq!(
            fs.read_direct_ino(ino, &mut buf, 0).expect("read"),
            buf.len()
        );
        for (t, model) in models.iter().enumerate() {
            for (x, &v) in model.iter().enumerate() {
                let at = ((t as u64 * quarter + x as u64) * SLOT) as usize;
                assert!(
                    buf[at..at + SLOT as usize].iter().all(|&c| c == v),
                    "direct backing {direct_backing}: slot at {at} is not its last write {v:#x}"
                );
            }
        }
        fs.close().expect("close");
        let out = e2fsck_fn(img.path());
        assert!(out.clean, "{}", out.output);
    }
}
