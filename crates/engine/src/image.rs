//! Image specs: which bytes of what hold the filesystem. A disk image as people have
//! it is more than an ext4 image at offset 0: a partition table first (GPT, MBR with
//! logical partitions), often a qcow2 file, and later images on other machines.
//!
//! Owns: [`ImageSpec`] (text form `PATH[?KEY=VALUE[&KEY=VALUE...]]`), [`open_device`]
//! (the spec as a [`BlockDevice`]) and [`inspect`] (what a disk holds, for `rext4
//! info DISK`). Callers: `Fs::open_spec` / `Fs::open_with`, the CLI, the mount, the
//! bindings.
//!
//! Fields: `partition=N` (numbered as Linux numbers them: GPT by entry slot, MBR
//! primary 1-4 and logical from 5), `offset=BYTES` (a multiple of 512) with optional
//! `size=BYTES` (K/M/G/T suffixes are powers of 1024), `format=raw|qcow2|auto`
//! (default auto: a qcow2 image is found by its magic; partition and offset then
//! apply to the qcow2's guest disk). Errors name the field and what is wrong.
//!
//! Plain paths stay plain: [`ImageSpec::file`] (and `Fs::open_with`) take a path as it
//! is, '?' and all. Text from a user goes through [`ImageSpec::from_arg`]: a text that
//! names an existing file is that file; otherwise it splits at its *last* '?', so a
//! file named `a?b.img` is reached with `a?b.img` (it exists) and its partition 1 with
//! `a?b.img?partition=1`.
//!
//! NBD exports ([`Source::Nbd`], `crate::device::nbd`): `nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH` and their TLS forms `nbds://`, `nbds+unix://`, as
//! the NBD URI standard writes them (its `socket=` and `tls-*` fields go to libnbd);
//! rext4's fields join them in the query (`partition=`, `offset=`, `size=`, and
//! `connections=N`, `timeout=SECONDS` for the NBD device). The URI is checked here
//! field by field (scheme, host, port, socket) before any connection is tried. An
//! export is a raw disk: a qcow2 is served decoded (qemu-nbd -f qcow2). `rbd:` specs
//! are refused by name (not supported yet).
//!
//! Claims (`crate::claim`) are taken by the caller on [`ImageSpec::local_file`], the
//! whole file: two writers of different partitions of one disk image are refused (the
//! claim is a flock on the file and a check of its loop devices, neither range-aware).
//! A network source has no file to claim: the server and multi-mount protection
//! (`crate::mmp`, on images made with it) keep other writers out.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::device::parttable::{self, Table};
use crate::device::window::Window;
use crate::device::{BlockDevice, FileDevice};
use crate::error::{Error, Result};

/// Where the bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// An image file or a block device.
    File(PathBuf),
    /// The export of an NBD server.
    Nbd(NbdSource),
}

/// An NBD export: `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`
/// (and their TLS forms `nbds://`, `nbds+unix://`), as the NBD URI standard writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdSource {
    /// The URI libnbd connects to: the spec's text without rext4's own fields.
    pub uri: String,
    /// `connections=N`: connections at most (used when the server allows several).
    pub connections: Option<usize>,
    /// `timeout=SECONDS`: how long one request may take before the device fails.
    pub timeout_secs: Option<u64>,
}

impl NbdSource {
    /// What the device is opened with.
    pub fn options(&self) -> crate::device::nbd::NbdOptions {
        let mut o = crate::device::nbd::NbdOptions::new(self.uri.clone());
        if let Some(n) = self.connections {
            o.connections = n;
        }
        if let Some(t) = self.timeout_secs {
            o.timeout = std::time::Duration::from_secs(t);
        }
        o
    }
}

/// The URI schemes of NBD specs.
const NBD_SCHEMES: [&str; 4] = ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"];

/// The container format of the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// qcow2 when the first bytes are its magic, else raw.
    #[default]
    Auto,
    Raw,
    Qcow2,
}

/// Which part of the (guest) disk holds the filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Part {
    #[default]
    Whole,
    /// Partition N of the disk's table.
    Partition(u32),
    /// `size` bytes (`None`: to the end) from `offset`.
    Range { offset: u64, size: Option<u64> },
}

/// An image to open: a source, its format and the part that holds the filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    pub source: Source,
    pub format: Format,
    pub part: Part,
}

/// The sector size offsets must be a multiple of (partition tables count in it too).
pub const SECTOR: u64 = 512;

impl ImageSpec {
    /// The file or block device at `path`, whole, format found by magic.
    pub fn file(path: impl Into<PathBuf>) -> ImageSpec {
        ImageSpec {
            source: Source::File(path.into()),
            format: Format::Auto,
            part: Part::Whole,
        }
    }

    /// A spec as a user writes it: `text` naming an existing file is that file (so
    /// names with '?' work), else [`ImageSpec::parse`].
    pub fn from_arg(text: &str) -> Result<ImageSpec> {
        if Path::new(text).exists() {
            return Ok(ImageSpec::file(text));
        }
        ImageSpec::parse(text)
    }

    /// Parse `PATH[?FIELD=VALUE[&FIELD=VALUE...]]`, splitting at the last '?', or an
    /// NBD URI (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`) whose
    /// query may hold rext4's fields beside the URI's own.
    pub fn parse(text: &str) -> Result<ImageSpec> {
        let bad = |m: String| Error::InvalidInput(format!("image spec '{text}': {m}"));
        if let Some(scheme) = NBD_SCHEMES.iter().find(|s| text.starts_with(**s)) {
            return parse_nbd(text, scheme);
        }
        for scheme in ["nbd+", "nbds+", "rbd:"] {
            if text.starts_with(scheme) {
                return Err(Error::Unsupported(format!(
                    "image spec '{text}': {} images are not supported yet",
                    text.split(['/', ':']).next().unwrap_or(scheme)
                )));
            }
        }
        let (path, query) = match text.rfind('?') {
            Some(i) => (&text[..i], Some(&text[i + 1..])),
            None => (text, None),
        };
        if path.is_empty() {
            return Err(bad("no image path before '?'".into()));
        }
        let mut spec = ImageSpec::file(path);
        let Some(query) = query else {
            return Ok(spec);
        };
        let f = Fields::parse(query, &bad, |_, _| Ok(false))?;
        f.apply(&mut spec, &bad)?;
        Ok(spec)
    }

    /// The file the spec reads (the one to claim); for a network source, its URI as
    /// text (no file: see [`ImageSpec::local_file`]).
    pub fn path(&self) -> &Path {
        match &self.source {
            Source::File(p) => p,
            Source::Nbd(n) => Path::new(&n.uri),
        }
    }

    /// The file or block device on this machine the spec reads, if it is one (not a
    /// network source): the one to claim, stat or canonicalize.
    pub fn local_file(&self) -> Option<&Path> {
        match &self.source {
            Source::File(p) => Some(p),
            Source::Nbd(_) => None,
        }
    }

    /// The same spec over another path (e.g. made absolute); a network source stays.
    pub fn with_path(&self, path: impl Into<PathBuf>) -> ImageSpec {
        match self.source {
            Source::File(_) => ImageSpec {
                source: Source::File(path.into()),
                ..self.clone()
            },
            Source::Nbd(_) => self.clone(),
        }
    }

    /// A whole file, format by magic: what `Fs::open_with` opens.
    pub fn is_plain(&self) -> bool {
        self.part == Part::Whole && self.format == Format::Auto
    }
}

/// `PATH?partition=2`, `PATH?offset=1048576&size=...`: text [`ImageSpec::parse`] reads
/// back (the path shown as it is).
impl fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path().display())?;
        let mut fields = Vec::new();
        if let Source::Nbd(n) = &self.source {
            if let Some(c) = n.connections {
                fields.push(format!("connections={c}"));
            }
            if let Some(t) = n.timeout_secs {
                fields.push(format!("timeout={t}"));
            }
        }
        match self.part {
            Part::Whole => {}
            Part::Partition(n) => fields.push(format!("partition={n}")),
            Part::Range { offset, size } => {
                fields.push(format!("offset={offset}"));
                if let Some(s) = size {
                    fields.push(format!("size={s}"));
                }
            }
        }
        match self.format {
            Format::Auto => {}
            Format::Raw => fields.push("format=raw".into()),
            Format::Qcow2 => fields.push("format=qcow2".into()),
        }
        if !fields.is_empty() {
            let sep = if matches!(self.source, Source::Nbd(_)) && self.path_has_query() {
                '&'
            } else {
                '?'
            };
            write!(f, "{sep}{}", fields.join("&"))?;
        }
        Ok(())
    }
}

impl ImageSpec {
    /// Whether the source's text already has a '?' query (an NBD URI's own fields).
    fn path_has_query(&self) -> bool {
        match &self.source {
            Source::Nbd(n) => n.uri.contains('?'),
            Source::File(_) => false,
        }
    }
}

/// rext4's fields of a spec's query (`partition=`, `offset=`, `size=`, `format=`).
#[derive(Default)]
struct Fields {
    partition: Option<u32>,
    offset: Option<u64>,
    size: Option<u64>,
    format: Option<Format>,
}

impl Fields {
    /// Read `query` (`K=V&K=V...`); `other(k, v)` takes fields of the source's own
    /// (`Ok(true)`: taken), the rest are rext4's or refused by name.
    fn parse(
        query: &str,
        bad: &dyn Fn(String) -> Error,
        mut other: impl FnMut(&str, &str) -> Result<bool>,
    ) -> Result<Fields> {
        let mut f = Fields::default();
        for field in query.split('&') {
            let Some((k, v)) = field.split_once('=') else {
                return Err(bad(format!(
                    "field '{field}' has no value (expected FIELD=VALUE: partition=N, \
                     offset=BYTES, size=BYTES or format=raw|qcow2)"
                )));
            };
            if v.is_empty() {
                return Err(bad(format!("field '{k}' has an empty value")));
            }
            let dup = |set: bool| {
                if set {
                    Err(bad(format!("field '{k}' is given twice")))
                } else {
                    Ok(())
                }
            };
            match k {
                "partition" => {
                    dup(f.partition.is_some())?;
                    let n: u32 = v
                        .parse()
                        .map_err(|_| bad(format!("partition '{v}' is not a partition number")))?;
                    if n == 0 {
                        return Err(bad("partitions are numbered from 1".into()));
                    }
                    f.partition = Some(n);
                }
                "offset" => {
                    dup(f.offset.is_some())?;
                    let o = parse_bytes(v)
                        .ok_or_else(|| bad(format!("offset '{v}' is not a byte count")))?;
                    if !o.is_multiple_of(SECTOR) {
                        return Err(bad(format!("offset {o} is not a multiple of {SECTOR}")));
                    }
                    f.offset = Some(o);
                }
                "size" => {
                    dup(f.size.is_some())?;
                    let s = parse_bytes(v)
                        .ok_or_else(|| bad(format!("size '{v}' is not a byte count")))?;
                    if s == 0 {
                        return Err(bad("size 0 holds no filesystem".into()));
                    }
                    f.size = Some(s);
                }
                "format" => {
                    dup(f.format.is_some())?;
                    f.format = Some(match v {
                        "raw" => Format::Raw,
                        "qcow2" => Format::Qcow2,
                        "auto" => Format::Auto,
                        _ => {
                            return Err(bad(format!(
                                "format '{v}' is unknown (raw, qcow2 or auto)"
                            )))
                        }
                    });
                }
                _ => {
                    if !other(k, v)? {
                        return Err(bad(format!(
                            "unknown field '{k}' (known: partition, offset, size, format)"
                        )));
                    }
                }
            }
        }
        Ok(f)
    }

    fn apply(self, spec: &mut ImageSpec, bad: &dyn Fn(String) -> Error) -> Result<()> {
        if self.partition.is_some() && (self.offset.is_some() || self.size.is_some()) {
            return Err(bad("partition= and offset=/size= exclude each other".into()));
        }
        spec.format = self.format.unwrap_or_default();
        spec.part = match (self.partition, self.offset, self.size) {
            (Some(n), _, _) => Part::Partition(n),
            (None, None, None) => Part::Whole,
            (None, o, s) => Part::Range {
                offset: o.unwrap_or(0),
                size: s,
            },
        };
        Ok(())
    }
}

/// An NBD URI (`scheme` is one of [`NBD_SCHEMES`]): checked field by field, so a bad
/// one is refused here, by name, before any connection is tried.
fn parse_nbd(text: &str, scheme: &str) -> Result<ImageSpec> {
    let bad = |m: String| Error::InvalidInput(format!("image spec '{text}': {m}"));
    let unix = scheme.contains("+unix");
    let rest = &text[scheme.len()..];
    let (before_query, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    if before_query.contains('#') {
        return Err(bad("NBD URIs have no '#' fragment".into()));
    }
    let (authority, export) = match before_query.find('/') {
        Some(i) => (&before_query[..i], &before_query[i..]),
        None => (before_query, ""),
    };
    if unix {
        if !authority.is_empty() {
            return Err(bad(format!(
                "an nbd+unix URI names no host ('{authority}'): write {scheme}/EXPORT?socket=PATH"
            )));
        }
    } else {
        if authority.is_empty() {
            return Err(bad(format!("no server: write {scheme}HOST[:PORT]/EXPORT")));
        }
        let (host, port) = if let Some(r) = authority.strip_prefix('[') {
            match r.split_once(']') {
                Some((h, p)) => (h, p.strip_prefix(':').map(Some).unwrap_or(None)),
                None => return Err(bad("unclosed '[' in the IPv6 address".into())),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no server name before the port".into()));
        }
        if host.contains('@') {
            return Err(bad("user names in NBD URIs are not supported".into()));
        }
        if let Some(p) = port {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => {}
                _ => return Err(bad(format!("port '{p}' is not a port number (1-65535)"))),
            }
        }
    }
    let mut socket = None;
    let mut passed = Vec::new();
    let (mut connections, mut timeout) = (None, None);
    let fields = match query {
        None => Fields::default(),
        Some(q) => Fields::parse(q, &bad, |k, v| {
            match k {
                "socket" if unix => {
                    if socket.replace(v.to_string()).is_some() {
                        return Err(bad("field 'socket' is given twice".into()));
                    }
                    passed.push(format!("{k}={v}"));
                }
                "socket" => {
                    return Err(bad("socket= is for nbd+unix:// URIs".into()));
                }
                "connections" => {
                    let n: usize = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=crate::device::nbd::MAX_CONNECTIONS).contains(n))
                        .ok_or_else(|| {
                            bad(format!(
                                "connections '{v}' is not a number from 1 to {}",
                                crate::device::nbd::MAX_CONNECTIONS
                            ))
                        })?;
                    connections = Some(n);
                }
                "timeout" => {
                    let t: u64 = v
                        .parse()
                        .ok()
                        .filter(|t| (1..=86_400).contains(t))
                        .ok_or_else(|| {
                            bad(format!(
                                "timeout '{v}' is not a number of seconds (1-86400)"
                            ))
                        })?;
                    timeout = Some(t);
                }
                _ if k.starts_with("tls-") => passed.push(format!("{k}={v}")),
                _ => {
                    return Err(bad(format!(
                        "unknown field '{k}' (known: socket, tls-*, connections, timeout, \
                         partition, offset, size, format)"
                    )))
                }
            }
            Ok(true)
        })?,
    };
    if unix && socket.is_none() {
        return Err(bad("an nbd+unix URI needs ?socket=PATH".into()));
    }
    if fields.format == Some(Format::Qcow2) {
        return Err(bad(
            "qcow2 is read from image files; serve a qcow2 over NBD decoded \
             (qemu-nbd -f qcow2, nbdkit's qcow2dec filter)"
                .into(),
        ));
    }
    let mut uri = format!("{scheme}{authority}{export}");
    if !passed.is_empty() {
        uri = format!("{uri}?{}", passed.join("&"));
    }
    let mut spec = ImageSpec {
        source: Source::Nbd(NbdSource {
            uri,
            connections,
            timeout_secs: timeout,
        }),
        format: Format::Auto,
        part: Part::Whole,
    };
    fields.apply(&mut spec, &bad)?;
    Ok(spec)
}

/// A byte count, optionally with a K, M, G or T suffix (powers of 1024).
fn parse_bytes(v: &str) -> Option<u64> {
    let (num, mult) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 1u64 << 10),
        b'm' | b'M' => (&v[..v.len() - 1], 1 << 20),
        b'g' | b'G' => (&v[..v.len() - 1], 1 << 30),
        b't' | b'T' => (&v[..v.len() - 1], 1 << 40),
        _ => (v, 1),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    num.parse::<u64>().ok()?.checked_mul(mult)
}

/// The qcow2 magic, "QFI\xfb".
pub const QCOW2_MAGIC: [u8; 4] = crate::device::qcow2::MAGIC;

/// The disk the spec names, before its part is taken: the file, or the guest disk
/// of a qcow2 file. `direct` (O_DIRECT) applies to a raw file.
fn open_disk(
    spec: &ImageSpec,
    read_only: bool,
    direct: bool,
) -> Result<(Arc<dyn BlockDevice>, &'static str)> {
    let path = match &spec.source {
        Source::File(p) => p,
        Source::Nbd(n) => {
            let dev = crate::device::nbd::NbdDevice::open(&n.options(), read_only)?;
            let mut magic = [0u8; 4];
            if spec.format == Format::Auto && dev.size_bytes() >= 4 {
                dev.read_at(&mut magic, 0)?;
                if magic == QCOW2_MAGIC {
                    return Err(Error::Unsupported(format!(
                        "{}: the NBD export holds a qcow2 image; serve it decoded \
                         (qemu-nbd -f qcow2, nbdkit's qcow2dec filter)",
                        n.uri
                    )));
                }
            }
            return Ok((Arc::new(dev), "nbd"));
        }
    };
    let file = FileDevice::open(path, read_only, direct)?;
    let mut magic = [0u8; 4];
    let is_qcow2 = file.size_bytes() >= 4 && {
        file.read_at(&mut magic, 0)?;
        magic == QCOW2_MAGIC
    };
    match (spec.format, is_qcow2) {
        (Format::Raw, _) | (Format::Auto, false) => Ok((Arc::new(file), "raw")),
        (Format::Qcow2, false) => Err(Error::BadImage(format!(
            "{}: not a qcow2 image (no qcow2 magic number)",
            path.display()
        ))),
        (Format::Qcow2 | Format::Auto, true) => {
            drop(file);
            let q = crate::device::qcow2::Qcow2::open(path, read_only)?;
            Ok((q, "qcow2"))
        }
    }
}

/// The spec's part of `disk`.
fn take_part(spec: &ImageSpec, disk: Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>> {
    let size = disk.size_bytes();
    match spec.part {
        Part::Whole => Ok(disk),
        Part::Range { offset, size: len } => {
            if offset >= size {
                return Err(Error::InvalidInput(format!(
                    "image spec '{spec}': offset {offset} is past the end of the \
                     {size}-byte disk"
                )));
            }
            let len = len.unwrap_or(size - offset);
            let w = Window::new(disk, offset, len)
                .map_err(|e| Error::InvalidInput(format!("image spec '{spec}': {e}")))?;
            Ok(Arc::new(w))
        }
        Part::Partition(n) => {
            let table = read_table(&*disk)?.ok_or_else(|| {
                Error::InvalidInput(format!(
                    "image spec '{spec}': the disk has no partition table (neither MBR nor \
                     GPT)"
                ))
            })?;
            let p = table
                .get(n)
                .map_err(|m| Error::InvalidInput(format!("image spec '{spec}': {m}")))?;
            if p.start_bytes
                .checked_add(p.size_bytes)
                .is_none_or(|e| e > size)
            {
                return Err(Error::BadImage(format!(
                    "{}: partition {n} (bytes {}..{}) ends past the end of the {size}-byte \
                     disk",
                    spec.path().display(),
                    p.start_bytes,
                    p.start_bytes.saturating_add(p.size_bytes)
                )));
            }
            Ok(Arc::new(Window::new(disk, p.start_bytes, p.size_bytes)?))
        }
    }
}

/// The partition table of `disk`, if it has one; a damaged one is [`Error::BadImage`].
pub fn read_table(disk: &dyn BlockDevice) -> Result<Option<Table>> {
    let read = |off: u64, buf: &mut [u8]| disk.read_at(buf, off);
    parttable::read_table(disk.size_bytes(), &read).map_err(|e| {
        if e.kind() == std::io::ErrorKind::InvalidData {
            Error::BadImage(e.to_string())
        } else {
            Error::Io(e)
        }
    })
}

/// The device holding the filesystem the spec names (not claimed: the caller claims
/// [`ImageSpec::path`] first). `direct` asks for O_DIRECT on a raw file.
pub fn open_device(
    spec: &ImageSpec,
    read_only: bool,
    direct: bool,
) -> Result<Arc<dyn BlockDevice>> {
    let (disk, _) = open_disk(spec, read_only, direct)?;
    take_part(spec, disk)
}

/// What a disk holds, for `rext4 info DISK`.
pub struct DiskInfo {
    /// "raw", "qcow2" or "nbd".
    pub format: &'static str,
    /// The (guest) disk, read-only.
    pub disk: Arc<dyn BlockDevice>,
    /// Its partition table, if any.
    pub table: Option<Table>,
}

/// Open the disk a spec names, read-only, whole (its part ignored), with its table.
pub fn inspect(spec: &ImageSpec) -> Result<DiskInfo> {
    let (disk, format) = open_disk(spec, true, false)?;
    let table = read_table(&*disk)?;
    Ok(DiskInfo {
        format,
        disk,
        table,
    })
}

/// A hint for an open of a whole disk that found no ext4: the partitions to open
/// instead, when it has a table.
pub(crate) fn partition_hint(disk: &dyn BlockDevice) -> Option<String> {
    let t = read_table(disk).ok()??;
    let kind = match t.kind {
        parttable::TableKind::Mbr => "an MBR",
        parttable::TableKind::Gpt => "a GPT",
    };
    let nums: Vec<String> = t.partitions.iter().map(|p| p.number.to_string()).collect();
    Some(format!(
        "the disk has {kind} partition table (partitions {}): open one as \
         IMAGE?partition=N; `rext4 info IMAGE` lists them",
        if nums.is_empty() {
            "none".into()
        } else {
            nums.join(", ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_and_round_trips() {
        let s = ImageSpec::parse("d.img?partition=2").expect("ok");
        assert_eq!(s.part, Part::Partition(2));
        assert_eq!(s.to_string(), "d.img?partition=2");
        let s = ImageSpec::parse("d.img?offset=1M&size=4096&format=raw").expect("ok");
        assert_eq!(
            s.part,
            Part::Range {
                offset: 1 << 20,
                size: Some(4096)
            }
        );
        assert_eq!(s.format, Format::Raw);
        assert_eq!(ImageSpec::parse(&s.to_string()).expect("again"), s);
        // Split at the last '?'.
        let s = ImageSpec::parse("a?b.img?partition=1").expect("ok");
        assert_eq!(s.path(), Path::new("a?b.img"));
        assert_eq!(
            ImageSpec::parse("plain.img").expect("ok"),
            ImageSpec::file("plain.img")
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let err = |t: &str| ImageSpec::parse(t).expect_err(t).to_string();
        assert!(err("d.img?offset=4097").contains("offset 4097 is not a multiple of 512"));
        assert!(err("d.img?partition=x").contains("partition 'x'"));
        assert!(err("d.img?partition=0").contains("from 1"));
        assert!(err("d.img?colour=red").contains("unknown field 'colour'"));
        assert!(err("d.img?partition=1&partition=2").contains("twice"));
        assert!(err("d.img?partition").contains("no value"));
        assert!(err("d.img?partition=1&offset=0").contains("exclude"));
        assert!(err("d.img?format=vmdk").contains("format 'vmdk'"));
        assert!(err("?partition=1").contains("no image path"));
        assert!(err("rbd:pool/image").contains("not supported yet"));
        assert!(err("d.img?size=99999999999999999999T").contains("size"));
    }

    #[test]
    fn nbd_uris_parse_and_round_trip() {
        let nbd = |t: &str| match ImageSpec::parse(t).expect(t) {
            ImageSpec {
                source: Source::Nbd(n),
                format,
                part,
            } => (n, format, part),
            s => panic!("{t}: {s:?}"),
        };
        let (n, f, p) = nbd("nbd://example.com/disk");
        assert_eq!(n.uri, "nbd://example.com/disk");
        assert_eq!((f, p), (Format::Auto, Part::Whole));
        assert_eq!(nbd("nbd://10.0.0.1:10809/").0.uri, "nbd://10.0.0.1:10809/");
        assert_eq!(nbd("nbd://[::1]:10809/e").0.uri, "nbd://[::1]:10809/e");
        assert_eq!(nbd("nbd://h").0.uri, "nbd://h");
        let (n, _, p) =
            nbd("nbd+unix:///exp?socket=/run/s.sock&partition=2&connections=2&timeout=5");
        assert_eq!(n.uri, "nbd+unix:///exp?socket=/run/s.sock");
        assert_eq!((n.connections, n.timeout_secs), (Some(2), Some(5)));
        assert_eq!(p, Part::Partition(2));
        // rext4's fields come back after the URI's own.
        let s = ImageSpec::parse("nbd+unix:///exp?socket=/run/s.sock&partition=2&timeout=5")
            .expect("ok");
        assert_eq!(
            s.to_string(),
            "nbd+unix:///exp?socket=/run/s.sock&timeout=5&partition=2"
        );
        assert_eq!(ImageSpec::parse(&s.to_string()).expect("again"), s);
        let s = ImageSpec::parse("nbd://h/e?offset=1M").expect("ok");
        assert_eq!(s.to_string(), "nbd://h/e?offset=1048576");
        assert_eq!(ImageSpec::parse(&s.to_string()).expect("again"), s);
        assert_eq!(s.local_file(), None);
        // TLS fields go to libnbd.
        assert_eq!(
            nbd("nbds://h/e?tls-certificates=/etc/pki").0.uri,
            "nbds://h/e?tls-certificates=/etc/pki"
        );
    }

    #[test]
    fn bad_nbd_uris_are_named() {
        let err = |t: &str| ImageSpec::parse(t).expect_err(t).to_string();
        assert!(err("nbd:///e").contains("no server"));
        assert!(err("nbd://:10809/e").contains("no server name"));
        assert!(err("nbd://h:0/e").contains("port '0'"));
        assert!(err("nbd://h:x/e").contains("port 'x'"));
        assert!(err("nbd://h:65536/e").contains("port '65536'"));
        assert!(err("nbd://[::1/e").contains("unclosed '['"));
        assert!(err("nbd://u@h/e").contains("user names"));
        assert!(err("nbd+unix:///e").contains("needs ?socket=PATH"));
        assert!(err("nbd+unix://h/e?socket=/s").contains("names no host"));
        assert!(err("nbd://h/e?socket=/s").contains("for nbd+unix"));
        assert!(err("nbd+unix:///e?socket=/s&socket=/t").contains("twice"));
        assert!(err("nbd://h/e?colour=red").contains("unknown field 'colour'"));
        assert!(err("nbd://h/e?connections=0").contains("connections '0'"));
        assert!(err("nbd://h/e?connections=99").contains("connections '99'"));
        assert!(err("nbd://h/e?timeout=never").contains("timeout 'never'"));
        assert!(err("nbd://h/e?format=qcow2").contains("qcow2"));
        assert!(err("nbd://h/e#frag").contains("fragment"));
        assert!(err("nbd://h/e?partition=1&offset=0").contains("exclude"));
        assert!(err("nbd+vsock:///e").contains("not supported"));
    }
}
