//! Device tables (genext2fs / makedevs / Buildroot format): devices, directories and
//! files with modes and owners, made without root.
//!
//! Each line: `NAME TYPE MODE UID GID MAJOR MINOR START INC COUNT` (`-` for an unused
//! field, `#` starts a comment). TYPE is `d` (a directory: made with its parents, or an
//! existing one's mode and owner changed), `f` (a regular file: an existing one's mode
//! and owner changed, else an empty one made), `c`/`b` (character/block device), `p`
//! (fifo). With COUNT > 0 a `c`/`b` line makes COUNT nodes NAME{START..}, minor
//! MINOR + i*INC (as makedevs: `/dev/tty 0 ... 0 1 4` gives tty0..tty3). MODE is octal
//! permission bits; UID and GID are the image's (no map applies). A node replaces what
//! the tree had at its path.
//!
//! Must hold: names are image paths placed as archive members are (no `..`, no symlink
//! followed); a path named twice by the table is an error naming both lines, before
//! anything is made; malformed lines are errors naming the line.

use std::collections::HashMap;

use rext4::format::inode::mode as imode;
use rext4::{Error, Fs, Ino, Result, SetAttr};

use crate::ids::Owners;
use crate::place::{clean, join, show, Comps, Placer};

/// One node the table asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: Vec<u8>,
    pub kind: u8,
    pub perm: u32,
    pub owner: (u32, u32),
    pub rdev: (u32, u32),
    /// Line number (from 1).
    pub line: usize,
}

/// Parse a table; every path once.
pub fn parse(text: &str) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.split('#').next().unwrap_or("").trim();
        if l.is_empty() {
            continue;
        }
        let bad =
            |why: &str| Error::InvalidInput(format!("device table line {line}: {why}: {raw}"));
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() != 10 && f.len() != 7 {
            return Err(bad(
                "expected NAME TYPE MODE UID GID MAJOR MINOR [START INC COUNT]",
            ));
        }
        let n = |s: &str, what: &str| -> Result<u32> {
            if s == "-" {
                return Ok(0);
            }
            s.parse::<u32>().map_err(|_| bad(what))
        };
        let kind = match f[1] {
            "d" | "f" | "c" | "b" | "p" => f[1].as_bytes()[0],
            _ => return Err(bad("TYPE is not one of d f c b p")),
        };
        let perm = u32::from_str_radix(f[2], 8).map_err(|_| bad("MODE is not octal"))?;
        if perm > 0o7777 {
            return Err(bad("MODE has more than permission bits"));
        }
        let owner = (n(f[3], "UID")?, n(f[4], "GID")?);
        let (major, minor) = (n(f[5], "MAJOR")?, n(f[6], "MINOR")?);
        let (start, inc, count) = if f.len() == 10 {
            (n(f[7], "START")?, n(f[8], "INC")?, n(f[9], "COUNT")?)
        } else {
            (0, 0, 0)
        };
        let (comps, _) = clean(f[0].as_bytes()).map_err(|m| bad(&m))?;
        if comps.is_empty() {
            return Err(bad("NAME is the root"));
        }
        let base = join(&comps);
        let mut add = |path: Vec<u8>, minor: u32| -> Result<()> {
            if let Some(first) = seen.insert(path.clone(), line) {
                return Err(Error::InvalidInput(format!(
                    "device table: /{} is named twice (lines {first} and {line})",
                    show(&path)
                )));
            }
            out.push(Entry {
                path,
                kind,
                perm,
                owner,
                rdev: (major, minor),
                line,
            });
            Ok(())
        };
        if count > 0 && matches!(kind, b'c' | b'b') {
            if count > 65536 {
                return Err(bad("COUNT is too large"));
            }
            for k in 0..count {
                let mut p = base.clone();
                p.extend_from_slice(start.saturating_add(k).to_string().as_bytes());
                let m = minor
                    .checked_add(k.checked_mul(inc).ok_or_else(|| bad("minor overflows"))?)
                    .ok_or_else(|| bad("minor overflows"))?;
                add(p, m)?;
            }
        } else {
            add(base, minor)?;
        }
    }
    Ok(out)
}

/// Make what the table says under directory `root` of `fs`.
pub fn apply(fs: &Fs, root: Ino, entries: &[Entry]) -> Result<usize> {
    let owners = Owners::default();
    let mut p = Placer::new(fs, root, &owners);
    for e in entries {
        let comps: Comps = e.path.split(|&b| b == b'/').map(<[u8]>::to_vec).collect();
        let at = |err: Error| {
            Error::InvalidInput(format!(
                "device table line {}: /{}: {err}",
                e.line,
                show(&e.path)
            ))
        };
        let attrs = SetAttr {
            mode: Some(e.perm),
            uid: Some(e.owner.0),
            gid: Some(e.owner.1),
            ..SetAttr::default()
        };
        match e.kind {
            b'd' => {
                let ino = p
                    .dir(&comps, true)
                    .map_err(at)?
                    .ok_or(Error::NotFound)
                    .map_err(at)?;
                fs.setattr_ino(ino, &attrs).map_err(at)?;
            }
            b'f' => {
                let existing = p.find(&comps).map_err(at)?;
                match existing {
                    Some(ino) if fs.stat_ino(ino).map_err(at)?.is_file() => {
                        fs.setattr_ino(ino, &attrs).map_err(at)?;
                    }
                    _ => {
                        p.node(&comps, e.owner, |fs, parent, name, u, g| {
                            fs.mknod_ino(
                                parent,
                                name,
                                u32::from(imode::S_IFREG) | e.perm,
                                u,
                                g,
                                (0, 0),
                            )
                        })
                        .map_err(at)?;
                    }
                }
            }
            k => {
                let t = match k {
                    b'c' => imode::S_IFCHR,
                    b'b' => imode::S_IFBLK,
                    _ => imode::S_IFIFO,
                };
                let rdev = if k == b'p' { (0, 0) } else { e.rdev };
                p.node(&comps, e.owner, |fs, parent, name, u, g| {
                    fs.mknod_ino(parent, name, u32::from(t) | e.perm, u, g, rdev)
                })
                .map_err(at)?;
            }
        }
    }
    Ok(entries.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_parse_as_makedevs_reads_them() {
        let t = "# comment\n/dev d 755 0 0 - - - - -\n/dev/console c 600 0 5 5 1 - - -\n\
                 /dev/tty c 666 0 0 4 0 0 1 3\n/dev/loop b 640 0 6 7 0 0 2 2\n";
        let e = parse(t).expect("parse");
        let names: Vec<String> = e.iter().map(|e| show(&e.path)).collect();
        assert_eq!(
            names,
            [
                "dev",
                "dev/console",
                "dev/tty0",
                "dev/tty1",
                "dev/tty2",
                "dev/loop0",
                "dev/loop1"
            ]
        );
        assert_eq!(e[1].rdev, (5, 1));
        assert_eq!(e[1].owner, (0, 5));
        assert_eq!(e[4].rdev, (4, 2));
        assert_eq!(e[6].rdev, (7, 2));
        assert_eq!(e[0].perm, 0o755);
    }

    #[test]
    fn bad_tables_are_refused() {
        for bad in [
            "/x q 755 0 0 - - - - -",
            "/x c 999 0 0 1 1 - - -",
            "/x c 755 a 0 1 1 - - -",
            "/x c 755 0 0",
            "/../x c 755 0 0 1 1 - - -",
            "/ d 755 0 0 - - - - -",
            "/x c 600 0 0 1 1 - - -\n/x b 600 0 0 1 1 - - -",
            "/t c 600 0 0 1 0 0 1 2\n/t1 c 600 0 0 1 1 - - -",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let twice = parse("/x c 600 0 0 1 1 - - -\n\n/x p 600 0 0 - - - - -");
        assert!(matches!(twice, Err(Error::InvalidInput(m)) if m.contains("lines 1 and 3")));
    }
}
