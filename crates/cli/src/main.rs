//! The `rext4` command: inspect ext4 images, copy files out of and into them, and
//! change them (mkdir, rm, mv, ln, chmod, chown, truncate, an xfs_io-like `io` shell),
//! without mounting and without root.
//!
//! Exit codes: 0 success, 1 an operational error (missing file, corrupt or unsupported
//! image), 2 bad usage (clap's own errors, and operands or option values the command
//! cannot take: a malformed size, mode, owner, UUID, feature or mount option). Every
//! message is "rext4 SUBCOMMAND: ..." on standard error (see `term`). A writing
//! command caught by SIGINT/SIGTERM/SIGHUP stops, closes its image clean and ends by
//! that signal (see `interrupt`).

/// mimalloc, not glibc's malloc: the engine's caches allocate an entry per insert and
/// free retired ones on whichever thread reclaims them; glibc's arenas then take locks
/// and scatter the entries (measured in docs/BENCHMARKS.md, "The allocator").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod bench_dax;
mod bench_dio;
mod bench_firstwrite;
mod bench_pwtrunc;
mod extract;
mod fit;
mod info;
mod interrupt;
mod io_cmd;
mod mkfs_cmd;
mod mode;
mod mount_cmd;
mod owner;
mod resize_cmd;
mod show;
mod spec;
mod term;
mod timefmt;
mod write_cmds;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use rext4::Fs;

use term::errln;

#[derive(Parser)]
#[command(
    name = "rext4",
    version,
    about = "A userspace ext4 engine: inspect, copy into and out of, and change ext4 images"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the superblock, like `dumpe2fs -h`; of a disk with a partition table,
    /// its partitions and which hold ext4.
    Info {
        /// Image file or block device, or a spec: DISK?partition=N,
        /// DISK?offset=BYTES[&size=BYTES].
        image: PathBuf,
        /// Also print what opening the image read (device requests and bytes).
        #[arg(long)]
        stats: bool,
    },
    /// List directories: `rext4 ls [-l] IMAGE:/path...` (several: a "PATH:" header per
    /// directory, as ls does).
    Ls {
        /// Long listing: mode, links, owner, group, size, modification time.
        #[arg(short = 'l')]
        long: bool,
        /// IMAGE:/path operands (directories are listed, other files named).
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Write files' contents to stdout, one after the other: `rext4 cat IMAGE:/path...`.
    Cat {
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Show inodes' metadata, extents and xattrs: `rext4 stat IMAGE:/path...`.
    Stat {
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Copy out of an image (`rext4 cp -r IMAGE:/dir DEST`) or into one
    /// (`rext4 cp -r SRC... IMAGE:/dir`), keeping modes, owners (as root), times,
    /// links, special files, xattrs and holes. As cp, without -r a pipe or device named
    /// as a source is read into a regular file (`cmd | rext4 cp /dev/stdin IMAGE:/f`).
    ///
    /// Into an image, SIGINT/SIGTERM/SIGHUP stop it after the file in progress (an
    /// unfinished file is removed), and the image is closed clean; a second signal ends
    /// it at once (the journal keeps the image consistent). So do the other commands
    /// that write an image (mkfs -d, rm -r, io...).
    Cp {
        /// Copy directories and their contents.
        #[arg(short = 'r', short_alias = 'R', long = "recursive")]
        recursive: bool,
        /// Do not show a progress bar.
        #[arg(short = 'q', long)]
        quiet: bool,
        /// Print each file once it is copied ('SRC' -> 'DEST').
        #[arg(short = 'v', long)]
        verbose: bool,
        /// Out of an image: replace a destination that cannot be overwritten in place
        /// (a symlink, never written through); a regular file is overwritten anyway,
        /// as by cp. Into an image, existing files are always replaced.
        #[arg(short = 'f', long)]
        force: bool,
        /// SRC... DEST; exactly one side names IMAGE:/path.
        #[arg(num_args = 2.., required = true)]
        paths: Vec<PathBuf>,
    },
    /// Create directories: `rext4 mkdir [-p] [-m MODE] IMAGE:/path...`.
    Mkdir {
        /// Make parents as needed; no error if the directory exists.
        #[arg(short = 'p', long)]
        parents: bool,
        /// Permission bits, octal or symbolic as for chmod (applied to a=rwx);
        /// default 755.
        #[arg(short = 'm', long)]
        mode: Option<String>,
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Remove files or directories: `rext4 rm [-r] [-f] [-d] IMAGE:/path...`.
    Rm {
        /// Remove directories and their contents.
        #[arg(short = 'r', short_alias = 'R', long)]
        recursive: bool,
        /// Ignore missing files.
        #[arg(short = 'f', long)]
        force: bool,
        /// Remove empty directories.
        #[arg(short = 'd', long = "dir")]
        dirs: bool,
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Rename or move within one image: `rext4 mv IMAGE:/src... IMAGE:/dest`.
    Mv {
        /// IMAGE:/src... IMAGE:/dest, all in one image.
        #[arg(num_args = 2.., required = true)]
        specs: Vec<String>,
    },
    /// Make links: `rext4 ln IMAGE:/target IMAGE:/link` or `rext4 ln -s TEXT IMAGE:/link`.
    Ln {
        /// Make a symbolic link holding TARGET's text.
        #[arg(short = 's', long)]
        symbolic: bool,
        /// IMAGE:/target (hard link), or the text a symbolic link holds.
        #[arg(allow_hyphen_values = true)]
        target: OsString,
        /// IMAGE:/link: the new name (inside it, when it is a directory).
        link: String,
    },
    /// Change permission bits: `rext4 chmod MODE IMAGE:/path...`.
    Chmod {
        /// Octal (755, 04755) or symbolic as chmod takes it (u+x, go-w, a=r,
        /// u=rwx,g=rx,o=, +t, g+s, a+X).
        #[arg(allow_hyphen_values = true)]
        mode: String,
        /// IMAGE:/path operands (symbolic links are followed).
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Change inode flags as chattr does: `rext4 chattr [+-=]FLAGS IMAGE:/path...`
    /// (F: casefold, on an empty directory of a casefold filesystem; i, a, A, s, u,
    /// c, d, t, T as chattr names them).
    Chattr {
        /// +FLAGS adds, -FLAGS removes, =FLAGS sets exactly (e.g. +F, -F, +i-a).
        #[arg(allow_hyphen_values = true)]
        flags: String,
        /// IMAGE:/path operands (symbolic links are followed).
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Change owner: `rext4 chown [-h] OWNER[:GROUP] IMAGE:/path...`.
    #[command(disable_help_flag = true)]
    Chown {
        /// Change a symlink itself, not its target.
        #[arg(short = 'h', long = "no-dereference")]
        no_deref: bool,
        /// Print help.
        #[arg(long, action = clap::ArgAction::Help)]
        help: Option<bool>,
        /// USER, USER:GROUP, USER: (USER's login group), :GROUP: names from the
        /// host's user and group databases, or numbers.
        owner: String,
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Set a file's size: `rext4 truncate -s SIZE IMAGE:/path...`.
    Truncate {
        /// SIZE, or +SIZE / -SIZE relative (K, M, G... suffixes: powers of 1024).
        #[arg(short = 's', long, allow_hyphen_values = true)]
        size: String,
        /// Do not create missing files.
        #[arg(short = 'c', long = "no-create")]
        no_create: bool,
        /// IMAGE:/path operands.
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// An xfs_io-like shell over one file: `rext4 io [-f] [-r] -c CMD... IMAGE:/path`.
    ///
    /// SIGINT/SIGTERM/SIGHUP stop it between commands or between the requests of a
    /// pwrite/pread, and the image is closed clean; a second signal ends it at once.
    Io(io_cmd::IoArgs),
    /// Give an image's free blocks back to what holds it, as fstrim does for a mount
    /// (holes punched in an image file, BLKDISCARD on a device, freed qcow2 clusters):
    /// `rext4 trim [-v] IMAGE...`.
    Trim {
        /// Print how many bytes were trimmed, as fstrim -v.
        #[arg(short = 'v', long)]
        verbose: bool,
        /// Images (files, devices or specs).
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Make an ext4 filesystem, like mkfs.ext4: `rext4 mkfs [OPTIONS] IMAGE [SIZE]`.
    Mkfs(mkfs_cmd::MkfsArgs),
    /// Grow or shrink an unmounted image, as resize2fs, crash-safe (interrupted, it is
    /// as it was or resized, never between): `rext4 resize [-P] IMAGE SIZE|min`.
    Resize(resize_cmd::ResizeArgs),
    /// Mount an image through FUSE: `rext4 mount [-o OPTIONS] [-f] IMAGE MOUNTPOINT`.
    Mount(mount_cmd::MountArgs),
    /// Unmount a `rext4 mount` and wait until the image is closed and clean:
    /// `rext4 umount MOUNTPOINT`.
    Umount(mount_cmd::UmountArgs),
    /// Make a rext4 mount durable: everything written to it before, also what the
    /// kernel still caches, is on stable storage when this returns (`sync` alone does
    /// not reach a FUSE server): `rext4 sync MOUNTPOINT...`.
    Sync(mount_cmd::SyncArgs),
    /// Run a benchmark workload through the API: `rext4 bench WORKLOAD IMAGE`
    /// (mdtest, seqwrite, seqread, smallfsync, pwtrunc, churn, dax, firstwrite,
    /// dio-overwrite).
    Bench(bench::BenchArgs),
}

/// Open `image` (an image spec) read-only, printing the engine's warnings.
fn open(image: &std::path::Path) -> Result<Fs, String> {
    let spec = spec::image_spec(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let fs = Fs::open_spec(&spec, rext4::FsOptions::default())
        .map_err(|e| format!("{}: {}", image.display(), term::reason(&e)))?;
    for w in fs.warnings() {
        errln!("warning: {}: {w}", image.display());
    }
    Ok(fs)
}

fn split(spec: &str) -> Result<spec::ImagePath, String> {
    spec::parse(spec).ok_or_else(|| format!("{spec}: expected IMAGE:/path"))
}

/// Whether the command changes an image: those catch SIGINT/SIGTERM/SIGHUP to stop
/// cleanly (`interrupt`). `cp` out of an image only writes host files.
fn writes_an_image(cmd: &Cmd) -> bool {
    match cmd {
        Cmd::Info { .. } | Cmd::Ls { .. } | Cmd::Cat { .. } | Cmd::Stat { .. } => false,
        // The mount handles its own signals.
        Cmd::Mount(_) | Cmd::Umount(_) | Cmd::Sync(_) => false,
        Cmd::Cp { paths, .. } => paths.last().and_then(|d| image_spec(d)).is_some(),
        Cmd::Io(a) => a.writes(),
        _ => true,
    }
}

fn run(cli: Cli) -> Result<(), (u8, String)> {
    let e1 = |s: String| (1u8, s);
    match cli.cmd {
        Cmd::Info { image, stats } => {
            let fs = match open(&image) {
                Ok(fs) => fs,
                Err(e) => {
                    // A disk with a partition table: list its partitions.
                    if let Some(text) = spec::image_spec(&image)
                        .ok()
                        .filter(|s| s.part == rext4::image::Part::Whole)
                        .and_then(|s| rext4::image::inspect(&s).ok())
                        .and_then(|d| info::render_disk(&image.to_string_lossy(), &d))
                    {
                        show::write_out(text.as_bytes())?;
                        return Ok(());
                    }
                    return Err(e1(e));
                }
            };
            show::write_out(info::render(&fs).as_bytes())?;
            if stats {
                show::write_out(info::render_stats(&fs).as_bytes())?;
            }
        }
        Cmd::Ls { long, specs } => show::ls_all(&specs, long)?,
        Cmd::Cat { specs } => show::cat_all(&specs)?,
        Cmd::Stat { specs } => show::stat_all(&specs)?,
        Cmd::Cp {
            recursive,
            quiet,
            verbose,
            force,
            paths,
        } => cp(
            CpFlags {
                recursive,
                quiet,
                verbose,
                force,
            },
            &paths,
        )?,
        Cmd::Mkdir {
            parents,
            mode,
            specs,
        } => write_cmds::mkdir(parents, mode.as_deref(), &specs)?,
        Cmd::Rm {
            recursive,
            force,
            dirs,
            specs,
        } => write_cmds::rm(recursive, force, dirs, &specs)?,
        Cmd::Mv { specs } => write_cmds::mv(&specs)?,
        Cmd::Ln {
            symbolic,
            target,
            link,
        } => write_cmds::ln(symbolic, &target, &link)?,
        Cmd::Chmod { mode, specs } => write_cmds::chmod(&mode, &specs)?,
        Cmd::Chattr { flags, specs } => write_cmds::chattr(&flags, &specs)?,
        Cmd::Chown {
            no_deref,
            owner,
            specs,
            ..
        } => write_cmds::chown(&owner, no_deref, &specs)?,
        Cmd::Truncate {
            size,
            no_create,
            specs,
        } => write_cmds::truncate(&size, no_create, &specs)?,
        Cmd::Io(args) => io_cmd::run(args)?,
        Cmd::Trim { verbose, images } => {
            for image in &images {
                let fs = write_cmds::open_rw(image).map_err(e1)?;
                let mut n = 0;
                let r = fs
                    .trim(0, u64::MAX, 0)
                    .map(|t| n = t)
                    .map_err(|e| (1, format!("{}: {}", image.display(), term::reason(&e))));
                write_cmds::close(&fs, image, r)?;
                if verbose {
                    println!("{}: {} ({n} bytes) trimmed", image.display(), human(n));
                }
            }
        }
        Cmd::Mkfs(args) => mkfs_cmd::run(args)?,
        Cmd::Resize(args) => resize_cmd::run(args)?,
        Cmd::Mount(a) => {
            no_huge_pages();
            // A malformed -o list is a usage error (exit 2), found before mounting.
            for list in &a.options {
                rext4_fuse::apply_options(&mut rext4_fuse::MountOptions::default(), list)
                    .map_err(|e| (2, e))?;
            }
            mount_cmd::run(a).map_err(e1)?
        }
        Cmd::Umount(a) => mount_cmd::umount(a).map_err(e1)?,
        Cmd::Sync(a) => mount_cmd::sync(a).map_err(e1)?,
        Cmd::Bench(args) => bench::run(args).map_err(e1)?,
    }
    Ok(())
}

/// Bytes as fstrim -v shows them ("1 GiB").
fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// An IMAGE:/path operand naming an existing image file (or device).
fn image_spec(p: &std::path::Path) -> Option<spec::ImagePath> {
    let s = spec::parse(p.to_str()?)?;
    spec::exists(s.image.to_str()?).then_some(s)
}

/// The flags of `rext4 cp`.
struct CpFlags {
    recursive: bool,
    quiet: bool,
    verbose: bool,
    force: bool,
}

/// `rext4 cp`: into an image when the last operand is IMAGE:/path, else out of one.
fn cp(flags: CpFlags, paths: &[PathBuf]) -> Result<(), (u8, String)> {
    let e1 = |s: String| (1u8, s);
    let progress = !flags.quiet && std::io::stderr().is_terminal();
    let Some((dest, srcs)) = paths.split_last() else {
        return Err((2, "missing operand".into()));
    };
    if let Some(d) = image_spec(dest) {
        if let Some(s) = srcs.iter().find(|s| image_spec(s).is_some()) {
            return Err((
                2,
                format!("{}: copying between images is not supported", s.display()),
            ));
        }
        let opts = write_cmds::CpInOptions {
            recursive: flags.recursive,
            progress,
            verbose: flags.verbose,
            owners: None,
        };
        return write_cmds::cp_in(srcs, &d, &dest.to_string_lossy(), opts);
    }
    let out_src = match srcs {
        [src] if src.to_str().and_then(spec::parse).is_some() => Some(src),
        _ => None,
    };
    let Some(src) = out_src else {
        if let Some(d) = dest.to_str().and_then(spec::parse) {
            return Err((
                1,
                format!("{}: No such file or directory", d.image.display()),
            ));
        }
        return Err((
            2,
            "expected SRC... IMAGE:/dir (into an image) or IMAGE:/path DEST (out of one)".into(),
        ));
    };
    let src = src.to_string_lossy().into_owned();
    let s = split(&src).map_err(|e| (2, e))?;
    let fs = open(&s.image).map_err(e1)?;
    let meta = fs.resolve(&s.path, false).and_then(|ino| fs.stat_ino(ino));
    if let Ok(m) = &meta {
        if m.is_dir() && !flags.recursive {
            return Err((1, format!("{src}: Is a directory (use -r)")));
        }
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let opts = extract::Options {
        preserve_owner: root,
        progress,
        verbose: flags.verbose,
        force: flags.force,
    };
    let report = extract::copy_out(&fs, &s.path, &src, dest, opts)
        .map_err(|e| e1(format!("{src}: {}", term::reason(&e))))?;
    if !report.errors.is_empty() {
        return Err((1, format!("{} error(s) while copying", report.errors.len())));
    }
    Ok(())
}

/// clap's usage error as the other messages read ("rext4 ls: unexpected argument
/// '-Z' found"), with coreutils' hint; exit 2. Help and version go through clap.
fn usage_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    // The subcommand, when the first argument names one.
    let cmd = Cli::command();
    let sub = std::env::args()
        .nth(1)
        .filter(|a| cmd.get_subcommands().any(|c| c.get_name() == a));
    if let Some(name) = &sub {
        term::set_subcommand(name);
    }
    let text = e.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    let text = text.split("\n\nUsage:").next().unwrap_or(text);
    let text: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("For more information"))
        .collect();
    let text = text.join("\n");
    let text = text.trim_end();
    errln!("{text}");
    let help = match &sub {
        Some(n) => format!("rext4 {n} --help"),
        None => "rext4 --help".to_string(),
    };
    let _ = writeln!(std::io::stderr(), "Try '{help}' for more information.");
    std::process::exit(2)
}

/// No transparent huge pages for the mount server: mimalloc asks for them, and each
/// of its threads' first allocations then fault in (and zero) 2 MiB at a time —
/// measured as ~8 ms of a fresh mount's first 4 KiB write+fsync spent in the kernel's
/// page clearing (docs/BENCHMARKS.md, #14). In-process work keeps them: `rext4 bench
/// mdtest` creates ~30% faster with them, while a mount's rate is its round trips.
fn no_huge_pages() {
    // SAFETY: prctl(2) with integer arguments; affects only this process's mappings.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn main() -> ExitCode {
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => usage_error(e),
    };
    if let Some(name) = matches.subcommand_name() {
        term::set_subcommand(name);
    }
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => usage_error(e),
    };
    // The engine's warnings (e.g. a failed writeback) go to standard error; a mount
    // routes them to its own log from here.
    rext4_fuse::init_stderr_log();
    if writes_an_image(&cli.cmd) {
        interrupt::install();
    }
    let r = run(cli);
    if let Err((_, msg)) = &r {
        if !msg.is_empty() {
            errln!("{msg}");
        }
    }
    if let Some(sig) = interrupt::requested() {
        errln!("interrupted by {}", interrupt::name(sig));
        interrupt::finish();
    }
    match r {
        Ok(()) if term::output_failed() => ExitCode::from(1),
        Ok(()) => ExitCode::SUCCESS,
        Err((code, _)) => ExitCode::from(code),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
