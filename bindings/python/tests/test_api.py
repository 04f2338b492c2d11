"""The Python API behaves as Python's own: the same sequence of file operations on a
host file (builtin open, os) and on an image file (rext4) gives the same results;
scandir/walk/stat/xattr calls follow os; the GIL is released during I/O."""

import bisect
import io
import os
import random
import stat
import sys
import threading
import time

import pytest

import rext4
from conftest import fsck_clean


@pytest.fixture
def fs(tmp):
    img = os.path.join(tmp, "api.img")
    rext4.mkfs(img, "64M", block_size=4096)
    with rext4.open(img, writable=True) as fs:
        yield fs


def file_ops(f, rng: random.Random, log: list) -> None:
    """A random sequence of RawIOBase calls, every result logged."""
    for _ in range(300):
        op = rng.choice(["read", "readinto", "write", "seek", "tell", "truncate", "readall"])
        if op == "read":
            log.append(("read", f.read(rng.choice([0, 1, 100, 5000, 70000, 200000]))))
        elif op == "readinto":
            buf = bytearray(rng.choice([1, 4096, 9000]))
            n = f.readinto(buf)
            log.append(("readinto", n, bytes(buf[:n])))
        elif op == "write":
            data = bytes(rng.randrange(256) for _ in range(rng.choice([1, 10, 4096, 10000])))
            log.append(("write", f.write(data)))
        elif op == "seek":
            whence = rng.choice([os.SEEK_SET, os.SEEK_CUR, os.SEEK_END])
            off = rng.randrange(0, 300000) if whence == os.SEEK_SET else rng.randrange(-1000, 1000)
            try:
                log.append(("seek", f.seek(off, whence)))
            except OSError as e:
                log.append(("seek-error", e.errno))
        elif op == "tell":
            log.append(("tell", f.tell()))
        elif op == "truncate":
            size = rng.choice([None, rng.randrange(0, 200000)])
            log.append(("truncate", f.truncate(size)))
        elif op == "readall":
            log.append(("readall", f.readall()))


@pytest.mark.parametrize("mode", ["r+b", "w+b", "a+b"])
def test_file_calls_match_python_files(fs, tmp, mode):
    host = os.path.join(tmp, "host-file")
    seed = bytes(range(256)) * 300
    with open(host, "wb") as f:
        f.write(seed)
    fs.write_bytes("/file", seed)
    theirs, ours = [], []
    with open(host, mode, buffering=0) as f:
        file_ops(f, random.Random(7), theirs)
    with fs.open("/file", mode) as f:
        assert isinstance(f, io.RawIOBase)
        file_ops(f, random.Random(7), ours)
    assert ours == theirs
    with open(host, "rb") as f:
        assert fs.read_bytes("/file") == f.read()


def test_text_mode_and_buffered_wrappers(fs):
    with fs.open("/t.txt", "w", encoding="utf-8") as t:
        t.write("ligne un\nzwei — drei\n")
    with fs.open("/t.txt", "r", encoding="utf-8") as t:
        assert t.readlines() == ["ligne un\n", "zwei — drei\n"]
    with fs.open("/t.txt", "rb") as raw, io.BufferedReader(raw) as b:
        assert b.readline() == b"ligne un\n"


def test_seek_data_and_hole(fs):
    with fs.open("/sparse", "wb") as f:
        f.seek(1 << 20)
        f.write(b"x" * 4096)
        f.truncate(4 << 20)
    with fs.open("/sparse", "rb") as f:
        assert f.seek(0, os.SEEK_DATA) == 1 << 20
        assert f.seek(1 << 20, os.SEEK_HOLE) == (1 << 20) + 4096
        assert f.read(4) == b"\0\0\0\0"
        assert f.stat().st_blocks == 8


def test_stat_fields(fs):
    fs.write_bytes("/f", b"12345", perm=0o640)
    fs.chown("/f", 1001, 1002)
    fs.utime("/f", ns=(1_000_000_001_000_000_002, 1_000_000_003_000_000_004))
    st = fs.stat("/f")
    assert isinstance(st, os.stat_result)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert (st.st_uid, st.st_gid, st.st_size, st.st_nlink) == (1001, 1002, 5, 1)
    assert st.st_atime_ns == 1_000_000_001_000_000_002
    assert st.st_mtime_ns == 1_000_000_003_000_000_004
    assert st.st_mtime == pytest.approx(1_000_000_003.000_000_004)
    assert st[stat.ST_MTIME] == 1_000_000_003
    fs.sync()  # delayed allocation: blocks are counted once written back
    assert st.st_blksize == 4096 and fs.stat("/f").st_blocks == 8
    assert fs.birthtime_ns("/f") is not None
    fs.symlink("f", "/l")
    assert stat.S_ISLNK(fs.lstat("/l").st_mode) and fs.stat("/l").st_ino == st.st_ino
    fs.utime("/l", (5.5, 6.25), follow_symlinks=False)
    assert fs.lstat("/l").st_mtime_ns == 6_250_000_000
    assert fs.stat("/f").st_mtime_ns == 1_000_000_003_000_000_004
    fs.chown("/f", -1, 7)
    assert (fs.stat("/f").st_uid, fs.stat("/f").st_gid) == (1001, 7)
    fs.mknod("/dev0", 0o600 | stat.S_IFCHR, os.makedev(4, 5))
    assert fs.stat("/dev0").st_rdev == os.makedev(4, 5)


def test_names_follow_the_argument_type(fs):
    fs.mkdir("/d")
    fs.write_bytes("/d/\xe9t\xe9", b"")
    fs.write_bytes(b"/d/raw\xff", b"")
    names = fs.listdir("/d")
    assert set(names) == {"été", "raw\udcff"}
    assert set(fs.listdir(b"/d")) == {"été".encode(), b"raw\xff"}
    entries = {e.name: e for e in fs.scandir("/d")}
    assert entries["été"].path == "/d/été" and entries["été"].is_file()
    assert os.fspath(entries["été"]) == "/d/été"
    for top in ("/", b"/"):
        for dirpath, dirnames, filenames in fs.walk(top):
            assert isinstance(dirpath, type(top))
            assert all(isinstance(n, type(top)) for n in dirnames + filenames)


def test_walk_prunes_and_bottom_up(fs):
    fs.makedirs("/a/b/c")
    fs.makedirs("/a/skip/deep")
    fs.write_bytes("/a/b/c/f", b"")
    fs.symlink("/a/b", "/a/link-to-b")
    seen = []
    for d, dirs, files in fs.walk("/a"):
        if "skip" in dirs:
            dirs.remove("skip")
        seen.append(d)
    assert "/a/skip" not in seen and "/a/skip/deep" not in seen and "/a/b/c" in seen
    assert "/a/link-to-b" not in seen
    assert "/a/link-to-b" in [d for d, _, _ in fs.walk("/a", followlinks=True)]
    order = [d for d, _, _ in fs.walk("/a", topdown=False)]
    assert order.index("/a/b/c") < order.index("/a/b") < order.index("/a")
    dirs_of_a = next(dirs for d, dirs, _ in fs.walk("/a"))
    assert sorted(dirs_of_a) == ["b", "link-to-b", "skip"]
    errors = []
    assert list(fs.walk("/missing", onerror=errors.append)) == []
    assert isinstance(errors[0], FileNotFoundError)


def test_xattrs_and_statvfs(fs):
    fs.write_bytes("/x", b"")
    fs.setxattr("/x", "user.a", b"1")
    fs.setxattr("/x", b"user.b", b"2" * 3000)
    assert sorted(fs.listxattr("/x")) == ["user.a", "user.b"]
    assert fs.getxattr("/x", "user.b") == b"2" * 3000
    fs.removexattr("/x", "user.a")
    assert fs.listxattr("/x") == ["user.b"]
    before = fs.statvfs()
    fs.write_bytes("/big", b"z" * (8 << 20))
    fs.sync()
    after = fs.statvfs()
    assert before.f_bsize == 4096 and before.f_namemax == 255
    assert before.f_bfree - after.f_bfree >= 2048
    assert before.f_ffree - after.f_ffree == 1


def test_makedirs_and_exists(fs):
    fs.makedirs("/p/q/r", mode=0o700)
    assert stat.S_IMODE(fs.stat("/p/q/r").st_mode) == 0o700
    with pytest.raises(FileExistsError):
        fs.makedirs("/p/q/r")
    fs.makedirs("/p/q/r", exist_ok=True)
    fs.write_bytes("/p/file", b"")
    with pytest.raises(FileExistsError):
        fs.makedirs("/p/file", exist_ok=True)
    assert fs.exists("/p/q") and fs.isdir("/p/q") and fs.isfile("/p/file")
    assert not fs.exists("/p/file/x") and not fs.islink("/p/q")


def test_gil_is_released_during_io(tmp):
    """While one thread is inside a native read or write, another runs Python code.
    A spinning thread stamps each turn; a call that kept the GIL could only have
    turns stamped at its very ends (before it took the GIL or within one switch
    interval after it gave it back), so turns are counted in the middle half of each
    call only."""
    img = os.path.join(tmp, "gil.img")
    rext4.mkfs(img, "256M", block_size=4096)
    fs = rext4.open(img, writable=True)
    fs.write_bytes("/big", os.urandom(1 << 20) * 64)
    f = fs.open("/big", "rb")
    w = fs.open("/w", "wb")
    payload = b"w" * (64 << 20)
    stamps = []
    running = [True]
    calls = []

    def spin():
        while running[0]:
            stamps.append(time.perf_counter_ns())

    def timed(fn, *args):
        start = time.perf_counter_ns()
        fn(*args)
        calls.append((start, time.perf_counter_ns()))

    def io_thread():
        try:
            for _ in range(4):
                timed(f._f.read_at, 64 << 20, 0)
                timed(w._f.write_at, payload, 0)
        finally:
            running[0] = False

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        t1 = threading.Thread(target=spin)
        t2 = threading.Thread(target=io_thread)
        t1.start()
        t2.start()
        t2.join()
        t1.join()
    finally:
        sys.setswitchinterval(old)
        f.close()
        w.close()
        fs.close()
    inside = []
    for start, end in calls:
        quarter = (end - start) // 4
        inside.append(bisect.bisect_left(stamps, end - quarter) - bisect.bisect_right(stamps, start + quarter))
    # Reads at even, writes at odd positions: most calls of each let the spinner in.
    assert sum(1 for n in inside[0::2] if n > 0) >= 3, inside
    assert sum(1 for n in inside[1::2] if n > 0) >= 3, inside


def test_threads_share_one_filesystem(fs):
    for i in range(4):
        fs.write_bytes(f"/t{i}", bytes([i]) * (3 << 20))
    results = {}

    def work(i):
        with fs.open(f"/t{i}", "rb") as f:
            results[i] = f.read()
        fs.write_bytes(f"/w{i}", bytes([i]) * 1000)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == bytes([i]) * (3 << 20) for i in range(4))
    assert all(fs.read_bytes(f"/w{i}") == bytes([i]) * 1000 for i in range(4))


def test_mkfs_options_and_reopen(tmp):
    img = os.path.join(tmp, "opts.img")
    rext4.mkfs(img, 32 << 20, block_size=1024, inodes=5000, label="py-label", uuid="01234567-89ab-cdef-0123-456789abcdef")
    with rext4.open(img) as fs:
        v = fs.statvfs()
        assert v.f_bsize == 1024 and abs(v.f_files - 5000) < 100
        assert fs.listdir("/") == ["lost+found"]
    with pytest.raises(ValueError):
        rext4.mkfs(img, "32M", features="no_such_feature")
    with pytest.raises(ValueError):
        rext4.mkfs(img, "32M", uuid="not-a-uuid")


def test_copy_in_progress_and_replace(fs, tmp):
    src = os.path.join(tmp, "tree")
    os.makedirs(os.path.join(src, "sub"))
    with open(os.path.join(src, "sub/a"), "wb") as f:
        f.write(b"a" * (3 << 20))
    with open(os.path.join(src, "b"), "wb") as f:
        f.write(b"b" * 10)
    calls = []
    fs.copy_in(src, "/", progress=lambda p, d, t: calls.append((p, d, t)))
    assert fs.read_bytes("/tree/sub/a") == b"a" * (3 << 20)
    assert calls[-1][1:] == ((3 << 20) + 10, (3 << 20) + 10)
    assert [d for _, d, _ in calls] == sorted(d for _, d, _ in calls)
    assert any(p.endswith("sub/a") and d < (3 << 20) for p, d, _ in calls)
    with open(os.path.join(src, "b"), "wb") as f:
        f.write(b"new")
    fs.copy_in(src, "/")
    assert fs.read_bytes("/tree/b") == b"new"
    fs.copy_in(os.path.join(src, "b"), "/single")
    assert fs.read_bytes("/single") == b"new"


def test_stubs_name_what_the_native_module_has():
    """_rext4.pyi declares exactly the native module's functions, classes and methods."""
    import ast

    stub = os.path.join(os.path.dirname(rext4.__file__), "_rext4.pyi")
    tree = ast.parse(open(stub).read())
    declared = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            declared[node.name] = None
        elif isinstance(node, ast.ClassDef):
            declared[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    native = rext4._rext4
    public = {n for n in dir(native) if not n.startswith("__")}
    assert set(declared) == public
    for name, methods in declared.items():
        if methods is None or name.endswith("Error"):
            continue
        have = {m for m in dir(getattr(native, name)) if not m.startswith("__")}
        assert methods == have, name


def test_mkfs_reproducible_from_an_archive_with_owners_devices_and_labels(tmp, monkeypatch):
    """mkfs(source=TAR, seed=..., uid_map=..., device_table=..., file_contexts=...)
    with SOURCE_DATE_EPOCH set: two builds a second apart are byte-identical, e2fsck
    clean, and hold the mapped owners, the devices and the labels."""
    import io as _io
    import tarfile
    import time as _time

    archive = os.path.join(tmp, "t.tar")
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as t:
        for name, uid, data in [("etc/hosts", 100000, b"127.0.0.1 localhost\n"), ("bin/sh", 100005, b"#!")]:
            i = tarfile.TarInfo(name)
            i.uid, i.gid, i.mode, i.mtime, i.size = uid, uid, 0o755, 1_000_000_000, len(data)
            t.addfile(i, _io.BytesIO(data))
        i = tarfile.TarInfo("../escape")
        t.addfile(i, _io.BytesIO(b""))
    table = os.path.join(tmp, "devices")
    with open(table, "w") as f:
        f.write("/dev d 755 0 0 - - - - -\n/dev/console c 600 0 5 5 1 - - -\n")
    contexts = os.path.join(tmp, "file_contexts")
    with open(contexts, "w") as f:
        f.write("/.* system_u:object_r:default_t:s0\n/bin(/.*)? system_u:object_r:bin_t:s0\n")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    images = []
    for n in range(2):
        img = os.path.join(tmp, f"r{n}.img")
        refused = rext4.mkfs(
            img,
            "16M",
            seed="python",
            source=archive,
            uid_map="0:100000:65536",
            gid_map="0:100000:65536",
            device_table=table,
            file_contexts=contexts,
        )
        assert len(refused) == 1 and "'..'" in refused[0]
        images.append(img)
        _time.sleep(1.1)
    with open(images[0], "rb") as a, open(images[1], "rb") as b:
        assert a.read() == b.read()
    fsck_clean(images[0])
    with rext4.open(images[0]) as fs:
        st = fs.lstat("/bin/sh")
        assert (st.st_uid, st.st_gid) == (5, 5)
        assert fs.lstat("/etc/hosts").st_uid == 0
        st = fs.lstat("/dev/console")
        assert os.major(st.st_rdev) == 5 and os.minor(st.st_rdev) == 1
        assert fs.getxattr("/bin/sh", "security.selinux") == b"system_u:object_r:bin_t:s0\0"
        assert fs.getxattr("/etc", "security.selinux") == b"system_u:object_r:default_t:s0\0"
        assert fs.lstat("/etc/hosts").st_mtime == 1_000_000_000
        assert fs.lstat("/bin").st_mtime <= 1_700_000_000
    with pytest.raises(ValueError):
        rext4.mkfs(os.path.join(tmp, "bad.img"), "8M", source=archive, uid_map="0:1")


def test_mkfs_from_a_directory_maps_owners(tmp):
    """mkfs(source=DIR, uid_map=..., gid_map=..., owner=...): the copied tree's owners
    mapped from the sources' ids (lost+found left as mkfs made it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give source files other owners")
    src = os.path.join(tmp, "src")
    os.makedirs(os.path.join(src, "d"))
    with open(os.path.join(src, "d", "f"), "wb") as f:
        f.write(b"x")
    os.chown(os.path.join(src, "d", "f"), 100007, 100009)
    os.chown(os.path.join(src, "d"), 100000, 100000)
    os.chown(src, 100000, 100000)
    img = os.path.join(tmp, "m.img")
    assert rext4.mkfs(img, "16M", source=src, uid_map="0:100000:65536", gid_map="0:100000:65536") == []
    fsck_clean(img)
    with rext4.open(img) as fs:
        assert (fs.lstat("/d/f").st_uid, fs.lstat("/d/f").st_gid) == (7, 9)
        assert fs.lstat("/d").st_uid == 0 and fs.lstat("/").st_uid == 0
        assert fs.lstat("/lost+found").st_uid == 0
        assert fs.read_bytes("/d/f") == b"x"
    img2 = os.path.join(tmp, "o.img")
    rext4.mkfs(img2, "16M", source=src, owner=(1000, 1000))
    with rext4.open(img2) as fs:
        assert fs.lstat("/d/f").st_uid == 1000 and fs.lstat("/").st_gid == 1000


@pytest.mark.parametrize("fstype", ["ext2", "ext3"])
def test_block_mapped_images_are_written(tmp, fstype):
    """ext2 and ext3 images (block maps, no extent feature) open writable: files past
    the direct and indirect ranges, a sparse one, a directory that grows; e2fsck clean;
    the kernel reads the same bytes."""
    from conftest import fsck_clean, loop_mount, mkfs_ext4

    img = os.path.join(tmp, f"{fstype}.img")
    mkfs_ext4(img, "64M", "-t", fstype, "-b", "1024")
    big = bytes(random.Random(7).randrange(256) for _ in range(300_000))
    with rext4.open(img, writable=True) as fs:
        fs.write_bytes("/big", big)
        fs.makedirs("/d")
        for i in range(300):
            fs.write_bytes(f"/d/file-{i:04}", b"%d" % i)
        with fs.open("/sparse", "wb") as f:
            f.seek(70 << 20)
            f.write(b"far")
        fs.setxattr("/big", "user.k", b"v")
    fsck_clean(img)
    with rext4.open(img) as fs:
        assert fs.read_bytes("/big") == big
        assert len(fs.listdir("/d")) == 300
    with loop_mount(img) as mnt:
        with open(os.path.join(mnt, "big"), "rb") as f:
            assert f.read() == big
        with open(os.path.join(mnt, "sparse"), "rb") as f:
            f.seek(70 << 20)
            assert f.read() == b"far"
