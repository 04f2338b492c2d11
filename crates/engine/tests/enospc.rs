//! A full filesystem through the embedding API: failed creates leave the counts as
//! they were, a write that returned success is never dropped by writeback for lack of
//! space, a failed write leaves the size alone, and the pool and root reserve are kept
//! back as on the kernel's ext4. After each: the counts equal the bitmaps
//! (`check_counts`), every acknowledged write reads back, e2fsck -fn is clean.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rext4::{act_as_privileged, Error, FallocMode, Fs, FsOptions, OpenOptions};
use rext4_testkit::{e2fsck_fn, mkfs, MkfsOptions};

use common::{open_rw as rw, Rng};

fn assert_counts(fs: &Fs, what: &str) {
    let d = fs.check_counts().expect("counts");
    assert!(d.is_empty(), "{what}: counts differ:\n{}", d.join("\n"));
}

/// Write `chunk`-byte pieces to `path` until the filesystem refuses: the bytes it
/// took.
fn fill(fs: &Fs, path: &str, chunk: usize) -> u64 {
    let f = fs.create(path).expect("create the filler");
    let buf = vec![0x5a; chunk];
    let mut at = 0u64;
    loop {
        match f.write_at(&buf, at) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("filling {path}: {e}"),
        }
    }
    f.sync_all().expect("fsync the filler");
    at
}

/// The reproducer: a symlink whose block allocation fails took its inode from
/// a slot a freed directory had used, and giving the inode back freed it as that
/// directory (e2fsck: "Directories count wrong for group #0").
#[test]
fn failed_symlink_on_a_full_disk_keeps_the_directory_count() {
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let fs = rw(img.path());
    for d in ["/d1", "/d2", "/d3"] {
        fs.create_dir(d).expect("mkdir");
    }
    for d in ["/d1", "/d2", "/d3"] {
        fs.remove_dir(d).expect("rmdir");
    }
    fs.sync().expect("sync");
    let _root = act_as_privileged(true);
    fill(&fs, "/fill", 1 << 20);
    let target = "x".repeat(100);
    let r = fs.symlink(&target, "/s1");
    assert!(
        matches!(r, Err(Error::NoSpace)),
        "symlink on a full disk: {r:?}"
    );
    assert_counts(&fs, "after the failed symlink");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A write past the end that cannot get a single block fails and leaves the file's
/// size as it was (the kernel's ext4 does; rext4 grew it to the write's offset).
#[test]
fn failed_write_past_eof_keeps_the_size() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let f = fs.create("/small").expect("create");
    f.write_all_at(&[7u8; 100], 0).expect("write");
    f.sync_all().expect("fsync");
    fill(&fs, "/fill", 1 << 20);
    for (off, len) in [(1_230_700u64, 65536usize), (4096, 1 << 20), (8192, 4096)] {
        let r = f.write_at(&vec![1u8; len], off);
        assert!(
            matches!(r, Err(Error::NoSpace)),
            "write {len} at {off}: {r:?}"
        );
        assert_eq!(
            f.len().expect("len"),
            100,
            "size after a failed write at {off}"
        );
    }
    drop(f);
    assert_eq!(fs.read("/small").expect("read"), vec![7u8; 100]);
    assert_counts(&fs, "after failed writes");
    fs.close().expect("close");
    let again = Fs::open(img.path()).expect("reopen");
    assert_eq!(again.metadata("/small").expect("stat").len(), 100);
    drop(again);
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// What one worker saw succeed, per file: the model of its bytes.
type Model = HashMap<String, Vec<u8>>;

/// Several threads create files, write at scattered offsets through the page cache
/// (delayed allocation), make slow symlinks and directories until the filesystem is
/// full; every write that returned success must be on the image after close, which
/// itself must succeed (no writeback may have run out of space).
#[test]
fn writes_that_returned_are_never_dropped_when_the_disk_fills() {
    fill_with_workers(MkfsOptions::new(4096, 128 << 20), 1 << 20);
}

/// The same on block-mapped images, where a write's blocks also need indirect blocks
/// (delayed pages promise the ones their routes lack, and writeback must find them):
/// ext2 at 1 KiB blocks with writes scattered over 6 MiB (far into the DIND range:
/// many writes need a fresh IND), and ext3 at 4 KiB blocks.
#[test]
fn writes_that_returned_are_never_dropped_on_a_full_block_mapped_disk() {
    fill_with_workers(
        MkfsOptions::new(1024, 32 << 20).arg("-t").arg("ext2"),
        6 << 20,
    );
    fill_with_workers(
        MkfsOptions::new(4096, 64 << 20).arg("-t").arg("ext3"),
        8 << 20,
    );
}

/// Four workers fill the image `opts` makes, writing at offsets below `spread`.
fn fill_with_workers(opts: MkfsOptions, spread: u64) {
    let img = mkfs(&opts).expect("mkfs");
    let fs = Fs::open_with(
        img.path(),
        FsOptions {
            read_only: false,
            commit_secs: 0,
            // A small cache: writeback runs all along, not only at close.
            cache_bytes: Some(8 << 20),
            ..FsOptions::default()
        },
    )
    .expect("open");
    let models: Arc<Mutex<Model>> = Arc::default();
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let fs = fs.clone();
            let models = models.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 ^ (w + 1).wrapping_mul(0x1234_5677));
                let mut full = 0;
                let mut files: Vec<String> = Vec::new();
                let mut n = 0u64;
                while full < 60 {
                    n += 1;
                    let op = rng.below(10);
                    let r = if op < 2 || files.is_empty() {
                        let p = format!("/w{w}-{n}");
                        match fs.create(&p) {
                            Ok(_) => {
                                models.lock().expect("models").insert(p.clone(), Vec::new());
                                files.push(p);
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    } else if op == 2 {
                        fs.symlink("t".repeat(200), format!("/l{w}-{n}"))
                    } else if op == 3 {
                        fs.create_dir(format!("/d{w}-{n}"))
                    } else {
                        let p = &files[rng.below(files.len() as u64) as usize];
                        let off = rng.below(spread);
                        let len = 1 + rng.below(96 << 10) as usize;
                        let byte = (n % 251) as u8 + 1;
                        let f = OpenOptions::new()
                            .write(true)
                            .open(&fs, p)
                            .expect("open for writing");
                        match f.write_at(&vec![byte; len], off) {
                            Ok(k) => {
                                let mut m = models.lock().expect("models");
                                let v = m.get_mut(p).expect("modelled");
                                let end = off as usize + k;
                                if v.len() < end {
                                    v.resize(end, 0);
                                }
                                v[off as usize..end].fill(byte);
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    };
                    match r {
                        Ok(()) => {}
                        Err(Error::NoSpace) => full += 1,
                        Err(e) => panic!("worker {w}: op {op}: {e}"),
                    }
                }
            })
        })
        .collect();
    for t in workers {
        t.join().expect("worker");
    }
    assert_counts(&fs, "full, before close");
    fs.close()
        .expect("close: writeback of acknowledged writes must find its space");
    let again = Fs::open(img.path()).expect("reopen");
    let models = models.lock().expect("models");
    for (p, want) in models.iter() {
        let got = again.read(p).expect("read back");
        let first = got.iter().zip(want.iter()).position(|(a, b)| a != b);
        let run = first.map(|i| {
            let n = got[i..]
                .iter()
                .zip(&want[i..])
                .take_while(|(a, b)| a != b)
                .count();
            (i, n, got[i], want[i])
        });
        assert!(
            got.len() == want.len() && got == *want,
            "{p}: {} bytes on the image, {} acknowledged; first difference (offset, \
             length, image byte, acknowledged byte): {run:?}",
            got.len(),
            want.len(),
        );
    }
    assert_counts(&again, "after reopen");
    drop(again);
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// As the kernel's ext4: an unprivileged caller stops short of the root reserve, and
/// nobody's new data takes the pool kept for changes that must not fail; statfs says
/// so (f_bavail 0 while blocks are still free).
#[test]
fn root_reserve_and_pool_are_kept_back() {
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let sb = fs.superblock();
    assert!(sb.r_blocks_count > 0, "mkfs keeps a root reserve");
    let pool = (sb.blocks_count / 50).min(4096);
    {
        let _user = act_as_privileged(false);
        fill(&fs, "/user", 1 << 20);
        let st = fs.statfs();
        assert_eq!(
            st.blocks_available, 0,
            "an unprivileged writer used what it may"
        );
        assert!(
            st.blocks_free >= sb.r_blocks_count + pool,
            "{} free, reserve {} + pool {pool}",
            st.blocks_free,
            sb.r_blocks_count
        );
        assert!(matches!(
            fs.create_dir("/more"),
            Ok(()) | Err(Error::NoSpace)
        ));
    }
    let _root = act_as_privileged(true);
    let took = fill(&fs, "/root", 1 << 20);
    assert!(took > 0, "root writes into its reserve");
    let st = fs.statfs();
    assert!(
        st.blocks_free >= pool,
        "{} free, pool {pool}",
        st.blocks_free
    );
    assert!(
        st.blocks_free < pool + 256,
        "root used its reserve: {} free",
        st.blocks_free
    );
    // Freeing gives the space back to everyone.
    fs.remove_file("/root").expect("rm");
    fs.remove_file("/user").expect("rm");
    fs.sync().expect("sync");
    assert!(fs.statfs().blocks_available > sb.blocks_count / 2);
    assert_counts(&fs, "after filling and freeing");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// Random sizes of buffered writes never leave promises behind: after fsync of
/// everything nothing is promised, and statfs's free count equals the superblock's.
#[test]
fn promises_are_all_given_back() {
    let img = mkfs(&MkfsOptions::new(1024, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let mut rng = Rng(77);
    let f = fs.create("/f").expect("create");
    for _ in 0..300 {
        let off = rng.below(4 << 20);
        let len = 1 + rng.below(40_000) as usize;
        match rng.below(5) {
            0 => f.set_len(rng.below(4 << 20)).expect("truncate"),
            _ => f.write_all_at(&vec![3u8; len], off).expect("write"),
        }
    }
    let st = fs.page_cache_stats();
    assert!(
        st.reserved_blocks > 0,
        "the writes left dirty pages over holes"
    );
    f.sync_all().expect("fsync");
    let st = fs.page_cache_stats();
    assert_eq!((st.reserved_blocks, st.reserved_tree_blocks), (0, 0));
    assert_eq!(fs.statfs().blocks_free, fs.superblock().free_blocks_count);
    drop(f);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A name added to a full one-block directory converts it to an htree, which takes
/// two new blocks; with one left the second allocation fails. The directory must stay
/// well formed (it kept the first block as an empty leaf), nothing leaks.
#[test]
fn directory_growth_that_runs_out_halfway_leaves_it_whole() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.create_dir("/d").expect("mkdir");
    // 19 entries of 208 bytes fill the 4060 bytes after "." and ".." and the tail.
    let name = |i: usize| format!("/d/{i:0>200}");
    for i in 0..19 {
        fs.create(name(i)).expect("create");
    }
    assert_eq!(
        fs.metadata("/d").expect("stat").len(),
        4096,
        "still one block"
    );
    let _root = act_as_privileged(true);
    let took = fill(&fs, "/fill", 1 << 20);
    // Give back exactly one block, committed so it can be used.
    fs.set_len("/fill", took - 4096).expect("shrink by a block");
    fs.sync().expect("sync");
    let r = fs.create(name(19));
    assert!(
        matches!(r, Err(Error::NoSpace)),
        "20th name: {:?}",
        r.map(|_| ())
    );
    let names = fs.read_dir("/d").expect("readdir");
    assert_eq!(names.len(), 19);
    assert_counts(&fs, "after the failed conversion");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    // Once space is back, the directory takes the name.
    let fs = rw(img.path());
    fs.remove_file("/fill").expect("rm");
    fs.create(name(19)).expect("create after freeing");
    assert_eq!(fs.read_dir("/d").expect("readdir").len(), 20);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A name that exists is reported as existing (EEXIST) before any other refusal of a
/// create — no free inode, an immutable directory, too many links — also when the
/// dentry cache does not know the name and the create learns it only in the leaf walk
/// that would add the entry (the inode it allocated is given back: counts unchanged).
#[test]
fn an_existing_name_wins_over_every_other_refusal() {
    let mut o = MkfsOptions::new(4096, 64 << 20);
    o.inodes = Some(256);
    let img = mkfs(&o).expect("mkfs");
    let name = |i: u32| format!("/d/a-name-long-enough-for-an-htree-{i:05}");
    {
        let fs = rw(img.path());
        let _root = act_as_privileged(true);
        fs.create_dir("/d").expect("mkdir");
        // 400 names for one file (hard links take no inode): an indexed directory.
        let f = fs.create(name(0)).expect("create");
        for i in 1..400 {
            f.link(name(i)).expect("link");
        }
        fs.create_dir("/fill").expect("mkdir");
        let mut i = 0;
        loop {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&fs, format!("/fill/{i}"))
            {
                Ok(_) => i += 1,
                Err(Error::NoSpace) => break,
                Err(e) => panic!("filling the inodes: {e}"),
            }
        }
        assert_eq!(fs.statfs().inodes_free, 0);
        fs.close().expect("close");
    }
    // Reopened: the dentry cache knows no name.
    let fs = rw(img.path());
    let _root = act_as_privileged(true);
    let excl = |p: &str| {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&fs, p)
            .map(drop)
    };
    let exists = |r: rext4::Result<()>, what: &str| {
        assert!(matches!(r, Err(Error::Exists)), "{what}: {r:?}");
    };
    // No free inode.
    exists(
        excl(&name(1)),
        "O_EXCL create of an existing name, no free inode",
    );
    exists(
        fs.create_dir(name(2)),
        "mkdir over an existing name, no free inode",
    );
    exists(
        fs.symlink("t", name(3)),
        "symlink over an existing name, no free inode",
    );
    let r = excl("/d/new");
    assert!(matches!(r, Err(Error::NoSpace)), "a new name: {r:?}");
    // Free inodes: the create learns of the name in the leaf walk, after allocating.
    fs.remove_file("/fill/0").expect("unlink");
    fs.remove_file("/fill/1").expect("unlink");
    let free = fs.statfs().inodes_free;
    exists(excl(&name(11)), "O_EXCL create of an existing name");
    exists(fs.create_dir(name(12)), "mkdir over an existing name");
    exists(
        fs.symlink("x".repeat(200), name(13)),
        "long symlink over an existing name",
    );
    exists(
        fs.mknod(name(14), 0o10644, (0, 0)),
        "mknod (FIFO) over an existing name",
    );
    assert_eq!(fs.statfs().inodes_free, free, "inodes given back");
    assert_counts(&fs, "after the refused creates");
    // An immutable directory: EEXIST for a name it has, EPERM for a new one.
    let d = fs.resolve(b"/d", true).expect("resolve");
    let flags = fs.flags_ino(d).expect("lsattr");
    fs.set_flags_ino(d, flags | 0x10).expect("chattr +i");
    exists(excl(&name(21)), "O_EXCL create in an immutable directory");
    let r = excl("/d/new");
    assert!(
        matches!(r, Err(Error::NotPermitted(_))),
        "immutable, new name: {r:?}"
    );
    fs.set_flags_ino(d, flags).expect("chattr -i");
    // Every name is still there, once.
    let names = fs.read_dir("/d").expect("readdir");
    let ours = names
        .iter()
        .filter(|e| e.name.starts_with(b"a-name"))
        .count();
    assert_eq!(ours, 400);
    excl("/d/new").expect("a new name once the directory is writable");
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A large aligned write that goes to the device at once (a frontend that caches
/// clean data itself, as the mount: `cache_clean` off) shows its end as the file's
/// size while its data is on the way. A whole-file pass by another thread meanwhile
/// (here fsyncs of the same file on a second handle; on the mount, an early commit)
/// must not write that size to the record as if the rest were a hole: when the write
/// then fails with ENOSPC, the file must keep the size of what succeeded (before the
/// fix, 1 MiB longer in most runs of the mount's full-disk test).
#[test]
fn a_failed_write_going_out_at_once_leaves_no_size_behind() {
    for round in 0..12 {
        let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
        let fs = Fs::open_with(
            img.path(),
            FsOptions {
                read_only: false,
                commit_secs: 0,
                cache_clean: false,
                ..FsOptions::default()
            },
        )
        .expect("open");
        let f = fs.create("/w").expect("create");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let racer = {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                let g = OpenOptions::new()
                    .write(true)
                    .open(&fs, "/w")
                    .expect("second handle");
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = g.sync_all();
                    n += 1;
                }
                n
            })
        };
        let buf = vec![0x3cu8; 1 << 20];
        let mut acked = 0u64;
        let err = loop {
            match fs.write_ino_at(f.ino(), &buf, acked) {
                Ok(n) => acked += n as u64,
                Err(e) => break e,
            }
        };
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let syncs = racer.join().expect("racer");
        assert!(matches!(err, Error::NoSpace), "round {round}: {err}");
        let _ = f.sync_all();
        let size = fs.stat_ino(f.ino()).expect("stat").len();
        assert_eq!(
            size, acked,
            "round {round}: the file's size after the failed write ({syncs} racing fsyncs)"
        );
        drop(f);
        fs.close().expect("close");
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "round {round}: {}", r.output);
    }
}

/// Batches of O_DIRECT writes on a full disk: a batch of pure overwrites needs no
/// block and succeeds under the shared lock; a batch with one write into a hole goes
/// one by one, the overwrites before it land, the hole's write fails with ENOSPC and
/// leaves the size alone. Then every acknowledged byte reads back after a reopen, the
/// counts equal the bitmaps and e2fsck -fn is clean.
#[test]
fn batches_of_direct_writes_on_a_full_disk() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let f = fs.create("/q").expect("create");
    // 64 KiB written, then a 64 KiB hole, then 64 KiB more: 192 KiB long.
    f.write_all_at(&[0x11; 65536], 0).expect("write");
    f.write_all_at(&[0x22; 65536], 131072).expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    fill(&fs, "/fill", 1 << 20);
    let q = OpenOptions::new()
        .write(true)
        .direct(true)
        .open(&fs, "/q")
        .expect("open direct");
    let mut model = vec![0x11u8; 65536];
    model.extend_from_slice(&[0u8; 65536]);
    model.extend_from_slice(&[0x22u8; 65536]);
    let before = fs.io_stats();
    let bufs: Vec<Vec<u8>> = (0..8u8).map(|k| vec![0x40 | k; 4096]).collect();
    let slots = [0u64, 3, 7, 15, 32, 33, 40, 47];
    let batch: Vec<(&[u8], u64)> = slots
        .iter()
        .zip(&bufs)
        .map(|(&s, b)| (&b[..], s * 4096))
        .collect();
    q.write_all_at_batch(&batch)
        .expect("overwrites need no block on a full disk");
    for (&s, b) in slots.iter().zip(&bufs) {
        model[(s * 4096) as usize..][..4096].copy_from_slice(b);
    }
    let after = fs.io_stats();
    assert_eq!(
        (
            after.direct_shared - before.direct_shared,
            after.direct_exclusive - before.direct_exclusive
        ),
        (8, 0),
        "(shared, exclusive) writes of the batch of overwrites"
    );
    // Slot 20 lies in the hole: the batch falls back to one write at a time.
    let hole_batch: Vec<(&[u8], u64)> = vec![(&bufs[0][..], 4096), (&bufs[1][..], 20 * 4096)];
    let r = q.write_all_at_batch(&hole_batch);
    assert!(
        matches!(r, Err(Error::NoSpace)),
        "a write into a hole: {r:?}"
    );
    model[4096..8192].copy_from_slice(&bufs[0]);
    assert_eq!(
        fs.metadata("/q").expect("stat").len(),
        model.len() as u64,
        "the size after the failed batch"
    );
    drop(q);
    assert_counts(&fs, "after the batches");
    fs.close().expect("close");
    let fs = rw(img.path());
    let back = fs.read("/q").expect("read");
    assert!(
        back == model,
        "the file does not hold the acknowledged writes"
    );
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

/// A device that stops the first write of a block filled with `GATE_BYTE` until the
/// test lets it go (the data write of one writeback piece, caught in flight).
struct Gate {
    state: std::sync::Mutex<(bool, bool)>, // (arrived, released)
    cv: std::sync::Condvar,
}

const GATE_BYTE: u8 = 0xaa;

impl common::Hooks for Gate {
    fn write(&self, buf: &[u8], _off: u64) -> std::io::Result<()> {
        if buf.len() == 4096 && buf.iter().all(|&b| b == GATE_BYTE) {
            let mut s = self.state.lock().expect("gate");
            s.0 = true;
            self.cv.notify_all();
            while !s.1 {
                s = self.cv.wait(s).expect("gate");
            }
        }
        Ok(())
    }
}

/// Direct writes of `chunk` bytes to a new file `path` until the filesystem refuses,
/// then of single blocks: afterwards nothing is left past the pool, and no dirty page
/// of another file was written back to get there (direct writes allocate at once).
fn fill_direct(fs: &Fs, path: &str) {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .direct(true)
        .open(fs, path)
        .expect("create the filler");
    let mut at = f.metadata().expect("stat").len();
    for chunk in [1usize << 20, 4096] {
        let buf = vec![0x5a; chunk];
        loop {
            match f.write_at(&buf, at) {
                Ok(n) if n == chunk => at += n as u64,
                Ok(n) => {
                    at += n as u64;
                    break;
                }
                Err(Error::NoSpace) => break,
                Err(e) => panic!("filling {path}: {e}"),
            }
        }
        at = at.div_ceil(4096) * 4096;
    }
}

/// The fill_stress failure, step by step: a writeback chunk holds a dirty page to keep
/// (page 0) and two a punch drops while the chunk is on its way (pages 100 and 101).
/// The punch gives their promised blocks back and waits for the chunk; other writes
/// take those blocks. The chunk must not allocate for the dropped pages (a fresh
/// claim, which finds nothing on a full disk): that failure dropped the whole chunk —
/// page 0's acknowledged data read back as zeros and writeback reported ENOSPC.
#[test]
fn pages_punched_under_writeback_cost_the_chunk_nothing() {
    pages_dropped_under_writeback(false);
}

/// The same with a truncate to page 100 dropping the two pages.
#[test]
fn pages_cut_under_writeback_cost_the_chunk_nothing() {
    pages_dropped_under_writeback(true);
}

fn pages_dropped_under_writeback(cut: bool) {
    let _root = act_as_privileged(true);
    let tmp = rext4_testkit::TempDir::new("enospc-punch-under-wb").expect("tmp");
    let img = tmp.join("img");
    std::fs::write(&img, vec![0u8; 16 << 20]).expect("image");
    rext4_testkit::tools::mkfs_at(&img, &MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let dev = Arc::new(common::Hooked::mem(
        std::fs::read(&img).expect("read image"),
        Gate {
            state: std::sync::Mutex::new((false, true)),
            cv: std::sync::Condvar::new(),
        },
    ));
    let opts = FsOptions {
        read_only: false,
        commit_secs: 0,
        ..FsOptions::default()
    };
    let fs = Arc::new(Fs::open_device(dev.clone(), opts).expect("open"));
    let f = fs.create("/f").expect("create");
    f.write_all_at(&[GATE_BYTE; 4096], 0).expect("page 0");
    f.write_all_at(&[0xbb; 8192], 100 * 4096)
        .expect("pages 100 and 101");
    let ino = f.ino();
    fill_direct(&fs, "/fill");
    assert_eq!(fs.blocks_available_to(true), 0, "the disk is full");

    dev.state.lock().expect("gate").1 = false;
    let wb = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.sync_range_ino(ino, 0, 0))
    };
    {
        let mut s = dev.state.lock().expect("gate");
        while !s.0 {
            s = dev.cv.wait(s).expect("gate");
        }
    }
    // Page 0's data is on its way; pages 100 and 101 are in the same chunk.
    let punch = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            if cut {
                fs.truncate_ino(ino, 100 * 4096)
            } else {
                fs.fallocate_ino(ino, FallocMode::PunchHole, 100 * 4096, 8192)
            }
        })
    };
    // The punch (or truncate) drops the pages (their promises come back), then waits
    // for the chunk.
    let t0 = std::time::Instant::now();
    while fs.blocks_available_to(true) == 0 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "the punch never dropped the pages"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    fill_direct(&fs, "/fill2");
    assert_eq!(fs.blocks_available_to(true), 0, "full again");
    {
        let mut s = dev.state.lock().expect("gate");
        s.1 = true;
        dev.cv.notify_all();
    }
    let r = wb.join().expect("writeback thread");
    punch
        .join()
        .expect("punch thread")
        .expect("punch or truncate");
    r.expect("writeback of the chunk");
    f.sync_all().expect("fsync");
    let back = fs.read("/f").expect("read /f");
    assert_eq!(back.len(), if cut { 100 } else { 102 } * 4096, "the size");
    assert!(
        back[..4096].iter().all(|&b| b == GATE_BYTE),
        "page 0 lost its data"
    );
    assert!(
        back[4096..].iter().all(|&b| b == 0),
        "the hole and the punched pages"
    );
    drop(f);
    assert_counts(&fs, "after the punch under writeback");
    let fs = Arc::try_unwrap(fs).unwrap_or_else(|_| panic!("fs still shared"));
    fs.close().expect("close");
    std::fs::write(&img, dev.snapshot()).expect("save the image");
    let r = e2fsck_fn(&img);
    assert!(r.clean, "{}", r.output);
}
