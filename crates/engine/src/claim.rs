//! Claiming an image before it is opened: rext4 writes an image only while nothing
//! else uses it, as e2fsprogs refuses a mounted filesystem.
//!
//! Owns: [`Claim`], taken by `Fs::open_with` (and `mkfs::mkfs_file`) before the first
//! byte is read, and released by `Fs::close` (or when the last handle goes).
//!
//! A claim for writing is refused ([`Error::InUse`], naming who holds the image) when
//! - a loop device is backed by the image file: compared by device and inode number
//!   of the backing file (`/sys/block/loopN/loop/backing_file`, stat'ed), not by path
//!   text, so another path to the same file, a rename or a loop device with an offset
//!   are caught too; the loop device's mount points are named;
//! - the image is a block device that is mounted or open exclusively elsewhere: it is
//!   opened with O_EXCL, which the kernel refuses with EBUSY then (and which keeps the
//!   kernel from mounting it while rext4 writes);
//! - another process holds a `flock` on it: every rext4 user takes one (exclusive for
//!   writing, shared for reading), so the mount, the CLI commands and API users keep
//!   out of each other's way. The holder's pid and command come from /proc/locks.
//!
//! A claim for reading never fails on these grounds: it notes that a writer may be
//! changing the image ([`Claim::read`]) and takes no lock, so readers (`rext4 ls`, an
//! API user) never keep a writer out. A caller that caches what it reads for long (the
//! read-only mount) holds a shared flock instead, keeping rext4 writers out while it
//! is open, and refuses an image someone writes.
//!
//! The checks see this mount namespace's mounts and this machine's loop devices; an
//! image shared over a network with another machine is not detected here: ext4's
//! multi-mount protection is made for that (`crate::mmp`, on images made with it).

use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// An image claimed for reading or writing; the claim lasts while this value lives.
#[derive(Debug)]
pub struct Claim {
    /// The descriptor that holds the flock (for a block device opened for writing,
    /// also the O_EXCL claim); `None` for a read claim that could not lock.
    _file: Option<File>,
}

/// Another user of an image, as found on this machine.
struct User {
    /// Says who, e.g. "loop device /dev/loop3 is mounted at /mnt".
    who: String,
    /// Whether it may write to the image (a read-only loop device or a shared flock
    /// holder does not).
    writes: bool,
}

impl Claim {
    /// Claim `path` for writing: refused with [`Error::InUse`] while anyone else uses
    /// it (see the module note).
    pub fn write(path: &Path) -> Result<Claim> {
        let meta = std::fs::metadata(path)?;
        if meta.file_type().is_block_device() {
            let file = match open_excl(path) {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(EBUSY) => {
                    let who = block_device_users(path, &meta)
                        .into_iter()
                        .map(|u| u.who)
                        .collect::<Vec<_>>();
                    let who = if who.is_empty() {
                        "it is open exclusively by another program".to_string()
                    } else {
                        who.join("; ")
                    };
                    return Err(in_use_for_writing(&who));
                }
                Err(e) => return Err(e.into()),
            };
            lock(&file, path, &meta, true, true)?;
            return Ok(Claim { _file: Some(file) });
        }
        if let Some(u) = loop_users(&meta).into_iter().next() {
            return Err(in_use_for_writing(&u.who));
        }
        let file = File::open(path)?;
        lock(&file, path, &meta, true, true)?;
        Ok(Claim { _file: Some(file) })
    }

    /// Claim `path` for reading. Returns a note (for the user) when another user may
    /// be writing the image: what is read may then change or look inconsistent. With
    /// `hold`, the claim keeps rext4 writers out while it lives (a shared flock, when
    /// no writer has the image); without, it changes nothing for others.
    pub fn read(path: &Path, hold: bool) -> Result<(Claim, Option<String>)> {
        let meta = std::fs::metadata(path)?;
        let mut users = if meta.file_type().is_block_device() {
            block_device_users(path, &meta)
        } else {
            loop_users(&meta)
        };
        let rext4_writer = |users: &mut Vec<User>| {
            users.extend(flock_holders(&meta, true).into_iter().map(|who| User {
                who: format!("rext4 process {who}"),
                writes: true,
            }));
        };
        let claim = if hold {
            let file = File::open(path)?;
            match lock(&file, path, &meta, false, true) {
                Ok(()) => Claim { _file: Some(file) },
                Err(Error::InUse(_)) => {
                    rext4_writer(&mut users);
                    Claim { _file: None }
                }
                Err(e) => return Err(e),
            }
        } else {
            // Who writes is read from /proc/locks: no lock is taken, not even for a
            // moment, so no writer starting now is refused on this reader's account.
            rext4_writer(&mut users);
            Claim { _file: None }
        };
        let writers: Vec<String> = users
            .into_iter()
            .filter(|u| u.writes)
            .map(|u| u.who)
            .collect();
        let note = (!writers.is_empty()).then(|| {
            format!(
                "image is in use by a writer ({}): what is read may change or look \
                 inconsistent",
                writers.join("; ")
            )
        });
        Ok((claim, note))
    }
}

/// Take a non-blocking flock on `path`: exclusive for read-write, shared for reading.
/// This is the lock every rext4 user of an image holds (see [`Claim`]); it lasts while
/// the returned claim lives. Refused at once with [`Error::InUse`], naming the
/// holders (a probe: the claims retry a moment first).
pub fn lock_path(path: &Path, exclusive: bool) -> Result<Claim> {
    let meta = std::fs::metadata(path)?;
    let file = File::open(path)?;
    lock(&file, path, &meta, exclusive, false)?;
    Ok(Claim { _file: Some(file) })
}

const EBUSY: i32 = 16;
const O_EXCL: i32 = 0o200;

fn in_use_for_writing(who: &str) -> Error {
    Error::InUse(format!(
        "image is in use: {who}; rext4 will not write to it (read-only access works)"
    ))
}

/// How long a refusal is retried before it is believed: a descriptor closed a moment
/// ago may live on in a child forked meanwhile by another thread (until its exec
/// closes it), keeping a flock or an O_EXCL claim that is already given up.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(500);

/// Retry `f` while it fails with `busy` errors, for at most [`SETTLE`].
fn settled<T>(mut f: impl FnMut() -> std::io::Result<T>, busy: i32) -> std::io::Result<T> {
    let t0 = std::time::Instant::now();
    loop {
        match f() {
            Err(e) if e.raw_os_error() == Some(busy) && t0.elapsed() < SETTLE => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

fn open_excl(path: &Path) -> std::io::Result<File> {
    settled(
        || {
            OpenOptions::new()
                .read(true)
                .custom_flags(O_EXCL)
                .open(path)
        },
        EBUSY,
    )
}

/// flock `file` (at `path`, described by `meta`); with `settle`, a refusal is retried
/// for [`SETTLE`] first.
fn lock(file: &File, path: &Path, meta: &Metadata, exclusive: bool, settle: bool) -> Result<()> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    let try_lock = || {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let r = if settle {
        settled(try_lock, libc::EWOULDBLOCK)
    } else {
        try_lock()
    };
    let Err(e) = r else { return Ok(()) };
    if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(Error::Io(std::io::Error::new(
            e.kind(),
            format!("cannot lock {}: {e}", path.display()),
        )));
    }
    // A shared request is refused only by a writer; an exclusive one by anyone.
    let holders = flock_holders(meta, !exclusive);
    let who = if holders.is_empty() {
        String::new()
    } else {
        format!(": {}", holders.join(", "))
    };
    let does = if exclusive {
        "has it open"
    } else {
        "has it open for writing"
    };
    Err(Error::InUse(format!(
        "image is in use: another rext4 process {does}{who}"
    )))
}

/// Split a `dev_t` as the kernel encodes it for user space.
fn major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// "pid N (command line)" of the processes holding a flock on the file `meta` is
/// from /proc/locks (writers only when `writers_only`).
fn flock_holders(meta: &Metadata, writers_only: bool) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    let (ma, mi) = major_minor(meta.dev());
    let want = format!("{ma:02x}:{mi:02x}:{}", meta.ino());
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5358448 0 EOF"; waiters have "->".
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != "FLOCK" || f[5] != want {
            continue;
        }
        if writers_only && f[3] != "WRITE" {
            continue;
        }
        let pid = f[4];
        let who = match command_of(pid) {
            Some(c) => format!("pid {pid}, {c}"),
            None => format!("pid {pid}"),
        };
        if !out.contains(&who) {
            out.push(who);
        }
    }
    out
}

/// A process's command line, shortened, in backquotes.
fn command_of(pid: &str) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    if words.is_empty() {
        return None;
    }
    let mut s = words.join(" ");
    if s.chars().count() > 100 {
        s = s.chars().take(97).collect::<String>() + "...";
    }
    Some(format!("`{s}`"))
}

/// The loop devices whose backing file is the file `meta` describes.
fn loop_users(meta: &Metadata) -> Vec<User> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut found: Vec<(u32, User)> = Vec::new();
    for ent in dir.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        let Some(n) = name
            .strip_prefix("loop")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let sys = ent.path();
        // Present only while the device is bound to a file.
        let Ok(backing) = std::fs::read_to_string(sys.join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.trim_end_matches('\n');
        let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
        let Ok(b) = std::fs::metadata(backing) else {
            continue;
        };
        if b.dev() != meta.dev() || b.ino() != meta.ino() {
            continue;
        }
        let read_only = read_trimmed(&sys.join("ro")).is_some_and(|s| s == "1");
        let offset = read_trimmed(&sys.join("loop/offset"))
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        let mounts = read_trimmed(&sys.join("dev"))
            .map(|d| mount_points(&d))
            .unwrap_or_default();
        let mut who = format!("loop device /dev/{name}");
        if offset > 0 {
            who.push_str(&format!(" (offset {offset})"));
        }
        if mounts.is_empty() {
            who.push_str(&format!(
                " is set up on it (losetup -d /dev/{name} frees it)"
            ));
        } else {
            who.push_str(&format!(" is mounted at {}", mounts.join(", ")));
        }
        found.push((
            n,
            User {
                who,
                writes: !read_only,
            },
        ));
    }
    found.sort_by_key(|(n, _)| *n);
    found.into_iter().map(|(_, u)| u).collect()
}

/// Who uses the block device at `path`: its mount points, the devices stacked on it
/// (device mapper, md, ...), rext4 processes holding it.
fn block_device_users(path: &Path, meta: &Metadata) -> Vec<User> {
    let (ma, mi) = major_minor(meta.rdev());
    let sys = PathBuf::from(format!("/sys/dev/block/{ma}:{mi}"));
    let read_only = read_trimmed(&sys.join("ro")).is_some_and(|s| s == "1");
    let mut users = Vec::new();
    let mounts = mount_points(&format!("{ma}:{mi}"));
    if !mounts.is_empty() {
        users.push(User {
            who: format!("{} is mounted at {}", path.display(), mounts.join(", ")),
            writes: !read_only,
        });
    }
    if let Ok(dir) = std::fs::read_dir(sys.join("holders")) {
        let names: Vec<String> = dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if !names.is_empty() {
            users.push(User {
                who: format!("{} is held by {}", path.display(), names.join(", ")),
                writes: !read_only,
            });
        }
    }
    for h in flock_holders(meta, false) {
        users.push(User {
            who: format!("rext4 process {h}"),
            writes: false,
        });
    }
    users
}

/// The mount points of the device numbered `maj_min` ("7:3") in this namespace.
fn mount_points(maj_min: &str) -> Vec<String> {
    let Ok(info) = std::fs::read("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in info.split(|&b| b == b'\n') {
        let f: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
        if f.len() > 4 && f[2] == maj_min.as_bytes() {
            out.push(String::from_utf8_lossy(&unescape_mountinfo(f[4])).into_owned());
        }
    }
    out
}

fn read_trimmed(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Undo mountinfo's octal escapes (\040 for a space, ...).
pub fn unescape_mountinfo(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|d| {
            d.iter()
                .all(|c| (b'0'..=b'7').contains(c))
                .then(|| d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0')))
        });
        if let (b'\\', Some(v @ 0..=255)) = (b[i], octal) {
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_numbers_split_as_the_kernel_encodes_them() {
        // makedev(7, 3), makedev(259, 1), makedev(8, 300)
        assert_eq!(major_minor(0x703), (7, 3));
        assert_eq!(major_minor((259 << 8) | 1), (259, 1));
        assert_eq!(
            major_minor((8 << 8) | (300 & 0xff) | ((300 & !0xff) << 12)),
            (8, 300)
        );
    }

    #[test]
    fn locks_exclude_as_readers_and_writers() {
        let p = std::env::temp_dir().join(format!("rext4-claim-{}", std::process::id()));
        std::fs::write(&p, b"x").expect("write");
        let w = lock_path(&p, true).expect("first writer");
        let e = lock_path(&p, true).expect_err("second writer");
        let msg = e.to_string();
        assert!(msg.contains("in use"), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "holder named: {msg}"
        );
        assert!(lock_path(&p, false).is_err(), "reader while a writer");
        // A read claim goes on, noting the writer.
        for hold in [false, true] {
            let (_r, note) = Claim::read(&p, hold).expect("read claim");
            let note = note.expect("a note about the writer");
            assert!(note.contains("in use by a writer"), "{note}");
        }
        drop(w);
        // A flock goes with the open file description, which a child that another
        // test thread of this process is forking holds until its exec closes it
        // (O_CLOEXEC): a lock given up here may outlive the drop by that moment.
        let released = |hold: bool| {
            let t0 = std::time::Instant::now();
            loop {
                let (r, note) = Claim::read(&p, hold).expect("read claim");
                if note.is_none() || t0.elapsed() > std::time::Duration::from_secs(10) {
                    return (r, note);
                }
                drop(r);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        // A plain reader keeps no writer out; a holding one does.
        let (r, note) = released(false);
        assert!(note.is_none(), "{note:?}");
        let w = Claim::write(&p).expect("writer beside a plain reader");
        drop((r, w));
        let (_r1, note) = released(true);
        assert!(note.is_none(), "{note:?}");
        let _r2 = lock_path(&p, false).expect("second reader");
        let e = Claim::write(&p).expect_err("writer while holding readers");
        assert!(e.to_string().contains("in use"), "{e}");
        let _ = std::fs::remove_file(&p);
    }
}
