//! Early commits (`FsOptions::early_commit_ms`, how the mount survives a crash of its
//! server): a crash of the process — every write made so far reached the image, in
//! order, nothing torn — at any write loses nothing the last early commit held, when
//! the image is opened again in the same boot. In another boot (a power loss restarted
//! the machine) and for the kernel's and e2fsck's recovery the early commits do not
//! exist: what the last commit held is there. After every recovery e2fsck -fn is
//! clean. (Power loss with torn and lost writes: `crash.rs`, `crash_early_commits`.)

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::Recorder;
use rext4::{Fs, FsOptions};
use rext4_testkit::crash::{self, Event, Rng};
use rext4_testkit::{e2fsck_fn, e2fsck_fy, mkfs, skip, LoopMount, MkfsOptions, TempDir};

const BOOT: [u8; 16] = [0x5a; 16];
const OTHER_BOOT: [u8; 16] = [0xa5; 16];

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// One version of a file: written from event `start` on; safe from a process crash
/// from `early` on (an early commit or a commit held it), from a power loss from
/// `hard` on (a commit held it). `None` data: the file is gone.
#[derive(Clone, Debug)]
struct Version {
    start: usize,
    early: usize,
    hard: usize,
    data: Option<Vec<u8>>,
}

/// What a file may hold after a crash at event `p`: the newest version safe by then
/// (by `safe`), or the one being written after it.
fn allowed(vs: &[Version], p: usize, safe: impl Fn(&Version) -> usize) -> Vec<Option<&Vec<u8>>> {
    let Some(i) = vs.iter().rposition(|v| safe(v) <= p) else {
        return Vec::new();
    };
    let mut ok = vec![vs[i].data.as_ref()];
    for v in &vs[i + 1..] {
        if v.start <= p {
            ok.push(v.data.as_ref());
        }
    }
    ok
}

struct Run {
    base: Vec<u8>,
    events: Vec<Event>,
    files: BTreeMap<String, Vec<Version>>,
}

/// Creates, overwrites, unlinks, a directory, an fsync, a growing file; early commits
/// between; no close (the process dies after the last write).
fn run() -> Run {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let base = std::fs::read(img.path()).expect("read");
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = Fs::open_device(
        dev.clone(),
        FsOptions {
            read_only: false,
            commit_secs: 0,
            boot_id: Some(BOOT),
            ..FsOptions::default()
        },
    )
    .expect("open");
    let mut files: BTreeMap<String, Vec<Version>> = BTreeMap::new();
    let mut pending: Vec<(String, usize, Option<Vec<u8>>)> = Vec::new();
    let mut step = |fs: &Fs, pending: &mut Vec<(String, usize, Option<Vec<u8>>)>, hard: bool| {
        if hard {
            fs.sync().expect("sync");
        } else {
            fs.early_commit().expect("early commit");
        }
        let at = dev.len();
        for (p, start, d) in pending.drain(..) {
            files.entry(p).or_default().push(Version {
                start,
                early: at,
                hard: if hard { at } else { usize::MAX },
                data: d,
            });
        }
        at
    };
    fs.create_dir("/a").expect("mkdir");
    for i in 0..10u64 {
        let p = format!("/a/f{i}");
        let d = data(i, 300 + (i as usize * 211) % 4000);
        pending.push((p.clone(), dev.len(), Some(d.clone())));
        fs.write(&p, &d).expect("write");
    }
    step(&fs, &mut pending, false);
    // Replace one (write a new file, rename it over: an overwrite in place is not
    // atomic on ext4 either), unlink another, a new directory with a file.
    let d0 = data(100, 2000);
    pending.push(("/a/f0".into(), dev.len(), Some(d0.clone())));
    fs.write("/a/f0.new", &d0).expect("write");
    fs.rename("/a/f0.new", "/a/f0").expect("rename over");
    pending.push(("/a/f1".into(), dev.len(), None));
    fs.remove_file("/a/f1").expect("rm");
    fs.create_dir("/b").expect("mkdir");
    let g = data(101, 9000);
    pending.push(("/b/g".into(), dev.len(), Some(g.clone())));
    fs.write("/b/g", &g).expect("write");
    step(&fs, &mut pending, false);
    // A commit (as fsync and sync make): from here a power loss keeps all of it.
    let c = data(102, 5000);
    pending.push(("/c".into(), dev.len(), Some(c.clone())));
    fs.write("/c", &c).expect("write");
    step(&fs, &mut pending, true);
    // After the commit, early commits again, one of a file growing in pieces.
    let mut d = Vec::new();
    for k in 0..4u64 {
        d.extend(data(200 + k, 3000));
        pending.push(("/d".into(), dev.len(), Some(d.clone())));
        fs.write("/d", &d).expect("write");
        step(&fs, &mut pending, false);
    }
    let e = data(300, 1500);
    pending.push(("/e".into(), dev.len(), Some(e.clone())));
    fs.write("/e", &e).expect("write");
    // The process dies here: no close, the last write never committed.
    std::mem::forget(fs);
    let events = dev.take();
    // Versions never made safe stay allowed as "being written" only.
    for (p, start, d) in pending {
        files.entry(p).or_default().push(Version {
            start,
            early: usize::MAX,
            hard: usize::MAX,
            data: d,
        });
    }
    Run {
        base,
        events,
        files,
    }
}

fn check(path: &std::path::Path, run: &Run, p: usize, same_boot: bool, label: &str) {
    let fsck = e2fsck_fn(path);
    assert!(fsck.clean, "{label}: e2fsck -fn:\n{}", fsck.output);
    let fs = Fs::open(path).expect("open after recovery");
    for (file, vs) in &run.files {
        let ok = if same_boot {
            allowed(vs, p, |v| v.early)
        } else {
            allowed(vs, p, |v| v.hard)
        };
        if ok.is_empty() {
            continue;
        }
        let got = match fs.read(file) {
            Ok(c) => Some(c),
            Err(rext4::Error::NotFound) => None,
            Err(e) => panic!("{label}: {file}: {e}"),
        };
        assert!(
            ok.contains(&got.as_ref()),
            "{label}: {file} holds {:?} bytes; allowed: {:?}",
            got.as_ref().map(Vec::len),
            ok.iter().map(|o| o.map(|v| v.len())).collect::<Vec<_>>()
        );
    }
}

/// Recover with rext4 in `boot`.
fn rext4_recover(path: &std::path::Path, boot: [u8; 16]) {
    let fs = Fs::open_with(
        path,
        FsOptions {
            read_only: false,
            commit_secs: 0,
            boot_id: Some(boot),
            ..FsOptions::default()
        },
    )
    .expect("recover");
    fs.close().expect("close");
}

/// A crash of the process at every write: the same boot replays the early commits;
/// another boot does not.
#[test]
fn a_process_crash_at_any_write_keeps_the_last_early_commit() {
    let run = run();
    // Blocks, not write calls: the journal writes a run of log blocks in one call.
    let writes: usize = run
        .events
        .iter()
        .map(|e| match e {
            Event::Write { data, .. } => data.len() / 1024,
            _ => 0,
        })
        .sum();
    assert!(writes > 100, "the run wrote {writes} blocks");
    let tmp = TempDir::new("early").expect("tmp");
    let path = tmp.join("img");
    let mut checked = 0;
    for p in 0..=run.events.len() {
        // Every write of the last few hundred events, every fifth before.
        if p + 300 < run.events.len() && p % 5 != 0 {
            continue;
        }
        let img = crash::image_at(&run.base, &run.events, p);
        for (boot, same) in [(BOOT, true), (OTHER_BOOT, false)] {
            std::fs::write(&path, &img).expect("write image");
            rext4_recover(&path, boot);
            check(
                &path,
                &run,
                p,
                same,
                &format!("crash at event {p}, same boot {same}"),
            );
            checked += 1;
        }
    }
    eprintln!(
        "{checked} recoveries from {} events checked",
        run.events.len()
    );
}

/// The kernel and e2fsck never see an early commit: after a crash with early
/// commits in the log they recover to the last commit, clean.
#[test]
fn the_kernel_and_e2fsck_ignore_early_commits() {
    let run = run();
    let tmp = TempDir::new("early").expect("tmp");
    let path = tmp.join("img");
    let img = crash::image_at(&run.base, &run.events, run.events.len());
    std::fs::write(&path, &img).expect("write image");
    let r = e2fsck_fy(&path);
    assert!(
        r.exit_code <= 1,
        "e2fsck -fy exit {}:\n{}",
        r.exit_code,
        r.output
    );
    check(&path, &run, run.events.len(), false, "e2fsck -fy");
    std::fs::write(&path, &img).expect("write image");
    match LoopMount::new(&path, false, "") {
        Ok(m) => {
            m.unmount().expect("unmount");
            check(&path, &run, run.events.len(), false, "kernel");
        }
        Err(e) => skip(&format!("kernel recovery: {e}")),
    }
    // And rext4 in the same boot finds more: every early commit.
    std::fs::write(&path, &img).expect("write image");
    rext4_recover(&path, BOOT);
    let fs = Fs::open(&path).expect("open");
    assert_eq!(
        fs.read("/d").expect("/d").len(),
        12000,
        "the last early commit"
    );
}
