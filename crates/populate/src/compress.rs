//! Archives as they come: plain, gzip, zstd or xz, told apart by their first bytes
//! (never by a file name), and decompressed as a stream.
//!
//! Must hold: nothing is buffered whole — a multi-gigabyte layer passes through in
//! small pieces; a stream that ends inside a compressed frame is an error (never a
//! silently shorter archive). Callers: `crate::apply_archive`, the CLI.

use std::io::{self, BufRead, BufReader, Read};

use rext4::{Error, Result};

/// What an archive's first bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
    Xz,
}

const GZIP: &[u8] = &[0x1F, 0x8B];
const ZSTD: &[u8] = &[0x28, 0xB5, 0x2F, 0xFD];
const XZ: &[u8] = &[0xFD, b'7', b'z', b'X', b'Z', 0x00];
const BZIP2: &[u8] = b"BZh";

/// The compression `head` (an archive's first bytes, at least 6 unless it is shorter)
/// starts with; bzip2 is named and refused.
pub fn detect(head: &[u8]) -> Result<Compression> {
    Ok(if head.starts_with(GZIP) {
        Compression::Gzip
    } else if head.starts_with(ZSTD) {
        Compression::Zstd
    } else if head.starts_with(XZ) {
        Compression::Xz
    } else if head.starts_with(BZIP2) {
        return Err(Error::Unsupported(
            "bzip2 archives are not read: decompress it first (bzip2 -dc ARCHIVE | ...)".into(),
        ));
    } else {
        Compression::None
    })
}

/// The archive in `r`, decompressed as its first bytes ask.
pub fn open(r: impl Read + Send + 'static) -> Result<Box<dyn Read + Send>> {
    let mut r = BufReader::with_capacity(1 << 16, r);
    // A pipe may hand over fewer bytes than the magic needs at a time.
    let mut head = [0u8; 6];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let c = detect(&head[..got])?;
    let whole: Box<dyn BufRead + Send> = Box::new(io::Cursor::new(head[..got].to_vec()).chain(r));
    finish(c, whole)
}

fn finish(c: Compression, r: Box<dyn BufRead + Send>) -> Result<Box<dyn Read + Send>> {
    Ok(match c {
        Compression::None => Box::new(r),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(r)),
        Compression::Zstd => Box::new(Zstd::new(r)),
        Compression::Xz => Box::new(Xz::spawn(r)),
    })
}

type ZstdFrame =
    ruzstd::decoding::StreamingDecoder<Box<dyn BufRead + Send>, ruzstd::decoding::FrameDecoder>;

/// Every zstd frame of a stream, one after the other (a decoder reads one frame).
struct Zstd {
    state: ZstdState,
}

enum ZstdState {
    Between(Box<dyn BufRead + Send>),
    In(Box<ZstdFrame>),
    Done,
}

impl Zstd {
    fn new(r: Box<dyn BufRead + Send>) -> Zstd {
        Zstd {
            state: ZstdState::Between(r),
        }
    }
}

fn bad_data(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Read for Zstd {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match std::mem::replace(&mut self.state, ZstdState::Done) {
                ZstdState::Done => return Ok(0),
                ZstdState::Between(mut r) => {
                    if r.fill_buf()?.is_empty() {
                        return Ok(0);
                    }
                    let d = ruzstd::decoding::StreamingDecoder::new(r)
                        .map_err(|e| bad_data(format!("zstd: {e}")))?;
                    self.state = ZstdState::In(Box::new(d));
                }
                ZstdState::In(mut d) => {
                    let n = d.read(buf)?;
                    if n > 0 || buf.is_empty() {
                        self.state = ZstdState::In(d);
                        return Ok(n);
                    }
                    let (r, dec) = d.into_parts();
                    if !dec.is_finished() {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "zstd stream ends inside a frame",
                        ));
                    }
                    self.state = ZstdState::Between(r);
                }
            }
        }
    }
}

/// xz, decoded on a thread of its own (the decoder writes; this side reads) through a
/// bounded channel of chunks, so memory stays small.
struct Xz {
    rx: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    cur: Vec<u8>,
    at: usize,
    done: bool,
}

struct ChanWriter(std::sync::mpsc::SyncSender<io::Result<Vec<u8>>>);

impl io::Write for ChanWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .send(Ok(buf.to_vec()))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "reader gone"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Xz {
    fn spawn(mut r: Box<dyn BufRead + Send>) -> Xz {
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        let spawned = std::thread::Builder::new()
            .name("rext4-xz".into())
            .spawn(move || {
                let mut w = io::BufWriter::with_capacity(1 << 16, ChanWriter(tx.clone()));
                let r = lzma_rs::xz_decompress(&mut r, &mut w)
                    .map_err(|e| bad_data(format!("xz: {e}")))
                    .and_then(|()| io::Write::flush(&mut w));
                drop(w);
                if let Err(e) = r {
                    let _ = tx.send(Err(e));
                }
            });
        let (rx, done) = match spawned {
            Ok(_) => (rx, false),
            Err(e) => {
                let (tx2, rx2) = std::sync::mpsc::sync_channel(1);
                let _ = tx2.send(Err(e));
                (rx2, false)
            }
        };
        Xz {
            rx,
            cur: Vec::new(),
            at: 0,
            done,
        }
    }
}

impl Read for Xz {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.cur.len() {
            if self.done {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(Ok(v)) => {
                    self.cur = v;
                    self.at = 0;
                }
                Ok(Err(e)) => {
                    self.done = true;
                    return Err(e);
                }
                // The decoder finished (its sender dropped).
                Err(_) => {
                    self.done = true;
                    return Ok(0);
                }
            }
        }
        let n = buf.len().min(self.cur.len() - self.at);
        buf[..n].copy_from_slice(&self.cur[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_numbers() {
        assert_eq!(detect(b"\x1f\x8b\x08").ok(), Some(Compression::Gzip));
        assert_eq!(detect(b"\x28\xb5\x2f\xfd\0").ok(), Some(Compression::Zstd));
        assert_eq!(detect(b"\xfd7zXZ\0").ok(), Some(Compression::Xz));
        assert_eq!(detect(b"ustar").ok(), Some(Compression::None));
        assert_eq!(detect(b"").ok(), Some(Compression::None));
        assert!(detect(b"BZh91AY").is_err());
    }
}
