//! DAX mode (SEEDS lesson E): file data copied straight between the caller and the
//! mapped image, mappings of the file's blocks coherent with `write_at`, the races of
//! mapping a hole while it is allocated, and truncate/punch under a live mapping.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rext4::{Error, FallocMode, Fs, FsOptions, OpenOptions};
use rext4_testkit::{e2fsck_fn, mkfs, Image, MkfsOptions};

fn dax_opts() -> FsOptions {
    FsOptions {
        read_only: false,
        dax: true,
        ..FsOptions::default()
    }
}

/// A fresh 4 KiB-block image on tmpfs.
fn shm_image(size: u64) -> Image {
    let img = mkfs(&MkfsOptions::new(4096, size)).expect("mkfs");
    img.copy_to_memory().expect("copy to /dev/shm")
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn create(fs: &Fs, path: &str) -> rext4::File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .open(fs, path)
        .expect("create")
}

fn read_all(f: &rext4::File) -> Vec<u8> {
    let mut v = vec![0u8; f.len().expect("len") as usize];
    f.read_exact_at(&mut v, 0).expect("read");
    v
}

/// Reads and writes of every shape in DAX mode read back, survive a reopen without
/// DAX (page cache), and leave an image e2fsck -fn calls clean.
#[test]
fn dax_file_io_reads_back_and_checks_clean() {
    let img = shm_image(32 << 20);
    let mut want: Vec<(String, Vec<u8>)> = Vec::new();
    {
        let fs = Fs::open_with(img.path(), dax_opts()).expect("open dax");
        // Aligned, large (allocating) write.
        let a = create(&fs, "/a");
        let da = pattern(1, 3 << 20);
        a.write_all_at(&da, 0).expect("write a");
        // Unaligned overwrite inside, then an unaligned append past a hole.
        let mut exp = da.clone();
        let patch = pattern(2, 10_001);
        a.write_all_at(&patch, 4093).expect("patch a");
        exp[4093..4093 + patch.len()].copy_from_slice(&patch);
        let tail = pattern(3, 777);
        let at = (4 << 20) + 5;
        a.write_all_at(&tail, at).expect("write past a hole");
        exp.resize(at as usize, 0);
        exp.extend_from_slice(&tail);
        assert_eq!(read_all(&a), exp, "a after writes");
        // Truncate into the middle of a block, then grow: no stale bytes.
        a.set_len(1_000_003).expect("shrink");
        exp.truncate(1_000_003);
        a.set_len(1_200_000).expect("grow");
        exp.resize(1_200_000, 0);
        assert_eq!(read_all(&a), exp, "a after truncates");
        // Punch a hole.
        fs.fallocate_ino(a.ino(), FallocMode::PunchHole, 8192, 20_000)
            .expect("punch");
        exp[8192..28_192].fill(0);
        assert_eq!(read_all(&a), exp, "a after punch");
        a.sync_all().expect("fsync a");
        want.push(("/a".into(), exp));
        // Small files, written through the inode-level API (what the mount uses).
        for i in 0..20u32 {
            let p = format!("/small{i}");
            let f = create(&fs, &p);
            let d = pattern(100 + i, 1 + i as usize * 397);
            fs.write_ino_at(f.ino(), &d, 0).expect("write_ino_at");
            let mut back = vec![0u8; d.len()];
            let n = fs
                .read_ino_at(
                    f.ino(),
                    &fs.inode_attr(f.ino()).expect("attr"),
                    &mut back,
                    0,
                )
                .expect("read_ino_at");
            assert_eq!(n, d.len());
            assert_eq!(back, d);
            want.push((p, d));
        }
        // O_APPEND.
        let l = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .append(true)
            .open(&fs, "/log")
            .expect("open log");
        let mut exp = Vec::new();
        for i in 0..50u32 {
            let d = pattern(500 + i, 100 + i as usize);
            l.write_all_at(&d, 0).expect("append");
            exp.extend_from_slice(&d);
        }
        assert_eq!(read_all(&l), exp);
        want.push(("/log".into(), exp));
        assert!(fs.is_dax());
        let st = fs.page_cache_stats();
        assert_eq!(
            (st.cached_bytes, st.dirty_bytes),
            (0, 0),
            "DAX file I/O must not use the page cache"
        );
        fs.close().expect("close");
    }
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck -fn after DAX writes:\n{}", r.output);
    // The same bytes without DAX (through the page cache, pread).
    let fs = Fs::open(img.path()).expect("reopen");
    for (p, d) in &want {
        let f = fs.open_file(p).expect("open");
        assert_eq!(&read_all(&f), d, "{p} after reopen");
    }
}

/// Bad configurations and a backing file cut under the filesystem are errors, never
/// a fault.
#[test]
fn dax_refuses_bad_setups_and_a_shrunk_backing_file() {
    let img = shm_image(16 << 20);
    let both = FsOptions {
        direct_io: true,
        ..dax_opts()
    };
    assert!(matches!(
        Fs::open_with(img.path(), both),
        Err(Error::InvalidInput(_))
    ));
    let mem = Arc::new(rext4::device::MemDevice::new(
        std::fs::read(img.path()).expect("read"),
    ));
    assert!(matches!(
        Fs::open_device(mem, dax_opts()),
        Err(Error::InvalidInput(_))
    ));
    let fs = Fs::open_with(img.path(), dax_opts()).expect("open");
    let f = create(&fs, "/big");
    // Put data near the end of the device so a cut can reach it.
    let d = pattern(9, 1 << 20);
    f.write_all_at(&d, 0).expect("write");
    // Absurd offsets: errors or EOF, never a fault.
    let mut small = [0u8; 16];
    assert_eq!(
        f.read_at(&mut small, u64::MAX)
            .expect("read at the end of time"),
        0
    );
    assert!(matches!(
        f.write_at(&small, u64::MAX - 1),
        Err(Error::FileTooLarge)
    ));
    let pre = f.map(0, 1 << 20).expect("a mapping made before the cut");
    assert!(pre.read(u64::MAX - 2, &mut small).is_err());
    assert!(pre.write(u64::MAX - 2, &small).is_err());
    assert!(pre.mark_dirty(u64::MAX, 10).is_err());
    assert!(
        pre.read(1 << 20, &mut small).is_err(),
        "past the mapping's end"
    );
    let ext = f.extents().expect("extents");
    let (_, m) = ext.last().expect("an extent");
    let rext4::Mapping::Mapped { physical, .. } = *m else {
        panic!("mapped extent expected, got {m:?}");
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(img.path())
        .expect("open backing")
        .set_len(physical * 4096)
        .expect("cut the backing file");
    let mut back = vec![0u8; d.len()];
    let e = f.read_at(&mut back, 0).expect_err("read past the cut");
    assert!(e.to_string().contains("shrank"), "{e}");
    assert!(f.write_at(&d, 0).is_err(), "a write past the cut fails");
    let e = pre
        .read(0, &mut back)
        .expect_err("a mapping read after the cut");
    assert!(e.to_string().contains("shrank"), "{e}");
    assert!(
        pre.write(0, &d[..10]).is_err(),
        "a mapping write after the cut"
    );
    drop(pre);
    // Mapping a file with an absurd range is refused; a huge one costs what its
    // extents cost (one run past EOF), not its length.
    assert!(f.map(0, u64::MAX).is_err());
    assert!(f.map(1 << 60, 4096).is_err(), "past ext4's largest file");
    assert!(f.map(4096 * 3 + 1, 4096).is_err());
    let t = std::time::Instant::now();
    let huge = f.map(0, 1 << 40).expect("a 1 TiB mapping of a 1 MiB file");
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    let mut b = [0u8; 16];
    assert!(huge.read((1 << 30) + 8, &mut b).is_err(), "past EOF");
    drop(huge);
    drop(f);
    drop(fs);
    // 1 KiB blocks: the data path works, mappings of blocks cannot (a block is not a
    // memory page).
    let small = mkfs(&MkfsOptions::new(1024, 8 << 20))
        .expect("mkfs")
        .copy_to_memory()
        .expect("copy");
    let fs = Fs::open_with(small.path(), dax_opts()).expect("open 1k");
    let f = create(&fs, "/x");
    f.write_all_at(&pattern(4, 5000), 100).expect("write");
    let mut b = vec![0u8; 5000];
    f.read_exact_at(&mut b, 100).expect("read");
    assert_eq!(b, pattern(4, 5000));
    assert!(matches!(f.map(0, 4096), Err(Error::Unsupported(_))));
    drop(f);
    fs.close().expect("close");
    let r = e2fsck_fn(small.path());
    assert!(r.clean, "{}", r.output);
}

/// Wait (at most a second) until `counter` moved past `seen`: the other thread ran
/// (or ended: its join reports why).
fn await_progress<T>(
    counter: &std::sync::atomic::AtomicU64,
    seen: u64,
    other: &std::thread::JoinHandle<T>,
) -> u64 {
    let t = std::time::Instant::now();
    loop {
        let now = counter.load(Ordering::Acquire);
        if now > seen || other.is_finished() || t.elapsed() > std::time::Duration::from_secs(1) {
            return now;
        }
        std::thread::yield_now();
    }
}

/// A 4 KiB-aligned file of `pages` pages with a hole at every odd page.
fn holey(fs: &Fs, path: &str, pages: u64, byte: u8) -> rext4::File {
    let f = create(fs, path);
    f.set_len(pages * 4096).expect("size");
    for p in (0..pages).step_by(2) {
        f.write_all_at(&[byte; 4096], p * 4096).expect("write");
    }
    f
}

/// Mappings show the file's blocks: coherent with read_at/write_at both ways, holes
/// read as zeros and fill when written, raw stores through the address count as
/// dirty until fsync writes them back.
#[test]
fn dax_mapping_is_coherent_with_read_and_write() {
    let img = shm_image(16 << 20);
    let fs = Fs::open_with(img.path(), dax_opts()).expect("open");
    let f = holey(&fs, "/m", 16, 0x11);
    let m = f.map(0, 16 * 4096).expect("map");
    let base = m.as_ptr().expect("a DAX mapping has an address");
    let mut b = vec![0u8; 4096];
    m.read(4096, &mut b).expect("read hole");
    assert!(b.iter().all(|&x| x == 0), "a hole reads zeros");
    m.read(0, &mut b).expect("read data");
    assert!(b.iter().all(|&x| x == 0x11));
    // write_at over written blocks: the mapping shows it at once (same memory).
    f.write_all_at(&[0x22; 100], 10).expect("overwrite");
    // SAFETY: page 0 maps a written block of this live mapping.
    let raw = unsafe { std::slice::from_raw_parts(base, 4096) };
    assert_eq!(&raw[10..110], &[0x22; 100][..]);
    // write_at into a hole: the mapping is rebuilt before the write returns.
    f.write_all_at(&[0x33; 4096], 3 * 4096)
        .expect("fill a hole");
    m.read(3 * 4096, &mut b).expect("read filled");
    assert!(
        b.iter().all(|&x| x == 0x33),
        "the filled hole shows the data"
    );
    // A mapping write into a written page: read_at sees it; it is dirty.
    assert_eq!(fs.dax_dirty_bytes(f.ino()), 0);
    m.write(2 * 4096 + 7, &[0x44; 9]).expect("mapping write");
    let mut r = [0u8; 9];
    f.read_exact_at(&mut r, 2 * 4096 + 7).expect("read_at");
    assert_eq!(r, [0x44; 9]);
    assert_eq!(fs.dax_dirty_bytes(f.ino()), 4096);
    // A raw store, reported.
    // SAFETY: page 4 maps a written block, writable (the file is open for writing).
    unsafe { std::ptr::write_bytes(base.add(4 * 4096 + 1), 0x55, 3) };
    m.mark_dirty(4 * 4096 + 1, 3).expect("mark dirty");
    f.read_exact_at(&mut r[..3], 4 * 4096 + 1).expect("read_at");
    assert_eq!(&r[..3], &[0x55; 3]);
    assert_eq!(fs.dax_dirty_bytes(f.ino()), 2 * 4096);
    // A mapping write into a hole allocates (a fault on a hole).
    m.write(5 * 4096 + 100, &[0x66; 50])
        .expect("mapping write into a hole");
    f.read_exact_at(&mut r, 5 * 4096 + 100).expect("read_at");
    assert_eq!(r, [0x66; 9]);
    m.read(5 * 4096, &mut b).expect("read");
    assert!(b[..100].iter().all(|&x| x == 0) && b[100..150].iter().all(|&x| x == 0x66));
    // Past EOF: the mapping is longer than the file.
    assert!(m.read(16 * 4096, &mut b).is_err() || m.len() <= 16 * 4096);
    f.sync_all().expect("fsync");
    assert_eq!(
        fs.dax_dirty_bytes(f.ino()),
        0,
        "fsync wrote the dirty pages back"
    );
    drop(m);
    drop(f);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// SEEDS lesson E, the hole race: a reader of a mapped hole while a writer allocates
/// it sees zeros before the write and the data after it returned, never a mix.
#[test]
fn dax_reader_of_a_mapped_hole_sees_the_write_once_it_returned() {
    let img = shm_image(16 << 20);
    let fs = Fs::open_with(img.path(), dax_opts()).expect("open");
    const PAGES: u64 = 64;
    let f = create(&fs, "/race");
    f.set_len(PAGES * 4096).expect("all holes");
    let m = Arc::new(f.map(0, PAGES * 4096).expect("map"));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let passes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = {
        let (m, done, passes) = (m.clone(), done.clone(), passes.clone());
        std::thread::spawn(move || {
            let mut b = vec![0u8; 4096];
            let mut reads = 0u64;
            loop {
                let returned = done.load(std::sync::atomic::Ordering::Acquire);
                if returned >= PAGES {
                    return reads;
                }
                // Every page below `returned` was written before we looked.
                for p in 0..PAGES {
                    m.read(p * 4096, &mut b).expect("read");
                    reads += 1;
                    let want = (p + 1) as u8;
                    let zeros = b.iter().all(|&x| x == 0);
                    let data = b.iter().all(|&x| x == want);
                    assert!(zeros || data, "page {p}: a mix of zeros and data");
                    assert!(
                        data || p >= returned,
                        "page {p}: zeros after its write returned"
                    );
                }
                passes.fetch_add(1, Ordering::Release);
            }
        })
    };
    // Each write lands while the reader is in a pass (it waits for a new pass).
    let mut seen = await_progress(&passes, 0, &reader);
    for p in 0..PAGES {
        f.write_all_at(&[(p + 1) as u8; 4096], p * 4096)
            .expect("allocating write");
        done.store(p + 1, std::sync::atomic::Ordering::Release);
        seen = await_progress(&passes, seen, &reader);
    }
    let reads = reader.join().expect("reader");
    assert!(
        reads >= PAGES * PAGES,
        "the reader ran alongside: {reads} reads"
    );
    let mut b = vec![0u8; 4096];
    for p in 0..PAGES {
        m.read(p * 4096, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == (p + 1) as u8), "page {p} at the end");
    }
}

/// Truncate and punch under a live mapping take the range away at once; a reader
/// racing truncate + reuse of the freed blocks by another file never sees that
/// file's bytes.
#[test]
fn dax_truncate_and_punch_under_a_mapping() {
    let img = shm_image(16 << 20);
    let fs = Fs::open_with(img.path(), dax_opts()).expect("open");
    let f = create(&fs, "/t");
    f.write_all_at(&[0x11; 16 * 4096], 0).expect("write");
    let m = Arc::new(f.map(0, 16 * 4096).expect("map"));
    let mut b = vec![0u8; 4096];
    fs.fallocate_ino(f.ino(), FallocMode::PunchHole, 4 * 4096, 2 * 4096)
        .expect("punch");
    m.read(4 * 4096, &mut b).expect("read punched");
    assert!(b.iter().all(|&x| x == 0), "a punched page reads zeros");
    // SAFETY: page 5 is a zero page of the live mapping after the punch.
    let raw = unsafe { std::slice::from_raw_parts(m.as_ptr().expect("addr").add(5 * 4096), 4096) };
    assert!(
        raw.iter().all(|&x| x == 0),
        "the raw page is a zero page too"
    );
    // Truncate as the mount does it (setattr), then as the API does.
    fs.setattr_ino(
        f.ino(),
        &rext4::SetAttr {
            size: Some(3 * 4096),
            ..Default::default()
        },
    )
    .expect("setattr size");
    assert!(
        m.read(3 * 4096, &mut b).is_err(),
        "past the EOF page after setattr"
    );
    // The freed blocks go to another file; grown back, the range is holes, not that
    // file's blocks.
    f.sync_all().expect("commit: the freed blocks are free");
    let other = create(&fs, "/other");
    other.write_all_at(&[0xEE; 13 * 4096], 0).expect("reuse");
    fs.setattr_ino(
        f.ino(),
        &rext4::SetAttr {
            size: Some(16 * 4096),
            ..Default::default()
        },
    )
    .expect("setattr grow");
    for p in 3..16 {
        m.read(p * 4096, &mut b).expect("read grown");
        assert!(b.iter().all(|&x| x == 0), "page {p} after shrink and grow");
    }
    drop(other);
    fs.remove_file("/other").expect("unlink");
    f.set_len(2 * 4096 + 10).expect("truncate");
    assert!(m.read(3 * 4096, &mut b).is_err(), "past the EOF page");
    m.read(2 * 4096, &mut b).expect("the EOF page");
    assert!(b[..10].iter().all(|&x| x == 0x11) && b[10..].iter().all(|&x| x == 0));
    assert!(m.write(8 * 4096, &[1]).is_err(), "a write past EOF fails");

    // The race: truncate frees the blocks, a commit makes them reusable, another
    // file takes them; the reader of the mapping must never see 0xEE.
    let stop = Arc::new(AtomicBool::new(false));
    let tries = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = {
        let (m, stop, tries) = (m.clone(), stop.clone(), tries.clone());
        std::thread::spawn(move || {
            let mut b = vec![0u8; 16 * 4096];
            let mut ok = 0u64;
            while !stop.load(Ordering::Acquire) {
                tries.fetch_add(1, Ordering::Release);
                if m.read(0, &mut b).is_ok() {
                    assert!(
                        b.iter().all(|&x| x == 0x11 || x == 0),
                        "the mapping showed another file's block"
                    );
                    ok += 1;
                }
            }
            ok
        })
    };
    let mut seen = await_progress(&tries, 0, &reader);
    for i in 0..40 {
        f.set_len(0).expect("truncate to 0");
        f.sync_all().expect("commit: the freed blocks are free");
        let other = create(&fs, &format!("/other{i}"));
        other.write_all_at(&[0xEE; 16 * 4096], 0).expect("reuse");
        seen = await_progress(&tries, seen, &reader);
        f.write_all_at(&[0x11; 16 * 4096], 0).expect("rewrite");
        seen = await_progress(&tries, seen, &reader);
        drop(other);
        fs.remove_file(format!("/other{i}")).expect("unlink");
    }
    stop.store(true, Ordering::Release);
    let ok = reader.join().expect("reader");
    assert!(ok > 0, "the reader read the whole mapping at least once");
    drop(m);
    drop(f);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// Forwards a DAX device's persistence events to a live simulator (once started).
#[derive(Default)]
struct LiveSim {
    sim: std::sync::Mutex<Option<rext4_testkit::pmem::PmemSim>>,
}

impl LiveSim {
    fn with<R>(&self, f: impl FnOnce(&mut rext4_testkit::pmem::PmemSim) -> R) -> Option<R> {
        self.sim
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(f)
    }
}

impl rext4::dax::PersistObserver for LiveSim {
    fn stored(&self, first: u64, lines: &[u8], how: rext4::dax::Store) {
        self.with(|s| s.store(first, lines, how == rext4::dax::Store::NonTemporal));
    }
    fn written_back(&self, first: u64, lines: &[u8]) {
        self.with(|s| s.write_back(first, lines));
    }
    fn fenced(&self) {
        self.with(|s| s.fence());
    }
}

/// Open the image a power failure leaves now (all unfenced stores lost) and read
/// `path` from it (journal replayed).
fn after_power_failure(sim: &LiveSim, path: &str) -> Vec<u8> {
    let img = sim
        .with(|s| s.crash(&mut rext4_testkit::crash::Rng(1), false))
        .expect("simulator started");
    let fs = Fs::open_device(
        Arc::new(rext4::device::MemDevice::new(img)),
        FsOptions::default(),
    )
    .expect("open after the failure");
    let f = fs.open_file(path).expect("open file");
    read_all(&f)
}

/// SEEDS lesson E, the dirty record: stores through a mapping stay recorded when an
/// allocating write rebuilds the mapping and when the mapping goes, so one fsync makes
/// both them and the write durable — writing back exactly the dirty pages, however
/// large the file.
#[test]
fn dax_one_fsync_flushes_mapping_stores_and_a_later_write() {
    let img = shm_image(16 << 20);
    let sim = Arc::new(LiveSim::default());
    let dev = rext4::dax::DaxDevice::open(img.path(), false)
        .expect("map")
        .with_observer(sim.clone());
    let opts = FsOptions {
        commit_secs: 0,
        ..dax_opts()
    };
    let fs = Fs::open_device(Arc::new(dev), opts).expect("open");
    // 4 MiB of data, then two hole pages.
    let f = create(&fs, "/d");
    f.write_all_at(&pattern(5, 4 << 20), 0).expect("write");
    f.set_len((4 << 20) + 2 * 4096).expect("holes at the end");
    let m = f.map(0, (4 << 20) + 2 * 4096).expect("map");
    fs.sync().expect("sync");
    *sim.sim.lock().unwrap_or_else(|p| p.into_inner()) = Some(rext4_testkit::pmem::PmemSim::new(
        std::fs::read(img.path()).expect("read image"),
    ));
    m.write(4096 + 10, &[0xA1; 300])
        .expect("mapping store, page 1");
    m.write(3 * 4096, &[0xA3; 4096])
        .expect("mapping store, page 3");
    // Not durable yet: the negative control.
    let before = after_power_failure(&sim, "/d");
    assert_ne!(&before[4096 + 10..4096 + 310], &[0xA1; 300][..]);
    // An allocating write into a hole rebuilds the mapping...
    f.write_all_at(&[0xB9; 4096], (4 << 20) + 4096)
        .expect("allocating write");
    // ...and the mapping goes.
    drop(m);
    assert_eq!(
        fs.dax_dirty_bytes(f.ino()),
        2 * 4096,
        "the record outlived both"
    );
    let wb0 = sim.with(|s| s.stats().written_back_lines).expect("sim");
    f.sync_data().expect("fsync");
    let wb = sim.with(|s| s.stats().written_back_lines).expect("sim") - wb0;
    assert_eq!(
        wb,
        2 * 4096 / 64,
        "fsync wrote back exactly the two dirty pages"
    );
    assert_eq!(fs.dax_dirty_bytes(f.ino()), 0);
    let after = after_power_failure(&sim, "/d");
    assert_eq!(&after[4096 + 10..4096 + 310], &[0xA1; 300][..]);
    assert_eq!(&after[3 * 4096..4 * 4096], &[0xA3; 4096][..]);
    assert_eq!(&after[(4 << 20) + 4096..], &[0xB9; 4096][..]);
    assert_eq!(after.len(), (4 << 20) + 2 * 4096);
    // Closing the filesystem (unmount) writes back what mappings stored, like fsync.
    let m = f.map(0, 4 << 20).expect("map again");
    m.write(2 * 4096, &[0xC2; 64])
        .expect("mapping store, page 2");
    drop(m);
    drop(f);
    fs.close().expect("close");
    let closed = after_power_failure(&sim, "/d");
    assert_eq!(&closed[2 * 4096..2 * 4096 + 64], &[0xC2; 64][..]);
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}
