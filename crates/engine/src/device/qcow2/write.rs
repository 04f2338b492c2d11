//! Writing a qcow2 image: the check before the first write (`prepare_write`), guest
//! writes (in place, or into new clusters), discard, and the flush that writes the
//! metadata in the order the module note gives.

use std::collections::HashMap;
use std::io;

use super::refcount::{self, Refcounts, MAX_TABLE_BYTES};
use super::{
    bad, be64, read_exact, Map, Meta, Qcow2, RwHeader, Table, COMPRESSED, COPIED,
    HDR_REFCOUNT_TABLE, OFFSET_MASK, ZERO_FLAG,
};
use crate::error::{Error, Result};

/// The most clusters one allocating step writes (bounds the copy buffer).
const MAX_ALLOC_RUN: u64 = 64;
/// Past this many bytes of dirty tables, a write flushes them.
const DIRTY_LIMIT_BYTES: u64 = 64 << 20;
const SECTOR: u64 = 512;
/// The most host clusters a read-write open checks (a bit each: 128 MiB; 64 TiB of
/// file with 64 KiB clusters).
const MAX_CHECKED_CLUSTERS: u64 = 1 << 30;
/// Bits 1-8 and 56-61 of a standard L2 entry (reserved, 0).
const L2_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// The host cluster a write into L2 entry `e` may go to in place.
fn in_place(e: u64) -> Option<u64> {
    let off = e & OFFSET_MASK;
    (e & COMPRESSED == 0 && e & COPIED != 0 && e & ZERO_FLAG == 0 && off != 0).then_some(off)
}

/// What a flush writes, taken under the lock.
#[derive(Default)]
struct Snapshot {
    /// Refcount blocks: (offset, version, bytes).
    blocks: Vec<(u64, u64, Vec<u8>)>,
    /// The moved refcount table (at `table_off`) and the header fields for it.
    table: Option<Vec<u8>>,
    table_off: u64,
    header: Option<[u8; 12]>,
    /// Sectors of the refcount table holding changed entries.
    table_sectors: Vec<(u64, Vec<u8>)>,
    /// L2 tables: (offset, version, bytes).
    l2: Vec<(u64, u64, Vec<u8>)>,
    /// Sectors of the L1 table holding changed entries.
    l1: Vec<(u64, Vec<u8>)>,
    /// Host byte ranges losing a reference once the above is durable.
    frees: Vec<(u64, u64)>,
}

impl Snapshot {
    fn is_empty(&self) -> bool {
        self.blocks.is_empty()
            && self.table.is_none()
            && self.table_sectors.is_empty()
            && self.l2.is_empty()
            && self.l1.is_empty()
            && self.frees.is_empty()
    }
}

/// The sectors of a table of 8-byte entries at `off` that hold the `dirty` entries
/// (ascending).
fn dirty_sectors(
    off: u64,
    entries: &[u64],
    dirty: impl Iterator<Item = usize>,
) -> Vec<(u64, Vec<u8>)> {
    let per = (SECTOR / 8) as usize;
    let mut sectors: Vec<usize> = dirty.map(|i| i / per).collect();
    sectors.dedup();
    sectors
        .into_iter()
        .filter(|&s| s * per < entries.len())
        .map(|s| {
            let end = ((s + 1) * per).min(entries.len());
            (off + (s * per * 8) as u64, encode(&entries[s * per..end]))
        })
        .collect()
}

fn encode(entries: &[u64]) -> Vec<u8> {
    entries.iter().flat_map(|e| e.to_be_bytes()).collect()
}

/// A set of host clusters.
struct Bits(Vec<u64>);

impl Bits {
    fn test(&self, c: u64) -> bool {
        self.0
            .get((c / 64) as usize)
            .is_some_and(|w| w & (1 << (c % 64)) != 0)
    }
    /// The first cluster of the set in `[from, to)`.
    fn next_set(&self, from: u64, to: u64) -> Option<u64> {
        let mut c = from;
        while c < to {
            let w = self.0.get((c / 64) as usize).copied().unwrap_or(0) >> (c % 64);
            if w == 0 {
                c = (c / 64 + 1) * 64;
                continue;
            }
            let at = c + u64::from(w.trailing_zeros());
            return (at < to).then_some(at);
        }
        None
    }
    fn set(&mut self, c: u64) {
        if let Some(w) = self.0.get_mut((c / 64) as usize) {
            *w |= 1 << (c % 64);
        }
    }
}

impl Qcow2 {
    /// Before the first write: load the refcount table, check every reference (see
    /// the module note) and give leaked clusters back.
    pub(super) fn prepare_write(&self, h: &RwHeader) -> Result<()> {
        let cs = self.cs();
        let path = &self.path;
        let mut m = self.lock();
        let file_len = m.file_len;
        let nclusters = file_len.div_ceil(cs);
        if nclusters > MAX_CHECKED_CLUSTERS {
            return Err(Error::Unsupported(format!(
                "{}: the qcow2 file holds {nclusters} clusters, more than rext4 checks before \
                 writing ({MAX_CHECKED_CLUSTERS}); read-only access works",
                path.display()
            )));
        }
        let (toff, tclusters) = (h.refcount_table_off, h.refcount_table_clusters);
        if toff == 0
            || !toff.is_multiple_of(cs)
            || tclusters == 0
            || tclusters * cs > MAX_TABLE_BYTES.max(cs)
            || toff.saturating_add(tclusters * cs) > file_len
        {
            return Err(bad(
                path,
                format!(
                    "the refcount table ({tclusters} clusters at {toff}) is not inside the file"
                ),
            ));
        }
        let mut raw = vec![0u8; (tclusters * cs) as usize];
        read_exact(&*self.host, &mut raw, toff)?;
        let table: Vec<u64> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        let rc_table = table.clone();
        m.rc = Some(Refcounts {
            order: h.refcount_order,
            table_off: toff,
            table_clusters: tclusters,
            table,
            table_dirty: Default::default(),
            moved_from: None,
            blocks: HashMap::new(),
            hint: 0,
        });

        // Every reference, once.
        let mut refs = Bits(vec![0; nclusters.div_ceil(64) as usize]);
        let mut shared: HashMap<u64, u64> = HashMap::new();
        let mark = |refs: &mut Bits,
                    shared: &HashMap<u64, u64>,
                    c: u64,
                    what: &dyn Fn() -> String|
         -> Result<()> {
            if c >= nclusters {
                return Err(bad(
                    path,
                    format!("{} is past the end of the {file_len}-byte file", what()),
                ));
            }
            if refs.test(c) || shared.contains_key(&c) {
                return Err(bad(
                    path,
                    format!(
                        "{} is host cluster {c}, which something else uses too (a cluster \
                         referenced twice; `qemu-img check` shows the damage)",
                        what()
                    ),
                ));
            }
            refs.set(c);
            Ok(())
        };
        mark(&mut refs, &shared, 0, &|| "the header".into())?;
        let (l1_off, l1_bytes) = (m.l1_off, m.l1.len() as u64 * 8);
        for c in l1_off / cs..(l1_off + l1_bytes).div_ceil(cs) {
            mark(&mut refs, &shared, c, &|| {
                format!("the L1 table (at {l1_off})")
            })?;
        }
        for c in toff / cs..toff / cs + tclusters {
            mark(&mut refs, &shared, c, &|| {
                format!("the refcount table (at {toff})")
            })?;
        }
        for (i, &e) in rc_table.iter().enumerate() {
            if e == 0 {
                continue;
            }
            if !e.is_multiple_of(cs) || e.saturating_add(cs) > file_len {
                return Err(bad(
                    path,
                    format!(
                        "refcount table entry {i} points at {e}, not a cluster inside the \
                         {file_len}-byte file"
                    ),
                ));
            }
            mark(&mut refs, &shared, e / cs, &|| {
                format!("refcount block {i} (at {e})")
            })?;
        }
        let l2_entries = (cs / 8) as usize;
        let l1 = m.l1.clone();
        for (l1i, &l1e) in l1.iter().enumerate() {
            let off = l1e & OFFSET_MASK;
            if l1e & !(OFFSET_MASK | COPIED) != 0 {
                return Err(bad(
                    path,
                    format!("L1 entry {l1i} ({l1e:#x}) has reserved bits set"),
                ));
            }
            if off == 0 {
                continue;
            }
            if l1e & COPIED == 0 {
                return Err(bad(
                    path,
                    format!(
                        "L1 entry {l1i} lacks the COPIED flag (its L2 table is shared, or \
                         the flag is wrong: `qemu-img check -r all` repairs it)"
                    ),
                ));
            }
            if !off.is_multiple_of(cs) || off.saturating_add(cs) > file_len {
                return Err(bad(
                    path,
                    format!(
                        "L1 entry {l1i} points at an L2 table at {off}, not a cluster inside \
                         the {file_len}-byte file"
                    ),
                ));
            }
            mark(&mut refs, &shared, off / cs, &|| {
                format!("the L2 table of L1 entry {l1i} (at {off})")
            })?;
            self.load_l2(&mut m, l1i, off)?;
            let t = m.l2.get(&off).map(|t| t.e.clone()).unwrap_or_default();
            for (j, &e) in t.iter().enumerate() {
                let gc = (l1i * l2_entries + j) as u64;
                if e & COMPRESSED != 0 {
                    if e & COPIED != 0 {
                        return Err(bad(
                            path,
                            format!("guest cluster {gc}: a compressed entry with COPIED set"),
                        ));
                    }
                    let (host, len) = self.compressed_range(e);
                    let start = host & !(SECTOR - 1);
                    let end = host.saturating_add(len);
                    for c in start / cs..end.div_ceil(cs) {
                        if c >= nclusters || refs.test(c) {
                            return Err(bad(
                                path,
                                format!(
                                    "compressed guest cluster {gc} (at {host}) is past the end \
                                     of the file or in a cluster something else uses"
                                ),
                            ));
                        }
                        *shared.entry(c).or_default() += 1;
                    }
                    continue;
                }
                if e & L2_RESERVED != 0 {
                    return Err(bad(
                        path,
                        format!("guest cluster {gc}'s L2 entry ({e:#x}) has reserved bits set"),
                    ));
                }
                if e & ZERO_FLAG != 0 && self.version < 3 {
                    return Err(bad(
                        path,
                        format!("guest cluster {gc}: a zero cluster in a version 2 image"),
                    ));
                }
                let host = e & OFFSET_MASK;
                if host == 0 {
                    if e & COPIED != 0 {
                        return Err(bad(
                            path,
                            format!(
                                "guest cluster {gc} has the COPIED flag but no host cluster                                  (an entry of an image with an external data file)"
                            ),
                        ));
                    }
                    continue;
                }
                if !host.is_multiple_of(cs) || host >= file_len {
                    return Err(bad(
                        path,
                        format!(
                            "guest cluster {gc} points at host offset {host}, not a cluster \
                             inside the {file_len}-byte file"
                        ),
                    ));
                }
                if e & COPIED == 0 {
                    return Err(bad(
                        path,
                        format!(
                            "guest cluster {gc} lacks the COPIED flag (its cluster is shared, \
                             or the flag is wrong: `qemu-img check -r all` repairs it)"
                        ),
                    ));
                }
                mark(&mut refs, &shared, host / cs, &|| {
                    format!("guest cluster {gc}'s data (at {host})")
                })?;
            }
        }

        // Refcounts against references: too low is damage, too high a leak. Only the
        // clusters inside the file are compared (as qemu-img check does), so the work
        // is bounded by the file's size whatever the table says.
        let order = h.refcount_order;
        let per = self.rc_entries(order);
        let wanted = |c: u64| u64::from(refs.test(c)) + shared.get(&c).copied().unwrap_or(0);
        let covered = rc_table.len() as u64 * per;
        let past = refs
            .next_set(covered, nclusters)
            .or_else(|| shared.keys().copied().filter(|&c| c >= covered).min());
        if let Some(c) = past {
            return Err(bad(
                path,
                format!(
                    "host cluster {c} is in use but past what the refcount table covers: \
                     `qemu-img check -r all` repairs it"
                ),
            ));
        }
        // Past the file's end: (cluster, 0) for every cluster of refcount block `b`
        // (table entry `ti`) from its entry `from` on that still counts a reference.
        let counted_from = |b: &[u8], ti: u64, from: u64| {
            (from..per)
                .filter(|&i| refcount::get(b, order, i as usize) != 0)
                .map(|i| (ti * per + i, 0))
                .collect::<Vec<_>>()
        };
        let mut leaks = Vec::new();
        let mut hint = None;
        for ti in 0..rc_table.len() as u64 {
            let inside = (ti * per).min(nclusters)..((ti + 1) * per).min(nclusters);
            if inside.is_empty() {
                // Past the file's end nothing is referenced: a refcount there is a
                // leak a crash left (allocated, the file never grew). qemu-img check
                // does not see it until the file grows over it, so give it back now.
                if rc_table[ti as usize] == 0 {
                    continue;
                }
                let Some(boff) = self.rc_block(&mut m, ti)? else {
                    continue;
                };
                if let Some(b) = m.rc.as_ref().and_then(|r| r.blocks.get(&boff)) {
                    leaks.extend(counted_from(&b.b, ti, 0));
                }
                continue;
            }
            let Some(boff) = self.rc_block(&mut m, ti)? else {
                let used = refs
                    .next_set(inside.start, inside.end)
                    .or_else(|| inside.clone().find(|c| shared.contains_key(c)));
                if let Some(c) = used {
                    return Err(low_refcount(path, c, 0, wanted(c)));
                }
                hint.get_or_insert(inside.start.max(1));
                continue;
            };
            let b = match m.rc.as_ref().and_then(|r| r.blocks.get(&boff)) {
                Some(b) => b.b.clone(),
                None => continue,
            };
            for c in inside.clone() {
                let have = refcount::get(&b, order, (c - ti * per) as usize);
                let want = wanted(c);
                if have < want {
                    return Err(low_refcount(path, c, have, want));
                }
                if have > want {
                    leaks.push((c, want));
                }
                if want == 0 {
                    hint.get_or_insert(c);
                }
            }
            if inside.end == nclusters {
                leaks.extend(counted_from(&b, ti, nclusters - ti * per));
            }
        }
        let mut punch = Vec::new();
        for &(c, want) in &leaks {
            self.set_refcount(&mut m, c, want)?;
            if want == 0 && c < nclusters {
                punch.push(c);
            }
        }
        if let Some(r) = m.rc.as_mut() {
            r.hint = hint.unwrap_or(nclusters.max(1));
        }
        self.punch_clusters(&punch)?;
        Ok(())
    }

    /// Punch runs of the given (ascending) clusters out of the host file.
    fn punch_clusters(&self, clusters: &[u64]) -> io::Result<()> {
        let cs = self.cs();
        let mut i = 0;
        while i < clusters.len() {
            let mut j = i + 1;
            while j < clusters.len() && clusters[j] == clusters[j - 1] + 1 {
                j += 1;
            }
            self.host.punch(clusters[i] * cs, (j - i) as u64 * cs)?;
            i = j;
        }
        Ok(())
    }

    fn writable(&self) -> io::Result<()> {
        super::super::refuse_if_read_only(self.read_only)?;
        let f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &*f {
            return Err(io::Error::other(format!(
                "{}: an earlier write of the qcow2 metadata failed ({why}); the image takes \
                 no more writes until it is opened again",
                self.path.display()
            )));
        }
        Ok(())
    }

    pub(super) fn fail(&self, e: &io::Error) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert_with(|| e.to_string());
    }

    /// Set the L2 entry of guest cluster `gc`, whose L2 table exists.
    fn set_entry(&self, m: &mut Meta, gc: u64, v: u64) -> io::Result<()> {
        let l2_entries = self.cs() / 8;
        let l1i = (gc / l2_entries) as usize;
        let off = m.l1.get(l1i).map_or(0, |e| e & OFFSET_MASK);
        self.load_l2(m, l1i, off)?;
        let ver = m.bump();
        let Some(t) = m.l2.get_mut(&off) else {
            return Err(super::invalid(format!(
                "{}: L2 table at {off} is gone",
                self.path.display()
            )));
        };
        t.e[(gc % l2_entries) as usize] = v;
        t.ver = ver;
        if !t.dirty {
            t.dirty = true;
            m.dirty_tables += 1;
        }
        Ok(())
    }

    /// Make sure L1 entry `l1i` has an L2 table (a new one is zeros, in the cache).
    fn l2_for_write(&self, m: &mut Meta, l1i: usize) -> io::Result<()> {
        let Some(&e) = m.l1.get(l1i) else {
            return Err(super::invalid(format!(
                "{}: L1 entry {l1i} is past the L1 table",
                self.path.display()
            )));
        };
        if e & OFFSET_MASK != 0 {
            return Ok(());
        }
        let (c, _) = self.alloc(m, 1)?;
        let off = c << self.cluster_bits;
        let ver = m.bump();
        m.l2.insert(
            off,
            Table {
                e: vec![0; (self.cs() / 8) as usize],
                ver,
                dirty: true,
            },
        );
        m.dirty_tables += 1;
        m.l1[l1i] = off | COPIED;
        m.l1_dirty.insert(l1i);
        Ok(())
    }

    /// Queue the host cluster(s) of a replaced L2 entry `e` to be freed.
    fn queue_free(&self, m: &mut Meta, e: u64) {
        if e & COMPRESSED != 0 {
            let (host, len) = self.compressed_range(e);
            let start = host & !(SECTOR - 1);
            m.frees.push((start, host + len - start));
        } else if e & OFFSET_MASK != 0 {
            m.frees.push((e & OFFSET_MASK, self.cs()));
        }
    }

    /// The guest bytes of cluster `gc` (L2 entry `e`) as they read now, into `out`
    /// (one cluster).
    fn old_cluster(&self, m: &Meta, gc: u64, e: u64, out: &mut [u8]) -> io::Result<()> {
        let cs = self.cs();
        let start = gc * cs;
        match self.classify(m.file_len, gc, e)? {
            Map::Zero => out.fill(0),
            Map::Unallocated => {
                let n = self.size.saturating_sub(start).min(cs) as usize;
                self.read_backing(&mut out[..n], start)?;
                out[n..].fill(0);
            }
            Map::Compressed(e) => out.copy_from_slice(&self.inflate_raw(gc, e, m.file_len)?),
            Map::Data(host) => {
                // SAFETY: `read_at` writes only initialized bytes.
                let got = self
                    .host
                    .read_at(unsafe { super::super::as_uninit(out) }, host)?;
                out[got..].fill(0);
            }
        }
        Ok(())
    }

    /// Write guest bytes: in place where the clusters allow, else into new clusters.
    pub(super) fn write_guest(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.writable()?;
        super::super::check_range(offset, buf.len(), self.size)?;
        let cs = self.cs();
        let mut done = 0usize;
        let mut flush = false;
        while done < buf.len() {
            let pos = offset + done as u64;
            let gc = pos >> self.cluster_bits;
            let within = pos & (cs - 1);
            let rest = buf.len() - done;
            let mut m = self.lock();
            let e = self.entry(&mut m, gc)?;
            if let Some(host) = in_place(e) {
                self.classify(m.file_len, gc, e)?;
                let mut n = ((cs - within) as usize).min(rest);
                let mut next = host + cs;
                let mut g = gc + 1;
                while n < rest && in_place(self.entry(&mut m, g)?) == Some(next) {
                    n = (n + cs as usize).min(rest);
                    next += cs;
                    g += 1;
                }
                drop(m);
                self.host.write_at(&buf[done..done + n], host + within)?;
                done += n;
                continue;
            }
            done += self.write_new(&mut m, gc, within, &buf[done..])?;
            flush |= m.dirty_tables << self.cluster_bits > DIRTY_LIMIT_BYTES;
        }
        if flush {
            self.flush_meta()?;
        }
        Ok(())
    }

    /// Write `data` from byte `within` of guest cluster `gc` (which cannot be written
    /// in place) and on through following clusters of the same L2 table that cannot
    /// either, into newly allocated clusters: whole clusters written, then the
    /// entries pointed at them. Returns the bytes of `data` written.
    fn write_new(&self, m: &mut Meta, gc: u64, within: u64, data: &[u8]) -> io::Result<usize> {
        let cs = self.cs();
        let l2_entries = cs / 8;
        let first_len = ((cs - within) as usize).min(data.len());
        let mut k = 1u64;
        let mut covered = first_len;
        while covered < data.len()
            && k < MAX_ALLOC_RUN
            && !(gc + k).is_multiple_of(l2_entries)
            && in_place(self.entry(m, gc + k)?).is_none()
        {
            covered = (covered + cs as usize).min(data.len());
            k += 1;
        }
        self.l2_for_write(m, (gc / l2_entries) as usize)?;
        let (c0, n) = self.alloc(m, k)?;
        let take = ((n * cs - within) as usize).min(data.len());
        let host = c0 * cs;
        if within == 0 && take as u64 == n * cs {
            self.host.write_at(&data[..take], host)?;
        } else {
            let mut tmp = vec![0u8; (n * cs) as usize];
            let cs_us = cs as usize;
            let end = within as usize + take;
            if within > 0 || end < cs_us {
                let e = self.entry(m, gc)?;
                self.old_cluster(m, gc, e, &mut tmp[..cs_us])?;
            }
            if n > 1 && end < tmp.len() {
                let last = gc + n - 1;
                let e = self.entry(m, last)?;
                let at = tmp.len() - cs_us;
                self.old_cluster(m, last, e, &mut tmp[at..])?;
            }
            tmp[within as usize..end].copy_from_slice(&data[..take]);
            self.host.write_at(&tmp, host)?;
        }
        for i in 0..n {
            let old = self.entry(m, gc + i)?;
            self.set_entry(m, gc + i, (host + i * cs) | COPIED)?;
            self.queue_free(m, old);
        }
        Ok(take)
    }

    /// Unmap the whole clusters of `[offset, offset + len)`; their host clusters are
    /// freed at the next flush, once the cleared entries are durable.
    pub(super) fn discard_guest(&self, offset: u64, len: u64) -> io::Result<()> {
        self.writable()?;
        super::super::check_range(
            offset,
            usize::try_from(len).unwrap_or(usize::MAX),
            self.size,
        )?;
        let cs = self.cs();
        let end_byte = offset + len;
        let first = offset.div_ceil(cs);
        // The disk's last cluster may be partial: all of it is in a range that
        // reaches the disk's end.
        let end = if end_byte == self.size {
            end_byte.div_ceil(cs)
        } else {
            end_byte / cs
        };
        let unmapped = if self.version >= 3 && self.backing.is_some() {
            ZERO_FLAG
        } else {
            0
        };
        let l2_entries = cs / 8;
        let mut gc = first;
        while gc < end {
            let stop = ((gc / l2_entries + 1) * l2_entries).min(end);
            let mut m = self.lock();
            let l1e = m.l1.get((gc / l2_entries) as usize).copied().unwrap_or(0);
            if l1e & OFFSET_MASK != 0 {
                for g in gc..stop {
                    let e = self.entry(&mut m, g)?;
                    if e & COMPRESSED == 0 && e & OFFSET_MASK == 0 {
                        continue; // unallocated or a zero cluster: nothing to give back
                    }
                    self.set_entry(&mut m, g, unmapped)?;
                    self.queue_free(&mut m, e);
                }
            }
            drop(m);
            gc = stop;
        }
        Ok(())
    }

    /// Take what the flush writes (see the module note).
    fn snapshot(&self, m: &mut Meta) -> Snapshot {
        let cs = self.cs();
        let mut s = Snapshot {
            frees: std::mem::take(&mut m.frees),
            ..Snapshot::default()
        };
        for (&off, t) in &m.l2 {
            if t.dirty {
                s.l2.push((off, t.ver, encode(&t.e)));
            }
        }
        let l1_dirty = std::mem::take(&mut m.l1_dirty);
        s.l1 = dirty_sectors(m.l1_off, &m.l1, l1_dirty.into_iter());
        if let Some(r) = m.rc.as_mut() {
            for (&off, b) in &r.blocks {
                if b.dirty {
                    s.blocks.push((off, b.ver, b.b.clone()));
                }
            }
            let table_dirty = std::mem::take(&mut r.table_dirty);
            if let Some((old_off, old_clusters)) = r.moved_from.take() {
                s.table = Some(encode(&r.table));
                s.table_off = r.table_off;
                let mut h = [0u8; 12];
                h[..8].copy_from_slice(&r.table_off.to_be_bytes());
                h[8..].copy_from_slice(&(r.table_clusters as u32).to_be_bytes());
                s.header = Some(h);
                s.frees.push((old_off, old_clusters * cs));
            } else {
                s.table_sectors = dirty_sectors(r.table_off, &r.table, table_dirty.into_iter());
            }
        }
        s
    }

    /// Mark what a flush wrote clean where nothing changed it since its snapshot.
    fn mark_clean(&self, m: &mut Meta, blocks: &[(u64, u64, Vec<u8>)], l2: &[(u64, u64, Vec<u8>)]) {
        let mut cleaned = 0;
        for (off, ver, _) in l2 {
            if let Some(t) = m.l2.get_mut(off) {
                if t.dirty && t.ver == *ver {
                    t.dirty = false;
                    cleaned += 1;
                }
            }
        }
        if let Some(r) = m.rc.as_mut() {
            for (off, ver, _) in blocks {
                if let Some(b) = r.blocks.get_mut(off) {
                    if b.dirty && b.ver == *ver {
                        b.dirty = false;
                        cleaned += 1;
                    }
                }
            }
        }
        m.dirty_tables = m.dirty_tables.saturating_sub(cleaned);
    }

    /// Make every completed write durable, with the metadata in order.
    pub(super) fn flush_meta(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        let _one = self.flush_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.writable()?;
        let s = self.snapshot(&mut self.lock());
        let r = self.write_snapshot(s);
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }

    fn write_snapshot(&self, s: Snapshot) -> io::Result<()> {
        let h = &*self.host;
        if s.is_empty() {
            return h.sync();
        }
        // 1. Refcount blocks (and a moved table), with the data since the last flush.
        for (off, _, b) in &s.blocks {
            h.write_at(b, *off)?;
        }
        if let Some(t) = &s.table {
            h.write_at(t, s.table_off)?;
        }
        h.sync()?;
        // 2. What makes new blocks count: table entries, or the header.
        if let Some(hdr) = &s.header {
            h.write_at(hdr, HDR_REFCOUNT_TABLE)?;
        }
        for (off, b) in &s.table_sectors {
            h.write_at(b, *off)?;
        }
        if s.header.is_some() || !s.table_sectors.is_empty() {
            h.sync()?;
        }
        // 3. L2 tables.
        for (off, _, b) in &s.l2 {
            h.write_at(b, *off)?;
        }
        if !s.l2.is_empty() {
            h.sync()?;
        }
        // 4. L1 entries.
        for (off, b) in &s.l1 {
            h.write_at(b, *off)?;
        }
        if !s.l1.is_empty() {
            h.sync()?;
        }
        self.mark_clean(&mut self.lock(), &s.blocks, &s.l2);
        if s.frees.is_empty() {
            return Ok(());
        }
        // 5. The frees, now that nothing durable points at them.
        let cs = self.cs();
        let blocks = {
            let mut m = self.lock();
            let mut zero = Vec::new();
            for &(off, len) in &s.frees {
                for c in off / cs..(off + len).div_ceil(cs) {
                    if self.decrement(&mut m, c)? && c < m.file_len.div_ceil(cs) {
                        zero.push(c);
                    }
                }
            }
            zero.sort_unstable();
            zero.dedup();
            // Punched before the lock goes: a cluster is allocated again only after.
            self.punch_clusters(&zero)?;
            let mut blocks = Vec::new();
            if let Some(r) = m.rc.as_ref() {
                for (&off, b) in &r.blocks {
                    if b.dirty {
                        blocks.push((off, b.ver, b.b.clone()));
                    }
                }
            }
            blocks
        };
        for (off, _, b) in &blocks {
            h.write_at(b, *off)?;
        }
        h.sync()?;
        self.mark_clean(&mut self.lock(), &blocks, &[]);
        Ok(())
    }
}

fn low_refcount(path: &std::path::Path, c: u64, have: u64, want: u64) -> Error {
    bad(
        path,
        format!(
            "host cluster {c} is referenced {want} time(s) but its refcount is {have} (a write \
             could reuse it): `qemu-img check -r all` repairs it"
        ),
    )
}
