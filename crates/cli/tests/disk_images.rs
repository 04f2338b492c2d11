//! Image specs at the command line: `rext4 info DISK` lists a partitioned disk's
//! partitions and which hold ext4; `DISK?partition=N:/path` works for the reading and
//! writing commands and for the mount; a bad spec field is an error naming it.

mod common;
mod fuse_mount;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::rext4;
use fuse_mount::{cannot_mount, Mounted};
use rext4_testkit::{e2fsck_fn, skip, TempDir};

const MIB: u64 = 1 << 20;

/// A 64 MiB GPT disk: partition 1 (8 MiB, no filesystem), partition 2 (48 MiB, ext4
/// labelled "data"). `None` (skipped) without sfdisk.
fn gpt_disk(dir: &TempDir) -> Option<PathBuf> {
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(64 * MIB))
        .expect("disk");
    let mut child = match Command::new("sfdisk")
        .args(["-q", "--no-reread", "--no-tell-kernel"])
        .arg(&disk)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            skip(&format!("sfdisk: {e}"));
            return None;
        }
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"label: gpt\nsize=8M, type=L, name=boot\nsize=48M, type=L\n")
        .expect("script");
    assert!(child.wait().expect("sfdisk").success());
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "data", "-E"])
        .arg(format!("offset={}", 9 * MIB))
        .arg(&disk)
        .arg(format!("{}k", 48 * 1024))
        .output()
        .expect("mkfs.ext4");
    assert!(out.status.success());
    Some(disk)
}

fn arg(disk: &Path, rest: &str) -> String {
    format!("{}{rest}", disk.display())
}

#[test]
fn info_lists_partitions_and_commands_take_specs() {
    let dir = TempDir::new("diskcli").expect("tmp");
    let Some(disk) = gpt_disk(&dir) else { return };
    let r = rext4(&["info".to_string(), arg(&disk, "")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = r.stdout_str();
    assert!(out.contains("Partition table: GPT"), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let p1 = lines.iter().find(|l| l.starts_with("1 ")).expect("row 1");
    let p2 = lines.iter().find(|l| l.starts_with("2 ")).expect("row 2");
    assert!(
        p1.contains("1048576") && p1.contains("boot") && p1.ends_with('-'),
        "{p1}"
    );
    assert!(
        p2.contains(&(9 * MIB).to_string())
            && p2.contains(&(48 * MIB).to_string())
            && p2.contains("ext4 \"data\"")
            && p2.contains("?partition=2"),
        "{p2}"
    );
    // info of the partition is the superblock, as for a plain image.
    let r = rext4(&["info".to_string(), arg(&disk, "?partition=2")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout_str().contains("Filesystem volume name:   data"));

    // Writing commands through the spec, then reading back.
    let src = dir.join("hello");
    std::fs::write(&src, b"hello, partition\n").expect("src");
    let r = rext4(&["mkdir".to_string(), arg(&disk, "?partition=2:/d")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = rext4(&[
        "cp".to_string(),
        src.display().to_string(),
        arg(&disk, "?partition=2:/d/"),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = rext4(&["cat".to_string(), arg(&disk, "?partition=2:/d/hello")]);
    assert_eq!(r.stdout, b"hello, partition\n", "{}", r.stderr);
    let fsck = e2fsck_fn(Path::new(&arg(&disk, &format!("?offset={}", 9 * MIB))));
    assert!(fsck.clean, "{}", fsck.output);

    // A whole disk is no ext4: the message says what to open.
    let r = rext4(&["ls".to_string(), arg(&disk, ":/")]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("open one as IMAGE?partition=N"),
        "{}",
        r.stderr
    );
    // Bad fields are named.
    let r = rext4(&["ls".to_string(), arg(&disk, "?partition=9:/")]);
    assert!(
        r.stderr
            .contains("partition 9 does not exist (the GPT has 2: 1, 2)"),
        "{}",
        r.stderr
    );
    let r = rext4(&["ls".to_string(), arg(&disk, "?offset=4097:/")]);
    assert!(
        r.stderr.contains("offset 4097 is not a multiple of 512"),
        "{}",
        r.stderr
    );
    let r = rext4(&["ls".to_string(), arg(&disk, "?part=2:/")]);
    assert!(r.stderr.contains("unknown field 'part'"), "{}", r.stderr);
}

#[test]
fn mount_a_partition() {
    if let Some(why) = cannot_mount() {
        return skip(&format!("mount of a partition: {why}"));
    }
    let dir = TempDir::new("diskcli").expect("tmp");
    let Some(disk) = gpt_disk(&dir) else { return };
    let before_p1 = {
        let b = std::fs::read(&disk).expect("read");
        b[MIB as usize..9 * MIB as usize].to_vec()
    };
    let spec = arg(&disk, "?partition=2");
    let mut m = Mounted::new(Path::new(&spec), &[]);
    std::fs::create_dir(m.join("via-mount")).expect("mkdir");
    let data = vec![0x5au8; 3 * MIB as usize];
    std::fs::write(m.join("via-mount/f"), &data).expect("write");
    assert!(m.unmount().success(), "{}", m.stderr());
    let r = rext4(&["cat".to_string(), arg(&disk, "?partition=2:/via-mount/f")]);
    assert!(r.stdout == data, "{}", r.stderr);
    let fsck = e2fsck_fn(Path::new(&arg(&disk, &format!("?offset={}", 9 * MIB))));
    assert!(fsck.clean, "{}", fsck.output);
    let b = std::fs::read(&disk).expect("read");
    assert!(
        b[MIB as usize..9 * MIB as usize] == before_p1[..],
        "partition 1 changed"
    );
}
