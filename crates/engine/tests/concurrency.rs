//! Concurrent I/O on one `Fs` from several threads: in-place overwrites (buffered, and
//! O_DIRECT ones under the inode's shared I/O lock only) racing with truncates, reads,
//! writeback and the creation of other files must never write into a block that
//! changed owner, and the image must stay consistent.
//!
//! One thread overwrites file A at random offsets with 0xAA; another keeps truncating A
//! to nothing and writing it back; a third creates files whose blocks come from what
//! the truncates free and fills them with their own byte; a fourth reads A and checks it
//! holds only 0xAA or the refill byte. Afterwards every other file must still hold its
//! own bytes only, and e2fsck -fn must be clean.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rext4::Fs;
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions};

use common::open_rw as rw;

const A_LEN: usize = 256 * 1024;

#[test]
fn overwrites_racing_truncates_never_touch_other_files() {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/a", vec![0xAA; A_LEN]).expect("write a");
    let a = fs.resolve(b"/a", true).expect("resolve");
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();

    // Overwriter: in-place writes of 0xAA (the fast path when A is fully written).
    {
        let (fs, stop) = (fs.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(7);
            let buf = vec![0xAAu8; 8192];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let off = rng.next_u64() % (A_LEN as u64 - 8192);
                let len = 1 + (rng.next_u64() % 8192) as usize;
                // Racing truncates may shrink A, then this write extends it again
                // (full path) or overwrites in place. Every other write is O_DIRECT
                // (the device path, in place under the shared lock when it can be).
                if n.is_multiple_of(2) {
                    fs.write_direct_ino(a, &buf[..len], off, false)
                        .expect("direct overwrite");
                } else {
                    fs.write_ino_at_keep_times(a, &buf[..len], off)
                        .expect("overwrite");
                }
                n += 1;
            }
            n
        }));
    }
    // Truncater: A to zero and back (frees and reallocates A's blocks).
    {
        let (fs, stop) = (fs.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                fs.truncate_ino(a, 0).expect("truncate");
                fs.write_ino_at(a, &vec![0xAA; A_LEN], 0).expect("refill");
                n += 1;
            }
            n
        }));
    }
    // Reader: A never shows bytes other than 0xAA and holes (zeros).
    {
        let (fs, stop) = (fs.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; A_LEN];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let inode = fs.read_inode(a).expect("inode");
                let got = fs.read_ino_at(a, &inode, &mut buf, 0).expect("read");
                if let Some(bad) = buf[..got].iter().position(|&b| b != 0xAA && b != 0) {
                    panic!("A holds {:#x} at {bad}", buf[bad]);
                }
                n += 1;
            }
            n
        }));
    }
    // Creator: other files take the blocks A's truncates free.
    let creator = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            let mut made = Vec::new();
            for i in 0..1000u32 {
                let byte = (i % 200) as u8 + 1;
                let name = format!("/f{i}");
                fs.write(&name, vec![byte; 4096 + (i as usize % 7) * 1024])
                    .expect("create");
                made.push((name, byte));
                if i % 3 == 0 {
                    let (old, _) = made.remove(0);
                    fs.remove_file(&old).expect("unlink");
                }
            }
            made
        })
    };
    let made = creator.join().expect("creator");
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert!(
        counts.iter().all(|&n| n > 0),
        "every thread ran: {counts:?}"
    );
    for (name, byte) in &made {
        let data = fs.read(name).expect("read back");
        if let Some(bad) = data.iter().position(|b| b != byte) {
            panic!("{name}: byte {bad} is {:#x}, want {byte:#x}", data[bad]);
        }
    }
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    let fs = Fs::open(img.path()).expect("reopen");
    for (name, byte) in &made {
        assert!(
            fs.read(name).expect("read").iter().all(|b| b == byte),
            "{name}"
        );
    }
}

/// SEEDS lesson A: concurrent 1 KiB and 2 KiB O_DIRECT writes into the same 4 KiB
/// blocks, over written, unwritten (fallocated) and hole ranges. Writes into written
/// blocks run under the shared I/O lock, the others take it exclusively and zero the
/// rest of the block: no byte of any completed write may be lost and no stale byte may
/// appear.
#[test]
fn concurrent_sub_block_direct_writes_lose_nothing() {
    sub_block_writes(true);
}

/// The same through the page cache (the FUSE path's writes).
#[test]
fn concurrent_sub_block_buffered_writes_lose_nothing() {
    sub_block_writes(false);
}

fn sub_block_writes(direct: bool) {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    const BLOCKS: u64 = 64;
    const LEN: u64 = BLOCKS * 4096;
    // Written: stale bytes 0xEE everywhere first. Unwritten: fallocated. Hole: nothing.
    fs.write("/written", vec![0xEE; LEN as usize])
        .expect("written");
    fs.write("/unwritten", b"").expect("create");
    let unwritten = fs.resolve(b"/unwritten", true).expect("resolve");
    fs.fallocate_ino(unwritten, rext4::FallocMode::Allocate, 0, LEN)
        .expect("fallocate");
    fs.write("/hole", b"").expect("create");
    let hole = fs.resolve(b"/hole", true).expect("resolve");
    fs.truncate_ino(hole, LEN).expect("size");
    for (name, piece) in [("/written", 1024u64), ("/unwritten", 2048), ("/hole", 1024)] {
        let ino = fs.resolve(name.as_bytes(), true).expect("resolve");
        let per_block = 4096 / piece;
        // One thread per piece slot: thread t writes slot t of every block, in an order
        // of its own, so writers into one block overlap in time.
        let threads: Vec<_> = (0..per_block)
            .map(|t| {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(t + 11);
                    let mut order: Vec<u64> = (0..BLOCKS).collect();
                    for i in (1..order.len()).rev() {
                        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                    }
                    for b in order {
                        let byte = (t as u8 + 1) * 16 + (b % 16) as u8;
                        let data = vec![byte; piece as usize];
                        let at = b * 4096 + t * piece;
                        if direct {
                            fs.write_direct_ino(ino, &data, at, false).expect("write");
                        } else {
                            fs.write_ino_at_keep_times(ino, &data, at).expect("write");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer");
        }
        let data = fs.read(name).expect("read");
        assert_eq!(data.len() as u64, LEN, "{name}");
        for b in 0..BLOCKS {
            for t in 0..per_block {
                let want = (t as u8 + 1) * 16 + (b % 16) as u8;
                let at = (b * 4096 + t * piece) as usize;
                if let Some(bad) = data[at..at + piece as usize]
                    .iter()
                    .position(|&x| x != want)
                {
                    panic!(
                        "{name}: block {b} slot {t} byte {bad} is {:#x}, want {want:#x}",
                        data[at + bad]
                    );
                }
            }
        }
    }
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// Namespace operations as concurrent handles: four threads create (also unnamed
/// files, O_TMPFILE, which some of them then link), link, unlink,
/// rename and remove names, and set attributes — each in a directory of its own (whose
/// contents and attributes a model predicts) and in two shared directories where they
/// race for the same few names, renaming files and directories within one and between
/// the two, into each other, over each other — while a fifth commits and reads. All of
/// these run as handles under inode locks (a rename that moves a directory or spans two
/// under the rename lock too), beside each other and beside writeback; truncates take
/// the write lock and exclude them. Afterwards every thread's directory is what its model says, byte for
/// byte and attribute for attribute after a reopen, every shared name resolves, and
/// e2fsck -fn is clean (link counts, "..", directory blocks, bitmaps, counters: a lost
/// update anywhere shows there).
///
/// The races it looks for are timing-dependent: it runs several rounds, each on a
/// fresh image with other seeds. (It found two engine bugs that predate handles: a
/// freed block's committed copy written home over the block's next owner by a
/// checkpoint, and an orphan left on the list by an unpin that raced the unlink.)
#[test]
fn namespace_handles_race_and_stay_consistent() {
    for round in 0..6 {
        namespace_race_round(round, false);
    }
}

/// The same with data written into each shared file the open makes, so that
/// writeback's pins and unpins race the opens, unlinks and closes. (Under CPU load it
/// found a stale last unpin freeing the next file to get the inode number, under that
/// file's open handle: its data then went into a freed inode, and writeback gave it a
/// block no inode referred to — e2fsck: block bitmap differences.)
#[test]
fn namespace_handles_race_with_data() {
    for round in 0..6 {
        namespace_race_round(round, true);
    }
}

fn namespace_race_round(round: u64, with_data: bool) {
    use rext4::Error;
    use std::collections::BTreeMap;
    // 1 KiB blocks and a small image: few groups, so the threads share inode table
    // blocks, bitmaps and descriptors.
    let img = mkfs(&MkfsOptions::new(1024, 24 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.create_dir("/shared").expect("mkdir shared");
    fs.create_dir("/shared2").expect("mkdir shared2");
    const THREADS: u64 = 4;
    for t in 0..THREADS {
        fs.create_dir(format!("/t{t}")).expect("mkdir own");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let background = {
        let (fs, stop) = (fs.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                fs.sync().expect("sync");
                let _ = fs.read_dir("/shared").expect("readdir shared");
                rounds += 1;
            }
            rounds
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x5eed + t + 16 * round);
                // What this thread's directory holds: name -> Some(bytes) for a file,
                // None for an (empty) directory.
                let mut own: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
                // The last extended attribute set on each of this thread's files.
                let mut attrs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let mut won = 0u64;
                let mut racing = |r: rext4::Result<()>| match r {
                    Ok(()) => won += 1,
                    Err(Error::Exists)
                    | Err(Error::NotFound)
                    | Err(Error::NotEmpty)
                    | Err(Error::IsADirectory)
                    | Err(Error::NotADirectory) => {}
                    Err(e) => panic!("thread {t}: {e}"),
                };
                for i in 0..3000u64 {
                    let name = format!("n{}", rng.below(24));
                    let path = format!("/t{t}/{name}");
                    let shared = format!("/shared/s{}", rng.below(12));
                    let shared2 = format!("/shared2/s{}", rng.below(12));
                    // Rounds 1 and 4 churn directories only, rounds 2 and 5 open and
                    // unlink shared files only (the mixes that find freed-block and
                    // unlink-against-last-close races fastest); the others mix all.
                    let op = match round % 3 {
                        1 => [2, 6, 7][rng.below(3) as usize],
                        2 => [4, 5][rng.below(2) as usize],
                        _ => rng.below(17),
                    };
                    match op {
                        0 | 1 => {
                            let data = vec![(i % 250) as u8 + 1; 1 + rng.below(3000) as usize];
                            match own.get(&name) {
                                Some(None) => {}
                                _ => {
                                    fs.write(&path, &data).expect("write own");
                                    own.insert(name, Some(data));
                                }
                            }
                        }
                        2 => match own.get(&name) {
                            Some(Some(_)) => {
                                fs.remove_file(&path).expect("unlink own");
                                own.remove(&name);
                                attrs.remove(&name);
                            }
                            Some(None) => {
                                fs.remove_dir(&path).expect("rmdir own");
                                own.remove(&name);
                            }
                            None => {
                                fs.create_dir(&path).expect("mkdir own");
                                own.insert(name, None);
                            }
                        },
                        3 => {
                            let to = format!("n{}", rng.below(24));
                            if own.get(&name).is_some_and(|v| v.is_some()) && !own.contains_key(&to)
                            {
                                fs.rename(&path, format!("/t{t}/{to}")).expect("rename own");
                                let v = own.remove(&name).expect("model");
                                if let Some(a) = attrs.remove(&name) {
                                    attrs.insert(to.clone(), a);
                                }
                                own.insert(to, v);
                            }
                        }
                        // A new file only: an existing name may be a hard link to a
                        // thread's own file, whose contents the model owns.
                        4 => racing(
                            rext4::OpenOptions::new()
                                .write(true)
                                .create_new(true)
                                .open(&fs, &shared)
                                .and_then(|f| {
                                    if with_data {
                                        f.write_all_at(b"shared", 0)?;
                                    }
                                    Ok(())
                                }),
                        ),
                        5 => racing(fs.remove_file(&shared)),
                        6 => racing(fs.create_dir(&shared)),
                        7 => racing(fs.remove_dir(&shared)),
                        8 => {
                            if own.get(&name).is_some_and(|v| v.is_some()) {
                                racing(fs.hard_link(&path, &shared));
                            }
                        }
                        // Pointing nowhere: a path through it must not reach a
                        // thread's own directory.
                        9 => racing(fs.symlink(format!("/nowhere/t{t}/{name}"), &shared)),
                        // Renames in one shared directory and between the two: files
                        // and directories, replacing what is there.
                        10 => racing(fs.rename(&shared, format!("/shared/s{}", rng.below(12)))),
                        11 => racing(fs.rename(&shared, &shared2)),
                        12 => racing(fs.rename(&shared2, &shared)),
                        // A directory into another (or into itself: refused).
                        13 => match fs.rename(&shared, format!("{shared2}/d")) {
                            Err(Error::InvalidInput(_)) => {}
                            r => racing(r),
                        },
                        // Attributes of this thread's file (a handle under its lock,
                        // beside the others' changes of the same table blocks), and
                        // of a shared name.
                        14 => {
                            if own.get(&name).is_some_and(|v| v.is_some()) {
                                let ino = fs.resolve(path.as_bytes(), false).expect("resolve");
                                let v = format!("{t}.{i}").into_bytes();
                                fs.set_xattr_ino(ino, b"user.t", &v, Default::default())
                                    .expect("setxattr own");
                                attrs.insert(name.clone(), v);
                                fs.set_permissions(&path, 0o600 | (i as u32 & 0o77))
                                    .expect("chmod own");
                            }
                            racing(fs.set_permissions(&shared, 0o755));
                        }
                        // This thread's file moves out to a shared name (no longer its
                        // own: unless the name was a link to it, which stays put).
                        15 => {
                            if own.get(&name).is_some_and(|v| v.is_some()) {
                                racing(fs.rename(&path, &shared));
                                if fs.symlink_metadata(&path).is_err() {
                                    own.remove(&name);
                                    attrs.remove(&name);
                                }
                            }
                        }
                        // An unnamed file (O_TMPFILE: an orphan from the start) that
                        // gets a shared name, or goes with its last reference.
                        _ => {
                            let f = fs.create_unnamed("/shared", 0o644, true).expect("tmpfile");
                            if with_data {
                                f.write_all_at(b"unnamed", 0).expect("write unnamed");
                            }
                            if rng.below(2) == 0 {
                                racing(f.link(&shared));
                            }
                        }
                    }
                }
                ((own, attrs), won)
            })
        })
        .collect();
    let (models, won): (Vec<_>, Vec<u64>) = workers
        .into_iter()
        .map(|w| w.join().expect("worker"))
        .unzip();
    // The shared directory saw real traffic, not only refusals.
    assert!(
        won.iter().all(|&w| w > 20),
        "shared-directory changes made: {won:?}"
    );
    stop.store(true, Ordering::Relaxed);
    assert!(background.join().expect("background") > 0);
    let check = |fs: &Fs| {
        for (t, (own, attrs)) in models.iter().enumerate() {
            let mut names: Vec<String> = fs
                .read_dir(format!("/t{t}"))
                .expect("readdir own")
                .into_iter()
                .map(|e| String::from_utf8_lossy(e.file_name()).into_owned())
                .collect();
            names.sort();
            let want: Vec<String> = own.keys().cloned().collect();
            assert_eq!(names, want, "thread {t}'s directory");
            for (name, v) in own {
                let p = format!("/t{t}/{name}");
                match v {
                    Some(data) => assert_eq!(&fs.read(&p).expect("read"), data, "{p}"),
                    None => assert!(fs.read_dir(&p).expect("readdir").is_empty(), "{p}"),
                }
                let x = fs.xattrs(&p).expect("xattrs");
                let got = x.iter().find(|(k, _)| k == b"user.t").map(|(_, v)| v);
                assert_eq!(got, attrs.get(name), "{p}: user.t");
            }
        }
        for dir in ["/shared", "/shared2"] {
            for e in fs.read_dir(dir).expect("readdir shared") {
                let p = format!("{dir}/{}", String::from_utf8_lossy(e.file_name()));
                fs.symlink_metadata(&p).expect("every shared name resolves");
            }
        }
    };
    check(&fs);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    check(&Fs::open(img.path()).expect("reopen"));
}

/// Creates and unlinks in one htree directory run with its inode lock shared, each
/// changing the one leaf its name hashes to under that leaf's lock (splits, growth and
/// names without one leaf take the directory exclusively). Four threads create and
/// unlink the same 64 names in a directory of 400 while a fifth adds new names (leaf
/// splits, index growth) and a sixth commits. For every name, the creates that
/// succeeded minus the unlinks that succeeded is 0 or 1 and says whether it is there
/// at the end — by readdir, by lookup through the dentry cache, and after a reopen —
/// and e2fsck -fn is clean.
#[test]
fn shared_directory_creates_and_unlinks_change_one_leaf_each() {
    use rext4::Error;
    use std::sync::atomic::AtomicI64;
    for round in 0..3u64 {
        let img = mkfs(&MkfsOptions::new(1024, 32 << 20)).expect("mkfs");
        let fs = rw(img.path());
        fs.create_dir("/d").expect("mkdir");
        for i in 0..400 {
            fs.write(format!("/d/filler-with-a-longer-name-{i:04}"), b"")
                .expect("filler");
        }
        const NAMES: usize = 64;
        let name = |k: usize| format!("/d/racing-name-{k:03}");
        let count: Arc<Vec<AtomicI64>> = Arc::new((0..NAMES).map(|_| AtomicI64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let helpers: Vec<_> = (0..2)
            .map(|h| {
                let (fs, stop) = (fs.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        if h == 0 {
                            fs.write(format!("/d/grown-{round}-{n:06}"), b"")
                                .expect("grow");
                        } else {
                            fs.sync().expect("sync");
                        }
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let (fs, count) = (fs.clone(), count.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(0xd1 + t + 8 * round);
                    for _ in 0..3000 {
                        let k = rng.below(NAMES as u64) as usize;
                        let p = name(k);
                        if rng.below(2) == 0 {
                            match rext4::OpenOptions::new()
                                .write(true)
                                .create_new(true)
                                .open(&fs, &p)
                            {
                                Ok(_) => {
                                    count[k].fetch_add(1, Ordering::SeqCst);
                                }
                                Err(Error::Exists) => {}
                                Err(e) => panic!("create {p}: {e}"),
                            }
                        } else {
                            match fs.remove_file(&p) {
                                Ok(()) => {
                                    count[k].fetch_sub(1, Ordering::SeqCst);
                                }
                                Err(Error::NotFound) => {}
                                Err(e) => panic!("unlink {p}: {e}"),
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker");
        }
        stop.store(true, Ordering::Relaxed);
        for h in helpers {
            assert!(h.join().expect("helper") > 0);
        }
        let check = |fs: &Fs, when: &str| {
            let listed: std::collections::BTreeSet<Vec<u8>> = fs
                .read_dir("/d")
                .expect("readdir")
                .into_iter()
                .map(|e| e.file_name().to_vec())
                .collect();
            for (k, c) in count.iter().enumerate() {
                let c = c.load(Ordering::SeqCst);
                assert!(c == 0 || c == 1, "{when}: {} made {c} times net", name(k));
                let p = name(k);
                let base = p.strip_prefix("/d/").expect("prefix").as_bytes().to_vec();
                assert_eq!(listed.contains(&base), c == 1, "{when}: readdir, {p}");
                assert_eq!(
                    fs.symlink_metadata(&p).is_ok(),
                    c == 1,
                    "{when}: lookup, {p}"
                );
            }
        };
        check(&fs, "before closing");
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "{}", r.output);
        check(&Fs::open(img.path()).expect("reopen"), "after reopening");
    }
}
