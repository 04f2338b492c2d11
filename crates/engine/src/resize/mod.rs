//! # resize: grow and shrink an unmounted image, crash-safe
//!
//! Owns `rext4 resize IMAGE SIZE|min` ([`resize`]): the new geometry (`layout`), the
//! shrink's evacuation of the groups it removes (`evacuate`), the smallest size the
//! contents fit in (`plan`), and the switch from the old geometry to the new one
//! (`switch`). Facts (what the new groups, descriptors, resize inode and superblock
//! look like) follow resize2fs 1.47 and the kernel's online resize; the protocol is our
//! own, because resize2fs is not crash-safe (it rewrites everything in place).
//!
//! ## The protocol: every state on disk is the old filesystem or the new one
//!
//! 0. *Checks*, before anything is written: the image is claimed for writing (no mount,
//!    loop device or other rext4 holds it: `crate::claim`); the superblock and every
//!    descriptor verify; the features are ones this module lays out (bigalloc,
//!    meta_bg, sparse_super2, no journal, a block-mapped journal, ext2/3 block-mapped
//!    layouts are refused by name); the filesystem has no recorded errors; the size is possible (the last
//!    group big enough for its metadata, as resize2fs rounds; not more than 2^32 blocks
//!    without 64bit, nor 2^32 inodes; descriptors fit in a group; not smaller than the
//!    contents). A journal that needs recovery is replayed first, as every read-write
//!    open of rext4 does (so a resize that was interrupted is finished this way).
//! 1. *Evacuation* (shrink only), through the engine: the image is opened read-write
//!    with allocations limited to the part that stays (`Fs::set_alloc_limit`), and
//!    everything in the part that goes is moved by ordinary journaled operations, one
//!    per object: a file's, directory's or symlink's blocks (data copied to the new
//!    blocks first — ordered, so durable before the commit that maps them — then the
//!    extent tree rebuilt over the new blocks in the kept part, old blocks freed), an
//!    xattr block (copied under its new block-number checksum; every inode sharing it
//!    repointed), an inode past the new inode count (record copied to a free number in
//!    the kept groups, its tree and directory blocks re-checksummed for the new
//!    number, every directory entry naming it and its subdirectories' `..` changed,
//!    the old number freed). Block-mapped files (an ext4 converted from ext3) are not
//!    moved: a shrink that would cut one off is refused naming it, and `min` stops
//!    past the last of their blocks. Each move commits whole or not at all, and none changes
//!    the tree (names, contents, attributes): a crash here leaves the old geometry
//!    with the same tree, and a second run finds less to move. Then the engine closes
//!    the image (log checkpointed and empty).
//! 2. *Preparation*, written only where the old filesystem keeps nothing: a grow
//!    extends the file (zeros), then writes the new groups' bitmaps, zeroed inode
//!    tables, backup superblocks and descriptor copies into the new part (and, as
//!    mke2fs would place them with flex_bg, into free blocks of the old last flex
//!    group); a shrink whose journal lies in the part that goes writes the new journal
//!    (its superblock, zeros) into free blocks of the kept part. Flushed. A crash here
//!    leaves the old filesystem as it was.
//! 3. *Switch*: every block of the kept part that the new geometry changes — the
//!    primary superblock, the descriptor blocks (new ones taken from the reserved GDT
//!    blocks on a grow, given back to them on a shrink), the block bitmaps that change
//!    (the old last group extended or the new one cut short, flex_bg tables of removed
//!    groups freed, a moved journal), the resize inode's record, DIND and reserved-GDT
//!    blocks, the journal inode's record and tree when the journal moves, and the backup
//!    superblocks and descriptor copies of the kept backup groups (when they fit) — is
//!    written as ONE jbd2 transaction into the filesystem's own journal: RECOVER is set
//!    in the on-disk superblock first (flushed), then the transaction is committed
//!    (`rext4_jbd2::Log::commit`: blocks, flush, commit block, flush). The commit block
//!    is the atomic point: before it every reader sees the old filesystem (an empty
//!    log); after it every recoverer — rext4's open, e2fsck, the kernel — replays the
//!    whole new geometry.
//! 4. *Checkpoint*: the transaction's blocks are written home — the superblock first
//!    (flushed), then the rest (flushed), and the journal inode's record last (flushed)
//!    when the journal moved (so a recoverer reads the old log, which holds the
//!    transaction, until everything else is home); then the log is emptied and RECOVER
//!    cleared (flushed). A crash here is replayed; replay is idempotent.
//! 5. *Finish*: backups that did not fit in the transaction are written (a stale
//!    backup is never read while the primary is sound, and e2fsck rewrites them), and
//!    a shrink truncates the file. A crash before the truncate leaves the new
//!    filesystem in a longer file (valid: a device may be larger than its filesystem);
//!    running the same resize again truncates it.
//!
//! So there is no state "in between": before step 3's commit the geometry is the old
//! one (with the tree unchanged), after it the new one. The marker of an interrupted
//! switch is the journal itself (RECOVER and the committed transaction), which every
//! reader of ext4 honours; an interrupted evacuation needs no marker (nothing is half
//! done).
//!
//! One limit, shared with the kernel's own online resize: the kernel reads the group
//! descriptors and the journal inode *before* it replays the journal, so a kernel
//! mount that is the first to open an image cut off between step 3's commit and the
//! superblock's home write in step 4 (a window of two device flushes) keeps the old
//! geometry, and a moved journal's old location, until it is unmounted; rext4 and
//! e2fsck replay before they read either. Opening the image with rext4 or e2fsck -p
//! first avoids it.
//!
//! ## Must hold
//! - Nothing outside the filesystem (as it is before or after) is written before the
//!   commit, except blocks the old filesystem does not use; nothing is written after
//!   it except the transaction's own blocks (home), the backups and the truncate.
//! - The new metadata equals what resize2fs writes for the same size (group tables,
//!   flags, counts, the resize inode, `s_reserved_gdt_blocks`, `s_r_blocks_count`
//!   scaled, `s_overhead_clusters` 0), but for the placement of moved blocks and
//!   inodes (ours: the engine's allocator).
//! - Free block and inode counts, in descriptors and superblock, are exact.
//!
//! ## Who calls it, locks
//! The CLI's `rext4 resize`, the Python binding's `rext4.resize`, tests. It runs alone
//! on the image it claimed (no other thread or process uses it), so it takes no lock
//! of its own; the evacuation runs its moves one at a time, each under the engine's
//! write lock (`Fs::write_lock`).

mod evacuate;
mod jmove;
mod layout;
mod plan;
mod raw;
mod switch;

use std::path::Path;
use std::sync::Arc;

use crate::device::{BlockDevice, FileDevice};
use crate::error::{Error, Result};

pub use layout::MAX_BLOCKS_32;

/// What size to resize to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// This many filesystem blocks (rounded as resize2fs rounds a last group too
    /// small for its metadata).
    Blocks(u64),
    /// The smallest size the contents fit in (`resize2fs -M`).
    Min,
}

/// What a resize did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResizeReport {
    /// Block size in bytes.
    pub block_size: u32,
    /// Blocks before and after.
    pub old_blocks: u64,
    pub new_blocks: u64,
    /// Groups before and after.
    pub old_groups: u64,
    pub new_groups: u64,
    /// Blocks and inodes the shrink moved out of the groups it removed.
    pub moved_blocks: u64,
    pub moved_inodes: u64,
    /// Whether the journal moved (a shrink past it).
    pub journal_moved: bool,
    /// Things the caller may want to tell the user (a journal replayed first, ...).
    pub warnings: Vec<String>,
    /// `ResizeOptions::commit_every` as the run used it.
    pub commit_every: u32,
}

/// Resize the unmounted image (or block device) at `path` to `target`: a file grows
/// (sparse) before a grow and is truncated after a shrink; a block device must be
/// large enough. See the module note for what is checked and how a crash is survived.
pub fn resize(path: impl AsRef<Path>, target: Target) -> Result<ResizeReport> {
    resize_with(path, target, &ResizeOptions::default())
}

/// [`resize`] with options.
pub fn resize_with(
    path: impl AsRef<Path>,
    target: Target,
    opts: &ResizeOptions,
) -> Result<ResizeReport> {
    let path = path.as_ref();
    let _claim = crate::claim::Claim::write(path)?;
    let meta = std::fs::metadata(path)?;
    let is_file = meta.file_type().is_file();
    let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(path, false, false)?);
    let (new_blocks, mut report) = prepare(dev.clone(), target)?;
    report.commit_every = opts.commit_every;
    let bs = u64::from(report.block_size);
    let new_bytes = new_blocks
        .checked_mul(bs)
        .ok_or_else(|| Error::InvalidInput("size overflows".into()))?;
    drop(dev);
    if new_bytes > meta.len() {
        if !is_file {
            return Err(Error::InvalidInput(format!(
                "{} is {} bytes: too small for {new_blocks} blocks of {bs} bytes",
                path.display(),
                meta.len()
            )));
        }
        // Sparse: the new part reads as zeros (the grow relies on it for the new
        // groups' inode tables, which it then marks zeroed).
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)?
            .set_len(new_bytes)?;
    }
    let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(path, false, false)?);
    // Blocks the extension made read as zeros.
    let zeroed_from = (is_file && new_bytes > meta.len()).then(|| meta.len().div_ceil(bs));
    let done = run(dev, target, new_blocks, zeroed_from, &mut report)?;
    if is_file && done * bs < std::fs::metadata(path)?.len() {
        let f = std::fs::OpenOptions::new().write(true).open(path)?;
        f.set_len(done * bs)?;
        f.sync_all()?;
    }
    Ok(report)
}

/// Resize the filesystem on `dev`, which is at least as large as the new size and
/// which the caller keeps others away from (no claim is taken, nothing is extended
/// or truncated). Returns what was done; the filesystem then has `new_blocks` blocks.
pub fn resize_device(dev: Arc<dyn BlockDevice>, target: Target) -> Result<ResizeReport> {
    resize_device_with(dev, target, &ResizeOptions::default())
}

/// How a resize runs (the defaults suit every use; tests tune them).
#[derive(Debug, Clone, Default)]
pub struct ResizeOptions {
    /// Commit the shrink's moves every this many (0: when the engine's journal policy
    /// commits, which is rarely for a small image). A crash test sets 1, so that every
    /// move is a state a crash can leave.
    pub commit_every: u32,
}

/// [`resize_device`] with options.
pub fn resize_device_with(
    dev: Arc<dyn BlockDevice>,
    target: Target,
    opts: &ResizeOptions,
) -> Result<ResizeReport> {
    let (new_blocks, mut report) = prepare(dev.clone(), target)?;
    report.commit_every = opts.commit_every;
    let bs = u64::from(report.block_size);
    if new_blocks * bs > dev.size_bytes() {
        return Err(Error::InvalidInput(format!(
            "the device is {} bytes: too small for {new_blocks} blocks of {bs} bytes",
            dev.size_bytes()
        )));
    }
    run(dev, target, new_blocks, None, &mut report)?;
    Ok(report)
}

/// The smallest size (in blocks) the filesystem at `path` can be shrunk to, without
/// changing anything (the image is opened read-only).
pub fn min_size(path: impl AsRef<Path>) -> Result<u64> {
    let fs = crate::Fs::open_with(
        path,
        crate::FsOptions {
            read_only: true,
            ..Default::default()
        },
    )?;
    let sb = fs.superblock();
    let min = plan::min_blocks(&fs)?;
    Ok(min.min(sb.blocks_count))
}

/// The block size of the filesystem at `path` (to read a size given in blocks).
pub fn block_size(path: impl AsRef<Path>) -> Result<u32> {
    let dev = FileDevice::open(path.as_ref(), true, false)?;
    let (_, sb) = crate::journal::read_superblock(&dev)?;
    Ok(sb.block_size())
}

/// Check the image and work out the new size (before anything is written).
fn prepare(dev: Arc<dyn BlockDevice>, target: Target) -> Result<(u64, ResizeReport)> {
    // bigalloc first, from the raw bytes: its geometry (clusters) is one the
    // superblock's decoder rejects as out of range, which would name the wrong cause.
    let mut raw = [0u8; 1024];
    dev.read_at(&mut raw, 1024)?;
    let ro_compat = rext4_format::bytes::le32(&raw, 0x64);
    if rext4_format::bytes::le16(&raw, 0x38) == 0xEF53
        && ro_compat & rext4_format::superblock::feature::RO_COMPAT_BIGALLOC != 0
    {
        return Err(Error::Unsupported(
            "rext4 resize does not resize bigalloc images (clusters larger than a block)".into(),
        ));
    }
    let (_, sb) = crate::journal::read_superblock(dev.as_ref())?;
    switch::check_features(&sb)?;
    // Every descriptor verified before the file is extended for a grow.
    let rw = raw::Raw::open(dev.as_ref())?;
    // The switch and the journal's move read and rewrite the journal's extent tree.
    let (_, journal) = rw.inode(sb.journal_inum)?;
    if !journal.has_flag(rext4_format::inode::flags::EXTENTS) {
        return Err(Error::Unsupported(
            "rext4 resize does not handle a block-mapped journal (one made without the \
             extent feature); recreate it (tune2fs -O ^has_journal, then -j) first"
                .into(),
        ));
    }
    drop(rw);
    let old = sb.blocks_count;
    let new = match target {
        Target::Blocks(n) => layout::adjust_size(&sb, n)?,
        // Worked out with the contents at hand, once the image is open.
        Target::Min => old,
    };
    let report = ResizeReport {
        block_size: sb.block_size(),
        old_blocks: old,
        old_groups: sb.group_count(),
        ..Default::default()
    };
    Ok((new, report))
}

/// Steps 1 to 4 of the module note on `dev` (already as large as `new_blocks` needs).
/// Returns the filesystem's size in blocks afterwards.
fn run(
    dev: Arc<dyn BlockDevice>,
    target: Target,
    new_blocks: u64,
    zeroed_from: Option<u64>,
    report: &mut ResizeReport,
) -> Result<u64> {
    // A size below what the contents need is refused before anything is written
    // (the read-write open below already writes the superblock): measured on a
    // read-only open, which sees a journal that needs recovery replayed in memory.
    if let Target::Blocks(_) = target {
        if new_blocks < report.old_blocks {
            let ro = crate::FsOptions {
                read_only: true,
                ..Default::default()
            };
            let fs = crate::Fs::open_device(dev.clone(), ro)?;
            let needed = plan::min_blocks(&fs)?;
            if new_blocks < needed {
                return Err(too_small(new_blocks, needed, report.block_size));
            }
        }
    }
    // Open read-write through the engine: replays a journal that needs it, finishes
    // orphans, and checks every descriptor.
    let fs = open_rw(&dev, report)?;
    let sb = fs.superblock();
    let mut new_blocks = match target {
        Target::Min => match plan::min_blocks(&fs) {
            Ok(n) => n,
            Err(e) => {
                let _ = fs.close();
                return Err(e);
            }
        },
        Target::Blocks(_) => new_blocks,
    };
    if new_blocks < sb.blocks_count {
        let needed = plan::min_blocks(&fs);
        let needed = match needed {
            Ok(n) => n,
            Err(e) => {
                let _ = fs.close();
                return Err(e);
            }
        };
        if target != Target::Min && new_blocks < needed {
            let _ = fs.close();
            return Err(too_small(new_blocks, needed, sb.block_size()));
        }
        fs.close()?;
        drop(fs);
        // The journal first, with the image closed: the engine logs into it.
        report.journal_moved = {
            let rw = raw::Raw::open(dev.as_ref())?;
            jmove::move_journal(&rw, new_blocks)?
        };
        let fs = open_rw(&dev, report)?;
        let moved = evacuate::evacuate(
            &fs,
            &mut new_blocks,
            target == Target::Min,
            report.commit_every,
        );
        match moved {
            Ok(m) => {
                report.moved_blocks = m.blocks;
                report.moved_inodes = m.inodes;
            }
            Err(e) => {
                let _ = fs.close();
                return Err(e);
            }
        }
        fs.close()?;
    } else {
        fs.close()?;
    }
    if new_blocks == sb.blocks_count {
        report.new_blocks = new_blocks;
        report.new_groups = sb.group_count();
        return Ok(new_blocks);
    }
    let sw = switch::switch(dev.as_ref(), new_blocks, zeroed_from)?;
    report.new_blocks = new_blocks;
    report.new_groups = sw.new_groups;
    Ok(new_blocks)
}

/// Open the image on `dev` read-write through the engine, as the resize needs it.
fn too_small(new_blocks: u64, needed: u64, bs: u32) -> Error {
    Error::InvalidInput(format!(
        "{new_blocks} blocks is smaller than the contents need ({needed} blocks of {bs} \
         bytes)"
    ))
}

fn open_rw(dev: &Arc<dyn BlockDevice>, report: &mut ResizeReport) -> Result<crate::Fs> {
    let opts = crate::FsOptions {
        read_only: false,
        commit_secs: 0,
        prefetch_block_bitmaps: false,
        ..Default::default()
    };
    let fs = crate::Fs::open_device(dev.clone(), opts)?;
    for w in fs.warnings() {
        if !report.warnings.contains(w) {
            report.warnings.push(w.clone());
        }
    }
    if fs.is_read_only() {
        let why = fs.warnings().join("; ");
        let _ = fs.close();
        return Err(Error::Unsupported(format!(
            "the image can only be opened read-only ({why})"
        )));
    }
    if let Err(e) = switch::check_features(&fs.superblock()) {
        let _ = fs.close();
        return Err(e);
    }
    Ok(fs)
}
