//! DAX persistence under simulated power failures (SEEDS lesson E, ADR model).
//!
//! A random workload (writes, mapping writes, truncates, punches, fsyncs) runs once on
//! a DAX image whose device reports every store, write-back and fence to a recorder.
//! The recorded run is then replayed through the testkit's persistence simulator,
//! which stops at 10,000+ random points: at each, a power failure drops every store
//! not written back and fenced (or, in the adversarial half, keeps a random subset of
//! them), rext4 opens the image (journal replay), and every byte a completed fsync
//! covered — and not touched since — must read back. e2fsck -fn checks every distinct
//! metadata state the failures leave. In the adversarial half the two superblocks
//! (ext4's and the journal's) are taken as atomic (see testkit::pmem).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rext4::dax::{DaxDevice, PersistObserver, Store};
use rext4::device::{BlockDevice, MemDevice};
use rext4::{FallocMode, Fs, FsOptions, OpenOptions};
use rext4_testkit::crash::Rng;
use rext4_testkit::pmem::PmemSim;
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions, TempDir};

/// What the recorder keeps, in order.
enum Ev {
    Store {
        first: u64,
        lines: Vec<u8>,
        nt: bool,
    },
    WriteBack {
        first: u64,
        lines: Vec<u8>,
    },
    Fence,
    /// The test is about to change these bytes of file `f` (their promise lapses).
    Touch {
        f: usize,
        from: u64,
        to: u64,
    },
    /// An fsync of file `f` returned; its contents then were these.
    Synced {
        f: usize,
        content: Vec<u8>,
    },
}

#[derive(Default)]
struct Recorder {
    on: AtomicBool,
    log: Mutex<Vec<Ev>>,
}

impl Recorder {
    fn push(&self, e: Ev) {
        if self.on.load(Ordering::Relaxed) {
            self.log.lock().unwrap_or_else(|p| p.into_inner()).push(e);
        }
    }
}

impl PersistObserver for Recorder {
    fn stored(&self, first: u64, lines: &[u8], how: Store) {
        self.push(Ev::Store {
            first,
            lines: lines.to_vec(),
            nt: how == Store::NonTemporal,
        });
    }
    fn written_back(&self, first: u64, lines: &[u8]) {
        self.push(Ev::WriteBack {
            first,
            lines: lines.to_vec(),
        });
    }
    fn fenced(&self) {
        self.push(Ev::Fence);
    }
}

const FILES: usize = 4;
const SPAN: u64 = 192 << 10;

fn fill(rng: &mut Rng, n: usize) -> Vec<u8> {
    let seed = rng.next_u64();
    (0..n as u64)
        .map(|i| (seed.wrapping_add(i.wrapping_mul(0x9E37_79B9)) >> 24) as u8)
        .collect()
}

/// Run the workload on a recorded DAX image; returns the image when recording
/// started, the log, and where the journal superblock is (byte offset).
fn record(seed: u64, ops: usize) -> (Vec<u8>, Vec<Ev>, u64) {
    let img = mkfs(&MkfsOptions::new(4096, 8 << 20)).expect("mkfs");
    let shm = img.copy_to_memory().expect("copy to tmpfs");
    let rec = Arc::new(Recorder::default());
    let dev = DaxDevice::open(shm.path(), false)
        .expect("map")
        .with_observer(rec.clone());
    let opts = FsOptions {
        read_only: false,
        dax: true,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(Arc::new(dev), opts).expect("open dax");
    let mut rng = Rng(seed);
    let mut files = Vec::new();
    let mut model: Vec<Vec<u8>> = Vec::new();
    for i in 0..FILES {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(&fs, format!("/f{i}"))
            .expect("create");
        let d = fill(&mut rng, (SPAN / 2) as usize);
        f.write_all_at(&d, 0).expect("initial data");
        files.push(f);
        model.push(d);
    }
    let maps: Vec<_> = files.iter().map(|f| f.map(0, SPAN).expect("map")).collect();
    fs.sync().expect("sync");
    let (_, jext) = fs.fiemap_ino(rext4::Ino(8), 1).expect("journal extents");
    let Some(&(0, rext4::Mapping::Mapped { physical, .. })) = jext.first() else {
        panic!("journal inode's first block is not mapped: {jext:?}");
    };
    let base = std::fs::read(shm.path()).expect("read the image");
    rec.on.store(true, Ordering::SeqCst);
    for (i, m) in model.iter().enumerate() {
        rec.push(Ev::Synced {
            f: i,
            content: m.clone(),
        });
    }
    for _ in 0..ops {
        let f = rng.below(FILES as u64) as usize;
        let size = model[f].len() as u64;
        match rng.below(100) {
            0..=39 => {
                let off = rng.below(SPAN);
                let n = 1 + rng.below(12 << 10) as usize;
                let d = fill(&mut rng, n);
                rec.push(Ev::Touch {
                    f,
                    from: off,
                    to: off + n as u64,
                });
                files[f].write_all_at(&d, off).expect("write");
                let end = off as usize + n;
                if model[f].len() < end {
                    model[f].resize(end, 0);
                }
                model[f][off as usize..end].copy_from_slice(&d);
            }
            40..=54 if size > 0 => {
                // A store through the mapping (cached, recorded dirty), inside the file
                // and the mapping.
                let lim = size.min(SPAN);
                let off = rng.below(lim);
                let n = (1 + rng.below(6 << 10)).min(lim - off) as usize;
                let d = fill(&mut rng, n);
                rec.push(Ev::Touch {
                    f,
                    from: off,
                    to: off + n as u64,
                });
                maps[f].write(off, &d).expect("mapping write");
                model[f][off as usize..off as usize + n].copy_from_slice(&d);
            }
            55..=59 if size > 0 => {
                // An overwrite that changes no metadata (the mount's writes under the
                // kernel's writeback cache): its fsync has nothing to commit, and
                // must still fence.
                let off = rng.below(size);
                let n = (1 + rng.below(8 << 10)).min(size - off) as usize;
                let d = fill(&mut rng, n);
                rec.push(Ev::Touch {
                    f,
                    from: off,
                    to: off + n as u64,
                });
                let w = fs
                    .write_ino_at_keep_times(files[f].ino(), &d, off)
                    .expect("overwrite");
                assert_eq!(w, n);
                model[f][off as usize..off as usize + n].copy_from_slice(&d);
            }
            60..=62 => {
                let to = rng.below(SPAN);
                rec.push(Ev::Touch {
                    f,
                    from: to.min(size),
                    to: to.max(size),
                });
                files[f].set_len(to).expect("set_len");
                model[f].resize(to as usize, 0);
            }
            63..=65 if size > 0 => {
                let off = rng.below(size);
                let n = (1 + rng.below(32 << 10)).min(size - off);
                rec.push(Ev::Touch {
                    f,
                    from: off,
                    to: off + n,
                });
                fs.fallocate_ino(files[f].ino(), FallocMode::PunchHole, off, n)
                    .expect("punch");
                model[f][off as usize..(off + n) as usize].fill(0);
            }
            66..=94 => {
                if rng.below(2) == 0 {
                    files[f].sync_all().expect("fsync");
                } else {
                    files[f].sync_data().expect("fdatasync");
                }
                rec.push(Ev::Synced {
                    f,
                    content: model[f].clone(),
                });
            }
            _ => {
                fs.sync().expect("sync");
                for (i, m) in model.iter().enumerate() {
                    rec.push(Ev::Synced {
                        f: i,
                        content: m.clone(),
                    });
                }
            }
        }
    }
    // The model and the live filesystem agree before any failure.
    for (i, f) in files.iter().enumerate() {
        let mut back = vec![0u8; f.len().expect("len") as usize];
        f.read_exact_at(&mut back, 0).expect("read");
        assert!(back == model[i], "file {i} differs from the model");
    }
    drop(maps);
    drop(files);
    fs.close().expect("close");
    rec.on.store(false, Ordering::SeqCst);
    let log = std::mem::take(&mut *rec.log.lock().unwrap_or_else(|p| p.into_inner()));
    (base, log, physical * 4096)
}

/// What fsync promised for one file: its contents at the last completed fsync, and
/// the bytes changed since (whose value is open).
struct Promise {
    content: Vec<u8>,
    touched: Vec<(u64, u64)>,
}

impl Promise {
    /// The byte ranges of `content` still promised (not touched since the fsync).
    fn kept(&self) -> Vec<(usize, usize)> {
        let mut t = self.touched.clone();
        t.sort_unstable();
        let len = self.content.len() as u64;
        let mut out = Vec::new();
        let mut pos = 0u64;
        for (a, e) in t {
            if a > pos {
                out.push((pos.min(len) as usize, a.min(len) as usize));
            }
            pos = pos.max(e);
        }
        if pos < len {
            out.push((pos as usize, len as usize));
        }
        out.retain(|(a, e)| a < e);
        out
    }
}

/// Open a crash image (replaying the journal), check every promised byte and rext4's
/// own audit (every metadata block verifies, counts agree with the bitmaps), close
/// it, and return the post-replay image with a key of its metadata state (every
/// metadata block the audit visits but the superblock's, whose times differ, and the
/// superblock's counts) — or a description of what was wrong.
fn check_one(img: Vec<u8>, promises: &[Promise]) -> Result<(Arc<MemDevice>, u32), String> {
    let dev = Arc::new(MemDevice::new(img));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts).map_err(|e| format!("open: {e}"))?;
    for (i, p) in promises.iter().enumerate() {
        // O_DIRECT reads: straight from the device, no page cache to fill.
        let f = OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&fs, format!("/f{i}"))
            .map_err(|e| format!("/f{i} open: {e}"))?;
        let size = f.len().map_err(|e| e.to_string())?;
        let mut back = vec![0u8; size as usize];
        f.read_exact_at(&mut back, 0)
            .map_err(|e| format!("/f{i} read: {e}"))?;
        if p.touched.is_empty() && size != p.content.len() as u64 {
            return Err(format!(
                "/f{i}: size {size}, fsync promised {}",
                p.content.len()
            ));
        }
        for (a, e) in p.kept() {
            let got = back.get(a..e);
            if got != Some(&p.content[a..e]) {
                let first = (a..e)
                    .find(|&b| back.get(b) != Some(&p.content[b]))
                    .unwrap_or(a);
                return Err(format!(
                    "/f{i}: byte {first} is {:?}, fsync promised {} (size {size})",
                    back.get(first),
                    p.content[first]
                ));
            }
        }
    }
    let audit = fs.audit().map_err(|e| format!("audit: {e}"))?;
    if !audit.problems.is_empty() {
        return Err(format!("audit: {:?}", audit.problems));
    }
    let diffs = fs.check_counts().map_err(|e| format!("counts: {e}"))?;
    if !diffs.is_empty() {
        return Err(format!("counts: {diffs:?}"));
    }
    fs.close().map_err(|e| format!("close: {e}"))?;
    let sb = fs.superblock();
    drop(fs);
    let mut key = rext4::format::csum::raw(
        0,
        format!("{} {}", sb.free_blocks_count, sb.free_inodes_count).as_bytes(),
    );
    let mut blocks: Vec<u64> = audit
        .blocks
        .iter()
        .filter(|(_, k)| *k != rext4::MetaKind::Superblock)
        .map(|&(b, _)| b)
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    let mut buf = vec![0u8; 4096];
    for b in blocks {
        dev.read_at(&mut buf, b * 4096)
            .map_err(|e| format!("block {b}: {e}"))?;
        key = rext4::format::csum::raw(key, &buf);
    }
    Ok((dev, key))
}

/// 10,000+ simulated power failures over a recorded random DAX workload: no fsynced
/// byte lost, e2fsck -fn clean after every replay.
#[test]
fn ten_thousand_power_failures_lose_no_fsynced_byte() {
    const FAILURES: usize = 10_000;
    let (base, log, jsb) = record(0x5eed_da7a, 260);
    let fences = log.iter().filter(|e| matches!(e, Ev::Fence)).count();
    let stores = log
        .iter()
        .filter(|e| matches!(e, Ev::Store { nt: false, .. }))
        .count();
    assert!(fences > 100, "the workload fenced only {fences} times");
    assert!(stores > 10, "too few stores through mappings: {stores}");
    // Failure points: event indexes (a failure happens before event k), sorted.
    let mut rng = Rng(0xfa11);
    let mut points: Vec<(usize, bool, u64)> = (0..FAILURES)
        .map(|_| {
            (
                rng.below(log.len() as u64 + 1) as usize,
                rng.below(2) == 0,
                rng.next_u64(),
            )
        })
        .collect();
    points.sort_by_key(|p| p.0);
    let mut sim = PmemSim::new(base);
    sim.atomic(jsb, 1024);
    let mut promises: Vec<Promise> = (0..FILES)
        // Nothing is promised until the log's first Synced events.
        .map(|_| Promise {
            content: Vec::new(),
            touched: vec![(0, u64::MAX)],
        })
        .collect();
    let mut next = 0usize;
    let mut checked = 0usize;
    let mut adversarial = 0usize;
    let mut seen: HashSet<u32> = HashSet::new();
    let mut fsck_runs = 0usize;
    let tmp = TempDir::new("dax-power-fsck").expect("tmp");
    for k in 0..=log.len() {
        while next < points.len() && points[next].0 == k {
            let (_, adv, seed) = points[next];
            next += 1;
            let img = sim.crash(&mut Rng(seed | 1), adv);
            adversarial += usize::from(adv);
            match check_one(img, &promises) {
                Ok((dev, key)) => {
                    if seen.insert(key) {
                        let p = tmp.join("crash.img");
                        std::fs::write(&p, dev.snapshot()).expect("write image");
                        let r = e2fsck_fn(&p);
                        assert!(
                            r.clean,
                            "e2fsck -fn after a failure before event {k} (adversarial \
                             {adv}):\n{}",
                            r.output
                        );
                        fsck_runs += 1;
                    }
                }
                Err(why) => panic!(
                    "power failure before event {k} of {} (adversarial {adv}, seed \
                     {seed}): {why}",
                    log.len()
                ),
            }
            checked += 1;
        }
        let Some(e) = log.get(k) else { break };
        match e {
            Ev::Store { first, lines, nt } => sim.store(*first, lines, *nt),
            Ev::WriteBack { first, lines } => sim.write_back(*first, lines),
            Ev::Fence => sim.fence(),
            Ev::Touch { f, from, to } => promises[*f].touched.push((*from, *to)),
            Ev::Synced { f, content } => {
                promises[*f] = Promise {
                    content: content.clone(),
                    touched: Vec::new(),
                }
            }
        }
    }
    assert_eq!(checked, FAILURES, "every failure point was checked");
    assert!(
        adversarial > FAILURES / 3,
        "adversarial failures: {adversarial}"
    );
    assert!(
        fsck_runs > 10,
        "distinct metadata states checked: {fsck_runs}"
    );
    eprintln!(
        "{checked} power failures ({adversarial} adversarial) over {} events \
         ({fences} fences); e2fsck -fn on {fsck_runs} distinct metadata states",
        log.len()
    );
}
