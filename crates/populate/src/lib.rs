//! rext4-populate: fill an image from what image builders have — tar archives (plain,
//! gzip, zstd or xz, from a file or a pipe), container image layers (tar layers
//! applied in order with their whiteouts, or an OCI image layout), and without root
//! the owners and labels a root build would give: owner override and id maps, a
//! device table (genext2fs/makedevs) and SELinux file_contexts.
//!
//! Owns: reading archives as streams ([`compress`], `tarball`), placing entries by
//! path ([`place`]: never following a symlink, never leaving the destination), OCI
//! layouts ([`oci`]), id maps ([`ids`]), device tables ([`devtable`]), SELinux
//! labels ([`contexts`]).
//!
//! Must hold: nothing is extracted to the host; a member that names a path outside
//! the tree (`..`) or goes through a symlink is refused and named, never placed; a
//! damaged or truncated archive is an error, not a shorter tree; bad input never
//! panics. With `SOURCE_DATE_EPOCH` set, the engine's reproducible mode applies, and
//! what is placed depends only on the archive's bytes (zero blocks become holes).
//!
//! Callers: the CLI's `rext4 mkfs -d ARCHIVE` / `--layer`, the Python binding,
//! embedders. Runs on the caller's thread, one entry at a time (xz is decoded on a
//! thread of its own).

pub mod compress;
pub mod contexts;
pub mod devtable;
pub mod ids;
pub mod oci;
pub mod place;
mod tarball;

use std::io::Read;

pub use ids::{IdMap, Owners};
use rext4::{Error, Fs, Ino, Result};

/// How a population owns what it places.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Source owners to image owners (`--owner`, `--uid-map`, `--gid-map`).
    pub owners: Owners,
}

/// What a population did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Members placed.
    pub entries: u64,
    /// Bytes of regular files placed.
    pub bytes: u64,
    /// Notes (a leading '/' dropped...).
    pub warnings: Vec<String>,
    /// Members refused (named, with why); the others were placed.
    pub errors: Vec<String>,
    /// `stop` said to stop; the member in progress was removed.
    pub interrupted: bool,
}

/// Why one step did not complete.
pub(crate) enum Step {
    Fail(Error),
    Stop,
}

impl From<Error> for Step {
    fn from(e: Error) -> Step {
        Step::Fail(e)
    }
}

impl From<std::io::Error> for Step {
    fn from(e: std::io::Error) -> Step {
        Step::Fail(e.into())
    }
}

/// Apply the archive `r` (any compression [`compress`] knows) to directory `dest`.
/// As a `layer`, whiteouts remove what lower layers placed. `stop` is polled between
/// members and chunks.
pub fn apply_archive(
    fs: &Fs,
    dest: Ino,
    r: impl Read + Send + 'static,
    opts: &Options,
    layer: bool,
    stop: &dyn Fn() -> bool,
) -> Result<Report> {
    let mut r = compress::open(r)?;
    let mut report = Report::default();
    tarball::apply(fs, dest, &mut r, opts, layer, stop, &mut report)?;
    Ok(report)
}

/// Apply the layers (tar files, any compression, or OCI image layouts, each
/// expanding to its layers) bottom first to directory `dest`.
pub fn apply_layers(
    fs: &Fs,
    dest: Ino,
    layers: &[std::path::PathBuf],
    opts: &Options,
    stop: &dyn Fn() -> bool,
) -> Result<Report> {
    let mut total = Report::default();
    for l in layers {
        let blobs = if l.is_dir() {
            if !oci::is_layout(l) {
                return Err(Error::InvalidInput(format!(
                    "{}: a directory given as a layer must be an OCI image layout \
                     (oci-layout, index.json)",
                    l.display()
                )));
            }
            oci::layers(l)?
        } else {
            vec![l.clone()]
        };
        for b in blobs {
            let f = std::fs::File::open(&b)
                .map_err(|e| Error::InvalidInput(format!("{}: {e}", b.display())))?;
            let r = apply_archive(fs, dest, f, opts, true, stop)
                .map_err(|e| Error::InvalidInput(format!("{}: {e}", b.display())))?;
            total.entries += r.entries;
            total.bytes += r.bytes;
            total.warnings.extend(r.warnings);
            total.errors.extend(
                r.errors
                    .into_iter()
                    .map(|m| format!("{}: {m}", b.display())),
            );
            if r.interrupted {
                total.interrupted = true;
                return Ok(total);
            }
        }
    }
    Ok(total)
}
