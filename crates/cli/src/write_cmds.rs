//! The write tools: `rext4 cp` into an image, `mkdir`, `rm`, `mv`, `ln`, `chmod`,
//! `chown`, `truncate`. Each opens its image read-write through the embedding API, does
//! its work, and always closes the filesystem (`Fs::close` writes everything back and
//! marks the image clean; its error is reported), also after a failed operation.
//!
//! Conventions (coreutils-like): several operands are processed one after the other, an
//! error on one is printed ("rext4 rm: IMAGE:/x: No such file or directory", worded by
//! `term::reason`) and the others still run; the exit code is 1 if any failed. Bad
//! operands (not IMAGE:/path, different images for `mv`/`ln`, a malformed mode, owner
//! or size) are usage errors (exit 2). New inodes belong to the caller (euid/egid);
//! `cp` keeps the source owner when run as root, as `cp -a` does.
//!
//! SIGINT/SIGTERM/SIGHUP (`interrupt`): the commands stop between operands, `rm -r`
//! between entries, `cp` between files and between 1 MiB chunks of a file (the file
//! in progress is then removed, so every file left is whole), and the image is closed
//! as on success.
//!
//! `cp` into an image (`cp_in`) copies like `cp -a`: modes, owners (root), atime and
//! mtime with nanoseconds, symlinks, hard links (grouped by host (dev, ino)), device
//! nodes, fifos, sockets, extended attributes (ACLs pass through in the VFS format; the
//! engine converts) and holes (SEEK_DATA/SEEK_HOLE, or zero-block skipping where the
//! host filesystem lacks them). Directory times are set after their contents. An
//! existing non-directory target is replaced (like `cp --remove-destination`), an
//! existing directory is merged into. The image file itself is never copied into
//! itself. `-v` prints "'SRC' -> 'IMAGE:/path'" once a file is complete in the engine
//! (it reaches the image with the commit at close). A destination ending in "/" must
//! be a directory, or be made from a source directory, as with cp(1).

use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use rext4::format::inode::mode as imode;
use rext4::{Error, Fs, FsOptions, Ino, SetAttr, Timestamp, XattrFlags};

use crate::interrupt;
use crate::mode::{self, ModeSpec};
use crate::spec::{self, ImagePath};
use crate::term::{self, errln, reason};

/// A failed command: exit code and message ("" when the details were printed already).
pub type Failure = (u8, String);

/// The caller's effective uid and gid: owner of every inode the tools create.
pub fn caller() -> (u32, u32) {
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

fn is_root() -> bool {
    caller().0 == 0
}

/// Open `image` read-write, printing the engine's warnings.
pub fn open_rw(image: &Path) -> Result<Fs, String> {
    // A malformed SOURCE_DATE_EPOCH fails the command (the engine's default would
    // quietly ignore it, and the image would not be reproducible).
    rext4::repro::source_date_epoch().map_err(|e| e.to_string())?;
    // The engine claims the image (one writer at a time, none under a loop device or
    // a mount) until `close`.
    let spec = crate::spec::image_spec(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let fs = Fs::open_spec(
        &spec,
        FsOptions {
            read_only: false,
            // A one-shot copy gains nothing from a large cache: with 64 MiB, writers
            // write back as they go and page buffers are reused instead of faulting
            // in fresh memory for every page copied.
            cache_bytes: Some(64 << 20),
            ..FsOptions::default()
        },
    )
    .map_err(|e| format!("{}: {}", image.display(), reason(&e)))?;
    for w in fs.warnings() {
        errln!("warning: {}: {w}", image.display());
    }
    Ok(fs)
}

/// Close `fs` after `result`; a close error fails an otherwise successful command.
pub fn close(fs: &Fs, image: &Path, result: Result<(), Failure>) -> Result<(), Failure> {
    match (fs.close(), result) {
        (Ok(()), r) => r,
        (Err(e), Ok(())) => Err((
            1,
            format!("{}: closing the image: {}", image.display(), reason(&e)),
        )),
        (Err(e), Err(f)) => {
            errln!("{}: closing the image: {}", image.display(), reason(&e));
            Err(f)
        }
    }
}

/// Parse every operand as IMAGE:/path (usage error otherwise).
pub fn parse_specs(args: &[String]) -> Result<Vec<ImagePath>, Failure> {
    args.iter()
        .map(|a| spec::parse(a).ok_or_else(|| (2, format!("{a}: expected IMAGE:/path"))))
        .collect()
}

/// Run `op` on every operand, opening each image once for a run of operands naming it.
/// Errors are printed as "rext4 CMD: OPERAND: reason"; exit 1 if any failed. A signal
/// stops it between operands.
fn for_each(
    args: &[String],
    mut op: impl FnMut(&Fs, &[u8]) -> rext4::Result<()>,
) -> Result<(), Failure> {
    let specs = parse_specs(args)?;
    let mut failed = false;
    let mut i = 0;
    while i < specs.len() {
        let image = specs[i].image.clone();
        if interrupt::requested().is_some() {
            break;
        }
        let fs = match open_rw(&image) {
            Ok(fs) => fs,
            Err(e) => {
                errln!("{e}");
                failed = true;
                i += 1;
                while i < specs.len() && specs[i].image == image {
                    i += 1;
                }
                continue;
            }
        };
        while i < specs.len() && specs[i].image == image {
            if interrupt::requested().is_some() {
                i = specs.len();
                break;
            }
            if let Err(e) = op(&fs, &specs[i].path) {
                errln!("{}: {}", args[i], reason(&e));
                fs.note_error(&e);
                failed = true;
            }
            i += 1;
        }
        if let Err(e) = fs.close() {
            errln!("{}: closing the image: {}", image.display(), reason(&e));
            failed = true;
        }
    }
    if failed {
        Err((1, String::new()))
    } else {
        Ok(())
    }
}

/// Components of an image path, without empty ones.
fn components(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.split(|&c| c == b'/').filter(|c| !c.is_empty())
}

/// The last component of a path, unless it is "." or ".." (or the path is "/").
fn base_name(path: &[u8]) -> Option<&[u8]> {
    components(path)
        .last()
        .filter(|c| !matches!(*c, b"." | b".."))
}

/// Parse a permission mode, octal or symbolic (see `mode`).
pub fn parse_mode(s: &str) -> Result<ModeSpec, Failure> {
    ModeSpec::parse(s).ok_or_else(|| {
        (
            2,
            format!("invalid mode: '{s}' (octal, e.g. 755, or symbolic, e.g. u+x,go-w)"),
        )
    })
}

// ---------------------------------------------------------------------------------
// mkdir, rm, mv, ln, chmod, chown, truncate

/// `rext4 mkdir [-p] [-m MODE] IMAGE:/path...`
pub fn mkdir(parents: bool, mode: Option<&str>, args: &[String]) -> Result<(), Failure> {
    // As mkdir(1): a symbolic mode applies to a=rwx (with the umask for no class).
    let perm = match mode {
        Some(m) => parse_mode(m)?.apply(0o777, true, mode::umask()),
        None => 0o755,
    };
    let (uid, gid) = caller();
    for_each(args, |fs, path| {
        if parents {
            // Each prefix is resolved from the root, so symlinked components are
            // followed as mkdir -p does.
            let comps: Vec<&[u8]> = components(path).collect();
            let mut cur = Vec::new();
            for (i, comp) in comps.iter().enumerate() {
                cur.push(b'/');
                cur.extend_from_slice(comp);
                match fs.resolve(&cur, true) {
                    Ok(ino) if fs.stat_ino(ino)?.is_dir() => {}
                    Ok(_) => return Err(Error::NotADirectory),
                    Err(Error::NotFound) => {
                        let (p, name) = fs.parent_and_name(&cur)?;
                        let m = if i + 1 == comps.len() { perm } else { 0o755 };
                        fs.mkdir_ino(p, name, m, uid, gid)?;
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        } else {
            if fs.resolve(path, false).is_ok() {
                return Err(Error::Exists);
            }
            let (parent, name) = fs.parent_and_name(path)?;
            fs.mkdir_ino(parent, name, perm, uid, gid).map(|_| ())
        }
    })
}

/// `rext4 rm [-r] [-f] [-d] IMAGE:/path...`
pub fn rm(recursive: bool, force: bool, dirs: bool, args: &[String]) -> Result<(), Failure> {
    for_each(args, |fs, path| {
        let ino = match fs.resolve(path, false) {
            Err(Error::NotFound) if force => return Ok(()),
            r => r?,
        };
        if ino == Ino::ROOT || base_name(path).is_none() {
            return Err(Error::InvalidInput(
                "refusing to remove '.', '..' or the root directory".into(),
            ));
        }
        if fs.stat_ino(ino)?.is_dir() {
            if recursive {
                let (parent, name) = fs.parent_and_name(path)?;
                // One entry at a time, so that a signal stops it between entries
                // (what is removed is removed; the rest stays whole).
                if !fs.empty_dir_ino(ino, &|| interrupt::requested().is_some())? {
                    return Ok(());
                }
                fs.rmdir_ino(parent, name)
            } else if dirs {
                fs.remove_dir(OsStr::from_bytes(path))
            } else {
                Err(Error::IsADirectory)
            }
        } else {
            fs.remove_file(OsStr::from_bytes(path))
        }
    })
}

/// Operands that must all name the same image: (image, paths).
fn same_image(args: &[String]) -> Result<(PathBuf, Vec<Vec<u8>>), Failure> {
    let specs = parse_specs(args)?;
    let first = specs
        .first()
        .map(|s| s.image.clone())
        .ok_or_else(|| (2, "missing operand".to_string()))?;
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let c0 = canon(&first);
    if specs.iter().any(|s| canon(&s.image) != c0) {
        return Err((2, "all operands must be in the same image".into()));
    }
    Ok((first, specs.into_iter().map(|s| s.path).collect()))
}

/// Where `src` goes for `mv`/`ln` into `dest`: inside it when it is a directory.
fn target_in(fs: &Fs, dest: &[u8], name: Option<&[u8]>) -> rext4::Result<(Ino, Vec<u8>)> {
    if let Ok(ino) = fs.resolve(dest, true) {
        if fs.stat_ino(ino)?.is_dir() {
            let name = name.ok_or_else(|| Error::InvalidInput("source has no name".into()))?;
            return Ok((ino, name.to_vec()));
        }
    }
    let (p, n) = fs.parent_and_name(dest)?;
    Ok((p, n.to_vec()))
}

/// `rext4 mv IMAGE:/src... IMAGE:/dest` (one image).
pub fn mv(args: &[String]) -> Result<(), Failure> {
    let (image, paths) = same_image(args)?;
    let Some((dest, srcs)) = paths.split_last() else {
        return Err((2, "missing operand".into()));
    };
    let fs = open_rw(&image).map_err(|e| (1, e))?;
    let mut failed = false;
    let dest_is_dir = fs
        .resolve(dest, true)
        .and_then(|i| fs.stat_ino(i))
        .is_ok_and(|m| m.is_dir());
    if srcs.len() > 1 && !dest_is_dir {
        let r = Err((1, format!("{}: Not a directory", args[args.len() - 1])));
        return close(&fs, &image, r);
    }
    for (i, src) in srcs.iter().enumerate() {
        // Some(true): source and destination are one file (one name, or two hard
        // links), which mv(1) refuses; rename(2) would do nothing and succeed.
        let r = (|| {
            let (p1, n1) = fs.parent_and_name(src)?;
            let (p2, n2) = target_in(&fs, dest, base_name(src))?;
            let from = fs.lookup(p1, n1)?.ok_or(Error::NotFound)?;
            if fs.lookup(p2, &n2)?.is_some_and(|t| t.ino == from.ino) {
                return Ok(true);
            }
            fs.rename_ino(p1, n1, p2, &n2, rext4::RenameFlags::default())
                .map(|()| false)
        })();
        let (from, to) = (&args[i], &args[args.len() - 1]);
        match r {
            Ok(false) => {}
            Ok(true) => {
                errln!("'{from}' and '{to}' are the same file");
                failed = true;
            }
            Err(e) => {
                errln!("{from} -> {to}: {}", reason(&e));
                failed = true;
            }
        }
    }
    let r = if failed {
        Err((1, String::new()))
    } else {
        Ok(())
    };
    close(&fs, &image, r)
}

/// `rext4 ln [-s] TARGET IMAGE:/link`: a hard link to IMAGE:/target, or with `-s` a
/// symlink holding TARGET's text.
pub fn ln(symbolic: bool, target: &OsStr, link: &str) -> Result<(), Failure> {
    let (image, tpath, lpath) = if symbolic {
        let l = spec::parse(link).ok_or_else(|| (2, format!("{link}: expected IMAGE:/path")))?;
        (l.image, target.as_bytes().to_vec(), l.path)
    } else {
        let t = target
            .to_str()
            .map(str::to_string)
            .ok_or_else(|| (2, "target must be IMAGE:/path".to_string()))?;
        let (image, mut paths) = same_image(&[t, link.to_string()])?;
        let l = paths.pop().unwrap_or_default();
        let t = paths.pop().unwrap_or_default();
        (image, t, l)
    };
    if tpath.is_empty() {
        return Err((2, "empty link target".into()));
    }
    let fs = open_rw(&image).map_err(|e| (1, e))?;
    let (uid, gid) = caller();
    let r = (|| {
        let (p, n) = target_in(&fs, &lpath, base_name(&tpath))?;
        if symbolic {
            fs.symlink_ino(p, &n, &tpath, uid, gid).map(|_| ())
        } else {
            let ino = fs.resolve(&tpath, false)?;
            fs.link_ino(ino, p, &n)
        }
    })()
    .map_err(|e| {
        (
            1,
            format!(
                "{link} -> {}: {}",
                String::from_utf8_lossy(&tpath),
                reason(&e)
            ),
        )
    });
    close(&fs, &image, r)
}

/// `rext4 chmod MODE IMAGE:/path...` (octal or symbolic; follows symlinks, like chmod).
pub fn chmod(mode: &str, args: &[String]) -> Result<(), Failure> {
    let spec = parse_mode(mode)?;
    let umask = mode::umask();
    for_each(args, |fs, path| {
        let ino = fs.resolve(path, true)?;
        let m = fs.stat_ino(ino)?;
        let sa = SetAttr {
            mode: Some(spec.apply(m.permissions(), m.is_dir(), umask)),
            ..SetAttr::default()
        };
        fs.setattr_ino(ino, &sa).map(|_| ())
    })
}

/// chattr's letters and the inode flags they stand for.
const CHATTR_LETTERS: &[(char, u32)] = &[
    ('s', 0x1),
    ('u', 0x2),
    ('c', 0x4),
    ('S', 0x8),
    ('i', 0x10),
    ('a', 0x20),
    ('d', 0x40),
    ('A', 0x80),
    ('j', 0x4000),
    ('t', 0x8000),
    ('D', 0x1_0000),
    ('T', 0x2_0000),
    ('e', 0x8_0000),
    ('x', 0x200_0000),
    ('P', 0x2000_0000),
    ('F', 0x4000_0000),
];

/// Parse chattr's mode: groups of `+`, `-` or `=` and letters. Returns the flags to
/// set, to clear, and whether `=` replaces all.
fn parse_chattr(spec: &str) -> Result<(u32, u32, Option<u32>), String> {
    let (mut add, mut sub, mut set) = (0u32, 0u32, None);
    let mut op = None;
    for ch in spec.chars() {
        match ch {
            '+' | '-' | '=' => {
                op = Some(ch);
                if ch == '=' {
                    set.get_or_insert(0);
                }
            }
            _ => {
                let bit = CHATTR_LETTERS
                    .iter()
                    .find(|(c, _)| *c == ch)
                    .map(|(_, b)| *b)
                    .ok_or_else(|| format!("chattr: unknown flag '{ch}' in {spec:?}"))?;
                match op {
                    Some('+') => add |= bit,
                    Some('-') => sub |= bit,
                    Some('=') => *set.get_or_insert(0) |= bit,
                    _ => return Err(format!("chattr: {spec:?} must start with +, - or =")),
                }
            }
        }
    }
    if op.is_none() {
        return Err(format!("chattr: {spec:?} must start with +, - or ="));
    }
    Ok((add, sub, set))
}

/// `rext4 chattr [+-=]FLAGS IMAGE:/path...`: FS_IOC_SETFLAGS with ext4's rules
/// (`Fs::set_flags_ino`): +F / -F only on an empty directory (ENOTEMPTY otherwise).
pub fn chattr(spec: &str, args: &[String]) -> Result<(), Failure> {
    let (add, sub, set) = parse_chattr(spec).map_err(|e| (2, e))?;
    for_each(args, |fs, path| {
        let ino = fs.resolve(path, true)?;
        let old = fs.flags_ino(ino)?;
        let new = match set {
            Some(s) => s,
            None => (old | add) & !sub,
        };
        fs.set_flags_ino(ino, new)
    })
}

/// `rext4 chown [-h] OWNER[:GROUP] IMAGE:/path...` (names from the host's databases,
/// or numbers; see `owner`). As chown(2) does on Linux, a changed owner clears
/// set-user-ID, and set-group-ID when group-executable, on non-directories.
pub fn chown(owner: &str, no_deref: bool, args: &[String]) -> Result<(), Failure> {
    let (uid, gid) = crate::owner::parse_owner(owner).map_err(|e| (2, e))?;
    for_each(args, |fs, path| {
        let ino = fs.resolve(path, !no_deref)?;
        let m = fs.stat_ino(ino)?;
        let mut mode = None;
        if !m.is_dir() && !m.is_symlink() {
            let mut p = m.permissions() & !0o4000;
            if p & 0o010 != 0 {
                p &= !0o2000;
            }
            if p != m.permissions() {
                mode = Some(p);
            }
        }
        let sa = SetAttr {
            uid,
            gid,
            mode,
            ..SetAttr::default()
        };
        fs.setattr_ino(ino, &sa).map(|_| ())
    })
}

/// coreutils-style SIZE: N, N with K/M/G/T/P/E (powers of 1024) or KB/MB/... (powers
/// of 1000), optionally prefixed by '+' or '-' (relative to the current size).
pub fn parse_size(s: &str) -> Result<(i8, u64), Failure> {
    let bad = || (2, format!("invalid size: '{s}'"));
    let (rel, body) = match s.as_bytes().first() {
        Some(b'+') => (1, &s[1..]),
        Some(b'-') => (-1, &s[1..]),
        _ => (0, s),
    };
    let digits = body.bytes().take_while(u8::is_ascii_digit).count();
    let n: u64 = body[..digits].parse().map_err(|_| bad())?;
    let suffix = &body[digits..];
    let powers = "KMGTPE";
    let mult: u64 = if suffix.is_empty() {
        1
    } else {
        let up = suffix.to_ascii_uppercase();
        let mut chars = up.chars();
        let c = chars.next().ok_or_else(bad)?;
        let exp = powers.find(c).ok_or_else(bad)? as u32 + 1;
        match chars.as_str() {
            "" | "IB" => 1024u64.checked_pow(exp).ok_or_else(bad)?,
            "B" => 1000u64.checked_pow(exp).ok_or_else(bad)?,
            _ => return Err(bad()),
        }
    };
    Ok((rel, n.checked_mul(mult).ok_or_else(bad)?))
}

/// `rext4 truncate [-c] -s SIZE IMAGE:/path...` (creates missing files unless -c).
pub fn truncate(size: &str, no_create: bool, args: &[String]) -> Result<(), Failure> {
    let (rel, n) = parse_size(size)?;
    let (uid, gid) = caller();
    for_each(args, |fs, path| {
        let ino = match fs.resolve(path, true) {
            Err(Error::NotFound) if no_create => return Ok(()),
            Err(Error::NotFound) => {
                let (p, name) = fs.parent_and_name(path)?;
                let mode = u32::from(imode::S_IFREG) | 0o644;
                fs.mknod_ino(p, name, mode, uid, gid, (0, 0))?
            }
            r => r?,
        };
        let cur = fs.stat_ino(ino)?;
        if cur.is_dir() {
            return Err(Error::IsADirectory);
        }
        let new = match rel {
            1 => cur.size.checked_add(n).ok_or(Error::FileTooLarge)?,
            -1 => cur.size.saturating_sub(n),
            _ => n,
        };
        fs.truncate_ino(ino, new)
    })
}

// ---------------------------------------------------------------------------------
// cp into an image

/// Options of `rext4 cp` into an image.
pub struct CpInOptions {
    pub recursive: bool,
    pub progress: bool,
    /// Print "'SRC' -> 'IMAGE:/path'" for every file once it is complete.
    pub verbose: bool,
    /// Owners from the sources' ids through these (`mkfs --owner`, `--uid-map`,
    /// `--gid-map`), also without root; `None`: the sources' as root, else the caller.
    pub owners: Option<rext4_populate::Owners>,
}

/// Host (dev, ino) of a file.
type HostId = (u64, u64);

struct InCopier<'a> {
    fs: &'a Fs,
    recursive: bool,
    root: bool,
    caller: (u32, u32),
    /// Host hard-link groups already copied: host id → image inode.
    links: HashMap<HostId, Ino>,
    /// The image file itself, never copied into itself.
    image_id: Option<HostId>,
    errors: usize,
    bar: ProgressBar,
    buf: Vec<u8>,
    /// Directory metadata taken by the progress pre-walk before it listed them (listing
    /// moves a directory's atime under relatime; the copy must keep the original).
    dir_meta: HashMap<PathBuf, std::fs::Metadata>,
    verbose: bool,
    /// "IMAGE:", before image paths in `-v` lines.
    image_arg: String,
    /// `CpInOptions::owners`.
    owners: Option<rext4_populate::Owners>,
    /// Reproducible mode (SOURCE_DATE_EPOCH set): zero blocks become holes whatever
    /// the source's holes (`write_nonzero_blocks`), and the atime is the mtime (reading
    /// a tree moves its atimes, so two copies of one tree never agree on them).
    reproducible: bool,
}

fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))
}

/// Every extended attribute of `p` (not following a final symlink), as the kernel
/// lists them: user.*, trusted.* (root only), security.*, system.posix_acl_*.
pub fn host_xattrs(p: &Path) -> std::io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = cpath(p)?;
    let names = loop {
        // SAFETY: `c` is NUL-terminated; a null buffer of size 0 asks for the length.
        let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOTSUP) {
                return Ok(Vec::new());
            }
            return Err(e);
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: `buf` has `buf.len()` writable bytes.
        let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue; // the list grew meanwhile
            }
            return Err(e);
        }
        buf.truncate(m as usize);
        break buf;
    };
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let Ok(cn) = CString::new(name) else { continue };
        let value = loop {
            // SAFETY: both strings are NUL-terminated; a null buffer asks for the length.
            let n = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), std::ptr::null_mut(), 0) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut buf = vec![0u8; n as usize];
            // SAFETY: `buf` has `buf.len()` writable bytes.
            let m = unsafe {
                libc::lgetxattr(c.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
            };
            if m < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ERANGE) {
                    continue;
                }
                return Err(e);
            }
            buf.truncate(m as usize);
            break buf;
        };
        out.push((name.to_vec(), value));
    }
    // In name order, not the host filesystem's: the image's layout follows the order
    // of the sets, and must not depend on where the source lives.
    out.sort();
    Ok(out)
}

fn ts(sec: i64, nsec: i64) -> Timestamp {
    Timestamp {
        sec,
        nsec: nsec.clamp(0, 999_999_999) as u32,
    }
}

/// Sum of regular file sizes under `p` (for the progress bar); records the metadata
/// of every directory before listing it.
fn total_bytes(p: &Path, follow: bool, dirs: &mut HashMap<PathBuf, std::fs::Metadata>) -> u64 {
    let md = if follow {
        std::fs::metadata(p)
    } else {
        std::fs::symlink_metadata(p)
    };
    let Ok(md) = md else { return 0 };
    if md.is_file() {
        return md.len();
    }
    if interrupt::requested().is_some() {
        return 0;
    }
    if !md.is_dir() {
        return 0;
    }
    dirs.insert(p.to_path_buf(), md);
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| total_bytes(&e.path(), false, dirs))
        .sum()
}

/// Why one host→image step did not complete.
enum StepError {
    /// An engine or host error, with context.
    Failed(String),
    /// A signal asked the command to stop (`interrupt`).
    Interrupted,
}

impl From<String> for StepError {
    fn from(s: String) -> Self {
        StepError::Failed(s)
    }
}

type StepResult<T> = Result<T, StepError>;

fn eng(what: &str) -> impl Fn(Error) -> StepError + '_ {
    move |e| StepError::Failed(format!("{what}: {}", reason(&e)))
}

fn host(what: &str) -> impl Fn(std::io::Error) -> StepError + '_ {
    move |e| StepError::Failed(format!("{what}: {}", term::io_reason(&e)))
}

/// `dir` + "/" + `name`, for image paths.
fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = dir.to_vec();
    while p.last() == Some(&b'/') {
        p.pop();
    }
    p.push(b'/');
    p.extend_from_slice(name);
    p
}

impl InCopier<'_> {
    fn err(&mut self, msg: String) {
        self.bar.suspend(|| errln!("{msg}"));
        self.errors += 1;
    }

    /// `cp -v`'s line, once `dpath` is complete in the engine.
    fn done(&self, src: &Path, dpath: &[u8]) {
        if self.verbose {
            let line = format!(
                "'{}' -> '{}{}'\n",
                src.display(),
                self.image_arg,
                String::from_utf8_lossy(dpath)
            );
            self.bar.suspend(|| term::out(&line));
        }
    }

    fn owner(&self, md: &std::fs::Metadata) -> (u32, u32) {
        if let Some(o) = &self.owners {
            o.map(md.uid(), md.gid())
        } else if self.root {
            (md.uid(), md.gid())
        } else {
            self.caller
        }
    }

    /// Copy host `src` (whose metadata is `md`) to `name` in image directory `parent`
    /// (image path `dpath`). Nothing new is started once a signal came.
    fn copy(&mut self, src: &Path, md: &std::fs::Metadata, parent: Ino, name: &[u8], dpath: &[u8]) {
        if interrupt::requested().is_some() {
            return;
        }
        match self.copy_one(src, md, parent, name, dpath) {
            Ok(()) | Err(StepError::Interrupted) => {}
            Err(StepError::Failed(e)) => self.err(e),
        }
    }

    fn copy_one(
        &mut self,
        src: &Path,
        md: &std::fs::Metadata,
        parent: Ino,
        name: &[u8],
        dpath: &[u8],
    ) -> StepResult<()> {
        let sd = src.display().to_string();
        let id = (md.dev(), md.ino());
        if Some(id) == self.image_id {
            self.bar
                .suspend(|| errln!("{sd}: skipping the image file itself"));
            return Ok(());
        }
        let existing = self.fs.lookup(parent, name).map_err(eng(&sd))?;
        if md.is_dir() {
            let ino = match existing {
                Some(e) => {
                    let m = self.fs.stat_ino(e.ino).map_err(eng(&sd))?;
                    if !m.is_dir() {
                        return Err(format!(
                            "{sd}: cannot overwrite non-directory '{}{}' with a directory",
                            self.image_arg,
                            String::from_utf8_lossy(dpath)
                        )
                        .into());
                    }
                    e.ino
                }
                None => {
                    let (u, g) = self.owner(md);
                    let ino = self
                        .fs
                        .mkdir_ino(parent, name, md.mode() & 0o7777, u, g)
                        .map_err(eng(&sd))?;
                    self.done(src, dpath);
                    ino
                }
            };
            return self.copy_dir_contents(src, md, ino, dpath);
        }
        if let Some(e) = existing {
            let m = self.fs.stat_ino(e.ino).map_err(eng(&sd))?;
            if m.is_dir() {
                return Err(format!(
                    "{sd}: cannot overwrite directory '{}{}' with a non-directory",
                    self.image_arg,
                    String::from_utf8_lossy(dpath)
                )
                .into());
            }
            if self.links.get(&id) == Some(&e.ino) {
                return Ok(()); // already this very file
            }
            self.fs.unlink_ino(parent, name).map_err(|e| {
                StepError::Failed(format!(
                    "{sd}: removing the existing target: {}",
                    reason(&e)
                ))
            })?;
        }
        if md.nlink() > 1 {
            if let Some(&ino) = self.links.get(&id) {
                self.fs.link_ino(ino, parent, name).map_err(eng(&sd))?;
                self.done(src, dpath);
                return Ok(());
            }
        }
        let (u, g) = self.owner(md);
        let perm = md.mode() & 0o7777;
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        // As cp(1): without -r a special file named on the command line (a pipe, as
        // `cp /dev/stdin`, a character device) is read, its bytes becoming a regular
        // file; with -r it is made again as what it is.
        let contents_only = !self.recursive && !ft.is_file() && !ft.is_symlink();
        let ino = if ft.is_file() || contents_only {
            let ino = self
                .fs
                .mknod_ino(parent, name, u32::from(imode::S_IFREG) | perm, u, g, (0, 0))
                .map_err(eng(&sd))?;
            let copied = if contents_only {
                self.copy_stream(src, ino)
            } else {
                self.copy_data(src, md.len(), ino)
            };
            if let Err(e) = copied {
                if matches!(e, StepError::Interrupted) {
                    // Stopped half way: remove the file, so every file left is whole.
                    if let Err(u) = self.fs.unlink_ino(parent, name) {
                        return Err(
                            format!("{sd}: removing the unfinished copy: {}", reason(&u)).into(),
                        );
                    }
                }
                return Err(e);
            }
            ino
        } else if ft.is_symlink() {
            let target = std::fs::read_link(src).map_err(host(&sd))?;
            self.fs
                .symlink_ino(parent, name, target.as_os_str().as_bytes(), u, g)
                .map_err(eng(&sd))?
        } else {
            let kind = if ft.is_char_device() {
                imode::S_IFCHR
            } else if ft.is_block_device() {
                imode::S_IFBLK
            } else if ft.is_fifo() {
                imode::S_IFIFO
            } else if ft.is_socket() {
                imode::S_IFSOCK
            } else {
                return Err(format!("{sd}: unknown file type").into());
            };
            let rdev = md.rdev();
            let dev = (libc::major(rdev), libc::minor(rdev));
            self.fs
                .mknod_ino(parent, name, u32::from(kind) | perm, u, g, dev)
                .map_err(eng(&sd))?
        };
        if md.nlink() > 1 {
            self.links.insert(id, ino);
        }
        self.finish(src, md, ino, false);
        self.done(src, dpath);
        Ok(())
    }

    /// Extended attributes, then (for merged directories) owner and mode, then times:
    /// last, because everything before changes mtime or ctime.
    fn finish(&mut self, src: &Path, md: &std::fs::Metadata, ino: Ino, set_owner_mode: bool) {
        let sd = src.display().to_string();
        match host_xattrs(src) {
            Ok(list) => {
                for (name, value) in list {
                    if let Err(e) = self
                        .fs
                        .set_xattr_ino(ino, &name, &value, XattrFlags::default())
                    {
                        self.err(format!(
                            "{sd}: xattr {}: {}",
                            String::from_utf8_lossy(&name),
                            reason(&e)
                        ));
                    }
                }
            }
            Err(e) => self.err(format!("{sd}: reading xattrs: {}", term::io_reason(&e))),
        }
        let (u, g) = self.owner(md);
        let mtime = ts(md.mtime(), md.mtime_nsec());
        let atime = if self.reproducible {
            mtime
        } else {
            ts(md.atime(), md.atime_nsec())
        };
        let mut sa = SetAttr {
            atime: Some(atime),
            mtime: Some(mtime),
            ..SetAttr::default()
        };
        if set_owner_mode {
            sa.uid = Some(u);
            sa.gid = Some(g);
            sa.mode = Some(md.mode() & 0o7777);
        }
        if let Err(e) = self.fs.setattr_ino(ino, &sa) {
            self.err(format!("{sd}: setting attributes: {}", reason(&e)));
        }
    }

    fn copy_dir_contents(
        &mut self,
        src: &Path,
        md: &std::fs::Metadata,
        ino: Ino,
        dpath: &[u8],
    ) -> StepResult<()> {
        let sd = src.display().to_string();
        let mut entries: Vec<(OsString, PathBuf)> = std::fs::read_dir(src)
            .map_err(host(&sd))?
            .filter_map(|e| match e {
                Ok(e) => Some((e.file_name(), e.path())),
                Err(err) => {
                    self.err(format!("{sd}: {}", term::io_reason(&err)));
                    None
                }
            })
            .collect();
        entries.sort();
        for (name, path) in entries {
            if interrupt::requested().is_some() {
                // An unfinished directory keeps the time of its last change, not the
                // source's: it does not pass for a finished copy.
                return Err(StepError::Interrupted);
            }
            let md = match self.dir_meta.remove(&path) {
                Some(m) => Ok(m),
                None => std::fs::symlink_metadata(&path),
            };
            match md {
                Ok(cmd) => self.copy(
                    &path,
                    &cmd,
                    ino,
                    name.as_bytes(),
                    &join(dpath, name.as_bytes()),
                ),
                Err(e) => self.err(format!("{}: {}", path.display(), term::io_reason(&e))),
            }
        }
        if interrupt::requested().is_some() {
            return Err(StepError::Interrupted);
        }
        self.finish(src, md, ino, true);
        Ok(())
    }

    /// Copy what reading host file `src` gives until its end (a pipe, a character
    /// device) into inode `ino`. A signal stops it between chunks.
    fn copy_stream(&mut self, src: &Path, ino: Ino) -> StepResult<()> {
        use std::io::Read;
        let sd = src.display().to_string();
        let mut f = std::fs::File::open(src).map_err(host(&sd))?;
        let mut pos = 0u64;
        loop {
            let r = f.read(&mut self.buf);
            // Checked after the read too: a Ctrl-C also ends the producer of a pipe,
            // whose end must not pass for the end of the data.
            if interrupt::requested().is_some() {
                return Err(StepError::Interrupted);
            }
            let n = match r {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(host(&sd)(e)),
            };
            write_all(self.fs, ino, &self.buf[..n], pos, &sd)?;
            pos += n as u64;
            self.bar.inc(n as u64);
        }
    }

    /// Copy the bytes of host file `src` into inode `ino`, keeping holes. A signal
    /// stops it between chunks (`StepError::Interrupted`).
    fn copy_data(&mut self, src: &Path, size: u64, ino: Ino) -> StepResult<()> {
        let sd = src.display().to_string();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(src)
            .map_err(host(&sd))?;
        use std::os::fd::AsRawFd;
        let fd = f.as_raw_fd();
        let mut off = 0u64;
        let mut zero_skip = false;
        while off < size {
            // The next data run [data, hole), by SEEK_DATA/SEEK_HOLE.
            let (data, hole) = if zero_skip {
                (off, size)
            } else {
                // SAFETY: `fd` is an open descriptor owned by `f` for this whole call.
                let d = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
                if d < 0 {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::ENXIO) => break, // only a hole is left
                        Some(libc::EINVAL) => {
                            zero_skip = true;
                            continue;
                        }
                        _ => return Err(host(&format!("{sd}: SEEK_DATA"))(e)),
                    }
                }
                // SAFETY: as above.
                let h = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
                if h < 0 {
                    let e = std::io::Error::last_os_error();
                    return Err(host(&format!("{sd}: SEEK_HOLE"))(e));
                }
                (d as u64, (h as u64).min(size))
            };
            let mut pos = data;
            while pos < hole {
                if interrupt::requested().is_some() {
                    return Err(StepError::Interrupted);
                }
                let want = ((hole - pos) as usize).min(self.buf.len());
                let n = f.read_at(&mut self.buf[..want], pos).map_err(host(&sd))?;
                if n == 0 {
                    break; // the file shrank while we copied
                }
                let chunk = &self.buf[..n];
                if self.reproducible {
                    write_nonzero_blocks(self.fs, ino, chunk, pos, &sd)?;
                } else {
                    // Without SEEK_DATA, whole zero blocks become holes.
                    let skip = zero_skip && chunk.iter().all(|&b| b == 0);
                    if !skip {
                        write_all(self.fs, ino, chunk, pos, &sd)?;
                    }
                }
                pos += n as u64;
                self.bar.inc(n as u64);
            }
            off = hole.max(off + 1);
        }
        let cur = self.fs.stat_ino(ino).map_err(eng(&sd))?.size;
        if cur != size {
            self.fs
                .truncate_ino(ino, size)
                .map_err(eng(&format!("{sd}: setting the size")))?;
        }
        Ok(())
    }
}

/// Write `data` at `pos` of inode `ino` whole. A write may take less than it was
/// given (the disk filled part way): the next goes on from where it stopped, so that a
/// failure names the first offset that did not fit and nothing is skipped.
fn write_all(fs: &Fs, ino: Ino, data: &[u8], pos: u64, sd: &str) -> StepResult<()> {
    let mut done = 0;
    while done < data.len() {
        let at = pos + done as u64;
        let w = fs
            .write_ino_at(ino, &data[done..], at)
            .map_err(eng(&format!("{sd}: writing at {at}")))?;
        if w == 0 {
            return Err(eng(&format!("{sd}: writing at {at}"))(Error::NoSpace));
        }
        done += w;
    }
    Ok(())
}

/// Write the blocks of `data` (at file offset `pos`) that are not all zeros: a zero
/// block stays a hole, whether the source had a hole or zeros there, so that the image
/// depends on the bytes alone (reproducible mode; mke2fs -d skips zero blocks too).
/// Blocks are the image's, counted from the file's start.
fn write_nonzero_blocks(fs: &Fs, ino: Ino, data: &[u8], pos: u64, sd: &str) -> StepResult<()> {
    let bs = u64::from(fs.block_size());
    let mut at = 0usize;
    let mut run: Option<usize> = None;
    while at < data.len() {
        let abs = pos + at as u64;
        let end = (((abs / bs) + 1) * bs - pos).min(data.len() as u64) as usize;
        let zero = data[at..end].iter().all(|&b| b == 0);
        match (zero, run) {
            (false, None) => run = Some(at),
            (true, Some(start)) => {
                write_all(fs, ino, &data[start..at], pos + start as u64, sd)?;
                run = None;
            }
            _ => {}
        }
        at = end;
    }
    if let Some(start) = run {
        write_all(fs, ino, &data[start..], pos + start as u64, sd)?;
    }
    Ok(())
}

/// `rext4 cp [-r] [-v] SRC... IMAGE:/dest`: copy host files and trees into an image.
pub fn cp_in(
    srcs: &[PathBuf],
    dest: &ImagePath,
    dest_arg: &str,
    opts: CpInOptions,
) -> Result<(), Failure> {
    let image_id = std::fs::metadata(crate::spec::image_file(&dest.image))
        .ok()
        .map(|m| (m.dev(), m.ino()));
    let fs = open_rw(&dest.image).map_err(|e| (1, e))?;
    let r = cp_in_open(&fs, srcs, dest, dest_arg, opts, image_id);
    close(&fs, &dest.image, r)
}

fn cp_in_open(
    fs: &Fs,
    srcs: &[PathBuf],
    dest: &ImagePath,
    dest_arg: &str,
    opts: CpInOptions,
    image_id: Option<HostId>,
) -> Result<(), Failure> {
    let dest_dir = match fs.resolve(&dest.path, true) {
        Ok(ino) => {
            let m = fs
                .stat_ino(ino)
                .map_err(|e| (1, format!("{dest_arg}: {}", reason(&e))))?;
            m.is_dir().then_some(ino)
        }
        Err(Error::NotFound) => None,
        Err(e) => return Err((1, format!("{dest_arg}: {}", reason(&e)))),
    };
    if srcs.len() > 1 && dest_dir.is_none() {
        return Err((1, format!("target '{dest_arg}': Not a directory")));
    }
    // "IMAGE:/x/" names a directory: only a source directory may create it.
    let dest_needs_dir = dest.path.len() > 1 && dest.path.ends_with(b"/");
    let mut dir_meta = HashMap::new();
    let bar = if opts.progress {
        let total: u64 = srcs
            .iter()
            .map(|s| total_bytes(s, !opts.recursive, &mut dir_meta))
            .sum();
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
    let mut c = InCopier {
        fs,
        recursive: opts.recursive,
        root: is_root(),
        caller: caller(),
        links: HashMap::new(),
        image_id,
        errors: 0,
        bar,
        buf: vec![0u8; 1 << 20],
        dir_meta,
        verbose: opts.verbose,
        image_arg: format!("{}:", dest.image.display()),
        owners: opts.owners,
        reproducible: matches!(rext4::repro::source_date_epoch(), Ok(Some(_))),
    };
    for src in srcs {
        if interrupt::requested().is_some() {
            break;
        }
        let sd = src.display();
        // Like cp: command-line symlinks are followed unless copying recursively.
        let md = if let Some(m) = c.dir_meta.remove(src) {
            Ok(m)
        } else if c.recursive {
            std::fs::symlink_metadata(src)
        } else {
            std::fs::metadata(src)
        };
        let md = match md {
            Ok(m) => m,
            Err(e) => {
                c.err(format!("{sd}: {}", term::io_reason(&e)));
                continue;
            }
        };
        if md.is_dir() && !c.recursive {
            c.err(format!("{sd}: Is a directory (use -r)"));
            continue;
        }
        let src_base = base_name(src.as_os_str().as_bytes());
        match (dest_dir, src_base) {
            // SRC/. or / copied into an existing directory: merge its contents.
            (Some(d), None) if md.is_dir() => {
                if let Err(StepError::Failed(e)) = c.copy_dir_contents(src, &md, d, &dest.path) {
                    c.err(e);
                }
            }
            (Some(d), Some(name)) => c.copy(src, &md, d, name, &join(&dest.path, name)),
            (Some(_), None) => c.err(format!("{sd}: has no file name")),
            (None, _) if dest_needs_dir && !md.is_dir() => {
                let what = if md.is_file() { "regular file" } else { "file" };
                c.err(format!(
                    "cannot create {what} '{dest_arg}': Not a directory"
                ));
            }
            (None, _) => match fs.parent_and_name(&dest.path) {
                Ok((p, n)) => c.copy(src, &md, p, n, &dest.path),
                Err(e) => c.err(format!("{dest_arg}: {}", reason(&e))),
            },
        }
    }
    c.bar.finish_and_clear();
    if c.errors > 0 {
        return Err((1, format!("{} error(s) while copying", c.errors)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10").ok(), Some((0, 10)));
        assert_eq!(parse_size("4K").ok(), Some((0, 4096)));
        assert_eq!(parse_size("1m").ok(), Some((0, 1 << 20)));
        assert_eq!(parse_size("2KB").ok(), Some((0, 2000)));
        assert_eq!(parse_size("3GiB").ok(), Some((0, 3 << 30)));
        assert_eq!(parse_size("+1k").ok(), Some((1, 1024)));
        assert_eq!(parse_size("-5").ok(), Some((-1, 5)));
        assert!(parse_size("").is_err());
        assert!(parse_size("1x").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999E").is_err());
    }

    #[test]
    fn names() {
        assert_eq!(base_name(b"/a/b/"), Some(&b"b"[..]));
        assert_eq!(base_name(b"a"), Some(&b"a"[..]));
        assert_eq!(base_name(b"/a/."), None);
        assert_eq!(base_name(b"/"), None);
        assert_eq!(base_name(b".."), None);
    }
}
