//! [`NbdDevice`]: the disk an NBD server exports (`nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH`), through libnbd.
//!
//! libnbd is the NBD client library of the NBD project's own people (the one nbdcopy,
//! nbdinfo and qemu's tools use). It is loaded at run time (`dlopen("libnbd.so.0")`,
//! [`Lib`]) over the handful of calls used here: a rext4 built with NBD support still
//! runs, and opens files, where libnbd is not installed (an NBD spec then says so), and
//! the crate has no build-time dependency on libnbd's headers or version (Debian 12
//! ships 1.14; the Rust binding upstream keeps in its tree is not on crates.io). Every
//! call is in libnbd's stable ABI since 1.0.
//!
//! Many requests in flight: the device keeps a pool of connections ([`Conn`]), up to
//! `connections` (default [`DEFAULT_CONNECTIONS`]) when the server says its connections
//! see each other's writes (NBD's multi-conn), one otherwise. A request takes a free
//! connection, so concurrent callers (read-ahead, writeback, direct I/O) reach the
//! server concurrently; a batch ([`BlockDevice::read_many`], `write_many`) goes out on
//! one connection as asynchronous commands all in flight at once (up to
//! [`MAX_BATCH_IN_FLIGHT`]). Requests are split at the server's maximum request size
//! (at most 32 MiB, what the NBD protocol lets a client send unasked).
//!
//! Durability: `flush` is NBD FLUSH on every connection (each covers the writes its
//! connection completed; one suffices under multi-conn), `write_through` a write with
//! FUA when the server offers it (else a write and a flush); `discard` is NBD TRIM
//! when the export allows it; a read-only export opens read-only only.
//!
//! Faults, handled as a failing disk: an error the server returns for a read, write or
//! trim is retried [`RETRIES`] times (a transient EIO); a failed flush is never retried
//! and fails the device for good (the writes it covered may be lost, so no later flush
//! may claim them durable); a lost connection fails the device for good too (writes
//! the server acknowledged but had not flushed may have gone with it): every later
//! request is an I/O error naming the first failure, until the image is opened again.
//! Every command waits at most `timeout` (default [`DEFAULT_TIMEOUT`]): a server
//! that does not answer fails the device, so a hung server cannot hang an unmount.
//!
//! Lock order: `flush_lock`, then the pool's mutex, which is held only to take a
//! connection out or put it back (a connection is used without any lock of this
//! module); `failed` is an `OnceLock`.
//! Callers: `crate::image::open_device` (image specs), tests.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{check_range, refuse_if_read_only, BlockDevice};

/// Connections opened when the server allows several (multi-conn).
pub const DEFAULT_CONNECTIONS: usize = 4;
/// The most connections a spec may ask for.
pub const MAX_CONNECTIONS: usize = 16;
/// How long one command (or the connection) may take before the device fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Asynchronous commands of one batch in flight at once on its connection.
pub const MAX_BATCH_IN_FLIGHT: usize = 64;
/// Further tries of a read, write or trim the server answered with a transient error.
pub const RETRIES: u32 = 3;
/// The largest request sent: NBD servers accept 32 MiB without saying so.
const MAX_REQUEST: u64 = 32 << 20;
/// Reads and writes larger than this go as pieces of this size, all in flight at
/// once on their connection, which the server works on in parallel (nbdkit's
/// threads): one 8 MiB write at a time from the writeback made `rext4 cp` into an
/// export 0.4x as fast as nbdcopy.
const PIECE: u64 = 1 << 20;
/// NBD TRIM carries a 32-bit length: trims go in pieces of at most this.
const MAX_TRIM: u64 = 1 << 30;

const LIBNBD_CMD_FLAG_FUA: u32 = 0x01;
const LIBNBD_SIZE_MAXIMUM: c_int = 2;

/// libnbd's `nbd_completion_callback` (passed by value; all null: no callback).
#[repr(C)]
#[derive(Clone, Copy)]
struct Completion {
    callback: *const c_void,
    user_data: *mut c_void,
    free: *const c_void,
}

const NO_COMPLETION: Completion = Completion {
    callback: std::ptr::null(),
    user_data: std::ptr::null_mut(),
    free: std::ptr::null(),
};

#[repr(C)]
struct Handle {
    _opaque: [u8; 0],
}

type HandleFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type SizeFn = unsafe extern "C" fn(*mut Handle) -> i64;

/// The libnbd calls used, found in `libnbd.so.0` at run time.
struct Lib {
    create: unsafe extern "C" fn() -> *mut Handle,
    close: unsafe extern "C" fn(*mut Handle),
    get_error: unsafe extern "C" fn() -> *const c_char,
    get_errno: unsafe extern "C" fn() -> c_int,
    set_handle_name: unsafe extern "C" fn(*mut Handle, *const c_char) -> c_int,
    aio_connect_uri: unsafe extern "C" fn(*mut Handle, *const c_char) -> c_int,
    aio_is_ready: HandleFn,
    aio_is_dead: HandleFn,
    aio_is_closed: HandleFn,
    poll: unsafe extern "C" fn(*mut Handle, c_int) -> c_int,
    get_size: SizeFn,
    get_block_size: unsafe extern "C" fn(*mut Handle, c_int) -> i64,
    is_read_only: HandleFn,
    can_flush: HandleFn,
    can_fua: HandleFn,
    can_trim: HandleFn,
    can_multi_conn: HandleFn,
    aio_pread: unsafe extern "C" fn(*mut Handle, *mut c_void, usize, u64, Completion, u32) -> i64,
    aio_pwrite:
        unsafe extern "C" fn(*mut Handle, *const c_void, usize, u64, Completion, u32) -> i64,
    aio_flush: unsafe extern "C" fn(*mut Handle, Completion, u32) -> i64,
    aio_trim: unsafe extern "C" fn(*mut Handle, u64, u64, Completion, u32) -> i64,
    aio_command_completed: unsafe extern "C" fn(*mut Handle, u64) -> c_int,
    aio_disconnect: unsafe extern "C" fn(*mut Handle, u32) -> c_int,
    aio_in_flight: HandleFn,
}

/// The library, loaded once per process (`Err`: why it could not be).
fn lib() -> io::Result<&'static Lib> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(load)
        .as_ref()
        .map_err(|m| io::Error::new(io::ErrorKind::Unsupported, m.clone()))
}

fn load() -> Result<Lib, String> {
    let name = c"libnbd.so.0";
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's
    // life (never dlclosed), so the symbols below stay valid.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(
            "NBD images need libnbd (libnbd.so.0, Debian package libnbd0), \
                    which is not installed"
                .into(),
        );
    }
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            let p = unsafe { libc::dlsym(h, concat!($name, "\0").as_ptr().cast()) };
            if p.is_null() {
                return Err(format!("libnbd.so.0 has no {} (too old a libnbd)", $name));
            }
            // SAFETY: the symbol is libnbd's function of that name, whose C signature
            // (libnbd.h, stable since libnbd 1.0) the field's type spells out.
            unsafe { fn_ptr(p) }
        }};
    }
    Ok(Lib {
        create: sym!("nbd_create"),
        close: sym!("nbd_close"),
        get_error: sym!("nbd_get_error"),
        get_errno: sym!("nbd_get_errno"),
        set_handle_name: sym!("nbd_set_handle_name"),
        aio_connect_uri: sym!("nbd_aio_connect_uri"),
        aio_is_ready: sym!("nbd_aio_is_ready"),
        aio_is_dead: sym!("nbd_aio_is_dead"),
        aio_is_closed: sym!("nbd_aio_is_closed"),
        poll: sym!("nbd_poll"),
        get_size: sym!("nbd_get_size"),
        get_block_size: sym!("nbd_get_block_size"),
        is_read_only: sym!("nbd_is_read_only"),
        can_flush: sym!("nbd_can_flush"),
        can_fua: sym!("nbd_can_fua"),
        can_trim: sym!("nbd_can_trim"),
        can_multi_conn: sym!("nbd_can_multi_conn"),
        aio_pread: sym!("nbd_aio_pread"),
        aio_pwrite: sym!("nbd_aio_pwrite"),
        aio_flush: sym!("nbd_aio_flush"),
        aio_trim: sym!("nbd_aio_trim"),
        aio_command_completed: sym!("nbd_aio_command_completed"),
        aio_disconnect: sym!("nbd_aio_disconnect"),
        aio_in_flight: sym!("nbd_aio_in_flight"),
    })
}

/// A function pointer of type `F` at `p`.
///
/// # Safety
/// `p` must be a function whose C signature `F` spells out.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

/// libnbd's last error on this thread, as an `io::Error` (`what` says which call).
fn last_error(lib: &Lib, what: &str) -> io::Error {
    // SAFETY: both read libnbd's thread-local error; the string is valid until the
    // next libnbd call on this thread, and is copied at once.
    let (msg, errno) = unsafe {
        let p = (lib.get_error)();
        let msg = if p.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        };
        (msg, (lib.get_errno)())
    };
    let kind = if errno != 0 {
        io::Error::from_raw_os_error(errno).kind()
    } else {
        io::ErrorKind::Other
    };
    let e = io::Error::new(kind, format!("NBD {what}: {msg}"));
    if errno != 0 {
        // Keep the errno for the FUSE edge: the message alone would lose it.
        return io::Error::from_raw_os_error(errno).with_context(e.to_string());
    }
    e
}

trait Context {
    fn with_context(self, msg: String) -> io::Error;
}
impl Context for io::Error {
    fn with_context(self, msg: String) -> io::Error {
        io::Error::new(
            self.kind(),
            WithErrno {
                errno: errno_of(&self),
                msg,
            },
        )
    }
}

/// An error message that remembers the errno it came from ([`errno_of`]).
#[derive(Debug)]
struct WithErrno {
    errno: Option<i32>,
    msg: String,
}
impl std::fmt::Display for WithErrno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}
impl std::error::Error for WithErrno {}

/// The errno an error of this module carries, if any.
fn errno_of(e: &io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| {
        e.get_ref()
            .and_then(|i| i.downcast_ref::<WithErrno>())
            .and_then(|w| w.errno)
    })
}

/// One connection to the server (a libnbd handle), used by one thread at a time.
struct Conn {
    h: *mut Handle,
    /// The server answered everything asked: a drop says goodbye (NBD_CMD_DISC)
    /// before closing. A connection that timed out or failed is closed outright
    /// (a goodbye would wait for a server that may never answer).
    clean: bool,
}

// SAFETY: a libnbd handle may be used from any thread (libnbd locks it inside);
// the pool hands each `Conn` to one thread at a time.
unsafe impl Send for Conn {}

impl Conn {
    /// Connect to `uri`, waiting at most `timeout`.
    fn connect(lib: &Lib, uri: &CStr, timeout: Duration) -> io::Result<Conn> {
        // SAFETY: nbd_create has no preconditions; null is its error.
        let h = unsafe { (lib.create)() };
        if h.is_null() {
            return Err(last_error(lib, "create"));
        }
        let mut c = Conn { h, clean: false };
        // SAFETY: a live handle and NUL-terminated strings.
        unsafe {
            (lib.set_handle_name)(h, c"rext4".as_ptr());
            if (lib.aio_connect_uri)(h, uri.as_ptr()) == -1 {
                return Err(last_error(lib, "connect"));
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            // SAFETY: a live handle.
            unsafe {
                if (lib.aio_is_ready)(h) == 1 {
                    c.clean = true;
                    return Ok(c);
                }
                if (lib.aio_is_dead)(h) == 1 || (lib.aio_is_closed)(h) == 1 {
                    return Err(last_error(lib, "connect"));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("NBD connect: no answer within {} s", timeout.as_secs_f32()),
                ));
            }
            // SAFETY: a live handle; the poll moves the handshake on.
            if unsafe { (lib.poll)(h, poll_ms(left)) } == -1 {
                return Err(last_error(lib, "connect"));
            }
        }
    }

    fn flag(&self, f: HandleFn) -> bool {
        // SAFETY: a live, connected handle.
        unsafe { f(self.h) == 1 }
    }

    /// Wait for the commands `cookies` (all issued on this connection), at most until
    /// `deadline`. The first error is returned once every command has ended (their
    /// buffers are then no longer used). On a timeout or a dead connection the
    /// connection is unusable: the caller drops it (which closes it, ending the
    /// commands still in flight before their buffers go).
    fn wait(&self, lib: &Lib, cookies: &[i64], deadline: Instant, what: &str) -> Wait {
        let mut done = vec![false; cookies.len()];
        let mut left_n = cookies.len();
        let mut first_err: Option<io::Error> = None;
        while left_n > 0 {
            for (i, &c) in cookies.iter().enumerate() {
                if done[i] {
                    continue;
                }
                // SAFETY: a live handle and a cookie it issued.
                match unsafe { (lib.aio_command_completed)(self.h, c as u64) } {
                    0 => {}
                    1 => {
                        done[i] = true;
                        left_n -= 1;
                    }
                    _ => {
                        done[i] = true;
                        left_n -= 1;
                        let e = last_error(lib, what);
                        first_err.get_or_insert(e);
                    }
                }
            }
            if left_n == 0 {
                break;
            }
            // SAFETY: a live handle.
            if unsafe { (lib.aio_is_dead)(self.h) == 1 || (lib.aio_is_closed)(self.h) == 1 } {
                return Wait::Dead(last_error(lib, what));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Wait::Dead(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("NBD {what}: the server did not answer in time"),
                ));
            }
            // SAFETY: a live handle, used by this thread alone.
            if unsafe { (lib.poll)(self.h, poll_ms(left)) } == -1 {
                return Wait::Dead(last_error(lib, what));
            }
        }
        match first_err {
            None => Wait::Done,
            // SAFETY: a live handle.
            Some(e) if unsafe { (lib.aio_is_dead)(self.h) == 1 } => Wait::Dead(e),
            Some(e) => Wait::Failed(e),
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Ok(lib) = lib() {
            // SAFETY: the handle is live and used by nobody else; after nbd_close no
            // command of it touches a buffer.
            unsafe {
                if self.clean
                    && (lib.aio_is_ready)(self.h) == 1
                    && (lib.aio_in_flight)(self.h) == 0
                    && (lib.aio_disconnect)(self.h, 0) == 0
                {
                    // Let the goodbye go out, for a second at most.
                    let t0 = Instant::now();
                    while (lib.aio_is_closed)(self.h) == 0
                        && (lib.aio_is_dead)(self.h) == 0
                        && t0.elapsed() < Duration::from_secs(1)
                    {
                        if (lib.poll)(self.h, 100) == -1 {
                            break;
                        }
                    }
                }
                (lib.close)(self.h);
            }
        }
    }
}

enum Wait {
    Done,
    /// The server answered with an error; the connection is fine.
    Failed(io::Error),
    /// The connection is gone (or timed out): the device fails.
    Dead(io::Error),
}

fn poll_ms(d: Duration) -> c_int {
    d.as_millis().clamp(1, 1000) as c_int
}

/// How an NBD device is opened.
#[derive(Debug, Clone)]
pub struct NbdOptions {
    /// The URI libnbd connects to (the NBD URI standard's forms).
    pub uri: String,
    /// Connections at most (used only when the server allows multi-conn).
    pub connections: usize,
    /// How long a command may take.
    pub timeout: Duration,
}

impl NbdOptions {
    pub fn new(uri: impl Into<String>) -> NbdOptions {
        NbdOptions {
            uri: uri.into(),
            connections: DEFAULT_CONNECTIONS,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// The export of an NBD server as a block device.
pub struct NbdDevice {
    lib: &'static Lib,
    pool: Mutex<Vec<Conn>>,
    freed: Condvar,
    /// Connections that exist (in the pool or in use).
    alive: AtomicUsize,
    size: u64,
    read_only: bool,
    can_flush: bool,
    can_fua: bool,
    can_trim: bool,
    /// The server's connections see each other's writes and flushes.
    multi_conn: bool,
    max_request: u64,
    timeout: Duration,
    /// The failure that ended the device (a lost connection, a failed flush).
    failed: OnceLock<String>,
    /// The URI, for messages.
    uri: String,
    /// Flushes go one at a time (each takes every connection out of the pool).
    flush_lock: Mutex<()>,
}

impl NbdDevice {
    /// Connect to the export; `read_only` also when the caller wants writes.
    pub fn open(opts: &NbdOptions, read_only: bool) -> io::Result<NbdDevice> {
        let lib = lib()?;
        let uri = CString::new(opts.uri.as_str())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in the NBD URI"))?;
        // The caller names the image: errors say what failed only.
        let ctx = |e: io::Error| e;
        let first = Conn::connect(lib, &uri, opts.timeout).map_err(ctx)?;
        // SAFETY: a live, connected handle.
        let (size, max) = unsafe {
            (
                (lib.get_size)(first.h),
                (lib.get_block_size)(first.h, LIBNBD_SIZE_MAXIMUM),
            )
        };
        if size < 0 {
            return Err(ctx(last_error(lib, "size")));
        }
        let server_ro = first.flag(lib.is_read_only);
        if server_ro && !read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the NBD export is read-only (open it read-only)",
            ));
        }
        let can_flush = first.flag(lib.can_flush);
        let can_fua = first.flag(lib.can_fua);
        let can_trim = first.flag(lib.can_trim);
        let multi = first.flag(lib.can_multi_conn);
        let want = if multi {
            opts.connections.clamp(1, MAX_CONNECTIONS)
        } else {
            1
        };
        let mut conns = vec![first];
        for _ in 1..want {
            conns.push(Conn::connect(lib, &uri, opts.timeout).map_err(ctx)?);
        }
        let max_request = if max > 0 {
            (max as u64).min(MAX_REQUEST)
        } else {
            MAX_REQUEST
        }
        .min(PIECE);
        Ok(NbdDevice {
            lib,
            alive: AtomicUsize::new(conns.len()),
            pool: Mutex::new(conns),
            freed: Condvar::new(),
            size: size as u64,
            read_only,
            can_flush,
            can_fua,
            can_trim,
            multi_conn: multi,
            max_request,
            timeout: opts.timeout,
            failed: OnceLock::new(),
            uri: opts.uri.clone(),
            flush_lock: Mutex::new(()),
        })
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.alive.load(Ordering::Relaxed)
    }

    fn check_failed(&self) -> io::Result<()> {
        match self.failed.get() {
            Some(why) => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("{}: the NBD device failed earlier ({why})", self.uri),
            )),
            None => Ok(()),
        }
    }

    fn fail(&self, e: &io::Error) {
        let _ = self.failed.set(e.to_string());
        self.freed.notify_all();
    }

    /// A free connection (waits while all are in use).
    fn take(&self) -> io::Result<Conn> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            self.check_failed()?;
            if let Some(c) = pool.pop() {
                return Ok(c);
            }
            if self.alive.load(Ordering::Relaxed) == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    format!("{}: no NBD connection left", self.uri),
                ));
            }
            pool = self.freed.wait(pool).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn give_back(&self, c: Conn) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        self.freed.notify_one();
    }

    /// Issue the commands `issue` makes (one per item, at most
    /// [`MAX_BATCH_IN_FLIGHT`] in flight) on one connection and wait for them;
    /// a transient error is retried [`RETRIES`] times (the whole batch again: reads,
    /// writes and trims may be repeated).
    fn run<F>(&self, what: &str, n: usize, retry: bool, mut issue: F) -> io::Result<()>
    where
        F: FnMut(&Lib, *mut Handle, usize) -> i64,
    {
        let mut tries = 0;
        loop {
            self.check_failed()?;
            let conn = self.take()?;
            let mut outcome = Wait::Done;
            let mut i = 0;
            while i < n {
                let end = (i + MAX_BATCH_IN_FLIGHT).min(n);
                let deadline = Instant::now() + self.timeout;
                let mut cookies = Vec::with_capacity(end - i);
                let mut issue_err = None;
                for k in i..end {
                    let c = issue(self.lib, conn.h, k);
                    if c == -1 {
                        issue_err = Some(last_error(self.lib, what));
                        break;
                    }
                    cookies.push(c);
                }
                let w = conn.wait(self.lib, &cookies, deadline, what);
                outcome = match (w, issue_err) {
                    (Wait::Dead(e), _) => Wait::Dead(e),
                    (_, Some(e)) if conn.flag(self.lib.aio_is_dead) => Wait::Dead(e),
                    (_, Some(e)) => Wait::Failed(e),
                    (w, None) => w,
                };
                if !matches!(outcome, Wait::Done) {
                    break;
                }
                i = end;
            }
            match outcome {
                Wait::Done => {
                    self.give_back(conn);
                    return Ok(());
                }
                Wait::Dead(e) => {
                    let mut conn = conn;
                    conn.clean = false;
                    drop(conn);
                    self.alive.fetch_sub(1, Ordering::Relaxed);
                    let m = format!("{}: {e} (connection lost)", self.uri);
                    let e = e.with_context(m);
                    self.fail(&e);
                    return Err(e);
                }
                Wait::Failed(e) => {
                    self.give_back(conn);
                    let transient = matches!(
                        errno_of(&e),
                        Some(libc::EIO | libc::EAGAIN | libc::EINTR | libc::EBUSY)
                    );
                    if retry && transient && tries < RETRIES {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(10 << (2 * tries)));
                        continue;
                    }
                    let m = format!("{}: {e}", self.uri);
                    return Err(e.with_context(m));
                }
            }
        }
    }

    /// `(offset, len)` pieces of at most `max` bytes covering `[off, off + len)`.
    fn pieces(off: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
        let n = len.div_ceil(max.max(1));
        (0..n).map(move |i| {
            let o = i * max;
            (off + o, (len - o).min(max))
        })
    }

    fn write_flags(&self, buf: &[u8], offset: u64, flags: u32) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        check_range(offset, buf.len(), self.size)?;
        let max = self.max_request;
        let p: Vec<(u64, u64)> = Self::pieces(offset, buf.len() as u64, max).collect();
        self.run("write", p.len(), true, |lib, h, k| {
            let (o, l) = p[k];
            let s = &buf[(o - offset) as usize..(o - offset + l) as usize];
            // SAFETY: `s` outlives the command (run waits for it or closes the
            // connection first).
            unsafe { (lib.aio_pwrite)(h, s.as_ptr().cast(), s.len(), o, NO_COMPLETION, flags) }
        })
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        // A failed device's connections may face a server that does not answer.
        if self.failed.get().is_some() {
            for c in self
                .pool
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .iter_mut()
            {
                c.clean = false;
            }
        }
    }
}

impl BlockDevice for NbdDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut reqs = [(offset, buf)];
        self.read_many(&mut reqs)
    }

    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let mut p: Vec<(*mut u8, u64, usize)> = Vec::with_capacity(reqs.len());
        for (off, b) in reqs.iter_mut() {
            check_range(*off, b.len(), self.size)?;
            let base = b.as_mut_ptr();
            for (o, l) in Self::pieces(*off, b.len() as u64, self.max_request) {
                // SAFETY: `o - off` is inside the buffer (pieces cover it).
                p.push((unsafe { base.add((o - *off) as usize) }, o, l as usize));
            }
        }
        self.run("read", p.len(), true, |lib, h, k| {
            let (ptr, o, l) = p[k];
            // SAFETY: each piece is a disjoint part of a caller's buffer that lives
            // until `run` returns (it waits for the command or closes the connection).
            unsafe { (lib.aio_pread)(h, ptr.cast(), l, o, NO_COMPLETION, 0) }
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_flags(buf, offset, 0)
    }

    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        let mut p: Vec<(*const u8, u64, usize)> = Vec::with_capacity(reqs.len());
        for (off, b) in reqs {
            check_range(*off, b.len(), self.size)?;
            for (o, l) in Self::pieces(*off, b.len() as u64, self.max_request) {
                // SAFETY: `o - off` is inside the buffer.
                p.push((
                    unsafe { b.as_ptr().add((o - *off) as usize) },
                    o,
                    l as usize,
                ));
            }
        }
        self.run("write", p.len(), true, |lib, h, k| {
            let (ptr, o, l) = p[k];
            // SAFETY: the caller's buffers live until `run` returns.
            unsafe { (lib.aio_pwrite)(h, ptr.cast(), l, o, NO_COMPLETION, 0) }
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.check_failed()?;
        if self.read_only || !self.can_flush {
            return Ok(());
        }
        // Without multi-conn each connection's FLUSH covers what that connection
        // completed: flush them all (they are few), taking each out of the pool in
        // turn (one flush at a time: two taking connections each could wait for each
        // other's for ever).
        let _one = self.flush_lock.lock().unwrap_or_else(|p| p.into_inner());
        // Under multi-conn one FLUSH covers what every connection completed (the NBD
        // protocol says so of NBD_FLAG_CAN_MULTI_CONN).
        let n = if self.multi_conn {
            1
        } else {
            self.alive.load(Ordering::Relaxed).max(1)
        };
        let mut held = Vec::with_capacity(n);
        let mut r = Ok(());
        for _ in 0..n {
            match self.take() {
                Ok(c) => held.push(c),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        for mut c in held {
            if r.is_ok() {
                let deadline = Instant::now() + self.timeout;
                // SAFETY: a live handle, held by this thread.
                let cookie = unsafe { (self.lib.aio_flush)(c.h, NO_COMPLETION, 0) };
                let w = if cookie == -1 {
                    Wait::Failed(last_error(self.lib, "flush"))
                } else {
                    c.wait(self.lib, &[cookie], deadline, "flush")
                };
                match w {
                    Wait::Done => {}
                    Wait::Failed(e) | Wait::Dead(e) => {
                        // Never retried: the writes it covered may be lost.
                        let m = format!("{}: {e}", self.uri);
                        let e = e.with_context(m);
                        self.fail(&e);
                        r = Err(e);
                    }
                }
            }
            if self.failed.get().is_some() {
                self.alive.fetch_sub(1, Ordering::Relaxed);
                c.clean = false;
                drop(c);
            } else {
                self.give_back(c);
            }
        }
        r
    }

    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.can_fua {
            self.write_flags(buf, offset, LIBNBD_CMD_FLAG_FUA)
        } else {
            self.write_at(buf, offset)?;
            self.flush()
        }
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        if !self.can_trim {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: the NBD export does not support trim", self.uri),
            ));
        }
        check_range(offset, 0, self.size)?;
        let len = len.min(self.size - offset);
        let p: Vec<(u64, u64)> = Self::pieces(offset, len, MAX_TRIM).collect();
        self.run("trim", p.len(), true, |lib, h, k| {
            let (o, l) = p[k];
            // SAFETY: a live handle; trim carries no buffer.
            unsafe { (lib.aio_trim)(h, l, o, NO_COMPLETION, 0) }
        })
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range() {
        let p: Vec<_> = NbdDevice::pieces(10, 100, 32).collect();
        assert_eq!(p, vec![(10, 32), (42, 32), (74, 32), (106, 4)]);
        assert_eq!(NbdDevice::pieces(0, 0, 32).count(), 0);
    }

    #[test]
    fn errno_survives_context() {
        let e = io::Error::from_raw_os_error(libc::EIO).with_context("x: y".into());
        assert_eq!(errno_of(&e), Some(libc::EIO));
        assert_eq!(e.to_string(), "x: y");
    }
}
