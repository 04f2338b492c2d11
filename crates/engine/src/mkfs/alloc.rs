//! mkfs block and inode allocation: an in-memory block bitmap of the whole filesystem
//! and the group descriptors' counters, with the allocation rules of libext2fs that
//! decide where mke2fs puts things: `ext2fs_reserve_super_and_bgd`,
//! `ext2fs_allocate_group_table` with `flexbg_offset` (alloc_tables.c),
//! `ext2fs_get_free_blocks2` and `ext2fs_new_block2` (alloc.c), the range allocation
//! of `ext2fs_fallocate`, and the group statistics of `ext2fs_block_alloc_stats2` /
//! `ext2fs_inode_alloc_stats2` (alloc_stats.c).
//!
//! Must hold: bit `i` of `map` is block `first_data_block + i`; every allocation goes
//! through [`Alloc::take`] or [`Alloc::take_range`], which keep the group and
//! superblock free counts and the BLOCK_UNINIT flags exact; the search order equals
//! libext2fs' so that block numbers match mke2fs'.

use rext4_format::group::{FLAG_BLOCK_UNINIT, FLAG_INODE_UNINIT};

use super::geometry::Geometry;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Default)]
pub(crate) struct Group {
    pub block_bitmap: u64,
    pub inode_bitmap: u64,
    pub inode_table: u64,
    pub free_blocks: u64,
    pub free_inodes: u32,
    pub used_dirs: u32,
    pub flags: u16,
    pub itable_unused: u32,
}

pub(crate) struct Alloc<'g> {
    pub geo: &'g Geometry,
    map: Vec<u64>,
    pub groups: Vec<Group>,
    pub free_blocks: u64,
    pub free_inodes: u32,
    /// Inodes in use (only low numbers are ever allocated by mkfs).
    pub used_inodes: Vec<u32>,
}

fn full() -> Error {
    Error::InvalidInput("no free blocks left for the filesystem metadata".into())
}

impl<'g> Alloc<'g> {
    /// `ext2fs_initialize`'s group setup: reserve superblocks and descriptor tables,
    /// set the UNINIT flags and the starting free counts.
    pub(crate) fn new(geo: &'g Geometry) -> Alloc<'g> {
        let nbits = geo.blocks_count - geo.first_data_block;
        let mut a = Alloc {
            geo,
            map: vec![0; nbits.div_ceil(64) as usize],
            groups: vec![Group::default(); geo.groups as usize],
            free_blocks: 0,
            free_inodes: geo.inodes_count,
            used_inodes: Vec::new(),
        };
        let csum = geo.group_csum();
        let flex = geo.log_groups_per_flex != 0;
        for g in 0..geo.groups {
            let mut flags = 0;
            let mut unused = 0;
            if csum {
                if g != geo.groups - 1 {
                    flags |= FLAG_BLOCK_UNINIT;
                }
                flags |= FLAG_INODE_UNINIT;
                unused = geo.inodes_per_group;
                if g == 0 {
                    // Wraps when a group has fewer inodes than the reserved ones, as
                    // in libext2fs; `finish_group_csum` recomputes it.
                    unused = unused.wrapping_sub(super::geometry::FIRST_INO);
                }
            }
            let mut free = a.reserve_super_and_bgd(g);
            if flex {
                free += 2 + geo.inode_blocks_per_group;
            }
            a.free_blocks += free;
            let grp = &mut a.groups[g as usize];
            grp.flags = flags;
            grp.itable_unused = unused;
            grp.free_blocks = free;
            grp.free_inodes = geo.inodes_per_group;
        }
        a
    }

    fn bit(&self, blk: u64) -> u64 {
        blk - self.geo.first_data_block
    }

    pub(crate) fn is_used(&self, blk: u64) -> bool {
        let i = self.bit(blk);
        self.map[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn mark(&mut self, blk: u64) {
        let i = self.bit(blk);
        self.map[(i / 64) as usize] |= 1 << (i % 64);
    }

    fn mark_range(&mut self, blk: u64, n: u64) {
        for b in blk..blk + n {
            self.mark(b);
        }
    }

    /// First block in `[from, to)` whose bit equals `used`.
    fn find(&self, from: u64, to: u64, used: bool) -> Option<u64> {
        let (mut i, end) = (self.bit(from), self.bit(to));
        while i < end {
            let w = self.map[(i / 64) as usize];
            let w = if used { w } else { !w };
            let w = w >> (i % 64);
            if w != 0 {
                let hit = i + u64::from(w.trailing_zeros());
                return (hit < end).then_some(hit + self.geo.first_data_block);
            }
            i = (i / 64 + 1) * 64;
        }
        None
    }

    /// `ext2fs_reserve_super_and_bgd`: mark group `g`'s superblock, descriptor and
    /// reserved-GDT blocks; returns the group's free blocks less bitmaps and table.
    fn reserve_super_and_bgd(&mut self, g: u64) -> u64 {
        let geo = self.geo;
        let mut used = 0;
        if geo.has_super(g) {
            let sb = geo.group_first(g);
            self.mark(sb);
            let old_desc = geo.desc_blocks + u64::from(geo.reserved_gdt_blocks);
            let n = old_desc.min(geo.blocks_count - (sb + 1));
            self.mark_range(sb + 1, n);
            used = 1 + old_desc;
        }
        (geo.blocks_in_group(g)).saturating_sub(2 + geo.inode_blocks_per_group + used)
    }

    /// `ext2fs_get_free_blocks2`: the first `num` free blocks in a row starting in
    /// `[start, finish)`, wrapping to the first data block when `finish <= start`.
    fn get_free_blocks(&self, start: u64, finish: u64, num: u64) -> Option<u64> {
        let geo = self.geo;
        let fdb = geo.first_data_block;
        let mut b = if start == 0 { fdb } else { start };
        let finish = if finish == 0 { start } else { finish };
        let num = num.max(1);
        loop {
            if b + num > geo.blocks_count {
                if finish > start {
                    return None;
                }
                b = fdb;
            }
            match self.find(b, b + num, true) {
                None => return Some(b),
                Some(u) => {
                    let next = u + 1;
                    if b < finish && finish <= next {
                        return None;
                    }
                    b = next;
                }
            }
        }
    }

    /// `flexbg_offset` of alloc_tables.c.
    fn flexbg_offset(&self, group: u64, start_blk: u64, rem_grp: u64, elem: u64) -> u64 {
        let geo = self.geo;
        let flexbg_size = 1u64 << geo.log_groups_per_flex;
        let flexbg = group / flexbg_size;
        let size = (rem_grp * elem).min(geo.blocks_per_group / 4);
        if start_blk != 0 && start_blk < geo.blocks_count {
            if let Some(b) = self.get_free_blocks(start_blk, start_blk + size, elem) {
                return b;
            }
        }
        let start = geo.group_first(flexbg_size * flexbg);
        let last_grp = (group | (flexbg_size - 1)).min(geo.groups - 1);
        let last_blk = geo.group_last(last_grp);
        self.get_free_blocks(start, last_blk, size)
            .or_else(|| self.get_free_blocks(start, last_blk, elem))
            .or_else(|| self.get_free_blocks(0, last_blk, elem))
            .unwrap_or(0)
    }

    /// Account `n` blocks starting at `blk` (all in one group or spanning several)
    /// as allocated: group and superblock counts, BLOCK_UNINIT cleared.
    fn stats_range(&mut self, mut blk: u64, mut n: u64) {
        while n > 0 {
            let g = self.geo.group_of(blk);
            let take = n.min(self.geo.group_last(g) - blk + 1);
            let grp = &mut self.groups[g as usize];
            grp.free_blocks -= take;
            grp.flags &= !FLAG_BLOCK_UNINIT;
            self.free_blocks -= take;
            blk += take;
            n -= take;
        }
    }

    /// `ext2fs_allocate_group_table` for group `g`.
    pub(crate) fn allocate_group_table(&mut self, g: u64) -> Result<()> {
        let geo = self.geo;
        let mut group_blk = geo.group_first(g);
        let mut last_blk = geo.group_last(g);
        let flexbg_size = if geo.log_groups_per_flex != 0 {
            1u64 << geo.log_groups_per_flex
        } else {
            0
        };
        let (mut last_grp, mut rem_grps) = (0, 0);
        if flexbg_size != 0 {
            last_grp = (g | (flexbg_size - 1)).min(geo.groups - 1);
            rem_grps = last_grp - g + 1;
        }
        let mut start_blk = group_blk;
        let mut table_offset = flexbg_size;
        if flexbg_size != 0 {
            let mut prev = 0;
            if !g.is_multiple_of(flexbg_size) {
                prev = self.groups[(g - 1) as usize].block_bitmap + 1;
            } else if last_grp == geo.groups - 1 {
                // The last flex group keeps its tables contiguous.
                table_offset = last_grp & (flexbg_size - 1);
                if table_offset == 0 {
                    table_offset = flexbg_size;
                } else {
                    table_offset += 1;
                }
            }
            start_blk = self.flexbg_offset(g, prev, rem_grps, 1);
            last_blk = geo.group_last(last_grp);
        }
        let bb = self
            .get_free_blocks(start_blk, last_blk, 1)
            .or_else(|| self.get_free_blocks(group_blk, last_blk, 1))
            .ok_or_else(full)?;
        self.mark(bb);
        self.groups[g as usize].block_bitmap = bb;
        if flexbg_size != 0 {
            self.stats_range(bb, 1);
            let prev = if !g.is_multiple_of(flexbg_size) {
                self.groups[(g - 1) as usize].inode_bitmap + 1
            } else {
                bb + table_offset
            };
            start_blk = self.flexbg_offset(g, prev, rem_grps, 1);
            last_blk = geo.group_last(last_grp);
        }
        let ib = self
            .get_free_blocks(start_blk, last_blk, 1)
            .or_else(|| self.get_free_blocks(group_blk, last_blk, 1))
            .ok_or_else(full)?;
        self.mark(ib);
        self.groups[g as usize].inode_bitmap = ib;
        let itb = geo.inode_blocks_per_group;
        if flexbg_size != 0 {
            self.stats_range(ib, 1);
            let prev = if !g.is_multiple_of(flexbg_size) {
                self.groups[(g - 1) as usize].inode_table + itb
            } else {
                ib + table_offset
            };
            group_blk = self.flexbg_offset(g, prev, rem_grps, itb);
            last_blk = geo.group_last(last_grp);
        }
        let it = self
            .get_free_blocks(group_blk, last_blk, itb)
            .ok_or_else(full)?;
        self.mark_range(it, itb);
        if flexbg_size != 0 {
            self.stats_range(it, itb);
        }
        self.groups[g as usize].inode_table = it;
        Ok(())
    }

    /// For a grow (`crate::resize`): blocks `blk..blk + n` are used by the filesystem
    /// being grown.
    pub(crate) fn mark_used(&mut self, blk: u64, n: u64) {
        self.mark_range(blk, n);
    }

    /// For a grow: group `g` of the filesystem being grown has its tables here (the
    /// placement of the next groups' tables starts from them, as libext2fs's does).
    pub(crate) fn set_tables(&mut self, g: u64, block_bitmap: u64, inode_bitmap: u64, table: u64) {
        let grp = &mut self.groups[g as usize];
        grp.block_bitmap = block_bitmap;
        grp.inode_bitmap = inode_bitmap;
        grp.inode_table = table;
    }

    /// `ext2fs_allocate_tables`.
    pub(crate) fn allocate_tables(&mut self) -> Result<()> {
        for g in 0..self.geo.groups {
            self.allocate_group_table(g)?;
        }
        Ok(())
    }

    /// Blocks in use (the bitmap's set bits).
    pub(crate) fn used_blocks(&self) -> u64 {
        self.map.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// `ext2fs_new_block2` + `ext2fs_block_alloc_stats2`: the first free block at or
    /// after `goal`, wrapping around.
    pub(crate) fn take(&mut self, goal: u64) -> Result<u64> {
        let geo = self.geo;
        let goal = if goal < geo.first_data_block || goal >= geo.blocks_count {
            geo.first_data_block
        } else {
            goal
        };
        let b = self
            .find(goal, geo.blocks_count, false)
            .or_else(|| self.find(geo.first_data_block, goal, false))
            .ok_or_else(full)?;
        self.mark(b);
        self.stats_range(b, 1);
        Ok(b)
    }

    /// One free run at or after `goal` (wrapping), at most `max` long: the piece
    /// `ext2fs_fallocate` takes next. Allocated and accounted.
    pub(crate) fn take_range(&mut self, goal: u64, max: u64) -> Result<(u64, u64)> {
        let geo = self.geo;
        let goal = if goal < geo.first_data_block || goal >= geo.blocks_count {
            geo.first_data_block
        } else {
            goal
        };
        let start = self
            .find(goal, geo.blocks_count, false)
            .or_else(|| self.find(geo.first_data_block, goal, false))
            .ok_or_else(full)?;
        let limit = (start + max).min(geo.blocks_count);
        let end = self.find(start, limit, true).unwrap_or(limit);
        let n = end - start;
        self.mark_range(start, n);
        self.stats_range(start, n);
        Ok((start, n))
    }

    /// `ext2fs_inode_alloc_stats2(ino, +1, is_dir)`.
    pub(crate) fn take_inode(&mut self, ino: u32, is_dir: bool) {
        let geo = self.geo;
        let ipg = geo.inodes_per_group;
        let g = ((ino - 1) / ipg) as usize;
        let grp = &mut self.groups[g];
        grp.free_inodes -= 1;
        if is_dir {
            grp.used_dirs += 1;
        }
        grp.flags &= !FLAG_INODE_UNINIT;
        if geo.group_csum() {
            // u32 arithmetic as in libext2fs (itable_unused may have wrapped).
            let first_unused = ipg
                .wrapping_sub(grp.itable_unused)
                .wrapping_add(g as u32 * ipg + 1);
            if ino >= first_unused {
                grp.itable_unused = g as u32 * ipg + ipg - ino;
            }
        }
        self.free_inodes -= 1;
        self.used_inodes.push(ino);
    }

    /// `ext2fs_new_inode`'s `check_inode_uninit` for the group of `ino`: a new inode
    /// in a group still marked INODE_UNINIT makes both its bitmaps real.
    pub(crate) fn new_inode_group(&mut self, ino: u32) {
        let geo = self.geo;
        let g = ((ino - 1) / geo.inodes_per_group) as usize;
        let grp = &mut self.groups[g];
        if geo.group_csum() && grp.flags & FLAG_INODE_UNINIT != 0 {
            grp.flags &= !(FLAG_INODE_UNINIT | FLAG_BLOCK_UNINIT);
        }
    }

    /// `ext2fs_set_gdt_csum`, run when libext2fs closes the filesystem: UNINIT flags
    /// and itable_unused recomputed from the counts and the inode bitmap.
    pub(crate) fn finish_group_csum(&mut self) {
        let geo = self.geo;
        if !geo.group_csum() {
            return;
        }
        let ipg = geo.inodes_per_group;
        for (g, grp) in self.groups.iter_mut().enumerate() {
            if grp.free_blocks == geo.blocks_per_group && g as u64 != geo.groups - 1 {
                grp.flags |= FLAG_BLOCK_UNINIT;
            }
            if grp.free_inodes == ipg {
                grp.flags |= FLAG_INODE_UNINIT;
                grp.itable_unused = ipg;
            } else {
                let last = self
                    .used_inodes
                    .iter()
                    .filter(|&&i| (i - 1) / ipg == g as u32)
                    .map(|&i| (i - 1) % ipg + 1)
                    .max()
                    .unwrap_or(0);
                grp.flags &= !FLAG_INODE_UNINIT;
                grp.itable_unused = ipg - last;
            }
        }
    }

    /// The goal libext2fs uses for a new inode's first block
    /// (`ext2fs_find_inode_goal` without blocks): the start of its flex group.
    pub(crate) fn inode_goal(&self, ino: u32) -> u64 {
        let geo = self.geo;
        let mut g = u64::from((ino - 1) / geo.inodes_per_group);
        if geo.log_groups_per_flex != 0 {
            g &= !((1u64 << geo.log_groups_per_flex) - 1);
        }
        geo.group_first(g)
    }

    /// The bits of group `g`'s block bitmap as one block (padding set past the end of
    /// the filesystem).
    pub(crate) fn block_bitmap(&self, g: u64) -> Vec<u8> {
        let geo = self.geo;
        let bs = geo.block_size as usize;
        let mut out = vec![0u8; bs];
        let first = geo.group_first(g);
        let n = geo.blocks_in_group(g);
        for i in 0..n {
            if self.is_used(first + i) {
                out[(i / 8) as usize] |= 1 << (i % 8);
            }
        }
        // Bits past the group (the fs end, or blocks_per_group < 8 * block size).
        for i in n..(bs as u64 * 8) {
            out[(i / 8) as usize] |= 1 << (i % 8);
        }
        out
    }

    /// Group `g`'s inode bitmap as one block (padding set past inodes_per_group).
    pub(crate) fn inode_bitmap(&self, g: u64) -> Vec<u8> {
        let geo = self.geo;
        let bs = geo.block_size as usize;
        let ipg = u64::from(geo.inodes_per_group);
        let mut out = vec![0u8; bs];
        for &ino in &self.used_inodes {
            let (ig, idx) = (u64::from(ino - 1) / ipg, u64::from(ino - 1) % ipg);
            if ig == g {
                out[(idx / 8) as usize] |= 1 << (idx % 8);
            }
        }
        for i in ipg..(bs as u64 * 8) {
            out[(i / 8) as usize] |= 1 << (i % 8);
        }
        out
    }
}
