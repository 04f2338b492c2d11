//! mkfs: allocate the initial files in mke2fs's order and write every structure.
//!
//! Order (it decides block numbers): group tables; root directory (inode 2, one
//! block); lost+found (inode 11, grown to 16 KiB or 12 blocks, whichever comes
//! first: `create_lost_and_found`); reserved inodes 1, 3..10; the resize inode's DIND
//! block (goal: after group 0's tables as if unpacked, `res_gdt.c`); the journal
//! (inode 8, from the block returned by `get_midpoint_journal_block`, filling free
//! runs in order, extents of at most 32768 blocks); the MMP block (feature mmp: the
//! first free block, `ext2fs_mmp_init`); the orphan file (inode 12, from the first
//! free block). Then bitmaps, descriptors, backups and the superblock.
//!
//! Must hold: inode records, directory blocks, extent blocks and orphan blocks carry
//! their checksums when metadata_csum is on; reserved inodes 1..10 get zero records
//! with a (16-bit) checksum as mke2fs's `write_reserved_inodes` writes them; backup
//! superblocks carry their group number and a cleared VALID state, like libext2fs.

use std::collections::BTreeMap;

use rext4_format::csum;
use rext4_format::dir::{self, FileType};
use rext4_format::extent::{self, Extent, Header, Index, Node};
use rext4_format::group::{
    DescCsum, GroupDesc, FLAG_BLOCK_UNINIT, FLAG_INODE_UNINIT, FLAG_ITABLE_ZEROED,
};
use rext4_format::inode::{self, flags, mode, Inode, Timestamp};
use rext4_format::jbd2::JournalSuperblock;
use rext4_format::resize::ResizeGeometry;
use rext4_format::superblock::{feature::*, Superblock, FLAG_SIGNED_HASH, FLAG_UNSIGNED_HASH};
use rext4_format::superblock::{SB_OFFSET, SB_SIZE, STATE_VALID};
use rext4_format::{bitmap, orphan};

use super::alloc::Alloc;
use super::geometry::{Geometry, FIRST_INO, INODE_SIZE};
use super::MkfsReport;
use crate::device::BlockDevice;
use crate::error::{Error, Result};

const ROOT_INO: u32 = 2;
const BAD_INO: u32 = 1;
const RESIZE_INO: u32 = 7;
const JOURNAL_INO: u32 = 8;
const LPF_INO: u32 = 11;
const ORPHAN_INO: u32 = 12;
/// Longest initialized extent.
const MAX_EXTENT: u64 = extent::MAX_INIT_LEN as u64;

pub(crate) struct Identity {
    pub uuid: [u8; 16],
    pub hash_seed: [u8; 16],
    pub label: [u8; 16],
    pub now: i64,
    /// uid and gid of the root directory.
    pub root_owner: (u32, u32),
    /// `s_mmp_update_interval` (mke2fs's default 5 with mmp, else 0 unless given).
    pub mmp_update_interval: u16,
    /// The device name the MMP block records (mke2fs: the path it was given).
    pub device_name: Vec<u8>,
    /// `s_encoding_flags` with casefold.
    pub encoding_flags: u16,
}

/// Device writes with a byte counter.
struct Out<'d> {
    dev: &'d dyn BlockDevice,
    bs: u64,
    written: u64,
}

impl Out<'_> {
    fn at(&mut self, offset: u64, buf: &[u8]) -> Result<()> {
        self.dev.write_at(buf, offset)?;
        self.written += buf.len() as u64;
        Ok(())
    }
    fn block(&mut self, blk: u64, buf: &[u8]) -> Result<()> {
        self.at(blk * self.bs, buf)
    }
    fn zero(&mut self, blk: u64, n: u64) -> Result<()> {
        const CHUNK: u64 = 256;
        let buf = vec![0u8; (CHUNK.min(n) * self.bs) as usize];
        let mut done = 0;
        while done < n {
            let k = CHUNK.min(n - done);
            self.block(blk + done, &buf[..(k * self.bs) as usize])?;
            done += k;
        }
        Ok(())
    }
}

/// Physical runs `(start, len)` → extents of at most [`MAX_EXTENT`] blocks.
fn extents_of(runs: &[(u64, u64)]) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    let mut logical = 0u64;
    for &(start, len) in runs {
        let mut done = 0;
        while done < len {
            let phys = start + done;
            let room = MAX_EXTENT;
            if let Some(last) = out.last_mut() {
                let l = u64::from(last.len);
                if last.physical + l == phys && l < room {
                    let k = (room - l).min(len - done);
                    last.len = (l + k) as u16;
                    done += k;
                    logical += k;
                    continue;
                }
            }
            let k = room.min(len - done);
            out.push(Extent {
                logical: logical as u32,
                len: k as u16,
                physical: phys,
                unwritten: false,
            });
            done += k;
            logical += k;
        }
    }
    out
}

/// A file's block map: the 60-byte i_block and, beyond 4 extents, one leaf block; or,
/// without the extent feature, an ext2/3 block map and its indirect blocks.
struct Mapped {
    i_block: [u8; 60],
    leaf: Option<(u64, Vec<Extent>)>,
    /// A block map's indirect blocks and their contents.
    indirect: Vec<(u64, Vec<u8>)>,
    /// EXTENTS_FL, or 0 for a block map.
    flags: u32,
    /// Blocks used, data and tree.
    blocks: u64,
}

/// Map `runs` with extents; a fifth extent needs a leaf block, placed as libext2fs's
/// `extent_node_split` does: the first free block from just before the first extent.
/// The block is taken after the data, which is when libext2fs takes it for the
/// journal (verified at 256 GiB). The orphan file is allocated block by block and
/// fits in the inode on every layout seen; were it to need a leaf, libext2fs would
/// take that block between data blocks and the placement could differ.
fn map_extents(alloc: &mut Alloc, runs: &[(u64, u64)]) -> Result<Mapped> {
    let exts = extents_of(runs);
    let data: u64 = runs.iter().map(|r| r.1).sum();
    let mut i_block = [0u8; 60];
    if exts.len() <= usize::from(extent::ROOT_CAPACITY) {
        let h = Header {
            entries: exts.len() as u16,
            max: extent::ROOT_CAPACITY,
            depth: 0,
            generation: 0,
        };
        Node::Leaf(h, exts).encode_into(&mut i_block);
        return Ok(Mapped {
            i_block,
            leaf: None,
            indirect: Vec::new(),
            flags: flags::EXTENTS,
            blocks: data,
        });
    }
    let cap = extent::block_capacity(alloc.geo.block_size as usize);
    if exts.len() > usize::from(cap) {
        return Err(Error::Unsupported(format!(
            "a file of {} extents needs a deeper extent tree than mkfs builds",
            exts.len()
        )));
    }
    let goal = exts
        .first()
        .map(|e| e.physical.saturating_sub(1))
        .unwrap_or(0);
    let leaf = alloc.take(goal)?;
    // libext2fs splits a full in-inode leaf by copying it out and writing the index
    // over the header and first entry; entries 1..3 stay behind as stale bytes.
    let root_cap = usize::from(extent::ROOT_CAPACITY);
    let h = Header {
        entries: root_cap as u16,
        max: extent::ROOT_CAPACITY,
        depth: 0,
        generation: 0,
    };
    Node::Leaf(h, exts[..root_cap].to_vec()).encode_into(&mut i_block);
    let h = Header {
        entries: 1,
        max: extent::ROOT_CAPACITY,
        depth: 1,
        generation: 0,
    };
    // A buffer of the header and one entry: encode_into writes nothing past it, and
    // leaves the entry's last two bytes (ei_unused) alone.
    let index_len = extent::HEADER_SIZE + extent::ENTRY_SIZE;
    Node::Index(
        h,
        vec![Index {
            logical: 0,
            child: leaf,
        }],
    )
    .encode_into(&mut i_block[..index_len]);
    // ei_unused is written as zero.
    i_block[index_len - 2..index_len].fill(0);
    Ok(Mapped {
        i_block,
        leaf: Some((leaf, exts)),
        indirect: Vec::new(),
        flags: flags::EXTENTS,
        blocks: data + 1,
    })
}

/// The block store of a file mkfs maps without extents: indirect blocks from the
/// allocator (first free at or after the goal, as `ext2fs_alloc_block`), kept in
/// memory until written.
struct MapStore<'a, 'g> {
    alloc: &'a std::cell::RefCell<&'a mut Alloc<'g>>,
    meta: BTreeMap<u64, Vec<u8>>,
    bs: usize,
}

impl crate::store::BlockStore for MapStore<'_, '_> {
    fn block_size(&self) -> usize {
        self.bs
    }
    fn read_meta(&self, blk: u64) -> Result<Vec<u8>> {
        self.meta.get(&blk).cloned().ok_or_else(|| {
            Error::corrupted("mkfs: an indirect block read before written", Some(blk))
        })
    }
    fn write_meta(&mut self, blk: u64, data: &[u8]) -> Result<()> {
        self.meta.insert(blk, data.to_vec());
        Ok(())
    }
    fn alloc(&mut self, goal: u64, _max_len: u32) -> Result<(u64, u32)> {
        Ok((self.alloc.borrow_mut().take(goal)?, 1))
    }
    fn free(&mut self, start: u64, _len: u64) -> Result<()> {
        Err(Error::corrupted("mkfs frees no block", Some(start)))
    }
}

/// Map `len` new blocks of inode `ino` with an ext2/3 block map, allocated as
/// libext2fs's `ext2fs_bmap2(BMAP_ALLOC)` does one block after the other (what
/// `ext2fs_fallocate` does for a file without extents): the first data block at the
/// start of the inode's group, each next one after the previous, and each indirect
/// block, when its range is reached, just after the last block taken — the goals the
/// kernel's allocator uses too (`blockmap_write`). Returns the map and the data runs.
fn map_blocks(alloc: &mut Alloc, ino: u32, len: u64) -> Result<(Mapped, Vec<(u64, u64)>)> {
    let geo = alloc.geo;
    let home = alloc.inode_goal(ino);
    let valid = (geo.first_data_block, geo.blocks_count);
    let cell = std::cell::RefCell::new(alloc);
    let mut store = MapStore {
        alloc: &cell,
        meta: BTreeMap::new(),
        bs: geo.block_size as usize,
    };
    let mut i_block = [0u8; 60];
    let mut sectors = 0u64;
    let mut runs = Vec::new();
    {
        let mut map = crate::blockmap_write::BlockMap::new(
            &mut store,
            &mut i_block,
            &mut sectors,
            home,
            valid,
        );
        let mut l = 0;
        while l < len {
            let mut data = |goal: u64, n: u32| {
                let (s, got) = cell.borrow_mut().take_range(goal, u64::from(n))?;
                Ok((s, got as u32))
            };
            let (p, got) = map.alloc(l, len - l, &mut data)?;
            push_run(&mut runs, p, got);
            l += got;
        }
    }
    let blocks = sectors / (u64::from(geo.block_size) / 512);
    let indirect = store.meta.into_iter().collect();
    Ok((
        Mapped {
            i_block,
            leaf: None,
            indirect,
            flags: 0,
            blocks,
        },
        runs,
    ))
}

/// i_block pointing at `blocks` directly (a block-mapped directory of at most 12).
fn direct_map(blocks: &[u64]) -> [u8; 60] {
    let mut ib = [0u8; 60];
    for (i, b) in blocks.iter().enumerate().take(12) {
        ib[i * 4..i * 4 + 4].copy_from_slice(&(*b as u32).to_le_bytes());
    }
    ib
}

/// `get_midpoint_journal_block` of mkjournal.c.
fn midpoint_journal_goal(alloc: &Alloc) -> u64 {
    let geo = alloc.geo;
    let free = |g: u64| alloc.groups[g as usize].free_blocks;
    let mid = (geo.blocks_count - geo.first_data_block) / 2;
    let mut group = if mid < geo.first_data_block {
        0
    } else {
        geo.group_of(mid)
    };
    let log_flex = 1u64 << geo.log_groups_per_flex;
    let start;
    if geo.log_groups_per_flex != 0 && group > log_flex {
        group &= !(log_flex - 1);
        while group < geo.groups && free(group) == 0 {
            group += 1;
        }
        if group == geo.groups {
            group = 0;
        }
        start = group;
    } else {
        start = group.saturating_sub(1);
    }
    let end = if group + 1 < geo.groups {
        group + 1
    } else {
        group
    };
    let mut best = start;
    for g in start + 1..=end {
        if free(g) > free(best) {
            best = g;
        }
    }
    geo.group_first(best)
}

struct Files {
    root_blk: u64,
    lpf_blks: Vec<u64>,
    dind: Option<u64>,
    journal: Option<Mapped>,
    journal_runs: Vec<(u64, u64)>,
    orphan: Option<Mapped>,
    orphan_runs: Vec<(u64, u64)>,
    /// The MMP block (feature mmp).
    mmp: Option<u64>,
    overhead: u64,
}

fn push_run(runs: &mut Vec<(u64, u64)>, blk: u64, n: u64) {
    match runs.last_mut() {
        Some(r) if r.0 + r.1 == blk => r.1 += n,
        _ => runs.push((blk, n)),
    }
}

/// Allocate everything in mke2fs's order; returns where things went.
fn allocate(alloc: &mut Alloc) -> Result<Files> {
    let geo = alloc.geo;
    let bs = u64::from(geo.block_size);
    alloc.allocate_tables()?;
    let overhead_tables = alloc.used_blocks() + geo.first_data_block;

    // create_root_dir
    let root_blk = alloc.take(alloc.inode_goal(ROOT_INO))?;
    alloc.take_inode(ROOT_INO, true);
    // create_lost_and_found: mkdir, then expand until 16 KiB (at most 12 blocks).
    alloc.new_inode_group(LPF_INO);
    alloc.take_inode(LPF_INO, true);
    let mut lpf_blks = vec![alloc.take(alloc.inode_goal(LPF_INO))?];
    let mut lpf_size = 0u64;
    // With inline_data, mkdir leaves lost+found in its inode and the first expansion
    // only moves it to a block: one block fewer (11 at 1 KiB, 3 at 4 KiB).
    let mut expansions = u32::from(geo.features.has_incompat(INCOMPAT_INLINE_DATA));
    for _ in 1..12 {
        lpf_size += bs;
        if lpf_size >= 16 * 1024 && lpf_size >= 2 * bs {
            break;
        }
        if expansions > 0 {
            expansions -= 1;
            continue;
        }
        let last = *lpf_blks.last().unwrap_or(&0);
        lpf_blks.push(alloc.take(last)?);
    }
    // reserve_inodes, create_bad_block_inode
    for ino in ROOT_INO + 1..FIRST_INO {
        alloc.take_inode(ino, false);
    }
    alloc.take_inode(BAD_INO, false);
    // ext2fs_create_resize_inode
    let dind = if geo.features.has_compat(COMPAT_RESIZE_INODE) {
        let goal = geo.first_data_block
            + geo.desc_blocks
            + u64::from(geo.reserved_gdt_blocks)
            + 2
            + geo.inode_blocks_per_group;
        Some(alloc.take(goal)?)
    } else {
        None
    };
    // The journal.
    let mut journal_runs = Vec::new();
    let mut overhead = overhead_tables;
    let journal = if geo.journal_blocks > 0 {
        let want = u64::from(geo.journal_blocks);
        overhead += want;
        if geo.features.has_incompat(INCOMPAT_EXTENTS) {
            let mut goal = midpoint_journal_goal(alloc);
            let mut got = 0;
            while got < want {
                let (start, n) = alloc.take_range(goal, want - got)?;
                push_run(&mut journal_runs, start, n);
                got += n;
                goal = start + n;
            }
            Some(map_extents(alloc, &journal_runs)?)
        } else {
            // ext2fs_fallocate of a file without extents ignores the midpoint goal:
            // block by block from the start of the inode's group.
            let (m, runs) = map_blocks(alloc, JOURNAL_INO, want)?;
            journal_runs = runs;
            Some(m)
        }
    } else {
        None
    };
    // The MMP block (`ext2fs_mmp_init`): the first free block, not counted as
    // overhead.
    let mmp = if geo.features.has_incompat(INCOMPAT_MMP) {
        Some(alloc.take(0)?)
    } else {
        None
    };
    // The orphan file: block by block from the first free block.
    let mut orphan_runs = Vec::new();
    let orphan = if geo.orphan_blocks > 0 {
        alloc.new_inode_group(ORPHAN_INO);
        alloc.take_inode(ORPHAN_INO, false);
        let mut last = 0;
        for _ in 0..geo.orphan_blocks {
            last = alloc.take(last)?;
            push_run(&mut orphan_runs, last, 1);
        }
        Some(map_extents(alloc, &orphan_runs)?)
    } else {
        None
    };
    Ok(Files {
        root_blk,
        lpf_blks,
        dind,
        journal,
        journal_runs,
        orphan,
        orphan_runs,
        mmp,
        overhead,
    })
}

/// A fresh in-memory inode record.
fn blank_inode() -> Result<Inode> {
    Ok(Inode::decode(&[0u8; INODE_SIZE as usize])?)
}

struct Records<'a> {
    geo: &'a Geometry,
    seed: u32,
    now: Timestamp,
    map: BTreeMap<u32, Vec<u8>>,
}

impl Records<'_> {
    /// Store `ino`'s record, checksummed when metadata_csum is on.
    fn put(&mut self, ino: u32, i: &Inode) {
        self.put_with(ino, i, |_| {});
    }

    /// [`Self::put`], `f` changing the record's bytes before the checksum.
    fn put_with(&mut self, ino: u32, i: &Inode, f: impl FnOnce(&mut [u8])) {
        let mut b = vec![0u8; INODE_SIZE as usize];
        i.encode_into(&mut b);
        f(&mut b);
        if self.geo.metadata_csum() {
            inode::set_csum(&mut b, ino, self.seed);
        }
        self.map.insert(ino, b);
    }

    /// An inode as `ext2fs_write_new_inode` finishes it: all times now, extra fields.
    fn new_file(&self, mode_bits: u16, links: u16, size: u64, blocks: u64) -> Result<Inode> {
        let mut i = blank_inode()?;
        i.mode = mode_bits;
        i.links_count = links;
        i.size = size;
        i.blocks_raw = blocks * u64::from(self.geo.block_size) / 512;
        i.atime = self.now;
        i.ctime = self.now;
        i.mtime = self.now;
        i.crtime = Some(self.now);
        i.extra_isize = 32;
        Ok(i)
    }
}

pub(crate) fn build(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    id: &Identity,
    zeroed: bool,
) -> Result<MkfsReport> {
    let bs = u64::from(geo.block_size);
    let bsz = geo.block_size as usize;
    let csum_on = geo.metadata_csum();
    let group_csum = geo.group_csum();
    let extents = geo.features.has_incompat(INCOMPAT_EXTENTS);
    let mut alloc = Alloc::new(geo);
    let files = allocate(&mut alloc)?;
    alloc.finish_group_csum();
    // write_inode_tables: with a zeroed device the tables count as zeroed.
    if zeroed {
        for g in alloc.groups.iter_mut() {
            g.flags |= FLAG_ITABLE_ZEROED;
        }
    }
    let seed = csum::fs_seed(&id.uuid, None);
    let now = Timestamp {
        sec: id.now,
        nsec: 0,
    };
    let mut out = Out {
        dev,
        bs,
        written: 0,
    };
    let mut rec = Records {
        geo,
        seed,
        now,
        map: BTreeMap::new(),
    };

    // Reserved inodes as write_reserved_inodes leaves them (metadata_csum only).
    if csum_on {
        for ino in 1..FIRST_INO {
            rec.put(ino, &blank_inode()?);
        }
    }
    // Inode 1: ext2fs_update_bb_inode sets its times on the 128-byte record.
    let mut bad = blank_inode()?;
    bad.atime = now;
    bad.mtime = now;
    bad.ctime = now;
    rec.put(BAD_INO, &bad);

    let ext_root = |blk: u64, len: u64| -> [u8; 60] {
        let mut ib = [0u8; 60];
        let h = Header {
            entries: 1,
            max: extent::ROOT_CAPACITY,
            depth: 0,
            generation: 0,
        };
        let e = Extent {
            logical: 0,
            len: len as u16,
            physical: blk,
            unwritten: false,
        };
        Node::Leaf(h, vec![e]).encode_into(&mut ib);
        ib
    };
    let dir_seed = |ino: u32| csum::inode_seed(seed, ino, 0);

    // Root directory: ".", "..", "lost+found".
    let mut blk = vec![0u8; bsz];
    dir::init_block(&mut blk, ROOT_INO, ROOT_INO, csum_on);
    dir::insert_entry(
        &mut blk,
        LPF_INO,
        b"lost+found",
        FileType::Directory,
        csum_on,
    )?
    .ok_or_else(|| Error::corrupted("mkfs: no room for lost+found in /", None))?;
    if csum_on {
        dir::set_leaf_csum(&mut blk, dir_seed(ROOT_INO))?;
    }
    out.block(files.root_blk, &blk)?;
    let mut root = rec.new_file(mode::S_IFDIR | 0o755, 3, bs, 1)?;
    if extents {
        root.flags = flags::EXTENTS;
        root.block = ext_root(files.root_blk, 1);
    } else {
        root.block = direct_map(&[files.root_blk]);
    }
    (root.uid, root.gid) = id.root_owner;
    rec.put(ROOT_INO, &root);

    // lost+found.
    let inline = geo.features.has_incompat(INCOMPAT_INLINE_DATA);
    for (i, &b) in files.lpf_blks.iter().enumerate() {
        if i == 0 {
            dir::init_block(&mut blk, LPF_INO, ROOT_INO, csum_on);
            if inline {
                // Made inline, then moved to a block: "..", 12 bytes, is followed
                // by the inline area's empty record stretched to the end.
                let end = bsz - if csum_on { dir::TAIL_LEN } else { 0 };
                rext4_format::bytes::set_le16(&mut blk, 12 + dir::DIRENT_REC_LEN, 12);
                rext4_format::bytes::set_le32(&mut blk, 24 + dir::DIRENT_INODE, 0);
                rext4_format::bytes::set_le16(
                    &mut blk,
                    24 + dir::DIRENT_REC_LEN,
                    dir::rec_len_to_disk(end - 24, bsz),
                );
            }
        } else {
            dir::init_empty_leaf(&mut blk, csum_on);
        }
        if csum_on {
            dir::set_leaf_csum(&mut blk, dir_seed(LPF_INO))?;
        }
        out.block(b, &blk)?;
    }
    let n = files.lpf_blks.len() as u64;
    let mut lpf = rec.new_file(mode::S_IFDIR | 0o700, 2, n * bs, n)?;
    if extents {
        lpf.flags = flags::EXTENTS;
        let mut runs = Vec::new();
        for &b in &files.lpf_blks {
            push_run(&mut runs, b, 1);
        }
        lpf.block = map_extents_fixed(&runs)?;
    } else {
        lpf.block = direct_map(&files.lpf_blks);
    }
    if inline {
        // The move out of the inode leaves its xattr area's header (no entry).
        rec.put_with(LPF_INO, &lpf, |r| {
            rext4_format::bytes::set_le32(r, 128 + 32, rext4_format::xattr::MAGIC)
        });
    } else {
        rec.put(LPF_INO, &lpf);
    }

    // Resize inode 7: DIND + the primary reserved GDT blocks as IND blocks.
    let backups = geo.backup_groups();
    if let Some(dind) = files.dind {
        let rg = ResizeGeometry {
            bs: geo.block_size,
            first_data_block: geo.first_data_block as u32,
            blocks_per_group: geo.blocks_per_group as u32,
            desc_blocks: geo.desc_blocks as u32,
            reserved_gdt_blocks: geo.reserved_gdt_blocks,
            backup_groups: backups.iter().map(|&g| g as u32).collect(),
        };
        let words = |v: Vec<u32>| -> Vec<u8> { v.iter().flat_map(|w| w.to_le_bytes()).collect() };
        out.block(dind, &words(rg.expected_dind()?))?;
        for j in 0..geo.reserved_gdt_blocks {
            let b = rg.primary_reserved_gdt_block(j)?;
            out.block(u64::from(b), &words(rg.expected_ind(j)?))?;
        }
        let apb = bs / 4;
        let count = 1 + u64::from(geo.reserved_gdt_blocks) * (1 + backups.len() as u64);
        let size = (apb * apb + apb + 12) * bs;
        let mut ri = rec.new_file(mode::S_IFREG | 0o600, 1, size, count)?;
        let mut ib = [0u8; 60];
        ib[13 * 4..14 * 4].copy_from_slice(&(dind as u32).to_le_bytes());
        ri.block = ib;
        rec.put(RESIZE_INO, &ri);
    }

    // Journal inode 8.
    let mut jnl_blocks = [0u32; 17];
    if let Some(j) = &files.journal {
        let len = u64::from(geo.journal_blocks);
        let first = files.journal_runs.first().map(|r| r.0).unwrap_or(0);
        let jsb = JournalSuperblock::new(geo.block_size, geo.journal_blocks, id.uuid);
        let mut b = vec![0u8; bsz];
        jsb.encode(&mut b)?;
        out.block(first, &b)?;
        if !zeroed {
            let mut skip_first = true;
            for &(s, n) in &files.journal_runs {
                let (s, n) = if skip_first { (s + 1, n - 1) } else { (s, n) };
                skip_first = false;
                out.zero(s, n)?;
            }
        }
        write_leaf(&mut out, geo, j, csum::inode_seed(seed, JOURNAL_INO, 0))?;
        for (b, d) in &j.indirect {
            out.block(*b, d)?;
        }
        let mut ji = rec.new_file(mode::S_IFREG | 0o600, 1, len * bs, j.blocks)?;
        ji.flags = j.flags;
        ji.block = j.i_block;
        rec.put(JOURNAL_INO, &ji);
        for (k, w) in j.i_block.chunks_exact(4).enumerate() {
            jnl_blocks[k] = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        }
        let size = len * bs;
        jnl_blocks[15] = (size >> 32) as u32;
        jnl_blocks[16] = size as u32;
    }

    // Orphan file inode 12.
    if let Some(o) = &files.orphan {
        let fseed = csum::inode_seed(seed, ORPHAN_INO, 0);
        let mut b = vec![0u8; bsz];
        for &(s, n) in &files.orphan_runs {
            for blk in s..s + n {
                orphan::init_block(&mut b);
                if csum_on {
                    orphan::set_block_csum(&mut b, fseed, blk);
                }
                out.block(blk, &b)?;
            }
        }
        write_leaf(&mut out, geo, o, fseed)?;
        let len = u64::from(geo.orphan_blocks);
        let mut oi = rec.new_file(mode::S_IFREG | 0o600, 1, len * bs, o.blocks)?;
        oi.flags = o.flags;
        oi.block = o.i_block;
        rec.put(ORPHAN_INO, &oi);
    }

    // The MMP block: clean, as `ext2fs_mmp_reset` leaves it (written at mkfs time,
    // by this host, for this device).
    if let Some(blk) = files.mmp {
        let m = rext4_format::mmp::MmpBlock::new(
            rext4_format::mmp::SEQ_CLEAN,
            id.now.max(0) as u64,
            &crate::mmp::nodename(),
            &id.device_name,
            id.mmp_update_interval
                .max(rext4_format::mmp::MIN_CHECK_INTERVAL),
        );
        let mut b = vec![0u8; bsz];
        m.encode_into(&mut b, csum_on.then_some(seed))?;
        out.block(blk, &b)?;
    }

    // Inode tables: the blocks holding records (plus, on a device that is not known
    // to be zero, every block lazy init would not zero later).
    let ipg = u64::from(geo.inodes_per_group);
    let per_block = bs / u64::from(INODE_SIZE);
    if !zeroed {
        for g in &alloc.groups {
            let unused = if group_csum {
                u64::from(g.itable_unused)
            } else {
                0
            };
            let n = ((ipg - unused) * u64::from(INODE_SIZE)).div_ceil(bs);
            out.zero(g.inode_table, n)?;
        }
    }
    let mut itable: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for (&ino, r) in &rec.map {
        let idx = u64::from(ino - 1);
        let g = (idx / ipg) as usize;
        let blk = alloc.groups[g].inode_table + (idx % ipg) / per_block;
        let off = ((idx % ipg) % per_block) as usize * INODE_SIZE as usize;
        let b = itable.entry(blk).or_insert_with(|| vec![0u8; bsz]);
        b[off..off + INODE_SIZE as usize].copy_from_slice(r);
    }
    for (blk, b) in &itable {
        out.block(*blk, b)?;
    }

    // Bitmaps and descriptors.
    let kind = if csum_on {
        DescCsum::Crc32c { seed }
    } else if group_csum {
        DescCsum::Crc16 { uuid: id.uuid }
    } else {
        DescCsum::None
    };
    let dsz = geo.desc_size as usize;
    let mut gdt = vec![0u8; (geo.desc_blocks * bs) as usize];
    for (g, grp) in alloc.groups.iter().enumerate() {
        let mut d = GroupDesc {
            block_bitmap: grp.block_bitmap,
            inode_bitmap: grp.inode_bitmap,
            inode_table: grp.inode_table,
            free_blocks_count: grp.free_blocks as u32,
            free_inodes_count: grp.free_inodes,
            used_dirs_count: grp.used_dirs,
            flags: grp.flags,
            itable_unused: grp.itable_unused,
            ..GroupDesc::default()
        };
        if !(group_csum && grp.flags & FLAG_BLOCK_UNINIT != 0) {
            let b = alloc.block_bitmap(g as u64);
            if csum_on {
                d.block_bitmap_csum = bitmap::compute_csum(&b, geo.blocks_per_group as u32, seed);
            }
            out.block(grp.block_bitmap, &b)?;
        }
        if !(group_csum && grp.flags & FLAG_INODE_UNINIT != 0) {
            let b = alloc.inode_bitmap(g as u64);
            if csum_on {
                d.inode_bitmap_csum = bitmap::compute_csum(&b, geo.inodes_per_group, seed);
            }
            out.block(grp.inode_bitmap, &b)?;
        }
        d.encode_into(&mut gdt[g * dsz..(g + 1) * dsz], dsz, g as u32, kind);
    }
    for g in std::iter::once(0).chain(backups.iter().copied()) {
        out.block(geo.group_first(g) + 1, &gdt)?;
    }

    // Superblocks.
    let mut sb = Superblock::decode_unchecked(&[0u8; SB_SIZE]);
    sb.inodes_count = geo.inodes_count;
    sb.blocks_count = geo.blocks_count;
    sb.r_blocks_count = geo.r_blocks_count;
    sb.free_blocks_count = alloc.free_blocks;
    sb.free_inodes_count = alloc.free_inodes;
    sb.first_data_block = geo.first_data_block as u32;
    sb.log_block_size = geo.log_block_size;
    sb.log_cluster_size = geo.log_block_size;
    sb.blocks_per_group = geo.blocks_per_group as u32;
    sb.clusters_per_group = geo.blocks_per_group as u32;
    sb.inodes_per_group = geo.inodes_per_group;
    sb.wtime = id.now;
    sb.max_mnt_count = -1;
    sb.state = STATE_VALID;
    sb.errors = 1;
    sb.lastcheck = id.now;
    sb.rev_level = 1;
    sb.first_ino = FIRST_INO;
    sb.inode_size = INODE_SIZE as u16;
    sb.feature_compat = geo.features.compat;
    sb.feature_incompat = geo.features.incompat;
    sb.feature_ro_compat = geo.features.ro_compat;
    sb.uuid = id.uuid;
    sb.volume_name = id.label;
    sb.reserved_gdt_blocks = geo.reserved_gdt_blocks as u16;
    for (i, h) in sb.hash_seed.iter_mut().enumerate() {
        let c = &id.hash_seed[4 * i..4 * i + 4];
        *h = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    sb.def_hash_version = 1; // half_md4
    if files.journal.is_some() {
        sb.journal_inum = JOURNAL_INO;
        sb.jnl_backup_type = 1; // EXT3_JNL_BACKUP_BLOCKS
        sb.jnl_blocks = jnl_blocks;
    }
    sb.desc_size = if geo.features.has_incompat(INCOMPAT_64BIT) {
        geo.desc_size as u16
    } else {
        0
    };
    sb.default_mount_opts = 0xC; // user_xattr, acl
    sb.mkfs_time = id.now;
    sb.min_extra_isize = 32;
    sb.want_extra_isize = 32;
    // mke2fs tests how `char` behaves on the machine it runs on.
    sb.flags = if std::ffi::c_char::MIN != 0 {
        FLAG_SIGNED_HASH
    } else {
        FLAG_UNSIGNED_HASH
    };
    sb.log_groups_per_flex = geo.log_groups_per_flex;
    if csum_on {
        sb.checksum_type = 1;
    }
    sb.overhead_clusters = files.overhead as u32;
    if geo.features.has_incompat(INCOMPAT_CSUM_SEED) {
        sb.checksum_seed = seed;
    }
    if files.orphan.is_some() {
        sb.orphan_file_inum = ORPHAN_INO;
    }
    sb.mmp_interval = id.mmp_update_interval;
    if geo.features.has_incompat(INCOMPAT_CASEFOLD) {
        sb.encoding = rext4_format::casefold::ENCODING_UTF8_12_1;
        sb.encoding_flags = id.encoding_flags;
    }
    if let Some(blk) = files.mmp {
        sb.mmp_block = blk;
    }
    sb.kbytes_written = out.written >> 10;

    let mut raw = vec![0u8; SB_SIZE];
    let mut backup_blocks = Vec::new();
    for &g in &backups {
        let mut b = sb.clone();
        b.block_group_nr = g as u16;
        b.state &= !STATE_VALID;
        raw.fill(0);
        b.encode_into(&mut raw);
        let blk = geo.group_first(g);
        backup_blocks.push(blk);
        if bsz > SB_SIZE && !zeroed {
            let mut full = vec![0u8; bsz];
            full[..SB_SIZE].copy_from_slice(&raw);
            out.block(blk, &full)?;
        } else {
            out.block(blk, &raw)?;
        }
    }
    if !zeroed && bsz > 2 * SB_SIZE {
        out.at(2 * SB_SIZE as u64, &vec![0u8; bsz - 2 * SB_SIZE])?;
    }
    raw.fill(0);
    sb.encode_into(&mut raw);
    out.at(SB_OFFSET, &raw)?;
    dev.flush()?;

    Ok(MkfsReport {
        size_type: geo.size_type,
        block_size: geo.block_size,
        blocks_count: geo.blocks_count,
        reserved_blocks: geo.r_blocks_count,
        inodes_count: geo.inodes_count,
        groups: geo.groups,
        blocks_per_group: geo.blocks_per_group,
        inodes_per_group: geo.inodes_per_group,
        reserved_gdt_blocks: geo.reserved_gdt_blocks,
        journal_blocks: geo.journal_blocks,
        orphan_file_blocks: geo.orphan_blocks,
        features: geo.features,
        uuid: id.uuid,
        hash_seed: id.hash_seed,
        superblock_backups: backup_blocks,
        free_blocks: alloc.free_blocks,
        free_inodes: alloc.free_inodes,
        overhead_blocks: files.overhead,
        bytes_written: out.written,
        warnings: Vec::new(),
    })
}

/// i_block for runs that must fit the inode (lost+found).
fn map_extents_fixed(runs: &[(u64, u64)]) -> Result<[u8; 60]> {
    let exts = extents_of(runs);
    if exts.len() > usize::from(extent::ROOT_CAPACITY) {
        return Err(Error::Unsupported(
            "lost+found would need an extent tree".into(),
        ));
    }
    let mut ib = [0u8; 60];
    let h = Header {
        entries: exts.len() as u16,
        max: extent::ROOT_CAPACITY,
        depth: 0,
        generation: 0,
    };
    Node::Leaf(h, exts).encode_into(&mut ib);
    Ok(ib)
}

/// Write a mapped file's extent leaf block, if it has one.
fn write_leaf(out: &mut Out, geo: &Geometry, m: &Mapped, inode_seed: u32) -> Result<()> {
    if let Some((blk, exts)) = &m.leaf {
        let mut b = vec![0u8; geo.block_size as usize];
        let h = Header {
            entries: exts.len() as u16,
            max: extent::block_capacity(b.len()),
            depth: 0,
            generation: 0,
        };
        Node::Leaf(h, exts.clone()).encode_into(&mut b);
        if geo.metadata_csum() {
            extent::set_csum(&mut b, inode_seed);
        }
        out.block(*blk, &b)?;
    }
    Ok(())
}
