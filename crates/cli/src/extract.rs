//! `rext4 cp -r IMAGE:/dir DEST`: copy a tree out of an image, preserving modes,
//! owners (when run as root), times, symlinks, hard links, device nodes, fifos and
//! extended attributes.
//!
//! Safety (the image is untrusted input): nothing is ever written outside DEST.
//! - Names come from `Fs::read_dir`, which never yields "." or ".." and reports names
//!   holding '/' or NUL as corruption; each name is still checked again here.
//! - Every object is created new: files with O_CREAT|O_EXCL|O_NOFOLLOW, directories with
//!   mkdir, symlinks/nodes/links with calls that fail on an existing name. A collision
//!   (duplicate names in a corrupt image) is an error for that entry, never a reuse, so
//!   no path ever passes through a symlink this run created: every directory on a
//!   written path was created by mkdir in this run (or is DEST itself).
//! - Symlinks are created, never followed; metadata of symlinks is set with
//!   AT_SYMLINK_NOFOLLOW calls; metadata of files and directories through descriptors
//!   opened with O_NOFOLLOW.
//! - Directory cycles in a corrupt image are cut by a visited set.
//! - The one exception, as cp(1): the destination named on the command line (DEST, or
//!   DEST/NAME when DEST is a directory) may be an existing regular file, which a
//!   regular file overwrites in place (O_TRUNC|O_NOFOLLOW). Anything else there (a
//!   symlink, which is never written through, a fifo, a device; or a regular file under
//!   a non-regular source) is refused ("File exists"), or with `-f` removed and created
//!   anew, as cp -f does with a destination it cannot open. A directory there is never
//!   replaced.

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use rext4::{FileType, Fs, Ino, Metadata, Timestamp};

use crate::term::{self, errln};

pub struct Options {
    pub preserve_owner: bool,
    pub progress: bool,
    /// Print "'SRC' -> 'DEST'" for every file once it is copied.
    pub verbose: bool,
    /// Replace a top-level destination that cannot be overwritten in place.
    pub force: bool,
}

#[derive(Default)]
pub struct Report {
    pub files: u64,
    pub bytes: u64,
    pub errors: Vec<String>,
}

struct Copier<'a> {
    fs: &'a Fs,
    opts: Options,
    links: HashMap<Ino, PathBuf>,
    visited: HashSet<Ino>,
    report: Report,
    bar: ProgressBar,
    /// The destination named on the command line: the only path that may exist.
    top: PathBuf,
}

/// An error of one entry, in the words the CLI uses.
fn why(e: &(dyn std::error::Error + 'static)) -> String {
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        term::io_reason(io)
    } else if let Some(fe) = e.downcast_ref::<rext4::Error>() {
        term::reason(fe)
    } else {
        e.to_string()
    }
}

fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))
}

fn timespec(t: Timestamp) -> libc::timespec {
    libc::timespec {
        tv_sec: t.sec as libc::time_t,
        tv_nsec: t.nsec.min(999_999_999) as _,
    }
}

/// The descriptor a destination names, when it names one of this process's own
/// (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`): `cp IMAGE:/f
/// /dev/stdout > out` writes where the shell pointed it, at its offset and with its
/// flags, and never removes or replaces the name (even with -f).
fn descriptor_dest(dst: &Path) -> Option<libc::c_int> {
    let s = dst.to_str()?;
    match s {
        "/dev/stdout" => Some(1),
        "/dev/stderr" => Some(2),
        _ => s
            .strip_prefix("/dev/fd/")
            .or_else(|| s.strip_prefix("/proc/self/fd/"))?
            .parse()
            .ok(),
    }
}

/// A `File` of its own on descriptor `fd` (a duplicate: closing it leaves `fd` open).
fn create_from_fd(fd: libc::c_int) -> std::io::Result<fs::File> {
    // SAFETY: F_DUPFD_CLOEXEC reads no memory; an fd that is not open gives EBADF.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if d < 0 {
        return Err(std::io::Error::last_os_error());
    }
    use std::os::fd::FromRawFd;
    // SAFETY: `d` was just created by fcntl and is owned by nothing else.
    Ok(unsafe { fs::File::from_raw_fd(d) })
}

fn last_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Set owner, mode and times of `p` without following a final symlink.
fn apply_meta(p: &Path, m: &Metadata, owner: bool) -> std::io::Result<()> {
    let c = cpath(p)?;
    if owner {
        // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
        let r = unsafe { libc::lchown(c.as_ptr(), m.uid, m.gid) };
        if r != 0 {
            return Err(last_err());
        }
    }
    if !m.is_symlink() {
        // chmod after chown: chown clears setuid/setgid bits.
        fs::set_permissions(p, fs::Permissions::from_mode(m.mode & 0o7777))?;
    }
    let ts = [timespec(m.atime), timespec(m.mtime)];
    // SAFETY: `c` is a valid path and `ts` points at two timespecs, as utimensat requires.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        return Err(last_err());
    }
    Ok(())
}

fn set_xattrs(p: &Path, attrs: &[(Vec<u8>, Vec<u8>)]) -> Vec<String> {
    let mut errs = Vec::new();
    let Ok(c) = cpath(p) else { return errs };
    for (name, value) in attrs {
        let Ok(n) = CString::new(name.clone()) else {
            continue;
        };
        // SAFETY: both strings are NUL-terminated and `value` is valid for its length.
        let r = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r != 0 {
            errs.push(format!(
                "{}: xattr {}: {}",
                p.display(),
                String::from_utf8_lossy(name),
                term::io_reason(&last_err())
            ));
        }
    }
    errs
}

impl Copier<'_> {
    fn err(&mut self, msg: String) {
        self.bar.suspend(|| errln!("{msg}"));
        self.report.errors.push(msg);
    }

    fn copy(&mut self, ino: Ino, src: &str, dst: &Path) {
        if let Err(e) = self.copy_one(ino, src, dst) {
            self.err(format!("{}: {}", dst.display(), why(e.as_ref())));
        }
    }

    /// `cp -v`'s line for a finished file.
    fn done(&self, src: &str, dst: &Path) {
        if self.opts.verbose {
            let line = format!("'{src}' -> '{}'\n", dst.display());
            self.bar.suspend(|| term::out(&line));
        }
    }

    /// Before creating a non-regular file at the command line's destination: with -f,
    /// remove an existing non-directory there, as cp -f does.
    fn clear_top(&self, dst: &Path) -> std::io::Result<()> {
        if dst == self.top && self.opts.force {
            if let Ok(md) = fs::symlink_metadata(dst) {
                if !md.is_dir() {
                    fs::remove_file(dst)?;
                }
            }
        }
        Ok(())
    }

    fn copy_one(
        &mut self,
        ino: Ino,
        src: &str,
        dst: &Path,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let m = self.fs.stat_ino(ino)?;
        if !m.is_dir() && m.nlink > 1 {
            if let Some(first) = self.links.get(&ino) {
                fs::hard_link(first, dst)?;
                self.done(src, dst);
                return Ok(());
            }
        }
        if !m.is_dir() && !m.is_file() {
            self.clear_top(dst)?;
        }
        match m.file_type {
            FileType::Dir => return self.copy_dir(ino, &m, src, dst),
            FileType::File => {
                if self.copy_file(ino, dst)? {
                    // Written into a device or pipe the user named as the destination
                    // (`cp IMAGE:/f /dev/null`): its mode, owner, times and xattrs are
                    // not the copy's to set.
                    self.report.files += 1;
                    self.done(src, dst);
                    return Ok(());
                }
            }
            FileType::Symlink => {
                let target = self.fs.read_link_ino(ino)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), dst)?;
            }
            FileType::CharDevice | FileType::BlockDevice | FileType::Fifo => {
                let c = cpath(dst)?;
                let kind = match m.file_type {
                    FileType::CharDevice => libc::S_IFCHR,
                    FileType::BlockDevice => libc::S_IFBLK,
                    _ => libc::S_IFIFO,
                };
                let (ma, mi) = m.rdev.unwrap_or((0, 0));
                let dev = libc::makedev(ma, mi);
                // SAFETY: `c` is a valid NUL-terminated path; mknod does not follow an
                // existing final symlink (it fails with EEXIST).
                let r = unsafe { libc::mknod(c.as_ptr(), kind | 0o600, dev) };
                if r != 0 {
                    return Err(last_err().into());
                }
            }
            FileType::Socket | FileType::Unknown => {
                self.err(format!(
                    "{}: skipping a socket or unknown file type",
                    dst.display()
                ));
                return Ok(());
            }
        }
        self.finish(ino, &m, dst);
        if m.nlink > 1 {
            // Recorded only once this name exists as the file we created, so later
            // names can never be linked to something else that holds the path.
            self.links.insert(ino, dst.to_path_buf());
        }
        self.report.files += 1;
        self.done(src, dst);
        Ok(())
    }

    fn finish(&mut self, ino: Ino, m: &Metadata, dst: &Path) {
        match self.fs.xattrs_ino(ino) {
            Ok(x) => {
                for e in set_xattrs(dst, &x) {
                    self.err(e);
                }
            }
            Err(e) => self.err(format!(
                "{}: reading xattrs: {}",
                dst.display(),
                term::reason(&e)
            )),
        }
        if let Err(e) = apply_meta(dst, m, self.opts.preserve_owner) {
            self.err(format!(
                "{}: setting attributes: {}",
                dst.display(),
                term::io_reason(&e)
            ));
        }
    }

    /// Copy regular file `ino` to `dst`; true when `dst` was an existing device or
    /// FIFO named on the command line (`/dev/null`, `/dev/stdout` to a pipe),
    /// which, as cp(1), is opened and written in sequence, holes as zeros.
    fn copy_file(&mut self, ino: Ino, dst: &Path) -> Result<bool, Box<dyn std::error::Error>> {
        let f = self.fs.open_ino(ino)?;
        let mut stream = false;
        let create = || {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(dst)
        };
        let named_fd = (dst == self.top).then(|| descriptor_dest(dst)).flatten();
        let mut out = match named_fd.map(create_from_fd) {
            Some(f) => {
                stream = true;
                f?
            }
            None => match create() {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dst == self.top => {
                    let md = fs::symlink_metadata(dst)?;
                    if md.is_dir() {
                        return Err("cannot overwrite a directory with a non-directory".into());
                    }
                    use std::os::unix::fs::FileTypeExt;
                    // A device or a pipe is written into, never removed (even with -f).
                    let sink = fs::metadata(dst).is_ok_and(|t| {
                        let ft = t.file_type();
                        ft.is_char_device() || ft.is_block_device() || ft.is_fifo()
                    });
                    // cp(1): a regular file is overwritten in place. O_NOFOLLOW: should it
                    // have become a symlink since, the open fails and nothing is followed.
                    let in_place = || {
                        OpenOptions::new()
                            .write(true)
                            .truncate(true)
                            .custom_flags(libc::O_NOFOLLOW)
                            .open(dst)
                    };
                    if sink {
                        stream = true;
                        OpenOptions::new().write(true).open(dst)?
                    } else {
                        match md.is_file().then(in_place) {
                            Some(Ok(f)) => f,
                            // cp -f: what cannot be opened is removed and created anew.
                            _ if self.opts.force => {
                                fs::remove_file(dst)?;
                                create()?
                            }
                            Some(Err(e)) => return Err(e.into()),
                            None => {
                                return Err(
                                    "exists and is not a regular file (cp -f replaces it)".into()
                                )
                            }
                        }
                    }
                }
                r => r?,
            },
        };
        let size = f.len()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < size {
            let n = f.read_at(&mut buf, off)?;
            if n == 0 {
                break;
            }
            if stream {
                out.write_all(&buf[..n])?;
            } else if buf[..n].iter().all(|&b| b == 0) {
                // Keep holes: skip writing zeros, set the length at the end.
            } else {
                std::os::unix::fs::FileExt::write_all_at(&out, &buf[..n], off)?;
            }
            off += n as u64;
            self.report.bytes += n as u64;
            self.bar.inc(n as u64);
        }
        if !stream {
            out.set_len(size)?;
        }
        out.flush()?;
        Ok(stream)
    }

    fn copy_dir(
        &mut self,
        ino: Ino,
        m: &Metadata,
        src: &str,
        dst: &Path,
    ) -> Result<(), Box<dyn std::error::Error>> {
        if !self.visited.insert(ino) {
            return Err(format!("directory inode {} appears twice (corrupt image)", ino.0).into());
        }
        if dst.as_os_str().is_empty() {
            return Err("empty destination".into());
        }
        match fs::create_dir(dst) {
            Ok(()) => {}
            // Only the top-level destination may exist already, and only as a real dir.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && self.visited.len() == 1 => {
                if !fs::symlink_metadata(dst)?.is_dir() {
                    return Err("destination exists and is not a directory".into());
                }
            }
            Err(e) => return Err(e.into()),
        }
        fs::set_permissions(dst, fs::Permissions::from_mode(0o700))?;
        let entries = self.fs.read_dir_ino(ino)?;
        for e in entries {
            if e.name.is_empty()
                || e.name == b"."
                || e.name == b".."
                || e.name.contains(&b'/')
                || e.name.contains(&0)
            {
                self.err(format!(
                    "{}: refusing entry name {:?}",
                    dst.display(),
                    e.name
                ));
                continue;
            }
            let child = dst.join(OsStr::from_bytes(&e.name));
            let child_src = format!(
                "{}/{}",
                src.trim_end_matches('/'),
                String::from_utf8_lossy(&e.name)
            );
            self.copy(e.ino, &child_src, &child);
        }
        self.finish(ino, m, dst);
        self.report.files += 1;
        self.done(src, dst);
        Ok(())
    }
}

/// Sum of regular file sizes under `ino`, for the progress bar (each directory once,
/// with no recursion: a tree of any depth, or a corrupted one with loops, ends).
fn total_bytes(fs: &Fs, ino: Ino, seen: &mut HashSet<Ino>) -> u64 {
    let mut total = 0;
    let mut todo = vec![ino];
    while let Some(ino) = todo.pop() {
        let Ok(m) = fs.stat_ino(ino) else { continue };
        if m.is_file() {
            total += m.size;
        } else if m.is_dir() && seen.insert(ino) {
            if let Ok(entries) = fs.read_dir_ino(ino) {
                todo.extend(entries.iter().map(|e| e.ino));
            }
        }
    }
    total
}

/// Copy `src` (a path in the image, named `src_arg` on the command line) to `dest` on
/// the host, cp -r style: when `dest` is an existing directory the copy goes inside it
/// under the source's name.
pub fn copy_out(
    fs: &Fs,
    src: &[u8],
    src_arg: &str,
    dest: &Path,
    opts: Options,
) -> rext4::Result<Report> {
    let ino = fs.resolve(src, false)?;
    let base = src.split(|&c| c == b'/').rfind(|c| !c.is_empty());
    // A last component "." or ".." names no new entry (dest/.. is outside dest): copy
    // into `dest` itself, as GNU cp does.
    let base = base.filter(|c| !matches!(*c, b"." | b".."));
    let target = match (fs::symlink_metadata(dest), base) {
        (Ok(md), Some(name)) if md.is_dir() => dest.join(OsStr::from_bytes(name)),
        _ => dest.to_path_buf(),
    };
    let bar = if opts.progress {
        let total = total_bytes(fs, ino, &mut HashSet::new());
        let b = ProgressBar::new(total);
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
        {
            b.set_style(style);
        }
        b
    } else {
        ProgressBar::hidden()
    };
    let mut c = Copier {
        fs,
        opts,
        links: HashMap::new(),
        visited: HashSet::new(),
        report: Report::default(),
        bar,
        top: target.clone(),
    };
    c.copy(ino, src_arg, &target);
    c.bar.finish_and_clear();
    Ok(c.report)
}
