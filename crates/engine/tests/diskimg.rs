//! Disk images as people have them (`rext4::image`): an ext4 filesystem in a GPT
//! partition, in an MBR logical partition, at a byte offset. For each, the kernel
//! writes a tree (a loop mount with offset and sizelimit), rext4 reads it identically
//! through the spec, rext4 writes through the spec, and then `e2fsck -fn` of the
//! partition is clean, the kernel sees what rext4 wrote, and no byte outside the
//! partition changed. Damaged tables and bad specs are errors that say what is wrong.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use rext4::{Error, Fs, FsOptions, ImageSpec};
use rext4_testkit::{
    diff_trees, e2fsck_fn, populate_kernel, skip, snapshot_dir, Compare, Fixture, LoopMount,
    TempDir,
};

const MIB: u64 = 1 << 20;

/// A sparse disk of `size` bytes partitioned by `sfdisk` with `script`.
fn partitioned(dir: &TempDir, name: &str, size: u64, script: &str) -> Option<PathBuf> {
    let disk = dir.join(name);
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(size))
        .expect("disk");
    let mut child = match Command::new("sfdisk")
        .args(["-q", "--no-reread", "--no-tell-kernel"])
        .arg(&disk)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            skip(&format!("sfdisk: {e}"));
            return None;
        }
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("script");
    assert!(child.wait().expect("sfdisk").success(), "sfdisk failed");
    Some(disk)
}

/// mkfs.ext4 at `offset` of `disk`, `size` bytes.
fn mkfs_at_offset(disk: &Path, offset: u64, size: u64) {
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-E"])
        .arg(format!("offset={offset}"))
        .arg(disk)
        .arg(format!("{}k", size / 1024))
        .output()
        .expect("mkfs.ext4");
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    }
}

/// The bytes of `disk` outside `[offset, offset + size)`.
fn outside(disk: &Path, offset: u64, size: u64) -> Vec<u8> {
    let mut b = std::fs::read(disk).expect("read disk");
    b.drain(offset as usize..(offset + size) as usize);
    b
}

/// The kernel writes a tree at `[offset, offset + size)` of `disk`; rext4 reads it
/// through `spec`, writes through it, and the result is checked.
fn kernel_then_rext4(disk: &Path, offset: u64, size: u64, spec: &str, label: &str) {
    mkfs_at_offset(disk, offset, size);
    let loop_opts = format!("offset={offset},sizelimit={size}");
    let m = match LoopMount::new(disk, false, &loop_opts) {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel loop mount: {e}")),
    };
    populate_kernel(m.path(), &Fixture::quick()).expect("kernel populates");
    m.unmount().expect("unmount");
    let m = LoopMount::new(disk, true, &format!("{loop_opts},noatime")).expect("mount ro");
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    m.unmount().expect("unmount");
    let before = outside(disk, offset, size);

    let spec = ImageSpec::parse(&format!("{}{spec}", disk.display())).expect("spec");
    let fs = Fs::open_spec(&spec, FsOptions::default()).expect("rext4 opens the spec");
    let ours = common::snapshot(&fs).expect("rext4 walks the tree");
    drop(fs);
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] kernel vs rext4:\n{}",
        d[..d.len().min(40)].join("\n")
    );

    // rext4 writes through the spec.
    let fs = Fs::open_spec(&spec, rw()).expect("open rw");
    fs.create_dir("/from-rext4").expect("mkdir");
    let data: Vec<u8> = (0..3 * MIB as usize + 123)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    fs.write("/from-rext4/data", &data).expect("write");
    fs.remove_file("/small/f0").ok();
    fs.close().expect("close");

    let fsck = e2fsck_fn(Path::new(&format!("{}?offset={offset}", disk.display())));
    assert!(fsck.clean, "[{label}] e2fsck: {}", fsck.output);
    assert_eq!(
        outside(disk, offset, size),
        before,
        "[{label}] bytes outside the partition changed"
    );
    let m = LoopMount::new(disk, true, &format!("{loop_opts},noatime")).expect("mount ro");
    let seen = std::fs::read(m.path().join("from-rext4/data")).expect("kernel reads");
    m.unmount().expect("unmount");
    assert!(seen == data, "[{label}] the kernel reads other bytes");
}

#[test]
fn gpt_partition() {
    let dir = TempDir::new("diskimg").expect("tmp");
    let Some(disk) = partitioned(&dir, "gpt.img", 64 * MIB, "label: gpt\n,8M,L,\n,48M,L,\n") else {
        return;
    };
    let d = rext4::image::inspect(&ImageSpec::file(&disk)).expect("inspect");
    let t = d.table.expect("a table");
    let p2 = t.get(2).expect("partition 2").clone();
    assert_eq!((p2.start_bytes, p2.size_bytes), (9 * MIB, 48 * MIB));
    assert_eq!(p2.kind, "Linux filesystem");
    kernel_then_rext4(&disk, p2.start_bytes, p2.size_bytes, "?partition=2", "gpt");
    // The whole disk is no ext4: the error names the partitions to open.
    let e = Fs::open(&disk).map(|_| ()).expect_err("whole disk");
    assert!(
        matches!(&e, Error::NotExt4(m) if m.contains("GPT partition table (partitions 1, 2)")),
        "{e}"
    );
}

#[test]
fn mbr_logical_partition() {
    let dir = TempDir::new("diskimg").expect("tmp");
    // Primary 1, extended 2 holding logical 5 and 6 (Linux's numbers).
    let Some(disk) = partitioned(
        &dir,
        "mbr.img",
        72 * MIB,
        "label: dos\n,8M,83\n,,E\n,8M,83\n,48M,83\n",
    ) else {
        return;
    };
    let d = rext4::image::inspect(&ImageSpec::file(&disk)).expect("inspect");
    let t = d.table.expect("a table");
    let nums: Vec<u32> = t.partitions.iter().map(|p| p.number).collect();
    assert_eq!(nums, vec![1, 2, 5, 6]);
    let p6 = t.get(6).expect("partition 6").clone();
    assert_eq!(p6.size_bytes, 48 * MIB);
    kernel_then_rext4(&disk, p6.start_bytes, p6.size_bytes, "?partition=6", "mbr");
}

#[test]
fn byte_offset() {
    let dir = TempDir::new("diskimg").expect("tmp");
    let disk = dir.join("off.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(52 * MIB))
        .expect("disk");
    kernel_then_rext4(
        &disk,
        3 * MIB,
        48 * MIB,
        &format!("?offset={}&size={}", 3 * MIB, 48 * MIB),
        "offset",
    );
}

#[test]
fn bad_tables_and_specs_are_named() {
    let dir = TempDir::new("diskimg").expect("tmp");
    let Some(disk) = partitioned(&dir, "bad.img", 16 * MIB, "label: gpt\n,4M,L,\n") else {
        return;
    };
    let open = |text: &str| {
        Fs::open_spec(&ImageSpec::parse(text).expect("spec"), FsOptions::default())
            .map(|_| ())
            .expect_err(text)
            .to_string()
    };
    let d = disk.display().to_string();
    let e = open(&format!("{d}?partition=3"));
    assert!(
        e.contains("partition 3 does not exist (the GPT has 1: 1)"),
        "{e}"
    );
    let e = open(&format!("{d}?offset={}", 32 * MIB));
    assert!(e.contains("past the end"), "{e}");
    let e = open(&format!("{d}?offset=512&size={}", 32 * MIB));
    assert!(e.contains("past the end"), "{e}");
    // Break both GPT headers' checksums: the table is damaged, said so.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&disk)
        .expect("open");
    f.write_all_at(b"\xff", 512 + 40).expect("poke primary");
    f.write_all_at(b"\xff", 16 * MIB - 512 + 40)
        .expect("poke backup");
    drop(f);
    let e = open(&format!("{d}?partition=1"));
    assert!(
        e.contains("corrupt GPT: GPT header checksum mismatch"),
        "{e}"
    );
    // A plain path holding '?' that exists is that file.
    let odd = dir.join("odd?partition=1");
    std::fs::copy(&disk, &odd).expect("copy");
    let s = ImageSpec::from_arg(&odd.display().to_string()).expect("spec");
    assert_eq!(s, ImageSpec::file(&odd));
    let e = Fs::open(&odd).map(|_| ()).expect_err("not ext4");
    assert!(matches!(e, Error::NotExt4(_)), "{e}");
}

/// A memory device that records discards.
struct Discards {
    mem: rext4::device::MemDevice,
    seen: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl rext4::device::BlockDevice for Discards {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.mem.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.mem.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.seen.lock().expect("seen").push((offset, len));
        self.mem.discard(offset, len)
    }
    fn size_bytes(&self) -> u64 {
        self.mem.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        false
    }
}

/// FsOptions::discard discards a file's blocks only once the transaction that freed
/// them is committed (before, a crash recovers the state that still uses them), and
/// `Fs::trim` discards free blocks only.
#[test]
fn discard_waits_for_the_commit() {
    let dev = std::sync::Arc::new(Discards {
        mem: rext4::device::MemDevice::new(common::base_image(4096, 64 * MIB)),
        seen: Default::default(),
    });
    let fs = Fs::open_device(
        dev.clone(),
        FsOptions {
            discard: true,
            ..rw()
        },
    )
    .expect("open");
    fs.write("/f", vec![7u8; 2 * MIB as usize]).expect("write");
    fs.write("/keep", vec![9u8; MIB as usize]).expect("write");
    fs.sync().expect("sync");
    let blocks = common::blocks_of(&fs, "/f");
    let keep = common::blocks_of(&fs, "/keep");
    dev.seen.lock().expect("seen").clear();
    fs.remove_file("/f").expect("rm");
    assert!(
        dev.seen.lock().expect("seen").is_empty(),
        "discarded before the free was committed"
    );
    fs.sync().expect("sync");
    let seen = dev.seen.lock().expect("seen").clone();
    let covered = |b: u64| {
        seen.iter()
            .any(|&(o, l)| b * 4096 >= o && (b + 1) * 4096 <= o + l)
    };
    assert!(
        blocks.iter().all(|&b| covered(b)),
        "not every freed block discarded"
    );
    // trim: everything free goes, nothing in use.
    dev.seen.lock().expect("seen").clear();
    let n = fs.trim(0, u64::MAX, 0).expect("trim");
    assert!(n >= 50 * MIB, "trimmed only {n}");
    let seen = dev.seen.lock().expect("seen").clone();
    let hit = |b: u64| {
        seen.iter()
            .any(|&(o, l)| b * 4096 < o + l && (b + 1) * 4096 > o)
    };
    assert!(
        !keep.iter().any(|&b| hit(b)),
        "trim discarded a file's block"
    );
    assert_eq!(fs.read("/keep").expect("read"), vec![9u8; MIB as usize]);
    fs.close().expect("close");
}

/// `Fs::trim` finds free runs a byte of the bitmap at a time and cuts the busy runs
/// out of them: blocks freed by a transaction not yet committed stay, blocks freed
/// and committed go, blocks in use stay.
#[test]
fn trim_skips_blocks_freed_since_the_last_commit() {
    let dev = std::sync::Arc::new(Discards {
        mem: rext4::device::MemDevice::new(common::base_image(4096, 64 * MIB)),
        seen: Default::default(),
    });
    let fs = Fs::open_device(dev.clone(), rw()).expect("open");
    for (name, len) in [
        ("/a", 2 * MIB),
        ("/b", 3 * MIB),
        ("/c", MIB),
        ("/keep", MIB),
    ] {
        fs.write(name, vec![5u8; len as usize]).expect("write");
    }
    fs.sync().expect("sync");
    let (a, b, c, keep) = (
        common::blocks_of(&fs, "/a"),
        common::blocks_of(&fs, "/b"),
        common::blocks_of(&fs, "/c"),
        common::blocks_of(&fs, "/keep"),
    );
    fs.remove_file("/b").expect("rm b");
    fs.sync().expect("sync");
    // /a and /c freed in the running transaction: busy, on both sides of /b's run.
    fs.remove_file("/a").expect("rm a");
    fs.remove_file("/c").expect("rm c");
    dev.seen.lock().expect("seen").clear();
    let n = fs.trim(0, u64::MAX, 0).expect("trim");
    let seen = dev.seen.lock().expect("seen").clone();
    let hit = |blk: u64| {
        seen.iter()
            .any(|&(o, l)| blk * 4096 < o + l && (blk + 1) * 4096 > o)
    };
    assert!(
        b.iter().all(|&x| hit(x)),
        "a committed free was not discarded"
    );
    for (what, blocks) in [("busy /a", &a), ("busy /c", &c), ("/keep", &keep)] {
        assert!(!blocks.iter().any(|&x| hit(x)), "trim discarded {what}");
    }
    let discarded: u64 = seen.iter().map(|&(_, l)| l).sum();
    assert_eq!(n, discarded, "trim's count and its discards differ");
    assert_eq!(fs.read("/keep").expect("read"), vec![5u8; MIB as usize]);
    fs.close().expect("close");
}
