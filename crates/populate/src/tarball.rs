//! Tar archives into an image: ustar, GNU (long names, old-style sparse members) and
//! pax (long names, owners, sub-second times, `SCHILY.xattr.*`, sparse formats 0.1
//! and 1.0), streamed member by member (nothing is extracted to the host).
//!
//! A member's numeric owner is used (as `tar --numeric-owner`), mapped by the
//! population's `Owners`; its mode's permission bits, its mtime (atime from pax
//! `atime`, else the mtime), its xattrs. Hard links point at an earlier member;
//! device numbers come from the header. A later member of the same path replaces the
//! earlier one (a directory merges). As a layer (`Options::layer`), `.wh.NAME`
//! removes NAME of the lower layers and `.wh..wh..opq` empties its directory of them
//! (OCI image spec); a whiteout of a path that does not exist is ignored, as container
//! runtimes do. Without `layer`, such names are ordinary files.
//!
//! Refused members (named in `Report::errors`, the rest still applied): names with
//! `..`, a parent that is not a directory in the image (symlinks are never followed),
//! a hard link to a missing member or a directory, unknown member types. A damaged
//! or truncated archive stops the population with an error.

use std::io::Read;

use rext4::format::inode::mode as imode;
use rext4::{Error, Fs, Ino, Result, SetAttr, Timestamp, XattrFlags};

use crate::place::{clean, join, show, write_nonzero, Comps, Placer};
use crate::{Options, Report, Step};

/// What a pax header said about a member.
#[derive(Default)]
struct Pax {
    mtime: Option<Timestamp>,
    atime: Option<Timestamp>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    sparse_major: Option<u64>,
    sparse_minor: Option<u64>,
    sparse_name: Option<Vec<u8>>,
    sparse_realsize: Option<u64>,
    sparse_map: Option<Vec<u64>>,
}

/// "123.456789" (pax times: seconds, optionally a fraction; may be negative).
fn pax_time(v: &[u8]) -> Option<Timestamp> {
    let s = std::str::from_utf8(v).ok()?;
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let sec: i64 = whole.parse().ok()?;
    let mut nsec: u32 = 0;
    for (i, c) in frac.bytes().take(9).enumerate() {
        if !c.is_ascii_digit() {
            return None;
        }
        nsec += u32::from(c - b'0') * 10u32.pow(8 - i as u32);
    }
    Some(if neg && nsec > 0 {
        Timestamp {
            sec: -sec - 1,
            nsec: 1_000_000_000 - nsec,
        }
    } else {
        Timestamp {
            sec: if neg { -sec } else { sec },
            nsec,
        }
    })
}

fn num(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

fn read_pax<R: Read>(e: &mut tar::Entry<'_, R>) -> Result<Pax> {
    let mut p = Pax::default();
    let Some(exts) = e.pax_extensions()? else {
        return Ok(p);
    };
    for ext in exts {
        let ext = ext?;
        let (k, v) = (ext.key_bytes(), ext.value_bytes());
        match k {
            b"mtime" => p.mtime = pax_time(v),
            b"atime" => p.atime = pax_time(v),
            b"GNU.sparse.major" => p.sparse_major = num(v),
            b"GNU.sparse.minor" => p.sparse_minor = num(v),
            b"GNU.sparse.name" => p.sparse_name = Some(v.to_vec()),
            b"GNU.sparse.realsize" | b"GNU.sparse.size" => p.sparse_realsize = num(v),
            b"GNU.sparse.map" => {
                p.sparse_map = v
                    .split(|&b| b == b',')
                    .map(num)
                    .collect::<Option<Vec<u64>>>()
            }
            _ => {
                if let Some(name) = k.strip_prefix(b"SCHILY.xattr.") {
                    p.xattrs.push((name.to_vec(), v.to_vec()));
                }
            }
        }
    }
    Ok(p)
}

/// Read sparse format 1.0's map from the start of a member's data: decimal numbers,
/// one a line (the count, then offset and size pairs), padded to 512 bytes. Returns
/// the map and the bytes of data consumed.
fn read_sparse_map<R: Read>(r: &mut R) -> Result<(Vec<u64>, u64)> {
    let bad = || Error::InvalidInput("sparse member: malformed map".into());
    let mut consumed = 0u64;
    let mut line = Vec::new();
    let mut next = |r: &mut R, consumed: &mut u64| -> Result<u64> {
        line.clear();
        let mut b = [0u8; 1];
        loop {
            r.read_exact(&mut b)?;
            *consumed += 1;
            if b[0] == b'\n' {
                break;
            }
            if line.len() > 20 {
                return Err(bad());
            }
            line.push(b[0]);
        }
        num(&line).ok_or_else(bad)
    };
    let count = next(r, &mut consumed)?;
    if count > 1 << 20 {
        return Err(bad());
    }
    let mut map = Vec::with_capacity(2 * count as usize);
    for _ in 0..2 * count {
        map.push(next(r, &mut consumed)?);
    }
    let pad = (512 - consumed % 512) % 512;
    std::io::copy(&mut r.take(pad), &mut std::io::sink())?;
    Ok((map, consumed + pad))
}

/// Apply the tar archive `r` (already decompressed) to the directory `dest` of `fs`.
/// `stop` is polled between members and chunks: when it says so, the member in
/// progress is removed and `Report::interrupted` set.
pub(crate) fn apply(
    fs: &Fs,
    dest: Ino,
    r: &mut dyn Read,
    opts: &Options,
    layer: bool,
    stop: &dyn Fn() -> bool,
    report: &mut Report,
) -> Result<()> {
    let mut placer = Placer::new(fs, dest, &opts.owners);
    let mut ar = tar::Archive::new(r);
    let mut buf = vec![0u8; 1 << 20];
    let mut warned_absolute = false;
    let entries = ar
        .entries()
        .map_err(|e| Error::InvalidInput(format!("reading the archive: {e}")))?;
    for entry in entries {
        if stop() {
            report.interrupted = true;
            break;
        }
        let mut e = entry.map_err(|e| Error::InvalidInput(format!("reading the archive: {e}")))?;
        let kind = e.header().entry_type();
        if kind.is_pax_global_extensions() {
            continue;
        }
        let pax = read_pax(&mut e)?;
        let raw_name = match &pax.sparse_name {
            Some(n) => n.clone(),
            None => e.path_bytes().into_owned(),
        };
        let (comps, absolute) = match clean(&raw_name) {
            Ok(c) => c,
            Err(msg) => {
                report.errors.push(msg);
                continue;
            }
        };
        if absolute && !warned_absolute {
            warned_absolute = true;
            report
                .warnings
                .push("removing leading '/' from member names".into());
        }
        if layer {
            match whiteout(&mut placer, &comps) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(err) => {
                    report.errors.push(format!("{}: {err}", show(&raw_name)));
                    continue;
                }
            }
        }
        match member(&mut placer, &mut e, &comps, &pax, &mut buf, stop, report) {
            Ok(()) => report.entries += 1,
            Err(Step::Stop) => {
                report.interrupted = true;
                break;
            }
            Err(Step::Fail(err)) => match err {
                // The archive itself is unreadable: nothing after this can be trusted.
                Error::Io(err) => {
                    return Err(Error::InvalidInput(format!(
                        "{}: reading the archive: {err}",
                        show(&raw_name)
                    )))
                }
                err @ (Error::NoSpace | Error::ShutDown(_)) => return Err(err),
                err => report.errors.push(format!("{}: {err}", show(&raw_name))),
            },
        }
    }
    placer.finish_dirs()
}

/// A layer's whiteout: `Ok(true)` when `comps` named one (and it was applied).
fn whiteout(p: &mut Placer<'_>, comps: &Comps) -> Result<bool> {
    let Some((name, up)) = comps.split_last() else {
        return Ok(false);
    };
    let Some(target) = name.strip_prefix(b".wh.") else {
        return Ok(false);
    };
    let Some(dir) = p.dir(up, true)? else {
        return Ok(true);
    };
    if target == b".wh..opq" {
        // Opaque: what lower layers put in the directory goes; this layer's stays.
        let mut gone = Vec::new();
        for de in p.fs.read_dir_ino(dir)? {
            if de.name == b"." || de.name == b".." {
                continue;
            }
            let mut c = up.to_vec();
            c.push(de.name.clone());
            if !p.made.contains(&join(&c)) {
                gone.push(de.name);
            }
        }
        for n in gone {
            p.remove(dir, &n)?;
        }
        return Ok(true);
    }
    if target.is_empty() || target == b"." || target == b".." {
        return Err(Error::InvalidInput("whiteout of no name".into()));
    }
    let mut c = up.to_vec();
    c.push(target.to_vec());
    let path = join(&c);
    if !p.made.contains(&path) {
        // A whiteout of a path that does not exist is ignored.
        p.remove(dir, target)?;
    }
    Ok(true)
}

fn member<R: Read>(
    p: &mut Placer<'_>,
    e: &mut tar::Entry<'_, R>,
    comps: &Comps,
    pax: &Pax,
    buf: &mut [u8],
    stop: &dyn Fn() -> bool,
    report: &mut Report,
) -> std::result::Result<(), Step> {
    let h = e.header();
    let kind = h.entry_type();
    let bad = |what: &str| Error::InvalidInput(format!("malformed header: {what}"));
    let perm = h.mode().map_err(|_| bad("mode"))? & 0o7777;
    let owner = (
        h.uid().map_err(|_| bad("uid"))?.min(u64::from(u32::MAX)) as u32,
        h.gid().map_err(|_| bad("gid"))?.min(u64::from(u32::MAX)) as u32,
    );
    let mtime = pax.mtime.unwrap_or(Timestamp {
        sec: h.mtime().map_err(|_| bad("mtime"))?.min(i64::MAX as u64) as i64,
        nsec: 0,
    });
    let atime = pax.atime.unwrap_or(mtime);
    use tar::EntryType as T;
    let ino = match kind {
        T::Directory => {
            let ino = p.mkdir(comps, perm, owner, (atime, mtime))?;
            set_xattrs(p.fs, ino, &pax.xattrs)?;
            return Ok(());
        }
        T::Regular | T::Continuous | T::GNUSparse => {
            let ino = p.node(comps, owner, |fs, parent, name, u, g| {
                fs.mknod_ino(parent, name, u32::from(imode::S_IFREG) | perm, u, g, (0, 0))
            })?;
            let r = file_data(p.fs, ino, e, pax, buf, stop);
            if let Err(err) = r {
                // The unfinished file does not stay.
                if let Some((name, up)) = comps.split_last() {
                    if let Ok(Some(dir)) = p.dir(up, false) {
                        let _ = p.remove(dir, name);
                    }
                }
                return Err(err);
            }
            report.bytes += e.size();
            ino
        }
        T::Symlink => {
            let target = e
                .link_name_bytes()
                .ok_or_else(|| bad("symlink without a target"))?
                .into_owned();
            if target.is_empty() {
                return Err(bad("empty symlink target").into());
            }
            p.node(comps, owner, |fs, parent, name, u, g| {
                fs.symlink_ino(parent, name, &target, u, g)
            })?
        }
        T::Link => {
            let target = e
                .link_name_bytes()
                .ok_or_else(|| bad("hard link without a target"))?
                .into_owned();
            let (tc, _) = clean(&target).map_err(Error::InvalidInput)?;
            let Some(ino) = p.find(&tc)? else {
                return Err(Error::InvalidInput(format!(
                    "hard link to '{}', which is not in the image",
                    show(&target)
                ))
                .into());
            };
            if p.fs.stat_ino(ino)?.is_dir() {
                return Err(Error::InvalidInput(format!(
                    "hard link to directory '{}'",
                    show(&target)
                ))
                .into());
            }
            if tc == *comps {
                return Ok(());
            }
            p.node(comps, owner, |fs, parent, name, _, _| {
                fs.link_ino(ino, parent, name).map(|()| ino)
            })?;
            // A link shares the target's inode: its attributes are the target's.
            return Ok(());
        }
        T::Char | T::Block | T::Fifo => {
            let t = match kind {
                T::Char => imode::S_IFCHR,
                T::Block => imode::S_IFBLK,
                _ => imode::S_IFIFO,
            };
            let dev = if t == imode::S_IFIFO {
                (0, 0)
            } else {
                (
                    h.device_major()
                        .map_err(|_| bad("device major"))?
                        .unwrap_or(0),
                    h.device_minor()
                        .map_err(|_| bad("device minor"))?
                        .unwrap_or(0),
                )
            };
            p.node(comps, owner, |fs, parent, name, u, g| {
                fs.mknod_ino(parent, name, u32::from(t) | perm, u, g, dev)
            })?
        }
        other => {
            return Err(Error::Unsupported(format!(
                "member type {:?} is not placed",
                other.as_byte() as char
            ))
            .into())
        }
    };
    set_xattrs(p.fs, ino, &pax.xattrs)?;
    p.fs.setattr_ino(
        ino,
        &SetAttr {
            atime: Some(atime),
            mtime: Some(mtime),
            ..SetAttr::default()
        },
    )?;
    Ok(())
}

fn set_xattrs(fs: &Fs, ino: Ino, xattrs: &[(Vec<u8>, Vec<u8>)]) -> Result<()> {
    let mut sorted: Vec<&(Vec<u8>, Vec<u8>)> = xattrs.iter().collect();
    sorted.sort();
    for (n, v) in sorted {
        fs.set_xattr_ino(ino, n, v, XattrFlags::default())?;
    }
    Ok(())
}

/// A regular member's bytes into `ino` (zero blocks left as holes), and its size.
fn file_data<R: Read>(
    fs: &Fs,
    ino: Ino,
    e: &mut tar::Entry<'_, R>,
    pax: &Pax,
    buf: &mut [u8],
    stop: &dyn Fn() -> bool,
) -> std::result::Result<(), Step> {
    // Pax sparse members: the data holds only the map's segments.
    let sparse = match (pax.sparse_major, pax.sparse_minor, &pax.sparse_map) {
        (Some(1), Some(0), _) => Some(read_sparse_map(e)?.0),
        (_, _, Some(map)) => Some(map.clone()),
        _ => None,
    };
    let size = match &sparse {
        Some(_) => pax
            .sparse_realsize
            .ok_or_else(|| Error::InvalidInput("sparse member without its size".into()))?,
        None => e.size(),
    };
    match sparse {
        None => copy_run(fs, ino, e, 0, u64::MAX, buf, stop)?,
        Some(map) => {
            if map.len() % 2 != 0 {
                return Err(Error::InvalidInput("sparse member: odd map".into()).into());
            }
            for seg in map.chunks_exact(2) {
                let (off, len) = (seg[0], seg[1]);
                if off.checked_add(len).is_none_or(|end| end > size) {
                    return Err(Error::InvalidInput(
                        "sparse member: a segment lies past its size".into(),
                    )
                    .into());
                }
                copy_run(fs, ino, e, off, len, buf, stop)?;
            }
        }
    }
    if fs.stat_ino(ino)?.size != size {
        fs.truncate_ino(ino, size)?;
    }
    Ok(())
}

/// Copy up to `len` bytes of `r` to `ino` from offset `at` (`u64::MAX`: to the end).
fn copy_run(
    fs: &Fs,
    ino: Ino,
    r: &mut dyn Read,
    mut at: u64,
    len: u64,
    buf: &mut [u8],
    stop: &dyn Fn() -> bool,
) -> std::result::Result<(), Step> {
    let mut left = len;
    while left > 0 {
        if stop() {
            return Err(Step::Stop);
        }
        let want = (buf.len() as u64).min(left) as usize;
        let n = match r.read(&mut buf[..want]) {
            Ok(0) if len == u64::MAX => return Ok(()),
            Ok(0) => {
                return Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "archive ends inside a member",
                ))
                .into())
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::Io(e).into()),
        };
        write_nonzero(fs, ino, &buf[..n], at)?;
        at += n as u64;
        if len != u64::MAX {
            left -= n as u64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_times_parse() {
        let t = |s: &str| pax_time(s.as_bytes()).map(|t| (t.sec, t.nsec));
        assert_eq!(t("1700000000"), Some((1_700_000_000, 0)));
        assert_eq!(t("12.5"), Some((12, 500_000_000)));
        assert_eq!(t("12.000000001"), Some((12, 1)));
        assert_eq!(t("-1.5"), Some((-2, 500_000_000)));
        assert_eq!(t("x"), None);
        assert_eq!(t("1.2x"), None);
    }
}
