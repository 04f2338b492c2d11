//! `rext4 mkfs [-b BLOCKSIZE] [-N INODES] [-L LABEL] [-U UUID] [-O FEATURES]
//! [-E EXTENDED] [-t ext2|ext3|ext4] [--upstream] [-q] [-F] [-d SRCDIR] IMAGE [SIZE]`:
//! make an ext4 filesystem (or with `-t` an ext2 or ext3 one: block-mapped files, ext3
//! with a journal) the way `mke2fs` 1.47.0 does (see `rext4::mkfs`), and with `-d`
//! fill it from a directory (through the same copy-in as `rext4 cp -r`, with its
//! progress bar on a terminal unless `-q`, and its handling of SIGINT/SIGTERM/SIGHUP).
//!
//! IMAGE is a regular file (created or truncated to a sparse image of SIZE, which
//! defaults to the file's current size), a block device (SIZE defaults to the whole
//! device), or an existing image through a spec (`disk.img?partition=2`, `?offset=`)
//! or a qcow2 image (`qemu-img create -f qcow2`): formatted where the spec points, the
//! qcow2's guest disk, SIZE defaulting to all of it. SIZE takes mke2fs's suffixes
//! k/m/g/t (KiB..TiB) and s (512-byte sectors); without a suffix it counts blocks of
//! `-b` bytes, or KiB when `-b` is not given.
//! `E2FSPROGS_FAKE_TIME` fixes every timestamp, as it does for mke2fs.
//!
//! Reproducible builds: with `SOURCE_DATE_EPOCH` set, every time the image holds is
//! that time or older (mkfs's own, the superblock's and journal's, and every change
//! the -d copy makes; the source's times newer than it are clamped to it), and with
//! `--seed` (or -U and -E hash_seed) nothing else varies either: the same input gives
//! the same bytes whatever its readdir order, the host or the time of day (see
//! `rext4::repro`). Later edits made with the variable set (cp, mkdir, rm, mv, a
//! mount) keep two such images identical.
//!
//! As mke2fs: an IMAGE that already holds a filesystem is named and the user asked
//! "Proceed anyway? (y,N)" when standard input and output are terminals (`-F` skips
//! the question; elsewhere it is not asked). Extended options (`-E`, comma-separated):
//! `hash_seed=UUID`, `root_owner[=UID:GID]` (without a value: the caller's uid and
//! gid), `mmp_update_interval=SECONDS` (with `-O mmp`; the MMP block records IMAGE as
//! its device, as mke2fs records its argument), `encoding=utf8` (turns casefold on;
//! `-O casefold` alone does too, with utf8-12.1) and `encoding_flags=strict`. Unlike mke2fs, whose root directory is 0:0 unless told, a mkfs run without
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
    /// Derive the UUID and the directory hash seed (unless -U / -E hash_seed give
    /// them) from this text, so that builds of the same input are byte-identical
    /// (with SOURCE_DATE_EPOCH set for the times).
    #[arg(long, value_name = "SEED")]
    pub seed: Option<String>,
    /// Feature edits: comma-separated names, ^name to clear, "none" to clear all.
    #[arg(short = 'O', value_name = "FEATURES", action = ArgAction::Append)]
    pub features: Vec<String>,
    /// Extended options, comma-separated: hash_seed=UUID (directory hash seed),
    /// root_owner[=UID:GID] (owner of the root directory; without a value the caller's;
    /// default 0:0 as root, the caller's otherwise), mmp_update_interval=SECONDS (with
    /// -O mmp; default 5).
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
    /// Fill the new filesystem from a directory (as `rext4 cp -r SRCDIR/. IMAGE:/`
    /// would: modes, owners as root, times, links, xattrs, holes) or a tar archive
    /// (plain, gzip, zstd or xz; `-` reads it from standard input), streamed without
    /// extracting it. SIGINT/SIGTERM/SIGHUP stop it cleanly, as they stop cp.
    #[arg(short = 'd', value_name = "SRCDIR|ARCHIVE|-")]
    pub populate: Option<PathBuf>,
    /// A container image layer to apply on top (repeatable, bottom first): a tar
    /// archive (any compression above) whose `.wh.NAME` files remove NAME from the
    /// layers below and `.wh..wh..opq` empties its directory of them, or an OCI image
    /// layout directory (its index's manifest's layers, in order).
    #[arg(long = "layer", value_name = "TAR|OCIDIR")]
    pub layers: Vec<PathBuf>,
    /// Every file copied in (-d, --layer) gets this owner, without root.
    #[arg(long, value_name = "UID:GID")]
    pub owner: Option<String>,
    /// Map the sources' user ids to the image's, as a user namespace's uid_map:
    /// INSIDE:OUTSIDE:COUNT (source ids OUTSIDE.. become INSIDE..; comma-separated or
    /// repeated; an id no range covers becomes 65534).
    #[arg(long = "uid-map", value_name = "INSIDE:OUTSIDE:COUNT")]
    pub uid_map: Vec<String>,
    /// Map the sources' group ids, as --uid-map.
    #[arg(long = "gid-map", value_name = "INSIDE:OUTSIDE:COUNT")]
    pub gid_map: Vec<String>,
    /// Make the devices, directories and files a device table lists (genext2fs /
    /// makedevs format: NAME TYPE MODE UID GID MAJOR MINOR START INC COUNT), without
    /// root, after the copy.
    #[arg(long = "device-table", value_name = "FILE")]
    pub device_table: Option<PathBuf>,
    /// Label every file with its SELinux context from this file_contexts file (as
    /// setfiles matches it), stored in security.selinux, after everything is in.
    #[arg(long = "file-contexts", value_name = "FILE")]
    pub file_contexts: Option<PathBuf>,
    /// Without a SIZE (a new or empty image file) and with -d or --layer, the image is
    /// made as small as its contents need; this much free space (a size, or a
    /// percentage of the contents, which also adds that share of inodes) is left on top.
    #[arg(long, value_name = "SIZE|PERCENT%")]
    pub extra: Option<String>,
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
    let mut mmp_update_interval = None;
    let mut encoding_flags = None;
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
                Some(("mmp_update_interval", v)) => {
                    mmp_update_interval = Some(
                        v.parse::<u16>()
                            .ok()
                            .filter(|&n| n <= rext4::format::mmp::MAX_UPDATE_INTERVAL)
                            .ok_or_else(|| {
                                format!("invalid mmp_update_interval: {v} (0 to 300 seconds)")
                            })?,
                    );
                }
                // mke2fs: naming the encoding turns casefold on; utf8-12.1 is the
                // only one ext4 has.
                Some(("encoding", "utf8" | "utf8-12.1")) => features.edit("casefold")?,
                Some(("encoding", v)) => {
                    return Err(format!("unknown encoding: {v} (ext4 has utf8, utf8-12.1)"))
                }
                Some(("encoding_flags", "strict")) => {
                    encoding_flags = Some(rext4::format::casefold::ENCODING_FLAG_STRICT)
                }
                Some(("encoding_flags", "nostrict")) => encoding_flags = Some(0),
                Some(("encoding_flags", v)) => {
                    return Err(format!("invalid encoding_flags: {v} (strict or nostrict)"))
                }
                Some(("root_owner", v)) => {
                    root_owner = Some(
                        parse_root_owner(v)
                            .ok_or_else(|| format!("invalid root_owner: '{v}' (UID:GID)"))?,
                    );
                }
                _ => {
                    return Err(format!(
                        "bad extended option: {opt} (valid: hash_seed=UUID, \
                         root_owner[=UID:GID], mmp_update_interval=SECONDS, encoding=utf8, \
                         encoding_flags=strict)"
                    ))
                }
            }
        }
    }
    if encoding_flags.is_some()
        && !features
            .add
            .has_incompat(rext4::format::superblock::feature::INCOMPAT_CASEFOLD)
    {
        return Err("encoding_flags needs casefold (-O casefold or -E encoding=utf8)".into());
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
        Err(_) => rext4::repro::source_date_epoch().map_err(|e| e.to_string())?,
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
        seed: args.seed.as_ref().map(|s| s.as_bytes().to_vec()),
        mmp_update_interval,
        device_path: Some(args.image.clone()),
        encoding_flags,
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

/// mkfs onto what a spec names (a partition, a byte range, a qcow2 image's guest
/// disk), claimed whole for the time of the format; SIZE defaults to the device's.
fn mkfs_spec(
    args: &MkfsArgs,
    fill_with: (&Extras, bool),
    spec: &rext4::ImageSpec,
    opts: MkfsOptions,
    size: Option<u64>,
) -> Result<(), Failure> {
    let failed = |e: rext4::Error| (1, format!("{}: {}", args.image.display(), reason(&e)));
    let report = {
        // A network source has no file here to claim.
        let _claim = match spec.local_file() {
            Some(p) => Some(rext4::Claim::write(p).map_err(failed)?),
            None => None,
        };
        if !confirm_overwrite(args) {
            return Err((1, String::new()));
        }
        let dev = rext4::image::open_device(spec, false, false).map_err(failed)?;
        let opts = MkfsOptions {
            size_bytes: size,
            ..opts
        };
        let r = mkfs::mkfs(&*dev, &opts).map_err(failed)?;
        dev.flush().map_err(|e| failed(e.into()))?;
        r
    };
    finish(args, fill_with, &report)
}

pub fn run(args: MkfsArgs) -> Result<(), Failure> {
    let opts = options(&args).map_err(|e| (2, e))?;
    let extras = extras(&args)?;
    let image = &args.image;
    let size = match &args.size {
        Some(s) => Some(
            mkfs::parse_size(s, args.block_size)
                .ok_or_else(|| (2, format!("invalid filesystem size: '{s}'")))?,
        ),
        None => None,
    };
    let mut from_dir = false;
    if let Some(src) = &args.populate {
        if src.as_os_str() != "-" {
            match std::fs::metadata(src) {
                Ok(m) => from_dir = m.is_dir(),
                Err(e) => return Err((1, format!("{}: {}", src.display(), term::io_reason(&e)))),
            }
        }
    }
    for l in &args.layers {
        if let Err(e) = std::fs::metadata(l) {
            return Err((1, format!("{}: {}", l.display(), term::io_reason(&e))));
        }
    }
    // A spec (`disk.img?partition=2`) or a qcow2 image: formatted through the device
    // the spec opens (its partition, the qcow2's guest disk), which must exist. A new
    // file's name may hold '?': a bad spec is an error only over an existing file.
    match crate::spec::image_spec(image) {
        Ok(spec) => {
            let is_qcow2 = || {
                let mut m = [0u8; 4];
                std::fs::File::open(spec.path()).is_ok_and(|f| f.read_exact_at(&mut m, 0).is_ok())
                    && m == rext4::image::QCOW2_MAGIC
            };
            if !spec.is_plain() || spec.local_file().is_none() || is_qcow2() {
                return mkfs_spec(&args, (&extras, from_dir), &spec, opts, size);
            }
        }
        Err(e) => {
            let text = image.to_string_lossy();
            if text
                .rfind('?')
                .is_some_and(|i| Path::new(&text[..i]).exists())
            {
                return Err((1, e));
            }
        }
    }
    let meta = std::fs::metadata(image).ok();
    let is_device = meta.as_ref().is_some_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_block_device()
    });
    let empty = meta.as_ref().is_none_or(|m| m.is_file() && m.len() == 0);
    if size.is_none() && !is_device && empty && (args.populate.is_some() || !args.layers.is_empty())
    {
        return crate::fit::run(&args, &opts, &extras, from_dir);
    }
    if args.extra.is_some() {
        return Err((
            2,
            "--extra is for an image sized to fit (no SIZE, -d or --layer)".into(),
        ));
    }
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
    finish(&args, (&extras, from_dir), &report)
}

/// After the format: warnings, mke2fs's summary, and the -d copy-in (`fill_with`: the
/// extras and whether the source is a directory).
fn finish(
    args: &MkfsArgs,
    (extras, from_dir): (&Extras, bool),
    report: &MkfsReport,
) -> Result<(), Failure> {
    let image = &args.image;
    for w in &report.warnings {
        errln!("warning: {w}");
    }
    if !args.quiet {
        term::out(&summary(report));
    }
    fill(
        args,
        extras,
        image,
        args.populate.as_deref(),
        from_dir,
        args.quiet,
    )
}

/// Everything after the format: the -d copy (a directory, or `source` as an
/// archive), the layers, the device table and the labels, into `image`.
pub(crate) fn fill(
    args: &MkfsArgs,
    extras: &Extras,
    image: &Path,
    source: Option<&Path>,
    from_dir: bool,
    quiet: bool,
) -> Result<(), Failure> {
    if let Some(src) = source.filter(|_| from_dir) {
        let mut contents = src.as_os_str().to_os_string();
        contents.push("/.");
        let dest = crate::spec::ImagePath {
            image: image.to_path_buf(),
            path: b"/".to_vec(),
        };
        let opts = crate::write_cmds::CpInOptions {
            recursive: true,
            progress: !quiet && std::io::stderr().is_terminal(),
            verbose: false,
            owners: (!extras.owners.is_identity()).then(|| extras.owners.clone()),
        };
        crate::write_cmds::cp_in(
            &[PathBuf::from(contents)],
            &dest,
            &format!("{}:/", image.display()),
            opts,
        )?;
        if !quiet && crate::interrupt::requested().is_none() {
            term::out("Copying files into the device: done\n");
        }
    }
    let archive = source.filter(|_| !from_dir);
    if archive.is_some() || !args.layers.is_empty() {
        populate_archives(args, image, archive, &extras.owners, quiet)?;
    }
    if crate::interrupt::requested().is_none() {
        finish_extras(extras, image)?;
    }
    Ok(())
}

/// What --owner, --uid-map, --gid-map, --device-table and --file-contexts ask for;
/// an error here is a usage error (or the file cannot be read or parsed: 1).
pub(crate) struct Extras {
    owners: rext4_populate::Owners,
    table: Option<Vec<rext4_populate::devtable::Entry>>,
    contexts: Option<rext4_populate::contexts::FileContexts>,
}

pub(crate) fn extras(args: &MkfsArgs) -> Result<Extras, Failure> {
    let usage = |e: rext4::Error| (2, reason(&e));
    let mut owners = rext4_populate::Owners::default();
    if let Some(o) = &args.owner {
        owners.owner = Some(rext4_populate::ids::parse_owner(o).map_err(usage)?);
    }
    for m in &args.uid_map {
        for e in rext4_populate::IdMap::parse(m).map_err(usage)?.entries() {
            owners.uid_map.add_entry(&e).map_err(usage)?;
        }
    }
    for m in &args.gid_map {
        for e in rext4_populate::IdMap::parse(m).map_err(usage)?.entries() {
            owners.gid_map.add_entry(&e).map_err(usage)?;
        }
    }
    let read = |p: &PathBuf| {
        std::fs::read_to_string(p)
            .map_err(|e| (1, format!("{}: {}", p.display(), term::io_reason(&e))))
    };
    fn failed(p: &Path) -> impl Fn(rext4::Error) -> Failure + '_ {
        move |e| (1, format!("{}: {}", p.display(), reason(&e)))
    }
    let table = match &args.device_table {
        Some(p) => Some(rext4_populate::devtable::parse(&read(p)?).map_err(failed(p))?),
        None => None,
    };
    let contexts = match &args.file_contexts {
        Some(p) => {
            Some(rext4_populate::contexts::FileContexts::parse(&read(p)?).map_err(failed(p))?)
        }
        None => None,
    };
    Ok(Extras {
        owners,
        table,
        contexts,
    })
}

/// The device table and the labels, after everything else is in.
fn finish_extras(extras: &Extras, image: &Path) -> Result<(), Failure> {
    if extras.table.is_none() && extras.contexts.is_none() {
        return Ok(());
    }
    let fs = crate::write_cmds::open_rw(image).map_err(|e| (1, e))?;
    let r = (|| {
        if let Some(t) = &extras.table {
            rext4_populate::devtable::apply(&fs, rext4::Ino::ROOT, t)
                .map_err(|e| (1, reason(&e)))?;
        }
        if let Some(fc) = &extras.contexts {
            rext4_populate::contexts::label_tree(&fs, rext4::Ino::ROOT, b"/", fc)
                .map_err(|e| (1, format!("labelling: {}", reason(&e))))?;
        }
        Ok(())
    })();
    crate::write_cmds::close(&fs, image, r)
}

/// `-d ARCHIVE` and the `--layer`s, in that order, through `rext4_populate`.
fn populate_archives(
    args: &MkfsArgs,
    image: &Path,
    archive: Option<&Path>,
    owners: &rext4_populate::Owners,
    quiet: bool,
) -> Result<(), Failure> {
    let fs = crate::write_cmds::open_rw(image).map_err(|e| (1, e))?;
    let opts = rext4_populate::Options {
        owners: owners.clone(),
    };
    let stop = || crate::interrupt::requested().is_some();
    let r = (|| {
        let mut failed = false;
        let mut note = |r: &rext4_populate::Report| {
            for w in &r.warnings {
                errln!("warning: {w}");
            }
            for e in &r.errors {
                errln!("{e}");
                failed = true;
            }
        };
        if let Some(src) = archive {
            let what = src.display().to_string();
            let r = if src.as_os_str() == "-" {
                rext4_populate::apply_archive(
                    &fs,
                    rext4::Ino::ROOT,
                    std::io::stdin(),
                    &opts,
                    false,
                    &stop,
                )
            } else {
                let f = std::fs::File::open(src)
                    .map_err(|e| (1, format!("{what}: {}", term::io_reason(&e))))?;
                rext4_populate::apply_archive(&fs, rext4::Ino::ROOT, f, &opts, false, &stop)
            }
            .map_err(|e| (1, format!("{what}: {}", reason(&e))))?;
            note(&r);
            if r.interrupted {
                return Ok(());
            }
        }
        if !args.layers.is_empty() {
            let r = rext4_populate::apply_layers(&fs, rext4::Ino::ROOT, &args.layers, &opts, &stop)
                .map_err(|e| (1, reason(&e)))?;
            note(&r);
        }
        if failed {
            return Err((1, "some members were not placed".to_string()));
        }
        if !quiet && !stop() {
            term::out("Copying files into the device: done\n");
        }
        Ok(())
    })();
    crate::write_cmds::close(&fs, image, r)
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
        let o = options(&parse(&["-O", "mmp", "-E", "mmp_update_interval=1", "img"]));
        assert_eq!(o.expect("options").mmp_update_interval, Some(1));
        assert!(options(&parse(&["-E", "mmp_update_interval=301", "img"])).is_err());
        assert!(options(&parse(&["-E", "mmp_update_interval=x", "img"])).is_err());
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
