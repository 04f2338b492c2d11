//! The smallest size the contents fit in (`rext4 resize IMAGE min`).
//!
//! A size `n` (as `layout::adjust_size` rounds it) fits when: the inodes in use fit in
//! the groups that stay; every kept group's bitmaps and inode table lie below `n` (they
//! are not moved); the resize inode's DIND block lies below `n`; and the free blocks
//! below `n` hold everything that must move — the blocks in use at or past `n` that
//! are not the removed groups' own metadata, the whole journal when any of it lies
//! past `n` (it moves as one), and a margin for the extent-tree blocks the moved files'
//! new trees may need. Whether a size fits only gets easier as it grows, so the
//! smallest is found by bisection over the counts (descriptors' free counts, and the
//! bitmap of the one group a size cuts).
//!
//! This is exact about blocks where resize2fs's `calculate_minimum_resize_size`
//! estimates (it adds a flex group of inode tables as slack), so the result is
//! usually smaller; the evacuation still checks every allocation, and a shrink to
//! `min` that meets a full disk tries a slightly larger size.

use std::sync::Arc;

use rext4_format::bitmap;
use rext4_format::superblock::feature;

use super::layout;
use crate::error::Result;
use crate::fs::{Fs, Ino};

/// Sorted disjoint runs `(start, len)`.
fn merge(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.retain(|r| r.1 > 0);
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, l) in v {
        match out.last_mut() {
            Some((ps, pl)) if *ps + *pl >= s => *pl = (*pl).max(s + l - *ps),
            _ => out.push((s, l)),
        }
    }
    out
}

/// Blocks of `runs` at or after `n`.
fn at_or_after(runs: &[(u64, u64)], n: u64) -> u64 {
    runs.iter()
        .map(|&(s, l)| (s + l).saturating_sub(s.max(n)).min(l))
        .sum()
}

/// What the size search needs to know about the filesystem.
pub(crate) struct Census {
    pub first: u64,
    pub bpg: u64,
    pub blocks: u64,
    pub ipg: u64,
    pub used_inodes: u64,
    /// Per group: blocks in it and free blocks.
    pub sizes: Vec<u64>,
    pub free: Vec<u64>,
    /// Per group: the bitmap (for the one group a size cuts).
    pub bitmaps: Vec<Arc<[u8]>>,
    /// Per group: the end of its bitmaps and inode table (what must stay below a size
    /// that keeps it).
    pub table_end: Vec<u64>,
    /// The removed groups' own metadata: superblock backups, descriptor copies,
    /// reserved GDT blocks, every group's tables.
    pub meta: Vec<(u64, u64)>,
    /// The journal's blocks and length.
    pub journal: Vec<(u64, u64)>,
    pub journal_len: u64,
    /// Blocks that never move (the resize inode's DIND block).
    pub pinned_end: u64,
}

impl Census {
    pub(crate) fn of(fs: &Fs) -> Result<Census> {
        let sb = fs.superblock();
        let descs = fs.group_descs();
        let first = u64::from(sb.first_data_block);
        let bpg = u64::from(sb.blocks_per_group);
        let itb = sb.inode_table_blocks();
        let mut sizes = Vec::with_capacity(descs.len());
        let mut free = Vec::with_capacity(descs.len());
        let mut bitmaps = Vec::with_capacity(descs.len());
        let mut table_end = Vec::with_capacity(descs.len());
        let mut meta = Vec::new();
        for (g, d) in descs.iter().enumerate() {
            let g64 = g as u64;
            sizes.push(sb.blocks_in_group(g64));
            let grp = fs.group(g)?;
            free.push(u64::from(grp.desc.free_blocks_count));
            bitmaps.push(fs.block_bitmap(g, &grp)?);
            drop(grp);
            table_end.push(
                (d.block_bitmap + 1)
                    .max(d.inode_bitmap + 1)
                    .max(d.inode_table + itb),
            );
            meta.push((sb.group_first_block(g64), sb.group_base_meta_blocks(g64)));
            meta.push((d.block_bitmap, 1));
            meta.push((d.inode_bitmap, 1));
            meta.push((d.inode_table, itb));
        }
        let mut journal = Vec::new();
        let mut journal_len = 0;
        if sb.has_compat(feature::COMPAT_HAS_JOURNAL) && sb.journal_inum != 0 {
            let ino = Ino(sb.journal_inum);
            let inode = fs.read_inode(ino)?;
            let bs = u64::from(sb.block_size());
            journal_len = inode.size / bs;
            for (l, m) in fs.extents(ino, &inode, u64::MAX)? {
                if let crate::store::Mapping::Mapped { physical, len, .. } = m {
                    // Extents past the log's size are an earlier move's old log,
                    // which the switch drops with its groups.
                    if l < journal_len {
                        journal.push((physical, len));
                    } else {
                        meta.push((physical, len));
                    }
                }
            }
        }
        let mut pinned_end = 0;
        if sb.has_compat(feature::COMPAT_RESIZE_INODE) {
            let inode = fs.read_inode(Ino(rext4_format::inode::RESIZE_INO))?;
            let b = &inode.block;
            pinned_end = u64::from(u32::from_le_bytes([b[52], b[53], b[54], b[55]])) + 1;
        }
        Ok(Census {
            first,
            bpg,
            blocks: sb.blocks_count,
            ipg: u64::from(sb.inodes_per_group),
            used_inodes: u64::from(sb.inodes_count - sb.free_inodes_count),
            sizes,
            free,
            bitmaps,
            table_end,
            meta: merge(meta),
            journal: merge(journal),
            journal_len,
            pinned_end,
        })
    }

    /// (free blocks below `n`, blocks in use at or after `n`).
    fn split(&self, n: u64) -> (u64, u64) {
        let (mut free_below, mut used_after) = (0, 0);
        for (g, (&size, &free)) in self.sizes.iter().zip(&self.free).enumerate() {
            let start = self.first + g as u64 * self.bpg;
            if start + size <= n {
                free_below += free;
            } else if start >= n {
                used_after += size - free;
            } else {
                let cut = n - start;
                let b = &self.bitmaps[g];
                let used_before = bitmap::count_set(b, cut);
                free_below += cut - used_before;
                used_after += (size - free).saturating_sub(used_before);
            }
        }
        (free_below, used_after)
    }

    /// Whether everything fits in a filesystem of `n` blocks (a size
    /// `layout::adjust_size` gave).
    pub(crate) fn fits(&self, n: u64) -> bool {
        if n >= self.blocks {
            return true;
        }
        let groups = (n - self.first).div_ceil(self.bpg);
        if self.used_inodes > groups * self.ipg || self.pinned_end > n {
            return false;
        }
        if self.table_end.iter().take(groups as usize).any(|&e| e > n) {
            return false;
        }
        let (free_below, used_after) = self.split(n);
        let journal_after = at_or_after(&self.journal, n);
        let meta_after = at_or_after(&self.meta, n);
        let movable = used_after.saturating_sub(meta_after + journal_after);
        let mut need = movable + margin(movable);
        if journal_after > 0 {
            need += self.journal_len + 1;
        }
        free_below >= need
    }
}

/// Extent-tree blocks the moved files' new trees may take beyond their old ones.
fn margin(movable: u64) -> u64 {
    if movable == 0 {
        0
    } else {
        movable / 256 + 16
    }
}

/// The smallest size (in blocks, as `layout::adjust_size` rounds) the filesystem open
/// as `fs` can be shrunk to; its current size when it cannot shrink.
pub(crate) fn min_blocks(fs: &Fs) -> Result<u64> {
    let sb = fs.superblock();
    let c = Census::of(fs)?;
    min_of(&c, |n| layout::adjust_size(&sb, n).ok())
}

/// The bisection: the smallest `adjust(n)` that fits.
pub(crate) fn min_of(c: &Census, adjust: impl Fn(u64) -> Option<u64>) -> Result<u64> {
    let fits = |n: u64| adjust(n).is_some_and(|a| a > c.first && c.fits(a));
    let (mut lo, mut hi) = (c.first + 1, c.blocks);
    if !fits(hi) {
        return Ok(c.blocks);
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(adjust(hi).unwrap_or(c.blocks))
}
