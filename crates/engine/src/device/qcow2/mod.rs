//! qcow2 images (qemu's format, v2 and v3) as the guest disk they hold, read and
//! written. Facts from qemu's docs/interop/qcow2.txt.
//!
//! Owns: [`Qcow2`] (the device) over its image file ([`HostFile`]), the L1 table,
//! a cache of L2 tables and, opened read-write, the refcount table and a cache of
//! refcount blocks (`refcount.rs`: refcounts, cluster allocation, the table's growth),
//! the write path, discard, flush and the check before writing (`write.rs`). Callers:
//! `crate::image::open_device` (image specs), tests ([`Qcow2::open_host`] over a
//! recording host file).
//!
//! Own code rather than a crate: `imago` (the maintained one with a sync API) writes
//! refcount blocks before L2 tables but with no flush between them, so a crash can
//! leave an L2 entry durable over a cluster whose refcount is not — corruption to
//! `qemu-img check`; `qcow2-rs` is async (tokio) only.
//!
//! Reading: the header is checked field by field (cluster size 512 B - 2 MiB, L1 size
//! against the guest size and qemu's 32 MiB bound, tables cluster-aligned and inside
//! the file), every L2 and data offset against the file's size and alignment (an L2
//! table or data cluster in the header cluster is refused); zero clusters (v3),
//! compressed clusters (deflate, through miniz_oxide; one must inflate to exactly a
//! cluster), a backing-file chain read through (a relative name is resolved against
//! the image's directory; a chain that meets a file twice, or deeper than
//! [`MAX_CHAIN`], is refused). No input panics or loops; errors name what is wrong
//! and where (`Error::BadImage` at open, `io::ErrorKind::InvalidData` on a read).
//!
//! Writing. A read-write open refuses, naming the way out: the dirty bit (lazy
//! refcounts left stale: `qemu-img check -r all`), the corrupt bit, internal
//! snapshots, persistent bitmaps and other auto-clear bits, encryption, external data
//! files, extended L2 entries, zstd. It then reads every reference once (header, L1
//! table, refcount table and blocks, L2 tables, data and compressed clusters): each
//! cluster must be inside the file, referenced once (compressed clusters may share
//! one), with a refcount at least its references and the COPIED flag set on every
//! L1 and standard L2 entry; else the open is refused as damaged. Leaks (refcount
//! above references: what a crash mid-allocation leaves, also past the file's end,
//! where a crash left a refcount but the file never grew) are given back. From then
//! on refcount 0 means free, so no write of ours can land in metadata. The check
//! reads every L2 table and refcount block once (a fully allocated 1 TiB guest with
//! 64 KiB clusters: 160 MiB) and keeps a bit per host cluster while it runs. Lazy refcounts
//! are never used and the dirty bit never set.
//!
//! A write into a cluster whose L2 entry is standard with COPIED (refcount 1) goes in
//! place. Anything else (unallocated — backing file or zeros —, zero, compressed, or
//! shared) gets a new cluster: the whole cluster written (the old content around the
//! write: from the backing file, zeros, the inflated cluster), then its L2 entry
//! pointed at it (with COPIED); the old host cluster, if any, is queued to be freed.
//! The backing file is never written. New clusters come from the first free one
//! from a hint on, runs contiguous; L2 tables and refcount blocks are allocated as
//! needed (a new refcount block sits in the first cluster of the range it covers, so
//! it counts itself), and when the refcount table covers too little it moves to a
//! bigger one past the covered area (with new blocks that count it).
//!
//! Ordering (the crash contract). Metadata changes stay in memory until a flush,
//! which writes them in this order, each step durable (fsync) before the next:
//! 1. the dirty refcount blocks (and the whole new refcount table when it moved),
//!    and with them every data write since the last flush;
//! 2. the refcount table's entries for new blocks, or the header's refcount table
//!    offset and size (12 bytes of sector 0) when it moved;
//! 3. the dirty L2 tables;
//! 4. the dirty L1 entries (new L2 tables);
//! 5. only now the frees queued before step 1 (clusters whose references step 3
//!    dropped, the old refcount table): refcounts decremented, a cluster that
//!    reaches 0 punched out of the file and free to allocate again; those refcount
//!    blocks written and synced.
//!
//! So at any crash each durable reference (L1 or L2 entry, table entry, header) was
//! written after the refcount and the contents it points at were durable; a cluster
//! is reused only after the entry that dropped it is durable; what is lost is at
//! most leaks (allocations whose entry was not durable yet, decrements not durable
//! yet). Entries are 8 bytes (refcounts at most 8) inside one sector, so a torn
//! table write leaves each entry old or new. A flush snapshots what it writes under
//! the lock; changes after the snapshot wait for the next flush. A failed write or
//! sync of metadata latches: every later write, discard and flush fails (the
//! memory is ahead of the file).
//!
//! Discard: whole clusters of the range are unmapped (L2 entry 0; on v3 with a
//! backing file a zero cluster, so the backing's bytes do not show through) and
//! their host clusters queued to be freed as above; partial clusters are left.
//!
//! Concurrency and lock order: `flush_lock` (one flush at a time), then `meta` (L1,
//! L2 tables, refcounts, the queue of frees). `meta` is held for lookups, for an
//! allocating write (allocation, its data write and the entry update are one step,
//! so no snapshot sees an entry without its refcount and data), and for a flush's
//! snapshot and frees; not for reads and writes of mapped data clusters nor for a
//! flush's writes and syncs. A cluster found by a lookup stays allocated until a
//! flush after the change that dropped it completes.

mod host;
mod refcount;
mod write;

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

pub use host::HostFile;

use super::BlockDevice;
use crate::error::{Error, Result};
use host::read_exact;

/// The first bytes of a qcow2 file, "QFI\xfb".
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// The longest backing chain followed.
pub const MAX_CHAIN: usize = 16;
/// qemu's bound on the L1 table (QCOW_MAX_L1_SIZE).
const MAX_L1_BYTES: u64 = 32 << 20;
/// Bytes of L2 tables kept decoded (64 KiB clusters: 512 tables, 256 GiB of guest).
/// Dirty tables stay until a flush writes them.
const L2_CACHE_BYTES: u64 = 32 << 20;
/// Bits 9-55 of an L1 or standard L2 entry: the host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COMPRESSED: u64 = 1 << 62;
/// Bit 63 of L1 and standard L2 entries: the refcount is exactly one.
const COPIED: u64 = 1 << 63;
const ZERO_FLAG: u64 = 1;
/// v3 header extension: the backing file's format name.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// v3 header extension: persistent dirty bitmaps.
const EXT_BITMAPS: u32 = 0x2385_2875;
/// Header fields rewritten: the refcount table's offset (8 bytes) and clusters (4).
const HDR_REFCOUNT_TABLE: u64 = 48;

/// A qcow2 image file's guest disk.
pub struct Qcow2 {
    host: Arc<dyn HostFile>,
    path: PathBuf,
    cluster_bits: u32,
    size: u64,
    version: u32,
    read_only: bool,
    backing: Option<Arc<dyn BlockDevice>>,
    /// One flush sequence at a time (taken before `meta`).
    flush_lock: Mutex<()>,
    meta: Mutex<Meta>,
    /// Set when a metadata write or sync failed: what failed.
    failed: Mutex<Option<String>>,
}

/// Everything about the mapping that changes: guarded by `Qcow2::meta`.
struct Meta {
    /// The host file's length as the mapping sees it: grows when clusters past the
    /// end are allocated (their bytes are written before anything points at them).
    file_len: u64,
    l1_off: u64,
    l1: Vec<u64>,
    /// L1 entries changed since the last flush.
    l1_dirty: BTreeSet<usize>,
    /// L2 tables by host offset.
    l2: HashMap<u64, Table>,
    /// The last compressed cluster inflated: (its L2 entry, the cluster).
    inflated: Option<(u64, Arc<[u8]>)>,
    /// Read-write only.
    rc: Option<refcount::Refcounts>,
    /// Byte ranges of the host file whose references were dropped since the last
    /// flush's snapshot: each cluster they touch loses one reference once the
    /// dropping entry is durable (flush step 5).
    frees: Vec<(u64, u64)>,
    /// Tables (L2 and refcount blocks) that differ from the file.
    dirty_tables: u64,
    /// Source of `Table::ver` / `refcount::Block::ver`.
    ver: u64,
}

/// A cached L2 table.
struct Table {
    e: Vec<u64>,
    /// Changed at `ver` (a flush marks it clean only if nothing changed it since
    /// its snapshot).
    ver: u64,
    dirty: bool,
}

impl Meta {
    fn bump(&mut self) -> u64 {
        self.ver += 1;
        self.ver
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn bad(path: &Path, what: String) -> Error {
    Error::BadImage(format!("{}: qcow2: {what}", path.display()))
}

fn invalid(what: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("corrupt qcow2 image: {what}"),
    )
}

/// The header fields a read-write open needs.
struct RwHeader {
    refcount_table_off: u64,
    refcount_table_clusters: u64,
    refcount_order: u32,
}

impl Qcow2 {
    /// Open the qcow2 image at `path` (its backing files read-only).
    pub fn open(path: &Path, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        let mut seen = Vec::new();
        Ok(Arc::new(Self::open_chain(path, read_only, &mut seen)?))
    }

    /// Open the qcow2 image held by `host`; `path` names it in messages and is where
    /// a relative backing file name is resolved from.
    pub fn open_host(host: Arc<dyn HostFile>, path: &Path, read_only: bool) -> Result<Qcow2> {
        Self::from_host(host, path, read_only, &mut Vec::new())
    }

    fn open_chain(path: &Path, read_only: bool, seen: &mut Vec<(u64, u64)>) -> Result<Qcow2> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)?;
        let meta = file.metadata()?;
        let id = (meta.dev(), meta.ino());
        if seen.contains(&id) {
            return Err(bad(
                path,
                "the backing-file chain loops (this file is its own backing file, \
                 directly or through others)"
                    .into(),
            ));
        }
        if seen.len() >= MAX_CHAIN {
            return Err(bad(
                path,
                format!("the backing-file chain is deeper than {MAX_CHAIN}"),
            ));
        }
        seen.push(id);
        Self::from_host(Arc::new(file), path, read_only, seen)
    }

    fn from_host(
        host: Arc<dyn HostFile>,
        path: &Path,
        read_only: bool,
        seen: &mut Vec<(u64, u64)>,
    ) -> Result<Qcow2> {
        let file_len = host.len_bytes()?;
        let mut h = vec![0u8; 512.min(file_len) as usize];
        read_exact(&*host, &mut h, 0)?;
        if h.len() < 72 || h[0..4] != MAGIC {
            return Err(bad(path, "no qcow2 header".into()));
        }
        let version = be32(&h, 4);
        if version != 2 && version != 3 {
            return Err(Error::Unsupported(format!(
                "{}: qcow2 version {version} (rext4 reads versions 2 and 3)",
                path.display()
            )));
        }
        let backing_off = be64(&h, 8);
        let backing_len = be32(&h, 16);
        let cluster_bits = be32(&h, 20);
        let size = be64(&h, 24);
        let crypt = be32(&h, 32);
        let l1_size = u64::from(be32(&h, 36));
        let l1_off = be64(&h, 40);
        let nb_snapshots = be32(&h, 60);
        if !(9..=21).contains(&cluster_bits) {
            return Err(bad(
                path,
                format!("cluster_bits {cluster_bits} is not 9..21"),
            ));
        }
        let cs = 1u64 << cluster_bits;
        if crypt != 0 {
            return Err(Error::Unsupported(format!(
                "{}: qcow2 image is encrypted",
                path.display()
            )));
        }
        let mut header_len = 72usize;
        let (mut incompat, mut autoclear, mut refcount_order) = (0u64, 0u64, 4u32);
        if version == 3 {
            if h.len() < 104 {
                return Err(bad(path, "v3 header is truncated".into()));
            }
            incompat = be64(&h, 72);
            autoclear = be64(&h, 88);
            refcount_order = be32(&h, 96);
            header_len = be32(&h, 100) as usize;
            if header_len < 104 || !header_len.is_multiple_of(8) || header_len as u64 > cs {
                return Err(bad(path, format!("header_length {header_len} is invalid")));
            }
            let compression = if header_len > 104 && h.len() > 104 {
                h[104]
            } else {
                0
            };
            if incompat & 2 != 0 {
                return Err(bad(
                    path,
                    "the image is marked corrupt (qemu-img check -r all repairs it)".into(),
                ));
            }
            let names = [
                (4u64, "an external data file"),
                (16, "extended L2 entries (subclusters)"),
            ];
            for (bit, what) in names {
                if incompat & bit != 0 {
                    return Err(Error::Unsupported(format!(
                        "{}: qcow2 image uses {what}",
                        path.display()
                    )));
                }
            }
            if incompat & 8 != 0 && compression != 0 {
                return Err(Error::Unsupported(format!(
                    "{}: qcow2 compression type {compression} (zstd); rext4 reads deflate",
                    path.display()
                )));
            }
            let unknown = incompat & !0x1f;
            if unknown != 0 {
                return Err(Error::Unsupported(format!(
                    "{}: qcow2 incompatible feature bits {unknown:#x}",
                    path.display()
                )));
            }
        }
        if l1_size * 8 > MAX_L1_BYTES {
            return Err(bad(
                path,
                format!("L1 table of {l1_size} entries is too large"),
            ));
        }
        let l2_entries = cs / 8;
        let covered = u128::from(l1_size) * u128::from(l2_entries) * u128::from(cs);
        if covered < u128::from(size) {
            return Err(bad(
                path,
                format!("L1 table of {l1_size} entries does not cover the {size}-byte disk"),
            ));
        }
        if l1_size > 0
            && (!l1_off.is_multiple_of(cs)
                || l1_off == 0
                || l1_off.saturating_add(l1_size * 8) > file_len)
        {
            return Err(bad(
                path,
                format!("L1 table at {l1_off} is not a cluster inside the file"),
            ));
        }
        let mut raw = vec![0u8; (l1_size * 8) as usize];
        read_exact(&*host, &mut raw, l1_off)?;
        let l1: Vec<u64> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();

        // Header extensions (the backing file's format; bitmaps).
        let mut backing_format = None;
        let mut has_bitmaps = false;
        let mut cl0 = vec![0u8; cs.min(file_len) as usize];
        read_exact(&*host, &mut cl0, 0)?;
        let mut at = header_len;
        while at + 8 <= cl0.len() {
            let (kind, len) = (be32(&cl0, at), be32(&cl0, at + 4) as usize);
            if kind == 0 {
                break;
            }
            let data = at + 8;
            if data + len > cl0.len() {
                return Err(bad(
                    path,
                    format!("header extension {kind:#x} runs past cluster 0"),
                ));
            }
            if kind == EXT_BACKING_FORMAT {
                backing_format = Some(String::from_utf8_lossy(&cl0[data..data + len]).into_owned());
            }
            has_bitmaps |= kind == EXT_BITMAPS;
            at = data + len.div_ceil(8) * 8;
        }

        if !read_only {
            let refuse = |what: String| {
                Err(Error::Unsupported(format!(
                    "{}: rext4 does not write a qcow2 image {what}",
                    path.display()
                )))
            };
            if incompat & 1 != 0 {
                return refuse(
                    "marked dirty (lazy refcounts were left stale by a writer that did \
                     not close it): `qemu-img check -r all` repairs the refcounts; \
                     read-only access works"
                        .into(),
                );
            }
            if nb_snapshots != 0 {
                return refuse(format!(
                    "with internal snapshots ({nb_snapshots}; `qemu-img snapshot -l` lists \
                     them, -d deletes one); read-only access works"
                ));
            }
            if has_bitmaps || autoclear != 0 {
                return refuse(format!(
                    "with persistent bitmaps or other auto-clear features ({autoclear:#x}; \
                     `qemu-img bitmap --remove` drops a bitmap); read-only access works"
                ));
            }
            if refcount_order > 6 {
                return Err(bad(
                    path,
                    format!("refcount_order {refcount_order} is above 6"),
                ));
            }
        }

        let backing = if backing_off != 0 {
            if backing_len == 0
                || backing_len > 1023
                || backing_off.saturating_add(u64::from(backing_len)) > cs.min(file_len)
            {
                return Err(bad(
                    path,
                    format!("backing file name ({backing_len} bytes at {backing_off}) is outside the first cluster"),
                ));
            }
            let name = &cl0[backing_off as usize..(backing_off + u64::from(backing_len)) as usize];
            let name = PathBuf::from(std::ffi::OsStr::new(
                std::str::from_utf8(name)
                    .map_err(|_| bad(path, "backing file name is not UTF-8".into()))?,
            ));
            let full = if name.is_absolute() {
                name
            } else {
                path.parent().unwrap_or(Path::new(".")).join(name)
            };
            let dev: Arc<dyn BlockDevice> = match backing_format.as_deref() {
                Some("raw") => Arc::new(open_backing_raw(&full, path)?),
                Some("qcow2") | None if is_qcow2(&full) => Arc::new(
                    Self::open_chain(&full, true, seen).map_err(|e| backing_err(path, &full, e))?,
                ),
                Some("qcow2") => {
                    return Err(bad(
                        path,
                        format!("backing file {} is not qcow2", full.display()),
                    ))
                }
                None => Arc::new(open_backing_raw(&full, path)?),
                Some(f) => {
                    return Err(Error::Unsupported(format!(
                        "{}: backing file format {f}",
                        path.display()
                    )))
                }
            };
            Some(dev)
        } else {
            None
        };
        let q = Qcow2 {
            host,
            path: path.to_path_buf(),
            cluster_bits,
            size,
            version,
            read_only,
            backing,
            flush_lock: Mutex::new(()),
            meta: Mutex::new(Meta {
                file_len,
                l1_off,
                l1,
                l1_dirty: BTreeSet::new(),
                l2: HashMap::new(),
                inflated: None,
                rc: None,
                frees: Vec::new(),
                dirty_tables: 0,
                ver: 0,
            }),
            failed: Mutex::new(None),
        };
        if !read_only {
            let hdr = RwHeader {
                refcount_table_off: be64(&h, HDR_REFCOUNT_TABLE as usize),
                refcount_table_clusters: u64::from(be32(&h, HDR_REFCOUNT_TABLE as usize + 8)),
                refcount_order,
            };
            if let Err(e) = q.prepare_write(&hdr) {
                // Nothing of a refused open reaches the file (not even on drop).
                q.fail(&io::Error::other(e.to_string()));
                return Err(e);
            }
        }
        Ok(q)
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn lock(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most L2 tables kept clean in the cache.
    fn l2_cache_tables(&self) -> usize {
        (L2_CACHE_BYTES >> self.cluster_bits).max(16) as usize
    }

    /// Load the L2 table at host offset `off` (L1 entry `l1i`) into the cache.
    fn load_l2(&self, m: &mut Meta, l1i: usize, off: u64) -> io::Result<()> {
        if m.l2.contains_key(&off) {
            return Ok(());
        }
        let cs = self.cs();
        if !off.is_multiple_of(cs) || off < cs || off.saturating_add(cs) > m.file_len {
            return Err(invalid(format!(
                "{}: L1 entry {l1i} points at an L2 table at {off}, not a cluster inside the \
                 {}-byte file",
                self.path.display(),
                m.file_len
            )));
        }
        let mut raw = vec![0u8; cs as usize];
        read_exact(&*self.host, &mut raw, off)?;
        let e: Vec<u64> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        if m.l2.len() >= self.l2_cache_tables() {
            m.l2.retain(|_, t| t.dirty);
        }
        m.l2.insert(
            off,
            Table {
                e,
                ver: 0,
                dirty: false,
            },
        );
        Ok(())
    }

    /// The L2 entry of guest cluster `gc` (0 when it has no L2 table).
    fn entry(&self, m: &mut Meta, gc: u64) -> io::Result<u64> {
        let l2_entries = self.cs() / 8;
        let l1i = (gc / l2_entries) as usize;
        let Some(&l1e) = m.l1.get(l1i) else {
            return Ok(0);
        };
        let off = l1e & OFFSET_MASK;
        if off == 0 {
            return Ok(0);
        }
        self.load_l2(m, l1i, off)?;
        Ok(m.l2
            .get(&off)
            .map_or(0, |t| t.e[(gc % l2_entries) as usize]))
    }

    /// What L2 entry `e` of guest cluster `gc` maps to, its offsets checked.
    fn classify(&self, file_len: u64, gc: u64, e: u64) -> io::Result<Map> {
        if e & COMPRESSED != 0 {
            return Ok(Map::Compressed(e));
        }
        if e & ZERO_FLAG != 0 {
            return Ok(Map::Zero);
        }
        let off = e & OFFSET_MASK;
        if off == 0 {
            return Ok(Map::Unallocated);
        }
        let cs = self.cs();
        if !off.is_multiple_of(cs) || off < cs || off >= file_len {
            return Err(invalid(format!(
                "{}: guest cluster {gc} points at host offset {off}, not a data cluster inside \
                 the {file_len}-byte file",
                self.path.display(),
            )));
        }
        Ok(Map::Data(off))
    }

    /// What guest cluster `gc` maps to.
    fn map(&self, gc: u64) -> io::Result<Map> {
        let mut m = self.lock();
        let e = self.entry(&mut m, gc)?;
        self.classify(m.file_len, gc, e)
    }

    /// The host bytes `[off, off + len)` of the compressed cluster of L2 entry `e`.
    fn compressed_range(&self, e: u64) -> (u64, u64) {
        let x = 62 - (self.cluster_bits - 8);
        let host = e & ((1u64 << x) - 1);
        let sectors = (e >> x) & ((1u64 << (62 - x)) - 1);
        (host, (sectors + 1) * 512 - (host & 511))
    }

    /// Inflate the compressed cluster of L2 entry `e` (guest cluster `gc`).
    fn inflate_raw(&self, gc: u64, e: u64, file_len: u64) -> io::Result<Vec<u8>> {
        let (host, len) = self.compressed_range(e);
        let len = len.min(file_len.saturating_sub(host));
        if host >= file_len || len == 0 {
            return Err(invalid(format!(
                "{}: compressed guest cluster {gc} at host offset {host} is past the end of \
                 the file",
                self.path.display()
            )));
        }
        let mut raw = vec![0u8; len as usize];
        read_exact(&*self.host, &mut raw, host)?;
        let cs = self.cs() as usize;
        let mut out = vec![0u8; cs];
        let flags =
            miniz_oxide::inflate::core::inflate_flags::TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF;
        let mut st = miniz_oxide::inflate::core::DecompressorOxide::new();
        let (status, _, n) =
            miniz_oxide::inflate::core::decompress(&mut st, &raw, &mut out, 0, flags);
        use miniz_oxide::inflate::TINFLStatus;
        // The stream may carry more input than it uses; it must fill the cluster.
        let ok = n == cs
            && matches!(
                status,
                TINFLStatus::Done | TINFLStatus::HasMoreOutput | TINFLStatus::NeedsMoreInput
            );
        if !ok {
            return Err(invalid(format!(
                "{}: compressed guest cluster {gc} does not inflate to a cluster ({status:?}, \
                 {n} bytes)",
                self.path.display()
            )));
        }
        Ok(out)
    }

    /// Inflate through the one-cluster cache (the read path; the lock is not held
    /// while inflating).
    fn inflate(&self, gc: u64, e: u64) -> io::Result<Arc<[u8]>> {
        let file_len = {
            let m = self.lock();
            if let Some((k, c)) = &m.inflated {
                if *k == e {
                    return Ok(c.clone());
                }
            }
            m.file_len
        };
        let c: Arc<[u8]> = self.inflate_raw(gc, e, file_len)?.into();
        self.lock().inflated = Some((e, c.clone()));
        Ok(c)
    }

    fn read_backing(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some(b) = &self.backing else {
            buf.fill(0);
            return Ok(());
        };
        let have = b.size_bytes().saturating_sub(offset).min(buf.len() as u64) as usize;
        if have > 0 {
            b.read_at(&mut buf[..have], offset)?;
        }
        buf[have..].fill(0);
        Ok(())
    }
}

enum Map {
    Unallocated,
    Zero,
    Data(u64),
    Compressed(u64),
}

fn is_qcow2(p: &Path) -> bool {
    let mut m = [0u8; 4];
    File::open(p).is_ok_and(|f| read_exact(&f, &mut m, 0).is_ok()) && m == MAGIC
}

fn open_backing_raw(full: &Path, of: &Path) -> Result<super::FileDevice> {
    super::FileDevice::open(full, true, false)
        .map_err(|e| bad(of, format!("backing file {}: {e}", full.display())))
}

fn backing_err(of: &Path, full: &Path, e: Error) -> Error {
    match e {
        Error::Io(io) => bad(of, format!("backing file {}: {io}", full.display())),
        e => e,
    }
}

impl Qcow2 {
    /// Fill `buf` from guest offset `offset`; every byte of it is initialized on
    /// success. Data clusters are read straight into it (no zeroing pass: a large
    /// read costs one copy, as from a raw image).
    fn read_into(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        super::check_range(offset, buf.len(), self.size)?;
        let cs = self.cs();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let gc = pos >> self.cluster_bits;
            let within = pos & (cs - 1);
            let mut n = ((cs - within) as usize).min(buf.len() - done);
            match self.map(gc)? {
                Map::Data(host) => {
                    // Merge following clusters stored right after this one: one read.
                    let mut next = host + cs;
                    let mut g = gc + 1;
                    while done + n < buf.len() {
                        match self.map(g)? {
                            Map::Data(h) if h == next => {
                                n = (n + cs as usize).min(buf.len() - done);
                                next += cs;
                                g += 1;
                            }
                            _ => break,
                        }
                    }
                    let dst = &mut buf[done..done + n];
                    let got = self.host.read_at(dst, host + within)?;
                    super::zeroed(&mut dst[got..]);
                }
                Map::Zero => {
                    super::zeroed(&mut buf[done..done + n]);
                }
                Map::Unallocated => {
                    let dst = super::zeroed(&mut buf[done..done + n]);
                    self.read_backing(dst, pos)?;
                }
                Map::Compressed(e) => {
                    let c = self.inflate(gc, e)?;
                    let w = within as usize;
                    let dst = super::zeroed(&mut buf[done..done + n]);
                    dst.copy_from_slice(&c[w..w + n]);
                }
            }
            done += n;
        }
        Ok(())
    }
}

impl BlockDevice for Qcow2 {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: `read_into` writes only initialized bytes.
        self.read_into(unsafe { super::as_uninit(buf) }, offset)
    }
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        self.read_into(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_guest(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.flush_meta()
    }
    /// Whole clusters unmapped and freed once that is durable; partial ones left.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.discard_guest(offset, len)
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
}

impl Drop for Qcow2 {
    /// What is still in memory reaches the file (a caller that flushed leaves
    /// nothing to do).
    fn drop(&mut self) {
        if !self.read_only {
            let _ = self.flush_meta();
        }
    }
}
