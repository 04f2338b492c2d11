//! Block-mapped files written: ext2 and ext3 images (no extent feature) and the old
//! files of an image converted to extents. Files of every map depth (direct, IND,
//! DIND, TIND), sparse and dense, written through the page cache and O_DIRECT,
//! truncated, punched; directories and slow symlinks; fallocate answered as the
//! kernel answers it; the kernel's layout (an indirect block just before its data);
//! e2fsck -fn text-clean and the kernel reading what rext4 wrote.

mod common;

use rext4::{FallocMode, Fs, OpenOptions};
use rext4_testkit::{debugfs_r, dumpe2fs_h, e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions};

use common::open_rw as rw;

/// A deterministic byte pattern, different per `seed`.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed.wrapping_mul(7)) ^ (i >> 10)) as u8)
        .collect()
}

fn flags_of(fs: &Fs, p: &str) -> u32 {
    let i = fs.resolve(p.as_bytes(), false).expect("resolve");
    fs.inode_attr(i).expect("inode").flags
}

const EXTENTS_FL: u32 = 0x8_0000;

/// A file as written: its size and the data pieces in it (holes between read as
/// zeros).
struct Expect {
    path: String,
    len: u64,
    pieces: Vec<(u64, Vec<u8>)>,
}

impl Expect {
    fn dense(path: &str, data: Vec<u8>) -> Expect {
        Expect {
            path: path.to_string(),
            len: data.len() as u64,
            pieces: vec![(0, data)],
        }
    }

    /// Check through `read_at(buf, offset) -> bytes read` and the size.
    fn check(&self, size: u64, read_at: &dyn Fn(&mut [u8], u64) -> usize, who: &str) {
        let p = &self.path;
        assert_eq!(size, self.len, "{who}: size of {p}");
        for (at, data) in &self.pieces {
            let mut got = vec![0u8; data.len()];
            let mut done = 0;
            while done < got.len() {
                let n = read_at(&mut got[done..], at + done as u64);
                assert!(n > 0, "{who}: {p} short at {}", at + done as u64);
                done += n;
            }
            if let Some(i) = got.iter().zip(data).position(|(a, b)| a != b) {
                panic!("{who}: {p} differs at byte {}", at + i as u64);
            }
            // The hole after the piece reads as zeros.
            let end = at + data.len() as u64;
            let gap = 8192.min(self.len - end.min(self.len)) as usize;
            let next = self
                .pieces
                .iter()
                .map(|(o, _)| *o)
                .filter(|&o| o >= end)
                .min();
            if gap > 0 && next.is_none_or(|o| o >= end + gap as u64) {
                let mut z = vec![1u8; gap];
                let mut done = 0;
                while done < gap {
                    done += read_at(&mut z[done..], end + done as u64).max(1);
                }
                assert!(
                    z.iter().all(|&b| b == 0),
                    "{who}: {p} hole after {end} is not zeros"
                );
            }
        }
    }
}

/// What the tests write: sizes across every level of the map for the block size,
/// and a sparse file with data deep in each level (past 4 GiB on 1 KiB blocks).
fn workload(fs: &Fs, bs: u64) -> Vec<Expect> {
    let apb = bs / 4;
    let mut want = Vec::new();
    let sizes = [
        0,
        1,
        bs as usize - 1,
        12 * bs as usize,
        12 * bs as usize + 1,
        ((12 + apb) * bs) as usize + 17,
        ((12 + apb + 3 * apb) * bs) as usize + 5,
    ];
    for (n, &len) in sizes.iter().enumerate() {
        let p = format!("/f{n}");
        let data = pattern(n as u32, len);
        fs.write(&p, &data).expect("write");
        want.push(Expect::dense(&p, data));
    }
    let tind = 12 + apb + apb * apb;
    let deep = if bs == 1024 {
        (5u64 << 30) / bs
    } else {
        tind + 3 * apb * apb + 5 * apb + 9
    };
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .open(fs, "/sparse")
        .expect("create");
    let mut e = Expect {
        path: "/sparse".into(),
        len: 0,
        pieces: Vec::new(),
    };
    for (k, l) in [3u64, 12 + 7, 12 + apb + apb + 3, tind + 1, deep]
        .iter()
        .enumerate()
    {
        let d = pattern(100 + k as u32, bs as usize + 100);
        let at = l * bs + 10;
        f.write_all_at(&d, at).expect("sparse write");
        e.len = e.len.max(at + d.len() as u64);
        e.pieces.push((at, d));
    }
    f.sync_all().expect("fsync");
    drop(f);
    want.push(e);
    want
}

fn check_reads(fs: &Fs, want: &[Expect]) {
    for e in want {
        let f = fs.open_file(&e.path).expect("open");
        let size = f.len().expect("len");
        e.check(size, &|b, o| f.read_at(b, o).expect("read"), "rext4");
    }
}

fn check_kernel(img: &std::path::Path, want: &[Expect]) {
    use std::os::unix::fs::FileExt;
    let m = match LoopMount::new(img, true, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    for e in want {
        let f = std::fs::File::open(m.path().join(&e.path[1..])).expect("kernel open");
        let size = f.metadata().expect("stat").len();
        e.check(
            size,
            &|b, o| f.read_at(b, o).expect("kernel read"),
            "kernel",
        );
    }
}

/// ext2 and ext3 at 1 KiB and 4 KiB blocks, 128- and 256-byte inodes: files of every
/// depth written and read back, new files block-mapped, e2fsck clean, the kernel
/// reading the same bytes.
#[test]
fn ext2_and_ext3_files_of_every_depth() {
    let layouts = [
        (
            "ext2 1k",
            MkfsOptions::new(1024, 64 << 20).arg("-t").arg("ext2"),
        ),
        (
            "ext3 4k",
            MkfsOptions::new(4096, 64 << 20).arg("-t").arg("ext3"),
        ),
        (
            "ext3 1k -I 128",
            MkfsOptions::new(1024, 64 << 20)
                .arg("-t")
                .arg("ext3")
                .arg("-I")
                .arg("128"),
        ),
    ];
    for (name, opts) in layouts {
        let img = mkfs(&opts).expect("mkfs");
        let bs = u64::from(rext4_testkit::image_block_size(img.path()).expect("bs"));
        let fs = rw(img.path());
        assert!(!fs.is_read_only(), "{name}: opens read-write");
        let want = workload(&fs, bs);
        for e in &want {
            assert_eq!(
                flags_of(&fs, &e.path) & EXTENTS_FL,
                0,
                "{name}: {} is block-mapped",
                e.path
            );
        }
        check_reads(&fs, &want);
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "{name}: e2fsck: {}", r.output);
        // ext3's journal is written as the kernel writes it on such an image: no
        // 64bit or checksum feature added (8-byte block tags).
        let h = dumpe2fs_h(img.path()).expect("dumpe2fs");
        if let Some(jf) = h.get("Journal features") {
            assert!(
                !jf.contains("64bit") && !jf.contains("checksum"),
                "{name}: journal features {jf}"
            );
        }
        let fs = rw(img.path());
        check_reads(&fs, &want);
        drop(fs);
        check_kernel(img.path(), &want);
    }
}

/// Sequential writes lay a file out as the kernel does: 0-11, the IND block, then
/// 12 on; the DIND, its first IND, then the data they map.
#[test]
fn indirect_blocks_sit_before_their_data() {
    let img = mkfs(&MkfsOptions::new(1024, 32 << 20).arg("-t").arg("ext2")).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/seq", pattern(1, (12 + 256 + 40) * 1024))
        .expect("write");
    fs.close().expect("close");
    let st = debugfs_r(img.path(), "stat /seq").expect("debugfs");
    let blocks = st
        .lines()
        .skip_while(|l| !l.starts_with("BLOCKS:"))
        .nth(1)
        .expect("BLOCKS line")
        .to_string();
    // e.g. "(0-11):1234-1245, (IND):1246, (12-267):1247-1502, (DIND):1503, (IND):1504, (268-307):1505-1544"
    let parts: Vec<&str> = blocks.split(", ").collect();
    assert_eq!(parts.len(), 6, "{blocks}");
    let num = |s: &str, at: usize| -> u64 {
        let v = s.split(':').nth(1).expect("colon");
        v.split('-').nth(at).unwrap_or(v).parse().expect("number")
    };
    assert_eq!(
        num(parts[1], 0),
        num(parts[0], 1) + 1,
        "IND after 0-11: {blocks}"
    );
    assert_eq!(
        num(parts[2], 0),
        num(parts[1], 0) + 1,
        "12 after IND: {blocks}"
    );
    assert_eq!(
        num(parts[3], 0),
        num(parts[2], 1) + 1,
        "DIND next: {blocks}"
    );
    assert_eq!(
        num(parts[4], 0),
        num(parts[3], 0) + 1,
        "its IND next: {blocks}"
    );
    assert_eq!(
        num(parts[5], 0),
        num(parts[4], 0) + 1,
        "then the data: {blocks}"
    );
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// Truncates and punches free data and emptied indirect blocks; a file grows again
/// over what was cut; fallocate modes other than punching are EOPNOTSUPP, as on the
/// kernel; O_DIRECT writes and reads.
#[test]
fn truncate_punch_fallocate_and_direct_io() {
    let img = mkfs(&MkfsOptions::new(1024, 64 << 20).arg("-t").arg("ext3")).expect("mkfs");
    let fs = rw(img.path());
    let len = (12 + 256 + 3 * 256 + 50) * 1024;
    let mut model = pattern(9, len);
    fs.write("/f", &model).expect("write");
    let free_full = fs.statfs().blocks_free;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fs, "/f")
        .expect("open");
    // Punch across direct, IND and DIND.
    fs.fallocate_ino(f.ino(), FallocMode::PunchHole, 5000, 300 * 1024)
        .expect("punch");
    model[5000..5000 + 300 * 1024].fill(0);
    for mode in [
        FallocMode::Allocate,
        FallocMode::KeepSize,
        FallocMode::ZeroRange { keep_size: true },
        FallocMode::ZeroRange { keep_size: false },
        FallocMode::CollapseRange,
        FallocMode::InsertRange,
    ] {
        let e = fs
            .fallocate_ino(f.ino(), mode, 0, 4096)
            .expect_err("fallocate on a block map");
        assert_eq!(e.errno(), 95, "{mode:?}: {e}");
    }
    // Truncate into the DIND's second IND, then grow over it again.
    f.set_len((12 + 256 + 256 + 7) as u64 * 1024 + 100)
        .expect("truncate");
    model.truncate((12 + 256 + 256 + 7) * 1024 + 100);
    f.write_all_at(b"tail", 2 << 20)
        .expect("write past the end");
    model.resize(2 << 20, 0);
    model.extend_from_slice(b"tail");
    drop(f);
    // O_DIRECT: an overwrite in place, an extending write, reads.
    let d = OpenOptions::new()
        .read(true)
        .write(true)
        .direct(true)
        .open(&fs, "/f")
        .expect("open direct");
    let blk = pattern(3, 4096);
    d.write_all_at(&blk, 8192).expect("direct overwrite");
    model[8192..8192 + 4096].copy_from_slice(&blk);
    d.write_all_at(&blk, 3 << 20).expect("direct extend");
    model.resize(3 << 20, 0);
    model.extend_from_slice(&blk);
    let mut back = vec![0u8; 4096];
    d.read_exact_at(&mut back, 3 << 20).expect("direct read");
    assert!(back == blk);
    drop(d);
    assert!(fs.read("/f").expect("read") == model);
    fs.remove_file("/f").expect("unlink");
    assert!(fs.statfs().blocks_free > free_full, "the blocks came back");
    fs.write("/f", &model).expect("write again");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    check_kernel(img.path(), &[Expect::dense("/f", model)]);
}

/// Directories grow through their block maps (a 1,500-entry htree), slow symlinks
/// and xattrs on ext2; the image is not clean while open and clean after close, as
/// the kernel marks an ext2 filesystem.
#[test]
fn ext2_directories_symlinks_and_clean_state() {
    let img = mkfs(&MkfsOptions::new(1024, 32 << 20).arg("-t").arg("ext2")).expect("mkfs");
    let state = |img: &std::path::Path| {
        dumpe2fs_h(img)
            .expect("dumpe2fs")
            .get("Filesystem state")
            .cloned()
            .unwrap_or_default()
    };
    let fs = rw(img.path());
    assert_eq!(state(img.path()), "not clean", "open read-write");
    fs.create_dir("/d").expect("mkdir");
    for i in 0..1500 {
        fs.write(format!("/d/entry-with-a-long-name-{i:05}"), format!("{i}"))
            .expect("create");
    }
    let target = "t/".repeat(150);
    fs.symlink(&target, "/slow").expect("slow symlink");
    let d = fs.resolve(b"/d", false).expect("resolve");
    fs.set_xattr_ino(d, b"user.k", b"v", rext4::XattrFlags::default())
        .expect("xattr");
    assert_eq!(flags_of(&fs, "/d") & EXTENTS_FL, 0);
    assert_eq!(flags_of(&fs, "/slow") & EXTENTS_FL, 0);
    for i in (0..1500).step_by(3) {
        fs.remove_file(format!("/d/entry-with-a-long-name-{i:05}"))
            .expect("unlink");
    }
    fs.close().expect("close");
    assert_eq!(state(img.path()), "clean", "closed");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    let m = match LoopMount::new(img.path(), true, "") {
        Ok(m) => m,
        Err(why) => return skip(&why),
    };
    assert_eq!(
        std::fs::read_dir(m.path().join("d")).expect("ls").count(),
        1000
    );
    assert_eq!(
        std::fs::read_link(m.path().join("slow")).expect("readlink"),
        std::path::PathBuf::from(&target)
    );
}
