//! `rext4 mkfs` against `mkfs.ext4` through the command line: same UUID, hash seed and
//! creation time give the same `dumpe2fs` output (full, with every group), except the
//! two fields that must differ: "Lifetime writes" (mke2fs counts what its own write
//! cache flushed) and the superblock "Checksum" (it covers that field).

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
        .map(str::to_string)
        .collect()
}

fn compare(size: &str, extra: &[&str]) {
    let d = TempDir::new("mkfs-cli").expect("tempdir");
    let ours = d.join("ours.img");
    let theirs = d.join("theirs.img");
    let st = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args(["mkfs", "-q", "-U", UUID, "-E", &format!("hash_seed={SEED}")])
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
        .args(["-q", "-F", "-U", UUID, "-E", &format!("hash_seed={SEED}")])
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
}
