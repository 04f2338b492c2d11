//! `rext4 mkfs` against `mkfs.ext4` through the command line: same UUID, hash seed and
//! creation time give the same `dumpe2fs` output (full, with every group), except the
//! two fields that must differ: "Lifetime writes" (mke2fs counts what its own write
//! cache flushed) and the superblock "Checksum" (it covers that field), and with
//! `-O mmp` the MMP block's update time and device name.

use std::path::Path;
use std::process::Command;

use rext4_testkit::{e2fsck_fn, skip, TempDir};

const UUID: &str = "5b1f00d5-3c1e-4d4b-9a6e-0123456789ab";
const SEED: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const TIME: &str = "1790000000";

fn dumpe2fs(img: &std::path::Path) -> Vec<String> {
    let out = Command::new("dumpe2fs")
        .arg(img)
        .env("TZ", "UTC")
        .output()
        .expect("dumpe2fs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with("Lifetime writes:") && !l.starts_with("Checksum:"))
        // An MMP block's time (mke2fs takes the real time, not the fake one) and device
        // (each image's own path).
        .filter(|l| {
            ![
                "    mmp_update_date:",
                "    mmp_update_time:",
                "    mmp_device_name:",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .map(str::to_string)
        .collect()
}

fn compare(size: &str, extra: &[&str]) {
    compare_with(size, extra, "");
}

/// `compare`, with `ext` added to the -E list of both tools (mke2fs keeps only its
/// last -E).
fn compare_with(size: &str, extra: &[&str], ext: &str) -> TempDir {
    let d = TempDir::new("mkfs-cli").expect("tempdir");
    let ours = d.join("ours.img");
    let theirs = d.join("theirs.img");
    let e = format!("hash_seed={SEED}{ext}");
    let st = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args(["mkfs", "-q", "-U", UUID, "-E", &e])
        .args(extra)
        .arg(&ours)
        .arg(size)
        .env("E2FSPROGS_FAKE_TIME", TIME)
        .status()
        .expect("rext4 mkfs");
    assert!(st.success());
    // mke2fs marks inode tables zeroed (ITABLE_ZEROED) when it can discard an existing
    // file, as rext4 does for the sparse file it makes; a file mke2fs has to create
    // itself gets lazy init instead. Give it an existing sparse file, as `truncate -s`.
    let bytes: u64 = match size.as_bytes().last() {
        Some(b'M') => size[..size.len() - 1].parse::<u64>().expect("n") << 20,
        Some(b'G') => size[..size.len() - 1].parse::<u64>().expect("n") << 30,
        _ => panic!("size {size}"),
    };
    std::fs::File::create(&theirs)
        .and_then(|f| f.set_len(bytes))
        .expect("create");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-U", UUID, "-E", &e])
        .args(extra)
        .arg(&theirs)
        .arg(size)
        .env("E2FSPROGS_FAKE_TIME", TIME)
        .status()
        .expect("mkfs.ext4");
    assert!(st.success());
    let (a, b) = (dumpe2fs(&ours), dumpe2fs(&theirs));
    let diff: Vec<String> = a
        .iter()
        .zip(b.iter())
        .filter(|(x, y)| x != y)
        .map(|(x, y)| format!("rext4:    {x}\nmkfs.ext4: {y}"))
        .collect();
    assert!(
        diff.is_empty() && a.len() == b.len(),
        "{size} {extra:?}:\n{}",
        diff.join("\n")
    );
    let r = e2fsck_fn(&ours);
    assert!(r.clean, "{}", r.output);
    d
}

/// `debugfs -R "stat PATH"`, without the lines that carry the inode checksum.
fn debugfs_stat(img: &Path, path: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", &format!("stat {path}")])
        .arg(img)
        .env("TZ", "UTC")
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// "User:  1000   Group:  1001" of `debugfs stat` → (uid, gid).
fn owner_of(stat: &str) -> (u32, u32) {
    let w: Vec<&str> = stat
        .lines()
        .find(|l| l.starts_with("User:"))
        .expect("User: line")
        .split_whitespace()
        .collect();
    (w[1].parse().expect("uid"), w[3].parse().expect("gid"))
}

/// -E root_owner=UID:GID gives what mke2fs gives (dumpe2fs, and debugfs's stat of the
/// root and lost+found, inode checksums included): the root directory owned by
/// UID:GID, lost+found still 0:0.
#[test]
fn root_owner_like_mke2fs() {
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        return skip("mkfs.ext4 not installed");
    }
    let d = compare_with("64M", &[], ",root_owner=1000:1001");
    let (ours, theirs) = (d.join("ours.img"), d.join("theirs.img"));
    for p in ["/", "/lost+found"] {
        assert_eq!(debugfs_stat(&ours, p), debugfs_stat(&theirs, p), "stat {p}");
    }
    assert_eq!(owner_of(&debugfs_stat(&ours, "/")), (1000, 1001));
    assert_eq!(owner_of(&debugfs_stat(&ours, "/lost+found")), (0, 0));
}

/// Without root, mkfs makes the root directory the caller's (so their mount of it is
/// writable for them); as root it stays 0:0; `-E root_owner` (no value) is the caller.
#[test]
fn root_directory_belongs_to_a_non_root_caller() {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("needs root to run mkfs as another user");
    }
    let d = TempDir::new("mkfs-owner").expect("tempdir");
    std::fs::set_permissions(
        d.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod");
    let mk = |name: &str, as_user: bool, extra: &[&str]| {
        let img = d.join(name);
        let mut c = Command::new(env!("CARGO_BIN_EXE_rext4"));
        c.arg("mkfs").arg("-q").args(extra).arg(&img).arg("16M");
        if as_user {
            c.uid(4321).gid(4322);
        }
        let out = c.output().expect("rext4 mkfs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = e2fsck_fn(&img);
        assert!(r.clean, "{}", r.output);
        (
            owner_of(&debugfs_stat(&img, "/")),
            owner_of(&debugfs_stat(&img, "/lost+found")),
        )
    };
    assert_eq!(mk("user.img", true, &[]), ((4321, 4322), (0, 0)));
    assert_eq!(mk("root.img", false, &[]), ((0, 0), (0, 0)));
    assert_eq!(
        mk("rootown.img", false, &["-E", "root_owner"]),
        ((0, 0), (0, 0))
    );
    assert_eq!(
        mk("user0.img", true, &["-E", "root_owner=0:0"]),
        ((0, 0), (0, 0))
    );
    // The user can write to it through the API as themselves: mkdir in /.
    let img = d.join("user.img");
    let out = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .arg("mkdir")
        .arg(format!("{}:/mine", img.display()))
        .uid(4321)
        .gid(4322)
        .output()
        .expect("mkdir");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn same_dumpe2fs_as_mkfs_ext4() {
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        return skip("mkfs.ext4 not installed");
    }
    for size in ["4M", "64M", "1G", "64G"] {
        compare(size, &[]);
    }
    compare("64M", &["-b", "4096", "-N", "5000", "-L", "label"]);
    compare("64M", &["-O", "mmp"]);
    compare_with("16M", &["-O", "mmp"], ",mmp_update_interval=1");
    // `rext4 mkfs -O ea_inode`: the feature as mke2fs sets it.
    compare("64M", &["-O", "ea_inode"]);
    // `rext4 mkfs -O inline_data`: lost+found one block smaller, as mke2fs makes it.
    compare("64M", &["-O", "inline_data"]);
}

/// `rext4 mkfs -t ext2|ext3` against `mkfs.ext4 -t ext2|ext3`, and `rext4 info` in
/// dumpe2fs -h's words on them.
#[test]
fn same_dumpe2fs_as_mke2fs_for_ext2_and_ext3() {
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        return skip("mkfs.ext4 not installed");
    }
    for t in ["ext2", "ext3"] {
        for size in ["4M", "64M", "1G"] {
            let d = compare_with(size, &["-t", t], "");
            let img = d.join("ours.img");
            let info = Command::new(env!("CARGO_BIN_EXE_rext4"))
                .arg("info")
                .arg(&img)
                .env("TZ", "UTC")
                .output()
                .expect("rext4 info");
            assert!(info.status.success());
            let info = String::from_utf8_lossy(&info.stdout).into_owned();
            let head = Command::new("dumpe2fs")
                .arg("-h")
                .arg(&img)
                .env("TZ", "UTC")
                .output()
                .expect("dumpe2fs -h");
            let head = String::from_utf8_lossy(&head.stdout).into_owned();
            for l in info.lines().filter(|l| !l.trim().is_empty()) {
                assert!(
                    head.lines().any(|h| h == l),
                    "{t} {size}: rext4 info says {l:?}, dumpe2fs -h does not:\n{head}"
                );
            }
            let want = if t == "ext3" {
                "has_journal ext_attr resize_inode dir_index filetype sparse_super large_file"
            } else {
                "ext_attr resize_inode dir_index filetype sparse_super large_file"
            };
            assert!(
                info.lines()
                    .any(|l| l == format!("Filesystem features:      {want}")),
                "{t}: {info}"
            );
        }
    }
}
