//! `rext4 mkfs [-b BLOCKSIZE] [-N INODES] [-L LABEL] [-U UUID] [-O FEATURES]
//! [-E hash_seed=UUID] [-q] [-F] [-d SRCDIR] IMAGE [SIZE]`: make an ext4 filesystem
//! the way `mkfs.ext4` 1.47.0 does (see `rext4::mkfs`).
//!
//! IMAGE is a regular file (created or truncated to a sparse image of SIZE, which
//! defaults to the file's current size) or a block device (SIZE defaults to the whole
//! device). SIZE takes mke2fs's suffixes k/m/g/t (KiB..TiB) and s (512-byte sectors);
//! without a suffix it counts blocks of `-b` bytes, or KiB when `-b` is not given.
//! `E2FSPROGS_FAKE_TIME` fixes every timestamp, as it does for mke2fs.

use std::path::PathBuf;

use clap::ArgAction;
use rext4::device::{BlockDevice, FileDevice};
use rext4::mkfs::{self, FeatureSet, MkfsOptions, MkfsReport};

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
    /// Extended options (comma-separated): hash_seed=UUID.
    #[arg(short = 'E', value_name = "OPTIONS", action = ArgAction::Append)]
    pub extended: Vec<String>,
    /// Filesystem type; only ext4 is made.
    #[arg(short = 't', value_name = "TYPE")]
    pub fs_type: Option<String>,
    /// Start from e2fsprogs 1.47.0's own defaults (adds orphan_file and
    /// metadata_csum_seed) instead of Debian's.
    #[arg(long)]
    pub upstream: bool,
    /// Quiet: print nothing but errors.
    #[arg(short = 'q')]
    pub quiet: bool,
    /// Force (accepted for compatibility; rext4 never asks).
    #[arg(short = 'F', action = ArgAction::Count)]
    pub force: u8,
    /// Copy the contents of a directory into the new filesystem (not yet supported).
    #[arg(short = 'd', value_name = "SRCDIR")]
    pub populate: Option<PathBuf>,
    /// Image file or block device.
    pub image: PathBuf,
    /// Filesystem size (default: the file's or device's size).
    pub size: Option<String>,
}

fn options(args: &MkfsArgs) -> Result<MkfsOptions, String> {
    if let Some(t) = &args.fs_type {
        if t != "ext4" {
            return Err(format!("only ext4 filesystems can be made, not {t}"));
        }
    }
    let mut features = FeatureSet::default();
    for spec in &args.features {
        features.edit(spec)?;
    }
    let mut hash_seed = None;
    for list in &args.extended {
        for opt in list.split(',').filter(|o| !o.is_empty()) {
            match opt.split_once('=') {
                Some(("hash_seed", v)) => {
                    hash_seed =
                        Some(mkfs::parse_uuid(v).ok_or_else(|| format!("invalid hash seed: {v}"))?);
                }
                _ => return Err(format!("bad extended option: {opt}")),
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
        creation_time,
        populate_from: args.populate.clone(),
        ..MkfsOptions::default()
    })
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

pub fn run(args: MkfsArgs) -> Result<(), String> {
    let mut opts = options(&args)?;
    // -d is done here, after the format, through the same copy-in as `rext4 cp -r`.
    let populate = opts.populate_from.take();
    let image = &args.image;
    let meta = std::fs::metadata(image).ok();
    let is_device = meta.as_ref().is_some_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_block_device()
    });
    let size = match &args.size {
        Some(s) => Some(
            mkfs::parse_size(s, args.block_size)
                .ok_or_else(|| format!("invalid filesystem size: {s}"))?,
        ),
        None => None,
    };
    // A device must not be formatted while mounted or used by another writer (the
    // engine's claim; `mkfs_file` claims an image file itself); held for the format
    // only, since the -d copy-in below claims it again.
    let lock = if is_device {
        Some(rext4::Claim::write(image).map_err(|e| format!("{}: {e}", image.display()))?)
    } else {
        None
    };
    let report = if is_device {
        let dev = FileDevice::open(image, false, false)
            .map_err(|e| format!("{}: {e}", image.display()))?;
        opts.size_bytes = size;
        let r = mkfs::mkfs(&dev, &opts).map_err(|e| format!("{}: {e}", image.display()))?;
        dev.flush()
            .map_err(|e| format!("{}: {e}", image.display()))?;
        r
    } else {
        let size = match (size, meta) {
            (Some(s), _) => s,
            (None, Some(m)) if m.len() > 0 => mkfs::device_fs_size(m.len(), args.block_size),
            _ => {
                return Err(format!(
                    "{}: give a size for a new or empty image file",
                    image.display()
                ))
            }
        };
        mkfs::mkfs_file(image, size, &opts).map_err(|e| format!("{}: {e}", image.display()))?
    };
    drop(lock);
    for w in &report.warnings {
        eprintln!("rext4 mkfs: warning: {w}");
    }
    if !args.quiet {
        print!("{}", summary(&report));
    }
    if let Some(src) = populate {
        if !src.is_dir() {
            return Err(format!("{}: not a directory", src.display()));
        }
        let mut contents = src.into_os_string();
        contents.push("/.");
        let dest = crate::spec::ImagePath {
            image: image.clone(),
            path: b"/".to_vec(),
        };
        let opts = crate::write_cmds::CpInOptions {
            recursive: true,
            progress: !args.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        };
        crate::write_cmds::cp_in(
            &[PathBuf::from(contents)],
            &dest,
            &format!("{}:/", image.display()),
            opts,
        )
        .map_err(|(_, m)| m)?;
        if !args.quiet {
            println!("Copying files into the device: done");
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
        assert!(options(&parse(&["-U", "nope", "img"])).is_err());
        assert!(options(&parse(&["-t", "ext3", "img"])).is_err());
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
