//! Lazy checkpoint and revoke records (jwrite's module note): an fsync costs two device
//! flushes, committed metadata waits in the log, and a logged metadata block that is
//! freed and reused for file data is revoked, so no recoverer (rext4, e2fsck, the
//! kernel) writes its old logged copy over the data.

mod common;

use std::sync::Arc;

use common::{Hooked, Hooks, Recorder};
use rext4::device::MemDevice;
use rext4::Fs;
use rext4_testkit::crash::Event;
use rext4_testkit::{e2fsck_fn, fixture_bytes, skip, TempDir};

use common::{base_image, blocks_of, open_device_rw as rw, recover};

fn flushes(dev: &Recorder) -> usize {
    dev.events
        .lock()
        .expect("events")
        .iter()
        .filter(|e| matches!(e, Event::Flush))
        .count()
}

/// Small files written and fsynced one by one cost two device flushes per fsync (the
/// one that makes the log blocks and the data durable before the commit block, and
/// the commit block's), where committing and checkpointing at once cost four; only the
/// fsync that finds the log full (here a 1024-block journal, every hundred or so
/// fsyncs) pays two more for the checkpoint.
#[test]
fn an_fsync_costs_two_flushes() {
    let dev = Arc::new(Recorder::new(base_image(4096, 64 << 20)));
    let fs = rw(dev.clone());
    fs.create_dir("/d").expect("mkdir");
    fs.sync().expect("sync");
    let mut counts = Vec::new();
    for i in 0..300 {
        let f = fs.create(format!("/d/f{i}")).expect("create");
        f.write_all_at(&fixture_bytes(i, 4096), 0).expect("write");
        let before = flushes(&dev);
        f.sync_all().expect("fsync");
        counts.push(flushes(&dev) - before);
        // The recorder keeps every write: drop them, only flushes are counted.
        dev.take();
    }
    let total: usize = counts.iter().sum();
    let over: Vec<(usize, usize)> = counts
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, n)| *n > 2)
        .collect();
    eprintln!(
        "device flushes per fsync: {total} for {} fsyncs; more than two in {over:?}",
        counts.len()
    );
    assert!(counts.iter().all(|&n| n >= 1), "an fsync flushed nothing");
    assert!(
        over.iter().all(|(_, n)| *n == 4) && over.len() <= counts.len() / 50,
        "fsyncs costing more than two flushes (index, flushes): {over:?}"
    );
    assert!(
        total * 100 <= counts.len() * 205,
        "{total} flushes for {} fsyncs",
        counts.len()
    );
    // What the log holds is durable: a crash now loses nothing fsynced.
    let img = dev.mem.snapshot();
    let tmp = TempDir::new("ckpt").expect("tmp");
    let path = tmp.join("img");
    std::fs::write(&path, &img).expect("write image");
    let report = rext4::journal::examine(&MemDevice::new(img)).expect("examine");
    assert!(
        report.transactions > 0,
        "fsync left nothing in the log: the checkpoint was not lazy"
    );
    let fs2 = common::open_rw(&path);
    for i in 0..300 {
        assert_eq!(
            fs2.read(format!("/d/f{i}")).expect("read"),
            fixture_bytes(i, 4096),
            "f{i}"
        );
    }
    fs2.close().expect("close");
    let r = e2fsck_fn(&path);
    assert!(r.clean, "e2fsck after recovery:\n{}", r.output);
    drop(fs);
}

/// A directory's blocks are committed (in the log, not yet home), the directory is
/// removed, and a file written and fsynced takes its blocks. A crash then leaves the
/// directory's old copies in the log: every recoverer must skip them (the removal's
/// commit revoked them) and the file must read back as written.
#[test]
fn revoked_block_reused_for_data() {
    let bs = 1024usize;
    let dev = Arc::new(Recorder::new(base_image(bs as u32, 8 << 20)));
    let fs = rw(dev.clone());
    fs.create_dir("/d").expect("mkdir");
    for i in 0..1500 {
        let name = format!("/d/a-rather-long-name-to-fill-directory-blocks-{i:05}");
        fs.write(&name, b"").expect("create");
    }
    fs.sync().expect("sync");
    let dir_blocks = blocks_of(&fs, "/d");
    assert!(
        dir_blocks.len() > 60,
        "directory of {} blocks",
        dir_blocks.len()
    );
    for i in 0..1500 {
        let name = format!("/d/a-rather-long-name-to-fill-directory-blocks-{i:05}");
        fs.remove_file(&name).expect("unlink");
    }
    fs.remove_dir("/d").expect("rmdir");
    // The removal commits (with its revoke records); the freed blocks become free.
    fs.sync().expect("sync");
    let free = fs.statfs().blocks_available;
    let len = (free.saturating_sub(100) as usize) * bs;
    let data = fixture_bytes(7, len);
    let f = fs.create("/big").expect("create");
    f.write_all_at(&data, 0).expect("write");
    f.sync_all().expect("fsync");
    let reused = blocks_of(&fs, "/big")
        .into_iter()
        .filter(|b| dir_blocks.contains(b))
        .count();
    assert!(
        reused > 0,
        "the file took none of the directory's {} blocks",
        dir_blocks.len()
    );
    let img = dev.mem.snapshot();
    let report = rext4::journal::examine(&MemDevice::new(img.clone())).expect("examine");
    assert!(
        report.revoke_records > 0 && report.revoke_hits > 0,
        "the crash image must hold the directory's logged blocks and their revoke \
         records: {report:?}"
    );
    drop(f);
    let tmp = TempDir::new("revoke").expect("tmp");
    let mut recoverers = vec!["rext4", "e2fsck"];
    match rext4_testkit::mount::can_loop_mount() {
        Ok(()) => recoverers.push("kernel"),
        Err(e) => skip(&format!("kernel recovery of the crash image: {e}")),
    }
    for how in recoverers {
        let path = tmp.join(how);
        std::fs::write(&path, &img).expect("write image");
        recover(&path, how).unwrap_or_else(|e| panic!("{how}: {e}"));
        let r = e2fsck_fn(&path);
        assert!(r.clean, "{how}: e2fsck after recovery:\n{}", r.output);
        let back = Fs::open(&path).expect("open").read("/big").expect("read");
        assert!(
            back == data,
            "{how}: /big does not read back as fsynced ({} of {} bytes differ)",
            back.iter().zip(&data).filter(|(a, b)| a != b).count(),
            data.len()
        );
    }
    drop(fs);
}

/// A device whose flush takes as long as a disk's cache flush.
struct SlowFlush;

impl Hooks for SlowFlush {
    fn flush(&self) -> std::io::Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(2));
        Ok(())
    }
}

/// Eight threads each writing and fsyncing files of their own share commits (group
/// commit): fewer commits than fsyncs, and every file reads back after a crash right
/// after the last fsync returned.
#[test]
fn concurrent_fsyncs_share_commits() {
    let dev = Arc::new(Hooked::mem(base_image(4096, 64 << 20), SlowFlush));
    let fs = rw(dev.clone());
    for t in 0..8 {
        fs.create_dir(format!("/t{t}")).expect("mkdir");
    }
    fs.sync().expect("sync");
    let before = fs.journal_stats();
    let per = 25u64;
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let fs = fs.clone();
            sc.spawn(move || {
                for i in 0..per {
                    let f = fs.create(format!("/t{t}/f{i}")).expect("create");
                    f.write_all_at(&fixture_bytes(t * 1000 + i, 4096), 0)
                        .expect("write");
                    f.sync_all().expect("fsync");
                }
            });
        }
    });
    let commits = fs.journal_stats().commits - before.commits;
    let fsyncs = 8 * per;
    eprintln!("{fsyncs} fsyncs on 8 threads: {commits} commits");
    assert!(
        commits > 0 && commits < fsyncs,
        "{fsyncs} fsyncs made {commits} commits"
    );
    // The crash: the image as the last fsync left it (every write so far was flushed
    // or, in this device, lands at once; the log is not checkpointed).
    let img = dev.snapshot();
    drop(fs);
    let tmp = TempDir::new("group").expect("tmp");
    let path = tmp.join("img");
    std::fs::write(&path, &img).expect("write image");
    recover(&path, "rext4").expect("recover");
    let r = e2fsck_fn(&path);
    assert!(r.clean, "e2fsck after recovery:\n{}", r.output);
    let fs = Fs::open(&path).expect("open");
    for t in 0..8u64 {
        for i in 0..per {
            assert_eq!(
                fs.read(format!("/t{t}/f{i}")).expect("read"),
                fixture_bytes(t * 1000 + i, 4096),
                "/t{t}/f{i}"
            );
        }
    }
}

/// A directory's blocks are committed (logged, not yet home); then many files are
/// made elsewhere, so the log fills, and the directory is removed: the transaction
/// that frees its blocks finds no room and checkpoints before it commits. That
/// checkpoint must still write the directory's committed blocks home, though the
/// running transaction has freed them: a crash after the checkpoint emptied the log
/// and before the freeing commit must find the directory whole. Every flush point of
/// the run is recovered (by rext4, and by e2fsck when it is not rext4's turn) and
/// e2fsck -fn must be clean.
#[test]
fn a_freed_logged_block_goes_home_at_a_checkpoint_before_its_free_commits() {
    let base = base_image(1024, 8 << 20);
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = rw(dev.clone());
    fs.create_dir("/d").expect("mkdir");
    fs.create_dir("/e").expect("mkdir");
    let name = |i: usize| format!("/d/a-rather-long-name-to-fill-directory-blocks-{i:05}");
    for i in 0..600 {
        fs.write(name(i), b"").expect("create");
    }
    fs.sync().expect("sync");
    let logged_dir = blocks_of(&fs, "/d");
    assert!(
        logged_dir.len() > 20,
        "directory of {} blocks",
        logged_dir.len()
    );
    // Fill the log with small committed transactions until the removal below (about
    // 190 blocks: the inode table blocks of 600 inodes, the directory's blocks)
    // cannot fit after them, yet is too small to be committed in parts.
    let head = || {
        let r = rext4::journal::examine(&MemDevice::new(dev.mem.snapshot())).expect("examine");
        r.log_head
    };
    let mut i = 0;
    while head() < 950 {
        for _ in 0..10 {
            fs.write(format!("/e/filler-{i:05}"), b"").expect("create");
            i += 1;
        }
        fs.sync().expect("sync");
        assert!(i < 20_000, "the log never filled");
    }
    let before = fs.journal_stats().checkpoints;
    let head_before = head();
    for i in 0..600 {
        fs.remove_file(name(i)).expect("unlink");
    }
    fs.remove_dir("/d").expect("rmdir");
    fs.sync().expect("sync");
    assert!(
        fs.journal_stats().checkpoints > before,
        "no checkpoint came while the directory's frees were uncommitted (log head \
         {head_before} of 1024 before the removal, {i} fillers)"
    );
    fs.close().expect("close");
    let events = dev.take();
    let tmp = TempDir::new("freed-logged").expect("tmp");
    let path = tmp.join("img");
    let points = rext4_testkit::crash::flush_points(&events);
    for (k, &fp) in points.iter().enumerate() {
        std::fs::write(
            &path,
            rext4_testkit::crash::image_at(&base, &events, fp + 1),
        )
        .expect("write image");
        let how = if k % 2 == 0 { "rext4" } else { "e2fsck" };
        recover(&path, how).unwrap_or_else(|e| panic!("flush {k}, {how}: {e}"));
        let r = e2fsck_fn(&path);
        assert!(
            r.clean,
            "flush {k}/{} recovered by {how}: e2fsck:\n{}",
            points.len(),
            r.output
        );
    }
    assert!(points.len() > 8, "{} flush points", points.len());
}
