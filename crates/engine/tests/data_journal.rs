//! Journaled file data (the engine's `fs::data_io`): an fsync that writes a few new
//! blocks puts their data in the log with the metadata that maps them, and the home
//! write waits for the checkpoint. Until then every read must see the logged data
//! (never the block's older home), every in-place change of the block must win over
//! the logged copy (in the cache, after recovery by rext4, e2fsck and the kernel), and
//! a freed block's logged copy must never be replayed over what reuses it.

mod common;

use std::sync::Arc;

use common::{base_image, blocks_of, open_device_rw, recover, Recorder};
use rext4::device::MemDevice;
use rext4::{Fs, OpenOptions};
use rext4_testkit::crash::{flush_points, image_at};
use rext4_testkit::{e2fsck_fn, fixture_bytes, skip, TempDir};

/// `path` opened for reading and writing.
fn open_rw_file(fs: &Fs, path: &str) -> rext4::File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(fs, path)
        .expect("open rw")
}

/// Every recoverer this machine has: rext4 and e2fsck always, the kernel where loop
/// mounts work (and where CI requires them, `skip` fails instead).
fn recoverers() -> Vec<&'static str> {
    let mut v = vec!["rext4", "e2fsck"];
    match rext4_testkit::mount::can_loop_mount() {
        Ok(()) => v.push("kernel"),
        Err(e) => skip(&format!("kernel recovery of the crash image: {e}")),
    }
    v
}

/// Recover `img` by each recoverer; e2fsck -fn must then be clean and every file in
/// `want` read back with its contents.
fn check_recovered(img: &[u8], want: &[(String, Vec<u8>)], tag: &str) {
    let tmp = TempDir::new("djournal").expect("tmp");
    for how in recoverers() {
        let path = tmp.join(how);
        std::fs::write(&path, img).expect("write image");
        recover(&path, how).unwrap_or_else(|e| panic!("{tag}, {how}: {e}"));
        let r = e2fsck_fn(&path);
        assert!(
            r.clean,
            "{tag}, {how}: e2fsck after recovery:\n{}",
            r.output
        );
        let fs = Fs::open(&path).expect("open");
        for (name, data) in want {
            let back = fs
                .read(name)
                .unwrap_or_else(|e| panic!("{tag}, {how}: {name}: {e}"));
            assert!(
                &back == data,
                "{tag}, {how}: {name} does not read back as fsynced ({} bytes, {} \
                 expected)",
                back.len(),
                data.len()
            );
        }
    }
}

/// Length of small file `i`: from a few bytes to just under four blocks.
fn small_len(i: u64) -> usize {
    (1 + i * 3797 % 16_000) as usize
}

/// Small files written and fsynced one by one: their data waits in the log (the
/// home blocks still hold what mke2fs left there), yet reads through the page cache
/// after it dropped them, O_DIRECT reads, a crash and every recoverer, and the
/// checkpoint at close all give the bytes as written.
#[test]
fn small_fsynced_data_waits_in_the_log_and_reads_back() {
    let dev = Arc::new(Recorder::new(base_image(4096, 64 << 20)));
    let fs = open_device_rw(dev.clone());
    fs.create_dir("/d").expect("mkdir");
    fs.sync().expect("sync");
    let mut want = Vec::new();
    for i in 0..40u64 {
        let name = format!("/d/f{i}");
        let data = fixture_bytes(i, small_len(i));
        let f = fs.create(&name).expect("create");
        f.write_all_at(&data, 0).expect("write");
        f.sync_all().expect("fsync");
        want.push((name, data));
    }
    assert_eq!(
        fs.journal_stats().checkpoints,
        0,
        "the log was checkpointed"
    );
    // Not home: the log holds the data.
    let img = dev.mem.snapshot();
    let bs = 4096usize;
    let mut firsts = Vec::new();
    for (name, data) in &want {
        let blocks = blocks_of(&fs, name);
        firsts.push(blocks[0] as usize);
        assert_eq!(blocks.len(), data.len().div_ceil(bs), "{name}: {blocks:?}");
        let b = blocks[0] as usize;
        let n = data.len().min(bs);
        assert_ne!(
            &img[b * bs..b * bs + n],
            &data[..n],
            "{name}: its data went home before the checkpoint (not journaled)"
        );
    }
    // Reads that go to the device see the journaled data.
    for (name, data) in &want {
        fs.open_file(name).expect("open").drop_cache(0, 0);
        assert_eq!(&fs.read(name).expect("read"), data, "{name}: cached read");
        let d = OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&fs, name)
            .expect("open direct");
        let mut back = vec![0u8; data.len()];
        d.read_exact_at(&mut back, 0).expect("direct read");
        assert_eq!(&back, data, "{name}: O_DIRECT read");
    }
    check_recovered(&img, &want, "crash after the last fsync");
    fs.close().expect("close");
    // The checkpoint at close wrote the data home.
    let img = dev.mem.snapshot();
    for ((name, data), &b) in want.iter().zip(&firsts) {
        let n = data.len().min(bs);
        assert_eq!(
            &img[b * bs..b * bs + n],
            &data[..n],
            "{name}: not home after close"
        );
    }
    let tmp = TempDir::new("djournal-closed").expect("tmp");
    let path = tmp.join("img");
    std::fs::write(&path, &img).expect("write image");
    let r = e2fsck_fn(&path);
    assert!(r.clean, "e2fsck after close:\n{}", r.output);
}

/// A block whose data is journaled is then changed in place — by an O_DIRECT
/// overwrite and by a buffered overwrite of part of it — and fsynced again: the change
/// must win over the logged copy, in reads and after a crash before the checkpoint.
#[test]
fn a_journaled_block_changed_in_place_keeps_the_newer_bytes() {
    let dev = Arc::new(Recorder::new(base_image(4096, 64 << 20)));
    let fs = open_device_rw(dev.clone());
    let first = fixture_bytes(1, 8192);
    for name in ["/direct", "/buffered"] {
        let f = fs.create(name).expect("create");
        f.write_all_at(&first, 0).expect("write");
        f.sync_all().expect("fsync");
    }
    // O_DIRECT over both blocks.
    let second = fixture_bytes(2, 8192);
    let d = OpenOptions::new()
        .write(true)
        .direct(true)
        .open(&fs, "/direct")
        .expect("open direct");
    d.write_all_at(&second, 0).expect("direct write");
    d.sync_data().expect("fdatasync");
    // Buffered, a few bytes in each block.
    let mut third = first.clone();
    let f = open_rw_file(&fs, "/buffered");
    for at in [100usize, 5000] {
        third[at..at + 7].copy_from_slice(b"changed");
        f.write_all_at(b"changed", at as u64).expect("write");
    }
    f.sync_data().expect("fdatasync");
    assert_eq!(
        fs.journal_stats().checkpoints,
        0,
        "the log was checkpointed"
    );
    let want = vec![
        ("/direct".to_string(), second),
        ("/buffered".to_string(), third),
    ];
    for (name, data) in &want {
        fs.open_file(name).expect("open").drop_cache(0, 0);
        assert_eq!(&fs.read(name).expect("read"), data, "{name}: read back");
    }
    check_recovered(&dev.mem.snapshot(), &want, "crash after the overwrites");
    drop((d, f));
    fs.close().expect("close");
    let tmp = TempDir::new("djournal-over").expect("tmp");
    let path = tmp.join("img");
    std::fs::write(&path, dev.mem.snapshot()).expect("write image");
    let r = e2fsck_fn(&path);
    assert!(r.clean, "e2fsck after close:\n{}", r.output);
    let fs = Fs::open(&path).expect("open");
    for (name, data) in &want {
        assert_eq!(&fs.read(name).expect("read"), data, "{name} after close");
    }
}

/// A small file's journaled block is freed (the file removed) and reused by a large
/// file written home: the removal's commit revokes the logged copy, so no recoverer
/// writes it over the large file's data.
#[test]
fn a_freed_journaled_block_is_revoked() {
    let bs = 1024usize;
    let dev = Arc::new(Recorder::new(base_image(bs as u32, 8 << 20)));
    let fs = open_device_rw(dev.clone());
    let mut small = Vec::new();
    for i in 0..20 {
        let name = format!("/s{i}");
        let f = fs.create(&name).expect("create");
        f.write_all_at(&fixture_bytes(i, 3 * bs), 0).expect("write");
        f.sync_all().expect("fsync");
        small.extend(blocks_of(&fs, &name));
    }
    for i in 0..20 {
        fs.remove_file(format!("/s{i}")).expect("unlink");
    }
    fs.sync().expect("sync");
    let free = fs.statfs().blocks_available;
    let data = fixture_bytes(99, (free.saturating_sub(100) as usize) * bs);
    let f = fs.create("/big").expect("create");
    f.write_all_at(&data, 0).expect("write");
    f.sync_all().expect("fsync");
    let reused = blocks_of(&fs, "/big")
        .into_iter()
        .filter(|b| small.contains(b))
        .count();
    assert!(
        reused > 0,
        "the large file took none of the small files' blocks"
    );
    let img = dev.mem.snapshot();
    let report = rext4::journal::examine(&MemDevice::new(img.clone())).expect("examine");
    assert!(
        report.revoke_records > 0 && report.revoke_hits > 0,
        "the crash image must hold the small files' logged data and their revoke \
         records: {report:?}"
    );
    drop(f);
    check_recovered(&img, &[("/big".to_string(), data)], "crash after the reuse");
    drop(fs);
}

/// Every flush point of a run that journals small files' data, overwrites some in
/// place, removes and truncates others, and closes: recovered by rext4 or e2fsck in
/// turn, e2fsck -fn is clean and every file whose fsync had returned reads back as
/// it was then (files changed later are left out).
#[test]
fn every_flush_point_of_journaled_data_recovers() {
    let bs = 1024usize;
    let base = base_image(bs as u32, 8 << 20);
    let dev = Arc::new(Recorder::new(base.clone()));
    let fs = open_device_rw(dev.clone());
    // (name, contents, events when its fsync returned)
    let mut synced: Vec<(String, Vec<u8>, usize)> = Vec::new();
    let mut changed = std::collections::HashSet::new();
    for i in 0..24u64 {
        let name = format!("/f{i}");
        let data = fixture_bytes(i, 1 + (i as usize * 1733) % (5 * bs));
        let f = fs.create(&name).expect("create");
        f.write_all_at(&data, 0).expect("write");
        f.sync_all().expect("fsync");
        synced.push((name, data, dev.len()));
        match i % 6 {
            3 => {
                let victim = format!("/f{}", i - 2);
                fs.remove_file(&victim).expect("unlink");
                changed.insert(victim);
            }
            4 => {
                let victim = format!("/f{}", i - 1);
                let v = open_rw_file(&fs, &victim);
                v.write_all_at(b"over", 0).expect("overwrite");
                v.set_len(2).expect("truncate");
                v.sync_all().expect("fsync");
                changed.insert(victim);
            }
            _ => {}
        }
    }
    fs.close().expect("close");
    let events = dev.take();
    let points = flush_points(&events);
    assert!(points.len() > 40, "{} flush points", points.len());
    let tmp = TempDir::new("djournal-points").expect("tmp");
    let path = tmp.join("img");
    for (k, &fp) in points.iter().enumerate() {
        std::fs::write(&path, image_at(&base, &events, fp + 1)).expect("write image");
        let how = if k % 2 == 0 { "rext4" } else { "e2fsck" };
        recover(&path, how).unwrap_or_else(|e| panic!("flush {k}, {how}: {e}"));
        let r = e2fsck_fn(&path);
        assert!(r.clean, "flush {k}, {how}: e2fsck:\n{}", r.output);
        let fs = Fs::open(&path).expect("open");
        for (name, data, at) in &synced {
            if *at <= fp + 1 && !changed.contains(name) {
                let back = fs
                    .read(name)
                    .unwrap_or_else(|e| panic!("flush {k}, {how}: {name}: {e}"));
                assert!(&back == data, "flush {k}, {how}: {name} lost fsynced bytes");
            }
        }
    }
}
