//! The mount's durability guarantees (README, "Durability"), each checked with a
//! `kill -9` of the server:
//! - fsync: the file is on the image once fsync returns, for every recoverer;
//! - `rext4 sync MNT`: everything written before it, also what the kernel still
//!   cached, is committed once it returns, for every recoverer;
//! - sync(1) and `sync -f MNT`: the kernel hands its dirty pages to the server, which
//!   writes them to the image file within a moment (early commits, `early_commit=`):
//!   after that, a crash of the server alone loses nothing when rext4 recovers the
//!   image (the same machine, not restarted); the kernel and e2fsck, which do not
//!   read early commits, recover a consistent image as of the last commit.
//!
//! After every recovery e2fsck -fn is clean. A power loss is the engine's crash sweep
//! (`crates/engine/tests/crash.rs`, `crash_early_commits` among them).

mod fuse_mount;

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fuse_mount::{bin, cannot_mount, Mounted};
use rext4_testkit::{e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions};

/// A small tree with known contents: (path, bytes).
fn tree() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for i in 0..40u32 {
        let len = [0usize, 1, 700, 4096, 9000, 70_000][i as usize % 6] + i as usize;
        let data: Vec<u8> = (0..len).map(|k| (k as u32 * 31 + i) as u8).collect();
        v.push((format!("d{}/f{i}", i % 4), data));
    }
    v.push((
        "big".into(),
        (0..3u32 << 20).map(|k| (k >> 7) as u8).collect(),
    ));
    v
}

fn write_tree(root: &Path, t: &[(String, Vec<u8>)]) {
    for (p, d) in t {
        let path = root.join(p);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).expect("mkdir");
        }
        File::create(&path)
            .and_then(|mut f| f.write_all(d))
            .expect("write");
    }
}

/// Kill the server with SIGKILL and clean up the dead mount.
fn kill_server(m: &mut Mounted) {
    // SAFETY: signalling the server this test spawned.
    assert_eq!(unsafe { libc::kill(m.pid(), libc::SIGKILL) }, 0);
    assert!(
        m.wait_exit(Duration::from_secs(20)).is_some(),
        "server did not die"
    );
    m.stop();
}

/// Recover the image as `how` says (rext4 on this machine, the kernel, e2fsck -fy),
/// check e2fsck -fn, and return what rext4 then reads of `t`: (present and equal,
/// present in part, missing).
fn recover_and_count(img: &Path, how: &str, t: &[(String, Vec<u8>)]) -> (usize, usize, usize) {
    match how {
        "rext4" => {
            let fs = rext4::Fs::open_with(
                img,
                rext4::FsOptions {
                    read_only: false,
                    ..rext4::FsOptions::default()
                },
            )
            .expect("rext4 recovery");
            fs.close().expect("close");
        }
        "kernel" => match LoopMount::new(img, false, "") {
            Ok(m) => m.unmount().expect("unmount"),
            Err(e) => {
                skip(&format!("kernel recovery: {e}"));
                return recover_and_count(img, "rext4", t);
            }
        },
        _ => {
            let r = rext4_testkit::e2fsck_fy(img);
            assert!(r.exit_code <= 1, "e2fsck -fy:\n{}", r.output);
        }
    }
    let r = e2fsck_fn(img);
    assert!(r.clean, "after {how} recovery, e2fsck -fn:\n{}", r.output);
    let fs = rext4::Fs::open(img).expect("open");
    let (mut same, mut partial, mut missing) = (0, 0, 0);
    for (p, d) in t {
        match fs.read(format!("/t/{p}")) {
            Ok(c) if c == *d => same += 1,
            Ok(c) => {
                // Part of what was written (the kernel hands pieces over in any
                // order; an unwritten piece reads as zeros) — never other bytes.
                assert!(
                    c.len() <= d.len() && c.iter().zip(d).all(|(a, b)| a == b || *a == 0),
                    "after {how} recovery /t/{p} holds bytes that were never written"
                );
                partial += 1;
            }
            Err(_) => missing += 1,
        }
    }
    (same, partial, missing)
}

/// Write the tree through a fresh default mount, run `settle` on it, kill the server;
/// each recoverer's count of (same, different, missing) files.
fn crash_after(settle: impl Fn(&Mounted), recoverers: &[&str]) -> Vec<(usize, usize, usize)> {
    let t = tree();
    let base = mkfs(&MkfsOptions::new(4096, 128 << 20)).expect("mkfs");
    let mut m = Mounted::new(base.path(), &[]);
    write_tree(&m.join("t"), &t);
    settle(&m);
    kill_server(&mut m);
    let crashed = fs::read(base.path()).expect("read image");
    recoverers
        .iter()
        .map(|how| {
            fs::write(base.path(), &crashed).expect("restore crash image");
            recover_and_count(base.path(), how, &t)
        })
        .collect()
}

fn can_run() -> bool {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return false;
    }
    true
}

#[test]
fn rext4_sync_makes_everything_durable() {
    if !can_run() {
        return;
    }
    let n = tree().len();
    let got = crash_after(
        |m| {
            let st = Command::new(bin())
                .arg("sync")
                .arg(m.path())
                .status()
                .expect("rext4 sync");
            assert!(st.success());
        },
        &["rext4", "kernel", "e2fsck"],
    );
    for (how, g) in ["rext4", "kernel", "e2fsck"].iter().zip(&got) {
        assert_eq!(
            *g,
            (n, 0, 0),
            "after rext4 sync and a server crash, {how} recovery"
        );
    }
}

#[test]
fn fsync_is_durable_for_every_recoverer() {
    if !can_run() {
        return;
    }
    let t = tree();
    let got = crash_after(
        |m| {
            for (p, _) in &t {
                File::open(m.join("t").join(p))
                    .and_then(|f| f.sync_all())
                    .expect("fsync");
            }
            // The directories' entries: fsync of each directory, as ext4 wants.
            for d in ["t", "t/d0", "t/d1", "t/d2", "t/d3"] {
                File::open(m.join(d))
                    .and_then(|f| f.sync_all())
                    .expect("fsync dir");
            }
        },
        &["rext4", "kernel"],
    );
    for g in got {
        assert_eq!(g, (t.len(), 0, 0), "fsynced files after a server crash");
    }
}

/// sync(1) reaches the server, whose early commit puts it in the image file within
/// a moment: rext4's recovery on the same machine finds all of it; the kernel and
/// e2fsck a clean image (as of the last commit).
#[test]
fn sync_then_server_crash_loses_nothing_for_rext4() {
    if !can_run() {
        return;
    }
    let n = tree().len();
    for variant in [&["sync"][..], &["sync", "-f"][..]] {
        let got = crash_after(
            |m| {
                let mut c = Command::new(variant[0]);
                if variant.len() > 1 {
                    c.arg(variant[1]).arg(m.path());
                }
                assert!(c.status().expect("sync").success());
                // The early commit's moment (200 ms by default), with room to spare.
                std::thread::sleep(Duration::from_millis(1000));
            },
            &["rext4", "kernel", "e2fsck"],
        );
        assert_eq!(
            got[0],
            (n, 0, 0),
            "{variant:?}: rext4 recovery after a server crash"
        );
    }
}

/// Without sync, data the kernel still caches is lost with the server (it never
/// reached it); the image is clean and holds no byte that was not written (checked
/// in `recover_and_count`).
#[test]
fn a_server_crash_without_sync_leaves_a_clean_image() {
    if !can_run() {
        return;
    }
    let got = crash_after(|_| {}, &["rext4", "kernel"]);
    eprintln!("no sync, after the crash (same, partial, missing): {got:?}");
}
