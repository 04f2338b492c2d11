//! Block-mapped (ext2/ext3 style) files and the resize inode 7 (format notes §2.11).
//!
//! Owns two pure pieces:
//! - the block-map geometry: which `i_block` slot (0..=11 direct, 12 IND, 13 DIND,
//!   14 TIND) and which indexes inside the indirect blocks lead to a logical block
//!   ([`map_path`]), and the little-endian `u32` entries of an indirect block
//!   ([`indirect_entries`]). The engine walks the chain with these to read any
//!   block-mapped file (no EXTENTS_FL), which in a mkfs 1.47 image is only inode 7;
//! - the expected contents of the resize inode's DIND block and of the reserved-GDT
//!   blocks it points at (each used as an IND block listing its backup copies), as
//!   e2fsck's `check_resize_inode` checks them, with verifiers that name the mismatch.
//!
//! Must hold: nothing here panics on any input; block numbers are 32-bit in block
//! maps, so an expected value that does not fit is reported, not truncated.
//!
//! Callers: the engine's read path for block-mapped inodes; fsck and the tests for the
//! resize inode (the engine treats inode 7 as read-only).

use crate::bytes::le32;
use crate::{FormatError, Result};

/// Number of `i_block` slots (60 bytes of le32).
pub const N_BLOCKS: usize = 15;
/// Slots 0..DIRECT_BLOCKS hold direct block numbers.
pub const DIRECT_BLOCKS: usize = 12;
/// Slot of the single-indirect block.
pub const IND_SLOT: usize = 12;
/// Slot of the double-indirect block (the resize inode uses only this one).
pub const DIND_SLOT: usize = 13;
/// Slot of the triple-indirect block.
pub const TIND_SLOT: usize = 14;
const _: () = assert!(TIND_SLOT + 1 == N_BLOCKS && N_BLOCKS * 4 == 60);

/// The resize inode's number.
pub const RESIZE_INO: u32 = 7;

/// Entries (le32 block numbers) in one indirect block of `bs` bytes.
#[inline]
pub fn addr_per_block(bs: u32) -> u32 {
    bs / 4
}

/// The le32 entries of an indirect block, in order (a trailing partial word is ignored).
pub fn indirect_entries(block: &[u8]) -> impl Iterator<Item = u32> + '_ {
    block.chunks_exact(4).map(|w| le32(w, 0))
}

/// The route from an inode's `i_block` to one logical block of a block-mapped file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapPath {
    /// `i_block` slot: 0..=11 direct, 12 IND, 13 DIND, 14 TIND.
    pub slot: usize,
    /// Number of indirect blocks to pass through (0 for direct, 1..=3).
    pub depth: usize,
    /// Entry index inside each indirect block, outermost first; only
    /// `indexes[..depth]` is meaningful (see [`MapPath::indexes`]).
    pub index_at_level: [u32; 3],
}

impl MapPath {
    /// The entry indexes to follow, outermost indirect block first.
    pub fn indexes(&self) -> &[u32] {
        self.index_at_level.get(..self.depth).unwrap_or(&[])
    }
}

/// Where logical block `logical` of a block-mapped file lives, for block size `bs`.
///
/// `None` when `bs` is not a power of two in 1024..=65536, or `logical` is past what the
/// map can address (past the TIND range, or ≥ 2^32 since ext4 logical blocks are u32).
pub fn map_path(logical: u64, bs: u32) -> Option<MapPath> {
    if !(1024..=65536).contains(&bs) || !bs.is_power_of_two() || logical > u64::from(u32::MAX) {
        return None;
    }
    let apb = u64::from(addr_per_block(bs));
    let mut rest = logical;
    if rest < DIRECT_BLOCKS as u64 {
        return Some(MapPath {
            slot: rest as usize,
            depth: 0,
            index_at_level: [0; 3],
        });
    }
    rest -= DIRECT_BLOCKS as u64;
    if rest < apb {
        return Some(MapPath {
            slot: IND_SLOT,
            depth: 1,
            index_at_level: [rest as u32, 0, 0],
        });
    }
    rest -= apb;
    if rest < apb * apb {
        let idx = [(rest / apb) as u32, (rest % apb) as u32, 0];
        return Some(MapPath {
            slot: DIND_SLOT,
            depth: 2,
            index_at_level: idx,
        });
    }
    rest -= apb * apb;
    if rest < apb * apb * apb {
        let idx = [
            (rest / (apb * apb)) as u32,
            ((rest / apb) % apb) as u32,
            (rest % apb) as u32,
        ];
        return Some(MapPath {
            slot: TIND_SLOT,
            depth: 3,
            index_at_level: idx,
        });
    }
    None
}

/// Groups other than 0 that hold superblock/GDT backups under sparse_super: 1 and the
/// powers of 3, 5 and 7 below `group_count`, ascending. Without sparse_super every
/// group does (pass `sparse_super = false`). sparse_super2 is not handled here.
pub fn backup_groups(group_count: u32, sparse_super: bool) -> Vec<u32> {
    if !sparse_super {
        return (1..group_count).collect();
    }
    let mut out = Vec::new();
    for base in [3u64, 5, 7] {
        let mut g = base;
        while g < u64::from(group_count) {
            out.push(g as u32);
            g *= base;
        }
    }
    if group_count > 1 {
        out.push(1);
    }
    out.sort_unstable();
    out
}

/// Geometry the resize inode depends on, as decoded from the superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResizeGeometry {
    /// Block size in bytes.
    pub bs: u32,
    /// s_first_data_block (1 on 1 KiB-block filesystems, else 0).
    pub first_data_block: u32,
    /// s_blocks_per_group.
    pub blocks_per_group: u32,
    /// Number of blocks the group descriptor table occupies.
    pub desc_blocks: u32,
    /// s_reserved_gdt_blocks.
    pub reserved_gdt_blocks: u32,
    /// Groups (other than 0) holding backups, ascending: see [`backup_groups`].
    pub backup_groups: Vec<u32>,
}

impl ResizeGeometry {
    /// Physical block of primary reserved-GDT block `j`: right after the superblock
    /// block and the GDT. A 1 KiB-block fs with first_data_block 0 (bigalloc) keeps
    /// its superblock in block 1, hence the extra block (e2fsck does the same).
    pub fn primary_reserved_gdt_block(&self, j: u32) -> Result<u32> {
        let extra = u64::from(self.bs == 1024 && self.first_data_block == 0);
        let blk = u64::from(self.first_data_block)
            + 1
            + extra
            + u64::from(self.desc_blocks)
            + u64::from(j);
        to_u32(blk)
    }

    /// DIND entry index that holds reserved-GDT block `j`.
    pub fn dind_index(&self, j: u32) -> usize {
        let apb = u64::from(addr_per_block(self.bs).max(1));
        ((u64::from(self.desc_blocks) + u64::from(j)) % apb) as usize
    }

    /// The full expected DIND block as `bs/4` entries: entry
    /// `(desc_blocks + j) % (bs/4)` = primary reserved-GDT block `j`, all others 0.
    pub fn expected_dind(&self) -> Result<Vec<u32>> {
        let apb = addr_per_block(self.bs) as usize;
        if self.reserved_gdt_blocks as usize > apb {
            return Err(FormatError::corrupted(format!(
                "reserved GDT blocks {} exceed the {apb} entries of a DIND block",
                self.reserved_gdt_blocks
            )));
        }
        let mut out = vec![0u32; apb];
        for j in 0..self.reserved_gdt_blocks {
            let blk = self.primary_reserved_gdt_block(j)?;
            if let Some(e) = out.get_mut(self.dind_index(j)) {
                *e = blk;
            }
        }
        Ok(out)
    }

    /// The expected contents of the IND block at primary reserved-GDT block `j`: its
    /// copy in each backup group, in [`ResizeGeometry::backup_groups`] order, then 0s.
    pub fn expected_ind(&self, j: u32) -> Result<Vec<u32>> {
        let apb = addr_per_block(self.bs) as usize;
        let primary = self.primary_reserved_gdt_block(j)?;
        if self.backup_groups.len() > apb {
            return Err(FormatError::corrupted(format!(
                "{} backup groups exceed the {apb} entries of a reserved GDT block",
                self.backup_groups.len()
            )));
        }
        let mut out = vec![0u32; apb];
        for (slot, &g) in out.iter_mut().zip(&self.backup_groups) {
            *slot = to_u32(u64::from(primary) + u64::from(g) * u64::from(self.blocks_per_group))?;
        }
        Ok(out)
    }

    /// Check the resize inode's DIND block: every reserved-GDT entry must point at its
    /// primary block. Other entries are not judged (e2fsck does not either).
    pub fn verify_dind(&self, block: &[u8]) -> Result<()> {
        let expected = self.expected_dind()?;
        check_len(block, self.bs, "resize inode DIND block")?;
        for j in 0..self.reserved_gdt_blocks {
            let idx = self.dind_index(j);
            let want = expected.get(idx).copied().unwrap_or(0);
            let have = le32(block, idx * 4);
            if have != want {
                return Err(FormatError::corrupted(format!(
                    "resize inode DIND entry {idx} (reserved GDT block {j}) is {have}, \
                     expected {want}"
                )));
            }
        }
        Ok(())
    }

    /// Check the reserved-GDT block `j` read as an IND block: its first entries list
    /// the block's backups, one per backup group. Later entries are not judged.
    pub fn verify_ind(&self, j: u32, block: &[u8]) -> Result<()> {
        let expected = self.expected_ind(j)?;
        check_len(block, self.bs, "resize inode reserved GDT block")?;
        for (i, (&want, have)) in expected
            .iter()
            .zip(indirect_entries(block))
            .take(self.backup_groups.len())
            .enumerate()
        {
            if have != want {
                return Err(FormatError::corrupted(format!(
                    "reserved GDT block {j} entry {i} (backup group {}) is {have}, expected {want}",
                    self.backup_groups.get(i).copied().unwrap_or(0)
                )));
            }
        }
        Ok(())
    }
}

fn to_u32(blk: u64) -> Result<u32> {
    u32::try_from(blk).map_err(|_| {
        FormatError::corrupted(format!("resize inode block {blk} does not fit in 32 bits"))
    })
}

fn check_len(block: &[u8], bs: u32, what: &'static str) -> Result<()> {
    crate::bytes::need(block, bs as usize, what)
}

/// Shared helpers for tests that build images with the real e2fsprogs tools
/// (used by the resize, xattr and orphan tests).
#[cfg(test)]
pub(crate) mod test_image {
    use crate::bytes::{le16, le32};
    use std::fs::OpenOptions;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A directory under the system temp dir, removed on drop.
    pub(crate) struct TempDir(PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> TempDir {
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "rext4-format-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("create temp dir");
            TempDir(p)
        }
        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Run a command, panic with its output unless it succeeds, return stdout.
    pub(crate) fn run(cmd: &mut Command) -> String {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// mkfs.ext4 a sparse image of `size` (e.g. "64M"). `upstream` selects the
    /// upstream 1.47.0 mke2fs.conf (orphan_file, metadata_csum_seed).
    pub(crate) fn mkfs(img: &Path, size: &str, args: &[&str], upstream: bool) {
        run(Command::new("truncate").arg("-s").arg(size).arg(img));
        let mut c = Command::new("mkfs.ext4");
        c.arg("-q").arg("-F").args(args).arg(img);
        if upstream {
            c.env("MKE2FS_CONFIG", rext4_testkit::upstream_conf_path());
        }
        run(&mut c);
    }

    pub(crate) fn debugfs(img: &Path, req: &str) -> String {
        run(Command::new("debugfs").arg("-R").arg(req).arg(img))
    }

    pub(crate) fn debugfs_w(img: &Path, req: &str) -> String {
        run(Command::new("debugfs")
            .arg("-w")
            .arg("-R")
            .arg(req)
            .arg(img))
    }

    /// `e2fsck -fn`: (clean, output). Clean = exit 0 and no complaint lines.
    pub(crate) fn e2fsck_clean(img: &Path) -> (bool, String) {
        // Only the superblock time checks off: this machine's clock can step back
        // between a mount and the check (the testkit's oracle does the same).
        let conf =
            std::env::temp_dir().join(format!("rext4-fmt-e2fsck-{}.conf", std::process::id()));
        let _ = std::fs::write(&conf, "[options]\n\tbroken_system_clock = 1\n");
        let out = Command::new("e2fsck")
            .env("E2FSCK_CONFIG", &conf)
            .arg("-fn")
            .arg(img)
            .output()
            .expect("spawn e2fsck");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let noisy = text.lines().any(|l| {
            let l = l.trim();
            !(l.is_empty()
                || l.starts_with("Pass ")
                || l.starts_with("e2fsck ")
                || l.contains("non-contiguous)"))
        });
        (out.status.success() && !noisy, text)
    }

    pub(crate) fn read_at(img: &Path, off: u64, len: usize) -> Vec<u8> {
        let mut f = std::fs::File::open(img).expect("open image");
        f.seek(SeekFrom::Start(off)).expect("seek");
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf).expect("read image");
        buf
    }

    pub(crate) fn write_at(img: &Path, off: u64, data: &[u8]) {
        let mut f = OpenOptions::new()
            .write(true)
            .open(img)
            .expect("open image rw");
        f.seek(SeekFrom::Start(off)).expect("seek");
        f.write_all(data).expect("write image");
    }

    /// The few superblock fields the tests need, read straight from the raw bytes.
    #[derive(Debug)]
    pub(crate) struct Sb {
        pub(crate) bs: u32,
        pub(crate) first_data_block: u32,
        pub(crate) blocks_per_group: u32,
        pub(crate) group_count: u32,
        pub(crate) desc_blocks: u32,
        pub(crate) reserved_gdt_blocks: u32,
        pub(crate) inode_size: u16,
        pub(crate) fs_seed: u32,
    }

    pub(crate) fn superblock(img: &Path) -> Sb {
        let sb = read_at(img, 1024, 1024);
        let bs = 1024u32 << le32(&sb, 0x18);
        let blocks = u64::from(le32(&sb, 0x4)) | (u64::from(le32(&sb, 0x150)) << 32);
        let first_data_block = le32(&sb, 0x14);
        let blocks_per_group = le32(&sb, 0x20);
        let group_count =
            (blocks - u64::from(first_data_block)).div_ceil(u64::from(blocks_per_group)) as u32;
        let incompat = le32(&sb, 0x60);
        let desc_size = if incompat & 0x80 != 0 {
            u32::from(le16(&sb, 0xFE))
        } else {
            32
        };
        let desc_blocks = (group_count * desc_size).div_ceil(bs);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&sb[0x68..0x78]);
        let seed = (incompat & 0x2000 != 0).then(|| le32(&sb, 0x270));
        Sb {
            bs,
            first_data_block,
            blocks_per_group,
            group_count,
            desc_blocks,
            reserved_gdt_blocks: u32::from(le16(&sb, 0xCE)),
            inode_size: le16(&sb, 0x58),
            fs_seed: crate::csum::fs_seed(&uuid, seed),
        }
    }

    /// Byte offset of inode `ino` in the image, from `debugfs imap`.
    pub(crate) fn inode_offset(img: &Path, ino: u32, bs: u32) -> u64 {
        let out = debugfs(img, &format!("imap <{ino}>"));
        let line = out
            .lines()
            .find(|l| l.contains("located at block"))
            .expect("imap output");
        let rest = line.split("located at block").nth(1).expect("block");
        let mut parts = rest.split(',');
        let blk: u64 = parts
            .next()
            .expect("blk")
            .trim()
            .parse()
            .expect("blk number");
        let off = parts
            .next()
            .expect("offset")
            .trim()
            .trim_start_matches("offset 0x");
        blk * u64::from(bs) + u64::from_str_radix(off, 16).expect("hex offset")
    }

    pub(crate) fn read_block(img: &Path, blk: u64, bs: u32) -> Vec<u8> {
        read_at(img, blk * u64::from(bs), bs as usize)
    }

    /// An ext4 loop mount, unmounted on drop.
    pub(crate) struct Mount(PathBuf);

    impl Mount {
        /// `Err` (the reason to skip) when the mount cannot be made here.
        pub(crate) fn new(img: &Path, dir: &Path) -> Result<Mount, String> {
            rext4_testkit::can_loop_mount()?;
            std::fs::create_dir_all(dir).map_err(|e| format!("mount point: {e}"))?;
            let out = Command::new("mount")
                .arg("-t")
                .arg("ext4")
                .arg("-o")
                .arg("loop")
                .arg(img)
                .arg(dir)
                .output()
                .map_err(|e| format!("cannot run mount: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "mount -o loop failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(Mount(dir.to_path_buf()))
        }
    }

    impl Drop for Mount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_image::*;
    use super::*;

    #[test]
    fn map_path_boundaries_4k() {
        let bs = 4096;
        let apb = 1024u64;
        let p = |l| map_path(l, bs).expect("mappable");
        assert_eq!(
            p(0),
            MapPath {
                slot: 0,
                depth: 0,
                index_at_level: [0; 3]
            }
        );
        assert_eq!(p(11).slot, 11);
        assert_eq!(p(11).indexes(), &[] as &[u32]);
        assert_eq!((p(12).slot, p(12).indexes()), (IND_SLOT, &[0u32][..]));
        let last_ind = 12 + apb - 1;
        assert_eq!(
            (p(last_ind).slot, p(last_ind).indexes()),
            (IND_SLOT, &[1023u32][..])
        );
        let first_dind = 12 + apb;
        assert_eq!(
            (p(first_dind).slot, p(first_dind).indexes()),
            (DIND_SLOT, &[0u32, 0][..])
        );
        assert_eq!(p(first_dind + apb).indexes(), &[1, 0]);
        let last_dind = first_dind + apb * apb - 1;
        assert_eq!(
            (p(last_dind).slot, p(last_dind).indexes()),
            (DIND_SLOT, &[1023u32, 1023][..])
        );
        let first_tind = last_dind + 1;
        assert_eq!(
            (p(first_tind).slot, p(first_tind).indexes()),
            (TIND_SLOT, &[0u32, 0, 0][..])
        );
        assert_eq!(p(first_tind + apb * apb + apb + 1).indexes(), &[1, 1, 1]);
        let last_tind = first_tind + apb * apb * apb - 1;
        assert_eq!(p(last_tind).indexes(), &[1023, 1023, 1023]);
        assert_eq!(map_path(last_tind + 1, bs), None);
    }

    #[test]
    fn map_path_boundaries_1k_and_limits() {
        let p = |l| map_path(l, 1024).expect("mappable");
        assert_eq!(p(12 + 255).indexes(), &[255]);
        assert_eq!(p(12 + 256).slot, DIND_SLOT);
        assert_eq!(p(12 + 256 + 256 * 256).slot, TIND_SLOT);
        assert_eq!(map_path(12 + 256 + 65536 + 256 * 256 * 256, 1024), None);
        // 64 KiB blocks: the TIND range is larger than 2^32, logical blocks are u32.
        assert!(map_path(u64::from(u32::MAX), 65536).is_some());
        assert_eq!(map_path(u64::from(u32::MAX) + 1, 65536), None);
        assert_eq!(map_path(0, 1000), None);
        assert_eq!(map_path(0, 512), None);
        assert_eq!(map_path(0, 131072), None);
    }

    #[test]
    fn backup_group_lists() {
        assert_eq!(backup_groups(8, true), vec![1, 3, 5, 7]);
        assert_eq!(
            backup_groups(128, true),
            vec![1, 3, 5, 7, 9, 25, 27, 49, 81, 125]
        );
        assert_eq!(backup_groups(1, true), Vec::<u32>::new());
        assert_eq!(backup_groups(4, false), vec![1, 2, 3]);
    }

    #[test]
    fn indirect_entries_reads_le32() {
        let b = [1, 0, 0, 0, 0, 1, 0, 0, 9];
        assert_eq!(indirect_entries(&b).collect::<Vec<_>>(), vec![1, 256]);
    }

    fn geometry(sb: &Sb) -> ResizeGeometry {
        ResizeGeometry {
            bs: sb.bs,
            first_data_block: sb.first_data_block,
            blocks_per_group: sb.blocks_per_group,
            desc_blocks: sb.desc_blocks,
            reserved_gdt_blocks: sb.reserved_gdt_blocks,
            backup_groups: backup_groups(sb.group_count, true),
        }
    }

    /// Read inode 7's i_block[13] from the raw image.
    fn resize_dind(img: &std::path::Path, sb: &Sb) -> u32 {
        let off = inode_offset(img, RESIZE_INO, sb.bs);
        let inode = read_at(img, off, usize::from(sb.inode_size));
        for s in 0..N_BLOCKS {
            let v = le32(&inode, 0x28 + 4 * s);
            assert_eq!(v != 0, s == DIND_SLOT, "i_block[{s}] = {v}");
        }
        le32(&inode, 0x28 + 4 * DIND_SLOT)
    }

    fn check_resize_inode(size: &str, args: &[&str], expect_wrap: bool) {
        let dir = TempDir::new("resize");
        let img = dir.path().join("fs.img");
        mkfs(&img, size, args, false);
        let sb = superblock(&img);
        let geo = geometry(&sb);
        assert!(geo.reserved_gdt_blocks > 0);
        let wraps = geo.desc_blocks + geo.reserved_gdt_blocks > addr_per_block(sb.bs);
        assert_eq!(wraps, expect_wrap, "{sb:?}");
        let dind_blk = resize_dind(&img, &sb);
        let mut dind = read_block(&img, u64::from(dind_blk), sb.bs);
        geo.verify_dind(&dind).expect("mkfs DIND verifies");
        let expected = geo.expected_dind().expect("expected DIND");
        assert_eq!(indirect_entries(&dind).collect::<Vec<_>>(), expected);
        for j in 0..geo.reserved_gdt_blocks {
            let pblk = geo.primary_reserved_gdt_block(j).expect("fits");
            let ind = read_block(&img, u64::from(pblk), sb.bs);
            geo.verify_ind(j, &ind)
                .expect("mkfs reserved GDT block verifies");
            assert_eq!(
                indirect_entries(&ind).collect::<Vec<_>>(),
                geo.expected_ind(j).expect("ind")
            );
        }
        // Cross-check map_path with debugfs' own block listing of inode 7:
        // "(L):P" pairs are data blocks at logical L.
        let stat = debugfs(&img, "stat <7>");
        let mut checked = 0;
        for tok in stat.split(", ").flat_map(|t| t.split_whitespace()) {
            let Some(rest) = tok.strip_prefix('(') else {
                continue;
            };
            let Some((l, p)) = rest.split_once("):") else {
                continue;
            };
            let (Ok(l), Ok(p)) = (l.parse::<u64>(), p.trim_end_matches(',').parse::<u32>()) else {
                continue;
            };
            let path = map_path(l, sb.bs).expect("mappable");
            assert_eq!(path.slot, DIND_SLOT);
            let [i0, i1] = [path.indexes()[0] as usize, path.indexes()[1] as usize];
            let ind_blk = le32(&dind, i0 * 4);
            let ind = read_block(&img, u64::from(ind_blk), sb.bs);
            assert_eq!(le32(&ind, i1 * 4), p, "logical {l}");
            checked += 1;
        }
        let backups = geo.backup_groups.len() as u32;
        assert_eq!(checked, geo.reserved_gdt_blocks * backups);

        // A wrong entry is reported with its position.
        let j = geo.reserved_gdt_blocks - 1;
        let idx = geo.dind_index(j);
        dind[idx * 4] ^= 1;
        let err = geo.verify_dind(&dind).expect_err("flipped DIND entry");
        assert!(
            format!("{err}").contains(&format!("DIND entry {idx}")),
            "{err}"
        );
    }

    #[test]
    fn resize_inode_of_1g_image_matches_mkfs() {
        check_resize_inode("1G", &[], false);
    }

    #[test]
    fn resize_inode_of_64m_1k_image_wraps_dind_index() {
        // 1 KiB blocks: 256 reserved GDT blocks + 1 GDT block wrap around the DIND.
        check_resize_inode("64M", &[], true);
    }

    #[test]
    fn map_path_reads_a_block_mapped_file() {
        // An ext3-style file (no extents) long enough to need IND and DIND blocks.
        let dir = TempDir::new("blockmap");
        let img = dir.path().join("fs.img");
        mkfs(&img, "32M", &["-b", "1024", "-O", "^extent,^64bit"], false);
        let sb = superblock(&img);
        let nblocks = 12 + 256 + 40; // reaches into the DIND range
        let data: Vec<u8> = (0..nblocks * 1024)
            .map(|i| (i * 7 + i / 1024) as u8)
            .collect();
        let src = dir.path().join("src");
        std::fs::write(&src, &data).expect("write src");
        debugfs_w(&img, &format!("write {} f", src.display()));
        let ino: u32 = debugfs(&img, "stat /f")
            .split_whitespace()
            .nth(1)
            .expect("Inode: N")
            .parse()
            .expect("ino");
        let inode = read_at(
            &img,
            inode_offset(&img, ino, sb.bs),
            usize::from(sb.inode_size),
        );
        assert_eq!(le32(&inode, 0x20) & 0x80000, 0, "file must be block-mapped");
        let mut out = Vec::new();
        for l in 0..nblocks as u64 {
            let path = map_path(l, sb.bs).expect("mappable");
            let mut blk = le32(&inode, 0x28 + 4 * path.slot);
            for &i in path.indexes() {
                let ind = read_block(&img, u64::from(blk), sb.bs);
                blk = indirect_entries(&ind).nth(i as usize).expect("entry");
            }
            assert_ne!(blk, 0, "logical {l} is a hole");
            out.extend(read_block(&img, u64::from(blk), sb.bs));
        }
        assert!(out == data, "file read through map_path differs");
    }

    #[test]
    fn geometry_overflow_is_an_error_not_a_wrap() {
        let geo = ResizeGeometry {
            bs: 4096,
            first_data_block: 0,
            blocks_per_group: 32768,
            desc_blocks: 1,
            reserved_gdt_blocks: 1,
            backup_groups: vec![1, 200_000],
        };
        assert!(geo.expected_ind(0).is_err());
        let too_many = ResizeGeometry {
            reserved_gdt_blocks: 1025,
            ..geo
        };
        assert!(too_many.expected_dind().is_err());
        assert!(too_many.verify_dind(&[0u8; 4096]).is_err());
    }
}
