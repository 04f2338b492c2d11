//! The file a qcow2 image lives in, as the qcow2 layer uses it: reads that may stop at
//! its end, writes that may extend it, a sync, and holes punched for freed clusters.
//! A trait rather than `std::fs::File` so tests can record every write and sync of
//! the image file (the crash sweep builds crash images of the qcow2 file from them).

use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// The host file of a qcow2 image.
pub trait HostFile: Send + Sync {
    /// Read into `buf` from `offset`; returns the bytes read (fewer than `buf.len()`
    /// only at the end of the file; those are initialized, the rest is untouched).
    fn read_at(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<usize>;
    /// Write all of `buf` at `offset`, extending the file if it ends before.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Make every completed write (and the file's length) durable.
    fn sync(&self) -> io::Result<()>;
    /// The file's length in bytes.
    fn len_bytes(&self) -> io::Result<u64>;
    /// Give `[offset, offset + len)` back to the host's filesystem; it reads zeros
    /// afterwards or keeps its bytes (a host that cannot punch holes). Never changes
    /// the file's length.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()>;
}

impl HostFile for File {
    fn read_at(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<usize> {
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: pread writes at most `rest.len()` bytes into `rest`, ours for the
            // call; the kernel never reads the destination.
            let r = unsafe {
                libc::pread(
                    self.as_raw_fd(),
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                    (offset + done as u64) as libc::off_t,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                break;
            }
            done += r as usize;
        }
        Ok(done)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        // fdatasync: the data and the length needed to read it back.
        self.sync_data()
    }

    fn len_bytes(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate(2) on our descriptor with plain integers.
        let r = unsafe {
            libc::fallocate(
                self.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        // A host filesystem without holes keeps the bytes: the cluster is free all
        // the same, only the space stays taken.
        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            return Ok(());
        }
        Err(e)
    }
}

/// Fill all of `buf` from `offset`; a file that ends before is `UnexpectedEof`.
pub(crate) fn read_exact(host: &dyn HostFile, buf: &mut [u8], offset: u64) -> io::Result<()> {
    // SAFETY: `read_at` writes only initialized bytes.
    let n = host.read_at(unsafe { super::super::as_uninit(buf) }, offset)?;
    if n < buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "qcow2 image file ends at {} (reading {} bytes at {offset})",
                offset + n as u64,
                buf.len()
            ),
        ));
    }
    Ok(())
}
