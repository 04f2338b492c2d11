//! An image someone else uses is not opened for writing (issue 12, item 4): a loop
//! device backs it (found by the backing file's device and inode, so any path to it
//! and a loop device with an offset count), it is a block device that is mounted or
//! held exclusively, or another rext4 user has it open for writing. Read-only opens go
//! on with a warning. Every sequence ends with e2fsck -fn clean and the data written
//! by the other user intact.

use std::fs;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{e2fsck_fn, mkfs, skip, LoopDevice, LoopMount, MkfsOptions};

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

fn in_use_message(r: rext4::Result<Fs>) -> String {
    match r {
        Err(Error::InUse(m)) => m,
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("opened for writing an image someone else uses"),
    }
}

fn fsck_clean(img: &Path) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "e2fsck -fn:\n{}", r.output);
}

/// The loop device (`/dev/loopN`) backing the mount at `mnt`, from mountinfo.
fn loop_device_of(mnt: &Path) -> String {
    let info = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let want = mnt.to_str().expect("utf-8 path");
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (left.split(' ').nth(4) == Some(want)).then(|| right.split(' ').nth(1))?
        })
        .expect("mount listed")
        .to_string()
}

#[test]
fn a_loop_mounted_image_is_not_opened_for_writing() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "") {
        Ok(m) => m,
        Err(e) => return skip(&e),
    };
    fs::write(m.path().join("kernel-file"), b"written by the kernel").expect("write");
    m.sync();
    let dev = loop_device_of(m.path());
    let msg = in_use_message(Fs::open_with(img.path(), rw()));
    assert!(
        msg.contains(&dev) && msg.contains(m.path().to_str().expect("utf-8")),
        "names the loop device and its mount point: {msg}"
    );
    // Another path to the same file: a symlink and a hard link.
    let sym = img.dir().join("via-symlink");
    std::os::unix::fs::symlink(img.path(), &sym).expect("symlink");
    let hard = img.dir().join("via-link");
    fs::hard_link(img.path(), &hard).expect("link");
    for p in [&sym, &hard] {
        let msg = in_use_message(Fs::open_with(p, rw()));
        assert!(msg.contains(&dev), "{}: {msg}", p.display());
    }
    // The block device itself: mounted, so O_EXCL is refused.
    let msg = in_use_message(Fs::open_with(&dev, rw()));
    assert!(msg.contains("mounted at"), "{msg}");
    // mkfs does not format it either, and leaves it as it is.
    let e = rext4::mkfs::mkfs_file(img.path(), 32 << 20, &Default::default())
        .expect_err("mkfs of a mounted image");
    assert!(matches!(e, Error::InUse(_)), "{e}");
    // Reading goes on, with a warning.
    for p in [img.path(), Path::new(&dev)] {
        let fs = Fs::open(p).expect("read-only open");
        assert!(
            fs.warnings()
                .iter()
                .any(|w| w.contains("in use by a writer")),
            "{}: {:?}",
            p.display(),
            fs.warnings()
        );
        assert_eq!(
            fs.read("/kernel-file").expect("read"),
            b"written by the kernel"
        );
    }
    m.unmount().expect("unmount");
    fsck_clean(img.path());
    // Free again: written and clean.
    let fs = Fs::open_with(img.path(), rw()).expect("open once unmounted");
    assert!(fs.warnings().is_empty(), "{:?}", fs.warnings());
    fs.write("/rext4-file", b"after").expect("write");
    fs.close().expect("close");
    fsck_clean(img.path());
    let fs = Fs::open(img.path()).expect("open");
    assert_eq!(
        fs.read("/kernel-file").expect("read"),
        b"written by the kernel"
    );
    assert_eq!(fs.read("/rext4-file").expect("read"), b"after");
}

#[test]
fn a_loop_device_with_an_offset_is_caught() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let before = fs::read(img.path()).expect("read image");
    {
        let l = match LoopDevice::attach_with(img.path(), &["--offset", "4096", "--read-only"]) {
            Ok(l) => l,
            Err(e) => return skip(&e),
        };
        let msg = in_use_message(Fs::open_with(img.path(), rw()));
        assert!(
            msg.contains(&*l.path().to_string_lossy())
                && msg.contains("offset 4096")
                && msg.contains("losetup -d"),
            "{msg}"
        );
        // A read-only loop device writes nothing: a reader is not warned.
        let fs = Fs::open(img.path()).expect("read-only open");
        assert!(
            !fs.warnings().iter().any(|w| w.contains("in use")),
            "{:?}",
            fs.warnings()
        );
    }
    assert!(
        fs::read(img.path()).expect("read image") == before,
        "image changed"
    );
    fsck_clean(img.path());
}

#[test]
fn a_block_device_held_exclusively_is_refused() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let l = match LoopDevice::attach(img.path()) {
        Ok(l) => l,
        Err(e) => return skip(&e),
    };
    {
        // What a kernel mount or another O_EXCL user holds.
        let _excl = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc_o_excl())
            .open(l.path())
            .expect("O_EXCL open");
        let msg = in_use_message(Fs::open_with(l.path(), rw()));
        assert!(msg.contains("exclusively"), "{msg}");
    }
    // Free: rext4 writes through the device, and holds it exclusively meanwhile.
    let fs = Fs::open_with(l.path(), rw()).expect("open the device");
    let e = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_o_excl())
        .open(l.path())
        .expect_err("O_EXCL while rext4 writes");
    assert_eq!(e.raw_os_error(), Some(16), "{e}");
    let msg = in_use_message(Fs::open_with(l.path(), rw()));
    assert!(msg.contains("in use"), "{msg}");
    fs.write("/through-the-device", b"x").expect("write");
    fs.close().expect("close");
    drop(l);
    fsck_clean(img.path());
    let fs = Fs::open(img.path()).expect("open");
    assert_eq!(fs.read("/through-the-device").expect("read"), b"x");
}

fn libc_o_excl() -> i32 {
    0o200
}

#[test]
fn a_second_writer_is_refused_and_named() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let a = Fs::open_with(img.path(), rw()).expect("first writer");
    a.write("/from-a", b"a").expect("write");
    a.sync().expect("sync");
    let msg = in_use_message(Fs::open_with(img.path(), rw()));
    assert!(
        msg.contains(&format!("pid {}", std::process::id())),
        "names the holder: {msg}"
    );
    // mkfs neither.
    let e = rext4::mkfs::mkfs_file(img.path(), 16 << 20, &Default::default())
        .expect_err("mkfs under a writer");
    assert!(matches!(e, Error::InUse(_)), "{e}");
    let r = Fs::open(img.path()).expect("a reader goes on");
    assert!(
        r.warnings()
            .iter()
            .any(|w| w.contains("in use by a writer")),
        "{:?}",
        r.warnings()
    );
    // A reader that keeps writers out is refused while one writes.
    let e = Fs::open_with(
        img.path(),
        FsOptions {
            keep_writers_out: true,
            ..FsOptions::default()
        },
    )
    .err()
    .expect("refused");
    assert!(matches!(e, Error::InUse(_)), "{e}");
    a.close().expect("close");
    // Closing releases the image, also while the handle still exists.
    let b = Fs::open_with(img.path(), rw()).expect("writer after close");
    assert_eq!(b.read("/from-a").expect("read"), b"a");
    b.close().expect("close");
    drop((a, r));
    fsck_clean(img.path());
}
