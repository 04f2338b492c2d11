//! # mkfs: create an ext4 filesystem the way mke2fs 1.47.0 does
//!
//! Owns: choosing the geometry ([`geometry`]), placing every metadata block
//! ([`alloc`]) and writing the fresh filesystem ([`write`]) through the
//! [`BlockDevice`] seam. The on-disk encodings all come from `rext4-format`.
//!
//! Must hold: for the same size and options (UUID, hash seed, creation time — or a
//! seed and `SOURCE_DATE_EPOCH`, which give them), the
//! result matches `mkfs.ext4` 1.47.0 block for block: layout, flags, counts and
//! checksums, so `dumpe2fs` prints the same text except "Lifetime writes" (bytes
//! mke2fs's I/O layer flushed, which depends on its write cache) and the superblock
//! checksum that covers it. Reproducing mke2fs means following its order of
//! allocation: group tables (flex_bg packing), root directory, lost+found, the resize
//! inode's DIND block, the journal at the filesystem's middle, then the orphan file.
//!
//! Unless [`MkfsOptions::device_zeroed`] says the device already reads as zeros (a
//! fresh sparse file, like mke2fs after a discard that zeroes), the inode-table blocks
//! holding used inodes and the journal are zeroed and the tables are left for the
//! kernel's lazy init (no ITABLE_ZEROED), as mke2fs does on such devices.
//!
//! Callers: the CLI's `rext4 mkfs`, tests and embedders. Not thread-aware: it owns
//! the device while it runs.

pub(crate) mod alloc;
mod features;
pub(crate) mod geometry;
mod write;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub use features::{FeatureSet, Features, FsType};

use crate::device::{BlockDevice, FileDevice};
use crate::error::{Error, Result};
use rext4_format::superblock::feature::INCOMPAT_MMP;

/// What to build. `Default` gives mke2fs's ext4 defaults with Debian's configuration.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// `-b`: block size in bytes; `None` chooses by size like mke2fs (1 KiB below
    /// 512 MiB, else 4 KiB).
    pub block_size: Option<u32>,
    /// `-N`: minimum number of inodes; `None` uses the size type's inode ratio.
    pub inodes: Option<u32>,
    /// `-L`: volume label (at most 16 bytes; longer labels are cut, with a warning).
    pub label: Option<String>,
    /// `-U`: filesystem UUID; random when `None`.
    pub uuid: Option<[u8; 16]>,
    /// `-E hash_seed=`: directory hash seed; random when `None`.
    pub hash_seed: Option<[u8; 16]>,
    /// `-O`: feature edits applied on top of the defaults.
    pub features: FeatureSet,
    /// Start from e2fsprogs 1.47.0's own mke2fs.conf (adds orphan_file and
    /// metadata_csum_seed) instead of Debian's.
    pub upstream_defaults: bool,
    /// `-t`: the defaults of ext2 (block maps, no journal), ext3 (block maps, a
    /// journal) or ext4.
    pub fs_type: FsType,
    /// Creation time (seconds since the epoch) for every timestamp mkfs writes, like
    /// `E2FSPROGS_FAKE_TIME`; when `None`, `SOURCE_DATE_EPOCH` from the environment
    /// if set (see [`crate::repro`]), else now.
    pub creation_time: Option<i64>,
    /// Derive every value mkfs would otherwise pick at random (the UUID and the
    /// directory hash seed, where `uuid` and `hash_seed` do not give them) from these
    /// bytes ([`crate::repro::derive`]), so that two runs make the same image.
    pub seed: Option<Vec<u8>>,
    /// Filesystem size in bytes; when `None`, the device's size rounded down to whole
    /// pages as mke2fs does ([`device_fs_size`]).
    pub size_bytes: Option<u64>,
    /// The device already reads as zeros everywhere (a fresh sparse file): skip
    /// zeroing and mark inode tables ITABLE_ZEROED, as mke2fs does after a discard
    /// that zeroes data.
    pub device_zeroed: bool,
    /// `-E root_owner=UID:GID`: owner of the root directory; 0:0 when `None`, as
    /// mke2fs 1.43+ does. lost+found stays 0:0 either way, as with mke2fs.
    pub root_owner: Option<(u32, u32)>,
    /// `-E mmp_update_interval=SECONDS`: how often a holder of an image with
    /// multi-mount protection (`-O mmp`) rewrites its MMP block; `None`: 5, as
    /// mke2fs (at most 300).
    pub mmp_update_interval: Option<u16>,
    /// The device name an MMP block records, as mke2fs records the path it was given
    /// ([`mkfs_file`] uses its path); `None`: empty.
    pub device_path: Option<std::path::PathBuf>,
    /// `-E encoding_flags=strict`: `s_encoding_flags` of a casefold filesystem (its
    /// `s_encoding` is always utf8-12.1, as mke2fs's default); 0 when `None`.
    pub encoding_flags: Option<u16>,
}

/// What was built.
#[derive(Debug, Clone)]
pub struct MkfsReport {
    /// mke2fs's size type: floppy, small, default, big or huge.
    pub size_type: &'static str,
    pub block_size: u32,
    pub blocks_count: u64,
    pub reserved_blocks: u64,
    pub inodes_count: u32,
    pub groups: u64,
    pub blocks_per_group: u64,
    pub inodes_per_group: u32,
    pub reserved_gdt_blocks: u32,
    /// Journal length in blocks (0: no journal).
    pub journal_blocks: u32,
    /// Orphan file length in blocks (0: none).
    pub orphan_file_blocks: u32,
    pub features: Features,
    pub uuid: [u8; 16],
    pub hash_seed: [u8; 16],
    /// Blocks holding superblock backups, ascending.
    pub superblock_backups: Vec<u64>,
    pub free_blocks: u64,
    pub free_inodes: u32,
    /// `s_overhead_clusters`: metadata and journal blocks.
    pub overhead_blocks: u64,
    /// Bytes written to the device.
    pub bytes_written: u64,
    /// Non-fatal notes (e.g. "label truncated").
    pub warnings: Vec<String>,
}

/// Create a filesystem on `dev` (its first `opts.size_bytes`, or all of it). Populating
/// it from a directory (mke2fs's `-d`) is the caller's next step, through the write
/// API (the `rext4 mkfs -d` command copies with its `cp`).
pub fn mkfs(dev: &dyn BlockDevice, opts: &MkfsOptions) -> Result<MkfsReport> {
    if dev.is_read_only() {
        return Err(Error::ReadOnly);
    }
    let size = match opts.size_bytes {
        Some(s) if s > dev.size_bytes() => {
            return Err(Error::InvalidInput(format!(
                "filesystem size {s} is larger than the device ({} bytes)",
                dev.size_bytes()
            )))
        }
        Some(s) => s,
        None => device_fs_size(dev.size_bytes(), opts.block_size),
    };
    let (features, geo) = plan(size, opts)?;
    let mut warnings = Vec::new();
    if features.has_compat(rext4_format::superblock::feature::COMPAT_HAS_JOURNAL)
        && geo.journal_blocks == 0
    {
        warnings.push("filesystem too small for a journal".to_string());
    }
    let mut label = [0u8; 16];
    if let Some(l) = &opts.label {
        let b = l.as_bytes();
        if b.len() > label.len() {
            warnings.push(format!("label too long, truncated to 16 bytes: {l}"));
        }
        let n = b.len().min(label.len());
        label[..n].copy_from_slice(&b[..n]);
    }
    let pick = |given: Option<[u8; 16]>, what: &str| match (given, &opts.seed) {
        (Some(u), _) => Ok(u),
        (None, Some(seed)) => Ok(crate::repro::derive(seed, what)),
        (None, None) => random_uuid(),
    };
    let uuid = pick(opts.uuid, "uuid")?;
    let hash_seed = pick(opts.hash_seed, "hash_seed")?;
    let now = match opts.creation_time {
        Some(t) => t,
        None => match crate::repro::source_date_epoch()? {
            Some(t) => t,
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0),
        },
    };
    let mmp_update_interval = match opts.mmp_update_interval {
        Some(0) | None if features.has_incompat(INCOMPAT_MMP) => {
            rext4_format::mmp::DEFAULT_UPDATE_INTERVAL
        }
        Some(n) => n,
        None => 0,
    };
    let device_name = {
        use std::os::unix::ffi::OsStrExt;
        opts.device_path
            .as_ref()
            .map(|p| p.as_os_str().as_bytes().to_vec())
            .unwrap_or_default()
    };
    let mut report = write::build(
        dev,
        &geo,
        &write::Identity {
            uuid,
            hash_seed,
            label,
            now,
            root_owner: opts.root_owner.unwrap_or((0, 0)),
            mmp_update_interval,
            device_name,
            encoding_flags: opts.encoding_flags.unwrap_or(0),
        },
        opts.device_zeroed,
    )?;
    report.warnings.splice(0..0, warnings);
    Ok(report)
}

/// The features and layout a filesystem of `size` bytes gets from `opts`, or the
/// reason it cannot be built (too small, too many inodes, a feature set rext4 does
/// not make): everything that can refuse, before anything is written.
fn plan(size: u64, opts: &MkfsOptions) -> Result<(Features, geometry::Geometry)> {
    let features = opts
        .features
        .apply(Features::defaults_for(opts.fs_type, opts.upstream_defaults))
        .normalized();
    features.check_buildable().map_err(Error::Unsupported)?;
    if opts.mmp_update_interval.unwrap_or(0) > rext4_format::mmp::MAX_UPDATE_INTERVAL {
        return Err(Error::InvalidInput(format!(
            "MMP update interval {} s is above the largest, {} s",
            opts.mmp_update_interval.unwrap_or(0),
            rext4_format::mmp::MAX_UPDATE_INTERVAL
        )));
    }
    let geo = geometry::Geometry::compute(&geometry::Request {
        size_bytes: size,
        block_size: opts.block_size,
        inodes: opts.inodes,
        features,
    })?;
    Ok((features, geo))
}

/// Create (or truncate) the regular file `path` as a sparse image of `size_bytes` and
/// make a filesystem in it. `opts.size_bytes` and `opts.device_zeroed` are implied.
/// An existing file in use (a loop device, a mount, another rext4 process) is refused
/// with [`Error::InUse`] and left as it is; so is any file when the options cannot make
/// a filesystem of that size (checked before the file is touched, as mke2fs does), and
/// a file this call created is removed again when it fails.
pub fn mkfs_file(path: &Path, size_bytes: u64, opts: &MkfsOptions) -> Result<MkfsReport> {
    plan(size_bytes, opts)?;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path);
    let created = f.is_ok();
    let f = match f {
        // Existing (or a symlink, whose target may still be made here: not removed).
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?,
        f => f?,
    };
    let r = (|| {
        // An image a loop device, a mount or another rext4 process uses is not
        // formatted (as mke2fs refuses a mounted filesystem): claimed before it is
        // truncated.
        let _claim = crate::claim::Claim::write(path)?;
        f.set_len(0)?;
        f.set_len(size_bytes)?;
        let dev = FileDevice::open(path, false, false)?;
        let opts = MkfsOptions {
            size_bytes: Some(size_bytes),
            device_zeroed: true,
            device_path: opts
                .device_path
                .clone()
                .or_else(|| Some(path.to_path_buf())),
            ..opts.clone()
        };
        let report = mkfs(&dev, &opts)?;
        dev.flush()?;
        Ok(report)
    })();
    drop(f);
    if r.is_err() && created {
        let _ = std::fs::remove_file(path);
    }
    r
}

/// The page size mke2fs rounds device sizes to (x86's; mke2fs asks `sysconf`).
const PAGE_SIZE: u64 = 4096;

/// The filesystem size mke2fs uses when it takes the size from the device rather
/// than from a size argument: rounded down to whole pages when blocks are smaller
/// than a page (`-b`, or 1 KiB while the block size is still undecided).
pub fn device_fs_size(device_bytes: u64, block_size: Option<u32>) -> u64 {
    if u64::from(block_size.unwrap_or(1024)) < PAGE_SIZE {
        device_bytes & !(PAGE_SIZE - 1)
    } else {
        device_bytes
    }
}

/// A random (version 4) UUID from the kernel's random source.
fn random_uuid() -> Result<[u8; 16]> {
    use std::io::Read;
    let mut u = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut u)?;
    u[6] = (u[6] & 0x0F) | 0x40;
    u[8] = (u[8] & 0x3F) | 0x80;
    Ok(u)
}

/// Parse `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|&c| c != b'-').collect();
    let dashes: Vec<usize> = s
        .bytes()
        .enumerate()
        .filter(|&(_, c)| c == b'-')
        .map(|(i, _)| i)
        .collect();
    if hex.len() != 32 || dashes != [8, 13, 18, 23] {
        return None;
    }
    let mut u = [0u8; 16];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        u[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(u)
}

/// Format a UUID as dumpe2fs prints it.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Parse a mke2fs size argument into bytes: a number (decimal, `0x` hex or `0`
/// octal) with an optional suffix `k`, `m`, `g`, `t` (KiB..TiB) or `s` (512-byte
/// sectors); without a suffix the unit is `block_size` (1024 when no `-b` was given),
/// as in mke2fs's `parse_num_blocks2`.
pub fn parse_size(arg: &str, block_size: Option<u32>) -> Option<u64> {
    let arg = arg.trim();
    // Suffix letters are never hex digits, so "0x1f" has none and "0x1fk" has one.
    let (digits, suffix) = match arg.chars().last() {
        Some(c) if "kKmMgGtTs".contains(c) => (&arg[..arg.len() - 1], Some(c)),
        _ => (arg, None),
    };
    let n = if let Some(h) = digits.strip_prefix("0x").or(digits.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()?
    } else if digits.len() > 1 && digits.starts_with('0') {
        u64::from_str_radix(&digits[1..], 8).ok()?
    } else {
        digits.parse::<u64>().ok()?
    };
    let shift = match suffix.map(|c| c.to_ascii_lowercase()) {
        None => return n.checked_mul(u64::from(block_size.unwrap_or(1024))),
        Some('k') => 10,
        Some('m') => 20,
        Some('g') => 30,
        Some('t') => 40,
        Some('s') => return n.checked_mul(512),
        Some(_) => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// A fresh filesystem with mke2fs's defaults on a zeroed memory device of `size`
/// bytes (unit tests).
#[cfg(test)]
pub(crate) fn mem_image(size: usize) -> std::sync::Arc<crate::device::MemDevice> {
    let dev = std::sync::Arc::new(crate::device::MemDevice::new(vec![0u8; size]));
    mkfs(
        dev.as_ref(),
        &MkfsOptions {
            device_zeroed: true,
            ..Default::default()
        },
    )
    .expect("mkfs");
    dev
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_mke2fs() {
        assert_eq!(parse_size("65536k", None), Some(64 << 20));
        assert_eq!(parse_size("64M", None), Some(64 << 20));
        assert_eq!(parse_size("1g", Some(4096)), Some(1 << 30));
        assert_eq!(parse_size("1000", None), Some(1000 * 1024));
        assert_eq!(parse_size("1000", Some(4096)), Some(1000 * 4096));
        assert_eq!(parse_size("2048s", None), Some(1 << 20));
        assert_eq!(parse_size("0x10", None), Some(16 * 1024));
        assert_eq!(parse_size("0x1F", None), Some(31 * 1024));
        assert_eq!(parse_size("010", None), Some(8 * 1024));
        assert_eq!(parse_size("12q", None), None);
        assert_eq!(parse_size("", None), None);
    }

    #[test]
    fn uuids_round_trip() {
        let s = "01234567-89ab-cdef-0123-456789abcdef";
        let u = parse_uuid(s).expect("valid");
        assert_eq!(u[0], 0x01);
        assert_eq!(u[15], 0xef);
        assert_eq!(format_uuid(&u), s);
        assert!(parse_uuid("0123456789abcdef0123456789abcdef").is_none());
        assert!(parse_uuid("01234567-89ab-cdef-0123-456789abcdeg").is_none());
    }
}
