//! Recovery of a jbd2 log (format notes §2.13; the kernel's `fs/jbd2/recovery.c` and
//! e2fsck, which share it): [`recover`] runs the SCAN pass with
//! `rext4_format::jbd2::Scanner` from `(s_start, s_sequence)`, wrapping inside the
//! log, the revoke table, then REPLAY, which writes each tagged block (unescaped) to
//! its home unless a transaction with a tid `>=` its own revoked it. Then, each step
//! made durable by a flush before the next: the replayed blocks; the journal
//! superblock (`s_start = 0`, `s_sequence = end + 1`, one tid skipped past the last
//! replayed as the kernel and e2fsck do, so no commit block left in the log can match
//! the next expected sequence; a recorded `s_errno` and an early-commit record
//! cleared). What the filesystem's own superblock needs after that (ext4's RECOVER
//! flag, its error state) is the caller's.
//!
//! A log that ends on a wrong magic or sequence, or on a checksum failure whose commit
//! time is older than the previous commit's, ends cleanly; a failed commit or
//! descriptor/revoke checksum whose commit time does not go backwards is corruption:
//! "journal transaction N is corrupt", and nothing is written. A data block whose tag
//! checksum fails is skipped and reported (`bad_checksums`).
//!
//! Fast commits (journal feature FAST_COMMIT): after the SCAN of the log, the
//! fast-commit area (journal blocks `log_last + 1` to the end) is scanned for the fast
//! commits of the first transaction not in the log (`rext4_format::fast_commit::Scan`).
//! Their records are not jbd2's to replay: they are returned ([`Recovery::fast_commits`])
//! for the filesystem to apply, and the journal superblock is left saying so — `s_start`
//! at the block after the log's last commit, `s_sequence` that transaction — a log with
//! no whole transaction whose fast commits every recoverer (kernel, e2fsck, rext4)
//! still replays. The filesystem's first commit (that transaction's number, written from
//! `s_first`) then replaces them. An area that is damaged before its first whole fast
//! commit fails recovery, as the kernel's does; damage after it ends the area there.
//!
//! rext4's early commits: when no committed transaction is in the log and the journal
//! superblock records a chain of them written in boot `boot_id`, the chain's complete
//! transactions (descriptors, every tag checksum and the EARLY block verified) are
//! replayed in order. In another boot the chain does not exist.

use rext4_format::fast_commit;
use rext4_format::jbd2::{
    self, unescape, verify_tag, EarlyRecord, JournalSuperblock, LogEnd, ScanResult, Scanner,
};
use rext4_format::FormatError;

use crate::{Device, Error, Result};

/// Where the log's blocks are on the device.
pub trait LogMap {
    /// Log blocks there are.
    fn blocks(&self) -> u64;
    /// The device block of log block `j`.
    fn physical(&self, j: u64) -> Result<u64>;
}

impl LogMap for [u64] {
    fn blocks(&self) -> u64 {
        self.len() as u64
    }
    fn physical(&self, j: u64) -> Result<u64> {
        usize::try_from(j)
            .ok()
            .and_then(|j| self.get(j).copied())
            .ok_or_else(|| corrupted(format!("journal block {j} is not mapped"), None))
    }
}

fn corrupted(what: String, block: Option<u64>) -> Error {
    Error::Corrupted { what, block }
}

/// Read log block `j` into `buf` (one block).
fn read<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    bs: usize,
    j: u64,
    buf: &mut [u8],
) -> Result<()> {
    dev.read_at(buf, map.physical(j)? * bs as u64)?;
    Ok(())
}

/// What a recovery found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Committed transactions found (and replayed), early commits included.
    pub transactions: usize,
    /// tid of the first transaction in the log (`s_sequence` before recovery).
    pub first_sequence: u32,
    /// First tid not in the log (last replayed tid + 1).
    pub end_sequence: u32,
    /// `s_sequence` written to the journal superblock (`end_sequence + 1`); the
    /// superblock is left alone for an empty log.
    pub new_sequence: u32,
    /// Blocks written to their home (a block logged by several transactions counts
    /// once per copy written).
    pub blocks_replayed: usize,
    /// Revoke records read.
    pub revoke_records: usize,
    /// Logged blocks not written because a later (or the same) transaction revoked them.
    pub revoke_hits: usize,
    /// `(tid, home block)` of logged blocks whose tag checksum failed: not written.
    pub bad_checksums: Vec<(u32, u64)>,
    /// Log block where the log started (`s_start`) and the block after the last
    /// commit; the log wrapped around the end of the journal when `head <= start`.
    pub log_start: u32,
    pub log_head: u32,
    /// How the log ended.
    pub end: LogEnd,
    /// `s_errno` found in the journal superblock (0 = none).
    pub journal_errno: i32,
    /// Of `transactions`, rext4's early commits (replayed only in the boot that wrote
    /// them).
    pub early_transactions: usize,
    /// The records of the whole fast commits of transaction `end_sequence`, for the
    /// filesystem to replay (empty when there are none); the journal was left needing
    /// them (see the module note).
    pub fast_commits: Vec<fast_commit::Tag>,
    /// Fast commits found whole.
    pub fast_commit_count: usize,
}

impl Default for Recovery {
    /// Nothing found, nothing done.
    fn default() -> Recovery {
        Recovery {
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
            fast_commits: Vec::new(),
            fast_commit_count: 0,
        }
    }
}

/// One transaction of a chain of early commits: tid, and where each of its logged
/// blocks is.
type EarlyTxn = (u32, Vec<jbd2::LoggedBlock>);

/// The complete transactions of the chain of early commits `jsb` records, when it
/// was written during boot `boot_id`: each with valid descriptors, every data block's
/// checksum verified, and its EARLY block; the chain ends at the first that is not.
fn early_chain<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    jsb: &JournalSuperblock,
    boot_id: Option<[u8; 16]>,
) -> Result<Vec<EarlyTxn>> {
    let (Some(rec), Some(boot)) = (EarlyRecord::from_sb(jsb), boot_id) else {
        return Ok(Vec::new());
    };
    if rec.boot_id != boot || rec.start < jsb.first || rec.start >= jsb.log_last() {
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
    while pos < jsb.log_last() {
        read(dev, map, bs, u64::from(pos), &mut buf)?;
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
            if at >= jsb.log_last() {
                whole = false;
                break;
            }
            read(dev, map, bs, u64::from(at), &mut data)?;
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

/// The journal superblock in log block 0, decoded and verified, its features known
/// (what the writer's `Log::open` and recovery both start from).
pub(crate) fn read_superblock<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    bs: usize,
) -> Result<JournalSuperblock> {
    Ok(read_superblock_block(dev, map, bs)?.0)
}

/// The journal superblock and the whole block that holds it.
pub(crate) fn read_superblock_block<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    bs: usize,
) -> Result<(JournalSuperblock, Vec<u8>)> {
    let mut b = vec![0u8; bs];
    read(dev, map, bs, 0, &mut b)?;
    let at = map.physical(0)?;
    let jsb = JournalSuperblock::decode(&b).map_err(|e| e.at_block(at))?;
    jsb.verify().map_err(|e| e.at_block(at))?;
    if let Err(e) = jsb.features_supported() {
        return Err(Error::Unsupported(format!("journal: {e}")));
    }
    Ok((jsb, b))
}

/// Read and check the journal superblock for recovery.
fn load_jsb<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    bs: usize,
) -> Result<JournalSuperblock> {
    let at = map.physical(0)?;
    let jsb = read_superblock(dev, map, bs)?;
    if jsb.blocksize as usize != bs || u64::from(jsb.maxlen) > map.blocks() {
        return Err(corrupted(
            format!(
                "journal superblock geometry (block size {}, {} blocks) does not fit the \
                 journal ({} blocks of {bs} bytes)",
                jsb.blocksize,
                jsb.maxlen,
                map.blocks()
            ),
            Some(at),
        ));
    }
    Ok(jsb)
}

/// The fast commits of transaction `tid` in the journal's fast-commit area (none
/// without the feature): the records of those found whole.
fn scan_fast_commits<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    jsb: &JournalSuperblock,
    tid: u32,
    inode_size: usize,
) -> Result<(Vec<fast_commit::Tag>, usize)> {
    let last = jsb.log_last();
    if !jsb.features().fast_commit() || last >= jsb.maxlen {
        return Ok((Vec::new(), 0));
    }
    let bs = jsb.blocksize as usize;
    let mut buf = vec![0u8; bs];
    let mut s = fast_commit::Scan::new(tid, inode_size);
    // jbd2's j_fc_first is j_last + 1.
    for j in last + 1..jsb.maxlen {
        read(dev, map, bs, u64::from(j), &mut buf)?;
        let step = s.feed(&buf).map_err(|e| {
            let why = match e {
                FormatError::Corrupted { what, .. } => what,
                other => other.to_string(),
            };
            corrupted(
                format!("fast commits of journal transaction {tid} are corrupt: {why}"),
                map.physical(u64::from(j)).ok(),
            )
        })?;
        if step == fast_commit::Step::Stop {
            break;
        }
    }
    let n = s.commits();
    Ok((s.finish(), n))
}

/// The SCAN pass. A corrupt transaction fails with its tid.
fn scan<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    jsb: &JournalSuperblock,
) -> Result<ScanResult> {
    let bs = jsb.blocksize as usize;
    let mut buf = vec![0u8; bs];
    let mut s = Scanner::new(jsb);
    while let Some(p) = s.next() {
        read(dev, map, bs, u64::from(p.0), &mut buf)?;
        s.feed(&buf);
    }
    let tid = s.sequence();
    s.finish().map_err(|e| {
        let why = match e {
            FormatError::Corrupted { what, .. } => what,
            other => other.to_string(),
        };
        corrupted(format!("journal transaction {tid} is corrupt: {why}"), None)
    })
}

/// Recover the log on the blocks `map` of `dev` (block size `bs`; home blocks must lie
/// below `fs_blocks`; the filesystem's inodes are `inode_size` bytes, which bounds fast
/// commits' inode records): replay what it holds, then empty it — or, without `write`,
/// only say what a replay would do. `boot_id`: this boot's, for rext4's early commits.
/// Fast commits are returned, not replayed (see the module note).
///
/// Errors: `Unsupported` for journal features that cannot be replayed, `Corrupted` for
/// an unreadable journal or a corrupt transaction or fast-commit area; in each case
/// nothing was written.
pub fn recover<D: Device + ?Sized, M: LogMap + ?Sized>(
    dev: &D,
    map: &M,
    bs: usize,
    fs_blocks: u64,
    inode_size: usize,
    write: bool,
    boot_id: Option<[u8; 16]>,
) -> Result<Recovery> {
    let jsb = load_jsb(dev, map, bs)?;
    let mut report = Recovery {
        first_sequence: jsb.sequence,
        end_sequence: jsb.sequence,
        new_sequence: jsb.sequence,
        log_start: jsb.start,
        log_head: jsb.start,
        journal_errno: jsb.errno,
        ..Recovery::default()
    };
    let mut update_jsb = jsb.errno != 0;
    if !jsb.is_empty() {
        let result = scan(dev, map, &jsb)?;
        let plan = result.replay_plan();
        let logged: usize = result.transactions.iter().map(|t| t.blocks.len()).sum();
        report.transactions = result.transactions.len();
        report.end_sequence = result.end_sequence;
        report.new_sequence = result.end_sequence.wrapping_add(1);
        report.log_head = result.head.0;
        report.end = result.end;
        report.revoke_records = result.transactions.iter().map(|t| t.revoked.len()).sum();
        report.revoke_hits = logged - plan.len();
        // Before anything is written: a damaged area fails recovery as a whole.
        let (tags, n) = scan_fast_commits(dev, map, &jsb, result.end_sequence, inode_size)?;
        report.fast_commits = tags;
        report.fast_commit_count = n;
        let fmt = jsb.log_format();
        let mut buf = vec![0u8; bs];
        for w in &plan {
            let home = w.tag.blocknr;
            if home >= fs_blocks {
                return Err(corrupted(
                    format!(
                        "journal transaction {} is corrupt: it logs block {home}, outside \
                         the filesystem ({fs_blocks} blocks)",
                        w.sequence
                    ),
                    None,
                ));
            }
            read(dev, map, bs, u64::from(w.log_block.0), &mut buf)?;
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
    if report.transactions == 0 && record && report.fast_commits.is_empty() {
        let chain = early_chain(dev, map, &jsb, boot_id)?;
        let mut buf = vec![0u8; bs];
        for (tid, blocks) in &chain {
            for b in blocks {
                let home = b.tag.blocknr;
                if home >= fs_blocks {
                    return Err(corrupted(
                        format!("early commit {tid} logs block {home}, outside the filesystem"),
                        None,
                    ));
                }
                read(dev, map, bs, u64::from(b.log_block.0), &mut buf)?;
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
        if !report.fast_commits.is_empty() {
            // No whole transaction left, the fast commits still to replay: the log
            // starts where the scan ended, expecting their transaction.
            new.start = report.log_head;
            new.sequence = report.end_sequence;
            report.new_sequence = report.end_sequence;
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
        read(dev, map, bs, 0, &mut b)?;
        new.encode(&mut b[..jbd2::SB_SIZE])?;
        dev.write_at(&b, map.physical(0)? * bs as u64)?;
        dev.flush()?;
    }

    Ok(report)
}
