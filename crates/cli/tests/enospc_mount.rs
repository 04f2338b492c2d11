//! Full disks through the mount as applications meet them (issue 40, items 1 and 7).
//!
//! - `fill_as_root`, `fill_without_root`: on 64 MiB, 256 MiB and 1 GiB images, `dd
//!   bs=1M` and then eight writer processes of random write sizes (some opening their
//!   file late, after space ran low) fill the default mount (the kernel's writeback
//!   cache). Every byte any write() returned as written reads back after unmount, each
//!   writer is stopped by ENOSPC from write() itself (its close succeeds: nothing was
//!   accepted and dropped), the server logged no refused cached write, and e2fsck -fn is
//!   clean. Without root the mount runs as nobody in a private mount namespace (its own
//!   /dev/fuse node open to nobody, fusermount3 doing the mount) and must say at mount
//!   that the dirty-page window is the kernel's.
//! - `direct_aio_writers_race_space_changes`: O_DIRECT writers submitting 128 KiB
//!   writes 128 at a time through io_submit(2) while other threads fallocate, punch and
//!   truncate (the same files past the writers' range, and files of their own that eat
//!   and free the space) on a nearly full filesystem: every write completes whole or
//!   with ENOSPC — never EIO, which is what the kernel makes of a short answer to an
//!   asynchronous direct write — and every write that completed reads back.
//! - `fio_direct_writers_see_enospc_not_eio`: the fio run (libaio, direct,
//!   iodepth 128, beside truncate/fallocate/punch jobs) reports no I/O error.
//!
//! The fills run the release-like test build of `rext4`; a 1 GiB image is filled
//! whole (measured: a few seconds each). Helper roles (`enospc_helper`) are this test
//! binary run again: a writer process, and the whole scenario as another user.

mod fuse_mount;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_mount::{bin, cannot_mount, is_mounted, wait_child, Mounted, Watchdog};
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, mkfs, mkfs_at, skip, MkfsOptions, TempDir};

const MIB: u64 = 1 << 20;
const NOBODY: u32 = 65534;
/// What marks a cached write the server could not place (lowspace's last resort).
const REFUSED: &str = "was refused for lack of space";
/// What a mount that may not set its dirty window says at mount.
const KERNEL_WINDOW_NOTE: &str = "dirty-page window is the kernel's";

const HELPER_TEST: &str = "enospc_helper";
const ENV_ROLE: &str = "REXT4_ENOSPC_ROLE";
const ENV_PATH: &str = "REXT4_ENOSPC_PATH";
const ENV_SEED: &str = "REXT4_ENOSPC_SEED";
const ENV_WAIT: &str = "REXT4_ENOSPC_WAIT_BELOW";
const ENV_LIMIT: &str = "REXT4_ENOSPC_LIMIT";
/// What a writer may write beyond the image's size: a writer that gets that far is
/// not writing into the image (a mount point whose mount is gone fills the host).
const WRITE_MARGIN: u64 = 64 * MIB;
/// statfs's f_type of a FUSE mount.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether the open file `f` lives on a FUSE mount (not on the directory beneath a
/// mount point whose mount is gone).
fn on_fuse(f: &File) -> bool {
    // SAFETY: statfs is plain old data; fstatfs fills it for a valid descriptor.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the descriptor is open for the call.
    let r = unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) };
    r == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
}
const ENV_IMG: &str = "REXT4_ENOSPC_IMG";
const ENV_MNT: &str = "REXT4_ENOSPC_MNT";
const ENV_LOG: &str = "REXT4_ENOSPC_LOG";
const ENV_OUT: &str = "REXT4_ENOSPC_OUT";
const ENV_BIN: &str = "REXT4_ENOSPC_BIN";

// ---------------------------------------------------------------------------------
// What the writers write, and how they report.

/// The byte a writer with seed `seed` puts at file offset `at`: position-dependent, so
/// data that lands at the wrong offset shows too.
fn pattern_byte(seed: u64, at: u64) -> u8 {
    ((at / 4096).wrapping_mul(31) ^ seed.wrapping_mul(7) ^ at) as u8 | 1
}

/// `len` bytes of the writer pattern from offset `at`.
fn pattern(seed: u64, at: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|k| pattern_byte(seed, at + k))
        .collect()
}

/// The text `yes` repeats into dd.
const DD_LINE: &[u8] = b"0123456789abcde\n";

/// What one writer reported: the bytes write() acknowledged, the errno of the write()
/// that failed (0: none did), and close's errno (0: it succeeded).
#[derive(Debug, Clone, PartialEq)]
struct Report {
    name: String,
    seed: u64,
    acked: u64,
    write_errno: i32,
    close_errno: i32,
}

impl Report {
    fn line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.name, self.seed, self.acked, self.write_errno, self.close_errno
        )
    }

    fn parse(l: &str) -> Option<Report> {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() != 5 {
            return None;
        }
        Some(Report {
            name: f[0].to_string(),
            seed: f[1].parse().ok()?,
            acked: f[2].parse().ok()?,
            write_errno: f[3].parse().ok()?,
            close_errno: f[4].parse().ok()?,
        })
    }
}

/// A writer process: once less than `wait_below` bytes are free (at most 30 s), open
/// `path` and write random-sized pieces of its pattern until write() fails (or
/// `limit` bytes were written: then it fails); then close. Prints its report.
fn writer(path: &Path, seed: u64, wait_below: u64, limit: u64) {
    let t0 = Instant::now();
    let dir = path.parent().expect("a directory");
    while avail_bytes(dir) >= wait_below && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .expect("writer: create");
    assert!(
        on_fuse(&f),
        "writer: {} is not on the mount",
        path.display()
    );
    let mut r = Rng(seed | 1);
    // The pattern repeats every 256 x 4 KiB, so one period past any offset serves.
    let period = 256 * 4096;
    let base = pattern(seed, 0, 2 * period + 4 * MIB as usize);
    let mut acked = 0u64;
    let write_errno = loop {
        let len = match r.below(3) {
            0 => 1 + r.below(64 << 10),
            1 => 1 + r.below(MIB),
            _ => 1 + r.below(4 * MIB),
        } as usize;
        let from = (acked % period as u64) as usize;
        match f.write(&base[from..from + len]) {
            Ok(n) => acked += n as u64,
            Err(e) => break e.raw_os_error().unwrap_or(-1),
        }
        assert!(
            acked < limit,
            "writer never stopped ({acked} bytes written)"
        );
    };
    let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
    // SAFETY: closing the descriptor taken out of the File.
    let close_errno = if unsafe { libc::close(fd) } == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?");
    println!(
        "REPORT {}",
        Report {
            name: name.to_string(),
            seed,
            acked,
            write_errno,
            close_errno,
        }
        .line()
    );
}

// ---------------------------------------------------------------------------------
// A fill scenario: mount, fill, unmount. Runs as root in the test, or as nobody in a
// helper process.

#[derive(Clone, Copy, Debug)]
enum Workload {
    /// `yes | dd iflag=fullblock bs=1M`.
    Dd,
    /// Eight writer processes of random write sizes.
    Writers,
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// The mount's server, started as `rext4 mount -f`; stopped by `stop`.
struct Server {
    child: Child,
    mnt: PathBuf,
}

impl Server {
    fn start(rext4: &Path, img: &Path, mnt: &Path, log: &Path) -> Server {
        let child = Command::new(rext4)
            .arg("mount")
            .arg("-f")
            .arg("-o")
            .arg(format!("log={}", log.display()))
            .arg(img)
            .arg(mnt)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rext4 mount");
        let mut s = Server {
            child,
            mnt: mnt.to_path_buf(),
        };
        let t0 = Instant::now();
        while !is_mounted(mnt) {
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!(
                    "rext4 mount exited ({st}): {}",
                    fs::read_to_string(log).unwrap_or_default()
                );
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "mount did not appear"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    /// Unmount and wait for the server to close the image and exit.
    fn stop(mut self) {
        for _ in 0..100 {
            if !is_mounted(&self.mnt) {
                break;
            }
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if is_mounted(&self.mnt) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let st = wait_child(&mut self.child, Duration::from_secs(60));
        assert!(
            st.is_some_and(|s| s.success()),
            "rext4 mount did not exit cleanly: {st:?}"
        );
    }
}

/// Mount `img` at `mnt`, run `work`, unmount; the writers' reports.
fn scenario(rext4: &Path, img: &Path, mnt: &Path, log: &Path, work: Workload) -> Vec<Report> {
    let server = Server::start(rext4, img, mnt, log);
    let limit = fs::metadata(img).expect("the image").len() + WRITE_MARGIN;
    let reports = match work {
        Workload::Dd => vec![run_dd(mnt, limit)],
        Workload::Writers => run_writers(mnt, limit),
    };
    server.stop();
    reports
}

/// `yes | dd bs=1M` into the mount, at most `limit` bytes (and only if it is mounted).
fn run_dd(mnt: &Path, limit: u64) -> Report {
    let out = Command::new("sh")
        .arg("-c")
        .arg(
            "mountpoint -q \"$1\" || { echo \"$1 is not mounted\" >&2; exit 1; }; \
             yes 0123456789abcde | dd iflag=fullblock bs=1M count=\"$3\" of=\"$2\"",
        )
        .arg("sh")
        .arg(mnt)
        .arg(mnt.join("dd"))
        .arg((limit / MIB).to_string())
        .output()
        .expect("dd");
    let err = String::from_utf8_lossy(&out.stderr);
    let close_failed = err.contains("closing output file");
    // dd prints no count when close fails: the report fails on that first.
    let acked = err
        .lines()
        .find_map(|l| {
            l.split_once(" bytes")
                .and_then(|(n, _)| n.trim().parse().ok())
        })
        .or(close_failed.then_some(0))
        .unwrap_or_else(|| panic!("no byte count from dd: {err}"));
    let at_write = err.contains("error writing") && err.contains("No space left on device");
    Report {
        name: "dd".into(),
        seed: 0,
        acked,
        write_errno: if at_write { libc::ENOSPC } else { 0 },
        close_errno: if close_failed { -1 } else { 0 },
    }
}

fn run_writers(mnt: &Path, limit: u64) -> Vec<Report> {
    assert!(is_mounted(mnt), "{} is not mounted", mnt.display());
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<Child> = (0..8u64)
        .map(|i| {
            // Two of them open their file late: once space is low.
            let wait_below = if i % 3 == 2 { 24 * MIB } else { u64::MAX };
            Command::new(&exe)
                .args(["--exact", HELPER_TEST, "--nocapture", "--test-threads=1"])
                .env(ENV_ROLE, "writer")
                .env(ENV_PATH, mnt.join(format!("w{i}")))
                .env(ENV_SEED, (0x5eed + i * 0x9E37).to_string())
                .env(ENV_WAIT, wait_below.to_string())
                .env(ENV_LIMIT, limit.to_string())
                .env("RUST_BACKTRACE", "0")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn a writer")
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("writer");
            let text = String::from_utf8_lossy(&out.stdout);
            // libtest prints "test NAME ... " before the test's own output.
            text.lines()
                .find_map(|l| l.split_once("REPORT ").and_then(|(_, r)| Report::parse(r)))
                .unwrap_or_else(|| panic!("writer without a report ({}): {text}", out.status))
        })
        .collect()
}

/// The helper roles (a no-op unless run by the tests here).
#[test]
fn enospc_helper() {
    match std::env::var(ENV_ROLE).as_deref() {
        Ok("writer") => writer(
            Path::new(&env(ENV_PATH)),
            env(ENV_SEED).parse().expect("seed"),
            env(ENV_WAIT).parse().expect("wait"),
            env(ENV_LIMIT).parse().expect("limit"),
        ),
        Ok(work @ ("dd" | "writers")) => {
            let work = if work == "dd" {
                Workload::Dd
            } else {
                Workload::Writers
            };
            let reports = scenario(
                Path::new(&env(ENV_BIN)),
                Path::new(&env(ENV_IMG)),
                Path::new(&env(ENV_MNT)),
                Path::new(&env(ENV_LOG)),
                work,
            );
            let text: String = reports.iter().map(|r| r.line() + "\n").collect();
            fs::write(env(ENV_OUT), text).expect("write the reports");
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------
// The fill tests.

/// What may be left when the writers have stopped (a write() refused beside what the
/// kernel's cache still owed, which the gate waits for only so long).
const LEFT_AT_MOST: u64 = 24 * MIB;

/// Check a filled image: reports, log, e2fsck, every acknowledged byte, and that it is
/// full for writers of that privilege (`root`: the root reserve is theirs too).
fn verify(img: &Path, log: &str, reports: &[Report], label: &str, root: bool) {
    assert!(
        !log.contains(REFUSED),
        "{label}: the server refused cached data:\n{log}"
    );
    let r = e2fsck_fn(img);
    assert!(r.clean, "{label}: e2fsck -fn:\n{}", r.output);
    let fs = rext4::Fs::open(img).expect("open the image");
    let mut acked_total = 0;
    for w in reports {
        assert_eq!(
            (w.write_errno, w.close_errno),
            (libc::ENOSPC, 0),
            "{label}: {w:?}: not stopped by ENOSPC from write() alone (close must \
             succeed)\nserver log:\n{log}"
        );
        let data = fs.read(format!("/{}", w.name)).expect("read back");
        assert_eq!(
            data.len() as u64,
            w.acked,
            "{label}: {}: {} bytes on the image, {} acknowledged\nserver log:\n{log}",
            w.name,
            data.len(),
            w.acked
        );
        let bad = if w.name == "dd" {
            data.chunks(DD_LINE.len())
                .position(|c| c != &DD_LINE[..c.len()])
        } else {
            (0..data.len()).find(|&k| data[k] != pattern_byte(w.seed, k as u64))
        };
        assert_eq!(bad, None, "{label}: {}: a wrong byte", w.name);
        acked_total += w.acked;
    }
    let left = fs.blocks_available_to(root) * u64::from(fs.block_size());
    fs.close().expect("close");
    eprintln!("{label}: {acked_total} bytes acknowledged, all on the image; {left} left");
    assert!(
        left <= LEFT_AT_MOST,
        "{label}: the writers stopped with {left} bytes left\nserver log:\n{log}"
    );
}

/// Fill a fresh image of `mb` MiB with `work`, as root.
fn fill_as(root: bool, mb: u64, work: Workload) {
    let dir = TempDir::new("enospc").expect("tempdir");
    let img = dir.join("img");
    File::create(&img)
        .and_then(|f| f.set_len(mb * MIB))
        .expect("image file");
    let mut opts = MkfsOptions::new(4096, mb * MIB);
    if !root {
        // nobody writes in the root directory.
        opts.extra_args = vec!["-E".into(), format!("root_owner={NOBODY}:{NOBODY}")];
    }
    mkfs_at(&img, &opts).expect("mkfs");
    let mnt = dir.join("mnt");
    fs::create_dir(&mnt).expect("mount point");
    let log = dir.join("log");
    let out = dir.join("reports");
    let label = format!(
        "{} MiB, {work:?}, {}",
        mb,
        if root { "root" } else { "nobody" }
    );
    let t0 = Instant::now();
    let reports = if root {
        scenario(Path::new(bin()), &img, &mnt, &log, work)
    } else {
        run_as_nobody(&dir, &img, &mnt, &log, &out, work);
        fs::read_to_string(&out)
            .expect("reports")
            .lines()
            .map(|l| Report::parse(l).expect("a report"))
            .collect()
    };
    let secs = t0.elapsed().as_secs_f64();
    let text = fs::read_to_string(&log).unwrap_or_default();
    verify(&img, &text, &reports, &label, root);
    if !root {
        let note = text.lines().find(|l| l.contains(KERNEL_WINDOW_NOTE));
        assert!(
            note.is_some(),
            "{label}: no note of the kernel's window at mount:\n{text}"
        );
        eprintln!("{label}: {}", note.unwrap_or_default());
    }
    eprintln!("{label}: filled in {secs:.1} s");
}

/// Run scenario `work` as nobody: in a private mount namespace whose /dev/fuse is a node
/// open to everyone (the host's may be root's only), through fusermount3.
fn run_as_nobody(dir: &TempDir, img: &Path, mnt: &Path, log: &Path, out: &Path, work: Workload) {
    for p in [dir.path(), img, mnt] {
        std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).expect("chown to nobody");
    }
    let devdir = dir.join("dev");
    fs::create_dir(&devdir).expect("dev dir");
    let exe = std::env::current_exe().expect("test binary");
    // The rext4 binary and this one must be reachable by nobody.
    for p in [Path::new(bin()), exe.as_path()] {
        let mode = fs::metadata(p).expect("binary").mode();
        assert!(
            mode & 0o005 == 0o005,
            "{} is not executable by others",
            p.display()
        );
    }
    let script = "set -e; mount -t tmpfs -o mode=0755 none \"$1\"; \
                  mknod -m 666 \"$1/fuse\" c 10 229; mount --bind \"$1/fuse\" /dev/fuse; \
                  shift; exec setpriv --reuid=65534 --regid=65534 --clear-groups -- \"$@\"";
    let mut child = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(&devdir)
        .arg(&exe)
        .args(["--exact", HELPER_TEST, "--nocapture", "--test-threads=1"])
        .env(
            ENV_ROLE,
            match work {
                Workload::Dd => "dd",
                Workload::Writers => "writers",
            },
        )
        .env(ENV_BIN, bin())
        .env(ENV_IMG, img)
        .env(ENV_MNT, mnt)
        .env(ENV_LOG, log)
        .env(ENV_OUT, out)
        .env("RUST_BACKTRACE", "1")
        .current_dir(dir.path())
        .process_group(0)
        .spawn()
        .expect("unshare");
    let st = wait_child(&mut child, Duration::from_secs(600));
    if st.is_none() {
        // SAFETY: killing the process group this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
    assert!(
        st.is_some_and(|s| s.success()),
        "the scenario as nobody failed ({st:?}); server log:\n{}",
        fs::read_to_string(log).unwrap_or_default()
    );
}

/// Why mounting as nobody cannot be tried here, if it cannot.
fn cannot_mount_as_nobody() -> Option<String> {
    cannot_mount().or_else(|| {
        let have = |t: &str| {
            Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        ["unshare", "setpriv", "fusermount3", "mknod"]
            .into_iter()
            .find(|t| !have(t))
            .map(|t| format!("{t} is missing"))
    })
}

#[test]
fn fill_as_root() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    for mb in [64, 256, 1024] {
        fill_as(true, mb, Workload::Dd);
        fill_as(true, mb, Workload::Writers);
    }
}

#[test]
fn fill_without_root() {
    if let Some(why) = cannot_mount_as_nobody() {
        skip(&why);
        return;
    }
    for mb in [64, 256, 1024] {
        fill_as(false, mb, Workload::Dd);
        fill_as(false, mb, Workload::Writers);
    }
}

// ---------------------------------------------------------------------------------
// Direct I/O through io_submit(2), with space coming and going.

/// struct iocb (linux/aio_abi.h, little-endian field order).
#[repr(C)]
#[derive(Default)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: i32,
    opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// struct io_event.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

const IOCB_CMD_PWRITE: u16 = 1;
const SLOT: usize = 128 << 10;
const DEPTH: usize = 128;

/// A 4 KiB-aligned buffer for O_DIRECT.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: a non-zero size with a valid alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Aligned { ptr, layout }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `layout.size()` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// The pattern of slot `slot` of file `file`: every byte says which write made it.
fn slot_byte(file: u64, slot: u64, k: usize) -> u8 {
    (file.wrapping_mul(131) ^ slot.wrapping_mul(29) ^ (k as u64 / 512)) as u8 | 1
}

/// One O_DIRECT writer: every 128 KiB slot of `[0, slots * 128 KiB)` of `path`
/// written once, in a shuffled order, up to `DEPTH` in flight. Returns the slots that
/// completed whole; panics on any other result than a whole write or ENOSPC.
fn aio_writer(path: &Path, file: u64, slots: u64, seed: u64) -> Vec<u64> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open O_DIRECT");
    let mut order: Vec<u64> = (0..slots).collect();
    let mut r = Rng(seed | 1);
    for i in (1..order.len()).rev() {
        order.swap(i, r.below(i as u64 + 1) as usize);
    }
    let mut ctx: libc::c_ulong = 0;
    // SAFETY: io_setup writes the new context into `ctx`.
    let rc = unsafe { libc::syscall(libc::SYS_io_setup, DEPTH as libc::c_long, &mut ctx) };
    assert_eq!(rc, 0, "io_setup: {}", std::io::Error::last_os_error());
    let mut bufs: Vec<Aligned> = (0..DEPTH).map(|_| Aligned::new(SLOT)).collect();
    let mut iocbs: Vec<Iocb> = (0..DEPTH).map(|_| Iocb::default()).collect();
    let mut free: Vec<usize> = (0..DEPTH).collect();
    let mut next = 0;
    let mut inflight = 0;
    let mut done = Vec::new();
    let mut enospc = 0;
    while next < order.len() || inflight > 0 {
        let mut batch: Vec<*mut Iocb> = Vec::new();
        while next < order.len() {
            let Some(i) = free.pop() else { break };
            let slot = order[next];
            next += 1;
            for (k, b) in bufs[i].bytes().iter_mut().enumerate() {
                *b = slot_byte(file, slot, k);
            }
            iocbs[i] = Iocb {
                data: (i as u64) << 32 | slot,
                opcode: IOCB_CMD_PWRITE,
                fildes: f.as_raw_fd() as u32,
                buf: bufs[i].ptr as u64,
                nbytes: SLOT as u64,
                offset: (slot as usize * SLOT) as i64,
                ..Iocb::default()
            };
            batch.push(&mut iocbs[i]);
        }
        let mut sent = 0;
        while sent < batch.len() {
            // SAFETY: `batch` points at iocbs (and they at buffers) that live until
            // their completion is reaped below.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_io_submit,
                    ctx,
                    (batch.len() - sent) as libc::c_long,
                    batch[sent..].as_mut_ptr(),
                )
            };
            assert!(n > 0, "io_submit: {}", std::io::Error::last_os_error());
            sent += n as usize;
        }
        inflight += sent;
        let mut ev = [IoEvent::default(); DEPTH];
        // SAFETY: io_getevents fills at most DEPTH events into `ev`.
        let n = unsafe {
            libc::syscall(
                libc::SYS_io_getevents,
                ctx,
                1 as libc::c_long,
                DEPTH as libc::c_long,
                ev.as_mut_ptr(),
                std::ptr::null_mut::<libc::timespec>(),
            )
        };
        assert!(n > 0, "io_getevents: {}", std::io::Error::last_os_error());
        for e in &ev[..n as usize] {
            let i = (e.data >> 32) as usize;
            let slot = e.data & 0xffff_ffff;
            free.push(i);
            inflight -= 1;
            if e.res == SLOT as i64 {
                done.push(slot);
            } else if e.res == -i64::from(libc::ENOSPC) {
                enospc += 1;
            } else {
                panic!(
                    "{}: the direct write of slot {slot} completed with {} ({}), not whole \
                     or ENOSPC",
                    path.display(),
                    e.res,
                    std::io::Error::from_raw_os_error((-e.res) as i32)
                );
            }
        }
    }
    // SAFETY: the context made above, with nothing in flight.
    unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
    eprintln!(
        "{}: {} writes done, {enospc} ENOSPC",
        path.display(),
        done.len()
    );
    done
}

/// Eat and free space until `stop`: fallocate pieces of `hog` until ENOSPC, punch
/// some, truncate it; and on `victim` fallocate, punch, zero and truncate past `from`.
fn racer(hog: &Path, victim: &Path, from: u64, seed: u64, stop: &AtomicBool) -> u64 {
    let h = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(hog)
        .expect("hog");
    let v = OpenOptions::new()
        .read(true)
        .write(true)
        .open(victim)
        .expect("victim");
    let mut r = Rng(seed | 1);
    let mut ops = 0u64;
    let fall = |f: &File, mode: i32, off: u64, len: u64| {
        // SAFETY: fallocate on a descriptor we own.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
        let e = std::io::Error::last_os_error().raw_os_error();
        assert!(
            rc == 0 || e == Some(libc::ENOSPC),
            "fallocate mode {mode:#x} at {off}+{len}: {:?}",
            std::io::Error::last_os_error()
        );
    };
    while !stop.load(Ordering::Relaxed) {
        ops += 1;
        let off = r.below(32) * MIB;
        match r.below(6) {
            0 | 1 => fall(&h, 0, off, 1 + r.below(2 * MIB)),
            2 => fall(
                &h,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                1 + r.below(4 * MIB),
            ),
            3 => {
                let _ = h.set_len(r.below(24 * MIB));
            }
            4 => {
                let mode = [
                    0,
                    libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_ZERO_RANGE,
                ][r.below(4) as usize];
                fall(&v, mode, from + r.below(4 * MIB), 1 + r.below(MIB));
            }
            _ => {
                // Never below the writers' range: what they wrote stays.
                let _ = v.set_len(from + r.below(4 * MIB));
            }
        }
    }
    ops
}

#[test]
fn direct_aio_writers_race_space_changes() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    let img = mkfs(&MkfsOptions::new(4096, 96 * MIB)).expect("mkfs");
    let mut m = Mounted::new(img.path(), &[]);
    let _w = Watchdog::new("direct aio", m.pid(), Duration::from_secs(300));
    // Nearly full: what is left is less than the writers want.
    let pad = File::create(m.join("pad")).expect("pad");
    let avail = avail_bytes(m.path());
    // SAFETY: fallocate on a descriptor we own.
    let rc = unsafe { libc::fallocate(pad.as_raw_fd(), 0, 0, (avail - 20 * MIB) as i64) };
    assert_eq!(rc, 0, "pad: {}", std::io::Error::last_os_error());
    drop(pad);
    const WRITERS: u64 = 4;
    const SLOTS: u64 = 64; // 8 MiB each
    let from = SLOTS * SLOT as u64;
    for i in 0..WRITERS {
        File::create(m.join(&format!("f{i}"))).expect("create");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let racers: Vec<_> = (0..WRITERS)
        .map(|i| {
            let stop = stop.clone();
            let hog = m.join(&format!("hog{i}"));
            let victim = m.join(&format!("f{i}"));
            std::thread::spawn(move || racer(&hog, &victim, from, 0xace + i, &stop))
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|i| {
            let p = m.join(&format!("f{i}"));
            std::thread::spawn(move || {
                // Twice over the range: the second pass overwrites what the first wrote.
                let a = aio_writer(&p, i, SLOTS, 0x51 + i);
                let b = aio_writer(&p, i, SLOTS, 0x77 + i);
                let mut all: Vec<u64> = a.into_iter().chain(b).collect();
                all.sort_unstable();
                all.dedup();
                all
            })
        })
        .collect();
    let done: Vec<Vec<u64>> = writers
        .into_iter()
        .map(|t| t.join().expect("writer"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = racers.into_iter().map(|t| t.join().expect("racer")).sum();
    assert!(m.unmount().success(), "{}", m.stderr());
    let log = m.stderr();
    assert!(!log.contains(REFUSED), "refused cached data:\n{log}");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck -fn:\n{}", r.output);
    let fs = rext4::Fs::open(img.path()).expect("open");
    let mut total = 0;
    for (i, slots) in done.iter().enumerate() {
        let data = fs.read(format!("/f{i}")).expect("read");
        for &slot in slots {
            let at = slot as usize * SLOT;
            let got = data.get(at..at + SLOT).unwrap_or(&[]);
            let want: Vec<u8> = (0..SLOT).map(|k| slot_byte(i as u64, slot, k)).collect();
            assert!(
                got == want.as_slice(),
                "f{i}: slot {slot} was written (the write completed) but does not read back"
            );
        }
        total += slots.len();
    }
    eprintln!("{total} completed direct writes read back; {ops} space changes raced them");
}

/// statvfs's f_bavail of `p` in bytes (0 when it fails).
fn avail_bytes(p: &Path) -> u64 {
    fuse_mount::statvfs(p).map_or(0, |st| st.f_bavail * st.f_frsize)
}

/// The fio run: libaio O_DIRECT writers (128 KiB, 128 in flight each) beside
/// truncate, fallocate and punch jobs on a nearly full filesystem get ENOSPC, never
/// EIO ("io_u error ... Input/output error").
#[test]
fn fio_direct_writers_see_enospc_not_eio() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    if Command::new("fio").arg("--version").output().is_err() {
        skip("fio is not installed");
        return;
    }
    let img = mkfs(&MkfsOptions::new(4096, 64 * MIB)).expect("mkfs");
    let mut m = Mounted::new(img.path(), &[]);
    let _w = Watchdog::new("fio", m.pid(), Duration::from_secs(300));
    let pad = File::create(m.join("pad")).expect("pad");
    // SAFETY: fallocate on a descriptor we own.
    let rc = unsafe { libc::fallocate(pad.as_raw_fd(), 0, 0, 20 * MIB as i64) };
    assert_eq!(rc, 0, "pad: {}", std::io::Error::last_os_error());
    drop(pad);
    let job = m.path().with_extension("fio");
    let mut j = File::create(&job).expect("job file");
    write!(
        j,
        "[global]\ndirectory={}\nsize=12m\nbs=128k\ntime_based=1\nruntime=6\n\
         continue_on_error=all\n\
         [dio]\nioengine=libaio\ndirect=1\niodepth=128\nrw=randwrite\nnumjobs=4\n\
         filename_format=f.$jobnum\n\
         [trunc]\nioengine=ftruncate\nrw=randwrite\nfilename_format=f.0\n\
         [falloc]\nioengine=falloc\nrw=randwrite\nfilename_format=f.1\nbs=1m\n\
         [punch]\nioengine=falloc\nrw=randtrim\nfilename_format=f.2\nbs=256k\n",
        m.path().display()
    )
    .expect("job");
    drop(j);
    let out = Command::new("timeout")
        .args(["120", "fio"])
        .arg(&job)
        .output()
        .expect("fio");
    let _ = fs::remove_file(&job);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(m.unmount().success(), "{}", m.stderr());
    let eio: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Input/output error") || l.contains("err=5"))
        .collect();
    assert!(eio.is_empty(), "fio saw EIO:\n{}", eio.join("\n"));
    let enospc = text.matches("No space left on device").count();
    eprintln!("fio: {enospc} writes refused with ENOSPC, none with EIO");
    let log = m.stderr();
    assert!(!log.contains(REFUSED), "refused cached data:\n{log}");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "e2fsck -fn:\n{}", r.output);
}
