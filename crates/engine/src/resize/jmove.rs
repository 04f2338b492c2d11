//! Moving the journal out of the part a shrink removes (before the switch): the log
//! is the one thing the engine cannot move, since its own transactions go there.
//!
//! How: a free run (or runs) of the kept part gets the new log — its superblock written
//! first, outside the filesystem (free blocks) — then one transaction in the OLD log
//! makes the journal inode map the new blocks as its log (logical `0..len`) and keep
//! the old ones past its size as unwritten extents (the "tail"), marks the new blocks
//! used, and updates the superblock's backup of the journal inode's map. The journal
//! inode's table block goes home last: until then a recoverer reads the old map, finds
//! the old log holding the transaction, and replays it. The tail stays owned by the
//! journal inode until the switch drops it with the groups it lies in: a kernel that
//! replays this transaction keeps writing its log where its in-memory journal inode
//! says (the old blocks) until it unmounts, and those blocks must not be free meanwhile.
//!
//! Must hold: the new log's blocks are free and below the new end; the new log starts
//! empty with a sequence number past every transaction the old one held.

use std::collections::BTreeMap;

use rext4_format::bitmap;
use rext4_format::extent::{
    block_capacity, Extent, MAX_INIT_LEN, MAX_UNWRITTEN_LEN, ROOT_CAPACITY,
};
use rext4_format::group::FLAG_BLOCK_UNINIT;
use rext4_format::jbd2::JournalSuperblock;
use rext4_format::superblock::feature;

use super::raw::{self, HomeOrder, Raw};
use crate::error::{Error, Result};

/// Move the log below `new_blocks` when any of it lies at or past it. Returns whether
/// it moved.
pub(crate) fn move_journal(rw: &Raw<'_>, new_blocks: u64) -> Result<bool> {
    let sb = &rw.sb;
    if !sb.has_compat(feature::COMPAT_HAS_JOURNAL) || sb.journal_inum == 0 {
        return Ok(false);
    }
    let ino = sb.journal_inum;
    let bs = rw.bs;
    let (mut rec, mut inode) = rw.inode(ino)?;
    let (exts, tree) = rw.extents(ino, &inode)?;
    let len = inode.size / bs;
    let (live, old_tail): (Vec<Extent>, Vec<Extent>) =
        exts.iter().partition(|e| u64::from(e.logical) < len);
    let beyond = |p: u64, n: u64| p + n > new_blocks;
    if !live.iter().any(|e| beyond(e.physical, u64::from(e.len)))
        && !tree.iter().any(|&b| beyond(b, 1))
    {
        return Ok(false);
    }
    // Free runs of the kept part, in block order.
    let new_groups =
        (new_blocks - u64::from(sb.first_data_block)).div_ceil(u64::from(sb.blocks_per_group));
    let mut bms: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for g in 0..new_groups {
        let b = rw.block_bitmap(g)?;
        let first = sb.group_first_block(g);
        let n = sb.blocks_in_group(g).min(new_blocks - first);
        let mut x = 0;
        while x < n {
            if bitmap::test(&b, x) {
                x += 1;
                continue;
            }
            let s = x;
            while x < n && !bitmap::test(&b, x) {
                x += 1;
            }
            match runs.last_mut() {
                Some((rs, rl)) if *rs + *rl == first + s => *rl += x - s,
                _ => runs.push((first + s, x - s)),
            }
        }
        bms.insert(g, b);
    }
    // One run that holds the whole log when there is one (the first), else the
    // longest runs until it fits.
    let mut pick: Vec<(u64, u64)> = Vec::new();
    if let Some(&(s, _)) = runs.iter().find(|r| r.1 >= len) {
        pick.push((s, len));
    } else {
        let mut by_len = runs.clone();
        by_len.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut need = len;
        for (s, l) in by_len {
            if need == 0 {
                break;
            }
            let take = l.min(need);
            pick.push((s, take));
            need -= take;
        }
        if need > 0 {
            return Err(Error::NoSpace);
        }
        pick.sort();
    }
    let mut new_exts = Vec::new();
    let mut logical = 0u64;
    for &(s, l) in &pick {
        let mut off = 0;
        while off < l {
            let n = (l - off).min(u64::from(MAX_INIT_LEN));
            new_exts.push(Extent {
                logical: logical as u32,
                len: n as u16,
                physical: s + off,
                unwritten: false,
            });
            logical += n;
            off += n;
        }
    }
    // The old log becomes the tail, after any tail an earlier interrupted run left.
    let mut tail = old_tail.clone();
    let mut at = tail.last().map_or(len, |e| e.end()).max(len);
    for e in &live {
        let mut off = 0u64;
        while off < u64::from(e.len) {
            let n = (u64::from(e.len) - off).min(u64::from(MAX_UNWRITTEN_LEN));
            tail.push(Extent {
                logical: at as u32,
                len: n as u16,
                physical: e.physical + off,
                unwritten: true,
            });
            at += n;
            off += n;
        }
    }
    if at > u64::from(u32::MAX) {
        return Err(Error::Unsupported("journal too large to move".into()));
    }
    let mut all = new_exts.clone();
    all.extend(tail.iter().copied());
    let used_by_log: u64 = pick.iter().map(|r| r.1).sum();
    // A leaf block when the extents do not fit in the inode.
    let leaf = if all.len() > usize::from(ROOT_CAPACITY) {
        if all.len() > usize::from(block_capacity(bs as usize)) {
            return Err(Error::Unsupported(format!(
                "the moved journal would take {} extents",
                all.len()
            )));
        }
        let taken = |b: u64| pick.iter().any(|&(s, l)| b >= s && b < s + l);
        let b = runs
            .iter()
            .flat_map(|&(s, l)| s..s + l)
            .find(|&b| !taken(b))
            .ok_or(Error::NoSpace)?;
        Some(b)
    } else {
        None
    };
    let seed = sb
        .metadata_csum()
        .then(|| rext4_format::csum::inode_seed(rw.seed, ino, inode.generation));
    let (root, leaf_block) = raw::encode_tree(&all, leaf, bs as usize, seed)?;

    // Bitmaps: the new log (and leaf) used, the old tree blocks free.
    let mark = |blk: u64, on: bool, bms: &mut BTreeMap<u64, Vec<u8>>| -> Result<()> {
        let g = (blk - u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group);
        let b = match bms.entry(g) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => v.insert(rw.block_bitmap(g)?),
        };
        bitmap::set(b, blk - sb.group_first_block(g), on);
        Ok(())
    };
    let mut touched = std::collections::BTreeSet::new();
    for &(s, l) in &pick {
        for b in s..s + l {
            mark(b, true, &mut bms)?;
            touched.insert((b - u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group));
        }
    }
    if let Some(b) = leaf {
        mark(b, true, &mut bms)?;
        touched.insert((b - u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group));
    }
    for &b in &tree {
        mark(b, false, &mut bms)?;
        touched.insert((b - u64::from(sb.first_data_block)) / u64::from(sb.blocks_per_group));
    }

    let mut txn: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut descs = rw.descs.clone();
    for &g in &touched {
        let b = &bms[&g];
        let d = &mut descs[g as usize];
        d.flags &= !FLAG_BLOCK_UNINIT;
        d.free_blocks_count = raw::free_in(b, sb.blocks_in_group(g)) as u32;
        d.block_bitmap_csum = rw.bitmap_csum(b, sb.clusters_per_group);
        txn.insert(d.block_bitmap, b.clone());
    }
    for (i, block) in super::switch::gdt_blocks(rw, &descs, rw.descs.len() as u64, sb.desc_blocks())
        .into_iter()
        .enumerate()
    {
        if rw.gdt.get(i) != Some(&block) {
            txn.insert(sb.desc_block_location(i as u64), block);
        }
    }
    let tree_delta = tree.len() as u64;
    let new_count = used_by_log + u64::from(leaf.is_some());
    let spb = bs / 512;
    inode.block = root;
    inode.blocks_raw = (inode.blocks_raw + new_count * spb).saturating_sub(tree_delta * spb);
    rw.seal_inode(ino, &inode, &mut rec);
    let (iblk, ioff) = rw.inode_loc(ino)?;
    let mut itab = rw.read(iblk)?;
    itab[ioff..ioff + rec.len()].copy_from_slice(&rec);
    txn.insert(iblk, itab);
    if let Some((b, data)) = leaf_block {
        txn.insert(b, data);
    }
    let mut nsb = sb.clone();
    let free: u64 = descs.iter().map(|d| u64::from(d.free_blocks_count)).sum();
    nsb.free_blocks_count = free;
    nsb.jnl_blocks = jnl_backup(&inode);
    nsb.wtime = super::switch::now_secs();
    nsb.feature_incompat |= feature::INCOMPAT_RECOVER;
    let sbb = rw.sb_block();
    txn.insert(
        sbb,
        raw::with_superblock(rw.read(sbb)?, &nsb, &rw.sb_raw, bs),
    );

    // The new log's superblock, before the commit that makes it the log.
    let first_old = live
        .iter()
        .find(|e| e.logical == 0)
        .ok_or_else(|| Error::corrupted("journal has no block 0", None))?;
    let mut jblock = rw.read(first_old.physical)?;
    let mut jsb = JournalSuperblock::decode(&jblock)?;
    if jsb.start != 0 {
        return Err(Error::InvalidInput(
            "the journal is not empty (recovery needed)".into(),
        ));
    }
    // The transaction below takes the old log's next sequence number.
    jsb.sequence = jsb.sequence.wrapping_add(1);
    jsb.update_checksum();
    jsb.encode(&mut jblock)?;
    let first_new = pick.first().map_or(0, |r| r.0);
    rw.dev.write_at(&jblock, first_new * bs)?;
    rw.dev.flush()?;

    raw::commit(
        rw,
        &txn,
        &HomeOrder {
            first: Vec::new(),
            last: Some(iblk),
        },
        (&nsb, &rw.sb_raw),
        &[],
    )?;
    Ok(true)
}

/// The superblock's backup of the journal inode's map (`s_jnl_blocks`): its i_block
/// words, then i_size's high and low halves.
pub(crate) fn jnl_backup(inode: &rext4_format::inode::Inode) -> [u32; 17] {
    let mut j = [0u32; 17];
    for (i, w) in inode.block.chunks_exact(4).enumerate() {
        j[i] = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
    }
    j[15] = (inode.size >> 32) as u32;
    j[16] = inode.size as u32;
    j
}
