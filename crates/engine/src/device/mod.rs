//! The device seam: every byte rext4 reads or writes goes through [`BlockDevice`], so
//! tests can wrap it (latency, faults, crash recording).
//!
//! Backends: [`FileDevice`] (pread/pwrite on an image file or block device, optionally
//! O_DIRECT through an aligned bounce buffer), [`MemDevice`] (a byte vector) and
//! [`crate::device::dax::DaxDevice`] (a memory-mapped backing store, copies with persistent
//! stores; `BlockDevice::dax` tells the file data path to bypass the page cache).
//! A file writes batches ([`BlockDevice::write_many`]) on its thread's io_uring
//! (`uring`), all in flight together.
//! [`latency`] wraps any of them to count requests ([`latency::Counted`], under every open
//! filesystem) or to make them slow ([`latency::LatencyDevice`]).
//! [`window::Window`] is a byte range of another device (a partition, an offset);
//! [`qcow2::Qcow2`] the guest disk of a qcow2 image file; [`parttable`] reads MBR and
//! GPT partition tables. `crate::image` builds these from an image spec.
//! Offsets and lengths are bytes; callers stay inside [`BlockDevice::size_bytes`], and
//! backends refuse anything outside it so no request can write past the image.
//! [`BlockDevice::discard`] gives a range back to whatever holds the image (a hole in
//! an image file, BLKDISCARD on a block device, freed qcow2 clusters).

pub mod dax;
pub mod latency;
pub mod nbd;
pub mod parttable;
pub mod qcow2;

mod uring;
pub mod window;

use std::fs::{File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::RwLock;

pub trait BlockDevice: Send + Sync {
    /// Fill `buf` from byte offset `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Fill `buf`, which need not be initialized, from byte offset `offset`; on
    /// success every byte of it is. The default zeroes it and reads; a backend that
    /// can read straight into it saves that pass (a large read into a fresh buffer
    /// then costs one copy, as a read(2) does).
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        self.read_at(zeroed(buf), offset)
    }
    /// Read a batch: each `(offset, buffer)` filled as [`Self::read_at`] fills it,
    /// several in flight at once (the default: up to [`latency::MAX_IN_FLIGHT`]
    /// threads, see [`latency`]); on an error some buffers may be unfilled.
    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        latency::read_parallel(self, reqs)
    }
    /// Write `buf` at byte offset `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Write a batch: each `(offset, bytes)` as [`Self::write_at`] writes it, several
    /// in flight at once where the backend can (a file: its thread's io_uring, see
    /// [`uring`]); in no defined order, so no two may overlap. On an error some may be
    /// unwritten. The default writes them one after the other.
    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        for (off, b) in reqs {
            self.write_at(b, *off)?;
        }
        Ok(())
    }
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Give `[offset, offset + len)` back to whatever holds the image (a hole punched
    /// in an image file, BLKDISCARD on a block device, a qcow2 image's clusters freed).
    /// The range's contents are unspecified afterwards (zeros on most backends): only
    /// ranges nobody uses any more are discarded. Backends may round the range inward
    /// to what they can free. The default: `ErrorKind::Unsupported`.
    fn discard(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the device does not support discard",
        ))
    }
    fn size_bytes(&self) -> u64;
    fn is_read_only(&self) -> bool;
    /// The device as memory the process maps (`crate::device::dax`), when it is one: file data
    /// then bypasses the page cache.
    fn dax(&self) -> Option<&crate::device::dax::DaxDevice> {
        None
    }
    /// A hint that `[offset, offset + len)` will soon be read or partly overwritten
    /// (`fs::write_ahead`): a buffered image file has the host read it into its cache
    /// now. Changes nothing else; the default ignores it.
    fn will_need(&self, _offset: u64, _len: u64) {}
    /// Read what the medium holds now, past every cache on this host that could keep
    /// an older copy: another host sharing the medium may have written it. Multi-mount
    /// protection reads its block this way (`crate::mmp`). The default is
    /// [`Self::read_at`], right for a backend that keeps no copy on this host (memory;
    /// a network block device that asks its server each time). A backend with a cache
    /// of its own (a page cache, a client-side cache) bypasses it here, and a wrapper
    /// passes the call to what it wraps.
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_at(buf, offset)
    }
    /// Write so that the next [`Self::read_fresh`] of any host sharing the medium sees
    /// it (multi-mount protection's block). The default writes and flushes; a backend
    /// that can reach the medium without flushing everything else (O_DIRECT) does so.
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_at(buf, offset)?;
        self.flush()
    }
}

/// A write to a device opened read-only: refused, the same way by every backend.
pub(crate) fn refuse_if_read_only(read_only: bool) -> io::Result<()> {
    if read_only {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "device is read-only",
        ));
    }
    Ok(())
}

pub(crate) fn check_range(offset: u64, len: usize, size: u64) -> io::Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O of {len} bytes at {offset} is outside the {size}-byte device"),
        )),
    }
}

/// Zero `buf` and see it as initialized bytes.
pub fn zeroed(buf: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    buf.fill(MaybeUninit::new(0));
    // SAFETY: every byte was just written; `MaybeUninit<u8>` has the layout of `u8`.
    unsafe { &mut *(buf as *mut [MaybeUninit<u8>] as *mut [u8]) }
}

/// See initialized bytes as possibly uninitialized ones, for a path that fills either
/// (the other way from [`zeroed`]).
///
/// # Safety
/// Only initialized bytes may be written through the result (it aliases `buf`, whose
/// bytes must stay valid `u8`s).
pub(crate) unsafe fn as_uninit(buf: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: same layout; the caller writes only initialized bytes.
    unsafe { &mut *(buf as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

const O_DIRECT: i32 = 0o40000;
const DIRECT_ALIGN: usize = 4096;
/// Buffered writes at least this large start the host's writeback of their range at
/// once (`FileDevice::write_at`).
const START_WRITEBACK_BYTES: usize = 512 << 10;

/// An image file or block device.
pub struct FileDevice {
    file: File,
    /// With O_DIRECT: a second, buffered descriptor for accesses that are not
    /// 512-byte aligned (O_DIRECT refuses those; the kernel keeps the two coherent).
    /// Sub-block writes through it need no read-modify-write here, so concurrent
    /// unaligned writes into one block cannot undo each other.
    unaligned: Option<File>,
    size: u64,
    read_only: bool,
    direct: bool,
    /// A block device (discard is BLKDISCARD), not a regular file (a punched hole).
    block_device: bool,
    /// An O_DIRECT descriptor of the same file for [`BlockDevice::read_fresh`] and
    /// [`BlockDevice::write_through`], opened at their first use (`None` inside when
    /// the file cannot be opened so: those then go around the page cache otherwise).
    uncached: std::sync::OnceLock<Option<File>>,
}

/// BLKDISCARD, `_IO(0x12, 119)`: discard a byte range of a block device.
const BLKDISCARD: libc::c_ulong = 0x1277;

impl FileDevice {
    /// Open `path`; `direct` asks for O_DIRECT (falls back to an error if unsupported).
    pub fn open(path: &Path, read_only: bool, direct: bool) -> io::Result<Self> {
        let mut o = OpenOptions::new();
        o.read(true).write(!read_only);
        if direct {
            o.custom_flags(O_DIRECT);
        }
        let file = o.open(path)?;
        let unaligned = if direct {
            Some(OpenOptions::new().read(true).write(!read_only).open(path)?)
        } else {
            None
        };
        let meta = file.metadata()?;
        let block_device = std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type());
        let size = if meta.file_type().is_file() {
            meta.len()
        } else {
            use std::io::{Seek, SeekFrom};
            let mut f = &file;
            f.seek(SeekFrom::End(0))?
        };
        Ok(FileDevice {
            file,
            unaligned,
            size,
            read_only,
            direct,
            block_device,
            uncached: std::sync::OnceLock::new(),
        })
    }

    /// The O_DIRECT descriptor of [`FileDevice::uncached`]: the file reopened through
    /// /proc/self/fd (the same file, whatever happened to its path since).
    fn uncached(&self) -> Option<&File> {
        self.uncached
            .get_or_init(|| {
                if self.direct {
                    return None;
                }
                let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
                OpenOptions::new()
                    .read(true)
                    .write(!self.read_only)
                    .custom_flags(O_DIRECT)
                    .open(path)
                    .ok()
            })
            .as_ref()
    }

    /// `f` on an O_DIRECT descriptor with a sector-aligned copy of the request: `None`
    /// when there is none here or it refuses this size or alignment (EINVAL), so the
    /// caller goes another way.
    fn direct_io(
        &self,
        len: usize,
        offset: u64,
        f: impl FnOnce(&File, &mut [u8]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        if !Self::direct_ok(len, offset) {
            return None;
        }
        let file = if self.direct {
            &self.file
        } else {
            self.uncached()?
        };
        let (mut v, s) = Self::aligned_bounce(len);
        match f(file, &mut v[s..s + len]) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None,
            r => Some(r),
        }
    }

    fn aligned_bounce(len: usize) -> (Vec<u8>, usize) {
        let v = vec![0u8; len + DIRECT_ALIGN];
        let skew = v.as_ptr() as usize % DIRECT_ALIGN;
        let start = if skew == 0 { 0 } else { DIRECT_ALIGN - skew };
        (v, start)
    }

    fn direct_ok(buf_len: usize, offset: u64) -> bool {
        buf_len.is_multiple_of(512) && offset.is_multiple_of(512)
    }
}

impl BlockDevice for FileDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        if self.direct && Self::direct_ok(buf.len(), offset) {
            let (mut v, s) = Self::aligned_bounce(buf.len());
            let n = buf.len();
            self.file.read_exact_at(&mut v[s..s + n], offset)?;
            buf.copy_from_slice(&v[s..s + n]);
            return Ok(());
        }
        self.unaligned
            .as_ref()
            .unwrap_or(&self.file)
            .read_exact_at(buf, offset)
    }

    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        if self.direct {
            return self.read_at(zeroed(buf), offset);
        }
        check_range(offset, buf.len(), self.size)?;
        let fd = self.file.as_raw_fd();
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: pread writes at most `rest.len()` bytes into `rest`, which is
            // ours for the call; the kernel never reads the destination.
            let r = unsafe {
                libc::pread(
                    fd,
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                    (offset + done as u64) as libc::off_t,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "failed to fill whole buffer",
                ));
            }
            done += r as usize;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        check_range(offset, buf.len(), self.size)?;
        if self.direct && Self::direct_ok(buf.len(), offset) {
            let (mut v, s) = Self::aligned_bounce(buf.len());
            v[s..s + buf.len()].copy_from_slice(buf);
            return self.file.write_all_at(&v[s..s + buf.len()], offset);
        }
        self.unaligned
            .as_ref()
            .unwrap_or(&self.file)
            .write_all_at(buf, offset)?;
        if buf.len() >= START_WRITEBACK_BYTES {
            // Streaming data: have the host start writing it to its disk now, while
            // the next requests arrive, instead of all of it at the next flush (a
            // large fsync otherwise copies everything, then waits for everything).
            // Only a hint: durability is still the flush's.
            // SAFETY: sync_file_range(2) on our descriptor, plain integers.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    offset as libc::off64_t,
                    buf.len() as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
        }
        Ok(())
    }

    /// Only O_DIRECT requests go to the ring: a buffered write is a copy into the
    /// host's page cache, which a queue does not speed up (io_uring hands it to a
    /// worker thread: measured slower than writing it here), so those are written one
    /// by one first.
    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        for (off, b) in reqs {
            check_range(*off, b.len(), self.size)?;
        }
        let (direct, buffered): (Vec<_>, Vec<_>) = reqs
            .iter()
            .partition(|&&(off, b)| self.direct && Self::direct_ok(b.len(), off));
        for (off, b) in buffered {
            self.write_at(b, off)?;
        }
        if direct.len() <= 1 {
            for (off, b) in direct {
                self.write_at(b, off)?;
            }
            return Ok(());
        }
        let rest_fd = self.unaligned.as_ref().unwrap_or(&self.file).as_raw_fd();
        let batch = direct
            .iter()
            .map(|&(offset, b)| {
                let (mut buf, skew) = Self::aligned_bounce(b.len());
                buf[skew..skew + b.len()].copy_from_slice(b);
                uring::Req {
                    fd: self.file.as_raw_fd(),
                    fd_rest: rest_fd,
                    offset,
                    buf,
                    skew,
                    len: b.len(),
                }
            })
            .collect();
        if uring::write_batch(batch)? {
            return Ok(());
        }
        for (off, b) in direct {
            self.write_at(b, off)?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }
    /// A regular file: `fallocate(PUNCH_HOLE | KEEP_SIZE)` (the range reads zeros and
    /// the host frees its blocks); a block device: BLKDISCARD on the 512-byte-aligned
    /// part of the range (EOPNOTSUPP where the device cannot).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        check_range(
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            self.size,
        )?;
        if len == 0 {
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        if self.block_device {
            let start = offset.div_ceil(512) * 512;
            let end = (offset + len) / 512 * 512;
            if end <= start {
                return Ok(());
            }
            let range = [start, end - start];
            // SAFETY: BLKDISCARD reads two u64s from the pointer, which points at
            // `range`, alive for the call.
            let r = unsafe { libc::ioctl(fd, BLKDISCARD as _, range.as_ptr()) };
            return if r == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            };
        }
        // SAFETY: fallocate(2) on our descriptor with plain integers.
        let r = unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
    /// `posix_fadvise(WILLNEED)` on a buffered descriptor (the host reads the range
    /// ahead, asynchronously); nothing under O_DIRECT, which has no host cache to fill.
    fn will_need(&self, offset: u64, len: u64) {
        let len = len.min(self.size.saturating_sub(offset));
        if self.direct || len == 0 {
            return;
        }
        // SAFETY: posix_fadvise(2) on our descriptor, plain integers.
        unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            );
        }
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// O_DIRECT (as e2fsprogs reads the MMP block of a device): neither this host's
    /// page cache nor a network filesystem's client cache answers. Where O_DIRECT is
    /// refused, the range's cached pages are dropped first, so the read goes to the
    /// medium.
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        let n = buf.len();
        let direct = self.direct_io(n, offset, |f, b| {
            f.read_exact_at(b, offset)?;
            buf.copy_from_slice(b);
            Ok(())
        });
        if let Some(r) = direct {
            return r;
        }
        let f = self.unaligned.as_ref().unwrap_or(&self.file);
        // SAFETY: posix_fadvise(2) on our descriptor, plain integers.
        unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                offset as libc::off_t,
                n as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
        f.read_exact_at(buf, offset)
    }

    /// O_DIRECT, or a buffered write whose range (only) is written out and waited for
    /// (`sync_file_range`): the device holds it, without a flush of everything else
    /// the image has dirty.
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        check_range(offset, buf.len(), self.size)?;
        let direct = self.direct_io(buf.len(), offset, |f, b| {
            b.copy_from_slice(buf);
            f.write_all_at(b, offset)
        });
        if let Some(r) = direct {
            return r;
        }
        let f = self.unaligned.as_ref().unwrap_or(&self.file);
        f.write_all_at(buf, offset)?;
        // SAFETY: sync_file_range(2) on our descriptor, plain integers.
        let r = unsafe {
            libc::sync_file_range(
                f.as_raw_fd(),
                offset as libc::off64_t,
                buf.len() as libc::off64_t,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// An in-memory device (tests, and images built in memory).
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    read_only: bool,
}

impl MemDevice {
    pub fn new(data: Vec<u8>) -> Self {
        MemDevice {
            data: RwLock::new(data),
            read_only: false,
        }
    }
    pub fn read_only(data: Vec<u8>) -> Self {
        MemDevice {
            data: RwLock::new(data),
            read_only: true,
        }
    }
    /// A copy of the current contents.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl BlockDevice for MemDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let d = self.data.read().unwrap_or_else(|p| p.into_inner());
        check_range(offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        let mut d = self.data.write().unwrap_or_else(|p| p.into_inner());
        check_range(offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    /// Zeroes the range.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        refuse_if_read_only(self.read_only)?;
        let mut d = self.data.write().unwrap_or_else(|p| p.into_inner());
        check_range(
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            d.len() as u64,
        )?;
        let o = offset as usize;
        d[o..o + len as usize].fill(0);
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.data.read().unwrap_or_else(|p| p.into_inner()).len() as u64
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
}

/// The journal's log (`rext4-jbd2`) reads and writes through any block device.
impl<'a> rext4_jbd2::Device for dyn BlockDevice + 'a {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        BlockDevice::read_at(self, buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        BlockDevice::write_at(self, buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        BlockDevice::flush(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_device_refuses_out_of_range() {
        let d = MemDevice::new(vec![0; 4096]);
        let mut b = [0u8; 16];
        assert!(d.read_at(&mut b, 4090).is_err());
        assert!(d.write_at(&b, u64::MAX - 3).is_err());
        d.write_at(&[7; 16], 4080).expect("in range");
        d.read_at(&mut b, 4080).expect("in range");
        assert_eq!(b, [7; 16]);
    }

    /// Batches (`write_many`, io_uring): 150 writes (more than one ring's worth), of
    /// aligned and unaligned sizes and offsets, on a buffered and an O_DIRECT file,
    /// each read back; a batch with one request out of range writes nothing, and a
    /// read-only file refuses one.
    #[test]
    fn file_device_write_many_writes_every_request() {
        if !uring::available() {
            rext4_testkit::skip("no io_uring here: batches are written one by one");
        }
        for direct in [false, true] {
            let p = std::env::temp_dir()
                .join(format!("rext4-dev-many-{}-{direct}", std::process::id()));
            std::fs::write(&p, vec![0u8; 1 << 20]).expect("write");
            let d = match FileDevice::open(&p, false, direct) {
                Ok(d) => d,
                Err(e) => {
                    let _ = std::fs::remove_file(&p);
                    rext4_testkit::skip(&format!("O_DIRECT open in the temp directory: {e}"));
                    continue;
                }
            };
            // Request i: 2 KiB at 6 KiB * i (aligned) or 777 bytes at 6 KiB * i + 5.
            let bufs: Vec<(u64, Vec<u8>)> = (0..150u64)
                .map(|i| {
                    let (off, len) = if i % 3 == 0 {
                        (6144 * i + 5, 777)
                    } else {
                        (6144 * i, 2048)
                    };
                    (off, vec![(i as u8) | 1; len])
                })
                .collect();
            let reqs: Vec<(u64, &[u8])> = bufs.iter().map(|(o, b)| (*o, &b[..])).collect();
            d.write_many(&reqs).expect("write_many");
            for (off, b) in &bufs {
                let mut got = vec![0u8; b.len() + 2];
                d.read_at(&mut got, off - 1).expect("read back");
                assert_eq!(got[0], 0, "direct={direct}: byte before {off}");
                assert_eq!(&got[1..=b.len()], &b[..], "direct={direct}: at {off}");
                assert_eq!(got[b.len() + 1], 0, "direct={direct}: byte after {off}");
            }
            let free = (1u64 << 20) - 4096; // past every request above
            let bad = [(free, &[7u8; 512][..]), (1 << 20, &[7u8; 512][..])];
            assert!(d.write_many(&bad).is_err(), "a request past the end");
            let mut first = [0u8; 512];
            d.read_at(&mut first, free).expect("read");
            assert_eq!(first, [0u8; 512], "nothing of a refused batch is written");
            let ro = FileDevice::open(&p, true, direct).expect("open read-only");
            assert!(ro.write_many(&reqs).is_err(), "read-only");
            let _ = std::fs::remove_file(&p);
        }
    }

    /// `read_fresh` sees a write made behind the device's back (as another host's),
    /// `write_through` reaches a reader of the file; aligned requests go through
    /// O_DIRECT, unaligned ones the fallback, on buffered and O_DIRECT devices alike.
    #[test]
    fn file_device_fresh_reads_and_writes_through() {
        let p = std::env::temp_dir().join(format!("rext4-dev-f-{}", std::process::id()));
        std::fs::write(&p, vec![0u8; 16384]).expect("write");
        for direct in [false, true] {
            let d = match FileDevice::open(&p, false, direct) {
                Ok(d) => d,
                Err(e) => {
                    rext4_testkit::skip(&format!("O_DIRECT open in the temp directory: {e}"));
                    continue;
                }
            };
            let mut b = vec![0u8; 4096];
            d.read_at(&mut b, 4096).expect("read");
            let other = OpenOptions::new().write(true).open(&p).expect("open");
            for (off, len, fill) in [(4096u64, 4096usize, 0x5Au8), (5000, 100, 0x33)] {
                other
                    .write_all_at(&vec![fill; len], off)
                    .expect("write behind");
                let mut got = vec![0u8; len];
                d.read_fresh(&mut got, off).expect("read_fresh");
                assert!(got.iter().all(|&x| x == fill), "direct={direct} at {off}");
                d.write_through(&vec![fill ^ 0xFF; len], off)
                    .expect("write_through");
                let mut seen = vec![0u8; len];
                std::fs::File::open(&p)
                    .and_then(|f| f.read_exact_at(&mut seen, off))
                    .expect("read back");
                assert!(
                    seen.iter().all(|&x| x == fill ^ 0xFF),
                    "direct={direct} at {off}"
                );
            }
            assert!(d.read_fresh(&mut b, 16000).is_err(), "past the end");
            let ro = FileDevice::open(&p, true, direct).expect("read-only");
            assert!(ro.write_through(&b, 0).is_err(), "read-only");
        }
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn file_device_direct_and_buffered_agree() {
        let p = std::env::temp_dir().join(format!("rext4-dev-{}", std::process::id()));
        std::fs::write(&p, vec![3u8; 8192]).expect("write");
        let d = FileDevice::open(&p, false, false).expect("open");
        d.write_at(&[9; 512], 512).expect("write");
        let mut a = vec![0u8; 1024];
        d.read_at(&mut a, 0).expect("read");
        match FileDevice::open(&p, true, true) {
            Ok(dd) => {
                let mut b = vec![0u8; 1024];
                dd.read_at(&mut b, 0).expect("direct read");
                assert_eq!(a, b);
            }
            Err(e) => rext4_testkit::skip(&format!(
                "the O_DIRECT half: O_DIRECT open in the temp directory: {e}"
            )),
        }
        assert_eq!(&a[..512], &[3; 512][..]);
        assert_eq!(&a[512..], &[9; 512][..]);
        assert!(d.read_at(&mut a, 8000).is_err());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn direct_device_takes_unaligned_io_and_concurrent_sub_block_writes() {
        let p = std::env::temp_dir().join(format!("rext4-dev-u-{}", std::process::id()));
        std::fs::write(&p, vec![0u8; 8192]).expect("write");
        let d = match FileDevice::open(&p, false, true) {
            Ok(d) => d,
            Err(e) => {
                let _ = std::fs::remove_file(&p);
                rext4_testkit::skip(&format!("O_DIRECT open in the temp directory: {e}"));
                return;
            }
        };
        let d = std::sync::Arc::new(d);
        // 8 threads, each writing its own 100-byte pieces of the same 4 KiB block.
        let threads: Vec<_> = (0..8u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for round in 0..200u64 {
                        let off = u64::from(t) * 100 + (round % 5) * 800;
                        d.write_at(&[t + 1; 100], off).expect("unaligned write");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        let mut b = vec![0u8; 4096];
        d.read_at(&mut b[..4000], 0).expect("unaligned read");
        for t in 0..8u8 {
            for k in 0..5u64 {
                let off = (u64::from(t) * 100 + k * 800) as usize;
                assert!(
                    b[off..off + 100].iter().all(|&x| x == t + 1),
                    "piece {t}/{k}"
                );
            }
        }
        let _ = std::fs::remove_file(&p);
    }
}
