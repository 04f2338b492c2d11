//! The engine's error type. errno values appear only at the FUSE/CLI edge, through
//! [`Error::errno`]; inside the engine errors are typed.

use std::fmt;
use std::io;

use rext4_format::FormatError;

#[derive(Debug)]
pub enum Error {
    /// The device failed.
    Io(io::Error),
    /// The device holds no ext4 filesystem (no ext4 magic number in the superblock, or
    /// too small to hold one): another filesystem, zeros or random bytes. The detail
    /// says which. Distinct from [`Error::Corrupted`], which is damage to an ext4
    /// filesystem.
    NotExt4(String),
    /// Metadata failed a check: `what` names it, `block` is where it was read from.
    Corrupted {
        what: String,
        block: Option<u64>,
    },
    /// The image uses features this version cannot handle (names listed).
    Unsupported(String),
    /// The disk image around the filesystem is damaged: a partition table, a qcow2
    /// image's header or tables (the text says what and where). EBADMSG.
    BadImage(String),
    NotFound,
    NotADirectory,
    IsADirectory,
    NotASymlink,
    /// Too many symbolic links while resolving a path.
    Loop,
    NameTooLong,
    InvalidInput(String),
    /// The handle was not opened for this: a write or `set_len` on one opened only for
    /// reading, a read on one opened only for writing (EBADF, as std's `File`).
    NotOpenFor(&'static str),
    /// The filesystem is open read-only.
    ReadOnly,
    /// The name exists already (EEXIST).
    Exists,
    /// A directory to remove or replace is not empty (ENOTEMPTY).
    NotEmpty,
    /// No free blocks or inodes (ENOSPC).
    NoSpace,
    /// Too many hard links (EMLINK).
    TooManyLinks,
    /// The file would exceed ext4's maximum size (EFBIG).
    FileTooLarge,
    /// The operation is not permitted on this object (EPERM).
    NotPermitted(String),
    /// The caller's credentials do not grant the access (EACCES).
    PermissionDenied,
    /// A journal or device write failed earlier; the filesystem is shut down (EIO).
    ShutDown(String),
    /// The image is used by someone else (a loop device, a mount, another rext4
    /// process), who is named (EBUSY; see `claim`).
    InUse(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn corrupted(what: impl Into<String>, block: Option<u64>) -> Self {
        Error::Corrupted {
            what: what.into(),
            block,
        }
    }

    /// The POSIX errno for this error (for frontends).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io(e) => e.raw_os_error().unwrap_or(5),
            Error::Corrupted { .. } => 74, // EBADMSG, as the kernel reports checksum errors
            Error::NotExt4(_) => 22,       // EINVAL, as mount(2) of the wrong type
            Error::Unsupported(_) => 95,   // EOPNOTSUPP
            Error::BadImage(_) => 74,      // EBADMSG, as corruption
            Error::NotFound => 2,
            Error::NotADirectory => 20,
            Error::IsADirectory => 21,
            Error::NotASymlink | Error::InvalidInput(_) => 22,
            Error::NotOpenFor(_) => 9,
            Error::Loop => 40,
            Error::NameTooLong => 36,
            Error::ReadOnly => 30,
            Error::Exists => 17,
            Error::NotEmpty => 39,
            Error::NoSpace => 28,
            Error::TooManyLinks => 31,
            Error::FileTooLarge => 27,
            Error::NotPermitted(_) => 1,
            Error::PermissionDenied => 13,
            Error::ShutDown(_) => 5,
            Error::InUse(_) => 16,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "I/O error: {e}"),
            Error::NotExt4(why) => write!(f, "not an ext4 filesystem ({why})"),
            Error::Corrupted {
                what,
                block: Some(b),
            } => {
                write!(f, "corrupted filesystem: {what} (block {b})")
            }
            Error::Corrupted { what, block: None } => write!(f, "corrupted filesystem: {what}"),
            Error::Unsupported(s) => write!(f, "unsupported: {s}"),
            Error::BadImage(s) => write!(f, "damaged disk image: {s}"),
            Error::NotFound => write!(f, "no such file or directory"),
            Error::NotADirectory => write!(f, "not a directory"),
            Error::IsADirectory => write!(f, "is a directory"),
            Error::NotASymlink => write!(f, "not a symbolic link"),
            Error::Loop => write!(f, "too many levels of symbolic links"),
            Error::NameTooLong => write!(f, "file name too long"),
            Error::InvalidInput(s) => write!(f, "invalid argument: {s}"),
            Error::NotOpenFor(what) => write!(f, "bad file descriptor: not open for {what}"),
            Error::ReadOnly => write!(f, "read-only filesystem"),
            Error::Exists => write!(f, "file exists"),
            Error::NotEmpty => write!(f, "directory not empty"),
            Error::NoSpace => write!(f, "no space left on device"),
            Error::TooManyLinks => write!(f, "too many links"),
            Error::FileTooLarge => write!(f, "file too large"),
            Error::NotPermitted(s) => write!(f, "operation not permitted: {s}"),
            Error::PermissionDenied => write!(f, "permission denied"),
            Error::ShutDown(s) => write!(f, "filesystem shut down after an error ({s})"),
            Error::InUse(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<FormatError> for Error {
    fn from(e: FormatError) -> Self {
        match e {
            FormatError::Corrupted { what, block } => Error::Corrupted { what, block },
            t @ FormatError::Truncated { .. } => Error::Corrupted {
                what: t.to_string(),
                block: None,
            },
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) => e,
            other => io::Error::from_raw_os_error(other.errno()),
        }
    }
}

/// Attach a block number to a format error.
pub(crate) trait AtBlock<T> {
    fn at(self, block: u64) -> Result<T>;
}

impl<T> AtBlock<T> for std::result::Result<T, FormatError> {
    fn at(self, block: u64) -> Result<T> {
        self.map_err(|e| Error::from(e.at_block(block)))
    }
}

impl From<rext4_jbd2::Error> for Error {
    fn from(e: rext4_jbd2::Error) -> Self {
        match e {
            rext4_jbd2::Error::Io(e) => Error::Io(e),
            rext4_jbd2::Error::Format(e) => Error::from(e),
            rext4_jbd2::Error::Corrupted { what, block } => Error::Corrupted { what, block },
            rext4_jbd2::Error::Unsupported(m) => Error::Unsupported(m),
            rext4_jbd2::Error::InvalidInput(m) => Error::InvalidInput(m),
        }
    }
}
