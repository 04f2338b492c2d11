//! Kernel loop mounts of test images, released by a drop guard.
//!
//! Owns: `can_loop_mount` (may this process mount at all?), `LoopMount` (an image
//! mounted with `mount -o loop` at a fresh `TempDir`), `LoopDevice` (a file attached
//! to a loop device, nothing mounted: a block device for a test to write to).
//! Must hold: every mount is undone on drop, also while a test panics: only a few loop
//! devices exist and a leaked one starves every later test. `mount -o loop` sets the
//! loop device to autoclear, so `umount` also frees the loop device; a busy mount is
//! retried and then lazily unmounted (`umount -l`). A mount point that still cannot be
//! unmounted is never deleted recursively.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::tmp::TempDir;

/// Whether this process can loop-mount ext4: root, `/dev/loop-control`, ext4 known to
/// the kernel, and `REXT4_NO_MOUNT` unset. `Err` holds the reason to print.
pub fn can_loop_mount() -> Result<(), String> {
    if std::env::var_os("REXT4_NO_MOUNT").is_some() {
        return Err("REXT4_NO_MOUNT is set".into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root: loop mounts need root".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("no /dev/loop-control".into());
    }
    match std::fs::read_to_string("/proc/filesystems") {
        Ok(s)
            if s.lines()
                .any(|l| l.split_whitespace().last() == Some("ext4")) =>
        {
            Ok(())
        }
        Ok(_) => Err("kernel does not list ext4 in /proc/filesystems".into()),
        Err(e) => Err(format!("cannot read /proc/filesystems: {e}")),
    }
}

/// An ext4 image mounted through a loop device; unmounted on drop.
#[derive(Debug)]
pub struct LoopMount {
    dir: TempDir,
    img: PathBuf,
    mounted: bool,
}

impl LoopMount {
    /// Mounts `img` (`-t ext4 -o loop[,ro][,extra_opts]`) at a fresh temp directory.
    /// `Err` is a reason to skip (not root, no loop device, mount refused...).
    pub fn new(img: &Path, ro: bool, extra_opts: &str) -> Result<LoopMount, String> {
        can_loop_mount()?;
        let dir = TempDir::new("mnt").map_err(|e| format!("mount point: {e}"))?;
        let mut opts = String::from("loop");
        if ro {
            opts.push_str(",ro");
        }
        let extra = extra_opts.trim_matches(',');
        if !extra.is_empty() {
            opts.push(',');
            opts.push_str(extra);
        }
        // Loop devices are few and shared with other tests: when none is free, wait a
        // little for one to be released instead of skipping at once.
        let mut attempt = 0;
        loop {
            let out = Command::new("mount")
                .args(["-t", "ext4", "-o", &opts])
                .arg(img)
                .arg(dir.path())
                .output()
                .map_err(|e| format!("cannot run mount: {e}"))?;
            if out.status.success() {
                break;
            }
            let stderr = String::from_utf8_lossy(&out.stderr);
            let no_loop = stderr.contains("failed to setup loop device")
                || stderr.contains("free loop device");
            attempt += 1;
            if attempt >= 20 || !no_loop {
                return Err(format!(
                    "mount -o {opts} {} failed: {}{}",
                    img.display(),
                    String::from_utf8_lossy(&out.stdout).trim(),
                    stderr.trim()
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Ok(LoopMount {
            dir,
            img: img.to_path_buf(),
            mounted: true,
        })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The mounted image file.
    pub fn image(&self) -> &Path {
        &self.img
    }

    /// `syncfs` on the mounted filesystem.
    pub fn sync(&self) {
        sync_path(self.path());
    }

    /// Unmounts now and reports failure (drop does the same silently).
    pub fn unmount(mut self) -> Result<(), String> {
        self.do_unmount()
    }

    fn do_unmount(&mut self) -> Result<(), String> {
        if !self.mounted {
            return Ok(());
        }
        sync_path(self.path());
        let mut last = String::new();
        for attempt in 0..20 {
            match run_umount(self.path(), false) {
                Ok(()) => {
                    self.mounted = false;
                    return Ok(());
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(if attempt < 5 { 20 } else { 100 }));
        }
        match run_umount(self.path(), true) {
            Ok(()) => {
                self.mounted = false;
                Err(format!(
                    "{} was busy ({last}); lazily unmounted",
                    self.path().display()
                ))
            }
            Err(e) => {
                // Never remove_dir_all into a live mount.
                self.dir.leak();
                self.mounted = false;
                Err(format!(
                    "cannot unmount {}: {last}; umount -l: {e}",
                    self.path().display()
                ))
            }
        }
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if let Err(e) = self.do_unmount() {
            eprintln!("rext4-testkit: {e}");
        }
    }
}

fn run_umount(path: &Path, lazy: bool) -> Result<(), String> {
    let mut cmd = Command::new("umount");
    if lazy {
        cmd.arg("-l");
    }
    let out = cmd
        .arg(path)
        .output()
        .map_err(|e| format!("cannot run umount: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

pub(crate) fn sync_path(path: &Path) {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: `c` is a valid NUL-terminated path; the fd is closed right after use.
    unsafe {
        let fd = libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::syncfs(fd);
            libc::close(fd);
        }
    }
}

/// A file attached to a free loop device (`losetup -f --show`), detached on drop.
#[derive(Debug)]
pub struct LoopDevice {
    dev: PathBuf,
}

impl LoopDevice {
    /// Attaches `file`. `Err` is a reason to skip (not root, no free loop device...).
    pub fn attach(file: &Path) -> Result<LoopDevice, String> {
        LoopDevice::attach_with(file, &[])
    }

    /// Attaches `file` with more `losetup` options (`--offset N`, `--read-only`...).
    pub fn attach_with(file: &Path, args: &[&str]) -> Result<LoopDevice, String> {
        can_loop_mount()?;
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .args(args)
            .arg(file)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup -f --show {}: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Ok(LoopDevice { dev: dev.into() })
    }

    /// The device node (`/dev/loopN`).
    pub fn path(&self) -> &Path {
        &self.dev
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        // A device still open elsewhere is detached once closed (autoclear).
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}
