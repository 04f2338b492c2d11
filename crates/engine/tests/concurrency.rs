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
