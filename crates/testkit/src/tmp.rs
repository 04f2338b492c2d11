//! Scratch directories and image files that clean up after themselves.
//!
//! Owns: `TempDir` (a fresh directory under `std::env::temp_dir()`, removed with its
//! contents on drop) and `Image` (an image file inside its own `TempDir`).
//! Must hold: names are unique across threads and processes (pid + counter + clock);
//! nothing is removed that this module did not create. A mount point that could not be
//! unmounted is leaked on purpose (`TempDir::leak`) so that drop never recurses into a
//! live mount.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A directory removed (recursively) on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    /// Creates `$TMPDIR/rext4-<prefix>-<pid>-<n>-<nanos>`.
    pub fn new(prefix: &str) -> io::Result<TempDir> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    /// Creates `<base>/rext4-<prefix>-<pid>-<n>-<nanos>`.
    pub fn new_in(base: &Path, prefix: &str) -> io::Result<TempDir> {
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let path = base.join(format!(
                "rext4-{prefix}-{}-{n}-{nanos:09}",
                std::process::id()
            ));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(TempDir { path, keep: false }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path().join(name)`.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    /// Do not remove the directory on drop (used for a mount point that is still busy,
    /// or to keep an image for post-mortem debugging).
    pub fn leak(&mut self) {
        self.keep = true;
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Where files that must live in memory go (DAX backing stores): /dev/shm (tmpfs)
/// when it exists, else the temporary directory.
pub fn memory_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// An image file inside its own `TempDir`; both are removed on drop.
#[derive(Debug)]
pub struct Image {
    path: PathBuf,
    dir: TempDir,
}

impl Image {
    /// Creates an empty sparse file of `size_bytes` named `fs.img` in a fresh `TempDir`.
    pub fn create_sparse(size_bytes: u64) -> io::Result<Image> {
        let dir = TempDir::new("img")?;
        let path = dir.join("fs.img");
        let f = std::fs::File::create(&path)?;
        f.set_len(size_bytes)?;
        Ok(Image { path, dir })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory holding the image; free for the test's other scratch files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A sparse copy of this image (`cp --sparse=always`) in a fresh `TempDir`.
    pub fn duplicate(&self) -> io::Result<Image> {
        let dir = TempDir::new("img")?;
        let path = dir.join("fs.img");
        let out = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(&self.path)
            .arg(&path)
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "cp failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(Image { path, dir })
    }

    /// A copy of this image in memory (`memory_dir`, tmpfs), for DAX tests.
    pub fn copy_to_memory(&self) -> io::Result<Image> {
        let dir = TempDir::new_in(&memory_dir(), "shm")?;
        let path = dir.join("fs.img");
        std::fs::copy(&self.path, &path)?;
        Ok(Image { path, dir })
    }

    /// Keeps the image file (and its directory) after drop, e.g. to inspect a failure.
    pub fn keep(mut self) -> PathBuf {
        self.dir.leak();
        self.path.clone()
    }
}

impl AsRef<Path> for Image {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tempdir_is_unique_and_removed() {
        let a = TempDir::new("t").expect("tempdir");
        let b = TempDir::new("t").expect("tempdir");
        assert_ne!(a.path(), b.path());
        std::fs::write(a.join("x"), b"hi").expect("write");
        let p = a.path().to_path_buf();
        drop(a);
        assert!(!p.exists());
    }

    #[test]
    fn image_is_sparse_and_removed() {
        let img = Image::create_sparse(64 << 20).expect("image");
        let md = std::fs::metadata(img.path()).expect("stat");
        assert_eq!(md.len(), 64 << 20);
        let p = img.path().to_path_buf();
        drop(img);
        assert!(!p.exists());
    }
}
