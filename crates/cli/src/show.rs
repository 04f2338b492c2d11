//! `rext4 ls`, `rext4 stat`, `rext4 cat`, `rext4 info`'s output: the reading commands.
//!
//! Like coreutils, each takes several IMAGE:/path operands (in one image or several):
//! `cat` concatenates, `stat` prints each, `ls` lists the files named first, then each
//! directory under a "OPERAND:" header when there are several operands. An operand
//! that fails is reported on standard error and the others are still printed; the exit
//! code is then 1. A closed standard output ends the command as it ends cat (see
//! `term`).

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use rext4::{FileType, Fs, Ino, Metadata};

use crate::term::{self, errln};
use crate::timefmt::{iso, ls_time};

/// Why printing one operand stopped.
pub enum ShowError {
    /// Writing to standard output failed.
    Out(std::io::Error),
    /// The engine failed (missing path, corrupt image...).
    Fs(rext4::Error),
}

impl From<std::io::Error> for ShowError {
    fn from(e: std::io::Error) -> Self {
        ShowError::Out(e)
    }
}

impl From<rext4::Error> for ShowError {
    fn from(e: rext4::Error) -> Self {
        ShowError::Fs(e)
    }
}

type ShowResult = Result<(), ShowError>;
type Failure = (u8, String);

/// One write(2) per buffer, not per line: `ls` of a big directory prints many lines.
fn stdout() -> std::io::BufWriter<std::io::StdoutLock<'static>> {
    std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock())
}

/// Write all of `bytes` to standard output (`rext4 info`).
pub fn write_out(bytes: &[u8]) -> Result<(), Failure> {
    let mut out = stdout();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(|e| term::reader_output_error(&e))
}

/// The images the operands name, each opened once (read-only).
#[derive(Default)]
struct Images {
    open: Vec<(PathBuf, Fs)>,
}

impl Images {
    /// The operand's image and path, or the reason it has none (printed by the caller).
    fn get(&mut self, arg: &str) -> Result<(Fs, Vec<u8>), Failure> {
        let s = crate::split(arg).map_err(|e| (2, e))?;
        if let Some((_, fs)) = self.open.iter().find(|(p, _)| *p == s.image) {
            return Ok((fs.clone(), s.path));
        }
        let fs = crate::open(&s.image).map_err(|e| (1, e))?;
        self.open.push((s.image, fs.clone()));
        Ok((fs, s.path))
    }
}

/// Every operand must be IMAGE:/path; a malformed one is a usage error before any
/// output.
fn check_operands(args: &[String]) -> Result<(), Failure> {
    for a in args {
        crate::split(a).map_err(|e| (2, e))?;
    }
    Ok(())
}

/// Run `each` on every operand in order; errors of one are printed and the others run.
fn for_each_operand(
    args: &[String],
    mut each: impl FnMut(&Fs, &[u8], &mut dyn Write) -> ShowResult,
) -> Result<(), Failure> {
    check_operands(args)?;
    let mut images = Images::default();
    let mut out = stdout();
    let mut failed = false;
    for a in args {
        let r = match images.get(a) {
            Ok((fs, path)) => each(&fs, &path, &mut out),
            Err((_, m)) => {
                out.flush().map_err(|e| term::reader_output_error(&e))?;
                errln!("{m}");
                failed = true;
                continue;
            }
        };
        failed |= settle(r, a, &mut out)?;
    }
    out.flush().map_err(|e| term::reader_output_error(&e))?;
    if failed {
        Err((1, String::new()))
    } else {
        Ok(())
    }
}

/// The outcome of printing operand `arg`: a failed output ends the command; an engine
/// error is reported after what was printed before it, as cat does, and the command
/// goes on (`Ok(true)`: this operand failed).
fn settle(r: ShowResult, arg: &str, out: &mut impl Write) -> Result<bool, Failure> {
    match r {
        Ok(()) => Ok(false),
        Err(ShowError::Out(e)) => Err(term::reader_output_error(&e)),
        Err(ShowError::Fs(e)) => {
            out.flush().map_err(|e| term::reader_output_error(&e))?;
            errln!("{arg}: {}", term::reason(&e));
            Ok(true)
        }
    }
}

/// `rext4 cat IMAGE:/path...`
pub fn cat_all(args: &[String]) -> Result<(), Failure> {
    for_each_operand(args, |fs, path, out| cat(fs, path, out))
}

/// `rext4 stat IMAGE:/path...`
pub fn stat_all(args: &[String]) -> Result<(), Failure> {
    for_each_operand(args, |fs, path, out| stat(fs, path, out))
}

/// `rext4 ls [-l] IMAGE:/path...`: files named on the command line first (sorted),
/// then each directory, under an "OPERAND:" header when there are several operands.
pub fn ls_all(args: &[String], long: bool) -> Result<(), Failure> {
    check_operands(args)?;
    let mut images = Images::default();
    let mut failed = false;
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for a in args {
        let r = images.get(a).and_then(|(fs, path)| {
            let p = std::path::Path::new(OsStr::from_bytes(&path));
            match fs.symlink_metadata(p) {
                Ok(m) => Ok((fs, m)),
                Err(e) => Err((1, format!("{a}: {}", term::reason(&e)))),
            }
        });
        match r {
            Ok((fs, m)) if m.is_dir() => dirs.push((a, fs, m.ino)),
            Ok((fs, m)) => files.push((a, fs, m.ino)),
            Err((_, m)) => {
                errln!("{m}");
                failed = true;
            }
        }
    }
    files.sort_by(|x, y| x.0.cmp(y.0));
    dirs.sort_by(|x, y| x.0.cmp(y.0));
    let mut out = stdout();
    for (a, fs, ino) in &files {
        let r = list(fs, vec![(a.as_bytes().to_vec(), *ino)], long, &mut out);
        failed |= settle(r, a, &mut out)?;
    }
    let headers = args.len() > 1;
    let mut printed = !files.is_empty();
    for (a, fs, ino) in &dirs {
        let r = (|| -> ShowResult {
            if headers {
                if printed {
                    writeln!(out)?;
                }
                writeln!(out, "{a}:")?;
            }
            printed = true;
            let entries = fs
                .read_dir_ino(*ino)?
                .into_iter()
                .map(|e| (e.name, e.ino))
                .collect();
            list(fs, entries, long, &mut out)
        })();
        failed |= settle(r, a, &mut out)?;
    }
    out.flush().map_err(|e| term::reader_output_error(&e))?;
    if failed {
        Err((1, String::new()))
    } else {
        Ok(())
    }
}

pub fn mode_string(m: &Metadata) -> String {
    let t = match m.file_type {
        FileType::Dir => 'd',
        FileType::Symlink => 'l',
        FileType::CharDevice => 'c',
        FileType::BlockDevice => 'b',
        FileType::Fifo => 'p',
        FileType::Socket => 's',
        FileType::File => '-',
        FileType::Unknown => '?',
    };
    let p = m.mode;
    let bit = |mask: u32, c: char| if p & mask != 0 { c } else { '-' };
    let special = |x: u32, exec: u32, set: char, unset: char| match (p & x != 0, p & exec != 0) {
        (true, true) => set,
        (true, false) => unset,
        (false, true) => 'x',
        (false, false) => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(t);
    s.push(bit(0o400, 'r'));
    s.push(bit(0o200, 'w'));
    s.push(special(0o4000, 0o100, 's', 'S'));
    s.push(bit(0o040, 'r'));
    s.push(bit(0o020, 'w'));
    s.push(special(0o2000, 0o010, 's', 'S'));
    s.push(bit(0o004, 'r'));
    s.push(bit(0o002, 'w'));
    s.push(special(0o1000, 0o001, 't', 'T'));
    s
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn name_str(b: &[u8]) -> String {
    // Show names as the terminal would get them, with control bytes escaped.
    let s = String::from_utf8_lossy(b);
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// Print `entries` (name, inode), sorted, one per line or in `ls -l`'s long format.
fn list(fs: &Fs, mut entries: Vec<(Vec<u8>, Ino)>, long: bool, out: &mut dyn Write) -> ShowResult {
    entries.sort();
    let t = now();
    for (name, ino) in entries {
        if !long {
            writeln!(out, "{}", name_str(&name))?;
            continue;
        }
        let m = fs.stat_ino(ino)?;
        let size = match m.rdev {
            Some((ma, mi)) => format!("{ma}, {mi}"),
            None => m.size.to_string(),
        };
        let mut line = format!(
            "{} {:>3} {:>5} {:>5} {:>10} {} {}",
            mode_string(&m),
            m.nlink,
            m.uid,
            m.gid,
            size,
            ls_time(m.mtime.sec, t),
            name_str(&name)
        );
        if m.is_symlink() {
            let target = fs.read_link_ino(ino)?;
            line.push_str(" -> ");
            line.push_str(&name_str(&target));
        }
        writeln!(out, "{line}")?;
    }
    Ok(())
}

fn stat(fs: &Fs, path: &[u8], out: &mut dyn Write) -> ShowResult {
    let p = std::path::Path::new(OsStr::from_bytes(path));
    let m = fs.symlink_metadata(p)?;
    let kind = match m.file_type {
        FileType::File if m.size == 0 => "regular empty file",
        FileType::File => "regular file",
        FileType::Dir => "directory",
        FileType::Symlink => "symbolic link",
        FileType::CharDevice => "character special file",
        FileType::BlockDevice => "block special file",
        FileType::Fifo => "fifo",
        FileType::Socket => "socket",
        FileType::Unknown => "unknown",
    };
    let mut name = name_str(path);
    if m.is_symlink() {
        name = format!("{name} -> {}", name_str(&fs.read_link_ino(m.ino)?));
    }
    writeln!(out, "  File: {name}")?;
    writeln!(
        out,
        "  Size: {:<15} Blocks: {:<10} IO Block: {:<6} {kind}",
        m.size, m.blocks, m.block_size
    )?;
    let dev = m
        .rdev
        .map(|(a, b)| format!(" Device type: {a},{b}"))
        .unwrap_or_default();
    writeln!(
        out,
        "Inode: {:<15} Links: {:<5} Generation: {}{dev}",
        m.ino.0, m.nlink, m.generation
    )?;
    writeln!(
        out,
        "Access: ({:04o}/{})  Uid: ({:5})   Gid: ({:5})",
        m.mode & 0o7777,
        mode_string(&m),
        m.uid,
        m.gid
    )?;
    writeln!(out, "Access: {}", iso(m.atime.sec, m.atime.nsec))?;
    writeln!(out, "Modify: {}", iso(m.mtime.sec, m.mtime.nsec))?;
    writeln!(out, "Change: {}", iso(m.ctime.sec, m.ctime.nsec))?;
    match m.crtime {
        Some(c) => writeln!(out, " Birth: {}", iso(c.sec, c.nsec))?,
        None => writeln!(out, " Birth: -")?,
    }
    writeln!(out, " Flags: {:#x}", m.flags)?;
    if m.is_file() || m.is_dir() {
        let f = fs.open_ino(m.ino)?;
        let ext = f.extents()?;
        writeln!(out, "Extents: {}", ext.len())?;
        for (l, map) in ext.iter().take(16) {
            if let rext4::Mapping::Mapped {
                physical,
                len,
                unwritten,
            } = map
            {
                let u = if *unwritten { " (unwritten)" } else { "" };
                writeln!(
                    out,
                    "  {l}..{}: {physical}..{}{u}",
                    l + len - 1,
                    physical + len - 1
                )?;
            }
        }
        if ext.len() > 16 {
            writeln!(out, "  ... {} more", ext.len() - 16)?;
        }
    }
    let xattrs = fs.xattrs_ino(m.ino)?;
    for (n, v) in xattrs {
        writeln!(out, "Xattr: {} ({} bytes)", name_str(&n), v.len())?;
    }
    Ok(())
}

fn cat(fs: &Fs, path: &[u8], out: &mut dyn Write) -> ShowResult {
    let p = std::path::Path::new(OsStr::from_bytes(path));
    let f = fs.open_file(p)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    loop {
        let n = f.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        off += n as u64;
    }
    Ok(())
}
