//! Multi-mount protection (mke2fs -O mmp): rext4 takes part as the kernel does. A
//! read-write open takes the MMP block (at once when it is clean), a thread moves its
//! sequence while open, and close leaves it clean; a read-only open leaves it alone.
//! A second writer — another open of the device, the kernel — is refused naming the
//! node and device that hold the image, after the kernel's wait; another node's write
//! to the block while open shuts the filesystem down. The kernel and rext4 take turns
//! on one image: trees read identically, e2fsck -fn stays clean.
//!
//! (Two processes and `kill -9` of the holder: crates/cli/tests/mmp.rs.)

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rext4::device::{BlockDevice, FileDevice};
use rext4::format::mmp::{MmpBlock, SeqState, SEQ_CLEAN, SEQ_FSCK};
use rext4::format::superblock::Superblock;
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{
    can_loop_mount, diff_trees, e2fsck_fn, mkfs, populate_kernel, skip, snapshot_dir, Compare,
    Fixture, Image, LoopMount, MkfsOptions,
};

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

/// A 64 MiB image with multi-mount protection, updated every `interval` seconds.
fn mmp_image(interval: u16) -> Image {
    mkfs(
        &MkfsOptions::new(4096, 64 << 20)
            .arg("-O")
            .arg("mmp")
            .arg("-E")
            .arg(&format!("mmp_update_interval={interval}")),
    )
    .expect("mkfs.ext4 -O mmp")
}

fn superblock(img: &Path) -> Superblock {
    let mut b = vec![0u8; 1024];
    std::fs::File::open(img)
        .and_then(|f| f.read_exact_at(&mut b, 1024))
        .expect("read superblock");
    Superblock::decode(&b).expect("superblock")
}

fn seed(sb: &Superblock) -> Option<u32> {
    sb.metadata_csum().then(|| sb.csum_seed())
}

/// The MMP block as the image file holds it.
fn read_mmp(img: &Path) -> MmpBlock {
    let sb = superblock(img);
    let bs = u64::from(sb.block_size());
    let mut b = vec![0u8; bs as usize];
    std::fs::File::open(img)
        .and_then(|f| f.read_exact_at(&mut b, sb.mmp_block * bs))
        .expect("read MMP block");
    MmpBlock::decode(&b, seed(&sb)).expect("MMP block")
}

/// Write the MMP block as another node would.
fn write_mmp(img: &Path, m: &MmpBlock) {
    let sb = superblock(img);
    let bs = u64::from(sb.block_size());
    let mut b = vec![0u8; bs as usize];
    m.encode_into(&mut b, seed(&sb)).expect("encode");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(img)
        .expect("open image");
    f.write_all_at(&b, sb.mmp_block * bs)
        .expect("write MMP block");
    f.sync_data().expect("sync");
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn fsck_clean(img: &Path, label: &str) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "[{label}] e2fsck -fn:\n{}", r.output);
}

/// Poll `cond` for up to `limit`.
fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    cond()
}

/// Read-only opens do not touch the block; a read-write open takes it at once when it
/// is clean (no wait, as the kernel), names this node and the image path in it, moves
/// the sequence every interval, and close marks it clean again.
#[test]
fn a_writer_holds_the_block_while_open_and_leaves_it_clean() {
    let img = mmp_image(1);
    let before = std::fs::read(img.path()).expect("read image");
    {
        let fs = Fs::open(img.path()).expect("read-only open");
        let m = fs.mmp_block().expect("read MMP").expect("mmp feature");
        assert_eq!(m.state(), SeqState::Clean);
        fs.read_dir("/").expect("readdir");
    }
    assert!(
        std::fs::read(img.path()).expect("read image") == before,
        "a read-only open changed the image"
    );

    let fs = Fs::open_with(img.path(), rw()).expect("read-write open");
    let first = read_mmp(img.path());
    let SeqState::Live(seq) = first.state() else {
        panic!("open left the block {:?}", first.state());
    };
    assert_eq!(first.nodename_text(), hostname());
    let path = img.path().as_os_str().to_string_lossy().into_owned();
    assert!(
        path.starts_with(&first.bdevname_text()) && !first.bdevname_text().is_empty(),
        "device name {:?} is not the path {path}",
        first.bdevname_text()
    );
    assert_eq!(fs.mmp_block().expect("read MMP").expect("mmp"), first);
    fs.create_dir("/d").expect("mkdir");
    fs.write("/d/f", vec![5u8; 100_000]).expect("write");
    assert!(
        wait_for(Duration::from_secs(10), || read_mmp(img.path()).seq != seq),
        "the sequence did not move within 10 s (update interval 1 s)"
    );
    fs.sync().expect("sync");
    fs.close().expect("close");
    let m = read_mmp(img.path());
    assert_eq!(m.seq, SEQ_CLEAN, "close did not mark the block clean");
    fsck_clean(img.path(), "after close");
    let fs = Fs::open(img.path()).expect("reopen");
    assert_eq!(fs.read("/d/f").expect("read"), vec![5u8; 100_000]);
}

/// While one writer has the image, a second is refused naming the first: by the claim
/// at once (same host, same path), and by multi-mount protection after the kernel's
/// wait when it reaches the device another way (as another host on shared storage
/// would). e2fsck's sequence (FSCK) is refused at once.
#[test]
fn a_second_writer_is_refused_naming_the_first() {
    let img = mmp_image(1);
    let a = Fs::open_with(img.path(), rw()).expect("first writer");
    match Fs::open_with(img.path(), rw()) {
        Err(Error::InUse(m)) => assert!(m.contains("pid"), "{m}"),
        other => panic!("second open by path: {:?}", other.map(|_| ())),
    }
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(img.path(), false, false).expect("open device"));
    let t0 = Instant::now();
    let e = Fs::open_device(dev.clone(), rw()).err().expect("refused");
    let msg = e.to_string();
    // The device name is the path as given, cut to the field's 32 bytes.
    let path = img.path().as_os_str().to_string_lossy().into_owned();
    let device = &path[..path.len().min(32)];
    assert!(
        matches!(e, Error::InUse(_))
            && msg.contains("another node")
            && msg.contains(&hostname())
            && msg.contains(device),
        "{msg}"
    );
    eprintln!("refused after {:?}: {msg}", t0.elapsed());
    a.write("/a", b"first").expect("the first writer goes on");
    a.close().expect("close");
    assert_eq!(read_mmp(img.path()).seq, SEQ_CLEAN);

    // e2fsprogs' sequence: refused without waiting, the block left alone.
    let mut m = read_mmp(img.path());
    m.seq = SEQ_FSCK;
    write_mmp(img.path(), &m);
    match Fs::open_device(dev.clone(), rw()) {
        Err(Error::InUse(m)) => assert!(m.contains("e2fsck"), "{m}"),
        other => panic!("open during e2fsck: {:?}", other.map(|_| ())),
    }
    assert_eq!(read_mmp(img.path()).seq, SEQ_FSCK);
    // A read-only open goes on.
    let ro = Fs::open(img.path()).expect("read-only open");
    assert_eq!(ro.read("/a").expect("read"), b"first");
}

/// Another node writing the MMP block while rext4 has the image open: the updater
/// notices at its next update and the filesystem shuts down with the reason (the
/// kernel's error handling makes it read-only); the block is left as the other node
/// wrote it.
#[test]
fn another_node_taking_the_block_shuts_the_filesystem_down() {
    let img = mmp_image(1);
    let fs = Fs::open_with(img.path(), rw()).expect("open");
    fs.write("/before", b"committed").expect("write");
    fs.sync().expect("sync");
    let intruder = MmpBlock::new(7, now(), b"intruder-node", b"/dev/sdz", 5);
    write_mmp(img.path(), &intruder);
    let shut = wait_for(Duration::from_secs(15), || {
        matches!(fs.write("/probe", b"x"), Err(Error::ShutDown(_)))
    });
    assert!(shut, "no shutdown after another node's write");
    // From here on nothing reaches the image: not the writes refused below, not the
    // data written before them, not close's commit.
    let frozen = std::fs::read(img.path()).expect("read image");
    let f = fs.open_file("/before").expect("open");
    let _ = f.write_at(b"more data", 0);
    match fs.write("/after", b"x") {
        Err(Error::ShutDown(why)) => {
            assert!(
                why.contains("intruder-node") && why.contains("mounted twice"),
                "{why}"
            )
        }
        other => panic!("write after the shutdown: {other:?}"),
    }
    drop(f);
    let _ = fs.sync();
    let _ = fs.close();
    assert!(
        std::fs::read(img.path()).expect("read image") == frozen,
        "the image was written after the MMP block was lost"
    );
    let m = read_mmp(img.path());
    assert_eq!(
        (m.seq, m.nodename_text()),
        (7, "intruder-node".to_string()),
        "the other node's block was overwritten"
    );
}

/// The kernel and rext4 on one MMP image: a tree the kernel wrote reads identically in
/// rext4; rext4's writes are e2fsck-clean and the kernel sees them; while rext4 holds
/// the image the kernel's mount fails (after its wait), and while the kernel holds it
/// rext4 is refused naming the loop device.
#[test]
fn kernel_and_rext4_take_turns_on_an_mmp_image() {
    if let Err(why) = can_loop_mount() {
        return skip(&why);
    }
    let img = mmp_image(1);
    let m = match LoopMount::new(img.path(), false, "noatime") {
        Ok(m) => m,
        Err(e) => return skip(&format!("kernel mount of an mmp image: {e}")),
    };
    populate_kernel(m.path(), &Fixture::quick()).expect("populate through the kernel");
    m.unmount().expect("unmount");
    assert_eq!(
        read_mmp(img.path()).seq,
        SEQ_CLEAN,
        "the kernel left it clean"
    );
    fsck_clean(img.path(), "kernel-written");
    let kernel = {
        let m = LoopMount::new(img.path(), true, "noatime").expect("read-only mount");
        let t = snapshot_dir(m.path()).expect("kernel snapshot");
        m.unmount().expect("unmount");
        t
    };
    let ours = common::snapshot(&Fs::open(img.path()).expect("open")).expect("walk");
    let d = diff_trees(&kernel, &ours, &Compare::exact());
    assert!(d.is_empty(), "kernel vs rext4:\n{}", d.join("\n"));

    // rext4 writes; meanwhile the kernel cannot mount the image.
    let fs = Fs::open_with(img.path(), rw()).expect("rext4 read-write open");
    fs.create_dir("/rext4").expect("mkdir");
    for i in 0..50u32 {
        fs.write(format!("/rext4/f{i}"), vec![i as u8; 3000 * i as usize])
            .expect("write");
    }
    fs.rename("/rext4/f1", "/rext4/renamed").expect("rename");
    fs.hard_link("/rext4/f2", "/rext4/link").expect("link");
    fs.symlink("f3", "/rext4/sym").expect("symlink");
    fs.set_len("/rext4/f4", 5).expect("truncate");
    fs.remove_file("/rext4/f5").expect("unlink");
    fs.sync().expect("sync");
    let t0 = Instant::now();
    let refused = LoopMount::new(img.path(), false, "noatime");
    assert!(
        refused.is_err(),
        "the kernel mounted an image rext4 holds read-write"
    );
    eprintln!("kernel mount refused after {:?}", t0.elapsed());
    fs.write("/rext4/after-kernel", b"still ours")
        .expect("rext4 goes on after the kernel's attempt");
    fs.close().expect("close");
    assert_eq!(read_mmp(img.path()).seq, SEQ_CLEAN);
    fsck_clean(img.path(), "after rext4's writes");
    let ours = common::snapshot(&Fs::open(img.path()).expect("open")).expect("walk");

    // The kernel sees what rext4 wrote; while it holds the image, rext4 is refused.
    let m = LoopMount::new(img.path(), false, "noatime").expect("kernel mounts again");
    let kernel = snapshot_dir(m.path()).expect("kernel snapshot");
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(img.path(), false, false).expect("open device"));
    let e = Fs::open_device(dev, rw()).err().expect("refused");
    let msg = e.to_string();
    assert!(
        matches!(e, Error::InUse(_)) && msg.contains("loop"),
        "refusal while the kernel holds the image: {msg}"
    );
    m.unmount().expect("unmount");
    let d = diff_trees(&ours, &kernel, &Compare::exact());
    assert!(d.is_empty(), "rext4 vs kernel:\n{}", d.join("\n"));
    assert!(kernel.contains_key(&b"rext4/after-kernel"[..]));
    fsck_clean(img.path(), "after the kernel again");
}
