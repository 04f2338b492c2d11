//! Crash sweep: workloads run on a recording device; from the recorded writes and
//! flushes, crash images are built at every flush point and with the writes since the
//! last flush lost or torn. Each image is recovered (rext4's replay on open; as root
//! also the kernel's; and e2fsck -fy), then `e2fsck -fn` must be clean and every file
//! whose fsync completed before the crash must hold exactly its fsynced content.
//!
//! Workloads: many small files written and fsynced; atomic replace (write temp, fsync,
//! rename over, fsync); deep trees with unlinks; large appends and truncates; files
//! with early commits (unflushed log writes, as the mount makes) between fsyncs; four
//! threads writing, rewriting and fsyncing at once (group commit).
//! `REXT4_CRASH_VARIANTS` (default 3, what CI runs) lost/torn variants per flush point;
//! the long sweep (`REXT4_CRASH_VARIANTS=40`) builds ≥ 50,000 images. Each sweep asserts
//! the least number of images its workload must give (one per fsync/sync, plus the
//! variants after each but the last) and that every recoverer recovered some.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::Recorder;
use rext4::{Fs, FsOptions};
use rext4_testkit::crash::{self, Event, Rng};
use rext4_testkit::{e2fsck_fn, e2fsck_fy, mkfs, skip, LoopMount, MkfsOptions, TempDir};

/// The fsynced history of one file: version `i` was being written from `start` on and
/// was durable (its fsync had completed) from `durable` on. After a crash at event
/// index `p`, the file holds the last durable version, or — if the next version's
/// write had started — either of the two. From `deleted_from` on it may be gone.
#[derive(Clone, Debug, Default)]
struct History {
    versions: Vec<(usize, usize, Vec<u8>)>,
    deleted_from: Option<usize>,
}

impl History {
    fn allowed(&self, p: usize) -> Option<(Vec<&Vec<u8>>, bool)> {
        let i = self.versions.iter().rposition(|v| v.1 <= p)?;
        let mut ok = vec![&self.versions[i].2];
        if let Some(next) = self.versions.get(i + 1) {
            if next.0 <= p {
                ok.push(&next.2);
            }
        }
        Some((ok, self.deleted_from.is_some_and(|d| p >= d)))
    }
}

/// The boot the workloads write in, and the one recovery runs in (after a power loss
/// the machine restarted).
const WRITER_BOOT: [u8; 16] = [0xB0; 16];
const RESTARTED_BOOT: [u8; 16] = [0xB1; 16];

struct Run {
    base: Vec<u8>,
    events: Vec<Event>,
    files: BTreeMap<String, History>,
    /// fsync and sync calls that returned: each flushed the device at least once.
    syncs: usize,
}

fn rw(dev: Arc<Recorder>) -> Fs {
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    Fs::open_device(dev, opts).expect("open rw")
}

fn base_image() -> Vec<u8> {
    let img = mkfs(&MkfsOptions::new(1024, 8 << 20)).expect("mkfs");
    std::fs::read(img.path()).expect("read")
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

fn small_files() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    fs.create_dir("/s").expect("mkdir");
    for i in 0..60u64 {
        let p = format!("/s/f{i}");
        let d = data(i, 100 + (i as usize * 37) % 3000);
        let start = dev.len();
        let f = fs.create(&p).expect("create");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync");
        syncs += 1;
        files.insert(
            p,
            History {
                versions: vec![(start, dev.len(), d)],
                deleted_from: None,
            },
        );
    }
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files,
    }
}

/// Files written with early commits between them (as the mount makes every moment):
/// unflushed transactions in the log, which a power loss may tear; every third file
/// fsynced. The boot that wrote them is `WRITER_BOOT`; recovery acts as after a
/// restart (`recover`), where only what was committed counts.
fn early_commits() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        boot_id: Some(WRITER_BOOT),
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts).expect("open rw");
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    fs.create_dir("/e").expect("mkdir");
    for i in 0..30u64 {
        let p = format!("/e/f{i}");
        let d = data(i + 500, 200 + (i as usize * 53) % 5000);
        let start = dev.len();
        let f = fs.create(&p).expect("create");
        f.write_all_at(&d, 0).expect("write");
        if i % 3 == 2 {
            f.sync_all().expect("fsync");
            syncs += 1;
            files.insert(
                p,
                History {
                    versions: vec![(start, dev.len(), d)],
                    deleted_from: None,
                },
            );
        } else {
            fs.early_commit().expect("early commit");
        }
    }
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files,
    }
}

/// Four threads write and fsync files of their own at once (and replace every third
/// one by rename), so fsyncs share commits (group commit): an fsync that found its
/// changes committed by another thread's commit returned without one, and its file
/// must be there all the same. (A rewrite in place would not do here: other threads'
/// commits may catch it truncated, which is no fsynced version.)
fn concurrent_fsyncs() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    fs.create_dir("/c").expect("mkdir");
    fs.sync().expect("sync");
    let before = fs.journal_stats().commits;
    let histories: Vec<BTreeMap<String, History>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (fs, dev) = (fs.clone(), dev.clone());
                sc.spawn(move || {
                    let mut files: BTreeMap<String, History> = BTreeMap::new();
                    for i in 0..15u64 {
                        let p = format!("/c/t{t}-f{i}");
                        let d = data(t * 100 + i, 300 + (i as usize * 211) % 4000);
                        let start = dev.len();
                        let f = fs.create(&p).expect("create");
                        f.write_all_at(&d, 0).expect("write");
                        f.sync_all().expect("fsync");
                        files
                            .entry(p)
                            .or_default()
                            .versions
                            .push((start, dev.len(), d));
                        if i % 3 == 2 {
                            // Replace an earlier file of this thread atomically: a new
                            // version fsynced under a temporary name, renamed over it,
                            // and the rename made durable by an fsync of the file.
                            let q = format!("/c/t{t}-f{}", i - 2);
                            let tmp = format!("/c/t{t}-tmp");
                            let d2 = data(t * 100 + i + 50, 100 + (i as usize * 97) % 3000);
                            let f = fs.create(&tmp).expect("create tmp");
                            f.write_all_at(&d2, 0).expect("write tmp");
                            f.sync_all().expect("fsync tmp");
                            let start = dev.len();
                            fs.rename(&tmp, &q).expect("rename");
                            f.sync_all().expect("fsync");
                            files
                                .entry(q)
                                .or_default()
                                .versions
                                .push((start, dev.len(), d2));
                        }
                    }
                    files
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    // The sweep needs one image per flush that ended a commit; fsyncs that shared a
    // commit made no flush of their own.
    let syncs = (fs.journal_stats().commits - before) as usize;
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files: histories.into_iter().flatten().collect(),
    }
}

fn atomic_replace() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut h = History::default();
    let mut syncs = 0;
    for v in 0..40u64 {
        let d = data(1000 + v, 500 + (v as usize * 91) % 2500);
        let f = fs.create("/config.tmp").expect("create tmp");
        f.write_all_at(&d, 0).expect("write");
        f.sync_all().expect("fsync tmp");
        let start = dev.len();
        fs.rename("/config.tmp", "/config").expect("rename");
        fs.sync().expect("fsync dir");
        syncs += 2;
        h.versions.push((start, dev.len(), d));
    }
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files: BTreeMap::from([("/config".to_string(), h)]),
    }
}

fn deep_trees() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let mut files = BTreeMap::new();
    let mut syncs = 0;
    for t in 0..6u64 {
        let start = dev.len();
        let mut p = format!("/t{t}");
        fs.create_dir(&p).expect("mkdir");
        for depth in 0..8 {
            p.push_str(&format!("/d{depth}"));
            fs.create_dir(&p).expect("mkdir");
            fs.write(format!("{p}/leaf"), data(t * 100 + depth, 200))
                .expect("write");
        }
        fs.sync().expect("sync");
        syncs += 1;
        let durable = dev.len();
        let mut p = format!("/t{t}");
        for depth in 0..8 {
            p.push_str(&format!("/d{depth}"));
            let h = History {
                versions: vec![(start, durable, data(t * 100 + depth, 200))],
                deleted_from: None,
            };
            files.insert(format!("{p}/leaf"), h);
        }
        if t % 2 == 1 {
            let from = dev.len();
            fs.remove_dir_all(format!("/t{t}/d0/d1")).expect("rm -r");
            fs.sync().expect("sync");
            syncs += 1;
            for (k, h) in files.iter_mut() {
                if k.starts_with(&format!("/t{t}/d0/d1/")) {
                    h.deleted_from = Some(from);
                }
            }
        }
    }
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files,
    }
}

fn appends_and_truncates() -> Run {
    let base = base_image();
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    let f = fs.create("/log").expect("create");
    let mut content: Vec<u8> = Vec::new();
    let mut h = History::default();
    let mut syncs = 0;
    for i in 0..40u64 {
        let start = dev.len();
        if i % 7 == 6 {
            let n = content.len() / 2;
            f.set_len(n as u64).expect("truncate");
            content.truncate(n);
        } else {
            let d = data(5000 + i, 3000 + (i as usize * 517) % 40_000);
            f.write_all_at(&d, content.len() as u64).expect("append");
            content.extend_from_slice(&d);
        }
        f.sync_all().expect("fsync");
        syncs += 1;
        h.versions.push((start, dev.len(), content.clone()));
    }
    fs.close().expect("close");
    Run {
        base,
        events: dev.take(),
        syncs,
        files: BTreeMap::from([("/log".to_string(), h)]),
    }
}

/// Recover an image file the way `how` says; returns a description of a failure.
fn recover(path: &std::path::Path, how: &str) -> Result<(), String> {
    match how {
        "rext4" => {
            // A crash image is what a power loss leaves: the machine restarted, so
            // early commits (written without a flush, in `WRITER_BOOT`) do not count.
            let opts = FsOptions {
                read_only: false,
                commit_secs: 0,
                boot_id: Some(RESTARTED_BOOT),
                ..FsOptions::default()
            };
            let fs = Fs::open_with(path, opts).map_err(|e| format!("rext4 open: {e}"))?;
            fs.close().map_err(|e| format!("rext4 close: {e}"))
        }
        "e2fsck" => {
            let r = e2fsck_fy(path);
            // 0 or 1 (fixed: the journal was replayed) are fine; more is a failure.
            if r.exit_code > 1 {
                return Err(format!("e2fsck -fy exit {}:\n{}", r.exit_code, r.output));
            }
            Ok(())
        }
        "kernel" => {
            let m = LoopMount::new(path, false, "")?;
            m.unmount()
        }
        _ => unreachable!(),
    }
}

/// Check one crash image (written to `path`) against the histories at point `p`.
fn check(path: &std::path::Path, run: &Run, p: usize, label: &str) {
    let fsck = e2fsck_fn(path);
    assert!(
        fsck.clean,
        "{label}: e2fsck after recovery:\n{}",
        fsck.output
    );
    let fs = Fs::open(path).expect("open after recovery");
    for (file, h) in &run.files {
        let Some((ok, may_be_gone)) = h.allowed(p) else {
            continue;
        };
        match fs.read(file) {
            Ok(c) => assert!(
                ok.contains(&&c),
                "{label}: {file} has {} bytes, not what was fsynced before the crash",
                c.len()
            ),
            Err(rext4::Error::NotFound) if may_be_gone => {}
            Err(err) => panic!("{label}: {file} unreadable after its fsync completed: {err}"),
        }
    }
}

fn sweep(name: &str, run: Run, recoverers: &[&str]) -> usize {
    let variants: u64 = std::env::var("REXT4_CRASH_VARIANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let tmp = TempDir::new("crash").expect("tmp");
    let path = tmp.join("img");
    let mut rng = Rng(0xC4A5_0000 ^ name.len() as u64);
    let mut images = 0;
    let mut used = BTreeMap::new();
    let points = crash::flush_points(&run.events);
    for (k, &fp) in points.iter().enumerate() {
        let durable = fp + 1;
        let mut imgs = vec![(
            crash::image_at(&run.base, &run.events, durable),
            "at flush".to_string(),
        )];
        if crash::writes_after(&run.events, durable) > 0 {
            for v in 0..variants {
                imgs.push((
                    crash::image_with_lost_writes(&run.base, &run.events, durable, &mut rng),
                    format!("lost/torn {v}"),
                ));
            }
        }
        for (img, what) in imgs {
            let how = recoverers[(k + images) % recoverers.len()];
            std::fs::write(&path, &img).expect("write image");
            let label = format!(
                "{name} flush {k}/{} ({what}), recovered by {how}",
                points.len()
            );
            if let Err(e) = recover(&path, how) {
                panic!("{label}: recovery failed: {e}");
            }
            check(&path, &run, durable, &label);
            images += 1;
            *used.entry(how).or_insert(0usize) += 1;
        }
    }
    eprintln!(
        "{name}: {images} crash images from {} flush points passed ({} fsync/sync calls, \
         {variants} variants per point)",
        points.len(),
        run.syncs
    );
    // Every fsync or sync that returned flushed the device, and every one but the last
    // was followed by writes of the next step: at least one image at each, plus the
    // lost/torn variants after all but the last. A sweep that found no flush points or
    // built fewer images than that has not checked what it claims.
    let least = run.syncs + variants as usize * run.syncs.saturating_sub(1);
    assert!(
        run.syncs > 0 && images >= least,
        "{name}: {images} crash images from {} flush points; {} fsync/sync calls with \
         {variants} variants each need at least {least}",
        points.len(),
        run.syncs
    );
    for how in recoverers {
        assert!(
            used.get(how).copied().unwrap_or(0) > 0,
            "{name}: no image was recovered by {how}"
        );
    }
    images
}

fn recoverers() -> Vec<&'static str> {
    if let Ok(v) = std::env::var("REXT4_CRASH_RECOVER") {
        // e.g. "e2fsck,kernel": only these recoverers.
        return v
            .split(',')
            .map(|w| match w {
                "rext4" => "rext4",
                "e2fsck" => "e2fsck",
                _ => "kernel",
            })
            .collect();
    }
    if rext4_testkit::can_loop_mount().is_ok() {
        vec!["rext4", "rext4", "e2fsck", "kernel"]
    } else {
        skip("kernel replay of crash images needs loop mounts");
        vec!["rext4", "e2fsck"]
    }
}

#[test]
fn crash_small_files_fsync() {
    sweep("small-files", small_files(), &recoverers());
}

#[test]
fn crash_atomic_replace() {
    sweep("atomic-replace", atomic_replace(), &recoverers());
}

#[test]
fn crash_deep_trees_unlink() {
    sweep("deep-trees", deep_trees(), &recoverers());
}

#[test]
fn crash_appends_truncates() {
    sweep("appends-truncates", appends_and_truncates(), &recoverers());
}

#[test]
fn crash_concurrent_fsyncs() {
    sweep("concurrent-fsyncs", concurrent_fsyncs(), &recoverers());
}

#[test]
fn crash_early_commits() {
    sweep("early-commits", early_commits(), &recoverers());
}
