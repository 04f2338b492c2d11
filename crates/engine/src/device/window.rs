//! [`Window`]: a byte range of another device seen as a device of its own — a
//! partition of a disk (`IMAGE?partition=N`) or `IMAGE?offset=BYTES&size=BYTES`.
//!
//! Must hold: no request reaches outside `[start, start + len)` of the device under
//! it (checked here, before the inner device's own check). Built by `crate::image`.

use std::io;
use std::mem::MaybeUninit;
use std::sync::Arc;

use super::{check_range, BlockDevice};

pub struct Window {
    inner: Arc<dyn BlockDevice>,
    start: u64,
    len: u64,
}

impl Window {
    /// `[start, start + len)` of `inner`; refused when it does not fit.
    pub fn new(inner: Arc<dyn BlockDevice>, start: u64, len: u64) -> io::Result<Window> {
        let size = inner.size_bytes();
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the range of {len} bytes at offset {start} ends past the end of the \
                     {size}-byte disk"
                ),
            ));
        }
        Ok(Window { inner, start, len })
    }
}

impl BlockDevice for Window {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.len)?;
        self.inner.read_at(buf, self.start + offset)
    }
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.len)?;
        self.inner.read_at_uninit(buf, self.start + offset)
    }
    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (off, b) in reqs.iter_mut() {
            check_range(*off, b.len(), self.len)?;
            *off += self.start;
        }
        let r = self.inner.read_many(reqs);
        for (off, _) in reqs.iter_mut() {
            *off -= self.start;
        }
        r
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.len)?;
        self.inner.write_at(buf, self.start + offset)
    }
    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        let mut moved = Vec::with_capacity(reqs.len());
        for &(off, b) in reqs {
            check_range(off, b.len(), self.len)?;
            moved.push((off + self.start, b));
        }
        self.inner.write_many(&moved)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, usize::try_from(len).unwrap_or(usize::MAX), self.len)?;
        self.inner.discard(self.start + offset, len)
    }
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.len)?;
        self.inner.read_fresh(buf, self.start + offset)
    }
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.len)?;
        self.inner.write_through(buf, self.start + offset)
    }
    fn will_need(&self, offset: u64, len: u64) {
        if offset < self.len {
            self.inner
                .will_need(self.start + offset, len.min(self.len - offset));
        }
    }
    fn size_bytes(&self) -> u64 {
        self.len
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn stays_inside() {
        let mem = Arc::new(MemDevice::new(vec![0u8; 8192]));
        assert!(Window::new(mem.clone(), 4096, 8192).is_err());
        let w = Window::new(mem.clone(), 1024, 2048).expect("fits");
        w.write_at(&[7u8; 512], 1536).expect("write");
        assert!(w.write_at(&[7u8; 512], 1537).is_err());
        assert!(w.read_at(&mut [0u8; 1], 2048).is_err());
        let snap = mem.snapshot();
        assert_eq!(&snap[2560..3072], &[7u8; 512][..]);
        assert_eq!(snap[2559], 0);
        assert_eq!(snap[3072], 0);
    }
}
