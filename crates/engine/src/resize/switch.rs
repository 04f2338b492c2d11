//! The switch from the old geometry to the new one (steps 2 to 5 of the module note of
//! `crate::resize`): what the new geometry changes, worked out from the closed image,
//! written where the old filesystem keeps nothing first, then as one transaction.
//!
//! A grow places the new groups' tables as libext2fs would for the new size
//! (`crate::mkfs`'s allocator, seeded with every block the filesystem uses), takes new
//! descriptor blocks from the reserved GDT blocks, extends the old last group, and
//! rebuilds the resize inode for the new geometry. A shrink (after the evacuation and
//! the journal move) checks that nothing but the removed groups' own metadata is left
//! past the new end, frees the removed groups' tables that lie in kept groups (flex_bg),
//! cuts the last group short, gives descriptor blocks back to the reserved GDT blocks,
//! drops the journal's old blocks, and rebuilds the resize inode.
//!
//! Must hold: see `crate::resize`; in particular every block written before the
//! commit is one the old filesystem does not use, and the checks that refuse a shrink
//! (anything in use past the new end) run before anything is written.

use std::collections::{BTreeMap, BTreeSet};

use rext4_format::bitmap;
use rext4_format::extent::Extent;
use rext4_format::group::{GroupDesc, FLAG_BLOCK_UNINIT, FLAG_INODE_UNINIT, FLAG_ITABLE_ZEROED};
use rext4_format::inode::Timestamp;
use rext4_format::resize::ResizeGeometry;
use rext4_format::superblock::{feature, Superblock, STATE_ERROR};

use super::layout::{self, Layout};
use super::raw::{self, HomeOrder, Raw};
use crate::device::BlockDevice;
use crate::error::{Error, Result};

/// What the switch did.
pub(crate) struct Switched {
    pub new_groups: u64,
}

/// Refuse what this module does not lay out, by name.
pub(crate) fn check_features(sb: &Superblock) -> Result<()> {
    let refuse = |what: &str| {
        Err(Error::Unsupported(format!(
            "rext4 resize does not handle {what}"
        )))
    };
    if sb.has_ro_compat(feature::RO_COMPAT_BIGALLOC) {
        return refuse("bigalloc images (clusters larger than a block)");
    }
    if sb.has_incompat(feature::INCOMPAT_META_BG) {
        return refuse("meta_bg images");
    }
    if sb.has_compat(feature::COMPAT_SPARSE_SUPER2) {
        return refuse("sparse_super2 images");
    }
    if !sb.has_compat(feature::COMPAT_HAS_JOURNAL) || sb.journal_inum == 0 {
        return refuse(
            "images without an internal journal (the switch to the new geometry is one \
             journal transaction)",
        );
    }
    if !sb.has_incompat(feature::INCOMPAT_EXTENTS) {
        return refuse("images without the extent feature (ext2/ext3 layouts)");
    }
    if sb.state & STATE_ERROR != 0 {
        return Err(Error::InvalidInput(
            "the filesystem has recorded errors: check it with e2fsck -f first".into(),
        ));
    }
    let fc = sb.check_features();
    if !fc.unsupported_incompat.is_empty() || !fc.unsupported_ro_compat.is_empty() {
        let mut all = fc.unsupported_incompat;
        all.extend(fc.unsupported_ro_compat);
        return refuse(&format!("images with {}", all.join(", ")));
    }
    Ok(())
}

/// Seconds now for the superblock (the epoch in reproducible mode).
pub(crate) fn now_secs() -> i64 {
    match crate::repro::source_date_epoch().ok().flatten() {
        Some(t) => t,
        None => crate::fs::now(),
    }
}

fn now_ts() -> Timestamp {
    Timestamp {
        sec: now_secs(),
        nsec: 0,
    }
}

/// The descriptor blocks `0..desc_blocks` holding `descs` (the first `groups` of
/// them), over the blocks as read (reserved bytes kept); slots past the last group
/// are zero.
pub(crate) fn gdt_blocks(
    rw: &Raw<'_>,
    descs: &[GroupDesc],
    groups: u64,
    desc_blocks: u64,
) -> Vec<Vec<u8>> {
    let ds = rw.sb.desc_size();
    let per = rw.sb.descs_per_block();
    (0..desc_blocks)
        .map(|i| {
            let mut b = rw
                .gdt
                .get(i as usize)
                .cloned()
                .unwrap_or_else(|| vec![0u8; rw.bs as usize]);
            for k in 0..per {
                let g = i * per + k;
                let slot = &mut b[k as usize * ds..(k as usize + 1) * ds];
                match descs.get(g as usize) {
                    Some(d) if g < groups => d.encode_into(slot, ds, g as u32, rw.kind),
                    _ => slot.fill(0),
                }
            }
            b
        })
        .collect()
}

/// Everything the switch writes.
#[derive(Default)]
struct Plan {
    /// Written and flushed before the commit (blocks the old filesystem does not use).
    pre: Vec<(u64, Vec<u8>)>,
    /// Runs (start, length) zeroed before the commit (new inode tables).
    zero: Vec<(u64, u64)>,
    /// The transaction.
    txn: BTreeMap<u64, Vec<u8>>,
    /// Backup superblocks and descriptor copies in groups the old filesystem has: in
    /// the transaction when there is room, else home after it.
    backups: Vec<(u64, Vec<u8>)>,
    sb: Option<Superblock>,
}

/// Steps 2 to 5 on the closed image on `dev`: switch it to `new_blocks` blocks (a size
/// `layout::adjust_size` gave). Blocks at and after `zeroed_from` read as zeros (a file
/// just extended).
pub(crate) fn switch(
    dev: &dyn BlockDevice,
    new_blocks: u64,
    zeroed_from: Option<u64>,
) -> Result<Switched> {
    let rw = Raw::open(dev)?;
    check_features(&rw.sb)?;
    if rw.sb.has_incompat(feature::INCOMPAT_RECOVER) {
        return Err(Error::InvalidInput(
            "the journal needs recovery: open the image read-write first".into(),
        ));
    }
    let new = layout::layout(&rw.sb, new_blocks)?;
    let mut plan = if new_blocks > rw.sb.blocks_count {
        grow(&rw, &new, zeroed_from)?
    } else {
        shrink(&rw, &new)?
    };
    let bs = rw.bs;
    // Step 2: outside the old filesystem.
    for (blk, d) in &plan.pre {
        dev.write_at(d, blk * bs)?;
    }
    let chunk = vec![0u8; (1 << 20).max(bs as usize)];
    for &(s, n) in &plan.zero {
        let mut at = s * bs;
        let end = (s + n) * bs;
        while at < end {
            let len = (end - at).min(chunk.len() as u64) as usize;
            dev.write_at(&chunk[..len], at)?;
            at += len as u64;
        }
    }
    dev.flush()?;
    // Steps 3 and 4; backups in the transaction when they fit.
    let Some(nsb) = plan.sb.take() else {
        return Err(Error::InvalidInput("no superblock planned".into()));
    };
    let room = max_txn_blocks(&rw)?;
    let post = if plan.txn.len() + plan.backups.len() <= room {
        for (b, d) in plan.backups.drain(..) {
            plan.txn.insert(b, d);
        }
        Vec::new()
    } else {
        std::mem::take(&mut plan.backups)
    };
    // Home, in the order that keeps a kernel that reads the superblock and the
    // descriptors before it replays the log (it does) consistent at each step: a grow
    // writes the descriptor blocks first (the old geometry ignores the new ones and the
    // slots past its groups), then the superblock; a shrink the superblock first (the
    // new geometry reads only the kept groups' descriptors, valid before and after).
    let sbb = rw.sb_block();
    let gdt: Vec<u64> = (0..new.desc_blocks)
        .map(|i| rw.sb.desc_block_location(i))
        .filter(|b| plan.txn.contains_key(b))
        .collect();
    let first = if new_blocks > rw.sb.blocks_count {
        vec![gdt, vec![sbb]]
    } else {
        vec![vec![sbb], gdt]
    };
    raw::commit(
        &rw,
        &plan.txn,
        &HomeOrder { first, last: None },
        (&nsb, &rw.sb_raw),
        &post,
    )?;
    Ok(Switched {
        new_groups: new.groups,
    })
}

/// Blocks one transaction may carry in this filesystem's log.
fn max_txn_blocks(rw: &Raw<'_>) -> Result<usize> {
    let map = crate::journal::JournalMap::locate(rw.dev, &rw.sb)?;
    let mut runs = rext4_jbd2::Runs::default();
    for j in 0..map.blocks {
        runs.push(map.physical(j)?, 1);
    }
    let log = rext4_jbd2::Log::open_runs(rw.dev, runs, rw.bs as usize)?;
    Ok(log.max_blocks())
}

/// The group holding block `blk`.
fn group_of(sb: &Superblock, blk: u64) -> u64 {
    (blk - u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group)
}

/// Blocks in group `g` of a filesystem of `blocks` blocks.
fn blocks_in(sb: &Superblock, blocks: u64, g: u64) -> u64 {
    blocks
        .saturating_sub(sb.group_first_block(g))
        .min(u64::from(sb.blocks_per_group))
}

/// The new superblock: `sb` with the new geometry and counts (RECOVER set: it goes
/// into the transaction).
fn new_superblock(sb: &Superblock, new: &Layout, descs: &[GroupDesc]) -> Superblock {
    let mut s = sb.clone();
    s.blocks_count = new.blocks;
    s.inodes_count = new.inodes;
    s.r_blocks_count = new.r_blocks;
    s.reserved_gdt_blocks = new.reserved_gdt as u16;
    // As resize2fs: the kernel works the overhead out again.
    s.overhead_clusters = 0;
    s.free_blocks_count = descs.iter().map(|d| u64::from(d.free_blocks_count)).sum();
    s.free_inodes_count = descs
        .iter()
        .map(|d| u64::from(d.free_inodes_count))
        .sum::<u64>()
        .min(u64::from(u32::MAX)) as u32;
    s.wtime = now_secs();
    s.feature_incompat |= feature::INCOMPAT_RECOVER;
    s
}

/// The inode table block holding `ino`, as the transaction has it so far.
fn itable_block(rw: &Raw<'_>, txn: &BTreeMap<u64, Vec<u8>>, blk: u64) -> Result<Vec<u8>> {
    match txn.get(&blk) {
        Some(b) => Ok(b.clone()),
        None => rw.read(blk),
    }
}

/// Rebuild the resize inode for the new geometry into `txn`: its DIND block, the
/// reserved GDT blocks (each listing its copies in the backup groups), its block count.
fn resize_inode(
    rw: &Raw<'_>,
    new: &Layout,
    backups: &[u64],
    txn: &mut BTreeMap<u64, Vec<u8>>,
) -> Result<()> {
    let sb = &rw.sb;
    if !sb.has_compat(feature::COMPAT_RESIZE_INODE) {
        return Ok(());
    }
    let ino = rext4_format::inode::RESIZE_INO;
    let (mut rec, mut inode) = rw.inode(ino)?;
    let dind = u64::from(u32::from_le_bytes([
        inode.block[52],
        inode.block[53],
        inode.block[54],
        inode.block[55],
    ]));
    if dind == 0 || dind >= new.blocks.min(sb.blocks_count) {
        return Err(Error::corrupted(
            format!("resize inode's DIND block {dind} is not in the filesystem"),
            None,
        ));
    }
    let rg = ResizeGeometry {
        bs: sb.block_size(),
        first_data_block: sb.first_data_block,
        blocks_per_group: sb.blocks_per_group,
        desc_blocks: new.desc_blocks as u32,
        reserved_gdt_blocks: new.reserved_gdt as u32,
        backup_groups: backups.iter().map(|&g| g as u32).collect(),
    };
    let words = |v: Vec<u32>| -> Vec<u8> { v.iter().flat_map(|w| w.to_le_bytes()).collect() };
    let put = |txn: &mut BTreeMap<u64, Vec<u8>>, blk: u64, data: Vec<u8>| -> Result<()> {
        if rw.read(blk)? != data {
            txn.insert(blk, data);
        }
        Ok(())
    };
    put(txn, dind, words(rg.expected_dind()?))?;
    for j in 0..new.reserved_gdt as u32 {
        let b = u64::from(rg.primary_reserved_gdt_block(j)?);
        put(txn, b, words(rg.expected_ind(j)?))?;
    }
    let count = 1 + new.reserved_gdt * (1 + backups.len() as u64);
    inode.blocks_raw = count * (rw.bs / 512);
    inode.ctime = now_ts();
    rw.seal_inode(ino, &inode, &mut rec);
    let (iblk, ioff) = rw.inode_loc(ino)?;
    let mut itab = itable_block(rw, txn, iblk)?;
    itab[ioff..ioff + rec.len()].copy_from_slice(&rec);
    txn.insert(iblk, itab);
    Ok(())
}

/// The superblock backup and descriptor copies of backup group `g` in the new
/// geometry: (block, contents) pairs. `fresh`: the blocks are new (nothing to keep).
fn backup_blocks(
    rw: &Raw<'_>,
    nsb: &Superblock,
    gdt: &[Vec<u8>],
    g: u64,
    fresh: bool,
) -> Result<Vec<(u64, Vec<u8>)>> {
    let first = rw.sb.group_first_block(g);
    let cur = if fresh {
        vec![0u8; rw.bs as usize]
    } else {
        rw.read(first)?
    };
    let mut out = vec![(first, raw::backup_superblock(cur, nsb, &rw.sb_raw, g))];
    for (i, b) in gdt.iter().enumerate() {
        out.push((first + 1 + i as u64, b.clone()));
    }
    Ok(out)
}

/// Write the descriptor blocks that changed into the transaction.
fn put_gdt(rw: &Raw<'_>, gdt: &[Vec<u8>], txn: &mut BTreeMap<u64, Vec<u8>>) {
    for (i, b) in gdt.iter().enumerate() {
        if rw.gdt.get(i) != Some(b) {
            txn.insert(rw.sb.desc_block_location(i as u64), b.clone());
        }
    }
}

/// A grow: new groups after the old last one (which is extended first).
fn grow(rw: &Raw<'_>, new: &Layout, zeroed_from: Option<u64>) -> Result<Plan> {
    use crate::mkfs::alloc::Alloc;
    use crate::mkfs::geometry::Geometry;
    let sb = &rw.sb;
    let bs = rw.bs;
    let old_groups = rw.descs.len() as u64;
    let csum = sb.has_ro_compat(feature::RO_COMPAT_METADATA_CSUM | feature::RO_COMPAT_GDT_CSUM);
    let itb = sb.inode_table_blocks();
    let ipg = sb.inodes_per_group;
    let geo = Geometry {
        size_type: "resize",
        block_size: sb.block_size(),
        log_block_size: sb.log_block_size,
        blocks_count: new.blocks,
        r_blocks_count: new.r_blocks,
        first_data_block: u64::from(sb.first_data_block),
        blocks_per_group: u64::from(sb.blocks_per_group),
        groups: new.groups,
        desc_size: sb.desc_size() as u32,
        desc_blocks: new.desc_blocks,
        inodes_per_group: ipg,
        inode_blocks_per_group: itb,
        inodes_count: new.inodes,
        reserved_gdt_blocks: new.reserved_gdt as u32,
        log_groups_per_flex: if sb.has_incompat(feature::INCOMPAT_FLEX_BG) {
            sb.log_groups_per_flex
        } else {
            0
        },
        features: crate::mkfs::Features {
            compat: sb.feature_compat,
            incompat: sb.feature_incompat,
            ro_compat: sb.feature_ro_compat,
        },
        journal_blocks: 0,
        orphan_blocks: 0,
    };
    let mut alloc = Alloc::new(&geo);
    let mut old_bitmaps = Vec::with_capacity(old_groups as usize);
    for g in 0..old_groups {
        let d = &rw.descs[g as usize];
        alloc.set_tables(g, d.block_bitmap, d.inode_bitmap, d.inode_table);
        let b = rw.block_bitmap(g)?;
        let first = sb.group_first_block(g);
        let n = sb.blocks_in_group(g);
        let mut x = 0;
        while x < n {
            if !bitmap::test(&b, x) {
                x += 1;
                continue;
            }
            let s = x;
            while x < n && bitmap::test(&b, x) {
                x += 1;
            }
            alloc.mark_used(first + s, x - s);
        }
        old_bitmaps.push(b);
    }
    for g in old_groups..new.groups {
        alloc.allocate_group_table(g)?;
    }
    let mut descs = rw.descs.clone();
    for g in old_groups..new.groups {
        let a = &alloc.groups[g as usize];
        descs.push(GroupDesc {
            block_bitmap: a.block_bitmap,
            inode_bitmap: a.inode_bitmap,
            inode_table: a.inode_table,
            free_inodes_count: ipg,
            flags: if csum {
                FLAG_INODE_UNINIT | FLAG_ITABLE_ZEROED
            } else {
                0
            },
            itable_unused: if csum { ipg } else { 0 },
            ..Default::default()
        });
    }
    // Groups that hold some group's tables (flex_bg packs them): never BLOCK_UNINIT.
    let mut holds = BTreeSet::new();
    for d in &descs {
        for (s, len) in [
            (d.block_bitmap, 1),
            (d.inode_bitmap, 1),
            (d.inode_table, itb),
        ] {
            holds.insert(group_of(sb, s));
            holds.insert(group_of(sb, s + len - 1));
        }
    }
    let mut plan = Plan::default();
    let zero_from = zeroed_from.unwrap_or(u64::MAX);
    for g in old_groups..new.groups {
        let n = blocks_in(sb, new.blocks, g);
        let bm = alloc.block_bitmap(g);
        let d = &mut descs[g as usize];
        d.free_blocks_count = raw::free_in(&bm, n) as u32;
        // As resize2fs: a group with a superblock backup or some group's tables has
        // its bitmap written.
        if csum && g != new.groups - 1 && !holds.contains(&g) && !sb.group_has_super(g) {
            d.flags |= FLAG_BLOCK_UNINIT;
        } else {
            d.block_bitmap_csum = rw.bitmap_csum(&bm, sb.clusters_per_group);
            plan.pre.push((d.block_bitmap, bm));
        }
        if !csum {
            let mut ib = vec![0u8; bs as usize];
            for x in u64::from(ipg)..bs * 8 {
                bitmap::set(&mut ib, x, true);
            }
            plan.pre.push((d.inode_bitmap, ib));
        }
        let it = d.inode_table;
        if it < zero_from {
            plan.zero.push((it, (zero_from - it).min(itb)));
        }
    }
    for g in 0..old_groups {
        let n = blocks_in(sb, new.blocks, g);
        let bm = alloc.block_bitmap(g);
        if bm == old_bitmaps[g as usize] {
            continue;
        }
        let d = &mut descs[g as usize];
        d.free_blocks_count = raw::free_in(&bm, n) as u32;
        d.flags &= !FLAG_BLOCK_UNINIT;
        d.block_bitmap_csum = rw.bitmap_csum(&bm, sb.clusters_per_group);
        plan.txn.insert(d.block_bitmap, bm);
    }
    let nsb = new_superblock(sb, new, &descs);
    let gdt = gdt_blocks(rw, &descs, new.groups, new.desc_blocks);
    put_gdt(rw, &gdt, &mut plan.txn);
    let backups = layout::backup_groups(sb, new.groups);
    resize_inode(rw, new, &backups, &mut plan.txn)?;
    let sbb = rw.sb_block();
    plan.txn.insert(
        sbb,
        raw::with_superblock(itable_block(rw, &plan.txn, sbb)?, &nsb, &rw.sb_raw, bs),
    );
    for &g in &backups {
        let fresh = g >= old_groups;
        let blocks = backup_blocks(rw, &nsb, &gdt, g, fresh)?;
        if fresh {
            plan.pre.extend(blocks);
        } else {
            plan.backups.extend(blocks);
        }
    }
    plan.sb = Some(nsb);
    Ok(plan)
}

/// A shrink: the groups from `new.groups` on are dropped, the last kept one cut at
/// `new.blocks`.
fn shrink(rw: &Raw<'_>, new: &Layout) -> Result<Plan> {
    let sb = &rw.sb;
    let bs = rw.bs;
    let keep = new.groups as usize;
    let old_groups = rw.descs.len();
    let itb = sb.inode_table_blocks();
    let ipg = sb.inodes_per_group;
    for (h, d) in rw.descs.iter().enumerate().skip(keep) {
        if !d.has_flag(FLAG_INODE_UNINIT) && d.free_inodes_count != ipg {
            return Err(Error::InvalidInput(format!(
                "group {h}, which the shrink removes, still has inodes in use"
            )));
        }
    }
    // What may lie past the new end: the removed groups' own metadata, and the
    // journal's old blocks (its tail).
    let mut allowed: Vec<(u64, u64)> = Vec::new();
    for h in keep..old_groups {
        let d = &rw.descs[h];
        allowed.push((d.block_bitmap, 1));
        allowed.push((d.inode_bitmap, 1));
        allowed.push((d.inode_table, itb));
        allowed.push((
            sb.group_first_block(h as u64),
            sb.group_base_meta_blocks(h as u64),
        ));
    }
    let jino = sb.journal_inum;
    let (mut jrec, mut jinode) = rw.inode(jino)?;
    let (jexts, jtree) = rw.extents(jino, &jinode)?;
    let jlen = jinode.size / bs;
    let (jlive, jtail): (Vec<Extent>, Vec<Extent>) =
        jexts.iter().partition(|e| u64::from(e.logical) < jlen);
    if jlive
        .iter()
        .any(|e| e.physical + u64::from(e.len) > new.blocks)
        || jtree.iter().any(|&b| b >= new.blocks)
    {
        return Err(Error::InvalidInput(
            "the journal still lies past the new end".into(),
        ));
    }
    for e in &jtail {
        allowed.push((e.physical, u64::from(e.len)));
    }
    allowed.sort_unstable();
    let is_allowed = |blk: u64| {
        let i = allowed.partition_point(|r| r.0 <= blk);
        i > 0 && {
            let (s, l) = allowed[i - 1];
            blk < s + l
        } || allowed.iter().any(|&(s, l)| blk >= s && blk < s + l)
    };
    let last = keep - 1;
    for g in last..old_groups {
        let b = rw.block_bitmap(g as u64)?;
        let first = sb.group_first_block(g as u64);
        let n = sb.blocks_in_group(g as u64);
        for x in 0..n {
            let blk = first + x;
            if blk >= new.blocks && bitmap::test(&b, x) && !is_allowed(blk) {
                return Err(Error::InvalidInput(format!(
                    "block {blk}, past the new end ({} blocks), is still in use",
                    new.blocks
                )));
            }
        }
    }
    let mut bms: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
    let set = |blk: u64, on: bool, bms: &mut BTreeMap<usize, Vec<u8>>| -> Result<()> {
        if blk >= new.blocks {
            return Ok(());
        }
        let g = group_of(sb, blk) as usize;
        let b = match bms.entry(g) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => v.insert(rw.block_bitmap(g as u64)?),
        };
        bitmap::set(b, blk - sb.group_first_block(g as u64), on);
        Ok(())
    };
    // The removed groups' tables that lie in kept groups.
    for h in keep..old_groups {
        let d = &rw.descs[h];
        for (s, len) in [
            (d.block_bitmap, 1),
            (d.inode_bitmap, 1),
            (d.inode_table, itb),
        ] {
            for blk in s..s + len {
                set(blk, false, &mut bms)?;
            }
        }
    }
    // The journal's old blocks, and its tree when it no longer needs one.
    let mut jblocks_dropped = 0u64;
    for e in &jtail {
        for blk in e.physical..e.physical + u64::from(e.len) {
            set(blk, false, &mut bms)?;
        }
        jblocks_dropped += u64::from(e.len);
    }
    let seed = sb
        .metadata_csum()
        .then(|| rext4_format::csum::inode_seed(rw.seed, jino, jinode.generation));
    let mut plan = Plan::default();
    if !jtail.is_empty() {
        let leaf = jtree.first().copied();
        let (root, leaf_block) = raw::encode_tree(&jlive, leaf, bs as usize, seed)?;
        let mut freed_tree = 0u64;
        match leaf_block {
            Some((b, data)) => {
                plan.txn.insert(b, data);
            }
            None => {
                for &b in &jtree {
                    set(b, false, &mut bms)?;
                    freed_tree += 1;
                }
            }
        }
        jinode.block = root;
        jinode.blocks_raw = jinode
            .blocks_raw
            .saturating_sub((jblocks_dropped + freed_tree) * (bs / 512));
        rw.seal_inode(jino, &jinode, &mut jrec);
        let (iblk, ioff) = rw.inode_loc(jino)?;
        let mut itab = itable_block(rw, &plan.txn, iblk)?;
        itab[ioff..ioff + jrec.len()].copy_from_slice(&jrec);
        plan.txn.insert(iblk, itab);
    }
    // The descriptor table's blocks given back: reserved GDT blocks (resize inode),
    // or free when they are more than the reserve holds.
    let old_meta = 1 + sb.desc_blocks() + u64::from(sb.reserved_gdt_blocks);
    let new_meta = 1 + new.desc_blocks + new.reserved_gdt;
    if new_meta < old_meta {
        for g in 0..new.groups {
            if sb.group_has_super(g) {
                let first = sb.group_first_block(g);
                for blk in first + new_meta..first + old_meta {
                    set(blk, false, &mut bms)?;
                }
            }
        }
    }
    // The last group's padding.
    {
        let g = last;
        let b = match bms.entry(g) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => v.insert(rw.block_bitmap(g as u64)?),
        };
        for x in blocks_in(sb, new.blocks, g as u64)..bs * 8 {
            bitmap::set(b, x, true);
        }
    }
    let mut descs: Vec<GroupDesc> = rw.descs[..keep].to_vec();
    for (&g, b) in &bms {
        let d = &mut descs[g];
        d.free_blocks_count = raw::free_in(b, blocks_in(sb, new.blocks, g as u64)) as u32;
        d.flags &= !FLAG_BLOCK_UNINIT;
        d.block_bitmap_csum = rw.bitmap_csum(b, sb.clusters_per_group);
        plan.txn.insert(d.block_bitmap, b.clone());
    }
    let mut nsb = new_superblock(sb, new, &descs);
    if !jtail.is_empty() {
        nsb.jnl_blocks = super::jmove::jnl_backup(&jinode);
    }
    let gdt = gdt_blocks(rw, &descs, new.groups, new.desc_blocks);
    put_gdt(rw, &gdt, &mut plan.txn);
    let backups = layout::backup_groups(sb, new.groups);
    resize_inode(rw, new, &backups, &mut plan.txn)?;
    let sbb = rw.sb_block();
    plan.txn.insert(
        sbb,
        raw::with_superblock(itable_block(rw, &plan.txn, sbb)?, &nsb, &rw.sb_raw, bs),
    );
    for &g in &backups {
        plan.backups
            .extend(backup_blocks(rw, &nsb, &gdt, g, false)?);
    }
    plan.sb = Some(nsb);
    Ok(plan)
}
