//! Huge filesystems on slow devices (SEEDS §D): what open reads, how the allocator
//! loads block bitmaps (batched, bounded, summarized), and the background prefetcher
//! (quiet, stoppable). Counts come from `Fs::io_stats` and the testkit's latency
//! device; no test here depends on wall-clock speed except the prefetcher's bound on a
//! foreground request's wait, which is measured by the device in whole latencies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rext4::device::latency::{Latency, LatencyDevice};
use rext4::device::{BlockDevice, FileDevice};
use rext4::mkfs::{mkfs_file, MkfsOptions};
use rext4::{FallocMode, Fs, FsOptions, Mapping};
use rext4_testkit::{e2fsck_fn, Image};

const MIB: u64 = 1 << 20;

fn slow(img: &Image, ms: u64, depth: usize) -> Arc<LatencyDevice> {
    let f = FileDevice::open(img.path(), false, false).expect("open image");
    Arc::new(LatencyDevice::new(
        Arc::new(f),
        Latency::Fixed(Duration::from_millis(ms)),
        depth,
    ))
}

fn open(dev: &Arc<LatencyDevice>, opts: FsOptions) -> Fs {
    Fs::open_device(
        dev.clone() as Arc<dyn BlockDevice>,
        FsOptions {
            read_only: false,
            commit_secs: 0,
            ..opts
        },
    )
    .expect("open")
}

fn extents_of(fs: &Fs, path: &str) -> usize {
    let f = fs.open_file(path).expect("open file");
    let mut runs = 0;
    let mut next = None;
    for (_, m) in f.extents().expect("extents") {
        if let Mapping::Mapped { physical, len, .. } = m {
            if next != Some(physical) {
                runs += 1;
            }
            next = Some(physical + len);
        }
    }
    runs
}

fn write_file(fs: &Fs, path: &str, len: u64) {
    let f = fs.create(path).expect("create");
    let buf = vec![0x5au8; MIB as usize];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(MIB);
        f.write_all_at(&buf[..n as usize], off).expect("write");
        off += n;
    }
    f.sync_all().expect("fsync");
}

/// A 1 TiB sparse image: open reads the superblock, the descriptor table (128 blocks)
/// in one request, and the journal's inode, map and superblock: no bitmap, no inode
/// table beyond the journal's; the first small write then reads what it must (the
/// root directory, one inode bitmap, one block bitmap) and nothing twice.
#[test]
fn open_reads_the_descriptor_table_in_large_requests_and_nothing_else() {
    let img = Image::create_sparse(1 << 40).expect("image");
    mkfs_file(img.path(), 1 << 40, &MkfsOptions::default()).expect("mkfs");
    let dev = slow(&img, 0, 8);
    let fs = open(&dev, FsOptions::default());
    let st = fs.io_stats();
    let groups = fs.superblock().group_count();
    let table_kib = groups * 64 / 1024;
    assert!(
        st.at_open.reads <= 6,
        "open took {} reads (superblock, descriptor table, journal inode, map, journal superblock)",
        st.at_open.reads
    );
    assert!(
        st.at_open.read_bytes / 1024 >= table_kib,
        "the table was not read: {st:?}"
    );
    let before = fs.io_stats();
    write_file(&fs, "/first", 4096);
    let w = fs.io_stats().device.since(&before.device);
    assert!(
        w.reads <= 4,
        "the first 4 KiB write read {} blocks",
        w.reads
    );
    let before = fs.io_stats();
    write_file(&fs, "/second", 4096);
    assert_eq!(fs.io_stats().device.since(&before.device).reads, 0);
    fs.close().expect("close");
    assert!(e2fsck_fn(img.path()).clean);
}

/// A 4 GiB image (32 groups, two flex groups) made full, then punched: groups 0..29
/// keep ten holes of 1 MiB (2,560 free blocks each, no run of 2,048), groups 30 and
/// 31 one hole of 16 MiB. Returns the image.
fn fragmented() -> Image {
    let img = Image::create_sparse(4 << 30).expect("image");
    mkfs_file(img.path(), 4 << 30, &MkfsOptions::default()).expect("mkfs");
    let fs = Fs::open_with(
        img.path(),
        FsOptions {
            read_only: false,
            prefetch_block_bitmaps: false,
            ..FsOptions::default()
        },
    )
    .expect("open");
    let free = fs.statfs().blocks_free * 4096;
    let f = fs.create("/fill").expect("create fill");
    // Leave what the allocator keeps back (16 MiB here) and room for the extent tree
    // the punching grows.
    fs.fallocate_ino(f.ino(), FallocMode::Allocate, 0, free - 24 * MIB)
        .expect("fill");
    let bpg = u64::from(fs.superblock().blocks_per_group);
    let groups = fs.superblock().group_count();
    // (logical block, physical block, length) of the fill: punched by physical place.
    let mut punches = Vec::new();
    for (lblk, m) in f.extents().expect("extents") {
        if let Mapping::Mapped { physical, len, .. } = m {
            punches.push((lblk, physical, len));
        }
    }
    for &(lstart, phys, len) in &punches {
        let mut b = 0;
        while b < len {
            let g = (phys + b) / bpg;
            let in_group = ((g + 1) * bpg - (phys + b)).min(len - b);
            let pos = (phys + b) % bpg;
            if g < groups - 2 {
                // Holes of 256 blocks every 2,048 blocks of the group, ten of them.
                let mut x = pos.next_multiple_of(2048);
                while x + 256 <= pos + in_group && x / 2048 < 10 {
                    let at = lstart + b + (x - pos);
                    fs.fallocate_ino(f.ino(), FallocMode::PunchHole, at * 4096, MIB)
                        .expect("punch");
                    x += 2048;
                }
            } else if pos + in_group >= 8192 && pos <= 4096 {
                let at = lstart + b + (4096 - pos.min(4096));
                fs.fallocate_ino(f.ino(), FallocMode::PunchHole, at * 4096, 16 * MIB)
                    .expect("punch big");
            }
            b += in_group;
        }
    }
    fs.close().expect("close");
    img
}

/// The allocator's search for a long run on fragmented groups reads bitmaps in
/// batches of `mb_prefetch` (one request for adjacent bitmaps), at most
/// `mb_prefetch_limit` in all, then one at a time; what it learned lets the next
/// large allocation skip the fragmented groups without any read.
#[test]
fn long_runs_are_searched_with_batched_bounded_prefetch_and_then_summaries() {
    let img = fragmented();
    let dev = slow(&img, 0, 8);
    let fs = open(
        &dev,
        FsOptions {
            mb_prefetch: Some(4),
            mb_prefetch_limit: Some(12),
            prefetch_block_bitmaps: false,
            ..FsOptions::default()
        },
    );
    let s0 = fs.io_stats();
    write_file(&fs, "/large", 32 * MIB);
    let s1 = fs.io_stats();
    let prefetched = s1.bitmaps_prefetched - s0.bitmaps_prefetched;
    let requests = s1.prefetch_requests - s0.prefetch_requests;
    let allocations = s1.allocations - s0.allocations;
    assert!(
        prefetched >= 4 && prefetched <= 12 * allocations,
        "prefetched {prefetched} bitmaps in {allocations} allocations (batches of 4, at \
         most 12 each): {s1:?}"
    );
    let groups = fs.superblock().group_count();
    assert!(
        prefetched + s1.bitmaps_read - s0.bitmaps_read <= groups,
        "a bitmap was read twice: {s1:?}"
    );
    assert!(
        requests * 2 <= prefetched,
        "{prefetched} bitmaps in {requests} requests: not batched"
    );
    assert!(
        s1.bitmaps_read - s0.bitmaps_read >= 1,
        "past the limit bitmaps load one at a time: {s1:?}"
    );
    let frags = extents_of(&fs, "/large");
    assert!(
        frags <= 2,
        "32 MiB in {frags} pieces; two 16 MiB holes fit it"
    );
    // The fragmented groups are known now: a second long run reads no bitmap of
    // theirs, at most that of the one group the first search never reached (the last:
    // it found its space before).
    let s1 = fs.io_stats();
    write_file(&fs, "/again", 8 * MIB);
    let s2 = fs.io_stats();
    assert!(
        s2.allocation_reads() - s1.allocation_reads() <= 1,
        "the second search read bitmaps again: {s1:?} then {s2:?}"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// The background prefetcher summarizes the groups after open, one request at a
/// time, never ahead of a foreground request by more than the one in flight; a large
/// allocation afterwards reads only the bitmap it takes; close stops it at once.
#[test]
fn background_prefetcher_summarizes_quietly_and_stops_at_close() {
    let img = fragmented();
    // Some file data to read in the foreground meanwhile.
    {
        let fs = Fs::open_with(
            img.path(),
            FsOptions {
                read_only: false,
                ..FsOptions::default()
            },
        )
        .expect("open");
        write_file(&fs, "/data", MIB);
        fs.close().expect("close");
    }
    let lat = 20;
    let dev = slow(&img, lat, 1);
    let fs = open(&dev, FsOptions::default());
    let data = fs.open_file("/data").expect("open data");
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    let mut fg_reads = 0;
    loop {
        let st = fs.io_stats();
        if st.background_groups >= 30 || t.elapsed() > Duration::from_secs(60) {
            break;
        }
        data.drop_cache(0, MIB);
        data.read_at(&mut buf, (fg_reads % 256) * 4096)
            .expect("read");
        fg_reads += 1;
        // Gaps longer than the prefetcher's quiet time, so it runs between them.
        std::thread::sleep(Duration::from_millis(lat + 10));
    }
    let st = fs.io_stats();
    assert!(
        st.background_groups >= 30,
        "the prefetcher summarized {} groups in 60 s: {st:?}",
        st.background_groups
    );
    assert!(st.background_requests >= 1);
    let wait = dev.max_foreground_wait();
    eprintln!(
        "background prefetch: {} groups in {} requests; {fg_reads} foreground reads, the \
         longest waited {wait:?} for the device (a request takes {lat} ms)",
        st.background_groups, st.background_requests
    );
    assert!(
        wait < Duration::from_millis(lat * 2),
        "a foreground request waited {wait:?} for the device (one request is {lat} ms)"
    );
    let before = fs.io_stats();
    write_file(&fs, "/large", 32 * MIB);
    let after = fs.io_stats();
    assert!(
        after.allocation_reads() - before.allocation_reads() <= 2,
        "after the prefetcher a large allocation read {} bitmaps",
        after.allocation_reads() - before.allocation_reads()
    );
    assert!(extents_of(&fs, "/large") <= 2);
    fs.close().expect("close");
    drop(data);
    let counted = dev.counts();
    std::thread::sleep(Duration::from_millis(5 * lat));
    assert_eq!(dev.counts(), counted, "requests after close");

    // Stopped halfway: a fresh open closed at once leaves groups unsummarized and the
    // device untouched afterwards.
    let dev = slow(&img, 200, 1);
    let fs = open(&dev, FsOptions::default());
    fs.close().expect("close");
    let st_groups = fs.io_stats().background_groups;
    let counted = dev.counts();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(dev.counts(), counted, "the prefetcher went on after close");
    assert!(st_groups < 30, "{st_groups} groups summarized before close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}
