//! Huge truncates and unlinks survive a crash (issue 40, item 2): an operation that
//! dirties more than one journal transaction holds commits in parts, with the inode on
//! the orphan list between them, so a crash at any flush point recovers — by rext4's
//! open, the kernel's mount and e2fsck -fy alike — to the file whole or to the
//! operation finished, never to half of it; `e2fsck -fn` is clean after every recovery.
//!
//! The images: a file of many extents whose blocks alternate with another file's (two
//! files allocated one block each in turn), so every extent is its own and the file's
//! blocks cover twice their number; and a sparse file of the largest size (16 TiB less
//! a block at 4 KiB blocks) with data spread over it, one allocated run per group. The
//! filesystems are made with 256-block groups and the smallest journal (1024 blocks),
//! so a test-sized file spans as many groups — bitmaps and descriptors the removal
//! dirties — as a huge one does on a huge filesystem, and more than one transaction
//! holds: each sweep asserts its operation took several commits. The images live in
//! sparse files; the operation runs on a device that keeps its writes in memory
//! (`Overlay`) and records them with the flushes, and each crash image is a sparse copy
//! of the image as of a flush point, with the writes after it lost or torn in the
//! variants. ext3 (block-mapped files) gets the same sweep.
//!
//! e2fsprogs cannot finish every such image: its orphan truncate (release_inode_blocks,
//! 1.47.0 and upstream) unmaps through ext2fs_block_iterate3, which frees an extent leaf
//! it empties and then visits it again ("Already cleared ... block found in orphaned
//! inode"), so a truncate of an extent file cut short with a whole leaf past i_size —
//! which the kernel's own restarted truncates leave too — ends with pass 1 clearing the
//! inode. The truncate sweeps of extent files count those images (recovered by rext4 and
//! the kernel to before or after); e2fsck must still leave them clean.
//!
//! Knobs: `REXT4_HUGE_EXTENTS` (extents of the fragmented file; default 100,000, the
//! acceptance's 1,000,000 for the long run), `REXT4_HUGE_VARIANTS` (lost/torn images per
//! flush point inside the operation; default 1), `REXT4_CRASH_RECOVER` (as crash.rs), `REXT4_CRASH_DUMP=dir` (keeps the crash
//! image that failed, as the crash left it).

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::env_u64;
use rext4::{FallocMode, Fs, FsOptions};
use rext4_testkit::crash::{Event, Rng};
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, MkfsOptions, TempDir};

const SECTOR: usize = 512;

/// A device over a sparse image file that never writes it: writes go to a map of
/// sectors in memory (read back over the file) and to the event log, with flushes.
struct Overlay {
    base: std::fs::File,
    size: u64,
    sectors: Mutex<HashMap<u64, Box<[u8]>>>,
    events: Mutex<Vec<Event>>,
}

impl Overlay {
    fn new(path: &Path) -> Overlay {
        let base = std::fs::File::open(path).expect("open base");
        let size = base.metadata().expect("stat").len();
        Overlay {
            base,
            size,
            sectors: Mutex::new(HashMap::new()),
            events: Mutex::new(Vec::new()),
        }
    }

    fn len(&self) -> usize {
        self.events.lock().expect("events").len()
    }
}

impl rext4::device::BlockDevice for Overlay {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.base.read_exact_at(buf, offset)?;
        let sectors = self.sectors.lock().expect("sectors");
        if sectors.is_empty() {
            return Ok(());
        }
        let first = offset / SECTOR as u64;
        let last = (offset + buf.len() as u64).div_ceil(SECTOR as u64);
        for s in first..last {
            if let Some(d) = sectors.get(&s) {
                let so = s * SECTOR as u64;
                let (a, b) = (
                    so.max(offset),
                    (so + SECTOR as u64).min(offset + buf.len() as u64),
                );
                buf[(a - offset) as usize..(b - offset) as usize]
                    .copy_from_slice(&d[(a - so) as usize..(b - so) as usize]);
            }
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let first = offset / SECTOR as u64;
        let last = (offset + buf.len() as u64).div_ceil(SECTOR as u64);
        for s in first..last {
            let so = s * SECTOR as u64;
            let (a, b) = (
                so.max(offset),
                (so + SECTOR as u64).min(offset + buf.len() as u64),
            );
            let mut d = vec![0u8; SECTOR];
            if b - a < SECTOR as u64 {
                self.read_at(&mut d, so)?;
            }
            d[(a - so) as usize..(b - so) as usize]
                .copy_from_slice(&buf[(a - offset) as usize..(b - offset) as usize]);
            self.sectors
                .lock()
                .expect("sectors")
                .insert(s, d.into_boxed_slice());
        }
        self.events.lock().expect("events").push(Event::Write {
            offset,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        self.events.lock().expect("events").push(Event::Flush);
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn is_read_only(&self) -> bool {
        false
    }
}

/// Copy `src` to `dst` keeping its holes (only the data ranges are read and written).
fn copy_sparse(src: &Path, dst: &Path) {
    let f = std::fs::File::open(src).expect("open src");
    let len = f.metadata().expect("stat").len();
    let out = std::fs::File::create(dst).expect("create dst");
    out.set_len(len).expect("size dst");
    let fd = f.as_raw_fd();
    let mut pos: i64 = 0;
    let mut buf = vec![0u8; 1 << 20];
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor this function owns (through `f`), no memory.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { len as i64 } else { hole };
        let mut at = data as u64;
        while at < hole as u64 {
            let n = ((hole as u64 - at) as usize).min(buf.len());
            f.read_exact_at(&mut buf[..n], at).expect("read src");
            out.write_all_at(&buf[..n], at).expect("write dst");
            at += n as u64;
        }
        pos = hole;
    }
}

/// What the file looks like: its size and allocated 512-byte units (None: gone), and
/// the filesystem's free blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    file: Option<(u64, u64)>,
    free: u64,
}

fn state(fs: &Fs, path: &str) -> State {
    let file = match fs.metadata(path) {
        Ok(m) => Some((m.size, m.blocks)),
        Err(rext4::Error::NotFound) => None,
        Err(e) => panic!("{path}: {e}"),
    };
    State {
        file,
        free: fs.statfs().blocks_free,
    }
}

fn open_rw_dev(dev: Arc<Overlay>) -> Fs {
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    Fs::open_device(dev, opts).expect("open rw")
}

fn open_rw(path: &Path) -> Fs {
    common::open_rw(path)
}

/// A filesystem of 256-block groups and a 1024-block journal (see the module note).
fn small_groups(bs: u32, size: u64, ext3: bool) -> Image {
    let mut o = MkfsOptions::new(bs, size)
        .arg("-g")
        .arg("256")
        .arg("-J")
        .arg(if bs == 1024 { "size=1" } else { "size=4" });
    if ext3 {
        o = o.arg("-t").arg("ext3");
    }
    o.inodes = Some(256);
    mkfs(&o).expect("mkfs")
}

/// `/big`, `n` blocks whose every block is an extent (or block-map run) of its own:
/// `/big` and `/gaps` get one block each in turn. Extent files take unwritten blocks
/// (fallocate); block-mapped ones direct writes, which allocate at once.
fn build_fragmented(path: &Path, n: u64, ext3: bool) {
    let fs = open_rw(path);
    let bs = u64::from(fs.block_size());
    let big = fs.create("/big").expect("create");
    let gaps = fs.create("/gaps").expect("create");
    if ext3 {
        drop((big, gaps));
        let mut o = rext4::OpenOptions::new();
        o.write(true).direct(true);
        let big = o.open(&fs, "/big").expect("open");
        let gaps = o.open(&fs, "/gaps").expect("open");
        let blk = vec![0x5au8; bs as usize];
        for i in 0..n {
            big.write_all_at(&blk, i * bs).expect("write");
            gaps.write_all_at(&blk, i * bs).expect("write");
        }
    } else {
        for i in 0..n {
            fs.fallocate_ino(big.ino(), FallocMode::Allocate, i * bs, bs)
                .expect("fallocate");
            fs.fallocate_ino(gaps.ino(), FallocMode::Allocate, i * bs, bs)
                .expect("fallocate");
        }
        drop((big, gaps));
    }
    let runs = fs
        .open_file("/big")
        .expect("open")
        .extents()
        .expect("extents");
    let mapped = runs
        .iter()
        .filter(|(_, m)| matches!(m, rext4::Mapping::Mapped { .. }))
        .count() as u64;
    assert!(
        mapped * 10 >= n * 9,
        "/big has {mapped} runs for {n} blocks: the allocator did not alternate"
    );
    fs.close().expect("close");
}

/// `/big` of the largest size an extent file may have, with `spots` runs of a group's
/// blocks each spread evenly over it (unwritten, a written block of data at the start
/// of each).
fn build_sparse(path: &Path, spots: u64) {
    let fs = open_rw(path);
    let bs = u64::from(fs.block_size());
    drop(fs.create("/big").expect("create"));
    // A direct write allocates its block at once, so each spot's extents are appended
    // in order (a compact tree, as e2fsck wants it).
    let mut o = rext4::OpenOptions::new();
    o.write(true).direct(true);
    let f = o.open(&fs, "/big").expect("open");
    let stride = (fs.max_file_size() / bs - 256) / spots;
    for i in 0..spots {
        let at = i * stride * bs;
        f.write_all_at(&vec![i as u8 | 1; bs as usize], at)
            .expect("write");
        fs.fallocate_ino(f.ino(), FallocMode::KeepSize, at + bs, 255 * bs)
            .expect("fallocate");
    }
    f.set_len(fs.max_file_size()).expect("set_len");
    drop(f);
    fs.close().expect("close");
    let fs = Fs::open(path).expect("open");
    let m = fs.metadata("/big").expect("stat");
    assert_eq!(m.size, u64::from(u32::MAX) * bs, "16 TiB less a block");
    drop(fs);
}

fn recoverers() -> Vec<&'static str> {
    if let Ok(v) = std::env::var("REXT4_CRASH_RECOVER") {
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
        vec!["rext4", "e2fsck", "kernel"]
    } else {
        skip("kernel recovery of crash images needs loop mounts");
        vec!["rext4", "e2fsck"]
    }
}

/// Apply the writes of `events` to the file at `path`.
fn apply(path: &Path, events: &[Event]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open image");
    for e in events {
        if let Event::Write { offset, data } = e {
            f.write_all_at(data, *offset).expect("apply");
        }
    }
}

/// Run `op` on the image at `base` (left as it is), then build a crash image at every
/// flush point (and `REXT4_HUGE_VARIANTS` with the writes after it lost or torn),
/// recover each and check that `/big` is as before `op` or as after it.
fn sweep(name: &str, base: &Path, fsck_truncate_gap: bool, op: impl FnOnce(&Fs)) {
    let t0 = std::time::Instant::now();
    let variants = env_u64("REXT4_HUGE_VARIANTS", 1);
    let before = state(&Fs::open(base).expect("open"), "/big");
    let dev = Arc::new(Overlay::new(base));
    let fs = open_rw_dev(dev.clone());
    let start = dev.len();
    let commits0 = fs.journal_stats().commits;
    op(&fs);
    let commits = fs.journal_stats().commits - commits0;
    let end = dev.len();
    let after = state(&fs, "/big");
    fs.close().expect("close");
    drop(fs);
    let events = std::mem::take(&mut *dev.events.lock().expect("events"));
    drop(dev);
    assert_ne!(before, after, "{name}: the operation changed nothing");
    // One commit would be atomic anyway: the sweep is about the parts.
    assert!(
        commits >= 2,
        "{name}: the operation took {commits} commits; the sweep needs one larger than a \
         transaction"
    );
    let tmp = TempDir::new("huge").expect("tmp");
    let at = tmp.join("at-flush");
    copy_sparse(base, &at);
    let points = rext4_testkit::crash::flush_points(&events);
    let how = recoverers();
    let mut rng = Rng(0x4855_4745 ^ name.len() as u64);
    let (mut images, mut saw_before, mut saw_after) = (0usize, 0usize, 0usize);
    let mut fsck_gap = 0usize;
    let mut used: HashMap<&str, usize> = HashMap::new();
    let mut applied = 0;
    for (k, &fp) in points.iter().enumerate() {
        let durable = fp + 1;
        apply(&at, &events[applied..durable]);
        applied = durable;
        let mut imgs = vec![("at flush".to_string(), None)];
        let more = events[durable..]
            .iter()
            .take_while(|e| !matches!(e, Event::Flush))
            .count();
        // Lost and torn writes where the operation runs (the open's and close's own
        // flushes are swept by crash.rs).
        if more > 0 && durable >= start && durable <= end {
            for v in 0..variants {
                imgs.push((format!("lost/torn {v}"), Some(rng.next_u64())));
            }
        }
        for (what, seed) in imgs {
            let r = how[images % how.len()];
            let path = tmp.join(format!("img-{images}"));
            copy_sparse(&at, &path);
            if let Some(seed) = seed {
                lose_or_tear(&path, &events[durable..], seed);
            }
            let label = format!(
                "{name} flush {k}/{} ({what}), recovered by {r}",
                points.len()
            );
            let keep = std::env::var("REXT4_CRASH_DUMP").ok().map(|dir| {
                let kept = Path::new(&dir).join(format!("{}-{images}.img", name.replace(' ', "-")));
                copy_sparse(&path, &kept);
                kept
            });
            let mut fsck_aborted = false;
            if r == "e2fsck" {
                let out = rext4_testkit::e2fsck_fy(&path);
                assert!(
                    out.exit_code <= 1,
                    "{label}: e2fsck -fy exit {}:\n{}",
                    out.exit_code,
                    out.output
                );
                fsck_aborted = out.output.contains("Already cleared");
            } else if let Err(e) = common::recover(&path, r) {
                panic!("{label}: recovery failed: {e}");
            }
            let fsck = e2fsck_fn(&path);
            assert!(
                fsck.clean,
                "{label}: e2fsck after recovery:\n{}",
                fsck.output
            );
            let fs = Fs::open(&path).expect("open after recovery");
            let now = state(&fs, "/big");
            drop(fs);
            if now == before {
                saw_before += 1;
                assert!(
                    durable <= end,
                    "{label}: the file is whole after the operation ended"
                );
            } else if now == after {
                saw_after += 1;
                assert!(
                    durable > start,
                    "{label}: the operation shows before it began"
                );
            } else if fsck_aborted && fsck_truncate_gap {
                // e2fsprogs (1.47.0, and upstream to this day) truncates an orphan
                // through ext2fs_block_iterate3, whose unmapping frees an extent leaf
                // it empties and then visits that leaf again: "Already cleared ...
                // block found in orphaned inode", the orphan truncate aborts and pass 1
                // clears the inode. Any truncate of an extent file cut short with a
                // whole leaf past i_size — the kernel's own restarted truncates too —
                // meets it; rext4 and the kernel finish the same images.
                fsck_gap += 1;
            } else {
                panic!("{label}: a half state: {now:?}, before {before:?}, after {after:?}");
            }
            if let Some(kept) = keep {
                let _ = std::fs::remove_file(kept);
            }
            images += 1;
            *used.entry(r).or_default() += 1;
            let _ = std::fs::remove_file(&path);
        }
    }
    eprintln!(
        "{name}: {images} crash images from {} flush points ({commits} commits in the \
         operation), {saw_before} recovered to before and {saw_after} to after, {fsck_gap} \
         where e2fsck's own orphan truncate aborted; recovered by {used:?}; {:.1} s",
        points.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        saw_before > 0 && saw_after > 0,
        "{name}: both outcomes must occur"
    );
    for r in how {
        assert!(
            used.get(r).copied().unwrap_or(0) > 0,
            "{name}: nothing recovered by {r}"
        );
    }
}

/// The writes after a flush point, up to the next flush, each lost, kept or torn (some
/// of its sectors kept), as the testkit's `image_with_lost_writes` (the primary
/// superblock's write never torn).
fn lose_or_tear(path: &Path, events: &[Event], seed: u64) {
    let mut rng = Rng(seed | 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open image");
    for e in events {
        match e {
            Event::Flush => break,
            Event::Write { offset, data } => match rng.below(4) {
                0 => {}
                1 if !rext4_testkit::crash::touches_superblock(*offset, data.len()) => {
                    for (i, s) in data.chunks(SECTOR).enumerate() {
                        if rng.below(2) == 0 {
                            f.write_all_at(s, offset + (i * SECTOR) as u64)
                                .expect("tear");
                        }
                    }
                }
                _ => f.write_all_at(data, *offset).expect("keep"),
            },
        }
    }
}

fn extents() -> u64 {
    env_u64("REXT4_HUGE_EXTENTS", 100_000)
}

/// A 1 KiB-block image holding `/big` of `n` alternating blocks: room for both files,
/// their trees and the metadata of 256-block groups.
fn fragmented_image(n: u64, ext3: bool) -> Image {
    let size = (2 * n * 1024 * 9 / 8 + (64 << 20)).next_multiple_of(1 << 20);
    let img = small_groups(1024, size, ext3);
    build_fragmented(img.path(), n, ext3);
    img
}

fn sparse_image() -> Image {
    // 1,000 groups of data in a 1.5 GiB filesystem of 1 MiB groups.
    let img = small_groups(4096, 1536 << 20, false);
    build_sparse(img.path(), 1000);
    img
}

#[test]
fn huge_truncate_of_many_extents() {
    let img = fragmented_image(extents(), false);
    sweep("truncate of many extents", img.path(), true, |fs| {
        fs.set_len("/big", 0).expect("truncate");
    });
}

#[test]
fn huge_unlink_of_many_extents() {
    let img = fragmented_image(extents(), false);
    sweep("unlink of many extents", img.path(), false, |fs| {
        fs.remove_file("/big").expect("unlink");
    });
}

#[test]
fn huge_truncate_of_16_tib_sparse() {
    let img = sparse_image();
    sweep("truncate of a 16 TiB sparse file", img.path(), true, |fs| {
        fs.set_len("/big", 0).expect("truncate");
    });
}

#[test]
fn huge_unlink_of_16_tib_sparse() {
    let img = sparse_image();
    sweep("unlink of a 16 TiB sparse file", img.path(), false, |fs| {
        fs.remove_file("/big").expect("unlink");
    });
}

#[test]
fn huge_truncate_and_unlink_block_mapped() {
    let n = extents();
    let img = fragmented_image(n, true);
    let copy = img.duplicate().expect("copy");
    sweep(
        "truncate of a fragmented block-mapped file",
        img.path(),
        false,
        |fs| {
            fs.set_len("/big", 3000 * 1024 + 7).expect("truncate");
        },
    );
    sweep(
        "unlink of a fragmented block-mapped file",
        copy.path(),
        false,
        |fs| {
            fs.remove_file("/big").expect("unlink");
        },
    );
}

/// A file open while it is unlinked is freed, in parts, by its last close.
#[test]
fn huge_unlink_while_open_freed_by_last_close() {
    let img = fragmented_image(extents().min(100_000), false);
    sweep(
        "last close of a huge unlinked file",
        img.path(),
        false,
        |fs| {
            let f = fs.open_file("/big").expect("open");
            fs.remove_file("/big").expect("unlink");
            fs.sync().expect("sync");
            drop(f);
        },
    );
}
