//! `rext4 mkfs [-b BLOCKSIZE] [-N INODES] [-L LABEL] [-U UUID] [-O FEATURES]
//! [-E EXTENDED] [-t ext2|ext3|ext4] [--upstream] [-q] [-F] [-d SRCDIR] IMAGE [SIZE]`:
//! make an ext4 filesystem (or with `-t` an ext2 or ext3 one: block-mapped files, ext3
//! with a journal) the way `mke2fs` 1.47.0 does (see `rext4::mkfs`), and with `-d`
//! fill it from a directory (through the same copy-in as `rext4 cp -r`, with its
//! progress bar on a terminal unless `-q`, and its handling of SIGINT/SIGTERM/SIGHUP).
//!
//! IMAGE is a regular file (created or truncated to a sparse image of SIZE, which
//! defaults to the file's current size) or a block device (SIZE defaults to the whole
//! device). SIZE takes mke2fs's suffixes k/m/g/t (KiB..TiB) and s (512-byte sectors);
//! without a suffix it counts blocks of `-b` bytes, or KiB when `-b` is not given.
//! `E2FSPROGS_FAKE_TIME` fixes every timestamp, as it does for mke2fs.
//!
//! As mke2fs: an IMAGE that already holds a filesystem is named and the user asked
//! "Proceed anyway? (y,N)" when standard input and output are terminals (`-F` skips
//! the question; elsewhere it is not asked). Extended options (`-E`, comma-separated):
//! `hash_seed=UUID`, `root_owner[=UID:GID]` (without a value: the caller's uid and
//! gid). Unlike mke2fs, whose root directory is 0:0 unless told, a mkfs run without
//! root makes the root directory the caller's, so that a user's own image mounts
//! writable for them. Malformed options and sizes are usage errors (exit 2).

use std::io::{IsTerminal, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use clap::ArgAction;
use rext4::device::{BlockDevice, FileDevice};
use rext4::mkfs::{self, FeatureSet, MkfsOptions, MkfsReport};

use crate::term::{self, errln, reason};
use crate::write_cmds::Failure;

#[derive(clap::Args, Debug, Clone)]
pub struct MkfsArgs {
    /// Block size in bytes (1024..65536); chosen by size when omitted.
    #[arg(short = 'b', value_name = "BLOCKSIZE")]
    pub block_size: Option<u32>,
    /// Minimum number of inodes.
    #[arg(short = 'N', value_name = "INODES")]
    pub inodes: Option<u32>,
    /// Volume label (up to 16 bytes).
    #[arg(short = 'L', value_name = "LABEL")]
    pub label: Option<String>,
    /// Filesystem UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or "random").
    #[arg(short = 'U', value_name = "UUID")]
    pub uuid: Option<String>,
    /// Feature edits: comma-separated names, ^name to clear, "none" to clear all.
    #[arg(short = 'O', value_name = "FEATURES", action = ArgAction::Append)]
    pub features: Vec<String>,
    /// Extended options, comma-separated: hash_seed=UUID (directory hash seed),
    /// root_owner[=UID:GID] (owner of the root directory; without a value the caller's;
    /// default 0:0 as root, the caller's otherwise).
    #[arg(short = 'E', value_name = "OPTIONS", action = ArgAction::Append)]
    pub extended: Vec<String>,
    /// Filesystem type: ext4 (the default), ext3 or ext2, with mke2fs.conf's defaults
    /// for it (ext2 and ext3: block-mapped files, no flex_bg; ext3 with a journal).
    #[arg(short = 't', value_name = "TYPE")]
    pub fs_type: Option<String>,
    /// Start from e2fsprogs 1.47.0's own defaults (adds orphan_file and
    /// metadata_csum_seed) instead of Debian's.
    #[arg(long)]
    pub upstream: bool,
    /// Quiet: print nothing but errors and the question -F skips; no progress bar.
    #[arg(short = 'q')]
    pub quiet: bool,
    /// Force: do not ask before overwriting an image that holds a filesystem.
    #[arg(short = 'F', action = ArgAction::Count)]
    pub force: u8,
    /// Copy the contents of a directory into the new filesystem, as `rext4 cp -r
    /// SRCDIR/. IMAGE:/` would (modes, owners as root, times, links, xattrs, holes;
    /// SIGINT/SIGTERM/SIGHUP stop it cleanly, as they stop cp).
    #[arg(short = 'd', value_name = "SRCDIR")]
    pub populate: Option<PathBuf>,
    /// Image file or block device.
    pub image: PathBuf,
    /// Filesystem size (default: the file's or device's size).
    pub size: Option<String>,
}

/// Parse `-E root_owner`'s value: "UID:GID" (numbers, as mke2fs takes).
fn parse_root_owner(v: &str) -> Option<(u32, u32)> {
    let (u, g) = v.split_once(':')?;
    Some((u.parse().ok()?, g.parse().ok()?))
}

/// The mkfs options the arguments ask for; an error here is a usage error.
fn options(args: &MkfsArgs) -> Result<MkfsOptions, String> {
    let fs_type = match &args.fs_type {
        None => mkfs::FsType::Ext4,
        Some(t) => mkfs::FsType::parse(t)
            .ok_or_else(|| format!("filesystem type {t} is not ext2, ext3 or ext4"))?,
    };
    let mut features = FeatureSet::default();
    for spec in &args.features {
        features.edit(spec)?;
    }
    let mut hash_seed = None;
    let (uid, gid) = crate::write_cmds::caller();
    // mke2fs 1.43+ leaves the root directory 0:0; a user's own image is theirs.
    let mut root_owner = (uid != 0).then_some((uid, gid));
    for list in &args.extended {
        for opt in list.split(',').filter(|o| !o.is_empty()) {
            match opt.split_once('=') {
                Some(("hash_seed", v)) => {
                    hash_seed =
                        Some(mkfs::parse_uuid(v).ok_or_else(|| format!("invalid hash seed: {v}"))?);
                }
                None if opt == "root_owner" => root_owner = Some((uid, gid)),
                Some(("root_owner", v)) => {
                    root_owner = Some(
                        parse_root_owner(v)
                            .ok_or_else(|| format!("invalid root_owner: '{v}' (UID:GID)"))?,
                    );
                }
                _ => {
                    return Err(format!(
                        "bad extended option: {opt} (valid: hash_seed=UUID, \
                         root_owner[=UID:GID])"
                    ))
                }
            }
        }
    }
    let uuid = match args.uuid.as_deref() {
        None | Some("random") => None,
        Some(u) => Some(mkfs::parse_uuid(u).ok_or_else(|| format!("invalid UUID: {u}"))?),
    };
    let creation_time = match std::env::var("E2FSPROGS_FAKE_TIME") {
        Ok(v) => Some(
            v.trim()
                .parse::<i64>()
                .map_err(|_| format!("E2FSPROGS_FAKE_TIME is not a number: {v}"))?,
        ),
        Err(_) => None,
    };
    Ok(MkfsOptions {
        block_size: args.block_size,
        inodes: args.inodes,
        label: args.label.clone(),
        uuid,
        hash_seed,
        features,
        upstream_defaults: args.upstream,
        fs_type,
        creation_time,
        root_owner,
        ..MkfsOptions::default()
    })
}

/// mke2fs's description of a filesystem already on `image` ("a ext4 file system
/// labelled 'x'\n\tcreated on DATE"), or `None` when it finds none.
fn existing_fs(image: &Path) -> Option<String> {
    let f = std::fs::File::open(image).ok()?;
    let mut head = vec![0u8; 0x10048];
    let n = f.read_at(&mut head, 0).ok()?;
    head.truncate(n);
    let le16 = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    if head.len() >= 2048 && le16(&head, 1024 + 0x38) == 0xEF53 {
        let sb = &head[1024..2048];
        let (compat, incompat, ro) = (le32(sb, 0x5C), le32(sb, 0x60), le32(sb, 0x64));
        // blkid's rule: ext4 features (extents, 64bit, flex_bg, huge_file, gdt_csum,
        // dir_nlink, extra_isize, metadata_csum...), else a journal makes ext3.
        let kind = if incompat & 0x2C0 != 0 || ro & 0x478 != 0 {
            "ext4"
        } else if compat & 0x4 != 0 {
            "ext3"
        } else {
            "ext2"
        };
        let cstr = |b: &[u8]| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        };
        let mut s = format!("a {kind} file system");
        let label = cstr(&sb[0x78..0x88]);
        if !label.is_empty() {
            s.push_str(&format!(" labelled '{label}'"));
        }
        let time = |lo: usize, hi: usize| i64::from(le32(sb, lo)) | i64::from(sb[hi]) << 32;
        let (mounted, made, written) = (time(0x2C, 0x275), time(0x108, 0x277), time(0x30, 0x274));
        let last_dir = cstr(&sb[0x88..0xC8]);
        if mounted != 0 && !last_dir.is_empty() {
            s.push_str(&format!(
                "\n\tlast mounted on {last_dir} on {}",
                crate::timefmt::ctime(mounted)
            ));
        } else if mounted != 0 {
            s.push_str(&format!(
                "\n\tlast mounted on {}",
                crate::timefmt::ctime(mounted)
            ));
        } else if made != 0 {
            s.push_str(&format!("\n\tcreated on {}", crate::timefmt::ctime(made)));
        } else if written != 0 {
            s.push_str(&format!(
                "\n\tlast modified on {}",
                crate::timefmt::ctime(written)
            ));
        }
        return Some(s);
    }
    if head.starts_with(b"XFSB") {
        return Some("a xfs file system".into());
    }
    if head.get(0x10040..0x10048) == Some(b"_BHRfS_M") {
        return Some("a btrfs file system".into());
    }
    None
}

/// mke2fs's question before overwriting a filesystem: on a terminal only, unless -F.
/// Ok(false): the user said no.
fn confirm_overwrite(args: &MkfsArgs) -> bool {
    if args.force > 0 || !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
        return true;
    }
    let Some(what) = existing_fs(&args.image) else {
        return true;
    };
    term::out(&format!(
        "{} contains {what}\nProceed anyway? (y,N) ",
        args.image.display()
    ));
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    let mut stdin = std::io::stdin().lock();
    while let Ok(1) = stdin.read(&mut byte) {
        if byte[0] == b'\n' {
            break;
        }
        answer.push(byte[0]);
    }
    matches!(answer.first(), Some(b'y' | b'Y'))
}

/// The lines mke2fs prints, without its progress counters.
fn summary(r: &MkfsReport) -> String {
    let mut s = format!(
        "Creating filesystem with {} {}k blocks and {} inodes\n",
        r.blocks_count,
        r.block_size / 1024,
        r.inodes_count
    );
    s.push_str(&format!(
        "Filesystem UUID: {}\n",
        mkfs::format_uuid(&r.uuid)
    ));
    if !r.superblock_backups.is_empty() {
        s.push_str("Superblock backups stored on blocks: ");
        // mke2fs's show_stats: each entry needs its digits + 2 columns of 72.
        let mut col_left = 0usize;
        for (i, b) in r.superblock_backups.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let item = b.to_string();
            let need = item.len() + 2;
            if need > col_left {
                s.push_str("\n\t");
                col_left = 72;
            }
            col_left -= need;
            s.push_str(&item);
        }
        s.push_str("\n\n");
    }
    s.push_str("Allocating group tables: done\n");
    s.push_str("Writing inode tables: done\n");
    if r.journal_blocks > 0 {
        s.push_str(&format!(
            "Creating journal ({} blocks): done\n",
            r.journal_blocks
        ));
    }
    s.push_str("Writing superblocks and filesystem accounting information: done\n");
    s
}

pub fn run(args: MkfsArgs) -> Result<(), Failure> {
    let opts = options(&args).map_err(|e| (2, e))?;
    let image = &args.image;
    let size = match &args.size {
        Some(s) => Some(
            mkfs::parse_size(s, args.block_size)
                .ok_or_else(|| (2, format!("invalid filesystem size: '{s}'")))?,
        ),
        None => None,
    };
    if let Some(src) = &args.populate {
        match std::fs::metadata(src) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err((1, format!("{}: Not a directory", src.display()))),
            Err(e) => return Err((1, format!("{}: {}", src.display(), term::io_reason(&e)))),
        }
    }
    let meta = std::fs::metadata(image).ok();
    let is_device = meta.as_ref().is_some_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_block_device()
    });
    // A device must not be formatted while mounted or used by another writer (the
    // engine's claim; `mkfs_file` claims an image file itself); held for the format
    // only, since the -d copy-in below claims it again.
    let lock = if is_device {
        Some(rext4::Claim::write(image).map_err(|e| (1, format!("{}: {e}", image.display())))?)
    } else {
        None
    };
    if !confirm_overwrite(&args) {
        return Err((1, String::new()));
    }
    let failed = |e: rext4::Error| (1, format!("{}: {}", image.display(), reason(&e)));
    let report = if is_device {
        let dev = FileDevice::open(image, false, false).map_err(|e| failed(e.into()))?;
        let opts = MkfsOptions {
            size_bytes: size,
            ..opts
        };
        let r = mkfs::mkfs(&dev, &opts).map_err(failed)?;
        dev.flush().map_err(|e| failed(e.into()))?;
        r
    } else {
        let size = match (size, meta) {
            (Some(s), _) => s,
            (None, Some(m)) if m.len() > 0 => mkfs::device_fs_size(m.len(), args.block_size),
            _ => {
                return Err((
                    2,
                    format!(
                        "{}: give a size for a new or empty image file",
                        image.display()
                    ),
                ))
            }
        };
        mkfs::mkfs_file(image, size, &opts).map_err(failed)?
    };
    drop(lock);
    for w in &report.warnings {
        errln!("warning: {w}");
    }
    if !args.quiet {
        term::out(&summary(&report));
    }
    if let Some(src) = &args.populate {
        let mut contents = src.clone().into_os_string();
        contents.push("/.");
        let dest = crate::spec::ImagePath {
            image: image.clone(),
            path: b"/".to_vec(),
        };
        let opts = crate::write_cmds::CpInOptions {
            recursive: true,
            progress: !args.quiet && std::io::stderr().is_terminal(),
            verbose: false,
        };
        crate::write_cmds::cp_in(
            &[PathBuf::from(contents)],
            &dest,
            &format!("{}:/", image.display()),
            opts,
        )?;
        if !args.quiet && crate::interrupt::requested().is_none() {
            term::out("Copying files into the device: done\n");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: MkfsArgs,
    }

    fn parse(v: &[&str]) -> MkfsArgs {
        Cli::try_parse_from(std::iter::once("mkfs").chain(v.iter().copied()))
            .expect("parse")
            .args
    }

    #[test]
    fn arguments_map_to_options() {
        let a = parse(&[
            "-q",
            "-F",
            "-F",
            "-b",
            "4096",
            "-O",
            "^has_journal",
            "-O",
            "orphan_file",
            "-E",
            "hash_seed=fedcba98-7654-3210-fedc-ba9876543210",
            "-U",
            "01234567-89ab-cdef-0123-456789abcdef",
            "-L",
            "lbl",
            "img",
            "64m",
        ]);
        assert_eq!(a.size.as_deref(), Some("64m"));
        let o = options(&a).expect("options");
        assert_eq!(o.block_size, Some(4096));
        assert_eq!(o.label.as_deref(), Some("lbl"));
        assert!(o.uuid.is_some() && o.hash_seed.is_some());
        assert_eq!(o.features.remove.compat, 0x4);
        assert_eq!(o.features.add.compat, 0x1000);
        assert!(options(&parse(&["-E", "stride=4", "img"])).is_err());
        assert!(options(&parse(&["-E", "root_owner=1", "img"])).is_err());
        let o = options(&parse(&["-E", "root_owner=12:34,hash_seed=random", "img"]));
        assert!(o.is_err(), "hash_seed=random is not a UUID");
        let o = options(&parse(&["-E", "root_owner=12:34", "img"])).expect("options");
        assert_eq!(o.root_owner, Some((12, 34)));
        assert!(options(&parse(&["-U", "nope", "img"])).is_err());
        let o = options(&parse(&["-t", "ext3", "img"])).expect("options");
        assert_eq!(o.fs_type, mkfs::FsType::Ext3);
        assert!(options(&parse(&["-t", "xfs", "img"])).is_err());
    }

    #[test]
    fn summary_wraps_backups_like_mke2fs() {
        let dir = std::env::temp_dir().join(format!("rext4-mkfs-cmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let img = dir.join("fs.img");
        let r = mkfs::mkfs_file(&img, 1 << 30, &MkfsOptions::default()).expect("mkfs");
        let s = summary(&r);
        assert!(
            s.contains("Superblock backups stored on blocks: \n\t32768, 98304, 163840, 229376\n")
        );
        assert!(s.contains("Creating journal (8192 blocks): done"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
