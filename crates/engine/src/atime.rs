//! Access times: when a read moves an inode's atime (the mount's atime options).
//!
//! Owns: [`AtimePolicy`] (set once per open filesystem, [`crate::FsOptions::atime`])
//! and [`Fs::touch_atime_ino`], which frontends call after a read, a directory listing
//! or a symlink read (the path API does: [`crate::File::read_at`], `Fs::read_dir`,
//! `Fs::read_link`). The rules are the kernel's (`atime_needs_update` and
//! `relatime_need_update` in fs/inode.c): never on a read-only filesystem, never for an
//! inode with the noatime flag (chattr +A), never for a directory under `nodiratime`;
//! under `relatime` only when the atime is not newer than the mtime or the ctime, or is
//! a day old; and never to the value it already has.
//!
//! Must hold: an atime update is an ordinary inode change (write lock, `write_inode`,
//! committed with the running transaction): no commit of its own. The check before it
//! reads the inode without a lock, so a read that needs no update (the common case
//! under relatime) costs a cached inode read and a comparison.

use rext4_format::inode::{flags, Inode, Timestamp};

use crate::error::Result;
use crate::fs::{Fs, Ino};

/// When reads update atime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AtimeMode {
    /// Never (`noatime`): the engine's default, so an embedder reading an image
    /// changes nothing in it unless it asks for atimes.
    #[default]
    Never,
    /// `relatime` (the mount's default, as ext4's): when the atime is not newer than
    /// the mtime or the ctime, or is at least a day old.
    Relative,
    /// `strictatime`: on every access.
    Always,
}

/// The atime options of a filesystem (mount(8)'s atime, noatime, relatime,
/// strictatime and nodiratime).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AtimePolicy {
    pub mode: AtimeMode,
    /// Never for directories (`nodiratime`).
    pub nodiratime: bool,
}

/// relatime's "a day old" (the kernel's 24*60*60).
const DAY_SECS: i64 = 24 * 60 * 60;

impl AtimePolicy {
    /// `relatime`, the mount's default.
    pub const RELATIME: AtimePolicy = AtimePolicy {
        mode: AtimeMode::Relative,
        nodiratime: false,
    };

    /// Whether an access at `now` moves the atime of `inode`.
    pub fn needs_update(&self, inode: &Inode, now: Timestamp) -> bool {
        if inode.flags & flags::NOATIME != 0 || (self.nodiratime && inode.is_dir()) {
            return false;
        }
        let due = match self.mode {
            AtimeMode::Never => false,
            AtimeMode::Always => true,
            AtimeMode::Relative => {
                inode.mtime >= inode.atime
                    || inode.ctime >= inode.atime
                    || now.sec - inode.atime.sec >= DAY_SECS
            }
        };
        due && inode.atime != now
    }
}

impl Fs {
    /// `ino` was read (file data, a directory listing, a symlink's target): move its
    /// atime to now if the filesystem's [`AtimePolicy`] asks for it. Returns whether
    /// the atime changed. Nothing happens on a read-only or shut-down filesystem or
    /// for an inode that is gone.
    pub fn touch_atime_ino(&self, ino: Ino) -> Result<bool> {
        let policy = self.inner.atime;
        if policy.mode == AtimeMode::Never || self.inner.read_only {
            return Ok(false);
        }
        let now = self.atime_now();
        let i = self.read_inode(ino)?;
        if i.mode == 0 || !policy.needs_update(&i, now) {
            return Ok(false);
        }
        let _w = self.write_lock();
        if self.check_writable().is_err() {
            return Ok(false);
        }
        // Again under the lock: another reader may have moved it meanwhile.
        let mut i = self.read_inode(ino)?;
        if i.mode == 0 || !policy.needs_update(&i, now) {
            return Ok(false);
        }
        i.atime = now;
        self.write_inode(ino, &i)?;
        Ok(true)
    }

    /// [`Fs::touch_atime_ino`] for the path API's reads. A failed atime update does
    /// not fail the read that caused it (the kernel's touch_atime ignores it too); an
    /// I/O error behind it shows at the next change or commit.
    pub(crate) fn accessed(&self, ino: Ino) {
        if self.inner.atime.mode != AtimeMode::Never {
            let _ = self.touch_atime_ino(ino);
        }
    }

    /// Now as an atime can hold it: whole seconds where inodes are 128 bytes (no
    /// room for nanoseconds; the kernel's s_time_gran), so an atime just set compares
    /// equal to the next access in the same second instead of being rewritten.
    fn atime_now(&self) -> Timestamp {
        let t = self.now();
        if self.inner.sb.inode_size > 128 {
            t
        } else {
            Timestamp {
                sec: t.sec,
                nsec: 0,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode(atime: i64, mtime: i64, ctime: i64) -> Inode {
        let mut i = Inode::decode(&[0u8; 256]).expect("zero inode decodes");
        i.mode = 0o100_644;
        i.atime = Timestamp {
            sec: atime,
            nsec: 0,
        };
        i.mtime = Timestamp {
            sec: mtime,
            nsec: 0,
        };
        i.ctime = Timestamp {
            sec: ctime,
            nsec: 0,
        };
        i
    }

    fn at(sec: i64) -> Timestamp {
        Timestamp { sec, nsec: 0 }
    }

    #[test]
    fn relatime_follows_the_kernel_rules() {
        let p = AtimePolicy::RELATIME;
        let now = at(1_000_000);
        // atime not newer than mtime or ctime: update.
        assert!(p.needs_update(&inode(900_000, 950_000, 900_000), now));
        assert!(p.needs_update(&inode(900_000, 800_000, 900_000), now));
        // atime newer than both, and less than a day old: no update.
        assert!(!p.needs_update(&inode(999_000, 900_000, 900_000), now));
        // A day old: update.
        assert!(p.needs_update(&inode(now.sec - DAY_SECS, 0, 0), now));
        assert!(!p.needs_update(&inode(now.sec - DAY_SECS + 1, 0, 0), now));
        // Never to the value it has.
        assert!(!p.needs_update(&inode(now.sec, now.sec, now.sec), now));
    }

    #[test]
    fn flags_and_modes_that_stop_updates() {
        let now = at(1_000_000);
        let old = inode(1, 2, 2);
        let strict = AtimePolicy {
            mode: AtimeMode::Always,
            nodiratime: false,
        };
        assert!(strict.needs_update(&inode(999_999, 0, 0), now));
        assert!(!AtimePolicy::default().needs_update(&old, now));
        let mut noatime_flag = old.clone();
        noatime_flag.flags |= flags::NOATIME;
        assert!(!strict.needs_update(&noatime_flag, now));
        let mut dir = old.clone();
        dir.mode = 0o040_755;
        let nodir = AtimePolicy {
            nodiratime: true,
            ..AtimePolicy::RELATIME
        };
        assert!(!nodir.needs_update(&dir, now));
        assert!(nodir.needs_update(&old, now));
    }
}
