use std::mem::align_of;

use crate::ll::fuse_abi as abi;
use crate::session::MAX_WRITE_SIZE;

/// Size of the buffer for reading a request from the kernel. Since the kernel may send
/// up to `MAX_WRITE_SIZE` bytes in a write request, we use that value plus some extra space.
const BUFFER_SIZE: usize = MAX_WRITE_SIZE + 4096;

/// `len` bytes of fresh anonymous memory: zero, and faulted in only where written. A
/// request buffer must hold the largest WRITE, but most requests are a page: zeroing
/// the whole of it with `vec![0; len]` (16 MiB per serving thread) made a mount's start
/// wait for memory nobody uses (rext4 #14). `None` when the kernel refuses the mapping.
pub(crate) fn map_zeroed(len: usize) -> Option<*mut u8> {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p.cast::<u8>())
}

/// Unmap what [`map_zeroed`] mapped.
///
/// # Safety
/// `p` and `len` are a mapping of [`map_zeroed`], unmapped once, not used after.
pub(crate) unsafe fn unmap(p: *mut u8, len: usize) {
    // SAFETY: as the caller promises.
    unsafe {
        libc::munmap(p.cast(), len);
    }
}

/// A buffer that provides an aligned sub-slice for FUSE operations.
///
/// It wraps a mapping of fresh pages ([`map_zeroed`]; a zeroed `Vec<u8>` where the
/// mapping is refused) and provides access to an aligned portion of it, ensuring proper
/// alignment for `fuse_in_header`.
#[derive(Debug)]
pub(crate) struct FuseReadBuf {
    /// The mapping (page-aligned), or `None` and `buffer` holds the bytes.
    mapped: Option<*mut u8>,
    buffer: Vec<u8>,
}

// SAFETY: the mapping is owned by this value alone, like the Vec it stands for.
unsafe impl Send for FuseReadBuf {}

impl Drop for FuseReadBuf {
    fn drop(&mut self) {
        if let Some(p) = self.mapped.take() {
            // SAFETY: mapped by `new` with this length, unmapped once.
            unsafe { unmap(p, BUFFER_SIZE) };
        }
    }
}

impl FuseReadBuf {
    /// Creates a new `FuseReadBuf` with the default buffer size.
    pub(crate) fn new() -> Self {
        match map_zeroed(BUFFER_SIZE) {
            Some(p) => Self {
                mapped: Some(p),
                buffer: Vec::new(),
            },
            None => Self {
                mapped: None,
                buffer: vec![0; BUFFER_SIZE],
            },
        }
    }

    /// Returns a mutable reference to the aligned portion of the buffer.
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        if let Some(p) = self.mapped {
            // SAFETY: a page-aligned (so header-aligned) mapping of BUFFER_SIZE
            // initialized bytes, borrowed mutably through `self`.
            return unsafe { std::slice::from_raw_parts_mut(p, BUFFER_SIZE) };
        }
        let alignment = align_of::<abi::fuse_in_header>();
        let off = alignment - (self.buffer.as_ptr() as usize) % alignment;
        if off == alignment {
            &mut self.buffer
        } else {
            &mut self.buffer[off..]
        }
    }
}
