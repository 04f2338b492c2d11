//! `rext4 mkfs -d SRC IMAGE` without a SIZE (a new or empty image file): the image is
//! made as small as its contents need, plus `--extra`.
//!
//! How: a trial build into a large sparse scratch image beside IMAGE measures what the
//! contents take (blocks, inodes) with the same block size and options; then the
//! smallest size whose fresh filesystem leaves that much free — after the engine's
//! pool of 2% (at most 4096 blocks) kept for changes that must not fail, and `--extra`
//! of free space and inodes — is found by formatting scratch images of candidate sizes
//! (a format writes only metadata: milliseconds each), and the real image is built at
//! that size. Should it not fit after all (a layout the trial did not predict), it is
//! built again 5% larger, up to three times. A source on standard input is spooled to
//! a scratch file first (read twice). Every scratch file is removed at the end.
//!
//! Must hold: the result is exactly what `mkfs -d SRC IMAGE SIZE` gives for the chosen
//! SIZE (same options, -N for the inodes), so reproducible builds stay reproducible.

use std::path::{Path, PathBuf};

use rext4::mkfs::{self, MkfsOptions, MkfsReport};

use crate::mkfs_cmd::{fill, Extras, MkfsArgs};
use crate::term::{self, reason};
use crate::write_cmds::Failure;

/// `--extra`: free space (and inode headroom) to leave.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Extra {
    Bytes(u64),
    Percent(f64),
}

/// Parse `--extra`: `N%` or a size with mke2fs's suffixes (k, m, g, t; bytes without).
pub fn parse_extra(s: &str) -> Option<Extra> {
    if let Some(p) = s.strip_suffix('%') {
        let v: f64 = p.trim().parse().ok()?;
        return (v.is_finite() && (0.0..=1000.0).contains(&v)).then_some(Extra::Percent(v));
    }
    let last = s.chars().last()?;
    if last.is_ascii_digit() {
        return s.parse().ok().map(Extra::Bytes);
    }
    mkfs::parse_size(s, None).map(Extra::Bytes)
}

/// A scratch file beside `image`, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(image: &Path, what: &str) -> Scratch {
        let name = image
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Scratch(image.with_file_name(format!(".{name}.{what}.{}", std::process::id())))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The trial's size: large enough for any input this machine could hold.
const TRIAL_BYTES: u64 = 1 << 40;

fn pool(blocks: u64) -> u64 {
    (blocks / 50).min(4096)
}

/// Free blocks and free inodes of the image at `p`, as its superblock says.
fn free_counts(p: &Path) -> Result<(u64, u32), Failure> {
    let fs = rext4::Fs::open(p).map_err(|e| (1, format!("{}: {}", p.display(), reason(&e))))?;
    let sb = fs.superblock();
    Ok((sb.free_blocks_count, sb.free_inodes_count))
}

pub fn run(
    args: &MkfsArgs,
    opts: &MkfsOptions,
    extras: &Extras,
    from_dir: bool,
) -> Result<(), Failure> {
    let image = &args.image;
    let extra = match &args.extra {
        Some(s) => parse_extra(s)
            .ok_or_else(|| (2, format!("invalid --extra: '{s}' (SIZE or PERCENT%)")))?,
        None => Extra::Bytes(0),
    };
    let bs = args.block_size.unwrap_or(4096);
    let opts = MkfsOptions {
        block_size: Some(bs),
        ..opts.clone()
    };
    // Standard input is read twice: spooled first.
    let spool = Scratch::new(image, "stdin");
    let source: Option<PathBuf> = match &args.populate {
        Some(p) if p.as_os_str() == "-" => {
            let mut f = std::fs::File::create(&spool.0)
                .map_err(|e| (1, format!("{}: {}", spool.0.display(), term::io_reason(&e))))?;
            std::io::copy(&mut std::io::stdin().lock(), &mut f).map_err(|e| {
                (
                    1,
                    format!("reading standard input: {}", term::io_reason(&e)),
                )
            })?;
            Some(spool.0.clone())
        }
        p => p.clone(),
    };
    // The trial: what the contents take.
    let trial = Scratch::new(image, "fit-trial");
    fn fail(p: &Path) -> impl Fn(rext4::Error) -> Failure + '_ {
        move |e| (1, format!("{}: {}", p.display(), reason(&e)))
    }
    let r0 = mkfs::mkfs_file(&trial.0, TRIAL_BYTES, &opts).map_err(fail(&trial.0))?;
    // Members refused here are refused again below (and reported there).
    let trial_result = fill(args, extras, &trial.0, source.as_deref(), from_dir, true);
    if crate::interrupt::requested().is_some() {
        return trial_result;
    }
    let (free_b, free_i) = free_counts(&trial.0)?;
    let used_blocks = r0.free_blocks.saturating_sub(free_b);
    let used_inodes = u64::from(r0.inodes_count - free_i);
    let (want_blocks, want_inodes) = match extra {
        Extra::Bytes(b) => (used_blocks + b.div_ceil(u64::from(bs)), used_inodes + 16),
        Extra::Percent(p) => (
            used_blocks + (used_blocks as f64 * p / 100.0).ceil() as u64,
            used_inodes + (used_inodes as f64 * p / 100.0).ceil() as u64 + 16,
        ),
    };
    // A little room for a layout that differs from the trial's (directory and extent
    // blocks in other groups).
    let need = want_blocks + want_blocks / 100 + 32;
    let inodes = u32::try_from(want_inodes).map_err(|_| (1, "too many inodes".to_string()))?;
    let fits = |blocks: u64| -> Option<MkfsReport> {
        let o = MkfsOptions {
            inodes: Some(inodes),
            ..opts.clone()
        };
        let r = mkfs::mkfs_file(&trial.0, blocks * u64::from(bs), &o).ok()?;
        (r.free_blocks.saturating_sub(pool(r.blocks_count)) >= need).then_some(r)
    };
    // Smallest block count that fits: doubling, then bisection.
    let mut hi = need.max(64);
    while fits(hi).is_none() {
        hi = hi
            .checked_mul(2)
            .ok_or_else(|| (1, "contents too large to fit".to_string()))?;
        if hi * u64::from(bs) > TRIAL_BYTES * 4 {
            return Err((1, "could not find a size that fits the contents".into()));
        }
    }
    let mut lo = need.min(hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    drop(trial);
    let mut blocks = hi;
    for attempt in 0..3 {
        let o = MkfsOptions {
            inodes: Some(inodes),
            ..opts.clone()
        };
        let report = mkfs::mkfs_file(image, blocks * u64::from(bs), &o).map_err(fail(image))?;
        if attempt == 0 {
            for w in &report.warnings {
                crate::term::errln!("warning: {w}");
            }
        }
        let r = fill(args, extras, image, source.as_deref(), from_dir, true);
        // A failure the trial did not have, on an image left (nearly) full: the layout
        // took more than the trial's; again, larger.
        let full =
            || free_counts(image).is_ok_and(|(free, _)| free <= pool(blocks) + need / 50 + 64);
        match r {
            Err(_) if attempt < 2 && trial_result.is_ok() && full() => {
                blocks += blocks / 20 + 16;
                continue;
            }
            r => {
                r?;
                if !args.quiet {
                    term::out(&format!(
                        "Sized to fit: {} blocks of {bs} bytes ({} KiB), {} inodes\n",
                        report.blocks_count,
                        report.blocks_count * u64::from(bs) / 1024,
                        report.inodes_count
                    ));
                }
                return Ok(());
            }
        }
    }
    Err((1, "the contents did not fit the size found".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_parses_sizes_and_percents() {
        assert_eq!(parse_extra("10%"), Some(Extra::Percent(10.0)));
        assert_eq!(parse_extra("1.5%"), Some(Extra::Percent(1.5)));
        assert_eq!(parse_extra("64m"), Some(Extra::Bytes(64 << 20)));
        assert_eq!(parse_extra("1000"), Some(Extra::Bytes(1000)));
        assert_eq!(parse_extra("-5%"), None);
        assert_eq!(parse_extra("x"), None);
    }
}
