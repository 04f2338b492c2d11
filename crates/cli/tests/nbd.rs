//! NBD exports at the command line (`nbd+unix:///?socket=PATH`, served by nbdkit):
//! the reading and writing commands take `URI:/path`, `rext4 mkfs` formats an export,
//! `rext4 mount` serves one, `rext4 trim` gives the served file's space back; then the
//! file is e2fsck text-clean and, as root, the kernel reads what rext4 wrote. An
//! unreachable server or a bad URI field is an error naming it.

mod common;
mod fuse_mount;

use std::path::Path;
use std::process::Command;

use common::rext4;
use fuse_mount::{cannot_mount, Mounted};
use rext4_testkit::nbd::{have_libnbd, have_nbdkit};
use rext4_testkit::{e2fsck_fn, skip, LoopMount, NbdServer, TempDir};

const MIB: u64 = 1 << 20;

fn ready(label: &str) -> bool {
    if let Err(e) = have_nbdkit().and_then(|_| have_libnbd()) {
        skip(&format!("[{label}] {e}"));
        return false;
    }
    true
}

fn mkfs(img: &Path, size: u64) {
    std::fs::File::create(img)
        .and_then(|f| f.set_len(size))
        .expect("image");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096"])
        .arg(img)
        .output()
        .expect("mkfs.ext4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ok(args: &[&str]) -> common::Run {
    let r = rext4(args);
    assert_eq!(r.code, 0, "rext4 {args:?}: {}", r.stderr);
    r
}

#[test]
fn commands_and_mount_over_nbd() {
    if !ready("commands") {
        return;
    }
    let dir = TempDir::new("nbd-cli").expect("tmp");
    let img = dir.join("fs.img");
    mkfs(&img, 64 * MIB);
    let server = NbdServer::file(&img).expect("nbdkit");
    let uri = server.uri();
    let at = |p: &str| format!("{uri}:{p}");
    let host = dir.join("host.bin");
    let data: Vec<u8> = (0..5 * MIB as usize)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    std::fs::write(&host, &data).expect("host file");
    ok(&["mkdir", &at("/d")]);
    ok(&["cp", host.to_str().expect("utf8"), &at("/d/")]);
    let r = ok(&["ls", &at("/d")]);
    assert!(r.stdout_str().contains("host.bin"), "{}", r.stdout_str());
    let r = ok(&["cat", &at("/d/host.bin")]);
    assert!(r.stdout == data, "cat returned other bytes");
    let out = dir.join("out.bin");
    ok(&["cp", &at("/d/host.bin"), out.to_str().expect("utf8")]);
    assert!(std::fs::read(&out).expect("out") == data);
    // `URI:` is the root.
    let r = ok(&["ls", &at("")]);
    assert!(r.stdout_str().contains("lost+found"), "{}", r.stdout_str());
    let r = ok(&["info", &uri]);
    assert!(r.stdout_str().contains("0xEF53"), "{}", r.stdout_str());

    let mut via_mount = false;
    match cannot_mount() {
        Some(why) => skip(&format!("mount over NBD: {why}")),
        None => {
            let mut m = Mounted::new(Path::new(&uri), &[]);
            std::fs::create_dir(m.join("via-mount")).expect("mkdir in the mount");
            std::fs::write(m.join("via-mount/f"), &data[..3 * MIB as usize]).expect("write");
            assert!(
                std::fs::read(m.join("d/host.bin")).expect("read") == data,
                "the mount reads other bytes"
            );
            assert!(m.unmount().success(), "{}", m.stderr());
            via_mount = true;
        }
    }
    drop(server);
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "e2fsck: {}", fsck.output);
    match LoopMount::new(&img, true, "noatime") {
        Err(e) => skip(&format!("kernel reading what rext4 wrote over NBD: {e}")),
        Ok(m) => {
            let a = std::fs::read(m.path().join("d/host.bin")).expect("kernel reads");
            let b = via_mount.then(|| std::fs::read(m.path().join("via-mount/f")));
            m.unmount().expect("unmount");
            assert!(a == data, "the kernel reads other bytes");
            if let Some(b) = b {
                assert!(b.expect("kernel reads") == data[..3 * MIB as usize]);
            }
        }
    }
}

#[test]
fn mkfs_and_trim_over_nbd() {
    if !ready("mkfs and trim") {
        return;
    }
    let dir = TempDir::new("nbd-mkfs").expect("tmp");
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(256 * MIB))
        .expect("image");
    let server = NbdServer::file(&img).expect("nbdkit");
    let uri = server.uri();
    ok(&["mkfs", "-F", &uri]);
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&img).expect("stat").blocks() * 512
    };
    let fresh = allocated();
    let host = dir.join("big");
    std::fs::write(&host, vec![0xa5u8; 64 << 20]).expect("host file");
    ok(&["cp", host.to_str().expect("utf8"), &format!("{uri}:/")]);
    assert!(allocated() > fresh + (60 << 20));
    ok(&["rm", &format!("{uri}:/big")]);
    ok(&["trim", &uri]);
    let after = allocated();
    assert!(
        after < fresh + (4 << 20),
        "after rext4 trim over NBD the file holds {after} bytes (fresh: {fresh})"
    );
    drop(server);
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "e2fsck: {}", fsck.output);
}

#[test]
fn unreachable_servers_and_bad_fields_are_named() {
    if !ready("bad input") {
        return;
    }
    let dir = TempDir::new("nbd-bad").expect("tmp");
    let sock = dir.join("nobody.sock");
    let r = rext4(&["ls", &format!("nbd+unix:///?socket={}:/", sock.display())]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("No such file"), "{}", r.stderr);
    let r = rext4(&["ls", "nbd://127.0.0.1:99999/x:/"]);
    assert!(r.stderr.contains("port '99999'"), "{}", r.stderr);
    let r = rext4(&["ls", "nbd+unix:///x:/"]);
    assert!(r.stderr.contains("socket=PATH"), "{}", r.stderr);
    let r = rext4(&[
        "ls",
        &format!("nbd+unix:///?socket={}&colour=red:/", sock.display()),
    ]);
    assert!(r.stderr.contains("unknown field 'colour'"), "{}", r.stderr);
}
