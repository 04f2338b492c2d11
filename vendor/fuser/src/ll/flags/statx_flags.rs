//! statx(2) flags (rext4 addition, under upstream fuser's names; see VENDOR.md).

use bitflags::bitflags;

bitflags! {
    /// The `STATX_*` fields of a statx(2) call (`stx_mask`): what the caller asked for,
    /// as [`crate::Filesystem::statx`] receives it. The fields a reply fills in follow
    /// from the [`crate::StatxAttr`] it is given.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct StatxMask: u32 {
        /// The file type bits of `stx_mode`.
        const TYPE = 1 << 0;
        /// The permission bits of `stx_mode`.
        const MODE = 1 << 1;
        /// `stx_nlink`.
        const NLINK = 1 << 2;
        /// `stx_uid`.
        const UID = 1 << 3;
        /// `stx_gid`.
        const GID = 1 << 4;
        /// `stx_atime`.
        const ATIME = 1 << 5;
        /// `stx_mtime`.
        const MTIME = 1 << 6;
        /// `stx_ctime`.
        const CTIME = 1 << 7;
        /// `stx_ino`.
        const INO = 1 << 8;
        /// `stx_size`.
        const SIZE = 1 << 9;
        /// `stx_blocks`.
        const BLOCKS = 1 << 10;
        /// The fields stat(2) has too.
        const BASIC_STATS = 0x7ff;
        /// `stx_btime`, the creation time.
        const BTIME = 1 << 11;
    }
}

bitflags! {
    /// `STATX_ATTR_*` properties of a file (`stx_attributes`, `stx_attributes_mask`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct StatxAttributes: u64 {
        /// Compressed by the filesystem.
        const COMPRESSED = 1 << 2;
        /// Immutable (`chattr +i`).
        const IMMUTABLE = 1 << 4;
        /// Append-only (`chattr +a`).
        const APPEND = 1 << 5;
        /// Not to be dumped (`chattr +d`).
        const NODUMP = 1 << 6;
        /// Encrypted by the filesystem.
        const ENCRYPTED = 1 << 11;
        /// An automount trigger.
        const AUTOMOUNT = 1 << 12;
        /// The root of a mount.
        const MOUNT_ROOT = 1 << 13;
        /// Protected by fs-verity.
        const VERITY = 1 << 20;
        /// In the DAX state.
        const DAX = 1 << 21;
    }
}
