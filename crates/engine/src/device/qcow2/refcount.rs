//! Refcounts of a qcow2 image opened read-write: the refcount table, a cache of
//! refcount blocks (raw bytes, entries of 1 to 64 bits), and cluster allocation
//! (the first free cluster from a hint, new refcount blocks, the table moved to a
//! bigger one). Changes stay in memory (blocks marked dirty, table entries listed)
//! until a flush writes them in the order the module note gives. Called with
//! `Qcow2::meta` held.

use std::collections::{BTreeSet, HashMap};
use std::io;

use super::{invalid, read_exact, Meta, Qcow2, OFFSET_MASK};

/// Bytes of refcount blocks kept in the cache (dirty ones stay until written).
const RC_CACHE_BYTES: u64 = 32 << 20;
/// qemu's bound on the refcount table (QCOW_MAX_REFTABLE_SIZE).
pub(super) const MAX_TABLE_BYTES: u64 = 8 << 20;

pub(super) struct Refcounts {
    /// Entries are `1 << order` bits wide.
    pub order: u32,
    pub table_off: u64,
    pub table_clusters: u64,
    /// Refcount block offsets (bits 9-63; 0: no block, all its refcounts 0).
    pub table: Vec<u64>,
    /// Entries changed since the last flush (the table did not move).
    pub table_dirty: BTreeSet<usize>,
    /// The table moved since the last flush, from `(offset, clusters)`: the flush
    /// writes all of it and points the header at it, then frees the old one.
    pub moved_from: Option<(u64, u64)>,
    /// Refcount blocks by host offset.
    pub blocks: HashMap<u64, Block>,
    /// No cluster below this one is free.
    pub hint: u64,
}

pub(super) struct Block {
    pub b: Vec<u8>,
    pub ver: u64,
    pub dirty: bool,
}

/// Entry `i` of a refcount block of `1 << order`-bit entries (sub-byte entries from
/// the least significant bit; wider ones big-endian).
pub(super) fn get(b: &[u8], order: u32, i: usize) -> u64 {
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per = 8 / bits;
            u64::from(b[i / per] >> ((i % per) * bits)) & ((1 << bits) - 1)
        }
        3 => u64::from(b[i]),
        4 => u64::from(u16::from_be_bytes([b[2 * i], b[2 * i + 1]])),
        5 => {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[4 * i..4 * i + 4]);
            u64::from(u32::from_be_bytes(a))
        }
        _ => {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[8 * i..8 * i + 8]);
            u64::from_be_bytes(a)
        }
    }
}

/// Set entry `i` (the caller keeps `v` within [`max`]).
pub(super) fn set(b: &mut [u8], order: u32, i: usize, v: u64) {
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per = 8 / bits;
            let shift = (i % per) * bits;
            let mask = (((1u16 << bits) - 1) as u8) << shift;
            b[i / per] = (b[i / per] & !mask) | (((v as u8) << shift) & mask);
        }
        3 => b[i] = v as u8,
        4 => b[2 * i..2 * i + 2].copy_from_slice(&(v as u16).to_be_bytes()),
        5 => b[4 * i..4 * i + 4].copy_from_slice(&(v as u32).to_be_bytes()),
        _ => b[8 * i..8 * i + 8].copy_from_slice(&v.to_be_bytes()),
    }
}

fn rc(m: &mut Meta) -> io::Result<&mut Refcounts> {
    m.rc.as_mut().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            "qcow2 image opened read-only",
        )
    })
}

impl Qcow2 {
    /// Refcount entries per block.
    pub(super) fn rc_entries(&self, order: u32) -> u64 {
        (self.cs() * 8) >> order
    }

    /// The host offset of refcount block `ti`, loaded into the cache; `None` when
    /// the table has no block there (or ends before).
    pub(super) fn rc_block(&self, m: &mut Meta, ti: u64) -> io::Result<Option<u64>> {
        let cs = self.cs();
        let file_len = m.file_len;
        let cache_blocks = (RC_CACHE_BYTES >> self.cluster_bits).max(16) as usize;
        let r = rc(m)?;
        let Some(&e) = r.table.get(ti as usize) else {
            return Ok(None);
        };
        let off = e & !511;
        if off == 0 {
            return Ok(None);
        }
        if r.blocks.contains_key(&off) {
            return Ok(Some(off));
        }
        if !off.is_multiple_of(cs) || off.saturating_add(cs) > file_len {
            return Err(invalid(format!(
                "{}: refcount block {ti} at {off} is not a cluster inside the file",
                self.path.display()
            )));
        }
        let mut b = vec![0u8; cs as usize];
        read_exact(&*self.host, &mut b, off)?;
        if r.blocks.len() >= cache_blocks {
            r.blocks.retain(|_, b| b.dirty);
        }
        r.blocks.insert(
            off,
            Block {
                b,
                ver: 0,
                dirty: false,
            },
        );
        Ok(Some(off))
    }

    /// The refcount of host cluster `c`.
    pub(super) fn refcount(&self, m: &mut Meta, c: u64) -> io::Result<u64> {
        let order = rc(m)?.order;
        let per = self.rc_entries(order);
        let Some(off) = self.rc_block(m, c / per)? else {
            return Ok(0);
        };
        let r = rc(m)?;
        Ok(r.blocks
            .get(&off)
            .map_or(0, |b| get(&b.b, order, (c % per) as usize)))
    }

    /// Set the refcount of host cluster `c`, whose refcount block exists.
    pub(super) fn set_refcount(&self, m: &mut Meta, c: u64, v: u64) -> io::Result<()> {
        let order = rc(m)?.order;
        let per = self.rc_entries(order);
        let off = self.rc_block(m, c / per)?.ok_or_else(|| {
            invalid(format!(
                "{}: host cluster {c} has no refcount block",
                self.path.display()
            ))
        })?;
        let ver = m.bump();
        let r = rc(m)?;
        let Some(b) = r.blocks.get_mut(&off) else {
            return Err(invalid(format!(
                "{}: refcount block at {off} left the cache",
                self.path.display()
            )));
        };
        set(&mut b.b, order, (c % per) as usize, v);
        b.ver = ver;
        if !b.dirty {
            b.dirty = true;
            m.dirty_tables += 1;
        }
        Ok(())
    }

    /// Drop one reference to host cluster `c`; true when it is free now.
    pub(super) fn decrement(&self, m: &mut Meta, c: u64) -> io::Result<bool> {
        let r = self.refcount(m, c)?;
        if r == 0 {
            return Err(invalid(format!(
                "{}: freeing host cluster {c}, whose refcount is already 0",
                self.path.display()
            )));
        }
        self.set_refcount(m, c, r - 1)?;
        if r == 1 {
            let rc = rc(m)?;
            rc.hint = rc.hint.min(c);
        }
        Ok(r == 1)
    }

    /// Allocate up to `want` contiguous free host clusters (at least one): their
    /// refcounts set to 1. Returns (first cluster, count).
    pub(super) fn alloc(&self, m: &mut Meta, want: u64) -> io::Result<(u64, u64)> {
        let order = rc(m)?.order;
        let per = self.rc_entries(order);
        let mut c = rc(m)?.hint;
        loop {
            let ti = c / per;
            if ti >= rc(m)?.table.len() as u64 {
                self.grow_table(m, ti)?;
                continue;
            }
            let Some(off) = self.rc_block(m, ti)? else {
                self.new_block(m, ti)?;
                continue;
            };
            let r = rc(m)?;
            let Some(b) = r.blocks.get(&off) else {
                return Err(invalid(format!(
                    "{}: refcount block at {off} left the cache",
                    self.path.display()
                )));
            };
            let from = (c % per) as usize;
            let Some(i) = (from..per as usize).find(|&i| get(&b.b, order, i) == 0) else {
                c = (ti + 1) * per;
                continue;
            };
            let mut n = 1u64;
            while n < want && (i as u64 + n) < per && get(&b.b, order, i + n as usize) == 0 {
                n += 1;
            }
            let first = ti * per + i as u64;
            let end_bytes = (first + n) << self.cluster_bits;
            if end_bytes > OFFSET_MASK {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "{}: qcow2 image would grow past 64 PiB",
                        self.path.display()
                    ),
                ));
            }
            for k in 0..n {
                self.set_refcount(m, first + k, 1)?;
            }
            rc(m)?.hint = first + n;
            m.file_len = m.file_len.max(end_bytes);
            return Ok((first, n));
        }
    }

    /// A refcount block for table entry `ti` (whose range has no allocated cluster),
    /// in the first cluster of its own range, counting itself.
    fn new_block(&self, m: &mut Meta, ti: u64) -> io::Result<()> {
        let order = rc(m)?.order;
        let per = self.rc_entries(order);
        let c = ti * per;
        if c == 0 {
            return Err(invalid(format!(
                "{}: the refcount table has no block for the header cluster",
                self.path.display()
            )));
        }
        let off = c << self.cluster_bits;
        let mut b = vec![0u8; self.cs() as usize];
        set(&mut b, order, 0, 1);
        let ver = m.bump();
        m.dirty_tables += 1;
        m.file_len = m.file_len.max(off + self.cs());
        let r = rc(m)?;
        r.blocks.insert(
            off,
            Block {
                b,
                ver,
                dirty: true,
            },
        );
        r.table[ti as usize] = off;
        r.table_dirty.insert(ti as usize);
        Ok(())
    }

    /// Move the refcount table to a bigger one that has entry `need`: placed at the
    /// first cluster the old one does not cover, followed by the new refcount blocks
    /// that count it and themselves (nothing is allocated at or past that cluster).
    /// The old table is freed after the flush that points the header at the new.
    fn grow_table(&self, m: &mut Meta, need: u64) -> io::Result<()> {
        let cs = self.cs();
        let per_cluster = cs / 8;
        let order = rc(m)?.order;
        let per = self.rc_entries(order);
        let old_len = rc(m)?.table.len() as u64;
        let start = old_len * per;
        let mut len = (old_len * 2).max(need + 1).max(per_cluster);
        len = len.div_ceil(per_cluster) * per_cluster;
        let (n_table, n_blocks) = loop {
            let n_table = len / per_cluster;
            let mut nb = 1u64;
            while nb * per < n_table + nb {
                nb += 1;
            }
            if old_len + nb <= len && need < len {
                break (n_table, nb);
            }
            len += per_cluster;
        };
        if len * 8 > MAX_TABLE_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "{}: the qcow2 refcount table would pass qemu's 8 MiB bound",
                    self.path.display()
                ),
            ));
        }
        let used = n_table + n_blocks;
        let ver = m.bump();
        let mut table = rc(m)?.table.clone();
        table.resize(len as usize, 0);
        let mut blocks = Vec::new();
        for j in 0..n_blocks {
            let mut b = vec![0u8; cs as usize];
            let range = (old_len + j) * per..(old_len + j + 1) * per;
            for x in start.max(range.start)..(start + used).min(range.end) {
                set(&mut b, order, (x - range.start) as usize, 1);
            }
            let off = (start + n_table + j) * cs;
            table[(old_len + j) as usize] = off;
            blocks.push((off, b));
        }
        m.dirty_tables += n_blocks;
        m.file_len = m.file_len.max((start + used) * cs);
        let r = rc(m)?;
        for (off, b) in blocks {
            r.blocks.insert(
                off,
                Block {
                    b,
                    ver,
                    dirty: true,
                },
            );
        }
        let old = (r.table_off, r.table_clusters);
        r.table = table;
        r.table_off = start * cs;
        r.table_clusters = n_table;
        r.table_dirty.clear();
        r.hint = r.hint.max(start + used);
        if r.moved_from.is_none() {
            r.moved_from = Some(old);
        } else {
            // A table moved to since the last flush was never in the header: its
            // clusters are free at once.
            for c in old.0 / cs..old.0 / cs + old.1 {
                self.decrement(m, c)?;
            }
        }
        Ok(())
    }
}
