//! `rext4 bench firstwrite IMAGE [--latency-ms MS]`: SEEDS lesson D — how long a huge
//! filesystem takes to open and to take its first write, on a device where every read
//! costs `MS` milliseconds.
//!
//! The image is dropped from the host's page cache (posix_fadvise DONTNEED) and opened
//! read-write through a [`rext4::device::latency::LatencyDevice`] (`--latency-ms` per
//! read, `--queue-depth` requests served at once); then one new file of `-s` bytes
//! (default 4 KiB) is written and fsynced, then a second one. Printed: the times, the
//! device requests of each step (from `Fs::io_stats`), the bitmaps the allocator read
//! singly and in batches, and the new file's extents (physically contiguous runs). The
//! files are removed again at the end, so rounds on one image measure the same thing.
//!
//! Lines: `RESULT|label|firstwrite|METRIC|VALUE|UNIT`, among them
//! `open_first_4k_write_fsync_ms` (the size in the name follows `-s`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rext4::device::latency::{IoCounts, Latency, LatencyDevice};
use rext4::device::{BlockDevice, FileDevice};
use rext4::{Fs, FsOptions, Mapping};

use crate::bench::BenchArgs;

fn out(label: &str, metric: &str, value: f64, unit: &str) {
    crate::term::out(&format!(
        "RESULT|{label}|firstwrite|{metric}|{value:.2}|{unit}\n"
    ));
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `4k`, `64m`: the size as the metric names spell it.
fn size_name(n: u64) -> String {
    for (unit, div) in [("g", 1u64 << 30), ("m", 1 << 20), ("k", 1 << 10)] {
        if n >= div && n.is_multiple_of(div) {
            return format!("{}{unit}", n / div);
        }
    }
    format!("{n}b")
}

/// Physically contiguous runs of the file's mapped extents.
fn fragments(ext: &[(u64, Mapping)]) -> usize {
    let mut runs = 0;
    let mut next: Option<u64> = None;
    for (_, m) in ext {
        if let Mapping::Mapped { physical, len, .. } = *m {
            if next != Some(physical) {
                runs += 1;
            }
            next = Some(physical + len);
        }
    }
    runs
}

/// Drop the image's clean pages from the host's page cache (a cold start).
fn drop_host_cache(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: a valid descriptor; advice only.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

pub fn run(a: &BenchArgs) -> Result<(), String> {
    let size = crate::bench::parse_size(a.size.as_deref().unwrap_or("4k"))?;
    if size == 0 {
        return Err("-s must be at least 1 byte".into());
    }
    let lat_ms = a.latency_ms.unwrap_or(0.0);
    if !(0.0..=10_000.0).contains(&lat_ms) {
        return Err("--latency-ms must be between 0 and 10000".into());
    }
    let what = |e: rext4::Error| crate::term::reason(&e);
    // The claim keeps other writers (and loop devices, mounts) away while open.
    let _claim =
        rext4::Claim::write(&a.image).map_err(|e| format!("{}: {}", a.image.display(), what(e)))?;
    drop_host_cache(&a.image);
    let file = FileDevice::open(&a.image, false, false)
        .map_err(|e| format!("{}: {e}", a.image.display()))?;
    let lat = Latency::Fixed(Duration::from_secs_f64(lat_ms / 1000.0));
    let slow = Arc::new(LatencyDevice::new(
        Arc::new(file),
        lat,
        a.queue_depth.unwrap_or(32),
    ));
    crate::term::out(&format!(
        "firstwrite: {} through {lat_ms} ms a read, queue depth {}; a {} file written and fsynced, then another\n",
        a.image.display(),
        a.queue_depth.unwrap_or(32),
        size_name(size)
    ));
    let opts = FsOptions {
        read_only: false,
        mb_prefetch: a.mb_prefetch,
        mb_prefetch_limit: a.mb_prefetch_limit,
        prefetch_block_bitmaps: !a.no_prefetch,
        ..FsOptions::default()
    };
    let t0 = Instant::now();
    let fs = Fs::open_device(slow.clone() as Arc<dyn BlockDevice>, opts)
        .map_err(|e| format!("{}: {}", a.image.display(), what(e)))?;
    let open = t0.elapsed();
    let r = writes(&fs, a, size, open, t0);
    let c = fs
        .close()
        .map_err(|e| format!("closing the image: {}", what(e)));
    r.and(c)
}

fn writes(fs: &Fs, a: &BenchArgs, size: u64, open: Duration, t0: Instant) -> Result<(), String> {
    let label = &a.label;
    let what = |e: rext4::Error| crate::term::reason(&e);
    let st0 = fs.io_stats();
    let data: Vec<u8> = (0..size.min(1 << 20))
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    let name = |k: usize| format!("/firstwrite-{}-{k}", std::process::id());
    let write_one = |path: &str| -> Result<(Duration, usize), String> {
        let t = Instant::now();
        let f = fs.create(path).map_err(what)?;
        let mut off = 0u64;
        while off < size {
            crate::bench::stop()?;
            let n = (size - off).min(data.len() as u64) as usize;
            f.write_all_at(&data[..n], off).map_err(what)?;
            off += n as u64;
        }
        f.sync_all().map_err(what)?;
        let took = t.elapsed();
        Ok((took, fragments(&f.extents().map_err(what)?)))
    };
    let (first, frags) = write_one(&name(1))?;
    let total = t0.elapsed();
    let st1 = fs.io_stats();
    let (second, _) = write_one(&name(2))?;
    let st2 = fs.io_stats();
    let w1 = st1.device.since(&st0.device);
    let w2 = st2.device.since(&st1.device);
    let at_open: IoCounts = st0.at_open;
    let sz = size_name(size);
    crate::term::out(&format!(
        "open {:.1} ms: {} reads, {} KiB; first {sz} write+fsync {:.1} ms: {} reads \
         ({} bitmaps singly, {} in {} batched requests), {} writes, {} flushes; \
         second {:.1} ms: {} reads; the file is in {frags} extent(s)\n",
        ms(open),
        at_open.reads,
        at_open.read_bytes / 1024,
        ms(first),
        w1.reads,
        st1.bitmaps_read - st0.bitmaps_read,
        st1.bitmaps_prefetched - st0.bitmaps_prefetched,
        st1.prefetch_requests - st0.prefetch_requests,
        w1.writes,
        w1.flushes,
        ms(second),
        w2.reads,
    ));
    out(label, "open_ms", ms(open), "ms");
    out(
        label,
        &format!("first_{sz}_write_fsync_ms"),
        ms(first),
        "ms",
    );
    out(
        label,
        &format!("open_first_{sz}_write_fsync_ms"),
        ms(total),
        "ms",
    );
    out(
        label,
        &format!("second_{sz}_write_fsync_ms"),
        ms(second),
        "ms",
    );
    out(label, "reads_at_open", at_open.reads as f64, "reads");
    out(
        label,
        "read_kib_at_open",
        (at_open.read_bytes / 1024) as f64,
        "KiB",
    );
    out(label, "reads_first_write", w1.reads as f64, "reads");
    out(label, "reads_second_write", w2.reads as f64, "reads");
    out(
        label,
        "bitmaps_prefetched_first_write",
        (st1.bitmaps_prefetched - st0.bitmaps_prefetched) as f64,
        "bitmaps",
    );
    out(label, "first_write_extents", frags as f64, "extents");
    for k in [1, 2] {
        fs.remove_file(name(k)).map_err(what)?;
    }
    Ok(())
}
