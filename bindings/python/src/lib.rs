//! `rext4._rext4`: the native half of the Python package (PyO3, abi3).
//!
//! Owns: one Python class per engine handle ([`PyFs`] over `rext4::Fs`, [`PyFile`]
//! over `rext4::File`) and the mapping of `rext4::Error` to Python exceptions. Paths
//! arrive as bytes (the Python half calls `os.fsencode`) and are image paths; names
//! go back as bytes. Everything shaped like `os`/`pathlib` (stat results, scandir,
//! walk, `io.RawIOBase` files, copy_in/copy_out) lives in `python/rext4/__init__.py`.
//!
//! Must hold: every call that may touch the image runs with the GIL released
//! (`py.allow_threads`), so Python threads do I/O in parallel; the handles are
//! `frozen` classes whose engine handle is cloned out under a short lock, never held
//! across I/O. A closed handle raises `ValueError`, as a closed Python file does.
//!
//! Errors: `Error::errno()` picks the `OSError` subclass (Python's `OSError(errno,
//! ...)` constructor does the choosing: ENOENT gives `FileNotFoundError`...);
//! corruption is `CorruptedError` and a device without ext4 `NotExt4Error`, both
//! `OSError` subclasses so that a plain `except OSError` still catches them.

use std::ffi::OsStr;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, RwLock};

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple, PyType};

use rext4::mkfs::{FeatureSet, MkfsOptions};
use rext4::{Error, FsOptions, Ino, Metadata, OpenOptions, SetAttr, Timestamp, XattrFlags};

create_exception!(
    _rext4,
    CorruptedError,
    PyOSError,
    "The image's metadata failed a check (errno EBADMSG); `block` says where, when known."
);
create_exception!(
    _rext4,
    NotExt4Error,
    PyOSError,
    "The file or device holds no ext4 filesystem (errno EINVAL)."
);

const ENODATA: i32 = 61;

fn path_of(p: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(p))
}

/// The Python exception for `e`; `filename` (image path bytes) goes into the
/// exception's `filename` as `os` functions put it there (`os.fsdecode`'d).
fn to_py(e: Error, filename: Option<&[u8]>) -> PyErr {
    Python::with_gil(|py| {
        let errno = e.errno();
        let msg = message(&e);
        let name: PyObject = match filename {
            Some(f) => {
                match PyString::from_object(&PyBytes::new(py, f), "utf-8", "surrogateescape") {
                    Ok(s) => s.into_any().unbind(),
                    Err(_) => py.None(),
                }
            }
            None => py.None(),
        };
        match &e {
            Error::Corrupted { block, .. } => {
                let err = CorruptedError::new_err((errno, msg, name));
                let _ = err.value(py).setattr("block", *block);
                err
            }
            Error::NotExt4(_) => NotExt4Error::new_err((errno, msg, name)),
            _ => PyOSError::new_err((errno, msg, name)),
        }
    })
}

/// `to_py` for xattr calls: a missing attribute is ENODATA, as getxattr(2) says.
fn xattr_err(e: Error, filename: &[u8]) -> PyErr {
    if matches!(e, Error::NotFound) {
        return PyOSError::new_err((ENODATA, "No data available", bytes_name(filename)));
    }
    to_py(e, Some(filename))
}

/// strerror's words, as `os` puts them in `OSError.strerror`, with the engine's detail
/// where the error carries one.
fn message(e: &Error) -> String {
    let strerror = std::io::Error::from_raw_os_error(e.errno()).to_string();
    let strerror = match strerror.rfind(" (os error ") {
        Some(i) => strerror[..i].to_string(),
        None => strerror,
    };
    match e {
        Error::Unsupported(d)
        | Error::InvalidInput(d)
        | Error::NotPermitted(d)
        | Error::InUse(d) => {
            format!("{strerror}: {d}")
        }
        Error::Io(_)
        | Error::NotExt4(_)
        | Error::Corrupted { .. }
        | Error::BadImage(_)
        | Error::ShutDown(_) => {
            format!("{strerror}: {e}")
        }
        Error::NotOpenFor(what) => format!("{strerror}: not open for {what}"),
        _ => strerror,
    }
}

fn bytes_name(f: &[u8]) -> String {
    String::from_utf8_lossy(f).into_owned()
}

/// An image path given as `str`, `bytes` or `os.PathLike`, as bytes (`os.fsencode`).
fn path_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = obj.downcast::<PyString>() {
        if let Ok(c) = s.to_cow() {
            return Ok(c.as_bytes().to_vec());
        }
    }
    // Surrogate-escaped str, PathLike: os.fsencode decides, as os functions do.
    let os = obj.py().import("os")?;
    let b = os.call_method1("fsencode", (obj,))?;
    Ok(b.downcast::<PyBytes>()?.as_bytes().to_vec())
}

/// A name from the image as `str` (`os.fsdecode`: UTF-8, surrogateescape) or `bytes`.
fn name_obj<'py>(py: Python<'py>, name: &[u8], as_str: bool) -> PyResult<Bound<'py, PyAny>> {
    if !as_str {
        return Ok(PyBytes::new(py, name).into_any());
    }
    match std::str::from_utf8(name) {
        Ok(s) => Ok(PyString::new(py, s).into_any()),
        Err(_) => Ok(
            PyString::from_object(&PyBytes::new(py, name), "utf-8", "surrogateescape")?.into_any(),
        ),
    }
}

/// (dirnames, filenames, the dirnames that are symlinks), as `walk_step` returns them.
type WalkStep<'py> = (
    Vec<Bound<'py, PyAny>>,
    Vec<Bound<'py, PyAny>>,
    Vec<Bound<'py, PyAny>>,
);

static STAT_RESULT: GILOnceCell<Py<PyType>> = GILOnceCell::new();
/// Whether `os.stat_result` has CPython-on-Linux's 19 fields (see `stat_result`).
static STAT_RESULT_FLAT: GILOnceCell<bool> = GILOnceCell::new();

/// `m` as an `os.stat_result` (st_dev 0), built here: `stat` is the hot call of a walk.
fn stat_result<'py>(py: Python<'py>, m: &Metadata) -> PyResult<Bound<'py, PyAny>> {
    let ty = STAT_RESULT.import(py, "os", "stat_result")?;
    let secs = |t: &Timestamp| t.sec as f64 + f64::from(t.nsec) * 1e-9;
    let ns = |t: &Timestamp| i128::from(t.sec) * 1_000_000_000 + i128::from(t.nsec);
    let (maj, min) = m.rdev.unwrap_or((0, 0));
    let rdev = libc::makedev(maj, min);
    let visible = (
        m.mode,
        m.ino.0,
        0u32,
        m.nlink,
        m.uid,
        m.gid,
        m.size,
        m.atime.sec,
        m.mtime.sec,
        m.ctime.sec,
    )
        .into_pyobject(py)?;
    let hidden: [(&str, PyObject); 9] = [
        (
            "st_atime",
            secs(&m.atime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_mtime",
            secs(&m.mtime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_ctime",
            secs(&m.ctime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_atime_ns",
            ns(&m.atime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_mtime_ns",
            ns(&m.mtime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_ctime_ns",
            ns(&m.ctime).into_pyobject(py)?.into_any().unbind(),
        ),
        (
            "st_blksize",
            m.block_size.into_pyobject(py)?.into_any().unbind(),
        ),
        ("st_blocks", m.blocks.into_pyobject(py)?.into_any().unbind()),
        ("st_rdev", rdev.into_pyobject(py)?.into_any().unbind()),
    ];
    let ty = ty.as_any();
    // CPython on Linux: 10 visible fields, then these 9 in this order: one tuple
    // fills them all. Another layout gets them by name.
    let flat = *STAT_RESULT_FLAT.get_or_try_init(py, || -> PyResult<bool> {
        Ok(ty.getattr("n_fields")?.extract::<usize>()? == 19)
    })?;
    if flat {
        let mut all: Vec<PyObject> = visible.iter().map(|o| o.unbind()).collect();
        all.extend(hidden.into_iter().map(|(_, v)| v));
        return ty.call1((PyTuple::new(py, all)?,));
    }
    let extra = PyDict::new(py);
    for (k, v) in hidden {
        extra.set_item(k, v)?;
    }
    ty.call1((visible, extra))
}

fn ts(sec: i64, nsec: u32) -> Timestamp {
    Timestamp { sec, nsec }
}

/// A stat tuple: ((mode, ino, nlink, uid, gid, size), (atime, mtime, ctime, crtime),
/// (blocks, blksize, rdev_major, rdev_minor, flags, generation)); each time is
/// (seconds, nanoseconds), crtime None where the inode has none.
type StatTuple = (
    (u32, u32, u32, u32, u32, u64),
    ((i64, u32), (i64, u32), (i64, u32), Option<(i64, u32)>),
    (u64, u32, u32, u32, u32, u32),
);

fn stat_tuple(m: &Metadata) -> StatTuple {
    let t = |t: &Timestamp| (t.sec, t.nsec);
    let (maj, min) = m.rdev.unwrap_or((0, 0));
    (
        (m.mode, m.ino.0, m.nlink, m.uid, m.gid, m.size),
        (
            t(&m.atime),
            t(&m.mtime),
            t(&m.ctime),
            m.crtime.as_ref().map(t),
        ),
        (m.blocks, m.block_size, maj, min, m.flags, m.generation),
    )
}

/// An open filesystem image (`rext4.open` wraps it in `rext4.FileSystem`).
#[pyclass(frozen, module = "rext4._rext4", name = "Fs")]
struct PyFs {
    fs: RwLock<Option<rext4::Fs>>,
}

impl PyFs {
    fn get(&self) -> PyResult<rext4::Fs> {
        self.fs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyValueError::new_err("I/O operation on closed filesystem"))
    }
}

fn resolve(fs: &rext4::Fs, path: &[u8], follow: bool) -> PyResult<Ino> {
    fs.resolve(path, follow).map_err(|e| to_py(e, Some(path)))
}

#[pymethods]
impl PyFs {
    /// Open the image at `path` (bytes: a file, or an image spec such as
    /// `disk.img?partition=2`; a path that exists is that file), read-only unless
    /// `writable`.
    #[staticmethod]
    #[pyo3(signature = (path, writable=false, cache_bytes=None))]
    fn open(
        py: Python<'_>,
        path: &[u8],
        writable: bool,
        cache_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let opts = FsOptions {
            read_only: !writable,
            cache_bytes,
            ..FsOptions::default()
        };
        let fs = py
            .allow_threads(|| {
                let spec = match std::str::from_utf8(path) {
                    Ok(t) => rext4::ImageSpec::from_arg(t)?,
                    Err(_) => rext4::ImageSpec::file(path_of(path)),
                };
                rext4::Fs::open_spec(&spec, opts)
            })
            .map_err(|e| to_py(e, Some(path)))?;
        Ok(PyFs {
            fs: RwLock::new(Some(fs)),
        })
    }

    /// Warnings the open gave (read-only fallback, image in use...).
    fn warnings(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.warnings().to_vec())
    }

    fn is_read_only(&self) -> PyResult<bool> {
        Ok(self.get()?.is_read_only())
    }

    /// `os.stat`/`os.lstat` of `path` (str, bytes or PathLike) as an `os.stat_result`.
    fn stat_result<'py>(
        &self,
        py: Python<'py>,
        path: &Bound<'py, PyAny>,
        follow: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fs = self.get()?;
        let path = path_arg(path)?;
        let m = py
            .allow_threads(|| {
                if follow {
                    fs.metadata(path_of(&path))
                } else {
                    fs.symlink_metadata(path_of(&path))
                }
            })
            .map_err(|e| to_py(e, Some(&path)))?;
        stat_result(py, &m)
    }

    /// One step of `os.walk`: the names in directory `path` split as os.walk splits
    /// them (a symlink to a directory is a dirname), and which dirnames are symlinks.
    fn walk_step<'py>(
        &self,
        py: Python<'py>,
        path: &[u8],
        as_str: bool,
    ) -> PyResult<WalkStep<'py>> {
        let fs = self.get()?;
        let split = py
            .allow_threads(|| {
                let list = fs.read_dir(path_of(path))?;
                let mut out = Vec::with_capacity(list.len());
                for e in list {
                    let (is_dir, is_link) = match e.file_type {
                        rext4::FileType::Dir => (true, false),
                        rext4::FileType::Symlink | rext4::FileType::Unknown => {
                            let mut full = path.to_vec();
                            full.push(b'/');
                            full.extend_from_slice(&e.name);
                            let link = e.file_type == rext4::FileType::Symlink
                                || fs
                                    .symlink_metadata(path_of(&full))
                                    .is_ok_and(|m| m.is_symlink());
                            // os.walk: DirEntry.is_dir() follows; a dangling link is not one.
                            (fs.metadata(path_of(&full)).is_ok_and(|m| m.is_dir()), link)
                        }
                        _ => (false, false),
                    };
                    out.push((e.name, is_dir, is_link));
                }
                Ok(out)
            })
            .map_err(|e| to_py(e, Some(path)))?;
        let (mut dirs, mut files, mut links) = (Vec::new(), Vec::new(), Vec::new());
        for (name, is_dir, is_link) in split {
            let n = name_obj(py, &name, as_str)?;
            if is_dir {
                if is_link {
                    links.push(n.clone());
                }
                dirs.push(n);
            } else {
                files.push(n);
            }
        }
        Ok((dirs, files, links))
    }

    fn stat(&self, py: Python<'_>, path: &[u8], follow: bool) -> PyResult<StatTuple> {
        let fs = self.get()?;
        py.allow_threads(|| {
            let m = if follow {
                fs.metadata(path_of(path))
            } else {
                fs.symlink_metadata(path_of(path))
            };
            m.map(|m| stat_tuple(&m)).map_err(|e| to_py(e, Some(path)))
        })
    }

    /// Entries of a directory: (name, inode number, dirent type code).
    fn listdir<'py>(
        &self,
        py: Python<'py>,
        path: &[u8],
    ) -> PyResult<Vec<(Bound<'py, PyBytes>, u32, u8)>> {
        let fs = self.get()?;
        let list = py
            .allow_threads(|| fs.read_dir(path_of(path)))
            .map_err(|e| to_py(e, Some(path)))?;
        Ok(list
            .iter()
            .map(|e| {
                (
                    PyBytes::new(py, &e.name),
                    e.ino.0,
                    e.file_type.dirent_code(),
                )
            })
            .collect())
    }

    fn readlink<'py>(&self, py: Python<'py>, path: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let fs = self.get()?;
        let t = py
            .allow_threads(|| fs.read_link(path_of(path)))
            .map_err(|e| to_py(e, Some(path)))?;
        Ok(PyBytes::new(py, &t))
    }

    /// Open a file: the flags are `OpenOptions`'s; `mode` is the new file's mode.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, read, write, create, create_new, truncate, append, mode=0o666))]
    fn open_file(
        &self,
        py: Python<'_>,
        path: &[u8],
        read: bool,
        write: bool,
        create: bool,
        create_new: bool,
        truncate: bool,
        append: bool,
        mode: u32,
    ) -> PyResult<PyFile> {
        let fs = self.get()?;
        let f = py
            .allow_threads(|| {
                if !write && !create && !create_new && !truncate && !append {
                    // Read-only opens refuse directories, as open(2) with O_RDONLY
                    // does not but Python's open() does (IsADirectoryError).
                    return fs.open_file(path_of(path));
                }
                if fs.is_read_only() {
                    // open(2) for writing on a read-only filesystem is EROFS at once
                    // (the engine's OpenOptions leaves it to the first write).
                    return Err(Error::ReadOnly);
                }
                let f = OpenOptions::new()
                    .read(read)
                    .write(write || append)
                    .create(create)
                    .create_new(create_new)
                    .truncate(truncate)
                    .append(append)
                    .mode(mode & 0o7777)
                    .open(&fs, path_of(path))?;
                if f.metadata()?.is_dir() {
                    return Err(Error::IsADirectory);
                }
                Ok(f)
            })
            .map_err(|e| to_py(e, Some(path)))?;
        Ok(PyFile {
            f: RwLock::new(Some(Arc::new(f))),
        })
    }

    fn mkdir(&self, py: Python<'_>, path: &[u8], mode: u32) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| {
            let (parent, name) = fs.parent_and_name(path)?;
            fs.mkdir_ino(parent, name, mode & 0o7777, 0, 0).map(|_| ())
        })
        .map_err(|e| to_py(e, Some(path)))
    }

    fn mknod(
        &self,
        py: Python<'_>,
        path: &[u8],
        mode: u32,
        major: u32,
        minor: u32,
    ) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.mknod(path_of(path), mode, (major, minor)))
            .map_err(|e| to_py(e, Some(path)))
    }

    fn remove(&self, py: Python<'_>, path: &[u8]) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.remove_file(path_of(path)))
            .map_err(|e| to_py(e, Some(path)))
    }

    fn rmdir(&self, py: Python<'_>, path: &[u8]) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.remove_dir(path_of(path)))
            .map_err(|e| to_py(e, Some(path)))
    }

    fn rename(&self, py: Python<'_>, src: &[u8], dst: &[u8]) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.rename(path_of(src), path_of(dst)))
            .map_err(|e| to_py(e, Some(src)))
    }

    fn symlink(&self, py: Python<'_>, target: &[u8], link: &[u8]) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.symlink(path_of(target), path_of(link)))
            .map_err(|e| to_py(e, Some(link)))
    }

    fn link(&self, py: Python<'_>, src: &[u8], dst: &[u8]) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.hard_link(path_of(src), path_of(dst)))
            .map_err(|e| to_py(e, Some(src)))
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        py: Python<'_>,
        path: &[u8],
        follow: bool,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        atime: Option<(i64, u32)>,
        mtime: Option<(i64, u32)>,
    ) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| {
            let ino = resolve(&fs, path, follow)?;
            let a = SetAttr {
                mode,
                uid,
                gid,
                atime: atime.map(|(s, n)| ts(s, n)),
                mtime: mtime.map(|(s, n)| ts(s, n)),
                ..SetAttr::default()
            };
            fs.setattr_ino(ino, &a).map_err(|e| to_py(e, Some(path)))?;
            Ok(())
        })
    }

    fn truncate(&self, py: Python<'_>, path: &[u8], length: u64) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.set_len(path_of(path), length))
            .map_err(|e| to_py(e, Some(path)))
    }

    fn getxattr<'py>(
        &self,
        py: Python<'py>,
        path: &[u8],
        name: &[u8],
        follow: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let fs = self.get()?;
        let v = py.allow_threads(|| {
            let ino = resolve(&fs, path, follow)?;
            match fs.get_xattr_ino(ino, name) {
                Ok(Some(v)) => Ok(v),
                Ok(None) => Err(xattr_err(Error::NotFound, path)),
                Err(e) => Err(xattr_err(e, path)),
            }
        })?;
        Ok(PyBytes::new(py, &v))
    }

    fn listxattr<'py>(
        &self,
        py: Python<'py>,
        path: &[u8],
        follow: bool,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let fs = self.get()?;
        let all = py.allow_threads(|| {
            let ino = resolve(&fs, path, follow)?;
            fs.xattrs_ino(ino).map_err(|e| to_py(e, Some(path)))
        })?;
        Ok(all.iter().map(|(n, _)| PyBytes::new(py, n)).collect())
    }

    #[allow(clippy::too_many_arguments)]
    fn setxattr(
        &self,
        py: Python<'_>,
        path: &[u8],
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
        follow: bool,
    ) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| {
            let ino = resolve(&fs, path, follow)?;
            fs.set_xattr_ino(ino, name, value, XattrFlags { create, replace })
                .map_err(|e| xattr_err(e, path))
        })
    }

    fn removexattr(&self, py: Python<'_>, path: &[u8], name: &[u8], follow: bool) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| {
            let ino = resolve(&fs, path, follow)?;
            fs.remove_xattr_ino(ino, name)
                .map_err(|e| xattr_err(e, path))
        })
    }

    /// statfs figures: (block size, blocks, free, available, inodes, free inodes,
    /// name max).
    fn statvfs(&self) -> PyResult<(u32, u64, u64, u64, u64, u64, u32)> {
        let s = self.get()?.statfs();
        Ok((
            s.block_size,
            s.blocks,
            s.blocks_free,
            s.blocks_available,
            s.inodes,
            s.inodes_free,
            s.name_max,
        ))
    }

    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let fs = self.get()?;
        py.allow_threads(|| fs.sync()).map_err(|e| to_py(e, None))
    }

    /// Write everything back, mark the image clean and let it go. Closing twice is a
    /// no-op, as for Python files.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let fs = self.fs.write().unwrap_or_else(|p| p.into_inner()).take();
        match fs {
            Some(fs) => py.allow_threads(|| fs.close()).map_err(|e| to_py(e, None)),
            None => Ok(()),
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.fs.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }
}

/// An open file of the image (`rext4.File` wraps it as an `io.RawIOBase`).
#[pyclass(frozen, module = "rext4._rext4", name = "File")]
struct PyFile {
    f: RwLock<Option<Arc<rext4::File>>>,
}

impl PyFile {
    fn get(&self) -> PyResult<Arc<rext4::File>> {
        self.f
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyValueError::new_err("I/O operation on closed file"))
    }
}

/// Reads larger than this are cut to the file's size first, so that `read(huge)`
/// does not allocate what the file does not hold.
const READ_CLAMP_BYTES: usize = 1 << 16;

#[pymethods]
impl PyFile {
    /// Up to `size` bytes from `offset` (fewer only at the end of the file).
    fn read_at<'py>(
        &self,
        py: Python<'py>,
        size: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let f = self.get()?;
        let mut size = size;
        if size > READ_CLAMP_BYTES {
            // The inode of an open file is cached: no I/O worth releasing the GIL for.
            let len = f.len().map_err(|e| to_py(e, None))?;
            size = size.min(usize::try_from(len.saturating_sub(offset)).unwrap_or(usize::MAX));
        }
        if size == 0 {
            return Ok(PyBytes::new(py, b""));
        }
        // A `bytes` object left uninitialized (as CPython's own FileIO.read makes
        // them) and filled by the read: no pass to zero it first.
        let len = pyo3::ffi::Py_ssize_t::try_from(size)
            .map_err(|_| PyValueError::new_err("read size too large"))?;
        // SAFETY: a NULL source asks CPython for an uninitialized object of `len`
        // bytes; it is ours alone until returned.
        let b = unsafe {
            let ptr = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len);
            Bound::from_owned_ptr_or_err(py, ptr)?.downcast_into_unchecked::<PyBytes>()
        };
        // SAFETY: the object's buffer holds `size` bytes (plus CPython's NUL), seen as
        // possibly uninitialized memory, which `read_at_uninit` only writes.
        let buf = unsafe {
            let data = pyo3::ffi::PyBytes_AsString(b.as_ptr()).cast::<MaybeUninit<u8>>();
            std::slice::from_raw_parts_mut(data, size)
        };
        let got = py
            .allow_threads(|| f.read_at_uninit(buf, offset))
            .map_err(|e| to_py(e, None))?;
        if got == size {
            Ok(b)
        } else {
            // SAFETY: the read initialized the first `got` bytes.
            let done = unsafe {
                std::slice::from_raw_parts(
                    pyo3::ffi::PyBytes_AsString(b.as_ptr()).cast::<u8>(),
                    got,
                )
            };
            Ok(PyBytes::new(py, done))
        }
    }

    /// Write all of `data` at `offset` (at the end in append mode); returns the length.
    fn write_at(&self, py: Python<'_>, data: &[u8], offset: u64) -> PyResult<usize> {
        let f = self.get()?;
        py.allow_threads(|| f.write_all_at(data, offset))
            .map_err(|e| to_py(e, None))?;
        Ok(data.len())
    }

    fn set_len(&self, py: Python<'_>, size: u64) -> PyResult<()> {
        let f = self.get()?;
        py.allow_threads(|| f.set_len(size))
            .map_err(|e| to_py(e, None))
    }

    fn len(&self, py: Python<'_>) -> PyResult<u64> {
        let f = self.get()?;
        py.allow_threads(|| f.len()).map_err(|e| to_py(e, None))
    }

    fn stat(&self, py: Python<'_>) -> PyResult<StatTuple> {
        let f = self.get()?;
        py.allow_threads(|| f.metadata().map(|m| stat_tuple(&m)))
            .map_err(|e| to_py(e, None))
    }

    /// SEEK_DATA (`data`) or SEEK_HOLE from `offset`; None past the end (ENXIO).
    fn seek_data(&self, py: Python<'_>, offset: u64, data: bool) -> PyResult<Option<u64>> {
        let f = self.get()?;
        let whence = if data {
            rext4::Whence::Data
        } else {
            rext4::Whence::Hole
        };
        py.allow_threads(|| f.seek(offset, whence))
            .map_err(|e| to_py(e, None))
    }

    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let f = self.get()?;
        py.allow_threads(|| f.sync_all())
            .map_err(|e| to_py(e, None))
    }

    fn close(&self) {
        self.f.write().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// Make a filesystem in the file `path` (created or truncated to `size` bytes).
/// Returns (block size, blocks, inodes).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (path, size, block_size=None, inodes=None, label=None, uuid=None, features=None, hash_seed=None, seed=None))]
fn mkfs(
    py: Python<'_>,
    path: &[u8],
    size: u64,
    block_size: Option<u32>,
    inodes: Option<u32>,
    label: Option<String>,
    uuid: Option<&str>,
    features: Option<&str>,
    hash_seed: Option<&str>,
    seed: Option<&[u8]>,
) -> PyResult<(u32, u64, u32)> {
    let parse = |u: Option<&str>| -> PyResult<Option<[u8; 16]>> {
        match u {
            Some(u) => {
                Ok(Some(rext4::mkfs::parse_uuid(u).ok_or_else(|| {
                    PyValueError::new_err(format!("invalid UUID: {u}"))
                })?))
            }
            None => Ok(None),
        }
    };
    let (uuid, hash_seed) = (parse(uuid)?, parse(hash_seed)?);
    let features = match features {
        Some(f) => FeatureSet::parse(f).map_err(PyValueError::new_err)?,
        None => FeatureSet::default(),
    };
    let opts = MkfsOptions {
        block_size,
        inodes,
        label,
        uuid,
        hash_seed,
        seed: seed.map(<[u8]>::to_vec),
        features,
        ..MkfsOptions::default()
    };
    let r = py
        .allow_threads(|| rext4::mkfs::mkfs_file(path_of(path), size, &opts))
        .map_err(|e| to_py(e, Some(path)))?;
    Ok((r.block_size, r.blocks_count, r.inodes_count))
}

/// Fill the image at `path` (opened read-write, closed at the end) through
/// rext4-populate: the tar `archive`, then the `layers` (tars or OCI layouts), owners
/// mapped; then (after `remap` — a tree copied in already, whose owners are mapped
/// in place) the device table and the file_contexts labels (file contents as text).
/// Returns the members refused (the rest is placed).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (path, archive=None, layers=Vec::new(), owner=None, uid_map=None, gid_map=None, device_table=None, file_contexts=None, remap=false))]
fn populate(
    py: Python<'_>,
    path: &[u8],
    archive: Option<&[u8]>,
    layers: Vec<Vec<u8>>,
    owner: Option<(u32, u32)>,
    uid_map: Option<&str>,
    gid_map: Option<&str>,
    device_table: Option<&str>,
    file_contexts: Option<&str>,
    remap: bool,
) -> PyResult<Vec<String>> {
    use rext4_populate as pop;
    let bad = |e: Error| PyValueError::new_err(e.to_string());
    let owners = pop::Owners {
        owner,
        uid_map: uid_map
            .map(pop::IdMap::parse)
            .transpose()
            .map_err(bad)?
            .unwrap_or_default(),
        gid_map: gid_map
            .map(pop::IdMap::parse)
            .transpose()
            .map_err(bad)?
            .unwrap_or_default(),
    };
    let table = device_table
        .map(pop::devtable::parse)
        .transpose()
        .map_err(bad)?;
    let contexts = file_contexts
        .map(pop::contexts::FileContexts::parse)
        .transpose()
        .map_err(bad)?;
    let layers: Vec<std::path::PathBuf> = layers.iter().map(|l| path_of(l).to_path_buf()).collect();
    let archive = archive.map(|a| path_of(a).to_path_buf());
    py.allow_threads(|| {
        let fs = rext4::Fs::open_with(
            path_of(path),
            FsOptions {
                read_only: false,
                ..FsOptions::default()
            },
        )?;
        let opts = pop::Options { owners };
        let stop = || false;
        let r = (|| -> rext4::Result<Vec<String>> {
            let mut refused = Vec::new();
            if remap {
                pop::ids::remap_tree(&fs, Ino::ROOT, &opts.owners)?;
            }
            if let Some(a) = &archive {
                let f = std::fs::File::open(a)?;
                refused.extend(pop::apply_archive(&fs, Ino::ROOT, f, &opts, false, &stop)?.errors);
            }
            if !layers.is_empty() {
                refused.extend(pop::apply_layers(&fs, Ino::ROOT, &layers, &opts, &stop)?.errors);
            }
            if let Some(t) = &table {
                pop::devtable::apply(&fs, Ino::ROOT, t)?;
            }
            if let Some(fc) = &contexts {
                pop::contexts::label_tree(&fs, Ino::ROOT, b"/", fc)?;
            }
            Ok(refused)
        })();
        let closed = fs.close();
        let refused = r?;
        closed.map(|()| refused)
    })
    .map_err(|e| to_py(e, Some(path)))
}

/// Resize the unmounted image at `path` offline (`rext4::resize`): to `size` bytes
/// (rounded down to whole blocks), or to the smallest size its contents fit in when
/// `size` is None. Returns (block size, old blocks, new blocks, blocks moved, inodes
/// moved, journal moved).
#[pyfunction]
#[pyo3(signature = (path, size=None))]
fn resize(
    py: Python<'_>,
    path: &[u8],
    size: Option<u64>,
) -> PyResult<(u32, u64, u64, u64, u64, bool)> {
    use rext4::resize::Target;
    let r = py
        .allow_threads(|| {
            let target = match size {
                Some(bytes) => {
                    let bs = rext4::resize::block_size(path_of(path))?;
                    Target::Blocks(bytes / u64::from(bs))
                }
                None => Target::Min,
            };
            rext4::resize::resize(path_of(path), target)
        })
        .map_err(|e| to_py(e, Some(path)))?;
    Ok((
        r.block_size,
        r.old_blocks,
        r.new_blocks,
        r.moved_blocks,
        r.moved_inodes,
        r.journal_moved,
    ))
}

/// Raise the exception the engine error named `kind` maps to (for the tests of the
/// mapping: some errors cannot be provoked on demand, e.g. a failed device).
#[pyfunction]
fn _raise_engine_error(kind: &str) -> PyResult<()> {
    let e = match kind {
        "Io" => Error::Io(std::io::Error::from_raw_os_error(5)),
        "NotExt4" => Error::NotExt4("test".into()),
        "Corrupted" => Error::corrupted("test", Some(7)),
        "Unsupported" => Error::Unsupported("test".into()),
        "NotFound" => Error::NotFound,
        "NotADirectory" => Error::NotADirectory,
        "IsADirectory" => Error::IsADirectory,
        "NotASymlink" => Error::NotASymlink,
        "Loop" => Error::Loop,
        "NameTooLong" => Error::NameTooLong,
        "InvalidInput" => Error::InvalidInput("test".into()),
        "NotOpenFor" => Error::NotOpenFor("writing"),
        "ReadOnly" => Error::ReadOnly,
        "Exists" => Error::Exists,
        "NotEmpty" => Error::NotEmpty,
        "NoSpace" => Error::NoSpace,
        "TooManyLinks" => Error::TooManyLinks,
        "FileTooLarge" => Error::FileTooLarge,
        "NotPermitted" => Error::NotPermitted("test".into()),
        "PermissionDenied" => Error::PermissionDenied,
        "ShutDown" => Error::ShutDown("test".into()),
        "InUse" => Error::InUse("test".into()),
        "BadImage" => Error::BadImage("test".into()),
        other => return Err(PyValueError::new_err(format!("no engine error {other}"))),
    };
    Err(to_py(e, Some(b"/test")))
}

#[pymodule]
fn _rext4(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFs>()?;
    m.add_class::<PyFile>()?;
    m.add_function(wrap_pyfunction!(mkfs, m)?)?;
    m.add_function(wrap_pyfunction!(populate, m)?)?;
    m.add_function(wrap_pyfunction!(resize, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_engine_error, m)?)?;
    m.add("CorruptedError", m.py().get_type::<CorruptedError>())?;
    m.add("NotExt4Error", m.py().get_type::<NotExt4Error>())?;
    Ok(())
}
