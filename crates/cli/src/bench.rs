//! `rext4 bench WORKLOAD IMAGE`: workloads run through the embedding API (no mount), with
//! output lines in the format of the shared anchor benchmarks
//! (`phase=create ops=N secs=S ops_per_s=R`, `RESULT|label|workload|metric|value|unit`),
//! so a script can put them beside the kernel's figures from the same run.
//!
//! Workloads: `mdtest N` (create N empty files in one directory, stat them, unlink them,
//! like the anchors' mdtest.c; with `--threads T` T threads share the N files, each in
//! its own directory or, with `--shared-dir`, all in one; `--chmod-rename` adds a chmod
//! and a rename of every file before the unlinks), `seqwrite SIZE` (one file
//! written in 1 MiB requests, then synced), `seqread` (read that file back),
//! `smallfsync N` (N files of 4 KiB, or `-s`, each written and fsynced; with `--threads T`, T
//! threads in directories of their own, and the journal commits counted against the
//! fsyncs: group commit), `pwtrunc` (SEEDS lesson B, like the anchors' pwrite_trunc:
//! `-n` iterations of pwrite 4 KiB at 0 + ftruncate 2 KiB, then the same with a
//! fallocate 0..32 KiB first in each iteration; with `--verify`, the stale-data
//! reproducer with reclaim at every step instead, in `bench_pwtrunc`), `churn` (SEEDS
//! lesson C, like the anchors' seedC script: create+unlink of one name in a tight loop
//! for `--secs`, alone, then while `--threads` threads stat a 16-deep path and a symlink
//! to it; and the lookups alone — the three phases taking turns in quarter-second
//! windows, so a drift of the machine's speed falls on all three alike; `--sync-grace`
//! opens with `FsOptions::sync_grace`).
//! `dax` (SEEDS lesson E) is in `bench_dax`, `firstwrite` (lesson D) in `bench_firstwrite`,
//! `dio-overwrite` (lesson A) in `bench_dio`.
//! mdtest phases, like the anchors' mdtest.c on a mount, do not sync (the kernel's
//! figures are page-cache figures too); seqwrite includes its fsync.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rext4::{Fs, FsOptions, Ino};

/// The workloads (see the module note).
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Workload {
    /// Create, stat and unlink -n files in one directory.
    Mdtest,
    /// Write one file of -s bytes in 1 MiB requests, then sync.
    Seqwrite,
    /// Read the seqwrite file back.
    Seqread,
    /// -n small files, each written and synced.
    Smallfsync,
    /// -n iterations of pwrite 4 KiB + ftruncate 2 KiB, then with fallocate.
    Pwtrunc,
    /// create+unlink of one name against --threads lookups, --secs per phase.
    Churn,
    /// DAX (IMAGE on tmpfs/hugetlbfs): copy limits, write/read bandwidth, fsync cost
    /// against dirty bytes and file size (see bench_dax).
    Dax,
    /// Open through a device with --latency-ms per read, write and fsync one new file
    /// of -s bytes (default 4k), and count the reads (see bench_firstwrite).
    Firstwrite,
    /// --threads O_DIRECT writers overwrite one prewritten file of -s bytes (default
    /// 256m) in --bs requests (default 2k) for --secs (see bench_dio).
    DioOverwrite,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// The workload to run.
    #[arg(value_enum)]
    pub workload: Workload,
    /// The image to run on (opened read-write).
    pub image: std::path::PathBuf,
    /// Files for mdtest / smallfsync (default 100000 / 10000).
    #[arg(short = 'n', long)]
    pub count: Option<u64>,
    /// pwtrunc: instead of timing, run SEEDS lesson B's stale-data reproducer -n times
    /// (default 100000) with forced reclaim at every step; fails on any stale byte
    /// (see bench_pwtrunc).
    #[arg(long)]
    pub verify: bool,
    /// Bytes for seqwrite (suffixes k, m, g; default 1g), and per file for smallfsync
    /// (default 4k).
    #[arg(short = 's', long)]
    pub size: Option<String>,
    /// Seconds per phase for churn (default 5).
    #[arg(long)]
    pub secs: Option<u64>,
    /// Threads: lookups for churn (default 1); for mdtest and smallfsync, threads that
    /// each take an equal share of the files, in a directory of their own (default 1).
    #[arg(long)]
    pub threads: Option<usize>,
    /// mdtest: every thread's files in one shared directory.
    #[arg(long)]
    pub shared_dir: bool,
    /// mdtest: also chmod every file after the stats, and rename every file in its
    /// directory (f... to r...) before the unlinks: phases `chmod` and `rename`.
    #[arg(long)]
    pub chmod_rename: bool,
    /// Request size for dax (suffixes k, m, g; default 1m).
    #[arg(long)]
    pub chunk: Option<String>,
    /// firstwrite: milliseconds every read of the image waits (default 0).
    #[arg(long)]
    pub latency_ms: Option<f64>,
    /// firstwrite: requests the slow device serves at once (default 32).
    #[arg(long)]
    pub queue_depth: Option<usize>,
    /// firstwrite: bitmaps one allocation reads together (the kernel's mb_prefetch).
    #[arg(long)]
    pub mb_prefetch: Option<u32>,
    /// firstwrite: bitmaps one allocation may prefetch in all (mb_prefetch_limit).
    #[arg(long)]
    pub mb_prefetch_limit: Option<u32>,
    /// firstwrite: no background bitmap prefetcher (no_prefetch_block_bitmaps).
    #[arg(long)]
    pub no_prefetch: bool,
    /// dio-overwrite: bytes per write (suffixes k, m; default 2k).
    #[arg(long)]
    pub bs: Option<String>,
    /// dio-overwrite: the image's own I/O, through the host's page cache or O_DIRECT.
    #[arg(long, value_enum)]
    pub backing: Option<crate::bench_dio::Backing>,
    /// dio-overwrite: writes each thread keeps in flight, submitted as one batch
    /// (`File::write_all_at_batch`; fio's --iodepth; default 1: one at a time).
    #[arg(long)]
    pub iodepth: Option<usize>,
    /// dio-overwrite: sequential (each writer from the start, as fio's jobs) or random.
    #[arg(long, value_enum)]
    pub rw: Option<crate::bench_dio::Rw>,
    /// churn: every inode free waits for the lookups that began before it, instead of
    /// letting the number cool (the synchronous grace-period design, to compare).
    #[arg(long)]
    pub sync_grace: bool,
    /// Label for RESULT lines.
    #[arg(long, default_value = "rext4-api")]
    pub label: String,
}

/// Err once SIGINT/SIGTERM/SIGHUP asked to stop: the workload ends, the image is
/// closed as usual.
pub(crate) fn stop() -> Result<(), String> {
    match crate::interrupt::requested() {
        Some(_) => Err("stopped".into()),
        None => Ok(()),
    }
}

pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.chars().last() {
        Some('k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        Some('t') => (&s[..s.len() - 1], 1 << 40),
        _ => (&s[..], 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("bad size {s:?}"))
}

fn phase(label: &str, workload: &str, name: &str, ops: u64, secs: f64) {
    crate::term::out(&format!(
        "phase={name} ops={ops} secs={secs:.3} ops_per_s={:.1}\n",
        ops as f64 / secs
    ));
    crate::term::out(&format!(
        "RESULT|{label}|{workload}|{name}_ops_per_s|{:.1}|ops/s\n",
        ops as f64 / secs
    ));
}

pub fn run(a: BenchArgs) -> Result<(), String> {
    if matches!(a.workload, Workload::Dax) {
        return crate::bench_dax::run(&a);
    }
    if matches!(a.workload, Workload::Firstwrite) {
        return crate::bench_firstwrite::run(&a);
    }
    if matches!(a.workload, Workload::DioOverwrite) {
        return crate::bench_dio::run(&a);
    }
    let fs = Fs::open_with(
        &a.image,
        FsOptions {
            read_only: false,
            sync_grace: a.sync_grace,
            ..FsOptions::default()
        },
    )
    .map_err(|e| format!("{}: {}", a.image.display(), crate::term::reason(&e)))?;
    let r = workload(&fs, &a);
    let c = fs
        .close()
        .map_err(|e| format!("closing the image: {}", crate::term::reason(&e)));
    r.and(c)
}

fn workload(fs: &Fs, a: &BenchArgs) -> Result<(), String> {
    let e = |x: rext4::Error| crate::term::reason(&x);
    match a.workload {
        Workload::Mdtest => mdtest(fs, a)?,
        Workload::Seqwrite => {
            let size = parse_size(a.size.as_deref().unwrap_or("1g"))?;
            let f = fs.create("/seqfile").map_err(e)?;
            let buf: Vec<u8> = (0..1 << 20).map(|i| (i * 31 % 251) as u8).collect();
            let t = Instant::now();
            let mut off = 0;
            while off < size {
                stop()?;
                let n = (size - off).min(buf.len() as u64) as usize;
                f.write_all_at(&buf[..n], off).map_err(e)?;
                off += n as u64;
            }
            f.sync_all().map_err(e)?;
            let s = t.elapsed().as_secs_f64();
            let mib = size as f64 / (1 << 20) as f64;
            crate::term::out(&format!(
                "phase=seqwrite bytes={size} secs={s:.3} MiB_per_s={:.1}\n",
                mib / s
            ));
            crate::term::out(&format!(
                "RESULT|{}|seqwrite|write_MiB_per_s|{:.1}|MiB/s\n",
                a.label,
                mib / s
            ));
        }
        Workload::Seqread => {
            let f = fs.open_file("/seqfile").map_err(e)?;
            let size = f.len().map_err(e)?;
            let mut buf = vec![0u8; 1 << 20];
            let t = Instant::now();
            let mut off = 0;
            while off < size {
                stop()?;
                let n = f.read_at(&mut buf, off).map_err(e)?;
                if n == 0 {
                    break;
                }
                off += n as u64;
            }
            let s = t.elapsed().as_secs_f64();
            let mib = size as f64 / (1 << 20) as f64;
            crate::term::out(&format!(
                "phase=seqread bytes={size} secs={s:.3} MiB_per_s={:.1}\n",
                mib / s
            ));
            crate::term::out(&format!(
                "RESULT|{}|seqread|read_MiB_per_s|{:.1}|MiB/s\n",
                a.label,
                mib / s
            ));
        }
        Workload::Smallfsync => smallfsync(fs, a)?,
        Workload::Churn => churn(fs, a)?,
        Workload::Dax | Workload::Firstwrite | Workload::DioOverwrite => {
            return Err("dax, firstwrite and dio-overwrite run on their own open".into())
        }
        Workload::Pwtrunc if a.verify => crate::bench_pwtrunc::verify(fs, a)?,
        Workload::Pwtrunc => {
            let n = a.count.unwrap_or(50_000);
            let f = fs.create("/pwtrunc").map_err(e)?;
            let ino = f.ino();
            let data = [0xcdu8; 4096];
            for falloc in [false, true] {
                let t = Instant::now();
                for _ in 0..n {
                    stop()?;
                    if falloc {
                        fs.fallocate_ino(ino, rext4::FallocMode::Allocate, 0, 32 << 10)
                            .map_err(e)?;
                    }
                    f.write_all_at(&data, 0).map_err(e)?;
                    f.set_len(2048).map_err(e)?;
                }
                let name = if falloc {
                    "falloc_pwrite_trunc"
                } else {
                    "pwrite_trunc"
                };
                phase(&a.label, "pwtrunc", name, n, t.elapsed().as_secs_f64());
            }
            drop(f);
            fs.remove_file("/pwtrunc").map_err(e)?;
        }
    }
    Ok(())
}

/// Run `work(t)` on `threads` threads at once; the first error wins.
fn on_threads(
    threads: usize,
    work: impl Fn(usize) -> Result<(), String> + Sync,
) -> Result<(), String> {
    std::thread::scope(|sc| {
        let work = &work;
        let handles: Vec<_> = (0..threads).map(|t| sc.spawn(move || work(t))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a bench thread panicked".into()))
            })
            .collect::<Result<Vec<()>, String>>()
            .map(|_| ())
    })
}

/// Thread `t`'s share of `0..n` among `threads` (equal shares, the last shorter).
fn share(n: u64, threads: usize, t: usize) -> std::ops::Range<u64> {
    let per = n.div_ceil(threads as u64);
    let t = t as u64;
    (t * per).min(n)..((t + 1) * per).min(n)
}

/// One mdtest operation on a name in a directory.
type NameOp<'a> = dyn Fn(Ino, &[u8]) -> Result<(), String> + Sync + 'a;

/// mdtest: create, stat and unlink `-n` empty files, shared by `--threads` threads.
fn mdtest(fs: &Fs, a: &BenchArgs) -> Result<(), String> {
    let e = |x: rext4::Error| crate::term::reason(&x);
    let n = a.count.unwrap_or(100_000);
    let threads = a.threads.unwrap_or(1).max(1);
    fs.create_dir_all("/mdtest").map_err(e)?;
    let mut dirs = Vec::with_capacity(threads);
    for t in 0..threads {
        let p = if a.shared_dir || threads == 1 {
            "/mdtest".to_string()
        } else {
            format!("/mdtest/t{t}")
        };
        fs.create_dir_all(&p).map_err(e)?;
        dirs.push(fs.resolve(p.as_bytes(), true).map_err(e)?);
    }
    // Thread t's names: its share of 0..n, so the names never collide (made before
    // the clock starts).
    let names: Vec<Vec<String>> = (0..threads)
        .map(|t| share(n, threads, t).map(|i| format!("f{i:07}")).collect())
        .collect();
    let label = if threads > 1 {
        format!(
            "{}-t{threads}{}",
            a.label,
            if a.shared_dir { "-shared" } else { "" }
        )
    } else {
        a.label.clone()
    };
    let timed = |name: &str, op: &NameOp| {
        let t0 = Instant::now();
        on_threads(threads, |t| {
            for nm in &names[t] {
                stop()?;
                op(dirs[t], nm.as_bytes())?;
            }
            Ok(())
        })?;
        phase(&label, "mdtest", name, n, t0.elapsed().as_secs_f64());
        Ok::<(), String>(())
    };
    timed("create", &|d, nm| {
        fs.mknod_ino(d, nm, 0o100644, 0, 0, (0, 0))
            .map(|_| ())
            .map_err(e)
    })?;
    timed("stat", &|d, nm| {
        let found = fs.lookup(d, nm).map_err(e)?.ok_or("lookup failed")?;
        fs.stat_ino(found.ino).map(|_| ()).map_err(e)
    })?;
    // The renamed name of `nm`: r instead of f.
    let renamed = |nm: &[u8]| [b"r", &nm[1..]].concat();
    if a.chmod_rename {
        timed("chmod", &|d, nm| {
            let found = fs.lookup(d, nm).map_err(e)?.ok_or("lookup failed")?;
            let attrs = rext4::SetAttr {
                mode: Some(0o600),
                ..Default::default()
            };
            fs.setattr_ino(found.ino, &attrs).map(drop).map_err(e)
        })?;
        timed("rename", &|d, nm| {
            fs.rename_ino(d, nm, d, &renamed(nm), Default::default())
                .map_err(e)
        })?;
        timed("unlink", &|d, nm| fs.unlink_ino(d, &renamed(nm)).map_err(e))?;
    } else {
        timed("unlink", &|d, nm| fs.unlink_ino(d, nm).map_err(e))?;
    }
    fs.remove_dir_all("/mdtest").map_err(e)?;
    Ok(())
}

/// smallfsync: `-n` files of 4 KiB (`-s`: another size, e.g. `-s 100` for files an
/// inline_data image keeps in their inodes), each written and fsynced, shared by
/// `--threads` threads (each in its own directory); the journal's commits are counted.
fn smallfsync(fs: &Fs, a: &BenchArgs) -> Result<(), String> {
    let e = |x: rext4::Error| crate::term::reason(&x);
    let n = a.count.unwrap_or(10_000);
    let threads = a.threads.unwrap_or(1).max(1);
    for t in 0..threads {
        fs.create_dir_all(format!("/smallfsync/t{t}")).map_err(e)?;
    }
    fs.sync().map_err(e)?;
    let len = parse_size(a.size.as_deref().unwrap_or("4k"))?;
    let data = vec![0x5Au8; len as usize];
    let before = fs.journal_stats();
    let t0 = Instant::now();
    on_threads(threads, |t| {
        for i in share(n, threads, t) {
            stop()?;
            let f = fs.create(format!("/smallfsync/t{t}/f{i:06}")).map_err(e)?;
            f.write_all_at(&data, 0).map_err(e)?;
            f.sync_all().map_err(e)?;
        }
        Ok(())
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let after = fs.journal_stats();
    let label = if threads > 1 {
        format!("{}-t{threads}", a.label)
    } else {
        a.label.clone()
    };
    phase(&label, "smallfsync", "write_fsync", n, secs);
    let commits = after.commits - before.commits;
    crate::term::out(&format!(
        "smallfsync: {n} fsyncs on {threads} threads, {commits} journal commits ({:.2} \
         fsyncs per commit), {} checkpoints\n",
        n as f64 / commits.max(1) as f64,
        after.checkpoints - before.checkpoints
    ));
    crate::term::out(&format!(
        "RESULT|{label}|smallfsync|commits|{commits}|commits\n"
    ));
    Ok(())
}

/// SEEDS lesson C: inode allocation and free while lockless lookups run.
fn churn(fs: &Fs, a: &BenchArgs) -> Result<(), String> {
    let e = |x: rext4::Error| x.to_string();
    let secs = Duration::from_secs(a.secs.unwrap_or(5).max(1));
    let threads = a.threads.unwrap_or(1).max(1);
    let mut deep = String::from("/seedC/tree");
    for i in 0..16 {
        deep.push_str(&format!("/d{i:02}"));
    }
    fs.create_dir_all(&deep).map_err(e)?;
    fs.create_dir_all("/seedC/churn").map_err(e)?;
    let leaf = format!("{deep}/leaf");
    fs.write(&leaf, b"").map_err(e)?;
    fs.symlink(&leaf["/seedC/".len()..], "/seedC/link")
        .map_err(e)?;
    let churn_dir = fs.resolve(b"/seedC/churn", true).map_err(e)?;
    // Creates+unlinks of one name until `stop`; returns the count.
    let creator = move |fs: Fs, stop: Arc<AtomicBool>| -> Result<u64, String> {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            fs.mknod_ino(churn_dir, b"x", 0o100644, 0, 0, (0, 0))
                .map_err(|x| x.to_string())?;
            fs.unlink_ino(churn_dir, b"x").map_err(|x| x.to_string())?;
            n += 1;
        }
        Ok(n)
    };
    let lookups = |fs: Fs, stop: Arc<AtomicBool>, leaf: String| -> Result<u64, String> {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let p = if n.is_multiple_of(2) {
                leaf.as_str()
            } else {
                "/seedC/link"
            };
            fs.metadata(p).map_err(|x| x.to_string())?;
            n += 1;
        }
        Ok(n)
    };
    // Run `creators` (0 or 1) and `looks` lookup threads together for `window`.
    let run = |creators: usize, looks: usize, window: Duration| -> Result<(u64, u64), String> {
        let stop = Arc::new(AtomicBool::new(false));
        // Named by phase, so that a profile (`perf report --sort comm`) tells the
        // creator alone from the creator beside the lookups.
        let both = if creators > 0 && looks > 0 {
            "with"
        } else {
            "alone"
        };
        let spawn = |name: String| std::thread::Builder::new().name(name);
        let c: Vec<_> = (0..creators)
            .map(|_| {
                let (fs, stop) = (fs.clone(), stop.clone());
                spawn(format!("create-{both}")).spawn(move || creator(fs, stop))
            })
            .collect::<Result<_, _>>()
            .map_err(|x| x.to_string())?;
        let l: Vec<_> = (0..looks)
            .map(|_| {
                let (fs, stop, leaf) = (fs.clone(), stop.clone(), leaf.clone());
                spawn(format!("lookup-{both}")).spawn(move || lookups(fs, stop, leaf))
            })
            .collect::<Result<_, _>>()
            .map_err(|x| x.to_string())?;
        let end = Instant::now() + window;
        while Instant::now() < end && crate::interrupt::requested().is_none() {
            std::thread::sleep(Duration::from_millis(50).min(end - Instant::now()));
        }
        stop.store(true, Ordering::Relaxed);
        let mut sums = (0, 0);
        for t in c {
            sums.0 += t.join().map_err(|_| "creator panicked")??;
        }
        for t in l {
            sums.1 += t.join().map_err(|_| "lookup thread panicked")??;
        }
        Ok(sums)
    };
    // The three phases take turns in windows of a quarter second, `secs` each in all:
    // a virtual machine's speed drifts by more than the difference measured over
    // seconds, and phases run one after the other would each see another machine.
    let windows = (secs.as_millis() / 250).max(1) as u32;
    let window = secs / windows;
    let (mut alone, mut look_alone, mut with, mut look_with) = (0, 0, 0, 0);
    for _ in 0..windows {
        alone += run(1, 0, window)?.0;
        look_alone += run(0, threads, window)?.1;
        let (c, l) = run(1, threads, window)?;
        with += c;
        look_with += l;
        if crate::interrupt::requested().is_some() {
            break;
        }
    }
    let s = secs.as_secs_f64();
    phase(&a.label, "churn", "create_unlink_alone", alone, s);
    phase(&a.label, "churn", "lookups_alone", look_alone, s);
    phase(&a.label, "churn", "create_unlink_with_lookups", with, s);
    phase(
        &a.label,
        "churn",
        "lookups_with_create_unlink",
        look_with,
        s,
    );
    crate::term::out(&format!(
        "churn: create+unlink with lookups running = {:.2} of alone; lookups with churn = \
         {:.2} of alone\n",
        with as f64 / alone.max(1) as f64,
        look_with as f64 / look_alone.max(1) as f64
    ));
    fs.remove_dir_all("/seedC").map_err(e)?;
    Ok(())
}
