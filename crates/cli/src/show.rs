//! `rext4 ls`, `rext4 stat`, `rext4 cat`.

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;

use rext4::{FileType, Fs, Metadata};

use crate::timefmt::{iso, ls_time};

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

pub fn ls(fs: &Fs, path: &[u8], long: bool, out: &mut dyn Write) -> rext4::Result<()> {
    let p = std::path::Path::new(OsStr::from_bytes(path));
    let meta = fs.symlink_metadata(p)?;
    let mut entries: Vec<(Vec<u8>, rext4::Ino)> = if meta.is_dir() {
        fs.read_dir(p)?
            .into_iter()
            .map(|e| (e.name, e.ino))
            .collect()
    } else {
        vec![(path.to_vec(), meta.ino)]
    };
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

pub fn stat(fs: &Fs, path: &[u8], out: &mut dyn Write) -> rext4::Result<()> {
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

pub fn cat(fs: &Fs, path: &[u8], out: &mut dyn Write) -> rext4::Result<()> {
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
    out.flush()?;
    Ok(())
}
