//! Fast-commit replay of kernel crash copies: images made with `mke2fs -O
//! fast_commit`, written by the kernel with every change fsynced so that it goes out
//! as a fast commit, and copied while still mounted. rext4's replay (read-write, and
//! read-only in memory) gives the tree e2fsck's replay (`e2fsck -fy` of another copy)
//! gives, e2fsck -fn finds it clean and the kernel mounts and writes it. New
//! directories, which e2fsck 1.47.0 cannot replay ("No free space in the directory":
//! it links into a directory it gave no block), are compared with the kernel's own
//! replay instead (after e2fsck -fy, which fixes the link counts and i_blocks the
//! kernel leaves wrong there). Damaged fast-commit areas fail with a clear error, or
//! end at the last whole fast commit, and never change the image when refused.
//!
//! The trees are compared, not dumpe2fs: rext4's result differs from e2fsck's in two
//! ways, both on purpose. An inode that a new file took over within the fast commits
//! (a new generation in its INODE record) loses the old file's blocks in rext4's
//! replay; e2fsck (and the kernel) keep them mapped, past the new file's end. And
//! e2fsck writes the block bitmaps of BLOCK_UNINIT groups, which rext4 leaves
//! uninitialized.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use rext4::device::{BlockDevice, FileDevice};
use rext4::format::jbd2::JournalSuperblock;
use rext4::format::superblock::{Superblock, SB_OFFSET};
use rext4::journal::{self, JournalMap};
use rext4::{Fs, FsOptions};
use rext4_testkit::tree::{hash_file, Tree};
use rext4_testkit::{
    diff_trees, e2fsck_fn, e2fsck_fy, mkfs, skip, snapshot_dir, Compare, Image, LoopMount,
    MkfsOptions,
};

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

fn fsync(p: &Path) {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .expect("fsync");
}

fn syncfs(p: &Path) {
    let ok = std::process::Command::new("sync")
        .arg("-f")
        .arg(p)
        .status()
        .expect("sync");
    assert!(ok.success(), "sync -f");
}

/// What the fast commits of a crash copy hold: the names of their records.
fn record_names(copy: &Path) -> BTreeSet<&'static str> {
    let r = journal::examine(&FileDevice::open(copy, true, false).expect("open"))
        .expect("examine the crash copy");
    r.fast_commits.iter().map(|t| t.name()).collect()
}

/// A crash copy of a kernel-mounted fast_commit image: `prepare` runs and is synced
/// (a full commit), then `work` (whose fsyncs go out as fast commits), then the image
/// is copied while mounted. `None` (skipped) without kernel mounts.
fn fc_crash_copy(
    opts: &MkfsOptions,
    prepare: &dyn Fn(&Path),
    work: &dyn Fn(&Path),
) -> Option<Image> {
    for attempt in 0..4 {
        let img = mkfs(opts).expect("mkfs -O fast_commit");
        let m = match LoopMount::new(img.path(), false, "commit=60") {
            Ok(m) => m,
            Err(e) => {
                skip(&format!("needs a kernel mount: {e}"));
                return None;
            }
        };
        prepare(m.path());
        syncfs(m.path());
        work(m.path());
        let copy = img.duplicate().expect("cp --sparse=always while mounted");
        m.unmount().expect("unmount");
        let r = journal::examine(&FileDevice::open(copy.path(), true, false).expect("open"))
            .expect("examine the crash copy");
        if !r.fast_commits.is_empty() {
            return Some(copy);
        }
        eprintln!("attempt {attempt}: no fast commit in the copy ({r:?}); again");
    }
    panic!("no fast commit in the crash copy 4 times");
}

fn fs_opts(bs: u32) -> MkfsOptions {
    MkfsOptions::new(bs, 64 << 20).arg("-O").arg("fast_commit")
}

fn prepare_files(root: &Path) {
    std::fs::create_dir_all(root.join("d/sub")).expect("mkdir");
    std::fs::write(root.join("d/old"), b"to be unlinked").expect("write");
    std::fs::write(root.join("keep"), b"to be renamed").expect("write");
    std::fs::write(root.join("big"), vec![0xB1u8; 200 * 1024]).expect("write");
    std::fs::write(root.join("grow"), vec![0x61u8; 5000]).expect("write");
}

/// File changes only, each fsynced: creates (many at once: more records than a block
/// holds, so PAD), appends, overwrites, truncates down and up, a rename, a hard link,
/// an unlink whose inode a new file takes.
fn work_files(root: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    std::fs::remove_file(root.join("d/old")).expect("unlink");
    for i in 0..40u32 {
        std::fs::write(
            root.join(format!("d/f{i}")),
            vec![i as u8; 100 + i as usize * 300],
        )
        .expect("write");
    }
    fsync(&root.join("d/f7"));
    let mut g = std::fs::OpenOptions::new()
        .append(true)
        .open(root.join("grow"))
        .expect("open");
    g.write_all(&vec![0x62u8; 70_000]).expect("append");
    g.sync_all().expect("fsync");
    let mut b = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("big"))
        .expect("open");
    b.seek(SeekFrom::Start(10)).expect("seek");
    b.write_all(b"overwritten in place").expect("write");
    b.seek(SeekFrom::Start(300 * 1024)).expect("seek");
    b.write_all(b"past the end, a hole before").expect("write");
    b.sync_all().expect("fsync");
    b.set_len(50_001).expect("truncate down");
    b.sync_all().expect("fsync");
    b.set_len(90_000).expect("truncate up");
    b.sync_all().expect("fsync");
    std::fs::rename(root.join("keep"), root.join("kept")).expect("rename");
    fsync(&root.join("kept"));
    std::fs::hard_link(root.join("d/f3"), root.join("d/sub/f3-link")).expect("link");
    fsync(&root.join("d/f3"));
    std::fs::write(root.join("last"), b"written after everything").expect("write");
    fsync(&root.join("last"));
}

/// New directories, nested, with files in them; fsynced files.
fn work_dirs(root: &Path) {
    std::fs::create_dir(root.join("nd")).expect("mkdir");
    std::fs::create_dir(root.join("nd/inner")).expect("mkdir");
    for i in 0..30u32 {
        std::fs::write(
            root.join(format!("nd/inner/f{i}")),
            vec![i as u8; 1 + i as usize * 77],
        )
        .expect("write");
    }
    fsync(&root.join("nd/inner/f29"));
    std::fs::write(root.join("nd/x"), b"xx").expect("write");
    fsync(&root.join("nd/x"));
}

/// rext4's read-write replay of a copy of `copy`: warnings, and e2fsck -fn clean.
fn rext4_replay(copy: &Image, label: &str) -> Image {
    let b = copy.duplicate().expect("copy");
    let fs = Fs::open_with(b.path(), rw()).expect("rext4 replays the fast commits");
    let w = fs.warnings().join("\n");
    assert!(
        w.contains("journal replayed") && w.contains("fast commits replayed"),
        "[{label}] {w}"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(b.path());
    assert!(
        r.clean,
        "[{label}] e2fsck -fn after rext4's replay:\n{}",
        r.output
    );
    b
}

fn snapshot(p: &Path) -> Tree {
    common::snapshot(&Fs::open(p).expect("open")).expect("walk")
}

/// The read-only open replays in memory: the same tree, the image unchanged.
fn check_read_only_replay(copy: &Image, want: &Tree, label: &str) {
    let c = copy.duplicate().expect("copy");
    let before = hash_file(c.path()).expect("hash");
    let fs = Fs::open(c.path()).expect("read-only open of a fast-commit crash copy");
    let w = fs.warnings().join("\n");
    assert!(
        w.contains("in memory only") && w.contains("fast commits replayed"),
        "[{label}] {w}"
    );
    let t = common::snapshot(&fs).expect("walk");
    drop(fs);
    let d = diff_trees(want, &t, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] in-memory replay:\n{}",
        d.join("\n")
    );
    assert_eq!(
        hash_file(c.path()).expect("hash"),
        before,
        "[{label}] a read-only open changed the image"
    );
}

/// The kernel mounts rext4's result, sees the same tree, writes on; e2fsck clean.
fn kernel_takes_over(img: &Image, want: &Tree, label: &str) {
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("[{label}] kernel mount: {e}")),
    };
    let k = snapshot_dir(m.path()).expect("kernel snapshot");
    let d = diff_trees(want, &k, &Compare::exact());
    assert!(d.is_empty(), "[{label}] rext4 vs kernel:\n{}", d.join("\n"));
    std::fs::write(m.path().join("after-rext4"), vec![9u8; 12_345]).expect("kernel write");
    m.unmount().expect("unmount");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "[{label}] e2fsck after the kernel:\n{}", r.output);
}

fn replay_like_e2fsck(bs: u32) {
    let label = format!("{bs} files");
    let Some(copy) = fc_crash_copy(&fs_opts(bs), &prepare_files, &work_files) else {
        return;
    };
    let names = record_names(copy.path());
    eprintln!("[{label}] fast-commit records: {names:?}");
    for want in [
        "HEAD",
        "INODE",
        "ADD_RANGE",
        "DEL_RANGE",
        "CREAT",
        "LINK",
        "UNLINK",
        "PAD",
        "TAIL",
    ] {
        assert!(
            names.contains(want),
            "[{label}] no {want} record in {names:?}"
        );
    }
    let a = copy.duplicate().expect("copy");
    let fy = e2fsck_fy(a.path());
    assert!(fy.exit_code <= 1, "[{label}] e2fsck -fy: {}", fy.output);
    let b = rext4_replay(&copy, &label);
    let (ta, tb) = (snapshot(a.path()), snapshot(b.path()));
    let d = diff_trees(&ta, &tb, &Compare::exact());
    assert!(
        d.is_empty(),
        "[{label}] e2fsck vs rext4:\n{}\ne2fsck -fy said:\n{}",
        d.join("\n"),
        fy.output
    );
    for p in ["kept", "last", "d/f39", "d/sub/f3-link", "grow", "big"] {
        assert!(tb.contains_key(p.as_bytes()), "[{label}] {p} missing");
    }
    assert!(!tb.contains_key(&b"d/old"[..]) && !tb.contains_key(&b"keep"[..]));
    let fs = Fs::open(b.path()).expect("open");
    assert_eq!(fs.metadata("/big").expect("stat").len(), 90_000);
    let big = fs.read("/big").expect("read");
    assert_eq!(&big[10..30], b"overwritten in place");
    assert!(
        big[50_001..].iter().all(|&x| x == 0),
        "truncate up left bytes"
    );
    assert_eq!(fs.read("/grow").expect("read").len(), 75_000);
    drop(fs);
    check_read_only_replay(&copy, &tb, &label);
    kernel_takes_over(&b, &tb, &label);
}

#[test]
fn kernel_fast_commits_replay_like_e2fsck_4k() {
    replay_like_e2fsck(4096);
}

#[test]
fn kernel_fast_commits_replay_like_e2fsck_1k() {
    replay_like_e2fsck(1024);
}

/// Directory times and link counts aside (the kernel's replay stamps the directories
/// it links into with the time of the replay, and e2fsck's repair after it counts
/// links as they are).
fn without_dir_times(mut t: Tree) -> Tree {
    for n in t.values_mut() {
        if n.kind == rext4_testkit::tree::Kind::Dir {
            n.mtime = (0, 0);
            n.ctime = (0, 0);
        }
    }
    t
}

#[test]
fn kernel_fast_commits_of_new_directories_replay_like_the_kernel() {
    let label = "new directories";
    let Some(copy) = fc_crash_copy(&fs_opts(4096), &prepare_files, &work_dirs) else {
        return;
    };
    let names = record_names(copy.path());
    assert!(
        names.contains("CREAT") && names.contains("INODE"),
        "{names:?}"
    );
    let k = copy.duplicate().expect("copy");
    match LoopMount::new(k.path(), false, "noatime") {
        Ok(m) => m.unmount().expect("unmount"),
        Err(e) => return skip(&format!("kernel replay: {e}")),
    }
    let fy = e2fsck_fy(k.path());
    assert!(
        fy.exit_code <= 1,
        "e2fsck -fy after the kernel: {}",
        fy.output
    );
    let b = rext4_replay(&copy, label);
    let tb = snapshot(b.path());
    let d = diff_trees(
        &without_dir_times(snapshot(k.path())),
        &without_dir_times(tb.clone()),
        &Compare::exact(),
    );
    assert!(d.is_empty(), "kernel vs rext4:\n{}", d.join("\n"));
    assert!(tb.contains_key(&b"nd/inner/f29"[..]) && tb.contains_key(&b"nd/x"[..]));
    assert_eq!(tb[&b"nd"[..]].nlink, 3, "nd has one subdirectory");
    check_read_only_replay(&copy, &tb, label);
    kernel_takes_over(&b, &tb, label);
}

/// Journal block `j` of the image file, through `f`.
fn patch_journal_block(p: &Path, j: u32, f: impl FnOnce(&mut [u8])) {
    let dev = FileDevice::open(p, false, false).expect("open");
    let mut raw = vec![0u8; 1024];
    dev.read_at(&mut raw, SB_OFFSET).expect("read sb");
    let sb = Superblock::decode(&raw).expect("sb");
    let map = JournalMap::locate(&dev, &sb).expect("journal");
    let mut b = vec![0u8; sb.block_size() as usize];
    map.read(&dev, u64::from(j), &mut b).expect("read");
    f(&mut b);
    map.write(&dev, u64::from(j), &b).expect("write");
}

/// The journal block of the fast-commit area's first block.
fn fc_first_block(p: &Path) -> u32 {
    let dev = FileDevice::open(p, true, false).expect("open");
    let mut raw = vec![0u8; 1024];
    dev.read_at(&mut raw, SB_OFFSET).expect("read sb");
    let sb = Superblock::decode(&raw).expect("sb");
    let map = JournalMap::locate(&dev, &sb).expect("journal");
    let mut b = vec![0u8; sb.block_size() as usize];
    map.read(&dev, 0, &mut b).expect("read");
    JournalSuperblock::decode(&b).expect("jsb").log_last() + 1
}

/// Damage in the first fast commit (a flipped byte, a length past its block) fails
/// every open with the reason and changes nothing; damage after a whole fast commit
/// ends the area there (what came before is replayed, e2fsck clean).
#[test]
fn damaged_fast_commit_areas() {
    let Some(copy) = fc_crash_copy(&fs_opts(4096), &prepare_files, &work_files) else {
        return;
    };
    let first = fc_first_block(copy.path());
    let refused = |p: &Path, what: &str| {
        let before = hash_file(p).expect("hash");
        for opts in [FsOptions::default(), rw()] {
            let e = Fs::open_with(p, opts).err().expect(what);
            let msg = e.to_string();
            assert!(
                msg.contains("fast commits of journal transaction") && msg.contains("corrupt"),
                "{what}: {msg}"
            );
        }
        assert_eq!(hash_file(p).expect("hash"), before, "{what}: image changed");
    };
    // A flipped byte in the first record after HEAD: the first TAIL's checksum fails.
    let c = copy.duplicate().expect("copy");
    patch_journal_block(c.path(), first, |b| b[40] ^= 0x10);
    refused(c.path(), "a flipped byte");
    // HEAD's length runs past its block.
    let c = copy.duplicate().expect("copy");
    patch_journal_block(c.path(), first, |b| {
        b[2] = 0xFF;
        b[3] = 0xFF;
    });
    refused(c.path(), "an absurd length");
    // The last block of the area's fast commits damaged: the ones before it replay.
    let whole = journal::examine(&FileDevice::open(copy.path(), true, false).expect("open"))
        .expect("examine");
    assert!(whole.fast_commit_count >= 2, "{whole:?}");
    let mut last = first;
    {
        let dev = FileDevice::open(copy.path(), true, false).expect("open");
        let mut raw = vec![0u8; 1024];
        dev.read_at(&mut raw, SB_OFFSET).expect("read sb");
        let sb = Superblock::decode(&raw).expect("sb");
        let map = JournalMap::locate(&dev, &sb).expect("journal");
        let mut b = vec![0u8; sb.block_size() as usize];
        // The last block whose first record is not a stale one: the scan's end.
        for j in first..first + 64 {
            if map.read(&dev, u64::from(j), &mut b).is_err() {
                break;
            }
            let tag = u16::from_le_bytes([b[0], b[1]]);
            if !(1..=9).contains(&tag) || (j > first && tag == 9) {
                break;
            }
            last = j;
        }
    }
    assert!(last > first, "the fast commits fill one block");
    let c = copy.duplicate().expect("copy");
    patch_journal_block(c.path(), last, |b| b[8] ^= 0x01);
    let cut = journal::examine(&FileDevice::open(c.path(), true, false).expect("open"))
        .expect("a damaged last fast commit ends the area");
    assert!(
        cut.fast_commit_count < whole.fast_commit_count && cut.fast_commit_count > 0,
        "{} of {}",
        cut.fast_commit_count,
        whole.fast_commit_count
    );
    let fs = Fs::open_with(c.path(), rw()).expect("replays the whole fast commits");
    fs.close().expect("close");
    let r = e2fsck_fn(c.path());
    assert!(r.clean, "e2fsck after a cut replay:\n{}", r.output);
}

/// The replay is one commit of rext4's journal that replaces the fast commits: a
/// crash anywhere in it (at every flush of the open and close that replay, and with
/// writes since the last flush lost at random) leaves an image whose next open
/// replays to the same tree, e2fsck -fn clean.
#[test]
fn a_crash_anywhere_in_the_replay_replays_to_the_same_tree() {
    use rext4_testkit::crash::{flush_points, image_at, Event, Rng};
    use std::sync::Arc;
    let Some(copy) = fc_crash_copy(
        &MkfsOptions::new(4096, 32 << 20)
            .arg("-O")
            .arg("fast_commit"),
        &prepare_files,
        &work_files,
    ) else {
        return;
    };
    let want = snapshot(rext4_replay(&copy, "crash").path());
    let base = std::fs::read(copy.path()).expect("read copy");
    let dev = Arc::new(common::Recorder::new(base.clone()));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(dev.clone(), opts.clone()).expect("replaying open");
    fs.close().expect("close");
    drop(fs);
    let events = dev.take();
    let points = flush_points(&events);
    assert!(points.len() >= 4, "{} flushes", points.len());
    let mut rng = Rng(0x5EED);
    let scratch = rext4_testkit::TempDir::new("fc-crash").expect("temp dir");
    let mut checked = 0;
    for (k, &fp) in points.iter().enumerate() {
        let next = points.get(k + 1).copied().unwrap_or(events.len());
        for variant in 0..2 {
            let mut img = image_at(&base, &events, fp);
            if variant == 1 {
                // Writes since the flush: each lost or made, whole.
                for e in &events[fp..next] {
                    if let Event::Write { offset, data } = e {
                        if rng.below(2) == 0 {
                            let o = *offset as usize;
                            img[o..o + data.len()].copy_from_slice(data);
                        }
                    }
                }
            }
            let p = scratch.join("crash.img");
            std::fs::write(&p, &img).expect("write image");
            drop(img);
            let label = format!("flush {k} of {}, variant {variant}", points.len());
            let fs = Fs::open_with(&p, opts.clone())
                .unwrap_or_else(|e| panic!("[{label}] open after the crash: {e}"));
            fs.close().expect("close");
            drop(fs);
            let r = e2fsck_fn(&p);
            assert!(r.clean, "[{label}] e2fsck -fn:\n{}", r.output);
            let d = diff_trees(&want, &snapshot(&p), &Compare::exact());
            assert!(d.is_empty(), "[{label}] tree:\n{}", d.join("\n"));
            checked += 1;
        }
    }
    eprintln!("{checked} crash images of the replay recover to the same tree");
}
