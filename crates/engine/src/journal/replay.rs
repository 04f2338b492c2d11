//! Journal replay for an ext4 filesystem (format notes §2.13): the ext4 side of
//! recovery. [`replay`] runs when the superblock has has_journal + RECOVER: it finds
//! the journal inode's blocks ([`JournalMap`]), hands them to `rext4_jbd2::recover`
//! (the SCAN, REVOKE and REPLAY passes, rext4's early commits, the replayed blocks and
//! then the emptied journal superblock made durable, each by a flush; see that crate),
//! then, last, writes the ext4 superblock, re-read from the device (the journal may
//! have rewritten it), with RECOVER cleared and ERROR_FS set when a logged block's
//! checksum failed or the journal recorded an abort (`s_errno`), as the kernel's
//! mount and e2fsck do.
//!
//! A crash between steps is harmless: before the journal superblock is emptied the log
//! is replayed again (replay is idempotent); between that and the ext4 superblock,
//! RECOVER is set over an empty log, which only clears it. A corrupt transaction fails
//! with "journal transaction N is corrupt" and writes nothing (the kernel refuses the
//! mount the same way).
//!
//! Fast commits (`report.fast_commits`) are not applied here: they need the open
//! filesystem (`Fs::open_device` replays them). The journal is left needing them and
//! RECOVER stays set, so every recoverer still replays them (see `rext4_jbd2::recover`).
//!
//! Not handled: external journals.

use rext4_format::superblock::{feature, SB_OFFSET, STATE_ERROR};

use super::{read_superblock, JournalMap};
use crate::device::BlockDevice;
use crate::error::Result;

/// What a replay found and did: whether the filesystem asked for one, and what the
/// log's recovery found and did (`rext4_jbd2::Recovery`, whose fields read through
/// the report: `report.transactions`, `report.end`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayReport {
    /// The superblock asked for recovery (has_journal + RECOVER). When false nothing
    /// was read from the journal and nothing was written.
    pub needed: bool,
    /// The log's recovery (all zero when not needed).
    pub log: rext4_jbd2::Recovery,
}

impl std::ops::Deref for ReplayReport {
    type Target = rext4_jbd2::Recovery;
    fn deref(&self) -> &rext4_jbd2::Recovery {
        &self.log
    }
}

impl std::ops::DerefMut for ReplayReport {
    fn deref_mut(&mut self) -> &mut rext4_jbd2::Recovery {
        &mut self.log
    }
}

impl ReplayReport {
    fn nothing() -> ReplayReport {
        ReplayReport {
            needed: false,
            log: rext4_jbd2::Recovery::default(),
        }
    }

    /// The log ran past the end of the journal and continued at `s_first`.
    pub fn wrapped(&self) -> bool {
        self.transactions > 0 && self.log_head <= self.log_start
    }

    /// Messages for the user beyond the replay summary (checksum failures, recorded
    /// journal errors).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if !self.bad_checksums.is_empty() {
            let list: Vec<String> = self
                .bad_checksums
                .iter()
                .take(8)
                .map(|(t, b)| format!("block {b} (transaction {t})"))
                .collect();
            w.push(format!(
                "journal replay skipped {} logged blocks whose checksum failed: {}; \
                 the filesystem is marked as having errors (run e2fsck)",
                self.bad_checksums.len(),
                list.join(", ")
            ));
        }
        if !self.fast_commits.is_empty() {
            w.push(format!(
                "the journal holds {} fast commit(s) of transaction {} ({} records), \
                 replayed by the read-write open",
                self.fast_commit_count,
                self.end_sequence,
                self.fast_commits.len()
            ));
        }
        if self.journal_errno != 0 {
            w.push(format!(
                "the journal recorded an error from a previous mount (errno {}); \
                 the filesystem is marked as having errors (run e2fsck)",
                self.journal_errno
            ));
        }
        w
    }
}

/// Replay the journal of the ext4 filesystem on `dev` if its superblock asks for
/// recovery (has_journal + RECOVER), then empty the log and clear RECOVER. A
/// filesystem that needs no recovery is left alone (`needed` false).
///
/// Errors: `Unsupported` for an external journal or journal features rext4 cannot
/// replay (named), `Corrupted` for an unreadable journal or a corrupt transaction
/// ("journal transaction N is corrupt: ..."); in both cases nothing was written.
pub fn replay(dev: &dyn BlockDevice) -> Result<ReplayReport> {
    run(dev, true, super::current_boot_id())
}

/// A dry run of [`replay`]: the same checks and report, nothing written.
pub fn examine(dev: &dyn BlockDevice) -> Result<ReplayReport> {
    run(dev, false, super::current_boot_id())
}

/// [`replay`], with rext4's early commits replayed only when they were written during
/// boot `boot_id` (`None`: never).
pub(crate) fn replay_in_boot(
    dev: &dyn BlockDevice,
    boot_id: Option<[u8; 16]>,
) -> Result<ReplayReport> {
    run(dev, true, boot_id)
}

fn run(dev: &dyn BlockDevice, write: bool, boot_id: Option<[u8; 16]>) -> Result<ReplayReport> {
    let (_, sb) = read_superblock(dev)?;
    if !sb.has_compat(feature::COMPAT_HAS_JOURNAL) || !sb.has_incompat(feature::INCOMPAT_RECOVER) {
        return Ok(ReplayReport::nothing());
    }
    let bs = sb.block_size() as usize;
    let map = JournalMap::locate(dev, &sb)?;
    let report = ReplayReport {
        needed: true,
        log: rext4_jbd2::recover(
            dev,
            &map.into_runs(),
            bs,
            sb.blocks_count,
            usize::from(sb.inode_size),
            write,
            boot_id,
        )?,
    };
    if !write {
        return Ok(report);
    }
    // The journal may have carried the superblock itself: re-read it.
    let (mut raw, mut sb) = read_superblock(dev)?;
    if report.fast_commits.is_empty() {
        sb.feature_incompat &= !feature::INCOMPAT_RECOVER;
    }
    if !report.bad_checksums.is_empty() || report.journal_errno != 0 {
        sb.state |= STATE_ERROR;
    }
    sb.encode_into(&mut raw);
    dev.write_at(&raw, SB_OFFSET)?;
    dev.flush()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_wrap_and_warnings() {
        let mut r = ReplayReport::nothing();
        assert!(!r.wrapped());
        r.transactions = 2;
        r.log_start = 900;
        r.log_head = 20;
        assert!(r.wrapped());
        r.log_head = 950;
        assert!(!r.wrapped());
        assert!(r.warnings().is_empty());
        r.bad_checksums.push((7, 1234));
        let w = r.warnings().join("\n");
        assert!(w.contains("block 1234 (transaction 7)"), "{w}");
    }
}
