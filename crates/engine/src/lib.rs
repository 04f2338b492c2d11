//! # rext4: a userspace ext4 engine
//!
//! The embedding API follows `std::fs`: [`Fs::open`] an image, then
//! [`Fs::metadata`], [`Fs::read_dir`], [`Fs::read_link`], [`Fs::open_file`] and
//! [`File::read_at`], [`Fs::xattrs`]. Inode-level calls (`*_ino`) serve frontends that
//! work by inode number (FUSE).
//!
//! Layers, top to bottom (see docs/ARCHITECTURE.md):
//! - `path`: path resolution and the path API; `file`: metadata and file reads;
//!   `dir`: linear and htree directories; `xattr`: extended attributes;
//! - `map`: logical→physical mapping (extent trees, block maps);
//! - `icache`/`grace`: inode and dentry caches (lock-free hits), inode reuse grace;
//! - `pagecache`: file data pages, delayed allocation, read-ahead, writeback;
//! - `fs`: superblock, feature gate, group descriptors, inode records;
//! - `cache`: metadata buffers, verified on read;
//! - `device`: the `BlockDevice` seam (file, memory); `dax`: a memory-mapped image
//!   (DAX: file data copied straight between the caller and the mapping), and
//!   `dax_file`: DAX file I/O, mappings of file blocks, the mapping lock, dirty
//!   records;
//! - `claim`: keeps other users away from an image opened by path (loop devices,
//!   mounts, other rext4 processes);
//! - `lockdep`: the lock order, checked in debug builds.
//!
//! Warnings the engine cannot return to a caller (a writeback that failed in the
//! background) go through the `log` crate; the embedding program routes them.
//!
//! Metadata readers take no lock but the buffer cache's map mutex (never held across
//! I/O); metadata writers serialize on `Fs::write_lock`; file data takes the inode's
//! I/O lock (shared for reads and writes inside the file). The lock order is in
//! docs/ARCHITECTURE.md. An image whose journal needs recovery is replayed at open (in
//! memory for read-only opens). Call [`Fs::close`] at the end: it writes the page cache
//! back, commits and marks the image clean (dropping the last handle does it too, but
//! cannot report errors).

mod acl;
pub mod alloc;
pub mod atime;
pub mod cache;
pub mod check;
pub mod claim;
pub mod dax;
mod dax_file;
pub mod device;
pub mod dir;
pub mod dir_write;
pub mod error;
pub mod extent_write;
pub mod file;
pub mod fs;
pub mod grace;
pub mod icache;
pub mod inode_write;
pub mod journal;
mod jwrite;
mod lockdep;
pub mod map;
pub mod mkfs;
pub mod ops;
pub mod orphan;
pub mod pagecache;
pub mod path;
pub mod perm;
mod space;
pub mod store;
pub mod xattr;

pub use atime::{AtimeMode, AtimePolicy};
pub use check::{Audit, MetaKind};
pub use claim::Claim;
pub use dir::DirEntry;
pub use error::{Error, Result};
pub use file::{File, FileType, Metadata};
pub use fs::{Errors, Fs, FsOptions, Ino, JournalStats};
pub use map::Mapping;
pub use ops::{FallocMode, RenameFlags, SetAttr, StatFs};
pub use pagecache::mapping::MappedRange;
pub use pagecache::rw::Whence;
pub use pagecache::PageCacheStats;
pub use path::OpenOptions;
pub use perm::Creds;
pub use rext4_format as format;
pub use rext4_format::inode::Timestamp;
pub use space::{act_as_privileged, PrivilegeGuard};
pub use xattr::XattrFlags;
