//! DAX mode (SEEDS lesson E): file data copied straight between the caller and the
//! mapped image, mappings of the file's blocks coherent with `write_at`, the races of
//! mapping a hole while it is allocated, and truncate/punch under a live mapping.

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
                .read_ino_at(f.ino(), &fs.inode_attr(f.ino()).expect("attr"), &mut back, 0)
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
    // Mapping a file with an absurd range is refused.
    assert!(f.map(0, u64::MAX).is_err());
    assert!(f.map(4096 * 3 + 1, 4096).is_err());
    drop(f);
    drop(fs);
}
