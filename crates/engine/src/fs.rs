//! The mounted filesystem object: superblock, group descriptors, the buffer cache, and
//! inode access. Everything above (paths, directories, files, xattrs) goes through here.
//!
//! Opening (`Fs::open_device`): read and verify the superblock, gate on features
//! (unknown incompat ⇒ refuse, naming them; unknown ro_compat ⇒ read-only), check the
//! geometry against the device size (so no later allocation or loop is bounded only by
//! on-disk numbers), read and verify every group descriptor. An image whose journal
//! needs recovery is opened read-only with a warning: replay comes with the journal.
//!
//! Must hold: every block number read from disk is checked against `blocks_count`
//! before use (the buffer cache refuses others), every inode number against
//! `inodes_count`.

use std::path::Path;
use std::sync::Arc;

use rext4_format::group::{self, DescCsum, GroupDesc};
use rext4_format::inode::{self as fmt_inode, Inode};
use rext4_format::superblock::{feature, Superblock, SB_OFFSET, SB_SIZE};

use crate::cache::{BufferCache, Kind};
use crate::device::{BlockDevice, FileDevice};
use crate::error::{AtBlock, Error, Result};

/// How to open a filesystem.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Open without writing anything to the image (the only mode until the write path).
    pub read_only: bool,
    /// Use O_DIRECT on the image file.
    pub direct_io: bool,
    /// Metadata cache size in blocks.
    pub cache_blocks: usize,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            read_only: true,
            direct_io: false,
            cache_blocks: 16384,
        }
    }
}

pub(crate) struct Inner {
    pub(crate) cache: BufferCache,
    pub(crate) sb: Superblock,
    pub(crate) groups: Vec<GroupDesc>,
    pub(crate) block_size: u32,
    pub(crate) csum_seed: u32,
    pub(crate) metadata_csum: bool,
    pub(crate) read_only: bool,
    pub(crate) warnings: Vec<String>,
}

/// An open ext4 filesystem. Cheap to clone; shareable across threads.
#[derive(Clone)]
pub struct Fs {
    pub(crate) inner: Arc<Inner>,
}

/// An inode number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ino(pub u32);

impl Ino {
    pub const ROOT: Ino = Ino(fmt_inode::ROOT_INO);
}

impl Fs {
    /// Open an image file read-only (std::fs-style entry point).
    pub fn open(path: impl AsRef<Path>) -> Result<Fs> {
        Self::open_with(path, FsOptions::default())
    }

    pub fn open_with(path: impl AsRef<Path>, opts: FsOptions) -> Result<Fs> {
        if !opts.read_only {
            return Err(Error::Unsupported(
                "read-write opening is not implemented yet".into(),
            ));
        }
        let dev = FileDevice::open(path.as_ref(), opts.read_only, opts.direct_io)?;
        Self::open_device(Arc::new(dev), opts)
    }

    pub fn open_device(dev: Arc<dyn BlockDevice>, opts: FsOptions) -> Result<Fs> {
        let mut raw = vec![0u8; SB_SIZE];
        if dev.size_bytes() < SB_OFFSET + SB_SIZE as u64 {
            return Err(Error::corrupted(
                "device too small to hold an ext4 superblock",
                None,
            ));
        }
        dev.read_at(&mut raw, SB_OFFSET)?;
        let sb = Superblock::decode(&raw).map_err(|e| Error::from(e.at_block(SB_OFFSET / 1024)))?;
        let mut warnings = Vec::new();
        let mut read_only = opts.read_only;
        let fc = sb.check_features();
        if !fc.unsupported_incompat.is_empty() {
            return Err(Error::Unsupported(format!(
                "image uses incompatible features rext4 does not support: {}",
                fc.unsupported_incompat.join(", ")
            )));
        }
        if !fc.unsupported_ro_compat.is_empty() && !read_only {
            warnings.push(format!(
                "read-only: image uses features rext4 cannot write: {}",
                fc.unsupported_ro_compat.join(", ")
            ));
            read_only = true;
        }
        if sb.has_incompat(feature::INCOMPAT_RECOVER) && sb.has_compat(feature::COMPAT_HAS_JOURNAL)
        {
            warnings.push(
                "the journal needs recovery and was NOT replayed: opened read-only; \
                 recently committed changes may be missing"
                    .into(),
            );
            read_only = true;
        }
        let bs = sb.block_size();
        let dev_blocks = dev.size_bytes() / u64::from(bs);
        if sb.blocks_count > dev_blocks {
            return Err(Error::corrupted(
                format!(
                    "block count {} exceeds the device size ({} blocks of {bs} bytes)",
                    sb.blocks_count, dev_blocks
                ),
                Some(SB_OFFSET / u64::from(bs)),
            ));
        }
        let cache = BufferCache::new(dev, bs as usize, sb.blocks_count, opts.cache_blocks);
        let csum_seed = sb.csum_seed();
        let metadata_csum = sb.metadata_csum();
        let groups = read_groups(&cache, &sb, csum_seed)?;
        Ok(Fs {
            inner: Arc::new(Inner {
                cache,
                sb,
                groups,
                block_size: bs,
                csum_seed,
                metadata_csum,
                read_only,
                warnings,
            }),
        })
    }

    pub fn superblock(&self) -> &Superblock {
        &self.inner.sb
    }
    pub fn group_descs(&self) -> &[GroupDesc] {
        &self.inner.groups
    }
    pub fn block_size(&self) -> u32 {
        self.inner.block_size
    }
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }
    /// Messages the user should see about how the image was opened.
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }
    pub(crate) fn cache(&self) -> &BufferCache {
        &self.inner.cache
    }

    /// Read and verify inode `ino`.
    pub fn read_inode(&self, ino: Ino) -> Result<Inode> {
        let (raw, blk) = self.inode_bytes(ino)?;
        if self.inner.metadata_csum {
            fmt_inode::verify_csum(&raw, ino.0, self.inner.csum_seed).at(blk)?;
        }
        let inode = Inode::decode(&raw).at(blk)?;
        Ok(inode)
    }

    /// The raw record of inode `ino` and the block it lives in.
    pub fn inode_bytes(&self, ino: Ino) -> Result<(Vec<u8>, u64)> {
        let sb = &self.inner.sb;
        if ino.0 == 0 || ino.0 > sb.inodes_count {
            return Err(Error::corrupted(
                format!("inode number {} out of range", ino.0),
                None,
            ));
        }
        let ipg = sb.inodes_per_group;
        let g = ((ino.0 - 1) / ipg) as usize;
        let idx = u64::from((ino.0 - 1) % ipg);
        let gd = self.inner.groups.get(g).ok_or_else(|| {
            Error::corrupted(format!("inode {} is in a missing group {g}", ino.0), None)
        })?;
        let isz = u64::from(sb.inode_size);
        let bs = u64::from(self.inner.block_size);
        if gd.has_flag(group::FLAG_INODE_UNINIT) {
            // Never initialized: reads as a zeroed record.
            return Ok((vec![0u8; isz as usize], gd.inode_table));
        }
        let blk = gd.inode_table.saturating_add(idx * isz / bs);
        let off = ((idx * isz) % bs) as usize;
        let data = self.inner.cache.read(blk, Kind::InodeTable, |_| Ok(()))?;
        let rec = data
            .get(off..off + isz as usize)
            .ok_or_else(|| Error::corrupted("inode record outside its block", Some(blk)))?;
        Ok((rec.to_vec(), blk))
    }

    /// Inode seed for checksums of blocks owned by this inode.
    pub(crate) fn inode_seed(&self, ino: Ino, inode: &Inode) -> u32 {
        rext4_format::csum::inode_seed(self.inner.csum_seed, ino.0, inode.generation)
    }
}

fn read_groups(cache: &BufferCache, sb: &Superblock, seed: u32) -> Result<Vec<GroupDesc>> {
    let ngroups = sb.group_count();
    let ds = sb.desc_size();
    let per_block = sb.descs_per_block();
    let kind = if sb.metadata_csum() {
        DescCsum::Crc32c { seed }
    } else if sb.has_ro_compat(feature::RO_COMPAT_GDT_CSUM) {
        DescCsum::Crc16 { uuid: sb.uuid }
    } else {
        DescCsum::None
    };
    let mut out = Vec::with_capacity(ngroups.min(1 << 20) as usize);
    for i in 0..sb.desc_blocks() {
        let blk = sb.desc_block_location(i);
        let data = cache.read(blk, Kind::GroupDesc, |_| Ok(()))?;
        for j in 0..per_block {
            let g = i * per_block + j;
            if g >= ngroups {
                break;
            }
            let off = (j as usize) * ds;
            let bytes = data.get(off..off + ds).unwrap_or(&[]);
            group::verify(bytes, g as u32, kind).at(blk)?;
            let gd = GroupDesc::decode(bytes, ds).at(blk)?;
            check_group(sb, g, &gd).at(blk)?;
            out.push(gd);
        }
    }
    Ok(out)
}

fn check_group(sb: &Superblock, g: u64, gd: &GroupDesc) -> rext4_format::Result<()> {
    let bs = u64::from(sb.block_size());
    let itable_blocks = (u64::from(sb.inodes_per_group) * u64::from(sb.inode_size)).div_ceil(bs);
    let n = sb.blocks_count;
    let ok = |b: u64, len: u64| b >= u64::from(sb.first_data_block) && b.saturating_add(len) <= n;
    rext4_format::ensure(ok(gd.block_bitmap, 1), || {
        format!("group {g} block bitmap {} out of range", gd.block_bitmap)
    })?;
    rext4_format::ensure(ok(gd.inode_bitmap, 1), || {
        format!("group {g} inode bitmap {} out of range", gd.inode_bitmap)
    })?;
    rext4_format::ensure(ok(gd.inode_table, itable_blocks), || {
        format!("group {g} inode table {} out of range", gd.inode_table)
    })?;
    rext4_format::ensure(gd.free_inodes_count <= sb.inodes_per_group, || {
        format!(
            "group {g} free inodes {} > inodes per group",
            gd.free_inodes_count
        )
    })
}
