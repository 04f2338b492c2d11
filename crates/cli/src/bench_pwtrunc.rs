//! `rext4 bench pwtrunc IMAGE -n N --verify`: SEEDS lesson B's stale-data reproducer
//! in-process (issue #16), like the anchors' `pwrite_trunc FILE N verify` with reclaim
//! forced at every step.
//!
//! Each of `-n` iterations (default 100000): truncate 0; fallocate 0..32 KiB; pwrite
//! 4 KiB of 0xcd at 0; truncate 2 KiB; after each of the four steps the file is
//! written back and its clean pages dropped (`File::sync_range` + `File::drop_cache`:
//! sync_file_range + fadvise DONTNEED), while a second thread does the same without
//! pause. Then the EOF page's tail [2 KiB, 4 KiB) is read through a mapping (must be
//! zeros) and the file through `read_at` (must be 2048 bytes of 0xcd, then EOF). A
//! stale byte is a nonzero byte past EOF in the mapping or a wrong, missing or extra
//! byte from `read_at`.
//!
//! Lines: `phase=verify ...` and `RESULT|label|pwtrunc|METRIC|VALUE|UNIT` with
//! `verify_iters_per_s`, `verify_iterations`, `stale_bytes`, `stale_iterations` and
//! `racer_iterations`. Any stale byte makes the run fail (after the lines are
//! printed); the file is removed at the end either way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rext4::{FallocMode, File, Fs};

use crate::bench::BenchArgs;

const PATH: &str = "/pwtrunc-verify";
const WRITE_BYTES: usize = 4096;
const TRUNC_BYTES: usize = 2048;
const FALLOC_BYTES: u64 = 32 << 10;

/// Write the file back and drop its clean pages: sync_file_range(WRITE|WAIT_AFTER) +
/// fadvise(DONTNEED) of the whole file.
fn reclaim(f: &File) -> Result<(), String> {
    f.sync_range(0, 0)
        .map_err(|e| format!("sync_range: {}", crate::term::reason(&e)))?;
    f.drop_cache(0, 0);
    Ok(())
}

/// What one iteration saw: stale bytes in the mapping and in `read_at`, and a sample.
struct Seen {
    stale_bytes: u64,
    what: String,
}

/// One iteration of the reproducer (see the module note).
fn iteration(fs: &Fs, f: &File) -> Result<Seen, String> {
    let e = |what: &str, x: rext4::Error| format!("{what}: {}", crate::term::reason(&x));
    f.set_len(0).map_err(|x| e("truncate 0", x))?;
    reclaim(f)?;
    fs.fallocate_ino(f.ino(), FallocMode::Allocate, 0, FALLOC_BYTES)
        .map_err(|x| e("fallocate", x))?;
    reclaim(f)?;
    f.write_all_at(&[0xcd; WRITE_BYTES], 0)
        .map_err(|x| e("pwrite", x))?;
    reclaim(f)?;
    f.set_len(TRUNC_BYTES as u64)
        .map_err(|x| e("truncate 2k", x))?;
    reclaim(f)?;
    let mut tail = [0xffu8; WRITE_BYTES - TRUNC_BYTES];
    f.map(0, WRITE_BYTES as u64)
        .and_then(|m| m.read(TRUNC_BYTES as u64, &mut tail))
        .map_err(|x| e("mapped read", x))?;
    let mapped = tail.iter().filter(|&&b| b != 0).count();
    let mut buf = [0u8; WRITE_BYTES];
    let n = f.read_at(&mut buf, 0).map_err(|x| e("read", x))?;
    let past_eof = f
        .read_at(&mut buf[n..], n as u64)
        .map_err(|x| e("read at EOF", x))?;
    let read_wrong = buf[..n.min(TRUNC_BYTES)]
        .iter()
        .filter(|&&b| b != 0xcd)
        .count()
        + n.abs_diff(TRUNC_BYTES)
        + past_eof;
    Ok(Seen {
        stale_bytes: (mapped + read_wrong) as u64,
        what: format!(
            "{mapped} nonzero bytes past EOF in the mapping (first 16: {:02x?}); read \
             returned {n} bytes then {past_eof} at EOF, {read_wrong} wrong",
            &tail[..16]
        ),
    })
}

fn result(label: &str, metric: &str, value: impl std::fmt::Display, unit: &str) {
    crate::term::out(&format!("RESULT|{label}|pwtrunc|{metric}|{value}|{unit}\n"));
}

/// `rext4 bench pwtrunc --verify` on the open image (see the module note).
pub fn verify(fs: &Fs, a: &BenchArgs) -> Result<(), String> {
    let n = a.count.unwrap_or(100_000);
    let f = rext4::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(fs, PATH)
        .map_err(|e| format!("{PATH}: {}", crate::term::reason(&e)))?;
    let racer_stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (looped, raced) = std::thread::scope(|sc| {
        let racer = sc.spawn(|| {
            let mut passes = 0u64;
            while !racer_stop.load(Ordering::Relaxed) {
                reclaim(&f)?;
                passes += 1;
            }
            Ok::<u64, String>(passes)
        });
        let looped = (|| {
            let (mut done, mut stale_bytes, mut stale_iters) = (0u64, 0u64, 0u64);
            let mut first = None;
            // A racer that stopped on an error ends the run (its error is reported).
            while done < n && !racer.is_finished() {
                crate::bench::stop()?;
                let seen = iteration(fs, &f)?;
                if seen.stale_bytes > 0 {
                    stale_bytes += seen.stale_bytes;
                    stale_iters += 1;
                    first.get_or_insert(format!("iteration {done}: {}", seen.what));
                }
                done += 1;
            }
            Ok::<_, String>((done, stale_bytes, stale_iters, first))
        })();
        racer_stop.store(true, Ordering::Relaxed);
        let raced = racer
            .join()
            .unwrap_or_else(|_| Err("the racer thread panicked".into()));
        (looped, raced)
    });
    let secs = t0.elapsed().as_secs_f64();
    drop(f);
    let removed = fs
        .remove_file(PATH)
        .map_err(|e| format!("removing {PATH}: {}", crate::term::reason(&e)));
    let (done, stale_bytes, stale_iters, first) = looped?;
    let raced = raced?;
    removed?;
    let rate = done as f64 / secs;
    crate::term::out(&format!(
        "phase=verify ops={done} secs={secs:.3} ops_per_s={rate:.1} stale_bytes={stale_bytes} \
         stale_iters={stale_iters} racer_iters={raced}\n"
    ));
    let label = &a.label;
    result(label, "verify_iters_per_s", format!("{rate:.1}"), "iters/s");
    result(label, "verify_iterations", done, "count");
    result(label, "stale_bytes", stale_bytes, "bytes");
    result(label, "stale_iterations", stale_iters, "count");
    result(label, "racer_iterations", raced, "count");
    match first {
        None => Ok(()),
        Some(first) => Err(format!(
            "pwtrunc --verify: {stale_bytes} stale bytes in {stale_iters} of {done} \
             iterations; first at {first}"
        )),
    }
}
