//! Journal replay (format notes §2.13; the recovery of the kernel's `fs/jbd2/recovery.c`
//! and e2fsck, which share it).
//!
//! [`replay`] runs the three passes on a device whose ext4 superblock has has_journal +
//! RECOVER: SCAN with the format crate's [`Scanner`] from `(s_start, s_sequence)`,
//! wrapping inside the log; the revoke table; then REPLAY, which writes each tagged
//! block (unescaped) to its home unless a transaction with a tid `>=` its own revoked
//! it. Then, in this order, each step made durable by a flush before the next:
//! 1. the replayed blocks;
//! 2. the journal superblock: `s_start = 0` (empty log), `s_sequence = end + 1` where
//!    `end` is the first tid not in the log, i.e. the last replayed tid + 2. This is the
//!    kernel's choice (`j_transaction_sequence = ++info.end_transaction` in
//!    `jbd2_journal_recover`) and e2fsck's (same code): skipping one tid guarantees that
//!    no commit block left in the log can ever match the next expected sequence;
//! 3. the ext4 superblock, re-read from the device (the journal may have rewritten it),
//!    with RECOVER cleared and its checksum recomputed.
//!
//! A crash between steps is harmless: before 2 the log is replayed again (replay is
//! idempotent); between 2 and 3 RECOVER is set over an empty log, which only clears it.
//!
//! Outcomes (stale vs corrupt, per the notes): a log that ends on a wrong magic or
//! sequence, or on a checksum failure whose commit time is older than the previous
//! commit's (stale data of an earlier pass over the log), ends cleanly. A failed commit
//! or descriptor/revoke checksum with a commit time that does not go backwards is
//! corruption: [`replay`] fails with "journal transaction N is corrupt" and writes
//! nothing (the kernel refuses the mount the same way). A data block whose tag checksum
//! fails is skipped, as both recoverers do; the replay then completes as e2fsck's does,
//! marks the filesystem as having errors (s_state ERROR_FS) and reports the blocks.
//! A journal superblock with a recorded abort (`s_errno`) also marks ERROR_FS and is
//! cleared, as the kernel's mount does.
//!
//! rext4's early commits (see `jwrite`): when no committed transaction is in the log
//! and the journal superblock records a chain of them written in this boot, the chain's
//! complete transactions (descriptors, every tag checksum and the EARLY block verified)
//! are replayed in order, then the log is emptied as above and the record cleared. In
//! another boot, or for jbd2's recovery, the chain does not exist.
//!
//! Not handled: fast-commit replay (a journal with FAST_COMMIT is refused as
//! unsupported), external journals.

use rext4_format::jbd2::{
    self, unescape, verify_tag, EarlyRecord, JournalSuperblock, LogEnd, ScanResult, Scanner,
};
use rext4_format::superblock::{feature, SB_OFFSET, STATE_ERROR};
use rext4_format::FormatError;

use super::{read_superblock, JournalMap};
use crate::device::BlockDevice;
use crate::error::{Error, Result};

/// What a replay found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayReport {
    /// The superblock asked for recovery (has_journal + RECOVER). When false nothing
    /// was read from the journal and nothing was written.
    pub needed: bool,
    /// Committed transactions found (and replayed).
    pub transactions: usize,
    /// tid of the first transaction in the log (`s_sequence` before replay).
    pub first_sequence: u32,
    /// First tid not in the log (last replayed tid + 1).
    pub end_sequence: u32,
    /// `s_sequence` written to the journal superblock (`end_sequence + 1`); the
    /// superblock is left alone for an empty log.
    pub new_sequence: u32,
    /// Blocks written to their home location (a block logged by several transactions
    /// counts once per copy written).
    pub blocks_replayed: usize,
    /// Revoke records read.
    pub revoke_records: usize,
    /// Logged blocks not written because a later (or the same) transaction revoked them.
    pub revoke_hits: usize,
    /// `(tid, fs block)` of logged blocks whose tag checksum failed: not written.
    pub bad_checksums: Vec<(u32, u64)>,
    /// Journal block where the log started (`s_start`) and the block after the last
    /// commit; the log wrapped around the end of the journal when `head <= start`.
    pub log_start: u32,
    pub log_head: u32,
    /// How the log ended.
    pub end: LogEnd,
    /// `s_errno` found in the journal superblock (0 = none).
    pub journal_errno: i32,
    /// Of `transactions`, rext4's early commits (replayed only in the boot that wrote
    /// them; see `jwrite`).
    pub early_transactions: usize,
}

impl ReplayReport {
    fn nothing() -> ReplayReport {
        ReplayReport {
            needed: false,
            transactions: 0,
            first_sequence: 0,
            end_sequence: 0,
            new_sequence: 0,
            blocks_replayed: 0,
            revoke_records: 0,
            revoke_hits: 0,
            bad_checksums: Vec::new(),
            log_start: 0,
            log_head: 0,
            end: LogEnd::Empty,
            journal_errno: 0,
            early_transactions: 0,
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

/// One transaction of a chain of early commits: tid, and where each of its logged
/// blocks is.
type EarlyTxn = (u32, Vec<jbd2::LoggedBlock>);

/// The complete transactions of the chain of early commits `jsb` records, when it
/// was written during boot `boot_id`: each with valid descriptors, every data block's
/// checksum verified, and its EARLY block; the chain ends at the first that is not.
fn early_chain(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    jsb: &JournalSuperblock,
    boot_id: Option<[u8; 16]>,
) -> Result<Vec<EarlyTxn>> {
    let (Some(rec), Some(boot)) = (EarlyRecord::from_sb(jsb), boot_id) else {
        return Ok(Vec::new());
    };
    if rec.boot_id != boot || rec.start < jsb.first || rec.start >= jsb.maxlen {
        return Ok(Vec::new());
    }
    let fmt = jsb.log_format();
    let bs = jsb.blocksize as usize;
    let mut buf = vec![0u8; bs];
    let mut data = vec![0u8; bs];
    let mut chain = Vec::new();
    let mut pos = rec.start;
    let mut tid = rec.first_tid;
    let mut cur: Vec<jbd2::LoggedBlock> = Vec::new();
    while pos < jsb.maxlen {
        map.read(dev, u64::from(pos), &mut buf)?;
        if jbd2::is_early(&buf, tid, &boot, fmt.j_seed) {
            chain.push((tid, std::mem::take(&mut cur)));
            tid = tid.wrapping_add(1);
            pos += 1;
            continue;
        }
        let tags = match jbd2::classify(&buf, tid, &fmt) {
            jbd2::BlockKind::Descriptor {
                tags,
                csum_ok: true,
            } => tags,
            _ => break,
        };
        let mut whole = true;
        for (k, tag) in tags.iter().enumerate() {
            let at = pos + 1 + k as u32;
            if at >= jsb.maxlen {
                whole = false;
                break;
            }
            map.read(dev, u64::from(at), &mut data)?;
            if verify_tag(tag, tid, &data, &fmt).is_err() {
                whole = false;
                break;
            }
            cur.push(jbd2::LoggedBlock {
                log_block: jbd2::LogPos(at),
                tag: *tag,
            });
        }
        if !whole {
            break;
        }
        pos += 1 + tags.len() as u32;
    }
    Ok(chain)
}

/// Read and check the journal superblock.
fn load_jsb(dev: &dyn BlockDevice, map: &JournalMap, bs: usize) -> Result<JournalSuperblock> {
    let mut b = vec![0u8; bs];
    map.read(dev, 0, &mut b)?;
    let at = map.physical(0)?;
    let jsb = JournalSuperblock::decode(&b).map_err(|e| Error::from(e.at_block(at)))?;
    jsb.verify().map_err(|e| Error::from(e.at_block(at)))?;
    if let Err(e) = jsb.features_supported() {
        return Err(Error::Unsupported(format!("journal: {e}")));
    }
    let f = jsb.features();
    if f.fast_commit() {
        return Err(Error::Unsupported(
            "journal feature fast_commit: fast-commit replay is not supported".into(),
        ));
    }
    if jsb.blocksize as usize != bs || u64::from(jsb.maxlen) > map.blocks {
        return Err(Error::corrupted(
            format!(
                "journal superblock geometry (block size {}, {} blocks) does not fit the \
                 journal inode ({} blocks of {bs} bytes)",
                jsb.blocksize, jsb.maxlen, map.blocks
            ),
            Some(at),
        ));
    }
    Ok(jsb)
}

/// The SCAN pass. A corrupt transaction fails with its tid.
fn scan(dev: &dyn BlockDevice, map: &JournalMap, jsb: &JournalSuperblock) -> Result<ScanResult> {
    let bs = jsb.blocksize as usize;
    let mut buf = vec![0u8; bs];
    let mut s = Scanner::new(jsb);
    while let Some(p) = s.next() {
        map.read(dev, u64::from(p.0), &mut buf)?;
        s.feed(&buf);
    }
    let tid = s.sequence();
    s.finish().map_err(|e| {
        let why = match e {
            FormatError::Corrupted { what, .. } => what,
            other => other.to_string(),
        };
        Error::corrupted(format!("journal transaction {tid} is corrupt: {why}"), None)
    })
}

fn run(dev: &dyn BlockDevice, write: bool, boot_id: Option<[u8; 16]>) -> Result<ReplayReport> {
    let (_, sb) = read_superblock(dev)?;
    if !sb.has_compat(feature::COMPAT_HAS_JOURNAL) || !sb.has_incompat(feature::INCOMPAT_RECOVER) {
        return Ok(ReplayReport::nothing());
    }
    let bs = sb.block_size() as usize;
    let map = JournalMap::locate(dev, &sb)?;
    let jsb = load_jsb(dev, &map, bs)?;
    let mut report = ReplayReport {
        needed: true,
        first_sequence: jsb.sequence,
        end_sequence: jsb.sequence,
        new_sequence: jsb.sequence,
        log_start: jsb.start,
        log_head: jsb.start,
        journal_errno: jsb.errno,
        ..ReplayReport::nothing()
    };
    let mut update_jsb = jsb.errno != 0;
    if !jsb.is_empty() {
        let result = scan(dev, &map, &jsb)?;
        let plan = result.replay_plan();
        let logged: usize = result.transactions.iter().map(|t| t.blocks.len()).sum();
        report.transactions = result.transactions.len();
        report.end_sequence = result.end_sequence;
        report.new_sequence = result.end_sequence.wrapping_add(1);
        report.log_head = result.head.0;
        report.end = result.end;
        report.revoke_records = result.transactions.iter().map(|t| t.revoked.len()).sum();
        report.revoke_hits = logged - plan.len();
        let fmt = jsb.log_format();
        let mut buf = vec![0u8; bs];
        for w in &plan {
            let home = w.tag.blocknr;
            if home >= sb.blocks_count {
                return Err(Error::corrupted(
                    format!(
                        "journal transaction {} is corrupt: it logs block {home}, outside \
                         the filesystem ({} blocks)",
                        w.sequence, sb.blocks_count
                    ),
                    None,
                ));
            }
            map.read(dev, u64::from(w.log_block.0), &mut buf)?;
            if verify_tag(&w.tag, w.sequence, &buf, &fmt).is_err() {
                report.bad_checksums.push((w.sequence, home));
                continue;
            }
            if w.tag.escaped() {
                unescape(&mut buf);
            }
            if write {
                dev.write_at(&buf, home * bs as u64)?;
            }
            report.blocks_replayed += 1;
        }
        update_jsb = true;
    }
    // Nothing committed for jbd2 (or a commit cut short after a chain of early
    // commits): the chain, when this boot wrote it.
    let record = EarlyRecord::from_sb(&jsb).is_some();
    let mut chain_end = None;
    if report.transactions == 0 && record {
        let chain = early_chain(dev, &map, &jsb, boot_id)?;
        let mut buf = vec![0u8; bs];
        for (tid, blocks) in &chain {
            for b in blocks {
                let home = b.tag.blocknr;
                if home >= sb.blocks_count {
                    return Err(Error::corrupted(
                        format!("early commit {tid} logs block {home}, outside the filesystem"),
                        None,
                    ));
                }
                map.read(dev, u64::from(b.log_block.0), &mut buf)?;
                if b.tag.escaped() {
                    unescape(&mut buf);
                }
                if write {
                    dev.write_at(&buf, home * bs as u64)?;
                }
                report.blocks_replayed += 1;
            }
        }
        report.transactions += chain.len();
        report.early_transactions = chain.len();
        chain_end = chain.last().map(|(t, _)| t.wrapping_add(1));
    }
    update_jsb |= record;
    if !write {
        return Ok(report);
    }
    dev.flush()?;

    if update_jsb {
        let mut new = jsb.clone();
        if !jsb.is_empty() {
            new.start = 0;
            new.sequence = report.new_sequence;
        }
        if let Some(end) = chain_end {
            // As after jbd2's replay: one tid skipped past the last replayed.
            report.end_sequence = end;
            report.new_sequence = end.wrapping_add(1);
            new.start = 0;
            new.sequence = report.new_sequence;
        }
        EarlyRecord::store(None, &mut new);
        new.errno = 0;
        new.update_checksum();
        let mut b = vec![0u8; bs];
        map.read(dev, 0, &mut b)?;
        new.encode(&mut b[..jbd2::SB_SIZE])?;
        map.write(dev, 0, &b)?;
        dev.flush()?;
    }

    // The journal may have carried the superblock itself: re-read it.
    let (mut raw, mut sb) = read_superblock(dev)?;
    sb.feature_incompat &= !feature::INCOMPAT_RECOVER;
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
