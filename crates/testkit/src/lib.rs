//! rext4-testkit: test-only helpers for the engine's and CLI's integration tests.
//!
//! Owns: images built with the real e2fsprogs tools (`mkfs`, `debugfs_*`), the e2fsck
//! oracle (`e2fsck_fn`: exit code 0 *and* nothing but pass lines in the output), kernel
//! loop mounts (`LoopMount`, released on drop even when a test panics), snapshots of
//! what the kernel sees (`snapshot_dir`, `diff_trees`, `ContentHasher`) and the standard
//! populated fixture (`populate_kernel`, `populate_debugfs`).
//! Must hold: no dependency on the engine (it would make the oracle depend on the thing
//! under test); every temp file, mount and loop device is released by a guard.
//! Tests that need root, loop devices, /dev/fuse or a tool call `can_loop_mount()` /
//! `LoopMount::new` (or their own check) and `skip(reason)` + return when they get
//! `Err`; `skip` is the only way a test skips, and with `REXT4_REQUIRE_ALL` set (CI) it
//! fails the test instead (`skip` module).

pub mod crash;
pub mod fixture;
pub mod mount;
pub mod nbd;
pub mod pmem;
pub mod skip;
pub mod tmp;
pub mod tools;
pub mod tree;

pub use fixture::{
    big_dir_name, fixture_bytes, fixture_shape, populate_debugfs, populate_kernel, Fixture,
};
pub use mount::{can_loop_mount, LoopDevice, LoopMount};
pub use nbd::NbdServer;
pub use skip::{require_all, skip, skip_without_capability, CAP_SYS_RESOURCE};
pub use tmp::{memory_dir, Image, TempDir};
pub use tools::{
    debugfs_r, debugfs_r_raw, debugfs_script, debugfs_w, debugfs_w_checked, dumpe2fs_h, e2fsck_fn,
    e2fsck_fy, e2fsck_with, extent_depth, htree_levels, image_block_size, mkfs, mkfs_at,
    upstream_conf_path, DebugfsOutput, FsckReport, MkfsOptions,
};
pub use tree::{
    diff_trees, read_xattrs, snapshot_dir, snapshot_node, tree_path, Compare, ContentHasher, Kind,
    Node, Tree,
};
