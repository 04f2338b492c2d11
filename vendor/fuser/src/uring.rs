//! FUSE over io_uring (rext4 addition to this copy of fuser; see VENDOR.md).
//!
//! With `/dev/fuse` alone the kernel keeps one queue of requests per connection and
//! wakes whichever server thread waits longest, on whatever CPU it last ran: on a small
//! machine most requests pay a cross-CPU wakeup each way. Linux 6.14+ (module parameter
//! `fuse.enable_uring`) can instead hand each request to a ring entry of the queue that
//! belongs to the CPU the caller runs on. Here each such queue is served by threads
//! pinned to that CPU, so caller and server take turns on one CPU.
//!
//! Protocol (include/uapi/linux/fuse.h, 7.42), as this module uses it:
//! - an io_uring with 128-byte SQEs; `IORING_OP_URING_CMD` on the /dev/fuse fd with
//!   `cmd_op` REGISTER (1) or COMMIT_AND_FETCH (2); the 80-byte command area holds
//!   `{flags: u64, commit_id: u64, qid: u16}`;
//! - REGISTER gives an entry's two buffers, `sqe.addr` pointing at two iovecs (`sqe.len`
//!   2): headers (>= 288 bytes) and payload (>= the connection's largest message);
//! - headers = `in_out[128]` (fuse_in_header in, fuse_out_header out), `op_in[128]` (the
//!   request's first argument), `ent_in_out {flags, commit_id, payload_sz, ..}`; the
//!   rest of the request, and of the reply, is in the payload buffer;
//! - a completion with result 0 means a request is in the entry; a negative one that
//!   the connection is going away. COMMIT_AND_FETCH hands the reply back and waits for
//!   the next request in one step;
//! - every CPU's queue must have an entry before the kernel uses the ring; until then,
//!   and for FORGET and INTERRUPT always, requests come through /dev/fuse.
//!
//! Where the caller wakes. Pinning the server to the caller's CPU is half of it: when
//! the server commits a reply, the scheduler would wake the caller on an idle CPU
//! rather than on the busy one it ran on, and every request would migrate it. A CPU
//! whose only runnable tasks are SCHED_IDLE counts as idle for that choice (and a woken
//! normal task preempts them), so the serving threads run SCHED_IDLE: the caller is
//! woken where it was and runs at once. SCHED_IDLE threads get almost no CPU next to a
//! busy normal task, so a monitor thread relaxes them — SCHED_OTHER, free to run on
//! any CPU — while they are being starved, that is while they wait for their CPU far
//! longer per request than requests answered one after another do, and while they
//! have a backlog (requests waiting behind the one being answered: a caller that does
//! not wait for each reply, whose work the other CPUs can share; see `Monitor`), and
//! pins them back at SCHED_IDLE when that has stopped for a while. io_uring is used
//! only when a thread may make both switches (SCHED_IDLE -> SCHED_OTHER needs
//! CAP_SYS_NICE or RLIMIT_NICE 20).
//!
//! A request is reassembled as /dev/fuse would deliver it (in-header, first argument,
//! payload, contiguous) by copying the two headers into room left just before the
//! payload buffer, so the payload is not copied; replies without a request payload to
//! keep (reads, getattr...) are written straight into the payload buffer.

use std::io;
use std::io::IoSlice;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode::UringCmd80;
use io_uring::squeue::Entry128;
use io_uring::types::Fd;
use log::debug;
use log::warn;
use parking_lot::Condvar;
use parking_lot::Mutex;

use crate::Filesystem;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// Offsets in the headers buffer (struct fuse_uring_req_header).
const HDR_OP_IN: usize = 128;
const HDR_ENT_IN_OUT: usize = 256;
const HDR_SIZE: usize = 288;
/// Largest first argument the kernel puts in `op_in`.
const OP_IN_MAX: usize = 128;
/// size_of(fuse_in_header), size_of(fuse_out_header).
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// Room before the payload for the in-header and first argument (multiple of 8).
const LEAD: usize = 256;
const _: () = assert!(LEAD >= IN_HEADER + OP_IN_MAX && LEAD % 8 == 0);

const FUSE_FORGET: u32 = 2;
const FUSE_BATCH_FORGET: u32 = 42;

/// The rings, made before the INIT reply asks the kernel for io_uring (so a machine
/// where io_uring cannot be set up, e.g. `kernel.io_uring_disabled`, or a seccomp
/// filter, never has the kernel wait for queues that will not come).
pub(crate) struct Prepared {
    /// (queue id = CPU number, pin to it, ring)
    rings: Vec<(u16, bool, IoUring<Entry128, cqueue::Entry>)>,
    /// Size of each entry's payload buffer.
    payload: usize,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("rings", &self.rings.len())
            .field("payload", &self.payload)
            .finish()
    }
}

impl Prepared {
    /// Queues to be served (one per possible CPU).
    pub(crate) fn queues(&self) -> usize {
        self.rings
            .iter()
            .map(|r| r.0)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    }
}

/// CPUs in a list like "0-3,6" (the format of /sys/devices/system/cpu/possible).
fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 4096 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Switches thread `tid` (0: this one) to SCHED_IDLE or SCHED_OTHER.
fn set_idle_class(tid: libc::pid_t, idle: bool) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: plain syscall on a thread id with a valid parameter block.
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether threads here may go to SCHED_IDLE and come back (tried on a scratch thread).
fn can_switch_class() -> io::Result<()> {
    std::thread::spawn(|| {
        set_idle_class(0, true)?;
        set_idle_class(0, false)
    })
    .join()
    .map_err(|_| io::Error::other("probe thread panicked"))?
}

/// Keeps the serving threads SCHED_IDLE and pinned to their queue's CPU while that
/// does not starve them, SCHED_OTHER and free to run on any CPU while it would (a
/// queue whose CPU is busy is then served from an idle one), or while they have a
/// backlog (`backlogged`: requests queue up behind the one being answered, as with
/// an application's asynchronous direct I/O, whose requests all come to the queue of
/// the CPU it submits them on: pinned there, one CPU served them and the others idled;
/// fio's 2 KiB O_DIRECT writes, one job, 64 in flight, went from 52-58k IOPS pinned
/// to 127-143k spread).
///
/// Starvation, sampled every `SAMPLE`, is the threads waiting for a CPU (run delay,
/// /proc/self/task/TID/schedstat) more than `STARVED_TOTAL` in all and more than
/// `STARVED_PER_REQUEST` per request answered: a busy normal task shares their CPU
/// (a CPU hog, or a streaming writer and the kernel's flusher). Measured here: a tar
/// -x, requests answered one after another, waits 1-7 us per request; creates while
/// the kernel still writes back a random-write run, up to ~50 us and 6 ms in a
/// sample; 1 MiB writes behind a writer on the same CPU 2.5 ms per request, 30-47%
/// of the time; a caller blocked on a queue whose CPU a hog keeps busy, all of it.
/// The number of runnable tasks says less — a tar -x with the flusher often has more
/// than CPUs without starving anyone, and that blocked caller starves with no more
/// than CPUs — so it serves only where schedstat is missing (two samples in a row
/// with more runnable tasks than CPUs).
///
/// Back to SCHED_IDLE after `hold` without starvation. `hold` starts at
/// `HOLD_MIN` and doubles, up to `HOLD_MAX`, when starvation returns within a second
/// of going back, so a steady stream does not flap between the classes; it falls back
/// to `HOLD_MIN` after `HOLD_MAX` in SCHED_IDLE. A backlog moves pinned threads only
/// while half a CPU or more of the machine idles (with every CPU busy serving its own
/// queue they are best where they are: fio's 2 KiB writes, eight jobs, lost 5-13% when
/// moved), is held `HOLD_MIN` alone and never lengthens `hold`: requests answered one
/// at a time that follow a burst (creates after a writeback) run best pinned.
struct Monitor {
    inner: Mutex<MonitorState>,
    /// Notified when the last serving thread leaves: the monitor ends at once rather
    /// than at its next sample (an unmount waits for it).
    gone: parking_lot::Condvar,
    /// The CPUs the process may use: where unpinned threads run.
    all: libc::cpu_set_t,
}

const SAMPLE: Duration = Duration::from_millis(50);
const STARVED_PER_REQUEST: Duration = Duration::from_micros(200);
const STARVED_TOTAL: Duration = Duration::from_millis(20);
const HOLD_MIN: Duration = Duration::from_millis(200);
const HOLD_MAX: Duration = Duration::from_secs(10);
/// A backlog (see `backlogged`): at least this many requests in a sample (2,000 a
/// second), at least this many answered per sleep.
const BACKLOG_MIN: u64 = 100;
const BACKLOG_PER_SLEEP: u64 = 4;
/// ...and pinned threads move for it only with this much of the machine idle (in
/// CPUs, averaged over the sample).
const BACKLOG_SPARE_CPUS: f64 = 0.5;

#[derive(Default)]
struct MonitorState {
    /// Serving threads: thread id, requests answered, the CPU it is pinned to while
    /// SCHED_IDLE (none: an offline CPU's queue, served from anywhere).
    members: Vec<(libc::pid_t, Arc<AtomicU64>, Option<usize>)>,
    alive: usize,
    normal: bool,
}

/// A serving thread's membership: joins with the current class, counts its requests,
/// leaves when dropped (also on panic, so the monitor ends).
struct Member {
    monitor: Arc<Monitor>,
    tid: libc::pid_t,
    requests: Arc<AtomicU64>,
}

impl Member {
    /// Joins thread-to-be-pinned-to `pin` with the monitor's current mode.
    fn join(monitor: Arc<Monitor>, pin: Option<usize>) -> Member {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let requests = Arc::new(AtomicU64::new(0));
        {
            let mut st = monitor.inner.lock();
            st.members.push((tid, requests.clone(), pin));
            monitor.apply(0, pin, st.normal);
        }
        Member {
            monitor,
            tid,
            requests,
        }
    }

    fn answered(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut st = self.monitor.inner.lock();
        st.members.retain(|m| m.0 != self.tid);
        st.alive -= 1;
        if st.alive == 0 {
            self.monitor.gone.notify_all();
        }
    }
}

/// One serving thread at a sample: its id, requests answered, run delay (if readable)
/// and voluntary sleeps (if readable), each a running total.
type ThreadTotals = (libc::pid_t, u64, Option<Duration>, Option<u64>);

/// What the serving threads did since the previous sample: requests answered, time
/// spent waiting for a CPU, and the times they went to sleep (those whose sleeps could
/// be read: `sleeps_of` is how many requests that count covers).
#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
struct Sample {
    requests: u64,
    waited: Duration,
    sleeps: u64,
    sleeps_of: u64,
}

/// The serving threads' activity since the previous sample, from each thread's
/// running totals.
#[derive(Default)]
struct Sampler {
    /// Per thread: requests answered, run delay and sleeps at its previous sample.
    prev: std::collections::HashMap<libc::pid_t, (u64, Duration, Option<u64>)>,
}

impl Sampler {
    /// Takes the totals of every serving thread; returns what those whose run delay
    /// could be read did since their previous sample, or `None` when no thread's
    /// could (no schedstat). A thread's first sample counts nothing.
    fn sample(&mut self, threads: impl Iterator<Item = ThreadTotals>) -> Option<Sample> {
        let (mut out, mut measured) = (Sample::default(), false);
        for (tid, n, delay, sleeps) in threads {
            if let Some(d) = delay {
                measured = true;
                let (n0, d0, s0) = self
                    .prev
                    .insert(tid, (n, d, sleeps))
                    .unwrap_or((n, d, sleeps));
                let answered = n.saturating_sub(n0);
                out.requests += answered;
                out.waited += d.saturating_sub(d0);
                if let (Some(s), Some(s0)) = (sleeps, s0) {
                    out.sleeps += s.saturating_sub(s0);
                    out.sleeps_of += answered;
                }
            }
        }
        measured.then_some(out)
    }
}

/// Whether threads that answered `requests` while waiting `waited` for their CPU in
/// one sample are starved: more than `STARVED_TOTAL` in all and more than
/// `STARVED_PER_REQUEST` per request.
fn starved_by_delay(waited: Duration, requests: u64) -> bool {
    waited > STARVED_TOTAL
        && waited / u32::try_from(requests.max(1)).unwrap_or(u32::MAX) > STARVED_PER_REQUEST
}

/// Whether the serving threads have a backlog: in one sample they answered at least
/// `BACKLOG_MIN` requests and went to sleep less than once per `BACKLOG_PER_SLEEP`
/// of them, so requests were waiting when they finished the one before (an
/// application's queue of asynchronous direct I/O, the kernel's writeback): the
/// caller does not wait for each reply, and the work is better spread over every CPU
/// than kept on the caller's. Requests answered one at a time, each awaited by its
/// caller, make a serving thread sleep once each.
fn backlogged(s: Sample) -> bool {
    s.sleeps_of >= BACKLOG_MIN && s.sleeps.saturating_mul(BACKLOG_PER_SLEEP) <= s.sleeps_of
}

/// CPUs left idle, on average, between two readings of the machine's CPU times
/// (`(idle, total)` in ticks of all CPUs together, from [`cpu_times`]) on a machine of
/// `cpus` CPUs: 1.0 is one whole CPU idle throughout.
fn spare_cpus(prev: (u64, u64), now: (u64, u64), cpus: usize) -> f64 {
    let total = now.1.saturating_sub(prev.1);
    if total == 0 {
        return 0.0;
    }
    now.0.saturating_sub(prev.0) as f64 / total as f64 * cpus as f64
}

/// The machine's idle (idle and iowait) and total CPU ticks so far, over all CPUs
/// (the first line of /proc/stat).
fn cpu_times() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = s
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .take(8)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    (f.len() == 8).then(|| (f[3] + f[4], f.iter().sum()))
}

/// Voluntary context switches of thread `tid` of this process so far (/proc status).
fn sleeps(tid: libc::pid_t) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// When the serving threads go relaxed and when they come back (see `Monitor`).
struct Policy {
    /// How long the relaxed mode outlasts the last starved sample.
    hold: Duration,
    /// The last switch (or the start), or in the relaxed mode the last starved or
    /// backlogged sample.
    since: Instant,
    /// Whether the threads have come back from the relaxed mode at least once (the
    /// start is no return: starvation soon after it does not lengthen `hold`).
    returned: bool,
    /// Samples in a row with more runnable tasks than CPUs.
    busy: u32,
    /// Whether a starved sample came in the current relaxed spell (else only backlogs
    /// did: they end when the requests stop queueing, and are held `HOLD_MIN` alone).
    starved: bool,
}

impl Policy {
    fn new(now: Instant) -> Policy {
        Policy {
            hold: HOLD_MIN,
            since: now,
            returned: false,
            busy: 0,
            starved: false,
        }
    }

    /// Starvation where run delays cannot be read: more runnable tasks than CPUs in two
    /// samples in a row.
    fn starved_by_load(&mut self, runnable: usize, cpus: usize) -> bool {
        self.busy = if runnable > cpus { self.busy + 1 } else { 0 };
        self.busy >= 2
    }

    /// The mode wanted after a sample at `now` (`normal`: relaxed), from the current one
    /// and whether the sample showed starvation or a backlog. A backlog relaxes as
    /// starvation does, but is held only `HOLD_MIN` and never lengthens `hold`: it is
    /// the requests' own pattern, not a CPU taken from the threads, and the requests
    /// answered one at a time that may follow it run best pinned.
    fn step(&mut self, normal: bool, starved: bool, backlog: bool, now: Instant) -> bool {
        let want_normal = if normal {
            if starved || backlog {
                self.since = now;
            }
            self.starved |= starved;
            now - self.since < if self.starved { self.hold } else { HOLD_MIN }
        } else {
            if now - self.since >= HOLD_MAX {
                self.hold = HOLD_MIN;
            }
            self.starved = starved;
            starved || backlog
        };
        if want_normal != normal {
            if want_normal && starved && self.returned && now - self.since < Duration::from_secs(1)
            {
                // Starvation back soon after the return: hold longer.
                self.hold = (self.hold * 2).min(HOLD_MAX);
            }
            self.returned |= !want_normal;
            self.since = now;
        }
        want_normal
    }
}

/// Time thread `tid` of this process has spent runnable but waiting for a CPU (the
/// second field of its schedstat; absent without CONFIG_SCHED_INFO).
fn run_delay(tid: libc::pid_t) -> Option<Duration> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    let ns = s.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Runnable tasks on the machine now, the caller excluded (/proc/loadavg's fourth field).
fn runnable_tasks() -> usize {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(3)?
                .split('/')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map_or(0, |n| n.saturating_sub(1))
}

impl Monitor {
    /// Thread `tid` (0: this one) in the relaxed mode (`normal`: SCHED_OTHER, on any
    /// CPU) or the default one (SCHED_IDLE, pinned to `pin`).
    fn apply(&self, tid: libc::pid_t, pin: Option<usize>, normal: bool) {
        // Affinity first: a thread seen in its new class has its new CPUs too.
        set_affinity(tid, if normal { None } else { pin }, &self.all);
        if let Err(e) = set_idle_class(tid, !normal) {
            debug!("uring: scheduling class of {tid}: {e}");
        }
    }

    /// Samples every `SAMPLE` until the serving threads are gone.
    fn run(&self, cpus: usize) {
        let mut sampler = Sampler::default();
        let mut policy = Policy::new(Instant::now());
        let mut times = cpu_times();
        loop {
            let mut st = self.inner.lock();
            if st.alive > 0 {
                self.gone.wait_for(&mut st, SAMPLE);
            }
            if st.alive == 0 {
                return;
            }
            let samples = st.members.iter().map(|(tid, count, _)| {
                let n = count.load(Ordering::Relaxed);
                (*tid, n, run_delay(*tid), sleeps(*tid))
            });
            let (starved, backlog) = match sampler.sample(samples) {
                Some(s) => (starved_by_delay(s.waited, s.requests), backlogged(s)),
                None => (policy.starved_by_load(runnable_tasks(), cpus), false),
            };
            // A backlog moves pinned threads only where a CPU is left idle for them
            // (every CPU busy, each serving its own queue, they are best where they
            // are); once moved, they stay while it lasts.
            let now_times = cpu_times();
            let spare = match (times, now_times) {
                (Some(a), Some(b)) => spare_cpus(a, b, cpus),
                _ => f64::INFINITY,
            };
            times = now_times;
            let backlog = backlog && (st.normal || spare >= BACKLOG_SPARE_CPUS);
            let want_normal = policy.step(st.normal, starved, backlog, Instant::now());
            if want_normal == st.normal {
                continue;
            }
            st.normal = want_normal;
            debug!(
                "uring: serving threads to SCHED_{}",
                if want_normal {
                    "OTHER, any CPU"
                } else {
                    "IDLE, pinned"
                }
            );
            for &(tid, _, pin) in &st.members {
                self.apply(tid, pin, want_normal);
            }
        }
    }
}

/// Makes one ring per serving thread: `per_queue` for each online CPU, one for each
/// possible but offline CPU (the kernel wants an entry in every queue).
pub(crate) fn prepare(per_queue: usize, payload: usize) -> io::Result<Prepared> {
    let read = |p: &str| std::fs::read_to_string(p);
    let possible = parse_cpu_list(&read("/sys/devices/system/cpu/possible")?)
        .ok_or_else(|| io::Error::other("unreadable CPU list"))?;
    let online = parse_cpu_list(&read("/sys/devices/system/cpu/online")?).unwrap_or_default();
    let plan = queue_plan(&possible, &online, per_queue)?;
    can_switch_class().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "its threads may not leave SCHED_IDLE ({e}): run as root (CAP_SYS_NICE) or \
                 raise RLIMIT_NICE to 20 (`ulimit -e 20` where the hard limit allows, or \
                 `USER - nice 0` in /etc/security/limits.conf) to use it; serving through \
                 /dev/fuse"
            ),
        )
    })?;
    let mut rings = Vec::with_capacity(plan.len());
    for (qid, pin) in plan {
        let ring = IoUring::<Entry128, cqueue::Entry>::builder().build(4)?;
        rings.push((qid, pin, ring));
    }
    Ok(Prepared { rings, payload })
}

/// One (queue id, pin to that CPU) per serving thread: `per_queue` for each online
/// CPU, one unpinned for each possible but offline CPU (the kernel wants an entry in
/// every queue).
fn queue_plan(
    possible: &[usize],
    online: &[usize],
    per_queue: usize,
) -> io::Result<Vec<(u16, bool)>> {
    // The kernel makes num_possible_cpus() queues and picks one by CPU number: the
    // numbers must be 0..n for every CPU to have its queue.
    if possible.iter().enumerate().any(|(i, &c)| i != c) || possible.len() > u16::MAX as usize {
        return Err(io::Error::other("possible CPUs are not numbered 0..n"));
    }
    let mut plan = Vec::new();
    for &cpu in possible {
        let up = online.contains(&cpu);
        for _ in 0..if up { per_queue.max(1) } else { 1 } {
            plan.push((cpu as u16, up));
        }
    }
    Ok(plan)
}

/// Queues whose CPU is online, among the (queue, pinned) of the serving threads.
fn online_queues(threads: impl Iterator<Item = (u16, bool)>) -> usize {
    threads
        .filter(|t| t.1)
        .map(|t| t.0)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

/// Starts the serving threads; they end when the connection goes away.
pub(crate) fn spawn<FS: Filesystem + 'static>(
    prepared: Prepared,
    fd: RawFd,
    make_loop: impl Fn(String) -> SessionEventLoop<FS>,
) -> io::Result<Vec<std::thread::JoinHandle<io::Result<()>>>> {
    let Prepared { rings, payload } = prepared;
    let monitor = Arc::new(Monitor {
        inner: Mutex::new(MonitorState::default()),
        gone: parking_lot::Condvar::new(),
        all: process_cpus(),
    });
    let cpus = online_queues(rings.iter().map(|r| (r.0, r.1)));
    // Every thread counts as alive from here, so the monitor ends only after all left.
    monitor.inner.lock().alive = rings.len();
    let mut threads = Vec::with_capacity(rings.len() + 1);
    let mut rings = rings.into_iter().enumerate();
    while let Some((i, (qid, pin, ring))) = rings.next() {
        let name = format!("fuser-q{qid}.{i}");
        let se = make_loop(name.clone());
        let m = monitor.clone();
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let member = Member::join(m, pin.then_some(qid as usize));
            serve(se, ring, fd, qid, payload, &member)
        });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                monitor.inner.lock().alive -= 1 + rings.len();
                return Err(e);
            }
        }
    }
    threads.push(
        std::thread::Builder::new()
            .name("fuser-uring-mon".into())
            .spawn(move || {
                monitor.run(cpus.max(1));
                Ok(())
            })?,
    );
    Ok(threads)
}

/// The CPUs this process may run on (its threads inherit them until pinned).
fn process_cpus() -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is a valid (empty) set for sched_getaffinity to fill.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            for cpu in 0..libc::CPU_SETSIZE as usize {
                libc::CPU_SET(cpu, &mut set);
            }
        }
        set
    }
}

/// Lets thread `tid` (0: this one) run on CPU `cpu` alone, or with `None` on `all`.
fn set_affinity(tid: libc::pid_t, cpu: Option<usize>, all: &libc::cpu_set_t) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it for any CPU
    // below CPU_SETSIZE (checked); sched_setaffinity reads one set.
    unsafe {
        let set = match cpu {
            Some(c) if c < libc::CPU_SETSIZE as usize => {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(c, &mut set);
                set
            }
            Some(_) => return,
            None => *all,
        };
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            // A cpuset may leave this CPU out: serve its queue from anywhere.
            debug!(
                "uring: affinity of {tid} to {cpu:?}: {}",
                io::Error::last_os_error()
            );
        }
    }
}

/// An io_uring command SQE for /dev/fuse: `cmd_op`, queue, commit id, and for
/// REGISTER the entry's two buffers.
fn fuse_cmd(
    fd: RawFd,
    cmd_op: u32,
    qid: u16,
    commit_id: u64,
    iov: Option<&[libc::iovec; 2]>,
) -> Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut op = UringCmd80::new(Fd(fd), cmd_op).cmd(cmd);
    if let Some(iov) = iov {
        op = op.addr(Some(iov.as_ptr() as u64));
    }
    let sqe = op.build();
    if iov.is_none() {
        return sqe;
    }
    // The builder has no setter for `len`, which REGISTER needs (the iovec count).
    // Entry128 is repr(C): the 64-byte io_uring_sqe, whose `len` (u32) is at offset 24,
    // then 64 bytes of command.
    // SAFETY: same size (checked by transmute) and every byte pattern is a valid SQE.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute::<Entry128, [u8; 128]>(sqe) };
    raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
    unsafe { std::mem::transmute::<[u8; 128], Entry128>(raw) }
}

/// Submits `sqe` and waits for the completion of this thread's only command.
fn submit_and_wait(ring: &mut IoUring<Entry128, cqueue::Entry>, sqe: &Entry128) -> io::Result<i32> {
    // SAFETY: the buffers the SQE points at (the entry's, and the iovecs for REGISTER)
    // live in `serve` for as long as the ring does.
    unsafe { ring.submission().push(sqe) }
        .map_err(|_| io::Error::other("submission queue full"))?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
        if let Some(cqe) = ring.completion().next() {
            return Ok(cqe.result());
        }
    }
}

/// One ring entry's buffers, shared with the reply objects of its current request.
struct Slot {
    /// HDR_SIZE bytes, 8-aligned.
    hdr: *mut u8,
    /// LEAD bytes of room, then `cap` bytes of payload; 8-aligned.
    data: *mut u8,
    cap: usize,
    words_hdr: usize,
    words_data: usize,
    /// `data` is a mapping (`alloc_payload`), unmapped on drop.
    data_mapped: bool,
    state: Mutex<SlotState>,
    replied: Condvar,
}

// SAFETY: the buffers are plain bytes; who writes them when is ordered by `state`: the
// serving thread between completions and before dispatch, a reply (once per request,
// under the lock) after, the kernel only while the entry is submitted.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

struct SlotState {
    /// Bumped per request, so a reply that outlives its request is refused.
    generation: u64,
    replied: bool,
    /// The request has no payload to keep: the reply body goes into the payload buffer.
    direct: bool,
    body_len: usize,
    staged: Vec<u8>,
}

fn alloc_words(words: usize) -> *mut u8 {
    Box::into_raw(vec![0u64; words].into_boxed_slice()).cast::<u8>()
}

/// A payload buffer of `words` words: fresh pages where the kernel maps them (zero,
/// faulted in only where a request writes: see `read_buf::map_zeroed`), else zeroed
/// words. Returns the buffer and whether it is a mapping.
fn alloc_payload(words: usize) -> (*mut u8, bool) {
    match crate::read_buf::map_zeroed(words * 8) {
        Some(p) => (p, true),
        None => (alloc_words(words), false),
    }
}

impl Slot {
    fn new(cap: usize) -> Slot {
        let words_hdr = HDR_SIZE.div_ceil(8);
        let words_data = (LEAD + cap).div_ceil(8);
        let data = alloc_payload(words_data);
        Slot {
            hdr: alloc_words(words_hdr),
            data: data.0,
            data_mapped: data.1,
            cap,
            words_hdr,
            words_data,
            state: Mutex::new(SlotState {
                generation: 0,
                replied: false,
                direct: false,
                body_len: 0,
                staged: Vec::new(),
            }),
            replied: Condvar::new(),
        }
    }

    fn payload(&self) -> *mut u8 {
        // SAFETY: LEAD is within the data allocation.
        unsafe { self.data.add(LEAD) }
    }

    fn read_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        // SAFETY: callers pass offsets within the headers buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.hdr.add(off), b.as_mut_ptr(), 4) };
        u32::from_ne_bytes(b)
    }

    fn read_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: as read_u32.
        unsafe { std::ptr::copy_nonoverlapping(self.hdr.add(off), b.as_mut_ptr(), 8) };
        u64::from_ne_bytes(b)
    }

    fn write_hdr(&self, off: usize, bytes: &[u8]) {
        debug_assert!(off + bytes.len() <= HDR_SIZE);
        // SAFETY: within the headers buffer, which nothing else touches meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.hdr.add(off), bytes.len()) };
    }

    /// An error reply written by the server itself (bad request, no reply given).
    fn set_status(&self, unique: u64, error: i32) {
        let mut out = [0u8; OUT_HEADER];
        out[0..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&error.to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        self.write_hdr(0, &out);
        let mut st = self.state.lock();
        st.replied = true;
        st.body_len = 0;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: allocated by alloc_words with these lengths, freed once.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.hdr.cast::<u64>(),
                self.words_hdr,
            )));
            if self.data_mapped {
                crate::read_buf::unmap(self.data, self.words_data * 8);
            } else {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    self.data.cast::<u64>(),
                    self.words_data,
                )));
            }
        }
    }
}

/// Where a reply to a request that came through a ring entry goes.
#[derive(Clone)]
pub(crate) struct RingReply {
    slot: Arc<Slot>,
    generation: u64,
}

impl std::fmt::Debug for RingReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingReply")
            .field("generation", &self.generation)
            .finish()
    }
}

impl RingReply {
    /// Writes a reply (fuse_out_header then body, as for writev on /dev/fuse) into the
    /// entry: the header into `in_out`, the body into the payload buffer or, while the
    /// request's own payload is still borrowed, a staging buffer.
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let slot = &*self.slot;
        let mut st = slot.state.lock();
        if st.generation != self.generation || st.replied {
            return Err(io::Error::other("reply to a finished io_uring request"));
        }
        let total: usize = data.iter().map(|s| s.len()).sum();
        if total < OUT_HEADER {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "short reply"));
        }
        let body_len = total - OUT_HEADER;
        let mut header = [0u8; OUT_HEADER];
        let mut at = 0usize;
        if body_len > slot.cap {
            // Cannot happen for replies sized by their request; fail the request.
            let mut h = [0u8; OUT_HEADER];
            copy_out(data, 0, &mut h);
            let unique = u64::from_ne_bytes(h[8..16].try_into().unwrap_or_default());
            drop(st);
            slot.set_status(unique, -libc::EIO);
            slot.replied.notify_all();
            return Err(io::Error::other("reply larger than the ring buffer"));
        }
        at += copy_out(data, at, &mut header);
        slot.write_hdr(0, &header);
        if body_len > 0 {
            if st.direct {
                // SAFETY: the payload buffer holds `cap` >= body_len bytes and the request
                // borrows none of it (it had no payload).
                let body = unsafe { std::slice::from_raw_parts_mut(slot.payload(), body_len) };
                copy_out(data, at, body);
            } else {
                let mut staged = std::mem::take(&mut st.staged);
                staged.resize(body_len, 0);
                copy_out(data, at, &mut staged);
                st.staged = staged;
            }
        }
        st.body_len = body_len;
        st.replied = true;
        drop(st);
        slot.replied.notify_all();
        Ok(())
    }
}

impl RingReply {
    /// Replies with a body that `fill` writes straight into the entry's payload buffer
    /// (at most `max` bytes; `fill` returns how many it wrote, or the error to reply
    /// with), so a READ's data is copied once, from the filesystem into the buffer the
    /// kernel reads. `Err(fill)` when the buffer cannot take it (the request kept a
    /// payload, the reply is too large, or it was answered already): the caller then
    /// fills a buffer of its own.
    pub(crate) fn fill<F>(&self, unique: u64, max: usize, fill: F) -> Result<io::Result<()>, F>
    where
        F: FnOnce(&mut [u8]) -> Result<usize, i32>,
    {
        let slot = &*self.slot;
        let mut st = slot.state.lock();
        if st.generation != self.generation || st.replied || !st.direct || max > slot.cap {
            return Err(fill);
        }
        // SAFETY: the payload buffer holds `cap` >= max bytes, initialized at
        // allocation; the request borrows none of it (it had no payload), and nothing
        // else touches it until this reply is committed (the state lock is held).
        let body = unsafe { std::slice::from_raw_parts_mut(slot.payload(), max) };
        let (error, body_len) = match fill(body) {
            Ok(n) => (0, n.min(max)),
            Err(errno) => (-errno.abs(), 0),
        };
        let mut out = [0u8; OUT_HEADER];
        out[0..4].copy_from_slice(&((OUT_HEADER + body_len) as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&error.to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        slot.write_hdr(0, &out);
        st.body_len = body_len;
        st.replied = true;
        drop(st);
        slot.replied.notify_all();
        Ok(Ok(()))
    }
}

/// Copies bytes `skip..skip + out.len()` of the concatenation of `data` into `out`;
/// returns how many were copied.
fn copy_out(data: &[IoSlice<'_>], mut skip: usize, out: &mut [u8]) -> usize {
    let mut n = 0;
    for s in data {
        if n == out.len() {
            break;
        }
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        let take = (s.len() - skip).min(out.len() - n);
        out[n..n + take].copy_from_slice(&s[skip..skip + take]);
        n += take;
        skip = 0;
    }
    n
}

/// A serving thread: registers its entry, then handles a request and commits its
/// reply until the connection goes away.
fn serve<FS: Filesystem>(
    se: SessionEventLoop<FS>,
    mut ring: IoUring<Entry128, cqueue::Entry>,
    fd: RawFd,
    qid: u16,
    payload: usize,
    member: &Member,
) -> io::Result<()> {
    let slot = Arc::new(Slot::new(payload));
    let iov = [
        libc::iovec {
            iov_base: slot.hdr.cast(),
            iov_len: HDR_SIZE,
        },
        libc::iovec {
            iov_base: slot.payload().cast(),
            iov_len: payload,
        },
    ];
    let mut sqe = fuse_cmd(fd, CMD_REGISTER, qid, 0, Some(&iov));
    loop {
        let res = submit_and_wait(&mut ring, &sqe)?;
        if res < 0 {
            let err = io::Error::from_raw_os_error(-res);
            return match -res {
                // The connection is unmounted or aborted, or the ring torn down; or
                // `enable_uring` was turned off between INIT and REGISTER (requests then
                // keep to /dev/fuse).
                libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => Ok(()),
                libc::EOPNOTSUPP => {
                    debug!("fuse io_uring queue {qid}: not enabled");
                    Ok(())
                }
                _ => {
                    warn!("fuse io_uring queue {qid}: {err}");
                    Err(err)
                }
            };
        }
        let commit_id = handle(&se, &slot);
        member.answered();
        sqe = fuse_cmd(fd, CMD_COMMIT_AND_FETCH, qid, commit_id, None);
    }
}

/// Dispatches the request in the entry; returns its commit id with the reply in place.
fn handle<FS: Filesystem>(se: &SessionEventLoop<FS>, slot: &Arc<Slot>) -> u64 {
    let opcode = slot.read_u32(4);
    let unique = slot.read_u64(8);
    let commit_id = slot.read_u64(HDR_ENT_IN_OUT + 8);
    let generation = begin(slot);
    let mut scratch = Vec::new();
    let Some(msg) = assemble(slot, &mut scratch) else {
        warn!(
            "fuse io_uring: malformed request (len {}, payload {})",
            slot.read_u32(0),
            slot.read_u32(HDR_ENT_IN_OUT + 16)
        );
        slot.set_status(unique, -libc::EIO);
        return finish(slot, commit_id);
    };
    let reply = RingReply {
        slot: slot.clone(),
        generation,
    };
    match RequestWithSender::with_ring(se.ch.sender(), reply, msg) {
        Some(req) => req.dispatch(se),
        None => slot.set_status(unique, -libc::EIO),
    }
    // A reply handed to another thread is waited for; requests without replies should
    // not come this way, but would otherwise hold the entry forever.
    let mut st = slot.state.lock();
    if !st.replied && matches!(opcode, FUSE_FORGET | FUSE_BATCH_FORGET) {
        drop(st);
        slot.set_status(unique, 0);
    } else {
        while !st.replied {
            slot.replied.wait(&mut st);
        }
        drop(st);
    }
    finish(slot, commit_id)
}

/// A new request is in the entry: replies to earlier ones are refused from now on, and
/// one whose request has no payload goes straight into the payload buffer. Returns the
/// request's generation.
fn begin(slot: &Slot) -> u64 {
    let payload_sz = slot.read_u32(HDR_ENT_IN_OUT + 16);
    let mut st = slot.state.lock();
    st.generation += 1;
    st.replied = false;
    st.direct = payload_sz == 0;
    st.body_len = 0;
    st.generation
}

/// Where a request of `in_len` bytes (header, first argument, payload) with
/// `payload_sz` bytes of payload is put together: the first argument's length, and
/// where in the data buffer the message starts when it can be built in place, just
/// before the payload (`None`: the payload would be misaligned there, so the message
/// is copied). `None` for a request that does not fit the entry.
fn layout(in_len: usize, payload_sz: usize, cap: usize) -> Option<(usize, Option<usize>)> {
    let arg0 = in_len.checked_sub(IN_HEADER + payload_sz)?;
    if arg0 > OP_IN_MAX || payload_sz > cap {
        return None;
    }
    let in_place = ((IN_HEADER + arg0) % 8 == 0).then(|| LEAD - IN_HEADER - arg0);
    Some((arg0, in_place))
}

/// The request in the entry as /dev/fuse would deliver it (in-header, first argument,
/// payload, contiguous and 8-aligned), built in the room before the payload so the
/// payload is not copied, or in `scratch` when that would misalign the payload.
/// `None` for a malformed request.
fn assemble<'s>(slot: &'s Slot, scratch: &'s mut Vec<u64>) -> Option<&'s [u8]> {
    let in_len = slot.read_u32(0) as usize;
    let payload_sz = slot.read_u32(HDR_ENT_IN_OUT + 16) as usize;
    let (arg0, in_place) = layout(in_len, payload_sz, slot.cap)?;
    let len = IN_HEADER + arg0 + payload_sz;
    Some(match in_place {
        Some(start) => {
            // SAFETY: [start, LEAD) is the room before the payload, inside the data
            // allocation; the headers buffer holds IN_HEADER + arg0 <= 168 readable
            // bytes at these offsets. The message then spans the room and the request's
            // payload, which the kernel wrote before completing and nothing writes until
            // the reply (direct replies only when there is no request payload, and past
            // LEAD).
            unsafe {
                std::ptr::copy_nonoverlapping(slot.hdr, slot.data.add(start), IN_HEADER);
                std::ptr::copy_nonoverlapping(
                    slot.hdr.add(HDR_OP_IN),
                    slot.data.add(start + IN_HEADER),
                    arg0,
                );
                std::slice::from_raw_parts(slot.data.add(start), len)
            }
        }
        None => {
            // First arguments are whole structs (multiples of 8 bytes) as of Linux 6.18;
            // any other size would leave the payload unaligned in place: copy the
            // message to an aligned buffer instead of refusing it.
            *scratch = vec![0u64; len.div_ceil(8)];
            let base = scratch.as_mut_ptr().cast::<u8>();
            // SAFETY: `scratch` holds >= len bytes and is not otherwise borrowed; the
            // sources are as above plus the payload (payload_sz <= cap).
            unsafe {
                std::ptr::copy_nonoverlapping(slot.hdr, base, IN_HEADER);
                std::ptr::copy_nonoverlapping(slot.hdr.add(HDR_OP_IN), base.add(IN_HEADER), arg0);
                std::ptr::copy_nonoverlapping(
                    slot.payload(),
                    base.add(IN_HEADER + arg0),
                    payload_sz,
                );
                std::slice::from_raw_parts(base, len)
            }
        }
    })
}

/// Moves a staged body into the payload buffer and records its size for the kernel.
fn finish(slot: &Slot, commit_id: u64) -> u64 {
    let mut st = slot.state.lock();
    let body_len = st.body_len;
    if body_len > 0 && !st.direct {
        // SAFETY: body_len <= cap (checked in send); the request's borrow has ended.
        unsafe { std::ptr::copy_nonoverlapping(st.staged.as_ptr(), slot.payload(), body_len) };
        st.staged.clear();
    }
    // One reply per generation: a late duplicate is refused.
    st.generation += 1;
    drop(st);
    slot.write_hdr(HDR_ENT_IN_OUT + 16, &(body_len as u32).to_ne_bytes());
    commit_id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ll::AnyRequest;
    use crate::ll::Operation;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,6\n"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-9999"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    /// Each online CPU's queue gets `per_queue` pinned threads, each offline one a single
    /// unpinned thread; possible CPUs must be numbered 0..n.
    #[test]
    fn queues_follow_the_cpus() {
        let plan = queue_plan(&[0, 1, 2, 3], &[0, 1, 3], 2).unwrap();
        assert_eq!(
            plan,
            [
                (0, true),
                (0, true),
                (1, true),
                (1, true),
                (2, false),
                (3, true),
                (3, true)
            ]
        );
        assert_eq!(online_queues(plan.iter().copied()), 3);
        assert_eq!(
            queue_plan(&[0, 1], &[0, 1], 0).unwrap(),
            [(0, true), (1, true)]
        );
        assert!(queue_plan(&[0, 2], &[0, 2], 1).is_err());
        assert!(queue_plan(&[1, 2], &[1, 2], 1).is_err());
    }

    fn sqe_bytes(sqe: Entry128) -> [u8; 128] {
        // SAFETY: Entry128 is the 128-byte SQE (size checked by transmute).
        unsafe { std::mem::transmute::<Entry128, [u8; 128]>(sqe) }
    }

    /// The SQEs the kernel reads: URING_CMD on the fd with the command, the commit id
    /// and queue in the command area (byte 48 on), and for REGISTER the two iovecs.
    #[test]
    fn register_and_commit_commands() {
        let iov = [
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: HDR_SIZE,
            },
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 4096,
            },
        ];
        let reg = sqe_bytes(fuse_cmd(7, CMD_REGISTER, 3, 0, Some(&iov)));
        assert_eq!(reg[0], UringCmd80::CODE);
        assert_eq!(reg[4..8], 7i32.to_ne_bytes());
        assert_eq!(reg[8..12], CMD_REGISTER.to_ne_bytes());
        assert_eq!(reg[16..24], (iov.as_ptr() as u64).to_ne_bytes());
        assert_eq!(reg[24..28], 2u32.to_ne_bytes());
        assert_eq!(reg[56..64], 0u64.to_ne_bytes());
        assert_eq!(reg[64..66], 3u16.to_ne_bytes());

        let commit = sqe_bytes(fuse_cmd(7, CMD_COMMIT_AND_FETCH, 1, 0xabcd, None));
        assert_eq!(commit[0], UringCmd80::CODE);
        assert_eq!(commit[8..12], CMD_COMMIT_AND_FETCH.to_ne_bytes());
        assert_eq!(commit[16..28], [0; 12], "no buffers, no length");
        assert_eq!(commit[56..64], 0xabcdu64.to_ne_bytes());
        assert_eq!(commit[64..66], 1u16.to_ne_bytes());
    }

    /// Puts a request into `slot` as the kernel does: the in-header and first argument
    /// in the headers buffer, the payload in the payload buffer.
    fn put_request(slot: &Slot, opcode: u32, arg0: &[u8], payload: &[u8], commit_id: u64) {
        let len = (IN_HEADER + arg0.len() + payload.len()) as u32;
        let mut h = [0u8; IN_HEADER];
        h[0..4].copy_from_slice(&len.to_ne_bytes());
        h[4..8].copy_from_slice(&opcode.to_ne_bytes());
        h[8..16].copy_from_slice(&0x1234_5678u64.to_ne_bytes()); // unique
        h[16..24].copy_from_slice(&1u64.to_ne_bytes()); // nodeid
        slot.write_hdr(0, &h);
        slot.write_hdr(HDR_OP_IN, arg0);
        slot.write_hdr(HDR_ENT_IN_OUT + 8, &commit_id.to_ne_bytes());
        slot.write_hdr(HDR_ENT_IN_OUT + 16, &(payload.len() as u32).to_ne_bytes());
        assert!(payload.len() <= slot.cap);
        // SAFETY: the payload buffer holds `cap` >= payload.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), slot.payload(), payload.len()) };
    }

    fn payload_bytes(slot: &Slot, n: usize) -> Vec<u8> {
        assert!(n <= slot.cap);
        // SAFETY: within the payload buffer.
        unsafe { std::slice::from_raw_parts(slot.payload(), n) }.to_vec()
    }

    fn hdr_bytes(slot: &Slot, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= HDR_SIZE);
        // SAFETY: within the headers buffer.
        unsafe { std::slice::from_raw_parts(slot.hdr.add(off), n) }.to_vec()
    }

    /// A WRITE (a 40-byte first argument) is rebuilt in place: the message /dev/fuse
    /// would give, 8-aligned, parsing to the same request, with its data the entry's
    /// payload buffer itself.
    #[test]
    fn a_request_is_rebuilt_before_its_payload() {
        let slot = Slot::new(8192);
        let mut write_in = [0u8; 40];
        write_in[0..8].copy_from_slice(&9u64.to_ne_bytes()); // fh
        write_in[8..16].copy_from_slice(&4096u64.to_ne_bytes()); // offset
        write_in[16..20].copy_from_slice(&5000u32.to_ne_bytes()); // size
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        put_request(&slot, 16, &write_in, &data, 1);
        let mut scratch = Vec::new();
        let msg = assemble(&slot, &mut scratch).expect("well formed");
        assert_eq!(
            msg.as_ptr(),
            slot.payload().wrapping_sub(IN_HEADER + 40).cast_const(),
            "built in place, just before the payload"
        );
        assert_eq!(msg.len(), IN_HEADER + 40 + 5000);
        assert_eq!(msg.as_ptr() as usize % 8, 0);
        assert_eq!(msg[..IN_HEADER], hdr_bytes(&slot, 0, IN_HEADER)[..]);
        assert_eq!(msg[IN_HEADER..IN_HEADER + 40], write_in);
        let req = AnyRequest::try_from(msg).expect("parses");
        match req.operation().expect("operation") {
            Operation::Write(w) => {
                assert_eq!((w.file_handle().0, w.offset()), (9, Ok(4096)));
                assert_eq!(w.data(), &data[..]);
                assert_eq!(w.data().as_ptr(), slot.payload().cast_const(), "not copied");
            }
            _ => panic!("not a WRITE"),
        }
    }

    /// A first argument whose size would leave the payload misaligned in place makes
    /// the message be copied whole into an aligned buffer.
    #[test]
    fn a_misaligning_first_argument_is_copied_aligned() {
        let slot = Slot::new(256);
        let arg0: Vec<u8> = (1..=12).collect();
        let payload: Vec<u8> = (100..150).collect();
        put_request(&slot, 99, &arg0, &payload, 2);
        let mut scratch = Vec::new();
        let msg = assemble(&slot, &mut scratch).expect("well formed").to_vec();
        assert!(!scratch.is_empty(), "copied");
        assert_eq!(scratch.as_ptr() as usize % 8, 0);
        let mut want = hdr_bytes(&slot, 0, IN_HEADER);
        want.extend(&arg0);
        want.extend(&payload);
        assert_eq!(msg, want);
    }

    #[test]
    fn layouts() {
        // (first argument length, start of the in-place message)
        assert_eq!(layout(IN_HEADER, 0, 64), Some((0, Some(LEAD - IN_HEADER))));
        assert_eq!(
            layout(IN_HEADER + 16 + 10, 10, 64),
            Some((16, Some(LEAD - 56)))
        );
        assert_eq!(
            layout(IN_HEADER + OP_IN_MAX, 0, 64),
            Some((OP_IN_MAX, Some(LEAD - 168)))
        );
        assert_eq!(layout(IN_HEADER + 12 + 8, 8, 64), Some((12, None)));
        // Shorter than header and payload, a first argument too long, a payload larger
        // than the entry.
        assert_eq!(layout(IN_HEADER + 4, 8, 64), None);
        assert_eq!(layout(IN_HEADER + OP_IN_MAX + 8, 0, 64), None);
        assert_eq!(layout(IN_HEADER + 65, 65, 64), None);
    }

    #[test]
    fn a_malformed_request_is_refused() {
        let slot = Slot::new(64);
        put_request(&slot, 3, &[0; 16], &[], 3);
        slot.write_hdr(HDR_ENT_IN_OUT + 16, &100u32.to_ne_bytes());
        assert!(assemble(&slot, &mut Vec::new()).is_none());
    }

    fn out_header(len: usize, error: i32, unique: u64) -> Vec<u8> {
        let mut h = (len as u32).to_ne_bytes().to_vec();
        h.extend(error.to_ne_bytes());
        h.extend(unique.to_ne_bytes());
        h
    }

    /// A request without payload: the reply's header goes to `in_out`, its body
    /// straight into the payload buffer, and its size into `ent_in_out`.
    #[test]
    fn a_reply_goes_into_the_entry() {
        let slot = Arc::new(Slot::new(4096));
        put_request(&slot, 3, &[0; 16], &[], 41);
        let generation = begin(&slot);
        let reply = RingReply {
            slot: slot.clone(),
            generation,
        };
        let body: Vec<u8> = (0..104).collect();
        let header = out_header(OUT_HEADER + body.len(), 0, 7);
        // The header split over two slices, as a reply may give it.
        reply
            .send(&[
                IoSlice::new(&header[..10]),
                IoSlice::new(&header[10..]),
                IoSlice::new(&body),
            ])
            .expect("send");
        assert_eq!(hdr_bytes(&slot, 0, OUT_HEADER), header);
        assert_eq!(payload_bytes(&slot, body.len()), body, "written in place");
        assert_eq!(finish(&slot, 41), 41);
        assert_eq!(
            hdr_bytes(&slot, HDR_ENT_IN_OUT + 16, 4),
            104u32.to_ne_bytes()
        );
        // Once committed, the request is over: a second reply is refused.
        assert!(reply.send(&[IoSlice::new(&header)]).is_err());
    }

    /// A reply filled in place (a READ's data) is written by the filler into the
    /// payload buffer itself, with a header counting what it wrote; an error from the
    /// filler is the reply's error, with no body; once replied, a fill is refused.
    #[test]
    fn a_reply_filled_in_place() {
        let slot = Arc::new(Slot::new(4096));
        put_request(&slot, 15, &[0; 24], &[], 41);
        let reply = RingReply {
            slot: slot.clone(),
            generation: begin(&slot),
        };
        let r = reply.fill(7, 4096, |b| {
            assert_eq!(
                b.as_ptr(),
                slot.payload().cast_const(),
                "the payload buffer"
            );
            assert_eq!(b.len(), 4096);
            b[..100].copy_from_slice(&[0xA5; 100]);
            Ok(100)
        });
        assert!(matches!(r, Ok(Ok(()))));
        assert_eq!(
            hdr_bytes(&slot, 0, OUT_HEADER),
            out_header(OUT_HEADER + 100, 0, 7)
        );
        assert_eq!(payload_bytes(&slot, 100), [0xA5; 100]);
        assert_eq!(finish(&slot, 41), 41);
        assert_eq!(
            hdr_bytes(&slot, HDR_ENT_IN_OUT + 16, 4),
            100u32.to_ne_bytes()
        );
        assert!(
            reply.fill(7, 10, |_| Ok(1)).is_err(),
            "one reply per request"
        );

        put_request(&slot, 15, &[0; 24], &[], 42);
        let reply = RingReply {
            slot: slot.clone(),
            generation: begin(&slot),
        };
        assert!(
            reply.fill(8, 4097, |_| Ok(1)).is_err(),
            "larger than the buffer: the caller fills its own"
        );
        assert!(matches!(reply.fill(8, 10, |_| Err(libc::EIO)), Ok(Ok(()))));
        assert_eq!(
            hdr_bytes(&slot, 0, OUT_HEADER),
            out_header(OUT_HEADER, -libc::EIO, 8)
        );
        assert_eq!(finish(&slot, 42), 42);
        assert_eq!(hdr_bytes(&slot, HDR_ENT_IN_OUT + 16, 4), 0u32.to_ne_bytes());
    }

    /// A request that brought a payload (a WRITE) keeps its buffer: a fill is refused
    /// and the payload is untouched.
    #[test]
    fn a_fill_leaves_a_request_payload_alone() {
        let slot = Arc::new(Slot::new(4096));
        put_request(&slot, 16, &[0; 40], b"request data", 5);
        let reply = RingReply {
            slot: slot.clone(),
            generation: begin(&slot),
        };
        assert!(
            reply
                .fill(9, 8, |b| {
                    b.fill(0);
                    Ok(8)
                })
                .is_err()
        );
        assert_eq!(payload_bytes(&slot, 12), b"request data");
        assert!(!slot.state.lock().replied);
    }

    /// While the request's payload is still borrowed the reply body is staged, and
    /// placed into the payload buffer only when the request is done.
    #[test]
    fn a_reply_to_a_request_with_payload_is_staged() {
        let slot = Arc::new(Slot::new(4096));
        put_request(&slot, 16, &[0; 40], b"request data", 5);
        let generation = begin(&slot);
        let reply = RingReply {
            slot: slot.clone(),
            generation,
        };
        let body = 12u32.to_ne_bytes();
        let header = out_header(OUT_HEADER + 8, 0, 9);
        reply
            .send(&[
                IoSlice::new(&header),
                IoSlice::new(&body),
                IoSlice::new(&[0; 4]),
            ])
            .expect("send");
        assert_eq!(
            payload_bytes(&slot, 12),
            b"request data",
            "payload untouched"
        );
        assert!(
            reply.send(&[IoSlice::new(&header)]).is_err(),
            "one reply per request"
        );
        assert_eq!(finish(&slot, 5), 5);
        assert_eq!(payload_bytes(&slot, 8), [12, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(hdr_bytes(&slot, HDR_ENT_IN_OUT + 16, 4), 8u32.to_ne_bytes());
    }

    /// A reply given after its request ended (the entry holds another one now) is
    /// refused and leaves the entry alone.
    #[test]
    fn a_late_reply_is_refused() {
        let slot = Arc::new(Slot::new(64));
        put_request(&slot, 3, &[0; 16], &[], 1);
        let stale = RingReply {
            slot: slot.clone(),
            generation: begin(&slot),
        };
        slot.set_status(1, 0);
        finish(&slot, 1);
        put_request(&slot, 3, &[0; 16], &[], 2);
        begin(&slot);
        let header = out_header(OUT_HEADER, -libc::ENOENT, 1);
        assert!(stale.send(&[IoSlice::new(&header)]).is_err());
        assert!(!slot.state.lock().replied);
    }

    /// A reply too large for the entry fails its request with EIO; a reply shorter than
    /// a header is refused.
    #[test]
    fn oversized_and_short_replies() {
        let slot = Arc::new(Slot::new(64));
        put_request(&slot, 15, &[0; 24], &[], 3);
        let reply = RingReply {
            slot: slot.clone(),
            generation: begin(&slot),
        };
        assert_eq!(
            reply.send(&[IoSlice::new(&[0; 8])]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let header = out_header(OUT_HEADER + 100, 0, 0x77);
        assert!(
            reply
                .send(&[IoSlice::new(&header), IoSlice::new(&[1; 100])])
                .is_err()
        );
        assert_eq!(
            hdr_bytes(&slot, 0, OUT_HEADER),
            out_header(OUT_HEADER, -libc::EIO, 0x77)
        );
        assert_eq!(finish(&slot, 3), 3);
        assert_eq!(hdr_bytes(&slot, HDR_ENT_IN_OUT + 16, 4), 0u32.to_ne_bytes());
    }

    #[test]
    fn copy_out_spans_slices() {
        let a = [1u8, 2, 3];
        let b = [4u8, 5];
        let c = [6u8, 7, 8, 9];
        let data = [IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&c)];
        let mut out = [0u8; 5];
        assert_eq!(copy_out(&data, 2, &mut out), 5);
        assert_eq!(out, [3, 4, 5, 6, 7]);
        let mut rest = [0u8; 8];
        assert_eq!(copy_out(&data, 7, &mut rest), 2);
        assert_eq!(rest[..2], [8, 9]);
    }

    #[test]
    fn starvation_by_run_delay() {
        let ms = Duration::from_millis;
        // Not over the total, however few requests.
        assert!(!starved_by_delay(STARVED_TOTAL, 1));
        // Over it: starved when more than 200 us per request.
        assert!(starved_by_delay(ms(25), 0));
        assert!(starved_by_delay(ms(25), 100));
        assert!(!starved_by_delay(ms(25), 125));
        assert!(!starved_by_delay(ms(40), 10_000));
    }

    /// Each sample counts what happened since the thread's previous one; threads
    /// without a readable run delay do not count, and with none the sample says so;
    /// sleeps count for the requests of the threads whose sleeps were read twice.
    #[test]
    fn samples_are_differences() {
        let ms = Duration::from_millis;
        let mut s = Sampler::default();
        assert_eq!(
            s.sample([(1, 10, Some(ms(5)), Some(7)), (2, 3, Some(ms(1)), None)].into_iter()),
            Some(Sample::default()),
            "first samples count nothing"
        );
        let at = |requests, waited, sleeps, sleeps_of| Sample {
            requests,
            waited,
            sleeps,
            sleeps_of,
        };
        assert_eq!(
            s.sample(
                [
                    (1, 15, Some(ms(35)), Some(9)),
                    (2, 6, Some(ms(2)), Some(4)),
                    (3, 9, None, Some(1))
                ]
                .into_iter()
            ),
            Some(at(8, ms(31), 2, 5))
        );
        assert_eq!(
            s.sample(
                [
                    (1, 25, Some(ms(35)), Some(10)),
                    (2, 16, Some(ms(2)), Some(4))
                ]
                .into_iter()
            ),
            Some(at(20, Duration::ZERO, 1, 20))
        );
        assert_eq!(s.sample([(3, 20, None, None)].into_iter()), None);
    }

    /// Idle CPUs from two readings of the machine's CPU times, and /proc/stat read.
    #[test]
    fn spare_cpus_from_cpu_times() {
        assert_eq!(spare_cpus((100, 1000), (150, 1100), 2), 1.0);
        assert_eq!(spare_cpus((100, 1000), (100, 1100), 2), 0.0);
        assert_eq!(
            spare_cpus((100, 1000), (100, 1000), 2),
            0.0,
            "no time passed"
        );
        let (idle, total) = cpu_times().expect("/proc/stat");
        assert!(idle <= total && total > 0);
    }

    /// A backlog is many requests answered with few sleeps; requests answered one at a
    /// time (a sleep each), few requests, or sleeps that could not be read are none.
    #[test]
    fn backlog_is_many_requests_per_sleep() {
        let of = |sleeps, sleeps_of| Sample {
            requests: sleeps_of,
            sleeps,
            sleeps_of,
            ..Sample::default()
        };
        assert!(backlogged(of(25, BACKLOG_MIN)));
        assert!(backlogged(of(0, 5000)));
        assert!(!backlogged(of(26, BACKLOG_MIN)), "fewer than 4 per sleep");
        assert!(!backlogged(of(5000, 5000)), "one sleep per request");
        assert!(!backlogged(of(0, BACKLOG_MIN - 1)), "too few requests");
        let unread = Sample {
            requests: 5000,
            ..Sample::default()
        };
        assert!(!backlogged(unread), "no sleeps read");
        // This thread's count is readable and grows when it sleeps.
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let before = sleeps(me).expect("voluntary_ctxt_switches in /proc status");
        std::thread::sleep(Duration::from_millis(2));
        assert!(sleeps(me).unwrap() > before);
    }

    #[test]
    fn starvation_by_load_needs_two_busy_samples() {
        let mut p = Policy::new(Instant::now());
        assert!(!p.starved_by_load(3, 2));
        assert!(p.starved_by_load(3, 2));
        assert!(p.starved_by_load(5, 2));
        assert!(!p.starved_by_load(2, 2));
        assert!(!p.starved_by_load(3, 2));
    }

    /// Relaxed at the first starved sample; back to SCHED_IDLE after `hold` without
    /// starvation; a quick return of starvation doubles `hold` (up to `HOLD_MAX`), and
    /// `HOLD_MAX` at SCHED_IDLE resets it.
    #[test]
    fn relaxed_while_starved_then_held() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let at = |m: u64| t0 + ms(m);
        let mut p = Policy::new(t0);
        let mut normal = false;
        let mut step = |p: &mut Policy, starved: bool, t: Instant| {
            normal = p.step(normal, starved, false, t);
            normal
        };
        assert!(!step(&mut p, false, at(50)), "calm: stays SCHED_IDLE");
        // Starved soon after the start: relaxed, and the start is not a return.
        assert!(step(&mut p, true, at(100)), "starved: relaxed");
        assert_eq!(p.hold, HOLD_MIN);
        assert!(step(&mut p, true, at(150)));
        // 200 ms (HOLD_MIN) after the last starved sample it goes back.
        assert!(step(&mut p, false, at(300)));
        assert!(!step(&mut p, false, at(350)));
        assert_eq!(p.hold, HOLD_MIN);
        // Starved again within a second of going back: relaxed, hold doubled.
        assert!(step(&mut p, true, at(400)));
        assert_eq!(p.hold, HOLD_MIN * 2);
        assert!(step(&mut p, false, at(700)), "held 400 ms now");
        assert!(!step(&mut p, false, at(800)));
        // Flapping keeps doubling, up to HOLD_MAX.
        let mut t = 800;
        for _ in 0..10 {
            t += 100;
            assert!(step(&mut p, true, at(t)));
            t += p.hold.as_millis() as u64;
            assert!(!step(&mut p, false, at(t)));
        }
        assert_eq!(p.hold, HOLD_MAX);
        // HOLD_MAX calm at SCHED_IDLE resets it; starvation then is not a quick return.
        t += HOLD_MAX.as_millis() as u64;
        assert!(!step(&mut p, false, at(t)));
        assert_eq!(p.hold, HOLD_MIN);
        assert!(step(&mut p, true, at(t + 50)));
        assert_eq!(p.hold, HOLD_MIN);
    }

    /// A backlog relaxes at once and is held `HOLD_MIN` after its last sample, however
    /// often it comes back, and never lengthens `hold`; starvation during a backlog's
    /// spell holds as starvation does.
    #[test]
    fn relaxed_while_backlogged_held_briefly() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let at = |m: u64| t0 + ms(m);
        let mut p = Policy::new(t0);
        p.hold = HOLD_MIN * 8;
        let mut normal = false;
        let mut step = |p: &mut Policy, starved: bool, backlog: bool, t: Instant| {
            normal = p.step(normal, starved, backlog, t);
            normal
        };
        let mut t = 0;
        for _ in 0..5 {
            t += 50;
            assert!(step(&mut p, false, true, at(t)), "backlog: relaxed");
            t += 50;
            assert!(step(&mut p, false, true, at(t)));
            t += HOLD_MIN.as_millis() as u64 - 50;
            assert!(step(&mut p, false, false, at(t)), "within HOLD_MIN");
            t += 50;
            assert!(!step(&mut p, false, false, at(t)), "back after HOLD_MIN");
            assert_eq!(
                p.hold,
                HOLD_MIN * 8,
                "a backlog's return does not double it"
            );
        }
        // Starved within a backlog's spell: held `hold`.
        t += 50;
        assert!(step(&mut p, false, true, at(t)));
        t += 50;
        assert!(step(&mut p, true, true, at(t)));
        let starved_at = t;
        t += HOLD_MIN.as_millis() as u64 * 4;
        assert!(step(&mut p, false, false, at(t)), "held as starvation");
        t = starved_at + p.hold.as_millis() as u64;
        assert!(!step(&mut p, false, false, at(t)));
    }
}
