//! Fast-commit replay through the tools and the mount: a kernel crash copy of a
//! `-O fast_commit` image whose last fsyncs went out as fast commits reads back with
//! `rext4 cat` (replayed in memory, the image unchanged), and `rext4 mount` replays it
//! on the image: the files read through the mount, e2fsck -fn clean after unmount.

mod fuse_mount;

use std::path::Path;
use std::process::{Command, Stdio};

use fuse_mount::{bin, cannot_mount, Mounted};
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, LoopMount, MkfsOptions};

fn fsync(p: &Path) {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .expect("fsync");
}

/// The crash copy: a file synced, then files written and fsynced (fast commits), then
/// the image copied while mounted (again when the copy caught no fast commit).
fn fc_crash_copy() -> Option<Image> {
    for _ in 0..4 {
        match one_copy() {
            Ok(c) => return c,
            Err(()) => eprintln!("no fast commit in the copy; again"),
        }
    }
    panic!("no fast commit in the crash copy 4 times");
}

fn one_copy() -> Result<Option<Image>, ()> {
    let img = mkfs(
        &MkfsOptions::new(4096, 64 << 20)
            .arg("-O")
            .arg("fast_commit"),
    )
    .expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "commit=60") {
        Ok(m) => m,
        Err(e) => {
            skip(&format!("needs a kernel mount: {e}"));
            return Ok(None);
        }
    };
    std::fs::write(m.path().join("before"), b"synced the slow way").expect("write");
    m.sync();
    for i in 0..5u32 {
        let p = m.path().join(format!("fc{i}"));
        std::fs::write(&p, vec![b'a' + i as u8; 10_000 + i as usize]).expect("write");
        fsync(&p);
    }
    let copy = img.duplicate().expect("copy while mounted");
    m.unmount().expect("unmount");
    let r = rext4::journal::examine(
        &rext4::device::FileDevice::open(copy.path(), true, false).expect("open"),
    )
    .expect("examine");
    if r.fast_commits.is_empty() {
        return Err(());
    }
    Ok(Some(copy))
}

#[test]
fn the_tools_and_the_mount_replay_fast_commits() {
    let Some(copy) = fc_crash_copy() else {
        return;
    };
    let before = std::fs::read(copy.path()).expect("read");
    let out = Command::new(bin())
        .arg("cat")
        .arg(format!("{}:/fc4", copy.path().display()))
        .stdin(Stdio::null())
        .output()
        .expect("rext4 cat");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, vec![b'e'; 10_004]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("fast commits replayed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(copy.path()).expect("read") == before,
        "rext4 cat changed the image"
    );
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let mut m = Mounted::new(copy.path(), &[]);
    for i in 0..5u32 {
        assert_eq!(
            std::fs::read(m.join(&format!("fc{i}"))).expect("read through the mount"),
            vec![b'a' + i as u8; 10_000 + i as usize]
        );
    }
    assert_eq!(
        std::fs::read(m.join("before")).expect("read"),
        b"synced the slow way"
    );
    assert!(m.unmount().success(), "{}", m.stderr());
    let r = e2fsck_fn(copy.path());
    assert!(
        r.clean,
        "e2fsck -fn after the mount's replay:\n{}",
        r.output
    );
}
