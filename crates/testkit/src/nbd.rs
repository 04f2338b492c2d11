//! NBD servers for tests: [`NbdServer`] runs nbdkit (any plugin, any filters) on a
//! Unix socket in a temporary directory and kills it on drop.
//!
//! Must hold: the server is this process's child, killed (SIGKILL) and reaped when the
//! guard drops, also when a test panics; its socket lives in the guard's own
//! directory. nbdkit runs in the foreground (`-f`) with `--exit-with-parent`, so a
//! test process killed outright takes its servers with it. Callers: the NBD tests.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::tmp::TempDir;

/// Whether nbdkit is installed (`Err`: why not, for `skip`).
pub fn have_nbdkit() -> Result<(), String> {
    match Command::new("nbdkit")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(()),
        _ => Err("nbdkit is not installed (Debian package nbdkit)".into()),
    }
}

/// Whether libnbd's shared library is there (the engine loads it at run time).
pub fn have_libnbd() -> Result<(), String> {
    let ok = [
        "/usr/lib/x86_64-linux-gnu/libnbd.so.0",
        "/usr/lib/aarch64-linux-gnu/libnbd.so.0",
        "/usr/lib64/libnbd.so.0",
        "/usr/lib/libnbd.so.0",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    if ok {
        Ok(())
    } else {
        Err("libnbd is not installed (Debian package libnbd0)".into())
    }
}

/// A running nbdkit, serving on a Unix socket until dropped.
pub struct NbdServer {
    child: Option<Child>,
    socket: PathBuf,
    dir: TempDir,
}

impl NbdServer {
    /// `nbdkit [--filter=F]... PLUGIN ARGS...` on a fresh socket; returns once the
    /// server accepts connections. `filters` and `args` go as given (`"file"`,
    /// `["file=/x.img"]`, filters `["delay"]` with args `["delay-read=5ms"]`).
    pub fn start(plugin: &str, filters: &[&str], args: &[&str]) -> io::Result<NbdServer> {
        let dir = TempDir::new("nbd")?;
        let socket = dir.join("nbd.sock");
        let mut cmd = Command::new("nbdkit");
        cmd.args(["-f", "--exit-with-parent", "--unix"])
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for f in filters {
            cmd.arg(format!("--filter={f}"));
        }
        cmd.arg(plugin).args(args);
        let child = cmd.spawn()?;
        let mut s = NbdServer {
            child: Some(child),
            socket,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !s.socket.exists() {
            if let Some(c) = s.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    s.child = None;
                    return Err(io::Error::other(format!(
                        "nbdkit {plugin} {args:?} exited at start: {st}"
                    )));
                }
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("nbdkit did not create its socket in 20 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(s)
    }

    /// The file plugin over `image` (writes go to the file; trim punches holes).
    pub fn file(image: &Path) -> io::Result<NbdServer> {
        let a = format!("file={}", image.display());
        Self::start("file", &[], &[&a])
    }

    /// The memory plugin: a sparse disk of `size` bytes in the server's memory.
    pub fn memory(size: u64) -> io::Result<NbdServer> {
        Self::start("memory", &[], &[&format!("size={size}")])
    }

    /// `nbd+unix:///?socket=PATH`: the URI an image spec takes.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A directory that lives as long as the server (for error files and such).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL the server now (a server that dies mid-workload).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP the server (a hung server); drop or [`NbdServer::kill`] still ends it.
    pub fn pause(&self) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGSTOP) };
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
