//! Metadata buffer cache: whole filesystem blocks keyed by physical block number,
//! verified on read.
//!
//! A block is verified once per [`Kind`] it is read as: a corrupted image can make one
//! block look like both an extent node and a directory block, and each use must pass its
//! own verifier before its bytes are trusted. Buffers are shared `Arc<[u8]>`; the cache
//! is bounded by a block count and drops arbitrary unpinned entries when full (the write
//! path will add dirty tracking and pinning here: this is the one place where a
//! metadata buffer will be declared dirty).
//!
//! Locking: one mutex around the map, never held across device I/O.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::device::BlockDevice;
use crate::error::{Error, Result};

/// What a block is being read as; each kind has its own verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    Raw = 0,
    GroupDesc = 1,
    Bitmap = 2,
    InodeTable = 3,
    ExtentNode = 4,
    DirLeaf = 5,
    DirIndex = 6,
    Xattr = 7,
    Indirect = 8,
    Symlink = 9,
}

struct Entry {
    data: Arc<[u8]>,
    verified: u32,
}

pub struct BufferCache {
    dev: Arc<dyn BlockDevice>,
    block_size: usize,
    blocks_count: u64,
    cap: usize,
    map: Mutex<HashMap<u64, Entry>>,
}

impl BufferCache {
    pub fn new(
        dev: Arc<dyn BlockDevice>,
        block_size: usize,
        blocks_count: u64,
        cap: usize,
    ) -> Self {
        BufferCache {
            dev,
            block_size,
            blocks_count,
            cap: cap.max(16),
            map: Mutex::new(HashMap::new()),
        }
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Read block `blk`, checking it with `verify` the first time it is read as `kind`.
    pub fn read(
        &self,
        blk: u64,
        kind: Kind,
        verify: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<Arc<[u8]>> {
        if blk >= self.blocks_count {
            return Err(Error::corrupted(
                format!(
                    "{kind:?} block {blk} is past the end of the filesystem ({})",
                    self.blocks_count
                ),
                Some(blk),
            ));
        }
        let bit = 1u32 << (kind as u32);
        let cached = {
            let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.get(&blk)
                .map(|e| (e.data.clone(), e.verified & bit != 0))
        };
        let data = match cached {
            Some((d, true)) => return Ok(d),
            Some((d, false)) => d,
            None => {
                let mut v = vec![0u8; self.block_size];
                self.dev.read_at(&mut v, blk * self.block_size as u64)?;
                Arc::from(v)
            }
        };
        verify(&data).map_err(|e| match e {
            Error::Corrupted { what, block: None } => Error::Corrupted {
                what,
                block: Some(blk),
            },
            other => other,
        })?;
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.cap {
            let victims: Vec<u64> = map.keys().take(self.cap / 4).copied().collect();
            for v in victims {
                map.remove(&v);
            }
        }
        let e = map.entry(blk).or_insert(Entry {
            data: data.clone(),
            verified: 0,
        });
        e.verified |= bit;
        Ok(data)
    }

    /// Read without a verifier (data blocks of symlinks, raw dumps).
    pub fn read_raw(&self, blk: u64) -> Result<Arc<[u8]>> {
        self.read(blk, Kind::Raw, |_| Ok(()))
    }

    /// Forget everything (after the device changed underneath).
    pub fn invalidate(&self) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn verifies_per_kind_and_reports_the_block() {
        let dev = Arc::new(MemDevice::new(vec![0u8; 1024 * 8]));
        let c = BufferCache::new(dev, 1024, 8, 16);
        c.read(3, Kind::Raw, |_| Ok(())).expect("raw ok");
        let e = c.read(3, Kind::DirLeaf, |_| Err(Error::corrupted("bad", None)));
        assert!(matches!(e, Err(Error::Corrupted { block: Some(3), .. })));
        assert!(matches!(
            c.read(9, Kind::Raw, |_| Ok(())),
            Err(Error::Corrupted { .. })
        ));
    }
}
