//! The io_uring transport's serving threads under the mount: one queue per CPU, its
//! threads pinned to that CPU at SCHED_IDLE, moved to SCHED_OTHER on any CPU while
//! they starve or have a backlog, and back when that ends (vendor/fuser/src/uring.rs's
//! monitor). In a binary of its own: the monitor reads the machine's load, so these
//! tests must not run beside other mounts' work (cargo runs test binaries one after
//! another, and these take turns). Each mount is a `Mounted` guard (unmounted and reaped on drop, also when
//! a test panics); the images are checked with e2fsck -fn after. Skips (printing why)
//! without root, /dev/fuse or the kernel's FUSE-over-io_uring.

mod fuse_mount;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use fuse_mount::{cannot_mount, Mounted};
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, MkfsOptions};

/// Held by each test for its whole run: the tests of this binary run one at a time
/// too (a poisoned lock, from a failed test, still serializes).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

fn image() -> Image {
    mkfs(&MkfsOptions::new(4096, 128 << 20)).expect("mkfs.ext4")
}

fn fsck_clean(img: &Path) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "e2fsck -fn not clean:\n{}", r.output);
}

/// This binary's turn, a fresh image and its default mount; `None` (printed) where
/// the machine cannot mount or the kernel serves no FUSE-over-io_uring.
fn mount_for_queues() -> Option<(std::sync::MutexGuard<'static, ()>, Image, Mounted)> {
    let one = one_at_a_time();
    if let Some(why) = cannot_mount().or_else(uring_unavailable) {
        skip(&why);
        return None;
    }
    let img = image();
    let m = Mounted::new(img.path(), &[]);
    Some((one, img, m))
}

/// Why the kernel will not serve this mount over io_uring, if it will not.
fn uring_unavailable() -> Option<String> {
    let p = "/sys/module/fuse/parameters/enable_uring";
    match fs::read_to_string(p) {
        Err(_) => Some(format!(
            "{p} missing: this kernel has no FUSE-over-io_uring"
        )),
        Ok(v) if v.trim() != "Y" => Some(format!(
            "{p} is N: FUSE-over-io_uring is off (scripts/test.sh turns it on as root)"
        )),
        Ok(_) => None,
    }
}

/// The server's threads: name, allowed CPUs, CPU time in clock ticks, scheduling
/// policy.
fn server_threads(pid: i32) -> Vec<(String, String, u64, i32)> {
    let mut out = Vec::new();
    for t in fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task dir")
        .flatten()
    {
        let p = t.path();
        let (Ok(comm), Ok(status), Ok(stat)) = (
            fs::read_to_string(p.join("comm")),
            fs::read_to_string(p.join("status")),
            fs::read_to_string(p.join("stat")),
        ) else {
            continue;
        };
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or("")
            .trim()
            .to_string();
        // Fields after the parenthesised name: utime and stime are the 12th and 13th.
        let rest = &stat[stat.rfind(')').expect("stat") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
        let tid = t
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .unwrap_or(0);
        // SAFETY: plain syscall on a thread id.
        let policy = unsafe { libc::sched_getscheduler(tid) };
        out.push((comm.trim().to_string(), cpus, ticks, policy));
    }
    out
}

/// Creates, stats, reads and unlinks `n` small files: a few requests each.
fn small_file_round_trips(dir: &Path, n: usize) {
    fs::create_dir(dir).expect("mkdir");
    for i in 0..n {
        fs::write(dir.join(format!("f{i}")), format!("file {i}")).expect("write");
    }
    for i in 0..n {
        let p = dir.join(format!("f{i}"));
        assert_eq!(
            fs::metadata(&p).expect("stat").len(),
            format!("file {i}").len() as u64
        );
        assert_eq!(fs::read_to_string(&p).expect("read"), format!("file {i}"));
    }
    for i in (0..n).step_by(2) {
        fs::remove_file(dir.join(format!("f{i}"))).expect("unlink");
    }
}

/// With FUSE-over-io_uring on, the requests are served by one queue per CPU, its
/// threads pinned to that CPU at SCHED_IDLE unless relaxed against starvation (named
/// fuser-q<cpu>.<n>), not by the /dev/fuse workers
/// (which keep FORGET and INTERRUPT); `nouring` keeps to /dev/fuse. Either way the
/// image comes out clean with what was written.
#[test]
fn requests_are_served_by_per_cpu_io_uring_queues() {
    let Some((_one, img, mut m)) = mount_for_queues() else {
        return;
    };
    small_file_round_trips(&m.join("a"), 3000);
    let threads = server_threads(m.pid());
    let ring: Vec<_> = threads
        .iter()
        .filter(|t| {
            t.0.strip_prefix("fuser-q")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    assert!(
        !ring.is_empty(),
        "no io_uring queue threads: {threads:?}\n{}",
        m.stderr()
    );
    let online = fs::read_to_string("/sys/devices/system/cpu/online").expect("online CPUs");
    let is_online = |cpu: u32| {
        online.trim().split(',').any(|r| match r.split_once('-') {
            Some((a, b)) => (a.parse().unwrap_or(u32::MAX)..=b.parse().unwrap_or(0)).contains(&cpu),
            None => r.parse() == Ok(cpu),
        })
    };
    for (name, cpus, _, policy) in &ring {
        let cpu = &name["fuser-q".len()..name.find('.').expect("fuser-q<cpu>.<n>")];
        // A queue of an online CPU is served at SCHED_IDLE on that CPU alone — or, while
        // that would starve its threads, at SCHED_OTHER anywhere.
        if is_online(cpu.parse().expect("queue number")) {
            match *policy {
                libc::SCHED_IDLE => assert_eq!(cpus, cpu, "{name} may run on {cpus}"),
                p => assert_eq!(p, libc::SCHED_OTHER, "{name} has policy {p}"),
            }
        }
    }
    let ring_ticks: u64 = ring.iter().map(|t| t.2).sum();
    let dev_ticks: u64 = threads
        .iter()
        .filter(|t| {
            t.0.strip_prefix("fuser-")
                .is_some_and(|r| r.parse::<u32>().is_ok())
        })
        .map(|t| t.2)
        .sum();
    assert!(
        ring_ticks > dev_ticks,
        "queue threads used {ring_ticks} ticks, /dev/fuse workers {dev_ticks}: {threads:?}"
    );
    let st = m.unmount();
    assert!(st.success(), "rext4 mount exit {st}: {}", m.stderr());
    fsck_clean(img.path());

    let mut m = Mounted::new(img.path(), &["nouring"]);
    let names: Vec<String> = server_threads(m.pid()).into_iter().map(|t| t.0).collect();
    assert!(
        !names.iter().any(|n| n.starts_with("fuser-q")),
        "nouring still has queue threads: {names:?}"
    );
    small_file_round_trips(&m.join("b"), 500);
    assert_eq!(fs::read_dir(m.join("a")).expect("readdir").count(), 1500);
    assert!(m.unmount().success());
    fsck_clean(img.path());
}

/// Pins the calling thread to CPU `cpu`.
fn pin_this_thread(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays inside it for cpu < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "pin to CPU {cpu}"
        );
    }
}

/// Scheduling policies of the server's io_uring queue threads for CPU `cpu`.
fn queue_policies(pid: i32, cpu: usize) -> Vec<i32> {
    let prefix = format!("fuser-q{cpu}.");
    server_threads(pid)
        .into_iter()
        .filter(|t| t.0.starts_with(&prefix))
        .map(|t| t.3)
        .collect()
}

/// Whether every policy in `p` (and at least one) is `want`.
fn all_are(p: &[i32], want: i32) -> bool {
    !p.is_empty() && p.iter().all(|&c| c == want)
}

/// Policies of the server `pid`'s queue 0 threads once all are `want`, or as they are
/// after `secs`.
fn wait_for_queue0(pid: i32, want: i32, secs: u64) -> Vec<i32> {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let p = queue_policies(pid, 0);
        if all_are(&p, want) || std::time::Instant::now() > until {
            return p;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The CPUs each of the server `pid`'s queue 0 threads may run on.
fn queue0_cpus(pid: i32) -> Vec<String> {
    server_threads(pid)
        .into_iter()
        .filter(|t| t.0.starts_with("fuser-q0."))
        .map(|t| t.1)
        .collect()
}

/// Queue 0's threads are SCHED_IDLE (pinned) at rest, before a test loads them.
fn pinned_at_rest(pid: i32) {
    let p = wait_for_queue0(pid, libc::SCHED_IDLE, 15);
    assert!(
        all_are(&p, libc::SCHED_IDLE),
        "queue 0 threads not SCHED_IDLE at rest: {p:?}"
    );
}

/// Queue 0's threads were free of CPU 0 while relaxed (`relaxed_cpus`, where the
/// machine has another CPU) and come back to SCHED_IDLE pinned to it once calm.
fn moved_then_back(pid: i32, relaxed_cpus: &[String]) {
    let several =
        fs::read_to_string("/sys/devices/system/cpu/online").is_ok_and(|s| s.trim() != "0");
    if several {
        assert!(
            relaxed_cpus.iter().all(|c| c != "0"),
            "relaxed queue 0 threads still pinned: {relaxed_cpus:?}"
        );
    }
    let calm = wait_for_queue0(pid, libc::SCHED_IDLE, 15);
    assert!(
        all_are(&calm, libc::SCHED_IDLE),
        "not back to SCHED_IDLE when calm: {calm:?}"
    );
    let pinned = queue0_cpus(pid);
    assert!(
        !pinned.is_empty() && pinned.iter().all(|c| c == "0"),
        "queue 0 threads not pinned to CPU 0 again: {pinned:?}"
    );
}

/// The io_uring queue threads run SCHED_IDLE pinned to their CPU (so a woken caller
/// stays on its CPU), and must not starve there: a busy normal task on the CPU of a
/// queue whose caller blocks on it moves them to SCHED_OTHER, free to run on any CPU;
/// when it is gone they return to SCHED_IDLE on their CPU. (The
/// machine then has no more runnable tasks than CPUs, so only the threads' own wait
/// for their CPU shows the starvation: a monitor that only counted runnable tasks left
/// them starving here.)
#[test]
fn queue_threads_leave_sched_idle_when_starved() {
    let Some((_one, img, mut m)) = mount_for_queues() else {
        return;
    };
    let pid = m.pid();
    pinned_at_rest(pid);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hog = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            pin_this_thread(0);
            let mut x = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        })
    };
    // GETXATTR: one synchronous request per call (the kernel caches no xattrs), and
    // nothing asynchronous beside it, so at most the hog and one of the caller or a
    // queue thread are runnable.
    let f = m.join("x");
    fs::write(&f, b"x").expect("write");
    let path = CString::new(f.as_os_str().as_bytes()).expect("path");
    let load = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            pin_this_thread(0);
            let mut buf = [0u8; 8];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: valid C strings and buffer; ENODATA is the expected answer.
                let r = unsafe {
                    libc::getxattr(
                        path.as_ptr(),
                        c"user.none".as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                assert_eq!(r, -1, "user.none exists");
            }
        })
    };
    let busy = wait_for_queue0(pid, libc::SCHED_OTHER, 10);
    let relaxed_cpus = queue0_cpus(pid);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    hog.join().expect("hog");
    load.join().expect("load");
    assert!(
        all_are(&busy, libc::SCHED_OTHER),
        "queue 0 threads starved behind a busy task on their CPU: {busy:?}\n{}",
        m.stderr()
    );
    moved_then_back(pid, &relaxed_cpus);
    assert!(m.unmount().success(), "{}", m.stderr());
    fsck_clean(img.path());
}

/// Linux native AIO (io_setup, io_submit, io_getevents), as fio's libaio engine uses
/// it: one thread keeps many O_DIRECT requests in flight.
mod aio {
    /// struct iocb (x86-64 and other little-endian layouts: key before rw_flags).
    #[repr(C)]
    #[derive(Default)]
    pub struct Iocb {
        pub data: u64,
        pub key: u32,
        pub rw_flags: i32,
        pub opcode: u16,
        pub reqprio: i16,
        pub fildes: u32,
        pub buf: u64,
        pub nbytes: u64,
        pub offset: i64,
        pub reserved2: u64,
        pub flags: u32,
        pub resfd: u32,
    }

    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    pub struct Event {
        pub data: u64,
        pub obj: u64,
        pub res: i64,
        pub res2: i64,
    }

    pub const PWRITE: u16 = 1;

    /// An AIO context, destroyed when dropped.
    pub struct Ctx(u64);

    impl Ctx {
        pub fn new(depth: u32) -> Ctx {
            let mut id = 0u64;
            // SAFETY: io_setup writes the context id to the pointer given.
            let r = unsafe { libc::syscall(libc::SYS_io_setup, depth, &mut id as *mut u64) };
            assert_eq!(r, 0, "io_setup: {}", std::io::Error::last_os_error());
            Ctx(id)
        }

        /// Submit all of `reqs` and wait for every completion; returns their results.
        pub fn run(&self, reqs: &mut [Iocb]) -> Vec<i64> {
            let mut ptrs: Vec<*mut Iocb> = reqs.iter_mut().map(|r| r as *mut Iocb).collect();
            let mut done = 0;
            while done < ptrs.len() {
                // SAFETY: the iocbs and the buffers they name outlive their completion,
                // awaited below before this returns.
                let n = unsafe {
                    libc::syscall(
                        libc::SYS_io_submit,
                        self.0,
                        (ptrs.len() - done) as libc::c_long,
                        ptrs[done..].as_mut_ptr(),
                    )
                };
                assert!(n > 0, "io_submit: {}", std::io::Error::last_os_error());
                done += n as usize;
            }
            let mut events = vec![Event::default(); reqs.len()];
            let mut got = 0;
            while got < reqs.len() {
                // SAFETY: room for the remaining events; no timeout.
                let n = unsafe {
                    libc::syscall(
                        libc::SYS_io_getevents,
                        self.0,
                        1 as libc::c_long,
                        (reqs.len() - got) as libc::c_long,
                        events[got..].as_mut_ptr(),
                        std::ptr::null_mut::<libc::timespec>(),
                    )
                };
                if n < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {
                    continue;
                }
                assert!(n > 0, "io_getevents: {}", std::io::Error::last_os_error());
                got += n as usize;
            }
            let mut res = vec![0; reqs.len()];
            for e in events {
                res[e.data as usize] = e.res;
            }
            res
        }
    }

    impl Drop for Ctx {
        fn drop(&mut self) {
            // SAFETY: every request of this context has completed (`run` waits).
            unsafe { libc::syscall(libc::SYS_io_destroy, self.0) };
        }
    }
}

/// A queue with a backlog is served from every CPU: an application that keeps 64
/// O_DIRECT writes in flight from one thread (fio's libaio engine, as SEEDS lesson A
/// runs it) sends them all to the queue of its CPU, where the pinned threads would
/// serve them on that one CPU while the others idle; the monitor sees requests
/// answered with few sleeps and moves the queue's threads to SCHED_OTHER on any CPU,
/// and back to SCHED_IDLE on their CPU once the stream ends. Every acknowledged write
/// reads back, and the image is clean.
#[test]
fn queue_threads_spread_under_a_backlog_of_async_direct_writes() {
    const BLOCKS: u64 = 4096;
    const DEPTH: usize = 64;
    if fs::read_to_string("/sys/devices/system/cpu/online").is_ok_and(|s| s.trim() == "0") {
        skip("one CPU online: a backlog has no other CPU to move to");
        return;
    }
    let Some((_one, img, mut m)) = mount_for_queues() else {
        return;
    };
    let pid = m.pid();
    let f = m.join("q");
    {
        let mut w = File::create(&f).expect("create");
        w.write_all(&vec![0u8; (BLOCKS * 4096) as usize])
            .expect("prewrite");
        w.sync_all().expect("fsync");
    }
    pinned_at_rest(pid);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, f) = (stop.clone(), f.clone());
        std::thread::spawn(move || {
            pin_this_thread(0);
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&f)
                .expect("open O_DIRECT");
            let layout = std::alloc::Layout::from_size_align(DEPTH * 4096, 4096).expect("layout");
            // SAFETY: a non-zero size; freed below with the same layout.
            let buf = unsafe { std::alloc::alloc_zeroed(layout) };
            assert!(!buf.is_null());
            let ctx = aio::Ctx::new(DEPTH as u32);
            // The byte each block was last written with (0: the prewrite).
            let mut want = vec![0u8; BLOCKS as usize];
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let byte = (round % 251) as u8 + 1;
                let mut reqs: Vec<aio::Iocb> = (0..DEPTH)
                    .map(|i| {
                        let blk = (round * DEPTH as u64 + i as u64) % BLOCKS;
                        // SAFETY: chunk i of the DEPTH-page buffer.
                        let chunk = unsafe { buf.add(i * 4096) };
                        unsafe { std::ptr::write_bytes(chunk, byte, 4096) };
                        aio::Iocb {
                            data: i as u64,
                            opcode: aio::PWRITE,
                            fildes: file.as_raw_fd() as u32,
                            buf: chunk as u64,
                            nbytes: 4096,
                            offset: (blk * 4096) as i64,
                            ..aio::Iocb::default()
                        }
                    })
                    .collect();
                let res = ctx.run(&mut reqs);
                for (i, r) in res.iter().enumerate() {
                    assert_eq!(*r, 4096, "write {i} of round {round}");
                    want[(reqs[i].offset / 4096) as usize] = byte;
                }
                round += 1;
            }
            drop(ctx);
            // SAFETY: allocated above with this layout; no request uses it any more.
            unsafe { std::alloc::dealloc(buf, layout) };
            (want, round)
        })
    };
    let busy = wait_for_queue0(pid, libc::SCHED_OTHER, 10);
    let relaxed_cpus = queue0_cpus(pid);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (want, rounds) = writer.join().expect("writer");
    assert!(
        all_are(&busy, libc::SCHED_OTHER),
        "queue 0 threads kept pinned under {rounds} rounds of {DEPTH} writes in flight: \
         {busy:?}\n{}",
        m.stderr()
    );
    moved_then_back(pid, &relaxed_cpus);
    let got = fs::read(&f).expect("read back");
    for (blk, &b) in want.iter().enumerate() {
        let at = &got[blk * 4096..(blk + 1) * 4096];
        assert!(
            at.iter().all(|&x| x == b),
            "block {blk}: want {b:#x}, got {:#x}",
            at[0]
        );
    }
    assert!(m.unmount().success(), "{}", m.stderr());
    fsck_clean(img.path());
}
