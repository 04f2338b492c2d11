//! The ext4 superblock (format notes §2.1): 1024 bytes at byte offset 1024 of the device,
//! with backups at the start of sparse_super backup groups.
//!
//! [`Superblock::decode`] checks the magic, the geometry (block size, group sizes,
//! counts that must be consistent with each other) and, with metadata_csum, the
//! checksum; it does not judge features: [`Superblock::check_features`] says which
//! feature bits this version of rext4 cannot honour, by name, so the engine can refuse
//! (incompat) or fall back to read-only (ro_compat).
//!
//! Encoding writes the known fields over the caller's copy of the original 1024 bytes,
//! so fields rext4 does not model survive a read-modify-write unchanged.

use crate::bytes::*;
use crate::csum;
use crate::{ensure, Result};

pub const SB_OFFSET: u64 = 1024;
pub const SB_SIZE: usize = 1024;
pub const MAGIC: u16 = 0xEF53;
const CSUM_OFF: usize = 0x3FC;

/// Feature bits, grouped by which word they live in.
pub mod feature {
    pub const COMPAT_DIR_PREALLOC: u32 = 0x1;
    pub const COMPAT_IMAGIC_INODES: u32 = 0x2;
    pub const COMPAT_HAS_JOURNAL: u32 = 0x4;
    pub const COMPAT_EXT_ATTR: u32 = 0x8;
    pub const COMPAT_RESIZE_INODE: u32 = 0x10;
    pub const COMPAT_DIR_INDEX: u32 = 0x20;
    pub const COMPAT_SPARSE_SUPER2: u32 = 0x200;
    pub const COMPAT_FAST_COMMIT: u32 = 0x400;
    pub const COMPAT_STABLE_INODES: u32 = 0x800;
    pub const COMPAT_ORPHAN_FILE: u32 = 0x1000;

    pub const INCOMPAT_COMPRESSION: u32 = 0x1;
    pub const INCOMPAT_FILETYPE: u32 = 0x2;
    pub const INCOMPAT_RECOVER: u32 = 0x4;
    pub const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
    pub const INCOMPAT_META_BG: u32 = 0x10;
    pub const INCOMPAT_EXTENTS: u32 = 0x40;
    pub const INCOMPAT_64BIT: u32 = 0x80;
    pub const INCOMPAT_MMP: u32 = 0x100;
    pub const INCOMPAT_FLEX_BG: u32 = 0x200;
    pub const INCOMPAT_EA_INODE: u32 = 0x400;
    pub const INCOMPAT_DIRDATA: u32 = 0x1000;
    pub const INCOMPAT_CSUM_SEED: u32 = 0x2000;
    pub const INCOMPAT_LARGEDIR: u32 = 0x4000;
    pub const INCOMPAT_INLINE_DATA: u32 = 0x8000;
    pub const INCOMPAT_ENCRYPT: u32 = 0x10000;
    pub const INCOMPAT_CASEFOLD: u32 = 0x20000;

    pub const RO_COMPAT_SPARSE_SUPER: u32 = 0x1;
    pub const RO_COMPAT_LARGE_FILE: u32 = 0x2;
    pub const RO_COMPAT_BTREE_DIR: u32 = 0x4;
    pub const RO_COMPAT_HUGE_FILE: u32 = 0x8;
    pub const RO_COMPAT_GDT_CSUM: u32 = 0x10;
    pub const RO_COMPAT_DIR_NLINK: u32 = 0x20;
    pub const RO_COMPAT_EXTRA_ISIZE: u32 = 0x40;
    pub const RO_COMPAT_HAS_SNAPSHOT: u32 = 0x80;
    pub const RO_COMPAT_QUOTA: u32 = 0x100;
    pub const RO_COMPAT_BIGALLOC: u32 = 0x200;
    pub const RO_COMPAT_METADATA_CSUM: u32 = 0x400;
    pub const RO_COMPAT_REPLICA: u32 = 0x800;
    pub const RO_COMPAT_READONLY: u32 = 0x1000;
    pub const RO_COMPAT_PROJECT: u32 = 0x2000;
    pub const RO_COMPAT_SHARED_BLOCKS: u32 = 0x4000;
    pub const RO_COMPAT_VERITY: u32 = 0x8000;
    pub const RO_COMPAT_ORPHAN_PRESENT: u32 = 0x10000;

    /// e2fsprogs' names for the bits, for messages.
    pub const INCOMPAT_NAMES: &[(u32, &str)] = &[
        (INCOMPAT_COMPRESSION, "compression"),
        (INCOMPAT_FILETYPE, "filetype"),
        (INCOMPAT_RECOVER, "needs_recovery"),
        (INCOMPAT_JOURNAL_DEV, "journal_dev"),
        (INCOMPAT_META_BG, "meta_bg"),
        (INCOMPAT_EXTENTS, "extent"),
        (INCOMPAT_64BIT, "64bit"),
        (INCOMPAT_MMP, "mmp"),
        (INCOMPAT_FLEX_BG, "flex_bg"),
        (INCOMPAT_EA_INODE, "ea_inode"),
        (INCOMPAT_DIRDATA, "dirdata"),
        (INCOMPAT_CSUM_SEED, "metadata_csum_seed"),
        (INCOMPAT_LARGEDIR, "large_dir"),
        (INCOMPAT_INLINE_DATA, "inline_data"),
        (INCOMPAT_ENCRYPT, "encrypt"),
        (INCOMPAT_CASEFOLD, "casefold"),
    ];
    pub const RO_COMPAT_NAMES: &[(u32, &str)] = &[
        (RO_COMPAT_SPARSE_SUPER, "sparse_super"),
        (RO_COMPAT_LARGE_FILE, "large_file"),
        (RO_COMPAT_BTREE_DIR, "btree_dir"),
        (RO_COMPAT_HUGE_FILE, "huge_file"),
        (RO_COMPAT_GDT_CSUM, "uninit_bg"),
        (RO_COMPAT_DIR_NLINK, "dir_nlink"),
        (RO_COMPAT_EXTRA_ISIZE, "extra_isize"),
        (RO_COMPAT_HAS_SNAPSHOT, "snapshot"),
        (RO_COMPAT_QUOTA, "quota"),
        (RO_COMPAT_BIGALLOC, "bigalloc"),
        (RO_COMPAT_METADATA_CSUM, "metadata_csum"),
        (RO_COMPAT_REPLICA, "replica"),
        (RO_COMPAT_READONLY, "read-only"),
        (RO_COMPAT_PROJECT, "project"),
        (RO_COMPAT_SHARED_BLOCKS, "shared_blocks"),
        (RO_COMPAT_VERITY, "verity"),
        (RO_COMPAT_ORPHAN_PRESENT, "orphan_present"),
    ];
    pub const COMPAT_NAMES: &[(u32, &str)] = &[
        (COMPAT_DIR_PREALLOC, "dir_prealloc"),
        (COMPAT_IMAGIC_INODES, "imagic_inodes"),
        (COMPAT_HAS_JOURNAL, "has_journal"),
        (COMPAT_EXT_ATTR, "ext_attr"),
        (COMPAT_RESIZE_INODE, "resize_inode"),
        (COMPAT_DIR_INDEX, "dir_index"),
        (0x40, "lazy_bg"),
        (0x80, "exclude_inode"),
        (0x100, "exclude_bitmap"),
        (COMPAT_SPARSE_SUPER2, "sparse_super2"),
        (COMPAT_FAST_COMMIT, "fast_commit"),
        (COMPAT_STABLE_INODES, "stable_inodes"),
        (COMPAT_ORPHAN_FILE, "orphan_file"),
    ];

    /// Names of the bits set in `bits`; unnamed bits as `FEATURE_X0x...`.
    pub fn names(bits: u32, table: &[(u32, &str)], prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        for i in 0..32 {
            let b = 1u32 << i;
            if bits & b == 0 {
                continue;
            }
            match table.iter().find(|(v, _)| *v == b) {
                Some((_, n)) => out.push((*n).to_string()),
                None => out.push(format!("FEATURE_{prefix}{i}")),
            }
        }
        out
    }
}
use feature::*;

/// Incompat features the engine can read and write.
pub const INCOMPAT_SUPPORTED: u32 = INCOMPAT_FILETYPE
    | INCOMPAT_RECOVER
    | INCOMPAT_META_BG
    | INCOMPAT_EXTENTS
    | INCOMPAT_64BIT
    | INCOMPAT_MMP
    | INCOMPAT_FLEX_BG
    | INCOMPAT_CSUM_SEED
    | INCOMPAT_LARGEDIR
    | INCOMPAT_EA_INODE
    | INCOMPAT_CASEFOLD
    | INCOMPAT_INLINE_DATA;
/// ro_compat features the engine honours when writing; others force read-only.
pub const RO_COMPAT_SUPPORTED: u32 = RO_COMPAT_SPARSE_SUPER
    | RO_COMPAT_LARGE_FILE
    | RO_COMPAT_HUGE_FILE
    | RO_COMPAT_GDT_CSUM
    | RO_COMPAT_DIR_NLINK
    | RO_COMPAT_EXTRA_ISIZE
    | RO_COMPAT_METADATA_CSUM
    | RO_COMPAT_ORPHAN_PRESENT
    | RO_COMPAT_BIGALLOC;

/// The outcome of the feature gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureCheck {
    /// Unknown incompat features: the image must not be opened at all.
    pub unsupported_incompat: Vec<String>,
    /// Unknown ro_compat features: the image may be opened read-only.
    pub unsupported_ro_compat: Vec<String>,
}

/// The superblock fields rext4 uses. Counts are full 64-bit values (lo + hi merged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub inodes_count: u32,
    pub blocks_count: u64,
    pub r_blocks_count: u64,
    pub free_blocks_count: u64,
    pub free_inodes_count: u32,
    pub first_data_block: u32,
    pub log_block_size: u32,
    pub log_cluster_size: u32,
    pub blocks_per_group: u32,
    pub clusters_per_group: u32,
    pub inodes_per_group: u32,
    pub mtime: i64,
    pub wtime: i64,
    pub mnt_count: u16,
    pub max_mnt_count: i16,
    pub state: u16,
    pub errors: u16,
    pub minor_rev_level: u16,
    pub lastcheck: i64,
    pub checkinterval: u32,
    pub creator_os: u32,
    pub rev_level: u32,
    pub def_resuid: u16,
    pub def_resgid: u16,
    pub first_ino: u32,
    pub inode_size: u16,
    pub block_group_nr: u16,
    pub feature_compat: u32,
    pub feature_incompat: u32,
    pub feature_ro_compat: u32,
    pub uuid: [u8; 16],
    pub volume_name: [u8; 16],
    pub last_mounted: [u8; 64],
    pub reserved_gdt_blocks: u16,
    pub journal_uuid: [u8; 16],
    pub journal_inum: u32,
    pub journal_dev: u32,
    pub last_orphan: u32,
    pub hash_seed: [u32; 4],
    pub def_hash_version: u8,
    pub jnl_backup_type: u8,
    pub desc_size: u16,
    pub default_mount_opts: u32,
    pub first_meta_bg: u32,
    pub mkfs_time: i64,
    pub jnl_blocks: [u32; 17],
    pub min_extra_isize: u16,
    pub want_extra_isize: u16,
    pub flags: u32,
    pub raid_stride: u16,
    pub mmp_interval: u16,
    pub mmp_block: u64,
    pub raid_stripe_width: u32,
    pub log_groups_per_flex: u8,
    pub checksum_type: u8,
    pub kbytes_written: u64,
    pub error_count: u32,
    pub mount_opts: [u8; 64],
    pub usr_quota_inum: u32,
    pub grp_quota_inum: u32,
    pub overhead_clusters: u32,
    pub backup_bgs: [u32; 2],
    pub lpf_ino: u32,
    pub prj_quota_inum: u32,
    pub checksum_seed: u32,
    pub encoding: u16,
    /// `s_encoding_flags` (0x27E): [`crate::casefold::ENCODING_FLAG_STRICT`].
    pub encoding_flags: u16,
    pub orphan_file_inum: u32,
    pub checksum: u32,
}

/// s_flags bits.
pub const FLAG_SIGNED_HASH: u32 = 0x1;
pub const FLAG_UNSIGNED_HASH: u32 = 0x2;
/// s_state bits.
pub const STATE_VALID: u16 = 0x1;
pub const STATE_ERROR: u16 = 0x2;
pub const STATE_ORPHAN: u16 = 0x4;

fn time(buf: &[u8], lo: usize, hi: usize) -> i64 {
    // Superblock times are unsigned 32-bit seconds plus an 8-bit high byte.
    i64::from(le32(buf, lo)) | (i64::from(u8_at(buf, hi)) << 32)
}

fn set_time(buf: &mut [u8], lo: usize, hi: usize, t: i64) {
    set_le32(buf, lo, t as u32);
    set_u8(buf, hi, (t >> 32) as u8);
}

impl Superblock {
    /// Decode and verify 1024 superblock bytes.
    pub fn decode(buf: &[u8]) -> Result<Self> {
        need(buf, SB_SIZE, "superblock")?;
        let magic = le16(buf, 0x38);
        ensure(magic == MAGIC, || {
            format!("superblock magic {magic:#06x}, expected 0xef53")
        })?;
        let sb = Self::decode_unchecked(buf);
        sb.check_geometry()?;
        // A checksum type without metadata_csum means the feature bit itself was
        // damaged: check the checksum then too, so that flip is caught.
        if sb.has_ro_compat(RO_COMPAT_METADATA_CSUM) || sb.checksum_type != 0 {
            ensure(sb.checksum_type == 1, || {
                format!(
                    "superblock checksum type {} is not crc32c",
                    sb.checksum_type
                )
            })?;
            let want = Self::compute_csum(buf);
            ensure(want == sb.checksum, || {
                format!(
                    "superblock checksum {:#010x}, computed {want:#010x}",
                    sb.checksum
                )
            })?;
        }
        Ok(sb)
    }

    /// Decode fields without any checks (for tools that print damaged superblocks).
    pub fn decode_unchecked(b: &[u8]) -> Self {
        let mut hash_seed = [0u32; 4];
        for (i, h) in hash_seed.iter_mut().enumerate() {
            *h = le32(b, 0xEC + 4 * i);
        }
        let mut jnl_blocks = [0u32; 17];
        for (i, j) in jnl_blocks.iter_mut().enumerate() {
            *j = le32(b, 0x10C + 4 * i);
        }
        let is64 = le32(b, 0x60) & INCOMPAT_64BIT != 0;
        let hi = |off: usize| if is64 { le32(b, off) } else { 0 };
        Superblock {
            inodes_count: le32(b, 0x0),
            blocks_count: lohi(le32(b, 0x4), hi(0x150)),
            r_blocks_count: lohi(le32(b, 0x8), hi(0x154)),
            free_blocks_count: lohi(le32(b, 0xC), hi(0x158)),
            free_inodes_count: le32(b, 0x10),
            first_data_block: le32(b, 0x14),
            log_block_size: le32(b, 0x18),
            log_cluster_size: le32(b, 0x1C),
            blocks_per_group: le32(b, 0x20),
            clusters_per_group: le32(b, 0x24),
            inodes_per_group: le32(b, 0x28),
            mtime: time(b, 0x2C, 0x275),
            wtime: time(b, 0x30, 0x274),
            mnt_count: le16(b, 0x34),
            max_mnt_count: le16(b, 0x36) as i16,
            state: le16(b, 0x3A),
            errors: le16(b, 0x3C),
            minor_rev_level: le16(b, 0x3E),
            lastcheck: time(b, 0x40, 0x277),
            checkinterval: le32(b, 0x44),
            creator_os: le32(b, 0x48),
            rev_level: le32(b, 0x4C),
            def_resuid: le16(b, 0x50),
            def_resgid: le16(b, 0x52),
            first_ino: if le32(b, 0x4C) == 0 {
                11
            } else {
                le32(b, 0x54)
            },
            inode_size: if le32(b, 0x4C) == 0 {
                128
            } else {
                le16(b, 0x58)
            },
            block_group_nr: le16(b, 0x5A),
            feature_compat: le32(b, 0x5C),
            feature_incompat: le32(b, 0x60),
            feature_ro_compat: le32(b, 0x64),
            uuid: arr(b, 0x68),
            volume_name: arr(b, 0x78),
            last_mounted: arr(b, 0x88),
            reserved_gdt_blocks: le16(b, 0xCE),
            journal_uuid: arr(b, 0xD0),
            journal_inum: le32(b, 0xE0),
            journal_dev: le32(b, 0xE4),
            last_orphan: le32(b, 0xE8),
            hash_seed,
            def_hash_version: u8_at(b, 0xFC),
            jnl_backup_type: u8_at(b, 0xFD),
            desc_size: le16(b, 0xFE),
            default_mount_opts: le32(b, 0x100),
            first_meta_bg: le32(b, 0x104),
            mkfs_time: time(b, 0x108, 0x276),
            jnl_blocks,
            min_extra_isize: le16(b, 0x15C),
            want_extra_isize: le16(b, 0x15E),
            flags: le32(b, 0x160),
            raid_stride: le16(b, 0x164),
            mmp_interval: le16(b, 0x166),
            mmp_block: le64(b, 0x168),
            raid_stripe_width: le32(b, 0x170),
            log_groups_per_flex: u8_at(b, 0x174),
            checksum_type: u8_at(b, 0x175),
            kbytes_written: le64(b, 0x178),
            error_count: le32(b, 0x194),
            mount_opts: arr(b, 0x200),
            usr_quota_inum: le32(b, 0x240),
            grp_quota_inum: le32(b, 0x244),
            overhead_clusters: le32(b, 0x248),
            backup_bgs: [le32(b, 0x24C), le32(b, 0x250)],
            lpf_ino: le32(b, 0x268),
            prj_quota_inum: le32(b, 0x26C),
            checksum_seed: le32(b, 0x270),
            encoding: le16(b, 0x27C),
            encoding_flags: le16(b, 0x27E),
            orphan_file_inum: le32(b, 0x280),
            checksum: le32(b, CSUM_OFF),
        }
    }

    /// Checks that make the rest of the engine's arithmetic safe.
    fn check_geometry(&self) -> Result<()> {
        ensure(self.log_block_size <= 6, || {
            format!("block size 2^(10+{}) is out of range", self.log_block_size)
        })?;
        let bs = self.block_size();
        if self.has_ro_compat(RO_COMPAT_BIGALLOC) {
            // Clusters of 2^0..2^16 blocks, at most 2^30 bytes (the kernel's
            // EXT4_MAX_CLUSTER_LOG_SIZE); the bitmap holds a bit per cluster.
            ensure(
                self.log_cluster_size >= self.log_block_size
                    && self.log_cluster_size - self.log_block_size <= 16
                    && self.log_cluster_size <= 20,
                || {
                    format!(
                        "cluster size 2^(10+{}) is out of range for block size {bs}",
                        self.log_cluster_size
                    )
                },
            )?;
            ensure(
                self.clusters_per_group >= 8
                    && self.clusters_per_group <= bs * 8
                    && self.clusters_per_group.is_multiple_of(8),
                || {
                    format!(
                        "clusters per group {} out of range for block size {bs}",
                        self.clusters_per_group
                    )
                },
            )?;
            ensure(
                u64::from(self.clusters_per_group) << self.cluster_bits()
                    == u64::from(self.blocks_per_group),
                || {
                    format!(
                        "blocks per group {} is not clusters per group {} x {}",
                        self.blocks_per_group,
                        self.clusters_per_group,
                        self.cluster_ratio()
                    )
                },
            )?;
            // Cluster arithmetic counts from block 0 (mke2fs makes it so).
            ensure(self.first_data_block == 0, || {
                format!(
                    "first data block {} with bigalloc (must be 0)",
                    self.first_data_block
                )
            })?;
        } else {
            ensure(
                self.blocks_per_group >= 8 && self.blocks_per_group <= bs * 8,
                || {
                    format!(
                        "blocks per group {} out of range for block size {bs}",
                        self.blocks_per_group
                    )
                },
            )?;
        }
        ensure(self.blocks_per_group.is_multiple_of(8), || {
            "blocks per group not a multiple of 8".into()
        })?;
        ensure(
            self.inodes_per_group >= 1 && self.inodes_per_group <= bs * 8,
            || format!("inodes per group {} out of range", self.inodes_per_group),
        )?;
        let isz = u32::from(self.inode_size);
        ensure(isz >= 128 && isz <= bs && isz.is_power_of_two(), || {
            format!("inode size {isz} invalid")
        })?;
        let want_first = u32::from(bs == 1024 && !self.has_ro_compat(RO_COMPAT_BIGALLOC));
        ensure(self.first_data_block == want_first, || {
            format!(
                "first data block {} wrong for block size {bs}",
                self.first_data_block
            )
        })?;
        ensure(self.blocks_count > u64::from(self.first_data_block), || {
            format!("blocks count {} too small", self.blocks_count)
        })?;
        let groups = self.group_count();
        let want_inodes = groups.checked_mul(u64::from(self.inodes_per_group));
        ensure(want_inodes == Some(u64::from(self.inodes_count)), || {
            format!(
                "inodes count {} != {} groups x {} inodes per group",
                self.inodes_count, groups, self.inodes_per_group
            )
        })?;
        if self.has_incompat(INCOMPAT_64BIT) {
            ensure(
                self.desc_size >= 64 && self.desc_size <= 1024 && self.desc_size.is_power_of_two(),
                || format!("descriptor size {} invalid", self.desc_size),
            )?;
        }
        ensure(
            self.first_ino >= 11 && self.first_ino < self.inodes_count,
            || format!("first inode {} invalid", self.first_ino),
        )?;
        if self.has_ro_compat(RO_COMPAT_EXTRA_ISIZE) || isz > 128 {
            ensure(u32::from(self.min_extra_isize) <= isz - 128, || {
                "min_extra_isize too big".into()
            })?;
        }
        ensure(self.free_inodes_count <= self.inodes_count, || {
            format!(
                "free inodes {} > inodes {}",
                self.free_inodes_count, self.inodes_count
            )
        })?;
        ensure(self.free_blocks_count <= self.blocks_count, || {
            format!(
                "free blocks {} > blocks {}",
                self.free_blocks_count, self.blocks_count
            )
        })
    }

    /// Write the modelled fields into `buf` (a copy of the original 1024 bytes) and
    /// refresh the checksum when metadata_csum is on.
    pub fn encode_into(&self, b: &mut [u8]) {
        let is64 = self.has_incompat(INCOMPAT_64BIT);
        set_le32(b, 0x0, self.inodes_count);
        set_le32(b, 0x4, self.blocks_count as u32);
        set_le32(b, 0x8, self.r_blocks_count as u32);
        set_le32(b, 0xC, self.free_blocks_count as u32);
        if is64 {
            set_le32(b, 0x150, (self.blocks_count >> 32) as u32);
            set_le32(b, 0x154, (self.r_blocks_count >> 32) as u32);
            set_le32(b, 0x158, (self.free_blocks_count >> 32) as u32);
        }
        set_le32(b, 0x10, self.free_inodes_count);
        set_le32(b, 0x14, self.first_data_block);
        set_le32(b, 0x18, self.log_block_size);
        set_le32(b, 0x1C, self.log_cluster_size);
        set_le32(b, 0x20, self.blocks_per_group);
        set_le32(b, 0x24, self.clusters_per_group);
        set_le32(b, 0x28, self.inodes_per_group);
        set_time(b, 0x2C, 0x275, self.mtime);
        set_time(b, 0x30, 0x274, self.wtime);
        set_le16(b, 0x34, self.mnt_count);
        set_le16(b, 0x36, self.max_mnt_count as u16);
        set_le16(b, 0x38, MAGIC);
        set_le16(b, 0x3A, self.state);
        set_le16(b, 0x3C, self.errors);
        set_le16(b, 0x3E, self.minor_rev_level);
        set_time(b, 0x40, 0x277, self.lastcheck);
        set_le32(b, 0x44, self.checkinterval);
        set_le32(b, 0x48, self.creator_os);
        set_le32(b, 0x4C, self.rev_level);
        set_le16(b, 0x50, self.def_resuid);
        set_le16(b, 0x52, self.def_resgid);
        set_le32(b, 0x54, self.first_ino);
        set_le16(b, 0x58, self.inode_size);
        set_le16(b, 0x5A, self.block_group_nr);
        set_le32(b, 0x5C, self.feature_compat);
        set_le32(b, 0x60, self.feature_incompat);
        set_le32(b, 0x64, self.feature_ro_compat);
        put(b, 0x68, &self.uuid);
        put(b, 0x78, &self.volume_name);
        put(b, 0x88, &self.last_mounted);
        set_le16(b, 0xCE, self.reserved_gdt_blocks);
        put(b, 0xD0, &self.journal_uuid);
        set_le32(b, 0xE0, self.journal_inum);
        set_le32(b, 0xE4, self.journal_dev);
        set_le32(b, 0xE8, self.last_orphan);
        for (i, h) in self.hash_seed.iter().enumerate() {
            set_le32(b, 0xEC + 4 * i, *h);
        }
        set_u8(b, 0xFC, self.def_hash_version);
        set_u8(b, 0xFD, self.jnl_backup_type);
        set_le16(b, 0xFE, self.desc_size);
        set_le32(b, 0x100, self.default_mount_opts);
        set_le32(b, 0x104, self.first_meta_bg);
        set_time(b, 0x108, 0x276, self.mkfs_time);
        for (i, j) in self.jnl_blocks.iter().enumerate() {
            set_le32(b, 0x10C + 4 * i, *j);
        }
        set_le16(b, 0x15C, self.min_extra_isize);
        set_le16(b, 0x15E, self.want_extra_isize);
        set_le32(b, 0x160, self.flags);
        set_le16(b, 0x164, self.raid_stride);
        set_le16(b, 0x166, self.mmp_interval);
        set_le64(b, 0x168, self.mmp_block);
        set_le32(b, 0x170, self.raid_stripe_width);
        set_u8(b, 0x174, self.log_groups_per_flex);
        set_u8(b, 0x175, self.checksum_type);
        set_le64(b, 0x178, self.kbytes_written);
        set_le32(b, 0x194, self.error_count);
        put(b, 0x200, &self.mount_opts);
        set_le32(b, 0x240, self.usr_quota_inum);
        set_le32(b, 0x244, self.grp_quota_inum);
        set_le32(b, 0x248, self.overhead_clusters);
        set_le32(b, 0x24C, self.backup_bgs[0]);
        set_le32(b, 0x250, self.backup_bgs[1]);
        set_le32(b, 0x268, self.lpf_ino);
        set_le32(b, 0x26C, self.prj_quota_inum);
        set_le32(b, 0x270, self.checksum_seed);
        set_le16(b, 0x27C, self.encoding);
        set_le16(b, 0x27E, self.encoding_flags);
        set_le32(b, 0x280, self.orphan_file_inum);
        if self.has_ro_compat(RO_COMPAT_METADATA_CSUM) {
            let c = Self::compute_csum(b);
            set_le32(b, CSUM_OFF, c);
        }
    }

    /// raw(~0, sb[0..0x3FC]).
    pub fn compute_csum(buf: &[u8]) -> u32 {
        csum::raw(!0, buf.get(..CSUM_OFF).unwrap_or(buf))
    }

    pub fn has_compat(&self, f: u32) -> bool {
        self.feature_compat & f != 0
    }
    pub fn has_incompat(&self, f: u32) -> bool {
        self.feature_incompat & f != 0
    }
    pub fn has_ro_compat(&self, f: u32) -> bool {
        self.feature_ro_compat & f != 0
    }
    pub fn metadata_csum(&self) -> bool {
        self.has_ro_compat(RO_COMPAT_METADATA_CSUM)
    }

    /// Which feature bits rext4 cannot honour.
    pub fn check_features(&self) -> FeatureCheck {
        FeatureCheck {
            unsupported_incompat: feature::names(
                self.feature_incompat & !INCOMPAT_SUPPORTED,
                INCOMPAT_NAMES,
                "I",
            ),
            unsupported_ro_compat: feature::names(
                self.feature_ro_compat & !RO_COMPAT_SUPPORTED,
                RO_COMPAT_NAMES,
                "R",
            ),
        }
    }

    pub fn block_size(&self) -> u32 {
        1024u32 << self.log_block_size.min(6)
    }
    /// log2 of the blocks in a cluster: 0 without bigalloc (a cluster is a block).
    pub fn cluster_bits(&self) -> u32 {
        if self.has_ro_compat(RO_COMPAT_BIGALLOC) {
            self.log_cluster_size
                .saturating_sub(self.log_block_size)
                .min(16)
        } else {
            0
        }
    }
    /// Blocks in a cluster (1 without bigalloc).
    pub fn cluster_ratio(&self) -> u64 {
        1u64 << self.cluster_bits()
    }
    /// Clusters in group `g` (the last group may be short): bits in its block bitmap.
    pub fn clusters_in_group(&self, g: u64) -> u64 {
        self.blocks_in_group(g).div_ceil(self.cluster_ratio())
    }
    pub fn group_count(&self) -> u64 {
        let data = self
            .blocks_count
            .saturating_sub(u64::from(self.first_data_block));
        data.div_ceil(u64::from(self.blocks_per_group.max(1)))
    }
    /// Size of a group descriptor on disk.
    pub fn desc_size(&self) -> usize {
        if self.has_incompat(INCOMPAT_64BIT) {
            usize::from(self.desc_size).max(32)
        } else {
            32
        }
    }
    pub fn descs_per_block(&self) -> u64 {
        (u64::from(self.block_size()) / self.desc_size() as u64).max(1)
    }
    /// Blocks taken by the group descriptor table.
    pub fn desc_blocks(&self) -> u64 {
        self.group_count().div_ceil(self.descs_per_block())
    }
    /// The checksum seed for every metadata checksum.
    pub fn csum_seed(&self) -> u32 {
        let seed = self
            .has_incompat(INCOMPAT_CSUM_SEED)
            .then_some(self.checksum_seed);
        csum::fs_seed(&self.uuid, seed)
    }
    /// Extra inode bytes beyond the 128-byte base that new inodes get.
    pub fn inode_extra_size(&self) -> u16 {
        if self.inode_size > 128 {
            self.want_extra_isize.max(32)
        } else {
            0
        }
    }

    /// Whether group `g` holds a superblock backup (sparse_super: 0, 1, powers of 3, 5, 7).
    pub fn group_has_super(&self, g: u64) -> bool {
        if self.has_compat(COMPAT_SPARSE_SUPER2) {
            return g == 0 || self.backup_bgs.iter().any(|&b| u64::from(b) == g && b != 0);
        }
        if g <= 1 || !self.has_ro_compat(RO_COMPAT_SPARSE_SUPER) {
            return true;
        }
        if g.is_multiple_of(2) {
            return false;
        }
        [3u64, 5, 7].iter().any(|&p| {
            let mut x = p;
            while x < g {
                x = match x.checked_mul(p) {
                    Some(v) => v,
                    None => return false,
                };
            }
            x == g
        })
    }

    /// First block of group `g`.
    pub fn group_first_block(&self, g: u64) -> u64 {
        u64::from(self.first_data_block)
            .saturating_add(g.saturating_mul(u64::from(self.blocks_per_group)))
    }

    /// Number of blocks in group `g` (the last group may be short).
    /// Blocks one group's inode table takes.
    pub fn inode_table_blocks(&self) -> u64 {
        (u64::from(self.inodes_per_group) * u64::from(self.inode_size))
            .div_ceil(u64::from(self.block_size()))
    }

    pub fn blocks_in_group(&self, g: u64) -> u64 {
        let first = self.group_first_block(g);
        self.blocks_count
            .saturating_sub(first)
            .min(u64::from(self.blocks_per_group))
    }

    /// Blocks at the start of group `g` taken by the superblock (or its backup) and
    /// group descriptors: with a backup, the classic table (all descriptor blocks and
    /// the reserved GDT blocks; under meta_bg only the first `first_meta_bg` blocks);
    /// under meta_bg, one descriptor block in the first, second and last group of each
    /// meta group from `first_meta_bg` on (after the backup, if any). As e2fsprogs'
    /// `ext2fs_super_and_bgd_loc2` counts them.
    pub fn group_base_meta_blocks(&self, g: u64) -> u64 {
        let sup = u64::from(self.group_has_super(g));
        let per = self.descs_per_block();
        let meta = self.has_incompat(INCOMPAT_META_BG);
        if !meta || g / per < u64::from(self.first_meta_bg) {
            if sup == 0 {
                return 0;
            }
            let old = if meta {
                u64::from(self.first_meta_bg)
            } else {
                self.desc_blocks()
            };
            // Group 0 of a 1 KiB-block bigalloc layout also holds the boot block.
            let boot =
                u64::from(g == 0) * (self.super_block_no() - u64::from(self.first_data_block));
            return boot + 1 + old + u64::from(self.reserved_gdt_blocks);
        }
        let r = g % per;
        sup + u64::from(r == 0 || r == 1 || r == per - 1)
    }

    /// The block holding the primary superblock: the first data block, except with
    /// 1 KiB blocks and bigalloc (first data block 0): block 1, block 0 being the boot
    /// block, which counts as the filesystem's too (e2fsprogs marks it used).
    pub fn super_block_no(&self) -> u64 {
        u64::from(self.first_data_block).max(u64::from(self.block_size() == 1024))
    }

    /// Physical block of group-descriptor block `i` (handles meta_bg).
    pub fn desc_block_location(&self, i: u64) -> u64 {
        let first_meta = u64::from(self.first_meta_bg);
        if !self.has_incompat(INCOMPAT_META_BG) || i < first_meta {
            return self.super_block_no().saturating_add(1).saturating_add(i);
        }
        // meta_bg: descriptor block i lives in the first group of its meta group.
        let g = i.saturating_mul(self.descs_per_block());
        self.group_first_block(g)
            .saturating_add(u64::from(self.group_has_super(g)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut b = vec![0u8; SB_SIZE];
        set_le16(&mut b, 0x38, MAGIC);
        set_le32(&mut b, 0x0, 2048);
        set_le32(&mut b, 0x4, 8192);
        set_le32(&mut b, 0x14, 1);
        set_le32(&mut b, 0x20, 8192);
        set_le32(&mut b, 0x24, 8192);
        set_le32(&mut b, 0x28, 2048);
        set_le32(&mut b, 0x4C, 1);
        set_le32(&mut b, 0x54, 11);
        set_le16(&mut b, 0x58, 256);
        set_le32(
            &mut b,
            0x64,
            RO_COMPAT_METADATA_CSUM | RO_COMPAT_SPARSE_SUPER,
        );
        set_le32(&mut b, 0x60, INCOMPAT_64BIT | INCOMPAT_EXTENTS);
        set_le16(&mut b, 0xFE, 64);
        set_u8(&mut b, 0x175, 1);
        let c = Superblock::compute_csum(&b);
        set_le32(&mut b, CSUM_OFF, c);
        b
    }

    /// `sample` as a bigalloc layout: 16 KiB clusters of 1 KiB blocks, 512 clusters
    /// per group, first data block 0; `f` changes it before the checksum is set.
    fn bigalloc_sample(f: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let mut b = sample();
        set_le32(
            &mut b,
            0x64,
            RO_COMPAT_METADATA_CSUM | RO_COMPAT_SPARSE_SUPER | RO_COMPAT_BIGALLOC,
        );
        set_le32(&mut b, 0x14, 0);
        set_le32(&mut b, 0x1C, 4);
        set_le32(&mut b, 0x24, 512);
        f(&mut b);
        let c = Superblock::compute_csum(&b);
        set_le32(&mut b, CSUM_OFF, c);
        b
    }

    #[test]
    fn bigalloc_geometry() {
        let sb = Superblock::decode(&bigalloc_sample(|_| {})).expect("valid");
        assert_eq!((sb.cluster_bits(), sb.cluster_ratio()), (4, 16));
        assert_eq!(sb.clusters_in_group(0), 512);
        // 1 KiB blocks, first data block 0: the superblock in block 1 and the
        // descriptors after it; group 0's base (boot block, superblock, table).
        assert_eq!(sb.super_block_no(), 1);
        assert_eq!(sb.desc_block_location(0), 2);
        assert_eq!(sb.group_base_meta_blocks(0), 3);
        // Without bigalloc a cluster is a block whatever the field holds.
        let plain = Superblock::decode(&sample()).expect("valid");
        assert_eq!(
            (plain.cluster_bits(), plain.clusters_in_group(0)),
            (0, 8191)
        );
        for (what, bad) in [
            (
                "blocks per group not clusters x ratio",
                bigalloc_sample(|b| set_le32(b, 0x24, 256)),
            ),
            (
                "cluster smaller than a block",
                bigalloc_sample(|b| {
                    set_le32(b, 0x18, 2);
                    set_le32(b, 0x1C, 1);
                }),
            ),
            (
                "cluster of 2^17 blocks",
                bigalloc_sample(|b| set_le32(b, 0x1C, 17)),
            ),
            (
                "first data block 1",
                bigalloc_sample(|b| set_le32(b, 0x14, 1)),
            ),
        ] {
            assert!(Superblock::decode(&bad).is_err(), "{what} accepted");
        }
    }

    #[test]
    fn decode_encode_round_trip_keeps_every_byte() {
        let b = sample();
        let sb = Superblock::decode(&b).expect("valid");
        assert_eq!(sb.block_size(), 1024);
        assert_eq!(sb.group_count(), 1);
        let mut out = b.clone();
        sb.encode_into(&mut out);
        assert_eq!(out, b);
    }

    #[test]
    fn every_single_bit_flip_is_caught() {
        let b = sample();
        for bit in 0..SB_SIZE * 8 {
            let mut m = b.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert!(Superblock::decode(&m).is_err(), "bit {bit} flip accepted");
        }
    }

    #[test]
    fn sparse_super_backup_groups() {
        let sb = Superblock::decode(&sample()).expect("valid");
        let with: Vec<u64> = (0..100).filter(|&g| sb.group_has_super(g)).collect();
        assert_eq!(with, vec![0, 1, 3, 5, 7, 9, 25, 27, 49, 81]);
    }

    #[test]
    fn unknown_features_are_named() {
        let mut b = sample();
        set_le32(
            &mut b,
            0x60,
            INCOMPAT_64BIT | INCOMPAT_ENCRYPT | 0x8000_0000,
        );
        let sb = Superblock::decode_unchecked(&b);
        let fc = sb.check_features();
        assert_eq!(fc.unsupported_incompat, vec!["encrypt", "FEATURE_I31"]);
    }

    #[test]
    fn garbage_never_panics() {
        let mut x: u64 = 0x1234_5678;
        for _ in 0..2000 {
            let mut b = sample();
            for _ in 0..8 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % b.len();
                b[i] = (x >> 32) as u8;
            }
            let sb = Superblock::decode_unchecked(&b);
            let _ = (
                sb.group_count(),
                sb.desc_blocks(),
                sb.csum_seed(),
                sb.desc_block_location(3),
            );
            let _ = Superblock::decode(&b);
        }
    }
}
