//! The `rext4` command: inspect ext4 images, copy files out of and into them, and
//! change them (mkdir, rm, mv, ln, chmod, chown, truncate, an xfs_io-like `io` shell),
//! without mounting and without root.
//!
//! Exit codes: 0 success, 1 an operational error (missing file, corrupt or unsupported
//! image), 2 bad usage (clap's default).

mod bench;
mod extract;
mod info;
mod io_cmd;
mod mkfs_cmd;
mod mount_cmd;
mod show;
mod spec;
mod timefmt;
mod write_cmds;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rext4::Fs;

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
    /// Print the superblock, like `dumpe2fs -h`.
    Info { image: PathBuf },
    /// List a directory: `rext4 ls [-l] IMAGE:/path`.
    Ls {
        #[arg(short = 'l')]
        long: bool,
        spec: String,
    },
    /// Write a file's contents to stdout.
    Cat { spec: String },
    /// Show an inode's metadata.
    Stat { spec: String },
    /// Copy out of an image (`rext4 cp -r IMAGE:/dir DEST`) or into one
    /// (`rext4 cp -r SRC... IMAGE:/dir`), keeping modes, owners (as root), times,
    /// links, special files, xattrs and holes.
    Cp {
        #[arg(short = 'r', short_alias = 'R', long = "recursive")]
        recursive: bool,
        /// Do not show a progress bar.
        #[arg(short = 'q', long)]
        quiet: bool,
        /// SRC... DEST; exactly one side names IMAGE:/path.
        #[arg(num_args = 2.., required = true)]
        paths: Vec<PathBuf>,
    },
    /// Create directories: `rext4 mkdir [-p] [-m MODE] IMAGE:/path...`.
    Mkdir {
        /// Make parents as needed; no error if the directory exists.
        #[arg(short = 'p', long)]
        parents: bool,
        /// Permission bits (octal), default 755.
        #[arg(short = 'm', long)]
        mode: Option<String>,
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
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Rename or move within one image: `rext4 mv IMAGE:/src... IMAGE:/dest`.
    Mv {
        #[arg(num_args = 2.., required = true)]
        specs: Vec<String>,
    },
    /// Make links: `rext4 ln IMAGE:/target IMAGE:/link` or `rext4 ln -s TEXT IMAGE:/link`.
    Ln {
        /// Make a symbolic link holding TARGET's text.
        #[arg(short = 's', long)]
        symbolic: bool,
        #[arg(allow_hyphen_values = true)]
        target: OsString,
        link: String,
    },
    /// Change permission bits: `rext4 chmod MODE IMAGE:/path...` (octal).
    Chmod {
        mode: String,
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Change owner: `rext4 chown [-h] UID[:GID] IMAGE:/path...` (numeric).
    #[command(disable_help_flag = true)]
    Chown {
        /// Change a symlink itself, not its target.
        #[arg(short = 'h', long = "no-dereference")]
        no_deref: bool,
        /// Print help.
        #[arg(long, action = clap::ArgAction::Help)]
        help: Option<bool>,
        owner: String,
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
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// An xfs_io-like shell over one file: `rext4 io [-f] [-r] -c CMD... IMAGE:/path`.
    Io(io_cmd::IoArgs),
    /// Make an ext4 filesystem, like mkfs.ext4: `rext4 mkfs [OPTIONS] IMAGE [SIZE]`.
    Mkfs(mkfs_cmd::MkfsArgs),
    /// Mount an image through FUSE: `rext4 mount [-o OPTIONS] [-f] IMAGE MOUNTPOINT`.
    Mount(mount_cmd::MountArgs),
    /// Unmount a `rext4 mount` and wait until the image is closed and clean:
    /// `rext4 umount MOUNTPOINT`.
    Umount(mount_cmd::UmountArgs),
    /// Run a benchmark workload through the API: `rext4 bench mdtest|seqwrite|seqread|smallfsync IMAGE`.
    Bench(bench::BenchArgs),
}

fn open(image: &std::path::Path) -> Result<Fs, String> {
    let fs = Fs::open(image).map_err(|e| format!("{}: {e}", image.display()))?;
    for w in fs.warnings() {
        eprintln!("rext4: warning: {}: {w}", image.display());
    }
    Ok(fs)
}

fn split(spec: &str) -> Result<spec::ImagePath, String> {
    spec::parse(spec).ok_or_else(|| format!("{spec}: expected IMAGE:/path"))
}

fn run(cli: Cli) -> Result<(), (u8, String)> {
    let e1 = |s: String| (1u8, s);
    // One write(2) per buffer, not per line: `ls` of a big directory prints many lines.
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    match cli.cmd {
        Cmd::Info { image } => {
            let fs = open(&image).map_err(e1)?;
            out.write_all(info::render(&fs).as_bytes())
                .map_err(|e| e1(e.to_string()))?;
        }
        Cmd::Ls { long, spec } => {
            let s = split(&spec).map_err(|e| (2, e))?;
            let fs = open(&s.image).map_err(e1)?;
            show::ls(&fs, &s.path, long, &mut out).map_err(|e| e1(format!("{spec}: {e}")))?;
        }
        Cmd::Cat { spec } => {
            let s = split(&spec).map_err(|e| (2, e))?;
            let fs = open(&s.image).map_err(e1)?;
            show::cat(&fs, &s.path, &mut out).map_err(|e| e1(format!("{spec}: {e}")))?;
        }
        Cmd::Stat { spec } => {
            let s = split(&spec).map_err(|e| (2, e))?;
            let fs = open(&s.image).map_err(e1)?;
            show::stat(&fs, &s.path, &mut out).map_err(|e| e1(format!("{spec}: {e}")))?;
        }
        Cmd::Cp {
            recursive,
            quiet,
            paths,
        } => cp(recursive, quiet, &paths)?,
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
        Cmd::Mkfs(args) => mkfs_cmd::run(args).map_err(e1)?,
        Cmd::Mount(a) => mount_cmd::run(a).map_err(e1)?,
        Cmd::Umount(a) => mount_cmd::umount(a).map_err(e1)?,
        Cmd::Bench(args) => bench::run(args).map_err(e1)?,
    }
    out.flush().map_err(|e| e1(format!("stdout: {e}")))
}

/// An IMAGE:/path operand naming an existing image file (or device).
fn image_spec(p: &std::path::Path) -> Option<spec::ImagePath> {
    let s = spec::parse(p.to_str()?)?;
    std::fs::metadata(&s.image)
        .is_ok_and(|m| !m.is_dir())
        .then_some(s)
}

/// `rext4 cp`: into an image when the last operand is IMAGE:/path, else out of one.
fn cp(recursive: bool, quiet: bool, paths: &[PathBuf]) -> Result<(), (u8, String)> {
    let e1 = |s: String| (1u8, s);
    let progress = !quiet && std::io::stderr().is_terminal();
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
            recursive,
            progress,
        };
        return write_cmds::cp_in(srcs, &d, &dest.to_string_lossy(), opts);
    }
    let out_src = match srcs {
        [src] if src.to_str().and_then(spec::parse).is_some() => Some(src),
        _ => None,
    };
    let Some(src) = out_src else {
        if let Some(d) = dest.to_str().and_then(spec::parse) {
            return Err((1, format!("{}: no such image file", d.image.display())));
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
        if m.is_dir() && !recursive {
            return Err((1, format!("{src}: is a directory (use -r)")));
        }
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let opts = extract::Options {
        preserve_owner: root,
        progress,
    };
    let report =
        extract::copy_out(&fs, &s.path, dest, opts).map_err(|e| e1(format!("{src}: {e}")))?;
    if !report.errors.is_empty() {
        return Err((1, format!("{} error(s) while copying", report.errors.len())));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The engine's warnings (e.g. a failed writeback) go to standard error; a mount
    // routes them to its own log from here.
    rext4_fuse::init_stderr_log();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            if !msg.is_empty() {
                eprintln!("rext4: {msg}");
            }
            ExitCode::from(code)
        }
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
