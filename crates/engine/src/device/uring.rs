//! Writes in flight together: a batch of positioned writes submitted at once on this
//! thread's io_uring, so one caller keeps a queue of requests at the image (as fio's
//! `--iodepth` or a loop device with `--direct-io=on` does) instead of one at a time.
//!
//! Owns: one ring per thread, made on first use and kept (dropped with the thread);
//! a thread whose ring cannot be made (no io_uring in this kernel, or it is disabled)
//! remembers that and its callers write one request at a time.
//!
//! Must hold: the kernel reads a request's buffer until its completion arrives, so every
//! buffer submitted stays alive and unmoved until then. Each request's bytes are copied
//! into a buffer this module owns (aligned for O_DIRECT); a batch returns only after
//! every submitted request has completed. If the ring fails while requests are still
//! in flight (never expected: the completion queue is twice the submission queue and a
//! batch never has more in flight than the submission queue holds), the ring and the
//! buffers are leaked rather than freed under the kernel, and the batch reports an
//! error.
//! Short writes and `EINTR`/`EAGAIN` completions are finished with plain `pwrite`.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

/// Requests one submission carries at most.
const RING_ENTRIES: u32 = 64;

thread_local! {
    /// `None`: not tried yet; `Some(None)`: unavailable on this thread.
    static RING: RefCell<Option<Option<IoUring>>> = const { RefCell::new(None) };
}

/// One write of a batch: the descriptor, where, and the bytes (copied by the caller
/// into `buf[skew..skew + len]`, aligned there when the descriptor is O_DIRECT).
pub(crate) struct Req {
    pub fd: RawFd,
    /// Where the rest of a short write goes (a buffered descriptor of the same file
    /// when `fd` is O_DIRECT: the rest need not be aligned).
    pub fd_rest: RawFd,
    pub offset: u64,
    pub buf: Vec<u8>,
    pub skew: usize,
    pub len: usize,
}

/// Whether this thread has a ring (made now if not tried yet).
#[cfg(test)]
pub(crate) fn available() -> bool {
    RING.with(|cell| cell.borrow_mut().get_or_insert_with(new_ring).is_some())
}

/// Write every request; `Ok(false)` when this thread has no ring (nothing was written:
/// the caller writes them one by one).
pub(crate) fn write_batch(reqs: Vec<Req>) -> io::Result<bool> {
    RING.with(|cell| {
        let mut cell = cell.borrow_mut();
        let slot = cell.get_or_insert_with(new_ring);
        let Some(ring) = slot.as_mut() else {
            return Ok(false);
        };
        let mut reqs = reqs;
        let mut first_err = None;
        while !reqs.is_empty() {
            let rest = reqs.split_off(reqs.len().min(RING_ENTRIES as usize));
            if let Err(e) = write_chunk(ring, &reqs) {
                match e {
                    Broken::InFlight(e) => {
                        // Requests may still be in flight: keep their buffers and the
                        // ring alive for good.
                        std::mem::forget(std::mem::take(&mut reqs));
                        std::mem::forget(rest);
                        if let Some(r) = slot.take() {
                            std::mem::forget(r);
                        }
                        return Err(e);
                    }
                    Broken::Request(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            reqs = rest;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(true),
        }
    })
}

fn new_ring() -> Option<IoUring> {
    IoUring::builder()
        .setup_cqsize(RING_ENTRIES * 2)
        .build(RING_ENTRIES)
        .ok()
}

enum Broken {
    /// The ring failed with requests submitted and not completed.
    InFlight(io::Error),
    /// A request failed (all completed).
    Request(io::Error),
}

fn write_chunk(ring: &mut IoUring, reqs: &[Req]) -> Result<(), Broken> {
    if reqs
        .iter()
        .any(|r| u32::try_from(r.len).is_err() || r.buf.len() < r.skew + r.len)
    {
        return Err(Broken::Request(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a batched write over 4 GiB, or past its buffer",
        )));
    }
    {
        let mut sq = ring.submission();
        for (i, r) in reqs.iter().enumerate() {
            let sqe = opcode::Write::new(types::Fd(r.fd), r.buf[r.skew..].as_ptr(), r.len as u32)
                .offset(r.offset)
                .build()
                .user_data(i as u64);
            // SAFETY: the buffer lives in `reqs`, which outlives every completion (this
            // function waits for all of them, and the caller leaks `reqs` when it
            // cannot); the queue has room (at most RING_ENTRIES per chunk, the queue
            // empty between chunks).
            if unsafe { sq.push(&sqe) }.is_err() {
                // Cannot happen (see above). Entries pushed before it would go with the
                // next submission: treated as in flight.
                return Err(Broken::InFlight(io::Error::other("io_uring queue full")));
            }
        }
    }
    let mut done = vec![false; reqs.len()];
    let mut left = reqs.len();
    let mut first_err = None;
    while left > 0 {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) => {}
            Err(e) => return Err(Broken::InFlight(e)),
        }
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            let Some(d) = done.get_mut(i) else { continue };
            if *d {
                continue;
            }
            *d = true;
            left -= 1;
            if let Err(e) = finish(&reqs[i], cqe.result()) {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(Broken::Request(e)),
        None => Ok(()),
    }
}

/// A completion's result: done, or the rest written with `pwrite`.
fn finish(r: &Req, res: i32) -> io::Result<()> {
    let mut written = match res {
        n if n >= 0 => n as usize,
        n if n == -libc::EINTR || n == -libc::EAGAIN => 0,
        n => return Err(io::Error::from_raw_os_error(-n)),
    };
    while written < r.len {
        let rest = &r.buf[r.skew + written..r.skew + r.len];
        // SAFETY: pwrite(2) reads `rest.len()` bytes of `rest`, which we own.
        let n = unsafe {
            libc::pwrite(
                r.fd_rest,
                rest.as_ptr().cast(),
                rest.len(),
                (r.offset + written as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the image took no more bytes",
            ));
        }
        written += n as usize;
    }
    Ok(())
}
