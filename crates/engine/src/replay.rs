//! Journal recovery (format notes §2.13): replay the committed transactions of a jbd2
//! log written by the kernel, e2fsck or rext4, then mark the log empty and clear
//! needs_recovery.
//!
//! The three passes come from the format crate's `Scanner` (scan: find the committed
//! transactions, judging checksum failures stale or corrupt by the commit-time rule;
//! revoke: newest revoking transaction per block; replay plan: every tagged block not
//! revoked by a transaction at least as new). Here: read the log through the journal
//! inode's block map, write each planned block home (unescaped; a block whose tag
//! checksum fails is skipped, as the kernel does), flush, then reset the journal
//! superblock (s_start 0, s_sequence past the last transaction) and clear RECOVER in a
//! freshly read ext4 superblock (block 0/1 may have been replayed), flush again.
//!
//! A read-only open replays into an [`Overlay`]: the same writes land in memory over
//! the untouched device.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use rext4_format::jbd2::{self, JournalSuperblock, Scanner};
use rext4_format::superblock::{feature, Superblock, SB_OFFSET, SB_SIZE};

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::fs::{Fs, FsOptions, Ino};
use crate::map::Mapping;

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayReport {
    pub transactions: usize,
    pub blocks: usize,
    /// Tagged blocks skipped because their checksum failed.
    pub bad_blocks: usize,
}

/// The journal's block map, read through a read-only view of the filesystem.
fn journal_map(dev: Arc<dyn BlockDevice>) -> Result<(Vec<u64>, u32, u64)> {
    let fs = Fs::open_device_no_replay(dev)?;
    let sb = fs.superblock();
    let ino = Ino(sb.journal_inum);
    if ino.0 == 0 {
        return Err(Error::Unsupported("external journals".into()));
    }
    let inode = fs.read_inode(ino)?;
    let bs = u64::from(fs.block_size());
    let n = inode.size / bs;
    if n > 1 << 24 {
        return Err(Error::corrupted(format!("journal of {n} blocks"), None));
    }
    let mut map = Vec::with_capacity(n as usize);
    let mut l = 0;
    while l < n {
        match fs.map_block(ino, &inode, l)? {
            Mapping::Mapped { physical, len, .. } => {
                let take = len.min(n - l);
                map.extend((0..take).map(|k| physical + k));
                l += take;
            }
            Mapping::Hole { .. } => {
                return Err(Error::corrupted(format!("journal has a hole at {l}"), None))
            }
        }
    }
    Ok((map, fs.block_size(), sb.blocks_count))
}

/// Replay the journal of the filesystem on `dev` (which must have RECOVER set).
pub fn replay(dev: Arc<dyn BlockDevice>) -> Result<ReplayReport> {
    let (map, bs, blocks_count) = journal_map(dev.clone())?;
    let bsz = bs as usize;
    let read = |j: u64| -> Result<Vec<u8>> {
        let p = *map.get(j as usize).ok_or_else(|| {
            Error::corrupted(format!("journal block {j} beyond the journal"), None)
        })?;
        let mut b = vec![0u8; bsz];
        dev.read_at(&mut b, p * u64::from(bs))?;
        Ok(b)
    };
    let jb0 = read(0)?;
    let mut jsb = JournalSuperblock::decode(&jb0).map_err(|e| Error::from(e.at_block(map[0])))?;
    jsb.verify().map_err(|e| Error::from(e.at_block(map[0])))?;
    jsb.features_supported()
        .map_err(|e| Error::Unsupported(format!("journal: {e}")))?;
    if jsb.maxlen as usize > map.len() {
        return Err(Error::corrupted(
            "journal superblock longer than the journal inode",
            Some(map[0]),
        ));
    }
    let mut sc = Scanner::new(&jsb);
    while let Some(pos) = sc.next() {
        let b = read(u64::from(pos.0))?;
        sc.feed(&b);
    }
    let res = sc.finish().map_err(|e| match e {
        rext4_format::FormatError::Corrupted { what, .. } => Error::corrupted(
            format!("journal is corrupt, refusing to replay: {what}"),
            None,
        ),
        other => Error::from(other),
    })?;
    let fmt = jsb.log_format();
    let mut report = ReplayReport {
        transactions: res.transactions.len(),
        ..ReplayReport::default()
    };
    for w in res.replay_plan() {
        let mut b = read(u64::from(w.log_block.0))?;
        if jbd2::verify_tag(&w.tag, w.sequence, &b, &fmt).is_err() {
            report.bad_blocks += 1;
            continue;
        }
        if w.tag.escaped() {
            jbd2::unescape(&mut b);
        }
        if w.tag.blocknr >= blocks_count {
            return Err(Error::corrupted(
                format!(
                    "journal tag for block {} beyond the filesystem",
                    w.tag.blocknr
                ),
                None,
            ));
        }
        dev.write_at(&b, w.tag.blocknr * u64::from(bs))?;
        report.blocks += 1;
    }
    dev.flush()?;
    // Empty the log; the next transaction ID follows the last one seen.
    jsb.start = 0;
    jsb.sequence = res.end_sequence.wrapping_add(1);
    jsb.update_checksum();
    let mut b0 = read(0)?;
    jsb.encode(&mut b0[..jbd2::SB_SIZE])?;
    dev.write_at(&b0, map[0] * u64::from(bs))?;
    // The superblock as replayed, without RECOVER.
    let mut raw = vec![0u8; SB_SIZE];
    dev.read_at(&mut raw, SB_OFFSET)?;
    let mut sb =
        Superblock::decode(&raw).map_err(|e| Error::from(e.at_block(SB_OFFSET / u64::from(bs))))?;
    sb.feature_incompat &= !feature::INCOMPAT_RECOVER;
    sb.encode_into(&mut raw);
    dev.write_at(&raw, SB_OFFSET)?;
    dev.flush()?;
    Ok(report)
}

/// A device whose writes stay in memory over a read-only base (read-only replay).
pub struct Overlay {
    base: Arc<dyn BlockDevice>,
    /// 512-byte-sector-aligned pieces written so far, by offset.
    written: RwLock<HashMap<u64, Vec<u8>>>,
}

const PIECE: u64 = 512;

impl Overlay {
    pub fn new(base: Arc<dyn BlockDevice>) -> Self {
        Overlay {
            base,
            written: RwLock::new(HashMap::new()),
        }
    }
}

impl BlockDevice for Overlay {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.base.read_at(buf, offset)?;
        let w = self.written.read().unwrap_or_else(|p| p.into_inner());
        if w.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let mut s = offset - offset % PIECE;
        while s < end {
            if let Some(piece) = w.get(&s) {
                let lo = s.max(offset);
                let hi = (s + PIECE).min(end);
                buf[(lo - offset) as usize..(hi - offset) as usize]
                    .copy_from_slice(&piece[(lo - s) as usize..(hi - s) as usize]);
            }
            s += PIECE;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.base.size_bytes() {
            return Err(std::io::Error::other("overlay write past the device"));
        }
        let mut s = offset - offset % PIECE;
        while s < end {
            let mut piece = vec![0u8; PIECE as usize];
            self.read_at(&mut piece, s)?;
            let lo = s.max(offset);
            let hi = (s + PIECE).min(end);
            piece[(lo - s) as usize..(hi - s) as usize]
                .copy_from_slice(&buf[(lo - offset) as usize..(hi - offset) as usize]);
            self.written
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(s, piece);
            s += PIECE;
        }
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

impl Fs {
    /// Open without replaying (used to read the journal inode during a replay).
    pub(crate) fn open_device_no_replay(dev: Arc<dyn BlockDevice>) -> Result<Fs> {
        Fs::open_device_inner(dev, FsOptions::default(), false)
    }
}
