//! `rext4 bench dax IMAGE`: the DAX data path (SEEDS lesson E) against the copy limits
//! of the memory behind it, in one run. IMAGE should live on tmpfs or hugetlbfs (or be
//! a dax device); it is opened with `FsOptions::dax`.
//!
//! Limits (`rext4::dax::measure_copy_limits`): a scratch file beside IMAGE (same
//! filesystem, as large as the test file),
//! mapped shared, filled in `--chunk` requests with three copy strategies, in the
//! order of the shared daxcopy.c — plain cached copy (`cached`, not persistent),
//! cached copy + clwb + sfence (`cached_clwb`), the DAX device's non-temporal stores +
//! sfence per request (`limit_nt`) — and read back with memcpy (`memcpy_read`). Then through the API: the file written once
//! (allocating, `first_write`), overwritten (`write`: the default write path), read
//! (`read`). Then fsync's cost: a mapped file with more and more bytes stored through
//! the mapping (`fsync_us_dirty_*`), and files of growing size with the same dirty
//! bytes (`fsync_us_size_*`); medians of 5.
//!
//! Lines: `RESULT|label|dax|metric|value|unit`, GB/s in 10^9 bytes per second.

use std::time::Instant;

use rext4::dax::write_back_kind;
use rext4::{Fs, FsOptions, OpenOptions};

use crate::bench::BenchArgs;

fn out(label: &str, metric: &str, value: f64, unit: &str) {
    crate::term::out(&format!("RESULT|{label}|dax|{metric}|{value:.2}|{unit}\n"));
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: &BenchArgs) -> Result<(), String> {
    let size = crate::bench::parse_size(a.size.as_deref().unwrap_or("1g"))?;
    let chunk = crate::bench::parse_size(a.chunk.as_deref().unwrap_or("1m"))? as usize;
    if chunk == 0 || size < chunk as u64 || !size.is_multiple_of(chunk as u64) {
        return Err("--size must be a positive multiple of --chunk".into());
    }
    let passes = 3u64;
    let label = &a.label;
    let wb = write_back_kind();
    crate::term::out(&format!(
        "dax: file {size} bytes, requests {chunk} bytes, write-back {wb:?}\n"
    ));
    let src: Vec<u8> = (0..chunk).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; chunk];
    let mut scratch = a.image.clone().into_os_string();
    scratch.push(".daxcopy");
    let l = rext4::dax::measure_copy_limits(
        std::path::Path::new(&scratch),
        usize::try_from(size).map_err(|_| "--size too large")?,
        chunk,
        passes as u32,
        &|| crate::bench::stop().is_err(),
    )
    .map_err(|e| format!("{}: {e}", std::path::Path::new(&scratch).display()))?;
    for (name, v) in [
        ("cached", l.cached),
        ("cached_clwb", l.cached_clwb),
        ("limit_nt", l.nt),
        ("memcpy_read", l.memcpy_read),
    ] {
        out(label, &format!("{name}_GBps"), v, "GB/s");
    }

    let fs = Fs::open_with(
        &a.image,
        FsOptions {
            read_only: false,
            dax: true,
            ..FsOptions::default()
        },
    )
    .map_err(|e| format!("{}: {}", a.image.display(), crate::term::reason(&e)))?;
    let r = through_api(&fs, a, size, chunk, passes, &src, &mut dst);
    let c = fs
        .close()
        .map_err(|e| format!("closing the image: {}", crate::term::reason(&e)));
    r.and(c)
}

fn through_api(
    fs: &Fs,
    a: &BenchArgs,
    size: u64,
    chunk: usize,
    passes: u64,
    src: &[u8],
    dst: &mut [u8],
) -> Result<(), String> {
    let e = |x: rext4::Error| crate::term::reason(&x);
    let label = &a.label;
    let _ = fs.remove_file("/daxfile");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(fs, "/daxfile")
        .map_err(e)?;
    let write_pass = |f: &rext4::File| -> Result<(), String> {
        let mut off = 0;
        while off < size {
            crate::bench::stop()?;
            f.write_all_at(src, off).map_err(e)?;
            off += chunk as u64;
        }
        f.sync_data().map_err(e)
    };
    let t = Instant::now();
    write_pass(&f)?;
    out(
        label,
        "first_write_GBps",
        gbps(size, t.elapsed().as_secs_f64()),
        "GB/s",
    );
    let t = Instant::now();
    for _ in 0..passes {
        write_pass(&f)?;
    }
    out(
        label,
        "write_GBps",
        gbps(size * passes, t.elapsed().as_secs_f64()),
        "GB/s",
    );
    let t = Instant::now();
    for _ in 0..passes {
        let mut off = 0;
        while off < size {
            crate::bench::stop()?;
            let n = f.read_at(dst, off).map_err(e)?;
            if n == 0 {
                return Err("short file".into());
            }
            off += n as u64;
        }
    }
    std::hint::black_box(&dst);
    out(
        label,
        "read_GBps",
        gbps(size * passes, t.elapsed().as_secs_f64()),
        "GB/s",
    );

    // ---- fsync against dirty bytes (one file) ----
    let m = f.map(0, size).map_err(e)?;
    let mut dirty_sizes = vec![4u64 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];
    dirty_sizes.retain(|&d| d <= size);
    for d in dirty_sizes {
        let mut us = Vec::new();
        for _ in 0..5 {
            let mut off = 0;
            while off < d {
                let n = (d - off).min(chunk as u64) as usize;
                m.write(off, &src[..n]).map_err(e)?;
                off += n as u64;
            }
            let t = Instant::now();
            f.sync_data().map_err(e)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        out(
            label,
            &format!("fsync_us_dirty_{}k", d >> 10),
            median(us),
            "us",
        );
    }
    drop(m);
    drop(f);
    fs.remove_file("/daxfile").map_err(e)?;

    // ---- fsync against file size (64 KiB dirty) ----
    let mut file_sizes = vec![1u64 << 20, 16 << 20, 256 << 20, 1 << 30];
    file_sizes.retain(|&s| s <= size);
    for s in file_sizes {
        let g = fs.create("/daxsize").map_err(e)?;
        let mut off = 0;
        while off < s {
            let n = (s - off).min(chunk as u64) as usize;
            g.write_all_at(&src[..n], off).map_err(e)?;
            off += n as u64;
        }
        g.sync_data().map_err(e)?;
        let m = g.map(0, s).map_err(e)?;
        let mut us = Vec::new();
        for k in 0..5u64 {
            // 64 KiB at a different place each time.
            let at = (k * (s / 5)) / 4096 * 4096;
            let n = (64u64 << 10).min(s - at);
            let mut done = 0;
            while done < n {
                let w = (n - done).min(chunk as u64) as usize;
                m.write(at + done, &src[..w]).map_err(e)?;
                done += w as u64;
            }
            let t = Instant::now();
            g.sync_data().map_err(e)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        out(
            label,
            &format!("fsync_us_size_{}m", s >> 20),
            median(us),
            "us",
        );
        drop(m);
        drop(g);
        fs.remove_file("/daxsize").map_err(e)?;
    }
    Ok(())
}
