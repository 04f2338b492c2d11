//! Multi-mount protection through the tools: `rext4 mount` holds an MMP image's block
//! for its life (the sequence moves, named for this host) and leaves it clean at
//! unmount; a second process that would write is refused naming the first; after
//! `kill -9` of the mount, a writer opens the image once the sequence has gone stale
//! (the kernel's wait), replays the journal and leaves e2fsck clean. `rext4 info`
//! shows the MMP fields in dumpe2fs's words (crates/cli/tests/commands.rs).

mod fuse_mount;

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use fuse_mount::{bin, cannot_mount, Mounted};
use rext4::format::mmp::{MmpBlock, SeqState, SEQ_CLEAN};
use rext4::format::superblock::Superblock;
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, MkfsOptions};

fn rext4<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run rext4")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn spec(img: &Path, p: &str) -> String {
    format!("{}:{p}", img.display())
}

/// The MMP block as the image file holds it.
fn read_mmp(img: &Path) -> MmpBlock {
    let f = File::open(img).expect("open image");
    let mut b = vec![0u8; 1024];
    f.read_exact_at(&mut b, 1024).expect("read superblock");
    let sb = Superblock::decode(&b).expect("superblock");
    let bs = u64::from(sb.block_size());
    let mut b = vec![0u8; bs as usize];
    f.read_exact_at(&mut b, sb.mmp_block * bs)
        .expect("read MMP block");
    MmpBlock::decode(&b, sb.metadata_csum().then(|| sb.csum_seed())).expect("MMP block")
}

fn write_synced(p: &Path, data: &[u8]) {
    let mut f = File::create(p).expect("create");
    f.write_all(data).expect("write");
    f.sync_all().expect("fsync");
    File::open(p.parent().expect("parent"))
        .and_then(|d| d.sync_all())
        .expect("fsync dir");
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

#[test]
fn a_mount_holds_the_block_and_a_killed_one_is_waited_out() {
    if let Some(why) = cannot_mount() {
        return skip(&why);
    }
    let img: Image = mkfs(
        &MkfsOptions::new(4096, 64 << 20)
            .arg("-O")
            .arg("mmp")
            .arg("-E")
            .arg("mmp_update_interval=1"),
    )
    .expect("mkfs.ext4 -O mmp");

    // A mount holds the block for its life, and unmount leaves it clean.
    let mut m = Mounted::new(img.path(), &[]);
    let held = read_mmp(img.path());
    let SeqState::Live(seq) = held.state() else {
        panic!("mounted, the block is {:?}", held.state());
    };
    assert_eq!(held.nodename_text(), hostname());
    write_synced(&m.join("first"), b"written through the mount");
    let t0 = Instant::now();
    while read_mmp(img.path()).seq == seq {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the mount's sequence did not move (interval 1 s)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A second writer is refused, naming the mount's server.
    let out = rext4(&["mkdir", &spec(img.path(), "/second")]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("in use") && stderr(&out).contains(&format!("pid {}", m.pid())),
        "{}",
        stderr(&out)
    );
    assert!(m.unmount().success(), "{}", m.stderr());
    assert_eq!(read_mmp(img.path()).seq, SEQ_CLEAN, "unmount left it held");
    fsck_clean(img.path(), "after unmount");

    // kill -9 of the mount: the block keeps its last sequence, which no one moves.
    let mut m = Mounted::new(img.path(), &[]);
    write_synced(&m.join("acked"), b"fsynced before the kill");
    // SAFETY: signalling the server this test started.
    assert_eq!(unsafe { libc::kill(m.pid(), libc::SIGKILL) }, 0);
    assert!(
        m.wait_exit(Duration::from_secs(10)).is_some(),
        "the server survived SIGKILL"
    );
    assert!(matches!(read_mmp(img.path()).state(), SeqState::Live(_)));
    // The next writer waits the sequence out (twice the check interval plus a second,
    // before and after its own write), then opens and replays.
    let t0 = Instant::now();
    let out = rext4(&["mkdir", &spec(img.path(), "/after-kill")]);
    let took = t0.elapsed();
    assert!(
        out.status.success(),
        "mkdir after the kill: {}",
        stderr(&out)
    );
    eprintln!("mkdir after kill -9 of the holder took {took:?}");
    drop(m);
    assert_eq!(read_mmp(img.path()).seq, SEQ_CLEAN);
    fsck_clean(img.path(), "after the killed mount");
    let fs = rext4::Fs::open(img.path()).expect("open");
    assert_eq!(
        fs.read("/acked").expect("read acked"),
        b"fsynced before the kill"
    );
    assert_eq!(
        fs.read("/first").expect("read"),
        b"written through the mount"
    );
    fs.read_dir("/after-kill").expect("the mkdir happened");
    drop(fs);
    // The kernel sees what the mount and the CLI wrote.
    match rext4_testkit::LoopMount::new(img.path(), true, "noatime") {
        Ok(k) => {
            assert_eq!(
                std::fs::read(k.path().join("acked")).expect("kernel read"),
                b"fsynced before the kill"
            );
            assert!(k.path().join("after-kill").is_dir());
            k.unmount().expect("unmount");
        }
        Err(e) => skip(&format!("kernel mount: {e}")),
    }
}

/// `rext4 mkfs -O mmp` gives what mkfs.ext4 gives (dumpe2fs, the MMP block's own
/// time and device name aside: crates/cli/tests/mkfs_cli.rs filters them), and the
/// image is e2fsck-clean and takes a rext4 writer at once.
#[test]
fn rext4_mkfs_makes_an_mmp_image_writers_take_at_once() {
    let d = rext4_testkit::TempDir::new("mmp-mkfs").expect("tempdir");
    let img = d.join("mmp.img");
    let out = rext4(&[
        "mkfs".as_ref(),
        "-q".as_ref(),
        "-O".as_ref(),
        "mmp".as_ref(),
        "-E".as_ref(),
        "mmp_update_interval=2".as_ref(),
        img.as_os_str(),
        "32M".as_ref(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let m = read_mmp(&img);
    assert_eq!(m.seq, SEQ_CLEAN);
    assert_eq!(m.nodename_text(), hostname());
    fsck_clean(&img, "fresh");
    let info = rext4(&["info".as_ref(), img.as_os_str()]);
    let text = String::from_utf8_lossy(&info.stdout).into_owned();
    assert!(
        text.contains("MMP update interval:      2") && text.contains("mmp_sequence: 0xff4d4d50"),
        "{text}"
    );
    let out = rext4(&["mkdir", &spec(&img, "/d")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_mmp(&img).seq, SEQ_CLEAN);
    fsck_clean(&img, "after mkdir");
}
