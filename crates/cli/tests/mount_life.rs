//! The mount's life at its edges (issue 12): an image someone else uses (item 4), a
//! server killed with SIGKILL (item 6), `rext4 umount` beside a second read-only mount
//! of the image (item 8), where the server's messages go (item 13), and what the
//! io_uring warning tells a user without CAP_SYS_NICE (item 14).
//!
//! Every sequence ends with e2fsck -fn clean and the acknowledged (fsynced) data read
//! back. Foreground mounts are `Mounted` guards; daemons (`rext4 mount` without `-f`)
//! are `Daemon` guards, which unmount lazily and kill the server if a test fails.

mod fuse_mount;

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use fuse_mount::{bin, cannot_mount, is_mounted, wait_child, Mounted};
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, LoopMount, MkfsOptions, TempDir};

fn image() -> Image {
    mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs.ext4")
}

fn fsck_clean(img: &Path) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "e2fsck -fn not clean:\n{}", r.output);
}

fn rext4<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run rext4")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn spec(img: &Path, p: &str) -> String {
    format!("{}:{p}", img.display())
}

/// Write `data` to `p` and fsync it and its directory: acknowledged.
fn write_synced(p: &Path, data: &[u8]) {
    let mut f = File::create(p).expect("create");
    f.write_all(data).expect("write");
    f.sync_all().expect("fsync");
    let dir = p.parent().expect("parent");
    File::open(dir)
        .and_then(|d| d.sync_all())
        .expect("fsync dir");
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The pids holding a flock on `img` (from /proc/locks).
fn lock_holders(img: &Path) -> Vec<i32> {
    let m = fs::metadata(img).expect("stat image");
    let dev = m.dev();
    let (ma, mi) = (
        ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff),
        (dev & 0xff) | ((dev >> 12) & !0xff),
    );
    let want = format!("{ma:02x}:{mi:02x}:{}", m.ino());
    let text = fs::read_to_string("/proc/locks").expect("/proc/locks");
    let mut pids: Vec<i32> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 5 && f[1] == "FLOCK" && f[5] == want).then(|| f[4].parse().ok())?
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .is_some_and(|zombie| !zombie)
}

fn wait_gone(pid: i32, limit: Duration) -> bool {
    let t0 = Instant::now();
    while alive(pid) {
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn kill9(pid: i32) {
    // SAFETY: signalling a server this test started.
    assert_eq!(
        unsafe { libc::kill(pid, libc::SIGKILL) },
        0,
        "kill -9 {pid}"
    );
    assert!(
        wait_gone(pid, Duration::from_secs(10)),
        "{pid} survived SIGKILL"
    );
}

/// The mount point of a killed server answers ENOTCONN once the kernel has aborted
/// the connection (ECONNABORTED or ECANCELED to requests caught in the abort).
fn assert_disconnected(p: &Path) {
    let t0 = Instant::now();
    loop {
        let e = fs::metadata(p).err().and_then(|e| e.raw_os_error());
        if e == Some(libc::ENOTCONN) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{}: stat gives {e:?}, not ENOTCONN",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A daemonized `rext4 mount` (no `-f`): on drop, unmounted lazily and its servers
/// killed if the test left them running.
struct Daemon {
    mnt: TempDir,
    pids: Vec<i32>,
}

impl Daemon {
    fn new(prefix: &str) -> Daemon {
        Daemon {
            mnt: TempDir::new(prefix).expect("mount point"),
            pids: Vec::new(),
        }
    }

    fn path(&self) -> &Path {
        self.mnt.path()
    }

    /// `rext4 mount [-o opts] img mnt`; the output, and the new servers noted.
    fn mount(&mut self, img: &Path, opts: &[&str], cwd: Option<&Path>) -> Output {
        let before = lock_holders(img);
        let mut c = Command::new(bin());
        c.arg("mount");
        for o in opts {
            c.args(["-o", o]);
        }
        c.arg(img).arg(self.path()).stdin(Stdio::null());
        if let Some(d) = cwd {
            c.current_dir(d);
        }
        let out = c.output().expect("run rext4 mount");
        self.pids.extend(
            lock_holders(img)
                .into_iter()
                .filter(|p| !before.contains(p) && *p != std::process::id() as i32),
        );
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if is_mounted(self.path()) {
            let _ = Command::new("umount").arg("-l").arg(self.path()).status();
        }
        for &p in &self.pids {
            if !wait_gone(p, Duration::from_secs(5)) {
                // SAFETY: a server this test started.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        if is_mounted(self.path()) {
            self.mnt.leak();
        }
    }
}

/// The loop device backing the kernel mount at `mnt`.
fn loop_device_of(mnt: &Path) -> String {
    let info = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let want = mnt.to_str().expect("utf-8 path");
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (left.split(' ').nth(4) == Some(want)).then(|| right.split(' ').nth(1))?
        })
        .expect("mount listed")
        .to_string()
}

/// Wait until no loop device is bound to `img` any more (the kernel releases a
/// mount's autoclear loop device as the mount goes, possibly a moment later).
fn wait_loop_released(img: &Path) {
    let t0 = Instant::now();
    loop {
        let out = Command::new("losetup")
            .arg("-j")
            .arg(img)
            .output()
            .expect("losetup -j");
        if out.stdout.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "loop device not released: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Item 4: while the kernel has the image loop-mounted, every rext4 entry point that
/// writes refuses it, naming the loop device and the mount point; reading works and
/// warns. Before the fix both wrote, and e2fsck found the image corrupt.
#[test]
fn every_writer_refuses_a_loop_mounted_image() {
    let img = image();
    let m = match LoopMount::new(img.path(), false, "") {
        Ok(m) => m,
        Err(e) => return skip(&e),
    };
    write_synced(&m.path().join("kernel-file"), b"the kernel's");
    m.sync();
    let dev = loop_device_of(m.path());
    let mnt = m.path().to_str().expect("utf-8").to_string();
    let refused = |what: &str, out: &Output, needle: &str| {
        let err = stderr(out);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(
            err.contains("in use") && err.contains(needle),
            "{what}: {err}"
        );
    };
    let naming = format!("{dev} is mounted at {mnt}");
    refused(
        "mkdir",
        &rext4(&["mkdir", &spec(img.path(), "/x")]),
        &naming,
    );
    refused(
        "mkfs",
        &rext4(&["mkfs".as_ref(), "-q".as_ref(), img.path().as_os_str()]),
        &naming,
    );
    if cannot_mount().is_none() {
        let mut d = Daemon::new("fusemnt-loop");
        let out = d.mount(img.path(), &[], None);
        refused("mount", &out, &naming);
        assert!(!is_mounted(d.path()));
    }
    // The device path: mounted, so its exclusive open is refused.
    refused(
        "mkdir on the device",
        &rext4(&["mkdir", &format!("{dev}:/x")]),
        &format!("mounted at {mnt}"),
    );
    refused(
        "mkfs on the device",
        &rext4(&["mkfs", "-q", &dev]),
        &format!("mounted at {mnt}"),
    );
    // Reading works, with a warning.
    let out = rext4(&["ls", &spec(img.path(), "/")]);
    assert!(out.status.success(), "ls: {}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("kernel-file"));
    assert!(
        stderr(&out).contains("in use by a writer") && stderr(&out).contains(&dev),
        "ls: {}",
        stderr(&out)
    );
    m.unmount().expect("unmount");
    wait_loop_released(img.path());
    fsck_clean(img.path());
    let out = rext4(&["cat", &spec(img.path(), "/kernel-file")]);
    assert_eq!(out.stdout, b"the kernel's", "{}", stderr(&out));
    // Free again: written, clean.
    let out = rext4(&["mkdir", &spec(img.path(), "/x")]);
    assert!(out.status.success(), "mkdir after: {}", stderr(&out));
    fsck_clean(img.path());
}

/// Item 4 (c): the CLI's writers and a rext4 mount coordinate through the engine's
/// claim, and the refusal names the mount's server.
#[test]
fn a_rext4_mount_keeps_cli_writers_out_and_is_named() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let img = image();
    let mut m = Mounted::new(img.path(), &[]);
    let data = pattern(7, 300_000);
    write_synced(&m.join("f"), &data);
    let out = rext4(&["mkdir", &spec(img.path(), "/x")]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("in use")
            && err.contains(&format!("pid {}", m.pid()))
            && err.contains("mount"),
        "{err}"
    );
    let out = rext4(&["ls", &spec(img.path(), "/")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("in use by a writer"),
        "{}",
        stderr(&out)
    );
    assert!(m.unmount().success(), "{}", m.stderr());
    fsck_clean(img.path());
    let fs = rext4::Fs::open(img.path()).expect("open");
    assert_eq!(fs.read("/f").expect("read"), data);
    assert!(fs.read_dir("/x").is_err(), "mkdir was refused");
}

/// Item 6: after kill -9 of the server, `rext4 umount` detaches the dead mount and
/// recovers the image (exit 0, saying so), and `rext4 mount` over a dead mount point
/// detaches it and mounts again. Before the fix: "not a rext4 mount" and "not a
/// directory". Everything fsynced before the kill reads back; e2fsck clean after each.
#[test]
fn a_killed_server_is_cleaned_up_by_umount_and_by_mount() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let img = image();
    let a = pattern(1, 1 << 20);
    let b = pattern(2, 123_457);
    {
        let m = Mounted::new(img.path(), &[]);
        fs::create_dir(m.join("dir")).expect("mkdir");
        write_synced(&m.join("dir/a"), &a);
        // The guard keeps the (now dead) child, so it still unmounts if a check fails.
        kill9(m.pid());
        assert_disconnected(m.path());
        let out = rext4(&["umount".as_ref(), m.path().as_os_str()]);
        assert!(out.status.success(), "umount: {}", stderr(&out));
        assert!(stderr(&out).contains("had died"), "{}", stderr(&out));
        assert!(!is_mounted(m.path()), "dead mount left behind");
    }
    fsck_clean(img.path());
    {
        let fs = rext4::Fs::open(img.path()).expect("open");
        assert_eq!(fs.read("/dir/a").expect("read a"), a);
    }
    // A daemon killed, then `rext4 mount` onto its dead mount point.
    let mut d = Daemon::new("fusemnt-dead");
    let out = d.mount(img.path(), &[], None);
    assert!(out.status.success(), "mount: {}", stderr(&out));
    assert_eq!(d.pids.len(), 1, "one server: {:?}", d.pids);
    write_synced(&d.path().join("dir/b"), &b);
    kill9(d.pids[0]);
    assert_disconnected(d.path());
    let out = d.mount(img.path(), &[], None);
    assert!(
        out.status.success(),
        "mount over a dead mount: {}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("had died"), "{}", stderr(&out));
    assert_eq!(fs::read(d.path().join("dir/a")).expect("read a"), a);
    assert_eq!(fs::read(d.path().join("dir/b")).expect("read b"), b);
    let out = rext4(&["umount".as_ref(), d.path().as_os_str()]);
    assert!(out.status.success(), "umount: {}", stderr(&out));
    assert!(!is_mounted(d.path()));
    fsck_clean(img.path());
    let fs = rext4::Fs::open(img.path()).expect("open");
    assert_eq!(fs.read("/dir/b").expect("read b"), b);
}

/// Item 8: with two read-only mounts of one image, `rext4 umount` of each returns at
/// once and its own server is gone, though the other still holds the image's shared
/// lock. Before the fix the first waited for an exclusive lock until its timeout.
#[test]
fn umount_beside_another_read_only_mount_is_prompt() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let img = image();
    let data = pattern(3, 200_000);
    {
        let fs = rext4::Fs::open_with(
            img.path(),
            rext4::FsOptions {
                read_only: false,
                ..rext4::FsOptions::default()
            },
        )
        .expect("open");
        fs.write("/f", &data).expect("write");
        fs.close().expect("close");
    }
    let mut one = Daemon::new("fusemnt-ro1");
    let mut two = Daemon::new("fusemnt-ro2");
    for d in [&mut one, &mut two] {
        let out = d.mount(img.path(), &["ro"], None);
        assert!(out.status.success(), "mount ro: {}", stderr(&out));
        assert_eq!(d.pids.len(), 1, "one server: {:?}", d.pids);
    }
    for (d, other) in [(&one, Some(&two)), (&two, None)] {
        // A bounded wait: the fix makes it prompt; without it this fails after 10 s.
        let out = rext4(&[
            "umount".as_ref(),
            "--timeout".as_ref(),
            "10".as_ref(),
            d.path().as_os_str(),
        ]);
        assert!(out.status.success(), "umount: {}", stderr(&out));
        assert!(!is_mounted(d.path()));
        assert!(
            wait_gone(d.pids[0], Duration::from_secs(5)),
            "server {} still running",
            d.pids[0]
        );
        if let Some(o) = other {
            assert!(alive(o.pids[0]), "the other server went too");
            assert_eq!(fs::read(o.path().join("f")).expect("read"), data);
        }
    }
    fsck_clean(img.path());
}

/// Item 13: `-o log=FILE` (a relative name: the daemon works in /) gets the server's
/// messages — open warnings (here: an image with quota, mounted read-only) and what
/// it does after start-up, when its standard error is gone; the warnings also reach
/// the user of `rext4 mount`. Without log=, the daemon logs to syslog, which works
/// also where nothing listens on /dev/log.
#[test]
fn a_daemon_logs_to_the_file_it_is_given_or_to_syslog() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let img = match mkfs(&MkfsOptions::new(4096, 32 << 20).arg("-O").arg("quota")) {
        Ok(i) => i,
        Err(e) => return skip(&format!("mkfs -O quota: {e}")),
    };
    let work = TempDir::new("logdir").expect("tempdir");
    let mut d = Daemon::new("fusemnt-log");
    let out = d.mount(img.path(), &["log=server.log"], Some(work.path()));
    assert!(out.status.success(), "mount: {}", stderr(&out));
    assert!(
        stderr(&out).contains("quota"),
        "warning shown: {}",
        stderr(&out)
    );
    assert!(fs::read_dir(d.path()).is_ok(), "mount serves");
    let out = rext4(&["umount".as_ref(), d.path().as_os_str()]);
    assert!(out.status.success(), "umount: {}", stderr(&out));
    let log = fs::read_to_string(work.join("server.log")).expect("log file");
    let pid = d.pids.first().copied().unwrap_or(0);
    for needle in [
        format!("rext4[{pid}]"),
        "WARN: ".to_string(),
        "quota".to_string(),
        format!("INFO: mounted {}", img.path().display()),
        "INFO: unmounted".to_string(),
    ] {
        assert!(log.contains(&needle), "{needle:?} not in the log:\n{log}");
    }
    // syslog (the default): works whether or not /dev/log exists.
    let mut d = Daemon::new("fusemnt-syslog");
    let out = d.mount(img.path(), &[], None);
    assert!(out.status.success(), "mount: {}", stderr(&out));
    assert!(fs::read_dir(d.path()).is_ok(), "mount serves");
    let out = rext4(&["umount".as_ref(), d.path().as_os_str()]);
    assert!(out.status.success(), "umount: {}", stderr(&out));
    fsck_clean(img.path());
}

/// A `rext4 mount -f` started through `wrap` (a command prefix); unmounted and
/// reaped on drop.
struct Wrapped {
    child: Child,
    mnt: PathBuf,
}

impl Wrapped {
    fn new(wrap: &[&str], img: &Path, mnt: &Path, log: &Path) -> Wrapped {
        let (cmd, pre) = wrap.split_first().expect("a command");
        let err = log.with_extension("stderr");
        let child = Command::new(cmd)
            .args(pre)
            .arg(bin())
            .args(["mount", "-f", "-o"])
            .arg(format!("log={}", log.display()))
            .arg(img)
            .arg(mnt)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&err).expect("stderr file"))
            .spawn()
            .expect("spawn");
        let mut w = Wrapped {
            child,
            mnt: mnt.to_path_buf(),
        };
        let t0 = Instant::now();
        while !is_mounted(mnt) {
            if let Ok(Some(st)) = w.child.try_wait() {
                panic!(
                    "mount exited {st}: {}{}",
                    fs::read_to_string(&err).unwrap_or_default(),
                    fs::read_to_string(log).unwrap_or_default()
                );
            }
            assert!(t0.elapsed() < Duration::from_secs(15), "no mount");
            std::thread::sleep(Duration::from_millis(10));
        }
        w
    }
}

impl Drop for Wrapped {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg(&self.mnt).status();
        }
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        if wait_child(&mut self.child, Duration::from_secs(20)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn uring_unavailable() -> Option<String> {
    let p = "/sys/module/fuse/parameters/enable_uring";
    match fs::read_to_string(p) {
        Err(_) => Some(format!("{p} missing: no FUSE-over-io_uring")),
        Ok(v) if v.trim() != "Y" => Some(format!("{p} is N: FUSE-over-io_uring is off")),
        Ok(_) => None,
    }
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Item 14: a server that may not switch its threads' scheduling class (no
/// CAP_SYS_NICE, RLIMIT_NICE 0) says how to get FUSE-over-io_uring, and the advice
/// holds: with RLIMIT_NICE 20 and still no CAP_SYS_NICE it serves through io_uring.
#[test]
fn the_io_uring_warning_says_what_to_do_and_the_advice_works() {
    if let Some(why) = cannot_mount().or_else(uring_unavailable) {
        return skip(&why);
    }
    if !have("setpriv") || !have("prlimit") {
        return skip("setpriv or prlimit (util-linux) missing");
    }
    let img = image();
    let dir = TempDir::new("uringadvice").expect("tempdir");
    // Raising a hard limit needs CAP_SYS_RESOURCE, which some sandboxes withhold.
    let can_raise = Command::new("prlimit")
        .args(["--nice=20:20", "--", "true"])
        .status()
        .is_ok_and(|s| s.success());
    for (limit, advised) in [("--nice=0:0", true), ("--nice=20:20", false)] {
        if !advised && !can_raise {
            rext4_testkit::skip_without_capability(
                rext4_testkit::CAP_SYS_RESOURCE,
                "cannot raise RLIMIT_NICE here: the advice's effect is not checked",
            );
            break;
        }
        let mnt = dir.join(format!("mnt{advised}"));
        fs::create_dir(&mnt).expect("mount point");
        let log = dir.join(format!("log{advised}"));
        {
            let wrap = [
                "prlimit",
                limit,
                "--",
                "setpriv",
                "--bounding-set",
                "-sys_nice",
                "--",
            ];
            let _m = Wrapped::new(&wrap, img.path(), &mnt, &log);
            assert!(fs::read_dir(&mnt).is_ok(), "mount serves");
        }
        let text = fs::read_to_string(&log).expect("log");
        if advised {
            for needle in [
                "io_uring not used",
                "run as root",
                "RLIMIT_NICE to 20",
                "ulimit -e 20",
            ] {
                assert!(text.contains(needle), "{needle:?} not in:\n{text}");
            }
        } else {
            assert!(
                text.contains("serving through FUSE-over-io_uring"),
                "RLIMIT_NICE 20 without CAP_SYS_NICE:\n{text}"
            );
        }
    }
    fsck_clean(img.path());
}
