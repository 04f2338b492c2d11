//! `rext4 bench dio-overwrite IMAGE [--threads N] [--bs 2k] [--backing buffered|direct]
//! [--iodepth N]`:
//! SEEDS lesson A in-process — concurrent O_DIRECT overwrites of one prewritten file,
//! as the seed's fio job (`--direct=1 --overwrite=1 --readwrite=write --numjobs=N
//! --blocksize=2k`, every job over the same offsets of one file).
//!
//! The image is opened read-write with its own I/O buffered (`--backing buffered`, the
//! default) or O_DIRECT (`--backing direct`, `FsOptions::direct_io`: compare with a
//! loop device's `--direct-io=on`). One file of `-s` bytes (default 256 MiB) is
//! written in 1 MiB requests and synced, so every block is mapped and written; then
//! `--threads` threads (default 8) each open it O_DIRECT and write `--bs` bytes
//! (default 2 KiB) at a time for `--secs` seconds (default 5): `--rw write` walks the
//! file from the start and wraps (all threads over the same offsets, as fio's jobs),
//! `--rw randwrite` picks `--bs`-aligned offsets at random. With `--iodepth N` each
//! thread submits N writes at a time as one batch (`File::write_all_at_batch`: all in
//! flight together, as fio's `--iodepth`; the next N positions, or N distinct random
//! ones). The file is removed at the end.
//!
//! Lines: `phase=dio-overwrite ops= secs= ops_per_s=`, `RESULT|label|dio-overwrite|iops|N|IOPS`,
//! and how the writes went (`Fs::io_stats`): `shared_lock` (overwrites in place under
//! the shared I/O lock) and `exclusive` (writes that retried under the exclusive lock;
//! none is expected once the file is prewritten).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rext4::{Fs, FsOptions};

use crate::bench::{parse_size, stop, BenchArgs};

/// How the image file itself is read and written.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backing {
    // Through the host's page cache. (Plain comments: clap would list documented
    // values as a second workload list in `bench --help`.)
    #[default]
    Buffered,
    // O_DIRECT on the image (`FsOptions::direct_io`).
    Direct,
}

/// The order of the overwrites.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rw {
    // From the start of the file, wrapping at its end.
    #[default]
    Write,
    // `--bs`-aligned offsets at random.
    Randwrite,
}

fn result(label: &str, metric: &str, value: f64, unit: &str) {
    crate::term::out(&format!(
        "RESULT|{label}|dio-overwrite|{metric}|{value:.1}|{unit}\n"
    ));
}

/// A small xorshift generator per thread (offsets only; no need for more).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

pub fn run(a: &BenchArgs) -> Result<(), String> {
    let threads = a.threads.unwrap_or(8).max(1);
    let bs = a.bs.as_deref().map_or(Ok(2048), parse_size)?;
    let size = a.size.as_deref().map_or(Ok(256 << 20), parse_size)?;
    let secs = a.secs.unwrap_or(5);
    let backing = a.backing.unwrap_or_default();
    let rw = a.rw.unwrap_or_default();
    if bs == 0 || !bs.is_multiple_of(512) || bs > 1 << 20 {
        return Err(format!(
            "--bs must be a multiple of 512 bytes up to 1m, not {bs}"
        ));
    }
    if size < bs {
        return Err(format!("-s {size} is smaller than --bs {bs}"));
    }
    let depth = a.iodepth.unwrap_or(1);
    if depth == 0 || depth > 4096 || depth as u64 > size / bs {
        return Err(format!(
            "--iodepth must be between 1 and 4096 and at most the file's {} writes, not {depth}",
            size / bs
        ));
    }
    let fs = Fs::open_with(
        &a.image,
        FsOptions {
            read_only: false,
            direct_io: backing == Backing::Direct,
            ..FsOptions::default()
        },
    )
    .map_err(|e| format!("{}: {}", a.image.display(), crate::term::reason(&e)))?;
    let shape = Shape {
        threads,
        bs,
        size,
        secs,
        rw,
        backing,
        depth,
    };
    let r = overwrite(&fs, a, &shape);
    let c = fs
        .close()
        .map_err(|e| format!("closing the image: {}", crate::term::reason(&e)));
    r.and(c)
}

/// What the run does (from the options, checked).
struct Shape {
    threads: usize,
    bs: u64,
    size: u64,
    secs: u64,
    rw: Rw,
    backing: Backing,
    depth: usize,
}

fn overwrite(fs: &Fs, a: &BenchArgs, shape: &Shape) -> Result<(), String> {
    let &Shape {
        threads,
        bs,
        size,
        secs,
        rw,
        backing,
        depth,
    } = shape;
    let e = |x: rext4::Error| crate::term::reason(&x);
    let path = format!("/dio-overwrite-{}", std::process::id());
    let f = fs.create(&path).map_err(e)?;
    let r = (|| {
        // Prewrite: every block mapped and written (fio's --overwrite=1 layout).
        let chunk = vec![0xcdu8; 1 << 20];
        let mut off = 0;
        while off < size {
            stop()?;
            let n = (size - off).min(chunk.len() as u64) as usize;
            f.write_all_at(&chunk[..n], off).map_err(e)?;
            off += n as u64;
        }
        f.sync_all().map_err(e)?;
        drop(f);
        let before = fs.io_stats();
        let blocks = size / bs;
        let done = AtomicBool::new(false);
        let ops = AtomicU64::new(0);
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs(secs);
        let res: Vec<Result<(), String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let (done, ops, path) = (&done, &ops, &path);
                    sc.spawn(move || -> Result<(), String> {
                        let f = rext4::OpenOptions::new()
                            .write(true)
                            .direct(true)
                            .open(fs, path)
                            .map_err(e)?;
                        let buf = vec![0x5au8 ^ t as u8; bs as usize];
                        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                        let mut mine = 0u64;
                        // Per-thread position for `write` (fio: each job walks the file).
                        let mut pos = 0u64;
                        let mut blks: Vec<u64> = Vec::with_capacity(depth);
                        let mut batch: Vec<(&[u8], u64)> = Vec::with_capacity(depth);
                        let mut since_look = 0u64;
                        while !done.load(Ordering::Relaxed) {
                            blks.clear();
                            while blks.len() < depth {
                                let blk = match rw {
                                    Rw::Write => {
                                        let b = pos;
                                        pos = (pos + 1) % blocks;
                                        b
                                    }
                                    Rw::Randwrite => next(&mut x) % blocks,
                                };
                                // A batch's writes may not overlap.
                                if depth == 1 || !blks.contains(&blk) {
                                    blks.push(blk);
                                }
                            }
                            if depth == 1 {
                                let n = f.write_at(&buf, blks[0] * bs).map_err(e)?;
                                if n as u64 != bs {
                                    return Err(format!("short direct write: {n} of {bs}"));
                                }
                            } else {
                                batch.clear();
                                batch.extend(blks.iter().map(|&b| (&buf[..], b * bs)));
                                f.write_all_at_batch(&batch).map_err(e)?;
                            }
                            mine += depth as u64;
                            since_look += depth as u64;
                            if since_look >= 256 {
                                since_look = 0;
                                if Instant::now() >= end || stop().is_err() {
                                    done.store(true, Ordering::Relaxed);
                                }
                            }
                        }
                        ops.fetch_add(mine, Ordering::Relaxed);
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a writer panicked".into())))
                .collect()
        });
        let took = t0.elapsed().as_secs_f64();
        res.into_iter().collect::<Result<(), String>>()?;
        stop()?;
        let after = fs.io_stats();
        let n = ops.load(Ordering::Relaxed);
        crate::term::out(&format!(
            "dio-overwrite: {threads} threads, {bs}-byte {rw:?} over a {size}-byte file, backing {backing:?}, iodepth {depth}\n"
        ));
        crate::term::out(&format!(
            "phase=dio-overwrite ops={n} secs={took:.3} ops_per_s={:.1}\n",
            n as f64 / took
        ));
        result(&a.label, "iops", n as f64 / took, "IOPS");
        result(
            &a.label,
            "shared_lock",
            (after.direct_shared - before.direct_shared) as f64,
            "writes",
        );
        result(
            &a.label,
            "exclusive",
            (after.direct_exclusive - before.direct_exclusive) as f64,
            "writes",
        );
        Ok(())
    })();
    let rm = fs.remove_file(&path).map_err(e);
    r.and(rm)
}
