//! An in-memory copy-on-write layer over a device: reads see the base device with every
//! block written through the overlay replaced by its in-memory copy; writes never reach
//! the base. A read-only open of an image whose journal needs recovery replays into an
//! overlay and opens the filesystem on it, so the image file stays unchanged.
//!
//! Must hold: the overlay has the base's size and refuses I/O outside it, like every
//! backend; a write of part of a block first copies the rest of that block from the
//! base, so later reads of the whole block are consistent.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, RwLock};

use crate::device::BlockDevice;

/// A [`BlockDevice`] whose writes go to a `HashMap<block, bytes>` over a base device
/// that is only ever read.
pub struct Overlay {
    base: Arc<dyn BlockDevice>,
    block_size: u64,
    blocks: RwLock<HashMap<u64, Vec<u8>>>,
}

impl Overlay {
    /// An empty overlay over `base`, tracking changes in units of `block_size` bytes
    /// (any power of two; the filesystem block size is the natural choice).
    pub fn new(base: Arc<dyn BlockDevice>, block_size: u32) -> Overlay {
        Overlay {
            base,
            block_size: u64::from(block_size.max(512)),
            blocks: RwLock::new(HashMap::new()),
        }
    }

    /// Number of blocks held in memory.
    pub fn changed_blocks(&self) -> usize {
        self.blocks.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn check_range(&self, offset: u64, len: usize) -> io::Result<u64> {
        let size = self.base.size_bytes();
        match offset.checked_add(len as u64) {
            Some(end) if end <= size => Ok(end),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("I/O of {len} bytes at {offset} is outside the {size}-byte device"),
            )),
        }
    }
}

impl BlockDevice for Overlay {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = self.check_range(offset, buf.len())?;
        self.base.read_at(buf, offset)?;
        let map = self.blocks.read().unwrap_or_else(|p| p.into_inner());
        if map.is_empty() || buf.is_empty() {
            return Ok(());
        }
        let bs = self.block_size;
        for blk in offset / bs..=(end - 1) / bs {
            let Some(data) = map.get(&blk) else { continue };
            let b_start = blk * bs;
            let lo = offset.max(b_start);
            let hi = end.min(b_start + bs);
            let src = data.get((lo - b_start) as usize..(hi - b_start) as usize);
            let dst = buf.get_mut((lo - offset) as usize..(hi - offset) as usize);
            if let (Some(src), Some(dst)) = (src, dst) {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = self.check_range(offset, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.block_size;
        let size = self.base.size_bytes();
        let mut map = self.blocks.write().unwrap_or_else(|p| p.into_inner());
        for blk in offset / bs..=(end - 1) / bs {
            let b_start = blk * bs;
            let lo = offset.max(b_start);
            let hi = end.min(b_start + bs);
            let data = match map.entry(blk) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    // A short last block (device size not a multiple of bs) keeps its
                    // length; a block written only in part starts as the base's copy.
                    let len = (size - b_start).min(bs) as usize;
                    let mut data = vec![0u8; len];
                    if lo > b_start || hi < b_start + len as u64 {
                        self.base.read_at(&mut data, b_start)?;
                    }
                    v.insert(data)
                }
            };
            let dst = data.get_mut((lo - b_start) as usize..(hi - b_start) as usize);
            let src = buf.get((lo - offset) as usize..(hi - offset) as usize);
            if let (Some(dst), Some(src)) = (dst, src) {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn is_read_only(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn writes_stay_in_memory_and_reads_merge() {
        let base = Arc::new(MemDevice::read_only(
            (0..8192u32).map(|i| i as u8).collect(),
        ));
        let o = Overlay::new(base.clone(), 1024);
        // A write straddling blocks 0 and 1, partial on both.
        o.write_at(&[0xAA; 100], 1000).expect("write");
        let mut b = vec![0u8; 2048];
        o.read_at(&mut b, 0).expect("read");
        for (i, &x) in b.iter().enumerate() {
            let want = if (1000..1100).contains(&i) {
                0xAA
            } else {
                i as u8
            };
            assert_eq!(x, want, "byte {i}");
        }
        assert_eq!(o.changed_blocks(), 2);
        // The base is untouched.
        let mut c = vec![0u8; 8192];
        base.read_at(&mut c, 0).expect("base read");
        assert!(c.iter().enumerate().all(|(i, &x)| x == i as u8));
        // Bounds are the base's.
        assert!(o.write_at(&[1; 16], 8190).is_err());
        assert!(o.read_at(&mut [0u8; 16], 8190).is_err());
        // A read that starts inside a changed block.
        let mut d = [0u8; 4];
        o.read_at(&mut d, 1098).expect("read");
        assert_eq!(d, [0xAA, 0xAA, 1100u32 as u8, 1101u32 as u8]);
    }
}
