"""Every error the engine reports reaches Python as the exception a Python user
catches: the OSError subclass `os` would raise, with errno and filename set;
corruption and non-ext4 images as their own OSError subclasses."""

import errno
import io
import os
import subprocess

import pytest

import rext4
from conftest import loop_mount, mkfs_ext4, need_tool


@pytest.fixture
def image(tmp):
    img = os.path.join(tmp, "e.img")
    rext4.mkfs(img, "32M", block_size=4096)
    with rext4.open(img, writable=True) as fs:
        fs.makedirs("/d/sub")
        fs.write_bytes("/d/f", b"data")
        fs.symlink("f", "/d/link")
        fs.symlink("loop2", "/d/loop1")
        fs.symlink("loop1", "/d/loop2")
    return img


# Every variant of rext4::Error: the exception class and errno it must become.
MAPPING = {
    "Io": (OSError, errno.EIO),
    "NotExt4": (rext4.NotExt4Error, errno.EINVAL),
    "Corrupted": (rext4.CorruptedError, errno.EBADMSG),
    "Unsupported": (OSError, errno.EOPNOTSUPP),
    "NotFound": (FileNotFoundError, errno.ENOENT),
    "NotADirectory": (NotADirectoryError, errno.ENOTDIR),
    "IsADirectory": (IsADirectoryError, errno.EISDIR),
    "NotASymlink": (OSError, errno.EINVAL),
    "Loop": (OSError, errno.ELOOP),
    "NameTooLong": (OSError, errno.ENAMETOOLONG),
    "InvalidInput": (OSError, errno.EINVAL),
    "NotOpenFor": (OSError, errno.EBADF),
    "ReadOnly": (OSError, errno.EROFS),
    "Exists": (FileExistsError, errno.EEXIST),
    "NotEmpty": (OSError, errno.ENOTEMPTY),
    "NoSpace": (OSError, errno.ENOSPC),
    "TooManyLinks": (OSError, errno.EMLINK),
    "FileTooLarge": (OSError, errno.EFBIG),
    "NotPermitted": (PermissionError, errno.EPERM),
    "PermissionDenied": (PermissionError, errno.EACCES),
    "ShutDown": (OSError, errno.EIO),
    "InUse": (OSError, errno.EBUSY),
    "BadImage": (OSError, errno.EBADMSG),
}


@pytest.mark.parametrize("kind", sorted(MAPPING))
def test_every_engine_error_maps_to_its_exception(kind):
    cls, code = MAPPING[kind]
    with pytest.raises(OSError) as info:
        rext4._rext4._raise_engine_error(kind)
    assert type(info.value) is cls, f"{kind}: {type(info.value).__name__}"
    assert info.value.errno == code
    assert info.value.filename == "/test"
    assert info.value.strerror == os.strerror(code) or info.value.strerror.startswith(os.strerror(code) + ": ")
    if kind == "Corrupted":
        assert info.value.block == 7


def test_the_mapping_table_names_every_engine_error():
    # A variant added to the engine and not to MAPPING fails here (the native module
    # refuses names it does not know, so this also checks the test's spelling).
    with pytest.raises(ValueError):
        rext4._rext4._raise_engine_error("NoSuchVariant")
    lib = os.path.join(os.path.dirname(__file__), "../../../crates/engine/src/error.rs")
    with open(lib) as f:
        text = f.read()
    enum = text[text.index("pub enum Error {") : text.index("\n}\n", text.index("pub enum Error {"))]
    variants = set()
    for line in enum.splitlines():
        line = line.strip()
        if line and line[0].isupper():
            variants.add(line.split("(")[0].split(" ")[0].split("{")[0].rstrip(","))
    assert variants == set(MAPPING)


def raises(cls, code, fn, *args, **kw):
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    assert isinstance(info.value, cls), f"{type(info.value).__name__} is not {cls.__name__}"
    assert info.value.errno == code, f"errno {info.value.errno} != {code}"
    return info.value


def test_errors_of_real_calls(image):
    with rext4.open(image, writable=True) as fs:
        e = raises(FileNotFoundError, errno.ENOENT, fs.stat, "/nope")
        assert e.filename == "/nope"
        raises(FileNotFoundError, errno.ENOENT, fs.open, "/nope", "rb")
        raises(FileNotFoundError, errno.ENOENT, fs.remove, "/d/nope")
        raises(FileNotFoundError, errno.ENOENT, fs.mkdir, "/nope/x")
        raises(NotADirectoryError, errno.ENOTDIR, fs.listdir, "/d/f")
        raises(NotADirectoryError, errno.ENOTDIR, fs.stat, "/d/f/x")
        raises(NotADirectoryError, errno.ENOTDIR, fs.rmdir, "/d/f")
        raises(IsADirectoryError, errno.EISDIR, fs.open, "/d", "rb")
        raises(IsADirectoryError, errno.EISDIR, fs.open, "/d", "wb")
        raises(IsADirectoryError, errno.EISDIR, fs.remove, "/d")
        raises(FileExistsError, errno.EEXIST, fs.mkdir, "/d")
        raises(FileExistsError, errno.EEXIST, fs.open, "/d/f", "xb")
        raises(FileExistsError, errno.EEXIST, fs.symlink, "x", "/d/f")
        raises(FileExistsError, errno.EEXIST, fs.link, "/d/f", "/d/link")
        raises(FileExistsError, errno.EEXIST, fs.makedirs, "/d/sub")
        fs.setxattr("/d/f", "user.a", b"1", os.XATTR_CREATE)
        raises(FileExistsError, errno.EEXIST, fs.setxattr, "/d/f", "user.a", b"1", os.XATTR_CREATE)
        raises(OSError, errno.ENODATA, fs.getxattr, "/d/f", "user.missing")
        raises(OSError, errno.ENODATA, fs.removexattr, "/d/f", "user.missing")
        raises(OSError, errno.ENODATA, fs.setxattr, "/d/f", "user.missing", b"", os.XATTR_REPLACE)
        raises(OSError, errno.ENOTEMPTY, fs.rmdir, "/d")
        fs.makedirs("/full/x")
        raises(OSError, errno.ENOTEMPTY, fs.rename, "/d/sub", "/full")
        raises(OSError, errno.ELOOP, fs.stat, "/d/loop1")
        raises(OSError, errno.ENAMETOOLONG, fs.stat, "/" + "n" * 256)
        raises(OSError, errno.ENAMETOOLONG, fs.mkdir, "/" + "n" * 256)
        raises(OSError, errno.EINVAL, fs.readlink, "/d/f")
        raises(OSError, errno.EINVAL, fs.rename, "/d", "/d/sub/inside")
        raises(OSError, errno.EFBIG, fs.truncate, "/d/f", 1 << 50)
        # user.* xattrs only on files and directories, as on Linux.
        raises(PermissionError, errno.EPERM, fs.setxattr, "/d/link", "user.x", b"1", follow_symlinks=False)
        # link(2) of a directory: EPERM, as os.link gives on Linux.
        raises(PermissionError, errno.EPERM, fs.link, "/d/sub", "/d/sub-link")
        raises(OSError, errno.EOPNOTSUPP, fs.setxattr, "/d/f", "nonsense.name", b"1")


def test_read_only_image_refuses_writes_with_erofs(image):
    with rext4.open(image) as fs:
        assert fs.read_only and fs.statvfs().f_flag & os.ST_RDONLY
        raises(OSError, errno.EROFS, fs.mkdir, "/x")
        raises(OSError, errno.EROFS, fs.open, "/x", "wb")
        raises(OSError, errno.EROFS, fs.setxattr, "/d/f", "user.x", b"1")
        raises(OSError, errno.EROFS, fs.chmod, "/d/f", 0o600)
        raises(OSError, errno.EROFS, fs.open, "/d/f", "r+b")


def test_no_space_is_enospc(tmp):
    img = os.path.join(tmp, "small.img")
    rext4.mkfs(img, "4M")
    with rext4.open(img, writable=True) as fs:
        with pytest.raises(OSError) as info:
            with fs.open("/fill", "wb") as f:
                for _ in range(64):
                    f.write(b"\xab" * (128 << 10))
        assert info.value.errno == errno.ENOSPC
    # Full, not broken: the image is consistent.
    from conftest import fsck_clean

    fsck_clean(img)


def test_too_many_links_is_emlink(tmp):
    img = os.path.join(tmp, "links.img")
    # Without dir_nlink a directory holds at most 65000 links: subdirectories count.
    rext4.mkfs(img, "64M", block_size=4096, inodes=70000, features="^dir_nlink,^metadata_csum")
    with rext4.open(img, writable=True) as fs:
        fs.write_bytes("/f", b"x")
        with pytest.raises(OSError) as info:
            for i in range(65001):
                fs.link("/f", f"/l{i}")
        assert info.value.errno == errno.EMLINK
        assert fs.stat("/f").st_nlink == 65000


def test_in_use_is_ebusy(image):
    with rext4.open(image, writable=True):
        raises(OSError, errno.EBUSY, rext4.open, image, writable=True)
        raises(OSError, errno.EBUSY, rext4.mkfs, image, "32M")
    with loop_mount(image, ro=False):
        raises(OSError, errno.EBUSY, rext4.open, image, writable=True)
        # Reading goes on, with a warning saying who writes the image.
        with rext4.open(image) as fs:
            assert fs.listdir("/d") and fs.warnings


def test_not_ext4_and_missing_image(tmp):
    zeros = os.path.join(tmp, "zeros.img")
    with open(zeros, "wb") as f:
        f.truncate(8 << 20)
    e = raises(rext4.NotExt4Error, errno.EINVAL, rext4.open, zeros)
    assert e.filename == zeros
    raises(FileNotFoundError, errno.ENOENT, rext4.open, os.path.join(tmp, "missing.img"))
    raises(IsADirectoryError, errno.EISDIR, rext4.open, tmp)


def test_unsupported_feature_is_eopnotsupp(tmp):
    img = os.path.join(tmp, "encrypt.img")
    mkfs_ext4(img, "16M", "-O", "encrypt")
    raises(OSError, errno.EOPNOTSUPP, rext4.open, img)


def test_corruption_is_corrupted_error(tmp):
    need_tool("debugfs")
    img = os.path.join(tmp, "c.img")
    rext4.mkfs(img, "16M", block_size=4096)
    with rext4.open(img, writable=True) as fs:
        fs.mkdir("/victim")
        for i in range(20):
            fs.write_bytes(f"/victim/f{i}", b"x")
    out = subprocess.run(["debugfs", "-R", "bmap /victim 0", img], capture_output=True, text=True)
    block = int(out.stdout.strip())
    with open(img, "r+b") as f:
        f.seek(block * 4096 + 100)
        f.write(b"\xff" * 64)
    with rext4.open(img) as fs:
        assert fs.listdir("/") == ["lost+found", "victim"]
        e = raises(rext4.CorruptedError, errno.EBADMSG, fs.listdir, "/victim")
        assert e.filename == "/victim"
        assert e.block == block


def test_closed_objects_raise_value_error(image):
    fs = rext4.open(image)
    f = fs.open("/d/f")
    f.close()
    with pytest.raises(ValueError):
        f.read()
    with pytest.raises(ValueError):
        f.seek(0)
    fs.close()
    fs.close()
    assert fs.closed
    with pytest.raises(ValueError):
        fs.stat("/")
    with pytest.raises(ValueError):
        fs.listdir("/")


def test_wrong_mode_operations(image):
    with rext4.open(image, writable=True) as fs:
        with fs.open("/d/f", "rb") as f:
            with pytest.raises(io.UnsupportedOperation):
                f.write(b"x")
            with pytest.raises(io.UnsupportedOperation):
                f.truncate(0)
        with fs.open("/d/new", "wb") as f:
            with pytest.raises(io.UnsupportedOperation):
                f.read()
        for bad in ("", "rw", "rr", "q", "rbt", "r+b+"):
            with pytest.raises(ValueError):
                fs.open("/d/f", bad)
        with fs.open("/d/f", "rb") as f:
            with pytest.raises(OSError) as info:
                f.seek(-1)
            assert info.value.errno == errno.EINVAL
            with pytest.raises(OSError) as info:
                f.seek(100, os.SEEK_DATA)
            assert info.value.errno == errno.ENXIO
        with pytest.raises(NotImplementedError):
            fs.chmod("/d/link", 0o600, follow_symlinks=False)
