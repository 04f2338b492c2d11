"""Fixtures of the rext4 Python suite: images made by the real e2fsprogs, the e2fsck
oracle, kernel loop mounts undone also when a test fails, and skips that fail under
REXT4_REQUIRE_ALL=1 (CI) as the Rust suite's do."""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time

import pytest


def require_all() -> bool:
    return os.environ.get("REXT4_REQUIRE_ALL", "") not in ("", "0")


def skip(reason: str) -> None:
    """The machine cannot run this (not root, a tool missing): skip, or fail where
    every test must run (REXT4_REQUIRE_ALL)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    log = os.environ.get("REXT4_SKIP_LOG")
    if require_all():
        pytest.fail(f"cannot run ({reason}) and REXT4_REQUIRE_ALL is set")
    if log:
        with open(log, "a") as f:
            f.write(f"{test}\t{reason}\n")
    pytest.skip(reason)


def need_tool(name: str) -> None:
    if shutil.which(name) is None:
        skip(f"{name} not installed")


def can_loop_mount():
    if os.environ.get("REXT4_NO_MOUNT"):
        return "REXT4_NO_MOUNT is set"
    if os.geteuid() != 0:
        return "not root: loop mounts need root"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    with open("/proc/filesystems") as f:
        if not any(line.split()[-1:] == ["ext4"] for line in f):
            return "kernel does not list ext4"
    return None


@contextlib.contextmanager
def loop_mount(img: str, ro: bool = True):
    """The image mounted by the kernel (`mount -o loop`), unmounted (and its loop
    device freed: autoclear) on exit, also when the body raises."""
    why = can_loop_mount()
    if why:
        skip(why)
    mnt = tempfile.mkdtemp(prefix="rext4-py-mnt-")
    opts = "loop,ro" if ro else "loop"
    for attempt in range(20):
        r = subprocess.run(["mount", "-t", "ext4", "-o", opts, img, mnt], capture_output=True, text=True)
        if r.returncode == 0:
            break
        # Loop devices are few and shared with other tests: wait for one.
        if attempt == 19:
            os.rmdir(mnt)
            raise AssertionError(f"mount failed: {r.stderr}")
        time.sleep(0.5)
    try:
        yield mnt
    finally:
        for attempt in range(10):
            if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.3)
        else:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        if not os.path.ismount(mnt):
            os.rmdir(mnt)


def fsck_clean(img: str) -> str:
    """Run `e2fsck -fn` and assert that it printed nothing but the banner, the pass
    lines and the summary (exit 0 alone is not enough: the oracle of the Rust suite,
    crates/testkit/src/tools.rs)."""
    need_tool("e2fsck")
    env = dict(os.environ)
    # Superblock times compared with a clock that may step: not structure.
    conf = os.path.join(tempfile.gettempdir(), "rext4-py-e2fsck.conf")
    with open(conf, "w") as f:
        f.write("[options]\n\tbroken_system_clock = 1\n")
    env["E2FSCK_CONFIG"] = conf
    r = subprocess.run(["e2fsck", "-fn", img], capture_output=True, text=True, env=env)
    out = r.stdout + r.stderr
    bad = []
    summary = False
    for line in out.splitlines():
        line = line.rstrip()
        if not line or (line.startswith("e2fsck ") and line.endswith(")")):
            continue
        if line.startswith("Pass ") and ": " in line:
            continue
        if " files (" in line and "non-contiguous)," in line and line.endswith(" blocks"):
            summary = True
            continue
        bad.append(line)
    assert r.returncode == 0 and summary and not bad, f"e2fsck -fn not clean (exit {r.returncode}):\n{out}"
    return out


def mkfs_ext4(img: str, size: str, *extra: str) -> None:
    """mkfs.ext4 -q -F EXTRA... IMG SIZE on a fresh file."""
    need_tool("mkfs.ext4")
    if os.path.exists(img):
        os.unlink(img)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", *extra, img, size], capture_output=True, text=True)
    assert r.returncode == 0, f"mkfs.ext4 failed: {r.stderr}"


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)
