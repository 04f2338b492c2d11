//! # rext4-format: the ext4 and jbd2 on-disk format as a pure library
//!
//! Owns: the byte layout of every on-disk structure rext4 reads or writes, their
//! checksums and the directory hashes. Decoders take `&[u8]` and return a typed value or
//! a [`FormatError`]; encoders write into a caller's buffer. Nothing here does I/O, takes
//! a lock, or makes a policy decision (which block to allocate, when to write).
//!
//! Must hold:
//! - No decoder panics on any byte string: every read goes through the bounds-checked
//!   helpers in [`bytes`], and counts read from disk are checked against the buffer
//!   before they are used as lengths.
//! - ext4 structures are little-endian; jbd2 structures are big-endian and all
//!   big-endian conversions live in [`jbd2`].
//! - Offsets are written as they appear in the format notes, and every fixed-size
//!   structure's size is asserted at compile time.
//!
//! Callers: the engine's buffer cache (verify on read and before write), mkfs, fsck and
//! the tests.
#![forbid(unsafe_code)]

pub mod acl;
pub mod bitmap;
pub mod bytes;
pub mod casefold;
#[rustfmt::skip]
mod casefold_tables;
pub mod csum;
pub mod dir;
pub mod extent;
pub mod fast_commit;
pub mod group;
pub mod hash;
pub mod inline;
pub mod inode;
pub mod jbd2;
pub mod mmp;
pub mod orphan;
pub mod resize;
pub mod superblock;
pub mod xattr;

use std::fmt;

/// Why a structure failed to decode or verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// The structure is damaged: `what` names the failing check. `block` is filled in
    /// by callers that know where the bytes came from (the decoders see only bytes).
    Corrupted { what: String, block: Option<u64> },
    /// The buffer handed to a decoder is shorter than the structure.
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
}

impl FormatError {
    pub fn corrupted(what: impl Into<String>) -> Self {
        FormatError::Corrupted {
            what: what.into(),
            block: None,
        }
    }

    /// Attach the physical block number the bytes were read from.
    pub fn at_block(self, blk: u64) -> Self {
        match self {
            FormatError::Corrupted { what, .. } => FormatError::Corrupted {
                what,
                block: Some(blk),
            },
            other => other,
        }
    }
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Corrupted {
                what,
                block: Some(b),
            } => {
                write!(f, "corrupted metadata at block {b}: {what}")
            }
            FormatError::Corrupted { what, block: None } => write!(f, "corrupted metadata: {what}"),
            FormatError::Truncated { what, need, have } => {
                write!(f, "{what}: need {need} bytes, have {have}")
            }
        }
    }
}

impl std::error::Error for FormatError {}

pub type Result<T> = std::result::Result<T, FormatError>;

/// Fail with `Corrupted` unless `cond` holds.
#[inline]
pub fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(FormatError::corrupted(what()))
    }
}
