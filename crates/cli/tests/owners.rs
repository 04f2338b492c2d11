//! Owners and labels without root (issue 39, item 3), through the kernel's view of the
//! image: `--uid-map`/`--gid-map` (user-namespace ranges, source ids to image ids)
//! from a directory built by a non-root user, `--owner` over a tar archive, a device
//! table (devices with their numbers, modes and owners, a file's mode changed) and a
//! file_contexts file (`security.selinux` as setfiles would set it), all made by a
//! non-root mkfs; and the bad inputs (a device table naming a file twice, malformed
//! maps) refused.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use rext4_testkit::{can_loop_mount, e2fsck_fn, read_xattrs, skip, LoopMount, TempDir};

const USER: u32 = 4321;

fn mkfs_as_user(args: &[&str], dir: &Path) -> common::Run {
    let out = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .arg("mkfs")
        .arg("-q")
        .args(args)
        .current_dir(dir)
        .uid(USER)
        .gid(USER)
        .stdin(Stdio::null())
        .output()
        .expect("rext4 mkfs");
    common::Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn owner(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.uid(), m.gid())
}

fn chown(p: &Path, u: u32, g: u32) {
    std::os::unix::fs::lchown(p, Some(u), Some(g)).expect("chown");
}

/// A work directory the test user may write, with a source tree it may read.
fn setup() -> Option<TempDir> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("needs root to make a tree of several owners and run mkfs as another user");
        return None;
    }
    if let Err(e) = can_loop_mount() {
        skip(&e);
        return None;
    }
    let w = TempDir::new("owners").expect("tempdir");
    std::fs::set_permissions(w.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    Some(w)
}

#[test]
fn id_maps_and_owner_without_root() {
    let Some(w) = setup() else { return };
    let src = w.join("src");
    std::fs::create_dir_all(src.join("d")).expect("src");
    for (name, u, g) in [
        ("a", 100_000, 100_000),
        ("b", 100_005, 100_007),
        ("c", 2000, 2000),
    ] {
        std::fs::write(src.join(name), name).expect("file");
        chown(&src.join(name), u, g);
    }
    chown(&src.join("d"), 100_000, 100_001);
    chown(&src, 100_000, 100_000);
    let r = mkfs_as_user(
        &[
            "--uid-map",
            "0:100000:65536",
            "--gid-map",
            "0:100000:65536",
            "-d",
            "src",
            "maps.img",
            "16M",
        ],
        w.path(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let img = w.join("maps.img");
    assert!(e2fsck_fn(&img).clean);
    {
        let m = LoopMount::new(&img, true, "").expect("mount");
        assert_eq!(owner(&m.path().join("a")), (0, 0));
        assert_eq!(owner(&m.path().join("b")), (5, 7));
        // No range covers 2000: the overflow id, as in a user namespace.
        assert_eq!(owner(&m.path().join("c")), (65534, 65534));
        assert_eq!(owner(&m.path().join("d")), (0, 1));
        assert_eq!(owner(m.path()), (0, 0));
        assert_eq!(owner(&m.path().join("lost+found")), (0, 0));
    }

    // --owner over a tar archive: every member and every implicit parent.
    let st = Command::new("tar")
        .args(["--numeric-owner", "-cf", "t.tar", "src/a", "src/d"])
        .current_dir(w.path())
        .status()
        .expect("tar");
    assert!(st.success());
    let r = mkfs_as_user(
        &["--owner", "1000:1001", "-d", "t.tar", "own.img", "16M"],
        w.path(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let img = w.join("own.img");
    assert!(e2fsck_fn(&img).clean);
    let m = LoopMount::new(&img, true, "").expect("mount");
    for p in ["src", "src/a", "src/d"] {
        assert_eq!(owner(&m.path().join(p)), (1000, 1001), "{p}");
    }

    // Malformed maps and owners are usage errors.
    for bad in [
        &["--uid-map", "0:1"][..],
        &["--uid-map", "0:10:10", "--uid-map", "5:15:1"],
        &["--owner", "root"],
    ] {
        let mut a = bad.to_vec();
        a.extend(["bad.img", "8M"]);
        let r = mkfs_as_user(&a, w.path());
        assert_eq!(r.code, 2, "{bad:?}: {}", r.stderr);
    }
}

#[test]
fn device_tables_and_file_contexts_without_root() {
    let Some(w) = setup() else { return };
    let src = w.join("src");
    std::fs::create_dir_all(src.join("etc")).expect("src");
    std::fs::create_dir_all(src.join("usr/bin")).expect("src");
    std::fs::write(src.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").expect("passwd");
    std::fs::write(src.join("usr/bin/sh"), "#!").expect("sh");
    std::fs::write(src.join("usr/bin/special"), "x").expect("special");
    std::fs::write(
        w.join("devices"),
        "# name type mode uid gid major minor start inc count\n\
         /dev          d 755 0 0 - - - - -\n\
         /dev/console  c 600 0 5 5 1 - - -\n\
         /dev/tty      c 666 0 0 4 0 0 1 3\n\
         /dev/loop     b 640 0 6 7 0 8 1 2\n\
         /dev/initctl  p 600 0 0 - - - - -\n\
         /etc/passwd   f 600 0 0 - - - - -\n\
         /var/log      d 750 0 4 - - - - -\n",
    )
    .expect("table");
    std::fs::write(
        w.join("file_contexts"),
        "/.*                  system_u:object_r:default_t:s0\n\
         /dev(/.*)?           system_u:object_r:device_t:s0\n\
         /dev/console   -c    system_u:object_r:console_device_t:s0\n\
         /dev/tty[0-9]* -c    system_u:object_r:tty_device_t:s0\n\
         /usr/bin(/.*)?       system_u:object_r:bin_t:s0\n\
         /usr/bin/special     system_u:object_r:special_exec_t:s0\n\
         /usr/bin/s.*   --    system_u:object_r:shell_exec_t:s0\n\
         /etc/passwd          <<none>>\n",
    )
    .expect("contexts");
    let r = mkfs_as_user(
        &[
            "--device-table",
            "devices",
            "--file-contexts",
            "file_contexts",
            "-d",
            "src",
            "dev.img",
            "16M",
        ],
        w.path(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let img = w.join("dev.img");
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "{}", fsck.output);
    let m = LoopMount::new(&img, true, "").expect("mount");
    let md = |p: &str| std::fs::symlink_metadata(m.path().join(p)).expect(p);
    let dev = |p: &str| {
        let r = md(p).rdev();
        (libc::major(r), libc::minor(r))
    };
    use std::os::unix::fs::FileTypeExt;
    assert!(md("dev/console").file_type().is_char_device());
    assert_eq!(dev("dev/console"), (5, 1));
    assert_eq!(md("dev/console").mode() & 0o7777, 0o600);
    assert_eq!(owner(&m.path().join("dev/console")), (0, 5));
    for (i, name) in ["dev/tty0", "dev/tty1", "dev/tty2"].iter().enumerate() {
        assert_eq!(dev(name), (4, i as u32), "{name}");
    }
    assert!(!m.path().join("dev/tty3").exists());
    assert!(md("dev/loop8").file_type().is_block_device());
    assert_eq!(dev("dev/loop9"), (7, 1));
    assert!(md("dev/initctl").file_type().is_fifo());
    assert_eq!(md("etc/passwd").mode() & 0o7777, 0o600);
    assert_eq!(
        std::fs::read(m.path().join("etc/passwd"))
            .expect("passwd")
            .len(),
        26
    );
    assert_eq!(md("var/log").mode() & 0o7777, 0o750);
    assert_eq!(owner(&m.path().join("var/log")), (0, 4));
    let label = |p: &str| {
        read_xattrs(&m.path().join(p))
            .expect("xattrs")
            .get(&b"security.selinux"[..])
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let want = |c: &str| Some(format!("system_u:object_r:{c}:s0\0"));
    assert_eq!(label(""), want("default_t"));
    assert_eq!(label("etc"), want("default_t"));
    assert_eq!(label("etc/passwd"), None);
    assert_eq!(label("dev"), want("device_t"));
    assert_eq!(label("dev/console"), want("console_device_t"));
    assert_eq!(label("dev/tty1"), want("tty_device_t"));
    assert_eq!(label("dev/loop8"), want("device_t"));
    assert_eq!(label("usr/bin"), want("bin_t"));
    assert_eq!(label("usr/bin/sh"), want("shell_exec_t"));
    assert_eq!(label("usr/bin/special"), want("special_exec_t"));
    assert_eq!(label("lost+found"), want("default_t"));
    drop(m);

    // A table naming a path twice is refused before the image is touched beyond mkfs.
    std::fs::write(
        w.join("twice"),
        "/dev/x c 600 0 0 1 1 - - -\n/dev/y c 600 0 0 1 2 - - -\n/dev/x b 600 0 0 1 1 - - -\n",
    )
    .expect("twice");
    let r = mkfs_as_user(&["--device-table", "twice", "twice.img", "8M"], w.path());
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("/dev/x is named twice (lines 1 and 3)"),
        "{}",
        r.stderr
    );
}
