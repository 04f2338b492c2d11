//! The `rext4` command: inspect ext4 images and copy files out of them, without
//! mounting and without root.
//!
//! Exit codes: 0 success, 1 an operational error (missing file, corrupt or unsupported
//! image), 2 bad usage (clap's default).

mod extract;
mod info;
mod show;
mod spec;
mod timefmt;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rext4::Fs;

#[derive(Parser)]
#[command(
    name = "rext4",
    version,
    about = "A userspace ext4 engine: inspect and copy files from ext4 images"
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
    /// Copy out of an image: `rext4 cp -r IMAGE:/dir DEST`.
    Cp {
        #[arg(short = 'r', short_alias = 'R', long = "recursive")]
        recursive: bool,
        /// Do not show a progress bar.
        #[arg(short = 'q', long)]
        quiet: bool,
        src: String,
        dest: PathBuf,
    },
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
    let out = std::io::stdout();
    let mut out = out.lock();
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
            src,
            dest,
        } => {
            let s =
                split(&src).map_err(|e| (2, format!("{e} (copying into images comes later)")))?;
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
                progress: !quiet && std::io::stderr().is_terminal(),
            };
            let report = extract::copy_out(&fs, &s.path, &dest, opts)
                .map_err(|e| e1(format!("{src}: {e}")))?;
            if !report.errors.is_empty() {
                return Err((1, format!("{} error(s) while copying", report.errors.len())));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("rext4: {msg}");
            ExitCode::from(code)
        }
    }
}
