//! SEEDS lesson C: lockless lookups (dentry cache -> inode number -> inode) never see an
//! inode that was freed and handed to another file while they ran.
//!
//! Two churners create and unlink one symlink each in a loop (`/d/a` -> "A-n",
//! `/d/b` -> "B-n"), so the inode number one frees is what the other allocates next
//! (nothing but the grace period delays reuse, with or without a journal). Readers
//! resolve `/d/a` and `/d/b` and read the targets: a target of the other name's family
//! means the reader followed a name to an inode that had been reused meanwhile. Some
//! reads are slow on purpose (the inode number is held for 300 µs inside the read
//! guard before the inode is read), which without the grace period lets the churners
//! reuse the number many times over.
//! The test also checks that reuse did happen (the two names shared inode numbers),
//! so it cannot pass by never reusing anything.
//!
//! The same runs with `FsOptions::sync_grace` (a free waits for its grace period
//! instead of letting the number cool): its churners then work by inode number
//! (`symlink_ino`, `unlink_ino`), outside any read guard, so their frees do wait.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions};

fn open(path: &std::path::Path, sync_grace: bool) -> Fs {
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        sync_grace,
        ..FsOptions::default()
    };
    Fs::open_with(path, opts).expect("open rw")
}

fn run(journal: bool, secs: u64, sync_grace: bool) {
    let mut opts = MkfsOptions::new(4096, 64 << 20);
    if !journal {
        opts = opts.arg("-O").arg("^has_journal");
    }
    let img = mkfs(&opts).expect("mkfs");
    let fs = open(img.path(), sync_grace);
    fs.create_dir("/d").expect("mkdir");
    let d = fs.resolve(b"/d", true).expect("resolve /d");
    let stop = Arc::new(AtomicBool::new(false));
    let used: Arc<Mutex<[HashSet<u32>; 2]>> = Arc::new(Mutex::new(Default::default()));
    let churners: Vec<_> = [(b'a', "A"), (b'b', "B")]
        .into_iter()
        .enumerate()
        .map(|(k, (name, family))| {
            let (fs, stop, used) = (fs.clone(), stop.clone(), used.clone());
            std::thread::spawn(move || {
                let path = format!("/d/{}", name as char);
                let mut n = 0u64;
                let mut mine = HashSet::new();
                while !stop.load(Ordering::Relaxed) {
                    let target = format!("{family}-{n}");
                    if sync_grace {
                        let ino = fs
                            .symlink_ino(d, &[name], target.as_bytes(), 0, 0)
                            .expect("symlink");
                        mine.insert(ino.0);
                        fs.unlink_ino(d, &[name]).expect("unlink");
                    } else {
                        fs.symlink(target, &path).expect("symlink");
                        let ino = fs.resolve(path.as_bytes(), false).expect("resolve own");
                        mine.insert(ino.0);
                        fs.remove_file(&path).expect("unlink");
                    }
                    n += 1;
                }
                used.lock().expect("lock")[k].extend(mine);
                n
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let (path, family) = if (i + r).is_multiple_of(2) {
                        ("/d/a", "A-")
                    } else {
                        ("/d/b", "B-")
                    };
                    i += 1;
                    let got = if i.is_multiple_of(4) {
                        // A slow reader (like a FUSE lookup waiting on the kernel): the
                        // name's inode number is held for a while before the inode is
                        // read. Meanwhile the churners free and allocate many inodes.
                        let _g = fs.read_guard();
                        match fs.lookup(d, &path.as_bytes()[3..]) {
                            Ok(Some(e)) => {
                                std::thread::sleep(Duration::from_micros(300));
                                fs.read_link_ino(e.ino)
                            }
                            Ok(None) => Err(Error::NotFound),
                            Err(e) => Err(e),
                        }
                    } else {
                        fs.read_link(path)
                    };
                    match got {
                        Ok(t) => {
                            assert!(
                                t.starts_with(family.as_bytes()),
                                "{path} resolved to an inode now holding {:?}",
                                String::from_utf8_lossy(&t)
                            );
                            seen += 1;
                        }
                        // Not there right now, or unlinked between the name and the
                        // inode (the inode is then seen as deleted, never as another).
                        Err(Error::NotFound) | Err(Error::Corrupted { .. }) => {}
                        Err(e) => panic!("read_link {path}: {e}"),
                    }
                }
                seen
            })
        })
        .collect();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let made: Vec<u64> = churners
        .into_iter()
        .map(|t| t.join().expect("churner"))
        .collect();
    let seen: Vec<u64> = readers
        .into_iter()
        .map(|t| t.join().expect("reader"))
        .collect();
    let used = used.lock().expect("lock");
    let shared = used[0].intersection(&used[1]).count();
    println!(
        "journal={journal} sync_grace={sync_grace}: creates {made:?}, targets read {seen:?}, inode numbers used \
         by both names: {shared}"
    );
    assert!(made.iter().all(|&n| n > 100), "churners ran: {made:?}");
    assert!(
        seen.iter().all(|&n| n > 0),
        "readers found targets: {seen:?}"
    );
    assert!(
        shared > 0,
        "the two names never shared an inode number: reuse was not exercised"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

#[test]
fn lookups_never_see_a_reused_inode_without_journal() {
    run(false, 3, false);
}

#[test]
fn lookups_never_see_a_reused_inode_with_journal() {
    run(true, 2, false);
}

#[test]
fn lookups_never_see_a_reused_inode_with_synchronous_grace_periods() {
    run(true, 2, true);
}

/// What tells the two designs apart: a free by inode number waits for a reader that
/// began before it under `sync_grace`, and never does by default (the number cools
/// and the allocator skips it). The reader drops its guard when the unlink has
/// returned, or after 2 s: a waiting free returns only after that (its own wait gives
/// up only after 5 s), a free that does not wait returns long before it.
#[test]
fn a_free_waits_for_readers_only_with_synchronous_grace_periods() {
    for sync_grace in [false, true] {
        let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
        let fs = open(img.path(), sync_grace);
        let root = rext4::Ino::ROOT;
        fs.mknod_ino(root, b"f", 0o100644, 0, 0, (0, 0))
            .expect("mknod");
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(AtomicBool::new(false));
        let reader = {
            let (fs, released) = (fs.clone(), released.clone());
            std::thread::spawn(move || {
                let g = fs.read_guard();
                held_tx.send(()).expect("send");
                let _ = done_rx.recv_timeout(Duration::from_secs(2));
                released.store(true, Ordering::SeqCst);
                drop(g);
            })
        };
        held_rx.recv().expect("reader holds its guard");
        fs.unlink_ino(root, b"f").expect("unlink");
        let waited = released.load(Ordering::SeqCst);
        let _ = done_tx.send(());
        reader.join().expect("reader");
        assert_eq!(
            waited,
            sync_grace,
            "sync_grace={sync_grace}: the unlink returned {} the reader's guard ended",
            if waited { "after" } else { "before" }
        );
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "{}", r.output);
    }
}
