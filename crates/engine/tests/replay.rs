//! Replay of kernel-written journals: images written by the kernel and copied while
//! still mounted (the log holds committed transactions, revoke records after deletes,
//! an open-but-unlinked file on the orphan list). rext4's replay of one copy and
//! `e2fsck -fy` of another give the same tree and the same `dumpe2fs` output, but for
//! fields listed below with the reason they differ.

mod common;

use std::process::Command;

use rext4::{Fs, FsOptions};
use rext4_testkit::{
    diff_trees, e2fsck_fn, e2fsck_fy, mkfs, skip, Compare, LoopMount, MkfsOptions,
};

/// dumpe2fs lines that legitimately differ after the two recoveries.
fn comparable(line: &str) -> bool {
    ![
        // rext4's read-write open counts as a mount, e2fsck does not.
        "Last mount time:",
        "Mount count:",
        // Both write the superblock, at different times.
        "Last write time:",
        // e2fsck records its check.
        "Last checked:",
        // Replay itself leaves last tid + 2 like e2fsck and the kernel (checked by the
        // bare-replay tests below); rext4's close then commits one more transaction
        // (the superblock), which advances it.
        "Journal sequence:",
        // Covers the fields above.
        "Checksum:",
        "Journal checksum:",
        // Bytes written over the filesystem's life: each tool counts its own I/O.
        "Lifetime writes:",
    ]
    .iter()
    .any(|p| line.starts_with(p))
}

/// Group lines without what e2fsck recomputes and the kernel (and rext4) only lower:
/// itable_unused ("unused inodes") and the INODE_UNINIT flag of groups left without
/// inodes (format notes §2.2), and the descriptor checksum that covers them.
fn normalise_group_line(l: &str) -> String {
    let mut l = l.to_string();
    if l.starts_with("Group ") {
        if let Some(i) = l.find(" csum 0x") {
            l.replace_range(i..i + 14, "");
        }
        l = l.replace("INODE_UNINIT, ", "");
    }
    if let Some(i) = l.find(" unused inodes") {
        let start = l[..i].rfind(", ").unwrap_or(i);
        l.replace_range(start..i + " unused inodes".len(), "");
    }
    l
}

fn dumpe2fs(p: &std::path::Path) -> Vec<String> {
    let out = Command::new("dumpe2fs")
        .arg(p)
        .env("TZ", "UTC")
        .output()
        .expect("dumpe2fs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| comparable(l))
        .map(normalise_group_line)
        .collect()
}

fn case(bs: u32, upstream: bool) {
    let label = format!("{bs} upstream={upstream}");
    let img = mkfs(&MkfsOptions::new(bs, 64 << 20).upstream(upstream)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "commit=60") {
        Ok(m) => m,
        Err(e) => return skip(&format!("needs a kernel mount: {e}")),
    };
    let root = m.path();
    std::fs::create_dir_all(root.join("a/b/c")).expect("mkdir");
    for i in 0..200 {
        std::fs::write(root.join(format!("a/f{i}")), vec![i as u8; 1000 + i * 37]).expect("write");
    }
    std::fs::create_dir(root.join("gone")).expect("mkdir");
    for i in 0..100 {
        std::fs::write(root.join(format!("gone/g{i}")), vec![1u8; 4096]).expect("write");
    }
    let sync = |p: &std::path::Path| {
        std::fs::File::open(p)
            .and_then(|f| f.sync_all())
            .expect("fsync")
    };
    sync(&root.join("a/f0"));
    std::fs::remove_dir_all(root.join("gone")).expect("rm -r");
    std::fs::write(root.join("a/b/c/deep"), b"deep").expect("write");
    let open = std::fs::File::create(root.join("open-unlinked")).expect("create");
    std::io::Write::write_all(&mut &open, &[9u8; 20_000]).expect("write");
    std::fs::remove_file(root.join("open-unlinked")).expect("unlink while open");
    sync(&root.join("a/b/c/deep"));
    let copy_a = img.path().with_extension("a");
    let copy_b = img.path().with_extension("b");
    // One copy of the live image, then a copy of that copy: the kernel may write
    // between two copies of the live image, and the two recoverers must start from
    // the same bytes.
    std::fs::copy(img.path(), &copy_a).expect("copy while mounted");
    std::fs::copy(&copy_a, &copy_b).expect("copy the copy");
    drop(open);
    m.unmount().expect("unmount");
    let h = rext4_testkit::dumpe2fs_h(&copy_a).expect("dumpe2fs");
    assert!(
        h["Filesystem features"].contains("needs_recovery"),
        "[{label}] the copy needs no recovery"
    );

    let fy = e2fsck_fy(&copy_a);
    assert!(fy.exit_code <= 1, "[{label}] e2fsck -fy: {}", fy.output);
    let fs = Fs::open_with(
        &copy_b,
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("rext4 replay");
    assert!(
        fs.warnings()
            .iter()
            .any(|w| w.starts_with("journal replayed:")),
        "{:?}",
        fs.warnings()
    );
    fs.close().expect("close");
    let r = e2fsck_fn(&copy_b);
    assert!(
        r.clean,
        "[{label}] e2fsck after rext4's replay: {}",
        r.output
    );

    let ta = common::snapshot(&Fs::open(&copy_a).expect("open a")).expect("walk a");
    let tb = common::snapshot(&Fs::open(&copy_b).expect("open b")).expect("walk b");
    let d = diff_trees(&ta, &tb, &Compare::exact());
    assert!(d.is_empty(), "[{label}] trees differ:\n{}", d.join("\n"));
    assert!(ta.contains_key(&b"a/b/c/deep"[..]) && !ta.contains_key(&b"gone"[..]));
    let (da, db) = (dumpe2fs(&copy_a), dumpe2fs(&copy_b));
    let diff: Vec<String> = da
        .iter()
        .zip(&db)
        .filter(|(x, y)| x != y)
        .map(|(x, y)| format!("e2fsck: {x}\nrext4:  {y}"))
        .collect();
    assert!(
        diff.is_empty() && da.len() == db.len(),
        "[{label}] dumpe2fs differs:\n{}\n{}e2fsck -fy said (exit {}):\n{}",
        diff.join("\n"),
        bitmap_bytes_diff(&diff, &copy_a, &copy_b, bs),
        fy.exit_code,
        fy.output
    );
    let _ = std::fs::remove_file(copy_a);
    let _ = std::fs::remove_file(copy_b);
}

/// For differing dumpe2fs lines that name a bitmap block ("Inode bitmap at 268 (...),
/// csum ..."), the bytes of that block that differ between the two recovered images:
/// what a failure needs to say which recovery set which bit.
fn bitmap_bytes_diff(lines: &[String], a: &Path, b: &Path, bs: u32) -> String {
    use std::os::unix::fs::FileExt;
    let mut out = String::new();
    for l in lines.iter().filter(|l| l.starts_with("rext4:")) {
        let Some(at) = l.find("bitmap at ") else {
            continue;
        };
        let digits: String = l[at + 10..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let Ok(blk) = digits.parse::<u64>() else {
            continue;
        };
        let read = |p: &Path| {
            let mut buf = vec![0u8; bs as usize];
            std::fs::File::open(p)
                .and_then(|f| f.read_exact_at(&mut buf, blk * u64::from(bs)))
                .map(|_| buf)
        };
        let (Ok(x), Ok(y)) = (read(a), read(b)) else {
            continue;
        };
        out += &format!("block {blk}, differing bytes (offset: e2fsck rext4):");
        for (i, (p, q)) in x.iter().zip(&y).enumerate().filter(|(_, (p, q))| p != q) {
            out += &format!(" {i}: {p:08b} {q:08b};");
        }
        out += "\n";
    }
    out
}

#[test]
fn kernel_journal_1k_debian() {
    case(1024, false);
}

#[test]
fn kernel_journal_4k_upstream() {
    case(4096, true);
}

#[test]
fn kernel_journal_4k_debian() {
    case(4096, false);
}

// ---------------------------------------------------------------------------------
// rext4::journal::replay on its own (no open/close around it), against e2fsck -fy.
// ---------------------------------------------------------------------------------

use std::path::Path;

use rext4::device::{BlockDevice, FileDevice, MemDevice};
use rext4::format::jbd2::{
    self, BlockKind, CommitBlock, Features, JournalSuperblock, LogFormat, Scanner, Tag,
};
use rext4::format::superblock::{feature, Superblock, SB_OFFSET, STATE_ERROR};
use rext4::journal::{self, JournalMap, ReplayReport};
use rext4_testkit::tree::hash_file;
use rext4_testkit::{dumpe2fs_h, snapshot_dir, Image};

fn rw_device(p: &Path) -> FileDevice {
    FileDevice::open(p, false, false).expect("open image rw")
}

/// `dumpe2fs -h` fields that legitimately differ between `e2fsck -fy` and a bare
/// `journal::replay` of the same crash copy, with the reason:
/// - "Last checked", "Mount count", "Check interval"-style bookkeeping: e2fsck -f
///   records its check (s_lastcheck, s_mnt_count reset to 0);
/// - "Last write time": both write the superblock, at different moments;
/// - "Lifetime writes": s_kbytes_written counts each tool's own I/O (libext2fs adds its
///   writes; replay does not touch the counter);
/// - "Free blocks", "Free inodes": e2fsck recomputes the superblock summary counters
///   and frees the orphan's inode and blocks; replay restores the counters as the
///   kernel last wrote them (the kernel keeps them only approximately on disk);
/// - "First orphan inode" (legacy orphan list) and the `orphan_present` feature
///   (orphan_file): e2fsck processes orphans, replay does not (that is the orphan
///   code's job at the next read-write open);
/// - "Checksum": covers all of the above.
const REPLAY_VS_E2FSCK: &[&str] = &[
    "Last checked",
    "Mount count",
    "Last write time",
    "Lifetime writes",
    "Free blocks",
    "Free inodes",
    "First orphan inode",
    "Checksum",
];

fn dumpe2fs_diff(a: &Path, b: &Path) -> Vec<String> {
    let (ha, hb) = (
        dumpe2fs_h(a).expect("dumpe2fs a"),
        dumpe2fs_h(b).expect("dumpe2fs b"),
    );
    let mut keys: Vec<&String> = ha.keys().chain(hb.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut out = Vec::new();
    for k in keys {
        let (va, vb) = (ha.get(k), hb.get(k));
        if REPLAY_VS_E2FSCK.contains(&k.as_str()) {
            if va != vb {
                eprintln!("expected difference {k}: e2fsck {va:?} / rext4 {vb:?}");
            }
            continue;
        }
        if k == "Filesystem features" {
            // orphan_present: see REPLAY_VS_E2FSCK.
            let strip = |v: Option<&String>| {
                v.map(|s| {
                    s.split_whitespace()
                        .filter(|f| *f != "orphan_present")
                        .collect::<Vec<_>>()
                        .join(" ")
                })
            };
            if strip(va) != strip(vb) {
                out.push(format!("{k}: e2fsck {va:?} / rext4 {vb:?}"));
            }
            continue;
        }
        if va != vb {
            out.push(format!("{k}: e2fsck {va:?} / rext4 {vb:?}"));
        }
    }
    out
}

/// A crash copy of a kernel-mounted image (taken with `cp --sparse=always` while
/// mounted, after `work`), whose log holds at least one committed transaction.
fn crash_copy(opts: &MkfsOptions, work: &dyn Fn(&Path, u32)) -> Option<Image> {
    for attempt in 0..4 {
        let img = mkfs(opts).expect("mkfs");
        let m = match LoopMount::new(img.path(), false, "commit=60") {
            Ok(m) => m,
            Err(e) => {
                skip(&format!("needs a kernel mount: {e}"));
                return None;
            }
        };
        // An open, unlinked file: on the orphan list (or orphan file) in the copy.
        let open = std::fs::File::create(m.path().join("orphan")).expect("create");
        std::io::Write::write_all(&mut &open, &[7u8; 30_000]).expect("write");
        std::fs::remove_file(m.path().join("orphan")).expect("unlink while open");
        work(m.path(), attempt);
        let copy = img.duplicate().expect("cp --sparse=always while mounted");
        drop(open);
        m.unmount().expect("unmount");
        let r = journal::examine(&FileDevice::open(copy.path(), true, false).expect("open"))
            .expect("examine the crash copy");
        if r.transactions > 0 {
            return Some(copy);
        }
        eprintln!("attempt {attempt}: the copied log was empty; again");
    }
    panic!("the copied log was empty 4 times");
}

fn syncfs(p: &Path) {
    let ok = Command::new("sync")
        .arg("-f")
        .arg(p)
        .status()
        .expect("sync");
    assert!(ok.success(), "sync -f");
}

fn fsync(p: &Path) {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .expect("fsync");
}

/// Many files and directories, fsynced; a directory of many files created, synced and
/// removed (its freed blocks give revoke records).
fn workload(root: &Path, seed: u32) {
    for d in 0..8 {
        let dir = root.join(format!("d{d}"));
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        for i in 0..40u32 {
            let len = ((i * 977 + seed * 13) % 9000) as usize + 1;
            std::fs::write(dir.join(format!("f{i}")), vec![(i + d) as u8; len]).expect("write");
        }
        std::os::unix::fs::symlink(format!("f{d}"), dir.join("link")).expect("symlink");
        fsync(&dir.join("f0"));
    }
    let gone = root.join("gone");
    std::fs::create_dir(&gone).expect("mkdir");
    for i in 0..300 {
        std::fs::write(
            gone.join(format!("a_rather_long_file_name_{i}")),
            [1u8; 100],
        )
        .expect("write");
    }
    syncfs(root);
    std::fs::remove_dir_all(&gone).expect("rm -r");
    std::fs::write(root.join("last"), b"written after the rm -r").expect("write");
    fsync(&root.join("last"));
}

/// Recover crash copy `copy` three ways and compare: A = `e2fsck -fy`, B = bare
/// `journal::replay`, C = read-only rext4 open (replay in memory).
fn compare_with_e2fsck(copy: &Image, label: &str) -> ReplayReport {
    let a = copy.duplicate().expect("copy A");
    let b = copy.duplicate().expect("copy B");
    let c = copy.duplicate().expect("copy C");

    let r = e2fsck_fy(a.path());
    assert!(r.exit_code <= 1, "[{label}] e2fsck -fy: {}", r.output);

    let report = journal::replay(&rw_device(b.path())).expect("rext4 replay");
    assert!(
        report.needed && report.transactions > 0,
        "[{label}] {report:?}"
    );
    assert!(report.bad_checksums.is_empty(), "[{label}] {report:?}");
    let h = dumpe2fs_h(b.path()).expect("dumpe2fs");
    assert!(
        !h["Filesystem features"].contains("needs_recovery"),
        "[{label}] RECOVER still set"
    );
    assert_eq!(h["Journal start"], "0", "[{label}]");
    let d = dumpe2fs_diff(a.path(), b.path());
    assert!(
        d.is_empty(),
        "[{label}] dumpe2fs -h differs:\n{}",
        d.join("\n")
    );
    // A second replay finds nothing to do.
    let again = journal::replay(&rw_device(b.path())).expect("replay again");
    assert!(!again.needed, "[{label}] {again:?}");

    // Trees: the kernel's read-only mount of A against rext4's read of B.
    let tb = common::snapshot(&Fs::open(b.path()).expect("open B")).expect("walk B");
    match LoopMount::new(a.path(), true, "noatime") {
        Ok(m) => {
            let ta = snapshot_dir(m.path()).expect("snapshot A");
            let d = diff_trees(&ta, &tb, &Compare::exact());
            assert!(d.is_empty(), "[{label}] trees differ:\n{}", d.join("\n"));
            m.unmount().expect("unmount");
        }
        Err(e) => skip(&format!("kernel mount of the e2fsck copy: {e}")),
    }

    // C: a read-only open sees the replayed tree; the image file is unchanged.
    let before = hash_file(c.path()).expect("hash");
    let fs = Fs::open(c.path()).expect("read-only open of a crash copy");
    assert!(fs.is_read_only());
    let w = fs.warnings().join("\n");
    assert!(
        w.contains("journal replayed in memory only") && w.contains("unchanged"),
        "[{label}] {w}"
    );
    let tc = common::snapshot(&fs).expect("walk C");
    drop(fs);
    let d = diff_trees(&tb, &tc, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] in-memory replay differs:\n{}",
        d.join("\n")
    );
    assert_eq!(
        hash_file(c.path()).expect("hash"),
        before,
        "[{label}] a read-only open changed the image"
    );
    eprintln!("[{label}] {report:?}");
    report
}

/// Compare a crash copy with e2fsck's recovery until its log holds revoke records:
/// whether the kernel's log still holds the `rm -r` transaction when the copy is taken
/// depends on its commit and checkpoint timing, so a run may have to be repeated (each
/// run is compared in full; three runs without revokes fail the test).
fn compare_with_revokes(opts: &MkfsOptions, label: &str) {
    for attempt in 1..=3 {
        let Some(copy) = crash_copy(opts, &workload) else {
            return;
        };
        let r = compare_with_e2fsck(&copy, label);
        if r.revoke_records > 0 {
            return;
        }
        eprintln!("[{label}] run {attempt}: the copied log has no revoke records; again");
    }
    panic!("[{label}] no revoke records in the kernel's log in 3 runs");
}

#[test]
fn bare_replay_matches_e2fsck_1k() {
    compare_with_revokes(&MkfsOptions::new(1024, 64 << 20), "1k debian");
}

#[test]
fn bare_replay_matches_e2fsck_4k() {
    compare_with_revokes(&MkfsOptions::new(4096, 128 << 20), "4k debian");
}

#[test]
fn bare_replay_matches_e2fsck_upstream() {
    for bs in [1024, 4096] {
        let opts = MkfsOptions::new(bs, 64 << 20).upstream(true);
        if let Some(copy) = crash_copy(&opts, &workload) {
            compare_with_e2fsck(&copy, &format!("{bs} upstream"));
        }
    }
}

// ---------------------------------------------------------------------------------
// A log that wraps around the end of the journal (1 KiB blocks, 1024-block journal).
// ---------------------------------------------------------------------------------

#[test]
fn wrapped_kernel_log_matches_e2fsck() {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "commit=60") {
        Ok(m) => m,
        Err(e) => return skip(&format!("needs a kernel mount: {e}")),
    };
    let open = std::fs::File::create(m.path().join("orphan")).expect("create");
    std::io::Write::write_all(&mut &open, &[7u8; 3000]).expect("write");
    std::fs::remove_file(m.path().join("orphan")).expect("unlink while open");
    let mut found = None;
    for i in 0..3000u32 {
        let p = m.path().join(format!("w{}", i % 400));
        std::fs::write(&p, vec![i as u8; (i as usize * 131) % 5000 + 1]).expect("write");
        fsync(&p);
        if i % 5 != 4 {
            continue;
        }
        let live = FileDevice::open(img.path(), true, false).expect("open live image");
        if journal::examine(&live).is_ok_and(|r| r.wrapped()) {
            let copy = img.duplicate().expect("cp while mounted");
            let r = journal::examine(&FileDevice::open(copy.path(), true, false).expect("open"))
                .expect("examine copy");
            if r.wrapped() {
                found = Some(copy);
                break;
            }
        }
    }
    drop(open);
    m.unmount().expect("unmount");
    let copy = found.expect("no wrapped log in 3000 fsyncs");
    let r = compare_with_e2fsck(&copy, "1k wrapped");
    assert!(r.wrapped(), "{r:?}");
}

// ---------------------------------------------------------------------------------
// Damaged logs: stale ends, corrupt transactions, bad data-block checksums.
// ---------------------------------------------------------------------------------

/// The journal of an image: map, superblock, and the scan of its log.
fn layout(p: &Path) -> (JournalMap, JournalSuperblock, jbd2::ScanResult) {
    let dev = FileDevice::open(p, true, false).expect("open");
    let mut raw = vec![0u8; 1024];
    dev.read_at(&mut raw, SB_OFFSET).expect("read sb");
    let sb = Superblock::decode(&raw).expect("sb");
    let map = JournalMap::locate(&dev, &sb).expect("locate journal");
    let bs = sb.block_size() as usize;
    let mut b = vec![0u8; bs];
    map.read(&dev, 0, &mut b).expect("read jsb");
    let jsb = JournalSuperblock::decode(&b).expect("jsb");
    let mut s = Scanner::new(&jsb);
    while let Some(pos) = s.next() {
        map.read(&dev, u64::from(pos.0), &mut b).expect("read log");
        s.feed(&b);
    }
    (map, jsb, s.finish().expect("scan"))
}

/// Apply `f` to journal block `j` of the image file.
fn patch_journal_block(p: &Path, map: &JournalMap, j: u32, f: impl FnOnce(&mut [u8])) {
    let dev = rw_device(p);
    let mut b = vec![0u8; block_size_of(p) as usize];
    map.read(&dev, u64::from(j), &mut b).expect("read");
    f(&mut b);
    map.write(&dev, u64::from(j), &b).expect("write");
}

fn block_size_of(p: &Path) -> u32 {
    rext4_testkit::image_block_size(p).expect("block size")
}

fn expect_corrupt(p: &Path, tid: u32, what: &str) {
    let before = hash_file(p).expect("hash");
    let err = journal::replay(&rw_device(p)).expect_err(what);
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("journal transaction {tid} is corrupt")),
        "{what}: {msg}"
    );
    let opts = FsOptions {
        read_only: false,
        ..FsOptions::default()
    };
    assert!(Fs::open_with(p, opts).is_err(), "{what}: rw open succeeded");
    assert!(Fs::open(p).is_err(), "{what}: ro open succeeded");
    assert_eq!(hash_file(p).expect("hash"), before, "{what}: image changed");
}

#[test]
fn damaged_kernel_logs() {
    let Some(copy) = crash_copy(&MkfsOptions::new(1024, 64 << 20), &workload) else {
        return;
    };
    let (map, jsb, scan) = layout(copy.path());
    let n = scan.transactions.len();
    assert!(n >= 2, "{n} transactions");
    let last = scan.transactions[n - 1].clone();
    let prev = scan.transactions[n - 2].clone();
    let (first, end) = (jsb.first, jsb.log_last());
    let fmt = jsb.log_format();
    let bs = block_size_of(copy.path()) as usize;
    let first_data = last.blocks.first().expect("last transaction logs blocks");
    // The block before `p` in the circular log.
    let prev_pos = |p: jbd2::LogPos| jbd2::LogPos(if p.0 == first { end - 1 } else { p.0 - 1 });
    // The descriptor right before the first data block of the last transaction, and
    // the commit block right before the log's head.
    let desc = prev_pos(first_data.log_block);
    let commit = prev_pos(scan.head);
    {
        let dev = FileDevice::open(copy.path(), true, false).expect("open");
        let mut b = vec![0u8; bs];
        map.read(&dev, u64::from(desc.0), &mut b).expect("read");
        assert!(
            matches!(
                jbd2::classify(&b, last.sequence, &fmt),
                BlockKind::Descriptor { .. }
            ),
            "block {} is not the descriptor",
            desc.0
        );
        map.read(&dev, u64::from(commit.0), &mut b).expect("read");
        assert!(
            matches!(
                jbd2::classify(&b, last.sequence, &fmt),
                BlockKind::Commit { .. }
            ),
            "block {} is not the commit block",
            commit.0
        );
    }

    // 1. A flipped byte in the last descriptor, commit time not older: corrupt.
    let c1 = copy.duplicate().expect("copy");
    patch_journal_block(c1.path(), &map, desc.0, |b| b[bs - 40] ^= 0x5A);
    expect_corrupt(c1.path(), last.sequence, "descriptor");

    // 2. A flipped byte in the last commit block: corrupt.
    let c2 = copy.duplicate().expect("copy");
    patch_journal_block(c2.path(), &map, commit.0, |b| b[200] ^= 0x01);
    expect_corrupt(c2.path(), last.sequence, "commit block");

    // 3. The same descriptor damage with a commit time older than the previous
    //    commit's: stale, the log ends before the last transaction.
    let c3 = copy.duplicate().expect("copy");
    patch_journal_block(c3.path(), &map, desc.0, |b| b[bs - 40] ^= 0x5A);
    patch_journal_block(c3.path(), &map, commit.0, |b| {
        CommitBlock::new(last.sequence, prev.commit_sec - 1, 0)
            .encode(b, &fmt)
            .expect("encode commit");
    });
    let r = journal::replay(&rw_device(c3.path())).expect("stale end replays");
    assert_eq!(r.transactions, n - 1, "{r:?}");
    assert_eq!(r.end, jbd2::LogEnd::Stale, "{r:?}");
    assert_eq!(r.new_sequence, last.sequence + 1, "{r:?}");
    let fs = Fs::open(c3.path()).expect("open after a stale-ended replay");
    common::snapshot(&fs).expect("readable tree");

    // 4. A flipped byte in a data block of the last transaction: that block is
    //    skipped, the rest replayed, the filesystem marked with errors.
    let c4 = copy.duplicate().expect("copy");
    let victim = scan
        .replay_plan()
        .into_iter()
        .rev()
        .find(|w| w.sequence == last.sequence)
        .expect("a replayed block of the last transaction");
    patch_journal_block(c4.path(), &map, victim.log_block.0, |b| b[100] ^= 0xFF);
    let opts = FsOptions {
        read_only: false,
        ..FsOptions::default()
    };
    let fs = Fs::open_with(c4.path(), opts).expect("rw open replays around a bad block");
    let w = fs.warnings().join("\n");
    assert!(
        w.contains("checksum failed") && w.contains(&format!("block {}", victim.tag.blocknr)),
        "{w}"
    );
    drop(fs);
    let mut raw = vec![0u8; 1024];
    FileDevice::open(c4.path(), true, false)
        .expect("open")
        .read_at(&mut raw, SB_OFFSET)
        .expect("read");
    let sb = Superblock::decode(&raw).expect("sb");
    assert!(sb.state & STATE_ERROR != 0, "ERROR_FS not set");
    assert!(!sb.has_incompat(feature::INCOMPAT_RECOVER));
}

// ---------------------------------------------------------------------------------
// Hand-built logs: the formats the kernel does not write (CSUM_V2, 32-bit tags, no
// checksums), escaping, revokes and wrap-around, replayed by rext4 and by e2fsck.
// ---------------------------------------------------------------------------------

/// One synthetic transaction: the homes it revokes, then (home, data) it logs.
type SyntheticTx<'a> = (Vec<u64>, Vec<(u64, &'a Vec<u8>)>);

/// A data block for the synthetic log; `magic` makes it start with the jbd2 magic.
fn data_block(bs: usize, fill: u8, magic: bool) -> Vec<u8> {
    let mut b = vec![fill; bs];
    if magic {
        b[..4].copy_from_slice(&jbd2::JBD2_MAGIC.to_be_bytes());
    }
    b
}

/// Write a log of three transactions (starting near the end of the journal, so it
/// wraps) into `img` and set RECOVER. Returns (home blocks, expected contents, the
/// first tid).
fn build_log(img: &mut [u8], features: Features) -> (Vec<u64>, Vec<Vec<u8>>, u32) {
    let o = SB_OFFSET as usize;
    let sb = Superblock::decode(&img[o..o + 1024]).expect("sb");
    let bs = sb.block_size() as usize;
    let dev = MemDevice::new(img.to_vec());
    let map = JournalMap::locate(&dev, &sb).expect("locate");
    let mut b = vec![0u8; bs];
    map.read(&dev, 0, &mut b).expect("jsb");
    let mut jsb = JournalSuperblock::decode(&b).expect("jsb");
    jsb.feature_incompat = features.incompat | jbd2::INCOMPAT_REVOKE;
    jsb.checksum_type = if features.csum_v2or3() {
        jbd2::CHECKSUM_TYPE_CRC32C
    } else {
        0
    };
    let seq0 = 1000;
    jsb.sequence = seq0;
    jsb.start = jsb.log_last() - 3;
    let fmt: LogFormat = jsb.log_format();
    let (first, last) = (jsb.first, jsb.log_last());
    // Free blocks at the end of the filesystem (never allocated by mkfs).
    let homes: Vec<u64> = (0..4).map(|k| sb.blocks_count - 20 + k).collect();
    let original = {
        let mut v = vec![0u8; bs];
        dev.read_at(&mut v, homes[2] * bs as u64)
            .expect("read home");
        v
    };
    let a = data_block(bs, 0xA1, true);
    let c = data_block(bs, 0xC3, false);
    let d = data_block(bs, 0xD4, true);
    let e = data_block(bs, 0xE5, false);
    let f = data_block(bs, 0xF6, false);
    // tid -> (revoked homes, logged (home, data))
    let txs: Vec<SyntheticTx> = vec![
        (
            vec![],
            vec![
                (homes[0], &a),
                (homes[1], &c),
                (homes[2], &c),
                (homes[3], &f),
            ],
        ),
        (vec![homes[1], homes[2]], vec![(homes[2], &d)]),
        (vec![], vec![(homes[1], &e)]),
    ];
    let mut pos = jbd2::LogPos(jsb.start);
    let put = |blk: &[u8], pos: &mut jbd2::LogPos| {
        map.write(&dev, u64::from(pos.0), blk).expect("write log");
        *pos = jbd2::next_block(*pos, first, last);
    };
    for (k, (revoked, logged)) in txs.iter().enumerate() {
        let tid = seq0 + k as u32;
        if !revoked.is_empty() {
            let mut r = vec![0u8; bs];
            let n = jbd2::encode_revoke(&mut r, tid, revoked, &fmt).expect("revoke");
            assert_eq!(n, revoked.len());
            put(&r, &mut pos);
        }
        let mut tags = Vec::new();
        let mut stored = Vec::new();
        for (home, data) in logged {
            let mut s = data.to_vec();
            let escaped = jbd2::escape(&mut s);
            tags.push(Tag {
                blocknr: *home,
                flags: if escaped { jbd2::TAG_FLAG_ESCAPE } else { 0 },
                csum: jbd2::tag_csum_field(&fmt, tid, &s),
            });
            stored.push(s);
        }
        let mut desc = vec![0u8; bs];
        let n = jbd2::encode_descriptor(&mut desc, tid, &tags, &jsb.uuid, &fmt).expect("desc");
        assert_eq!(n, tags.len());
        put(&desc, &mut pos);
        for s in &stored {
            put(s, &mut pos);
        }
        let mut cb = vec![0u8; bs];
        CommitBlock::new(tid, 1_700_000_000 + k as u64, 0)
            .encode(&mut cb, &fmt)
            .expect("commit");
        put(&cb, &mut pos);
    }
    jsb.update_checksum();
    map.read(&dev, 0, &mut b).expect("jsb block");
    jsb.encode(&mut b[..jbd2::SB_SIZE]).expect("encode jsb");
    map.write(&dev, 0, &b).expect("write jsb");
    let mut bytes = dev.snapshot();
    let mut s = Superblock::decode(&bytes[o..o + 1024]).expect("sb");
    s.feature_incompat |= feature::INCOMPAT_RECOVER;
    s.encode_into(&mut bytes[o..o + 1024]);
    img.copy_from_slice(&bytes);
    // h0: A (escaped in the log, restored); h1: revoked in tid 1, logged again in
    // tid 2 → E; h2: logged in tid 0 and 1, revoked in tid 1 → untouched; h3: F.
    (homes, vec![a, e, original, f], seq0)
}

#[test]
fn synthetic_logs_replay_like_e2fsck() {
    let v2_32 = Features {
        incompat: jbd2::INCOMPAT_CSUM_V2,
        ..Features::default()
    };
    let v3_64 = Features {
        incompat: jbd2::INCOMPAT_CSUM_V3 | jbd2::INCOMPAT_64BIT,
        ..Features::default()
    };
    let v2_64 = Features {
        incompat: jbd2::INCOMPAT_CSUM_V2 | jbd2::INCOMPAT_64BIT,
        ..Features::default()
    };
    let plain = Features::default();
    for bs in [1024u32, 4096] {
        let base = mkfs(&MkfsOptions::new(bs, 16 << 20)).expect("mkfs");
        for (name, features) in [
            ("v2", v2_32),
            ("v3/64", v3_64),
            ("v2/64", v2_64),
            ("none", plain),
        ] {
            let label = format!("{bs} {name}");
            let mut img = std::fs::read(base.path()).expect("read image");
            let (homes, want, seq0) = build_log(&mut img, features);

            let dev = MemDevice::new(img.clone());
            let r = journal::replay(&dev).expect("replay");
            assert_eq!(r.transactions, 3, "[{label}] {r:?}");
            assert!(r.wrapped(), "[{label}] {r:?}");
            assert_eq!(r.revoke_records, 2, "[{label}] {r:?}");
            assert_eq!(r.revoke_hits, 3, "[{label}] {r:?}");
            assert_eq!(r.blocks_replayed, 3, "[{label}] {r:?}");
            assert_eq!(r.new_sequence, seq0 + 4, "[{label}] {r:?}");
            let ours = dev.snapshot();
            for (h, w) in homes.iter().zip(&want) {
                let at = (*h * u64::from(bs)) as usize;
                assert!(ours[at..at + bs as usize] == w[..], "[{label}] block {h}");
            }

            // e2fsck replays the same log to the same bytes.
            let tmp = rext4_testkit::TempDir::new("synth").expect("tmp");
            let (pa, pb) = (tmp.join("a.img"), tmp.join("b.img"));
            std::fs::write(&pa, &img).expect("write");
            std::fs::write(&pb, &ours).expect("write");
            let fy = e2fsck_fy(&pa);
            assert!(fy.exit_code <= 1, "[{label}] e2fsck -fy: {}", fy.output);
            let theirs = std::fs::read(&pa).expect("read");
            for h in &homes {
                let at = (*h * u64::from(bs)) as usize;
                assert!(
                    ours[at..at + bs as usize] == theirs[at..at + bs as usize],
                    "[{label}] block {h}: rext4 and e2fsck disagree"
                );
            }
            let fnr = e2fsck_fn(&pb);
            assert!(
                fnr.clean,
                "[{label}] e2fsck -fn after rext4: {}",
                fnr.output
            );
            let d = dumpe2fs_diff(&pa, &pb);
            assert!(
                d.is_empty(),
                "[{label}] dumpe2fs -h differs:\n{}",
                d.join("\n")
            );
        }
    }
}
