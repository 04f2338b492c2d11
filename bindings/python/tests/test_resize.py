"""rext4.resize: an image grown to 4x and shrunk back to min keeps its tree and is
e2fsck -fn clean at each step; bad sizes and a held image raise the errno they should,
the image unchanged."""

import errno
import hashlib
import os
import random

import pytest

import rext4
from conftest import fsck_clean


def tree(img: str) -> dict:
    """Every path of the image with its type, mode and content hash (symlink target)."""
    out = {}
    with rext4.open(img) as fs:
        for dirpath, dirnames, filenames in fs.walk("/"):
            for name in dirnames + filenames:
                p = dirpath.rstrip("/") + "/" + name
                st = fs.lstat(p)
                if fs.islink(p):
                    what = fs.readlink(p)
                elif fs.isdir(p):
                    what = None
                else:
                    what = hashlib.sha256(fs.read_bytes(p)).hexdigest()
                out[p] = (st.st_mode, what)
    return out


def populate(img: str, tag: str, seed: int) -> None:
    rng = random.Random(seed)
    with rext4.open(img, writable=True) as fs:
        for d in range(6):
            fs.makedirs(f"/{tag}/d{d}")
            for f in range(10):
                data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 100, 5000, 70000])))
                fs.write_bytes(f"/{tag}/d{d}/f{f}", data)
            fs.symlink(f"/{tag}/d{d}/f0", f"/{tag}/d{d}/link")


def test_grow_4x_then_min(tmp):
    img = os.path.join(tmp, "r.img")
    rext4.mkfs(img, "16M", block_size=1024)
    populate(img, "a", 1)
    before = tree(img)
    r = rext4.resize(img, 64 << 20)
    assert (r.block_size, r.old_blocks, r.new_blocks) == (1024, 16384, 65536)
    assert os.path.getsize(img) == 64 << 20
    fsck_clean(img)
    assert tree(img) == before
    # More files, some in the new groups, then the smallest size.
    populate(img, "b", 2)
    before = tree(img)
    r = rext4.resize(img, "min")
    assert r.new_blocks < 65536 and r.old_blocks == 65536
    assert os.path.getsize(img) == r.new_blocks * 1024
    fsck_clean(img)
    assert tree(img) == before


def test_bad_sizes_and_a_held_image_change_nothing(tmp):
    img = os.path.join(tmp, "r.img")
    rext4.mkfs(img, "16M", block_size=4096)
    populate(img, "a", 3)
    with rext4.open(img, writable=True):
        with pytest.raises(OSError) as e:
            rext4.resize(img, 32 << 20)
        assert e.value.errno == errno.EBUSY
    with open(img, "rb") as f:
        orig = f.read()
    for size, err in [(0, errno.EINVAL), (64 << 10, errno.EINVAL), (1 << 62, errno.EINVAL)]:
        with pytest.raises(OSError) as e:
            rext4.resize(img, size)
        assert e.value.errno in (err, errno.ENOSPC), (size, e.value)
    with pytest.raises(ValueError):
        rext4.resize(img, -5)
    with open(img, "rb") as f:
        assert f.read() == orig
    fsck_clean(img)
