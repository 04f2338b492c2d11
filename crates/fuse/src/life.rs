//! The ends of a mount's life seen from outside the server: `rext4 umount` waiting for
//! the server of one mount, and a mount whose server died.
//!
//! Waiting for the server: every server holds a shared `flock` on its mount point's
//! directory — opened before mounting, so it is the directory under the mount — from
//! before the mount until the image is closed (`hold_mountpoint`). Once the mount is
//! gone the path leads to that directory again, and `wait_for_server` takes the lock
//! exclusively: granted when that mount's server is done, whatever other mounts of the
//! same image (two read-only ones share the image's lock) still run. It works for any
//! user who may open the directory; root for everyone's mounts.
//!
//! A dead server: after `kill -9` the kernel aborts the connection and the mount point
//! answers ENOTCONN. It is recognised as a rext4 mount by its mountinfo entry (type
//! fuse.rext4, or fuse with an ext4 image as its source), detached (umount2 with
//! MNT_DETACH, or `fusermount3 -u -z` without root), and the image left by it is
//! recovered by the engine's open (journal replay, orphans).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A mount as /proc/self/mountinfo lists it.
pub(crate) struct MountEntry {
    pub(crate) fstype: String,
    pub(crate) source: PathBuf,
    pub(crate) read_only: bool,
}

/// The last (topmost) mountinfo entry whose mount point is `mnt`.
pub(crate) fn mount_entry(mnt: &Path) -> Option<MountEntry> {
    let info = std::fs::read("/proc/self/mountinfo").ok()?;
    let want = mnt.as_os_str().as_bytes();
    info.split(|&b| b == b'\n')
        .filter_map(|l| {
            let text = String::from_utf8_lossy(l);
            let (left, right) = text.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            if f.len() < 6 || crate::unescape_mountinfo(f[4]).as_slice() != want {
                return None;
            }
            Some(MountEntry {
                fstype: (*r.first()?).to_string(),
                source: PathBuf::from(std::ffi::OsString::from_vec(crate::unescape_mountinfo(
                    r.get(1)?,
                ))),
                read_only: f[5].split(',').any(|o| o == "ro"),
            })
        })
        .next_back()
}

/// `p` made absolute without asking the mount point itself (a dead mount answers
/// ENOTCONN to every lookup): its parent is resolved, its name kept.
pub(crate) fn resolve_mountpoint(p: &Path) -> Result<PathBuf, String> {
    match p.canonicalize() {
        Ok(c) => Ok(c),
        Err(e) => {
            let name = p
                .file_name()
                .ok_or_else(|| format!("{}: {e}", p.display()))?;
            let parent = match p.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                _ => PathBuf::from("."),
            };
            let parent = parent
                .canonicalize()
                .map_err(|_| format!("{}: {e}", p.display()))?;
            Ok(parent.join(name))
        }
    }
}

/// Whether `mnt` is a FUSE mount whose server is gone: the kernel answers ENOTCONN
/// once the connection is aborted (ECONNABORTED to a request it aborted, ECANCELED
/// while the abort is still under way: asked again then).
fn is_disconnected(mnt: &Path) -> bool {
    for _ in 0..50 {
        match std::fs::symlink_metadata(mnt).map_err(|e| e.raw_os_error()) {
            Err(Some(libc::ENOTCONN | libc::ECONNABORTED)) => return true,
            Err(Some(libc::ECANCELED | libc::EINTR)) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => return false,
        }
    }
    false
}

/// Whether `p` holds an ext4 superblock (magic 0xEF53 at byte 1080).
fn looks_like_ext4(p: &Path) -> bool {
    let mut m = [0u8; 2];
    crate::spec_of(p)
        .and_then(|s| rext4::image::open_device(&s, true, false))
        .is_ok_and(|d| d.read_at(&mut m, 1080).is_ok())
        && m == [0x53, 0xEF]
}

/// The mountinfo entry of `mnt` when it is a rext4 mount whose server died.
pub(crate) fn dead_rext4_mount(mnt: &Path) -> Option<MountEntry> {
    let e = mount_entry(mnt)?;
    let ours = e.fstype == "fuse.rext4" || (e.fstype == "fuse" && looks_like_ext4(&e.source));
    (ours && is_disconnected(mnt)).then_some(e)
}

/// Detach the dead mount at `mnt`: umount2(MNT_DETACH), or `fusermount3 -u -z`
/// where that is not permitted (not root).
pub(crate) fn detach(mnt: &Path) -> Result<(), String> {
    let c = std::ffi::CString::new(mnt.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: umount2 with a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(format!("umount -l {}: {e}", mnt.display()));
    }
    let st = std::process::Command::new("fusermount3")
        .args(["-u", "-z", "--"])
        .arg(mnt)
        .status()
        .map_err(|e| format!("fusermount3 -u -z {}: {e}", mnt.display()))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("fusermount3 -u -z {} failed", mnt.display()))
    }
}

/// Bring the image a dead read-write server left back to clean now: an open for
/// writing replays its journal and finishes its orphans, `close` marks it clean.
/// `Ok(false)`: its journal needed no recovery, nothing was done.
pub(crate) fn recover(image: &Path) -> Result<bool, String> {
    let spec = crate::spec_of(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let mut raw = vec![0u8; 1024];
    rext4::image::open_device(&spec, true, false)
        .and_then(|d| d.read_at(&mut raw, 1024).map_err(rext4::Error::from))
        .map_err(|e| format!("{}: {e}", image.display()))?;
    let sb = rext4::format::superblock::Superblock::decode(&raw)
        .map_err(|e| format!("{}: {e}", image.display()))?;
    if !sb.has_incompat(rext4::format::superblock::feature::INCOMPAT_RECOVER) {
        return Ok(false);
    }
    let fs = rext4::Fs::open_spec(
        &spec,
        rext4::FsOptions {
            read_only: false,
            commit_secs: 0,
            ..rext4::FsOptions::default()
        },
    )
    .map_err(|e| format!("{}: {e}", image.display()))?;
    fs.close()
        .map_err(|e| format!("{}: closing: {e}", image.display()))?;
    Ok(true)
}

/// The server's hold on its mount point (see the module note): a shared flock on the
/// directory under the mount, taken before mounting. `None` when the directory cannot
/// be opened; `rext4 umount` then waits for the image's lock instead.
pub(crate) fn hold_mountpoint(mnt: &Path) -> Option<File> {
    let f = File::open(mnt).ok()?;
    // SAFETY: flock on a descriptor we own.
    (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0).then_some(f)
}

/// Wait (at most `limit`) until the server of the mount that was at `mnt` is done:
/// the mount point's lock is free. Where the directory cannot be opened, a read-write
/// mount's server is waited for by the image's lock.
pub(crate) fn wait_for_server(
    mnt: &Path,
    image: &Path,
    read_only: bool,
    limit: Duration,
) -> Result<(), String> {
    let t0 = Instant::now();
    let timeout = || {
        format!(
            "{}: the server has not closed the image after {} s",
            image.display(),
            limit.as_secs()
        )
    };
    let dir = File::open(mnt).ok();
    loop {
        let done = match &dir {
            Some(d) => {
                // SAFETY: flock on a descriptor we own; released when `dir` closes.
                let r = unsafe { libc::flock(d.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
                r == 0
            }
            None if read_only => true,
            None => match crate::lock_image(image, true) {
                Ok(_) => true,
                Err(e) if !e.contains("in use") => return Err(e),
                Err(_) => false,
            },
        };
        if done {
            return Ok(());
        }
        if t0.elapsed() > limit {
            return Err(timeout());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
