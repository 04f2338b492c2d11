//! qcow2 images (qemu's format, v2 and v3), read as the guest disk they hold: the
//! header, the L1 and L2 tables, zero clusters (v3), compressed clusters (deflate,
//! through miniz_oxide) and a backing-file chain read through (a relative name is
//! resolved against the image's directory; a chain that meets a file twice, or is
//! deeper than [`MAX_CHAIN`], is refused). Facts from qemu's docs/interop/qcow2.txt.
//!
//! Own code rather than a crate: `imago` (the maintained one with a sync API) writes
//! refcount blocks before L2 tables but with no flush between them, so a crash can
//! leave an L2 entry durable over a cluster whose refcount is not — corruption to
//! `qemu-img check`; `qcow2-rs` is async (tokio) only. Writing is not done yet: a
//! read-write open is refused by name ([`Qcow2::open`]), so nothing here changes the
//! file.
//!
//! Must hold: no input panics or loops. Every header field is checked before use
//! (cluster size 512 B - 2 MiB, L1 size against the guest size and qemu's 32 MiB
//! bound, tables cluster-aligned and inside the file), every L2 and data offset from
//! the file is checked against the file's size and alignment (an L2 table or data
//! cluster in the header cluster is refused: a pointer loop into metadata), and a
//! compressed cluster inflates to exactly one cluster. Errors name what is wrong and
//! where (`Error::BadImage` at open, `io::ErrorKind::InvalidData` on a read).
//!
//! Concurrency: reads take `cache` (decoded L2 tables, the last inflated cluster)
//! only to look up or insert; device reads happen outside it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::BlockDevice;
use crate::error::{Error, Result};

/// The first bytes of a qcow2 file, "QFI\xfb".
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// The longest backing chain followed.
pub const MAX_CHAIN: usize = 16;
/// qemu's bound on the L1 table (QCOW_MAX_L1_SIZE).
const MAX_L1_BYTES: u64 = 32 << 20;
/// L2 tables kept decoded (64 KiB clusters: 32 MiB, each covering 512 MiB).
const L2_CACHE_TABLES: usize = 512;
/// Bits 9-55 of an L1 or standard L2 entry: the host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COMPRESSED: u64 = 1 << 62;
const ZERO_FLAG: u64 = 1;
/// v3 header extension: the backing file's format name.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;

/// A qcow2 image file's guest disk, read-only.
pub struct Qcow2 {
    file: File,
    file_len: u64,
    path: PathBuf,
    cluster_bits: u32,
    size: u64,
    l1: Vec<u64>,
    backing: Option<Arc<dyn BlockDevice>>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    l2: HashMap<u64, Arc<[u64]>>,
    /// The last compressed cluster inflated: (its L2 entry, the cluster).
    inflated: Option<(u64, Arc<[u8]>)>,
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

impl Qcow2 {
    /// Open the qcow2 image at `path`. Read-write is refused (not supported yet).
    pub fn open(path: &Path, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        if !read_only {
            return Err(Error::Unsupported(format!(
                "{}: writing qcow2 images is not supported yet (read-only access works; \
                 `qemu-img convert -O raw` makes a raw image rext4 writes)",
                path.display()
            )));
        }
        let mut seen = Vec::new();
        Ok(Arc::new(Self::open_chain(path, &mut seen)?))
    }

    fn open_chain(path: &Path, seen: &mut Vec<(u64, u64)>) -> Result<Qcow2> {
        let file = File::open(path)?;
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
        let file_len = meta.len();
        let mut h = vec![0u8; 512.min(file_len) as usize];
        file.read_exact_at(&mut h, 0)?;
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
        if version == 3 {
            if h.len() < 104 {
                return Err(bad(path, "v3 header is truncated".into()));
            }
            let incompat = be64(&h, 72);
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
        file.read_exact_at(&mut raw, l1_off)?;
        let l1: Vec<u64> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();

        // Header extensions (the backing file's format).
        let mut backing_format = None;
        let mut cl0 = vec![0u8; cs.min(file_len) as usize];
        file.read_exact_at(&mut cl0, 0)?;
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
            at = data + len.div_ceil(8) * 8;
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
                    Self::open_chain(&full, seen).map_err(|e| backing_err(path, &full, e))?,
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
        Ok(Qcow2 {
            file,
            file_len,
            path: path.to_path_buf(),
            cluster_bits,
            size,
            l1,
            backing,
            cache: Mutex::new(Cache::default()),
        })
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// The L2 table at host offset `off` (checked and cached).
    fn l2(&self, l1i: usize, off: u64) -> io::Result<Arc<[u64]>> {
        if let Some(t) = self.lock().l2.get(&off) {
            return Ok(t.clone());
        }
        let cs = self.cs();
        if !off.is_multiple_of(cs) || off < cs || off.saturating_add(cs) > self.file_len {
            return Err(invalid(format!(
                "{}: L1 entry {l1i} points at an L2 table at {off}, not a cluster inside the \
                 {}-byte file",
                self.path.display(),
                self.file_len
            )));
        }
        let mut raw = vec![0u8; cs as usize];
        self.file.read_exact_at(&mut raw, off)?;
        let t: Arc<[u64]> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        let mut c = self.lock();
        if c.l2.len() >= L2_CACHE_TABLES {
            c.l2.clear();
        }
        c.l2.insert(off, t.clone());
        Ok(t)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What guest cluster `gc` maps to.
    fn map(&self, gc: u64) -> io::Result<Map> {
        let l2_entries = self.cs() / 8;
        let l1i = (gc / l2_entries) as usize;
        let Some(&l1e) = self.l1.get(l1i) else {
            return Ok(Map::Unallocated);
        };
        let l2_off = l1e & OFFSET_MASK;
        if l2_off == 0 {
            return Ok(Map::Unallocated);
        }
        let t = self.l2(l1i, l2_off)?;
        let e = t[(gc % l2_entries) as usize];
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
        if !off.is_multiple_of(cs) || off < cs || off >= self.file_len {
            return Err(invalid(format!(
                "{}: guest cluster {gc} points at host offset {off}, not a data cluster inside \
                 the {}-byte file",
                self.path.display(),
                self.file_len
            )));
        }
        Ok(Map::Data(off))
    }

    /// Inflate the compressed cluster of L2 entry `e`.
    fn inflate(&self, gc: u64, e: u64) -> io::Result<Arc<[u8]>> {
        if let Some((k, c)) = &self.lock().inflated {
            if *k == e {
                return Ok(c.clone());
            }
        }
        let cb = self.cluster_bits;
        let x = 62 - (cb - 8);
        let host = e & ((1u64 << x) - 1);
        let sectors = (e >> x) & ((1u64 << (62 - x)) - 1);
        let len = ((sectors + 1) * 512 - (host & 511)).min(self.file_len.saturating_sub(host));
        if host >= self.file_len || len == 0 {
            return Err(invalid(format!(
                "{}: compressed guest cluster {gc} at host offset {host} is past the end of \
                 the file",
                self.path.display()
            )));
        }
        let mut raw = vec![0u8; len as usize];
        self.file.read_exact_at(&mut raw, host)?;
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
        let c: Arc<[u8]> = out.into();
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
    File::open(p).is_ok_and(|f| f.read_exact_at(&mut m, 0).is_ok()) && m == MAGIC
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

/// pread into possibly uninitialized bytes; returns how many were read (fewer only at
/// the end of the file).
fn pread_uninit(file: &File, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: pread writes at most `rest.len()` bytes into `rest`, ours for the
        // call; the kernel never reads the destination.
        let r = unsafe {
            libc::pread(
                file.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                (offset + done as u64) as libc::off_t,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            break;
        }
        done += r as usize;
    }
    Ok(done)
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
                    let got = pread_uninit(&self.file, dst, host + within)?;
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
    fn write_at(&self, _buf: &[u8], _offset: u64) -> io::Result<()> {
        super::refuse_if_read_only(true)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn is_read_only(&self) -> bool {
        true
    }
}
