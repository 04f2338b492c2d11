//! # rext4: a userspace ext4 engine
//!
//! The embedding API follows `std::fs`: [`Fs::open`] an image, then
//! [`Fs::metadata`], [`Fs::read_dir`], [`Fs::read_link`], [`Fs::open_file`] and
//! [`File::read_at`], [`Fs::xattrs`]. Inode-level calls (`*_ino`) serve frontends that
//! work by inode number (FUSE).
//!
//! Layers, top to bottom (the table in docs/ARCHITECTURE.md, checked by
//! `tests/layers.rs`):
//! - `path`: path resolution and the path API; `dir`: linear and htree directories;
//!   `file`: metadata and file reads; `perm`: permission checks; `xattr`: extended
//!   attributes; `orphan`: pins and orphans;
//! - `ops`: operations by inode number; `alloc`: block and inode allocators; `atime`,
//!   `acl`, `check`;
//! - `fs`: the filesystem core — superblock, feature gate, group descriptors, inode
//!   records, transactions and commits (`fs::jwrite`), logical→physical mapping
//!   (`fs::map`), inode writes (`fs::inode_write`), file data pages
//!   (`fs::pagecache`), space promises (`fs::space`), DAX file I/O (`fs::dax_file`);
//! - `cache`: metadata buffers, verified on read; `journal`: jbd2 log reading and
//!   replay; `mkfs`;
//! - `device`: the `BlockDevice` seam (file, memory) and `device::dax`, a
//!   memory-mapped image, partitions and offsets (`device::window`), qcow2;
//!   `image`: image specs (`IMAGE?partition=N`, `?offset=BYTES`), opened as devices; `icache`/`grace`: inode and dentry caches (lock-free hits),
//!   inode reuse grace; `dir_write`/`extent_write`: the directory and extent-tree
//!   algorithms, written against `store`'s seams;
//! - `claim`: keeps other users away from an image opened by path (loop devices,
//!   mounts, other rext4 processes); `lockdep`: the lock order, checked in debug
//!   builds; `repro`: `SOURCE_DATE_EPOCH` and seed-derived values; `error`.
//!
//! Warnings the engine cannot return to a caller (a writeback that failed in the
//! background) go through the `log` crate; the embedding program routes them.
//!
//! Metadata readers take no lock but a buffer cache shard's mutex (never held across
//! I/O); namespace and attribute changes and writeback run as concurrent handles under
//! inode locks, truncate, fallocate and writes that allocate at once serialize on
//! `Fs::write_lock`; file data takes the inode's
//! I/O lock (shared for reads and writes inside the file). The lock order is in
//! docs/ARCHITECTURE.md. An image whose journal needs recovery is replayed at open (in
//! memory for read-only opens). Call [`Fs::close`] at the end: it writes the page cache
//! back, commits and marks the image clean (dropping the last handle does it too, but
//! cannot report errors).

mod acl;
pub mod alloc;
pub mod atime;
pub mod blockmap_write;
pub mod cache;
pub mod check;
pub mod claim;
pub mod device;
pub use device::dax;
pub mod dir;
pub mod dir_write;
pub mod error;
pub mod extent_write;
mod fc_replay;
pub mod file;
pub mod fs;
pub use fs::{inode_write, map, pagecache};
pub mod grace;
pub mod icache;
pub mod image;
mod inline;
pub mod inthash;
pub mod journal;
mod lockdep;
pub mod mkfs;
mod mmp;
pub mod ops;
pub mod orphan;
pub mod path;
pub mod perm;
pub mod repro;
pub mod resize;
pub mod store;
pub mod striped;
pub mod xattr;

pub use atime::{AtimeMode, AtimePolicy};
pub use check::{Audit, MetaKind};
pub use claim::Claim;
pub use dir::DirEntry;
pub use error::{Error, Result};
pub use fc_replay::FcReplay;
pub use file::{File, FileType, Metadata};
pub use fs::pagecache::mapping::MappedRange;
pub use fs::pagecache::rw::Whence;
pub use fs::pagecache::PageCacheStats;
pub use fs::space::{act_as_privileged, spend_held, HeldGuard, PrivilegeGuard};
pub use fs::{Errors, Fs, FsOptions, Ino, JournalStats};
pub use image::ImageSpec;
pub use ops::{FallocMode, RenameFlags, SetAttr, StatFs};
pub use path::OpenOptions;
pub use perm::Creds;
pub use rext4_format as format;
pub use rext4_format::inode::Timestamp;
pub use store::Mapping;
pub use xattr::XattrFlags;
