//! Image specs at the command line: `rext4 info DISK` lists a partitioned disk's
//! partitions and which hold ext4; `DISK?partition=N:/path` works for the reading and
//! writing commands and for the mount; a bad spec field is an error naming it.
//!
//! qcow2 images at the command line: `rext4 mkfs` onto an image `qemu-img create`
//! made, writes through the CLI and the mount (v2, v3, an overlay over a backing
//! file), then `qemu-img check` clean, the exported guest disk e2fsck-clean and, as
//! root, what the kernel sees in it; `rext4 trim`, `fstrim` on the mount and `-o
//! discard` give a qcow2 file's space back.

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

/// Bytes the host allocated for `p` (what `du` shows).
fn allocated(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).expect("stat").blocks() * 512
}

/// Write `len` bytes of zeros (as data, not holes) to `path` in 1 MiB writes.
fn write_zeros(path: &Path, len: u64) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).expect("create");
    let chunk = vec![0u8; MIB as usize];
    for _ in 0..len / MIB {
        f.write_all(&chunk).expect("write");
    }
    f.sync_all().expect("fsync");
}

fn mkfs_2g(path: &Path) {
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096"])
        .arg(path)
        .arg("2G")
        .output()
        .expect("mkfs.ext4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// After writing and deleting 1 GiB on a 2 GiB image file, `fstrim` on the mount and
/// `rext4 trim` each bring the file's allocated size back within 5% of what a fresh
/// copy of the same tree needs; so does the `discard` mount option as files go.
/// Before trim support, `fstrim` answered "the discard operation is not supported"
/// and the image file kept the 1 GiB.
#[test]
fn trim_gives_space_back() {
    if let Some(why) = cannot_mount() {
        return skip(&format!("trim through the mount: {why}"));
    }
    let dir = TempDir::new("trim").expect("tmp");
    let kept: Vec<u8> = (0..(4 * MIB) as usize)
        .map(|i| (i * 31 % 253) as u8)
        .collect();
    let kept_src = dir.join("kept");
    std::fs::write(&kept_src, &kept).expect("kept");
    // What a fresh copy of the tree (one 4 MiB file) needs.
    let fresh = dir.join("fresh.img");
    mkfs_2g(&fresh);
    let r = rext4(&[
        "cp".to_string(),
        kept_src.display().to_string(),
        arg(&fresh, ":/kept"),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let want = allocated(&fresh);

    let img = dir.join("img");
    mkfs_2g(&img);
    let check = |label: &str| {
        let have = allocated(&img);
        eprintln!("[{label}] allocated {have} bytes, a fresh copy {want}");
        assert!(
            have as f64 <= want as f64 * 1.05,
            "[{label}] the image file holds {have} bytes, a fresh copy {want}"
        );
        let fsck = e2fsck_fn(&img);
        assert!(fsck.clean, "[{label}] {}", fsck.output);
        let r = rext4(&["cat".to_string(), arg(&img, ":/kept")]);
        assert!(r.stdout == kept, "[{label}] kept file differs");
    };

    // Written and deleted through the mount, then `rext4 trim` of the image.
    let mut m = Mounted::new(&img, &[]);
    std::fs::write(m.join("kept"), &kept).expect("kept");
    write_zeros(&m.join("big"), 1 << 30);
    std::fs::remove_file(m.join("big")).expect("rm");
    assert!(m.unmount().success(), "{}", m.stderr());
    assert!(
        allocated(&img) > want + (900 * MIB),
        "the write did not reach the image"
    );
    let r = rext4(&["trim".to_string(), "-v".into(), arg(&img, "")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout_str().contains("trimmed"), "{}", r.stdout_str());
    check("rext4 trim");

    // fstrim on the mount.
    let mut m = Mounted::new(&img, &[]);
    let free = free_bytes(m.path());
    write_zeros(&m.join("big"), 1 << 30);
    std::fs::remove_file(m.join("big")).expect("rm");
    wait_until_freed(m.path(), free);
    let out = Command::new("fstrim").arg("-v").arg(m.path()).output();
    match out {
        Ok(o) => assert!(
            o.status.success(),
            "fstrim: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            m.unmount();
            return skip(&format!("fstrim: {e}"));
        }
    }
    assert!(m.unmount().success(), "{}", m.stderr());
    check("fstrim");

    // -o discard: freed blocks go back as their transaction commits.
    let mut m = Mounted::new(&img, &["discard"]);
    write_zeros(&m.join("big"), 256 * MIB);
    std::fs::remove_file(m.join("big")).expect("rm");
    assert!(m.unmount().success(), "{}", m.stderr());
    check("mount -o discard");
}

/// `qemu-img ARGS`; `None` (skipped) without qemu-img.
fn qemu_img(args: &[&str]) -> Option<()> {
    match Command::new("qemu-img").args(args).output() {
        Ok(o) if o.status.success() => Some(()),
        Ok(o) => panic!("qemu-img {args:?}: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            skip(&format!("qemu-img: {e}"));
            None
        }
    }
}

/// `qemu-img check` of a qcow2 image: clean (exit 0, "No errors") or the output.
fn assert_qemu_clean(q: &Path, label: &str) {
    let o = Command::new("qemu-img")
        .arg("check")
        .arg(q)
        .output()
        .expect("qemu-img check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.code() == Some(0) && text.contains("No errors were found"),
        "[{label}] qemu-img check exit {:?}:\n{text}",
        o.status.code()
    );
}

/// The guest disk of `q`, exported raw by qemu-img.
fn export(q: &Path, raw: &Path) {
    let _ = std::fs::remove_file(raw);
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        &q.display().to_string(),
        &raw.display().to_string(),
    ])
    .expect("qemu-img");
}

/// qcow2 images (v3, v2, and an overlay over a backing file) written through the CLI
/// (mkfs onto the qemu-img-made image, mkdir, cp) and the mount: qemu-img check is
/// clean after each, the exported guest disk is e2fsck -fn clean, rext4 reads back
/// what was written and (as root) so does the kernel from the export; the backing
/// file is unchanged.
#[test]
fn qcow2_written_through_cli_and_mount() {
    let dir = TempDir::new("qcow2cli").expect("tmp");
    let d = |n: &str| dir.join(n);
    let s = |n: &str| d(n).display().to_string();
    let payload: Vec<u8> = (0..(3 * MIB) as usize).map(|i| (i % 251) as u8).collect();
    std::fs::write(d("payload"), &payload).expect("payload");
    if qemu_img(&["create", "-q", "-f", "qcow2", &s("v3.qcow2"), "128M"]).is_none() {
        return;
    }
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        &s("v2.qcow2"),
        "128M",
    ]);
    // The backing file: made by rext4 mkfs too, with a file in it.
    qemu_img(&["create", "-q", "-f", "qcow2", &s("backing.qcow2"), "128M"]);
    for name in ["v3.qcow2", "v2.qcow2", "backing.qcow2"] {
        let r = rext4(&["mkfs", "-q", "-L", "q", &s(name)]);
        assert_eq!(r.code, 0, "[{name}] mkfs: {}", r.stderr);
        assert_qemu_clean(&d(name), &format!("{name} after mkfs"));
    }
    let r = rext4(&[
        "cp".to_string(),
        s("payload"),
        format!("{}:/from-backing", s("backing.qcow2")),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "backing.qcow2",
        "-F",
        "qcow2",
        &s("over.qcow2"),
    ]);
    let backing = std::fs::read(d("backing.qcow2")).expect("read backing");
    for name in ["v3.qcow2", "v2.qcow2", "over.qcow2"] {
        let q = d(name);
        let img = |p: &str| format!("{}:{p}", q.display());
        let r = rext4(&["mkdir".to_string(), img("/cli")]);
        assert_eq!(r.code, 0, "[{name}] mkdir: {}", r.stderr);
        let r = rext4(&["cp".to_string(), s("payload"), img("/cli/payload")]);
        assert_eq!(r.code, 0, "[{name}] cp: {}", r.stderr);
        assert_qemu_clean(&q, &format!("{name} after cp"));
        if cannot_mount().is_none() {
            let mut m = Mounted::new(&q, &[]);
            std::fs::create_dir(m.join("mnt")).expect("mkdir via mount");
            std::fs::write(m.join("mnt/f"), &payload[..MIB as usize]).expect("write");
            std::fs::write(m.join("mnt/small"), b"through the mount\n").expect("write");
            assert!(m.unmount().success(), "[{name}] {}", m.stderr());
            assert_qemu_clean(&q, &format!("{name} after the mount"));
            let r = rext4(&["cat".to_string(), img("/mnt/small")]);
            assert_eq!(r.stdout, b"through the mount\n", "{}", r.stderr);
        }
        let r = rext4(&["cat".to_string(), img("/cli/payload")]);
        assert!(r.stdout == payload, "[{name}] {}", r.stderr);
        let raw = d("export.raw");
        export(&q, &raw);
        let fsck = e2fsck_fn(&raw);
        assert!(fsck.clean, "[{name}] {}", fsck.output);
        match rext4_testkit::LoopMount::new(&raw, true, "noatime") {
            Ok(m) => {
                let got = std::fs::read(m.path().join("cli/payload")).expect("kernel read");
                assert!(got == payload, "[{name}] the kernel reads other bytes");
                if name == "over.qcow2" {
                    let got = std::fs::read(m.path().join("from-backing")).expect("read");
                    assert!(got == payload, "the backing file's file");
                }
                m.unmount().expect("unmount");
            }
            Err(e) => skip(&format!("kernel loop mount of the export: {e}")),
        }
    }
    assert!(
        std::fs::read(d("backing.qcow2")).expect("read backing") == backing,
        "the backing file changed"
    );
}

/// After writing and deleting 1 GiB on a 2 GiB qcow2 image, `rext4 trim` and `fstrim`
/// on the mount each bring the qcow2 file's allocated size within 5% of what a fresh
/// qcow2 image with the same tree needs; so does `-o discard` as files go;
/// qemu-img check clean each time. Before qcow2 discard, the file kept the 1 GiB.
#[test]
fn qcow2_trim_gives_space_back() {
    if let Some(why) = cannot_mount() {
        return skip(&format!("qcow2 trim through the mount: {why}"));
    }
    let dir = TempDir::new("qtrim").expect("tmp");
    let kept: Vec<u8> = (0..(4 * MIB) as usize)
        .map(|i| (i * 31 % 253) as u8)
        .collect();
    let kept_src = dir.join("kept");
    std::fs::write(&kept_src, &kept).expect("kept");
    let make = |name: &str| {
        let q = dir.join(name);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            &q.display().to_string(),
            "2G",
        ])?;
        let r = rext4(&[
            "mkfs".to_string(),
            "-q".into(),
            "-b".into(),
            "4096".into(),
            q.display().to_string(),
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        Some(q)
    };
    let Some(fresh) = make("fresh.qcow2") else {
        return;
    };
    let r = rext4(&[
        "cp".to_string(),
        kept_src.display().to_string(),
        arg(&fresh, ":/kept"),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let want = allocated(&fresh);
    let Some(img) = make("img.qcow2") else { return };
    let check = |label: &str| {
        let have = allocated(&img);
        eprintln!("[{label}] allocated {have} bytes, a fresh copy {want}");
        assert!(
            have as f64 <= want as f64 * 1.05,
            "[{label}] the qcow2 file holds {have} bytes, a fresh copy {want}"
        );
        assert_qemu_clean(&img, label);
        let r = rext4(&["cat".to_string(), arg(&img, ":/kept")]);
        assert!(r.stdout == kept, "[{label}] kept file differs");
    };

    let mut m = Mounted::new(&img, &[]);
    std::fs::write(m.join("kept"), &kept).expect("kept");
    write_zeros(&m.join("big"), 1 << 30);
    std::fs::remove_file(m.join("big")).expect("rm");
    assert!(m.unmount().success(), "{}", m.stderr());
    assert!(
        allocated(&img) > want + (900 * MIB),
        "the write did not reach the image"
    );
    let r = rext4(&["trim".to_string(), "-v".into(), arg(&img, "")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    check("rext4 trim");

    let mut m = Mounted::new(&img, &[]);
    let free = free_bytes(m.path());
    write_zeros(&m.join("big"), 1 << 30);
    std::fs::remove_file(m.join("big")).expect("rm");
    wait_until_freed(m.path(), free);
    let out = Command::new("fstrim").arg("-v").arg(m.path()).output();
    match out {
        Ok(o) => assert!(
            o.status.success(),
            "fstrim: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            m.unmount();
            return skip(&format!("fstrim: {e}"));
        }
    }
    // Given back while still mounted (the trim flushes the image).
    let have = allocated(&img);
    assert!(
        have as f64 <= want as f64 * 1.05,
        "after fstrim, still mounted: {have} bytes, a fresh copy {want}"
    );
    assert!(m.unmount().success(), "{}", m.stderr());
    check("fstrim");

    let mut m = Mounted::new(&img, &["discard"]);
    write_zeros(&m.join("big"), 256 * MIB);
    std::fs::remove_file(m.join("big")).expect("rm");
    assert!(m.unmount().success(), "{}", m.stderr());
    check("mount -o discard");
    let raw = dir.join("export.raw");
    export(&img, &raw);
    let fsck = e2fsck_fn(&raw);
    assert!(fsck.clean, "{}", fsck.output);
}

/// `rext4 mkfs DISK?partition=1` formats that partition only: e2fsck finds it clean
/// at the partition's offset, the other partition's filesystem is untouched, and a
/// bad spec over an existing disk is an error (no file made of its name).
#[test]
fn mkfs_onto_a_partition() {
    let dir = TempDir::new("diskmkfs").expect("tmp");
    let Some(disk) = gpt_disk(&dir) else { return };
    let before = std::fs::read(&disk).expect("read");
    let r = rext4(&["mkfs".to_string(), "-q".into(), arg(&disk, "?partition=1")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let fsck = e2fsck_fn(Path::new(&arg(&disk, &format!("?offset={MIB}"))));
    assert!(fsck.clean, "{}", fsck.output);
    let after = std::fs::read(&disk).expect("read");
    assert!(
        after[9 * MIB as usize..] == before[9 * MIB as usize..],
        "partition 2 changed"
    );
    assert!(
        after[..MIB as usize] == before[..MIB as usize],
        "the table changed"
    );
    let r = rext4(&["info".to_string(), arg(&disk, "?partition=1")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = rext4(&["mkfs".to_string(), "-q".into(), arg(&disk, "?partiton=1")]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("unknown field 'partiton'"),
        "{}",
        r.stderr
    );
    assert!(!Path::new(&arg(&disk, "?partiton=1")).exists());
}

/// statvfs's f_bfree of `p` in bytes (0 when it fails).
fn free_bytes(p: &Path) -> u64 {
    fuse_mount::statvfs(p).map_or(0, |st| st.f_bfree * st.f_frsize)
}

/// Wait (up to 30 s) until the mount at `p` has `free` bytes free again (less 1 MiB).
/// A file removed right after its close is freed when the kernel's RELEASE of its
/// last handle arrives, which FUSE sends after close returns: until then it is an
/// open, unlinked file whose blocks are in use, on rext4 as on any filesystem, and
/// fstrim rightly leaves them alone.
fn wait_until_freed(p: &Path, free: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while free_bytes(p) + MIB < free {
        assert!(
            std::time::Instant::now() < deadline,
            "the removed file's space was not freed within 30 s ({} of {free} bytes free)",
            free_bytes(p)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
