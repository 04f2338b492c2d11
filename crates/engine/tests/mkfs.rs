//! mkfs against mke2fs 1.47.0: for the same size, UUID, hash seed and creation time
//! (`E2FSPROGS_FAKE_TIME`), `rext4::mkfs` and `mkfs.ext4` must produce images whose
//! full `dumpe2fs` output is the same and whose bytes are the same, except for the
//! fields listed in [`ALLOWED_DUMPE2FS`] / [`ALLOWED_SB_BYTES`]. Every rext4 image
//! must pass `e2fsck -fn`, open in the engine, and (as root) mount read-write in the
//! kernel, take new files and still pass e2fsck afterwards.

use std::fs::File;
use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;

use rext4::device::{BlockDevice, FileDevice};
use rext4::mkfs::{format_uuid, mkfs_file, FeatureSet, MkfsOptions, MkfsReport};
use rext4::Fs;
use rext4_testkit::{e2fsck_fn, skip, upstream_conf_path, LoopMount, TempDir};

const UUID: &str = "01234567-89ab-cdef-0123-456789abcdef";
const HASH_SEED: &str = "fedcba98-7654-3210-fedc-ba9876543210";
const TIME: i64 = 1_700_000_000;

const K: u64 = 1024;
const M: u64 = 1024 * K;
const G: u64 = 1024 * M;

/// dumpe2fs lines that must differ, with the reason.
const ALLOWED_DUMPE2FS: &[(&str, &str)] = &[
    (
        "Lifetime writes:",
        "s_kbytes_written counts the bytes mke2fs's unix_io layer flushed before the final \
         superblock write, which depends on its 8-block write-back cache; rext4 records \
         the bytes it wrote",
    ),
    (
        "Checksum:",
        "the superblock checksum covers s_kbytes_written",
    ),
    (
        "    mmp_update_date:",
        "mke2fs stamps the MMP block with the real time (E2FSPROGS_FAKE_TIME does not \
         reach it); rext4 with the creation time",
    ),
    ("    mmp_update_time:", "as mmp_update_date"),
    (
        "    mmp_device_name:",
        "each tool records the path it was given, and the two images have their own",
    ),
];

/// Byte ranges of the MMP block allowed to differ, for the reasons above: mmp_time
/// (0x8..0x10), mmp_bdevname (0x50..0x70) and the checksum that covers them
/// (0x3FC..0x400).
const ALLOWED_MMP_BYTES: &[(usize, usize)] = &[(0x8, 0x10), (0x50, 0x70), (0x3FC, 0x400)];

/// Superblock byte ranges (relative to each copy) allowed to differ: s_kbytes_written
/// (0x178..0x180) and s_checksum (0x3FC..0x400), for the reasons above.
const ALLOWED_SB_BYTES: &[(usize, usize)] = &[(0x178, 0x180), (0x3FC, 0x400)];

struct Case {
    size: u64,
    upstream: bool,
    /// Extra mke2fs arguments, mirrored in `opts`.
    args: Vec<String>,
    /// rext4 takes the size from the device (as mke2fs does here) instead of being
    /// given it.
    from_device: bool,
    opts: MkfsOptions,
}

impl Case {
    fn new(size: u64, upstream: bool) -> Case {
        Case {
            size,
            upstream,
            args: Vec::new(),
            from_device: false,
            opts: MkfsOptions {
                uuid: rext4::mkfs::parse_uuid(UUID),
                hash_seed: rext4::mkfs::parse_uuid(HASH_SEED),
                creation_time: Some(TIME),
                upstream_defaults: upstream,
                ..MkfsOptions::default()
            },
        }
    }
    fn features(mut self, spec: &str) -> Case {
        self.args.push("-O".into());
        self.args.push(spec.into());
        self.opts.features.edit(spec).expect("feature spec");
        self
    }
    fn block_size(mut self, bs: u32) -> Case {
        self.args.push("-b".into());
        self.args.push(bs.to_string());
        self.opts.block_size = Some(bs);
        self
    }
    fn inodes(mut self, n: u32) -> Case {
        self.args.push("-N".into());
        self.args.push(n.to_string());
        self.opts.inodes = Some(n);
        self
    }
    fn fs_type(mut self, t: &str) -> Case {
        self.args.push("-t".into());
        self.args.push(t.into());
        self.opts.fs_type = rext4::mkfs::FsType::parse(t).expect("fs type");
        self
    }
    fn label(mut self, l: &str) -> Case {
        self.args.push("-L".into());
        self.args.push(l.into());
        self.opts.label = Some(l.into());
        self
    }
}

fn mke2fs(path: &Path, c: &Case) {
    let f = File::create(path).expect("create image");
    f.set_len(c.size).expect("size image");
    drop(f);
    let mut cmd = Command::new("mkfs.ext4");
    if c.upstream {
        cmd.env("MKE2FS_CONFIG", upstream_conf_path());
    } else {
        cmd.env_remove("MKE2FS_CONFIG");
    }
    cmd.env("E2FSPROGS_FAKE_TIME", TIME.to_string())
        .args(["-q", "-F", "-U", UUID, "-E"])
        .arg(format!("hash_seed={HASH_SEED}"))
        .args(&c.args)
        .arg(path);
    let out = cmd.output().expect("run mkfs.ext4");
    assert!(
        out.status.success(),
        "mkfs.ext4 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn dumpe2fs(path: &Path) -> String {
    let out = Command::new("dumpe2fs")
        .arg(path)
        .output()
        .expect("run dumpe2fs");
    assert!(out.status.success(), "dumpe2fs {} failed", path.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The dumpe2fs lines that differ, in `diff`'s words ("-" mke2fs, "+" rext4), with
/// the allowed lines removed first.
fn dumpe2fs_diff(theirs: &str, ours: &str) -> Vec<String> {
    let keep = |l: &&str| !ALLOWED_DUMPE2FS.iter().any(|(p, _)| l.starts_with(p));
    let a: Vec<&str> = theirs.lines().filter(keep).collect();
    let b: Vec<&str> = ours.lines().filter(keep).collect();
    // Longest common subsequence on lines: dumpe2fs output is a few thousand lines.
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out.push(format!("+{}", b[j]));
            j += 1;
        } else {
            out.push(format!("-{}", a[i]));
            i += 1;
        }
    }
    out
}

/// `[start, end)` byte ranges holding data (not holes).
fn data_ranges(path: &Path) -> Vec<(u64, u64)> {
    extern "C" {
        fn lseek(fd: i32, offset: i64, whence: i32) -> i64;
    }
    const SEEK_DATA: i32 = 3;
    const SEEK_HOLE: i32 = 4;
    let f = File::open(path).expect("open image");
    let size = f.metadata().expect("stat").len() as i64;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut off = 0i64;
    while off < size {
        // SAFETY: lseek only reads the descriptor `fd`, which `f` keeps open.
        let d = unsafe { lseek(fd, off, SEEK_DATA) };
        if d < 0 {
            break;
        }
        // SAFETY: as above.
        let h = unsafe { lseek(fd, d, SEEK_HOLE) };
        let h = if h < 0 { size } else { h };
        out.push((d as u64, h as u64));
        off = h;
    }
    out
}

fn merge(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Byte offsets of every superblock copy.
fn superblock_offsets(r: &MkfsReport) -> Vec<u64> {
    let bs = u64::from(r.block_size);
    let mut v = vec![1024];
    v.extend(r.superblock_backups.iter().map(|b| b * bs));
    v
}

/// Byte offset of the image's MMP block, when it has multi-mount protection.
fn mmp_block_offset(img: &Path) -> Option<u64> {
    let mut b = vec![0u8; 1024];
    File::open(img)
        .and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.read_exact_at(&mut b, 1024)
        })
        .expect("read superblock");
    let sb = rext4::format::superblock::Superblock::decode(&b).expect("superblock");
    sb.has_incompat(rext4::format::superblock::feature::INCOMPAT_MMP)
        .then(|| sb.mmp_block * u64::from(sb.block_size()))
}

/// Compare both images over the union of their data ranges; returns the differing
/// byte offsets outside the allowed superblock fields (at most `limit`).
fn byte_diff(theirs: &Path, ours: &Path, r: &MkfsReport, limit: usize) -> Vec<u64> {
    let ranges = merge(
        data_ranges(theirs)
            .into_iter()
            .chain(data_ranges(ours))
            .collect(),
    );
    let sbs = superblock_offsets(r);
    let mmp_at = mmp_block_offset(ours);
    let allowed = |off: u64| {
        let within = |start: u64, ranges: &[(usize, usize)]| {
            off >= start
                && ranges
                    .iter()
                    .any(|&(a, b)| off - start >= a as u64 && off - start < b as u64)
        };
        sbs.iter().any(|&s| within(s, ALLOWED_SB_BYTES))
            || mmp_at.is_some_and(|m| within(m, ALLOWED_MMP_BYTES))
    };
    let (mut fa, mut fb) = (
        File::open(theirs).expect("open"),
        File::open(ours).expect("open"),
    );
    let mut out = Vec::new();
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    for (s, e) in ranges {
        let mut off = s;
        while off < e {
            let n = ((e - off) as usize).min(ba.len());
            use std::io::{Seek, SeekFrom};
            fa.seek(SeekFrom::Start(off)).expect("seek");
            fb.seek(SeekFrom::Start(off)).expect("seek");
            fa.read_exact(&mut ba[..n]).expect("read");
            fb.read_exact(&mut bb[..n]).expect("read");
            if ba[..n] != bb[..n] {
                for i in 0..n {
                    if ba[i] != bb[i] && !allowed(off + i as u64) {
                        out.push(off + i as u64);
                        if out.len() >= limit {
                            return out;
                        }
                    }
                }
            }
            off += n as u64;
        }
    }
    out
}

/// Build both images and require equal dumpe2fs output and equal bytes; then check
/// the rext4 image with e2fsck and the engine. Returns the rext4 image's directory.
fn compare(c: &Case) -> (TempDir, MkfsReport) {
    let dir = TempDir::new("mkfs").expect("temp dir");
    let theirs = dir.join("mke2fs.img");
    let ours = dir.join("rext4.img");
    mke2fs(&theirs, c);
    let r = if c.from_device {
        File::create(&ours)
            .and_then(|f| f.set_len(c.size))
            .expect("create image");
        let dev = FileDevice::open(&ours, false, false).expect("open image");
        let opts = MkfsOptions {
            device_zeroed: true,
            ..c.opts.clone()
        };
        rext4::mkfs::mkfs(&dev, &opts).expect("rext4 mkfs")
    } else {
        mkfs_file(&ours, c.size, &c.opts).expect("rext4 mkfs")
    };
    assert_eq!(format_uuid(&r.uuid), UUID);

    let diff = dumpe2fs_diff(&dumpe2fs(&theirs), &dumpe2fs(&ours));
    if !diff.is_empty() {
        panic!(
            "dumpe2fs differs (size {}, upstream {}, args {:?}); - mke2fs, + rext4:\n{}",
            c.size,
            c.upstream,
            c.args,
            diff.join("\n")
        );
    }
    let bytes = byte_diff(&theirs, &ours, &r, 32);
    if !bytes.is_empty() {
        let bs = u64::from(r.block_size);
        let shown: Vec<String> = bytes
            .iter()
            .map(|o| format!("block {} +{:#x}", o / bs, o % bs))
            .collect();
        panic!(
            "images differ (size {}, upstream {}, args {:?}) at: {}",
            c.size,
            c.upstream,
            c.args,
            shown.join(", ")
        );
    }
    let fsck = e2fsck_fn(&ours);
    assert!(
        fsck.clean,
        "e2fsck -fn on the rext4 image:\n{}",
        fsck.output
    );
    let fs = Fs::open(&ours).expect("engine opens the rext4 image");
    let names: Vec<Vec<u8>> = fs
        .read_dir("/")
        .expect("read /")
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(
        names.iter().any(|n| n == b"lost+found"),
        "root lists {names:?}"
    );
    fs.read_dir("/lost+found").expect("read lost+found");
    (dir, r)
}

#[test]
fn same_as_mke2fs_4m() {
    compare(&Case::new(4 * M, false));
}
#[test]
fn same_as_mke2fs_64m() {
    compare(&Case::new(64 * M, false));
}
#[test]
fn same_as_mke2fs_1g() {
    compare(&Case::new(G, false));
}
#[test]
fn same_as_mke2fs_64g() {
    let (_d, r) = compare(&Case::new(64 * G, false));
    assert!(
        r.bytes_written < 64 * M,
        "the 64 GiB image must stay sparse"
    );
}
#[test]
fn same_as_mke2fs_upstream_4m() {
    compare(&Case::new(4 * M, true));
}
#[test]
fn same_as_mke2fs_upstream_64m() {
    compare(&Case::new(64 * M, true));
}
#[test]
fn same_as_mke2fs_upstream_1g() {
    compare(&Case::new(G, true));
}
#[test]
fn same_as_mke2fs_upstream_64g() {
    compare(&Case::new(64 * G, true));
}

/// Sizes that hit other rules: floppy type, a trimmed last group, tables spilling into
/// a backup group, a journal crossing group boundaries, a journal with an extent
/// leaf block (> 4 extents), 1 KiB blocks on a large fs.
#[test]
fn same_as_mke2fs_other_sizes() {
    for size in [2 * M, 16685 * K, 256 * M, 512 * M, 5 * G] {
        compare(&Case::new(size, false));
    }
    compare(&Case::new(2 * G, false).block_size(1024));
    compare(&Case::new(128 * M, true).block_size(4096));
    compare(&Case::new(256 * G, false));
    // Too small for a journal (and so, upstream, for the orphan file).
    compare(&Case::new(1900 * K, true));
    compare(&Case::new(4000 * K, false).block_size(4096));
    // A size taken from the device is rounded down to whole pages.
    let mut c = Case::new(20003 * K, false);
    c.from_device = true;
    let (_d, r) = compare(&c);
    assert_eq!(r.blocks_count, 20000);
}

/// `-t ext2` and `-t ext3`: the base features, no flex_bg, block-mapped root,
/// lost+found and (ext3) journal, its indirect blocks where libext2fs puts them.
#[test]
fn same_as_mke2fs_ext2_ext3() {
    for t in ["ext2", "ext3"] {
        for size in [4 * M, 64 * M, G] {
            compare(&Case::new(size, false).fs_type(t));
        }
        compare(&Case::new(256 * M, true).fs_type(t));
        compare(&Case::new(512 * M, false).fs_type(t).block_size(1024));
        compare(
            &Case::new(64 * M, false)
                .fs_type(t)
                .features("^resize_inode"),
        );
    }
    compare(
        &Case::new(64 * M, false)
            .fs_type("ext3")
            .features("extent,uninit_bg"),
    );
}

#[test]
fn same_as_mke2fs_with_options() {
    compare(&Case::new(64 * M, false).inodes(5000).label("rext4-label"));
    // More inodes than one bitmap per group holds: smaller groups (mke2fs retries
    // with blocks_per_group - 8 until they fit).
    compare(&Case::new(64 * M, false).inodes(100_000));
    // Fewer inodes per group than reserved inodes: lost+found lands in group 1.
    compare(&Case::new(64 * M, false).inodes(16));
    let too_many = MkfsOptions {
        inodes: Some(250_000),
        ..MkfsOptions::default()
    };
    let dir = TempDir::new("mkfs-n").expect("temp dir");
    assert!(mkfs_file(&dir.join("fs.img"), 64 * M, &too_many).is_err());
    for spec in [
        "^has_journal",
        "^resize_inode",
        "^flex_bg",
        "^64bit",
        "^dir_index,^ext_attr",
        "^metadata_csum",
        "^metadata_csum,uninit_bg",
        "^sparse_super,^resize_inode",
        "metadata_csum_seed",
        "ea_inode",
        "ea_inode,^metadata_csum",
        "inline_data",
    ] {
        compare(&Case::new(64 * M, false).features(spec));
        compare(&Case::new(G, true).features(spec));
    }
}

/// `-O mmp` (and `-E mmp_update_interval`): the MMP block where mke2fs puts it (the
/// first free block after the journal), clean, with this host's name, the image's
/// path and the creation time; the superblock's interval.
#[test]
fn same_as_mke2fs_with_mmp() {
    for (case, interval) in [
        (Case::new(64 * M, false).features("mmp"), 5),
        (Case::new(G, true).features("mmp"), 5),
        (Case::new(16 * M, false).block_size(1024).features("mmp"), 5),
    ] {
        let (dir, r) = compare(&case);
        let img = dir.join("rext4.img");
        let at = mmp_block_offset(&img).expect("mmp block");
        let mut b = vec![0u8; r.block_size as usize];
        File::open(&img)
            .and_then(|f| {
                use std::os::unix::fs::FileExt;
                f.read_exact_at(&mut b, at)
            })
            .expect("read MMP block");
        let m = rext4::format::mmp::MmpBlock::decode(&b, None).expect("MMP block");
        assert_eq!(m.seq, rext4::format::mmp::SEQ_CLEAN);
        assert_eq!(m.time, TIME as u64);
        assert_eq!(m.check_interval, interval);
        let path = img.as_os_str().to_string_lossy().into_owned();
        assert_eq!(m.bdevname_text(), path[..path.len().min(32)]);
    }
    let mut c = Case::new(64 * M, false).features("mmp");
    // mke2fs keeps only its last -E: this one repeats the hash seed.
    c.args.push("-E".into());
    c.args
        .push(format!("hash_seed={HASH_SEED},mmp_update_interval=1"));
    c.opts.mmp_update_interval = Some(1);
    let (dir, _) = compare(&c);
    let h = rext4_testkit::dumpe2fs_h(&dir.join("rext4.img")).expect("dumpe2fs");
    assert_eq!(h["MMP update interval"], "1");
}

#[test]
fn kernel_mounts_rext4_images_rw() {
    if let Err(why) = rext4_testkit::can_loop_mount() {
        skip(&why);
        return;
    }
    for (size, upstream) in [(64 * M, false), (G, true)] {
        let dir = TempDir::new("mkfs-mount").expect("temp dir");
        let img = dir.join("fs.img");
        let opts = MkfsOptions {
            upstream_defaults: upstream,
            ..MkfsOptions::default()
        };
        mkfs_file(&img, size, &opts).expect("mkfs");
        {
            let m = match LoopMount::new(&img, false, "") {
                Ok(m) => m,
                Err(why) => {
                    skip(&why);
                    return;
                }
            };
            for i in 0..50 {
                let p = m.path().join(format!("d{}/f{i}", i % 5));
                std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
                std::fs::write(&p, vec![i as u8; 5000 * i]).expect("write");
            }
            assert!(m.path().join("lost+found").is_dir());
            m.unmount().expect("unmount");
        }
        let fsck = e2fsck_fn(&img);
        assert!(fsck.clean, "after kernel writes:\n{}", fsck.output);
        let fs = Fs::open(&img).expect("engine opens");
        let files = fs
            .read_dir("/d3")
            .expect("read /d3")
            .into_iter()
            .filter(|e| e.name.starts_with(b"f"))
            .count();
        assert_eq!(files, 10);
    }
}

/// A device full of old data: mkfs must zero what it relies on (journal, used inode
/// table blocks, block 0 past the boot sector) and leave tables to lazy init.
#[test]
fn device_with_old_data_is_initialized() {
    for upstream in [false, true] {
        let dir = TempDir::new("mkfs-junk").expect("temp dir");
        let img = dir.join("fs.img");
        let junk: Vec<u8> = (0..64 * M).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&img, &junk).expect("write junk");
        let dev = FileDevice::open(&img, false, false).expect("open");
        let opts = MkfsOptions {
            upstream_defaults: upstream,
            ..MkfsOptions::default()
        };
        let r = rext4::mkfs::mkfs(&dev, &opts).expect("mkfs");
        dev.flush().expect("flush");
        drop(dev);
        assert!(r.bytes_written > u64::from(r.journal_blocks) * u64::from(r.block_size));
        let fsck = e2fsck_fn(&img);
        assert!(fsck.clean, "e2fsck on a reused device:\n{}", fsck.output);
        let text = dumpe2fs(&img);
        assert!(!text.contains("ITABLE_ZEROED"), "tables were not zeroed");
        let m = match LoopMount::new(&img, false, "") {
            Ok(m) => m,
            Err(why) => {
                skip(&why);
                continue;
            }
        };
        std::fs::write(m.path().join("f"), b"hello").expect("write");
        m.unmount().expect("unmount");
        let fsck = e2fsck_fn(&img);
        assert!(fsck.clean, "after the kernel:\n{}", fsck.output);
    }
}

#[test]
fn unbuildable_features_are_refused() {
    let dir = TempDir::new("mkfs-f").expect("temp dir");
    for spec in ["^extent", "bigalloc"] {
        let opts = MkfsOptions {
            features: FeatureSet::parse(spec).expect("parse"),
            ..MkfsOptions::default()
        };
        assert!(
            mkfs_file(&dir.join("fs.img"), 8 * M, &opts).is_err(),
            "{spec} accepted"
        );
    }
}

/// A mkfs that cannot be built (too small, too many inodes, a feature rext4 does not
/// make) is refused before the file is touched: an existing image keeps every byte
/// (before, the file was truncated first and the user's image lost to a mistyped size),
/// and a file the call created is not left behind.
#[test]
fn refused_mkfs_leaves_the_file_as_it_was() {
    let dir = TempDir::new("mkfs-keep").expect("temp dir");
    let img = dir.join("keep.img");
    mkfs_file(&img, 8 * M, &MkfsOptions::default()).expect("mkfs");
    {
        let fs = Fs::open_with(
            &img,
            rext4::FsOptions {
                read_only: false,
                ..Default::default()
            },
        )
        .expect("open");
        fs.write("/data", b"important").expect("write");
        fs.close().expect("close");
    }
    let before = std::fs::read(&img).expect("read image");
    let refusals: [(&str, u64, MkfsOptions); 3] = [
        ("10 KiB", 10 * K, MkfsOptions::default()),
        (
            "-N 99999999",
            8 * M,
            MkfsOptions {
                inodes: Some(99_999_999),
                ..MkfsOptions::default()
            },
        ),
        (
            "-O bigalloc",
            8 * M,
            MkfsOptions {
                features: FeatureSet::parse("bigalloc").expect("parse"),
                ..MkfsOptions::default()
            },
        ),
    ];
    for (what, size, opts) in &refusals {
        assert!(mkfs_file(&img, *size, opts).is_err(), "{what} accepted");
        assert!(
            std::fs::read(&img).expect("read image") == before,
            "a refused mkfs ({what}) changed the image"
        );
        let new = dir.join("new.img");
        assert!(mkfs_file(&new, *size, opts).is_err(), "{what} accepted");
        assert!(
            !new.exists(),
            "a refused mkfs ({what}) left a new file behind"
        );
    }
    let fs = Fs::open(&img).expect("open after the refusals");
    assert_eq!(fs.read("/data").expect("read"), b"important");
}
