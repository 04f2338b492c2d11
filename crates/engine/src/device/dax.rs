//! DAX: the image as byte-addressable memory (SEEDS lesson E).
//!
//! When the image lives in memory the process can map — a file on tmpfs or hugetlbfs,
//! a device-dax or pmem character device, a CXL memory file — [`DaxDevice`] maps all of
//! it once (MAP_SHARED) and serves the [`BlockDevice`] seam by copying between the
//! caller's buffer and the mapping: no page cache, no system call per request.
//!
//! Persistence (what [`BlockDevice::flush`] promises): a write copies with
//! non-temporal stores (they bypass the CPU caches; x86-64 `movntdq`), and the few
//! bytes of a write that do not fill whole 16-byte units go through the cache and
//! are written back with `clwb` (`clflushopt`, `clflush` where missing). `flush` is an
//! `sfence`: every earlier store is then in the persistence domain (the ADR model: the
//! memory controller's queues survive a power failure, the CPU caches do not). On a
//! backing store whose durability is the kernel's page cache over a disk (an image file
//! on ext4, xfs, ...) `flush` also runs msync(MS_SYNC); on tmpfs and hugetlbfs there is
//! nothing behind the memory to sync. Other architectures copy with plain stores and
//! make `flush` an msync of the whole mapping (the portable fallback).
//!
//! Stores made through a mapping of file blocks (`dax_map`) go through the cache like
//! any store of the program; [`DaxDevice::persist_lines`] writes such ranges back (the
//! file's fsync does it for its dirty ranges, then fences).
//!
//! A [`PersistObserver`] (tests: the testkit's persistence simulator) is told of every
//! store, write-back and fence with the lines' contents as they are in memory, so it
//! can compute what a power failure at any moment would leave.
//!
//! Safety: the mapping is shared memory outside Rust's object model (another process
//! may change it); the engine never forms references to it, only copies through raw
//! pointers, inside the bounds checked against the mapped length. Accesses to the same
//! bytes are ordered by the engine's locks exactly as pread/pwrite to the same bytes
//! are on [`crate::device::FileDevice`]. A backing file truncated under the engine
//! would make an access past its new end fault (SIGBUS): each request first checks the
//! file's size (fstat) and fails with an I/O error naming it instead. A truncate that
//! races that check is the one case left (as with any mapped file).
//!
//! Lock order: none here; the observer's lock is a leaf.

use std::fs::OpenOptions;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use crate::device::BlockDevice;

/// CPU cache line: the unit of write-back and of the persistence simulator.
pub const LINE: usize = 64;

/// How a store reached memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// Non-temporal: durable at the next fence.
    NonTemporal,
    /// Through the cache: durable once written back (`clwb`) and fenced.
    Cached,
}

/// Sees every persistence event of a [`DaxDevice`], in order (test instrumentation).
/// `lines` holds the current contents of the whole lines from `first_line` on.
pub trait PersistObserver: Send + Sync {
    /// Bytes were stored into these lines.
    fn stored(&self, first_line: u64, lines: &[u8], how: Store);
    /// These lines were written back (clwb): their contents reach memory at the next
    /// fence.
    fn written_back(&self, first_line: u64, lines: &[u8]);
    /// sfence: everything stored non-temporally or written back before is durable.
    fn fenced(&self);
}

/// What the CPU offers for write-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteBack {
    Clwb,
    Clflushopt,
    Clflush,
    /// No cache-line write-back instruction (not x86-64): msync instead.
    Msync,
}

/// The best write-back instruction this CPU has.
pub fn write_back_kind() -> WriteBack {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 7 is asked for only when leaf 0 says it exists.
        let max = core::arch::x86_64::__cpuid(0).eax;
        let ebx7 = if max >= 7 {
            core::arch::x86_64::__cpuid_count(7, 0).ebx
        } else {
            0
        };
        if ebx7 & (1 << 24) != 0 {
            WriteBack::Clwb
        } else if ebx7 & (1 << 23) != 0 {
            WriteBack::Clflushopt
        } else {
            WriteBack::Clflush
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        WriteBack::Msync
    }
}

/// Copy primitives on raw memory.
pub(crate) mod copy {
    use super::{WriteBack, LINE};

    /// Write back the cache lines covering `[p, p+len)` (no fence).
    ///
    /// # Safety
    /// `p..p+len` lies inside one live mapping.
    pub unsafe fn write_back(wb: WriteBack, p: *const u8, len: usize) {
        if len == 0 {
            return;
        }
        let start = (p as usize) & !(LINE - 1);
        let end = p as usize + len;
        let mut a = start;
        while a < end {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `a` is a line that overlaps the caller's range, so it is mapped;
            // the instructions only write the line back and have no other effect.
            unsafe {
                match wb {
                    WriteBack::Clwb => {
                        core::arch::asm!("clwb [{}]", in(reg) a, options(nostack, preserves_flags))
                    }
                    WriteBack::Clflushopt => core::arch::asm!(
                        "clflushopt [{}]",
                        in(reg) a,
                        options(nostack, preserves_flags)
                    ),
                    WriteBack::Clflush | WriteBack::Msync => {
                        core::arch::x86_64::_mm_clflush(a as *const u8)
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = wb;
            a += LINE;
        }
    }

    /// Store fence: earlier non-temporal stores and write-backs complete first.
    pub fn fence() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: sfence has no operands and no effect but ordering.
        unsafe {
            core::arch::x86_64::_mm_sfence()
        };
        #[cfg(not(target_arch = "x86_64"))]
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Copy `src` to `dst` with non-temporal stores where the destination allows
    /// (16-byte units); the unaligned head and tail go through the cache and are
    /// written back. No fence: the caller fences when it needs durability.
    ///
    /// # Safety
    /// `dst..dst+src.len()` lies inside one live, writable mapping and does not
    /// overlap `src`.
    pub unsafe fn copy_nt(wb: WriteBack, dst: *mut u8, src: &[u8]) {
        let n = src.len();
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let head = (16 - (dst as usize & 15)) & 15;
            if n < head + 64 {
                // SAFETY: the caller's contract.
                unsafe {
                    core::ptr::copy_nonoverlapping(src.as_ptr(), dst, n);
                    write_back(wb, dst, n);
                }
                return;
            }
            // SAFETY: head < n, inside the caller's range.
            unsafe {
                core::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
            }
            let body = (n - head) & !15;
            let mut i = head;
            // 64 bytes per round: four loads, four streaming stores.
            while i + 64 <= head + body {
                // SAFETY: i+64 <= n on both sides; dst+i is 16-byte aligned (head
                // aligned it), as _mm_stream_si128 requires; loads are unaligned.
                unsafe {
                    let s = src.as_ptr().add(i) as *const __m128i;
                    let d = dst.add(i) as *mut __m128i;
                    let a = _mm_loadu_si128(s);
                    let b = _mm_loadu_si128(s.add(1));
                    let c = _mm_loadu_si128(s.add(2));
                    let e = _mm_loadu_si128(s.add(3));
                    _mm_stream_si128(d, a);
                    _mm_stream_si128(d.add(1), b);
                    _mm_stream_si128(d.add(2), c);
                    _mm_stream_si128(d.add(3), e);
                }
                i += 64;
            }
            while i + 16 <= head + body {
                // SAFETY: as above, for one 16-byte unit.
                unsafe {
                    let v = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                    _mm_stream_si128(dst.add(i) as *mut __m128i, v);
                }
                i += 16;
            }
            // SAFETY: the tail i..n is inside the caller's range; head and tail went
            // through the cache, so they are written back.
            unsafe {
                core::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), n - i);
                write_back(wb, dst, head);
                write_back(wb, dst.add(i), n - i);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = wb;
            // SAFETY: the caller's contract.
            unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), dst, n) };
        }
    }

    /// Copy through the cache, then write every line back (no fence).
    ///
    /// # Safety
    /// As [`copy_nt`].
    pub unsafe fn copy_cached_wb(wb: WriteBack, dst: *mut u8, src: &[u8]) {
        // SAFETY: the caller's contract.
        unsafe {
            core::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            write_back(wb, dst, src.len());
        }
    }
}

/// One shared mapping of a whole backing file.
struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain shared memory; all access is through raw-pointer copies
// whose ordering the engine's locks provide (see the module note).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the values mmap returned; nothing uses the region after
        // the device is dropped (mappings of file blocks hold the device).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Where the bytes of the backing store become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backing {
    /// tmpfs, hugetlbfs, a dax character device: the memory is all there is.
    Memory,
    /// A file whose pages the kernel writes to a disk: flush needs msync.
    PageCache,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// A device over a memory-mapped backing store (see the module note).
pub struct DaxDevice {
    region: Region,
    file: std::fs::File,
    backing: Backing,
    read_only: bool,
    wb: WriteBack,
    observer: Option<Arc<dyn PersistObserver>>,
    /// Whether `file` is a regular file (its size can change under us).
    regular: bool,
}

impl DaxDevice {
    /// Map the image file or dax device at `path`.
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path)?;
        let meta = file.metadata()?;
        let ft = meta.file_type();
        let len = if ft.is_file() {
            meta.len()
        } else if ft.is_char_device() || ft.is_block_device() {
            use std::io::{Seek, SeekFrom};
            let mut f = &file;
            f.seek(SeekFrom::End(0))?
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: not a file or device that can be mapped",
                    path.display()
                ),
            ));
        };
        let len = usize::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "image too large to map"))?;
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: empty, nothing to map", path.display()),
            ));
        }
        let backing = if ft.is_char_device() {
            Backing::Memory
        } else {
            // SAFETY: statfs writes into the zeroed struct we pass; the fd is open.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let r = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            #[allow(clippy::unnecessary_cast)]
            let t = st.f_type as i64;
            if t == TMPFS_MAGIC || t == HUGETLBFS_MAGIC {
                Backing::Memory
            } else {
                Backing::PageCache
            }
        };
        let prot = if read_only {
            libc::PROT_READ
        } else {
            libc::PROT_READ | libc::PROT_WRITE
        };
        // SAFETY: a fresh shared mapping of `len` bytes of an open descriptor; the
        // kernel picks the address. Checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(DaxDevice {
            region: Region {
                ptr: ptr.cast(),
                len,
            },
            file,
            backing,
            read_only,
            wb: write_back_kind(),
            observer: None,
            regular: ft.is_file(),
        })
    }

    /// Report every persistence event to `obs` (the testkit's simulator).
    pub fn with_observer(mut self, obs: Arc<dyn PersistObserver>) -> Self {
        self.observer = Some(obs);
        self
    }

    /// The backing file (mappings of file blocks map it again).
    pub(crate) fn backing_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    /// The mapped length in bytes.
    pub fn len(&self) -> u64 {
        self.region.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// The write-back instruction in use.
    pub fn write_back(&self) -> WriteBack {
        self.wb
    }

    /// `[offset, offset+len)` inside the mapping, and inside the backing file as it is
    /// now (a file truncated under us would fault).
    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        let size = self.region.len as u64;
        let end = match offset.checked_add(len as u64) {
            Some(end) if end <= size => end,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("I/O of {len} bytes at {offset} is outside the {size}-byte device"),
                ))
            }
        };
        if self.regular && len > 0 {
            let now = self.file.metadata()?.len();
            if end > now {
                return Err(io::Error::other(format!(
                    "the DAX backing file shrank to {now} bytes under the filesystem \
                     (mapped {size}); refusing to touch byte {offset}"
                )));
            }
        }
        Ok(offset as usize)
    }

    /// The backing file still covers the whole mapping (mappings of file blocks check
    /// it before touching them: a page past a cut would fault).
    pub(crate) fn check_intact(&self) -> io::Result<()> {
        if !self.regular {
            return Ok(());
        }
        let now = self.file.metadata()?.len();
        if now < self.region.len as u64 {
            return Err(io::Error::other(format!(
                "the DAX backing file shrank to {now} bytes under the filesystem \
                 (mapped {})",
                self.region.len
            )));
        }
        Ok(())
    }

    /// Tell the observer about the lines covering `[off, off+len)`.
    fn observe(&self, off: usize, len: usize, f: impl FnOnce(&dyn PersistObserver, u64, &[u8])) {
        let Some(obs) = &self.observer else { return };
        if len == 0 {
            return;
        }
        let first = off / LINE;
        let end = (off + len).div_ceil(LINE) * LINE;
        let end = end.min(self.region.len);
        let mut lines = vec![0u8; end - first * LINE];
        // SAFETY: first*LINE..end is inside the mapping (end clamped to its length).
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.region.ptr.add(first * LINE),
                lines.as_mut_ptr(),
                lines.len(),
            )
        };
        f(obs.as_ref(), first as u64, &lines);
    }

    /// Write back the lines of `[offset, offset+len)` (stores made through a mapping
    /// of file blocks); durable at the next [`BlockDevice::flush`].
    pub fn persist_lines(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = usize::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "range too long"))?;
        let o = self.check(offset, len)?;
        // SAFETY: o..o+len checked inside the mapping.
        unsafe { copy::write_back(self.wb, self.region.ptr.add(o), len) };
        self.observe(o, len, |obs, first, lines| obs.written_back(first, lines));
        Ok(())
    }

    /// Record a store made through a mapping of file blocks (for the observer; the
    /// bytes are already in memory).
    pub(crate) fn note_cached_store(&self, offset: u64, len: usize) {
        if let Ok(o) = usize::try_from(offset) {
            if o.checked_add(len).is_some_and(|e| e <= self.region.len) {
                self.observe(o, len, |obs, first, lines| {
                    obs.stored(first, lines, Store::Cached)
                });
            }
        }
    }

    /// Base address of the mapping (the benchmark compares against it).
    pub fn as_ptr(&self) -> *const u8 {
        self.region.ptr
    }
}

impl BlockDevice for DaxDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and `read_at_uninit` only
        // writes initialized bytes into it.
        self.read_at_uninit(unsafe { crate::device::as_uninit(buf) }, offset)
    }

    /// The mapping is copied straight into `buf`: a DAX read is one pass over the
    /// memory, with no zeroing pass before it (the reads of `File::read_at` and the
    /// mount come here through `read_device_into`).
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        let o = self.check(offset, buf.len())?;
        // SAFETY: o..o+len is inside the mapping (checked) and the backing file;
        // `buf` is the caller's own memory, so the two do not overlap.
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.region.ptr.add(o),
                buf.as_mut_ptr().cast::<u8>(),
                buf.len(),
            )
        };
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        crate::device::refuse_if_read_only(self.read_only)?;
        let o = self.check(offset, buf.len())?;
        // SAFETY: o..o+len is inside the writable mapping (checked; read-only devices
        // return above) and does not overlap the caller's buffer.
        unsafe { copy::copy_nt(self.wb, self.region.ptr.add(o), buf) };
        self.observe(o, buf.len(), |obs, first, lines| {
            obs.stored(first, lines, Store::NonTemporal)
        });
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        copy::fence();
        if let Some(obs) = &self.observer {
            obs.fenced();
        }
        if self.backing == Backing::PageCache || self.wb == WriteBack::Msync {
            // SAFETY: the whole region, as mapped.
            let r = unsafe { libc::msync(self.region.ptr.cast(), self.region.len, libc::MS_SYNC) };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.region.len as u64
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn dax(&self) -> Option<&DaxDevice> {
        Some(self)
    }
}

/// Copy bandwidths of a backing store in GB/s (10^9 bytes per second), for
/// `rext4 bench dax`.
#[derive(Debug, Clone, Copy)]
pub struct CopyLimits {
    /// Plain cached copy (not persistent).
    pub cached: f64,
    /// Cached copy, clwb of every line, sfence, per request.
    pub cached_clwb: f64,
    /// The device's non-temporal copy, sfence per request.
    pub nt: f64,
    /// memcpy out of the mapping.
    pub memcpy_read: f64,
}

/// Measure the copy strategies on a scratch file created at `scratch` (removed
/// again; on the same filesystem as the image to compare with): `size` bytes mapped
/// shared, filled `passes` times in `chunk`-byte requests per strategy, in the
/// order of the shared daxcopy.c (cached, cached+clwb, then non-temporal, so the
/// region is warm), then read back. `stop` is polled between requests.
pub fn measure_copy_limits(
    scratch: &Path,
    size: usize,
    chunk: usize,
    passes: u32,
    stop: &dyn Fn() -> bool,
) -> io::Result<CopyLimits> {
    if chunk == 0 || size == 0 || !size.is_multiple_of(chunk) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "size must be a positive multiple of the request size",
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(scratch)?;
    struct Cleanup<'a>(&'a Path);
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _cleanup = Cleanup(scratch);
    file.set_len(size as u64)?;
    // SAFETY: a fresh shared mapping of the whole scratch file; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let region = Region {
        ptr: p.cast(),
        len: size,
    };
    let wb = write_back_kind();
    let src: Vec<u8> = (0..chunk).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; chunk];
    let total = (size as u64 * u64::from(passes)) as f64;
    let mut rates = [0f64; 4];
    for (k, rate) in rates.iter_mut().enumerate() {
        let t = std::time::Instant::now();
        for _ in 0..passes {
            let mut off = 0usize;
            while off < size {
                if stop() {
                    return Err(io::Error::new(io::ErrorKind::Interrupted, "stopped"));
                }
                // SAFETY: off + chunk <= size (size is a multiple of chunk): inside
                // the scratch mapping, which nobody else uses; `src`/`dst` are ours.
                unsafe {
                    let d = region.ptr.add(off);
                    match k {
                        0 => core::ptr::copy_nonoverlapping(src.as_ptr(), d, chunk),
                        1 => {
                            copy::copy_cached_wb(wb, d, &src);
                            copy::fence();
                        }
                        2 => {
                            copy::copy_nt(wb, d, &src);
                            copy::fence();
                        }
                        _ => core::ptr::copy_nonoverlapping(d, dst.as_mut_ptr(), chunk),
                    }
                }
                off += chunk;
            }
        }
        std::hint::black_box(&dst);
        *rate = total / t.elapsed().as_secs_f64() / 1e9;
    }
    drop(region);
    Ok(CopyLimits {
        cached: rates[0],
        cached_clwb: rates[1],
        nt: rates[2],
        memcpy_read: rates[3],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_limits_measure_and_clean_up() {
        let p = std::path::PathBuf::from(format!(
            "{}/rext4-dax-limits-{}",
            std::env::temp_dir().display(),
            std::process::id()
        ));
        let l = measure_copy_limits(&p, 1 << 20, 64 << 10, 1, &|| false).expect("measure");
        assert!(l.nt > 0.0 && l.cached > 0.0 && l.cached_clwb > 0.0 && l.memcpy_read > 0.0);
        assert!(!p.exists(), "the scratch file is removed");
        assert!(measure_copy_limits(&p, 1000, 64, 1, &|| false).is_err());
        assert!(!p.exists());
    }

    fn tmp_image(name: &str, len: usize) -> std::path::PathBuf {
        let dir = if Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let p = dir.join(format!("rext4-dax-{name}-{}", std::process::id()));
        std::fs::write(&p, vec![0u8; len]).expect("write image");
        p
    }

    #[test]
    fn copies_agree_at_every_alignment() {
        let p = tmp_image("align", 1 << 16);
        let d = DaxDevice::open(&p, false).expect("map");
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for (off, n) in [
            (0u64, 5000usize),
            (1, 4999),
            (17, 63),
            (4095, 1000),
            (60000, 5000),
        ] {
            let n = n.min((d.len() - off) as usize);
            d.write_at(&src[..n], off).expect("write");
            let mut back = vec![0u8; n];
            d.read_at(&mut back, off).expect("read");
            assert_eq!(back, src[..n], "at {off}+{n}");
        }
        d.flush().expect("flush");
        drop(d);
        let on_file = std::fs::read(&p).expect("read file");
        assert_eq!(
            &on_file[60000..65000],
            &src[..5000],
            "the bytes are in the file"
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn refuses_out_of_range_and_a_shrunk_backing_file() {
        let p = tmp_image("shrink", 8192);
        let d = DaxDevice::open(&p, false).expect("map");
        let mut b = [0u8; 16];
        assert!(d.read_at(&mut b, 8190).is_err());
        assert!(d.write_at(&b, u64::MAX - 3).is_err());
        let f = OpenOptions::new().write(true).open(&p).expect("open");
        f.set_len(4096).expect("truncate the backing file");
        let e = d.read_at(&mut b, 4096).expect_err("past the shrunk end");
        assert!(e.to_string().contains("shrank"), "{e}");
        assert!(d.write_at(&b, 6000).is_err());
        d.read_at(&mut b, 0).expect("below the new end still works");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn refuses_an_empty_backing_file() {
        let p = tmp_image("empty", 0);
        assert!(DaxDevice::open(&p, false).is_err());
        let _ = std::fs::remove_file(&p);
    }
}
