"""rext4: read and write ext4 filesystem images without root, a mount or a subprocess.

    import rext4
    rext4.mkfs("disk.img", 64 << 20)
    with rext4.open("disk.img", writable=True) as fs:
        fs.makedirs("/etc/app")
        with fs.open("/etc/app/conf", "wb") as f:
            f.write(b"x = 1\\n")
        for dirpath, dirnames, filenames in fs.walk("/"):
            print(dirpath, filenames)

The filesystem object follows the names of ``os`` and ``pathlib``; paths are paths
inside the image ("/" is its root; relative paths start there too; absolute symlinks
resolve inside the image). Names come back as ``str`` for ``str`` arguments and as
``bytes`` for ``bytes`` arguments, as ``os.listdir`` does. Errors are the ``OSError``
subclasses ``os`` raises (``FileNotFoundError``, ``FileExistsError``,
``NotADirectoryError``... with ``errno`` set); damaged metadata raises
``CorruptedError`` and a file without ext4 ``NotExt4Error`` (both ``OSError``). Every
call that touches the image releases the GIL, so threads do I/O in parallel.

The image has no umask and no caller identity: new files get the mode given (default
0o644, directories 0o755) and owner 0:0 unless ``chown`` says otherwise.
"""

from __future__ import annotations

import builtins
import io
import math
import os
import posixpath
import stat as _stat
import time
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _rext4
from ._rext4 import CorruptedError, NotExt4Error

__all__ = [
    "mkfs",
    "resize",
    "ResizeResult",
    "open",
    "FileSystem",
    "File",
    "DirEntry",
    "CorruptedError",
    "NotExt4Error",
]

PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
Progress = Callable[[str, int, int], None]

_CHUNK = 1 << 20


def _b(path: PathArg) -> bytes:
    return os.fsencode(path)


def _like(template: PathArg, name: bytes) -> Union[str, bytes]:
    """``name`` as ``bytes`` when ``template`` is bytes, else as ``str``."""
    if isinstance(template, bytes):
        return name
    return os.fsdecode(name)


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    s = size.strip()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if s and s[-1].lower() in units:
        return int(s[:-1]) * units[s[-1].lower()]
    return int(s)


def mkfs(
    path: PathArg,
    size: Union[int, str],
    *,
    block_size: Optional[int] = None,
    inodes: Optional[int] = None,
    label: Optional[str] = None,
    uuid: Optional[str] = None,
    features: Optional[str] = None,
    hash_seed: Optional[str] = None,
    seed: Optional[Union[str, bytes]] = None,
    source: Optional[PathArg] = None,
    layers: Sequence[PathArg] = (),
    owner: Optional[Tuple[int, int]] = None,
    uid_map: Optional[str] = None,
    gid_map: Optional[str] = None,
    device_table: Optional[PathArg] = None,
    file_contexts: Optional[PathArg] = None,
) -> List[str]:
    """Make an ext4 filesystem in the file ``path``, created or truncated to ``size``
    bytes (an int, or a string such as ``"64M"``), laid out as mke2fs 1.47 does.

    ``block_size``, ``inodes``, ``label``, ``uuid`` and ``features`` (mke2fs's ``-O``
    syntax, e.g. ``"^metadata_csum,^has_journal"``) are mke2fs's ``-b -N -L -U -O``;
    ``hash_seed`` its ``-E hash_seed=``. ``seed`` derives the UUID and hash seed not
    given, so that with ``SOURCE_DATE_EPOCH`` set the same input gives the same image.
    An image that a loop device, a mount or another rext4 user holds is refused
    (``OSError`` with errno EBUSY).

    Then, as ``rext4 mkfs`` does: ``source`` (a directory, copied as ``copy_in``
    copies, or a tar archive, plain or gzip/zstd/xz), the container ``layers`` (tar
    files or OCI image layouts, bottom first, whiteouts applied), owners mapped by
    ``owner`` ``(uid, gid)`` and ``uid_map`` / ``gid_map`` (``"INSIDE:OUTSIDE:COUNT"``,
    as a user namespace's), the ``device_table`` (makedevs format) and the SELinux
    ``file_contexts`` labels. Returns the archive members refused (named, with why);
    the rest is placed. Malformed maps, tables or contexts raise ``ValueError``."""
    seed_b = seed.encode() if isinstance(seed, str) else seed
    _rext4.mkfs(_b(path), _parse_size(size), block_size, inodes, label, uuid, features, hash_seed, seed_b)
    archive = None
    remap = False
    if source is not None:
        if os.path.isdir(source):
            with open(path, writable=True) as fs:
                for name in sorted(os.listdir(source)):
                    fs.copy_in(os.path.join(os.fsencode(source), os.fsencode(name)), b"/")
                st = os.lstat(source)
                fs.chown(b"/", st.st_uid, st.st_gid)
                fs.chmod(b"/", st.st_mode & 0o7777)
                fs.utime(b"/", ns=(st.st_atime_ns, st.st_mtime_ns))
            remap = owner is not None or bool(uid_map) or bool(gid_map)
        else:
            archive = _b(source)
    extra = [device_table, file_contexts]
    if archive is None and not layers and not remap and extra == [None, None]:
        return []

    def text(p: Optional[PathArg]) -> Optional[str]:
        if p is None:
            return None
        with builtins.open(p, encoding="utf-8") as f:
            return f.read()

    return _rext4.populate(
        _b(path),
        archive,
        [_b(l) for l in layers],
        owner,
        uid_map,
        gid_map,
        text(device_table),
        text(file_contexts),
        remap,
    )


class ResizeResult(NamedTuple):
    """What :func:`resize` did: sizes in filesystem blocks of ``block_size`` bytes."""

    block_size: int
    old_blocks: int
    new_blocks: int
    moved_blocks: int
    moved_inodes: int
    journal_moved: bool


def resize(path: PathArg, size: Union[int, str]) -> ResizeResult:
    """Grow or shrink the unmounted ext4 image ``path`` offline, as ``rext4 resize``
    (and resize2fs) does: ``size`` in bytes (an int, or a string such as ``"256M"``;
    rounded down to whole blocks), or ``"min"`` for the smallest size the contents fit
    in. A file grows or is truncated to the new size. Crash-safe: interrupted at any
    point, the image is the old filesystem or the new one. An image that a mount, a
    loop device or another rext4 user holds is refused (``OSError``, errno EBUSY); a
    size too small for the contents raises ``OSError`` with errno ENOSPC, an impossible
    one EINVAL, a feature not handled (bigalloc, meta_bg, ...) EOPNOTSUPP, each with
    the reason; the image is then unchanged."""
    if isinstance(size, str) and size.strip().lower() == "min":
        n = None
    else:
        n = _parse_size(size)
        if n < 0:
            raise ValueError(f"negative size: {size!r}")
    return ResizeResult(*_rext4.resize(_b(path), n))


def open(path: PathArg, writable: bool = False, *, cache_bytes: Optional[int] = None) -> "FileSystem":
    """Open the image file or block device ``path``; read-only unless ``writable``.

    ``path`` may be an image spec: ``disk.img?partition=2`` (GPT or MBR, logical
    partitions from 5), ``disk.img?offset=1048576[&size=BYTES]``; a qcow2 image is
    found by its magic. A path that exists is that file, '?' and all.

    A writable open refuses an image in use (a loop device, a mount, another rext4
    process: errno EBUSY) and replays a journal left to recover. ``cache_bytes``
    bounds the file-data cache (default: 1/16 of RAM, 64 MiB to 2 GiB). Use the
    result as a context manager, or call ``close()``: it writes everything back and
    marks the image clean."""
    native = _rext4.Fs.open(_b(path), writable, cache_bytes)
    return FileSystem(native, os.fspath(path))


def _times(t: Tuple[int, int]) -> Tuple[float, int]:
    sec, nsec = t
    return sec + nsec / 1e9, sec * 1_000_000_000 + nsec


def _stat_result(t) -> os.stat_result:
    (mode, ino, nlink, uid, gid, size), (at, mt, ct, _crt), (blocks, blksize, maj, mnr, _fl, _gen) = t
    af, ans = _times(at)
    mf, mns = _times(mt)
    cf, cns = _times(ct)
    seq = (mode, ino, 0, nlink, uid, gid, size, at[0], mt[0], ct[0])
    extra = {
        "st_atime": af,
        "st_mtime": mf,
        "st_ctime": cf,
        "st_atime_ns": ans,
        "st_mtime_ns": mns,
        "st_ctime_ns": cns,
        "st_blksize": blksize,
        "st_blocks": blocks,
        "st_rdev": os.makedev(maj, mnr),
    }
    return os.stat_result(seq, extra)


def _split_ns(ns: int) -> Tuple[int, int]:
    sec, nsec = divmod(ns, 1_000_000_000)
    return sec, nsec


def _split_float(t: float) -> Tuple[int, int]:
    sec = math.floor(t)
    nsec = int((t - sec) * 1e9)
    return sec, min(nsec, 999_999_999)


_DT_TO_IFMT = {
    1: _stat.S_IFREG,
    2: _stat.S_IFDIR,
    3: _stat.S_IFCHR,
    4: _stat.S_IFBLK,
    5: _stat.S_IFIFO,
    6: _stat.S_IFSOCK,
    7: _stat.S_IFLNK,
}


class DirEntry:
    """An entry of ``FileSystem.scandir``, as ``os.DirEntry``: ``name``, ``path``,
    ``inode()``, ``is_dir()``, ``is_file()``, ``is_symlink()`` (from the directory
    entry, no stat) and ``stat()``."""

    __slots__ = ("name", "path", "_ino", "_dtype", "_fs", "_stat", "_lstat")

    def __init__(self, fs: "FileSystem", name, path, ino: int, dtype: int):
        self.name = name
        self.path = path
        self._ino = ino
        self._dtype = dtype
        self._fs = fs
        self._stat: Optional[os.stat_result] = None
        self._lstat: Optional[os.stat_result] = None

    def inode(self) -> int:
        return self._ino

    def _ifmt(self, follow_symlinks: bool) -> int:
        fmt = _DT_TO_IFMT.get(self._dtype, 0)
        if fmt == 0 or (fmt == _stat.S_IFLNK and follow_symlinks):
            try:
                return _stat.S_IFMT(self.stat(follow_symlinks=follow_symlinks).st_mode)
            except FileNotFoundError:
                return 0
        return fmt

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._ifmt(follow_symlinks) == _stat.S_IFDIR

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._ifmt(follow_symlinks) == _stat.S_IFREG

    def is_symlink(self) -> bool:
        return self._ifmt(False) == _stat.S_IFLNK

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if follow_symlinks:
            if self._stat is None:
                self._stat = self._fs.stat(self.path)
            return self._stat
        if self._lstat is None:
            self._lstat = self._fs.lstat(self.path)
        return self._lstat

    def __fspath__(self):
        return self.path

    def __repr__(self) -> str:
        return f"<rext4.DirEntry {self.name!r}>"


class _ScandirIterator:
    def __init__(self, entries: List[DirEntry]):
        self._it = iter(entries)

    def __iter__(self):
        return self

    def __next__(self) -> DirEntry:
        return next(self._it)

    def close(self) -> None:
        self._it = iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class File(io.RawIOBase):
    """A file of the image, opened by ``FileSystem.open`` in a binary mode: an
    ``io.RawIOBase`` with ``read``, ``readinto``, ``readall``, ``write``, ``seek``
    (also ``os.SEEK_DATA``/``os.SEEK_HOLE``), ``tell``, ``truncate``, plus ``fsync``
    (the file's data and the journal made durable) and ``stat``."""

    def __init__(self, native, name: PathArg, mode: str, readable: bool, writable: bool, append: bool):
        super().__init__()
        self._f = native
        self.name = name
        self.mode = mode
        self._readable = readable
        self._writable = writable
        self._append = append
        self._pos = native.len() if append else 0

    def readable(self) -> bool:
        self._check_open()
        return self._readable

    def writable(self) -> bool:
        self._check_open()
        return self._writable

    def seekable(self) -> bool:
        self._check_open()
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def _check_readable(self) -> None:
        self._check_open()
        if not self._readable:
            raise io.UnsupportedOperation("File not open for reading")

    def _check_writable(self) -> None:
        self._check_open()
        if not self._writable:
            raise io.UnsupportedOperation("File not open for writing")

    def read(self, size: Optional[int] = -1) -> bytes:
        self._check_readable()
        if size is None or size < 0:
            return self.readall()
        data = self._f.read_at(size, self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        self._check_readable()
        chunks: List[bytes] = []
        while True:
            want = max(_CHUNK, self._f.len() - self._pos)
            data = self._f.read_at(want, self._pos)
            if not data:
                return b"".join(chunks)
            self._pos += len(data)
            chunks.append(data)

    def readinto(self, b) -> int:
        self._check_readable()
        with memoryview(b) as view, view.cast("B") as out:
            data = self._f.read_at(len(out), self._pos)
            n = len(data)
            out[:n] = data
        self._pos += n
        return n

    def write(self, b) -> int:
        self._check_writable()
        data = b if isinstance(b, bytes) else bytes(b)
        n = self._f.write_at(data, self._pos)
        self._pos = self._f.len() if self._append else self._pos + n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._check_open()
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self._pos + offset
        elif whence == os.SEEK_END:
            pos = self._f.len() + offset
        elif whence in (getattr(os, "SEEK_DATA", 3), getattr(os, "SEEK_HOLE", 4)):
            if offset < 0:
                raise OSError(22, "Invalid argument", self.name)
            found = self._f.seek_data(offset, whence == getattr(os, "SEEK_DATA", 3))
            if found is None:
                raise OSError(6, "No such device or address", self.name)
            pos = found
        else:
            raise ValueError(f"invalid whence ({whence})")
        if pos < 0:
            raise OSError(22, "Invalid argument", self.name)
        self._pos = pos
        return pos

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def truncate(self, size: Optional[int] = None) -> int:
        self._check_writable()
        if size is None:
            size = self._pos
        self._f.set_len(size)
        return size

    def fsync(self) -> None:
        """Make the file's data and metadata durable (fsync)."""
        self._check_open()
        self._f.sync()

    def stat(self) -> os.stat_result:
        """os.fstat of this file."""
        self._check_open()
        return _stat_result(self._f.stat())

    def close(self) -> None:
        if not self.closed:
            try:
                super().close()
            finally:
                self._f.close()


def _parse_mode(mode: str) -> Tuple[bool, bool, bool, bool, bool, bool, bool]:
    """(binary, read, write, create, create_new, truncate, append) for an open() mode."""
    chars = set(mode)
    if len(chars) != len(mode) or not chars <= set("rwxab+t") or len(chars & set("rwxa")) != 1:
        raise ValueError(f"invalid mode: {mode!r}")
    if "b" in chars and "t" in chars:
        raise ValueError(f"invalid mode: {mode!r}")
    plus = "+" in chars
    binary = "b" in chars
    if "r" in chars:
        return binary, True, plus, False, False, False, False
    if "w" in chars:
        return binary, plus, True, True, False, True, False
    if "x" in chars:
        return binary, plus, True, False, True, False, False
    return binary, plus, True, True, False, False, True


class FileSystem:
    """An open ext4 image (from ``rext4.open``): a context manager whose methods are
    named as in ``os``. Safe to share between threads."""

    def __init__(self, native, path: Union[str, bytes]):
        self._fs = native
        self.path = path

    def __enter__(self) -> "FileSystem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("ro" if self.read_only else "rw")
        return f"<rext4.FileSystem {self.path!r} {state}>"

    @property
    def closed(self) -> bool:
        return self._fs.closed

    @property
    def read_only(self) -> bool:
        return self._fs.is_read_only()

    @property
    def warnings(self) -> List[str]:
        """What the open warned about (image in use by others, read-only fallback)."""
        return self._fs.warnings()

    # --- metadata -------------------------------------------------------------

    def stat(self, path: PathArg, *, follow_symlinks: bool = True) -> os.stat_result:
        """``os.stat`` inside the image (``st_dev`` is 0)."""
        return self._fs.stat_result(path, follow_symlinks)

    def lstat(self, path: PathArg) -> os.stat_result:
        return self._fs.stat_result(path, False)

    def birthtime_ns(self, path: PathArg, *, follow_symlinks: bool = True) -> Optional[int]:
        """The inode's creation time (ext4's crtime) in ns, None where it has none."""
        crt = self._fs.stat(_b(path), follow_symlinks)[1][3]
        return None if crt is None else crt[0] * 1_000_000_000 + crt[1]

    def exists(self, path: PathArg) -> bool:
        try:
            self.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def isdir(self, path: PathArg) -> bool:
        try:
            return _stat.S_ISDIR(self.stat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def isfile(self, path: PathArg) -> bool:
        try:
            return _stat.S_ISREG(self.stat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def islink(self, path: PathArg) -> bool:
        try:
            return _stat.S_ISLNK(self.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def statvfs(self) -> os.statvfs_result:
        """``os.statvfs`` of the image (``f_flag`` has ``os.ST_RDONLY`` when read-only)."""
        bs, blocks, bfree, bavail, files, ffree, namemax = self._fs.statvfs()
        flag = os.ST_RDONLY if self.read_only else 0
        return os.statvfs_result((bs, bs, blocks, bfree, bavail, files, ffree, ffree, flag, namemax))

    # --- directories ------------------------------------------------------------

    def listdir(self, path: PathArg = "/") -> List[Union[str, bytes]]:
        """Names in directory ``path``, without "." and "..", in directory order."""
        return [_like(path, name) for name, _ino, _dt in self._fs.listdir(_b(path))]

    def scandir(self, path: PathArg = "/") -> _ScandirIterator:
        """``os.scandir``: an iterator (and context manager) of ``DirEntry``."""
        raw = _b(path)
        entries = [
            DirEntry(self, _like(path, name), _like(path, posixpath.join(raw, name)), ino, dt)
            for name, ino, dt in self._fs.listdir(raw)
        ]
        return _ScandirIterator(entries)

    def walk(
        self,
        top: PathArg = "/",
        topdown: bool = True,
        onerror: Optional[Callable[[OSError], None]] = None,
        followlinks: bool = False,
    ) -> Iterator[Tuple[Union[str, bytes], List, List]]:
        """``os.walk``: yields ``(dirpath, dirnames, filenames)``; with ``topdown``
        the caller may prune ``dirnames`` in place."""
        top = os.fspath(top)
        as_str = not isinstance(top, bytes)
        stack: list = [top]
        while stack:
            item = stack.pop()
            if isinstance(item, tuple):
                yield item
                continue
            try:
                dirs, files, links = self._fs.walk_step(_b(item), as_str)
            except OSError as e:
                if onerror is not None:
                    onerror(e)
                continue
            if topdown:
                yield item, dirs, files
                # The caller may have pruned dirs; links says which are symlinks.
                for name in reversed(dirs):
                    if followlinks or name not in links:
                        stack.append(posixpath.join(item, name))
            else:
                stack.append((item, dirs, files))
                for name in reversed(dirs):
                    if followlinks or name not in links:
                        stack.append(posixpath.join(item, name))

    def mkdir(self, path: PathArg, mode: int = 0o755) -> None:
        """``os.mkdir`` (no umask: ``mode`` is what the directory gets)."""
        self._fs.mkdir(_b(path), mode)

    def makedirs(self, name: PathArg, mode: int = 0o755, exist_ok: bool = False) -> None:
        """``os.makedirs``: missing parents too."""
        raw = _b(name).rstrip(b"/")
        head, tail = posixpath.split(raw)
        if head and tail and not self.exists(head):
            try:
                self.makedirs(head, mode, exist_ok=True)
            except FileExistsError:
                pass
        try:
            self.mkdir(raw, mode)
        except FileExistsError:
            if not exist_ok or not self.isdir(raw):
                raise
        except OSError as e:
            # "/" or "": nothing to make.
            if raw in (b"", b"/") and exist_ok:
                return
            raise e

    def rmdir(self, path: PathArg) -> None:
        self._fs.rmdir(_b(path))

    # --- names ------------------------------------------------------------------

    def remove(self, path: PathArg) -> None:
        """``os.remove``: a file, symlink or device (not a directory)."""
        self._fs.remove(_b(path))

    unlink = remove

    def rename(self, src: PathArg, dst: PathArg) -> None:
        """``os.rename`` (replaces ``dst`` as POSIX rename does)."""
        self._fs.rename(_b(src), _b(dst))

    replace = rename

    def symlink(self, src: PathArg, dst: PathArg) -> None:
        """``os.symlink``: ``dst`` becomes a symlink whose target is ``src``."""
        self._fs.symlink(_b(src), _b(dst))

    def readlink(self, path: PathArg) -> Union[str, bytes]:
        return _like(path, self._fs.readlink(_b(path)))

    def link(self, src: PathArg, dst: PathArg) -> None:
        """``os.link``: ``dst`` becomes another name of ``src``."""
        self._fs.link(_b(src), _b(dst))

    def mknod(self, path: PathArg, mode: int = 0o600 | _stat.S_IFREG, device: int = 0) -> None:
        """``os.mknod``: a device, fifo, socket or empty file."""
        self._fs.mknod(_b(path), mode, os.major(device), os.minor(device))

    # --- attributes -------------------------------------------------------------

    def chmod(self, path: PathArg, mode: int, *, follow_symlinks: bool = True) -> None:
        if not follow_symlinks:
            raise NotImplementedError("chmod: follow_symlinks unavailable on this platform")
        self._fs.setattr(_b(path), True, mode & 0o7777, None, None, None, None)

    def chown(self, path: PathArg, uid: int, gid: int, *, follow_symlinks: bool = True) -> None:
        """``os.chown``; -1 leaves that id as it is."""
        self._fs.setattr(
            _b(path), follow_symlinks, None, None if uid == -1 else uid, None if gid == -1 else gid, None, None
        )

    def lchown(self, path: PathArg, uid: int, gid: int) -> None:
        self.chown(path, uid, gid, follow_symlinks=False)

    def utime(
        self,
        path: PathArg,
        times: Optional[Tuple[float, float]] = None,
        *,
        ns: Optional[Tuple[int, int]] = None,
        follow_symlinks: bool = True,
    ) -> None:
        """``os.utime``: ``times`` in seconds or ``ns`` in nanoseconds, as (atime,
        mtime); neither sets both to now."""
        if times is not None and ns is not None:
            raise ValueError("utime: you may specify either 'times' or 'ns' but not both")
        if ns is not None:
            at, mt = _split_ns(ns[0]), _split_ns(ns[1])
        elif times is not None:
            at, mt = _split_float(times[0]), _split_float(times[1])
        else:
            at = mt = _split_ns(time.time_ns())
        self._fs.setattr(_b(path), follow_symlinks, None, None, None, at, mt)

    def truncate(self, path: PathArg, length: int) -> None:
        self._fs.truncate(_b(path), length)

    def getxattr(self, path: PathArg, attribute: Union[str, bytes], *, follow_symlinks: bool = True) -> bytes:
        """``os.getxattr``; a missing attribute is ``OSError`` errno ENODATA."""
        return self._fs.getxattr(_b(path), _b(attribute), follow_symlinks)

    def setxattr(
        self,
        path: PathArg,
        attribute: Union[str, bytes],
        value: bytes,
        flags: int = 0,
        *,
        follow_symlinks: bool = True,
    ) -> None:
        """``os.setxattr``; ``flags`` takes ``os.XATTR_CREATE`` / ``os.XATTR_REPLACE``."""
        create = bool(flags & os.XATTR_CREATE)
        replace = bool(flags & os.XATTR_REPLACE)
        self._fs.setxattr(_b(path), _b(attribute), bytes(value), create, replace, follow_symlinks)

    def listxattr(self, path: PathArg = "/", *, follow_symlinks: bool = True) -> List[str]:
        return [os.fsdecode(n) for n in self._fs.listxattr(_b(path), follow_symlinks)]

    def removexattr(self, path: PathArg, attribute: Union[str, bytes], *, follow_symlinks: bool = True) -> None:
        self._fs.removexattr(_b(path), _b(attribute), follow_symlinks)

    # --- file data ----------------------------------------------------------------

    def open(
        self,
        path: PathArg,
        mode: str = "rb",
        *,
        perm: int = 0o644,
        encoding: Optional[str] = None,
        errors: Optional[str] = None,
        newline: Optional[str] = None,
    ):
        """Open a file of the image like ``open()``: ``"rb"``, ``"wb"``, ``"r+b"``,
        ``"ab"``, ``"xb"`` (and ``"w+b"``...) give a ``File`` (``io.RawIOBase``, no
        buffering); a text mode (``"r"``, ``"w"``...) wraps it in
        ``io.TextIOWrapper``. A created file gets ``perm``."""
        binary, read, write, create, create_new, trunc, append = _parse_mode(mode)
        native = self._fs.open_file(_b(path), read, write, create, create_new, trunc, append, perm)
        raw = File(native, os.fspath(path), mode if binary else mode + "b", read, write, append)
        if binary:
            return raw
        buffered: io.BufferedIOBase
        if read and write:
            buffered = io.BufferedRandom(raw)
        elif write:
            buffered = io.BufferedWriter(raw)
        else:
            buffered = io.BufferedReader(raw)
        return io.TextIOWrapper(buffered, encoding=encoding or "utf-8", errors=errors, newline=newline)

    def read_bytes(self, path: PathArg) -> bytes:
        """``pathlib.Path.read_bytes``."""
        with self.open(path, "rb") as f:
            return f.readall()

    def write_bytes(self, path: PathArg, data: bytes, *, perm: int = 0o644) -> int:
        """``pathlib.Path.write_bytes``: create or replace the file's contents."""
        with self.open(path, "wb", perm=perm) as f:
            return f.write(data)

    # --- copies between the host and the image --------------------------------------

    def copy_in(self, src: PathArg, dst: PathArg, *, progress: Optional[Progress] = None) -> None:
        """Copy the host file or tree ``src`` into the image at ``dst`` (into it when
        ``dst`` is an existing directory, as ``cp -a``): data (holes kept), modes,
        owners, times, xattrs, symlinks, hard links within the copy, devices and
        fifos. An existing file is replaced, an existing directory merged.
        ``progress(path, done_bytes, total_bytes)`` is called after each file and
        each 1 MiB; the bytes are file sizes (holes count, hard links once)."""
        src_b = _b(src).rstrip(b"/") or b"/"
        dst_b = _b(dst)
        if self.isdir(dst_b):
            dst_b = posixpath.join(dst_b, posixpath.basename(src_b))
        total = _host_bytes(src_b)
        _CopyIn(self, progress, total).copy(src_b, dst_b)

    def copy_out(self, src: PathArg, dst: PathArg, *, progress: Optional[Progress] = None) -> None:
        """Copy the image's file or tree ``src`` to the host path ``dst`` (into it when
        ``dst`` is an existing directory): data (holes kept), modes, times, xattrs
        (the ``user.`` and ``trusted.``/``security.`` ones the caller may set),
        symlinks, hard links within the copy, devices and fifos; owners when run as
        root. Nothing is written through a symlink already at the destination.
        ``progress`` as for ``copy_in``."""
        src_b = _b(src)
        dst_b = _b(dst).rstrip(b"/") or b"/"
        if os.path.isdir(dst_b) and not os.path.islink(dst_b):
            name = posixpath.basename(src_b.rstrip(b"/"))
            if name:
                dst_b = posixpath.join(dst_b, name)
        sizes = {}
        st = self.lstat(src_b)
        if _stat.S_ISDIR(st.st_mode):
            for dirpath, _dirs, files in self.walk(src_b):
                for f in files:
                    s = self.lstat(posixpath.join(dirpath, f))
                    if _stat.S_ISREG(s.st_mode):
                        sizes[s.st_ino] = s.st_size
        elif _stat.S_ISREG(st.st_mode):
            sizes[st.st_ino] = st.st_size
        total = sum(sizes.values())
        _CopyOut(self, progress, total).copy(src_b, dst_b)

    # --- durability -------------------------------------------------------------------

    def sync(self) -> None:
        """``syncfs``: write every change back and commit the journal (durable)."""
        self._fs.sync()

    def close(self) -> None:
        """Write everything back, mark the image clean and release it. Idempotent."""
        self._fs.close()


def _host_bytes(path: bytes) -> int:
    """Bytes of the regular files under ``path`` (hard links counted once): what
    copy_in's progress counts to."""
    st = os.lstat(path)
    if _stat.S_ISREG(st.st_mode):
        return st.st_size
    sizes = {}
    if _stat.S_ISDIR(st.st_mode):
        for dirpath, _dirs, files in os.walk(path):
            for f in files:
                s = os.lstat(os.path.join(dirpath, f))
                if _stat.S_ISREG(s.st_mode):
                    sizes[(s.st_dev, s.st_ino)] = s.st_size
    return sum(sizes.values())


def _data_runs(fd: int, size: int) -> Iterator[Tuple[int, int]]:
    """(offset, length) of the data of the host file ``fd`` (its holes left out)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, min(end, size) - start
        pos = end


class _CopyIn:
    def __init__(self, fs: FileSystem, progress: Optional[Progress], total: int):
        self.fs = fs
        self.progress = progress
        self.total = total
        self.done = 0
        self.links: dict = {}

    def tick(self, path: bytes) -> None:
        if self.progress is not None:
            self.progress(os.fsdecode(path), self.done, self.total)

    def copy(self, src: bytes, dst: bytes) -> None:
        st = os.lstat(src)
        fs = self.fs
        if st.st_nlink > 1 and not _stat.S_ISDIR(st.st_mode):
            first = self.links.get((st.st_dev, st.st_ino))
            if first is not None:
                if fs.exists(dst) or fs.islink(dst):
                    fs.remove(dst)
                fs._fs.link(first, dst)
                return
            self.links[(st.st_dev, st.st_ino)] = dst
        if _stat.S_ISDIR(st.st_mode):
            if not fs.isdir(dst):
                fs.mkdir(dst, _stat.S_IMODE(st.st_mode))
            for name in sorted(os.listdir(src)):
                self.copy(os.path.join(src, name), posixpath.join(dst, name))
        else:
            if fs.islink(dst) or (fs.exists(dst) and not _stat.S_ISREG(st.st_mode)):
                fs.remove(dst)
            if _stat.S_ISREG(st.st_mode):
                self.copy_data(src, dst, st)
            elif _stat.S_ISLNK(st.st_mode):
                fs._fs.symlink(os.readlink(src), dst)
            else:
                fs.mknod(dst, st.st_mode, st.st_rdev)
        self.finish(src, dst, st)
        self.tick(src)

    def copy_data(self, src: bytes, dst: bytes, st: os.stat_result) -> None:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            base = self.done
            with self.fs.open(dst, "wb", perm=_stat.S_IMODE(st.st_mode)) as out:
                for start, length in _data_runs(fd, st.st_size):
                    off = start
                    while off < start + length:
                        data = os.pread(fd, min(_CHUNK, start + length - off), off)
                        if not data:
                            break
                        out.seek(off)
                        out.write(data)
                        off += len(data)
                        self.done = base + off
                        self.tick(src)
                out.truncate(st.st_size)
            self.done = base + st.st_size
        finally:
            os.close(fd)

    def finish(self, src: bytes, dst: bytes, st: os.stat_result) -> None:
        fs = self.fs
        fs.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
        if not _stat.S_ISLNK(st.st_mode):
            fs.chmod(dst, _stat.S_IMODE(st.st_mode))
        try:
            names = os.listxattr(src, follow_symlinks=False)
        except OSError:
            names = []
        for name in names:
            try:
                value = os.getxattr(src, name, follow_symlinks=False)
            except OSError:
                continue
            fs.setxattr(dst, name, value, follow_symlinks=False)
        fs.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


class _CopyOut:
    def __init__(self, fs: FileSystem, progress: Optional[Progress], total: int):
        self.fs = fs
        self.progress = progress
        self.total = total
        self.done = 0
        self.links: dict = {}
        self.root = os.geteuid() == 0

    def tick(self, path: bytes) -> None:
        if self.progress is not None:
            self.progress(os.fsdecode(path), self.done, self.total)

    def copy(self, src: bytes, dst: bytes) -> None:
        fs = self.fs
        st = fs.lstat(src)
        if st.st_nlink > 1 and not _stat.S_ISDIR(st.st_mode):
            first = self.links.get(st.st_ino)
            if first is not None:
                _remove_host_nondir(dst)
                os.link(first, dst, follow_symlinks=False)
                return
            self.links[st.st_ino] = dst
        if _stat.S_ISDIR(st.st_mode):
            try:
                os.mkdir(dst, 0o700)
            except FileExistsError:
                if not _stat.S_ISDIR(os.lstat(dst).st_mode):
                    raise
            for name in fs.listdir(src):
                raw = os.fsencode(name)
                self.copy(posixpath.join(src, raw), os.path.join(dst, raw))
        else:
            if _stat.S_ISREG(st.st_mode):
                self.copy_data(src, dst, st)
            else:
                _remove_host_nondir(dst)
                if _stat.S_ISLNK(st.st_mode):
                    os.symlink(fs.readlink(src), dst)
                else:
                    os.mknod(dst, st.st_mode, st.st_rdev)
        self.finish(src, dst, st)
        self.tick(src)

    def copy_data(self, src: bytes, dst: bytes, st: os.stat_result) -> None:
        # A symlink (or anything but a regular file) at dst is replaced, never
        # written through.
        try:
            if not _stat.S_ISREG(os.lstat(dst).st_mode):
                _remove_host_nondir(dst)
        except FileNotFoundError:
            pass
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            base = self.done
            with self.fs.open(src, "rb") as f:
                pos = 0
                while pos < st.st_size:
                    try:
                        start = f.seek(pos, os.SEEK_DATA)
                    except OSError:
                        break
                    end = min(f.seek(start, os.SEEK_HOLE), st.st_size)
                    f.seek(start)
                    off = start
                    while off < end:
                        data = f.read(min(_CHUNK, end - off))
                        if not data:
                            break
                        os.pwrite(fd, data, off)
                        off += len(data)
                        self.done = base + off
                        self.tick(src)
                    pos = end
            os.ftruncate(fd, st.st_size)
            self.done = base + st.st_size
        finally:
            os.close(fd)

    def finish(self, src: bytes, dst: bytes, st: os.stat_result) -> None:
        fs = self.fs
        for name in fs.listxattr(src, follow_symlinks=False):
            value = fs.getxattr(src, name, follow_symlinks=False)
            try:
                os.setxattr(dst, name, value, follow_symlinks=False)
            except OSError:
                # system.posix_acl_* on a host filesystem without ACLs, security.*
                # the caller may not set: the copy goes on without them, as cp -a.
                pass
        if self.root:
            os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
        if not _stat.S_ISLNK(st.st_mode):
            os.chmod(dst, _stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _remove_host_nondir(path: bytes) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if _stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", os.fsdecode(path))
    os.unlink(path)
