//! What the mount tests share: the FUSE mount guard (a running `rext4 mount -f IMAGE
//! MNT` that is unmounted — fusermount3 -u, then umount -l — and reaped on drop, even
//! when the test panics), a watchdog that kills a stuck server, and renameat2(2).
#![allow(dead_code)]

use std::ffi::CString;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rext4_testkit::TempDir;

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rext4")
}

pub fn is_mounted(mnt: &Path) -> bool {
    let want = mnt.as_os_str().as_bytes();
    fs::read("/proc/self/mountinfo").is_ok_and(|t| {
        t.split(|&b| b == b'\n')
            .any(|l| l.split(|&b| b == b' ').nth(4) == Some(want))
    })
}

pub fn wait_child(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let t0 = Instant::now();
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if t0.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `rext4 mount -f IMAGE MNT`; unmounted and reaped on drop.
pub struct Mounted {
    child: Option<Child>,
    mnt: TempDir,
    log: PathBuf,
}

impl Mounted {
    pub fn new(img: &Path, opts: &[&str]) -> Mounted {
        Self::new_with_env(img, opts, &[])
    }

    /// [`Mounted::new`] with these variables set in the server's environment.
    pub fn new_with_env(img: &Path, opts: &[&str], env: &[(&str, &str)]) -> Mounted {
        let mnt = TempDir::new("fusemnt").expect("mount point");
        let log = mnt.path().with_extension("log");
        let mut cmd = Command::new(bin());
        cmd.envs(env.iter().copied());
        cmd.arg("mount").arg("-f");
        for o in opts {
            cmd.args(["-o", o]);
        }
        let child = cmd
            .arg(img)
            .arg(mnt.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn rext4 mount");
        let mut m = Mounted {
            child: Some(child),
            mnt,
            log,
        };
        let t0 = Instant::now();
        while !is_mounted(m.path()) {
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("rext4 mount exited ({st}) before mounting: {}", m.stderr());
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "mount did not appear: {}",
                m.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        m
    }

    pub fn path(&self) -> &Path {
        self.mnt.path()
    }

    pub fn join(&self, p: &str) -> PathBuf {
        self.mnt.join(p)
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Unmount, wait for the server to commit and exit; returns its exit status.
    pub fn unmount(&mut self) -> ExitStatus {
        let st = self.stop();
        assert!(!is_mounted(self.path()), "still mounted after unmount");
        st.unwrap_or_else(|| panic!("rext4 mount did not exit: {}", self.stderr()))
    }

    /// Wait for the server to exit by itself (after a signal).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let st = wait_child(self.child.as_mut()?, limit);
        if st.is_some() {
            self.child = None;
        }
        st
    }

    /// Unmount (also a dead mount whose server was already reaped by `wait_exit`),
    /// then wait for the server; its exit status if it was still ours to reap.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let child = self.child.take();
        for attempt in 0..50 {
            if !is_mounted(self.path()) {
                break;
            }
            let ok = Command::new("fusermount3")
                .arg("-u")
                .arg(self.path())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                break;
            }
            std::thread::sleep(Duration::from_millis(if attempt < 10 { 20 } else { 100 }));
        }
        if is_mounted(self.path()) {
            let _ = Command::new("umount").arg("-l").arg(self.path()).status();
        }
        let mut child = child?;
        let st = wait_child(&mut child, Duration::from_secs(30));
        if st.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        st
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        self.stop();
        if is_mounted(self.path()) {
            self.mnt.leak();
        }
        let _ = fs::remove_file(&self.log);
    }
}

/// Kills the server `pid` if the guard is not dropped within `limit` (a stuck request
/// then fails the test instead of blocking it).
pub struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    pub fn new(label: &'static str, pid: i32, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d2 = Arc::clone(&done);
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !d2.load(Ordering::SeqCst) {
                if t0.elapsed() > limit {
                    eprintln!("{label}: stuck for {limit:?}: killing rext4 server {pid}");
                    // SAFETY: signalling the server process this test spawned.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
    }
}

/// A path as a C string (test paths hold no NUL).
pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

/// statvfs(3) of `p`.
pub fn statvfs(p: &Path) -> std::io::Result<libc::statvfs> {
    let c = cpath(p);
    // SAFETY: statvfs with a valid path and a zeroed out-struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// renameat2(2) relative to the working directory.
pub fn renameat2(from: &Path, to: &Path, flags: u32) -> std::io::Result<()> {
    let (a, b) = (cpath(from), cpath(to));
    // SAFETY: two valid NUL-terminated paths; AT_FDCWD.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Why FUSE mounts cannot run here, if they cannot (printed as the skip reason).
pub fn cannot_mount() -> Option<String> {
    if std::env::var_os("REXT4_NO_MOUNT").is_some() {
        return Some("REXT4_NO_MOUNT is set".into());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    None
}
