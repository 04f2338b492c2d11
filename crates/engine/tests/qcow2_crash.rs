//! Crash sweep of the qcow2 layer: an ext4 workload with fsyncs (new files, atomic
//! replaces, deletes followed by a trim, so clusters are allocated, rewritten and
//! freed) runs on a qcow2 image whose *file* is recorded — every write and sync the
//! qcow2 layer makes (`HostFile`, punched holes as writes of zeros). From the log,
//! crash images of the qcow2 file are built at every sync point, and with the writes
//! since it lost or torn sector by sector (`rext4_testkit::crash`). Each image:
//! - `qemu-img check` finds no corruption (exit 0, or 3: leaks only);
//! - rext4's qcow2 reader reads the same guest bytes as `qemu-img convert` (every
//!   fourth image);
//! - rext4 opens it read-write (the journal replays, leaks are given back) and
//!   closes it: then `qemu-img check` finds nothing at all (exit 0), the exported
//!   guest disk is `e2fsck -fn` clean and every file whose fsync had returned holds
//!   what was fsynced (or a later version whose change had begun).
//!
//! `device_flush_contract_under_crashes` does the same without a filesystem: random
//! writes, discards and flushes on the device, every guest byte of every crash image
//! checked against the last completed flush and what was written after it (a flush
//! that did not sync in-place writes fails it).
//!
//! Images: v3 with 64 KiB clusters (qemu-img's default), v2, and v3 with 512-byte
//! clusters and 64-bit refcounts (new refcount blocks often, and the refcount table
//! moves during the run). `REXT4_CRASH_VARIANTS` (default 1) lost/torn images per
//! sync point, `REXT4_QCOW2_CRASH_FILES` (default 10) files per run.

mod common;

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use common::env_u64;
use rext4::device::qcow2::{HostFile, Qcow2};
use rext4::device::BlockDevice;
use rext4::{Fs, FsOptions, ImageSpec};
use rext4_testkit::crash::{self, Event, Rng};
use rext4_testkit::{e2fsck_fn, skip, MkfsOptions, TempDir};

/// A qcow2 file in memory that logs every write and sync.
struct RecHost {
    inner: Mutex<(Vec<u8>, Vec<Event>)>,
}

impl RecHost {
    fn len(&self) -> usize {
        self.inner.lock().expect("host").1.len()
    }
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut self.inner.lock().expect("host").1)
    }
}

impl HostFile for RecHost {
    fn read_at(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> std::io::Result<usize> {
        let g = self.inner.lock().expect("host");
        let have = g.0.len().saturating_sub(offset as usize).min(buf.len());
        for (d, s) in buf[..have].iter_mut().zip(&g.0[offset as usize..]) {
            *d = MaybeUninit::new(*s);
        }
        Ok(have)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let mut g = self.inner.lock().expect("host");
        let end = offset as usize + buf.len();
        if g.0.len() < end {
            g.0.resize(end, 0);
        }
        g.0[offset as usize..end].copy_from_slice(buf);
        g.1.push(Event::Write {
            offset,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.lock().expect("host").1.push(Event::Flush);
        Ok(())
    }
    fn len_bytes(&self) -> std::io::Result<u64> {
        Ok(self.inner.lock().expect("host").0.len() as u64)
    }
    /// A hole reads zeros: logged as a write of zeros (a crash keeps it or not).
    fn punch(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let mut g = self.inner.lock().expect("host");
        let end = (offset + len).min(g.0.len() as u64);
        if end <= offset {
            return Ok(());
        }
        g.0[offset as usize..end as usize].fill(0);
        g.1.push(Event::Write {
            offset,
            data: vec![0; (end - offset) as usize],
        });
        Ok(())
    }
}

/// One state of a path: its change began at event `start` and was durable from
/// `durable` on; `None`: no file.
struct Version {
    start: usize,
    durable: usize,
    content: Option<Vec<u8>>,
}

/// What `vs` allows after a crash whose image has every event before `lo` and any
/// of those before `hi`; `None` before any version was durable.
fn allowed(vs: &[Version], lo: usize, hi: usize) -> Option<Vec<Option<&[u8]>>> {
    let last = vs.iter().rposition(|v| v.durable <= lo)?;
    let mut ok = vec![vs[last].content.as_deref()];
    for v in &vs[last + 1..] {
        if v.start < hi {
            ok.push(v.content.as_deref());
        }
    }
    Some(ok)
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

struct Run {
    base: Vec<u8>,
    /// Where the guest's primary superblock (guest bytes 1024..2048) lives in the
    /// qcow2 file: writes over it are never torn (see `rext4_testkit::crash`).
    superblock: std::ops::Range<u64>,
    events: Vec<Event>,
    files: BTreeMap<String, Vec<Version>>,
}

/// The workload on the qcow2 image `base` (named `path` in messages).
fn workload(base: Vec<u8>, path: &Path) -> Run {
    let host = Arc::new(RecHost {
        inner: Mutex::new((base.clone(), Vec::new())),
    });
    let dev = Qcow2::open_host(host.clone(), path, false).expect("open qcow2 read-write");
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(Arc::new(dev), opts).expect("open fs");
    let mut files: BTreeMap<String, Vec<Version>> = BTreeMap::new();
    fs.create_dir("/c").expect("mkdir");
    fs.sync().expect("sync");
    let n = env_u64("REXT4_QCOW2_CRASH_FILES", 10);
    for i in 0..n {
        let p = format!("/c/f{i}");
        let d = data(i, 3000 + (i as usize * 47_777) % 400_000);
        let start = host.len();
        let f = fs.create(&p).expect("create");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync");
        drop(f);
        files.entry(p).or_default().push(Version {
            start,
            durable: host.len(),
            content: Some(d),
        });
        if i % 4 == 3 {
            // Atomic replace of an earlier file.
            let j = i - 2;
            let d = data(1000 + i, 20_000 + (i as usize * 7919) % 200_000);
            let f = fs.create("/c/tmp").expect("create tmp");
            f.write_all_at(&d, 0).expect("write tmp");
            f.sync_all().expect("fsync tmp");
            drop(f);
            let p = format!("/c/f{j}");
            let start = host.len();
            fs.rename("/c/tmp", &p).expect("rename");
            fs.sync().expect("sync");
            files.entry(p).or_default().push(Version {
                start,
                durable: host.len(),
                content: Some(d),
            });
        }
        if i % 5 == 4 {
            // Delete an earlier file and give its space back.
            let p = format!("/c/f{}", i - 4);
            let start = host.len();
            fs.remove_file(&p).expect("rm");
            fs.sync().expect("sync");
            files.entry(p).or_default().push(Version {
                start,
                durable: host.len(),
                content: None,
            });
            fs.trim(0, u64::MAX, 0).expect("trim");
        }
    }
    fs.close().expect("close");
    drop(fs);
    Run {
        superblock: host_range(&base, 1024, 1024),
        base,
        events: host.take(),
        files,
    }
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The host bytes of guest bytes `[off, off + len)` in the qcow2 file `img`, which
/// must be allocated and contiguous there (they are in qemu-img's images).
fn host_range(img: &[u8], off: u64, len: u64) -> std::ops::Range<u64> {
    let cs = 1u64 << u32::from_be_bytes(img[20..24].try_into().expect("4 bytes"));
    let l1 = be64(img, 40) as usize;
    let host = |g: u64| {
        let gc = g / cs;
        let l2 = (be64(img, l1 + (gc / (cs / 8)) as usize * 8) & 0x00ff_ffff_ffff_fe00) as usize;
        assert!(l2 != 0, "guest byte {g} has no L2 table");
        let e = be64(img, l2 + (gc % (cs / 8)) as usize * 8) & 0x00ff_ffff_ffff_fe00;
        assert!(e != 0, "guest byte {g} is not allocated");
        e + g % cs
    };
    let (a, b) = (host(off), host(off + len - 1));
    assert_eq!(
        b - a,
        len - 1,
        "guest bytes {off}+{len} are not contiguous in the file"
    );
    a..b + 1
}

/// `qemu-img check`: exit code and output.
fn qemu_check(p: &Path) -> (i32, String) {
    let o = Command::new("qemu-img")
        .arg("check")
        .arg(p)
        .output()
        .expect("qemu-img check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code().unwrap_or(-1), text)
}

fn qemu_convert(args: &[&str]) {
    let o = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img");
    assert!(
        o.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Check one crash image of the qcow2 file (see the module note).
/// `compare`: also check that rext4's qcow2 reader reads what qemu reads.
fn check_image(
    img: &[u8],
    run: &Run,
    (lo, hi): (usize, usize),
    compare: bool,
    label: &str,
    dir: &TempDir,
) {
    let q = dir.join("crash.qcow2");
    let raw = dir.join("crash.raw");
    let qs = q.display().to_string();
    let raws = raw.display().to_string();
    std::fs::write(&q, img).expect("write image");
    let (code, text) = qemu_check(&q);
    assert!(
        (code == 0 || code == 3) && !text.contains("ERROR"),
        "{label}: qemu-img check exit {code}:\n{text}"
    );
    if compare {
        let _ = std::fs::remove_file(&raw);
        qemu_convert(&["convert", "-O", "raw", &qs, &raws]);
        let theirs = std::fs::read(&raw).expect("read export");
        let dev = Qcow2::open(&q, true).expect("open read-only");
        let mut ours = vec![0u8; theirs.len()];
        dev.read_at(&mut ours, 0).expect("read guest");
        drop(dev);
        assert!(
            ours == theirs,
            "{label}: rext4 reads other guest bytes than qemu"
        );
    }

    // Recovery through the qcow2 layer: open read-write (replay), close.
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_spec(&ImageSpec::file(&q), opts)
        .unwrap_or_else(|e| panic!("{label}: rext4 open read-write: {e}"));
    fs.close().unwrap_or_else(|e| panic!("{label}: close: {e}"));
    drop(fs);
    let (code, text) = qemu_check(&q);
    assert!(
        code == 0 && text.contains("No errors were found"),
        "{label}: after rext4's recovery and close, qemu-img check exit {code}:\n{text}"
    );
    let _ = std::fs::remove_file(&raw);
    qemu_convert(&["convert", "-O", "raw", &qs, &raws]);
    let fsck = e2fsck_fn(&raw);
    assert!(fsck.clean, "{label}: e2fsck -fn:\n{}", fsck.output);
    let fs = Fs::open(&raw).expect("open export");
    for (p, vs) in &run.files {
        let Some(ok) = allowed(vs, lo, hi) else {
            continue;
        };
        let got = fs.read(p).ok();
        assert!(
            ok.contains(&got.as_deref()),
            "{label}: {p} holds {:?} bytes, allowed: {:?}",
            got.as_ref().map(|g| g.len()),
            ok.iter().map(|o| o.map(|b| b.len())).collect::<Vec<_>>()
        );
    }
}

/// Build and check the crash images of `run`; returns how many.
fn sweep(name: &str, run: &Run) -> usize {
    let variants = env_u64("REXT4_CRASH_VARIANTS", 1);
    let dir = TempDir::new("qcow2crash").expect("tmp");
    let mut rng = Rng(0x0C0C_2000 ^ name.len() as u64);
    let points = crash::flush_points(&run.events);
    let mut at = run.base.clone();
    let mut applied = 0;
    let mut images = 0;
    for (k, &fp) in points.iter().enumerate() {
        let durable = fp + 1;
        at = crash::image_at(&at, &run.events[applied..durable], durable - applied);
        applied = durable;
        let next = points.get(k + 1).copied().unwrap_or(run.events.len());
        let label = format!("{name} sync {k}/{}", points.len());
        check_image(
            &at,
            run,
            (durable, durable),
            images % 4 == 0,
            &format!("{label} (at the sync)"),
            &dir,
        );
        images += 1;
        if crash::writes_after(&run.events, durable) > 0 {
            for v in 0..variants {
                let sb = &run.superblock;
                let whole = |o: u64, n: usize| o < sb.end && o + n as u64 > sb.start;
                let img = crash::image_with_lost_writes_keeping(
                    &at,
                    &run.events[durable..],
                    0,
                    &mut rng,
                    &whole,
                );
                check_image(
                    &img,
                    run,
                    (durable, next),
                    images % 4 == 0,
                    &format!("{label} (lost/torn {v})"),
                    &dir,
                );
                images += 1;
            }
        }
    }
    eprintln!(
        "[{name}] {images} crash images from {} events, {} sync points",
        run.events.len(),
        points.len()
    );
    images
}

fn base(opts: &[&str], dir: &TempDir) -> Option<Vec<u8>> {
    let raw = dir.join("base.raw");
    rext4_testkit::mkfs_at(&raw, &MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let q = dir.join("base.qcow2");
    let _ = std::fs::remove_file(&q);
    let mut args = vec!["convert", "-O", "qcow2"];
    args.extend_from_slice(opts);
    let (r, qs) = (raw.display().to_string(), q.display().to_string());
    args.push(&r);
    args.push(&qs);
    match Command::new("qemu-img").args(&args).output() {
        Ok(o) if o.status.success() => Some(std::fs::read(&q).expect("read base")),
        Ok(o) => panic!("qemu-img {args:?}: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            skip(&format!("qemu-img: {e}"));
            None
        }
    }
}

/// The refcount table's offset in a qcow2 header.
fn refcount_table_at(img: &[u8]) -> u64 {
    u64::from_be_bytes(img[48..56].try_into().expect("8 bytes"))
}

fn crash_sweep(name: &str, opts: &[&str]) -> Option<Run> {
    let dir = TempDir::new("qcow2crash-base").expect("tmp");
    let base = base(opts, &dir)?;
    let run = workload(base, &dir.join("base.qcow2"));
    let images = sweep(name, &run);
    let syncs = run
        .events
        .iter()
        .filter(|e| matches!(e, Event::Flush))
        .count();
    assert!(images >= syncs, "{name}: {images} images for {syncs} syncs");
    Some(run)
}

#[test]
fn crash_v3_default_clusters() {
    crash_sweep("v3", &[]);
}

#[test]
fn crash_v2() {
    crash_sweep("v2", &["-o", "compat=0.10"]);
}

#[test]
fn crash_small_clusters_refcount_table_moves() {
    let Some(run) = crash_sweep("v3-512", &["-o", "cluster_size=512,refcount_bits=64"]) else {
        return;
    };
    let end = crash::image_at(&run.base, &run.events, run.events.len());
    assert_ne!(
        refcount_table_at(&end),
        refcount_table_at(&run.base),
        "the refcount table never moved: the sweep did not cover its growth"
    );
}

/// The device's flush contract under crashes, without a filesystem on top: random
/// writes (any size and alignment, into unallocated, backing, and allocated clusters),
/// discards and flushes on a qcow2 overlay with small clusters, the qcow2 file
/// recorded. At every sync point of the file, and with the writes since lost or torn,
/// `qemu-img check` finds no corruption and every guest byte holds what it held at the
/// last completed device flush or a value written to it after that flush (a discarded
/// range may read anything). After rext4 opens and closes the image read-write it is
/// fully clean.
#[test]
fn device_flush_contract_under_crashes() {
    let dir = TempDir::new("qcow2flush").expect("tmp");
    let size = 8usize << 20;
    let backing: Vec<u8> = (0..size).map(|i| (i / 4096) as u8 | 0x40).collect();
    std::fs::write(dir.join("b.raw"), &backing).expect("backing");
    let q = dir.join("o.qcow2");
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096"])
        .args(["-b", "b.raw", "-F", "raw"])
        .arg(&q)
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("qemu-img create: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => return skip(&format!("qemu-img: {e}")),
    }
    let base = std::fs::read(&q).expect("read");
    let host = Arc::new(RecHost {
        inner: Mutex::new((base.clone(), Vec::new())),
    });
    let dev = Qcow2::open_host(host.clone(), &q, false).expect("open");
    // Completed flushes: (event index after it, the guest then); writes and discards:
    // (event index before it, offset, bytes or None for a discard).
    let mut model = backing.clone();
    let mut flushes = vec![(0usize, model.clone())];
    let mut ops: Vec<(usize, usize, Option<Vec<u8>>, usize)> = Vec::new();
    let mut rng = Rng(0xF1u64 << 40 | 7);
    // The first MiB written whole first: the second half of the run writes only there,
    // in place, so its flushes have no metadata to write (only the data to sync).
    let first = vec![0x33u8; 1 << 20];
    ops.push((host.len(), 0, Some(first.clone()), first.len()));
    dev.write_at(&first, 0).expect("write");
    model[..first.len()].copy_from_slice(&first);
    for op in 0..240u32 {
        let in_place = op >= 120;
        match rng.below(12) {
            0..=9 => {
                let len = match rng.below(3) {
                    0 => 1 + rng.below(900),
                    1 => 4096 * (1 + rng.below(6)),
                    _ => 1 + rng.below(40_000),
                } as usize;
                let room = if in_place { 1 << 20 } else { size };
                let off = rng.below((room - len) as u64 + 1) as usize;
                let data: Vec<u8> = (0..len)
                    .map(|i| (op as u8).wrapping_mul(7) ^ i as u8)
                    .collect();
                ops.push((host.len(), off, Some(data.clone()), len));
                dev.write_at(&data, off as u64).expect("write");
                model[off..off + len].copy_from_slice(&data);
            }
            10 if !in_place => {
                let len = rng.below(64 << 10) as usize;
                let off = rng.below((size - len) as u64 + 1) as usize;
                ops.push((host.len(), off, None, len));
                dev.discard(off as u64, len as u64).expect("discard");
                let mut now = vec![0u8; len];
                dev.read_at(&mut now, off as u64).expect("read");
                model[off..off + len].copy_from_slice(&now);
            }
            _ => {
                dev.flush().expect("flush");
                flushes.push((host.len(), model.clone()));
            }
        }
    }
    dev.flush().expect("flush");
    flushes.push((host.len(), model.clone()));
    drop(dev);
    let events = host.take();
    let points = crash::flush_points(&events);
    let mut rng = Rng(0x5eed);
    let mut images = 0;
    let p = dir.join("crash.qcow2");
    for (k, &fp) in points.iter().enumerate() {
        let lo = fp + 1;
        let hi = points.get(k + 1).copied().unwrap_or(events.len());
        let at = crash::image_at(&base, &events, lo);
        let mut imgs = vec![(at.clone(), lo)];
        if crash::writes_after(&events, lo) > 0 {
            imgs.push((
                crash::image_with_lost_writes(&at, &events[lo..], 0, &mut rng),
                hi,
            ));
        }
        for (img, hi) in imgs {
            let label = format!(
                "sync {k}/{} (events before {lo}, maybe to {hi})",
                points.len()
            );
            std::fs::write(&p, &img).expect("write");
            let (code, text) = qemu_check(&p);
            assert!(
                (code == 0 || code == 3) && !text.contains("ERROR"),
                "{label}: qemu-img check exit {code}:\n{text}"
            );
            let dev = Qcow2::open(&p, true).expect("open crash image");
            let mut got = vec![0u8; size];
            dev.read_at(&mut got, 0).expect("read crash image");
            drop(dev);
            // The last device flush that may have returned before the crash (the crash
            // came at `hi` at the latest), and what was issued after it.
            let (f_end, f_model) = flushes
                .iter()
                .rev()
                .find(|(end, _)| *end <= hi)
                .expect("a flush");
            let mut ok: Vec<bool> = got.iter().zip(f_model).map(|(a, b)| a == b).collect();
            for (start, off, data, len) in &ops {
                if *start < *f_end || *start >= hi {
                    continue;
                }
                for i in *off..off + len {
                    ok[i] |= data.as_ref().is_none_or(|d| d[i - off] == got[i]);
                }
            }
            if let Some(i) = ok.iter().position(|&x| !x) {
                panic!(
                    "{label}: guest byte {i} is {:#x}; at the last flush it was {:#x} and \
                     nothing written since holds that",
                    got[i], f_model[i]
                );
            }
            let dev = Qcow2::open(&p, false).expect("open read-write");
            dev.flush().expect("flush");
            drop(dev);
            let (code, text) = qemu_check(&p);
            assert!(
                code == 0,
                "{label}: after a read-write open, exit {code}:\n{text}"
            );
            images += 1;
        }
    }
    eprintln!("{images} crash images from {} events", events.len());
    assert!(images >= points.len());
}
